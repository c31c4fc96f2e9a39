"""What a step costs on this machine: the target's forward over a tree of n nodes after a context of c tokens, what
each more sequence of a batch adds, and one draft-head forward; measured once per host, device, target and head,
and cached (a JSON file under $EAGLE_LITE_CACHE/costs; `refresh=True` or EAGLE_LITE_REFRESH_COSTS=1 measures again).
Decoding never changes them, so no choice depends on a clock. docs/methods.md, "Costs", has what is timed.

    cost = step_cost(target)                    # measured on first use here, then read from the cache
    cost.step(6, context=500, sequences=3)      # seconds of a step verifying 6 nodes (root included) of 3 sequences
    cost.draft(3)                               # seconds of 3 head forwards (where timed: `step_cost`)

Readers: `Caps` (the tree cap of a server's batched step) and eagle_lite_wing/controller.py.
"""
from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import platform
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..atomic import write_json_atomic
from ..targets.lm_head import NodeLogits

log = logging.getLogger("eagle_lite")

ROWS = (1, 2, 3, 4, 5, 6, 8, 12, 16, 24, 32, 48, 64)   # tree sizes measured (nodes, root included)
PREFIX = 128            # context before the measured forwards
LONG = 512              # the longer context they are timed after too: PREFIX + LONG tokens
BATCH = 4               # sequences of the batch that times what one more sequence adds
VERSION = 6             # of the cache file's layout and what it measures (and the code it timed)


@dataclass
class StepCost:
    """verify: {nodes: seconds} of a step that verifies a chain of that many nodes (the forward and the lm_head rows
    acceptance projects) after PREFIX tokens, measured; verify_long: the same after PREFIX + LONG tokens (empty:
    not measured, a context costs nothing more); sequence: the seconds each more sequence of a batch adds, at
    PREFIX; head: seconds of one draft-head forward over one row (0.0: not timed); catch_up: of the head's first
    forward of a step, which also reads the target's features of the tokens accepted (0.0: not timed).
    """

    verify: dict[int, float]
    head: float = 0.0
    catch_up: float = 0.0
    source: str = "measured"
    verify_long: dict[int, float] = field(default_factory=dict)
    sequence: float = 0.0
    _points: list[tuple[int, float]] = field(init=False, repr=False)
    _long: list[tuple[int, float]] = field(init=False, repr=False)
    _cache_read: float = field(init=False, repr=False)

    def __post_init__(self) -> None:
        if not self.verify:
            raise ValueError("a step cost needs at least one measured tree size")
        # sizes in numeric order (a cache file's keys are strings: "12" sorts before "2")
        self.verify = dict(sorted((int(n), float(s)) for n, s in self.verify.items()))
        self.verify_long = dict(sorted((int(n), max(float(s), self.verify.get(int(n), 0.0)))
                                       for n, s in self.verify_long.items()))
        self._points, self._long = _monotone(self.verify), _monotone(self.verify_long)
        # what one more token of context adds to a one-node step: each more sequence's read of its own cache
        self._cache_read = (read_curve(self._long, 1) - read_curve(self._points, 1)) / LONG if self._long else 0.0

    def step(self, nodes: float, context: float = PREFIX, sequences: int = 1) -> float:
        """Seconds of a step verifying `nodes` tree nodes (linear between measured sizes, and beyond the largest) of
        `sequences` sequences whose contexts average `context` tokens (linear between the two measured contexts,
        and beyond)."""
        at_prefix = read_curve(self._points, nodes)
        slope = (read_curve(self._long, nodes) - at_prefix) / LONG if self._long else 0.0
        seconds = at_prefix + slope * (context - PREFIX)
        if sequences > 1:
            seconds += (sequences - 1) * (self.sequence + self._cache_read * (context - PREFIX))
        return max(seconds, 0.0)

    def draft(self, forwards: int) -> float:
        """Seconds of a head's draft of `forwards` forwards (the first one its catch-up); 0 for none."""
        return 0.0 if forwards <= 0 else self.catch_up + (forwards - 1) * self.head

    def as_dict(self) -> dict:
        return {"version": VERSION, "verify": {str(n): s for n, s in self.verify.items()}, "head": self.head,
                "catch_up": self.catch_up, "verify_long": {str(n): s for n, s in self.verify_long.items()},
                "sequence": self.sequence}


def _monotone(verify: dict[int, float]) -> list[tuple[int, float]]:
    """The points `StepCost.step` reads: a larger tree never costs less than a smaller one (timing noise aside)."""
    points, most = [], 0.0
    for n, s in verify.items():
        most = max(most, s)
        points.append((n, most))
    return points


def read_curve(points: list[tuple[int, float]], nodes: float) -> float:
    """A measured curve [(size, seconds)] in size order at `nodes`: linear between its sizes, and beyond the largest
    (one point: proportional to it)."""
    if len(points) == 1:
        return points[0][1] * max(nodes, 1) / points[0][0]
    for (n0, s0), (n1, s1) in zip(points, points[1:]):
        if nodes <= n1:
            return s0 + (s1 - s0) * (max(nodes, n0) - n0) / (n1 - n0)
    (n0, s0), (n1, s1) = points[-2], points[-1]
    return s1 + (s1 - s0) * (nodes - n1) / (n1 - n0)


