"""What adapter churn must leave behind: nothing. The leak the churn soak found (bench/README.md, "Memory under
adapter churn"), checked by the state that must be empty, counted, never timed:

- an adapter's failure is kept once and reported to every request for it; raising that one instance linked each
  raise's frames into its ``__traceback__``, so every failed request (its prompt, queue, generators) stayed alive;
"""

from __future__ import annotations

import gc
from pathlib import Path

import grpc
import pytest
import torch
from adapter_files import write_peft_adapter
from helpers import text_req, tiny_settings
from loraplex.v1 import generation_pb2_grpc as pb_grpc

from service.adapters.reader import DEVICE_ALIGN
from service.adapters.registry import index_adapter
from service.adapters.spec import plan_nbytes
from service.api.generation import _raise_if_failed
from service.api.server import BackgroundServer
from service.engine.request import FinishReason, GenerationRequest, TokenEvent
from service.errors import ResourceExhausted
from service.model.weights import load_model

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
        store = srv.server.runtime.loaded.adapters.store  # type: ignore[union-attr]

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
            _raise_if_failed(event)
        raised.append(err.value)
    assert shared.__traceback__ is None
    assert len({id(e) for e in raised}) == 3 and all(
        str(e) == str(shared) and e.status == shared.status for e in raised
    )


def _event(error: BaseException) -> TokenEvent:
    return TokenEvent((), "", finish=FinishReason.ERROR, error=error)
