"""Medusa heads as a drafter: each head's top candidates placed on the draft tree (``--speculate-tree``).

Head ``h`` reads a row's last kept hidden state and predicts the token ``h + 2`` positions on; the tree says which
candidate of which head sits at each node. With ``--draft-threshold`` a row verifies depth ``d`` only while the
heads' chained top-1 probability for drafts ``1..d`` is at least the threshold.
"""

from __future__ import annotations

from collections.abc import Sequence

from torch import Tensor

from service.adapters.medusa.heads import MedusaHeads
from service.drafters.base import Draft, DraftModel
from service.drafters.tree import DraftTree


class MedusaDrafter:
    """Drafts for the rows of one adapter's heads (one drafter per loaded heads, so their rows draft together)."""

    def __init__(self, heads: MedusaHeads, tree: DraftTree, threshold: float = 0.0) -> None:
        self.heads = heads
        self.tree = tree
        self.threshold = threshold

    def propose(self, hidden: Tensor, history: Sequence[Sequence[int]], model: DraftModel) -> list[Draft | None]:
        tree, k = self.tree, self.tree.max_rank + 1
        depths, head = None, model.draft_head(hidden.shape[0] * self.heads.num_heads)
        if self.threshold > 0:  # verify depth d only while P(the top-1 drafts 1..d are all right) >= threshold
            ids, probs = self.heads.candidates(hidden, head, k)
            depths = (probs.cumprod(dim=1) >= self.threshold).sum(dim=1).tolist()
        else:
            ids = self.heads.topk(hidden, head, k)  # [B, n_heads, k]
        drafts: list[Draft | None] = []
        for i, topk in enumerate(ids.tolist()):
            nodes = tree.nodes_within(depths[i]) if depths is not None else tree.size
            drafts.append(Draft(tree, tuple(tree.tokens(topk)[: nodes - 1])))
        return drafts


__all__ = ["MedusaDrafter"]
