"""Draft heads in the layouts other projects publish and serve: read (`--draft DIR` / `--medusa DIR` take them,
through `load_head` and `load_medusa`, load.py) and written (`python -m eagle_lite.export`).

detect.py tells the layout from a folder's files; eagle.py, eagle3.py and medusa.py read and write one layout
each; files.py reads published tensor files (pickles only through torch's weights_only unpickler).
"""
from __future__ import annotations

from pathlib import Path

from .detect import KINDS, detect, is_eagle_lite
from .load import load_head, load_medusa

__all__ = ["KINDS", "detect", "is_eagle_lite", "load_head", "load_medusa", "read_head", "read_medusa_heads"]


def read_head(path: str | Path, target):
    """A DraftHead from a published EAGLE-1/2 or EAGLE-3 folder (official EAGLE, SpecForge, vLLM, SGLang)."""
    from .eagle import read_eagle
    from .eagle3 import read_eagle3

    layout = detect(path)
    if layout.kind == "medusa":
        raise ValueError(f"{path} holds {KINDS['medusa']}, not an EAGLE draft head: pass it with --medusa "
                         f"(method medusa)")
    return read_eagle(layout, target) if layout.kind == "eagle" else read_eagle3(layout, target)


def read_medusa_heads(path: str | Path, target):
    """MedusaHeads from a published Medusa folder (FasterDecoding v1 / version 2, or vLLM's layout)."""
    from .medusa import read_medusa

    return read_medusa(detect(path), target)


def check_folder(path: str | Path, method: str) -> None:
    """Refuse a head folder that is missing or of another kind than method `method` ("eagle" or "medusa") runs
    (eagle_lite's own, or a published layout)."""
    from ..heads.checkpoint import MEDUSA_FORMAT, read_config, read_head_config

    if is_eagle_lite(Path(path)):
        read_head_config(path) if method == "eagle" else read_config(path, MEDUSA_FORMAT, "Medusa heads")
        return
    kind = detect(path).kind
    if (kind == "medusa") != (method == "medusa"):
        raise ValueError(f"{path} holds {KINDS[kind]}, which method '{method}' cannot use")
