"""A user's own model to a served head: `python -m trainers.train target=FOLDER`, the estimate before the stages, the
fit's logger, the closing summary's commands, and every --draft tool defaulting to the head's own target."""
from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
import torch
from conftest import tiny_train_config, train_config

import trainers.train  # noqa: F401  (registers conf/'s resolvers: target_name, scaled)
from trainers.targets import run_name
from trainers.train import own_target

ROOT = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(ROOT)}


def run(args: list[str], timeout: int = 600, **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run(args, cwd=ROOT, capture_output=True, text=True, timeout=timeout, env=ENV, **kwargs)


# -- target=MODEL ---------------------------------------------------------------------------------------------------
def test_target_names_a_model_folder_or_hub_id_and_the_run_is_filed_under_it(tmp_path):
    assert own_target(["target=tiny", "data=tiny"]) == ["target=tiny", "data=tiny"]
    assert own_target(["target=./models/my-qwen", "name=x"]) == [
        "target=pretrained", "target.spec='./models/my-qwen'", "name=x"]
    assert own_target(["target=Qwen/Qwen2.5-0.5B-Instruct"])[1] == "target.spec='Qwen/Qwen2.5-0.5B-Instruct'"
    assert own_target(["target.spec=x", "+target=y"]) == ["target.spec=x", "+target=y"]   # other keys untouched
    assert own_target(["-m", "target=tiny,smollm2"]) == ["-m", "target=tiny,smollm2"]    # a multirun over configs
    assert run_name("smollm2") == "smollm2" and run_name("gemma3") == "gemma-3-270m-q4_k_m"
    assert run_name("Qwen/Qwen2.5-0.5B-Instruct") == "Qwen--Qwen2.5-0.5B-Instruct"
    assert run_name(str(tmp_path / "my-qwen") + "/") == "my-qwen"
    assert run_name("/models/llama.Q4_K_M.gguf") == "llama.Q4_K_M"

    folder = tmp_path / "my-qwen"
    cfg = train_config(*own_target([f"target={folder}", f"paths.root={tmp_path}"]))
    assert (cfg.target.name, cfg.target.spec, cfg.target.kind) == ("my-qwen", str(folder), "pretrained")
    assert cfg.paths.output == f"{tmp_path}/train/my-qwen/sharegpt/default"
    assert cfg.data.distill.start_from == "data/distill/my-qwen-sharegpt"   # never SmolLM2's answers
    # target.spec alone names the run too; the embedded default keeps its name
    assert train_config(f"target.spec={folder}").target.name == "my-qwen"
    assert train_config().target.name == "smollm2"


def test_the_mix_follows_the_limit_a_user_sets():
    assert train_config().data.mix.text.distill.limit == 1200
    assert train_config("data.distill.limit=8").data.mix.text.distill.limit == 5
    quick = train_config("data=quick")
    assert quick.data.get("mix") is None and quick.data.distill.limit == 256


def test_an_unknown_target_option_and_an_unknown_logger_are_one_line_and_exit_2(tmp_path):
    for arg, says in (("logger=nope", "Could not find 'logger/nope'"),):
        proc = run([sys.executable, "-m", "trainers.train", "target=tiny", "data=tiny", f"paths.root={tmp_path}", arg])
        assert proc.returncode == 2, proc.stderr
        [line] = proc.stderr.strip().splitlines()
        assert line.startswith("error: ") and says in line and "csv" in line and "tensorboard" in line
        assert "Config search path" not in line


def test_answers_nobody_committed_are_no_warning_and_a_rerun_with_nothing_to_answer_says_nothing(tmp_path, caplog):
    import logging

    from trainers.distill import start_from

    with caplog.at_level(logging.INFO, logger="trainers.distill"):
        assert start_from(tmp_path / "distill", tmp_path / "nowhere", {}, set()) == set()
    assert caplog.records == []   # every item answered already: start_from is not even looked at
    with caplog.at_level(logging.INFO, logger="trainers.distill"):
        assert start_from(tmp_path / "distill", tmp_path / "nowhere", {}, {"a"}) == set()
    [record] = caplog.records
    assert record.levelno == logging.INFO and "the target answers the prompts here" in record.getMessage()


# -- loggers ---------------------------------------------------------------------------------------------------------
def test_logger_tensorboard_writes_event_files(tmp_path):
    from trainers.train import train

    cfg = tiny_train_config(tmp_path, "logger=tensorboard", "trainer.max_epochs=1")
    train(cfg)
    events = list((Path(cfg.paths.output) / "tensorboard").rglob("events.out.tfevents.*"))
    assert events and events[0].stat().st_size > 0
    assert not (Path(cfg.paths.output) / "logs").exists()   # the chosen logger, not the CSV one beside it


def test_a_logger_that_cannot_work_is_refused_before_any_stage(tmp_path, monkeypatch):
    import importlib.util

    from trainers.loggers import check_logger
    from trainers.train import check_settings

    with pytest.raises(ValueError, match=r"trainer.logger is not read: choose the fit's logger with logger="):
        check_settings(tiny_train_config(tmp_path, "+trainer.logger=true"))
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else real(name, *a))
    with pytest.raises(ValueError, match=r"logger=wandb needs the package wandb, which is not installed: pip install"):
        check_logger(tiny_train_config(tmp_path, "logger=wandb"))
    check_logger(tiny_train_config(tmp_path, "logger=csv"))
    check_logger(tiny_train_config(tmp_path, "logger=tensorboard"))


