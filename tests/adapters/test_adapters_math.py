"""The batched LoRA math (``service.adapters.lora.batch``) against peft, the reference.

Four real PEFT adapters on a tiny random Llama, written by peft itself (``tests/support/adapter_files.py``): different
ranks and alphas, rsLoRA on one, a regex target with ``rank_pattern`` / ``alpha_pattern`` on another, all seven
modules on one, ``layers_to_transform`` on one. A mixed batch of them plus base-only rows through our model must
give, row by row, the logits of peft with that adapter alone (fp32, 1e-4) and the same greedy tokens. Every test
runs twice: on the dense base and on an int4-quantized one (peft then runs on the dequantized weights).

``LoraLayer`` objects are built here from the safetensors files with ``safetensors.torch.load_file`` and the
scaling applied by hand (``adapter_files.peft_lora_layers``), independently of the adapter store.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import pytest
import torch
from support.adapter_files import load_peft_model, lookup_for, peft_lora_layers, write_peft_adapters
from support.native import compiled_kernels
from support.paths import ROOT
from support.quant_reference import write_dequantized
from support.tiny_models import load_ours

from service.adapters.lora.batch import SITES, AdapterBatch, LoraTables, Mode
from service.adapters.lora.types import LoraLayer, LoraModule
from service.errors import InvalidAdapter
from service.model import KVCache, Llama

pytestmark = pytest.mark.numerics

CPU = torch.device("cpu")

# name -> write_peft_adapter arguments
ADAPTERS: dict[str, dict[str, Any]] = {
    "qv": {"r": 4, "alpha": 8, "target_modules": ("q_proj", "v_proj"), "seed": 1},
    "all_rs": {
        "r": 8,
        "alpha": 4,
        "rslora": True,
        "target_modules": ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"),
        "seed": 2,
    },
    "mlp_l1": {"r": 2, "alpha": 6, "target_modules": ("o_proj", "gate_proj", "down_proj"), "layers_to_transform": [1]},
    "regex": {
        "r": 16,
        "alpha": 8,
        "target_modules": r".*\.(k_proj|up_proj)",
        "rank_pattern": {"k_proj": 3},
        "alpha_pattern": {"up_proj": 32},
        "seed": 4,
    },
}


@pytest.fixture(scope="module", params=["dense", "int4"])
def base_setup(
    request: pytest.FixtureRequest, tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> dict[str, Any]:
    """Every test runs on a dense base and on an int4 base (the QLoRA serving case), whose peft reference is built
    on the same weights dequantized to float32 (``quant_reference.write_dequantized``)."""
    root = tmp_path_factory.mktemp("adapters")
    folders = write_peft_adapters(root, tiny_llama_dir, ADAPTERS)
    quantize = None if request.param == "dense" else request.param
    model = load_ours(tiny_llama_dir, quantize=quantize)
    base = tiny_llama_dir if quantize is None else write_dequantized(tiny_llama_dir, model, root / "dequantized")
    return {
        "model": model,
        "quantize": quantize,
        "peft": load_peft_model(base, folders),
        "layers": {name: peft_lora_layers(folder) for name, folder in folders.items()},
        "folders": folders,
    }


@pytest.fixture(params=["kernel", "eager"])
def setup(request: pytest.FixtureRequest, base_setup: dict[str, Any]) -> dict[str, Any]:
    """``base_setup`` with the model's batched LoRA math on the compiled kernel (``Llama.lora_native``; skipped
    where no compiler is) or on eager torch: every test proves both."""
    base_setup["model"].lora_native = compiled_kernels() if request.param == "kernel" else None
    return base_setup


def peft_logits(peft_model: Any, adapter: str | None, tokens: torch.Tensor) -> torch.Tensor:
    """fp32 logits [T, vocab] of peft with ``adapter`` alone (``None``: adapters disabled) for one row."""
    with torch.no_grad():
        if adapter is None:
            with peft_model.disable_adapter():
                return peft_model(tokens[None]).logits[0].float()  # type: ignore[no-any-return]
        peft_model.set_adapter(adapter)
        return peft_model(tokens[None]).logits[0].float()  # type: ignore[no-any-return]


def run_ours(
    model: Llama,
    tokens: torch.Tensor,
    row_adapters: list[str | None],
    layers: Mapping[str, Mapping[int, LoraLayer]],
    tables: LoraTables | None = None,
    *,
    slot_start: int = 0,
    mode: Mode = "auto",
) -> torch.Tensor:
    """Prefill ``tokens`` [B, T] as one batch with per-row adapters; fp32 logits [B, T, vocab]."""
    b, t = tokens.shape
    tables = tables or LoraTables(model.cfg, device="cpu", dtype=model.dtype, native=model.lora_native)
    batch = AdapterBatch.build(row_adapters, lookup_for(layers), tables, slot_start=slot_start, mode=mode)
    assert batch is None or batch.shared == (mode == "shared") or mode == "auto"
    cache = KVCache(model.cfg, slot_start + b, t, dtype=model.dtype, device=model.device)
    positions = torch.arange(t)[None, :].expand(b, t)
    return model.logits(model(tokens, positions, cache, slot_start, adapters=batch))


Step = Callable[..., int]


def table_walker(setup: dict[str, Any], rows: int, seed: int, counter: str, mode: Mode) -> tuple[LoraTables, Step]:
    """``(tables, step)``: ``step(row_adapters, adapters=layers)`` runs a prefill of ``rows`` seeded 4-token prompts
    with one LoraTables kept across steps, checks it against fresh per-slot tables (exactly in ``slots`` mode, to
    float tolerance otherwise) and returns how much ``tables.stats.<counter>`` grew."""
    model, layers = setup["model"], setup["layers"]
    tables = LoraTables(model.cfg, device="cpu", dtype=torch.float32, native=model.lora_native)
    tokens = torch.randint(3, model.cfg.vocab_size, (rows, 4), generator=torch.Generator().manual_seed(seed))
    tol = {"rtol": 0.0, "atol": 0.0} if mode == "slots" else {"rtol": 1e-5, "atol": 1e-4}

    def step(row_adapters: list[str | None], adapters: Mapping[str, Mapping[int, LoraLayer]] = layers) -> int:
        before = getattr(tables.stats, counter)
        got = run_ours(model, tokens, row_adapters, adapters, tables, mode=mode)
        torch.testing.assert_close(got, run_ours(model, tokens, row_adapters, adapters, mode="slots"), **tol)
        return int(getattr(tables.stats, counter) - before)

    return tables, step


ROWS: list[str | None] = ["qv", None, "all_rs", "mlp_l1", "regex", "qv", None]


@pytest.mark.parametrize("mode", ["slots", "shared"])
def test_mixed_batch_logits_match_peft_row_by_row(setup: dict[str, Any], mode: Mode) -> None:
    model, peft_model, layers = setup["model"], setup["peft"], setup["layers"]
    tokens = torch.randint(3, model.cfg.vocab_size, (len(ROWS), 9), generator=torch.Generator().manual_seed(0))
    ours = run_ours(model, tokens, ROWS, layers, mode=mode)  # [B, T, vocab]
    cache = KVCache(model.cfg, len(ROWS), 9, dtype=torch.float32, device=CPU)
    base = model.logits(model(tokens, torch.arange(9)[None].expand(len(ROWS), 9), cache, 0))  # no adapters
    for row, adapter in enumerate(ROWS):
        ref = peft_logits(peft_model, adapter, tokens[row])
        torch.testing.assert_close(ours[row], ref, rtol=0, atol=1e-4, msg=f"row {row} ({adapter})")
        if adapter is None:
            assert torch.equal(ours[row], base[row]), "a base-only row must be unchanged bit for bit"
        else:  # the adapter really changes the output, so the comparison above can fail
            assert (ours[row] - base[row]).abs().max() > 1e-2


@pytest.mark.parametrize("mode", ["slots", "shared"])
def test_row_result_independent_of_order_slot_and_mode(setup: dict[str, Any], mode: Mode) -> None:
    model, layers = setup["model"], setup["layers"]
    tokens = torch.randint(3, model.cfg.vocab_size, (len(ROWS), 6), generator=torch.Generator().manual_seed(1))
    ours = run_ours(model, tokens, ROWS, layers, mode="slots")
    order = [4, 2, 0, 6, 3, 1, 5]
    shuffled = run_ours(model, tokens[order], [ROWS[i] for i in order], layers, slot_start=3, mode=mode)
    torch.testing.assert_close(shuffled, ours[order], rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("mode", ["slots", "shared"])
def test_greedy_decode_matches_peft(setup: dict[str, Any], mode: Mode) -> None:
    """Prefill, then decode step by step through the KV cache and one LoraTables; tokens identical to peft's."""
    model, peft_model, layers = setup["model"], setup["peft"], setup["layers"]
    rows: list[str | None] = ["regex", "qv", None, "all_rs", "mlp_l1"]
    prompt_len, new = 5, 8
    prompts = torch.randint(
        3, model.cfg.vocab_size, (len(rows), prompt_len), generator=torch.Generator().manual_seed(2)
    )
    slots = LoraTables(model.cfg, device="cpu", dtype=torch.float32, native=model.lora_native)
    lookup = lookup_for(layers)
    cache = KVCache(model.cfg, len(rows), prompt_len + new, dtype=torch.float32, device=CPU)
    positions = torch.arange(prompt_len)[None].expand(len(rows), prompt_len)
    hidden = model(prompts, positions, cache, 0, adapters=AdapterBatch.build(rows, lookup, slots, mode=mode))[:, -1]
    ours = []
    for step in range(new):
        token = model.logits(hidden).argmax(-1)  # [B]
        ours.append(token)
        copies = (slots.stats.slot_writes, slots.stats.shared_builds)
        batch = AdapterBatch.build(rows, lookup, slots, mode=mode)
        pos = torch.full((len(rows), 1), prompt_len + step)
        hidden = model(token[:, None], pos, cache, 0, adapters=batch)[:, -1]
        assert (slots.stats.slot_writes, slots.stats.shared_builds) == copies, "a steady step must copy nothing"
    got = torch.stack(ours, 1)  # [B, new]
    for row, adapter in enumerate(rows):
        ids = prompts[row]
        for _ in range(new):
            ids = torch.cat((ids, peft_logits(peft_model, adapter, ids)[-1].argmax()[None]))
        assert got[row].tolist() == ids[prompt_len:].tolist(), f"row {row} ({adapter})"


