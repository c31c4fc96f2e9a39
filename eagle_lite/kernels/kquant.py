"""GGUF's K-quants (Q4_K, Q5_K, Q6_K) as grid codes, read from the file's own blocks.

A K-quant super-block of 256 inputs holds an fp16 d (and, for Q4_K/Q5_K, an fp16 dmin) and a 6-bit scale (and min)
per sub-block; gguf-py, which transformers de-quantizes GGUF files with, rebuilds each weight in fp32 as
`(d * scale) * q - (dmin * min)` (Q4_K, Q5_K: sub-blocks of 32) or `(d * scale) * q` (Q6_K: 16 inputs a scale).
That is a per-group grid of the kind grid_linear.py keeps (Q4_K is Grid4 with d * scale and -(dmin * min); Q5_K and
Q6_K are GridK), but finding its scales from the fp32 weights alone is guesswork: a sub-block's codes rarely reach
both ends of the range. So the codes and per-group scales are taken from the file's blocks, with the same fp32
products gguf-py computes, and matched to the model's weights by content: a grid is attached to a weight
(`weight.gguf_grid`) only where it rebuilds that weight bit for bit, its rows in the order the model holds them
(transformers reorders a Llama file's q/k rows). `grid_linear.grid_of` checks it again when the kernels are chosen.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from torch import nn

from .grid_linear import GROUP, Grid4, GridK, GridWeight, same_bits

QK_K = 256                                       # inputs per super-block
BLOCK_BYTES = {"Q4_K": 144, "Q5_K": 176, "Q6_K": 210}


def _scale_min(scales: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The 6-bit scales and mins of Q4_K/Q5_K's 12 packed bytes (gguf-py's Q4_K.get_scale_min): [n, 8] each."""
    s = scales.reshape(-1, 3, 4)
    d, m, m_d = s[:, 0], s[:, 1], s[:, 2]
    sc = np.concatenate([d & 0x3F, (m_d & 0x0F) | ((d >> 2) & 0x30)], axis=-1)
    mn = np.concatenate([m & 0x3F, (m_d >> 4) | ((m >> 2) & 0x30)], axis=-1)
    return sc, mn


