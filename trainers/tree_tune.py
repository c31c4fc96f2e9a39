"""The end of a training run: a short tune of the new head's CPU tree, saved in its config.json.

A head trained for a new model has no tree of its own; eagle then runs the CPU's default tree, tuned for another
head and another model. So the run decodes a few held-out prompts (one ShareGPT, one HumanEval, after the ones a
default benchmark takes) with a few small trees and vanilla, interleaved as `eval.tune` does (every output checked
against vanilla's), and records the fastest exact tree as the head's CPU tree, with the `eval.tune` command that
tunes it further. The same figures say how fast the target decodes here, which sizes the benchmark the run prints
(`next_steps`). The tune is eval's own command (`python -m eval.tune`), run as the summary prints it, so that
trainers never import eval.
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


def tune_tree(spec: str, head: Path, threads: int | None = None) -> dict:
    """Tune `head`'s CPU tree on target `spec`: the `eval.tune` command (`command`) in a process of its own, from the
    source checkout that holds eval/, which saves the fastest exact tree in the head's config.json. Returns the tree,
    its and vanilla's tokens/s, the seconds it took and the command; RuntimeError where the command fails.
    threads: those the tune decodes with (None: one per core, as generate, the server and the benchmark decode by
    default, whatever the training ran on)."""
    import json
    import subprocess
    import sys
    import tempfile

    start = time.perf_counter()
    line = command(str(head), spec, threads or os.cpu_count() or 1)
    root = Path(__file__).resolve().parents[1]        # the checkout: eval/ lies beside trainers/
    with tempfile.TemporaryDirectory() as tmp:
        summary = Path(tmp) / "tune.json"
        args = [sys.executable, *shlex.split(line)[1:], "--summary", str(summary)]
        done = subprocess.run(args, cwd=root, capture_output=True, text=True)
        if not summary.is_file():
            last = (done.stderr.strip() or done.stdout.strip() or f"exit {done.returncode}").splitlines()[-1]
            raise RuntimeError(f"python -m eval.tune failed: {last}")
        figures = json.loads(summary.read_text())
    top = figures["best"]
    result = {"command": line, "vanilla_tokens_per_s": figures["baseline_tokens_per_s"],
              "seconds": round(time.perf_counter() - start, 1)}
    if top is None:   # no tree reproduced vanilla's output: a defect, said by the summary; nothing saved
        return {**result, "tree": None}
    return {**result, "tree": top["setting"], "tokens_per_s": top["tokens_per_s"], "speedup": top["speedup"]}
