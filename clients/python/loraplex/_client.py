"""``Client``: the blocking client of a loraplex server (generation, tokenizer, model info, adapters).

Every method is one RPC; a failed RPC raises a ``LoraplexError`` subclass (see ``loraplex._errors``),
arguments the client can reject itself raise ``ValueError`` / ``TypeError`` before anything is sent.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Generator, Sequence
from typing import TypeVar, Unpack, overload

import grpc

from loraplex import _channel, _convert
from loraplex._base import ClientBase
from loraplex._channel import Metadata
from loraplex._closing import Closing
from loraplex._convert import GenerateOptions, Prompt
from loraplex._errors import from_rpc_error
from loraplex._stream import DeltaStream
from loraplex._types import AdapterInfo, Conversation, Delta, Generation, HealthStatus, ModelInfo, TokenizeResult
from loraplex.v1 import adapters_pb2, adapters_pb2_grpc, generation_pb2, generation_pb2_grpc

_Response = TypeVar("_Response")


class Client(Closing, ClientBase[grpc.Channel]):
    """Blocking client. Thread-safe: one client (one channel) can serve many threads.

    ``target``: "host:port", or e.g. "dns:///loraplex-headless.ns.svc:50051" with
    ``load_balancing="round_robin"`` to spread calls over every replica behind a headless Service.
    ``timeout``: default deadline in seconds for every call (None = none); a call's own ``timeout=``
    wins. ``metadata``: (key, value) pairs sent with every call. ``api_key``: sent as
    ``authorization: Bearer <key>``. ``tls_ca``: TLS, trusting the CA in this PEM file (default: the
    system's roots when ``tls_cert`` is given); ``tls_cert`` + ``tls_key``: a client certificate for
    mutual TLS (PEM files). ``credentials``: any gRPC channel credentials instead (default: plaintext).
    ``options``: extra gRPC channel arguments (message size limits default to
    ``DEFAULT_MAX_MESSAGE_BYTES``, like the server's). ``channel``: use this channel instead of making
    one (then ``target``, the TLS arguments, ``load_balancing`` and ``options`` must be left out, and
    ``close`` leaves the channel open).

    ``retry``: a ``RetryPolicy`` (default: 4 attempts, backoff from 0.2 s up to 5 s) for calls the
    server refused with UNAVAILABLE or RESOURCE_EXHAUSTED before answering (loading, draining, queue
    full), on the idempotent methods only (not ``load_adapter`` / ``unload_adapter``); gRPC retries
    them itself, within each call's deadline. None = no retries. It is part of the channel the client
    makes (a ``channel=`` passed in keeps its own service config). ``wait_for_ready``: a call made
    while the server cannot be reached waits for it (up to the call's deadline: give a ``timeout``)
    instead of failing with UNAVAILABLE at once.

    Every generation call sends the adapter id as the ``x-loraplex-adapter`` request header (empty
    for the base model), so a proxy can route each adapter to the replicas where it is hot.
    """

    def _setup(self, channel: grpc.Channel | None) -> None:
        if channel is not None:
            self._channel = channel
        elif self._credentials is None:
            self._channel = grpc.insecure_channel(self._target, options=self._options)
        else:
            self._channel = grpc.secure_channel(self._target, self._credentials, options=self._options)
        self._generation = generation_pb2_grpc.GenerationStub(self._channel)
        self._adapters = adapters_pb2_grpc.AdaptersStub(self._channel)
        self._health = _channel.health_check(self._channel)

    # --------------------------------------------------------------------------------- plumbing

    def _call(
        self,
        method: Callable[..., _Response],
        request: object,
        timeout: float | None,
        metadata: Metadata | None = None,
    ) -> _Response:
        deadline = self._deadline(timeout)
        try:
            return method(
                request, timeout=deadline, metadata=metadata or self._metadata, wait_for_ready=self._wait_for_ready
            )
        except grpc.RpcError as error:
            raise from_rpc_error(error) from error

    # ------------------------------------------------------------------------------- generation

    @overload
    def generate(  # type: ignore[overload-overlap]  # a str is also a Sequence[str]; it matches here first
        self, prompt: str | Conversation, *, timeout: float | None = None, **options: Unpack[GenerateOptions]
    ) -> Generation: ...

    @overload
    def generate(
        self, prompt: Sequence[Prompt], *, timeout: float | None = None, **options: Unpack[GenerateOptions]
    ) -> list[Generation]: ...

    def generate(
        self, prompt: Prompt | Sequence[Prompt], *, timeout: float | None = None, **options: Unpack[GenerateOptions]
    ) -> Generation | list[Generation]:
        """Generate a completion for one prompt, or for each prompt of a list (batched on the server).

        ``prompt``: a str; a conversation (a list of ``ChatMessage`` or {"role", "content"} dicts);
        or a list of those, answered in order with a list of ``Generation``. Keyword options are
        described in ``GenerateOptions`` (adapter, sampling, max_new_tokens, stop, chat, ...).
        """
        opts = _convert.generation_options(**options)
        inputs, single = _convert.build_inputs(prompt, chat=opts.chat)
        request = _convert.generate_request(inputs, opts)
        response: generation_pb2.GenerateResponse = self._call(
            self._generation.Generate, request, timeout, _channel.with_adapter(self._metadata, opts.adapter_id)
        )
        return _convert.generations_of(response, len(inputs), single=single)

    def stream(
        self, prompt: Prompt, *, timeout: float | None = None, **options: Unpack[GenerateOptions]
    ) -> DeltaStream:
        """Generate for one prompt and yield ``Delta``s as tokens arrive; the last has ``is_last``.

        Arguments are checked here, before any RPC; the call starts on the first iteration. Use it in a
        ``for`` loop, or as ``with client.stream(...) as deltas:``: leaving the block, breaking out of
        the loop early or calling ``.close()`` cancels the request on the server.
        """
        opts = _convert.generation_options(**options)
        request = _convert.stream_request(_convert.build_input(prompt, chat=opts.chat), opts)
        deadline = self._deadline(timeout)
        return DeltaStream(self._deltas(request, deadline, _channel.with_adapter(self._metadata, opts.adapter_id)))

    def _deltas(
        self, request: generation_pb2.GenerateStreamRequest, deadline: float | None, metadata: Metadata
    ) -> Generator[Delta, None, None]:
        call = self._generation.GenerateStream(
            request, timeout=deadline, metadata=metadata, wait_for_ready=self._wait_for_ready
        )
        try:
            for message in call:
                yield _convert.to_delta(message)
        except grpc.RpcError as error:
            raise from_rpc_error(error) from error
        finally:
            call.cancel()  # a no-op once the call has finished

    def tokenize(self, text: Prompt, *, chat: bool = False, timeout: float | None = None) -> TokenizeResult:
        """Token ids of a prompt exactly as generation sees it (``chat`` as in ``generate``)."""
        request = generation_pb2.TokenizeRequest(input=_convert.build_input(text, chat=chat))
        response: generation_pb2.TokenizeResponse = self._call(self._generation.Tokenize, request, timeout)
        return _convert.to_tokenize_result(response)

    def model_info(self, *, timeout: float | None = None) -> ModelInfo:
        """The served model, the server's limits and features."""
        response: generation_pb2.ModelInfoResponse = self._call(
            self._generation.ModelInfo, generation_pb2.ModelInfoRequest(), timeout
        )
        return _convert.to_model_info(response)

    # --------------------------------------------------------------------------------- adapters

    def load_adapter(
        self, adapter_id: str, source: str | os.PathLike[str], *, timeout: float | None = None
    ) -> AdapterInfo:
        """Register ``source`` as ``adapter_id``: an adapter folder's path on the server, or
        ``"hf://org/name[@revision]"``, a snapshot in the server's local Hugging Face cache (never downloaded;
        ``NotFound`` names the paths looked up). Either must lie inside the server's allowed adapter roots.

        Only its config and headers are read now; weights load lazily on first use. The result's ``source`` is
        ``source`` as given, its ``resolved_path`` the folder the server reads.
        """
        request = _convert.load_adapter_request(adapter_id, os.fspath(source))
        response: adapters_pb2.LoadAdapterResponse = self._call(self._adapters.LoadAdapter, request, timeout)
        return _convert.to_adapter_info(response.adapter)

    def unload_adapter(self, adapter_id: str, *, timeout: float | None = None) -> AdapterInfo:
        """Remove an adapter: refused (``FailedPrecondition``, nothing removed) while requests use it. Returns what
        happened: its description with state ``UNLOADED`` and nothing resident (hits, source... as they were)."""
        request = adapters_pb2.UnloadAdapterRequest(id=_convert.check_id("adapter id", adapter_id, allow_empty=False))
        response: adapters_pb2.UnloadAdapterResponse = self._call(self._adapters.UnloadAdapter, request, timeout)
        return _convert.to_adapter_info(response.adapter)

    def list_adapters(self, *, timeout: float | None = None) -> list[AdapterInfo]:
        """Every registered adapter, sorted by id."""
        response: adapters_pb2.ListAdaptersResponse = self._call(
            self._adapters.ListAdapters, adapters_pb2.ListAdaptersRequest(), timeout
        )
        return [_convert.to_adapter_info(a) for a in response.adapters]

    def get_adapter(self, adapter_id: str, *, timeout: float | None = None) -> AdapterInfo:
        """One adapter's state: tiers, bytes, hits, last use, load latency."""
        request = adapters_pb2.GetAdapterRequest(id=_convert.check_id("adapter id", adapter_id, allow_empty=False))
        response: adapters_pb2.GetAdapterResponse = self._call(self._adapters.GetAdapter, request, timeout)
        return _convert.to_adapter_info(response.adapter)

    # ------------------------------------------------------------------------------- lifecycle

    def health(self, service: str = "", *, timeout: float | None = None) -> HealthStatus:
        """grpc.health.v1 Check: SERVING once the model is ready, NOT_SERVING while loading or draining.

        ``service`` "" asks about the server as a whole. A server without the health service raises
        ``Unimplemented``.
        """
        status: HealthStatus = self._call(self._health, service, timeout)
        return status

    def close(self) -> None:
        """Close the channel (unless it was passed in). Calls in flight are cancelled."""
        if self._owns_channel:
            self._channel.close()
