"""`make peer-check`: the exported target and heads run in the engines people deploy, on this machine.

  python -m eval.peers.check [--prompts 4] [--max-new-tokens 64] [--k 3] [--engines vllm,openvino,hf4,llama]

1. Exports (eagle_lite.export) under build/peers/exports: the embedded target as a Hugging Face folder; the shipped
   head (EAGLE-3) in the speculators layout for vLLM and, with its embedding, for OpenVINO GenAI, which
   `optimum-cli export openvino` converts (fp32) with the target; the EAGLE-1 head shipped before it
   (data/heads/smollm2-eagle1) for vLLM (--format eagle --engine vllm, --allow-lossy: the export prints what vLLM
   loses, measured).
2. The first turns of the first --prompts held-out questions (eval/questions/heldout12.jsonl), chat-formatted once
   here: every engine gets the same prompt ids and --max-new-tokens, greedy, batch 1.
3. eagle_lite vanilla (the reference tokens), eagle_lite eagle with each head as a chain of --k drafted tokens
   (tree depth k, top_k 1, no lookup graft: the setting vLLM's num_speculative_tokens k and OpenVINO GenAI's
   num_assistant_tokens k run), then each peer in its own venv (build/peers/<engine>, eval/peers/install.sh),
   through eval/peers/<engine>_peer.py.
   llama.cpp decodes the embedded GGUF file itself: its own server (eval/peers/llama_server_peer.py, the binaries
   install.sh builds from the llama.cpp llama-cpp-python vendors, or $LLAMA_CPP_BIN) plain, and with the shipped
   head exported by `eagle_lite.export --format gguf-eagle3` as its EAGLE-3 draft (a chain of --k, every round);
   a build whose plain speed is under a tenth of the AVX2 speed is named broken, not timed. Its rows are compared
   with llama.cpp's own plain greedy output (its int8 activations give other tokens than eagle_lite's fp32), and
   llama.cpp's speculation counters (accepted tokens per draft round) follow the table. llama-cpp-python
   (build/peers/llama) adds its own plain row where installed.
4. A table: engine, method, tokens per target forward, tokens/s, output identical to eagle_lite's vanilla, start-up
   seconds; written to build/peers/run/table.md and results.json as well.

With llama among the engines, a second table follows: llama.cpp against eagle_lite vanilla and its default method
on the SmolLM2 Q4_1 and Gemma 3 270M Q4_K_M files as they are (eval/llama_table.py, one prompt, best of 3).
A peer that fails prints its command and the last lines of its error in the table's notes instead of a row.
Run it alone on the machine (`flock /tmp/cpu.lock make peer-check` here): the timings share the CPU.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

from eval.peers.common import EXPORTS, ROOT, RUN, llama_bin, min_llama_speed, prompts, trimmed

PEERS = ("vllm", "openvino", "hf4", "llama")
LLAMA_PLAIN = "llama.cpp vanilla"
EAGLE1_HEAD = Path("data/heads/smollm2-eagle1")   # the EAGLE-1 head shipped before the EAGLE-3 one


def sh(cmd: list[str], log: Path) -> None:
    """Run `cmd`, its output to `log`; a RuntimeError with the command and the log's tail if it fails."""
    with open(log, "w") as f:
        code = subprocess.call(cmd, stdout=f, stderr=subprocess.STDOUT)
    if code != 0:
        tail = [line for line in log.read_text(errors="replace").splitlines() if line.strip()][-6:]
        raise RuntimeError(f"`{' '.join(cmd)}` exited {code}: " + " | ".join(tail))


