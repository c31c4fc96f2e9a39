"""The generation loop: prefill -> draft -> verify -> accept -> cache commit -> next.

One loop serves every method: plain decoding is speculative decoding whose drafter proposes the root
alone. The path of a token:
  1. prefill: the target reads the prompt; its last logits choose the first new token (the root).
  2. draft:   the drafter proposes a tree of continuations under the root (drafters/).
  3. verify:  the target reads the whole tree in one forward with the tree mask (target.py, tree.py).
  4. accept:  the longest path the target agrees with, plus one bonus token (accept.py); the lm_head
              projects only the nodes that walk reads (lm_head.NodeLogits; greedy: their certified argmax),
              and the tree's probes, whose outputs the drafter reads back (`observe`: lookahead's window).
  5. commit:  the accepted nodes' KV entries move next to the prefix (kv_cache.py); the bonus is the next root.
The engine knows drafters (drafter.py) and observers (observer.py: `Engine.observers` see each prefill, accepted step
and finished answer), nothing else: what a drafter plans travels with its tree and comes back to it (`observe`).
"""
from __future__ import annotations

import contextlib
import dataclasses
import numbers
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Protocol

import torch

from ..config import GenerationConfig, TreeConfig
from ..kv_cache import ContextOverflowError, StaticKVCache
from ..targets.lm_head import NodeLogits
from ..targets.model import Target
from ..tree import DraftTree
from .accept import accept, sample, target_probs
from .drafter import Drafter, DraftInput, NoDrafter, propose_together
from .observer import Observer, Step


@dataclass
class GenerationStats:
    prompt_tokens: int = 0
    reused_prompt_tokens: int = 0      # prompt tokens whose KV entries were kept from the previous call
    new_tokens: int = 0
    target_forwards: int = 0           # prefill included
    accept_lengths: list[int] = field(default_factory=list)  # tokens emitted per verify forward (bonus included)
    draft_depths: list[int] = field(default_factory=list)    # each verified tree's deepest node (0: a plain step)
    prefill_seconds: float = 0.0
    draft_seconds: float = 0.0
    verify_seconds: float = 0.0        # target forward over the tree (hidden states)
    accept_seconds: float = 0.0        # lm_head rows the acceptance walk reads, acceptance, cache commit
    seconds: float = 0.0               # wall time, prefill included
    stop_reason: str = ""              # "eos" | "length" | "context"; "interrupted" where a caller stopped it

    @property
    def tokens_per_s(self) -> float:
        return self.new_tokens / self.seconds if self.seconds > 0 else 0.0

    @property
    def accept_length_mean(self) -> float:
        return sum(self.accept_lengths) / len(self.accept_lengths) if self.accept_lengths else 0.0

    def as_dict(self) -> dict:
        return {
            "prompt_tokens": self.prompt_tokens, "new_tokens": self.new_tokens,
            "target_forwards": self.target_forwards, "accept_length_mean": round(self.accept_length_mean, 4),
            "seconds": round(self.seconds, 4), "tokens_per_s": round(self.tokens_per_s, 3),
            "prefill_seconds": round(self.prefill_seconds, 4), "draft_seconds": round(self.draft_seconds, 4),
            "verify_seconds": round(self.verify_seconds, 4), "accept_seconds": round(self.accept_seconds, 4),
            "stop_reason": self.stop_reason,
        }


@dataclass
class GenerationResult:
    token_ids: list[int]
    stats: GenerationStats


def depth_acceptance(accept_lengths: list[int], draft_depths: list[int]) -> list[dict]:
    """Acceptance at each draft position, from the steps' accepted lengths (bonus included) and their trees' depths
    (as vLLM and SpecForge report it): per depth k, the steps whose tree reached depth k (`drafted`), those that
    accepted a token there (`accepted`), `rate` = accepted / drafted, and `conditional` = accepted / the drafted
    steps that had accepted depth k - 1 (the chance the k-th token is taken once the (k-1)-th was)."""
    steps = list(zip(accept_lengths, draft_depths))
    rows = []
    for k in range(1, max(draft_depths, default=0) + 1):
        drafted = [n - 1 for n, depth in steps if depth >= k]
        accepted = sum(a >= k for a in drafted)
        reached = sum(a >= k - 1 for a in drafted)
        rows.append({"depth": k, "drafted": len(drafted), "accepted": accepted,
                     "rate": accepted / len(drafted) if drafted else 0.0,
                     "conditional": accepted / reached if reached else 0.0})
    return rows


