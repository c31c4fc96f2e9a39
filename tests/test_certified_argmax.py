"""The float16 argmax of the lm_head: always the fp32 argmax, near ties included; refused where unsafe."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from conftest import make_target, reference_greedy

from eagle_lite.config import GenerationConfig
from eagle_lite.decoding.engine import Engine
from eagle_lite.drafters import PromptLookupDrafter
from eagle_lite.kernels.certified_argmax import CertifiedArgmax


def _weight(vocab: int = 4096, hidden: int = 64, seed: int = 0) -> torch.Tensor:
    torch.manual_seed(seed)
    return torch.randn(vocab, hidden) * 0.3


def test_the_answer_is_the_fp32_argmax_for_random_states():
    weight = _weight()
    argmax = CertifiedArgmax.build(weight, lambda x: F.linear(x, weight), require_faster=False)
    assert argmax is not None
    for seed in range(200):
        torch.manual_seed(seed)
        x = torch.randn(64) * (0.1 + seed % 7)
        assert argmax(x) == int(F.linear(x, weight).argmax())


def test_near_ties_are_settled_in_fp32():
    weight = _weight()
    x = torch.randn(64)
    best = int(F.linear(x, weight).argmax())
    # rows whose logits differ from the best by ~1e-4: far below float16's resolution, far above fp32's
    for j, gap in ((7, 1e-4), (3000, -1e-4), (11, 0.0)):
        weight[j] = weight[best] + gap * x / x.square().sum()
    exact = F.linear(x, weight)
    argmax = CertifiedArgmax(weight)
    assert argmax(x) == int(exact.argmax()) and argmax.rechecked == 1
    assert int(exact.argmax()) in (7, min(11, best))        # the +gap row wins; an exact tie goes to the lower id
    weight[7] = weight[best]
    assert CertifiedArgmax(weight)(x) == min(7, best)       # duplicated best rows: the lowest id, like argmax


def test_out_of_float16_range_inputs_take_the_fp32_path():
    weight = _weight()
    x = torch.randn(64)
    x[5] = 1e6
    assert CertifiedArgmax(weight)(x) == int(F.linear(x, weight).argmax())


def test_build_refuses_unsafe_weights_and_kernels(monkeypatch):
    weight = _weight()
    exact = lambda x: F.linear(x, weight)  # noqa: E731
    assert CertifiedArgmax.build(weight.to(torch.bfloat16), exact) is None
    big = weight.clone()
    big[0, 0] = 1e5                                          # does not fit float16
    assert CertifiedArgmax.build(big, lambda x: F.linear(x, big)) is None
    # a kernel whose errors exceed a quarter of the bound (e.g. one that summed in float16) is not trusted
    monkeypatch.setattr(CertifiedArgmax, "_approx", lambda self, x: F.linear(x, weight) + 0.5)
    assert CertifiedArgmax.build(weight, exact, require_faster=False) is None


def test_greedy_generation_on_the_float16_argmax_equals_the_target_alone():
    target = make_target("llama", seed=3)
    target.lm._argmax = CertifiedArgmax(target.lm_head.weight)
    prompt = [5, 9, 13, 5, 9, 13, 5, 9, 21, 4]
    want = reference_greedy(target, prompt, 40)
    for drafter in (None, PromptLookupDrafter()):
        got = Engine(target, drafter).generate(prompt, GenerationConfig(max_new_tokens=40)).token_ids
        assert got == want


def test_the_lm_heads_row_argmax_is_torchs_ties_and_nans_included():
    from eagle_lite.targets.lm_head import first_argmax

    torch.manual_seed(0)
    row = torch.randn(50000)
    with torch.inference_mode():
        for ties in ([7], [5, 77, 40000], [49999, 3]):    # equal largest logits: the first index, as torch's
            tied = row.clone()
            tied[ties] = 100.0
            assert first_argmax(tied) == int(tied.argmax()) == min(ties)
        tied[11] = float("nan")                          # a NaN counts as the largest, as in torch
        assert first_argmax(tied) == int(tied.argmax()) == 11
    assert first_argmax(row.double()) == int(row.argmax())   # other dtypes: torch's own
