"""`python -m eagle_lite.serve`: load the target and method as the CLI does, then serve them over HTTP (uvicorn).

SIGTERM drains: /health and new requests answer 503, the admitted requests finish (at most --drain-seconds), then
the process exits 0. A second SIGTERM or Ctrl-C stops at once.
"""
from __future__ import annotations

import argparse
import logging
import os
import signal
import socket
import sys
import threading

from ..cli import arguments, entry_point
from ..options import add_flag, add_model_flags, check_flags, load_from_flags, quiet_libraries
from ..threads import check_threads
from .scheduler import Limits

log = logging.getLogger("eagle_lite.serve")


def build_parser() -> argparse.ArgumentParser:
    limits = Limits()
    p = argparse.ArgumentParser(
        prog="python -m eagle_lite.serve",
        description="An OpenAI-compatible server (chat and completions, streaming or not) with continuous batching "
                    "and lossless speculative decoding: every request gets what the CLI would answer alone.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    add_model_flags(p)
    s = p.add_argument_group("server (the model flags above set each request's defaults: --max-new-tokens is the "
                             "default max_tokens, --temperature the default temperature)")
    s.add_argument("--host", default="127.0.0.1", help="address to listen on")
    s.add_argument("--port", type=int, default=8000, help="port to listen on (0: any free one)")
    s.add_argument("--model-id", default=None, help="the model name clients send (default: the target's short "
                                                    "name: a .gguf file's or folder's name, a hub id, an alias)")
    add_flag(s, "max-batch", default=limits.max_batch)
    s.add_argument("--max-queue", type=int, default=limits.max_queue,
                   help="requests waiting for a place in the batch; past it: 429")
    s.add_argument("--max-prompt-tokens", type=int, default=limits.max_prompt_tokens, help="longer prompts: 413")
    s.add_argument("--max-tokens-limit", type=int, default=limits.max_tokens,
                   help="the largest max_tokens a request may ask for; more: 400")
    s.add_argument("--kv-budget-mb", type=float, default=limits.kv_budget_mb,
                   help="target KV cache memory for all admitted requests; a request that does not fit: 429")
    s.add_argument("--prefix-cache", type=int, default=limits.prefix_cache,
                   help="finished requests whose KV cache is kept for later prompts that start the same way (a chat "
                        "template's system turn, an earlier turn): those tokens are not read again; 0: none")
    s.add_argument("--drain-seconds", type=float, default=limits.drain_seconds,
                   help="how long SIGTERM waits for running requests before it stops them")
    add_flag(s, "batch-threads")
    add_flag(p, "verbose", note="and every request")
    p.set_defaults(static=None)
    return p


@entry_point(stopped="[stopped while loading]")
def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, format="%(message)s")
    with arguments():
        check_flags(args)
        check_threads(args.batch_threads, "--batch-threads")
        limits = Limits(max_batch=args.max_batch, max_queue=args.max_queue, max_prompt_tokens=args.max_prompt_tokens,
                        max_tokens=args.max_tokens_limit, kv_budget_mb=args.kv_budget_mb,
                        drain_seconds=args.drain_seconds, prefix_cache=args.prefix_cache)
        if not 0 <= args.port <= 65535:
            raise ValueError(f"--port must be in 0..65535 (0: any free one), got {args.port}")
        if args.max_new_tokens > limits.max_tokens:
            raise ValueError(f"--max-new-tokens ({args.max_new_tokens}) is above --max-tokens-limit "
                             f"({limits.max_tokens})")
    try:   # before the (slow) load: a port that is taken says so at once
        sock = socket.create_server((args.host, args.port))
    except OSError as err:   # the port is taken, the address is not ours
        # an address that does not resolve is getaddrinfo's (negative) code, which os.strerror does not know
        reason = (os.strerror(err.errno) if err.errno and err.errno > 0
                  else (err.strerror or str(err)).split(" (while attempting")[0])
        print(f"error: cannot listen on {args.host}:{args.port} ({reason})", file=sys.stderr)
        return 1
    quiet_libraries(args.verbose)
    try:
        import torch
        import uvicorn

        from . import build_service, create_app
        from .protocol import served_model_id

        lm, cfg = load_from_flags(args)
        threads = torch.get_num_threads()   # --threads, else torch's default (one per core)
        model_id = args.model_id or served_model_id(args.target or lm.target.name)
        service = build_service(lm, model_id, limits,
                                default_max_tokens=args.max_new_tokens, default_temperature=args.temperature,
                                default_seed=args.seed, threads=(threads, args.batch_threads or threads),
                                tree=cfg.tree)
    except ImportError as err:
        print(f"error: {err}: install the server's packages with pip install 'eagle_lite[serve]'", file=sys.stderr)
        return 1
    server = DrainingServer(uvicorn.Config(create_app(service), host=args.host, port=args.port,
                                           log_level="info" if args.verbose else "warning",
                                           timeout_graceful_shutdown=5), service)
    # The engine runs on this thread, which loaded the model; HTTP on another (module docstring of scheduler.py:
    # torch's OpenMP workers serve the thread that started them). Signals arrive here and go to uvicorn's handler.
    http = threading.Thread(target=_serve_http, args=(server, sock), name="eagle_lite-http", daemon=True)
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, server.handle_exit)
    print(f"eagle_lite serve · model {service.model_id} · method {lm.method} · http://{args.host}:{args.port}",
          file=sys.stderr)
    http.start()
    service.scheduler.run()     # until the HTTP thread stops it
    http.join(timeout=10)
    if not server.started:
        print(f"error: the HTTP server on {args.host}:{args.port} did not start (--verbose shows why)",
              file=sys.stderr)
        return 1
    return 0


def _serve_http(server, sock) -> None:
    """uvicorn on `sock` until it exits (SIGINT, a drained SIGTERM), then the batch loop is stopped."""
    try:
        server.run(sockets=[sock])
    except SystemExit:      # uvicorn failed to start, and logged why
        pass
    except Exception as err:  # noqa: BLE001 (one line, not a traceback; the process then exits 1)
        log.error("the HTTP server stopped: %s: %s", type(err).__name__, err)
    finally:
        server.service.scheduler.stop()


def _server_class():
    import uvicorn

    class Draining(uvicorn.Server):
        """uvicorn's server whose first SIGTERM drains the batch before it lets uvicorn shut down."""

        def __init__(self, config, service) -> None:
            super().__init__(config)
            self.service = service
            self._draining = False

        def handle_exit(self, sig, frame) -> None:
            if sig == signal.SIGTERM and not self._draining:
                self._draining = True
                threading.Thread(target=self._drain, name="eagle_lite-drain", daemon=True).start()
                return
            super().handle_exit(sig, frame)

        def _drain(self) -> None:
            finished = self.service.scheduler.drain(self.service.scheduler.limits.drain_seconds)
            if not finished:
                log.warning("drain: stopped the requests still running after %.0f s",
                            self.service.scheduler.limits.drain_seconds)
            self.should_exit = True

    return Draining


def DrainingServer(config, service):  # noqa: N802 (a class made on first use: uvicorn is an optional package)
    return _server_class()(config, service)


if __name__ == "__main__":
    sys.exit(main())
