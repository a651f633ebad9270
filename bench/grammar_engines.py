"""Grammar engines side by side: llguidance vs xgrammar vs outlines-core on JSON schemas, one tokenizer, one run.

    .venv/bin/python bench/grammar_engines.py                  # all three (their venv is built on the first run)
    .venv/bin/python bench/grammar_engines.py --quick --here --engines llguidance   # the test's smoke mode

Each engine runs in its own child process (its RSS is its own), by default with the python of the peer venv
``bench/.work/grammar`` (bench/peers_envs.py ``grammar_env``: the three engines pinned beside the server's torch,
tokenizers and transformers); ``--here`` runs the children with this interpreter instead (llguidance only, as the
server has no other). Same tokenizer for all: SmolLM2's tokenizer.json (vocabulary 49152, EOS 2); llguidance
``LLTokenizer`` from its JSON, xgrammar ``TokenizerInfo.from_huggingface`` of a ``PreTrainedTokenizerFast``,
outlines-core a ``Vocabulary`` of the byte-level tokens' bytes. Compact JSON (no whitespace, "," and ":").

Measured per engine:
  * set-up: the tokenizer / vocabulary structure, once per server (and the import);
  * compile: 32 distinct generated schemas (5-50 properties, nested objects, enums, arrays, patterns, formats),
    median and max, and a 50-property schema; a cache hit where the engine has one (xgrammar's compiler cache),
    else what a server cache would do per request (llguidance ``deep_copy`` of a compiled matcher, outlines-core
    ``Guide(index)``);
  * mask time per decoding step, walking each schema along a valid instance token by token: 1 row (one schema at
    a time) and 32 rows (the 32 schemas at once, in the engine's batched call: llguidance ``LLExecutor`` +
    ``fill_next_token_bitmask_par``, xgrammar ``BatchGrammarMatcher``; outlines-core has none, a loop of
    ``write_mask_into``); first walk of a fresh compile and a second walk; every step's mask is checked to allow
    the instance's next token, and EOS at the end;
  * memory: RSS growth for the 32 compiled grammars, and after walking them;
  * correctness: a corpus of generated and hand-written schemas; random walks (a random allowed token each step,
    tokens with a quote preferred 60% of the time, else a string would rarely end; stop when EOS is allowed, at
    most 300 tokens), decoded, ``json.loads`` and ``jsonschema`` (with format checks): valid / invalid /
    unsupported schema (compile error) / compile past ``--compile-limit`` / capped / dead end (no token allowed
    and EOS not allowed).
Results: ``--out`` (bench/results/grammar_engines.json) and a table on stdout.
"""

from __future__ import annotations

import abc
import argparse
import importlib
import json
import os
import pickle
import platform
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
ENGINES = ("llguidance", "xgrammar", "outlines-core")
TOKENIZER = ROOT / "models/SmolLM2-135M-Instruct/tokenizer.json"
VOCAB = 49152
EOS = 2
WALK_CAP = 300


def log(msg: str) -> None:
    print(f"grammar: {msg}", file=sys.stderr, flush=True)


# ---------------------------------------------------------------- the schema corpus (schema, valid instance)

PATTERNS = (
    ("^[A-Z]{3}-[0-9]{4}$", "ABC-1234"),
    ("^[a-z]+(_[a-z]+)*$", "snake_case"),
    ("^\\+?[0-9]{7,12}$", "+1234567"),
)
FORMATS = (("date", "2026-12-02"), ("email", "ada@example.com"), ("uuid", "123e4567-e89b-12d3-a456-426614174000"))
WORDS = ("alpha", "beta", "gamma", "delta", "omega", "north", "south", "red", "green", "blue", "small", "large")


def _string(rng: random.Random) -> tuple[dict[str, Any], Any]:
    kind = rng.choice(("plain", "plain", "bounded", "enum", "pattern", "format"))
    if kind == "bounded":
        lo = rng.randint(1, 4)
        hi = lo + rng.randint(4, 40)
        return {"type": "string", "minLength": lo, "maxLength": hi}, "x" * lo
    if kind == "enum":
        values = rng.sample(WORDS, rng.randint(2, 6))
        return {"type": "string", "enum": values}, values[-1]
    if kind == "pattern":
        pattern, example = rng.choice(PATTERNS)
        return {"type": "string", "pattern": pattern}, example
    if kind == "format":
        fmt, example = rng.choice(FORMATS)
        return {"type": "string", "format": fmt}, example
    return {"type": "string"}, rng.choice(WORDS) + " text"


