"""``AsyncClient``: the asyncio client (``grpc.aio``), method for method the same as ``Client``.

The channel is made on first use, inside the running event loop, so an ``AsyncClient`` may be
constructed anywhere; use it from one event loop.
"""

from __future__ import annotations

import os
from collections.abc import AsyncGenerator, Awaitable, Callable, Sequence
from types import TracebackType
from typing import NamedTuple, Self, TypeVar, Unpack, overload

import grpc
import grpc.aio

from loraplex import _channel, _convert
from loraplex._base import ClientBase
from loraplex._channel import Metadata
from loraplex._convert import GenerateOptions, Prompt
from loraplex._errors import from_rpc_error
from loraplex._stream import AsyncDeltaStream
from loraplex._types import AdapterInfo, Conversation, Delta, Generation, HealthStatus, ModelInfo, TokenizeResult
from loraplex.v1 import adapters_pb2, adapters_pb2_grpc, generation_pb2, generation_pb2_grpc

_Response = TypeVar("_Response")


class _Stubs(NamedTuple):
    generation: generation_pb2_grpc.GenerationAsyncStub
    adapters: adapters_pb2_grpc.AdaptersAsyncStub
    health: Callable[..., Awaitable[HealthStatus]]


class AsyncClient(ClientBase[grpc.aio.Channel]):
    """Asyncio client; arguments as for ``Client`` (``channel`` must then be a ``grpc.aio.Channel``).

    Every generation call sends the adapter id as the ``x-loraplex-adapter`` request header.
    """

    def _setup(self, channel: grpc.aio.Channel | None) -> None:
        self._channel = channel  # None: made by ``_open``, inside the event loop
        self._stubs: _Stubs | None = None

    # --------------------------------------------------------------------------------- plumbing

    def _open(self) -> _Stubs:
        """The stubs, making the channel first if this is the first call."""
        if self._stubs is None:
            if self._channel is None:
                if self._credentials is None:
                    self._channel = grpc.aio.insecure_channel(self._target, options=self._options)
                else:
                    self._channel = grpc.aio.secure_channel(self._target, self._credentials, options=self._options)
            self._stubs = _Stubs(
                generation=generation_pb2_grpc.GenerationStub(self._channel),
                adapters=adapters_pb2_grpc.AdaptersStub(self._channel),
                health=_channel.health_check(self._channel),
            )
        return self._stubs

    async def _call(
        self,
        method: Callable[..., Awaitable[_Response]],
        request: object,
        timeout: float | None,
        metadata: Metadata | None = None,
    ) -> _Response:
        deadline = self._deadline(timeout)
        try:
            return await method(
                request, timeout=deadline, metadata=metadata or self._metadata, wait_for_ready=self._wait_for_ready
            )
        except grpc.RpcError as error:  # grpc.aio.AioRpcError is a grpc.RpcError
            raise from_rpc_error(error) from error

    # ------------------------------------------------------------------------------- generation

    @overload
    async def generate(  # type: ignore[overload-overlap]  # a str is also a Sequence[str]; it matches here first
        self, prompt: str | Conversation, *, timeout: float | None = None, **options: Unpack[GenerateOptions]
    ) -> Generation: ...

    @overload
    async def generate(
        self, prompt: Sequence[Prompt], *, timeout: float | None = None, **options: Unpack[GenerateOptions]
    ) -> list[Generation]: ...

    async def generate(
        self, prompt: Prompt | Sequence[Prompt], *, timeout: float | None = None, **options: Unpack[GenerateOptions]
    ) -> Generation | list[Generation]:
        """As ``Client.generate``."""
        opts = _convert.generation_options(**options)
        inputs, single = _convert.build_inputs(prompt, chat=opts.chat)
        request = _convert.generate_request(inputs, opts)
        generation = self._open().generation
        response: generation_pb2.GenerateResponse = await self._call(
            generation.Generate, request, timeout, _channel.with_adapter(self._metadata, opts.adapter_id)
        )
        return _convert.generations_of(response, len(inputs), single=single)

    def stream(
        self, prompt: Prompt, *, timeout: float | None = None, **options: Unpack[GenerateOptions]
    ) -> AsyncDeltaStream:
        """As ``Client.stream``, for ``async for`` or ``async with client.stream(...) as deltas:``.
        Arguments are checked here; the call starts on the first iteration. Leaving the block or the
        loop early (or ``await deltas.aclose()``) cancels the request."""
        opts = _convert.generation_options(**options)
        request = _convert.stream_request(_convert.build_input(prompt, chat=opts.chat), opts)
        deadline = self._deadline(timeout)
        metadata = _channel.with_adapter(self._metadata, opts.adapter_id)
        return AsyncDeltaStream(self._deltas(request, deadline, metadata))

    async def _deltas(
        self, request: generation_pb2.GenerateStreamRequest, deadline: float | None, metadata: Metadata
    ) -> AsyncGenerator[Delta, None]:
        generation = self._open().generation
        ready = self._wait_for_ready
        call = generation.GenerateStream(request, timeout=deadline, metadata=metadata, wait_for_ready=ready)
        try:
            async for message in call:
                yield _convert.to_delta(message)
        except grpc.RpcError as error:
            raise from_rpc_error(error) from error
        finally:
            call.cancel()  # a no-op once the call has finished

    async def tokenize(self, text: Prompt, *, chat: bool = False, timeout: float | None = None) -> TokenizeResult:
        """As ``Client.tokenize``."""
        request = generation_pb2.TokenizeRequest(input=_convert.build_input(text, chat=chat))
        generation = self._open().generation
        response: generation_pb2.TokenizeResponse = await self._call(generation.Tokenize, request, timeout)
        return _convert.to_tokenize_result(response)

    async def model_info(self, *, timeout: float | None = None) -> ModelInfo:
        """As ``Client.model_info``."""
        generation = self._open().generation
        response: generation_pb2.ModelInfoResponse = await self._call(
            generation.ModelInfo, generation_pb2.ModelInfoRequest(), timeout
        )
        return _convert.to_model_info(response)

    # --------------------------------------------------------------------------------- adapters

    async def load_adapter(
        self, adapter_id: str, source: str | os.PathLike[str], *, timeout: float | None = None
    ) -> AdapterInfo:
        """As ``Client.load_adapter``."""
        request = _convert.load_adapter_request(adapter_id, os.fspath(source))
        adapters = self._open().adapters
        response: adapters_pb2.LoadAdapterResponse = await self._call(adapters.LoadAdapter, request, timeout)
        return _convert.to_adapter_info(response.adapter)

    async def unload_adapter(self, adapter_id: str, *, timeout: float | None = None) -> AdapterInfo:
        """As ``Client.unload_adapter``."""
        request = adapters_pb2.UnloadAdapterRequest(id=_convert.check_id("adapter id", adapter_id, allow_empty=False))
        adapters = self._open().adapters
        response: adapters_pb2.UnloadAdapterResponse = await self._call(adapters.UnloadAdapter, request, timeout)
        return _convert.to_adapter_info(response.adapter)

    async def list_adapters(self, *, timeout: float | None = None) -> list[AdapterInfo]:
        """As ``Client.list_adapters``."""
        adapters = self._open().adapters
        response: adapters_pb2.ListAdaptersResponse = await self._call(
            adapters.ListAdapters, adapters_pb2.ListAdaptersRequest(), timeout
        )
        return [_convert.to_adapter_info(a) for a in response.adapters]

    async def get_adapter(self, adapter_id: str, *, timeout: float | None = None) -> AdapterInfo:
        """As ``Client.get_adapter``."""
        request = adapters_pb2.GetAdapterRequest(id=_convert.check_id("adapter id", adapter_id, allow_empty=False))
        adapters = self._open().adapters
        response: adapters_pb2.GetAdapterResponse = await self._call(adapters.GetAdapter, request, timeout)
        return _convert.to_adapter_info(response.adapter)

    # ------------------------------------------------------------------------------- lifecycle

    async def health(self, service: str = "", *, timeout: float | None = None) -> HealthStatus:
        """As ``Client.health``."""
        status: HealthStatus = await self._call(self._open().health, service, timeout)
        return status

    async def close(self) -> None:
        """Close the channel (unless it was passed in). Calls in flight are cancelled."""
        if self._owns_channel and self._channel is not None:
            await self._channel.close()
            self._channel = None
            self._stubs = None

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.close()
