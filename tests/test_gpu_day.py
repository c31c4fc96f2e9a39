"""The GPU day's script (eval/gpu_day.py), run dry on the CPU: every step's command runs with a tiny target, so the
script that a lent GPU runs cannot rot while none is lent."""
from __future__ import annotations

import json
import tarfile

import pytest
import torch
from conftest import train_config

from eagle_lite.heads.checkpoint import save_head
from eagle_lite.heads.draft import DraftHead
from eagle_lite.targets.loading import load_target
from eval import gpu_day


@pytest.fixture
def tiny_head(tiny_model_dir, tmp_path):
    target = load_target(str(tiny_model_dir))
    return save_head(DraftHead.for_target(target), tmp_path / "head", target)


@pytest.fixture
def questions(tmp_path):
    """Two short prompts of two kinds: the held-out file's prompts are longer than the tiny target's context."""
    path = tmp_path / "questions.jsonl"
    path.write_text(json.dumps({"question_id": "a", "category": "chat", "turns": ["hi"]}) + "\n"
                    + json.dumps({"question_id": "b", "category": "code", "turns": ["def f():"]}) + "\n")
    return path


def test_the_dry_run_runs_every_step_and_returns_the_files_a_call_may(tiny_model_dir, tiny_head, questions, tmp_path,
                                                                     capsys):
    out, work = tmp_path / "out", tmp_path / "work"
    args = ["run", "--dry-run", "--target", str(tiny_model_dir), "--draft", str(tiny_head), "--questions",
            str(questions), "--out", str(out), "--work", str(work), "--budget-s", "900"]
    assert gpu_day.main(args) == 0
    steps = json.loads((out / "steps.json").read_text())["steps"]
    status = {s["name"]: s["status"] for s in steps}
    assert [s.name for s in gpu_day.STEPS] == list(status)
    assert status.pop("head_validate").startswith("skipped")    # validation needs the real target's cache
    assert set(status.values()) == {"ok"}, status
    files = sorted(p.name for p in out.iterdir())
    assert files == ["head.tar", "log.txt", "parallel.tar", "results.tar.gz", "steps.json"]
    assert len(files) <= gpu_day.FILES_BACK
    with tarfile.open(out / "results.tar.gz") as tar:
        names = tar.getnames()
    for want in ("results/step_cost_llama1b.json", "results/step_cost_smollm2.json", "results/head_config.json",
                 "results/table_shipped/summary.md", "results/table_tuned/summary.md", "results/table_bf16/summary.md",
                 "results/table_bf16_eagle3/summary.md", "results/table_bf16_full_vocab/summary.md",
                 "results/table_fp32/summary.md", "results/table_fp32_eagle3/summary.md",
                 "results/hf_generate/summary.md", "results/op_counts_shipped.json", "results/op_counts_eagle3.json",
                 "results/table_bf16_parallel/summary.md", "results/table_fp32_parallel/summary.md"):
        assert want in names, names
    tuned = json.loads((tiny_head / "config.json").read_text())
    assert "tree" in tuned      # tune --save-tree recorded the tree for the device it ran on (here the CPU)
    with tarfile.open(out / "head.tar") as tar:
        assert "head/config.json" in tar.getnames()

    # a second call on the same machine skips what is done, and the report reads what came back
    out2 = tmp_path / "out2"
    assert gpu_day.main([*args[:-4], "--out", str(out2), "--work", str(work), "--budget-s", "60"]) == 0
    again = json.loads((out2 / "steps.json").read_text())["steps"]
    assert all(s["status"].startswith("done earlier") for s in again), again
    capsys.readouterr()
    assert gpu_day.main(["report", str(out)]) == 0
    text = capsys.readouterr().out
    assert "| table_shipped | ok |" in text and "summary.md" in text and "the new head:" in text
    assert "the new parallel head:" in text
    assert (out / "unpacked" / "head" / "config.json").is_file()
    assert json.loads((out / "unpacked" / "parallel" / "config.json").read_text())["parallel"] == 3
    assert text.rstrip().endswith(f"python -m eval.gpu_day report {out} --keep (copies it to "
                                  f"{gpu_day.PARALLEL_HEAD}, which the next `make gpu-day` packs)")
    kept = tmp_path / "kept"
    kept.mkdir()
    (kept / "stale.txt").write_text("from the head before")
    assert gpu_day.main(["report", str(out), "--keep", str(kept)]) == 0
    assert f"kept the parallel head in {kept}" in capsys.readouterr().out
    assert sorted(p.name for p in kept.iterdir()) == sorted(p.name for p in (out / "unpacked" / "parallel").iterdir())


