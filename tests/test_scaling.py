"""Training over several processes on the CPU (gloo, the tiny target): Lightning's DDP against one process, a killed
rank resumed on another number of ranks, and the data stages shared over ranks started by torchrun."""
from __future__ import annotations

import csv
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from conftest import tiny_train_config  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
QUIET = ("progress=false", "trainer.enable_progress_bar=false", "trainer.enable_model_summary=false")
# the same 6 steps on any number of ranks: a global batch of 8 sequences, no input noise (drawn per rank), a
# checkpoint every 2 steps, one validation at the end
FIT = ("trainer.max_steps=6", "draft.objective.noise=none", "trainer.num_sanity_val_steps=0",
       "checkpoint.every_n_train_steps=2", "trainer.log_every_n_steps=1")
# What "the same head" means here. With per-rank batches that make the global batch equal, every step reads the same
# sequences and its loss is the mean over all of them (objective.step_losses' per_rank): the per-step losses agree to
# float rounding (the ranks' batches are padded to other widths). AdamW's first steps move a weight by about lr in
# the direction of its gradient's sign, so where a gradient is ~0 rounding can flip that sign: a few weights then
# differ by up to 2 lr a step. Measured (6 steps, lr 1e-3): per-step losses within 9e-5 relative; mean |dw| 9e-6,
# 0.3% of the weights more than 1e-4 apart, the largest 2.3e-3. Another batch order would move the losses by ~1e-2
# and the mean |dw| to ~1e-3.
LOSS_RTOL = 5e-4
MEAN_DW = 5e-5
FAR_DW, FAR_SHARE = 1e-4, 0.01


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("runs")


def train_command(*overrides: str, script: list[str] | None = None) -> list[str]:
    return [sys.executable, *(script or ["-m", "trainers.train"]), "target=tiny", "data=tiny", *QUIET, *overrides]


def run(command: list[str], runs: Path, timeout: int = 240, **env) -> subprocess.CompletedProcess:
    environ = {**os.environ, "EAGLE_LITE_RUNS": str(runs), "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1",
               "OMP_NUM_THREADS": "1", **env}
    return subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=timeout, env=environ)


def ddp(devices: int, batch: int) -> tuple[str, ...]:
    return ("trainer=ddp", "trainer.accelerator=cpu", "trainer.precision=32-true", f"trainer.devices={devices}",
            f"data.loader.batch_size={batch}")


def trained(run: Path) -> dict[str, torch.Tensor]:
    """The fp32 weights a run ended with (its last checkpoint; the export stores them in the target's dtype)."""
    return torch.load(Path(run) / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=True)["state_dict"]


def step_losses(run: Path) -> dict[int, float]:
    """train/loss of every step the run logged (a resumed run's later log wins for a step logged twice)."""
    losses = {}
    for log in sorted((Path(run) / "logs").glob("version_*/metrics.csv"), key=lambda p: int(p.parent.name[8:])):
        for row in csv.DictReader(log.open()):
            if row.get("train/loss_step"):
                losses[int(row["step"])] = float(row["train/loss_step"])
    return losses


def assert_same_head(got: Path, want: Path) -> None:
    """The two runs trained on the same batches to the same weights, to the tolerances stated above."""
    a, b = step_losses(got), step_losses(want)
    assert a.keys() == b.keys() == set(range(6))
    for step in a:
        assert a[step] == pytest.approx(b[step], rel=LOSS_RTOL), (step, a, b)
    x, y = trained(got), trained(want)
    assert x.keys() == y.keys()
    dw = torch.cat([(x[k] - y[k]).abs().flatten() for k in x])
    assert float(dw.mean()) <= MEAN_DW and float((dw > FAR_DW).float().mean()) <= FAR_SHARE, (
        float(dw.mean()), float((dw > FAR_DW).float().mean()))


@pytest.fixture(scope="module")
def one_process(runs) -> dict:
    """The reference: 6 steps of 8 sequences in this process."""
    from trainers.train import train

    return train(tiny_train_config(runs, "name=one", "data.loader.batch_size=8", *FIT))


def test_two_ddp_processes_train_the_head_one_process_trains(runs, one_process):
    """trainer=ddp on 2 CPU processes (gloo), 4 sequences each: the head, the reduced validation metric and the
    files of the run folder against one process with batches of 8."""
    out = run(train_command("name=two", *ddp(2, 4), *FIT), runs)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.count("head: ") == 1   # rank 0 alone reports
    folder = runs / "train" / "tiny" / "tiny" / "two"
    log = json.loads((folder / "head" / "train_log.json").read_text())["summary"]
    assert log["global_step"] == one_process["global_step"] == 6
    assert_same_head(folder, Path(one_process["export"]).parent)
    # validation read every held-out sequence once over the two ranks, and the sums were reduced across them
    assert log["val/tokens"] == one_process["val/tokens"] > 0
    assert log["val/top1"] == pytest.approx(one_process["val/top1"], abs=0.02)
    # one writer: one Hydra config and log, one CSV log, one export, one set of checkpoints
    assert sorted(p.name for p in folder.iterdir()) == [".hydra", ".lock", "checkpoints", "epochs.json",
                                                        "estimate.json", "finished.json", "head", "logs", "train.log"]
    assert sorted(p.name for p in (folder / "logs").iterdir()) == ["version_0"]
    assert sorted(p.name for p in (folder / "checkpoints").iterdir()) == ["last.ckpt"]
    assert not list(folder.rglob("*.tmp"))


