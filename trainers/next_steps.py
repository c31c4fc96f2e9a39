"""What a finished training run prints last: where the head is, how it validated (with a warning when the held-out
split is too small to mean anything), where its curve is, and the exact commands to chat with it, benchmark it
against prompt lookup on held-out kinds of question, serve it and export it."""
from __future__ import annotations

import os
import shlex
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
HELDOUT = ROOT / "eval" / "questions" / "heldout12.jsonl"
MIN_VAL_SEQUENCES = 20     # fewer held-out answers: top-1 moves by several points from one answer to the next
MIN_VAL_TOKENS = 2000


def _arg(path) -> str:
    """A path as the user would type it here: relative to the working directory when below it."""
    text = str(path)
    try:
        relative = os.path.relpath(Path(text).resolve())
    except ValueError:   # another drive
        return shlex.quote(text)
    return shlex.quote(text if relative.startswith("..") else relative)


def commands(result: dict, spec: str | None) -> list[tuple[str, str]]:
    """(what, command) for the exported head of `result`, trained for target `spec` (None: a tiny random target that
    only exists inside a training process)."""
    head, kind = _arg(result["export"]), result.get("head_kind", "eagle")
    if spec is None:
        return []
    target = [] if spec == "smollm2" else ["--target", shlex.quote(spec)]   # as the user gave it
    draft = ["--method", "medusa", "--medusa", head] if kind == "medusa" else ["--draft", head]
    fmt = {"medusa": "medusa", "eagle3": "eagle3"}.get(kind, "eagle")
    methods = "vanilla,lookup,medusa" if kind == "medusa" else "vanilla,lookup,eagle"
    return [
        ("chat", " ".join(["python -m eagle_lite.generate", *target, *draft])),
        ("benchmark", " ".join(["python -m eval.benchmark", *target, *draft, "--methods", methods, "--tasks", "''",
                                "--questions", _arg(HELDOUT), "--per-task", "2", "--max-new-tokens", "256"])),
        ("serve", " ".join(["python -m eagle_lite.serve", *target, *draft])),
        ("export", " ".join(["python -m eagle_lite.export", head, "--format", fmt, "--out",
                             _arg(f"{result['export']}-{fmt}")])),
    ]


def validation_warning(result: dict) -> str | None:
    """One line when the held-out split is too small for its figures to mean anything."""
    sequences, tokens = result.get("val_sequences"), result.get("val/tokens")
    if sequences is None or tokens is None:
        return None
    if sequences >= MIN_VAL_SEQUENCES and tokens >= MIN_VAL_TOKENS:
        return None
    return (f"warning: validation held out {sequences} sequences ({int(tokens):,} tokens), too few to compare heads by "
            f"(at least {MIN_VAL_SEQUENCES} and {MIN_VAL_TOKENS:,}): raise data.distill.limit or "
            f"data.loader.val_percent")


def closing(result: dict, spec: str | None) -> str:
    """The run's last lines (`result`: `train.run_stages`' summary)."""
    export = Path(result["export"])
    took = f"{result['seconds']} s"
    if result.get("estimated_seconds") is not None:
        took += f", estimated {result['estimated_seconds']} s"
    lines = [f"head: {export}  (step {result['global_step']}, {result.get('epochs')} epochs; {took})"]
    if "val/top1" in result:
        held = (f" on {result['val_sequences']} held-out sequences ({int(result.get('val/tokens', 0)):,} tokens)"
                if result.get("val_sequences") is not None else "")
        estimate = (f", accepted per step (estimated) {result['val/accept_len_est']:.2f}"
                    if "val/accept_len_est" in result else "")
        lines.append(f"validation: top-1 {result['val/top1']:.3f}{estimate}{held}")
    warning = validation_warning(result)
    if warning:
        lines.append(warning)
    curve = export / "training_curve.png"
    if curve.is_file():
        lines.append(f"curve: {curve}  (per epoch: {export / 'train_log.md'})")
    steps = commands(result, spec)
    if steps:
        lines.append("next:")
        width = max(len(what) for what, _ in steps) + 1
        lines += [f"  {what + ':':<{width}} {command}" for what, command in steps]
    else:
        lines.append("next: a tiny random target lives only inside training; train on a model folder or hub id "
                     "(target=MODEL) for a head to chat with, benchmark, serve and export")
    return "\n".join(lines)
