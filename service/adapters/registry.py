"""Registration: an adapter id and folder become a compact, validated index of its LoRA tensors.

``index_adapter`` reads ``adapter_config.json`` and the safetensors *header* (through ``service.loading``), never
a tensor byte, checks everything that can be checked without the data, and returns an ``AdapterSpec``: per
(layer, module) slot the rank, the byte offsets of ``lora_A`` / ``lora_B``, their dtypes and the scaling, held in
flat ``array`` columns (about 30 bytes a slot, so 1,000 SmolLM2-sized adapters index in a few MB). Tensor
records for the loader are rebuilt from those columns one layer at a time (``AdapterSpec.layer_records``).

Public API::

    check_adapter_id(adapter_id) -> None                      InvalidRequest
    resolve_source(path, roots) -> Path                       PermissionDenied outside the roots
    index_adapter(adapter_id, path, model_config, *, roots=()) -> AdapterSpec   NotFound: no such folder
    AdapterSpec, SlotRecords
    plan_buffer(spec, dtype, align) -> BufferPlan / plan_nbytes(spec, dtype, align) -> int
    buffer_views(spec, plan, buffer, dtype) -> {(layer, module): (A [r, in], B [out, r])}

The store keeps each adapter's tensors in one flat allocation per tier (host: the file's dtypes; device: the
serving dtype); ``plan_buffer`` places every A and B in it on an aligned offset and ``buffer_views`` cuts the typed
views. Registration keeps only ``plan_nbytes`` (the budgets need it); offsets are computed when a load starts.

Path policy: with ``roots`` given, the folder *and* the files read from it are resolved (symlinks followed) and
must lie inside one root; anything else is ``PermissionDenied`` (a traversal such as ``root/../x`` and a symlink
pointing out of a root look the same after resolution). Without roots any readable folder is accepted. The spec
records the weights file's ``FileStamp``; the store reads through ``integrity.open_verified``, so the roots and
the stamp are checked again at every read.
"""

from __future__ import annotations

import re
import time
from array import array
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from service.adapters.integrity import FileStamp, stamp
from service.adapters.peft import (
    CONFIG_FILE,
    CONVERT_HINT,
    PICKLE_FILES,
    WEIGHTS_FILE,
    LoraAdapterConfig,
    lora_scaling,
    module_features,
    read_lora_config,
    resolve_targets,
)
from service.adapters.peft_keys import GROUP, LORA_KEY, LoraKey, explain_foreign_key, lora_key_name, module_key
from service.adapters.types import MODULES
from service.errors import InvalidAdapter, InvalidRequest, NotFound, PermissionDenied, shorten
from service.loading import DTYPES, TensorRecord, read_safetensors_header
from service.model.config import ModelConfig

_ID = re.compile(r"[A-Za-z0-9_-][A-Za-z0-9._-]{0,127}")
FLOAT_CODES = ("F32", "F16", "BF16", "F64")  # dtypes a LoRA weight may be stored in; index = code in the columns
N_MODULES = len(MODULES)


def check_adapter_id(adapter_id: str) -> None:
    """1-128 characters of ``[A-Za-z0-9._-]``, not starting with '.' (ids appear in paths, logs and metrics)."""
    if not isinstance(adapter_id, str) or not _ID.fullmatch(adapter_id):
        raise InvalidRequest(
            f"invalid adapter id {shorten(adapter_id)!r}: use 1-128 characters from [A-Za-z0-9._-], "
            "not starting with '.'"
        )


def resolve_source(path: Path, roots: Sequence[Path]) -> Path:
    """The adapter folder with symlinks resolved; with ``roots``, it must lie inside one of them."""
    resolved = Path(path).expanduser().resolve()
    _check_inside(resolved, roots, path)
    return resolved


def _check_inside(resolved: Path, roots: Sequence[Path], shown: Path) -> None:
    if roots and not any(resolved.is_relative_to(Path(r).expanduser().resolve()) for r in roots):
        raise PermissionDenied(
            f"adapter path {shorten(shown)!r} resolves outside the allowed adapter roots (--adapter-root); "
            "symlinks and '..' are resolved before the check"
        )


@dataclass(frozen=True, slots=True)
class SlotRecords:
    """One (layer, module) slot of an adapter, ready for ``load_tensors``."""

    module: str
    a: TensorRecord  # lora_A [r, in]
    b: TensorRecord  # lora_B [out, r]
    scaling: float


