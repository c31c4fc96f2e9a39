"""Load any head folder: eagle_lite's own layout, or a published one detected from its files."""
from __future__ import annotations

from pathlib import Path

from ..heads.checkpoint import load_native_head
from ..heads.draft import DraftHead
from ..heads.medusa import MedusaHeads, load_native_medusa
from .detect import is_eagle_lite


def load_head(path: str | Path, target) -> DraftHead:
    """An EAGLE draft head for `target` from a folder in eagle_lite's layout or a published one (official
    EAGLE-1/2 or EAGLE-3, SpecForge, vLLM, SGLang), refusing heads built for another target or damaged files."""
    from . import read_head

    return load_native_head(path, target) if is_eagle_lite(Path(path)) else read_head(path, target)


def load_medusa(path: str | Path, target) -> MedusaHeads:
    """Medusa heads for `target` from a folder in eagle_lite's layout or a published one (FasterDecoding v1 /
    version 2, vLLM), refusing heads built for another target or damaged files."""
    from . import read_medusa_heads

    return load_native_medusa(path, target) if is_eagle_lite(Path(path)) else read_medusa_heads(path, target)
