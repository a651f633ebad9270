"""The slot KV cache: one row ("slot") per running request, indexed by token position.

The engine keeps its running requests compacted in slots ``0..n-1`` so that every forward pass reads one
contiguous slot range as a plain slice (no gather). When a request retires, the last row is moved into the hole
with ``move``; a verified draft path is kept with ``keep_path`` and a failed step's slots are zeroed with
``clear`` (the cache owns every slot move). A row's length is the engine's business: the model writes K/V at the
positions it is given and attends only to positions ``<=`` the query's own, so whatever lies beyond a row's length
(a rolled-back draft, a former occupant, the tail of a padded prompt) is never read into a result.

Masked attention is NaN-safe by what the cache holds: it starts zeroed, never uninitialised, and the model writes
only finite values bounded by ``KV_LIMIT`` (``finite_kv``), so a masked-out key scores exactly -inf and
its value is weighted by exactly 0 (``0 * NaN`` would be NaN), whoever occupied the slot before. On the CPU the
zeros come from an anonymous memory map, so the cache costs resident memory only for the pages requests actually
write: a 32-slot, 4096-token cache is sized for the worst case without zero-filling gigabytes at start-up.
"""

from __future__ import annotations

import mmap

import torch
from torch import Tensor

from service.model.config import ModelConfig

__all__ = ["KV_LIMIT", "KVCache", "finite_kv", "lazy_zeros"]

# Bound of every value the KV cache holds (the fp16 maximum). K/V past a row's length stay in its slot and are
# read, masked, by the next occupant whenever it shares a batch with a longer row: a masked score must be exactly
# -inf and a masked value weighted by exactly 0, which NaN, inf or a score that overflows to inf would break.
KV_LIMIT = 65504.0


def finite_kv(kv: Tensor) -> Tensor:
    """K/V as the cache stores them: NaN -> 0, everything else clamped to +-KV_LIMIT. The identity on the values of
    any healthy row (it only touches this step's new K/V, a few KB); a row that produced non-finite values fails
    on its own logits, while its slot keeps nothing that could poison the slot's next occupant."""
    return torch.nan_to_num(kv, nan=0.0, posinf=KV_LIMIT, neginf=-KV_LIMIT).clamp_(-KV_LIMIT, KV_LIMIT)


