"""Counters and gauges of a server, in the Prometheus text exposition format (version 0.0.4).

Requests by endpoint and status, prompt and generated tokens, the queue length and batch size, the KV cache
reserved against its budget, and per method the speculative-decoding figures vLLM exports: sequence verify steps
(`num_drafts`), tree nodes verified (`num_draft_tokens`, the roots included) and tokens emitted by them
(`num_emitted_tokens`, the bonus tokens included); their ratio is the accepted tokens per target forward. With
a drafter's observer of its steps (`statistics`; method auto's choices, eagle_lite_wing/auto.py `Choices`), the
series it gives (`series(labels)`).
"""
from __future__ import annotations

import threading
from collections import defaultdict


class Metrics:
    def __init__(self, method: str, choices=None) -> None:
        self.method, self.watched = method, choices   # a drafter's observer (method auto: its `Choices`)
        self._lock = threading.Lock()
        self.requests: dict[tuple[str, int], int] = defaultdict(int)
        self.prompt_tokens = 0
        self.cached_tokens = 0         # prompt tokens read from a kept cache (prefix reuse), not prefilled
        self.generation_tokens = 0
        self.steps = 0                 # batched target forwards (prefills not counted)
        self.drafts = 0                # sequence verify steps
        self.draft_tokens = 0          # tree nodes verified
        self.emitted_tokens = 0        # tokens those steps emitted
        self.last_batch = 0

    def request(self, endpoint: str, status: int, prompt_tokens: int = 0, generated: int = 0,
                cached: int = 0) -> None:
        with self._lock:
            self.requests[(endpoint, status)] += 1
            self.prompt_tokens += prompt_tokens
            self.cached_tokens += cached
            self.generation_tokens += generated

    def step(self, batch: int, cap: int, rows: int, emitted: list[int]) -> None:
        """A batched step: its sequences, tree cap, nodes verified, tokens each emitted."""
        with self._lock:
            self.steps += 1
            self.drafts += batch
            self.draft_tokens += rows
            self.emitted_tokens += sum(emitted)
            self.last_batch = batch

    def render(self, scheduler) -> str:
        m = f'method="{self.method}"'
        with self._lock:
            lines = ["# HELP eagle_lite_requests_total HTTP requests by endpoint and status.",
                     "# TYPE eagle_lite_requests_total counter"]
            lines += [f'eagle_lite_requests_total{{endpoint="{e}",status="{s}"}} {n}'
                      for (e, s), n in sorted(self.requests.items())]
            rate = self.emitted_tokens / self.drafts if self.drafts else 0.0
            series = [
                ("prompt_tokens_total", "counter", "Prompt tokens of finished requests.", "", self.prompt_tokens),
                ("prefix_cache_hit_tokens_total", "counter",
                 "Prompt tokens of finished requests taken from a kept cache instead of prefilled.", "",
                 self.cached_tokens),
                ("prefix_cache_sequences", "gauge", "Finished sequences kept for their prefix.", "",
                 len(scheduler.donors)),
                ("generation_tokens_total", "counter", "Tokens generated for finished requests.", "",
                 self.generation_tokens),
                ("queue_length", "gauge", "Requests waiting for a place in the batch.", "", len(scheduler.waiting)),
                ("batch_size", "gauge", "Sequences in the running batch.", "", len(scheduler.running)),
                ("batch_steps_total", "counter", "Batched target forwards (one per step).", "", self.steps),
                ("tree_cap", "gauge", "Tree nodes per sequence allowed in the last step (0: the configured tree).",
                 "", scheduler.last_cap),
                ("kv_cache_reserved_bytes", "gauge", "KV cache bytes reserved by admitted requests.", "",
                 scheduler.reserved),
                ("kv_cache_budget_bytes", "gauge", "KV cache budget.", "", scheduler.budget_bytes),
                ("spec_decode_num_drafts_total", "counter", "Sequence verify steps.", m, self.drafts),
                ("spec_decode_num_draft_tokens_total", "counter", "Tree nodes verified (roots included).", m,
                 self.draft_tokens),
                ("spec_decode_num_emitted_tokens_total", "counter", "Tokens emitted by verify steps (bonus included).",
                 m, self.emitted_tokens),
                ("spec_decode_accepted_per_forward", "gauge", "Mean tokens a sequence gets per target forward.", m,
                 round(rate, 4)),
            ]
            series += self.watched.series(m) if self.watched is not None else []
        adapter = getattr(scheduler, "adapter", None)
        if adapter is not None:   # --adapt: the head learning from this traffic
            series += adapter.series()
        for name, kind, help_text, labels, value in series:
            lines += [f"# HELP eagle_lite_{name} {help_text}", f"# TYPE eagle_lite_{name} {kind}",
                      f"eagle_lite_{name}{{{labels}}} {value}" if labels else f"eagle_lite_{name} {value}"]
        return "\n".join(lines) + "\n"
