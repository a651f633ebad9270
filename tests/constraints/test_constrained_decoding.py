"""Constrained decoding in the engine: every output follows its grammar, rows stay independent, speculation is exact.

A tiny random Llama with SmolLM2's tokenizer writes the outputs: its tokens are close to random, so its outputs
wander through every corner of a grammar a trained model would avoid. Finished outputs are parsed and validated
with ``jsonschema``; outputs cut by the token limit must be a prefix the grammar accepts.
"""

from __future__ import annotations

import json
import re
import zlib
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from support.adapter_files import write_peft_adapter
from support.drafters import Oracle
from support.engines import grammar_cache, prompt, run, stepped_engine, tokens_of
from support.wait import wait_until

from service.adapters.catalog import AdapterCatalog
from service.adapters.lora.part import LoraPart
from service.adapters.lora.store import AdapterStore
from service.adapters.medusa.format import write_medusa
from service.adapters.medusa.part import MedusaPart
from service.adapters.medusa.registry import MedusaRegistry
from service.config import Settings
from service.constraints.cache import GrammarCache
from service.constraints.spec import Constraint
from service.drafters.registry import SERVER_DRAFTERS
from service.engine.engine import Engine
from service.engine.request import FinishReason, GenerationRequest, TokenEvent
from service.engine.sampling import SamplingParams
from service.model.config import ModelConfig
from service.model.load_folder import load_model
from service.tokenizer import Tokenizer

CPU = torch.device("cpu")
LIMITS: dict[str, Any] = {"max_batch_size": 8, "max_prompt_tokens": 64, "max_total_tokens": 256}


def _leaf() -> st.SearchStrategy[dict[str, Any]]:
    words = st.text(alphabet="abcxyz", min_size=1, max_size=5)
    return st.one_of(
        st.just({"type": "integer"}),
        st.builds(
            lambda lo, span: {"type": "integer", "minimum": lo, "maximum": lo + span},
            st.integers(-50, 50),
            st.integers(0, 500),
        ),
        st.just({"type": "boolean"}),
        st.just({"type": "null"}),
        st.builds(lambda n: {"type": "string", "maxLength": n}, st.integers(0, 10)),
        st.builds(lambda values: {"enum": values}, st.lists(words, min_size=1, max_size=4, unique=True)),
        st.just({"type": "string", "pattern": "^[a-z]{2,5}$"}),
        st.just({"type": ["integer", "boolean"]}),
    )


def _object(props: dict[str, Any], all_required: bool) -> dict[str, Any]:
    required = sorted(props) if all_required else sorted(props)[:1]
    return {"type": "object", "properties": props, "required": required, "additionalProperties": False}


SCHEMAS = st.recursive(
    _leaf(),
    lambda kids: st.one_of(
        st.builds(lambda items, n: {"type": "array", "items": items, "maxItems": n}, kids, st.integers(0, 3)),
        st.builds(
            _object,
            st.dictionaries(st.text(alphabet="abcdefgh", min_size=1, max_size=6), kids, min_size=1, max_size=4),
            st.booleans(),
        ),
    ),
    max_leaves=8,
)


@pytest.fixture(scope="module")
def grammars(served_tiny_dir: Path) -> GrammarCache:
    return grammar_cache(served_tiny_dir)


@pytest.fixture(scope="module")
def engines(served_tiny_dir: Path, grammars: GrammarCache) -> dict[str, Engine]:
    """The same model plain, with prompt lookup, and with an int8 base."""
    return {
        "plain": stepped_engine(served_tiny_dir, grammars, **LIMITS),
        "lookup": stepped_engine(served_tiny_dir, grammars, draft="prompt-lookup", draft_ngram=1, **LIMITS),
        "int8": stepped_engine(served_tiny_dir, grammars, quantize="int8", **LIMITS),
    }


def _request(rid: str, grammar: Any, sampling: SamplingParams, n: int = 40, **kw: Any) -> GenerationRequest:
    return GenerationRequest(rid, tuple(prompt(zlib.crc32(rid.encode()) % 1000, 8)), n, sampling, grammar=grammar, **kw)


def _accepts(grammars: GrammarCache, constraint: Constraint, tokens: Sequence[int]) -> bool:
    """Whether a fresh matcher of ``constraint`` takes every token of ``tokens``, in order."""
    matcher = grammars.get(constraint).start()
    return matcher.valid_prefix(tokens) == len(tokens)


def _check(events: list[TokenEvent], schema: dict[str, Any], constraint: Constraint, grammars: GrammarCache) -> str:
    text = "".join(e.text for e in events)
    finish = events[-1].finish
    assert finish in (FinishReason.EOS, FinishReason.LENGTH), finish
    if finish is FinishReason.EOS:
        jsonschema.validate(json.loads(text), schema)
    else:  # cut by the limit: every token is one the grammar took
        assert _accepts(grammars, constraint, tokens_of(events))
    return text


