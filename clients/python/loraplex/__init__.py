"""Python client for the loraplex gRPC API: one base LLM plus many LoRA / Medusa adapters.

    from loraplex import Client

    with Client("127.0.0.1:50051") as client:
        print(client.generate("The capital of France is", max_new_tokens=8).text)
        for delta in client.stream([{"role": "user", "content": "Hi!"}], adapter="my-lora"):
            print(delta.text, end="", flush=True)

``AsyncClient`` offers the same methods for asyncio. Errors are ``LoraplexError`` subclasses, one per
gRPC status. The generated protobuf / gRPC modules of the API are ``loraplex.v1`` (for direct stub
use); this package needs only ``grpcio`` and ``protobuf``.
"""

from __future__ import annotations

from loraplex._async_client import AsyncClient
from loraplex._channel import ADAPTER_HEADER, DEFAULT_MAX_MESSAGE_BYTES
from loraplex._client import Client
from loraplex._convert import GenerateOptions
from loraplex._errors import (
    AlreadyExists,
    Cancelled,
    DeadlineExceeded,
    FailedPrecondition,
    Internal,
    InvalidArgument,
    LoraplexError,
    NotFound,
    PermissionDenied,
    ResourceExhausted,
    Unauthenticated,
    Unavailable,
    Unimplemented,
    error_class,
    from_rpc_error,
)
from loraplex._retry import RetryPolicy
from loraplex._stream import AsyncDeltaStream, DeltaStream
from loraplex._types import (
    AdapterInfo,
    AdapterKind,
    AdapterState,
    ChatMessage,
    ComputePath,
    Conversation,
    Delta,
    FinishReason,
    Generation,
    HealthStatus,
    Limits,
    LoadLatency,
    Message,
    ModelInfo,
    SamplingParams,
    TokenizeResult,
    Usage,
    WeightedAdapter,
)

__version__ = "0.1.0"

__all__ = [
    "ADAPTER_HEADER",
    "DEFAULT_MAX_MESSAGE_BYTES",
    "AdapterInfo",
    "AdapterKind",
    "AdapterState",
    "AlreadyExists",
    "AsyncClient",
    "AsyncDeltaStream",
    "Cancelled",
    "ChatMessage",
    "Client",
    "ComputePath",
    "Conversation",
    "DeadlineExceeded",
    "Delta",
    "DeltaStream",
    "FailedPrecondition",
    "FinishReason",
    "GenerateOptions",
    "Generation",
    "HealthStatus",
    "Internal",
    "InvalidArgument",
    "Limits",
    "LoadLatency",
    "LoraplexError",
    "Message",
    "ModelInfo",
    "NotFound",
    "PermissionDenied",
    "ResourceExhausted",
    "RetryPolicy",
    "SamplingParams",
    "TokenizeResult",
    "Unauthenticated",
    "Unavailable",
    "Unimplemented",
    "Usage",
    "WeightedAdapter",
    "error_class",
    "from_rpc_error",
]
