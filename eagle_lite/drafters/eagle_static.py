"""An EAGLE head's draft in fixed shapes: what `EagleDrafter.fixed_shape` hands the fixed-shape step
(decoding/static/step.py), which runs it on device tensors with no read back to the host, so that a CUDA graph
can capture it or `torch.compile(fullgraph=True)` compile it.

The tree grows by the drafter's own growth (eagle_tree.py `expanded_tree_steps`), its shapes fixed
(`tree.FixedGrowth`): every level is expanded, min_prob marks nodes invalid instead of dropping them, and there is
no prompt-lookup graft. What differs from the drafter is only where the head's forwards go: a draft cache of slots
(static/kv_cache.py) with the expansions at fixed slots past the main region, so that their mask is the prefix
(one comparison a step) beside their block, and the rotary tables of all expansions come from one call.
"""
from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from dataclasses import replace

import torch

from ..config import TreeConfig
from ..decoding.static.kv_cache import DeviceKVCache, cache_shape, probe_calls, probe_error, probe_ids, slot_mask
from ..decoding.static.stack import RotaryTables, StaticLayer, rms_norm, supported, supported_norm
from ..kernels.accelerate import stock
from ..tree import FixedGrowth, FixedTree
from .eagle_tree import expanded_tree_steps

log = logging.getLogger("eagle_lite")


class DraftConstants:
    """What the draft reads that depends only on `tree`'s shape and the draft cache's `slots`, built once per shape:
    a captured graph reads them where they lie, and a step launches nothing for them. W = top_k * (depth - 1)
    expansion slots, after the draft cache's `main` slots."""

    def __init__(self, tree: TreeConfig, bucket: int, slots: int, device) -> None:
        k, depth = tree.top_k, tree.depth
        levels, width, main = depth - 1, max(k * (depth - 1), 1), slots - k * (depth - 1)
        kk = torch.arange(k)
        own = torch.zeros(max(levels, 1), k, width, dtype=torch.bool)
        for d in range(levels):
            own[d, kk, d * k + kk] = True
        long, flag = dict(dtype=torch.long, device=device), dict(dtype=torch.bool, device=device)
        self.growth = FixedGrowth.of(tree, device)
        pad = bucket - 1 - self.growth.tree_nodes.numel()             # the bucket's nodes past the root and those kept
        self.read_rows = torch.arange(depth + 1, device=device)                  # [D + 1]
        self.causal = torch.ones(depth + 1, depth + 1, **flag).tril_()           # [D + 1, D + 1]
        self.cols, self.main_cols = torch.arange(slots, device=device), torch.arange(main, device=device)
        self.expansion_levels = torch.arange(max(levels, 1), device=device)     # expansion d's tokens: length + d - 1
        self.own = own.to(device)                  # [depth - 1, k, W]: expansion d's frontier node i at its slot
        self.expansion_slots = (main + torch.arange(max(levels, 1))[:, None] * k + kk).to(device)   # [depth - 1, k]
        self.no_ancestors = torch.zeros(k, width, **flag)                        # [k, W]
        self.chain_vis = (own[:, 0].long().cumsum(0) > 0).to(device)   # [depth - 1, W]: a parallel head's mask rows
        # the bucket of B nodes the tree is placed in: the root, the kept nodes, padding off the root
        self.zero1, self.true1 = torch.zeros(1, **long), torch.ones(1, **flag)
        self.pad_zeros, self.pad_ones, self.pad_false = torch.zeros(pad, **long), torch.ones(pad, **long), \
            torch.zeros(pad, **flag)
        self.eye, self.ones = torch.eye(bucket, **flag), torch.ones(bucket, **flag)
        self.tree_rows = torch.arange(bucket, device=device)