def _value(rng: random.Random, depth: int) -> tuple[dict[str, Any], Any]:
    kinds = ["string", "string", "integer", "number", "boolean", "array"]
    if depth < 2:
        kinds += ["object", "object"]
    kinds += ["nullable", "const"]
    kind = rng.choice(kinds)
    if kind == "string":
        return _string(rng)
    if kind == "integer":
        if rng.random() < 0.5:
            lo = rng.randint(-100, 100)
            return {"type": "integer", "minimum": lo, "maximum": lo + rng.randint(1, 1000)}, lo + 1
        return {"type": "integer"}, rng.randint(-5000, 5000)
    if kind == "number":
        return {"type": "number"}, round(rng.uniform(-100, 100), 3)
    if kind == "boolean":
        return {"type": "boolean"}, rng.random() < 0.5
    if kind == "nullable":
        inner, _ = _string(rng) if rng.random() < 0.5 else ({"type": "integer"}, 7)
        return {"anyOf": [inner, {"type": "null"}]}, None
    if kind == "const":
        word = rng.choice(WORDS)
        return {"const": word}, word
    if kind == "array":
        item_kind = rng.random()
        if item_kind < 0.4:
            item, example = _string(rng)
        elif item_kind < 0.7 or depth >= 2:
            item, example = {"type": "integer"}, 3
        else:
            item, example = _object(rng, rng.randint(2, 5), depth + 1)
        schema: dict[str, Any] = {"type": "array", "items": item}
        count = 1
        if rng.random() < 0.5:
            schema["minItems"] = 1
            schema["maxItems"] = rng.randint(2, 8)
            count = 2
        return schema, [example] * count
    return _object(rng, rng.randint(2, 6), depth + 1)


def _object(rng: random.Random, n: int, depth: int) -> tuple[dict[str, Any], dict[str, Any]]:
    props: dict[str, Any] = {}
    instance: dict[str, Any] = {}
    required = []
    for i in range(n):
        name = f"{rng.choice(WORDS)}_{i}"
        schema, example = _value(rng, depth)
        props[name] = schema
        if rng.random() < 0.7:
            required.append(name)
            instance[name] = example
        elif rng.random() < 0.5:
            instance[name] = example
    return {"type": "object", "properties": props, "required": required, "additionalProperties": False}, instance


def generated(seed: int, count: int, lo: int = 5, hi: int = 50) -> list[tuple[str, dict[str, Any], Any]]:
    rng = random.Random(seed)
    out = []
    for i in range(count):
        schema, instance = _object(rng, rng.randint(lo, hi), 0)
        out.append((f"gen{seed}-{i}", schema, instance))
    return out


def fifty(seed: int = 50) -> tuple[str, dict[str, Any], Any]:
    schema, instance = _object(random.Random(seed), 50, 0)
    return "props50", schema, instance


HAND: list[tuple[str, dict[str, Any], Any]] = [
    (
        "refs",
        {
            "$defs": {"pt": {"type": "object", "properties": {"x": {"type": "integer"}, "y": {"type": "integer"}}}},
            "type": "object",
            "properties": {"a": {"$ref": "#/$defs/pt"}, "b": {"$ref": "#/$defs/pt"}},
            "required": ["a", "b"],
        },
        {"a": {"x": 1, "y": 2}, "b": {"x": 3, "y": 4}},
    ),
    (
        "recursive",
        {
            "$defs": {
                "node": {
                    "type": "object",
                    "properties": {
                        "v": {"type": "integer"},
                        "kids": {"type": "array", "items": {"$ref": "#/$defs/node"}},
                    },
                    "required": ["v"],
                    "additionalProperties": False,
                }
            },
            "$ref": "#/$defs/node",
        },
        {"v": 1, "kids": [{"v": 2}]},
    ),
    (
        "oneof",
        {
            "type": "object",
            "properties": {
                "shape": {
                    "oneOf": [
                        {"type": "object", "properties": {"r": {"type": "number"}}, "required": ["r"]},
                        {"type": "object", "properties": {"w": {"type": "integer"}}, "required": ["w"]},
                    ]
                }
            },
            "required": ["shape"],
        },
        {"shape": {"r": 1.5}},
    ),
    (
        "tuple",
        {
            "type": "object",
            "properties": {
                "p": {"type": "array", "prefixItems": [{"type": "string"}, {"type": "integer"}], "items": False}
            },
            "required": ["p"],
        },
        {"p": ["a", 1]},
    ),
    (
        "map",
        {"type": "object", "additionalProperties": {"type": "integer"}, "maxProperties": 4},
        {"a": 1},
    ),
    (
        "type-list",
        {"type": "object", "properties": {"n": {"type": ["string", "null"]}, "k": {"type": ["integer", "boolean"]}}},
        {"n": None, "k": True},
    ),
    (
        "bounds",
        {
            "type": "object",
            "properties": {
                "score": {"type": "number", "exclusiveMinimum": 0, "maximum": 1},
                "count": {"type": "integer", "minimum": 10, "maximum": 99},
                "name": {"type": "string", "minLength": 3, "maxLength": 5},
            },
            "required": ["score", "count", "name"],
        },
        {"score": 0.5, "count": 42, "name": "abcd"},
    ),
    (
        "allof",
        {
            "allOf": [
                {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]},
                {"type": "object", "properties": {"b": {"type": "string"}}, "required": ["b"]},
            ]
        },
        {"a": 1, "b": "x"},
    ),
    (
        "unique",
        {"type": "object", "properties": {"tags": {"type": "array", "items": {"type": "string"}, "uniqueItems": True}}},
        {"tags": ["a", "b"]},
    ),
    (
        "multipleof",
        {"type": "object", "properties": {"even": {"type": "integer", "multipleOf": 2}}, "required": ["even"]},
        {"even": 4},
    ),
    (
        "datetime",
        {"type": "object", "properties": {"at": {"type": "string", "format": "date-time"}}, "required": ["at"]},
        {"at": "2026-12-02T04:30:00Z"},
    ),
    (
        "enum-mixed",
        {"type": "object", "properties": {"e": {"enum": ["a", 1, None, True]}}, "required": ["e"]},
        {"e": 1},
    ),
]


