"""Fuzzing the adapter config parsers: PEFT ``adapter_config.json`` and Medusa ``config.json``.

Random valid-looking configs (every field the parsers read, with plausible and hostile values) and the same
files damaged as text go through what registration runs on them — ``read_lora_config`` + ``resolve_targets``
against a tiny Llama, ``read_medusa_config`` + ``is_medusa_folder`` + ``index_medusa`` on a real heads file —
and must end in a result or a ``LoraplexError``, never another exception.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from support.fuzz import EDGE_INTS, SCALARS, fuzz_settings, json_values, text_mutations, typed_outcome

from service.adapters.lora.peft import MODULES, read_lora_config, resolve_targets
from service.adapters.medusa.format import CONFIG_FILE, index_medusa, is_medusa_folder, read_medusa_config, write_medusa
from service.errors import CheckpointError, InvalidAdapter, LoraplexError
from service.model.config import ModelConfig

# Module names and pieces of them, and regex-ish strings that compile, fail to compile, or overflow re's limits.
NAME_PARTS = st.sampled_from(
    [*MODULES, "self_attn.q_proj", "mlp", "lm_head", "embed_tokens", "layers", "model.layers.0.mlp.up_proj", "x"]
)
REGEX_BITS = st.sampled_from(
    [".*", "(", ")", "[", "]", "|", "?", "+", "*", "\\", "\\d", "{2}", "{99999999999}", "(?P<idx>", "(?P<", ">",
     "q_proj", "layers", ".", "^", "$", "\\N{LATIN}", "(?=", "\\1", "(.*)*", "(q_|k_)+"]
)  # fmt: skip
REGEXES = st.one_of(
    st.lists(REGEX_BITS, max_size=8).map("".join),
    st.integers(1, 3_000).map(lambda d: "(" * d + "q_proj" + ")" * d),  # nesting past re's recursion limit
)
TARGETS = st.one_of(st.none(), st.just("all-linear"), REGEXES, st.lists(st.one_of(NAME_PARTS, REGEXES), max_size=4))


def _maybe(values: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    """Mostly a plausible value, sometimes any JSON value."""
    return st.one_of(values, values, values, json_values())


LORA_FIELDS: dict[str, st.SearchStrategy[Any]] = {
    "peft_type": _maybe(st.sampled_from(["LORA", "LORA", "IA3", "lora"])),
    "r": _maybe(EDGE_INTS),
    "lora_alpha": _maybe(st.one_of(EDGE_INTS, st.floats())),
    "target_modules": _maybe(TARGETS),
    "exclude_modules": _maybe(TARGETS),
    "use_rslora": _maybe(st.booleans()),
    "fan_in_fan_out": _maybe(st.booleans()),
    "bias": _maybe(st.sampled_from(["none", "all", "lora_only"])),
    "use_dora": _maybe(st.booleans()),
    "modules_to_save": _maybe(st.one_of(st.none(), st.lists(NAME_PARTS, max_size=2))),
    "layers_to_transform": _maybe(st.one_of(st.none(), EDGE_INTS, st.lists(EDGE_INTS, max_size=3))),
    "layers_pattern": _maybe(st.one_of(st.none(), st.just("layers"), REGEXES, st.lists(REGEXES, max_size=2))),
    "rank_pattern": _maybe(st.dictionaries(st.one_of(NAME_PARTS, REGEXES), EDGE_INTS, max_size=3)),
    "alpha_pattern": _maybe(st.dictionaries(st.one_of(NAME_PARTS, REGEXES), st.one_of(EDGE_INTS, st.floats()))),
    "base_model_name_or_path": _maybe(st.text(max_size=8)),
}


@st.composite
def config_texts(draw: st.DrawFn, fields: dict[str, st.SearchStrategy[Any]], required: tuple[str, ...] = ()) -> str:
    """A JSON object with ``required`` and a random subset of the other ``fields`` (plus junk keys), possibly
    damaged as text."""
    optional = sorted(set(fields) - set(required))
    keys = [*required, *draw(st.lists(st.sampled_from(optional), unique=True, max_size=len(optional)))]
    raw = {key: draw(fields[key]) for key in keys}
    raw.update(draw(st.dictionaries(st.text(max_size=6), SCALARS, max_size=2)))
    return draw(text_mutations(json.dumps(raw)))


@pytest.fixture(scope="module")
def tiny_config(tiny_llama_dir: Path) -> ModelConfig:
    return ModelConfig.from_hf(tiny_llama_dir)


@pytest.fixture(scope="module")
def scratch(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("fuzz_configs")


@fuzz_settings()
@given(text=config_texts(LORA_FIELDS))
def test_lora_config_parse_raises_only_typed_errors(scratch: Path, tiny_config: ModelConfig, text: str) -> None:
    path = scratch / "adapter_config.json"
    path.write_text(text, encoding="utf-8", errors="surrogatepass")

    def register() -> dict[tuple[int, str], tuple[int, float]]:
        return resolve_targets(read_lora_config(path), tiny_config, file=path)

    outcome = typed_outcome(register)
    if isinstance(outcome, LoraplexError):
        assert isinstance(outcome, InvalidAdapter) and outcome.file == str(path)
    else:  # what registration accepted is servable: real projections, positive ranks, finite alphas
        for (layer, module), (rank, alpha) in outcome.items():
            assert 0 <= layer < tiny_config.num_layers and module in MODULES
            assert rank > 0 and math.isfinite(alpha)


MEDUSA_FIELDS: dict[str, st.SearchStrategy[Any]] = {
    "medusa_num_heads": _maybe(st.one_of(st.integers(0, 4), EDGE_INTS)),
    "medusa_num_layers": _maybe(st.one_of(st.integers(0, 2), EDGE_INTS)),
    "version": _maybe(st.one_of(st.none(), st.sampled_from([1, 2, 1.0, 2.5, 3]), EDGE_INTS, st.floats())),
    "base_model_name_or_path": _maybe(st.text(max_size=8)),
}


@pytest.fixture(scope="module")
def heads_dir(tiny_config: ModelConfig, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Real v1 heads for the tiny model: 2 heads x 1 block; the fuzzer rewrites only config.json."""
    hidden, vocab = tiny_config.hidden_size, tiny_config.vocab_size
    w, b, out = torch.zeros(1, 2, hidden, hidden), torch.zeros(1, 2, hidden), torch.zeros(2, vocab, hidden)
    return write_medusa(tmp_path_factory.mktemp("fuzz_heads"), w, b, out)