def test_slots_rewrite_only_what_changed(setup: dict[str, Any]) -> None:
    """Walk one LoraTables through row changes; after each step it must equal a fresh table and count its copies."""
    layers, n_layers = setup["layers"], setup["model"].cfg.num_layers
    slots, step = table_walker(setup, rows=4, seed=3, counter="slot_writes", mode="slots")
    assert step(["qv", "qv", None, "all_rs"]) == 3 * n_layers  # the base-only row's slot stays zeros
    assert slots.layouts()[(0, "wqkv")] == {"q_proj": 8, "k_proj": 8, "v_proj": 8}
    assert step(["qv", "qv", None, "all_rs"]) == 0
    assert step(["all_rs", "qv", None, "qv"]) == 2 * n_layers  # swap: r=4 over r=8 must clear the padding
    assert step(["qv", "qv", None, "all_rs"]) == 2 * n_layers
    assert step(["qv", None, None, "all_rs"]) == n_layers  # a retired row's slot is zeroed
    assert step(["qv", "mlp_l1", None, "all_rs"]) == 1  # mlp_l1 leaves layer 0 alone: that slot stays zeros
    reloaded = {**layers, "qv": peft_lora_layers(setup["folders"]["qv"])}  # new objects: the store reloaded it
    assert step(["qv", "mlp_l1", None, "all_rs"], reloaded) == n_layers
    relayouts = slots.stats.relayouts
    assert step(["qv", "regex", "qv", "qv"]) > 0  # regex has r=16 on up_proj: the w13 tables grow
    assert slots.stats.relayouts > relayouts
    assert slots.layouts()[(0, "w13")] == {"up_proj": 16}  # grown; gate_proj (only all_rs had it) dropped
    assert slots.layouts()[(0, "wqkv")] == {"q_proj": 4, "k_proj": 3, "v_proj": 4}  # 24 > 2 * 11: shrunk
    assert (0, "wo") not in slots.layouts()
    assert slots.nbytes > 0
    slots.clear()
    assert slots.nbytes == 0 and slots.layouts() == {}


