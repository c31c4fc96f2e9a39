"""Prompt lookup (n-gram) drafting: propose what followed the latest earlier occurrence of the last n-gram.

Training-free and nearly free to run; it shines where the answer repeats the context (code edits,
summaries, quoting). With no match the tree is the root alone: a plain decoding step, no loss. Given a `store`
of other text (anything with `continuation(tokens, min_ngram, k)`: eagle_lite_wing's store of the answers served
sets one), it also copies from it where it matches longer.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..config import TreeConfig
from ..decoding.drafter import Drafter, DraftInput
from ..tree import DraftTree


class AdaptiveLength:
    """Speculation length for chain drafters: grow after a full acceptance, shrink after a rejection."""

    def __init__(self, start: int, low: int = 1, high: int = 16) -> None:
        self.k, self.low, self.high = start, low, high
        self.proposed = 0

    def update(self, accepted: int) -> None:
        """accepted: how many of the last `proposed` drafted tokens the target kept."""
        if self.proposed == 0:
            return
        if accepted >= self.proposed:
            self.k = min(self.k + 2, self.high)
        else:
            self.k = max(self.low, min(self.k - 1, accepted + 1))


class NgramIndex:
    """The latest start of every n-gram (min_ngram <= n <= max_ngram) of a growing sequence that some token
    follows, kept up to date as tokens are appended, so a lookup costs O(1) rather than a scan of the
    whole context, whose cost in Python grows with the prompt. A sequence that does not extend the one
    indexed (a new prompt, an edited turn) is indexed afresh."""

    def __init__(self, min_ngram: int, max_ngram: int) -> None:
        self.sizes = range(min_ngram, max_ngram + 1)
        self._seq: list[int] = []
        self._starts: dict[int, dict[tuple[int, ...], int]] = {n: {} for n in self.sizes}

    def update(self, tokens: list[int]) -> None:
        done = len(self._seq)
        if len(tokens) < done or tokens[:done] != self._seq:
            self._seq, done = [], 0
            self._starts = {n: {} for n in self.sizes}
        for n, starts in self._starts.items():
            # n-grams that now have a following token: starts s with s + n <= len(tokens) - 1
            for s in range(max(0, done - n), len(tokens) - n):
                starts[tuple(tokens[s:s + n])] = s
        self._seq = list(tokens)

    def latest(self, ngram: tuple[int, ...]) -> int | None:
        """The latest start of `ngram` that a token follows (never the sequence's own suffix), or None."""
        return self._starts[len(ngram)].get(ngram)


class PromptLookupDrafter(Drafter):
    name = "lookup"

    def __init__(self, max_ngram: int = 5, min_ngram: int = 1, num_tokens: int = 10, adaptive: bool = True) -> None:
        """max_ngram: the longest context suffix matched; shorter ones are tried in turn down to min_ngram.
        num_tokens: the chain length to start with; adaptive: grow it after a full acceptance, shrink it after a
        rejection (AdaptiveLength)."""
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError(f"need 1 <= min_ngram <= max_ngram, got {min_ngram}, {max_ngram}")
        self.max_ngram, self.min_ngram = max_ngram, min_ngram
        self.length = AdaptiveLength(num_tokens, high=num_tokens if not adaptive else max(num_tokens, 16))
        self.adaptive = adaptive
        self.index = NgramIndex(min_ngram, max_ngram)
        self.store = None   # other text to copy from (module docstring); None: the context alone

    def reset(self, max_len: int, keep: int = 0) -> int:
        self.length.proposed = 0
        return keep

    def max_tree_nodes(self, tree: TreeConfig) -> int:
        return 1 + self.length.high

    def lookup(self, tokens: list[int], k: int) -> list[int]:
        """The up-to-k tokens that followed the most recent earlier match of the longest suffix n-gram (in the
        context, or in `store` where it holds a longer one)."""
        return self.match_length(tokens, k)[2]

    def match(self, tokens: list[int], k: int) -> tuple[int, list[int]]:
        """(where the continuation starts in `tokens`, the continuation): `lookup` with the place it copies from
        (tokens[start - 1] is the earlier occurrence of the last token). (0, []) where nothing matches."""
        return self.match_length(tokens, k)[1:]

    def match_length(self, tokens: list[int], k: int) -> tuple[int, int, list[int]]:
        """`match` with the length of the n-gram matched first: (n, start, continuation); (0, 0, []) for none.
        A match in `store` is taken where its n-gram is longer than the context's and as long as the store copies
        (start is then 0: it copies from no place of `tokens`)."""
        self.index.update(tokens)
        n_tok = len(tokens)
        found = 0, 0, []
        for n in range(min(self.max_ngram, n_tok - 1), self.min_ngram - 1, -1):
            start = self.index.latest(tuple(tokens[n_tok - n:]))
            if start is not None:
                found = n, start + n, tokens[start + n:start + n + k]
                break
        if self.store is not None and found[0] < self.max_ngram:
            n, chain = self.store.continuation(tokens, max(self.min_ngram, found[0] + 1), k)
            if chain:
                return n, 0, chain
        return found

    def sit_out(self, inp: DraftInput) -> bool:
        """A step without a lookup chain (a batch's plain step): nothing to learn; the index catches up later."""
        return True

    def propose(self, inp: DraftInput, tree: TreeConfig) -> DraftTree:
        if self.adaptive:
            self.length.update(inp.hidden.shape[0] - 1)   # features arrive for the root + accepted tokens
        guess = self.lookup(inp.tokens, self.length.k)
        self.length.proposed = len(guess)
        return DraftTree.chain(torch.tensor([inp.root] + guess, device=inp.hidden.device))


@dataclass(frozen=True)
class LookupOptions:
    """max_ngram..min_ngram: context suffixes matched, longest first; num_tokens: chain length to start with."""

    max_ngram: int = 5
    min_ngram: int = 1
    num_tokens: int = 10
    adaptive: bool = True


def build_lookup(target, o: LookupOptions) -> PromptLookupDrafter:
    return PromptLookupDrafter(o.max_ngram, o.min_ngram, o.num_tokens, o.adaptive)
