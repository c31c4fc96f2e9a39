"""Device operations the static step launches, counted on the CPU (`python -m eval.step_cost --count-ops`).

On a GPU a small target's step is bound by kernel launches, not arithmetic, so the number of operations a step
dispatches predicts its cost there. `OpCounter` is a `TorchDispatchMode`: it sees every aten op below autograd,
after composite ops (linear, sdpa, layer norms written in Python) have been decomposed into what a backend runs.

What is counted as a launch: every dispatched aten (or custom) op except
- views and aliases (`OpOverload.is_view`, plus `_unsafe_view`, `_reshape_alias`): they change a tensor's
  metadata only, no kernel runs on any device;
- allocations (`empty*`, `new_empty*`, `lift_fresh`): the caching allocator, no kernel;
- host reads (`_local_scalar_dense`, what `.item()`, `int()`, `bool()` dispatch): counted apart as syncs.
An op that runs several kernels on CUDA (sort, topk over a long row, index_put with a bool mask) counts once, and
one that CUDA fuses with its neighbour counts alone: the count is a lower-level proxy for kernels, not a census.

`SyncGuard` raises on what would make a captured step wait for the host: a scalar read (`_local_scalar_dense`),
an op whose output shape depends on the data (nonzero, masked_select, unique, ...), a copy to another device, and
the Python reads `.tolist()`, `.cpu()`, `.numpy()` (which on a CPU tensor dispatch nothing).
"""
from __future__ import annotations

import contextlib
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch
from torch.utils._python_dispatch import TorchDispatchMode

aten = torch.ops.aten
NO_KERNEL = {aten.empty.memory_format, aten.empty_strided.default, aten.empty_like.default,
             aten.new_empty.default, aten.new_empty_strided.default, aten.lift_fresh.default,
             aten._unsafe_view.default, aten._reshape_alias.default, aten.detach.default, aten.alias.default}
SYNC = {aten._local_scalar_dense.default}
# ops whose output shape depends on the values: the host must read a count before it can allocate the result
DATA_SHAPED = {"nonzero", "masked_select", "unique", "_unique", "_unique2", "unique_dim", "unique_consecutive",
               "repeat_interleave", "nonzero_static_fallback", "argwhere"}


def is_launch(func) -> bool:
    """Whether an aten op runs a kernel (see the module's docstring)."""
    return not (func in NO_KERNEL or func in SYNC or getattr(func, "is_view", False))


class OpCounter(TorchDispatchMode):
    """Counts dispatched ops: `launches` (by region), `syncs`, and `by_op` (op name -> launches)."""

    def __init__(self) -> None:
        super().__init__()
        self.launches: Counter = Counter()
        self.by_op: Counter = Counter()
        self.syncs = 0
        self.region = "other"

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in SYNC:
            self.syncs += 1
        elif is_launch(func):
            self.launches[self.region] += 1
            self.by_op[func.overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))

    @property
    def total(self) -> int:
        return sum(self.launches.values())

    @contextlib.contextmanager
    def region_of(self, region: str) -> Iterator[None]:
        saved, self.region = self.region, region
        try:
            yield
        finally:
            self.region = saved

    def wrap(self, fn: Callable, region: str) -> Callable:
        """`fn`, its ops counted under `region` (unless they already count under "head": the head's own layer)."""
        def run(*args, **kwargs):
            with self.region_of(self.region if self.region == "head" else region):
                return fn(*args, **kwargs)
        return run

    @contextlib.contextmanager
    def regions(self, step) -> Iterator[None]:
        """Count a StaticStep's ops by region: "target layer" (the target's decoder layers, fused or the
        model's own), "head" (the draft head's forwards), "other" (everything else)."""
        from eagle_lite.decoding.static.stack import StaticLayer

        handles = []
        for layer in step.target.decoder.layers:
            handles.append(layer.register_forward_pre_hook(lambda *_: setattr(self, "region", "target layer")))
            handles.append(layer.register_forward_hook(lambda *_: setattr(self, "region", "other")))
        call = StaticLayer.__call__
        StaticLayer.__call__ = self.wrap(call, "target layer")
        draft = step.draft
        if draft is not None:
            draft._forward = self.wrap(type(draft)._forward.__get__(draft), "head")
        try:
            yield
        finally:
            StaticLayer.__call__ = call
            if draft is not None:
                del draft._forward
            for h in handles:
                h.remove()


class HostSyncError(RuntimeError):
    pass


