"""`python -m eval.benchmark`: tokens/s of transformers generate(), prompt lookup, the engine's vanilla
decoding and EAGLE, measured in one run on the same prompts, with a markdown table on stdout.

    python -m eval.benchmark                                # 3 held-out ShareGPT + 3 HumanEval prompts
    python -m eval.benchmark --per-task 10 --max-new-tokens 256 --out runs/bench.jsonl
"""
from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path

import torch
from tqdm import tqdm

from eagle_lite.checkpoint import default_head_path, load_head
from eagle_lite.config import GenerationConfig, TreeConfig
from eagle_lite.draft import DraftHead
from eagle_lite.loading import load_target

from . import report, runner
from .methods import build_methods
from .tasks import humaneval_questions, load_question_file, sharegpt_questions

ALL_METHODS = ["hf_generate", "hf_prompt_lookup", "vanilla", "eagle"]


def parse_args(argv=None) -> argparse.Namespace:
    tree = TreeConfig()
    p = argparse.ArgumentParser(prog="python -m eval.benchmark", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", default=None, help="target (default: the embedded SmolLM2-135M-Instruct)")
    p.add_argument("--draft", default="auto", help="'auto' (shipped head), 'random' (untrained), or a head folder")
    p.add_argument("--methods", default=",".join(ALL_METHODS), help="comma-separated, from " + ",".join(ALL_METHODS))
    p.add_argument("--tasks", default="sharegpt,humaneval", help="built-in tasks: sharegpt,humaneval")
    p.add_argument("--questions", type=Path, help="an MT-bench / Spec-Bench JSONL question file (adds its categories)")
    p.add_argument("--per-task", type=int, default=3, help="questions per task / category")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--tree-depth", type=int, default=tree.depth)
    p.add_argument("--tree-top-k", type=int, default=tree.top_k)
    p.add_argument("--tree-total-tokens", type=int, default=tree.total_tokens)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--out", type=Path, help="also write every record as JSONL here")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    import transformers

    transformers.logging.set_verbosity_error()
    transformers.logging.disable_progress_bar()
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    target = load_target(args.target, dtype=getattr(torch, args.dtype))
    head, head_note = None, ""
    if "eagle" in methods:
        path = default_head_path(target.name) if args.draft == "auto" else (None if args.draft == "random" else Path(args.draft))
        if path is None:
            torch.manual_seed(0)
            head, head_note = DraftHead.for_target(target), " (untrained random head: exactness check, not speed)"
        else:
            head, head_note = load_head(path, target), f" (head: {path})"
    questions = []
    tasks = [t.strip() for t in args.tasks.split(",") if t.strip()]
    if "sharegpt" in tasks:
        questions += sharegpt_questions(limit=args.per_task)
    if "humaneval" in tasks:
        questions += humaneval_questions(limit=args.per_task)
    if args.questions:
        questions += load_question_file(args.questions, per_category_limit=args.per_task)
    cfg = GenerationConfig(max_new_tokens=args.max_new_tokens,
                           tree=TreeConfig(args.tree_depth, args.tree_top_k, args.tree_total_tokens))
    table = build_methods(target, methods, head)
    baseline = methods[0]
    turns = sum(len(q.turns) for q in questions) * len(methods)
    out = open(args.out, "w") if args.out else None
    with tqdm(total=turns, desc="benchmark", unit="run", file=sys.stderr) as bar:
        def on_record(rec):
            bar.set_postfix_str(f"{rec.method} {rec.tokens_per_s:.1f} tok/s")
            bar.update()
            if out:
                out.write(json.dumps(rec.as_dict()) + "\n")
        records = runner.run(target, questions, table, cfg, baseline=baseline, on_record=on_record)
    if out:
        out.close()
    print(f"target {target.name} · {args.dtype} · {torch.get_num_threads()} threads · max_new_tokens "
          f"{args.max_new_tokens} · tree depth {cfg.tree.depth} top_k {cfg.tree.top_k} total {cfg.tree.total_tokens}"
          f"{head_note}\n")
    print(report.markdown_table(report.summarize(records, baseline), baseline))
    mismatches = [r for r in records if r.identical_to_baseline is False]
    for r in mismatches:
        print(f"  mismatch: {r.method} on {r.question_id} differs from {baseline} at token {r.first_mismatch}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
