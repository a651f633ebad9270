"""The engine: one thread that owns the model and the KV cache and runs continuous batching.

Each step is three calls: the scheduler plans (retire, admit, draft or not), the runner executes the plan on the
model and the KV cache (prefill the newcomers, then one decode step of every running row), the output processor
turns the sampled tokens into events and publishes the step's statistics once. Requests join and leave between
steps; a row's tokens reach its sink as soon as they are sampled. ``step()`` is public: tests drive the engine
deterministically without its thread.

The engine never awaits and the event loop never runs torch: they meet at ``submit`` (a thread-safe queue, where
the request's adapter is resolved once) and at each request's sink (called on this thread; the servicer hops to
its loop). A step that raises fails the rows it ran with an error and the engine keeps serving.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Hashable
from dataclasses import dataclass

import torch

from service import metrics
from service.adapters.catalog import AdapterCatalog
from service.adapters.handle import Adapter, involves
from service.config import Settings
from service.constraints.backend import Backend
from service.constraints.masks import Masks
from service.drafters.registry import server_drafter
from service.engine.detok import IncrementalDetokenizer
from service.engine.outputs import OutputProcessor
from service.engine.prefix import PrefixCache
from service.engine.request import (
    FinishReason,
    GenerationRequest,
    RequestHandle,
    Sink,
    TokenEvent,
    check_max_new_tokens,
)
from service.engine.row import Row
from service.engine.runner import Runner
from service.engine.sampling import make_generator
from service.engine.scheduler import Scheduler, SchedulerLimits, StepPlan
from service.engine.stops import StopMatcher
from service.engine.thread_governor import ThreadControl, step_key
from service.errors import AdapterNotFound, EngineStepFailed, InvalidRequest, QueueFull, Unavailable
from service.model.kv_cache import KVCache
from service.model.llama import Llama
from service.tokenizer import Tokenizer
from service.torch_threads import name_os_thread

log = logging.getLogger("loraplex.engine")

__all__ = ["Engine", "EngineState"]


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
        self,
        model: Llama,
        tokenizer: Tokenizer,
        settings: Settings,
        *,
        adapters: AdapterCatalog | None = None,
        constraints: Backend | None = None,
    ) -> None:
        self.model = model
        self.tokenizer = tokenizer
        self.settings = settings
        param = next(model.parameters())
        self.device = param.device
        self.cache = KVCache(
            model.cfg, settings.max_batch_size, settings.max_total_tokens, dtype=param.dtype, device=self.device
        )
        self.adapters = adapters
        eos = frozenset(tokenizer.eos_token_ids) | frozenset(model.cfg.eos_token_ids)
        self.outputs = OutputProcessor(eos, settings.max_total_tokens, self._release)
        lookup = adapters.layer if adapters is not None else None
        masks = None
        if constraints is not None:
            masks = Masks(constraints, model.cfg.vocab_size, settings.max_batch_size, self.device)
        self.runner = Runner(model, self.cache, settings, self.outputs, lookup, masks)
        limits = SchedulerLimits(
            settings.max_batch_size,
            settings.speculate_max_batch,
            settings.speculate_adaptive,
            prefill_chunk_tokens=settings.prefill_chunk_tokens,
        )
        drafter = server_drafter(settings)
        self.scheduler = Scheduler(limits, self.cache.move, cached=self.runner.cached, drafter=drafter)
        self.threads = ThreadControl(settings)
        self._inbox: queue.SimpleQueue[tuple[RequestHandle, Sink, Adapter | None] | None] = queue.SimpleQueue()
        self._counted: set[RequestHandle] = set()  # submitted, neither finished nor cancelled (guarded by _lock)
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._steps = 0
        self._state = EngineState(0, 0, settings.max_batch_size, 0, ())
        # K/V keys of adapter registrations removed since the last step: their prefix blocks are dropped by the
        # engine thread, which owns the cache (appended on the unregistering thread; deque appends are atomic).
        self._forgotten: deque[Hashable] = deque()
        if adapters is not None:
            adapters.on_unregister(self._forgotten.append)

    @property
    def eos_ids(self) -> frozenset[int]:
        return self.outputs.eos_ids

    @eos_ids.setter
    def eos_ids(self, ids: frozenset[int]) -> None:
        self.outputs.eos_ids = ids

    @property
    def prefix(self) -> PrefixCache:
        return self.runner.prefix

    # --- the submitter's side (any thread) ------------------------------------------------------------------
    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name="loraplex-engine", daemon=True)
            self._thread.start()

    def stop(self, timeout: float | None = 5.0) -> bool:
        """Stop taking work. The thread ends the step it is in, then fails every request left with UNAVAILABLE
        (``_shutdown``); wait up to ``timeout`` seconds for it (0: ask and return). True once the thread has ended
        (an engine never started fails its queued requests here, at once)."""
        first = not self._stop.is_set()
        self._stop.set()
        self._inbox.put(None)
        if self._thread is None:
            if first:
                self._shutdown()
            return True
        self._thread.join(timeout)
        return not self._thread.is_alive()

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

    def validate(self, request: GenerationRequest) -> Adapter | None:
        """Raise ``InvalidRequest`` for anything the engine cannot run (``AdapterNotFound`` for an unknown
        adapter); called by ``submit`` and the edge. Returns the request's resolved adapter."""
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
        if request.grammar is not None and self.runner.masks is None:
            raise InvalidRequest("this engine serves no output constraints", field="constraint")
        if request.adapter_id is None:
            if request.speculate:
                raise InvalidRequest("speculate=true needs an adapter with Medusa heads (adapter_id is empty)")
            return None
        if self.adapters is None:
            raise AdapterNotFound(request.adapter_id)
        if request.mix and request.mix[0][0] != request.adapter_id:
            raise InvalidRequest("a request's mix must start with its adapter_id", field="adapters")
        mix = request.mix or ((request.adapter_id, 1.0),)  # AdapterNotFound; a mixture's bounds (InvalidRequest)
        adapter = self.adapters.resolve_mix(mix, limit=self.settings.max_mixture_adapters)
        if request.speculate and not adapter.drafts():
            raise InvalidRequest(f"speculate=true, but {' + '.join(map(repr, adapter.components))} has no Medusa heads")
        return adapter

    def submit(self, request: GenerationRequest, sink: Sink) -> RequestHandle:
        """Queue ``request``; its events go to ``sink`` on the engine thread (or the caller of ``step``)."""
        if self._stop.is_set() or (self._thread is not None and not self._thread.is_alive()):
            raise Unavailable("the engine is not running")
        adapter = self.validate(request)
        handle = RequestHandle(request, on_cancel=self._release)
        with self._lock:
            if len(self._counted) >= self.settings.max_queue + self.settings.max_batch_size:
                raise QueueFull(
                    f"{len(self._counted)} requests are queued or running (limit {self.settings.max_queue} waiting); "
                    "retry later or spread load over more replicas"
                )
            self._counted.add(handle)
        if adapter is not None and self.adapters is not None:
            for adapter_id in adapter.components:  # a cold adapter's read overlaps the step in flight
                self.adapters.prefetch(adapter_id)
        self._inbox.put((handle, sink, adapter))
        return handle

    def _release(self, handle: RequestHandle) -> None:
        """The request no longer counts against the queue limit (finished, or cancelled: any thread)."""
        with self._lock:
            self._counted.discard(handle)

    def generate(self, request: GenerationRequest, timeout: float | None = None) -> list[TokenEvent]:
        """Blocking convenience for tests and in-process benchmarks: all events of one request (needs ``start``)."""
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
        name_os_thread()  # before its first parallel kernel: its OpenMP workers take the name too
        self.threads.start()
        with torch.inference_mode():
            while not self._stop.is_set():
                # Block for new work when nothing runs; poll briefly while rows only wait for adapter loads.
                sched = self.scheduler
                wait = None if sched.running else (0.002 if sched.waiting else 0.5)
                if wait == 0.5:
                    self.threads.idle()  # what other processes do while nothing runs: the last half second only
                if not self._take_inbox(wait):
                    break
                self._run_step()
        self._shutdown()

    def _shutdown(self) -> None:
        for row in self.scheduler.drain():
            self.outputs.finish(row, FinishReason.ERROR, error=Unavailable("the server is shutting down"))
        self.outputs.publish()
        if self.runner.masks is not None:
            self.runner.masks.close()

    def step(self) -> EngineState:
        """Take every submission queued so far and run one step; for tests that drive an engine never started."""
        if self._thread is not None:
            raise RuntimeError("step() drives an engine without its thread; this one was started")
        self._take_inbox(None)
        with torch.inference_mode():
            self._run_step()
        return self._state

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
            self.scheduler.add(self._new_row(*item))
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                return True

    def _new_row(self, handle: RequestHandle, sink: Sink, adapter: Adapter | None) -> Row:
        req = handle.request
        generator = None if req.sampling.greedy else make_generator(req.sampling.seed, self.device)
        return Row(
            handle=handle,
            sink=sink,
            detok=IncrementalDetokenizer(self.tokenizer, req.prompt_ids),
            stops=StopMatcher(req.stop_sequences) if req.stop_sequences else None,
            generator=generator,
            ids=list(req.prompt_ids),
            adapter=adapter,
            enqueued=req.arrival,
            matcher=req.grammar.start() if req.grammar is not None else None,
        )

    def _run_step(self) -> None:
        if self._forgotten:
            self._forget_unloaded()
        plan = self.scheduler.schedule(time.monotonic())
        try:
            self._execute(plan)
        except Exception as exc:  # outside the two passes (delivering retirements): fail every row in a slot
            self._recover(exc, list(self.scheduler.running), 0)
        self.scheduler.compact()
        self.outputs.publish()
        self._publish_state()

    def _forget_unloaded(self) -> None:
        """Drop the prefix blocks of adapter registrations removed since the last step (alone or in a mixture)."""
        gone = [self._forgotten.popleft() for _ in range(len(self._forgotten))]
        self.runner.prefix.forget(lambda key: any(involves(key, g) for g in gone))
        metrics.PREFIX_CACHE_BLOCKS.set(self.runner.prefix.blocks_used)

    def _execute(self, plan: StepPlan) -> None:
        """Run one plan: deliver retirements, run the prefill pass, decode every row that has its whole prompt.

        The prefill pass and the decode step fail separately: an exception in one fails only the rows it ran."""
        for row, reason in plan.retired:
            self.outputs.finish(row, reason)
        for row, error in plan.failed:
            self.outputs.finish(row, FinishReason.ERROR, error=error)
        if plan.prefill:
            start = time.perf_counter()
            try:
                self.runner.prefill(plan.prefill, plan.prefill_tokens, plan.prefill_start, plan.draft)
            except Exception as exc:  # a bug or a device fault: fail the rows of the pass, keep decoding the others
                self._recover(exc, list(plan.prefill), plan.prefill_start)
            metrics.PREFILL_PASS_SECONDS.observe(time.perf_counter() - start)
            self.scheduler.compact()
        rows = self.scheduler.running[: self.scheduler.decoding]
        if rows:
            try:
                self._decode(rows, plan.draft)
            except Exception as exc:
                self._recover(exc, rows, 0)

    def _decode(self, rows: list[Row], draft: bool) -> None:
        """One decode step, timed for the governors: threads per step kind, speculation by output tokens / s."""
        speculative = any(r.draft is not None for r in rows)
        n, key = len(rows), step_key(len(rows), speculative)
        spec_governed = self.settings.speculate_adaptive and any(r.drafter is not None for r in rows)
        threads = self.threads.before_step(key)
        start, before = time.perf_counter(), sum(r.generated for r in rows) if spec_governed else 0
        self.runner.decode(rows, draft)
        seconds = time.perf_counter() - start
        self.threads.after_step(key, threads, seconds, n)
        if self.runner.depth is not None:  # what a verification's further positions cost, per batch size
            self.runner.depth.step(n, self.runner.positions, seconds, speculative)
        if spec_governed:  # what the speculation governor learns from: output tokens / s of each kind of step
            self.scheduler.governor.record(n, speculative, seconds, sum(r.generated for r in rows) - before)

    def _recover(self, exc: Exception, rows: list[Row], first: int) -> None:
        """After an exception escaped the runner: fail the rows it ran (slots ``first ..``), reset what it may have
        half-written.

        Other rows (waiting, or in the other pass of the step) go on. The failed rows' slots are zeroed up to the
        last position the pass could have written (prompt, length + drafts), so nothing half-computed, NaN
        included, stays behind in a slot. The prefix cache and the LoRA tables outlive rows and cannot tell which of
        their writes the pass finished: the runner drops both (they are caches and refill from the next requests).
        """
        # One line for the step; each failed row's own event=request_ended line names its request.
        shown = ",".join(r.request.request_id for r in rows[:16]) + (",..." if len(rows) > 16 else "")
        log.error(
            "event=engine_step_failed rows=%d request_ids=%s error=%s", len(rows), shown, type(exc).__name__,
            exc_info=exc,
        )  # fmt: skip
        metrics.ENGINE_STEP_FAILURES.inc()
        error = EngineStepFailed(
            f"the engine step running this request failed ({type(exc).__name__}); it is safe to retry"
        )
        written = max((max(len(r.request.prompt_ids), r.length) + r.drafted + 1 for r in rows), default=0)
        for row in rows:
            self.outputs.finish(row, FinishReason.ERROR, error=error)  # the row is done: it leaves its slot
        self.cache.clear(len(rows), written, first=first)
        self.runner.reset()

    def _publish_state(self) -> None:
        self._steps += 1
        running, waiting = self.scheduler.running, self.scheduler.waiting
        self._state = EngineState(
            running=len(running),
            waiting=len(waiting),
            slots=self.settings.max_batch_size,
            steps=self._steps,
            running_ids=tuple(r.request.request_id for r in running),
        )
        metrics.RUNNING_REQUESTS.set(len(running))
        metrics.WAITING_REQUESTS.set(len(waiting))
        metrics.KV_CACHE_USAGE.set(len(running) / self.settings.max_batch_size)
        metrics.LORA_INFO.publish(
            [r.adapter.id for r in running if r.adapter is not None],
            [r.adapter.id for r in waiting if r.adapter is not None],
            self.settings.max_batch_size,
        )
