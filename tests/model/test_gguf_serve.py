"""``loraplex serve --gguf`` end to end over real gRPC: a LoRA on the GGUF base against peft on its weights.

The served model is a tiny random Llama with SmolLM2's tokenizer (``served_tiny_dir``) written to GGUF by the
``gguf`` package (Q8_0 embedding, Q4_1 projections); the reference is transformers + peft on the same weights
dequantized by ``gguf`` (tests/support/gguf_files.py). The adapter, written by peft, targets all seven projections.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from loraplex import Client
from support.adapter_files import load_peft_model, reference_greedy, write_peft_adapter
from support.gguf_files import write_reference_folder, write_tiny_gguf

from service.errors import GGUFError
from service.tokenizer import Tokenizer

pytestmark = pytest.mark.numerics

ALL_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
PROMPTS = [f"Write a short story about a robot number {i}." for i in range(3)]
NEW_TOKENS = 12


@pytest.fixture(scope="module")
def files(served_tiny_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    tmp = tmp_path_factory.mktemp("gguf_serve")
    gguf = write_tiny_gguf(served_tiny_dir, tmp / "served.gguf", types={"token_embd": "Q8_0"})
    reference = write_reference_folder(served_tiny_dir, gguf, tmp / "reference")
    adapter = write_peft_adapter(tmp / "all", reference, r=8, alpha=16, target_modules=ALL_PROJECTIONS, scale=0.5)
    return {"gguf": gguf, "reference": reference, "adapter": adapter}


def _peft_greedy(model: Any, prompt: list[int]) -> list[int]:
    return reference_greedy(model, prompt, NEW_TOKENS)


def test_lora_on_the_served_gguf_matches_peft(
    tiny_server: Callable[..., Any], files: dict[str, Path], served_tiny_dir: Path
) -> None:
    srv = tiny_server(gguf=files["gguf"], adapters=(("all", files["adapter"]),))
    tokenizer = Tokenizer.from_folder(served_tiny_dir)
    peft_model = load_peft_model(files["reference"], {"all": files["adapter"]})
    with Client(srv.target, timeout=120) as client:
        assert client.model_info().load_mode == "gguf"
        for text in PROMPTS:
            ids = tokenizer.encode(text)
            got = client.generate(
                text, adapter="all", max_new_tokens=NEW_TOKENS, ignore_eos=True, return_token_ids=True
            ).token_ids
            assert list(got) == _peft_greedy(peft_model, ids), text
            base = client.generate(text, max_new_tokens=NEW_TOKENS, ignore_eos=True, return_token_ids=True)
            with peft_model.disable_adapter():
                assert list(base.token_ids) == _peft_greedy(peft_model, ids), text


def test_a_corrupt_gguf_fails_the_load_by_name(
    tiny_server: Callable[..., Any], files: dict[str, Path], tmp_path: Path
) -> None:
    """A server given a truncated GGUF stays NOT_SERVING; its load fails with the typed error naming file and tensor."""
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    bad = tmp_path / "cut.gguf"
    bad.write_bytes(files["gguf"].read_bytes()[:-100])
    srv = tiny_server(gguf=bad, load=False)
    with pytest.raises(GGUFError, match="truncated") as info:
        srv.call(srv.server.load())
    assert info.value.file == str(bad) and info.value.tensor is not None
    with grpc.insecure_channel(srv.target) as channel:
        status = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10).status
    assert status == health_pb2.HealthCheckResponse.NOT_SERVING


def test_gguf_setting_from_flag_and_env_and_its_refusals() -> None:
    from service.cli import build_parser, serve_settings
    from service.config import ConfigError, Settings

    assert serve_settings(build_parser().parse_args(["serve", "--gguf", "m.gguf"]), env={}).gguf == Path("m.gguf")
    assert Settings.from_env({"LORAPLEX_GGUF": "w.gguf"}).gguf == Path("w.gguf")
    assert Settings.from_env({"LORAPLEX_GGUF": ""}).gguf is None
    with pytest.raises(ConfigError, match="served as stored"):
        Settings.from_env({}, gguf=Path("m.gguf"), quantize="int4")
    with pytest.raises(ConfigError, match="CPU only"):
        Settings.from_env({}, gguf=Path("m.gguf"), device="cuda")
