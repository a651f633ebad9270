"""service.selfcheck: every compute path checked against float32 at start-up; a wrong one falls back or refuses.

The wrong paths are injected for real: an int4 layout derived from a packer that is not torch's (what the old
hard-coded AVX-512 unpack amounted to on AVX2 and generic CPUs), the old unpack itself, a broken attention kernel
in a real ``loraplex serve`` process (through ``sitecustomize``), so the server is seen to fall back and answer
right, or to exit before it ever says SERVING.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import grpc
import pytest
import torch
from loraplex.v1 import generation_pb2 as pb
from loraplex.v1 import generation_pb2_grpc as pb_grpc
from support.gguf_files import write_tiny_gguf
from support.native import compiled_kernels, kernels_mode
from support.servers import text_req, tiny_settings
from support.tiny_models import load_ours

from service import metrics
from service.adapters.lora.batch import LoraTables
from service.api.server import BackgroundServer
from service.kernels import native
from service.model import KVCache
from service.model.load_gguf import load_gguf_model
from service.model.weights import NEVER, Int4Weight, int4, int4_layout, protocol
from service.model.weights.q8_table import SCREEN_MIN_ROWS
from service.platform import cpu_capability
from service.selfcheck import SelfCheckFailed, run_self_check

pytestmark = pytest.mark.numerics


@pytest.fixture(scope="module")
def tiny_gguf(served_tiny_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    types = {"token_embd": "Q8_0", "output.": "Q8_0"}  # Q4_1 projections, Q8_0 embedding and head
    return write_tiny_gguf(served_tiny_dir, tmp_path_factory.mktemp("selfcheck") / "tiny.gguf", types=types)


@pytest.mark.parametrize("quantize", [None, "int8", "int4"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_every_path_of_a_healthy_model_passes(tiny_llama_dir: Path, quantize: str | None, dtype: torch.dtype) -> None:
    report = run_self_check(load_ours(tiny_llama_dir, dtype=dtype, quantize=quantize))
    assert report.capability == cpu_capability() and report.dtype == str(dtype).removeprefix("torch.")
    assert all(c.status == "ok" and c.error <= c.tolerance for c in report.checks), report.checks
    kinds = {c.path.split(" ")[0] for c in report.checks}
    assert {quantize or "dense", "output", "LoRA", "attention,", "Medusa"} <= kinds
    if dtype == torch.float32 and native.kernels() is not None:  # the fused step ops too
        assert "fused" in kinds
    if native.kernels() is not None:  # the batched LoRA kernel beside the eager math, both layouts, every site
        assert sum(c.path.startswith("LoRA kernel") for c in report.checks) == 8
    if quantize is not None:  # both of a quantized kind's paths, on a probe and on the model's own weights
        paths = {c.path.split(": ", 1)[-1] for c in report.checks if c.path.startswith(quantize)}
        assert {"kernel", "dequantized dense", "model weight, kernel vs dequantized"} <= paths


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_gguf_models_head_embedding_and_blocks_pass(
    served_tiny_dir: Path, tiny_gguf: Path, dtype: torch.dtype
) -> None:
    model = load_gguf_model(served_tiny_dir, tiny_gguf, dtype=dtype)[0]
    report = run_self_check(model)
    assert all(c.status == "ok" for c in report.checks), report.checks
    heads = [c for c in report.checks if c.path.startswith("output head") and not c.path.endswith("argmax")]
    assert len(heads) == 4 and any(c.path == "embedding gather" for c in report.checks)
    loaded = native.kernels()
    screened = [(c.path, c.kernel, c.tolerance) for c in report.checks if c.path.endswith("rows, argmax")]
    screens = loaded is not None and loaded.q8_screen and dtype == torch.float32
    want = [(f"output head, {m} rows, argmax", "int8 screen", 0) for m in (9, 16) if m >= SCREEN_MIN_ROWS]
    assert screened == (want if screens else [])
    if loaded is not None:  # one row: the native kernel in either dtype
        assert heads[0].kernel == f"{loaded.name} q8 kernel"
    elif dtype == torch.bfloat16:
        assert heads[0].kernel.startswith("int4 pair")
    if dtype == torch.bfloat16:
        assert heads[1].kernel.startswith("int4 pair")


def test_a_wrong_native_kernel_falls_back_to_torchs_and_answers_right(
    served_tiny_dir: Path, tiny_gguf: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The compiled kernels are proved like torch's: one computing wrong on this CPU is dropped at start-up."""
    compiled_kernels()
    model = load_gguf_model(served_tiny_dir, tiny_gguf, dtype=torch.float32)[0]

    def q4_zeros(self: native.NativeKernels, x2: torch.Tensor, *tiles: Any) -> torch.Tensor:
        return torch.zeros(x2.shape[0], tiles[-2], dtype=tiles[-1])  # (qs, d, m, n, out_dtype)

    def q8_zeros(self: native.NativeKernels, x2: torch.Tensor, q: torch.Tensor, *rest: Any) -> torch.Tensor:
        return torch.zeros(x2.shape[0], q.shape[1], dtype=rest[-1])

    monkeypatch.setattr(native.NativeKernels, "q4_matmul", q4_zeros)
    monkeypatch.setattr(native.NativeKernels, "q8_matmul", q8_zeros)
    report = run_self_check(model)
    fallbacks = [c.path for c in report.checks if c.status.startswith("fallback")]
    assert any(p.startswith("q4 projection") for p in fallbacks) and "output head, 1 row" in fallbacks, fallbacks
    reference = load_gguf_model(served_tiny_dir, tiny_gguf, dtype=torch.float32, packed=False)[0]
    ids = torch.tensor([[1, 5, 9, 2, 7]])
    got, want = (_prefill_logits(m, ids) for m in (model, reference))
    torch.testing.assert_close(got, want, rtol=0, atol=1e-4)


