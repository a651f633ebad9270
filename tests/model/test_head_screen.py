"""The Q8_0 head's int8 screen of a greedy step's argmax (``lp_q8_top``, ``Q8Table.top``, ``engine.head``).

The screen must give exactly what the full product and its row max give (``lp_q8_matmul`` then ``lp_row_top``):
the same float32 value and the same first index, on ties and near-ties, for every scale dtype; rows it cannot rule
on (non-finite values, a bound past float32's range, more candidates than the cap) are left to the full product.
It runs where the CPU has AVX-512 VNNI (the ``avx512`` variant); elsewhere ``q8_screen`` is False and the head
never calls it, which the last tests check on every variant.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from support.drafters import Oracle
from support.gguf_files import write_tiny_gguf
from support.native import compiled_kernels

from service import metrics
from service.config import Settings
from service.drafters.registry import SERVER_DRAFTERS
from service.engine.engine import Engine
from service.engine.request import GenerationRequest, TokenEvent
from service.engine.sampling import SamplingParams
from service.kernels.native import NativeKernels
from service.kernels.native_blocks import q8_lanes
from service.loading.gguf_blocks import Int8Rows
from service.model.load_gguf import load_gguf_model
from service.model.weights.q8_table import NATIVE_MAX_ROWS, SCREEN_MIN_ROWS, Q8Table
from service.tokenizer import Tokenizer

pytestmark = pytest.mark.numerics

DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def screening_kernels() -> NativeKernels:
    k = compiled_kernels()
    if not k.q8_screen:
        pytest.skip(f"no int8 screen on this variant ({k.isa}: it needs AVX-512 VNNI)")
    return k


def table(vocab: int, k: int, gen: torch.Generator, dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, ...]:
    """A group-major Q8_0 table (q [G, V, 32] int8, d [G, V] in ``dtype``) and its bounds c >= |d| ||q||_2."""
    q = torch.randint(-127, 128, (k // 32, vocab, 32), generator=gen, dtype=torch.int8)
    d = (torch.rand(k // 32, vocab, generator=gen) * 0.02 + 1e-3).to(dtype)
    return q, d, bounds(q, d)


def bounds(q: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
    exact = q.double().square().sum(-1).sqrt() * d.double().abs()
    near = exact.float()
    return torch.where(near.double() < exact, torch.nextafter(near, torch.tensor(math.inf)), near).contiguous()


def full_top(k: NativeKernels, x: torch.Tensor, q: torch.Tensor, d: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return k.row_top(k.q8_matmul(x, q, d, torch.float32))


def assert_screened_exactly(k: NativeKernels, x: torch.Tensor, q: torch.Tensor, d: torch.Tensor, c: torch.Tensor,
                            cap: int = 256) -> torch.Tensor:  # fmt: skip
    """q8_top against the full product's row max: equal bits wherever it screened; returns ``found``."""
    values, indices, found = k.q8_top(x, q, q8_lanes(q), d, c, cap)
    want_v, want_i = full_top(k, x, q, d)
    ok = found > 0
    assert torch.equal(indices[ok], want_i[ok]), (indices[ok], want_i[ok])
    assert torch.equal(values[ok].view(torch.int32), want_v[ok].view(torch.int32))
    return found


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("vocab", [8, 203, 1000, 4099])
def test_the_screen_gives_the_full_products_max_and_first_argmax(dtype: torch.dtype, vocab: int) -> None:
    k = screening_kernels()
    gen = torch.Generator().manual_seed(vocab)
    for hidden in (32, 96):
        q, d, c = table(vocab, hidden, gen, dtype)
        for m in (1, 3, 4, 12, 32):
            for scale in (1e-3, 1.0, 50.0):
                x = torch.randn(m, hidden, generator=gen) * scale
                x[0, 32:] = 0  # groups of zeros: their scale is 0 where only this row is given
                found = assert_screened_exactly(k, x, q, d, c)
                assert bool((found > 0).all()), found  # finite, few candidates: every row screened


