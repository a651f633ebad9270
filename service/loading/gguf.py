"""GGUF headers: parse one file's header (metadata and tensor table) from its handle and validate it.

A GGUF file (versions 2 and 3, little-endian) is ``"GGUF"`` + ``u32 version`` + ``u64 tensor count`` + ``u64
metadata count``, then the metadata key/value pairs (13 value types, arrays nested), then one info per tensor
(name, dims innermost first, ggml type, offset relative to the data section), then padding to ``general.alignment``
(default 32) and the data section. Only the header is read, through a bounded cursor that knows the file size:
every count and length is checked against the bytes left (and a hard cap) before anything is allocated for it,
so a hostile file cannot make us allocate more than it is long.

Checked here, each a :class:`~service.errors.GGUFError` naming the file (and the tensor where there is one):
truncation, magic, version, counts and lengths, duplicate keys and names, the alignment value, dims, a ggml type
this module does not know, offsets that are misaligned, out of the file or overlapping. Whether a known type can
be *served* is the loader's question (``service.loading.gguf_blocks``).
"""

from __future__ import annotations

import itertools
import math
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

from service.errors import GGUFError

__all__ = ["GGML_TYPES", "MAX_STRING_BYTES", "GGMLType", "GGUFHeader", "GGUFTensor", "read_gguf_header"]

MAGIC = b"GGUF"
VERSIONS = (2, 3)
DEFAULT_ALIGNMENT = 32
MAX_STRING_BYTES = 64 << 20  # one metadata string or tensor name (a chat template is a few KB)
MAX_ARRAY_ITEMS = 1 << 26  # one metadata array (a vocabulary has ~1e5..1e6 entries)
MAX_COUNT = 1 << 24  # tensors or metadata pairs in one file
MAX_DIMS = 4  # GGML_MAX_DIMS
MAX_DEPTH = 4  # nesting of metadata arrays


@dataclass(frozen=True, slots=True)
class GGMLType:
    """A ggml tensor type: ``block_elems`` values stored in ``block_bytes`` bytes."""

    code: int
    name: str
    block_elems: int
    block_bytes: int


def _types() -> dict[int, GGMLType]:
    rows = (
        (0, "F32", 1, 4), (1, "F16", 1, 2), (2, "Q4_0", 32, 18), (3, "Q4_1", 32, 20), (6, "Q5_0", 32, 22),
        (7, "Q5_1", 32, 24), (8, "Q8_0", 32, 34), (9, "Q8_1", 32, 40), (10, "Q2_K", 256, 84),
        (11, "Q3_K", 256, 110), (12, "Q4_K", 256, 144), (13, "Q5_K", 256, 176), (14, "Q6_K", 256, 210),
        (15, "Q8_K", 256, 292), (16, "IQ2_XXS", 256, 66), (17, "IQ2_XS", 256, 74), (18, "IQ3_XXS", 256, 98),
        (19, "IQ1_S", 256, 50), (20, "IQ4_NL", 32, 18), (21, "IQ3_S", 256, 110), (22, "IQ2_S", 256, 82),
        (23, "IQ4_XS", 256, 136), (24, "I8", 1, 1), (25, "I16", 1, 2), (26, "I32", 1, 4), (27, "I64", 1, 8),
        (28, "F64", 1, 8), (29, "IQ1_M", 256, 56), (30, "BF16", 1, 2), (34, "TQ1_0", 256, 54),
        (35, "TQ2_0", 256, 66), (39, "MXFP4", 32, 17),
    )  # fmt: skip
    return {code: GGMLType(code, name, elems, nbytes) for code, name, elems, nbytes in rows}


GGML_TYPES: dict[int, GGMLType] = _types()
"""ggml type code -> its block geometry, for every type whose size this parser can check."""


@dataclass(frozen=True, slots=True)
class GGUFTensor:
    """One tensor of a GGUF file: ``nbytes`` bytes at absolute offset ``start``; ``shape`` in torch order
    (outermost first: ``[rows, columns]`` for a matrix), i.e. the file's dims reversed."""

    name: str
    file: Path
    ggml_type: GGMLType
    shape: tuple[int, ...]
    start: int
    nbytes: int

    @property
    def row_elems(self) -> int:
        return self.shape[-1]

    @property
    def rows(self) -> int:
        return math.prod(self.shape[:-1])

    @property
    def row_bytes(self) -> int:
        return self.row_elems // self.ggml_type.block_elems * self.ggml_type.block_bytes


