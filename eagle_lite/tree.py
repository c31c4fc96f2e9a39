"""Draft trees: the nodes a drafter proposes, their ancestor mask, and the EAGLE-2 rerank.

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
    what the controller calibrates against what the target accepts (decoding/controller.py).
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


def rerank(scores: torch.Tensor, parents: torch.Tensor, budget: int) -> tuple[torch.Tensor, list[int]]:
    """EAGLE-2's rerank: keep the `budget` drafted nodes of highest cumulative log-probability.

    scores: [M] cumulative log-prob of each candidate; parents: [M] index of each candidate's parent
    candidate, -1 for the root's children. Candidates must be listed parents-first. Because a child's
    score never exceeds its parent's, and a stable sort keeps parents ahead of equal-scored children,
    the kept set is always a connected tree.
    Returns (kept candidate indices in topological order [K], parent of each kept node as a tree index
    where 0 is the root and kept node j is tree node j + 1).
    """
    scores = scores.nan_to_num(nan=-math.inf)   # a broken draft's NaN would sort anywhere (its tree stays exact)
    order = torch.sort(scores, descending=True, stable=True).indices[:budget]
    kept = torch.sort(order).values  # candidate order is topological, so sorting indices keeps it
    kept_list, parent_of = kept.tolist(), parents.tolist()
    slot = {c: j + 1 for j, c in enumerate(kept_list)}
    tree_parents = [0 if parent_of[c] < 0 else slot[parent_of[c]] for c in kept_list]
    return kept, tree_parents
