"""The target's lm_head as the engine reads it: logits of a few rows, the greedy token, node logits on demand.

The lm_head is the single most expensive matrix of a small model, so it is never run over more rows than
acceptance reads. `LmHead.logits` picks the product for the row count and device (every choice is the same fp32
sum of the same terms, to rounding); `LmHead.top_token` finds one row's argmax exactly without a full fp32 row
where it can (grid codes, or kernels/certified_argmax.py); `NodeLogits` projects a verified tree's nodes lazily.
"""
from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch
from torch import nn

from ..kernels import FEW_ROWS, MAX_GRID_ROWS, CertifiedArgmax, GridWeight, few_rows_product

# On CPU a one-row lm_head product streams a transposed (H x V) copy of the weight faster than it streams
# the row-major original (MKL's gemv), so targets whose lm_head is at most this large keep one.
TRANSPOSED_LM_HEAD_MAX_BYTES = 512 << 20


def first_argmax(row: torch.Tensor) -> int:
    """The index of the largest logit of a row [V] (the first of equal ones, as torch's argmax): numpy's on a CPU
    float32 row, which runs vectorised where torch's CPU argmax runs on one thread without SIMD (docs/cpu.md)."""
    if row.device.type == "cpu" and row.dtype == torch.float32 and row.dim() == 1 and not row.requires_grad:
        return int(np.argmax(row.numpy()))
    return int(row.argmax())


