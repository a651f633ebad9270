"""What a request asks its output to match: a ``Constraint``, in no wire format and not yet compiled.

Both edges build one (gRPC: the ``constraint`` oneof; OpenAI HTTP: ``response_format``, ``structured_outputs``,
``guided_*`` and forced tool calls) and ``check_constraint`` bounds it on the event loop before anything is
compiled. The backend (``service.constraints.llg``) turns a checked constraint into a grammar; the cache
(``service.constraints.cache``) keys compiled grammars by ``Constraint.key``.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

from service.errors import InvalidRequest

JSON_SCHEMA = "json_schema"  # ``source``: the schema, as JSON text
JSON_OBJECT = "json_object"  # any JSON object (``source`` unused)
REGEX = "regex"  # ``source``: the pattern (Rust ``regex`` syntax, matched against the whole output)
GRAMMAR = "grammar"  # ``source``: the grammar, in ``dialect``
CHOICE = "choice"  # ``choices``: the output is exactly one of these strings
KINDS = (JSON_SCHEMA, JSON_OBJECT, REGEX, GRAMMAR, CHOICE)
DIALECTS = ("lark", "gbnf")  # GRAMMAR's dialects: Lark (llguidance's syntax) and llama.cpp's GBNF


@dataclass(frozen=True)
class Constraint:
    """One output constraint. ``source`` is the schema / pattern / grammar text; ``dialect`` names the grammar's
    syntax (GRAMMAR only); ``choices`` the strings of a CHOICE."""

    kind: str
    source: str = ""
    dialect: str = ""
    choices: tuple[str, ...] = ()

    @property
    def key(self) -> str:
        """The cache key: a digest of everything that shapes the compiled grammar."""
        h = hashlib.blake2b(digest_size=16)
        for part in (self.kind, self.dialect, self.source, *self.choices):
            data = part.encode("utf-8", "surrogatepass")
            h.update(len(data).to_bytes(8, "little"))
            h.update(data)
        return h.hexdigest()

    @property
    def size(self) -> int:
        """Characters of text the constraint carries (what ``check_constraint`` bounds)."""
        return len(self.source) + sum(len(c) for c in self.choices)


@dataclass(frozen=True)
class ConstraintLimits:
    """The bounds every constraint meets before it is compiled (docs/limits.md): ``max_bytes`` of UTF-8 text in
    all, ``max_choices`` strings in a CHOICE, ``max_depth`` levels of nesting in a JSON schema."""

    max_bytes: int = 64 << 10
    max_choices: int = 1024
    max_depth: int = 32


def check_constraint(c: Constraint, limits: ConstraintLimits) -> None:
    """Refuse a constraint that is malformed or over a limit, naming the field; O(size), no compiling. The
    schema's nesting depth is checked where it is parsed (``service.constraints.llg``), off the event loop."""
    if c.kind not in KINDS:
        raise InvalidRequest(f"constraint kind must be one of {KINDS}, got {c.kind!r}", field="constraint")
    if c.size > limits.max_bytes or _utf8_size(c) > limits.max_bytes:
        raise InvalidRequest(
            f"the constraint has more than {limits.max_bytes} bytes of text; this server accepts at most "
            f"{limits.max_bytes} (--max-constraint-bytes)",
            field="constraint",
            limit=limits.max_bytes,
        )
    if c.kind == GRAMMAR and c.dialect not in DIALECTS:
        raise InvalidRequest(
            f"a grammar's dialect must be one of {DIALECTS}, got {c.dialect!r}", field="constraint.grammar"
        )
    if c.kind in (JSON_SCHEMA, REGEX, GRAMMAR) and not c.source.strip():
        raise InvalidRequest(f"the {c.kind} constraint is empty", field=f"constraint.{c.kind}")
    if c.kind == CHOICE:
        if not c.choices:
            raise InvalidRequest("a choice constraint needs at least one string", field="constraint.choice")
        if len(c.choices) > limits.max_choices:
            raise InvalidRequest(
                f"the choice constraint has {len(c.choices)} strings; this server accepts at most "
                f"{limits.max_choices} (--max-constraint-choices)",
                field="constraint.choice",
                limit=limits.max_choices,
            )
        if any(not s for s in c.choices):
            raise InvalidRequest("a choice constraint's strings must not be empty", field="constraint.choice")


def _utf8_size(c: Constraint) -> int:
    texts = (c.source, *c.choices)
    return sum(len(t.encode("utf-8", "surrogatepass")) for t in texts)


__all__ = [
    "CHOICE",
    "DIALECTS",
    "GRAMMAR",
    "JSON_OBJECT",
    "JSON_SCHEMA",
    "KINDS",
    "REGEX",
    "Constraint",
    "ConstraintLimits",
    "check_constraint",
]
