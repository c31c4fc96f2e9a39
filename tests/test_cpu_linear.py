"""oneDNN-packed linears: the same products as nn.Linear, invisible to state_dict, removable for baselines."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from eagle_lite.kernels.cpu_linear import pack_linears, packing_available, unpacked

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


class _Block(nn.Module):
    """Sibling projections of one input, as transformers' attention and gated MLP name them."""

    def __init__(self, bias: bool) -> None:
        super().__init__()
        self.q_proj, self.k_proj, self.v_proj = (nn.Linear(48, 48, bias), nn.Linear(48, 16, bias),
                                                 nn.Linear(48, 16, bias))
        self.gate_proj, self.up_proj = nn.Linear(48, 96, bias=False), nn.Linear(48, 96, bias=False)

    def forward(self, x):
        q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        return q.sum(-1) + k.sum(-1) * v.sum(-1), self.gate_proj(x) * self.up_proj(x)


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("rows,threads", [(1, 1), (1, 2), (6, 1), (40, 1)])
def test_sibling_projections_share_one_product_with_the_same_results(bias, rows, threads, monkeypatch):
    torch.manual_seed(0)
    dense = _Block(bias)
    packed = _Block(bias)
    packed.load_state_dict(dense.state_dict())
    assert pack_linears(packed) == 5 and set(packed.state_dict()) == set(dense.state_dict())
    x = torch.randn(1, rows, 48)
    calls = []
    product = torch.ops.mkldnn._linear_pointwise
    monkeypatch.setattr(torch.ops.mkldnn, "_linear_pointwise", lambda *a: calls.append(a[1].shape) or product(*a),
                        raising=False)
    saved = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        with torch.inference_mode():
            for got, want in zip(packed(x), dense(x)):
                torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    finally:
        torch.set_num_threads(saved)
    # one product per group, for 2-32 rows, and for one row only where oneDNN can split it over threads
    assert len(calls) == (2 if 1 < rows <= 32 or (rows == 1 and threads > 1) else 0)


def test_a_sibling_computes_its_own_product_for_another_or_modified_input():
    torch.manual_seed(0)
    block = _Block(True)
    pack_linears(block)
    x, other = torch.randn(5, 48), torch.randn(5, 48)
    with torch.no_grad():   # inference tensors keep no version counter: there only the identity is checked
        block.q_proj(x)
        torch.testing.assert_close(block.k_proj(other), F.linear(other, block.k_proj.weight, block.k_proj.bias))
        x.mul_(2.0)   # in place after the shared product: the stale slice must not be handed out
        torch.testing.assert_close(block.v_proj(x), F.linear(x, block.v_proj.weight, block.v_proj.bias))
        block.q_proj(x)
        torch.testing.assert_close(block.k_proj(x), F.linear(x, block.k_proj.weight, block.k_proj.bias),
                                   rtol=1e-5, atol=1e-5)
