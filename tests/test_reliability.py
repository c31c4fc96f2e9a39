"""Pipes, full disks, read-only folders and interrupted runs: one line, the right exit status, nothing lost."""
from __future__ import annotations

import errno
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from conftest import save_tiny_llama, tiny_train_config

ROOT = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}


@pytest.fixture(scope="module")
def endless_model_dir(tmp_path_factory):
    """A tiny random Llama with no EOS and a long context: it writes until it is stopped."""
    return save_tiny_llama(tmp_path_factory.mktemp("endless"), 8192, eos_token_id=None)


def refuse_target_loads(monkeypatch) -> None:
    """Loading a target fails the test: what is checked here must be checked before."""
    import eagle_lite.pipeline
    import eval.evaluation

    def refuse(*args, **kwargs):
        raise AssertionError("the target was loaded before the inputs were checked")

    monkeypatch.setattr(eagle_lite.pipeline, "load_target", refuse)
    monkeypatch.setattr(eval.evaluation, "load_target", refuse)


# -- the boundary -----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("raised, status, line", [
    (lambda cli: OSError(errno.ENOSPC, "No space left on device", "runs/x/last.ckpt"), 1,
     "error: No space left on device (ENOSPC): runs/x/last.ckpt; free some space and run the same command again"),
    (lambda cli: PermissionError(errno.EROFS, "Read-only file system", "/ro/runs"), 1,
     "error: Read-only file system (EROFS): /ro/runs; the file system is read-only"),
    (lambda cli: ValueError("top_p must be\nin (0, 1]"), 1, "error: top_p must be in (0, 1]"),
    (lambda cli: cli.UsageError("--threads must be >= 1"), 2, "error: --threads must be >= 1"),
    (lambda cli: KeyboardInterrupt(), 130, "[stopped]"),
    (lambda cli: cli.Terminated(), 143, "[stopped]"),
])
def test_the_boundary_turns_each_expected_failure_into_one_line_and_its_status(raised, status, line, capsys):
    from eagle_lite import cli

    def main():
        raise raised(cli)

    assert cli.run(main) == status
    err = capsys.readouterr().err.strip()
    assert err.startswith(line) and len(err.splitlines()) == 1


def test_the_boundary_keeps_the_traceback_of_a_bug_and_a_bad_argument_is_status_2(capsys):
    from eagle_lite import cli

    with pytest.raises(TypeError):
        cli.run(lambda: None + 1)
    with pytest.raises(cli.UsageError), cli.arguments():
        raise ValueError("bad flag")

    @cli.entry_point
    def main(argv=None):
        with cli.arguments():
            raise ValueError(f"--seed must be a whole number, got {argv}")

    assert main(["x"]) == 2 and "--seed must be" in capsys.readouterr().err


def test_a_broken_pipe_that_is_not_stdout_is_an_error(capsys):
    from eagle_lite import cli

    def main():
        raise BrokenPipeError(errno.EPIPE, "Broken pipe")   # e.g. a subprocess's pipe: stdout is still read

    assert cli.run(main) == 1 and "Broken pipe (EPIPE)" in capsys.readouterr().err


def piped_into_head(args: list[str], stdin: str | None = None) -> tuple[int, str, bytes]:
    """Run `args` with stdout piped into `head -c 20`; returns (its exit status, its stderr, what head printed)."""
    script = 'python="$1"; shift; "$python" "$@" 2>"$ERR_FILE" | head -c 20; echo "${PIPESTATUS[0]}" >"$STATUS_FILE"'
    tmp = Path(os.environ.get("TMPDIR", "/tmp"))
    err_file, status_file = tmp / f"err-{os.getpid()}-{time.monotonic_ns()}", tmp / f"status-{os.getpid()}"
    proc = subprocess.run(["bash", "-c", script, "bash", sys.executable, *args], input=stdin, capture_output=True,
                          text=stdin is not None, timeout=300, cwd=ROOT,
                          env={**ENV, "ERR_FILE": str(err_file), "STATUS_FILE": str(status_file)})
    status, err = int(status_file.read_text()), err_file.read_text()
    err_file.unlink()
    status_file.unlink()
    return status, err, proc.stdout


