"""Regular expressions from adapter configs (PEFT ``target_modules``, ``rank_pattern`` keys, ...): can they run?

A config is outside input and Python's ``re`` backtracks, so a pattern is checked before it is ever matched:
it must compile (``re.error``, and the ``OverflowError`` / ``RecursionError`` that repeat counts and nesting past
``re``'s limits raise instead), and no repeat (max > 1) may hold another repeat or an alternation — the shapes
(``(.*)*``, ``(a+)+``, ``(ab|a)*``) that take exponential time to fail. Nothing here matches a name.
"""

from __future__ import annotations

import importlib
import re
from typing import Any

_PARSER: Any = importlib.import_module("re._parser")  # the parser behind re.compile (typeshed does not declare it)
_REPEATS = ("MAX_REPEAT", "MIN_REPEAT", "POSSESSIVE_REPEAT")


def regex_problem(pattern: str) -> str | None:
    """Why ``pattern`` cannot be used (a phrase to follow the pattern in a message), or None when it can."""
    try:
        re.compile(pattern)
        nested = _nested_repeat(_PARSER.parse(pattern))
    except (re.error, OverflowError, RecursionError) as e:
        return f"is not a valid regular expression: {e}"
    if nested:
        return (
            "repeats a group that itself repeats or alternates, which can take exponential time to match; "
            "write it without the nested repetition (e.g. '.*' instead of '(.*)*')"
        )
    return None


def _nested_repeat(parsed: Any, *, inside: bool = False) -> bool:
    """True when a repeat (max > 1) holds another repeat (max > 1) or an alternation. ``parsed`` is
    ``re._parser.parse(pattern)`` or a part of it; ``inside``: already within such a repeat."""
    for op, av in parsed:
        name = str(op)
        if name in _REPEATS:
            _low, high, body = av
            if high > 1 and (inside or _nested_repeat(body, inside=True)):
                return True
            if _nested_repeat(body, inside=inside):
                return True
        elif (name == "BRANCH" and inside) or any(_nested_repeat(part, inside=inside) for part in _subpatterns(av)):
            return True
    return False


def _subpatterns(av: Any) -> list[Any]:
    if isinstance(av, _PARSER.SubPattern):
        return [av]
    if isinstance(av, (tuple, list)):
        return [p for x in av for p in _subpatterns(x)]
    return []
