"""PEFT exactness of every adapter variant the server accepts, alone and all together in one mixed batch.

DoRA (all seven projections, and q/v only), one adapter at a strength (0, 0.5, 2; DoRA at 0.5), a three-adapter
mixture of different ranks and targets, LoRA on embed_tokens and lm_head (untied and tied embeddings),
modules_to_save (the norms; embed_tokens and lm_head) and trained LoRA biases: each served row, through an engine
built the way the server builds it, must give peft's greedy tokens, peft's first-step logits and peft's
log-probability at every step (fp32, the tolerance of ``test_adapters_math``). The references are peft's own
forward (``support.peft_variants``); each differs from the base model, so no case can pass by serving the base.
The dense folder base carries every case, served with the batched LoRA math on the compiled kernel and on eager
torch; an int4 and a GGUF (Q4_1) base carry a few, against peft over the weights they serve, dequantized.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import pytest
import torch
from support.peft_variants import (
    Mix,
    Outputs,
    Served,
    engine_outputs,
    reference_model,
    reference_outputs,
    row_request,
    serve,
    summed_reference_model,
    write_served_llama,
    write_variants,
)

from service.kernels import native

pytestmark = pytest.mark.numerics

ALL = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# name -> LoraConfig keywords (+ seed), written by peft over the base, every tensor random (peft_variants)
ADAPTERS: dict[str, dict[str, Any]] = {
    "dora-all": {"r": 4, "lora_alpha": 8, "target_modules": list(ALL), "use_dora": True, "seed": 11},
    "dora-qv": {"r": 8, "lora_alpha": 16, "target_modules": ["q_proj", "v_proj"], "use_dora": True, "seed": 12},
    "lora": {"r": 8, "lora_alpha": 16, "target_modules": list(ALL), "seed": 13},
    # the mixture's parts: their union covers every projection of every layer (add_weighted_adapter's "cat" needs
    # each module it creates to have a source); the first is not rsLoRA (the mixture inherits its config)
    "mix-a": {"r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj"], "seed": 14},
    "mix-b": {"r": 8, "lora_alpha": 32, "target_modules": ["gate_proj", "down_proj"], "seed": 15},
    "mix-c": {
        "r": 2,
        "lora_alpha": 4,
        "target_modules": ["q_proj", "k_proj", "o_proj", "up_proj"],
        "use_rslora": True,
        "seed": 16,
    },
    # saved as peft saves it by default: with copies of the base embedding and head (served as replacements)
    "embed-head": {
        "r": 4,
        "lora_alpha": 8,
        "target_modules": ["embed_tokens", "lm_head", "q_proj"],
        "seed": 17,
        "save_embedding_layers": "auto",
    },
    "mix-eh": {"r": 2, "lora_alpha": 6, "target_modules": ["embed_tokens", "lm_head", "v_proj"], "seed": 21},
    "mts-norms": {
        "r": 4,
        "lora_alpha": 8,
        "target_modules": ["q_proj"],
        "seed": 18,
        "modules_to_save": ["input_layernorm", "post_attention_layernorm", "norm"],
    },
    "mts-embed-head": {
        "r": 4,
        "lora_alpha": 8,
        "target_modules": ["v_proj"],
        "seed": 19,
        "modules_to_save": ["embed_tokens", "lm_head"],
    },
    "bias": {"r": 4, "lora_alpha": 8, "target_modules": list(ALL), "lora_bias": True, "seed": 20},
}
TIED_ADAPTERS = {name: ADAPTERS[name] for name in ("embed-head", "mts-embed-head", "lora")}

# case -> the row's weighted adapters; () is the base model
CASES: dict[str, Mix] = {
    "lora-x1": (("lora", 1.0),),  # the plain path: the harness's control
    "dora-all": (("dora-all", 1.0),),
    "dora-qv": (("dora-qv", 1.0),),
    "lora-x0": (("lora", 0.0),),
    "lora-x0.5": (("lora", 0.5),),
    "lora-x2": (("lora", 2.0),),
    "dora-x0.5": (("dora-all", 0.5),),
    "mix3": (("mix-a", 0.7), ("mix-b", 0.2), ("mix-c", 1.1)),
    "embed-head": (("embed-head", 1.0),),
    "mix-embed-head": (("mix-eh", 0.6), ("lora", -0.4)),  # LoRA on embed_tokens / lm_head stacked like the others
    "mts-norms": (("mts-norms", 1.0),),
    "mts-embed-head": (("mts-embed-head", 1.0),),
    "bias": (("bias", 1.0),),
}
TIED_CASES: dict[str, Mix] = {name: CASES[name] for name in ("lora-x1", "embed-head", "mts-embed-head")}
QUANTIZED = (
    "lora-x1",
    "dora-all",
    "dora-x0.5",
    "mix3",
    "embed-head",
    "mix-embed-head",
    "mts-norms",
    "mts-embed-head",
    "bias",
)
QUANTIZED_CASES = {name: CASES[name] for name in QUANTIZED}

PROMPTS = [[5, 17, 300, 4000, 42], [7, 7, 7, 1234], [1000, 2000, 3000, 4000, 5000, 6000, 77]]
NEW_TOKENS = 8
ATOL = 1e-4  # fp32 logits, as test_adapters_math checks the batched LoRA math against peft
# On a quantized base peft runs the dequantized weights densely while the server runs the kernel (torch's int4, the
# compiled Q4): sums in another order. The three-adapter mixture's largest gap measured 1.3e-4 under
# ATEN_CPU_CAPABILITY=default (7e-5 under AVX512), rounding that grows with the delta's size; a wrong delta is ~1.
QUANTIZED_ATOL = 2e-4


# --- bases, adapters, engines ----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def untied_dir(tmp_path_factory: pytest.TempPathFactory, smollm2_dir: Path) -> Path:
    return write_served_llama(tmp_path_factory.mktemp("untied"), smollm2_dir, seed=7)


@pytest.fixture(scope="module")
def adapter_root(tmp_path_factory: pytest.TempPathFactory, untied_dir: Path) -> Path:
    root = tmp_path_factory.mktemp("variants")
    write_variants(root, untied_dir, ADAPTERS)
    return root


@pytest.fixture(scope="module", params=["kernel", "eager"])
def untied(request: pytest.FixtureRequest, untied_dir: Path, adapter_root: Path) -> Iterator[Served]:
    """The untied base served with the batched LoRA math on the compiled kernel (where the library builds) and on
    eager torch (its tables as a self-check fallback leaves them, before any row); the other bases serve on the
    default."""
    served = serve(untied_dir, adapter_root)
    tables = served.engine.runner.tables
    assert tables is not None and (tables.native is None) == (native.kernels() is None)
    if request.param == "eager":
        tables.native = None
    yield served
    served.close()


@pytest.fixture(scope="module")
def tied(tmp_path_factory: pytest.TempPathFactory, smollm2_dir: Path) -> Iterator[Served]:
    folder = write_served_llama(tmp_path_factory.mktemp("tied"), smollm2_dir, seed=8, tie_word_embeddings=True)
    root = tmp_path_factory.mktemp("tied_variants")
    write_variants(root, folder, TIED_ADAPTERS)
    served = serve(folder, root)
    yield served
    served.close()


@pytest.fixture(scope="module", params=["int4", "gguf"])
def quantized(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory, untied_dir: Path, adapter_root: Path
) -> Iterator[Served]:
    """The untied base served int4-quantized or from a Q4_1 GGUF, with the same adapters; peft's reference runs on
    the weights it serves, dequantized to float32 (``quant_reference`` / ``gguf_files``)."""
    tmp = tmp_path_factory.mktemp(f"base_{request.param}")
    if request.param == "gguf":
        from support.gguf_files import write_reference_folder, write_tiny_gguf

        gguf = write_tiny_gguf(untied_dir, tmp / "model.gguf")
        served = serve(untied_dir, adapter_root, write_reference_folder(untied_dir, gguf, tmp / "ref"), gguf=gguf)
    else:
        from support.quant_reference import write_dequantized

        served = serve(untied_dir, adapter_root, quantize=request.param)
        served.reference_folder = write_dequantized(untied_dir, served.parts.model, tmp / "ref")
    yield served
    served.close()


_REFERENCES: dict[tuple[Path, Mix], list[Outputs]] = {}


def references(served: Served, mix: Mix) -> list[Outputs]:
    """peft's outputs for ``mix`` over ``served``'s reference weights, one per prompt (computed once)."""
    key = (served.reference_folder, mix)
    if key not in _REFERENCES:
        model = reference_model(served.reference_folder, served.adapters, mix)
        _REFERENCES[key] = [reference_outputs(model, p, NEW_TOKENS) for p in PROMPTS]
    return _REFERENCES[key]


# --- checks ----------------------------------------------------------------------------------------------------


def mismatch(got: Any, want: Outputs, atol: float = ATOL) -> str | None:
    """Why a served row is not peft's (None: it is)."""
    if isinstance(got, BaseException):
        return f"refused: {type(got).__name__}: {got}"
    if got.tokens != want.tokens:
        return f"tokens {got.tokens} != peft {want.tokens}"
    assert want.first_logits is not None
    if got.first_logits is None:
        return "no first-step logits recorded"
    gap = float((got.first_logits - want.first_logits).abs().max())
    if gap > atol:
        return f"first-step logits differ by up to {gap:.3g} (> {atol})"
    lp_gap = max(abs(a - b) for a, b in zip(got.logprobs, want.logprobs, strict=True))
    if lp_gap > atol:
        return f"log-probabilities differ by up to {lp_gap:.3g} (> {atol})"
    return None


