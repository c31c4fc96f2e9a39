"""The HTTP server: the official openai client against an in-process server on a free loopback port, concurrent
clients whose greedy answers equal single-request decoding, cancellation, every limit and bad request, draining."""
from __future__ import annotations

import json
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import openai
import pytest
import torch
import uvicorn
from conftest import eagle_drafter, make_target, tiny_tokenizer

from eagle_lite.config import GenerationConfig, TreeConfig
from eagle_lite.decoding.engine import Engine
from eagle_lite.drafters import EagleOptions, NoDrafter, build
from eagle_lite.drafters.prompt_lookup import PromptLookupDrafter
from eagle_lite.heads.draft import DraftHead
from eagle_lite.pipeline import Pipeline
from eagle_lite.serve import Limits, build_service, create_app

TREE = TreeConfig(depth=3, top_k=3, total_tokens=6)
COST = {1: 0.001, 8: 0.002, 32: 0.004, 64: 0.02}   # a fixed forward-cost table: no timing in tests
QUESTIONS = ["hello there", "why is the sky blue?", "count: 1 2 3 1 2 3 1 2", "a", "tell me a story about a cat",
             "abcabcabcabc", "what?"]


@pytest.fixture(scope="module")
def chat_target():
    target = make_target("llama", seed=5, max_pos=4096)   # room for requests that run long enough to interrupt
    target.tokenizer = tiny_tokenizer()
    return target


class SlowDrafter(NoDrafter):
    """Plain decoding at most ~200 steps a second: requests that are surely still running when a test acts."""

    def propose(self, inp, tree):
        time.sleep(0.005)
        return super().propose(inp, tree)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_healthy(proc: subprocess.Popen, url: str, seconds: float = 240) -> None:
    """Wait until the server process `proc` answers /health at `url` (it must not exit first)."""
    deadline = time.monotonic() + seconds
    while True:
        assert proc.poll() is None, proc.stderr.read()
        assert time.monotonic() < deadline
        try:
            if httpx.get(url + "/health").status_code == 200:
                return
        except httpx.TransportError:
            time.sleep(0.2)


