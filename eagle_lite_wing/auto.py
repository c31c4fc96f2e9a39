"""Method auto: each step, the controller (eagle_lite_wing/controller.py) chooses between a plain step, prompt lookup's
chain and the draft head's tree with lookup's chain grafted on, from this machine's measured costs and this
request's acceptance so far.

The tree given (`TreeConfig`) is the largest the head may draft (depth, top_k, total_tokens) and the most lookup
tokens grafted onto it (`lookup`); its min_prob is the controller's, set each step. Lookup alone proposes up to
COPY_MAX tokens. Without a head (no head ships for the target) the choice is between plain steps and lookup.

Each step's plan travels with its tree (`DraftTree.plan`, which the engine never reads) and comes back in `observe`;
`Choices` (an observer the pipeline attaches: `AutoDrafter.statistics`) sums the steps by the plan's kind.

Status (measured, docs/methods.md "auto"): no gain over the default method (eagle where a head ships) on this
project's held-out questions, 2 threads on an AMD EPYC Zen 5: greedy 168.8 tokens/s against eagle's 179.3 (0.94x);
sampled 1.00x at T=0.7 and 0.97x at T=1.0. Off by default: `--method auto` (drafters/registry.py builds it from here).
"""
from __future__ import annotations

import dataclasses
import logging
import math
import threading

import torch

from eagle_lite.config import GenerationConfig, TreeConfig, default_tree
from eagle_lite.decoding.cost import StepCost, step_cost
from eagle_lite.decoding.drafter import Drafter, DraftInput, Proposal, propose_together
from eagle_lite.decoding.engine import shared_start
from eagle_lite.decoding.observer import Observer, Step
from eagle_lite.drafters.lookup_graft import COPY_MAX
from eagle_lite.drafters.prompt_lookup import PromptLookupDrafter
from eagle_lite.tree import DraftTree, graft_chain

from .controller import ALONE, ChainRate, Controller, seat, time_head

log = logging.getLogger("eagle_lite")

AUTO_DEPTH = 4      # the deepest chain auto lets a top-1 head (a CPU's tree) draft when it is sure
AUTO_LOOKUP = 8     # the most lookup tokens grafted onto a head's tree


def auto_tree(tree: TreeConfig) -> TreeConfig:
    """The tree auto runs where a head recommends `tree`: as deep as AUTO_DEPTH at least (the controller stops
    where the head is unsure), at least AUTO_LOOKUP lookup tokens, and no fixed min_prob."""
    depth = max(tree.depth, AUTO_DEPTH)
    total = max(tree.total_tokens, depth) if tree.top_k == 1 else tree.total_tokens
    return TreeConfig(depth, tree.top_k, total, max(tree.lookup, AUTO_LOOKUP), 0.0)


class Choices(Observer):
    """Method auto's steps by its controller's choice (controller.KINDS): per choice, [steps, tokens, predicted
    tokens, predicted s, measured s, of which the draft predicted, measured] summed over every sequence watched
    (`rows`). The CLI's stats, the server's /metrics and eval.profile_step read them. Thread-safe."""

    def __init__(self) -> None:
        self.rows: dict[str, list[float]] = {}
        self._lock = threading.Lock()

    def on_step(self, seq, step: Step) -> None:
        plan = getattr(step.tree, "plan", None)
        if plan is None:
            return
        with self._lock:
            row = self.rows.setdefault(plan.kind, [0, 0, 0.0, 0.0, 0.0, 0.0, 0.0])
            for i, value in enumerate((1, len(step.tokens), plan.tokens, plan.seconds, step.seconds, plan.draft,
                                       step.draft_seconds)):
                row[i] += value

    def snapshot(self) -> dict[str, list[float]]:
        with self._lock:
            return {kind: list(row) for kind, row in self.rows.items()}

    def line(self) -> str:
        """The CLI's line (its stats, the chat's /stats): share, tokens a step, the step time predicted and measured."""
        rows = self.snapshot()
        steps = sum(row[0] for row in rows.values()) or 1
        return "[auto's choices: " + ", ".join(
            f"{kind} {100 * n / steps:.0f}% ({tokens / n:.2f} tokens, {1e3 * predicted / n:.1f} ms predicted, "
            f"{1e3 * measured / n:.1f} measured)"
            for kind, (n, tokens, _, predicted, measured, *_) in sorted(rows.items())) + "]"

    def series(self, labels: str) -> list[tuple]:
        """The server's /metrics series (serve/metrics.py), per choice: steps, tokens, seconds predicted, measured."""
        out = []
        for choice, (steps, tokens, _, predicted, measured, *_) in sorted(self.snapshot().items()):
            c = f'{labels},choice="{choice}"'
            out += [("auto_steps_total", "counter", "Sequence steps by the controller's choice.", c, steps),
                    ("auto_tokens_total", "counter", "Tokens those steps emitted.", c, tokens),
                    ("auto_predicted_seconds_total", "counter", "Step seconds the controller predicted.", c,
                     round(predicted, 6)),
                    ("auto_measured_seconds_total", "counter", "Step seconds measured (draft, verify, accept).", c,
                     round(measured, 6))]
        return out

    def as_dict(self) -> dict:
        """Per choice: steps, and tokens per step, step time and draft time (ms) as predicted and as measured."""
        return {kind: {"steps": int(steps), "tokens_per_step": round(tokens / steps, 3),
                       "predicted_tokens_per_step": round(expected / steps, 3),
                       "predicted_ms": round(1e3 * predicted / steps, 3),
                       "measured_ms": round(1e3 * measured / steps, 3),
                       "predicted_draft_ms": round(1e3 * pdraft / steps, 3),
                       "measured_draft_ms": round(1e3 * mdraft / steps, 3)}
                for kind, (steps, tokens, expected, predicted, measured, pdraft, mdraft)
                in sorted(self.snapshot().items())}


