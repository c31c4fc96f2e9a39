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
    default = run_json(capsys, *common, "--draft", "random")     # the default method: eagle, a head being given
    assert default["method"] == "eagle" and default["token_ids"] == vanilla["token_ids"]
    auto = run_json(capsys, *common, "--method", "auto", "--draft", "random")
    assert auto["method"] == "auto" and auto["token_ids"] == vanilla["token_ids"]
    assert sum(c["steps"] for c in auto["choices"].values()) == auto["target_forwards"] - 1
    pinned = run_json(capsys, *common, "--method", "auto", "--draft", "random", "--tree-depth", "2")   # eagle runs it
    assert pinned["method"] == "eagle" and pinned["token_ids"] == vanilla["token_ids"] and "choices" not in pinned


def test_static_step_answers_as_the_engine_does(tiny_model_dir, capsys):
    """--static: the fixed-shape step (eager on a CPU) gives the engine's greedy answer, and samples (seeded: the same
    answer twice); what it cannot run is refused before the model loads."""
    common = ["--target", str(tiny_model_dir), "--prompt", "hello there", "--max-new-tokens", "20"]
    vanilla = run_json(capsys, *common, "--method", "vanilla")
    for method in ("vanilla", "eagle"):
        out = run_json(capsys, *common, "--method", method, "--draft", "random", "--static")
        assert out["token_ids"] == vanilla["token_ids"] and (out["method"], out["static"]) == (method, "eager")
    assert vanilla["static"] is None
    sampled = [*common, "--method", "eagle", "--draft", "random", "--static", "--temperature", "0.7", "--seed", "0"]
    out = run_json(capsys, *sampled)
    assert out["static"] == "eager" and out["token_ids"] == run_json(capsys, *sampled)["token_ids"]   # seeded
    assert run_json(capsys, *common, "--method", "vanilla", "--static", "off")["static"] is None
    assert main([*common, "--static", "--method", "lookup"]) == 2
    assert "runs methods eagle and vanilla" in capsys.readouterr().err
    assert main([*common, "--static", "cuda-graph", "--method", "vanilla"]) == 1     # a CPU target
    assert "captures CUDA graphs" in capsys.readouterr().err


def test_staged_and_both_sampling_rules_run_from_the_command_line(tiny_model_dir, capsys):
    common = ["--target", str(tiny_model_dir), "--prompt", "hello hello hello", "--max-new-tokens", "16",
              "--draft", "random", "--tree-lookup", "3"]
    vanilla = run_json(capsys, *common, "--method", "vanilla")
    staged = run_json(capsys, *common, "--method", "staged")
    assert staged["method"] == "staged" and staged["token_ids"] == vanilla["token_ids"]
    for rule in ("q", "match"):
        sampled = [*common, "--method", "eagle", "--temperature", "0.9", "--seed", "3", "--draft-sampling", rule]
        assert run_json(capsys, *sampled)["token_ids"] == run_json(capsys, *sampled)["token_ids"]


def test_a_reduced_vocabulary_head_drafts_over_the_whole_vocabulary_from_the_command_line(tiny_model_dir, tmp_path,
                                                                                           capsys):
    import torch

    from eagle_lite.heads.checkpoint import save_head
    from eagle_lite.heads.draft import DraftHead
    from eagle_lite.pipeline import load

    target = load(str(tiny_model_dir), method="vanilla").target
    torch.manual_seed(0)
    head = save_head(DraftHead.for_target(target, d2t=torch.arange(0, target.vocab_size, 2)), tmp_path / "head",
                     target)
    common = ["--target", str(tiny_model_dir), "--prompt", "hello there", "--max-new-tokens", "16"]
    vanilla = run_json(capsys, *common, "--method", "vanilla")
    for vocab in ("head", "full"):
        out = run_json(capsys, *common, "--method", "eagle", "--draft", str(head), "--draft-vocab", vocab)
        assert out["token_ids"] == vanilla["token_ids"]
    for static in ([], ["--static"]):
        assert run_json(capsys, *common, "--draft", str(head), "--draft-vocab", "full", *static)["token_ids"] == \
            vanilla["token_ids"]
    with pytest.raises(SystemExit) as exit_info:
        main([*common, "--draft-vocab", "all"])
    assert exit_info.value.code == 2 and "invalid choice: 'all'" in capsys.readouterr().err


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


