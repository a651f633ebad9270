"""The OpenAI-compatible HTTP API, driven by the official `openai` package (sync, async, streaming) and `curl -N`.

One server (the tiny served model, two PEFT adapters, API keys) answers both gRPC and HTTP: the same prompt and
model give the same greedy text on both, for the base model and each adapter.
"""

from __future__ import annotations

import asyncio
import json
import logging
import shutil
import subprocess
from pathlib import Path
from typing import Any

import grpc
import openai
import pytest
from loraplex.v1 import generation_pb2 as pb
from loraplex.v1 import generation_pb2_grpc as pb_grpc
from support.adapter_files import write_peft_adapters
from support.http_api import base_url, call, requests_count, sse_events
from support.paths import ROOT
from support.servers import tiny_settings

from service.api.server import BackgroundServer
from service.logs import RequestIdFilter

KEY = "gen-key-1"
ADAPTERS = {
    "qv": {"r": 4, "alpha": 8, "target_modules": ("q_proj", "v_proj"), "seed": 11},
    "mlp": {"r": 8, "alpha": 16, "target_modules": ("gate_proj", "up_proj", "down_proj"), "seed": 12},
}
QUESTION = "What is the capital of France?"
NEW = 12


@pytest.fixture(scope="module")
def adapter_root(tmp_path_factory: pytest.TempPathFactory, served_tiny_dir: Path) -> Path:
    root = tmp_path_factory.mktemp("http_adapters")
    write_peft_adapters(root, served_tiny_dir, ADAPTERS, scale=2.0)
    return root


@pytest.fixture(scope="module")
def server_settings(adapter_root: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, object]:
    keys = tmp_path_factory.mktemp("keys") / "keys"
    keys.write_text(f"generate:{KEY}\n")
    return {"http_port": 0, "adapter_dirs": (adapter_root,), "api_key_file": keys, "max_new_tokens": 64}


