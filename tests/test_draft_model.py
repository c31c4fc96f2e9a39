"""Draft-model and layer-skip speculation behind the same verifier: exact greedy, exact sampling, clear errors."""
from __future__ import annotations

import json
from collections import Counter

import pytest
import torch
from conftest import VOCAB, exact_continuations, make_target, reference_greedy
from tokenizers import Tokenizer, models
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

import eagle_lite.decoding.engine as engine_module
from eagle_lite.config import GenerationConfig, SamplingConfig
from eagle_lite.decoding.accept import target_probs
from eagle_lite.decoding.engine import Engine
from eagle_lite.drafters import DraftModelDrafter, LayerSkipDrafter
from eagle_lite.drafters.layer_skip import EarlyExit
from eagle_lite.generate import main
from eagle_lite.targets.model import Target


def noisy_copy(family: str = "llama", noise: float = 0.1) -> Target:
    """The target's weights with a perturbed lm_head: a different model that agrees about half the time."""
    draft = make_target(family)
    with torch.no_grad():
        g = torch.Generator().manual_seed(7)
        draft.lm_head.weight.add_(noise * torch.randn(draft.lm_head.weight.shape, generator=g))
    draft.name = f"noisy-{family}"
    return draft


def tiny_llama(vocab: int = VOCAB, layers: int = 2, seed: int = 0, tokenizer=None, name: str = "tiny") -> Target:
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                         eos_token_id=None, bos_token_id=None, pad_token_id=0)
    model = LlamaForCausalLM(config)
    with torch.no_grad():
        model.lm_head.weight.mul_(8.0)
    return Target(model.eval(), tokenizer, name=name)


def word_tokenizer(words: list[str]) -> PreTrainedTokenizerFast:
    return PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)},
                                                                               unk_token=words[0])))


def greedy(max_new_tokens: int) -> GenerationConfig:
    return GenerationConfig(max_new_tokens=max_new_tokens, stop_at_eos=False)


@pytest.fixture(scope="module")
def drafts() -> dict:
    return {family: {"other": make_target(family, seed=3, hidden=32), "noisy": noisy_copy(family)}
            for family in ("llama", "qwen2")}


# -- greedy exactness ------------------------------------------------------------------------------

@pytest.mark.parametrize("kind", ["other", "noisy"])
@pytest.mark.parametrize("num_tokens,adaptive", [(1, False), (4, True)])
@pytest.mark.parametrize("prompt_len", [1, 9, 47])
def test_draft_model_greedy_equals_target_greedy(target, drafts, kind, num_tokens, adaptive, prompt_len):
    prompt = torch.randint(VOCAB, (prompt_len,), generator=torch.Generator().manual_seed(prompt_len)).tolist()
    draft = drafts[target.config.model_type][kind]
    drafter = DraftModelDrafter(target, draft, num_tokens=num_tokens, adaptive=adaptive)
    result = Engine(target, drafter).generate(prompt, greedy(30))
    assert result.token_ids == reference_greedy(target, prompt, 30)
    assert result.stats.target_forwards == 1 + len(result.stats.accept_lengths)
    if kind == "noisy":  # partial acceptance: chains cut in the middle, the draft cache rolled back
        assert 1 < result.stats.accept_length_mean < num_tokens + 1 or num_tokens == 1


@pytest.mark.parametrize("num_tokens", [1, 3, 5])
def test_target_as_its_own_draft_accepts_every_token(llama, num_tokens):
    prompt = [5, 6, 7, 8]
    steps = 4
    budget = 1 + steps * (num_tokens + 1)                # prefill token, then K drafted + bonus per verify
    drafter = DraftModelDrafter(llama, llama, num_tokens=num_tokens, adaptive=False)
    result = Engine(llama, drafter).generate(prompt, greedy(budget))
    assert result.token_ids == reference_greedy(llama, prompt, budget)
    assert result.stats.accept_lengths == [num_tokens + 1] * steps