@pytest.mark.parametrize("mode", ["one-shot", "chat"])
def test_a_reader_that_goes_away_ends_generate_quietly(endless_model_dir, mode):
    args = ["-m", "eagle_lite.generate", "--target", str(endless_model_dir), "--method", "vanilla",
            "--max-new-tokens", "3000", "--threads", "1"]
    if mode == "one-shot":
        status, err, out = piped_into_head([*args, "--prompt", "Tell me a story"])
    else:
        status, err, out = piped_into_head(args, stdin="Tell me a story\nand another\n")
    assert len(out) == 20
    assert status == 0, err
    assert "Traceback" not in err and "BrokenPipeError" not in err and "Exception ignored" not in err


def test_sigterm_during_an_answer_keeps_the_text_and_the_stats(endless_model_dir):
    proc = subprocess.Popen([sys.executable, "-m", "eagle_lite.generate", "--target", str(endless_model_dir),
                             "--prompt", "hello", "--method", "vanilla", "--max-new-tokens", "8000", "--threads", "1"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=ENV, cwd=ROOT)
    first = proc.stdout.read(1)
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=300)
    err = err.decode()
    assert proc.returncode == 143, err
    assert (first + out).strip() and "Traceback" not in err
    assert err.strip().splitlines()[-2:][0] == "[stopped]" and "mean accepted length" in err.strip().splitlines()[-1]


# -- numbers that are not numbers -------------------------------------------------------------------------------
@pytest.mark.parametrize("args, message", [
    (["--temperature", "nan"], "temperature must be a finite number, got nan"),
    (["--temperature", "inf"], "temperature must be a finite number, got inf"),
    (["--top-p", "nan"], "top_p must be a finite number"),
    (["--seed", str(2 ** 70)], f"seed must be in [0, {2 ** 64}), got {2 ** 70}"),
    (["--seed", "-1"], "seed must be in [0,"),
])
def test_numbers_that_are_not_numbers_are_refused_before_the_target_loads(args, message, capsys, monkeypatch):
    from eagle_lite.generate import main

    refuse_target_loads(monkeypatch)
    assert main(["--prompt", "x", *args]) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1


def test_configs_refuse_fractions_nan_and_bools():
    from eagle_lite.config import GenerationConfig, SamplingConfig, TreeConfig

    with pytest.raises(ValueError, match="max_new_tokens must be a whole number, got 2.5"):
        GenerationConfig(max_new_tokens=2.5)
    with pytest.raises(ValueError, match="tree depth must be a whole number"):
        TreeConfig(depth=2.5)
    with pytest.raises(ValueError, match="top_k must be a whole number"):
        SamplingConfig(top_k=True)
    with pytest.raises(ValueError, match="tree min_prob must be a finite number"):
        TreeConfig(min_prob=float("nan"))
    assert GenerationConfig(max_new_tokens=3, seed=2 ** 64 - 1).seed == 2 ** 64 - 1


@pytest.fixture(scope="module")
def lm(tiny_model_dir):
    from eagle_lite.pipeline import load

    return load(str(tiny_model_dir), method="vanilla")


def test_the_api_refuses_a_fractional_budget_and_token_ids_outside_the_vocabulary(lm):
    with pytest.raises(ValueError, match="max_new_tokens must be a whole number"):
        lm.config(max_new_tokens=2.5)
    vocab = lm.target.vocab_size
    for bad in (vocab, -1):
        message = rf"prompt token 1 is {bad}, not a token id of target .* \(0 to {vocab - 1}\)"
        with pytest.raises(ValueError, match=message):
            lm.generate([5, bad, 7], lm.config(max_new_tokens=2))
    assert len(lm.generate([5, vocab - 1, 7], lm.config(max_new_tokens=2)).token_ids) == 2


@pytest.mark.parametrize("setting, message", [
    ({"num_beams": 2}, "num_beams=2: beam search is not supported"),
    ({"num_return_sequences": 2, "do_sample": True}, "num_return_sequences=2: multiple sequences per prompt are not"),
])
def test_custom_generate_names_beam_search_and_multiple_sequences(tiny_model_dir, setting, message):
    from transformers import AutoModelForCausalLM

    from eagle_lite.custom_generate import generate as eagle_generate

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    with pytest.raises(ValueError, match=message):
        model.generate(torch.tensor([[5, 17, 33]]), max_new_tokens=4, pad_token_id=1, custom_generate=eagle_generate,
                       **setting)


