"""Reading one adapter: its tensors from disk into a host copy, checked, then laid out on the serving device.

Mechanism only: no tiers, no budgets, no lock (the store decides what to load and when, and calls this from its
loader thread). Every read opens the weights file through ``integrity.open_verified`` (the file indexed at
registration, inside the roots) and every tensor read is checked finite (``integrity.check_finite``) before it
is laid out; the check's time is the ``validate`` stage of ``loraplex_adapter_load_duration_seconds``.

Public API::

    HOST_ALIGN, DEVICE_ALIGN                      byte alignment of every view in a host / device buffer
    HostCopy(buffer, tensors)                     raw tensors of one adapter as read (host tier)
    Loaded                                        one finished load: layers on the device + the host copy + timings
    AdapterReader(device, dtype, roots).load(spec, host) -> Loaded
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

from service import metrics
from service.adapters.common.files import check_finite, open_verified
from service.adapters.lora.spec import AdapterSpec, SlotRecords, buffer_views, plan_buffer
from service.adapters.lora.types import BaseWeights, DoraNorm, LoraLayer, LoraModule
from service.config import MAX_SAVED_MODULE_BYTES
from service.errors import InvalidAdapter, ResourceExhausted
from service.loading import load_tensors

HOST_ALIGN = 64  # bytes; every tensor view in a host or device buffer starts on this boundary
DEVICE_ALIGN = 256


@dataclass(eq=False)
class HostCopy:
    """One adapter's tensors as read from its file, in one flat buffer (the host tier)."""

    buffer: torch.Tensor  # [nbytes] uint8, pinned on CUDA servers
    tensors: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]  # raw A [r, in], B [out, r] (file dtype)
    magnitudes: dict[tuple[int, str], torch.Tensor] = field(default_factory=dict)  # DoRA [out] (file dtype)
    biases: dict[tuple[int, str], torch.Tensor] = field(default_factory=dict)  # lora_B bias [out] (file dtype)
    parts: dict[tuple[int, str, str], torch.Tensor] = field(default_factory=dict)  # (layer, name, role): spec.parts

    @property
    def nbytes(self) -> int:
        vectors = (*self.magnitudes.values(), *self.biases.values(), *self.parts.values())
        return int(self.buffer.numel()) + sum(v.numel() * v.element_size() for v in vectors)


@dataclass
class Loaded:
    """A finished load: what the store publishes."""

    layers: tuple[LoraLayer | None, ...]
    host: HostCopy
    from_disk: bool
    bytes_read: int
    read_seconds: float
    layout_seconds: float


