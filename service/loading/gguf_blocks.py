"""GGUF tensor data: stream a tensor's blocks from the open file and unpack them into their destination.

A tensor is read whole rows at a time with ``os.preadv`` into one reused buffer of at most ``CHUNK_BYTES`` (never
the whole tensor, never the whole file), decoded there, and written to its destination rows, optionally permuted
(``dest_rows[i]`` is where the file's row ``i`` goes: llama.cpp's Q/K RoPE permutation is undone this way; rows
permute, blocks within a row do not). Three destination kinds:

- :class:`Int4Rows` from Q4_0 / Q4_1, exact: ``w = (q - 8) * scale + zero`` per group of 32 with Q4_0
  ``w = d * (q - 8)`` -> scale d, zero 0 and Q4_1 ``w = d * q + m`` -> scale d, zero m + 8d.
- :class:`Int8Rows` from Q8_0, exact: ``w = d * q`` per group of 32, ``q`` int8.
- a dense float tensor from F32 / F16 / BF16 or any of the block types above, dequantized in float32.

Layouts (ggml): Q4_0 block = f16 d, 16 bytes of nibbles; Q4_1 = f16 d, f16 m, 16 bytes; element ``j < 16`` of a
block is the low nibble of byte ``j``, element ``j + 16`` its high nibble. Q8_0 = f16 d, 32 int8.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import Tensor

from service.errors import GGUFError, GGUFUnsupported
from service.loading.gguf import GGUFTensor

__all__ = ["CHUNK_BYTES", "GROUP", "INT4_TYPES", "SUPPORTED", "Int4Rows", "Int8Rows", "RowReader"]

CHUNK_BYTES = 4 << 20
GROUP = 32  # the block size of every block type read here
INT4_TYPES = frozenset({"Q4_0", "Q4_1"})
_FLOATS = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}
SUPPORTED = frozenset({*INT4_TYPES, "Q8_0", *_FLOATS})


@dataclass(frozen=True)
class Int4Rows:
    """Unpacked 4-bit weights, ready for the int4 kernel: ``w = (q - 8) * scale + zero`` per group of 32."""

    q: Tensor  # [N, K] values 0..15 (uint8, or int32 as the kernel's packer takes them)
    scale: Tensor  # [N, K / 32] float32
    zero: Tensor  # [N, K / 32] float32

    @classmethod
    def empty(cls, n: int, k: int, q_dtype: torch.dtype = torch.uint8) -> Int4Rows:
        g = k // GROUP
        return cls(torch.empty(n, k, dtype=q_dtype), torch.empty(n, g), torch.empty(n, g))

    def dequantize(self) -> Tensor:
        n, k = self.q.shape
        w = (self.q.view(n, k // GROUP, GROUP).float() - 8) * self.scale[..., None] + self.zero[..., None]
        return w.view(n, k)  # [N, K] float32


@dataclass(frozen=True)
class Int8Rows:
    """Unpacked Q8_0 weights: ``w = q * scale`` per group of 32. ``q`` may be a strided view (``group_major``)."""

    q: Tensor  # [N, K / 32, 32] int8
    scale: Tensor  # [N, K / 32] float32

    @classmethod
    def empty(cls, n: int, k: int) -> Int8Rows:
        return cls(torch.empty(n, k // GROUP, GROUP, dtype=torch.int8), torch.empty(n, k // GROUP))

    @classmethod
    def group_major(cls, n: int, k: int) -> Int8Rows:
        """Rows over ``[K / 32, N, 32]`` / ``[K / 32, N]`` storage: each column group's slice contiguous."""
        g = k // GROUP
        q = torch.empty(g, n, GROUP, dtype=torch.int8)
        return cls(q.transpose(0, 1), torch.empty(g, n).t())

    def dequantize(self, rows: Tensor | None = None) -> Tensor:
        """Rows ``rows`` (all when None) as float32 ``[R, K]``: exact (an int8 times an f16 fits a float32)."""
        q, s = (self.q, self.scale) if rows is None else (self.q[rows], self.scale[rows])
        return (q.float() * s[..., None]).reshape(q.shape[0], -1)


Dest = Int4Rows | Int8Rows | Tensor


def _f16(raw: Tensor, byte: int) -> Tensor:
    """The f16 at byte ``byte`` of each block of ``raw`` [B, block_bytes], as float32 [B]."""
    return raw[:, byte : byte + 2].contiguous().view(torch.float16).view(-1).float()


def _nibbles(qs: Tensor) -> Tensor:
    """[B, 16] packed bytes -> [B, 32] values 0..15 in ggml's order (low nibbles, then high)."""
    return torch.cat((qs & 0xF, qs >> 4), dim=1)


