"""`python -m eval.tune`: find the fastest settings of one drafting method on a few prompts of a task.

    python -m eval.tune --method eagle --task humaneval            # tree depth x top_k x total_tokens
    python -m eval.tune --method eagle --static --device cuda --dtype bfloat16 --trees 4,8,31 6,10,63 --save-tree
    python -m eval.tune --method lookup --task sharegpt            # chain length K (num_tokens)
    python -m eval.tune --method lookahead --task sharegpt         # window W x n-gram N x candidates G
    python -m eval.tune --method layer_skip --exit-layer 12        # K of the early-exit draft
    python -m eval.tune --method draft_model --draft-model SPEC    # K of a smaller draft model
    python -m eval.tune --method medusa --medusa HEADS_DIR         # Medusa tree size (nodes)
    python -m eval.tune --method eagle --questions mt_bench.jsonl --limit 2 --depths 3,5 --totals 8,16
    python -m eval.tune --method eagle --task sharegpt,humaneval --skip 3 --limit 2 --draft HEAD_DIR --save-tree

Every candidate setting decodes the same prompts through the runner of `eval.sweep` (all candidates
interleaved per question, so machine drift hits them alike; each greedy output is checked against
vanilla decoding). The table gives tokens/s, the speedup over vanilla and the mean accepted length;
the best setting whose output is identical to vanilla's is printed last, with how to select it;
`--save-tree` records eagle's best tree in the head folder's config.json, where the CLI, the Python API
and the benchmark take it as their default tree.
`--static [MODE]` sweeps eagle's tree grid through the fixed-shape static step (`static_step.StaticStep`, CUDA
graphs on CUDA: the default path there, whose costs differ from the engine's), against plain decoding through the
same step as the baseline; that step has no prompt-lookup graft, so lookup lengths are ignored.
--method takes every registered method whose registry entry declares a grid (`Method.tune`, drafters/registry.py;
its help names those that declare none, and why), and the grid flags are its axes (`registry.Axis`): a new method
is tuned by its registry entry alone. The method flags are those the methods' options declare (--draft,
--exit-layer, --draft-model, --medusa, ...), but the ones a grid sets instead (--medusa-choices: --nodes;
lookahead's: its grid flags). Chain drafters (lookup, draft_model, layer_skip) sweep a fixed K (adaptive off) plus
their default adaptive K; eagle sweeps the tree grid (combinations TreeConfig rejects are skipped); medusa sweeps
tree sizes (`sized_choices`); lookahead sweeps its window x n-gram x candidates grid.
"""
from __future__ import annotations

import argparse
import dataclasses
import itertools
import logging
import shlex
import sys
from dataclasses import replace
from pathlib import Path

import torch

from eagle_lite.atomic import write_json_atomic
from eagle_lite.cli import arguments, entry_point
from eagle_lite.config import OPTION, TreeConfig
from eagle_lite.decoding.static.tree import bucket_for
from eagle_lite.drafters import registry
from eagle_lite.options import (
    add_device_flags,
    add_flag,
    add_method_flag,
    add_method_flags,
    options_of,
    quiet_libraries,
    target_of,
)
from eagle_lite.targets.model import Target
from eagle_lite.threads import check_threads, set_threads

from .evaluation import add_static_flags, head_for, load_questions
from .methods import static_method
from .tuning import (
    BASELINE,
    Candidate,
    best,
    chain_candidates,
    check_counts,
    counts,
    eagle_candidates,
    floats,
    grid_candidates,
    how_to_select,
    ints,
    markdown,
    medusa_candidates,
    skip_per_category,
    tree_grid,
    tune,
)

log = logging.getLogger("eagle_lite")


def tunable() -> list[str]:
    """The registered methods eval.tune sweeps: those whose registry entry declares a grid (`registry.Tuning`)."""
    return [name for name, m in registry.METHODS.items() if isinstance(m.tune, registry.Tuning)]


def untuned() -> dict[str, str]:
    """The registered methods eval.tune does not sweep, and why (their registry entries say)."""
    return {name: m.tune for name, m in registry.METHODS.items() if not isinstance(m.tune, registry.Tuning)}


def grid_axes(methods: list[str]) -> dict[str, tuple[registry.Axis, list[str]]]:
    """Grid flag -> (its axis, the methods that sweep it), over `methods`' registry entries."""
    axes: dict[str, tuple[registry.Axis, list[str]]] = {}
    for name in methods:
        for axis in registry.METHODS[name].tune.axes:
            axes.setdefault(axis.flag, (axis, []))[1].append(name)
    return axes


def swept_keys(methods: list[str]) -> set[str]:
    """The method flags (option keys) a grid sets instead: its axes' fields that are options of the method."""
    keys = set()
    for name in methods:
        flags = {f.name: f.metadata[OPTION].key for f in dataclasses.fields(registry.METHODS[name].options)
                 if OPTION in f.metadata}
        keys |= {flags[axis.field] for axis in registry.METHODS[name].tune.axes if axis.field in flags}
    return keys


