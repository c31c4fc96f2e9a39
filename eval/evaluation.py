"""The evaluation runner every eval entry point shares (`eval.benchmark`, `eval.sweep`, `eval.tune`,
`eval.ceiling`, `eval.profile_step`): settings (`EvalSettings`), the questions of a task list, the head a `--draft`
names, one evaluation of methods x questions with interleaved runs (`evaluate`), and the folder it writes
(records.jsonl, summary.md / summary.json, speedup.png, accept_lengths.png). No entry point imports another; each
imports this.
"""
from __future__ import annotations

import json
import logging
import sys
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch
from tqdm import tqdm

from eagle_lite.atomic import check_folder_writable, write_atomic, write_text_atomic
from eagle_lite.config import GenerationConfig, SamplingConfig, TreeConfig, resolve_tree
from eagle_lite.decoding.static.step import MODES
from eagle_lite.drafters import registry
from eagle_lite.heads.draft import DraftHead
from eagle_lite.kernels.attention import BACKENDS
from eagle_lite.options import (
    add_static_flag,
    every_options,
    method_flags,
    options_of,
    unknown_keys,
)
from eagle_lite.targets.loading import load_target
from eagle_lite.threads import check_threads, set_threads

from . import plots, report, runner
from .methods import STATIC_METHODS, build_methods, check_static, gguf_of, method_names, registry_method
from .tasks import (
    KINDS,
    Question,
    humaneval_questions,
    limit_per_category,
    load_question_file,
    sharegpt_kind_questions,
    sharegpt_questions,
)

log = logging.getLogger("eagle_lite")
SHAREGPT_KINDS_DEFAULT = 60   # questions per kind of the sharegpt_kinds task when it names no limit


@dataclass
class EvalSettings:
    target: str | None = None
    dtype: str = "float32"
    device: str = "cpu"          # torch device of the target (and of the drafts that run on it)
    methods: list[str] = field(
        default_factory=lambda: ["hf_generate", "hf_prompt_lookup", "vanilla", "lookup", "eagle"])
    baseline: str = "hf_generate"
    max_new_tokens: int = 128
    warmup: bool = True
    repeats: int = 1             # each turn through every method this many times; a record keeps the fastest
    tree: dict = field(default_factory=dict)  # depth/top_k/total_tokens set over the head's recommended tree
    tasks: list[dict] = field(
        default_factory=lambda: [{"name": "sharegpt", "limit": 3}, {"name": "humaneval", "limit": 3}])
    per_category_limit: int | None = None
    threads: int | None = None   # torch CPU threads; None: torch's default (one per core)
    # the methods' own options by key (eagle_lite/options.py: draft, exit_layer, lookahead_window, ...; unset: the
    # method's default)
    options: dict = field(default_factory=dict)
    temperature: float = 0.0        # 0: greedy, and outputs are checked against the baseline's; else sampled
    top_p: float = 1.0
    top_k: int = 0
    seed: int = 0                   # sampling: each method draws with this seed on every prompt
    attention: str = "auto"         # the target's tree-verification backend (kernels/attention.py)
    static: str | None = None       # a static step mode (static_step.MODES): vanilla and eagle through the
                                    # fixed-shape step; None: the engine
    static_max_len: int | None = 2048   # their cache slots, allocated once (more if a call needs them)

    @property
    def eagle(self) -> registry.EagleOptions:
        """The options of eagle's head (its folder, draft sampling and vocabulary), which every head method runs."""
        return options_of("eagle", self.options)


def load_questions(tasks: list[dict], per_category_limit: int | None = None) -> list[Question]:
    """The questions of a task list, in its order: each task a mapping with `name` (sharegpt, humaneval,
    sharegpt_kinds or file), an optional `limit` (sharegpt_kinds: per kind, default `SHAREGPT_KINDS_DEFAULT`),
    sharegpt_kinds an optional `kinds` list (default every kind of `eval.tasks.KINDS`), file its `path`."""
    questions: list[Question] = []
    for task in tasks:
        name = task.get("name")
        if name == "sharegpt":
            questions += sharegpt_questions(limit=task.get("limit"))
        elif name == "humaneval":
            questions += humaneval_questions(limit=task.get("limit"))
        elif name == "sharegpt_kinds":
            limit = task.get("limit")
            questions += sharegpt_kind_questions(SHAREGPT_KINDS_DEFAULT if limit is None else limit,
                                                 kinds=task.get("kinds", KINDS))
        elif name == "file":
            questions += load_question_file(task["path"], per_category_limit=task.get("limit"))
        else:
            raise ValueError(f"unknown task '{name}': use sharegpt, humaneval, sharegpt_kinds or file (with a path)")
    return limit_per_category(questions, per_category_limit)