def token_budget(prompt_ids: list[int], target: Target, max_new_tokens: int) -> int:
    """How many new tokens `prompt_ids` may get: `max_new_tokens`, cut to the context window left. An empty prompt,
    one that fills the window, or one with an id that is not a token of the target's vocabulary is refused."""
    n_prompt = len(prompt_ids)
    if n_prompt == 0:
        raise ValueError("the prompt is empty: give at least one token")
    vocab = target.vocab_size
    bad = next((i for i, t in enumerate(prompt_ids)
                if isinstance(t, bool) or not isinstance(t, numbers.Integral) or not 0 <= t < vocab), None)
    if bad is not None:
        raise ValueError(f"prompt token {bad} is {prompt_ids[bad]!r}, not a token id of target '{target.name}' "
                         f"(0 to {vocab - 1})")
    if n_prompt >= target.max_context:
        raise ContextOverflowError(
            f"the prompt has {n_prompt} tokens but target '{target.name}' has a context window of "
            f"{target.max_context}: shorten the prompt (or drop earlier chat turns)"
        )
    return min(max_new_tokens, target.max_context - n_prompt)


def shared_start(a: list[int], b: list[int]) -> int:
    """How many leading tokens `a` and `b` have in common."""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def reusable(cached: list[int], prompt_ids: list[int]) -> int:
    """How many of a cache's leading tokens (`cached`) a new prompt may keep: fewer than they share, since a
    drafter's pair t holds token t + 1, which must be unchanged too; and fewer than the prompt, whose last token is
    always re-read for its logits."""
    return max(0, min(shared_start(cached, prompt_ids) - 1, len(prompt_ids) - 1))


@dataclass
class Sequence:
    """One sequence being decoded: its own KV cache and drafter, the tokens so far, and what its next step reads.
    `Engine.begin` makes one (prefilling its prompt); `Engine.step` advances any number of them together."""

    drafter: Drafter
    cache: StaticKVCache | None        # None: the step backend keeps the sequence's caches (`Engine.backend`)
    cfg: GenerationConfig
    stats: GenerationStats
    tokens: list[int]                  # prompt + generated; the last is the next tree's root, not in the cache yet
    features: torch.Tensor | None      # [m, H'] the target's features of the tokens committed by the last forward
    budget: int                        # new tokens it may get (`token_budget`)
    eos: set[int]
    generator: torch.Generator | None  # its own sampling stream: a batch-mate never moves it
    start: float                       # perf_counter at its prefill
    observers: tuple[Observer, ...] = ()   # `Engine.observers` when it began
    notes: dict = field(default_factory=dict)   # what each observer keeps of it, by observer

    @property
    def done(self) -> bool:
        return bool(self.stats.stop_reason)

    @property
    def answer(self) -> list[int]:
        """The tokens emitted so far (a token a last step verified past a stop is not one of them)."""
        start = self.stats.prompt_tokens
        return self.tokens[start:start + self.stats.new_tokens]

    def emit(self, new: list[int]) -> list[int]:
        """`new` cut exactly where the target alone would stop (at EOS or the token budget); the stats count them and
        the wall time since `start`, and record why it stopped."""
        out, stats = [], self.stats
        for tok in new:
            out.append(tok)
            if tok in self.eos:
                stats.stop_reason = "eos"
                break
            if stats.new_tokens + len(out) == self.budget:
                stats.stop_reason = "length" if self.budget == self.cfg.max_new_tokens else "context"
                break
        stats.new_tokens += len(out)
        stats.seconds = time.perf_counter() - self.start
        return out

    def advance(self, new: list[int]) -> list[int]:
        """Count one verify forward whose accepted tokens (the bonus last) are `new`: what of them is emitted."""
        self.tokens += new
        self.stats.target_forwards += 1
        out = self.emit(new)
        self.stats.accept_lengths.append(len(out))
        return out


