"""Header and folder validation: every way a safetensors file or sharded folder can be malformed raises a
typed error naming the file (and the tensor), and what safetensors itself accepts we accept too."""

from __future__ import annotations

import json
import struct
from collections.abc import Callable
from pathlib import Path

import pytest
import safetensors
import torch
from safetensors.torch import save_file
from support.safetensors_cases import entry, raw_file, sample_tensors, write_sharded

from service.errors import CheckpointError, HeaderError, ShardError
from service.loading import MAX_HEADER_BYTES, CheckpointIndex, read_safetensors_header


def _safetensors_rejects(path: Path) -> bool:
    try:
        with safetensors.safe_open(str(path), framework="pt") as f:
            for k in f.keys():  # noqa: SIM118 - safe_open has no __iter__
                f.get_tensor(k)
    except Exception:
        return True
    return False


def test_header_records_match_the_file(tmp_path: Path) -> None:
    tensors = sample_tensors()
    path = tmp_path / "a.safetensors"
    save_file(tensors, str(path), metadata={"format": "pt", "note": "x"})
    records, meta = read_safetensors_header(path)
    assert meta == {"format": "pt", "note": "x"}
    assert set(records) == set(tensors)
    raw = path.read_bytes()
    for name, t in tensors.items():
        rec = records[name]
        assert rec.file == path and rec.shape == tuple(t.shape) and rec.torch_dtype == t.dtype
        assert rec.nbytes == t.numel() * t.element_size()
        got = torch.frombuffer(bytearray(raw[rec.start : rec.start + rec.nbytes]) or bytearray(1), dtype=torch.uint8)
        want = t.contiguous().reshape(-1).view(torch.uint8) if t.numel() else torch.zeros(0, dtype=torch.uint8)
        assert torch.equal(got[: rec.nbytes], want)


GOOD = {"a": entry("F32", [2], 0, 8), "b": entry("I8", [3], 8, 11)}
GOOD_DATA = bytes(range(11))

# (case id, header object or raw text, data, explicit length, tensor the error must name or None)
MALFORMED = [
    ("unknown dtype", {"a": entry("F33", [2], 0, 8)}, bytes(8), None, "a"),
    ("sub-byte dtype", {"a": entry("F4", [2], 0, 1)}, bytes(1), None, "a"),
    ("offsets out of range", {"a": entry("F32", [4], 0, 16)}, bytes(8), None, "a"),
    ("end before begin", {"a": entry("F32", [0], 8, 0)}, bytes(8), None, "a"),
    ("byte count vs shape", {"a": entry("F32", [3], 0, 8)}, bytes(8), None, "a"),
    ("overlap", {"a": entry("F32", [2], 0, 8), "b": entry("F32", [1], 4, 8)}, bytes(8), None, "b"),
    ("gap", {"a": entry("F32", [1], 0, 4), "b": entry("F32", [1], 8, 12)}, bytes(12), None, "b"),
    ("gap at start", {"a": entry("F32", [1], 4, 8)}, bytes(8), None, "a"),
    ("trailing bytes", {"a": entry("F32", [1], 0, 4)}, bytes(8), None, None),
    ("negative dim", {"a": entry("F32", [-1], 0, 0)}, b"", None, "a"),
    ("shape not a list", {"a": {"dtype": "F32", "shape": 4, "data_offsets": [0, 16]}}, bytes(16), None, "a"),
    ("offsets not a pair", {"a": {"dtype": "F32", "shape": [1], "data_offsets": [0]}}, bytes(4), None, "a"),
    ("missing dtype", {"a": {"shape": [1], "data_offsets": [0, 4]}}, bytes(4), None, "a"),
    ("entry not an object", {"a": [1, 2]}, b"", None, "a"),
    ("metadata not strings", {"__metadata__": {"k": 1}, **GOOD}, GOOD_DATA, None, None),
    ("header not an object", [1, 2], b"", None, None),
    ("invalid json", '{"a": {"dtype": "F32",', b"", None, None),
    ("not utf-8", None, b"", None, None),
    ("does not start with brace", ' {"a": 1}', b"", None, None),
    ("duplicate key", '{"a": {"dtype":"U8","shape":[1],"data_offsets":[0,1]}, "a": {}}', b"\0", None, "a"),
]


