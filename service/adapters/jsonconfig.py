"""Reading an adapter folder's JSON config: one JSON object, or an ``InvalidAdapter`` naming the file.

Shared by the PEFT LoRA (``adapter_config.json``) and Medusa (``config.json``) formats; it knows neither format's
fields, and never raises anything but ``InvalidAdapter``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from service.errors import InvalidAdapter


def read_json_object(path: Path, missing: str) -> dict[str, Any]:
    """The JSON object in ``path``; ``missing`` is the message when the file does not exist."""
    try:
        raw = json.loads(Path(path).read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise InvalidAdapter(missing, file=path) from None
    except (OSError, ValueError, RecursionError) as e:  # ValueError: bad UTF-8 / JSON, a number past int()'s limit
        raise InvalidAdapter(f"cannot read JSON: {e}", file=path) from None
    if not isinstance(raw, dict):
        raise InvalidAdapter("expected a JSON object", file=path)
    return raw


def is_int(value: Any) -> bool:
    """An integer that is not a bool (JSON ``true`` parses as one)."""
    return isinstance(value, int) and not isinstance(value, bool)


def short_repr(value: Any, limit: int = 200) -> str:
    """``repr(value)``, cut to ``limit`` characters (a config value can be any size)."""
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


__all__ = ["is_int", "read_json_object", "short_repr"]