@fuzz_settings()
@given(text=config_texts(MEDUSA_FIELDS))
def test_medusa_config_parse_raises_only_typed_errors(heads_dir: Path, tiny_config: ModelConfig, text: str) -> None:
    path = heads_dir / CONFIG_FILE
    path.write_text(text, encoding="utf-8", errors="surrogatepass")
    assert isinstance(is_medusa_folder(heads_dir), bool)
    outcome = typed_outcome(lambda: read_medusa_config(path))
    if isinstance(outcome, LoraplexError):
        assert isinstance(outcome, InvalidAdapter)
        return
    spec = typed_outcome(lambda: index_medusa(heads_dir, tiny_config))
    if not isinstance(spec, LoraplexError):  # only the file's true shape can pass: 2 heads x 1 block, v1
        assert (spec.num_heads, spec.num_layers, spec.version) == (2, 1, 1)


@pytest.mark.parametrize(
    "text",
    [
        '{"r": 8, "lora_alpha": 1' + "0" * 400 + "}",  # an int too large for a float
        '{"r": 8, "target_modules": "' + "(" * 2000 + "q_proj" + ")" * 2000 + '"}',  # nesting past re's limit
        '{"r": 8, "target_modules": ["q_proj"], "rank_pattern": {"q{99999999999}": 4}}',  # repeat count overflow
        '{"r": 8, "target_modules": ["q_proj"], "layers_to_transform": [0], "layers_pattern": "(?P<idx>l)ayers"}',
        '{"r": 8, "target_modules": "(.*)*x"}',  # nested repetition: exponential backtracking (hours), now refused
        '{"r": 8, "target_modules": ["q_proj"], "rank_pattern": {"(q_|k_)+proj": 4}}',
        "[" * 100_000 + "]" * 100_000,  # JSON nested past the recursion limit
        '{"r": ' + "9" * 5000 + "}",  # past int()'s digit limit
    ],
    ids=["alpha-overflow", "regex-nesting", "regex-repeat", "layers-pattern-group", "regex-exponential",
         "pattern-key-exponential",
         "json-nesting", "json-digits"],
)  # fmt: skip
def test_lora_config_found_by_the_fuzzer_are_invalid_adapter(
    tmp_path: Path, tiny_config: ModelConfig, text: str
) -> None:
    path = tmp_path / "adapter_config.json"
    path.write_text(text, encoding="utf-8")
    with pytest.raises(InvalidAdapter):
        resolve_targets(read_lora_config(path), tiny_config, file=path)