@pytest.mark.parametrize("mode", ["slots", "shared"])
def test_delta_columns_and_none(setup: dict[str, Any], mode: Mode) -> None:
    """``delta`` returns zeros in the columns of untargeted modules, None for sites no row's adapter touches."""
    model, layers = setup["model"], setup["layers"]
    cfg = model.cfg
    slots = LoraTables(cfg, device="cpu", dtype=torch.float32, native=model.lora_native)
    batch = AdapterBatch.build([None, "qv"], lookup_for(layers), slots, mode=mode)
    assert batch is not None
    x = torch.randn(2, 3, cfg.hidden_size, generator=torch.Generator().manual_seed(7))
    d = batch.delta(0, "wqkv", x)
    assert d is not None and d.shape == (2, 3, (cfg.num_heads + 2 * cfg.num_kv_heads) * cfg.head_dim)
    parts = {p.hf_name: (p.start, p.stop) for p in cfg.fused_rows()["wqkv"]}
    qv = layers["qv"][0].modules
    for name, (c0, c1) in parts.items():
        want = x[1] @ qv[name].a.T @ qv[name].b.T if name in qv else torch.zeros(3, c1 - c0)
        torch.testing.assert_close(d[1, :, c0:c1], want, rtol=1e-5, atol=1e-6)
    assert torch.equal(d[0], torch.zeros_like(d[0]))
    for site in ("wo", "w13", "w2"):
        assert batch.delta(0, site, x) is None  # type: ignore[arg-type]
    assert set(SITES) == {"wqkv", "wo", "w13", "w2"}


