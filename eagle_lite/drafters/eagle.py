"""EAGLE-2 drafting: the draft head grows a dynamic tree by cumulative log-probability, then reranks it
(optionally keeping only nodes whose path probability reaches `TreeConfig.min_prob`; the growth: eagle_tree.py, the
same in the fixed-shape step, eagle_static.py). A prompt-lookup path is
grafted on by composing it with `LookupGraft` (lookup_graft.py); a parallel head drafts in eagle_lite_wing/parallel.py.

Sampling has two exact rules, `draft_sampling`: "match" (the head's top-k tree; acceptance follows the child
carrying the target's draw) and "q" (children drawn from the head's q, accepted by sibling-wise recursive rejection;
the tree is ranked by values fixed before each draw). docs/methods.md, "EAGLE's two sampling rules", has why each
is exact; tests/test_eagle_sampling.py checks both.
"""
from __future__ import annotations

import copy
from dataclasses import dataclass
from functools import partial

import torch

from ..config import DRAFT_SAMPLING, TreeConfig
from ..decoding.drafter import Drafter, DraftInput, FixedShape, Proposal, propose_together
from ..heads.draft import DraftHead
from ..kernels import MAX_GRID_ROWS, accelerate_head, draft_vocab_grid, few_rows_product
from ..kv_cache import StaticKVCache
from ..tree import DraftTree
from .eagle_static import StaticDraft
from .eagle_tree import grow_tree_steps


