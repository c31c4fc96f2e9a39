"""How the target answers distillation prompts: eagle_lite's own decoding engine, or batched `generate()`.

  "engine"   - `eagle_lite.decoding.engine.Engine` with the drafting method `method` (data.distill.method and
               .options, the keys of eagle_lite/options.py; "auto": its controller over the head shipped for the
               target, prompt lookup where none ships), `batch_size` prompts decoded together as a server batches
               requests (`Engine.begin_all`, `Engine.step`: each over its own cache, a finished one replaced by the
               next prompt at once).
               Speculative decoding is lossless, so each answer is the target's own greedy answer (or a draw
               from its own distribution when sampling, from the prompt's own seeded generator), and on a CPU
               it is the faster way (docs/benchmarks.md, "Distillation backends"). The speed-ups it applies to
               the target are set aside wherever the target is read as built (`Target.stock`).
  "generate" - transformers' `model.generate` on batches of prompts, left-padded and grouped by length:
               what a GPU wants (batch 512 in experiment=gpu).
  "auto"     - "engine" on a CPU, "generate" elsewhere.

Greedy answers from the two agree up to floating-point summation order (the engine's CPU products run
from the weights' GGUF grid codes; the tests check them token for token on a tiny target).
"""
from __future__ import annotations

import logging
from collections import deque
from collections.abc import Sequence

import torch
from tqdm.auto import tqdm

from eagle_lite.drafters import registry
from eagle_lite.options import option_values, options_of, unknown_keys
from eagle_lite.pipeline import for_target
from eagle_lite.targets.model import Target

from .targets import pad_token_id

log = logging.getLogger("trainers.distill")

BACKENDS = ("auto", "engine", "generate")

def resolve_backend(backend: str, target: Target) -> str:
    if backend not in BACKENDS:
        raise ValueError(f"data.distill.backend must be one of {', '.join(map(repr, BACKENDS))}, got {backend!r}")
    if backend == "auto":
        return "engine" if torch.device(target.device).type == "cpu" else "generate"
    return backend


def generate_answers(target: Target, prompts: Sequence[Sequence[int]], cfg,
                     progress: tqdm | None = None) -> list[list[int]]:
    """The target's answers to `prompts` (token ids), each cut after its first EOS (kept).

    `cfg` is a `DistillConfig`: max_new_tokens, do_sample/temperature/top_p, batch_size and backend.
    """
    if resolve_backend(cfg.backend, target) == "engine":
        return engine_answers(target, prompts, cfg, progress)
    return batched_answers(target, prompts, cfg, progress)


def batched_answers(target: Target, prompts: Sequence[Sequence[int]], cfg,
                    progress: tqdm | None = None) -> list[list[int]]:
    """Batched `model.generate` with left padding; prompts are grouped by length to waste little padding."""
    pad = pad_token_id(target)
    eos = sorted(target.eos_token_ids)
    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
    answers: list[list[int]] = [[] for _ in prompts]
    # top_k given always: generate() would otherwise apply the generation config's (50 by default)
    sampling = dict(do_sample=True, temperature=cfg.temperature, top_p=cfg.top_p, top_k=cfg.top_k) if cfg.do_sample \
        else dict(do_sample=False)
    for start in range(0, len(order), cfg.batch_size):
        rows = order[start:start + cfg.batch_size]
        width = max(len(prompts[i]) for i in rows)
        ids = torch.full((len(rows), width), pad, dtype=torch.long)  # B T, left-padded
        attention = torch.zeros_like(ids)
        for r, i in enumerate(rows):
            n = len(prompts[i])
            ids[r, width - n:] = torch.tensor(prompts[i], dtype=torch.long)
            attention[r, width - n:] = 1
        with torch.inference_mode(), target.stock():
            out = target.model.generate(input_ids=ids.to(target.device), attention_mask=attention.to(target.device),
                                        max_new_tokens=cfg.max_new_tokens, pad_token_id=pad,
                                        eos_token_id=eos or None, **sampling)
        for r, i in enumerate(rows):
            new = out[r, width:].tolist()
            cut = next((k + 1 for k, tok in enumerate(new) if tok in eos), len(new))
            answers[i] = new[:cut]  # after EOS generate() pads; those are not the target's tokens
        if progress is not None:
            progress.update(len(rows))
    return answers


