"""Lookahead decoding: exact output, its window and candidates verified in one forward, and its pool really used."""
from __future__ import annotations

import json
from collections import Counter

import pytest
import torch
from conftest import VOCAB, exact_continuations, reference_greedy
from transformers import LlamaConfig, LlamaForCausalLM

from eagle_lite.config import GenerationConfig, SamplingConfig
from eagle_lite.decoding.engine import Engine
from eagle_lite.drafters import DraftInput, LookaheadDrafter, LookaheadOptions, PromptLookupDrafter, registry
from eagle_lite.drafters.lookahead import NgramPool
from eagle_lite.generate import main
from eagle_lite.options import every_options, options_of
from eagle_lite.targets.model import Target


def greedy(n: int) -> GenerationConfig:
    return GenerationConfig(max_new_tokens=n, stop_at_eos=False)


STEP = 7   # the bigram target's next token: (token + STEP) % VOCAB, one cycle through the whole vocabulary


@pytest.fixture(scope="module")
def bigram() -> Target:
    """A tiny Llama whose next token is (token + STEP) % VOCAB whatever came before: its layers add nothing to the
    residual stream (o_proj and down_proj zero) and the lm_head scores each token's successor's embedding.
    Its text never repeats within VOCAB tokens, so nothing in the context predicts it; the target itself does."""
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                         eos_token_id=None, bos_token_id=None, pad_token_id=0)
    model = LlamaForCausalLM(config)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        embed = torch.nn.functional.normalize(torch.randn(VOCAB, 64), dim=-1)
        model.model.embed_tokens.weight.copy_(embed)
        model.lm_head.weight.copy_(4.0 * embed[(torch.arange(VOCAB) - STEP) % VOCAB])   # row y scores y's predecessor
    return Target(model.eval(), name="tiny-bigram")


def test_the_bigram_target_is_what_it_claims(bigram):
    assert reference_greedy(bigram, [1, 2, 3], 5) == [3 + STEP * k for k in range(1, 6)]


# -- exactness ---------------------------------------------------------------------------------------

SIZES = [(4, 3, 2), (1, 2, 0), (1, 3, 1), (0, 3, 2), (3, 2, 1), (5, 4, 3), (2, 5, 4), (0, 2, 0)]


@pytest.mark.parametrize("window, ngram, candidates", SIZES)
@pytest.mark.parametrize("prompt", [[5, 6, 7, 8, 9] * 4, list(range(1, 30)), [3]])
def test_lookahead_greedy_equals_generate(target, window, ngram, candidates, prompt):
    drafter = LookaheadDrafter(window, ngram, candidates)
    result = Engine(target, drafter).generate(prompt, greedy(40))
    assert result.token_ids == reference_greedy(target, prompt, 40)
    assert result.stats.target_forwards == len(result.stats.accept_lengths) + 1


def test_greedy_equals_generate_on_other_architectures(any_family):
    prompt = [4, 9, 4, 9, 11, 4, 9]
    result = Engine(any_family, LookaheadDrafter(3, 3, 2)).generate(prompt, greedy(30))
    assert result.token_ids == reference_greedy(any_family, prompt, 30)


def test_next_turns_keep_the_pool_and_stay_exact(llama):
    drafter = LookaheadDrafter(3, 3, 2)
    engine = Engine(llama, drafter)
    first = [3, 4, 5, 6, 7, 8]
    answer = engine.generate(first, greedy(20)).token_ids
    assert answer == reference_greedy(llama, first, 20)
    pooled = len(drafter.pool)
    second = first + answer + [9, 10, 11]                # the next chat turn: pool and window are kept
    result = engine.generate(second, greedy(20))
    assert result.token_ids == reference_greedy(llama, second, 20)
    assert result.stats.reused_prompt_tokens > 0 and len(drafter.pool) >= pooled
    other = [60, 61, 62]                                 # another conversation: the pool starts over
    assert engine.generate(other, greedy(20)).token_ids == reference_greedy(llama, other, 20)
    assert drafter._text[:3] == other