@pytest.mark.parametrize(("case", "header", "data", "length", "tensor"), MALFORMED, ids=[c[0] for c in MALFORMED])
def test_malformed_headers_raise_typed_errors(
    tmp_path: Path, case: str, header: object, data: bytes, length: int | None, tensor: str | None
) -> None:
    path = tmp_path / "bad.safetensors"
    if case == "not utf-8":
        body = b'{"\xff": 1}'
        path.write_bytes(struct.pack("<Q", len(body)) + body)
    elif isinstance(header, str):
        raw_file(path, None, data, text=header, length=length)
    else:
        raw_file(path, header, data, length=length)
    with pytest.raises(HeaderError) as info:
        read_safetensors_header(path)
    assert info.value.file == str(path)
    assert info.value.tensor == tensor
    assert str(path) in str(info.value)
    # The reference implementation refuses the same files (we are not stricter than the format), except
    # for sub-byte float types, which are valid safetensors but have no torch dtype to load them into.
    if case != "sub-byte dtype":
        assert _safetensors_rejects(path), case


def test_well_formed_hand_made_file_is_accepted(tmp_path: Path) -> None:
    path = raw_file(tmp_path / "ok.safetensors", {"__metadata__": {"k": "v"}, **GOOD}, GOOD_DATA)
    records, meta = read_safetensors_header(path)
    assert meta == {"k": "v"} and records["b"].start == path.stat().st_size - 3
    assert not _safetensors_rejects(path)


def test_header_padding_and_zero_size_tensors_at_the_same_offset(tmp_path: Path) -> None:
    header = {"z1": entry("F32", [0], 0, 0), "z2": entry("I64", [0, 3], 0, 0), "a": entry("U8", [2], 0, 2)}
    path = raw_file(tmp_path / "z.safetensors", None, b"\1\2", text=json.dumps(header) + "    ")
    records, _ = read_safetensors_header(path)
    assert records["z1"].nbytes == 0 and records["a"].nbytes == 2
    assert not _safetensors_rejects(path)


def test_truncated_file(tmp_path: Path) -> None:
    good = tmp_path / "good.safetensors"
    save_file({"w": torch.randn(64, 64)}, str(good))
    raw = good.read_bytes()
    for cut in (3, 8, 20, len(raw) - 1):
        bad = tmp_path / f"cut{cut}.safetensors"
        bad.write_bytes(raw[:cut])
        with pytest.raises(HeaderError) as info:
            read_safetensors_header(bad)
        assert info.value.file == str(bad)


def test_header_length_past_end_of_file(tmp_path: Path) -> None:
    path = raw_file(tmp_path / "a.safetensors", GOOD, GOOD_DATA, length=10_000)
    with pytest.raises(HeaderError, match="past the end"):
        read_safetensors_header(path)


def test_absurd_header_length_is_refused_without_reading(tmp_path: Path) -> None:
    path = tmp_path / "huge.safetensors"
    path.write_bytes(struct.pack("<Q", 2**63) + b"{}")
    with pytest.raises(HeaderError, match="limit"):
        read_safetensors_header(path)
    path.write_bytes(struct.pack("<Q", MAX_HEADER_BYTES + 1) + b"{}")
    with pytest.raises(HeaderError, match="limit"):
        read_safetensors_header(path)


def test_missing_file(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError):
        read_safetensors_header(tmp_path / "nope.safetensors")
    with pytest.raises(ShardError):
        CheckpointIndex.open(tmp_path / "nope")


# ---------------------------------------------------------------------------------------------------- folders


def test_open_single_file_folder_and_file(tmp_path: Path) -> None:
    tensors = sample_tensors()
    save_file(tensors, str(tmp_path / "model.safetensors"))
    for target in (tmp_path, tmp_path / "model.safetensors"):
        index = CheckpointIndex.open(target)
        assert set(index.tensors) == set(tensors)
        assert index.files == (tmp_path / "model.safetensors",)
        assert index.header_seconds > 0


def test_open_sharded_folder(tmp_path: Path) -> None:
    tensors = sample_tensors()
    write_sharded(tmp_path, tensors, 3)
    index = CheckpointIndex.open(tmp_path)
    assert set(index.tensors) == set(tensors) and len(index.files) == 3
    assert CheckpointIndex.open(tmp_path / "model.safetensors.index.json").tensors == index.tensors
    assert index.nbytes == sum(t.numel() * t.element_size() for t in tensors.values())


def test_open_folder_of_files(tmp_path: Path) -> None:
    save_file({"a": torch.ones(2)}, str(tmp_path / "adapter_model.safetensors"))
    save_file({"b": torch.ones(3)}, str(tmp_path / "medusa_lm_head.safetensors"))
    index = CheckpointIndex.open(tmp_path)
    assert set(index.tensors) == {"a", "b"} and len(index.files) == 2