def corpus(quick: bool) -> dict[str, list[tuple[str, dict[str, Any], Any]]]:
    timing = generated(1, 4 if quick else 32)
    # smaller objects (3-15 properties): a random walk finishes them within WALK_CAP tokens
    correctness = generated(2, 4 if quick else 64, 3, 15) + (HAND[:2] if quick else HAND)
    return {"timing": timing, "fifty": [fifty()], "correctness": correctness}


def dump(obj: Any) -> str:
    return json.dumps(obj, separators=(",", ":"))


# ---------------------------------------------------------------- the engines (imported only in their child)


class Engine(abc.ABC):
    """One engine's set-up, compile, matchers and masks, all on one int32 bitmask of (rows, VOCAB / 32) words."""

    name = ""
    slow_compile = False

    def __init__(self, tokenizer: Path, threads: int) -> None:
        self.threads = threads

    @abc.abstractmethod
    def compile(self, schema: str) -> Any:
        """The compiled form of a schema (JSON text)."""

    def cache_hit(self, schema: str, compiled: Any) -> Any:
        return self.start(compiled)

    @abc.abstractmethod
    def start(self, compiled: Any) -> Any:
        """A fresh matcher of a compiled schema."""

    @abc.abstractmethod
    def fill(self, matchers: list[Any], bitmask: Any) -> None:
        """Every matcher's mask into its row of ``bitmask``."""

    @abc.abstractmethod
    def consume(self, matcher: Any, token: int) -> bool:
        """Advance ``matcher`` by ``token``; False if refused."""


class Llguidance(Engine):
    name = "llguidance"

    def __init__(self, tokenizer: Path, threads: int) -> None:
        import llguidance
        import llguidance.torch

        super().__init__(tokenizer, threads)
        self.lib, self.ltorch = llguidance, llguidance.torch
        self.tok = llguidance.LLTokenizer(tokenizer.read_text(), n_vocab=VOCAB, eos_token=EOS)
        self.executor = llguidance.LLExecutor(threads)
        self.options = {"whitespace_flexible": False, "item_separator": ",", "key_separator": ":"}

    def compile(self, schema: str) -> Any:
        grammar = self.lib.LLMatcher.grammar_from_json_schema(schema, defaults=self.options)
        matcher = self.lib.LLMatcher(self.tok, grammar, log_level=0)
        if matcher.is_error():
            raise ValueError(matcher.get_error())
        return matcher

    def start(self, compiled: Any) -> Any:
        return compiled.deep_copy()

    def fill(self, matchers: list[Any], bitmask: Any) -> None:
        if len(matchers) == 1:
            self.ltorch.fill_next_token_bitmask(matchers[0], bitmask, 0)
        else:
            self.ltorch.fill_next_token_bitmask_par(self.executor, [(m, i) for i, m in enumerate(matchers)], bitmask)

    def consume(self, matcher: Any, token: int) -> bool:
        return bool(matcher.consume_token(token)) and not matcher.is_error()


class Xgrammar(Engine):
    name = "xgrammar"

    def __init__(self, tokenizer: Path, threads: int) -> None:
        import xgrammar
        from transformers import PreTrainedTokenizerFast

        super().__init__(tokenizer, threads)
        self.lib = xgrammar
        hf = PreTrainedTokenizerFast(tokenizer_file=str(tokenizer), eos_token="<|endoftext|>")
        info = xgrammar.TokenizerInfo.from_huggingface(hf, vocab_size=VOCAB, stop_token_ids=[EOS])
        self.compiler = xgrammar.GrammarCompiler(info, max_threads=threads, cache_enabled=True)
        self.batch = xgrammar.BatchGrammarMatcher(threads)

    def compile(self, schema: str) -> Any:
        return self.compiler.compile_json_schema(schema, any_whitespace=False, separators=(",", ":"))

    def cache_hit(self, schema: str, compiled: Any) -> Any:
        return self.compile(schema)

    def start(self, compiled: Any) -> Any:
        return self.lib.GrammarMatcher(compiled)

    def fill(self, matchers: list[Any], bitmask: Any) -> None:
        if len(matchers) == 1:
            matchers[0].fill_next_token_bitmask(bitmask, 0)
        else:
            self.batch.batch_fill_next_token_bitmask(matchers, bitmask)

    def consume(self, matcher: Any, token: int) -> bool:
        return bool(matcher.accept_token(token))