def test_early_exit_equals_the_models_own_intermediate_hidden_states():
    target = tiny_llama(layers=4)
    ids = torch.tensor([3, 14, 15, 92, 65, 35])
    with torch.inference_mode():
        states = target.model(ids[None], output_hidden_states=True).hidden_states   # layers + 1, each 1 T H
        for exit_layer in (1, 3):
            early = EarlyExit(target, exit_layer)
            cache = early.new_cache(16)
            logits, _ = early.forward(ids[:4], cache, logits_rows=slice(None))     # a prefix, then the rest
            cache.commit(4)
            rest, _ = early.forward(ids[4:], cache, logits_rows=slice(None))
            expected = target.lm_head(target.decoder.norm(states[exit_layer]))[0]   # T V
            torch.testing.assert_close(torch.cat([logits, rest]), expected, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("prompt_len", [1, 9, 47])
def test_layer_skip_greedy_equals_target_greedy(target, prompt_len):
    prompt = torch.randint(VOCAB, (prompt_len,), generator=torch.Generator().manual_seed(prompt_len)).tolist()
    result = Engine(target, LayerSkipDrafter(target, exit_layer=1)).generate(prompt, greedy(30))  # 1 of 2 layers
    assert result.token_ids == reference_greedy(target, prompt, 30)


@pytest.mark.parametrize("exit_layer", [1, 3])
def test_layer_skip_on_a_deeper_target_is_exact_and_accepted(exit_layer):
    target = tiny_llama(layers=4, seed=1)
    prompt = list(range(10, 30))
    drafter = LayerSkipDrafter(target, exit_layer=exit_layer, num_tokens=3)
    result = Engine(target, drafter).generate(prompt, greedy(30))
    assert result.token_ids == reference_greedy(target, prompt, 30)
    if exit_layer == 3:    # all layers but one: the draft mostly agrees with the target
        assert result.stats.accept_length_mean > 1.5


def test_exit_layer_is_validated(llama):
    for bad in (0, 2, -1):
        with pytest.raises(ValueError, match=rf"exit_layer must be an int in \[1, 1\].*got {bad}"):
            LayerSkipDrafter(llama, exit_layer=bad)


# -- sampling ----------------------------------------------------------------------------------------

def test_draft_model_sampling_matches_target_distribution(llama, monkeypatch):
    """A draft whose q_draft differs from p_target: min(1, p/q) acceptance and residual resampling run."""
    sampling = SamplingConfig(temperature=0.8, top_k=4)
    draft = noisy_copy("llama")
    verified = []                                        # (drafted tokens accepted, drafted) per verify
    real_accept = engine_module.accept

    def counting_accept(tree, logits, sampling_cfg, generator):
        assert tree.q_draft is not None and tree.q_draft.shape == (len(tree), VOCAB)
        path, bonus = real_accept(tree, logits, sampling_cfg, generator)
        verified.append((len(path) - 1, len(tree) - 1))
        return path, bonus

    monkeypatch.setattr(engine_module, "accept", counting_accept)
    engine = Engine(llama, DraftModelDrafter(llama, draft, num_tokens=2, adaptive=False))
    # 2,000 draws: the empirical TV of a ~16-outcome marginal is ~0.035 when exact (800 gave ~0.05, too near 0.06)
    draws = 2000
    counts = Counter()
    for seed in range(draws):
        cfg = GenerationConfig(max_new_tokens=3, sampling=sampling, seed=seed, stop_at_eos=False)
        counts[tuple(engine.generate([5, 6, 7], cfg).token_ids)] += 1
    assert sum(a for a, _ in verified) > 200               # drafted tokens were accepted ...
    assert sum(a < k for a, k in verified) > 200           # ... and rejected (residual resampling)
    exact = exact_continuations(llama, [5, 6, 7], sampling)  # the target's 3-token distribution, enumerated
    keys = set(counts) | set(exact)
    assert 0.5 * sum(abs(counts.get(k, 0) / draws - exact.get(k, 0.0)) for k in keys) < 0.12
    for pos in range(2):  # the first two marginals (4 and ~16 outcomes) more tightly; the third's is too wide
        emp, ref = Counter(), Counter()
        for k, c in counts.items():
            emp[k[pos]] += c / draws
        for k, p in exact.items():
            ref[k[pos]] += p
        assert 0.5 * sum(abs(emp[t] - ref[t]) for t in set(emp) | set(ref)) < 0.06, pos


@pytest.mark.parametrize("method", ["draft_model", "layer_skip"])
def test_sampling_is_seeded_and_stays_in_the_target_support(llama, method):
    sampling = SamplingConfig(temperature=0.7, top_k=3)
    drafter = lambda: (DraftModelDrafter(llama, noisy_copy("llama")) if method == "draft_model"  # noqa: E731
                       else LayerSkipDrafter(llama, exit_layer=1))
    cfg = GenerationConfig(max_new_tokens=16, sampling=sampling, seed=11, stop_at_eos=False)
    prompt = [5, 6, 7, 5, 6]
    a = Engine(llama, drafter()).generate(prompt, cfg).token_ids
    assert a == Engine(llama, drafter()).generate(prompt, cfg).token_ids and len(a) == 16
    with torch.inference_mode():
        probs = target_probs(llama.model(torch.tensor([prompt + a])).logits[0], sampling)  # T V
    assert all(probs[len(prompt) - 1 + i, tok] > 0 for i, tok in enumerate(a))  # each token is in the top 3


# -- vocabularies ------------------------------------------------------------------------------------

def test_vocabulary_mismatch_is_refused_naming_both(llama):
    small = tiny_llama(vocab=80, name="tiny-80")
    with pytest.raises(ValueError, match=r"draft model 'tiny-80' and target 'tiny-llama'.*80 vs 96"):
        DraftModelDrafter(llama, small)
    words = [f"w{i}" for i in range(VOCAB)]
    swapped = words[:50] + [words[51], words[50]] + words[52:]
    tgt = Target(llama.model, word_tokenizer(words), name="tok-a")
    with pytest.raises(ValueError, match=r"draft model 'tok-b' and target 'tok-a' have different tokenizers"):
        DraftModelDrafter(tgt, Target(llama.model, word_tokenizer(swapped), name="tok-b"))
    DraftModelDrafter(tgt, Target(llama.model, word_tokenizer(words), name="tok-c"))   # equal: accepted


def test_lm_head_padding_past_a_shared_tokenizer_is_tolerated():
    words = [f"w{i}" for i in range(90)]
    target = tiny_llama(vocab=96, tokenizer=word_tokenizer(words), name="padded-96")
    draft = tiny_llama(vocab=104, seed=5, tokenizer=word_tokenizer(words), name="padded-104")
    prompt = [4, 5, 6]
    result = Engine(target, DraftModelDrafter(target, draft)).generate(prompt, greedy(20))
    assert result.token_ids == reference_greedy(target, prompt, 20)


# -- prefix reuse ------------------------------------------------------------------------------------

def greedy_chain_from_scratch(draft, tokens: list[int], k: int) -> list[int]:
    """The draft's greedy continuation of `tokens`, from a fresh cache: what a synced cache must give."""
    cache, out, new = draft.new_cache(len(tokens) + k), [], tokens
    for _ in range(k):
        logits, _ = draft.forward(torch.tensor(new), cache, logits_rows=slice(-1, None))  # 1 V
        cache.commit(len(new))
        out.append(int(logits[0].argmax()))
        new = out[-1:]
    return out


@pytest.mark.parametrize("method", ["draft_model", "layer_skip"])
def test_next_turn_reuses_the_prefix_and_stays_exact(llama, method):
    draft = noisy_copy("llama")
    drafter = DraftModelDrafter(llama, draft) if method == "draft_model" else LayerSkipDrafter(llama, 1)
    read = []                                      # tokens the draft model reads, per forward
    real_forward = drafter.draft.forward
    drafter.draft.forward = lambda ids, cache, **kw: (read.append(ids.numel()), real_forward(ids, cache, **kw))[1]
    real_propose, rounds = drafter.propose, []

    def checked_propose(inp, tree):
        # a rejected draft's KV entries must be rolled back: every chain is the draft's own from scratch
        chain = real_propose(inp, tree)
        rounds.append((list(inp.tokens), chain.tokens[1:].tolist()))  # the engine extends its list
        return chain

    drafter.propose = checked_propose
    engine = Engine(llama, drafter)
    first = [3, 4, 5, 6, 7, 8]
    answer = engine.generate(first, greedy(15)).token_ids
    assert answer == reference_greedy(llama, first, 15)
    second = first + answer + [9, 10, 11]                # the next chat turn
    read.clear()
    result = engine.generate(second, greedy(15))
    assert result.token_ids == reference_greedy(llama, second, 15)
    assert result.stats.reused_prompt_tokens >= len(first) + len(answer) - 2
    assert read[0] <= len(second) - len(first)           # the draft re-read only what it had not seen
    diverged = [3, 4, 60, 61]
    assert engine.generate(diverged, greedy(15)).token_ids == reference_greedy(llama, diverged, 15)
    drafter.draft.forward = real_forward
    assert len(rounds) > 10
    for tokens, chain in rounds:
        assert chain == greedy_chain_from_scratch(drafter.draft, tokens, len(chain))


# -- entry points ------------------------------------------------------------------------------------

def test_cli_layer_skip_and_draft_model_equal_vanilla(tiny_model_dir, capsys):
    common = ["--target", str(tiny_model_dir), "--prompt", "hello there", "--max-new-tokens", "16", "--json"]
    outputs = {}
    for method, extra in [("vanilla", []), ("layer_skip", ["--exit-layer", "1"]),
                          ("draft_model", ["--draft-model", str(tiny_model_dir)])]:
        assert main(common + ["--method", method] + extra) == 0
        outputs[method] = json.loads(capsys.readouterr().out)
        assert outputs[method]["method"] == method
    assert outputs["layer_skip"]["token_ids"] == outputs["vanilla"]["token_ids"]
    assert outputs["draft_model"]["token_ids"] == outputs["vanilla"]["token_ids"]
    assert outputs["draft_model"]["accept_length_mean"] > 1.0     # the target drafting for itself
    assert main(["--target", str(tiny_model_dir), "--prompt", "x", "--method", "draft_model"]) == 1
    assert "needs --draft-model" in capsys.readouterr().err
    assert main(["--target", str(tiny_model_dir), "--prompt", "x", "--method", "layer_skip", "--exit-layer", "5"]) == 1
    assert "exit_layer must be an int in [1, 1]" in capsys.readouterr().err


def test_eval_methods_register_both(llama):
    from eagle_lite.drafters import DraftModelOptions
    from eval.methods import build_methods

    with pytest.raises(ValueError, match="'draft_model' needs --draft-model"):
        build_methods(llama, ["draft_model"])
    methods = build_methods(llama, ["vanilla", "draft_model", "layer_skip"],
                            {"draft_model": DraftModelOptions(draft_target=llama)})
    cfg = greedy(10)
    runs = {name: run([5, 6, 7], cfg) for name, run in methods.items()}
    assert runs["draft_model"].token_ids == runs["layer_skip"].token_ids == runs["vanilla"].token_ids