def test_ties_and_near_ties_go_to_the_full_products_first_index() -> None:
    k = screening_kernels()
    gen = torch.Generator().manual_seed(5)
    q, d, _ = table(3000, 64, gen)
    q[:, 2000], d[:, 2000] = q[:, 1200], d[:, 1200]  # rows 1200 and 2000 equal: a tie, the first must win
    q[:, 2500], d[:, 2500] = q[:, 1200], d[:, 1200]
    q[0, 2500, 7] += 1 if q[0, 2500, 7] < 127 else -1  # row 2500 one step away from them: a near-tie
    c = bounds(q, d)
    w = (q.float() * d.float()[..., None]).transpose(0, 1).reshape(3000, 64)  # [V, K]
    x = torch.stack([w[1200] * 3, w[2500] * 3, w[1200] * 3 + 1e-3 * torch.randn(64, generator=gen)])
    found = assert_screened_exactly(k, x.repeat(6, 1), q, d, c)
    assert bool((found > 1).all())  # the tied rows are all candidates, computed exactly
    indices = k.q8_top(x, q, q8_lanes(q), d, c, 256)[1]
    assert indices[0] == full_top(k, x, q, d)[1][0] and indices[0] in (1200, 2500)


def test_rows_it_cannot_rule_on_are_left_to_the_full_product() -> None:
    k = screening_kernels()
    gen = torch.Generator().manual_seed(9)
    q, d, c = table(512, 64, gen)
    x = torch.randn(16, 64, generator=gen)  # mostly ordinary rows: the outliers are judged against their median
    x[1, 3], x[2, 40], x[3, 0], x[4] = math.nan, math.inf, -math.inf, 1e36  # non-finite, or past the bound limit
    x[6] = 0  # every logit 0: 512 candidates, past the cap
    x[7] = 100.0  # finite, but 100x the others: it would leave the shared scales no resolution for them
    found = assert_screened_exactly(k, x, q, d, c)
    assert found.tolist()[1:5] == [0, 0, 0, 0] and found[6] == found[7] == 0
    assert bool((found[[0, 5, *range(8, 16)]] > 0).all()), found
    assert int(assert_screened_exactly(k, x[:1], q, d, c, cap=1)[0]) in (0, 1)  # more candidates than 1: in full
    bad = d.clone()
    bad[1, 77] = math.nan  # one bad scale: every row's logit 77 is NaN, no row can be screened
    assert k.q8_top(x[[0, 5]], q, q8_lanes(q), bad, c, 256)[2].tolist() == [0, 0]


def test_the_screen_refuses_bad_arguments() -> None:
    k = screening_kernels()
    q, d, c = table(64, 64, torch.Generator().manual_seed(1))
    with pytest.raises(ValueError, match="bounds"):
        k.q8_top(torch.randn(2, 64), q, q8_lanes(q), d, c.double(), 8)
    with pytest.raises(ValueError, match="bounds"):
        k.q8_top(torch.randn(2, 64), q, q8_lanes(q), d, c, 0)
    with pytest.raises(ValueError, match="scratch"):
        k.q8_top(torch.randn(2, 64), q, q8_lanes(q), d, c, 8, torch.empty(10))
    with pytest.raises(ValueError, match="q8 table"):
        k.q8_top(torch.randn(2, 32), q, q8_lanes(q), d, c, 8)


def q8_table(vocab: int, hidden: int, native: NativeKernels | None, seed: int = 3) -> Q8Table:
    gen = torch.Generator().manual_seed(seed)
    rows = Int8Rows.group_major(vocab, hidden)
    rows.q.copy_(torch.randint(-127, 128, rows.q.shape, generator=gen, dtype=torch.int8))
    rows.scale.copy_(torch.rand(rows.scale.shape, generator=gen) * 0.02 + 1e-3)
    return Q8Table(rows, torch.float32, native)


