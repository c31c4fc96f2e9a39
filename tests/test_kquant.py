"""GGUF's K-quants (Q4_K, Q5_K, Q6_K) on the grid kernels: codes read from the file's blocks rebuild every weight
bit for bit (as gguf-py, which transformers loads GGUF files with, de-quantizes them), the kernel multiplies by
each of them exactly, and a target whose weights are K-quant decodes, plainly and speculatively, exactly like
transformers' generate()."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import make_model, reference_greedy
from test_grid_linear import needs_kernel

from eagle_lite.config import GenerationConfig, TreeConfig
from eagle_lite.decoding.engine import Engine
from eagle_lite.drafters import NoDrafter
from eagle_lite.kernels import cpu_linear, running_fused
from eagle_lite.kernels.grid_linear import Grid4, GridK, grid_of
from eagle_lite.kernels.kquant import BLOCK_BYTES, attach_file_grids, grid_from_blocks, placed
from eagle_lite.targets.model import Target

gguf = pytest.importorskip("gguf")
KINDS = ["Q4_K", "Q5_K", "Q6_K"]


def random_blocks(kind: str, rows: int, cols: int, seed: int = 0, step: float = 2e-4) -> np.ndarray:
    """A [rows, cols] K-quant tensor's raw blocks: random codes, scales and mins, fp16 d (and dmin) near `step`."""
    rng = np.random.default_rng(seed)
    blocks = rng.integers(0, 256, size=(rows * cols // 256, BLOCK_BYTES[kind]), dtype=np.uint8)
    d = (step * rng.uniform(0.5, 1.5, size=(blocks.shape[0], 1))).astype(np.float16).view(np.uint8)
    if kind == "Q6_K":
        blocks[:, 208:210] = d
    else:
        blocks[:, 0:2] = d
        blocks[:, 2:4] = (step * rng.uniform(0.5, 1.5, size=(blocks.shape[0], 1))).astype(np.float16).view(np.uint8)
    return blocks.reshape(rows, -1)


def dequantized(kind: str, blocks: np.ndarray) -> torch.Tensor:
    """gguf-py's fp32 weights of the blocks: what transformers' GGUF loading holds."""
    qtype = gguf.GGMLQuantizationType[kind]
    return torch.from_numpy(np.ascontiguousarray(gguf.dequantize(blocks, qtype), dtype=np.float32))


@pytest.mark.parametrize("kind", KINDS)
def test_codes_from_the_blocks_rebuild_gguf_py_s_weights_bit_for_bit(kind):
    blocks = random_blocks(kind, 24, 512, seed=1)
    w = dequantized(kind, blocks)
    grid = grid_from_blocks(kind, blocks, 24, 512)
    assert isinstance(grid, Grid4 if kind == "Q4_K" else GridK)
    assert torch.equal(grid.dense().view(torch.int32), w.view(torch.int32))


@pytest.mark.parametrize("kind", KINDS)
def test_codes_follow_the_weight_s_row_order_and_refuse_another_weight(kind):
    blocks = random_blocks(kind, 16, 256, seed=2)
    w = dequantized(kind, blocks)
    grid = grid_from_blocks(kind, blocks, 16, 256)
    order = torch.randperm(16, generator=torch.Generator().manual_seed(0))
    moved = placed(grid, w[order].contiguous())                   # transformers reorders a Llama file's q/k rows
    assert moved is not None and torch.equal(moved.dense(), w[order])
    nudged = w.clone()
    nudged[3, 7] = torch.nextafter(nudged[3, 7], torch.tensor(1.0))
    assert placed(grid, nudged) is None
    assert placed(grid, dequantized(kind, random_blocks(kind, 16, 256, seed=3))) is None


@needs_kernel
@pytest.mark.parametrize("wide", ["1", "0"])   # 16 lanes (AVX-512, where the CPU has it) or 8 (AVX2)
@pytest.mark.parametrize("kind", KINDS)
def test_the_kernel_multiplies_by_each_k_quant_weight_bit_for_bit(kind, wide, monkeypatch):
    """Rows of the identity pick out single weights: the kernel's rebuild of each must be gguf-py's fp32 weight."""
    monkeypatch.setenv("EAGLE_LITE_AVX512", wide)
    blocks = random_blocks(kind, 40, 256, seed=4)
    w = dequantized(kind, blocks)
    w.gguf_grid = grid_from_blocks(kind, blocks, 40, 256)
    grid = grid_of(w)
    assert grid is w.gguf_grid
    eye = torch.eye(256)
    for rows in (eye[:1], eye[:5], eye[5:37], eye[200:256]):
        picked = rows.argmax(-1)
        out, expected = grid(rows.contiguous()), w.t()[picked]
        # bit for bit, except a weight of -0.0 (Q6_K: code 0 with a negative scale), summed to +0.0 as by any GEMM
        assert torch.equal(torch.where(expected == 0, 0.0, out).view(torch.int32),
                           torch.where(expected == 0, 0.0, expected).view(torch.int32))
        assert bool((out[expected == 0] == 0).all())
    x = torch.randn(7, 256, generator=torch.Generator().manual_seed(5))
    torch.testing.assert_close(grid(x), (x.double() @ w.double().t()).float(), rtol=1e-5, atol=1e-5)


def test_a_weight_changed_since_its_codes_were_read_keeps_its_own_product():
    blocks = random_blocks("Q4_K", 8, 256, seed=6)
    w = dequantized("Q4_K", blocks)
    w.gguf_grid = grid_from_blocks("Q4_K", blocks, 8, 256)
    w[0, 0] += 1.0
    found = grid_of(w)
    assert found is not w.gguf_grid and (found is None or torch.equal(found.dense(), w))


def write_gguf(path, tensors: dict[str, tuple[str, np.ndarray]]) -> None:
    """A GGUF file holding only `tensors` (name -> (kind, raw blocks)): all attach_file_grids reads."""
    writer = gguf.GGUFWriter(str(path), "llama")
    for name, (kind, blocks) in tensors.items():
        writer.add_tensor(name, blocks, raw_dtype=gguf.GGMLQuantizationType[kind])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


LAYOUTS = {  # each linear's K-quant: all Q4_K, o and down as 8-bit K-quant codes (the fused layer runs both), or a
    # Q4_K_M-like mix whose q/k/v are not of one kind (their own products)
    "q4_k": dict.fromkeys(("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"), "Q4_K"),
    "k8_out": {"q_proj": "Q4_K", "k_proj": "Q4_K", "v_proj": "Q4_K", "o_proj": "Q5_K", "gate_proj": "Q4_K",
               "up_proj": "Q4_K", "down_proj": "Q6_K"},
    "mixed": {"q_proj": "Q4_K", "k_proj": "Q4_K", "v_proj": "Q6_K", "o_proj": "Q5_K", "gate_proj": "Q5_K",
              "up_proj": "Q5_K", "down_proj": "Q6_K"},
}


def k_quant_target(layout: str, tmp_path) -> Target:
    """A tiny Llama (hidden 256: whole super-blocks) whose linears and lm_head are K-quant, loaded as load_target
    loads a GGUF file: gguf-py's fp32 weights, then the file's codes attached."""
    model = make_model("llama", hidden=256)
    tensors, seed = {}, 10
    with torch.no_grad():
        for name, module in model.named_modules():
            kind = LAYOUTS[layout].get(name.rsplit(".", 1)[-1])
            if name == "lm_head":
                kind = "Q6_K"
            if kind is None:
                continue
            rows, cols = module.weight.shape
            blocks = random_blocks(kind, rows, cols, seed=seed, step=2e-3 if name == "lm_head" else 2e-4)
            seed += 1
            w = dequantized(kind, blocks)
            if name.endswith("q_proj"):           # the file's rows in another order, as a Llama file's q/k are
                order = torch.randperm(rows, generator=torch.Generator().manual_seed(seed))
                module.weight.copy_(w[order])
            else:
                module.weight.copy_(w)
            tensors[name] = (kind, blocks)
    write_gguf(tmp_path / "tiny.gguf", tensors)
    assert attach_file_grids(model, tmp_path / "tiny.gguf") == len(tensors)
    return Target(model.eval(), name=f"tiny-{layout}")


@needs_kernel
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_a_k_quant_target_decodes_exactly_like_generate(layout, tmp_path):
    from test_engine import eagle_engine

    target = k_quant_target(layout, tmp_path)
    attn, mlp = target.decoder.layers[0].self_attn, target.decoder.layers[0].mlp
    down = mlp.down_proj.cpu_product
    assert isinstance(down, cpu_linear._GridProduct)
    assert isinstance(down.grid, Grid4 if layout == "q4_k" else GridK)
    fused = [running_fused(layer) is not None for layer in target.decoder.layers]
    assert fused == [layout != "mixed"] * len(fused)   # the op takes Q4 and 8-bit K-quant codes, siblings of one kind
    if layout != "mixed":                     # siblings of one kind share one product
        assert isinstance(attn.q_proj.sibling_product.product.grid, Grid4)
    else:                                     # q/k Q4_K beside a Q6_K v: each its own
        assert isinstance(attn.v_proj.cpu_product.grid, GridK) and isinstance(attn.q_proj.cpu_product.grid, Grid4)
        assert isinstance(mlp.up_proj.sibling_product.product.grid, GridK)
    assert isinstance(target.lm_grid, GridK)
    prompt = list(range(3, 20))
    ref = reference_greedy(target, prompt, 30)
    cfg = GenerationConfig(max_new_tokens=30, stop_at_eos=False, tree=TreeConfig(depth=4, top_k=4, total_tokens=12))
    assert Engine(target, NoDrafter()).generate(prompt, cfg).token_ids == ref
    assert eagle_engine(target).generate(prompt, cfg).token_ids == ref
