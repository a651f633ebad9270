"""The quantized kinds a dense checkpoint can be served as: one table, name -> quantizer.

    quantize(w [N, K], kind, group_size=32, *, dtype=None) -> Weight     kind: a key of ``QUANTIZERS``

``dtype`` is the compute dtype: the activations' dtype, which torch's kernels require the scales to share (float32,
bfloat16 or float16). A new kind is its class in its own module (implementing ``protocol.Weight``) plus its entry
here; ``--quantize`` (``service.config.QUANTIZE``) names the same keys.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Literal

import torch
from torch import Tensor

from service.model.weights.int4 import Int4Weight
from service.model.weights.int8 import Int8Weight
from service.model.weights.protocol import Weight

__all__ = ["QUANTIZERS", "QuantKind", "quantize", "with_dense_copy"]

QuantKind = Literal["int8", "int4"]

# kind -> (w [N, K], group_size, dtype) -> the compact weight
QUANTIZERS: dict[str, Callable[[Tensor, int, torch.dtype | None], Weight]] = {
    "int8": lambda w, _group, dtype: Int8Weight.quantize(w, dtype=dtype),
    "int4": lambda w, group, dtype: Int4Weight.quantize(w, group, dtype=dtype),
}


def quantize(w: Tensor, kind: str, group_size: int = 32, *, dtype: torch.dtype | None = None) -> Weight:
    """Quantize a dense [N, K] weight (see the classes' ``quantize``)."""
    quantizer = QUANTIZERS.get(kind)
    if quantizer is None:
        raise ValueError(f"quantization kind must be {' or '.join(map(repr, QUANTIZERS))}, got {kind!r}")
    return quantizer(w, group_size, dtype)


def with_dense_copy(w: Weight) -> Weight:
    """``w`` keeping its dequantized weight, which ``linear`` multiplies by from ``DENSE_COPY_FROM_ROWS`` rows on:
    the kernel's speed at small batches, the dense matmul's at large ones, for the memory of both."""
    return w.with_dense_copy()
