"""Plain result and option types of the client: frozen dataclasses and string enums, no protobuf.

Every result type is built from its protobuf message by ``loraplex._convert``; callers never need the
generated ``loraplex.v1`` modules unless they want to talk to the stubs directly.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime


class FinishReason(enum.StrEnum):
    """Why a generation stopped. A ``str`` enum: ``reason == "eos"`` works."""

    LENGTH = "length"  # max_new_tokens reached, or the server's max_total_tokens
    EOS = "eos"  # the model ended the sequence
    STOP_SEQUENCE = "stop_sequence"  # one of ``stop`` appeared in the text
    CANCELLED = "cancelled"  # cancelled by the client, a deadline, or server shutdown
    DEAD_END = "dead_end"  # the output constraint allowed no next token (the text may not match it)
    UNSPECIFIED = "unspecified"  # not reported (an older or newer server)


class AdapterKind(enum.StrEnum):
    """What an adapter contains."""

    LORA = "lora"
    MEDUSA = "medusa"
    MEDUSA_LORA = "medusa_lora"
    UNSPECIFIED = "unspecified"


class AdapterState(enum.StrEnum):
    """Where an adapter's weights are (``AdapterInfo`` layer counts say how much)."""

    REGISTERED = "registered"  # indexed only; nothing in memory
    HOST = "host"  # raw tensors in host memory (evicted from the device; reuse needs no disk read)
    DEVICE = "device"  # every layer on the serving device
    LOADING = "loading"  # being read for a request
    FAILED = "failed"  # its last load failed (AdapterInfo.error)
    UNLOADED = "unloaded"  # removed by unload_adapter (only in its result); the id is free again
    UNSPECIFIED = "unspecified"


class HealthStatus(enum.StrEnum):
    """grpc.health.v1 serving status, as ``Client.health`` returns it."""

    UNKNOWN = "unknown"
    SERVING = "serving"  # the model is loaded and requests are accepted
    NOT_SERVING = "not_serving"  # loading, or draining before shutdown
    SERVICE_UNKNOWN = "service_unknown"  # the server does not know the service name asked about


@dataclass(frozen=True)
class ChatMessage:
    """One chat turn. Plain ``{"role": ..., "content": ...}`` mappings are accepted wherever this is."""

    role: str
    content: str


Message = ChatMessage | Mapping[str, str]
"""A chat turn: a ``ChatMessage`` or a mapping with "role" and "content"."""

Conversation = Sequence[Message]
"""A list of chat turns, oldest first; the model's chat template is applied to it."""


@dataclass(frozen=True)
class WeightedAdapter:
    """One adapter of a mixture (``generate(..., adapters=[WeightedAdapter("a", 0.7), ...])``): its deltas are
    multiplied by ``weight`` and summed with the others' (PEFT's ``add_weighted_adapter``, ``"cat"``)."""

    id: str
    weight: float


@dataclass(frozen=True)
class SamplingParams:
    """How the next token is chosen; the defaults are greedy decoding.

    Pass as ``sampling=`` to ``generate`` / ``stream``; keyword arguments given there override fields.
    """

    temperature: float = 0.0  # 0 = greedy (argmax); top_k, top_p and seed are then ignored
    top_k: int = 0  # 0 = off
    top_p: float | None = None  # None (or 1.0) = off; else in (0, 1]
    repetition_penalty: float | None = None  # None (or 1.0) = off; else > 0
    seed: int | None = None  # None = random; with a seed the output is reproducible


@dataclass(frozen=True)
class Usage:
    """Token counts of one generation."""

    prompt_tokens: int  # after the chat template
    generated_tokens: int  # including a final EOS and the tokens of a matched stop sequence
    accepted_draft_tokens: int = 0  # of generated_tokens, how many were accepted Medusa drafts


@dataclass(frozen=True)
class Generation:
    """The result for one prompt of ``generate``."""

    text: str  # without the EOS token and without a matched stop sequence
    finish_reason: FinishReason
    usage: Usage
    token_ids: tuple[int, ...] = ()  # only with return_token_ids=True
    logprobs: tuple[float, ...] = ()  # only with return_logprobs=True; parallel to token_ids
    stop_sequence: str | None = None  # the matched stop sequence, when finish_reason is STOP_SEQUENCE
    request_id: str = ""  # the id the server logged this request under


