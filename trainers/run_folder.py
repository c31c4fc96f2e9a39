"""A training run's folder (paths.output) kept sound through crashes, full disks and a second run:

- `RunLock`: one training at a time per folder; a second is refused with the first one's PID. The lock is the
  kernel's (fcntl), so a run killed with -9 leaves no stale lock behind.
- `AtomicCheckpointIO`: Lightning writes each checkpoint to a temporary file renamed into place once complete, so a
  full disk or a kill leaves the previous checkpoint whole instead of a truncated one.
- `resume_checkpoint`: the newest checkpoint that reads back whole; a damaged one is named and set aside
  (`<name>.damaged`), as damaged feature shards are.
- `finished` / `mark_finished`: a run that completed says so, and its rerun leaves the exported head alone.
"""
from __future__ import annotations

import errno
import fcntl
import json
import logging
import os
import zipfile
from pathlib import Path
from typing import Any

import torch
from lightning.fabric.plugins import TorchCheckpointIO
from omegaconf import OmegaConf

from eagle_lite.atomic import write_atomic, write_json_atomic

log = logging.getLogger("trainers.train")
LOCK = ".lock"
FINISHED = "finished.json"
DAMAGED = ".damaged"


class RunLock:
    """An exclusive lock on `folder` for as long as the `with` block runs; the holder's PID is in the lock file."""

    def __init__(self, folder: str | Path) -> None:
        self.path = Path(folder) / LOCK
        self.fd: int | None = None

    def __enter__(self) -> RunLock:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as err:
            holder = os.pread(fd, 64, 0).decode(errors="replace").strip() or "unknown"
            os.close(fd)
            if err.errno not in (errno.EAGAIN, errno.EACCES):
                raise
            raise RuntimeError(f"run folder {self.path.parent} is in use by another training (process {holder}): "
                               f"wait for it to end, or give this run its own name=...") from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        self.fd = fd
        return self

    def __exit__(self, *exc) -> None:
        if self.fd is not None:
            os.ftruncate(self.fd, 0)
            os.close(self.fd)   # closing the file releases the lock
            self.fd = None


class AtomicCheckpointIO(TorchCheckpointIO):
    """Lightning's torch checkpoints, written through `eagle_lite.atomic.write_atomic`: complete or absent."""

    def save_checkpoint(self, checkpoint: dict[str, Any], path, storage_options: Any | None = None) -> None:
        if storage_options is not None:
            raise TypeError(f"{type(self).__name__} takes no storage_options")
        write_atomic(path, lambda tmp: torch.save(checkpoint, tmp))


def damage(path: Path) -> str | None:
    """What is wrong with checkpoint `path` (a torch zip archive), or None when every entry reads back whole."""
    try:
        with zipfile.ZipFile(path) as archive:
            bad = archive.testzip()
    except (zipfile.BadZipFile, OSError, EOFError, ValueError) as err:
        return " ".join(str(err).split()) or type(err).__name__
    return None if bad is None else f"entry {bad} fails its checksum"


def resume_checkpoint(ckpt_dir: str | Path) -> Path | None:
    """The newest checkpoint in `ckpt_dir` that reads back whole (last.ckpt first), or None. Each damaged one met on
    the way is logged by name and renamed to `<name>.damaged`, so it is neither resumed from nor overwritten."""
    ckpt_dir = Path(ckpt_dir)
    if not ckpt_dir.is_dir():
        return None
    found = sorted(ckpt_dir.glob("*.ckpt"), key=lambda p: (p.name == "last.ckpt", p.stat().st_mtime), reverse=True)
    for path in found:
        problem = damage(path)
        if problem is None:
            return path
        aside = path.with_name(path.name + DAMAGED)
        os.replace(path, aside)
        log.warning("checkpoint %s is damaged (%s): set aside as %s; resuming from the one before it", path,
                    problem, aside.name)
    return None


def stop_settings(cfg) -> dict:
    """What decides where a run ends: a rerun with other values trains on (e.g. a raised trainer.max_epochs)."""
    early = cfg.get("early_stopping")
    return {"max_epochs": cfg.trainer.get("max_epochs"), "max_steps": cfg.trainer.get("max_steps"),
            "early_stopping": OmegaConf.to_container(early, resolve=True) if early else None}


def finished(cfg) -> dict | None:
    """The record of this run folder's completed training, if it completed with the stop settings asked for now
    and its exported head is still there; None otherwise (a run to start or resume)."""
    file = Path(cfg.paths.output) / FINISHED
    if not (cfg.get("resume") and file.is_file() and (Path(cfg.paths.export) / "config.json").is_file()):
        return None
    try:
        record = json.loads(file.read_text())
    except (ValueError, OSError):
        return None
    return record if record.get("stop") == stop_settings(cfg) else None


def mark_finished(cfg, summary: dict) -> None:
    """Record that this run's training completed and its head was exported."""
    write_json_atomic(Path(cfg.paths.output) / FINISHED, {
        "stop": stop_settings(cfg), "global_step": summary.get("global_step"), "epochs": summary.get("epochs"),
        "export": str(cfg.paths.export)})
