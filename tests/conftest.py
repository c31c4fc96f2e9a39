"""Tiny random targets built in-process: no downloads, a few milliseconds a forward."""
from __future__ import annotations

import os

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM  # noqa: E402

from eagle_lite.target import Target  # noqa: E402

VOCAB = 96


def make_target(family: str = "llama", seed: int = 0, hidden: int = 64, max_pos: int = 512) -> Target:
    torch.manual_seed(seed)
    common = dict(vocab_size=VOCAB, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=max_pos,
                  eos_token_id=None, bos_token_id=None, pad_token_id=0)
    if family == "llama":
        model = LlamaForCausalLM(LlamaConfig(**common))
    elif family == "qwen2":
        model = Qwen2ForCausalLM(Qwen2Config(**common))
    else:
        raise ValueError(family)
    # Sharper next-token distributions than a fresh init, so greedy paths are not all ties
    with torch.no_grad():
        model.lm_head.weight.mul_(8.0)
    return Target(model.eval(), name=f"tiny-{family}")


@pytest.fixture(scope="session", params=["llama", "qwen2"])
def target(request) -> Target:
    return make_target(request.param)


@pytest.fixture(scope="session")
def llama() -> Target:
    return make_target("llama")


def reference_greedy(target: Target, prompt: list[int], max_new_tokens: int, eos: int | None = None) -> list[int]:
    """transformers' own greedy generate(): the output every method must reproduce."""
    ids = torch.tensor([prompt])
    # an explicit all-ones mask: otherwise generate() masks out prompt tokens equal to pad_token_id
    out = target.model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                                do_sample=False, eos_token_id=eos, pad_token_id=0)
    return out[0, len(prompt):].tolist()
