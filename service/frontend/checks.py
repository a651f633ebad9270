"""Every check of a domain request, run once for both edges, before anything expensive happens.

``check`` runs the cheap checks of a ``GenerationCall`` on the event loop, before tokenization, chat templating,
adapter lookup or queueing: the per-field size limits, the ids, ``max_new_tokens`` and the sampling parameters
(``SamplingParams``, valid by construction), and returns a ``Checked``; ``engine_request`` only assembles the
engine's ``GenerationRequest`` from it and a tokenized prompt. The engine's own ``validate`` (prompt length,
vocabulary, adapter) is the one check left after tokenization.

Every size check is O(size of the field) string work with no allocation beyond one UTF-8 encoding of a field
already known to be short enough. A field over its limit is INVALID_ARGUMENT (retrying it unchanged cannot
succeed), and the message names the field, the limit and the flag that sets it; RESOURCE_EXHAUSTED is kept for
capacity (queue full) and for the transport's message-size limit. Errors name domain fields
(``service.frontend.request``). docs/limits.md lists every limit; keep the two in step.
"""

from __future__ import annotations

import re
import uuid
from collections.abc import Sequence
from dataclasses import dataclass

from service.adapters.common.ids import check_adapter_id
from service.adapters.handle import check_mix, check_weight
from service.config import Settings
from service.constraints.backend import Grammar
from service.constraints.spec import check_constraint
from service.engine.request import GenerationRequest, check_max_new_tokens
from service.engine.sampling import SamplingParams
from service.errors import InvalidRequest
from service.frontend import tools
from service.frontend.prompts import Prompt
from service.frontend.request import GenerationCall, Input
from service.logs import REQUEST_ID

REQUEST_ID_MAX_CHARS = 128
_REQUEST_ID = re.compile(rf"^[\x21-\x7e]{{1,{REQUEST_ID_MAX_CHARS}}}$")


def _utf8_len_over(texts: Sequence[str], limit: int) -> int | None:
    """The texts' total UTF-8 size if it exceeds ``limit``, else None. Stops encoding once over the limit, and
    never encodes a text whose character count alone is over it (a character is at least one byte)."""
    total = 0
    for text in texts:
        total += len(text)
        if total > limit:
            return total
    if total * 4 <= limit:  # at most 4 bytes per character: no need to encode
        return None
    total = 0
    for text in texts:
        total += len(text.encode("utf-8", "surrogatepass"))
        if total > limit:
            return total
    return None


def check_input(item: Input, settings: Settings, field: str = "input") -> None:
    """The prompt's size before tokenization: ``max_prompt_bytes`` of UTF-8 (text, or every chat message's role and
    content together, with the tools and tool calls) and at most ``max_chat_messages`` chat messages. ``field``:
    where the input is in its request (``inputs[2]``), for the error's ``field``."""
    limit = settings.prompt_bytes_limit
    kind = item.kind
    if item.messages is not None:
        turns = item.messages
        if len(turns) > settings.max_chat_messages:
            raise InvalidRequest(
                f"input.messages has {len(turns)} messages; this server accepts at most {settings.max_chat_messages} "
                "(--max-chat-messages)",
                field=f"{field}.messages",
                limit=settings.max_chat_messages,
            )
        texts: Sequence[str] = [s for m in turns for s in (m.role, m.content)]
    else:
        texts = [item.text] if item.text is not None else []
    if item.tools or item.messages:
        texts = [*texts, *tools.tool_texts(item.tools, item.messages)]  # the tools and calls count too
    size = _utf8_len_over(texts, limit)
    if size is not None:
        raise InvalidRequest(
            f"the prompt has more than {limit} bytes of UTF-8 (at least {size}); this server accepts at most "
            f"{limit} (--max-prompt-bytes)",
            field=f"{field}.{kind or 'text'}",
            limit=limit,
        )


def check_stops(stops: Sequence[str], settings: Settings) -> None:
    """At most ``max_stop_sequences`` stop sequences, each 1 to ``max_stop_sequence_bytes`` bytes of UTF-8."""
    if len(stops) > settings.max_stop_sequences:
        raise InvalidRequest(
            f"stop_sequences has {len(stops)} entries; this server accepts at most {settings.max_stop_sequences} "
            "(--max-stop-sequences)",
            field="stop_sequences",
            limit=settings.max_stop_sequences,
        )
    limit = settings.max_stop_sequence_bytes
    for i, stop in enumerate(stops):
        if not stop:
            raise InvalidRequest("stop_sequences must not contain empty strings", field=f"stop_sequences[{i}]")
        size = _utf8_len_over([stop], limit)
        if size is not None:
            raise InvalidRequest(
                f"stop_sequences[{i}] has more than {limit} bytes of UTF-8; this server accepts at most {limit} "
                "per stop sequence (--max-stop-sequence-bytes)",
                field=f"stop_sequences[{i}]",
                limit=limit,
            )


def check_ids(adapter_id: str, request_id: str) -> None:
    """The adapter id's rule (``service.adapters.common.ids``; "" = the base model) and the request id's length (its
    character rule is checked by ``request_id_of``)."""
    if adapter_id:
        check_adapter_id(adapter_id, field="adapter_id")
    if len(request_id) > REQUEST_ID_MAX_CHARS:
        raise InvalidRequest(
            f"request_id has {len(request_id)} characters; it must be 1-{REQUEST_ID_MAX_CHARS} printable ASCII "
            "characters without spaces",
            field="request_id",
            limit=REQUEST_ID_MAX_CHARS,
        )


