"""The end of a training run tunes the new head's CPU tree on a few held-out prompts and saves it in the head."""
from __future__ import annotations

import json


def test_a_trained_head_gets_its_own_cpu_tree_with_the_command_that_tunes_it(tmp_path):
    import torch
    from conftest import save_tiny_llama

    from eagle_lite.heads.checkpoint import save_head
    from eagle_lite.heads.draft import DraftHead
    from eagle_lite.targets.loading import load_target
    from trainers.tree_tune import TREES, tune_tree

    model = save_tiny_llama(tmp_path / "model", 2048, eos_token_id=2, lm_head_scale=8.0)   # room for HumanEval
    target = load_target(str(model))
    torch.manual_seed(0)
    head = save_head(DraftHead.for_target(target), tmp_path / "head", target)
    result = tune_tree(str(model), head, threads=1)
    assert result["tree"] is not None and result["vanilla_tokens_per_s"] > 0   # every tree is exact: one is saved
    config = json.loads((head / "config.json").read_text())
    assert config["tree"] == result["tree"]
    assert ",".join(str(config["tree"][k]) for k in ("depth", "top_k", "total_tokens", "lookup")) in TREES
    assert config["tree_command"].startswith("python -m eval.tune --method eagle") and "--save-tree" in \
        config["tree_command"]


def test_the_gemma_head_ships_small_and_is_found_by_the_gguf_name():
    """`--target gemma-3-270m-q4_k_m.gguf --draft auto` finds the shipped head by the file's stem."""
    from eagle_lite.heads.checkpoint import HEADS_DIR, default_head_path, recommended_tree

    head = default_head_path("gemma-3-270m-q4_k_m")
    assert head == HEADS_DIR / "gemma-3-270m-q4_k_m"
    config = json.loads((head / "config.json").read_text())
    assert config["target"]["name"] == "gemma-3-270m-q4_k_m" and config["target"]["vocab_size"] == 262144
    assert config["dtype"] == "bfloat16" and config["draft_vocab_size"] == 8192
    assert (head / "model.safetensors").stat().st_size < 16 * 2**20
    assert recommended_tree(config, head, "cpu") is not None   # the tree the run tuned for it
    assert (head / "README.md").is_file()


def test_the_tune_decodes_on_one_thread_per_core_whatever_the_training_ran_on(monkeypatch, tmp_path):
    """The benchmark the training summary prints, generate and the server decode at one thread per core by default:
    the tune that sizes their tree runs there too, as the eval.tune command it prints (trainers import no eval), and a
    command that fails says why in one line."""
    import os
    import subprocess

    import pytest

    from trainers import tree_tune

    seen = []

    def run(args, **kw):
        seen.append((args, kw["cwd"]))
        return subprocess.CompletedProcess(args, 2, "", "error: no such head\n")

    monkeypatch.setattr(subprocess, "run", run)
    with pytest.raises(RuntimeError, match="eval.tune failed: error: no such head"):
        tree_tune.tune_tree("smollm2", tmp_path / "head")
    (args, cwd), = seen
    assert args[1:3] == ["-m", "eval.tune"] and args[args.index("--threads") + 1] == str(os.cpu_count())
    assert (cwd / "eval" / "tune.py").is_file()