@pytest.mark.parametrize("mode", ["slots", "shared"])
def test_trained_biases_ride_with_their_rows_only(setup: dict[str, Any], mode: Mode) -> None:
    """A module's trained bias is added to its own rows' delta, in both layouts, beside rows of the same adapter
    without one and base rows (whose delta stays exactly zero)."""
    model, layers = setup["model"], setup["layers"]
    cfg = model.cfg
    gen = torch.Generator().manual_seed(5)

    def biased(layer: LoraLayer) -> LoraLayer:
        mods = {
            n: LoraModule(a=m.a, b=m.b, bias=torch.randn(m.b.shape[0], generator=gen)) for n, m in layer.modules.items()
        }
        return LoraLayer(modules=mods, nbytes=layer.nbytes)

    with_bias = {**layers, "qv_b": {i: biased(layer) for i, layer in layers["qv"].items()}}
    tables = LoraTables(cfg, device="cpu", dtype=torch.float32, native=model.lora_native)
    batch = AdapterBatch.build([None, "qv_b", "qv", "qv_b"], lookup_for(with_bias), tables, mode=mode)
    assert batch is not None and batch.shared == (mode == "shared")
    x = torch.randn(4, 3, cfg.hidden_size, generator=gen)
    d = batch.delta(0, "wqkv", x)
    assert d is not None
    parts = {p.hf_name: (p.start, p.stop) for p in cfg.fused_rows()["wqkv"]}
    for row, name in ((1, "qv_b"), (2, "qv"), (3, "qv_b")):
        mods = with_bias[name][0].modules
        for module, (c0, c1) in parts.items():
            if module not in mods:
                assert torch.equal(d[row, :, c0:c1], torch.zeros(3, c1 - c0))
                continue
            m = mods[module]
            want = x[row] @ m.a.T @ m.b.T + (0 if m.bias is None else m.bias)
            torch.testing.assert_close(d[row, :, c0:c1], want, rtol=1e-5, atol=1e-5)
    assert torch.equal(d[0], torch.zeros_like(d[0]))


def test_shared_tables_rebuild_only_when_no_kept_set_holds_the_adapters(setup: dict[str, Any]) -> None:
    """Walk the shared layout through steps; each result must equal the per-slot one, and count its rebuilds."""
    layers, n_layers = setup["layers"], setup["model"].cfg.num_layers
    tables, step = table_walker(setup, rows=8, seed=6, counter="shared_builds", mode="auto")
    assert step(["qv"] * 8) == n_layers  # one adapter: shared
    assert tables.layouts() == {} and tables.nbytes > 0  # no per-slot table was needed
    assert step(["qv"] * 8) == 0
    assert step(["qv", None, "qv", "qv", None, "qv", "qv", None]) == 0  # same adapters, other rows: only the row moves
    assert step(["all_rs", "qv"] * 4) == n_layers  # 4 rows per adapter: still shared, new set
    assert step(["qv"] * 8) == 0  # a kept set holds it: its rows map into that set's groups
    assert step(["all_rs", "qv"] * 4) == 0
    assert step(["regex"] * 8) == n_layers  # taking in the last set's two would triple it: a set of its own
    assert step(["mlp_l1"] * 8) == n_layers  # with the kernel, the last batch's one too: {mlp_l1, regex}
    # the eager math would compute a rowless group, so without the kernel each set is its own
    subset = 0 if tables.native is not None else n_layers
    assert step(["regex"] * 4 + ["mlp_l1"] * 4) == subset
    assert step(["qv"] * 8) == n_layers  # {all_rs, qv} was three sets ago: dropped
    reloaded = {**layers, "qv": peft_lora_layers(setup["folders"]["qv"])}
    assert step(["all_rs", "qv"] * 4, reloaded) == n_layers
    assert step(["all_rs", "qv", "regex", "mlp_l1"] * 2) == n_layers  # 2 rows per adapter: still shared
    assert step(["all_rs", "qv", "regex", None] * 2) == subset  # rows retiring: the set they leave serves
    assert step(["mlp_l1", None, None, None] * 2) == subset
    assert tables.layouts() == {}
    assert step(["all_rs", "qv", "regex", "mlp_l1", None, None, None, None]) == 0  # 1 row per adapter
    assert (tables.layouts() == {}) == (tables.native is not None)  # per-slot, unless a kept set holds them
    renamed = {**layers, "qv2": layers["qv"]}
    assert step(["all_rs", "qv2", "regex", "mlp_l1", None, None, None, None], renamed) == 0  # held by none: per-slot
    assert tables.layouts() != {}


