"""Tool calls in a streamed output: ``CallStream`` turns each text delta into the content to send now and the
``CallDelta`` s of the calls, so a stream's calls and content are those of the same output parsed whole
(``ToolUse.calls_of``), up to the whitespace around blocks."""

from __future__ import annotations

import json
from dataclasses import dataclass

from service.frontend.tools import (
    CALL_CLOSE,
    CALL_OPEN,
    NONE,
    REQUIRED,
    ToolCall,
    ToolFormat,
    ToolUse,
    block_calls,
    new_call_id,
)


@dataclass(frozen=True)
class CallDelta:
    """A piece of call ``index`` of a reply: its first piece has the call's ``id`` and ``name``; the pieces'
    ``arguments`` joined are its arguments' JSON text."""

    index: int
    arguments: str
    name: str = ""
    id: str = ""

    @classmethod
    def whole(cls, index: int, call: ToolCall) -> CallDelta:
        return cls(index, call.arguments, call.name, call.id or new_call_id())


class CallStream:
    """One streamed output's ``(content, calls)``, delta by delta: content goes out as it comes, except what may be
    the start of a tool-call block; a block goes out as its calls once it closes (or as content, if it holds no
    valid call). Under a named tool the output is its arguments, sent as they come; under ``REQUIRED`` it is held
    whole and parsed at its end. ``complete``: the calls sent are whole (False once a named tool's arguments ended
    cut short)."""

    def __init__(self, use: ToolUse, fmt: ToolFormat) -> None:
        self.use, self.fmt = use, fmt
        self.calls = 0  # calls started so far
        self.complete = True
        self._held = ""
        self._in_block = False
        self._after_call = False

    def feed(self, text: str, final: bool) -> tuple[str, tuple[CallDelta, ...]]:
        """The content to send now and the call pieces ``text`` gave (``final``: the output's last delta)."""
        if self.use.choice == NONE:
            return text, ()
        self._held += text
        if self.use.choice == REQUIRED:
            if not final:
                return "", ()
            content, whole = self.use.calls_of(self._held, self.fmt)
            self._held = ""
            self.calls += len(whole)
            return content or "", tuple(CallDelta.whole(i, c) for i, c in enumerate(whole))
        if self.use.forced:
            return "", self._named(text, final)
        out: list[str] = []
        calls: list[CallDelta] = []
        while True:
            if self._in_block:
                end = self._held.find(CALL_CLOSE)
                if end < 0 and not final:
                    break
                body = self._held[len(CALL_OPEN) : end if end >= 0 else len(self._held)]
                block_text = self._held if end < 0 else self._held[: end + len(CALL_CLOSE)]
                found = block_calls(body, self.use)
                if found is None:
                    out.append(block_text)
                else:
                    kept = found if self.use.parallel else found[: max(0, 1 - self.calls)]
                    calls += [CallDelta.whole(self.calls + i, c) for i, c in enumerate(kept)]
                    self.calls += len(kept)
                    self._after_call = True
                self._held = self._held[len(block_text) :]
                self._in_block = False
                continue
            if self._after_call:
                self._held = self._held.lstrip()
                self._after_call = not self._held and not final
            start = self._held.find(CALL_OPEN)
            if start >= 0:
                out.append(self._held[:start])
                self._held = self._held[start:]
                self._in_block = True
                continue
            keep = 0 if final else _partial_open(self._held)
            out.append(self._held[: len(self._held) - keep])
            self._held = self._held[len(self._held) - keep :]
            break
        return "".join(out), tuple(calls)

    def _named(self, text: str, final: bool) -> tuple[CallDelta, ...]:
        if final:
            try:
                self.complete = isinstance(json.loads(self._held), dict)
            except ValueError:
                self.complete = False
        piece = text.lstrip() if not self.calls else text
        if self.calls:
            return (CallDelta(0, piece),) if piece else ()
        if not piece and not final:
            return ()
        self.calls = 1
        return (CallDelta(0, piece, self.use.choice, new_call_id()),)


def _partial_open(text: str) -> int:
    """How many characters at the end of ``text`` could begin ``<tool_call>``."""
    for size in range(min(len(CALL_OPEN) - 1, len(text)), 0, -1):
        if CALL_OPEN.startswith(text[-size:]):
            return size
    return 0
