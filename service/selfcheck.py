"""The start-up self-check: every compute path the server will use, on a small probe, against a float32 reference.

Kernels differ by CPU capability (``ATEN_CPU_CAPABILITY``; AVX2, AVX-512, AMX, aarch64) and by torch version, and
a path that computes wrong on one machine once served garbage there while every test passed on another. So before
the server says SERVING, ``run_self_check`` runs, for the loaded model in its serving dtype:

- each kind and shape of projection weight: the quantized kernel and the dequantized dense path on a probe weight
  built from known values (truth computed in float32 from those values), then on the model's own weight the kernel
  against its dequantized form, and a kept dense copy against both;
- the output head (dense, or a GGUF Q8_0 table with its int4 pair, chunked and dense-copy paths, and its int8
  screen of a greedy step's argmax, which must agree exactly) and a compact embedding's gather, on a sample of
  vocabulary rows;
- the batched LoRA math, per-slot and shared, on random adapters (a base-only row must stay bit-identical), eager
  and on the compiled kernel when the model has one (``Llama.lora_native``): a wrong kernel sends the adapter
  tables back to the eager math;
- attention (``scaled_dot_product_attention`` with the model's mask shapes), decode and prefill;
- the fused step ops (float32, bfloat16) when the compiled kernels run them (residual + RMSNorm, SiLU·mul, RoPE
  with the K/V write, decode attention): a wrong one sends the model back to the eager ops;
- the dtype Medusa heads draft in.

A path off by more than its dtype's tolerance either falls back to a path that passed (a quantized kind whose
dequantized path is wrong runs its kernel at every batch size, one whose kernel is wrong runs dense; a head's int4
pair or dense copy is dropped), logged as ``event=self_check_fallback``, or the check raises ``SelfCheckFailed``
naming the path, the capability and the dtype: the server then exits instead of serving. The report (capability,
each path's kernel, error and outcome) is what ``ModelInfo`` and ``loraplex info`` show.

Never reads files or the environment; probes are seeded, so a given machine always checks the same numbers.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor

from service.adapters.lora.batch import AdapterBatch, LoraTables, Mode, module_layout
from service.errors import FailedPrecondition
from service.model.decode_stack import compare
from service.model.kv_cache import finite_kv
from service.model.llama import PROJ_NAMES, Llama, ProjName
from service.model.rope import apply_rope
from service.model.weights.dispatch import NEVER
from service.model.weights.protocol import Weight
from service.platform import cpu_capability, draft_dtype
from service.selfcheck_lora import in_features, out_features, random_lora, reference_delta
from service.selfcheck_report import PathCheck, SelfCheckReport, exact_top, rel_error

__all__ = ["TOLERANCE", "PathCheck", "SelfCheckFailed", "SelfCheckReport", "run_self_check"]

log = logging.getLogger("loraplex.selfcheck")

# Largest relative error (per row: |y - ref| / |ref|) a path may have against its float32 reference. A wrong
# layout or kernel is off by ~1 (uncorrelated values); rounding alone stays far below these.
TOLERANCE: dict[torch.dtype, float] = {torch.float32: 1e-4, torch.bfloat16: 3e-2, torch.float16: 1e-2}


# Rows of the probe weights (the model's own weights are checked at their full shape) and of the float32 reference
# computed at a time: the check's memory stays a few MB above the model's.
PROBE_ROWS = 256
REF_ROWS = 512


class SelfCheckFailed(FailedPrecondition):
    """A compute path disagrees with its float32 reference and has no correct fallback."""


class _Checker:
    def __init__(self, model: Llama) -> None:
        self.model = model
        self.dtype = model.dtype
        self.device = model.device
        self.tol = TOLERANCE[model.dtype]
        self.gen = torch.Generator().manual_seed(20261201)
        self.checks: list[PathCheck] = []

    def randn(self, *shape: int, dtype: torch.dtype | None = None) -> Tensor:
        t = torch.randn(shape, generator=self.gen)
        return t.to(device=self.device, dtype=self.dtype if dtype is None else dtype)

    def record(self, path: str, kernel: str, y: Tensor, ref: Tensor, tol: float | None = None) -> PathCheck:
        tol = self.tol if tol is None else tol
        err = rel_error(y, ref)
        check = PathCheck(path, kernel, err, tol, "ok" if err <= tol else "failed")
        self.checks.append(check)
        return check

    def fallback(self, check: PathCheck, what: str) -> None:
        i = self.checks.index(check)
        self.checks[i] = dataclasses.replace(check, status=f"fallback: {what}")
        log.warning(
            "event=self_check_fallback path=%r error=%.3g tolerance=%.3g capability=%s dtype=%s fallback=%r",
            check.path, check.error, check.tolerance, _capability(self.device), _name(self.dtype), what,
        )  # fmt: skip

    # --- projections -------------------------------------------------------------------------------------

    def projections(self) -> None:
        seen: dict[tuple[str, tuple[int, int]], list[tuple[int, ProjName]]] = {}
        for layer in range(self.model.cfg.num_layers):
            for name in PROJ_NAMES:
                w = self.model.projection(layer, name)
                kind: str = "dense" if isinstance(w, Tensor) else w.kind
                seen.setdefault((kind, (int(w.shape[0]), int(w.shape[1]))), []).append((layer, name))
        for (kind, shape), sites in seen.items():
            first = self.model.projection(*sites[0])
            if isinstance(first, Tensor):
                self.dense(f"dense projection {shape[0]}x{shape[1]}", first)
            else:
                self.quantized(kind, shape, first, sites)

    def dense(self, path: str, w: Tensor) -> None:
        x = self.randn(4, w.shape[1])
        self.record(path, f"dense matmul ({_name(self.dtype)})", F.linear(x, w), F.linear(x.float(), w.float()))

    def quantized(self, kind: str, shape: tuple[int, int], w: Weight, sites: list[tuple[int, ProjName]]) -> None:
        n, k = shape
        label = f"{kind} projection {n}x{k}"
        probe, truth = w.probe(min(w.shape[0], PROBE_ROWS), self.gen)  # truth: float32 from the raw values
        x = self.randn(3, k)
        ref = F.linear(x.float(), truth)
        del truth
        kernel = self.record(f"{label}: kernel", w.kernel_name, probe.matmul(x), ref)
        dense = self.record(
            f"{label}: dequantized dense",
            f"{probe.dequantize_kernel} + dense matmul",
            F.linear(x, probe.dequantize()),
            ref,
        )
        own = w.dequantize()  # the model's weight: the two paths must agree on it as well
        own_ref = torch.cat([F.linear(x.float(), rows.float()) for rows in torch.split(own, REF_ROWS)], dim=-1)
        del own
        mine = self.record(f"{label}: model weight, kernel vs dequantized", w.kernel_name, w.matmul(x),
                           own_ref)  # fmt: skip
        if w.dense is not None:
            self.record(f"{label}: dense copy", "dense matmul over the kept copy", F.linear(x, w.dense), own_ref)
        if kernel.ok and dense.ok and mine.ok:
            return
        if kernel.ok and not (dense.ok and mine.ok):
            self._every(sites, lambda q: q.with_dispatch(NEVER, keep_dense=False))
            self.fallback(dense if not dense.ok else mine, f"the {kind} kernel at every batch size, no dense copies")
        elif dense.ok and not kernel.ok and self.device.type == "cpu":
            self._every(sites, lambda q: q.with_dispatch(1))
            self.fallback(kernel, f"the dequantized dense path at every batch size for {kind}")
        else:
            self._fail(label)

    def _every(self, sites: list[tuple[int, ProjName]], change: Callable[[Weight], Weight]) -> None:
        for layer, name in sites:
            w = self.model.projection(layer, name)
            if not isinstance(w, Tensor):
                self.model.set_projection(layer, name, change(w))

    # --- head and embedding ------------------------------------------------------------------------------

    def head(self) -> None:
        head = self.model.lm_head
        hidden = self.model.cfg.hidden_size
        rows = _sample_rows(self.model.cfg.vocab_size, self.gen).to(self.device)
        if isinstance(head, Tensor):
            x = self.randn(4, hidden)
            ref = F.linear(x.float(), head[rows].float())
            self.record("output head", f"dense matmul ({_name(self.dtype)})", self.model.logits(x)[:, rows], ref)
            return
        ref_rows = head.rows(rows)  # [n, hidden] float32
        for m in (1, 2, 9, 16):  # the head's paths: one row, a few (int4 pair), many (chunks or dense copy)
            x = self.randn(m, hidden)
            path = f"output head, {m} row{'s' if m > 1 else ''}"
            ref = F.linear(x.float(), ref_rows)
            logits = head.project(x)
            check = self.record(path, head.kernel_for(m), logits[:, rows], ref)
            if (top := head.top(x)) is not None:  # a greedy step's argmax without every logit: exactly project's
                want = exact_top(*logits.float().max(dim=-1))
                if not self.record(f"{path}, argmax", "int8 screen", exact_top(*top[:2]), want, 0).ok:
                    head.screen = False
                    self.fallback(self.checks[-1], "the max of the full product")
            if check.ok:
                continue
            kernel = head.kernel_for(m)
            if not head.drop_fast_path(m):
                self._fail(path)
            self.fallback(check, f"{head.kernel_for(m)} instead of {kernel}")
            if not self.record(path, head.kernel_for(m), head.project(x)[:, rows], ref).ok:
                self._fail(path)
        emb = self.model.tok_embeddings
        if not isinstance(emb, Tensor):
            self.record("embedding gather", "dequantized rows", emb.gather(rows), emb.rows(rows))
            self._fail_any("embedding")

    # --- LoRA, attention, drafting -----------------------------------------------------------------------

    def lora(self) -> None:
        cfg = self.model.cfg
        layout = module_layout(cfg)
        adapters = {
            aid: random_lora(layout, rank, self.gen, self.device, self.dtype) for aid, rank in (("a", 8), ("b", 4))
        }
        x_of = {site: self.randn(3, 2, in_features(layout, site)) for site in PROJ_NAMES}
        modes: tuple[Mode, ...] = ("slots", "shared")
        native = self.model.lora_native
        kernel_checks: list[PathCheck] = []
        for mode in modes:
            for kernel in (None, native) if native is not None else (None,):
                tables = LoraTables(cfg, device=self.device, dtype=self.dtype, native=kernel)
                batch = AdapterBatch.build(["a", None, "b"], lambda a, _layer: adapters[str(a)], tables, mode=mode)
                if batch is None:
                    raise RuntimeError("an adapter batch with adapters was built as None")
                how = f"batched LoRA ({mode}) in {_name(tables.compute_dtype)}"
                prefix, how = ("LoRA", how) if kernel is None else ("LoRA kernel", f"{kernel.name} {how}")
                for site in PROJ_NAMES:
                    x = x_of[site]
                    base = self.randn(3, 2, out_features(layout, site))
                    out = batch.add_delta(base.clone(), x, 0, site)
                    ref = base.float().clone()
                    for row, aid in ((0, "a"), (2, "b")):
                        ref[row] += reference_delta(adapters[aid], layout, site, x[row].float())
                    path = f"{prefix} {mode} {site}"
                    checks = [self.record(path, how, out, ref)]
                    if not torch.equal(out[1], base[1]):
                        checks.append(PathCheck(f"{path}: base row untouched", how, math.inf, 0.0, "failed"))
                        self.checks.append(checks[-1])
                    if kernel is not None:
                        kernel_checks += checks
        if any(not c.ok for c in kernel_checks):  # the eager math (checked above) serves instead
            self.model.lora_native = None
            for c in kernel_checks:
                if not c.ok:
                    self.fallback(c, "the eager batched LoRA (torch)")
        self._fail_any("LoRA")

    def attention(self) -> None:
        cfg = self.model.cfg
        kv, g, d = cfg.num_kv_heads, cfg.num_heads // cfg.num_kv_heads, cfg.head_dim
        for t in (1, 5):
            length = 24
            q = self.randn(2, kv, t * g, d)
            k, v = self.randn(2, kv, length, d), self.randn(2, kv, length, d)
            lengths = torch.tensor([length - t, length - 9 - t])  # the second row is shorter: masked keys
            pos = lengths[:, None] + torch.arange(t)  # [2, T]
            visible = torch.arange(length)[None, None, :] <= pos[:, :, None]  # [2, T, L]
            mask = torch.zeros(visible.shape).masked_fill_(~visible, -math.inf).repeat_interleave(g, dim=1)
            mask = mask.unsqueeze(1).to(device=self.device, dtype=self.dtype)  # [2, 1, T*G, L]
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
            scores = q.float() @ k.float().transpose(-1, -2) / math.sqrt(d) + mask.float()
            ref = scores.softmax(-1) @ v.float()
            self.record(
                f"attention, {t} quer{'y' if t == 1 else 'ies'} per row", "scaled_dot_product_attention", y, ref
            )
        self._fail_any("attention")

    def step_ops(self) -> None:
        """The fused step ops (``service.model.step``) on probes in the model's dtype against float32 computed from
        the same values; any wrong one sends the model to the eager ops."""
        ops = self.model.native
        if ops is None:
            return
        cfg = self.model.cfg
        h, kv, d, length, eps = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, 24, cfg.rms_norm_eps
        kernel = f"{ops.name} fused step ops"
        n = cfg.hidden_size
        x, y, w = self.randn(3, n, dtype=torch.float32), self.randn(3, n), self.randn(n)
        ref = F.rms_norm(x + y.float(), w.shape, w.float(), eps)
        checks = [self.record("fused residual add + RMSNorm", kernel, ops.add_rmsnorm(x.clone(), y, w, eps), ref)]
        proj = self.randn(40, n)  # a dense weight's product of a few rows (protocol.linear)
        got = ops.dense_matmul(y, proj, torch.float32)
        checks.append(self.record("dense product of a few rows", kernel, got, y.float() @ proj.float().T))
        gu = self.randn(3, 2 * cfg.intermediate_size) * 4
        gate, up = gu.float().chunk(2, dim=-1)
        checks.append(self.record("fused SiLU*mul", kernel, ops.silu_mul(gu), F.silu(gate) * up))
        qkv, cos, sin = self.randn(2, h + 2 * kv, d), self.randn(2, d), self.randn(2, d)
        cache = self.randn(2, 2, kv, length, d)
        pos = torch.tensor([length - 1, length - 10])  # the second row is shorter: keys past it unread
        out = ops.decode_attention(qkv, cos, sin, pos, cache[0], cache[1], h)
        qk = apply_rope(qkv.float()[:, None, : h + kv], cos.float()[:, None, None], sin.float()[:, None, None])[:, 0]
        rows = torch.arange(2)
        written = torch.cat((cache[0][rows, :, pos], cache[1][rows, :, pos]), dim=1)  # [2, 2 KV, D]
        want = finite_kv(torch.cat((qk[:, h:], qkv.float()[:, h + kv :]), dim=1))
        checks.append(self.record("fused RoPE + K/V write", kernel, written, want))
        seen = torch.arange(length)[None, :] <= pos[:, None]  # [2, L]
        checks.append(self.record("fused decode attention", kernel, out, _attended(qk[:, :h], cache, seen)))
        # a draft tree: a root and two candidates after it, each seeing the cache below the root and its ancestors
        tree = torch.tensor([[[1, 0, 0], [1, 1, 0], [1, 0, 1]]], dtype=torch.bool)
        qkv, cache, at = self.randn(3, h + 2 * kv, d), self.randn(2, 1, kv, length, d), torch.arange(length - 3, length)
        cos, sin = cos[:1].expand(3, d).contiguous(), sin[:1].expand(3, d).contiguous()
        out = ops.decode_attention(qkv, cos, sin, at, cache[0], cache[1], h, slots=1, tree=tree)
        qk = apply_rope(qkv.float()[:, None, :h], cos.float()[:, None, None], sin.float()[:, None, None])[:, 0]
        seen = torch.cat((torch.ones(3, length - 3, dtype=torch.bool), tree[0]), dim=1)  # [3, L]
        ref = _attended(qk, cache.expand(2, 3, kv, length, d), seen)
        checks.append(self.record("fused draft tree attention", kernel, out, ref))
        logits = self.randn(4, 1000, dtype=torch.float32)
        logits[1, 700] = logits[1, 300] = logits[1].max() + 1  # a tie (the first column), +inf, a row of -inf
        logits[2, 5], logits[3] = math.inf, -math.inf
        got, want = exact_top(*ops.row_top(logits)), exact_top(*logits.max(dim=-1))
        checks.append(self.record("row max and argmax", kernel, got, want, 0))  # sampling's argmax: exact
        if all(c.ok for c in checks):
            return self.decode_stack(kernel)
        self.model.native = None
        for c in checks:
            if not c.ok:
                self.fallback(c, "the eager step ops (torch)")

    def decode_stack(self, kernel: str) -> None:
        """A decode step in one call (``service.model.decode_stack``) against the per-op path: equal bit for bit."""
        pair = compare(self.model)
        if pair is not None and not self.record("decode step in one call", kernel, *pair, 0).ok:
            self.model.stack.enabled = False
            self.fallback(self.checks[-1], "the fused step ops one call at a time")

    def drafting(self) -> None:
        dtype = draft_dtype(self.model.dtype, self.device)
        w, x = (self.randn(rows, self.model.cfg.hidden_size, dtype=dtype) for rows in (512, 4))
        ref = F.linear(x.float(), w.float())
        self.record("Medusa draft head", f"dense matmul ({_name(dtype)})", F.linear(x, w), ref, TOLERANCE[dtype])
        self._fail_any("Medusa draft head")

    def _fail_any(self, prefix: str) -> None:
        for c in self.checks:
            if c.path.startswith(prefix) and c.status == "failed":
                self._fail(c.path)

    def _fail(self, path: str) -> None:
        bad = [c for c in self.checks if c.path.startswith(path) and c.status == "failed"] or self.checks[-1:]
        worst = max(bad, key=lambda c: c.error)
        message = (
            f"start-up self-check failed: {worst.path} ({worst.kernel}) is off by {worst.error:.3g} against its "
            f"float32 reference (tolerance {worst.tolerance:.3g}) on CPU capability {_capability(self.device)} in "
            f"{_name(self.dtype)}; refusing to serve wrong answers. Try --dtype float32, another weight source, or "
            "report this with the output of `python -m torch.utils.collect_env`"
        )
        log.error("event=self_check_failed path=%r capability=%s dtype=%s error=%.3g", worst.path,
                  _capability(self.device), _name(self.dtype), worst.error)  # fmt: skip
        raise SelfCheckFailed(message)


def run_self_check(model: Llama) -> SelfCheckReport:
    """Check every compute path of ``model`` (see the module docstring); fall back or raise ``SelfCheckFailed``."""
    start = time.perf_counter()
    checker = _Checker(model)
    with torch.inference_mode():
        checker.projections()
        checker.head()
        checker.lora()
        checker.attention()
        checker.step_ops()
        checker.drafting()
    report = SelfCheckReport(
        _capability(model.device), _name(model.dtype), tuple(checker.checks), time.perf_counter() - start
    )
    worst = max((c.error / c.tolerance for c in report.checks if c.tolerance), default=0.0)
    log.info("event=self_check capability=%s dtype=%s paths=%d worst_error_ratio=%.3g seconds=%.3f",
             report.capability, report.dtype, len(report.checks), worst, report.seconds)  # fmt: skip
    return report


# --- probes --------------------------------------------------------------------------------------------


def _attended(q: Tensor, cache: Tensor, seen: Tensor) -> Tensor:
    """Attention in float32: q [B, H, D] rotated, cache [2, B, KV, L, D] (each row's K, V), seen [B, L] bool: the
    positions each row attends to -> [B, H * D]."""
    b, h, d = q.shape
    kv, length = cache.shape[2], cache.shape[3]
    k, v = cache[0].float(), cache[1].float()
    scores = q.reshape(b, kv, h // kv, d) @ k.transpose(-1, -2) / math.sqrt(d)  # [B, KV, G, L]
    scores.masked_fill_(~seen.reshape(b, 1, 1, length), -math.inf)
    return (scores.softmax(-1) @ v).reshape(b, h * d)


def _sample_rows(vocab: int, gen: torch.Generator) -> Tensor:
    """Vocabulary rows the head is checked on: the first and last 64 (the edges of chunks) and 384 at random."""
    edges = torch.cat((torch.arange(min(64, vocab)), torch.arange(max(0, vocab - 64), vocab)))
    rows: Tensor = torch.unique(torch.cat((edges, torch.randint(0, vocab, (384,), generator=gen))))
    return rows


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _capability(device: torch.device) -> str:
    return str(torch.cuda.get_device_name(device)) if device.type == "cuda" else cpu_capability()