def head_for(target, draft: str) -> tuple[DraftHead, str]:
    """The head to evaluate and a note for the report saying which it is (an untrained one where none ships)."""
    head = None if draft == "random" else registry.load_eagle_head(target, draft)
    if head is None:
        torch.manual_seed(0)
        return DraftHead.for_target(target), "untrained random head: an exactness check, not a speed figure"
    return head, f"head {'shipped for ' + target.name if draft == registry.AUTO else draft}"


def tree_for(head: DraftHead | None, overrides: dict, device: str | None = None) -> TreeConfig:
    """The head's recommended tree (else the device's default) with `overrides` set over it (`resolve_tree`)."""
    return resolve_tree(getattr(head, "tree", None), device=device, **overrides)


def check_settings(s: EvalSettings) -> None:
    """Refuse every setting that is wrong whatever the target, before it loads (20-80 s): unknown methods or
    dtype, a baseline not among the methods, threads, tree and sampling values, lookahead's sizes, and the draft
    head, draft model, Medusa heads and GGUF file the methods need (the registry's checks). Raises ValueError /
    FileNotFoundError naming the setting."""
    unknown = [m for m in s.methods if m not in method_names()]
    if unknown:
        raise ValueError(f"unknown method(s) {unknown}: choose from {', '.join(method_names())}")
    if s.baseline not in s.methods:
        raise ValueError(f"baseline '{s.baseline}' must be one of the methods {s.methods}")
    if not isinstance(getattr(torch, str(s.dtype), None), torch.dtype):
        raise ValueError(f"unknown dtype {s.dtype!r}: use float32 or bfloat16")
    check_threads(s.threads, "threads")
    if not isinstance(s.repeats, int) or s.repeats < 1:
        raise ValueError(f"repeats must be a whole number >= 1, got {s.repeats!r}")
    if s.attention not in ("auto", *BACKENDS):
        raise ValueError(f"unknown attention backend {s.attention!r}; choose one of: auto, {', '.join(BACKENDS)}")
    if s.static is not None:
        if s.static not in MODES:   # "off" is the CLI's: here, no --static
            raise ValueError(f"unknown static step mode {s.static!r}: choose one of {', '.join(MODES)}")
        check_static(s.methods, s.static)
    TreeConfig.check_overrides(s.tree)
    GenerationConfig(max_new_tokens=s.max_new_tokens, seed=s.seed,
                     sampling=SamplingConfig(temperature=s.temperature, top_p=s.top_p, top_k=s.top_k))
    unknown_options = unknown_keys(s.options)
    if unknown_options:
        raise ValueError(f"unknown method option(s) {unknown_options}: each method's are {sorted(method_flags())}")
    options = every_options(s.options)
    if "hf_assisted" in s.methods:       # runs the draft_model method's smaller LM
        registry.check("draft_model", options["draft_model"])
    for name in s.methods:
        method = registry_method(name, options)
        if method is not None:
            registry.check(*method)
    if "llama_cpp" in s.methods:
        gguf_of(s.target)


def evaluate(s: EvalSettings, progress: bool = True):
    """Returns (records, summary rows, header line). Settings and questions are checked before the target loads."""
    check_settings(s)
    questions = load_questions(s.tasks, s.per_category_limit)
    if not questions:
        raise ValueError("no questions to run: check the task settings (each task's limit, per_category_limit)")
    if s.threads is not None:
        set_threads(s.threads, "threads")
    target = load_target(s.target, dtype=getattr(torch, s.dtype), device=s.device, attention=s.attention)
    uses_head = any((registry_method(m, {}) or ("",))[0] in registry.head_methods() for m in s.methods)
    head, note = head_for(target, s.eagle.draft) if uses_head else (None, "")
    options = every_options(s.options)
    if head is not None:   # loaded once, for every head method
        options.update({name: replace(o, head=head) for name, o in options.items()
                        if isinstance(o, registry.EagleOptions)})
    gguf = gguf_of(s.target) if "llama_cpp" in s.methods else None
    methods = build_methods(target, s.methods, options, gguf=gguf, threads=s.threads, static=s.static,
                            static_max_len=s.static_max_len)
    tree = tree_for(head, s.tree, str(target.device))
    sampling = SamplingConfig(temperature=s.temperature, top_p=s.top_p, top_k=s.top_k)
    cfg = GenerationConfig(max_new_tokens=s.max_new_tokens, tree=tree, sampling=sampling, seed=s.seed)
    total = sum(len(q.turns) for q in questions) * len(methods)
    records: list[runner.Record] = []
    with tqdm(total=total, desc="eval", unit="run", file=sys.stderr, disable=not progress) as bar:
        def on_record(rec: runner.Record) -> None:
            records.append(rec)
            bar.set_postfix_str(f"{rec.category}/{rec.method} {rec.tokens_per_s:.1f} tok/s")
            bar.update()

        try:
            runner.run(target, questions, methods, cfg, baseline=s.baseline, warmup=s.warmup, on_record=on_record,
                       repeats=s.repeats)
        except KeyboardInterrupt as err:   # keep the runs that finished: they are reported and written
            if not records:
                raise
            finished = runner.finished_turns(records, len(methods))
            header = (header_of(s, target, tree, sampling, note) + f" · stopped after {len(records)} of {total} "
                      f"runs: the table holds the {len(finished)} runs of the turns every method finished")
            raise Stopped(records, report.summarize(finished, s.baseline), header, err) from None
    return records, report.summarize(records, s.baseline), header_of(s, target, tree, sampling, note)


