"""Validation curves of several training runs side by side, read from their Lightning CSV logs.

    python -m trainers.curves runs/train/smollm2/cpu_text/cpu_head runs/train/smollm2/cpu_text/cpu_head_scratch \\
        --out docs/cpu_head_levers.png

Each run folder's `logs/version_*/metrics.csv` (CSVLogger, every version: a resumed run adds one) holds the val/*
metrics of every validation, mid-epoch ones included (trainer.val_check_interval), by global step. Printed: one
markdown table per run (step, wall-clock seconds since its first logged row where the log has them, the metrics);
with --out, a PNG of val/top1 and val/accept_len_est by step, one line per run.
"""
from __future__ import annotations

import argparse
import csv
import sys
from pathlib import Path

METRICS = ("val/top1", "val/top1_novel", "val/accept_len_est", "val/loss")


def read_curve(run: str | Path) -> list[dict]:
    """[{step, val/...}] of every validation the run logged, in step order (a step logged twice: the later)."""
    rows: dict[int, dict] = {}
    files = sorted(Path(run).glob("logs/version_*/metrics.csv"), key=lambda p: int(p.parent.name.split("_")[-1]))
    if not files:
        raise FileNotFoundError(f"no logs/version_*/metrics.csv under {run}: is it a trainers.train run folder?")
    for file in files:
        with open(file, newline="") as f:
            for row in csv.DictReader(f):
                values = {k: float(row[k]) for k in row if k.startswith(("val/", "val_kind/")) and row[k] != ""}
                if values and row.get("step", "") != "":
                    rows.setdefault(int(row["step"]), {}).update(values)
    return [{"step": step, **rows[step]} for step in sorted(rows)]


def table(name: str, curve: list[dict]) -> str:
    keys = [k for k in METRICS if any(k in r for r in curve)]
    if not keys:
        return f"**{name}**: no validation logged yet"
    lines = [f"**{name}**", "", "| step | " + " | ".join(keys) + " |", "|---" * (len(keys) + 1) + "|"]
    lines += ["| " + " | ".join([str(r["step"])] + [f"{r[k]:.4f}" if k in r else "" for k in keys]) + " |"
              for r in curve]
    return "\n".join(lines)


def plot(curves: dict[str, list[dict]], out: str | Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from eagle_lite.atomic import write_atomic

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for ax, key in zip(axes, ("val/top1", "val/accept_len_est")):
        for name, curve in curves.items():
            rows = [r for r in curve if key in r]
            ax.plot([r["step"] for r in rows], [r[key] for r in rows], marker="o", ms=3, label=name)
        ax.set_title(key)
        ax.set_xlabel("optimizer step")
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=7)
    fig.tight_layout()
    write_atomic(Path(out), lambda tmp: fig.savefig(tmp, dpi=110, format="png"))
    plt.close(fig)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m trainers.curves", description=__doc__.split("\n\n")[0])
    parser.add_argument("runs", nargs="+", help="trainers.train run folders (paths.output)")
    parser.add_argument("--out", help="write the curves as a PNG here")
    args = parser.parse_args(argv)
    try:
        curves = {Path(run).name: read_curve(run) for run in args.runs}
    except (FileNotFoundError, ValueError) as err:
        print(f"error: {err}", file=sys.stderr)
        sys.exit(1)
    print("\n\n".join(table(name, curve) for name, curve in curves.items()))
    if args.out:
        plot(curves, args.out)
        print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