class StepBackend(Protocol):
    """What runs a sequence's steps in place of the engine's tree step (`Engine.backend`), on caches of its own: the
    fixed-shape step (static.step.StaticStep). The engine's loop chooses the first token, stops and counts."""

    def running(self) -> contextlib.AbstractContextManager: ...   # around a whole call

    def prefill(self, prompt_ids: list[int], cfg: GenerationConfig, budget: int, generator: torch.Generator | None,
                choose, observed: bool = False) -> int: ...   # reads the prompt; returns choose(the last prompt
    #                                                         token's final hidden state); observed: keep what follows

    def step(self, seq: Sequence) -> list[int]: ...   # one draft + verify: the accepted tokens, the bonus last

    def seen_prompt(self) -> tuple[torch.Tensor, torch.Tensor]: ...   # observed: the prompt's hidden, features

    def seen(self) -> tuple[DraftTree, list[int], torch.Tensor, torch.Tensor]: ...   # the last step's tree, path,
    #                                                                                 hidden and features


class Engine:
    """Generates from one target with one drafter, one sequence (`stream`) or a batch of them (`begin`, `step`).

    The KV caches are allocated once (grown only when a longer sequence needs it, never past the
    context window), so memory stays bounded over a long conversation. A prompt that starts with the
    tokens of the previous call (the next turn of a chat) reuses their cache entries instead of
    re-reading them. `stream` is `begin` then `step([sequence])` until it stops: the loop a server runs over a
    changing batch (eagle_lite.serve) is this one, with more sequences in the list.
    """

    def __init__(self, target: Target, drafter: Drafter | None = None, backend: StepBackend | None = None) -> None:
        self.target = target
        self.drafter = drafter or NoDrafter()
        # what runs `stream`'s steps on caches of its own (the fixed-shape step); None: the tree step (`step`)
        self.backend = backend
        self._cache: StaticKVCache | None = None
        self._cached_tokens: list[int] = []   # what the committed cache slots hold
        self.last_verify: tuple[int, float] = (0, 0.0)   # (tree nodes, seconds) of the last step's target forward
        self.observers: list[Observer] = []   # called with each sequence's prefill, steps and end (observer.py)

    def _cache_for(self, prompt_ids: list[int], max_len: int) -> tuple[StaticKVCache, int]:
        """A cache for this call and how many leading prompt tokens it already holds."""
        if self._cache is None:
            self._cache = self.target.new_cache(max_len)
        elif self._cache.max_len < max_len:
            # grow geometrically (a chat grows a little every turn), keeping the committed entries
            self._cache = self._cache.grown(max(max_len, min(2 * self._cache.max_len, self.target.max_context)))
        keep = self.drafter.reset(max_len, reusable(self._cached_tokens, prompt_ids))
        self._cache.truncate(keep)
        self._cached_tokens = []  # until this call commits a consistent state
        return self._cache, keep

    def reset(self) -> None:
        """Forget the cached conversation (the next call re-reads its whole prompt)."""
        self._cached_tokens = []

    def fresh_cache(self, prompt_ids: list[int], cfg: GenerationConfig, drafter: Drafter) -> StaticKVCache:
        """An empty cache of `slots()` slots for a new sequence, its drafter reset to match."""
        need = self.slots(prompt_ids, cfg, drafter)
        drafter.reset(need, 0)
        return self.target.new_cache(need)

    def slots(self, prompt_ids: list[int], cfg: GenerationConfig, drafter: Drafter | None = None) -> int:
        """The KV cache slots a sequence of this prompt and config needs: prompt + token budget + one tree."""
        n_prompt = len(prompt_ids)
        return n_prompt + token_budget(prompt_ids, self.target, cfg.max_new_tokens) + \
            (drafter or self.drafter).max_tree_nodes(cfg.tree)

    def generate(self, prompt_ids: list[int], cfg: GenerationConfig = GenerationConfig()) -> GenerationResult:
        stats = GenerationStats()
        tokens = [t for step in self.stream(prompt_ids, cfg, stats) for t in step]
        return GenerationResult(tokens, stats)

    @torch.inference_mode()
    def stream(self, prompt_ids: list[int], cfg: GenerationConfig = GenerationConfig(),
               stats: GenerationStats | None = None) -> Iterator[list[int]]:
        """Yield the new tokens of each step; `stats` (if given) is filled in as it goes. The steps are the tree
        step's (`step`), or the step backend's where the engine has one."""
        backend = self.backend
        with backend.running() if backend is not None else contextlib.nullcontext():
            if backend is None:
                cache, keep = self._cache_for(prompt_ids, self.slots(prompt_ids, cfg))
                seq, first = self.begin(prompt_ids, cfg, stats=stats, cache=cache, keep=keep)
            else:
                seq, first = self._begin_on(backend, prompt_ids, cfg, stats)
            self._cached_tokens = seq.tokens[:seq.cache.length] if seq.cache is not None else []
            yield first
            while not seq.done:
                self._cached_tokens = []  # an interrupted compaction would leave the cache inconsistent
                out = self.step([seq])[0] if backend is None else self._step_on(backend, seq)
                self._cached_tokens = seq.tokens[:seq.cache.length] if seq.cache is not None else []
                yield out

    def _begin_on(self, backend: StepBackend, prompt_ids: list[int], cfg: GenerationConfig,
                  stats: GenerationStats | None) -> tuple[Sequence, list[int]]:
        """`begin` on a step backend, which reads the prompt into caches of its own; the first token is chosen as
        `begin` chooses it."""
        stats = stats if stats is not None else GenerationStats()
        budget = token_budget(prompt_ids, self.target, cfg.max_new_tokens)
        generator = _generator(cfg, self.target.device)
        stats.prompt_tokens, stats.reused_prompt_tokens = len(prompt_ids), 0
        start = time.perf_counter()
        observers = tuple(self.observers)
        first = backend.prefill(prompt_ids, cfg, budget, generator,
                                lambda last: first_token(self.target, last, cfg, generator), bool(observers))
        stats.target_forwards = 1
        stats.prefill_seconds = time.perf_counter() - start
        eos = self.target.eos_token_ids if cfg.stop_at_eos else set()
        seq = Sequence(self.drafter, None, cfg, stats, [*prompt_ids, first], None, budget, eos, generator, start,
                       observers)
        out = seq.emit([first])
        if observers:
            self._notify_start(seq, *backend.seen_prompt(), 0)
        return seq, out

    def _step_on(self, backend: StepBackend, seq: Sequence) -> list[int]:
        """One step of `seq` on a step backend; its observers see it as they see the tree step's (`step`), its draft
        not timed apart (`Step.draft_seconds` 0: the backend runs draft and verify as one)."""
        start = time.perf_counter()
        out = seq.advance(backend.step(seq))
        if seq.observers:
            tree, path, hidden, features = backend.seen()
            self._notify(seq, Step(tree, path, out, hidden, features, 0.0, time.perf_counter() - start))
        return out

    @staticmethod
    def _notify_start(seq: Sequence, hidden: torch.Tensor, features: torch.Tensor, read_from: int) -> None:
        """`seq`'s observers see its prefill (and its end, where its first token stopped it)."""
        for observer in seq.observers:
            observer.on_start(seq, hidden, features, read_from)
            if seq.done:
                observer.on_finish(seq)

    @staticmethod
    def _notify(seq: Sequence, step: Step) -> None:
        """`seq`'s observers see its accepted step (and its end, where it stopped)."""
        for observer in seq.observers:
            observer.on_step(seq, step)
            if seq.done:
                observer.on_finish(seq)

    @torch.inference_mode()
    def begin(self, prompt_ids: list[int], cfg: GenerationConfig = GenerationConfig(),
              drafter: Drafter | None = None, stats: GenerationStats | None = None,
              cache: StaticKVCache | None = None, keep: int = 0) -> tuple[Sequence, list[int]]:
        """Prefill a new sequence and choose its first token: (the sequence, [first token] as emitted).

        drafter: the sequence's own (None: the engine's); a batch gives each sequence one of its own, since a
        drafter keeps per-sequence state. cache: a cache whose first `keep` slots already hold the prompt's first
        tokens (`stream`'s chat reuse); None: a fresh one of `slots()` slots, and the drafter is reset."""
        return self._prefill([_Start(prompt_ids, cfg, drafter or self.drafter, stats, cache, keep)])[0]

    @torch.inference_mode()
    def begin_all(self, starts: list[tuple]) -> list[tuple[Sequence, list[int]]]:
        """`begin` for several new sequences, (prompt, config, drafter, stats or None[, cache, keep, before]) each:
        what their caches do not hold yet is read in ONE target forward (a server's requests that join its batch
        together), each over its own cache, so each gets what its own prefill gives (to fp32 rounding)."""
        return self._prefill([_Start(*start) for start in starts])

    @torch.inference_mode()
    def read_part(self, ids: list[int], cache: StaticKVCache, drafter: Drafter) -> torch.Tensor:
        """Read a part of a long prompt into `cache` (a prefill in chunks: a server reads one between steps, so the
        running sequences do not wait for the whole prompt); returns the tokens' features, which `begin_all` takes
        as `before` when it reads the rest and chooses the first token."""
        ((_, features),) = self.target.verify([(torch.tensor(ids, device=self.target.device), cache, None, None)],
                                              taps=_taps(drafter))
        cache.commit(len(ids))
        return features

    def _prefill(self, starts: list[_Start]) -> list[tuple[Sequence, list[int]]]:
        target = self.target
        taps = _taps(starts[0].drafter)
        if any(_taps(s.drafter) != taps for s in starts):
            raise ValueError("sequences prefilled together must read the same feature layers")
        ready = []   # (start, stats, budget, cache, generator)
        for s in starts:
            stats = s.stats if s.stats is not None else GenerationStats()
            budget = token_budget(s.prompt_ids, target, s.cfg.max_new_tokens)
            cache, keep = s.cache, s.keep
            if cache is None:
                cache, keep = self.fresh_cache(s.prompt_ids, s.cfg, s.drafter), 0
            generator = _generator(s.cfg, target.device)
            stats.prompt_tokens, stats.reused_prompt_tokens = len(s.prompt_ids), keep
            ready.append((s, stats, budget, cache, generator))
        start = time.perf_counter()
        # 1. prefill (what each cache does not hold yet): only the last prompt token's next token is read
        outs = target.verify([(torch.tensor(s.prompt_ids[cache.length:], device=target.device), cache, None, None)
                              for s, _, _, cache, _ in ready], taps=taps)    # per sequence: T H, T H'
        last = [hidden[-1] for hidden, _ in outs]
        greedy = [i for i, (s, *_) in enumerate(ready) if s.cfg.sampling.greedy]
        firsts: dict[int, int] = {}
        if len(greedy) > 1:   # every greedy sequence's first token from one lm_head product
            rows = NodeLogits.together(target.lm, [(last[i][None], [0]) for i in greedy])
            firsts = {i: nodes.top_token(0) for i, nodes in zip(greedy, rows)}
        begun = []
        for i, ((s, stats, budget, cache, generator), (hidden, read)) in enumerate(zip(ready, outs)):
            read_from = cache.length
            cache.commit(len(s.prompt_ids) - cache.length)
            features = read if s.before is None else torch.cat([s.before, read])
            first = firsts[i] if i in firsts else first_token(target, last[i], s.cfg, generator)
            stats.target_forwards = 1
            stats.prefill_seconds = time.perf_counter() - start
            eos = target.eos_token_ids if s.cfg.stop_at_eos else set()
            seq = Sequence(s.drafter, cache, s.cfg, stats, list(s.prompt_ids) + [first], features, budget, eos,
                           generator, start, tuple(self.observers))
            begun.append((seq, seq.emit([first])))
            self._notify_start(seq, hidden, read, read_from)
        return begun

    @torch.inference_mode()
    def step(self, seqs: list[Sequence], caps: list[int | None] | None = None) -> list[list[int]]:
        """One step of every sequence in `seqs` (none of them done): each one's drafter proposes a tree, the
        target verifies all the trees in ONE forward (`Target.verify`: each tree sees its own cache and its own
        ancestors), then each sequence accepts and commits its own path. Returns each sequence's new tokens.

        caps: the most tree nodes (root included) each sequence may verify this step; None: its drafter's tree as
        configured (`draft_all`). Any tree is verified exactly, so a server shrinks them as its batch grows without
        changing what greedy decoding outputs."""
        target = self.target
        caps = caps if caps is not None else [None] * len(seqs)
        taps = _taps(seqs[0].drafter)
        if any(_taps(seq.drafter) != taps for seq in seqs):
            raise ValueError("sequences verified together must read the same feature layers")
        # 2. draft a tree rooted at each sequence's last chosen token (EAGLE heads: their forwards batched)
        drafted_before = [seq.stats.draft_seconds for seq in seqs]
        drafted = draft_all(seqs, caps)
        # 3. verify every node of every tree in one forward
        t1 = time.perf_counter()
        outs = target.verify([(tree.tokens, seq.cache, tree.ancestors, tree.depths)
                              for seq, tree in zip(seqs, drafted)], taps=taps)   # per sequence: N H, N H'
        t2 = time.perf_counter()
        self.last_verify = (sum(len(tree) for tree in drafted), t2 - t1)
        # 4. accept  5. commit the accepted path, sequence by sequence; the lm_head rows of every sequence's
        # likeliest path (a plain step: its root) are projected together first
        t3 = time.perf_counter()
        paths = [tree.likely_path() for tree in drafted]
        projected = NodeLogits.together(target.lm, [(hidden, likely) for (hidden, _), likely in zip(outs, paths)])
        shared = (time.perf_counter() - t3) / len(seqs)
        emitted = []
        for seq, tree, (hidden, features), likely, nodes, before in zip(seqs, drafted, outs, paths, projected,
                                                                        drafted_before):
            t3 = time.perf_counter() - shared
            if tree.probes:
                nodes.prefetch(tree.probes + likely)   # with the rows the drafter reads back: one product
            path, bonus = accept(tree, nodes, seq.cfg.sampling, seq.generator)
            seq.drafter.observe(tree, nodes, path)   # the target's outputs at the nodes it verified (lookahead, auto)
            seq.cache.compact(torch.tensor(path, device=target.device))
            seq.features = features[path]  # the accepted nodes' features feed the drafter next round
            new = tree.tokens[path[1:]].tolist() + [bonus]
            stats = seq.stats
            stats.verify_seconds += t2 - t1
            stats.accept_seconds += time.perf_counter() - t3
            out = seq.advance(new)
            stats.draft_depths.append(tree.depth)
            emitted.append(out)
            if seq.observers:
                draft = stats.draft_seconds - before
                self._notify(seq, Step(tree, path, out, hidden, features, draft,
                                       draft + (t2 - t1) / len(seqs) + time.perf_counter() - t3))
        return emitted


