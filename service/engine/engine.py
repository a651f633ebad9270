"""The engine: one thread that owns the model and the KV cache and runs continuous batching.

Every iteration of the loop: take new submissions, retire cancelled / expired rows, admit waiting requests
into free KV slots and prefill them in one padded batch, then run one decode step for every running row.
Requests join and leave between steps; a row's tokens are handed to its sink as soon as they are sampled.

Running rows are kept compacted in KV slots ``0..n-1`` (row ``i`` lives in slot ``i``): when a row retires,
the last row's cache is moved into the hole, so every forward pass reads one contiguous slot range.

The engine never awaits and the event loop never runs torch: they meet at ``submit`` (a thread-safe queue)
and at each request's sink (called on this thread; the servicer hops to its loop).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from service import metrics
from service.adapters.catalog import AdapterCatalog
from service.adapters.lora import AdapterBatch, LoraTables
from service.config import Settings
from service.engine.detok import IncrementalDetokenizer
from service.engine.governor import SpeculationGovernor
from service.engine.prefix import PrefixCache
from service.engine.request import (
    FinishReason,
    GenerationRequest,
    RequestHandle,
    Sink,
    TokenEvent,
    check_max_new_tokens,
)
from service.engine.sampling import RandomStream, Sampler, make_generator
from service.engine.stops import StopMatcher
from service.engine.thread_governor import ThreadControl, step_key
from service.errors import (
    AdapterNotFound,
    EngineStepFailed,
    FailedPrecondition,
    InvalidRequest,
    LoraplexError,
    QueueFull,
    Unavailable,
)
from service.medusa.heads import MedusaHeads
from service.medusa.tree import DraftTree
from service.model.kv_cache import KVCache
from service.model.llama import Llama
from service.tokenizer import Tokenizer

log = logging.getLogger("loraplex.engine")

# Padded prompt tokens one prefill pass may hold: bounds the prefill's activation memory and the time running
# streams wait while newcomers are prefilled.
PREFILL_TOKEN_BUDGET = 8192


@dataclass(eq=False)
class _Row:
    handle: RequestHandle
    sink: Sink
    detok: IncrementalDetokenizer
    stops: StopMatcher | None
    generator: RandomStream | None
    ids: list[int]  # prompt + generated, for the repetition penalty
    length: int = 0  # tokens whose K/V are in the cache
    pending: int = -1  # last sampled token, fed at the next decode step
    generated: int = 0
    pinned: bool = False  # holds a pin on its adapter's LoRA part in the store (taken at admission)
    lora: bool = False  # its adapter has a LoRA part
    heads: MedusaHeads | None = None  # Medusa heads that draft for this row (greedy rows only)
    kv_key: tuple[str, float] | None = None  # what besides the tokens shapes its K/V: the LoRA registration
    drafts: list[int] = field(default_factory=list)  # drafted tokens to verify at the next step
    accepted: int = 0  # draft tokens accepted so far
    done: bool = False
    enqueued: float = field(default_factory=time.monotonic)
    last_token_at: float = 0.0

    @property
    def request(self) -> GenerationRequest:
        return self.handle.request


@dataclass(frozen=True)
class EngineState:
    """A snapshot for tests, metrics and ModelInfo."""

    running: int
    waiting: int
    slots: int
    steps: int
    running_ids: tuple[str, ...]


class Engine:
    def __init__(
        self, model: Llama, tokenizer: Tokenizer, settings: Settings, *, adapters: AdapterCatalog | None = None
    ) -> None:
        self.model = model
        self.tokenizer = tokenizer
        self.settings = settings
        param = next(model.parameters())
        self.device = param.device
        self.cache = KVCache(
            model.cfg, settings.max_batch_size, settings.max_total_tokens, dtype=param.dtype, device=self.device
        )
        self.sampler = Sampler(self.device)
        self.adapters = adapters
        # LoRA weights laid out for the batched math, kept across steps (rows stay in their slots).
        self.tables = LoraTables(model.cfg, device=self.device, dtype=param.dtype) if adapters is not None else None
        self._trees: dict[int, DraftTree] = {}  # the draft tree per head count
        self.governor = SpeculationGovernor()
        self.threads = ThreadControl(settings)
        self.prefix = PrefixCache(self.cache, settings.prefix_cache_bytes, settings.prefix_block_tokens)
        self.eos_ids = frozenset(tokenizer.eos_token_ids) | frozenset(model.cfg.eos_token_ids)
        self._inbox: queue.SimpleQueue[tuple[RequestHandle, Sink] | None] = queue.SimpleQueue()
        self._waiting: deque[_Row] = deque()
        self._running: list[_Row] = []
        self._counted: set[RequestHandle] = set()  # submitted, neither finished nor cancelled (guarded by _lock)
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._steps = 0
        self._state = EngineState(0, 0, settings.max_batch_size, 0, ())

    # --- the submitter's side (any thread) ------------------------------------------------------------------
    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name="loraplex-engine", daemon=True)
            self._thread.start()

    def stop(self, timeout: float | None = 5.0) -> None:
        self._stop.set()
        self._inbox.put(None)
        if self._thread is not None:
            self._thread.join(timeout)
            self._thread = None

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def state(self) -> EngineState:
        return self._state

    @property
    def in_flight(self) -> int:
        """Requests submitted and neither finished nor cancelled (queued, waiting or running); exact, unlike
        ``state()``. This is what the queue limit counts: a cancelled request stops counting at ``cancel``, while
        its KV slot is freed at the next step."""
        return len(self._counted)

    def validate(self, request: GenerationRequest) -> None:
        """Raise ``InvalidRequest`` for anything the engine cannot run; called by ``submit`` and the edge."""
        s = self.settings
        n = len(request.prompt_ids)
        if n == 0:
            raise InvalidRequest("the prompt is empty: give at least one token of text")
        if n > s.max_prompt_tokens:
            raise InvalidRequest(f"the prompt has {n} tokens; this server accepts at most {s.max_prompt_tokens}")
        check_max_new_tokens(request.max_new_tokens, s.max_new_tokens)
        if n >= s.max_total_tokens:
            raise InvalidRequest(
                f"the prompt has {n} tokens; prompt + generated tokens must stay under {s.max_total_tokens}"
            )
        vocab = self.model.cfg.vocab_size
        bad = [t for t in request.prompt_ids if not 0 <= t < vocab]
        if bad:
            raise InvalidRequest(f"token ids {bad[:5]} are outside the vocabulary [0, {vocab})")
        if request.adapter_id is not None:
            if self.adapters is None:
                raise AdapterNotFound(request.adapter_id)
            kind = self.adapters.kind(request.adapter_id)  # AdapterNotFound
            if request.speculate and kind == "lora":
                raise InvalidRequest(f"speculate=true, but adapter {request.adapter_id!r} has no Medusa heads")
        elif request.speculate:
            raise InvalidRequest("speculate=true needs an adapter with Medusa heads (adapter_id is empty)")

    def submit(self, request: GenerationRequest, sink: Sink) -> RequestHandle:
        """Queue ``request``; its events go to ``sink`` on the engine thread. Raises typed errors."""
        if self._stop.is_set() or not self.alive:
            raise Unavailable("the engine is not running")
        self.validate(request)
        handle = RequestHandle(request, on_cancel=self._release)
        with self._lock:
            if len(self._counted) >= self.settings.max_queue + self.settings.max_batch_size:
                raise QueueFull(
                    f"{len(self._counted)} requests are queued or running (limit {self.settings.max_queue} waiting); "
                    "retry later or spread load over more replicas"
                )
            self._counted.add(handle)
        if request.adapter_id is not None and self.adapters is not None:
            self.adapters.prefetch(request.adapter_id)  # a cold adapter's read overlaps the step in flight
        self._inbox.put((handle, sink))
        return handle

    def _release(self, handle: RequestHandle) -> None:
        """The request no longer counts against the queue limit (finished, or cancelled: any thread)."""
        with self._lock:
            self._counted.discard(handle)

    def generate(self, request: GenerationRequest, timeout: float | None = None) -> list[TokenEvent]:
        """Blocking convenience for tests and in-process benchmarks: all events of one request."""
        events: queue.SimpleQueue[TokenEvent] = queue.SimpleQueue()
        self.submit(request, events.put)
        out: list[TokenEvent] = []
        while True:
            event = events.get(timeout=timeout)
            out.append(event)
            if event.finish is not None:
                return out

    # --- the engine thread ------------------------------------------------------------------------------------
    def _loop(self) -> None:
        self.threads.start()
        with torch.inference_mode():
            while not self._stop.is_set():
                # Block for new work when nothing runs; poll briefly while rows only wait for adapter loads.
                wait = None if self._running else (0.002 if self._waiting else 0.5)
                if wait == 0.5:
                    self.threads.idle()  # what other processes do while nothing runs: the last half second only
                if not self._take_inbox(wait):
                    break
                try:
                    self._step()
                except Exception as exc:  # a bug or a device fault in a step: fail its rows, keep serving
                    self._recover(exc)
                self._publish_state()
        for row in [*self._running, *self._waiting]:
            self._finish(row, FinishReason.ERROR, error=Unavailable("the server is shutting down"))

    def _recover(self, exc: Exception) -> None:
        """After an exception escaped ``_step``: fail the rows of that step and reset what it may have half-written.

        Only the running rows took part in the step; waiting rows stay queued. The failed rows' slots are zeroed up
        to the last position the step could have written (prompt, length + drafts), so nothing half-computed, NaN
        included, stays behind in a slot. The prefix cache and the LoRA tables outlive rows and cannot tell which of
        their writes the step finished: both are dropped (they are caches and refill from the next requests).
        """
        rows = list(self._running)
        shown = ",".join(r.request.request_id for r in rows[:16]) + (",..." if len(rows) > 16 else "")
        log.error(
            "event=engine_step_failed rows=%d request_ids=%s error=%s", len(rows), shown, type(exc).__name__,
            exc_info=exc,
        )  # fmt: skip
        metrics.ENGINE_STEP_FAILURES.inc()
        error = EngineStepFailed(
            f"the engine step running this request failed ({type(exc).__name__}); it is safe to retry"
        )
        written = max((max(len(r.request.prompt_ids), r.length) + len(r.drafts) + 1 for r in rows), default=0)
        for row in rows:
            self._finish(row, FinishReason.ERROR, error=error)
        self._running.clear()
        self.cache.data[:, :, : len(rows), :, : min(written, self.cache.max_len)].zero_()  # [L, 2, n, n_kv, T, D]
        self.prefix.clear()
        metrics.PREFIX_CACHE_BLOCKS.set(0)
        if self.tables is not None:
            self.tables.clear()

    def _take_inbox(self, wait: float | None) -> bool:
        """Move submissions into the waiting queue, waiting up to ``wait`` seconds for the first (None: don't
        wait). False when asked to stop."""
        try:
            item = self._inbox.get(timeout=wait) if wait is not None else self._inbox.get_nowait()
        except queue.Empty:
            return True
        while True:
            if item is None:
                return not self._stop.is_set()
            self._waiting.append(self._new_row(*item))
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                return True

    def _new_row(self, handle: RequestHandle, sink: Sink) -> _Row:
        req = handle.request
        generator = None if req.sampling.greedy else make_generator(req.sampling.seed, self.device)
        return _Row(
            handle=handle,
            sink=sink,
            detok=IncrementalDetokenizer(self.tokenizer, req.prompt_ids),
            stops=StopMatcher(req.stop_sequences) if req.stop_sequences else None,
            generator=generator,
            ids=list(req.prompt_ids),
            enqueued=req.arrival,
        )

    def _step(self) -> None:
        now = time.monotonic()
        for row in [*self._waiting, *self._running]:
            if row.handle.cancelled:
                self._finish(row, FinishReason.CANCELLED)
            elif row.request.deadline is not None and now > row.request.deadline:
                self._finish(row, FinishReason.DEADLINE)
        if any(r.done for r in self._waiting):
            self._waiting = deque(r for r in self._waiting if not r.done)
        self._compact()
        newcomers = self._admit()
        if newcomers:
            self._prefill(newcomers)
            self._compact()
        if self._running:
            self._decode()
        self._compact()

    def _admit(self) -> list[_Row]:
        """Move waiting rows into free slots, in arrival order, skipping rows whose adapter is still loading
        (the store reads it on its own thread, so they never hold up rows behind them)."""
        admitted: list[_Row] = []
        longest = 0
        kept: deque[_Row] = deque()
        while self._waiting:
            row = self._waiting.popleft()
            n = len(row.request.prompt_ids)
            full = len(self._running) >= self.settings.max_batch_size
            over_budget = bool(admitted) and max(longest, n) * (len(admitted) + 1) > PREFILL_TOKEN_BUDGET
            if full or over_budget or not self._adapter_ready(row):
                if not row.done:
                    kept.append(row)
                continue
            longest = max(longest, n)
            admitted.append(row)
            self._running.append(row)
        self._waiting = kept
        return admitted

    def _adapter_ready(self, row: _Row) -> bool:
        """True when the row needs no adapter or every part of it is loaded: the LoRA part resident on the device
        (then pinned for the row's lifetime) and the Medusa heads loaded. Loads run on the adapters' own threads."""
        adapter = row.request.adapter_id
        if adapter is None:
            return True
        if self.adapters is None:
            self._finish(row, FinishReason.ERROR, error=AdapterNotFound(adapter))
            return False
        store, medusa = self.adapters.store, self.adapters.medusa
        try:
            kind = self.adapters.kind(adapter)
            row.lora = kind != "medusa"
            if row.lora and not row.pinned:  # a load completing takes the row's pin for it (no eviction before)
                row.pinned = store.request(adapter, pin=True, waiter=row.handle)
            heads_ready = kind == "lora" or medusa.request(adapter)
            error = (store.failure(adapter) if row.lora else None) or (
                None if kind == "lora" else medusa.failure(adapter)
            )
        except LoraplexError as exc:  # unregistered meanwhile, store closed
            heads_ready, error = False, exc
        if error is not None:
            self._finish(row, FinishReason.ERROR, error=error)
            return False
        if not (heads_ready and (row.pinned or not row.lora)):
            return False
        if row.lora:  # a re-registered id gets a new key: its deltas, and so its K/V, may differ
            row.kv_key = (adapter, store.get(adapter).registered_at)
        sampling = row.request.sampling
        # Speculation serves greedy rows (output identical to plain greedy); sampled, penalized or logprob rows
        # decode one token per step, so their distribution and logprobs are exactly the plain ones.
        plain_greedy = sampling.greedy and not sampling.penalized and not sampling.logprobs
        if kind != "lora" and row.request.speculate is not False and plain_greedy:
            row.heads = medusa.heads(adapter)
        return True

    def _adapter_batch(self, rows: Sequence[_Row], slot_start: int) -> AdapterBatch | None:
        if self.adapters is None or self.tables is None:
            return None
        return AdapterBatch.build(
            [r.request.adapter_id if r.lora else None for r in rows],
            self.adapters.store.layer,
            self.tables,
            slot_start=slot_start,
        )

    def _speculating(self) -> bool:
        """Draft for the next step? Not above ``speculate_max_batch``; below it, as the governor measures."""
        batch = len(self._running)
        if batch > self.settings.speculate_max_batch:
            return False
        return not self.settings.speculate_adaptive or self.governor.choose(batch)

    def _tree(self, num_heads: int) -> DraftTree:
        tree = self._trees.get(num_heads)
        if tree is None:
            tree = self._trees[num_heads] = DraftTree.parse(self.settings.speculate_tree, num_heads)
        return tree

    def _draft(self, rows: Sequence[_Row], hidden: torch.Tensor) -> None:
        """Set the drafts of rows with heads from their last hidden state ``hidden`` [len(rows), H]: the candidate
        token of every node of the draft tree (``--speculate-tree``) down to the depth the row verifies."""
        if not any(row.heads is not None for row in rows):
            return  # the common decode step: no row drafts, nothing to reset (rows without heads never hold drafts)
        groups: dict[int, list[int]] = {}
        speculating = self._speculating()
        for b, row in enumerate(rows):
            row.drafts = []
            if row.heads is not None and not row.done and speculating:
                groups.setdefault(id(row.heads), []).append(b)
        threshold = self.settings.draft_threshold
        for members in groups.values():
            heads = rows[members[0]].heads
            assert heads is not None  # groups hold rows with heads only
            tree = self._tree(heads.num_heads)
            index = torch.tensor(members, device=hidden.device)
            x, k = hidden.index_select(0, index), tree.max_rank + 1
            depths = None
            if threshold > 0:  # verify depth d only while P(the top-1 drafts 1..d are all right) >= threshold
                ids, probs = heads.candidates(x, self.model.draft_head(), k)
                depths = (probs.cumprod(dim=1) >= threshold).sum(dim=1).tolist()
            else:
                ids = heads.topk(x, self.model.draft_head(), k)  # [g, n_heads, k]
            for i, (b, topk) in enumerate(zip(members, ids.tolist(), strict=True)):
                nodes = tree.nodes_within(depths[i]) if depths is not None else tree.size
                rows[b].drafts = tree.tokens(topk)[: nodes - 1]

    def _prefill(self, rows: Sequence[_Row]) -> None:
        """Prefill the newcomers (slots ``start ..``): K/V of cached prompt blocks are copied in, the rest computed.

        Row b feeds its prompt from ``cached_b`` on, at positions ``cached_b ..``, right-padded to the longest
        remainder; padding lands beyond the row's length (clamped into the cache), where it is never read."""
        start = len(self._running) - len(rows)
        prompts = [r.request.prompt_ids for r in rows]
        self._prefill_shared_prefixes(rows, start)
        cached = [
            self.prefix.restore(self.prefix.lookup(p, r.kv_key, limit=len(p) - 1), start + b)
            for b, (r, p) in enumerate(zip(rows, prompts, strict=True))
        ]
        width = max(len(p) - c for p, c in zip(prompts, cached, strict=True))
        tokens = torch.zeros((len(rows), width), dtype=torch.long)  # [B, T], right-padded
        for b, (p, c) in enumerate(zip(prompts, cached, strict=True)):
            tokens[b, : len(p) - c] = torch.tensor(p[c:], dtype=torch.long)
        starts = torch.tensor(cached, dtype=torch.long)[:, None]  # [B, 1]
        positions = (starts + torch.arange(width, dtype=torch.long)).clamp_(max=self.cache.max_len - 1)  # [B, T]
        now = time.monotonic()
        for r in rows:
            metrics.QUEUE_TIME.observe(now - r.enqueued)
        metrics.PROMPT_TOKENS.inc(sum(len(p) for p in prompts))
        metrics.PREFIX_CACHE_HIT_TOKENS.inc(sum(cached))
        batch = self._adapter_batch(rows, start)
        kv_len = int(positions.max()) + 1
        hidden = self.model(
            tokens.to(self.device), positions.to(self.device), self.cache, start, batch, kv_len=kv_len
        )  # [B, T, H]
        last = torch.tensor([len(p) - c - 1 for p, c in zip(prompts, cached, strict=True)], device=self.device)
        final = hidden[torch.arange(len(rows), device=self.device), last]  # [B, H]
        logits = self.model.logits(final)  # [B, V]
        for b, (r, p) in enumerate(zip(rows, prompts, strict=True)):
            r.length = len(p)
            self.prefix.insert(p, r.kv_key, start + b, len(p))
        metrics.PREFIX_CACHE_BLOCKS.set(self.prefix.blocks_used)
        self._sample_and_emit(rows, logits)
        self._draft(rows, final)

    def _prefill_shared_prefixes(self, rows: Sequence[_Row], start: int) -> None:
        """Newcomers that start with the same uncached blocks (a burst of requests with one system prompt) would
        each compute them: prefill those blocks once, for one of the rows, and cache them for the others."""
        if len(rows) < 2 or not self.prefix.enabled:
            return
        chains = [self.prefix.hashes(r.request.prompt_ids, r.kv_key, limit=len(r.request.prompt_ids) - 1) for r in rows]
        counts: dict[int, int] = {}
        for chain in chains:
            for h in chain:
                counts[h] = counts.get(h, 0) + 1
        done: set[int] = set()
        for b, (row, chain) in enumerate(zip(rows, chains, strict=True)):
            depth = 0
            while depth < len(chain) and counts[chain[depth]] > 1:
                depth += 1
            if depth == 0 or chain[depth - 1] in done:
                continue
            done.add(chain[depth - 1])
            prompt = row.request.prompt_ids
            have = self.prefix.restore(
                self.prefix.lookup(prompt, row.kv_key, limit=depth * self.prefix.block), start + b
            )
            n = depth * self.prefix.block
            if have >= n:
                continue
            tokens = torch.tensor([prompt[have:n]], dtype=torch.long, device=self.device)  # [1, T]
            positions = torch.arange(have, n, dtype=torch.long, device=self.device)[None, :]  # [1, T]
            self.model(tokens, positions, self.cache, start + b, self._adapter_batch([row], start + b), kv_len=n)
            self.prefix.insert(prompt, row.kv_key, start + b, n)

    def _decode(self) -> None:
        rows = self._running
        speculative = any(r.drafts for r in rows)
        n, key = len(rows), step_key(len(rows), speculative)
        spec_governed = self.settings.speculate_adaptive and any(r.heads is not None for r in rows)
        threads = self.threads.before_step(key)
        start, before = time.perf_counter(), sum(r.generated for r in rows) if spec_governed else 0
        (self._decode_speculative if speculative else self._decode_plain)(rows)
        seconds = time.perf_counter() - start
        self.threads.after_step(key, threads, seconds, n)
        if spec_governed:  # what the speculation governor learns from: output tokens / s of each kind of step
            self.governor.record(n, speculative, seconds, sum(r.generated for r in rows) - before)

    def _decode_plain(self, rows: list[_Row]) -> None:
        tokens = torch.tensor([[r.pending] for r in rows], dtype=torch.long)  # [B, 1]
        positions = torch.tensor([[r.length] for r in rows], dtype=torch.long)  # [B, 1]
        metrics.BATCH_SIZE.observe(len(rows))
        batch = self._adapter_batch(rows, 0)
        hidden = self.model(tokens.to(self.device), positions.to(self.device), self.cache, 0, batch)  # [B, 1, H]
        logits = self.model.logits(hidden[:, -1])  # [B, V]
        for r in rows:
            r.length += 1
        self._sample_and_emit(rows, logits)
        self._draft(rows, hidden[:, -1])

    def _decode_speculative(self, rows: list[_Row]) -> None:
        """Verify every row's pending token plus its draft tree in one forward pass; keep the longest accepted path.

        Row b feeds its pending token (the root, cache position ``L_b``) and its first ``v_b - 1`` tree nodes
        (node i at cache position ``L_b + i``, RoPE position ``L_b + depth(i)``, attending to its ancestors only),
        padded to the batch's widest with its pending token (K/V beyond its length, never read back). Greedy rows
        walk the tree along the model's argmax and emit the path's tokens plus the argmax at its end: exactly
        plain greedy decoding; the path's K/V then move to ``L_b + 1 ..``. Rows without drafts (sampled, or without
        heads) read node 0 like a plain decode step.
        """
        limit = self.settings.max_total_tokens
        tree = self._tree(max(r.heads.num_heads for r in rows if r.heads is not None))
        depths = tree.depths
        valid = []
        for r in rows:  # nodes a row verifies: within its remaining tokens (a path of depth d emits d + 1)
            room = min(r.request.max_new_tokens - r.generated - 1, limit - r.length - 2)
            valid.append(min(1 + len(r.drafts), tree.nodes_within(max(0, room))))
        width = min(max(valid), min(limit - r.length for r in rows))  # every row's nodes stay inside the cache
        valid = [min(v, width) for v in valid]
        fed = [[r.pending, *r.drafts[: valid[b] - 1]] + [r.pending] * (width - valid[b]) for b, r in enumerate(rows)]
        tokens = torch.tensor(fed, dtype=torch.long, device=self.device)  # [B, T]
        starts = torch.tensor([r.length for r in rows], device=self.device)  # [B]
        positions = starts[:, None] + torch.tensor(depths[:width], device=self.device)[None, :]  # [B, T]
        metrics.BATCH_SIZE.observe(len(rows))
        batch = self._adapter_batch(rows, 0)
        kv_len = max(r.length for r in rows) + width
        hidden = self.model(tokens, positions, self.cache, 0, batch, kv_len=kv_len, tree=tree.visible[:width, :width])
        logits = self.model.logits(hidden)  # [B, T, V]
        plain = [b for b, r in enumerate(rows) if r.heads is None]
        if plain:  # sampled rows (and rows without heads): one token from node 0, as a plain step
            sub = [rows[b] for b in plain]
            for r in sub:
                r.length += 1
            self._sample_and_emit(sub, logits[torch.tensor(plain, device=self.device), 0])
        self._fail_non_finite_paths(rows, logits, valid)
        predicted = logits.argmax(dim=-1).tolist()  # [B, T]
        last = [0] * len(rows)  # the node whose hidden state drafts next
        drafted = kept = 0
        for b, row in enumerate(rows):
            if row.heads is None or row.done:
                continue
            path = tree.accept(fed[b], predicted[b], valid[b])
            a = len(path)
            if path != list(range(1, a + 1)):  # K/V of the kept nodes to positions L+1 .. L+a
                src = torch.tensor([row.length + i for i in path], device=self.device)
                dst = torch.arange(row.length + 1, row.length + 1 + a, device=self.device)
                self.cache.data[:, :, b, :, dst] = self.cache.data[:, :, b, :, src]
            drafted += valid[b] - 1
            kept += a
            last[b] = path[-1] if path else 0
            row.length += 1 + a
            row.accepted += a
            for token in [*(fed[b][i] for i in path), predicted[b][last[b]]]:
                if row.done:
                    break
                self._emit(row, int(token), None)
        metrics.SPECULATIVE_DRAFTED.inc(drafted)
        metrics.SPECULATIVE_ACCEPTED.inc(kept)
        metrics.SPECULATIVE_STEPS.inc(sum(1 for r in rows if r.heads is not None))
        at = torch.tensor(last, device=self.device)
        self._draft(rows, hidden[torch.arange(len(rows), device=self.device), at])  # state after the last kept token

    def _sample_and_emit(self, rows: Sequence[_Row], logits: torch.Tensor) -> None:
        finite = torch.isfinite(logits.amax(dim=-1))  # [B]: the max is NaN if any logit is, inf if any is +inf
        if not bool(finite.all()):  # fail those rows alone; the sampler never sees their NaN or inf
            keep = [b for b, ok in enumerate(finite.tolist()) if ok or not self._fail_non_finite(rows[b])]
            rows = [rows[b] for b in keep]
            logits = logits[torch.tensor(keep, dtype=torch.long, device=logits.device)]
            if not rows:
                return
        params = [r.request.sampling for r in rows]
        needs_history = any(p.repetition_penalty != 1.0 for p in params)
        result = self.sampler.sample(
            logits, params, [r.generator for r in rows], [r.ids for r in rows] if needs_history else None
        )
        tokens = result.tokens.tolist()
        logprobs = result.logprobs.tolist() if result.logprobs is not None else None
        for i, r in enumerate(rows):
            self._emit(r, int(tokens[i]), None if logprobs is None else float(logprobs[i]))

    def _fail_non_finite_paths(self, rows: Sequence[_Row], logits: torch.Tensor, valid: Sequence[int]) -> None:
        """Fail the drafting rows whose verified nodes' logits [B, T, V] hold NaN or inf (plain rows of the step
        are checked where they are sampled)."""
        finite = torch.isfinite(logits.amax(dim=-1)).tolist()  # [B, T]: NaN or +inf anywhere makes the max so
        for b, row in enumerate(rows):
            if row.heads is not None and not row.done and not all(finite[b][: valid[b]]):
                self._fail_non_finite(row)

    def _fail_non_finite(self, row: _Row) -> bool:
        """End a row whose logits hold NaN or inf with an error naming its adapter (its K/V never poison its slot:
        the model stores only finite values). True: the row is failed."""
        adapter = row.request.adapter_id
        what = f"adapter {adapter!r}" if adapter is not None else "the base model"
        log.warning(
            "event=non_finite_logits request=%s adapter=%s generated=%d", row.request.request_id, adapter, row.generated
        )
        error = FailedPrecondition(
            f"the output of {what} became non-finite (NaN or inf logits) after {row.generated} generated tokens; "
            "the request was stopped. Other requests are not affected; check the adapter's weights"
        )
        self._finish(row, FinishReason.ERROR, error=error)
        return True

    def _emit(self, row: _Row, token: int, logprob: float | None) -> None:
        now = time.monotonic()
        req = row.request
        if row.generated == 0:
            metrics.TIME_TO_FIRST_TOKEN.observe(now - req.arrival)
            metrics.ADAPTERS.first_token(req.adapter_id, now - req.arrival)
        else:
            metrics.INTER_TOKEN_LATENCY.observe(now - row.last_token_at)
        row.last_token_at = now
        row.generated += 1
        row.ids.append(token)
        row.pending = token
        metrics.GENERATED_TOKENS.inc()
        finish: FinishReason | None = None
        if token in self.eos_ids and not req.ignore_eos:
            finish = FinishReason.EOS
            text = row.detok.flush()
        else:
            text = row.detok.push(token)
        if row.stops is not None:
            text, stopped = row.stops.push(text)
            if stopped:
                finish = FinishReason.STOP_SEQUENCE
        if finish is None and (row.generated >= req.max_new_tokens or row.length + 1 >= self.settings.max_total_tokens):
            finish = FinishReason.LENGTH
        if finish is not None and finish is not FinishReason.STOP_SEQUENCE:
            if finish is not FinishReason.EOS:
                text += row.detok.flush()
            if row.stops is not None:
                tail, stopped = row.stops.push(text)
                text = tail + ("" if stopped else row.stops.flush())
        want_logprobs = req.sampling.logprobs and logprob is not None
        event = TokenEvent(
            token_ids=(token,),
            text=text,
            logprobs=(logprob,) if want_logprobs and logprob is not None else None,
            finish=finish,
            prompt_tokens=len(req.prompt_ids),
            generated_tokens=row.generated,
            accepted_draft_tokens=row.accepted,
            stop_sequence=(row.stops.matched or "") if row.stops is not None else "",
        )
        if finish is not None:
            self._close(row, finish)
        self._deliver(row, event)

    def _finish(self, row: _Row, reason: FinishReason, *, error: BaseException | None = None) -> None:
        """End ``row`` without a new token (cancel, deadline, error, shutdown)."""
        if row.done:
            return
        self._close(row, reason)
        text = ""
        if reason not in (FinishReason.CANCELLED, FinishReason.DEADLINE, FinishReason.ERROR):
            text = row.detok.flush()
        event = TokenEvent(
            token_ids=(),
            text=text,
            finish=reason,
            prompt_tokens=len(row.request.prompt_ids),
            generated_tokens=row.generated,
            error=error,
        )
        self._deliver(row, event)

    def _close(self, row: _Row, reason: FinishReason) -> None:
        row.done = True
        if row.pinned and self.adapters is not None and row.request.adapter_id is not None:
            row.pinned = False
            try:
                self.adapters.store.unpin(row.request.adapter_id)
            except LoraplexError:
                log.exception("unpin of adapter %s failed", row.request.adapter_id)
        elif row.lora and self.adapters is not None and row.request.adapter_id is not None:
            self.adapters.store.forget(row.request.adapter_id, row.handle)  # it waited: drop its claim on the load
        self._release(row.handle)
        metrics.ADAPTERS.generated(row.request.adapter_id, row.generated)
        if reason in (FinishReason.LENGTH, FinishReason.EOS, FinishReason.STOP_SEQUENCE):
            metrics.REQUEST_LATENCY.observe(time.monotonic() - row.request.arrival)

    def _deliver(self, row: _Row, event: TokenEvent) -> None:
        try:
            row.sink(event)
        except Exception:  # a consumer that went away must not take the engine down
            log.exception("sink of request %s failed; cancelling it", row.request.request_id)
            row.handle.cancel()

    def _compact(self) -> None:
        """Drop finished rows, moving the last live row's cache into each hole (row i stays in slot i)."""
        rows = self._running
        i = 0
        while i < len(rows):
            if not rows[i].done:
                i += 1
                continue
            while len(rows) - 1 > i and rows[-1].done:
                rows.pop()
            last = len(rows) - 1
            if last != i:
                self.cache.move(last, i, rows[last].length)
                rows[i] = rows[last]
            rows.pop()

    def _publish_state(self) -> None:
        self._steps += 1
        self._state = EngineState(
            running=len(self._running),
            waiting=len(self._waiting),
            slots=self.settings.max_batch_size,
            steps=self._steps,
            running_ids=tuple(r.request.request_id for r in self._running),
        )
        metrics.RUNNING_REQUESTS.set(len(self._running))
        metrics.WAITING_REQUESTS.set(len(self._waiting))
        metrics.KV_CACHE_USAGE.set(len(self._running) / self.settings.max_batch_size)
