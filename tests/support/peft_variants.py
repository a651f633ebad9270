"""PEFT adapter variants (DoRA, trained biases, embedding/head LoRA, modules_to_save), per-request strength and
weighted mixtures: the adapters written by peft itself, and what peft computes for them (the reference).

    write_variant(folder, base_model, seed=0, scale=0.5, **lora_config) -> Path
    Served(folder, reference_folder, engine, adapters)        one base served by an engine built like the server's
    serve(folder, root, reference_folder=None, **settings) -> Served
    reference_model(base, adapters, mix) -> transformers / peft model (eval, fp32)
    reference_outputs(model, prompt, new_tokens) -> Outputs    greedy tokens, first-step logits, per-step logprobs
    engine_outputs(served, rows, new_tokens) -> {rid: Outputs} rows submitted together (they share forward passes)

Every trainable tensor of a written adapter is drawn from a seeded generator (peft starts ``lora_B`` and
``lora_embedding_B`` at zero, which would make every adapter a no-op): LoRA A/B, trained LoRA biases, DoRA's
magnitude (perturbed around peft's initial ``||W||``) and the ``modules_to_save`` copies (norms scaled around their
weights, embedding and head shifted). A case's ``mix`` is ``((adapter, weight), ...)``; the reference of one
adapter at a weight multiplies every LoRA layer's ``scaling`` by it (DoRA's norm is recomputed from it in peft's
forward), and of several adapters is ``add_weighted_adapter(..., combination_type="cat")``: the exact weighted sum.
"""

from __future__ import annotations

import shutil
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from service.engine.engine import Engine
from service.engine.request import GenerationRequest
from service.engine.sampling import Sampler, SampleResult, SamplingParams

Mix = tuple[tuple[str, float], ...]
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json")


def write_served_llama(folder: Path, tokenizer_from: Path, **config: Any) -> Path:
    """A tiny random Llama (``tiny_models.write_tiny_llama``, SmolLM2's vocabulary) with SmolLM2's tokenizer files,
    so an engine can serve it; ``config`` overrides the tiny defaults (``tie_word_embeddings=True``, ...)."""
    from support.tiny_models import write_tiny_llama

    write_tiny_llama(folder, vocab_size=49152, **config)
    for name in TOKENIZER_FILES:
        if (tokenizer_from / name).exists():
            shutil.copy(tokenizer_from / name, folder / name)
    return folder


def _randomise(peft_model: Any, generator: torch.Generator, scale: float) -> None:
    def noise(shape: torch.Size) -> torch.Tensor:
        return torch.randn(shape, generator=generator)

    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if not param.requires_grad:
                continue
            if "lora_magnitude_vector" in name:  # [out], peft's ||W|| per output channel
                param.mul_(1.0 + 0.2 * noise(param.shape))
            elif ".lora_A." in name:  # [r, in]: unit-variance x @ A.T
                param.copy_(noise(param.shape) / param.shape[1] ** 0.5)
            elif ".lora_B." in name and param.ndim == 2:  # [out, r]
                param.copy_(scale * noise(param.shape) / param.shape[1] ** 0.5)
            elif ".lora_B." in name:  # [out] lora_bias
                param.copy_(scale * noise(param.shape))
            elif "lora_embedding_A" in name:  # [r, vocab]: a unit-variance code per token
                param.copy_(noise(param.shape))
            elif "lora_embedding_B" in name:  # [hidden, r]
                param.copy_(scale * noise(param.shape) / param.shape[1] ** 0.5)
            elif ".modules_to_save." in name and param.ndim == 1:  # a norm's weight
                param.mul_(1.0 + 0.3 * noise(param.shape))
            elif ".modules_to_save." in name:  # embedding / head [vocab, hidden]
                param.add_(scale * param.std() * noise(param.shape))
            else:
                raise AssertionError(f"an adapter parameter this helper does not fill: {name}")


