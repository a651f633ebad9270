"""Shared fixtures and the capability guard. Tests run on CPU, offline; the real SmolLM2 folder comes from `make model`.

Tests live in one folder per component (model/, loading/, adapters/, medusa/, engine/, threads/, frontend/, api/
(gRPC), proto/, http/, client/, deploy/, metrics/, docs/, fuzz/, bench/); their shared plain helpers in the
`support` package (tests/support/), which this directory being on ``sys.path`` makes importable. No test module
imports another.

Factories: `tiny_llama_factory` (tiny random Llama folders; `tiny_llama_dir` and its `tiny_cfg` are the default
one), `tiny_server` (a started `BackgroundServer` over the tiny served model with `support.servers.TEST_SETTINGS`,
the module's defaults and the test's overrides, closed at teardown), `tiny_peft_adapters` (PEFT adapters for the
tiny Llama), `make_store` (CPU adapter stores for it, closed at teardown), `free_port`; and one default `server`
(with its `channel` and `stub`) per module, started with the module's `server_settings` (a module overrides that
fixture, which may use the module's other fixtures), unless the module needs another model or start-up.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable, Iterator
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import grpc
import pytest
import torch
from loraplex.v1 import generation_pb2_grpc
from support.paths import ROOT

SMOLLM2_DIR = Path(os.environ.get("LORAPLEX_TEST_MODEL", ROOT / "models" / "SmolLM2-135M-Instruct"))
SMOLLM2_GGUF = SMOLLM2_DIR.parent / "SmolLM2-135M-Instruct.Q4_1.gguf"  # `fetch-model` keeps it beside the folder
# pytest's thread keeps torch's default thread count whatever the servers' serial threads set (service.torch_threads)
torch.get_num_threads()


def pytest_report_header(config: pytest.Config) -> str:
    forced = os.environ.get("ATEN_CPU_CAPABILITY")
    how = f"forced by ATEN_CPU_CAPABILITY={forced}" if forced else "the machine's own"
    return f"torch CPU capability: {torch.backends.cpu.get_cpu_capability()} ({how})"


def pytest_sessionstart(session: pytest.Session) -> None:
    """A forced capability torch did not take would make the capability matrix prove nothing: stop instead."""
    forced = os.environ.get("ATEN_CPU_CAPABILITY")
    if forced and torch.backends.cpu.get_cpu_capability() != forced.upper():
        raise pytest.UsageError(
            f"ATEN_CPU_CAPABILITY={forced} but torch dispatches to {torch.backends.cpu.get_cpu_capability()}"
        )


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    import torch

    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


@pytest.fixture(autouse=True)
def _root_logging_restored() -> Iterator[None]:
    """A test that runs ``cli.main(["serve", ...])`` lets ``logs.configure`` bind a root handler to that test's
    captured stderr, which pytest closes afterwards: every later log line would end in "--- Logging error ---".
    Handlers the service's logging set-up added during the test are removed after it (pytest's own are left to
    pytest), the thread excepthook is put back and warnings go back to Python (a later test that routes them
    into its own log would otherwise find them already routed)."""
    root = logging.getLogger()
    before, level, hook = set(root.handlers), root.level, threading.excepthook
    yield
    for handler in list(root.handlers):
        if handler not in before and type(handler.formatter).__module__ == "service.logs":
            root.removeHandler(handler)
            root.setLevel(level)
    threading.excepthook = hook
    logging.captureWarnings(False)  # logs.configure routes warnings into logging; pytest records them itself


@pytest.fixture(scope="session")
def smollm2_dir() -> Path:
    """The real default model. `make test` fetches it first; running pytest alone needs `make model`."""
    if not (SMOLLM2_DIR / "config.json").exists():
        pytest.fail(f"{SMOLLM2_DIR} is missing: run `make model` (make test does it for you)")
    return SMOLLM2_DIR


@pytest.fixture(scope="session")
def smollm2_gguf() -> Path:
    """The Q4_1 GGUF the default model is converted from, kept next to the folder by `make model`."""
    if not SMOLLM2_GGUF.is_file():
        pytest.fail(f"{SMOLLM2_GGUF} is missing: run `make model` (fetch-model keeps the GGUF beside the folder)")
    return SMOLLM2_GGUF


@pytest.fixture(scope="session")
def tiny_llama_factory(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., Path]:
    """``make(**kwargs) -> folder``: ``support.tiny_models.write_tiny_llama`` into a fresh temp folder, once
    per arguments."""
    from support.tiny_models import write_tiny_llama

    made: dict[str, Path] = {}

    def make(**kwargs: Any) -> Path:
        key = repr(sorted(kwargs.items()))
        if key not in made:
            made[key] = write_tiny_llama(tmp_path_factory.mktemp("tiny_llama"), **kwargs)
        return made[key]

    return make


@pytest.fixture(scope="session")
def tiny_llama_dir(tiny_llama_factory: Callable[..., Path]) -> Path:
    """The default tiny random Llama (GQA, untied embeddings), written once per session."""
    return tiny_llama_factory()


@pytest.fixture(scope="session")
def served_tiny_dir(tmp_path_factory: pytest.TempPathFactory, smollm2_dir: Path) -> Path:
    """A tiny random Llama with SmolLM2's vocabulary and tokenizer files: a servable model that runs in ms."""
    from support.tiny_models import write_served_tiny

    return write_served_tiny(tmp_path_factory.mktemp("served_tiny"), smollm2_dir, max_position_embeddings=1024)


