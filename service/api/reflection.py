"""gRPC server reflection, ``grpc.reflection.v1`` and ``grpc.reflection.v1alpha``, with the protos' comments.

grpcio-reflection's servicer answers from ``FileDescriptor.CopyToProto``, which drops source info, and serves only
``v1alpha``. This one answers file requests with the ``FileDescriptorProto``s as protoc wrote them: the loraplex
files come from ``loraplex/v1/descriptors.binpb`` (``make proto``, ``--include_source_info``), so ``grpcurl
describe`` shows their comments; the health and reflection files (which ship without source info) are added from
their generated modules. ``v1`` is ``v1alpha`` under another package name, field for field (the upstream protos
are identical on the wire), so one servicer answers both: its ``v1`` file is derived from the ``v1alpha`` one.

Invariant: every file named in a reply's dependencies is in the same reply (clients need no second round trip),
and a lookup that fails is an ``error_response`` with NOT_FOUND, never a failed call.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterable
from importlib import resources
from typing import Any

import grpc
from google.protobuf import descriptor_pb2, descriptor_pool, text_format
from grpc_reflection.v1alpha import reflection_pb2 as pb

DESCRIPTOR_SET = "descriptors.binpb"
V1ALPHA_SERVICE = "grpc.reflection.v1alpha.ServerReflection"
V1_SERVICE = "grpc.reflection.v1.ServerReflection"
METHOD = "ServerReflectionInfo"


def loraplex_files() -> list[descriptor_pb2.FileDescriptorProto]:
    """The loraplex protos and their imports, with source info, as ``make proto`` wrote them."""
    data = (resources.files("loraplex.v1") / DESCRIPTOR_SET).read_bytes()
    return list(descriptor_pb2.FileDescriptorSet.FromString(data).file)


def _proto_of(module: Any) -> descriptor_pb2.FileDescriptorProto:
    proto = descriptor_pb2.FileDescriptorProto()
    module.DESCRIPTOR.CopyToProto(proto)
    return proto


def v1_reflection_file() -> descriptor_pb2.FileDescriptorProto:
    """``grpc/reflection/v1/reflection.proto``: the v1alpha file with the package renamed throughout."""
    text = text_format.MessageToString(_proto_of(pb)).replace("grpc.reflection.v1alpha", "grpc.reflection.v1")
    proto = text_format.Parse(text, descriptor_pb2.FileDescriptorProto())
    proto.name = "grpc/reflection/v1/reflection.proto"
    return proto


class Descriptors:
    """File protos by name, and a pool over them to find which file defines a symbol or an extension."""

    def __init__(self, files: Iterable[descriptor_pb2.FileDescriptorProto]) -> None:
        self.files: dict[str, descriptor_pb2.FileDescriptorProto] = {}
        self.pool = descriptor_pool.DescriptorPool()
        for proto in files:
            if proto.name not in self.files:  # a shared import (timestamp.proto) comes once
                self.files[proto.name] = proto
                self.pool.Add(proto)

    @classmethod
    def for_server(cls, health_module: Any) -> Descriptors:
        """The loraplex files, then the health and both reflection files."""
        return cls([*loraplex_files(), _proto_of(health_module), _proto_of(pb), v1_reflection_file()])

    def with_dependencies(self, name: str) -> list[bytes]:
        """``name``'s serialized proto, then each file it imports, transitively, each once."""
        order: list[str] = []
        pending = [name]
        while pending:
            current = pending.pop()
            if current in order:
                continue
            order.append(current)
            pending.extend(self.files[current].dependency)
        return [self.files[n].SerializeToString() for n in order]


class ReflectionServicer:
    """Answers ``ServerReflectionInfo`` streams (v1 and v1alpha alike) for ``services`` from ``descriptors``."""

    def __init__(self, services: Iterable[str], descriptors: Descriptors) -> None:
        self.services = tuple(sorted(services))
        self.descriptors = descriptors

    async def ServerReflectionInfo(
        self, requests: AsyncIterator[pb.ServerReflectionRequest], context: Any
    ) -> AsyncIterator[pb.ServerReflectionResponse]:
        async for request in requests:
            yield self.answer(request)

    def answer(self, request: pb.ServerReflectionRequest) -> pb.ServerReflectionResponse:
        kind = request.WhichOneof("message_request")
        reply = pb.ServerReflectionResponse(original_request=request)
        try:
            if kind == "list_services":
                reply.list_services_response.service.extend(pb.ServiceResponse(name=n) for n in self.services)
            elif kind == "file_by_filename":
                self._files(reply, request.file_by_filename)
            elif kind == "file_containing_symbol":
                self._files(reply, self.descriptors.pool.FindFileContainingSymbol(request.file_containing_symbol).name)
            elif kind == "file_containing_extension":
                ask = request.file_containing_extension
                message = self.descriptors.pool.FindMessageTypeByName(ask.containing_type)
                extension = self.descriptors.pool.FindExtensionByNumber(message, ask.extension_number)
                self._files(reply, self.descriptors.pool.FindFileContainingSymbol(extension.full_name).name)
            elif kind == "all_extension_numbers_of_type":
                message = self.descriptors.pool.FindMessageTypeByName(request.all_extension_numbers_of_type)
                numbers = sorted(e.number for e in self.descriptors.pool.FindAllExtensions(message))
                reply.all_extension_numbers_response.base_type_name = message.full_name
                reply.all_extension_numbers_response.extension_number.extend(numbers)
            else:
                return _error(request, grpc.StatusCode.INVALID_ARGUMENT, "no request in the message")
        except KeyError:
            return _error(request, grpc.StatusCode.NOT_FOUND, "not found")
        return reply

    def _files(self, reply: pb.ServerReflectionResponse, name: str) -> None:
        if name not in self.descriptors.files:
            raise KeyError(name)
        reply.file_descriptor_response.file_descriptor_proto.extend(self.descriptors.with_dependencies(name))


def _error(request: pb.ServerReflectionRequest, code: grpc.StatusCode, message: str) -> pb.ServerReflectionResponse:
    return pb.ServerReflectionResponse(
        original_request=request,
        error_response=pb.ErrorResponse(error_code=code.value[0], error_message=f"{code.name}: {message}"),
    )


def add_to_server(server: grpc.aio.Server, services: Iterable[str], health_module: Any) -> tuple[str, ...]:
    """Serve reflection under both names for ``services`` and the reflection services themselves; returns every
    service name reflection lists."""
    names = (*services, V1_SERVICE, V1ALPHA_SERVICE)
    servicer = ReflectionServicer(names, Descriptors.for_server(health_module))
    handler = grpc.stream_stream_rpc_method_handler(
        servicer.ServerReflectionInfo,
        request_deserializer=pb.ServerReflectionRequest.FromString,
        response_serializer=pb.ServerReflectionResponse.SerializeToString,
    )
    server.add_generic_rpc_handlers(
        [grpc.method_handlers_generic_handler(service, {METHOD: handler}) for service in (V1_SERVICE, V1ALPHA_SERVICE)]
    )
    return servicer.services
