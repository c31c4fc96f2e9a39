"""The one entry point to eagle_lite's optional speed-ups: apply them to a loaded model, or run without them.

`accelerate_target` gives a target's decoder faster few-row linears (grid codes where the weights lie on a GGUF
grid, else oneDNN-packed copies), one-op RMSNorms, whole decoder layers as one native op and the stack of them
(`FusedStack`), and returns what the caller runs through: the stack (None where it does not apply) and the
lm_head's grid codes. `accelerate_head` does the same for a draft head. Every piece is probed against the
model's own forward when applied and kept only where it computes the same thing (to fp32 rounding), and is a
no-op off CPU or for non-fp32 weights. `stock(model)` runs a block on the model exactly as transformers built it.

The pieces the runtime calls between those (the few-row lm_head product and its row limits, the running fused
layer's parts, the certified argmax, the rotary table) are named here too, so nothing outside this package imports
its other modules: a kernel's module can be split or renamed behind this one.

Turning it off: `Target(..., accelerate=False)`, or EAGLE_LITE_ACCELERATE=0 for a whole process; EAGLE_LITE_NATIVE=0
keeps the torch-level pieces and drops only the native C++ ops. docs/cpu.md says why the results stay exact.
"""
from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from dataclasses import dataclass

from torch import nn

from .certified_argmax import CertifiedArgmax
from .cpu_linear import FEW_ROWS, few_rows_product, pack_linears, unpacked
from .fused_layer import MAX_FUSED_ROWS, FusedStack, fuse_decoder_layers, fuse_stack, running_fused, unfused_layers
from .fused_norm import fuse_rms_norms, unfused
from .grid_linear import MAX_GRID_ROWS, Grid8, GridWeight, grid_of
from .kquant import attach_file_grids, gguf_header  # a K-quant GGUF file's codes beside its weights; its header
from .native import kernel_available, needs_build
from .rotary_table import RotaryTable

__all__ = ["FEW_ROWS", "MAX_FUSED_ROWS", "MAX_GRID_ROWS", "Accelerated", "CertifiedArgmax", "GridWeight",
           "RotaryTable", "accelerate_head", "accelerate_target", "attach_file_grids", "draft_vocab_grid",
           "enabled", "few_rows_product", "gguf_header",
           "needs_build", "running_fused", "stock"]


def enabled() -> bool:
    """Whether this process applies the speed-ups at all (EAGLE_LITE_ACCELERATE=0 turns them off)."""
    return os.environ.get("EAGLE_LITE_ACCELERATE", "1") != "0"


@dataclass
class Accelerated:
    """What a target runs through once accelerated: the fused stack for few-token forwards (None where its layers
    do not all fuse) and the lm_head's grid codes (None where its weight lies on no grid)."""

    stack: FusedStack | None = None
    lm_grid: GridWeight | None = None
    applied: bool = False


def accelerate_target(decoder: nn.Module, lm_head: nn.Module) -> Accelerated:
    """Apply the speed-ups to a target's decoder stack in place; see the module docstring."""
    if not enabled():
        return Accelerated(applied=True)
    pack_linears(decoder)                     # no-op off CPU and for non-fp32 weights
    fuse_rms_norms(decoder)                   # no-op off CPU, for non-fp32 weights or inexact norms
    fuse_decoder_layers(getattr(decoder, "layers", []), getattr(decoder, "rotary_emb", None))
    plain_head = type(lm_head) is nn.Linear and lm_head.weight.device.type == "cpu"
    return Accelerated(fuse_stack(decoder), grid_of(lm_head.weight) if plain_head else None, applied=True)


def accelerate_head(head: nn.Module, layer: nn.Module | None, rotary: nn.Module | None,
                    round_to_grid: bool = True) -> None:
    """Apply the speed-ups to a draft head in place; `layer` (None: none) may run as one native op. round_to_grid:
    run its linears from Q8_0 codes rounded from its fp32 weights (a quarter of the bytes; proposals barely move,
    and acceptance keeps the output exact)."""
    if not enabled():
        return
    pack_linears(head, round_to_grid=round_to_grid)
    fuse_rms_norms(head)
    if layer is not None:
        fuse_decoder_layers([layer], rotary)  # one native op where its linears run from codes


def draft_vocab_grid(weight, round_to_grid: bool = False) -> GridWeight | None:
    """Grid codes of a draft head's own slice of the lm_head (None where it lies on no grid, or when off).
    round_to_grid: a weight on no grid is rounded onto a Q8_0 one (a draft head's own lm_head, as its linears)."""
    if not enabled():
        return None
    found = grid_of(weight)
    return Grid8.rounded(weight) if found is None and round_to_grid and kernel_available() else found


@contextlib.contextmanager
def stock(model: nn.Module) -> Iterator[None]:
    """Run a block on `model`'s own linears, norms and layers (the speed-ups set aside, then put back)."""
    with unpacked(model), unfused(model), unfused_layers(model):
        yield
