"""Reading the tensor files of published head folders, and writing the ones eagle_lite exports.

Published heads come as `model.safetensors`, a sharded `model.safetensors.index.json`, or a torch pickle
(`pytorch_model.bin`, Medusa's `medusa_lm_head.pt`, SGLang's hot-token map). A pickle is only ever read with
`torch.load(weights_only=True)`, whose unpickler builds nothing but tensors and plain containers, and is then
refused unless it is what the format says: a flat dict of name -> tensor, or one tensor.
"""
from __future__ import annotations

import json
import pickle
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file

from ..atomic import write_atomic

WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin")


def read_pickle(file: Path):
    """torch.load(weights_only=True) of `file`, refusing anything its restricted unpickler refuses."""
    try:
        return torch.load(file, map_location="cpu", weights_only=True)
    except (pickle.UnpicklingError, RuntimeError, EOFError, ValueError, AttributeError, TypeError) as err:
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise ValueError(f"{file} is not a file of tensors (read with torch.load(weights_only=True), which builds "
                         f"nothing else): {first}") from None


def read_tensor_pickle(file: Path) -> dict[str, torch.Tensor]:
    """A pickled state dict: a flat dict of str -> tensor, or a ValueError naming what the file holds instead."""
    obj = read_pickle(file)
    if not isinstance(obj, dict):
        raise ValueError(f"{file} holds a {type(obj).__name__}: expected a flat dict of name -> tensor")
    bad = {k: type(v).__name__ for k, v in obj.items() if not (isinstance(k, str) and isinstance(v, torch.Tensor))}
    if bad:
        shown = ", ".join(f"{k!r}: {t}" for k, t in list(bad.items())[:5])
        raise ValueError(f"{file} holds non-tensor entries ({shown}): expected a flat dict of name -> tensor")
    return obj


def read_safetensors(file: Path) -> dict[str, torch.Tensor]:
    try:
        return load_file(file)
    except (SafetensorError, OSError, ValueError) as err:
        raise ValueError(f"{file} is corrupt or truncated: {err}") from err


def read_sharded(index: Path) -> dict[str, torch.Tensor]:
    """The shards a `model.safetensors.index.json` names, merged."""
    try:
        weight_map = json.loads(index.read_text())["weight_map"]
    except (json.JSONDecodeError, KeyError, TypeError) as err:
        raise ValueError(f"{index} is not a safetensors index (expected a \"weight_map\"): {err}") from err
    tensors: dict[str, torch.Tensor] = {}
    for shard in sorted(set(weight_map.values())):
        if Path(shard).name != shard:
            raise ValueError(f"{index} names shard {shard!r} outside its folder")
        tensors.update(read_safetensors(index.parent / shard))
    return tensors


def weights_file(folder: Path, names: tuple[str, ...] = WEIGHT_FILES) -> Path | None:
    """The first of `names` present in `folder` (safetensors before pickles)."""
    for name in names:
        if (folder / name).is_file():
            return folder / name
    return None


def read_weights(file: Path) -> dict[str, torch.Tensor]:
    """The tensors of one weights file, by its kind."""
    if file.name.endswith(".index.json"):
        return read_sharded(file)
    if file.suffix == ".safetensors":
        return read_safetensors(file)
    return read_tensor_pickle(file)


def strip_prefix(tensors: dict[str, torch.Tensor], prefix: str = "model.") -> dict[str, torch.Tensor]:
    """Keys without a leading `prefix` (checkpoints saved from a wrapper carry it; servers accept both)."""
    return {k[len(prefix):] if k.startswith(prefix) else k: v for k, v in tensors.items()}


def save_tensor_pickle(obj, file: Path) -> Path:
    """torch.save of tensors only (a tensor, or a flat dict of them), for the loaders that read nothing but a
    pickle; checked by reading it back the way eagle_lite reads pickles."""
    write_atomic(file, lambda tmp: torch.save(obj, tmp))
    read_pickle(file)
    return file