SAMPLED = (
    SamplingParams(),
    SamplingParams(temperature=1.0, seed=7),
    SamplingParams(temperature=0.8, top_k=40, top_p=0.9, repetition_penalty=1.3, seed=9, logprobs=True),
)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(schema=SCHEMAS)
def test_every_output_validates_against_its_schema(
    schema: dict[str, Any], engines: dict[str, Engine], grammars: GrammarCache
) -> None:
    constraint = Constraint("json_schema", json.dumps(schema))
    grammar = grammars.get(constraint)
    plain = run(engines["plain"], *(_request(f"s{i}", grammar, p) for i, p in enumerate(SAMPLED)))
    for events in plain.values():
        _check(events, schema, constraint, grammars)
    assert all(len(e.logprobs or ()) == len(e.token_ids) for e in plain["s2"])  # logprobs of masked rows
    lookup = run(engines["lookup"], _request("s0", grammar, SAMPLED[0]))["s0"]
    assert tokens_of(lookup) == tokens_of(plain["s0"])  # speculation never changes constrained greedy output
    quantized = run(engines["int8"], _request("q", grammar, SAMPLED[0]))["q"]
    _check(quantized, schema, constraint, grammars)


@pytest.mark.parametrize(
    ("constraint", "valid"),
    [
        (Constraint("regex", r"[0-9]{3}-[a-z]{2,4}"), lambda t: re.fullmatch(r"[0-9]{3}-[a-z]{2,4}", t)),
        (Constraint("choice", choices=("yes", "no", "not sure")), lambda t: t in ("yes", "no", "not sure")),
        (Constraint("json_object"), lambda t: isinstance(json.loads(t), dict)),
        (
            Constraint("grammar", 'start: "(" item (", " item)* ")"\nitem: /[a-z]{1,3}/', "lark"),
            lambda t: re.fullmatch(r"\([a-z]{1,3}(, [a-z]{1,3})*\)", t),
        ),
        (Constraint("grammar", 'root ::= "x=" [0-9] [0-9]? ";"', "gbnf"), lambda t: re.fullmatch(r"x=[0-9]{1,2};", t)),
    ],
    ids=["regex", "choice", "json_object", "lark", "gbnf"],
)
def test_regexes_choices_and_grammars_are_followed(
    constraint: Constraint, valid: Any, engines: dict[str, Engine], grammars: GrammarCache
) -> None:
    grammar = grammars.get(constraint)
    out = run(engines["plain"], *(_request(f"r{i}", grammar, p, n=120) for i, p in enumerate(SAMPLED)))
    for events in out.values():
        text = "".join(e.text for e in events)
        if events[-1].finish is FinishReason.EOS:
            assert valid(text), text
        else:
            assert events[-1].finish is FinishReason.LENGTH
            assert _accepts(grammars, constraint, tokens_of(events))


def test_a_length_cut_says_so_and_is_a_prefix(engines: dict[str, Engine], grammars: GrammarCache) -> None:
    constraint = Constraint("json_schema", json.dumps(_object({"alpha": {"type": "string"}}, True)))
    events = run(engines["plain"], _request("cut", grammars.get(constraint), SAMPLED[0], n=3))["cut"]
    assert events[-1].finish is FinishReason.LENGTH and len(tokens_of(events)) == 3
    assert _accepts(grammars, constraint, tokens_of(events))


def test_a_grammar_that_refuses_every_token_ends_its_row_at_a_dead_end(
    engines: dict[str, Engine], grammars: GrammarCache
) -> None:
    engine = engines["plain"]
    grammar = grammars.get(Constraint("regex", "[a-z]{5,40}"))
    handle_events: list[TokenEvent] = []
    free: list[TokenEvent] = []
    engine.submit(_request("dead", grammar, SAMPLED[0], n=30), handle_events.append)
    engine.submit(_request("free", None, SAMPLED[0], n=30, ignore_eos=True), free.append)
    for _ in range(3):
        engine.step()
    row = next(r for r in engine.scheduler.running if r.request.request_id == "dead")
    assert row.matcher is not None
    assert not row.matcher.consume(0)  # a token the regex refuses: the matcher is in error from here on
    while not (handle_events and handle_events[-1].finish is not None):
        engine.step()
    assert handle_events[-1].finish is FinishReason.DEAD_END
    emitted = tokens_of(handle_events)
    assert emitted and _accepts(grammars, Constraint("regex", "[a-z]{5,40}"), emitted)  # nothing outside it
    while not (free and free[-1].finish is not None):
        engine.step()
    assert free[-1].finish is FinishReason.LENGTH and len(tokens_of(free)) == 30  # its neighbour goes on


