"""Proposers behind one contract (decoding/drafter.py), built by name through one registry (registry.py); the engine
and verifier are the same for all of them."""
from ..decoding.drafter import Drafter, DraftInput, NoDrafter, VanillaOptions
from .draft_model import DraftModelDrafter, DraftModelOptions
from .eagle import EagleDrafter
from .eagle_options import AUTO, EagleOptions, load_eagle_head
from .layer_skip import LayerSkipDrafter, LayerSkipOptions
from .lookahead import LookaheadDrafter, LookaheadOptions
from .lookup_graft import LookupGraft
from .medusa import MedusaDrafter, MedusaOptions
from .prompt_lookup import LookupOptions, PromptLookupDrafter
from .registry import DEFAULT, METHODS, build, check, names, resolve

__all__ = ["DraftInput", "Drafter", "NoDrafter", "EagleDrafter", "PromptLookupDrafter", "LookupGraft",
           "DraftModelDrafter", "LayerSkipDrafter", "MedusaDrafter", "LookaheadDrafter", "AUTO", "DEFAULT",
           "METHODS", "names",
           "build", "check", "resolve", "load_eagle_head", "EagleOptions", "LookupOptions", "DraftModelOptions",
           "LayerSkipOptions", "MedusaOptions", "LookaheadOptions", "VanillaOptions"]
