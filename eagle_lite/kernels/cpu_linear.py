"""Linear layers for a few rows on CPU: the 4-bit grid kernel where the weights lie on such a grid,
else oneDNN's prepacked weights for 2+ rows and the dense gemv for one.

Verifying a tree runs the target's linears on 4-24 rows, a shape torch's default product (MKL's small-M GEMM)
serves far from the memory-bound ideal. Weights de-quantized from a GGUF file run from their integer codes
(grid_linear.py: 5 bits a weight instead of 32). Other fp32 weights are reordered once into oneDNN's blocked
layout (`torch.ops.mkldnn._reorder_linear_weight`, the op torch.compile's CPU freezing emits). One row (plain
decoding) uses the packed product only when torch has more than one thread (MKL's gemv runs on one core; oneDNN
splits it). Calls of more than MAX_PACKED_ROWS rows (a prompt's prefill) keep the dense weight.

Sibling linears that read the same input (an attention's q/k/v projections, a gated MLP's gate/up) share one
packed matrix, their weights stacked: the first sibling called runs one product for all of them and the
others return their slice of it. A sibling hands out its slice only for the very tensor the product was run on
(the same object and, outside inference mode where torch counts in-place changes, unmodified since); any other
call computes its own product, so a model that calls its projections some other way stays correct.

`pack_linears(module)` gives every fp32 `nn.Linear` under `module` the grid or packed copy beside its dense
weight, and `unpacked(module)` runs a block of code on the library's own forward. The packed copy costs the
linears' memory once more. Both products are fp32 sums of the same terms in a different order, as any two GEMM
kernels are. docs/cpu.md has the design; `python -m eval.profile_step` measures it.
"""
from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn

from .grid_linear import MAX_GRID_ROWS, Grid8, GridWeight, grid_of
from .instance_forward import class_forwards
from .native import kernel_available

# A tall weight (an lm_head) times at most this many rows streams the weight once as weight @ rows.T on CPU
FEW_ROWS = 8
MAX_PACKED_ROWS = 32  # above this (a prompt's prefill) MKL's own GEMM is as fast or faster
# Children of one module that read the same input, by the names transformers' decoder layers give them
# (Llama, Mistral, Qwen2/3, Gemma ...): each group shares one packed product.
SIBLINGS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))


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


def few_rows_product(rows: torch.Tensor, weight: torch.Tensor, grid: GridWeight | None = None) -> torch.Tensor:
    """rows @ weight.T for a tall weight (an lm_head, [V, H]) and a few rows. From `grid` (the weight's grid
    codes, grid_linear.py) where given and it takes the rows; else, for 1-8 rows on CPU, as weight @ rows.T:
    MKL streams the tall matrix once (measured faster than `rows @ weight.T` for 2-8 rows of SmolLM2's lm_head
    and of an 8k-row draft vocabulary, and for one row of the latter). Other shapes and devices take the plain
    product."""
    if grid is not None and grid.takes(rows):
        return grid(rows)
    if weight.device.type == "cpu" and 1 <= rows.shape[0] <= FEW_ROWS:
        return torch.mm(weight, rows.t()).t()
    return rows @ weight.t()


class _PackedProduct:
    """oneDNN's product with the weight reordered once into its blocked layout."""
    max_rows = MAX_PACKED_ROWS

    def __init__(self, weight: torch.Tensor) -> None:
        with torch.inference_mode(False), torch.no_grad():
            self.weight = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), None)

    def usable(self, rows: int) -> bool:
        # MKL's gemv runs one row on one core; oneDNN splits it over the threads
        return rows > 1 or torch.get_num_threads() > 1

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.weight, bias, "none", [], "")


class _GridProduct:
    """The grid kernel (grid_linear.py) for weights it rebuilds exactly; any thread count."""
    max_rows = MAX_GRID_ROWS

    def __init__(self, grid: GridWeight) -> None:
        self.grid = grid

    def usable(self, rows: int) -> bool:
        return True

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        out = self.grid(x)
        return out if bias is None else out + bias


def _product_for(weight: torch.Tensor, grid: bool, round_to_grid: bool = False) -> _PackedProduct | _GridProduct | None:
    """The fastest few-row product for this fp32 weight: the grid kernel where the weight lies on a GGUF grid
    (and the kernel builds), else oneDNN's packed product (None where oneDNN is unavailable). round_to_grid:
    a weight off any grid is rounded onto a Q8_0 grid first (draft models only: not the same weight)."""
    found = grid_of(weight) if grid else None
    if found is None and round_to_grid and kernel_available():
        found = Grid8.rounded(weight)
    if found is not None:
        return _GridProduct(found)
    return _PackedProduct(weight) if packing_available() else None


