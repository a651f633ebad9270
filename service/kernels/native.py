"""loraplex's own CPU kernels (``src/*.cpp``): built for this CPU's instruction set at first use, cached on disk.

    configure(mode="auto", cache_dir=None)      the process's choice (``--kernels``, ``--kernel-cache``)
    kernels() -> NativeKernels | None           the loaded library, or None: eager torch paths (see ``status``)
    build(isa, cache_dir) -> Path               compile one variant (the image pre-warms all: ``loraplex kernels``)

``NativeKernels`` wraps each source's entry points: the Q4 / Q8 products and the Q8 head's screened argmax
(``blocks.cpp``, through ``native_blocks.BlockProducts``; Q4 weights in tiles of ``Q4_TILE`` rows), dense products
of a few rows (``dense.cpp``), products with bf16 weights in pairs (``pairs.cpp``), the fused step ops
(``step.cpp``), the batched LoRA shrink/expand of one (layer, site) (``lora.cpp``, over a table from
``service.kernels.lora.lora_site``) and the one-call decode step (``decode.cpp``).

The variant follows torch's CPU capability (``service.platform.cpu_capability``), so ``ATEN_CPU_CAPABILITY=default``
or ``avx2`` runs the generic or AVX2 code as it does torch's: AVX512 -> ``avx512``, AVX2 (with F16C) -> ``avx2``,
anything else (older x86, aarch64, POWER) -> ``generic``, plain C++ built without instruction-set flags. Never
``-march=native``: an image built on one CPU runs on every other (an instruction beyond the variant's flags, such as
``vdpbf16ps``, runs only behind a check of the CPU, with portable code of the same arithmetic beside it).

Built with ``$CXX`` (default ``g++``) into ``<cache>/blocks-<isa>-<hash>.so``, the hash over the source and the
flags, so a changed source builds anew and a cached library needs no compiler (the image ships all three, built by
``loraplex kernels``); written to a temporary name and renamed, so concurrent servers never load a half-written
file; building one removes the variant's older libraries. Linked ``--as-needed`` against the C runtime and OpenMP.
``mode="auto"``: a machine without a compiler, or a build that fails, serves on the eager torch paths with one
warning; ``"native"``: that is an error; ``"eager"``: never built. The library shares torch's OpenMP runtime (one
``libgomp.so.1`` per process), so ``torch.set_num_threads`` sets its threads too. ctypes releases the GIL a call.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import math
import os
import shutil
import subprocess
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

from service.errors import FailedPrecondition
from service.kernels import KERNEL_DTYPES
from service.kernels.checks import DTYPE_CODES as _DTYPE_CODES
from service.kernels.checks import Q4_TILE as _Q4_TILE
from service.kernels.checks import check_attention as _check_attention
from service.kernels.checks import check_pairs as _check_pairs
from service.kernels.checks import check_step as _check_step
from service.kernels.checks import check_tree
from service.kernels.checks import raise_for as _raise
from service.kernels.checks import tree_args as _tree_args
from service.kernels.compile import compile_shared
from service.kernels.lora import LORA_FIELDS, LoraSite, StackLora
from service.kernels.native_blocks import BlockProducts
from service.platform import cpu_capability, cpu_flags

__all__ = [
    "ABI_VERSION",
    "ISA_FLAGS",
    "KERNEL_MODES",
    "Q4_TILE",
    "NativeKernels",
    "build",
    "configure",
    "default_cache_dir",
    "isa_for",
    "kernels",
    "status",
    "variant",
]

log = logging.getLogger(__name__)

ABI_VERSION = 13  # lp_abi_version() of the source this wrapper speaks to
KERNEL_MODES = ("auto", "native", "eager")
Q4_TILE = _Q4_TILE  # weight rows side by side in lp_q4_matmul's layout
_SRC = Path(__file__).with_name("src")
SOURCES = tuple(_SRC / f"{n}.cpp" for n in ("blocks", "dense", "pairs", "step", "lora", "decode"))
HEADERS = (_SRC / "dtypes.h", _SRC / "ahead.h", _SRC / "shares.h")  # included by the sources: part of the cache key
ISA_FLAGS = {
    "avx512": ("-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mavx2", "-mfma", "-mf16c"),
    "avx2": ("-mavx2", "-mfma", "-mf16c"),
    "generic": (),
}
BASE_FLAGS = (
    "-O3", "-std=c++17", "-shared", "-fPIC", "-fopenmp", "-fno-math-errno", "-fno-trapping-math", "-ffp-contract=off",
    "-fno-exceptions",
    "-fno-rtti", "-Wl,--as-needed",
)  # fmt: skip
BUILD_TIMEOUT_S = 120

_P, _I, _L, _F = ctypes.c_void_p, ctypes.c_int, ctypes.c_int64, ctypes.c_float


def default_cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "loraplex" / "kernels"


def isa_for(capability: str, flags: frozenset[str] | None) -> str:
    """The variant for torch's ``capability`` on a CPU with ``flags`` (cpuinfo; None when unreadable)."""
    if capability == "AVX512":
        return "avx512"
    if capability == "AVX2" and flags is not None and "f16c" in flags:
        return "avx2"
    return "generic"


