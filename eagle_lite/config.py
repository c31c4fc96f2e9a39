"""Typed settings for one generation call, validated when they are made, and the flags that set them.

The dataclass fields are the config keys: Hydra configs and CLI flags map onto them one to one. The flags more than
one entry point takes are declared here once (`SHARED`, `add_flag`); this module imports no torch.
"""
from __future__ import annotations

import argparse
import dataclasses
import math
import numbers
from dataclasses import dataclass
from pathlib import Path
from typing import Any

DRAFT_SAMPLING = ("q", "match")  # the sampling rules of EAGLE trees (EagleOptions.draft_sampling)
DRAFT_VOCAB = ("head", "full")   # what an EAGLE head drafts over (EagleOptions.draft_vocab)
STATIC_MODES = ("auto", "eager", "compile", "cuda-graph")   # how static/step.py runs

SEEDS = 1 << 64   # torch generators take seeds in [0, 2**64)
OPTION = "option"   # the dataclass field metadata key of an `option`


@dataclasses.dataclass(frozen=True)
class Flag:
    """How a method's option is set from outside: the command-line flag `--name` and the config key `name` with `_`
    (eagle_lite/options.py reads these for every entry point). type: what the text of the flag is converted by."""

    name: str
    help: str
    type: object = None
    choices: tuple | None = None
    metavar: str | None = None

    @property
    def key(self) -> str:
        """The config key and the argparse attribute: exit-layer -> exit_layer."""
        return self.name.replace("-", "_")


def option(default, name: str, help: str, *, type=None, choices=None, metavar: str | None = None):
    """A field of a method's options dataclass that every entry point exposes: flag `--name` and config key `name`
    (dashes as underscores), parsed by `type`, with `help`. Fields without it are for Python callers only."""
    return dataclasses.field(default=default, metadata={OPTION: Flag(name, help, type, choices and tuple(choices),
                                                                     metavar)})


def check_whole(name: str, value, low: int | None = None, high: int | None = None) -> int:
    """`value` when it is a whole number (not a bool, not 2.5) in [low, high); else a ValueError naming `name`."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise ValueError(f"{name} must be a whole number, got {value!r}")
    if (low is not None and value < low) or (high is not None and value >= high):
        span = f">= {low}" if high is None else f"in [{low}, {high})" if low is not None else f"< {high}"
        raise ValueError(f"{name} must be {span}, got {value}")
    return int(value)


def check_finite(name: str, value) -> float:
    """`value` when it is a finite real number (not nan, not inf, not a bool); else a ValueError naming `name`."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value):
        raise ValueError(f"{name} must be a finite number, got {value!r}")
    return float(value)


@dataclass(frozen=True)
class TreeConfig:
    """The EAGLE-2 dynamic draft tree.

    depth: how many times the frontier is expanded (the longest draftable path).
    top_k: children per frontier node, and the width of the frontier.
    total_tokens: drafted nodes kept after reranking (the root is extra), i.e. the verify budget.
    lookup: up to this many prompt-lookup tokens grafted onto the tree as one more path; 0: off. Free to
      draft; it adds the nodes the tree does not already hold to the verify (drafters/lookup_graft.py).
    min_prob: drafted nodes whose path probability under the draft (the product of its top-k
      probabilities from the root) is below this are not verified, and expansion stops once the whole
      frontier is below it; 0: off. Each verified node costs the target compute, so on a CPU a node the
      draft thinks unlikely costs more than it is expected to return: the tree then shrinks where the
      draft is unsure and may run deep where it is sure. Exact either way (any tree is verified exactly).
    """

    depth: int = 5
    top_k: int = 8
    total_tokens: int = 24
    lookup: int = 0
    min_prob: float = 0.0

    def __post_init__(self) -> None:
        for name in ("depth", "top_k", "total_tokens", "lookup"):
            check_whole(f"tree {name}", getattr(self, name))
        check_finite("tree min_prob", self.min_prob)
        if self.depth < 1:
            raise ValueError(f"tree depth must be >= 1, got {self.depth}")
        if self.top_k < 1:
            raise ValueError(f"tree top_k must be >= 1, got {self.top_k}")
        if self.lookup < 0:
            raise ValueError(f"tree lookup must be >= 0 (0 = off), got {self.lookup}")
        if not 0.0 <= self.min_prob < 1.0:
            raise ValueError(f"tree min_prob must be in [0, 1) (0 = off), got {self.min_prob}")
        if self.total_tokens < 1:
            raise ValueError(f"tree total_tokens must be >= 1, got {self.total_tokens}")
        most = self.nodes_at(self.depth)
        if self.total_tokens > most:
            raise ValueError(
                f"tree total_tokens={self.total_tokens} exceeds the {most} nodes that depth={self.depth}, "
                f"top_k={self.top_k} can draft; lower total_tokens or raise depth/top_k"
            )

    def nodes_at(self, depth: int) -> int:
        """The most nodes a tree of this top_k drafts `depth` deep."""
        return self.top_k + (depth - 1) * self.top_k * self.top_k

    def capped(self, depth: int) -> TreeConfig:
        """This tree at most `depth` deep, its node budget cut to what that depth drafts (a parallel head's K)."""
        if self.depth <= depth:
            return self
        return TreeConfig(depth, self.top_k, min(self.total_tokens, self.nodes_at(depth)), self.lookup, self.min_prob)

    @classmethod
    def check_overrides(cls, overrides: dict) -> None:
        """Refuse tree settings no tree can take (a depth of 0, more nodes than the given depth and top_k can
        draft, ...), before any model loads; unset (None) ones are left to the tree they will be set over."""
        roomy = {"depth": 1 << 16, "top_k": 1 << 16, "total_tokens": 1}  # unset sizes at their most permissive
        cls(**{**roomy, **{k: v for k, v in overrides.items() if v is not None}})

    @classmethod
    def from_spec(cls, spec: str) -> TreeConfig:
        """'depth,top_k,total_tokens[,lookup[,min_prob]]', e.g. '3,4,8,8,0.1' (the form eval tools take)."""
        parts = [p.strip() for p in spec.split(",")]
        if not 3 <= len(parts) <= 5:
            raise ValueError(f"a tree spec is depth,top_k,total_tokens[,lookup[,min_prob]], got {spec!r}")
        fields = dict(zip(("depth", "top_k", "total_tokens", "lookup", "min_prob"), parts))
        try:
            return cls(**{k: float(v) if k == "min_prob" else int(v) for k, v in fields.items()})
        except ValueError as err:
            raise ValueError(f"bad tree spec {spec!r}: {err}") from None


