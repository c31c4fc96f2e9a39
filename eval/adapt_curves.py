"""Learning curves of `--adapt`: how much the adapted head accepts against answer tokens seen, per choice of learner.

    python -m eval.adapt_curves --tasks humaneval --per-task 80 --threads 2 --records runs/he.safetensors \\
        --settings '{}' '{"moves": "layer"}' '{"replay": 0}'

The questions are answered once (greedy, with the capture on: eagle_lite_wing/adapt.py's data); `--records FILE`
keeps those answers' captured features (safetensors) so a later run replays them without answering again. Each
setting (JSON: the wing's learner.py LearnConfig fields, plus the Adapter's "steps" per answer, "judge_tokens" and
"confidence") then replays the stream through an Adapter, the guard included: each answer is scored before it is
learned from (tokens per step of a greedy chain of LearnConfig.depth head tokens, `Learner.accepted`) by the frozen
head and by the head serving at that point. Printed per setting and fifth of the stream: both, their ratio, and the
learner's seconds. No tokens/s: this measures the head, `eval.adapt` the speed.
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

from eagle_lite.cli import entry_point
from eagle_lite.options import add_flag
from eagle_lite.threads import check_threads, set_threads
from eagle_lite_wing.capture import Capture, Captured
from eagle_lite_wing.learner import LearnConfig

from .evaluation import load_questions

FIELDS = ("input_ids", "loss_mask", "hidden", "taps")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m eval.adapt_curves", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_flag(p, "target")
    add_flag(p, "draft", note="the head to start from")
    add_flag(p, "questions")
    add_flag(p, "tasks")
    add_flag(p, "per-task")
    add_flag(p, "max-new-tokens")
    add_flag(p, "threads")
    p.add_argument("--records", help="a .safetensors file of the captured answers: read where it exists, else written")
    p.add_argument("--settings", nargs="+", default=["{}"], help="learner settings, one JSON object each")
    args = p.parse_args(argv)
    check_threads(args.threads)
    for text in args.settings:
        settings(text)   # a bad one is refused before anything is answered
    if not args.records or not Path(args.records).is_file():
        if not args.questions and not args.tasks:
            p.error("give --questions or --tasks (or --records FILE of answers captured before)")
    return args


def settings(text: str) -> tuple[LearnConfig, dict]:
    """A setting's (LearnConfig, Adapter keywords: steps, judge_tokens, confidence)."""
    try:
        given = json.loads(text)
    except ValueError as err:
        raise ValueError(f"--settings {text!r} is not JSON ({err})") from err
    if not isinstance(given, dict):
        raise ValueError(f"--settings {text!r} is not a JSON object")
    adapter = {k: given.pop(k) for k in ("steps", "judge_tokens", "confidence") if k in given}
    unknown = set(given) - set(LearnConfig.__dataclass_fields__)
    if unknown:
        raise ValueError(f"--settings: unknown learner settings {sorted(unknown)}")
    return LearnConfig(**given), adapter


def answer(lm, questions, max_new_tokens: int) -> list[Captured]:
    """Every question's first turn answered with the capture on; the captured answers in order."""
    capture = Capture(max_tokens=1 << 40)
    lm.engine.observers.append(capture)
    records = []
    for i, q in enumerate(questions):
        lm.generate([{"role": "user", "content": q.turns[0]}], lm.config(max_new_tokens=max_new_tokens))
        records += capture.take()
        print(f"  answered {i + 1}/{len(questions)}", file=sys.stderr, flush=True)
    lm.engine.observers.remove(capture)
    return records


def save_records(records: list[Captured], path: str) -> None:
    from safetensors.torch import save_file

    tensors = {f"{i}.{k}": getattr(r, k).contiguous() for i, r in enumerate(records) for k in FIELDS
               if getattr(r, k) is not None}
    save_file(tensors, path, metadata={"records": str(len(records))})


def load_records(path: str) -> list[Captured]:
    """The answers `save_records` wrote; a file that is not such a file is refused in one line."""
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(path, "pt") as f:
            n = int((f.metadata() or {})["records"])
            keys = set(f.keys())
            return [Captured(*(f.get_tensor(f"{i}.{k}") if f"{i}.{k}" in keys else None for k in FIELDS))
                    for i in range(n)]
    except (SafetensorError, KeyError, ValueError) as err:
        raise ValueError(f"--records {path} is not a file of captured answers written by eval.adapt_curves "
                         f"({err}); give another path, or delete it to answer again") from err


def curve(lm, draft: str, records: list[Captured], cfg: LearnConfig, keywords: dict) -> tuple[list, float]:
    """[(frozen, serving)] accepted per step on each answer before it is learned from; the learner's seconds."""
    from eagle_lite.drafters.registry import load_eagle_head
    from eagle_lite_wing.adapt import attach

    with tempfile.TemporaryDirectory() as folder:
        adapter = attach(lm, folder, draft, cfg=cfg, **keywords)
        frozen = load_eagle_head(lm.target, draft).float().eval()
        points = []
        for i, record in enumerate(records):
            points.append((adapter.learner.accepted(frozen, [record]), adapter.learner.accepted(adapter.champion,
                                                                                                [record])))
            adapter.capture.put(record)
            adapter.round()
            print(f"  {i + 1}/{len(records)}: frozen {points[-1][0]:.2f}, serving {points[-1][1]:.2f}",
                  file=sys.stderr, flush=True)
        return points, adapter.learner.seconds


@entry_point
def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from eagle_lite.pipeline import load

    set_threads(args.threads)
    lm = load(args.target, method="eagle", draft=args.draft)
    if args.records and Path(args.records).is_file():
        records = load_records(args.records)
    else:
        tasks = [{"name": "file", "path": args.questions}] if args.questions else []
        tasks += [{"name": n.strip()} for n in args.tasks.split(",") if n.strip()]
        records = answer(lm, load_questions(tasks, args.per_task), args.max_new_tokens)
        if args.records:
            save_records(records, args.records)
    tokens = sum(int(r.loss_mask.sum()) for r in records)
    print(f"eval.adapt_curves · {lm.target.name} · {len(records)} answers, {tokens} answer tokens · accepted per step "
          f"of a greedy chain, frozen -> adapted (ratio), per fifth of the stream\n")
    print("| setting | " + " | ".join(f"fifth {k}" for k in range(1, 6)) + " | learner s |")
    print("|---|" + "---:|" * 6)
    for text in args.settings:
        cfg, keywords = settings(text)
        points, seconds = curve(lm, args.draft, records, cfg, keywords)
        n = len(points)
        cells = []
        for k in range(5):
            part = points[n * k // 5:n * (k + 1) // 5] or [(0.0, 0.0)]
            f, a = (sum(p[j] for p in part) / len(part) for j in (0, 1))
            cells.append(f"{f:.2f} -> {a:.2f} ({a / f if f else 0:.3f})")
        print(f"| `{text}` | " + " | ".join(cells) + f" | {seconds:.0f} |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