class Stopped(KeyboardInterrupt):
    """Ctrl-C (or SIGTERM) during the runs, with what finished: records, summary rows and header as `evaluate`
    returns them, and the interrupt to raise again once they are reported."""

    def __init__(self, records: list, rows: list[dict], header: str, interrupt: KeyboardInterrupt) -> None:
        super().__init__()
        self.records, self.rows, self.header, self.interrupt = records, rows, header, interrupt


def header_of(s: EvalSettings, target, tree: TreeConfig, sampling: SamplingConfig, note: str) -> str:
    """The report's first line: what ran, where, with which tree and sampling."""
    static = [m for m in s.methods if m in STATIC_METHODS] if s.static is not None else []
    rules = {name: m.draft_sampling for name, m in registry.METHODS.items() if name in ("eagle", "auto")}
    each_own = ", ".join(f"{method}'s {rule}" for method, rule in rules.items() if rule)
    return (f"target {target.name} · {s.dtype} · {target.device} · attention "
            f"{target.config._attn_implementation} · {torch.get_num_threads()} threads · max_new_tokens "
            f"{s.max_new_tokens} · tree depth {tree.depth}, top_k {tree.top_k}, total_tokens "
            f"{tree.total_tokens}, lookup {tree.lookup}" + (f", min_prob {tree.min_prob:g}" if tree.min_prob else "")
            + ("" if sampling.greedy else f" · sampling: temperature {sampling.temperature}, top_p {sampling.top_p}, "
               f"top_k {sampling.top_k}, seed {s.seed}, draft sampling "
               f"{s.eagle.draft_sampling or each_own} (outputs differ by draw: no identity "
               f"check)")
            + (f" · each turn run {s.repeats} times, the fastest kept" if s.repeats > 1 else "")
            + (f" · {', '.join(static)}: static step, mode {s.static}, no lookup graft" if static else "")
            + (f" · {note}" if note else ""))


def check_out_dir(out_dir: Path) -> Path:
    """Make sure the results can be written to `out_dir` before the first prompt runs: not a file, creatable,
    writable (an OSError naming it otherwise)."""
    out_dir = Path(out_dir)
    if out_dir.exists() and not out_dir.is_dir():
        raise ValueError(f"--out {out_dir} is a file: give a folder for the records, summary and plots")
    return check_folder_writable(out_dir)


def write_outputs(out_dir: Path, records, rows, baseline: str, header: str) -> str:
    """Write records, summaries and plots; return the markdown summary."""
    out_dir.mkdir(parents=True, exist_ok=True)
    write_text_atomic(out_dir / "records.jsonl", "".join(json.dumps(r.as_dict()) + "\n" for r in records))
    table = report.markdown_table(rows, baseline)
    mismatches = [f"- {r.method} on {r.question_id}: differs from {baseline} at token {r.first_mismatch}"
                  for r in records if r.identical_to_baseline is False]
    text = f"{header}\n\n{table}\n" + ("\nMismatches:\n" + "\n".join(mismatches) + "\n" if mismatches else "")
    write_text_atomic(out_dir / "summary.md", text)
    write_text_atomic(out_dir / "summary.json", json.dumps(rows, indent=1))
    write_atomic(out_dir / "speedup.png", lambda tmp: plots.plot_speedups(rows, baseline, tmp))
    write_atomic(out_dir / "accept_lengths.png", lambda tmp: plots.plot_accept_lengths(records, tmp))
    return text


def add_static_flags(p, what: str = "decoding through") -> None:
    """--static [MODE] (eagle_lite/options.py, the CLI's own) and --static-max-len: vanilla and eagle through the
    fixed-shape step (eval.benchmark and eval.tune)."""
    add_static_flag(p, what)
    p.add_argument("--static-max-len", type=int, default=2048,
                   help="--static: cache slots allocated once (each step attends over all of them)")
