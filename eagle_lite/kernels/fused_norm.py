"""RMSNorm layers as one op instead of the six or seven small ops transformers runs.

A 30-layer SmolLM2 forward calls 61 RMSNorms. transformers' `LlamaRMSNorm.forward` (cast, pow, mean,
add, rsqrt, mul, cast, mul) costs more than `F.rms_norm` does on a few rows, with the same result to
the bit, and eagle_lite's native kernel (csrc/rms_norm.cpp: one pass per row, the same fp32 operations with
the sum of squares accumulated in another order, as any reduction kernel may) a fraction of either: through
`F.rms_norm` the 61 norms are a visible share of a one-token forward.
`fuse_rms_norms(module)` gives each RMSNorm under `module` an instance `forward` that calls the native
kernel where it builds, else `F.rms_norm`, but only after checking on a probe input that it gives the
module's own output (bit for bit for `F.rms_norm`; to float32 rounding, 1e-6, for the kernel). The weight the
op multiplies by (`fused_weight`) is the module's own, or `1 + weight` (Gemma's norms: the same fp32 add, made
once); a norm that computes something else (a different cast order) keeps its own forward.
`unfused(module)` runs a block on the library's forward (the stock baselines).
"""
from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn

from .instance_forward import class_forwards
from .native import kernel_available


def _eps(norm: nn.Module) -> float | None:
    for name in ("variance_epsilon", "eps"):
        value = getattr(norm, name, None)
        if isinstance(value, float):
            return value
    return None


def _fused_forward(norm: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return F.rms_norm(x, norm.weight.shape, norm.fused_weight, norm.fused_eps)


def _native_forward(norm: nn.Module, x: torch.Tensor) -> torch.Tensor:
    if torch.is_grad_enabled() or x.dtype != torch.float32:   # the kernel has no backward; fp32 rows only
        return _fused_forward(norm, x)
    return torch.ops.eagle_lite.rms_norm(x.contiguous(), norm.fused_weight, norm.fused_eps)


def _candidate(norm: nn.Module) -> bool:
    weight = getattr(norm, "weight", None)
    return (type(norm).__name__.endswith("RMSNorm") and "forward" not in norm.__dict__
            and isinstance(weight, torch.Tensor) and weight.dim() == 1 and weight.dtype == torch.float32
            and weight.device.type == "cpu" and _eps(norm) is not None)


def _agrees(norm: nn.Module, weight: torch.Tensor, native: bool = False) -> bool:
    """Whether the fused op gives the module's own output on a deterministic probe (no RNG): exactly for
    `F.rms_norm`, to float32 rounding for the native kernel (its sum of squares runs in another order)."""
    size = norm.weight.shape[0]
    x = torch.linspace(-3.0, 3.0, 3 * size).view(3, size).sin() * torch.linspace(0.1, 8.0, 3)[:, None]
    with torch.no_grad():
        try:
            own = type(norm).forward(norm, x)
            if not native:
                return torch.equal(own, F.rms_norm(x, (size,), weight, _eps(norm)))
            fused = torch.ops.eagle_lite.rms_norm(x, weight.detach().contiguous(), _eps(norm))
            return torch.allclose(fused, own, rtol=1e-6, atol=1e-6)
        except (RuntimeError, TypeError):
            return False


def _native_ok(norm: nn.Module, weight: torch.Tensor) -> bool:
    return norm.weight.shape[0] % 8 == 0 and kernel_available() and _agrees(norm, weight, native=True)


def fuse_rms_norms(module: nn.Module, native: bool = True) -> int:
    """Give the fp32 CPU RMSNorms under `module` a one-op forward where it computes the same norm (the
    native kernel if `native` and it builds, else `F.rms_norm`); returns how many."""
    fused = 0
    for norm in module.modules():
        if not _candidate(norm):
            continue
        for weight in (norm.weight, (norm.weight.detach() + 1.0).contiguous()):   # w * x, or (1 + w) * x
            if native and _native_ok(norm, weight):
                forward = _native_forward
            elif _agrees(norm, weight):
                forward = _fused_forward
            else:
                continue
            break
        else:
            continue
        norm.fused_eps, norm.fused_weight = _eps(norm), weight
        norm.forward = functools.partial(forward, norm)
        fused += 1
    return fused


def unfused(module: nn.Module):
    """A context: run a block with the library's own forward on the fused norms, then fuse them again."""
    return class_forwards(m for m in module.modules() if hasattr(m, "fused_eps"))
