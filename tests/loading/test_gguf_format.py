"""GGUF header parsing and block decoding against the ``gguf`` package, and every corruption's typed error.

Files are real: a tiny random Llama written by ``gguf.GGUFWriter`` (tests/support/gguf_files.py) and SmolLM2's own Q4_1
file where the test says so. Corrupted files are copies with real header bytes edited; the byte positions come
from ``gguf.GGUFReader``'s field offsets, not from the parser under test.
"""

from __future__ import annotations

import dataclasses
import os
import struct
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from support.gguf_files import write_tiny_gguf

from service.errors import GGUFError, GGUFUnsupported, HeaderError, TensorMismatch
from service.loading.gguf import read_gguf_header
from service.loading.gguf_blocks import Int4Rows, Int8Rows, RowReader

MIXED = {"token_embd": "Q8_0", "attn_v": "Q8_0", "ffn_down": "Q4_0", "attn_output": "F16", "output.": "BF16"}


@pytest.fixture(scope="module")
def tiny_gguf(tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_gguf(tiny_llama_dir, tmp_path_factory.mktemp("gguf") / "tiny.gguf", types=MIXED)


def _reader(path: Path) -> Any:
    import gguf

    return gguf.GGUFReader(str(path))


def _same_value(ours: Any, ref: Any) -> bool:
    if isinstance(ref, float):
        return bool(abs(ours - ref) <= 1e-7 * max(1.0, abs(ref)))
    return bool(ours == ref)


@pytest.mark.parametrize("version", [2, 3])
def test_header_matches_gguf_reader(tiny_llama_dir: Path, tmp_path: Path, version: int) -> None:
    path = write_tiny_gguf(tiny_llama_dir, tmp_path / "t.gguf", types=MIXED, version=version)
    ours, ref = read_gguf_header(path), _reader(path)
    assert ours.version == version
    assert ours.data_offset == ref.data_offset
    for key, field in ref.fields.items():
        if key.startswith("GGUF.") or key == "test.arr_nested":
            continue
        assert _same_value(ours.metadata[key], field.contents()), key
    assert ours.metadata["test.arr_nested"] == [[1, 2], [3]]  # GGUFReader flattens nested arrays
    assert set(ours.tensors) == {t.name for t in ref.tensors}
    for t in ref.tensors:
        mine = ours.tensors[t.name]
        assert (mine.start, mine.nbytes, mine.ggml_type.code) == (t.data_offset, t.n_bytes, int(t.tensor_type))
        assert list(mine.shape) == t.shape.tolist()[::-1]


def test_real_smollm2_header_matches_gguf_reader(smollm2_gguf: Path) -> None:
    ours, ref = read_gguf_header(smollm2_gguf), _reader(smollm2_gguf)
    assert len(ours.tensors) == len(ref.tensors) == 272
    for t in ref.tensors:
        mine = ours.tensors[t.name]
        assert (mine.start, mine.nbytes, mine.ggml_type.code) == (t.data_offset, t.n_bytes, int(t.tensor_type))
    for key, field in ref.fields.items():
        if not key.startswith("GGUF."):
            assert _same_value(ours.metadata[key], field.contents()), key


def test_header_reads_only_the_header(smollm2_gguf: Path) -> None:
    """The parser's reads end at the tensor table: the data section (98 % of the file) is never touched."""
    header = read_gguf_header(smollm2_gguf)
    with smollm2_gguf.open("rb") as f:
        read_gguf_header(smollm2_gguf, f)
        assert f.tell() <= header.data_offset


@pytest.mark.parametrize("chunk_bytes", [64, 4 << 20])
def test_blocks_decode_exactly_as_gguf_dequantize(tiny_gguf: Path, chunk_bytes: int) -> None:
    import gguf

    header = read_gguf_header(tiny_gguf)
    fd = os.open(tiny_gguf, os.O_RDONLY)
    try:
        reader = RowReader(fd, chunk_bytes=chunk_bytes)
        seen = set()
        for t in _reader(tiny_gguf).tensors:
            mine = header.tensors[t.name]
            ref = torch.from_numpy(gguf.dequantize(t.data, t.tensor_type).astype(np.float32)).reshape(mine.shape)
            dense = torch.empty(mine.shape)
            reader.read(mine, dense)
            torch.testing.assert_close(dense, ref, rtol=0, atol=0)
            kind = mine.ggml_type.name
            seen.add(kind)
            if kind in ("Q4_0", "Q4_1"):
                rows: Int4Rows | Int8Rows = Int4Rows.empty(*mine.shape)
            elif kind == "Q8_0":
                rows = Int8Rows.empty(*mine.shape)
            else:
                continue
            reader.read(mine, rows)
            torch.testing.assert_close(rows.dequantize(), ref, rtol=1e-6, atol=1e-7)
        assert seen == {"Q4_0", "Q4_1", "Q8_0", "F16", "BF16", "F32"}
    finally:
        os.close(fd)


def test_row_permutation_writes_each_row_once(tiny_gguf: Path) -> None:
    header = read_gguf_header(tiny_gguf)
    t = header.tensors["blk.0.attn_q.weight"]
    fd = os.open(tiny_gguf, os.O_RDONLY)
    try:
        reader = RowReader(fd, chunk_bytes=100)
        plain, permuted = Int4Rows.empty(*t.shape), Int4Rows.empty(*t.shape)
        reader.read(t, plain)
        order = torch.randperm(t.shape[0], generator=torch.Generator().manual_seed(0))
        reader.read(t, permuted, order)
    finally:
        os.close(fd)
    assert torch.equal(permuted.q[order], plain.q) and torch.equal(permuted.zero[order], plain.zero)


# --- corruption: each edit of real bytes, its typed error ------------------------------------------------


def _edit(src: Path, dst: Path, at: int, data: bytes) -> Path:
    raw = bytearray(src.read_bytes())
    raw[at : at + len(data)] = data
    dst.write_bytes(bytes(raw))
    return dst


def _tensor_field(path: Path, name: str) -> tuple[int, list[int]]:
    """(offset of the tensor-info field of ``name``, byte offsets of its parts: name len, name, n_dims, dims, type,
    offset) from ``GGUFReader``."""
    t = next(t for t in _reader(path).tensors if t.name == name)
    starts, pos = [], t.field.offset
    for part in t.field.parts:
        starts.append(pos)
        pos += part.nbytes
    return t.field.offset, starts


def _kv_value_at(path: Path, key: str) -> int:
    field = _reader(path).fields[key]
    return int(field.offset + sum(p.nbytes for p in field.parts[:3]))  # after key length, key, value type


def _expect(path: Path, match: str, tensor: str | None = None, kind: type[Exception] = GGUFError) -> None:
    with pytest.raises(kind, match=match) as info:
        read_gguf_header(path)
    err = info.value
    assert isinstance(err, HeaderError) and err.status == "INVALID_ARGUMENT"
    assert err.file == str(path) and err.tensor == tensor


def test_bad_magic(tiny_gguf: Path, tmp_path: Path) -> None:
    _expect(_edit(tiny_gguf, tmp_path / "x.gguf", 0, b"GGUX"), "bad magic")


@pytest.mark.parametrize("version", [1, 4, 0x03000000])
def test_bad_version(tiny_gguf: Path, tmp_path: Path, version: int) -> None:
    _expect(_edit(tiny_gguf, tmp_path / "x.gguf", 4, struct.pack("<I", version)), "unsupported GGUF version")


@pytest.mark.parametrize("cut", [3, 20, 600, -1])
def test_truncated_file(tiny_gguf: Path, tmp_path: Path, cut: int) -> None:
    """Cut in the fixed header, in the metadata, in the tensor table, and one byte short of the data's end."""
    raw = tiny_gguf.read_bytes()
    path = tmp_path / "x.gguf"
    path.write_bytes(raw[:cut])
    header_end = _tensor_field(tiny_gguf, _reader(tiny_gguf).tensors[-1].name)[1][-1]
    with pytest.raises(GGUFError, match="truncated") as info:
        read_gguf_header(path)
    assert info.value.file == str(path)
    if cut == -1 or cut > header_end:
        assert info.value.tensor is not None  # the data of a named tensor is cut


@pytest.mark.parametrize(
    ("where", "value", "match"),
    [
        (8, struct.pack("<Q", 1 << 62), "tensor count .* is absurd"),
        (16, struct.pack("<Q", 1 << 40), "metadata count .* is absurd"),
        (24, struct.pack("<Q", 1 << 50), "metadata key length .* is absurd"),
    ],
)
def test_absurd_counts_are_refused_before_allocation(
    tiny_gguf: Path, tmp_path: Path, where: int, value: bytes, match: str
) -> None:
    _expect(_edit(tiny_gguf, tmp_path / "x.gguf", where, value), match)


def test_absurd_string_and_array_lengths(tiny_gguf: Path, tmp_path: Path) -> None:
    at = _kv_value_at(tiny_gguf, "test.str")
    _expect(_edit(tiny_gguf, tmp_path / "s.gguf", at, struct.pack("<Q", 1 << 61)), "metadata string length")
    at = _kv_value_at(tiny_gguf, "test.arr_i32") + 4  # after the item type
    _expect(_edit(tiny_gguf, tmp_path / "a.gguf", at, struct.pack("<Q", 1 << 58)), "array length .* is absurd")


def test_unknown_ggml_type(tiny_gguf: Path, tmp_path: Path) -> None:
    _, parts = _tensor_field(tiny_gguf, "blk.0.ffn_up.weight")
    _expect(_edit(tiny_gguf, tmp_path / "x.gguf", parts[4], struct.pack("<I", 77)), "unknown ggml type 77",
            "blk.0.ffn_up.weight")  # fmt: skip


def test_offsets_misaligned_out_of_range_and_overlapping(tiny_gguf: Path, tmp_path: Path) -> None:
    name = "blk.1.ffn_up.weight"
    _, parts = _tensor_field(tiny_gguf, name)
    offset = int(next(t for t in _reader(tiny_gguf).tensors if t.name == name).field.parts[-1][0])
    _expect(_edit(tiny_gguf, tmp_path / "m.gguf", parts[5], struct.pack("<Q", offset + 4)), "not a multiple", name)
    _expect(_edit(tiny_gguf, tmp_path / "r.gguf", parts[5], struct.pack("<Q", 1 << 40)), "out of range", name)
    other = next(t for t in _reader(tiny_gguf).tensors if t.name == "blk.1.ffn_gate.weight")
    overlapping = _edit(tiny_gguf, tmp_path / "o.gguf", parts[5], struct.pack("<Q", int(other.field.parts[-1][0])))
    with pytest.raises(GGUFError, match="overlaps"):
        read_gguf_header(overlapping)


def test_bad_dims(tiny_gguf: Path, tmp_path: Path) -> None:
    name = "blk.0.attn_norm.weight"
    _, parts = _tensor_field(tiny_gguf, name)
    _expect(_edit(tiny_gguf, tmp_path / "d.gguf", parts[2], struct.pack("<I", 9)), "9 dims", name)
    _expect(_edit(tiny_gguf, tmp_path / "z.gguf", parts[3], struct.pack("<Q", 0)), "out of range", name)


def test_model_checks_unsupported_type_and_shape_mismatch(tiny_llama_dir: Path, tmp_path: Path) -> None:
    from service.model.config import ModelConfig
    from service.model.gguf_plan import check_gguf, gguf_targets

    cfg = ModelConfig.from_hf(tiny_llama_dir)
    q5 = write_tiny_gguf(tiny_llama_dir, tmp_path / "q5.gguf", types={"ffn_gate": "Q5_0"})
    with pytest.raises(GGUFUnsupported, match="Q5_0") as info:
        check_gguf(read_gguf_header(q5), cfg, gguf_targets(cfg))
    assert info.value.status == "FAILED_PRECONDITION" and info.value.tensor == "blk.0.ffn_gate.weight"

    good = write_tiny_gguf(tiny_llama_dir, tmp_path / "ok.gguf")
    name = "blk.1.ffn_down.weight"
    _, parts = _tensor_field(good, name)
    bad = _edit(good, tmp_path / "shape.gguf", parts[3] + 8, struct.pack("<Q", 32))  # rows 64 -> 32
    with pytest.raises(TensorMismatch, match=r"blk.1.ffn_down.weight: shape \[32, 96\]") as mismatch:
        check_gguf(read_gguf_header(bad), cfg, gguf_targets(cfg))
    assert mismatch.value.file == str(bad) and mismatch.value.status == "INVALID_ARGUMENT"
    other = dataclasses.replace(cfg, num_layers=3)
    with pytest.raises(TensorMismatch, match=r"llama\.block_count=2 but config\.json says 3"):
        check_gguf(read_gguf_header(good), other, gguf_targets(other))
