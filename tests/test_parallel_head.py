"""The parallel-drafting head (DraftHead.parallel, P-EAGLE): what training unrolls is what drafting computes, the
draft is one head forward, output stays the target's (greedy token for token, sampling in law), and the head
saves, loads and trains as any other."""
from __future__ import annotations

import pytest
import torch
from conftest import continuation_tv, eagle_drafter, make_target, reference_greedy
from test_eagle_sampling import SHAPES, TEMPERATURE, Q, assert_exact, decode_pairs, exact_pairs

from eagle_lite.config import GenerationConfig, SamplingConfig, TreeConfig
from eagle_lite.decoding.engine import Engine
from eagle_lite.drafters import eagle_tree as eagle_module
from eagle_lite.heads.checkpoint import load_native_head as load_head
from eagle_lite.heads.checkpoint import save_head
from eagle_lite.heads.draft import DraftHead
from eagle_lite.tree import attention_mask
from eagle_lite_wing.parallel import rows_by_depth
from trainers.objective import Pairs, unroll

V = Q.shape[0]
DEEP = {}


def target_for(design: str, llama):
    """The 2-layer llama for EAGLE-1 heads; a 4-layer one (three layers to tap) for EAGLE-3 heads."""
    if design == "eagle":
        return llama
    if "t" not in DEEP:
        DEEP["t"] = make_target(layers=4)
    return DEEP["t"]


def parallel_head(target, k: int = 4, design: str = "eagle", seed: int = 0) -> DraftHead:
    torch.manual_seed(seed)
    taps = (0, 1, 2) if design == "eagle3" else ()
    head = DraftHead.for_target(target, feature_layers=taps, design=design, parallel=k)
    with torch.no_grad():        # mask vectors of the features' scale, so that the rows draft something
        head.mask_hidden.normal_()
        head.mask_embed.normal_()
    return head.eval()


@pytest.mark.parametrize("design", ["eagle", "eagle3"])
def test_training_unroll_is_the_one_forward_drafting_computes(llama, design):
    """Step k at position t of `unroll` equals row k of the forward drafting runs from root t - k: the real pairs
    up to the root, then k mask rows."""
    llama = target_for(design, llama)
    head = parallel_head(llama, 4, design)
    width, hidden = head.input_width, llama.config.hidden_size
    n = 12
    g = torch.Generator().manual_seed(1)
    pairs = Pairs(hidden=torch.randn(1, n, width, generator=g), embeds=torch.randn(1, n, hidden, generator=g),
                  positions=torch.arange(n)[None], segment=torch.ones(1, n, dtype=torch.long),
                  target=torch.zeros(1, n, hidden), weight=torch.ones(1, n, dtype=torch.bool))
    with torch.no_grad():
        preds = unroll(head, pairs, 4)
        for root in (3, 7):
            for k in range(1, 4):
                mask_h, mask_e = head.mask_rows(k, torch.float32)
                x = torch.cat([pairs.hidden[0, :root + 1], mask_h])
                e = torch.cat([pairs.embeds[0, :root + 1], mask_e])
                rows = root + 1 + k
                out = head(x[None], e[None], torch.arange(rows)[None],
                           attention_mask(0, torch.ones(rows, rows, dtype=torch.bool).tril()))
                torch.testing.assert_close(out[0, -1], preds[k][0, root + k], atol=1e-5, rtol=1e-4)


def test_the_draft_is_one_head_forward(llama):
    """A depth-4 draft from a K=4 head: one catch-up forward with its 3 mask rows, no tree forwards."""
    head = parallel_head(llama, 4)
    drafter = eagle_drafter(llama, head)
    calls = []
    forward = head.step_packed
    head.step_packed = lambda blocks: calls.append([b[0].shape[0] for b in blocks]) or forward(blocks)
    cfg = GenerationConfig(max_new_tokens=12, tree=TreeConfig(depth=4, top_k=2, total_tokens=8, lookup=0),
                           stop_at_eos=False)
    out = Engine(llama, drafter).generate([5, 6, 7, 8, 9], cfg)
    steps = len(out.stats.accept_lengths)
    assert len(calls) == steps                          # one head forward a draft
    accepted = [1] + out.stats.accept_lengths[:-1]      # the pairs each catch-up reads: the last step's tokens
    assert [c[0] for c in calls[1:]] == [a + 3 for a in accepted[1:]], (calls, out.stats.accept_lengths)


