"""The bad-input matrix (docs/bad-inputs.md) walked against one live server over loopback gRPC.

The doc's first table is the list of cases: each row is sent (Generate rows also as GenerateStream where the
row says so) and must get its status and a message containing its fragment, under 4 KiB. After every
row a greedy base request and a greedy request with a good LoRA must give the tokens they gave before the first
row: a bad input fails its own call, never the server or a neighbour. The doc and the cases here are kept in
step by the test itself (a row without a case, or a case without a row, fails), and every test the doc's
second table names must exist.
"""

from __future__ import annotations

import json
import re
import shutil
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import pytest
import torch
from loraplex.v1 import adapters_pb2 as apb
from loraplex.v1 import adapters_pb2_grpc as apb_grpc
from loraplex.v1 import generation_pb2 as pb
from loraplex.v1 import generation_pb2_grpc as pb_grpc
from support.adapter_files import rewrite_adapter_tensors, write_peft_adapter
from support.paths import ROOT
from support.servers import Outcome, as_stream, outcome, text_req, tiny_settings
from support.wait import wait_until

from service.api.server import BackgroundServer

DOC = ROOT / "docs" / "bad-inputs.md"
WALKED, ELSEWHERE = "## Walked against one live server", "## Covered by other tests"
GENERATE_KEY, ADMIN_KEY = "gen-5e1f0a", "adm-92c4b7"
GEN, ADM = (("authorization", f"Bearer {GENERATE_KEY}"),), (("authorization", f"Bearer {ADMIN_KEY}"),)
WEIGHTS = "adapter_model.safetensors"
# Every message stays well under gRPC's 8 KiB metadata soft limit, past which a status turns into
# RESOURCE_EXHAUSTED; echoed input is cut (service.errors.shorten), so no message grows with its input.
MESSAGE_BOUND = 4096
LIMITS: dict[str, object] = {
    "max_batch_size": 2,
    "max_queue": 1,
    "max_new_tokens": 1000,
    "max_total_tokens": 1024,
    "max_prompt_bytes": 4096,
    "max_chat_messages": 8,
    "max_stop_sequences": 4,
    "max_stop_sequence_bytes": 32,
    "max_message_bytes": 64 << 10,
    "max_constraint_bytes": 1024,
    "max_constraint_choices": 4,
    "max_constraint_depth": 4,
}


@dataclass(frozen=True)
class Row:
    case: str
    rpc: str
    status: str
    fragment: str  # "" where the row is accepted (OK)


def doc_section(heading: str) -> list[list[str]]:
    """The cells of every body row of the table under ``heading`` in docs/bad-inputs.md."""
    text = DOC.read_text()
    body = text.split(heading, 1)[1].split("\n## ", 1)[0]
    rows = [line for line in body.splitlines() if line.startswith("| `")]
    return [[cell.strip() for cell in line.strip("|").split(" | ")] for line in rows]


def walked_rows() -> list[Row]:
    rows = []
    for case, _, rpc, status, fragment in doc_section(WALKED):
        rows.append(Row(case.strip("`"), rpc, status, fragment.strip("`") if fragment != "—" else ""))
    return rows


@dataclass
class Live:
    """The one server of the matrix, its stubs and its adapter root."""

    server: BackgroundServer
    channel: grpc.Channel
    stub: pb_grpc.GenerationStub
    admin: apb_grpc.AdaptersStub
    root: Path
    spare: Path  # adapter files outside the root, to copy in


def greedy(live: Live, request: pb.GenerateRequest) -> list[list[int]]:
    return [list(r.token_ids) for r in live.stub.Generate(request, metadata=GEN, timeout=60).results]


def load(live: Live, adapter_id: str, folder: Path) -> None:
    live.admin.LoadAdapter(apb.LoadAdapterRequest(id=adapter_id, source=str(folder)), metadata=ADM, timeout=60)


# ------------------------------------------------------------------------------------------ request fields

Mutation = Callable[[pb.GenerateRequest], None]


def _chat(*messages: pb.ChatMessage) -> Mutation:
    return lambda r: r.inputs[0].CopyFrom(pb.Input(messages=pb.ChatMessages(messages=list(messages))))


def _set(path: str, value: object) -> Mutation:
    def mutate(r: pb.GenerateRequest) -> None:
        *parents, name = path.split(".")
        target: Any = r
        for parent in parents:
            target = getattr(target, parent)
        setattr(target, name, value)

    return mutate


