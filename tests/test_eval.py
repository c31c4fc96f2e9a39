"""The evaluation runner: methods interleaved per question, identical-output check, summary table."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from eagle_lite.config import GenerationConfig, TreeConfig
from eagle_lite.drafters import EagleOptions
from eagle_lite.heads.draft import DraftHead
from eagle_lite.targets.loading import load_target
from eval import report, runner
from eval.methods import build_methods
from eval.runner import first_difference
from eval.tasks import load_question_file


@pytest.fixture(scope="module")
def chat_target(tiny_model_dir):
    return load_target(str(tiny_model_dir))


def test_runner_compares_every_method_to_the_baseline(chat_target, tmp_path):
    qfile = tmp_path / "q.jsonl"
    qfile.write_text("\n".join(json.dumps(q) for q in [
        {"question_id": 1, "category": "writing", "turns": ["write a poem", "shorter"]},
        {"question_id": 2, "category": "code", "turns": ["def f(x):"]},
    ]))
    questions = load_question_file(qfile)
    torch.manual_seed(0)
    methods = build_methods(chat_target, ["hf_generate", "vanilla", "eagle"],
                            {"eagle": EagleOptions(head=DraftHead.for_target(chat_target))})
    cfg = GenerationConfig(max_new_tokens=10, tree=TreeConfig(depth=3, top_k=3, total_tokens=8))
    records = runner.run(chat_target, questions, methods, cfg, baseline="hf_generate", warmup=False)
    assert len(records) == 3 * 3                      # 3 turns (2 + 1) x 3 methods
    # interleaved, the baseline first; the others take turns going first
    assert [r.method for r in records] == ["hf_generate", "vanilla", "eagle", "hf_generate", "eagle", "vanilla",
                                           "hf_generate", "vanilla", "eagle"]
    assert all(r.identical_to_baseline for r in records), [r for r in records if not r.identical_to_baseline]
    assert {r.question_id for r in records} == {"1#0", "1#1", "2"}
    rows = report.summarize(records, "hf_generate")
    assert {(r["category"], r["method"]) for r in rows} >= {("overall", "eagle"), ("code", "vanilla")}
    table = report.markdown_table(rows, "hf_generate")
    assert "| overall | eagle |" in table and "100%" in table
    # acceptance at each draft position, from every eagle step's tree depth (the tree above: at most 3 levels)
    eagle = next(r for r in rows if r["category"] == "overall" and r["method"] == "eagle")
    depths = [d for r in records if r.method == "eagle" for d in r.draft_depths]
    assert len(depths) == sum(len(r.accept_lengths) for r in records if r.method == "eagle")
    assert [d["depth"] for d in eagle["per_depth"]] == list(range(1, max(depths) + 1)) and max(depths) <= 3
    assert eagle["per_depth"][0]["drafted"] == sum(d >= 1 for d in depths)
    assert all(0.0 <= d["conditional"] <= 1.0 for d in eagle["per_depth"])
    vanilla = next(r for r in rows if r["category"] == "overall" and r["method"] == "vanilla")
    assert vanilla["per_depth"] == []   # plain steps draft nothing


def base_model_dir(tiny_model_dir, tmp_path):
    """The tiny chat model saved without its chat template, as a base model (GPT-2, Pythia) is."""
    import shutil

    base = tmp_path / "base"
    shutil.copytree(tiny_model_dir, base)
    config = json.loads((base / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (base / "tokenizer_config.json").write_text(json.dumps(config))
    for template in base.glob("chat_template.*"):
        template.unlink()
    return base


def test_a_base_model_without_a_chat_template_is_benchmarked_on_plain_prompts(tiny_model_dir, tmp_path):
    """No chat template (GPT-2, Pythia): prompts and earlier turns in the plain layout (chat_format.py)."""
    from eagle_lite.text.chat_format import chat_text

    target = load_target(str(base_model_dir(tiny_model_dir, tmp_path)))
    assert not getattr(target.tokenizer, "chat_template", None)
    questions = load_question_file(two_question_file(tmp_path))
    methods = build_methods(target, ["hf_generate", "vanilla", "eagle"],
                            {"eagle": EagleOptions(head=DraftHead.for_target(target))})
    cfg = GenerationConfig(max_new_tokens=8, tree=TreeConfig(depth=2, top_k=2, total_tokens=3))
    records = runner.run(target, questions, methods, cfg, baseline="hf_generate")
    assert records and all(r.identical_to_baseline for r in records)
    first = questions[0]
    ids = runner.conversation_prompts(target, first, [])
    text = chat_text(target.tokenizer, [{"role": "user", "content": first.turns[0]}])
    assert text == first.turns[0] + "\n\n"
    assert ids == target.tokenizer(text, add_special_tokens=False).input_ids


def test_a_base_model_takes_text_and_messages_in_the_plain_layout(tiny_model_dir, tmp_path):
    from eagle_lite import load

    lm = load(str(base_model_dir(tiny_model_dir, tmp_path)), method="vanilla")
    tok = lm.target.tokenizer
    assert lm.prompt_ids("hi") == tok("hi\n\n", add_special_tokens=False).input_ids
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"},
                {"role": "user", "content": "?"}]
    assert lm.prompt_ids(messages) == tok("hi\n\nyo" + tok.eos_token + "\n\n?\n\n", add_special_tokens=False).input_ids
    assert lm.prompt_ids("hi", chat_template=False) == tok.encode("hi")          # --raw: the text as it is
    assert lm.generate(messages, lm.config(max_new_tokens=4)).token_ids


def test_a_sampled_benchmark_runs_every_method_with_the_seed_and_checks_no_identity(tiny_model_dir, tmp_path, capsys):
    from eval import benchmark

    args = ["--target", str(tiny_model_dir), "--methods", "hf_generate,vanilla,eagle", "--draft", "random",
            "--tasks", "", "--questions", str(two_question_file(tmp_path)), "--per-task", "1", "--max-new-tokens", "12",
            "--temperature", "0.8", "--top-p", "0.9", "--seed", "3"]
    assert benchmark.main(args) == 0
    out = capsys.readouterr().out
    assert "sampling: temperature 0.8, top_p 0.9, top_k 0, seed 3" in out
    rows = [line for line in out.splitlines() if line.startswith("| overall |")]
    assert len(rows) == 3 and all(line.rstrip().endswith("| — |") for line in rows)   # identity not claimed


def test_a_benchmark_runs_vanilla_and_eagle_through_the_static_step(tiny_model_dir, tmp_path, capsys):
    """--static: vanilla and eagle through the fixed-shape step (eager on a CPU), transformers' generate() beside
    them as it is, greedy and sampled; the engine's other methods are refused in one line."""
    from eval import benchmark

    args = ["--target", str(tiny_model_dir), "--methods", "hf_generate,vanilla,eagle",
            "--draft", "random", "--tasks", "", "--questions", str(two_question_file(tmp_path)), "--per-task", "1",
            "--max-new-tokens", "12", "--tree-depth", "3", "--tree-top-k", "3", "--tree-total-tokens", "6",
            "--attention", "sdpa", "--static-max-len", "300"]
    assert benchmark.main([*args, "--static"]) == 0
    out = capsys.readouterr().out
    assert "vanilla, eagle: static step, mode auto" in out and "attention sdpa" in out
    rows = [line for line in out.splitlines() if line.startswith("| overall |")]
    assert len(rows) == 3 and all("| 100% |" in line for line in rows), rows
    assert benchmark.main([*args[:2], *args[4:], "--methods", "vanilla,eagle", "--static", "--temperature", "0.7"]) == 0
    assert "sampling: temperature 0.7" in capsys.readouterr().out
    assert benchmark.main([*args[:2], "--methods", "vanilla,lookup", *args[4:], "--static", "eager"]) == 1
    err = capsys.readouterr().err
    assert "--static eager runs methods vanilla and eagle" in err and "['lookup']" in err


