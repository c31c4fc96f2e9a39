"""llama.cpp's own server decodes a GGUF file greedily from given prompt ids, plainly or with an EAGLE-3 draft.

  python eval/peers/llama_server_peer.py --bin DIR --gguf TARGET.gguf --prompts prompts.json --out result.json \
      [--draft eagle3-smollm2.gguf --k 3] [--threads 1] [--runs 1] [--min-speed 2.9]

DIR holds the binaries eval/peers/install.sh llama builds from the llama.cpp that llama-cpp-python vendors
(llama-server; $LLAMA_CPP_BIN points elsewhere). One server per call: `llama-server -m TARGET` (plain greedy), with
--draft also `-md DRAFT --spec-type draft-eagle3 --spec-draft-n-max K --spec-draft-p-min 0` (a chain of K drafted
tokens a round, every round: the setting eagle_lite's chain of K and the other peers run). Each prompt is POSTed to
/completion as token ids (greedy: temperature 0, top_k 1; no prompt cache between prompts), the fastest of --runs
kept; its seconds are the server's own prompt + generation time. Generation stops at the end-of-sequence token, as
the table's comparison trims there.

Before any timing, --min-speed: the plain server decodes a short probe; a build slower than that many tokens/s is
named broken and nothing is timed (exit status 3; FACTS.md: a build with AMX on a host whose AMX stalls runs
~250 times slower). The speculation counters are llama.cpp's own (/metrics): drafted tokens, accepted tokens and
verification rounds; tokens per target forward = 1 + accepted / rounds, llama.cpp's "mean len". Stdlib only; imports
nothing from eagle_lite.
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

SERVER = "llama-server"
PROBE_TOKENS = 32


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def request(port: int, path: str, body: dict | None = None, timeout: float = 600.0) -> bytes:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(f"http://127.0.0.1:{port}{path}", data=data,
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        return resp.read()


class Server:
    """A llama-server process on a free local port, up until closed."""

    def __init__(self, binary: Path, gguf: str, threads: int, ctx: int, draft: str | None, k: int, log: Path,
                 extra: list[str] = ()):
        self.port = free_port()
        cmd = [str(binary), "-m", gguf, "-t", str(threads), "-tb", str(threads), "-c", str(ctx), "-np", "1",
               "--host", "127.0.0.1", "--port", str(self.port), "--metrics", "--no-webui", "--temp", "0"]
        if draft is not None:
            cmd += ["-md", draft, "--spec-type", "draft-eagle3", "--spec-draft-n-max", str(k),
                    "--spec-draft-p-min", "0", "-td", str(threads), "-tbd", str(threads)]
        cmd += list(extra)
        self.cmd, self.log = cmd, log
        self.log_file = open(log, "w")
        start = time.perf_counter()
        self.proc = subprocess.Popen(cmd, stdout=self.log_file, stderr=subprocess.STDOUT)
        while True:
            if self.proc.poll() is not None:
                self.close()
                tail = " | ".join(log.read_text(errors="replace").strip().splitlines()[-4:])
                raise RuntimeError(f"`{' '.join(cmd)}` exited {self.proc.returncode}: {tail}")
            try:
                if json.loads(request(self.port, "/health", timeout=5)).get("status") == "ok":
                    break
            except (urllib.error.URLError, ConnectionError, OSError, ValueError):
                pass
            if time.perf_counter() - start > 300:
                self.close()
                raise RuntimeError(f"`{' '.join(cmd)}` did not come up in 300 s")
            time.sleep(0.2)
        self.startup_s = time.perf_counter() - start

    def complete(self, ids: list[int], max_new: int, ignore_eos: bool = False) -> dict:
        body = {"prompt": ids, "n_predict": max_new, "temperature": 0.0, "top_k": 1, "top_p": 1.0, "min_p": 0.0,
                "repeat_penalty": 1.0, "cache_prompt": False, "return_tokens": True, "stream": False,
                "ignore_eos": ignore_eos}
        return json.loads(request(self.port, "/completion", body))

    def metrics(self) -> dict[str, float]:
        return parse_metrics(request(self.port, "/metrics").decode())

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log_file.close()


def parse_metrics(text: str) -> dict[str, float]:
    """llama.cpp's Prometheus counters (/metrics), by name without the "llamacpp:" prefix."""
    out = {}
    for line in text.splitlines():
        if line.strip() and not line.startswith("#"):
            name, _, value = line.strip().rpartition(" ")
            out[name.removeprefix("llamacpp:")] = float(value)
    return out


