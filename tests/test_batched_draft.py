"""Batched drafting: the EAGLE heads of several sequences propose together (one head forward per tree depth for all of
them, `Engine.step` -> `draft_all` -> `propose_together`) and give the trees each proposes alone."""
from __future__ import annotations

import pytest
import torch
from conftest import VOCAB, eagle_drafter, make_target

from eagle_lite.config import GenerationConfig, SamplingConfig, TreeConfig
from eagle_lite.decoding import engine as engine_module
from eagle_lite.decoding.engine import Engine
from eagle_lite.drafters import EagleOptions, build
from eagle_lite.drafters import eagle as eagle_module
from eagle_lite.heads.draft import DraftHead
from eagle_lite.kernels.native import kernel_available

TREE = TreeConfig(depth=4, top_k=3, total_tokens=8, lookup=4)


@pytest.fixture(scope="module", params=["plain", "fused"])
def batch_target(request):
    """A tiny Llama through transformers' own layers, and one whose layers (and its heads') run as the native op."""
    if request.param == "fused" and not kernel_available():
        pytest.skip("the native kernels do not build here")
    return make_target("llama", seed=3, grid=request.param == "fused", layers=4)


def make_head(target, kind: str) -> DraftHead:
    torch.manual_seed(1)
    if kind == "eagle3":
        return DraftHead.for_target(target, feature_layers=(0, 1, 2), design="eagle3")
    if kind == "taps":   # eagle_lite's own EAGLE-3 variant: the tapped layers fused to one feature
        return DraftHead.for_target(target, feature_layers=(0, 1, 2))
    if kind == "draft_vocab":
        return DraftHead.for_target(target, torch.arange(8, VOCAB))
    return DraftHead.for_target(target)


