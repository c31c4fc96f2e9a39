"""The end of a training run: a short tune of the new head's CPU tree, saved in its config.json.

A head trained for a new model has no tree of its own; eagle then runs the CPU's default tree, tuned for another
head and another model. So the run decodes a few held-out prompts (one ShareGPT, one HumanEval, after the ones a
default benchmark takes) with a few small trees and vanilla, interleaved as `eval.tune` does (every output checked
against vanilla's), and records the fastest exact tree as the head's CPU tree, with the `eval.tune` command that
tunes it further. The same figures say how fast the target decodes here, which sizes the benchmark the run prints
(`next_steps`).
"""
from __future__ import annotations

import logging
import os
import shlex
import time
from pathlib import Path

log = logging.getLogger("trainers.train")

TREES = ("1,1,1,4", "2,1,2,4", "3,1,3,4")   # depth,top_k,total_tokens,lookup: small trees, as a CPU affords
TASKS = ("sharegpt", "humaneval")
PER_TASK = 1
SKIP = 3           # eval.benchmark's default --per-task takes the first three of each task: the tune takes later ones
MAX_NEW_TOKENS = 64


def command(head: str, spec: str | None, threads: int | None) -> str:
    """The `eval.tune` command this tune runs (and a longer one would extend: more --limit, more --trees)."""
    args = ["python", "-m", "eval.tune", "--method", "eagle", "--task", ",".join(TASKS), "--skip", str(SKIP),
            "--limit", str(PER_TASK),
            "--max-new-tokens", str(MAX_NEW_TOKENS), *(["--threads", str(threads)] if threads else []),
            "--trees", *TREES, "--draft", head, *(["--target", spec] if spec and spec != "smollm2" else []),
            "--save-tree"]
    return shlex.join(args)


def seconds_for(token_s: float) -> float:
    """About how long the tune takes at `token_s` seconds a token (vanilla's; each method decodes once to warm up)."""
    turns = PER_TASK * len(TASKS)
    return 2 * turns * (1 + len(TREES)) * MAX_NEW_TOKENS * token_s


def fitting_questions(target, pool: int = 8) -> list:
    """PER_TASK first-turn questions of each of TASKS whose prompt and answer fit the target's context (the first of
    `pool` after the SKIP a benchmark takes); ValueError where none does."""
    import dataclasses

    from eval.evaluation import load_questions
    from eval.runner import conversation_prompts

    chosen = []
    for name in TASKS:
        taken = load_questions([{"name": name, "limit": SKIP + pool}])[SKIP:]
        fits = [dataclasses.replace(q, turns=q.turns[:1]) for q in taken]
        fits = [q for q in fits if len(conversation_prompts(target, q, [])) + MAX_NEW_TOKENS <= target.max_context]
        chosen += fits[:PER_TASK]
    if not chosen:
        raise ValueError(f"no {' or '.join(TASKS)} prompt fits target '{target.name}''s context of "
                         f"{target.max_context} tokens with {MAX_NEW_TOKENS} new ones")
    return chosen


def tune_tree(spec: str, head: Path, threads: int | None = None) -> dict:
    """Tune `head`'s CPU tree on target `spec` and save the fastest exact one in its config.json. Returns the tree,
    its and vanilla's tokens/s, the seconds it took and the command; raises what loading or decoding raised.
    threads: those the tune decodes with (None: one per core, as generate, the server and the benchmark decode by
    default, whatever the training ran on); torch's count is restored afterwards."""
    import torch

    from eagle_lite.threads import set_threads

    before = torch.get_num_threads()
    set_threads(threads or os.cpu_count() or 1)
    try:
        return _tune_tree(spec, head, threads)
    finally:
        set_threads(before)


def _tune_tree(spec: str, head: Path, threads: int | None) -> dict:
    from eagle_lite.config import TreeConfig
    from eagle_lite.drafters import registry
    from eagle_lite.heads.checkpoint import recommend_tree
    from eagle_lite.targets.loading import load_target
    from eval.tuning import BASELINE, best, eagle_candidates, tune

    start = time.perf_counter()
    target = load_target(spec)   # as generate loads it: the tree-verification backend and the few-row speed-ups
    drafted = registry.load_eagle_head(target, str(head))
    questions = fitting_questions(target)
    trees = [TreeConfig.from_spec(t) for t in TREES]
    rows = tune(target, questions, eagle_candidates(target, drafted, [], [], [], trees=trees), MAX_NEW_TOKENS)
    vanilla = next(r for r in rows if r["method"] == BASELINE)
    top = best(rows)
    result = {"command": command(str(head), spec, threads), "vanilla_tokens_per_s": vanilla["tokens_per_s"],
              "seconds": round(time.perf_counter() - start, 1)}
    if top is None:   # no tree reproduced vanilla's output: a defect, said by the summary; nothing saved
        return {**result, "tree": None}
    recommend_tree(head, TreeConfig(**top["setting"]), result["command"], target.device.type)
    return {**result, "tree": top["setting"], "tokens_per_s": top["tokens_per_s"], "speedup": top["speedup"]}