@pytest.mark.parametrize("tree", [TreeConfig(depth=4, top_k=1, total_tokens=4, lookup=0),
                                  TreeConfig(depth=3, top_k=3, total_tokens=8, lookup=0),
                                  TreeConfig(depth=6, top_k=2, total_tokens=10, lookup=3),
                                  TreeConfig(depth=6, top_k=1, total_tokens=6, lookup=0),
                                  TreeConfig(depth=2, top_k=4, total_tokens=6, lookup=4, min_prob=0.05)],
                         ids=["chain", "tree", "deeper than K, graft", "a chain longer than K", "min_prob, graft"])
@pytest.mark.parametrize("design", ["eagle", "eagle3"])
def test_greedy_output_is_the_targets(llama, tree, design):
    llama = target_for(design, llama)
    head = parallel_head(llama, 4, design)
    cfg = GenerationConfig(max_new_tokens=32, tree=tree, stop_at_eos=False)
    engine = Engine(llama, eagle_drafter(llama, head))
    for prompt in ([5, 6, 5, 6, 5, 6, 5], list(range(20, 60))):
        assert engine.generate(prompt, cfg).token_ids == reference_greedy(llama, prompt, 32)


def per_depth_tree(root: int, shape: TreeConfig, sampling: SamplingConfig, g: torch.Generator):
    """The sampled tree a parallel head drafts: depth d's children from one distribution, whatever the parent
    (here Q's rows root, root+1, ... as the head's rows)."""
    logits = torch.stack([Q[(root + d) % V] for d in range(max(shape.depth, 1))]).log()
    return eagle_module.grow_tree(root, logits[:1], rows_by_depth(logits), shape, sampling, g, None, V)


@pytest.mark.parametrize("shape", SHAPES.values(), ids=SHAPES.keys())
def test_per_depth_trees_keep_the_targets_law(shape):
    counts, per_step = decode_pairs(lambda root, g: per_depth_tree(root, shape, TEMPERATURE, g), TEMPERATURE)
    assert_exact(counts, exact_pairs(TEMPERATURE), sum(counts.values()))
    assert per_step > 1.0


def test_engine_sampling_with_a_parallel_head_matches_the_target(llama):
    sampling = SamplingConfig(temperature=0.8, top_k=4)
    prompt = [5, 6, 5, 6, 5, 6, 5]
    engine = Engine(llama, eagle_drafter(llama, parallel_head(llama, 3), draft_sampling="q"))
    tree = TreeConfig(depth=3, top_k=2, total_tokens=4, lookup=3)
    assert continuation_tv(llama, engine, prompt, sampling, tree) < 0.12


def test_a_parallel_head_saves_and_loads_with_its_mask_rows(llama, tmp_path):
    llama = target_for("eagle3", llama)
    head = parallel_head(llama, 5, "eagle3")
    folder = save_head(head, tmp_path / "head", llama, dtype=torch.float32)
    loaded = load_head(folder, llama)
    assert loaded.parallel == 5
    torch.testing.assert_close(loaded.mask_hidden, head.mask_hidden)
    torch.testing.assert_close(loaded.mask_embed, head.mask_embed)
    plain = save_head(DraftHead.for_target(llama), tmp_path / "plain", llama)
    assert load_head(plain, llama).parallel == 0 and load_head(plain, llama).mask_hidden is None


def test_parallel_takes_two_or_more_tokens(llama):
    with pytest.raises(ValueError, match="K >= 2"):
        DraftHead.for_target(llama, parallel=1)