def test_progress_false_turns_the_fits_bar_off_too(tmp_path, monkeypatch):
    import lightning.pytorch

    from trainers.train import train

    seen = {}
    real = lightning.pytorch.Trainer

    class Spy(real):
        def __init__(self, *args, **kwargs):
            seen.update(kwargs)
            super().__init__(*args, **kwargs)

    monkeypatch.setattr(lightning.pytorch, "Trainer", Spy)
    train(train_config("target=tiny", "data=tiny", f"paths.root={tmp_path}", "progress=false",
                       "trainer.enable_progress_bar=true", "trainer.max_epochs=1"))
    assert seen["enable_progress_bar"] is False


# -- EAGLE-3 on a short stack -----------------------------------------------------------------------------------------
def test_eagle3_taps_of_a_short_stack_are_chosen_not_refused():
    from trainers.targets import TargetConfig, tiny_target
    from trainers.train import feature_layers

    four = tiny_target(TargetConfig(kind="tiny", name="tiny", num_layers=4))
    assert feature_layers(train_config("target=tiny", "draft.design=eagle3"), four) == (0, 1, 2)
    three = tiny_target(TargetConfig(kind="tiny", name="tiny", num_layers=3))
    with pytest.raises(ValueError, match=r"L = 3: train an EAGLE-1 head instead \(draft.design=eagle\)"):
        feature_layers(train_config("target=tiny", "draft.design=eagle3"), three)
    with pytest.raises(ValueError, match=r"from 0 to 2 \(e.g. \[0, 1, 2\]\)"):
        feature_layers(train_config("target=tiny", "draft.design=eagle3", "draft.feature_layers=[1,2,3]"), four)


# -- the estimate ---------------------------------------------------------------------------------------------------
def test_the_estimate_is_printed_and_written_before_the_stages_and_counts_what_is_done(tmp_path, capsys,
                                                                                        monkeypatch):
    import eagle_lite.kernels
    from trainers.train import train

    monkeypatch.setattr(eagle_lite.kernels, "needs_build", lambda: True)   # a machine that never built them
    cfg = tiny_train_config(tmp_path, "trainer.max_epochs=1")
    result = train(cfg)
    out = capsys.readouterr().out
    assert out.index("estimate on this machine") < out.index("total")
    written = json.loads((Path(cfg.paths.output) / "estimate.json").read_text())
    stages = {s["stage"]: s for s in written["stages"]}
    assert set(stages) == {"kernels", "distill", "features", "fit"}
    assert stages["kernels"]["seconds"] > 0 and "once per machine" in stages["kernels"]["what"]
    assert stages["distill"]["what"] == "48 answers of up to 40 new tokens"
    assert stages["features"]["bytes"] > 0 and all(s["seconds"] > 0 for s in stages.values())
    assert written["probe"]["decode_step_s"] > 0 and written["probe"]["fit_row_s"] > 0
    assert result["estimated_seconds"] == written["seconds"]
    # a second run over the same data: the answers and features are there, only the fit is left
    monkeypatch.setattr(eagle_lite.kernels, "needs_build", lambda: False)
    train(tiny_train_config(tmp_path, "trainer.max_epochs=1", "name=again"))
    again = {s["stage"]: s for s in json.loads(
        (tmp_path / "train" / "tiny" / "tiny" / "again" / "estimate.json").read_text())["stages"]}
    assert "kernels" not in again   # nothing to answer: no engine, no kernels
    assert again["distill"]["what"] == "nothing to answer" and again["distill"]["seconds"] == 0
    assert again["features"]["what"] == "cached" and again["fit"]["seconds"] > 0


