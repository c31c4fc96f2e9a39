"""The static step's draft tree in fixed shapes: bucket sizes, ancestors by gathers, and greedy acceptance as
tensor ops (static/step.py)."""
from __future__ import annotations

from dataclasses import dataclass, fields

import torch

# Tree sizes (root included) the verify step is built for: a tree pads to the next one.
BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128)


def bucket_for(nodes: int) -> int:
    """The smallest bucket holding a tree of `nodes` nodes (root included)."""
    for size in BUCKETS:
        if size >= nodes:
            return size
    raise ValueError(f"a tree of {nodes} nodes is larger than the static step's largest bucket ({BUCKETS[-1]}): "
                     f"lower total_tokens")


def tree_ancestors(parents: torch.Tensor, depth: int) -> torch.Tensor:
    """[N, N] bool, row i marking node i and its ancestors, for a tree given by `parents` [N] (the root, node 0,
    its own parent) of at most `depth` levels below the root: `depth` gathers up the parent pointers."""
    n = parents.numel()
    rows = torch.arange(n, device=parents.device)
    anc = torch.eye(n, dtype=torch.bool, device=parents.device)
    up = rows
    for _ in range(depth):
        up = parents[up]
        anc = anc.index_put((rows, up), torch.ones(n, dtype=torch.bool, device=parents.device))
    return anc


@dataclass
class StaticTree:
    """A draft tree padded to a bucket of B nodes: node 0 is the root. Padding nodes hang off the root, are not
    `valid` and so are never accepted; nothing valid attends to them."""

    tokens: torch.Tensor     # [B] long (node 0: the root)
    parents: torch.Tensor    # [B] long, the root's own parent is 0
    depths: torch.Tensor     # [B] long
    ancestors: torch.Tensor  # [B, B] bool, self included
    valid: torch.Tensor      # [B] bool

    @classmethod
    def empty(cls, size: int, device) -> StaticTree:
        """The root alone, padded to `size` nodes."""
        parents = torch.zeros(size, dtype=torch.long, device=device)
        nodes = torch.arange(size, device=device)
        return cls(torch.zeros(size, dtype=torch.long, device=device), parents, (nodes > 0).long(),
                   tree_ancestors(parents, 1), nodes == 0)

    @classmethod
    def build(cls, tokens: list[int], parents: list[int], size: int, device="cpu") -> StaticTree:
        """A tree given as the engine's DraftTree gives it (parents[0] == -1), padded to `size` nodes."""
        n, pad = len(tokens), size - len(tokens)
        p = torch.tensor([0] + list(parents[1:]) + [0] * pad, device=device)
        anc = tree_ancestors(p, n)
        return cls(torch.tensor(list(tokens) + [0] * pad, device=device), p, anc.sum(1) - 1, anc,
                   torch.arange(size, device=device) < n)

    def fill(self, other: StaticTree) -> None:
        """Copy `other` (same bucket) into these buffers (they stay where a captured graph reads them)."""
        for f in fields(self):
            getattr(self, f.name).copy_(getattr(other, f.name))


def accept_greedy(tree: StaticTree, top: torch.Tensor, depth: int, is_root: torch.Tensor | None = None,
                  levels: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Greedy acceptance in tensor ops. top: [B] the target's argmax at each node. depth: the tree's most levels
    below the root (D). Returns (path [D + 1]: the accepted nodes from the root, padded with 0; n: the tokens this
    step emits, accepted nodes plus the bonus, 0-d; bonus: the target's token after the path, 0-d).
    is_root ([B] bool, node 0) and levels (arange(D + 1)): where the caller keeps them on the device."""
    b = tree.tokens.numel()
    if is_root is None:
        is_root = torch.arange(b, device=top.device) == 0
    if levels is None:
        levels = torch.arange(depth + 1, device=top.device)
    match = ((tree.tokens == top[tree.parents]) & tree.valid) | is_root
    accepted = torch.le(tree.ancestors, match[None, :]).all(dim=1)      # every node on its path matches
    best = torch.where(accepted, tree.depths, -1).argmax().view(1)       # the deepest: ends the accepted path
    on_path = tree.ancestors.index_select(0, best) & (tree.depths[None, :] == levels[:, None])   # D+1 B
    path = on_path.byte().argmax(dim=1)                                  # the path's node at each level, else 0
    return path, tree.depths.index_select(0, best)[0] + 1, top.index_select(0, best)[0]
