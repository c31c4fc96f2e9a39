"""Medusa heads in the published layouts: FasterDecoding/Medusa (v1, and config `"version": "2"`) and vLLM's.

FasterDecoding: config.json (medusa_num_heads, medusa_num_layers, base_model_name_or_path, version) and
`medusa_lm_head.safetensors` (its trainer) / `medusa_lm_head.pt` (what its loaders read) holding, for head k,
`{k}.{l}.linear.weight` [H, H] and `.bias` [H] per ResBlock l, and in v1 a vocabulary projection `{k}.{L}.weight`
[V, H] (L = medusa_num_layers); version "2" heads are ResBlocks only and score with the base lm_head. Its heads
repeat one ResBlock module `medusa_num_layers` times (list multiplication), so their blocks are equal.
vLLM (`model_type: medusa`): `blocks.{k}.layers.{l}.weight` (+ `.bias` with medusa_fc_bias), `lm_heads.{k}.weight`
or one `lm_head.weight` (original_lm_head), config num_heads, num_hidden_layers, hidden_size, vocab_size.
"""
from __future__ import annotations

import re
from pathlib import Path

import torch
from safetensors.torch import save_file

from ..atomic import write_atomic
from ..heads.checkpoint import HeadMismatchError, check_target, load_weights, write_folder
from ..heads.medusa import MedusaHeads
from .detect import KINDS, Layout
from .files import save_tensor_pickle

BLOCK = re.compile(r"^(\d+)\.(\d+)\.linear\.(weight|bias)$")
PROJ = re.compile(r"^(\d+)\.(\d+)\.weight$")
VLLM_BLOCK = re.compile(r"^blocks\.(\d+)\.layers\.(\d+)\.(weight|bias)$")
VLLM_PROJ = re.compile(r"^lm_heads\.(\d+)\.weight$")


def fasterdecoding_names(tensors: dict[str, torch.Tensor], num_layers: int) -> dict[str, torch.Tensor]:
    """vLLM's key names as FasterDecoding's (identity for a FasterDecoding file)."""
    out = {}
    for key, value in tensors.items():
        if m := VLLM_BLOCK.match(key):
            out[f"{m[1]}.{m[2]}.linear.{m[3]}"] = value
        elif m := VLLM_PROJ.match(key):
            out[f"{m[1]}.{num_layers}.weight"] = value
        else:
            out[key] = value
    return out


def read_medusa(layout: Layout, target) -> MedusaHeads:
    """A published Medusa folder as MedusaHeads for `target` (v1: each head's own vocabulary projection)."""
    config, where = layout.config, layout.where
    if layout.kind != "medusa":
        raise ValueError(f"{layout.folder} holds {KINDS[layout.kind]}, not Medusa heads: pass it with --draft")
    meta = config.get("eagle_lite") or {}
    if "target" in meta:
        check_target(meta, target, layout.folder, "Medusa heads")
    vllm = config.get("model_type") == "medusa" and "medusa_num_heads" not in config
    layers = int(config.get("num_hidden_layers" if vllm else "medusa_num_layers", 1))
    tensors = fasterdecoding_names(layout.tensors, layers)
    shared = tensors.pop("lm_head.weight", None)          # vLLM original_lm_head: one projection for all heads
    tensors.pop("token_map", None)
    found = sorted({int(m[1]) for k in tensors if (m := BLOCK.match(k))})
    count = int(config.get("num_heads" if vllm else "medusa_num_heads", len(found)))
    if found[:count] != list(range(count)):
        raise ValueError(f"{where}: config.json names {count} heads, the weights hold ResBlocks of heads {found}")
    hidden = target.hidden_size
    for k in range(count):
        for l in range(layers):
            w = tensors.get(f"{k}.{l}.linear.weight")
            if w is None or tuple(w.shape) != (hidden, hidden):
                got = None if w is None else list(w.shape)
                raise HeadMismatchError(f"{where}: head {k} block {l} weight is {got}, target '{target.name}' needs "
                                        f"[{hidden}, {hidden}]")
    per_head = [tensors.get(f"{k}.{layers}.weight") for k in range(count)]
    if str(config.get("version", "")) == "2":
        if any(p is not None for p in per_head):
            raise ValueError(f"{where}: config.json says version 2 (heads score with the base lm_head), but the "
                             f"weights hold per-head vocabulary projections {{k}}.{layers}.weight")
        projections = None       # a vLLM lm_head.weight beside them is the base lm_head's copy
    else:
        projections = [shared] * count if shared is not None else per_head
        if any(p is None for p in projections):
            raise ValueError(f"{where}: a Medusa-1 head needs its vocabulary projection {{k}}.{layers}.weight for "
                             f"every head (or config.json \"version\": \"2\" to score with the base lm_head)")
    base = target.lm_head.weight.detach().cpu()
    own = projections is not None and not all(torch.equal(p.to(base.dtype), base) for p in projections)
    for p in projections if own else []:
        if tuple(p.shape) != (target.vocab_size, hidden):
            raise HeadMismatchError(f"{where}: a vocabulary projection is {list(p.shape)}, target '{target.name}' "
                                    f"needs [{target.vocab_size}, {hidden}]")
    heads = MedusaHeads(hidden, count, layers, target.vocab_size if own else None)
    state = {}
    for k in range(count):
        for l in range(layers):
            state[f"heads.{k}.{l}.linear.weight"] = tensors[f"{k}.{l}.linear.weight"]
            state[f"heads.{k}.{l}.linear.bias"] = tensors.get(f"{k}.{l}.linear.bias", torch.zeros(hidden))
        if own:
            state[f"lm_heads.{k}.weight"] = projections[k]
    load_weights(heads, state, f"{where}: the weights in {layout.weights.name}")
    return heads.to(device=target.device, dtype=target.dtype).eval()


