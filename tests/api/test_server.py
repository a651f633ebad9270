"""End-to-end over real loopback gRPC: generation RPCs, health, reflection, errors and their status codes."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from loraplex.v1 import generation_pb2 as pb
from loraplex.v1 import generation_pb2_grpc as pb_grpc
from support.servers import as_stream, stream_req, text_req

from service.api.server import BackgroundServer
from service.config import Settings


def test_unary_stream_and_several_prompts_agree(stub: pb_grpc.GenerationStub) -> None:
    unary = stub.Generate(text_req("Hello there", 20), timeout=60)
    (result,) = unary.results
    assert result.finish_reason == pb.FINISH_REASON_LENGTH
    assert len(result.token_ids) == 20 and result.usage.generated_tokens == 20
    assert unary.request_id

    chunks = list(stub.GenerateStream(stream_req("Hello there", 20), timeout=60))
    assert "".join(c.text for c in chunks) == result.text
    assert [t for c in chunks for t in c.token_ids] == list(result.token_ids)
    assert chunks[-1].finish_reason == pb.FINISH_REASON_LENGTH and chunks[-1].HasField("usage")
    assert all(c.finish_reason == pb.FINISH_REASON_UNSPECIFIED for c in chunks[:-1])
    assert chunks[0].request_id

    several = stub.Generate(
        pb.GenerateRequest(
            inputs=[pb.Input(text="Hello there"), pb.Input(text="Something else entirely")],
            stopping=pb.StoppingCriteria(max_new_tokens=20, ignore_eos=True),
            return_options=pb.ReturnOptions(return_token_ids=True),
        ),
        timeout=60,
    )
    assert len(several.results) == 2
    assert list(several.results[0].token_ids) == list(result.token_ids)
    assert list(several.results[1].token_ids) != list(result.token_ids)


def test_stop_sequence_over_grpc(stub: pb_grpc.GenerationStub) -> None:
    full = stub.Generate(text_req("Tell me a story", 30), timeout=60).results[0].text
    stop = full[10:13]
    r = text_req("Tell me a story", 30)
    r.stopping.stop_sequences.append(stop)
    got = stub.Generate(r, timeout=60).results[0]
    assert got.finish_reason == pb.FINISH_REASON_STOP_SEQUENCE
    assert got.text == full[: full.index(stop)]
    assert got.stop_sequence == stop


def test_seed_reproducibility(stub: pb_grpc.GenerationStub) -> None:
    def sample(seed: int) -> list[int]:
        r = text_req("Once upon a time", 16, sampling=pb.SamplingParams(temperature=1.0, top_p=0.9, seed=seed))
        return list(stub.Generate(r, timeout=60).results[0].token_ids)

    assert sample(7) == sample(7)
    assert sample(7) != sample(8)


def test_logprobs_returned(stub: pb_grpc.GenerationStub) -> None:
    r = text_req("Hi", 5)
    r.return_options.return_logprobs = True
    result = stub.Generate(r, timeout=60).results[0]
    assert len(result.logprobs) == 5 and all(lp <= 0 for lp in result.logprobs)


def test_cancel_frees_the_slot(server: BackgroundServer, stub: pb_grpc.GenerationStub) -> None:
    call = stub.GenerateStream(stream_req("a long one", 250), timeout=60)
    next(call)
    engine = server.server.runtime.loaded.engine  # type: ignore[union-attr]
    assert engine.in_flight == 1
    call.cancel()
    end = time.monotonic() + 10
    while (engine.in_flight or engine.state().running) and time.monotonic() < end:
        time.sleep(0.01)
    assert engine.in_flight == 0 and engine.state().running == 0


def test_deadline_exceeded(stub: pb_grpc.GenerationStub) -> None:
    with pytest.raises(grpc.RpcError) as err:
        stub.Generate(text_req("slow", 250), timeout=0.05)
    assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED


@pytest.mark.parametrize(
    ("mutate", "code", "needle"),
    [
        (lambda r: r.inputs[0].ClearField("text"), grpc.StatusCode.INVALID_ARGUMENT, "input"),
        (lambda r: setattr(r.inputs[0], "text", ""), grpc.StatusCode.INVALID_ARGUMENT, ""),
        (lambda r: setattr(r.inputs[0], "text", "word " * 400), grpc.StatusCode.INVALID_ARGUMENT, "at most 128"),
        (lambda r: setattr(r.stopping, "max_new_tokens", 0), grpc.StatusCode.INVALID_ARGUMENT, "max_new_tokens"),
        (lambda r: setattr(r.stopping, "max_new_tokens", 100000), grpc.StatusCode.INVALID_ARGUMENT, "max_new_tokens"),
        (lambda r: setattr(r.sampling, "temperature", -0.5), grpc.StatusCode.INVALID_ARGUMENT, "temperature"),
        (lambda r: setattr(r.sampling, "top_p", 0.0), grpc.StatusCode.INVALID_ARGUMENT, "top_p"),
        (lambda r: setattr(r.sampling, "top_p", 1.5), grpc.StatusCode.INVALID_ARGUMENT, "top_p"),
        (lambda r: setattr(r.sampling, "repetition_penalty", 0.0), grpc.StatusCode.INVALID_ARGUMENT, "penalty"),
        (lambda r: r.stopping.stop_sequences.append(""), grpc.StatusCode.INVALID_ARGUMENT, "stop_sequences"),
        (lambda r: setattr(r, "adapter_id", "nope"), grpc.StatusCode.NOT_FOUND, "nope"),
        (lambda r: setattr(r, "request_id", "has space"), grpc.StatusCode.INVALID_ARGUMENT, "request_id"),
    ],
)
def test_bad_input_gets_the_right_status(stub: pb_grpc.GenerationStub, mutate, code, needle) -> None:  # type: ignore[no-untyped-def]
    r = text_req("fine prompt", 4)
    mutate(r)
    for call in (stub.Generate, _as_stream(stub)):
        with pytest.raises(grpc.RpcError) as err:
            call(r)
        assert err.value.code() == code, err.value.details()
        assert needle.lower() in (err.value.details() or "").lower()
    # ... and the server keeps serving.
    assert stub.Generate(text_req("still fine", 2), timeout=60).results[0].usage.generated_tokens == 2


def _as_stream(stub: pb_grpc.GenerationStub):  # type: ignore[no-untyped-def]
    def call(r: pb.GenerateRequest) -> list[pb.GenerateStreamResponse]:
        return list(stub.GenerateStream(as_stream(r), timeout=60))

    return call


def test_queue_full_is_resource_exhausted(tiny_server: Callable[..., BackgroundServer]) -> None:
    srv = tiny_server(max_batch_size=1, max_queue=1, max_new_tokens=1000, max_total_tokens=1024)
    with grpc.insecure_channel(srv.target) as channel:
        stub = pb_grpc.GenerationStub(channel)
        engine = srv.server.runtime.loaded.engine  # type: ignore[union-attr]
        running = [stub.Generate.future(text_req("occupy", 1000), timeout=60) for _ in range(2)]
        end = time.monotonic() + 10  # one running, one waiting: the queue is full
        while engine.in_flight < 2 and time.monotonic() < end:
            time.sleep(0.005)
        assert engine.in_flight == 2
        with pytest.raises(grpc.RpcError) as err:
            stub.Generate(text_req("one too many", 2), timeout=60)
        assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "retry" in (err.value.details() or "")
        for call in running:
            call.cancel()


def test_tokenize_and_model_info(stub: pb_grpc.GenerationStub, served_tiny_dir: Path) -> None:
    from service.tokenizer import Tokenizer

    tok = Tokenizer.from_folder(served_tiny_dir)
    got = stub.Tokenize(pb.TokenizeRequest(input=pb.Input(text="Hello world")))
    assert list(got.token_ids) == tok.encode("Hello world")
    chat = stub.Tokenize(pb.TokenizeRequest(input=pb.Input(text="Hi", chat=True)))
    assert chat.rendered_text == tok.apply_chat_template([{"role": "user", "content": "Hi"}])
    info = stub.ModelInfo(pb.ModelInfoRequest())
    assert info.vocab_size == 49152 and info.limits.max_prompt_tokens == 128
    assert info.limits.max_mixture_adapters == Settings(model=served_tiny_dir).max_mixture_adapters
    assert info.dtype == "float32" and info.device == "cpu" and info.load_mode == "stream"
    assert "chat_template" in info.features and 2 in info.eos_token_ids


def test_health_transitions_and_reflection(tiny_server: Callable[..., BackgroundServer]) -> None:
    srv = tiny_server(load=False)
    with grpc.insecure_channel(srv.target) as channel:
        health = health_pb2_grpc.HealthStub(channel)
        gen = pb_grpc.GenerationStub(channel)

        def status(service: str = "loraplex.v1.Generation") -> int:
            return int(health.Check(health_pb2.HealthCheckRequest(service=service)).status)

        assert status() == health_pb2.HealthCheckResponse.NOT_SERVING
        with pytest.raises(grpc.RpcError) as err:
            gen.Generate(text_req("too early", 2))
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
        assert srv.server is not None
        srv.call(srv.server.load())
        assert status() == health_pb2.HealthCheckResponse.SERVING
        assert status("") == health_pb2.HealthCheckResponse.SERVING

        refl = reflection_pb2_grpc.ServerReflectionStub(channel)
        responses = refl.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")]))
        names = {s.name for r in responses for s in r.list_services_response.service}
        assert {"loraplex.v1.Generation", "grpc.health.v1.Health", "grpc.reflection.v1alpha.ServerReflection"} <= names

        # Draining: NOT_SERVING, and new work is refused while a running stream finishes.
        stream = gen.GenerateStream(stream_req("finish me", 250), timeout=60)
        first = next(stream)
        drained = threading.Thread(target=srv.call, args=(srv.server.drain(5.0),))
        drained.start()
        time.sleep(0.02)
        assert status() == health_pb2.HealthCheckResponse.NOT_SERVING
        with pytest.raises(grpc.RpcError) as refused:
            gen.Generate(text_req("too late", 2))
        assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
        rest = list(stream)
        assert rest[-1].finish_reason == pb.FINISH_REASON_LENGTH
        assert len(first.token_ids) + sum(len(c.token_ids) for c in rest) == 250
        drained.join(10)
        srv.server = None


@pytest.mark.slow
def test_real_model_answers_paris(tiny_server: Callable[..., BackgroundServer], smollm2_dir: Path) -> None:
    srv = tiny_server(model=smollm2_dir, max_prompt_tokens=512, max_total_tokens=1024)
    with grpc.insecure_channel(srv.target) as channel:
        stub = pb_grpc.GenerationStub(channel)
        r = pb.GenerateRequest(
            inputs=[pb.Input(text="What is the capital of France?", chat=True)],
            stopping=pb.StoppingCriteria(max_new_tokens=24),
        )
        result = stub.Generate(r, timeout=120).results[0]
        assert "Paris" in result.text
        assert result.finish_reason == pb.FINISH_REASON_EOS
        messages = pb.ChatMessages(messages=[pb.ChatMessage(role="user", content="What is the capital of France?")])
        streamed = stub.GenerateStream(
            pb.GenerateStreamRequest(
                input=pb.Input(messages=messages), stopping=pb.StoppingCriteria(max_new_tokens=24)
            ),
            timeout=120,
        )
        assert "".join(c.text for c in streamed) == result.text
