"""The drafter registry and tree resolution: one place builds every method and resolves "auto" and the tree."""
from __future__ import annotations

import dataclasses

import pytest
from conftest import make_target

from eagle_lite.config import TreeConfig, resolve_tree
from eagle_lite.drafters import registry
from eagle_lite.drafters.lookup_graft import LookupGraft
from eagle_lite.options import options_of


def test_every_registered_method_builds_a_drafter_with_its_default_options(monkeypatch):
    target = make_target("llama")
    built = {}
    for name in registry.names():
        options = {"eagle": registry.EagleOptions(draft="random"), "staged": registry.EagleOptions(draft="random"),
                   "medusa": registry.MedusaOptions(heads="random"),
                   "draft_model": registry.DraftModelOptions(draft_target=target)}.get(name)
        built[name] = registry.build(name, target, options)
    assert isinstance(built["eagle"], LookupGraft) and built["eagle"].inner.name == "eagle"
    assert built["staged"].name == "staged" and built["staged"].staged and not built["eagle"].staged
    assert built["vanilla"].max_tree_nodes(TreeConfig()) == 1
    assert {type(d).__name__ for d in built.values()} >= {"PromptLookupDrafter", "NoDrafter", "MedusaDrafter"}


def test_auto_loads_the_head_given_or_shipped_and_runs_without_one(monkeypatch):
    target = make_target("llama")
    monkeypatch.setattr("eagle_lite.heads.checkpoint.default_head_path", lambda name: None)
    name, options = registry.resolve("auto", target)
    assert name == "auto" and options.head is None       # no head ships: lookup and plain steps
    name, options = registry.resolve("auto", target, registry.EagleOptions(draft="random"))
    assert name == "auto" and options.head is not None


def test_the_default_is_eagle_with_a_head_and_lookup_without_one(monkeypatch):
    from eagle_lite.options import add_model_flags

    target = make_target("llama")
    monkeypatch.setattr("eagle_lite.heads.checkpoint.default_head_path", lambda name: None)
    name, options = registry.resolve(registry.DEFAULT, target)
    assert name == "lookup" and isinstance(options, registry.LookupOptions)
    name, options = registry.resolve(registry.DEFAULT, target, registry.EagleOptions(draft="random"))
    assert name == "eagle" and options.head is not None
    assert isinstance(registry.build(registry.DEFAULT, target, registry.EagleOptions(draft="random")), LookupGraft)
    import argparse

    parser = argparse.ArgumentParser()
    add_model_flags(parser)
    assert parser.parse_args([]).method == registry.DEFAULT == "default"   # the CLI's and the server's default


def test_options_are_checked_before_a_model_loads():
    with pytest.raises(ValueError, match="needs --draft-model"):
        registry.check("draft_model")
    with pytest.raises(ValueError, match="needs --medusa PATH"):
        registry.check("medusa", registry.MedusaOptions())
    with pytest.raises(ValueError, match="unknown method 'nope'"):
        registry.check("nope")
    with pytest.raises(TypeError, match="takes LookupOptions"):
        registry.options_for("lookup", registry.EagleOptions())
    with pytest.raises(ValueError, match="draft_sampling must be one of q, match"):
        registry.check("staged", registry.EagleOptions(draft_sampling="greedy"))
    with pytest.raises(ValueError, match="draft_vocab must be one of head, full"):
        registry.check("eagle", registry.EagleOptions(draft_vocab="all"))


def test_flags_reach_the_eagle_options():
    for name in ("eagle", "staged", "auto"):
        assert options_of(name, {"draft": "random", "draft_sampling": "match"}) == registry.EagleOptions(
            draft="random", draft_sampling="match")
    assert options_of("eagle").draft_sampling == registry.EagleOptions().draft_sampling
    assert options_of("eagle", {"draft_vocab": "full", "exit_layer": 3}) == registry.EagleOptions(draft_vocab="full")


def test_the_tree_is_defaults_then_the_recommendation_then_the_flags():
    recommended = TreeConfig(depth=1, top_k=1, total_tokens=1, lookup=4)
    assert resolve_tree() == TreeConfig()
    assert resolve_tree(recommended) == recommended
    assert resolve_tree(recommended, device="cuda") == recommended
    assert resolve_tree(recommended, depth=None, lookup=0) == TreeConfig(1, 1, 1, 0)
    with pytest.raises(ValueError, match="unknown tree setting"):
        resolve_tree(recommended, width=3)
    with pytest.raises(ValueError, match="total_tokens=50 exceeds"):
        resolve_tree(recommended, total_tokens=50)


@pytest.mark.parametrize("device, tree", [
    ("cpu", TreeConfig(1, 1, 1, lookup=4)),           # every node and draft step costs ~a tenth of a plain step
    ("cuda", TreeConfig(6, 10, 60, lookup=8)),        # nodes nearly free: EAGLE-2's budget
    ("cuda:1", TreeConfig(6, 10, 60, lookup=8)),
    ("mps", TreeConfig(6, 10, 60, lookup=8)),
])
def test_without_a_recommendation_the_device_picks_the_tree_and_flags_still_override(device, tree):
    assert resolve_tree(None, device=device) == tree
    assert resolve_tree(None, device=device, top_k=2, total_tokens=2) == dataclasses.replace(tree, top_k=2,
                                                                                             total_tokens=2)
