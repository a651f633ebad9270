"""The output processor: sampled tokens become events (detokenized deltas, stops, EOS, finish), once per row.

It owns everything that happens after a token is chosen: the incremental detokenizer and stop matcher of each
row, the finish rules (EOS, stop sequence, ``max_new_tokens``, the cache's end), releasing a finished row's
adapter and queue place, delivering to the row's sink, and the step's statistics, gathered while the step runs
and published once at its end (``publish``). It never touches tensors. Sinks run on the engine thread; a sink
that raises cancels its request and never takes the engine down. Its log lines name their request
(``request_id``: the call's id, ``service.logs.about``): this thread runs outside every request's context.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from service import metrics
from service.engine.request import FinishReason, RequestHandle, TokenEvent
from service.engine.row import Row
from service.errors import FailedPrecondition, LoraplexError
from service.logs import about

log = logging.getLogger("loraplex.engine")

_COMPLETED = (FinishReason.LENGTH, FinishReason.EOS, FinishReason.STOP_SEQUENCE, FinishReason.DEAD_END)
_SILENT = (FinishReason.CANCELLED, FinishReason.DEADLINE, FinishReason.ERROR)


@dataclass
class StepStats:
    """What one step adds to the metrics; ``OutputProcessor.publish`` writes it once per step."""

    generated: int = 0
    first_tokens: list[tuple[str | None, float]] = field(default_factory=list)  # (adapter, seconds since arrival)
    inter_token: list[float] = field(default_factory=list)
    finished: list[tuple[str | None, int, float | None]] = field(default_factory=list)  # adapter, tokens, latency


class OutputProcessor:
    def __init__(
        self, eos_ids: frozenset[int], max_total_tokens: int, release: Callable[[RequestHandle], None]
    ) -> None:
        self.eos_ids = eos_ids
        self.max_total_tokens = max_total_tokens
        self._release = release  # the request stops counting against the queue limit
        self.stats = StepStats()

    def emit_all(self, rows: Sequence[Row], tokens: Sequence[int], logprobs: Sequence[float] | None) -> None:
        """One token per row (a plain step)."""
        if logprobs is None:
            for r, t in zip(rows, tokens, strict=True):
                self.emit(r, t, None)
        else:
            for r, t, lp in zip(rows, tokens, logprobs, strict=True):
                self.emit(r, t, lp)

    def emit_path(self, row: Row, tokens: Sequence[int]) -> None:
        """A verified draft path plus the token after it, stopping where the row finishes."""
        for token in tokens:
            if row.done:
                break
            self.emit(row, token, None)

    def emit(self, row: Row, token: int, logprob: float | None) -> None:
        # A constrained row's grammar consumes the token first: a token it refuses is never emitted (the mask
        # allowed it, so only a backend limit hit mid-way refuses it) and the row ends at a dead end instead.
        complete = False  # then: the grammar is complete, nothing but end-of-sequence may follow
        if row.matcher is not None:
            if not row.matcher.consume(token):
                self.dead_end(row)
                return
            complete = row.matcher.finished
        now = time.monotonic()
        req = row.request
        if row.generated == 0:
            self.stats.first_tokens.append((req.adapter_id, now - req.arrival))
        else:
            self.stats.inter_token.append(now - row.last_token_at)
        row.last_token_at = now
        row.generated += 1
        row.ids.append(token)
        row.pending = token
        self.stats.generated += 1
        finish: FinishReason | None = None
        eos = token in self.eos_ids and (not req.ignore_eos or complete)
        if eos:
            finish = FinishReason.EOS
            text = row.detok.flush()
        else:
            text = row.detok.push(token)
            if complete:
                finish = FinishReason.EOS
        if row.stops is not None:
            text, stopped = row.stops.push(text)
            if stopped:
                finish = FinishReason.STOP_SEQUENCE
        if finish is None and (row.generated >= req.max_new_tokens or row.length + 1 >= self.max_total_tokens):
            finish = FinishReason.LENGTH
        if finish is not None and finish is not FinishReason.STOP_SEQUENCE:
            text = self._final_text(row, text, flush=not eos)
        event = TokenEvent(
            token_ids=(token,),
            text=text,
            logprobs=(logprob,) if req.sampling.logprobs and logprob is not None else None,
            finish=finish,
            prompt_tokens=len(req.prompt_ids),
            generated_tokens=row.generated,
            accepted_draft_tokens=row.accepted,
            stop_sequence=(row.stops.matched or "") if row.stops is not None else "",
        )
        if finish is not None:
            self._close(row, finish)
        self._deliver(row, event)

    @staticmethod
    def _final_text(row: Row, text: str, *, flush: bool) -> str:
        """The last delta of a row ending by EOS or length: what the detokenizer and the stop matcher held back."""
        if flush:
            text += row.detok.flush()
        if row.stops is not None:
            tail, stopped = row.stops.push(text)
            text = tail + ("" if stopped else row.stops.flush())
        return text

    def finish(self, row: Row, reason: FinishReason, *, error: BaseException | None = None) -> None:
        """End ``row`` without a new token (cancel, deadline, error, shutdown)."""
        if row.closed:
            return
        self._close(row, reason)
        req = row.request
        log.log(
            logging.INFO if error is not None else logging.DEBUG,
            "event=request_ended reason=%s request=%s adapter=%s generated=%d error=%s",
            reason.value, req.request_id, req.adapter_id, row.generated, type(error).__name__ if error else None,
            extra=about(req.log_id),
        )  # fmt: skip
        text = row.detok.flush() if reason not in _SILENT else ""
        event = TokenEvent(
            token_ids=(),
            text=text,
            finish=reason,
            prompt_tokens=len(row.request.prompt_ids),
            generated_tokens=row.generated,
            error=error,
        )
        self._deliver(row, event)

    def dead_end(self, row: Row) -> None:
        """End a row whose constraint allows no next token (its grammar can neither go on nor end: a backend
        limit hit mid-way): its output so far is a prefix the grammar accepts."""
        reason = row.matcher.error if row.matcher is not None else ""
        log.warning(
            "event=constraint_dead_end request=%s adapter=%s generated=%d reason=%r",
            row.request.request_id, row.request.adapter_id, row.generated, reason[:200],
            extra=about(row.request.log_id),
        )  # fmt: skip
        metrics.CONSTRAINT_DEAD_ENDS.inc()
        self.finish(row, FinishReason.DEAD_END)

    def fail_non_finite(self, row: Row) -> None:
        """End a row whose logits hold NaN or inf with an error naming its adapter (its K/V never poison its slot:
        the model stores only finite values)."""
        adapter = row.request.adapter_id
        what = f"adapter {adapter!r}" if adapter is not None else "the base model"
        log.warning(
            "event=non_finite_logits request=%s adapter=%s generated=%d",
            row.request.request_id, adapter, row.generated, extra=about(row.request.log_id),
        )  # fmt: skip
        error = FailedPrecondition(
            f"the output of {what} became non-finite (NaN or inf logits) after {row.generated} generated tokens; "
            "the request was stopped. Other requests are not affected; check the adapter's weights"
        )
        self.finish(row, FinishReason.ERROR, error=error)

    def _close(self, row: Row, reason: FinishReason) -> None:
        row.done = row.closed = True
        if row.adapter is not None:
            try:
                row.adapter.release()
            except LoraplexError:
                log.exception(
                    "event=adapter_release_failed adapter=%s", row.adapter.id, extra=about(row.request.log_id)
                )
        self._release(row.handle)
        latency = time.monotonic() - row.request.arrival if reason in _COMPLETED else None
        self.stats.finished.append((row.request.adapter_id, row.generated, latency))

    def _deliver(self, row: Row, event: TokenEvent) -> None:
        try:
            row.sink(event)
        except Exception:  # a consumer that went away must not take the engine down
            log.exception(
                "event=sink_failed request=%s action=cancel", row.request.request_id, extra=about(row.request.log_id)
            )
            row.handle.cancel()

    def publish(self) -> None:
        """Write the step's statistics to the metrics, once per step."""
        s, self.stats = self.stats, StepStats()
        if s.generated:
            metrics.GENERATED_TOKENS.inc(s.generated)
        for adapter, seconds in s.first_tokens:
            metrics.TIME_TO_FIRST_TOKEN.observe(seconds)
            metrics.ADAPTERS.first_token(adapter, seconds)
        for seconds in s.inter_token:
            metrics.INTER_TOKEN_LATENCY.observe(seconds)
        for adapter, tokens, latency in s.finished:
            metrics.ADAPTERS.generated(adapter, tokens)
            if latency is not None:
                metrics.REQUEST_LATENCY.observe(latency)


__all__ = ["OutputProcessor", "StepStats"]
