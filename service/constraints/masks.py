"""Token masks for the constrained rows of a step, computed beside the forward pass and applied before sampling.

``begin`` hands the rows' matchers to the mask thread, which fills one int32 bitmask row per constrained row
(the backend's executor spreads the rows over its own threads, with the GIL released) while the engine thread
runs the forward pass; ``apply`` waits for it, if it is not done yet, and sets every disallowed logit to -inf,
on the logits' device. Sampling then sees only tokens the grammar allows, whatever the sampling options; a row
whose mask allows nothing is a dead end, reported to the caller. ``load`` / ``allows`` / ``masked`` serve
speculative verification, which walks a row's draft node by node and needs the mask after each accepted token.

It never advances a matcher: the output processor consumes each emitted token.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from service import metrics
from service.constraints.backend import Backend, Matcher
from service.torch_threads import name_os_thread

__all__ = ["Masks", "PendingMasks"]


class PendingMasks:
    """One step's masks in flight: ``rows`` (index in the step's batch, matcher), and the fill's future."""

    __slots__ = ("future", "rows")

    def __init__(self, rows: list[tuple[int, Matcher]], future: Future[float]) -> None:
        self.rows = rows
        self.future = future


class Masks:
    def __init__(self, backend: Backend, vocab: int, max_rows: int, device: torch.device) -> None:
        self.backend = backend
        self.vocab = vocab
        self.device = device
        self.words = (vocab + 31) // 32
        pin = device.type == "cuda"
        self._bits = torch.zeros((max_rows, self.words), dtype=torch.int32, pin_memory=pin)  # [R, W]
        self._one = torch.zeros((1, self.words), dtype=torch.int32, pin_memory=pin)  # [1, W]: speculative walks
        # byte -> which of its 8 tokens are refused (bit j of byte k of the little-endian words: token 8k + j)
        table = [[not (byte >> j) & 1 for j in range(8)] for byte in range(256)]
        self._refuses = torch.tensor(table, dtype=torch.bool, device=device)  # [256, 8]
        self._pool: ThreadPoolExecutor | None = None
        self._lock = threading.Lock()
        self._last: Future[float] | None = None  # the fill in flight: one bitmask, so one fill at a time

    def begin(self, rows: Sequence[object]) -> PendingMasks | None:
        """Start filling the masks of the rows (anything with a ``matcher``) that have one; None if none has."""
        constrained = [(b, m) for b, r in enumerate(rows) if (m := getattr(r, "matcher", None)) is not None]
        if not constrained:
            return None
        if self._last is not None and not self._last.done():  # a step that failed before applying its masks
            self._last.exception()
        self._last = self._executor().submit(self._fill, constrained)
        return PendingMasks(constrained, self._last)

    def _executor(self) -> ThreadPoolExecutor:
        with self._lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(1, thread_name_prefix="loraplex-masks", initializer=name_os_thread)
            return self._pool

    def _fill(self, rows: list[tuple[int, Matcher]]) -> float:
        start = time.perf_counter()
        bits = self._bits
        self.backend.fill_masks([(m, b) for b, m in rows], bits.data_ptr(), self.words * 4, bits.shape[0])
        seconds = time.perf_counter() - start
        metrics.CONSTRAINT_MASK_SECONDS.observe(seconds)
        return seconds

    def apply(self, pending: PendingMasks, logits: torch.Tensor, argmax: Sequence[int | None] = ()) -> list[int]:
        """Mask ``logits`` [B, V] in place (row b of the step gets its matcher's mask); returns the rows whose mask
        allows no token (dead ends).

        ``argmax[b]``, where given, is row b's unmasked argmax, for a row that needs only its argmax to be right
        (greedy, no penalty, no logprobs): when its grammar allows that token, the masked argmax is the same token
        (ties go to the lowest id either way) and the row's logits are left alone; they are masked only when it is
        refused. A model that writes what its grammar wants (most steps of a JSON output) costs one bit test."""
        start = time.perf_counter()
        pending.future.result()
        metrics.CONSTRAINT_MASK_WAIT_SECONDS.observe(time.perf_counter() - start)
        index = [b for b, _ in pending.rows]
        bits = self._bits.index_select(0, torch.tensor(index, dtype=torch.long))  # [C, W]: row b's mask at row b
        words = bits.numpy()
        full = []  # rows (of ``index``) whose logits are masked
        for c, b in enumerate(index):
            top = argmax[b] if argmax else None
            if top is None or not (int(words[c, top // 32]) >> (top % 32)) & 1:
                full.append(c)
        if full:
            at = torch.tensor([index[c] for c in full], dtype=torch.long, device=logits.device)
            refused = self._refused(bits.index_select(0, torch.tensor(full, dtype=torch.long)))  # [F, V]
            if len(full) == logits.shape[0]:  # every row of the step: in place
                logits.masked_fill_(refused, float("-inf"))
            else:
                logits.index_copy_(0, at, logits.index_select(0, at).masked_fill_(refused, float("-inf")))
        none = (bits == 0).all(dim=-1).tolist()  # bits past the vocabulary are never set
        # A matcher in error (a backend limit hit, a refused token) may still allow end-of-sequence: a dead end too.
        return [b for (b, m), dead in zip(pending.rows, none, strict=True) if dead or m.error]

    # One matcher at a time, on the engine thread: speculative verification walks a draft node by node.
    def load(self, matcher: Matcher) -> bool:
        """Compute ``matcher``'s mask for ``allows`` and ``masked``; False at a dead end (nothing allowed)."""
        matcher.fill_mask(self._one.data_ptr(), self.words * 4)
        return not matcher.error and bool(self._one.any())

    def allows(self, token: int) -> bool:
        """Whether the loaded mask allows ``token``."""
        return bool((int(self._one[0, token // 32]) >> (token % 32)) & 1)

    def masked(self, logits: torch.Tensor) -> torch.Tensor:
        """One row's logits [V] with what the loaded mask refuses set to -inf (a copy)."""
        return logits.masked_fill(self._refused(self._one)[0], float("-inf"))

    def _refused(self, bits: torch.Tensor) -> torch.Tensor:
        """[C, W] int32 bitmask -> [C, V] bool on the logits' device, True where a token is refused (bit t % 32 of
        word t // 32 clear: token t), through a 256-entry table of bytes."""
        octets = bits.to(self.device, non_blocking=True).view(torch.uint8).long()  # [C, 4W]
        return self._refuses[octets].view(bits.shape[0], -1)[:, : self.vocab]

    def close(self) -> None:
        with self._lock:
            if self._pool is not None:
                self._pool.shutdown(wait=False)
                self._pool = None