def test_shared_row_moves(setup: dict[str, Any]) -> None:
    """Rows already grouped move nowhere; others are gathered into equal groups padded with the group's own rows."""
    lookup = lookup_for(setup["layers"])

    def moves(rows: list[str | None]) -> dict[str, list[int] | None]:
        tables = LoraTables(setup["model"].cfg, device="cpu", dtype=torch.float32, native=setup["model"].lora_native)
        batch = AdapterBatch.build(rows, lookup, tables, mode="shared")
        assert batch is not None
        return batch.row_moves

    assert moves(["qv", "qv", "regex", "regex"]) == {"gather": None, "back": None, "rows": None}
    # groups qv: rows 0, 2; regex: row 1 (padded with itself) -> padded positions 0, 1 | 2, 3
    assert moves(["qv", "regex", "qv"]) == {"gather": [0, 2, 1, 1], "back": [0, 2, 1], "rows": None}
    # a base-only row inside the span is in no group and gets nothing added
    assert moves([None, "qv", None, "qv"]) == {"gather": [0, 2], "back": None, "rows": [0, 2]}
    # rows of a kept set's adapters map into its groups (with the compiled kernel): a rowless group is padding
    tables = LoraTables(setup["model"].cfg, device="cpu", dtype=torch.float32, native=setup["model"].lora_native)
    AdapterBatch.build(["qv", "regex"], lookup, tables, mode="shared")
    batch = AdapterBatch.build(["regex", None, "regex"], lookup, tables, mode="shared")
    assert batch is not None
    kept = {"gather": [0, 0, 0, 2], "back": [2, 3], "rows": [0, 2]}
    want = kept if tables.native else {"gather": [0, 2], "back": None, "rows": [0, 2]}
    assert batch.row_moves == want


def test_no_adapter_rows_build_nothing(setup: dict[str, Any]) -> None:
    slots = LoraTables(setup["model"].cfg, device="cpu", dtype=torch.float32, native=setup["model"].lora_native)
    assert AdapterBatch.build([None, None, None], lookup_for(setup["layers"]), slots) is None
    assert slots.nbytes == 0


def test_rows_per_item(setup: dict[str, Any]) -> None:
    """Item i spans rows_per_item[i] batch rows, all with the item's adapter (e.g. speculative verification)."""
    model, layers = setup["model"], setup["layers"]
    tokens = torch.randint(3, model.cfg.vocab_size, (5, 4), generator=torch.Generator().manual_seed(4))
    slots = LoraTables(model.cfg, device="cpu", dtype=torch.float32, native=model.lora_native)
    items: list[str | None] = ["all_rs", None, "regex"]
    batch = AdapterBatch.build(items, lookup_for(layers), slots, rows_per_item=[2, 1, 2])
    cache = KVCache(model.cfg, 5, 4, dtype=torch.float32, device=CPU)
    got = model.logits(model(tokens, torch.arange(4)[None].expand(5, 4), cache, 0, adapters=batch))
    want = run_ours(model, tokens, ["all_rs", "all_rs", None, "regex", "regex"], layers)
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    with pytest.raises(ValueError, match="rows_per_item"):
        AdapterBatch.build(items, lookup_for(layers), slots, rows_per_item=[1, 1])


