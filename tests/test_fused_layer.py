"""Whole decoder layers as one native op (fused_layer.py): taken only where they compute what the layer
computes, equal to the library's own forward on chains, trees and the cache, and exact end to end."""
from __future__ import annotations

import contextlib

import pytest
import torch
from conftest import VOCAB, make_target, reference_greedy
from test_feature_layers import draft_rows, eagle3_drafter
from test_grid_linear import needs_kernel

from eagle_lite.config import GenerationConfig, TreeConfig
from eagle_lite.decoding.engine import Engine
from eagle_lite.drafters import NoDrafter
from eagle_lite.kernels import fused_layer
from eagle_lite.targets import model as model_module
from eagle_lite.targets.model import Target
from eagle_lite.tree import DraftTree

pytestmark = needs_kernel


def _fused(target) -> list[bool]:
    return ["forward" in layer.__dict__ and hasattr(layer, "fused_parts") for layer in target.decoder.layers]


def _run(target, blocks):
    """Hidden states of each block (ids, tree or None) run one after another, and the cache they leave."""
    cache = target.new_cache(128)
    outs = []
    with torch.inference_mode():
        for ids, tree in blocks:
            if tree is None:
                _, hidden = target.forward(ids, cache)
                cache.commit(ids.numel())
            else:
                _, hidden = target.forward(tree.tokens, cache, ancestors=tree.ancestors, depths=tree.depths)
                cache.compact(torch.tensor([0, 2]))
            outs.append(hidden)
    return outs, cache


