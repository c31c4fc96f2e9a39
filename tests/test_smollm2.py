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
    ref = smollm2.model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=48, do_sample=False)
    ref = ref[0, len(ids):].tolist()
    cfg = GenerationConfig(max_new_tokens=48)
    assert Engine(smollm2, NoDrafter()).generate(ids, cfg).token_ids == ref
    torch.manual_seed(0)
    eagle = Engine(smollm2, EagleDrafter(smollm2, DraftHead.for_target(smollm2)))
    assert eagle.generate(ids, cfg).token_ids == ref