@pytest.fixture(scope="module")
def server_settings() -> dict[str, object]:
    """This module's overrides of `support.servers.TEST_SETTINGS` for its ``server``; a module overrides
    this fixture."""
    return {}


@pytest.fixture(scope="module")
def server(served_tiny_dir: Path, server_settings: dict[str, object]) -> Iterator[Any]:
    """One started server per test module over ``served_tiny_dir`` with `support.servers.TEST_SETTINGS` and the module's
    ``server_settings`` (a module that needs another model or start-up defines its own ``server``)."""
    from support.servers import tiny_settings

    from service.api.server import BackgroundServer

    with BackgroundServer(tiny_settings(served_tiny_dir, **server_settings)) as srv:
        yield srv


@pytest.fixture(scope="module")
def channel(server: Any) -> Iterator[grpc.Channel]:
    """An insecure loopback channel to this module's ``server``."""
    with grpc.insecure_channel(server.target) as ch:
        yield ch


@pytest.fixture(scope="module")
def stub(channel: grpc.Channel) -> generation_pb2_grpc.GenerationStub:
    """A Generation stub on this module's ``channel``."""
    return generation_pb2_grpc.GenerationStub(channel)


@pytest.fixture
def tiny_server(served_tiny_dir: Path) -> Iterator[Callable[..., Any]]:
    """``start(*defaults, **settings) -> BackgroundServer``: a started server over ``served_tiny_dir`` (or
    ``model=``) with `support.servers.tiny_settings` defaults, then ``defaults``, then these overrides; every server
    it started is stopped at teardown."""
    from support.servers import tiny_settings

    from service.api.server import BackgroundServer

    with ExitStack() as stack:

        def start(
            *defaults: dict[str, object], model: Path = served_tiny_dir, load: bool = True, **overrides: object
        ) -> BackgroundServer:
            return stack.enter_context(BackgroundServer(tiny_settings(model, *defaults, **overrides), load=load))

        yield start


@pytest.fixture(scope="session")
def tiny_peft_adapters(
    tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Callable[..., dict[str, Path]]:
    """``write(**specs) -> {name: folder}``: one PEFT adapter per ``name={write_peft_adapter keywords}`` over the
    tiny Llama, written by peft (`support.adapter_files.write_peft_adapters`) into a fresh temp folder."""
    from support.adapter_files import write_peft_adapters
    from support.tiny_models import load_hf_llama

    def write(**specs: dict[str, Any]) -> dict[str, Path]:
        return write_peft_adapters(tmp_path_factory.mktemp("peft"), load_hf_llama(tiny_llama_dir), specs)

    return write


@pytest.fixture(scope="session")
def tiny_cfg(tiny_llama_dir: Path) -> Any:
    """The default tiny Llama's `ModelConfig`."""
    from service.model.config import ModelConfig

    return ModelConfig.from_hf(tiny_llama_dir)


@pytest.fixture
def make_store(tiny_cfg: Any) -> Iterator[Callable[..., Any]]:
    """``make(device_budget=1 MiB, host_budget=1 MiB, dtype=fp32, roots=(), overflow=0) -> AdapterStore``: a CPU
    adapter store for the tiny Llama (`support.stores.new_store`); every store it made is closed at teardown."""
    from support.stores import new_store

    with ExitStack() as stack:
        yield lambda **kw: stack.enter_context(new_store(tiny_cfg, **kw))


@pytest.fixture
def free_port() -> int:
    """A loopback port nothing listens on right now."""
    from support.servers import free_port as pick

    return pick()