class StaticDraft:
    """The draft head's tree in fixed shapes, for the fixed-shape step (`StaticStep(target, draft)`).

    The step calls `tree_for` (the tree it drafts for a request's), `prepare` (caches and constants for a cache of
    the target's `slots`), `prefill` (the prompt's pairs), then `draft` each step, and runs them inside `running`.
    fused: the head's layer as one fused op (static/stack.py), where a probe shows it computes the model's layer."""

    def __init__(self, target, head, fused: bool = True) -> None:
        self.target, self.head = target, head
        self.taps = tuple(head.feature_layers)
        self.parallel = int(head.parallel)
        self.lm_weight = head.output_weight(target.lm_head.weight).detach().contiguous()
        self.cache: DeviceKVCache | None = None
        self.consts: DraftConstants | None = None
        self.tree: TreeConfig | None = None
        self._shape: tuple = ()
        self._warned_lookup = False
        self._layer = None      # (StaticLayer, RotaryTables) of the head's decoder layer, where it is one
        if fused and supported(head.layer):
            layer = StaticLayer(head.layer, 0)
            self._layer = (layer, RotaryTables(head.rotary, layer))
            problem = self._fused_problem()
            if problem:
                log.info("the static step runs the head's own layer, not the fused one: %s", problem)
                self._layer = None

    @contextlib.contextmanager
    def running(self, compiled: bool) -> Iterator[None]:
        """Run a block as the draft needs the head: where the steps are compiled, the head's own modules (the CPU
        speed-ups of kernels/ are native ops that torch.compile does not trace)."""
        with stock(self.head) if compiled else contextlib.nullcontext():
            yield

    def tree_for(self, tree: TreeConfig) -> TreeConfig:
        """The tree this draft grows for a request's `tree`: without its prompt-lookup graft, a parallel head's
        capped to its K."""
        if tree.lookup and not self._warned_lookup:
            log.info("the static step drafts without the prompt-lookup graft: tree lookup=%d is ignored", tree.lookup)
            self._warned_lookup = True
        tree = replace(tree, lookup=0)
        return tree.capped(self.parallel) if self.parallel else tree

    def prepare(self, tree: TreeConfig, bucket: int, slots: int, rebuild: bool) -> bool:
        """A draft cache beside a target cache of `slots` slots and constants for `tree` placed in a bucket of `bucket`
        nodes (static/tree.py); rebuilt where `rebuild` (the step's shapes changed) or where they do not fit. Returns
        whether anything was rebuilt (the step then recaptures its graphs)."""
        dev, width = self.target.device, tree.top_k * max(tree.depth - 1, 0)
        need, changed = slots + width + tree.depth + 1, False
        if self.cache is None or self.cache.slots < need:
            self.cache = None                    # the old buffer goes before the new one comes
            _, kv_heads, head_dim = cache_shape(self.head.config)
            self.cache = DeviceKVCache(1, kv_heads, head_dim, need, self.lm_weight.dtype, dev)
            changed = True
        if changed or rebuild or self.consts is None or (tree, bucket) != self._shape:
            self.consts, self.tree, self._shape = DraftConstants(tree, bucket, self.cache.slots, dev), tree, \
                (tree, bucket)
            changed = True
        return changed

    def prefill(self, feats: torch.Tensor, ids: torch.Tensor) -> None:
        """The prompt's pairs (f_t, x_{t+1}), t < p - 1: feats [p - 1, F] and ids [p - 1] (the prompt's tokens after
        the first), at positions 0 ...; run eagerly."""
        p = ids.numel()
        if p == 0:
            return
        ar, zero = torch.arange(p, device=ids.device), torch.zeros((), dtype=torch.long, device=ids.device)
        causal = torch.ones(p, p, dtype=torch.bool, device=ids.device).tril_()
        self._forward(feats, ids, ar, slot_mask(zero, causal, self.cache.slots), ar)

    def _forward(self, feats: torch.Tensor, tokens: torch.Tensor | None, positions: torch.Tensor, mask: torch.Tensor,
                 slots: torch.Tensor, rotary: tuple[torch.Tensor, torch.Tensor] | None = None,
                 embeds: torch.Tensor | None = None) -> torch.Tensor:
        """The draft head over T pairs (feature, next token) at `positions`, written at `slots`: [T, H].
        rotary: the fused layer's tables at `positions`, where the caller has them already. embeds: the rows'
        token embeddings in place of `tokens`' (a parallel head's mask rows)."""
        embeds = self.target.embed_tokens(tokens) if embeds is None else embeds
        if self._layer is not None:       # DraftHead.forward, its layer fused (static/stack.py)
            layer, tables = self._layer
            x = self.head.layer_input(feats, embeds)
            return layer(x, rotary if rotary is not None else tables(x, positions), mask, self.cache.kv[0],
                         slots, embeds)
        return self.head(feats[None], embeds[None], positions[None], mask, self.cache.writer(slots))[0]

    def _logits(self, h: torch.Tensor) -> torch.Tensor:
        """h [R, H] -> the head's logits over its vocabulary [R, V_draft]."""
        norm = getattr(self.head, "norm", None)
        if self._layer is not None and norm is not None and supported_norm(norm):
            h = rms_norm(norm, h)                                          # logit_features in one op
        else:
            h = self.head.logit_features(h)
        return h @ self.lm_weight.t()

    def draft(self, state) -> None:
        """Read the features the last step produced (`state`: static/step.py `StepState`), then grow the tree under
        the root into `state.tree` by `expanded_tree_steps` in fixed shapes, answering each expansion it asks for
        with one head forward over the frontier (each node seeing the committed slots and its own path).

        A parallel head (`DraftHead.parallel`) runs its depth - 1 mask rows in one more forward instead of the
        expansions, at the first slot of each expansion level; each level's children are then that row's top-k,
        whatever their parent (eagle_lite_wing/parallel.py)."""
        s, c, tree = state, self.consts, self.tree
        k, depth = tree.top_k, tree.depth
        # 1. the pairs (f_t, x_{t+1}) of the tokens the last step emitted, at positions length - n ... length - 1
        start = s.length - s.n
        at = start + c.read_rows
        h = self._forward(s.feats, s.emitted, at, slot_mask(start, c.causal, c.cols, at), at)   # D+1 H
        h = h.index_select(0, s.n.view(1) - 1)                             # 1 H: predicts the root's feature
        # 2. the tree: its growth asks for each expansion's logits, given the frontier's parent rows and tokens
        grow = expanded_tree_steps(s.root, self._logits(h), tree, vocab=self.head.d2t, fixed=c.growth)
        positions = s.length + c.expansion_levels                          # depth - 1
        prefix = (c.main_cols < s.length).expand(k, -1)                    # k main: the committed slots
        if self.parallel and depth > 1:  # the mask rows at the next positions, each seeing the committed slots and
            mask = torch.cat([(c.main_cols < s.length).expand(depth - 1, -1), c.chain_vis], dim=1)[None, None]
            mask_hidden, mask_embeds = self.head.mask_rows(depth - 1, s.feats.dtype)   # those before it
            level_logits = self._logits(self._forward(mask_hidden, None, positions, mask, c.expansion_slots[:, 0],
                                                      embeds=mask_embeds))  # depth-1 V_draft
        rotary = self._rotary(s.feats, positions) if depth > 1 and not self.parallel else None
        vis = c.no_ancestors                                               # k W: ancestors among expansion slots
        request = next(grow)
        for d in range(1, depth):                                          # exactly depth - 1 expansions
            parent_row, tokens = request
            if self.parallel:                                              # every frontier node: the row's top-k
                logits = level_logits[d - 1:d]
            else:
                vis = (c.no_ancestors if d == 1 else vis[parent_row]) | c.own[d - 1]   # k W: each node and its path
                h = self._forward(h[parent_row], tokens, positions[d - 1].expand(k),
                                  torch.cat([prefix, vis], dim=1)[None, None], c.expansion_slots[d - 1],
                                  None if rotary is None else tuple(r[d - 1].expand(k, -1, -1) for r in rotary))
                logits = self._logits(h)                                   # k V_draft
            request = grow.send(logits)
        self._place(s, request)                                            # the growth's last yield: its tree

    def _place(self, s, kept: FixedTree) -> None:
        """Write the root and the kept nodes into the step's tree buffers (static/tree.py `StaticTree`), padding
        after them, and their ancestors by `depth` gathers up the parent pointers."""
        c, t = self.consts, s.tree
        torch.cat([c.zero1, kept.parents, c.pad_zeros], out=t.parents)
        torch.cat([s.root, kept.tokens, c.pad_zeros], out=t.tokens)
        torch.cat([c.zero1, kept.depths, c.pad_ones], out=t.depths)
        torch.cat([c.true1, kept.valid, c.pad_false], out=t.valid)      # below min_prob: verified, never accepted
        t.ancestors.copy_(c.eye)
        up = c.tree_rows
        for _ in range(self.tree.depth):
            up = t.parents[up]
            t.ancestors.index_put_((c.tree_rows, up), c.ones)

    def _rotary(self, like: torch.Tensor, positions: torch.Tensor):
        """The fused head layer's rotary tables at `positions` (None where the head runs its own layer)."""
        if self._layer is None:
            return None
        return self._layer[1](like, positions)

    def _fused_problem(self) -> str | None:
        """Why the fused layer cannot stand in for the head's own: None where 3 pairs and then two sibling nodes
        through each way give the same outputs and cache entries (to float rounding: the products run in other
        shapes)."""
        target, dev, fused = self.target, self.target.device, self._layer
        ids = probe_ids(target.vocab_size, dev)
        g = torch.Generator().manual_seed(0)
        feats = torch.randn(5, (len(self.taps) or 1) * target.hidden_size, generator=g).to(dev, target.dtype)
        calls = [(feats[rows], ids[rows], *call) for rows, call in zip((slice(0, 3), slice(3, 5)),
                                                                       probe_calls(3, dev))]
        tolerance = 1e-5 if target.dtype == torch.float32 else 2e-2
        saved, outs = self.cache, []
        try:
            with torch.inference_mode(), stock(self.head):   # the model as transformers built it
                for use in (fused, None):
                    self._layer = use
                    self.cache = DeviceKVCache(1, *cache_shape(self.head.config)[1:], 16, self.lm_weight.dtype, dev)
                    outs.append([*(self._forward(*call) for call in calls), self.cache.kv[..., :6, :]])
        except Exception as err:  # noqa: BLE001 (any failure means: run the head's own layer)
            return f"a probe fails ({type(err).__name__}: {err})"
        finally:
            self.cache, self._layer = saved, fused
        error = probe_error(*outs)
        log.debug("the fused head layer on the probe: relative error %.1e", error)
        return f"it computes something else on a probe (relative error {error:.1e})" if error > tolerance else None
