"""The parallel head's drafter (P-EAGLE, arXiv 2602.01469): the whole draft in the catch-up forward.

Status (measured, docs/benchmarks.md "The parallel head"): on this project's targets it accepts less than the
sequential head it replaces (1.71 accepted a step against 2.50 on the CPU) and runs slower on the GPU too (1.29x
against the sequential head's 1.56x over plain decoding, bf16 on an H200). Off by default: only a head saved with
`parallel` (`draft.parallel=K` in training, or a published P-EAGLE folder) drafts this way; method eagle and auto
build this drafter for it (drafters/registry.py `eagle_drafter`).

A parallel head (`DraftHead.parallel` = K) drafts in its catch-up forward alone: K-1 mask rows (`DraftHead.mask_rows`)
follow the root's row (f_t, x_{t+1}) at the next positions, each reading two learned vectors instead of a feature and
a token embedding (`mask_hidden`, as wide as the head's feature input, and `mask_embed`); row j predicts the token j
places further on, seeing the real pairs and the mask rows before it (trained with the same losses at each row:
trainers/objective.py `unroll`). The tree grows from their K distributions (depth d's children from row d's,
whatever their parent), to at most K deep. The sampling rules of drafters/eagle.py hold as they are: a node's
distribution is the row it was drawn from. It reads no probe (`LookupGraft` stages nothing with it).
"""
from __future__ import annotations

from collections.abc import Callable
from functools import partial

import torch

from eagle_lite.config import TreeConfig
from eagle_lite.decoding.drafter import DraftInput, FixedShape, Proposal
from eagle_lite.drafters.eagle import EagleDrafter, HeadCall
from eagle_lite.drafters.eagle_static import StaticDraft
from eagle_lite.drafters.eagle_tree import grow_tree


class ParallelDrafter(EagleDrafter):
    """EagleDrafter for a head with `parallel` = K >= 2 (module docstring)."""

    @property
    def parallel(self) -> int:
        return self.head.parallel

    def fixed_shape(self) -> FixedShape:
        """The static step runs its tree when forced (`--static`); it is not the faster exact step by default."""
        return FixedShape(partial(StaticDraft, self.target, self.head), preferred=False)

    def proposal(self, inp: DraftInput, tree: TreeConfig, probe=None, first_min_prob: float | None = None) -> Proposal:
        """The catch-up forward with the mask rows after the root's, then the tree from their logits."""
        inp, m, n = self._caught_up(inp)
        dev = inp.hidden.device
        features, embeds = inp.hidden, self.target.embed_tokens(torch.tensor(inp.tokens[-m:], device=dev))
        masks = min(tree.depth, self.parallel) - 1
        if masks > 0:
            mask_hidden, mask_embeds = self.head.mask_rows(masks, embeds.dtype)
            features, embeds = torch.cat([features, mask_hidden.to(features.dtype)]), torch.cat([embeds, mask_embeds])
        t = features.shape[0]
        _, logits = yield HeadCall(self, features, embeds, torch.arange(n, n + t, device=dev),
                                   torch.ones(t, t, dtype=torch.bool, device=dev).tril_(), m - 1)
        self.cache.commit(m)
        real = self.cache.length
        try:
            sampling = inp.sampling if self.draft_sampling == "q" and not inp.sampling.greedy else None
            return grow_tree(inp.root, logits[:1], rows_by_depth(logits), tree.capped(logits.shape[0]), sampling,
                             inp.generator, self.head.d2t, self.target.vocab_size)
        finally:
            self.cache.truncate(real)


def rows_by_depth(logits: torch.Tensor) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """`grow_tree`'s expand over per-depth logits [D, V]: the n-th expansion answers row n for every parent."""
    depth = iter(range(1, logits.shape[0]))
    return lambda parent_row, tokens: logits[next(depth)].expand(parent_row.numel(), -1)
