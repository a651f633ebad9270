"""docs/limits.md names every field ``ModelInfo.limits`` reports: a limit added to the proto is added to the page."""

from __future__ import annotations

from support.paths import ROOT

from service.api.generation import LIMIT_FIELDS


def test_every_reported_limit_is_named_on_the_limits_page() -> None:
    text = (ROOT / "docs" / "limits.md").read_text()
    missing = [name for name in LIMIT_FIELDS if f"`{name}`" not in text]
    assert not missing, f"docs/limits.md does not name ModelInfo.limits fields {missing}"
