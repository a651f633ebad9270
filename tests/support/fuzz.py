"""Shared pieces of the property-based fuzzers (tests/fuzz/): run sizes and JSON-ish strategies.

Two run sizes, chosen with ``LORAPLEX_FUZZ=short|long`` (default short):

- ``short``: a few hundred examples per target, what ``make test`` runs (a few seconds in all);
- ``long``: ten thousand examples per target, run by hand before a release (see bench/README.md,
  "Fuzzing").

No example database is kept (``database=None``): a failure prints the ``@reproduce_failure`` blob to replay it,
and nothing is written into the checkout.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable
from typing import Any, TypeVar

from hypothesis import HealthCheck, event, settings
from hypothesis import strategies as st

from service.errors import LoraplexError

T = TypeVar("T")

_RUNS = {
    "short": settings(max_examples=200, deadline=None, database=None, print_blob=True),
    "long": settings(
        max_examples=10_000,
        deadline=None,
        database=None,
        print_blob=True,
        suppress_health_check=[HealthCheck.too_slow],
    ),
}


def fuzz_settings() -> settings:
    """The settings of the run size named by ``LORAPLEX_FUZZ`` (``short`` when unset)."""
    name = os.environ.get("LORAPLEX_FUZZ", "short")
    if name not in _RUNS:
        raise ValueError(f"LORAPLEX_FUZZ must be one of {sorted(_RUNS)}, got {name!r}")
    return _RUNS[name]


def typed_outcome(call: Callable[[], T]) -> T | LoraplexError:
    """``call()``'s result, or the ``LoraplexError`` it raised; any other exception propagates (a bug).

    Each outcome is recorded as a hypothesis event, so ``pytest --hypothesis-show-statistics`` shows how the
    examples split between results and each error class."""
    try:
        result = call()
    except LoraplexError as e:
        assert str(e), f"{type(e).__name__} without a message"
        event(type(e).__name__)
        return e
    event("ok")
    return result


# Integers a parser must survive: ordinary, negative, 64-bit edges, and ones too long for float() or str().
EDGE_INTS = st.one_of(
    st.integers(-4, 70),
    st.sampled_from([2**31 - 1, 2**32, 2**63 - 1, 2**63, 2**64 - 1, 2**64, -(2**63), 10**308, 10**400]),
    st.integers(),
)
EDGE_FLOATS = st.one_of(st.floats(allow_nan=True, allow_infinity=True), st.sampled_from([0.0, -0.0, 1e-45, 1e308]))
SCALARS = st.one_of(st.none(), st.booleans(), EDGE_INTS, EDGE_FLOATS, st.text(max_size=12))


def json_values(leaves: st.SearchStrategy[Any] = SCALARS) -> st.SearchStrategy[Any]:
    """Any JSON value (lists and objects nested a few deep) built from ``leaves``."""
    return st.recursive(
        leaves,
        lambda inner: st.one_of(st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=8), inner, max_size=4)),
        max_leaves=12,
    )


def text_mutations(text: str) -> st.SearchStrategy[str]:
    """``text`` cut, spliced or wrapped the ways a damaged or hostile JSON file would be."""
    n = len(text)
    cut = st.integers(0, n)
    return st.one_of(
        st.just(text),
        cut.map(lambda i: text[:i]),
        st.tuples(cut, st.text(max_size=8)).map(lambda t: text[: t[0]] + t[1] + text[t[0] :]),
        st.tuples(cut, cut).map(lambda t: text[: min(t)] + text[max(t) :]),
        st.integers(1, 50_000).map(lambda d: '{"x":' * d + text + "}" * d),  # nesting past the recursion limit
        # a number longer than int()'s digit limit (sys.get_int_max_str_digits)
        st.integers(4_301, 6_000).map(lambda d: re.sub(r"(?<=[\[ ,:])\d+", "9" * d, text, count=1)),
    )