@dataclass(frozen=True, slots=True, eq=False)
class AdapterSpec:
    """What registration learned about one adapter. Columns are indexed by ``layer * len(MODULES) + module``."""

    id: str
    source: Path  # the adapter folder, resolved
    file: Path  # adapter_model.safetensors, resolved
    config: LoraAdapterConfig
    num_layers: int
    features: tuple[tuple[int, int], ...]  # (in, out) per module, in MODULES order
    prefix: str  # tensor names are rebuilt as {prefix}layers.{L}....lora_{A|B}{infix}.weight
    infix: str
    ranks: array[int]  # 0 = the adapter has no delta for this slot
    a_start: array[int]  # absolute file offsets of each slot's lora_A / lora_B bytes
    b_start: array[int]
    a_dtype: array[int]  # index into FLOAT_CODES
    b_dtype: array[int]
    scaling: array[float]
    file_bytes: int  # the size of the weights file when it was indexed
    stamp: FileStamp  # the weights file's identity when its header was read: every later read checks it
    index_seconds: float

    @property
    def layers(self) -> tuple[int, ...]:
        """Layers with at least one delta, ascending."""
        n = N_MODULES
        return tuple(layer for layer in range(self.num_layers) if any(self.ranks[layer * n : (layer + 1) * n]))

    @property
    def modules(self) -> tuple[str, ...]:
        """Modules with a delta in at least one layer, in MODULES order."""
        n = N_MODULES
        return tuple(m for i, m in enumerate(MODULES) if any(self.ranks[i::n]))

    def module_ranks(self) -> dict[str, int]:
        """The largest rank of each adapted module over the layers."""
        n = N_MODULES
        return {m: max(self.ranks[i::n]) for i, m in enumerate(MODULES) if any(self.ranks[i::n])}

    @property
    def max_rank(self) -> int:
        return max(self.ranks, default=0)

    def a_itemsize(self, slot: int) -> int:
        return _itemsize(self.a_dtype[slot])

    def b_itemsize(self, slot: int) -> int:
        return _itemsize(self.b_dtype[slot])

    def raw_nbytes(self) -> int:
        """Bytes of LoRA weights in the file (the host tier holds exactly these)."""
        total = 0
        for slot, r in enumerate(self.ranks):
            if r:
                fin, fout = self.features[slot % N_MODULES]
                total += r * fin * _itemsize(self.a_dtype[slot]) + fout * r * _itemsize(self.b_dtype[slot])
        return total

    def laid_out_nbytes(self, dtype: torch.dtype) -> int:
        """Bytes of the laid-out weights in the serving dtype (what the device tier holds)."""
        elems = sum(r * sum(self.features[slot % N_MODULES]) for slot, r in enumerate(self.ranks) if r)
        return elems * dtype.itemsize

    def layer_records(self, layer: int) -> list[SlotRecords]:
        """Tensor records of one layer's deltas (empty if the adapter does not touch the layer)."""
        out: list[SlotRecords] = []
        for i, module in enumerate(MODULES):
            slot = layer * N_MODULES + i
            r = self.ranks[slot]
            if not r:
                continue
            fin, fout = self.features[i]
            a_code, b_code = FLOAT_CODES[self.a_dtype[slot]], FLOAT_CODES[self.b_dtype[slot]]
            a_name = lora_key_name(LoraKey(self.prefix, layer, module, "A", self.infix))
            b_name = lora_key_name(LoraKey(self.prefix, layer, module, "B", self.infix))
            a_bytes, b_bytes = r * fin * _itemsize(self.a_dtype[slot]), fout * r * _itemsize(self.b_dtype[slot])
            out.append(
                SlotRecords(
                    module=module,
                    a=TensorRecord(a_name, self.file, a_code, (r, fin), self.a_start[slot], a_bytes),
                    b=TensorRecord(b_name, self.file, b_code, (fout, r), self.b_start[slot], b_bytes),
                    scaling=self.scaling[slot],
                )
            )
        return out


def _itemsize(code: int) -> int:
    return DTYPES[FLOAT_CODES[code]].itemsize


def index_adapter(adapter_id: str, path: Path, model_config: ModelConfig, *, roots: Sequence[Path] = ()) -> AdapterSpec:
    """Validate an adapter folder against the base model and index its tensors (config + header only)."""
    t0 = time.perf_counter()
    check_adapter_id(adapter_id)
    folder = resolve_source(path, roots)
    if not folder.exists():
        raise NotFound(f"adapter folder {shorten(path)!r} does not exist")
    if not folder.is_dir():
        raise InvalidAdapter("the adapter source is not a folder", file=path)
    config_path = folder / CONFIG_FILE
    _check_inside(config_path.resolve(), roots, config_path)
    config = read_lora_config(config_path, model_type=model_config.model_type)
    weights = (folder / WEIGHTS_FILE).resolve()
    _check_inside(weights, roots, folder / WEIGHTS_FILE)
    if not weights.is_file():
        pickles = [name for name in PICKLE_FILES if (folder / name).is_file()]
        if pickles:
            raise InvalidAdapter(f"pickled weights are refused. {CONVERT_HINT}", file=folder / pickles[0])
        raise InvalidAdapter(f"no {WEIGHTS_FILE} in the adapter folder", file=folder / WEIGHTS_FILE)

    targets = resolve_targets(config, model_config, file=config_path)
    before = stamp(weights)  # taken first: a change after this point shows at the next read
    records, _ = read_safetensors_header(weights)
    return _build_index(adapter_id, folder, weights, config, model_config, targets, records, before, t0)


