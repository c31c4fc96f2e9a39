"""A shard file's size and a cheap checksum, recorded when it is written, so a resumed stage finds a damaged one.

The checksum is BLAKE2b over the file's first and last MiB (the whole file below 2 MiB), next to its size.
A feature shard of the default recipe holds up to ~300 MB and a cache holds many: checking every shard on each
resume then reads 2 MiB a shard, not the whole cache, and still catches the damage files meet in practice,
a truncated or extended file (the size) and a header or tail overwritten or zeroed (the sampled ends). A change
inside the middle of a large shard goes unseen; distill shards, usually under 2 MiB, are checked whole.
"""
from __future__ import annotations

import hashlib
from pathlib import Path

SAMPLE = 1 << 20  # bytes read at each end of a file


def file_digest(path: str | Path) -> dict:
    """{"bytes": size, "blake2b": checksum of the first and last SAMPLE bytes}: what a manifest records."""
    path = Path(path)
    size = path.stat().st_size
    h = hashlib.blake2b(digest_size=16)
    with open(path, "rb") as f:
        h.update(f.read(SAMPLE))
        if size > SAMPLE:
            f.seek(max(SAMPLE, size - SAMPLE))
            h.update(f.read(SAMPLE))
    return {"bytes": size, "blake2b": h.hexdigest()}


def file_damage(path: str | Path, recorded: dict, checksum: bool = True) -> str | None:
    """Why `path` no longer matches what was `recorded` of it (its `file_digest`), or None where it does.

    Only the fields `recorded` holds are compared: manifests written before these fields existed hold neither,
    and then only a missing file is damage. checksum=False compares the size alone (a stat, no read).
    """
    path = Path(path)
    if not path.is_file():
        return "the file is missing"
    size = path.stat().st_size
    if "bytes" in recorded and size != recorded["bytes"]:
        return f"{size} bytes, the manifest recorded {recorded['bytes']}"
    if checksum and "blake2b" in recorded and file_digest(path)["blake2b"] != recorded["blake2b"]:
        return "its checksum differs from the manifest's"
    return None