FIELDS: dict[str, Mutation] = {
    "input-unset": lambda r: r.inputs[0].ClearField("text"),
    "empty-text": lambda r: setattr(r.inputs[0], "text", ""),
    "prompt-no-tokens": lambda r: setattr(r.inputs[0], "text", "\x16"),  # valid text that tokenizes to nothing
    "prompt-tokens": lambda r: setattr(r.inputs[0], "text", "word " * 400),
    "prompt-bytes": lambda r: setattr(r.inputs[0], "text", "x" * 4097),
    "prompt-bytes-multibyte": lambda r: setattr(r.inputs[0], "text", "€" * 1366),
    "chat-messages": _chat(*[pb.ChatMessage(role="user", content="hi")] * 9),
    "chat-empty": _chat(),
    "chat-no-role": _chat(pb.ChatMessage(role="", content="hi")),
    "max-new-tokens-zero": _set("stopping.max_new_tokens", 0),
    "max-new-tokens-over": _set("stopping.max_new_tokens", 100_000),
    "temperature-negative": _set("sampling.temperature", -0.5),
    "temperature-nan": _set("sampling.temperature", float("nan")),
    "temperature-inf": _set("sampling.temperature", float("inf")),
    "top-p-zero": _set("sampling.top_p", 0.0),
    "top-p-over": _set("sampling.top_p", 1.5),
    "penalty-zero": _set("sampling.repetition_penalty", 0.0),
    "penalty-tiny": _set("sampling.repetition_penalty", 1e-45),
    "penalty-huge": _set("sampling.repetition_penalty", 200.0),
    "stop-empty": lambda r: r.stopping.stop_sequences.append(""),
    "stop-too-many": lambda r: r.stopping.stop_sequences.extend(["a", "b", "c", "d", "e"]),
    "stop-too-long": lambda r: r.stopping.stop_sequences.append("s" * 33),
    "adapter-unknown": _set("adapter_id", "nope"),
    "adapter-id-too-long": _set("adapter_id", "a" * 10_000),
    "adapter-id-unicode": _set("adapter_id", "good\u00e9"),
    "adapter-id-control": _set("adapter_id", "go\x01od"),
    "adapter-id-nul": _set("adapter_id", "go\x00od"),
    "adapter-id-trailing-space": _set("adapter_id", "good "),
    "adapter-id-leading-dot": _set("adapter_id", ".good"),
    "request-id-space": _set("request_id", "has space"),
    "request-id-too-long": _set("request_id", "r" * 10_000),
    "speculate-no-adapter": _set("speculate", True),
    "speculate-lora": lambda r: r.MergeFrom(pb.GenerateRequest(speculate=True, adapter_id="good")),
}


def _constraint(**kind: Any) -> Mutation:
    return lambda r: r.constraint.CopyFrom(pb.Constraint(**kind))


def _nested(depth: int) -> str:
    """A JSON schema of ``depth`` objects, each the only property of the one around it."""
    schema: dict[str, Any] = {"type": "integer"}
    for _ in range(depth):
        schema = {"type": "object", "properties": {"a": schema}}
    return json.dumps(schema)


CONSTRAINTS: dict[str, Mutation] = {
    "constraint-too-large": _constraint(regex="a" * 1025),
    "constraint-too-large-multibyte": _constraint(choice=pb.Choice(choices=["€" * 400, "é"])),  # 401 chars, 1,202 bytes
    "constraint-too-many-choices": _constraint(choice=pb.Choice(choices=["a", "b", "c", "d", "e"])),
    "constraint-choice-empty": _constraint(choice=pb.Choice()),
    "constraint-choice-empty-string": _constraint(choice=pb.Choice(choices=["yes", ""])),
    "constraint-regex-empty": _constraint(regex=""),
    "constraint-dialect-unspecified": _constraint(grammar=pb.Grammar(text='start: "a"')),
    "constraint-dialect-unknown": _constraint(grammar=pb.Grammar(text='start: "a"', dialect=9)),  # type: ignore[arg-type]
    "constraint-regex-invalid": _constraint(regex="(unclosed"),
    "constraint-schema-not-json": _constraint(json_schema="{not json"),
    "constraint-schema-too-deep": _constraint(json_schema=_nested(6)),
    "constraint-grammar-invalid": _constraint(grammar=pb.Grammar(text="start: (", dialect=pb.GRAMMAR_DIALECT_LARK)),
}


def field_case(mutate: Mutation, both: bool) -> Callable[[Live], list[Outcome]]:
    def run(live: Live) -> list[Outcome]:
        r = text_req("fine prompt", 4)
        mutate(r)
        calls = [lambda: live.stub.Generate(r, metadata=GEN, timeout=30)]
        if both:
            calls.append(lambda: list(live.stub.GenerateStream(as_stream(r), metadata=GEN, timeout=30)))
        return [outcome(call) for call in calls]

    return run


