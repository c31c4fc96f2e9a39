"""The training log exported next to a head: metrics per epoch, time, disk used, and the training curve.

`History` is a Lightning callback that keeps the metrics of every finished epoch; `write_train_log`
writes them as `train_log.json` (for tools) and `train_log.md` (for people), and `plot_training_curve`
draws them into `training_curve.png`.
"""
from __future__ import annotations

import json
import time
from pathlib import Path

import lightning.pytorch as L

from eagle_lite.atomic import write_atomic, write_json_atomic, write_text_atomic

_KEYS = ("train/loss_epoch", "train/loss_reg_epoch", "train/loss_cls_epoch", "train/top1_epoch",
         "val/loss", "val/top1", "val/top3", "val/accept_len_est", "val/top1_novel")
KIND = "val_kind/"   # val_kind/<group>/top1 and /accept_len_est: validation per kind of data (trainers/module.py)


class History(L.Callback):
    """Collects {epoch, step, seconds, metric: value} at the end of every training epoch. With `path`, the rows are
    also written there after each epoch, and a resumed run starts from the rows of the steps its checkpoint holds:
    a run killed part way keeps the epochs it finished."""

    def __init__(self, path: str | Path | None = None) -> None:
        self.path = Path(path) if path is not None else None
        self.epochs: list[dict] = []
        self.start = time.perf_counter()
        self.start_step: int | None = None
        self.fit_seconds: float | None = None  # set by the caller around trainer.fit
        self.best: dict | None = None          # set by the caller when early stopping exports the best epoch
        self.exception: BaseException | None = None   # what stopped the fit, if anything did

    def on_train_start(self, trainer, pl_module) -> None:
        self.start_step = trainer.global_step  # > 0 when resumed from a checkpoint
        if self.path is not None and self.path.is_file() and self.start_step > 0:
            earlier = json.loads(self.path.read_text()).get("epochs", [])
            self.epochs = [row for row in earlier if row["step"] <= self.start_step] + self.epochs

    def on_fit_end(self, trainer, pl_module) -> None:
        if self.start_step is None:  # resumed a finished run: no training step ran at all
            self.start_step = trainer.global_step

    def on_exception(self, trainer, pl_module, exception: BaseException) -> None:
        self.exception = exception

    def on_train_epoch_end(self, trainer, pl_module) -> None:
        metrics = trainer.callback_metrics
        row = {"epoch": trainer.current_epoch, "step": trainer.global_step,
               "seconds": round(time.perf_counter() - self.start, 2)}
        row.update({k.removesuffix("_epoch"): round(float(metrics[k]), 5) for k in _KEYS if k in metrics})
        row.update({k: round(float(v), 5) for k, v in sorted(metrics.items()) if k.startswith(KIND)})
        self.epochs.append(row)
        if self.path is not None and trainer.is_global_zero:
            write_json_atomic(self.path, {"epochs": self.epochs})


def folder_bytes(folder: str | Path) -> int:
    folder = Path(folder)
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file()) if folder.exists() else 0


def _table(rows: list[dict], keys: list[str], names: list[str] | None = None) -> list[str]:
    names = names or keys
    return (["| " + " | ".join(names) + " |", "|" + "---|" * len(keys)]
            + ["| " + " | ".join(str(row.get(k, "")) for k in keys) + " |" for row in rows])


def kinds_of(epochs: list[dict]) -> list[str]:
    """The validation groups the epochs report, in order of first appearance."""
    return list(dict.fromkeys(k[len(KIND):].rsplit("/", 1)[0] for row in epochs for k in row if k.startswith(KIND)))


def write_train_log(folder: str | Path, summary: dict, epochs: list[dict]) -> None:
    """summary: flat facts of the run (experiment, steps, seconds, disk, final metrics). The markdown log has one
    table of the overall metrics per epoch and, where validation reports kinds, one of each kind's estimated
    acceptance (and top-1) per epoch."""
    folder = Path(folder)
    write_json_atomic(folder / "train_log.json", {"summary": summary, "epochs": epochs})
    lines = ["# Draft head training log", ""]
    lines += [f"- **{k}**: {v}" for k, v in summary.items()]
    if epochs:
        keys = list(dict.fromkeys(k for row in epochs for k in row if not k.startswith(KIND)))
        lines += ["", *_table(epochs, keys)]
        kinds = kinds_of(epochs)
        if kinds:
            lines += ["", "Validation by kind: estimated acceptance (val_kind/<kind>/accept_len_est)", ""]
            lines += _table(epochs, ["epoch"] + [f"{KIND}{k}/accept_len_est" for k in kinds], ["epoch", *kinds])
            lines += ["", "Validation by kind: top-1 (val_kind/<kind>/top1)", ""]
            lines += _table(epochs, ["epoch"] + [f"{KIND}{k}/top1" for k in kinds], ["epoch", *kinds])
    write_text_atomic(folder / "train_log.md", "\n".join(lines) + "\n")


def plot_training_curve(path: str | Path, epochs: list[dict], best_epoch: int | None = None) -> Path | None:
    """training_curve.png: per epoch, train and validation loss; validation top-1 (and top-1 on novel tokens);
    estimated acceptance overall and per kind. A dotted line marks the exported epoch (early stopping). None
    (nothing written) without epochs."""
    if not epochs:
        return None
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    def series(key: str) -> tuple[list[int], list[float]]:
        rows = [r for r in epochs if key in r]
        return [r["epoch"] for r in rows], [r[key] for r in rows]

    kinds = kinds_of(epochs)
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    panels = [(axes[0], "loss", [("train/loss", "train"), ("val/loss", "validation")]),
              (axes[1], "top-1 agreement", [("train/top1", "train"), ("val/top1", "validation"),
                                            ("val/top1_novel", "validation, novel tokens")]),
              (axes[2], "estimated accepted length", [("val/accept_len_est", "validation, all")])]
    for ax, title, keys in panels:
        for key, label in keys:
            xs, ys = series(key)
            if xs:
                ax.plot(xs, ys, marker="o", ms=3, lw=1.8, label=label)
        ax.set_title(title)
        ax.set_xlabel("epoch")
        ax.grid(alpha=0.3)
    for kind in kinds:
        xs, ys = series(f"{KIND}{kind}/accept_len_est")
        if xs:
            axes[2].plot(xs, ys, lw=0.9, alpha=0.8, label=kind)
    if best_epoch is not None:
        for ax in axes:
            ax.axvline(best_epoch, color="gray", ls=":", lw=1)
    for ax in axes:
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=7, loc="best", ncol=2 if ax is axes[2] and len(kinds) > 4 else 1)
    fig.tight_layout()
    path = Path(path)
    write_atomic(path, lambda tmp: fig.savefig(tmp, dpi=110, format="png"))
    plt.close(fig)
    return path
