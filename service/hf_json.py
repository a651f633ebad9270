"""The JSON files of a Hugging Face model folder (config.json, generation_config.json, tokenizer_config.json).

One reader for the model config and the tokenizer, so both refuse a bad file the same way: every failure (missing,
unreadable, not UTF-8, not JSON, nested past the recursion limit, not an object) is a ``CheckpointError`` naming
the file, never a bare ``OSError`` / ``ValueError`` / ``RecursionError``. Reads files only; knows no field but
``eos_token_id``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from service.errors import CheckpointError

__all__ = ["eos_token_ids", "read_json_object"]


def read_json_object(path: Path, *, missing_ok: bool = False) -> dict[str, Any]:
    """The JSON object in ``path``; ``{}`` for a missing file when ``missing_ok`` (an optional file)."""
    if missing_ok and not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise CheckpointError("file not found", file=path) from None
    except (OSError, ValueError, RecursionError) as exc:  # ValueError: bad UTF-8 / JSON, a number past int()'s limit
        raise CheckpointError(f"cannot read JSON: {exc}", file=path) from None
    if not isinstance(data, dict):
        raise CheckpointError("expected a JSON object", file=path)
    return data


def eos_token_ids(value: Any, source: Path | str) -> list[int]:
    """An ``eos_token_id`` value: absent, one id, or a list of ids; anything else is refused, naming ``source``."""
    if value is None:
        return []
    if isinstance(value, int) and not isinstance(value, bool):
        return [value]
    if isinstance(value, list) and all(isinstance(v, int) and not isinstance(v, bool) for v in value):
        return list(value)
    raise CheckpointError(f"eos_token_id must be an integer or a list of integers, got {value!r}", file=source)
