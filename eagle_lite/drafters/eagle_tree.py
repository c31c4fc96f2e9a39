"""EAGLE-2's dynamic tree from a draft's logits: the root's children, then the best frontier's expansions, then the
rerank (`grow_tree_steps`). One growth for both steps: the engine's drafter (drafters/eagle.py) runs it as it is, and
the fixed-shape step (drafters/eagle_static.py, decoding/static/) runs it with its shapes fixed (`FixedGrowth`).

Greedy trees rank children by path log-probability; sampled ones ("q", drafters/eagle.py) draw them from the
draft's q and rank them by values fixed before each draw (`sampled_values`).
"""
from __future__ import annotations

import math
from collections.abc import Callable, Generator

import torch

from ..config import SamplingConfig, TreeConfig
from ..decoding.accept import target_probs
from ..tree import (
    DraftTree,
    FixedGrowth,
    FixedTree,
    Growth,
    SampledRows,
    candidate_parents,
    log_floor,
    rerank,
    top_children,
)


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
                        size: int | None = None, fixed: FixedGrowth | None = None
                        ) -> Generator[tuple[torch.Tensor, torch.Tensor], torch.Tensor, DraftTree | FixedTree]:
    """`grow_tree_steps` for any top_k: the frontier's expansions through `tree.Growth`, then the rerank.

    fixed: grow in fixed shapes (`tree.FixedGrowth`: the fixed-shape step's, read where it lies): every level is
    expanded (exactly depth - 1 expansions), the rerank keeps exactly total_tokens, min_prob marks nodes invalid
    instead of dropping them, nothing is read back from the device, and the result, a `tree.FixedTree` of the kept
    nodes (root not included; `root` is not read), is the answer to the last expansion's logits: the generator's
    last yield, not its return value, which torch.compile cannot trace. Greedy (top-k) trees only: the fixed-shape
    step samples by matching the target's draws."""
    k, dev = tree.top_k, root_logits.device
    sampled = sampling is not None
    if fixed is not None and sampled:
        raise ValueError("a growth in fixed shapes drafts the top-k tree; sampled children need the engine's step")
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
    if fixed is None:
        first, parent_row = torch.arange(valid + 1, device=dev), torch.zeros(valid, dtype=torch.long, device=dev)
    else:
        first, parent_row = fixed.first, fixed.root_rows        # the root's children read the root's row
    growth = Growth(values[0], cum[0], tokens[0], first)
    floor = log_floor(tree.min_prob)
    for level in range(1, tree.depth):
        if level > 1:
            parent_row = growth.follow(_sampled_frontier(growth.values[-1], k)) if sampled else growth.choose(k)
        front = growth.front_cum
        if fixed is None and (front.numel() == 0 or (tree.min_prob > 0 and float(front.max()) < floor)):
            break                                            # nothing left worth expanding
        logits = yield parent_row, growth.front_tokens
        if sampled:
            growth.add(*drawn(logits, front))
        else:
            growth.add_top(*top_children(logits, k, vocab))
    values = torch.cat(growth.values)
    if fixed is not None:
        kept, parents = rerank(values, growth.parents(fixed.parent_of), tree.total_tokens, fixed.no_slot,
                               fixed.tree_nodes)
        yield FixedTree(torch.cat(growth.tokens)[kept], parents, fixed.level_of[kept], values[kept] >= floor)
        return None
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
