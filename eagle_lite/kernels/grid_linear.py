"""fp32 weights that lie exactly on a GGUF grid, kept as small integer codes and multiplied by an AVX2 kernel.

A target de-quantized from a GGUF file holds fp32 weights with few distinct values. SmolLM2's linears
are Q4_1, `w = q * d + m` with a 4-bit code q and one (d, m) pair per 32 inputs; its lm_head (tied to
the embeddings) is Q8_0, `w = q * d` with an 8-bit q. `Grid4.of(weight)` and `Grid8.of(weight)` find
the codes and scales and keep them only if rebuilding every weight (an fp32 multiply, then for Q4 an
fp32 add) gives back the weight bit for bit; anything else (a model trained in fp32, one cast to bf16)
is left alone. A K-quant tensor (Q4_K, Q5_K, Q6_K) gets its codes from the GGUF file's own blocks instead
(kquant.py), checked the same way against the weight. The kernel (csrc/grid_linear.cpp) rebuilds the same
fp32 weights on the fly and sums the same fp32 products as a dense GEMM, in a different order, as any two
GEMM kernels do: the model is unchanged, only its storage shrinks from 32 to 5 (Q4, Q4_K), 9 (Q8, Q5_0) or
12 (Q5_K, Q6_K) bits a weight. A few-row product
(plain decoding, tree verification) over fp32 weights is memory-bound on a CPU; from codes it reads a
fraction of the bytes and runs faster. Products of more than `MAX_GRID_ROWS` rows (a prompt's
prefill) are compute-bound and keep the dense weight.

The kernel is part of eagle_lite's native extension (native.py: built once per machine, with an fp32
fallback where it cannot be built).
"""
from __future__ import annotations

import torch

from .native import kernel_available

GROUP = 32          # inputs per (d, m) pair
LEVELS = 16         # 4-bit codes
MAX_GRID_ROWS = 32  # more rows (a prefill) are compute-bound: MKL's dense GEMM is as fast or faster there


