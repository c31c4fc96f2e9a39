"""`python -m eval.kinds`: ShareGPT first prompts chosen by kind, as a question file (the rules of eval.tasks).

    python -m eval.kinds --per-kind 60 --out kinds.jsonl             # every kind
    python -m eval.kinds --kinds qa --per-kind 60 --out qa.jsonl       # one kind's stream (eval.adapt)
    python -m eval.kinds --kinds rag --per-kind 60 --later-turns --out rag.jsonl   # and later turns

It prints how many questions each kind got from each tier: held-out chats, chats the shipped head did not train on,
the rest.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from eagle_lite.atomic import write_text_atomic
from eagle_lite.cli import arguments, entry_point
from eagle_lite.config import add_flag
from eval.tasks import KINDS, KindCounts, question_lines, sharegpt_kind_questions


def kinds_table(counts: dict[str, KindCounts], per_kind: int) -> str:
    """The per-kind counts as a markdown table (kind, total, heldout, unseen, trained, available)."""
    lines = [f"| kind | total (of {per_kind}) | heldout | unseen | trained | available |",
             "|---|---:|---:|---:|---:|---:|"]
    for c in counts.values():
        lines.append(f"| {c.kind} | {c.total} | {c.tiers['heldout']} | {c.tiers['unseen']} | {c.tiers['trained']} "
                     f"| {c.available} |")
    return "\n".join(lines)


@entry_point
def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m eval.kinds", description=(
        "Write ShareGPT first prompts chosen by kind (sharegpt_kind_questions: held-out chats first, then "
        "ones the shipped head did not train on, then the rest) as a question file, and print how many each kind "
        "got from each tier."))
    parser.add_argument("--per-kind", type=int, default=60, help="questions per kind (default 60)")
    parser.add_argument("--kinds", default=",".join(KINDS), help=f"comma-separated (default: {','.join(KINDS)})")
    parser.add_argument("--out", type=Path, default=None, help="the question file to write (JSONL; default: none)")
    add_flag(parser, "sharegpt")
    parser.add_argument("--later-turns", action="store_true", help=(
        "also take later user turns that stand alone (a kind's rules ask for its passage in the turn), after every "
        "first turn of their tier: ShareGPT's first turns hold fewer than 60 summarization and rag prompts"))
    args = parser.parse_args(argv)
    with arguments():
        if args.per_kind < 0:
            raise ValueError(f"--per-kind must be >= 0, got {args.per_kind}")
        kinds = [k.strip() for k in args.kinds.split(",") if k.strip()]
        unknown = [k for k in kinds if k not in KINDS]
        if not kinds or unknown:
            raise ValueError(f"--kinds: choose from {', '.join(KINDS)}, got {args.kinds!r}")
    counts: dict[str, KindCounts] = {}
    questions = sharegpt_kind_questions(args.per_kind, kinds, path=args.sharegpt, counts=counts,
                                       later_turns=args.later_turns)
    if args.out:
        write_text_atomic(args.out, question_lines(questions))
        print(f"{args.out}: {len(questions)} questions")
    print(kinds_table(counts, args.per_kind))
    return 0


if __name__ == "__main__":
    sys.exit(main())