@pytest.mark.parametrize("backend", ["auto", "generate"])
def test_the_distill_probe_times_the_backend_that_answers(tmp_path, monkeypatch, backend):
    """On a CPU the distill stage answers through eagle_lite's engine (data.distill.backend auto): the probe times a
    plain step of the engine's batch, not transformers' forward; backend generate times that forward."""
    from trainers import estimate as estimate_module
    from trainers.targets import TargetConfig, build_target

    timed = []
    for name in ("_engine_step", "_decode_step"):
        real = getattr(estimate_module, name)
        monkeypatch.setattr(estimate_module, name, lambda *a, _n=name, _f=real: timed.append(_n) or _f(*a))
    cfg = tiny_train_config(tmp_path, f"++data.distill.backend={backend}")
    probe = estimate_module.probe(cfg, build_target(TargetConfig(kind="tiny", name="tiny")), ())
    assert timed == (["_engine_step"] if backend == "auto" else ["_decode_step"]) and probe.decode_step_s > 0


def test_once_answered_the_estimate_counts_the_answers_own_tokens(tmp_path):
    """Answers written count as they are, not at their most: the features stage of a fresh feature folder is sized
    by the tokens the distill folder holds."""
    from trainers.distill import DistillSummary, summarize
    from trainers.estimate import Probe, estimate
    from trainers.targets import TargetConfig, build_target
    from trainers.train import data_sources, train

    train(tiny_train_config(tmp_path, "stop_after=distill"))
    cfg = tiny_train_config(tmp_path, f"paths.features={tmp_path / 'fresh'}")
    target = build_target(TargetConfig(kind="tiny", name="tiny"))
    sources = data_sources(cfg)
    held = summarize(Path(sources[0].distill), DistillSummary(Path(sources[0].distill)))
    stages = {s.stage: s for s in estimate(cfg, target, sources, (), Probe(0.01, 8, 1e-4, 0.01, 1024))}
    assert stages["distill"].what == "nothing to answer"
    assert held.records > 0 and stages["features"].what == f"~{held.tokens:,} tokens through the target"


# -- the closing summary ----------------------------------------------------------------------------------------------
def test_the_summary_warns_of_a_small_validation_split_and_names_the_next_commands(tmp_path):
    from trainers.next_steps import closing

    result = {"export": str(tmp_path / "head"), "global_step": 20, "epochs": 4, "seconds": 12.0,
              "estimated_seconds": 15.0, "val/top1": 0.197, "val/accept_len_est": 1.3, "val/tokens": 200.0,
              "val_sequences": 1, "head_kind": "eagle3"}
    text = closing(result, "./my-qwen")
    assert "warning: validation held out 1 sequences (200 tokens), too few" in text
    assert "python -m eagle_lite.generate --target ./my-qwen --draft" in text
    assert "--format eagle3 --out" in text and "eval/questions/heldout12.jsonl" in text
    big = {**result, "val/tokens": 5000.0, "val_sequences": 40}
    assert "warning" not in closing(big, "smollm2") and "--target" not in closing(big, "smollm2")
    assert "a tiny random target lives only inside training" in closing(result, None)


