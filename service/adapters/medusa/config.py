"""The Medusa adapter config: ``config.json`` (``medusa_num_heads``, ``medusa_num_layers``, optional ``version``).

Pure parsing and validation: every problem is an ``InvalidAdapter`` naming the file; no tensor is read. The file
format as a whole (weights, names, shapes) is ``service.adapters.medusa.format``.

The three numbers are read as published: a JSON integer, an integral float (``2.0``) or a string of decimal digits
(FasterDecoding's medusa-2 trainer writes ``"version": "2"``); a bool, a fraction or any other text is refused.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from service.adapters.common.files import is_int, read_json_object, short_repr
from service.errors import InvalidAdapter

CONFIG_FILE = "config.json"


@dataclass(frozen=True, slots=True)
class MedusaConfig:
    """The fields of a Medusa ``config.json``. ``version`` is None when the config does not say."""

    num_heads: int
    num_layers: int
    version: int | None
    base_model_name_or_path: str | None


def read_medusa_config(path: Path) -> MedusaConfig:
    """Parse and validate a Medusa ``config.json``; every problem is an ``InvalidAdapter`` naming the file."""

    def fail(message: str) -> InvalidAdapter:
        return InvalidAdapter(message, file=path)

    raw = read_json_object(path, "file not found: a Medusa adapter folder needs config.json")
    missing = [key for key in ("medusa_num_heads", "medusa_num_layers") if key not in raw]
    if missing:
        raise fail(
            f"missing key(s) {', '.join(missing)}: a Medusa config.json needs medusa_num_heads and medusa_num_layers"
        )
    heads, layers = _count(raw["medusa_num_heads"]), _count(raw["medusa_num_layers"])
    if heads is None or heads < 1:
        raise fail(f"medusa_num_heads must be an integer >= 1, got {short_repr(raw['medusa_num_heads'])}")
    if layers is None or layers < 0:
        raise fail(f"medusa_num_layers must be an integer >= 0, got {short_repr(raw['medusa_num_layers'])}")
    version = _version(raw.get("version"), fail)
    if version == 2 and layers < 1:
        raise fail("medusa_num_layers must be >= 1 for version 2 heads (with no block a v2 head is the lm_head)")
    base = raw.get("base_model_name_or_path")
    return MedusaConfig(
        num_heads=heads,
        num_layers=layers,
        version=version,
        base_model_name_or_path=base if isinstance(base, str) else None,
    )


def is_medusa_folder(folder: Path) -> bool:
    """True when ``folder/config.json`` is a JSON object naming ``medusa_num_heads`` (a base model's never does).
    Only a regular file is read (a FIFO or device would block or never end)."""
    path = Path(folder) / CONFIG_FILE
    if not path.is_file():
        return False
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError, RecursionError):
        return False
    return isinstance(raw, dict) and "medusa_num_heads" in raw


_MAX_DIGITS = 18  # a count written as text: more digits than any real config has is refused, not parsed


def _count(value: Any) -> int | None:
    """``value`` as an integer when it is one as published (``3``, ``3.0``, ``"3"``); None otherwise."""
    if is_int(value):
        return int(value)
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, str) and 0 < len(value) <= _MAX_DIGITS and value.isascii() and value.isdigit():
        return int(value)
    return None


def _version(value: Any, fail: Callable[[str], InvalidAdapter]) -> int | None:
    if value is None:
        return None
    version = _count(value)
    if version not in (1, 2):
        raise fail(f'version must be 1 or 2 (or "1" / "2") when given, got {short_repr(value)}')
    return version


__all__ = ["CONFIG_FILE", "MedusaConfig", "is_medusa_folder", "read_medusa_config"]
