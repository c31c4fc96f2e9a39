"""Row invariance: a row's result does not depend on how many rows share the forward.

Speculative greedy equals plain greedy bit for bit only if a token's logits in a tree's verify are the ones its
plain step computes alone: the same products, the same attention sums, in the same order. These tests hold the
native kernels to that (products of 1 to 32 rows; a tree node among hidden siblings against the plain steps along
its path), on both vector widths.
"""
from __future__ import annotations

import pytest
import torch
from conftest import make_target, snap_to_q4_1, snap_to_q8_0

from eagle_lite.kernels import native
from eagle_lite.kernels.grid_linear import Grid4, Grid8, GridK, grid_of

pytestmark = pytest.mark.skipif(not native.kernel_available(), reason="the native kernels did not build here")

WIDTHS = ["1", "0"]   # EAGLE_LITE_AVX512: 16 lanes where the CPU has AVX-512, and 8


def k8_grid(weight: torch.Tensor) -> GridK:
    """A Q6_K-like grid of `weight` [N, K]: int8 codes in -32..31 with a scale per 16 inputs and m = -0.0."""
    n, k = weight.shape
    w = weight.reshape(n, k // 16, 16)
    d = (w.abs().amax(-1, keepdim=True) / 31).half().float()
    codes = torch.round(w / d).clamp(-32, 31).to(torch.int8).reshape(n, k)
    scales = torch.stack([d[..., 0], torch.full_like(d[..., 0], -0.0)], -1).reshape(n, k // 8)
    return GridK(codes, scales)


@pytest.mark.parametrize("wide", WIDTHS)
@pytest.mark.parametrize("kind", [Grid4, Grid8, GridK])
def test_a_rows_product_is_the_same_bits_whatever_rows_share_it(wide, kind, monkeypatch):
    monkeypatch.setenv("EAGLE_LITE_AVX512", wide)
    torch.manual_seed(0)
    weight = torch.randn(75, 192)   # 75 columns: a tail past every tile's width
    grid = k8_grid(weight) if kind is GridK else grid_of({Grid4: snap_to_q4_1, Grid8: snap_to_q8_0}[kind](weight))
    assert isinstance(grid, kind)
    x = torch.randn(32, 192)
    alone = torch.cat([grid(x[i:i + 1].contiguous()) for i in range(32)])
    for m in range(1, 33):
        together = grid(x[:m].contiguous())
        assert torch.equal(together, alone[:m]), f"{m} rows: a row's product changed with the rows beside it"


def _tree(path: list[int], other: int) -> tuple[list[int], list[int], list[int]]:
    """A tree whose node order puts a hidden sibling before each node of `path` (so a path node's slot is not its
    position): (tokens, parents, the path's node indices)."""
    tokens, parents, nodes = [path[0]], [-1], [0]
    for tok in path[1:]:
        tokens.append(other)                 # a sibling the path's next node must not see
        parents.append(nodes[-1])
        tokens.append(tok)
        parents.append(nodes[-1])
        nodes.append(len(tokens) - 1)
    return tokens, parents, nodes


def _ancestors(parents: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    n = len(parents)
    mask = torch.zeros(n, n, dtype=torch.bool)
    depths = torch.zeros(n, dtype=torch.long)
    for i, p in enumerate(parents):
        mask[i, i] = True
        if p >= 0:
            mask[i] |= mask[p]
            depths[i] = depths[p] + 1
    return mask, depths


@pytest.mark.parametrize("wide", WIDTHS)
@pytest.mark.parametrize("prompt_len", [13, 16, 29])
@torch.inference_mode()
def test_a_tree_node_gets_the_bits_of_the_plain_steps_along_its_path(wide, prompt_len, monkeypatch):
    monkeypatch.setenv("EAGLE_LITE_AVX512", wide)
    target = make_target("llama", grid=True, hidden=128, layers=2)
    assert target.accelerated.stack is not None, "the tiny grid target should run its layers as the fused op"
    gen = torch.Generator().manual_seed(prompt_len)
    prompt = torch.randint(1, 96, (prompt_len,), generator=gen)
    path = torch.randint(1, 96, (7,), generator=gen).tolist()

    plain = target.new_cache(64)
    target.forward(prompt, plain)
    plain.commit(prompt_len)
    steps, step_logits = [], []
    for tok in path:
        _, hidden = target.forward(torch.tensor([tok]), plain)
        plain.commit(1)
        steps.append(hidden[0])
        step_logits.append(target.logits(hidden)[0])

    tokens, parents, nodes = _tree(path, other=95)
    ancestors, depths = _ancestors(parents)
    tree = target.new_cache(64)
    target.forward(prompt, tree)
    tree.commit(prompt_len)
    _, hidden = target.forward(torch.tensor(tokens), tree, ancestors, depths)
    logits = target.logits(hidden[nodes])
    for depth, node in enumerate(nodes):
        assert torch.equal(hidden[node], steps[depth]), f"depth {depth}: the tree node's hidden state differs"
        assert torch.equal(logits[depth], step_logits[depth]), f"depth {depth}: the tree node's logits differ"