def test_layers_pattern_alternation_selects_by_layer_index(tmp_path: Path, tiny_config: ModelConfig) -> None:
    # Found by the fuzzer: an alternation matched without the layer index and int(None) raised TypeError.
    path = tmp_path / "adapter_config.json"
    raw = {"r": 4, "target_modules": ["q_proj"], "layers_to_transform": [1], "layers_pattern": "layers|blocks"}
    path.write_text(json.dumps(raw), encoding="utf-8")
    assert resolve_targets(read_lora_config(path), tiny_config, file=path) == {(1, "q_proj"): (4, 8.0)}


@pytest.mark.parametrize(
    "raw",
    ['{"medusa_num_heads": 2, "medusa_num_layers": 1, "version": 1' + "0" * 400 + "}",
     '{"medusa_num_heads": ' + "9" * 5000 + ', "medusa_num_layers": 1}',
     '{"medusa_num_heads": 2, "medusa_num_layers": 1, "x": ' + "[" * 100_000 + "]" * 100_000 + "}"],
    ids=["version-overflow", "json-digits", "json-nesting"],
)  # fmt: skip
def test_medusa_config_found_by_the_fuzzer_are_invalid_adapter(heads_dir: Path, raw: str) -> None:
    path = heads_dir / CONFIG_FILE
    path.write_text(raw, encoding="utf-8")
    assert is_medusa_folder(heads_dir) is False or "medusa_num_heads" in raw
    with pytest.raises(InvalidAdapter):
        read_medusa_config(path)


def test_medusa_head_count_beyond_the_file_is_refused_without_listing_every_head(
    heads_dir: Path, tiny_config: ModelConfig
) -> None:
    # Found while fuzzing: medusa_num_heads=10**9 looped over every claimed head, listing each missing tensor.
    (heads_dir / CONFIG_FILE).write_text(json.dumps({"medusa_num_heads": 10**6, "medusa_num_layers": 1}))
    with pytest.raises(InvalidAdapter, match="hold only 6 tensor"):
        index_medusa(heads_dir, tiny_config)


@pytest.mark.parametrize(
    "regex",
    [r".*\.(q_proj|v_proj)", r"model\.layers\.(0|1)\.self_attn\.(q_proj|v_proj)", r".*\.layers\.\d+\.self_attn\.q_proj",
     r"^(?!.*lm_head).*_proj$", r".*(self_attn|mlp)\.[a-z]+_proj"],
)  # fmt: skip
def test_ordinary_target_regexes_are_still_accepted(tmp_path: Path, tiny_config: ModelConfig, regex: str) -> None:
    # The nested-repetition refusal must not catch the regexes people write.
    path = tmp_path / "adapter_config.json"
    path.write_text(json.dumps({"r": 4, "target_modules": regex}), encoding="utf-8")
    assert resolve_targets(read_lora_config(path), tiny_config, file=path)


