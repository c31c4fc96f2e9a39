"""On the real embedded target (slow: run with `make test-slow`): every method gives the target's greedy output."""
from __future__ import annotations

import pytest
import torch

from eagle_lite.config import GenerationConfig
from eagle_lite.draft import DraftHead
from eagle_lite.drafters import EagleDrafter, NoDrafter
from eagle_lite.engine import Engine

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def smollm2():
    from eagle_lite.loading import load_target

    return load_target("smollm2")


def test_eagle_random_head_equals_vanilla_equals_transformers(smollm2):
    ids = smollm2.tokenizer.apply_chat_template([{"role": "user", "content": "Write a haiku about autumn."}],
                                                add_generation_prompt=True, return_dict=False)
    x = torch.tensor([ids])
    with smollm2.stock():  # the reference is stock transformers
        ref = smollm2.model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=48, do_sample=False)
    ref = ref[0, len(ids):].tolist()
    cfg = GenerationConfig(max_new_tokens=48)
    assert Engine(smollm2, NoDrafter()).generate(ids, cfg).token_ids == ref
    torch.manual_seed(0)
    eagle = Engine(smollm2, EagleDrafter(smollm2, DraftHead.for_target(smollm2)))
    assert eagle.generate(ids, cfg).token_ids == ref


def test_shipped_head_is_the_default_and_exact(smollm2):
    """`load()` speculates with the head shipped for SmolLM2 (if one ships): same tokens as transformers,
    more than one token per target forward on a chat prompt, with the head's recommended tree."""
    from eagle_lite.checkpoint import default_head_path, load_head

    path = default_head_path("smollm2")
    if path is None:
        pytest.skip("no head ships for smollm2")
    head = load_head(path, smollm2)
    assert head.tree is not None, "a shipped head records the tree eval.tune found fastest"
    ids = smollm2.tokenizer.apply_chat_template([{"role": "user", "content": "Explain what a linked list is."}],
                                                add_generation_prompt=True, return_dict=False)
    x = torch.tensor([ids])
    with smollm2.stock():
        ref = smollm2.model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=64, do_sample=False)
    ref = ref[0, len(ids):].tolist()
    out = Engine(smollm2, EagleDrafter(smollm2, head)).generate(ids, GenerationConfig(max_new_tokens=64, tree=head.tree))
    assert out.token_ids == ref
    assert out.stats.accept_length_mean > 1.5
