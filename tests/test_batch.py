"""Batched decoding: sequences verified together in one target forward decode exactly what each does alone."""
from __future__ import annotations

import pytest
import torch
from conftest import VOCAB, eagle_drafter, make_target

from eagle_lite.config import GenerationConfig, TreeConfig
from eagle_lite.decoding.engine import Engine
from eagle_lite.drafters import EagleOptions, NoDrafter, build
from eagle_lite.drafters.eagle import HeadCall
from eagle_lite.drafters.prompt_lookup import PromptLookupDrafter
from eagle_lite.heads.draft import DraftHead
from eagle_lite.kernels.native import kernel_available
from eagle_lite.tree import DraftTree


@pytest.fixture(scope="module", params=["plain", "fused"])
def batch_target(request):
    """A tiny Llama through transformers' own layers, and one whose layers run as the native fused op."""
    if request.param == "fused" and not kernel_available():
        pytest.skip("the native kernels do not build here")
    target = make_target("llama", seed=3, grid=request.param == "fused")
    if request.param == "fused":
        assert target.accelerated.stack is not None
    return target


def prompts(n: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(VOCAB, (int(torch.randint(1, 40, (1,), generator=g)),), generator=g).tolist()
            for _ in range(n)]


def random_tree(root: int, n: int, g: torch.Generator) -> DraftTree:
    parents = [-1] + [int(torch.randint(i, (1,), generator=g)) for i in range(1, n)]
    tokens = [root] + torch.randint(VOCAB, (n - 1,), generator=g).tolist()
    return DraftTree(torch.tensor(tokens), parents)