@pytest.mark.parametrize("method", ["eagle", "auto"])
def test_scripted_chat_session(tiny_model_dir, method):
    script = "hello\nhow are you\n/stats\n/reset\nagain\n/quit\n"
    proc = subprocess.run(
        [sys.executable, "-m", "eagle_lite.generate", "--target", str(tiny_model_dir), "--method", method,
         "--draft", "random", "--max-new-tokens", "12"],
        input=script, capture_output=True, text=True, timeout=300,
        env={**os.environ, "HF_HUB_OFFLINE": "1"},
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.count("bot> ") == 3
    assert proc.stderr.count("mean accepted length") == 3     # one stats line per answer
    assert "[2 answers," in proc.stderr                          # /stats after two answers
    assert ("[auto's choices: " in proc.stderr) == (method == "auto")   # and the controller's split
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
    from eagle_lite.config import TreeConfig, default_tree
    from eagle_lite.generate import build_parser
    from eagle_lite.heads.checkpoint import save_head
    from eagle_lite.heads.draft import DraftHead
    from eagle_lite.options import generation_config
    from eagle_lite.pipeline import load

    vanilla = load(str(tiny_model_dir), method="vanilla")
    head = save_head(DraftHead.for_target(vanilla.target), tmp_path / "head", vanilla.target,
                     extra={"tree": {"depth": 2, "top_k": 3, "total_tokens": 5}})
    lm = load(str(tiny_model_dir), draft=str(head), method="eagle")
    assert lm.tree == TreeConfig(2, 3, 5) and lm.config().tree == lm.tree and vanilla.tree == default_tree("cpu")
    out = lm.generate("hello there", lm.config(max_new_tokens=12))
    assert out.token_ids == vanilla.generate("hello there", vanilla.config(max_new_tokens=12)).token_ids
    args = build_parser().parse_args(["--tree-total-tokens", "4"])
    assert generation_config(args, lm.tree).tree == TreeConfig(2, 3, 4)
    assert generation_config(build_parser().parse_args([]), lm.tree).tree == TreeConfig(2, 3, 5)


def test_a_config_without_a_tree_runs_the_pipelines_tree_and_one_that_names_a_tree_runs_it(tiny_model_dir, tmp_path):
    """GenerationConfig(...) built by hand carries the generic TreeConfig(), a GPU-sized tree: a Pipeline runs its
    own (the head's recommended) tree in its place, unless the config names a tree, even TreeConfig() itself."""
    from eagle_lite.config import GenerationConfig, TreeConfig
    from eagle_lite.heads.checkpoint import save_head
    from eagle_lite.heads.draft import DraftHead
    from eagle_lite.pipeline import load

    target = load(str(tiny_model_dir), method="vanilla").target
    head = save_head(DraftHead.for_target(target), tmp_path / "head", target,
                     extra={"tree": {"depth": 2, "top_k": 3, "total_tokens": 5}})
    lm = load(str(tiny_model_dir), draft=str(head), method="eagle")
    ran: list[TreeConfig] = []
    engine_stream = lm.engine.stream   # the engine's generate runs its stream
    lm.engine.stream = lambda ids, cfg, *rest: ran.append(cfg.tree) or engine_stream(ids, cfg, *rest)
    lm.generate("hello there", GenerationConfig(max_new_tokens=4))
    "".join(lm.stream("hello there", GenerationConfig(max_new_tokens=4, seed=1)))
    lm.generate("hello there", GenerationConfig(max_new_tokens=4, tree=TreeConfig()))
    lm.generate("hello there", GenerationConfig(max_new_tokens=4, tree=TreeConfig(1, 1, 1)))
    lm.generate("hello there")
    assert ran == [TreeConfig(2, 3, 5), TreeConfig(2, 3, 5), TreeConfig(), TreeConfig(1, 1, 1), TreeConfig(2, 3, 5)]


def test_a_head_without_a_tree_for_the_device_is_noted_once_with_how_to_find_one(tiny_model_dir, tmp_path, capsys):
    """A freshly trained head recommends no tree: the CLI says which one runs and how to find this machine's; not
    when the head has one, nor when the tree flags choose it, nor for an untrained head (eval.tune refuses it)."""
    from eagle_lite.config import TreeConfig
    from eagle_lite.generate import main
    from eagle_lite.heads.checkpoint import save_head
    from eagle_lite.heads.draft import DraftHead
    from eagle_lite.pipeline import load

    target = load(str(tiny_model_dir), method="vanilla").target
    bare = save_head(DraftHead.for_target(target), tmp_path / "bare", target)
    tuned = save_head(DraftHead.for_target(target), tmp_path / "tuned", target,
                      extra={"tree": {"depth": 2, "top_k": 3, "total_tokens": 5}})
    common = ["--target", str(tiny_model_dir), "--prompt", "hi", "--max-new-tokens", "4", "--method", "eagle"]
    assert main([*common, "--draft", str(bare)]) == 0
    err = capsys.readouterr().err
    assert err.count("note: the head recommends no draft tree for cpu") == 1
    assert f"--draft {bare} --save-tree" in err and "(depth 1, top_k 1, total_tokens 1, lookup 4)" in err
    assert load(str(tiny_model_dir), draft=str(bare), method="eagle").tree == TreeConfig(1, 1, 1, lookup=4)
    for flags in (["--draft", str(tuned)], ["--draft", str(bare), "--tree-depth", "2"], ["--draft", "random"]):
        assert main([*common, *flags]) == 0
        assert "recommends no draft tree" not in capsys.readouterr().err


def test_a_target_without_a_head_drafts_by_prompt_lookup_by_default(tiny_model_dir, caplog):
    from eagle_lite import load

    lm = load(str(tiny_model_dir))                      # no head ships for it: the default is lookup
    assert lm.method == "lookup" and "the default method is lookup" in caplog.text
    auto = load(str(tiny_model_dir), method="auto")     # auto chooses between lookup and plain steps
    assert auto.method == "auto" and auto.engine.drafter.head is None and "prompt lookup" in caplog.text
    prompt = "abcabcabcabc"                             # repeats: lookup drafts from the prompt
    vanilla = load(str(tiny_model_dir), method="vanilla")
    cfg = vanilla.config(max_new_tokens=24, stop_at_eos=False)
    assert lm.generate(prompt, cfg).token_ids == vanilla.generate(prompt, cfg).token_ids

    name = lm.target.name
    assert lm.describe() == f"target {name} · method lookup"
    head = load(str(tiny_model_dir), method="eagle", draft="random")
    assert head.describe() == f"target {name} · method eagle · head random"


def test_a_one_shot_answer_says_which_target_method_and_head_ran(tiny_model_dir):
    proc = subprocess.run(cli("--target", str(tiny_model_dir), "--prompt", "hi", "--max-new-tokens", "4",
                              "--method", "eagle", "--draft", "random"), capture_output=True, text=True, env=ENV)
    assert proc.returncode == 0, proc.stderr
    stats = proc.stderr.strip().splitlines()[-1]
    assert "mean accepted length" in stats and f"target {tiny_model_dir} · method eagle · head random" in stats


# -- what a user types or does never ends in a traceback -------------------------------------------------------
ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}


