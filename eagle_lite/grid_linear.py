"""fp32 weights that lie exactly on a 4-bit grid, kept as 4-bit codes and multiplied by an AVX2 kernel.

A target de-quantized from a GGUF file holds fp32 weights with few distinct values: SmolLM2's Q4_1
linears are `w = q * d + m` with a 4-bit code q and one (d, m) pair per 32 inputs. `Grid4.of(weight)`
finds q, d and m and keeps them only if rebuilding every weight (one fp32 multiply, one fp32 add)
gives back the weight bit for bit; anything else (a model trained in fp32, one cast to bf16) is left
alone. The kernel (csrc/grid4_linear.cpp) rebuilds the same fp32 weights on the fly and sums the same
fp32 products as a dense GEMM, in a different order, as any two GEMM kernels do: the model is
unchanged, only its storage shrinks from 32 to 5 bits a weight. A few-row product (plain decoding,
tree verification) is memory-bound on this CPU, so it runs 2-3x faster. Dense rows past
`MAX_GRID_ROWS` (a prompt's prefill) are compute-bound and keep the dense weight.

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
from dataclasses import dataclass
from pathlib import Path

import torch

log = logging.getLogger("eagle_lite")

GROUP = 32          # inputs per (d, m) pair
LEVELS = 16         # 4-bit codes
MAX_GRID_ROWS = 24  # measured on the 2-core box: the kernel leads oneDNN's fp32 product up to ~32 rows
_SOURCE = Path(__file__).parent / "csrc" / "grid4_linear.cpp"


@functools.cache
def kernel_available() -> bool:
    """Whether the grid kernel runs here: an x86-64 CPU with AVX2 and a C++ compiler (built once, cached)."""
    if os.environ.get("EAGLE_LITE_GRID_KERNEL", "1") == "0":
        return False
    if platform.machine().lower() not in ("x86_64", "amd64") or torch.backends.cpu.get_cpu_capability() not in ("AVX2", "AVX512"):
        return False
    try:
        from torch.utils.cpp_extension import load

        # pip's `ninja` lands beside the interpreter, which need not be on PATH (a venv run by path)
        os.environ["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")])
        log.info("building the 4-bit grid kernel once (about 30 s)")
        load(name="eagle_lite_grid4", sources=[str(_SOURCE)], is_python_module=False,
             extra_cflags=["-O3", "-mavx2", "-mfma", "-ffp-contract=off", "-fopenmp"], extra_ldflags=["-fopenmp"])
        return hasattr(torch.ops.eagle_lite, "grid4_linear")
    except Exception as err:  # a missing compiler or headers: the fp32 products still work
        log.warning("4-bit grid kernel unavailable (%s: %s); linears keep their fp32 products",
                    type(err).__name__, str(err).splitlines()[0] if str(err) else "")
        return False


@dataclass(frozen=True)
class Grid4:
    """A [N, K] fp32 weight as 4-bit codes `qs` [N, K/2] (uint8, two per byte) and `dm` [N, K/16]
    (fp32 d, m per group of 32 inputs): w[j, 32g + i] = q * d + m, bit for bit."""
    qs: torch.Tensor
    dm: torch.Tensor

    @property
    def out_features(self) -> int:
        return self.qs.shape[0]

    @classmethod
    def of(cls, weight: torch.Tensor) -> "Grid4 | None":
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
            low = w.amin(-1, keepdim=True)                                       # m: the group's code-0 value
            span = (w.amax(-1, keepdim=True).double() - low.double()) / (LEVELS - 1)
            step = codes = exact = None
            for guess in (span.float(), span.half().float()):                   # d in fp32, or GGUF's fp16 d
                guess = torch.where(guess > 0, guess, torch.ones_like(guess))
                guess_codes = torch.round((w - low) / guess).clamp_(0, LEVELS - 1)
                fits = ((guess_codes * guess) + low == w).all(-1, keepdim=True)  # the kernel's two roundings
                if step is None:
                    step, codes, exact = guess, guess_codes, fits
                else:                                                           # per group, the guess that fits
                    step = torch.where(exact, step, guess)
                    codes = torch.where(exact, codes, guess_codes)
                    exact = exact | fits
                if bool(exact.all()):
                    break
            if not bool(exact.all()):
                return None
            codes = codes.to(torch.uint8)
            qs = (codes[..., :GROUP // 2] | (codes[..., GROUP // 2:] << 4)).reshape(n, k // 2).contiguous()
            dm = torch.cat([step, low], dim=-1).reshape(n, k // GROUP * 2).contiguous()
        return cls(qs, dm)

    def dense(self) -> torch.Tensor:
        """The fp32 weight these codes stand for (what `of` checked against)."""
        n = self.qs.shape[0]
        packed = self.qs.view(n, -1, GROUP // 2)                                   # n G 16
        codes = torch.stack([packed & 0x0F, packed >> 4], dim=-2).view(n, -1, GROUP).float()
        dm = self.dm.view(n, -1, 2)
        return ((codes * dm[..., :1]) + dm[..., 1:]).reshape(n, -1)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., K] fp32 -> x @ w.T [..., N], by the kernel (`kernel_available()` must be true)."""
        rows = x.reshape(-1, x.shape[-1]).contiguous()
        return torch.ops.eagle_lite.grid4_linear(rows, self.qs, self.dm).view(*x.shape[:-1], self.out_features)
