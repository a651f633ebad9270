"""Registration: an adapter id and folder become a compact, validated index of its LoRA tensors.

``index_adapter`` reads ``adapter_config.json`` and the safetensors *header* (through ``service.loading``), never
a tensor byte, checks everything that can be checked without the data (every problem named with its file and
tensor, reported together), and returns an ``AdapterSpec`` (``service.adapters.lora.spec``; re-exported here with
``plan_nbytes``).

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
from collections.abc import Sequence
from pathlib import Path
from typing import TypedDict

from service.adapters.common.files import FileStamp, check_folder, refuse_pickles, resolve_source, stamp
from service.adapters.common.ids import check_adapter_id
from service.adapters.lora.model_parts import index_parts, parse_part_key, resolve_saved
from service.adapters.lora.peft import (
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
from service.adapters.lora.peft_keys import BIAS_KEY, GROUP, LORA_KEY, MAGNITUDE_KEY, explain_foreign_key, module_key
from service.adapters.lora.spec import FLOAT_CODES, N_MODULES, AdapterSpec, plan_nbytes
from service.adapters.lora.types import MODULES
from service.errors import InvalidAdapter
from service.loading import TensorRecord, read_safetensors_header
from service.model.config import ModelConfig


def index_adapter(adapter_id: str, path: Path, model_config: ModelConfig, *, roots: Sequence[Path] = ()) -> AdapterSpec:
    """Validate an adapter folder against the base model and index its tensors (config + header only)."""
    t0 = time.perf_counter()
    check_adapter_id(adapter_id)
    folder = resolve_source(path, roots)
    check_folder(folder, path)
    config_path = folder / CONFIG_FILE
    resolve_source(config_path, roots)
    config = read_lora_config(config_path, model_type=model_config.model_type)
    weights = (folder / WEIGHTS_FILE).resolve()
    resolve_source(folder / WEIGHTS_FILE, roots)
    if not weights.is_file():
        refuse_pickles(folder, PICKLE_FILES, "weights", CONVERT_HINT)
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
    features = module_features(model_config)
    problems: list[tuple[str, str]] = []  # (tensor, message)
    top = model_config.num_layers
    found: list[tuple[tuple[int, str, str], TensorRecord]] = []  # model_parts tensors
    seen, style = _match_names(records, targets, top, problems, found, dora=config.use_dora, bias=config.lora_bias)
    model_targets = {k: v for k, v in targets.items() if k[0] == top}
    saved = resolve_saved(config, model_config, file=folder / CONFIG_FILE)
    parts = index_parts(found, model_targets, saved, config, model_config, problems)
    columns = _zero_columns(model_config.num_layers * N_MODULES)
    for (layer, module), pair in seen.items():
        bad = _fill_slot(columns, layer, module, pair, targets[(layer, module)], features[module], config)
        if bad is not None:
            problems.append(bad)
    missing_slots = [k for k in targets if k not in seen and k[0] < top]
    if missing_slots and not problems:
        missing_slots.sort(key=lambda k: (k[0], MODULES.index(k[1])))
        shown = ", ".join(module_key(*k) for k in missing_slots[:5]) + (" ..." if len(missing_slots) > 5 else "")
        problems.append(("", f"{CONFIG_FILE} targets {len(missing_slots)} module(s) with no tensors in it: {shown}"))
    if problems:
        _raise(problems, weights)
    if style is None and not parts:
        raise InvalidAdapter("the file holds no LoRA tensors", file=weights)

    return AdapterSpec(
        id=adapter_id,
        source=folder,
        file=weights,
        config=config,
        num_layers=model_config.num_layers,
        features=tuple(features[m] for m in MODULES),
        prefix=style[0] if style else "",
        infix=style[1] if style else "",
        **columns,
        file_bytes=file_stamp.size,
        stamp=file_stamp,
        index_seconds=time.perf_counter() - t0,
        parts=parts,
    )


def _match_names(
    records: dict[str, TensorRecord],
    targets: dict[tuple[int, str], tuple[int, float]],
    n_layers: int,
    problems: list[tuple[str, str]],
    found: list[tuple[tuple[int, str, str], TensorRecord]],
    *,
    dora: bool = False,
    bias: bool = False,
) -> tuple[dict[tuple[int, str], dict[str, TensorRecord]], tuple[str, str] | None]:
    """Each tensor's (layer, module) -> {"A" | "B" | "M" (DoRA's magnitude, with ``dora``) | "bias" (lora_B's
    bias, with ``bias``): record}, and the names' (prefix, infix); the tensors of ``model_parts`` go to ``found``;
    a name that is none of these, or a projection's whose style differs from the first one's, to ``problems``."""
    seen: dict[tuple[int, str], dict[str, TensorRecord]] = {}
    style: tuple[str, str] | None = None
    match_key = LORA_KEY.fullmatch  # inlined parse_lora_key: this loop runs once per tensor of the file
    extras: list[tuple[str, re.Match[str], TensorRecord]] = []  # ("M" | "bias", its name's match, record)
    for name, rec in records.items():
        m = match_key(name)
        if m is None and dora and (e := MAGNITUDE_KEY.fullmatch(name)):
            extras.append(("M", e, rec))
            continue
        if m is None and bias and (e := BIAS_KEY.fullmatch(name)):
            extras.append(("bias", e, rec))
            continue
        if m is None and (part := parse_part_key(name, n_layers)) is not None:
            found.append((part, rec))
            continue
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
    for tag, e, rec in extras:  # after the weights: each vector belongs to a module seen with its A and B
        key = (int(e["layer"]), e["module"])
        if style is not None and (e["prefix"], e.groupdict().get("infix") or "") != style:
            problems.append(
                (rec.name, f"key prefix/infix differ from the file's other keys ({style[0]!r}, {style[1]!r})")
            )
        elif GROUP.get(key[1]) != e["group"] or key not in seen:
            problems.append((rec.name, f"{_EXTRA[tag]} of a module with no lora_A / lora_B in the file"))
        else:
            seen[key][tag] = rec
    return seen, style


# The per-channel vectors beside a module's A and B: as named when one has no module, and when one is misshapen.
_EXTRA = {"M": "a DoRA magnitude", "bias": "a LoRA bias"}
_WHAT = {"M": "DoRA's magnitude", "bias": "a LoRA bias"}


class _Columns(TypedDict):
    """The ``AdapterSpec`` columns while they are filled, one entry per (layer, module) slot."""

    ranks: array[int]
    a_start: array[int]
    b_start: array[int]
    a_dtype: array[int]
    b_dtype: array[int]
    scaling: array[float]
    m_start: array[int]
    m_dtype: array[int]
    bias_start: array[int]
    bias_dtype: array[int]


def _zero_columns(n_slots: int) -> _Columns:
    return _Columns(
        ranks=array("I", bytes(4 * n_slots)),
        a_start=array("Q", bytes(8 * n_slots)),
        b_start=array("Q", bytes(8 * n_slots)),
        a_dtype=array("B", bytes(n_slots)),
        b_dtype=array("B", bytes(n_slots)),
        scaling=array("d", bytes(8 * n_slots)),
        m_start=array("Q", bytes(8 * n_slots)),
        m_dtype=array("B", bytes(n_slots)),
        bias_start=array("Q", bytes(8 * n_slots)),
        bias_dtype=array("B", bytes(n_slots)),
    )


def _fill_slot(
    columns: _Columns,
    layer: int,
    module: str,
    pair: dict[str, TensorRecord],
    rank_alpha: tuple[int, float],
    features: tuple[int, int],
    config: LoraAdapterConfig,
) -> tuple[str, str] | None:
    """Check one slot's lora_A / lora_B records and write them into ``columns``; else the (tensor, problem)."""
    a, b = pair.get("A"), pair.get("B")
    if a is None or b is None:
        present = next(iter(pair.values()))  # a slot exists once one of its two tensors was seen
        missing = "lora_B" if b is None else "lora_A"
        return present.name, f"has no matching {missing} tensor"
    rank, alpha = rank_alpha
    bad = _check_pair(a, b, rank, *features)
    if bad is not None:
        return bad
    slot = layer * N_MODULES + MODULES.index(module)
    for on, tag, start, dtype, missing in (
        (config.use_dora, "M", "m_start", "m_dtype", "use_dora is set, but the module has no lora_magnitude_vector"),
        (config.lora_bias, "bias", "bias_start", "bias_dtype", "lora_bias is set, but the module has no lora_B bias"),
    ):
        if on:
            bad = _check_vector(pair.get(tag), a, missing, _WHAT[tag], features[1])
            if bad is not None:
                return bad
            columns[start][slot], columns[dtype][slot] = pair[tag].start, FLOAT_CODES.index(pair[tag].dtype)  # type: ignore[literal-required]
    columns["ranks"][slot] = rank
    columns["a_start"][slot], columns["b_start"][slot] = a.start, b.start
    columns["a_dtype"][slot], columns["b_dtype"][slot] = FLOAT_CODES.index(a.dtype), FLOAT_CODES.index(b.dtype)
    columns["scaling"][slot] = lora_scaling(rank, alpha, config.use_rslora)
    return None


def _check_vector(
    rec: TensorRecord | None, owner: TensorRecord, missing: str, what: str, fout: int
) -> tuple[str, str] | None:
    """A per-output-channel vector (DoRA's magnitude, a LoRA bias): present, a float type, ``[out_features]``."""
    if rec is None:
        return owner.name, missing
    if rec.dtype not in FLOAT_CODES:
        return rec.name, f"dtype {rec.dtype} is not a float type ({', '.join(FLOAT_CODES)})"
    if tuple(rec.shape) != (fout,):
        return rec.name, f"shape {rec.shape}: {what} must be [out_features] = [{fout}]"
    return None


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


__all__ = ["AdapterSpec", "index_adapter", "plan_nbytes"]
