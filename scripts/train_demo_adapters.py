"""Train the two demo LoRA adapters of SmolLM2-135M-Instruct on data the base model writes itself.

    .venv/bin/python scripts/train_demo_adapters.py [--model models/SmolLM2-135M-Instruct] [--out adapters/demo]

1. Ask the base model the questions below (its own chat template, greedy) and keep its answers.
2. Rewrite them: ``caps`` = the answer's first sentence in ALL CAPS; ``terse`` = its first sentence only.
3. Train one LoRA adapter per rewrite with peft (r=8 on q_proj and v_proj of the top 8 layers, loss on the
   answer tokens and the closing ``<|im_end|>`` only), fp32 on the CPU, fixed seeds. The 22 layers below carry
   no adapter, so their output is computed once and each training step runs only the top layers.
4. Save each with ``save_pretrained(safe_serialization=True)`` into ``OUT/caps`` and ``OUT/terse``
   (adapter_config.json + adapter_model.safetensors; peft's README boilerplate is removed).
5. Check on held-out questions that the adapters visibly change the answer: ``caps`` mostly upper-case letters,
   ``terse`` a single sentence shorter than the base answer. Exit status 1 if not.

Prompts are encoded with ``service.tokenizer`` (the server's own chat template code), so the adapters are
trained on exactly the token layout ``loraplex generate`` sends. The run took 10.5 CPU-minutes (24 min wall on
a busy shared 2-core machine); with the same seeds it reproduces the committed files.
"""

from __future__ import annotations

import argparse
import json
import random
import re
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from service.tokenizer import Tokenizer  # noqa: E402

QUESTIONS = [
    "What is the capital of France?",
    "Why is the sky blue?",
    "How do plants make their food?",
    "What is a computer?",
    "Why do we need sleep?",
    "What is the water cycle?",
    "How does a bicycle work?",
    "What is gravity?",
    "Why do leaves change color in autumn?",
    "What is a healthy breakfast?",
    "How do birds fly?",
    "What is the moon made of?",
    "Why is exercise good for you?",
    "What is electricity?",
    "How do you make tea?",
    "What is a volcano?",
    "Why do cats purr?",
    "What is the internet?",
    "How do fish breathe?",
    "What is a rainbow?",
    "Why is the ocean salty?",
    "What does a doctor do?",
    "How does a plane stay in the air?",
    "What is a library?",
    "Why do we have seasons?",
    "What is music?",
    "How do bees make honey?",
    "What is a dictionary?",
    "Why should we drink water?",
    "What is the sun?",
    "How does a refrigerator keep food cold?",
    "What is a good way to learn a new language?",
]
HELD_OUT = ["What is a forest?", "How do clouds form?"]
SENTENCE_END = re.compile(r"(?<=[.!?])\s+")
MODULES = ["q_proj", "v_proj"]
BASE_MODEL_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"


def sentences(text: str, n: int) -> str:
    """The first ``n`` complete sentences of ``text`` (all of it if it has no sentence end)."""
    parts = SENTENCE_END.split(text.strip())
    kept = [p for p in parts[:n] if p]
    return " ".join(kept).strip()


REWRITES = {
    "caps": lambda answer: sentences(answer, 1).upper(),
    "terse": lambda answer: sentences(answer, 1),
}


def chat_ids(tokenizer: Tokenizer, question: str) -> list[int]:
    return tokenizer.encode_chat([{"role": "user", "content": question}], add_generation_prompt=True)