def prompts(n: int, seed: int = 0) -> list[list[int]]:
    """Prompts of different lengths; the longer ones repeat themselves, so that prompt lookup finds chains."""
    g = torch.Generator().manual_seed(seed)
    return [(torch.randint(VOCAB, (max(3, length // 3),), generator=g).tolist() * 3)[:length]
            for length in (3, 11, 26, 40)[:n]]


class Recorder:
    """Records the trees `draft_all` returns and how many sequences each packed head forward served."""

    def __init__(self, monkeypatch) -> None:
        self.trees: list[list] = []
        self.packed: list[int] = []
        draft_all, answer_all = engine_module.draft_all, eagle_module.HeadCall.answer_all

        def recorded_draft_all(seqs, caps):
            trees = draft_all(seqs, caps)
            self.trees.append(trees)
            return trees

        def recorded_answer_all(calls):
            self.packed.append(len(calls))
            return answer_all(calls)

        monkeypatch.setattr(engine_module, "draft_all", recorded_draft_all)
        monkeypatch.setattr(eagle_module.HeadCall, "answer_all", staticmethod(recorded_answer_all))


@pytest.mark.parametrize("kind,staged", [("eagle", False), ("eagle", True), ("draft_vocab", False),
                                         ("taps", False), ("exact", False),
                                         ("eagle3", False)])
def test_proposing_together_gives_each_tree_alone(batch_target, kind, staged, monkeypatch):
    """Four sequences of different prompt lengths, budgets and step caps (a cap of 1 sits the head out): step after
    step, the trees drafted together are node for node those each sequence's drafter proposes alone, and the
    outputs are each prompt's own greedy generation."""
    target = batch_target
    head = make_head(target, kind)
    configs = [GenerationConfig(max_new_tokens=n, tree=TREE, stop_at_eos=False) for n in (24, 10, 30, 18)]
    ps = prompts(len(configs))

    def new_drafter():   # method eagle (the head and its prompt-lookup graft), or staged
        # "exact": the head's own fp32 weights, so its layer runs as transformers' (over a PackedKVCache when packed)
        options = EagleOptions(head=head, round_head=kind != "exact")
        return build("staged" if staged else "eagle", target, options)

    want = [Engine(target, new_drafter()).generate(p, c).token_ids for p, c in zip(ps, configs)]

    rec = Recorder(monkeypatch)
    batch, alone = Engine(target), Engine(target)
    started = [(batch.begin(p, c, drafter=new_drafter()), alone.begin(p, c, drafter=new_drafter()))
               for p, c in zip(ps, configs)]
    out = [list(first) for (_, first), _ in started]
    running = [(i, together, own) for i, ((together, _), (own, _)) in enumerate(started)]
    caps = [None, 5, None, 1, 3]
    step = 0
    while running:
        step_caps = [caps[(step + i) % len(caps)] for i, _, _ in running]
        rec.trees.clear()
        outs = batch.step([s for _, s, _ in running], step_caps)
        (together,) = rec.trees
        for (i, _, own), cap, new, tree in zip(running, step_caps, outs, together):
            (own_new,) = alone.step([own], [cap])
            (own_tree,) = rec.trees[-1]
            assert tree.tokens.tolist() == own_tree.tokens.tolist(), f"step {step}, sequence {i}"
            assert tree.parents == own_tree.parents, f"step {step}, sequence {i}"
            assert new == own_new
            out[i] += new
        running = [(i, s, own) for i, s, own in running if not s.done]
        step += 1
    assert out == want
    assert max(rec.packed) >= 3   # head forwards did serve several sequences at once


def test_sampled_sequences_draft_alone(monkeypatch):
    """Sampled trees are not batched: each sequence's drafter proposes alone (one sequence per head forward)."""
    target = make_target("llama", seed=3, layers=4)
    head = make_head(target, "eagle")
    rec = Recorder(monkeypatch)
    engine = Engine(target)
    sampling = SamplingConfig(temperature=0.8)
    seqs = [engine.begin(p, GenerationConfig(max_new_tokens=6, tree=TREE, stop_at_eos=False, sampling=sampling,
                                             seed=i), drafter=eagle_drafter(target, head))[0]
            for i, p in enumerate(prompts(3))]
    engine.step(seqs)
    assert rec.packed and max(rec.packed) == 1


def test_a_head_back_from_many_plain_steps_reads_a_window_of_them_at_their_own_positions(batch_target, monkeypatch):
    """A head that sat out more plain steps than `catch_up_window` reads only the last rows of them on its return:
    at their own positions (their keys are those a head that read everything wrote there), the dropped positions a
    hole in its cache; the output stays the target's greedy output, and `reset` keeps no pair past the hole."""
    from eagle_lite.drafters.eagle import EagleDrafter

    target = batch_target
    head = make_head(target, "eagle")
    cfg = GenerationConfig(max_new_tokens=40, tree=TREE, stop_at_eos=False)
    prompt = prompts(4)[2]
    want = Engine(target, EagleDrafter(target, head)).generate(prompt, cfg).token_ids
    calls = []
    answer_all = eagle_module.HeadCall.answer_all

    def recorded(batch):
        calls.append([(c.drafter, c.positions.tolist()) for c in batch])
        return answer_all(batch)

    monkeypatch.setattr(eagle_module.HeadCall, "answer_all", staticmethod(recorded))
    engine = Engine(target)
    runs = {}
    for window in (None, 4):
        monkeypatch.setattr(EagleDrafter, "catch_up_window", window)
        drafter = EagleDrafter(target, head)
        seq, out = engine.begin(prompt, cfg, drafter=drafter)
        out, steps = list(out), 0
        while not seq.done:
            sat_out = 3 <= steps < 13                       # ten plain steps, then the head again
            before = drafter.cache.length
            calls.clear()
            out += engine.step([seq], [1 if sat_out else None])[0]
            if steps == 13:
                caught = next(positions for d, positions in calls[0] if d is drafter)
                runs[window] = (before, caught, drafter.cache.length, drafter.cache.keys.clone())
            steps += 1
        assert out == want, f"window {window}"
    (full_before, full_pos, full_after, full_keys), (before, pos, after, keys) = runs[None], runs[4]
    assert before == full_before                             # the same pairs up to the sit-out
    assert pos == full_pos[-len(pos):] and len(pos) < len(full_pos) and pos[0] > before   # later rows, own positions
    assert after - before == len(pos) and full_after - full_before == len(full_pos)
    assert torch.allclose(keys[..., before:after, :], full_keys[..., pos[0]:pos[-1] + 1, :], atol=1e-4)
    hole = pos[0] - before
    assert drafter.reset(len(out) + 8, keep=before + 2) == before + 2    # a keep inside the hole: its first part stays
    assert drafter.cache.length == before and drafter._holes == [(before, 2)]
    drafter = EagleDrafter(target, head)
    seq, _ = engine.begin(prompt, cfg, drafter=drafter)
    for steps in range(14):
        engine.step([seq], [1 if 3 <= steps < 13 else None])
    positions = drafter.cache.length + hole
    assert drafter.reset(len(out) + 8, keep=positions - 1) == positions - 1    # a keep past it: the hole stays
    assert drafter._holes == [(before, hole)] and drafter.cache.length == positions - 1 - hole