def test_draft_weights_of_the_wrong_shape_are_one_line_naming_the_tensor(tiny_model_dir, lm, tmp_path, capsys):
    from safetensors.torch import load_file, save_file

    from eagle_lite.generate import main
    from eagle_lite.heads.checkpoint import save_head
    from eagle_lite.heads.draft import DraftHead

    head = save_head(DraftHead.for_target(lm.target), tmp_path / "head", lm.target)
    tensors = load_file(head / "model.safetensors")
    wanted = list(tensors["fc.weight"].shape)
    tensors["fc.weight"] = torch.zeros(wanted[0], wanted[1] // 2)
    save_file(tensors, head / "model.safetensors")
    assert main(["--target", str(tiny_model_dir), "--draft", str(head), "--prompt", "x", "--max-new-tokens", "2"]) == 1
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1
    assert f"tensor fc.weight is {[wanted[0], wanted[1] // 2]} in the file, but the head needs {wanted}" in err


# -- finished work kept -----------------------------------------------------------------------------------------
def question_file(tmp_path: Path) -> Path:
    qfile = tmp_path / "questions.jsonl"
    qfile.write_text("".join(json.dumps({"question_id": q, "category": "chat", "turns": [f"say {q}"]}) + "\n"
                             for q in "abcd"))
    return qfile


def benchmark_args(tiny_model_dir, tmp_path) -> list[str]:
    return ["--target", str(tiny_model_dir), "--methods", "vanilla,lookup", "--tasks", "", "--questions",
            str(question_file(tmp_path)), "--per-task", "4", "--max-new-tokens", "6", "--threads", "1"]


def test_benchmark_checks_its_out_path_before_the_first_prompt(tiny_model_dir, tmp_path, capsys, monkeypatch):
    from eval import benchmark

    refuse_target_loads(monkeypatch)
    out = tmp_path / "results.md"
    out.write_text("earlier results\n")
    assert benchmark.main([*benchmark_args(tiny_model_dir, tmp_path), "--out", str(out)]) == 1
    err = capsys.readouterr().err.strip()
    assert err == f"error: --out {out} is a file: give a folder for the records, summary and plots"
    assert out.read_text() == "earlier results\n"


def interrupt_after(monkeypatch, runs: int, interrupt=KeyboardInterrupt) -> None:
    """Ctrl-C (or `interrupt`) arrives during the run after `runs` finished method runs (warm-up not counted)."""
    import eval.evaluation

    build = eval.evaluation.build_methods

    def counting(*args, **kwargs):
        methods, calls = build(*args, **kwargs), [0]

        def wrap(method):
            def call(prompt, cfg):
                if cfg.max_new_tokens != 8:    # the warm-up's 8 tokens are not a run
                    if calls[0] == runs:
                        raise interrupt()
                    calls[0] += 1
                return method(prompt, cfg)
            return call
        return {name: wrap(m) for name, m in methods.items()}

    monkeypatch.setattr(eval.evaluation, "build_methods", counting)


def test_ctrl_c_in_the_benchmark_prints_and_writes_what_finished(tiny_model_dir, tmp_path, capsys, monkeypatch):
    from eval import benchmark

    interrupt_after(monkeypatch, 5)    # questions a and b done (2 methods each), c's baseline done
    out_dir = tmp_path / "bench"
    assert benchmark.main([*benchmark_args(tiny_model_dir, tmp_path), "--out", str(out_dir)]) == 130
    out, err = capsys.readouterr()
    assert "stopped after 5 of 8 runs: the table holds the 4 runs of the turns every method finished" in out
    assert "| overall | vanilla | 2 |" in out and "| overall | lookup | 2 |" in out
    records = [json.loads(line) for line in (out_dir / "records.jsonl").read_text().splitlines()]
    assert [(r["question_id"], r["method"]) for r in records] == [("a", "vanilla"), ("a", "lookup"), ("b", "vanilla"),
                                                                  ("b", "lookup"), ("c", "vanilla")]
    assert (out_dir / "summary.md").is_file() and err.strip().splitlines()[-1] == "[stopped]"


def test_ctrl_c_in_a_sweep_writes_what_finished(tiny_model_dir, tmp_path, capsys, monkeypatch):
    from eval import sweep

    interrupt_after(monkeypatch, 2)
    run_dir = tmp_path / "sweep"
    monkeypatch.setattr(sys, "argv", ["eval.sweep", f"target={tiny_model_dir}", "methods=[vanilla,lookup]",
                                      "baseline=vanilla", "task=file", f"task.tasks.0.path={question_file(tmp_path)}",
                                      "max_new_tokens=6", "warmup=false", "threads=1", f"hydra.run.dir={run_dir}"])
    assert sweep._main() == 130
    assert "stopped after 2 of 4 runs" in capsys.readouterr().out   # 2 questions (the task's limit) x 2 methods
    assert len((run_dir / "records.jsonl").read_text().splitlines()) == 2


# -- training: settings, finished runs, logs, checkpoints, locks -----------------------------------------------
@pytest.mark.parametrize("override, message", [("trainer.max_epochs=-1", "trainer.max_epochs must be >= 1, got -1"),
                                               ("trainer.max_epochs=0", "trainer.max_epochs must be >= 1, got 0"),
                                               ("trainer.max_epochs=1.5", "trainer.max_epochs must be a whole number"),
                                               ("checkpoint.every_n_train_steps=0", "every_n_train_steps must be >= 1"),
                                               ("seed=-3", "seed must be in [0, 4294967296)")])
def test_training_settings_that_make_no_sense_are_refused_before_the_target_loads(tmp_path, override, message,
                                                                                   monkeypatch):
    import trainers.targets
    from trainers.train import train

    monkeypatch.setattr(trainers.targets, "build_target", lambda *a, **k: pytest.fail("the target was built"))
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace(")", r"\)")):
        train(tiny_train_config(tmp_path, override))


