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