@dataclass
class _Start:
    """A sequence to prefill (`Engine.begin`): its prompt and config, its drafter, stats to fill (None: new), and a
    cache whose first `keep` slots hold the prompt's first tokens (None: a fresh one), then any more it read in parts
    (`Engine.read_part`), whose features are `before`."""

    prompt_ids: list[int]
    cfg: GenerationConfig
    drafter: Drafter
    stats: GenerationStats | None = None
    cache: StaticKVCache | None = None
    keep: int = 0
    before: torch.Tensor | None = None   # features of the prompt tokens after `keep` read already (`read_part`)


def draft_all(seqs: list[Sequence], caps: list[int | None]) -> list[DraftTree]:
    """Each sequence's drafter's tree, at most its cap nodes (root included; None: as configured), adding the time
    to its stats.

    cap 1 is a plain decoding step: the root alone, where the drafter can sit the step out (`sit_out`: it keeps
    what it must learn of the step; drafters that cannot draft as usual). Otherwise an EAGLE tree's budget
    (`TreeConfig.total_tokens`) shrinks to the cap, and a deterministic tree still larger (a lookup chain, a
    grafted path) keeps its first `cap` nodes. Sampled trees keep the drafter's own budget: which sampled nodes are
    kept must not depend on their draws.

    Greedy sequences propose together (`Drafter.proposal`, `propose_together`: EAGLE heads' forwards batched),
    sharing its time; each tree is the one its drafter proposes alone (docs/serve.md, "Batched drafting").

    Each drafter class is told of the step's batch first (`Drafter.seat(drafters, configs)`: method auto's
    controllers weigh the batch's step, which is what sizes their trees; their caps are None)."""
    t0 = time.perf_counter()
    seated: dict[type, list[Sequence]] = {}
    for seq in seqs:
        seated.setdefault(type(seq.drafter), []).append(seq)
    for kind, batch in seated.items():
        kind.seat([seq.drafter for seq in batch], [seq.cfg for seq in batch])
    plans = [_plan(seq, cap) for seq, cap in zip(seqs, caps)]   # the root alone (sat out), or (input, tree)
    together = [i for i, (seq, plan) in enumerate(zip(seqs, plans))
                if not isinstance(plan, DraftTree) and seq.cfg.sampling.greedy]
    together = together if len(together) >= 2 else []
    trees: list[DraftTree | tuple] = list(plans)
    if together:
        for i, tree in zip(together, propose_together([seqs[i].drafter.proposal(*plans[i]) for i in together])):
            trees[i] = tree
        share = (time.perf_counter() - t0) / len(together)
        for i in together:
            seqs[i].stats.draft_seconds += share
    for i, (seq, plan) in enumerate(zip(seqs, plans)):
        if i not in together and not isinstance(plan, DraftTree):
            t1 = time.perf_counter()
            trees[i] = seq.drafter.propose(*plan)
            seq.stats.draft_seconds += time.perf_counter() - t1
    return [_cut(tree, cap) for tree, cap in zip(trees, caps)]