def axis_values(args: argparse.Namespace, method: str) -> dict[str, list]:
    """`method`'s axes as given (its grid flags): options or TreeConfig field -> values."""
    return {axis.field: getattr(args, axis.flag.replace("-", "_")) for axis in registry.METHODS[method].tune.axes}


def task_names(text: str) -> list[str]:
    names = [t.strip() for t in text.split(",") if t.strip()]
    unknown = [t for t in names if t not in ("humaneval", "sharegpt", "sharegpt_kinds")]
    if not names or unknown:
        raise argparse.ArgumentTypeError(f"tasks are humaneval, sharegpt and/or sharegpt_kinds, got {text!r}")
    return names


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m eval.tune", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_method_flag(p, tunable(), required=True,
                    note="not tuned: " + "; ".join(f"{m}: {why}" for m, why in untuned().items()))
    add_flag(p, "tasks", "--task", dest="task", default="humaneval", type=task_names, metavar="TASKS")
    add_flag(p, "questions", note="instead of --tasks")
    add_flag(p, "limit", default=3)
    add_flag(p, "skip", note="e.g. 3: the prompts left are those the benchmark does not use")
    add_flag(p, "max-new-tokens", default=64)
    add_flag(p, "target")
    add_device_flags(p, attention=False)   # --save-tree records the tree for --device's kind of device
    p.add_argument("--no-warmup", action="store_true", help="skip the warm-up generation of each candidate")
    p.add_argument("--summary", type=Path, metavar="FILE",
                   help="also write the best setting and the baseline's figures to FILE as JSON (trainers read it)")
    g = p.add_argument_group("drafts")
    add_method_flags(g, tunable(), skip=swept_keys(tunable()))
    g.add_argument("--save-tree", action="store_true",
                   help="eagle: write the best tree into the head folder's config.json as its "
                        "recommended tree for --device's kind (\"tree\" on a CPU, \"tree_cuda\" on CUDA); "
                        "with --static it keeps the lookup length of the tree the head recommends there now (0 if "
                        "none), which the engine's eagle grafts and the static step ignores")
    g = p.add_argument_group("grids (each method's axes, from its registry entry)")
    for flag, (axis, names) in grid_axes(tunable()).items():
        kind = floats if axis.kind is float else counts if axis.least < 1 else ints
        shown = f" (default: {','.join(map(str, axis.values))})" if axis.values else ""
        g.add_argument(f"--{flag}", type=kind, default=list(axis.values), metavar="LIST",
                       help=f"{'/'.join(names)}: {axis.help}, comma-separated{shown}")
    add_flag(g, "trees", note="eagle: these trees instead of the grid")
    g = p.add_argument_group("eagle through the fixed-shape step (baseline: plain decoding through it)")
    add_static_flags(g, "eagle: tune its tree for")
    return p.parse_args(argv)


def check_args(args: argparse.Namespace) -> None:
    """Refuse every flag that is wrong whatever the target, before it loads (20-80 s): counts, threads, the tree
    grid, and the draft head, Medusa heads or draft model the method needs. Raises ValueError /
    FileNotFoundError naming the flag or the path."""
    with arguments():   # the flags alone: a bad one is exit status 2
        check_counts(args)
        check_threads(args.threads)
        if args.save_tree and (args.method != "eagle" or args.draft == "random"):
            raise ValueError("--save-tree records an eagle tree in a head folder: use --method eagle "
                             "with --draft auto or a head folder")
        if args.static is not None and args.method != "eagle":
            raise ValueError(f"--static tunes eagle's tree through the fixed-shape step: use --method eagle (not "
                             f"{args.method})")
        sweep, values = registry.METHODS[args.method].tune.sweep, axis_values(args, args.method)
        trees = args.trees or (tree_grid(values["depth"], values["top_k"], values["total_tokens"])
                               if sweep == "tree" else [])
        if args.static is not None:
            for tree in trees:
                bucket_for(1 + tree.total_tokens)   # the static step's largest verify bucket bounds the tree
            if args.static == "cuda-graph" and not args.device.startswith("cuda"):
                raise ValueError(f"--static {args.static} captures CUDA graphs: use --device cuda, or "
                                 f"--static eager / compile")
            if args.static_max_len < 1:
                raise ValueError(f"--static-max-len must be >= 1, got {args.static_max_len}")
    options = options_of(args.method, args)
    if sweep == "grid":   # every combination of its axes' values
        for combo in itertools.product(*values.values()):
            registry.check(args.method, replace(options, **dict(zip(values, combo))))
        return
    registry.check(args.method, options)