@dataclass(frozen=True)
class Delta:
    """One message of ``stream``: what was generated since the previous one.

    Joining ``text`` of all deltas gives the full text. The last delta has ``finish_reason`` and
    ``usage`` set (``is_last``); text may be empty while ``token_ids`` is not (an incomplete UTF-8
    character, or text held back because it might start a stop sequence).
    """

    text: str
    token_ids: tuple[int, ...] = ()
    logprobs: tuple[float, ...] = ()
    finish_reason: FinishReason | None = None  # last delta only
    usage: Usage | None = None  # last delta only
    stop_sequence: str | None = None  # last delta only, when finish_reason is STOP_SEQUENCE
    request_id: str = ""  # first delta only

    @property
    def is_last(self) -> bool:
        return self.finish_reason is not None


@dataclass(frozen=True)
class TokenizeResult:
    """Token ids of a prompt, exactly as generation would see them."""

    token_ids: tuple[int, ...]
    tokens: tuple[str, ...]  # vocabulary string of each id (byte-level pieces)
    rendered_text: str  # the text after the chat template (the input itself without one)

    def __len__(self) -> int:
        return len(self.token_ids)


@dataclass(frozen=True)
class Limits:
    """The server's per-request limits."""

    max_batch_size: int  # also the most prompts in one generate call
    max_prompt_tokens: int
    max_new_tokens: int  # also the default of max_new_tokens
    max_total_tokens: int  # prompt + generated
    max_queue: int  # waiting requests before RESOURCE_EXHAUSTED
    max_mixture_adapters: int  # adapters one request may mix (``adapters=``)


@dataclass(frozen=True)
class ComputePath:
    """One compute path as the server's start-up self-check ran it against a float32 reference."""

    path: str  # e.g. "int4 projection 3072x576: kernel"
    kernel: str  # e.g. "torch int4 kernel"
    error: float  # largest per-row relative error
    tolerance: float
    status: str  # "ok" or "fallback: ..."


@dataclass(frozen=True)
class ModelInfo:
    """The served model and the server."""

    model_name: str
    model_path: str
    architecture: str
    dtype: str
    device: str
    vocab_size: int
    context_length: int
    limits: Limits
    features: tuple[str, ...]  # e.g. ("lora", "medusa")
    server_version: str
    load_mode: str  # "stream", "mmap", "eager" or "gguf"
    load_seconds: float
    eos_token_ids: tuple[int, ...] = ()
    cpu_capability: str = ""  # torch's CPU dispatch capability ("AVX512", "AVX2", "DEFAULT"), or the GPU's name
    weights: str = ""  # "folder" or "gguf"
    compute_paths: tuple[ComputePath, ...] = ()


@dataclass(frozen=True)
class LoadLatency:
    """Seconds spent making an adapter usable, by stage (0 = not run yet)."""

    index_seconds: float = 0.0  # config + headers + validation, at registration
    read_seconds: float = 0.0  # last load: reading the weights file (0 when it came from the host tier)
    layout_seconds: float = 0.0  # last load: scale, convert, copy onto the device
    total_seconds: float = 0.0  # last load: request to resident, queueing included


@dataclass(frozen=True)
class AdapterInfo:
    """A registered adapter and where its weights are now."""

    id: str
    source: str  # as given at registration: a path on the server, or hf://org/name[@revision]
    kind: AdapterKind
    state: AdapterState
    rank: int = 0  # largest LoRA rank
    alpha: float = 0.0
    target_modules: tuple[str, ...] = ()
    medusa_heads: int = 0
    total_bytes: int = 0  # on disk
    host_bytes: int = 0  # resident in host memory now
    device_bytes: int = 0  # resident on the serving device now
    num_layers: int = 0
    host_layers: int = 0
    device_layers: int = 0
    hits: int = 0  # requests that used it
    last_used: datetime | None = None  # UTC; None if never used
    registered_at: datetime | None = None  # UTC
    load_latency: LoadLatency = field(default_factory=LoadLatency)
    active_requests: int = 0
    pinned: bool = False
    error: str | None = None  # why the last load failed (state FAILED)
    loads: int = 0  # completed loads onto the device
    disk_reads: int = 0  # of those, the ones that read the disk
    resolved_path: str = ""  # the folder the server reads its files from (an hf:// source's snapshot folder)