def _build_index(
    adapter_id: str,
    folder: Path,
    weights: Path,
    config: LoraAdapterConfig,
    model_config: ModelConfig,
    targets: dict[tuple[int, str], tuple[int, float]],
    records: dict[str, TensorRecord],
    file_stamp: FileStamp,
    t0: float,
) -> AdapterSpec:
    n_slots = model_config.num_layers * N_MODULES
    features = module_features(model_config)
    module_index = {m: i for i, m in enumerate(MODULES)}
    ranks = array("I", bytes(4 * n_slots))
    a_start, b_start = array("Q", bytes(8 * n_slots)), array("Q", bytes(8 * n_slots))
    a_dtype, b_dtype = array("B", bytes(n_slots)), array("B", bytes(n_slots))
    scaling = array("d", bytes(8 * n_slots))
    seen: dict[tuple[int, str], dict[str, TensorRecord]] = {}
    problems: list[tuple[str, str]] = []  # (tensor, message)
    style: tuple[str, str] | None = None

    match_key = LORA_KEY.fullmatch  # inlined parse_lora_key: this loop runs once per tensor of the file
    n_layers = model_config.num_layers
    for name, rec in records.items():
        m = match_key(name)
        if m is None or GROUP.get(m[4]) != m[3]:
            problems.append((name, explain_foreign_key(name)))
            continue
        prefix, layer_text, _, module, matrix, infix = m.groups()
        if style is None:
            style = (prefix, infix or "")
        elif prefix != style[0] or (infix or "") != style[1]:
            problems.append((name, f"key prefix/infix differ from the file's other keys ({style[0]!r}, {style[1]!r})"))
            continue
        layer = int(layer_text)
        if layer >= n_layers:
            problems.append((name, f"layer {layer} is outside the base model's {n_layers} layers"))
            continue
        if (layer, module) not in targets:
            problems.append((name, f"{CONFIG_FILE} does not target {module_key(layer, module)}"))
            continue
        seen.setdefault((layer, module), {})[matrix] = rec

    rslora = config.use_rslora
    for (layer, module), pair in seen.items():
        a, b = pair.get("A"), pair.get("B")
        if a is None or b is None:
            present = next(iter(pair.values()))  # a slot exists once one of its two tensors was seen
            missing = "lora_B" if b is None else "lora_A"
            problems.append((present.name, f"has no matching {missing} tensor"))
            continue
        rank, alpha = targets[(layer, module)]
        fin, fout = features[module]
        bad = _check_pair(a, b, rank, fin, fout)
        if bad is not None:
            problems.append(bad)
            continue
        slot = layer * N_MODULES + module_index[module]
        ranks[slot] = rank
        a_start[slot], b_start[slot] = a.start, b.start
        a_dtype[slot], b_dtype[slot] = FLOAT_CODES.index(a.dtype), FLOAT_CODES.index(b.dtype)
        scaling[slot] = lora_scaling(rank, alpha, rslora)

    missing_slots = [k for k in targets if k not in seen]
    if missing_slots and not problems:
        missing_slots.sort(key=lambda k: (k[0], module_index[k[1]]))
        shown = ", ".join(module_key(*k) for k in missing_slots[:5]) + (" ..." if len(missing_slots) > 5 else "")
        problems.append(("", f"{CONFIG_FILE} targets {len(missing_slots)} module(s) with no tensors in it: {shown}"))
    if problems:
        _raise(problems, weights)
    if style is None:
        raise InvalidAdapter("the file holds no LoRA tensors", file=weights)

    return AdapterSpec(
        id=adapter_id,
        source=folder,
        file=weights,
        config=config,
        num_layers=model_config.num_layers,
        features=tuple(features[m] for m in MODULES),
        prefix=style[0],
        infix=style[1],
        ranks=ranks,
        a_start=a_start,
        b_start=b_start,
        a_dtype=a_dtype,
        b_dtype=b_dtype,
        scaling=scaling,
        file_bytes=file_stamp.size,
        stamp=file_stamp,
        index_seconds=time.perf_counter() - t0,
    )


