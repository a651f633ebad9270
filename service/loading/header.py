"""Safetensors headers: parse one file's header into tensor records and validate it against the format.

A safetensors file is ``u64 little-endian N`` + ``N bytes of JSON`` + a data section. The JSON maps each
tensor name to ``{"dtype", "shape", "data_offsets": [begin, end]}`` (offsets relative to the data section)
and may hold a ``__metadata__`` map of strings. We accept exactly what the reference Rust crate accepts:
the header is at most 100 MB, valid UTF-8 JSON starting with ``{``; the tensors, sorted by offset, tile the
data section from byte 0 to its last byte with no gap and no overlap; each tensor's byte count equals
``numel × itemsize``. Every violation raises :class:`~service.errors.HeaderError` naming the file (and the
tensor where there is one). Only the header bytes are read.
"""

from __future__ import annotations

import json
import math
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from service.errors import HeaderError

__all__ = ["DTYPES", "MAX_HEADER_BYTES", "TensorRecord", "read_safetensors_header"]

MAX_HEADER_BYTES = 100_000_000  # same bound as the safetensors crate
_LEN = struct.Struct("<Q")


def _dtype_table() -> dict[str, torch.dtype]:
    table: dict[str, torch.dtype] = {
        "F64": torch.float64,
        "F32": torch.float32,
        "F16": torch.float16,
        "BF16": torch.bfloat16,
        "I64": torch.int64,
        "I32": torch.int32,
        "I16": torch.int16,
        "I8": torch.int8,
        "U8": torch.uint8,
        "BOOL": torch.bool,
        "C64": torch.complex64,
    }
    # Optional dtypes: present only in torch builds that define them.
    for code, attr in (
        ("F8_E4M3", "float8_e4m3fn"),
        ("F8_E5M2", "float8_e5m2"),
        ("F8_E4M3FNUZ", "float8_e4m3fnuz"),
        ("F8_E5M2FNUZ", "float8_e5m2fnuz"),
        ("F8_E8M0", "float8_e8m0fnu"),
        ("U16", "uint16"),
        ("U32", "uint32"),
        ("U64", "uint64"),
    ):
        dt = getattr(torch, attr, None)
        if isinstance(dt, torch.dtype):
            table[code] = dt
    return table


DTYPES: dict[str, torch.dtype] = _dtype_table()
"""safetensors dtype code -> torch dtype, for every code this torch build can hold."""


@dataclass(frozen=True, slots=True)
class TensorRecord:
    """Where one tensor lives: ``nbytes`` bytes at absolute offset ``start`` of ``file``."""

    name: str
    file: Path
    dtype: str
    shape: tuple[int, ...]
    start: int
    nbytes: int

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


