"""Every error status carries one ``google.rpc.ErrorInfo`` (domain ``loraplex``): its reason and the error's
structured fields, over real loopback gRPC from a real server (tiny random Llama, SmolLM2's tokenizer, a real PEFT
adapter written by peft and then damaged on disk). Read here with grpcio-status, as any gRPC client can; the
Python client's own reading is tested in tests/client/test_client_errors.py."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import grpc
import loraplex
import pytest
import torch
from google.rpc import error_details_pb2
from grpc_status import rpc_status
from loraplex.v1 import adapters_pb2, adapters_pb2_grpc
from loraplex.v1 import generation_pb2 as pb
from loraplex.v1 import generation_pb2_grpc as pb_grpc
from support.adapter_files import rewrite_adapter_tensors, write_peft_adapter

from service.api.server import BackgroundServer
from service.engine.sampling import SamplingParams
from service.errors import AdapterNotFound, CheckpointError, InvalidRequest, QueueFull

ONE_TOKEN = pb.StoppingCriteria(max_new_tokens=1, ignore_eos=True)


@pytest.fixture(scope="module")
def adapter_root(tmp_path_factory: pytest.TempPathFactory, served_tiny_dir: Path) -> Path:
    root = tmp_path_factory.mktemp("detail_adapters")
    write_peft_adapter(root / "good", served_tiny_dir, r=4, alpha=8)
    bad = write_peft_adapter(root / "misshaped", served_tiny_dir, r=4, alpha=8)
    name = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"

    def widen(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        tensors[name] = torch.zeros(4, tensors[name].shape[1] + 1)
        return tensors

    rewrite_adapter_tensors(bad, widen)
    return root


@pytest.fixture(scope="module")
def server_settings(adapter_root: Path) -> dict[str, object]:
    return {
        "max_batch_size": 4,
        "max_prompt_tokens": 64,
        "max_new_tokens": 8,
        "max_total_tokens": 128,
        "max_stop_sequences": 2,
        "adapter_roots": (adapter_root,),
    }


@pytest.fixture(scope="module")
def target(server: BackgroundServer) -> str:
    return server.target


@pytest.fixture(scope="module")
def channel(target: str) -> Iterator[grpc.Channel]:
    with grpc.insecure_channel(target) as ch:
        yield ch


def error_info(error: grpc.RpcError) -> error_details_pb2.ErrorInfo:
    """The one ErrorInfo of a failed call's ``grpc-status-details-bin`` (grpcio-status checks code and message)."""
    status = rpc_status.from_call(error)  # type: ignore[arg-type]
    assert status is not None, "no grpc-status-details-bin trailer"
    assert status.code == error.code().value[0] and status.message == error.details()  # type: ignore[attr-defined]
    (detail,) = status.details
    info = error_details_pb2.ErrorInfo()
    assert detail.Unpack(info)
    assert info.domain == "loraplex"
    return info


def failed(call: object, *args: object) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as err:
        result = call(*args, timeout=60)  # type: ignore[operator]
        if isinstance(result, Iterator):  # a server stream fails on its first read
            list(result)
    return err.value


def test_unknown_adapter_names_it(channel: grpc.Channel) -> None:
    stub = pb_grpc.GenerationStub(channel)
    request = pb.GenerateRequest(inputs=[pb.Input(text="hi")], adapter_id="ghost", stopping=ONE_TOKEN)
    error = failed(stub.Generate, request)
    assert error.code() == grpc.StatusCode.NOT_FOUND  # type: ignore[attr-defined]
    info = error_info(error)
    assert info.reason == "ADAPTER_NOT_FOUND" and dict(info.metadata) == {"adapter_id": "ghost"}
    get = failed(adapters_pb2_grpc.AdaptersStub(channel).GetAdapter, adapters_pb2.GetAdapterRequest(id="gone"))
    assert dict(error_info(get).metadata) == {"adapter_id": "gone"}


@pytest.mark.parametrize(
    ("request_", "field", "limit"),
    [
        (pb.GenerateStreamRequest(input=pb.Input(text="hi"), sampling=pb.SamplingParams(top_p=2.0)),
         "sampling.top_p", None),
        (pb.GenerateStreamRequest(input=pb.Input(text="hi"), sampling=pb.SamplingParams(temperature=-1.0)),
         "sampling.temperature", None),
        (pb.GenerateStreamRequest(input=pb.Input(text="hi"), stopping=pb.StoppingCriteria(max_new_tokens=9)),
         "stopping.max_new_tokens", "8"),
        (pb.GenerateStreamRequest(input=pb.Input(text="hi"), stopping=pb.StoppingCriteria(stop_sequences=["a"] * 3)),
         "stopping.stop_sequences", "2"),
        (pb.GenerateStreamRequest(input=pb.Input(text="hi"), request_id="has space"), "request_id", "128"),
        (pb.GenerateStreamRequest(input=pb.Input(text="")), "input.text", None),
    ],
)  # fmt: skip
def test_invalid_argument_names_the_field(
    channel: grpc.Channel, request_: pb.GenerateStreamRequest, field: str, limit: str | None
) -> None:
    error = failed(pb_grpc.GenerationStub(channel).GenerateStream, request_)
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT  # type: ignore[attr-defined]
    info = error_info(error)
    assert info.reason == "INVALID_REQUEST"
    assert dict(info.metadata) == {"field": field, **({"limit": limit} if limit is not None else {})}


