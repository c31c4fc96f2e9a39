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
--method takes every registered method (drafters/registry.py) this has a grid for (its help names those it does not
tune, and why); the method flags are those the methods' options declare (--draft, --exit-layer, --draft-model,
--medusa, ...), but the ones a grid sets instead (--medusa-choices: --nodes; lookahead's: its grid flags).
Chain drafters (options with `num_tokens`: lookup, draft_model, layer_skip, ...) sweep a fixed K (adaptive off)
plus their default adaptive K; eagle sweeps the tree grid (combinations TreeConfig rejects are skipped); medusa
sweeps tree sizes (`sized_choices`); lookahead sweeps its window x n-gram x candidates grid.
"""
from __future__ import annotations

import argparse
import dataclasses
import itertools
import logging
import shlex
import sys
from dataclasses import replace

import torch

from eagle_lite.cli import arguments, entry_point
from eagle_lite.config import TreeConfig
from eagle_lite.decoding.static_tree import bucket_for
from eagle_lite.drafters import registry
from eagle_lite.options import TARGET_HELP, add_device_flags, add_method_flags, options_of, quiet_libraries, target_of
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
    how_to_select,
    ints,
    lookahead_candidates,
    markdown,
    medusa_candidates,
    skip_per_category,
    tree_grid,
    tree_spec,
    tune,
)

log = logging.getLogger("eagle_lite")
# the registered methods eval.tune does not tune, and why
UNTUNED = {"vanilla": "the baseline every candidate is timed against",
           "staged": "it drafts eagle's tree with the same head: tune that with --method eagle",
           "auto": "its controller chooses each step's proposal (eval.profile_step shows its choices); tune the "
                   "head's tree it grows from with --method eagle"}
GRIDS = ("eagle", "medusa", "lookahead")   # the methods with a grid of their own; the rest sweep K (`num_tokens`)
SWEPT = ("medusa_choices", "lookahead_window", "lookahead_ngram", "lookahead_candidates")   # set by the grid flags


def tunable() -> list[str]:
    """The registered methods eval.tune sweeps: those with a grid here, and the chain drafters (options with
    `num_tokens`), but `UNTUNED`."""
    return [name for name, m in registry.METHODS.items() if name not in UNTUNED
            and (name in GRIDS or "num_tokens" in {f.name for f in dataclasses.fields(m.options)})]


def task_names(text: str) -> list[str]:
    names = [t.strip() for t in text.split(",") if t.strip()]
    unknown = [t for t in names if t not in ("humaneval", "sharegpt", "sharegpt_kinds")]
    if not names or unknown:
        raise argparse.ArgumentTypeError(f"tasks are humaneval, sharegpt and/or sharegpt_kinds, got {text!r}")
    return names


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m eval.tune", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--method", required=True, choices=tunable(),
                   help="the method to tune; not tuned: " + "; ".join(f"{m}: {why}" for m, why in UNTUNED.items()))
    p.add_argument("--task", default="humaneval", type=task_names,
                   help="built-in prompt sets, comma-separated: humaneval, sharegpt, sharegpt_kinds")
    p.add_argument("--questions", default=None, help="an MT-bench / Spec-Bench JSONL file instead of --task")
    p.add_argument("--limit", type=int, default=3, help="questions used per task (per category with --questions)")
    p.add_argument("--skip", type=int, default=0,
                   help="skip the first N questions of each task first (e.g. 3: prompts the benchmark does not use)")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--target", default=None, help=TARGET_HELP)
    add_device_flags(p, attention=False)   # --save-tree records the tree for --device's kind of device
    p.add_argument("--no-warmup", action="store_true", help="skip the warm-up generation of each candidate")
    g = p.add_argument_group("drafts")
    add_method_flags(g, tunable(), skip=SWEPT)
    g.add_argument("--save-tree", action="store_true",
                   help="eagle: write the best tree into the head folder's config.json as its "
                        "recommended tree for --device's kind (\"tree\" on a CPU, \"tree_cuda\" on CUDA); "
                        "with --static it keeps the lookup length of the tree the head recommends there now (0 if "
                        "none), which the engine's eagle grafts and the static step ignores")
    g = p.add_argument_group("grids")
    g.add_argument("--num-tokens", type=ints, default=[1, 2, 3, 4, 6, 8], help="chain drafters: K values")
    g.add_argument("--depths", type=ints, default=[3, 5], help="eagle: tree depths")
    g.add_argument("--top-ks", type=ints, default=[4, 8], help="eagle: tree top_k values")
    g.add_argument("--totals", type=ints, default=[12, 24, 48], help="eagle: tree total_tokens values")
    g.add_argument("--lookups", type=ints, default=[],
                   help="eagle: prompt-lookup lengths to graft onto the tree, each tried beside 0 (off); "
                        "--static ignores them (no graft in the static step)")
    g.add_argument("--min-probs", type=floats, default=[],
                   help="eagle: TreeConfig.min_prob values (verify only nodes this likely under the "
                        "draft), each tried beside 0 (off)")
    g.add_argument("--trees", nargs="+", type=tree_spec, default=None, metavar="SPEC",
                   help="eagle: these trees instead of the grid, each "
                        "depth,top_k,total_tokens[,lookup[,min_prob]]")
    g.add_argument("--nodes", type=ints, default=[4, 8, 12, 16, 24], help="medusa: tree sizes (drafted nodes)")
    g.add_argument("--lookahead-windows", type=counts, default=[1, 2, 4], help="lookahead: window widths W")
    g.add_argument("--lookahead-ngrams", type=ints, default=[2, 3], help="lookahead: n-gram lengths N (>= 2)")
    g.add_argument("--lookahead-candidates", type=counts, default=[2], help="lookahead: pool n-grams verified G")
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
        trees = args.trees or (tree_grid(args.depths, args.top_ks, args.totals) if args.method == "eagle" else [])
        if args.static is not None:
            for tree in trees:
                bucket_for(1 + tree.total_tokens)   # the static step's largest verify bucket bounds the tree
            if args.static == "cuda-graph" and not args.device.startswith("cuda"):
                raise ValueError(f"--static {args.static} captures CUDA graphs: use --device cuda, or "
                                 f"--static eager / compile")
            if args.static_max_len < 1:
                raise ValueError(f"--static-max-len must be >= 1, got {args.static_max_len}")
    if args.method == "lookahead":   # its grid flags are lists of sizes
        for window, ngram, count in itertools.product(args.lookahead_windows, args.lookahead_ngrams,
                                                      args.lookahead_candidates):
            registry.check("lookahead", registry.LookaheadOptions(window, ngram, count))
        return
    registry.check(args.method, options_of(args.method, args))


def build_candidates(args: argparse.Namespace, target: Target) -> list[Candidate]:
    from eagle_lite.formats import load_medusa
    from eagle_lite.heads.medusa import MedusaHeads
    from eagle_lite.targets.loading import load_target

    options = options_of(args.method, args)   # checked by check_args: medusa has its heads, draft_model its model
    if args.method == "eagle":
        head, _ = head_for(target, args.draft)
        static = args.static is not None
        if static and (args.lookups or any(tree.lookup for tree in args.trees or ())):
            log.warning("--static: the static step drafts without the prompt-lookup graft: lookup lengths "
                        "(--lookups, --trees) are ignored")
        return eagle_candidates(target, head, args.depths, args.top_ks, args.totals,
                                (0,) if static else tuple(dict.fromkeys([0, *args.lookups])),
                                tuple(dict.fromkeys([0.0, *args.min_probs])), args.trees,
                                static=args.static,
                                static_max_len=args.static_max_len, options=options)
    if args.method == "medusa":
        if options.heads == "random":
            torch.manual_seed(0)
            heads = MedusaHeads.for_target(target)
        else:
            heads = load_medusa(options.heads, target)
        return medusa_candidates(target, heads, args.nodes)
    if args.method == "lookahead":
        return lookahead_candidates(target, args.lookahead_windows, args.lookahead_ngrams, args.lookahead_candidates)
    if args.method == "draft_model":   # loaded once, for every candidate
        options = replace(options, draft_target=load_target(options.model, dtype=getattr(torch, args.dtype),
                                                            device=args.device))
    return chain_candidates(args.method, target, args.num_tokens, options)


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
