"""Proposers behind one protocol (decoding/drafter.py), built by name through one registry (registry.py); the engine and
verifier are the same for all of them."""
from ..decoding.drafter import Drafter, DraftInput, NoDrafter
from .draft_model import DraftModelDrafter
from .eagle import EagleDrafter
from .layer_skip import LayerSkipDrafter
from .lookahead import LookaheadDrafter
from .lookup_graft import LookupGraft
from .medusa import MedusaDrafter
from .prompt_lookup import PromptLookupDrafter
from .registry import (
                       AUTO,
                       DEFAULT,
                       METHODS,
                       NAMES,
                       DraftModelOptions,
                       EagleOptions,
                       LayerSkipOptions,
                       LookaheadOptions,
                       LookupOptions,
                       MedusaOptions,
                       VanillaOptions,
                       build,
                       check,
                       load_eagle_head,
                       resolve,
)

__all__ = ["DraftInput", "Drafter", "NoDrafter", "EagleDrafter", "PromptLookupDrafter", "LookupGraft",
           "DraftModelDrafter", "LayerSkipDrafter", "MedusaDrafter", "LookaheadDrafter", "AUTO", "DEFAULT",
           "METHODS", "NAMES",
           "build", "check", "resolve", "load_eagle_head", "EagleOptions", "LookupOptions", "DraftModelOptions",
           "LayerSkipOptions", "MedusaOptions", "LookaheadOptions", "VanillaOptions"]
