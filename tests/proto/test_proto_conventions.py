"""API conventions of proto/loraplex/v1 that protoc does not enforce, read from protoc's own descriptors
(with source info): package and file layout, enums with an UNSPECIFIED zero and prefixed values, field
numbers 1000+ reserved in every message, and a comment on every service, RPC, message, field, enum
and enum value."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from google.protobuf import descriptor_pb2
from support.paths import ROOT

PROTO_ROOT = ROOT / "proto"
PROTOS = sorted((PROTO_ROOT / "loraplex" / "v1").glob("*.proto"))
FIELD_MAX = 536_870_911  # 2**29 - 1, protobuf's largest field number

# FileDescriptorProto / DescriptorProto / ServiceDescriptorProto / EnumDescriptorProto field numbers,
# which are what a SourceCodeInfo location path is made of.
FILE_MESSAGE, FILE_ENUM, FILE_SERVICE = 4, 5, 6
MESSAGE_FIELD, MESSAGE_NESTED, MESSAGE_ENUM = 2, 3, 4
SERVICE_METHOD, ENUM_VALUE = 2, 2


def _descriptor_set(tmp_path: Path) -> descriptor_pb2.FileDescriptorSet:
    protoc = pytest.importorskip("grpc_tools.protoc")
    out = tmp_path / "set.pb"
    well_known = Path(protoc.__file__).resolve().parent / "_proto"
    args = [
        "protoc",
        f"-I{PROTO_ROOT}",
        f"-I{well_known}",
        "--include_source_info",
        f"--descriptor_set_out={out}",
        *(p.relative_to(PROTO_ROOT).as_posix() for p in PROTOS),
    ]
    assert protoc.main(args) == 0
    return descriptor_pb2.FileDescriptorSet.FromString(out.read_bytes())


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> list[descriptor_pb2.FileDescriptorProto]:
    return list(_descriptor_set(tmp_path_factory.mktemp("proto")).file)


def _messages(
    messages: list[descriptor_pb2.DescriptorProto], path: tuple[int, ...], prefix: str
) -> Iterator[tuple[str, tuple[int, ...], descriptor_pb2.DescriptorProto]]:
    for i, message in enumerate(messages):
        here = (*path, i)
        yield f"{prefix}{message.name}", here, message
        yield from _messages(list(message.nested_type), (*here, MESSAGE_NESTED), f"{prefix}{message.name}.")


def _elements(file: descriptor_pb2.FileDescriptorProto) -> Iterator[tuple[str, tuple[int, ...]]]:
    """(name, source path) of every element that must carry a comment."""
    for service_index, service in enumerate(file.service):
        yield service.name, (FILE_SERVICE, service_index)
        for i, method in enumerate(service.method):
            yield f"{service.name}.{method.name}", (FILE_SERVICE, service_index, SERVICE_METHOD, i)
    enums: list[tuple[str, tuple[int, ...], descriptor_pb2.EnumDescriptorProto]]
    enums = [(e.name, (FILE_ENUM, i), e) for i, e in enumerate(file.enum_type)]
    for name, path, message in _messages(list(file.message_type), (FILE_MESSAGE,), ""):
        yield name, path
        for i, field in enumerate(message.field):
            yield f"{name}.{field.name}", (*path, MESSAGE_FIELD, i)
        enums += [(f"{name}.{e.name}", (*path, MESSAGE_ENUM, i), e) for i, e in enumerate(message.enum_type)]
    for name, path, enum in enums:
        yield name, path
        for i, value in enumerate(enum.value):
            yield f"{name}.{value.name}", (*path, ENUM_VALUE, i)


def test_layout(files: list[descriptor_pb2.FileDescriptorProto]) -> None:
    assert {f.name for f in files} >= {"loraplex/v1/generation.proto", "loraplex/v1/adapters.proto"}
    for file in files:
        assert file.package == "loraplex.v1", file.name
        assert file.syntax == "proto3", file.name
    services = {s.name for f in files for s in f.service}
    assert services == {"Generation", "Adapters"}


def test_every_element_is_commented(files: list[descriptor_pb2.FileDescriptorProto]) -> None:
    missing = []
    for file in files:
        comments = {
            tuple(loc.path): loc.leading_comments.strip() or loc.trailing_comments.strip()
            for loc in file.source_code_info.location
        }
        missing += [f"{file.name}: {name}" for name, path in _elements(file) if not comments.get(path)]
    assert not missing, "uncommented: " + ", ".join(missing)


def test_enums_have_unspecified_zero_and_prefixed_values(files: list[descriptor_pb2.FileDescriptorProto]) -> None:
    enums = [e for f in files for e in f.enum_type]
    enums += [e for f in files for _, _, m in _messages(list(f.message_type), (), "") for e in m.enum_type]
    assert enums
    for enum in enums:
        prefix = "".join(f"_{c}" if c.isupper() else c.upper() for c in enum.name).lstrip("_") + "_"
        assert enum.value[0].number == 0 and enum.value[0].name == f"{prefix}UNSPECIFIED", enum.name
        for value in enum.value:
            assert value.name.startswith(prefix), value.name
        numbers = [v.number for v in enum.value]
        assert len(set(numbers)) == len(numbers), f"{enum.name} has aliases"


def test_every_message_reserves_1000_and_up(files: list[descriptor_pb2.FileDescriptorProto]) -> None:
    for file in files:
        for name, _, message in _messages(list(file.message_type), (), ""):
            # DescriptorProto.ReservedRange.end is exclusive.
            ranges = {(r.start, r.end) for r in message.reserved_range}
            assert (1000, FIELD_MAX + 1) in ranges, f"{file.name}: {name} lacks `reserved 1000 to max;`"
            assert all(field.number < 1000 for field in message.field), name


def test_optional_where_unset_differs_from_zero(files: list[descriptor_pb2.FileDescriptorProto]) -> None:
    fields = {
        f"{name}.{field.name}": field
        for file in files
        for name, _, message in _messages(list(file.message_type), (), "")
        for field in message.field
    }
    for name in (
        "SamplingParams.top_p",
        "SamplingParams.repetition_penalty",
        "SamplingParams.seed",
        "StoppingCriteria.max_new_tokens",
        "GenerateRequest.speculate",
        "GenerateStreamRequest.speculate",
    ):
        assert fields[name].proto3_optional, f"{name} must be `optional` (unset is not 0)"
    # The stream request mirrors the unary one field for field (names, numbers, types).
    unary = {n.split(".", 1)[1]: f for n, f in fields.items() if n.startswith("GenerateRequest.")}
    stream = {n.split(".", 1)[1]: f for n, f in fields.items() if n.startswith("GenerateStreamRequest.")}
    assert unary.pop("inputs").number == stream.pop("input").number == 1
    assert {k: (f.number, f.type) for k, f in unary.items()} == {k: (f.number, f.type) for k, f in stream.items()}