def run_rows(served: Served, cases: Mapping[str, Mix], prompts: range) -> dict[str, str | None]:
    """Every case on each of ``prompts`` plus base-model rows, submitted together (they share forward passes):
    row label -> why it is not its own peft reference (None: it is)."""
    rows = {
        f"{case}/p{i}": row_request(f"{case}/p{i}", PROMPTS[i], mix, NEW_TOKENS)
        for case, mix in {**cases, "base": ()}.items()
        for i in prompts
    }
    got = engine_outputs(served, rows)
    wanted = {case: references(served, mix) for case, mix in {**cases, "base": ()}.items()}
    atol = QUANTIZED_ATOL if served.engine.model.quantized else ATOL
    return {rid: mismatch(got[rid], wanted[rid.split("/")[0]][int(rid[-1])], atol) for rid in rows}


def assert_all_exact(results: Mapping[str, str | None]) -> None:
    bad = {rid: why for rid, why in results.items() if why is not None}
    assert not bad, "rows that are not peft's:\n" + "\n".join(f"  {rid}: {why}" for rid, why in sorted(bad.items()))


# --- the reference itself --------------------------------------------------------------------------------------


def _differs(want: list[Outputs], base: list[Outputs]) -> bool:
    """Greedy tokens differ on some prompt and first-step logits on every prompt (by far more than ``ATOL``)."""
    gaps = [float((w.first_logits - b.first_logits).abs().max()) for w, b in zip(want, base, strict=True)]  # type: ignore[operator]
    return min(gaps) > 1e-2 and any(w.tokens != b.tokens for w, b in zip(want, base, strict=True))