# ------------------------------------------------------------------------------------------ whole calls


def _inputs(n: int) -> Callable[[Live], list[Outcome]]:
    request = pb.GenerateRequest(inputs=[pb.Input(text="a")] * n, stopping=pb.StoppingCriteria(max_new_tokens=2))
    return lambda live: [outcome(lambda: live.stub.Generate(request, metadata=GEN, timeout=30))]


def _accepted_like_greedy(mutate: Mutation) -> Callable[[Live], list[Outcome]]:
    def run(live: Live) -> list[Outcome]:
        odd = text_req("Once upon a time", 8)
        mutate(odd)
        assert greedy(live, odd) == greedy(live, text_req("Once upon a time", 8))
        return [(grpc.StatusCode.OK, "")]

    return run


def _seed_wraps(live: Live) -> list[Outcome]:
    def sampled(seed: int, inputs: int) -> list[list[int]]:
        r = text_req("Once upon a time", 8, sampling=pb.SamplingParams(temperature=1.0, seed=seed))
        r.inputs.extend([pb.Input(text="Once upon a time")] * (inputs - 1))
        return greedy(live, r)

    assert sampled(2**64 - 1, 2) == [sampled(2**64 - 1, 1)[0], sampled(0, 1)[0]]
    return [(grpc.StatusCode.OK, "")]


def _raw(method: str, data: bytes, *, stream: bool) -> Callable[[Live], Outcome]:
    def run(live: Live) -> Outcome:
        if stream:
            call = live.channel.unary_stream(method, request_serializer=None, response_deserializer=None)
            return outcome(lambda: list(call(data, metadata=GEN, timeout=30)))
        unary = live.channel.unary_unary(method, request_serializer=None, response_deserializer=None)
        return outcome(lambda: unary(data, metadata=GEN, timeout=30))

    return run


def _malformed(live: Live) -> list[Outcome]:
    return [
        _raw("/loraplex.v1.Generation/Generate", b"\x0f", stream=False)(live),
        _raw("/loraplex.v1.Generation/GenerateStream", b"\x0f", stream=True)(live),
    ]


def _bad_utf8(live: Live) -> list[Outcome]:
    data = pb.TokenizeRequest(input=pb.Input(text="AAAA")).SerializeToString().replace(b"AAAA", b"\xff\xfe\xc0\x80")
    return [_raw("/loraplex.v1.Generation/Tokenize", data, stream=False)(live)]


def _tokenize(text: str) -> Callable[[Live], list[Outcome]]:
    request = pb.TokenizeRequest(input=pb.Input(text=text))
    return lambda live: [outcome(lambda: live.stub.Tokenize(request, metadata=GEN, timeout=30))]


def _key(metadata: tuple[tuple[str, str], ...]) -> Callable[[Live], list[Outcome]]:
    return lambda live: [outcome(lambda: live.stub.Generate(text_req("hi", 2), metadata=metadata, timeout=30))]


def _generate_key_on_admin(live: Live) -> list[Outcome]:
    return [outcome(lambda: live.admin.ListAdapters(apb.ListAdaptersRequest(), metadata=GEN, timeout=30))]


def _admin(method: str, request: object) -> Callable[[Live], list[Outcome]]:
    return lambda live: [outcome(lambda: getattr(live.admin, method)(request, metadata=ADM, timeout=30))]


def _load(adapter_id: str, source: Callable[[Live], str]) -> Callable[[Live], list[Outcome]]:
    def run(live: Live) -> list[Outcome]:
        request = apb.LoadAdapterRequest(id=adapter_id, source=source(live))
        return [outcome(lambda: live.admin.LoadAdapter(request, metadata=ADM, timeout=30))]

    return run


def _broken_adapter(name: str, breaks: Callable[[Live, Path], None]) -> Callable[[Live], list[Outcome]]:
    """Register a healthy copy of the spare LoRA as ``name``, break it with ``breaks``, then generate with it."""

    def run(live: Live) -> list[Outcome]:
        folder = shutil.copytree(live.spare / "healthy", live.root / name)
        load(live, name, folder)
        breaks(live, folder)
        return [outcome(lambda: live.stub.Generate(text_req("hi", 4, adapter_id=name), metadata=GEN, timeout=60))]

    return run


def _nan_adapter(live: Live) -> list[Outcome]:
    load(live, "nan", live.root / "nan")  # registration reads headers only: accepted
    return [outcome(lambda: live.stub.Generate(text_req("hi", 4, adapter_id="nan"), metadata=GEN, timeout=60))]


