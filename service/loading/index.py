"""Checkpoint folders: one name -> record map over a single file, a sharded folder, or a folder of files.

Opening a checkpoint reads every file's header once (and nothing else), checks that the files agree with
each other and with ``model.safetensors.index.json`` when there is one, and keeps the records. Loading is
then a pure function of records and destinations (see ``loader``).
"""

from __future__ import annotations

import json
import re
import time
from dataclasses import dataclass, field
from pathlib import Path

from service.errors import ShardError
from service.loading.header import TensorRecord, read_safetensors_header

__all__ = ["SHARD_INDEX", "SINGLE_FILE", "CheckpointIndex"]

SINGLE_FILE = "model.safetensors"
SHARD_INDEX = "model.safetensors.index.json"
_SHARD_NAME = re.compile(r"^(?P<prefix>.+)-(?P<i>\d+)-of-(?P<n>\d+)\.safetensors$")


@dataclass
class CheckpointIndex:
    """Every tensor of a checkpoint, by name, with the files that hold them (in a stable order)."""

    root: Path
    tensors: dict[str, TensorRecord]
    files: tuple[Path, ...]
    header_seconds: float = 0.0  # time open() spent reading and validating headers
    metadata: dict[Path, dict[str, str]] = field(default_factory=dict)  # each file's __metadata__

    @property
    def nbytes(self) -> int:
        return sum(r.nbytes for r in self.tensors.values())

    @classmethod
    def open(cls, path: Path) -> CheckpointIndex:
        """A folder with model.safetensors, or sharded with model.safetensors.index.json, or any folder of
        *.safetensors files (adapters use that), or a single .safetensors file."""
        path = Path(path)
        t0 = time.perf_counter()
        if path.is_file():
            is_index = path.name.endswith(".index.json")
            index = _open_sharded(path) if is_index else _open_files(path.parent, (path,))
        elif path.is_dir():
            if (path / SHARD_INDEX).is_file():
                index = _open_sharded(path / SHARD_INDEX)
            elif (path / SINGLE_FILE).is_file():
                index = _open_files(path, (path / SINGLE_FILE,))
            else:
                files = tuple(sorted(p for p in path.glob("*.safetensors") if p.is_file()))
                if not files:
                    raise ShardError("folder holds no .safetensors file", file=path)
                index = _open_files(path, files)
        else:
            raise ShardError("no such file or folder", file=path)
        index.header_seconds = time.perf_counter() - t0
        return index


def _open_files(root: Path, files: tuple[Path, ...]) -> CheckpointIndex:
    tensors: dict[str, TensorRecord] = {}
    metadata: dict[Path, dict[str, str]] = {}
    for file in files:
        records, meta = read_safetensors_header(file)
        metadata[file] = meta
        for name, record in records.items():
            other = tensors.get(name)
            if other is not None:
                raise ShardError(f"tensor is in two files: {other.file} and {file}", file=file, tensor=name)
            tensors[name] = record
    return CheckpointIndex(root=root, tensors=tensors, files=files, metadata=metadata)


def _open_sharded(index_path: Path) -> CheckpointIndex:
    root = index_path.parent
    try:
        doc = json.loads(index_path.read_text(encoding="utf-8"))
    except (OSError, ValueError, RecursionError) as e:  # ValueError: bad UTF-8 / JSON, a number past int()'s limit
        raise ShardError(f"cannot read the shard index: {e}", file=index_path) from None
    weight_map = doc.get("weight_map") if isinstance(doc, dict) else None
    if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
        raise ShardError("'weight_map' must map tensor names to shard file names", file=index_path)

    shard_names = sorted(set(weight_map.values()))
    files: list[Path] = []
    for shard in shard_names:
        file = root / shard
        # A shard name is a plain file name in the same folder: no absolute paths, no '..'.
        if Path(shard).name != shard or shard in ("", ".", ".."):
            raise ShardError(f"shard name {shard!r} is not a file name in {root}", file=index_path)
        if not file.is_file():
            raise ShardError(f"the index names shard {shard!r}, which does not exist", file=file)
        files.append(file)
    _check_no_unnamed_shards(root, shard_names, index_path)

    index = _open_files(root, tuple(files))  # raises on duplicate names across shards
    for name, shard in weight_map.items():
        record = index.tensors.get(name)
        if record is None or record.file.name != shard:
            raise ShardError(
                f"the index places the tensor in {shard!r}, but that shard does not hold it",
                file=root / shard,
                tensor=name,
            )
    for name, record in index.tensors.items():
        if name not in weight_map:
            raise ShardError("the shard holds a tensor that the index does not list", file=record.file, tensor=name)
    return index


def _check_no_unnamed_shards(root: Path, named: list[str], index_path: Path) -> None:
    """A file of the same numbered series ("model-00003-of-00004.safetensors") that the index omits means the
    index is stale or incomplete. Unrelated .safetensors files in the folder are left alone."""
    series = {(m["prefix"], m["n"]) for m in map(_SHARD_NAME.match, named) if m}
    if not series:
        return
    for file in sorted(root.glob("*.safetensors")):
        m = _SHARD_NAME.match(file.name)
        if m and (m["prefix"], m["n"]) in series and file.name not in named:
            raise ShardError(f"shard {file.name!r} is not named by the index {index_path.name}", file=file)
