"""The training log exported next to a head: metrics per epoch, time, disk used.

`History` is a Lightning callback that keeps the metrics of every finished epoch; `write_train_log`
writes them as `train_log.json` (for tools) and `train_log.md` (for people).
"""
from __future__ import annotations

import time
from pathlib import Path

import lightning.pytorch as L

from eagle_lite.atomic import write_json_atomic, write_text_atomic

_KEYS = ("train/loss_epoch", "train/loss_reg_epoch", "train/loss_cls_epoch", "train/top1_epoch",
         "val/loss", "val/top1", "val/top3", "val/accept_len_est")


class History(L.Callback):
    """Collects {epoch, step, seconds, metric: value} at the end of every training epoch."""

    def __init__(self) -> None:
        self.epochs: list[dict] = []
        self.start = time.perf_counter()
        self.start_step: int | None = None
        self.fit_seconds: float | None = None  # set by the caller around trainer.fit

    def on_train_start(self, trainer, pl_module) -> None:
        self.start_step = trainer.global_step  # > 0 when resumed from a checkpoint

    def on_fit_end(self, trainer, pl_module) -> None:
        if self.start_step is None:  # resumed a finished run: no training step ran at all
            self.start_step = trainer.global_step

    def on_train_epoch_end(self, trainer, pl_module) -> None:
        metrics = trainer.callback_metrics
        row = {"epoch": trainer.current_epoch, "step": trainer.global_step,
               "seconds": round(time.perf_counter() - self.start, 2)}
        row.update({k.removesuffix("_epoch"): round(float(metrics[k]), 5) for k in _KEYS if k in metrics})
        self.epochs.append(row)


def folder_bytes(folder: str | Path) -> int:
    folder = Path(folder)
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file()) if folder.exists() else 0


def write_train_log(folder: str | Path, summary: dict, epochs: list[dict]) -> None:
    """summary: flat facts of the run (experiment, steps, seconds, disk, final metrics)."""
    folder = Path(folder)
    write_json_atomic(folder / "train_log.json", {"summary": summary, "epochs": epochs})
    lines = ["# Draft head training log", ""]
    lines += [f"- **{k}**: {v}" for k, v in summary.items()]
    if epochs:
        keys = list(dict.fromkeys(k for row in epochs for k in row))
        lines += ["", "| " + " | ".join(keys) + " |", "|" + "---|" * len(keys)]
        lines += ["| " + " | ".join(str(row.get(k, "")) for k in keys) + " |" for row in epochs]
    write_text_atomic(folder / "train_log.md", "\n".join(lines) + "\n")