def cli(*args: str | bytes) -> list:
    return [sys.executable, "-m", "eagle_lite.generate", *args]


def test_clean_text_makes_any_input_valid_text():
    from eagle_lite.text.chat_format import clean_text

    assert clean_text("plain ascii") == "plain ascii"
    assert clean_text("a\x00b") == "ab"                                     # NUL is dropped
    assert clean_text("Hi \udced\udca0\udc80 there \udcff") == "Hi \ufffd\ufffd\ufffd there \ufffd"
    assert clean_text("caf\udcc3\udca9") == "café"                           # escaped bytes that form UTF-8
    assert clean_text("lone \ud800 surrogate") == "lone \ufffd surrogate"    # e.g. from a JSON "\ud800" escape
    clean_text("\ud800\udcff\x00").encode("utf-8")                          # always encodable


def test_invalid_utf8_in_a_prompt_is_answered(tiny_model_dir):
    proc = subprocess.run(cli("--target", str(tiny_model_dir), "--prompt", b"Hi \xed\xa0\x80 there \xff",
                              "--max-new-tokens", "6", "--method", "vanilla", "--json"),
                          capture_output=True, timeout=300, env=ENV)
    assert proc.returncode == 0, proc.stderr.decode()
    assert json.loads(proc.stdout)["new_tokens"] == 6


