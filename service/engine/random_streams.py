"""Per-request randomness for sampling: one ``RandomStream`` per sampled request, one uniform per row per step.

A stream is seeded from all 64 bits of the request's seed when it has one (torch's CPU generator keeps only the
low 32), or from the OS when it has none. ``uniforms`` draws one U[0, 1) number per row, each from that row's own
stream, so a row's draw never depends on which other requests share the batch. Nothing here touches logits.
"""

from __future__ import annotations

import os
import random
from collections.abc import Sequence

import torch
from torch import Tensor

__all__ = ["MAX_SEED", "Generator", "RandomStream", "make_generator", "uniforms"]

MAX_SEED = 2**64 - 1


class RandomStream:
    """One request's stream of U[0, 1) draws, seeded with every bit of a 64-bit seed.

    ``torch.Generator.manual_seed`` on CPU seeds its Mersenne Twister with the seed's low 32 bits, so seeds s,
    s + 2**32 and s + 2**63 gave identical output; Python's ``random.Random`` seeds its Mersenne Twister with the
    whole integer. Draws are float64 with 53 random bits and the same on every platform.
    """

    __slots__ = ("_rng", "seed")

    def __init__(self, seed: int) -> None:
        self.seed = seed
        self._rng = random.Random(seed)

    def uniforms(self, count: int) -> list[float]:
        return [self._rng.random() for _ in range(count)]


Generator = RandomStream | torch.Generator


def make_generator(seed: int | None, device: torch.device | str = "cpu") -> RandomStream:
    """A fresh random stream for one request: seeded from ``seed``, or from the OS when it has none.

    ``device`` is accepted for symmetry with torch generators; draws are made on the host (one per row per step)
    and moved to the logits' device with the rest of the batch's."""
    del device
    return RandomStream(seed if seed is not None else int.from_bytes(os.urandom(8), "little"))


def uniforms(generators: Sequence[Generator | None], device: torch.device) -> Tensor:
    """One U[0, 1) float64 per row, each from its own stream (a torch generator draws on its own device; a row
    without a generator draws from torch's default one)."""
    if all(isinstance(gen, RandomStream) for gen in generators):  # the engine's case: one host tensor
        values = [u for gen in generators if isinstance(gen, RandomStream) for u in gen.uniforms(1)]
        return torch.tensor(values, dtype=torch.float64, device=device)  # [S]
    draws = []
    for gen in generators:
        if gen is None:
            draws.append(torch.rand((1,), dtype=torch.float64))
        elif isinstance(gen, RandomStream):
            draws.append(torch.tensor(gen.uniforms(1), dtype=torch.float64))
        else:
            draws.append(torch.rand((1,), dtype=torch.float64, generator=gen, device=gen.device))
    return torch.cat([d.to(device) for d in draws])  # [S]