@pytest.mark.parametrize("family", ["llama", "mistral"])
def test_layers_on_a_grid_run_as_one_op_and_match_their_own_forward(family):
    target = make_target(family, grid=True)
    assert all(_fused(target))
    gen = torch.Generator().manual_seed(3)
    tree = DraftTree(tokens=torch.randint(1, VOCAB, (6,), generator=gen), parents=[-1, 0, 0, 1, 1, 2])
    blocks = [(torch.randint(1, VOCAB, (40,), generator=gen), None),   # prefill: past MAX_FUSED_ROWS, own forward
              (torch.randint(1, VOCAB, (5,), generator=gen), None),    # a chain: the op
              (torch.tensor([7]), None),                             # one decoding step: the op
              (None, tree)]                                          # a tree verification: the op with its mask
    assert target.accelerated.stack is not None                                 # all layers fused: the stack runs them
    fused, fused_cache = _run(target, blocks)
    with target.stock():
        assert not any(_fused(target)) and target.accelerated.stack is None
        own, own_cache = _run(target, blocks)
    assert all(_fused(target)) and target.accelerated.stack is not None         # stock() gives them back
    for a, b in zip(fused, own):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
    n = own_cache.length
    assert fused_cache.length == n == 40 + 5 + 1 + 2
    torch.testing.assert_close(fused_cache.keys[..., :n, :], own_cache.keys[..., :n, :], rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(fused_cache.values[..., :n, :], own_cache.values[..., :n, :], rtol=1e-4, atol=1e-5)


def test_layers_that_compute_something_else_keep_their_own_forward():
    qwen2 = make_target("qwen2", grid=True)      # q/k/v biases: the op has none
    assert not any(_fused(qwen2))
    qwen3 = make_target("qwen3", grid=True)      # q/k norms: same projections, other arithmetic
    layer = qwen3.decoder.layers[0]
    assert fused_layer._structured(layer) and fused_layer._LayerParts(layer).complete
    assert not any(_fused(qwen3))                # refused by the probe, not by the layout check
    assert qwen2.accelerated.stack is None and qwen3.accelerated.stack is None
    assert not any(_fused(make_target("llama")))  # fp32 weights off any grid: no codes to run from


def test_a_stack_that_computes_something_else_is_refused(monkeypatch):
    target = make_target("llama", grid=True)
    assert fused_layer.fuse_stack(target.decoder) is not None
    call = fused_layer.FusedStack.__call__
    monkeypatch.setattr(fused_layer.FusedStack, "__call__", lambda self, *a: call(self, *a) * (1 + 1e-3))
    assert fused_layer.fuse_stack(target.decoder) is None


def test_the_stack_runs_few_token_forwards_and_the_model_the_rest(monkeypatch):
    target = make_target("llama", grid=True)
    calls = []
    call = fused_layer.FusedStack.__call__
    monkeypatch.setattr(fused_layer.FusedStack, "__call__",
                        lambda self, *a: calls.append(a[0].numel()) or call(self, *a))
    cache = target.new_cache(128)
    with torch.inference_mode():
        for n in (40, 5, 1):              # a prefill past MAX_FUSED_ROWS, a chain, a step
            target.forward(torch.arange(1, n + 1), cache)
            cache.commit(n)
    assert calls == [5, 1]


def assert_decodes_like_generate(target) -> None:
    """Plain decoding and eagle (a random head) on `target` emit transformers' greedy tokens, 40 of them."""
    from test_engine import eagle_engine

    prompt = list(range(3, 20))
    ref = reference_greedy(target, prompt, 40)
    cfg = GenerationConfig(max_new_tokens=40, stop_at_eos=False, tree=TreeConfig(depth=3, top_k=3, total_tokens=8))
    assert Engine(target, NoDrafter()).generate(prompt, cfg).token_ids == ref
    assert eagle_engine(target).generate(prompt, cfg).token_ids == ref


def test_without_the_kernel_nothing_is_fused(monkeypatch):
    monkeypatch.setattr(fused_layer, "kernel_available", lambda: False)
    assert not any(_fused(make_target("llama", grid=True)))


@pytest.mark.parametrize("wide", ["1", "0"])   # grid products 16 lanes wide where the CPU has AVX-512, or 8
@pytest.mark.parametrize("family", ["llama", "mistral", "qwen3"])
def test_fused_targets_decode_exactly_like_generate(family, wide, monkeypatch):
    monkeypatch.setenv("EAGLE_LITE_AVX512", wide)

    target = make_target(family, grid=True)
    assert_decodes_like_generate(target)


def test_the_models_own_forward_reaches_the_op_under_its_cache_keyword(monkeypatch):
    """Without the stack, the model's forward calls each fused layer itself, passing the cache as `cache` (transformers
    >= 5.24) or `past_key_values` (before): a few-token forward must still run the op, not the layer's own forward."""
    target = make_target("llama", grid=True)
    monkeypatch.setattr(target.accelerated, "stack", None)
    calls = []
    for layer in target.decoder.layers:
        parts = layer.fused_parts
        monkeypatch.setattr(layer, "fused_parts", lambda *a, parts=parts: calls.append(a[0].shape[0]) or parts(*a))
    cache = target.new_cache(128)
    with torch.inference_mode():
        for n in (40, 5, 1):              # a prefill past MAX_FUSED_ROWS (own forward), a chain, a step
            target.forward(torch.arange(1, n + 1), cache)
            cache.commit(n)
    assert calls == [5] * len(target.decoder.layers) + [1] * len(target.decoder.layers)


def test_an_eagle3_draft_layer_runs_as_one_op_on_the_codes_its_own_forward_reads():
    """An EAGLE-3 head's layer (attention over [input_layernorm(embeds); hidden_norm(h)], 2H wide) runs as the op,
    given the embeddings beside h: the features, logits and cache entries of a catch-up and a tree step are its own
    forward's over the same rounded codes, and sequences packed into one forward get what each gets alone."""
    drafter = eagle3_drafter(make_target("llama", layers=4, grid=True))
    head = drafter.head
    assert fused_layer.running_fused(head.layer) is not None
    fused = draft_rows(drafter)
    fused_kv = drafter.cache.keys[..., :9, :].clone(), drafter.cache.values[..., :9, :].clone()
    with fused_layer.unfused_layers(head):
        assert fused_layer.running_fused(head.layer) is None
        own = draft_rows(drafter)
        own_kv = drafter.cache.keys[..., :9, :].clone(), drafter.cache.values[..., :9, :].clone()
    for a, b in zip(fused + fused_kv, own + own_kv):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5 * float(b.abs().max()))

    g = torch.Generator().manual_seed(9)
    blocks = []
    for t in (4, 6):
        cache = drafter.sibling()
        cache.reset(32)
        blocks.append((torch.randn(t, 3 * head.config.hidden_size, generator=g), torch.randn(t, head.config.hidden_size,
                       generator=g), cache.cache, torch.arange(t), torch.ones(t, t, dtype=torch.bool).tril_()))
    with torch.inference_mode():
        together = head.step_packed(blocks)
        for block, out in zip(blocks, together):
            block[2].truncate(0)
            torch.testing.assert_close(out, head.step(*block), rtol=1e-4, atol=1e-5)


