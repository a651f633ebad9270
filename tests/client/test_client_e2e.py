"""The client package and the `loraplex` CLI against a real server over loopback gRPC."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
from loraplex import AsyncClient, Client, FinishReason, InvalidArgument, NotFound, Unavailable

from service.api.server import BackgroundServer

# The test defaults (`support.servers.TEST_SETTINGS`) with the server's own queue and longer requests; a mixture
# limit off its default so `model_info` shows the server's value.
SETTINGS: dict[str, object] = {
    "max_queue": 256,
    "max_prompt_tokens": 256,
    "max_new_tokens": 128,
    "max_mixture_adapters": 3,
}


@pytest.fixture(scope="module")
def server_settings() -> dict[str, object]:
    return SETTINGS


def test_client_generate_stream_tokenize_info(server: BackgroundServer) -> None:
    with Client(server.target, timeout=60) as client:
        assert client.health().name == "SERVING"
        one = client.generate("Hello", max_new_tokens=12, ignore_eos=True, return_token_ids=True)
        assert one.finish_reason is FinishReason.LENGTH and len(one.token_ids) == 12
        deltas = list(client.stream("Hello", max_new_tokens=12, ignore_eos=True, return_token_ids=True))
        assert "".join(d.text for d in deltas) == one.text
        assert deltas[-1].finish_reason is FinishReason.LENGTH and deltas[-1].usage is not None
        both = client.generate(["Hello", "Goodbye"], max_new_tokens=4, ignore_eos=True)
        assert len(both) == 2 and both[0].text == client.generate("Hello", max_new_tokens=4, ignore_eos=True).text
        assert client.tokenize("Hello world").token_ids
        info = client.model_info()
        assert info.vocab_size == 49152 and info.limits.max_new_tokens == 128
        assert info.limits.max_mixture_adapters == 3
        with pytest.raises(NotFound) as err:
            client.generate("x", adapter="missing", max_new_tokens=2)
        assert "missing" in str(err.value)
        with pytest.raises(InvalidArgument, match="max_new_tokens"):
            client.generate("x", max_new_tokens=100000)


def test_async_client_concurrent_streams(server: BackgroundServer) -> None:
    async def run() -> list[str]:
        async with AsyncClient(server.target, timeout=60) as client:

            async def one(prompt: str) -> str:
                return "".join([d.text async for d in client.stream(prompt, max_new_tokens=10, ignore_eos=True)])

            return await asyncio.gather(*(one(f"prompt {i}") for i in range(6)))

    texts = asyncio.run(run())
    with Client(server.target, timeout=60) as client:
        for i, text in enumerate(texts):
            assert text == client.generate(f"prompt {i}", max_new_tokens=10, ignore_eos=True).text


def test_unavailable_while_loading(tiny_server: Callable[..., BackgroundServer]) -> None:
    srv = tiny_server(load=False, **SETTINGS)
    with (
        Client(srv.target, timeout=10) as client,
        pytest.raises(Unavailable, match="loading"),
    ):
        client.generate("too early", max_new_tokens=2)


def cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "service.cli", *args], capture_output=True, text=True, timeout=120, check=False
    )


def test_cli_generate_json_tokenize_info(server: BackgroundServer) -> None:
    out = cli("generate", "--target", server.target, "--raw", "--max-new-tokens", "5", "--json", "Hello")
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout)
    assert result["usage"]["generated_tokens"] <= 5 and len(result["token_ids"]) == result["usage"]["generated_tokens"]
    streamed = cli("generate", "--target", server.target, "--raw", "--max-new-tokens", "5", "Hello")
    assert streamed.returncode == 0 and streamed.stdout.strip() == result["text"].strip()
    tok = cli("tokenize", "--target", server.target, "Hello world")
    assert json.loads(tok.stdout)["token_ids"]
    info = cli("info", "--target", server.target)
    shown = json.loads(info.stdout)
    assert shown["vocab_size"] == 49152 and shown["limits"]["max_mixture_adapters"] == 3
    bad = cli("generate", "--target", server.target, "--adapter", "nope", "Hello")
    assert bad.returncode != 0 and "nope" in bad.stderr


@pytest.mark.slow
def test_cli_demo_question_gets_paris(tiny_server: Callable[..., BackgroundServer], smollm2_dir: Path) -> None:
    srv = tiny_server(model=smollm2_dir, **SETTINGS)
    out = cli("generate", "--target", srv.target, "What is the capital of France?")
    assert out.returncode == 0, out.stderr
    assert "Paris" in out.stdout
