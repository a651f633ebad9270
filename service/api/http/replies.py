"""The frontend's results and events -> OpenAI response bodies and stream chunks (plain dicts, ready for JSON).

One ``Replies`` per request: it fixes the reply's ``id`` (``chatcmpl-<request id>`` / ``cmpl-<request id>``),
``created`` and ``model`` and adds up usage across choices (each prompt's tokens counted once, as OpenAI does,
however many choices it has). Finish reasons: EOS and a stop sequence are ``stop``, the token limit ``length``,
an output constraint that allows no next token ``dead_end`` (docs/http.md), and a reply that made tool calls
``tool_calls`` (its calls parsed by ``service.frontend.tools``, sent as ``service.api.http.tools`` shapes them).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

from service.api.http import tools as wire
from service.api.http.params import Call
from service.frontend import Completion, FinishReason, Generated, TokenEvent, tools
from service.frontend.tool_stream import CallDelta, CallStream
from service.tokenizer import Tokenizer

FINISH: dict[FinishReason | None, str] = {
    FinishReason.EOS: "stop",
    FinishReason.STOP_SEQUENCE: "stop",
    FinishReason.LENGTH: "length",
    FinishReason.DEAD_END: "dead_end",  # the output constraint allowed no next token (OpenAI has no name for it)
}

Result = Completion | TokenEvent


class Replies:
    def __init__(self, call: Call, request_id: str, tokenizer: Tokenizer) -> None:
        self.call = call
        self.chat = call.kind == "chat"
        self.id = f"{'chatcmpl' if self.chat else 'cmpl'}-{request_id}"
        self.created = int(time.time())
        self.tokenizer = tokenizer
        self._prompt_tokens = [0] * call.choices
        self._completion_tokens = [0] * call.choices
        self._text_offsets = [0] * call.choices  # completions logprobs: where the next token starts
        self._started = [False] * call.choices
        self._format = tools.SMOLLM2  # the chat template's tool format, where there are tools
        use = call.tools if self.chat else None
        self._calls = None
        if use is not None:
            self._format = tools.format_for(tokenizer.chat_template)
            self._calls = [CallStream(use, self._format) for _ in range(call.choices)]

    def _envelope(self, obj: str) -> dict[str, Any]:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.call.model}

    def _count(self, index: int, result: Result) -> None:
        if index % self.call.n == 0:  # the first choice of its prompt: that prompt's tokens, once
            self._prompt_tokens[index] = result.prompt_tokens
        self._completion_tokens[index] = result.generated_tokens

    def usage(self) -> dict[str, int]:
        prompt, completion = sum(self._prompt_tokens), sum(self._completion_tokens)
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}

    # ------------------------------------------------------------------------------------------ whole replies

    def completion(self, generated: Generated) -> dict[str, Any]:
        """The body of a non-streamed reply: one choice per completion."""
        choices = []
        for index, result in enumerate(generated.completions):
            self._count(index, result)
            choice: dict[str, Any] = {"index": index}
            finish = FINISH.get(result.finish)
            if self.chat:
                content, calls = self._parsed(result.text)
                choice["message"] = {"role": "assistant", "content": content}
                if calls:
                    choice["message"]["tool_calls"] = wire.tool_calls_json(calls)
                    finish = "tool_calls"
            else:
                choice["text"] = result.text
            choice["logprobs"] = self._logprobs(index, result)
            choice["finish_reason"] = finish
            choices.append(choice)
        body = self._envelope("chat.completion" if self.chat else "text_completion")
        body.update(choices=choices, usage=self.usage())
        return body

    def _parsed(self, text: str) -> tuple[str | None, tuple[tools.ToolCall, ...]]:
        use = self.call.tools
        return (text, ()) if use is None else use.calls_of(text, self._format)

    # ---------------------------------------------------------------------------------------------- streams

    def chunks(self, index: int, response: TokenEvent) -> list[dict[str, Any]]:
        """The stream chunks of one event of choice ``index`` (none for an empty delta)."""
        finished = response.finish in FINISH
        if finished:
            self._count(index, response)
        first = not self._started[index]
        self._started[index] = True
        text = response.text
        calls: tuple[CallDelta, ...] = ()
        if self._calls is not None:
            text, calls = self._calls[index].feed(response.text, finished)
        if not text and not calls and not finished and not (first and self.chat):
            return []
        choice: dict[str, Any] = {"index": index}
        if self.chat:
            delta: dict[str, Any] = {"role": "assistant"} if first else {}
            if text or first:
                delta["content"] = text
            if calls:
                delta["tool_calls"] = wire.tool_call_deltas(calls)
            choice["delta"] = delta
        else:
            choice["text"] = text
        choice["logprobs"] = self._logprobs(index, response)
        choice["finish_reason"] = None
        if finished:
            stream = None if self._calls is None else self._calls[index]
            called = stream is not None and stream.calls > 0 and stream.complete
            choice["finish_reason"] = "tool_calls" if called else FINISH.get(response.finish)
        chunk = self._envelope("chat.completion.chunk" if self.chat else "text_completion")
        chunk["choices"] = [choice]
        if self.call.include_usage:
            chunk["usage"] = None
        return [chunk]

    def usage_chunk(self) -> dict[str, Any]:
        """The last chunk of a stream with ``stream_options.include_usage``: no choices, the request's usage."""
        chunk = self._envelope("chat.completion.chunk" if self.chat else "text_completion")
        chunk.update(choices=[], usage=self.usage())
        return chunk

    # --------------------------------------------------------------------------------------------- logprobs

    def _logprobs(self, index: int, result: Result) -> dict[str, Any] | None:
        if not self.call.logprobs:
            return None
        pieces = [self.tokenizer.decode([t], skip_special_tokens=False) for t in result.token_ids]
        values: Sequence[float] = list(result.logprobs or ())
        if self.chat:
            content = [
                {"token": piece, "logprob": value, "bytes": list(piece.encode("utf-8")), "top_logprobs": []}
                for piece, value in zip(pieces, values, strict=False)  # drafted tokens carry none
            ]
            return {"content": content, "refusal": None}
        offsets = []
        for piece in pieces:
            offsets.append(self._text_offsets[index])
            self._text_offsets[index] += len(piece)
        return {"tokens": pieces, "token_logprobs": values, "top_logprobs": None, "text_offset": offsets}