def is_request_id(text: str) -> bool:
    """Whether ``text`` is a valid request id: 1-128 printable ASCII characters without spaces."""
    return bool(_REQUEST_ID.match(text))


def request_id_of(given: str) -> str:
    """``given`` when it is a valid request id, a new one when it is empty; else ``InvalidRequest``."""
    if not given:
        return uuid.uuid4().hex[:16]
    if not _REQUEST_ID.match(given):
        raise InvalidRequest(
            "request_id must be 1-128 printable ASCII characters without spaces",
            field="request_id",
            limit=REQUEST_ID_MAX_CHARS,
        )
    return given


def adapter_mix(call: GenerationCall, settings: Settings) -> tuple[str, tuple[tuple[str, float], ...]]:
    """The call's adapter id and weighted adapters (the engine's ``adapter_id`` and ``mix``), checked.

    The rule: ``adapter_scale`` goes with ``adapter_id`` alone; ``adapters`` with ``adapter_id`` empty or equal to
    its first id. One adapter at weight 1 is that adapter alone (``mix`` empty: today's K/V key and batching)."""
    if call.adapter_scale is not None:
        if call.adapters:
            raise InvalidRequest(
                "adapter_scale and adapters exclude each other: weigh each adapter in adapters", field="adapter_scale"
            )
        if not call.adapter_id:
            raise InvalidRequest("adapter_scale needs an adapter (adapter_id is empty)", field="adapter_scale")
        check_weight(call.adapter_scale, "adapter_scale")
        mix: tuple[tuple[str, float], ...] = ((call.adapter_id, call.adapter_scale),)
    elif call.adapters:
        for i, (adapter_id, _) in enumerate(call.adapters):
            check_adapter_id(adapter_id, field=f"adapters[{i}].id")
        if call.adapter_id not in ("", call.adapters[0][0]):
            raise InvalidRequest(
                f"adapter_id {call.adapter_id!r} is not adapters[0].id {call.adapters[0][0]!r}: leave adapter_id "
                "empty with adapters, or name the first of them",
                field="adapter_id",
            )
        check_mix(call.adapters, settings.max_mixture_adapters)
        mix = call.adapters
    else:
        return call.adapter_id, ()
    return mix[0][0], () if mix == ((mix[0][0], 1.0),) else mix


def check_call(call: GenerationCall, settings: Settings) -> None:
    """Every per-field limit of a call, before any of its work starts."""
    check_ids(call.adapter_id, call.request_id)
    if not call.inputs:
        raise InvalidRequest("inputs is empty: give at least one input", field="inputs")
    if len(call.inputs) > settings.max_batch_size:
        raise InvalidRequest(
            f"at most {settings.max_batch_size} inputs per request (--max-batch-size), got {len(call.inputs)}",
            field="inputs",
            limit=settings.max_batch_size,
        )
    check_stops(call.stop_sequences, settings)
    if call.constraint is not None:
        check_constraint(call.constraint, settings.constraint_limits)
    for i, item in enumerate(call.inputs):
        check_input(item, settings, f"inputs[{i}]")


@dataclass(frozen=True)
class Checked:
    """A call whose every field was checked, before its prompts are tokenized. ``sampling`` has one entry per
    input (input i is seeded with seed + i)."""

    call: GenerationCall
    request_id: str
    max_new_tokens: int
    sampling: tuple[SamplingParams, ...]
    adapter_id: str = ""  # the call's adapter, or its mixture's first ("": the base model)
    mix: tuple[tuple[str, float], ...] = ()  # the weighted adapters (empty: adapter_id alone at weight 1)


def check(call: GenerationCall, settings: Settings) -> Checked:
    """Everything about ``call`` that can be refused before its prompts are tokenized."""
    check_call(call, settings)
    adapter_id, mix = adapter_mix(call, settings)
    request_id = request_id_of(call.request_id)
    max_new = settings.max_new_tokens if call.max_new_tokens is None else call.max_new_tokens
    check_max_new_tokens(max_new, settings.max_new_tokens)
    sampling = tuple(call.sampling.params(logprobs=call.logprobs, offset=i) for i in range(len(call.inputs)))
    return Checked(call, request_id, max_new, sampling, adapter_id, mix)


def engine_request(
    checked: Checked, prompt: Prompt, index: int = 0, grammar: Grammar | None = None
) -> GenerationRequest:
    """Input ``index`` of a checked call as the engine's request (its id is ``<request id>/<index>`` when there are
    several; its ``call_id`` the id of the call running it, which its engine log lines carry; ``grammar`` its
    compiled constraint): assembly only."""
    call = checked.call
    several = len(checked.sampling) > 1
    return GenerationRequest(
        request_id=f"{checked.request_id}/{index}" if several else checked.request_id,
        prompt_ids=prompt.ids,
        max_new_tokens=checked.max_new_tokens,
        sampling=checked.sampling[index],
        adapter_id=checked.adapter_id or None,
        mix=checked.mix,
        stop_sequences=call.stop_sequences,
        ignore_eos=call.ignore_eos,
        speculate=call.speculate,
        deadline=call.deadline,
        call_id=REQUEST_ID.get() or "",
        grammar=grammar,
    )
