"""``loraplex convert medusa``: FasterDecoding's medusa-1 ``medusa_lm_head.pt`` into the layout served here.

The reference medusa-1 code saves ``medusa_head.state_dict()`` with ``torch.save``: a pickle holding, per head
``h``, the residual blocks ``{h}.{l}.linear.weight`` / ``.bias`` and the head's own projection ``{h}.{n}.weight``.
Its heads repeat *one* block module ``n`` times, so with ``medusa_num_layers > 1`` the names of a head's blocks
are views of the same tensor, which ``safetensors.torch.save_file`` refuses ("Some tensors share memory"). Here
every tensor is copied into fresh stacked buffers, so each name owns its bytes in the written file.

The pickle is opened only with ``torch.load(weights_only=True)``: no code from it can run (and memory-mapped when
it is in torch's zip format, so only the stacked copies are held in memory). The structure (heads,
blocks, v1 projections or not) is read from the tensor names and checked (shapes, one dtype, finite values) before
anything is written; the output is ``config.json`` + ``medusa_lm_head.safetensors`` in a folder that did not exist
(written beside it and renamed, so a failed conversion leaves nothing behind). Every problem is an
``InvalidAdapter`` naming the file and, where there is one, the tensor.
"""

from __future__ import annotations

import pickle
import re
import shutil
import zipfile
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from service.adapters.common.files import check_finite, read_json_object
from service.adapters.medusa.format import CONFIG_FILE, FLOAT_CODES, PICKLE_FILES, PREFIX, write_medusa
from service.errors import InvalidAdapter

__all__ = ["Converted", "convert_medusa", "find_pickle"]

