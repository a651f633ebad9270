"""The runner: executes the scheduler's plan on the model and the KV cache.

It builds the step's input tensors and LoRA tables, runs the forward pass, samples or verifies drafts, and asks
each row's drafter (``service.drafters``) for the next step's draft; it verifies whatever tree a draft holds,
without knowing which drafter made it. It hands each row's new tokens to the output processor and
advances ``row.length`` (the tokens whose K/V are in the row's slot); every slot move goes through the KV cache.
It never decides who runs (the scheduler's job) and never builds events (the output processor's).

Row ``b`` of a decode step lives in KV slot ``b``; row ``b`` of a prefill pass in slot ``start + b``. A prefill
pass computes each of its rows' next prompt chunk (the whole prompt, with chunking off); only rows whose chunk
ends their prompt reach the vocabulary projection, the sampler and the prefix cache.
"""

from __future__ import annotations

import time
from collections.abc import Hashable, Sequence

import torch

from service import metrics
from service.adapters.lora.batch import AdapterBatch, LoraTables
from service.adapters.lora.mix import AdapterLookup, Mixer
from service.config import Settings
from service.constraints.masks import Masks, PendingMasks
from service.engine.constrained import ConstrainedWalk, trim_draft
from service.engine.draft_depth import DraftDepth
from service.engine.head import Top, project, row_top
from service.engine.outputs import OutputProcessor
from service.engine.prefix import PrefixCache
from service.engine.row import Row
from service.engine.sampling import Sampler
from service.model.kv_cache import KVCache
from service.model.llama import Llama


