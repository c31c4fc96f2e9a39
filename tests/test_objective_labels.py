"""The token loss's labels (the target's distribution, its top-k, or its greedy token: draft.objective.labels) and
its LK share (draft.objective.lk_weight)."""
from __future__ import annotations

import pytest
import torch

from trainers.objective import ObjectiveConfig, Pairs, target_distribution, token_loss


def pairs_of(target: torch.Tensor) -> Pairs:
    n, h = target.shape
    zeros = torch.zeros(1, n, h)
    return Pairs(hidden=zeros, embeds=zeros, positions=torch.zeros(1, n, dtype=torch.long),
                 segment=torch.ones(1, n, dtype=torch.long), target=target[None],
                 weight=torch.tensor([[True] * (n - 1) + [False]]))


def test_labels_are_the_distribution_its_top_k_or_its_argmax():
    torch.manual_seed(0)
    lm, feats = torch.randn(50, 8), torch.randn(6, 8)
    pairs = pairs_of(feats)
    full = target_distribution(pairs, lm)
    assert full.shape == (5, 50) and torch.allclose(full.sum(-1), torch.ones(5))
    token = target_distribution(pairs, lm, "token")
    assert torch.equal(token.argmax(-1), full.argmax(-1)) and torch.equal(token.sum(-1), torch.ones(5))
    assert int((token > 0).sum()) == 5
    top = target_distribution(pairs, lm, "distribution", top_k=3)
    assert ((top > 0).sum(-1) == 3).all() and torch.allclose(top.sum(-1), torch.ones(5))
    kept = full.topk(3, dim=-1)
    renormalised = kept.values / kept.values.sum(-1, keepdim=True)
    assert torch.allclose(top.gather(-1, kept.indices), renormalised, atol=1e-6)


def test_bad_label_settings_are_refused():
    with pytest.raises(ValueError, match="labels must be"):
        ObjectiveConfig(labels="soft")
    with pytest.raises(ValueError, match="label_top_k"):
        ObjectiveConfig(label_top_k=-1)


def test_lk_loss_is_minus_log_the_acceptance_rate_and_mixes_with_cross_entropy():
    p = torch.tensor([[0.7, 0.2, 0.1], [0.5, 0.5, 0.0]])
    q = torch.tensor([[0.5, 0.3, 0.2], [0.5, 0.5, 0.0]]).clamp_min(1e-9)
    q_logp = q.log()
    ce = -(p * q_logp).sum(-1)
    assert torch.allclose(token_loss(q_logp, p), ce)
    accept = torch.tensor([0.5 + 0.2 + 0.1, 1.0])       # sum of min(p, q) per row
    assert torch.allclose(token_loss(q_logp, p, 1.0), -accept.log(), atol=1e-6)
    assert torch.allclose(token_loss(q_logp, p, 0.25), 0.75 * ce - 0.25 * accept.log(), atol=1e-6)
    assert float(token_loss(q_logp, p, 1.0)[1]) == pytest.approx(0.0, abs=1e-6)   # identical: always accepted


def test_lk_loss_gradient_raises_the_acceptance_rate():
    p = torch.tensor([[0.6, 0.3, 0.1]])
    logits = torch.tensor([[0.0, 1.0, 0.5]], requires_grad=True)
    before = torch.minimum(p, logits.softmax(-1)).sum()
    token_loss(logits.log_softmax(-1), p, 1.0).sum().backward()
    with torch.no_grad():
        after = torch.minimum(p, (logits - 0.1 * logits.grad).softmax(-1)).sum()
    assert after > before


def test_lk_weight_outside_zero_to_one_is_refused():
    with pytest.raises(ValueError, match="lk_weight"):
        ObjectiveConfig(lk_weight=1.5)
