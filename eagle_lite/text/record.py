"""`--record DIR` (opt-in): every answer the CLI, the server or `load(record=DIR)` completes, written as token ids in
the distill shard format for `python -m trainers.train data=recorded data.distill.start_from=DIR`.

A record is one answer: `input_ids` (the prompt, earlier turns included, then the answer) and the answer's span.
`distill.json` names the target (another target's folder is refused in one line). Shards of at most `SHARD_SIZE`
records are rewritten whole (temporary file, then rename) after every answer; each process claims the shard numbers
it writes (created exclusively), so several may record into one folder. docs/training.md, "Your own traffic".
"""
from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path

from ..atomic import check_folder_writable, write_json_atomic, write_text_atomic

META = "distill.json"
SHARD_SIZE = 64
SOURCE = "recorded"


def recorded_meta(fingerprint: dict) -> dict:
    """The distill meta of a folder of recorded answers of the target with this fingerprint (what trainers.distill's
    `run_meta` writes for source "recorded")."""
    return {"format": "eagle_lite.distill", "version": 1, "target": fingerprint, "settings": {"source": SOURCE}}


class Recorder:
    """Appends answered sequences of `target` to the record folder `folder` (module docstring). Thread-safe: the
    server's worker records while requests arrive."""

    def __init__(self, folder: str | Path, target) -> None:
        self.folder = Path(folder)
        meta = recorded_meta(target.fingerprint())
        check_folder_writable(self.folder)   # made where missing
        path = self.folder / META
        if path.is_file():
            try:
                held = json.loads(path.read_text())
            except (OSError, ValueError) as err:
                raise ValueError(f"--record {self.folder}: {META} is damaged ({err}); give another folder") from err
            keys = ("model_type", "hidden_size", "vocab_size", "embedding_sha")
            built = held.get("target", {}) if isinstance(held, dict) else {}
            if any(built.get(k) != meta["target"][k] for k in keys):
                raise ValueError(f"--record {self.folder} holds the answers of target '{built.get('name')}', not of "
                                 f"'{target.name}': give each target its own folder")
            if held.get("settings", {}).get("source") != SOURCE:
                raise ValueError(f"--record {self.folder} holds distilled answers of source "
                                 f"'{held.get('settings', {}).get('source')}', not recorded traffic: give another "
                                 f"folder")
        else:
            write_json_atomic(path, {**meta, "shards": {}})
        self._lock = threading.Lock()
        self._prefix = f"rec-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}"
        self._shard: Path | None = None
        self._records: list[dict] = []
        self.count = 0

    def _claim(self) -> Path:
        """A new shard file, numbered after the folder's last one and created exclusively (another process recording
        into the same folder takes the next number)."""
        taken = [int(p.name[6:11]) for p in self.folder.glob("shard-[0-9][0-9][0-9][0-9][0-9].jsonl*")]
        index = max(taken, default=-1) + 1
        while True:
            path = self.folder / f"shard-{index:05d}.jsonl"
            try:
                os.close(os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644))
                return path
            except FileExistsError:
                index += 1

    def add(self, prompt_ids: list[int], answer_ids: list[int]) -> None:
        """Record one answer (nothing for an empty one)."""
        if not answer_ids:
            return
        with self._lock:
            start = len(prompt_ids)
            self._records.append({"id": f"{self._prefix}:{self.count:06d}", "input_ids": [*prompt_ids, *answer_ids],
                                  "spans": [[start, start + len(answer_ids)]]})
            self.count += 1
            if self._shard is None:
                self._shard = self._claim()
            write_text_atomic(self._shard, "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in self._records))
            if len(self._records) >= SHARD_SIZE:
                self._shard, self._records = None, []