def _check_pair(a: TensorRecord, b: TensorRecord, rank: int, fin: int, fout: int) -> tuple[str, str] | None:
    for rec in (a, b):
        if rec.dtype not in FLOAT_CODES:
            return rec.name, f"dtype {rec.dtype} is not a float type ({', '.join(FLOAT_CODES)})"
        if len(rec.shape) != 2:
            return rec.name, f"shape {rec.shape} is not a matrix"
    if a.shape[1] != fin:
        return a.name, f"shape {a.shape}: the base layer has in_features={fin}, expected [r, {fin}]"
    if b.shape[0] != fout:
        return b.name, f"shape {b.shape}: the base layer has out_features={fout}, expected [{fout}, r]"
    if a.shape[0] != b.shape[1]:
        return b.name, f"rank {b.shape[1]} differs from the rank {a.shape[0]} of {a.name!r}"
    if a.shape[0] != rank:
        return a.name, f"rank {a.shape[0]} in the file, but {CONFIG_FILE} gives this module r={rank}"
    return None


def _raise(problems: list[tuple[str, str]], file: Path) -> None:
    if len(problems) == 1:
        tensor, message = problems[0]
        raise InvalidAdapter(message, file=file, tensor=tensor or None)
    shown = "; ".join(f"{t!r}: {m}" if t else m for t, m in problems[:10])
    more = f" (and {len(problems) - 10} more)" if len(problems) > 10 else ""
    raise InvalidAdapter(f"{len(problems)} problems: {shown}{more}", file=file, tensor=problems[0][0] or None)


# --- flat buffers: where each slot's A and B live in one host or device allocation ---------------------------


@dataclass(frozen=True)
class BufferPlan:
    """Byte offsets of every slot's A and B inside one adapter's host or device buffer."""

    offsets: dict[tuple[int, str], tuple[int, int]]  # (layer, module) -> (offset of A, offset of B)
    nbytes: int


def plan_buffer(spec: AdapterSpec, dtype: torch.dtype | None, align: int) -> BufferPlan:
    """Offsets of every slot's A then B in one flat buffer (``dtype`` None: each tensor in its file dtype)."""
    offsets: dict[tuple[int, str], tuple[int, int]] = {}
    cursor = 0
    for layer, module, (a_bytes, b_bytes) in slot_sizes(spec, dtype):
        a_at = -(-cursor // align) * align
        b_at = -(-(a_at + a_bytes) // align) * align
        offsets[(layer, module)] = (a_at, b_at)
        cursor = b_at + b_bytes
    return BufferPlan(offsets, -(-cursor // align) * align)


def plan_nbytes(spec: AdapterSpec, dtype: torch.dtype | None, align: int) -> int:
    """``plan_buffer(...).nbytes`` without building the offsets (registration keeps only this number)."""
    cursor = 0
    for _, _, (a_bytes, b_bytes) in slot_sizes(spec, dtype):
        cursor = -(-cursor // align) * align + a_bytes
        cursor = -(-cursor // align) * align + b_bytes
    return -(-cursor // align) * align


def slot_sizes(spec: AdapterSpec, dtype: torch.dtype | None) -> Iterator[tuple[int, str, tuple[int, int]]]:
    """(layer, module, (bytes of A, bytes of B)) of every slot with a delta, in layer then MODULES order."""
    n = len(MODULES)
    for slot, r in enumerate(spec.ranks):
        if r:
            fin, fout = spec.features[slot % n]
            if dtype is None:
                a_size, b_size = spec.a_itemsize(slot), spec.b_itemsize(slot)
            else:
                a_size = b_size = dtype.itemsize
            yield slot // n, MODULES[slot % n], (r * fin * a_size, fout * r * b_size)


def buffer_views(
    spec: AdapterSpec, plan: BufferPlan, buffer: torch.Tensor, dtype: torch.dtype | None
) -> dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]:
    """Typed, shaped views into ``buffer`` at the plan's offsets (A [r, in], B [out, r]); one ``as_strided``
    per tensor on a typed view of the whole buffer (offsets are aligned, so they divide by every itemsize)."""
    typed: dict[torch.dtype, torch.Tensor] = {}
    out: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] = {}
    for layer in spec.layers:
        for s in spec.layer_records(layer):
            pair = []
            for rec, offset in zip((s.a, s.b), plan.offsets[(layer, s.module)], strict=True):
                dt = dtype if dtype is not None else rec.torch_dtype
                flat = typed.get(dt)
                if flat is None:
                    flat = typed[dt] = buffer.view(dt)  # [nbytes / itemsize]
                rows, cols = rec.shape
                pair.append(flat.as_strided((rows, cols), (cols, 1), offset // dt.itemsize))
            out[(layer, s.module)] = (pair[0], pair[1])
    return out