def byte_level_vocab(tokenizer: Path) -> tuple[dict[bytes, list[int]], set[int]]:
    """Each token's bytes (GPT-2 byte-level alphabet undone), and the special tokens' ids."""
    data = json.loads(tokenizer.read_text())
    printable = [*range(33, 127), *range(161, 173), *range(174, 256)]
    codes = printable + [256 + i for i in range(256 - len(printable))]
    byte_of = dict(
        zip((chr(c) for c in codes), [*printable, *(b for b in range(256) if b not in printable)], strict=True)
    )
    special = {t["id"] for t in data.get("added_tokens", []) if t.get("special")}
    out: dict[bytes, list[int]] = {}
    for token, tid in data["model"]["vocab"].items():
        if tid in special or tid >= VOCAB:
            continue
        out.setdefault(bytes(byte_of[ch] for ch in token), []).append(tid)
    return out, special


class OutlinesCore(Engine):
    name = "outlines-core"
    slow_compile = True

    def __init__(self, tokenizer: Path, threads: int) -> None:
        import outlines_core
        from outlines_core.json_schema import build_regex_from_schema

        super().__init__(tokenizer, threads)
        self.lib, self.regex = outlines_core, build_regex_from_schema
        vocab, _ = byte_level_vocab(tokenizer)
        self.vocab = outlines_core.Vocabulary(EOS, vocab)

    def compile(self, schema: str) -> Any:
        return self.lib.Index(self.regex(schema, whitespace_pattern=""), self.vocab)

    def start(self, compiled: Any) -> Any:
        return self.lib.Guide(compiled)

    def fill(self, matchers: list[Any], bitmask: Any) -> None:
        words, size = bitmask.shape[1], bitmask.element_size()
        base = bitmask.data_ptr()
        for i, m in enumerate(matchers):
            m.write_mask_into(base + i * words * size, words, size)

    def consume(self, matcher: Any, token: int) -> bool:
        try:
            matcher.advance(token, return_tokens=False)
        except Exception:
            return False
        return True


CLASSES: dict[str, type[Engine]] = {"llguidance": Llguidance, "xgrammar": Xgrammar, "outlines-core": OutlinesCore}


# ---------------------------------------------------------------- measuring, in an engine's child


def rss_mb() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def timed(fn: Callable[[], Any]) -> tuple[float, Any]:
    t0 = time.perf_counter()
    out = fn()
    return time.perf_counter() - t0, out


def summary(values: list[float], scale: float = 1e3) -> dict[str, float]:
    """ms by default: median, p90, max, mean, n."""
    if not values:
        return {}
    s = sorted(values)
    return {
        "median": statistics.median(s) * scale,
        "p90": s[min(len(s) - 1, int(0.9 * len(s)))] * scale,
        "max": s[-1] * scale,
        "mean": statistics.fmean(s) * scale,
        "n": len(s),
    }


