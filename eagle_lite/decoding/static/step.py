"""The speculative step in fixed shapes on device tensors: draft -> verify -> accept -> cache commit, with one
small read-back per step (`StepState.readback`: the accepted length, then the new tokens) and nothing else crossing
to the host, so that it can be captured in CUDA graphs or compiled with `torch.compile(fullgraph=True)`.

Every host decision of the engine is a tensor op here: slot-indexed caches (static/kv_cache.py), the draft a
drafter hands this step (`Drafter.fixed_shape`: an EAGLE head's is drafters/eagle_static.py, the drafter's own tree
growth with its shapes fixed) placed in a bucket (static/tree.py), acceptance by `accept_greedy` (argmax, or a draw
per tree level: accept.py's rule for deterministic children), the commit one fixed-size copy. `StaticStep` is a
step backend of the engine (`Engine.backend`), which prefills through it, stops and counts. docs/gpu.md ("What one
step is") has the design, the modes and the GPU commands.
"""
from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, fields

import torch

from ...config import STATIC_MODES, GenerationConfig, SamplingConfig, TreeConfig
from ...kernels.accelerate import stock
from ...kernels.attention import KEYS, resolve_backend, select_attention
from ...kv_cache import ContextOverflowError, cache_keyword
from ...tree import DraftTree
from ..accept import sample_rows, target_probs
from ..engine import GenerationStats
from .kv_cache import DeviceKVCache, cache_shape, probe_calls, probe_error, probe_ids, slot_mask
from .stack import StaticStack
from .tree import StaticTree, accept_greedy, bucket_for

log = logging.getLogger("eagle_lite")

SLOT_BLOCK = 256   # cache sizes are rounded up to this many slots, so most prompts reuse the same graphs
MODES = STATIC_MODES
# attention backends the static step runs: SDPA kernels over a dense mask of the whole buffer. The split backends
# (lse_merge, flash) need the prefix as the first keys, and flex builds its BlockMask per forward on the host.
STATIC_BACKENDS = ("sdpa", "gqa")


# -- the engine ----------------------------------------------------------------------------------------
class VerifyConstants:
    """What the verify step reads that depends only on the bucket, the depth and the cache size."""

    def __init__(self, bucket: int, depth: int, slots: int, device) -> None:
        self.cols = torch.arange(slots, device=device)              # [S] over the target's cache
        self.tree_rows = torch.arange(bucket, device=device)        # [B]
        self.is_root = self.tree_rows == 0
        self.levels = torch.arange(depth + 1, device=device)        # [D + 1]


@dataclass
class StepState:
    """What one step reads and writes on the device; the buffers never move (captured graphs read them)."""

    length: torch.Tensor     # [] long: tokens in the target's cache; the root's position
    root: torch.Tensor       # [1] long: the last chosen token, not yet in the cache
    readback: torch.Tensor   # [D + 2] long: the tokens the last step emitted (n), then those tokens, bonus last
    feats: torch.Tensor | None   # [D + 1, F]: target features of the emitted tokens' predecessors (the draft reads)
    tree: StaticTree
    uniforms: torch.Tensor   # [D + 1] float64: sampling's draw at each tree level, drawn before each step
    seen: Seen | None = None   # what the last verify saw, kept only while observers watch (`StaticStep.seen`)

    @property
    def n(self) -> torch.Tensor:
        return self.readback[0]

    @property
    def emitted(self) -> torch.Tensor:
        return self.readback[1:]

    def small(self) -> list[torch.Tensor]:
        """Every buffer but the caches (what a step may change besides the slots past the committed length)."""
        return [self.length, self.root, self.readback, *([self.feats] if self.feats is not None else []),
                *(getattr(self.tree, f.name) for f in fields(self.tree)), self.uniforms]


@dataclass
class Seen:
    """The last verify's outputs at the tree's B nodes and its accepted path, kept for observers
    (decoding/observer.py); a step writes them only while someone watches."""

    hidden: torch.Tensor     # [B, H] the target's last hidden states
    features: torch.Tensor   # [B, F] the features a draft reads there
    path: torch.Tensor       # [D + 1] long: the accepted nodes from the root, padded with 0

    def keep(self, hidden: torch.Tensor, features: torch.Tensor, path: torch.Tensor | None = None) -> None:
        """Copy a verify's outputs in (path None: plain decoding's, the root alone)."""
        self.hidden.copy_(hidden)
        self.features.copy_(features)
        if path is not None:
            self.path.copy_(path)


