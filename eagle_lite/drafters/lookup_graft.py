"""Prompt lookup composed with another drafter: graft the lookup continuation onto its tree, and while the
answer copies its context, verify lookup chains alone (up to `copy_cap`, the inner drafter sitting the step out):
a chain taken whole doubles the next; one taken in part, past a graft's length, is followed by one a token longer
than what it took, as prompt lookup's own adaptive chain does.
With `staged`, the inner EagleDrafter first reads the lookup chain and grafts the prefix it agrees with.
Greedy steps only: sampled steps take the inner drafter's tree alone (a copied token is accepted with the target's
probability of it; the graft did not pay there on held-out prompts). docs/methods.md, "Lookup grafts and staged",
has the details.
"""
from __future__ import annotations

import torch

from ..config import TreeConfig
from ..decoding.drafter import Drafter, DraftInput, FixedShape, Proposal, propose_together
from ..decoding.engine import shared_start
from ..tree import DraftTree, graft_chain
from .prompt_lookup import PromptLookupDrafter

COPY_MAX = 16   # the longest lookup chain verified alone while the answer copies its context
COPY_START = 10   # the first one, after a grafted chain was taken whole: prompt lookup's own first chain
# Past LONG_CONTEXT tokens each verified row also attends over the whole context, which makes a row cost markedly
# more than after a short prompt (on a CPU), so shorter copy chains pay there.
LONG_CONTEXT, COPY_MAX_LONG = 1024, 8


def copy_cap(context: int) -> int:
    """The longest copy chain worth verifying after `context` tokens."""
    return COPY_MAX if context <= LONG_CONTEXT else COPY_MAX_LONG


class LookupGraft(Drafter):
    """`inner`'s trees with a prompt-lookup path grafted on (TreeConfig.lookup > 0; 0 passes them through).

    copy_mode: verify lookup chains alone while they are accepted whole, where the inner drafter can sit those steps
    out (`Drafter.sit_out`: one that reads the target's features must learn of the steps it did not draft).
    """

    def __init__(self, inner: Drafter, copy_mode: bool = True, staged: bool = False) -> None:
        self.inner = inner
        self.name = "staged" if staged else inner.name
        self.feature_layers, self.head, self.recommended_tree = inner.feature_layers, inner.head, inner.recommended_tree
        # the longest earlier match of the last 2-5 tokens
        self.lookup = PromptLookupDrafter(max_ngram=5, min_ngram=2, adaptive=False)
        self.copy_mode = copy_mode
        self._graft: tuple[int, list[int]] = (0, [])   # (sequence length, lookup chain) of the last proposal
        self._copied = False                             # whether that chain was verified alone (copy mode)
        self.copy_steps = 0                              # proposals that were the lookup chain alone
        # staged: the inner drafter (an EagleDrafter) reads each lookup chain in its catch-up forward and the chain
        # grafted is the part it agrees with plus its own next token (module docstring)
        self.staged = staged and (inner.head is None or not inner.head.parallel)
        if self.staged:
            inner.keep_features = True
        self.probes = 0                                  # staged proposals whose lookup chain the head read
        self.probe_agreed = 0                            # chain tokens the head agreed with (head steps not run)

    def sibling(self) -> LookupGraft:
        """The same graft over a sibling of the inner drafter (`EagleDrafter.sibling`): per-sequence state of its
        own, the head and its tables shared."""
        return LookupGraft(self.inner.sibling(), copy_mode=self.copy_mode, staged=self.staged)

    @property
    def queued_rows(self) -> int:
        return self.inner.queued_rows

    def fixed_shape(self) -> FixedShape | None:
        """The static step drafts the inner tree without a graft, as eagle's does; staged's is its own."""
        return None if self.staged else self.inner.fixed_shape()

    def sit_out(self, inp: DraftInput) -> bool:
        return self.inner.sit_out(inp)

    def observe(self, tree: DraftTree, nodes, path: list[int]) -> None:
        self.inner.observe(tree, nodes, path)

    def __getattr__(self, name: str):
        inner = self.__dict__.get("inner")               # the inner drafter's own state (cache, head, ...)
        if inner is None:
            raise AttributeError(name)
        return getattr(inner, name)

    def reset(self, max_len: int, keep: int = 0) -> int:
        self._graft, self._copied = (0, []), False
        return self.inner.reset(max_len, keep)

    def max_tree_nodes(self, tree: TreeConfig) -> int:
        copy = 1 + COPY_MAX if self.copy_mode and tree.lookup else 0
        staged = 1 if self.staged and tree.lookup else 0     # the head's token past the chain it agrees with
        return max(self.inner.max_tree_nodes(tree) + tree.lookup + staged, copy)

    def _copy_length(self, tokens: list[int], tree: TreeConfig) -> int:
        """How long a lookup chain to verify alone this step (0: none, the answer is not copying its context). The
        last proposal's chain accepted whole: double it (a grafted chain: start at COPY_START); a copy chain
        of which at least `tree.lookup` tokens were taken: the answer still copies, so go on with one more than
        it took (as prompt lookup's own chain shrinks), rather than back to the tree and a new ramp."""
        start, chain = self._graft
        if len(chain) < 2:
            return 0
        taken = shared_start(tokens[start:start + len(chain)], chain)
        if taken == len(chain):
            return 2 * len(chain) if self._copied else max(tree.total_tokens + tree.lookup, COPY_START)
        return taken + 1 if self._copied and taken >= max(tree.lookup, 2) else 0

    def propose(self, inp: DraftInput, tree: TreeConfig) -> DraftTree:
        return propose_together([self.proposal(inp, tree)])[0]

    def proposal(self, inp: DraftInput, tree: TreeConfig) -> Proposal:
        """`propose` step by step (decoding.drafter.Proposal): the inner drafter's forwards, where it proposes so."""
        if not tree.lookup or (not inp.sampling.greedy and not self.staged):   # module docstring: sampled steps
            return (yield from self._inner(inp, tree))
        length = self._copy_length(inp.tokens, tree) if self.copy_mode else 0
        self._copied = False
        if length:
            chain = self.lookup.lookup(inp.tokens, min(copy_cap(len(inp.tokens)), length))
            if chain and self.inner.sit_out(inp):
                self._graft, self._copied = (len(inp.tokens), chain), True
                self.copy_steps += 1
                return DraftTree.chain(torch.tensor([inp.root] + chain, device=inp.hidden.device))
        if self.staged:
            return (yield from self._proposal_staged(inp, tree))
        drafted = yield from self._inner(inp, tree)
        chain = self.lookup.lookup(inp.tokens, tree.lookup)
        self._graft = (len(inp.tokens), chain)
        return graft_chain(drafted, chain)

    def _inner(self, inp: DraftInput, tree: TreeConfig, **probe) -> Proposal:
        """The inner drafter's proposal."""
        return (yield from self.inner.proposal(inp, tree, **probe))

    def _proposal_staged(self, inp: DraftInput, tree: TreeConfig) -> Proposal:
        start, chain = self.lookup.match(inp.tokens, tree.lookup)
        drafted = yield from self._inner(inp, tree, probe=(start, chain) if chain else None)
        if not chain:
            self._graft = (len(inp.tokens), [])
            return drafted
        top = self.inner.probe_top                       # the head's token after the root, after chain[0], ...
        agreed = 0
        while agreed < len(chain) and chain[agreed] == top[agreed]:
            agreed += 1
        staged = chain[:agreed] + [top[agreed]]
        self.probes += 1
        self.probe_agreed += agreed
        self._graft = (len(inp.tokens), chain)           # whether the answer copies: whether it took the lookup chain
        return graft_chain(drafted, staged)
