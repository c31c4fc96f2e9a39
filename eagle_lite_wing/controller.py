"""Method auto's controller (eagle_lite_wing/auto.py): each step, the proposal with the most expected tokens per
second.

Status (measured, docs/methods.md "auto"): no gain over the default method on this project's held-out questions
(2 threads, AMD EPYC Zen 5: greedy, auto 168.8 tokens/s against eagle's 179.3, 0.94x; sampled, 1.00x at T=0.7 and
0.97x at T=1.0). Off by default: only `--method auto` brings it in.

A step that verifies n tree nodes after a draft of f head forwards costs `cost.step(n, context) + cost.draft(f)`
(eagle_lite/decoding/cost.py: this machine's figures; the context is the sequence's tokens so far) and returns 1
token (the target's own) plus each drafted node it accepts. The controller weighs three proposals:

  plain    the root alone: one token, the cheapest step;
  lookup   prompt lookup's chain of its first L tokens: no draft cost;
  head     the draft head's tree (a chain on a CPU) with lookup's L tokens grafted on.

Expected tokens come from an acceptance model of this request, learnt from what the target accepted:
- lookup (`ChainRate`): by the length m of the n-gram matched (a bucket of its own for a chain copied from an
  earlier answer), the chance its first token is accepted and each next one after the one before. Every step's
  lookup chain is scored against the tokens that followed, proposed or not:
  a chain's token is accepted exactly when it is the target's (greedy, or the target's sample: acceptance is
  lossless, so what follows has the target's distribution whatever was proposed).
- head (`Calibration`): the chance a drafted node is accepted given the head's path probability of it, per bin,
  starting from the identity; plus, by lookup's bucket, the tokens a head step returned and the nodes it verified.
A drafted node is worth verifying where its chance p of being accepted beats what its cost c buys elsewhere,
p > c x rate (rate: this request's tokens per second): the lookup chain is cut where p falls below it, and the
head's tree stops growing where its calibrated path probability does (`TreeConfig.min_prob`, set each step).
Then the proposal of the highest expected tokens / expected seconds is run. Where the head looked worse it drafts
again now and then (its first HEAD_FIRST times every EXPLORE steps, then the less often the further behind, and
in a batch the less often the more sequences it holds), so its figures follow the text. Seconds are the cost
model's, never a clock's: a seed reproduces a sampled answer.

In a batch (a server's step over several requests) the target's one forward verifies every sequence's tree, so
a node one sequence adds delays them all. `seat` gives each sequence's controller its batchmates (`Mates`: the rows,
tokens and draft seconds the others are expected to add, from their running figures), and it then weighs the
batch's step: a plan's speed is the batch's tokens over the step's seconds at the batch's rows, sequences and
contexts (each sequence reads its own cache and is accepted and committed on its own), a node's cost the step's
growth at those rows, and the rate it must beat the batch's (a sequence's share of a step is an equal part
of the forward plus its own draft). As the batch grows, each node costs more and the trees shrink, down to plain
steps. Alone, the mates are none. A server's fixed methods (drafters without a controller) have their trees capped
from the same step costs (eagle_lite/decoding/cost.py `Caps`).

The controller changes what is proposed, never what is accepted: every tree is verified exactly.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

import torch

from eagle_lite.config import TreeConfig
from eagle_lite.decoding.cost import PREFIX, StepCost, sync
from eagle_lite.decoding.drafter import DraftInput

KINDS = ("plain", "lookup", "head")
EXPLORE = 8          # steps the head sits out before it drafts again (more where it is further behind)
RATE_EMA = 0.1       # weight of a step in the running tokens and seconds
HEAD_EMA = 0.2       # weight of a head step in the head's running tokens, nodes and forwards
HEAD_PRIOR_TOKENS = 1.5   # tokens a head step is expected to return before any is seen
HEAD_FIRST = 3       # head steps every request tries (every EXPLORE steps) before its figures decide alone
BEHIND = 30.0        # how much less often the head drafts again, the further its plan is behind the best
SHRINK = 3.0         # head steps of all buckets a bucket's own few count against (its estimate leans on theirs)
NODE_SPAN = 3        # tree sizes a node's cost is averaged over
CATCH_UP_ROWS = 2    # the accepted tokens a catch-up forward is timed over (a step's own, typically)


class Calibration:
    """P(a drafted node is accepted | the head's path probability p of it), in BINS bins over [0, 1]; each starts
    at PRIOR observations accepting at its centre (the head taken at its word) and counts what the target accepted.
    Read monotone: a likelier path is never less likely to be accepted."""

    BINS = 10
    PRIOR = 3.0

    def __init__(self) -> None:
        self.seen = [self.PRIOR] * self.BINS
        self.hits = [self.PRIOR * (b + 0.5) / self.BINS for b in range(self.BINS)]
        self._table: list[float] | None = None

    def _bin(self, p: float) -> int:
        return min(max(int(p * self.BINS), 0), self.BINS - 1)

    def add(self, p: float, accepted: bool) -> None:
        b = self._bin(p)
        self.seen[b] += 1
        self.hits[b] += float(accepted)
        self._table = None

    def table(self) -> list[float]:
        if self._table is None:
            out, best = [], 0.0
            for hits, seen in zip(self.hits, self.seen):
                best = max(best, hits / seen)
                out.append(best)
            self._table = out
        return self._table

    def __call__(self, p: float) -> float:
        return self.table()[self._bin(p)]

    def floor(self, wanted: float) -> float:
        """The least path probability whose node is accepted with at least `wanted` (a min_prob; 0.999 where no
        bin reaches it)."""
        for b, p in enumerate(self.table()):
            if p >= wanted:
                return b / self.BINS
        return 0.999


class ChainRate:
    """Prompt lookup's acceptance by the n-gram length m matched (1..MAX_M), or COPY where the chain before was
    accepted whole (the answer is copying its context): the chance its first token is accepted, and each next one
    given the one before; priors of PRIOR observations."""

    MAX_M = 5
    COPY = MAX_M + 1
    STORED = COPY + 1     # a chain copied from an earlier answer (PromptLookupDrafter.store), not the context
    PRIOR = 2.0

    def __init__(self) -> None:
        first = {m: 0.1 * m for m in range(1, self.MAX_M + 1)} | {self.COPY: 0.7, self.STORED: 0.3}
        self.first = {m: [self.PRIOR * p, self.PRIOR] for m, p in first.items()}
        self.next = {m: [self.PRIOR * (0.8 if m == self.COPY else 0.5), self.PRIOR] for m in first}

    @classmethod
    def key(cls, m: int, copying: bool, stored: bool = False) -> int:
        """The bucket of a chain matched by an m-gram (0: no match), `copying` the last chain accepted whole,
        `stored` one copied from an earlier answer."""
        return 0 if m <= 0 else cls.STORED if stored else cls.COPY if copying else min(m, cls.MAX_M)

    def expect(self, m: int, length: int) -> list[float]:
        """The chance each of the chain's first `length` tokens is accepted (each with all before it); m: its
        bucket (`key`)."""
        if m <= 0 or length <= 0:
            return []
        first, nxt = self.first[m][0] / self.first[m][1], self.next[m][0] / self.next[m][1]
        out = [first]
        while len(out) < length:
            out.append(out[-1] * nxt)
        return out

    def add(self, m: int, length: int, matched: int) -> None:
        """A chain of `length` tokens of bucket m (`key`) had its first `matched` accepted."""
        if m <= 0 or length <= 0:
            return
        self.first[m][1] += 1
        if matched == 0:
            return
        self.first[m][0] += 1
        trials = min(matched, length - 1)      # each accepted token but the last one proposed had a next one
        self.next[m][0] += matched - 1
        self.next[m][1] += trials


@dataclass(frozen=True)
class Mates:
    """What the other sequences of a batched step are expected to add to it (`seat`): how many they are, the tree
    rows they verify, the tokens they return, their draft seconds and their contexts (tokens, summed)."""

    count: int = 0
    rows: float = 0.0
    tokens: float = 0.0
    draft: float = 0.0
    context: float = 0.0


ALONE = Mates()


def seat(controllers: list[Controller]) -> None:
    """Give each controller of a step's batch its mates: the others' running rows, tokens and draft seconds and
    their contexts (one alone, or none: nothing to do but forget any earlier batch)."""
    rows = sum(c.rows for c in controllers)
    tokens = sum(c.tokens for c in controllers)
    draft = sum(c.drafting for c in controllers)
    context = sum(c.context for c in controllers)
    for c in controllers:
        c.mates = Mates(len(controllers) - 1, rows - c.rows, tokens - c.tokens, draft - c.drafting,
                        context - c.context) if len(controllers) > 1 else ALONE


@dataclass
class Plan:
    """One step's choice: its kind (KINDS), the lookup tokens it proposes (alone or grafted), the head's min_prob
    (a head plan; `Controller.first_min_prob` for its first token), and the tokens and seconds it was expected to
    take (draft, verify and acceptance; in a batch, its share of the step: `Controller.share`), and the tree rows
    it was expected to verify."""

    kind: str
    lookup: int
    min_prob: float
    tokens: float
    seconds: float
    controller: Controller = field(repr=False)
    bucket: int = 0            # lookup's bucket this step (ChainRate.key)
    head_forwards: int = 0     # the head forwards a head plan ran
    draft: float = 0.0         # of `seconds`, the head's draft
    nodes: float = 1.0         # tree nodes it verifies, root included (a head plan: as expected)

    def done(self, nodes: int, tokens: int) -> None:
        """What the step verified and returned: the controller's running figures follow it."""
        self.controller.measured(self, nodes, tokens)


class Controller:
    """The per-request controller (module docstring). head: whether a draft head can propose."""

    def __init__(self, cost: StepCost, head: bool) -> None:
        self.cost, self.has_head = cost, head
        self.calibration = Calibration()
        self.lookup = ChainRate()
        self.tokens, self.seconds = 1.0, cost.step(1)   # running tokens and (predicted) seconds per step
        # head steps by lookup's bucket (ChainRate.key, 0: no match), and of all buckets together (key -1):
        # [tokens, nodes verified, steps] running
        self.head = {m: [HEAD_PRIOR_TOKENS, 2.0, 0] for m in range(-1, ChainRate.STORED + 1)}
        self.head_forwards = 2.0       # head forwards per head step (running)
        self.since_head = 0
        self.rows, self.drafting = 1.0, 0.0   # tree rows verified and draft seconds per step (running)
        self.mates = ALONE             # the rest of this step's batch (`seat`)
        self.context = float(PREFIX)   # this sequence's tokens so far (its drafter sets it each step)
        self._steps: dict[tuple, float] = {}   # cost.step's answers (`step`)

    @property
    def rate(self) -> float:
        """Tokens per second of this request's steps so far (running; the seconds its plans were predicted to take,
        so that no choice depends on a clock: a seed reproduces a sampled answer). In a batch its seconds are its
        shares of the steps, so this is about the batch's rate."""
        return self.tokens / self.seconds

    def step(self, nodes: float) -> float:
        """Seconds of the step's forward, acceptance and commit where this sequence verifies `nodes` (and its mates
        theirs): at the batch's rows, sequences and mean context (remembered for the step's many questions)."""
        m = self.mates
        key = (m.rows + nodes, (m.context + self.context) / (m.count + 1), m.count + 1)
        seconds = self._steps.get(key)
        if seconds is None:
            if len(self._steps) > 256:
                self._steps.clear()
            seconds = self._steps[key] = self.cost.step(*key)
        return seconds

    def node_cost(self, nodes: int) -> float:
        """Seconds one more verified node adds to a step where this sequence verifies `nodes` (and its mates theirs):
        the mean over the next NODE_SPAN (timing noise makes single steps of the measured curve uneven)."""
        return max(self.step(nodes + NODE_SPAN) - self.step(nodes), 0.0) / NODE_SPAN

    def share(self, nodes: float, draft: float = 0.0) -> float:
        """This sequence's seconds of a step where it verifies `nodes` after a draft of `draft` seconds: its draft
        and its part of the step (alone: the whole step)."""
        return draft + self.step(nodes) / (self.mates.count + 1)

    def speed(self, plan: Plan) -> float:
        """The expected tokens per second of the step (of the batch's, in a batch) where this sequence runs `plan`."""
        m = self.mates
        return (m.tokens + plan.tokens) / (m.draft + plan.draft + self.step(plan.nodes))

    def chain_length(self, probs: list[float], nodes: int = 1) -> int:
        """How many of a chain's tokens (each accepted with `probs`, falling along it) are worth verifying after a
        tree of `nodes`."""
        rate, length = self.rate, 0
        for p in probs:
            if p < self.node_cost(nodes + length) * rate:
                break
            length += 1
        return length

    def graft_length(self, match: int, chain: int, head_first: float | None, nodes: int) -> int:
        """The lookup tokens worth grafting onto a head tree of `nodes` whose first token is not the chain's and is
        accepted with `head_first` (None: the tree holds the chain's first token): the chain's first token can only
        be accepted where the head's is not."""
        probs = self.lookup.expect(match, chain)
        if head_first is not None and probs:
            scale = min(1.0, (1.0 - head_first) / probs[0])
            probs = [p * scale for p in probs]
        return self.chain_length(probs, nodes)

    def choose(self, match: int, chain: int, max_lookup: int) -> Plan:
        """The plan of this step: `match` lookup's bucket (`ChainRate.key`; 0: no match) and `chain` its tokens."""
        probs = self.lookup.expect(match, min(chain, max_lookup))
        length = self.chain_length(probs)
        plans = [Plan("plain", 0, 0.0, 1.0, self.share(1), self, match)]
        if length:
            plans.append(Plan("lookup", length, 0.0, 1.0 + sum(probs[:length]), self.share(1 + length), self,
                              match, nodes=1 + length))
        best = max(plans, key=self.speed)
        if not self.has_head:
            return best
        tokens, nodes = self.head_estimate(match)
        draft = self.cost.draft(max(1, round(self.head_forwards)))
        nodes = 1 + round(nodes)
        head = Plan("head", length, self.min_prob(nodes), tokens, self.share(nodes, draft), self, match, draft=draft,
                    nodes=nodes)
        gap = max(0.0, 1.0 - self.speed(head) / self.speed(best))
        # the head drafts where it is the fastest, and now and then where it is not (its first HEAD_FIRST steps
        # every EXPLORE steps, then the less often the further behind it is), so that its estimates follow the text
        # in a batch an exploring step costs every sequence its time, for what this one learns: it waits longer
        wait = EXPLORE * (1.0 if self.head[-1][2] < HEAD_FIRST else 1.0 + BEHIND * gap) * (1 + self.mates.count)
        if self.speed(head) >= self.speed(best) or self.since_head >= wait:
            return head
        return best

    def head_estimate(self, match: int) -> tuple[float, float]:
        """(tokens, nodes verified besides the root) of a head step in lookup's bucket `match`: the bucket's running
        figures, leaning on those of all head steps while the bucket has few (SHRINK)."""
        tokens, nodes, steps = self.head[match]
        every_tokens, every_nodes, _ = self.head[-1]
        w = steps / (steps + SHRINK)
        return w * tokens + (1 - w) * every_tokens, w * nodes + (1 - w) * every_nodes

    def min_prob(self, nodes: int) -> float:
        """The head's floor: a node whose calibrated chance of acceptance is below what its verify and one more
        head forward would buy at this request's rate is not drafted."""
        return self.calibration.floor((self.node_cost(nodes) + self.cost.head) * self.rate)

    def first_min_prob(self, nodes: int) -> float:
        """The floor of the head's first token, whose forward a head step runs anyway: its verify alone."""
        return self.calibration.floor(self.node_cost(nodes) * self.rate)

    def measured(self, plan: Plan, nodes: int, tokens: int) -> None:
        """What a step of `plan` verified (nodes) and returned (tokens)."""
        self.tokens += RATE_EMA * (tokens - self.tokens)
        self.seconds += RATE_EMA * (plan.seconds - self.seconds)
        self.rows += RATE_EMA * (nodes - self.rows)
        self.drafting += RATE_EMA * (plan.draft - self.drafting)
        self.since_head = 0 if plan.kind == "head" else self.since_head + 1
        if plan.kind == "head":
            for row in (self.head[plan.bucket], self.head[-1]):
                weight = max(HEAD_EMA, 1.0 / (row[2] + 2))   # the prior counts as one step
                row[0] += weight * (tokens - row[0])
                row[1] += weight * (nodes - 1 - row[1])
                row[2] += 1
            self.head_forwards += HEAD_EMA * (plan.head_forwards - self.head_forwards)


def time_head(target, drafter, repeats: int) -> tuple[float, float]:
    """(seconds of a catch-up forward over CATCH_UP_ROWS accepted tokens' features, of one more forward) of an EAGLE
    drafter's head: depth-1 and depth-3 greedy chains drafted by a sibling with its own cache. Method auto's
    `time_head` for eagle_lite/decoding/cost.py `step_cost`, which caches them with the target's step costs."""
    twin = drafter.sibling()
    width = (len(drafter.feature_layers) or 1) * target.hidden_size
    times = {1: math.inf, 3: math.inf}
    for _ in range(repeats):
        for depth in times:
            twin.reset(PREFIX, 0)
            tokens = [5] * (PREFIX // 4)
            zeros = torch.zeros(len(tokens) - 1, width, dtype=target.dtype, device=target.device)
            twin.propose(DraftInput(tokens, zeros), TreeConfig(1, 1, 1))   # its context, read once
            inp = DraftInput(tokens + [7 + i for i in range(CATCH_UP_ROWS)], zeros.new_zeros(CATCH_UP_ROWS, width))
            sync(target.device)
            start = time.perf_counter()
            twin.propose(inp, TreeConfig(depth, 1, depth))
            sync(target.device)
            times[depth] = min(times[depth], time.perf_counter() - start)
    return times[1], max(times[3] - times[1], 0.0) / 2
