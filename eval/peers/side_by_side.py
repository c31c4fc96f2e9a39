"""llama.cpp's EAGLE-3 against eagle_lite's default, same head, same prompts, same GGUF file, on this machine.

  python -m eval.peers.side_by_side [--prompts 12] [--max-new-tokens 128] [--threads 2] [--k 3] [--runs 1]
                                   [--llama-k 3] [--llama-args "--poll 0"]

The shipped SmolLM2 head, exported once by `python -m eagle_lite.export eagle_lite/heads/smollm2 --format
gguf-eagle3` (build/peers/exports/eagle3-gguf), drafts for llama.cpp's server (eval/peers/llama_server_peer.py; the
binaries of `eval/peers/install.sh llama` or $LLAMA_CPP_BIN) as a chain of --k tokens a round (and of each of
--llama-k, a row each; --llama-args: more llama-server flags for those rows); eagle_lite runs the same head at its
default (the head's recommended CPU tree) and as the same chain of --k. Each engine also decodes
plainly (vanilla); every run decodes the first turns of the first --prompts held-out questions
(eval/questions/heldout12.jsonl, chat-formatted once here), greedy, batch 1, up to --max-new-tokens (stopping at the
end-of-sequence token), the SmolLM2-135M-Instruct Q4_1 file: eagle_lite de-quantizes it to fp32, llama.cpp runs it
with its int8 activations, so each engine is compared with its own vanilla for identity and speed-up.
Prints a markdown table with the date and `lscpu`'s CPU; writes build/peers/run/side_by_side.json. Run it alone:
the timings share the CPU (`flock /tmp/bench.lock python -m eval.peers.side_by_side` here).
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

from eval.peers.common import EXPORTS, RUN, llama_bin, min_llama_speed, prompts, trimmed


def cpu_line() -> str:
    """lscpu's model name, with whether the CPU has AVX-512 and AMX."""
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
        name = next(line.split(":", 1)[1].strip() for line in out.splitlines() if line.startswith("Model name"))
    except (OSError, subprocess.CalledProcessError, StopIteration):
        name = "unknown CPU"
    flags = ""
    try:
        flags = next(line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags"))
    except (OSError, StopIteration):
        pass
    avx512 = "AVX-512" if " avx512f" in flags else "no AVX-512"
    amx = "AMX" if " amx_tile" in flags else "no AMX"
    return f"{name} ({avx512}, {amx})"


def eagle_lite_runs(target, ids: list[list[int]], max_new: int, k: int, runs: int) -> dict[str, dict]:
    from eagle_lite.config import GenerationConfig, TreeConfig
    from eagle_lite.drafters import EagleOptions, registry
    from eagle_lite.pipeline import engine_for, for_target

    default = for_target(target, registry.DEFAULT)
    chain = TreeConfig(depth=k, top_k=1, total_tokens=k, lookup=0)
    setups = {
        "vanilla": (engine_for(target, "vanilla", None), GenerationConfig(max_new)),
        f"default ({default.method}, the head's CPU tree)": (default.engine, default.config(max_new_tokens=max_new)),
        f"eagle, chain of {k} (llama.cpp's setting)": (engine_for(target, "eagle", EagleOptions(copy_mode=False)),
                                                      GenerationConfig(max_new, tree=chain)),
    }
    out = {}
    for name, (engine, cfg) in setups.items():
        engine.generate(ids[0], GenerationConfig(8, tree=cfg.tree))             # warm-up, untimed
        rows, forwards = [], 0
        for prompt in ids:
            best = None
            for _ in range(max(1, runs)):
                result = engine.generate(prompt, cfg)
                if best is None or result.stats.seconds < best[0].stats.seconds:
                    best = (result,)
            result = best[0]
            rows.append({"token_ids": list(result.token_ids), "seconds": result.stats.seconds})
            forwards += result.stats.target_forwards
        out[name] = {"rows": rows, "forwards": forwards}
    return out


def llama_runs(gguf: Path, draft: Path, prompts_file: Path, threads: int, ks: list[int], runs: int,
               extra: str = "") -> dict[str, dict]:
    binaries = llama_bin()
    if binaries is None:
        raise RuntimeError("no llama.cpp binaries: run eval/peers/install.sh llama, or set LLAMA_CPP_BIN=DIR")
    out = {}
    base = [sys.executable, "eval/peers/llama_server_peer.py", "--bin", str(binaries), "--gguf", str(gguf),
            "--prompts", str(prompts_file), "--threads", str(threads), "--runs", str(runs),
            "--min-speed", f"{min_llama_speed(threads):.2f}"]
    setups = [("vanilla", [])]
    for k in ks:
        more = ["--server-args", extra] if extra else []
        setups.append((f"eagle3, chain of {k}{f' ({extra})' if extra else ''}",
                       ["--draft", str(draft), "--k", str(k), *more]))
    for i, (name, flags) in enumerate(setups):
        result = RUN / f"side-llama-{i}.json"
        done = subprocess.run(base + ["--out", str(result)] + flags, capture_output=True, text=True)
        if done.returncode != 0:
            tail = " | ".join([line for line in (done.stdout + done.stderr).splitlines() if line.strip()][-3:])
            raise RuntimeError(f"llama.cpp {name}: exited {done.returncode}: {tail}")
        out[name] = json.loads(result.read_text())
    return out


def table(runs: dict[str, dict[str, dict]], eos: set[int], head: str) -> list[str]:
    lines = ["| engine | method | tokens/s | vs its own vanilla | tokens per target forward | accepted per draft round "
             "| identical to its own vanilla |", "|---|---|---:|---:|---:|---:|---|"]
    for engine, named in runs.items():
        vanilla = named["vanilla"]
        base = sum(len(r["token_ids"]) for r in vanilla["rows"]) / sum(r["seconds"] for r in vanilla["rows"])
        ref = [trimmed(r["token_ids"], eos) for r in vanilla["rows"]]
        for method, run in named.items():
            new = sum(len(r["token_ids"]) for r in run["rows"])
            speed = new / sum(r["seconds"] for r in run["rows"])
            spec = run.get("spec") or {}
            if spec.get("rounds"):
                tpf, acc = spec["tokens_per_round"], f"{spec['accepted_per_round']:.2f}"
            elif run.get("forwards"):
                tpf = new / run["forwards"]
                acc = "" if method == "vanilla" else f"{tpf - 1:.2f}"
            else:
                tpf, acc = 1.0, ""
            same = sum(trimmed(r["token_ids"], eos) == want for r, want in zip(run["rows"], ref))
            label = method if method == "vanilla" else f"{method}, {head}"
            lines.append(f"| {engine} | {label} | {speed:.1f} | {speed / base:.2f}x | {tpf:.2f} | {acc} | "
                         f"{same}/{len(ref)} |")
    return lines


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m eval.peers.side_by_side", description=__doc__.split("\n")[0])
    p.add_argument("--prompts", type=int, default=12)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--k", type=int, default=3, help="llama.cpp's drafted tokens a round (--spec-draft-n-max)")
    p.add_argument("--runs", type=int, default=1, help="timed runs per prompt; the fastest is kept")
    p.add_argument("--llama-k", default=None, help="llama.cpp's chain lengths, comma-separated (default: --k)")
    p.add_argument("--llama-args", default="", help="more llama-server flags for its EAGLE-3 rows")
    args = p.parse_args(argv)
    ks = [int(k) for k in (args.llama_k or str(args.k)).split(",") if k]
    import torch

    from eagle_lite.export import export
    from eagle_lite.formats.gguf_eagle3 import file_name
    from eagle_lite.heads.checkpoint import default_head_path
    from eagle_lite.targets.loading import embedded_gguf, load_target
    from eagle_lite.threads import set_threads

    set_threads(args.threads)
    RUN.mkdir(parents=True, exist_ok=True)
    target = load_target("smollm2")
    head = default_head_path(target.name)
    draft = EXPORTS / "eagle3-gguf" / file_name(target.name)
    export(head, "gguf-eagle3", draft.parent, target, torch.bfloat16)
    ids = prompts(target, args.prompts)
    prompts_file = RUN / "side_by_side_prompts.json"
    prompts_file.write_text(json.dumps({"prompts": ids, "max_new_tokens": args.max_new_tokens}))
    eos = {int(target.tokenizer.eos_token_id)} if target.tokenizer.eos_token_id is not None else set()
    started = time.strftime("%Y-%m-%d")
    runs = {"eagle_lite": eagle_lite_runs(target, ids, args.max_new_tokens, args.k, args.runs)}
    del target
    try:
        runs["llama.cpp"] = llama_runs(embedded_gguf(), draft, prompts_file, args.threads, ks, args.runs,
                                       args.llama_args)
    except RuntimeError as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    lines = [f"{started}, {cpu_line()}, {args.threads} threads; SmolLM2-135M-Instruct Q4_1, the shipped head "
             f"({head}); {len(ids)} held-out prompts, up to {args.max_new_tokens} greedy tokens, best of {args.runs}",
             "", *table(runs, eos, "shipped head")]
    print("\n".join(lines))
    (RUN / "side_by_side.json").write_text(json.dumps({"runs": runs, "table": lines}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