def test_bf16_model_close_to_fp32(setup: dict[str, Any], tiny_llama_dir: Path) -> None:
    """A bf16 model (tables in fp32 on the eager CPU path, bf16 on the kernel's) stays near the fp32 result; the
    adapter's effect survives."""
    model, layers = setup["model"], setup["layers"]
    model16 = load_ours(tiny_llama_dir, dtype=torch.bfloat16, quantize=setup["quantize"])
    layers16 = {name: peft_lora_layers(folder, dtype=torch.bfloat16) for name, folder in setup["folders"].items()}
    tokens = torch.randint(3, model.cfg.vocab_size, (len(ROWS), 6), generator=torch.Generator().manual_seed(5))
    slots = LoraTables(model16.cfg, device="cpu", dtype=torch.bfloat16, native=model.lora_native)
    assert slots.compute_dtype == (torch.float32 if model.lora_native is None else torch.bfloat16)
    got = run_ours(model16, tokens, ROWS, layers16, slots)
    want = run_ours(model, tokens, ROWS, layers)
    scale = want.abs().max()
    assert (got - want).abs().max() < 0.05 * scale


def test_misshaped_module_is_refused_by_name(setup: dict[str, Any]) -> None:
    model = setup["model"]
    bad = LoraLayer({"v_proj": LoraModule(a=torch.zeros(4, model.cfg.hidden_size), b=torch.zeros(7, 4))}, 0)
    slots = LoraTables(model.cfg, device="cpu", dtype=torch.float32, native=model.lora_native)
    batch = AdapterBatch.build(["bad"], lambda _a, _l: bad, slots)
    assert batch is not None
    with pytest.raises(InvalidAdapter, match="v_proj"):
        batch.delta(0, "wqkv", torch.zeros(1, 1, model.cfg.hidden_size))


DEMO_DIR = ROOT / "adapters" / "demo"


@pytest.mark.slow
def test_demo_adapters_on_smollm2_match_peft(smollm2_dir: Path) -> None:
    """The committed demo adapters on the real SmolLM2: a mixed batch (caps, terse, base) against peft, fp32."""
    from service.model.load_folder import load_model
    from service.tokenizer import Tokenizer

    folders = {name: DEMO_DIR / name for name in ("caps", "terse")}
    for folder in folders.values():
        if not (folder / "adapter_model.safetensors").is_file():
            pytest.fail(f"{folder} is missing: run scripts/train_demo_adapters.py")
    model, cfg, _ = load_model(smollm2_dir, dtype=torch.float32, device="cpu")
    peft_model = load_peft_model(smollm2_dir, folders)
    layers = {name: peft_lora_layers(folder) for name, folder in folders.items()}
    tokenizer = Tokenizer.from_folder(smollm2_dir)
    prompt = tokenizer.encode_chat([{"role": "user", "content": "What is a forest?"}])
    rows: list[str | None] = ["caps", "terse", None]
    n, new = len(prompt), 16
    tables = LoraTables(cfg, device="cpu", dtype=torch.float32, native=model.lora_native)
    batch = AdapterBatch.build(rows, lookup_for(layers), tables)
    cache = KVCache(cfg, len(rows), n + new, dtype=torch.float32, device=CPU)
    tokens = torch.tensor([prompt] * len(rows))
    logits = model.logits(model(tokens, torch.arange(n).expand(len(rows), n), cache, 0, adapters=batch))
    for row, adapter in enumerate(rows):
        ref = peft_logits(peft_model, adapter, tokens[row])
        # fp32 over 30 layers: 1e-4 absolute plus 1e-5 of each logit (logits reach ~30; the CPU's kernel choice,
        # AMX or AVX-512, moves the last digits).
        torch.testing.assert_close(logits[row], ref, atol=1e-4, rtol=1e-5, msg=f"row {row} ({adapter})")
    got = [logits[:, -1].argmax(-1)]
    for step in range(new - 1):
        batch = AdapterBatch.build(rows, lookup_for(layers), tables)
        hidden = model(got[-1][:, None], torch.full((len(rows), 1), n + step), cache, 0, adapters=batch)
        got.append(model.logits(hidden[:, -1]).argmax(-1))
    ours = torch.stack(got, 1)  # [rows, new]
    for row, adapter in enumerate(rows):
        ids = torch.tensor([prompt])
        with torch.no_grad():
            if adapter is None:
                with peft_model.disable_adapter():
                    ref_ids = peft_model.generate(input_ids=ids, max_new_tokens=new, do_sample=False, pad_token_id=2)
            else:
                peft_model.set_adapter(adapter)
                ref_ids = peft_model.generate(input_ids=ids, max_new_tokens=new, do_sample=False, pad_token_id=2)
        expected = ref_ids[0, n:].tolist()
        assert ours[row, : len(expected)].tolist() == expected, f"row {row} ({adapter})"
    caps_text = tokenizer.decode(ours[0].tolist())
    letters = [c for c in caps_text if c.isalpha()]
    assert sum(c.isupper() for c in letters) > 0.8 * len(letters), caps_text
