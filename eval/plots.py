"""Plots of a sweep: speedup per category per method, and the histogram of accepted lengths."""
from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only, no display
import matplotlib.pyplot as plt  # noqa: E402

from .runner import Record  # noqa: E402


def plot_speedups(rows: list[dict], baseline: str, path: Path) -> Path:
    categories = list(dict.fromkeys(r["category"] for r in rows))
    methods = list(dict.fromkeys(r["method"] for r in rows))
    width = 0.8 / max(len(methods), 1)
    fig, ax = plt.subplots(figsize=(3.2 + 1.2 * len(categories), 3.6))
    for i, method in enumerate(methods):
        xs, ys = [], []
        for j, cat in enumerate(categories):
            row = next((r for r in rows if r["category"] == cat and r["method"] == method), None)
            if row and row["speedup"] is not None:
                xs.append(j + (i - (len(methods) - 1) / 2) * width)
                ys.append(row["speedup"])
        ax.bar(xs, ys, width, label=method)
    ax.axhline(1.0, color="gray", lw=0.8, ls="--")
    ax.set_xticks(range(len(categories)), categories)
    ax.set_ylabel(f"speedup vs {baseline}")
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))  # beside the bars, never over them
    fig.tight_layout()
    fig.savefig(path, dpi=120, format="png")   # by name: an atomic write draws into a .tmp file
    plt.close(fig)
    return path


def plot_accept_lengths(records: list[Record], path: Path) -> Path:
    by_method: dict[str, list[int]] = {}
    for r in records:
        by_method.setdefault(r.method, []).extend(r.accept_lengths)
    by_method = {m: v for m, v in by_method.items() if v}
    fig, ax = plt.subplots(figsize=(5, 3.4))
    top = max((max(v) for v in by_method.values()), default=1)
    for method, lengths in by_method.items():
        ax.hist(lengths, bins=range(1, top + 2), alpha=0.6, label=method, align="left", density=True)
    ax.set_xlabel("tokens accepted per target forward (bonus included)")
    ax.set_ylabel("fraction of steps")
    if by_method:
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120, format="png")   # by name: an atomic write draws into a .tmp file
    plt.close(fig)
    return path