_NAME = re.compile(r"(?P<head>\d+)\.(?P<index>\d+)\.(?:linear\.(?P<part>weight|bias)|weight)")
_FLOAT_DTYPES = {torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16", torch.float64: "F64"}


@dataclass(frozen=True, slots=True)
class Converted:
    """What ``convert_medusa`` wrote, and what it noticed on the way (``notes``: for the user to read)."""

    folder: Path
    num_heads: int
    num_layers: int
    version: int
    dtype: torch.dtype
    shared_tensors: int  # names whose bytes another name of the pickle shared (written as copies)
    notes: tuple[str, ...]


def find_pickle(source: Path) -> Path:
    """``source`` itself if it is a file, else the first of ``PICKLE_FILES`` in the folder ``source``."""
    source = Path(source)
    if source.is_file():
        return source
    if not source.is_dir():
        raise InvalidAdapter("no such file or folder", file=source)
    for name in PICKLE_FILES:
        if (source / name).is_file():
            return source / name
    raise InvalidAdapter(f"no {' / '.join(PICKLE_FILES)} in the folder", file=source)


def convert_medusa(source: Path, destination: Path) -> Converted:
    """Convert the pickled heads at ``source`` (the file, or its folder) into a new Medusa folder ``destination``.

    ``config.json`` beside the pickle, when present, gives ``base_model_name_or_path``; the head and block counts
    come from the tensors (a config that disagrees is reported in ``notes``)."""
    pt = find_pickle(source)
    destination = Path(destination)
    if destination.exists() and (not destination.is_dir() or any(destination.iterdir())):
        raise InvalidAdapter("the destination exists and is not an empty folder; choose a new one", file=destination)
    tensors = _load_pickle(pt)
    shared = _count_shared(tensors)
    n_heads, n_layers, version = _structure(tensors, pt)
    weight, bias, out, dtype = _stack(tensors, n_heads, n_layers, version, pt)
    config_path = pt.parent / CONFIG_FILE
    config = read_json_object(config_path, "") if config_path.is_file() else {}
    notes = _compare_config(config, n_heads, n_layers, config_path)
    base = config.get("base_model_name_or_path")
    staging = destination.with_name(f".{destination.name}.converting")
    shutil.rmtree(staging, ignore_errors=True)
    try:
        write_medusa(
            staging, weight, bias, out, version=version, base_model=base if isinstance(base, str) else None,
            metadata={"format": "pt", "converted_from": pt.name},
        )  # fmt: skip
        if destination.exists():
            destination.rmdir()  # empty, checked above
        staging.rename(destination)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return Converted(destination, n_heads, n_layers, version, dtype, shared, tuple(notes))


def _load_pickle(pt: Path) -> dict[str, torch.Tensor]:
    """The pickle's ``{name: tensor}``, loaded with ``weights_only=True``; the ``medusa_head.`` prefix removed."""
    try:  # a zip-format pickle (torch >= 1.6) is mapped, not read whole; the legacy format has to be read
        raw: Any = torch.load(pt, map_location="cpu", weights_only=True, mmap=zipfile.is_zipfile(pt))
    except (pickle.UnpicklingError, RuntimeError, EOFError, ValueError, OSError) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise InvalidAdapter(f"cannot be read as a weights-only PyTorch pickle: {first}", file=pt) from None
    if not isinstance(raw, Mapping) or not raw:
        raise InvalidAdapter(f"expected a state dict of tensors, got {type(raw).__name__}", file=pt)
    out: dict[str, torch.Tensor] = {}
    for name, value in raw.items():
        if not isinstance(name, str) or not isinstance(value, torch.Tensor):
            raise InvalidAdapter(f"not a tensor entry ({type(value).__name__})", file=pt, tensor=str(name))
        out[name.removeprefix(PREFIX)] = value
    return out


def _count_shared(tensors: dict[str, torch.Tensor]) -> int:
    """Names beyond the first that point at the same bytes (FasterDecoding's repeated block module)."""
    seen: set[tuple[int, int, tuple[int, ...]]] = set()
    shared = 0
    for t in tensors.values():
        start = t.untyped_storage().data_ptr() + int(t.storage_offset()) * t.element_size()
        key = (start, t.numel(), tuple(t.stride()))
        shared += key in seen
        seen.add(key)
    return shared


def _structure(tensors: dict[str, torch.Tensor], pt: Path) -> tuple[int, int, int]:
    """(heads, blocks per head, version) from the names: every head has the same blocks, and a projection after
    them in all heads (v1) or in none (v2, the base ``lm_head``)."""
    parts: dict[int, set[tuple[int, str]]] = {}
    for name in tensors:
        m = _NAME.fullmatch(name)
        if m is None:
            raise InvalidAdapter(
                "not a Medusa head tensor (expected {h}.{l}.linear.weight / .bias or {h}.{n}.weight)",
                file=pt, tensor=name,
            )  # fmt: skip
        parts.setdefault(int(m["head"]), set()).add((int(m["index"]), m["part"] or "out"))
    n_heads = max(parts) + 1
    if len(parts) != n_heads:  # a gap in the numbering (looked for near the start: an index can be any size)
        missing = [h for h in range(min(n_heads, len(parts) + 8)) if h not in parts][:8]
        raise InvalidAdapter(f"head(s) {missing} missing: heads must be numbered 0..{n_heads - 1}", file=pt)
    shapes = {head: _head_structure(head, names, pt) for head, names in parts.items()}
    if len(set(shapes.values())) != 1:
        described = ", ".join(f"head {h}: {n} block(s){' + projection' if o else ''}" for h, (n, o) in shapes.items())
        raise InvalidAdapter(f"the heads differ in structure ({described})", file=pt)
    n_layers, has_out = shapes[0]
    if not has_out and n_layers == 0:
        raise InvalidAdapter("the heads have neither blocks nor projections", file=pt)
    return n_heads, n_layers, 1 if has_out else 2


def _head_structure(head: int, names: set[tuple[int, str]], pt: Path) -> tuple[int, bool]:
    """One head's (blocks, has a projection): blocks ``0..n-1`` (weight and bias), then ``{n}.weight`` or not."""
    outs = sorted(i for i, part in names if part == "out")
    n_layers = outs[0] if outs else max((i for i, _ in names), default=-1) + 1
    expected = {(i, p) for i in range(n_layers) for p in ("weight", "bias")}
    if outs:
        expected.add((n_layers, "out"))
    if names != expected:
        odd = sorted(names ^ expected)
        shown = ", ".join(f"{head}.{i}.linear.{p}" if p != "out" else f"{head}.{i}.weight" for i, p in odd[:6])
        raise InvalidAdapter(f"head {head} is not blocks 0..n-1 then an optional projection: {shown}", file=pt)
    return n_layers, bool(outs)


def _stack(
    tensors: dict[str, torch.Tensor], n_heads: int, n_layers: int, version: int, pt: Path
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.dtype]:
    """Fresh stacked buffers (``write_medusa``'s layout) after checking every tensor's dtype, shape and values."""
    dtypes = {t.dtype for t in tensors.values()}
    if len(dtypes) != 1 or (dtype := next(iter(dtypes))) not in _FLOAT_DTYPES:
        raise InvalidAdapter(f"tensors must share one float dtype ({', '.join(FLOAT_CODES)}); got {dtypes}", file=pt)
    first = tensors["0.0.linear.weight"] if n_layers else tensors[f"0.{n_layers}.weight"]
    hidden = int(first.shape[-1])
    vocab = int(tensors[f"0.{n_layers}.weight"].shape[0]) if version == 1 else 0
    weight = torch.empty(n_layers, n_heads, hidden, hidden, dtype=dtype)  # [L, n, H, H]
    bias = torch.empty(n_layers, n_heads, hidden, dtype=dtype)  # [L, n, H]
    out = torch.empty(n_heads, vocab, hidden, dtype=dtype) if version == 1 else None  # [n, V, H]
    for h in range(n_heads):
        for layer in range(n_layers):
            _copy(weight[layer, h], tensors, f"{h}.{layer}.linear.weight", pt)
            _copy(bias[layer, h], tensors, f"{h}.{layer}.linear.bias", pt)
        if out is not None:
            _copy(out[h], tensors, f"{h}.{n_layers}.weight", pt)
    return weight, bias, out, dtype


def _copy(destination: torch.Tensor, tensors: dict[str, torch.Tensor], name: str, pt: Path) -> None:
    tensor = tensors[name]
    if tuple(tensor.shape) != tuple(destination.shape):
        raise InvalidAdapter(
            f"shape {tuple(tensor.shape)}, expected {tuple(destination.shape)} (from head 0's tensors)",
            file=pt, tensor=name,
        )  # fmt: skip
    check_finite(tensor, name, pt)
    destination.copy_(tensor)


def _compare_config(config: dict[str, Any], n_heads: int, n_layers: int, path: Path) -> list[str]:
    notes = []
    for key, found in (("medusa_num_heads", n_heads), ("medusa_num_layers", n_layers)):
        claimed = config.get(key)
        if claimed is not None and claimed != found and str(claimed) != str(found):
            notes.append(f"{path} says {key}={claimed!r}, but the tensors hold {found}; wrote {found}")
    return notes
