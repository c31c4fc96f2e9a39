"""EAGLE-3 heads read several decoder layers of the target (low, middle, high) instead of its last hidden state:
the taps come out of the target's forward on both of its paths, the head drafts from them, and decoding stays
exactly the target's."""
from __future__ import annotations

import pytest
import torch
from conftest import VOCAB, eagle_drafter, make_target, reference_greedy
from test_grid_linear import needs_kernel

from eagle_lite.config import GenerationConfig, TreeConfig
from eagle_lite.decoding.engine import Engine
from eagle_lite.formats import load_head
from eagle_lite.heads.checkpoint import HeadMismatchError, save_head
from eagle_lite.heads.draft import DraftHead, auto_feature_layers
from eagle_lite.tree import DraftTree


@pytest.fixture(scope="module", params=["llama", "qwen2", "llama-q4_1"])
def deep(request):
    """Four-layer targets: the grid one runs its forwards through the fused native stack, the others through
    the model's own forward."""
    family, _, grid = request.param.partition("-")
    return make_target(family, layers=4, grid=bool(grid))


def test_taps_are_the_layers_outputs_on_either_path(deep):
    ids = torch.tensor([5, 9, 2, 7, 11])
    with torch.inference_mode():
        own = deep.model.model(input_ids=ids[None], output_hidden_states=True).hidden_states
        cache = deep.new_cache(16)
        _, hidden, taps = deep.forward(ids[:2], cache, taps=(2, 0))
        cache.commit(2)
        tree = DraftTree(ids[2:], [-1, 0, 1])  # a chain, read as a tree
        _, hidden2, taps2 = deep.forward(tree.tokens, cache, tree.ancestors, tree.depths, taps=(2, 0))
    want = torch.cat([own[3][0], own[1][0]], dim=-1)  # in the order asked; hidden_states[i + 1] is layer i's output
    got = torch.cat([taps, taps2])
    assert got.shape == (5, 2 * deep.hidden_size)
    assert torch.allclose(got, want, rtol=1e-4, atol=1e-4 * float(want.abs().max()))
    assert torch.allclose(torch.cat([hidden, hidden2]), own[-1][0], rtol=1e-4, atol=1e-4)
    assert (deep.accelerated.stack is not None) == ("q4_1" in deep.name)  # both paths are covered


@pytest.mark.parametrize("tree", [TreeConfig(depth=4, top_k=3, total_tokens=10),
                                  TreeConfig(depth=3, top_k=2, total_tokens=4, lookup=6)], ids=["tree", "lookup"])
def test_eagle3_head_decodes_exactly_the_targets_greedy_output(deep, tree):
    torch.manual_seed(0)
    head = DraftHead.for_target(deep, feature_layers=auto_feature_layers(4))
    assert head.feature_layers == (0, 1, 2) and head.fuse.in_features == 3 * deep.hidden_size
    engine = Engine(deep, eagle_drafter(deep, head))
    prompt = torch.randint(VOCAB, (23,), generator=torch.Generator().manual_seed(3)).tolist()
    result = engine.generate(prompt, GenerationConfig(max_new_tokens=40, tree=tree, stop_at_eos=False))
    assert result.token_ids == reference_greedy(deep, prompt, 40)


def test_the_head_reads_its_own_taps_not_the_last_hidden_state(deep):
    """The features reaching the drafter are the taps: a drafter that records them sees len(taps) * H columns."""
    torch.manual_seed(0)
    drafter = eagle_drafter(deep, DraftHead.for_target(deep, feature_layers=(0, 2)))
    seen = []
    propose = drafter.propose
    drafter.propose = lambda inp, tree: (seen.append(inp.hidden.shape), propose(inp, tree))[1]
    Engine(deep, drafter).generate([3, 4, 5, 6], GenerationConfig(max_new_tokens=8, stop_at_eos=False))
    assert seen and all(shape[1] == 2 * deep.hidden_size for shape in seen)


def test_feature_layers_round_trip_and_are_checked_against_the_target(deep, tmp_path):
    torch.manual_seed(0)
    head = DraftHead.for_target(deep, feature_layers=(0, 2))
    save_head(head, tmp_path / "head", deep)
    loaded = load_head(tmp_path / "head", deep)
    assert loaded.feature_layers == (0, 2)
    assert torch.equal(loaded.fuse.weight, head.fuse.weight.to(torch.bfloat16).to(loaded.fuse.weight.dtype))
    shallow = make_target("llama")  # two layers: layer 2 does not exist
    shallow.fingerprint = deep.fingerprint  # passes the target check: only its depth differs
    with pytest.raises(HeadMismatchError, match=r"reads the outputs of decoder layers \[0, 2\].*has 2 layers"):
        load_head(tmp_path / "head", shallow)
    with pytest.raises(ValueError, match="two or more decoder layers"):
        DraftHead.for_target(deep, feature_layers=(1,))
    with pytest.raises(ValueError, match="from 0 to 2"):
        DraftHead.for_target(deep, feature_layers=(0, 3))


