"""Prefix caching: the K/V of prompt blocks already prefilled, reused by later prompts that start the same way.

Public API::

    PrefixCache(cache: KVCache, budget_bytes: int, block: int = 16)
    prefix.hashes(tokens, key, limit=None) -> list[int]     chain hash of each full block
    prefix.lookup(tokens, key, limit=None) -> list[int]     pool indices of the longest cached block prefix
    prefix.restore(blocks, slot) -> int                     copies them into a KV slot; returns positions restored
    prefix.insert(tokens, key, slot, length) -> int         stores the slot's full blocks; returns blocks added
    prefix.forget(match) -> int                             drops every block whose key matches (an unloaded adapter's)
    prefix.clear(), .blocks_by_key(), .blocks_used, .touched_rows, .capacity, .nbytes, .block

Chat traffic repeats itself: every request of a deployment carries the same system prompt and chat-template
header, and multi-turn conversations resend the whole history. Their K/V is the same whoever computes it, so
the engine computes it once. A prompt is cut into blocks of ``block`` tokens; block ``i`` is identified by a
hash chained over every token before its end and the row's ``key`` (the LoRA adapter registration whose deltas
shaped the K/V, or ``None`` for the base model), so a block is reused only where the whole prefix up to it
matches. The tokens are stored with each block and compared on lookup: a hash collision cannot return the
wrong K/V.

Storage is one pool tensor on the cache's device, ``[layers, 2, n_kv, capacity, block, head_dim]``, sized by the
byte budget; a restore is one ``index_select`` + one copy into the slot, an insert one ``index_copy_``. Blocks
are evicted least recently used first (a lookup touches every block it returns). Evicting a block whose
descendants remain only makes those descendants unreachable until they age out too.

Numerics: restored K/V were computed in another prefill, with another batch shape, so logits after a cache hit
can differ from a cold prefill in the last bits, exactly as they can between two batch compositions.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass

import torch

from service.model import KVCache
from service.model.kv_cache import lazy_zeros


@dataclass
class _Block:
    index: int  # in the pool
    tokens: tuple[int, ...]  # this block's tokens
    parent: int | None  # the previous block's hash (None: the first block)
    key: Hashable  # the key its chain was hashed under (``forget`` drops blocks by key)


class PrefixCache:
    def __init__(self, cache: KVCache, budget_bytes: int, block: int = 16) -> None:
        if block <= 0:
            raise ValueError(f"block must be > 0, got {block}")
        layers, two, _, n_kv, _, head_dim = cache.data.shape
        self.block = block
        self.kv = cache
        per_block = layers * two * n_kv * block * head_dim * cache.data.element_size()
        self.capacity = max(0, budget_bytes // per_block)
        # [L, 2, n_kv, capacity, block, D]; an empty pool when the budget holds no block (caching off)
        self.pool = lazy_zeros((layers, two, n_kv, self.capacity, block, head_dim), cache.dtype, cache.device)
        self._blocks: OrderedDict[int, _Block] = OrderedDict()  # chain hash -> block, least recently used first
        self._free = list(range(self.capacity - 1, -1, -1))
        self.touched_rows = 0  # pool rows ever written: the pool's pages are touched lazily, lowest rows first

    @property
    def enabled(self) -> bool:
        return self.capacity > 0

    @property
    def blocks_used(self) -> int:
        return len(self._blocks)

    @property
    def nbytes(self) -> int:
        return self.pool.numel() * self.pool.element_size()

    def clear(self) -> None:
        self._blocks.clear()
        self._free = list(range(self.capacity - 1, -1, -1))

    def forget(self, match: Callable[[Hashable], bool]) -> int:
        """Drop every block stored under a key ``match`` accepts (those an adapter registration that is gone shaped,
        alone or in a mixture: no lookup can reach them again); returns how many. Their pool rows are the next to be
        reused (the free list is a stack), so under adapter churn the pool's touched memory stays at the working set
        instead of growing to the budget."""
        gone = [h for h, block in self._blocks.items() if match(block.key)]
        for h in gone:
            self._free.append(self._blocks.pop(h).index)
        return len(gone)

    def blocks_by_key(self) -> dict[Hashable, int]:
        """Blocks held per key (state for tests and metrics)."""
        held: dict[Hashable, int] = {}
        for block in self._blocks.values():
            held[block.key] = held.get(block.key, 0) + 1
        return held

    def _chain(self, tokens: Sequence[int], key: Hashable, blocks: int) -> list[tuple[int, tuple[int, ...]]]:
        """(chain hash, tokens) of the first ``blocks`` blocks of ``tokens``."""
        out: list[tuple[int, tuple[int, ...]]] = []
        parent = hash(("loraplex-prefix", key))
        for i in range(blocks):
            part = tuple(tokens[i * self.block : (i + 1) * self.block])
            parent = hash((parent, part))
            out.append((parent, part))
        return out

    def hashes(self, tokens: Sequence[int], key: Hashable, *, limit: int | None = None) -> list[int]:
        """The chain hash of each full block of ``tokens[:limit]``: equal hashes, equal prefixes (up to collisions,
        which ``lookup`` rules out by comparing tokens)."""
        usable = len(tokens) if limit is None else min(limit, len(tokens))
        return [h for h, _ in self._chain(tokens, key, usable // self.block)] if self.enabled else []

    def lookup(self, tokens: Sequence[int], key: Hashable, *, limit: int | None = None) -> list[int]:
        """Pool indices of the longest run of cached blocks that starts ``tokens`` (at most ``limit`` tokens)."""
        if not self.enabled:
            return []
        usable = len(tokens) if limit is None else min(limit, len(tokens))
        found: list[int] = []
        prev: int | None = None
        for h, part in self._chain(tokens, key, usable // self.block):
            entry = self._blocks.get(h)
            if entry is None or entry.tokens != part or entry.parent != prev:
                break
            self._blocks.move_to_end(h)
            found.append(entry.index)
            prev = h
        return found

    def restore(self, blocks: Sequence[int], slot: int) -> int:
        """Copy ``blocks`` (from ``lookup``) into positions ``[0, len(blocks) * block)`` of KV slot ``slot``."""
        if not blocks:
            return 0
        n = len(blocks) * self.block
        index = torch.tensor(list(blocks), device=self.pool.device)
        picked = self.pool.index_select(3, index)  # [L, 2, n_kv, nb, block, D]
        layers, two, n_kv, _, _, d = picked.shape
        self.kv.data[:, :, slot, :, :n] = picked.view(layers, two, n_kv, n, d)
        return n

    def insert(self, tokens: Sequence[int], key: Hashable, slot: int, length: int) -> int:
        """Store the full blocks of ``tokens[:length]`` whose K/V sit in KV slot ``slot``; returns blocks added."""
        if not self.enabled:
            return 0
        # At most `capacity` blocks: every block of this chain is then more recent than any block evicted for it.
        chain = self._chain(tokens, key, min(min(length, len(tokens)) // self.block, self.capacity))
        new: list[int] = []  # block numbers within the prompt
        pool_index: list[int] = []
        prev: int | None = None
        for i, (h, part) in enumerate(chain):
            entry = self._blocks.get(h)
            if entry is not None and entry.tokens == part and entry.parent == prev:
                self._blocks.move_to_end(h)
            else:
                if entry is not None:  # a colliding hash: the newer block replaces it
                    self._free.append(self._blocks.pop(h).index)
                if not self._free:
                    _, old = self._blocks.popitem(last=False)
                    self._free.append(old.index)
                index = self._free.pop()
                self.touched_rows = max(self.touched_rows, index + 1)
                self._blocks[h] = _Block(index, part, prev, key)
                new.append(i)
                pool_index.append(index)
            prev = h
        if new:
            layers, two, _, n_kv, _, d = self.kv.data.shape
            src = self.kv.data[:, :, slot, :, : len(chain) * self.block].reshape(layers, two, n_kv, len(chain), -1, d)
            picked = src.index_select(3, torch.tensor(new, device=src.device))  # [L, 2, n_kv, len(new), block, D]
            self.pool.index_copy_(3, torch.tensor(pool_index, device=src.device), picked)
        return len(new)