def test_benchmark_runs_staged_and_each_sampling_rule(tiny_model_dir, tmp_path, capsys):
    """staged and eagle over the whole vocabulary beside eagle (greedy: identical to the baseline), and eagle_q /
    eagle_match sampled in one run."""
    from eval import benchmark
    from eval.methods import registry_method

    common = ["--target", str(tiny_model_dir), "--draft", "random", "--tasks", "", "--questions",
              str(two_question_file(tmp_path)), "--per-task", "1", "--max-new-tokens", "12", "--tree-lookup", "3"]
    assert benchmark.main(common + ["--methods", "vanilla,eagle,staged,eagle_full_vocab"]) == 0
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| overall |")]
    assert len(rows) == 4 and all(line.rstrip().endswith("| 100% |") for line in rows)
    assert registry_method("eagle_full_vocab", {"eagle": EagleOptions(draft="h")}) == (
        "eagle", EagleOptions(draft="h", draft_vocab="full"))
    sampled = ["--methods", "vanilla,eagle_q,eagle_match,eagle", "--temperature", "0.8", "--draft-sampling", "match"]
    assert benchmark.main(common + sampled) == 0
    out = capsys.readouterr().out
    assert "draft sampling match" in out
    assert {m for m in ("eagle_q", "eagle_match", "eagle") if f"| overall | {m} |" in out} == {"eagle_q", "eagle_match",
                                                                                              "eagle"}