def _truncate(live: Live, folder: Path) -> None:
    data = (folder / WEIGHTS).read_bytes()
    (folder / WEIGHTS).write_bytes(data[: len(data) // 2])


def _weights_only(live: Live, folder: Path) -> None:
    shutil.copy(live.spare / "larger" / WEIGHTS, folder / WEIGHTS)  # r=8 tensors; the config still says r=2


def _replaced(live: Live) -> list[Outcome]:
    folder = shutil.copytree(live.spare / "healthy", live.root / "replaced")
    load(live, "replaced", folder)
    shutil.copy(live.spare / "larger" / WEIGHTS, folder / WEIGHTS)  # other ranks, more modules: other offsets
    shutil.copy(live.spare / "larger" / "adapter_config.json", folder / "adapter_config.json")
    served = greedy(live, text_req("hi", 6, adapter_id="replaced"))  # the first read: finds the file changed
    load(live, "fresh-larger", shutil.copytree(live.spare / "larger", live.root / "fresh-larger"))
    load(live, "fresh-healthy", shutil.copytree(live.spare / "healthy", live.root / "fresh-healthy"))
    assert served == greedy(live, text_req("hi", 6, adapter_id="fresh-larger"))
    assert served != greedy(live, text_req("hi", 6, adapter_id="fresh-healthy"))
    return [(grpc.StatusCode.OK, "")]


def _queue_full(live: Live) -> list[Outcome]:
    engine = live.server.server.runtime.loaded.engine  # type: ignore[union-attr]
    occupying = [live.stub.Generate.future(text_req("occupy", 1000), metadata=GEN, timeout=120) for _ in range(3)]
    try:
        assert wait_until(lambda: engine.in_flight == 3), "2 running + 1 waiting never reached"
        return [outcome(lambda: live.stub.Generate(text_req("one too many", 2), metadata=GEN, timeout=30))]
    finally:
        for call in occupying:
            call.cancel()
        assert wait_until(lambda: engine.in_flight == 0 and engine.state().running == 0)


def _deadline(live: Live) -> list[Outcome]:
    engine = live.server.server.runtime.loaded.engine  # type: ignore[union-attr]
    got = outcome(lambda: live.stub.Generate(text_req("slow", 1000), metadata=GEN, timeout=0.05))
    assert wait_until(lambda: engine.in_flight == 0 and engine.state().running == 0)  # the slot came back
    return [got]


def _outside(live: Live) -> str:
    return str(live.spare / "healthy")


CASES: dict[str, Callable[[Live], list[Outcome]]] = {
    "no-inputs": _inputs(0),
    "too-many-inputs": _inputs(3),
    **{name: field_case(mutate, both=True) for name, mutate in FIELDS.items()},
    **{name: field_case(mutate, both=True) for name, mutate in CONSTRAINTS.items()},
    "temperature-tiny": _accepted_like_greedy(_set("sampling.temperature", 1e-45)),
    "top-k-huge": _accepted_like_greedy(_set("sampling.top_k", 4_000_000_000)),
    "seed-wraps": _seed_wraps,
    "malformed-bytes": _malformed,
    "bad-utf8": _bad_utf8,
    "oversize-message": _tokenize("w" * (70 << 10)),
    "tokenize-too-large": _tokenize("w" * 5000),
    "key-missing": _key(()),
    "key-wrong": _key((("authorization", "Bearer not-a-key"),)),
    "key-generate-on-admin": _generate_key_on_admin,
    "load-missing-folder": _load("missing", lambda live: str(live.root / "absent")),
    "load-outside-roots": _load("outside", _outside),
    "load-plain-file": _load("plain", lambda live: str(live.root / "plain.txt")),
    "load-empty-source": _load("empty", lambda live: ""),
    "load-hf-malformed": _load("hf-bad", lambda live: "hf://acme/../etc"),
    "load-hf-absent": _load("hf-absent", lambda live: "hf://acme/loraplex-not-in-any-cache"),
    "load-bad-id": _load("bad id", lambda live: str(live.root / "good")),
    "load-id-too-long": _load("i" * 10_000, lambda live: str(live.root / "good")),
    "load-empty-id": _load("", lambda live: str(live.root / "good")),
    "load-duplicate": _load("good", lambda live: str(live.root / "good")),
    "get-unknown": _admin("GetAdapter", apb.GetAdapterRequest(id="ghost")),
    "get-id-too-long": _admin("GetAdapter", apb.GetAdapterRequest(id="g" * 10_000)),
    "get-bad-id": _admin("GetAdapter", apb.GetAdapterRequest(id="good\x00")),
    "unload-unknown": _admin("UnloadAdapter", apb.UnloadAdapterRequest(id="ghost")),
    "unload-id-too-long": _admin("UnloadAdapter", apb.UnloadAdapterRequest(id="u" * 10_000)),
    "unload-bad-id": _admin("UnloadAdapter", apb.UnloadAdapterRequest(id="good ")),
    "unload-empty-id": _admin("UnloadAdapter", apb.UnloadAdapterRequest(id="")),
    "nan-adapter": _nan_adapter,
    "adapter-truncated": _broken_adapter("truncated", _truncate),
    "adapter-replaced": _replaced,
    "adapter-weights-mismatch": _broken_adapter("mismatch", _weights_only),
    "queue-full": _queue_full,
    "deadline": _deadline,
}


# ------------------------------------------------------------------------------------------ the server


def _poison(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    key = sorted(k for k in tensors if "lora_B" in k)[0]
    return {k: torch.full_like(v, float("nan")) if k == key else v for k, v in tensors.items()}


@pytest.fixture(scope="module")
def live(served_tiny_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Live]:
    from support.tiny_models import load_hf_llama

    base = load_hf_llama(served_tiny_dir)
    root, spare = tmp_path_factory.mktemp("matrix_root"), tmp_path_factory.mktemp("matrix_spare")
    write_peft_adapter(root / "good", base, r=4, seed=1, scale=0.5)
    write_peft_adapter(root / "nan", base, r=4, seed=2, scale=0.5)
    rewrite_adapter_tensors(root / "nan", _poison)
    write_peft_adapter(spare / "healthy", base, r=2, seed=3, scale=0.5)
    write_peft_adapter(spare / "larger", base, r=8, seed=4, scale=0.5, target_modules=("q_proj", "k_proj", "v_proj"))
    (root / "plain.txt").write_text("not an adapter folder")
    keys = tmp_path_factory.mktemp("matrix_keys") / "api-keys"
    keys.write_text(f"generate:{GENERATE_KEY}\nadmin:{ADMIN_KEY}\n")
    settings = tiny_settings(served_tiny_dir, adapter_roots=(root,), api_key_file=keys, **LIMITS)
    with BackgroundServer(settings) as srv, grpc.insecure_channel(srv.target) as channel:
        live = Live(srv, channel, pb_grpc.GenerationStub(channel), apb_grpc.AdaptersStub(channel), root, spare)
        load(live, "good", root / "good")
        yield live


def normal_answers(live: Live) -> list[list[int]]:
    """What the matrix must never change: a greedy base request and a greedy request with the good LoRA."""
    base = greedy(live, text_req("The same answer", 12))
    return base + greedy(live, text_req("The same answer", 12, adapter_id="good"))


@pytest.fixture(scope="module")
def before(live: Live) -> list[list[int]]:
    answers = normal_answers(live)
    assert answers[0] != answers[1] and all(len(a) == 12 for a in answers)  # the LoRA does change the answer
    return answers


ROWS = walked_rows()


@pytest.mark.parametrize("row", ROWS, ids=[row.case for row in ROWS])
def test_each_bad_input_gets_its_status_and_the_server_keeps_its_answers(
    live: Live, before: list[list[int]], row: Row
) -> None:
    outcomes = CASES[row.case](live)
    assert len(outcomes) == (2 if row.rpc == "Generate, GenerateStream" else 1), row.rpc
    for code, details in outcomes:
        assert code.name == row.status, (row.case, code, details)
        assert row.fragment.lower() in details.lower(), (row.case, details)
        assert len(details) < MESSAGE_BOUND, (row.case, len(details))
    assert normal_answers(live) == before, f"{row.case} changed a normal request's answer"


def test_the_doc_and_the_cases_agree() -> None:
    documented = [row.case for row in ROWS]
    assert len(documented) == len(set(documented)), "a case is listed twice"
    missing = {"no case": set(documented) - set(CASES), "no row": set(CASES) - set(documented)}
    assert set(documented) == set(CASES), missing
    statuses = {code.name for code in grpc.StatusCode}
    assert {row.status for row in ROWS} <= statuses
    assert all(row.fragment for row in ROWS if row.status != "OK")


def test_every_test_the_doc_names_exists() -> None:
    named = doc_section(ELSEWHERE)
    assert named
    for case, _, _, test in named:
        path, _, name = test.strip("`").partition("::")
        assert re.search(rf"^def {name}\(", (ROOT / path).read_text(), re.M), (case, test)


def test_the_readme_links_the_matrix() -> None:
    assert "(docs/bad-inputs.md)" in (ROOT / "README.md").read_text()
