"""How big a tree each sequence of a batch verifies this step, from measured costs.

A step of B sequences with at most n tree nodes each costs the drafting (per sequence) plus one target forward
over the B x n' packed nodes (n' <= n: what the drafters actually proposed), and returns B x E(n) tokens,
E(n) the tokens a sequence gets from a tree capped at n nodes (1 for a plain step). The cap chosen is the one of
`CAPS` (up to the configured tree) with the most tokens per second:

    rate(n) = B E(n) / (B draft(n) + verify(B n'(n)))

verify(T) starts from this machine's measured step costs (decoding/cost.py: the target's forward over T tree
nodes after a 128-token prefix, the best of a few runs, measured once per host and cached; the same figures method
auto's controller reads) and then follows what the steps take (a running average per T, linear between measured
points). E(n), n'(n) and draft(n) are running averages of what the
sequences got at each cap, starting from a prior (`prior_tokens`). On a CPU the forward's cost grows with its
rows (and jumps past the 32 rows the native layer op takes), so as B grows the chosen trees shrink, down to plain
decoding (n = 1), the way vLLM turns speculation off above a batch size, but found from measurements.
Batch 1 always runs the configured tree: what the CLI runs. Method auto's steps take no cap from here: its
controllers weigh the batch's rows themselves (decoding/controller.py, `seat`).
"""
from __future__ import annotations

import math

from ..decoding.cost import read_curve

CAPS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64)
PRIOR_WEIGHT = 4.0   # observations a prior counts as
EMA = 0.1            # weight of a new measurement in a running average


def prior_tokens(n: int) -> float:
    """Tokens a sequence is expected to get from a tree of n nodes before any is seen: 1 for a plain step, a
    log-like growth above (acceptance grows with the tree, ever more slowly)."""
    return min(float(n), 1.0 + 0.6 * math.log2(n)) if n > 1 else 1.0


class CostModel:
    """Chooses each step's tree cap (module docstring); `observe` feeds it what each step took."""

    def __init__(self, verify_seconds: dict[int, float], max_nodes: int) -> None:
        self.verify = dict(sorted(verify_seconds.items()))
        self.caps = [c for c in CAPS if c < max_nodes] + [max_nodes]
        # per cap: [tokens, nodes, draft seconds] running averages, and how many steps fed them
        self.seen = {c: [prior_tokens(c), float(c), 0.0] for c in self.caps}
        self.count = {c: 0 for c in self.caps}

    def verify_cost(self, rows: int) -> float:
        """Seconds of one forward over `rows` packed nodes (linear between measured points, beyond the last)."""
        return read_curve(list(self.verify.items()), rows)

    def rate(self, batch: int, cap: int) -> float:
        tokens, nodes, draft = self.seen[cap]
        return batch * tokens / (batch * draft + self.verify_cost(max(1, round(batch * nodes))))

    def choose(self, batch: int) -> int | None:
        """The cap for a step of `batch` sequences; None (the configured tree) for one sequence."""
        if batch <= 1:
            return None
        return max(self.caps, key=lambda c: self.rate(batch, c))

    def observe(self, cap: int | None, rows: int, seconds: float, per_sequence: list[tuple[int, int, float]]) -> None:
        """A step's packed rows and forward seconds, and per sequence (tokens emitted, tree nodes, draft seconds)."""
        if rows in self.verify:
            self.verify[rows] += EMA * (seconds - self.verify[rows])
        cap = self.caps[-1] if cap is None else cap
        if cap not in self.seen:
            return
        for tokens, nodes, draft in per_sequence:
            weight = max(EMA, 1.0 / (PRIOR_WEIGHT + self.count[cap] + 1))
            self.seen[cap] = [old + weight * (new - old) for old, new in zip(self.seen[cap], (tokens, nodes, draft))]
            self.count[cap] += 1
