"""Before any stage runs: about how long each stage of a training run takes on this machine, and how much disk it fills.

A probe of the target measures what the stages repeat (`probe`, a few seconds): one plain decode step of
`data.distill.batch_size` answers through the backend that answers, and each prompt's read (distill), one batched
forward over whole sequences, as the feature cache runs it (features), and one training step of a fresh head on a
loader row (fit). `estimate` multiplies them by the run's sizes; work a folder already holds (answers, cached
features, a finished fit) counts as done. The table is printed and written to the run folder (estimate.json), and
the run's summary sets the measured seconds beside it.

Sizes are upper bounds where the data decides them: every answer is counted at data.distill.max_new_tokens (a
model that ends its answers earlier takes less), a ShareGPT prompt at ~90 tokens (the mean first prompt with a
49k-token BPE vocabulary; a finer tokenizer makes more).
"""
from __future__ import annotations

import json
import logging
import math
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from omegaconf import OmegaConf

from eagle_lite.atomic import write_json_atomic

from .features import describe_bytes, estimate_bytes
from .resample import resolved

log = logging.getLogger("trainers.train")
PROMPT_TOKENS = 90             # a ShareGPT first prompt, as the distill stage keeps them (data/sharegpt.yaml)
DISTILL_BYTES_PER_TOKEN = 12   # a JSON line's ids and text, per token (measured on SmolLM2's shards)
FILE = "estimate.json"
KERNEL_BUILD_S = 75.0          # eagle_lite's native CPU kernels, built on first use (measured: 73 s on 2 cores)


@dataclass
class Probe:
    decode_step_s: float     # one decode step of `batch` answers with a KV cache
    batch: int
    forward_token_s: float   # the features stage's batched forward, per token
    fit_row_s: float | None  # one training step on one loader row of `row_tokens` tokens (None: not probed)
    row_tokens: int


@dataclass
class Stage:
    stage: str
    seconds: float
    bytes: int
    what: str


def _timed(fn, repeats: int = 3) -> float:
    fn()   # warm-up: first-call allocations and kernel choice
    best = math.inf
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


@torch.inference_mode()
def _engine_step(target, batch: int, context: int) -> float:
    """One plain step of `batch` sequences through eagle_lite's engine, as the distill stage's engine backend decodes
    (its native CPU kernels; its speculative steps cost more than a plain one and emit more tokens)."""
    from eagle_lite.config import GenerationConfig
    from eagle_lite.decoding.drafter import NoDrafter
    from eagle_lite.pipeline import engine_for

    engine = engine_for(target, "vanilla")
    cfg = GenerationConfig(max_new_tokens=16, stop_at_eos=False)
    prompts = torch.randint(0, target.vocab_size, (batch, context)).tolist()
    seqs = [seq for seq, _ in engine.begin_all([(p, cfg, NoDrafter(), None) for p in prompts])]
    return _timed(lambda: engine.step(seqs))


@torch.inference_mode()
def _decode_step(target, batch: int, context: int) -> float:
    from transformers import DynamicCache

    from eagle_lite.kv_cache import with_cache

    ids = torch.randint(0, target.vocab_size, (batch, context), device=target.device)
    cache = with_cache(target.model, DynamicCache())
    with target.stock():
        target.model(input_ids=ids, use_cache=True, **cache)
        step = ids[:, -1:]
        return _timed(lambda: target.model(input_ids=step, use_cache=True, logits_to_keep=1, **cache))


def _forward(target, batch: int, length: int, taps: tuple[int, ...]) -> float:
    from .features import target_features

    seqs = torch.randint(0, target.vocab_size, (batch, length)).tolist()
    return _timed(lambda: target_features(target, seqs, taps), repeats=1) / (batch * length)


