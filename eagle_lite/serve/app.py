"""The HTTP layer: OpenAI's chat and completions endpoints over the batch loop (scheduler.py).

Every answer is JSON or server-sent events in OpenAI's shapes; every failure is OpenAI's error object with a
status (400 bad request, 404 no such route, 413 too long, 429 busy, 503 draining, 500 a failed generation),
never a traceback; a client that disconnects before its request is whole is counted as 499 (nginx's "client
closed request") and answered with nothing. Text is detokenized here, on the event loop (text/detokenize.py: a
multi-byte character held back until it is whole), and stop strings are found in that text (the text before the
first one is returned and the sequence is cancelled).
"""
from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from dataclasses import dataclass

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect

from ..config import GenerationConfig, SamplingConfig, TreeConfig
from ..decoding.engine import GenerationStats
from ..pipeline import Pipeline
from ..text.detokenize import Detokenizer
from .metrics import Metrics
from .protocol import parse, parse_json
from .scheduler import Job, Refused, Scheduler

log = logging.getLogger("eagle_lite.serve")

FINISH = {"eos": "stop", "stop": "stop", "length": "length", "context": "length"}
ERROR_TYPES = {400: "invalid_request_error", 404: "not_found_error", 413: "invalid_request_error",
               429: "rate_limit_error", 503: "service_unavailable", 500: "server_error"}


@dataclass
class Service:
    """What the app serves: a pipeline (target, tokenizer, method), the batch loop and the request defaults."""

    pipeline: Pipeline
    scheduler: Scheduler
    metrics: Metrics
    model_id: str
    tree: TreeConfig
    default_max_tokens: int = 256
    default_temperature: float = 0.0
    default_seed: int | None = None

    def __post_init__(self) -> None:
        self.created = int(time.time())


def error(status: int, message: str, param: str | None = None, code: str | None = None) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": ERROR_TYPES.get(status, "invalid_request_error"),
                                   "param": param, "code": code}}, status_code=status)


