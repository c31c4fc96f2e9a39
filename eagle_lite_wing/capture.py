"""What the verify forwards already computed, kept for a head that learns from the traffic it serves (`--adapt`).

Status: part of online adaptation (adapt.py), which measured at most +0.5% accepted per step on the weak kinds at
77-115 ms of CPU per answered token (docs/adapt.md); off unless `--adapt` is given.

An observer of the engine (eagle_lite.decoding.observer, `Engine.observers`): for every token the target read,
its last hidden state and the features the head reads (an EAGLE-3 head's taps, else the hidden state again, not
stored twice), exactly what the head's training batches hold (trainers/objective.py `collate`). Nothing is computed for
it: the rows are those of the prefill and of the accepted paths, stored in bfloat16 as the feature caches store them.

A record is one answer: up to `context` tokens of its prompt (what the head attends to before the answer), then the
answer. The buffer keeps the newest records up to `max_tokens` tokens; older ones are dropped as new ones arrive.
`take()` hands the records captured since the last call to the learner, which keeps its own pool.
"""
from __future__ import annotations

import threading
import time
from collections import deque
from dataclasses import dataclass

import torch

from eagle_lite.decoding.observer import Observer, Step


@dataclass
class Captured:
    """One answer as the head's training data: tokens [T], the loss mask [T] (True on the answer), hidden [T, H]
    and taps [T, K*H] (None: the head reads the hidden state), bfloat16."""

    input_ids: torch.Tensor
    loss_mask: torch.Tensor
    hidden: torch.Tensor
    taps: torch.Tensor | None

    def __len__(self) -> int:
        return int(self.input_ids.shape[0])

    def item(self) -> dict:
        """The record as `collate` takes it."""
        return {"input_ids": self.input_ids, "loss_mask": self.loss_mask, "hidden": self.hidden,
                **({"taps": self.taps} if self.taps is not None else {})}


class Rows:
    """A sequence's rows as decoding goes: the target's outputs at tokens `start`.. of the sequence."""

    def __init__(self, start: int, prompt_tokens: int) -> None:
        self.start, self.prompt_tokens = start, prompt_tokens
        self.hidden: list[torch.Tensor] = []
        self.features: list[torch.Tensor] = []

    def add(self, hidden: torch.Tensor, features: torch.Tensor | None) -> None:
        """hidden [n, H]; features [n, H'] where the head reads other features than the hidden state (None: not)."""
        self.hidden.append(hidden.to(torch.bfloat16))
        if features is not None:
            self.features.append(features.to(torch.bfloat16))


class Capture(Observer):
    """The bounded buffer of captured answers (module docstring). Thread-safe: a server's worker adds while a
    learner takes. `seconds`: the time spent keeping rows."""

    def __init__(self, max_tokens: int = 32768, context: int = 256) -> None:
        if max_tokens < 1 or context < 0:
            raise ValueError(f"capture sizes must be max_tokens >= 1 and context >= 0, got {max_tokens}, {context}")
        self.max_tokens, self.context = max_tokens, context
        self._records: deque[Captured] = deque()
        self._tokens = 0
        self._lock = threading.Lock()
        self.seconds = 0.0

    def on_start(self, seq, hidden: torch.Tensor, features: torch.Tensor, read_from: int) -> None:
        """A new sequence's rows start at its last `context` prompt tokens (`Rows.start`): the prefill's outputs are
        kept from there."""
        t0 = time.perf_counter()
        prompt = seq.stats.prompt_tokens
        rows = seq.notes[self] = Rows(max(read_from, prompt - self.context), prompt)
        cut = rows.start - read_from
        rows.add(hidden[cut:], None if features is hidden else features[cut:])
        self.seconds += time.perf_counter() - t0

    def on_step(self, seq, step: Step) -> None:
        rows = seq.notes.get(self)
        if rows is not None:
            t0 = time.perf_counter()
            rows.add(step.hidden[step.path], None if step.features is step.hidden else step.features[step.path])
            self.seconds += time.perf_counter() - t0

    def on_finish(self, seq) -> None:
        rows = seq.notes.pop(self, None)
        if rows is not None:
            self.finish(rows, seq.tokens, seq.stats.new_tokens)

    def finish(self, rows: Rows, tokens: list[int], answer_tokens: int) -> None:
        """Store a finished sequence: `tokens` all it holds, the first `answer_tokens` after the prompt its answer."""
        if not rows.hidden or answer_tokens < 1:
            return
        hidden = torch.cat(rows.hidden)
        taps = torch.cat(rows.features) if rows.features else None
        first = len(tokens) - 1 - hidden.shape[0]         # the rows cover every token but the last (the next root)
        begin = rows.prompt_tokens - first                # the answer's first row
        n = min(hidden.shape[0], begin + answer_tokens)   # not the tokens a last step verified past the answer
        if n <= begin:
            return
        hidden, taps = hidden[:n], taps[:n] if taps is not None else None
        ids = torch.tensor(tokens[first:first + n], dtype=torch.long)
        mask = torch.zeros(n, dtype=torch.bool)
        mask[max(begin, 0):] = True
        self.put(Captured(ids, mask, hidden, taps))

    def put(self, record: Captured) -> None:
        """Store a record (`finish`; eval.adapt_curves replays stored ones)."""
        with self._lock:
            self._records.append(record)
            self._tokens += len(record)
            while self._tokens > self.max_tokens and len(self._records) > 1:
                self._tokens -= len(self._records.popleft())

    def take(self) -> list[Captured]:
        """The records captured since the last `take`, oldest first; the buffer is emptied."""
        with self._lock:
            out = list(self._records)
            self._records.clear()
            self._tokens = 0
        return out

    def __len__(self) -> int:
        return len(self._records)