CRASHING = """
import os, sys
sys.path.insert(0, {root!r})
from trainers.module import DraftLightningModule
step = DraftLightningModule.training_step

def killed(self, batch, batch_idx):
    if self.global_step == 3 and self.global_rank == 1:
        os.kill(os.getpid(), 9)   # rank 1 dies as a node does: no exception, no checkpoint of its own
    return step(self, batch, batch_idx)

DraftLightningModule.training_step = killed
import runpy
runpy.run_module("trainers.train", run_name="__main__")   # as `python -m trainers.train` (Lightning reruns this file)
"""


def test_a_killed_rank_resumes_on_another_number_of_ranks(runs, one_process, tmp_path):
    """Rank 1 of 2 is killed at step 3; the run goes on from its last checkpoint on one process (8 sequences a
    batch) and ends with the head of the uninterrupted run: the data order goes on where the 2 ranks stopped."""
    from trainers.train import train

    script = tmp_path / "killed_rank.py"
    script.write_text(CRASHING.format(root=str(ROOT)))
    out = run(train_command("name=killed", *ddp(2, 4), *FIT, script=[str(script)]), runs)
    assert out.returncode != 0
    folder = runs / "train" / "tiny" / "tiny" / "killed"
    assert (folder / "checkpoints" / "last.ckpt").is_file() and not (folder / "head").exists()
    resumed = train(tiny_train_config(runs, "name=killed", "data.loader.batch_size=8", *FIT))
    assert resumed["resumed_from_step"] in (2, 3) and resumed["global_step"] == 6
    assert_same_head(Path(resumed["export"]).parent, Path(one_process["export"]).parent)


def test_the_features_stage_over_two_torchrun_processes_is_the_one_process_cache(runs, one_process, tmp_path):
    """torchrun starts 2 ranks; distill and features are shared between them (each writes its own shards, rank 0 the
    records), and the caches equal those of one process, byte for byte in every tensor."""
    here = tmp_path / "runs"
    out = run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
               "-m", "trainers.train", "target=tiny", "data=tiny", *QUIET, "stop_after=features"], here)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "rank 1 of 2 computes" in out.stdout and "rank 1 of 2 answers" in out.stdout
    mine, theirs = here / "data" / "tiny" / "tiny", runs / "data" / "tiny" / "tiny"
    reference = [json.loads(line) for f in sorted((theirs / "distill").glob("shard-*.jsonl")) for line in
                 f.read_text().splitlines()]
    assert [json.loads(line) for f in sorted((mine / "distill").glob("shard-*.jsonl"))
            for line in f.read_text().splitlines()] == reference
    manifest = json.loads((mine / "features" / "manifest.json").read_text())
    assert manifest["complete"]
    want = json.loads((theirs / "features" / "manifest.json").read_text())
    assert [e["ids"] for e in manifest["shards"]] == [e["ids"] for e in want["shards"]]
    for entry in want["shards"]:
        got, ref = load_file(mine / "features" / entry["file"]), load_file(theirs / "features" / entry["file"])
        assert got.keys() == ref.keys() and all(torch.equal(got[k], ref[k]) for k in ref)


def test_online_features_train_the_head_the_cache_trains(one_process, tmp_path):
    """data.features.mode=online: the fit's target computes each batch's features (no cache is written); the same
    steps as the cached run, to the same weights (to the tolerances above: features rounded to bf16 alike)."""
    from trainers.train import train

    online = train(tiny_train_config(tmp_path, "name=one", "data.loader.batch_size=8", "data.features.mode=online",
                                     *FIT))
    assert not (tmp_path / "data" / "tiny" / "tiny" / "features").exists()
    assert online["tokens"] == one_process["tokens"] and online["val/tokens"] == one_process["val/tokens"]
    assert_same_head(Path(online["export"]).parent, Path(one_process["export"]).parent)


def test_fsdp_and_several_machines_compose_as_lightning_strategies():
    """trainer=fsdp is Lightning's FSDPStrategy (GPUs only: Lightning refuses it on the CPU accelerator, so it is not
    run here); trainer.num_nodes reaches the Trainer."""
    import hydra
    from conftest import train_config
    from lightning.pytorch.strategies import FSDPStrategy

    cfg = train_config("trainer=fsdp", "trainer.num_nodes=2")
    strategy = hydra.utils.instantiate(cfg.trainer.strategy)
    assert isinstance(strategy, FSDPStrategy) and cfg.trainer.accelerator == "gpu" and cfg.trainer.num_nodes == 2
    assert train_config("trainer=ddp", "trainer.num_nodes=2").trainer.num_nodes == 2
