"""eagle_lite's native CPU kernels (csrc/), built once per machine and loaded as torch ops.

`torch.ops.eagle_lite.grid4_linear / grid8_linear` (grid_linear.py), `rms_norm` (fused_norm.py),
`tree_attention` (attention.py's gqa backend) and `decoder_layer` (fused_layer.py) are AVX2 C++
(csrc/, their shared pieces in csrc/kernels.h) compiled by torch's own extension builder on first use
(about a minute; cached under ~/.cache/torch_extensions, or $TORCH_EXTENSIONS_DIR). Where that cannot happen (no C++ compiler,
no Python headers, a CPU without AVX2, another architecture) `kernel_available()` is False after one
warning and every caller keeps its torch path: slower, never wrong. EAGLE_LITE_NATIVE=0 turns them off
(for A/B timings).
"""
from __future__ import annotations

import functools
import logging
import os
import platform
import sys
from pathlib import Path

import torch

log = logging.getLogger("eagle_lite")

NAME = "eagle_lite_native"
SOURCES = [Path(__file__).parent / "csrc" / name
           for name in ("grid_linear.cpp", "rms_norm.cpp", "tree_attention.cpp", "decoder_layer.cpp")]
OPS = ("grid4_linear", "grid8_linear", "rms_norm", "tree_attention", "decoder_layer")


def _build_root() -> Path:
    from torch.utils.cpp_extension import get_default_build_root

    return Path(os.environ.get("TORCH_EXTENSIONS_DIR") or get_default_build_root())


def _built_before() -> bool:
    """Whether a build of the kernels is cached (then loading takes a moment; torch rebuilds if a source changed)."""
    return any(_build_root().glob(f"*/{NAME}/{NAME}.so")) or any(_build_root().glob(f"{NAME}/{NAME}.so"))


STALE_LOCK_SECONDS = 600   # a build takes ~1.5 min; a lock this old was left by a build that was killed


def _clear_stale_lock() -> None:
    """torch's builder waits, silently and forever, while its lock file exists; a build that was killed (Ctrl-C
    during the first run) leaves it behind. Remove one that is old, say so for a recent one."""
    import time

    for lock in [_build_root() / NAME / "lock", *_build_root().glob(f"*/{NAME}/lock")]:
        if not lock.exists():
            continue
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
    if platform.machine().lower() not in ("x86_64", "amd64") or torch.backends.cpu.get_cpu_capability() not in ("AVX2", "AVX512"):
        return False
    try:
        from torch.utils.cpp_extension import load

        # pip's `ninja` lands beside the interpreter, which need not be on PATH (a venv run by path)
        os.environ["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")])
        _clear_stale_lock()
        if not _built_before():
            log.warning("building eagle_lite's native CPU kernels once (about a minute; cached under %s)", _build_root())
        load(name=NAME, sources=[str(s) for s in SOURCES], is_python_module=False,
             extra_cflags=["-O3", "-mavx2", "-mfma", "-ffp-contract=off", "-fopenmp"], extra_ldflags=["-fopenmp"])
        return all(hasattr(torch.ops.eagle_lite, op) for op in OPS)
    except Exception as err:  # a missing compiler or headers: the torch paths still work
        log.warning("eagle_lite's native CPU kernels are unavailable (%s: %s); using torch's ops instead",
                    type(err).__name__, str(err).splitlines()[0] if str(err) else "")
        return False