@pytest.mark.parametrize("case", list(CASES))
def test_each_reference_differs_from_the_base(untied: Served, case: str) -> None:
    """Every case's peft reference changes the base's tokens and logits (strength 0 is the base, exactly)."""
    base, want = references(untied, ()), references(untied, CASES[case])
    if case == "lora-x0":
        assert [w.tokens for w in want] == [b.tokens for b in base]
        for w, b in zip(want, base, strict=True):
            torch.testing.assert_close(w.first_logits, b.first_logits, rtol=0, atol=1e-5)
    else:
        assert _differs(want, base), case


def test_the_strengths_are_distinct_references(untied: Served) -> None:
    """0.5, 1 and 2 on one adapter are three references (not one reference under three names)."""
    outputs = [o for case in ("lora-x0.5", "lora-x1", "lora-x2") for o in references(untied, CASES[case])]
    assert len({tuple(o.tokens) for o in outputs}) == len(outputs)


def test_tied_references_differ_from_the_base(tied: Served) -> None:
    base = references(tied, ())
    for case, mix in TIED_CASES.items():
        assert _differs(references(tied, mix), base), case


@pytest.mark.parametrize("case", ["mix3", "mix-embed-head"])
def test_the_mixture_reference_is_the_weighted_sum(untied: Served, case: str) -> None:
    """add_weighted_adapter("cat") and every part active at once, each scaled by its weight, agree: the reference
    is the weighted sum of the parts' deltas, not an artefact of one peft route."""
    mix = CASES[case]
    summed = summed_reference_model(untied.reference_folder, untied.adapters, mix)
    for want, prompt in zip(references(untied, mix), PROMPTS, strict=True):
        other = reference_outputs(summed, prompt, NEW_TOKENS)
        assert other.tokens == want.tokens
        torch.testing.assert_close(other.first_logits, want.first_logits, rtol=0, atol=ATOL)


# --- the engine against it --------------------------------------------------------------------------------------


@pytest.mark.parametrize("case", list(CASES))
def test_alone_matches_peft(untied: Served, case: str) -> None:
    """One case's rows (three prompts) with base rows beside them: each row is its peft reference."""
    assert_all_exact(run_rows(untied, {case: CASES[case]}, range(len(PROMPTS))))


def test_all_together_in_one_batch_match_peft(untied: Served) -> None:
    """Every case on two prompts plus base rows, admitted in one step: each row equals its own reference."""
    assert_all_exact(run_rows(untied, CASES, range(2)))


@pytest.mark.parametrize("case", list(TIED_CASES))
def test_tied_embeddings_alone_match_peft(tied: Served, case: str) -> None:
    assert_all_exact(run_rows(tied, {case: TIED_CASES[case]}, range(len(PROMPTS))))


def test_tied_embeddings_together_match_peft(tied: Served) -> None:
    assert_all_exact(run_rows(tied, TIED_CASES, range(2)))


@pytest.mark.parametrize("case", list(QUANTIZED_CASES))
def test_quantized_base_alone_matches_peft(quantized: Served, case: str) -> None:
    assert_all_exact(run_rows(quantized, {case: QUANTIZED_CASES[case]}, range(len(PROMPTS))))


def test_quantized_base_together_matches_peft(quantized: Served) -> None:
    assert_all_exact(run_rows(quantized, QUANTIZED_CASES, range(2)))


def test_quantized_references_differ_from_the_base(quantized: Served) -> None:
    base = references(quantized, ())
    for case, mix in QUANTIZED_CASES.items():
        assert _differs(references(quantized, mix), base), case