def _sibling_product(layers: list[nn.Linear], grid: bool, round_to_grid: bool):
    """One product for sibling linears' weights stacked. Where one has codes read from its GGUF file (kquant.py), the
    siblings share a product only if each has codes of the same kind (stacked); otherwise None: each gets its own."""
    if grid and any(getattr(layer.weight, "gguf_grid", None) is not None for layer in layers):
        grids = [grid_of(layer.weight) for layer in layers]
        if any(g is None for g in grids) or len({type(g) for g in grids}) != 1:
            return None
        return _GridProduct(type(grids[0]).stacked(grids))
    return _product_for(torch.cat([layer.weight.detach() for layer in layers]), grid, round_to_grid)


def _use_product(product, x: torch.Tensor, in_features: int) -> bool:
    rows = x.numel() // in_features
    # the products are for inference; past max_rows (a prompt's prefill) MKL's own GEMM is as fast or faster
    return rows <= product.max_rows and product.usable(rows) and not torch.is_grad_enabled()


def _product_forward(layer: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    if not _use_product(layer.cpu_product, x, layer.in_features):
        return F.linear(x, layer.weight, layer.bias)
    return layer.cpu_product(x, layer.bias)


def _version(x: torch.Tensor) -> int:
    """x's in-place version counter; inference tensors keep none (-1: only the tensor's identity is checked)."""
    return -1 if x.is_inference() else x._version


class _SiblingProduct:
    """One product for sibling linears that read the same input; each sibling takes its slice once."""

    def __init__(self, layers: list[nn.Linear], product) -> None:
        self.sizes = [layer.out_features for layer in layers]
        self.product = product                   # over the siblings' weights stacked
        with torch.inference_mode(False), torch.no_grad():
            self.bias = None if layers[0].bias is None else torch.cat([layer.bias.detach() for layer in layers])
        self.input: torch.Tensor | None = None   # the tensor the pending slices were computed from
        self.version = -1                        # its in-place version counter then
        self.slices: list[torch.Tensor | None] = []

    def first(self, layer: nn.Linear, x: torch.Tensor) -> torch.Tensor:
        if not _use_product(self.product, x, layer.in_features):
            self.input, self.slices = None, []
            return F.linear(x, layer.weight, layer.bias)
        # contiguous slices: callers may .view() them like the output of their own nn.Linear
        out = [part.contiguous() for part in self.product(x, self.bias).split(self.sizes, dim=-1)]
        self.input, self.version, self.slices = x, _version(x), out
        return out[0]

    def later(self, index: int, layer: nn.Linear, x: torch.Tensor) -> torch.Tensor:
        if self.input is not x or _version(x) != self.version or self.slices[index] is None:
            return F.linear(x, layer.weight, layer.bias)
        out, self.slices[index] = self.slices[index], None
        if all(s is None for s in self.slices[1:]):
            self.input, self.slices = None, []   # every sibling has its slice: drop the input
        return out


def _packable(layer: nn.Module) -> bool:
    return (type(layer) is nn.Linear and layer.weight.device.type == "cpu" and layer.weight.dtype == torch.float32
            and not hasattr(layer, "cpu_product") and not hasattr(layer, "sibling_product"))


def _same_input(layers: list[nn.Linear]) -> bool:
    return (len({layer.in_features for layer in layers}) == 1
            and len({layer.bias is None for layer in layers}) == 1 and "forward" not in layers[0].__dict__)


def pack_linears(module: nn.Module, grid: bool = True, round_to_grid: bool = False) -> int:
    """Give the fp32 CPU `nn.Linear`s under `module` a few-row product and the forward that uses it;
    returns how many. grid: use the grid kernels for weights that lie on a GGUF grid. round_to_grid: run
    the others from Q8_0 codes rounded from their weights, which changes what they compute by up to 0.4% of
    a group's largest weight: for a draft model only (its state_dict and training path keep the exact weights).

    Like accelerate's hooks, this sets an instance `forward`; the product's weights are plain attributes,
    so the module's type, its state_dict and every other caller are unchanged.
    """
    packed = 0
    for parent in list(module.modules()):
        for names in SIBLINGS:
            layers = [getattr(parent, name, None) for name in names]
            if not (all(_packable(layer) for layer in layers) and _same_input(layers)):
                continue
            with torch.inference_mode(False), torch.no_grad():
                product = _sibling_product(layers, grid, round_to_grid)
            if product is None:
                continue
            group = _SiblingProduct(layers, product)
            layers[0].forward = functools.partial(group.first, layers[0])
            for index, layer in enumerate(layers[1:], 1):
                layer.forward = functools.partial(group.later, index, layer)
            for layer in layers:
                layer.sibling_product = group   # marks it packed (see _packable); holds the shared product
            packed += len(layers)
    for layer in module.modules():
        if _packable(layer):
            product = _product_for(layer.weight, grid, round_to_grid)
            if product is None:
                continue
            layer.cpu_product = product
            layer.forward = functools.partial(_product_forward, layer)
            packed += 1
    return packed


def unpacked(module: nn.Module):
    """A context: run a block with the library's own `nn.Linear.forward` on the packed layers, then pack them again."""
    return class_forwards(m for m in module.modules() if isinstance(m, nn.Linear))