def test_the_summary_sizes_the_benchmark_to_minutes_and_names_the_tree_and_a_matching_request(tmp_path):
    from trainers.next_steps import BENCH_BUDGET_S, benchmark_size, closing, commands

    assert benchmark_size(None)[:2] == (2, 256)
    assert benchmark_size(1 / 150)[:2] == (2, 256)              # a fast target: the full benchmark fits
    per_task, tokens, seconds = benchmark_size(1 / 20)          # Gemma 3 270M here: fewer prompts and tokens
    assert (per_task, tokens) == (1, 256) and seconds <= BENCH_BUDGET_S
    assert benchmark_size(1 / 10)[:2] == (1, 128)
    result = {"export": str(tmp_path / "head"), "global_step": 20, "epochs": 4, "seconds": 12.0,
              "head_kind": "eagle", "tune": {"tree": {"depth": 2, "top_k": 1, "total_tokens": 2, "lookup": 4,
                                                      "min_prob": 0.0},
                                             "tokens_per_s": 30.0, "speedup": 1.5, "vanilla_tokens_per_s": 20.0,
                                             "seconds": 70.0, "command": "python -m eval.tune --save-tree"}}
    text = closing(result, "/models/gemma-3-270m-q4_k_m.gguf")
    assert "tree: tuned in 70 s" in text and "depth 2" in text and "1.50x vanilla" in text
    assert "--per-task 1 --max-new-tokens 256" in text and "about 8 min here" in text
    request = dict(commands(result, "/models/gemma-3-270m-q4_k_m.gguf"))["request"]
    body = json.loads(shlex.split(request)[shlex.split(request).index("-d") + 1])
    assert body["model"] == "gemma-3-270m-q4_k_m" and body["max_tokens"] == 128   # a bounded answer
    one = {**result, "tune": {**result["tune"], "tree": {**result["tune"]["tree"], "depth": 1, "total_tokens": 1}}}
    assert "1 node," in closing(one, "smollm2") and "1 nodes" not in closing(one, "smollm2")
    untuned = {**result, "tune": {"tree": None, "command": "python -m eval.tune --save-tree", "error": "boom"},
               "decode_step_s": 0.05}
    line = next(x for x in closing(untuned, "smollm2").splitlines() if x.startswith("tree:"))
    assert "the tune failed (boom)" in line and "about 51 s here" in line and "python -m eval.tune" in line


def test_the_server_answers_to_a_short_name_of_its_target():
    from eagle_lite.serve.protocol import served_model_id

    assert served_model_id("/root/.cache/x/gemma-3-270m-q4_k_m.gguf") == "gemma-3-270m-q4_k_m"
    assert served_model_id("./models/my-qwen") == "my-qwen"
    assert served_model_id("HuggingFaceTB/SmolLM2-135M-Instruct") == "HuggingFaceTB/SmolLM2-135M-Instruct"
    assert served_model_id("smollm2") == "smollm2"


# -- the head's own target --------------------------------------------------------------------------------------------
def test_tools_default_to_the_target_a_head_was_trained_for(tmp_path, tiny_model_dir, capsys):
    from eagle_lite.heads.checkpoint import HeadMismatchError, check_target, recorded_target, save_head
    from eagle_lite.heads.draft import DraftHead
    from eagle_lite.options import target_of
    from eagle_lite.targets.loading import load_target

    target = load_target(str(tiny_model_dir))
    capsys.readouterr()
    assert target.spec == str(Path(tiny_model_dir).resolve())
    head = save_head(DraftHead.for_target(target), tmp_path / "head", target)
    assert recorded_target(head) == target.spec
    assert target_of(None, head) == target.spec
    assert capsys.readouterr().err.strip() == f"target: {target.spec} (the one {head} was trained for)"
    assert target_of("smollm2", head) == "smollm2" and target_of(None, "auto") is None
    config = json.loads((head / "config.json").read_text())
    gone = tmp_path / "gone"
    (gone).mkdir()
    (gone / "config.json").write_text(json.dumps({**config, "target_spec": str(tmp_path / "nowhere")}))
    assert target_of(None, gone) is None   # a target not on this machine: the default, and the check says why
    other = {**config, "target": {**config["target"], "embedding_sha": "0" * 16}}
    with pytest.raises(HeadMismatchError, match=rf"pass the target it was trained for \(--target {target.spec}\)"):
        check_target(other, target, head)


class Loaded(Exception):
    """Raised by a stand-in load_target with the spec a tool asked for."""