def test_sampled_methods_draw_reproducibly_with_the_seed_and_are_not_compared(chat_target):
    from eagle_lite.config import SamplingConfig

    torch.manual_seed(0)
    methods = build_methods(chat_target, ["hf_generate", "vanilla", "eagle"],
                            {"eagle": EagleOptions(head=DraftHead.for_target(chat_target))})
    cfg = GenerationConfig(max_new_tokens=16, sampling=SamplingConfig(temperature=1.0), seed=5,
                           tree=TreeConfig(depth=2, top_k=2, total_tokens=2))
    prompt = [3, 4, 5, 6]
    for name, method in methods.items():
        first, again = method(prompt, cfg).token_ids, method(prompt, cfg).token_ids
        assert first == again and len(first) > 0, name
    other = GenerationConfig(max_new_tokens=16, sampling=cfg.sampling, seed=6, tree=cfg.tree)
    assert any(m(prompt, other).token_ids != m(prompt, cfg).token_ids for m in methods.values())
    records = runner.run(chat_target, [runner.Question("q", "chat", ["hello"])], methods, cfg,
                         baseline="hf_generate", warmup=False)
    assert len(records) == 3 and all(r.identical_to_baseline is None for r in records)
    assert "| overall | eagle |" in report.markdown_table(report.summarize(records, "hf_generate"), "hf_generate")


def test_repeats_rotate_the_order_keep_the_fastest_run_and_flag_a_repeat_that_differs(chat_target):
    from eval.methods import Run

    calls: list[str] = []

    def fake(name: str, times: list[float], tokens: list[list[int]]):
        def run(prompt, cfg):
            i = sum(c == name for c in calls)
            calls.append(name)
            return Run(tokens[i % len(tokens)], times[i % len(times)], 3, [2, 1])
        return run

    methods = {"base": fake("base", [1.0], [[1, 2]]), "a": fake("a", [0.5, 0.2, 0.4], [[1, 2]]),
               "b": fake("b", [0.3], [[1, 2], [1, 2], [1, 7]])}
    records = runner.run(chat_target, [runner.Question("q", "chat", ["hello"])], methods, GenerationConfig(),
                         baseline="base", warmup=False, repeats=3)
    assert calls == ["base", "a", "b", "base", "b", "a", "base", "a", "b"]   # the others take turns going first
    by = {r.method: r for r in records}
    assert [r.method for r in records] == ["base", "a", "b"]   # in the last repeat's order
    assert by["a"].seconds == 0.2 and by["a"].tokens_per_s == pytest.approx(10.0)
    assert by["a"].identical_to_baseline and not by["b"].identical_to_baseline and by["b"].first_mismatch == 1
    with pytest.raises(ValueError, match="repeats"):
        runner.run(chat_target, [], methods, GenerationConfig(), baseline="base", repeats=0)


def test_first_difference():
    assert first_difference([1, 2, 3], [1, 2, 3]) is None
    assert first_difference([1, 5, 3], [1, 2, 3]) == 1
    assert first_difference([1, 2], [1, 2, 3]) == 2


def test_unknown_method_is_refused(chat_target):
    with pytest.raises(ValueError, match="unknown method"):
        build_methods(chat_target, ["no_such_method"])
    with pytest.raises(ValueError, match="needs --draft-model"):
        build_methods(chat_target, ["hf_assisted"])


def test_llama_cpp_needs_a_gguf_target_and_says_what_to_install(chat_target, tiny_model_dir, monkeypatch):
    from eval.methods import gguf_of

    with pytest.raises(ValueError, match="needs the target's GGUF file"):
        build_methods(chat_target, ["llama_cpp"])
    with pytest.raises(ValueError, match="runs a GGUF file"):
        gguf_of(str(tiny_model_dir))
    monkeypatch.setitem(sys.modules, "llama_cpp", None)  # as if llama-cpp-python were not installed
    with pytest.raises(ValueError, match="pip install llama-cpp-python"):
        build_methods(chat_target, ["llama_cpp"], gguf=Path("model.gguf"))


def two_question_file(tmp_path):
    qfile = tmp_path / "questions.jsonl"
    qfile.write_text(json.dumps({"question_id": "a", "category": "chat", "turns": ["hi", "more"]}) + "\n"
                     + json.dumps({"question_id": "b", "category": "code", "turns": ["def f():"]}) + "\n")
    return qfile


def sweep_overrides(tiny_model_dir, qfile):
    return [f"target={tiny_model_dir}", "draft=random", "methods=[hf_generate,vanilla,eagle]", "task=file",
            f"task.tasks.0.path={qfile}", "max_new_tokens=8", "warmup=false",
            "tree.depth=3", "tree.top_k=3", "tree.total_tokens=8"]


