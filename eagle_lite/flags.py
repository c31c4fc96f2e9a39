"""The flags more than one entry point takes, each declared once: `SHARED`, added to a parser by `add_flag`.

    add_flag(parser, "target")                           # --target, as every tool that loads a target takes it
    add_flag(parser, "max-new-tokens", default=64)       # this tool's own default
    add_flag(parser, "questions", note="instead of --tasks")   # what the flag means here, after the shared help

The CLI and the server (eagle_lite/options.py), eval/ and trainers/ take them from here alone: a flag has the same name,
type and help wherever it is taken. This module imports no torch, so the light tools (trainers.device_bundle, which
runs before the wheels are installed, eval.gpu_day, the question-set builders) declare theirs here too. A method's own
flags are its options' fields (`config.option`, eagle_lite/options.py).
"""
from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from .config import SamplingConfig, TreeConfig

TARGET_HELP = ("target model: 'smollm2' (embedded default), a .gguf file, a local folder or a hub id; any transformers "
               "causal LM whose cached tree forward matches its own (checked at load); with --draft HEAD, the target "
               "the head was trained for")
DRAFT_HELP = "draft head: 'auto' (shipped for the target), 'random' (untrained, exact but slow), or a folder"
ATTENTION = ["auto", "sdpa", "gqa", "flex", "lse_merge", "flash"]
DTYPES = ["float32", "bfloat16"]


def tree_spec(text: str) -> TreeConfig:
    """A --trees value, depth,top_k,total_tokens[,lookup[,min_prob]] (`TreeConfig.from_spec`)."""
    try:
        return TreeConfig.from_spec(text)
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None


# name -> add_argument's keywords: what each flag is, wherever it is taken. An entry point changes its default (or
# nargs, required) where its job differs, and adds a note saying what the flag means there (`add_flag`).
SHARED: dict[str, dict[str, Any]] = {
    "target": {"default": None, "help": TARGET_HELP},
    "draft": {"default": "auto", "help": DRAFT_HELP},   # also EagleOptions.draft, the CLI's and the server's
    "threads": {"type": int, "default": None,
                "help": "torch CPU threads, >= 1 (unset: one per core). Use 1 when other jobs share the cores: "
                        "threads that wait for a busy core stall every step"},
    "device": {"default": "cpu", "help": "torch device of the target (cpu, cuda, ...)"},
    "dtype": {"default": "float32", "choices": DTYPES, "help": "target weights dtype"},
    "attention": {"default": "auto", "choices": ATTENTION,
                  "help": "tree-verification attention backend (see docs/attention.md); auto picks the fastest here"},
    "max-new-tokens": {"type": int, "default": 256, "help": "stop each answer after this many new tokens"},
    "temperature": {"type": float, "default": SamplingConfig().temperature, "help": "sampling temperature; 0: greedy"},
    "top-p": {"type": float, "default": SamplingConfig().top_p, "help": "nucleus sampling: the likeliest tokens "
              "whose probabilities sum to P (1: off)"},
    "top-k": {"type": int, "default": SamplingConfig().top_k, "help": "sample among the K likeliest tokens (0: off)"},
    "seed": {"type": int, "default": None, "help": "seed for sampling (reproducible outputs)"},
    "methods": {"default": None, "help": "comma-separated methods, each timed on the same prompts"},
    "questions": {"default": None, "help": "an MT-bench / Spec-Bench JSONL question file (question_id, category, "
                  "turns)"},
    "tasks": {"default": "", "help": "built-in prompt sets, comma-separated: sharegpt, humaneval, sharegpt_kinds "
              "(ShareGPT first prompts by kind)"},
    "per-task": {"type": int, "default": None, "help": "questions of each task (and of each category of --questions)"},
    "limit": {"type": int, "default": None, "help": "questions of each category (each task of the built-in ones)"},
    "skip": {"type": int, "default": 0, "help": "skip the first N questions of each category first"},
    "trees": {"nargs": "+", "type": tree_spec, "default": None, "metavar": "SPEC",
              "help": "draft trees, each depth,top_k,total_tokens[,lookup[,min_prob]]"},
    "reps": {"type": int, "default": None, "help": "timed repetitions of each measurement"},
    "max-batch": {"type": int, "default": 8, "help": "sequences the server decodes together"},
    "batch-threads": {"type": int, "default": None,
                      "help": "torch CPU threads of the server's steps of 4 or more sequences (unset: --threads)"},
    "verbose": {"action": "store_true", "help": "show loading logs and progress bars"},
    "sharegpt": {"type": Path, "default": None, "help": "a ShareGPT JSON file (default: the package's)"},
    "val-percent": {"type": float, "default": 5.0,
                    "help": "the share of records held out for validation, in percent (data.loader.val_percent)"},
    "wheels": {"type": Path, "default": Path(".carry-wheels"), "help": "where the downloaded wheels go"},
}


def add_flag(p, name: str, *aliases: str, note: str | None = None, **changes) -> argparse.Action:
    """--`name` (and `aliases`) on parser or group `p`, as `SHARED` declares it: its one declaration. `changes`: what
    this entry point takes otherwise (default, nargs, required, type where its values are checked further, dest);
    `note`: what the flag means here, after the shared help. A default other than None and False is shown."""
    kwargs = {**SHARED[name], **changes}
    text = kwargs.pop("help") + (f"; {note}" if note else "")
    if isinstance(kwargs.get("default"), (int, float, str, Path)) and kwargs["default"] != "" \
            and kwargs.get("action") is None and "%(default)" not in text:
        text += " (default: %(default)s)"
    return p.add_argument(f"--{name}", *aliases, help=text, **kwargs)