def engine_answers(target: Target, prompts: Sequence[Sequence[int]], cfg,
                   progress: tqdm | None = None) -> list[list[int]]:
    """The answers through eagle_lite's engine, `cfg.batch_size` prompts decoded together (continuous batching: a
    finished answer's place goes to the next prompt before the next step).

    Sampled answers draw from a generator per prompt, seeded in prompt order from torch's global RNG, which
    `distill` seeds per shard, so a shard's answers are the same whether or not the run was resumed, and whatever
    the batch size.
    """
    from eagle_lite.config import GenerationConfig, SamplingConfig

    pipeline = _pipeline_for(target, cfg.method, cfg.options)
    engine, tree = pipeline.engine, pipeline.tree
    sampling = SamplingConfig(cfg.temperature, cfg.top_p, cfg.top_k) if cfg.do_sample else SamplingConfig()
    configs = [GenerationConfig(max_new_tokens=cfg.max_new_tokens, sampling=sampling, tree=tree,
                                seed=int(torch.randint(2**62, (1,))) if cfg.do_sample else None) for _ in prompts]
    new_drafter = pipeline.drafter_factory()                  # a drafter keeps per-sequence state: one each
    free = [engine.drafter] + [new_drafter() for _ in range(min(cfg.batch_size, len(prompts)) - 1)]
    answers: list[list[int]] = [[] for _ in prompts]
    waiting = deque(range(len(prompts)))
    running: list[tuple[int, object]] = []                    # (prompt index, its engine Sequence)
    while waiting or running:
        joining = [waiting.popleft() for _ in range(min(len(waiting), len(free)))]
        if joining:
            begun = engine.begin_all([(list(prompts[i]), configs[i], free.pop(), None) for i in joining])
            for i, (seq, first) in zip(joining, begun):
                answers[i] += first
                running.append((i, seq))
        stepping = [(i, seq) for i, seq in running if not seq.done]
        if stepping:
            for (i, _), new in zip(stepping, engine.step([seq for _, seq in stepping])):
                answers[i] += new   # ends with the EOS token when the target wrote one
        for _, seq in running:
            if seq.done:
                free.append(seq.drafter)
                if progress is not None:
                    progress.update(1)
        running = [(i, seq) for i, seq in running if not seq.done]
    return answers


# the pipelines answering for the target distilled last, by (method, options): one target at a time, so that a
# pipeline (which holds its target) keeps no other target alive
_answering: dict = {"target": None, "pipelines": {}}


def check_method(method: str, options: dict) -> None:
    """Refuse `data.distill.method` and `data.distill.options` (its option keys, eagle_lite/options.py) that cannot
    work, before a target loads: ValueError naming the setting."""
    unknown = unknown_keys(options)
    if unknown:
        raise ValueError(f"data.distill.options has unknown key(s) {unknown}: each is a drafting method's option")
    registry.check(method, options_of(method, option_values(options)))


def no_shipped_head(target: Target, settings) -> bool:
    """Whether method auto, with these options, finds no head for `target` (none ships for it and none is named)."""
    from eagle_lite.heads.checkpoint import default_head_path

    draft = getattr(settings, "draft", None)
    return (getattr(settings, "head", None) is None and draft in (None, registry.AUTO)
            and default_head_path(target.name) is None)


def _pipeline_for(target: Target, method: str = "auto", options: dict | None = None):
    """The pipeline that answers for `target` with `method` and its `options` (built once, and kept until another
    target answers), with the speed-ups and tree-attention backend applied to the target (the features stage and
    batched generate() run it as built, inside `Target.stock`). "auto": its controller over the head shipped for it
    (eagle_lite_wing/auto.py), else lookup."""
    settings = options_of(method, option_values(options or {}))
    if _answering["target"] is not target:
        _answering.update(target=target, pipelines={})
    built = _answering["pipelines"]
    if (method, settings) not in built:
        target.speed_up()
        try:
            if method == registry.AUTO and no_shipped_head(target, settings):
                # what auto would do, without its advice to train a head: that is what this run is doing
                pipeline = for_target(target, "lookup")
            else:
                pipeline = for_target(target, method, settings)
        except (ValueError, FileNotFoundError) as err:
            if method != registry.AUTO:
                raise
            log.warning("distill: the head shipped for '%s' does not load (%s); drafting by prompt lookup",
                        target.name, err)
            pipeline = for_target(target, "lookup")
        log.info("distill: answering with eagle_lite's engine (%s drafter)", pipeline.engine.drafter.name)
        built[(method, settings)] = pipeline
    return built[(method, settings)]