def write_medusa(heads: MedusaHeads, target, out: str | Path, meta: dict, dtype: torch.dtype = torch.bfloat16
                 ) -> list[str]:
    """Write Medusa heads for vLLM (model.safetensors) and FasterDecoding (medusa_lm_head.*); returns notes."""
    out, notes = Path(out), []
    cast = {k: v.detach().to("cpu", dtype).contiguous() for k, v in heads.state_dict().items()}
    n, layers = heads.num_heads, heads.num_layers
    fd = {}
    for k in range(n):
        for l in range(layers):
            fd[f"{k}.{l}.linear.weight"] = cast[f"heads.{k}.{l}.linear.weight"]
            fd[f"{k}.{l}.linear.bias"] = cast[f"heads.{k}.{l}.linear.bias"]
        if heads.lm_heads is not None:
            fd[f"{k}.{layers}.weight"] = cast[f"lm_heads.{k}.weight"]
    vllm = {f"blocks.{m[1]}.layers.{m[2]}.{m[3]}": v for key, v in fd.items() if (m := BLOCK.match(key))}
    if heads.lm_heads is not None:
        vllm.update({f"lm_heads.{k}.weight": cast[f"lm_heads.{k}.weight"] for k in range(n)})
    else:   # vLLM's Medusa has no access to the target's lm_head: it gets a copy, shared by every head
        vllm["lm_head.weight"] = target.lm_head.weight.detach().to("cpu", dtype).contiguous()
    config = {
        "architectures": ["MedusaModel"], "model_type": "medusa",
        # FasterDecoding's MedusaConfig
        "medusa_num_heads": n, "medusa_num_layers": layers, "base_model_name_or_path": target.name,
        **({} if heads.lm_heads is not None else {"version": "2"}),
        # vLLM's MedusaConfig
        "hidden_size": heads.hidden_size, "vocab_size": target.vocab_size, "truncated_vocab_size": target.vocab_size,
        "num_heads": n, "num_hidden_layers": layers, "medusa_fc_bias": True,
        "original_lm_head": heads.lm_heads is None, "torch_dtype": str(dtype).removeprefix("torch."),
        "eagle_lite": meta,
    }
    write_folder(out, vllm, config)
    shared_blocks = all(torch.equal(fd[f"{k}.{l}.linear.{p}"], fd[f"{k}.0.linear.{p}"])
                        for k in range(n) for l in range(layers) for p in ("weight", "bias"))
    for name in ("medusa_lm_head.safetensors", "medusa_lm_head.pt"):
        (out / name).unlink(missing_ok=True)
    if shared_blocks:
        write_atomic(out / "medusa_lm_head.safetensors", lambda tmp: save_file(fd, tmp, metadata={"format": "pt"}))
        # FasterDecoding's from_pretrained reads only this pickle: torch.save of the same flat dict of tensors
        save_tensor_pickle(fd, out / "medusa_lm_head.pt")
    else:
        notes.append(f"each head has {layers} different ResBlocks; FasterDecoding's Medusa repeats one ResBlock module "
                     f"in a head, so only vLLM's files (model.safetensors) are written")
    notes.append("vLLM's Medusa proposes each head's top-1 token (a chain); eagle_lite's trees use more of each head")
    return notes
