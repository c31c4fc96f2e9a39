"""Medusa drafting (Cai et al. 2024): a static tree of the heads' top-k guesses, all from one target feature.

Alignment. DraftInput.hidden[-1] is f_t, the target's feature of the token just before the root;
the target chose the root x_{t+1} from it (its lm_head is the "zeroth head"). Medusa head k reads the
same f_t and guesses x_{t+k+2} (eagle_lite/heads/medusa.py), which sits at depth k + 1 of the tree (the root
is depth 0). So the heads never see the root or any drafted token: their guesses at every depth are
independent, and the tree may combine them freely.

The tree is given as Medusa "choices": paths of top-k ranks. The node of path (i_0, i_1, ..., i_d)
holds head d's i_d-th likeliest token, and its parent is the node of (i_0, ..., i_{d-1}) (the root for
a path of length 1). E.g. [[0], [1], [0, 0]]: head 0's top-2 under the root, and head 1's top-1 under
head 0's top-1. The choices must be prefix-closed (every path's parent path is listed too). Children
are chosen deterministically (q_draft=None), so greedy and sampled acceptance are both exact.
"""
from __future__ import annotations

import heapq
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ..config import TreeConfig, option
from ..decoding.drafter import Drafter, DraftInput
from ..heads.medusa import MedusaHeads
from ..tree import DraftTree

# 12 drafted nodes, depth <= 4: sized_choices(12, 4), written out. A CPU verify forward of ~13 tokens
# costs about as much as one token's; Medusa's GPU trees (63 nodes and more) are too wide here.
DEFAULT_CHOICES: list[list[int]] = [
    [0], [0, 0], [1], [0, 0, 0], [0, 1], [1, 0], [2], [0, 0, 0, 0], [0, 0, 1], [0, 1, 0], [1, 0, 0], [0, 2],
]

# A rough prior for ranking paths when no accuracies were measured: head d's top-1 is right with
# probability TOP1 * DEPTH_DECAY**d, and each lower rank RANK_DECAY times as often as the one above.
TOP1, DEPTH_DECAY, RANK_DECAY = 0.6, 0.9, 0.35


def path_score(path: tuple[int, ...]) -> float:
    """The prior probability that every node on `path` is right (rounded so equal products tie exactly)."""
    score = 1.0
    for d, rank in enumerate(path):
        score *= TOP1 * DEPTH_DECAY ** d * RANK_DECAY ** rank
    return round(score, 12)


def sized_choices(num_nodes: int, num_heads: int, max_rank: int = 16) -> list[list[int]]:
    """The `num_nodes` likeliest paths under the prior above, at most `num_heads` deep: a prefix-closed tree.

    Best-first: a path's next sibling and first child both score lower than it, so popping the best of
    them in turn lists paths in decreasing score, each parent before its children.
    """
    if num_nodes < 1 or num_heads < 1:
        raise ValueError(f"need num_nodes >= 1 and num_heads >= 1, got {num_nodes}, {num_heads}")
    heap = [(-path_score((0,)), 1, (0,))]
    out: list[list[int]] = []
    while heap and len(out) < num_nodes:
        _, _, path = heapq.heappop(heap)
        out.append(list(path))
        nxt = [path[:-1] + (path[-1] + 1,)] if path[-1] + 1 < max_rank else []
        nxt += [path + (0,)] if len(path) < num_heads else []
        for p in nxt:
            heapq.heappush(heap, (-path_score(p), len(p), p))
    return out


def parse_choices(text: str) -> list[list[int]]:
    """Medusa choices from JSON text ("[[0], [1], [0, 0]]") or from a .json file holding that list."""
    source = "--medusa-choices"
    if not text.lstrip().startswith("[") and Path(text).is_file():
        source, text = text, Path(text).read_text()
    try:
        choices = json.loads(text)
    except json.JSONDecodeError as err:
        raise ValueError(f"Medusa choices from {source} are not valid JSON ({err.msg} at column {err.colno}): "
                         f"give a list of rank paths like [[0], [1], [0, 0]]") from None
    return choices