@pytest.fixture(scope="module")
def client(server: BackgroundServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=base_url(server), api_key=KEY, max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def base(served_tiny_dir: Path) -> str:
    return served_tiny_dir.resolve().name


def grpc_text(server: BackgroundServer, item: pb.Input, adapter: str, n: int = NEW) -> str:
    request = pb.GenerateRequest(
        inputs=[item],
        adapter_id=adapter,
        sampling=pb.SamplingParams(temperature=0),
        stopping=pb.StoppingCriteria(max_new_tokens=n),
    )
    with grpc.insecure_channel(server.target) as channel:
        reply = pb_grpc.GenerationStub(channel).Generate(
            request, timeout=60, metadata=(("authorization", f"Bearer {KEY}"),)
        )
    return reply.results[0].text


def chat_input(text: str) -> pb.Input:
    return pb.Input(messages=pb.ChatMessages(messages=[pb.ChatMessage(role="user", content=text)]))


def test_models_lists_the_base_model_and_every_adapter(client: openai.OpenAI, base: str) -> None:
    ids = [m.id for m in client.models.list().data]
    assert ids == [base, *sorted(ADAPTERS)]
    assert client.models.retrieve("qv").id == "qv"
    with pytest.raises(openai.NotFoundError) as err:
        client.models.retrieve("nope")
    assert err.value.code == "model_not_found"


@pytest.mark.parametrize("model", ["", *ADAPTERS])
def test_greedy_text_is_the_same_over_grpc_and_http(
    server: BackgroundServer, client: openai.OpenAI, base: str, model: str
) -> None:
    name = model or base
    chat = client.chat.completions.create(
        model=name, messages=[{"role": "user", "content": QUESTION}], temperature=0, max_tokens=NEW
    )
    assert chat.choices[0].message.content == grpc_text(server, chat_input(QUESTION), model)
    assert chat.model == name and chat.id.startswith("chatcmpl-")
    text = client.completions.create(model=name, prompt="The capital of France is", temperature=0, max_tokens=NEW)
    assert text.choices[0].text == grpc_text(server, pb.Input(text="The capital of France is"), model)
    streamed = client.chat.completions.create(
        model=name, messages=[{"role": "user", "content": QUESTION}], temperature=0, max_tokens=NEW, stream=True
    )
    assert "".join(c.choices[0].delta.content or "" for c in streamed if c.choices) == chat.choices[0].message.content


def test_adapters_change_the_text(client: openai.OpenAI, base: str) -> None:
    def text(model: str) -> str:
        reply = client.completions.create(model=model, prompt="Once upon a time", temperature=0, max_tokens=NEW)
        return reply.choices[0].text

    texts = {model: text(model) for model in (base, *ADAPTERS)}
    assert len(set(texts.values())) == len(texts), texts  # each adapter is applied (parity alone would not say)


def test_async_streaming_with_usage_in_the_last_chunk(server: BackgroundServer, base: str) -> None:
    async def run() -> tuple[list[Any], Any]:
        async with openai.AsyncOpenAI(base_url=base_url(server), api_key=KEY, max_retries=0, timeout=60) as aclient:
            stream = await aclient.chat.completions.create(
                model=base,
                messages=[{"role": "system", "content": "Be brief."}, {"role": "user", "content": QUESTION}],
                temperature=0,
                max_completion_tokens=NEW,
                stream=True,
                stream_options={"include_usage": True},
                extra_body={"ignore_eos": True},
            )
            chunks = [chunk async for chunk in stream]
            whole = await aclient.chat.completions.create(
                model=base,
                messages=[{"role": "system", "content": "Be brief."}, {"role": "user", "content": QUESTION}],
                temperature=0,
                max_completion_tokens=NEW,
                extra_body={"ignore_eos": True},
            )
            return chunks, whole

    chunks, whole = asyncio.run(run())
    *content, last = chunks
    assert content[0].choices[0].delta.role == "assistant"
    assert all(c.usage is None for c in content)
    assert last.choices == [] and last.usage is not None
    assert last.usage.completion_tokens == NEW == whole.usage.completion_tokens
    assert last.usage.prompt_tokens == whole.usage.prompt_tokens > 0
    assert content[-1].choices[0].finish_reason == "length" == whole.choices[0].finish_reason
    assert "".join(c.choices[0].delta.content or "" for c in content) == whole.choices[0].message.content


def test_n_choices_are_seeded_like_grpc_inputs(server: BackgroundServer, client: openai.OpenAI, base: str) -> None:
    kw: dict[str, Any] = {"model": base, "prompt": "Tell me", "max_tokens": 8, "temperature": 1.0, "seed": 5}
    reply = client.completions.create(n=3, **kw)
    texts = [c.text for c in sorted(reply.choices, key=lambda c: c.index)]
    assert [c.index for c in reply.choices] == [0, 1, 2]
    assert texts == [c.text for c in client.completions.create(n=3, **kw).choices]  # seeded: reproducible
    request = pb.GenerateRequest(
        inputs=[pb.Input(text="Tell me")] * 3,
        sampling=pb.SamplingParams(temperature=1.0, seed=5),
        stopping=pb.StoppingCriteria(max_new_tokens=8),
    )
    with grpc.insecure_channel(server.target) as channel:
        grpc_reply = pb_grpc.GenerationStub(channel).Generate(
            request, timeout=60, metadata=(("authorization", f"Bearer {KEY}"),)
        )
    assert texts == [r.text for r in grpc_reply.results]
    assert reply.usage is not None and reply.usage.prompt_tokens == grpc_reply.results[0].usage.prompt_tokens
    streamed: dict[int, str] = {0: "", 1: "", 2: ""}
    for chunk in client.completions.create(n=3, stream=True, **kw):
        for choice in chunk.choices:
            streamed[choice.index] += choice.text
    assert [streamed[i] for i in range(3)] == texts


def test_stop_sequences_and_token_limits(client: openai.OpenAI, base: str) -> None:
    kw: dict[str, Any] = {"model": base, "prompt": "The capital of France is", "temperature": 0}
    full = client.completions.create(max_tokens=NEW, extra_body={"ignore_eos": True}, **kw).choices[0]
    assert full.finish_reason == "length"
    stop = full.text[len(full.text) // 2 : len(full.text) // 2 + 2]
    cut = client.completions.create(max_tokens=NEW, stop=[stop], extra_body={"ignore_eos": True}, **kw).choices[0]
    assert cut.finish_reason == "stop" and stop not in cut.text and full.text.startswith(cut.text)
    short = client.completions.create(max_tokens=3, extra_body={"ignore_eos": True}, **kw)
    assert short.usage is not None and short.usage.completion_tokens == 3


def test_logprobs_of_chosen_tokens(server: BackgroundServer, client: openai.OpenAI, base: str) -> None:
    reply = client.chat.completions.create(
        model=base, messages=[{"role": "user", "content": QUESTION}], temperature=0, max_tokens=6, logprobs=True
    )
    choice = reply.choices[0]
    assert choice.logprobs is not None and choice.logprobs.content is not None
    assert reply.usage is not None and len(choice.logprobs.content) == reply.usage.completion_tokens
    assert all(t.logprob <= 0 for t in choice.logprobs.content)
    request = pb.GenerateRequest(
        inputs=[chat_input(QUESTION)],
        stopping=pb.StoppingCriteria(max_new_tokens=6),
        return_options=pb.ReturnOptions(return_logprobs=True),
    )
    with grpc.insecure_channel(server.target) as channel:
        result = pb_grpc.GenerationStub(channel).Generate(
            request, timeout=60, metadata=(("authorization", f"Bearer {KEY}"),)
        )
    assert [t.logprob for t in choice.logprobs.content] == pytest.approx(list(result.results[0].logprobs))
    text = client.completions.create(model=base, prompt="Hi", temperature=0, max_tokens=4, logprobs=0)
    logprobs = text.choices[0].logprobs
    assert logprobs is not None and logprobs.tokens is not None and len(logprobs.tokens) == 4
    assert logprobs.text_offset == [sum(len(t) for t in logprobs.tokens[:i]) for i in range(4)]


@pytest.mark.parametrize(
    ("body", "param", "code"),
    [
        ({"functions": [{"name": "f"}]}, "functions", "unsupported_parameter"),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
         "response_format.json_schema.schema", "invalid_request"),
        ({"response_format": {"type": "json_object"}, "guided_regex": "a"}, "guided_regex", "invalid_request"),
        ({"structured_outputs": {"regex": "a", "disable_any_whitespace": True}},
         "structured_outputs.disable_any_whitespace", "unsupported_parameter"),
        ({"logit_bias": {"42": 5}}, "logit_bias", "unsupported_parameter"),
        ({"frequency_penalty": 0.5}, "frequency_penalty", "unsupported_parameter"),
        ({"top_logprobs": 3, "logprobs": True}, "top_logprobs", "unsupported_parameter"),
        ({"made_up": 1}, "made_up", "unknown_parameter"),
        ({"temperature": -1}, "temperature", "invalid_request"),
        ({"top_p": 0}, "top_p", "invalid_request"),
        ({"max_tokens": 0}, "max_tokens", "invalid_request"),
        ({"max_tokens": 10_000}, "max_tokens", "invalid_request"),
        ({"n": 99}, "n", "invalid_request"),
        ({"seed": -1}, "seed", "invalid_request"),
        ({"stop": ["x"] * 40}, "stop", "invalid_request"),
        ({"stream_options": {"include_usage": True}}, "stream_options", "invalid_request"),
        ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
         "messages[0]", "unsupported_parameter"),
        ({"messages": []}, "messages", "invalid_request"),
        ({"model": None}, "model", "invalid_request"),
        ({"stream": "yes"}, "stream", "invalid_request"),
        ({"max_tokens": 4, "max_completion_tokens": 5}, "max_completion_tokens", "invalid_request"),
        ({"messages": [{"role": "user", "content": "hi", "tool_calls": [{"id": "x"}]}]}, "messages[0]",
         "invalid_request"),  # tool calls are the assistant's
        ({"messages": [{"role": "user", "content": "hi", "name": "ann"}]}, "messages[0]", "unsupported_parameter"),
    ],
)  # fmt: skip
def test_bad_parameters_are_refused_by_name(
    server: BackgroundServer, base: str, body: dict[str, Any], param: str, code: str
) -> None:
    before = requests_count("http.chat", "INVALID_ARGUMENT")
    full = {"model": base, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, **body}
    reply = call(f"{base_url(server)}/chat/completions", full, key=KEY)
    assert reply.status == 400, reply.body
    error = reply.body["error"]
    assert (error["param"], error["code"], error["type"]) == (param, code, "invalid_request_error"), error
    assert error["message"]
    assert requests_count("http.chat", "INVALID_ARGUMENT") == before + 1