def test_steps_without_time_left_are_skipped_and_recorded(tiny_model_dir, tiny_head, questions, tmp_path):
    out = tmp_path / "out"
    assert gpu_day.main(["run", "--dry-run", "--target", str(tiny_model_dir), "--draft", str(tiny_head),
                         "--questions", str(questions), "--out", str(out), "--work", str(tmp_path / "w"),
                         "--budget-s", "20"]) == 0
    steps = json.loads((out / "steps.json").read_text())["steps"]
    assert all(s["status"].startswith("skipped") for s in steps), steps
    assert json.loads((tmp_path / "w" / "state.json").read_text() if (tmp_path / "w" / "state.json").exists()
                      else "{}") == {}    # nothing ran: a later call runs every step


def test_a_file_larger_than_a_call_returns_is_cut_and_put_back_together(tmp_path):
    data = bytes(range(256)) * 41
    (tmp_path / "head.tar").write_bytes(data)
    parts = gpu_day.cut(tmp_path / "head.tar", 4000)
    assert [p.name for p in parts] == ["head.tar.00", "head.tar.01", "head.tar.02"]
    assert not (tmp_path / "head.tar").exists() and all(p.stat().st_size <= 4000 for p in parts)
    assert gpu_day.uncut(tmp_path, "head.tar").read_bytes() == data
    assert gpu_day.cut(tmp_path / "head.tar", len(data)) == [tmp_path / "head.tar"]
    assert gpu_day.uncut(tmp_path, "nothing.tar") is None


def test_the_plan_fits_the_lease_and_names_every_step(tmp_path, capsys):
    assert gpu_day.main(["plan", "--all", "--carry", str(tmp_path / "none")]) == 0
    text = capsys.readouterr().out
    for step in gpu_day.STEPS:
        assert step.name in text
    assert 'run(carry=[".carry/1"]' in text and "--budget-s" in text and "--skip" not in text
    planned = gpu_day.START_S + 2 * gpu_day.TRANSFER_S + sum(s.estimate_s for s in gpu_day.STEPS
                                                               if s.name not in gpu_day.MEASURED)
    assert planned <= gpu_day.LEASE_S                # the default day (what an earlier day measured left out)
    last = sum(s.estimate_s for s in gpu_day.STEPS if s.needs_target and s.name not in gpu_day.MEASURED)
    assert last <= gpu_day.LAST_CALL_S - gpu_day.RESERVE_S


def test_the_plan_leaves_out_what_an_earlier_day_measured(tmp_path, capsys):
    assert gpu_day.main(["plan", "--carry", str(tmp_path / "none")]) == 0
    text = capsys.readouterr().out
    calls = [line for line in text.splitlines() if line.startswith("  run(")]
    assert len(calls) == 2 and all(f"--skip {','.join(gpu_day.MEASURED)}\"" in c for c in calls), calls
    steps = [line.split()[0] for line in text.splitlines() if line.startswith("    ")]
    assert steps == [s.name for s in gpu_day.STEPS if s.name not in gpu_day.MEASURED]
    # issue #62's next loan: the tests, the parallel head's fit and its tables in bf16 and fp32
    assert steps == ["gpu_tests", "parallel_fit", "table_bf16_parallel", "table_fp32_parallel"]
    assert ".carry/eagle3" not in text and "--eagle3" not in text     # no EAGLE-3 step planned: no head carried
    assert gpu_day.main(["plan", "--skip", "tune", "--carry", str(tmp_path / "none")]) == 0
    assert "--skip tune\"" in capsys.readouterr().out
    assert gpu_day.main(["plan", "--skip", "tables", "--carry", str(tmp_path / "none")]) == 2
    assert "--skip: unknown step(s) ['tables']" in capsys.readouterr().err


def test_a_call_of_its_own_carries_the_eagle3_head_before_the_last(tmp_path, capsys):
    for folder in ("1", "2", "eagle3"):
        (tmp_path / folder).mkdir()
    (tmp_path / "eagle3" / "config.json").write_text("{}")
    assert gpu_day.main(["plan", "--carry", str(tmp_path)]) == 0
    assert ".carry/eagle3" not in capsys.readouterr().out           # the default plan has no EAGLE-3 step
    assert gpu_day.main(["plan", "--all", "--carry", str(tmp_path)]) == 0
    calls = [line for line in capsys.readouterr().out.splitlines() if line.startswith("  run(")]
    assert 'carry=[".carry/1"]' in calls[0] and 'carry=[".carry/2"]' in calls[2]
    assert calls[1] == '  run(carry=[".carry/eagle3"], timeout_s=60, command="cp -r .carry/eagle3 /tmp/eagle3")'
    assert all(c.rstrip('")').endswith("--eagle3 /tmp/eagle3") for c in calls if "eval.gpu_day run" in c)
    assert all("--skip" not in c for c in calls)
    assert len(calls) == 3                                               # the head's folder is not a bundle part


