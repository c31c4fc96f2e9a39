"""Atomic file writes: a file is either absent or complete, never half-written.

Every pipeline stage (distilled answers, feature shards, manifests, exported logs) and every head
folder (weights, config.json) is written through `write_atomic`, so a run killed at any moment leaves
only finished files behind and can resume.
"""
from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Callable
from pathlib import Path


def write_atomic(path: str | Path, write: Callable[[str], None]) -> Path:
    """Call `write(tmp_path)` on a temporary file next to `path`, then rename it onto `path`."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    try:
        write(tmp)
        fd = os.open(tmp, os.O_RDONLY)
        try:
            os.fsync(fd)   # the data is on disk before the name points at it (a power cut leaves the old file)
        finally:
            os.close(fd)
        os.chmod(tmp, 0o644)  # mkstemp makes 0600; these are shared data files, not secrets
        os.replace(tmp, path)  # atomic on POSIX: readers see the old file or the new one
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)
    return path


def check_writable(path: str | Path, flag: str) -> Path:
    """Make sure a file can be written at `path` before the work whose results it will hold: a folder there is a
    ValueError naming `flag`; a folder that cannot be made or written to, an OSError naming it."""
    path = Path(path)
    if path.is_dir():
        raise ValueError(f"{flag} {path} is a folder: give a file name")
    try:
        check_folder_writable(path.parent)
    except OSError as err:   # named as the file asked for
        raise OSError(err.errno, err.strerror, str(path)) from None
    return path


def check_folder_writable(folder: str | Path) -> Path:
    """Make `folder` (and its parents) and write a temporary file in it: an OSError if either cannot be done."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryFile(dir=folder):
        pass
    return folder


def write_text_atomic(path: str | Path, text: str) -> Path:
    return write_atomic(path, lambda tmp: Path(tmp).write_text(text, encoding="utf-8"))


def write_json_atomic(path: str | Path, data) -> Path:
    return write_text_atomic(path, json.dumps(data, indent=2) + "\n")
