"""The 4-bit grid path: weights found on a Q4_1 grid are rebuilt bit for bit, the kernel's products equal
the dense ones, and a target whose linears use it still decodes exactly like transformers' generate()."""
from __future__ import annotations

import os
import platform
import shutil

import pytest
import torch
import torch.nn.functional as F
from conftest import make_target, reference_greedy, snap_to_q4_1, snap_to_q8_0
from torch import nn

from eagle_lite.config import GenerationConfig, TreeConfig
from eagle_lite.decoding.engine import Engine
from eagle_lite.drafters import NoDrafter
from eagle_lite.kernels import cpu_linear, grid_linear
from eagle_lite.kernels.cpu_linear import pack_linears
from eagle_lite.kernels.grid_linear import Grid4, Grid8, grid_of, kernel_available

CAN_BUILD = (platform.machine().lower() in ("x86_64", "amd64") and shutil.which("c++") is not None
             and torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512")
             and os.environ.get("EAGLE_LITE_NATIVE", "1") != "0")
needs_kernel = pytest.mark.skipif(not CAN_BUILD, reason="the grid kernel needs x86-64 with AVX2 and a C++ compiler "
                                                        "(and EAGLE_LITE_NATIVE not 0)")


def _weight(n: int = 48, k: int = 96, seed: int = 0) -> torch.Tensor:
    return snap_to_q4_1(torch.randn(n, k, generator=torch.Generator().manual_seed(seed)))


def test_grid_rebuilds_a_q4_1_weight_bit_for_bit():
    w = _weight()
    grid = Grid4.of(w)
    assert grid is not None and grid.codes.shape == (48, 48) and grid.codes.dtype == torch.uint8
    assert grid.scales.shape == (48, 6)
    assert torch.equal(grid.dense(), w)


def test_grid_takes_symmetric_q4_0_weights_too():
    gen = torch.Generator().manual_seed(1)
    q = torch.randint(-8, 8, (8, 2, 32), generator=gen).float()
    q[..., 0], q[..., 1] = -8, 7                           # the group's extremes, as the quantizer makes them
    d = (torch.rand(8, 2, 1, generator=gen) * 0.03).half().float()
    w = (q * d).reshape(8, 64)                             # GGUF Q4_0: d * (q - 8) with an fp16 d
    grid = Grid4.of(w)
    assert grid is not None and torch.equal(grid.dense(), w)


def test_grid8_rebuilds_a_q8_0_weight_bit_for_bit():
    w = snap_to_q8_0(torch.randn(40, 64, generator=torch.Generator().manual_seed(2)))
    grid = Grid8.of(w)
    assert grid is not None and grid.codes.dtype == torch.int8 and grid.scales.shape == (40, 2)
    assert torch.equal(grid.dense(), w)
    assert Grid4.of(w) is None          # 255 levels do not fit 16
    assert Grid8.of(torch.randn(40, 64)) is None


def test_grid_rejects_weights_off_a_grid():
    assert Grid4.of(torch.randn(16, 64)) is None                        # trained fp32 weights
    w = _weight()
    nudged = w.clone()
    nudged[3, 17] = torch.nextafter(nudged[3, 17], torch.tensor(10.0))   # one ulp off in one place
    assert Grid4.of(nudged) is None
    assert Grid4.of(w.to(torch.bfloat16)) is None
    assert Grid4.of(_weight(k=96)[:, :40].contiguous()) is None        # inputs not a multiple of 32
    broken = w.clone()
    broken[0, 0] = float("nan")
    assert Grid4.of(broken) is None


@needs_kernel
def test_the_kernel_builds_on_this_machine():
    assert kernel_available()