def write_variant(
    folder: Path,
    base_model: Any,
    *,
    seed: int = 0,
    scale: float = 0.5,
    save_embedding_layers: bool | str = False,
    **lora_config: Any,
) -> Path:
    """``get_peft_model(base_model, LoraConfig(**lora_config))``, every adapter tensor randomised (see the module
    docstring), ``save_pretrained`` (by default the delta only: no copy of the base embedding; peft's own default
    ``"auto"`` adds the targeted embedding and head layers), then ``unload()``."""
    from peft import LoraConfig, get_peft_model

    config = LoraConfig(lora_dropout=0.0, task_type="CAUSAL_LM", **lora_config)
    peft_model = get_peft_model(base_model, config)
    try:
        _randomise(peft_model, torch.Generator().manual_seed(seed), scale)
        peft_model.save_pretrained(folder, safe_serialization=True, save_embedding_layers=save_embedding_layers)
    finally:
        peft_model.unload()
    return Path(folder)


def write_variants(root: Path, base: Path, specs: Mapping[str, Mapping[str, Any]]) -> dict[str, Path]:
    """One `write_variant` folder per ``name: keywords`` under ``root``, over the transformers model in ``base``."""
    from support.tiny_models import load_hf_llama

    return {name: write_variant(root / name, load_hf_llama(base), **kw) for name, kw in specs.items()}


# --- the reference ---------------------------------------------------------------------------------------------


def _scale_adapter(peft_model: Any, adapter: str, weight: float) -> int:
    """Multiply ``scaling[adapter]`` of every LoRA layer by ``weight``; how many layers it changed."""
    from peft.tuners.lora import LoraLayer

    changed = 0
    for module in peft_model.modules():
        if isinstance(module, LoraLayer) and adapter in module.scaling:
            module.scaling[adapter] *= weight
            changed += 1
    return changed


def reference_model(base: Path, adapters: Mapping[str, Path], mix: Mix) -> Any:
    """What peft computes for a row with ``mix`` over the transformers model in ``base`` (``()``: the base)."""
    from support.adapter_files import load_peft_model
    from support.tiny_models import load_hf_llama

    if not mix:
        return load_hf_llama(base)
    names = [name for name, _ in mix]
    model = load_peft_model(base, {name: adapters[name] for name in names})
    if len(mix) == 1:
        model.set_adapter(names[0])
        if mix[0][1] != 1.0:
            assert _scale_adapter(model, names[0], mix[0][1]) > 0
        return model
    model.add_weighted_adapter(names, [w for _, w in mix], "mix", combination_type="cat")
    model.set_adapter("mix")
    return model


def summed_reference_model(base: Path, adapters: Mapping[str, Path], mix: Mix) -> Any:
    """A second route to a mixture: every adapter active at once (peft sums their outputs), each scaled by its
    weight. Must agree with ``reference_model``'s ``add_weighted_adapter`` (a check of the reference itself)."""
    from support.adapter_files import load_peft_model

    names = [name for name, _ in mix]
    model = load_peft_model(base, {name: adapters[name] for name in names})
    model.base_model.set_adapter(names)
    for name, weight in mix:
        _scale_adapter(model, name, weight)
    return model


@dataclass(frozen=True)
class Outputs:
    """One row: its greedy tokens, the logits [vocab] it chose the first from, the log-probability of each token."""

    tokens: list[int]
    first_logits: torch.Tensor | None
    logprobs: list[float]


def reference_outputs(model: Any, prompt: Sequence[int], new_tokens: int) -> Outputs:
    """``new_tokens`` greedy tokens from ``generate``; then one teacher-forced forward over prompt + tokens for the
    first-step logits and each chosen token's log-probability."""
    from support.adapter_files import reference_greedy

    tokens = reference_greedy(model, list(prompt), new_tokens)
    with torch.no_grad():
        logits = model(torch.tensor([[*prompt, *tokens]])).logits[0].float()  # [P + N, vocab]
    steps = logits[len(prompt) - 1 : len(prompt) - 1 + new_tokens]  # [N, vocab]: the logits each token came from
    logprobs = torch.log_softmax(steps, dim=-1).gather(-1, torch.tensor(tokens)[:, None]).squeeze(-1)
    return Outputs(tokens, steps[0], logprobs.tolist())


# --- the engine ------------------------------------------------------------------------------------------------


class _FirstLogits(Sampler):
    """The engine's sampler, keeping the logits row i was first sampled from, by ``params[i]``'s identity (each
    request gets its own ``SamplingParams`` object, so the identity names the request)."""

    def __init__(self, inner: Sampler) -> None:
        super().__init__(inner.device)
        self.inner = inner
        self.first: dict[int, torch.Tensor] = {}

    def sample(self, logits: torch.Tensor, params: Sequence[SamplingParams], *args: Any, **kw: Any) -> SampleResult:
        for i, p in enumerate(params):
            self.first.setdefault(id(p), logits[i].detach().float().clone())
        return self.inner.sample(logits, params, *args, **kw)


