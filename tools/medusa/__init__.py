"""Medusa outside the serving path: the reference generation loop, verification by the book, head training.

``loop`` is the batched greedy loop the engine's speculation is checked against; ``speculative`` verifies one draft
chain per row (greedy, and speculative sampling with its distribution proof); ``train`` distils heads from the base
model's own text. The server's Medusa code (format, heads, registry, draft trees) stays in ``service.adapters.medusa``.
"""

from __future__ import annotations

from tools.medusa.loop import Generation, GenerationStats, generate
from tools.medusa.speculative import PAD, Verified, verify_greedy, verify_sampling

__all__ = ["PAD", "Generation", "GenerationStats", "Verified", "generate", "verify_greedy", "verify_sampling"]