def test_lookahead_sampling_matches_target_distribution(llama):
    """Sampled end to end: the first three tokens, lookahead vs the target's distribution enumerated exactly."""
    sampling = SamplingConfig(temperature=0.8, top_k=4)
    prompt = [5, 6, 5, 6, 5, 6, 5]                     # the text's n-grams give candidates from the first step
    drafter = LookaheadDrafter(3, 3, 2)
    sizes, propose = [], drafter.propose
    # candidate nodes per tree: the nodes besides the root and the window
    drafter.propose = lambda inp, tree: sizes.append(len(t := propose(inp, tree)) - 1 - 3 * len(drafter.levels)) or t
    engine = Engine(llama, drafter)
    draws, counts, lengths = 1000, Counter(), []
    for seed in range(draws):
        cfg = GenerationConfig(max_new_tokens=3, sampling=sampling, seed=seed, stop_at_eos=False)
        result = engine.generate(prompt, cfg)
        counts[tuple(result.token_ids)] += 1
        lengths += result.stats.accept_lengths
    assert min(sizes) >= 0 and sum(s > 0 for s in sizes) > draws // 4   # candidates were verified beside the window
    assert lengths.count(2) > draws // 4                                # and drafted tokens were accepted
    exact = exact_continuations(llama, prompt, sampling)
    keys = set(counts) | set(exact)
    assert 0.5 * sum(abs(counts.get(k, 0) / draws - exact.get(k, 0.0)) for k in keys) < 0.12


# -- the method's mechanics --------------------------------------------------------------------------

def test_the_tree_holds_the_candidates_trie_then_the_window_with_the_papers_mask():
    drafter = LookaheadDrafter(window=3, ngram=3, candidates=3)
    drafter.levels = [[10, 11, 12], [20, 21, 22]]
    drafter._text = [1, 2, 9]                           # indexed already
    for ngram in ([9, 4, 5], [9, 4, 6], [9, 7, 8]):
        drafter.pool.add(ngram)
    tree = drafter.propose(DraftInput([1, 2, 9], torch.zeros(1, 4)), None)
    # root; candidates, latest first, sharing their common first token; then level 0 (a chain), then level 1
    assert tree.tokens.tolist() == [9, 7, 8, 4, 6, 5, 10, 11, 12, 20, 21, 22]
    assert tree.parents == [-1, 0, 1, 0, 3, 3, 0, 6, 7, 6, 7, 8]
    assert tree.children[0] == [1, 3, 6]                # candidates first among the root's children
    assert tree.probes == [9, 10, 11]                   # the top level's outputs continue the columns
    assert tree.likely_path() == [0, 1, 2]              # the latest candidate, never the window
    alone = LookaheadDrafter(window=3, ngram=3, candidates=0)
    alone.levels = [[10, 11, 12]]
    assert alone.propose(DraftInput([1, 2, 9], torch.zeros(1, 4)), None).likely_path() == [0]
    level0, level1 = [6, 7, 8], [9, 10, 11]
    for i, node in enumerate(level1):                   # level 1 column i sees root, level 0 up to i, itself
        seen = {int(s) for s in torch.nonzero(tree.ancestors[node]).flatten()}
        assert seen == {0, *level0[:i + 1], node}
        assert int(tree.depths[node]) == i + 2
    assert tree.depths[level0].tolist() == [1, 2, 3]
    assert drafter.max_tree_nodes(None) == 1 + (3 + 3) * 2


class Rows:
    """Stands in for NodeLogits: the target's greedy token at each node."""

    def __init__(self, tops: dict[int, int]) -> None:
        self.tops = tops

    def top_token(self, node: int) -> int:
        return self.tops[node]


