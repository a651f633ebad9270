"""The `loraplex.v1.Generation` servicer: thin methods that translate protobuf to the frontend's domain and back.

Each generation method turns its request into a ``GenerationCall`` (``convert.call_of``), runs it on the
frontend (``service.frontend.Frontend``: checks, tokenization off the loop, submission) and turns completions or
events back into replies; ``convert.grpc_fields`` names a refused field by its path in the request message. Auth,
error statuses, metrics and the access line are the interceptors' (``service.api.interceptors``, through the call
observer): a method raises typed errors and never builds a status or counts a request itself.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import AsyncGenerator, AsyncIterator
from dataclasses import replace

from loraplex.v1 import generation_pb2 as pb
from loraplex.v1 import generation_pb2_grpc as pb_grpc

from service import __version__
from service.api import convert
from service.api.runtime import Runtime
from service.api.status import Context
from service.frontend import Frontend
from service.logs import new_request_id

LIMIT_FIELDS = tuple(pb.Limits.DESCRIPTOR.fields_by_name)
"""``ModelInfo.limits``: each field of the message is the ``Settings`` field of the same name."""


class GenerationServicer(pb_grpc.GenerationServicer):
    def __init__(self, runtime: Runtime, frontend: Frontend) -> None:
        self.runtime = runtime
        self.frontend = frontend

    def _deadline(self, context: Context) -> float | None:
        remaining = context.time_remaining()
        return None if remaining is None else time.monotonic() + remaining

    async def Generate(self, request: pb.GenerateRequest, context: Context) -> pb.GenerateResponse:
        with convert.grpc_fields(stream=False):
            generated = await self.frontend.generate(convert.call_of(request, deadline=self._deadline(context)))
        results = [convert.result_of(c, request.return_options) for c in generated.completions]
        return pb.GenerateResponse(results=results, request_id=generated.request_id)

    async def GenerateStream(
        self, request: pb.GenerateStreamRequest, context: Context
    ) -> AsyncIterator[pb.GenerateStreamResponse]:
        async with contextlib.aclosing(self._stream(request, self._deadline(context))) as responses:
            async for response in responses:
                yield response

    async def _stream(
        self, request: pb.GenerateStreamRequest, deadline: float | None
    ) -> AsyncGenerator[pb.GenerateStreamResponse, None]:
        request_id = request.request_id or new_request_id()  # the access interceptor's, unless called directly
        first = True
        with convert.grpc_fields(stream=True):
            call = replace(convert.call_of(request, deadline=deadline), request_id=request_id)
            async with contextlib.aclosing(self.frontend.stream(call)) as events:
                async for event in events:
                    response = convert.stream_response(event, request.return_options)
                    if first:
                        response.request_id = request_id
                        first = False
                    yield response

    async def Tokenize(self, request: pb.TokenizeRequest, context: Context) -> pb.TokenizeResponse:
        with convert.grpc_fields(stream=False):
            tokenized = await self.frontend.tokenize(convert.input_of(request.input))
        return convert.tokenize_response(tokenized)

    async def ModelInfo(self, request: pb.ModelInfoRequest, context: Context) -> pb.ModelInfoResponse:
        rt = self.runtime.ready()
        s = rt.settings
        cfg = rt.model_config
        features = ["lora", "medusa", "logprobs", "stop_sequences", "seed"]
        if rt.tokenizer.has_chat_template:
            features.append("chat_template")
        if rt.grammars is not None:
            features.append("constraints")  # GenerateRequest.constraint is served
        return pb.ModelInfoResponse(
            model_name=s.model.resolve().name,
            model_path=str(s.model),
            architecture=cfg.architecture,
            dtype=rt.dtype,
            device=str(rt.device),
            vocab_size=cfg.vocab_size,
            context_length=cfg.max_position_embeddings,
            limits=pb.Limits(**{name: getattr(s, name) for name in LIMIT_FIELDS}),
            features=features,
            server_version=__version__,
            load_mode=rt.load_mode,
            load_seconds=rt.load_seconds,
            eos_token_ids=sorted(rt.engine.eos_ids),
            cpu_capability=rt.self_check.capability,
            weights=rt.weights,
            compute_paths=[
                pb.ComputePath(path=c.path, kernel=c.kernel, error=c.error, tolerance=c.tolerance, status=c.status)
                for c in rt.self_check.checks
            ],
        )