@pytest.mark.parametrize("tool, args", [
    ("eval.tune", ["--method", "eagle", "--questions", "{questions}", "--limit", "1"]),
    ("eval.profile_step", []),
    ("eval.ceiling", ["--questions", "{questions}", "--limit", "1"]),
    ("eval.head_cost", []),
])
def test_the_eval_tools_load_the_target_a_head_was_trained_for(tool, args, tmp_path, tiny_model_dir, monkeypatch,
                                                               capsys):
    import importlib

    import eagle_lite.targets.loading
    from eagle_lite.heads.checkpoint import save_head
    from eagle_lite.heads.draft import DraftHead
    from eagle_lite.targets.loading import load_target

    target = load_target(str(tiny_model_dir))
    head = save_head(DraftHead.for_target(target), tmp_path / "head", target)
    questions = tmp_path / "q.jsonl"
    questions.write_text(json.dumps({"question_id": 1, "category": "qa", "turns": ["Why?"]}) + "\n")

    def loaded(spec, *a, **k):
        raise Loaded(spec)

    module = importlib.import_module(tool)
    monkeypatch.setattr(eagle_lite.targets.loading, "load_target", loaded)
    if hasattr(module, "load_target"):
        monkeypatch.setattr(module, "load_target", loaded)
    with pytest.raises(Loaded) as got:
        module.main.__wrapped__([*(a.format(questions=questions) for a in args), "--draft", str(head)])
    assert str(got.value) == target.spec
    assert f"target: {target.spec} (the one {head} was trained for)" in capsys.readouterr().err


def test_the_benchmark_and_the_sweep_take_the_heads_target(tmp_path, tiny_model_dir):
    from eagle_lite.heads.checkpoint import save_head
    from eagle_lite.heads.draft import DraftHead
    from eagle_lite.targets.loading import load_target
    from eval.benchmark import parse_args, settings_of
    from eval.sweep import settings_from

    target = load_target(str(tiny_model_dir))
    head = save_head(DraftHead.for_target(target), tmp_path / "head", target)
    assert settings_of(parse_args(["--draft", str(head)])).target == target.spec
    assert settings_of(parse_args(["--draft", str(head), "--target", "smollm2"])).target == "smollm2"
    from hydra import compose, initialize_config_dir

    with initialize_config_dir(config_dir=str(ROOT / "conf" / "eval"), version_base=None):
        assert settings_from(compose("sweep", overrides=[f"draft={head}"])).target == target.spec


# -- the whole path, as a user walks it --------------------------------------------------------------------------------
def next_commands(stdout: str) -> dict[str, list[str]]:
    lines = stdout[stdout.index("\nnext:\n"):].splitlines()[2:]
    found = {}
    for line in lines:
        what, _, command = line.strip().partition(": ")
        found[what] = shlex.split(command)
    return found


def python(command: list[str]) -> list[str]:
    assert command[:2] == ["python", "-m"], command
    return [sys.executable, *command[1:]]


def save_real_tokenizer_model(path: Path) -> Path:
    """A tiny random Llama with SmolLM2's own tokenizer and chat template (read from the embedded GGUF's metadata),
    saved as a user's model folder is."""
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from eagle_lite.targets.loading import embedded_gguf

    gguf = embedded_gguf("smollm2")
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    tokenizer.save_pretrained(path)
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                         eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id, bos_token_id=None,
                         tie_word_embeddings=False)
    model = LlamaForCausalLM(config)
    with torch.no_grad():
        model.lm_head.weight.mul_(8.0)   # sharper logits: greedy continuations are not all ties
    model.save_pretrained(path)
    return path