def cache_dir() -> Path:
    return Path(os.environ.get("EAGLE_LITE_CACHE") or Path.home() / ".cache" / "eagle_lite") / "costs"


def _machine(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def cache_key(target, head=None) -> str:
    """What the figures depend on, hashed: the machine, the threads, torch, the target and the head's shape."""
    parts = [_machine(target.device), str(torch.get_num_threads()), torch.__version__, target.name,
             str(target.dtype), str(target.device), str(target.vocab_size), str(target.max_context)]
    if head is not None:
        cfg = head.config
        parts += [type(head.layer).__name__, str(cfg.hidden_size), str(getattr(head, "draft_vocab_size", "")),
                  str(tuple(head.feature_layers))]
    return hashlib.sha256("|".join(parts).encode()).hexdigest()[:16]


def step_cost(target, drafter=None, refresh: bool = False, time_head=None) -> StepCost:
    """This machine's StepCost for `target`: read from the cache, else measured (a few seconds for a small target on
    a CPU) and cached. time_head(target, drafter, repeats) -> (catch_up, head) seconds: the EAGLE drafter
    `drafter`'s head forwards timed too (method auto's, eagle_lite_wing/controller.py), under a key of their own."""
    head = drafter.head if time_head is not None and drafter is not None else None
    path = cache_dir() / f"{cache_key(target, head)}.json"
    refresh = refresh or os.environ.get("EAGLE_LITE_REFRESH_COSTS", "0") == "1"
    if not refresh and path.is_file():
        try:
            data = json.loads(path.read_text())
            if data.get("version") == VERSION:
                return StepCost(data["verify"], data["head"], data["catch_up"], f"cached {path}",
                                data["verify_long"], data["sequence"])
        except (OSError, ValueError, KeyError, TypeError):
            log.warning("the step cost cache %s is unreadable: measuring again", path)
    cost = measure(target, drafter, time_head=time_head)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        write_json_atomic(path, cost.as_dict())
    except OSError as err:   # a read-only home: the figures still serve this process
        log.warning("could not cache the step cost in %s (%s)", path, err)
    return cost


@torch.inference_mode()
def measure(target, drafter=None, rows: tuple[int, ...] = ROWS, repeats: int = 5, time_head=None) -> StepCost:
    """Time the target's forward over chains of `rows` nodes after a PREFIX-token context and after PREFIX + LONG
    tokens (where the target's window holds them), each with the lm_head rows acceptance projects (`NodeLogits`
    over the chain as its likely path: every node's row in one product where the lm_head has grid codes, the root's
    argmax alone for one node) and the root's commit; a batch of BATCH one-node sequences, each on its own cache
    (their roots projected together, committed one by one), against the chain of BATCH nodes; and with `time_head`
    the drafter's head forwards (`step_cost`). The best of `repeats` rounds, each round timing every size once (a
    moment of load elsewhere then spoils one round of all sizes rather than every try of one)."""
    rows = tuple(n for n in rows if n + PREFIX < target.max_context) or (1,)
    prefix = min(PREFIX, target.max_context - max(rows) - 1)
    contexts = [prefix] + ([prefix + LONG] if prefix + LONG + max(rows) < target.max_context else [])
    chains = {c: _filled(target, c, max(rows)) for c in contexts}
    batch = [chains[prefix]] + [_filled(target, prefix, 1) for _ in range(BATCH - 1)] if BATCH in rows else []
    times = {(c, n): math.inf for c in contexts for n in rows}
    batch_time = math.inf
    for _ in range(repeats):
        for c in contexts:
            for n in rows:
                times[c, n] = min(times[c, n], _timed(target, [(chains[c], n)]))
        if batch:
            batch_time = min(batch_time, _timed(target, [(cache, 1) for cache in batch]))
    verify = {n: times[prefix, n] for n in rows}
    verify_long = {n: times[contexts[-1], n] for n in rows} if len(contexts) > 1 else {}
    sequence = max(batch_time - verify[BATCH], 0.0) / (BATCH - 1) if batch else 0.0
    head = catch_up = 0.0
    if time_head is not None and drafter is not None and drafter.head is not None:
        catch_up, head = time_head(target, drafter, repeats)
    return StepCost(verify, head, catch_up, verify_long=verify_long, sequence=sequence)


def _filled(target, context: int, rows: int):
    """A cache holding `context` committed tokens, with room for `rows` more."""
    cache = target.new_cache(context + rows)
    target.forward((torch.arange(context, device=target.device) * 7919 + 11) % target.vocab_size, cache)
    cache.commit(context)
    return cache


def _timed(target, blocks: list[tuple]) -> float:
    """Seconds of one step over `blocks` [(cache, nodes)]: the forward over each block's chain of that many nodes,
    the lm_head rows acceptance projects (each chain its likely path), and each root's commit; the caches are then
    put back as they were."""
    dev = target.device
    lengths = [cache.length for cache, _ in blocks]
    chains = [(torch.arange(n, device=dev) * 31 + 5) % target.vocab_size for _, n in blocks]
    sync(dev)
    start = time.perf_counter()
    outs = target.verify([(tokens, cache, None, None) for tokens, (cache, _) in zip(chains, blocks)])
    projected = NodeLogits.together(target.lm, [(hidden, list(range(n))) for (hidden, _), (_, n) in zip(outs, blocks)])
    root = torch.zeros(1, dtype=torch.long, device=dev)
    for nodes, (cache, _) in zip(projected, blocks):
        nodes.top_token(0)
        cache.compact(root)
    sync(dev)
    seconds = time.perf_counter() - start
    for (cache, _), length in zip(blocks, lengths):
        cache.truncate(length)
    return seconds


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


CAPS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64)   # tree caps a batched step of a fixed method chooses from
CAP_PRIOR = 4.0      # steps a cap's prior counts as
CAP_EMA = 0.1        # weight of a step in a cap's running figures


