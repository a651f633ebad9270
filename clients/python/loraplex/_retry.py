"""Retries and waiting for the server, as gRPC does them itself: a ``retryPolicy`` in the channel's service config.

gRPC retries a call only while it is uncommitted (no response headers received yet); the loraplex server answers
a refusal (RESOURCE_EXHAUSTED: queue full; UNAVAILABLE: loading, draining) before any header, so refused calls
are retried with exponential backoff (randomized, as gRPC's retry design specifies) and a call that had started
to answer never is. Only idempotent methods get the policy: generation, tokenization, model info, listing and
reading adapters, health checks; ``LoadAdapter`` / ``UnloadAdapter`` are sent once.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass

import grpc

IDEMPOTENT_METHODS: tuple[dict[str, str], ...] = (
    {"service": "loraplex.v1.Generation"},  # every method: Generate, GenerateStream, Tokenize, ModelInfo
    {"service": "loraplex.v1.Adapters", "method": "ListAdapters"},
    {"service": "loraplex.v1.Adapters", "method": "GetAdapter"},
    {"service": "grpc.health.v1.Health", "method": "Check"},
)
"""The methods a retry policy applies to (a service config ``name`` list)."""

MAX_ATTEMPTS_LIMIT = 5  # gRPC caps maxAttempts at 5 whatever the config says
SERVICE_CONFIG_OPTION = "grpc.service_config"


@dataclass(frozen=True)
class RetryPolicy:
    """How the client retries idempotent calls that the server refused with one of ``codes``.

    ``max_attempts``: tries in all, first included (2-5). Before retry n the client waits a random time in
    ``[0, min(initial_backoff * backoff_multiplier**(n-1), max_backoff)]`` seconds. The call's deadline covers
    every attempt. Pass ``retry=None`` to a client to turn retries off.
    """

    max_attempts: int = 4
    initial_backoff: float = 0.2
    max_backoff: float = 5.0
    backoff_multiplier: float = 2.0
    codes: tuple[str, ...] = ("UNAVAILABLE", "RESOURCE_EXHAUSTED")

    def __post_init__(self) -> None:
        if isinstance(self.max_attempts, bool) or not isinstance(self.max_attempts, int):
            raise TypeError("max_attempts must be an int")
        if not 2 <= self.max_attempts <= MAX_ATTEMPTS_LIMIT:
            raise ValueError(f"max_attempts must be 2-{MAX_ATTEMPTS_LIMIT} (use retry=None for no retries)")
        for name in ("initial_backoff", "max_backoff", "backoff_multiplier"):
            value = getattr(self, name)
            number = isinstance(value, (int, float)) and not isinstance(value, bool)
            if not (number and math.isfinite(value) and value > 0):
                raise ValueError(f"{name} must be a finite number > 0, got {value!r}")
        if self.max_backoff < self.initial_backoff:
            raise ValueError("max_backoff must be >= initial_backoff")
        known = {code.name for code in grpc.StatusCode} - {"OK"}
        if not self.codes or any(code not in known for code in self.codes):
            raise ValueError(f"codes must be gRPC status code names like 'UNAVAILABLE', got {self.codes!r}")

    def as_json(self) -> dict[str, object]:
        """The ``retryPolicy`` object of a gRPC service config."""
        return {
            "maxAttempts": self.max_attempts,
            "initialBackoff": _duration(self.initial_backoff),
            "maxBackoff": _duration(self.max_backoff),
            "backoffMultiplier": self.backoff_multiplier,
            "retryableStatusCodes": list(self.codes),
        }


def _duration(seconds: float) -> str:
    """Seconds as a protobuf JSON Duration ("0.2s"), to the nanosecond."""
    text = f"{seconds:.9f}".rstrip("0").rstrip(".")
    return f"{text}s"


def service_config(policy: RetryPolicy | None) -> str | None:
    """The channel's service config (JSON) for ``policy``; None when retries are off."""
    if policy is None:
        return None
    config = {"methodConfig": [{"name": list(IDEMPOTENT_METHODS), "retryPolicy": policy.as_json()}]}
    return json.dumps(config, sort_keys=True)
