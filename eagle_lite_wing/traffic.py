"""A store of the answers served, for prompt lookup across requests: what followed an n-gram in an earlier answer.

Status: measured 0.96-0.97x against the same method without it on this project's targets (docs/adapt.md); off
unless asked (`Adapter(traffic_tokens=N)`, `eval.adapt --traffic-tokens N`).

Prompt lookup copies from the request's own context. Answers of one kind of traffic repeat one another too (code's
idioms, a support bot's phrasing): the store keeps the latest answers as token ids (at most `max_tokens`, the
oldest dropped first) with the latest place of every n-gram of `min_ngram` (MIN_NGRAM) to `max_ngram` tokens, and
a lookup drafter that finds a longer match here than in its context proposes what followed it (shorter matches
across answers are mostly wrong: MIN_NGRAM). It changes what is proposed, never what is accepted.

It is an observer of the engine (eagle_lite.decoding.observer): each sequence's prompt lookup (the drafter's own,
or its `lookup`: eagle's graft, auto) copies from it while the sequence runs, and its answer joins it when done.

    store = TrafficStore()
    engine.observers.append(store)                # every answer the engine finishes joins it
    store.add(answer_ids)                         # or one given directly
    n, chain = store.continuation(tokens, 5, 8)   # the longest n-gram (>= 5 here) ending `tokens`, what followed it
"""
from __future__ import annotations

from eagle_lite.decoding.observer import Observer

MAX_TOKENS = 65536   # answer tokens kept
MIN_NGRAM = 4        # the shortest match a lookup copies from another answer: shorter ones are mostly wrong there


def _lookups(drafter) -> list:
    """The prompt lookups `drafter` copies with: itself, or its `lookup` (eagle's graft, auto)."""
    return [d for d in (drafter, getattr(drafter, "lookup", None)) if hasattr(d, "store")]


class TrafficStore(Observer):
    def __init__(self, max_tokens: int = MAX_TOKENS, min_ngram: int = MIN_NGRAM, max_ngram: int = 5) -> None:
        if max_tokens < 1 or not 1 <= min_ngram <= max_ngram:
            raise ValueError(f"a traffic store keeps >= 1 token and n-grams of 1 <= min <= max, got {max_tokens}, "
                             f"{min_ngram}, {max_ngram}")
        self.max_tokens, self.min_ngram, self.max_ngram = max_tokens, min_ngram, max_ngram
        self.answers: dict[int, list[int]] = {}   # serial -> tokens, oldest first
        self.tokens = 0
        self._serial = 0
        # n -> {n-gram: (serial of the answer, start)}: the latest place of each n-gram some token follows
        self._index: dict[int, dict[tuple[int, ...], tuple[int, int]]] = {}
        self._reindex()

    def __len__(self) -> int:
        return len(self.answers)

    def on_start(self, seq, hidden, features, read_from: int) -> None:
        for lookup in _lookups(seq.drafter):
            lookup.store = self

    def on_finish(self, seq) -> None:
        self.add(seq.answer)
        for lookup in _lookups(seq.drafter):
            lookup.store = None

    def add(self, answer: list[int]) -> None:
        """Keep a finished answer (token ids). Past `max_tokens` kept, the oldest go down to three quarters of it
        (the index is rebuilt then, so not at every answer)."""
        answer = list(answer[-self.max_tokens:])
        if len(answer) < 2:
            return
        self._serial += 1
        self.answers[self._serial] = answer
        self.tokens += len(answer)
        self._index_answer(self._serial, answer)
        if self.tokens > self.max_tokens:
            while self.tokens > self.max_tokens * 3 // 4 and len(self.answers) > 1:
                self.tokens -= len(self.answers.pop(next(iter(self.answers))))
            self._reindex()

    def _reindex(self) -> None:
        self._index = {n: {} for n in range(self.min_ngram, self.max_ngram + 1)}
        for serial, kept in self.answers.items():
            self._index_answer(serial, kept)

    def _index_answer(self, serial: int, answer: list[int]) -> None:
        for n, places in self._index.items():
            for s in range(len(answer) - n):
                places[tuple(answer[s:s + n])] = (serial, s)

    def continuation(self, tokens: list[int], min_ngram: int, k: int) -> tuple[int, list[int]]:
        """(n, chain): the longest n-gram (at least min_ngram and the store's own `min_ngram`, at most `max_ngram`)
        ending `tokens` that an earlier answer holds, and the up-to-k tokens that followed it there; (0, []) where
        none does."""
        for n in range(min(self.max_ngram, len(tokens)), max(min_ngram, self.min_ngram) - 1, -1):
            place = self._index[n].get(tuple(tokens[len(tokens) - n:]))
            if place is not None:
                serial, start = place
                return n, self.answers[serial][start + n:start + n + k]
        return 0, []