def test_sweep_config_runs_end_to_end_and_writes_table_and_plots(tiny_model_dir, tmp_path):
    from hydra import compose, initialize_config_dir

    from eval.sweep import evaluate, settings_from, write_outputs

    with initialize_config_dir(config_dir=str(Path(__file__).parents[1] / "conf" / "eval"), version_base=None):
        cfg = compose("sweep", overrides=sweep_overrides(tiny_model_dir, two_question_file(tmp_path)))
    settings = settings_from(cfg)
    records, rows, header = evaluate(settings, progress=False)
    text = write_outputs(tmp_path / "out", records, rows, settings.baseline, header)
    assert len(records) == 3 * 3
    assert "| overall | eagle |" in text and "| chat | vanilla |" in text
    for name in ("records.jsonl", "summary.md", "summary.json", "speedup.png", "accept_lengths.png"):
        assert (tmp_path / "out" / name).stat().st_size > 0
    assert len((tmp_path / "out" / "records.jsonl").read_text().splitlines()) == 9


def test_sweep_runs_every_drafter(tiny_model_dir, tmp_path):
    from hydra import compose, initialize_config_dir

    from eval.sweep import evaluate, settings_from

    overrides = sweep_overrides(tiny_model_dir, two_question_file(tmp_path))
    overrides[2] = "methods=[vanilla,lookup,eagle,staged,layer_skip,draft_model,medusa,hf_assisted]"
    overrides += [f"draft_model={tiny_model_dir}", "exit_layer=1", "medusa=random"]
    with initialize_config_dir(config_dir=str(Path(__file__).parents[1] / "conf" / "eval"), version_base=None):
        settings = settings_from(compose("sweep", overrides=overrides + ["baseline=vanilla"]))
    records, rows, _ = evaluate(settings, progress=False)
    # hf_assisted: transformers' own assisted generation, same draft model
    assert {r.method for r in records} == {"vanilla", "lookup", "eagle", "staged", "layer_skip", "draft_model",
                                           "medusa", "hf_assisted"}
    assert all(r.identical_to_baseline for r in records)
    # the model drafting for itself is accepted in full
    assert min(r.accept_length_mean for r in records if r.method == "draft_model" and r.new_tokens > 4) > 1.5


def test_every_eval_task_config_composes():
    from hydra import compose, initialize_config_dir

    import eval.sweep  # noqa: F401  stores the methods' options, which the config's defaults list names

    conf = Path(__file__).parents[1] / "conf" / "eval"
    with initialize_config_dir(config_dir=str(conf), version_base=None):
        for task in sorted(p.stem for p in (conf / "task").glob("*.yaml")):
            cfg = compose("sweep", overrides=[f"task={task}"])
            assert cfg.task.tasks, task


def test_multirun_sweep_from_the_command_line(tiny_model_dir, tmp_path):
    args = [sys.executable, "-m", "eval.sweep", "-m", *sweep_overrides(tiny_model_dir, two_question_file(tmp_path)),
            "tree.total_tokens=4,8", f"hydra.sweep.dir={tmp_path / 'sweep'}"]
    proc = subprocess.run(args, capture_output=True, text=True, timeout=600,
                          cwd=Path(__file__).parents[1], env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    summaries = sorted((tmp_path / "sweep").glob("*/summary.md"))
    assert len(summaries) == 2
    assert "total_tokens 4" in summaries[0].read_text() + summaries[1].read_text()


def test_malformed_question_file_names_the_line(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"question_id": 1, "category": "x", "turns": ["ok"]}\n'
                   '{"question_id": 2, "turns": ["no category"]}\n')
    with pytest.raises(ValueError, match=r"bad.jsonl:2"):
        load_question_file(bad)


def test_profile_step_prints_where_the_time_goes(tiny_model_dir, capsys):
    from eval.profile_step import main as profile_main

    assert profile_main(["--target", str(tiny_model_dir), "--draft", "random", "--trees", "2,2,3",
                         "--max-new-tokens", "6", "--prompt", "hi"]) == 0
    out = capsys.readouterr().out
    assert "| vanilla | — |" in out and "| eagle d=2 k=2 n=3 |" in out and "| lookup |" in out
    assert profile_main(["--target", str(tiny_model_dir), "--draft", "random", "--trees", "2,2,3",
                         "--max-new-tokens", "6", "--prompt", "hi", "--static"]) == 0
    out = capsys.readouterr().out
    assert "| vanilla (static) | — |" in out and "| eagle d=2 k=2 n=3 (static) |" in out


