"""Which published layout a head folder holds, told from its files; anything else is refused.

| kind     | config.json says                                        | weights hold                           |
|----------|---------------------------------------------------------|----------------------------------------|
| eagle    | a Llama config (no draft_vocab_size, no Medusa keys)    | fc.weight [H, 2H], layers.{i}.*        |
| eagle3   | draft_vocab_size, or an architecture naming Eagle3      | fc.weight [H, 3H], midlayer.*, lm_head |
| eagle3   | speculators_model_type "eagle3" (speculators, vLLM)     | the same with layers.0.* for midlayer.* |
| medusa   | medusa_num_heads (FasterDecoding) or model_type medusa  | {k}.{l}.linear.* / blocks.{k}.layers.* |

eagle_lite's own folders (config.json with a "format") are read by eagle_lite/heads/checkpoint.py.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import torch

from .files import WEIGHT_FILES, read_weights, strip_prefix, weights_file

MEDUSA_FILES = ("medusa_lm_head.safetensors", "medusa_lm_head.pt", *WEIGHT_FILES)
KINDS = {
    "eagle": "an EAGLE-1/2 head (config.json + fc, layers.0.*: official EAGLE, vLLM, SGLang)",
    "eagle3": "an EAGLE-3 head (config.json with draft_vocab_size + fc, midlayer.*, norm, lm_head, d2t: official "
              "EAGLE-3 or SpecForge; or the speculators layout with layers.0.*)",
    "medusa": "Medusa heads (config.json with medusa_num_heads + medusa_lm_head.*, FasterDecoding v1 or version 2; "
              "or vLLM's model_type medusa)",
}


@dataclass
class Layout:
    kind: str                       # a key of KINDS
    folder: Path
    config: dict
    weights: Path                   # the file the tensors come from
    tensors: dict[str, torch.Tensor] = field(repr=False, default_factory=dict)   # without a "model." prefix

    @property
    def where(self) -> str:
        return f"{self.kind} head {self.folder}"


def read_json(file: Path) -> dict:
    try:
        config = json.loads(file.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise ValueError(f"draft head config {file} is corrupt: {err}") from err
    if not isinstance(config, dict):
        raise ValueError(f"draft head config {file} holds a {type(config).__name__}, not a JSON object")
    return config


def is_eagle_lite(folder: Path) -> bool:
    """Whether `folder` is (or claims to be) one of eagle_lite's own head folders, or holds nothing readable:
    eagle_lite/heads/checkpoint.py then reads it, with its own messages."""
    file = Path(folder) / "config.json"
    if not file.is_file():
        return True
    try:
        config = json.loads(file.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError):
        return True
    return not isinstance(config, dict) or "format" in config


def kind_from_config(config: dict) -> str | None:
    architectures = config.get("architectures") or []
    if "medusa_num_heads" in config or config.get("model_type") == "medusa":
        return "medusa"
    if "draft_vocab_size" in config or any("Eagle3" in str(a) for a in architectures):
        return "eagle3"
    if "hidden_size" in config and "num_attention_heads" in config:
        return "eagle"
    return None


def kind_from_keys(keys: set[str]) -> str | None:
    if any(k.startswith("midlayer.") for k in keys):
        return "eagle3"
    if "fc.weight" in keys and any(k.startswith("layers.") for k in keys):
        return "eagle"
    if any(k.startswith("blocks.") for k in keys) or any(k.split(".")[0].isdigit() for k in keys):
        return "medusa"
    return None


def from_speculators(config: dict, tensors: dict[str, torch.Tensor]) -> tuple[dict, dict[str, torch.Tensor]]:
    """A speculators-layout EAGLE-3 folder (config `speculators_model_type: "eagle3"`, the layer's Llama fields under
    `transformer_layer_config`, weights `layers.0.*`) as the default layout reads: the layer's fields at the top beside
    the speculators keys, `midlayer.*`. The config keeps `speculators_model_type`, which says how its taps and
    `norm_output` are meant (formats/eagle3.py)."""
    flat = {**(config.get("transformer_layer_config") or {}),
            **{k: v for k, v in config.items() if k != "transformer_layer_config"}}
    renamed = {("midlayer." + k.removeprefix("layers.0.") if k.startswith("layers.0.") else k): v
               for k, v in tensors.items()}
    return flat, renamed


def detect(folder: str | Path) -> Layout:
    """The layout of a published head folder, its config and tensors; a ValueError naming what was found and
    what was expected when it is none of KINDS or its config and weights disagree."""
    folder = Path(folder)
    config = read_json(folder / "config.json")
    by_config = kind_from_config(config)
    file = weights_file(folder, MEDUSA_FILES if by_config == "medusa" else WEIGHT_FILES)
    if file is None:
        names = MEDUSA_FILES if by_config == "medusa" else WEIGHT_FILES
        raise FileNotFoundError(f"{folder} has a config.json but no weights: expected one of {', '.join(names)}")
    tensors = strip_prefix(read_weights(file))
    if config.get("speculators_model_type") is not None:
        if config["speculators_model_type"] != "eagle3":
            raise ValueError(f"{folder} is a speculators {config['speculators_model_type']!r} head: eagle_lite reads "
                             f"the speculators layout of EAGLE-3 heads only")
        config, tensors = from_speculators(config, tensors)
    by_keys = kind_from_keys(set(tensors))
    expected = "; ".join(f"{k}: {v}" for k, v in KINDS.items())
    if by_config is None and by_keys is None:
        shown = ", ".join(sorted(tensors)[:6]) + (", ..." if len(tensors) > 6 else "")
        raise ValueError(f"{folder} holds no draft head layout eagle_lite knows: config keys "
                         f"{sorted(config)[:8]}, weights {shown}. Expected {expected}")
    if by_config is not None and by_keys is not None and by_config != by_keys:
        raise ValueError(f"{folder} is inconsistent: its config.json describes {KINDS[by_config]}, but "
                         f"{file.name} holds the keys of {KINDS[by_keys]}")
    kind = by_keys or by_config
    return Layout(kind, folder, config, file, tensors)
