"""Causal LMs beyond the Llama family run through the same code path: exact greedy output for every method
that applies, logits as the model makes them (scaled or soft-capped), and clear refusals where a method cannot run."""
from __future__ import annotations

import json

import pytest
import torch
import transformers as T
from conftest import VOCAB, eagle_drafter, reference_greedy, tiny_tokenizer

from eagle_lite.config import GenerationConfig, TreeConfig
from eagle_lite.decoding.drafter import NoDrafter
from eagle_lite.decoding.engine import Engine
from eagle_lite.drafters.layer_skip import LayerSkipDrafter
from eagle_lite.formats import load_head
from eagle_lite.heads.checkpoint import save_head
from eagle_lite.heads.draft import DraftHead
from eagle_lite.targets.model import Target

SIZES = dict(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, pad_token_id=0)
LLAMA_LIKE = dict(SIZES, intermediate_size=128, num_key_value_heads=2, max_position_embeddings=512)

# family -> (config class, model class, config kwargs)
FAMILIES = {
    "gpt2": (T.GPT2Config, T.GPT2LMHeadModel, SIZES),                           # learned positions, no rotary
    "gpt_neox": (T.GPTNeoXConfig, T.GPTNeoXForCausalLM, SIZES),                 # layer_past, partial rotary
    "falcon": (T.FalconConfig, T.FalconForCausalLM, SIZES),
    "phi": (T.PhiConfig, T.PhiForCausalLM, dict(LLAMA_LIKE, num_key_value_heads=4)),
    "gemma2": (T.Gemma2Config, T.Gemma2ForCausalLM, dict(LLAMA_LIKE, head_dim=16)),   # soft-capped attention
    "gemma3": (T.Gemma3TextConfig, T.Gemma3ForCausalLM,                          # per-layer-type rotary
               dict(LLAMA_LIKE, head_dim=16, final_logit_softcapping=3.0)),
    "granite": (T.GraniteConfig, T.GraniteForCausalLM, dict(LLAMA_LIKE, logits_scaling=4.0)),
    "qwen3_moe": (T.Qwen3MoeConfig, T.Qwen3MoeForCausalLM,                      # experts: the head is a dense layer
                  dict(LLAMA_LIKE, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32)),
}
# models whose attention does not take transformers' boolean masks through its attention interface (or that
# have none: Mamba)
UNVERIFIABLE = {
    "mpt": lambda: T.MptForCausalLM(T.MptConfig(vocab_size=VOCAB, d_model=64, n_layers=2, n_heads=4)),
    "bloom": lambda: T.BloomForCausalLM(T.BloomConfig(vocab_size=VOCAB, hidden_size=64, n_layer=2, n_head=4)),
    "mamba": lambda: T.MambaForCausalLM(T.MambaConfig(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2)),
}


def build(family: str) -> Target:
    config_cls, model_cls, sizes = FAMILIES[family]
    torch.manual_seed(0)
    model = model_cls(config_cls(**sizes)).eval()
    if not model.config.tie_word_embeddings:
        with torch.no_grad():
            model.get_output_embeddings().weight.mul_(8.0)   # sharper distributions: greedy paths are not ties
    return Target(model, name=f"tiny-{family}")


@pytest.fixture(scope="module", params=list(FAMILIES))
def family_target(request) -> Target:
    return build(request.param)


def assert_eagle_and_vanilla_reproduce_greedy(target: Target) -> None:
    prompt = list(range(3, 20))
    expected = reference_greedy(target, prompt, 24)
    cfg = GenerationConfig(max_new_tokens=24, stop_at_eos=False, tree=TreeConfig(depth=3, top_k=3, total_tokens=8))
    head = DraftHead.for_target(target)
    assert Engine(target, eagle_drafter(target, head)).generate(prompt, cfg).token_ids == expected
    assert Engine(target, NoDrafter()).generate(prompt, cfg).token_ids == expected


def test_eagle_and_vanilla_reproduce_the_targets_greedy_output(family_target):
    assert_eagle_and_vanilla_reproduce_greedy(family_target)


def test_the_targets_logits_are_the_models_own_scaled_or_capped_ones(family_target):
    ids = torch.tensor([5, 9, 13, 2, 40])
    with torch.inference_mode():
        expected = family_target.model(ids[None]).logits[0]
        _, hidden = family_target.forward(ids, family_target.new_cache(16))
        got = family_target.logits(hidden)
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-5)   # what sampling draws from
    assert torch.equal(got.argmax(-1), expected.argmax(-1))


@pytest.mark.parametrize("family", ["gemma3", "granite"])
def test_a_scaled_or_capped_head_is_found(family):
    target = build(family)
    assert target.lm.finish is not None            # raw lm_head logits would sample at the wrong temperature


def test_a_model_whose_logits_are_something_else_is_refused():
    class Squared(T.LlamaForCausalLM):
        def forward(self, *args, **kwargs):
            out = super().forward(*args, **kwargs)
            out.logits = out.logits ** 2
            return out

    torch.manual_seed(0)
    model = Squared(T.LlamaConfig(**LLAMA_LIKE)).eval()
    with pytest.raises(ValueError, match="as something other than its lm_head"):
        Target(model, name="squared")