def _is_uint(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _short(value: Any, limit: int = 200) -> str:
    """``repr(value)`` cut to ``limit`` characters: a value from a header can be as large as the header."""
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def read_safetensors_header(path: Path) -> tuple[dict[str, TensorRecord], dict[str, str]]:
    """Parse + validate one file's header (records, __metadata__). Reads only the header bytes."""
    path = Path(path)
    try:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            if size < _LEN.size:
                raise HeaderError(f"file is truncated: {size} bytes, shorter than the 8-byte header length", file=path)
            (n,) = _LEN.unpack(f.read(_LEN.size))
            if n > MAX_HEADER_BYTES:
                raise HeaderError(f"header length {n} is larger than the {MAX_HEADER_BYTES}-byte limit", file=path)
            if _LEN.size + n > size:
                raise HeaderError(f"header length {n} runs past the end of the file ({size} bytes)", file=path)
            raw = f.read(n)
    except OSError as e:
        raise HeaderError(f"cannot read the header: {e}", file=path) from e
    if len(raw) != n:
        raise HeaderError(f"file is truncated inside its {n}-byte header", file=path)
    return _parse(raw, path, data_size=size - _LEN.size - n, data_start=_LEN.size + n)


def _parse(
    raw: bytes, path: Path, *, data_size: int, data_start: int
) -> tuple[dict[str, TensorRecord], dict[str, str]]:
    obj = _json_object(raw, path)
    metadata: dict[str, str] = {}
    raw_meta = obj.pop("__metadata__", None)
    if raw_meta is not None:
        if not isinstance(raw_meta, dict) or not all(isinstance(v, str) for v in raw_meta.values()):
            raise HeaderError("__metadata__ must map strings to strings", file=path)
        metadata = dict(raw_meta)
    entries = {name: _entry(name, info, path, data_size) for name, info in obj.items()}
    _check_tiling(entries, path, data_size)
    records = {
        name: TensorRecord(name=name, file=path, dtype=dtype, shape=shape, start=data_start + begin, nbytes=end - begin)
        for name, (dtype, shape, begin, end) in entries.items()
    }
    return records, metadata


def _json_object(raw: bytes, path: Path) -> dict[str, Any]:
    """The header bytes as a JSON object: UTF-8, starting with '{', no duplicate key at any depth."""

    def unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for key, value in pairs:
            if key in out:
                raise HeaderError(f"duplicate key {key!r} in the JSON header", file=path, tensor=key)
            out[key] = value
        return out

    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise HeaderError(f"header is not valid UTF-8: {e}", file=path) from None
    if not text.startswith("{"):
        raise HeaderError("header does not start with '{'", file=path)
    try:
        obj = json.loads(text, object_pairs_hook=unique_keys)
    except ValueError as e:  # JSONDecodeError, and an integer too long for int() (sys.get_int_max_str_digits)
        raise HeaderError(f"header is not valid JSON: {e}", file=path) from None
    except RecursionError:
        raise HeaderError("header JSON is nested too deeply", file=path) from None
    if not isinstance(obj, dict):
        raise HeaderError("header is not a JSON object", file=path)
    return obj


def _entry(name: str, info: Any, path: Path, data_size: int) -> tuple[str, tuple[int, ...], int, int]:
    """One tensor's entry, checked: (dtype, shape, begin, end), offsets relative to the data section."""

    def error(message: str) -> HeaderError:
        return HeaderError(message, file=path, tensor=name)

    if not isinstance(info, dict):
        raise error("entry is not a JSON object")
    dtype = info.get("dtype")
    if not isinstance(dtype, str):
        raise error("missing or non-string 'dtype'")
    if dtype not in DTYPES:
        raise error(f"unknown or unsupported dtype {_short(dtype)}")
    shape = info.get("shape")
    if not isinstance(shape, list) or not all(_is_uint(d) for d in shape):
        raise error(f"'shape' must be a list of non-negative integers, got {_short(shape)}")
    offsets = info.get("data_offsets")
    if not isinstance(offsets, list) or len(offsets) != 2 or not all(_is_uint(o) for o in offsets):
        raise error(f"'data_offsets' must be [begin, end], got {_short(offsets)}")
    begin, end = offsets
    if end < begin:
        raise error(f"data_offsets [{begin}, {end}] end before they begin")
    if end > data_size:
        raise error(
            f"data_offsets [{begin}, {end}] are out of range: the data section has {data_size} bytes (file truncated?)"
        )
    itemsize = DTYPES[dtype].itemsize
    expected = math.prod(shape) * itemsize
    if end - begin != expected:
        raise error(f"holds {end - begin} bytes but shape {tuple(shape)} × {dtype} ({itemsize} B) needs {expected}")
    return dtype, tuple(shape), begin, end


def _check_tiling(entries: dict[str, tuple[str, tuple[int, ...], int, int]], path: Path, data_size: int) -> None:
    """Like the reference crate: sorted by offset, the tensors tile the data section exactly."""
    spans = sorted((begin, end, name) for name, (_, _, begin, end) in entries.items())
    cursor, previous = 0, None
    for begin, end, name in spans:
        if begin < cursor:
            raise HeaderError(f"data_offsets [{begin}, {end}] overlap tensor {previous!r}", file=path, tensor=name)
        if begin > cursor:
            after = f"after tensor {previous!r}" if previous is not None else "at the start of the data section"
            raise HeaderError(f"bytes [{cursor}, {begin}) {after} belong to no tensor (gap)", file=path, tensor=name)
        cursor, previous = end, name
    if cursor != data_size:
        raise HeaderError(f"the tensors cover {cursor} bytes but the data section has {data_size}", file=path)
