"""Channel options, TLS credentials, request metadata and the grpc.health.v1 codec shared by both clients.

The health check is called by method path with a hand-written codec for its two one-field messages,
so the client needs neither grpcio-health-checking nor its generated modules.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import grpc

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
    0: HealthStatus.UNKNOWN,
    1: HealthStatus.SERVING,
    2: HealthStatus.NOT_SERVING,
    3: HealthStatus.SERVICE_UNKNOWN,
}


def channel_options(load_balancing: str | None, options: Sequence[tuple[str, Any]]) -> list[tuple[str, Any]]:
    """gRPC channel arguments: ``load_balancing`` (e.g. "round_robin") as the LB policy, then ``options``, then
    the message size limits ``options`` left out (``DEFAULT_MAX_MESSAGE_BYTES`` both ways)."""
    result: list[tuple[str, Any]] = []
    if load_balancing is not None:
        if not isinstance(load_balancing, str) or not load_balancing:
            raise ValueError(f"load_balancing must be a policy name like 'round_robin', got {load_balancing!r}")
        result.append(("grpc.lb_policy_name", load_balancing))
    result.extend((str(key), value) for key, value in options)
    given = {key for key, _ in result}
    result.extend((key, DEFAULT_MAX_MESSAGE_BYTES) for key in _MESSAGE_LIMITS if key not in given)
    return result


PathLike = str | os.PathLike[str]


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


# -------------------------------------------------------------- grpc.health.v1, hand-encoded
# HealthCheckRequest { string service = 1; }   HealthCheckResponse { ServingStatus status = 1; }


def _varint(value: int) -> bytes:
    out = bytearray()
    while True:
        byte = value & 0x7F
        value >>= 7
        if value:
            out.append(byte | 0x80)
        else:
            out.append(byte)
            return bytes(out)


def _read_varint(data: bytes, pos: int) -> tuple[int, int]:
    result = shift = 0
    while True:
        if pos >= len(data) or shift > 63:
            raise ValueError("truncated or oversized varint in health response")
        byte = data[pos]
        pos += 1
        result |= (byte & 0x7F) << shift
        shift += 7
        if not byte & 0x80:
            return result, pos


def encode_health_request(service: str) -> bytes:
    if not service:
        return b""
    raw = service.encode("utf-8")
    return b"\x0a" + _varint(len(raw)) + raw  # field 1, wire type 2 (length-delimited)


def decode_health_response(data: bytes) -> HealthStatus:
    """The ``status`` field of a HealthCheckResponse; unknown fields are skipped."""
    status = 0
    pos = 0
    while pos < len(data):
        tag, pos = _read_varint(data, pos)
        field_number, wire_type = tag >> 3, tag & 7
        if wire_type == 0:
            value, pos = _read_varint(data, pos)
            if field_number == 1:
                status = value
        elif wire_type == 2:
            length, pos = _read_varint(data, pos)
            pos += length
        elif wire_type in (1, 5):
            pos += 8 if wire_type == 1 else 4
        else:
            raise ValueError(f"unexpected wire type {wire_type} in health response")
    if pos > len(data):
        raise ValueError("truncated health response")
    return _HEALTH_STATUSES.get(status, HealthStatus.UNKNOWN)