@needs_kernel
@pytest.mark.parametrize("design", ["eagle", "eagle3"])
def test_a_catch_ups_skipped_rows_write_the_same_keys_and_values_and_the_kept_rows_come_out_unchanged(design):
    """`step_packed` blocks with a skip: the op computes only the skipped rows' keys and values (a catch-up's
    accepted tokens before the root), and gives the other rows what the forward without skips gives them, for
    sequences alone and packed, under a causal mask and under a tree's (to the rounding of the products' sums: a
    product sums a row in another order when it has more rows beside it)."""

    def close(a, b):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6 * float(b.abs().max()))
    from eagle_lite.drafters.eagle import EagleDrafter
    from eagle_lite.heads.draft import DraftHead

    target = make_target("llama", layers=4, grid=True)
    if design == "eagle3":
        drafter = eagle3_drafter(target)
    else:
        drafter = EagleDrafter(target, DraftHead.for_target(target))
    head = drafter.head
    assert fused_layer.running_fused(head.layer) is not None
    width = head.input_width
    g = torch.Generator().manual_seed(3)
    tree = torch.tensor([[1, 0, 0, 0, 0], [1, 1, 0, 0, 0], [1, 0, 1, 0, 0], [1, 1, 0, 1, 0], [1, 0, 1, 0, 1]],
                        dtype=torch.bool)
    shapes = [(7, torch.ones(7, 7, dtype=torch.bool).tril_(), 6), (5, tree, 2), (3, torch.ones(3, 3).tril_().bool(), 0)]
    seqs = [drafter.sibling() for _ in shapes]
    for seq in seqs:
        seq.reset(64)
    blocks = [(torch.randn(t, width, generator=g), torch.randn(t, head.config.hidden_size, generator=g), seq.cache,
               torch.arange(4, 4 + t), visible, skip) for (t, visible, skip), seq in zip(shapes, seqs)]
    with torch.inference_mode():
        for seq in seqs:        # a context of 4 pairs first, so the rows attend over committed slots too
            head.step_packed([(torch.randn(4, width, generator=g), torch.randn(4, head.config.hidden_size,
                                                                                generator=g), seq.cache,
                               torch.arange(4), torch.ones(4, 4, dtype=torch.bool).tril_())])
            seq.cache.commit(4)
        full = head.step_packed([block[:5] for block in blocks])
        kv = [(seq.cache.keys[..., :4 + t, :].clone(), seq.cache.values[..., :4 + t, :].clone())
              for (t, _, _), seq in zip(shapes, seqs)]
        for mode in ("packed", "alone"):
            for seq in seqs:
                seq.cache.keys[..., 4:, :] = 0
                seq.cache.values[..., 4:, :] = 0
            outs = (head.step_packed(blocks) if mode == "packed"
                    else [head.step_packed([block])[0] for block in blocks])
            for (t, _, skip), seq, out, whole, (keys, values) in zip(shapes, seqs, outs, full, kv):
                assert out.shape[0] == t - skip
                close(out, whole[skip:])
                close(seq.cache.keys[..., :4 + t, :], keys)
                close(seq.cache.values[..., :4 + t, :], values)


