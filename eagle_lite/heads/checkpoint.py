"""Save and load draft heads: `model.safetensors` + `config.json` recording the target they were built for.

Only safetensors are ever read (never pickles), and every way a head can be wrong — missing files, a
truncated or corrupt weights file, a head built for another target, a folder of another kind of head —
is a clear error naming the path. The folder helpers (`write_folder`, `read_config`, `read_tensors`,
`check_target`) serve every kind of head; `format` in config.json says which kind a folder holds.
"""
from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from ..atomic import write_atomic, write_json_atomic
from ..config import TreeConfig
from .draft import DraftHead

FORMAT = "eagle_lite.draft_head"
MEDUSA_FORMAT = "eagle_lite.medusa_heads"  # eagle_lite/heads/medusa.py
VERSION = 1
KINDS = {FORMAT: "an EAGLE draft head (method eagle, --draft PATH)",
         MEDUSA_FORMAT: "Medusa heads (method medusa, --medusa PATH)"}
HEADS_DIR = Path(__file__).parent  # heads shipped with the package, one folder per target alias


class HeadMismatchError(ValueError):
    """The draft head was built for a different target."""


def default_head_path(target_name: str) -> Path | None:
    """The head shipped for a target alias or hub id ('smollm2', 'org/model' -> heads/org--model)."""
    path = HEADS_DIR / re.sub(r"[^A-Za-z0-9._-]+", "--", target_name).strip("-.")
    return path if (path / "config.json").exists() else None


def write_folder(path: str | Path, tensors: dict[str, torch.Tensor], config: dict) -> Path:
    """Write model.safetensors and config.json into folder `path`, each atomically (temp file + rename)."""
    path = Path(path)
    write_atomic(path / "model.safetensors", lambda tmp: save_file(tensors, tmp, metadata={"format": "pt"}))
    write_json_atomic(path / "config.json", config)
    return path