SHORT = ("trainer.max_epochs=3", "trainer.limit_train_batches=3", "checkpoint.every_n_train_steps=2",
         "data.loader.batch_size=2", "trainer.num_sanity_val_steps=0", "trainer.limit_val_batches=1")


def crash_at(monkeypatch, step: int, error: BaseException) -> None:
    from trainers.module import DraftLightningModule

    training_step = DraftLightningModule.training_step

    def crashing(self, batch, batch_idx):
        if self.global_step == step:
            raise error
        return training_step(self, batch, batch_idx)

    monkeypatch.setattr(DraftLightningModule, "training_step", crashing)


def test_a_finished_training_says_so_and_leaves_its_head_alone(tmp_path):
    from trainers.train import train

    cfg = tiny_train_config(tmp_path, "name=done", *SHORT)
    first = train(cfg)
    exported = Path(first["export"])
    config = (exported / "config.json").read_bytes()
    assert "val/top1" in json.loads(config)["training"]
    again = train(tiny_train_config(tmp_path, "name=done", *SHORT))
    assert again["finished"] is True and again["global_step"] == first["global_step"] == 9
    assert (exported / "config.json").read_bytes() == config
    # more epochs asked for: the run trains on from where it ended
    more = train(tiny_train_config(tmp_path, "name=done", *SHORT[1:], "trainer.max_epochs=4"))
    assert more.get("finished") is None and more["resumed_from_step"] == 9 and more["global_step"] == 12


def test_the_training_log_keeps_the_epochs_before_a_crash(tmp_path, monkeypatch):
    from trainers.module import DraftLightningModule
    from trainers.train import train

    step = DraftLightningModule.training_step
    crash_at(monkeypatch, 7, RuntimeError("killed"))     # in epoch 2, after epochs 0 and 1 ended
    with pytest.raises(RuntimeError, match="killed"):
        train(tiny_train_config(tmp_path, "name=crash", *SHORT))
    monkeypatch.setattr(DraftLightningModule, "training_step", step)
    result = train(tiny_train_config(tmp_path, "name=crash", *SHORT))
    assert result["resumed_from_step"] >= 6
    log = json.loads((Path(result["export"]) / "train_log.json").read_text())
    assert [row["epoch"] for row in log["epochs"]] == [0, 1, 2] and [r["step"] for r in log["epochs"]] == [3, 6, 9]