def prior_tokens(n: int) -> float:
    """Tokens a sequence is expected to get from a tree of n nodes before any is seen: 1 for a plain step, a
    log-like growth above (acceptance grows with the tree, ever more slowly)."""
    return min(float(n), 1.0 + 0.6 * math.log2(n)) if n > 1 else 1.0


class Caps:
    """The tree cap of a batched step (a server's) for a drafter without a controller of its own (a fixed method):
    of CAPS up to the configured tree, the one of the most tokens per second,

        rate(n) = B E(n) / (B draft(n) + catch_up(n) + cost.step(B n'(n), sequences=B))

    with the step costs above (method auto's controller weighs the same), and E(n), n'(n), draft(n) the running
    tokens, tree nodes and draft seconds sequences got at cap n (from a prior, `prior_tokens`). As the batch grows
    each node costs more and the caps shrink, down to plain steps. One sequence runs the configured tree: what the
    CLI runs. A plain step lets a head sit out (it queues the target's features it did not read); the next head step
    reads every sequence's queue first. catch_up(n > 1) prices that: each sequence's queued rows times the running
    seconds of a queued row (learned from the head steps that caught up), spread over the steps the sequence has left
    at E(n) tokens a step (a catch-up is paid once, for every later head step of the answer)."""

    def __init__(self, cost: StepCost, max_nodes: int) -> None:
        self.cost = cost
        self.caps = [c for c in CAPS if c < max_nodes] + [max_nodes]
        self.seen = {c: [prior_tokens(c), float(c), 0.0] for c in self.caps}
        self.count = {c: 0 for c in self.caps}
        self.row, self.rows_seen = 0.0, 0      # seconds of one queued row in a head's catch-up; steps that taught it

    def rate(self, batch: int, cap: int, queued: list[tuple[int, int]] = ()) -> float:
        tokens, nodes, draft = self.seen[cap]
        catch_up = sum(rows * self.row / max(1.0, left / tokens) for rows, left in queued) if cap > 1 else 0.0
        return batch * tokens / (batch * draft + catch_up
                                 + self.cost.step(max(1, round(batch * nodes)), sequences=batch))

    def choose(self, batch: int, queued: list[tuple[int, int]] = ()) -> int | None:
        """The cap for a step of `batch` sequences; None (the configured tree) for one sequence. queued: per
        sequence, (feature rows its head has queued, tokens it has left)."""
        if batch <= 1:
            return None
        return max(self.caps, key=lambda c: self.rate(batch, c, queued))

    def observe(self, cap: int | None, per_sequence: list[tuple[int, float, float]],
                queued: list[int] | None = None) -> None:
        """A step at `cap` (None: the configured tree): per sequence, (tokens emitted, tree nodes, draft seconds),
        and the rows its head had queued before the step (a head step read them: their part of its draft seconds
        teaches the row cost, and the cap's draft figure keeps the rest)."""
        cap = self.caps[-1] if cap is None else cap
        if cap not in self.seen:
            return
        rows, caught = (sum(queued) if queued is not None and cap > 1 else 0), 0.0
        if rows:   # a batch's heads draft in one forward whose seconds its sequences share: learned per step
            caught = max(sum(d for _, _, d in per_sequence) - len(per_sequence) * self.seen[cap][2], 0.0)
            self.row += max(CAP_EMA, 1.0 / (self.rows_seen + 1)) * (caught / rows - self.row)
            self.rows_seen += 1
        for tokens, nodes, draft in per_sequence:
            draft -= caught / len(per_sequence)
            weight = max(CAP_EMA, 1.0 / (CAP_PRIOR + self.count[cap] + 1))
            self.seen[cap] = [old + weight * (new - old) for old, new in zip(self.seen[cap], (tokens, nodes, draft))]
            self.count[cap] += 1
