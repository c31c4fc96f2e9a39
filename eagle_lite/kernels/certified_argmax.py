"""The lm_head's argmax for one hidden state, from a float16 copy of the weight, certified exact.

Greedy decoding needs one thing from a row of logits: which token is largest. On CPU one fp32 row of
SmolLM2's 49152 x 576 lm_head streams 113 MB, a large part of a CPU decoding step; PyTorch's float16 matrix-vector
kernel reads half of that. Its logits z~ are not the fp32 logits z, but the difference has a bound
that holds for every row j (u = 2**-11, float16's unit roundoff; the products are summed in float32):

    |z~_j - z_j| <= b_j = SAFETY * ((2u + u^2 + n 2**-24) |w_j| |x| + 2**-24 sqrt(n) (|w_j| + |x|) + u |z~_j|)

(rounding w and x to float16, the float32 sum, float16 subnormals, rounding z~ to float16; |.| is the
Euclidean norm, which bounds sum_i |w_ji x_i|). The true argmax is then one of the rows whose interval
[z~ - b, z~ + b] reaches the largest lower end; those few rows (usually one) are computed again in fp32
and the largest of them is the answer: the token fp32 would choose, without the fp32 pass over the matrix.

`CertifiedArgmax.build` keeps the float16 path only where it is safe and pays: the weight fits float16,
a probe's errors stay within a quarter of the bound (a kernel that summed in float16 would not), and
it is faster than the fp32 row on this machine. Sampling needs every probability and keeps fp32.
"""
from __future__ import annotations

import math
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

SAFETY = 4.0
_U = 2.0 ** -11          # float16 unit roundoff
_F32 = 2.0 ** -24        # float32 unit roundoff
_HALF_MAX = 60000.0      # inputs beyond this (float16's largest finite is 65504) take the fp32 path


class CertifiedArgmax:
    """argmax_j (W x)_j for a [V, H] fp32 weight and one x [H], reading a float16 copy of W."""

    def __init__(self, weight: torch.Tensor) -> None:
        self.weight = weight                                               # V H fp32 (the model's own)
        with torch.inference_mode(False), torch.no_grad():
            self.half = weight.detach().to(torch.float16)                  # V H
            self.row_norms = weight.detach().norm(dim=1)                   # V
        n = weight.shape[1]
        self.rel = SAFETY * (2 * _U + _U * _U + n * _F32)                  # times |w_j| |x|
        self.abs = SAFETY * _F32 * math.sqrt(n)                            # times |w_j| + |x|
        self.rechecked = 0                                                 # calls that needed > 1 fp32 row

    @classmethod
    def build(cls, weight: torch.Tensor, fp32_row: Callable[[torch.Tensor], torch.Tensor],
              require_faster: bool = True) -> CertifiedArgmax | None:
        """The float16 path for this weight, or None where it is unsafe or (require_faster) no faster than
        `fp32_row`, which maps x [1, H] to fp32 logits [1, V]."""
        if weight.device.type != "cpu" or weight.dtype != torch.float32 or weight.dim() != 2:
            return None
        if not bool(torch.isfinite(weight).all()) or float(weight.abs().max()) > _HALF_MAX:
            return None
        fast = cls(weight)
        h = weight.shape[1]
        x = torch.linspace(-4.0, 4.0, h).sin() * torch.linspace(0.5, 3.0, h)  # deterministic probe, no RNG
        with torch.no_grad():
            approx = fast._approx(x)
            exact = fp32_row(x[None])[0].float()
            if not bool(((approx - exact).abs() <= fast._bound(approx, x) / 4).all()):
                return None
            if require_faster and fast._seconds(lambda: fast(x)) >= fast._seconds(lambda: fp32_row(x[None]).argmax()):
                return None
        return fast

    @staticmethod
    def _seconds(fn: Callable[[], object], repeats: int = 3) -> float:
        fn()
        best = float("inf")
        for _ in range(repeats):
            start = time.perf_counter()
            fn()
            best = min(best, time.perf_counter() - start)
        return best

    def _approx(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x.to(torch.float16)[None], self.half)[0].float()   # V

    def _bound(self, approx: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        x_norm = float(x.norm())
        return (self.rel * x_norm + self.abs) * self.row_norms + self.abs * x_norm + SAFETY * _U * approx.abs()

    def __call__(self, x: torch.Tensor) -> int:
        """x: [H] (fp32). The index fp32 logits W x would give as their argmax."""
        if float(x.abs().max()) > _HALF_MAX:
            return int(F.linear(x, self.weight).argmax())
        approx = self._approx(x)
        bound = self._bound(approx, x)
        floor = (approx - bound).max()
        rows = torch.nonzero(approx + bound >= floor).flatten()            # ascending ids; the argmax is here
        if not bool(torch.isfinite(floor)) or rows.numel() == 0:
            return int(F.linear(x, self.weight).argmax())
        if rows.numel() == 1:
            return int(rows[0])
        self.rechecked += 1
        exact = F.linear(x, self.weight[rows])                             # the candidates in fp32
        return int(rows[exact.argmax()])                                   # ties: the lowest id, like argmax
