"""What the static step launches (eval/op_count.py): a budget of device operations per step that a change may not
exceed, the per-layer structure, and no host read inside a step. On a GPU a small target's step is bound by
kernel launches, so these counts, taken on the CPU, are what the GPU's speed follows (docs/benchmarks.md)."""
from __future__ import annotations

import pytest
import torch
from conftest import make_target, reference_greedy

from eagle_lite.config import GenerationConfig, TreeConfig
from eagle_lite.heads.draft import DraftHead
from eagle_lite.pipeline import static_engine_for
from eval.op_count import HostSyncError, OpCounter, SyncGuard, count_generation

TREE = TreeConfig(depth=4, top_k=4, total_tokens=15)
# Launches per step of the 2-layer tiny Llama (make_target("llama")) at TREE, counted as eval/op_count.py counts
# them. Before the fused layers (static/stack.py) and the draft's and verify's constants (issue #49): vanilla 135,
# eagle's draft 320 and verify 137.
BUDGET = {"vanilla": 43, "draft": 149, "verify": 67}
TOLERANCE = 0.05            # a change may add up to 5% before this fails; lower the budget when it falls
LAYER_BUDGET = 14           # per target layer: 13, one more where attention needs a copy (SDPA's transpose)


@pytest.fixture(scope="module")
def tiny():
    return make_target("llama")


def counts(target, head, tokens: int = 10):
    cfg = GenerationConfig(max_new_tokens=tokens, stop_at_eos=False, tree=TREE)
    return count_generation(static_engine_for(target, head, mode="eager"), [list(range(3, 20))], cfg)


def eagle_head(target):
    torch.manual_seed(0)
    return DraftHead.for_target(target)


def test_the_steps_stay_within_their_launch_budget(tiny):
    vanilla, eagle = counts(tiny, None), counts(tiny, eagle_head(tiny))
    assert vanilla.steps == 9 and eagle.steps >= 1                     # the prefill's token, then one a step
    got = {"vanilla": vanilla.per_step("verify"), "draft": eagle.per_step("draft"),
           "verify": eagle.per_step("verify")}
    over = {k: (v, BUDGET[k]) for k, v in got.items() if v > BUDGET[k] * (1 + TOLERANCE)}
    assert not over, f"launches per step above the budget (count, budget): {over}"
    assert vanilla.syncs == 0 and eagle.syncs == 0
    for ops in (vanilla, eagle):
        assert ops.region_per_step("target layer") <= LAYER_BUDGET * tiny.config.num_hidden_layers


def test_the_counter_counts_kernels_not_views():
    counter = OpCounter()
    x = torch.arange(12.0)
    with counter:
        y = x.view(3, 4).t().unsqueeze(0)          # views: nothing launched
        z = (y * 2).sum()                           # two kernels
        int(z)                                      # a host read
    assert counter.total == 2 and counter.by_op == {"mul": 1, "sum": 1} and counter.syncs == 1


@pytest.mark.parametrize("read", [lambda t: t[0].item(), lambda t: t.tolist(), lambda t: int(t.sum()),
                                  lambda t: t.nonzero(), lambda t: t[t > 1], lambda t: t.cpu(),
                                  lambda t: bool(t.any())])
def test_the_sync_guard_refuses_every_host_read(read):
    with pytest.raises(HostSyncError), SyncGuard():
        read(torch.arange(4))
    assert torch.arange(3).tolist() == [0, 1, 2]                       # put back afterwards


@pytest.mark.parametrize("with_head", [False, True])
def test_a_step_never_reads_the_device(tiny, with_head):
    """The draft and verify steps, eagerly, under a guard that raises on any host read: the step's only read is
    the read-back the engine makes after it (on CUDA the gpu test runs them under CUDA's sync debug mode)."""
    static = static_engine_for(tiny, eagle_head(tiny) if with_head else None, mode="eager")
    prompt = list(range(3, 12))
    cfg = GenerationConfig(max_new_tokens=6, stop_at_eos=False, tree=TREE)
    static.generate(prompt, cfg)
    engine = static.backend
    steps = [engine.draft_step, engine.verify_step] if with_head else [engine.verify_step]
    with torch.inference_mode(), engine.running():
        for _ in range(3):
            with SyncGuard():
                for step in steps:
                    step()


def test_the_fused_layers_are_taken_and_emit_what_the_models_layers_emit(tiny):
    """The fused layers (static/stack.py) run the tiny Llama and its head; the model's own layers give the same
    tokens with more launches."""
    head = eagle_head(tiny)
    fused, own = static_engine_for(tiny, head), static_engine_for(tiny, head, fused=False)
    assert fused.backend._stack is not None and fused.backend.draft._layer is not None
    assert own.backend._stack is None and own.backend.draft._layer is None
    prompt = list(range(5, 30))
    cfg = GenerationConfig(max_new_tokens=20, stop_at_eos=False, tree=TREE)
    assert fused.generate(prompt, cfg).token_ids == own.generate(prompt, cfg).token_ids == \
        reference_greedy(tiny, prompt, 20)
    fewer, more = counts(tiny, head, 6), count_generation(own, [prompt], cfg)
    assert fewer.per_step() < 0.8 * more.per_step()


def test_an_eagle3_head_runs_fused_and_exact():
    """An EAGLE-3 head's layer (two norms side by side before the attention) fused: the same tokens as its own
    layer, and transformers' greedy output."""
    target = make_target("llama", layers=4)
    torch.manual_seed(0)
    head = DraftHead.for_target(target, feature_layers=(0, 1, 2), design="eagle3")
    fused, own = static_engine_for(target, head), static_engine_for(target, head, fused=False)
    assert fused.backend.draft._layer is not None and fused.backend.draft._layer[0].eagle3 and \
        own.backend.draft._layer is None
    prompt = list(range(5, 25))
    cfg = GenerationConfig(max_new_tokens=16, stop_at_eos=False, tree=TREE)
    assert fused.generate(prompt, cfg).token_ids == own.generate(prompt, cfg).token_ids == \
        reference_greedy(target, prompt, 16)