class Server:
    """A server in this process, on a thread, on a free loopback port."""

    def __init__(self, target, method: str = "vanilla", limits: Limits = Limits(max_batch=4), record=None,
                 adapt=None, **kwargs) -> None:
        torch.manual_seed(0)
        head = DraftHead.for_target(target) if method in ("eagle", "auto") else None
        make = {"vanilla": NoDrafter, "lookup": PromptLookupDrafter, "slow": SlowDrafter,
                "eagle": lambda: eagle_drafter(target, head),
                "auto": lambda: build("auto", target, EagleOptions(head=head))}[method]
        self.pipeline = Pipeline(target, make(), method if method != "slow" else "vanilla")
        self.pipeline.tree = TREE
        if record is not None:   # --record: what load(record=...) sets
            from eagle_lite.text.record import Recorder

            self.pipeline.recorder = Recorder(record, target)
        if adapt is not None:    # --adapt: what load(adapt=...) sets; requests then draft with the head serving
            from eagle_lite_wing.adapt import Adapter
            from eagle_lite_wing.learner import LearnConfig

            torch.manual_seed(0)
            start = DraftHead.for_target(target)
            Adapter(self.pipeline, adapt, start, cfg=LearnConfig(batch_tokens=256, window=128, replay=0.0),
                    judge_tokens=16)
            make = None
        self.service = build_service(self.pipeline, "tiny", limits, make_drafter=make, verify_seconds=COST, **kwargs)
        self.service.scheduler.start()
        self.port = free_port()
        self.server = uvicorn.Server(uvicorn.Config(create_app(self.service), host="127.0.0.1", port=self.port,
                                                   log_level="error"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            assert time.monotonic() < deadline, "the server did not start"
            time.sleep(0.02)
        self.url = f"http://127.0.0.1:{self.port}"
        self.client = openai.OpenAI(base_url=self.url + "/v1", api_key="none", max_retries=0)

    def close(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)
        self.service.scheduler.stop()

    def post(self, path: str, body, **kwargs) -> httpx.Response:
        content = body if isinstance(body, (bytes, str)) else json.dumps(body)
        return httpx.post(self.url + path, content=content, headers={"Content-Type": "application/json"},
                          timeout=60, **kwargs)


@pytest.fixture
def serve(chat_target):
    servers = []

    def start(*args, **kwargs) -> Server:
        servers.append(Server(chat_target, *args, **kwargs))
        return servers[-1]

    yield start
    for s in servers:
        s.close()


def alone(target, ids: list[int], max_tokens: int) -> list[int]:
    """Single-request vanilla decoding: what every method, batched or not, must answer."""
    cfg = GenerationConfig(max_new_tokens=max_tokens, tree=TREE)
    return Engine(target, NoDrafter()).generate(ids, cfg).token_ids


def test_openai_client_chat_and_completions_streaming_and_not(serve, chat_target):
    s = serve()
    assert [m.id for m in s.client.models.list().data] == ["tiny"]
    messages = [{"role": "user", "content": "why is the sky blue?"}]
    want = s.pipeline.decode(alone(chat_target, s.pipeline.encode(messages), 20))
    reply = s.client.chat.completions.create(model="tiny", messages=messages, max_tokens=20, temperature=0)
    assert reply.choices[0].message.content == want and reply.choices[0].finish_reason == "length"
    assert reply.usage.completion_tokens == 20 and reply.usage.prompt_tokens == len(s.pipeline.encode(messages))
    chunks = list(s.client.chat.completions.create(model="tiny", messages=messages, max_tokens=20, stream=True,
                                                   stream_options={"include_usage": True}))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == want
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 20
    raw = s.pipeline.decode(alone(chat_target, s.pipeline.encode("once upon", chat_template=False), 15))
    done = s.client.completions.create(model="tiny", prompt="once upon", max_tokens=15)
    assert done.choices[0].text == raw
    parts = s.client.completions.create(model="tiny", prompt="once upon", max_tokens=15, stream=True)
    assert "".join(p.choices[0].text for p in parts) == raw


@pytest.mark.parametrize("method", ["vanilla", "lookup", "eagle", "auto"])
def test_concurrent_clients_get_single_request_greedy_output(serve, chat_target, method):
    s = serve(method, Limits(max_batch=4))
    lengths = [30, 12, 25, 40, 7, 33, 18]

    def ask(i: int) -> str:
        r = s.client.completions.create(model="tiny", prompt=QUESTIONS[i], max_tokens=lengths[i], temperature=0,
                                        stream=i % 2 == 1)
        return r.choices[0].text if i % 2 == 0 else "".join(p.choices[0].text for p in r)

    with ThreadPoolExecutor(len(QUESTIONS)) as pool:
        got = list(pool.map(ask, range(len(QUESTIONS))))
    want = [s.pipeline.decode(alone(chat_target, s.pipeline.encode(q, chat_template=False), n))
            for q, n in zip(QUESTIONS, lengths)]
    assert got == want
    metrics = httpx.get(s.url + "/metrics").text
    assert f'eagle_lite_spec_decode_num_drafts_total{{method="{method}"}}' in metrics
    assert 'eagle_lite_requests_total{endpoint="/v1/completions",status="200"} 7' in metrics
    assert s.service.metrics.steps < sum(lengths)   # sequences shared target forwards
    assert ('eagle_lite_auto_steps_total{method="auto",choice=' in metrics) == (method == "auto")
    # auto's controllers size their trees from the batch's rows; the cost model caps the fixed methods' trees only
    assert (sum(s.service.scheduler.cost.count.values()) == 0) == (method == "auto")


def test_recorded_requests_are_the_answers_served(serve, chat_target, tmp_path):
    """--record in the server: each finished request of a batch is one record, its prompt then the tokens it was
    answered."""
    s = serve("lookup", Limits(max_batch=4), record=tmp_path / "traffic")
    lengths = [30, 12, 25]

    def ask(i: int) -> str:
        return s.client.completions.create(model="tiny", prompt=QUESTIONS[i], max_tokens=lengths[i],
                                           temperature=0).choices[0].text

    with ThreadPoolExecutor(3) as pool:
        list(pool.map(ask, range(3)))
    records = [json.loads(line) for shard in sorted((tmp_path / "traffic").glob("shard-*.jsonl"))
               for line in shard.read_text().splitlines()]
    want = {tuple(s.pipeline.encode(q, chat_template=False) + alone(chat_target, s.pipeline.encode(
        q, chat_template=False), n)) for q, n in zip(QUESTIONS, lengths)}
    assert {tuple(r["input_ids"]) for r in records} == want
    assert all(r["spans"][0][1] == len(r["input_ids"]) for r in records)


def test_the_head_adapts_while_the_server_is_idle(serve, chat_target, tmp_path):
    """--adapt in the server: the answers stay the target's own, the learner runs between requests, and /metrics
    shows it."""
    s = serve("auto", Limits(max_batch=4), adapt=tmp_path / "head")
    lengths = [30, 12, 25]

    def ask(i: int) -> str:
        return s.client.completions.create(model="tiny", prompt=QUESTIONS[i], max_tokens=lengths[i],
                                           temperature=0).choices[0].text

    for _ in range(2):
        with ThreadPoolExecutor(3) as pool:
            texts = list(pool.map(ask, range(3)))
        for q, n, text in zip(QUESTIONS, lengths, texts):
            ids = s.pipeline.encode(q, chat_template=False)
            assert text == s.pipeline.decode(alone(chat_target, ids, n))
    deadline = time.monotonic() + 60
    while s.service.scheduler.adapter.learner.steps == 0:
        assert time.monotonic() < deadline, "the learner never ran while the server was idle"
        time.sleep(0.1)
    metrics = httpx.get(s.url + "/metrics").text
    assert "eagle_lite_adapt_steps_total " in metrics and "eagle_lite_adapt_steps_total 0\n" not in metrics
    assert 'eagle_lite_adapt_judged_accepted{head="serving"}' in metrics


def test_stop_strings_and_seeded_sampling(serve):
    s = serve()
    full = s.client.completions.create(model="tiny", prompt="hello", max_tokens=30).choices[0].text
    stop = full[10:12]
    cut = s.client.completions.create(model="tiny", prompt="hello", max_tokens=30, stop=[stop])
    assert cut.choices[0].text == full[:full.index(stop)] and cut.choices[0].finish_reason == "stop"
    sampled = [s.client.completions.create(model="tiny", prompt="hello", max_tokens=20, temperature=1.0,
                                           seed=7).choices[0].text for _ in range(2)]
    assert sampled[0] == sampled[1]


def error_of(r: httpx.Response) -> dict:
    body = r.json()
    assert set(body["error"]) >= {"message", "type", "param", "code"}, body
    return body["error"]


def test_bad_requests_are_400s_naming_the_field(serve):
    s = serve(limits=Limits(max_batch=2, max_tokens=64, max_prompt_tokens=50))
    chat = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}]}
    r = s.post("/v1/chat/completions", b"{not json")
    assert r.status_code == 400 and "JSON" in error_of(r)["message"]
    cases = [({"messages": chat["messages"]}, "model"), ({**chat, "model": "gpt-4"}, "model"),
             ({"model": "tiny"}, "messages"), ({**chat, "messages": [{"role": "robot", "content": "x"}]},
                                               "messages[0].role"),
             ({**chat, "temperature": "hot"}, "temperature"), ({**chat, "top_p": 0}, "top_p"),
             ({**chat, "max_tokens": 0}, "max_tokens"), ({**chat, "max_tokens": 65}, "max_tokens"),
             ({**chat, "n": 2}, "n"), ({**chat, "stop": [1]}, "stop"), ({**chat, "stream": "yes"}, "stream")]
    for body, field in cases:
        r = s.post("/v1/chat/completions", body)
        assert r.status_code == 400, (body, r.text)
        assert error_of(r)["param"] == field, (body, r.text)
    r = s.post("/v1/completions", {"model": "tiny"})
    assert r.status_code == 400 and error_of(r)["param"] == "prompt"
    r = s.post("/v1/completions", {"model": "tiny", "prompt": "x" * 80})
    assert r.status_code == 413 and error_of(r)["code"] == "context_length_exceeded"
    r = httpx.get(s.url + "/v1/nothing")
    assert r.status_code == 404 and error_of(r)
    assert s.client.completions.create(model="tiny", prompt="still fine", max_tokens=3).choices[0].text