def test_the_input_index_is_part_of_the_field(channel: grpc.Channel) -> None:
    request = pb.GenerateRequest(inputs=[pb.Input(text="ok"), pb.Input(text="x" * 70_000)], stopping=ONE_TOKEN)
    info = error_info(failed(pb_grpc.GenerationStub(channel).Generate, request))
    assert info.metadata["field"] == "inputs[1].text" and int(info.metadata["limit"]) < 70_000


def test_checkpoint_errors_name_file_and_tensor(channel: grpc.Channel, adapter_root: Path) -> None:
    stub = adapters_pb2_grpc.AdaptersStub(channel)
    request = adapters_pb2.LoadAdapterRequest(id="bad", source=str(adapter_root / "misshaped"))
    error = failed(stub.LoadAdapter, request)
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT  # type: ignore[attr-defined]
    info = error_info(error)
    assert info.reason == "INVALID_ADAPTER"
    assert info.metadata["file"].endswith("misshaped/adapter_model.safetensors")
    assert info.metadata["tensor"] == "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"
    ok = stub.LoadAdapter(adapters_pb2.LoadAdapterRequest(id="good", source=str(adapter_root / "good")), timeout=60)
    assert ok.adapter.id == "good"  # a refused adapter harms nothing


def test_malformed_bytes_have_their_own_reason(channel: grpc.Channel) -> None:
    call = channel.unary_unary("/loraplex.v1.Generation/Tokenize", request_serializer=None, response_deserializer=None)
    info = error_info(failed(call, b"\x08\xff\xff"))
    assert info.reason == "MALFORMED_REQUEST" and dict(info.metadata) == {}


def test_error_classes_know_reason_and_fields() -> None:
    assert AdapterNotFound("a").reason == "ADAPTER_NOT_FOUND"
    assert AdapterNotFound("a" * 1000).details()["adapter_id"].endswith("[800 more characters]")
    assert QueueFull("full").reason == "QUEUE_FULL" and QueueFull("full").details() == {}
    assert InvalidRequest("bad", field="sampling.top_p").details() == {"field": "sampling.top_p"}
    assert CheckpointError("x", file=Path("/m/a.safetensors"), tensor="w").details() == {
        "file": "/m/a.safetensors",
        "tensor": "w",
    }


def test_sampling_is_validated_once_per_input(channel: grpc.Channel, monkeypatch: pytest.MonkeyPatch) -> None:
    """Validation happens once, where protobuf becomes domain types (it ran four times per Generate before)."""
    calls: list[SamplingParams] = []
    real = SamplingParams.validate

    def counted(self: SamplingParams) -> None:
        calls.append(self)
        real(self)

    monkeypatch.setattr(SamplingParams, "validate", counted)
    stub = pb_grpc.GenerationStub(channel)
    sampling = pb.SamplingParams(temperature=0.7, seed=5)
    stub.Generate(pb.GenerateRequest(inputs=[pb.Input(text="a")], sampling=sampling, stopping=ONE_TOKEN), timeout=60)
    assert len(calls) == 1
    two = pb.GenerateRequest(inputs=[pb.Input(text="a"), pb.Input(text="b")], sampling=sampling, stopping=ONE_TOKEN)
    stub.Generate(two, timeout=60)
    assert [p.seed for p in calls[1:]] == [5, 6]  # one per input, each with its own seed
    list(stub.GenerateStream(pb.GenerateStreamRequest(input=pb.Input(text="a"), stopping=ONE_TOKEN), timeout=60))
    assert len(calls) == 4


def test_the_python_clients_expose_reason_and_fields(target: str, adapter_root: Path) -> None:
    with loraplex.Client(target, timeout=60) as client:
        with pytest.raises(loraplex.NotFound) as missing:
            client.generate("hi", adapter="ghost", max_new_tokens=1)
        assert missing.value.reason == "ADAPTER_NOT_FOUND" and missing.value.domain == "loraplex"
        assert dict(missing.value.details) == {"adapter_id": "ghost"}
        with pytest.raises(loraplex.InvalidArgument) as bad:
            client.load_adapter("bad", adapter_root / "misshaped")
        assert bad.value.reason == "INVALID_ADAPTER"
        assert bad.value.details["tensor"].endswith("q_proj.lora_A.weight")

    async def stream_too_long() -> loraplex.LoraplexError:
        async with loraplex.AsyncClient(target, timeout=60) as client:
            with pytest.raises(loraplex.InvalidArgument) as err:
                async for _ in client.stream("hi", max_new_tokens=1, stop=["a", "b", "c"]):
                    pass
            return err.value

    error = asyncio.run(stream_too_long())
    assert error.reason == "INVALID_REQUEST"
    assert dict(error.details) == {"field": "stopping.stop_sequences", "limit": "2"}
