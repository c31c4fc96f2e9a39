"""The token loss's labels: the target's distribution, its top-k, or its greedy token (draft.objective.labels)."""
from __future__ import annotations

import pytest
import torch

from trainers.objective import ObjectiveConfig, Pairs, target_distribution


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
