"""``AdapterSpec``: the compact index of one adapter's LoRA tensors, and the flat buffers its tensors load into.

A spec holds, per (layer, module) slot, the rank, the byte offsets of ``lora_A`` / ``lora_B`` in the weights
file, their dtypes and the scaling, in flat ``array`` columns (about 30 bytes a slot, so 1,000 SmolLM2-sized
adapters index in a few MB). Tensor records for the loader are rebuilt from those columns one layer at a time
(``AdapterSpec.layer_records``). Registration (``service.adapters.lora.registry``) builds specs; nothing here reads a
file.

The store keeps each adapter's tensors in one flat allocation per tier (host: the file's dtypes; device: the
serving dtype); ``plan_buffer`` places every A and B in it on an aligned offset and ``buffer_views`` cuts the typed
views. Registration keeps only ``plan_nbytes`` (the budgets need it); offsets are computed when a load starts.
"""

from __future__ import annotations

from array import array
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from service.adapters.common.files import FileStamp
from service.adapters.lora.peft import LoraAdapterConfig
from service.adapters.lora.peft_keys import LoraKey, bias_key_name, lora_key_name, magnitude_key_name
from service.adapters.lora.types import LAYER_NORMS, MODULES
from service.loading import DTYPES, TensorRecord

FLOAT_CODES = ("F32", "F16", "BF16", "F64")  # dtypes a LoRA weight may be stored in; index = code in the columns
N_MODULES = len(MODULES)


@dataclass(frozen=True, slots=True)
class SlotRecords:
    """One (layer, module) slot of an adapter, ready for ``load_tensors``."""

    module: str
    a: TensorRecord  # lora_A [r, in]
    b: TensorRecord  # lora_B [out, r]
    scaling: float
    m: TensorRecord | None = None  # DoRA's lora_magnitude_vector [out] (None: plain LoRA)
    bias: TensorRecord | None = None  # lora_B's trained bias [out] (None: no lora_bias)


@dataclass(frozen=True, slots=True)
class PartRecord:
    """One tensor beside the projections' LoRA (``model_parts``): LoRA on embed_tokens / lm_head, a saved module."""

    layer: int  # the decoder layer of a layer norm; ``num_layers`` (the pseudo-layer) for the others
    name: str  # input_layernorm | post_attention_layernorm | norm | embed_tokens | lm_head
    role: str  # "A" | "B" (LoRA; B gets ``scaling``) | "saved" (replaces the base weight)
    record: TensorRecord
    scaling: float = 1.0


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
    m_start: array[int]  # DoRA: absolute file offsets of each slot's lora_magnitude_vector (unused without)
    m_dtype: array[int]
    bias_start: array[int]  # lora_bias: absolute file offsets of each slot's lora_B bias (unused without)
    bias_dtype: array[int]
    file_bytes: int  # the size of the weights file when it was indexed
    stamp: FileStamp  # the weights file's identity when its header was read: every later read checks it
    index_seconds: float
    parts: tuple[PartRecord, ...] = ()  # LoRA on embed_tokens / lm_head, saved modules (loaded beside the buffer)

    @property
    def layers(self) -> tuple[int, ...]:
        """Layers with at least one delta, ascending."""
        n = N_MODULES
        return tuple(layer for layer in range(self.num_layers) if any(self.ranks[layer * n : (layer + 1) * n]))

    @property
    def modules(self) -> tuple[str, ...]:
        """Modules with a delta in at least one layer, in MODULES order, then embed_tokens / lm_head."""
        return tuple(self.module_ranks())

    def module_ranks(self) -> dict[str, int]:
        """The largest rank of each adapted module over the layers."""
        n = N_MODULES
        ranks = {m: max(self.ranks[i::n]) for i, m in enumerate(MODULES) if any(self.ranks[i::n])}
        return ranks | {p.name: p.record.shape[0] for p in self.parts if p.role == "A"}

    @property
    def max_rank(self) -> int:
        return max(self.module_ranks().values(), default=0)

    @property
    def saved_modules(self) -> tuple[str, ...]:
        """The modules the adapter replaces (modules_to_save, saved base layers), each once, in forward order."""
        names = {p.name for p in self.parts if p.role == "saved"}
        return tuple(n for n in ("embed_tokens", *LAYER_NORMS, "norm", "lm_head") if n in names)

    def parts_nbytes(self, dtype: torch.dtype | None, *, saved_only: bool = False) -> int:
        """Bytes of the parts as stored (``dtype`` None: the host tier) or in the serving dtype (the device)."""
        return sum(
            p.record.nbytes if dtype is None else p.record.numel * dtype.itemsize
            for p in self.parts
            if not saved_only or p.role == "saved"
        )

    def extras_nbytes(self, dtype: torch.dtype | None) -> int:
        """Bytes of the tensors beside the A/B buffer (``dtype`` None: the host tier, as stored): the ``parts``;
        DoRA: the magnitudes as stored, or on the device five float32 vectors per module (magnitude, the three norm
        terms, the factor); a LoRA bias: as stored, or in the serving dtype."""
        dora, bias = self.config.use_dora, self.config.lora_bias
        total = self.parts_nbytes(dtype)
        if not (dora or bias):
            return total
        for slot, r in enumerate(self.ranks):
            if r:
                fout = self.features[slot % N_MODULES][1]
                if dora:
                    total += fout * (5 * 4 if dtype is not None else _itemsize(self.m_dtype[slot]))
                if bias:
                    total += fout * (dtype.itemsize if dtype is not None else _itemsize(self.bias_dtype[slot]))
        return total

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
            m = None
            if self.config.use_dora:
                m_code, m_bytes = FLOAT_CODES[self.m_dtype[slot]], fout * _itemsize(self.m_dtype[slot])
                m_name = magnitude_key_name(self.prefix, layer, module)
                m = TensorRecord(m_name, self.file, m_code, (fout,), self.m_start[slot], m_bytes)
            bias = None
            if self.config.lora_bias:
                code, size = FLOAT_CODES[self.bias_dtype[slot]], fout * _itemsize(self.bias_dtype[slot])
                name = bias_key_name(self.prefix, layer, module, self.infix)
                bias = TensorRecord(name, self.file, code, (fout,), self.bias_start[slot], size)
            out.append(
                SlotRecords(
                    module=module,
                    a=TensorRecord(a_name, self.file, a_code, (r, fin), self.a_start[slot], a_bytes),
                    b=TensorRecord(b_name, self.file, b_code, (fout, r), self.b_start[slot], b_bytes),
                    scaling=self.scaling[slot],
                    m=m,
                    bias=bias,
                )
            )
        return out


def _itemsize(code: int) -> int:
    return DTYPES[FLOAT_CODES[code]].itemsize


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
    """``plan_buffer(...).nbytes`` without building the offsets, plus the per-channel vectors allocated beside the
    buffer (``AdapterSpec.extras_nbytes``): what a tier holds for the adapter (registration keeps only this)."""
    cursor = 0
    for _, _, (a_bytes, b_bytes) in slot_sizes(spec, dtype):
        cursor = -(-cursor // align) * align + a_bytes
        cursor = -(-cursor // align) * align + b_bytes
    return -(-cursor // align) * align + spec.extras_nbytes(dtype)


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


__all__ = [
    "FLOAT_CODES",
    "N_MODULES",
    "AdapterSpec",
    "BufferPlan",
    "PartRecord",
    "SlotRecords",
    "buffer_views",
    "plan_buffer",
    "plan_nbytes",
    "slot_sizes",
]