def test_piped_chat_takes_bad_bytes_and_writes_no_prompts(tiny_model_dir):
    proc = subprocess.run(cli("--target", str(tiny_model_dir), "--max-new-tokens", "5", "--method", "vanilla"),
                          input=b"Hi \x00 there \xff\nSecond line\n/quit\n", capture_output=True, timeout=300,
                          env={**ENV, "PYTHONIOENCODING": "utf-8"})   # strict decoding, as in most UTF-8 locales
    assert proc.returncode == 0, proc.stderr.decode()
    assert proc.stdout.decode().count("bot> ") == 2 and proc.stderr.decode().count("mean accepted length") == 2
    assert "you>" not in proc.stdout.decode() + proc.stderr.decode()   # prompts are for a terminal only


class FailingOnce:
    """A pipeline whose first answer fails inside the turn; it records the conversations it is given."""

    method, target = "vanilla", type("T", (), {"name": "fake"})()

    def __init__(self) -> None:
        self.seen: list[list[dict]] = []

    def describe(self) -> str:
        return "target fake · method vanilla"

    def stream(self, messages, cfg, stats=None):
        self.seen.append([dict(m) for m in messages])
        if len(self.seen) == 1:
            raise TypeError("TextEncodeInput must be Union[TextInputSequence, Tuple[InputSequence, InputSequence]]")
        yield "fine"


def test_an_error_inside_a_chat_turn_keeps_the_session(monkeypatch, capsys):
    import io

    from eagle_lite.config import GenerationConfig
    from eagle_lite.generate import chat

    monkeypatch.setattr(sys, "stdin", io.StringIO("first\nsecond\nthird\n"))
    lm = FailingOnce()
    chat(lm, GenerationConfig())
    out, err = capsys.readouterr()
    assert "error: this turn failed (TypeError" in err and "the conversation goes on" in err
    assert out.count("fine") == 2
    assert [m["content"] for m in lm.seen[1]] == ["second"]             # the failed turn is not in the history
    assert [m["content"] for m in lm.seen[2]] == ["second", "fine", "third"]


def test_ctrl_c_at_the_chat_prompt_keeps_the_conversation(monkeypatch, capsys):
    from eagle_lite import generate
    from eagle_lite.config import GenerationConfig

    typed = iter([KeyboardInterrupt, "first", KeyboardInterrupt, "second", EOFError])

    def read_turn(adapter=None):
        step = next(typed)
        if isinstance(step, type):
            raise step()
        return step

    monkeypatch.setattr(generate, "read_turn", read_turn)
    lm = FailingOnce()
    generate.chat(lm, GenerationConfig())
    assert "(/quit or Ctrl-D ends the chat)" in capsys.readouterr().err
    assert [m["content"] for m in lm.seen[1]] == ["second"] and len(lm.seen) == 2   # the session went on


@pytest.fixture(scope="module")
def endless_model_dir(tmp_path_factory):
    """A tiny random Llama with no EOS and a long context: it writes until it is stopped."""
    from conftest import save_tiny_llama

    return save_tiny_llama(tmp_path_factory.mktemp("endless-model"), 8192, eos_token_id=None)


def interrupt_after_first_byte(args: list, stream: str) -> subprocess.CompletedProcess:
    """Start the CLI, wait until it writes its first byte to `stream` (stdout or stderr), then press Ctrl-C."""
    import signal

    # a runner started in the background hands its children SIGINT ignored, and Python then never raises
    # KeyboardInterrupt: the CLI gets the default disposition, as from a terminal
    proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=ENV,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    first = getattr(proc, stream).read(1)
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=300)
    out, err = (first + out, err) if stream == "stdout" else (out, first + err)
    return subprocess.CompletedProcess(args, proc.returncode, out.decode(), err.decode())