class NativeKernels(BlockProducts):
    """The loaded library of one variant. Every method takes contiguous CPU tensors and checks what it passes."""

    def __init__(self, path: Path, isa: str) -> None:
        self.path = path
        self.isa = isa
        lib = ctypes.CDLL(str(path))
        lib.lp_abi_version.restype = ctypes.c_int
        lib.lp_isa.restype = ctypes.c_char_p
        abi, built = lib.lp_abi_version(), lib.lp_isa().decode()
        if abi != ABI_VERSION or built != isa:
            raise FailedPrecondition(f"kernel library {path}: ABI {abi} for {built}, expected {ABI_VERSION} for {isa}")
        lib.lp_q4_matmul.argtypes = [_P, _I, _P, _P, _P, _L, _L, _L, _P, _I, _L]
        lib.lp_q8_matmul.argtypes = [_P, _I, _P, _P, _I, _L, _L, _L, _P, _I, _L]
        lib.lp_q8_top.argtypes = [_P, _I, _P, _P, _P, _I, _P, _L, _L, _L, _L, _P, _P, _P, _P]
        lib.lp_dense_matmul.argtypes = [_P, _I, _P, _I, _L, _L, _L, _L, _P, _I, _L]
        lib.lp_pairs_matmul.argtypes = [_P, _P, _L, _L, _L, _P, _I, _L]
        lib.lp_add_rmsnorm.argtypes = [_P, _P, _P, _L, _L, ctypes.c_float, _P, _I]
        lib.lp_silu_mul.argtypes = [_P, _L, _L, _P, _I]
        lib.lp_row_top.argtypes = [_P, _L, _L, _P, _P]
        lib.lp_decode_attention.argtypes = [_P, _P, _P, _P, _L, _L, _P, _L, _L, _L, _L, _P, _P, _L, _L, _L, _F, _P,
                                            _I]  # fmt: skip
        lib.lp_lora_delta.argtypes = [_P, _I, _L, _L, _L, _P, _L, _P, _I, _L, _L, _L, _L, _L, _P, _P, _P, _P, _P, _L]
        lib.lp_decode_stack.argtypes = [_P, _L, _L, _P, _L, _P, _P, ctypes.c_float, _P, _P, _P, _P, _L, _P, _L, _L, _L,
                                        _L, _L, ctypes.c_float, _P, _P, _L, _L, _P, _I]  # fmt: skip
        for fn in (lib.lp_q4_matmul, lib.lp_q8_matmul, lib.lp_dense_matmul, lib.lp_pairs_matmul, lib.lp_add_rmsnorm,
                   lib.lp_silu_mul, lib.lp_decode_attention, lib.lp_lora_delta, lib.lp_decode_stack,
                   lib.lp_row_top, lib.lp_q8_top):  # fmt: skip
            fn.restype = ctypes.c_int
        self.q8_screen = bool(lib.lp_q8_top_supported())  # q8_top can screen (AVX-512 VNNI)
        self.bf16_dot = bool(lib.lp_bf16_dot())  # pairs_matmul on the CPU's bf16 dot products (else portable code)
        self.decode_fields = int(lib.lp_decode_fields())  # pointers per layer in lp_decode_stack's table
        if lib.lp_decode_lora_fields() != LORA_FIELDS:
            raise FailedPrecondition(f"kernel library {path}: its LoRA fields are not {LORA_FIELDS}")
        self._lib = lib

    @property
    def name(self) -> str:
        return f"loraplex {self.isa}"

    def dense_matmul(self, x2: Tensor, w: Tensor, out_dtype: torch.dtype) -> Tensor:
        """x2 [M, K] -> [M, N] in ``out_dtype``: ``x2 @ w^T`` for a dense w [N, K]; float32 or bfloat16 each."""
        (mrows, k), (n, kw) = x2.shape, w.shape
        _check_step(x2)
        if k != kw or {w.dtype, out_dtype} - set(KERNEL_DTYPES) or not w.is_contiguous() or w.device.type != "cpu":
            raise ValueError(f"dense_matmul: x {x2.dtype} {list(x2.shape)}, w {w.dtype} {list(w.shape)}, {out_dtype}")
        out = torch.empty(mrows, n, dtype=out_dtype)
        rc = self._lib.lp_dense_matmul(x2.data_ptr(), _DTYPE_CODES[x2.dtype], w.data_ptr(), _DTYPE_CODES[w.dtype],
                                       mrows, n, k, k, out.data_ptr(), _DTYPE_CODES[out_dtype], n)  # fmt: skip
        if rc:
            _raise(rc, f"lp_dense_matmul refused x {tuple(x2.shape)} and weight {tuple(w.shape)}")
        return out

    def pairs_matmul(self, x2: Tensor, w: Tensor, n: int, out_dtype: torch.dtype) -> Tensor:
        """x2 [M, K] bf16 -> [M, N] in ``out_dtype``: ``x2 @ W^T`` for a bf16 W [N, K] kept in pairs, w [ceil(N / 16),
        ceil(K / 2), 16, 2] (``service.model.weights.bf16_pairs``)."""
        _check_pairs(x2, w, n, out_dtype)
        (m, k), code = x2.shape, _DTYPE_CODES[out_dtype]
        out = torch.empty(m, n, dtype=out_dtype)
        if self._lib.lp_pairs_matmul(x2.data_ptr(), w.data_ptr(), m, n, k, out.data_ptr(), code, n):
            raise ValueError(f"lp_pairs_matmul refused x {tuple(x2.shape)} and weight [{n}, {k}]")
        return out

    # --- the small ops of a decode step, float32 or bfloat16 (src/step.cpp) --------------------------------

    def add_rmsnorm(self, x: Tensor, y: Tensor | None, w: Tensor, eps: float) -> Tensor:
        """``x += y`` in place (y None: no add), then RMSNorm of x with weight w: x [..., N] float32 (the residual
        stream), w [N] and y float32 or bfloat16 alike; the output [..., N] in w's dtype."""
        n = w.shape[0]
        _check_step(x)
        code = _check_step(w, *(() if y is None else (y,)))
        if x.shape[-1] != n or (y is not None and y.shape != x.shape):
            raise ValueError(f"add_rmsnorm: x {tuple(x.shape)}, y {None if y is None else tuple(y.shape)}, w [{n}]")
        if x.dtype != torch.float32:
            raise ValueError(f"add_rmsnorm: the residual stream x must be float32, got {x.dtype}")
        out = torch.empty_like(x, dtype=w.dtype)
        rc = self._lib.lp_add_rmsnorm(x.data_ptr(), None if y is None else y.data_ptr(), w.data_ptr(),
                                      x.numel() // n, n, eps, out.data_ptr(), code)  # fmt: skip
        if rc:
            _raise(rc, f"lp_add_rmsnorm refused x {tuple(x.shape)} with eps {eps}")
        return out

    def silu_mul(self, gu: Tensor) -> Tensor:
        """gu [..., 2 I] float32 or bfloat16 ([gate; up]) -> [..., I] alike: ``silu(gate) * up``."""
        code = _check_step(gu)
        inter = gu.shape[-1] // 2
        out = gu.new_empty(*gu.shape[:-1], inter)
        rc = self._lib.lp_silu_mul(gu.data_ptr(), gu.numel() // max(2 * inter, 1), inter, out.data_ptr(), code)
        if rc or 2 * inter != gu.shape[-1]:
            raise ValueError(f"lp_silu_mul refused gu {tuple(gu.shape)}")
        return out

    def decode_attention(
        self, qkv: Tensor, cos: Tensor, sin: Tensor, pos: Tensor, k_cache: Tensor, v_cache: Tensor, heads: int,
        slots: int | None = None, tree: Tensor | None = None,
    ) -> Tensor:  # fmt: skip
        """One query token per row: qkv [B, H + 2 KV, D], cos / sin [B, D] (RoPE at each row's position);
        k_cache, v_cache [S, KV, max_len, D] (the rows' slots, written at ``pos`` [B] int64; row b in slot b % S, S =
        ``slots``, B by default: B = T S is a chain of T tokens a slot, token-major; with ``tree`` bool [S or 1, T,
        T], a draft tree's T nodes a slot, each at its root's position + its index and seeing the cache below its
        root and the nodes its row marks) -> [B, H * D]; all float32 or all bfloat16. See ``lp_decode_attention``."""
        b = qkv.shape[0]
        slots = b if slots is None else slots
        code = _check_attention(qkv, cos, sin, pos, (k_cache, v_cache), heads, slots, tree)
        d, kv, max_len = qkv.shape[2], k_cache.shape[1], k_cache.shape[2]
        out = qkv.new_empty(b, heads * d)
        marks, stride = _tree_args(tree)
        rc = self._lib.lp_decode_attention(
            qkv.data_ptr(), cos.data_ptr(), sin.data_ptr(), pos.data_ptr(), b, slots, marks, stride, heads, kv, d,
            k_cache.data_ptr(), v_cache.data_ptr(), k_cache.stride(0), max_len * d, max_len, 1.0 / math.sqrt(d),
            out.data_ptr(), code,
        )  # fmt: skip
        if rc:
            _raise(rc, f"lp_decode_attention refused qkv {tuple(qkv.shape)} at positions {pos.tolist()}")
        return out

    def row_top(self, x: Tensor) -> tuple[Tensor, Tensor]:
        """x [B, N] float32 logits -> (values [B] float32, indices [B] int64): ``x.max(dim=-1)``, the first column
        holding a row's largest value (a row holding NaN: NaN at its first NaN), in one parallel pass."""
        if x.dim() != 2 or x.shape[1] < 1 or x.dtype != torch.float32 or not x.is_contiguous() or x.is_cuda:
            raise ValueError(f"row_top takes contiguous float32 CPU logits [B, N], got {x.dtype} {tuple(x.shape)}")
        values, indices = x.new_empty(x.shape[0]), torch.empty(x.shape[0], dtype=torch.int64)
        if self._lib.lp_row_top(x.data_ptr(), x.shape[0], x.shape[1], values.data_ptr(), indices.data_ptr()):
            raise ValueError(f"lp_row_top refused logits {tuple(x.shape)}")
        return values, indices

    # --- a whole decode step of a float32 model on Q4 weights (src/decode.cpp) ------------------------------

    def decode_stack(
        self, x: Tensor, table: ctypes.Array[ctypes.c_int64], dims: tuple[int, ...], final_norm: Tensor, eps: float,
        rope: tuple[Tensor, Tensor, Tensor], kv: Tensor, slot_start: int, lora: StackLora | None, tokens: int = 1,
        tree: Tensor | None = None,
    ) -> Tensor:  # fmt: skip
        """x [T B, hidden] float32 (embedded, ``tokens`` = T a row, token-major; left as the residual stream) ->
        [T B, hidden] final-normed through the layers ``table`` lists; dims (hidden, heads, kv heads, head dim,
        intermediate); rope: cos, sin [T B, D], cache positions [T B]; ``tree``: a draft tree's mask, as
        ``decode_attention`` takes it; K/V into slots ``slot_start ..`` of ``kv`` [L, 2, slots, KV, max_len, D];
        ``lora``: compiled LoRA tables. Contiguous; the norm, rope tables, cache and the output in the model's dtype,
        float32 or bfloat16 (``service.model.decode_stack``)."""
        cos, sin, pos = rope
        check_tree(tree, x.shape[0] // tokens, tokens)
        marks, stride = _tree_args(tree)
        s = kv.stride()
        out = torch.empty(x.shape, dtype=final_norm.dtype)
        sites, lo, hi, group = (None, 0, 0, None) if lora is None else (lora.sites, *lora.span, lora.rows.data_ptr())
        rc = self._lib.lp_decode_stack(
            x.data_ptr(), x.shape[0] // tokens, tokens, table, kv.shape[0], (ctypes.c_int64 * 5)(*dims),
            final_norm.data_ptr(), eps, cos.data_ptr(), sin.data_ptr(), pos.data_ptr(), marks, stride,
            kv.data_ptr() + slot_start * s[2] * kv.element_size(), s[0], s[1], s[2], s[3], kv.shape[4],
            1.0 / math.sqrt(dims[3]), out.data_ptr(), sites, lo, hi, group, _DTYPE_CODES[final_norm.dtype],
        )  # fmt: skip
        if rc:
            _raise(rc, f"lp_decode_stack refused {x.shape[0]} rows at positions {pos.tolist()}")
        return out

    # --- the batched LoRA math of one (layer, site) (src/lora.cpp) ------------------------------------------

    def lora_delta(self, site: LoraSite, out: Tensor, x: Tensor, group: Tensor) -> None:
        """Add each row's LoRA delta to ``out`` [B, T, N] in place: row b's group ``g = group[b]`` (int64 [B]; -1:
        the row is left alone) gives ``h = x[b] @ a[g]^T`` over x [B, T, in] and, per module,
        ``out[b, :, col:col + out_m] += h[:, start:start + r] @ bt[g] (+ bias[g])``, or with a scale
        ``= scale[g] * (out + delta)``. x and out: float32 or bfloat16, one dtype, contiguous CPU tensors."""
        b, t, k = x.shape
        if x.dtype not in KERNEL_DTYPES or out.dtype != x.dtype or k != site.in_features:
            raise ValueError(f"lora_delta: x {x.dtype} {tuple(x.shape)}, out {out.dtype} for tables of {k} inputs")
        fits = out.shape[:2] == x.shape[:2] and out.shape[2] >= site.cols and group.shape == (b,)
        if not fits or group.dtype != torch.int64:
            raise ValueError(f"lora_delta: x {tuple(x.shape)}, out {tuple(out.shape)}, group {group.dtype} "
                             f"{tuple(group.shape)}")  # fmt: skip
        if not (x.is_contiguous() and out.is_contiguous() and group.is_contiguous()) or x.device.type != "cpu":
            raise ValueError("lora_delta takes contiguous CPU x, out and group")
        seg, bts, scales, biases = site.args
        rc = self._lib.lp_lora_delta(
            x.data_ptr(), _DTYPE_CODES[x.dtype], b, t, k, group.data_ptr(), site.groups, site.tensors[0].data_ptr(),
            _DTYPE_CODES[site.dtype], *site.strides, site.width, len(bts), seg, bts, scales, biases, out.data_ptr(),
            out.shape[2],
        )  # fmt: skip
        if rc:
            _raise(rc, f"lp_lora_delta refused x {tuple(x.shape)}, out {tuple(out.shape)} for groups {group.tolist()}")


def _compiler() -> str | None:
    return shutil.which(os.environ.get("CXX", "g++"))


def _library_name(isa: str) -> str:
    h = hashlib.sha256(b"".join(source.read_bytes() for source in (*SOURCES, *HEADERS)))
    h.update(" ".join(BASE_FLAGS + ISA_FLAGS[isa]).encode())
    return f"blocks-{isa}-{h.hexdigest()[:16]}.so"


def build(isa: str, cache_dir: Path) -> Path:
    """The library of variant ``isa`` in ``cache_dir``, compiled unless cached; raises FailedPrecondition."""
    if isa not in ISA_FLAGS:
        raise ValueError(f"unknown kernel variant {isa!r}; known: {sorted(ISA_FLAGS)}")
    path = cache_dir / _library_name(isa)
    if path.is_file():
        return path
    cxx = _compiler()
    if cxx is None:
        raise FailedPrecondition(f"no C++ compiler ({os.environ.get('CXX', 'g++')}) to build the native kernels")
    cache_dir.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=cache_dir)
    os.close(fd)
    try:
        error = compile_shared(cxx, [*BASE_FLAGS, *ISA_FLAGS[isa], f'-DLP_ISA="{isa}"'], SOURCES, tmp, BUILD_TIMEOUT_S)
        if error is not None:
            raise FailedPrecondition(f"building the {isa} kernels failed: {error[-2000:]}")
        os.replace(tmp, path)
        for stale in cache_dir.glob(f"blocks-{isa}-*.so"):  # an older source's: a loaded copy stays mapped
            if stale != path:
                stale.unlink(missing_ok=True)
    except subprocess.TimeoutExpired:
        raise FailedPrecondition(f"building the {isa} kernels took over {BUILD_TIMEOUT_S} s") from None
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return path


@dataclass
class _State:
    mode: str = "auto"
    cache_dir: Path | None = None
    loaded: NativeKernels | None = None
    status: str = "not loaded yet"
    tried: bool = False


_state = _State()
_lock = threading.Lock()


def configure(mode: str = "auto", cache_dir: Path | None = None) -> None:
    """Set the process's kernel choice; the library is (re)loaded at the next ``kernels()``."""
    if mode not in KERNEL_MODES:
        raise ValueError(f"kernels must be one of {KERNEL_MODES}, got {mode!r}")
    with _lock:
        _state.mode, _state.cache_dir = mode, cache_dir
        _state.loaded, _state.tried, _state.status = None, False, "not loaded yet"


def kernels() -> NativeKernels | None:
    """The native kernels for this CPU, built on first call; None when off or unavailable (``status`` says why)."""
    with _lock:
        if _state.tried:
            return _state.loaded
        _state.tried = True
        if _state.mode == "eager":
            _state.status = "off (--kernels eager)"
            return None
        isa = isa_for(cpu_capability(), cpu_flags())
        try:
            path = build(isa, _state.cache_dir or default_cache_dir())
            _state.loaded = NativeKernels(path, isa)
        except (FailedPrecondition, OSError, subprocess.SubprocessError) as exc:
            if _state.mode == "native":
                raise FailedPrecondition(f"--kernels native: {exc}") from exc
            _state.status = f"unavailable, serving on torch's kernels: {exc}"
            log.warning("event=native_kernels_unavailable reason=%r", str(exc))
            return None
        _state.status = f"{isa} ({path})"
        log.info("event=native_kernels_loaded isa=%s path=%s", isa, path)
        return _state.loaded


def status() -> str:
    """What ``kernels()`` did: the variant and file, or why there is none."""
    with _lock:
        return _state.status


def variant() -> str:
    """The variant ``kernels()`` loaded (``avx512``, ``avx2``, ``generic``), or ``eager`` when none was (not asked
    for, off or unavailable): the ``kernels`` label of ``loraplex_compute_info``."""
    with _lock:
        return "eager" if _state.loaded is None else _state.loaded.isa