@dataclass(frozen=True)
class GGUFHeader:
    file: Path
    version: int
    metadata: dict[str, Any]
    tensors: dict[str, GGUFTensor]  # in the file's tensor-info order
    alignment: int
    data_offset: int
    file_size: int


# value type code -> (struct format, byte size) for the fixed-size scalars
_SCALARS: dict[int, tuple[str, int]] = {
    0: ("<B", 1), 1: ("<b", 1), 2: ("<H", 2), 3: ("<h", 2), 4: ("<I", 4), 5: ("<i", 4), 6: ("<f", 4),
    7: ("<?", 1), 10: ("<Q", 8), 11: ("<q", 8), 12: ("<d", 8),
}  # fmt: skip
_STRING, _ARRAY = 8, 9


class _Cursor:
    """Sequential reads of the header with the file size in view: a read past the end is 'truncated'."""

    def __init__(self, f: BinaryIO, path: Path, size: int) -> None:
        self.f, self.path, self.size, self.pos = f, path, size, 0
        self.where: str | None = None  # the metadata key or tensor being parsed, for error messages

    def fail(self, message: str, tensor: str | None = None) -> GGUFError:
        at = f" (at byte {self.pos}{f', key {self.where!r}' if self.where and tensor is None else ''})"
        return GGUFError(message + at, file=self.path, tensor=tensor)

    @property
    def left(self) -> int:
        return self.size - self.pos

    def take(self, n: int, what: str) -> bytes:
        if n > self.left:
            raise self.fail(f"truncated: {what} needs {n} bytes, {self.left} left in the file")
        data = self.f.read(n)
        if len(data) != n:
            raise self.fail(f"truncated: {what} short read ({len(data)} of {n} bytes)")
        self.pos += n
        return data

    def scalar(self, code: int, what: str) -> Any:
        fmt, n = _SCALARS[code]
        return struct.unpack(fmt, self.take(n, what))[0]

    def u32(self, what: str) -> int:
        return int(self.scalar(4, what))

    def u64(self, what: str) -> int:
        return int(self.scalar(10, what))

    def string(self, what: str) -> str:
        n = self.u64(f"{what} length")
        if n > MAX_STRING_BYTES or n > self.left:
            raise self.fail(f"{what} length {n} is absurd (cap {MAX_STRING_BYTES}, {self.left} bytes left)")
        try:
            return self.take(n, what).decode("utf-8")
        except UnicodeDecodeError as exc:
            raise self.fail(f"{what} is not UTF-8: {exc}") from None

    def value(self, code: int, depth: int = 0) -> Any:
        if code in _SCALARS:
            return self.scalar(code, "metadata value")
        if code == _STRING:
            return self.string("metadata string")
        if code != _ARRAY:
            raise self.fail(f"unknown metadata value type {code}")
        if depth >= MAX_DEPTH:
            raise self.fail(f"metadata arrays nested deeper than {MAX_DEPTH}")
        item = self.u32("array item type")
        count = self.u64("array length")
        min_item = _SCALARS[item][1] if item in _SCALARS else 8 if item in (_STRING, _ARRAY) else 1
        if count > MAX_ARRAY_ITEMS or count * min_item > self.left:
            raise self.fail(f"array length {count} is absurd (cap {MAX_ARRAY_ITEMS}, {self.left} bytes left)")
        if item in _SCALARS:
            fmt, n = _SCALARS[item]
            return list(struct.unpack(f"<{count}{fmt[1]}", self.take(count * n, "array items")))
        return [self.value(item, depth + 1) for _ in range(count)]


