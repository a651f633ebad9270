"""Train v2 Medusa heads for SmolLM2 by self-distillation and write them as a Medusa adapter folder.

    .venv/bin/python scripts/train_medusa_heads.py [--model models/SmolLM2-135M-Instruct]
        [--out adapters/demo/medusa] [--heads 3] [--prompts 1640] [--max-new 128] [--dtype bfloat16]

1. The frozen base model answers the chat prompts below greedily (``tools.medusa.loop.generate``, batched). The
   corpus is cached under ``--work`` (``bench/.work/medusa`` by default), keyed by model, prompts and length, so a
   rerun only trains.
2. The final hidden state that produced each response token is recorded while generating (no gradient, no
   second pass).
3. The heads' residual blocks are trained on those states (``tools.medusa.train``): first a hidden-space
   regression, then cross-entropy through the frozen ``lm_head`` against the base model's own greedy tokens.
4. The folder gets ``config.json`` (version 2) and ``medusa_lm_head.safetensors``; the safetensors metadata
   records the corpus size and the per-head top-1 accuracy on held-out sequences.

Every step is seeded; on 2 CPU cores the whole run takes about 20 minutes (13 generating the corpus of ~178k
tokens in bf16, 6 training); ``scripts/design_medusa_tree.py`` then picks a draft tree from the held-out part.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from service.adapters.medusa.format import write_medusa  # noqa: E402
from service.adapters.medusa.heads import MedusaHeads  # noqa: E402
from service.model.load_folder import load_model  # noqa: E402
from service.tokenizer import Tokenizer  # noqa: E402
from tools.medusa.loop import generate  # noqa: E402
from tools.medusa.train import head_accuracy, head_dataset, train_v2_heads  # noqa: E402

TEMPLATES = (
    "Explain {} in simple terms.",
    "What is {}? Answer in a few sentences.",
    "Give me three facts about {}.",
    "Write a short paragraph about {}.",
    "Why is {} important?",
    "How would you describe {} to a child?",
    "List some common misconceptions about {}.",
    "What are the pros and cons of {}?",
    "Summarize the history of {} briefly.",
    "Write a haiku about {}.",
    "What should a beginner know about {}?",
    "Compare {} with something similar.",
    "How does {} work?",
    "Tell me something surprising about {}.",
    "What questions do people often ask about {}?",
    "Write a short story that involves {}.",
    "What is the future of {}?",
    "Give an example that illustrates {}.",
    "How has {} changed over time?",
    "What are the main parts of {}?",
)
SUBJECTS = (
    "photosynthesis",
    "the water cycle",
    "black holes",
    "machine learning",
    "the French Revolution",
    "climate change",
    "the human heart",
    "volcanoes",
    "the stock market",
    "vaccines",
    "the internet",
    "renewable energy",
    "the Roman Empire",
    "honey bees",
    "quantum computing",
    "the moon",
    "recycling",
    "sleep",
    "coffee",
    "the Pyramids of Giza",
    "electric cars",
    "rainbows",
    "democracy",
    "earthquakes",
    "the immune system",
    "chess",
    "the Amazon rainforest",
    "gravity",
    "music theory",
    "DNA",
    "cloud computing",
    "the printing press",
    "ocean tides",
    "healthy eating",
    "meditation",
    "dinosaurs",
    "the solar system",
    "inflation",
    "bicycles",
    "public libraries",
    "friendship",
    "the Olympic Games",
    "jazz",
    "glaciers",
    "social media",
    "the periodic table",
    "photography",
    "gardening",
    "bread baking",
    "the Great Wall of China",
    "smartphones",
    "whales",
    "taxes",
    "the Renaissance",
    "batteries",
    "volunteering",
    "deserts",
    "football",
    "memory",
    "bridges",
    "time zones",
    "mushrooms",
    "the Industrial Revolution",
    "password security",
    "coral reefs",
    "elections",
    "yoga",
    "trains",
    "the human brain",
    "spices",
    "comets",
    "job interviews",
    "wind turbines",
    "ancient Greece",
    "tea",
    "cats",
    "budgeting",
    "the ozone layer",
    "robots",
    "poetry",
    "rivers",
    "the postal service",
)


# Held out from training (different phrasings and subjects from TEMPLATES x SUBJECTS): what bench/medusa.py and
# tests/medusa/test_medusa_smollm2.py measure the heads on.
HELD_OUT_PROMPTS = (
    "Tell me how a refrigerator keeps food cold.",
    "What makes a good night's sleep?",
    "Describe the life cycle of a butterfly.",
    "How do airplanes stay in the air?",
    "What are the benefits of learning a second language?",
    "Give me a simple recipe for pancakes.",
    "Why do leaves change color in autumn?",
    "How does a computer store information?",
    "What is the difference between weather and climate?",
    "Explain how a bill becomes a law.",
    "What are some ways to reduce stress at work?",
    "How do vaccines train the body?",
    "Describe a typical day of an astronaut on the space station.",
    "What causes thunder and lightning?",
    "How can I start running as a beginner?",
    "Why is the sky blue?",
    "What did ancient Egyptians eat?",
    "How does a credit card work?",
    "What are the main parts of a cell?",
    "How do solar panels produce electricity?",
)


def training_prompts(count: int) -> list[str]:
    """``count`` distinct prompts, spread over every template and subject (deterministic)."""
    # Walk the subjects, each time with the next template: every subject meets several phrasings early on.
    pairs = [(TEMPLATES[(i + r) % len(TEMPLATES)], s) for r in range(len(TEMPLATES)) for i, s in enumerate(SUBJECTS)]
    if count > len(pairs):
        raise SystemExit(f"--prompts {count}: at most {len(pairs)} distinct prompts are defined")
    return [t.format(s) for t, s in pairs[:count]]


def build_corpus(
    model_dir: Path, texts: list[str], max_new: int, batch: int, work: Path, dtype: str = "float32"
) -> tuple[list[list[int]], list[list[int]], list[torch.Tensor]]:
    """(prompt ids, greedy response ids, the hidden state that produced each response token) per text.

    Read from the cache under ``work`` when model, texts and length match; the states are recorded while
    generating (``generate(record_hidden=True)``), so no second pass over the corpus is needed."""
    spec = [str(model_dir.resolve()), texts, max_new] + ([dtype] if dtype != "float32" else [])
    key = hashlib.sha256(json.dumps(spec).encode()).hexdigest()[:16]
    path, states_path = work / f"corpus-{key}.json", work / f"corpus-{key}.pt"
    if path.is_file() and states_path.is_file():
        doc = json.loads(path.read_text())
        hiddens = torch.load(states_path)
        print(f"corpus: cached {path} ({sum(len(r) for r in doc['responses'])} tokens)", flush=True)
        return doc["prompts"], doc["responses"], hiddens
    tok = Tokenizer.from_folder(model_dir)
    prompts = [tok.encode_chat([{"role": "user", "content": t}]) for t in texts]
    model, cfg, _ = load_model(model_dir, dtype=getattr(torch, dtype), device="cpu")
    responses: list[list[int]] = []
    hiddens: list[torch.Tensor] = []
    t0 = time.perf_counter()
    for start in range(0, len(prompts), batch):
        out = generate(
            model, prompts[start : start + batch], max_new, eos_token_ids=cfg.eos_token_ids, record_hidden=True
        )
        responses += out.tokens
        hiddens += out.hidden or []
        done = start + len(out.tokens)
        print(f"corpus: {done}/{len(prompts)} responses, {time.perf_counter() - t0:.0f}s", flush=True)
    work.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"texts": texts, "prompts": prompts, "responses": responses}))
    torch.save(hiddens, states_path)
    return prompts, responses, hiddens


def add_corpus_arguments(ap: argparse.ArgumentParser) -> None:
    """The arguments that identify the cached corpus and its held-out split (shared with design_medusa_tree.py)."""
    ap.add_argument("--model", type=Path, default=ROOT / "models" / "SmolLM2-135M-Instruct")
    ap.add_argument("--work", type=Path, default=ROOT / "bench" / ".work" / "medusa")
    ap.add_argument("--prompts", type=int, default=1640)
    ap.add_argument("--max-new", type=int, default=128)
    ap.add_argument("--batch", type=int, default=32, help="generation batch size")
    ap.add_argument(
        "--dtype", choices=("float32", "bfloat16"), default="bfloat16",
        help="dtype of the base model generating the corpus (bfloat16: about twice as fast on CPU; the states are "
        "stored in fp32 either way)",
    )  # fmt: skip
    ap.add_argument("--holdout", type=float, default=0.1, help="fraction of sequences kept out of training")
    ap.add_argument("--seed", type=int, default=0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_corpus_arguments(ap)
    ap.add_argument("--out", type=Path, default=ROOT / "adapters" / "demo" / "medusa")
    ap.add_argument("--heads", type=int, default=3)
    ap.add_argument("--layers", type=int, default=1)
    ap.add_argument("--mse-epochs", type=int, default=4)
    ap.add_argument("--ce-epochs", type=int, default=4)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0 = torch's default)")
    args = ap.parse_args()
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    t_start = time.perf_counter()

    texts = training_prompts(args.prompts)
    prompts, responses, hiddens = build_corpus(args.model, texts, args.max_new, args.batch, args.work, args.dtype)
    model, _, _ = load_model(args.model, dtype=torch.float32, device="cpu")

    order = torch.randperm(len(prompts), generator=torch.Generator().manual_seed(args.seed)).tolist()
    n_hold = max(1, int(len(order) * args.holdout))
    held, train = order[:n_hold], order[n_hold:]
    x, y = head_dataset([hiddens[i] for i in train], [responses[i] for i in train], args.heads)
    hx, hy = head_dataset([hiddens[i] for i in held], [responses[i] for i in held], args.heads)
    print(f"training on {x.shape[0]} positions of {len(train)} sequences; {hx.shape[0]} held out", flush=True)
    t0 = time.perf_counter()
    weight, bias = train_v2_heads(
        x,
        y,
        model.lm_head,
        lengths=[len(responses[i]) for i in train],
        num_layers=args.layers,
        mse_epochs=args.mse_epochs,
        ce_epochs=args.ce_epochs,
        lr=args.lr,
        seed=args.seed,
        log=lambda line: print(line, flush=True),
    )
    train_seconds = time.perf_counter() - t0
    heads = MedusaHeads(2, weight, bias)
    acc_train = head_accuracy(heads, x[:4096], y[:4096], model.lm_head)  # a sample: the full set adds a minute
    acc_held = head_accuracy(heads, hx, hy, model.lm_head)
    print("top-1 accuracy per head (train):    " + " ".join(f"{a:.3f}" for a in acc_train))
    print("top-1 accuracy per head (held out): " + " ".join(f"{a:.3f}" for a in acc_held))

    metadata = {
        "format": "pt",
        "trained_by": "scripts/train_medusa_heads.py (self-distillation, frozen base)",
        "corpus": f"{len(prompts)} prompts x <= {args.max_new} greedy tokens, {x.shape[0]} training positions",
        "top1_heldout": json.dumps([round(a, 4) for a in acc_held]),
        "top1_train": json.dumps([round(a, 4) for a in acc_train]),
    }
    write_medusa(args.out, weight, bias, version=2, base_model="HuggingFaceTB/SmolLM2-135M-Instruct", metadata=metadata)
    print(f"wrote {args.out} (training {train_seconds:.0f}s, total {time.perf_counter() - t_start:.0f}s)")


if __name__ == "__main__":
    main()