class SyncGuard(TorchDispatchMode):
    """Raises HostSyncError on anything inside it that reads the device from the host (see the module)."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func.overloadpacket.__name__
        if func in SYNC or name in DATA_SHAPED or (name == "index" and _bool_index(args)):
            raise HostSyncError(f"{func} reads the device from the host")
        if name in ("_to_copy", "to") and "device" in kwargs and kwargs["device"] is not None:
            src = args[0].device if args and isinstance(args[0], torch.Tensor) else None
            if src is not None and torch.device(kwargs["device"]) != src:
                raise HostSyncError(f"{func} copies to {kwargs['device']}")
        return func(*args, **kwargs)

    def __enter__(self):
        self._saved = {name: getattr(torch.Tensor, name) for name in ("tolist", "cpu", "numpy")}
        for name in self._saved:
            setattr(torch.Tensor, name, _refuse(name))
        return super().__enter__()

    def __exit__(self, *exc):
        for name, method in self._saved.items():
            setattr(torch.Tensor, name, method)
        return super().__exit__(*exc)


def _refuse(name: str) -> Callable:
    def method(self, *args, **kwargs):
        raise HostSyncError(f"Tensor.{name}() reads the device from the host")
    return method


def _bool_index(args) -> bool:
    indices = args[1] if len(args) > 1 else ()
    return any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in indices or ())


# -- counting a generation -------------------------------------------------------------------------------------
@dataclass
class StepOps:
    """Launches of one engine's steps over a generation: per step kind, per region, and what the steps emitted."""

    method: str
    steps: int = 0
    tokens: int = 0                                   # emitted by the steps (the prefill's token not included)
    launches: Counter = field(default_factory=Counter)   # step kind ("draft", "verify") -> launches, all steps
    regions: Counter = field(default_factory=Counter)    # region -> launches, all steps
    by_op: Counter = field(default_factory=Counter)
    syncs: int = 0
    layers: int = 0                                   # the target's decoder layers
    depth: int = 0                                    # the draft tree's depth (0: plain decoding)
    verify_nodes: int = 1                             # the verify bucket

    def per_step(self, kind: str | None = None) -> float:
        total = self.launches[kind] if kind else sum(self.launches.values())
        return total / max(self.steps, 1)

    @property
    def per_token(self) -> float:
        return sum(self.launches.values()) / max(self.tokens, 1)

    @property
    def accepted(self) -> float:
        return self.tokens / max(self.steps, 1)

    def region_per_step(self, region: str) -> float:
        return self.regions[region] / max(self.steps, 1)

    def as_dict(self) -> dict:
        return {"method": self.method, "steps": self.steps, "tokens": self.tokens,
                "launches_per_step": round(self.per_step(), 2), "launches_per_token": round(self.per_token, 2),
                "draft_per_step": round(self.per_step("draft"), 2),
                "verify_per_step": round(self.per_step("verify"), 2),
                "target_layers_per_step": round(self.region_per_step("target layer"), 2),
                "head_per_step": round(self.region_per_step("head"), 2),
                "other_per_step": round(self.region_per_step("other"), 2), "syncs": self.syncs,
                "layers": self.layers, "depth": self.depth, "verify_nodes": self.verify_nodes,
                "by_op": dict(self.by_op.most_common())}


def count_generation(engine, prompts: list[list[int]], cfg) -> StepOps:
    """Run `engine` (an Engine whose backend is the static step in mode eager) over `prompts`, counting what its draft
    and verify steps launch, through the models' own modules (`stock`: the code CUDA runs, not the CPU speed-ups)."""
    from eagle_lite.kernels.accelerate import stock

    step = engine.backend
    if step.mode != "eager":
        raise ValueError(f"op counts run the steps eagerly (mode {step.mode!r} given)")
    target, head = step.target, None if step.draft is None else step.draft.head
    counter = OpCounter()
    ops = StepOps("eagle_graph" if head is not None else "vanilla_graph", layers=target.config.num_hidden_layers)

    def counted(fn: Callable[[], None], kind: str) -> Callable[[], None]:
        def run() -> None:
            before, syncs = counter.total, counter.syncs
            with counter:
                fn()
            ops.launches[kind] += counter.total - before
            ops.syncs += counter.syncs - syncs
            if kind == "verify":       # what the step emitted, before the caller trims it to the budget
                ops.steps += 1
                ops.tokens += int(step._state.readback[0])
        return run

    step.draft_step = counted(type(step).draft_step.__get__(step), "draft")
    step.verify_step = counted(type(step).verify_step.__get__(step), "verify")
    step._steps.clear()
    try:
        with contextlib.ExitStack() as stack:
            stack.enter_context(stock(target.model))
            if head is not None:
                stack.enter_context(stock(head))
            stack.enter_context(counter.regions(step))
            for prompt in prompts:
                engine.generate(prompt, cfg)
    finally:
        del step.draft_step, step.verify_step
        step._steps.clear()
    ops.regions, ops.by_op = counter.launches, counter.by_op
    if head is not None:
        ops.depth = step.draft.tree.depth
        ops.verify_nodes = step._state.tree.tokens.numel()
    return ops


def markdown(rows: list[StepOps], launch_us: float | None = None) -> str:
    """The table `eval.step_cost --count-ops` prints: launches per step (draft, verify; the target's layers, the
    head's forwards, the rest), per draft depth and per layer, per emitted token; with `launch_us`, what those
    launches alone would cost at that many microseconds each."""
    lines = ["| method | verify nodes | draft depth | launches/step | draft | verify | per draft depth | "
             "head (per forward) | target layers (per layer) | rest | host syncs/step | accepted/step | "
             "launches/token |", "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        per_depth = f"{r.per_step('draft') / r.depth:.0f}" if r.depth else "—"
        head = f"{r.region_per_step('head'):.0f} ({r.region_per_step('head') / r.depth:.0f})" if r.depth else "—"
        layers = r.region_per_step("target layer")
        lines.append(f"| {r.method} | {r.verify_nodes} | {r.depth or '—'} | {r.per_step():.0f} | "
                     f"{r.per_step('draft'):.0f} | {r.per_step('verify'):.0f} | {per_depth} | {head} | "
                     f"{layers:.0f} ({layers / r.layers:.0f}) | {r.region_per_step('other'):.0f} | "
                     f"{r.syncs / max(r.steps, 1):.1f} | {r.accepted:.2f} | {r.per_token:.0f} |")
    if launch_us:
        lines += ["", f"At {launch_us:g} µs a launch: " + "; ".join(
            f"{r.method} {r.per_step() * launch_us / 1e3:.2f} ms a step, {r.per_token * launch_us / 1e3:.2f} ms a token"
            for r in rows)]
    return "\n".join(lines)
