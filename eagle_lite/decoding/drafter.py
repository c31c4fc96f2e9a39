"""The drafter contract: a `Drafter` proposes a tree of continuations for the target to verify."""
from __future__ import annotations

from collections.abc import Callable, Generator
from dataclasses import dataclass
from typing import Any

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


# A drafter's proposal run step by step: it yields each forward it needs (a request whose class answers a list of
# them together, `answer_all`), is sent that forward's answer, and returns its tree.
Proposal = Generator[Any, Any, DraftTree]


@dataclass(frozen=True)
class FixedShape:
    """What a drafter hands the fixed-shape step (decoding/static/) to run its steps in its place: `draft(fused)`, which
    builds the draft in fixed shapes that step runs (an EAGLE head's: drafters/eagle_static.py `StaticDraft`; fused:
    its layer as one op where a probe agrees), None for plain decoding; and whether that step is the faster exact one
    where graphs pay (CUDA; a parallel head's is not)."""

    draft: Callable[[bool], Any] | None = None
    preferred: bool = True


class Drafter:
    """The base of every drafter: `reset`, `max_tree_nodes` and `propose` to define, and a default for every optional
    hook, so that the engine, the pipeline and the server call methods instead of probing attributes.

    feature_layers: the target's decoder layers it reads (EAGLE-3 heads): the engine passes their outputs as
    `DraftInput.hidden` (`Target.forward`'s taps) instead of the last hidden state. head: the EAGLE DraftHead it drafts
    with (step costs, the server's siblings, --adapt), None for others. recommended_tree: the tree that head
    recommends for this device (None: none). queued_rows: feature rows it reads before its next tree (steps it sat
    out), which a server prices. seats_batch: whether `seat` sizes its own trees from a step's batch (method auto's
    controllers), so a server caps none of them."""

    name = "drafter"
    feature_layers: tuple[int, ...] = ()
    head: Any = None
    recommended_tree: TreeConfig | None = None
    queued_rows = 0
    seats_batch = False

    def reset(self, max_len: int, keep: int = 0) -> int:
        """Start a sequence of at most max_len tokens whose first `keep` tokens are those of the last one.

        Returns how many of those the drafter kept state for (<= keep); the engine re-reads the rest.
        """
        raise NotImplementedError

    def max_tree_nodes(self, tree: TreeConfig) -> int:
        """The most nodes (root included) a proposed tree can have: the verify slots to reserve."""
        raise NotImplementedError

    def propose(self, inp: DraftInput, tree: TreeConfig) -> DraftTree:
        """Return a tree whose root token is inp.root."""
        raise NotImplementedError

    def proposal(self, inp: DraftInput, tree: TreeConfig, **hints) -> Proposal:
        """`propose` as a generator of the forwards it needs (`Proposal`), so that several sequences' drafters
        propose together (`propose_together`: EAGLE heads' forwards batched, drafters/eagle.py). By default it needs
        none: the tree at once. hints: what a wrapper passes on to `propose` (staged's `probe`)."""
        return self.propose(inp, tree, **hints)
        yield   # noqa: B901 (a generator that returns at once)

    def sit_out(self, inp: DraftInput) -> bool:
        """A plain step the caller chose (a server's full batch): True where the drafter sat it out, keeping what it
        must learn of the step (a head the features it missed); False: it cannot, and drafts as usual."""
        return False

    def observe(self, tree: DraftTree, nodes, path: list[int]) -> None:
        """After each acceptance: the tree it proposed, the target's logits of its nodes (`lm_head.NodeLogits`:
        `nodes.top_token(i)`, `nodes[i]`), the rows of `tree.probes` already projected, and the accepted path (root
        first); lookahead reads its Jacobi window's next tokens here, method auto what its plan returned."""

    @classmethod
    def seat(cls, drafters: list[Drafter], configs: list) -> None:
        """Told each step's batch (the drafters of this class and their sequences' GenerationConfigs) before any of
        them proposes (method auto: its controllers weigh the batch)."""

    def statistics(self):
        """An observer of its steps for the engine it runs in (`decoding.observer.Observer`), or None."""
        return None

    def sibling(self) -> Drafter | None:
        """A drafter of the same method with per-sequence state of its own and its weights shared (one per sequence
        of a batch), or None where a fresh build costs nothing more."""
        return None

    def fixed_shape(self) -> FixedShape | None:
        """How the fixed-shape step can run its steps in its place (`FixedShape`), or None where it cannot."""
        return None


@dataclass(frozen=True)
class VanillaOptions:
    """Plain decoding: nothing to set."""


class NoDrafter(Drafter):
    """Plain autoregressive decoding through the same loop: every tree is the root alone."""

    name = "vanilla"

    def reset(self, max_len: int, keep: int = 0) -> int:
        return keep

    def max_tree_nodes(self, tree: TreeConfig) -> int:
        return 1

    def sit_out(self, inp: DraftInput) -> bool:
        """Every step is plain: nothing to learn."""
        return True

    def propose(self, inp: DraftInput, tree: TreeConfig) -> DraftTree:
        return DraftTree(torch.tensor([inp.root], device=inp.hidden.device), [-1])

    def fixed_shape(self) -> FixedShape:
        return FixedShape()


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
