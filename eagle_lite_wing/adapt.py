"""`--adapt DIR`: the serving head keeps learning from the traffic it serves, guarded, and persisted in DIR.

Status (measured, docs/adapt.md): at most +0.5% accepted per step on the weak kinds, at 77-115 ms of CPU per
answered token, about ten times what decoding the token costs; the lookup store 0.96-0.97x. Off by default: only
`--adapt DIR` (the CLI, the server, `load(adapt=...)`) turns it on.

The path: an observer of the engine keeps what its verify forwards computed for every answer (capture.py); between
answers
`Adapter.round` judges and trains:
1. **Guard (champion and challenger).** The answers captured since the last judgement are traffic neither head has
   trained on. Once they hold `judge_tokens` answer tokens, the serving head (champion) and the learner's head
   (challenger) are scored on them root for root (learner.py `lengths`: the chain a greedy chain of head
   tokens gets at each answer position), and `verdict` reads the paired differences: a challenger that accepts
   more by at least `confidence` standard errors replaces the serving head; one that accepts less by as much is
   dropped (the learner restarts from the champion). Either way the answers join the learner's pool. Where the
   difference is within the noise, the answers stay held out and the next judgement scores both heads on them
   and the next `judge_tokens` together, up to `max_judge_tokens`; past that they join the pool and training
   goes on with no verdict.
2. **Learner.** `steps` optimizer steps of the training loss on the pool, mixed with replay (learner.py).
3. **Lookup from traffic** (opt-in: `traffic_tokens` > 0). Another observer keeps every finished answer in a store
   (traffic.py, the newest `traffic_tokens`) that prompt lookup copies from across requests, where an
   earlier answer matches a longer n-gram than the request's own context.

Output stays exact whichever head serves: a head only proposes, and the target's acceptance decides.

DIR is an ordinary head folder (`--draft DIR` loads it, `eagle_lite.export` exports it) holding the champion, its
config's `adapted` card (what it learned from; accepted per step before and after each promotion) and the trees and
training objective of the head it started from. It is written only at a promotion, each file atomically, so a crash
or kill loses at most the rounds since and never leaves a half-written head. A DIR holding a head resumes from it; a
head of another target, or a DIR that cannot be written, is refused in one line. `reset()` goes back to the head it
started from.
"""
from __future__ import annotations

import copy
import dataclasses
import logging
import shutil
import time
from pathlib import Path

import torch

from eagle_lite.atomic import check_folder_writable, write_text_atomic
from eagle_lite.heads.checkpoint import read_config, save_head

from .capture import Capture, Captured
from .learner import LearnConfig, Learner, Replay, objective_of
from .traffic import TrafficStore

log = logging.getLogger(__name__)

CARRIED = ("tree", "tree_cuda", "tree_command", "training")   # config keys a head folder passes on to DIR
DEFAULT_REPLAY = Path(__file__).resolve().parents[1] / "data" / "distill"


def serving_eagle(drafter):
    """(the object holding the EAGLE drafter, the drafter): method auto's `inner`, eagle's graft's `inner`."""
    from eagle_lite.drafters.eagle import EagleDrafter

    inner = getattr(drafter, "inner", None)
    if isinstance(inner, EagleDrafter):
        return drafter, inner
    if isinstance(drafter, EagleDrafter):
        return None, drafter
    raise ValueError(f"--adapt trains a draft head, but method '{getattr(drafter, 'name', drafter)}' drafts "
                     f"without one: use method auto or eagle")


def default_replay(target) -> Path | None:
    """The shipped head's training answers for `target` where the source tree holds them (data/distill)."""
    path = DEFAULT_REPLAY / f"{target.name}-sharegpt_all"
    return path if any(path.glob("shard-*.jsonl*")) else None