class StaticStep:
    """The fixed-shape step as the Engine's step backend (`Engine(target, drafter, backend=StaticStep(...))`): plain
    decoding (draft None) or the draft a drafter hands it (`FixedShape.draft`: drafters/eagle_static.py `StaticDraft`,
    its taps, `tree_for`, `prepare`, `prefill`, `draft` and `running`), greedy or sampled. The engine prefills through
    `prefill`, then asks `step` for each step's tokens; its loop chooses the first token, stops, and counts.

    mode: how the steps run. "eager"; "compile" (`torch.compile(fullgraph=True)` with `compile_backend`, inductor
    by default); "cuda-graph" (each step captured once in a `torch.cuda.CUDAGraph` per bucket and replayed); "auto":
    "cuda-graph" on CUDA, else "eager" (why not torch.compile's own CUDA graphs: docs/gpu.md).
    max_len: the cache slots to allocate up front (more are allocated when a call needs them, in blocks of
    `SLOT_BLOCK`: each growth recaptures or recompiles the steps; every step attends over all slots, so a benchmark
    sets it once, to about its longest call).
    profile: synchronise between draft and verify to time them (stats.draft_seconds / verify_seconds): a
    measurement, not a speed run.
    lookahead: queue each step before reading the one before it (`_ahead`; None: on CUDA, where the device then
    never waits for the host; on a CPU, where nothing runs asynchronously, it would only add a wasted last step).
    """

    def __init__(self, target, draft=None, mode: str = "auto", max_len: int | None = None,
                 profile: bool = False, compile_backend: str = "inductor", lookahead: bool | None = None,
                 fused: bool = True) -> None:
        if mode not in MODES:
            raise ValueError(f"unknown static step mode {mode!r}: choose one of {', '.join(MODES)}")
        if mode == "auto":
            mode = "cuda-graph" if target.device.type == "cuda" else "eager"
        if mode == "cuda-graph" and target.device.type != "cuda":
            raise ValueError(f"static step mode {mode!r} captures CUDA graphs; target '{target.name}' is on "
                             f"{target.device} (use 'eager' or 'compile')")
        self.target, self.draft, self.mode, self.profile = target, draft, mode, profile
        self.compile_backend = compile_backend
        self.lookahead = target.device.type == "cuda" if lookahead is None else lookahead
        self._cache_keyword = cache_keyword(type(target.decoder).forward)   # what the decoder calls its cache
        self.taps = draft.taps if draft is not None else ()
        if self.taps:
            target.check_taps(self.taps)
        self._fixed_len = max_len
        self._cache: DeviceKVCache | None = None
        self._state: StepState | None = None
        self._shape: tuple = ()            # (bucket, depth, top_k, total_tokens, min_prob, sampling) of the state
        self._steps: dict = {}             # (kind, shape) -> the callable that runs that step
        self._pool = None                  # the CUDA graphs' shared memory pool
        self._verify_consts: VerifyConstants | None = None
        self._sampling, self._generator = SamplingConfig(), None   # the call's (`prefill`)
        self._reads: Iterator[list[int]] | None = None             # each step's read-back (`step`)
        self._root, self._prompt_read = 0, None                    # what observers are shown (`seen`)
        # the target's layers in fewer ops (static/stack.py), where it runs them as the model does; else the model
        self._stack = StaticStack.build(target.decoder, self.taps) if fused else None
        problem = self._fused_problem() if self._stack is not None else None
        if problem:
            log.info("the static step runs the model's own layers, not the fused ones: %s", problem)
            self._stack = None
        self._check_static_forward()

    # -- the model calls --------------------------------------------------------------------------
    @contextlib.contextmanager
    def running(self) -> Iterator[None]:
        """Run a block as the steps need the models: attention through an SDPA backend (`STATIC_BACKENDS`: the
        target's own if it is one, else gqa), and, where the steps are compiled, the modules' own forwards (the
        CPU speed-ups of kernels/ are native ops and packed weights that torch.compile does not trace)."""
        model = self.target.model
        current = model.config._attn_implementation
        with contextlib.ExitStack() as stack:
            if self.target.device.type == "cuda":     # graphs, streams and events on the target's GPU
                stack.enter_context(torch.cuda.device(self.target.device))
            if current not in [KEYS[b] for b in STATIC_BACKENDS]:
                model.set_attn_implementation(select_attention("gqa" if _has_gqa() else "sdpa", model))
                stack.callback(model.set_attn_implementation, current)
            if self.mode == "compile":
                stack.enter_context(stock(model))
            if self.draft is not None:
                stack.enter_context(self.draft.running(self.mode == "compile"))
            yield

    def _check_static_forward(self) -> None:
        """Refuse a target that the static step would run wrong: a prompt, then two sibling nodes after it, through
        the static cache, must give the target's own full forwards' logits (as `Target._check_tree_forward`)."""
        target, dev = self.target, self.target.device
        ids = probe_ids(target.vocab_size, dev)
        sibling = (ids[4:5] + 1) % target.vocab_size
        saved, problem = self._cache, None
        try:
            with torch.inference_mode(), self.running():
                want = torch.stack([target.model(input_ids=ids[None]).logits[0, 4],
                                    target.model(input_ids=torch.cat([ids[:4], sibling])[None]).logits[0, -1]])
                self._cache = DeviceKVCache(*cache_shape(target.config), 16, target.dtype, dev)
                prompt, pair = probe_calls(4, dev)
                self._target_forward(ids[:4], *prompt)
                got = target.logits(self._target_forward(torch.cat([ids[4:5], sibling]), *pair)[0]).float()
            tolerance = 1e-3 if target.dtype == torch.float32 else 3e-2
            if float((got - want.float()).norm()) > tolerance * float(want.float().norm()) + 1e-5:
                problem = "its logits over a draft tree through the static cache differ from its own full forward"
        except Exception as err:  # noqa: BLE001 (any failure here means the target cannot run this way)
            problem = f"a forward through the static cache fails ({type(err).__name__}: {err})"
        finally:
            self._cache = saved
        if problem:
            raise ValueError(f"target '{target.name}' cannot run the static step: {problem}; use the engine")

    def _fused_problem(self) -> str | None:
        """Why the fused layers (`_stack`) cannot stand in for the model's own: None where a prompt (4 tokens) and
        then two sibling nodes through each way give the same outputs and cache entries (to float rounding, summed
        over the layers: the products run in other shapes). The draft probes its own (drafters/eagle_static.py)."""
        target, dev, fused = self.target, self.target.device, self._stack
        ids = probe_ids(target.vocab_size, dev)
        tokens = [ids[:4], torch.cat([ids[4:5], (ids[4:5] + 1) % target.vocab_size])]
        tolerance = 1e-4 if target.dtype == torch.float32 else 2e-2
        saved, outs = self._cache, []
        try:
            with torch.inference_mode(), self.running(), stock(target.model):   # the model as transformers built it
                for use in (fused, None):
                    self._stack = use
                    self._cache = DeviceKVCache(*cache_shape(target.config), 16, target.dtype, dev)
                    outs.append([*(torch.cat(self._target_forward(t, *call), dim=-1)
                                   for t, call in zip(tokens, probe_calls(4, dev))), self._cache.kv[..., :6, :]])
        except Exception as err:  # noqa: BLE001 (any failure means: run the model's own layers)
            return f"a probe fails ({type(err).__name__}: {err})"
        finally:
            self._cache, self._stack = saved, fused
        error = probe_error(*outs)
        log.debug("the fused layers on the probe: relative error %.1e", error)
        return f"they compute something else on a probe (relative error {error:.1e})" if error > tolerance else None

    def _target_forward(self, tokens: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor,
                        slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(final hidden states [T, H], the features the draft head reads [T, F]) of T tokens; their keys and
        values land at `slots` of the target's cache."""
        t = tokens.numel()
        if self._stack is not None:
            hidden, tapped = self._stack(tokens, positions, mask, self._cache.kv, slots)
            return hidden, (torch.cat(tapped, dim=-1) if self.taps else hidden)
        out = self.target.decoder(input_ids=tokens.view(1, t), attention_mask=mask, position_ids=positions.view(1, t),
                                  use_cache=True, output_hidden_states=bool(self.taps),
                                  **{self._cache_keyword: self._cache.writer(slots)})
        hidden = out.last_hidden_state[0]
        if not self.taps:
            return hidden, hidden
        return hidden, torch.cat([out.hidden_states[i + 1][0] for i in self.taps], dim=-1)

    def _next(self, hidden: torch.Tensor, depths: torch.Tensor) -> torch.Tensor:
        """The target's next token after each final hidden state [T, H] of nodes at `depths` [T] -> [T] long: its
        argmax, or sampling, its draw at the uniform of the node's level (`accept.sample_rows`). A walk down the tree
        visits one node a level, so the nodes it visits draw independently, as accept.py's walk draws."""
        logits = self.target.lm_head(hidden)
        finish = self.target.lm.finish
        logits = logits if finish is None else finish(logits)
        if self._sampling.greedy:
            return logits.argmax(dim=-1)
        return sample_rows(target_probs(logits, self._sampling), self._state.uniforms[depths])

    # -- the steps ------------------------------------------------------------------------------------
    def draft_step(self) -> None:
        """Grow the draft tree under the root into `state.tree` (the draft's `draft`: drafters/eagle_static.py, the
        drafter's own growth in fixed shapes)."""
        self.draft.draft(self._state)

    def verify_step(self) -> None:
        """Verify `state.tree` in one target forward, accept its longest path whose every node carries the target's
        next token at its parent (`accept_greedy` over `_next`'s tokens: the argmax, or sampling, a draw: accept.py's
        rule for deterministic children), commit it; `readback` then holds the accepted length and the new tokens
        (past them, what it holds is not read)."""
        s, c = self._state, self._verify_consts
        if s.tree.tokens.numel() == 1:                                     # plain decoding: the root alone
            hidden, feats = self._target_forward(s.root, s.length.view(1), (c.cols <= s.length).view(1, 1, 1, -1),
                                                 s.length.view(1))
            if s.seen is not None:
                s.seen.keep(hidden, feats)
            s.readback[1:].copy_(self._next(hidden, c.levels))   # levels: [0], the root's
            s.root.copy_(s.readback[1:])
            s.length.add_(1)
            return
        tree = s.tree
        tokens = torch.cat([s.root, tree.tokens[1:]])
        slots = s.length + c.tree_rows
        hidden, feats = self._target_forward(tokens, s.length + tree.depths,
                                             slot_mask(s.length, tree.ancestors, c.cols, slots), slots)
        top = self._next(hidden, tree.depths)                             # B: each node's next token
        path, n, bonus = accept_greedy(StaticTree(tokens, tree.parents, tree.depths, tree.ancestors, tree.valid),
                                       top, c.levels.numel() - 1, c.is_root, c.levels)
        if s.seen is not None:
            s.seen.keep(hidden, feats, path)
        # commit: the path's entries next to the prefix (slots past length + n are overwritten by the next step)
        self._cache.move(s.length + path, slots[:c.levels.numel()])
        if s.feats is not None:
            torch.index_select(feats, 0, path, out=s.feats)
        # the target's token at each path node is the next token: the path's own tokens after the root, then the
        # bonus (entries past n are not read)
        torch.index_select(top, 0, path, out=s.readback[1:])
        s.readback[:1].copy_(n.view(1))
        s.root.copy_(bonus.view(1))
        s.length.add_(n)

    # -- running them ---------------------------------------------------------------------------------
    def _runner(self, kind: str) -> Callable[[], None]:
        key = (kind, self._shape)       # `_prepare` forgets them all when it rebuilds a buffer
        run = self._steps.get(key)
        if run is None:
            fn = self.draft_step if kind == "draft" else self.verify_step
            if self.mode == "eager":
                run = fn
            elif self.mode == "compile":
                # one compiled graph per bucket and tree setting, all of the same two methods: room for many
                config = torch._dynamo.config
                config.recompile_limit = max(getattr(config, "recompile_limit", 8), 64)
                run = torch.compile(fn, fullgraph=True, dynamic=False, backend=self.compile_backend)
            else:
                try:
                    run = self._capture(fn)
                except Exception as err:  # noqa: BLE001 (whatever stops the capture, the user needs another mode)
                    raise RuntimeError(f"capturing the static {kind} step in a CUDA graph failed "
                                       f"({type(err).__name__}: {err}); run it in mode 'eager' or 'compile'") from err
            self._steps[key] = run
        return run

    def _capture(self, fn: Callable[[], None]) -> Callable[[], None]:
        """`fn` recorded once in a CUDA graph (after a warm-up run whose effects on the step state are undone: a
        step writes the caches only past the committed length) and replayed from then on."""
        saved = [t.clone() for t in self._state.small()]
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            fn()
        torch.cuda.current_stream().wait_stream(side)
        for t, v in zip(self._state.small(), saved):
            t.copy_(v)
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            fn()
        return graph.replay

    def _prepare(self, need: int, tree: TreeConfig, sampling: SamplingConfig = SamplingConfig(),
                 observed: bool = False) -> None:
        """Caches of at least `need` slots and step buffers for `tree` and `sampling` (the draft's too; `observed`:
        what each verify saw too, `Seen`); rebuilt (and graphs recaptured) only when one of them changes."""
        target, dev = self.target, self.target.device
        depth = tree.depth if self.draft is not None else 0
        size = max(self._fixed_len or 0, -(-need // SLOT_BLOCK) * SLOT_BLOCK)
        if self._cache is None or self._cache.slots < size:
            if self._cache is not None:
                size = max(size, min(2 * self._cache.slots, -(-target.max_context // SLOT_BLOCK) * SLOT_BLOCK))
            self._cache = None   # the old buffer goes before the new one comes
            self._cache = DeviceKVCache(*cache_shape(target.config), size, target.dtype, dev)
            self._steps.clear()
        bucket = bucket_for(1 + tree.total_tokens) if self.draft is not None else 1
        shape = (bucket, depth, tree.top_k, tree.total_tokens, tree.min_prob, sampling, observed)
        self._sampling = sampling
        if shape != self._shape or self._state is None:
            features = len(self.taps) * target.hidden_size if self.taps else target.hidden_size
            self._state = StepState(
                length=torch.zeros((), dtype=torch.long, device=dev),
                root=torch.zeros(1, dtype=torch.long, device=dev),
                readback=torch.zeros(depth + 2, dtype=torch.long, device=dev),
                feats=None if self.draft is None else torch.zeros(depth + 1, features, dtype=target.dtype, device=dev),
                tree=StaticTree.empty(bucket, dev),
                uniforms=torch.zeros(depth + 1, dtype=torch.float64, device=dev),
                seen=None if not observed else Seen(
                    torch.zeros(bucket, target.hidden_size, dtype=target.dtype, device=dev),
                    torch.zeros(bucket, features, dtype=target.dtype, device=dev),
                    torch.zeros(depth + 1, dtype=torch.long, device=dev)))
            self._shape = shape
            self._steps.clear()
        if self.draft is not None and self.draft.prepare(tree, bucket, self._cache.slots, rebuild=not self._steps):
            self._steps.clear()
        if not self._steps or self._verify_consts is None:                # the graphs read them where they lie
            self._verify_consts = VerifyConstants(bucket, depth, self._cache.slots, dev)

    def _prefill(self, prompt_ids: list[int], choose: Callable[[torch.Tensor], int] | None = None) -> int:
        """The prompt through the target (and the draft head), eagerly; returns the first new token, `choose` of the
        last prompt token's final hidden state [H] (None: the target's argmax)."""
        s, dev = self._state, self.target.device
        p = len(prompt_ids)
        ids = torch.tensor(prompt_ids, device=dev)
        ar = torch.arange(p, device=dev)
        zero = torch.zeros((), dtype=torch.long, device=dev)
        causal = torch.ones(p, p, dtype=torch.bool, device=dev).tril_()
        hidden, feats = self._target_forward(ids, ar, slot_mask(zero, causal, self._cache.slots), ar)
        first = (choose or self.target.top_token)(hidden[-1])
        if self.draft is not None:                                         # pairs (f_t, x_{t+1}) for t < p - 1
            self.draft.prefill(feats[:-1], ids[1:])
        s.length.fill_(p)
        s.root.fill_(first)
        s.readback.zero_()
        s.readback[0] = 1                                                  # what the draft reads: the first token
        s.readback[1] = first
        if s.feats is not None:                                            # f_{p-1}: the draft reads it next step
            s.feats.zero_()
            s.feats[0] = feats[-1]
        self._prompt_read = (hidden, feats) if s.seen is not None else None
        return first

    # -- the engine's backend -------------------------------------------------------------------------
    def prefill(self, prompt_ids: list[int], cfg: GenerationConfig, budget: int, generator: torch.Generator | None,
                choose: Callable[[torch.Tensor], int], observed: bool = False) -> int:
        """Read the prompt into this step's own caches (sized for `budget` new tokens and `cfg`'s tree) and return
        the first token, `choose` of the last prompt token's final hidden state; the steps after it (`step`) decode
        with `cfg`'s tree (without its prompt-lookup graft; a parallel head's capped to its K) and sampling, drawing
        from `generator`. observed: observers watch this call, so the prompt's outputs and each verify's are kept
        for them (`seen_prompt`, `seen`). Run inside `running()`."""
        window = self.target.window
        if window is not None and len(prompt_ids) + budget > window:   # its masks are one for every layer
            raise ContextOverflowError(
                f"the fixed-shape step runs target '{self.target.name}' within its {window}-token sliding window, and "
                f"this prompt and answer take {len(prompt_ids) + budget} tokens: run without --static (the tree step "
                f"gives each sliding layer its own window)")
        tree, bucket, depth = cfg.tree, 1, 0
        if self.draft is not None:
            tree = self.draft.tree_for(tree)
            bucket, depth = bucket_for(1 + tree.total_tokens), tree.depth
        self._generator = generator
        # the budget, the last step's tree, and on CUDA one more step queued ahead (`_ahead`)
        self._prepare(len(prompt_ids) + budget + 2 * (bucket + depth + 1), tree, cfg.sampling, observed)
        self._reads = None
        return self._prefill(prompt_ids, choose)

    def seen_prompt(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The target's outputs at the prompt's tokens: (last hidden states [p, H], features [p, F]) (`observed`)."""
        return self._prompt_read

    def seen(self) -> tuple[DraftTree, list[int], torch.Tensor, torch.Tensor]:
        """What the last step verified, read back for observers (`observed`): (its tree, without the padding; its
        accepted path, root first; the target's last hidden states and features at the tree's nodes)."""
        s = self._state
        valid = s.tree.valid.tolist()
        nodes = max(i for i, v in enumerate(valid) if v) + 1            # padding comes after the kept nodes
        parents = s.tree.parents[:nodes].tolist()
        tree = DraftTree(torch.cat([s.root.new_tensor([self._root]), s.tree.tokens[1:nodes]]), [-1] + parents[1:])
        accepted = int(s.readback[0])
        path = s.seen.path[:accepted].tolist()                          # plain decoding: [0], the root
        return tree, path, s.seen.hidden[:nodes].clone(), s.seen.features[:nodes].clone()

    def step(self, seq) -> list[int]:
        """One draft and verify on the device: the tokens it emits (those of the accepted path, the bonus last).
        `seq.stats` gets the draft and verify times where `profile` is set."""
        self._root = seq.tokens[-1]
        if self._reads is None:
            draft = self._runner("draft") if self.draft is not None else None
            verify = self._runner("verify")
            ahead = self.lookahead and not self.profile and self._state.seen is None   # observed: each step read
            self._reads = self._ahead(draft, verify) if ahead else \
                self._in_turn(draft, verify, seq.stats)
        back = next(self._reads)
        return back[1:1 + back[0]]

    def _launch(self, draft, verify, between: Callable[[], None] = lambda: None) -> None:
        """Queue one step: its uniforms drawn (sampling), then the draft, `between` (a sync to time them), the
        verify."""
        if self._generator is not None:
            u = self._state.uniforms
            torch.rand(u.shape, generator=self._generator, dtype=u.dtype, device=u.device, out=u)
        if draft is not None:
            draft()
        between()
        verify()

    def _in_turn(self, draft, verify, stats: GenerationStats) -> Iterator[list[int]]:
        """Each step's read-back, read before the next step starts (a CPU; or timing the parts: `profile`)."""
        sync = torch.cuda.synchronize if self.profile and self.target.device.type == "cuda" else (lambda: None)
        t: list[float] = []
        while True:
            t[:] = [time.perf_counter()]
            self._launch(draft, verify, lambda: t.append(sync() or time.perf_counter()))
            back = self._state.readback.tolist()                          # the step's one read from the device
            if self.profile:
                stats.draft_seconds += t[1] - t[0]
                stats.verify_seconds += time.perf_counter() - t[1]
            yield back

    def _ahead(self, draft, verify) -> Iterator[list[int]]:
        """Each step's read-back on CUDA, with the next step already queued behind it: its [n, tokens] go to pinned
        host memory by an asynchronous copy, and the host reads them while the device runs the next step, so the
        device never waits for the host. The step queued after the last one read is wasted (its cache slots are
        past the budget; `prefill` reserves them)."""
        cuda = self.target.device.type == "cuda"    # elsewhere the same order, run synchronously (tests)
        host = [torch.empty(self._state.readback.numel(), dtype=torch.long, pin_memory=cuda) for _ in range(2)]
        done = [torch.cuda.Event() if cuda else None for _ in range(2)]

        def queue(slot: int) -> None:
            self._launch(draft, verify)
            host[slot].copy_(self._state.readback, non_blocking=cuda)
            if cuda:
                done[slot].record()

        queue(0)
        slot = 0
        while True:
            queue(1 - slot)
            if cuda:
                done[slot].synchronize()
            yield host[slot].tolist()
            slot = 1 - slot


def _has_gqa() -> bool:
    try:
        resolve_backend("gqa", "cpu")
    except ValueError:
        return False
    return True