def build_candidates(args: argparse.Namespace, target: Target) -> list[Candidate]:
    from eagle_lite.formats import load_medusa
    from eagle_lite.heads.medusa import MedusaHeads
    from eagle_lite.targets.loading import load_target

    """The candidates of the sweep --method's registry entry names (`registry.Tuning`), over its axes' values."""
    options = options_of(args.method, args)   # checked by check_args: medusa has its heads, draft_model its model
    sweep, values = registry.METHODS[args.method].tune.sweep, axis_values(args, args.method)
    if sweep == "tree":   # an EAGLE head's trees; lookup lengths and min_probs each tried beside 0 (off)
        head, _ = head_for(target, args.draft)
        static = args.static is not None
        if static and (values["lookup"] or any(tree.lookup for tree in args.trees or ())):
            log.warning("--static: the static step drafts without the prompt-lookup graft: lookup lengths "
                        "(--lookups, --trees) are ignored")
        return eagle_candidates(target, head, values["depth"], values["top_k"], values["total_tokens"],
                                (0,) if static else tuple(dict.fromkeys([0, *values["lookup"]])),
                                tuple(dict.fromkeys([0.0, *values["min_prob"]])), args.trees,
                                static=args.static,
                                static_max_len=args.static_max_len, options=options)
    if sweep == "sizes":   # Medusa trees of each size
        if options.heads == "random":
            torch.manual_seed(0)
            heads = MedusaHeads.for_target(target)
        else:
            heads = load_medusa(options.heads, target)
        return medusa_candidates(target, heads, values["choices"])
    if sweep == "grid":
        return grid_candidates(args.method, target, values, options)
    if getattr(options, "model", None) is not None and getattr(options, "draft_target", "") is None:
        # a draft model, loaded once for every candidate
        options = replace(options, draft_target=load_target(options.model, dtype=getattr(torch, args.dtype),
                                                            device=args.device))
    return chain_candidates(args.method, target, values["num_tokens"], options)


@entry_point
def main(argv=None) -> int:
    args = parse_args(argv)
    from eagle_lite.heads.checkpoint import default_head_path
    from eagle_lite.targets.loading import load_target


    quiet_libraries(False)
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    take = args.skip + args.limit
    tasks = ([{"name": "file", "path": args.questions, "limit": take}] if args.questions
             else [{"name": t, "limit": take} for t in args.task])
    task_label = (args.questions or ",".join(args.task)) + (f" after the first {args.skip}" if args.skip else "")
    check_args(args)
    questions = skip_per_category(load_questions(tasks), args.skip)
    if not questions:
        raise ValueError(f"no questions to tune on in {task_label}: lower --skip or raise --limit")
    set_threads(args.threads)
    target = load_target(target_of(args.target, args.draft), dtype=getattr(torch, args.dtype),
                         device=args.device)
    if args.save_tree and args.draft == "auto" and default_head_path(target.name) is None:
        raise ValueError(f"--save-tree: no head ships for target '{target.name}' to record the tree in; "
                         f"pass --draft HEAD_FOLDER")
    candidates = build_candidates(args, target)
    baseline = BASELINE
    make_baseline = (lambda: static_method(target, None, args.static, args.static_max_len)) \
        if args.static is not None else None
    rows = tune(target, questions, candidates, args.max_new_tokens, warmup=not args.no_warmup, baseline=baseline,
                make_baseline=make_baseline)
    static = f" (static step, mode {args.static}: vanilla too)" if args.static is not None else ""
    print(f"target {target.name} · {args.method}{static} · {task_label}: {len(questions)} questions, "
          f"{sum(len(q.turns) for q in questions)} turns · max_new_tokens {args.max_new_tokens} · "
          f"{torch.get_num_threads()} threads\n")
    print(markdown(rows, baseline))
    top = best(rows, baseline)
    if args.summary is not None:
        base = next(r for r in rows if r["method"] == baseline)
        write_json_atomic(args.summary, {"best": top, "baseline_tokens_per_s": base["tokens_per_s"]})
    if top is None:
        print(f"\nno candidate reproduced {baseline}'s output on every prompt: check the draft and the dtype")
        return 1
    speedup = "" if top["speedup"] is None else f" ({top['speedup']:.2f}x {baseline})"
    if top["speedup"] is not None and top["speedup"] < 1:
        print(f"\nno setting beats {baseline} decoding on these prompts (an untrained draft, or drafting costs "
              f"too much)")
    print(f"\nbest: {top['method']} at {top['tokens_per_s']:.1f} tokens/s{speedup}; "
          f"select it with {how_to_select(args.method, top['setting'], args.static)}")
    if args.save_tree:
        from eagle_lite.heads.checkpoint import read_head_config, recommend_tree, recommended_tree

        folder = default_head_path(target.name) if args.draft == "auto" else args.draft
        command = "python -m eval.tune " + shlex.join(sys.argv[1:] if argv is None else argv)
        device = target.device.type
        tree = TreeConfig(**top["setting"])
        kept = ""
        if args.static is not None:   # not measured here: the lookup the engine's eagle grafts stays as it was
            now = recommended_tree(read_head_config(folder), folder, device)
            tree = replace(tree, lookup=now.lookup if now is not None else 0)
            kept = (f" (lookup {tree.lookup} kept from its previous tree" if now is not None else " (lookup 0") \
                + ": the static step does not graft)"
        recommend_tree(folder, tree, command, device)
        print(f"saved as the recommended tree of {folder} on {device}{kept}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