def _fp16(raw: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(raw).view(np.float16).astype(np.float32)


def grid_from_blocks(kind: str, blocks: np.ndarray, rows: int, cols: int) -> GridWeight:
    """The grid of a [rows, cols] K-quant tensor from its raw blocks (uint8, rows * cols / 256 blocks in order)."""
    if cols % QK_K:
        raise ValueError(f"{kind}: a row of {cols} inputs is not whole super-blocks of {QK_K}")
    b = np.ascontiguousarray(blocks, dtype=np.uint8).reshape(-1, BLOCK_BYTES[kind])
    n = b.shape[0]
    if kind == "Q6_K":
        ql, qh, sc, d = b[:, :128], b[:, 128:192], b[:, 192:208], b[:, 208:210]
        scale = _fp16(d) * np.ascontiguousarray(sc).view(np.int8).astype(np.float32)           # [n, 16]
        ql = (ql.reshape(n, -1, 1, 64) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)) & np.uint8(0x0F)
        qh = (qh.reshape(n, -1, 1, 32) >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 1, 4, 1)) & np.uint8(3)
        q = (ql.reshape(n, -1, 32) | (qh.reshape(n, -1, 32) << np.uint8(4))).astype(np.int8) - np.int8(32)
        pairs = np.stack([scale, np.full_like(scale, -0.0)], axis=-1)                          # [n, 16, 2]
        return GridK(torch.from_numpy(q.reshape(rows, cols).copy()),
                     torch.from_numpy(pairs.reshape(rows, cols // 16 * 2).copy()))
    d, dmin, packed = _fp16(b[:, 0:2]), _fp16(b[:, 2:4]), b[:, 4:16]
    sc, mn = _scale_min(packed)
    scale, low = d * sc.astype(np.float32), -(dmin * mn.astype(np.float32))                  # [n, 8] each
    shifts = np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)
    if kind == "Q4_K":
        q = ((b[:, 16:].reshape(n, -1, 1, 32) >> shifts) & np.uint8(0x0F)).reshape(n, -1, GROUP)
        codes = q[..., :GROUP // 2] | (q[..., GROUP // 2:] << np.uint8(4))                     # Grid4's packing
        pairs = np.stack([scale, low], axis=-1)                                                # [n, 8, 2]
        return Grid4(torch.from_numpy(codes.reshape(rows, cols // 2).copy()),
                     torch.from_numpy(pairs.reshape(rows, cols // GROUP * 2).copy()))
    if kind == "Q5_K":
        qh, qs = b[:, 16:48], b[:, 48:]
        ql = ((qs.reshape(n, -1, 1, 32) >> shifts) & np.uint8(0x0F)).reshape(n, -1, 32)
        hi = ((qh.reshape(n, -1, 1, 32) >> np.arange(8, dtype=np.uint8).reshape(1, 1, 8, 1)) & np.uint8(1))
        q = (ql | (hi.reshape(n, -1, 32) << np.uint8(4))).astype(np.int8)
        pairs = np.stack([scale, low, scale, low], axis=-1)                                    # [n, 8, 4]
        return GridK(torch.from_numpy(q.reshape(rows, cols).copy()),
                     torch.from_numpy(pairs.reshape(rows, cols // GROUP * 4).copy()))
    raise ValueError(f"not a K-quant type: {kind}")


def _row_sums(w: torch.Tensor) -> torch.Tensor:
    """A checksum of each row's bits (equal rows, equal sums; the match is checked bit for bit after)."""
    weights = torch.arange(1, w.shape[1] + 1, dtype=torch.float64).sqrt()
    return w.view(torch.int32).double() @ weights


def placed(grid: GridWeight, weight: torch.Tensor, sums: torch.Tensor | None = None) -> GridWeight | None:
    """`grid` with its rows in the order of `weight`'s where it rebuilds `weight` bit for bit; else None."""
    dense = grid.dense()
    if same_bits(dense, weight):
        return grid
    mine, theirs = _row_sums(dense), _row_sums(weight) if sums is None else sums
    a, b = torch.sort(mine), torch.sort(theirs)
    if not torch.equal(a.values, b.values):
        return None
    order = torch.empty_like(b.indices)
    order[b.indices] = a.indices                 # weight row r is the file's row order[r]
    moved = grid.rows(order)
    return moved if same_bits(moved.dense(), weight) else None


def attach_file_grids(model: nn.Module, path: str | Path) -> int:
    """Give each fp32 CPU weight of `model`'s linears and embeddings that a K-quant tensor of the GGUF file at `path`
    rebuilds bit for bit that tensor's grid (`weight.gguf_grid`); returns how many. Other weights are untouched."""
    from gguf import GGUFReader

    weights: dict[tuple[int, int], list[torch.Tensor]] = {}
    seen: set[int] = set()
    for module in model.modules():
        w = getattr(module, "weight", None)
        if (isinstance(module, (nn.Linear, nn.Embedding)) and isinstance(w, torch.Tensor) and w.dim() == 2
                and w.dtype == torch.float32 and w.device.type == "cpu" and id(w) not in seen):
            seen.add(id(w))
            weights.setdefault(tuple(w.shape), []).append(w)
    sums: dict[int, torch.Tensor] = {}
    attached = 0
    with torch.inference_mode(False), torch.no_grad():
        for tensor in GGUFReader(str(path)).tensors:
            kind = tensor.tensor_type.name
            cols = int(tensor.shape[0])
            rows = int(np.prod(tensor.shape[1:])) if len(tensor.shape) > 1 else 1
            candidates = [w for w in weights.get((rows, cols), []) if getattr(w, "gguf_grid", None) is None]
            if kind not in BLOCK_BYTES or not candidates or cols % QK_K:
                continue
            grid = grid_from_blocks(kind, np.asarray(tensor.data), rows, cols)
            for w in candidates:
                if id(w) not in sums:
                    sums[id(w)] = _row_sums(w.detach())
                found = placed(grid, w.detach(), sums[id(w)])
                if found is not None:
                    w.gguf_grid = found
                    attached += 1
                    break
    return attached
