"""Lookahead decoding (Fu et al., 2024): Jacobi iteration over a window of future positions, a pool of the n-grams
its trajectories produce, and candidate n-grams from the pool verified in the same target forward.

One step is one DraftTree: the root, the candidates (a trie of the latest G pool n-grams that start with the root's
token), then the window (N - 1 levels of W tokens, level j column i at depth i + 1 + j). `observe` moves the window
up a level and pools the N-grams its columns completed; `reset(keep > 0)` keeps pool and window. Exact whatever the
pool holds (the tree is chosen deterministically). docs/methods.md, "lookahead's window and pool", has the details.
"""
from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ..config import TreeConfig, option
from ..decoding.drafter import Drafter, DraftInput
from ..tree import DraftTree

LEAST = {"window": 0, "ngram": 2, "candidates": 0}


def check_sizes(window: int, ngram: int, candidates: int) -> None:
    """Refuse sizes no lookahead drafter can take: ValueError naming the flag."""
    for name, value in (("window", window), ("ngram", ngram), ("candidates", candidates)):
        if isinstance(value, bool) or not isinstance(value, int) or value < LEAST[name]:
            raise ValueError(f"lookahead {name} (--lookahead-{name}) must be an integer >= {LEAST[name]}, "
                             f"got {value!r}")


class NgramPool:
    """The latest `per_key` distinct n-grams seen for each first token; an n-gram seen again becomes the latest."""

    def __init__(self, per_key: int) -> None:
        self.per_key = per_key
        self._tails: dict[int, dict[tuple[int, ...], None]] = {}   # first token -> tails, oldest first

    def add(self, ngram: Sequence[int]) -> None:
        if self.per_key == 0:
            return
        tails = self._tails.setdefault(ngram[0], {})
        tail = tuple(ngram[1:])
        tails.pop(tail, None)
        tails[tail] = None
        if len(tails) > self.per_key:
            del tails[next(iter(tails))]

    def latest(self, token: int, k: int) -> list[tuple[int, ...]]:
        """Up to k tails of the n-grams that start with `token`, latest first."""
        tails = self._tails.get(token)
        return list(reversed(tails))[:k] if tails else []

    def clear(self) -> None:
        self._tails.clear()

    def __len__(self) -> int:
        return sum(len(t) for t in self._tails.values())


class LookaheadDrafter(Drafter):
    name = "lookahead"

    def __init__(self, window: int = 1, ngram: int = 3, candidates: int = 2, seed: int = 0) -> None:
        """window (W): Jacobi streams, each one verify row per level; ngram (N): the length of the n-grams collected
        and verified (the window has N - 1 levels); candidates (G): pool n-grams verified per step. A step verifies
        at most 1 + (W + G) * (N - 1) nodes. W = 0: no window (the pool holds the text's n-grams alone); N = 2:
        plain Jacobi decoding of W tokens, with 2-grams verified beside it. seed: the window's first tokens, drawn
        from the prompt."""
        check_sizes(window, ngram, candidates)
        self.window, self.ngram, self.candidates = window, ngram, candidates
        self.pool = NgramPool(candidates)
        self.levels: list[list[int]] = []   # the window, level 0 first
        self._text: list[int] = []           # the text whose n-grams are in the pool
        self.seed = seed
        self._rng = random.Random(seed)

    def reset(self, max_len: int, keep: int = 0) -> int:
        if keep == 0:
            self.pool.clear()
            self.levels, self._text = [], []
            self._rng = random.Random(self.seed)
        return keep

    def max_tree_nodes(self, tree: TreeConfig) -> int:
        return 1 + (self.window + self.candidates) * (self.ngram - 1)

    def _index(self, tokens: list[int]) -> None:
        """Pool the N-grams of `tokens` that the pool does not hold yet (those past the text indexed before)."""
        done = len(self._text)
        if tokens[:done] != self._text:           # not an extension (an edited turn): from where they part
            done = next((i for i, (a, b) in enumerate(zip(tokens, self._text)) if a != b), len(tokens))
            del self._text[done:]
        self._text += tokens[done:]
        n = self.ngram
        for start in range(max(0, done - n + 1), len(tokens) - n + 1):
            self.pool.add(tokens[start:start + n])

    def propose(self, inp: DraftInput, tree: TreeConfig) -> DraftTree:
        self._index(inp.tokens)
        if self.window and not self.levels:       # the first step: level 0 drawn from the prompt
            self.levels = [[self._rng.choice(inp.tokens) for _ in range(self.window)]]
        tokens, parents = [inp.root], [-1]
        # the verification branch: the candidates' trie under the root, so that their children are distinct tokens
        child: dict[tuple[int, int], int] = {}
        for tail in self.pool.latest(inp.root, self.candidates):
            node = 0
            for token in tail:
                if (node, token) not in child:
                    tokens.append(token)
                    parents.append(node)
                    child[(node, token)] = len(tokens) - 1
                node = child[(node, token)]
        likely = list(range(len(tokens)))[:self.ngram]    # the latest candidate: root, then its tail's nodes
        # the lookahead branch: level 0 a chain under the root, each higher level under the level below
        rows: list[list[int]] = []
        for j, level in enumerate(self.levels):
            row: list[int] = []
            for i, token in enumerate(level):
                tokens.append(token)
                parents.append(rows[j - 1][i] if j else (row[i - 1] if i else 0))
                row.append(len(tokens) - 1)
            rows.append(row)
        # likely: the walk's probable reads are the latest candidate's, never the window's (lm_head rows cost)
        return DraftTree(torch.tensor(tokens, device=inp.hidden.device), parents, probes=rows[-1] if rows else [],
                         likely=likely)

    def observe(self, tree: DraftTree, nodes, path: list[int] | None = None) -> None:
        """The target's greedy tokens at the top level continue the window's columns (see the module's doc)."""
        if not tree.probes:
            return
        new = [nodes.top_token(i) for i in tree.probes]
        if len(self.levels) < self.ngram - 1:     # still filling
            self.levels.append(new)
            return
        for column in zip(*self.levels, new):
            self.pool.add(column)
        self.levels = self.levels[1:] + [new]


@dataclass(frozen=True)
class LookaheadOptions:
    """window (W): Jacobi streams; ngram (N): n-gram length (the window has N - 1 levels); candidates (G): pool
    n-grams verified per step. A step verifies at most 1 + (W + G) * (N - 1) nodes. The defaults suit a CPU, where
    each verified row costs a good fraction of a one-token forward: wider windows find more n-grams but pay only
    where extra rows are nearly free (a GPU)."""

    window: int = option(1, "lookahead-window", "Jacobi window width, W verify rows per level; 0: no window",
                         type=int, metavar="W")
    ngram: int = option(3, "lookahead-ngram", "n-gram length, >= 2 (the window has N - 1 levels)", type=int,
                        metavar="N")
    candidates: int = option(2, "lookahead-candidates", "pool n-grams verified per step", type=int, metavar="G")


def build_lookahead(target, o: LookaheadOptions) -> LookaheadDrafter:
    return LookaheadDrafter(o.window, o.ngram, o.candidates)


def check_lookahead(o: LookaheadOptions) -> None:
    check_sizes(o.window, o.ngram, o.candidates)