class Runner:
    def __init__(
        self,
        model: Llama,
        cache: KVCache,
        settings: Settings,
        outputs: OutputProcessor,
        layer_lookup: AdapterLookup | None,
        masks: Masks | None = None,
    ) -> None:
        self.model = model
        self.cache = cache
        self.settings = settings
        self.outputs = outputs
        param = next(model.parameters())
        self.device = param.device
        self.sampler = Sampler(self.device)
        # Rows' weighted adapters composed into the math's layers (plain adapters pass through untouched).
        mixes = 2 * settings.max_batch_size
        self.mixer = None if layer_lookup is None else Mixer(layer_lookup, capacity=mixes)
        # LoRA weights laid out for the batched math, kept across steps (rows stay in their slots).
        self.tables = (
            LoraTables(model.cfg, device=self.device, dtype=param.dtype, native=model.lora_native)
            if layer_lookup is not None
            else None
        )
        self.prefix = PrefixCache(cache, settings.prefix_cache_bytes, settings.prefix_block_tokens)
        self.masks = masks  # token masks of constrained rows (None: this runner serves no constraints)
        self.depth = DraftDepth() if settings.speculate_adaptive else None  # how deep a step verifies drafts
        self.positions = 0  # positions the last decode step fed (rows x width)

    def reset(self) -> None:
        """Drop the caches that outlive rows (prefix blocks, LoRA tables): after a failed step they may be half
        written; both refill from the next requests."""
        self.prefix.clear()
        metrics.PREFIX_CACHE_BLOCKS.set(0)
        if self.tables is not None:
            self.tables.clear()
        if self.mixer is not None:
            self.mixer.clear()

    def _adapter_batch(self, rows: Sequence[Row], slot_start: int) -> AdapterBatch | None:
        if self.mixer is None or self.tables is None:
            return None
        keys = [r.request.deltas_key if r.deltas else None for r in rows]
        owners = [r.request for r in rows]  # a row holds its adapter while it lives: one stack serves its steps
        return AdapterBatch.build(keys, self.mixer.layer, self.tables, slot_start=slot_start, owners=owners)

    # --- prefill ----------------------------------------------------------------------------------------------
    def prefill(self, rows: Sequence[Row], grants: Sequence[int], start: int, draft: bool) -> None:
        """One prefill pass over rows in slots ``start ..``: every row but the last computes the rest of its prompt,
        the last up to ``grants[-1]`` more tokens (the scheduler's counts budget the pass).

        A row's first pass copies in the K/V of its cached prompt blocks; then row b feeds its prompt from what its
        slot holds, ``s_b``, to ``e_b`` (its prompt's end; for the last row ``min(s_b + grant, len)``), at
        positions ``s_b ..`` (attending to its own earlier chunks in the cache), right-padded to the widest chunk;
        padding lands beyond ``e_b`` (clamped into the cache), where the next chunk or nothing writes first and
        nothing reads. A row whose chunk ends its prompt samples its first token (and drafts, with a drafter) and its
        prompt blocks enter the prefix cache."""
        self._start_rows([(r, start + b) for b, r in enumerate(rows) if r.length == 0])
        last_end = min(rows[-1].length + grants[-1], len(rows[-1].request.prompt_ids))
        ends = [len(r.request.prompt_ids) for r in rows[:-1]] + [last_end]  # all but the last complete
        width = max(e - r.length for r, e in zip(rows, ends, strict=True))
        tokens = torch.zeros((len(rows), width), dtype=torch.long)  # [B, T], right-padded
        for b, (r, e) in enumerate(zip(rows, ends, strict=True)):
            tokens[b, : e - r.length] = torch.tensor(r.request.prompt_ids[r.length : e], dtype=torch.long)
        starts = torch.tensor([r.length for r in rows], dtype=torch.long)[:, None]  # [B, 1]
        positions = (starts + torch.arange(width, dtype=torch.long)).clamp_(max=self.cache.max_len - 1)  # [B, T]
        metrics.PROMPT_TOKENS.inc(sum(e - r.length for r, e in zip(rows, ends, strict=True)))
        metrics.PREFILL_CHUNKS.inc(len(rows))
        batch = self._adapter_batch(rows, start)
        kv_len = int(positions.max()) + 1
        done = [b for b, (r, e) in enumerate(zip(rows, ends, strict=True)) if e == len(r.request.prompt_ids)]
        masks = self._begin_masks([rows[b] for b in done])  # filled beside the forward pass
        hidden = self.model(
            tokens.to(self.device), positions.to(self.device), self.cache, start, batch, kv_len=kv_len
        )  # [B, T, H]
        last = torch.tensor([ends[b] - rows[b].length - 1 for b in done], dtype=torch.long, device=self.device)
        for r, e in zip(rows, ends, strict=True):
            r.length = e
        if not done:
            return
        final = hidden[torch.tensor(done, device=self.device), last]  # [C, H]: each completed row's last token
        completed = [rows[b] for b in done]
        logits, top = project(self.model, completed, final, batch, masks is None, done)  # [C, V] or None; the argmax
        for b, r in zip(done, completed, strict=True):
            self.prefix.insert(r.request.prompt_ids, r.kv_key, start + b, r.length)
        metrics.PREFIX_CACHE_BLOCKS.set(self.prefix.blocks_used)
        self._sample(completed, logits, masks, top)
        self._draft(completed, final, draft)

    def _start_rows(self, fresh: Sequence[tuple[Row, int]]) -> None:
        """Rows (and their slots) in their first pass: their queue time ends; their cached prompt blocks are copied
        into their slots, those shared by several of them and not cached yet computed once first."""
        now = time.monotonic()
        self._prefill_shared_prefixes([r for r, _ in fresh], [slot for _, slot in fresh])
        for r, slot in fresh:
            metrics.QUEUE_TIME.observe(now - r.enqueued)
            p = r.request.prompt_ids
            r.length = self.prefix.restore(self.prefix.lookup(p, r.kv_key, limit=len(p) - 1), slot)
            metrics.PREFIX_CACHE_HIT_TOKENS.inc(r.length)
            metrics.PROMPT_TOKENS.inc(r.length)

    def cached(self, prompt: Sequence[int], key: Hashable) -> int:
        """Prompt tokens a first pass would copy from the prefix cache for ``prompt`` under ``key`` (the scheduler's
        estimate; the pass itself looks again)."""
        return len(self.prefix.lookup(prompt, key, limit=len(prompt) - 1)) * self.prefix.block

    def _prefill_shared_prefixes(self, rows: Sequence[Row], slots: Sequence[int]) -> None:
        """Newcomers (in ``slots``) that start with the same uncached blocks (a burst of requests with one system
        prompt) would each compute them: prefill those blocks once, for one of the rows, and cache them for the
        others."""
        if len(rows) < 2 or not self.prefix.enabled:
            return
        chains = [self.prefix.hashes(r.request.prompt_ids, r.kv_key, limit=len(r.request.prompt_ids) - 1) for r in rows]
        counts: dict[int, int] = {}
        for chain in chains:
            for h in chain:
                counts[h] = counts.get(h, 0) + 1
        done: set[int] = set()
        for row, slot, chain in zip(rows, slots, chains, strict=True):
            depth = 0
            while depth < len(chain) and counts[chain[depth]] > 1:
                depth += 1
            if depth == 0 or chain[depth - 1] in done:
                continue
            done.add(chain[depth - 1])
            prompt = row.request.prompt_ids
            have = self.prefix.restore(self.prefix.lookup(prompt, row.kv_key, limit=depth * self.prefix.block), slot)
            n = depth * self.prefix.block
            if have >= n:
                continue
            tokens = torch.tensor([prompt[have:n]], dtype=torch.long, device=self.device)  # [1, T]
            positions = torch.arange(have, n, dtype=torch.long, device=self.device)[None, :]  # [1, T]
            self.model(tokens, positions, self.cache, slot, self._adapter_batch([row], slot), kv_len=n)
            self.prefix.insert(prompt, row.kv_key, slot, n)

    # --- decode -----------------------------------------------------------------------------------------------
    def decode(self, rows: list[Row], draft: bool) -> None:
        """One decode step of every running row (slots ``0 .. len(rows)``): plain, or verifying drafts."""
        metrics.BATCH_SIZE.observe(len(rows))
        if any(r.draft is not None for r in rows):
            self._decode_speculative(rows, draft)
        else:
            self._decode_plain(rows, draft)

    def _decode_plain(self, rows: list[Row], draft: bool) -> None:
        tokens = torch.tensor([[r.pending] for r in rows], dtype=torch.long)  # [B, 1]
        positions = torch.tensor([[r.length] for r in rows], dtype=torch.long)  # [B, 1]
        batch = self._adapter_batch(rows, 0)
        masks = self._begin_masks(rows)  # filled beside the forward pass
        hidden = self.model(tokens.to(self.device), positions.to(self.device), self.cache, 0, batch)  # [B, 1, H]
        self.positions = len(rows)
        logits, top = project(self.model, rows, hidden[:, -1], batch, masks is None)  # [B, V] or None; the argmax
        for r in rows:
            r.length += 1
        self._sample(rows, logits, masks, top)
        self._draft(rows, hidden[:, -1], draft)

    def _decode_speculative(self, rows: list[Row], draft: bool) -> None:
        """Verify every row's pending token plus its draft tree in one forward pass; keep the longest accepted path.

        Row b feeds its pending token (the root, cache position ``L_b``) and its first ``v_b - 1`` tree nodes
        (node i at cache position ``L_b + i``, RoPE position ``L_b + depth(i)``, attending to its ancestors only),
        padded to the batch's widest with its pending token (K/V beyond its length, never read back). Greedy rows
        walk the tree along the model's argmax and emit the path's tokens plus the argmax at its end: exactly
        plain greedy decoding; the cache then keeps the path's K/V at ``L_b + 1 ..``. Rows without a drafter
        (sampled rows) read node 0 like a plain decode step.
        """
        valid = self._verified_nodes(rows)
        width = max(valid)
        fed = [
            [r.pending, *self._tokens(r)[: valid[b] - 1]] + [r.pending] * (width - valid[b]) for b, r in enumerate(rows)
        ]
        tokens = torch.tensor(fed, dtype=torch.long, device=self.device)  # [B, T]
        depths, tree = self._tree_of_step(rows, valid, width)
        positions = torch.tensor([r.length for r in rows], device=self.device)[:, None] + depths  # [B, T]
        batch = self._adapter_batch(rows, 0)
        kv_len = max(r.length for r in rows) + width
        hidden = self.model(tokens, positions, self.cache, 0, batch, kv_len=kv_len, tree=tree)
        n = len(rows)
        self.positions = n * width
        index = [i for i in range(n) for _ in range(width)]  # node states row by row: each verified as a plain row
        free = all(r.drafter is not None and r.matcher is None for r in rows)  # the logits themselves unneeded
        flat, top = project(self.model, [rows[i] for i in index], hidden.reshape(n * width, -1), batch, free, index)
        logits = None if flat is None else flat.view(n, width, -1)  # [B, T, V]
        plain = [b for b, r in enumerate(rows) if r.drafter is None]
        if plain and logits is not None:  # sampled rows: one token from node 0, as a plain step
            sub = [rows[b] for b in plain]
            for r in sub:
                r.length += 1
            self._sample(sub, logits[torch.tensor(plain, device=self.device), 0], self._begin_masks(sub), None)
        best, predicted = (v.view(n, width) for v in top)  # [B, T]: each node's max and first argmax
        self._fail_non_finite_paths(rows, best, valid)
        last = self._accept(rows, fed, predicted.tolist(), valid, logits)
        at = torch.tensor(last, device=self.device)
        self._draft(rows, hidden[torch.arange(len(rows), device=self.device), at], draft)  # after the last kept token

    def _accept(
        self,
        rows: Sequence[Row],
        fed: list[list[int]],
        predicted: list[list[int]],
        valid: list[int],
        logits: torch.Tensor | None,
    ) -> list[int]:
        """Walk each drafting row's tree along the model's argmax ``predicted`` [B, T] (a constrained row: the
        argmax its grammar allows, from ``logits`` [B, T, V], given when a row has a grammar); keep and emit the
        path. Returns per row the node whose hidden state drafts next."""
        last = [0] * len(rows)
        drafted = kept = 0
        for b, row in enumerate(rows):
            if row.drafter is None or row.done:
                continue
            tree = row.draft.tree if row.draft is not None else None
            if row.matcher is not None and self.masks is not None and logits is not None:  # the grammar's argmax
                walk = ConstrainedWalk(self.masks, row.matcher, logits[b])
                path = tree.accept(fed[b], walk.predict, valid[b]) if tree is not None else []
                final = walk.picked[-1] if walk.picked else walk.predict(0)
                walk.undo()  # the output processor consumes what is emitted
            else:
                path = tree.accept(fed[b], predicted[b].__getitem__, valid[b]) if tree is not None else []
                final = predicted[b][path[-1] if path else 0]
            self.cache.keep_path(b, row.length, path)
            if self.depth is not None and tree is not None:
                self.depth.walked(row.drafter, tree.depths[valid[b] - 1], len(path))
            drafted += valid[b] - 1
            kept += len(path)
            last[b] = path[-1] if path else 0
            row.length += 1 + len(path)
            row.accepted += len(path)
            self.outputs.emit_path(row, [fed[b][i] for i in path])
            if final is None:
                self.outputs.dead_end(row)
            else:
                self.outputs.emit_path(row, [final])
        metrics.SPECULATIVE_DRAFTED.inc(drafted)
        metrics.SPECULATIVE_ACCEPTED.inc(kept)
        metrics.SPECULATIVE_STEPS.inc(sum(1 for r in rows if r.drafter is not None))
        return last

    @staticmethod
    def _tokens(row: Row) -> tuple[int, ...]:
        return () if row.draft is None else row.draft.tokens

    def _tree_of_step(self, rows: Sequence[Row], valid: Sequence[int], width: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Depths [B, T] of the nodes fed (padding at depth 0) and the attention mask of the trees: [T, T] when one
        tree holds every row's verified nodes as its first nodes (the usual case: one drafter, or Medusa heads of
        different counts), else [B, T, T] (each row its own tree; a padding node sees only itself)."""
        trees = [r.draft.tree for r in rows if r.draft is not None]
        widest = max(trees, key=lambda t: t.size)
        if all(t is widest or t.paths == widest.paths[: len(t.paths)] for t in trees):
            depths = torch.tensor(widest.depths[:width], device=self.device)[None, :].expand(len(rows), width)
            return depths, widest.visible[:width, :width]
        depth_rows = []
        mask = torch.eye(width, dtype=torch.bool).repeat(len(rows), 1, 1)  # [B, T, T]
        for b, (r, v) in enumerate(zip(rows, valid, strict=True)):
            if r.draft is None:
                depth_rows.append([0] * width)
                continue
            depth_rows.append(r.draft.tree.depths[:v] + [0] * (width - v))
            mask[b, :v, :v] = r.draft.tree.visible[:v, :v]
        return torch.tensor(depth_rows, device=self.device), mask

    def _verified_nodes(self, rows: Sequence[Row]) -> list[int]:
        """Nodes each row verifies: within its remaining tokens (a path of depth d emits d + 1), and every row's
        nodes inside the cache."""
        limit = self.settings.max_total_tokens
        valid = []
        caps: dict[int, int | None] = {}  # per drafter: the depth's limit, asked once a step
        for r in rows:
            room = min(r.request.max_new_tokens - r.generated - 1, limit - r.length - 2)
            if self.depth is not None and r.draft is not None and id(r.drafter) not in caps:
                caps[id(r.drafter)] = self.depth.limit(r.drafter, len(rows))
            cap = caps.get(id(r.drafter)) if r.draft is not None else None
            room = room if cap is None else min(room, cap)
            valid.append(1 if r.draft is None else min(1 + r.draft.size, r.draft.tree.nodes_within(max(0, room))))
        width = min(max(valid), min(limit - r.length for r in rows))
        return [min(v, width) for v in valid]

    # --- sampling and drafting --------------------------------------------------------------------------------
    def _begin_masks(self, rows: Sequence[Row]) -> PendingMasks | None:
        return self.masks.begin(rows) if self.masks is not None else None

    def _sample(
        self, rows: Sequence[Row], logits: torch.Tensor | None, masks: PendingMasks | None, top: Top | None
    ) -> None:
        """Sample every row's next token from ``logits`` [B, V], after ``masks`` (begun for these rows) removed
        what each constrained row's grammar does not allow; or, rows needing only their argmax, take ``top``."""
        if top is None:
            if logits is None:
                raise ValueError("_sample takes the logits or their top")
            top = row_top(self.model, logits)
        values, indices = top  # [B]: NaN if a logit is, inf if one is +inf; the first argmax
        finite = torch.isfinite(values)
        argmax: torch.Tensor | None = indices  # while the logits are unmasked
        dead: list[int] = []
        if masks is not None and self.masks is not None and logits is not None:  # rows needing only their argmax:
            only = [r.request.sampling.argmax_only for r in rows]  # masked only if the grammar refuses their argmax
            tops = indices.tolist() if any(only) else [None] * len(rows)
            dead = self.masks.apply(masks, logits, [t if o else None for t, o in zip(tops, only, strict=True)])
            argmax = None
        if dead or not bool(finite.all()):  # fail those rows alone; the sampler never sees their NaN or inf
            ok = finite.tolist()
            for b in dead:
                if ok[b]:
                    self.outputs.dead_end(rows[b])
            keep = [b for b, fine in enumerate(ok) if (fine or self._fail(rows[b])) and b not in dead]
            rows = [rows[b] for b in keep]
            kept = torch.tensor(keep, dtype=torch.long, device=indices.device)
            logits = None if logits is None else logits[kept]
            argmax = None if argmax is None else argmax[kept]
            if not rows:
                return
        if logits is None:  # ``top``: every row takes its argmax (no masks, so ``argmax`` is the kept rows')
            return self.outputs.emit_all(rows, (indices if argmax is None else argmax).tolist(), None)
        params = [r.request.sampling for r in rows]
        needs_history = any(p.repetition_penalty != 1.0 for p in params)
        result = self.sampler.sample(
            logits, params, [r.generator for r in rows], [r.ids for r in rows] if needs_history else None, argmax
        )
        logprobs = result.logprobs.tolist() if result.logprobs is not None else None
        self.outputs.emit_all(rows, result.tokens.tolist(), logprobs)

    def _fail(self, row: Row) -> bool:
        """Fail a row with non-finite logits; False, so a filter drops it."""
        self.outputs.fail_non_finite(row)
        return False

    def _fail_non_finite_paths(self, rows: Sequence[Row], best: torch.Tensor, valid: Sequence[int]) -> None:
        """Fail the drafting rows whose verified nodes' logits hold NaN or inf, from their max ``best`` [B, T] (NaN
        or +inf anywhere makes it so; plain rows of the step are checked where they are sampled)."""
        finite = torch.isfinite(best).tolist()  # [B, T]
        for b, row in enumerate(rows):
            if row.drafter is not None and not row.done and not all(finite[b][: valid[b]]):
                self.outputs.fail_non_finite(row)

    def _draft(self, rows: Sequence[Row], hidden: torch.Tensor, draft: bool) -> None:
        """Ask each drafter for the drafts of its rows, from their last hidden state ``hidden`` [len(rows), H] and
        their tokens so far; rows sharing a drafter are asked together."""
        if not any(row.drafter is not None for row in rows):
            return  # the common decode step: no row drafts, nothing to reset (rows without drafters hold no draft)
        groups: dict[int, list[int]] = {}
        for b, row in enumerate(rows):
            row.draft = None
            if row.drafter is not None and not row.done and draft:
                groups.setdefault(id(row.drafter), []).append(b)
        for members in groups.values():
            drafter = rows[members[0]].drafter
            assert drafter is not None  # groups hold rows with drafters only
            x = hidden.index_select(0, torch.tensor(members, device=hidden.device))  # [g, H]
            drafts = drafter.propose(x, [rows[b].ids for b in members], self.model)
            for b, proposed in zip(members, drafts, strict=True):
                matcher = rows[b].matcher
                if proposed is not None and matcher is not None:
                    proposed = trim_draft(proposed, matcher)
                rows[b].draft = proposed if proposed is not None and proposed.tokens else None


__all__ = ["Runner"]