def test_profile_step_sums_the_steps_of_a_question_files_prompts(tiny_model_dir, tmp_path, capsys):
    from eagle_lite.config import GenerationConfig
    from eagle_lite.decoding.engine import Engine
    from eagle_lite.drafters import registry
    from eagle_lite.pipeline import load
    from eval.profile_step import main as profile_main
    from eval.profile_step import profile

    questions = tmp_path / "q.jsonl"
    questions.write_text("".join(json.dumps({"question_id": f"{kind}{i}", "category": kind, "turns": [f"{kind} {i}"]})
                                 + "\n" for kind in ("a", "b") for i in range(3)))
    assert profile_main(["--target", str(tiny_model_dir), "--draft", "random", "--trees", "1,1,1,4",
                         "--max-new-tokens", "5", "--questions", str(questions), "--limit", "2"]) == 0
    out = capsys.readouterr().out
    assert f"{questions}: 4 prompts" in out and "| lookup |" in out and "| eagle d=1 k=1 n=1 lookup=4 |" in out
    # the steps of every prompt are summed: tokens a step are all new tokens but each prompt's first over all steps
    target = load(str(tiny_model_dir), method="vanilla").target
    rows = profile([("vanilla", Engine(target, registry.build("vanilla", target)), GenerationConfig(5))],
                   [[1, 2, 3], [4, 5], [6]])
    assert rows["vanilla"]["tokens_per_step"] == 1.0 and rows["vanilla"]["verify"] > 0


def test_step_cost_times_verify_against_tree_size_and_the_draft_step(capsys, tmp_path):
    from eval.step_cost import main as step_cost

    out_file = tmp_path / "cost.json"
    assert step_cost(["--tiny", "--sizes", "1,4,16", "--reps", "1", "--trees", "2,2,3", "--out", str(out_file)]) == 0
    out = capsys.readouterr().out
    assert "| 16 |" in out and "| d=2 k=2 n=3 |" in out and "vs 1 node (eager)" in out
    numbers = json.loads(out_file.read_text())["tiny"]
    assert set(numbers["verify"]["eager"]) == {"1", "4", "16"} and numbers["draft"]["eager"]["d=2 k=2 n=3"] > 0
    assert step_cost(["--tiny", "--modes", "cuda-graph"]) == 1
    assert "captures CUDA graphs" in capsys.readouterr().err


@pytest.mark.parametrize("flags, message", [(["--per-task", "-1"], "--per-task must be >= 0, got -1"),
                                            (["--static-max-len", "-5"], "--static-max-len must be >= 1, got -5")])
def test_benchmark_flags_are_checked_before_anything_loads(flags, message, capsys, monkeypatch):
    from eval import benchmark

    monkeypatch.setattr(benchmark, "evaluate", lambda *a, **k: pytest.fail("ran before the flags were checked"))
    assert benchmark.main(flags) == 2
    assert capsys.readouterr().err.strip() == f"error: {message}"


def test_step_cost_checks_its_out_file_before_measuring(capsys, tmp_path, monkeypatch):
    import eval.step_cost

    monkeypatch.setattr(eval.step_cost, "load", lambda *a, **k: pytest.fail("measured before --out was checked"))
    assert eval.step_cost.main(["--tiny", "--out", str(tmp_path)]) == 2
    assert capsys.readouterr().err.strip() == f"error: --out {tmp_path} is a folder: give a file name"
    assert eval.step_cost.main(["--tiny", "--out", "/proc/no/such.json"]) == 1
    assert capsys.readouterr().err.strip().startswith("error: No such file or directory (ENOENT): /proc/no")


# -- a user's mistake is one line, found before the target loads ---------------------------------------------------
def test_a_question_file_without_questions_is_an_error(tmp_path):
    empty, blank = tmp_path / "empty.jsonl", tmp_path / "blank.jsonl"
    empty.write_text("")
    blank.write_text("\n  \n")
    for path in (empty, blank):
        with pytest.raises(ValueError, match=f"question file {path} holds no questions"):
            load_question_file(path)
    with pytest.raises(FileNotFoundError, match="question file .*nowhere.jsonl not found"):
        load_question_file(tmp_path / "nowhere.jsonl")
    (tmp_path / "latin1.jsonl").write_bytes(b'{"question_id": 1, "category": "x", "turns": ["caf\xe9"]}\n')
    with pytest.raises(ValueError, match="latin1.jsonl is not UTF-8 text"):
        load_question_file(tmp_path / "latin1.jsonl")


@pytest.fixture
def no_target_load(monkeypatch):
    """Makes loading a target fail the test: what is checked here must be checked before."""
    def refuse(*args, **kwargs):
        raise AssertionError("the target was loaded before the inputs were checked")

    import eagle_lite.targets.loading
    import eval.evaluation
    import eval.profile_step

    for module in (eagle_lite.targets.loading, eval.evaluation, eval.profile_step):
        monkeypatch.setattr(module, "load_target", refuse)