class GridWeight:
    """A [N, K] fp32 weight as integer `codes` and fp32 `scales` per group of 32 inputs (subclasses say
    which grid), rebuilding the weight bit for bit."""
    op_name = ""

    def __init__(self, codes: torch.Tensor, scales: torch.Tensor) -> None:
        self.codes, self.scales = codes, scales

    @property
    def out_features(self) -> int:
        return self.codes.shape[0]

    @classmethod
    def of(cls, weight: torch.Tensor) -> GridWeight | None:
        """The grid form of `weight`, or None unless it rebuilds `weight` exactly."""
        if weight.dim() != 2 or weight.dtype != torch.float32 or weight.device.type != "cpu":
            return None
        n, k = weight.shape
        if k % GROUP or n == 0:
            return None
        with torch.inference_mode(False), torch.no_grad():
            w = weight.detach().reshape(n, k // GROUP, GROUP)
            if n > 16 and cls._find(w[:16]) is None:   # most weights are on no grid: a few rows tell, cheaply
                return None
            if not bool(torch.isfinite(w).all()):
                return None
            return cls._find(w)

    @classmethod
    def _find(cls, w: torch.Tensor) -> GridWeight | None:
        raise NotImplementedError

    @staticmethod
    def _fitting(guesses, rebuild):
        """Per group, the first scale guess whose codes rebuild the group exactly: (scale, codes) or None.
        rebuild(scale) -> (codes, rebuilt weights)."""
        step = codes = exact = None
        for guess in guesses:
            guess = torch.where(guess > 0, guess, torch.ones_like(guess))
            guess_codes, rebuilt = rebuild(guess)
            fits = rebuilt.all(-1, keepdim=True)
            if step is None:
                step, codes, exact = guess, guess_codes, fits
            else:
                step = torch.where(exact, step, guess)
                codes = torch.where(exact, codes, guess_codes)
                exact = exact | fits
            if bool(exact.all()):
                return step, codes
        return None

    @classmethod
    def stacked(cls, grids: list[GridWeight]) -> GridWeight:
        """One grid whose rows are `grids`' rows in order (sibling linears' weights stacked), all of this kind."""
        return cls(torch.cat([g.codes for g in grids]), torch.cat([g.scales for g in grids]))

    def rows(self, order: torch.Tensor) -> GridWeight:
        """The grid of the weight's rows taken in `order` (indices)."""
        return type(self)(self.codes[order].contiguous(), self.scales[order].contiguous())

    def dense(self) -> torch.Tensor:
        """The fp32 weight these codes stand for (what `of` checked against)."""
        raise NotImplementedError

    def takes(self, x: torch.Tensor) -> bool:
        """Whether `x` [..., K] is a product the kernel is for: at most MAX_GRID_ROWS rows, inference only
        (no backward)."""
        return x.numel() // x.shape[-1] <= MAX_GRID_ROWS and not torch.is_grad_enabled()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., K] fp32 -> x @ w.T [..., N], by the kernel (`kernel_available()` must be true)."""
        rows = x.reshape(-1, x.shape[-1]).contiguous()
        out = getattr(torch.ops.eagle_lite, self.op_name)(rows, self.codes, self.scales)
        return out.view(*x.shape[:-1], self.out_features)


class Grid4(GridWeight):
    """4-bit codes (uint8 [N, K/2], two per byte) and (d, m) per group (fp32 [N, K/16]): w = q * d + m, q in
    0..15 (GGUF's Q4_1; its Q4_0, d * (q - 8), is the case m = -8 d)."""
    op_name = "grid4_linear"

    @classmethod
    def _find(cls, w: torch.Tensor) -> Grid4 | None:
        low = w.amin(-1, keepdim=True)                                          # m: the group's code-0 value
        span = (w.amax(-1, keepdim=True).double() - low.double()) / (LEVELS - 1)

        def rebuild(d):
            q = torch.round((w - low) / d).clamp_(0, LEVELS - 1)
            return q, (q * d) + low == w                                       # the kernel's two roundings
        found = cls._fitting((span.float(), span.half().float()), rebuild)     # d in fp32, or GGUF's fp16 d
        if found is None:
            return None
        d, q = found
        n, groups = w.shape[:2]
        q = q.to(torch.uint8)
        codes = (q[..., :GROUP // 2] | (q[..., GROUP // 2:] << 4)).reshape(n, groups * GROUP // 2).contiguous()
        return cls(codes, torch.cat([d, low], dim=-1).reshape(n, groups * 2).contiguous())

    def dense(self) -> torch.Tensor:
        """The fp32 weight these codes stand for (what `of` checked against)."""
        n = self.codes.shape[0]
        packed = self.codes.view(n, -1, GROUP // 2)                             # n G 16
        q = torch.stack([packed & 0x0F, packed >> 4], dim=-2).view(n, -1, GROUP).float()
        dm = self.scales.view(n, -1, 2)
        return ((q * dm[..., :1]) + dm[..., 1:]).reshape(n, -1)


class Grid8(GridWeight):
    """8-bit codes (int8 [N, K]) and d per group (fp32 [N, K/32]): w = q * d (GGUF's Q8_0)."""
    op_name = "grid8_linear"

    @classmethod
    def _find(cls, w: torch.Tensor) -> Grid8 | None:
        span = w.abs().amax(-1, keepdim=True).double() / 127

        def rebuild(d):
            q = torch.round(w / d).clamp_(-128, 127)
            return q, q * d == w
        # d in fp32, GGUF's fp16 d of a Q8_0 group (its largest |w| / 127), or of a Q5_0 group (w = d * (q - 16):
        # its largest |w| is 16 |d|, exactly)
        guesses = (span.float(), span.half().float(), w.abs().amax(-1, keepdim=True) / 16)
        found = cls._fitting(guesses, rebuild)
        if found is None:
            return None
        d, q = found
        n, groups = w.shape[:2]
        return cls(q.to(torch.int8).reshape(n, groups * GROUP).contiguous(), d.reshape(n, groups).contiguous())

    def dense(self) -> torch.Tensor:
        n = self.codes.shape[0]
        return (self.codes.view(n, -1, GROUP).float() * self.scales.view(n, -1, 1)).reshape(n, -1)

    @classmethod
    def rounded(cls, weight: torch.Tensor) -> Grid8 | None:
        """`weight` rounded onto a Q8_0 grid (d = the group's largest |w| / 127): NOT the same weight, but
        within 0.4% of each group's largest entry. Only for a draft model, whose proposals need not be exact
        (acceptance checks every token against the target). None where `weight` cannot take a grid."""
        if weight.dim() != 2 or weight.dtype != torch.float32 or weight.device.type != "cpu" or weight.shape[1] % GROUP:
            return None
        with torch.inference_mode(False), torch.no_grad():
            w = weight.detach().reshape(weight.shape[0], -1, GROUP)
            if not bool(torch.isfinite(w).all()):
                return None
            d = w.abs().amax(-1, keepdim=True) / 127
            d = torch.where(d > 0, d, torch.ones_like(d))
            q = torch.round(w / d).clamp_(-127, 127)
            return cls.of(((q * d)).reshape(weight.shape))


class GridK(GridWeight):
    """8-bit codes (int8 [N, K]) and a (d, m) pair per 16 inputs (fp32 [N, K/8]): w = q * d + m, GGUF's K-quants
    Q5_K (q in 0..31, one pair per sub-block of 32: d * scale, -(dmin * min)) and Q6_K (q in -32..31, d * scale per
    16 inputs, m = -0.0, which adds nothing to any fp32 value). Their codes are read from a GGUF file's own blocks
    (kquant.py), not found from the weights: a sub-block's scale and min are 6-bit multiples of the super-block's
    fp16 d and dmin, rarely at the group's extremes."""
    op_name = "gridk_linear"

    @classmethod
    def _find(cls, w: torch.Tensor) -> GridK | None:
        return None

    def dense(self) -> torch.Tensor:
        n = self.codes.shape[0]
        dm = self.scales.view(n, -1, 2, 2)
        q = self.codes.view(n, -1, 2, GROUP // 2).float()
        return ((q * dm[..., :1]) + dm[..., 1:]).reshape(n, -1)


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two fp32 tensors hold the same bits (unlike ==, tells -0.0 from 0.0 and matches a NaN)."""
    return a.shape == b.shape and torch.equal(a.view(torch.int32), b.view(torch.int32))


def file_grid(weight: torch.Tensor) -> GridWeight | None:
    """The grid codes read from the weight's GGUF file (kquant.py: `weight.gguf_grid`), where they rebuild the weight
    as it is now bit for bit; else None."""
    known = getattr(weight, "gguf_grid", None)
    if known is None or weight.dtype != torch.float32 or weight.device.type != "cpu":
        return None
    with torch.inference_mode(False), torch.no_grad():
        return known if same_bits(known.dense(), weight.detach()) else None


def grid_of(weight: torch.Tensor) -> GridWeight | None:
    """`weight` on the first grid that rebuilds it exactly (its file's K-quant codes, Q4, then Q8), where the kernels
    run; else None."""
    known = file_grid(weight)
    if known is not None:
        return known if kernel_available() else None
    for kind in (Grid4, Grid8):
        found = kind.of(weight)
        if found is not None:
            return found if kernel_available() else None
    return None