class AdapterReader:
    """Reads and lays out whole adapters for the store's loader thread (one thread: the CUDA copy stream is its own).

    ``load(spec, host)`` reads every touched layer from disk into a new host copy (``host`` None), or reuses
    ``host``, and lays it out on the device in the serving dtype, ``lora_B`` scaled."""

    def __init__(
        self,
        device: torch.device,
        dtype: torch.dtype,
        roots: Sequence[Path],
        base: BaseWeights | None = None,
        *,
        max_saved_bytes: int = MAX_SAVED_MODULE_BYTES,
    ) -> None:
        self.device = device
        self.max_saved_bytes = max_saved_bytes
        self.base = base  # the base weights DoRA's norm is computed from (None: DoRA adapters are refused earlier)
        self.dtype = dtype
        self.roots = tuple(roots)
        self._pin_host = device.type == "cuda"
        self._stream: torch.cuda.Stream | None = None  # created on the loader thread on first use

    def load(self, spec: AdapterSpec, host: HostCopy | None) -> Loaded:
        """Read (unless a host copy exists) and lay out every touched layer. Raises the typed errors of the
        checks: ``AdapterFileChanged``, ``PermissionDenied``, ``NonFiniteTensor``, ``HeaderError``."""
        self.check_saved(spec)  # again: a file indexed anew after a change may save more
        from_disk = host is None
        if host is None:
            host_plan = plan_buffer(spec, None, HOST_ALIGN)
            buffer = torch.empty(host_plan.nbytes, dtype=torch.uint8, pin_memory=self._pin_host)
            host = HostCopy(buffer, buffer_views(spec, host_plan, buffer, None))
        device_plan = plan_buffer(spec, self.dtype, DEVICE_ALIGN)
        if self.device.type == "cuda" and self._stream is None:
            self._stream = torch.cuda.Stream(self.device)  # type: ignore[no-untyped-call]
        stream = self._stream  # the loader's own copy stream: layout never waits behind the engine's kernels
        with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
            device_buffer = torch.empty(device_plan.nbytes, dtype=torch.uint8, device=self.device)
        if stream is not None:
            # Written on the loader's stream, read by the engine on the default stream: when an eviction frees
            # it, the allocator must wait for the engine's queued kernels before handing the memory out again.
            device_buffer.record_stream(torch.cuda.default_stream(self.device))
        device_views = buffer_views(spec, device_plan, device_buffer, self.dtype)
        layers: list[LoraLayer | None] = [None] * (spec.num_layers + 1)  # + the model-level pseudo-layer
        read_s = layout_s = validate_s = 0.0
        roots = self.roots

        def opener(file: Path) -> int:  # the file indexed at registration, inside the roots, or an error
            return open_verified(file, spec.stamp, roots)

        nbytes = 0
        try:
            for layer in spec.layers:
                slots = spec.layer_records(layer)
                if from_disk:
                    n, r, v = _read_layer(layer, slots, host, opener)
                    nbytes, read_s, validate_s = nbytes + n, read_s + r, validate_s + v
                t0 = time.perf_counter()
                layers[layer] = self._lay_out(layer, slots, host, device_views, stream)
                if any(s.m is not None for s in slots):
                    layers[layer] = self._with_dora(layer, slots, host, layers[layer])
                layout_s += time.perf_counter() - t0
            if spec.parts:
                if from_disk:
                    n, r, v = _read_parts(spec, host, opener)
                    nbytes, read_s, validate_s = nbytes + n, read_s + r, validate_s + v
                t0 = time.perf_counter()
                self._lay_out_parts(spec, host, layers, stream)
                layout_s += time.perf_counter() - t0
        finally:  # observed on failure too: refusing a bad tensor is what the check costs
            if from_disk:
                metrics.ADAPTER_LOAD_DURATION.labels(stage="validate", tier="disk").observe(validate_s)
        if stream is not None:
            t0 = time.perf_counter()
            stream.synchronize()
            layout_s += time.perf_counter() - t0
        return Loaded(tuple(layers), host, from_disk, nbytes, read_s, layout_s)

    def _engine_reads(self, tensor: torch.Tensor, stream: torch.cuda.Stream | None) -> torch.Tensor:
        """``tensor``, made on the loader's stream, marked as read by the engine's (as the flat buffer is)."""
        if stream is not None:
            tensor.record_stream(torch.cuda.default_stream(self.device))
        return tensor

    def check_saved(self, spec: AdapterSpec) -> None:
        """Refuse an adapter whose saved modules (modules_to_save, saved base layers) exceed ``max_saved_bytes`` in
        the serving dtype: ``ResourceExhausted`` naming them."""
        size = spec.parts_nbytes(self.dtype, saved_only=True)
        if size > self.max_saved_bytes:
            raise ResourceExhausted(
                f"adapter {spec.id!r} saves {', '.join(spec.saved_modules)}: {size} bytes in the serving dtype, over "
                f"--max-saved-module-bytes {self.max_saved_bytes}"
            )

    def _lay_out(
        self,
        layer: int,
        slots: Sequence[SlotRecords],
        host: HostCopy,
        device_views: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]],
        stream: torch.cuda.Stream | None,
    ) -> LoraLayer:
        modules: dict[str, LoraModule] = {}
        nbytes = 0
        with torch.no_grad(), torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
            for s in slots:
                a_raw, b_raw = host.tensors[(layer, s.module)]  # [r, in], [out, r] in the file's dtype
                a, b = device_views[(layer, s.module)]  # same shapes, serving dtype, on the device
                a.copy_(a_raw, non_blocking=True)
                if b.dtype == torch.float32:
                    b.copy_(b_raw, non_blocking=True).mul_(s.scaling)
                else:  # scale in fp32, round once
                    b.copy_(b_raw.to(self.device, non_blocking=True).float().mul_(s.scaling))
                bias = None
                if s.bias is not None:  # scaled like B, in fp32, rounded once
                    raw = host.biases[(layer, s.module)].to(self.device, torch.float32)  # may be the host tensor
                    bias = self._engine_reads((raw * s.scaling).to(self.dtype), stream)
                    nbytes += bias.nbytes
                modules[s.module] = LoraModule(a=a, b=b, bias=bias)
                nbytes += a.nbytes + b.nbytes
        return LoraLayer(modules=modules, nbytes=nbytes)

    def _lay_out_parts(
        self, spec: AdapterSpec, host: HostCopy, layers: list[LoraLayer | None], stream: torch.cuda.Stream | None
    ) -> None:
        """Attach the parts to their layers: saved weights to ``LoraLayer.saved``, LoRA on embed_tokens / lm_head
        to the pseudo-layer's modules (``b`` scaled in fp32, rounded once)."""
        saved: dict[int, dict[str, torch.Tensor]] = {}
        lora: dict[str, dict[str, torch.Tensor]] = {}
        with torch.no_grad(), torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
            for p in spec.parts:
                raw = host.parts[(p.layer, p.name, p.role)].to(self.device, non_blocking=True)
                if p.role == "saved":
                    saved.setdefault(p.layer, {})[p.name] = self._engine_reads(raw.to(self.dtype), stream)
                else:
                    laid = (raw.float() * p.scaling).to(self.dtype)
                    lora.setdefault(p.name, {})[p.role] = self._engine_reads(laid, stream)
        for layer in sorted(set(saved) | ({spec.num_layers} if lora else set())):
            old = layers[layer]
            modules = dict(old.modules) if old is not None else {}
            modules |= {name: LoraModule(a=ab["A"], b=ab["B"]) for name, ab in lora.items() if layer == spec.num_layers}
            kept = saved.get(layer, {})
            tensors = [t for m in modules.values() for t in (m.a, m.b)] if layer == spec.num_layers else []
            nbytes = (old.nbytes if old is not None else 0) + sum(t.nbytes for t in (*tensors, *kept.values()))
            layers[layer] = LoraLayer(modules=modules, nbytes=nbytes, saved=kept)

    def _with_dora(self, layer: int, slots: Sequence[SlotRecords], host: HostCopy, laid: LoraLayer | None) -> LoraLayer:
        """``laid`` with each DoRA module's norm terms, from the float32 A, scaled B and the base weight."""
        assert laid is not None
        if self.base is None:
            raise InvalidAdapter("a DoRA adapter needs the base weights, which this store was not given")
        modules = dict(laid.modules)
        nbytes = laid.nbytes
        with torch.no_grad():
            for s in slots:
                if s.m is None:
                    continue
                a_raw, b_raw = host.tensors[(layer, s.module)]
                a = a_raw.to(self.device, torch.float32)  # [r, in]
                b = b_raw.to(self.device, torch.float32) * s.scaling  # [out, r]
                w = self.base.weight(layer, s.module)  # [out, in] float32
                dora = DoraNorm(
                    magnitude=host.magnitudes[(layer, s.module)].to(self.device, torch.float32),
                    base_sq=(w * w).sum(1),
                    cross=(b * (w @ a.t())).sum(1),
                    delta_sq=((b @ (a @ a.t())) * b).sum(1),
                )
                module = modules[s.module]
                modules[s.module] = LoraModule(
                    a=module.a, b=module.b, dora=dora, rescale=dora.rescale(1.0), bias=module.bias
                )
                nbytes += 5 * 4 * int(w.shape[0])
        return LoraLayer(modules=modules, nbytes=nbytes)