def test_own_model_folder_to_a_served_head_with_the_readme_command(tmp_path):
    from test_serve import free_port, wait_healthy

    model = save_real_tokenizer_model(tmp_path / "my-llama")
    readme = (ROOT / "README.md").read_text()
    assert "python -m trainers.train target=./my-model data=quick" in readme
    runs = tmp_path / "runs"
    # the README's command, on this folder, with the sizes a test affords
    train = run([sys.executable, "-m", "trainers.train", f"target={model}", "data=quick", f"paths.root={runs}",
                 "data.distill.limit=24", "data.distill.max_new_tokens=24", "data.distill.max_prompt_tokens=400",
                 "data.loader.val_percent=25", "trainer.max_epochs=2", "progress=false",
                 "data.max_degenerate=null"])   # a random model's answers loop: the data check would stop the run
    assert train.returncode == 0, train.stderr[-3000:]
    assert "no draft head ships" not in train.stderr and "does not exist" not in train.stderr
    head = runs / "train" / "my-llama" / "quick" / "default" / "head"
    assert (head / "config.json").is_file() and (runs / "train" / "my-llama" / "quick" / "default" /
                                                "estimate.json").is_file()
    out = train.stdout
    assert out.index("estimate on this machine") < out.index(f"head: {head}")
    assert "warning: validation held out" in out   # 24 prompts: a split too small to mean anything, and said so
    steps = next_commands(out)
    assert set(steps) == {"chat", "benchmark", "serve", "request", "export"}
    assert "tree: tuned in" in out   # the run ends with its own CPU tree, saved in the head
    assert json.loads((head / "config.json").read_text())["tree"]["lookup"] == 4

    # chat, as printed (the target comes from the command; the answer is the target's own)
    chat = run(python(steps["chat"]), input="Hi there\n/quit\n")
    assert chat.returncode == 0 and "bot>" in chat.stdout, chat.stderr
    # the head generates exactly what the target alone does
    ids = {}
    for method in ("vanilla", "eagle"):
        one = run([sys.executable, "-m", "eagle_lite.generate", "--draft", str(head), "--method", method,
                   "--prompt", "Tell me about the sea.", "--max-new-tokens", "48", "--json"])
        assert one.returncode == 0, one.stderr
        assert f"target: {model.resolve()} (the one {head} was trained for)" in one.stderr
        ids[method] = json.loads(one.stdout)["token_ids"]
    assert ids["eagle"] == ids["vanilla"] and len(ids["vanilla"]) > 0
    # export, as printed
    export = run(python(steps["export"]))
    assert export.returncode == 0, export.stderr
    assert (Path(steps["export"][-1]) if Path(steps["export"][-1]).is_absolute()
            else ROOT / steps["export"][-1]).joinpath("config.json").is_file()
    # serve, as printed (on a free port), one request
    port = free_port()
    server = subprocess.Popen(python(steps["serve"]) + ["--port", str(port), "--threads", "1"], cwd=ROOT, env=ENV,
                              stderr=subprocess.PIPE, text=True)
    try:
        url = f"http://127.0.0.1:{port}"
        wait_healthy(server, url)
        models = httpx.get(url + "/v1/models").json()["data"]
        printed = json.loads(steps["request"][steps["request"].index("-d") + 1])   # the request the run printed
        assert models[0]["id"] == printed["model"] == "my-llama"
        reply = httpx.post(url + "/v1/chat/completions", timeout=120, json={**printed, "max_tokens": 48})
        assert reply.status_code == 200, reply.text
        assert reply.json()["choices"][0]["message"]["content"]
    finally:
        server.terminate()
        server.wait(timeout=60)
    # benchmark, as printed: eagle against lookup on the held-out kinds, every output identical
    bench = run(python(steps["benchmark"]), timeout=900)
    assert bench.returncode == 0, bench.stderr[-3000:]
    overall = [line for line in bench.stdout.splitlines() if line.startswith("| overall |")]
    assert [line.split(" | ")[1] for line in overall] == ["vanilla", "lookup", "eagle"]
    assert all(line.rstrip(" |").endswith("100%") for line in overall), bench.stdout


def test_validate_defaults_to_the_heads_target_and_names_the_fix_for_another_cache(tmp_path, tiny_model_dir):
    from transformers import AutoModelForCausalLM

    from trainers.train import train

    cfg = tiny_train_config(tmp_path, "target.kind=pretrained", f"target.spec={tiny_model_dir}", "target.name=chat",
                            "trainer.max_epochs=1")
    result = train(cfg)
    scored = run([sys.executable, "-m", "trainers.validate", result["export"], "--features", cfg.paths.features])
    assert scored.returncode == 0, scored.stderr
    assert f"target: {Path(tiny_model_dir).resolve()} (the one" in scored.stderr and "top-1" in scored.stdout
    other = tmp_path / "other"   # another model: the same shapes, other embeddings
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    with torch.no_grad():
        model.get_input_embeddings().weight.add_(1.0)
    model.save_pretrained(other)
    for file in Path(tiny_model_dir).glob("tok*"):
        (other / file.name).write_bytes(file.read_bytes())
    (other / "chat_template.jinja").write_bytes((Path(tiny_model_dir) / "chat_template.jinja").read_bytes()) \
        if (Path(tiny_model_dir) / "chat_template.jinja").is_file() else None
    proc = run([sys.executable, "-m", "trainers.validate", result["export"], "--features", cfg.paths.features,
                "--target", str(other)])
    assert proc.returncode == 1
    [line] = proc.stderr.strip().splitlines()
    assert line.startswith("error: feature cache") and f"pass --target {tiny_model_dir}" in line
    assert "delete" not in line
