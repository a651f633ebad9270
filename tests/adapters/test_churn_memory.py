"""What adapter churn must leave behind: nothing. The leaks the churn soak found (bench/README.md, "Memory under
adapter churn"), each checked by the state that must be empty, counted, never timed:

- an adapter's failure is kept once and reported to every request for it; raising that one instance linked each
  raise's frames into its ``__traceback__``, so every failed request (its prompt, queue, generators) stayed alive;
- the prefix cache kept the K/V blocks of an unloaded adapter registration, unreachable, until the budget evicted
  them: under churn the pool filled to its whole budget;
- the C heap: glibc's dynamic mmap threshold had risen past most tensors, whose freed holes stayed in the heap
  (``service.heap`` pins it; a test can only check that it is set).
"""

from __future__ import annotations

import gc
from pathlib import Path

import grpc
import pytest
import torch
from loraplex.v1 import adapters_pb2 as apb
from loraplex.v1 import adapters_pb2_grpc as apb_grpc
from loraplex.v1 import generation_pb2_grpc as pb_grpc
from support.adapter_files import write_peft_adapter
from support.engines import prompt, req
from support.servers import text_req, tiny_settings

from service.adapters.catalog import AdapterCatalog
from service.adapters.lora.part import LoraPart
from service.adapters.lora.reader import DEVICE_ALIGN
from service.adapters.lora.registry import index_adapter
from service.adapters.lora.spec import plan_nbytes
from service.adapters.lora.store import AdapterStore
from service.adapters.medusa.part import MedusaPart
from service.adapters.medusa.registry import MedusaRegistry
from service.api.server import BackgroundServer
from service.config import Settings
from service.engine.engine import Engine
from service.engine.request import FinishReason, GenerationRequest, TokenEvent
from service.errors import ResourceExhausted
from service.frontend import raise_if_failed
from service.heap import MMAP_THRESHOLD_BYTES, fix_mmap_threshold
from service.model.load_folder import load_model
from service.tokenizer import Tokenizer

CPU = torch.device("cpu")


def alive_requests() -> int:
    gc.collect()
    return sum(type(o) is GenerationRequest for o in gc.get_objects())