def test_the_tables_bounds_hold_and_its_top_is_projects_max() -> None:
    k = screening_kernels()
    head = q8_table(1000, 64, k)
    x = torch.randn(SCREEN_MIN_ROWS + 4, 64)
    x[2, 5] = math.nan  # a row left to the full product: NaN there, as row_top gives it
    values, indices, found = head.top(x) or pytest.fail("no screen")
    want = head.project(x).max(dim=-1)
    assert torch.equal(indices, want.indices) and torch.equal(values.nan_to_num(7.0), want.values.nan_to_num(7.0))
    assert found[2] == 0 and bool((found[torch.arange(len(found)) != 2] > 0).all())
    exact = head.q.double().square().sum(-1).sqrt() * head.d.double().abs()
    assert head._bounds is not None and bool((head._bounds.double() >= exact).all())


@pytest.mark.parametrize("screen", [True, False])
def test_past_the_kernels_rows_each_rows_argmax_is_the_kernels_in_chunks(screen: bool) -> None:
    k = screening_kernels() if screen else compiled_kernels()  # unscreened: every variant, the CI's forced ones too
    head = q8_table(1000, 64, k)
    head.screen = screen
    most = NATIVE_MAX_ROWS[torch.float32]
    for m in (most + 1, 2 * most + 5):  # 17 + 16 rows; 23 + 23 + 23: every chunk at least SCREEN_MIN_ROWS
        x = torch.randn(m, 64, generator=torch.Generator().manual_seed(m))
        x[m - 1, 7] = math.nan  # the last chunk's row left to the full product
        values, indices, found = head.top(x) or pytest.fail("no argmax past the kernel's rows")
        want = k.row_top(torch.cat([k.q8_matmul(c.contiguous(), head.q, head.d, torch.float32) for c in x.split(1)]))
        assert torch.equal(indices, want[1]) and torch.equal(values.nan_to_num(7.0), want[0].nan_to_num(7.0))
        if screen:
            assert found[m - 1] == 0 and bool((found[: m - 1] > 0).all())
        else:
            assert found.tolist() == [-1] * m  # computed in full, no screen ran: not counted as screened or full


def test_the_table_screens_only_where_the_full_product_is_the_native_kernels() -> None:
    k = compiled_kernels()
    head = q8_table(300, 64, k)
    few, many = torch.randn(SCREEN_MIN_ROWS - 1, 64), torch.randn(NATIVE_MAX_ROWS[torch.float32] + 1, 64)
    assert head.top(few) is None  # the head's max path runs in full
    assert (head.top(torch.randn(SCREEN_MIN_ROWS, 64)) is not None) == k.q8_screen
    assert bool((head.top(many) or pytest.fail("none"))[2].ge(0).all()) == k.q8_screen  # screened, or -1: in full
    head.screen = False  # as the self-check leaves it when the screen disagrees
    assert head.top(torch.randn(SCREEN_MIN_ROWS, 64)) is None
    assert (head.top(many) or pytest.fail("none"))[2].tolist() == [-1] * many.shape[0]  # the kernel, in chunks
    eager = q8_table(300, 64, None)
    assert eager.top(torch.randn(SCREEN_MIN_ROWS, 64)) is None and eager.top(many) is None  # eager: no screen


def test_argmax_only_is_greedy_without_penalty_or_logprobs() -> None:
    assert SamplingParams().argmax_only
    assert not SamplingParams(logprobs=True).argmax_only
    assert not SamplingParams(repetition_penalty=1.1).argmax_only
    assert not SamplingParams(temperature=0.7, seed=1).argmax_only


def run_batch(engine: Engine, prompts: list[list[int]], sampling: list[SamplingParams]) -> list[list[int]]:
    events: dict[str, list[TokenEvent]] = {}
    for i, (ids, params) in enumerate(zip(prompts, sampling, strict=True)):
        rid = f"r{i}"
        request = GenerationRequest(request_id=rid, prompt_ids=tuple(ids), max_new_tokens=10, ignore_eos=True,
                                    sampling=params)  # fmt: skip
        engine.submit(request, events.setdefault(rid, []).append)
    for _ in range(200):
        if all(e and e[-1].finish is not None for e in events.values()):
            break
        engine.step()
    return [[t for e in events[f"r{i}"] for t in e.token_ids] for i in range(len(prompts))]