def _fit_row(cfg, target, taps: tuple[int, ...], length: int) -> float | None:
    """One training step (forward and backward through the run's own module and objective) on one row."""
    import warnings

    from eagle_lite.heads.draft import DraftHead

    from .module import DraftLightningModule, OptimConfig
    from .objective import ObjectiveConfig

    if cfg.draft.get("kind", "eagle") == "medusa":
        return None
    size = cfg.draft.get("vocab_size")
    d2t = torch.arange(int(size)) if size is not None and int(size) < target.vocab_size else None
    design = cfg.draft.get("design", "eagle")
    head = DraftHead.for_target(target, d2t, feature_layers=taps, design=design).float()
    objective = ObjectiveConfig(**OmegaConf.to_container(cfg.draft.objective, resolve=True))
    module = DraftLightningModule(head, target.lm_head.weight, target.embed_tokens.weight, objective, OptimConfig())
    module = module.to(target.device)
    hidden = target.hidden_size
    batch = {"input_ids": torch.randint(0, target.vocab_size, (1, length)),
             "hidden": torch.randn(1, length, hidden), "loss_mask": torch.ones(1, length, dtype=torch.bool),
             "segment": torch.ones(1, length, dtype=torch.long), "position_ids": torch.arange(length)[None]}
    if taps:
        batch["taps"] = torch.randn(1, length, hidden * len(taps))
    batch = {k: v.to(target.device) for k, v in batch.items()}

    def step():
        module.zero_grad(set_to_none=True)
        module.training_step(batch, 0).backward()

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*self.log.*")   # no Trainer here: nothing to log to
        return _timed(step, repeats=1)


def probe(cfg, target, taps: tuple[int, ...]) -> Probe:
    """Time the pieces every stage repeats, on this machine with this target (a few seconds)."""
    batch = int(cfg.data.distill.batch_size)
    length = min(PROMPT_TOKENS + int(cfg.data.distill.max_new_tokens), int(cfg.data.features.max_len))
    row = int(cfg.data.loader.max_len) if cfg.data.loader.pack else length
    from .answering import resolve_backend

    engine = resolve_backend(str(cfg.data.distill.get("backend", "auto")), target) == "engine"
    with torch.random.fork_rng(devices=[]):   # the run's seeded random state stays as the stages expect it
        step = (_engine_step if engine else _decode_step)(target, batch, PROMPT_TOKENS)
        return Probe(decode_step_s=step, batch=batch,
                     forward_token_s=_forward(target, int(cfg.data.features.batch_size), length, taps),
                     fit_row_s=_fit_row(cfg, target, taps, row), row_tokens=row)


def _answered(folder: Path, start_from: str | None):
    """What a source's distill folder holds, or would take from its committed start_from (`distill.DistillSummary`:
    records, skipped prompts, their tokens)."""
    from .distill import DistillSummary, start_from_folder, summarize

    held = summarize(folder, DistillSummary(folder)) if folder.is_dir() else DistillSummary(folder)
    if start_from and start_from_folder(start_from).is_dir():
        committed = summarize(start_from_folder(start_from), DistillSummary(start_from_folder(start_from)))
        held = max(held, committed, key=lambda summary: summary.records + summary.skipped)
    return held


def _available(settings) -> int | None:
    """How many items a source can give at most: ShareGPT's training conversations after `offset` (its committed index
    of ids), a question file's lines after `offset`; None where the limit alone decides (synthetic, recorded)."""
    source, offset = settings["source"], int(settings.get("offset") or 0)
    if source in ("sharegpt", "sharegpt_text"):
        from .sharegpt import train_ids

        return max(len(train_ids()) - offset, 0)
    if source == "prompts":
        from .distill import prompts_path

        lines = prompts_path(settings["prompts"]).read_text().splitlines()
        return max(sum(1 for line in lines if line.strip()) - offset, 0)
    return None


def fitting_share(settings, target, sample: int = 256) -> float:
    """The share of a source's chosen prompts (up to `sample` of them, from the first) within max_prompt_tokens, in
    the target's own layout (the distill stage skips the others)."""
    from .distill import DistillConfig, _Chat, choose_conversations

    settings = OmegaConf.to_container(settings, resolve=True) if OmegaConf.is_config(settings) else dict(settings)
    try:
        cfg = DistillConfig(**{**settings, "limit": min(int(settings["limit"]), sample)})
        chosen = choose_conversations(cfg)
    except (OSError, ValueError) as err:   # the distill stage says what is wrong with the prompts; this is advice
        log.debug("estimate: prompts not read (%s)", err)
        return 1.0
    if not chosen:
        return 1.0
    fits = sum(_Chat(c).next_prompt(0, target.tokenizer, cfg.max_prompt_tokens) is not None for c in chosen)
    return fits / len(chosen)


