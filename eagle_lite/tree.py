"""Draft trees: the nodes a drafter proposes, their ancestor mask, and EAGLE-2's tree growth and rerank.

Node 0 is always the root: the last token already chosen (by the target) but not yet in its KV cache.
Every other node is a drafted guess; `parents[i] < i`, so nodes are in topological order and a
node's depth is its distance from the root (its position is prefix_len + depth).

A tree whose nodes were *sampled* carries `q_draft`: row i is the distribution node i was drawn from, which
sibling-wise rejection (accept.py) needs. A dense [N, V] tensor (a draft model's chain), or `SampledRows`, which
builds each row from the few distributions the nodes were drawn from when acceptance reads it.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch


def attention_mask(prefix_len: int, visible: torch.Tensor) -> torch.Tensor:
    """The 4-D boolean mask of T new tokens after a shared prefix of `prefix_len` cached tokens.

    visible: [T, S] bool (True: may attend) over the last S key slots, the T new tokens last (S >= T:
    the draft also attends to tree nodes written by earlier steps). Returns [1, 1, T, prefix_len + S]:
    the whole prefix is visible to every token, and past it each token sees what `visible` says.
    """
    t, s = visible.shape
    mask = torch.ones(1, 1, t, prefix_len + s, dtype=torch.bool, device=visible.device)
    mask[0, 0, :, prefix_len:] = visible
    return mask


def windowed(visible: torch.Tensor | None, length: int, positions: torch.Tensor, window: int) -> torch.Tensor | None:
    """A sliding-window layer's mask of T new tokens after `length` committed ones: `visible` [T, length + T] (None:
    a causal chain) with each row's keys more than window - 1 positions back hidden. positions [T]: each new token's
    position, which is also its key's (a committed slot's position is its index). Returns `visible` itself where no
    row reaches back past the window (None stays None)."""
    t = positions.numel()
    first = positions - (window - 1)                     # the oldest position each row sees
    if t == 0 or int(first.max()) <= 0:
        return visible
    if visible is None:
        visible = torch.ones(t, length + t, dtype=torch.bool, device=positions.device).tril_(length)
    keys = torch.cat([torch.arange(length, device=positions.device), positions])   # each key slot's position
    return visible & (keys[None, :] >= first[:, None])


def packed_mask(visible: list[torch.Tensor]) -> torch.Tensor:
    """The block-diagonal 4-D boolean mask of several sequences' blocks packed into one row (`Target.verify`).

    visible[i]: [n_i, S_i] bool, sequence i's mask over its own keys (`attention_mask(length_i, ancestors_i)[0, 0]`:
    its committed prefix, then its own new tokens). Returns [1, 1, sum n_i, sum S_i]: each block's rows see
    its own columns as `visible[i]` says and no other sequence's."""
    t, s = sum(v.shape[0] for v in visible), sum(v.shape[1] for v in visible)
    mask = torch.zeros(1, 1, t, s, dtype=torch.bool, device=visible[0].device)
    r = c = 0
    for v in visible:
        mask[0, 0, r:r + v.shape[0], c:c + v.shape[1]] = v
        r, c = r + v.shape[0], c + v.shape[1]
    return mask


def ancestor_mask(bits: list[int]) -> torch.Tensor:
    """[N, N] bool from each node's ancestors as the bits of an int (bit j of bits[i]: node j is an ancestor of i,
    or i itself): a few tensor ops for trees of up to 63 nodes (int64 rows), a row at a time past that."""
    n = len(bits)
    if n <= 63:
        return ((torch.tensor(bits)[:, None] >> torch.arange(n)) & 1).bool()
    return torch.tensor([[(b >> j) & 1 for j in range(n)] for b in bits], dtype=torch.bool)