@pytest.fixture(scope="module")
def root(served_tiny_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("churn")
    write_peft_adapter(folder / "big", served_tiny_dir, r=8, target_modules="all-linear", seed=3)
    write_peft_adapter(folder / "small", served_tiny_dir, r=2, seed=4)
    return folder


def test_a_kept_failure_reported_to_many_requests_keeps_none_of_them_alive(served_tiny_dir: Path, root: Path) -> None:
    cfg = load_model(served_tiny_dir, dtype=torch.float32, device=CPU)[1]
    too_big = plan_nbytes(index_adapter("big", root / "big", cfg), torch.float32, DEVICE_ALIGN)
    settings = tiny_settings(served_tiny_dir, adapter_dirs=(root,), adapter_device_budget_bytes=too_big // 2)
    with BackgroundServer(settings) as srv, grpc.insecure_channel(srv.target) as channel:
        stub = pb_grpc.GenerationStub(channel)
        store = srv.server.runtime.loaded.adapters.kind(LoraPart).store  # type: ignore[union-attr]

        def fail(n: int) -> None:
            for _ in range(n):
                with pytest.raises(grpc.RpcError) as err:
                    stub.Generate(text_req("hi", 2, adapter_id="big"), timeout=30)
                assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED

        fail(3)
        after_few = alive_requests()
        fail(30)
        kept = store.failure("big")
        assert isinstance(kept, ResourceExhausted)
        assert kept.__traceback__ is None and kept.__context__ is None  # the kept instance was never raised
        assert alive_requests() <= after_few  # before: one more request, queue and generator per failed call


def test_the_edge_raises_a_fresh_copy_of_a_shared_error() -> None:
    shared = ResourceExhausted("adapter 'big' needs more than the whole budget")
    event = _event(shared)
    raised = []
    for _ in range(3):
        with pytest.raises(ResourceExhausted) as err:
            raise_if_failed(event)
        raised.append(err.value)
    assert shared.__traceback__ is None
    assert len({id(e) for e in raised}) == 3
    assert all(str(e) == str(shared) and e.status == shared.status for e in raised)


def _event(error: BaseException) -> TokenEvent:
    return TokenEvent((), "", finish=FinishReason.ERROR, error=error)


def _engine(served_tiny_dir: Path, root: Path) -> tuple[Engine, AdapterCatalog]:
    model, cfg, _ = load_model(served_tiny_dir, dtype=torch.float32, device=CPU)
    store = AdapterStore(cfg, device=CPU, dtype=torch.float32, device_budget_bytes=1 << 30, host_budget_bytes=0)
    catalog = AdapterCatalog([MedusaPart(MedusaRegistry(cfg, device=CPU, dtype=torch.float32)), LoraPart(store)])
    settings = Settings(model=served_tiny_dir, dtype="float32", max_batch_size=4, max_total_tokens=256,
                        prefix_block_tokens=8)  # fmt: skip
    return Engine(model, Tokenizer.from_folder(served_tiny_dir), settings, adapters=catalog), catalog


def _run(engine: Engine, request: GenerationRequest) -> None:
    events: list[object] = []
    engine.submit(request, events.append)
    for _ in range(200):
        engine.step()
        if events and getattr(events[-1], "finish", None) is not None:
            return
    raise AssertionError("the request did not finish")


def test_an_unloaded_adapters_prefix_blocks_are_dropped_and_their_pool_rows_reused(
    served_tiny_dir: Path, root: Path
) -> None:
    engine, catalog = _engine(served_tiny_dir, root)
    prefix = engine.prefix
    try:
        words = prompt(21, 40)  # 5 blocks of 8 tokens
        _run(engine, req("base", words, n=2))
        base_blocks = prefix.blocks_by_key()
        n = base_blocks[None]  # the base model's blocks of the prompt
        assert set(base_blocks) == {None} and n >= 4 and prefix.touched_rows == n
        for round_ in range(5):  # churn: load, serve, unload the same adapter id
            catalog.register("small", root / "small")
            lora = catalog.kind(LoraPart)
            assert lora is not None
            lora.store.ensure("small", timeout=60)  # loaded on the store's thread: resident before the steps
            key = catalog.resolve("small").kv_key()
            _run(engine, req(f"small-{round_}", words, n=2, adapter_id="small"))
            assert prefix.blocks_by_key() == {None: n, key: n}
            catalog.unregister("small")
            engine.step()  # the engine thread's step drops the registration's blocks
            assert prefix.blocks_by_key() == base_blocks, f"round {round_}: an unloaded registration still holds blocks"
            assert prefix.touched_rows == 2 * n  # each round reuses the rows the last one freed: the pool stays put
    finally:
        engine.stop()
        catalog.close()


def test_unloading_one_component_drops_the_prefix_blocks_of_every_mixture_and_scale_of_it(
    served_tiny_dir: Path, root: Path
) -> None:
    engine, catalog = _engine(served_tiny_dir, root)
    prefix = engine.prefix
    try:
        lora = catalog.kind(LoraPart)
        assert lora is not None
        for name in ("big", "small"):
            catalog.register(name, root / name)
            lora.store.ensure(name, timeout=60)
        words = prompt(22, 40)  # 5 blocks of 8 tokens
        mixes = {
            "mixed": (("big", 0.5), ("small", 0.5)),
            "scaled": (("small", 0.5),),
            "big-scaled": (("big", 0.5),),
        }
        for rid, mix in mixes.items():
            _run(engine, req(rid, words, n=2, adapter_id=mix[0][0], mix=mix))
        _run(engine, req("small", words, n=2, adapter_id="small"))
        _run(engine, req("big", words, n=2, adapter_id="big"))
        keys = {rid: catalog.resolve_mix(mix, limit=4).kv_key() for rid, mix in mixes.items()}
        big, small = catalog.resolve("big").kv_key(), catalog.resolve("small").kv_key()
        held = prefix.blocks_by_key()
        n = held[big]
        assert set(held) == {big, small, *keys.values()} and all(count == n for count in held.values())
        catalog.unregister("small")
        engine.step()  # the engine thread's step drops the blocks of every key built from the registration
        assert prefix.blocks_by_key() == {big: n, keys["big-scaled"]: n}
    finally:
        engine.stop()
        catalog.close()


def test_unloading_over_grpc_empties_the_registrations_bookkeeping(served_tiny_dir: Path, root: Path) -> None:
    settings = tiny_settings(served_tiny_dir, adapter_roots=(root,), prefix_block_tokens=8)
    with BackgroundServer(settings) as srv, grpc.insecure_channel(srv.target) as channel:
        stub, admin = pb_grpc.GenerationStub(channel), apb_grpc.AdaptersStub(channel)
        engine = srv.server.runtime.loaded.engine  # type: ignore[union-attr]
        long_prompt = "one two three four five six seven eight nine ten " * 4
        for _ in range(3):
            admin.LoadAdapter(apb.LoadAdapterRequest(id="small", source=str(root / "small")), timeout=30)
            stub.Generate(text_req(long_prompt, 2, adapter_id="small"), timeout=30)
            assert any(key is not None for key in engine.prefix.blocks_by_key())
            admin.UnloadAdapter(apb.UnloadAdapterRequest(id="small"), timeout=30)
            stub.Generate(text_req("a base request: the engine takes a step", 2), timeout=30)
            assert [key for key in engine.prefix.blocks_by_key() if key is not None] == []
            store = srv.server.runtime.loaded.adapters.kind(LoraPart).store  # type: ignore[union-attr]
            state = store.state()
            assert state.adapters == {} and state.device_bytes == state.host_bytes == 0
            assert state.device_lru == state.host_lru == state.queued == ()


def test_the_mmap_threshold_is_pinned_unless_the_environment_chose() -> None:
    assert fix_mmap_threshold(env={"MALLOC_MMAP_THRESHOLD_": "131072"}) == "environment"
    assert fix_mmap_threshold(MMAP_THRESHOLD_BYTES, env={}) in ("set", "unsupported")  # "set" on glibc
