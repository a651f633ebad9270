"""Where torch's int4 packer puts each 4-bit value, learned from the packer itself, and the unpack that inverts it.

torch's int4 kernels take their weight in a private packed form (``_convert_weight_to_int4pack_for_cpu`` on CPU,
``_convert_weight_to_int4pack`` on CUDA) whose memory layout depends on the CPU capability torch dispatches to
(blocks of 64 rows under AVX-512, 32 under AVX2 and the generic kernel, other forms on aarch64 and CUDA) and may
change with the torch version. Nothing here assumes that layout. ``derive`` packs probe matrices whose values
spell out each element's position, four bits at a time, and reads back which nibble of the packed bytes each
element landed in: the inverse permutation, for the exact shape and on the device that will use it.

Unpacking must be cheap (a prefill dequantizes every projection), so the permutation is compressed when it has a
shape a strided view can express: every row's values sit at a constant byte stride, all in the low or all in the
high nibble (true of every layout seen so far). Then unpacking is one row gather over a strided view of the bytes
and a per-row shift. Any other permutation is kept whole (an int32 index per value) and gathered: slower, still
exact. Whichever form, the compressed layout is checked against the full permutation before it is used, and the
permutation itself must be a bijection of the nibbles, or ``derive`` refuses by raising ``LayoutError``.

A layout is derived once per (device, N, K) and cached for the process: the capability cannot change while it runs.
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

__all__ = ["Int4Layout", "LayoutError", "Packer", "RowRun", "chunks_concatenate", "derive", "layout_for", "pack_cpu"]

Packer = Callable[[Tensor], Tensor]  # q int32 [N, K] in 0..15 -> the kernel's packed weight (any shape and dtype)


class LayoutError(RuntimeError):
    """The packer's output is not a permutation of the input's nibbles (no unpack can be derived)."""


@dataclass(frozen=True)
class RowRun:
    """Rows whose values all sit ``stride`` bytes apart along K (a strided view of the packed bytes)."""

    rows: Tensor  # [R] int64: output rows of this run (all rows, in order, when the run covers the weight)
    first_byte: Tensor  # [R] int64: byte of each row's value at k = 0, relative to ``base``
    shift: Tensor  # [R, 1] uint8: 0 where the row is in the low nibble, 4 in the high
    base: int  # the smallest byte offset of the run
    span: int  # rows of the strided view: max first byte - base + 1
    stride: int  # bytes between k and k + 1 of one row
    whole: bool  # the run is every row in order (the result needs no scatter)


@dataclass(frozen=True)
class Int4Layout:
    """The inverse of the packer for one [N, K] shape: ``runs`` when strided, else a full ``gather`` index."""

    n: int
    k: int
    runs: tuple[RowRun, ...] | None
    gather: Tensor | None  # [N * K] int32: nibble index of each value, row-major (``runs`` is None)

    @property
    def form(self) -> str:
        """``strided`` or ``gather``: which unpack runs (reported by the start-up self-check)."""
        return "strided" if self.runs is not None else "gather"

    def unpack(self, packed: Tensor, out: Tensor) -> Tensor:
        """The 4-bit values of ``packed`` into ``out`` [N, K] (any dtype), in row-major order."""
        if self.gather is not None:
            return out.view(-1).copy_(_nibbles(packed)[self.gather]).view(self.n, self.k)
        data = packed.reshape(-1).view(torch.uint8)  # [N * K / 2] bytes
        for run in self.runs or ():
            view = data[run.base :].as_strided((run.span, self.k), (1, run.stride))  # [span, K]
            vals = torch.index_select(view, 0, run.first_byte)  # [R, K] bytes
            vals.bitwise_right_shift_(run.shift).bitwise_and_(15)
            if run.whole:
                out.copy_(vals)
            else:
                out[run.rows] = vals.to(out.dtype)
        return out


def pack_cpu(q32: Tensor) -> Tensor:
    """The CPU kernel's packer: q int32 [N, K] -> its packed weight."""
    return torch._convert_weight_to_int4pack_for_cpu(q32, 1)


def _nibbles(packed: Tensor) -> Tensor:
    """[2 * bytes] uint8: nibble i is byte i / 2's low (i even) or high (i odd) half."""
    data = packed.reshape(-1).view(torch.uint8)
    return torch.stack((data & 15, data >> 4), dim=1).view(-1)


