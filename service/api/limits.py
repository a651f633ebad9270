"""Per-field request limits, checked where protobuf arrives and before anything expensive happens.

Every check here is O(size of the field) string work with no allocation beyond one UTF-8 encoding of a field
already known to be short enough: it runs on the event loop before tokenization, chat templating, adapter
lookup or queueing. A field over its limit is INVALID_ARGUMENT (the request itself is malformed for this
server; retrying it unchanged cannot succeed), and the message names the field, the limit and the flag that
sets it. RESOURCE_EXHAUSTED is kept for capacity (queue full) and for the transport's message-size limit.
docs/limits.md lists every limit; keep the two in step.
"""

from __future__ import annotations

from collections.abc import Sequence

from loraplex.v1 import generation_pb2 as pb

from service.adapters.common.ids import ADAPTER_ID_MAX_CHARS, check_adapter_id
from service.config import Settings
from service.errors import InvalidRequest

__all__ = ["ADAPTER_ID_MAX_CHARS", "REQUEST_ID_MAX_CHARS", "check_generate", "check_input"]

REQUEST_ID_MAX_CHARS = 128


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


def check_input(message: pb.Input, settings: Settings, field: str = "input") -> None:
    """The prompt's size before tokenization: ``max_prompt_bytes`` of UTF-8 (text, or every chat message's role and
    content together) and at most ``max_chat_messages`` chat messages. ``field``: where the input is in its
    request (``inputs[2]``), for the error's ``field``."""
    limit = settings.prompt_bytes_limit
    kind = message.WhichOneof("kind")
    if kind == "messages":
        turns = message.messages.messages
        if len(turns) > settings.max_chat_messages:
            raise InvalidRequest(
                f"input.messages has {len(turns)} messages; this server accepts at most {settings.max_chat_messages} "
                "(--max-chat-messages)",
                field=f"{field}.messages",
                limit=settings.max_chat_messages,
            )
        texts: Sequence[str] = [s for m in turns for s in (m.role, m.content)]
    else:
        texts = [message.text] if kind == "text" else []
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
            field="stopping.stop_sequences",
            limit=settings.max_stop_sequences,
        )
    limit = settings.max_stop_sequence_bytes
    for i, stop in enumerate(stops):
        if not stop:
            raise InvalidRequest("stop_sequences must not contain empty strings", field=f"stopping.stop_sequences[{i}]")
        size = _utf8_len_over([stop], limit)
        if size is not None:
            raise InvalidRequest(
                f"stop_sequences[{i}] has more than {limit} bytes of UTF-8; this server accepts at most {limit} "
                "per stop sequence (--max-stop-sequence-bytes)",
                field=f"stopping.stop_sequences[{i}]",
                limit=limit,
            )


def check_ids(adapter_id: str, request_id: str) -> None:
    """The adapter id's rule (``service.adapters.common.ids``; "" = the base model) and the request id's length (its
    character rule is checked where it is used)."""
    if adapter_id:
        check_adapter_id(adapter_id, field="adapter_id")
    if len(request_id) > REQUEST_ID_MAX_CHARS:
        raise InvalidRequest(
            f"request_id has {len(request_id)} characters; it must be 1-{REQUEST_ID_MAX_CHARS} printable ASCII "
            "characters without spaces",
            field="request_id",
            limit=REQUEST_ID_MAX_CHARS,
        )


def check_generate(message: pb.GenerateRequest | pb.GenerateStreamRequest, settings: Settings) -> None:
    """Every per-field limit of a Generate / GenerateStream request, before any of its work starts."""
    check_ids(message.adapter_id, message.request_id)
    if isinstance(message, pb.GenerateRequest):
        if not message.inputs:
            raise InvalidRequest("inputs is empty: give at least one input", field="inputs")
        if len(message.inputs) > settings.max_batch_size:
            raise InvalidRequest(
                f"at most {settings.max_batch_size} inputs per request (--max-batch-size), got {len(message.inputs)}",
                field="inputs",
                limit=settings.max_batch_size,
            )
    check_stops(message.stopping.stop_sequences, settings)
    if isinstance(message, pb.GenerateRequest):
        for i, item in enumerate(message.inputs):
            check_input(item, settings, f"inputs[{i}]")
    else:
        check_input(message.input, settings)
