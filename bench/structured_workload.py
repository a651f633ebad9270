"""The constrained workload of bench/structured.py, shared by loraplex's side and vLLM's (standard library only).

vLLM's runner imports this module from its own virtualenv, so it imports nothing outside the standard library. It
fixes what "the same rows" means: stream ``i`` uses adapter ``i mod adapters``, prompt ``prompt(i)`` and, when
constrained, schema ``schema(i, salt)``. A schema asks for an object whose last property is an array of at least
``LONG_ITEMS`` integers, so no constrained row can complete its grammar inside ``NEW_TOKENS`` tokens: every row,
free or constrained, generates exactly ``NEW_TOKENS`` tokens, and the two throughputs are of the same token counts.
``typical_schema`` is the other corpus: objects of 5 to 50 properties of mixed types, for compile times and
for outputs that finish.
"""

from __future__ import annotations

import json
from typing import Any

__all__ = ["LONG_ITEMS", "NEW_TOKENS", "prompt", "schema", "typical_schema"]

NEW_TOKENS = 48
LONG_ITEMS = 200

_TYPES = ({"type": "integer"}, {"type": "string", "maxLength": 12}, {"type": "boolean"}, {"enum": ["a", "b", "c"]})


def prompt(i: int) -> str:
    """Stream ``i``'s prompt, plain text (no chat template)."""
    return f"Describe robot number {i} as a JSON object:"


def schema(i: int, salt: str = "") -> dict[str, Any]:
    """Stream ``i``'s schema: distinct per ``(i, salt)`` (its property names carry both), never complete within
    ``NEW_TOKENS`` tokens."""
    props: dict[str, Any] = {f"{salt}f{i}_{k}": _TYPES[(i + k) % len(_TYPES)] for k in range(2 + i % 4)}
    props[f"{salt}readings{i}"] = {"type": "array", "items": {"type": "integer"}, "minItems": LONG_ITEMS}
    return {"type": "object", "properties": props, "required": list(props), "additionalProperties": False}


def typical_schema(i: int, properties: int) -> dict[str, Any]:
    """A schema of ``properties`` properties (strings, integers, numbers, booleans, enums, a nested object and an
    array), distinct per ``i``."""
    kinds: list[dict[str, Any]] = [
        {"type": "string"},
        {"type": "integer", "minimum": 0},
        {"type": "number"},
        {"type": "boolean"},
        {"enum": ["red", "green", "blue", f"c{i}"]},
        {"type": "array", "items": {"type": "string"}, "maxItems": 5},
        {"type": "object", "properties": {"x": {"type": "integer"}, "y": {"type": "integer"}}, "required": ["x"]},
    ]
    props = {f"p{i}_{k}": kinds[k % len(kinds)] for k in range(properties)}
    return {"type": "object", "properties": props, "required": list(props)[: max(1, properties // 2)]}


def schema_text(s: dict[str, Any]) -> str:
    return json.dumps(s, separators=(",", ":"))
