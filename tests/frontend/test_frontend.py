"""The frontend seam (``service.frontend``): one domain request under both edges, each naming fields its own way.

No model and no server: the checks and field names are pure functions, the call observer is driven by hand, and
the engine client runs against a stand-in runtime whose engine answers each request from the event loop. The
servers' own tests (test_http_*, test_bad_input_matrix, test_error_details) cover the same paths end to end.
"""

from __future__ import annotations

import ast
import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import pytest
from support.paths import ROOT

from service import metrics
from service.api import convert
from service.api.http import errors
from service.config import Settings
from service.engine.request import FinishReason, GenerationRequest, RequestHandle, TokenEvent
from service.errors import DeadlineExceeded, InvalidRequest
from service.frontend import ChatMessage, Frontend, GenerationCall, Input, Sampling, checks, observer

T = TypeVar("T")


def _imports(folder: Path) -> set[str]:
    names: set[str] = set()
    for path in folder.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                names.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and node.module:
                names.add(node.module)
    return names


def test_no_protobuf_on_the_http_path_or_in_the_frontend() -> None:
    for folder in (ROOT / "service" / "api" / "http", ROOT / "service" / "frontend"):
        wire = {n for n in _imports(folder) if n.startswith(("loraplex", "google.protobuf", "grpc"))}
        assert not wire, (folder, wire)
        for path in folder.rglob("*.py"):
            assert "pb." not in path.read_text(), path
    frontend = _imports(ROOT / "service" / "frontend")
    assert not {n for n in frontend if n.startswith(("service.api", "starlette", "uvicorn"))}


def _refusal(call: GenerationCall, settings: Settings | None = None) -> InvalidRequest:
    with pytest.raises(InvalidRequest) as caught:
        checks.check(call, settings or Settings(max_new_tokens=8, max_stop_sequences=2))
    return caught.value


TEXT = (Input(text="hi"),)


@pytest.mark.parametrize(
    ("call", "domain", "generate", "stream", "http"),
    [
        (GenerationCall(inputs=()), "inputs", "inputs", "inputs", "n"),
        (GenerationCall(TEXT, max_new_tokens=0), "max_new_tokens", "stopping.max_new_tokens", None, "max_tokens"),
        (GenerationCall(TEXT, stop_sequences=("a", "b", "c")), "stop_sequences", "stopping.stop_sequences", None,
         "stop"),
        (GenerationCall(TEXT, stop_sequences=("",)), "stop_sequences[0]", "stopping.stop_sequences[0]", None, "stop"),
        (GenerationCall(TEXT, sampling=Sampling(top_p=2.0)), "sampling.top_p", "sampling.top_p", None, "top_p"),
        (GenerationCall(TEXT, adapter_id="no spaces"), "adapter_id", "adapter_id", None, "model"),
        (GenerationCall(TEXT, request_id="has space"), "request_id", "request_id", None, "x-request-id"),
        (GenerationCall((Input(text="x" * 9),)), "inputs[0].text", "inputs[0].text", "input.text", "prompt"),
        (GenerationCall((Input(messages=(ChatMessage("user", "x" * 9),)),)), "inputs[0].messages",
         "inputs[0].messages", "input.messages", "messages"),
    ],
)  # fmt: skip
def test_the_domain_names_a_field_and_each_edge_renames_it(
    call: GenerationCall, domain: str, generate: str, stream: str | None, http: str
) -> None:
    exc = _refusal(call, Settings(max_new_tokens=8, max_stop_sequences=2, max_prompt_bytes=4))
    assert exc.field == domain
    assert convert.field_of(domain, stream=False) == generate
    assert convert.field_of(domain, stream=True) == (stream or generate)
    chat = domain.endswith("messages")
    assert errors.error_body(exc, chat=chat)["error"]["param"] == http
    with pytest.raises(InvalidRequest) as renamed, convert.grpc_fields(stream=True):
        raise exc
    assert (renamed.value.field, str(renamed.value), renamed.value.limit) == (stream or generate, str(exc), exc.limit)
    assert exc.field == domain  # the edge renamed a copy


def test_sampling_numbers_are_float32_and_inputs_are_seeded_in_turn() -> None:
    params = Sampling(temperature=0.7, seed=2**64 - 1).params
    temperature = params(logprobs=True).temperature
    assert temperature == 0.699999988079071  # 0.7 as float32, as the gRPC API's message holds it
    assert params(logprobs=False, offset=1).seed == 0
    with pytest.raises(InvalidRequest, match=r"got 1\.100000023841858") as caught:
        Sampling(top_p=1.1).params(logprobs=False)
    assert caught.value.field == "sampling.top_p"
    with pytest.raises(InvalidRequest, match="got inf"):
        Sampling(temperature=1e300).params(logprobs=False)


def _count(name: str, **labels: str) -> float:
    return metrics.REGISTRY.get_sample_value(name, labels) or 0.0


