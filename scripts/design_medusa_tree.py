"""Choose a Medusa draft tree for trained heads from held-out data: expected tokens per step for each node budget.

    .venv/bin/python scripts/design_medusa_tree.py [--heads adapters/demo/medusa] [--budgets 3 6 9 12 16]
        [--prompts 1640] [--max-new 128] [--dtype bfloat16] [--ranks 4]

Uses the corpus ``scripts/train_medusa_heads.py`` cached (same prompts, length and dtype arguments; the same
held-out split by seed). At every held-out position the heads' top-``ranks`` candidates are compared with the
base model's own greedy continuation: tree node ``(r_1 .. r_d)`` is accepted there exactly when each ``r_i``-th
candidate of head ``i - 1`` is the token at depth ``i``, so a tree's accepted length is the number of its nodes
accepted, and its mean over positions is what speculative decoding gains per step beyond the one token a plain
step gives (verified greedily, this is exact for teacher-forced states). Nodes are added greedily by their
acceptance frequency (a node is never more frequent than its parent, so each budget's tree is the best one of
that size); prints each budget's tree as a ``--speculate-tree`` value.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

from train_medusa_heads import add_corpus_arguments, build_corpus, training_prompts  # noqa: E402

from service.adapters.medusa import MedusaHeads, index_medusa  # noqa: E402
from service.model.config import ModelConfig  # noqa: E402
from service.model.load_folder import load_model  # noqa: E402
from tools.medusa.train import head_dataset  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_corpus_arguments(ap)
    ap.add_argument("--heads", type=Path, default=ROOT / "adapters" / "demo" / "medusa")
    ap.add_argument("--ranks", type=int, default=4)
    ap.add_argument("--budgets", type=int, nargs="+", default=[3, 6, 9, 12, 16])
    args = ap.parse_args()

    texts = training_prompts(args.prompts)
    prompts, responses, hiddens = build_corpus(args.model, texts, args.max_new, args.batch, args.work, args.dtype)
    order = torch.randperm(len(prompts), generator=torch.Generator().manual_seed(args.seed)).tolist()
    held = order[: max(1, int(len(order) * args.holdout))]
    cfg = ModelConfig.from_hf(args.model)
    heads = MedusaHeads.load(index_medusa(args.heads, cfg), device="cpu", dtype=torch.float32)
    model, _, _ = load_model(args.model, dtype=torch.float32, device="cpu")
    x, y = head_dataset([hiddens[i] for i in held], [responses[i] for i in held], heads.num_heads)
    keep = (y >= 0).all(dim=1)  # positions with a target for every head
    x, y = x[keep], y[keep]
    top = torch.cat([heads.topk(x[i : i + 1024], model.lm_head, args.ranks) for i in range(0, len(x), 1024)])
    hit = top == y[:, :, None]  # [M, n_heads, ranks]
    print(f"{len(x)} held-out positions; top-k accuracy per head (k = 1..{args.ranks}):")
    for h in range(heads.num_heads):
        print(f"  head {h}: " + " ".join(f"{hit[:, h, : k + 1].any(-1).float().mean():.3f}" for k in range(args.ranks)))

    def accepted(path: tuple[int, ...]) -> torch.Tensor:  # [M] bool: every node along the path matches
        ok = torch.ones(len(x), dtype=torch.bool)
        for depth, rank in enumerate(path):
            ok &= hit[:, depth, rank]
        return ok

    chosen: list[tuple[int, ...]] = []
    freq: dict[tuple[int, ...], float] = {}
    frontier = {(r,): float(accepted((r,)).float().mean()) for r in range(args.ranks)}
    for budget in sorted(args.budgets):
        while len(chosen) < budget and frontier:
            best = max(frontier, key=lambda p: frontier[p])
            freq[best] = frontier.pop(best)
            chosen.append(best)
            if len(best) < heads.num_heads:
                for r in range(args.ranks):
                    child = (*best, r)
                    frontier[child] = float(accepted(child).float().mean())
        spec = ";".join(".".join(str(r) for r in p) for p in sorted(chosen, key=lambda p: (len(p), p)))
        print(f"{len(chosen):>3} nodes: {1 + sum(freq.values()):.3f} tokens/step  --speculate-tree '{spec}'")
    chain = [tuple([0] * d) for d in range(1, heads.num_heads + 1)]
    print(f"chain ({len(chain)} nodes): {1 + sum(float(accepted(p).float().mean()) for p in chain):.3f} tokens/step")


if __name__ == "__main__":
    main()