def test_empty_folder(tmp_path: Path) -> None:
    with pytest.raises(ShardError, match=r"no \.safetensors"):
        CheckpointIndex.open(tmp_path)


def test_duplicate_tensor_across_files(tmp_path: Path) -> None:
    save_file({"a": torch.ones(2)}, str(tmp_path / "one.safetensors"))
    save_file({"a": torch.ones(2), "b": torch.ones(1)}, str(tmp_path / "two.safetensors"))
    with pytest.raises(ShardError) as info:
        CheckpointIndex.open(tmp_path)
    assert info.value.tensor == "a" and "one.safetensors" in str(info.value)


def _open_with_weight_map(
    folder: Path, shards: int, edit: Callable[[dict[str, str]], dict[str, str]], match: str | None = None
) -> ShardError:
    """Write ``sample_tensors()`` as ``shards`` shards, replace the index's weight map with ``edit(weight_map)``
    and return the ``ShardError`` that opening the folder raises."""
    write_sharded(folder, sample_tensors(), shards)
    path = folder / "model.safetensors.index.json"
    doc = json.loads(path.read_text())
    assert isinstance(doc["weight_map"], dict)
    doc["weight_map"] = edit(doc["weight_map"])
    path.write_text(json.dumps(doc))
    with pytest.raises(ShardError, match=match) as info:
        CheckpointIndex.open(folder)
    return info.value


def test_index_points_to_missing_shard(tmp_path: Path) -> None:
    write_sharded(tmp_path, sample_tensors(), 2)
    (tmp_path / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(ShardError, match="does not exist") as info:
        CheckpointIndex.open(tmp_path)
    assert info.value.file is not None and info.value.file.endswith("model-00002-of-00002.safetensors")


def test_index_names_tensor_absent_from_its_shard(tmp_path: Path) -> None:
    error = _open_with_weight_map(tmp_path, 2, lambda m: {**m, "ghost": "model-00001-of-00002.safetensors"})
    assert error.tensor == "ghost"


def test_index_places_tensor_in_the_wrong_shard(tmp_path: Path) -> None:
    moved: list[str] = []

    def move(weight_map: dict[str, str]) -> dict[str, str]:
        moved.append(next(n for n, s in weight_map.items() if s.startswith("model-00001")))
        return {**weight_map, moved[0]: "model-00002-of-00002.safetensors"}

    assert _open_with_weight_map(tmp_path, 2, move).tensor == moved[0]


def test_shard_holds_tensor_the_index_omits(tmp_path: Path) -> None:
    error = _open_with_weight_map(tmp_path, 2, lambda m: {n: s for n, s in m.items() if n != "f32"})
    assert error.tensor == "f32"


def test_shard_of_the_series_not_named_by_the_index(tmp_path: Path) -> None:
    def drop_third(weight_map: dict[str, str]) -> dict[str, str]:
        return {n: s for n, s in weight_map.items() if not s.startswith("model-00003")}

    error = _open_with_weight_map(tmp_path, 3, drop_third, match="not named by the index")
    assert error.file is not None and error.file.endswith("model-00003-of-00003.safetensors")


def test_duplicate_tensor_across_shards(tmp_path: Path) -> None:
    write_sharded(tmp_path, {"a": torch.ones(2), "b": torch.ones(3)}, 2)
    save_file({"a": torch.ones(2), "b": torch.ones(3)}, str(tmp_path / "model-00002-of-00002.safetensors"))
    with pytest.raises(ShardError, match="two files"):
        CheckpointIndex.open(tmp_path)


@pytest.mark.parametrize("doc", ["not json", "[1]", '{"weight_map": {"a": 3}}', '{"weight_map": {"a": "../x"}}'])
def test_bad_index_documents(tmp_path: Path, doc: str) -> None:
    write_sharded(tmp_path, {"a": torch.ones(2)}, 1)
    (tmp_path / "model.safetensors.index.json").write_text(doc)
    with pytest.raises(ShardError):
        CheckpointIndex.open(tmp_path)


def test_malformed_shard_names_its_file(tmp_path: Path) -> None:
    write_sharded(tmp_path, sample_tensors(), 2)
    shard = tmp_path / "model-00002-of-00002.safetensors"
    shard.write_bytes(shard.read_bytes()[:-5])
    with pytest.raises(HeaderError) as info:
        CheckpointIndex.open(tmp_path)
    assert info.value.file == str(shard)