def test_the_observer_reports_a_call_once_with_the_code_that_was_sent(caplog: pytest.LogCaptureFixture) -> None:
    before = _count("loraplex_requests_total", method="Observed", code="RESOURCE_EXHAUSTED")
    before_adapter = _count("loraplex_adapter_requests_total", adapter="", code="RESOURCE_EXHAUSTED")

    async def one_call() -> None:
        call = observer.begin("Observed", "req-7", "ipv4:1.2.3.4:5", lambda adapter_id: False)
        call.per_adapter = True
        observer.submitted(3)
        observer.observe(TokenEvent((1, 2), "ab"))
        observer.decided("Observed", "RESOURCE_EXHAUSTED")  # a status sent, then the call was cancelled
        call.finish("CANCELLED")
        call.finish("OK")
        call.end()
        assert observer.CURRENT.get() is None

    with caplog.at_level(logging.INFO, logger="loraplex.access"):
        asyncio.run(one_call())
    assert _count("loraplex_requests_total", method="Observed", code="RESOURCE_EXHAUSTED") == before + 1
    assert _count("loraplex_adapter_requests_total", adapter="", code="RESOURCE_EXHAUSTED") == before_adapter + 1
    (line,) = [r for r in caplog.records if r.name == "loraplex.access"]
    fields: dict[str, Any] = line.fields  # type: ignore[attr-defined]
    assert (fields["code"], fields["prompt_tokens"], fields["generated_tokens"]) == ("RESOURCE_EXHAUSTED", 3, 2)
    assert fields["ttft_seconds"] is not None and fields["peer"] == "ipv4:1.2.3.4:5"


class _Tokenizer:
    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [ord(c) % 50 for c in text]

    def apply_chat_template(self, turns: list[dict[str, str]], add_generation_prompt: bool) -> str:
        return "".join(f"<{t['role']}>{t['content']}" for t in turns)

    def id_to_token(self, i: int) -> str:
        return chr(ord("a") + i % 26)


@dataclass
class _Engine:
    """Answers each request with its prompt's first ids as tokens, one event per token (or fails it)."""

    fail: FinishReason | None = None
    seen: list[GenerationRequest] = field(default_factory=list)

    def validate(self, request: GenerationRequest) -> None:
        if request.adapter_id == "ghost":
            raise InvalidRequest("no ghosts")

    def submit(self, request: GenerationRequest, sink: Callable[[TokenEvent], None]) -> RequestHandle:
        self.seen.append(request)
        tokens = request.prompt_ids[: request.max_new_tokens]
        for i, token in enumerate(tokens):
            last = i == len(tokens) - 1
            finish = (self.fail or FinishReason.LENGTH) if last else None
            sink(TokenEvent((token,), str(token), finish=finish, prompt_tokens=len(request.prompt_ids),
                            generated_tokens=i + 1))  # fmt: skip
        return RequestHandle(request)


@dataclass
class _Loaded:
    settings: Settings
    tokenizer: Any
    engine: Any


class _Runtime:
    def __init__(self, engine: _Engine) -> None:
        self.loaded = _Loaded(Settings(max_new_tokens=3), _Tokenizer(), engine)

    def ready(self) -> _Loaded:
        return self.loaded

    async def off_loop(self, fn: Callable[..., T], *args: object) -> T:
        return fn(*args)


def test_the_engine_client_generates_streams_and_tokenizes() -> None:
    engine = _Engine()
    frontend = Frontend(_Runtime(engine))  # type: ignore[arg-type]
    call = GenerationCall((Input(text="abcd"), Input(text="xy", chat=True)), request_id="r", sampling=Sampling(seed=5))

    async def run() -> None:
        generated = await frontend.generate(call)
        assert generated.request_id == "r"
        first, second = generated.completions
        assert (first.token_ids, first.finish, first.generated_tokens) == ((47, 48, 49), FinishReason.LENGTH, 3)
        assert second.text == "".join(str(ord(c) % 50) for c in "<user>xy"[:3])
        assert [(r.request_id, r.sampling.seed) for r in engine.seen] == [("r/0", 5), ("r/1", 6)]
        events = [e async for e in frontend.stream(GenerationCall((Input(text="ab"),)))]
        assert [e.token_ids for e in events] == [(47,), (48,)] and events[-1].finish is FinishReason.LENGTH
        tokenized = await frontend.tokenize(Input(messages=(ChatMessage("user", "a"),)))
        assert tokenized.rendered_text == "<user>a" and len(tokenized.tokens) == len(tokenized.token_ids) == 7
        with pytest.raises(InvalidRequest, match="no ghosts"):
            await frontend.generate(GenerationCall(TEXT, adapter_id="ghost"))
        with pytest.raises(InvalidRequest) as empty:
            await frontend.generate(GenerationCall((Input(text="a"), Input(text=""))))
        assert empty.value.field == "input.text"
        engine.fail = FinishReason.DEADLINE
        with pytest.raises(DeadlineExceeded):
            [e async for e in frontend.stream(GenerationCall(TEXT))]

    asyncio.run(run())