def _decode_int4(t: GGUFTensor, raw: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """raw [R, row_bytes] -> q [R, K] uint8, scale [R, G], zero [R, G]."""
    r = raw.shape[0]
    blocks = raw.view(-1, t.ggml_type.block_bytes)  # [R*G, 18 or 20]
    d = _f16(blocks, 0)
    if t.ggml_type.name == "Q4_0":
        q, zero = _nibbles(blocks[:, 2:]), torch.zeros_like(d)
    else:
        q, zero = _nibbles(blocks[:, 4:]), _f16(blocks, 2) + 8 * d
    return q.view(r, -1), d.view(r, -1), zero.view(r, -1)


def _decode_q8(raw: Tensor) -> tuple[Tensor, Tensor]:
    r = raw.shape[0]
    blocks = raw.view(-1, 34)
    return blocks[:, 2:].contiguous().view(torch.int8).view(r, -1), _f16(blocks, 0).view(r, -1)


def decode_float(t: GGUFTensor, raw: Tensor) -> Tensor:
    """raw [R, row_bytes] -> float32 [R, K] for any supported type (dequantized in float32)."""
    name = t.ggml_type.name
    if name in _FLOATS:
        return raw.view(_FLOATS[name]).float()
    if name == "Q8_0":
        q, s = _decode_q8(raw)
        return Int8Rows(q.view(q.shape[0], -1, GROUP), s).dequantize()
    q, scale, zero = _decode_int4(t, raw)
    return Int4Rows(q, scale, zero).dequantize()


class RowReader:
    """Reads tensors of one open GGUF file into destinations through one reused buffer of bounded size."""

    def __init__(self, fd: int, chunk_bytes: int = CHUNK_BYTES) -> None:
        self.fd = fd
        self.chunk_bytes = chunk_bytes
        self._set_buffer(chunk_bytes)
        self.bytes_read = 0
        self.decode_seconds = 0.0  # unpacking and writing destinations, the rest of a read's time is the reads

    def _set_buffer(self, nbytes: int) -> None:
        self._bytes = bytearray(nbytes)
        self._buf = torch.frombuffer(self._bytes, dtype=torch.uint8)  # shares the bytearray's memory

    def _chunks(self, t: GGUFTensor) -> Iterator[tuple[int, Tensor]]:
        """(first row, raw [rows, row_bytes] uint8) over the tensor, each a view of the reused buffer."""
        row_bytes = t.row_bytes
        if row_bytes > self._buf.numel():
            self._set_buffer(row_bytes)
        per = self._buf.numel() // row_bytes
        for r0 in range(0, t.rows, per):
            n = min(per, t.rows - r0) * row_bytes
            got = os.preadv(self.fd, [memoryview(self._bytes)[:n]], t.start + r0 * row_bytes)
            if got != n:
                at = t.start + r0 * row_bytes
                raise GGUFError(f"truncated: short read, {got} of {n} bytes at {at}", file=t.file, tensor=t.name)
            self.bytes_read += n
            yield r0, self._buf[:n].view(-1, row_bytes)

    def read(self, t: GGUFTensor, dest: Dest, dest_rows: Tensor | None = None) -> None:
        """Fill ``dest`` (``[t.rows, K]`` rows; ``dest_rows`` [t.rows] permutes them, or for a vector its elements)
        from tensor ``t``."""
        name = t.ggml_type.name
        if name not in SUPPORTED:
            served = ", ".join(sorted(SUPPORTED))
            raise GGUFUnsupported(f"ggml type {name} is not served (only {served})", file=t.file, tensor=t.name)
        wrong_int4 = isinstance(dest, Int4Rows) and name not in INT4_TYPES
        if wrong_int4 or (isinstance(dest, Int8Rows) and name != "Q8_0"):
            raise GGUFUnsupported(f"{name} cannot fill a {type(dest).__name__}", file=t.file, tensor=t.name)
        for r0, raw in self._chunks(t):
            t0 = time.perf_counter()
            self._write(t, raw, r0, dest, dest_rows)
            self.decode_seconds += time.perf_counter() - t0

    @staticmethod
    def _write(t: GGUFTensor, raw: Tensor, r0: int, dest: Dest, dest_rows: Tensor | None) -> None:
        rows = slice(r0, r0 + raw.shape[0]) if dest_rows is None else dest_rows[r0 : r0 + raw.shape[0]]
        if isinstance(dest, Int4Rows):
            for part, src in zip((dest.q, dest.scale, dest.zero), _decode_int4(t, raw), strict=True):
                part[rows] = src if isinstance(rows, slice) else src.to(part.dtype)  # index_put needs one dtype
        elif isinstance(dest, Int8Rows):
            q, scale = _decode_q8(raw)
            dest.q[rows] = q.view(q.shape[0], -1, GROUP)
            dest.scale[rows] = scale
        elif len(t.shape) == 1:  # a vector is one row: ``dest_rows`` places (and permutes) its elements
            dest.view(-1)[slice(None) if dest_rows is None else dest_rows] = decode_float(t, raw).view(-1)
        else:
            dest.view(-1, t.row_elems)[rows] = decode_float(t, raw)
