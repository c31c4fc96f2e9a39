"""Prompt lookup across requests (eagle_lite_wing/traffic.py): the store of answers served, the lookups copying it,
and that output stays the target's own."""
from __future__ import annotations

import pytest
import torch
from conftest import reference_greedy

from eagle_lite.config import GenerationConfig, SamplingConfig, TreeConfig
from eagle_lite.decoding.engine import Engine
from eagle_lite.drafters import registry
from eagle_lite.drafters.prompt_lookup import PromptLookupDrafter
from eagle_lite.heads.draft import DraftHead
from eagle_lite_wing.traffic import TrafficStore


def prompts(n: int, seed: int = 0, length: int = 12) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 90, (length,), generator=g).tolist() for _ in range(n)]


def test_the_store_finds_the_longest_ngram_of_earlier_answers_and_keeps_the_newest():
    from eagle_lite_wing.controller import ChainRate

    assert ChainRate.key(4, False, stored=True) == ChainRate.STORED != ChainRate.key(4, False)   # auto's own bucket
    store = TrafficStore(max_tokens=20, min_ngram=1, max_ngram=3)
    store.add([1, 2, 3, 4, 5, 6])
    store.add([9, 2, 3, 7, 8])
    assert store.continuation([0, 2, 3], 1, 4) == (2, [7, 8])       # the latest place of (2, 3)
    assert store.continuation([5, 1, 2, 3], 1, 4) == (3, [4, 5, 6])  # a longer n-gram wins over a later one
    assert store.continuation([0, 2, 3], 3, 4) == (0, [])            # none as long as asked
    assert store.continuation([42], 1, 4) == (0, [])
    store.add([1])                                                    # nothing to copy from one token
    assert len(store) == 2
    store.add(list(range(30, 45)))                                    # past 20 tokens: the oldest go, down to 15
    assert store.tokens <= 20 and len(store) == 1
    assert store.continuation([0, 2, 3], 1, 4) == (0, [])
    assert store.continuation([31, 32], 1, 2) == (2, [33, 34])
    with pytest.raises(ValueError):
        TrafficStore(max_tokens=0)
    with pytest.raises(ValueError):
        TrafficStore(min_ngram=6, max_ngram=5)


def test_lookup_takes_the_stores_match_only_where_it_is_longer():
    store = TrafficStore()
    store.add([4, 5, 6, 7, 8, 9])
    lookup = PromptLookupDrafter(max_ngram=5, min_ngram=1)
    context = [7, 1, 2, 4, 5, 6, 7]
    assert lookup.match_length(context, 3) == (1, 1, [1, 2, 4])       # the context alone: (7) at its start
    lookup.store = store
    assert lookup.match_length(context, 3) == (4, 0, [8, 9])          # the store holds (4, 5, 6, 7)
    assert lookup.match_length([5, 6, 7], 3) == (0, 0, [])             # 3 tokens: too short to copy from another answer
    assert lookup.match_length([1, 2, 1, 2], 2) == (2, 2, [1, 2])      # the context's longer match stays


@pytest.mark.parametrize("method", ["lookup", "eagle", "auto"])
def test_greedy_output_is_the_targets_with_a_store_and_a_repeat_takes_fewer_steps(llama, method):
    torch.manual_seed(0)
    options = None if method == "lookup" else registry.EagleOptions(head=DraftHead.for_target(llama))
    engine = Engine(llama, registry.build(method, llama, options))
    tree = TreeConfig(1, 1, 1, 8) if method != "lookup" else TreeConfig()
    cfg = GenerationConfig(max_new_tokens=40, tree=tree, stop_at_eos=False)
    store = TrafficStore()
    engine.observers.append(store)
    steps = []
    for prompt in prompts(3) + prompts(1):             # the last prompt is the first again
        engine.reset()
        out = engine.generate(prompt, cfg)
        assert out.token_ids == reference_greedy(llama, prompt, 40)
        steps.append(out.stats.target_forwards)
    assert len(store) == 4
    assert steps[-1] < steps[0]                        # its answer, looked up from the first
    engine.observers.remove(store)                     # a finished answer's drafter lets go of the store
    engine.reset()
    assert engine.generate(prompts(1)[0], cfg).stats.target_forwards == steps[0]


def test_sampled_output_does_not_depend_on_the_store(llama):
    """A lookup chain is verified by drawing each position's token from the target (accept.py): one draw a token,
    whatever was proposed, so the same seed gives the same answer with or without the store."""
    engine = Engine(llama, registry.build("lookup", llama))
    prompt = prompts(1)[0]
    cfg = GenerationConfig(max_new_tokens=24, sampling=SamplingConfig(temperature=1.0), seed=3, stop_at_eos=False)
    plain = engine.generate(prompt, cfg).token_ids
    store = TrafficStore()
    store.add(plain)
    engine.observers.append(store)
    engine.reset()
    assert engine.generate(prompt, cfg).token_ids == plain