def test_a_missing_eagle3_head_skips_its_steps_and_says_so(tmp_path):
    out = tmp_path / "out"
    skip = ",".join(s.name for s in gpu_day.STEPS if s.name not in gpu_day.EAGLE3_STEPS)
    assert gpu_day.main(["run", "--out", str(out), "--work", str(tmp_path / "w"), "--budget-s", "60",
                         "--skip", skip, "--eagle3", str(tmp_path / "nowhere")]) == 0
    steps = {s["name"]: s["status"] for s in json.loads((out / "steps.json").read_text())["steps"]}
    for name in gpu_day.EAGLE3_STEPS:
        assert steps[name] == f"skipped (no EAGLE-3 head at {tmp_path / 'nowhere'}: carry it there)"


def test_a_bundle_packed_before_the_tree_grew_is_refused_with_what_to_do(tmp_path, capsys):
    tree = gpu_day.tree_bytes()
    for n, size in ((1, gpu_day.CALL_LIMIT - tree - gpu_day.CALL_SPARE - 10), (2, gpu_day.CALL_LIMIT - tree + 1)):
        (tmp_path / str(n)).mkdir()
        with open(tmp_path / str(n) / "000.000", "wb") as f:
            f.truncate(size)        # sparse: the size counts, not the disk
    assert gpu_day.main(["plan", "--carry", str(tmp_path)]) == 1
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and f"{tmp_path / '2'}:" in err and "repack with `make gpu-day`" in err
    (tmp_path / "2" / "000.000").unlink()
    assert gpu_day.main(["plan", "--carry", str(tmp_path)]) == 0


def test_run_without_its_inputs_is_one_line(tmp_path, capsys):
    assert gpu_day.main(["run", "--dry-run", "--out", str(tmp_path), "--budget-s", "10"]) == 2
    assert "--dry-run needs --target" in capsys.readouterr().err
    assert gpu_day.main(["run", "--out", str(tmp_path), "--budget-s", "10", "--carry", str(tmp_path)]) == 2
    assert "no manifest.json there" in capsys.readouterr().err
    assert gpu_day.main(["run", "--out", str(tmp_path), "--budget-s", "10", "--skip", "tables"]) == 2
    assert "--skip: unknown step(s) ['tables']" in capsys.readouterr().err
    assert gpu_day.main(["report", str(tmp_path / "nothing")]) == 1


@pytest.mark.parametrize("text, problem", [("{oops", "not JSON: Expecting"), ('{"x": 1}', 'no "steps" list'),
                                           ('{"steps": [{"name": "tune"}]}', "a step lacks name, status or seconds")])
def test_a_damaged_steps_file_is_named_in_one_line(text, problem, tmp_path, capsys):
    (tmp_path / "call1").mkdir()
    (tmp_path / "call1" / "steps.json").write_text(text)
    assert gpu_day.main(["report", str(tmp_path)]) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"error: {tmp_path / 'call1' / 'steps.json'} is not a gpu_day steps.json") and problem in err
    assert err.count("\n") == 1


@pytest.fixture
def parallel_head(tiny_model_dir, tmp_path):
    """A tiny parallel head (3 tokens a forward), as a day's parallel_fit returns one for the tiny target."""
    target = load_target(str(tiny_model_dir))
    return save_head(DraftHead.for_target(target).make_parallel(3), tmp_path / "kept", target)


def fit_commands(monkeypatch, tiny_model_dir, tiny_head, questions, tmp_path, carry=None):
    """The parallel_fit commands of a dry run (the others skipped, no command run) and its log."""
    ran = []

    def sh(self, record, argv, timeout):
        record.commands.append(" ".join(argv))
        ran.append(argv)
        return 0

    monkeypatch.setattr(gpu_day.Day, "sh", sh)
    monkeypatch.setattr(gpu_day, "SITE", tmp_path / "site")
    out = tmp_path / "out"
    skip = ",".join(s.name for s in gpu_day.STEPS if s.name != "parallel_fit")
    assert gpu_day.main(["run", "--dry-run", "--target", str(tiny_model_dir), "--draft", str(tiny_head),
                         "--questions", str(questions), "--out", str(out), "--work", str(tmp_path / "w"),
                         "--budget-s", "900", "--skip", skip, *(["--carry", str(carry)] if carry else [])]) == 0
    return ran, (out / "log.txt").read_text()