def _inverse(pack: Packer, n: int, k: int, device: torch.device) -> Tensor:
    """[N * K] int64: the nibble index each row-major value lands in. One probe per 4 bits of the position."""
    count = n * k
    if count >= 2**31:
        raise LayoutError(f"a [{n}, {k}] int4 weight has too many values to derive its layout")
    pos = torch.arange(count, dtype=torch.int32, device=device)
    where = torch.zeros(count, dtype=torch.int32, device=device)  # nibble index -> value position
    probe = torch.empty(count, dtype=torch.int32, device=device)
    shift = 0
    while shift == 0 or (1 << shift) < count:
        torch.bitwise_right_shift(pos, shift, out=probe).bitwise_and_(15)
        nib = _nibbles(pack(probe.view(n, k)))
        if nib.numel() != count:
            raise LayoutError(f"the int4 packer made {nib.numel()} nibbles of a [{n}, {k}] weight, not {count}")
        where.bitwise_or_(nib.to(torch.int32).bitwise_left_shift_(shift))
        shift += 4
    if not bool((torch.bincount(where, minlength=count) == 1).all()):
        raise LayoutError(f"the int4 packer's output for [{n}, {k}] is not a permutation of its input")
    inverse = torch.empty(count, dtype=torch.int64, device=device)
    inverse[where.long()] = torch.arange(count, dtype=torch.int64, device=device)
    return inverse


def _runs(inverse: Tensor, n: int, k: int) -> tuple[RowRun, ...] | None:
    """Compress the inverse into strided row runs, or None where it has no such form."""
    nib = inverse.view(n, k)
    first = nib[:, 0]  # [N]
    step = nib[:, 1] - first if k > 1 else torch.full_like(first, 2)
    if not torch.equal(nib, first[:, None] + step[:, None] * torch.arange(k, device=nib.device)):
        return None
    if bool((step % 2).any()):
        return None  # a row alternating nibbles has no one shift
    runs = []
    strides = torch.unique(step)
    for stride in strides.tolist():
        rows = (step == stride).nonzero().view(-1)
        byte = first[rows] // 2
        base = int(byte.min())
        shift = (4 * (first[rows] % 2)).to(torch.uint8)[:, None]
        whole = len(strides) == 1
        span = int(byte.max()) - base + 1
        runs.append(RowRun(rows, byte - base, shift, base, span, stride // 2, whole))
    return tuple(runs)


def _check_runs(runs: tuple[RowRun, ...], inverse: Tensor, n: int, k: int) -> bool:
    rebuilt = torch.full((n, k), -1, dtype=torch.int64, device=inverse.device)
    cols = torch.arange(k, device=inverse.device)
    for run in runs:
        nibble = 2 * (run.base + run.first_byte[:, None] + run.stride * cols) + (run.shift.to(torch.int64) // 4)
        rebuilt[run.rows] = nibble
    return torch.equal(rebuilt.view(-1), inverse)


def derive(pack: Packer, n: int, k: int, device: torch.device | str = "cpu") -> Int4Layout:
    """The layout ``pack`` produces for [N, K] weights on ``device`` (see the module docstring)."""
    device = torch.device(device)
    inverse = _inverse(pack, n, k, device)
    runs = _runs(inverse, n, k)
    if runs is not None and _check_runs(runs, inverse, n, k):
        return Int4Layout(n, k, runs, None)
    return Int4Layout(n, k, None, inverse.to(torch.int32))


_CACHE: dict[tuple[str, int, int], Int4Layout] = {}
_LOCK = threading.Lock()


def layout_for(n: int, k: int, device: torch.device, pack: Packer) -> Int4Layout:
    """The cached layout of [N, K] weights on ``device``'s type, derived with ``pack`` on first use."""
    key = (device.type, n, k)
    with _LOCK:
        found = _CACHE.get(key)
        if found is None:
            found = _CACHE[key] = derive(pack, n, k, device)
        return found


def chunks_concatenate(pack: Packer, chunk: int, k: int, last: int, device: torch.device | str = "cpu") -> bool:
    """Whether packing a weight ``chunk`` rows at a time (the last piece ``last`` rows) and concatenating the
    pieces gives the packing of the whole: checked on a random [2 * chunk + last, K] probe (a middle chunk, a
    chunk after it, the tail), so a caller may pack a large table through small reused buffers."""
    rows = 2 * chunk + last
    probe = torch.randint(0, 16, (rows, k), dtype=torch.int32, generator=torch.Generator().manual_seed(0))
    probe = probe.to(device)
    whole = pack(probe).reshape(-1)
    bounds = [0, chunk, 2 * chunk, rows]
    pieces = [pack(probe[a:b].contiguous()).reshape(-1) for a, b in itertools.pairwise(bounds) if b > a]
    return torch.equal(whole, torch.cat(pieces))
