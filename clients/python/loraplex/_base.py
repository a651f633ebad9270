"""What ``Client`` and ``AsyncClient`` share: their constructor (argument checks, metadata, credentials, channel
options with the retry policy) and per-call deadlines. Each subclass makes its own kind of channel; nothing here
sends an RPC."""

from __future__ import annotations

import abc
from collections.abc import Sequence
from typing import Any, Generic, TypeVar

import grpc

from loraplex import _channel, _retry
from loraplex._channel import DEFAULT_TARGET, Metadata, PathLike
from loraplex._retry import RetryPolicy

DEFAULT_RETRY = RetryPolicy()

ChannelT = TypeVar("ChannelT")


class ClientBase(abc.ABC, Generic[ChannelT]):
    """The arguments of both clients, checked once (see ``Client`` for what each one means)."""

    def __init__(
        self,
        target: str = DEFAULT_TARGET,
        *,
        timeout: float | None = None,
        metadata: Sequence[tuple[str, str]] = (),
        channel: ChannelT | None = None,
        load_balancing: str | None = None,
        api_key: str | None = None,
        credentials: grpc.ChannelCredentials | None = None,
        options: Sequence[tuple[str, Any]] = (),
        tls_ca: PathLike | None = None,
        tls_cert: PathLike | None = None,
        tls_key: PathLike | None = None,
        retry: RetryPolicy | None = DEFAULT_RETRY,
        wait_for_ready: bool = False,
    ) -> None:
        if retry is not None and not isinstance(retry, RetryPolicy):
            raise TypeError(f"retry must be a RetryPolicy or None (no retries), got {type(retry).__name__}")
        if not isinstance(wait_for_ready, bool):
            raise TypeError("wait_for_ready must be a bool")
        self._wait_for_ready = wait_for_ready
        self._timeout = _channel.check_timeout(timeout)
        self._metadata: Metadata = _channel.base_metadata(metadata, api_key)
        credentials = _channel.tls_credentials(credentials, tls_ca, tls_cert, tls_key)
        if channel is not None:
            _channel.check_own_channel(target, credentials, load_balancing, options)
        self._target = target
        self._credentials = credentials
        self._options = _channel.channel_options(load_balancing, options, _retry.service_config(retry))
        self._owns_channel = channel is None
        self._setup(channel)

    @abc.abstractmethod
    def _setup(self, channel: ChannelT | None) -> None:
        """Take the caller's channel (None: make one now or on first use, as the subclass wants)."""

    def _deadline(self, timeout: float | None) -> float | None:
        """A call's deadline: its own ``timeout``, else the client's default."""
        return _channel.check_timeout(timeout) if timeout is not None else self._timeout
