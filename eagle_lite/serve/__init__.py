"""`python -m eagle_lite.serve`: an OpenAI-compatible HTTP server (FastAPI on uvicorn) with continuous batching and
lossless speculative decoding across concurrent requests.

    python -m eagle_lite.serve --port 8000                  # the embedded SmolLM2 target, the CLI's default method

Requests join a running batch between steps (scheduler.py); the target verifies every sequence's tree in one
forward, each over its own KV cache, so every request gets what it would get alone. docs/serve.md is the manual:
endpoints, limits, errors, metrics, tree caps, and why FastAPI rather than LitServe.
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
    watched = probe.statistics()    # method auto: the observer of its controllers' choices
    engine.observers += ([watched] if watched is not None else []) + (adapter.observers() if adapter else [])
    metrics = Metrics(pipeline.method, watched)
    scheduler = Scheduler(engine, make_drafter, limits, tree_nodes, Caps(cost, tree_nodes), on_step=metrics.step,
                          threads=threads,
                          recorder=pipeline.recorder, adapter=adapter)
    return Service(pipeline, scheduler, metrics, model_id, tree, default_max_tokens, default_temperature,
                   default_seed)
