"""docs/flags.md is what ``scripts/gen_flags.py`` writes from the CLI's own definitions: run ``make docs`` after
changing a flag."""

from __future__ import annotations

import importlib.util
from types import ModuleType

import pytest
from support.paths import ROOT

from service.cli import SERVE_FLAGS, build_parser

PAGE = ROOT / "docs" / "flags.md"


def _gen_flags() -> ModuleType:
    spec = importlib.util.spec_from_file_location("gen_flags", ROOT / "scripts" / "gen_flags.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_flag_reference_is_current() -> None:
    assert PAGE.read_text() == _gen_flags().render(), "docs/flags.md is stale: run `make docs`"


def test_every_serve_flag_is_in_a_group_and_on_the_page(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LORAPLEX_TARGET", "10.9.8.7:1")  # read by the client commands' defaults, never written
    text = _gen_flags().render()
    assert "10.9.8.7" not in text
    grouped = [flag.name for _, flags in SERVE_FLAGS for flag in flags]
    assert len(grouped) == len(set(grouped))
    (serve,) = [a for a in build_parser()._actions if a.dest == "command"]
    parsed = {o for a in serve.choices["serve"]._actions for o in a.option_strings} - {"-h", "--help"}
    assert {o for o in parsed if not o.startswith("--no-")} == set(grouped)
    for name in grouped:
        assert f"| `{name}" in text, name