def test_a_body_nested_at_any_depth_is_a_400(serve):
    from eagle_lite.serve.protocol import MAX_DEPTH, parse_json

    s = serve()
    # one past the limit; shallow enough for json to read; past Python's stack (a RecursionError in json)
    bodies = ['{"model": "tiny", "messages": ' + "[" * depth + "]" * depth + "}" for depth in (MAX_DEPTH, 900, 5000)]
    for body in bodies + ["[" * 100_000 + "]" * 100_000]:
        r = s.post("/v1/chat/completions", body)
        assert r.status_code == 400, (body[:40], r.text)
        assert error_of(r)["code"] == "invalid_json" and f"nested more than {MAX_DEPTH}" in error_of(r)["message"]
    assert s.service.metrics.requests.get(("/v1/chat/completions", 500)) is None
    nested = {"a": [{"b": [[["x"]]]}]}   # 6 deep
    for _ in range(MAX_DEPTH - 6):
        nested = {"n": nested}
    assert parse_json(json.dumps(nested).encode()) == nested   # exactly MAX_DEPTH deep is read
    with pytest.raises(Exception, match=f"nested more than {MAX_DEPTH}"):
        parse_json(json.dumps({"n": nested}).encode())
    assert s.client.completions.create(model="tiny", prompt="still fine", max_tokens=3).choices[0].text


class Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage() + (" traceback" if record.exc_info else ""))


def test_a_client_that_disconnects_mid_request_is_not_logged_as_a_failure(serve):
    s = serve()
    records = Records()
    loggers = [logging.getLogger(name) for name in ("uvicorn.error", "eagle_lite.serve")]
    for logger in loggers:
        logger.addHandler(records)
    try:
        with socket.create_connection(("127.0.0.1", s.port)) as sock:   # half a request, then gone
            sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                         b"Content-Length: 1000\r\n\r\n{\"model\": \"tiny\", ")
            time.sleep(0.2)
        requests = s.service.metrics.requests
        wait_until(lambda: any(path == "/v1/completions" for path, _ in requests))
        time.sleep(0.2)   # uvicorn logs an application's exception after the response
        assert dict(requests) == {("/v1/completions", 499): 1}
        assert not [line for line in records.lines if "traceback" in line or "Exception" in line], records.lines
    finally:
        for logger in loggers:
            logger.removeHandler(records)
    assert s.client.completions.create(model="tiny", prompt="still fine", max_tokens=3).choices[0].text


def long_stream(s: Server, tokens: int = 400):
    """A streaming request that is still running when it returns: the client, the response, its first chunk."""
    client = httpx.Client(timeout=60)
    request = client.build_request("POST", s.url + "/v1/completions",
                                   json={"model": "tiny", "prompt": "go", "max_tokens": tokens, "stream": True})
    response = client.send(request, stream=True)
    lines = response.iter_lines()
    first = next(line for line in lines if line.startswith("data:"))
    return client, response, lines, first


def wait_until(condition, seconds: float = 20) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


def test_a_client_that_disconnects_frees_its_sequence(serve):
    s = serve("slow")
    client, response, lines, _ = long_stream(s, 2000)   # (dropping `lines` would close the response)
    scheduler = s.service.scheduler
    wait_until(lambda: len(scheduler.running) == 1)
    response.close()
    client.close()
    wait_until(lambda: not scheduler.running and scheduler.reserved == 0)
    del lines
    assert s.client.completions.create(model="tiny", prompt="next", max_tokens=4).choices[0].text is not None


def test_queue_batch_and_kv_limits_refuse_with_429_and_413(serve):
    s = serve("slow", Limits(max_batch=1, max_queue=1))
    busy = [long_stream(s, 2000)]
    wait_until(lambda: len(s.service.scheduler.running) == 1)
    waiting = threading.Thread(target=lambda: s.post("/v1/completions", {"model": "tiny", "prompt": "q",
                                                                           "max_tokens": 2}))
    waiting.start()
    wait_until(lambda: len(s.service.scheduler.waiting) == 1)
    r = s.post("/v1/completions", {"model": "tiny", "prompt": "one too many", "max_tokens": 2})
    assert r.status_code == 429 and error_of(r)["code"] == "queue_full"
    with pytest.raises(openai.RateLimitError):
        s.client.completions.create(model="tiny", prompt="x", max_tokens=2)
    busy[0][1].close()
    waiting.join(timeout=30)

    per_token = s.service.scheduler.bytes_per_slot
    small = serve("slow", Limits(max_batch=4, max_tokens=4000, kv_budget_mb=3000 * per_token / 2**20))
    held = long_stream(small, 2000)            # reserves ~2000 of the 3000 slots
    r = small.post("/v1/completions", {"model": "tiny", "prompt": "y", "max_tokens": 1500})
    assert r.status_code == 429 and error_of(r)["code"] == "kv_budget_full"
    r = small.post("/v1/completions", {"model": "tiny", "prompt": "y", "max_tokens": 3500, "stream": True})
    assert r.status_code == 413 and error_of(r)["code"] == "kv_budget_exceeded"
    held[1].close()
    wait_until(lambda: small.service.scheduler.reserved == 0)
    assert small.post("/v1/completions", {"model": "tiny", "prompt": "y", "max_tokens": 300}).status_code == 200


def test_draining_refuses_new_requests_and_finishes_running_ones(serve):
    s = serve("slow")
    client, response, lines, first = long_stream(s, 200)
    drained = []
    threading.Thread(target=lambda: drained.append(s.service.scheduler.drain(30))).start()
    wait_until(lambda: s.service.scheduler.draining)
    r = s.post("/v1/completions", {"model": "tiny", "prompt": "late", "max_tokens": 2})
    assert r.status_code == 503 and error_of(r)["code"] == "draining"
    assert httpx.get(s.url + "/health").status_code == 503
    rest = [line for line in lines if line.startswith("data:")]
    assert rest[-1] == "data: [DONE]"
    text = "".join(json.loads(line[5:])["choices"][0]["text"] for line in [first] + rest[:-1])
    assert len(s.pipeline.target.tokenizer.encode(text)) > 0
    wait_until(lambda: drained == [True])
    client.close()