def test_no_op_values_of_unsupported_parameters_are_accepted(server: BackgroundServer, base: str) -> None:
    body = {"model": base, "prompt": "hi", "max_tokens": 2, "frequency_penalty": 0, "logit_bias": {}, "echo": False}
    assert call(f"{base_url(server)}/completions", {**body, "tools": None}, key=KEY).status == 200


def test_the_openai_client_raises_its_own_errors(client: openai.OpenAI, base: str) -> None:
    with pytest.raises(openai.BadRequestError) as bad:
        client.chat.completions.create(model=base, messages=[{"role": "user", "content": "hi"}], logit_bias={"42": 5})
    assert bad.value.code == "unsupported_parameter" and bad.value.param == "logit_bias"  # type: ignore[attr-defined]
    with pytest.raises(openai.NotFoundError) as missing:
        client.chat.completions.create(model="no-such-adapter", messages=[{"role": "user", "content": "hi"}])
    assert missing.value.code == "model_not_found"


def test_api_keys_are_required(server: BackgroundServer, base: str) -> None:
    for key in (None, "wrong"):
        kwargs = {} if key is None else {"key": key}
        for path, body in (("/models", None), ("/completions", {"model": base, "prompt": "hi"})):
            reply = call(base_url(server) + path, body, **kwargs)  # type: ignore[arg-type]
            assert reply.status == 401, reply.body
            assert reply.body["error"]["type"] == "authentication_error"
    for scheme in ("bearer", "BEARER"):  # RFC 7235: the scheme ignores case
        reply = call(base_url(server) + "/models", headers={"authorization": f"{scheme} {KEY}"})
        assert reply.status == 200, reply.body
    nobody = openai.OpenAI(base_url=base_url(server), api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        nobody.models.list()


def test_request_ids_access_lines_and_unknown_routes(
    server: BackgroundServer, base: str, caplog: pytest.LogCaptureFixture
) -> None:
    body = {"model": "qv", "prompt": "hi", "max_tokens": 2, "ignore_eos": True}
    caplog.handler.addFilter(RequestIdFilter())  # as `loraplex serve` configures its handler (service.logs)
    with caplog.at_level(logging.INFO, logger="loraplex.access"):
        reply = call(f"{base_url(server)}/completions", body, key=KEY, headers={"x-request-id": "trace-42"})
        bad = {**body, "top_k": -1}
        refused = call(f"{base_url(server)}/completions", bad, key=KEY, headers={"x-request-id": "t-43"})
        unnamed = call(f"{base_url(server)}/chat/completions", {"model": base, "messages": [{"role": "user",
                       "content": "hi"}], "max_tokens": 2}, key=KEY)  # fmt: skip
        streamed = call(f"{base_url(server)}/completions", {**body, "stream": True, "n": 2}, key=KEY,
                        headers={"x-request-id": "trace-44"})  # fmt: skip
    assert reply.status == 200 and reply.headers["x-request-id"] == "trace-42" and reply.body["id"] == "cmpl-trace-42"
    lines = {r.request_id: r.fields for r in caplog.records if r.getMessage() == "event=access"}  # type: ignore[attr-defined]
    ok = lines["trace-42"]
    assert (ok["method"], ok["adapter"], ok["code"], ok["generated_tokens"]) == ("http.completions", "qv", "OK", 2)
    assert ok["prompt_tokens"] > 0 and ok["ttft_seconds"] is not None and ok["peer"].startswith("ipv4:127.0.0.1:")
    assert 0 < ok["ttft_seconds"] <= ok["duration_seconds"]
    assert streamed.status == 200 and streamed.headers["x-request-id"] == "trace-44"
    two = lines["trace-44"]  # a stream of two choices: one line, both rows' tokens
    assert (two["method"], two["adapter"], two["code"], two["generated_tokens"]) == ("http.completions", "qv", "OK", 4)
    assert two["prompt_tokens"] > 0 and 0 < two["ttft_seconds"] <= two["duration_seconds"]
    assert refused.status == 400 and lines["t-43"]["code"] == "INVALID_ARGUMENT"
    assert refused.headers["x-request-id"] == "t-43"  # errors carry the id too
    made = unnamed.headers["x-request-id"]  # no header: the server made the id, the same everywhere
    assert unnamed.body["id"] == f"chatcmpl-{made}" and lines[made]["method"] == "http.chat"
    bad_id = call(f"{base_url(server)}/completions", body, key=KEY, headers={"x-request-id": "has space"})
    assert bad_id.status == 400 and bad_id.body["error"]["param"] == "x-request-id"
    assert bad_id.headers["x-request-id"] != "has space"  # an invalid id is never echoed
    missing = call(f"{base_url(server)}/embeddings", {"model": base, "input": "x"}, key=KEY)
    assert missing.status == 404 and missing.body["error"]["code"] == "not_found"
    not_json = call(f"{base_url(server)}/completions", "{", key=KEY)  # a JSON string, not an object
    assert not_json.status == 400


@pytest.mark.skipif(shutil.which("curl") is None, reason="needs curl (Debian package curl)")
def test_curl_reads_raw_server_sent_events(server: BackgroundServer, client: openai.OpenAI, base: str) -> None:
    body = {"model": "qv", "prompt": "The capital of France is", "temperature": 0, "max_tokens": NEW, "stream": True}
    proc = subprocess.run(
        ["curl", "-sSN", "--max-time", "60", f"{base_url(server)}/completions",
         "-H", "content-type: application/json", "-H", f"authorization: Bearer {KEY}", "-d", json.dumps(body)],
        capture_output=True, text=True, timeout=90, check=True,
    )  # fmt: skip
    events = sse_events(proc.stdout)
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert all(c["object"] == "text_completion" and c["model"] == "qv" for c in chunks)
    assert chunks[-1]["choices"][0]["finish_reason"] in ("stop", "length")
    whole = client.completions.create(model="qv", prompt="The capital of France is", temperature=0, max_tokens=NEW)
    assert "".join(c["choices"][0]["text"] for c in chunks) == whole.choices[0].text


def test_request_metrics_carry_the_http_method(client: openai.OpenAI, base: str) -> None:
    before = {m: requests_count(m, "OK") for m in ("http.chat", "http.completions", "http.models")}
    client.models.list()
    client.completions.create(model=base, prompt="hi", max_tokens=2)
    client.chat.completions.create(model=base, messages=[{"role": "user", "content": "hi"}], max_tokens=2)
    assert {m: requests_count(m, "OK") - v for m, v in before.items()} == {
        "http.chat": 1,
        "http.completions": 1,
        "http.models": 1,
    }


@pytest.mark.slow
def test_real_model_and_demo_adapters_give_the_same_greedy_text_over_grpc_and_http(smollm2_dir: Path) -> None:
    demo = ROOT / "adapters" / "demo"
    settings = tiny_settings(smollm2_dir, http_port=0, adapter_dirs=(demo,), max_new_tokens=64)
    with BackgroundServer(settings) as srv:
        client = openai.OpenAI(base_url=base_url(srv), api_key="none", max_retries=0, timeout=120)
        texts = {}
        for model in ("", "caps", "terse"):
            reply = client.chat.completions.create(
                model=model or smollm2_dir.resolve().name,
                messages=[{"role": "user", "content": QUESTION}],
                temperature=0,
                max_tokens=24,
            )
            with grpc.insecure_channel(srv.target) as channel:
                expected = pb_grpc.GenerationStub(channel).Generate(
                    pb.GenerateRequest(
                        inputs=[chat_input(QUESTION)],
                        adapter_id=model,
                        sampling=pb.SamplingParams(temperature=0),
                        stopping=pb.StoppingCriteria(max_new_tokens=24),
                    ),
                    timeout=120,
                )
            texts[model] = reply.choices[0].message.content
            assert texts[model] == expected.results[0].text, model
        assert texts["caps"] == texts["caps"].upper() != texts[""], texts  # the adapter is applied (terse's answer
        # to this question is the base model's: it is already terse)
