"""Summaries of evaluation records: per category and overall, as a markdown table."""
from __future__ import annotations

from collections import defaultdict

from eagle_lite.decoding.engine import depth_acceptance

from .runner import Record


def summarize(records: list[Record], baseline: str) -> list[dict]:
    """One row per (category, method) plus 'overall' rows: tokens/s = total tokens / total seconds."""
    groups: dict[tuple[str, str], list[Record]] = defaultdict(list)
    for r in records:
        groups[(r.category, r.method)].append(r)
        groups[("overall", r.method)].append(r)
    rows = []
    for (category, method), rs in groups.items():
        tokens, seconds = sum(r.new_tokens for r in rs), sum(r.seconds for r in rs)
        accepted = [a for r in rs for a in r.accept_lengths]
        with_depths = [r for r in rs if len(r.draft_depths) == len(r.accept_lengths)]
        per_depth = depth_acceptance([a for r in with_depths for a in r.accept_lengths],
                                     [d for r in with_depths for d in r.draft_depths])
        rows.append({
            "category": category, "method": method, "turns": len(rs), "new_tokens": tokens,
            "tokens_per_s": tokens / seconds if seconds else 0.0,
            "accept_length_mean": sum(accepted) / len(accepted) if accepted else None,
            "per_depth": per_depth,   # decoding.engine.depth_acceptance: acceptance at each draft position
            "identical": (None if any(r.identical_to_baseline is None for r in rs)       # sampled: not compared
                          else sum(bool(r.identical_to_baseline) for r in rs) / len(rs)),
        })
    base = {row["category"]: row["tokens_per_s"] for row in rows if row["method"] == baseline}
    for row in rows:
        b = base.get(row["category"])
        row["speedup"] = row["tokens_per_s"] / b if b else None
    order = sorted({r.category for r in records}) + ["overall"]
    methods = list(dict.fromkeys(r.method for r in records))
    return sorted(rows, key=lambda row: (order.index(row["category"]), methods.index(row["method"])))


def markdown_table(rows: list[dict], baseline: str) -> str:
    lines = [f"| task | method | turns | new tokens | tokens/s | speedup vs {baseline} | mean accepted length "
             "| identical output |",
             "|---|---|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        accept = "—" if r["accept_length_mean"] is None else f"{r['accept_length_mean']:.2f}"
        speed = "—" if r["speedup"] is None else f"{r['speedup']:.2f}x"
        same = "—" if r["identical"] is None else f"{100 * r['identical']:.0f}%"
        lines.append(f"| {r['category']} | {r['method']} | {r['turns']} | {r['new_tokens']} | "
                     f"{r['tokens_per_s']:.1f} | {speed} | {accept} | {same} |")
    return "\n".join(lines)
