"""Channel options, TLS credentials, request metadata and the health check shared by both clients.

The health check uses grpcio-health-checking's messages (``grpc_health.v1.health_pb2``) and answers the
client's own ``HealthStatus``.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import grpc
from grpc_health.v1 import health_pb2

from loraplex._retry import SERVICE_CONFIG_OPTION
from loraplex._types import HealthStatus

ADAPTER_HEADER = "x-loraplex-adapter"
"""Request metadata key that carries the adapter id (empty for the base model) on generation calls.

Proxies can route on it (e.g. a consistent hash per adapter) so that each adapter stays hot on a few
replicas; the server itself reads the id from the request message."""

DEFAULT_TARGET = "127.0.0.1:50051"
DEFAULT_MAX_MESSAGE_BYTES = 4 << 20
"""Largest message a client sends or receives unless its ``options`` say otherwise (the server's default
``--max-message-bytes``)."""
_MESSAGE_LIMITS = ("grpc.max_receive_message_length", "grpc.max_send_message_length")
HEALTH_CHECK_METHOD = "/grpc.health.v1.Health/Check"

Metadata = tuple[tuple[str, str], ...]

_HEALTH_STATUSES = {
    health_pb2.HealthCheckResponse.UNKNOWN: HealthStatus.UNKNOWN,
    health_pb2.HealthCheckResponse.SERVING: HealthStatus.SERVING,
    health_pb2.HealthCheckResponse.NOT_SERVING: HealthStatus.NOT_SERVING,
    health_pb2.HealthCheckResponse.SERVICE_UNKNOWN: HealthStatus.SERVICE_UNKNOWN,
}


def channel_options(
    load_balancing: str | None, options: Sequence[tuple[str, Any]], service_config: str | None = None
) -> list[tuple[str, Any]]:
    """gRPC channel arguments: ``load_balancing`` (e.g. "round_robin") as the LB policy, then ``options``, then
    the message size limits ``options`` left out (``DEFAULT_MAX_MESSAGE_BYTES`` both ways), then
    ``service_config`` (the retry policy's JSON) unless ``options`` has a service config of its own."""
    result: list[tuple[str, Any]] = []
    if load_balancing is not None:
        if not isinstance(load_balancing, str) or not load_balancing:
            raise ValueError(f"load_balancing must be a policy name like 'round_robin', got {load_balancing!r}")
        result.append(("grpc.lb_policy_name", load_balancing))
    result.extend((str(key), value) for key, value in options)
    given = {key for key, _ in result}
    result.extend((key, DEFAULT_MAX_MESSAGE_BYTES) for key in _MESSAGE_LIMITS if key not in given)
    if service_config is not None and SERVICE_CONFIG_OPTION not in given:
        result.append((SERVICE_CONFIG_OPTION, service_config))
    return result


PathLike = str | os.PathLike[str]


def check_own_channel(
    target: str, credentials: object, load_balancing: str | None, options: Sequence[tuple[str, Any]]
) -> None:
    """With a caller's ``channel=``, the arguments that would make a channel must be left out."""
    if target != DEFAULT_TARGET or credentials is not None or load_balancing is not None or options:
        raise ValueError("with channel=, leave out target, credentials, load_balancing and options")


def tls_credentials(
    credentials: grpc.ChannelCredentials | None,
    tls_ca: PathLike | None,
    tls_cert: PathLike | None,
    tls_key: PathLike | None,
) -> grpc.ChannelCredentials | None:
    """The channel's credentials: ``credentials`` as given, or TLS from PEM files (``tls_ca``: the CA that signed
    the server's certificate, default the system's roots; ``tls_cert`` + ``tls_key``: a client certificate for
    mutual TLS), or None (plaintext) when none of them is given."""
    if tls_ca is None and tls_cert is None and tls_key is None:
        return credentials
    if credentials is not None:
        raise ValueError("give either credentials= or tls_ca= / tls_cert= / tls_key=, not both")
    if (tls_cert is None) != (tls_key is None):
        raise ValueError("tls_cert and tls_key go together (the client certificate and its private key)")
    return grpc.ssl_channel_credentials(
        root_certificates=_read_pem(tls_ca, "tls_ca"),
        private_key=_read_pem(tls_key, "tls_key"),
        certificate_chain=_read_pem(tls_cert, "tls_cert"),
    )


def _read_pem(path: PathLike | None, name: str) -> bytes | None:
    if path is None:
        return None
    try:
        return Path(path).read_bytes()
    except OSError as exc:
        raise ValueError(f"{name}={str(path)!r}: cannot read it ({exc.strerror})") from None


def base_metadata(metadata: Sequence[tuple[str, str]], api_key: str | None) -> Metadata:
    """Metadata sent with every call: the caller's pairs, plus ``authorization: Bearer <api_key>``."""
    pairs: list[tuple[str, str]] = []
    for item in metadata:
        key, value = item
        if not isinstance(key, str) or not isinstance(value, str):
            raise TypeError("metadata must be (str, str) pairs")
        if key.lower() != key:
            raise ValueError(f"metadata keys must be lower-case, got {key!r}")
        if key == ADAPTER_HEADER:
            raise ValueError(f"metadata key {key!r} is set by the client itself (adapter=)")
        if key == "authorization" and api_key is not None:
            raise ValueError("give either api_key or an 'authorization' metadata pair, not both")
        pairs.append((key, value))
    if api_key is not None:
        if not isinstance(api_key, str) or not api_key:
            raise ValueError("api_key must be a non-empty str")
        pairs.append(("authorization", f"Bearer {api_key}"))
    return tuple(pairs)


def with_adapter(metadata: Metadata, adapter_id: str) -> Metadata:
    """``metadata`` plus the adapter header (always present on generation calls, empty = base model)."""
    return (*metadata, (ADAPTER_HEADER, adapter_id))


def check_timeout(timeout: float | None) -> float | None:
    if timeout is None:
        return None
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)):
        raise TypeError(f"timeout must be seconds (a number), got {type(timeout).__name__}")
    if not timeout > 0:
        raise ValueError(f"timeout must be > 0 seconds, got {timeout}")
    return float(timeout)


# ------------------------------------------------------------------------------------ grpc.health.v1


def encode_health_request(service: str) -> bytes:
    data: bytes = health_pb2.HealthCheckRequest(service=service).SerializeToString()  # grpc_health has no stubs
    return data


def decode_health_response(data: bytes) -> HealthStatus:
    """The ``status`` of a HealthCheckResponse as a ``HealthStatus`` (a status newer than this client: UNKNOWN)."""
    status = health_pb2.HealthCheckResponse.FromString(data).status
    return _HEALTH_STATUSES.get(status, HealthStatus.UNKNOWN)


def health_check(channel: Any) -> Any:
    """``Health/Check`` on ``channel`` (sync or aio) as a callable taking the service name and answering a
    ``HealthStatus`` (or, on an aio channel, an awaitable of one)."""
    return channel.unary_unary(
        HEALTH_CHECK_METHOD, request_serializer=encode_health_request, response_deserializer=decode_health_response
    )