@pytest.mark.parametrize("tree", [TreeConfig(depth=4, top_k=1, total_tokens=4), TreeConfig(depth=3, top_k=3,
                                  total_tokens=8), TreeConfig(depth=6, top_k=2, total_tokens=7, min_prob=0.01),
                                  TreeConfig(depth=6, top_k=1, total_tokens=6)],
                         ids=["chain", "tree", "deeper than K, min_prob", "a chain longer than K"])
@pytest.mark.parametrize("design", ["eagle", "eagle3"])
def test_the_static_step_drafts_with_a_parallel_head_and_stays_exact(llama, tree, design):
    from eagle_lite.pipeline import static_engine_for

    target = target_for(design, llama)
    static = static_engine_for(target, parallel_head(target, 4, design))
    cfg = GenerationConfig(max_new_tokens=30, tree=tree, stop_at_eos=False)
    for prompt in ([5, 6, 5, 6, 5, 6, 5], list(range(20, 60))):
        result = static.generate(prompt, cfg)
        assert result.token_ids == reference_greedy(target, prompt, 30)
        assert result.stats.target_forwards == 1 + len(result.stats.accept_lengths)


def test_the_static_steps_parallel_tree_is_the_drafters(llama):
    """The static step's mask rows and per-level children propose the tree drafters/eagle.py grows from the same
    head's K distributions."""
    from test_static_step import first_trees

    head = parallel_head(llama, 4)
    static, want = first_trees(llama, head, TreeConfig(depth=4, top_k=3, total_tokens=10), [4, 8, 15, 16, 23, 42, 7])
    n = len(want)
    assert n == 11
    assert static.tokens[:n].tolist() == want.tokens.tolist()
    assert static.parents[1:n].tolist() == want.parents[1:]
    assert torch.equal(static.depths[:n], want.depths)


def test_export_writes_vllms_p_eagle_layout_and_loads_back(llama, tmp_path):
    """--format eagle3: mask_hidden, pard_token and the head's own embed_tokens (the target's, with the mask
    embedding at pard_token's row), as vLLM's parallel drafting reads them; loaded back, the same drafts."""
    import json

    from safetensors.torch import load_file

    from eagle_lite.formats import load_head as load_any
    from eagle_lite.formats.eagle3 import pard_token, write_eagle3

    target = target_for("eagle3", llama)
    head = parallel_head(target, 4, "eagle3")
    notes = write_eagle3(head, target, tmp_path / "out", {"target": target.fingerprint()}, torch.float32)
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    tensors = load_file(tmp_path / "out" / "model.safetensors")
    pard = config["pard_token"]
    assert pard == pard_token(target) and "parallel_drafting" in notes[0]
    torch.testing.assert_close(tensors["mask_hidden"], head.mask_hidden.detach())
    torch.testing.assert_close(tensors["embed_tokens.weight"][pard], head.mask_embed.detach())
    others = torch.arange(target.vocab_size) != pard
    torch.testing.assert_close(tensors["embed_tokens.weight"][others], target.embed_tokens.weight[others])
    loaded = load_any(tmp_path / "out", target)
    assert loaded.parallel == 4
    cfg = GenerationConfig(max_new_tokens=24, tree=TreeConfig(depth=4, top_k=2, total_tokens=6, lookup=0),
                           stop_at_eos=False)
    runs = [Engine(target, eagle_drafter(target, h)).generate(list(range(30, 50)), cfg) for h in (head, loaded)]
    assert runs[0].token_ids == runs[1].token_ids == reference_greedy(target, list(range(30, 50)), 24)
    assert runs[0].stats.accept_lengths == runs[1].stats.accept_lengths


def test_the_eagle1_layout_and_other_engines_refuse_a_parallel_head(llama, tmp_path):
    from eagle_lite.formats.eagle import write_eagle
    from eagle_lite.formats.eagle3 import write_eagle3

    with pytest.raises(ValueError, match="P-EAGLE.*EAGLE-3"):
        write_eagle(parallel_head(llama, 4), llama, tmp_path / "a", {})
    target = target_for("eagle3", llama)
    with pytest.raises(ValueError, match="--engine speculators has no place"):
        write_eagle3(parallel_head(target, 4, "eagle3"), target, tmp_path / "b", {}, engine="speculators")
