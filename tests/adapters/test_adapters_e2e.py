"""Adapters end to end over real gRPC: mixed batches vs peft, admin API, bad adapters, eviction under budget."""

from __future__ import annotations

import json
import shutil
import threading
from pathlib import Path
from typing import Any

import grpc
import pytest
import torch
from loraplex import AlreadyExists, Client, FailedPrecondition, InvalidArgument, NotFound, PermissionDenied
from support.adapter_files import load_peft_model, reference_greedy, write_peft_adapter, write_peft_adapters
from support.servers import tiny_settings

from service.adapters.lora.part import LoraPart
from service.api.server import BackgroundServer

# Four adapters that differ in every way the math cares about, plus base-only rows.
ADAPTERS: dict[str, dict[str, Any]] = {
    "qv-r4": {"r": 4, "alpha": 8, "target_modules": ("q_proj", "v_proj"), "seed": 1},
    "all-r8": {
        "r": 8,
        "alpha": 32,
        "target_modules": ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"),
        "seed": 2,
    },
    "mlp-r16-rslora": {"r": 16, "alpha": 16, "rslora": True, "target_modules": ("gate_proj", "down_proj"), "seed": 3},
    "o-r2": {"r": 2, "alpha": 4, "target_modules": ("o_proj",), "seed": 4, "layers_to_transform": [1]},
}
PROMPTS = [[5, 17, 300, 4000, 42], [7, 7, 7], [1000, 2000, 3000, 4000, 5000, 6000, 77], [9, 8, 7, 6]]
NEW_TOKENS = 16


@pytest.fixture(scope="module")
def adapter_root(tmp_path_factory: pytest.TempPathFactory, served_tiny_dir: Path) -> Path:
    root = tmp_path_factory.mktemp("adapters")
    write_peft_adapters(root, served_tiny_dir, ADAPTERS, scale=0.5)
    return root


LIMITS: dict[str, object] = {"max_batch_size": 16, "max_queue": 256, "max_new_tokens": 64, "max_total_tokens": 256}


@pytest.fixture(scope="module")
def server_settings(adapter_root: Path) -> dict[str, object]:
    return {**LIMITS, "adapter_roots": (adapter_root,), "adapter_dirs": (adapter_root,)}


def peft_greedy(base: Path, adapter: Path | None, prompt: list[int]) -> list[int]:
    from transformers import LlamaForCausalLM

    if adapter is None:
        model = LlamaForCausalLM.from_pretrained(base, dtype=torch.float32).eval()
    else:
        model = load_peft_model(base, {"a": adapter})
    return reference_greedy(model, prompt, NEW_TOKENS)


def generate_ids(client: Client, prompt: list[int], adapter: str | None) -> list[int]:
    # Raw token ids go through Tokenize's inverse: the tiny model shares SmolLM2's tokenizer, so decode the
    # prompt ids to text the tokenizer maps back to exactly these ids.
    text = client_tokenizer_text(client, prompt)
    result = client.generate(
        text, adapter=adapter, max_new_tokens=NEW_TOKENS, ignore_eos=True, return_token_ids=True, timeout=120
    )
    return list(result.token_ids)


_TEXT_CACHE: dict[tuple[int, ...], str] = {}


def client_tokenizer_text(client: Client, prompt: list[int]) -> str:
    key = tuple(prompt)
    if key not in _TEXT_CACHE:
        from service.tokenizer import Tokenizer

        tok = Tokenizer.from_folder(Path(client.model_info().model_path))
        text = tok.decode(prompt, skip_special_tokens=False)
        assert tok.encode(text) == prompt, "pick prompt ids that survive a decode/encode round trip"
        _TEXT_CACHE[key] = text
    return _TEXT_CACHE[key]


def test_startup_registers_the_adapter_dir_lazily(server: BackgroundServer) -> None:
    with Client(server.target, timeout=30) as client:
        listed = {a.id: a for a in client.list_adapters()}
        assert set(listed) == set(ADAPTERS)
        for info in listed.values():
            assert info.state.value in ("registered", "device")  # nothing is read before a request needs it
        assert listed["all-r8"].rank == 8 and listed["mlp-r16-rslora"].rank == 16