class AutoDrafter(Drafter):
    """inner: an EagleDrafter (None: lookup and plain steps only); cost: this machine's step costs (None: measured
    or read from the cache, `cost.step_cost`, the head's forwards timed by `controller.time_head`). Per-sequence
    state: the controller and what it waits to learn."""

    name = "auto"
    statistics = Choices   # the observer of its steps the pipeline attaches to its engine
    seats_batch = True     # its controllers size their trees from the batch (`seat`)

    def __init__(self, target, inner=None, cost: StepCost | None = None) -> None:
        self.target, self.inner = target, inner
        self.head = inner.head if inner is not None else None     # the DraftHead (None: no head)
        self.feature_layers = inner.feature_layers if inner is not None else ()
        # the head's tree for this device (the device's default where it recommends none), made auto's
        self.recommended_tree = auto_tree(inner.recommended_tree or default_tree(str(target.device))) \
            if inner is not None else TreeConfig(1, 1, 1, AUTO_LOOKUP)
        self.cost = cost if cost is not None else step_cost(target, inner, time_head=time_head)
        # whether what it proposes moves a sampled answer: the head's q rule draws its tree from the request's
        # generator and accepts by its ratio; lookup's chains and the match rule's are accepted by the target's own
        # draws, so a seed's answer is then the one vanilla decoding gives, whatever the controller chooses
        self.moves_samples = inner is not None and inner.draft_sampling == "q"
        self._fresh()

    def _fresh(self) -> None:
        self.lookup = PromptLookupDrafter(max_ngram=5, min_ngram=1, adaptive=False)
        self.controller = Controller(self.cost, self.inner is not None)
        self._lookups: list[tuple[int, list[int], int]] = []   # (position, chain, m) not yet scored
        self._drafted: tuple[int, DraftTree] | None = None     # the last head tree (its root's position)
        self._copying = False                                   # the last chain scored was accepted whole

    def tree_for(self, tree: TreeConfig) -> TreeConfig:
        """The tree auto runs where the head's recommended tree is `tree` (`auto_tree`; without a head, as given)."""
        return auto_tree(tree) if self.inner is not None else tree

    def sibling(self) -> AutoDrafter:
        """A drafter of the same head and costs with a controller of its own (one per sequence of a batch)."""
        return AutoDrafter(self.target, self.inner.sibling() if self.inner is not None else None, self.cost)

    def reset(self, max_len: int, keep: int = 0) -> int:
        self._fresh()
        return self.inner.reset(max_len, keep) if self.inner is not None else keep

    def max_tree_nodes(self, tree: TreeConfig) -> int:
        head = self.inner.max_tree_nodes(tree) + tree.lookup if self.inner is not None else 1
        return max(head, 1 + COPY_MAX, 1 + tree.lookup)

    def sit_out(self, inp: DraftInput) -> bool:
        """A plain step the caller chose (a server's full batch): the head keeps the features it missed."""
        self._learn(inp.tokens)
        if self.inner is not None:
            self.inner.sit_out(inp)
        return True

    def propose(self, inp: DraftInput, tree: TreeConfig) -> DraftTree:
        return propose_together([self.proposal(inp, tree)])[0]

    def proposal(self, inp: DraftInput, tree: TreeConfig) -> Proposal:
        """`propose` step by step (decoding.drafter.Proposal): the head's forwards, where the plan drafts with it."""
        self._learn(inp.tokens)
        most = max(COPY_MAX, tree.lookup)   # a cap (a server's batch) cuts the chain (`engine._cut`)
        m, start, chain = self.lookup.match_length(inp.tokens, most)
        match = ChainRate.key(m, self._copying, stored=bool(chain) and start == 0)   # start 0: an earlier answer
        if chain:
            self._lookups.append((len(inp.tokens), chain, match))
        plan = self.controller.choose(match, len(chain), most)
        if plan.kind != "head":
            if self.inner is not None:
                self.inner.sit_out(inp)
            drafted = DraftTree.chain(torch.tensor([inp.root] + chain[:plan.lookup], device=inp.hidden.device))
        else:
            head_tree = dataclasses.replace(tree, min_prob=plan.min_prob, lookup=0)
            first = self.controller.first_min_prob(len(chain[:plan.lookup]) + 1)
            grown = yield from self.inner.proposal(inp, head_tree, first_min_prob=min(first, plan.min_prob))
            self._drafted = (len(inp.tokens), grown)
            plan.head_forwards = max(1, int(grown.depths.max()))
            head_first = None   # the chance the head's first token is accepted, where it is not the chain's
            if chain and len(grown) > 1 and int(grown.tokens[1]) != chain[0]:
                head_first = self.controller.calibration(_prob(grown.scores[1])) if grown.scores else 0.0
            plan.lookup = self.controller.graft_length(plan.bucket, min(len(chain), tree.lookup), head_first,
                                                       len(grown))
            drafted = graft_chain(grown, chain[:plan.lookup])
        drafted.plan = plan
        return drafted

    @classmethod
    def seat(cls, drafters: list[AutoDrafter], configs: list[GenerationConfig]) -> None:
        """Seat a step's batch (controller.seat): each controller weighs the batch's step. A sampled sequence with a
        seed whose proposals move its draws (`moves_samples`: a head's q rule) plans as if alone, so that its answer
        does not depend on its batch."""
        seat([d.controller for d in drafters])
        for d, cfg in zip(drafters, configs):
            if not cfg.sampling.greedy and cfg.seed is not None and d.moves_samples:
                d.controller.mates = ALONE

    def observe(self, tree: DraftTree, nodes, path: list[int]) -> None:
        """What the step of `tree`'s plan verified and returned: the controller's running figures follow it."""
        if tree.plan is not None:
            tree.plan.done(len(tree), len(path))

    def _learn(self, tokens: list[int]) -> None:
        """Score the lookup chains and the last head tree against the tokens that followed them; the controller's
        context is now theirs."""
        self.controller.context = float(len(tokens))
        waiting = []
        for pos, chain, match in self._lookups:
            after = tokens[pos:pos + len(chain)]
            matched = shared_start(chain, after)
            if matched < len(after) or len(after) == len(chain):
                self.controller.lookup.add(match, len(chain), matched)
                self._copying = matched == len(chain) >= 2
            else:
                waiting.append((pos, chain, match))
        self._lookups = waiting
        if self._drafted is not None:
            pos, grown = self._drafted
            self._drafted = None
            self._score_head(grown, tokens[pos:])

    def _score_head(self, grown: DraftTree, after: list[int]) -> None:
        """Each head node is accepted exactly when its path is what followed (controller.py's docstring)."""
        if grown.scores is None or len(grown) == 1:
            return
        tokens, accepted = grown.tokens.tolist(), [True] + [False] * (len(grown) - 1)
        for i in range(1, len(grown)):
            d = int(grown.depths[i])
            accepted[i] = accepted[grown.parents[i]] and d <= len(after) and after[d - 1] == tokens[i]
            self.controller.calibration.add(_prob(grown.scores[i]), accepted[i])


