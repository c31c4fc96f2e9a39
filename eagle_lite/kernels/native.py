"""eagle_lite's native CPU kernels (csrc/), built once per installation and loaded as torch ops.

`torch.ops.eagle_lite.grid4_linear / grid8_linear / gridk_linear` (grid_linear.py), `rms_norm` (fused_norm.py),
`tree_attention` (attention.py's gqa backend) and `decoder_layer`, `decoder_layer_packed` (fused_layer.py) are AVX2 C++
(csrc/, their shared pieces in csrc/kernels.h; the grid products also have an AVX-512 path, taken at run time where
the CPU has it, EAGLE_LITE_AVX512=0 to keep AVX2) compiled by torch's own extension builder on first use
(about a minute; cached under ~/.cache/torch_extensions, or $TORCH_EXTENSIONS_DIR). Where that cannot happen
(no C++ compiler, no Python headers, a CPU without AVX2, another architecture) `kernel_available()` is False
after one warning and every caller keeps its torch path: slower, never wrong. EAGLE_LITE_NATIVE=0 turns them off
(for A/B timings).

The build is named by a hash of what goes into it (`build_key`: the csrc/ files' text, the compiler flags, and
the torch and Python it builds against), and compiles a copy of the sources kept inside its build folder: two
checkouts of the same code on one installation share one build, whatever folders they sit in, and different
code (or another torch) gets a build of its own instead of rebuilding someone else's.
"""
from __future__ import annotations

import functools
import hashlib
import json
import logging
import os
import platform
import shutil
import sys
import sysconfig
import tempfile
from pathlib import Path

import torch

log = logging.getLogger("eagle_lite")

CSRC = Path(__file__).parent / "csrc"
SOURCES = [CSRC / name for name in ("grid_linear.cpp", "rms_norm.cpp", "tree_attention.cpp", "decoder_layer.cpp")]
OPS = ("grid4_linear", "grid8_linear", "gridk_linear", "rms_norm", "tree_attention", "decoder_layer",
       "decoder_layer_packed")
CFLAGS = ("-O3", "-mavx2", "-mfma", "-ffp-contract=off", "-fopenmp")
LDFLAGS = ("-fopenmp",)   # tuples: torch's builder appends its own flags to the lists it is given
STALE_LOCK_SECONDS = 600   # a build takes minutes at most; a lock this old was left by a build that was killed


def _build_root() -> Path:
    from torch.utils.cpp_extension import get_default_build_root

    return Path(os.environ.get("TORCH_EXTENSIONS_DIR") or get_default_build_root())


def build_key(folder: Path = CSRC) -> str:
    """12 hex digits of a hash of everything a build depends on: the text of each file in `folder` (sources and
    headers, by name, not by path), the compiler flags, and the torch and Python it compiles and links against."""
    h = hashlib.sha256()
    for file in sorted(p for p in folder.iterdir() if p.suffix in (".cpp", ".h")):
        h.update(file.name.encode() + b"\0" + file.read_bytes() + b"\0")
    toolchain = [CFLAGS, LDFLAGS, os.environ.get("CXX", "c++"), torch.__version__, str(Path(torch.__file__).parent),
                 sysconfig.get_paths()["include"], platform.machine()]
    h.update(json.dumps(toolchain).encode())
    return h.hexdigest()[:12]


@functools.cache
def extension_name() -> str:
    return f"eagle_lite_native_{build_key()}"


def build_dir() -> Path:
    """This code's build folder: one per `build_key`."""
    return _build_root() / extension_name()


def stage_sources(folder: Path, sources: list[Path] = SOURCES) -> list[Path]:
    """The sources as copies in `folder`/src (copied once, with the headers beside them): torch's build command
    names its sources' paths, so building every checkout's copy from this one place keeps the command, and
    with it the finished build, the same for all of them. A complete copy is never rewritten (its file times
    would make ninja rebuild)."""
    src = folder / "src"
    if not src.is_dir():
        folder.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=".src.", dir=folder))
        for file in sources[0].parent.iterdir():
            if file.suffix in (".cpp", ".h"):
                shutil.copy2(file, tmp / file.name)
        try:
            os.replace(tmp, src)   # whole or not at all; another process may have staged the same copy first
        except OSError:
            if not src.is_dir():
                raise
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return [src / file.name for file in sources]


def _built_before(folder: Path) -> bool:
    """Whether this code's build is cached (then loading takes a moment)."""
    return (folder / f"{folder.name}.so").is_file()


def needs_build() -> bool:
    """Whether the first use of the native kernels here would build them (about a minute) rather than load them."""
    if os.environ.get("EAGLE_LITE_NATIVE", "1") == "0" or platform.machine().lower() not in ("x86_64", "amd64"):
        return False
    return torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512") and not _built_before(build_dir())


def _clear_stale_lock(folder: Path | None = None) -> None:
    """torch's builder waits, silently and forever, while its lock file exists; a build that was killed (Ctrl-C
    during the first run) leaves it behind. Remove one that is old, say so for a recent one."""
    import time

    lock = (folder or build_dir()) / "lock"
    if not lock.exists():
        return
    age = time.time() - lock.stat().st_mtime
    if age > STALE_LOCK_SECONDS:
        log.warning("removing %s, left %d min ago by an interrupted build of the native kernels", lock, age // 60)
        lock.unlink(missing_ok=True)
    else:
        log.warning("waiting for another build of the native kernels (lock file %s); if no other eagle_lite "
                    "process is building, delete that file", lock)


@functools.cache
def kernel_available() -> bool:
    """Whether the native kernels run here: x86-64 with AVX2 and a C++ compiler (built once, cached)."""
    if os.environ.get("EAGLE_LITE_NATIVE", "1") == "0":
        return False
    if (platform.machine().lower() not in ("x86_64", "amd64")
            or torch.backends.cpu.get_cpu_capability() not in ("AVX2", "AVX512")):
        return False
    try:
        from torch.utils.cpp_extension import load

        # pip's `ninja` lands beside the interpreter, which need not be on PATH (a venv run by path)
        os.environ["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")])
        folder = build_dir()
        _clear_stale_lock(folder)
        if not _built_before(folder):
            log.warning("building eagle_lite's native CPU kernels once (about a minute; cached in %s)", folder)
        load(name=folder.name, sources=[str(s) for s in stage_sources(folder)], build_directory=str(folder),
             is_python_module=False, extra_cflags=list(CFLAGS), extra_ldflags=list(LDFLAGS))
        return all(hasattr(torch.ops.eagle_lite, op) for op in OPS)
    except Exception as err:  # a missing compiler or headers: the torch paths still work
        log.warning("eagle_lite's native CPU kernels are unavailable (%s: %s); using torch's ops instead",
                    type(err).__name__, str(err).splitlines()[0] if str(err) else "")
        return False
