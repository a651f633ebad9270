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
exact. Whichever form, a layout is used only after it unpacks every position probe and a random weight exactly as
packed (each value read from the nibble that holds its position), or ``derive`` refuses by raising
``LayoutError``. Deriving works in int32 over one [N, K] probe at a time: a few N * K words, once per shape.

A layout is derived once per (device, N, K) and cached for the process: the capability cannot change while it runs.
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Callable, Iterator
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
    gather: Tensor | None  # [N * K] int64: nibble index of each value, row-major (``runs`` is None)

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


def _probes(n: int, k: int, device: torch.device) -> Iterator[Tensor]:
    """One [N, K] int32 probe per 4 bits of the row-major position: probe[n, k] = ((n * K + k) >> shift) & 15. The
    same buffer each time, built from a row and a column ramp (no [N * K] position array)."""
    count = n * k
    if count >= 2**31:
        raise LayoutError(f"a [{n}, {k}] int4 weight has too many values to derive its layout")
    rows = torch.arange(n, dtype=torch.int32, device=device)[:, None] * k  # [N, 1]
    cols = torch.arange(k, dtype=torch.int32, device=device)[None, :]  # [1, K]
    probe = torch.empty(n, k, dtype=torch.int32, device=device)
    shift = 0
    while shift == 0 or (1 << shift) < count:
        yield torch.add(rows, cols, out=probe).bitwise_right_shift_(shift).bitwise_and_(15)
        shift += 4


def _where(pack: Packer, n: int, k: int, device: torch.device) -> Tensor:
    """[N * K] int32: the row-major position of the value each nibble of the packed weight holds."""
    count = n * k
    where = torch.zeros(count, dtype=torch.int32, device=device)
    for shift, probe in zip(itertools.count(0, 4), _probes(n, k, device), strict=False):
        nib = _nibbles(pack(probe))
        if nib.numel() != count:
            raise LayoutError(f"the int4 packer made {nib.numel()} nibbles of a [{n}, {k}] weight, not {count}")
        where.add_(nib, alpha=1 << shift)  # the digits land in disjoint bits: adding is or-ing
    return where


def _runs(where: Tensor, n: int, k: int) -> tuple[RowRun, ...] | None:
    """Strided row runs read off the nibbles holding columns 0 and 1 of each row, or None where the layout has no
    such form (a row whose two first values are not in one nibble half, a position missing or doubled). Whether
    the runs hold every other column too is for the round trip (``_round_trips``) to show."""
    step_rows = 1 << 20  # nibbles at a time: no [N * K] temporary beside ``where``
    at = torch.cat(
        [
            ((where[i : i + step_rows] % k) < min(k, 2)).nonzero().view(-1) + i
            for i in range(0, where.numel(), step_rows)
        ]
    )  # nibbles holding a column 0 or 1
    if at.numel() != n * min(k, 2):
        return None
    pos = where[at].long()
    first = torch.full((n,), -1, dtype=torch.int64, device=where.device)
    second = torch.full((n,), -1, dtype=torch.int64, device=where.device)
    first[pos[pos % k == 0] // k] = at[pos % k == 0]
    if k > 1:
        second[pos[pos % k == 1] // k] = at[pos % k == 1]
    step = second - first if k > 1 else torch.full_like(first, 2)
    if bool((first < 0).any()) or (k > 1 and bool((second < 0).any())) or bool((step % 2).any()):
        return None
    runs = []
    strides = torch.unique(step)
    for stride in strides.tolist():
        rows = (step == stride).nonzero().view(-1)
        byte = first[rows] // 2
        base = int(byte.min())
        shift = (4 * (first[rows] % 2)).to(torch.uint8)[:, None]
        span = int(byte.max()) - base + 1
        runs.append(RowRun(rows, byte - base, shift, base, span, int(stride) // 2, len(strides) == 1))
    if any(r.base + r.span - 1 + (r.stride * (k - 1)) >= n * k // 2 for r in runs) or any(r.stride <= 0 for r in runs):
        return None  # a view past the packed bytes
    return tuple(runs)


def _gather(where: Tensor) -> Tensor | None:
    """[N * K] int64: each row-major value's nibble index, or None if the packer did not permute the nibbles."""
    gather = torch.full_like(where, -1, dtype=torch.int64)
    gather[where.long()] = torch.arange(where.numel(), device=where.device)
    return None if bool((gather < 0).any()) else gather


def _round_trips(layout: Int4Layout, pack: Packer, n: int, k: int, device: torch.device) -> bool:
    """Whether ``layout`` unpacks every position probe and a random weight exactly as packed: each value read
    from the nibble that holds its position, so the unpack inverts the packer."""
    out = torch.empty(n, k, dtype=torch.uint8, device=device)
    randoms = torch.randint(0, 16, (n, k), dtype=torch.int32, generator=torch.Generator().manual_seed(n * k))
    for probe in itertools.chain(_probes(n, k, device), [randoms.to(device)]):
        if not torch.equal(layout.unpack(pack(probe), out), probe.to(torch.uint8)):
            return False
    return True


def derive(pack: Packer, n: int, k: int, device: torch.device | str = "cpu") -> Int4Layout:
    """The layout ``pack`` produces for [N, K] weights on ``device`` (see the module docstring)."""
    device = torch.device(device)
    where = _where(pack, n, k, device)
    runs = _runs(where, n, k)
    if runs is not None:
        strided = Int4Layout(n, k, runs, None)
        del where
        if _round_trips(strided, pack, n, k, device):
            return strided
        where = _where(pack, n, k, device)
    gather = _gather(where)
    del where
    if gather is None:
        raise LayoutError(f"the int4 packer's output for [{n}, {k}] is not a permutation of its input")
    layout = Int4Layout(n, k, None, gather)
    if not _round_trips(layout, pack, n, k, device):
        raise LayoutError(f"the int4 packer's output for [{n}, {k}] depends on the values packed")
    return layout


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