@dataclass
class Served:
    """One base model served by an engine built the way the server builds it (``service.bootstrap.build``: its
    adapter catalog registers every folder under ``root``), started; and the float32 HF folder peft runs on."""

    folder: Path
    reference_folder: Path
    engine: Engine
    adapters: dict[str, Path]
    refused: dict[str, Exception]  # adapters the catalog would not register, and why
    parts: Any = field(repr=False, default=None)

    def close(self) -> None:
        self.engine.stop()
        self.parts.adapters.close()


def serve(folder: Path, root: Path, reference_folder: Path | None = None, **settings: Any) -> Served:
    """A started engine over ``folder`` (``settings``: ``quantize``, ``gguf``, ...) with every adapter under
    ``root`` registered by folder name (one by one, so that a refused one is kept with its error)."""
    from service.bootstrap import build
    from service.config import Settings

    s = Settings(
        model=folder, dtype="float32", adapter_roots=(root,), max_batch_size=64,
        max_total_tokens=128, max_new_tokens=32, prefix_cache_bytes=0, **settings,
    )  # fmt: skip
    parts = build(s)
    parts.engine.runner.sampler = _FirstLogits(parts.engine.runner.sampler)
    parts.engine.start()
    adapters = {p.name: p for p in sorted(root.iterdir()) if (p / "adapter_config.json").is_file()}
    refused: dict[str, Exception] = {}
    for name, path in adapters.items():
        try:
            parts.adapters.register(name, path)
        except Exception as exc:  # kept: the rows of this adapter report it
            refused[name] = exc
    return Served(folder, reference_folder or folder, parts.engine, adapters, refused, parts)


def row_request(rid: str, prompt: Sequence[int], mix: Mix, new_tokens: int) -> GenerationRequest:
    """The engine request of a row with ``mix``: one adapter at weight 1 by ``adapter_id`` alone (the plain path),
    anything else as ``mix`` with ``adapter_id`` its first adapter; ``()`` is the base model."""
    adapter = mix[0][0] if mix else None
    weighted = mix if len(mix) > 1 or (mix and mix[0][1] != 1.0) else ()
    return GenerationRequest(
        request_id=rid, prompt_ids=tuple(prompt), max_new_tokens=new_tokens, ignore_eos=True, adapter_id=adapter,
        mix=weighted, sampling=SamplingParams(logprobs=True),
    )  # fmt: skip


def engine_outputs(served: Served, rows: Mapping[str, GenerationRequest], timeout: float = 60.0) -> dict[str, Any]:
    """Submit ``rows`` (rid -> request) so that they are admitted in one step and share every forward pass;
    each row's `Outputs`, or the exception its request failed with (a refusal at submit or an error event)."""
    from support.engines import run_together

    sampler = served.engine.runner.sampler
    assert isinstance(sampler, _FirstLogits)
    sampler.first.clear()  # ids of freed requests' params may be reused by this batch's
    out: dict[str, Any] = {}
    accepted = {}
    for rid, request in rows.items():
        refusal = next((served.refused[a] for a, _ in request.deltas_key or () if a in served.refused), None)
        if refusal is not None:
            out[rid] = refusal
            continue
        try:
            served.engine.validate(request)
        except Exception as exc:  # the refusal is the row's result
            out[rid] = exc
        else:
            accepted[rid] = request
    events = run_together(served.engine, list(accepted.values()), timeout=timeout) if accepted else {}
    for rid, evs in events.items():
        errors = [e.error for e in evs if e.error is not None]
        if errors:
            out[rid] = errors[0]
            continue
        tokens = [t for e in evs for t in e.token_ids]
        logprobs = [lp for e in evs for lp in (e.logprobs or ())]
        out[rid] = Outputs(tokens, sampler.first.get(id(accepted[rid].sampling)), logprobs)
    return out


__all__ = [
    "Mix",
    "Outputs",
    "Served",
    "engine_outputs",
    "reference_model",
    "reference_outputs",
    "row_request",
    "serve",
    "summed_reference_model",
    "write_served_llama",
    "write_variant",
    "write_variants",
]
