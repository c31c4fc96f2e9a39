"""The batch loop: requests join a running batch between steps and leave it when they finish or are cancelled.

One worker thread owns the engine. Each turn it admits waiting requests while the batch has room (`Engine.begin_all`,
each with a pooled drafter; a long prompt a part a turn), drops those cancelled or stopped, then runs one
`Engine.step` over the batch, under the tree cap of `decoding.cost.Caps`. Events go back to each request's `sink`
(called on this thread): ("tokens", ids), ("done", stats), ("error", message). The last `Limits.prefix_cache`
finished requests' caches and drafters are kept for prompts that share their start. Admission enforces the limits:
a full queue or KV budget (every admitted request's prompt, token budget and one tree) refuses with 429
(`Refused`), a draining server with 503. docs/serve.md is the manual.
"""
from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from ..config import GenerationConfig, check_finite, check_whole
from ..decoding.cost import Caps
from ..decoding.drafter import Drafter
from ..decoding.engine import Engine, GenerationStats, Sequence, reusable, shared_start, token_budget
from ..kv_cache import ContextOverflowError, StaticKVCache
from ..threads import set_threads

log = logging.getLogger("eagle_lite.serve")


class Refused(Exception):
    """A request the server will not take now or at all: an HTTP status and the OpenAI error's fields."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code


@dataclass(frozen=True)
class Limits:
    """max_batch: sequences decoded together; max_queue: requests waiting for a place; max_prompt_tokens,
    max_tokens: the longest prompt and answer a request may ask for; kv_budget_mb: the target's KV cache memory
    for all admitted requests together (and the finished ones kept for their prefix); drain_seconds: how long a
    SIGTERM waits for running requests; prefix_cache: finished sequences whose KV cache is kept for requests whose
    prompt starts the same way (0: none)."""

    max_batch: int = 8
    max_queue: int = 64
    max_prompt_tokens: int = 4096
    max_tokens: int = 2048
    kv_budget_mb: float = 2048.0
    drain_seconds: float = 60.0
    prefix_cache: int = 4

    def __post_init__(self) -> None:
        for name in ("max_batch", "max_prompt_tokens", "max_tokens"):
            check_whole(name, getattr(self, name), 1)
        check_whole("max_queue", self.max_queue, 0)
        check_whole("prefix_cache", self.prefix_cache, 0)
        if check_finite("kv_budget_mb", self.kv_budget_mb) <= 0:
            raise ValueError(f"kv_budget_mb must be > 0, got {self.kv_budget_mb}")
        if check_finite("drain_seconds", self.drain_seconds) < 0:
            raise ValueError(f"drain_seconds must be >= 0, got {self.drain_seconds}")


@dataclass
class Job:
    """One request as the worker sees it."""

    prompt_ids: list[int]
    cfg: GenerationConfig
    sink: Callable[[tuple], None]
    kv_bytes: int = 0
    stats: GenerationStats = field(default_factory=GenerationStats)
    cancelled: bool = False

    def cancel(self) -> None:
        """Free the sequence at the next step (a client that went away, a stop string found)."""
        self.cancelled = True


@dataclass
class Donor:
    """A finished sequence kept for its prompt prefix (`Limits.prefix_cache`): the tokens its KV cache holds, the
    cache, the drafter whose state matches it, and the KV bytes it holds."""

    tokens: list[int]
    cache: StaticKVCache
    drafter: Drafter
    kv_bytes: int


@dataclass
class Admitted:
    """A request on its way into the batch: its drafter, the cache it starts from (None: a fresh one) and how many
    leading prompt tokens that cache holds; a long prompt read in parts also the features of the parts so far."""

    job: Job
    drafter: Drafter
    cache: StaticKVCache | None = None
    keep: int = 0
    parts: list[torch.Tensor] = field(default_factory=list)

    @property
    def to_read(self) -> int:
        return len(self.job.prompt_ids) - self.keep


# A request starts from a kept sequence's cache when their tokens agree on at least this many (fewer are cheaper
# to read again than to copy).
MIN_REUSE = 8
# A step of this many sequences or more runs on `threads[1]` torch threads, a smaller one on `threads[0]` (the
# server's --batch-threads and --threads): where clients or other work share the cores, a small step may do better
# on fewer threads than a large one, whose length hides a thread's wait for a core.
BUSY_BATCH = 4
# Requests admitted together are prefilled in one forward, up to this many prompt tokens a forward: a pack of short
# prompts reads the weights once for all of them. A longer prompt is read this many tokens a turn, between steps.
PACK_TOKENS = 1024


def failed(err: Exception) -> tuple:
    """The event a request gets when its generation raised `err`."""
    return "error", f"generation failed ({type(err).__name__}: {err})"


class Scheduler:
    def __init__(self, engine: Engine, make_drafter: Callable[[], Drafter], limits: Limits, tree_nodes: int,
                 cost: Caps, on_step: Callable[[int, int, int, list[int]], None] | None = None,
                 threads: tuple[int, int] | None = None, recorder=None, adapter=None) -> None:
        """make_drafter: a fresh drafter (weights shared, state its own); tree_nodes: the most nodes one tree has.
        cost: the tree caps of a fixed method's steps. on_step(batch, cap, rows, emitted per sequence): called after
        each step (metrics). threads:
        torch CPU threads for steps of fewer than BUSY_BATCH sequences and for larger ones (None: left as they are).
        recorder: where each finished answer is recorded (`text.record.Recorder`; None: nowhere, the default)."""
        self.engine, self.limits, self.cost, self.on_step = engine, limits, cost, on_step
        self.recorder = recorder
        self.adapter = adapter   # eagle_lite_wing.adapt.Adapter (--adapt): its learner runs a step at a time while idle
        self.threads = threads
        self.make_drafter = make_drafter
        self.pool = [make_drafter() for _ in range(limits.max_batch)]   # more are made while kept sequences hold some
        self.tree_nodes = tree_nodes
        cache = engine.target.new_cache(1)
        self.bytes_per_slot = (cache.keys.numel() + cache.values.numel()) * cache.keys.element_size()
        self.budget_bytes = int(limits.kv_budget_mb * 2**20)
        self.reserved = 0                 # KV bytes of the admitted requests (waiting and running)
        self.waiting: deque[Job] = deque()
        self.running: list[tuple[Job, Sequence]] = []
        self.donors: list[Donor] = []     # finished sequences kept for their prefix, the most recent last
        self.reading: list[Admitted] = []  # long prompts read in parts, a part a turn
        self.last_cap: int = 0            # the tree cap of the last step (0: the configured tree)
        self.draining = False
        self._busy = False                # admitted requests between the queue and the batch
        self._stopped = False
        self._cond = threading.Condition()
        self._thread = threading.Thread(target=self.run, name="eagle_lite-batch", daemon=True)

    def start(self) -> None:
        """Run the batch loop on a thread of its own (`run` runs it on the calling thread)."""
        self._thread.start()

    # -- the HTTP side ----------------------------------------------------------------------------
    def check(self, prompt_ids: list[int], max_tokens: int) -> int:
        """The token budget of a request (413/400 where it asks for too much); what `submit` reserves."""
        n_prompt = len(prompt_ids)
        if n_prompt > self.limits.max_prompt_tokens:
            raise Refused(413, f"the prompt has {n_prompt} tokens; this server takes at most "
                               f"{self.limits.max_prompt_tokens}", "messages", "context_length_exceeded")
        if max_tokens > self.limits.max_tokens:
            raise Refused(400, f"max_tokens is {max_tokens}; this server gives at most {self.limits.max_tokens}",
                          "max_tokens", "invalid_value")
        try:
            return token_budget(prompt_ids, self.engine.target, max_tokens)
        except ContextOverflowError as err:   # a prompt that fills the context window
            raise Refused(413, str(err), "messages", "context_length_exceeded") from None
        except ValueError as err:             # an empty prompt, a token id outside the vocabulary
            raise Refused(400, str(err), "prompt", "invalid_value") from None

    def submit(self, job: Job) -> None:
        """Queue a request (Refused: 503 draining, 429 queue or KV budget full)."""
        budget = self.check(job.prompt_ids, job.cfg.max_new_tokens)
        job.kv_bytes = (len(job.prompt_ids) + budget + self.tree_nodes) * self.bytes_per_slot
        with self._cond:
            if self.draining or self._stopped:
                raise Refused(503, "the server is shutting down; retry on another instance", None, "draining")
            if len(self.waiting) >= self.limits.max_queue:
                raise Refused(429, f"{len(self.waiting)} requests are already waiting; retry later", None,
                              "queue_full")
            if job.kv_bytes > self.budget_bytes:
                raise Refused(413, f"this request needs {job.kv_bytes / 2**20:.1f} MiB of KV cache, more than the "
                                   f"server's whole budget ({self.limits.kv_budget_mb:g} MiB): lower max_tokens or "
                                   f"shorten the prompt", "max_tokens", "kv_budget_exceeded")
            while self.reserved + job.kv_bytes > self.budget_bytes and self.donors:
                self._evict()                 # kept prefixes give way to requests
            if self.reserved + job.kv_bytes > self.budget_bytes:
                raise Refused(429, f"the KV cache budget ({self.limits.kv_budget_mb:g} MiB) is taken by running "
                                   f"requests; retry later", None, "kv_budget_full")
            self.reserved += job.kv_bytes
            self.waiting.append(job)
            self._cond.notify()

    def drain(self, timeout: float) -> bool:
        """Refuse new requests, wait (at most `timeout` s) for the admitted ones; whatever is left then is
        stopped with an error event. Returns whether every admitted request finished."""
        with self._cond:
            self.draining = True
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.idle:
                return True
            time.sleep(0.05)
        with self._cond:
            for job in list(self.waiting) + [job for job, _ in self.running] + [a.job for a in self.reading]:
                job.sink(("error", "the server shut down before this request finished"))
                job.cancel()
        return self.idle

    def stop(self) -> None:
        with self._cond:
            self._stopped = True
            self._cond.notify()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout=10)

    def _learns(self) -> bool:
        return self.adapter is not None and self.adapter.has_work()

    @property
    def idle(self) -> bool:
        return not self.waiting and not self.running and not self.reading and not self._busy

    # -- the worker -------------------------------------------------------------------------------
    def run(self) -> None:
        """The batch loop, until `stop`: admit, drop the cancelled, step. A server runs it on the thread that loaded
        the model (torch's OpenMP worker threads belong to the thread that starts them: a second thread running torch
        gets workers of its own, libgomp then throttles their spinning, and a step takes far longer)."""
        while True:
            with self._cond:
                while not self._stopped and self.idle and not self._learns():
                    self._cond.wait()
                if self._stopped:
                    break
                learn = self.idle
            if learn:   # nothing to serve: one step of the head's learner, on this thread (torch's own)
                try:
                    self.adapter.round(steps=1)
                except Exception:  # noqa: BLE001 (a learner's failure must not stop serving)
                    log.exception("the head's learner failed; serving goes on with the head it has, not learning")
                    self.adapter = None
                continue
            with self._cond:
                admit = []
                while self.waiting and len(self.running) + len(self.reading) + len(admit) < self.limits.max_batch:
                    admit.append(self.waiting.popleft())
                self._busy = True
            try:
                self._begin(admit)
                self._read_part()
                self._drop_cancelled()
                if self.running:
                    self._step()
            except Exception as err:  # noqa: BLE001 (the worker must outlive any one request's failure)
                log.exception("a batch step failed; its requests get an error and the server goes on")
                for job, seq in self.running:
                    self._finish(job, seq.drafter, failed(err))
                self.running = []
            with self._cond:
                self._busy = False
        for job, seq in self.running:
            self._finish(job, seq.drafter, ("error", "the server stopped"))
        for a in self.reading:
            self._finish(a.job, a.drafter, ("error", "the server stopped"))
        self.running, self.reading = [], []

    def _begin(self, jobs: list[Job]) -> None:
        """Prefill the admitted requests, several prompts to a forward (`Engine.begin_all`, up to PACK_TOKENS
        prompt tokens to read a pack), each on a kept cache where one shares its start, and let them join."""
        packs: list[list[Admitted]] = []
        for job in jobs:
            if job.cancelled:
                self._release(job)
                continue
            admitted = self._admit(job)
            if admitted is None:
                continue
            if admitted.to_read > PACK_TOKENS:    # a long prompt: read in parts between steps
                if admitted.cache is None:
                    admitted.cache = self.engine.fresh_cache(job.prompt_ids, job.cfg, admitted.drafter)
                self.reading.append(admitted)
            elif packs and sum(a.to_read for a in packs[-1]) + admitted.to_read <= PACK_TOKENS:
                packs[-1].append(admitted)
            else:
                packs.append([admitted])
        for pack in packs:
            try:
                begun = self.engine.begin_all([(a.job.prompt_ids, a.job.cfg, a.drafter, a.job.stats, a.cache, a.keep)
                                               for a in pack])
            except Exception as err:  # noqa: BLE001 (one request's failure: it gets the error, the batch goes on)
                if len(pack) > 1:     # find which: each on its own
                    self.pool += [a.drafter for a in pack]
                    for a in pack:
                        self._begin([a.job])
                    continue
                log.exception("a prefill failed")
                self._finish(pack[0].job, pack[0].drafter, failed(err))
                continue
            for a, (seq, first) in zip(pack, begun):
                self._joined(a.job, seq, first)

    def _read_part(self) -> None:
        """Read the next part (PACK_TOKENS tokens) of the oldest long prompt; one whose rest fits a pack then
        joins the batch through `Engine.begin_all` with the features of its parts. One part a turn, between steps:
        the running sequences wait for a part, not for the whole prompt."""
        if not self.reading:
            return
        a = self.reading[0]
        job, cache = a.job, a.cache
        if job.cancelled:
            self.reading.pop(0)
            self._finish(job, a.drafter, None)
            return
        try:
            done = cache.length
            if len(job.prompt_ids) - done > PACK_TOKENS:
                a.parts.append(self.engine.read_part(job.prompt_ids[done:done + PACK_TOKENS], cache, a.drafter))
            if len(job.prompt_ids) - cache.length <= PACK_TOKENS:
                self.reading.pop(0)
                ((seq, first),) = self.engine.begin_all([(job.prompt_ids, job.cfg, a.drafter, job.stats, cache,
                                                          a.keep, torch.cat(a.parts) if a.parts else None)])
                self._joined(job, seq, first)
        except Exception as err:  # noqa: BLE001 (one request's failure: it gets the error, the batch goes on)
            log.exception("a prefill failed")
            if a in self.reading:
                self.reading.remove(a)
            self._finish(job, a.drafter, failed(err))

    def _admit(self, job: Job) -> Admitted | None:
        """How a request is prefilled: on a kept sequence's cache whose first `keep` tokens it shares (not read
        again, as a chat's next turn in the CLI), else with a pooled drafter on a fresh cache. None where preparing
        it failed (the request got the error)."""
        donor = self._donor_for(job.prompt_ids)
        if donor is None:
            return Admitted(job, self._drafter())
        try:
            need = self.engine.slots(job.prompt_ids, job.cfg, donor.drafter)
            keep = donor.drafter.reset(need, reusable(donor.tokens, job.prompt_ids))
            donor.cache.truncate(keep)
            return Admitted(job, donor.drafter, donor.cache.grown(need), keep)   # exactly the slots it reserved
        except Exception as err:  # noqa: BLE001 (one request's failure: it gets the error, the batch goes on)
            log.exception("a prefill failed")
            self._finish(job, donor.drafter, failed(err))
            return None

    def _drafter(self) -> Drafter:
        with self._cond:
            return self.pool.pop() if self.pool else self.make_drafter()

    def _joined(self, job: Job, seq: Sequence, first: list[int]) -> None:
        job.sink(("tokens", first))
        if seq.done:
            self._finish(job, seq.drafter, ("done", job.stats), seq)
        else:
            self.running.append((job, seq))

    def _donor_for(self, prompt_ids: list[int]) -> Donor | None:
        """The kept sequence sharing the longest prefix with this prompt (at least MIN_REUSE tokens), taken out of
        the kept ones; None where none does."""
        with self._cond:
            best, common = None, 0
            for donor in self.donors:
                n = shared_start(donor.tokens, prompt_ids)
                if n > common:
                    best, common = donor, n
            if best is None or common < MIN_REUSE:
                return None
            self.donors.remove(best)
            self.reserved -= best.kv_bytes
            return best

    def _drop_cancelled(self) -> None:
        kept = []
        for job, seq in self.running:
            if job.cancelled:
                job.stats.stop_reason = job.stats.stop_reason or "cancelled"
                self._finish(job, seq.drafter, None)
            else:
                kept.append((job, seq))
        self.running = kept

    def _step(self) -> None:
        seqs = [seq for _, seq in self.running]
        if self.threads is not None:
            set_threads(self.threads[len(seqs) >= BUSY_BATCH])
        # drafters that are told the batch (`seat`: method auto's controllers) size their own trees from its rows;
        # a fixed method's tree is capped from the step costs
        controlled = all(seq.drafter.seats_batch for seq in seqs)
        cap, queued = None, None
        if not controlled:   # each head's rows queued by sat-out steps, priced against the tokens it has left
            queued = [seq.drafter.queued_rows for seq in seqs]
            cap = self.cost.choose(len(seqs), [(q, seq.budget - seq.stats.new_tokens) for q, seq in zip(queued, seqs)])
        drafting = [seq.stats.draft_seconds for seq in seqs]
        outs = self.engine.step(seqs, [cap] * len(seqs))
        rows, _ = self.engine.last_verify
        self.last_cap = cap or 0
        if not controlled:
            self.cost.observe(cap, [(len(out), rows / len(seqs), seq.stats.draft_seconds - before)
                                    for out, seq, before in zip(outs, seqs, drafting)], queued)
        if self.on_step is not None:
            self.on_step(len(seqs), cap or 0, rows, [len(out) for out in outs])
        kept = []
        for (job, seq), out in zip(self.running, outs):
            job.sink(("tokens", out))
            if seq.done:
                if self.recorder is not None:   # what the target answered, as emitted (--record)
                    start = len(job.prompt_ids)
                    self.recorder.add(job.prompt_ids, seq.tokens[start:start + job.stats.new_tokens])
                self._finish(job, seq.drafter, ("done", job.stats), seq)
            else:
                kept.append((job, seq))
        self.running = kept

    def _finish(self, job: Job, drafter: Drafter, event: tuple | None, seq: Sequence | None = None) -> None:
        """A request leaves: its KV reservation is freed and its drafter goes back to the pool, or, where it finished
        (`seq`) and prefixes are kept, both stay with its cache as the newest kept sequence."""
        self._release(job)
        if seq is not None and self.limits.prefix_cache:
            kv = seq.cache.max_len * self.bytes_per_slot
            with self._cond:
                self.donors.append(Donor(seq.tokens[:seq.cache.length], seq.cache, drafter, kv))
                self.reserved += kv
                while len(self.donors) > self.limits.prefix_cache:
                    self._evict()
        else:
            self.pool.append(drafter)
        if event is not None:
            job.sink(event)

    def _evict(self) -> None:
        """Drop the oldest kept sequence (with the lock held): its memory is freed, its drafter back in the pool."""
        donor = self.donors.pop(0)
        self.reserved -= donor.kv_bytes
        self.pool.append(donor.drafter)

    def _release(self, job: Job) -> None:
        with self._cond:
            self.reserved -= job.kv_bytes
            job.kv_bytes = 0
