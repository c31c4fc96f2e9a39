"""oneDNN-packed linears: the same products as nn.Linear, invisible to state_dict, removable for baselines."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from eagle_lite.cpu_linear import pack_linears, packing_available, unpacked

pytestmark = pytest.mark.skipif(not packing_available(), reason="oneDNN packed linear unavailable here")


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(48, 96), nn.SiLU(), nn.Linear(96, 48, bias=False))


@pytest.mark.parametrize("rows", [1, 2, 7, 32, 40])
def test_packed_products_equal_the_dense_ones(rows):
    dense, packed = _model(), _model()
    assert pack_linears(packed) == 2
    x = torch.randn(1, rows, 48)
    with torch.inference_mode():
        torch.testing.assert_close(packed(x), dense(x), rtol=1e-5, atol=1e-5)


def test_packing_keeps_the_state_dict_and_training_path():
    model = _model()
    keys = set(model.state_dict())
    pack_linears(model)
    assert set(model.state_dict()) == keys and pack_linears(model) == 0   # packing twice is a no-op
    loss = model(torch.randn(3, 48)).square().sum()                       # grad enabled: the dense path
    loss.backward()
    assert model[0].weight.grad is not None


def test_unpacked_runs_the_library_forward_then_packs_again(monkeypatch):
    model = _model()
    pack_linears(model)
    calls = []
    monkeypatch.setattr(torch.ops.mkldnn, "_linear_pointwise", lambda *a: calls.append(1) or torch.zeros(()),
                        raising=False)
    with torch.inference_mode():
        with unpacked(model):
            assert all("forward" not in m.__dict__ for m in model if isinstance(m, nn.Linear))
            model(torch.randn(4, 48))
        assert calls == []
        assert all("forward" in m.__dict__ for m in model if isinstance(m, nn.Linear))


def test_target_stock_runs_transformers_own_layers_and_attention():
    from conftest import make_target

    target = make_target("llama")
    target = type(target)(target.model, attention="gqa")
    linear = target.decoder.layers[0].mlp.up_proj
    assert "forward" in linear.__dict__ and target.model.config._attn_implementation == "eagle_lite_gqa"
    with target.stock():
        assert "forward" not in linear.__dict__ and target.model.config._attn_implementation == "sdpa"
    assert "forward" in linear.__dict__ and target.model.config._attn_implementation == "eagle_lite_gqa"