def test_a_wrong_argmax_screen_is_turned_off_and_the_head_answers_in_full(
    served_tiny_dir: Path, tiny_gguf: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A screen that names the wrong token disagrees with the full product's max: the self-check turns it off."""
    if not compiled_kernels().q8_screen:
        pytest.skip("no int8 screen on this CPU (AVX-512 VNNI)")
    model = load_gguf_model(served_tiny_dir, tiny_gguf, dtype=torch.float32)[0]
    real = native.NativeKernels.q8_top

    def off_by_one(self: native.NativeKernels, *args: Any) -> tuple[torch.Tensor, ...]:
        values, indices, found = real(self, *args)
        return values, (indices + 1) % args[1].shape[1], found

    monkeypatch.setattr(native.NativeKernels, "q8_top", off_by_one)
    report = run_self_check(model)
    fallbacks = [c.path for c in report.checks if c.status.startswith("fallback")]
    assert fallbacks and all(p.endswith("rows, argmax") for p in fallbacks), fallbacks
    assert not model.lm_head.screen and model.lm_head.top(torch.randn(16, model.cfg.hidden_size)) is None


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_wrong_lora_kernel_falls_back_to_the_eager_math(
    tiny_llama_dir: Path, dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A LoRA kernel that adds nothing fails its probes; the model's adapter tables then run the eager math."""
    compiled_kernels()
    model = load_ours(tiny_llama_dir, dtype=dtype)
    assert model.lora_native is not None
    monkeypatch.setattr(native.NativeKernels, "lora_delta", lambda self, *args: None)
    report = run_self_check(model)
    fallbacks = [c.path for c in report.checks if c.status.startswith("fallback")]
    assert len(fallbacks) == 8 and all(p.startswith("LoRA kernel") for p in fallbacks), fallbacks
    assert all(c.status == "ok" for c in report.checks if not c.path.startswith("LoRA kernel"))
    assert model.lora_native is None
    assert LoraTables(model.cfg, device="cpu", dtype=dtype, native=model.lora_native).native is None


def test_wrong_fused_step_ops_fall_back_to_the_eager_ones_and_answer_right(
    tiny_llama_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    compiled_kernels()
    model = load_ours(tiny_llama_dir)
    with kernels_mode("eager"):
        reference = load_ours(tiny_llama_dir)

    def zeros(self: native.NativeKernels, qkv: torch.Tensor, *rest: Any, **named: Any) -> torch.Tensor:
        return qkv.new_zeros(qkv.shape[0], rest[5] * qkv.shape[2])  # [B, heads * D]

    monkeypatch.setattr(native.NativeKernels, "decode_attention", zeros)
    assert model.native is not None
    report = run_self_check(model)
    fallbacks = [c.path for c in report.checks if c.status.startswith("fallback")]
    want = ["fused RoPE + K/V write", "fused decode attention", "fused draft tree attention"]
    assert fallbacks == want and model.native is None
    ids, got = torch.tensor([[1, 5, 9, 2, 7]]), []
    for m in (model, reference):  # a decode step after the prompt: where the fused attention would run
        cache = KVCache(m.cfg, 1, 8, dtype=torch.float32, device=m.device)
        m(ids, torch.arange(5)[None, :], cache, 0)
        got.append(m.logits(m(torch.tensor([[3]]), torch.tensor([[5]]), cache, 0)))
    torch.testing.assert_close(got[0], got[1], rtol=0, atol=1e-4)


def test_a_wrong_row_top_falls_back_to_torchs_max(tiny_llama_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Sampling's one-pass argmax (``lp_row_top``) answering the last column of every row: the self-check finds it
    and the model keeps no compiled step ops, so the sampler takes torch's max."""
    compiled_kernels()
    model = load_ours(tiny_llama_dir)

    def last(self: native.NativeKernels, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return x[:, -1].clone(), torch.full((x.shape[0],), x.shape[1] - 1, dtype=torch.int64)

    monkeypatch.setattr(native.NativeKernels, "row_top", last)
    report = run_self_check(model)
    assert [c.path for c in report.checks if c.status.startswith("fallback")] == ["row max and argmax"]
    assert model.native is None


def _prefill_logits(model: Any, ids: torch.Tensor) -> torch.Tensor:
    cache = KVCache(model.cfg, 1, ids.shape[1], dtype=torch.float32, device=model.device)
    return model.logits(model(ids, torch.arange(ids.shape[1])[None, :], cache, 0))


def _rotating_packer(q32: torch.Tensor) -> torch.Tensor:
    """torch's packer after rotating the rows by one: a layout the kernel does not use."""
    return int4_layout.pack_cpu(q32.roll(1, dims=0).contiguous())


def _wrong_layout(monkeypatch: pytest.MonkeyPatch) -> None:
    wrong: dict[tuple[int, int], int4_layout.Int4Layout] = {}

    def layout_for(n: int, k: int, device: torch.device, pack: int4_layout.Packer) -> int4_layout.Int4Layout:
        if (n, k) not in wrong:
            wrong[n, k] = int4_layout.derive(_rotating_packer, n, k, device)
        return wrong[n, k]

    monkeypatch.setattr(int4, "layout_for", layout_for)


def test_a_wrong_int4_layout_falls_back_to_the_kernel(tiny_llama_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _wrong_layout(monkeypatch)
    model = load_ours(tiny_llama_dir, quantize="int4")
    report = run_self_check(model)
    fallbacks = [c for c in report.checks if c.status.startswith("fallback")]
    assert fallbacks and all("int4 kernel at every batch size" in c.status for c in fallbacks)
    for layer in range(model.cfg.num_layers):
        for name in ("wqkv", "wo", "w13", "w2"):
            w = model.projection(layer, name)
            assert isinstance(w, Int4Weight) and w.dense_from_rows == NEVER and w.dense is None
    x = torch.randn(300, model.cfg.hidden_size)  # a prefill-sized batch now runs the kernel, never the bad unpack
    w = model.projection(0, "wqkv")
    assert torch.equal(protocol.linear(x, w, scratch=model.scratch), w.matmul(x))


def test_a_wrong_int4_layout_served_falls_back_and_answers_right(
    served_tiny_dir: Path, tiny_gguf: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """torch's int4 kernel serving the blocks (``--kernels eager``: float32 would run the native kernel)."""
    settings = tiny_settings(served_tiny_dir, gguf=tiny_gguf, dtype="float32", http_port=-1, metrics_port=-1,
                             kernels="eager")  # fmt: skip
    prompt = text_req("The capital of France is", n=12)

    def serve() -> tuple[list[int], list[str]]:
        with BackgroundServer(settings) as srv, grpc.insecure_channel(srv.target) as channel:
            stub = pb_grpc.GenerationStub(channel)
            info = stub.ModelInfo(pb.ModelInfoRequest(), timeout=30)
            out = stub.Generate(prompt, timeout=60)
        return list(out.results[0].token_ids), [p.status for p in info.compute_paths]

    with kernels_mode("eager"):  # the servers set it; the default again for the tests after this one
        want, statuses = serve()
    assert all(s == "ok" for s in statuses)
    labels = {"capability": cpu_capability(), "dtype": "float32", "weights": "gguf", "kernels": "eager"}
    assert metrics.REGISTRY.get_sample_value("loraplex_compute_info", {**labels, "self_check": "ok"}) == 1
    _wrong_layout(monkeypatch)
    with kernels_mode("eager"):
        got, statuses = serve()
    assert got == want  # the same greedy tokens: the prefill ran the kernel instead of the wrong unpack
    assert any(s.startswith("fallback: the int4 kernel at every batch size") for s in statuses)
    assert metrics.REGISTRY.get_sample_value("loraplex_compute_info", {**labels, "self_check": "fallback"}) == 1
    assert (metrics.REGISTRY.get_sample_value("loraplex_self_check_fallbacks") or 0) >= 1


def _old_avx512_unpack(packed: torch.Tensor, n: int, k: int, out: torch.Tensor) -> torch.Tensor:
    """The unpack main hard-coded until 2026-12: AVX-512's blocks of 64 rows (right there, wrong elsewhere)."""
    full = n // 64 * 64
    flat = packed.reshape(-1)
    if full:
        p = flat[: full * k // 2].view(full // 64, k, 32)
        dst = out[:full].view(full // 64, 2, 32, k)
        dst[:, 0].copy_((p & 15).transpose(1, 2))
        dst[:, 1].copy_((p >> 4).transpose(1, 2))
    if n > full:
        r = n - full
        p = flat[full * k // 2 :].view(k, r // 2)
        dst = out[full:].view(r // 2, 2, k)
        dst[:, 0].copy_((p & 15).t())
        dst[:, 1].copy_((p >> 4).t())
    return out


def test_the_old_avx512_only_unpack_is_caught_wherever_it_is_wrong(
    tiny_llama_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    class OldLayout:
        form = "strided"

        def __init__(self, n: int, k: int) -> None:
            self.n, self.k = n, k

        def unpack(self, packed: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
            return _old_avx512_unpack(packed, self.n, self.k, out)

    monkeypatch.setattr(int4, "layout_for", lambda n, k, device, pack: OldLayout(n, k))
    report = run_self_check(load_ours(tiny_llama_dir, quantize="int4", dtype=torch.bfloat16))
    fell_back = any(c.status.startswith("fallback") for c in report.checks)
    assert fell_back == (cpu_capability() != "AVX512")  # right under AVX-512 only; caught everywhere else


def test_a_path_without_a_correct_fallback_refuses(tiny_llama_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    model = load_ours(tiny_llama_dir, quantize="int4")
    monkeypatch.setattr(Int4Weight, "matmul", lambda self, x2: torch.zeros(x2.shape[0], self.shape[0]))
    _wrong_layout(monkeypatch)  # both int4 paths wrong
    with pytest.raises(SelfCheckFailed) as failed:
        run_self_check(model)
    message = str(failed.value)
    assert "int4 projection" in message and cpu_capability() in message and "float32" in message


BROKEN_ATTENTION = """
import torch.nn.functional as F
_sdpa = F.scaled_dot_product_attention
F.scaled_dot_product_attention = lambda q, k, v, **kw: _sdpa(q, k, v, **kw) * 1.5
"""


def test_serve_exits_naming_a_broken_kernel_and_never_serves(served_tiny_dir: Path, tmp_path: Path) -> None:
    """A real ``loraplex serve`` whose attention kernel computes wrong (patched at interpreter start)."""
    (tmp_path / "sitecustomize.py").write_text(BROKEN_ATTENTION)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")])}
    cmd = [sys.executable, "-m", "service.cli", "serve", "--model", str(served_tiny_dir), "--port", "0",
           "--http-port", "-1", "--metrics-port", "-1", "--dtype", "float32"]  # fmt: skip
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=240, check=False)
    assert done.returncode == 1, done.stderr[-2000:]
    assert "event=self_check_failed path='attention, 1 query per row'" in done.stderr
    assert f"capability={cpu_capability()} dtype=float32" in done.stderr
    assert "event=serving" not in done.stderr and "is SERVING" not in done.stderr