def spec_stats(before: dict[str, float], after: dict[str, float], runs: int) -> dict:
    """llama.cpp's speculation counters between two /metrics reads: drafted and accepted tokens, verification
    rounds, accepted per round and mean length (1 + accepted / rounds: tokens per target forward)."""
    delta = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in
             ("spec_decode_num_draft_tokens_total", "spec_decode_num_accepted_tokens_total",
              "spec_decode_num_drafts_total")}
    rounds, accepted = delta["spec_decode_num_drafts_total"], delta["spec_decode_num_accepted_tokens_total"]
    stats = {"drafted_tokens": delta["spec_decode_num_draft_tokens_total"], "accepted_tokens": accepted,
             "rounds": rounds, "runs": runs}
    if rounds:
        stats["accepted_per_round"] = accepted / rounds
        stats["tokens_per_round"] = 1 + accepted / rounds              # llama.cpp's "mean len"
    return stats


def run(server: Server, ids: list[int], max_new: int, ignore_eos: bool = False) -> dict:
    result = server.complete(ids, max_new, ignore_eos)
    timings = result.get("timings") or {}
    tokens = [int(t) for t in result.get("tokens") or []]
    seconds = (timings.get("prompt_ms", 0.0) + timings.get("predicted_ms", 0.0)) / 1000.0
    return {"token_ids": tokens, "seconds": seconds, "decode_seconds": timings.get("predicted_ms", 0.0) / 1000.0,
            "text": result.get("content", "")}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--bin", required=True, help="the folder holding llama-server")
    p.add_argument("--gguf", required=True)
    p.add_argument("--prompts", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--draft", default=None, help="an EAGLE-3 draft GGUF (eagle_lite.export --format gguf-eagle3)")
    p.add_argument("--k", type=int, default=3, help="drafted tokens per round (--spec-draft-n-max)")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--runs", type=int, default=1, help="timed runs per prompt; the fastest is kept")
    p.add_argument("--server-args", default="", help="more llama-server flags, space-separated (e.g. \"--poll 0\")")
    p.add_argument("--min-speed", type=float, default=0.0,
                   help="tokens/s the plain server must reach on a probe before anything is timed (0: no probe)")
    args = p.parse_args()
    binary = Path(args.bin) / SERVER
    if not binary.is_file():
        print(f"error: no {SERVER} in {args.bin}: run eval/peers/install.sh llama (or set LLAMA_CPP_BIN)",
              file=sys.stderr)
        return 1
    spec = json.loads(Path(args.prompts).read_text())
    max_new = int(spec["max_new_tokens"])
    ctx = max(512, max(len(ids) for ids in spec["prompts"]) + max_new + 16)
    logs = Path(os.environ.get("LLAMA_PEER_LOGS", tempfile.gettempdir()))
    name = "eagle3" if args.draft else "plain"
    if args.min_speed > 0:
        probe = Server(binary, args.gguf, args.threads, ctx, None, args.k, logs / "llama-server-probe.log")
        try:
            run(probe, spec["prompts"][0], 8)                                  # warm-up
            got = run(probe, spec["prompts"][0], PROBE_TOKENS, ignore_eos=True)   # every probe token decoded
        finally:
            probe.close()
        speed = len(got["token_ids"]) / max(got["decode_seconds"], 1e-9)
        if speed < args.min_speed:
            print(f"broken build: {binary} decodes {speed:.2f} tokens/s plain, under {args.min_speed:.1f} (a tenth of "
                  f"the AVX2 speed): not timed; rebuild it: eval/peers/install.sh llama (it checks each build and "
                  f"falls back to AVX2 flags)", file=sys.stderr)
            return 3
        print(f"probe: {speed:.1f} tokens/s plain ({args.threads} threads)")
    server = Server(binary, args.gguf, args.threads, ctx, args.draft, args.k, logs / f"llama-server-{name}.log",
                    args.server_args.split())
    try:
        run(server, spec["prompts"][0], 8)                                     # warm-up, untimed
        before = server.metrics()
        rows = []
        for ids in spec["prompts"]:
            best = None
            for _ in range(max(1, args.runs)):
                got = run(server, ids, max_new)
                if best is None or got["seconds"] < best["seconds"]:
                    best = got
            rows.append(best)
            print(f"{len(best['token_ids']) / best['seconds']:.1f} tokens/s ({args.threads} threads): {best['text']!r}")
            print(f"token ids: {best['token_ids']}")
        after = server.metrics()
    finally:
        server.close()
    stats = spec_stats(before, after, max(1, args.runs))
    if stats["rounds"]:
        print(f"llama.cpp speculation: {stats['accepted_tokens']:.0f} accepted of {stats['drafted_tokens']:.0f} "
              f"drafted in {stats['rounds']:.0f} rounds: {stats['accepted_per_round']:.2f} accepted a round, mean len "
              f"{stats['tokens_per_round']:.2f}")
    result = {"engine": "llama.cpp", "startup_s": server.startup_s, "rows": rows, "spec": stats,
              "command": " ".join(server.cmd)}
    Path(args.out).write_text(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
