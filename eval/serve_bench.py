"""`python -m eval.serve_bench`: load test of `python -m eagle_lite.serve` on loopback, per method: 1, 2, 4 and 8
concurrent streaming clients over held-out prompts, aggregate tokens/s and per-request latency (time to first
token and total, p50/p95), beside the same requests one at a time and the CLI's engine on the same prompts.

    python -m eval.serve_bench                        # SmolLM2; vanilla, lookup, eagle, default; 8 requests a level
    python -m eval.serve_bench --temperature 1.0      # every request sampled (OpenAI clients' default)
    python -m eval.serve_bench --methods eagle --clients 1,8 --requests 16 --max-tokens 64
    python -m eval.serve_bench --rounds 3             # each level 3 times a method, taking turns; the fastest kept,
                                                      # and each round's ratio to the first method with their median

Each method's server runs as its own process (`python -m eagle_lite.serve` on 127.0.0.1, a free port), all of them
up at once so that at each level the methods take turns (drift on a shared host hits them alike); the clients
are threads of this one; a level sends `--requests` requests (at least one per client), each client one at a time,
and stops starting new ones after `--seconds`. Every request has `max_tokens` = --max-tokens and is greedy, its
answer checked against the CLI engine's answer to the same prompt (the `identical` column), or with --temperature
sampled (seed: the prompt's index; no identity check: a batch-mate's draws never move a request's, but the server's
and the CLI's trees differ, and so do their draws). The CLI row is the
engine alone in this process (`eagle_lite.load(...).generate`, what `python -m eagle_lite.generate` runs), before
any server starts, so the two never share the CPU. The "at once, no HTTP" row is the server's own batch loop in this
process (`batch_run`), given the largest level's number of prompts together: what that level would reach without
HTTP, clients or arrival times. For method auto a second table splits each level's sequence steps by the
controllers' choice (the server's /metrics), with the step time they predicted against the time measured.
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime, timezone
from pathlib import Path

from eagle_lite.atomic import check_writable, write_text_atomic
from eagle_lite.cli import arguments, entry_point
from eagle_lite.options import add_flag
from eagle_lite.threads import set_threads

QUESTIONS = Path(__file__).parent / "questions" / "heldout12.jsonl"


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m eval.serve_bench", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    add_flag(p, "target")
    add_flag(p, "methods", default="vanilla,lookup,eagle,default")
    add_flag(p, "temperature", note="every request samples at it")
    p.add_argument("--clients", default="1,2,4,8", help="concurrency levels")
    p.add_argument("--requests", type=int, default=8, help="requests per level (at least one per client)")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--seconds", type=float, default=120.0, help="a level starts no request after this long")
    p.add_argument("--rounds", type=int, default=1,
                   help="run each level this many times per method, the methods taking turns, and keep each "
                        "method's fastest round (other work on the host only slows a round down)")
    add_flag(p, "questions", type=Path, default=QUESTIONS, note="the requests are their first turns")
    add_flag(p, "threads", default=2, note="the server's and the CLI run's")
    add_flag(p, "batch-threads")
    add_flag(p, "max-batch")
    p.add_argument("--json", type=Path, default=None, help="also write every figure here")
    return p.parse_args(argv)


def prompts(path: Path) -> list[str]:
    """The first turn of each question of an MT-bench-style file (eval.tasks: a missing or malformed file says so)."""
    from .tasks import load_question_file

    return [q.turns[0] for q in load_question_file(path)]


def check_args(args: argparse.Namespace) -> tuple[list[str], list[int]]:
    """The flags, before anything loads: (methods, concurrency levels); a ValueError names the flag."""
    from eagle_lite.config import check_finite
    from eagle_lite.drafters.registry import names
    from eagle_lite.threads import check_threads

    methods = [m for m in args.methods.split(",") if m]
    if not methods or any(m not in names() for m in methods):
        raise ValueError(f"--methods takes comma-separated methods of {', '.join(names())}, "
                         f"got {args.methods!r}")
    try:
        levels = [int(c) for c in args.clients.split(",")]
    except ValueError:
        levels = []
    if not levels or min(levels) < 1:
        raise ValueError(f"--clients takes comma-separated counts >= 1 like 1,2,4,8, got {args.clients!r}")
    for flag, value in (("--requests", args.requests), ("--max-tokens", args.max_tokens),
                        ("--max-batch", args.max_batch), ("--rounds", args.rounds)):
        if value < 1:
            raise ValueError(f"{flag} must be >= 1, got {value}")
    if check_finite("--seconds", args.seconds) <= 0:
        raise ValueError(f"--seconds must be > 0, got {args.seconds}")
    check_threads(args.threads)
    check_threads(args.batch_threads, "--batch-threads")
    if check_finite("--temperature", args.temperature) < 0:
        raise ValueError(f"--temperature must be >= 0 (0: greedy), got {args.temperature}")
    return methods, levels


def share(value: float | None) -> str:
    """A share of identical answers as a table cell; "—" where sampling leaves nothing to compare."""
    return "—" if value is None else f"{value:.0%}"


def percentile(values: list[float], q: float) -> float:
    if not values:
        return 0.0
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q / 100 * (len(ordered) - 1))))]


def cli_run(args, method: str, questions: list[str]) -> tuple[float, list[str]]:
    """tokens/s of the engine alone (what the CLI runs) over the questions, one after another; and its answers."""
    from eagle_lite import load

    set_threads(args.threads)
    lm = load(args.target, method=method)
    lm.generate(questions[0], lm.config(max_new_tokens=8))   # warm-up: kernels, caches
    tokens, seconds, answers = 0, 0.0, []
    for i, q in enumerate(questions):
        out = lm.generate(q, sampled(lm, args, i))
        tokens, seconds = tokens + out.stats.new_tokens, seconds + out.stats.seconds
        answers.append(out.text)
    del lm
    return tokens / seconds, answers


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(args, method: str):
    import httpx

    port = free_port()
    cmd = [sys.executable, "-m", "eagle_lite.serve", "--method", method, "--port", str(port), "--threads",
           str(args.threads), "--max-batch", str(args.max_batch), "--max-tokens-limit", str(max(args.max_tokens, 256))]
    if args.batch_threads is not None:
        cmd += ["--batch-threads", str(args.batch_threads)]
    if args.target:
        cmd += ["--target", args.target]
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 300
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited: {proc.stderr.read()}")
        if time.monotonic() > deadline:
            proc.kill()
            raise RuntimeError("the server did not start in 300 s")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return proc, url
        except httpx.TransportError:
            time.sleep(0.5)


def batch_run(args, method: str, questions: list[str]) -> tuple[float, list[str]]:
    """tokens/s of the server's batch loop alone, without HTTP: every question submitted at once to the scheduler
    `python -m eagle_lite.serve` runs (the same limits, cost model and threads), stepped on this thread until all
    are answered. The ceiling the server's largest level can reach; and its answers."""
    from eagle_lite import load
    from eagle_lite.serve import Limits, build_service
    from eagle_lite.serve.scheduler import Job

    set_threads(args.threads)
    lm = load(args.target, method=method)
    service = build_service(lm, "bench", Limits(max_batch=args.max_batch),
                            threads=(args.threads, args.batch_threads or args.threads))
    scheduler = service.scheduler
    answers: list[list[int]] = [[] for _ in questions]
    left = [len(questions)]

    def sink(i: int):
        def put(event: tuple) -> None:
            if event[0] == "tokens":
                answers[i] += event[1]
            elif event[0] in ("done", "error"):
                left[0] -= 1
                if not left[0]:
                    scheduler.stop()
        return put

    start = time.perf_counter()
    for i, q in enumerate(questions):
        scheduler.submit(Job(lm.encode([{"role": "user", "content": q}]), sampled(lm, args, i), sink(i)))
    scheduler.run()
    seconds = time.perf_counter() - start
    return sum(map(len, answers)) / seconds, [lm.decode(a) for a in answers]