def state_tensors(module: torch.nn.Module, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """The module's state dict on the CPU, floating tensors cast to `dtype` (integer buffers kept)."""
    return {k: (v.to(dtype) if v.is_floating_point() else v).detach().cpu().contiguous()
            for k, v in module.state_dict().items()}


def save_head(head: DraftHead, path: str | Path, target, extra: dict | None = None,
              dtype: torch.dtype = torch.bfloat16) -> Path:
    """Write the head's own weights (not the target's embeddings or lm_head) atomically to folder `path`."""
    config = {
        "format": FORMAT, "version": VERSION,
        "target": target.fingerprint(),
        **({"target_spec": target.spec} if getattr(target, "spec", None) else {}),
        "layer_class": type(head.layer).__name__,
        "draft_vocab_size": head.draft_vocab_size,
        **({"feature_layers": list(head.feature_layers)} if head.feature_layers else {}),
        # the options of published layouts, recorded only where they differ from eagle_lite's own head
        **({"design": head.design} if head.design != "eagle" else {}),
        **({"fc_bias": False} if head.design == "eagle" and not head.fc_bias else {}),
        **({"input_norm": False} if head.design == "eagle" and not head.input_norm else {}),
        **({"fc_norm": True} if head.fc_norm is not None else {}),
        **({"norm_output": True} if head.norm_output else {}),
        **({"parallel": head.parallel} if head.parallel else {}),
        "dtype": str(dtype).removeprefix("torch."),
        **(extra or {}),
    }
    return write_folder(path, state_tensors(head, dtype), config)


def read_config(path: str | Path, expected: str = FORMAT, what: str = "draft head") -> dict:
    """config.json of a head folder, refusing a missing or corrupt file or a folder of another `format`."""
    path = Path(path)
    cfg_file = path / "config.json"
    if not cfg_file.is_file():
        raise FileNotFoundError(f"no {what} at {path}: expected {cfg_file} and model.safetensors")
    try:
        config = json.loads(cfg_file.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise ValueError(f"{what} config {cfg_file} is corrupt: {err}") from err
    found = config.get("format") if isinstance(config, dict) else None
    if found != expected:
        holds = KINDS.get(found, f"no eagle_lite head (format={found!r})")
        raise ValueError(f"{cfg_file} holds {holds}, not {KINDS[expected]}: point to a folder of the right kind")
    return config


def read_head_config(path: str | Path) -> dict:
    return read_config(path, FORMAT, "draft head")


def read_tensors(path: str | Path, what: str = "draft head") -> dict[str, torch.Tensor]:
    """model.safetensors of a head folder (never a pickle), refusing a missing, truncated or corrupt file."""
    path = Path(path)
    weights = path / "model.safetensors"
    if not weights.is_file():
        raise FileNotFoundError(f"{what} {path} has a config but no weights file {weights}")
    try:
        return load_file(weights)
    except (SafetensorError, OSError, ValueError) as err:
        raise ValueError(f"{what} weights {weights} are corrupt or truncated: {err}") from err


def load_weights(module: torch.nn.Module, tensors: dict[str, torch.Tensor], where: str) -> None:
    """Load `tensors` into `module` with every name and shape accounted for. A mismatch is one ValueError line that
    names the first tensor and both shapes (and counts the rest), instead of torch's list of every one."""
    own = module.state_dict()
    problems = [f"tensor {k} is {list(v.shape)} in the file, but the head needs {list(own[k].shape)}"
                for k, v in tensors.items() if k in own and v.shape != own[k].shape]
    problems += [f"tensor {k} is missing from the file" for k in own if k not in tensors]
    problems += [f"tensor {k} in the file is not part of the head" for k in tensors if k not in own]
    if problems:
        more = f" (and {len(problems) - 1} more mismatches)" if len(problems) > 1 else ""
        raise ValueError(f"{where} do not fit: {problems[0]}{more}; is it a head for this target and format?")
    module.load_state_dict({k: v.to(own[k].dtype) for k, v in tensors.items()}, strict=True)


def recorded_target(path: str | Path) -> str | None:
    """The target a head folder says it was trained for: the spec eagle_lite records (an alias, an absolute folder or
    file, a hub id), else the name in its fingerprint; in a published layout, its eagle_lite record's. None: the folder
    says nothing (or is no head folder)."""
    try:
        config = json.loads((Path(path) / "config.json").read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(config, dict):
        return None
    record = config if "format" in config else (config.get("eagle_lite") or {})
    spec = record.get("target_spec") or (record.get("target") or {}).get("name")
    return str(spec) if spec else None


def check_target(config: dict, target, path: Path | str = "", what: str = "draft head") -> None:
    """Refuse a head whose recorded target differs from `target` in architecture or weights."""
    built, given = config.get("target", {}), target.fingerprint()
    keys = ("model_type", "hidden_size", "vocab_size", "embedding_sha")
    if any(built.get(k) != given[k] for k in keys):
        def describe(fp: dict) -> str:
            return (f"'{fp.get('name')}' ({fp.get('model_type')}, hidden {fp.get('hidden_size')}, "
                    f"vocab {fp.get('vocab_size')}, embeddings {fp.get('embedding_sha')})")
        spec = config.get("target_spec") or built.get("name")
        raise HeadMismatchError(
            f"{what} {path} was trained for target {describe(built)}, got {describe(given)}; "
            f"pass the target it was trained for (--target {spec}), or train a head for this one "
            f"(python -m trainers.train target=MODEL)"
        )


def load_native_head(path: str | Path, target) -> DraftHead:
    """Load a head folder in eagle_lite's own layout for `target`, refusing heads built for another target or with
    damaged files (`formats.load_head` reads every layout and calls this one for eagle_lite's)."""
    path = Path(path)
    config = read_head_config(path)
    check_target(config, target, path)
    tensors = read_tensors(path)
    weights = path / "model.safetensors"
    layers = config.get("feature_layers") or []
    if not (isinstance(layers, list) and all(isinstance(i, int) for i in layers)):
        raise ValueError(f"draft head config {path / 'config.json'} has feature_layers={layers!r}: expected a list of "
                         f"decoder layer numbers")
    try:
        target.check_taps(tuple(layers), f"draft head {path}")
    except ValueError as err:
        raise HeadMismatchError(str(err)) from err
    head = DraftHead.for_target(target, d2t=tensors.get("d2t"), layer_class=config.get("layer_class"),
                                feature_layers=tuple(layers), fc_bias=config.get("fc_bias", True),
                                input_norm=config.get("input_norm", True), design=config.get("design", "eagle"),
                                fc_norm=bool(config.get("fc_norm", False)),
                                norm_output=bool(config.get("norm_output", False)),
                                parallel=int(config.get("parallel", 0) or 0))
    load_weights(head, tensors, f"draft head weights {weights}")
    head.tree = recommended_tree(config, path, torch.device(target.device).type)
    return head.to(device=target.device, dtype=target.dtype).eval()


def _tree_key(device: str) -> str:
    """config.json's key for the tree recommended on `device` ('cpu', 'cuda', ...): "tree" for the CPU (where
    the shipped trees are tuned), "tree_<device>" elsewhere: verifying a node costs a CPU a noticeable share of a
    step but a GPU next to nothing, so the fastest trees differ by an order of magnitude in size."""
    return "tree" if device == "cpu" else f"tree_{device}"


def recommend_tree(path: str | Path, tree: TreeConfig, command: str = "", device: str = "cpu") -> Path:
    """Record `tree` as the head's recommended tree on `device` in its config.json (atomically), with the command
    that measured it (`<key>_command`; the figures themselves belong in docs/benchmarks.md)."""
    path = Path(path)
    config = read_head_config(path)
    key = _tree_key(device)
    config[key] = dataclasses.asdict(tree)
    config.pop(f"{key}_measured", None)
    if command:
        config[f"{key}_command"] = command
    write_json_atomic(path / "config.json", config)
    return path


def recommended_tree(config: dict, path: Path | str = "", device: str = "cpu") -> TreeConfig | None:
    """The draft tree config.json recommends on `device` (`"tree"` on the CPU, `"tree_cuda"` on CUDA: `{"depth",
    "top_k", "total_tokens", "lookup", "min_prob"}`, the fastest one `eval.tune` found for this head there); None
    where it names none for the device (a CPU's tree says nothing about a GPU's: `config.default_tree` runs)."""
    key = _tree_key(device)
    tree = config.get(key)
    if tree is None:
        return None
    try:
        return TreeConfig(**tree)
    except (TypeError, ValueError) as err:
        raise ValueError(f"draft head config {Path(path) / 'config.json'} has an invalid \"{key}\" "
                         f"{tree!r}: {err}") from err