def create_app(service: Service) -> FastAPI:
    app = FastAPI(title="eagle_lite", docs_url=None, redoc_url=None, openapi_url=None)
    scheduler, metrics = service.scheduler, service.metrics

    @app.exception_handler(Refused)
    async def refused(request: Request, err: Refused):
        metrics.request(request.url.path, err.status)
        return error(err.status, err.message, err.param, err.code)

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, err: HTTPException):
        return error(err.status_code, str(err.detail), None, None)

    @app.exception_handler(Exception)
    async def failed(request: Request, err: Exception):
        log.exception("request failed")
        metrics.request(request.url.path, 500)
        return error(500, f"the server failed on this request ({type(err).__name__})", None, "internal_error")

    @app.get("/health")
    async def health():
        if scheduler.draining:
            return JSONResponse({"status": "draining"}, status_code=503)
        return {"status": "ok"}

    @app.get("/metrics")
    async def prometheus():
        return PlainTextResponse(metrics.render(scheduler), media_type="text/plain; version=0.0.4")

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": service.model_id, "object": "model", "created": service.created,
                                            "owned_by": "eagle_lite"}]}

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await complete(request, chat=True)

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await complete(request, chat=False)

    async def complete(request: Request, chat: bool):
        if scheduler.draining:
            raise Refused(503, "the server is shutting down; retry on another instance", None, "draining")
        try:
            raw = await request.body()
        except ClientDisconnect:   # gone mid-body: no one to answer, and no failure of the server's to log
            log.info("a client disconnected before sending its whole request to %s", request.url.path)
            metrics.request(request.url.path, 499)
            return Response(status_code=499)
        body = parse_json(raw)
        params = parse(body, service.model_id, chat, service.default_max_tokens, service.default_temperature)
        try:
            prompt_ids = service.pipeline.prompt_ids(params.prompt, chat_template=chat)
        except (ValueError, TypeError) as err:
            raise Refused(400, f"{'messages' if chat else 'prompt'}: {err}", "messages" if chat else "prompt",
                          "invalid_value") from None
        if not chat and isinstance(params.prompt, list) and any(
                not 0 <= t < service.pipeline.target.vocab_size for t in prompt_ids):
            raise Refused(400, f"prompt: token ids must be in [0, {service.pipeline.target.vocab_size})", "prompt",
                          "invalid_value")
        try:
            sampling = SamplingConfig(temperature=params.temperature, top_p=params.top_p)
        except ValueError as err:
            raise Refused(400, str(err), "temperature", "invalid_value") from None
        seed = params.seed if params.seed is not None else service.default_seed
        cfg = GenerationConfig(max_new_tokens=params.max_tokens, sampling=sampling, tree=service.tree, seed=seed)
        loop, events = asyncio.get_running_loop(), asyncio.Queue()

        def sink(event: tuple) -> None:   # called on the worker thread
            loop.call_soon_threadsafe(events.put_nowait, event)

        job = Job(prompt_ids, cfg, sink)
        scheduler.submit(job)
        ident = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
        text = Detokenizer(service.pipeline.decode, params.stop)
        run = Run(job, events, text, chat, request)
        if params.stream:
            return StreamingResponse(stream(run, ident, params.include_usage), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache"})
        return await whole(run, ident)

    def head(ident: str, chat: bool) -> dict:
        return {"id": ident, "object": "chat.completion" if chat else "text_completion", "created": int(time.time()),
                "model": service.model_id}

    def usage(run: Run) -> dict:
        n_prompt, n_new = len(run.job.prompt_ids), run.job.stats.new_tokens
        return {"prompt_tokens": n_prompt, "completion_tokens": n_new, "total_tokens": n_prompt + n_new,
                "prompt_tokens_details": {"cached_tokens": run.job.stats.reused_prompt_tokens}}

    async def whole(run: Run, ident: str):
        pieces = [piece async for piece in run.pieces()]
        if run.failure is not None:
            metrics.request(run.request.url.path, run.failure[0])
            return error(*run.failure)
        text, finish = "".join(pieces), run.finish_reason
        choice = ({"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": finish}
                  if run.chat else {"index": 0, "text": text, "finish_reason": finish, "logprobs": None})
        metrics.request(run.request.url.path, 200, len(run.job.prompt_ids), run.job.stats.new_tokens,
                            run.job.stats.reused_prompt_tokens)
        return {**head(ident, run.chat), "choices": [choice], "usage": usage(run)}

    async def stream(run: Run, ident: str, include_usage: bool):
        top = {**head(ident, run.chat), "object": "chat.completion.chunk" if run.chat else "text_completion"}

        def chunk(piece: str | None, finish: str | None = None) -> str:
            if run.chat:
                delta = {} if piece is None else {"content": piece}
                choice = {"index": 0, "delta": delta, "finish_reason": finish}
            else:
                choice = {"index": 0, "text": piece or "", "finish_reason": finish, "logprobs": None}
            return sse({**top, "choices": [choice]})

        try:
            if run.chat:
                yield sse({**top, "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""},
                                               "finish_reason": None}]})
            async for piece in run.pieces():
                if piece:
                    yield chunk(piece)
            if run.failure is not None:
                status, message, param, code = run.failure
                metrics.request(run.request.url.path, status)
                yield sse({"error": {"message": message, "type": ERROR_TYPES.get(status, "server_error"),
                                     "param": param, "code": code}})
                return
            yield chunk(None, run.finish_reason)
            if include_usage:
                yield sse({**top, "choices": [], "usage": usage(run)})
            yield "data: [DONE]\n\n"
            metrics.request(run.request.url.path, 200, len(run.job.prompt_ids), run.job.stats.new_tokens,
                            run.job.stats.reused_prompt_tokens)
        finally:
            run.job.cancel()   # a client that went away: its sequence leaves the batch at the next step

    return app


async def next_event(events: asyncio.Queue, timeout: float):
    """The next event of a request's queue, asyncio.TimeoutError after `timeout` s without one; where Python has
    `asyncio.timeout`, a timer rather than the task `wait_for` makes for every event."""
    if not events.empty():
        return events.get_nowait()
    if hasattr(asyncio, "timeout"):
        async with asyncio.timeout(timeout):
            return await events.get()
    return await asyncio.wait_for(events.get(), timeout)


def sse(obj: dict) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


class Run:
    """One request in flight: the worker's events turned into text pieces, and how it ended."""

    def __init__(self, job: Job, events: asyncio.Queue, text: Detokenizer, chat: bool, request: Request) -> None:
        self.job, self.events, self.text, self.chat, self.request = job, events, text, chat, request
        self.finish_reason = "stop"
        self.failure: tuple | None = None

    async def pieces(self):
        while True:
            try:
                kind, value = await next_event(self.events, 1.0)
            except asyncio.TimeoutError:
                if await self.request.is_disconnected():
                    self.job.cancel()
                    return
                continue
            if kind == "tokens":
                piece = self.text.add(value)
                if piece:
                    yield piece
                if self.text.stopped:
                    self.job.cancel()
                    self.finish_reason = "stop"
                    return
            elif kind == "done":
                stats: GenerationStats = value
                rest = self.text.add([], final=True)
                if rest:
                    yield rest
                self.finish_reason = "stop" if self.text.stopped else FINISH.get(stats.stop_reason, "stop")
                return
            else:
                status = 503 if "shut down" in value else 500
                self.failure = (status, value, None, "draining" if status == 503 else "generation_failed")
                return
