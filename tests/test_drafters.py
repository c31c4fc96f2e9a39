"""Training-free drafters behind the same verifier: exact output, and they really get accepted."""
from __future__ import annotations

import pytest
import torch
from conftest import reference_greedy

from eagle_lite.config import GenerationConfig, SamplingConfig
from eagle_lite.decoding.engine import Engine
from eagle_lite.drafters import DraftInput, NoDrafter, PromptLookupDrafter
from eagle_lite.drafters.prompt_lookup import AdaptiveLength


def test_lookup_finds_the_latest_longest_match():
    d = PromptLookupDrafter(max_ngram=3, num_tokens=4)
    tokens = [1, 2, 3, 9, 9, 1, 2, 3, 7, 8, 0, 5, 1, 2, 3]
    assert d.lookup(tokens, 4) == [7, 8, 0, 5]           # the latest earlier "1 2 3", not the first
    assert d.lookup([4, 5, 6], 4) == []                   # no earlier occurrence of any suffix
    assert d.lookup([5, 1, 6, 1], 3) == [6, 1]            # falls back to a 1-gram
    tree = d.propose(DraftInput(tokens, torch.zeros(1, 4)), None)
    assert tree.tokens.tolist() == [3, 7, 8, 0, 5] and tree.parents == [-1, 0, 1, 2, 3]


def _scan(tokens, k, max_ngram, min_ngram):
    """The lookup by brute force: every earlier start of each suffix n-gram, latest first."""
    for n in range(min(max_ngram, len(tokens) - 1), min_ngram - 1, -1):
        for start in range(len(tokens) - n - 1, -1, -1):
            if tokens[start:start + n] == tokens[len(tokens) - n:] and tokens[start + n:start + n + k]:
                return tokens[start + n:start + n + k]
    return []


def test_the_ngram_index_answers_like_a_scan_as_the_sequence_grows_and_is_edited():
    import random

    rng = random.Random(0)
    for _ in range(100):
        max_ngram = rng.randint(1, 6)
        min_ngram = rng.randint(1, max_ngram)
        d = PromptLookupDrafter(max_ngram=max_ngram, min_ngram=min_ngram)
        seq = [rng.randint(0, 6) for _ in range(rng.randint(0, 5))]
        for _ in range(40):
            if rng.random() < 0.1:             # a new prompt or an edited turn: not an extension
                seq = seq[:rng.randint(0, len(seq))]
            seq = seq + [rng.randint(0, 6) for _ in range(rng.randint(1, 4))]
            k = rng.randint(1, 8)
            assert d.lookup(list(seq), k) == _scan(seq, k, max_ngram, min_ngram)


def test_adaptive_length_grows_and_shrinks():
    length = AdaptiveLength(start=4, low=1, high=8)
    length.proposed = 4
    length.update(accepted=4)
    assert length.k == 6
    length.proposed = 6
    length.update(accepted=1)
    assert length.k == 2
    length.update(accepted=0)
    assert length.k == 1


@pytest.mark.parametrize("prompt", [[5, 6, 7, 8, 9] * 4, list(range(1, 30)), [3]])
def test_prompt_lookup_greedy_is_exact(target, prompt):
    ref = reference_greedy(target, prompt, 40)
    result = Engine(target, PromptLookupDrafter()).generate(prompt, GenerationConfig(max_new_tokens=40,
                                                                                     stop_at_eos=False))
    assert result.token_ids == ref


def test_prompt_lookup_is_accepted_on_repetitive_text(llama):
    prompt = [5, 6, 7, 8, 9] * 4
    ref = reference_greedy(llama, prompt, 40)
    # a tiny random model half-repeats itself: looking up the context predicts some of it
    result = Engine(llama, PromptLookupDrafter()).generate(prompt, GenerationConfig(max_new_tokens=40,
                                                                                    stop_at_eos=False))
    assert result.token_ids == ref
    assert max(result.stats.accept_lengths) >= 3
    assert result.stats.target_forwards <= 36       # vanilla needs 40


def test_prompt_lookup_sampling_is_seeded_and_matches_vanilla_support(llama):
    cfg = GenerationConfig(max_new_tokens=12, sampling=SamplingConfig(temperature=0.7, top_k=3), seed=5,
                           stop_at_eos=False)
    a = Engine(llama, PromptLookupDrafter()).generate([5, 6, 7, 5, 6], cfg).token_ids
    b = Engine(llama, PromptLookupDrafter()).generate([5, 6, 7, 5, 6], cfg).token_ids
    assert a == b and len(a) == 12
    assert Engine(llama, NoDrafter()).generate([5, 6, 7, 5, 6], cfg).stats.new_tokens == 12