class EagleDrafter(Drafter):
    name = "eagle"
    # the most feature rows of sat-out steps a head reads on its return: older ones are dropped and their positions
    # left as a hole in its cache (its attention skips them; drafts are verified, so output is unchanged), which
    # bounds a catch-up after many plain steps. None: read them all. Off where features are kept for probes.
    catch_up_window: int | None = 32

    def __init__(self, target, head: DraftHead, round_head: bool = True, draft_sampling: str = "q") -> None:
        """round_head: on CPU, run the head's linears from Q8_0 codes rounded from its fp32 weights (a
        quarter of the bytes; proposals barely move and acceptance keeps the output exact); else oneDNN's
        packed fp32 product. No-op elsewhere. draft_sampling: how a sampled (temperature > 0) tree is drafted
        and accepted, one of DRAFT_SAMPLING (module docstring); greedy decoding ignores it."""
        if draft_sampling not in DRAFT_SAMPLING:
            raise ValueError(f"draft_sampling must be one of {', '.join(DRAFT_SAMPLING)}, got {draft_sampling!r}")
        self.draft_sampling = draft_sampling
        self.target = target
        self.head = head.eval()
        self.feature_layers = head.feature_layers   # the target's layers the head reads (EAGLE-3), else ()
        accelerate_head(self.head, self.head.layer, self.head.rotary, round_to_grid=round_head)
        # V_draft H: the target's lm_head (frozen, shared), or its draft-vocabulary rows, or an EAGLE-3 head's own
        self.lm_weight = head.output_weight(target.lm_head.weight).detach().contiguous()
        # its integer codes where it lies on a GGUF grid (grid_linear.py); the full vocabulary is the target's own;
        # an EAGLE-3 head's own lm_head is one of the head's linears, rounded onto a grid as they are (round_head)
        shared = head.d2t is None and head.lm_head is None
        own = head.lm_head is not None and round_head
        self.lm_grid = target.lm_grid if shared else draft_vocab_grid(self.lm_weight, round_to_grid=own)
        self.keep_features = False                 # keep the target's features by position (for `probe`)
        self.recommended_tree = head.tree          # the tree its checkpoint recommends for this device, if any
        self._fresh()

    def _fresh(self) -> None:
        """The per-sequence state, empty."""
        self.cache: StaticKVCache | None = None
        self._features: torch.Tensor | None = None  # [>= cache.length, H']: row t is f_t of the head's pair t
        self.probe_top: list[int] = []             # the head's greedy tokens of the last `probe` (see propose)
        self._queued: list[torch.Tensor] = []     # features the head has not read yet (steps it sat out)
        self.queued_rows = 0                       # their rows: the catch-up its next `propose` reads first
        self._holes: list[tuple[int, int]] = []   # (cache slot, positions missing before it): dropped sat-out rows
        self._dropped = 0                          # rows dropped from the queue, the hole its catch-up leaves

    def sibling(self) -> EagleDrafter:
        """A drafter of the same head with per-sequence state of its own and all else shared (the head and its
        speed-ups, its output weight and grid codes: applied and built once): one per sequence of a batch."""
        twin = copy.copy(self)
        twin._fresh()
        return twin

    def reset(self, max_len: int, keep: int = 0, tree_slots: int = 256) -> int:
        need = max_len + tree_slots
        if self.cache is None:
            cfg = self.head.config
            head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
            kv_heads = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
            self.cache = StaticKVCache(1, kv_heads, head_dim, need, self.lm_weight.dtype, self.lm_weight.device)
        elif self.cache.max_len < need:
            self.cache = self.cache.grown(need)
        # pair t holds (f_t, x_{t+1}): it stays valid while both tokens are unchanged. Positions before `keep` stay,
        # holes among them too (a hole's slot: the first pair after it)
        keep = min(keep, self.cache.length + sum(size for _, size in self._holes))
        holes, skipped = [], 0
        for slot, size in self._holes:
            if slot + skipped >= keep:
                break
            holes.append((slot, min(size, keep - slot - skipped)))
            skipped += holes[-1][1]
        self.cache.truncate(keep - skipped)
        self._queued, self.queued_rows, self._holes, self._dropped = [], 0, holes, 0
        return keep

    def max_tree_nodes(self, tree: TreeConfig) -> int:
        return 1 + tree.total_tokens

    def _target_ids(self, ids: torch.Tensor) -> torch.Tensor:
        return ids if self.head.d2t is None else self.head.d2t[ids]

    def fixed_shape(self) -> FixedShape:
        """The static step drafts this head's tree by the same growth as `propose`, its shapes fixed
        (eagle_static.py)."""
        return FixedShape(partial(StaticDraft, self.target, self.head))

    def sit_out(self, inp: DraftInput) -> bool:
        """Another drafter proposed this step (a lookup chain, a plain step): keep its features for the next
        `propose`, at most `catch_up_window` rows of them."""
        self._queued.append(inp.hidden)
        self.queued_rows += inp.hidden.shape[0]
        window = None if self.keep_features else self.catch_up_window
        while window is not None and self.queued_rows > window:
            first = self._queued.pop(0)
            drop = min(self.queued_rows - window, first.shape[0])
            if drop < first.shape[0]:
                self._queued.insert(0, first[drop:])
            self._dropped += drop
            self.queued_rows -= drop
        return True

    def _logits(self, h: torch.Tensor) -> torch.Tensor:
        """h: [R, H] predicted features -> the head's logits over its vocabulary [R, V_draft] (float32)."""
        h = self.head.logit_features(h)                      # an EAGLE-3 head's own final norm, else h
        return few_rows_product(h, self.lm_weight, self.lm_grid).float()

    def _keep(self, n: int, features: torch.Tensor) -> None:
        """Store the target's features of positions n.. (rows of the head's pairs) for later probes."""
        need = n + features.shape[0]
        if self._features is None or self._features.shape[0] < need or self._features.shape[1] != features.shape[1]:
            grown = features.new_empty(max(need, 2 * (0 if self._features is None else self._features.shape[0]),
                                           1024), features.shape[1])
            if self._features is not None and self._features.shape[1] == features.shape[1]:
                grown[:n] = self._features[:n]
            self._features = grown
        self._features[n:need] = features

    def propose(self, inp: DraftInput, tree: TreeConfig, probe: tuple[int, list[int]] | None = None) -> DraftTree:
        """probe: (start, chain), a guess of the tokens after the root copied from tokens[start:] (a prompt-lookup
        match: tokens[start - 1] is an earlier occurrence of the root), with keep_features on. The head then also
        reads the chain in the same forward as its catch-up, each token paired with the target's feature at the
        position it was copied from (the features here are not known yet; those of the copied context stand in),
        and `probe_top` becomes the head's greedy token after the root, then after each chain token: where the
        head would take the chain, and what it would say where it leaves it. Approximate, as it only decides what
        to propose."""
        return propose_together([self.proposal(inp, tree, probe)])[0]

    def _caught_up(self, inp: DraftInput) -> tuple[DraftInput, int, int]:
        """(inp with the features of the steps it sat out before its own, the m features it brings, the position
        of the first: the n real pairs already in the draft cache and the positions its holes skip)."""
        if self._queued:
            inp = DraftInput(inp.tokens, torch.cat(self._queued + [inp.hidden]), inp.sampling, inp.generator)
            self._queued, self.queued_rows = [], 0
        if self._dropped:
            self._holes.append((self.cache.length, self._dropped))
            self._dropped = 0
        m, n = inp.hidden.shape[0], self.cache.length + sum(size for _, size in self._holes)
        if n + m + 1 != len(inp.tokens):
            raise RuntimeError(f"draft cache holds {n} pairs, but {len(inp.tokens)} tokens arrived "
                               f"with {m} new features")
        if self.keep_features:
            self._keep(n, inp.hidden)
        return inp, m, n

    def proposal(self, inp: DraftInput, tree: TreeConfig, probe: tuple[int, list[int]] | None = None,
                 first_min_prob: float | None = None) -> Proposal:
        """`propose` step by step (decoding.drafter.Proposal): it yields each head forward it needs as a `HeadCall`,
        so that drafters of several sequences sharing a head run each forward once for all of them.
        first_min_prob: a top-1 chain's floor for its first token (its forward is run anyway), below tree.min_prob."""
        inp, m, n = self._caught_up(inp)
        cache, embed = self.cache, self.target.embed_tokens
        dev = inp.hidden.device
        # 1. Catch up on the real features: pair (f_t, x_{t+1}) sits at x_t's position t.
        features, next_tokens = inp.hidden, inp.tokens[-m:]
        start, chain = probe if probe is not None and self.keep_features else (0, [])
        if chain:    # pair (f_{start-1+j}, chain[j]) at the root's position + j
            features = torch.cat([features, self._features[start - 1:start - 1 + len(chain)]])
            next_tokens = next_tokens + chain
        embeds = embed(torch.tensor(next_tokens, device=dev))
        t = m + len(chain)
        h, logits = yield HeadCall(self, features, embeds, torch.arange(n, n + t, device=dev),
                                   torch.ones(t, t, dtype=torch.bool, device=dev).tril_(), m - 1)
        cache.commit(m)                                      # the chain's slots are overwritten by the tree's
        real = cache.length                                  # the slots of the real pairs
        # h, logits: the root's, then (probe) each chain token's (the rows before only wrote keys and values)
        self.probe_top = self._target_ids(logits.argmax(-1)).tolist() if chain else []   # len(chain) + 1
        h, root_logits = h[:1], logits[:1]
        n += m                                               # = the root's position
        # 2. The tree: each expansion reads the frontier's parents' predicted features and the frontier's tokens,
        # at the next position, each node seeing its own ancestors among the tree nodes written so far.
        sampling = inp.sampling if self.draft_sampling == "q" and not inp.sampling.greedy else None
        grow = grow_tree_steps(inp.root, root_logits, tree, sampling, inp.generator, self.head.d2t,
                               self.target.vocab_size, first_min_prob)
        written, last, depth = torch.zeros(0, 0, dtype=torch.bool, device=dev), 0, 0
        try:
            request = next(grow)
            while True:
                parent_row, tokens = request                 # expand the frontier: its parents' rows, its tokens
                r = parent_row.numel()
                parent_vis = (written[last + parent_row] if depth
                              else torch.zeros(r, 0, dtype=torch.bool, device=dev))        # r W
                vis = torch.cat([parent_vis, torch.eye(r, dtype=torch.bool, device=dev)], dim=1)  # r W+r
                depth += 1
                h, logits = yield HeadCall(self, h[parent_row], embed(tokens),
                                           torch.full((r,), n + depth - 1, device=dev), vis, 0)   # r H, r V_draft
                cache.commit(r)
                last = written.shape[0]
                written = torch.cat([torch.nn.functional.pad(written, (0, r)), vis], dim=0)   # W+r W+r
                request = grow.send(logits)
        except StopIteration as grown:
            return grown.value
        finally:
            cache.truncate(real)                             # drop the tree nodes; the real pairs stay