def test_ctrl_c_during_a_one_shot_answer_keeps_the_text_and_prints_the_stats(endless_model_dir):
    proc = interrupt_after_first_byte(cli("--target", str(endless_model_dir), "--prompt", "hello", "--method",
                                          "vanilla", "--max-new-tokens", "8000", "--threads", "1"), "stdout")
    assert proc.returncode == 130, proc.stderr
    assert "Traceback" not in proc.stderr and "KeyboardInterrupt" not in proc.stderr
    assert proc.stdout.strip()                                             # the text generated so far
    lines = proc.stderr.strip().splitlines()
    assert lines[-2] == "[stopped]" and "mean accepted length" in lines[-1]


def test_ctrl_c_while_loading_stops_without_a_traceback(tiny_model_dir):
    # the target load is made to announce itself and hang, so Ctrl-C lands inside it
    slow_load = ("import sys, time\n"
                 "import eagle_lite.pipeline as p\n"
                 "def hang(*a, **k):\n"
                 "    print('loading', file=sys.stderr, flush=True)\n"
                 "    time.sleep(600)\n"
                 "p.load_target = hang\n"
                 "from eagle_lite.generate import main\n"
                 f"sys.exit(main(['--target', {str(tiny_model_dir)!r}, '--prompt', 'hi']))\n")
    proc = interrupt_after_first_byte([sys.executable, "-c", slow_load], "stderr")
    assert proc.returncode == 130, proc.stderr
    assert "Traceback" not in proc.stderr and "[stopped while loading" in proc.stderr


def test_threads_are_checked_before_loading(tiny_model_dir, capsys, monkeypatch, caplog):
    from eagle_lite import threads
    from eagle_lite.threads import check_threads

    assert main(["--target", "no/such/model", "--prompt", "x", "--threads", "0"]) == 2
    assert "--threads must be a whole number >= 1" in capsys.readouterr().err
    monkeypatch.setattr(os, "cpu_count", lambda: 4)
    monkeypatch.setattr(threads, "_warned", set())
    assert check_threads(999) == 999 and "more than the 4 CPU cores" in caplog.text
    assert check_threads(None) is None and check_threads(4) == 4
    with pytest.raises(ValueError, match="target.threads must be"):
        check_threads(-1, "target.threads")
    # a count no machine has is refused: starting that many threads ends the process without a word (SIGSEGV)
    assert main(["--target", "no/such/model", "--prompt", "x", "--threads", "100000000"]) == 2
    assert "--threads must be at most 1024" in capsys.readouterr().err


def test_set_threads_is_the_one_place_torch_threads_are_set():
    from pathlib import Path

    import torch

    from eagle_lite.threads import set_threads

    before = torch.get_num_threads()
    try:
        assert set_threads(2) == 2 == torch.get_num_threads()
        assert set_threads(None) == 2   # None leaves the count as it is
        with pytest.raises(ValueError, match="target.threads must be a whole number"):
            set_threads(0, "target.threads")
        assert torch.get_num_threads() == 2   # a refused count changes nothing
    finally:
        torch.set_num_threads(before)
    # every runtime entry point, eval tool and trainer goes through set_threads (hf4_peer runs in a venv without
    # eagle_lite); a new direct call would skip the check that stops a count no machine has from crashing torch
    root = Path(__file__).resolve().parents[1]
    files = [f for folder in ("eagle_lite", "trainers", "eval") for f in (root / folder).rglob("*.py")]
    direct = [str(f.relative_to(root)) for f in files
              if "torch.set_num_threads(" in f.read_text() and f.name not in ("threads.py", "hf4_peer.py")]
    assert direct == []


