"""Proposers behind one protocol; the engine and verifier are the same for all of them."""
from .base import DraftInput, Drafter, NoDrafter
from .draft_model import DraftModelDrafter
from .eagle import EagleDrafter
from .layer_skip import LayerSkipDrafter
from .medusa import MedusaDrafter
from .prompt_lookup import PromptLookupDrafter

__all__ = ["DraftInput", "Drafter", "NoDrafter", "EagleDrafter", "PromptLookupDrafter",
           "DraftModelDrafter", "LayerSkipDrafter", "MedusaDrafter"]