def test_sigterm_drains_and_exits_0(tiny_model_dir):
    port = free_port()
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1]), "HF_HUB_OFFLINE": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "eagle_lite.serve", "--target", str(tiny_model_dir), "--method",
                             "vanilla", "--port", str(port), "--threads", "1", "--max-new-tokens", "150"],
                            env=env, stderr=subprocess.PIPE, text=True)
    try:
        url = f"http://127.0.0.1:{port}"
        wait_healthy(proc, url)
        with httpx.stream("POST", url + "/v1/completions", timeout=60,
                          json={"model": tiny_model_dir.name, "prompt": "hi", "max_tokens": 150,
                                "stream": True}) as response:
            lines = response.iter_lines()
            next(line for line in lines if line.startswith("data:"))
            proc.send_signal(signal.SIGTERM)
            rest = [line for line in lines if line.startswith("data:")]
        assert rest[-1] == "data: [DONE]"
        assert proc.wait(timeout=60) == 0
        assert "Traceback" not in proc.stderr.read()
    finally:
        if proc.poll() is None:
            proc.kill()


def test_large_batches_step_on_their_own_thread_count_and_stay_exact(serve, chat_target):
    """threads=(1, 2): steps of BUSY_BATCH sequences or more run on 2 torch threads, smaller ones on 1; the answers
    are each prompt's own greedy answer either way."""
    from eagle_lite.serve.scheduler import BUSY_BATCH

    before = torch.get_num_threads()
    seen: list[tuple[int, int]] = []   # (sequences, torch threads) of every step
    try:
        s = serve("vanilla", Limits(max_batch=4), threads=(1, 2))
        engine = s.service.scheduler.engine
        step = engine.step

        def recording(seqs, caps=None):
            seen.append((len(seqs), torch.get_num_threads()))
            return step(seqs, caps)

        engine.step = recording
        lengths = [30, 12, 25, 40, 7, 33, 18]
        with ThreadPoolExecutor(len(QUESTIONS)) as pool:
            got = list(pool.map(lambda i: s.client.completions.create(
                model="tiny", prompt=QUESTIONS[i], max_tokens=lengths[i], temperature=0).choices[0].text,
                range(len(QUESTIONS))))
    finally:
        torch.set_num_threads(before)
    want = [s.pipeline.decode(alone(chat_target, s.pipeline.encode(q, chat_template=False), n))
            for q, n in zip(QUESTIONS, lengths)]
    assert got == want
    assert {threads for batch, threads in seen if batch >= BUSY_BATCH} == {2}
    assert {threads for batch, threads in seen if batch < BUSY_BATCH} == {1}


def test_batch_threads_below_one_is_one_line_before_loading(capsys):
    from eagle_lite.serve.__main__ import main

    assert main(["--batch-threads", "0"]) == 2
    assert "--batch-threads must be a whole number >= 1" in capsys.readouterr().err


def test_requests_admitted_together_are_prefilled_in_packs(chat_target, monkeypatch):
    """Requests waiting when the worker turns are prefilled several to a forward (up to PACK_TOKENS prompt tokens a
    pack), answer what each answers alone, and a prefill that fails fails its own request only."""
    from eagle_lite.serve import scheduler as sched
    from eagle_lite.serve.scheduler import Job

    pipeline = Pipeline(chat_target, NoDrafter(), "vanilla")
    pipeline.tree = TREE
    service = build_service(pipeline, "tiny", Limits(max_batch=8), verify_seconds=COST)
    engine = service.scheduler.engine
    packs, begin_all = [], engine.begin_all
    poison = 7

    def recording(starts):
        packs.append(len(starts))
        if any(poison in prompt for prompt, *_ in starts):
            raise RuntimeError("a prefill that fails")
        return begin_all(starts)

    monkeypatch.setattr(engine, "begin_all", recording)
    monkeypatch.setattr(sched, "PACK_TOKENS", 40)
    ps = [[(11 * i + j) % 50 + 8 for j in range(n)] for i, n in enumerate((12, 15, 9, 20, 6))] + [[3, poison, 4]]
    events: dict[int, list] = {i: [] for i in range(len(ps))}
    done = threading.Semaphore(0)

    def sink(i):
        def put(event):
            events[i].append(event)
            if event[0] in ("done", "error"):
                done.release()
        return put

    for i, p in enumerate(ps):   # all waiting before the worker starts: admitted in one turn
        service.scheduler.submit(Job(p, GenerationConfig(max_new_tokens=6, tree=TREE), sink(i)))
    service.scheduler.start()
    try:
        for _ in ps:
            assert done.acquire(timeout=60)
    finally:
        service.scheduler.stop()
    assert packs[:2] == [3, 3] and packs[2:] == [1, 1, 1]   # 12+15+9 | 20+6+3 (fails: each alone) | ...
    for i, p in enumerate(ps[:-1]):
        got = [t for kind, value in events[i] if kind == "tokens" for t in value]
        assert got == alone(chat_target, p, 6) and events[i][-1][0] == "done"
    assert events[len(ps) - 1][-1][0] == "error" and "a prefill that fails" in events[len(ps) - 1][-1][1]


