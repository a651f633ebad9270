"""Fixtures the HTTP API's end-to-end modules share: the official ``openai`` client on the module's ``server``,
and the base model's name (what ``model`` is for it)."""

from __future__ import annotations

from pathlib import Path

import openai
import pytest
from support.http_api import base_url

from service.api.server import BackgroundServer


@pytest.fixture(scope="module")
def client(server: BackgroundServer) -> openai.OpenAI:
    """The module's own ``server`` fixture, through the official client (no retries: a failure shows at once)."""
    return openai.OpenAI(base_url=base_url(server), api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def model(smollm2_dir: Path) -> str:
    return smollm2_dir.resolve().name