def test_observe_fills_the_window_then_pools_its_columns_and_moves_up():
    drafter = LookaheadDrafter(window=2, ngram=3, candidates=2)
    tree = drafter.propose(DraftInput([1, 2, 3], torch.zeros(1, 4)), None)
    assert len(drafter.levels) == 1 and tree.probes == list(range(len(tree) - 2, len(tree)))
    start = list(drafter.levels[0])
    drafter.observe(tree, Rows({tree.probes[0]: 40, tree.probes[1]: 41}))
    assert drafter.levels == [start, [40, 41]]          # filling: a new level
    tree = drafter.propose(DraftInput([1, 2, 3, 4], torch.zeros(1, 4)), None)
    drafter.observe(tree, Rows({tree.probes[0]: 50, tree.probes[1]: 51}))
    assert drafter.levels == [[40, 41], [50, 51]]       # full: level 0 dropped, the new tokens on top
    assert (40, 50) in drafter.pool.latest(start[0], 2) and (41, 51) in drafter.pool.latest(start[1], 2)


def test_a_tree_checks_its_probes_and_likely_path():
    from eagle_lite.tree import DraftTree

    tokens = torch.tensor([1, 2, 3, 4])
    assert DraftTree(tokens, [-1, 0, 0, 2], likely=[0, 2, 3]).likely_path() == [0, 2, 3]
    assert DraftTree(tokens, [-1, 0, 0, 2]).likely_path() == [0, 1]
    for kwargs in ({"probes": [4]}, {"likely": [0, 1, 3]}, {"likely": [1, 2]}):
        with pytest.raises(ValueError):
            DraftTree(tokens, [-1, 0, 0, 2], **kwargs)


def test_the_pool_keeps_the_latest_distinct_ngrams_per_first_token():
    pool = NgramPool(per_key=2)
    for ngram in ([1, 2, 3], [1, 4, 5], [1, 2, 3], [1, 6, 7], [2, 1, 1]):
        pool.add(ngram)
    assert pool.latest(1, 5) == [(6, 7), (2, 3)]        # (2, 3) seen again became the latest; (4, 5) dropped
    assert pool.latest(2, 1) == [(1, 1)] and pool.latest(9, 3) == [] and len(pool) == 3
    assert NgramPool(per_key=0).latest(1, 2) == []


def test_prefetched_rows_are_projected_in_one_product_and_read_back(llama):
    from eagle_lite.targets.lm_head import NodeLogits

    hidden = torch.randn(6, llama.hidden_size)
    calls, logits = [], llama.lm.logits
    llama.lm.logits = lambda h: calls.append(h.shape[0]) or logits(h)
    try:
        with torch.inference_mode():
            nodes = NodeLogits(llama.lm, hidden, lazy=True)
            nodes.prefetch([4, 5, 1, 4])
            assert calls == [3] and nodes.projected == 3
            assert nodes.top_token(5) == int(llama.lm_head(hidden[5]).argmax())
            torch.testing.assert_close(nodes[1], llama.lm_head(hidden[1]), rtol=1e-5, atol=1e-5)
            assert calls == [3]                         # read back, not projected again
            nodes.prefetch([1, 2])
            assert calls == [3, 1] and nodes.projected == 4
    finally:
        del llama.lm.logits


def test_the_window_and_the_candidates_share_one_target_forward_per_step(llama):
    forwards = []
    real = llama.forward

    def counting(tokens, cache, *args, **kwargs):
        forwards.append(tokens.numel())
        return real(tokens, cache, *args, **kwargs)

    drafter = LookaheadDrafter(3, 3, 2)
    sizes, propose = [], drafter.propose
    drafter.propose = lambda inp, tree: sizes.append(len(t := propose(inp, tree))) or t
    llama.forward = counting
    try:
        prompt = [5, 6, 7, 8, 9] * 4
        result = Engine(llama, drafter).generate(prompt, greedy(30))
    finally:
        del llama.forward
    steps = len(result.stats.accept_lengths)
    assert result.stats.target_forwards == steps + 1 == len(forwards)      # prefill + one forward per step
    assert forwards[1:] == sizes                                          # each one the whole tree
    assert max(sizes) > 1 + 3 * 2                                         # window and candidates together


