"""An input's token ids: the chat template applied where the input asks for it, then the tokenizer.

CPU work (the Rust tokenizer, jinja templates): the frontend runs these on the runtime's worker pool, never on
the event loop. Errors name domain fields (``service.frontend.request``).
"""

from __future__ import annotations

from dataclasses import dataclass

from service.errors import InvalidRequest
from service.frontend import tools
from service.frontend.request import Input
from service.tokenizer import Tokenizer


@dataclass(frozen=True)
class Prompt:
    ids: tuple[int, ...]
    rendered: str


@dataclass(frozen=True)
class Tokenized:
    """An input as the tokenizer sees it: its ids, each id's token text and the text after templating."""

    token_ids: tuple[int, ...]
    tokens: tuple[str, ...]
    rendered_text: str


def prompt_of(item: Input, tokenizer: Tokenizer) -> Prompt:
    """Token ids of one input, with the chat template applied when the input asks for it."""
    if item.messages is not None:
        turns = [{"role": m.role, "content": m.content} for m in item.messages]
        if not turns:
            raise InvalidRequest("input.messages is empty: give at least one chat message", field="input.messages")
        if any(not t["role"] for t in turns):
            raise InvalidRequest("every chat message needs a role (e.g. 'user')", field="input.messages.role")
        if tools.uses_tools(item.messages, item.tools):
            fmt = tools.format_for(tokenizer.chat_template)
            turns, extra = fmt.render_args(item.messages, item.tools)
            text = tokenizer.apply_chat_template(turns, add_generation_prompt=True, **extra)
        else:
            text = tokenizer.apply_chat_template(turns, add_generation_prompt=True)
        return Prompt(tuple(tokenizer.encode(text, add_special_tokens=False)), text)
    if item.text is not None:
        if not item.text:
            raise InvalidRequest("the prompt is empty: set input.text to some text", field="input.text")
        if item.chat:
            text = tokenizer.apply_chat_template([{"role": "user", "content": item.text}], add_generation_prompt=True)
            return Prompt(tuple(tokenizer.encode(text, add_special_tokens=False)), text)
        return Prompt(tuple(tokenizer.encode(item.text)), item.text)
    raise InvalidRequest("input needs either `text` or `messages`", field="input")


def tokenize(item: Input, tokenizer: Tokenizer) -> Tokenized:
    prompt = prompt_of(item, tokenizer)
    tokens = tuple(tokenizer.id_to_token(i) or "" for i in prompt.ids)
    return Tokenized(prompt.ids, tokens, prompt.rendered)