# The tree a drafter runs where it recommends none, by device kind. On a CPU every verified node and every draft
# step costs a fifth to a tenth of a plain step (docs/benchmarks.md, "Cost of one step"), so one head token and a
# prompt-lookup chain; on a GPU a node costs next to nothing, so EAGLE-2's budget (depth 6, top_k 10, 60 nodes) and
# a longer lookup graft.
DEVICE_TREES = {"cpu": TreeConfig(1, 1, 1, lookup=4)}
ACCELERATOR_TREE = TreeConfig(6, 10, 60, lookup=8)


def default_tree(device: str | None = None) -> TreeConfig:
    """The tree for `device` ('cpu', 'cuda', 'cuda:1', ...) where the drafter recommends none; None: `TreeConfig()`,
    the library's generic default (GenerationConfig's)."""
    if device is None:
        return TreeConfig()
    return DEVICE_TREES.get(str(device).split(":")[0], ACCELERATOR_TREE)


def resolve_tree(recommended: TreeConfig | None = None, device: str | None = None, **flags) -> TreeConfig:
    """The tree a call runs: the drafter's recommendation for the device (a head's config.json,
    `checkpoint.recommended_tree`), else the device's default (`default_tree`), then the user's flags (TreeConfig
    field names; None: unset). Every entry point resolves its tree here."""
    unknown = sorted(set(flags) - {f.name for f in dataclasses.fields(TreeConfig)})
    if unknown:
        raise ValueError(f"unknown tree setting(s) {unknown}: a tree has depth, top_k, total_tokens, lookup, min_prob")
    given = {k: v for k, v in flags.items() if v is not None}
    return dataclasses.replace(recommended or default_tree(device), **given)


@dataclass(frozen=True)
class SamplingConfig:
    """How the target's next-token distribution is formed. temperature == 0 means greedy."""

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0

    def __post_init__(self) -> None:
        check_finite("temperature", self.temperature)
        check_finite("top_p", self.top_p)
        check_whole("top_k", self.top_k)
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0 (0 = greedy), got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 = off), got {self.top_k}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


GENERIC_TREE = TreeConfig()   # GenerationConfig's tree where none is given (this very object: `tree_given`)


@dataclass(frozen=True)
class GenerationConfig:
    """tree: where none is given, a Pipeline runs its own (`Pipeline.tree`: the head's recommended tree for the
    device), not the generic `TreeConfig()` an Engine runs."""

    max_new_tokens: int = 256
    sampling: SamplingConfig = SamplingConfig()
    tree: TreeConfig = GENERIC_TREE
    seed: int | None = None
    stop_at_eos: bool = True

    def __post_init__(self) -> None:
        check_whole("max_new_tokens", self.max_new_tokens)
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if self.seed is not None:
            check_whole("seed", self.seed, 0, SEEDS)


def tree_given(cfg: GenerationConfig) -> bool:
    """Whether cfg's tree was set (an explicit `TreeConfig()` counts), rather than left at the generic default."""
    return cfg.tree is not GENERIC_TREE


# -- the flags more than one entry point takes, each declared once: `SHARED`, added to a parser by `add_flag` ----------
#     add_flag(parser, "target")                                # --target, as every tool that loads a target takes it
#     add_flag(parser, "max-new-tokens", default=64)            # this tool's own default
#     add_flag(parser, "questions", note="instead of --tasks")  # what the flag means here, after the shared help
# The CLI and the server (options.py), eval/ and trainers/ take them from here alone: a flag has the same name, type and
# help wherever it is taken. This module imports no torch, so the light tools (trainers.device_bundle, which runs before
# the wheels are installed, eval.gpu_day, the question-set builders) declare theirs here too. A method's own flags are
# its options' fields (`option` above, options.py).
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