def sampled(lm, args, i: int):
    """The GenerationConfig of question i: --max-tokens, greedy or at --temperature with seed i."""
    from eagle_lite.config import SamplingConfig

    return lm.config(max_new_tokens=args.max_tokens, sampling=SamplingConfig(temperature=args.temperature), seed=i)


def one_request(http, url: str, model: str, question: str, max_tokens: int, temperature: float = 0.0,
                seed: int = 0) -> dict:
    """A streaming chat request on the client `http` (an httpx.Client: its connection kept between requests, as
    the openai client keeps it): its time to first token, total time, tokens and text."""
    body = {"model": model, "messages": [{"role": "user", "content": question}], "max_tokens": max_tokens,
            "temperature": temperature, "seed": seed, "stream": True, "stream_options": {"include_usage": True}}
    start = time.perf_counter()
    first, text, tokens = None, [], 0
    with http.stream("POST", url + "/v1/chat/completions", json=body) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
            for choice in chunk.get("choices", []):
                piece = choice["delta"].get("content")
                if piece:
                    first = first or time.perf_counter()
                    text.append(piece)
    end = time.perf_counter()
    return {"ttft": (first or end) - start, "total": end - start, "tokens": tokens, "text": "".join(text)}


def auto_choices(http, url: str) -> dict[str, list[float]]:
    """Method auto's counters on the server's /metrics so far, per choice: [steps, tokens, predicted s, measured s]
    (empty for another method)."""
    names = ("auto_steps_total", "auto_tokens_total", "auto_predicted_seconds_total", "auto_measured_seconds_total")
    out: dict[str, list[float]] = {}
    for line in http.get(url + "/metrics").text.splitlines():
        name, _, rest = line.removeprefix("eagle_lite_").partition("{")
        if name in names and 'choice="' in rest:
            choice = rest.split('choice="', 1)[1].split('"', 1)[0]
            out.setdefault(choice, [0.0] * len(names))[names.index(name)] = float(rest.rsplit(" ", 1)[1])
    return out