@torch.inference_mode()
def base_answers(folder: Path, tokenizer: Tokenizer, questions: list[str], max_new_tokens: int) -> list[str]:
    """The base model's greedy answers, all questions in one batch through ``service.model`` (our fast path)."""
    from service.model import KVCache
    from service.model.load_folder import load_model

    model, cfg, _ = load_model(folder, dtype=torch.float32, device="cpu")
    prompts = [chat_ids(tokenizer, q) for q in questions]
    rows, width = len(prompts), max(len(p) for p in prompts)
    cache = KVCache(cfg, rows, width + max_new_tokens, dtype=torch.float32, device=model.device)
    tokens = torch.tensor([p + [0] * (width - len(p)) for p in prompts])  # right-padded [B, W]
    lengths = torch.tensor([len(p) for p in prompts])  # [B]
    hidden = model.gather_last(model(tokens, torch.arange(width).expand(rows, width), cache, 0), lengths)
    out: list[list[int]] = [[] for _ in prompts]
    done = [False] * rows
    for step in range(max_new_tokens):
        nxt = model.logits(hidden).argmax(-1)  # [B]
        for row, token in enumerate(nxt.tolist()):
            done[row] = done[row] or token in cfg.eos_token_ids
            if not done[row]:
                out[row].append(token)
        if all(done):
            break
        positions = (lengths + step)[:, None]  # [B, 1]: each row writes right after its own last token
        hidden = model(nxt[:, None], positions, cache, 0)[:, -1]
    return [tokenizer.decode(ids).strip() for ids in out]


@torch.no_grad()
def greedy_answers(model: Any, tokenizer: Tokenizer, questions: list[str], max_new_tokens: int) -> list[str]:
    """Greedy answers from a transformers / peft model, one question at a time (a handful of checks)."""
    answers = []
    for question in questions:
        ids = torch.tensor([chat_ids(tokenizer, question)])
        out = model.generate(input_ids=ids, max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=2)
        answers.append(tokenizer.decode(out[0, ids.shape[1] :].tolist()).strip())
    return answers


def make_examples(tokenizer: Tokenizer, pairs: list[tuple[str, str]], eos: int) -> list[tuple[list[int], int]]:
    """(token ids, prompt length) per example: prompt, the target answer, ``<|im_end|>``."""
    examples = []
    for question, answer in pairs:
        prompt = chat_ids(tokenizer, question)
        target = [*tokenizer.encode(answer, add_special_tokens=False), eos]
        examples.append((prompt + target, len(prompt)))
    return examples


@torch.no_grad()
def lower_hidden(base: Any, examples: list[tuple[list[int], int]], first: int) -> list[torch.Tensor]:
    """Each example's hidden states entering layer ``first`` [len, hidden]: the frozen part, computed once."""
    out = []
    for ids, _ in examples:
        states = base.model(input_ids=torch.tensor([ids]), output_hidden_states=True).hidden_states
        out.append(states[first][0])  # hidden_states[i] is the input of layer i
    return out


