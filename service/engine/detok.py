"""Incremental detokenization: turn a request's stream of token ids into a stream of text deltas.

Decoding token by token is wrong for two reasons: one character can span several tokens (an emoji split into
byte tokens decodes to U+FFFD until its last byte arrives), and some decoders change a token's text depending
on its neighbours (SentencePiece drops the leading space of the first token it sees). The window algorithm
(TGI's prefix/read offsets: decode a few ids twice, emit the difference once it no longer ends in U+FFFD) is
``tokenizers.decoders.DecodeStream``, run in Rust (``Tokenizer.decode_stream``). This module adds what it
lacks: the prompt's last ids as left context (dropped when they end inside a character), a ``flush`` for text
still held when the request ends (``DecodeStream`` has none, so a stream ending in an unfinished character
would lose it), and a bound on holding: after ``_MAX_HELD_TOKENS`` ids without text (invalid UTF-8 from the
model, or skipped special tokens) the held ids are emitted as they decode and the stream restarts after them.

Invariants: a delta never ends inside a character unless that bound or ``flush`` forces it; concatenating every
``push`` and the final ``flush`` gives ``tokenizer.decode(generated_ids)`` (for decoders whose output is a pure
function of the ids, which covers byte-level BPE: Llama 3, SmolLM2, Qwen, GPT-2); only a bounded tail of ids is
kept, however long the generation.
"""

from __future__ import annotations

from collections.abc import Sequence

from service.tokenizer import Tokenizer

__all__ = ["IncrementalDetokenizer"]

_REPLACEMENT = "\ufffd"
# Ids decoded in front of the first generated token (the prompt's) or of a flushed tail (the last emitted ones),
# so context-dependent decoders see a real left neighbour (the same 5 TGI and vLLM use).
_CONTEXT_TOKENS = 5
# After this many held-back ids the tail is not an unfinished character but invalid UTF-8 from the model (or
# skipped special tokens): it is emitted as it decodes (U+FFFD included) rather than held for ever.
_MAX_HELD_TOKENS = 8


class IncrementalDetokenizer:
    """Per-request text stream. ``push`` each generated id, ``flush`` once at the end.

    ``prompt_ids``: the request's prompt; its last few ids give the first generated token its left context
    (their text is never emitted). ``skip_special_tokens``: as ``Tokenizer.decode``.
    """

    __slots__ = ("_chunks", "_context", "_held", "_skip", "_step", "_tok")

    def __init__(
        self, tokenizer: Tokenizer, prompt_ids: Sequence[int] | None = None, *, skip_special_tokens: bool = True
    ) -> None:
        self._tok = tokenizer
        self._skip = skip_special_tokens
        context = self._left_context(prompt_ids or [])
        self._context: list[int] = context  # the ids just before ``_held``: left context for a flush
        self._held: list[int] = []  # pushed ids whose text has not been emitted yet
        self._step = tokenizer.decode_stream(context, skip_special_tokens=skip_special_tokens)
        self._chunks: list[str] = []

    def push(self, token_id: int) -> str:
        """Add one generated id; return the text it completes (often "", never a partial character)."""
        self._held.append(token_id)
        delta = self._step(token_id)
        if delta is None:
            return self.flush() if len(self._held) >= _MAX_HELD_TOKENS else ""
        self._context = (self._context + self._held)[-_CONTEXT_TOKENS:]
        self._held = []
        self._chunks.append(delta)
        return delta

    def flush(self) -> str:
        """Emit whatever is held back (an unfinished character decodes to U+FFFD, as in a full decode), and
        restart the stream after it."""
        if not self._held:
            return ""
        ids = self._context + self._held
        head = self._tok.decode(self._context, skip_special_tokens=self._skip) if self._context else ""
        delta = self._tok.decode(ids, skip_special_tokens=self._skip)[len(head) :]
        self._context, self._held = self._left_context(ids), []
        self._step = self._tok.decode_stream(self._context, skip_special_tokens=self._skip)
        if delta:
            self._chunks.append(delta)
        return delta

    def _left_context(self, ids: Sequence[int]) -> list[int]:
        """The last few ``ids``, or none when they end inside a character: text completing it would shift every
        offset (and ``DecodeStream`` would then emit the context itself)."""
        context = list(ids[-_CONTEXT_TOKENS:])
        if context and self._tok.decode(context, skip_special_tokens=self._skip).endswith(_REPLACEMENT):
            return []
        return context

    @property
    def text(self) -> str:
        """All text emitted so far."""
        if len(self._chunks) > 1:
            self._chunks[:] = ["".join(self._chunks)]
        return self._chunks[0] if self._chunks else ""

    @property
    def held_tokens(self) -> int:
        """How many pushed ids have not yet shown up in the emitted text (for tests and debugging)."""
        return len(self._held)