def test_the_head_is_a_llama_layer_where_the_targets_layers_cannot_serve(tmp_path):
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    gpt2, gemma2 = build("gpt2"), build("gemma2")
    assert not gpt2.llama_layers and gemma2.llama_layers
    assert type(DraftHead.for_target(gpt2).layer) is LlamaDecoderLayer
    assert type(DraftHead.for_target(gemma2).layer) is type(gemma2.decoder.layers[0])

    head = DraftHead.for_target(gpt2)
    save_head(head, tmp_path / "head", gpt2, dtype=torch.float32)
    assert json.loads((tmp_path / "head" / "config.json").read_text())["layer_class"] == "LlamaDecoderLayer"
    loaded = load_head(tmp_path / "head", gpt2)
    for name, tensor in head.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], tensor), name

    config = json.loads((tmp_path / "head" / "config.json").read_text())
    config["layer_class"] = "MambaBlock"
    (tmp_path / "head" / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="built with a MambaBlock"):
        load_head(tmp_path / "head", gpt2)


@pytest.mark.parametrize("family", ["gpt2", "gemma3"])
def test_layer_skip_refuses_a_target_without_a_llama_style_stack(family):
    with pytest.raises(ValueError, match="layer_skip runs the first layers"):
        LayerSkipDrafter(build(family))


def test_a_saved_gemma2_folder_loads_and_decodes_exactly(tmp_path):
    """from_pretrained with SDPA forced would refuse Gemma 2 (it soft-caps attention scores)."""
    from eagle_lite.targets.loading import load_target

    built = build("gemma2")
    built.model.save_pretrained(tmp_path / "gemma2")
    tiny_tokenizer().save_pretrained(tmp_path / "gemma2")
    target = load_target(str(tmp_path / "gemma2"))
    prompt = list(range(3, 20))
    cfg = GenerationConfig(max_new_tokens=16, stop_at_eos=False, tree=TreeConfig(depth=2, top_k=2, total_tokens=3))
    head = DraftHead.for_target(target)
    assert Engine(target, eagle_drafter(target, head)).generate(prompt, cfg).token_ids == \
        reference_greedy(built, prompt, 16)


def test_a_target_path_that_does_not_exist_is_named(tmp_path):
    from eagle_lite.targets.loading import load_target

    with pytest.raises(FileNotFoundError, match="no model folder there"):
        load_target(str(tmp_path / "missing"))


@pytest.mark.parametrize("family", list(UNVERIFIABLE))
def test_a_model_the_tree_forward_would_run_wrong_is_refused_at_load(family):
    torch.manual_seed(0)
    with pytest.raises(ValueError, match="cannot be verified exactly"):
        Target(UNVERIFIABLE[family]().eval(), name=family)


def test_gptj_is_refused_or_exact_as_the_installed_transformers_runs_it():
    """GPT-J's attention ignored boolean masks before transformers 5.24 and goes through the attention interface
    since: whichever is installed, loading refuses it or generation reproduces its greedy output."""
    torch.manual_seed(0)
    model = T.GPTJForCausalLM(T.GPTJConfig(vocab_size=VOCAB, n_embd=64, n_layer=2, n_head=4, rotary_dim=8)).eval()
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(8.0)
    try:
        target = Target(model, name="gptj")
    except ValueError as err:
        assert "cannot be verified exactly" in str(err)
        return
    assert_eagle_and_vanilla_reproduce_greedy(target)


def test_the_head_of_a_mixture_of_experts_target_is_dense_and_deterministic():
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    target = build("qwen3_moe")
    heads = []
    for _ in range(2):
        torch.manual_seed(1)
        heads.append(DraftHead.for_target(target))
    assert type(heads[0].layer) is LlamaDecoderLayer     # an MoE layer built outside its model kept torch.empty experts
    for name, tensor in heads[0].state_dict().items():
        assert torch.isfinite(tensor).all() and torch.equal(tensor, heads[1].state_dict()[name]), name


def test_sampling_follows_the_logits_the_model_scales():
    """Granite divides its logits by 4: sampled answers (plain and speculative) follow the model's own law,
    not the unscaled lm_head's (which samples as if at a quarter of the temperature)."""
    from collections import Counter

    from conftest import exact_continuations, tv
    from test_accept import TargetTopKDrafter

    from eagle_lite.config import SamplingConfig

    target = build("granite")
    sampling = SamplingConfig(temperature=0.8, top_k=4)
    exact = exact_continuations(target, [5, 6, 7], sampling)
    draws = 1000
    for drafter in (NoDrafter(), TargetTopKDrafter(target)):
        engine, counts = Engine(target, drafter), Counter()
        for seed in range(draws):
            cfg = GenerationConfig(max_new_tokens=3, sampling=sampling, seed=seed, stop_at_eos=False)
            counts[tuple(engine.generate([5, 6, 7], cfg).token_ids)] += 1
        assert tv(counts, exact, draws) < 0.12, type(drafter).__name__