def test_the_pool_finds_continuations_the_text_does_not_hold(bigram):
    """On the bigram target nothing in the text predicts the answer (prompt lookup accepts no drafted token), but
    the window's columns run ahead along the target's own cycle and the pool hands their n-grams to the root."""
    prompt = [50, 60, 70, 80, 1]
    ref = reference_greedy(bigram, prompt, 60)
    lookup = Engine(bigram, PromptLookupDrafter()).generate(prompt, greedy(60))
    assert lookup.token_ids == ref and max(lookup.stats.accept_lengths) == 1
    no_window = Engine(bigram, LookaheadDrafter(window=0, ngram=3, candidates=2)).generate(prompt, greedy(60))
    assert no_window.token_ids == ref and max(no_window.stats.accept_lengths) == 1
    result = Engine(bigram, LookaheadDrafter(window=4, ngram=4, candidates=2)).generate(prompt, greedy(60))
    assert result.token_ids == ref
    assert max(result.stats.accept_lengths) == 4                          # whole n-grams accepted
    assert result.stats.target_forwards < 0.75 * 60


def test_sizes_are_checked():
    for kwargs, message in (({"window": -1}, "window .* >= 0, got -1"), ({"ngram": 1}, "ngram .* >= 2, got 1"),
                            ({"candidates": -2}, "candidates .* >= 0, got -2"), ({"window": 2.5}, "got 2.5")):
        with pytest.raises(ValueError, match=message):
            LookaheadDrafter(**kwargs)
        with pytest.raises(ValueError, match=message):
            registry.check("lookahead", LookaheadOptions(**kwargs))


# -- entry points ------------------------------------------------------------------------------------

def test_registry_builds_it_with_its_options(llama):
    drafter = registry.build("lookahead", llama, LookaheadOptions(window=2, ngram=4, candidates=1))
    assert isinstance(drafter, LookaheadDrafter) and (drafter.window, drafter.ngram, drafter.candidates) == (2, 4, 1)
    assert options_of("lookahead", {"lookahead_ngram": 5}) == LookaheadOptions(ngram=5)
    assert options_of("lookahead") == LookaheadOptions()


def test_cli_lookahead_equals_vanilla(tiny_model_dir, capsys):
    common = ["--target", str(tiny_model_dir), "--prompt", "hello hello hello", "--max-new-tokens", "16", "--json"]
    assert main([*common, "--method", "vanilla"]) == 0
    vanilla = json.loads(capsys.readouterr().out)
    assert main([*common, "--method", "lookahead", "--lookahead-window", "2", "--lookahead-ngram", "4",
                 "--lookahead-candidates", "3"]) == 0
    lookahead = json.loads(capsys.readouterr().out)
    assert lookahead["method"] == "lookahead" and lookahead["token_ids"] == vanilla["token_ids"]


@pytest.mark.parametrize("flag, value, message", [
    ("--lookahead-window", "-1", "lookahead window (--lookahead-window) must be an integer >= 0, got -1"),
    ("--lookahead-ngram", "1", "lookahead ngram (--lookahead-ngram) must be an integer >= 2, got 1"),
    ("--lookahead-candidates", "-3", "lookahead candidates (--lookahead-candidates) must be an integer >= 0"),
])
def test_cli_refuses_bad_sizes_in_one_line_before_the_target_loads(flag, value, message, capsys, monkeypatch):
    import eagle_lite.pipeline

    def refuse(*a, **k):
        raise AssertionError("the target was loaded before the inputs were checked")

    monkeypatch.setattr(eagle_lite.pipeline, "load_target", refuse)
    assert main(["--prompt", "x", "--method", "lookahead", flag, value]) == 1
    err = capsys.readouterr().err
    assert message in err and err.startswith("error: ") and len(err.strip().splitlines()) == 1


