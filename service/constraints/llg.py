"""The llguidance backend: constraints compiled into llguidance grammars, masks filled by its Rust executor.

llguidance (https://github.com/guidance-ai/llguidance) builds its lexer and Earley parser lazily, so compiling
a JSON schema costs milliseconds and every step's mask is computed from the row's parser state; ``LLExecutor``
fills many rows' masks in parallel with the GIL released. Chosen over xgrammar and outlines-core by measurement
(bench/README.md, structured output). Its limits (``LLParserLimits``) bound the work of a compile and of every
step, so a hostile grammar fails its own row instead of stalling the others.

A schema is parsed here (off the event loop) and its nesting bounded before llguidance sees it. Errors from
llguidance become ``InvalidRequest`` naming the constraint kind and llguidance's own message.
"""

from __future__ import annotations

import json
from collections.abc import Sequence

import llguidance

from service.constraints.backend import Matcher
from service.constraints.spec import CHOICE, GRAMMAR, JSON_OBJECT, JSON_SCHEMA, REGEX, Constraint
from service.errors import InvalidRequest, shorten

# What the cache charges a grammar beyond its text: llguidance's lexer and parser tables live outside Python's
# view and grow as rows walk the grammar; this lies between a fresh compile's and a walked one's RSS growth
# (bench/README.md, structured output: the grammar engine).
_GRAMMAR_OVERHEAD_BYTES = 256 << 10
# One space after "," and ":" (how most JSON a model has read is written), no other whitespace: a model cannot
# pad its output with newlines until its token limit.
_JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


class LLGuidanceMatcher:
    """One row's llguidance matcher."""

    __slots__ = ("_m",)

    def __init__(self, matcher: llguidance.LLMatcher) -> None:
        self._m = matcher

    def consume(self, token: int) -> bool:
        return bool(self._m.consume_token(token))

    def rollback(self, count: int) -> None:
        if count:
            self._m.rollback(count)

    def valid_prefix(self, tokens: Sequence[int]) -> int:
        return int(self._m.validate_tokens(list(tokens))) if tokens else 0

    def fill_mask(self, address: int, nbytes: int) -> None:
        self._m.unsafe_compute_mask_ptr(address, nbytes)

    @property
    def finished(self) -> bool:
        return bool(self._m.is_stopped())

    @property
    def error(self) -> str:
        return str(self._m.get_error()) if self._m.is_error() else ""

    @property
    def raw(self) -> llguidance.LLMatcher:
        return self._m


class LLGuidanceGrammar:
    """A compiled grammar: a matcher never advanced, copied for every row."""

    __slots__ = ("_pristine", "nbytes")

    def __init__(self, pristine: llguidance.LLMatcher, nbytes: int) -> None:
        self._pristine = pristine
        self.nbytes = nbytes

    def start(self) -> LLGuidanceMatcher:
        return LLGuidanceMatcher(self._pristine.deep_copy())


class LLGuidanceBackend:
    """Compiles constraints for one tokenizer (its ``tokenizer.json`` text) and a model vocabulary of ``vocab``
    ids (ids past the tokenizer's are never allowed); ``eos_ids`` end a grammar that is complete."""

    def __init__(self, tokenizer_json: str, vocab: int, eos_ids: Sequence[int], *, max_depth: int) -> None:
        self.tokenizer = llguidance.LLTokenizer(tokenizer_json, n_vocab=vocab, eos_token=sorted(eos_ids))
        self.vocab = vocab
        self.max_depth = max_depth
        # One executor thread: the masks are filled beside the forward pass, whose torch threads take the cores.
        self._executor = llguidance.LLExecutor(num_threads=1)
        self._limits = llguidance.LLParserLimits(verbose_errors=False)  # errors never echo grammars into logs

    def compile(self, constraint: Constraint) -> LLGuidanceGrammar:
        grammar = self._grammar_text(constraint)
        matcher = llguidance.LLMatcher(self.tokenizer, grammar, log_level=0, limits=self._limits)
        # The first mask builds the lexer's start: the expensive part of some grammars (a regex of nested repeats).
        # Computed here, on a copy, on the compile pool, it costs no engine step; a lexer over its limits fails here.
        probe = matcher.deep_copy()
        if not probe.is_error():
            probe.compute_bitmask()
        error = next((m.get_error() for m in (matcher, probe) if m.is_error()), "")
        if error:
            raise InvalidRequest(
                f"the {constraint.kind} constraint cannot be compiled: {shorten(error)}", field=_field(constraint)
            )
        return LLGuidanceGrammar(matcher, len(grammar) + _GRAMMAR_OVERHEAD_BYTES)

    def fill_masks(self, matchers: Sequence[tuple[Matcher, int]], address: int, row_bytes: int, rows: int) -> None:
        self._executor.unsafe_compute_mask_ptr([(_raw(m), i) for m, i in matchers], address, row_bytes, rows)

    def _grammar_text(self, c: Constraint) -> str:
        """The llguidance grammar (its JSON form) of a constraint; ``InvalidRequest`` for a malformed one."""
        try:
            if c.kind == JSON_SCHEMA:
                schema = _parse_schema(c.source, self.max_depth)
                return llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=_JSON_OPTIONS)  # type: ignore[arg-type]
            if c.kind == JSON_OBJECT:
                return llguidance.LLMatcher.grammar_from_json_schema({"type": "object"}, defaults=_JSON_OPTIONS)  # type: ignore[arg-type]
            if c.kind == REGEX:
                return llguidance.LLMatcher.grammar_from_regex(c.source)
            if c.kind == CHOICE:
                return llguidance.grammar_from("choice", json.dumps(list(c.choices)))
            if c.kind == GRAMMAR:
                return llguidance.grammar_from("lark" if c.dialect == "lark" else "gbnf", c.source)
        except ValueError as exc:
            raise InvalidRequest(f"the {c.kind} constraint is malformed: {shorten(exc)}", field=_field(c)) from None
        raise InvalidRequest(f"unknown constraint kind {c.kind!r}", field="constraint")


def _raw(m: Matcher) -> llguidance.LLMatcher:
    if not isinstance(m, LLGuidanceMatcher):
        raise TypeError(f"the llguidance backend fills masks of its own matchers, not {type(m).__name__}")
    return m.raw


def _field(c: Constraint) -> str:
    return f"constraint.{c.kind}"


def _parse_schema(source: str, max_depth: int) -> dict[str, object]:
    """The schema as a JSON object whose nesting (objects and arrays) is at most ``max_depth`` levels; the depth is
    counted on the text before parsing, so a schema nested a million levels deep costs one scan, not a recursion."""
    depth = deepest = 0
    in_string = escaped = False
    for ch in source:
        if in_string:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == '"':
                in_string = False
        elif ch == '"':
            in_string = True
        elif ch in "[{":
            depth += 1
            if depth > deepest:
                deepest = depth
                if deepest > max_depth:
                    raise InvalidRequest(
                        f"the JSON schema nests more than {max_depth} levels of objects and arrays; this server "
                        f"accepts at most {max_depth} (--max-constraint-depth)",
                        field="constraint.json_schema",
                        limit=max_depth,
                    )
        elif ch in "]}":
            depth -= 1
    try:
        schema = json.loads(source)
    except ValueError as exc:
        message = f"the JSON schema is not valid JSON: {shorten(exc)}"
        raise InvalidRequest(message, field="constraint.json_schema") from None
    if not isinstance(schema, dict):
        raise InvalidRequest("the JSON schema must be a JSON object", field="constraint.json_schema")
    return schema


__all__ = ["LLGuidanceBackend", "LLGuidanceGrammar", "LLGuidanceMatcher"]