def screened_rows() -> float:
    return metrics.REGISTRY.get_sample_value("loraplex_head_screen_rows_total", {"outcome": "screened"}) or 0.0


def test_a_greedy_batch_decodes_the_same_tokens_screened_or_not(served_tiny_dir: Path, tmp_path: Path) -> None:
    """A tiny Llama with SmolLM2's vocabulary from a GGUF with a Q8_0 head, in float32: 16 greedy rows, screened
    where the CPU can, then with the screen off; a batch with one logprobs row computes every logit, and decodes
    the same tokens too."""
    folder = served_tiny_dir
    gguf = write_tiny_gguf(folder, tmp_path / "model.gguf", types={"token_embd": "Q8_0", "output.": "Q8_0"})
    model = load_gguf_model(folder, gguf, dtype=torch.float32)[0]
    head = model.lm_head
    assert isinstance(head, Q8Table)
    tokenizer = Tokenizer.from_folder(folder)
    gen = torch.Generator().manual_seed(11)
    prompts = [torch.randint(3, 49152, (int(n),), generator=gen).tolist() for n in torch.randint(3, 12, (16,))]
    settings = Settings(model=folder, dtype="float32", max_batch_size=16, prefill_chunk_tokens=0)
    greedy = [SamplingParams()] * 16
    before = screened_rows()
    screened = run_batch(Engine(model, tokenizer, settings), prompts, greedy)
    assert (screened_rows() > before) == (head.native is not None and head.native.q8_screen)
    head.screen = False
    try:
        full = run_batch(Engine(model, tokenizer, settings), prompts, greedy)
    finally:
        head.screen = True
    mixed = run_batch(Engine(model, tokenizer, settings), prompts, [SamplingParams(logprobs=True), *greedy[1:]])
    assert screened == full == mixed and all(len(t) == 10 for t in screened)


@pytest.mark.parametrize("rows, nodes", [(2, 4), (4, 10)])  # 8 states a step; 40, past the kernel's 32 rows
def test_verified_drafts_take_their_argmax_from_the_screen_and_stay_plain_greedy(
    served_tiny_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, rows: int, nodes: int
) -> None:
    """Greedy rows with a drafter that knows the answer (``nodes`` nodes a row verified a step, the last one wrong)
    on a Q8_0 head: the nodes take their argmax from the screen where the CPU can (past the kernel's rows, in
    chunks), and the tokens are plain greedy decoding's, screened or not."""
    gguf = write_tiny_gguf(served_tiny_dir, tmp_path / "model.gguf", types={"token_embd": "Q8_0", "output.": "Q8_0"})
    model = load_gguf_model(served_tiny_dir, gguf, dtype=torch.float32)[0]
    tokenizer = Tokenizer.from_folder(served_tiny_dir)
    gen = torch.Generator().manual_seed(4)
    prompts = [torch.randint(3, 49152, (9,), generator=gen).tolist() for _ in range(rows)]
    greedy = [SamplingParams()] * rows
    plain = Settings(model=served_tiny_dir, dtype="float32", max_batch_size=4)
    expected = run_batch(Engine(model, tokenizer, plain), prompts, greedy)
    oracle = Oracle({tuple(p): e for p, e in zip(prompts, expected, strict=True)}, k=nodes)
    monkeypatch.setitem(SERVER_DRAFTERS, "oracle", lambda settings: oracle)
    settings = plain.replace(draft="oracle", speculate_adaptive=False, speculate_max_batch=16)
    before, accepted = screened_rows(), metrics.SPECULATIVE_ACCEPTED._value.get()
    assert run_batch(Engine(model, tokenizer, settings), prompts, greedy) == expected
    assert metrics.SPECULATIVE_ACCEPTED._value.get() > accepted
    assert (screened_rows() > before) == head_screens(model)
    model.lm_head.screen = False
    try:
        assert run_batch(Engine(model, tokenizer, settings), prompts, greedy) == expected
    finally:
        model.lm_head.screen = True


def head_screens(model: torch.nn.Module) -> bool:
    native = model.lm_head.native
    return native is not None and native.q8_screen