@needs_kernel
@pytest.mark.parametrize("wide", ["1", "0"])   # 16 lanes (AVX-512, where the CPU has it) or 8 (AVX2)
@pytest.mark.parametrize("rows", [1, 2, 3, 5, 12, 13, 24, 30])
@pytest.mark.parametrize("bits", [4, 8])
def test_kernel_products_equal_the_dense_products(rows, bits, wide, monkeypatch):
    monkeypatch.setenv("EAGLE_LITE_AVX512", wide)
    raw = torch.randn(80, 192, generator=torch.Generator().manual_seed(3))
    w = snap_to_q4_1(raw) if bits == 4 else snap_to_q8_0(raw)
    grid = grid_of(w)
    assert isinstance(grid, Grid4 if bits == 4 else Grid8)
    x = torch.randn(rows, 192, generator=torch.Generator().manual_seed(rows))
    exact = (x.double() @ w.double().t()).float()
    torch.testing.assert_close(grid(x), exact, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(grid(x[None]), exact[None], rtol=1e-5, atol=1e-5)   # [..., K] inputs


@needs_kernel
@pytest.mark.parametrize("wide", ["1", "0"])
@pytest.mark.parametrize("bits", [4, 8])
def test_the_kernel_multiplies_by_each_weight_rebuilt_bit_for_bit(bits, wide, monkeypatch):
    """Rows of the identity pick out single weights (every other product is a zero): the kernel's rebuild of each
    weight (per weight, or by table lookup of the group's 16 levels) must give the stored fp32 weight exactly."""
    monkeypatch.setenv("EAGLE_LITE_AVX512", wide)
    raw = torch.randn(40, 96, generator=torch.Generator().manual_seed(5))
    w = snap_to_q4_1(raw) if bits == 4 else snap_to_q8_0(raw)
    grid = grid_of(w)
    for rows in (torch.eye(96)[:1], torch.eye(96)[:5], torch.eye(96)[5:37], torch.eye(96)[60:96]):
        picked = rows.argmax(-1)
        assert torch.equal(grid(rows.contiguous()), w.t()[picked])


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.gate_proj, self.up_proj = nn.Linear(64, 96, bias=False), nn.Linear(64, 96, bias=False)
        self.down_proj = nn.Linear(96, 64, bias=True)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


def _grid_block() -> _Block:
    torch.manual_seed(0)
    block = _Block()
    with torch.no_grad():
        for layer in (block.gate_proj, block.up_proj, block.down_proj):
            layer.weight.copy_(snap_to_q4_1(layer.weight))
    return block


@needs_kernel
@pytest.mark.parametrize("rows", [1, 7, 40])
def test_grid_weights_get_the_grid_product_with_the_same_results(rows):
    dense, fast = _grid_block(), _grid_block()
    assert pack_linears(fast) == 3
    assert isinstance(fast.gate_proj.sibling_product.product, cpu_linear._GridProduct)
    assert isinstance(fast.down_proj.cpu_product, cpu_linear._GridProduct)
    x = torch.randn(1, rows, 64)
    with torch.inference_mode():
        torch.testing.assert_close(fast(x), dense(x), rtol=1e-5, atol=1e-5)


def test_without_the_kernel_grid_weights_keep_the_fp32_products(monkeypatch):
    monkeypatch.setattr(grid_linear, "kernel_available", lambda: False)
    dense, block = _grid_block(), _grid_block()
    pack_linears(block)
    assert not any(isinstance(getattr(m, "cpu_product", None), cpu_linear._GridProduct) for m in block.modules())
    x = torch.randn(3, 64)
    with torch.inference_mode():
        torch.testing.assert_close(block(x), dense(x), rtol=1e-5, atol=1e-5)


@needs_kernel
@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_a_q4_1_target_decodes_exactly_like_generate(family):
    from test_engine import eagle_engine

    target = make_target(family, grid=True)
    mlp = target.decoder.layers[0].mlp
    assert isinstance(mlp.down_proj.cpu_product, cpu_linear._GridProduct)
    assert isinstance(target.lm_grid, Grid8)
    prompt = list(range(3, 20))
    ref = reference_greedy(target, prompt, 30)
    cfg = GenerationConfig(max_new_tokens=30, stop_at_eos=False, tree=TreeConfig(depth=4, top_k=4, total_tokens=12))
    assert Engine(target, NoDrafter()).generate(prompt, cfg).token_ids == ref
    engine = eagle_engine(target)
    assert isinstance(engine.drafter.lm_grid, Grid8)
    assert engine.generate(prompt, cfg).token_ids == ref


def test_rounding_a_weight_onto_a_q8_0_grid_stays_within_its_step():
    w = torch.randn(24, 96, generator=torch.Generator().manual_seed(7))
    grid = Grid8.rounded(w)
    assert isinstance(grid, Grid8) and Grid8.of(w) is None          # rounded: not the weight itself
    step = w.view(24, 3, 32).abs().amax(-1, keepdim=True) / 127
    assert ((grid.dense().view(24, 3, 32) - w.view(24, 3, 32)).abs() <= step / 2 + 1e-7).all()
    assert Grid8.rounded(w[:, :40].contiguous()) is None


@needs_kernel
@pytest.mark.parametrize("round_head", [True, False])
def test_the_draft_head_may_run_from_rounded_codes_and_stays_exact(round_head):
    from conftest import eagle_drafter

    from eagle_lite.heads.draft import DraftHead

    target = make_target("llama")
    torch.manual_seed(0)
    drafter = eagle_drafter(target, DraftHead.for_target(target), round_head=round_head)
    products = [m.cpu_product if hasattr(m, "cpu_product") else m.sibling_product.product
                for m in drafter.head.modules() if isinstance(m, nn.Linear)]
    assert all(isinstance(p, cpu_linear._GridProduct) == round_head for p in products) and products
    prompt = list(range(3, 20))
    cfg = GenerationConfig(max_new_tokens=30, stop_at_eos=False, tree=TreeConfig(depth=3, top_k=3, total_tokens=8))
    assert Engine(target, drafter).generate(prompt, cfg).token_ids == reference_greedy(target, prompt, 30)


def test_a_lock_left_by_a_killed_build_is_removed_and_a_fresh_one_kept(tmp_path, monkeypatch, caplog):
    import os
    import time

    from eagle_lite.kernels import native

    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    lock = native.build_dir() / "lock"
    assert lock.parent.parent == tmp_path and lock.parent.name == native.extension_name()
    lock.parent.mkdir()
    lock.touch()
    native._clear_stale_lock()                     # a build may be running: keep it, and say what to do
    assert lock.exists() and "delete that file" in caplog.text
    old = time.time() - native.STALE_LOCK_SECONDS - 60
    os.utime(lock, (old, old))
    native._clear_stale_lock()                     # no build runs this long: torch would wait forever
    assert not lock.exists() and "interrupted build" in caplog.text


def test_the_native_build_is_keyed_by_its_code_not_by_the_checkout(tmp_path):
    import os
    import shutil

    from eagle_lite.kernels import native

    a, b = (shutil.copytree(native.CSRC, tmp_path / clone / "eagle_lite" / "csrc") for clone in ("a", "b"))
    assert native.build_key(a) == native.build_key(b) == native.build_key(native.CSRC)   # clones share one build
    assert native.extension_name() == f"eagle_lite_native_{native.build_key()}"
    build = tmp_path / "build"
    staged = native.stage_sources(build, [a / s.name for s in native.SOURCES])
    assert [p.name for p in staged] == [s.name for s in native.SOURCES] and (build / "src" / "kernels.h").is_file()
    times = [os.stat(p).st_mtime_ns for p in staged]
    assert native.stage_sources(build, [b / s.name for s in native.SOURCES]) == staged   # the same build command
    assert [os.stat(p).st_mtime_ns for p in staged] == times                            # nothing for ninja to redo
    (b / "kernels.h").write_text((b / "kernels.h").read_text() + "\n// changed\n")
    assert native.build_key(b) != native.build_key(a)                                  # other code, its own build
