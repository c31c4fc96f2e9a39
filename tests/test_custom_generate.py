"""transformers' own model.generate(custom_generate=...) runs eagle_lite's speculative decoding and returns exactly
what plain generate() returns."""
from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from eagle_lite.custom_generate import generate as eagle_generate
from eagle_lite.heads.checkpoint import save_head
from eagle_lite.heads.draft import DraftHead
from eagle_lite.targets.model import Target


@pytest.fixture(scope="module")
def model(tiny_model_dir):
    return AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def head_dir(model, tmp_path_factory):
    """A head folder saved for this model (random weights: little is accepted, every path is still exact)."""
    target = Target(AutoModelForCausalLM.from_pretrained(model.config.name_or_path, dtype=torch.float32), name="tiny")
    torch.manual_seed(0)
    return save_head(DraftHead.for_target(target, torch.arange(40)), tmp_path_factory.mktemp("head") / "h", target)


PROMPT = torch.tensor([[5, 17, 33, 2, 9, 71, 40, 12]])


@pytest.mark.parametrize("draft", ["head", "lookup"])
def test_greedy_custom_generate_equals_plain_generate(model, head_dir, draft):
    kwargs = dict(max_new_tokens=40, do_sample=False, pad_token_id=1)
    plain = model.generate(PROMPT, **kwargs)
    got = model.generate(PROMPT, custom_generate=eagle_generate, draft=head_dir if draft == "head" else None, **kwargs)
    assert torch.equal(got, plain)
    assert torch.equal(model.generate(PROMPT, **kwargs), plain)   # the model itself is left as it was


def test_it_stops_where_generate_stops_and_returns_its_output_type(model, head_dir):
    plain = model.generate(PROMPT, max_new_tokens=40, do_sample=False, pad_token_id=1)
    eos = int(plain[0, PROMPT.shape[1] + 6])    # a token greedy decoding reaches: generation ends there
    kwargs = dict(max_new_tokens=40, do_sample=False, pad_token_id=1, eos_token_id=eos, return_dict_in_generate=True)
    want = model.generate(PROMPT, **kwargs)
    got = model.generate(PROMPT, custom_generate=eagle_generate, draft=head_dir, **kwargs)
    assert type(got) is type(want) and torch.equal(got.sequences, want.sequences)
    assert got.sequences.shape[1] <= PROMPT.shape[1] + 7


def test_sampling_is_reproducible_under_torch_manual_seed(model, head_dir):
    kwargs = dict(max_new_tokens=20, do_sample=True, temperature=0.8, top_k=20, pad_token_id=1)
    runs = []
    for _ in range(2):
        torch.manual_seed(3)
        runs.append(model.generate(PROMPT, custom_generate=eagle_generate, draft=head_dir, **kwargs))
    assert torch.equal(runs[0], runs[1]) and runs[0].shape == (1, PROMPT.shape[1] + 20)


def test_what_it_cannot_do_exactly_is_refused(model, head_dir):
    with pytest.raises(ValueError, match="one sequence at a time, got a batch of 2"):
        model.generate(PROMPT.repeat(2, 1), custom_generate=eagle_generate, draft=head_dir, max_new_tokens=4,
                       pad_token_id=1)
    with pytest.raises(ValueError, match="RepetitionPenaltyLogitsProcessor"):
        model.generate(PROMPT, custom_generate=eagle_generate, draft=head_dir, max_new_tokens=4, pad_token_id=1,
                       repetition_penalty=1.3)


def test_a_model_used_through_custom_generate_is_freed_with_its_engines(tiny_model_dir, head_dir):
    import gc
    import weakref

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    keys = set(model.state_dict())
    model.generate(PROMPT, max_new_tokens=4, do_sample=False, pad_token_id=1, custom_generate=eagle_generate,
                   draft=head_dir)
    assert set(model.state_dict()) == keys                 # the cached engines are not registered as submodules
    alive = weakref.ref(model)
    del model
    gc.collect()
    assert alive() is None