def _cached(folder: Path) -> tuple[int, bool]:
    """(tokens a feature cache holds, whether it is complete)."""
    try:
        manifest = json.loads((folder / "manifest.json").read_text())
    except (OSError, ValueError):
        return 0, False
    return int(manifest.get("total_tokens", 0)), bool(manifest.get("complete"))


def estimate(cfg, target, sources, taps: tuple[int, ...], measured: Probe) -> list[Stage]:
    """The stages' time and disk for the run `cfg` over `sources` (`train.data_sources`), from `measured`."""
    max_len = int(cfg.data.features.max_len)
    answers = new_tokens = tokens = tokens_left = sequences = skipped_all = redraws = 0
    distill_s = 0.0
    for source in sources:
        s = source.settings
        limit = int(s["limit"])
        available = _available(s)
        limit = limit if available is None else min(limit, available)
        turns = int(s.get("max_turns", 1)) if s.get("multi_turn") else 1
        held = _answered(Path(source.distill), s.get("start_from"))
        answered = held.records + held.skipped   # or skipped (a prompt too long): either way not to answer again
        if s["source"] == "recorded":   # answers as they were served: nothing generated, as many as were recorded
            limit = min(limit, answered)
            per_item, generated = min(PROMPT_TOKENS + int(s["max_new_tokens"]), max_len), 0
        elif s["source"] == "sharegpt_text":   # ShareGPT's own replies: nothing generated, up to max_prompt_tokens
            per_item, generated = min(int(s["max_prompt_tokens"]), max_len), 0
        else:
            prompt = ((int(s["prompt_len_min"]) + int(s["prompt_len_max"])) // 2 if s["source"] == "synthetic"
                      else min(PROMPT_TOKENS, int(s["max_prompt_tokens"])))
            generated = turns * int(s["max_new_tokens"])
            per_item = min(prompt * turns + generated, max_len)
        left = max(limit - answered, 0)
        if left and generated and s["source"] in ("sharegpt", "prompts") and target.tokenizer is not None:
            share = fitting_share(s, target)   # prompts over max_prompt_tokens are skipped, not answered
            skipped = left - round(left * share)
            left, limit = left - skipped, limit - skipped
            skipped_all += skipped
        answers += left if generated else 0
        if left and generated:   # degenerate answers drawn again (trainers/resample.py): how many, the answers say
            redraws = max(redraws, resolved(target, s["source"], dict(s.get("resample") or {}))["tries"])
        new_tokens += left * generated
        distill_s += math.ceil(left / measured.batch) * generated * measured.decode_step_s
        if generated:                                          # each prompt answered is read once, batched
            distill_s += left * max(per_item - generated, 0) * measured.forward_token_s
        # the answers already written count as they are, those still to write at their most
        done = min(held.records, limit - left)
        done_tokens = held.tokens * done // held.records if held.records else 0
        done_tokens = min(done_tokens, done * max_len)
        tokens += done_tokens + left * per_item
        sequences += done + left
        cached, complete = _cached(Path(source.features))
        tokens_left += 0 if complete and not left else max(done_tokens + left * per_item - cached, 0)
    loader = cfg.data.loader
    train_tokens = tokens * (1 - float(loader.val_percent) / 100)
    steps_per_epoch = max(math.ceil(sequences * (1 - float(loader.val_percent) / 100) / int(loader.batch_size)), 1)
    max_steps = int(cfg.trainer.get("max_steps", -1) or -1)
    steps = steps_per_epoch * int(cfg.trainer.get("max_epochs") or 1)
    steps = min(steps, max_steps) if max_steps > 0 else steps
    rows_per_step = max(train_tokens / steps_per_epoch / measured.row_tokens, 1.0)
    done = (Path(cfg.paths.output) / "finished.json").is_file()
    fit_s = 0.0 if done or measured.fit_row_s is None else steps * rows_per_step * measured.fit_row_s * 1.1
    head_params = _head_params(cfg, target, taps)
    setup = []
    if answers and str(target.device).startswith("cpu"):   # answering runs the engine, with the native kernels
        from eagle_lite.kernels import needs_build

        if needs_build():
            setup = [Stage("kernels", KERNEL_BUILD_S, 0, "the native CPU kernels' build, once per machine")]
    return setup + [
        Stage("distill", distill_s, new_tokens * DISTILL_BYTES_PER_TOKEN,
              f"{answers} answers of up to {new_tokens // max(answers, 1)} new tokens"
              + (f" ({skipped_all} prompts over max_prompt_tokens skipped)" if skipped_all else "")
              + (f", and degenerate ones drawn again (up to {redraws} times each, not counted)" if redraws else "")
              if answers else "nothing to answer"),
        Stage("features", tokens_left * measured.forward_token_s,
              estimate_bytes(tokens_left, target.hidden_size, len(taps)),
              f"~{tokens_left:,} tokens through the target" if tokens_left else "cached"),
        Stage("fit", fit_s, 0 if done else head_params * 4 * 3 + head_params * 2,
              "finished" if done else f"{steps} steps of ~{rows_per_step * measured.row_tokens:,.0f} tokens"
              + ("" if measured.fit_row_s is not None else " (Medusa: not probed)")),
    ]