def _adapter_engine(folder: Path, root: Path, grammars: GrammarCache, **overrides: Any) -> Engine:
    """An fp32 engine with LoRA adapters ``lora-a``, ``lora-b`` and Medusa heads ``heads`` (tree 0;1;0.0;1.0)."""
    s = Settings(model=folder, dtype="float32", **{**LIMITS, **overrides})
    model, cfg, _ = load_model(folder, dtype=torch.float32, device=CPU)
    store = AdapterStore(cfg, device=CPU, dtype=torch.float32, device_budget_bytes=1 << 26, host_budget_bytes=1 << 26)
    registry = MedusaRegistry(cfg, device=CPU, dtype=torch.float32)
    catalog = AdapterCatalog([MedusaPart(registry, tree="0;1;0.0;1.0"), LoraPart(store)])
    for name in ("lora-a", "lora-b", "heads"):
        catalog.register(name, root / name)
    # the heads load on the registry's thread
    assert wait_until(lambda: registry.request("heads") or registry.failure("heads") is not None, 30, poll=0.01)
    assert registry.failure("heads") is None
    return Engine(model, Tokenizer.from_folder(folder), s, adapters=catalog, constraints=grammars.backend)


@pytest.fixture(scope="module")
def adapter_root(served_tiny_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("constrained-adapters")
    write_peft_adapter(root / "lora-a", served_tiny_dir, r=4, alpha=8, seed=1, scale=0.5)
    write_peft_adapter(root / "lora-b", served_tiny_dir, r=8, alpha=8, seed=2, scale=0.5)
    h = ModelConfig.from_hf(served_tiny_dir).hidden_size
    g = torch.Generator().manual_seed(4)
    write_medusa(root / "heads", torch.randn(1, 2, h, h, generator=g) * 0.05, torch.zeros(1, 2, h), version=2)
    return root


def _mixed_jobs(grammars: GrammarCache) -> list[tuple[str, Any, str | None]]:
    person = _object({"name": {"type": "string", "maxLength": 8}, "age": {"type": "integer"}}, True)
    tags = {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "maxItems": 4}
    return [
        ("schema-base", grammars.get(Constraint("json_schema", json.dumps(person))), None),
        ("schema-a", grammars.get(Constraint("json_schema", json.dumps(tags))), "lora-a"),
        ("free-b", None, "lora-b"),
        ("regex-base", grammars.get(Constraint("regex", r"[A-Z][a-z]{3,8}\.")), None),
        ("choice-a", grammars.get(Constraint("choice", choices=("alpha", "beta", "gamma"))), "lora-a"),
        ("schema-heads", grammars.get(Constraint("json_schema", json.dumps(person))), "heads"),
        ("free-base", None, None),
    ]


@pytest.mark.numerics
def test_mixed_batches_give_every_row_its_own_tokens(
    served_tiny_dir: Path, adapter_root: Path, grammars: GrammarCache
) -> None:
    engine = _adapter_engine(served_tiny_dir, adapter_root, grammars, speculate_max_batch=0)
    jobs = _mixed_jobs(grammars)
    alone = {rid: tokens_of(run(engine, _request(rid, g, SAMPLED[0], n=32, adapter_id=a))[rid]) for rid, g, a in jobs}
    together = run(engine, *(_request(rid, g, SAMPLED[0], n=32, adapter_id=a) for rid, g, a in jobs))
    assert {rid: tokens_of(ev) for rid, ev in together.items()} == alone
    sampled = run(engine, *(_request(rid, g, SAMPLED[2], n=32, adapter_id=a) for rid, g, a in jobs))
    for rid, grammar, _ in jobs:  # greedy and sampled, under LoRAs and Medusa heads: every token the grammar's
        for events in (together[rid], sampled[rid]):
            assert events[-1].finish in (FinishReason.EOS, FinishReason.LENGTH)
            if grammar is not None:
                assert grammar.start().valid_prefix(tokens_of(events)) == len(tokens_of(events))
                if rid.startswith("schema") and events[-1].finish is FinishReason.EOS:
                    json.loads("".join(e.text for e in events))


@pytest.mark.numerics
def test_speculation_under_constraints_is_plain_constrained_greedy(
    served_tiny_dir: Path, adapter_root: Path, grammars: GrammarCache, monkeypatch: pytest.MonkeyPatch
) -> None:
    jobs = _mixed_jobs(grammars)
    plain = _adapter_engine(served_tiny_dir, adapter_root, grammars, speculate_max_batch=0)
    requests = [_request(rid, g, SAMPLED[0], n=32, adapter_id=a) for rid, g, a in jobs]
    expected = {r.request_id: tokens_of(run(plain, r)[r.request_id]) for r in requests}
    oracle = Oracle({r.prompt_ids: expected[r.request_id] for r in requests}, k=4)
    monkeypatch.setitem(SERVER_DRAFTERS, "oracle", lambda _settings: oracle)
    fast = _adapter_engine(
        served_tiny_dir, adapter_root, grammars, draft="oracle", speculate_max_batch=8, speculate_adaptive=False
    )
    together = run(fast, *requests)
    assert {rid: tokens_of(ev) for rid, ev in together.items()} == expected
    assert together["schema-base"][-1].accepted_draft_tokens >= 8  # the oracle's drafts were walked and kept