class Child:
    def __init__(self, engine: Engine, spec: dict[str, Any], out: Path, result: dict[str, Any]) -> None:
        import numpy as np
        import torch
        from tokenizers import Tokenizer

        self.np, self.torch = np, torch
        self.engine, self.spec, self.out, self.result = engine, spec, out, result
        self.tokenizer = Tokenizer.from_file(spec["tokenizer"])
        self.words = (VOCAB + 31) // 32
        vocab, _ = byte_level_vocab(Path(spec["tokenizer"]))
        closing = np.zeros(VOCAB, dtype=bool)
        for raw, ids in vocab.items():
            if b'"' in raw:  # inside a string (where ~49k tokens are allowed) only these can end it
                closing[ids] = True
        self.closing = closing

    def save(self) -> None:
        self.out.write_text(json.dumps(self.result, indent=1))

    def bitmask(self, rows: int) -> Any:
        return self.torch.zeros((rows, self.words), dtype=self.torch.int32)

    def allowed(self, row: Any) -> Any:
        bits = self.np.unpackbits(row.numpy().view(self.np.uint8), bitorder="little")[:VOCAB]
        return bits.astype(bool)

    def tokens(self, instance: Any) -> list[int]:
        ids: list[int] = self.tokenizer.encode(dump(instance), add_special_tokens=False).ids
        return ids

    def compile(self, schema: dict[str, Any]) -> tuple[float, Any]:
        """(seconds, the engine's compiled grammar). Where one compile can run for minutes (outlines-core builds its
        whole index up front), it runs in a forked child that must finish within ``compile_limit_s`` (else
        TimeoutError, the child killed) and hands back its time and the pickled index (unpickling is not timed)."""
        limit = self.spec["compile_limit_s"]
        if not (self.engine.slow_compile and limit):
            return timed(lambda: self.engine.compile(dump(schema)))
        with tempfile.NamedTemporaryFile(suffix=".pickle") as f:
            pid = os.fork()
            if pid == 0:
                try:
                    got: Any = timed(lambda: self.engine.compile(dump(schema)))
                except Exception as e:
                    got = ("error", f"{type(e).__name__}: {str(e)[:200]}")
                finally:
                    with open(f.name, "wb") as out:
                        pickle.dump(got, out)
                    os._exit(0)
            deadline = time.monotonic() + limit
            while os.waitpid(pid, os.WNOHANG) == (0, 0):
                if time.monotonic() > deadline:
                    os.kill(pid, signal.SIGKILL)
                    os.waitpid(pid, 0)
                    raise TimeoutError(f"compile ran past {limit:.0f} s")
                time.sleep(0.005)
            seconds, compiled = pickle.loads(Path(f.name).read_bytes())
        if seconds == "error":
            raise ValueError(compiled)
        return seconds, compiled

    def compile_all(self, schemas: list[tuple[str, dict[str, Any], Any]]) -> tuple[dict[str, Any], dict[str, Any]]:
        compiled, times, errors = {}, {}, {}
        for name, schema, _ in schemas:
            try:
                seconds, compiled[name] = self.compile(schema)
                times[name] = seconds
            except Exception as e:
                errors[name] = f"{type(e).__name__}: {str(e)[:200]}"
            self.result["progress"] = f"compiled {len(times)} of {len(schemas)}, {len(errors)} failed"
            self.save()
        return compiled, {"seconds": times, "errors": errors}

    def walk_one(self, compiled: dict[str, Any], docs: dict[str, list[int]]) -> dict[str, Any]:
        """Each schema alone along its instance: per-step mask seconds, and whether every step allowed it."""
        masks, consumes, bad = [], [], {}
        bm = self.bitmask(1)
        for name, matcher_src in compiled.items():
            m = self.engine.start(matcher_src)
            for i, tok in enumerate([*docs[name], EOS]):
                seconds, _ = timed(lambda m=m: self.engine.fill([m], bm))
                masks.append(seconds)
                if not self.allowed(bm[0])[tok]:
                    bad[name] = f"step {i}: token {tok} not allowed"
                    break
                if tok == EOS:
                    break
                seconds, ok = timed(lambda m=m, tok=tok: self.engine.consume(m, tok))
                consumes.append(seconds)
                if not ok:
                    bad[name] = f"step {i}: consume({tok}) refused"
                    break
        return {"mask_ms": summary(masks), "consume_ms": summary(consumes), "rejected": bad}

    def walk_batch(self, compiled: dict[str, Any], docs: dict[str, list[int]]) -> dict[str, Any]:
        """All schemas at once, one batched fill per step; steps timed while every row is still walking."""
        names = list(compiled)
        matchers = [self.engine.start(compiled[n]) for n in names]
        seqs = [[*docs[n], EOS] for n in names]
        bm = self.bitmask(len(names))
        full, partial, bad = [], [], {}
        active = list(range(len(names)))
        step = 0
        while active:
            rows = [matchers[i] for i in active]
            view = bm[: len(rows)]
            seconds, _ = timed(lambda rows=rows, view=view: self.engine.fill(rows, view))
            (full if len(active) == len(names) else partial).append(seconds)
            still = []
            for j, i in enumerate(active):
                tok = seqs[i][step]
                if not self.allowed(view[j])[tok]:
                    bad[names[i]] = f"step {step}: token {tok} not allowed"
                elif tok != EOS:
                    if self.engine.consume(matchers[i], tok):
                        still.append(i)
                    else:
                        bad[names[i]] = f"step {step}: consume({tok}) refused"
            active = still
            step += 1
        return {
            "rows": len(names),
            "step_ms_all_rows": summary(full),
            "step_ms_fewer_rows": summary(partial),
            "rejected": bad,
        }

    def random_walk(self, compiled: Any, rng: random.Random) -> tuple[str, list[int]]:
        np = self.np
        m = self.engine.start(compiled)
        bm = self.bitmask(1)
        out: list[int] = []
        for _ in range(WALK_CAP):
            self.engine.fill([m], bm)
            allowed = self.allowed(bm[0])
            if allowed[EOS]:
                return "done", out
            ids = np.flatnonzero(allowed)
            if ids.size == 0:
                return "dead end", out
            closing = ids[self.closing[ids]]
            pool = closing if closing.size and rng.random() < 0.6 else ids
            tok = int(pool[rng.randrange(pool.size)])
            if not self.engine.consume(m, tok):
                return f"refused its own mask's token {tok}", out
            out.append(tok)
        return "capped", out

    def correctness(self, schemas: list[tuple[str, dict[str, Any], Any]], walks: int) -> dict[str, Any]:
        import jsonschema

        counts = {"schemas": len(schemas), "walks": 0, "valid": 0, "invalid": 0, "capped": 0, "dead_end": 0}
        counts |= {"unsupported_schemas": 0, "compile_timeouts": 0, "instance_rejected": 0}
        details: dict[str, Any] = {}
        rng = random.Random(7)
        for name, schema, instance in schemas:
            try:
                _, compiled = self.compile(schema)
            except Exception as e:
                counts["compile_timeouts" if isinstance(e, TimeoutError) else "unsupported_schemas"] += 1
                details[name] = {"unsupported": f"{type(e).__name__}: {str(e)[:200]}"}
                continue
            walk = self.walk_one({name: compiled}, {name: self.tokens(instance)})
            if walk["rejected"]:
                counts["instance_rejected"] += 1
                details.setdefault(name, {})["instance_rejected"] = walk["rejected"][name]
            validator = jsonschema.Draft202012Validator(schema, format_checker=jsonschema.FormatChecker())
            for _ in range(walks):
                counts["walks"] += 1
                how, ids = self.random_walk(compiled, rng)
                text = self.tokenizer.decode(ids, skip_special_tokens=False)
                if how == "capped":
                    counts["capped"] += 1
                    details.setdefault(name, {}).setdefault("capped", []).append(text[-120:])
                    continue
                if how != "done":
                    counts["dead_end"] += 1
                    details.setdefault(name, {}).setdefault("dead_ends", []).append(f"{how}: {text[-80:]}")
                    continue
                try:
                    error = next(iter(validator.iter_errors(json.loads(text))), None)
                    why = error.message[:160] if error else ""
                except json.JSONDecodeError as e:
                    why = f"not JSON: {e}"
                if why:
                    counts["invalid"] += 1
                    details.setdefault(name, {}).setdefault("invalid", []).append({"text": text[:300], "why": why})
                else:
                    counts["valid"] += 1
        return {"counts": counts, "details": details}

    def run(self) -> None:
        spec, r = self.spec, self.result
        sets = corpus(spec["quick"])
        timing = sets["timing"]
        docs = {name: self.tokens(inst) for name, _, inst in timing + sets["fifty"]}
        import jsonschema

        checker = jsonschema.FormatChecker()
        r["instances_invalid"] = [  # the generator's own instances, checked: they must all be valid
            name
            for name, schema, inst in timing + sets["fifty"] + sets["correctness"]
            if not jsonschema.Draft202012Validator(schema, format_checker=checker).is_valid(inst)
        ]
        r["instance_tokens"] = summary([float(len(d)) for d in docs.values()], scale=1)
        rss0 = rss_mb()
        compiled, compile_info = self.compile_all(timing)
        rss1 = rss_mb()
        r["compile"] = {
            "ms": summary(list(compile_info["seconds"].values())),
            "errors": compile_info["errors"],
            "per_schema_ms": {k: v * 1e3 for k, v in compile_info["seconds"].items()},
        }
        big, big_info = self.compile_all(sets["fifty"])
        r["compile"]["props50_ms"] = big_info["seconds"].get("props50", 0.0) * 1e3 or big_info["errors"]
        hits = []
        for name, schema, _ in timing:
            if name in compiled:
                hits.append(timed(lambda s=schema, c=compiled[name]: self.engine.cache_hit(dump(s), c))[0])
        r["compile"]["cache_hit_ms"] = summary(hits)
        self.save()
        total = sum(compile_info["seconds"].values())
        log(f"{self.engine.name}: compiled {len(compiled)}/{len(timing)} in {total:.2f} s")
        r["walk_1_row_first"] = self.walk_one(compiled, docs)
        r["walk_1_row_second"] = self.walk_one(compiled, docs)
        if big:
            r["walk_props50"] = self.walk_one(big, docs)
        self.save()
        # the batch: a fresh compile of the same schemas (xgrammar's hits its cache: that is its design); where
        # compiles are slow (outlines-core, whose Guide holds no lazily built state) the same compiled indexes
        fresh = compiled if self.engine.slow_compile else self.compile_all(timing)[0]
        r["walk_batch_first"] = self.walk_batch(fresh, docs)
        r["walk_batch_second"] = self.walk_batch(fresh, docs)
        r["rss_mb"] = {"baseline": rss0, "compiled_32": rss1 - rss0, "after_walks": rss_mb() - rss0}
        self.save()
        log(f"{self.engine.name}: walks done; correctness ...")
        r["correctness"] = self.correctness(sets["correctness"], spec["walks"])
        self.save()


