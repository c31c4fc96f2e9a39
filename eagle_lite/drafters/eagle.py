"""EAGLE-2 drafting: the draft head grows a dynamic tree by cumulative log-probability, then reranks it
(optionally keeping only nodes whose path probability reaches `TreeConfig.min_prob`). A prompt-lookup path is
grafted on by composing it with `LookupGraft` (lookup_graft.py); a parallel head drafts in eagle_lite_wing/parallel.py.

Sampling has two exact rules, `draft_sampling`: "match" (the head's top-k tree; acceptance follows the child
carrying the target's draw) and "q" (children drawn from the head's q, accepted by sibling-wise recursive rejection;
the tree is ranked by values fixed before each draw). docs/methods.md, "EAGLE's two sampling rules", has why each
is exact; tests/test_eagle_sampling.py checks both.
"""
from __future__ import annotations

import copy
import math
from collections.abc import Callable, Generator
from dataclasses import dataclass

import torch

from ..config import DRAFT_SAMPLING, SamplingConfig, TreeConfig
from ..decoding.accept import target_probs
from ..decoding.drafter import Drafter, DraftInput, FixedShape, Proposal, propose_together
from ..heads.draft import DraftHead
from ..kernels import MAX_GRID_ROWS, accelerate_head, draft_vocab_grid, few_rows_product
from ..kv_cache import StaticKVCache
from ..tree import DraftTree, Growth, SampledRows, candidate_parents, log_floor, rerank, top_children


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
        """The static step drafts this head's tree as `propose` does (decoding/static/)."""
        return FixedShape(self.head)

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


