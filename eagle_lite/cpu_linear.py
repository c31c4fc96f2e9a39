"""Linear layers for a few rows on CPU: oneDNN's prepacked weights for 2+ rows, the dense gemv for one.

Verifying a tree runs the target's linears on 4-24 rows. torch's default product for that shape (MKL's
small-M GEMM) is far from the memory-bound ideal: on the 2-core box a 30-layer SmolLM2 forward of 6
tokens took 89 ms at one thread against 46 ms for one token. oneDNN with the weight reordered once into
its blocked layout (`torch.ops.mkldnn._reorder_linear_weight`, the op torch.compile's CPU freezing
emits) took 74 ms for the same 6 tokens, and 13-18% less from 2 to 12 tokens; for one row it is ~10%
slower than the dense gemv, so one-row calls (plain decoding) keep the dense weight, and so do calls of
more than 32 rows (a prompt's prefill), where MKL's GEMM is 5-10% ahead.

`pack_linears(module)` gives every fp32 `nn.Linear` under `module` the packed copy beside its dense weight,
and `unpacked(module)` runs a block of code on the library's own forward (a baseline that must run stock
transformers). The packed copy costs the linears' memory once more. Both products are fp32 sums
of the same terms in a different order, as any two GEMM kernels are.
"""
from __future__ import annotations

import contextlib
import functools
from typing import Iterator

import torch
import torch.nn.functional as F
from torch import nn

MAX_PACKED_ROWS = 32  # above this (a prompt's prefill) MKL's own GEMM is as fast or faster


@functools.cache
def packing_available() -> bool:
    """Whether oneDNN's packed linear runs here and agrees with F.linear (probed once on a small matrix)."""
    if not torch.backends.mkldnn.is_available():
        return False
    try:
        w = torch.linspace(-1.0, 1.0, 24 * 16).view(24, 16).sin()   # no RNG: probing must not move seeds
        x = torch.linspace(-2.0, 2.0, 3 * 16).view(3, 16).cos()
        packed = torch.ops.mkldnn._reorder_linear_weight(w, None)
        y = torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")
        return torch.allclose(y, F.linear(x, w), rtol=1e-4, atol=1e-5)
    except (RuntimeError, AttributeError, NotImplementedError):
        return False


def few_rows_product(rows: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """rows @ weight.T for a tall weight (an lm_head, [V, H]) and 2-8 rows on CPU, as weight @ rows.T: MKL
    streams the tall matrix once (measured ~2x faster than `rows @ weight.T` for 2-8 rows of SmolLM2's
    lm_head and of an 8k-row draft vocabulary). Other shapes and devices take the plain product."""
    if weight.device.type == "cpu" and 2 <= rows.shape[0] <= 8:
        return torch.mm(weight, rows.t()).t()
    return rows @ weight.t()


def _packed_forward(layer: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    rows = x.numel() // layer.in_features
    if rows == 1 or rows > MAX_PACKED_ROWS or torch.is_grad_enabled():  # the packed copy is for inference
        return F.linear(x, layer.weight, layer.bias)
    return torch.ops.mkldnn._linear_pointwise(x, layer.packed_weight, layer.bias, "none", [], "")


def _packable(layer: nn.Module) -> bool:
    return (type(layer) is nn.Linear and layer.weight.device.type == "cpu"
            and layer.weight.dtype == torch.float32 and not hasattr(layer, "packed_weight"))


def pack_linears(module: nn.Module) -> int:
    """Give the fp32 CPU `nn.Linear`s under `module` a packed weight and the forward that uses it;
    returns how many (0 where oneDNN's packed linear is unavailable).

    Like accelerate's hooks, this sets an instance `forward`; the packed weight is a non-persistent
    buffer, so the module's type, its state_dict and every other caller are unchanged.
    """
    if not packing_available():
        return 0
    packed = 0
    for layer in module.modules():
        if _packable(layer):
            with torch.inference_mode(False), torch.no_grad():
                weight = torch.ops.mkldnn._reorder_linear_weight(layer.weight.detach(), None)
            layer.register_buffer("packed_weight", weight, persistent=False)
            layer.forward = functools.partial(_packed_forward, layer)
            packed += 1
    return packed


@contextlib.contextmanager
def unpacked(module: nn.Module) -> Iterator[None]:
    """Run a block with the library's own `nn.Linear.forward` on the packed layers, then pack them again."""
    layers = [m for m in module.modules() if isinstance(m, nn.Linear) and "forward" in m.__dict__]
    saved = [m.__dict__.pop("forward") for m in layers]
    try:
        yield
    finally:
        for layer, forward in zip(layers, saved):
            layer.forward = forward