def _read_parts(spec: AdapterSpec, host: HostCopy, opener: Callable[[Path], int]) -> tuple[int, float, float]:
    """Read the adapter's ``parts`` into ``host.parts`` and check them finite: (bytes, read s, check s)."""
    t0 = time.perf_counter()
    plan = {}
    for p in spec.parts:
        plan[p.record.name] = host.parts[(p.layer, p.name, p.role)] = torch.empty(
            p.record.shape, dtype=p.record.torch_dtype, pin_memory=host.buffer.is_pinned()
        )
    stats = load_tensors({p.record.name: p.record for p in spec.parts}, plan, mode="stream", threads=1, opener=opener)
    t1 = time.perf_counter()
    try:
        for p in spec.parts:
            check_finite(host.parts[(p.layer, p.name, p.role)], p.record.name, p.record.file)
    finally:
        t2 = time.perf_counter()
    return stats.bytes_read, t1 - t0, t2 - t1


def _read_layer(
    layer: int, slots: Sequence[SlotRecords], host: HostCopy, opener: Callable[[Path], int]
) -> tuple[int, float, float]:
    """Read one layer's tensors from disk into the host buffer and check them finite: (bytes, read s, check s).
    A NaN or inf would reach every token of every request using the adapter: ``NonFiniteTensor`` names it."""
    t0 = time.perf_counter()
    plan = {}
    for s in slots:
        a, b = host.tensors[(layer, s.module)]
        plan[s.a.name], plan[s.b.name] = a, b
        if s.m is not None:
            m = host.magnitudes[(layer, s.module)] = torch.empty(s.m.shape, dtype=s.m.torch_dtype)
            plan[s.m.name] = m
        if s.bias is not None:
            plan[s.bias.name] = host.biases[(layer, s.module)] = torch.empty(s.bias.shape, dtype=s.bias.torch_dtype)
    records = {r.name: r for s in slots for r in (s.a, s.b, s.m, s.bias) if r is not None}
    stats = load_tensors(records, plan, mode="stream", threads=1, opener=opener)
    t1 = time.perf_counter()
    try:
        for s in slots:
            for rec, tensor in zip((s.a, s.b), host.tensors[(layer, s.module)], strict=True):
                check_finite(tensor, rec.name, rec.file)
            if s.m is not None:
                check_finite(host.magnitudes[(layer, s.module)], s.m.name, s.m.file)
            if s.bias is not None:
                check_finite(host.biases[(layer, s.module)], s.bias.name, s.bias.file)
    finally:
        t2 = time.perf_counter()
    return stats.bytes_read, t1 - t0, t2 - t1


__all__ = ["DEVICE_ALIGN", "HOST_ALIGN", "MAX_SAVED_MODULE_BYTES", "AdapterReader", "HostCopy", "Loaded"]
