"""fp32 weights that lie exactly on a GGUF grid, kept as small integer codes and multiplied by an AVX2 kernel.

A target de-quantized from a GGUF file holds fp32 weights with few distinct values. SmolLM2's linears
are Q4_1, `w = q * d + m` with a 4-bit code q and one (d, m) pair per 32 inputs; its lm_head (tied to
the embeddings) is Q8_0, `w = q * d` with an 8-bit q. `Grid4.of(weight)` and `Grid8.of(weight)` find
the codes and scales and keep them only if rebuilding every weight (an fp32 multiply, then for Q4 an
fp32 add) gives back the weight bit for bit; anything else (a model trained in fp32, one cast to bf16)
is left alone. The kernel (csrc/grid_linear.cpp) rebuilds the same fp32 weights on the fly and sums the
same fp32 products as a dense GEMM, in a different order, as any two GEMM kernels do: the model is
unchanged, only its storage shrinks from 32 to 5 (Q4) or 9 (Q8) bits a weight. A few-row product
(plain decoding, tree verification) is memory-bound on this CPU, so it runs 2-3x faster. Products of
more than `MAX_GRID_ROWS` rows (a prompt's prefill) are compute-bound and keep the dense weight.

The kernel is compiled once per machine with torch's C++ extension builder (about 30 s, cached under
~/.cache/torch_extensions); where that fails (no compiler, no AVX2), a warning says so and the
linears keep their fp32 products.
"""
from __future__ import annotations

import functools
import logging
import os
import platform
import sys
from pathlib import Path

import torch

log = logging.getLogger("eagle_lite")

GROUP = 32          # inputs per (d, m) pair
LEVELS = 16         # 4-bit codes
MAX_GRID_ROWS = 24  # measured on the 2-core box: the kernel leads oneDNN's fp32 product up to ~32 rows
_SOURCE = Path(__file__).parent / "csrc" / "grid_linear.cpp"


@functools.cache
def kernel_available() -> bool:
    """Whether the grid kernels run here: an x86-64 CPU with AVX2 and a C++ compiler (built once, cached)."""
    if os.environ.get("EAGLE_LITE_GRID_KERNEL", "1") == "0":
        return False
    if platform.machine().lower() not in ("x86_64", "amd64") or torch.backends.cpu.get_cpu_capability() not in ("AVX2", "AVX512"):
        return False
    try:
        from torch.utils.cpp_extension import load

        # pip's `ninja` lands beside the interpreter, which need not be on PATH (a venv run by path)
        os.environ["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")])
        log.info("building the 4-bit grid kernel once (about 30 s)")
        load(name="eagle_lite_grid_linear", sources=[str(_SOURCE)], is_python_module=False,
             extra_cflags=["-O3", "-mavx2", "-mfma", "-ffp-contract=off", "-fopenmp"], extra_ldflags=["-fopenmp"])
        return hasattr(torch.ops.eagle_lite, "grid8_linear")
    except Exception as err:  # a missing compiler or headers: the fp32 products still work
        log.warning("4-bit grid kernel unavailable (%s: %s); linears keep their fp32 products",
                    type(err).__name__, str(err).splitlines()[0] if str(err) else "")
        return False


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
    def of(cls, weight: torch.Tensor) -> "GridWeight | None":
        """The grid form of `weight`, or None unless it rebuilds `weight` exactly."""
        if weight.dim() != 2 or weight.dtype != torch.float32 or weight.device.type != "cpu":
            return None
        n, k = weight.shape
        if k % GROUP or n == 0:
            return None
        with torch.inference_mode(False), torch.no_grad():
            w = weight.detach().reshape(n, k // GROUP, GROUP)
            if not bool(torch.isfinite(w).all()):
                return None
            return cls._find(w)

    @classmethod
    def _find(cls, w: torch.Tensor) -> "GridWeight | None":
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
    def _find(cls, w: torch.Tensor) -> "Grid4 | None":
        low = w.amin(-1, keepdim=True)                                          # m: the group's code-0 value
        span = (w.amax(-1, keepdim=True).double() - low.double()) / 15

        def rebuild(d):
            q = torch.round((w - low) / d).clamp_(0, 15)
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
    def _find(cls, w: torch.Tensor) -> "Grid8 | None":
        span = w.abs().amax(-1, keepdim=True).double() / 127

        def rebuild(d):
            q = torch.round(w / d).clamp_(-128, 127)
            return q, q * d == w
        found = cls._fitting((span.float(), span.half().float()), rebuild)
        if found is None:
            return None
        d, q = found
        n, groups = w.shape[:2]
        return cls(q.to(torch.int8).reshape(n, groups * GROUP).contiguous(), d.reshape(n, groups).contiguous())

    def dense(self) -> torch.Tensor:
        n = self.codes.shape[0]
        return (self.codes.view(n, -1, GROUP).float() * self.scales.view(n, -1, 1)).reshape(n, -1)


def grid_of(weight: torch.Tensor) -> GridWeight | None:
    """`weight` on the first grid that rebuilds it exactly (Q4, then Q8), where the kernels run; else None."""
    for kind in (Grid4, Grid8):
        found = kind.of(weight)
        if found is not None:
            return found if kernel_available() else None
    return None