def test_a_tree_top_k_wider_than_the_draft_vocabulary_drafts_every_token(tiny_model_dir, capsys):
    common = ["--target", str(tiny_model_dir), "--draft", "random", "--prompt", "hi", "--max-new-tokens", "4"]
    expected = run_json(capsys, *common, "--method", "vanilla")["token_ids"]
    assert run_json(capsys, *common, "--tree-top-k", "500", "--tree-total-tokens", "8")["token_ids"] == expected


def test_tree_flags_are_checked_against_the_heads_tree_not_the_default(tiny_model_dir, tmp_path, capsys):
    from eagle_lite.heads.checkpoint import save_head
    from eagle_lite.heads.draft import DraftHead
    from eagle_lite.pipeline import load

    vanilla = load(str(tiny_model_dir), method="vanilla")
    head = save_head(DraftHead.for_target(vanilla.target), tmp_path / "head", vanilla.target,
                     extra={"tree": {"depth": 1, "top_k": 1, "total_tokens": 1, "lookup": 4}})
    common = ["--target", str(tiny_model_dir), "--draft", str(head), "--prompt", "hi", "--max-new-tokens", "4"]
    assert main([*common, "--tree-top-k", "2", "--json"]) == 0          # 1,2,1,4: fits the head's tree
    capsys.readouterr()
    assert main([*common, "--tree-depth", "0"]) == 2                    # no tree takes it: refused before loading
    assert "tree depth must be >= 1" in capsys.readouterr().err


@pytest.mark.parametrize("args, message", [
    (["--draft", "{nowhere}"], "no draft head at"),
    (["--method", "medusa", "--medusa", "{nowhere}"], "no Medusa heads at"),
    (["--method", "medusa", "--medusa", "random", "--medusa-choices", "[[0],"], "are not valid JSON"),
    (["--method", "draft_model", "--draft-model", "{nowhere}"], "draft model '"),
    (["--method", "eagle", "--draft", "random", "--tree-total-tokens", "0"], "total_tokens must be >= 1"),
])
def test_generate_checks_its_inputs_before_the_target_loads(args, message, tmp_path, capsys, monkeypatch):
    import eagle_lite.pipeline

    def refuse(*a, **k):
        raise AssertionError("the target was loaded before the inputs were checked")

    monkeypatch.setattr(eagle_lite.pipeline, "load_target", refuse)
    code = main(["--prompt", "x", *[a.format(nowhere=tmp_path / "nowhere") for a in args]])
    err = capsys.readouterr().err
    assert code in (1, 2) and message in err and len(err.strip().splitlines()) == 1


def test_chat_with_adapt_learns_between_turns_and_keeps_a_head_folder(tiny_model_dir, tmp_path):
    """--adapt in the chat: answers as without it, /stats says what the head learned, /reset-head is a command; a
    folder that cannot be written and a method without a head are refused in one line before loading."""
    folder = tmp_path / "adapted"
    script = "".join(f"question number {i} about the weather\n" for i in range(4)) + "/stats\n/reset-head\n/quit\n"
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    common = ["--target", str(tiny_model_dir), "--draft", "random", "--max-new-tokens", "40"]
    proc = subprocess.run(cli(*common, "--adapt", str(folder)), input=script, capture_output=True, text=True,
                          timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr
    assert "[adapt: 4 answers" in proc.stderr or "[adapt: 3 answers" in proc.stderr, proc.stderr
    assert "serves again" in proc.stderr
    plain = subprocess.run(cli(*common), input=script.replace("/reset-head\n", ""), capture_output=True, text=True,
                           timeout=300, env=env)
    assert plain.stdout == proc.stdout                                     # the same answers
    file = tmp_path / "file"
    file.write_text("")
    bad = subprocess.run(cli(*common, "--adapt", str(file / "sub"), "--prompt", "hi"), capture_output=True,
                         text=True, timeout=300, env=env)
    assert bad.returncode == 1 and "Not a directory" in bad.stderr and "Traceback" not in bad.stderr
    lookup = subprocess.run(cli(*common[:2], "--method", "lookup", "--adapt", str(folder), "--prompt", "hi"),
                            capture_output=True, text=True, timeout=300, env=env)
    assert lookup.returncode != 0 and "--adapt trains a draft head" in lookup.stderr