def test_a_packed_parallel_head_is_extracted_and_continued_by_the_fit(monkeypatch, tiny_model_dir, tiny_head,
                                                                       parallel_head, questions, tmp_path, capsys):
    wheel = tmp_path / "wheels" / "hydra_core-1.3.8-py3-none-any.whl"
    wheel.parent.mkdir()
    wheel.write_bytes(b"w" * 100)
    size = sum(f.stat().st_size for f in parallel_head.iterdir())
    folders = gpu_day.bundle([wheel], tmp_path / "carry", size // 3, parallel_head)
    assert len(folders) >= 3                                     # the head cut over several calls
    manifest = json.loads((folders[0] / "manifest.json").read_text())
    assert [e["name"] for e in manifest] == [wheel.name, "parallel_init.tar"]
    assert "kind" not in manifest[0] and manifest[1]["kind"] == "head"
    assert manifest[1]["from"] == str(parallel_head) and "parallel 3" in manifest[1]["about"]

    # the plan says which head the bundle continues
    assert gpu_day.main(["plan", "--carry", str(tmp_path / "carry")]) == 0
    assert f"parallel_fit continues the parallel head packed from {parallel_head}" in capsys.readouterr().out

    # on the device: nothing goes to pip but the wheel, the head once all its parts are in
    pips = []
    monkeypatch.setattr(gpu_day.subprocess, "run", lambda cmd, **kw: pips.append(cmd))
    device = tmp_path / "device"
    device.mkdir()
    for folder in folders:
        for f in folder.iterdir():
            (device / f.name).write_bytes(f.read_bytes())
        installed = gpu_day.install(device, tmp_path / "site", lambda line: None)
        assert installed == {wheel.name}
        assert (device / "parallel_init" / "config.json").is_file() == (folder == folders[-1])
    assert len(pips) == 1 and pips[0][-1].endswith(wheel.name)
    for f in parallel_head.iterdir():
        assert (device / "parallel_init" / f.name).read_bytes() == f.read_bytes()
    monkeypatch.undo()

    ran, log = fit_commands(monkeypatch, tiny_model_dir, tiny_head, questions, tmp_path, carry=device)
    assert len(ran) == 1 and f"draft.init_from={device / 'parallel_init'}" in ran[0]
    assert f"continues the carried parallel head {device / 'parallel_init'} (parallel 3" in log


def test_without_a_carried_head_the_fit_starts_as_its_experiment_does(monkeypatch, tiny_model_dir, tiny_head,
                                                                      questions, tmp_path, capsys):
    (tmp_path / "carry").mkdir()
    (tmp_path / "carry" / "manifest.json").write_text("[]")
    ran, log = fit_commands(monkeypatch, tiny_model_dir, tiny_head, questions, tmp_path, carry=tmp_path / "carry")
    profile = gpu_day.dry_profile(str(tiny_model_dir), str(tiny_head), str(questions))
    assert len(ran) == 1 and ran[0][3:-1] == [*profile.parallel_train, f"name={gpu_day.PARALLEL_NAME}"]
    assert "no parallel head carried" in log
    assert gpu_day.main(["plan", "--carry", str(tmp_path / "none")]) == 0
    assert "parallel_fit starts from the shipped head" in capsys.readouterr().out
    assert gpu_day.main(["pack", "--parallel-from", str(tmp_path)]) == 2
    assert "--parallel-from" in capsys.readouterr().err


def test_trainers_train_continues_a_parallel_head(tiny_model_dir, parallel_head, tmp_path):
    """What parallel_fit runs with a carried head: the head is taken as it is (parallel, its mask vectors kept)."""
    from eagle_lite.formats import load_head
    from trainers.train import build_module, own_target

    cfg = train_config(*own_target([f"target={tiny_model_dir}", "data=tiny", f"draft.init_from={parallel_head}",
                                    "draft.parallel=3", "draft.objective.ttt_steps=3"]))
    target = load_target(str(tiny_model_dir))
    head = build_module(cfg, target, None).head
    saved = load_head(str(parallel_head), target).float()
    assert head.parallel == 3
    assert torch.equal(head.mask_hidden, saved.mask_hidden) and torch.equal(head.mask_embed, saved.mask_embed)
    assert torch.equal(head.fc.weight, saved.fc.weight)
