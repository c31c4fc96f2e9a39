"""The CLI contract: --help, one-shot --json, eagle == vanilla, a scripted chat session, clear errors."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from eagle_lite.generate import main

def run_json(capsys, *args) -> dict:
    assert main(list(args) + ["--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_help_explains_the_flags(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["--help"])
    assert exit_info.value.code == 0
    text = capsys.readouterr().out
    for flag in ("--prompt", "--method", "--draft", "--max-new-tokens", "--temperature", "--seed", "--json",
                 "--tree-depth", "--target", "--threads", "--attention"):
        assert flag in text


def test_one_shot_json_eagle_equals_vanilla(tiny_model_dir, capsys):
    common = ["--target", str(tiny_model_dir), "--prompt", "hello there", "--max-new-tokens", "24"]
    vanilla = run_json(capsys, *common, "--method", "vanilla")
    eagle = run_json(capsys, *common, "--method", "eagle", "--draft", "random")
    for key in ("text", "token_ids", "new_tokens", "seconds", "tokens_per_s", "target_forwards", "accept_length_mean"):
        assert key in eagle
    assert eagle["token_ids"] == vanilla["token_ids"] and eagle["text"] == vanilla["text"]
    assert vanilla["target_forwards"] == vanilla["new_tokens"] and vanilla["accept_length_mean"] == 1.0
    assert 1 <= eagle["new_tokens"] <= 24 and eagle["method"] == "eagle"


def test_seeded_sampling_is_reproducible(tiny_model_dir, capsys):
    common = ["--target", str(tiny_model_dir), "--prompt", "hi", "--max-new-tokens", "16", "--temperature", "0.9",
              "--seed", "3", "--method", "eagle", "--draft", "random"]
    assert run_json(capsys, *common)["token_ids"] == run_json(capsys, *common)["token_ids"]


def test_errors_are_clear(tiny_model_dir, capsys):
    assert main(["--target", str(tiny_model_dir), "--prompt", "x", "--method", "eagle"]) == 1
    assert "no draft head ships" in capsys.readouterr().err
    assert main(["--target", str(tiny_model_dir), "--prompt", "x", "--tree-total-tokens", "999"]) == 2
    assert "total_tokens=999 exceeds" in capsys.readouterr().err
    assert main(["--target", str(tiny_model_dir), "--prompt", "x" * 300]) == 1
    assert "context window of 256" in capsys.readouterr().err
    assert main(["--target", str(tiny_model_dir), "--prompt", "x", "--device", "gpu0"]) == 1
    assert "unknown device 'gpu0'" in capsys.readouterr().err


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="needs a machine without CUDA")
def test_asking_for_a_gpu_that_is_not_there_says_so_before_loading(tiny_model_dir, capsys):
    from eval import benchmark, profile_step, tune

    assert main(["--target", str(tiny_model_dir), "--prompt", "x", "--device", "cuda"]) == 1
    assert "sees no CUDA GPU" in capsys.readouterr().err
    for tool, args in ((benchmark, ["--methods", "vanilla"]), (tune, ["--method", "lookup"]), (profile_step, [])):
        assert tool.main(["--target", str(tiny_model_dir), "--device", "cuda", *args]) == 1
        assert "sees no CUDA GPU" in capsys.readouterr().err


def test_scripted_chat_session(tiny_model_dir):
    script = "hello\nhow are you\n/stats\n/reset\nagain\n/quit\n"
    proc = subprocess.run(
        [sys.executable, "-m", "eagle_lite.generate", "--target", str(tiny_model_dir), "--method", "eagle",
         "--draft", "random", "--max-new-tokens", "12"],
        input=script, capture_output=True, text=True, timeout=300,
        env={**os.environ, "HF_HUB_OFFLINE": "1"},
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.count("bot> ") == 3
    assert proc.stderr.count("mean accepted length") == 3     # one stats line per answer
    assert "[2 answers," in proc.stderr                          # /stats after two answers
    assert "(new conversation)" in proc.stderr


def test_attention_backend_flag_keeps_the_output(tiny_model_dir, capsys):
    common = ["--target", str(tiny_model_dir), "--prompt", "abc", "--max-new-tokens", "12", "--method", "eagle",
              "--draft", "random"]
    sdpa = run_json(capsys, *common)
    assert run_json(capsys, *common, "--attention", "lse_merge")["token_ids"] == sdpa["token_ids"]
    assert main([*common, "--attention", "flash"]) == 1
    assert "flash" in capsys.readouterr().err


def test_chat_survives_a_conversation_longer_than_the_context(tiny_model_dir):
    script = ("x" * 300) + "\nhi\n/quit\n"     # the first turn cannot fit 256 tokens; the next one can
    proc = subprocess.run(
        [sys.executable, "-m", "eagle_lite.generate", "--target", str(tiny_model_dir), "--method", "vanilla",
         "--max-new-tokens", "5"],
        input=script, capture_output=True, text=True, timeout=300, env={**os.environ, "HF_HUB_OFFLINE": "1"},
    )
    assert proc.returncode == 0, proc.stderr
    assert "context window of 256" in proc.stderr and "/reset" in proc.stderr
    assert proc.stderr.count("mean accepted length") == 1     # the second turn was answered


def test_the_heads_recommended_tree_is_the_default_and_flags_override_it(tiny_model_dir, tmp_path):
    from eagle_lite.checkpoint import save_head
    from eagle_lite.config import TreeConfig
    from eagle_lite.draft import DraftHead
    from eagle_lite.generate import build_parser, generation_config
    from eagle_lite.pipeline import load

    vanilla = load(str(tiny_model_dir), method="vanilla")
    head = save_head(DraftHead.for_target(vanilla.target), tmp_path / "head", vanilla.target,
                     extra={"tree": {"depth": 2, "top_k": 3, "total_tokens": 5}})
    lm = load(str(tiny_model_dir), draft=str(head), method="eagle")
    assert lm.tree == TreeConfig(2, 3, 5) and lm.config().tree == lm.tree and vanilla.tree == TreeConfig()
    out = lm.generate("hello there", lm.config(max_new_tokens=12))
    assert out.token_ids == vanilla.generate("hello there", vanilla.config(max_new_tokens=12)).token_ids
    args = build_parser().parse_args(["--tree-total-tokens", "4"])
    assert generation_config(args, lm.tree).tree == TreeConfig(2, 3, 4)
    assert generation_config(build_parser().parse_args([]), lm.tree).tree == TreeConfig(2, 3, 5)


def test_a_target_without_a_head_drafts_by_prompt_lookup_by_default(tiny_model_dir, caplog):
    from eagle_lite import load

    lm = load(str(tiny_model_dir))                      # no head ships for it
    assert lm.method == "lookup" and "prompt lookup" in caplog.text
    prompt = "abcabcabcabc"                             # repeats: lookup drafts from the prompt
    vanilla = load(str(tiny_model_dir), method="vanilla")
    cfg = vanilla.config(max_new_tokens=24, stop_at_eos=False)
    assert lm.generate(prompt, cfg).token_ids == vanilla.generate(prompt, cfg).token_ids