def _plan(seq: Sequence, cap: int | None) -> DraftTree | tuple[DraftInput, TreeConfig]:
    """What `draft_all` asks the sequence's drafter: (its input, the tree config cut to `cap`), or the root alone
    where the drafter sits a plain step out."""
    inp = DraftInput(seq.tokens, seq.features, seq.cfg.sampling, seq.generator)
    if cap is not None and cap <= 1 and seq.drafter.sit_out(inp):
        return DraftTree(torch.tensor([inp.root], device=seq.features.device), [-1])
    tree_cfg = seq.cfg.tree
    if cap is not None and cap - 1 < tree_cfg.total_tokens:
        tree_cfg = dataclasses.replace(tree_cfg, total_tokens=max(1, cap - 1))
    return inp, tree_cfg


def _cut(tree: DraftTree, cap: int | None) -> DraftTree:
    """A deterministic tree larger than `cap` keeps its first `cap` nodes (`draft_all`)."""
    if cap is not None and len(tree) > cap and tree.q_draft is None and not tree.probes:
        tree = tree.truncated(max(cap, 1))
    return tree


def _generator(cfg: GenerationConfig, device) -> torch.Generator | None:
    """A sampled sequence's own random stream (seeded by `cfg.seed`, else at random); None for greedy decoding."""
    if cfg.sampling.greedy:
        return None
    generator = torch.Generator(device=device)
    generator.manual_seed(cfg.seed if cfg.seed is not None else int(torch.seed()))
    return generator


def first_token(target: Target, last: torch.Tensor, cfg: GenerationConfig, generator: torch.Generator | None) -> int:
    """The first new token after the prompt, from the last prompt token's final hidden state [H]: the target's argmax,
    or a draw from its sampling distribution."""
    if cfg.sampling.greedy:
        return target.top_token(last)
    return sample(target_probs(target.logits(last[None])[0], cfg.sampling), generator)


def _taps(drafter: Drafter) -> tuple[int, ...]:
    """The decoder layers whose outputs the drafter reads besides the final hidden states (EAGLE-3 heads)."""
    return tuple(drafter.feature_layers)