def test_python_api_and_eval_methods_take_it(tiny_model_dir, llama):
    from eagle_lite import load
    from eval.evaluation import EvalSettings, check_settings
    from eval.methods import build_methods

    lm = load(str(tiny_model_dir), method="lookahead", options=LookaheadOptions(window=2, ngram=3, candidates=2))
    assert lm.method == "lookahead" and isinstance(lm.engine.drafter, LookaheadDrafter)
    assert lm.generate("hi", lm.config(max_new_tokens=8)).token_ids == \
        load(str(tiny_model_dir), method="vanilla").generate("hi", lm.config(max_new_tokens=8)).token_ids
    settings = EvalSettings(methods=["vanilla", "lookahead"], baseline="vanilla", options={"lookahead_window": 2})
    assert every_options(settings.options)["lookahead"] == LookaheadOptions(window=2)
    with pytest.raises(ValueError, match="ngram .* >= 2"):
        check_settings(EvalSettings(methods=["vanilla", "lookahead"], baseline="vanilla",
                                    options={"lookahead_ngram": 1}))
    with pytest.raises(ValueError, match=r"unknown method option\(s\) \['lookahead_width'\]"):
        check_settings(EvalSettings(methods=["vanilla", "lookahead"], baseline="vanilla",
                                    options={"lookahead_width": 1}))
    methods = build_methods(llama, ["vanilla", "lookahead"], every_options(settings.options))
    runs = {name: run([5, 6, 7, 5, 6, 7], greedy(12)) for name, run in methods.items()}
    assert runs["lookahead"].token_ids == runs["vanilla"].token_ids


def test_the_sweep_config_sets_its_sizes(tiny_model_dir, tmp_path):
    from pathlib import Path

    from hydra import compose, initialize_config_dir
    from test_eval import sweep_overrides, two_question_file

    from eval.sweep import evaluate, settings_from

    overrides = sweep_overrides(tiny_model_dir, two_question_file(tmp_path))
    overrides[2] = "methods=[vanilla,lookahead]"
    with initialize_config_dir(config_dir=str(Path(__file__).parents[1] / "conf" / "eval"), version_base=None):
        settings = settings_from(compose("sweep", overrides=[*overrides, "baseline=vanilla", "lookahead.window=2",
                                                             "lookahead.candidates=3"]))
    assert every_options(settings.options)["lookahead"] == LookaheadOptions(window=2, candidates=3)
    records, _, _ = evaluate(settings, progress=False)
    assert {r.method for r in records} == {"vanilla", "lookahead"} and all(r.identical_to_baseline for r in records)


def test_benchmark_and_tune_take_its_flags(capsys, monkeypatch):
    import eagle_lite.targets.loading
    import eval.evaluation
    from eval import benchmark, tune

    def refuse(*a, **k):
        raise AssertionError("the target was loaded before the inputs were checked")

    for module in (eagle_lite.targets.loading, eval.evaluation):
        monkeypatch.setattr(module, "load_target", refuse)
    args = benchmark.parse_args(["--methods", "vanilla,lookahead", "--lookahead-window", "3"])
    assert every_options(benchmark.settings_of(args).options)["lookahead"] == LookaheadOptions(window=3)
    assert benchmark.main(["--methods", "vanilla,lookahead", "--lookahead-ngram", "1"]) == 1
    assert "lookahead ngram (--lookahead-ngram) must be an integer >= 2" in capsys.readouterr().err
    assert tune.main(["--method", "lookahead", "--lookahead-ngrams", "1,3"]) == 1
    assert "lookahead ngram (--lookahead-ngram) must be an integer >= 2" in capsys.readouterr().err
    setting = {"window": 2, "ngram": 3, "candidates": 1}
    assert tune.how_to_select("lookahead", setting) == \
        "--lookahead-window 2 --lookahead-ngram 3 --lookahead-candidates 1"


def test_tune_runs_its_grid(tiny_model_dir):
    from eagle_lite.targets.loading import load_target
    from eval.tasks import Question
    from eval.tune import best, tune
    from eval.tuning import grid_candidates

    target = load_target(str(tiny_model_dir))
    candidates = grid_candidates("lookahead", target, {"window": [1, 2], "ngram": [3], "candidates": [2]})
    assert [c.label for c in candidates] == ["lookahead W=1 N=3 G=2", "lookahead W=2 N=3 G=2"]
    rows = tune(target, [Question("1", "chat", ["hello hello hello"])], candidates, max_new_tokens=8, warmup=False)
    assert {r["method"] for r in rows} == {"vanilla", *(c.label for c in candidates)}
    assert best(rows)["setting"] in [c.setting for c in candidates]