# auto's sampling rule for its head where none is given: its match makes a seed's sampled answer the target's own
# draws, whatever the controller proposes (the very tokens vanilla emits for that seed), and accepted more a step
# than q in auto's chains (docs/methods.md)
DRAFT_SAMPLING = "match"


def resolve(target, options) -> tuple[str, object]:
    """Method auto with the head its options name loaded into them (None where none ships for `target`: auto then
    chooses between prompt lookup and plain steps)."""
    from eagle_lite.drafters.eagle_options import EagleOptions, load_eagle_head

    eagle = options if isinstance(options, EagleOptions) else EagleOptions()
    head = eagle.head if eagle.head is not None else load_eagle_head(target, eagle.draft)
    if head is None:
        log.warning("no draft head ships for target '%s': method auto drafts by prompt lookup (training-free); "
                    "train a head with `python -m trainers.train` and pass it with --draft", target.name)
    return "auto", dataclasses.replace(eagle, head=head)


def build(target, o) -> AutoDrafter:
    """Method auto's drafter (drafters/registry.py builds it from here): the head `o` (EagleOptions) holds or names
    (None where none ships: lookup and plain steps), drafting by auto's sampling rule unless `o` sets one."""
    from eagle_lite.drafters.eagle_options import eagle_drafter, load_eagle_head

    head = o.head if o.head is not None else load_eagle_head(target, o.draft)
    if head is not None:
        head = head.over_full_vocabulary() if o.draft_vocab == "full" else head
        head = eagle_drafter(target, head, round_head=o.round_head,
                             draft_sampling=o.draft_sampling or DRAFT_SAMPLING)
    return AutoDrafter(target, head)


def _prob(log_p: float) -> float:
    return math.exp(min(log_p, 0.0))