def read_gguf_header(path: Path | str, f: BinaryIO | None = None) -> GGUFHeader:
    """Parse and validate the header of the GGUF file ``path`` (read through ``f`` when given; its position is
    then left after the tensor table). Reads the header only, never the data section."""
    path = Path(path)
    if f is None:
        with path.open("rb") as owned:
            return read_gguf_header(path, owned)
    size = os.fstat(f.fileno()).st_size
    f.seek(0)
    cur = _Cursor(f, path, size)
    magic = cur.take(4, "magic")
    if magic != MAGIC:
        raise cur.fail(f"bad magic {magic!r}: not a GGUF file (expected {MAGIC!r})")
    version = cur.u32("version")
    if version not in VERSIONS:
        hint = " (a big-endian file?)" if version.to_bytes(4, "little")[::-1] in (b"\0\0\0\2", b"\0\0\0\3") else ""
        raise cur.fail(f"unsupported GGUF version {version}{hint}; this reader takes {VERSIONS}")
    n_tensors, n_kv = cur.u64("tensor count"), cur.u64("metadata count")
    # smallest possible entries: a metadata pair 8 + 0 + 4 + 1 bytes, a tensor info 8 + 0 + 4 + 8 + 4 + 8.
    for count, what, smallest in ((n_kv, "metadata count", 13), (n_tensors, "tensor count", 32)):
        if count > MAX_COUNT or count * smallest > cur.left:
            raise cur.fail(f"{what} {count} is absurd (cap {MAX_COUNT}, {cur.left} bytes left)")
    metadata = _read_metadata(cur, n_kv)
    alignment = _alignment(cur, metadata)
    infos = [_read_tensor_info(cur) for _ in range(n_tensors)]
    data_offset = -(-cur.pos // alignment) * alignment
    if data_offset > size:
        raise cur.fail(f"truncated: the data section would start at byte {data_offset}, past the end")
    tensors = _place_tensors(cur, infos, alignment, data_offset)
    return GGUFHeader(path, version, metadata, tensors, alignment, data_offset, size)


def _read_metadata(cur: _Cursor, n_kv: int) -> dict[str, Any]:
    metadata: dict[str, Any] = {}
    for _ in range(n_kv):
        cur.where = None
        key = cur.string("metadata key")
        cur.where = key
        if key in metadata:
            raise cur.fail(f"duplicate metadata key {key!r}")
        metadata[key] = cur.value(cur.u32("metadata value type"))
    cur.where = None
    return metadata


def _alignment(cur: _Cursor, metadata: dict[str, Any]) -> int:
    value = metadata.get("general.alignment", DEFAULT_ALIGNMENT)
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0 or value & (value - 1) or value > 1 << 20:
        raise cur.fail(f"general.alignment {value!r} is not a power of two in [1, 2^20]")
    return value


_Info = tuple[str, GGMLType, tuple[int, ...], int]


def _read_tensor_info(cur: _Cursor) -> _Info:
    name = cur.string("tensor name")
    n_dims = cur.u32("tensor dims count")
    if not 1 <= n_dims <= MAX_DIMS:
        raise cur.fail(f"{n_dims} dims (a ggml tensor has 1..{MAX_DIMS})", name)
    dims = tuple(cur.u64("tensor dim") for _ in range(n_dims))
    code = cur.u32("tensor type")
    offset = cur.u64("tensor offset")
    ggml_type = GGML_TYPES.get(code)
    if ggml_type is None:
        raise cur.fail(f"unknown ggml type {code}", name)
    if any(d < 1 or d > 1 << 40 for d in dims):
        raise cur.fail(f"dims {list(dims)} out of range (each in [1, 2^40])", name)
    if dims[0] % ggml_type.block_elems:
        raise cur.fail(f"row length {dims[0]} is not a multiple of the {ggml_type.name} block", name)
    return name, ggml_type, dims[::-1], offset


def _place_tensors(cur: _Cursor, infos: list[_Info], alignment: int, data_offset: int) -> dict[str, GGUFTensor]:
    tensors: dict[str, GGUFTensor] = {}
    data_bytes = cur.size - data_offset
    for name, ggml_type, shape, offset in infos:
        if name in tensors:
            raise cur.fail("duplicate tensor name", name)
        nbytes = math.prod(shape) // ggml_type.block_elems * ggml_type.block_bytes
        if offset % alignment:
            raise cur.fail(f"offset {offset} is not a multiple of the alignment {alignment}", name)
        if offset > data_bytes or nbytes > data_bytes - offset:
            raise cur.fail(
                f"bytes [{offset}, {offset + nbytes}) of the data section are out of range "
                f"(it has {data_bytes} bytes): truncated or a bad offset",
                name,
            )
        tensors[name] = GGUFTensor(name, cur.path, ggml_type, shape, data_offset + offset, nbytes)
    by_start = sorted(tensors.values(), key=lambda t: t.start)
    for prev, nxt in itertools.pairwise(by_start):
        if nxt.start < prev.start + prev.nbytes:
            raise cur.fail(f"overlaps {prev.name!r} (bytes from {nxt.start} < {prev.start + prev.nbytes})", nxt.name)
    return tensors
