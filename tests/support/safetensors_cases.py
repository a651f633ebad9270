"""Test helpers for the loader: real safetensors files (written by the safetensors library) and hand-made
malformed ones (written with struct + json), so every rule of the format can be broken on purpose."""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file


def sample_tensors(seed: int = 0) -> dict[str, torch.Tensor]:
    """One tensor per dtype the loader must reproduce bit for bit, plus zero-size and 0-d tensors."""
    g = torch.Generator().manual_seed(seed)
    f32 = torch.randn(7, 13, generator=g)
    return {
        "f32": f32,
        "f16": torch.randn(5, 3, 4, generator=g).half(),
        "bf16": torch.randn(33, generator=g).bfloat16(),
        "f64": torch.randn(3, 3, generator=g).double(),
        "i64": torch.randint(-(2**40), 2**40, (4, 6), generator=g),
        "i32": torch.randint(-(2**31), 2**31 - 1, (9,), generator=g, dtype=torch.int32),
        "i16": torch.randint(-(2**15), 2**15 - 1, (2, 5), generator=g, dtype=torch.int16),
        "i8": torch.randint(-128, 127, (11,), generator=g, dtype=torch.int8),
        "u8": torch.randint(0, 255, (3, 17), generator=g, dtype=torch.uint8),
        "bool": torch.rand(19, generator=g) > 0.5,
        "empty": torch.zeros(0, 4),
        "empty_i64": torch.zeros(3, 0, dtype=torch.int64),
        "scalar": torch.tensor(3.25),
        "scalar_i32": torch.tensor(-7, dtype=torch.int32),
        # special float values must survive byte for byte
        "specials": torch.tensor([float("nan"), float("inf"), -float("inf"), -0.0, 1e-45]),
    }


def write_sharded(folder: Path, tensors: dict[str, torch.Tensor], n_shards: int, prefix: str = "model") -> Path:
    """Write ``tensors`` over ``n_shards`` files named like HF checkpoints, plus the index. Returns folder."""
    folder.mkdir(parents=True, exist_ok=True)
    names = sorted(tensors)
    weight_map: dict[str, str] = {}
    for i in range(n_shards):
        shard = f"{prefix}-{i + 1:05d}-of-{n_shards:05d}.safetensors"
        part = {n: tensors[n].contiguous() for n in names[i::n_shards]}
        save_file(part, str(folder / shard), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(part, shard))
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (folder / f"{prefix}.safetensors.index.json").write_text(json.dumps(index))
    return folder


def raw_file(path: Path, header: Any, data: bytes = b"", *, length: int | None = None, text: str | None = None) -> Path:
    """A file with any header at all: ``header`` as JSON (or ``text`` verbatim), an explicit ``length``
    field if given (else the true one), then ``data``."""
    body = (text if text is not None else json.dumps(header)).encode("utf-8")
    n = len(body) if length is None else length
    path.write_bytes(struct.pack("<Q", n) + body + data)
    return path


def entry(dtype: str, shape: list[int], begin: int, end: int) -> dict[str, Any]:
    return {"dtype": dtype, "shape": shape, "data_offsets": [begin, end]}
