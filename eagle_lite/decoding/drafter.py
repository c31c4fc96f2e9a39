"""The drafter protocol: anything that proposes a tree of continuations for the target to verify."""
from __future__ import annotations

from collections.abc import Generator
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from ..config import SamplingConfig, TreeConfig
from ..tree import DraftTree


@dataclass
class DraftInput:
    """What the engine tells a drafter each round.

    tokens: the whole sequence so far (prompt + generated); the last one is the root of the next tree,
      chosen by the target but not yet in its KV cache.
    hidden: [m, H] the target's last hidden states of the m tokens it committed since the last round
      (the whole prompt after prefill); hidden[i] belongs to tokens[-m - 1 + i]. For a drafter with
      `feature_layers` (EAGLE-3 heads) the outputs of those decoder layers instead, [m, len * H].
    sampling, generator: how the target samples; a drafter that samples its tokens from q_draft
      (rather than choosing them deterministically) uses them and returns q_draft with the tree.
    """

    tokens: list[int]
    hidden: torch.Tensor
    sampling: SamplingConfig = SamplingConfig()
    generator: torch.Generator | None = None

    @property
    def root(self) -> int:
        return self.tokens[-1]


class Drafter(Protocol):
    """A drafter may also name `feature_layers`, the target's decoder layers it reads (EAGLE-3 heads): the engine
    then passes their outputs as `DraftInput.hidden` (`Target.forward`'s taps) instead of the last hidden state.
    It may also define `observe(tree, nodes, path)`: called after each acceptance with the tree it proposed, the
    target's logits of its nodes (`lm_head.NodeLogits`: `nodes.top_token(i)`, `nodes[i]`), the rows of
    `tree.probes` already projected, and the accepted path (root first); lookahead reads its Jacobi window's next
    tokens there, method auto what its plan (`tree.plan`, which the engine never reads) returned.
    Its class may define `seat(drafters, configs)`: told each step's batch (the drafters of that class and their
    sequences' GenerationConfigs) before any of them proposes (method auto: its controllers weigh the batch).
    It may also define `proposal(inp, tree)`: `propose` as a generator of the forwards it needs (`Proposal`), so that
    several sequences' drafters can propose together (`propose_together`: EAGLE heads, drafters/eagle.py).
    `fixed_shape`: whether the fixed-shape step (static_step.py) can run its steps in its place: plain decoding, or
    the tree of its `head` drafted as drafters/eagle.py drafts it (nothing grafted on); absent: it cannot."""

    name: str

    def reset(self, max_len: int, keep: int = 0) -> int:
        """Start a sequence of at most max_len tokens whose first `keep` tokens are those of the last one.

        Returns how many of those the drafter kept state for (<= keep); the engine re-reads the rest.
        """

    def max_tree_nodes(self, tree: TreeConfig) -> int:
        """The most nodes (root included) a proposed tree can have: the verify slots to reserve."""

    def propose(self, inp: DraftInput, tree: TreeConfig) -> DraftTree:
        """Return a tree whose root token is inp.root."""


class NoDrafter:
    """Plain autoregressive decoding through the same loop: every tree is the root alone."""

    name = "vanilla"
    feature_layers: tuple[int, ...] = ()
    fixed_shape = True

    def reset(self, max_len: int, keep: int = 0) -> int:
        return keep

    def max_tree_nodes(self, tree: TreeConfig) -> int:
        return 1

    def sit_out(self, inp: DraftInput) -> None:
        """Every step is plain: nothing to learn."""

    def propose(self, inp: DraftInput, tree: TreeConfig) -> DraftTree:
        return DraftTree(torch.tensor([inp.root], device=inp.hidden.device), [-1])


# A drafter's proposal run step by step: it yields each forward it needs (a request whose class answers a list of
# them together, `answer_all`), is sent that forward's answer, and returns its tree.
Proposal = Generator[Any, Any, DraftTree]


def propose_together(proposals: list[Proposal]) -> list[DraftTree]:
    """Run several proposals in lockstep and return their trees: each round, every proposal still running yields one
    request, the requests of one class are answered together by `type(request).answer_all(requests)` (e.g. one
    head forward for all of them), and each proposal is sent its own answer. A proposal run alone is its drafter's
    `propose`."""
    trees: list[DraftTree | None] = [None] * len(proposals)
    waiting: dict[int, Any] = {}

    def advance(i: int, answer: Any) -> None:
        try:
            waiting[i] = proposals[i].send(answer)
        except StopIteration as done:
            trees[i] = done.value
            waiting.pop(i, None)

    try:
        for i in range(len(proposals)):
            advance(i, None)
        while waiting:
            by_kind: dict[type, list[int]] = {}
            for i, request in waiting.items():
                by_kind.setdefault(type(request), []).append(i)
            answers = {}
            for kind, ids in by_kind.items():
                answers.update(zip(ids, kind.answer_all([waiting[i] for i in ids])))
            for i, answer in answers.items():
                advance(i, answer)
    finally:
        for proposal in proposals:   # where one failed, the others still undo what they wrote (their `finally`)
            proposal.close()
    return trees