def child_main(spec_path: str) -> None:
    spec = json.loads(Path(spec_path).read_text())
    out = Path(spec["out"])
    result: dict[str, Any] = {"engine": spec["engine"], "threads": spec["threads"]}
    t0 = time.perf_counter()
    engine_cls = CLASSES[spec["engine"]]
    try:
        # the imports apart from the set-up: torch (every engine fills torch bitmasks here; llguidance.torch and
        # xgrammar import it), the engine's modules, transformers for xgrammar's tokenizer
        modules = {"llguidance": ["llguidance", "llguidance.torch"], "xgrammar": ["xgrammar", "transformers"]}
        modules["outlines-core"] = ["outlines_core", "outlines_core.json_schema"]
        result["import_s"] = timed(lambda: [importlib.import_module(m) for m in ["torch", *modules[spec["engine"]]]])[0]
        result["setup_s"], engine = timed(lambda: engine_cls(Path(spec["tokenizer"]), spec["threads"]))
        result["versions"] = versions(spec["engine"])
        Child(engine, spec, out, result).run()
    except Exception as e:
        result["failed"] = f"{type(e).__name__}: {e}"
    result["wall_s"] = time.perf_counter() - t0
    out.write_text(json.dumps(result, indent=1))


def versions(engine: str) -> dict[str, str]:
    from importlib.metadata import version

    names = [engine, "torch", "tokenizers"] + (["transformers"] if engine == "xgrammar" else [])
    return {n: version(n) for n in names}


