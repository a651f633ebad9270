"""The client's pure parts: request messages built from keyword arguments, client-side argument checks,
metadata, the hand-written health codec (against grpcio-health-checking's generated messages) and the
conversion of response messages into the client's dataclasses."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

import grpc
import loraplex
import pytest
from google.protobuf import timestamp_pb2
from google.protobuf.message import DecodeError
from grpc_health.v1 import health_pb2
from loraplex import _channel, _convert
from loraplex.v1 import adapters_pb2, generation_pb2

pb = generation_pb2


def _options(**kwargs: Any) -> _convert.GenerationOptions:
    return _convert.generation_options(**kwargs)


def _request(prompt: Any, **kwargs: Any) -> tuple[pb.GenerateRequest, bool]:
    opts = _options(**kwargs)
    inputs, single = _convert.build_inputs(prompt, chat=opts.chat)
    return _convert.generate_request(inputs, opts), single


# ------------------------------------------------------------------------------------------ prompts


def test_single_text_prompt_defaults_to_greedy_and_unset_optionals() -> None:
    request, single = _request("Hello")
    assert single
    expected = pb.GenerateRequest(
        inputs=[pb.Input(text="Hello")],
        sampling=pb.SamplingParams(),
        stopping=pb.StoppingCriteria(),
        return_options=pb.ReturnOptions(),
    )
    assert request == expected
    assert request.SerializeToString(deterministic=True) == expected.SerializeToString(deterministic=True)
    for name in ("top_p", "repetition_penalty", "seed"):
        assert not request.sampling.HasField(name)
    assert not request.stopping.HasField("max_new_tokens")
    assert not request.HasField("speculate")


def test_batch_of_texts_and_conversations_keeps_order() -> None:
    conversation = [{"role": "system", "content": "Be brief."}, loraplex.ChatMessage("user", "Hi")]
    request, single = _request(["a", conversation, "b"], chat=True)
    assert not single
    messages = pb.ChatMessages(
        messages=[pb.ChatMessage(role="system", content="Be brief."), pb.ChatMessage(role="user", content="Hi")]
    )
    assert list(request.inputs) == [
        pb.Input(text="a", chat=True),
        pb.Input(messages=messages),
        pb.Input(text="b", chat=True),
    ]
    assert [i.WhichOneof("kind") for i in request.inputs] == ["text", "messages", "text"]


def test_a_list_of_messages_is_one_conversation() -> None:
    request, single = _request([{"role": "user", "content": "Hi"}])
    assert single
    assert len(request.inputs) == 1
    assert request.inputs[0].messages.messages[0] == pb.ChatMessage(role="user", content="Hi")


@pytest.mark.parametrize(
    ("prompt", "error"),
    [
        ([], ValueError),  # no prompts
        (b"bytes", TypeError),
        (42, TypeError),
        ({"role": "user", "content": "x"}, TypeError),  # a message must be wrapped in a list
        ([{"role": "user"}], ValueError),  # no content
        ([{"role": "", "content": "x"}], ValueError),
        ([{"role": "user", "content": 3}], TypeError),
        (["ok", []], ValueError),  # an empty conversation inside a batch
        (["ok", 3], TypeError),
    ],
)
def test_bad_prompts_are_rejected_before_sending(prompt: Any, error: type[Exception]) -> None:
    with pytest.raises(error):
        _request(prompt)


# ------------------------------------------------------------------------------------------ options


def test_every_option_lands_in_its_field() -> None:
    request, _ = _request(
        "x",
        adapter="sql-lora",
        temperature=0.7,
        top_k=40,
        top_p=0.9,
        repetition_penalty=1.1,
        seed=2**64 - 1,
        max_new_tokens=16,
        stop=["\n\n", "###"],
        ignore_eos=True,
        speculate=False,
        return_token_ids=True,
        return_logprobs=True,
        request_id="req-1",
    )
    expected = pb.GenerateRequest(
        inputs=[pb.Input(text="x")],
        adapter_id="sql-lora",
        sampling=pb.SamplingParams(temperature=0.7, top_k=40, top_p=0.9, repetition_penalty=1.1, seed=2**64 - 1),
        stopping=pb.StoppingCriteria(max_new_tokens=16, stop_sequences=["\n\n", "###"], ignore_eos=True),
        return_options=pb.ReturnOptions(return_token_ids=True, return_logprobs=True),
        speculate=False,
        request_id="req-1",
    )
    assert request == expected
    assert request.HasField("speculate") and request.speculate is False


def test_keywords_override_a_sampling_params_object() -> None:
    base = loraplex.SamplingParams(temperature=0.8, top_k=50, top_p=0.95, seed=7)
    opts = _options(sampling=base, top_k=5, seed=9)
    assert opts.sampling == pb.SamplingParams(temperature=0.8, top_k=5, top_p=0.95, seed=9)
    assert not opts.sampling.HasField("repetition_penalty")


def test_single_stop_string_and_stream_request_share_fields() -> None:
    opts = _options(stop="END", adapter="a", max_new_tokens=3)
    request = _convert.stream_request(_convert.build_input("p", chat=False), opts)
    assert list(request.stopping.stop_sequences) == ["END"]
    # GenerateStreamRequest mirrors GenerateRequest's numbering; the common fields serialize alike.
    unary = _convert.generate_request([], opts)
    assert request.SerializeToString(deterministic=True).endswith(unary.SerializeToString(deterministic=True))


@pytest.mark.parametrize(
    ("kwargs", "error"),
    [
        ({"temperature": -0.1}, ValueError),
        ({"temperature": float("nan")}, ValueError),
        ({"temperature": "hot"}, TypeError),
        ({"top_k": -1}, ValueError),
        ({"top_k": 1.5}, TypeError),
        ({"top_p": 0.0}, ValueError),
        ({"top_p": 1.01}, ValueError),
        ({"repetition_penalty": 0.0}, ValueError),
        ({"seed": -1}, ValueError),
        ({"seed": 2**64}, ValueError),
        ({"seed": True}, TypeError),
        ({"max_new_tokens": 0}, ValueError),
        ({"max_new_tokens": 2**32}, ValueError),
        ({"stop": [""]}, ValueError),
        ({"stop": [b"x"]}, TypeError),
        ({"adapter": "has space"}, ValueError),
        ({"adapter": "ünïcode"}, ValueError),
        ({"adapter": "a" * 129}, ValueError),
        ({"adapter": 3}, TypeError),
        ({"request_id": "bad\nid"}, ValueError),
        ({"speculate": "yes"}, TypeError),
        ({"chat": 1}, TypeError),
        ({"return_logprobs": None}, TypeError),
        ({"sampling": {"temperature": 1.0}}, TypeError),
        ({"temprature": 1.0}, TypeError),  # a typo is an unknown keyword
    ],
)
def test_bad_options_are_rejected_before_sending(kwargs: dict[str, Any], error: type[Exception]) -> None:
    with pytest.raises(error):
        _options(**kwargs)


def test_load_adapter_request_checks_id_and_source() -> None:
    assert _convert.load_adapter_request("a.b-1", "/adapters/x") == adapters_pb2.LoadAdapterRequest(
        id="a.b-1", source="/adapters/x"
    )
    with pytest.raises(ValueError):
        _convert.load_adapter_request("", "/x")
    with pytest.raises(ValueError):
        _convert.load_adapter_request("a", "")


# ----------------------------------------------------------------------------------------- metadata


def test_metadata_adapter_header_and_api_key() -> None:
    base = _channel.base_metadata([("x-team", "search")], api_key="k1")
    assert base == (("x-team", "search"), ("authorization", "Bearer k1"))
    assert _channel.with_adapter(base, "sql")[-1] == (loraplex.ADAPTER_HEADER, "sql")
    assert _channel.with_adapter(base, "")[-1] == ("x-loraplex-adapter", "")
    with pytest.raises(ValueError):
        _channel.base_metadata([("authorization", "Basic x")], api_key="k1")
    with pytest.raises(ValueError):
        _channel.base_metadata([(loraplex.ADAPTER_HEADER, "x")], api_key=None)
    with pytest.raises(ValueError):
        _channel.base_metadata([("X-Upper", "x")], api_key=None)


def test_channel_options_and_client_arguments() -> None:
    assert _channel.channel_options("round_robin", [("grpc.max_receive_message_length", 1 << 24)]) == [
        ("grpc.lb_policy_name", "round_robin"),
        ("grpc.max_receive_message_length", 1 << 24),
        ("grpc.max_send_message_length", loraplex.DEFAULT_MAX_MESSAGE_BYTES),  # the server's default limit
    ]
    with pytest.raises(ValueError):
        loraplex.Client(timeout=0)
    with pytest.raises(ValueError):
        loraplex.Client(channel=grpc.insecure_channel("127.0.0.1:1"), load_balancing="round_robin")
    with loraplex.Client("127.0.0.1:1", load_balancing="round_robin") as client:
        with pytest.raises(ValueError):  # checked before any RPC: no server needed
            client.generate("x", temperature=-1)
        with pytest.raises(TypeError):
            client.stream(["a", "b"])  # type: ignore[list-item]  # one prompt only
        with pytest.raises(ValueError):
            client.get_adapter("")


# ------------------------------------------------------------------------------------------- health


@pytest.mark.parametrize("status", list(health_pb2.HealthCheckResponse.ServingStatus.values()))
def test_every_health_status_has_its_own(status: int) -> None:
    data = health_pb2.HealthCheckResponse(status=status).SerializeToString()
    name = health_pb2.HealthCheckResponse.ServingStatus.Name(status)
    assert _channel.decode_health_response(data) == loraplex.HealthStatus[name]


def test_health_decoding_skips_unknown_fields_and_refuses_truncated_bytes() -> None:
    known = health_pb2.HealthCheckResponse(status=health_pb2.HealthCheckResponse.SERVING).SerializeToString()
    # field 2 (varint 300), field 3 (length-delimited "ab"), field 4 (fixed32) around the known field
    extra = b"\x10\xac\x02" + b"\x1a\x02ab" + b"\x25\x00\x00\x00\x00"
    assert _channel.decode_health_response(extra + known + extra) is loraplex.HealthStatus.SERVING
    newer = b"\x08\x09"  # a status value this client does not know
    assert _channel.decode_health_response(newer) is loraplex.HealthStatus.UNKNOWN
    with pytest.raises(DecodeError):
        _channel.decode_health_response(b"\x1a\x05ab")  # truncated


# ---------------------------------------------------------------------------------------- responses


def test_generation_result_conversion() -> None:
    result = pb.GenerationResult(
        text="Paris",
        token_ids=[7, 8],
        logprobs=[-0.5, -0.25],
        finish_reason=pb.FINISH_REASON_STOP_SEQUENCE,
        stop_sequence="\n",
        usage=pb.Usage(prompt_tokens=5, generated_tokens=2, accepted_draft_tokens=1),
    )
    generation = _convert.to_generation(result, "r1")
    assert generation == loraplex.Generation(
        text="Paris",
        finish_reason=loraplex.FinishReason.STOP_SEQUENCE,
        usage=loraplex.Usage(prompt_tokens=5, generated_tokens=2, accepted_draft_tokens=1),
        token_ids=(7, 8),
        logprobs=(-0.5, -0.25),
        stop_sequence="\n",
        request_id="r1",
    )
    assert generation.finish_reason == "stop_sequence"


def test_every_finish_reason_has_a_client_value() -> None:
    for number in pb.FinishReason.values():
        name = pb.FinishReason.Name(number).removeprefix("FINISH_REASON_")
        converted = _convert.to_generation(pb.GenerationResult(finish_reason=number), "").finish_reason
        assert converted is loraplex.FinishReason[name]


def test_stream_delta_is_last_only_with_finish_reason_or_usage() -> None:
    middle = _convert.to_delta(pb.GenerateStreamResponse(text="Pa", token_ids=[1], request_id="r"))
    assert not middle.is_last and middle.usage is None and middle.finish_reason is None
    assert middle.request_id == "r"
    last = _convert.to_delta(
        pb.GenerateStreamResponse(
            text="ris", finish_reason=pb.FINISH_REASON_EOS, usage=pb.Usage(prompt_tokens=3, generated_tokens=4)
        )
    )
    assert last.is_last and last.finish_reason is loraplex.FinishReason.EOS
    assert last.usage == loraplex.Usage(prompt_tokens=3, generated_tokens=4, accepted_draft_tokens=0)


def test_model_info_and_tokenize_conversion() -> None:
    message = pb.ModelInfoResponse(
        model_name="SmolLM2-135M-Instruct",
        architecture="LlamaForCausalLM",
        vocab_size=49152,
        context_length=8192,
        limits=pb.Limits(
            max_batch_size=32,
            max_prompt_tokens=2048,
            max_new_tokens=1024,
            max_total_tokens=4096,
            max_mixture_adapters=4,
        ),
        features=["lora", "medusa"],
        load_seconds=1.5,
        eos_token_ids=[2],
    )
    info = _convert.to_model_info(message)
    assert info.limits.max_total_tokens == 4096 and info.limits.max_mixture_adapters == 4
    assert info.features == ("lora", "medusa")
    assert info.eos_token_ids == (2,) and info.load_seconds == 1.5
    tokens = _convert.to_tokenize_result(pb.TokenizeResponse(token_ids=[1, 2], tokens=["a", "b"], rendered_text="ab"))
    assert len(tokens) == 2 and tokens.tokens == ("a", "b")


def test_adapter_info_conversion_with_timestamps() -> None:
    registered = datetime(2025, 1, 2, 3, 4, 5, 600000, tzinfo=UTC)
    stamp = timestamp_pb2.Timestamp()
    stamp.FromDatetime(registered)
    message = adapters_pb2.AdapterInfo(
        id="sql",
        source="/a/sql",
        kind=adapters_pb2.ADAPTER_KIND_MEDUSA_LORA,
        state=adapters_pb2.ADAPTER_STATE_DEVICE,
        rank=16,
        alpha=32.0,
        target_modules=["q_proj", "v_proj"],
        medusa_heads=4,
        total_bytes=1000,
        device_bytes=400,
        num_layers=30,
        device_layers=12,
        hits=3,
        registered_at=stamp,
        load_latency=adapters_pb2.LoadLatency(index_seconds=0.01, read_seconds=0.002),
        active_requests=1,
        pinned=True,
    )
    info = _convert.to_adapter_info(message)
    assert info.kind is loraplex.AdapterKind.MEDUSA_LORA and info.state is loraplex.AdapterState.DEVICE
    assert info.registered_at == registered and info.last_used is None
    assert info.target_modules == ("q_proj", "v_proj") and info.device_layers == 12
    assert info.load_latency == loraplex.LoadLatency(index_seconds=0.01, read_seconds=0.002)
    assert info.pinned and info.active_requests == 1
    for number in adapters_pb2.AdapterKind.values():
        name = adapters_pb2.AdapterKind.Name(number).removeprefix("ADAPTER_KIND_")
        converted = _convert.to_adapter_info(adapters_pb2.AdapterInfo(kind=number)).kind
        assert converted is loraplex.AdapterKind[name]
    for state in adapters_pb2.AdapterState.values():
        name = adapters_pb2.AdapterState.Name(state).removeprefix("ADAPTER_STATE_")
        converted_state = _convert.to_adapter_info(adapters_pb2.AdapterInfo(state=state)).state
        assert converted_state is loraplex.AdapterState[name]
