"""Medusa heads (Cai et al. 2024): K small residual heads that guess several tokens ahead from one feature.

Alignment (what the drafter and the training objective both assume): the target read x_0..x_t and gave
its last hidden state f_t, from which its own lm_head predicts x_{t+1}. Head k (0-based) maps f_t to
a feature whose logits under the target's frozen lm_head predict x_{t+k+2}.

Each head is `num_layers` residual blocks h <- h + SiLU(W h + b), W starting at zero (an untrained head repeats
the target's guess), then the target's lm_head, or with `vocab_size` its own (`lm_heads`, Medusa-1 as published,
imported by eagle_lite/formats/medusa.py). Saved like EAGLE heads (heads/checkpoint.py), `format` =
"eagle_lite.medusa_heads".
"""
from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from .checkpoint import (
    MEDUSA_FORMAT,
    VERSION,
    check_target,
    load_weights,
    read_config,
    read_tensors,
    state_tensors,
    write_folder,
)

WHAT = "Medusa heads"


class ResBlock(nn.Module):
    """h + SiLU(W h + b): [..., H] -> [..., H]."""

    def __init__(self, hidden_size: int) -> None:
        super().__init__()
        self.linear = nn.Linear(hidden_size, hidden_size)
        nn.init.zeros_(self.linear.weight)  # identity-like at init (Medusa): starts from the target's own guess

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h + F.silu(self.linear(h))


class MedusaHeads(nn.Module):
    def __init__(self, hidden_size: int, num_heads: int = 4, num_layers: int = 1,
                 vocab_size: int | None = None) -> None:
        """vocab_size: give each head its own vocabulary projection [V, H] (Medusa-1); None: the target's lm_head."""
        super().__init__()
        for name, value in (("hidden_size", hidden_size), ("num_heads", num_heads), ("num_layers", num_layers)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"Medusa {name} must be an int >= 1, got {value!r}")
        self.hidden_size, self.num_heads, self.num_layers = hidden_size, num_heads, num_layers
        self.heads = nn.ModuleList(nn.Sequential(*(ResBlock(hidden_size) for _ in range(num_layers)))
                                   for _ in range(num_heads))
        self.lm_heads = None if vocab_size is None else nn.ModuleList(
            nn.Linear(hidden_size, vocab_size, bias=False) for _ in range(num_heads))

    @classmethod
    def for_target(cls, target, num_heads: int = 4, num_layers: int = 1) -> MedusaHeads:
        """Fresh heads shaped for `target`, in its dtype and device."""
        heads = cls(target.hidden_size, num_heads, num_layers)
        return heads.to(device=target.device, dtype=target.dtype)

    def forward(self, hidden: torch.Tensor, num: int | None = None) -> torch.Tensor:
        """hidden: [..., H] target features f_t -> [K, ..., H], K = num (default all heads).

        Row k is head k's feature: the target's lm_head on it scores x_{t+k+2}.
        """
        hidden = hidden.to(self.heads[0][0].linear.weight.dtype)
        return torch.stack([head(hidden) for head in self.heads[:num]])  # K ... H

    def logits(self, features: torch.Tensor, lm_head: nn.Module) -> torch.Tensor:
        """features: [K, ..., H] (`forward`) -> [K, ..., V]: each head's own projection, else the target's lm_head."""
        if self.lm_heads is None:
            return lm_head(features)
        return torch.stack([proj(f.to(proj.weight.dtype)) for proj, f in zip(self.lm_heads, features)])


def save_medusa(heads: MedusaHeads, path: str | Path, target, extra: dict | None = None,
                dtype: torch.dtype = torch.bfloat16) -> Path:
    """Write the heads' own weights (not the target's lm_head) atomically to folder `path`."""
    config = {
        "format": MEDUSA_FORMAT, "version": VERSION,
        "target": target.fingerprint(),
        "num_heads": heads.num_heads, "num_layers": heads.num_layers, "hidden_size": heads.hidden_size,
        **({"own_lm_heads": True} if heads.lm_heads is not None else {}),
        "dtype": str(dtype).removeprefix("torch."),
        **(extra or {}),
    }
    return write_folder(path, state_tensors(heads, dtype), config)


def load_native_medusa(path: str | Path, target) -> MedusaHeads:
    """Load Medusa heads for `target`, refusing heads built for another target or with damaged files. A folder in a
    published layout is read by `formats.load_medusa`, which calls this one for eagle_lite's own."""
    path = Path(path)
    config = read_config(path, MEDUSA_FORMAT, WHAT)
    check_target(config, target, path, WHAT)
    sizes = {k: config.get(k) for k in ("num_heads", "num_layers")}
    if any(isinstance(v, bool) or not isinstance(v, int) or v < 1 for v in sizes.values()):
        raise ValueError(f"{WHAT} config {path / 'config.json'} is corrupt: num_heads and num_layers must be "
                         f"ints >= 1, got {sizes}; re-export the heads")
    tensors = read_tensors(path, WHAT)
    heads = MedusaHeads(target.hidden_size, sizes["num_heads"], sizes["num_layers"],
                        target.vocab_size if config.get("own_lm_heads") else None)
    load_weights(heads, tensors, f"{WHAT} weights {path / 'model.safetensors'} ({sizes})")
    return heads.to(device=target.device, dtype=target.dtype).eval()
