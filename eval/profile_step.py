"""`python -m eval.profile_step`: where the milliseconds of one decoding step go, per method and tree.

    python -m eval.profile_step --draft runs/train/smollm2/sharegpt/default/head --threads 1
    python -m eval.profile_step --draft random --trees 3,8,8 5,8,24
    python -m eval.profile_step --device cuda --dtype bfloat16 --static cuda-graph   # adds the static step's rows

Per step: draft, verify (the target's forward over the tree), accept + cache commit; plus tokens per step
and tokens/s, for vanilla decoding and EAGLE at each tree (depth,top_k,total_tokens). With --static, the same
through the fixed-shape step (static_step.py), synchronised between draft and verify to time them (its
accept+commit runs inside the verify step's time).
"""
from __future__ import annotations

import argparse
import sys

import torch

from eagle_lite.chat_format import chat_ids
from eagle_lite.cli import arguments, entry_point
from eagle_lite.config import GenerationConfig, TreeConfig
from eagle_lite.decoding.engine import Engine
from eagle_lite.decoding.static_step import StaticEngine
from eagle_lite.drafters import registry
from eagle_lite.targets.loading import load_target
from eagle_lite.threads import check_threads

from .sweep import head_for
from .tune import tree_label, tree_spec

PROMPT = "Explain how a hash map works, with an example in Python."


def profile(engine: Engine, ids: list[int], cfg: GenerationConfig) -> dict:
    engine.generate(ids, GenerationConfig(max_new_tokens=8, tree=cfg.tree))   # warm-up
    engine.reset()
    s = engine.generate(ids, cfg).stats
    steps = max(len(s.accept_lengths), 1)
    return {"draft": 1000 * s.draft_seconds / steps, "verify": 1000 * s.verify_seconds / steps,
            "accept": 1000 * s.accept_seconds / steps, "tokens_per_step": s.accept_length_mean,
            "tokens_per_s": s.tokens_per_s, "prefill": 1000 * s.prefill_seconds}


@entry_point
def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m eval.profile_step", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", default=None)
    p.add_argument("--draft", default="auto", help="'auto', 'random' or a head folder")
    p.add_argument("--trees", nargs="*", type=tree_spec, default=[TreeConfig(3, 8, 8), TreeConfig(5, 8, 24)],
                   help="depth,top_k,total_tokens[,lookup[,min_prob]] ...")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--prompt", default=PROMPT)
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads, >= 1 (default: one per core)")
    p.add_argument("--device", default="cpu", help="torch device of the target: cpu, cuda, ...")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--static", nargs="?", const="auto", default=None, metavar="MODE",
                   choices=["auto", "eager", "compile", "reduce-overhead", "cuda-graph"],
                   help="also profile the static step in this mode (auto: CUDA graphs on CUDA, eager elsewhere)")
    return run(p.parse_args(argv))


def run(args: argparse.Namespace) -> int:
    """Check the flags, load, profile and print the table; returns the exit status."""
    import transformers

    transformers.logging.set_verbosity_error()
    transformers.logging.disable_progress_bar()
    with arguments():
        if args.max_new_tokens < 1:
            raise ValueError(f"--max-new-tokens must be >= 1, got {args.max_new_tokens}")
        check_threads(args.threads)
    registry.check("eagle", registry.EagleOptions(draft=args.draft))
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    target = load_target(args.target, dtype=getattr(torch, args.dtype), device=args.device)
    head, note = head_for(target, args.draft)
    ids = chat_ids(target.tokenizer, [{"role": "user", "content": args.prompt}])
    rows = [("vanilla", profile(Engine(target, registry.build("vanilla", target)), ids,
                                GenerationConfig(args.max_new_tokens)))]
    if args.static:
        rows.append(("vanilla_graph", profile(StaticEngine(target, None, mode=args.static, profile=True), ids,
                                              GenerationConfig(args.max_new_tokens))))
    for tree in args.trees:
        cfg = GenerationConfig(args.max_new_tokens, tree=tree)
        rows.append((tree_label(tree), profile(Engine(target, registry.build(
            "eagle", target, registry.EagleOptions(head=head))), ids, cfg)))
        if args.static:
            static = StaticEngine(target, head, mode=args.static, profile=True)
            rows.append((f"{tree_label(tree)} graph", profile(static, ids, cfg)))
    print(f"target {target.name} · {torch.get_num_threads()} threads · {note}\n")
    print("| method | draft ms/step | verify ms/step | accept+commit ms/step | tokens/step | tokens/s |")
    print("|---|---:|---:|---:|---:|---:|")
    for name, r in rows:
        draft = "—" if name.startswith("vanilla") else f"{r['draft']:.1f}"
        print(f"| {name} | {draft} | {r['verify']:.1f} | {r['accept']:.2f} | {r['tokens_per_step']:.2f} | "
              f"{r['tokens_per_s']:.1f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