def _draw(logits: torch.Tensor, k: int, sampling: SamplingConfig,
          generator: torch.Generator | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """logits: [R, V_draft] -> (q [R, V_draft]: the draft's sampling distribution, temperature / top-k / top-p
    applied as to the target's; p [R, k]: the q of each token drawn; ids [R, k]: k tokens drawn from each row
    without replacement, in draw order). One token (k = 1, the CPU tree): the inverse of q's CDF at a uniform draw,
    as accept.sample. Several: Gumbel-top-k, the order of log q - log E (E ~ Exp(1), i.e. log q plus Gumbel noise)
    being that of successive draws, each from q with the earlier ones removed. Where q has fewer than k possible
    tokens, the slots past them hold no draw (p = 0). Uniforms are float64: no token's share is lost to rounding."""
    q = target_probs(logits, sampling)                       # R V_draft
    u = torch.rand(q.shape[0], 1 if k == 1 else q.shape[1], generator=generator, dtype=torch.float64,
                   device=q.device)
    if k == 1:
        cdf = q.double().cumsum(-1)                          # R V_draft
        ids = torch.searchsorted(cdf, u * cdf[:, -1:], right=True)      # R 1: the first token whose CDF exceeds u
        last = q.shape[1] - 1 - (q.flip(-1) > 0).int().argmax(-1, keepdim=True)   # u rounded onto the total
        ids = torch.minimum(ids, last)
        return q, q.gather(-1, ids), ids
    noise = u.neg_().log1p_().neg_().log_()                  # log E, E = -log(1 - u) ~ Exp(1)
    keys, ids = (q.double().log() - noise).topk(min(k, q.shape[-1]), dim=-1)
    p = q.gather(-1, ids).masked_fill_(keys == -math.inf, 0.0)
    return q, p, ids


def sampled_values(parent_cum: torch.Tensor, p: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """parent_cum [R] (log path probabilities), p [R, k] (the q of each child drawn, in draw order) -> (values,
    cum) [R, k]. Child i's value: its parent's path probability times the mass not drawn before it, 1 - sum of p
    over siblings 0..i-1: it depends on the parent and the earlier siblings, never on the child's own token, and
    it never exceeds the parent's value nor an earlier sibling's (the rerank keeps a connected tree whose siblings
    are a prefix of the draw order). A child's cum is its parent's times its own q, capped at its value; -inf for
    slots that hold no draw."""
    drawn_before = torch.nn.functional.pad(p.cumsum(-1)[:, :-1], (1, 0))   # exclusive: monotone as floats too
    values = parent_cum[:, None] + (1.0 - drawn_before).clamp_min(1e-30).log()
    values = values.masked_fill(p <= 0, -math.inf)
    cum = torch.minimum(parent_cum[:, None] + p.log(), values)
    return values, cum


def grow_tree(root: int, root_logits: torch.Tensor, expand: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
              tree: TreeConfig, sampling: SamplingConfig | None = None, generator: torch.Generator | None = None,
              vocab: torch.Tensor | None = None, size: int | None = None) -> DraftTree:
    """`grow_tree_steps` with each expansion answered by `expand`."""
    steps = grow_tree_steps(root, root_logits, tree, sampling, generator, vocab, size)
    try:
        request = next(steps)
        while True:
            request = steps.send(expand(*request))
    except StopIteration as grown:
        return grown.value


def grow_tree_steps(root: int, root_logits: torch.Tensor, tree: TreeConfig, sampling: SamplingConfig | None = None,
                    generator: torch.Generator | None = None, vocab: torch.Tensor | None = None,
                    size: int | None = None, first_min_prob: float | None = None
                    ) -> Generator[tuple[torch.Tensor, torch.Tensor], torch.Tensor, DraftTree]:
    """EAGLE-2's dynamic tree from a draft's logits: the root's children, then `depth - 1` expansions of the best
    frontier, then the rerank to `total_tokens` (and `min_prob`), grown through `tree.Growth` as the static step
    grows its own.

    root_logits: [1, V_draft] the draft's logits after the root. Each expansion yields (parent_row [r], tokens [r])
    and is sent [r, V_draft]: the draft's logits after each frontier node, given its parent's row in the previous
    expansion's output (the root's: 0) and its own token (`grow_tree`: an `expand` function answers). vocab:
    [V_draft] the target id of each draft token (None: the same ids); size: the target's vocabulary size (sampled
    trees); first_min_prob: a greedy top-1 chain's floor for its first token (`greedy_chain_steps`).
    sampling None: each node's k likeliest children (`top_children`), ranked by path log-probability. Else children
    are drawn from q = target_probs(logits, sampling) and ranked by value (`sampled_values`); the tree carries
    `SampledRows`. Expansion stops early where no frontier node reaches min_prob, and the rerank keeps only the
    nodes that do."""
    k, sampled = tree.top_k, sampling is not None
    if k == 1 and not sampled:
        return (yield from greedy_chain_steps(root, root_logits, tree, vocab, first_min_prob))
    if k == 1:
        return (yield from sampled_chain_steps(root, root_logits, tree, sampling, generator, vocab, size))
    return (yield from expanded_tree_steps(root, root_logits, tree, sampling, generator, vocab, size))


def expanded_tree_steps(root: int, root_logits: torch.Tensor, tree: TreeConfig, sampling: SamplingConfig | None = None,
                        generator: torch.Generator | None = None, vocab: torch.Tensor | None = None,
                        size: int | None = None
                        ) -> Generator[tuple[torch.Tensor, torch.Tensor], torch.Tensor, DraftTree]:
    """`grow_tree_steps` for any top_k: the frontier's expansions through `tree.Growth`, then the rerank."""
    k, dev = tree.top_k, root_logits.device
    sampled = sampling is not None
    dists: list[torch.Tensor] = []                           # sampled: the q of each expanded node, root first

    def drawn(logits: torch.Tensor, parent_cum: torch.Tensor):
        q, p, ids = _draw(logits, k, sampling, generator)
        dists.append(q)
        values, cum = sampled_values(parent_cum, p)
        return values, cum, ids if vocab is None else vocab[ids]

    if sampled:
        values, cum, tokens = drawn(root_logits, torch.zeros(1, device=dev))     # 1 k
        valid = int((values[0] > -math.inf).sum())
    else:
        values, tokens = top_children(root_logits, k, vocab)
        cum, valid = values, values.shape[1]
    growth = Growth(values[0], cum[0], tokens[0], torch.arange(valid + 1, device=dev))
    parent_row = torch.zeros(valid, dtype=torch.long, device=dev)   # the root's children read the root's row
    floor = log_floor(tree.min_prob)
    for level in range(1, tree.depth):
        if level > 1:
            parent_row = growth.follow(_sampled_frontier(growth.values[-1], k)) if sampled else growth.choose(k)
        front = growth.front_cum
        if front.numel() == 0 or (tree.min_prob > 0 and float(front.max()) < floor):
            break                                            # nothing left worth expanding
        logits = yield parent_row, growth.front_tokens
        if sampled:
            growth.add(*drawn(logits, front))
        else:
            growth.add_top(*top_children(logits, k, vocab))
    values = torch.cat(growth.values)
    budget = tree.total_tokens if tree.min_prob <= 0 else min(tree.total_tokens, int((values >= floor).sum()))
    if sampled:
        budget = min(budget, int((values > -math.inf).sum()))     # never a slot that holds no draw
    parent_of = torch.tensor(candidate_parents(growth.levels), device=dev)   # sampled: each one's row in `dists`
    kept, parents = rerank(values, growth.parents(parent_of), budget)
    tokens = torch.cat([torch.tensor([root], device=dev), torch.cat(growth.tokens)[kept]])
    parents = [-1] + parents.tolist()
    scores = [0.0] + torch.cat(growth.cum)[kept].tolist()   # each kept node's path log-probability
    if not sampled:
        return DraftTree(tokens, parents, scores=scores)
    return DraftTree(tokens, parents, sampled_rows(torch.cat(dists), vocab, size, tokens.tolist(), parents,
                                                   [-1] + parent_of[kept].tolist()), scores=scores)


def _sampled_frontier(values: torch.Tensor, k: int) -> torch.Tensor:
    """A sampled level's next frontier: its k best candidates by value that hold a draw, in candidate order (equal
    values rank the earlier candidate first)."""
    best = torch.sort(values, descending=True, stable=True).indices[:k]
    return best[values[best] > -math.inf].sort().values


def greedy_chain_steps(root: int, root_logits: torch.Tensor, tree: TreeConfig, vocab: torch.Tensor | None = None,
                       first_min_prob: float | None = None
                       ) -> Generator[tuple[torch.Tensor, torch.Tensor], torch.Tensor, DraftTree]:
    """`grow_tree_steps` for a greedy tree of top_k 1 (the CPU's chains), in a few ops a depth: each depth's likeliest
    token while the path's log-probability stays at or above log(min_prob), at most min(depth, total_tokens) of
    them. The same tree as the top-k expansion and rerank keep (along a chain the path probability only falls, so
    the rerank keeps a prefix of it), without the expansions whose nodes the budget would drop. first_min_prob (None:
    min_prob): the first token's floor instead."""
    dev = root_logits.device
    floor = log_floor(tree.min_prob)
    first = floor if first_min_prob is None else log_floor(first_min_prob)
    length = min(tree.depth, tree.total_tokens)
    row = torch.zeros(1, dtype=torch.long, device=dev)   # the one frontier node's row in each expansion's output
    tokens: list[int] = []
    scores = [0.0]
    cum, logits = 0.0, root_logits
    while len(tokens) < length:
        best, top = top_children(logits[:1], 1, vocab)
        cum += float(best)
        if cum < (floor if tokens else first):
            break
        tokens.append(int(top))
        scores.append(cum)
        if len(tokens) < length:
            logits = yield row, torch.tensor(tokens[-1:], device=dev)
    chain = DraftTree.chain(torch.tensor([root] + tokens, device=dev))
    chain.scores = scores
    return chain


def sampled_chain_steps(root: int, root_logits: torch.Tensor, tree: TreeConfig, sampling: SamplingConfig,
                        generator: torch.Generator | None = None, vocab: torch.Tensor | None = None,
                        size: int | None = None
                        ) -> Generator[tuple[torch.Tensor, torch.Tensor], torch.Tensor, DraftTree]:
    """`grow_tree_steps` for a sampled tree of top_k 1 (the CPU's chains), in a few ops a depth: one token drawn from
    q after each node, the same draws and the same tree as the expansion and rerank give. Along a chain a node's
    value is its parent's path probability, so expansion stops after a node whose path falls below min_prob, every
    node drawn reaches it, and the rerank keeps the first total_tokens of them."""
    dev = root_logits.device
    floor = log_floor(tree.min_prob)
    row = torch.zeros(1, dtype=torch.long, device=dev)   # the one frontier node's row in each expansion's output
    dists, tokens, scores = [], [root], [0.0]
    cum, logits = torch.zeros(1, device=dev), root_logits
    while True:
        q, p, ids = _draw(logits, 1, sampling, generator)
        dists.append(q)
        cum = torch.minimum(cum + p[0].log(), cum)             # sampled_values' cum of the one child
        token = ids[0] if vocab is None else vocab[ids[0]]
        tokens.append(int(token))
        scores.append(float(cum))
        if len(tokens) > tree.depth or (tree.min_prob > 0 and float(cum) < floor):
            break
        logits = yield row, token
    kept = min(len(tokens) - 1, tree.total_tokens)
    tokens, scores = tokens[:kept + 1], scores[:kept + 1]
    parents = list(range(-1, kept))
    # node j was drawn from dists[j - 1], the q after its parent: its source row is its parent's index
    return DraftTree(torch.tensor(tokens, device=dev), parents,
                     sampled_rows(torch.cat(dists), vocab, size, tokens, parents, parents), scores=scores)


def sampled_rows(dists: torch.Tensor, vocab: torch.Tensor | None, size: int | None, tokens: list[int],
                 parents: list[int], source: list[int]) -> SampledRows:
    """A sampled tree's q_draft: node i's row is the q it was drawn from, less its earlier siblings (a kept
    node's earlier siblings are all kept: siblings are a prefix of the draw order)."""
    excluded: list[list[int]] = [[] for _ in tokens]
    drawn: dict[int, list[int]] = {}
    for i in range(1, len(tokens)):
        excluded[i] = list(drawn.setdefault(parents[i], []))
        drawn[parents[i]].append(tokens[i])
    return SampledRows(dists, vocab, size if size is not None else dists.shape[1], tokens, source, excluded)
