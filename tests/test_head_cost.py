"""`eval.head_cost` splits a head's draft forward into its pieces and counts the device ops it launches: an EAGLE-3 head
whose layer runs as the native op dispatches fewer than the same head run through torch."""
from __future__ import annotations

from conftest import make_target
from test_feature_layers import eagle3_drafter
from test_grid_linear import needs_kernel

from eval.head_cost import head_cost


@needs_kernel
def test_the_eagle3_heads_cost_is_split_and_its_fused_forward_dispatches_fewer_ops():
    target = make_target("llama", layers=4, grid=True)
    fast, plain = (head_cost(eagle3_drafter(target, round_head=r), rows=3, reps=3) for r in (True, False))
    assert set(fast) == set(plain) and {"forward", "  fc", "  q/k/v", "logits", "  lm_head", "ops"} <= set(fast)
    assert all(v > 0 for v in fast.values()) and all(v > 0 for v in plain.values())
    assert fast["ops"] < plain["ops"]


def test_a_parallel_heads_chain_is_one_forward_where_a_sequential_heads_is_k():
    """`--chain`: a sequential head's draft of K tokens runs K head forwards, so its ops grow by one forward's worth
    a token; a parallel head's stays one forward (K-1 more rows, a few more ops for the rows' logits)."""
    from eagle_lite.drafters.eagle import EagleDrafter
    from eagle_lite.heads.draft import DraftHead
    from eagle_lite_wing.parallel import ParallelDrafter
    from eval.head_cost import chain_cost

    target = make_target("llama")
    sequential = EagleDrafter(target, DraftHead.for_target(target))
    parallel = ParallelDrafter(target, DraftHead.for_target(target, parallel=4))
    seq = {k: chain_cost(sequential, k, rows=3, reps=3) for k in (1, 2, 4)}
    par = {k: chain_cost(parallel, k, rows=3, reps=3) for k in (1, 2, 4)}
    assert all(ms > 0 for ms, _ in [*seq.values(), *par.values()])
    per_forward = seq[2][1] - seq[1][1]
    assert per_forward > 0 and seq[4][1] - seq[2][1] >= 2 * per_forward
    assert abs(par[1][1] - seq[1][1]) <= 2               # K = 1: the same one forward
    assert par[4][1] - par[1][1] < per_forward           # four tokens for less than a second forward
