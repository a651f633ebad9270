"""Fuzzing the safetensors header parser: valid-looking and mutated files give records or a ``HeaderError``.

Two properties over ``read_safetensors_header`` on real files:

- a header built to follow the format (names, dtypes, shapes, offsets that tile the data section) parses, and
  its records say exactly what was written;
- the same files damaged at the JSON level (a field replaced by any JSON value, offsets moved) or at the byte
  level (length prefix rewritten, bytes flipped, cut or spliced) raise only ``LoraplexError`` subclasses.
"""

from __future__ import annotations

import json
import math
import struct
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st
from support.fuzz import EDGE_INTS, fuzz_settings, json_values, text_mutations, typed_outcome

from service.errors import HeaderError, LoraplexError, ShardError
from service.loading import CheckpointIndex
from service.loading.header import DTYPES, read_safetensors_header

NAMES = st.text(st.characters(codec="utf-8"), min_size=1, max_size=12).filter(lambda s: s != "__metadata__")


@st.composite
def tensor_tables(draw: st.DrawFn) -> tuple[dict[str, Any], int]:
    """A header object that follows the format, and the size of the data section it describes."""
    names = draw(st.lists(NAMES, unique=True, max_size=5))
    header: dict[str, Any] = {}
    cursor = 0
    for name in names:
        dtype = draw(st.sampled_from(sorted(DTYPES)))
        shape = draw(st.lists(st.integers(0, 5), max_size=3))
        nbytes = math.prod(shape) * DTYPES[dtype].itemsize
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [cursor, cursor + nbytes]}
        cursor += nbytes
    if draw(st.booleans()):
        header["__metadata__"] = draw(st.dictionaries(st.text(max_size=6), st.text(max_size=6), max_size=3))
    if draw(st.booleans()):  # the order of keys in the JSON is free
        header = dict(reversed(list(header.items())))
    return header, cursor


def _write(path: Path, header_bytes: bytes, data: bytes, length: int | None = None) -> Path:
    n = len(header_bytes) if length is None else length
    path.write_bytes(struct.pack("<Q", n) + header_bytes + data)
    return path


@pytest.fixture(scope="module")
def scratch(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("fuzz_header") / "f.safetensors"


@fuzz_settings()
@given(table=tensor_tables(), pad=st.integers(0, 7))
def test_valid_headers_parse_to_what_was_written(scratch: Path, table: tuple[dict[str, Any], int], pad: int) -> None:
    header, data_size = table
    raw = json.dumps(header).encode() + b" " * pad  # the format allows trailing spaces in the header
    records, metadata = read_safetensors_header(_write(scratch, raw, bytes(data_size)))
    assert metadata == header.get("__metadata__", {})
    assert set(records) == set(header) - {"__metadata__"}
    for name, rec in records.items():
        begin, end = header[name]["data_offsets"]
        assert (rec.dtype, list(rec.shape)) == (header[name]["dtype"], header[name]["shape"])
        assert (rec.start, rec.nbytes) == (8 + len(raw) + begin, end - begin)


FIELDS = st.sampled_from(["dtype", "shape", "data_offsets"])


@st.composite
def damaged_headers(draw: st.DrawFn) -> tuple[dict[str, Any], int]:
    """A valid table with one field of one entry (or the entry, or __metadata__) replaced by any JSON value."""
    header, data_size = draw(tensor_tables())
    names = [n for n in header if n != "__metadata__"]
    target = draw(st.sampled_from([*names, "__metadata__", "extra"]))
    how = draw(st.sampled_from(["field", "entry", "offsets"])) if target in names else "entry"
    if how == "field":
        header[target][draw(FIELDS)] = draw(json_values())
    elif how == "offsets":
        header[target]["data_offsets"] = draw(st.lists(EDGE_INTS, min_size=2, max_size=2))
    else:
        header[target] = draw(json_values())
    return header, data_size + draw(st.sampled_from([0, 0, 1, -1]))


@fuzz_settings()
@given(table=damaged_headers())
def test_damaged_json_fields_raise_only_header_errors(scratch: Path, table: tuple[dict[str, Any], int]) -> None:
    header, data_size = table
    raw = json.dumps(header).encode()
    outcome = typed_outcome(lambda: read_safetensors_header(_write(scratch, raw, bytes(max(data_size, 0)))))
    if isinstance(outcome, LoraplexError):
        assert isinstance(outcome, HeaderError) and outcome.file == str(scratch)


@st.composite
def damaged_files(draw: st.DrawFn) -> tuple[bytes, bytes, int | None]:
    """(header bytes, data, length prefix or None for the true length): text and byte level damage."""
    header, data_size = draw(tensor_tables())
    text = draw(text_mutations(json.dumps(header)))
    raw = bytearray(text.encode("utf-8", "surrogatepass"))
    for _ in range(draw(st.integers(0, 3))):  # flip a few bytes (invalid UTF-8 among them)
        if raw:
            raw[draw(st.integers(0, len(raw) - 1))] = draw(st.integers(0, 255))
    length = draw(st.one_of(st.none(), st.sampled_from([0, 1, 7, 2**63, 2**64 - 1]), st.integers(0, len(raw) + 16)))
    data = bytes(draw(st.integers(0, data_size + 8)))
    return bytes(raw), data, length


@fuzz_settings()
@given(case=damaged_files())
def test_damaged_bytes_raise_only_typed_errors(scratch: Path, case: tuple[bytes, bytes, int | None]) -> None:
    raw, data, length = case
    outcome = typed_outcome(lambda: read_safetensors_header(_write(scratch, raw, data, length)))
    if isinstance(outcome, LoraplexError):
        assert isinstance(outcome, HeaderError) and outcome.file == str(scratch)


@pytest.mark.parametrize("digits", [4301, 20_000])
def test_integer_too_long_for_python_is_a_header_error(scratch: Path, digits: int) -> None:
    # Found by the fuzzer: json.loads raised a plain ValueError (int() digit limit), not a HeaderError.
    raw = ('{"a": {"dtype": "F32", "shape": [' + "1" * digits + '], "data_offsets": [0, 4]}}').encode()
    with pytest.raises(HeaderError, match="not valid JSON"):
        read_safetensors_header(_write(scratch, raw, bytes(4)))


@pytest.mark.parametrize("field", ["dtype", "shape", "data_offsets"])
def test_a_huge_bad_value_is_not_echoed_whole(scratch: Path, field: str) -> None:
    # Seen while fuzzing: the message repeated the bad value whole, as large as the header (here ~1 MB).
    entry: dict[str, Any] = {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}
    entry[field] = "x" * 1_000_000 if field == "dtype" else [-1] * 250_000
    with pytest.raises(HeaderError) as err:
        read_safetensors_header(_write(scratch, json.dumps({"a": entry}).encode(), bytes(4)))
    assert len(str(err.value)) < 500


@pytest.mark.parametrize(
    "text", ['{"weight_map": {"a": "x.safetensors"}, "n": ' + "9" * 5000 + "}", "[" * 100_000 + "]" * 100_000]
)
def test_a_shard_index_past_json_limits_is_a_shard_error(tmp_path: Path, text: str) -> None:
    # The header's defect (found by its fuzzer), looked for and found in the shard index: ValueError / RecursionError.
    (tmp_path / "model.safetensors.index.json").write_text(text)
    with pytest.raises(ShardError, match="cannot read the shard index"):
        CheckpointIndex.open(tmp_path)