@dataclass
class DraftTree:
    """probes: nodes whose target outputs the drafter reads back after the verify forward (`Drafter.observe`), e.g.
    lookahead's Jacobi window. They are verified and may be accepted like any other node: a node's context is its
    ancestors, so every node the target agrees with is a token it would have chosen.
    likely: the path (root first) acceptance will probably walk, where that is not the root then each first child
    (`likely_path`); lookahead names its latest candidate, never its window.
    scores: each node's path log-probability under the draft (root 0.0) where the drafter knows it (EAGLE heads):
    what the controller calibrates against what the target accepts (eagle_lite_wing/controller.py).
    plan: the controller's plan that chose this tree (`controller.Plan`), told what the step took (`Engine.step`)."""

    tokens: torch.Tensor                 # [N] token ids, node 0 = root
    parents: list[int]                   # parents[0] = -1
    q_draft: torch.Tensor | SampledRows | None = None  # row i: the distribution node i was *sampled* from;
    #                                                       None: every node chosen deterministically
    probes: list[int] = field(default_factory=list)
    likely: list[int] | None = None
    scores: list[float] | None = None
    plan: Any = None
    depths: torch.Tensor = field(init=False)     # [N]
    depth: int = field(init=False)               # the deepest node's depth (0: the root alone)
    ancestors: torch.Tensor = field(init=False)  # [N, N] bool, self included
    children: list[list[int]] = field(init=False)

    def __post_init__(self) -> None:
        n = self.tokens.numel()
        if len(self.parents) != n or self.parents[0] != -1:
            raise ValueError(f"a tree of {n} tokens needs {n} parents with parents[0] == -1, got {self.parents}")
        depth = [0] * n
        children: list[list[int]] = [[] for _ in range(n)]
        bits = [1] * n                                   # node i's ancestors (itself included) as bits of an int
        for i in range(1, n):
            p = self.parents[i]
            if not 0 <= p < i:
                raise ValueError(f"node {i} has parent {p}; parents must come before their children")
            depth[i] = depth[p] + 1
            children[p].append(i)
            bits[i] = bits[p] | (1 << i)
        if any(not 0 <= i < n for i in self.probes):
            raise ValueError(f"probes {self.probes} name nodes outside the tree's {n}")
        if self.scores is not None and len(self.scores) != n:
            raise ValueError(f"a tree of {n} tokens needs {n} scores, got {len(self.scores)}")
        if self.likely is not None and (self.likely[:1] != [0] or any(
                not 0 < c < n or self.parents[c] != p for p, c in zip(self.likely, self.likely[1:]))):
            raise ValueError(f"likely {self.likely} is not a path from the root of the tree")
        self.depths = torch.tensor(depth, device=self.tokens.device)
        self.depth = max(depth)
        self.ancestors = ancestor_mask(bits).to(self.tokens.device)
        self.children = children

    def __len__(self) -> int:
        return self.tokens.numel()

    def likely_path(self) -> list[int]:
        """Root, then each node's first child: the drafter's likeliest path where children come best first
        (EAGLE's top-k expansion and rerank keep that order); `likely` where the drafter gave it."""
        if self.likely is not None:
            return list(self.likely)
        path = [0]
        while self.children[path[-1]]:
            path.append(self.children[path[-1]][0])
        return path

    def truncated(self, n: int) -> DraftTree:
        """The first n nodes (a connected subtree: parents come first). Only for trees whose nodes were chosen
        deterministically and that carry no probes: which sampled nodes are kept must not depend on their draws,
        and a drafter reads its probes back."""
        if n >= len(self):
            return self
        if self.q_draft is not None or self.probes:
            raise ValueError("a sampled tree, or one with probes, is cut by its drafter's own budget")
        likely = self.likely_path()
        likely = likely[:next((i for i, node in enumerate(likely) if node >= n), len(likely))]
        return DraftTree(self.tokens[:n], self.parents[:n], likely=likely)

    @classmethod
    def chain(cls, tokens: torch.Tensor, q_draft: torch.Tensor | None = None) -> DraftTree:
        """A single path: root, then each token the child of the one before."""
        return cls(tokens, list(range(-1, tokens.numel() - 1)), q_draft)