def choice_rows(before: dict[str, list[float]], after: dict[str, list[float]]) -> dict[str, dict]:
    """A level's split of auto's sequence steps by choice (the counters' growth between two /metrics reads): share of
    steps, tokens a step, and ms a step as the controller predicted it and as measured (its share of the batch's)."""
    grown = {c: [a - b for a, b in zip(v, before.get(c, [0.0] * len(v)))] for c, v in after.items()}
    steps = sum(v[0] for v in grown.values()) or 1.0
    return {c: {"share": v[0] / steps, "tokens_per_step": v[1] / v[0], "predicted_ms": 1e3 * v[2] / v[0],
                "measured_ms": 1e3 * v[3] / v[0]} for c, v in sorted(grown.items()) if v[0] > 0}


def fastest(rounds: list[dict]) -> dict:
    """A level's fastest round, its identical share the least of every round's (None when sampled)."""
    row = dict(max(rounds, key=lambda r: r["tokens_per_s"]))
    if row["identical"] is not None:
        row["identical"] = min(r["identical"] for r in rounds)
    return {**row, "rounds": len(rounds)}


def round_ratios(runs: dict[str, list[list[dict]]]) -> dict[str, list[list[float]]]:
    """Each later method's rate over the first method's in the same round, per level: a figure that drift between
    rounds moves less than the fastest round does (the methods of a round run back to back, rounds minutes apart)."""
    base, *others = runs
    return {m: [[r["tokens_per_s"] / b["tokens_per_s"] for r, b in zip(mine, theirs)]
                for mine, theirs in zip(runs[m], runs[base])] for m in others}


def ratio_table(ratios: dict[str, list[list[float]]], base: str, levels: list[int]) -> list[str]:
    """`round_ratios` as a table: each level's rounds and their median."""
    lines = [f"| {method} | {clients} | {' '.join(f'{x:.3f}' for x in rounds)} | {statistics.median(rounds):.3f} |"
             for i, clients in enumerate(levels) for method, by_level in ratios.items() for rounds in [by_level[i]]]
    return [f"| method | clients | each round vs {base} | median |", "|---|---|---|---:|"] + lines


def level(url: str, model: str, questions: list[str], clients: int, args) -> tuple[dict, list[dict]]:
    """`clients` threads, each sending requests one at a time, `args.requests` in all (at least one each)."""
    import httpx

    n = max(args.requests, clients)
    todo = list(range(n))
    lock, results = threading.Lock(), []
    start = time.perf_counter()

    def client() -> None:
        with httpx.Client(timeout=600) as http:
            while True:
                with lock:
                    if not todo or time.perf_counter() - start > args.seconds:
                        return
                    i = todo.pop(0)
                q = i % len(questions)
                r = one_request(http, url, model, questions[q], args.max_tokens, args.temperature, q)
                with lock:
                    results.append({**r, "question": i % len(questions)})

    with ThreadPoolExecutor(clients) as pool:
        for f in [pool.submit(client) for _ in range(clients)]:
            f.result()
    wall = time.perf_counter() - start
    ttft, total = [r["ttft"] for r in results], [r["total"] for r in results]
    row = {"clients": clients, "requests": len(results), "tokens": sum(r["tokens"] for r in results),
           "seconds": wall, "tokens_per_s": sum(r["tokens"] for r in results) / wall,
           "ttft_p50": percentile(ttft, 50), "ttft_p95": percentile(ttft, 95),
           "total_p50": percentile(total, 50), "total_p95": percentile(total, 95)}
    return row, results