# status 2: a flag wrong in itself (cli.arguments); 1: what it names is missing or does not fit
@pytest.mark.parametrize("tool, args, message, status", [
    ("benchmark", ["--questions", "{empty}", "--tasks", "humaneval"], "holds no questions", 1),
    ("benchmark", ["--methods", "vanilla,eagle", "--draft", "{nowhere}"], "no draft head at", 1),
    ("benchmark", ["--methods", "vanilla,medusa", "--medusa", "{nowhere}"], "no Medusa heads at", 1),
    ("benchmark", ["--methods", "vanilla,draft_model"], "needs --draft-model SPEC", 1),
    ("benchmark", ["--threads", "0"], "--threads must be a whole number >= 1", 2),
    ("benchmark", ["--tree-depth", "0"], "tree depth must be >= 1", 1),
    ("benchmark", ["--methods", "vanilla,eagle", "--static", "--draft", "{nowhere}"], "no draft head at", 1),
    ("benchmark", ["--methods", "vanilla,lookup", "--static"], "run on the engine only", 1),
    ("tune", ["--method", "lookup", "--questions", "{empty}"], "holds no questions", 1),
    ("tune", ["--method", "eagle", "--draft", "{nowhere}"], "no draft head at", 1),
    ("tune", ["--method", "eagle", "--depths", "1", "--top-ks", "1", "--totals", "4"], "no valid tree", 2),
    ("tune", ["--method", "draft_model", "--draft-model", "{nowhere}"], "draft model '", 1),
    ("tune", ["--method", "lookup", "--threads", "0"], "--threads must be a whole number >= 1", 2),
    ("tune", ["--method", "eagle", "--static", "--draft", "{nowhere}"], "no draft head at", 1),
    ("tune", ["--method", "eagle", "--static", "cuda-graph"], "captures CUDA graphs", 2),
    ("tune", ["--method", "eagle", "--static", "--trees", "10,16,128"], "larger than the static step's largest bucket",
     2),
    ("tune", ["--method", "lookup", "--static"], "--static tunes eagle's tree", 2),
    ("profile_step", ["--draft", "{nowhere}"], "no draft head at", 1),
    ("profile_step", ["--threads", "0"], "--threads must be a whole number >= 1", 2),
    ("profile_step", ["--limit", "0"], "--limit must be >= 1", 2),
    ("profile_step", ["--questions", "{nowhere}"], "not found", 1),
    ("ceiling", ["--draft", "{nowhere}"], "no draft head at", 1),
    ("ceiling", ["--trees", "2,2,2"], "--trees must be chains", 2),
])
def test_eval_inputs_are_checked_before_the_target_loads(tool, args, message, status, tmp_path, capsys, no_target_load):
    import importlib

    (tmp_path / "empty.jsonl").write_text("")
    paths = {"empty": tmp_path / "empty.jsonl", "nowhere": tmp_path / "nowhere"}
    main = importlib.import_module(f"eval.{tool}").main
    assert main(["--target", "tiny", *[a.format(**paths) for a in args]]) == status
    err = capsys.readouterr().err
    assert message in err and err.startswith("error: ") and len(err.strip().splitlines()) == 1


