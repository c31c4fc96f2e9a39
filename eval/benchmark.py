"""`python -m eval.benchmark`: tokens/s of transformers generate(), its prompt lookup, the engine's vanilla
decoding and EAGLE, measured in one run on the same prompts (interleaved), printed as a markdown table.

    python -m eval.benchmark                                # 3 held-out ShareGPT + 3 HumanEval prompts
    python -m eval.benchmark --per-task 10 --max-new-tokens 256 --out runs/bench
    python -m eval.benchmark --questions mt_bench.jsonl     # any MT-bench / Spec-Bench question file
    python -m eval.benchmark --device cuda --dtype bfloat16 --methods vanilla,eagle --static   # the fixed-shape step

The same runner as `python -m eval.sweep` (Hydra, for sweeps), with plain flags for a quick check.
"""
from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

from eagle_lite.cli import arguments, entry_point
from eagle_lite.options import (
    add_device_flags,
    add_flag,
    add_method_flags,
    add_sampling_flags,
    add_tree_flags,
    option_values,
    quiet_libraries,
    target_of,
)
from eagle_lite.threads import check_threads

from . import report
from .evaluation import EvalSettings, Stopped, add_static_flags, check_out_dir, evaluate, write_outputs

ALL_METHODS = ["hf_generate", "hf_prompt_lookup", "vanilla", "lookup", "eagle"]
# also available: staged (eagle whose head checks the lookup chain), eagle_q and eagle_match (eagle with one sampling
# rule each, to compare both in one run), lookahead (--lookahead-window, --lookahead-ngram, --lookahead-candidates),
# layer_skip (--exit-layer), draft_model and hf_assisted (transformers' assisted generation; both --draft-model SPEC),
# medusa (--medusa PATH|random), llama_cpp (llama.cpp on the target's GGUF; needs the optional llama-cpp-python; added
# by default when importable). --static runs vanilla and eagle through the fixed-shape step (static/step.py: CUDA
# graphs on CUDA; greedy only)


def default_methods() -> list[str]:
    import importlib.util

    return ALL_METHODS + (["llama_cpp"] if importlib.util.find_spec("llama_cpp") else [])


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m eval.benchmark", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_flag(p, "target")
    add_flag(p, "methods", note=f"the first is the baseline (default: {','.join(ALL_METHODS)}, plus llama_cpp when "
                                f"llama-cpp-python is installed)")
    add_flag(p, "tasks", default="sharegpt,humaneval")
    add_flag(p, "questions", type=Path, note="adds its categories")
    add_flag(p, "per-task", default=3)
    add_flag(p, "max-new-tokens", default=128)
    p.add_argument("--repeats", type=int, default=1,
                   help="run each turn through every method this many times (order rotating) and keep each "
                        "method's fastest: a shared host only slows runs down (default: 1)")
    add_tree_flags(p)
    add_device_flags(p)
    add_sampling_flags(p.add_argument_group("sampling (temperature 0: greedy, every output checked against the "
                                            "baseline's; > 0: sampled, speed only)"),
                       seed=0, seed_note="every method draws with it on each prompt")
    add_static_flags(p)
    g = p.add_argument_group("the methods' own options (eagle_q, eagle_match and eagle_full_vocab: eagle with one "
                             "draft sampling rule or the whole vocabulary; hf_assisted: --draft-model's LM)")
    add_method_flags(g)
    p.add_argument("--out", type=Path, help="also write records, summary and plots into this folder")
    return p.parse_args(argv)


def settings_of(args: argparse.Namespace) -> EvalSettings:
    """The flags as the runner's settings."""
    methods = [m.strip() for m in (args.methods or ",".join(default_methods())).split(",") if m.strip()]
    if not methods:
        raise ValueError(f"--methods {args.methods!r} names no method: give them comma-separated, the baseline first")
    tasks = [{"name": t.strip(), "limit": args.per_task} for t in args.tasks.split(",") if t.strip()]
    if args.questions:
        tasks.append({"name": "file", "path": str(args.questions), "limit": args.per_task})
    target = target_of(args.target, getattr(args, "draft", None))
    return EvalSettings(target=target, dtype=args.dtype, device=args.device, methods=methods,
                        baseline=methods[0], max_new_tokens=args.max_new_tokens, repeats=args.repeats, tasks=tasks,
                        tree={"depth": args.tree_depth, "top_k": args.tree_top_k,
                              "total_tokens": args.tree_total_tokens, "lookup": args.tree_lookup,
                              "min_prob": args.tree_min_prob},
                        threads=args.threads, options=option_values(args), temperature=args.temperature,
                        top_p=args.top_p, top_k=args.top_k, seed=args.seed, attention=args.attention,
                        static=args.static, static_max_len=args.static_max_len)


@entry_point
def main(argv=None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    with arguments():
        if args.repeats < 1:
            raise ValueError(f"--repeats must be >= 1, got {args.repeats}")
        if args.per_task < 0:
            raise ValueError(f"--per-task must be >= 0, got {args.per_task}")
        if args.static_max_len < 1:
            raise ValueError(f"--static-max-len must be >= 1, got {args.static_max_len}")
        check_threads(args.threads)  # named as the flag here; evaluate checks the settings again
        settings = settings_of(args)
    if args.out:
        check_out_dir(args.out)   # before the first prompt: a run's results must have somewhere to go
    quiet_libraries(False)
    try:
        records, rows, header = evaluate(settings)
    except Stopped as stop:   # Ctrl-C: report and write the runs that finished, then stop
        report_results(args.out, stop.records, stop.rows, settings.baseline, stop.header)
        raise stop.interrupt from None
    report_results(args.out, records, rows, settings.baseline, header)
    return 0


def report_results(out: Path | None, records, rows, baseline: str, header: str) -> None:
    """The table on stdout; with --out, also records, summaries and plots in that folder."""
    if out:
        print(write_outputs(out, records, rows, baseline, header))
    else:
        print(f"{header}\n\n{report.markdown_table(rows, baseline)}")


if __name__ == "__main__":
    sys.exit(main())
