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


class _Rebuilt:
    """A grid's fp32 weight and its rows' checksums, computed once for all the weights it is compared with."""

    def __init__(self, grid: GridWeight) -> None:
        self.grid, self.dense = grid, grid.dense()
        self.sorted = torch.sort(_row_sums(self.dense))


def placed(grid: GridWeight | _Rebuilt, weight: torch.Tensor, sums: torch.Tensor | None = None) -> GridWeight | None:
    """`grid` with its rows in the order of `weight`'s where it rebuilds `weight` bit for bit; else None.
    sums: `weight`'s row checksums, where already computed."""
    rebuilt = grid if isinstance(grid, _Rebuilt) else _Rebuilt(grid)
    grid = rebuilt.grid
    a, b = rebuilt.sorted, torch.sort(_row_sums(weight) if sums is None else sums)
    if not torch.equal(a.values, b.values):
        return None
    if same_bits(rebuilt.dense, weight):
        return grid
    order = torch.empty_like(b.indices)
    order[b.indices] = a.indices                 # weight row r is the file's row order[r]
    moved = grid.rows(order)
    return moved if same_bits(moved.dense(), weight) else None


_FIXED = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}   # GGUF value type -> bytes
_SCALAR = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_STRING, _ARRAY = 8, 9


def gguf_header(path: str | Path) -> tuple[dict, list[tuple[str, int, list[int], int]], int]:
    """A GGUF file's header: (its scalar and string metadata by key, its tensor table as (name, type id, dims, offset
    from the data start), the data start in bytes). Arrays (the vocabulary) are skipped.

    Reads the header with `struct` rather than gguf's GGUFReader, which turns every metadata value (a 262k-token
    vocabulary) into numpy views: seconds on a large vocabulary, where only a few values are needed."""
    import mmap
    import struct

    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
        pos = 0

        def take(fmt: str):
            nonlocal pos
            out = struct.unpack_from("<" + fmt, buf, pos)
            pos += struct.calcsize("<" + fmt)
            return out[0] if len(out) == 1 else out

        def text() -> str:
            nonlocal pos
            length = take("Q")
            pos += length
            return bytes(buf[pos - length:pos]).decode("utf-8", "replace")

        def skip(kind: int) -> None:
            nonlocal pos
            if kind == _STRING:
                length = take("Q")
                pos += length
            elif kind == _ARRAY:
                item, count = take("IQ")
                if item in _FIXED:
                    pos += _FIXED[item] * count
                else:
                    for _ in range(count):
                        skip(item)
            else:
                pos += _FIXED[kind]

        magic, version, n_tensors, n_kv = take("4sIQQ")
        if magic != b"GGUF" or version < 2:
            raise ValueError(f"{path}: not a GGUF file of version 2 or later")
        metadata: dict = {}
        for _ in range(n_kv):
            key, kind = text(), take("I")
            if kind in _SCALAR:
                metadata[key] = take(_SCALAR[kind])
            elif kind == _STRING:
                metadata[key] = text()
            else:
                skip(kind)
        infos = []
        for _ in range(n_tensors):
            name = text()
            dims = [take("Q") for _ in range(take("I"))]
            infos.append((name, take("I"), dims, take("Q")))
        alignment = metadata.get("general.alignment", 32)
        start = (pos + alignment - 1) // alignment * alignment
    return metadata, infos, start


def k_quant_tensors(path: str | Path) -> list[tuple[str, str, int, int, np.ndarray]]:
    """The K-quant tensors of a GGUF file: (name, kind, rows, cols, raw blocks as a read-only memory map)."""
    from gguf import GGMLQuantizationType

    _, infos, start = gguf_header(path)
    out = []
    for name, type_id, dims, offset in infos:
        kind = GGMLQuantizationType(type_id).name if type_id in GGMLQuantizationType._value2member_map_ else ""
        if kind not in BLOCK_BYTES or len(dims) < 2 or dims[0] % QK_K:
            continue
        cols, rows = int(dims[0]), int(np.prod(dims[1:]))
        blocks = np.memmap(path, dtype=np.uint8, mode="r", offset=start + offset,
                           shape=(rows, cols // QK_K * BLOCK_BYTES[kind]))
        out.append((name, kind, rows, cols, blocks))
    return out


def attach_file_grids(model: nn.Module, path: str | Path) -> int:
    """Give each fp32 CPU weight of `model`'s linears and embeddings that a K-quant tensor of the GGUF file at `path`
    rebuilds bit for bit that tensor's grid (`weight.gguf_grid`); returns how many. Other weights are untouched."""
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
        for _name, kind, rows, cols, blocks in k_quant_tensors(path):
            candidates = [w for w in weights.get((rows, cols), []) if getattr(w, "gguf_grid", None) is None]
            if not candidates:
                continue
            grid = _Rebuilt(grid_from_blocks(kind, blocks, rows, cols))
            for w in candidates:
                if id(w) not in sums:
                    sums[id(w)] = _row_sums(w.detach())
                found = placed(grid, w.detach(), sums[id(w)])
                if found is not None:
                    w.gguf_grid = found
                    attached += 1
                    break
    return attached