def test_auto_feature_layers_pick_low_middle_and_high():
    assert auto_feature_layers(30) == (2, 15, 27)   # SmolLM2
    assert auto_feature_layers(32) == (2, 16, 29)   # EAGLE-3 on an 8B Llama
    assert auto_feature_layers(4) == (0, 1, 2)
    with pytest.raises(ValueError, match="too few to tap"):
        auto_feature_layers(2)


def eagle3_head(target) -> DraftHead:
    """A random head of the published EAGLE-3 layout: fc over three taps, its own norm and lm_head over a draft
    vocabulary."""
    torch.manual_seed(1)
    return DraftHead.for_target(target, torch.arange(8, VOCAB), feature_layers=(0, 1, 2), design="eagle3")


def eagle3_drafter(target, round_head: bool = True):
    """The head drafter of method eagle for `eagle3_head`, its products from rounded codes (round_head) or from its
    fp32 weights."""
    from eagle_lite.drafters.eagle import EagleDrafter

    return EagleDrafter(target, eagle3_head(target), round_head=round_head)


def draft_rows(drafter) -> tuple[torch.Tensor, torch.Tensor]:
    """A catch-up over 6 pairs of taps [6, 3H] and tokens, then a tree step of three children of the last: the
    head's predicted features [9, H] and its logits after the root and each child [4, V_draft]."""
    target, head = drafter.target, drafter.head
    g = torch.Generator().manual_seed(5)
    taps = torch.randn(6, 3 * target.hidden_size, generator=g)
    tokens, children = torch.randint(VOCAB, (6,), generator=g), torch.randint(VOCAB, (3,), generator=g)
    drafter.reset(64)
    with torch.inference_mode():
        h = head.step(taps, target.embed_tokens(tokens), drafter.cache, torch.arange(6),
                      torch.ones(6, 6, dtype=torch.bool).tril_())
        drafter.cache.commit(6)
        tree = head.step(h[[-1, -1, -1]], target.embed_tokens(children), drafter.cache, torch.full((3,), 6),
                         torch.eye(3, dtype=torch.bool))
        return torch.cat([h, tree]), drafter._logits(torch.cat([h[-1:], tree]))


@needs_kernel
def test_the_accelerated_eagle3_head_drafts_what_its_torch_path_does_and_decodes_exactly():
    """Like the shipped head's, an EAGLE-3 head runs its fc over the taps, its 2H-wide q/k/v, o, gate/up, down and
    its own lm_head from Q8_0 codes rounded from its weights, its norms natively and its layer as the native op.
    That moves its logits by no more than the rounding, so it proposes the plain fp32 head's tokens wherever the
    rounding cannot swap them, and decoding with it is the target's greedy output."""
    from eagle_lite.kernels import cpu_linear
    from eagle_lite.kernels.fused_layer import running_fused
    from eagle_lite.kernels.grid_linear import Grid8

    target = make_target("llama", layers=4, grid=True)
    fast, plain = eagle3_drafter(target), eagle3_drafter(target, round_head=False)
    parts = running_fused(fast.head.layer)
    assert parts is not None and parts.wide and running_fused(plain.head.layer) is None
    linears = [fast.head.fc, fast.head.layer.self_attn.q_proj, fast.head.layer.mlp.down_proj]
    assert all(isinstance(getattr(m, "cpu_product", None) or m.sibling_product.product, cpu_linear._GridProduct)
               for m in linears)
    assert isinstance(fast.lm_grid, Grid8) and plain.lm_grid is None
    h_fast, fast_logits = draft_rows(fast)
    h_plain, plain_logits = draft_rows(plain)
    moved = float((fast_logits - plain_logits).abs().max())
    assert 0 < moved <= 0.02 * float(plain_logits.abs().max())          # rounded, by a rounding's worth
    torch.testing.assert_close(h_fast, h_plain, rtol=0.02, atol=0.02 * float(h_plain.abs().max()))
    top = plain_logits.topk(2, dim=-1).values
    clear = (top[:, 0] - top[:, 1]) > 2 * moved                         # no rounding of this size swaps these
    assert clear.any()
    assert torch.equal(fast_logits.argmax(-1)[clear], plain_logits.argmax(-1)[clear])
    prompt = torch.randint(VOCAB, (23,), generator=torch.Generator().manual_seed(3)).tolist()
    for tree in (TreeConfig(depth=4, top_k=3, total_tokens=10), TreeConfig(depth=1, top_k=1, total_tokens=1, lookup=4)):
        engine = Engine(target, eagle_drafter(target, eagle3_head(target)))
        result = engine.generate(prompt, GenerationConfig(max_new_tokens=40, tree=tree, stop_at_eos=False))
        assert result.token_ids == reference_greedy(target, prompt, 40)
