"""A drafter with a flag is one module plus one registry line: the flag its options dataclass declares is a flag of
the CLI, the server and the eval tools, and a key of eval's and training's configs, and its value reaches the
drafter's options through each of them (eagle_lite/options.py); the grid its registry entry declares (`Method.tune`) is
what eval.tune sweeps."""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import pytest
from conftest import reference_greedy

from eagle_lite.config import GenerationConfig
from eagle_lite.drafters import registry
from eagle_lite.drafters.prompt_lookup import PromptLookupDrafter
from eagle_lite.options import every_options, option, option_values, options_of


# -- the new drafter's one module: its options, its drafter, the function building one from the other --------------
@dataclass(frozen=True)
class ToyOptions:
    width: int = option(2, "toy-width", "tokens the toy drafts a step", type=int, metavar="K")


def build_toy(target, options: ToyOptions) -> PromptLookupDrafter:
    BUILT.append(options.width)
    return PromptLookupDrafter(max_ngram=3, min_ngram=1, num_tokens=options.width, adaptive=False)


BUILT: list[int] = []   # the width of every toy drafter built


@dataclass(frozen=True)
class ChainOptions:
    """A chain drafter's options: eval.tune sweeps its num_tokens."""

    width: int = option(2, "toy-width", "tokens the toy drafts a step", type=int, metavar="K")
    num_tokens: int = 4
    adaptive: bool = True


def build_chain(target, options: ChainOptions) -> PromptLookupDrafter:
    BUILT.append((options.width, options.num_tokens))
    return PromptLookupDrafter(3, 1, options.num_tokens, options.adaptive)


@pytest.fixture
def toy(monkeypatch):
    """... and its one registry line."""
    monkeypatch.setitem(registry.METHODS, "toy", registry.Method(ToyOptions, build_toy, "a toy: fixed-width lookup"))
    BUILT.clear()
    return BUILT


