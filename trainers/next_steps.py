"""What a finished training run prints last: where the head is, how it validated (with a warning when the held-out
split is too small to mean anything), where its curve is, and the exact commands to chat with it, benchmark it
against prompt lookup on held-out kinds of question (sized to take minutes here, with how long), serve it, send the
server a request it answers, and export it; and the head's CPU tree as the run tuned it, or the command that tunes
it."""
from __future__ import annotations

import json
import os
import shlex
from pathlib import Path

from eagle_lite.serve.protocol import served_model_id

ROOT = Path(__file__).resolve().parents[1]
HELDOUT = ROOT / "eval" / "questions" / "heldout12.jsonl"
MIN_VAL_SEQUENCES = 20     # fewer held-out answers: top-1 moves by several points from one answer to the next
MIN_VAL_TOKENS = 2000
HELDOUT_KINDS = 12         # kinds of question in HELDOUT
BENCH_BUDGET_S = 600       # the printed benchmark takes at most about this long here (the smallest size aside)
BENCH_SIZES = ((2, 256), (1, 256), (1, 128), (1, 64))   # (prompts a kind, new tokens), the largest that fits first
BENCH_METHODS = 3
SERVE_PORT = 8000          # eagle_lite.serve's default


def token_seconds(result: dict) -> float | None:
    """Seconds a token of plain decoding takes here: from the tree tune's vanilla (one answer, as the benchmark
    decodes), else from the estimate's probe (a batched decode step: slower than one answer's, so an upper bound)."""
    rate = (result.get("tune") or {}).get("vanilla_tokens_per_s")
    if rate:
        return 1.0 / rate
    return result.get("decode_step_s")


def benchmark_size(token_s: float | None) -> tuple[int, int, float | None]:
    """(prompts a kind, new tokens, about how many seconds) for the printed benchmark: the largest of BENCH_SIZES
    whose every method decoding at plain decoding's pace (an upper bound) fits BENCH_BUDGET_S, else the smallest."""
    if token_s is None:
        per_task, new = BENCH_SIZES[0]
        return per_task, new, None
    for per_task, new in BENCH_SIZES:
        seconds = HELDOUT_KINDS * per_task * BENCH_METHODS * new * token_s
        if seconds <= BENCH_BUDGET_S:
            break
    return per_task, new, seconds


def describe(seconds: float) -> str:
    return f"{seconds:.0f} s" if seconds < 90 else f"{seconds / 60:.0f} min"


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
    per_task, new_tokens, _ = benchmark_size(token_seconds(result))
    request = {"model": served_model_id(spec), "messages": [{"role": "user", "content": "Hello!"}],
               "max_tokens": 128}
    return [
        ("chat", " ".join(["python -m eagle_lite.generate", *target, *draft])),
        ("benchmark", " ".join(["python -m eval.benchmark", *target, *draft, "--methods", methods, "--tasks", "''",
                                "--questions", _arg(HELDOUT), "--per-task", str(per_task), "--max-new-tokens",
                                str(new_tokens)])),
        ("serve", " ".join(["python -m eagle_lite.serve", *target, *draft])),
        ("request", " ".join(["curl", "-s", f"http://127.0.0.1:{SERVE_PORT}/v1/chat/completions", "-H",
                              shlex.quote("Content-Type: application/json"), "-d", shlex.quote(json.dumps(request))])),
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
    tree = tree_line(result)
    if tree:
        lines.append(tree)
    steps = commands(result, spec)
    if steps:
        per_task, new_tokens, seconds = benchmark_size(token_seconds(result))
        if seconds is not None:
            lines.append(f"benchmark: {HELDOUT_KINDS} kinds x {per_task} prompt(s) x {BENCH_METHODS} methods, "
                         f"{new_tokens} new tokens each: about {describe(seconds)} here at plain decoding's pace "
                         f"(eval.benchmark --per-task and --max-new-tokens size it)")
        lines.append("next:")
        width = max(len(what) for what, _ in steps) + 1
        lines += [f"  {what + ':':<{width}} {command}" for what, command in steps]
    else:
        lines.append("next: a tiny random target lives only inside training; train on a model folder or hub id "
                     "(target=MODEL) for a head to chat with, benchmark, serve and export")
    return "\n".join(lines)


def plural(n: int, noun: str) -> str:
    """'1 node', '8 nodes'."""
    return f"{n} {noun}{'' if n == 1 else 's'}"


def tree_line(result: dict) -> str | None:
    """The head's CPU tree as the run tuned it, or the command that tunes it and about how long it takes."""
    tune = result.get("tune")
    if not tune:
        return None
    tree = tune.get("tree")
    if tree:
        speed = f", {tune['speedup']:.2f}x vanilla" if tune.get("speedup") else ""
        nodes = plural(tree["total_tokens"], "node")
        return (f"tree: tuned in {describe(tune['seconds'])} on a few held-out prompts: depth {tree['depth']}, top_k "
                f"{tree['top_k']}, {nodes}, lookup {tree['lookup']} ({tune['tokens_per_s']:.1f} tokens/s{speed}), "
                f"saved as the head's CPU tree; a longer tune: {tune['command']}")
    from .tree_tune import seconds_for

    token_s = token_seconds(result)
    took = f" (about {describe(seconds_for(token_s))} here)" if token_s else ""
    why = f"the tune failed ({tune['error']})" if tune.get("error") else "not tuned"
    return f"tree: {why}; eagle runs the CPU's default tree until this is run{took}: {tune['command']}"