@torch.inference_mode()
def test_packed_verify_equals_each_block_alone(batch_target):
    """Each sequence's hidden states and new cache entries are its own forward's, whatever sits beside it."""
    target, g = batch_target, torch.Generator().manual_seed(1)
    caches, trees = [], []
    for prompt, n in zip(prompts(4), (1, 5, 3, 7)):
        cache = target.new_cache(64)
        target.forward(torch.tensor(prompt), cache)
        cache.commit(len(prompt))
        caches.append(cache)
        trees.append(random_tree(prompt[-1], n, g))
    alone_caches = [c.grown(c.max_len) for c in caches]
    alone = [target.forward(t.tokens, c, t.ancestors, t.depths)[1] for t, c in zip(trees, alone_caches)]
    packed = target.verify([(t.tokens, c, t.ancestors, t.depths) for t, c in zip(trees, caches)])
    # the same arithmetic up to the order of fp32 sums (the native products tile the rows they are given)
    for (hidden, _), want, cache, own in zip(packed, alone, caches, alone_caches):
        end = cache.length + len(want)
        torch.testing.assert_close(hidden, want, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(cache.keys[..., :end, :], own.keys[..., :end, :], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(cache.values[..., :end, :], own.values[..., :end, :], rtol=1e-5, atol=1e-5)


def drafter_for(method: str, target, head=None):
    if method == "vanilla":
        return NoDrafter()
    if method == "lookup":
        return PromptLookupDrafter()
    if method == "auto":
        return build("auto", target, EagleOptions(head=head))
    return eagle_drafter(target, head)


@pytest.mark.parametrize("method", ["vanilla", "lookup", "eagle", "auto"])
def test_batched_steps_equal_each_sequence_alone(batch_target, method, monkeypatch):
    """Sequences that join a running batch at different steps, with different budgets and trees that change size
    from step to step, decode token for token what each decodes alone (eagle: their heads' forwards packed)."""
    target = batch_target
    packed = []   # how many sequences each head forward served
    answer_all = HeadCall.answer_all
    monkeypatch.setattr(HeadCall, "answer_all", staticmethod(lambda calls: packed.append(len(calls))
                                                              or answer_all(calls)))
    torch.manual_seed(0)
    head = DraftHead.for_target(target) if method in ("eagle", "auto") else None
    tree = TreeConfig(depth=3, top_k=3, total_tokens=6)
    configs = [GenerationConfig(max_new_tokens=n, tree=tree, stop_at_eos=False) for n in (30, 12, 25, 40, 7)]
    ps = prompts(len(configs), seed=2)
    alone = [Engine(target, drafter_for(method, target, head)).generate(p, c).token_ids for p, c in zip(ps, configs)]

    engine = Engine(target)
    joins = {0: [0, 1], 2: [2], 3: [3, 4]}   # step -> sequences that join before it
    running, out, step = [], {}, 0
    caps = [None, 1, 3, 2, 5]   # the most nodes a sequence may verify: its own tree, plain, a cut tree
    while step in joins or running:
        for i in joins.get(step, []):
            seq, first = engine.begin(ps[i], configs[i], drafter=drafter_for(method, target, head))
            out[i] = list(first)
            running.append((i, seq))
        step_caps = [caps[(step + i) % len(caps)] for i, _ in running]   # trees shrink and grow between steps
        for (i, _), new in zip(running, engine.step([s for _, s in running], step_caps)):
            out[i] += new
        running = [(i, s) for i, s in running if not s.done]
        step += 1
    assert [out[i] for i in range(len(configs))] == alone
    if method != "auto":   # auto's sequences draft with the head when their controllers choose it
        assert (max(packed, default=0) > 1) == (method == "eagle")


@torch.inference_mode()
def test_plain_steps_of_a_batch_project_their_roots_in_one_product(batch_target, monkeypatch):
    """A step of B plain sequences reads the lm_head once for all of their roots (not once per sequence), and
    every root's logits are the ones it would get alone."""
    from eagle_lite.targets.lm_head import LmHead, NodeLogits

    target = batch_target
    engine = Engine(target)
    cfg = GenerationConfig(max_new_tokens=5, stop_at_eos=False)
    seqs = [engine.begin(p, cfg, drafter=NoDrafter())[0] for p in prompts(5, seed=4)]
    products = []
    logits, top_token = LmHead.logits, LmHead.top_token
    monkeypatch.setattr(LmHead, "logits", lambda self, h: products.append(h.shape[0]) or logits(self, h))
    monkeypatch.setattr(LmHead, "top_token", lambda self, h: products.append("alone") or top_token(self, h))
    engine.step(seqs)
    assert products == [5]

    hidden = [torch.randn(n, target.lm.module.weight.shape[1]) for n in (1, 4, 3)]
    likely = [[0], [0, 2, 3], [0, 1]]
    together = NodeLogits.together(target.lm, list(zip(hidden, likely)))
    for h, path, nodes in zip(hidden, likely, together):
        alone = logits(target.lm, h)
        for node in path:
            torch.testing.assert_close(nodes[node], alone[node], rtol=1e-5, atol=1e-5)
        assert nodes.projected == len(path)


def test_a_batch_of_head_drafters_shares_one_output_weight(batch_target):
    """The server's drafters (one per sequence) are siblings: one draft lm_head and one head between them, a KV
    cache each; a sibling decodes exactly what a drafter built on its own does."""
    target = batch_target
    torch.manual_seed(0)
    head = DraftHead.for_target(target)
    first = eagle_drafter(target, head)
    twins = [first.sibling() for _ in range(3)]
    assert all(t.inner.lm_weight.data_ptr() == first.inner.lm_weight.data_ptr() and t.inner.head is head
               for t in twins)
    cfg = GenerationConfig(max_new_tokens=20, tree=TreeConfig(depth=3, top_k=3, total_tokens=6), stop_at_eos=False)
    p = prompts(1, seed=7)[0]
    alone = Engine(target, eagle_drafter(target, head)).generate(p, cfg).token_ids
    for twin in twins:
        assert Engine(target, twin).generate(p, cfg).token_ids == alone
    assert len({id(t.inner.cache) for t in twins}) == 3


@torch.inference_mode()
def test_prompts_prefilled_together_decode_what_each_does_alone(batch_target, monkeypatch):
    """`Engine.begin_all` reads several prompts in one forward; greedy and seeded sampled sequences then decode
    token for token what each does from its own prefill."""
    from eagle_lite.config import SamplingConfig
    from eagle_lite.targets.model import Target

    target = batch_target
    configs = [GenerationConfig(max_new_tokens=n, stop_at_eos=False) for n in (9, 1, 14)] + [
        GenerationConfig(max_new_tokens=12, stop_at_eos=False, seed=5, sampling=SamplingConfig(temperature=0.8))]
    ps = prompts(len(configs), seed=9)
    alone = [Engine(target, PromptLookupDrafter()).generate(p, c).token_ids for p, c in zip(ps, configs)]
    engine, forwards = Engine(target), []
    verify = Target.verify
    monkeypatch.setattr(Target, "verify", lambda self, blocks, **kw: forwards.append(len(blocks))
                        or verify(self, blocks, **kw))
    begun = engine.begin_all([(p, c, PromptLookupDrafter(), None) for p, c in zip(ps, configs)])
    assert forwards == [len(ps)]
    out = [list(first) for _, first in begun]
    running = [(i, seq) for i, (seq, _) in enumerate(begun) if not seq.done]
    while running:
        for (i, _), new in zip(running, engine.step([s for _, s in running])):
            out[i] += new
        running = [(i, s) for i, s in running if not s.done]
    assert out == alone


def test_the_server_caps_price_a_sat_out_heads_catch_up_and_learn_its_row_cost():
    """A plain step lets each head sit out and queue the features it missed; the next head step reads them all.
    The caps charge that catch-up (queued rows x the running seconds of a row, spread over the steps a sequence has
    left), learn the row cost from the head steps that paid it, and keep it out of the cap's own draft figure."""
    from eagle_lite.decoding.cost import Caps, StepCost

    caps = Caps(StepCost({1: 0.010, 4: 0.011, 16: 0.016, 32: 0.030}, sequence=0.001), max_nodes=5)
    fresh = [(0, 200)] * 4                                    # 4 sequences, nothing queued, 200 tokens left each
    head_cap = caps.choose(4, fresh)
    assert head_cap > 1                                        # here drafting pays at 4 sequences
    assert caps.choose(4, [(300, 200)] * 4) == head_cap        # the row cost is not known yet: nothing is charged
    caps.observe(head_cap, [(3, 4.0, 0.001)] * 4, [0] * 4)     # a head step without a queue: its own drafting
    own = caps.seen[head_cap][2]
    caps.observe(head_cap, [(3, 4.0, own + 0.015)] * 4, [300] * 4)   # the same step after 300 rows queued each
    assert caps.row == pytest.approx(0.06 / 1200)              # 4 x 15 ms over 1,200 rows
    assert caps.seen[head_cap][2] == pytest.approx(own)        # the catch-up is not the cap's drafting
    assert caps.choose(4, fresh) == head_cap
    assert caps.choose(4, [(300, 8)] * 4) == 1                 # a long queue and few tokens left: plain steps
    assert caps.choose(4, [(300, 100_000)] * 4) == head_cap    # paid once for a long answer: the head again
    assert caps.choose(1, [(300, 8)]) is None                  # one sequence runs the configured tree