class KVCache:
    def __init__(self, cfg: ModelConfig, slots: int, max_len: int, *, dtype: torch.dtype, device: torch.device) -> None:
        if slots <= 0 or max_len <= 0:
            raise ValueError(f"slots and max_len must be positive, got slots={slots} max_len={max_len}")
        self.slots = slots
        self.max_len = max_len
        self.dtype = dtype
        self.device = torch.device(device)
        self.num_layers = cfg.num_layers
        # One allocation for everything, so `move` is one copy for all layers.
        shape = (cfg.num_layers, 2, slots, cfg.num_kv_heads, max_len, cfg.head_dim)
        self.data = lazy_zeros(shape, dtype, self.device)  # [L, 2, slots, n_kv, max_len, D]
        self.k: list[torch.Tensor] = [self.data[i, 0] for i in range(cfg.num_layers)]  # each [slots, n_kv, max_len, D]
        self.v: list[torch.Tensor] = [self.data[i, 1] for i in range(cfg.num_layers)]
        # Flat views for writing: one index_copy_ per layer puts a whole step's K and V in place.
        self.rows: list[torch.Tensor] = [self.data[i].view(-1, cfg.head_dim) for i in range(cfg.num_layers)]
        self._n_kv = cfg.num_kv_heads
        self._head_offsets = torch.arange(2 * cfg.num_kv_heads, device=self.device)  # [2 * n_kv]: K heads, V heads

    @property
    def nbytes(self) -> int:
        return self.data.numel() * self.data.element_size()

    def write_index(self, slot_start: int, positions: torch.Tensor) -> torch.Tensor:
        """Row numbers in ``rows[layer]`` for the K and V of tokens at ``positions`` [B, T] of slots
        ``slot_start + b``, ordered (b, t, j) with j < n_kv the K heads and j >= n_kv the V heads: [B * T * 2 * n_kv].

        Computed once per forward pass and shared by every layer (all layers have the same layout).
        """
        b = positions.shape[0]
        slots = torch.arange(slot_start, slot_start + b, device=positions.device)  # [B]
        j = self._head_offsets  # [2 * n_kv]
        kv = j // self._n_kv  # [2 * n_kv]: 0 = K, 1 = V
        head = j % self._n_kv
        # data[layer] is [2, slots, n_kv, max_len, D]; this is the row of element (kv, slot, head, position).
        base = ((kv * self.slots)[None, :] + slots[:, None]) * self._n_kv + head[None, :]  # [B, 2 * n_kv]
        index = base[:, None, :] * self.max_len + positions[:, :, None]  # [B, T, 2 * n_kv]
        return index.reshape(-1)

    def move(self, src_slot: int, dst_slot: int, length: int) -> None:
        """Copy positions ``[0, length)`` of every layer's K and V from ``src_slot`` to ``dst_slot``."""
        for name, slot in (("src_slot", src_slot), ("dst_slot", dst_slot)):
            if not 0 <= slot < self.slots:
                raise ValueError(f"{name}={slot} is outside [0, {self.slots})")
        if not 0 <= length <= self.max_len:
            raise ValueError(f"length={length} is outside [0, {self.max_len}]")
        if src_slot == dst_slot or length == 0:
            return
        self.data[:, :, dst_slot, :, :length] = self.data[:, :, src_slot, :, :length]  # [L, 2, n_kv, length, D]

    def clear(self, slots: int, length: int, *, first: int = 0) -> None:
        """Zero positions ``[0, length)`` of slots ``[first, first + slots)`` (after a failed step: nothing
        half-written stays)."""
        first = min(max(first, 0), self.slots)
        stop, length = min(first + max(slots, 0), self.slots), min(max(length, 0), self.max_len)
        self.data[:, :, first:stop, :, :length].zero_()  # [L, 2, slots, n_kv, length, D]

    def keep_path(self, slot: int, start: int, path: list[int]) -> None:
        """After a draft verification wrote tree node ``i`` of ``slot`` at position ``start + i``, keep the
        accepted nodes ``path`` (ascending node numbers, root excluded) at ``start + 1 .. start + len(path)``.

        A path that is already in place (a chain's prefix) costs nothing; what lies past it is never read.
        """
        if not 0 <= slot < self.slots:
            raise ValueError(f"slot={slot} is outside [0, {self.slots})")
        a = len(path)
        if path == list(range(1, a + 1)):
            return
        if start + 1 + a > self.max_len or any(not 0 < i < self.max_len - start for i in path):
            raise ValueError(f"path {path} from position {start} does not fit max_len={self.max_len}")
        src = torch.tensor([start + i for i in path], device=self.device)  # [a]
        dst = torch.arange(start + 1, start + 1 + a, device=self.device)  # [a]
        self.data[:, :, slot, :, dst] = self.data[:, :, slot, :, src]  # [L, 2, n_kv, a, D]

    def __repr__(self) -> str:
        return (
            f"KVCache(layers={self.num_layers}, slots={self.slots}, max_len={self.max_len}, "
            f"dtype={self.dtype}, device={self.device}, nbytes={self.nbytes})"
        )


def lazy_zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A zero tensor; on the CPU backed by lazily-committed anonymous pages (the kernel zero-fills on first touch)."""
    if device.type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    numel = 1
    for n in shape:
        numel *= n
    nbytes = numel * torch.empty((), dtype=dtype).element_size()
    if nbytes == 0:
        return torch.zeros(shape, dtype=dtype)
    region = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE)
    # The tensor holds a reference to ``region`` through its storage's buffer, which keeps the mapping alive.
    return torch.frombuffer(region, dtype=dtype, count=numel).view(shape)
