"""The constraint checks before compiling, the llguidance backend's errors, and the compiled-grammar cache's state
after each lookup (hits, misses, single flight, LRU eviction by bytes)."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import pytest
from support.engines import grammar_cache

from service import metrics
from service.constraints import llg
from service.constraints.cache import GrammarCache
from service.constraints.llg import LLGuidanceBackend, LLGuidanceGrammar
from service.constraints.spec import Constraint, ConstraintLimits, check_constraint
from service.errors import InvalidRequest

LIMITS = ConstraintLimits(max_bytes=64, max_choices=3, max_depth=4)


@pytest.mark.parametrize(
    ("constraint", "field", "words"),
    [
        (Constraint("xml"), "constraint", "kind must be one of"),
        (Constraint("regex", "a" * 65), "constraint", r"at most 64 \(--max-constraint-bytes\)"),
        (Constraint("regex", "é" * 33), "constraint", "at most 64"),  # 66 bytes of UTF-8, 33 characters
        (Constraint("choice", choices=("a", "b", "c", "d")), "constraint.choice", "--max-constraint-choices"),
        (Constraint("choice"), "constraint.choice", "at least one"),
        (Constraint("choice", choices=("a", "")), "constraint.choice", "must not be empty"),
        (Constraint("grammar", "start: a", "ebnf"), "constraint.grammar", "dialect must be one of"),
        (Constraint("json_schema", "  "), "constraint.json_schema", "is empty"),
        (Constraint("regex"), "constraint.regex", "is empty"),
    ],
)
def test_checks_refuse_by_field_before_compiling(constraint: Constraint, field: str, words: str) -> None:
    with pytest.raises(InvalidRequest, match=words) as info:
        check_constraint(constraint, LIMITS)
    assert info.value.field == field


def test_checks_pass_what_is_within_every_limit() -> None:
    for c in (
        Constraint("json_object"),
        Constraint("choice", choices=("yes", "no")),
        Constraint("grammar", 'root ::= "x"', "gbnf"),
        Constraint("regex", "[0-9]+"),
    ):
        check_constraint(c, LIMITS)


def test_the_key_tells_every_part_apart() -> None:
    keys = {
        Constraint("regex", "ab").key,
        Constraint("regex", "a", choices=("b",)).key,
        Constraint("choice", choices=("ab",)).key,
        Constraint("choice", choices=("a", "b")).key,
        Constraint("grammar", "ab", "lark").key,
        Constraint("grammar", "ab", "gbnf").key,
    }
    assert len(keys) == 6


@pytest.fixture(scope="module")
def backend(smollm2_dir: Path) -> LLGuidanceBackend:
    backend = grammar_cache(smollm2_dir).backend
    assert isinstance(backend, LLGuidanceBackend)
    return backend


@pytest.mark.parametrize(
    ("constraint", "field", "words"),
    [
        (Constraint("json_schema", "{not json"), "constraint.json_schema", "not valid JSON"),
        (Constraint("json_schema", "[1, 2]"), "constraint.json_schema", "must be a JSON object"),
        (Constraint("json_schema", '{"type": 5}'), "constraint.json_schema", "cannot be compiled"),
        (Constraint("json_schema", '{"$ref": "#/missing"}'), "constraint.json_schema", "cannot be compiled"),
        (Constraint("regex", "[unclosed"), "constraint.regex", "unclosed character class"),
        (Constraint("grammar", "start: missing_rule", "lark"), "constraint.grammar", "unknown name"),
        (Constraint("grammar", "root ::= (", "gbnf"), "constraint.grammar", "constraint"),
    ],
)
def test_the_backend_names_what_it_cannot_compile(
    backend: LLGuidanceBackend, constraint: Constraint, field: str, words: str
) -> None:
    with pytest.raises(InvalidRequest, match=words) as info:
        backend.compile(constraint)
    assert info.value.field == field


def test_nesting_is_bounded_on_the_text_before_parsing(
    backend: LLGuidanceBackend, monkeypatch: pytest.MonkeyPatch
) -> None:
    deep = '{"items": ' * 100_000 + "{}" + "}" * 100_000  # a parser would recurse 100,000 levels
    with monkeypatch.context() as patched:  # refused by the scan of the text: the JSON parser is never reached
        patched.setattr(llg.json, "loads", lambda *_a, **_k: pytest.fail("the schema was parsed"))
        with pytest.raises(InvalidRequest, match="--max-constraint-depth") as info:
            backend.compile(Constraint("json_schema", deep))
    assert info.value.field == "constraint.json_schema" and info.value.limit == 32
    brackets_in_strings = json.dumps({"description": "[" * 100, "type": "string"})
    backend.compile(Constraint("json_schema", brackets_in_strings))  # brackets inside strings do not nest


def _lookups() -> tuple[float, float]:
    c = metrics.CONSTRAINT_CACHE_LOOKUPS
    return c.labels("hit")._value.get(), c.labels("miss")._value.get()


def _regex(i: int) -> Constraint:
    return Constraint("regex", f"[a-z]{{{i}}}")


def test_the_cache_keeps_by_content_and_evicts_least_recently_used(backend: LLGuidanceBackend) -> None:
    one = backend.compile(_regex(1)).nbytes
    cache = GrammarCache(backend, budget_bytes=3 * one + one // 2)  # room for three grammars of this size
    hits, misses = _lookups()
    first = cache.get(_regex(1))
    assert cache.get(_regex(1)) is first  # a hit: the same compiled grammar
    assert _lookups() == (hits + 1, misses + 1)
    cache.get(_regex(2))
    cache.get(_regex(3))
    assert cache.keys() == [_regex(1).key, _regex(2).key, _regex(3).key]
    cache.get(_regex(1))  # used again: now the most recent
    cache.get(_regex(4))  # over the budget: the least recently used (2) goes
    assert cache.keys() == [_regex(3).key, _regex(1).key, _regex(4).key]
    assert cache.held_bytes <= cache.budget_bytes
    assert metrics.CONSTRAINT_CACHE_BYTES._value.get() == cache.held_bytes


def test_a_zero_budget_keeps_nothing(backend: LLGuidanceBackend) -> None:
    cache = GrammarCache(backend, budget_bytes=0)
    assert cache.get(_regex(2)) is not cache.get(_regex(2))
    assert cache.keys() == [] and cache.held_bytes == 0


def test_a_failed_compile_is_remembered_and_refused_at_once(backend: LLGuidanceBackend) -> None:
    slow = _SlowBackend(backend)
    slow.release.set()
    cache = GrammarCache(slow, budget_bytes=1 << 20)  # type: ignore[arg-type]
    bad = Constraint("regex", "(")
    errors = []
    for _ in range(3):
        with pytest.raises(InvalidRequest, match="cannot be compiled") as info:
            cache.get(bad)
        errors.append(info.value)
    assert slow.compiles == 1 and cache.keys() == [bad.key]
    assert len({id(e) for e in errors}) == 3  # a fresh error each time, never the kept instance


def test_submit_compiles_on_the_cache_pool_and_answers_hits_at_once(backend: LLGuidanceBackend) -> None:
    cache = GrammarCache(backend, budget_bytes=1 << 20)
    try:
        first = cache.submit(_regex(6)).result(10)
        again = cache.submit(_regex(6))
        assert again.done() and again.result() is first
    finally:
        cache.close()


def test_a_regex_of_nested_repeats_compiles_with_its_first_mask(backend: LLGuidanceBackend) -> None:
    import torch

    grammar = backend.compile(Constraint("regex", "(a{40}){40}"))
    bits = torch.zeros((backend.vocab + 31) // 32, dtype=torch.int32)
    matcher = grammar.start()
    matcher.fill_mask(bits.data_ptr(), bits.numel() * 4)
    assert matcher.error == "" and int(bits.count_nonzero()) > 0


class _SlowBackend:
    """The real backend, each compile held until the test lets it go."""

    def __init__(self, inner: LLGuidanceBackend) -> None:
        self.inner = inner
        self.release, self.compiles = threading.Event(), 0

    def compile(self, constraint: Constraint) -> LLGuidanceGrammar:
        self.compiles += 1
        assert self.release.wait(10)
        return self.inner.compile(constraint)

    def fill_masks(self, *args: object) -> None:
        raise AssertionError("not used")


def test_concurrent_lookups_of_a_new_constraint_compile_it_once(backend: LLGuidanceBackend) -> None:
    slow = _SlowBackend(backend)
    cache = GrammarCache(slow, budget_bytes=1 << 30)  # type: ignore[arg-type]
    results: list[object] = []
    threads = [threading.Thread(target=lambda: results.append(cache.get(_regex(5)))) for _ in range(4)]
    for t in threads:
        t.start()
    time.sleep(0.2)
    slow.release.set()
    for t in threads:
        t.join(10)
    assert slow.compiles == 1 and len(results) == 4 and all(r is results[0] for r in results)