def export_all(target, fresh: bool) -> dict[str, list[str]]:
    """The folders the peers load, written by eagle_lite.export; returns each export's notes."""
    import torch

    from eagle_lite.export import export, export_target
    from eagle_lite.heads.checkpoint import default_head_path

    notes: dict[str, list[str]] = {}
    folder = EXPORTS / "smollm2"
    if fresh or not (folder / "config.json").is_file():
        notes["target"] = export_target("smollm2", folder)
    notes["eagle1-vllm"] = export(EAGLE1_HEAD, "eagle", EXPORTS / "eagle1-vllm", target, torch.bfloat16,
                                  engine="vllm", allow_lossy=True)
    shipped = default_head_path(target.name)
    notes["eagle3-gguf"] = export(shipped, "gguf-eagle3", EXPORTS / "eagle3-gguf", target, torch.bfloat16)
    for engine in ("speculators", "openvino"):
        notes[f"eagle3-{engine}"] = export(shipped, "eagle3", EXPORTS / f"eagle3-{engine}", target, torch.float32,
                                           engine=engine, verifier=str(folder.resolve()))
    return notes


def eagle_lite_runs(target, ids: list[list[int]], max_new: int, k: int) -> dict[str, dict]:
    """eagle_lite vanilla and eagle (each head as a chain of k) on the prompts: tokens, seconds, forwards."""
    from eagle_lite.config import GenerationConfig, TreeConfig
    from eagle_lite.drafters import EagleOptions
    from eagle_lite.formats import load_head
    from eagle_lite.pipeline import engine_for

    chain = TreeConfig(depth=k, top_k=1, total_tokens=k, lookup=0)
    heads = {"eagle3 (shipped head)": None, "eagle (EAGLE-1 head)": load_head(EAGLE1_HEAD, target)}
    engines = {"vanilla": (engine_for(target, "vanilla", None), GenerationConfig(max_new))}
    for name, head in heads.items():
        options = EagleOptions(head=head, copy_mode=False) if head is not None else EagleOptions(copy_mode=False)
        engines[f"{name}, k={k}"] = (engine_for(target, "eagle", options),
                                     GenerationConfig(max_new, tree=chain))
    out = {}
    for name, (engine, cfg) in engines.items():
        engine.generate(ids[0], GenerationConfig(8, tree=cfg.tree))          # warm-up, untimed
        rows, forwards = [], 0
        for prompt in ids:
            result = engine.generate(prompt, cfg)
            rows.append({"token_ids": list(result.token_ids), "seconds": result.stats.seconds})
            forwards += result.stats.target_forwards
        out[name] = {"engine": "eagle_lite", "rows": rows, "forwards": forwards, "startup_s": None}
    return out