class Adapter:
    """Online adaptation of `pipeline`'s head into `folder` (module docstring).

    start: a trainable copy of the head adaptation starts from (never the serving one, whose linears run packed
    kernels), loaded as the pipeline's was; champion: the head DIR holds where it resumes (the pipeline serves it),
    None: the start head serves. source: the start head's folder (its objective and trees; None: EAGLE's defaults).
    replay: a distill folder of the start head's training answers (None: no replay)."""

    def __init__(self, pipeline, folder: str | Path, start, champion=None, source: str | Path | None = None,
                 cfg: LearnConfig = LearnConfig(), replay: str | Path | None = None, judge_tokens: int = 256,
                 steps: int = 4, seed: int = 0, confidence: float = 2.0, max_judge_tokens: int = 1024,
                 traffic_tokens: int = 0) -> None:
        self.pipeline, self.folder, self.cfg = pipeline, Path(folder), cfg
        self.judge_tokens, self.steps = judge_tokens, steps
        if confidence < 0:
            raise ValueError(f"the guard's confidence is a number of standard errors, >= 0; got {confidence}")
        if traffic_tokens < 0:
            raise ValueError(f"the lookup store keeps >= 0 answer tokens (0: none), got {traffic_tokens}")
        self.confidence, self.max_judge_tokens = confidence, max(max_judge_tokens, judge_tokens)
        try:
            check_folder_writable(self.folder)
        except OSError as err:
            raise ValueError(f"--adapt {self.folder}: cannot write there ({err.strerror or err})") from err
        self.holder, _ = serving_eagle(pipeline.engine.drafter)
        self.source = Path(source) if source is not None else None
        self.start_head = start.float().eval()
        self.card = {"from": str(self.source) if self.source else "", "answers": 0, "answer_tokens": 0,
                     "promotions": 0, "judged": []}
        if champion is not None:
            self.card.update(read_config(self.folder).get("adapted", {}))
        self.champion = copy.deepcopy(champion if champion is not None else self.start_head).float().eval()
        objective = objective_of(self.champion, self.source if self.source is not None else
                                 (self.folder if champion is not None else None))
        replays = Replay(pipeline.target, replay, self.champion.feature_layers, cfg.window, cfg.replay_pool, seed) \
            if replay is not None and cfg.replay > 0 else None
        self.learner = Learner(pipeline.target, copy.deepcopy(self.champion), objective, cfg, replays, seed)
        self.capture = Capture(max_tokens=cfg.pool_tokens)
        self.traffic_tokens = traffic_tokens
        self.traffic = TrafficStore(traffic_tokens) if traffic_tokens else None
        self.watch(pipeline.engine)
        pipeline.adapter = self
        self.pending: list[Captured] = []
        self.judged_tokens = 0   # answer tokens of `pending` at its last judgement (one within the noise keeps them)
        self.credit = 0          # optimizer steps the answers so far have bought and the learner has not run
        self.history: list[tuple[int, float, float, bool]] = []   # (answer tokens seen, champion, challenger, promoted)

    # -- serving --------------------------------------------------------------------------------------
    def _serve(self, head) -> None:
        """Make `head` (a copy: the drafter accelerates it in place) the one the pipeline drafts with."""
        from eagle_lite.drafters.eagle_options import eagle_drafter

        _, old = serving_eagle(self.pipeline.engine.drafter)
        head = head.to(old.lm_weight.device).eval()
        head.tree = old.recommended_tree
        drafter = eagle_drafter(self.pipeline.target, head, draft_sampling=old.draft_sampling)
        if self.holder is None:
            self.pipeline.engine.drafter = drafter
        else:
            self.holder.inner = drafter
            if hasattr(self.holder, "head"):
                self.holder.head = head
        self.pipeline.engine.reset()

    def observers(self) -> list:
        """The observers an engine serving this head needs: the capture, and the lookup store where there is one."""
        return [self.capture] + ([self.traffic] if self.traffic is not None else [])

    def watch(self, engine) -> None:
        """Make `engine`'s observers this adapter's (any earlier capture or store of it replaced)."""
        engine.observers[:] = [o for o in engine.observers if not isinstance(o, (Capture, TrafficStore))] + \
            self.observers()

    def bind(self, pipeline) -> None:
        """Adapt the head `pipeline` serves from now on (auto.py `pinned`: eagle's pipeline over the same head)."""
        self.pipeline, (self.holder, _) = pipeline, serving_eagle(pipeline.engine.drafter)
        self.watch(pipeline.engine)
        pipeline.adapter = self

    def reset(self) -> None:
        """Serve the head adaptation started from again, and train from it (DIR keeps its last champion until the
        next promotion); the lookup store starts empty."""
        self.champion = copy.deepcopy(self.start_head).float().eval()
        if self.traffic is not None:
            self.traffic = TrafficStore(self.traffic_tokens)
            self.watch(self.pipeline.engine)
        self._restart()
        self._serve(copy.deepcopy(self.champion))

    def _restart(self) -> None:
        """The learner starts again from the champion (a dropped challenger)."""
        self.learner.restart(self.champion.state_dict())

    # -- learning -------------------------------------------------------------------------------------
    def round(self, steps: int | None = None) -> dict:
        """Judge the answers captured since the last judgement where enough have come, then train: each new answer
        buys `self.steps` optimizer steps, run here up to `steps` at a time (None: all it holds). Returns what it
        did: {"judged": (champion, challenger) or None, "promoted": bool, "loss": float, "steps": int,
        "seconds": float}."""
        t0 = time.perf_counter()
        new = self.capture.take()
        self.pending += new
        self.credit += self.steps * len(new)
        self.card["answers"] += len(new)
        self.card["answer_tokens"] += sum(int(r.loss_mask.sum()) for r in new)
        judged, promoted = None, False
        held = sum(int(r.loss_mask.sum()) for r in self.pending)
        if held - self.judged_tokens >= self.judge_tokens:
            judged, decided, promoted = self._judge(self.pending)
            self.judged_tokens = held
            if decided or held >= self.max_judge_tokens:
                self.learner.add(self.pending)
                self.pending, self.judged_tokens = [], 0
        before = self.learner.steps
        loss = self.learner.train(self.credit if steps is None else min(self.credit, steps))
        self.credit -= self.learner.steps - before
        return {"judged": judged, "promoted": promoted, "loss": loss, "steps": self.learner.steps - before,
                "seconds": time.perf_counter() - t0}

    def _judge(self, records: list[Captured]) -> tuple[tuple[float, float] | None, bool, bool]:
        """Score both heads on `records`: ((champion, challenger) accepted per step, decided, promoted)."""
        if self.learner.steps == 0:
            return None, True, False
        champion = self.learner.lengths(self.champion, records)
        challenger = self.learner.lengths(self.learner.head, records)
        decision = verdict(champion, challenger, self.confidence)
        scores = float(champion.mean()), float(challenger.mean())
        seen = self.card["answer_tokens"]
        self.history.append((seen, *scores, decision == "promote"))
        self.card["judged"] = (self.card["judged"] + [[seen, round(scores[0], 4), round(scores[1], 4)]])[-20:]
        if decision == "promote":
            self.champion.load_state_dict(self.learner.weights())
            self.card["promotions"] += 1
            self._serve(copy.deepcopy(self.champion))
            self.save()
        elif decision == "drop":
            self._restart()
        return scores, decision != "wait", decision == "promote"

    def save(self) -> None:
        """Write the champion into DIR as a head folder (a disk error is reported in one line; serving goes on)."""
        extra = {"adapted": self.card}
        if self.source is not None and (self.source / "config.json").is_file():
            config = read_config(self.source)
            extra.update({k: config[k] for k in CARRIED if k in config})
            yaml_path = self.source / "train_config.yaml"
            if yaml_path.is_file() and not (self.folder / "train_config.yaml").is_file():
                shutil.copyfile(yaml_path, self.folder / "train_config.yaml")
        try:
            save_head(self.champion, self.folder, self.pipeline.target, extra=extra, dtype=torch.float32)
            write_text_atomic(self.folder / "README.md", self.describe())
        except OSError as err:
            log.warning("--adapt %s: the adapted head was not saved (%s); serving goes on", self.folder,
                        err.strerror or err)

    def describe(self) -> str:
        """The folder's card: where the head came from and what it learned."""
        c = self.card
        lines = ["# A draft head adapted online by eagle_lite (`--adapt`)", "",
                 f"- started from: {c['from'] or 'the head given'}",
                 f"- learned from: {c['answers']} answers, {c['answer_tokens']} answer tokens",
                 f"- promotions: {c['promotions']}", "",
                 "| answer tokens seen | serving head (accepted/step) | challenger | ", "|---:|---:|---:|"]
        lines += [f"| {seen} | {a:.3f} | {b:.3f} |" for seen, a, b in c["judged"]]
        return "\n".join(lines) + "\n"

    def has_work(self) -> bool:
        """New answers to take in, or steps bought and a pool to spend them on."""
        return len(self.capture) > 0 or (self.credit > 0 and bool(self.learner.pool))

    def series(self) -> list[tuple]:
        """The server's /metrics series (serve/metrics.py): the learner's steps and seconds, promotions, answer
        tokens taken in, and what each head accepted at the last judgement."""
        last = self.history[-1] if self.history else (0, 0.0, 0.0, False)
        return [("adapt_steps_total", "counter", "Optimizer steps of the head's learner (--adapt).", "",
                 self.learner.steps),
                ("adapt_promotions_total", "counter", "Learned heads that replaced the serving one.", "",
                 self.card["promotions"]),
                ("adapt_answer_tokens_total", "counter", "Answer tokens the learner has taken in.", "",
                 self.card["answer_tokens"]),
                ("adapt_learner_seconds_total", "counter", "Seconds the learner ran.", "",
                 round(self.learner.seconds, 3)),
                ("adapt_judged_accepted", "gauge", "Accepted tokens per step each head got at the last judgement, on "
                 "traffic neither trained on.", 'head="serving"', round(last[1], 4)),
                ("adapt_judged_accepted", "gauge", "", 'head="challenger"', round(last[2], 4))]

    def stats_line(self) -> str:
        last = self.history[-1] if self.history else None
        judged = f", last judged {last[1]:.2f} -> {last[2]:.2f} accepted/step" if last else ""
        store = f", {len(self.traffic)} answers to look up" if self.traffic is not None else ""
        return (f"[adapt: {self.card['answers']} answers, {self.learner.steps} steps, "
                f"{self.card['promotions']} promotions{judged}, learner {self.learner.seconds:.1f} s{store}]")