def test_mixed_batch_rows_match_peft_alone(server: BackgroundServer, served_tiny_dir: Path, adapter_root: Path) -> None:
    """Every row of one mixed batch (4 adapters, base-only rows) equals peft with that adapter alone."""
    jobs = [(a, p) for a in [*ADAPTERS, None] for p in PROMPTS[:2]]
    results: dict[int, list[int]] = {}
    with Client(server.target, timeout=120) as client:
        for prompt in PROMPTS:
            client_tokenizer_text(client, prompt)
        threads = [
            threading.Thread(target=lambda i=i, a=a, p=p: results.__setitem__(i, generate_ids(client, p, a)))
            for i, (a, p) in enumerate(jobs)
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
    for i, (adapter, prompt) in enumerate(jobs):
        expected = peft_greedy(served_tiny_dir, None if adapter is None else adapter_root / adapter, prompt)
        assert results[i] == expected, f"row {i} adapter={adapter}"
    base = [results[i] for i, (a, _) in enumerate(jobs) if a is None]
    assert all(results[i] != base[0] for i, (a, p) in enumerate(jobs) if a is not None and p == PROMPTS[0])


def test_admin_api_and_states(server: BackgroundServer, adapter_root: Path, tmp_path: Path) -> None:
    with Client(server.target, timeout=30) as client:
        generate_ids(client, PROMPTS[0], "qv-r4")
        info = client.get_adapter("qv-r4")
        assert info.state.value == "device" and info.device_bytes > 0 and info.hits >= 1
        assert info.load_latency.index_seconds > 0 and info.loads >= 1 and info.disk_reads == 1
        assert info.last_used is not None and info.registered_at is not None
        # A second id for the same folder, loaded and unloaded through the API.
        added = client.load_adapter("copy", adapter_root / "qv-r4")
        assert added.id == "copy" and added.state.value == "registered"
        assert generate_ids(client, PROMPTS[1], "copy") == generate_ids(client, PROMPTS[1], "qv-r4")
        with pytest.raises(AlreadyExists):
            client.load_adapter("copy", adapter_root / "qv-r4")
        used = client.get_adapter("copy")
        assert used.state.value == "device" and used.device_bytes > 0
        removed = client.unload_adapter("copy")  # says what happened, not the state it had before
        assert (removed.id, removed.state.value, removed.device_bytes, removed.host_bytes) == ("copy", "unloaded", 0, 0)
        assert removed.hits == used.hits and removed.source == used.source
        with pytest.raises(NotFound):
            client.get_adapter("copy")
        with pytest.raises(NotFound):
            client.generate("x", adapter="copy", max_new_tokens=2)


def _broken(root: Path, name: str, how: str) -> Path:
    folder = root / name
    shutil.copytree(root / "qv-r4", folder)
    cfg = folder / "adapter_config.json"
    weights = folder / "adapter_model.safetensors"
    if how == "no-config":
        cfg.unlink()
    elif how == "bad-json":
        cfg.write_text("{not json")
    elif how == "truncated":
        weights.write_bytes(weights.read_bytes()[:-100])
    elif how == "garbage":
        weights.write_bytes(b"\xff" * 64)
    elif how == "absent-module":
        raw = json.loads(cfg.read_text())
        raw["target_modules"] = ["q_proj", "v_proj", "no_such_proj"]
        cfg.write_text(json.dumps(raw))
    elif how == "shape":
        from safetensors.torch import load_file, save_file

        tensors = load_file(weights)
        key = next(k for k in tensors if "lora_A" in k)
        tensors[key] = torch.zeros(tensors[key].shape[0], tensors[key].shape[1] + 1)
        save_file(tensors, weights)
    elif how == "pickle":
        weights.unlink()
        (folder / "adapter_model.bin").write_bytes(b"not really a pickle")
    return folder


@pytest.mark.parametrize(
    ("how", "needle"),
    [
        ("no-config", "adapter_config.json"),
        ("bad-json", "adapter_config.json"),
        ("truncated", "adapter_model.safetensors"),
        ("garbage", "adapter_model.safetensors"),
        ("absent-module", "no_such_proj"),
        ("shape", "shape"),
        ("pickle", "safetensors"),
    ],
)
def test_bad_adapters_are_refused_and_the_server_keeps_serving(
    server: BackgroundServer, adapter_root: Path, how: str, needle: str
) -> None:
    folder = _broken(adapter_root, f"broken-{how}", how)
    with Client(server.target, timeout=30) as client:
        with pytest.raises(InvalidArgument) as err:
            client.load_adapter(f"broken-{how}", folder)
        assert needle in str(err.value)
        assert f"broken-{how}" not in {a.id for a in client.list_adapters()}
        assert len(generate_ids(client, PROMPTS[0], None)) == NEW_TOKENS


def test_a_nan_adapter_fails_its_requests_alone_over_grpc(server: BackgroundServer, adapter_root: Path) -> None:
    """A registered adapter whose lora_B is all NaN: its requests get INVALID_ARGUMENT naming file and tensor (it
    goes FAILED when its tensors are read); requests of other tenants running at the same time are unchanged."""
    from support.adapter_files import rewrite_adapter_tensors

    folder = adapter_root / "nan-b"
    if not folder.exists():
        shutil.copytree(adapter_root / "qv-r4", folder)
        nan = float("nan")
        rewrite_adapter_tensors(folder, lambda t: {k: v.fill_(nan) if "lora_B" in k else v for k, v in t.items()})
    with Client(server.target, timeout=60) as client:
        want = {a: generate_ids(client, PROMPTS[0], a) for a in (None, "qv-r4")}
        client.load_adapter("nan-b", folder)  # headers only: nothing to see yet
        got: dict[str | None, list[int]] = {}
        errors: list[BaseException] = []

        def other(adapter: str | None) -> None:
            got[adapter] = generate_ids(client, PROMPTS[0], adapter)

        threads = [threading.Thread(target=other, args=(a,)) for a in want]
        for t in threads:
            t.start()
        try:
            generate_ids(client, PROMPTS[1], "nan-b")
        except InvalidArgument as e:
            errors.append(e)
        for t in threads:
            t.join(60)
        assert len(errors) == 1 and "non-finite" in str(errors[0]) and "adapter_model.safetensors" in str(errors[0])
        assert "lora_B" in str(errors[0])
        error = errors[0]
        assert isinstance(error, InvalidArgument) and error.reason == "NON_FINITE_TENSOR"  # the ErrorInfo says it too
        assert error.details["file"].endswith("nan-b/adapter_model.safetensors")
        assert "lora_B" in error.details["tensor"]
        assert client.get_adapter("nan-b").state.value == "failed"
        assert got == want
        client.unload_adapter("nan-b")


def test_paths_outside_the_roots_and_bad_ids(server: BackgroundServer, adapter_root: Path, tmp_path: Path) -> None:
    outside = tmp_path / "outside"
    shutil.copytree(adapter_root / "qv-r4", outside)
    link = adapter_root / "escape"
    link.symlink_to(outside, target_is_directory=True)
    with Client(server.target, timeout=30) as client:
        for source in (outside, adapter_root / ".." / outside.parent.name / "outside", link):
            with pytest.raises(PermissionDenied):
                client.load_adapter("sneaky", source)
        with pytest.raises(InvalidArgument, match="invalid adapter id"):
            client.load_adapter("../etc", adapter_root / "qv-r4")
        with pytest.raises(NotFound):
            client.get_adapter("never-registered")
        with pytest.raises(NotFound, match="does not exist"):  # a missing folder inside the root
            client.load_adapter("missing", adapter_root / "no-such-folder")


def test_unload_while_running_is_refused_until_it_finishes(server: BackgroundServer) -> None:
    with Client(server.target, timeout=60) as client:
        text = client_tokenizer_text(client, PROMPTS[0])
        stream = client.stream(text, adapter="o-r2", max_new_tokens=60, ignore_eos=True)
        next(stream)
        with pytest.raises(FailedPrecondition, match="o-r2"):
            client.unload_adapter("o-r2")
        assert list(stream)[-1].finish_reason is not None
        assert client.get_adapter("o-r2").id == "o-r2"  # still registered, still usable
        assert len(generate_ids(client, PROMPTS[0], "o-r2")) == NEW_TOKENS


def test_eviction_under_a_tiny_budget_keeps_outputs_right(served_tiny_dir: Path, tmp_path: Path) -> None:
    """32 adapters cycling through a device tier that holds ~3 of them: outputs stay right, memory stays in budget."""
    root = tmp_path / "many"
    from transformers import LlamaForCausalLM

    base = LlamaForCausalLM.from_pretrained(served_tiny_dir, dtype=torch.float32).eval()
    for i in range(32):
        write_peft_adapter(root / f"a{i:02d}", base, r=4 + (i % 3) * 2, alpha=8, seed=100 + i, scale=0.5)
    one = (root / "a00" / "adapter_model.safetensors").stat().st_size
    settings = tiny_settings(
        served_tiny_dir,
        LIMITS,
        adapter_roots=(root,),
        adapter_dirs=(root,),
        adapter_device_budget_bytes=3 * one + 4096,
        adapter_host_budget_bytes=6 * one,
        max_batch_size=4,
    )
    expected: dict[str, list[int]] = {}
    with BackgroundServer(settings) as srv, Client(srv.target, timeout=120) as client:
        store = srv.server.runtime.loaded.adapters.kind(LoraPart).store  # type: ignore[union-attr]
        for rnd in range(2):
            for i in range(32):
                name = f"a{i:02d}"
                got = generate_ids(client, PROMPTS[0], name)
                if rnd == 0:
                    expected[name] = got
                else:
                    assert got == expected[name], name
                state = store.state()
                assert state.device_bytes <= state.device_budget_bytes
                assert state.host_bytes <= state.host_budget_bytes
        assert len(set(map(tuple, expected.values()))) > 16  # adapters really differ
        infos = {a.id: a for a in client.list_adapters()}
        assert sum(a.loads for a in infos.values()) >= 60  # evicted and loaded again
    for name in ("a00", "a17", "a31"):
        assert expected[name] == peft_greedy(served_tiny_dir, root / name, PROMPTS[0])


def test_lazy_registration_reads_no_tensor(server: BackgroundServer, adapter_root: Path) -> None:
    with Client(server.target, timeout=30) as client:
        before = server.server.runtime.loaded.adapters.kind(LoraPart).store.state().disk_bytes  # type: ignore[union-attr]
        client.load_adapter("lazy", adapter_root / "all-r8")
        info = client.get_adapter("lazy")
        assert info.state.value == "registered" and info.device_bytes == 0 and info.host_bytes == 0
        assert server.server.runtime.loaded.adapters.kind(LoraPart).store.state().disk_bytes == before  # type: ignore[union-attr]
        client.unload_adapter("lazy")


def test_grpc_status_codes_directly(server: BackgroundServer) -> None:
    from loraplex.v1 import adapters_pb2, adapters_pb2_grpc

    with grpc.insecure_channel(server.target) as channel:
        stub = adapters_pb2_grpc.AdaptersStub(channel)
        with pytest.raises(grpc.RpcError) as err:
            stub.GetAdapter(adapters_pb2.GetAdapterRequest(id="nope"))
        assert err.value.code() == grpc.StatusCode.NOT_FOUND
        with pytest.raises(grpc.RpcError) as err:
            stub.LoadAdapter(adapters_pb2.LoadAdapterRequest(id="x", source=""))
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT


def test_cli_adapters_verbs(server: BackgroundServer, adapter_root: Path) -> None:
    import subprocess
    import sys

    def cli(*args: str) -> subprocess.CompletedProcess[str]:
        cmd = [sys.executable, "-m", "service.cli", "adapters", "--target", server.target, *args]
        return subprocess.run(cmd, capture_output=True, text=True, timeout=60, check=False)

    listed = cli("list")
    assert listed.returncode == 0, listed.stderr
    ids = [line.split()[0] for line in listed.stdout.splitlines()[1:]]
    assert set(ADAPTERS) <= set(ids)
    loaded = cli("load", "cli-copy", str(adapter_root / "qv-r4"))
    assert loaded.returncode == 0 and json.loads(loaded.stdout)["id"] == "cli-copy"
    rows = {line.split()[0]: line.split() for line in cli("list").stdout.splitlines()[1:]}
    assert rows["cli-copy"][-1] == str(adapter_root / "qv-r4")  # the source, as given
    shown = json.loads(cli("show", "cli-copy").stdout)
    assert shown["state"] == "registered" and shown["rank"] == 4
    assert cli("unload", "cli-copy").returncode == 0
    missing = cli("show", "cli-copy")
    assert missing.returncode != 0 and "cli-copy" in missing.stderr