# ---------------------------------------------------------------- the parent: venv, children, report


def machine() -> dict[str, Any]:
    info: dict[str, Any] = {"python": platform.python_version(), "cpus": os.cpu_count()}
    try:
        sys.path.insert(0, str(ROOT / "bench"))
        import machine as bench_machine

        info |= bench_machine.describe()
    except Exception as e:  # the smoke mode must not depend on it
        info["machine_error"] = str(e)
    info["load_average"] = os.getloadavg()
    return info


def run_engine(python: Path, engine: str, args: argparse.Namespace) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "out.json"
        spec = {"engine": engine, "tokenizer": str(args.tokenizer), "threads": args.threads, "quick": args.quick}
        spec |= {"walks": args.walks, "out": str(out), "compile_limit_s": args.compile_limit}
        (Path(tmp) / "spec.json").write_text(json.dumps(spec))
        env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
        cmd = [str(python), str(Path(__file__).resolve()), "--child", str(Path(tmp) / "spec.json")]
        try:
            proc = subprocess.run(cmd, env=env, timeout=args.timeout, capture_output=True, text=True, check=False)
            sys.stderr.write(proc.stderr[-4000:])
            why = f"exited {proc.returncode}" if proc.returncode else ""
        except subprocess.TimeoutExpired:
            why = f"ran past {args.timeout:.0f} s (partial results kept)"
        result: dict[str, Any] = json.loads(out.read_text()) if out.exists() else {"engine": engine}
        if why:
            result["failed"] = result.get("failed") or why
        return result


def fmt(value: Any, digits: int = 2) -> str:
    return f"{value:.{digits}f}" if isinstance(value, int | float) else "–"


def table(results: dict[str, Any]) -> str:
    engines = [e for e in ENGINES if e in results["engines"]]
    rows: list[tuple[str, Callable[[dict[str, Any]], Any]]] = [
        ("version", lambda r: r.get("versions", {}).get(r["engine"], "–")),
        ("import + tokenizer set-up, s", lambda r: fmt(r.get("import_s", 0) + r.get("setup_s", 0), 2)),
        ("tokenizer set-up alone (once per server), s", lambda r: fmt(r.get("setup_s"), 2)),
        ("compiled of the 32 (errors, past the limit)", lambda r: _compiled(r)),
        ("compile, 32 schemas: median ms", lambda r: fmt(_get(r, "compile", "ms", "median"))),
        ("compile, 32 schemas: max ms", lambda r: fmt(_get(r, "compile", "ms", "max"))),
        ("compile, 50 properties: ms", lambda r: fmt(_get(r, "compile", "props50_ms"))),
        ("cache hit / per-request start: median ms", lambda r: fmt(_get(r, "compile", "cache_hit_ms", "median"), 3)),
        ("mask, 1 row, first walk: median ms", lambda r: fmt(_get(r, "walk_1_row_first", "mask_ms", "median"), 3)),
        ("mask, 1 row, first walk: p90 / max ms", lambda r: _pair(r, "walk_1_row_first")),
        ("mask, 1 row, second walk: median ms", lambda r: fmt(_get(r, "walk_1_row_second", "mask_ms", "median"), 3)),
        ("mask, 50 properties, 1 row: median ms", lambda r: fmt(_get(r, "walk_props50", "mask_ms", "median"), 3)),
        (
            "mask, 32 rows, first walk: median ms/step",
            lambda r: fmt(_get(r, "walk_batch_first", "step_ms_all_rows", "median"), 3),
        ),
        (
            "mask, 32 rows, first walk: max ms/step",
            lambda r: fmt(_get(r, "walk_batch_first", "step_ms_all_rows", "max"), 3),
        ),
        (
            "mask, 32 rows, second walk: median ms/step",
            lambda r: fmt(_get(r, "walk_batch_second", "step_ms_all_rows", "median"), 3),
        ),
        ("RSS growth, 32 compiled: MB", lambda r: fmt(_get(r, "rss_mb", "compiled_32"), 1)),
        ("RSS growth after the walks: MB", lambda r: fmt(_get(r, "rss_mb", "after_walks"), 1)),
        ("valid instances rejected (of 32 + corpus)", lambda r: _rejected(r)),
        (
            "corpus: schemas / unsupported / compile past the limit",
            lambda r: _counts(r, "schemas", "unsupported_schemas", "compile_timeouts"),
        ),
        ("corpus walks: valid / invalid", lambda r: _counts(r, "valid", "invalid")),
        ("corpus walks: capped / dead end", lambda r: _counts(r, "capped", "dead_end")),
    ]
    lines = ["| | " + " | ".join(engines) + " |", "| --- |" + " --- |" * len(engines)]
    for label, get in rows:
        lines.append(f"| {label} | " + " | ".join(str(get(results["engines"][e])) for e in engines) + " |")
    for e in engines:
        if failed := results["engines"][e].get("failed"):
            lines.append(f"\n- {e} failed: {failed}")
    return "\n".join(lines)