def test_tune_static_runs_the_static_step_against_its_own_vanilla_and_saves_its_tree(tiny_model_dir, tmp_path, capsys,
                                                                                       caplog):
    from eagle_lite.heads.checkpoint import read_head_config, recommend_tree, save_head
    from eval.tune import eagle_candidates, main

    target = load_target(str(tiny_model_dir))
    head = DraftHead.for_target(target)
    head_dir = save_head(head, tmp_path / "head", target)
    recommend_tree(head_dir, TreeConfig(2, 2, 2, lookup=3), device="cpu")   # the engine's eagle grafts lookup 3
    qfile = tmp_path / "questions.jsonl"
    qfile.write_text(json.dumps({"question_id": "a", "category": "chat", "turns": ["hi"]}) + "\n")
    rc = main(["--method", "eagle", "--static", "--target", str(tiny_model_dir), "--questions", str(qfile), "--draft",
               str(head_dir), "--max-new-tokens", "8", "--no-warmup", "--trees", "2,2,3", "1,1,1", "--save-tree"])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "eagle (static step, mode auto: vanilla too)" in out and "speedup vs vanilla" in out
    table = [line.split("|")[1].strip() for line in out.splitlines() if line.startswith("| ") and "---" not in line]
    assert sorted(table[1:]) == ["eagle d=1 k=1 n=1", "eagle d=2 k=2 n=3", "vanilla"]
    assert out.count("| 100% |") == 3                                    # every output equals vanilla's
    best = next(line for line in out.splitlines() if line.startswith("best: "))
    assert "--tree-lookup" not in best and best.endswith("--static auto") and "x vanilla" in best
    saved = read_head_config(head_dir)
    winner = {"eagle d=2 k=2 n=3": (2, 2, 3), "eagle d=1 k=1 n=1": (1, 1, 1)}[best.split(" at ")[0][6:]]
    assert saved["tree"] == {"depth": winner[0], "top_k": winner[1], "total_tokens": winner[2], "lookup": 3,
                             "min_prob": 0.0}                               # the lookup the head recommended kept
    assert saved["tree_command"].startswith("python -m eval.tune --method eagle --static")
    assert "lookup 3 kept" in out

    # the static step has no lookup graft: trees differing only in lookup run once, with one warning line
    candidates = eagle_candidates(target, head, [], [], [], trees=[TreeConfig(2, 2, 3), TreeConfig(2, 2, 3, 4)],
                                  static="eager")
    assert [c.label for c in candidates] == ["eagle d=2 k=2 n=3"]
    with caplog.at_level("WARNING", logger="eagle_lite"):
        assert main(["--method", "eagle", "--static", "--target", str(tiny_model_dir), "--questions", str(qfile),
                     "--draft", "random", "--max-new-tokens", "2", "--no-warmup", "--trees", "1,1,1,2"]) == 0
    assert [r.getMessage() for r in caplog.records if "prompt-lookup graft" in r.getMessage()] == [
        "--static: the static step drafts without the prompt-lookup graft: lookup lengths (--lookups, --trees) "
        "are ignored"]