def check_choices(choices, num_heads: int, vocab_size: int) -> list[tuple[int, ...]]:
    """Validate Medusa choices; returns them as tuples sorted by (depth, path): parents before children."""
    if not isinstance(choices, (list, tuple)) or not choices:
        raise ValueError(f"Medusa choices must be a non-empty list of rank paths like [[0], [1], [0, 0]], "
                         f"got {choices!r:.80}")
    paths: set[tuple[int, ...]] = set()
    for c in choices:
        if (not isinstance(c, (list, tuple)) or not c
                or any(isinstance(i, bool) or not isinstance(i, int) or i < 0 for i in c)):
            raise ValueError(f"Medusa choice {c!r} must be a non-empty list of ranks (ints >= 0)")
        path = tuple(c)
        if path in paths:
            raise ValueError(f"Medusa choice {list(path)} is listed twice: list each path once")
        if len(path) > num_heads:
            raise ValueError(f"Medusa choice {list(path)} is {len(path)} deep but the heads guess only "
                             f"{num_heads} positions: drop the deeper paths or train more heads")
        if max(path) >= vocab_size:
            raise ValueError(f"Medusa choice {list(path)} asks for rank {max(path)} of a {vocab_size}-token "
                             f"vocabulary: ranks must be < {vocab_size}")
        paths.add(path)
    for path in paths:
        if len(path) > 1 and path[:-1] not in paths:
            raise ValueError(f"Medusa choice {list(path)} has no parent {list(path[:-1])} in the choices: "
                             f"add it (choices must be prefix-closed)")
    return sorted(paths, key=lambda p: (len(p), p))


class MedusaDrafter(Drafter):
    """A static Medusa tree (root + one node per choice) from the heads' top-k at each depth.

    choices: rank paths (a list, or JSON text / a .json file, see `parse_choices`); None: the
    DEFAULT_CHOICES no deeper than the heads reach. The tree config of the call is not used: the
    choices fix the tree.
    """

    name = "medusa"

    def __init__(self, target, heads: MedusaHeads, choices: list[list[int]] | str | None = None) -> None:
        if isinstance(choices, str):
            choices = parse_choices(choices)
        if choices is None:
            choices = [c for c in DEFAULT_CHOICES if len(c) <= heads.num_heads]
        paths = check_choices(choices, heads.num_heads, target.vocab_size)
        self.target, self.heads = target, heads.eval()
        self.choices = [list(p) for p in paths]
        index = {(): 0}
        self.parents = [-1]
        for j, path in enumerate(paths, start=1):
            self.parents.append(index[path[:-1]])
            index[path] = j
        dev = target.device
        self.head_of = torch.tensor([len(p) - 1 for p in paths], device=dev)  # N-1: the head (depth - 1) of each node
        self.rank_of = torch.tensor([p[-1] for p in paths], device=dev)       # N-1: its rank in that head's top-k
        self.depth = max(len(p) for p in paths)
        self.width = max(p[-1] for p in paths) + 1

    def reset(self, max_len: int, keep: int = 0) -> int:
        return keep  # stateless: every round reads only the newest target feature

    def max_tree_nodes(self, tree: TreeConfig) -> int:
        return 1 + len(self.choices)

    def top_tokens(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden: [H] f_t -> [L, W] token ids: row d is head d's W likeliest guesses for x_{t+d+2}."""
        feats = self.heads(hidden, self.depth)                               # L H
        logits = self.heads.logits(feats.to(self.target.dtype), self.target.lm_head)   # L V
        return logits.topk(self.width, dim=-1).indices                      # L W

    def propose(self, inp: DraftInput, tree: TreeConfig) -> DraftTree:
        # hidden[-1] is f_t of the token before the root: the target chose the root from it, and head
        # d's guesses from it are for depth d + 1 below the root
        top = self.top_tokens(inp.hidden[-1])                                # L W
        drafted = top[self.head_of, self.rank_of]                           # N-1
        root = torch.tensor([inp.root], device=drafted.device)
        return DraftTree(torch.cat([root, drafted]), self.parents)


@dataclass(frozen=True)
class MedusaOptions:
    """heads: a folder written by `save_medusa`, "random" (untrained: exact but slow), or loaded MedusaHeads.
    choices: the tree as rank paths, JSON text or a .json file (None: DEFAULT_CHOICES)."""

    heads: Any = option(None, "medusa", "heads saved by `python -m trainers.train experiment=medusa`, or 'random'",
                        metavar="PATH")
    choices: Any = option(None, "medusa-choices", "the tree as rank paths, e.g. '[[0],[1],[0,0]]', or a .json file "
                          "(None: a 12-node tree)", metavar="JSON")


def build_medusa(target, o: MedusaOptions) -> MedusaDrafter:
    from ..formats import load_medusa

    heads = o.heads
    if isinstance(heads, (str, Path)):
        heads = MedusaHeads.for_target(target) if heads == "random" else load_medusa(heads, target)
    return MedusaDrafter(target, heads, o.choices)


def check_medusa(o: MedusaOptions) -> None:
    if o.heads is None:
        raise ValueError("method 'medusa' needs --medusa PATH (heads trained with `python -m trainers.train "
                         "experiment=medusa`) or --medusa random (untrained: exact but slow)")
    if isinstance(o.heads, (str, Path)) and o.heads != "random":
        from ..formats import check_folder

        check_folder(o.heads, "medusa")
    if isinstance(o.choices, str):
        parse_choices(o.choices)
