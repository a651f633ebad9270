"""Tool calls in a streamed output: ``CallStream`` turns each text delta into the content to send now and the
calls it completed, so a stream's calls and content are those of the same output parsed whole
(``ToolUse.calls_of``), up to the whitespace around blocks."""

from __future__ import annotations

from service.frontend.tools import CALL_CLOSE, CALL_OPEN, NONE, ToolCall, ToolFormat, ToolUse, block_calls


class CallStream:
    """One streamed output's ``(content, calls)``, delta by delta: content goes out as it comes, except what may be
    the start of a tool-call block; a block goes out as its calls once it closes (or as content, if it holds no
    valid call). A forced output is held whole and parsed at its end."""

    def __init__(self, use: ToolUse, fmt: ToolFormat) -> None:
        self.use, self.fmt = use, fmt
        self.calls = 0  # calls sent so far
        self._held = ""
        self._in_block = False
        self._after_call = False

    def feed(self, text: str, final: bool) -> tuple[str, tuple[ToolCall, ...]]:
        """The content to send now and the calls completed by ``text`` (``final``: the output's last delta)."""
        if self.use.choice == NONE:
            return text, ()
        self._held += text
        if self.use.forced:
            if not final:
                return "", ()
            content, whole = self.use.calls_of(self._held, self.fmt)
            self._held = ""
            self.calls += len(whole)
            return content or "", whole
        out: list[str] = []
        calls: list[ToolCall] = []
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
                    calls += kept
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


def _partial_open(text: str) -> int:
    """How many characters at the end of ``text`` could begin ``<tool_call>``."""
    for size in range(min(len(CALL_OPEN) - 1, len(text)), 0, -1):
        if CALL_OPEN.startswith(text[-size:]):
            return size
    return 0
