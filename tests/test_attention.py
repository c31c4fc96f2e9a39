"""Attention backends: each one equals softmax(QK^T/sqrt(d) + mask) V on tree masks, and a target's verify
logits are the same whichever backend runs them."""
from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch
from conftest import VOCAB, make_target, reference_greedy
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from eagle_lite.kernels import attention
from eagle_lite.kernels.attention import (
    KEYS,
    BackendUnavailableError,
    dense_attention,
    merge_lse,
    prefix_attention,
    resolve_backend,
    select_attention,
    split_attention,
)
from eagle_lite.targets.model import Target
from eagle_lite.tree import DraftTree, attention_mask

HEADS, KV_HEADS, HEAD_DIM = 8, 2, 16
CPU_BACKENDS = ["sdpa", "gqa", "flex", "lse_merge"]  # 'flash' needs flash-attn and CUDA: see the gpu tests


def reference_attention(q, k, v, mask, scale):
    """The definition, with nothing shared with the code under test: repeat kv heads, additive -inf mask."""
    rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)  # B H S D
    scores = q @ k.transpose(-1, -2) * scale                                # B H T S
    if mask is not None:
        scores = scores + torch.zeros_like(scores).masked_fill(~mask, float("-inf"))
    return torch.softmax(scores, dim=-1) @ v                                # B H T D


def random_tree_mask(prefix_len: int, n_nodes: int, seed: int, device="cpu") -> torch.Tensor:
    """[1, 1, N, prefix + N]: a random tree (random parents) under a fully visible prefix."""
    g = torch.Generator().manual_seed(seed)
    parents = [-1] + [int(torch.randint(i, (1,), generator=g)) for i in range(1, n_nodes)]
    tree = DraftTree(torch.zeros(n_nodes, dtype=torch.long), parents)
    return attention_mask(prefix_len, tree.ancestors).to(device)


