"""Proposers behind one protocol; the engine and verifier are the same for all of them."""
from .base import DraftInput, Drafter, NoDrafter
from .eagle import EagleDrafter
from .prompt_lookup import PromptLookupDrafter

__all__ = ["DraftInput", "Drafter", "NoDrafter", "EagleDrafter", "PromptLookupDrafter"]
