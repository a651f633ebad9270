"""The frontend's domain request and result: what a client asks for and gets back, in no wire format.

Both edges build a ``GenerationCall`` from their own wire format (gRPC: ``service.api.convert``; OpenAI HTTP:
``service.api.http.params``) and turn ``Completion`` s and ``TokenEvent`` s back into theirs. Nothing here is
checked on construction: ``service.frontend.checks`` checks a call once, in one order, for both edges.

A domain error's ``field`` names an attribute of a call (each edge maps it to its own vocabulary):
``inputs`` (their count), ``inputs[i].text`` / ``inputs[i].messages`` (an input's size), ``input`` /
``input.text`` / ``input.messages`` / ``input.messages.role`` (an input's content, found while it is tokenized),
``adapter_id``, ``adapter_scale``, ``adapters`` / ``adapters[i].id`` / ``adapters[i].weight``, ``request_id``,
``max_new_tokens``, ``stop_sequences`` / ``stop_sequences[i]``,
``sampling.<name>``, ``constraint`` / ``constraint.<kind>``.

A new request field for both APIs is: an attribute here, its check in ``checks`` (or ``SamplingParams``), its
translation in each edge (``service.api.convert`` for gRPC, its proto message; ``service.api.http.params`` for
OpenAI JSON), and the engine's use of it. The HTTP path never sees protobuf.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass, field

from service.constraints.spec import Constraint
from service.engine.request import FinishReason
from service.engine.sampling import SamplingParams
from service.frontend.tools import ToolCall, ToolSpec


@dataclass(frozen=True)
class ChatMessage:
    """One turn. An assistant turn may carry the ``tool_calls`` it made; a ``tool`` turn is the result of the call
    ``tool_call_id`` (of the function ``name``)."""

    role: str
    content: str
    tool_calls: tuple[ToolCall, ...] = ()
    tool_call_id: str = ""
    name: str = ""


@dataclass(frozen=True)
class Input:
    """One prompt: ``text`` (templated as one user turn when ``chat``), or chat ``messages``. Neither set is a
    request the checks refuse; an empty text or conversation is still that kind. ``tools``: the functions the
    chat template is told of (``service.frontend.tools``)."""

    text: str | None = None
    messages: tuple[ChatMessage, ...] | None = None
    chat: bool = False
    tools: tuple[ToolSpec, ...] = ()

    @property
    def kind(self) -> str | None:
        """``"messages"``, ``"text"`` or None (neither)."""
        if self.messages is not None:
            return "messages"
        return None if self.text is None else "text"


@dataclass(frozen=True)
class Sampling:
    """How to pick tokens, as asked (unchecked): ``SamplingParams`` checks the values when the call is checked.
    The numbers are float32 in both APIs: ``params`` rounds each to the nearest float32 (overflow: infinity), so a
    value means the same, and is refused alike, whichever edge it came through."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    repetition_penalty: float = 1.0
    seed: int | None = None

    def params(self, *, logprobs: bool, offset: int = 0) -> SamplingParams:
        """The engine's parameters for input ``offset`` of a call: seeded with seed + offset, wrapping modulo 2**64
        (so every uint64 seed stays valid). Raises ``InvalidRequest`` naming the field."""
        seed = None if self.seed is None else (self.seed + offset) % 2**64
        return SamplingParams(
            temperature=_float32(self.temperature),
            top_k=self.top_k,
            top_p=_float32(self.top_p),
            repetition_penalty=_float32(self.repetition_penalty),
            seed=seed,
            logprobs=logprobs,
        )


def _float32(x: float) -> float:
    return float(ctypes.c_float(x).value)


@dataclass(frozen=True)
class GenerationCall:
    """One call asking for a generation per input, all with the same adapter, sampling and stops.

    ``adapter_id`` "" is the base model; ``max_new_tokens`` None the server's default; ``request_id`` "" a new id;
    ``deadline`` a ``time.monotonic()`` instant or None; ``speculate`` None: when the adapter has Medusa heads;
    ``constraint`` what every output must match (None: free text). ``adapter_scale`` multiplies the adapter's
    deltas (None: 1); ``adapters`` is a mixture, (id, weight) in request order, with ``adapter_id`` "" or its
    first id (``checks.adapter_mix`` states the rule)."""

    inputs: tuple[Input, ...]
    adapter_id: str = ""
    sampling: Sampling = field(default_factory=Sampling)
    max_new_tokens: int | None = None
    stop_sequences: tuple[str, ...] = ()
    ignore_eos: bool = False
    speculate: bool | None = None
    logprobs: bool = False
    request_id: str = ""
    deadline: float | None = None
    constraint: Constraint | None = None
    adapter_scale: float | None = None
    adapters: tuple[tuple[str, float], ...] = ()


@dataclass(frozen=True)
class Completion:
    """The whole output of one input: every token id, the log-probabilities asked for, why it finished, usage."""

    text: str
    token_ids: tuple[int, ...]
    logprobs: tuple[float, ...]
    finish: FinishReason
    stop_sequence: str
    prompt_tokens: int
    generated_tokens: int
    accepted_draft_tokens: int


@dataclass(frozen=True)
class Generated:
    """The answer to a non-streamed call: its request id and one completion per input, in order."""

    request_id: str
    completions: tuple[Completion, ...]