def random_qkv(n_nodes: int, prefix_len: int, seed: int, dtype=torch.float32, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    s = prefix_len + n_nodes
    q = torch.randn(1, HEADS, n_nodes, HEAD_DIM, generator=g, dtype=dtype)
    k = torch.randn(1, KV_HEADS, s, HEAD_DIM, generator=g, dtype=dtype)
    v = torch.randn(1, KV_HEADS, s, HEAD_DIM, generator=g, dtype=dtype)
    return q.to(device), k.to(device), v.to(device)


def run_registered(backend: str, q, k, v, mask, scale):
    """Call the function transformers would call for this backend; returns [B, H, T, D]."""
    attention._register()
    module = SimpleNamespace(num_key_value_groups=q.shape[1] // k.shape[1], is_causal=True, training=False)
    out, weights = ALL_ATTENTION_FUNCTIONS[KEYS[backend]](module, q, k, v, mask, dropout=0.0, scaling=scale)
    assert weights is None and out.shape == (q.shape[0], q.shape[2], q.shape[1], q.shape[3])  # B T H D
    return out.transpose(1, 2)


CASES = [(prefix, n, seed) for prefix in (0, 1, 37) for n, seed in ((1, 0), (6, 1), (24, 2))]


@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize("prefix_len,n_nodes,seed", CASES)
def test_backend_equals_dense_reference(backend, prefix_len, n_nodes, seed):
    q, k, v = random_qkv(n_nodes, prefix_len, seed)
    mask = random_tree_mask(prefix_len, n_nodes, seed)
    scale = 1 / math.sqrt(HEAD_DIM)
    out = run_registered(backend, q, k, v, mask, scale)
    torch.testing.assert_close(out, reference_attention(q, k, v, mask, scale), atol=1e-5, rtol=1e-5)


def _native_or_skip():
    from eagle_lite.kernels.native import kernel_available

    if not kernel_available():
        pytest.skip("eagle_lite's native kernels do not build here")


@pytest.mark.parametrize("prefix_len,n_nodes,seed", [(0, 1, 0), (1, 6, 1), (37, 8, 2), (203, 5, 4), (0, 7, 5)])
@pytest.mark.parametrize("masked", [True, False])
def test_native_tree_attention_equals_dense_reference(prefix_len, n_nodes, seed, masked, monkeypatch):
    """gqa's native loop (CPU, fp32, inference, <= 8 queries), with the cache's strided k/v views."""
    _native_or_skip()
    calls = []
    kernel = torch.ops.eagle_lite.tree_attention
    monkeypatch.setattr(torch.ops.eagle_lite, "tree_attention", lambda *a: calls.append(1) or kernel(*a), raising=False)
    g = torch.Generator().manual_seed(seed)
    s = prefix_len + n_nodes
    q = torch.randn(1, 9, n_nodes, 64, generator=g)
    cache = torch.randn(2, 1, 3, s + 50, 64, generator=g)               # StaticKVCache's layout, spare slots
    k, v = cache[0, :, :, :s], cache[1, :, :, :s]
    mask = random_tree_mask(prefix_len, n_nodes, seed) if masked else None
    reference = reference_attention(q, k, v, mask if masked else torch.ones(n_nodes, s, dtype=torch.bool)
                                    .tril_(prefix_len).view(1, 1, n_nodes, s), 0.125)
    with torch.inference_mode():
        out = run_registered("gqa", q, k, v, mask, 0.125)
    torch.testing.assert_close(out, reference, atol=1e-5, rtol=1e-5)
    assert calls == [1]
    monkeypatch.setenv("EAGLE_LITE_AVX512", "0")     # value sums 8 lanes wide: the same FMAs, lane by lane
    with torch.inference_mode():
        assert torch.equal(run_registered("gqa", q, k, v, mask, 0.125), out)


def test_more_queries_than_the_native_loop_takes_go_to_sdpa(monkeypatch):
    _native_or_skip()
    calls = []
    monkeypatch.setattr(torch.ops.eagle_lite, "tree_attention", lambda *a: calls.append(1), raising=False)
    q, k, v = random_qkv(attention.NATIVE_MAX_QUERIES + 1, 20, seed=6)
    mask = random_tree_mask(20, attention.NATIVE_MAX_QUERIES + 1, seed=6)
    with torch.inference_mode():
        out = run_registered("gqa", q, k, v, mask, 0.25)
    torch.testing.assert_close(out, reference_attention(q, k, v, mask, 0.25), atol=1e-5, rtol=1e-5)
    assert calls == []


def test_a_prompt_from_an_empty_cache_runs_sdpas_causal_kernel(monkeypatch):
    """gqa turns the plain causal mask of a fresh prompt into is_causal (skipping the hidden half); any other
    mask of the same shape (a tree, padding) keeps the mask."""
    sdpa, calls = torch.nn.functional.scaled_dot_product_attention, []

    def spy(*args, **kwargs):
        calls.append((kwargs.get("attn_mask") is None, kwargs.get("is_causal")))
        return sdpa(*args, **kwargs)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", spy)
    n = attention.NATIVE_MAX_QUERIES + 12
    q, k, v = random_qkv(n, 0, seed=7)
    causal = attention_mask(0, torch.ones(n, n, dtype=torch.bool).tril_())
    tree = random_tree_mask(0, n, seed=7)
    with torch.inference_mode():
        for mask, fast in ((causal, True), (tree, False)):
            calls.clear()
            out = run_registered("gqa", q, k, v, mask, 0.25)
            torch.testing.assert_close(out, reference_attention(q, k, v, mask, 0.25), atol=1e-5, rtol=1e-5)
            assert calls == [(True, True)] if fast else calls == [(False, False)]


@pytest.mark.parametrize("backend", ["gqa", "flex", "lse_merge"])
def test_no_mask_means_causal_over_the_cache(backend):
    """Plain calls (generate()) may pass no mask: the T queries are the last T of the S keys."""
    q, k, v = random_qkv(5, 9, seed=3)
    causal = torch.ones(5, 14, dtype=torch.bool).tril_(9).view(1, 1, 5, 14)
    out = run_registered(backend, q, k, v, None, 0.3)
    torch.testing.assert_close(out, reference_attention(q, k, v, causal, 0.3), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("prefix_len,n_nodes,seed", CASES)
def test_lse_merge_is_exact_in_float64(prefix_len, n_nodes, seed):
    q, k, v = random_qkv(n_nodes, prefix_len, seed, dtype=torch.float64)
    mask = random_tree_mask(prefix_len, n_nodes, seed)
    out = split_attention(q, k, v, mask, scale=0.25)
    assert out.dtype == torch.float64
    torch.testing.assert_close(out, reference_attention(q, k, v, mask, 0.25), atol=1e-12, rtol=1e-12)


def test_merge_lse_of_any_key_split_equals_attention_over_all_keys():
    q, k, v = random_qkv(7, 30, seed=4, dtype=torch.float64)
    out_all, lse_all = dense_attention(q, k, v, None, 0.5)
    out_a, lse_a = dense_attention(q, k[:, :, :11], v[:, :, :11], None, 0.5)
    out_b, lse_b = dense_attention(q, k[:, :, 11:], v[:, :, 11:], None, 0.5)
    out, lse = merge_lse(out_a, lse_a, out_b, lse_b)
    torch.testing.assert_close(out, out_all, atol=1e-12, rtol=1e-12)
    torch.testing.assert_close(lse, lse_all, atol=1e-12, rtol=1e-12)
    torch.testing.assert_close(out_all, reference_attention(q, k, v, None, 0.5), atol=1e-12, rtol=1e-12)


def test_prefix_kernel_returns_the_log_sum_exp():
    """The CPU flash kernel (with GQA rows packed per kv head) against the plain-torch one."""
    q, k, v = random_qkv(6, 40, seed=5)
    out, lse = prefix_attention(q, k, v, 0.25)
    ref_out, ref_lse = dense_attention(q, k, v, None, 0.25)
    torch.testing.assert_close(out, ref_out, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse, ref_lse, atol=1e-5, rtol=1e-5)


def test_split_refuses_a_mask_that_hides_prefix_keys():
    q, k, v = random_qkv(4, 6, seed=6)
    mask = random_tree_mask(6, 4, seed=6)
    mask[0, 0, 2, 1] = False  # e.g. left padding: the split would silently attend to it
    with pytest.raises(RuntimeError, match="whole prefix"):
        run_registered("lse_merge", q, k, v, mask, 0.25)


# -- choosing ------------------------------------------------------------------------------------------
def test_unknown_backend_names_are_refused():
    with pytest.raises(ValueError, match="unknown attention backend 'fast'.*auto, sdpa, gqa, flex, lse_merge, flash"):
        resolve_backend("fast", "cpu")
    with pytest.raises(ValueError, match="unknown attention backend"):
        Target(make_target().model, attention="eager")


@pytest.mark.skipif(attention.flash_attn_func() is not None, reason="flash-attn is installed")
def test_flash_without_flash_attn_is_a_clear_error():
    with pytest.raises(BackendUnavailableError, match="flash-attn package is not importable.*'lse_merge'"):
        resolve_backend("flash", "cpu")
    with pytest.raises(BackendUnavailableError, match="flash"):
        Target(make_target().model, attention="flash")


def test_auto_never_raises_and_picks_gqa_on_cpu():
    for device in ("cpu", "meta"):
        assert resolve_backend("auto", device) == "gqa"
        assert resolve_backend("AUTO", device, torch.float32) in attention.BACKENDS
    assert resolve_backend("lse_merge", "cpu") == "lse_merge" and resolve_backend("flex", "cpu") == "flex"


def test_default_target_keeps_sdpa():
    target = make_target()
    assert target.model.config._attn_implementation == "sdpa"
    assert select_attention("sdpa", target.model) == "sdpa"


# -- end to end: a tiny random Llama -------------------------------------------------------------------
def verify_logits(target: Target, prefix_len: int, n_nodes: int, seed: int):
    prefix = torch.randint(VOCAB, (prefix_len,), generator=torch.Generator().manual_seed(seed))
    g = torch.Generator().manual_seed(seed + 1)
    parents = [-1] + [int(torch.randint(i, (1,), generator=g)) for i in range(1, n_nodes)]
    tree = DraftTree(torch.randint(VOCAB, (n_nodes,), generator=g), parents)
    cache = target.new_cache(prefix_len + n_nodes)
    with torch.inference_mode():
        if prefix_len:
            target.forward(prefix, cache)
            cache.commit(prefix_len)
        return target.forward(tree.tokens, cache, tree.ancestors, tree.depths, logits_rows=slice(None))


@pytest.mark.parametrize("backend", ["gqa", "flex", "lse_merge"])
@pytest.mark.parametrize("prefix_len,n_nodes", [(0, 9), (1, 5), (37, 24)])
def test_tree_verify_logits_match_sdpa(backend, prefix_len, n_nodes):
    model = make_target("llama").model
    want_logits, want_hidden = verify_logits(Target(model, attention="sdpa"), prefix_len, n_nodes, seed=7)
    target = Target(model, attention=backend)
    assert model.config._attn_implementation == KEYS[backend]
    logits, hidden = verify_logits(target, prefix_len, n_nodes, seed=7)
    torch.testing.assert_close(logits, want_logits, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(hidden, want_hidden, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("backend", ["gqa", "flex", "lse_merge"])
def test_generate_through_a_registered_backend_is_unchanged(backend):
    """transformers' own generate() builds masks through the mask function registered beside the backend."""
    model = make_target("llama").model
    want = reference_greedy(Target(model, attention="sdpa"), [5, 17, 3, 9], max_new_tokens=6)
    assert reference_greedy(Target(model, attention=backend), [5, 17, 3, 9], max_new_tokens=6) == want


# -- on a GPU (skipped on CPU; run with -m gpu) ----------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["sdpa", "gqa", "flex", "lse_merge", "flash"])
@pytest.mark.parametrize("prefix_len,n_nodes,seed", CASES)
def test_backend_equals_dense_reference_on_cuda(backend, prefix_len, n_nodes, seed):
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    dtype = torch.bfloat16 if backend == "flash" else torch.float32
    if backend == "flash":
        pytest.importorskip("flash_attn")
    q, k, v = random_qkv(n_nodes, prefix_len, seed, dtype=dtype, device="cuda")
    mask = random_tree_mask(prefix_len, n_nodes, seed, device="cuda")
    out = run_registered(backend, q, k, v, mask, 0.25)
    want = reference_attention(q.float(), k.float(), v.float(), mask, 0.25)
    tol = 2e-2 if dtype == torch.bfloat16 else 1e-5
    torch.testing.assert_close(out.float(), want, atol=tol, rtol=tol)


@pytest.mark.gpu
def test_auto_on_cuda_picks_flash_or_sdpa_kernels_never_a_recompiling_one():
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    want = "flash" if attention.flash_attn_func() is not None else "gqa"
    assert resolve_backend("auto", "cuda", torch.bfloat16) == want
