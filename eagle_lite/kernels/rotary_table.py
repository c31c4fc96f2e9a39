"""A rotary embedding's cos/sin read from a table of positions instead of recomputed every forward.

A few-token forward on a CPU pays ~10 torch ops for its rotary cos/sin (transformers' rotary module: the
product of positions and inverse frequencies, a cat, cos, sin, two scalings, two casts). Every entry is a
function of its own position alone (one fp32 product, then cos or sin, then the scaling), so rows computed once
for positions 0..L-1 and gathered later are the module's own output for those positions. `RotaryTable` keeps
them, grown on demand by the module itself, and gathers each forward's rows in two ops.

Rotary types whose frequencies depend on the sequence length (dynamic NTK, LongRoPE) change the module's output
as the context grows; for them the table is not used and the module runs every time. A module with a rotary per
layer type (Gemma 3: sliding and full attention) has one table per type (`layer_type`).
"""
from __future__ import annotations

import torch
from torch import nn

STATIC_ROPE = ("default", "linear", "llama3", "yarn")   # frequencies fixed when the module is built
MIN_ROWS = 1024


class RotaryTable:
    """cos/sin [T, D] of `rotary` (transformers' rotary embedding module) for positions [T], from a table where
    the rotary type allows it (STATIC_ROPE), else from the module."""

    def __init__(self, rotary: nn.Module, layer_type: str | None = None) -> None:
        self.rotary = rotary
        self.kwargs = {} if layer_type is None else {"layer_type": layer_type}
        kind = getattr(rotary, "rope_type", "default")
        self.static = (kind[layer_type] if isinstance(kind, dict) else kind) in STATIC_ROPE
        self._cos: torch.Tensor | None = None
        self._sin: torch.Tensor | None = None

    def __call__(self, x: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x: any tensor of the forward's dtype and device; positions: [T]. Returns (cos, sin), [T, D] each,
        contiguous."""
        if not self.static or torch.is_grad_enabled():
            cos, sin = self.rotary(x[None], positions[None], **self.kwargs)
            return cos[0].contiguous(), sin[0].contiguous()
        table = self._cos
        need = int(positions.max()) + 1
        if table is None or table.shape[0] < need or table.dtype != x.dtype or table.device != x.device:
            self._build(x, max(need, 2 * (0 if table is None else table.shape[0]), MIN_ROWS))
        return self._cos[positions], self._sin[positions]

    def _build(self, x: torch.Tensor, rows: int) -> None:
        with torch.inference_mode():
            cos, sin = self.rotary(x.new_zeros(1, 1), torch.arange(rows, device=x.device)[None], **self.kwargs)
        self._cos, self._sin = cos[0].contiguous(), sin[0].contiguous()