def peer_runs(engines: list[str], k: int, prompts_file: Path, threads: int) -> tuple[dict[str, dict], list[str]]:
    """Each peer's runs (vanilla, then with its head), through its script in its venv; failures as notes."""
    py = {e: str(ROOT / e / "bin" / "python") for e in PEERS}
    target = str(EXPORTS / "smollm2")
    jobs: list[tuple[str, list[str]]] = []
    if "hf4" in engines:
        jobs.append(("hf4 generate", [py["hf4"], "eval/peers/hf4_peer.py", "--target", target, "--threads",
                                      str(threads)]))
    if "llama" in engines:
        from eagle_lite.formats.gguf_eagle3 import file_name
        from eagle_lite.targets.loading import embedded_gguf

        gguf = str(embedded_gguf())
        if (ROOT / "llama" / ".installed").is_file():
            jobs.append(("llama-cpp-python generate (the Q4_1 GGUF file)",
                         [py["llama"], "eval/peers/llama_peer.py", "--gguf", gguf, "--threads", str(threads)]))
        binaries = llama_bin()
        if binaries is not None:
            server = [sys.executable, "eval/peers/llama_server_peer.py", "--bin", str(binaries), "--gguf", gguf,
                      "--threads", str(threads), "--min-speed", f"{min_llama_speed(threads):.2f}"]
            draft = EXPORTS / "eagle3-gguf" / file_name("smollm2")
            jobs += [(LLAMA_PLAIN, server),
                     (f"llama.cpp eagle3 (shipped head), k={k}", server + ["--draft", str(draft), "--k", str(k)])]
    if "vllm" in engines:
        peer = [py["vllm"], "eval/peers/vllm_peer.py", "--target", target]
        jobs += [("vllm vanilla", peer),
                 (f"vllm eagle3 speculators (shipped head), k={k}",
                  peer + ["--head", str(EXPORTS / "eagle3-speculators"), "--speculators", "--k", str(k)]),
                 (f"vllm eagle (EAGLE-1 head), k={k}",
                  peer + ["--head", str(EXPORTS / "eagle1-vllm"), "--k", str(k)])]
    if "openvino" in engines:
        ov = ROOT / "ov"
        convert = [("smollm2", EXPORTS / "smollm2"), ("eagle3", EXPORTS / "eagle3-openvino")]
        failed = None
        for name, src in convert:
            if not (ov / name / "openvino_model.xml").is_file():
                try:
                    sh([py["openvino"], "eval/peers/openvino_convert.py", str(src), str(ov / name)],
                       RUN / f"convert-{name}.log")
                except RuntimeError as err:
                    failed = str(err)
        peer = [py["openvino"], "eval/peers/openvino_peer.py", "--target", str(ov / "smollm2"), "--threads",
                str(threads)]
        if failed is None or (ov / "smollm2" / "openvino_model.xml").is_file():
            jobs.append(("openvino vanilla", peer))
        if (ov / "eagle3" / "openvino_model.xml").is_file():
            jobs.append((f"openvino eagle3 (shipped head), k={k}",
                         peer + ["--draft", str(ov / "eagle3"), "--k", str(k)]))
    results, notes = {}, []
    if "openvino" in engines and failed is not None:
        notes.append(f"OpenVINO conversion failed: {failed}")
    for name, cmd in jobs:
        out = RUN / (name.split(",")[0].replace(" ", "-").replace("(", "").replace(")", "") + ".json")
        out.unlink(missing_ok=True)
        try:
            sh(cmd + ["--prompts", str(prompts_file), "--out", str(out)], out.with_suffix(".log"))
            results[name] = json.loads(out.read_text())
        except RuntimeError as err:
            notes.append(f"{name}: {err}")
    for name, run in results.items():
        if name.startswith("llama.cpp ") and name != LLAMA_PLAIN:
            run["reference"] = LLAMA_PLAIN        # llama.cpp's own numerics: compared with its own plain greedy
    return results, notes


def llama_spec_lines(runs: dict[str, dict]) -> list[str]:
    """llama.cpp's own speculation counters of its EAGLE-3 rows (llama_server_peer.py reads them from /metrics)."""
    lines = []
    for name, run in runs.items():
        spec = run.get("spec") or {}
        if name.startswith("llama.cpp ") and spec.get("rounds"):
            lines.append(f"- {name}: llama.cpp reports {spec['accepted_tokens']:.0f} drafted tokens accepted of "
                         f"{spec['drafted_tokens']:.0f} in {spec['rounds']:.0f} draft rounds: "
                         f"{spec['accepted_per_round']:.2f} accepted per round, mean length "
                         f"{spec['tokens_per_round']:.2f} tokens per target forward")
    return lines


def tokens_per_forward(name: str, run: dict) -> float | None:
    new = sum(len(r["token_ids"]) for r in run["rows"])
    if run.get("forwards"):
        return new / run["forwards"]
    spec = run.get("spec") or {}
    if spec.get("tokens_per_round"):
        return spec["tokens_per_round"]                  # llama.cpp's mean length: 1 + accepted / rounds
    if spec.get("drafts"):
        return 1 + spec.get("accepted_tokens", 0) / spec["drafts"]
    if spec.get("main_inferences"):
        return new / spec["main_inferences"]
    return 1.0 if "vanilla" in name or "generate" in name else None


