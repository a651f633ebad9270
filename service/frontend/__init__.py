"""The transport-neutral frontend: domain requests in, domain results and events out, for every edge.

``Frontend`` (the engine client) takes a ``GenerationCall`` and returns ``Generated`` completions or streams
``TokenEvent`` s (the engine's events: token ids, text delta, log-probabilities, and on the last one the
``FinishReason`` and usage; a failed one is raised as its typed error instead); ``checks`` validates a call
once, with errors naming domain fields; ``observer`` reports every call of every edge (request id, access line,
request and per-adapter metrics); ``AdapterAdmin`` (``adapters``) loads and removes adapters, the same checks
for gRPC's ``LoadAdapter`` / ``UnloadAdapter`` and HTTP's vLLM routes. The gRPC servicers (``service.api.generation``
+ ``convert``, ``service.api.adapters``) and the OpenAI routes (``service.api.http``) only translate their wire
formats to and from these types. Nothing here imports protobuf, grpc or the HTTP framework.
"""

from service.engine.request import FinishReason, TokenEvent
from service.frontend.adapters import AdapterAdmin
from service.frontend.client import Frontend, raise_if_failed
from service.frontend.prompts import Prompt, Tokenized
from service.frontend.request import ChatMessage, Completion, Generated, GenerationCall, Input, Sampling

__all__ = [
    "AdapterAdmin",
    "ChatMessage",
    "Completion",
    "FinishReason",
    "Frontend",
    "Generated",
    "GenerationCall",
    "Input",
    "Prompt",
    "Sampling",
    "TokenEvent",
    "Tokenized",
    "raise_if_failed",
]
