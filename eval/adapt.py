"""Online head adaptation measured (`--adapt`): a head that learns from the answers it serves, beside the frozen head.

    python -m eval.adapt --questions eval/questions/heldout12.jsonl --max-new-tokens 256 --threads 2
    python -m eval.adapt --tasks sharegpt_kinds --per-task 60 --stream kind --out runs/adapt

Each question's turns are answered twice, greedily and interleaved: by the frozen head, then by the adapting one
(eagle_lite_wing/adapt.py), whose learner then runs its round (timed apart: the learner's seconds, never in tokens/s).
`--stream kind` (default) gives every kind its own stream, in file order, each starting from the head given;
`--stream mixed` runs one stream over every question in file order. Printed per kind and per fifth of its stream:
tokens/s and accepted tokens per step of both heads, and whether every output was identical; then an overall row of
the last fifths, the learner's seconds and its cost per answered token. With `--traffic-tokens N` the adapting side
also looks up earlier answers (its lookup store; 0, the default: the head alone adapts). `--out DIR` also writes
`adapt.json` and keeps each stream's adapted head (DIR/heads/<stream>). The `--tree-*` flags set the tree both heads
draft (unset: the head's own; `--method eagle --tree-depth 4 --tree-top-k 1 --tree-total-tokens 4 --tree-lookup 0`
is a chain of 4 head tokens alone, where acceptance is all the head's).
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

from eagle_lite.cli import entry_point
from eagle_lite.config import resolve_tree
from eagle_lite.drafters import registry
from eagle_lite.options import add_flag, add_method_flag, add_tree_flags, tree_flags
from eagle_lite.threads import check_threads, set_threads
from eagle_lite_wing.learner import MOVES, LearnConfig
from eagle_lite_wing.traffic import MAX_TOKENS

from .evaluation import load_questions

FIFTHS = 5


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m eval.adapt", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_flag(p, "target")
    add_flag(p, "questions")
    add_flag(p, "tasks", note="instead of or beside --questions")
    add_flag(p, "per-task")
    p.add_argument("--stream", choices=["kind", "mixed"], default="kind",
                   help="kind: a stream per kind, each from the head given; mixed: one stream over every question")
    add_method_flag(p, [registry.AUTO, "eagle"], note="the method both heads draft in")
    add_flag(p, "draft", note="the head to start from")
    add_flag(p, "max-new-tokens")
    add_flag(p, "threads")
    p.add_argument("--moves", choices=MOVES, default=LearnConfig.moves, help="what the learner updates")
    p.add_argument("--lr", type=float, default=LearnConfig.lr)
    p.add_argument("--steps", type=int, default=4, help="optimizer steps each answer buys")
    p.add_argument("--judge-tokens", type=int, default=256, help="answer tokens between two judgements of the guard")
    p.add_argument("--confidence", type=float, default=2.0,
                   help="standard errors by which the guard's paired difference must clear zero to swap heads")
    p.add_argument("--replay", type=float, default=LearnConfig.replay,
                   help="share of a batch from the head's training answers (0: none)")
    p.add_argument("--prompts", action="store_true",
                   help="train on the prompts' positions too, not only the answers' (LearnConfig.prompts)")
    p.add_argument("--traffic-tokens", type=int, default=0,
                   help=f"answer tokens the adapting side's lookup store keeps, to copy from across questions "
                        f"(eagle_lite_wing/traffic.py, e.g. {MAX_TOKENS}; 0, the default: none, the head alone adapts)")
    p.add_argument("--out", help="a folder for adapt.json and the adapted heads")
    add_tree_flags(p)
    args = p.parse_args(argv)
    if not args.questions and not args.tasks:
        p.error("give --questions FILE or --tasks")
    if args.max_new_tokens < 1 or args.steps < 0 or (args.per_task is not None and args.per_task < 1) \
            or args.traffic_tokens < 0:
        p.error("--max-new-tokens and --per-task must be >= 1, --steps and --traffic-tokens >= 0")
    check_threads(args.threads)
    try:   # refused before anything is loaded
        args.learn = LearnConfig(moves=args.moves, lr=args.lr, replay=args.replay, prompts=args.prompts)
    except ValueError as err:
        p.error(str(err))
    return args


def questions_of(args) -> list:
    tasks = [{"name": "file", "path": args.questions}] if args.questions else []
    tasks += [{"name": name.strip()} for name in args.tasks.split(",") if name.strip()]
    return load_questions(tasks, args.per_task)


def streams(questions: list, how: str) -> dict[str, list]:
    """Stream name -> its questions in file order: one per kind, or one ("mixed") over them all."""
    if how == "mixed":
        return {"mixed": list(questions)}
    out: dict[str, list] = defaultdict(list)
    for q in questions:
        out[q.category].append(q)
    return dict(out)


def answer(pipeline, question, max_new_tokens: int, tree: dict | None = None) -> list[dict]:
    """Every turn of `question` answered greedily (each turn after this pipeline's own earlier answers); tree: the
    --tree-* flags (`options.tree_flags`; None or unset: the pipeline's tree)."""
    messages, turns = [], []
    cfg = pipeline.config(max_new_tokens=max_new_tokens, tree=resolve_tree(pipeline.tree, **(tree or {})))
    for turn in question.turns:
        messages.append({"role": "user", "content": turn})
        out = pipeline.generate(messages, cfg)
        messages.append({"role": "assistant", "content": out.text})
        s = out.stats
        turns.append({"ids": out.token_ids, "tokens": s.new_tokens, "seconds": s.seconds,
                      "steps": max(s.target_forwards - 1, 1)})
    return turns


def run_stream(target, args, name: str, questions: list, heads_dir: Path) -> list[dict]:
    """One stream: the frozen and the adapting pipeline answer each question in turn; rows per question."""
    from eagle_lite.pipeline import for_target
    from eagle_lite_wing.adapt import attach

    options = registry.EagleOptions(draft=args.draft)
    frozen = for_target(target, args.method, options)
    adapting = for_target(target, args.method, options)
    folder = heads_dir / name
    adapter = attach(adapting, folder, args.draft, cfg=args.learn, judge_tokens=args.judge_tokens, steps=args.steps,
                     confidence=args.confidence, traffic_tokens=args.traffic_tokens)
    tree = tree_flags(args)
    rows = []
    for i, q in enumerate(questions):
        a = answer(frozen, q, args.max_new_tokens, tree)
        b = answer(adapting, q, args.max_new_tokens, tree)
        t0 = time.process_time()
        report = adapter.round()
        learner = time.process_time() - t0
        rows.append({"kind": q.category, "id": q.question_id, "frozen": a, "adapted": b, "learner_seconds": learner,
                     "identical": all(x["ids"] == y["ids"] for x, y in zip(a, b)), "judged": report["judged"],
                     "promoted": report["promoted"]})
        judged = report["judged"]
        note = f" judged {judged[0]:.2f}->{judged[1]:.2f}{' promoted' if report['promoted'] else ''}" if judged else ""
        print(f"  {name} {i + 1}/{len(questions)} {q.question_id}: frozen {summary(a)}, adapted {summary(b)}"
              f"{'' if rows[-1]['identical'] else ' DIFFERENT'}{note}", file=sys.stderr, flush=True)
    return rows


def summary(turns: list[dict]) -> str:
    tokens, seconds, steps = (sum(t[k] for t in turns) for k in ("tokens", "seconds", "steps"))
    return f"{tokens / max(seconds, 1e-9):.1f} tok/s {tokens / steps:.2f}/step"


def totals(rows: list[dict], side: str) -> dict:
    turns = [t for r in rows for t in r[side]]
    tokens, seconds, steps = (sum(t[k] for t in turns) for k in ("tokens", "seconds", "steps"))
    return {"accepted": round(tokens / steps, 4) if steps else 0.0,
            "tokens_per_s": round(tokens / seconds, 3) if seconds else 0.0, "tokens": tokens}


def fifths(rows: list[dict]) -> list[list[dict]]:
    """The rows in FIFTHS consecutive parts, as even as they can be (empty parts where fewer rows)."""
    n = len(rows)
    return [rows[n * k // FIFTHS:n * (k + 1) // FIFTHS] for k in range(FIFTHS)]


def table(by_kind: dict[str, list[dict]], by_stream: dict[str, list[dict]]) -> tuple[str, dict]:
    """The printed table and adapt.json's "kinds": each kind's rows in fifths, then the last fifth of every stream."""
    lines = ["| kind | fifth | answers | frozen tok/s | adapted tok/s | speed | frozen acc/step | adapted acc/step | "
             "acc | identical |", "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    kinds: dict = {}
    for kind, rows in sorted(by_kind.items()):
        parts = []
        for k, part in enumerate(fifths(rows)):
            f, a = totals(part, "frozen"), totals(part, "adapted")
            parts.append({"frozen": f, "adapted": a})
            if part:
                lines.append(row_line(kind, str(k + 1), part, f, a))
        kinds[kind] = {"fifths": parts}
    last = [row for rows in by_stream.values() for row in fifths(rows)[-1]]
    lines.append(row_line("all streams", "last", last, totals(last, "frozen"), totals(last, "adapted")))
    return "\n".join(lines), kinds


def row_line(kind: str, fifth: str, rows: list[dict], f: dict, a: dict) -> str:
    speed = a["tokens_per_s"] / f["tokens_per_s"] if f["tokens_per_s"] else 0.0
    acc = a["accepted"] / f["accepted"] if f["accepted"] else 0.0
    same = sum(r["identical"] for r in rows)
    return (f"| {kind} | {fifth} | {len(rows)} | {f['tokens_per_s']:.1f} | {a['tokens_per_s']:.1f} | {speed:.2f}x | "
            f"{f['accepted']:.2f} | {a['accepted']:.2f} | {acc:.2f}x | {same}/{len(rows)} |")


@entry_point
def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from eagle_lite.targets.loading import load_target

    questions = questions_of(args)
    if not questions:
        raise ValueError("no questions to answer: check --questions / --tasks / --per-task")
    set_threads(args.threads)
    target = load_target(args.target)
    out = Path(args.out) if args.out else None
    heads_dir = out / "heads" if out else Path(tempfile.mkdtemp(prefix="eagle_lite-adapt-"))
    by_kind: dict[str, list[dict]] = defaultdict(list)
    by_stream: dict[str, list[dict]] = {}
    for name, qs in streams(questions, args.stream).items():
        by_stream[name] = run_stream(target, args, name, qs, heads_dir)
        for row in by_stream[name]:
            by_kind[row["kind"]].append(row)
    learner = sum(row["learner_seconds"] for rows in by_stream.values() for row in rows)
    text, kinds = table(by_kind, by_stream)
    rows = [r for rs in by_kind.values() for r in rs]
    identical = sum(r["identical"] for r in rows) / len(rows)
    answered = sum(t["tokens"] for r in rows for t in r["adapted"])
    tree = ", ".join(f"{k} {v}" for k, v in tree_flags(args).items() if v is not None) or "the head's"
    moves = args.moves
    print(f"eval.adapt · {target.name} · method {args.method} · tree {tree} · stream {args.stream} · moves {moves} · "
          f"lr {args.lr} · {args.steps} steps/answer · lookup store {args.traffic_tokens} tokens · "
          f"replay {args.replay} · {len(rows)} questions · {args.max_new_tokens} new tokens · "
          f"{args.threads or 'default'} threads\n")
    print(text)
    print(f"\nidentical outputs: {identical:.1%} · learner {learner:.1f} CPU s "
          f"({1e3 * learner / max(answered, 1):.2f} ms per answered token)")
    if out:
        out.mkdir(parents=True, exist_ok=True)
        (out / "adapt.json").write_text(json.dumps({"kinds": kinds, "identical": identical,
                                                    "learner_seconds": round(learner, 3)}, indent=2) + "\n")
        print(f"wrote {out / 'adapt.json'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