def table(runs: dict[str, dict], eos: set[int]) -> list[str]:
    lines = ["| engine | method | tokens per target forward | tokens/s | identical to eagle_lite vanilla (or: to) "
             "| start-up s |", "|---|---|---|---|---|---|"]
    for name, run in runs.items():
        new = sum(len(r["token_ids"]) for r in run["rows"])
        seconds = sum(r["seconds"] for r in run["rows"])
        against = run.get("reference") if run.get("reference") in runs else "eagle_lite vanilla"
        reference = [trimmed(r["token_ids"], eos) for r in runs[against]["rows"]]
        same = sum(trimmed(r["token_ids"], eos) == ref for r, ref in zip(run["rows"], reference))
        tpf = tokens_per_forward(name, run)
        engine, _, method = name.partition(" ")
        start = run.get("startup_s")
        lines.append(f"| {run.get('engine', engine)} | {method} | {'n/a' if tpf is None else f'{tpf:.2f}'} | "
                     f"{new / seconds:.1f} | {same}/{len(reference)}"
                     f"{'' if against == 'eagle_lite vanilla' else f' (to {against})'} | "
                     f"{'' if start is None else f'{start:.0f}'} |")
    return lines


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m eval.peers.check", description=__doc__.split("\n")[0])
    p.add_argument("--prompts", type=int, default=4)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--k", type=int, default=3, help="drafted tokens per step (a chain), every engine")
    p.add_argument("--engines", default=",".join(PEERS))
    p.add_argument("--threads", type=int, default=1,
                   help="threads of eagle_lite, transformers 4.x and OpenVINO (vLLM's CPU build runs torch on one)")
    p.add_argument("--fresh", action="store_true", help="re-export the target folder too")
    args = p.parse_args(argv)
    engines = [e for e in args.engines.split(",") if e]
    unknown = sorted(set(engines) - set(PEERS))
    if unknown:
        print(f"error: unknown engine(s) {unknown}: choose from {', '.join(PEERS)}", file=sys.stderr)
        return 1
    missing = [e for e in engines if not (ROOT / e / ".installed").is_file()
               and not (e == "llama" and llama_bin() is not None)]
    if missing:
        print(f"error: no venv for {missing}: run eval/peers/install.sh {' '.join(missing)}", file=sys.stderr)
        return 1
    from eagle_lite.targets.loading import load_target
    from eagle_lite.threads import set_threads

    set_threads(args.threads)
    RUN.mkdir(parents=True, exist_ok=True)
    target = load_target("smollm2")
    started = time.strftime("%Y-%m-%d")
    notes = export_all(target, args.fresh)
    for name, lines in notes.items():
        for line in lines:
            print(f"export {name}: {line}")
    ids = prompts(target, args.prompts)
    prompts_file = RUN / "prompts.json"
    prompts_file.write_text(json.dumps({"prompts": ids, "max_new_tokens": args.max_new_tokens}))
    runs = {f"eagle_lite {k}": v for k, v in eagle_lite_runs(target, ids, args.max_new_tokens, args.k).items()}
    del target
    peers, failures = peer_runs(engines, args.k, prompts_file, args.threads)
    runs.update(peers)
    eos = set(load_eos())
    lines = [f"{started}, {len(ids)} held-out prompts, {args.max_new_tokens} new tokens, greedy, batch 1, fp32, "
             f"{args.threads} thread(s) each", "", *table(runs, eos)]
    lines += llama_spec_lines(runs)
    lines += [f"- {f}" for f in failures]
    if "llama" in engines and (ROOT / "llama" / ".installed").is_file():
        lines += ["", "The GGUF files as they are (eval/llama_table.py):", "", *llama_files_table(args.threads)]
    print("\n".join(lines))
    (RUN / "table.md").write_text("\n".join(lines) + "\n")
    (RUN / "results.json").write_text(json.dumps(runs))
    return 0


def llama_files_table(threads: int) -> list[str]:
    """eval/llama_table.py's table (llama.cpp, eagle_lite vanilla and the default method on both GGUF files), at its
    defaults, run as its own command."""
    python = str(ROOT / "llama" / "bin" / "python")
    cmd = [sys.executable, "-m", "eval.llama_table", "--threads", str(threads), "--llama-python", python]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        return [f"eval.llama_table failed: {(done.stderr.strip().splitlines() or ['no output'])[-1]}"]
    return done.stdout.rstrip("\n").splitlines()


def load_eos() -> list[int]:
    config = json.loads((EXPORTS / "smollm2" / "generation_config.json").read_text())
    eos = config.get("eos_token_id")
    return eos if isinstance(eos, list) else [eos]


if __name__ == "__main__":
    sys.exit(main())