def gemma3_target(grid: bool = True, window: int = 512) -> Target:
    """A tiny Gemma 3 (q/k norms, norms around the attention and the MLP, GELU-tanh, a sliding and a full layer with
    their own rotary, a scaled tied embedding), its linears Q4_1 and its lm_head Q8_0 (grid), its norms random."""
    from conftest import snap_to_q4_1, snap_to_q8_0
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    torch.manual_seed(0)
    config = Gemma3TextConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                              num_attention_heads=4, num_key_value_heads=1, head_dim=32, query_pre_attn_scalar=32,
                              sliding_window=window, layer_types=["sliding_attention", "full_attention"],
                              max_position_embeddings=512, eos_token_id=None, bos_token_id=None, pad_token_id=0)
    model = Gemma3ForCausalLM(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.normal_(0.0, 0.5)                                      # 1 + w: not all ones
        model.lm_head.weight.normal_(0.0, 0.16)                          # tied: the embedding too (no zero pad row)
        if grid:
            for module in model.model.layers.modules():
                if isinstance(module, torch.nn.Linear):
                    module.weight.copy_(snap_to_q4_1(module.weight))
            model.lm_head.weight.copy_(snap_to_q8_0(model.lm_head.weight))
    return Target(model.eval(), name="tiny-gemma3")


@pytest.mark.parametrize("fused", [True, False])
def test_a_sliding_window_model_runs_its_whole_context_exactly_like_generate(fused, monkeypatch):
    """A tiny Gemma 3 whose sliding layer sees 16 tokens: prompts and answers far longer than the window decode as
    transformers' generate() does (each sliding layer's mask hides what lies past its window, the full layer's sees
    everything), plainly and through trees, through the fused op and through the model's own layers."""
    from test_engine import eagle_engine

    target = gemma3_target(window=16)
    assert target.window == 16 and target.max_context == 512    # its position limit, not the window
    assert target.accelerated.stack is not None
    prompt = [(7 * i) % 90 + 3 for i in range(40)]               # 40 tokens: past the window already
    ref = reference_greedy(target, prompt, 40)
    cfg = GenerationConfig(max_new_tokens=40, stop_at_eos=False, tree=TreeConfig(depth=3, top_k=3, total_tokens=8,
                                                                                 lookup=4))
    run = contextlib.nullcontext() if fused else target.stock()
    with run:
        assert Engine(target, NoDrafter()).generate(prompt, cfg).token_ids == ref
        assert eagle_engine(target).generate(prompt, cfg).token_ids == ref
    # the fixed-shape step gives every layer one mask: it runs such a target within the window, and says so past it
    from eagle_lite.kv_cache import ContextOverflowError
    from eagle_lite.pipeline import static_engine_for

    static = static_engine_for(target, None, "eager")
    short = GenerationConfig(max_new_tokens=8, stop_at_eos=False)
    assert static.generate(prompt[:6], short).token_ids == reference_greedy(target, prompt[:6], 8)
    with pytest.raises(ContextOverflowError, match="within its 16-token sliding window"):
        static.generate(prompt, short)
    # a model with one mask for every layer keeps the window as its context
    monkeypatch.setattr(model_module, "mask_window", lambda config, decoder: None)
    assert gemma3_target(window=16).max_context == 16


@pytest.mark.parametrize("wide", ["1", "0"])
def test_gemma3_layers_run_as_one_op_and_decode_exactly_like_generate(wide, monkeypatch):
    monkeypatch.setenv("EAGLE_LITE_AVX512", wide)
    target = gemma3_target()
    assert all(_fused(target)) and target.accelerated.stack is not None
    assert [p.act for p in target.accelerated.stack.parts] == [1, 1] and target.accelerated.stack.kinds == [
        "sliding_attention", "full_attention"]
    gen = torch.Generator().manual_seed(3)
    tree = DraftTree(tokens=torch.randint(1, VOCAB, (6,), generator=gen), parents=[-1, 0, 0, 1, 1, 2])
    blocks = [(torch.randint(1, VOCAB, (40,), generator=gen), None), (torch.randint(1, VOCAB, (5,), generator=gen),
                                                                      None), (torch.tensor([7]), None), (None, tree)]
    fused, fused_cache = _run(target, blocks)
    with target.stock():
        own, own_cache = _run(target, blocks)
    for a, b in zip(fused, own):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
    n = own_cache.length
    torch.testing.assert_close(fused_cache.keys[..., :n, :], own_cache.keys[..., :n, :], rtol=1e-4, atol=1e-5)
    assert_decodes_like_generate(target)


def test_a_gemma3_layer_whose_extra_norms_the_op_left_out_is_refused(monkeypatch):
    """The probe is what keeps the op honest: an op that skipped the q/k and sandwich norms is not taken."""
    call = fused_layer._LayerParts.__call__
    monkeypatch.setattr(fused_layer._LayerParts, "__call__",
                        lambda self, *a, **k: (setattr(self, "extra", None), call(self, *a, **k))[1])
    target = gemma3_target()
    assert not any(_fused(target)) and target.accelerated.stack is None
