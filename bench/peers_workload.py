"""The side-by-side workload of bench/peers.py, shared by every engine's runner (standard library only).

The peers' runners import this module from their own virtualenvs (vLLM's, llama-cpp-python's), so it must never
import anything outside the standard library. It fixes what "the same run" means for every engine: the prompts
(no chat template), greedy decoding with EOS ignored, exactly ``NEW_TOKENS`` new tokens per request, request
``i`` of a row using adapter ``i mod n`` of the first ``n`` adapters, and tok/s = generated tokens / wall time of
the whole batch, the warm median over ``runs`` after one warm-up.
"""

from __future__ import annotations

import os
import statistics
from dataclasses import asdict, dataclass
from typing import Any

__all__ = ["NEW_TOKENS", "ROWS", "Row", "peak_rss_bytes", "prompt", "row_by_key", "summarise"]

NEW_TOKENS = 32


@dataclass(frozen=True)
class Row:
    """One line of the table: ``requests`` sent at once, spread over the first ``adapters`` LoRAs (0 = base)."""

    key: str
    title: str
    requests: int
    adapters: int

    def adapter_of(self, i: int) -> int | None:
        """Index of request ``i``'s adapter, None for the base model."""
        return i % self.adapters if self.adapters else None

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


ROWS = (
    Row("b1", "1 request, no LoRA", 1, 0),
    Row("b1_lora", "1 request, 1 LoRA", 1, 1),
    Row("b16_l8", "16 requests over 8 LoRAs", 16, 8),
    Row("b32_l16", "32 requests over 16 LoRAs", 32, 16),
    Row("b32", "32 requests, no LoRA", 32, 0),
)


def row_by_key(key: str) -> Row:
    for row in ROWS:
        if row.key == key:
            return row
    raise KeyError(f"unknown row {key!r}; rows: {', '.join(r.key for r in ROWS)}")


def prompt(i: int) -> str:
    """Request ``i``'s prompt, sent as plain text (no chat template)."""
    return f"Write a short story about a robot number {i}."


def summarise(walls: list[float], tokens: int, first_ids: list[int]) -> dict[str, Any]:
    """tok/s of each measured run (``tokens`` generated in ``walls[k]`` seconds) and their median; ``first_ids``
    (request 0's token ids in the last run) lets the report check that the engines did the same work."""
    rates = [tokens / w for w in walls]
    return {
        "tok_s": statistics.median(rates),
        "tok_s_runs": rates,
        "wall_s_runs": walls,
        "tokens": tokens,
        "first_ids": first_ids,
    }


def peak_rss_bytes(pid: int | None = None) -> int:
    """Peak resident set size (VmHWM) of ``pid`` (default: this process), in bytes; 0 when unreadable."""
    path = f"/proc/{pid if pid is not None else os.getpid()}/status"
    try:
        with open(path) as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0