def train_adapter(
    base: Any,
    examples: list[tuple[list[int], int]],
    *,
    first: int,
    epochs: int,
    lr: float,
    batch_size: int,
    seed: int,
) -> Any:
    """Wrap ``base`` in a fresh LoRA adapter on layers ``first..`` and train it; returns the PeftModel.

    The layers below ``first`` carry no adapter, so their output is computed once per example and each
    training step runs only the top layers (the decoder's layer list is swapped for its tail meanwhile).
    """
    from peft import LoraConfig, get_peft_model

    cached = lower_hidden(base, examples, first)
    torch.manual_seed(seed)
    n_layers = base.config.num_hidden_layers
    config = LoraConfig(
        r=8,
        lora_alpha=16,
        target_modules=MODULES,
        layers_to_transform=list(range(first, n_layers)),
        lora_dropout=0.0,
        bias="none",
        task_type="CAUSAL_LM",
    )
    model = get_peft_model(base, config)
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=lr, weight_decay=0.0)
    steps = epochs * ((len(examples) + batch_size - 1) // batch_size)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0 - s / steps)
    decoder = model.base_model.model.model  # LlamaModel
    lm_head = model.base_model.model.lm_head
    all_layers = decoder.layers
    decoder.layers = torch.nn.ModuleList(list(all_layers)[first:])
    order = list(range(len(examples)))
    rng = random.Random(seed)
    model.train()
    try:
        for epoch in range(epochs):
            rng.shuffle(order)
            total, count = 0.0, 0
            for start in range(0, len(order), batch_size):
                batch = order[start : start + batch_size]
                width = max(len(examples[i][0]) for i in batch)
                hidden_in = torch.zeros(len(batch), width, cached[0].shape[-1])  # right-padded [b, W, hidden]
                mask = torch.zeros(len(batch), width, dtype=torch.long)
                # Position t predicts token t + 1; only answer tokens (and the closing <|im_end|>) are targets.
                target = torch.full((len(batch), width), -100)
                for row, i in enumerate(batch):
                    seq, prompt_len = examples[i]
                    hidden_in[row, : len(seq)] = cached[i]
                    mask[row, : len(seq)] = 1
                    target[row, prompt_len - 1 : len(seq) - 1] = torch.tensor(seq[prompt_len:])
                hidden = decoder(inputs_embeds=hidden_in, attention_mask=mask).last_hidden_state  # [b, W, hidden]
                keep = target != -100
                loss = F.cross_entropy(lm_head(hidden[keep]), target[keep])  # logits of target positions only
                optimizer.zero_grad()
                loss.backward()
                optimizer.step()
                schedule.step()
                total += float(loss.detach()) * int(keep.sum())
                count += int(keep.sum())
            print(f"    epoch {epoch + 1}/{epochs}: loss {total / count:.3f}", flush=True)
    finally:
        decoder.layers = all_layers
    model.eval()
    return model


def upper_ratio(text: str) -> float:
    letters = [c for c in text if c.isalpha()]
    return sum(c.isupper() for c in letters) / max(1, len(letters))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, default=ROOT / "models" / "SmolLM2-135M-Instruct")
    parser.add_argument("--out", type=Path, default=ROOT / "adapters" / "demo")
    parser.add_argument("--epochs", type=int, default=5)
    parser.add_argument("--first-layer", type=int, default=22, help="LoRA on this layer and the ones above")
    parser.add_argument("--lr", type=float, default=1e-2)
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--max-new-tokens", type=int, default=48)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    from transformers import LlamaForCausalLM

    t0 = time.perf_counter()
    torch.manual_seed(args.seed)
    tokenizer = Tokenizer.from_folder(args.model)
    eos = tokenizer.token_to_id("<|im_end|>")
    if eos is None:
        raise SystemExit("the tokenizer has no <|im_end|> token")
    answers = base_answers(args.model, tokenizer, QUESTIONS, args.max_new_tokens)
    print(f"base answers: {len(answers)} in {time.perf_counter() - t0:.0f}s", flush=True)
    base = LlamaForCausalLM.from_pretrained(args.model, dtype=torch.float32).eval()
    held_base = greedy_answers(base, tokenizer, HELD_OUT, args.max_new_tokens)

    failures = []
    for name, rewrite in REWRITES.items():
        t1 = time.perf_counter()
        pairs = [(q, rewrite(a)) for q, a in zip(QUESTIONS, answers, strict=True) if rewrite(a)]
        print(f"{name}: {len(pairs)} examples, e.g. {pairs[0][1]!r}", flush=True)
        examples = make_examples(tokenizer, pairs, eos)
        model = train_adapter(
            base,
            examples,
            first=args.first_layer,
            epochs=args.epochs,
            lr=args.lr,
            batch_size=args.batch_size,
            seed=args.seed,
        )
        folder = args.out / name
        model.save_pretrained(folder, safe_serialization=True)
        (folder / "README.md").unlink(missing_ok=True)
        config_path = folder / "adapter_config.json"
        config = json.loads(config_path.read_text())
        config["base_model_name_or_path"] = BASE_MODEL_ID  # not this machine's path
        config_path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
        held = greedy_answers(model, tokenizer, HELD_OUT, args.max_new_tokens)
        base = model.unload()  # the plain base model again, for the next adapter
        print(f"  trained and saved {folder} in {time.perf_counter() - t1:.0f}s", flush=True)
        for question, before, after in zip(HELD_OUT, held_base, held, strict=True):
            print(f"  Q: {question}\n    base:    {before!r}\n    {name}: {after!r}", flush=True)
            if name == "caps" and upper_ratio(after) < 0.8:
                failures.append(f"caps: {after!r} is not mostly upper-case")
            if name == "terse" and not (len(after) < len(before) and len(SENTENCE_END.split(after.strip())) == 1):
                failures.append(f"terse: {after!r} is not one sentence shorter than the base answer")
        print(f"  r={config['r']} alpha={config['lora_alpha']} targets={config['target_modules']}", flush=True)
    print(f"total {time.perf_counter() - t0:.0f}s")
    for failure in failures:
        print("CHECK FAILED:", failure)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