@entry_point
def main(argv=None) -> int:
    import httpx

    from eagle_lite.serve.protocol import served_model_id

    args = parse_args(argv)
    with arguments():
        methods, levels = check_args(args)
        if args.json:
            check_writable(args.json, "--json")   # before the runs whose figures it holds
    questions = prompts(args.questions)
    model = served_model_id(args.target or "smollm2")   # the name the server answers to
    report = {"date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"), "command": " ".join(sys.argv),
              "methods": {}}
    lines = ["| method | clients | requests | tokens/s | vs 1 client | vs CLI | TTFT p50 / p95 s | "
             "total p50 / p95 s | identical |", "|---|---|---|---|---|---|---|---|---|"]
    choices: list[str] = []
    alone: dict[str, tuple] = {}
    for method in methods:   # the engine alone and the batch loop alone, before any server starts
        cli_rate, cli_answers = cli_run(args, method, questions[:max(args.requests, max(levels))])
        print(f"{method}: CLI engine {cli_rate:.1f} tokens/s", file=sys.stderr, flush=True)
        together = questions[:max(levels)]
        batch_rate, batch_answers = batch_run(args, method, together)
        batch_same = None if args.temperature else \
            sum(a == b for a, b in zip(batch_answers, cli_answers)) / len(together)
        print(f"{method}: batch loop, {len(together)} at once, no HTTP {batch_rate:.1f} tokens/s", file=sys.stderr,
              flush=True)
        alone[method] = (cli_rate, cli_answers, batch_rate, batch_same, len(together))
    servers: dict[str, tuple] = {}
    runs: dict[str, list[list[dict]]] = {m: [[] for _ in levels] for m in methods}   # each level's rounds
    try:
        for method in methods:   # every server up (an idle one only holds memory), so levels interleave
            servers[method] = start_server(args, method)
            with httpx.Client(timeout=600) as http:
                one_request(http, servers[method][1], model, questions[0], 8)   # warm-up
        for i, clients in enumerate(levels):
            for turn in range(args.rounds):
                k = (i * args.rounds + turn) % len(methods)
                for method in methods[k:] + methods[:k]:
                    url, cli_answers = servers[method][1], alone[method][1]
                    with httpx.Client(timeout=60) as http:   # auto's counters before and after the level
                        before = auto_choices(http, url)
                        row, results = level(url, model, questions, clients, args)
                        row["choices"] = choice_rows(before, auto_choices(http, url))
                    row["identical"] = None if args.temperature else sum(
                        r["text"] == cli_answers[r["question"]] for r in results
                        if r["question"] < len(cli_answers)) / max(1, len(results))
                    runs[method][i].append(row)
                    print(f"{method}: {clients} clients {row['tokens_per_s']:.1f} tokens/s", file=sys.stderr,
                          flush=True)
    finally:
        for proc, _ in servers.values():
            proc.terminate()
            proc.wait(timeout=120)
    for method in methods:
        cli_rate, _, batch_rate, batch_same, together = alone[method]
        rows = [fastest(rounds) for rounds in runs[method]]
        base = rows[0]["tokens_per_s"] if rows else 1.0
        lines.append(f"| {method} | CLI engine | {max(args.requests, max(levels))} | {cli_rate:.1f} | | 1.00 | | | |")
        lines.append(f"| {method} | {together} at once, no HTTP | {together} | {batch_rate:.1f} | "
                     f"{batch_rate / base:.2f} | {batch_rate / cli_rate:.2f} | | | {share(batch_same)} |")
        for row in rows:
            lines.append(f"| {method} | {row['clients']} | {row['requests']} | {row['tokens_per_s']:.1f} | "
                         f"{row['tokens_per_s'] / base:.2f} | {row['tokens_per_s'] / cli_rate:.2f} | "
                         f"{row['ttft_p50']:.2f} / {row['ttft_p95']:.2f} | {row['total_p50']:.2f} / "
                         f"{row['total_p95']:.2f} | {share(row['identical'])} |")
        report["methods"][method] = {"cli_tokens_per_s": cli_rate, "batch_tokens_per_s": batch_rate,
                                     "batch_identical": batch_same, "levels": rows}
        for row in rows:
            for choice, c in row["choices"].items():
                choices.append(f"| {method} | {row['clients']} | {choice} | {c['share']:.0%} | "
                               f"{c['tokens_per_step']:.2f} | {c['predicted_ms']:.2f} | {c['measured_ms']:.2f} |")
    print("\n".join(lines))
    if args.rounds > 1 and len(methods) > 1:
        report["round_ratios"] = round_ratios(runs)
        print("\n" + "\n".join(ratio_table(report["round_ratios"], methods[0], levels)))
    if choices:   # method auto: what its controllers chose at each level, predicted against measured
        print("\n| method | clients | choice | steps | tokens/step | ms/step predicted | measured |\n"
              "|---|---|---|---:|---:|---:|---:|\n" + "\n".join(choices))
    if args.json:
        write_text_atomic(args.json, json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