def test_a_damaged_checkpoint_is_set_aside_and_the_run_resumes_from_the_last_good_one(tmp_path, monkeypatch, caplog):
    from trainers.module import DraftLightningModule
    from trainers.train import train

    step = DraftLightningModule.training_step
    crash_at(monkeypatch, 5, RuntimeError("crash"))
    with pytest.raises(RuntimeError):
        train(tiny_train_config(tmp_path, "name=damaged", *SHORT))
    ckpts = Path(tiny_train_config(tmp_path, "name=damaged").paths.output) / "checkpoints"
    last = ckpts / "last.ckpt"
    good = sorted(p.name for p in ckpts.glob("*.ckpt") if p.name != "last.ckpt")
    assert good, "the crash saved a checkpoint of its own beside last.ckpt"
    last.write_bytes(last.read_bytes()[: last.stat().st_size // 2])        # what a disk full in place leaves
    monkeypatch.setattr(DraftLightningModule, "training_step", step)
    result = train(tiny_train_config(tmp_path, "name=damaged", *SHORT))
    assert result["resumed_from_step"] == 5 and result["global_step"] == 9
    assert (ckpts / "last.ckpt.damaged").is_file()
    assert "last.ckpt is damaged" in caplog.text and "set aside as last.ckpt.damaged" in caplog.text


def test_a_full_disk_while_checkpointing_leaves_the_last_checkpoint_whole(tmp_path, monkeypatch):
    from trainers.train import train

    save, calls = torch.save, []

    def filling_up(obj, f, *args, **kwargs):
        calls.append(f)
        save(obj, f, *args, **kwargs)
        if len(calls) >= 2:       # from the second checkpoint on, half of it fits and then the disk is full
            if isinstance(f, (str, os.PathLike)):
                os.truncate(f, os.path.getsize(f) // 2)
            else:
                f.truncate(f.tell() // 2)
            raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(torch, "save", filling_up)
    with pytest.raises(OSError) as failure:
        train(tiny_train_config(tmp_path, "name=full", *SHORT))
    assert failure.value.errno == errno.ENOSPC
    ckpts = Path(tiny_train_config(tmp_path, "name=full").paths.output) / "checkpoints"
    assert sorted(p.name for p in ckpts.iterdir()) == ["last.ckpt"]     # no half-written file beside it
    assert torch.load(ckpts / "last.ckpt", weights_only=True)["global_step"] == 2
    monkeypatch.setattr(torch, "save", save)
    assert train(tiny_train_config(tmp_path, "name=full", *SHORT))["resumed_from_step"] == 2


def test_a_second_training_on_the_same_folder_is_refused_naming_the_first(tmp_path):
    from trainers.train import train

    cfg = tiny_train_config(tmp_path, "name=busy", *SHORT)
    holder = subprocess.Popen([sys.executable, "-c", "import sys, time\nfrom trainers.run_folder import RunLock\n"
                               "with RunLock(sys.argv[1]):\n    print('locked', flush=True)\n    time.sleep(300)\n",
                               str(cfg.paths.output)], stdout=subprocess.PIPE, text=True, env=ENV, cwd=ROOT)
    try:
        assert holder.stdout.readline().strip() == "locked"
        with pytest.raises(RuntimeError, match=rf"in use by another training \(process {holder.pid}\)"):
            train(cfg)
    finally:
        holder.kill()
        holder.wait()
    assert train(cfg)["global_step"] == 9     # a killed holder leaves no stale lock


def test_training_on_a_read_only_runs_folder_is_one_line(tmp_path):
    runs = tmp_path / "ro"
    program = (
        "import errno, os, pathlib, runpy, sys\n"
        f"ro = {str(runs)!r}\n"
        "def refuse(path):\n"
        "    if str(path).startswith(ro):\n"
        "        raise OSError(errno.EROFS, 'Read-only file system', str(path))\n"
        "mkdir, makedirs = pathlib.Path.mkdir, os.makedirs\n"
        "def path_mkdir(self, *a, **k):\n"
        "    refuse(self)\n"
        "    return mkdir(self, *a, **k)\n"
        "def os_makedirs(name, *a, **k):\n"
        "    refuse(name)\n"
        "    return makedirs(name, *a, **k)\n"
        "pathlib.Path.mkdir, os.makedirs = path_mkdir, os_makedirs\n"
        "sys.argv = ['trainers.train', 'target=tiny', 'data=tiny', 'progress=false']\n"
        "runpy.run_module('trainers.train', run_name='__main__')\n")
    proc = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True, timeout=300, cwd=ROOT,
                          env={**ENV, "EAGLE_LITE_RUNS": str(runs)})
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"error: Read-only file system (EROFS): {runs}")
