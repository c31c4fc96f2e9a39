"""`python -m eagle_lite.serve`: an OpenAI-compatible HTTP server with continuous batching and lossless
speculative decoding across concurrent requests.

    python -m eagle_lite.serve --port 8000                  # the embedded SmolLM2 target, the CLI's default method
    curl localhost:8000/v1/chat/completions -H 'Content-Type: application/json' \\
         -d '{"model": "smollm2", "messages": [{"role": "user", "content": "Hi!"}]}'

Requests join a running batch between steps and leave it when they finish (scheduler.py); each step drafts a
tree per sequence and the target verifies all of them in one forward (`Engine.step`, `Target.verify`), each tree
over its own KV cache, so every request gets what it would get alone (greedy: the CLI's answer). The trees shrink
as the batch grows, down to plain decoding, from this machine's step costs (decoding/cost.py): a fixed method's
caps (decoding/cost.py `Caps`), method auto's trees by its controllers, which weigh the batch's step
(eagle_lite_wing/controller.py). docs/serve.md is the manual: endpoints, limits, errors, metrics.

FastAPI (on uvicorn) rather than LitServe: LitServe batches requests into one `predict` call per batch and runs
its own workers, whereas here the batch is the engine's own state, which requests join and leave between
speculative steps and which streams tokens per step; that wants plain ASGI routes over one worker thread, which is
what FastAPI gives (with its error handlers and streaming responses) and nothing more.
"""
from __future__ import annotations

from ..config import TreeConfig
from ..decoding.cost import Caps, StepCost, step_cost
from ..pipeline import Pipeline, engine_for
from .app import Service, create_app
from .metrics import Metrics
from .scheduler import Limits, Refused, Scheduler

__all__ = ["Limits", "Refused", "Service", "build_service", "create_app"]


def build_service(pipeline: Pipeline, model_id: str, limits: Limits = Limits(), make_drafter=None,
                  options=None, default_max_tokens: int = 256, default_temperature: float = 0.0,
                  default_seed: int | None = None, verify_seconds: dict | None = None,
                  threads: tuple[int, int] | None = None, tree: TreeConfig | None = None) -> Service:
    """The server's state around a loaded pipeline; `start()` its scheduler before serving.
    verify_seconds: {nodes: seconds} of a step (decoding/cost.py `StepCost.verify`; None: this machine's, cached,
    else measured now, about a second). threads: torch
    threads for small and for large batches (scheduler.BUSY_BATCH; None: as they are). tree: every request's draft
    tree (None: the pipeline's)."""
    adapter = pipeline.adapter
    if make_drafter is None and adapter is not None:   # --adapt: each request drafts with the head serving then
        make_drafter = lambda: pipeline.engine.drafter.sibling()   # noqa: E731
    make_drafter = make_drafter or pipeline.drafter_factory(options)
    tree = tree or pipeline.tree
    probe = make_drafter()
    tree_nodes = probe.max_tree_nodes(tree)
    cost = StepCost(verify_seconds) if verify_seconds else step_cost(pipeline.target)
    engine = engine_for(pipeline.target, None)   # each sequence of a batch brings its own drafter
    make = getattr(probe, "statistics", None)    # method auto: the observer of its controllers' choices
    watched = make() if make is not None else None
    engine.observers += ([watched] if watched is not None else []) + (adapter.observers() if adapter else [])
    metrics = Metrics(pipeline.method, watched)
    scheduler = Scheduler(engine, make_drafter, limits, tree_nodes, Caps(cost, tree_nodes), on_step=metrics.step,
                          threads=threads,
                          recorder=pipeline.recorder, adapter=adapter)
    return Service(pipeline, scheduler, metrics, model_id, tree, default_max_tokens, default_temperature,
                   default_seed)