def _seldom(values: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    """One time in twelve any JSON value, else ``values``: a model config has many required fields, and each
    must usually be right for the parser to get past the first."""
    return st.integers(0, 11).flatmap(lambda i: json_values() if i == 11 else values)


MODEL_REQUIRED = ("architectures", "model_type", "vocab_size", "hidden_size", "intermediate_size",
                  "num_hidden_layers", "num_attention_heads", "max_position_embeddings")  # fmt: skip
MODEL_FIELDS: dict[str, st.SearchStrategy[Any]] = {
    "architectures": _seldom(st.sampled_from([["LlamaForCausalLM"], ["MistralForCausalLM"], []])),
    "model_type": _seldom(st.sampled_from(["llama", "mistral"])),
    "vocab_size": _seldom(st.one_of(st.just(256), EDGE_INTS)),
    "hidden_size": _seldom(st.one_of(st.just(64), EDGE_INTS)),
    "intermediate_size": _seldom(st.one_of(st.just(96), EDGE_INTS)),
    "num_hidden_layers": _seldom(st.one_of(st.just(2), EDGE_INTS)),
    "num_attention_heads": _seldom(st.one_of(st.just(4), EDGE_INTS)),
    "num_key_value_heads": _seldom(st.one_of(st.just(2), EDGE_INTS)),
    "head_dim": _seldom(st.one_of(st.just(16), EDGE_INTS)),
    "max_position_embeddings": _seldom(st.one_of(st.just(256), EDGE_INTS)),
    "rms_norm_eps": _seldom(st.one_of(st.just(1e-5), st.floats())),
    "rope_theta": _seldom(st.one_of(st.just(10000.0), st.floats(), EDGE_INTS)),
    "rope_scaling": _seldom(
        st.fixed_dictionaries(
            {"rope_type": st.sampled_from(["llama3", "linear", "default"]), "factor": st.floats()},
            optional={
                "low_freq_factor": st.floats(),
                "high_freq_factor": st.floats(),
                "original_max_position_embeddings": EDGE_INTS,
            },
        )
    ),
    "tie_word_embeddings": _seldom(st.booleans()),
    "hidden_act": _seldom(st.just("silu")),
    "eos_token_id": _seldom(st.one_of(st.just(2), EDGE_INTS, st.lists(EDGE_INTS, max_size=3))),
    "quantization_config": _seldom(st.none()),
}


@fuzz_settings()
@given(text=config_texts(MODEL_FIELDS, MODEL_REQUIRED))
def test_model_config_parse_raises_only_typed_errors(scratch: Path, text: str) -> None:
    path = scratch / "config.json"
    path.write_text(text, encoding="utf-8", errors="surrogatepass")
    outcome = typed_outcome(lambda: ModelConfig.from_hf(path))
    if isinstance(outcome, LoraplexError):
        assert outcome.status == "INVALID_ARGUMENT"
    else:  # what is accepted can be built: positive sizes, finite rope parameters
        c = outcome
        assert min(c.vocab_size, c.hidden_size, c.num_layers, c.num_heads, c.num_kv_heads, c.head_dim) > 0
        assert c.num_heads % c.num_kv_heads == 0 and math.isfinite(c.rope_theta) and c.rope_theta > 0
        if c.rope_scaling is not None:
            r = c.rope_scaling
            assert all(math.isfinite(x) for x in (r.factor, r.low_freq_factor, r.high_freq_factor))


@pytest.mark.parametrize(
    "change",
    [{"rope_theta": None}, {"rope_theta": 10**400}, {"num_key_value_heads": -2}, {"head_dim": -16},
     {"rope_scaling": {"rope_type": "linear", "factor": float("nan")}},
     {"rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": float("nan"), "high_freq_factor": 4.0}},
     {"rope_scaling": {"rope_type": "linear", "factor": 10**400}}],
    ids=["theta-null", "theta-overflow", "kv-heads-negative", "head-dim-negative", "factor-nan", "low-nan",
         "factor-overflow"],
)  # fmt: skip
def test_model_config_found_by_the_fuzzer_is_a_checkpoint_error(
    tiny_llama_dir: Path, tmp_path: Path, change: dict[str, Any]
) -> None:
    # Found by the fuzzer: TypeError / OverflowError from float(), and negative or NaN values accepted.
    raw = json.loads((tiny_llama_dir / "config.json").read_text())
    raw.pop("rope_parameters", None)
    raw.update({"rope_theta": 10000.0, **change})
    path = tmp_path / "config.json"
    path.write_text(json.dumps(raw))
    with pytest.raises(CheckpointError):
        ModelConfig.from_hf(path)