def test_a_sweep_setting_error_is_one_line(tiny_model_dir, tmp_path):
    args = [sys.executable, "-m", "eval.sweep", f"target={tiny_model_dir}", f"draft={tmp_path / 'nowhere'}",
            "methods=[vanilla,eagle]", "baseline=vanilla", f"hydra.run.dir={tmp_path / 'run'}"]
    proc = subprocess.run(args, capture_output=True, text=True, timeout=600, cwd=Path(__file__).parents[1],
                          env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert proc.returncode == 1 and "Traceback" not in proc.stderr
    assert proc.stderr.strip().splitlines()[-1].startswith("error: no draft head at")


@pytest.mark.parametrize("override, message", [("max_new_tokens=abc", "max_new_tokens='abc' is not a whole number"),
                                               ("temperature=warm", "temperature='warm' is not a number"),
                                               ("methods=5", "methods=5 is not a list"),
                                               ("tree=5", "tree=5 is not a mapping"),
                                               ("lookahead=5", "lookahead=5 is not a mapping"),
                                               ("task.tasks=[5]", r"task.tasks=\[5\] is not a list of mappings")])
def test_a_sweep_number_that_is_not_one_names_the_setting(override, message):
    from hydra import compose, initialize_config_dir

    from eval.sweep import settings_from

    with initialize_config_dir(str(Path(__file__).parents[1] / "conf" / "eval"), version_base=None):
        cfg = compose("sweep", overrides=[override])
    with pytest.raises(ValueError, match=message):
        settings_from(cfg)


# -- eval.ceiling: the oracle that measures what a tree returns at a given head accuracy --------------------------
def test_ceiling_oracle_sets_the_heads_accuracy_and_stays_exact(tiny_model_dir, tmp_path, capsys):
    """Rate 1 proposes the target's own chain (every drafted token accepted: accepted length depth + 1 on a tree
    without a graft); rate 0 never (one token a step), while counting the head's own top-1 at every position;
    every output equals vanilla's."""
    from eval.ceiling import main as ceiling_main

    qfile = two_question_file(tmp_path)
    out_rows = {}
    assert ceiling_main(["--target", str(tiny_model_dir), "--draft", "random", "--questions", str(qfile),
                         "--limit", "1", "--max-new-tokens", "12", "--trees", "3,1,3,0", "--rates", "0,1"]) == 0
    printed = capsys.readouterr().out.splitlines()
    by_kind = {}
    for line in printed:
        cells = [c.strip() for c in line.strip("|").split("|")]
        if len(cells) == 7 and cells[0] not in ("method", "---"):
            out_rows[cells[0]] = cells
        if len(cells) == 4 and cells[0].startswith("oracle@"):
            by_kind[cells[0]] = cells
    assert set(out_rows) == {"vanilla", "lookup", "eagle d=3 k=1 n=3", "oracle@0 d=3 k=1 n=3",
                             "oracle@1 d=3 k=1 n=3"}
    # the same head's depth-1 accuracy by kind: both questions' kinds, the overall column the first table's
    assert "| head's own depth-1 token right | chat | code | overall |" in printed
    assert set(by_kind) == {"oracle@0 d=3 k=1 n=3", "oracle@1 d=3 k=1 n=3"}
    assert by_kind["oracle@0 d=3 k=1 n=3"][3] == out_rows["oracle@0 d=3 k=1 n=3"][6].split(" of ")[0]
    assert all(row[5] == "100%" for row in out_rows.values())
    assert float(out_rows["oracle@0 d=3 k=1 n=3"][4]) == 1.0
    assert float(out_rows["oracle@1 d=3 k=1 n=3"][4]) > 3.0    # 4 a step, less the turns' last steps
    asked = out_rows["oracle@0 d=3 k=1 n=3"][6]
    # asked at every position of every turn's answer but its first (the prefill's) and its last (past the answer)
    assert " of " in asked and int(asked.split(" of ")[1]) >= 3 * 10


def test_ceiling_counts_the_heads_depth1_accuracy_by_kind():
    """Each turn's new counts go to its question's kind; other methods' records are ignored; the overall column is
    the oracle's own total."""
    from eval.ceiling import KindCounts, OracleDraft, Reference
    from eval.runner import Record

    oracle = OracleDraft(None, Reference(), 0.0)
    counts = KindCounts({"oracle@0 d=1": oracle, "oracle@1 d=1": OracleDraft(None, Reference(), 1.0)})

    def turn(category, method="oracle@0 d=1"):
        counts.record(Record(question_id="q", category=category, method=method, new_tokens=1, seconds=1.0,
                             tokens_per_s=1.0, target_forwards=1, accept_length_mean=1.0, accept_lengths=[1],
                             identical_to_baseline=True, first_mismatch=None))

    oracle.asked, oracle.head_right = 10, 7
    turn("math")
    turn("math", method="vanilla")
    oracle.asked, oracle.head_right = 14, 8
    turn("rag")
    oracle.asked, oracle.head_right = 20, 12
    turn("math")
    assert counts.by_kind["oracle@0 d=1"] == {"math": [16, 11], "rag": [4, 1]}
    table = counts.markdown().splitlines()
    assert table[0] == "| head's own depth-1 token right | math | rag | overall |"
    assert table[2] == "| oracle@0 d=1 | 0.688 | 0.250 | 0.600 |"
    assert len(table) == 3                   # the oracle that asked nothing has no row


def test_ceiling_oracle_rewrites_only_what_its_rate_says(tiny_model_dir):
    from eagle_lite.tree import DraftTree
    from eval.ceiling import OracleDraft, Reference

    class Head:   # what the oracle reads of the drafter it wraps
        target = type("T", (), {"vocab_size": 100})()

    ref = Reference()
    ref.ids, ref.runs = [5, 6, 7, 8, 9], 1      # one vanilla run recorded: the oracles count from it
    chain = DraftTree(torch.tensor([6, 7, 50, 9]), [-1, 0, 1, 2])   # root 6 at position 1; the head: 7 right, 50 wrong
    right = OracleDraft(Head(), ref, 1.0).rewrite(chain, 2)
    assert right.tokens.tolist() == [6, 7, 8, 9]
    wrong = OracleDraft(Head(), ref, 0.0)
    out = wrong.rewrite(chain, 2)
    assert out.tokens[0] == 6 and all(int(t) != r for t, r in zip(out.tokens[1:], [7, 8, 9]))
    assert (wrong.asked, wrong.head_right) == (1, 1)              # depth 1: the head's own 7 was the target's
    past = OracleDraft(Head(), ref, 1.0).rewrite(chain, 4)        # past the reference's end: the head's tokens stay
    assert past.tokens.tolist() == [6, 9, 50, 9]


def test_profile_step_prices_a_verified_row_against_the_one_row_step():
    import argparse

    from conftest import make_target

    from eval.profile_step import row_costs, row_counts

    assert row_counts("1,4,16") == [1, 4, 16]
    for bad in ("a,b", "0,2", ""):
        with pytest.raises(argparse.ArgumentTypeError, match="counts of rows >= 1"):
            row_counts(bad)
    table = row_costs(make_target("llama", grid=True), list(range(3, 20)), [1, 3], reps=2).splitlines()
    rows = [line.split("|")[1:-1] for line in table if line.startswith("| ") and line[2].isdigit()]
    assert [r[0].strip() for r in rows] == ["1", "3"] and rows[0][4].strip() == "1.00x"
    assert float(rows[1][5]) == float(rows[1][5])   # each extra row's ms, a number (noise may make it negative)
    assert rows[0][5].strip() == "—" and float(rows[1][3]) > 0.0
