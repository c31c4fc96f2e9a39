"""Fused RMSNorms: F.rms_norm bit-identical to transformers' own, the native kernel equal to float32 rounding,
used only where they compute the same norm, removable for baselines."""
from __future__ import annotations

import pytest
import torch
from conftest import make_target

from eagle_lite.kernels.fused_norm import fuse_rms_norms


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_fused_decoder_is_bit_identical_to_the_stock_one(family):
    stock, fused = make_target(family).model, make_target(family).model   # same seed: same weights
    for m in fused.modules():   # Target fused them already; start from the library's forwards
        m.__dict__.pop("forward", None)
    norms = [m for m in fused.modules() if type(m).__name__.endswith("RMSNorm")]
    assert fuse_rms_norms(fused, native=False) == len(norms) > 0   # qwen3's q/k norms included
    ids = torch.randint(0, 96, (1, 11))
    with torch.inference_mode():
        for m in stock.modules():
            m.__dict__.pop("forward", None)
        assert torch.equal(fused(ids).logits, stock(ids).logits)


@pytest.mark.parametrize("rows", [1, 7, 100])
def test_the_native_norm_equals_the_library_norm_to_rounding(rows):
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    from eagle_lite.kernels.native import kernel_available

    if not kernel_available():
        pytest.skip("eagle_lite's native kernels do not build here")
    stock, fused = LlamaRMSNorm(576, eps=1e-5), LlamaRMSNorm(576, eps=1e-5)
    with torch.no_grad():
        stock.weight.uniform_(0.5, 2.0)
    fused.load_state_dict(stock.state_dict())
    assert fuse_rms_norms(fused) == 1 and fused.forward.func.__name__ == "_native_forward"
    x = torch.randn(1, rows, 576) * 3
    with torch.inference_mode():
        torch.testing.assert_close(fused(x), stock(x), rtol=1e-6, atol=1e-6)
    out = fused(x)                                   # grad enabled: torch's differentiable path
    assert torch.equal(out, torch.nn.functional.rms_norm(x, (576,), fused.weight, 1e-5))


def test_a_norm_that_computes_something_else_keeps_its_forward():
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    class CenteredRMSNorm(LlamaRMSNorm):   # subtracts the mean first: neither w * norm(x) nor (1 + w) * norm(x)
        def forward(self, x):
            return super().forward(x - x.mean(-1, keepdim=True))

    norm = CenteredRMSNorm(32)
    assert fuse_rms_norms(norm) == 0 and "forward" not in norm.__dict__
    assert fuse_rms_norms(LlamaRMSNorm(32).to(torch.bfloat16)) == 0        # only fp32 is fused
    assert fuse_rms_norms(LlamaRMSNorm(32)) == 1


@pytest.mark.parametrize("native", [True, False])
def test_a_gemma_norm_is_fused_with_one_plus_its_weight(native):
    from transformers.models.gemma3.modeling_gemma3 import Gemma3RMSNorm  # scales by (1 + weight)

    stock, fused = Gemma3RMSNorm(64, eps=1e-6), Gemma3RMSNorm(64, eps=1e-6)
    with torch.no_grad():
        stock.weight.normal_(0.0, 0.5)
    fused.load_state_dict(stock.state_dict())
    assert fuse_rms_norms(fused, native=native) == 1
    assert torch.equal(fused.fused_weight, stock.weight.detach() + 1.0)
    x = torch.randn(3, 64) * 3
    with torch.inference_mode():
        if native and fused.forward.func.__name__ == "_native_forward":
            torch.testing.assert_close(fused(x), stock(x), rtol=1e-6, atol=1e-6)
        else:
            assert torch.equal(fused(x), stock(x))


def test_unfused_runs_the_library_forward_then_fuses_again(monkeypatch):
    from eagle_lite.kernels import fused_norm

    monkeypatch.setattr(fused_norm, "kernel_available", lambda: False)   # count F.rms_norm calls below
    target = make_target()
    norm = target.decoder.norm
    assert "forward" in norm.__dict__ and fuse_rms_norms(target.decoder) == 0   # fusing twice is a no-op
    calls = []
    monkeypatch.setattr(torch.nn.functional, "rms_norm", lambda *a, **k: calls.append(1) or a[0])
    with torch.inference_mode():
        with target.stock():
            assert "forward" not in norm.__dict__
            target.model(torch.tensor([[1, 2, 3]]))
        assert calls == [] and "forward" in norm.__dict__
        norm(torch.ones(1, 64))
        assert calls == [1]