def _head_params(cfg, target, taps: tuple[int, ...]) -> int:
    """About the head's parameters: a decoder layer, its fc over the inputs and its lm_head rows (EAGLE-3)."""
    hidden, inter = target.hidden_size, int(getattr(target.config, "intermediate_size", 4 * target.hidden_size))
    layer = 4 * hidden * hidden + 3 * hidden * inter
    fc = hidden * hidden * max(len(taps), 2)
    rows = int(cfg.draft.get("vocab_size") or target.vocab_size)
    return layer + fc + (rows * hidden if cfg.draft.get("design", "eagle") == "eagle3" else 0)


def describe_seconds(s: float) -> str:
    if s < 60:
        return f"{s:.0f} s"
    if s < 3600:
        return f"{s / 60:.1f} min"
    return f"{s / 3600:.1f} h"


def table(stages: list[Stage], measured: Probe) -> str:
    total_s, total_b = sum(s.seconds for s in stages), sum(s.bytes for s in stages)
    fit = f", a fit step on {measured.row_tokens} tokens {measured.fit_row_s:.2f} s" if measured.fit_row_s else ""
    lines = [f"estimate on this machine (probe: a decode step of {measured.batch} answers "
             f"{1000 * measured.decode_step_s:.1f} ms, the target's forward {1e6 * measured.forward_token_s:.0f} "
             f"us/token{fit}):",
             f"  {'stage':<9}{'time':>10}{'disk':>11}  what"]
    for s in stages:
        lines.append(f"  {s.stage:<9}{'~' + describe_seconds(s.seconds):>10}{'~' + describe_bytes(s.bytes):>11}  "
                     f"{s.what}")
    lines.append(f"  {'total':<9}{'~' + describe_seconds(total_s):>10}{'~' + describe_bytes(total_b):>11}")
    return "\n".join(lines)


def announce(cfg, target, sources, taps: tuple[int, ...]) -> dict | None:
    """Probe, estimate, print the table and write it to the run folder; returns what was written. A probe that fails
    (a model the probe's shapes do not suit) costs the run its estimate, not its training: None, and a warning."""
    try:
        measured = probe(cfg, target, taps)
    except Exception as err:   # noqa: BLE001 - the estimate is advice; the stages decide what fails
        log.warning("estimate: the probe of the target failed (%s); the stages run without an estimate",
                    " ".join(str(err).split()) or type(err).__name__)
        return None
    stages = estimate(cfg, target, sources, taps, measured)
    print(table(stages, measured), flush=True)
    record = {"probe": asdict(measured), "stages": [asdict(s) for s in stages],
              "seconds": round(sum(s.seconds for s in stages), 1)}
    write_json_atomic(Path(cfg.paths.output) / FILE, record)
    return record