class SampledRows:
    """q_draft of a tree whose nodes were drawn from a few distributions (an EAGLE head's, one per expanded node),
    each row built when acceptance reads it: [N, V] dense rows would cost N x 49k floats a step.

    dists: [P, V_d] the distributions drawn from, over the drafter's vocabulary; vocab: [V_d] the target id of each
    of its tokens (None: V_d is the target's vocabulary); size: the target's vocabulary size V. For node i:
    source[i] is the row of `dists` it was drawn from, and excluded[i] the target ids of the siblings drawn before it
    from that row (drawn without replacement: its row is dists[source[i]] with those removed, renormalized).
    source[i] = -1: a node chosen deterministically; its row is a point mass on its own token (tokens[i]), with
    which sibling-wise rejection accepts it with the target's (residual) probability of that token, exactly as
    sample-and-match would. The root's row (node 0) is never read.
    """

    def __init__(self, dists: torch.Tensor, vocab: torch.Tensor | None, size: int, tokens: list[int],
                 source: list[int], excluded: list[list[int]]) -> None:
        if not len(tokens) == len(source) == len(excluded):
            raise ValueError(f"{len(tokens)} nodes need as many sources and exclusions, got {len(source)}, "
                             f"{len(excluded)}")
        self.dists, self.vocab, self.size = dists, vocab, size
        self.tokens, self.source, self.excluded = tokens, source, excluded

    def __len__(self) -> int:
        return len(self.tokens)

    def __getitem__(self, node: int) -> torch.Tensor:
        row = torch.zeros(self.size, dtype=torch.float32, device=self.dists.device)
        src = self.source[node]
        if src < 0:
            row[self.tokens[node]] = 1.0
            return row
        if self.vocab is None:
            row[:self.dists.shape[1]] = self.dists[src]
        else:
            row[self.vocab] = self.dists[src].float()
        if self.excluded[node]:
            row[self.excluded[node]] = 0.0
            row /= row.sum()
        return row

    def with_chosen(self, tokens: list[int]) -> SampledRows:
        """These rows followed by deterministic nodes (point masses) of `tokens`."""
        return SampledRows(self.dists, self.vocab, self.size, self.tokens + list(tokens),
                           self.source + [-1] * len(tokens), self.excluded + [[] for _ in tokens])


def graft_chain(tree: DraftTree, chain: list[int]) -> DraftTree:
    """`tree` with the path root -> chain[0] -> chain[1] ... added: existing nodes are followed where their
    tokens match, new nodes are appended (in topological order) from the first token that differs.
    Children stay distinct tokens, so acceptance stays exact.

    A sampled tree (q_draft `SampledRows`) takes the new nodes as deterministic ones (point-mass rows), each the
    last child of its parent: acceptance tries it after the sampled siblings, and whether it is there depends on
    those earlier siblings alone (the chain's token is among them or not), so sibling-wise rejection stays exact.
    A dense q_draft is refused."""
    if tree.q_draft is not None and not isinstance(tree.q_draft, SampledRows):
        raise ValueError("graft_chain takes deterministic trees or SampledRows trees, not a dense q_draft")
    tokens, parents = tree.tokens.tolist(), list(tree.parents)
    node = 0
    for tok in chain:
        child = next((c for c in tree.children[node] if tokens[c] == tok), None) if node < len(tree) else None
        if child is None:
            tokens.append(tok)
            parents.append(node)
            child = len(tokens) - 1
        node = child
    if len(tokens) == len(tree):
        return tree
    q_draft = None if tree.q_draft is None else tree.q_draft.with_chosen(tokens[len(tree):])
    return DraftTree(torch.tensor(tokens, device=tree.tokens.device), parents, q_draft, probes=tree.probes,
                     likely=tree.likely)


# -- EAGLE-2's tree growth, in tensor ops ------------------------------------------------------------------
# Used by the one EAGLE tree growth (drafters/eagle_tree.py `expanded_tree_steps`), which the engine's drafter runs
# and the fixed-shape step runs with its shapes fixed (`FixedGrowth`, captured in a CUDA graph). Nothing below
# reads the device from the host or changes a shape with the data; what does (the engine's early stop under
# min_prob, its budget, its DraftTree) is the growth's, off when its shapes are fixed.

