"""Every kind of weight the model serves, behind one protocol (``protocol``): what each kind is and how it computes.

- dense: a plain ``Tensor`` [N, K] (``protocol.linear`` runs ``F.linear``);
- ``Int8Weight`` (``int8``) and ``Int4Weight`` (``int4``, its packed layout derived by ``int4_layout``): weight-only
  quantized projections, made by ``kinds.quantize`` (the table of quantizers) or from stored blocks (GGUF);
- ``Q4Native`` (``q4``, ``q4_native``): a GGUF's 4-bit blocks as stored, multiplied in float32 by loraplex's
  compiled kernel (``service.kernels.native``);
- ``Bf16Pairs`` (``bf16_pairs``): a bf16 model's dense projections, as stored, kept in pairs for the compiled
  kernel's bf16 dot products (lossless; chosen at load where the CPU has them), and ``PairsTable``, its head;
- ``Q8Table`` (``q8_table``): a GGUF Q8_0 embedding / output head, an ``EmbeddingTable``;
- dense copies: any kind's ``with_dense_copy``, and ``dense_copies.keep_dense_copies`` (a model's, within a
  budget).

``dispatch`` holds the measured rows from which ``linear`` leaves a kernel for a dense matmul. The model
(``service.model.llama``) imports ``protocol`` only; loaders and the self-check import the kinds. Nothing here
reads a file or records a metric.
"""

from __future__ import annotations

from service.model.weights.bf16_pairs import Bf16Pairs, PairsTable
from service.model.weights.dispatch import DENSE_COPY_FROM_ROWS, DENSE_FROM_ROWS, NEVER, dense_from_rows
from service.model.weights.int4 import Int4Weight
from service.model.weights.int8 import Int8Weight
from service.model.weights.kinds import QUANTIZERS, QuantKind, quantize, with_dense_copy
from service.model.weights.protocol import EmbeddingTable, ProjWeight, Scratch, Weight, linear
from service.model.weights.q4_native import Q4Native
from service.model.weights.q8_table import Q8Table

__all__ = [
    "DENSE_COPY_FROM_ROWS",
    "DENSE_FROM_ROWS",
    "NEVER",
    "QUANTIZERS",
    "Bf16Pairs",
    "EmbeddingTable",
    "Int4Weight",
    "Int8Weight",
    "PairsTable",
    "ProjWeight",
    "Q4Native",
    "Q8Table",
    "QuantKind",
    "Scratch",
    "Weight",
    "dense_from_rows",
    "linear",
    "quantize",
    "with_dense_copy",
]