def _get(r: dict[str, Any], *keys: str) -> Any:
    for k in keys:
        if not isinstance(r, dict) or k not in r:
            return None
        r = r[k]
    return r


def _pair(r: dict[str, Any], walk: str) -> str:
    return f"{fmt(_get(r, walk, 'mask_ms', 'p90'), 3)} / {fmt(_get(r, walk, 'mask_ms', 'max'), 2)}"


def _rejected(r: dict[str, Any]) -> str:
    walk = _get(r, "walk_1_row_first", "rejected")
    corpus_rejects = _get(r, "correctness", "counts", "instance_rejected")
    if walk is None:
        return "–"
    return f"{len(walk)} + {corpus_rejects if corpus_rejects is not None else '–'}"


def _counts(r: dict[str, Any], *keys: str) -> str:
    counts = _get(r, "correctness", "counts")
    return " / ".join(str(counts[k]) for k in keys) if counts else "–"


def _compiled(r: dict[str, Any]) -> str:
    compile_info = r.get("compile")
    if not compile_info:
        return "–"
    errors = compile_info["errors"].values()
    late = sum("ran past" in e for e in errors)
    return f"{len(compile_info['per_schema_ms'])} ({len(errors) - late}, {late})"


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--engines", default=",".join(ENGINES))
    p.add_argument("--quick", action="store_true", help="4 timing schemas, 6 corpus schemas, 1 walk each")
    p.add_argument("--here", action="store_true", help="run the children with this interpreter (no peer venv)")
    p.add_argument("--venv", type=Path, default=None, help="the peer venv's folder (default: built under --work)")
    p.add_argument("--work", type=Path, default=ROOT / "bench/.work")
    p.add_argument("--tokenizer", type=Path, default=TOKENIZER)
    p.add_argument("--threads", type=int, default=2, help="llguidance LLExecutor / xgrammar batch and compiler")
    p.add_argument("--walks", type=int, default=None, help="random walks per corpus schema (default 4, quick 1)")
    p.add_argument("--compile-limit", type=float, default=20, help="outlines-core: seconds per schema compile")
    p.add_argument("--timeout", type=float, default=1800, help="per engine child, seconds")
    p.add_argument("--out", type=Path, default=ROOT / "bench/results/grammar_engines.json")
    p.add_argument("--child", help=argparse.SUPPRESS)
    return p.parse_args()


def main() -> None:
    args = parse()
    if args.child:
        child_main(args.child)
        return
    args.walks = args.walks or (1 if args.quick else 4)
    engines = [e for e in args.engines.split(",") if e]
    if unknown := set(engines) - set(ENGINES):
        raise SystemExit(f"unknown engines {sorted(unknown)}; known: {', '.join(ENGINES)}")
    if args.here:
        python = Path(sys.executable)
    elif args.venv:
        python = args.venv / "bin/python"
    else:
        sys.path.insert(0, str(ROOT / "bench"))
        import peers_envs

        env = peers_envs.grammar_env(args.work, log)
        if env.python is None:
            raise SystemExit(f"no grammar venv: {env.reason}")
        python = env.python
    started = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    results: dict[str, Any] = {"started": started, "command": " ".join(sys.argv), "machine": machine()}
    results["settings"] = {"threads": args.threads, "walks": args.walks, "quick": args.quick, "walk_cap": WALK_CAP}
    results["engines"] = {}
    for engine in engines:
        log(f"{engine} ...")
        results["engines"][engine] = run_engine(python, engine, args)
    results["load_average_end"] = os.getloadavg()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=1) + "\n")
    print(table(results))
    log(f"wrote {args.out}")


if __name__ == "__main__":
    main()