def test_the_cli_takes_its_flag_and_the_value_reaches_the_drafter(toy, tiny_model_dir, capsys):
    from eagle_lite.generate import build_parser, main

    help_text = " ".join(build_parser().format_help().split())
    assert "--toy-width K" in help_text and "--method toy: tokens the toy drafts a step (default: 2)" in help_text
    common = ["--target", str(tiny_model_dir), "--prompt", "abcabcabc", "--max-new-tokens", "12", "--json"]
    assert main([*common, "--method", "toy", "--toy-width", "3"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert toy == [3] and out["method"] == "toy"
    assert main([*common, "--method", "vanilla"]) == 0
    assert json.loads(capsys.readouterr().out)["token_ids"] == out["token_ids"]     # lossless as every method


def test_the_server_takes_its_flag_and_its_drafters_get_the_value(toy, llama):
    from eagle_lite.pipeline import for_target
    from eagle_lite.serve.__main__ import build_parser

    parser = build_parser()
    assert "--toy-width" in parser.format_help()
    args = parser.parse_args(["--method", "toy", "--toy-width", "4"])
    pipeline = for_target(llama, args.method, options_of(args.method, args))
    drafters = pipeline.drafter_factory()            # one per sequence of a batch
    assert drafters().length.k == 4 and set(toy) == {4}


def test_eval_takes_its_flag_and_its_config_key(toy, llama, monkeypatch):
    from hydra import compose, initialize_config_dir

    from eval import benchmark
    from eval.evaluation import check_settings
    from eval.methods import build_methods
    from eval.sweep import settings_from, store_method_options

    args = benchmark.parse_args(["--methods", "vanilla,toy", "--toy-width", "5"])
    assert args.toy_width == 5
    settings = benchmark.settings_of(args)
    check_settings(settings)                           # "toy" is a method eval knows, its options are checked
    methods = build_methods(llama, settings.methods, every_options(settings.options))
    assert toy == [5]
    prompt = [5, 6, 7, 5, 6, 7, 5]
    assert methods["toy"](prompt, GenerationConfig(max_new_tokens=10)).token_ids == reference_greedy(llama, prompt, 10)
    conf = Path(__file__).parents[1] / "conf" / "eval"
    store_method_options()   # what eval.sweep does on import, now with toy's keys
    with initialize_config_dir(config_dir=str(conf), version_base=None):
        nested = settings_from(compose("sweep", overrides=["toy.width=6"]))   # a config key, nested or flat
        flat = settings_from(compose("sweep", overrides=["+toy_width=7"]))
        assert compose("sweep").toy.width is None                          # unset: the method's default
    assert every_options(nested.options)["toy"] == ToyOptions(6) and every_options(flat.options)["toy"] == ToyOptions(7)
    assert "toy" not in conf.joinpath("sweep.yaml").read_text()          # no yaml edit
    monkeypatch.delitem(registry.METHODS, "toy")
    store_method_options()


def test_the_sweep_config_holds_every_methods_options_and_writes_none():
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    from eagle_lite.options import _flat, method_flags
    from eval.sweep import settings_from

    conf = Path(__file__).parents[1] / "conf" / "eval"
    assert not set(_flat(OmegaConf.to_container(OmegaConf.load(conf / "sweep.yaml")))) & set(method_flags())
    overrides = ["exit_layer=1", "medusa=random", "medusa_choices=[[0],[1]]", "draft_model=m", "lookahead.window=2",
                 "+lookahead.ngram=4", "draft=random", "draft_sampling=match", "draft_vocab=full"]
    with initialize_config_dir(config_dir=str(conf), version_base=None):
        options = every_options(settings_from(compose("sweep", overrides=overrides)).options)
    assert options["layer_skip"] == registry.LayerSkipOptions(exit_layer=1)
    assert options["medusa"] == registry.MedusaOptions("random", [[0], [1]])
    assert options["draft_model"] == registry.DraftModelOptions("m")
    assert options["lookahead"] == registry.LookaheadOptions(window=2, ngram=4)
    assert options["eagle"] == registry.EagleOptions("random", draft_sampling="match", draft_vocab="full")


def test_tune_takes_the_registrys_methods_and_a_chain_drafters_flag(monkeypatch, tiny_model_dir, tmp_path, capsys):
    from eval import tune

    assert tune.tunable() == ["eagle", "lookup", "lookahead", "draft_model", "layer_skip", "medusa"]
    for untuned in tune.untuned():      # in the registry, refused, with the reason in --method's help
        assert untuned in registry.METHODS
        with pytest.raises(SystemExit):
            tune.parse_args(["--method", untuned])
    with pytest.raises(SystemExit):
        tune.parse_args(["--help"])
    help_text = " ".join(capsys.readouterr().out.split())
    assert all(f"{name}: {why}" in help_text for name, why in tune.untuned().items())
    assert "--medusa PATH --method medusa: heads saved by" in help_text     # the flag MedusaOptions declares
    assert "--medusa-choices JSON" not in help_text and "--lookahead-window W" not in help_text   # grids set them
    monkeypatch.setitem(registry.METHODS, "toy", registry.Method(ToyOptions, build_toy, "no grid declared"))
    assert "toy" not in tune.tunable()
    monkeypatch.setitem(registry.METHODS, "chain", registry.Method(ChainOptions, build_chain, "a toy chain",
                                                                   tune=registry.CHAIN))
    assert tune.tunable()[-1] == "chain"
    BUILT.clear()
    qfile = tmp_path / "questions.jsonl"
    qfile.write_text(json.dumps({"question_id": "a", "category": "chat", "turns": ["abcabcabc"]}) + "\n")
    assert tune.main(["--method", "chain", "--toy-width", "5", "--num-tokens", "2", "--target", str(tiny_model_dir),
                      "--questions", str(qfile), "--max-new-tokens", "6", "--no-warmup"]) == 0
    out = capsys.readouterr().out
    assert {"chain K=2", "chain K=4 adaptive"} <= {line.split("|")[1].strip() for line in out.splitlines()
                                                   if line.startswith("| ")}
    assert set(BUILT) == {(5, 2), (5, 4)}                                # the flag reached every candidate
    assert "options=ChainOptions(num_tokens=" in out


def test_tune_reads_a_methods_grid_from_its_registry_entry(monkeypatch, tiny_model_dir, tmp_path, capsys):
    from eval import tune

    grid = registry.Tuning("grid", (registry.Axis("toy-widths", "width", (5, 6), "toy widths", "w"),))
    monkeypatch.setitem(registry.METHODS, "toy", registry.Method(ToyOptions, build_toy, "a toy", tune=grid))
    assert "toy" in tune.tunable() and "toy" not in tune.untuned()
    assert tune.parse_args(["--method", "toy"]).toy_widths == [5, 6]          # the entry's values are the default
    with pytest.raises(SystemExit):
        tune.parse_args(["--help"])
    help_text = " ".join(capsys.readouterr().out.split())
    assert "--toy-widths LIST toy: toy widths, comma-separated (default: 5,6)" in help_text
    assert "--toy-width K" not in help_text                                   # the grid sets the option instead
    BUILT.clear()
    qfile = tmp_path / "questions.jsonl"
    qfile.write_text(json.dumps({"question_id": "a", "category": "chat", "turns": ["abcabcabc"]}) + "\n")
    assert tune.main(["--method", "toy", "--toy-widths", "3,4", "--target", str(tiny_model_dir), "--questions",
                      str(qfile), "--max-new-tokens", "6", "--no-warmup"]) == 0
    out = capsys.readouterr().out
    assert {"toy w=3", "toy w=4"} <= {line.split("|")[1].strip() for line in out.splitlines() if line.startswith("| ")}
    assert set(BUILT) == {3, 4} and "--toy-width" in out.splitlines()[-1]   # each candidate, and how to select it


def test_training_takes_it_as_the_distill_method(toy, tmp_path):
    from trainers.distill import DistillConfig, distill, read_records, synthetic_prompt
    from trainers.targets import TargetConfig, tiny_target

    target = tiny_target(TargetConfig(name="tiny", kind="tiny", seed=0))
    cfg = DistillConfig(source="synthetic", limit=2, max_new_tokens=8, shard_size=2, backend="engine",
                        batch_size=1, method="toy", options={"toy": {"width": 3}})
    distill(target, cfg, tmp_path / "answers", progress=False)
    assert toy and set(toy) == {3}      # the pipeline's drafter, and those answering (a fresh one per sequence)
    for i, record in enumerate(read_records(tmp_path / "answers")):   # the target's own greedy answers
        prompt = synthetic_prompt(i, cfg, target)
        expected = reference_greedy(target, prompt, 8, eos=1)
        assert record["input_ids"] == prompt + expected[:expected.index(1) + 1 if 1 in expected else None], i
    with pytest.raises(ValueError, match=r"unknown key\(s\) \['toy_depth'\]"):
        DistillConfig(method="toy", options={"toy_depth": 3})


def test_flags_and_configs_give_the_same_options(toy):
    import argparse

    from eagle_lite.options import add_method_flags

    parser = argparse.ArgumentParser()
    add_method_flags(parser)
    args = parser.parse_args(["--toy-width", "9", "--exit-layer", "1", "--lookahead-window", "0"])
    config = {"toy": {"width": 9}, "exit_layer": 1, "lookahead": {"window": 0}, "tree": {"depth": 3}}
    assert every_options(option_values(args)) == every_options(option_values(config))
    assert options_of("layer_skip", args) == registry.LayerSkipOptions(exit_layer=1)
    assert options_of("toy", option_values(config)) == ToyOptions(9)
