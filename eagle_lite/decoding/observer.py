"""The observer protocol: what watches decoding without changing it.

An engine's `observers` (`Engine.observers`; the pipeline or the server adds them) see every sequence's prefill,
each of its accepted steps and its finished answer; they never change what is proposed or accepted. Statistics
(method auto's choices, eagle_lite_wing/auto.py) and the experiments of eagle_lite_wing (the rows a learning head trains
on, a store of the answers served) attach here. An observer keeps what it needs of one sequence in
`seq.notes[self]`; the engine never reads it.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..tree import DraftTree


@dataclass
class Step:
    """One sequence's accepted step as an observer sees it."""

    tree: DraftTree           # what its drafter proposed (a field such as `plan` is the drafter's own)
    path: list[int]           # the tree nodes accepted, root first
    tokens: list[int]         # the tokens the step emitted (cut where the sequence stops)
    hidden: torch.Tensor      # [N, H] the target's last hidden states at the tree's nodes
    features: torch.Tensor    # [N, H'] the features the drafter reads there (`hidden` itself where they are the same)
    draft_seconds: float      # the sequence's drafting this step
    seconds: float            # its share of the step: its draft, its part of the verify forward, its acceptance


class Observer:
    """Watches sequences being decoded; each call may be left as it is here (nothing)."""

    def on_start(self, seq, hidden: torch.Tensor, features: torch.Tensor, read_from: int) -> None:
        """`seq` was prefilled: the target's outputs at its prompt tokens read_from.. (those before were kept in the
        cache from an earlier call, or read in parts)."""

    def on_step(self, seq, step: Step) -> None:
        """`seq` accepted a step; `seq.tokens` holds its tokens."""

    def on_finish(self, seq) -> None:
        """`seq` is done (`seq.stats.stop_reason`); its answer is `seq.answer`."""