def log_floor(min_prob: float) -> float:
    """The path log-probability a node needs to be worth verifying under `TreeConfig.min_prob` (-inf: any)."""
    return math.log(min_prob) if min_prob > 0 else -math.inf


def top_children(logits: torch.Tensor, k: int, vocab: torch.Tensor | None = None
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [R, V_draft] -> (log-probabilities, target token ids) [R, min(k, V_draft)]: each row's likeliest
    next tokens, best first (k 1: one max, cheaper than a top-k on a CPU). vocab: [V_draft] the target id of each
    draft token (None: the same ids)."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    scores, ids = logp.max(dim=-1, keepdim=True) if k == 1 else logp.topk(min(k, logits.shape[-1]), dim=-1)
    return scores, ids if vocab is None else vocab[ids]


def candidate_parents(levels: list[tuple[int, int]]) -> list[int]:
    """Each candidate's parent as an index into the expanded nodes (the root first, then each frontier in order),
    for a growth of `levels` ((nodes expanded, children each) per level, `Growth.levels`). A sampled tree's
    candidate draws from its parent's distribution, the parent's index among the expanded nodes."""
    parents, first = [], 0
    for nodes, per in levels:
        parents += [first + i for i in range(nodes) for _ in range(per)]
        first += nodes
    return parents


class Growth:
    """The candidates of EAGLE-2's tree growth and the frontier the next expansion reads.

    Candidates are numbered from 1 in the order they are drafted (0: the root): the root's children, then each
    expansion's, a frontier node's children together, best first. Each has a value (what the frontier and the
    rerank rank by) and a path log-probability `cum` (what its children's values start from); for the top-k tree
    (`add_top`, `choose`) both are the cumulative log-probability. `levels` holds each level's shape, (nodes
    expanded, children each), from which the candidates' parents follow (`candidate_parents`).

    values, cum, tokens: [c] the root's children. first: [r + 1] arange, the numbers of the root and of the first
    frontier (the root's first r children), passed in so that a caller can keep it on the device."""

    def __init__(self, values: torch.Tensor, cum: torch.Tensor, tokens: torch.Tensor, first: torch.Tensor) -> None:
        r = first.numel() - 1
        self.values, self.cum, self.tokens = [values], [cum], [tokens]
        self.expanded = [first]             # the numbers of the nodes each level expands, the root (0) first
        self.levels = [(1, values.numel())]
        self.size = values.numel()          # candidates drafted
        self.front_cum, self.front_tokens = cum[:r], tokens[:r]

    def add(self, values: torch.Tensor, cum: torch.Tensor, tokens: torch.Tensor) -> None:
        """The frontier's children, [r, c] each: row i holds frontier node i's."""
        self.levels.append((values.shape[0], values.shape[1]))
        self.values.append(values.flatten())
        self.cum.append(cum.flatten())
        self.tokens.append(tokens.flatten())
        self.size += values.numel()

    def add_top(self, logp: torch.Tensor, tokens: torch.Tensor) -> None:
        """The frontier's children ranked by path log-probability: logp and tokens [r, c] (`top_children`), or [1, c]
        where every frontier node has the same children (a parallel head's level)."""
        values = self.front_cum[:, None] + logp
        self.add(values, values, tokens.expand_as(values))

    def choose(self, k: int) -> torch.Tensor:
        """The top-k tree's next frontier: the last level's k likeliest candidates (`follow`)."""
        last = self.values[-1]
        front_cum, best = last.topk(min(k, last.numel()))
        return self.follow(best, front_cum)

    def follow(self, best: torch.Tensor, front_cum: torch.Tensor | None = None) -> torch.Tensor:
        """Make the last level's candidates `best` (indices into it) the next frontier; front_cum: their cum where the
        caller has it. Returns each one's parent's row in the last expansion."""
        self.expanded.append(best + (self.size - self.values[-1].numel() + 1))
        self.front_cum = self.cum[-1][best] if front_cum is None else front_cum
        self.front_tokens = self.tokens[-1][best]
        return best // self.levels[-1][1]

    def parents(self, parent_of: torch.Tensor) -> torch.Tensor:
        """[size] each candidate's parent's number (0: the root); parent_of: `candidate_parents(self.levels)`."""
        return torch.cat(self.expanded)[parent_of]


@dataclass
class FixedGrowth:
    """A top-k growth in fixed shapes: every level expanded, the rerank to exactly `total_tokens`, min_prob a mask
    (`FixedTree.valid`) instead of a cut. What the growth reads that depends only on the tree's shape, built once on
    the device, so that a captured graph reads it where it lies and a step reads nothing back from the device.

    first: [k + 1] the numbers of the root and its children; root_rows: [k] zeros, each child's parent row (the
    root's); parent_of: [C] `candidate_parents` of the growth's levels; no_slot: [C + 1] zeros; tree_nodes: [n]
    arange(1, n + 1), n = the nodes kept; level_of: [C] each candidate's depth."""

    first: torch.Tensor
    root_rows: torch.Tensor
    parent_of: torch.Tensor
    no_slot: torch.Tensor
    tree_nodes: torch.Tensor
    level_of: torch.Tensor

    @classmethod
    def of(cls, tree, device) -> FixedGrowth:
        """The constants of `tree`'s (a TreeConfig) top-k growth, every frontier holding top_k nodes."""
        k = tree.top_k
        shape = [(1, k)] + [(k, k)] * (tree.depth - 1)                 # `Growth.levels`
        cands = sum(nodes * per for nodes, per in shape)
        long = dict(dtype=torch.long, device=device)
        return cls(first=torch.arange(k + 1, device=device), root_rows=torch.zeros(k, **long),
                   parent_of=torch.tensor(candidate_parents(shape), **long), no_slot=torch.zeros(cands + 1, **long),
                   tree_nodes=torch.arange(1, min(tree.total_tokens, cands) + 1, device=device),
                   level_of=torch.tensor([d + 1 for d, (nodes, per) in enumerate(shape) for _ in range(nodes * per)],
                                         **long))


@dataclass
class FixedTree:
    """What a growth in fixed shapes returns: the n kept nodes after the root, in topological order. tokens [n];
    parents [n] (tree indices, 0 the root, kept node j is node j + 1); depths [n]; valid [n] (False: below
    min_prob, verified but never accepted)."""

    tokens: torch.Tensor
    parents: torch.Tensor
    depths: torch.Tensor
    valid: torch.Tensor


def rerank(scores: torch.Tensor, parents: torch.Tensor, budget: int, slots: torch.Tensor | None = None,
           nodes: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """EAGLE-2's rerank: keep the `budget` drafted nodes of highest score (cumulative log-probability).

    scores: [M] each candidate's score; parents: [M] each candidate's parent's number (0: the root, candidate c:
    c + 1; `Growth.parents`). Candidates must be listed parents-first. Because a child's score never exceeds its
    parent's, and a stable sort keeps parents ahead of equal-scored children, the kept set is always a connected
    tree. Returns (kept candidate indices in topological order [K], the parent of each kept node as a tree index
    [K], where 0 is the root and kept node j is tree node j + 1). slots ([M + 1] long zeros) and nodes
    (arange(1, K + 1)): where the caller keeps them on the device.
    """
    scores = scores.nan_to_num(nan=-math.inf)   # a broken draft's NaN would sort anywhere (its tree stays exact)
    order = torch.sort(scores, descending=True, stable=True).indices[:budget]
    kept = torch.sort(order).values  # candidate order is topological, so sorting indices keeps it
    if slots is None:
        slots = torch.zeros(scores.numel() + 1, dtype=torch.long, device=scores.device)
    if nodes is None:
        nodes = torch.arange(1, kept.numel() + 1, device=scores.device)
    return kept, slots.index_copy(0, kept + 1, nodes)[parents[kept]]   # a candidate's number -> its tree node