def test_serve_bench_runs_every_level_and_checks_the_answers(tiny_model_dir, tmp_path):
    """The load benchmark end to end on a tiny model: the server's answers at every level and round, and the batch
    loop's without HTTP, equal the CLI engine's."""
    from eval.serve_bench import main

    out = tmp_path / "bench.json"
    assert main(["--target", str(tiny_model_dir), "--methods", "vanilla,lookup", "--clients", "1,3", "--rounds", "2",
                 "--requests", "3", "--max-tokens", "12", "--threads", "1", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    for method in ("vanilla", "lookup"):
        got = report["methods"][method]
        assert got["batch_identical"] == 1.0 and got["batch_tokens_per_s"] > 0
        assert [row["clients"] for row in got["levels"]] == [1, 3]
        assert all(row["identical"] == 1.0 and row["requests"] == 3 and row["tokens"] > 0 and row["rounds"] == 2
                   for row in got["levels"])
    ratios = report["round_ratios"]["lookup"]
    assert [len(level) for level in ratios] == [2, 2] and all(x > 0 for level in ratios for x in level)


def test_serve_bench_pairs_each_round_with_the_first_methods_and_takes_the_median():
    from eval.serve_bench import ratio_table, round_ratios

    def rounds(*rates):
        return [{"tokens_per_s": r} for r in rates]

    runs = {"vanilla": [rounds(100.0, 200.0, 100.0)], "default": [rounds(98.0, 150.0, 110.0)]}
    assert round_ratios(runs) == {"default": [[0.98, 0.75, 1.1]]}
    table = ratio_table(round_ratios(runs), "vanilla", [8])
    assert table[0] == "| method | clients | each round vs vanilla | median |"
    assert table[2] == "| default | 8 | 0.980 0.750 1.100 | 0.980 |"


def test_serve_bench_keeps_a_levels_fastest_round_and_its_least_identical_share():
    from eval.serve_bench import fastest

    rounds = [{"tokens_per_s": 90.0, "identical": 1.0}, {"tokens_per_s": 120.0, "identical": 1.0},
              {"tokens_per_s": 100.0, "identical": 0.5}]
    assert fastest(rounds) == {"tokens_per_s": 120.0, "identical": 0.5, "rounds": 3}
    assert fastest([{"tokens_per_s": 5.0, "identical": None}])["identical"] is None


def test_serve_bench_samples_with_auto(tiny_model_dir, tmp_path, capsys):
    """--temperature: every request sampled (method auto: its controllers in the server's batch), no identity check."""
    from eval.serve_bench import main

    out = tmp_path / "bench.json"
    assert main(["--target", str(tiny_model_dir), "--methods", "auto", "--clients", "2", "--requests", "2",
                 "--max-tokens", "10", "--threads", "1", "--temperature", "1.0", "--json", str(out)]) == 0
    got = json.loads(out.read_text())["methods"]["auto"]
    assert got["batch_identical"] is None and got["batch_tokens_per_s"] > 0
    assert [(row["identical"], row["requests"]) for row in got["levels"]] == [(None, 2)]
    choices = got["levels"][0]["choices"]   # the level's split of auto's steps, from the server's /metrics
    assert choices and set(choices) <= {"plain", "lookup", "head"}
    assert sum(c["share"] for c in choices.values()) == pytest.approx(1.0)
    assert all(c["tokens_per_step"] >= 1 and c["predicted_ms"] > 0 and c["measured_ms"] > 0 for c in choices.values())
    assert "| auto | 2 | " in capsys.readouterr().out


def test_serve_bench_splits_auto_steps_by_the_growth_of_its_counters():
    from eval.serve_bench import choice_rows

    rows = choice_rows({"plain": [10, 10, 0.1, 0.12]}, {"plain": [40, 40, 0.4, 0.42], "head": [10, 25, 0.1, 0.15]})
    assert rows["plain"] == pytest.approx({"share": 0.75, "tokens_per_step": 1.0, "predicted_ms": 10.0,
                                           "measured_ms": 10.0})
    assert rows["head"] == pytest.approx({"share": 0.25, "tokens_per_step": 2.5, "predicted_ms": 10.0,
                                          "measured_ms": 15.0})


@pytest.mark.parametrize("args, message", [
    (["--clients", "1,x"], "error: --clients takes comma-separated counts >= 1 like 1,2,4,8, got '1,x'"),
    (["--clients", "0"], "error: --clients takes comma-separated counts >= 1 like 1,2,4,8, got '0'"),
    (["--methods", "nosuch"], "error: --methods takes comma-separated methods of default, eagle, staged, "),
    (["--requests", "0"], "error: --requests must be >= 1, got 0"),
    (["--rounds", "0"], "error: --rounds must be >= 1, got 0"),
    (["--seconds", "nan"], "error: --seconds must be a finite number, got nan"),
    (["--temperature", "-1"], "error: --temperature must be >= 0 (0: greedy), got -1.0"),
    (["--threads", "0"], "error: --threads must be a whole number >= 1"),
    (["--json", "{tmp}"], "error: --json {tmp} is a folder: give a file name"),
    (["--questions", "{tmp}/none.jsonl"], "error: question file {tmp}/none.jsonl not found"),
])
def test_serve_bench_checks_its_flags_in_one_line_before_anything_runs(args, message, tmp_path, capsys, monkeypatch):
    import eval.serve_bench

    monkeypatch.setattr(eval.serve_bench, "cli_run", lambda *a, **k: pytest.fail("ran before the flags were checked"))
    assert eval.serve_bench.main([a.format(tmp=tmp_path) for a in args]) in (1, 2)
    err = capsys.readouterr().err
    assert err.startswith(message.format(tmp=tmp_path)) and err.count("\n") == 1


@pytest.mark.parametrize("method", ["lookup", "eagle"])
def test_prompts_that_start_like_a_finished_one_reuse_its_cache(chat_target, method):
    """A finished request's KV cache is kept (`prefix_cache`), with its drafter; a later prompt sharing its start
    prefills only the rest and answers what it answers alone; kept caches count in the KV budget and give way to
    new requests."""
    from eagle_lite.serve.scheduler import MIN_REUSE, Job

    torch.manual_seed(0)
    head = DraftHead.for_target(chat_target) if method == "eagle" else None
    make = PromptLookupDrafter if method == "lookup" else (lambda: eagle_drafter(chat_target, head))
    pipeline = Pipeline(chat_target, make(), method)
    pipeline.tree = TREE
    service = build_service(pipeline, "tiny", Limits(max_batch=2, prefix_cache=2, kv_budget_mb=64),
                            make_drafter=make, verify_seconds=COST)
    scheduler = service.scheduler
    scheduler.start()
    system = [(7 * j) % 50 + 8 for j in range(MIN_REUSE + 6)]   # a shared start, like a chat's system turn

    def ask(prompt: list[int], n: int = 6) -> Job:
        done = threading.Event()
        tokens: list[int] = []
        job = Job(prompt, GenerationConfig(max_new_tokens=n, tree=TREE),
                  lambda e: tokens.extend(e[1]) if e[0] == "tokens" else done.set())
        scheduler.submit(job)
        assert done.wait(60)
        job.tokens = tokens
        return job

    try:
        first = ask(system + [20, 21, 22])
        assert first.stats.reused_prompt_tokens == 0 and len(scheduler.donors) == 1
        kept = scheduler.reserved
        assert kept == scheduler.donors[0].kv_bytes > 0          # a kept cache counts in the budget
        second = ask(system + [30, 31])
        assert second.stats.reused_prompt_tokens == len(system) - 1   # the shared start (its last token re-read
        # for the drafter's pairs), not read again
        assert second.tokens == alone(chat_target, system + [30, 31], 6)
        other = ask([40 + j for j in range(12)])                # no shared start: read whole
        assert other.stats.reused_prompt_tokens == 0 and other.tokens == alone(chat_target, other.prompt_ids, 6)
        assert len(scheduler.donors) == 2                       # at most prefix_cache kept
        # a request that needs the memory the kept caches hold gets it: they are dropped, oldest first
        scheduler.budget_bytes = scheduler.reserved + 10 * scheduler.bytes_per_slot
        newest = scheduler.donors[-1]
        ask([60 + j for j in range(12)], n=12)   # needs ~30 slots
        assert scheduler.donors[:-1] in ([], [newest]) and scheduler.reserved <= scheduler.budget_bytes
    finally:
        scheduler.stop()


def test_a_taken_port_is_one_line_before_loading(capsys):
    from eagle_lite.serve.__main__ import main

    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = taken.getsockname()[1]
        assert main(["--port", str(port), "--target", "/nonexistent/model"]) == 1   # refused before any load
    err = capsys.readouterr().err
    assert err.strip() == f"error: cannot listen on 127.0.0.1:{port} (Address already in use)"


@pytest.mark.parametrize("args, message", [
    (["--port", "70000"], "error: --port must be in 0..65535 (0: any free one), got 70000"),
    (["--port", "-1"], "error: --port must be in 0..65535 (0: any free one), got -1"),
    (["--host", "999.1.1.1", "--port", "0"], "error: cannot listen on 999.1.1.1:0 ("),
])
def test_a_port_or_host_it_cannot_listen_on_is_one_line_before_loading(args, message, capsys):
    """An address that does not resolve says why in the resolver's words (not 'Unknown error -2')."""
    from eagle_lite.serve.__main__ import main

    assert main([*args, "--target", "/nonexistent/model"]) in (1, 2)
    err = capsys.readouterr().err.strip()
    assert err.startswith(message) and "\n" not in err and "Unknown error" not in err and "attempting" not in err


def test_a_shared_chat_start_is_reported_as_cached_tokens(serve):
    """Two chat requests share the chat template's start: the second reads it from the first one's kept cache, says
    so in `usage.prompt_tokens_details.cached_tokens`, and /metrics counts it."""
    s = serve("vanilla")
    ask = lambda text: s.client.chat.completions.create(   # noqa: E731
        model="tiny", messages=[{"role": "user", "content": text}], max_tokens=5, temperature=0)
    first, second = ask("hello there, how are you?"), ask("hello there, who are you?")
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert 8 <= cached < second.usage.prompt_tokens
    metrics = httpx.get(s.url + "/metrics").text
    assert f"eagle_lite_prefix_cache_hit_tokens_total {cached}" in metrics
    assert "eagle_lite_prefix_cache_sequences 1" in metrics   # the first cache went on with the second


@pytest.mark.parametrize("method", ["vanilla", "eagle"])
def test_a_long_prompt_is_read_in_parts_between_steps(chat_target, monkeypatch, method):
    """A prompt longer than a pack is read a part a turn, between the running batch's steps (which go on meanwhile),
    then answers what it answers alone; the head (eagle) reads the features of every part."""
    from eagle_lite.serve import scheduler as sched
    from eagle_lite.serve.scheduler import Job

    monkeypatch.setattr(sched, "PACK_TOKENS", 8)
    torch.manual_seed(0)
    head = DraftHead.for_target(chat_target) if method == "eagle" else None
    make = NoDrafter if method == "vanilla" else (lambda: eagle_drafter(chat_target, head))
    pipeline = Pipeline(chat_target, make(), method)
    pipeline.tree = TREE
    service = build_service(pipeline, "tiny", Limits(max_batch=4, prefix_cache=0), make_drafter=make,
                            verify_seconds=COST)
    scheduler, engine = service.scheduler, service.scheduler.engine
    order: list[str] = []
    parts, read_part = [], engine.read_part
    monkeypatch.setattr(engine, "read_part", lambda *a: order.append("part") or parts.append(1) or read_part(*a))
    done = {name: threading.Event() for name in "ab"}
    tokens: dict[str, list[int]] = {"a": [], "b": []}

    def sink(name):
        def put(event):
            if event[0] == "tokens":
                tokens[name].extend(event[1])
                order.append(name)
            else:
                assert event[0] == "done", event
                done[name].set()
        return put

    short = [11, 12, 13, 14]
    long = [(5 * j) % 50 + 8 for j in range(37)]
    cfg = GenerationConfig(max_new_tokens=120, tree=TREE, stop_at_eos=False)   # still running when b comes
    scheduler.start()
    try:
        scheduler.submit(Job(short, cfg, sink("a")))
        deadline = time.monotonic() + 30
        while not tokens["a"]:
            assert time.monotonic() < deadline
            time.sleep(0.001)
        scheduler.submit(Job(long, GenerationConfig(max_new_tokens=6, tree=TREE, stop_at_eos=False), sink("b")))
        assert done["a"].wait(60) and done["b"].wait(60)
    finally:
        scheduler.stop()
    assert len(parts) == 4                        # 37 tokens: 4 parts of 8, the last 5 with the first token
    between = order[order.index("part"):order.index("b")]
    assert between.count("a") >= 2                             # the running sequence stepped between the parts
    want = lambda p, n: Engine(chat_target, make()).generate(p, GenerationConfig(   # noqa: E731
        max_new_tokens=n, tree=TREE, stop_at_eos=False)).token_ids
    assert tokens["b"] == want(long, 6) and tokens["a"] == want(short, 120)