class LmHead:
    """lm_head(hidden) -> logits, then `finish` (a model's logit scale or soft cap; None: nothing)."""

    def __init__(self, module: nn.Module, finish: Callable | None = None, grid: GridWeight | None = None) -> None:
        self.module, self.finish, self.grid = module, finish, grid
        self._transposed: torch.Tensor | None = None        # H V copy for one-row products on CPU
        self._argmax: CertifiedArgmax | None | bool = False  # float16 argmax path (top_token); False: not built

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits [R, V] of final hidden states [R, H], in the fastest form for R and device.

        On CPU a few rows are memory-bound on the V x H weight: grid codes (Q8_0) where the weight has them;
        else one row streams the transposed copy and up to FEW_ROWS rows run as W @ h^T (each faster than
        `F.linear` there: kernels' few_rows_product).
        """
        out = self._product(hidden)
        return out if self.finish is None else self.finish(out)

    def _product(self, hidden: torch.Tensor) -> torch.Tensor:
        weight, bias = self.module.weight, getattr(self.module, "bias", None)
        if self.grid is not None and self.grid.takes(hidden):
            out = self.grid(hidden)
            return out if bias is None else out + bias
        if weight.device.type != "cpu" or type(self.module) is not nn.Linear or hidden.shape[0] > FEW_ROWS:
            return self.module(hidden)
        if hidden.shape[0] == 1 and self._transposed_weight() is not None:
            out = hidden @ self._transposed
        else:
            out = few_rows_product(hidden, weight)
        return out if bias is None else out + bias

    def top_token(self, hidden: torch.Tensor) -> int:
        """The greedy token for one final hidden state [H]: argmax of its fp32 logits. On CPU they come from the
        grid codes where the lm_head has them, else from a float16 copy with an error bound that makes the answer
        exact (kernels/certified_argmax.py)."""
        if self.grid is not None:
            return first_argmax(self.logits(hidden[None])[0])
        if self._argmax is False:
            plain = type(self.module) is nn.Linear and getattr(self.module, "bias", None) is None
            had_transposed = self._transposed is not None
            self._argmax = CertifiedArgmax.build(self.module.weight, self._product) if plain else None
            if self._argmax is not None and not had_transposed:
                self._transposed = None   # built only to time the fp32 row against: greedy no longer needs it
        if self._argmax is None:
            return first_argmax(self.logits(hidden[None])[0])
        return self._argmax(hidden)

    def _transposed_weight(self) -> torch.Tensor | None:
        weight = self.module.weight
        if self._transposed is None and weight.numel() * weight.element_size() <= TRANSPOSED_LM_HEAD_MAX_BYTES:
            with torch.inference_mode(False):  # a normal tensor: callers may run outside inference mode
                self._transposed = weight.detach().t().contiguous()
        return self._transposed


class NodeLogits:
    """The target's logits of the nodes of a verified tree, projected through the lm_head on demand.

    Acceptance reads the logits of the nodes it walks through (the accepted path and the node where it
    stops), a few of the tree's nodes; on CPU each lm_head row costs as much as a decoder layer, so
    `lazy` projects a node when it is first read. Otherwise (GPU) all rows are projected in one product.
    `likely`: nodes the walk will probably read (the draft's likeliest path): where the lm_head runs from
    grid codes, the first read of one of them projects them all in one product, which reads the weight
    once for all of them. `nodes[i]` is node i's logits [V].
    """

    def __init__(self, head: LmHead, hidden: torch.Tensor, lazy: bool | None = None,
                 likely: list[int] | None = None, rows: dict[int, torch.Tensor] | None = None) -> None:
        self.head, self.hidden = head, hidden  # N H, final hidden states of the tree's nodes
        self.lazy = hidden.device.type == "cpu" if lazy is None else lazy
        self._all = None if self.lazy else head.logits(hidden)
        self._rows: dict[int, torch.Tensor] = dict(rows or {})   # node -> logits [V] projected already
        self._tops: dict[int, int] = {}
        self._likely = likely if self.lazy and likely and len(likely) > 1 and head.grid is not None else None
        self.projected = 0 if self.lazy else hidden.shape[0]   # nodes whose logits or argmax were computed
        self.projected += len(self._rows) if self.lazy else 0

    @classmethod
    def together(cls, head: LmHead, trees: list[tuple[torch.Tensor, list[int]]]) -> list[NodeLogits]:
        """One `NodeLogits` per verified tree of a batch, (final hidden states [N, H], its likely path): on CPU
        the likely paths' rows of all the trees are projected in shared products, which read the lm_head weight
        once per product instead of once per tree (a batch of plain steps: one product for every root)."""
        if len(trees) < 2 or any(hidden.device.type != "cpu" for hidden, _ in trees):
            return [cls(head, hidden, likely=likely) for hidden, likely in trees]
        wanted = [(t, node) for t, (_, likely) in enumerate(trees) for node in dict.fromkeys(likely)]
        per_product = MAX_GRID_ROWS if head.grid is not None else FEW_ROWS
        found: list[dict[int, torch.Tensor]] = [{} for _ in trees]
        for start in range(0, len(wanted), per_product):
            part = wanted[start:start + per_product]
            logits = head.logits(torch.stack([trees[t][0][node] for t, node in part]))
            for (t, node), row in zip(part, logits):
                found[t][node] = row
        return [cls(head, hidden, likely=likely, rows=rows) for (hidden, likely), rows in zip(trees, found)]

    def prefetch(self, nodes: list[int]) -> None:
        """Project these nodes' logits in one product (the lm_head weight read once for all of them) for the reads
        that follow: rows a drafter reads back after acceptance (`DraftTree.probes`) beside the walk's."""
        if self._all is not None:
            return
        rows = [n for n in dict.fromkeys(nodes) if n not in self._rows]
        if rows:
            self._rows.update(zip(rows, self.head.logits(self.hidden[rows])))
            self.projected += len(rows)

    def _project_likely(self, node: int) -> None:
        if self._likely is not None and node in self._likely:
            rows, self._likely = self._likely, None
            self.prefetch(rows)

    def top_token(self, node: int) -> int:
        """The target's greedy token at `node` (its logits' argmax); lazily, without an fp32 row on CPU."""
        if self._all is not None:
            return first_argmax(self._all[node])
        if node not in self._tops:
            self._project_likely(node)
        if node in self._rows:
            return first_argmax(self._rows[node])
        if node not in self._tops:
            self._tops[node] = self.head.top_token(self.hidden[node])
            self.projected += 1
        return self._tops[node]

    def __getitem__(self, node: int) -> torch.Tensor:
        if self._all is not None:
            return self._all[node]
        self._project_likely(node)
        row = self._rows.get(node)
        if row is None:
            row = self._rows[node] = self.head.logits(self.hidden[node:node + 1])[0]
            self.projected += 1
        return row
