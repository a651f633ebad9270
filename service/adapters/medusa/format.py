"""The Medusa adapter format: the tensor names and shapes of ``medusa_lm_head.safetensors``, and the index of them.

``config.json`` is parsed in ``service.adapters.medusa.config`` (its names are re-exported here).

Registration reads the config and the safetensors *headers* (through ``service.loading.CheckpointIndex``), never a
tensor byte, checks everything against the base model and returns a ``MedusaSpec``: per head, the records of its
residual blocks and (v1) of its own output projection. A spec is a few records per head, so thousands of
registered adapters cost nothing worth counting.

The format (FasterDecoding/Medusa, also read by TGI and LoRAX). Head ``h`` of ``medusa_num_heads`` is
``medusa_num_layers`` residual blocks ``x <- x + SiLU(W x + b)`` applied to the base model's last hidden state
(after the final norm), followed by a projection to the vocabulary:

- v1: each head has its own projection ``{h}.{n}.weight`` [vocab, hidden] (``n = medusa_num_layers``);
- v2: the head reuses the base model's ``lm_head`` (no ``{h}.{n}.weight`` in the file).

Block ``l`` of head ``h`` is ``{h}.{l}.linear.weight`` [hidden, hidden] and ``{h}.{l}.linear.bias`` [hidden]. A
``medusa_head.`` prefix on every name (as a whole-model ``state_dict`` would write) is accepted. ``version`` in the
config is optional; without it the file decides (any ``{h}.{n}.weight`` means v1). The weights live in
``medusa_lm_head.safetensors``, or else in the folder's other ``*.safetensors`` files; ``adapter_model.safetensors``
is never one of them, because a Medusa + LoRA folder keeps its LoRA weights there (with ``adapter_config.json``).

Every problem is an ``InvalidAdapter`` naming the file (and the tensor where there is one); tensor problems are
collected and reported together, before anything is loaded.
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from service.adapters.common.files import FileStamp, check_finite, check_folder, refuse_pickles, stamp
from service.adapters.medusa.config import CONFIG_FILE, MedusaConfig, is_medusa_folder, read_medusa_config
from service.errors import CheckpointError, InvalidAdapter
from service.loading import CheckpointIndex, TensorRecord
from service.model.config import ModelConfig

__all__ = [
    "CONFIG_FILE",
    "LORA_WEIGHTS_FILE",
    "PICKLE_FILES",
    "WEIGHTS_FILE",
    "BlockRecords",
    "HeadRecords",
    "MedusaConfig",
    "MedusaSpec",
    "check_heads_finite",
    "index_medusa",
    "is_medusa_folder",
    "read_medusa_config",
    "weight_files",
    "write_medusa",
]

WEIGHTS_FILE = "medusa_lm_head.safetensors"
PICKLE_FILES = ("medusa_lm_head.pt", "medusa_lm_head.bin", "medusa_lm_head.pth")
LORA_WEIGHTS_FILE = "adapter_model.safetensors"  # the LoRA half of a Medusa + LoRA folder (service.adapters.lora.peft)
FLOAT_CODES = ("F32", "F16", "BF16", "F64")
PREFIX = "medusa_head."
_NAMED_MISSING_SLACK = 1024  # tensors a config may claim beyond the file's and still get them listed by name
CONVERT_HINT = (
    "loraplex reads only safetensors (pickled weights can run code when loaded). Convert once with "
    "`loraplex convert medusa SRC DST` (SRC: this folder or its .pt file; DST: a new folder, then load that one)"
)

# "{h}.{l}.linear.weight" / "{h}.{l}.linear.bias" (a residual block) or "{h}.{n}.weight" (v1 output projection)
_KEY = re.compile(
    r"(?P<prefix>(?:medusa_head\.)?)(?P<head>\d+)\.(?P<index>\d+)\.(?:linear\.(?P<part>weight|bias)|weight)"
)


@dataclass(frozen=True, slots=True)
class BlockRecords:
    """One residual block ``x + SiLU(W x + b)``."""

    weight: TensorRecord  # [hidden, hidden]
    bias: TensorRecord  # [hidden]


@dataclass(frozen=True, slots=True)
class HeadRecords:
    blocks: tuple[BlockRecords, ...]  # medusa_num_layers, applied in order
    out: TensorRecord | None  # v1: [vocab, hidden]; v2: None (the base lm_head)


@dataclass(frozen=True, slots=True, eq=False)
class MedusaSpec:
    """What registration learned about one Medusa adapter."""

    source: Path  # the adapter folder
    files: tuple[Path, ...]  # the safetensors files holding the heads
    config: MedusaConfig
    version: int  # 1 or 2, after inference from the file when the config has none
    hidden_size: int
    vocab_size: int
    heads: tuple[HeadRecords, ...]
    file_bytes: tuple[int, ...]  # each file's size when it was indexed
    stamps: tuple[FileStamp, ...]  # each file's identity when its header was read: every later read checks it
    index_seconds: float

    @property
    def num_heads(self) -> int:
        return len(self.heads)

    @property
    def num_layers(self) -> int:
        return self.config.num_layers

    def records(self) -> dict[str, TensorRecord]:
        """Every tensor of the heads by name (the load plan's source)."""
        out: dict[str, TensorRecord] = {}
        for head in self.heads:
            for block in head.blocks:
                out[block.weight.name] = block.weight
                out[block.bias.name] = block.bias
            if head.out is not None:
                out[head.out.name] = head.out
        return out

    def raw_nbytes(self) -> int:
        """Bytes of head weights in the files (what a host copy holds)."""
        return sum(r.nbytes for r in self.records().values())

    def laid_out_nbytes(self, dtype: torch.dtype) -> int:
        """Bytes of the heads on a device in ``dtype`` (``MedusaHeads.nbytes``)."""
        return sum(r.numel for r in self.records().values()) * dtype.itemsize


def weight_files(folder: Path) -> tuple[Path, ...]:
    """``medusa_lm_head.safetensors`` if present, else every other ``*.safetensors`` except the LoRA weights."""
    folder = Path(folder)
    main = folder / WEIGHTS_FILE
    if main.is_file():
        return (main,)
    return tuple(sorted(p for p in folder.glob("*.safetensors") if p.is_file() and p.name != LORA_WEIGHTS_FILE))


def index_medusa(
    folder: Path, model_config: ModelConfig, *, check_path: Callable[[Path], object] | None = None
) -> MedusaSpec:
    """Validate a Medusa adapter folder against the base model and index its heads (config + headers only).

    ``check_path`` is called with every file (resolved) before it is opened: the registry's path policy.
    """
    t0 = time.perf_counter()
    folder = Path(folder)
    check_folder(folder, folder)
    config_path = folder / CONFIG_FILE
    if check_path is not None:
        check_path(config_path.resolve())
    config = read_medusa_config(config_path)
    files = tuple(f.resolve() for f in weight_files(folder))
    if not files:
        refuse_pickles(folder, PICKLE_FILES, "Medusa heads", CONVERT_HINT)
        raise InvalidAdapter(f"no {WEIGHTS_FILE} (or other Medusa .safetensors file) in the folder", file=folder)
    records: dict[str, TensorRecord] = {}
    stamps: list[FileStamp] = []
    for file in files:
        if check_path is not None:
            check_path(file)
        stamps.append(stamp(file))  # before the header: a change after this shows at the next read
        for name, rec in _read_header(file).items():
            if name in records:
                raise InvalidAdapter(f"tensor is also in {records[name].file}", file=file, tensor=name)
            records[name] = rec
    version, heads = _build_heads(config, records, model_config, config_path)
    return MedusaSpec(
        source=folder,
        files=files,
        config=config,
        version=version,
        hidden_size=model_config.hidden_size,
        vocab_size=model_config.vocab_size,
        heads=heads,
        file_bytes=tuple(st.size for st in stamps),
        stamps=tuple(stamps),
        index_seconds=time.perf_counter() - t0,
    )


def check_heads_finite(spec: MedusaSpec, tensors: dict[str, torch.Tensor]) -> None:
    """Refuse loaded head tensors (by record name) holding NaN or inf: ``NonFiniteTensor`` naming file and tensor."""
    records = spec.records()
    for name, tensor in tensors.items():
        check_finite(tensor, name, records[name].file)


def write_medusa(
    folder: Path,
    block_weight: torch.Tensor,
    block_bias: torch.Tensor,
    out_weight: torch.Tensor | None = None,
    *,
    version: int | None = None,
    base_model: str | None = None,
    metadata: dict[str, str] | None = None,
) -> Path:
    """Write stacked heads (``MedusaHeads`` layout: weight [L, n, H, H], bias [L, n, H], v1 out [n, V, H]) as a
    Medusa folder: ``config.json`` and ``medusa_lm_head.safetensors`` with the reference key names."""
    from safetensors.torch import save_file

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    n_layers, n_heads = int(block_weight.shape[0]), int(block_weight.shape[1])
    tensors: dict[str, torch.Tensor] = {}
    for h in range(n_heads):
        for layer in range(n_layers):
            tensors[f"{h}.{layer}.linear.weight"] = block_weight[layer, h].contiguous()
            tensors[f"{h}.{layer}.linear.bias"] = block_bias[layer, h].contiguous()
        if out_weight is not None:
            tensors[f"{h}.{n_layers}.weight"] = out_weight[h].contiguous()
    save_file({k: v.detach().cpu() for k, v in tensors.items()}, str(folder / WEIGHTS_FILE), metadata=metadata)
    config: dict[str, Any] = {"medusa_num_heads": n_heads, "medusa_num_layers": n_layers}
    if version is not None:
        config["version"] = version
    if base_model is not None:
        config["base_model_name_or_path"] = base_model
    (folder / CONFIG_FILE).write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
    return folder


def _read_header(file: Path) -> dict[str, TensorRecord]:
    """The file's records; a corrupt file is an ``InvalidAdapter`` with the reader's own diagnosis."""
    try:
        return CheckpointIndex.open(file).tensors
    except CheckpointError as e:
        message = str(e)
        where = f"file {e.file}" + (f", tensor {e.tensor!r}" if e.tensor is not None else "")
        if message.startswith(where + ": "):
            message = message[len(where) + 2 :]
        raise InvalidAdapter(f"not a valid safetensors file: {message}", file=file, tensor=e.tensor) from None


def _build_heads(
    config: MedusaConfig, records: dict[str, TensorRecord], model_config: ModelConfig, config_path: Path
) -> tuple[int, tuple[HeadRecords, ...]]:
    n_heads, n_layers = config.num_heads, config.num_layers
    hidden, vocab = model_config.hidden_size, model_config.vocab_size
    needed = n_heads * max(2 * n_layers, 1)  # at least: every block's weight + bias (v1 also an output per head)
    # The loops below are as long as the config claims: a claim far beyond the file is refused before them
    # (a small excess goes on, so the usual mistake gets the list of missing names).
    if needed > len(records) + _NAMED_MISSING_SLACK:
        files = sorted({str(r.file) for r in records.values()}) or [str(config_path.parent)]
        raise InvalidAdapter(
            f"{CONFIG_FILE} says {n_heads} head(s) x {n_layers} block(s), which needs at least {needed} tensors, "
            f"but the Medusa file(s) hold only {len(records)} tensor(s)",
            file=files[0] if len(files) == 1 else config_path.parent,
        )
    dims = f"hidden_size={hidden}, vocab_size={vocab}"
    problems: list[tuple[TensorRecord | None, str]] = []
    found, prefix = _classify(records, n_heads, n_layers, problems)

    has_out = [h for h in range(n_heads) if (h, n_layers, "out") in found]
    version = config.version if config.version is not None else (1 if has_out else 2)
    if version == 2 and has_out:
        rec = found[(has_out[0], n_layers, "out")]
        problems.append((rec, "version 2 heads use the base model's lm_head, but the file has an output projection"))
    if version == 2 and n_layers < 1:
        problems.append((None, "version 2 heads need medusa_num_layers >= 1"))

    heads: list[HeadRecords] = []
    missing: list[str] = []
    for h in range(n_heads):
        blocks: list[BlockRecords] = []
        for layer in range(n_layers):
            w, b = found.get((h, layer, "weight")), found.get((h, layer, "bias"))
            if w is None:
                missing.append(f"{prefix}{h}.{layer}.linear.weight")
            if b is None:
                missing.append(f"{prefix}{h}.{layer}.linear.bias")
            if w is not None and b is not None:
                problems.extend(_check(w, (hidden, hidden), "[hidden, hidden]", dims))
                problems.extend(_check(b, (hidden,), "[hidden]", dims))
                blocks.append(BlockRecords(w, b))
        out = found.get((h, n_layers, "out"))
        if version == 1:
            if out is None:
                missing.append(f"{prefix}{h}.{n_layers}.weight")
            else:
                problems.extend(_check(out, (vocab, hidden), "[vocab, hidden]", dims))
        heads.append(HeadRecords(tuple(blocks), out if version == 1 else None))
    if missing:
        shown = ", ".join(repr(n) for n in missing[:8]) + (" ..." if len(missing) > 8 else "")
        problems.append(
            (
                None,
                f"{len(missing)} tensor(s) missing for {n_heads} head(s) x {n_layers} block(s) "
                f"(version {version}): {shown}",
            )
        )
    if problems:
        _raise(problems, records, config_path)
    return version, tuple(heads)


def _classify(
    records: dict[str, TensorRecord], n_heads: int, n_layers: int, problems: list[tuple[TensorRecord | None, str]]
) -> tuple[dict[tuple[int, int, str], TensorRecord], str]:
    """Each tensor name -> (head, index, "weight" | "bias" | "out"), and the names' common prefix; a name that
    does not fit the config is appended to ``problems``."""
    found: dict[tuple[int, int, str], TensorRecord] = {}  # (head, index, "weight" | "bias" | "out")
    prefix: str | None = None
    for name, rec in records.items():
        m = _KEY.fullmatch(name)
        if m is None:
            problems.append((rec, "not a Medusa head tensor (expected {h}.{l}.linear.weight/bias or {h}.{n}.weight)"))
            continue
        if prefix is None:
            prefix = m["prefix"]
        elif m["prefix"] != prefix:
            problems.append((rec, f"prefix differs from the file's other names ({prefix!r})"))
            continue
        head, index = int(m["head"]), int(m["index"])
        part = m["part"] or "out"
        if head >= n_heads:
            problems.append((rec, f"head {head} is beyond {CONFIG_FILE}'s medusa_num_heads={n_heads}"))
        elif part == "out" and index != n_layers:
            problems.append(
                (
                    rec,
                    f"an output projection must follow the {n_layers} block(s): expected "
                    f"{prefix}{head}.{n_layers}.weight",
                )
            )
        elif part != "out" and index >= n_layers:
            problems.append((rec, f"block {index} is beyond {CONFIG_FILE}'s medusa_num_layers={n_layers}"))
        else:
            found[(head, index, part)] = rec
    return found, prefix or ""


def _check(rec: TensorRecord, shape: tuple[int, ...], what: str, model: str) -> list[tuple[TensorRecord | None, str]]:
    if rec.dtype not in FLOAT_CODES:
        return [(rec, f"dtype {rec.dtype} is not a float type ({', '.join(FLOAT_CODES)})")]
    if rec.shape != shape:
        return [(rec, f"shape {rec.shape}, expected {what} = {shape} for the base model ({model})")]
    return []


def _raise(
    problems: list[tuple[TensorRecord | None, str]], records: dict[str, TensorRecord], config_path: Path
) -> None:
    files = sorted({r.file for r in records.values()})
    default_file: Path = files[0] if len(files) == 1 else config_path.parent
    if len(problems) == 1:
        rec, msg = problems[0]
        raise InvalidAdapter(msg, file=rec.file if rec else default_file, tensor=rec.name if rec else None)
    detail = "; ".join(f"{rec.name!r}: {msg}" if rec else msg for rec, msg in problems[:20])
    more = f" (and {len(problems) - 20} more)" if len(problems) > 20 else ""
    raise InvalidAdapter(f"{len(problems)} problems with the Medusa heads: {detail}{more}", file=default_file)