def verdict(champion: torch.Tensor, challenger: torch.Tensor, confidence: float) -> str:
    """"promote", "drop" or "wait": the challenger's chain lengths against the champion's at the same roots ([N]
    each). Promote (drop) when their mean difference is above (below) zero by `confidence` standard errors of it;
    wait while it is within them. Neighbouring roots share their text, so the standard error is a floor, and a
    `confidence` of 2 or more keeps a head from being swapped on noise."""
    diff = (challenger - champion).double()
    if diff.numel() < 2:
        return "wait"
    mean, error = float(diff.mean()), float(diff.std() / diff.numel() ** 0.5)
    if mean > confidence * error and mean > 0:
        return "promote"
    if mean < -confidence * error and mean < 0:
        return "drop"
    return "wait"


def adapted_draft(folder: str | Path | None, draft: str | None) -> str | None:
    """The head a pipeline with `--adapt folder` serves: the folder's where it holds one (resuming), else `draft`."""
    if folder is not None and (Path(folder) / "config.json").is_file():
        return str(folder)
    return draft


def resume(folder: str | Path, options, draft: str | None, static: str | None) -> tuple:
    """What `load(adapt=folder)` loads: (options, draft, the draft adaptation starts from), the folder's head in
    place of the one named where it holds one (resuming). The head it learns is the drafter's: no static step."""
    from eagle_lite.drafters.eagle_options import EagleOptions

    if static not in (None, "off"):
        raise ValueError("--adapt runs on the engine, not the static step: drop --static")
    eagle_options = isinstance(options, EagleOptions)
    start_draft = options.draft if eagle_options else draft
    resumed = adapted_draft(folder, None)
    if resumed is not None and eagle_options:
        options = dataclasses.replace(options, draft=resumed, head=None)
    elif resumed is not None:
        draft = resumed
    return options, draft, start_draft


def attach(pipeline, folder: str | Path, draft: str | None = None, **settings) -> Adapter:
    """Adapt `pipeline`'s head into `folder` (`load(adapt=...)`): the head adaptation starts from is `draft` (a head
    folder; None or "auto": the one shipped for the target; "random"), loaded afresh as a trainable copy; the
    folder's head, where it holds one, is the champion the pipeline already serves. Replay: the shipped head's
    training answers where the source tree holds them."""
    from eagle_lite.drafters.eagle_options import AUTO, load_eagle_head
    from eagle_lite.heads.checkpoint import default_head_path

    target = pipeline.target
    serving_eagle(pipeline.engine.drafter)          # a method with a head, before anything is loaded
    start = load_eagle_head(target, draft)
    if start is None:
        raise ValueError(f"--adapt trains a draft head, but none ships for target '{target.name}': give --draft PATH")
    source = default_head_path(target.name) if draft in (None, AUTO) else None if draft == "random" else Path(draft)
    resumed = adapted_draft(folder, None)
    champion = load_eagle_head(target, resumed) if resumed is not None else None
    settings.setdefault("replay", default_replay(target) if draft in (None, AUTO) else None)
    return Adapter(pipeline, folder, start, champion=champion, source=source, **settings)