@dataclass
class HeadCall:
    """One head forward a proposal asks for (`EagleDrafter.proposal`): `DraftHead.step`'s inputs over the drafter's
    cache (hidden, embeds: [t, H]; positions [t]; visible [t, S]). Its answer: the predicted features of rows
    logits_from.. [t - logits_from, H] and the head's logits of them; the rows before (a catch-up's accepted
    tokens before the root) only write their keys and values (`DraftHead.step`'s skip)."""

    drafter: EagleDrafter
    hidden: torch.Tensor
    embeds: torch.Tensor
    positions: torch.Tensor
    visible: torch.Tensor
    logits_from: int

    @staticmethod
    def answer_all(calls: list[HeadCall]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Answer calls of several sequences: those over one head (and target) and of one input width (a catch-up
        reads the target's features, a tree step the head's own) run as packed head forwards (`step_packed`) and
        one logits product."""
        groups: dict[tuple, list[int]] = {}
        for i, call in enumerate(calls):
            groups.setdefault((id(call.drafter.head), id(call.drafter.target), call.hidden.shape[-1]), []).append(i)
        answers: list = [None] * len(calls)
        for ids in groups.values():
            group = [calls[i] for i in ids]
            drafter = group[0].drafter
            read = drafter.head.step_packed([(c.hidden, c.embeds, c.drafter.cache, c.positions, c.visible,
                                              c.logits_from) for c in group])
            rows = read[0] if len(read) == 1 else torch.cat(read)
            # the draft vocabulary's product in pieces of rows its grid codes take, as each call's own would be
            logits = (drafter._logits(rows) if rows.shape[0] <= MAX_GRID_ROWS
                      else torch.cat([drafter._logits(part) for part in rows.split(MAX_GRID_ROWS)]))
            logits = [logits] if len(read) == 1 else logits.split([x.shape[0] for x in read])
            for i, out, lg in zip(ids, read, logits):
                answers[i] = (out, lg)
        return answers
