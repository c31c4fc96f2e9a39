"""EAGLE-1/2 heads in the published layout (SafeAILab/EAGLE `cnets1.py`; vLLM and SGLang `llama_eagle.py`):
config.json (a Llama config, no "bias" key) + model.safetensors or pytorch_model.bin (fc, layers.{i}.*; layer 0
has no input norm; no norm, no lm_head, no embedding), and a reduced draft vocabulary as SGLang's
`hot_token_ids.pt` (one int64 tensor of target ids). fc.bias is always written (zeros where the head has none); a
head whose layer normalises its input is written behind an exact identity layer 0 and read back as one layer.
docs/deploy.md ("Export", "The published layouts") has the file layout and why.
"""
from __future__ import annotations

from pathlib import Path

import torch

from ..heads.checkpoint import check_target, load_weights, recommended_tree, state_tensors, write_folder
from ..heads.draft import DraftHead
from .detect import Layout
from .files import read_pickle, save_tensor_pickle
from .llama import check_sizes, config_fields, head_config

TOKEN_MAP = "hot_token_ids.pt"
ARCHITECTURES = ["LlamaForCausalLMEagle", "LlamaForCausalLM"]   # SGLang's class first; vLLM prefixes "Eagle"
LAYER_KEYS = {"self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight",
              "self_attn.o_proj.weight", "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight",
              "post_attention_layernorm.weight"}
QKV_BIAS = {"self_attn.q_proj.bias", "self_attn.k_proj.bias", "self_attn.v_proj.bias"}


def read_token_map(file: Path, vocab_size: int) -> torch.Tensor:
    """SGLang's hot-token map: the draft vocabulary as target ids [V_draft], int64."""
    ids = read_pickle(file)
    if isinstance(ids, list) and all(isinstance(i, int) for i in ids):
        ids = torch.tensor(ids)
    if not (isinstance(ids, torch.Tensor) and ids.dim() == 1 and not ids.is_floating_point() and ids.numel()):
        raise ValueError(f"{file} holds {type(ids).__name__}: expected a hot-token map, one 1-D tensor of target ids")
    ids = ids.long()
    if int(ids.min()) < 0 or int(ids.max()) >= vocab_size or ids.unique().numel() != ids.numel():
        raise ValueError(f"{file} lists ids outside [0, {vocab_size}) or twice: expected distinct target token ids")
    return ids


def is_identity(tensors: dict[str, torch.Tensor], prefix: str) -> bool:
    """Whether the layer under `prefix` adds nothing to its input: no attention output, no MLP output."""
    return all(f"{prefix}{k}" in tensors and not bool(tensors[f"{prefix}{k}"].any())
               for k in ("self_attn.o_proj.weight", "mlp.down_proj.weight"))


def read_eagle(layout: Layout, target) -> DraftHead:
    """An EAGLE-1/2 head folder as a DraftHead for `target` (no input norm on its layer, fc bias if stored)."""
    config, where, tensors = layout.config, layout.where, dict(layout.tensors)
    check_sizes(config, target, where)
    meta = config.get("eagle_lite") or {}
    if "target" in meta:
        check_target(meta, target, layout.folder)
    cfg = head_config(config, where)
    hidden = cfg.hidden_size
    fc = tensors.get("fc.weight")
    if fc is None or tuple(fc.shape) != (hidden, 2 * hidden):
        found = None if fc is None else list(fc.shape)
        raise ValueError(f"{where}: fc.weight has shape {found}, but config.json says hidden_size {hidden}: expected "
                         f"[{hidden}, {2 * hidden}] (fc maps [embedding; feature] to the hidden size)")
    tensors.pop("embed_tokens.weight", None)    # the target's embedding is used, as every loader does
    layers = sorted({int(k.split(".")[1]) for k in tensors if k.startswith("layers.")})
    count = config.get("num_hidden_layers", len(layers))
    if layers != list(range(count)):
        raise ValueError(f"{where}: config.json says num_hidden_layers={count}, the weights hold layers {layers}")
    if count == 2 and is_identity(tensors, "layers.0.") and "layers.1.input_layernorm.weight" in tensors:
        prefix, input_norm = "layers.1.", True    # eagle_lite's form of a head whose layer normalizes its input
        carried = tensors.get("layers.0.self_attn.o_proj.bias")
        if carried is not None and "fc.bias" not in tensors:
            tensors["fc.bias"] = carried          # the vLLM layout: fc's bias added by the identity layer 0
        tensors = {k: v for k, v in tensors.items() if not k.startswith("layers.0.")}
        o_bias = tensors.pop("layers.1.self_attn.o_proj.bias", None)
        if o_bias is not None and bool(o_bias.any()):
            raise ValueError(f"{where}: layers.1.self_attn.o_proj.bias is not zero: eagle_lite's heads have no "
                             f"attention output bias")
    elif count == 1:
        prefix, input_norm = "layers.0.", False
        if "layers.0.input_layernorm.weight" in tensors:
            raise ValueError(f"{where}: layers.0.input_layernorm.weight is not part of the EAGLE layout: official "
                             f"EAGLE, vLLM and SGLang give layer 0 no input norm and would drop it")
    else:
        raise ValueError(f"{where} has {count} decoder layers: eagle_lite runs one-layer EAGLE heads (or two, the "
                         f"first an exact identity, as eagle_lite exports a layer with an input norm)")
    qkv_bias = bool(config.get("qkv_bias"))
    if not qkv_bias:
        for key in QKV_BIAS:                      # zeros where a layout builds them (the vLLM layout's q/k/v)
            for name in [k for k in tensors if k.startswith(prefix) and k.endswith(key)]:
                if bool(tensors[name].any()):
                    raise ValueError(f"{where}: {name} is not zero but config.json sets no qkv_bias")
                del tensors[name]
    if qkv_bias:
        cfg.attention_bias = True   # transformers' Llama layer then also has an o_proj bias: zero, as the loaders'
    token_map = layout.folder / TOKEN_MAP
    d2t = read_token_map(token_map, target.vocab_size) if token_map.is_file() else None
    if "fc.bias" in tensors and not bool(tensors["fc.bias"].any()):
        del tensors["fc.bias"]    # a zero bias adds nothing: how eagle_lite writes a head without one
    head = DraftHead.for_target(target, d2t, fc_bias="fc.bias" in tensors, input_norm=input_norm, config=cfg)
    state = {k: v for k, v in tensors.items() if k.startswith("fc.")}
    state.update({"layer." + k[len(prefix):]: v for k, v in tensors.items() if k.startswith(prefix)})
    if qkv_bias:
        state["layer.self_attn.o_proj.bias"] = torch.zeros(hidden)
    if d2t is not None:
        state["d2t"] = d2t
    leftover = sorted(k for k in tensors if not (k.startswith("fc.") or k.startswith(prefix)))
    if leftover:
        raise ValueError(f"{where} holds keys the EAGLE layout has no place for: {leftover[:8]}")
    load_state(head, state, layout)
    head.tree = recommended_tree(meta, layout.folder, torch.device(target.device).type)
    return head.to(device=target.device, dtype=target.dtype).eval()


def load_state(head: torch.nn.Module, state: dict[str, torch.Tensor], layout: Layout) -> None:
    """Load with every key accounted for; a shape or name mismatch names the file."""
    load_weights(head, state, f"{layout.where}: the weights in {layout.weights.name}")


def vllm_carries_bias(head: DraftHead) -> bool:
    """Whether vLLM can run this head's fc bias exactly: only through the identity layer 0 of a head whose layer
    normalizes its input (`vllm_bias_layout`)."""
    return head.fc_bias and bool(head.fc.bias.detach().any()) and head.input_norm


def vllm_bias_layout(tensors: dict[str, torch.Tensor], config: dict, qkv_bias: bool) -> None:
    """Move fc.bias onto the identity layer 0's o_proj bias, in place. vLLM's llama_eagle.py builds fc without a
    bias, but its Llama layer builds o_proj with one when config `attention_bias` (or `bias`) is true, and q/k/v
    with one only as `qkv_bias` says. Layer 0 then computes x + (0 @ attn + b) + mlp(..)@0 = x + b: fc's output
    plus its bias, exactly; layer 1's o_proj bias is zero."""
    bias = tensors.pop("fc.bias")
    config["attention_bias"], config["qkv_bias"] = True, qkv_bias
    tensors["layers.0.self_attn.o_proj.bias"] = bias
    tensors["layers.1.self_attn.o_proj.bias"] = torch.zeros_like(bias)


def layer_keys(head: DraftHead) -> set[str]:
    """The head layer's state keys, refused unless they are those of a Llama layer (optionally q/k/v biases)."""
    keys = {k.removeprefix("layer.") for k in head.state_dict() if k.startswith("layer.")}
    extra = keys - LAYER_KEYS - QKV_BIAS - {"input_layernorm.weight"}
    if extra or not LAYER_KEYS <= keys:
        raise ValueError(f"this head's decoder layer ({type(head.layer).__name__}) has {sorted(extra or keys)}: the "
                         f"published EAGLE layout is a Llama layer (q/k/v/o, gate/up/down, RMSNorms; q/k/v biases "
                         f"at most), so it cannot be exported as one")
    return keys


def write_eagle(head: DraftHead, target, out: str | Path, meta: dict, dtype: torch.dtype = torch.bfloat16,
                engine: str = "all") -> list[str]:
    """Write `head` as an EAGLE-1/2 folder that official EAGLE, vLLM and SGLang load; returns notes for the user
    (what a loader does differently with it). meta: eagle_lite's own record (target fingerprint, tree, training).
    engine "vllm": the layout only vLLM reads, which carries a head's fc bias exactly (`vllm_bias_layout`)."""
    if head.design == "eagle3":
        raise ValueError("this is an EAGLE-3 head (fc over the target's tapped layers, its own norm and lm_head): "
                         "export it with --format eagle3")
    if head.parallel:
        raise ValueError(f"this head drafts {head.parallel} tokens in one forward (P-EAGLE): the layout vLLM reads "
                         f"for parallel drafting is EAGLE-3's (train it with experiment=cpu_parallel)")
    if head.fuse is not None:
        raise ValueError("this head reads the target's tapped layers through `fuse` (eagle_lite's earlier EAGLE-3 "
                         "variant): no EAGLE-1 loader feeds a head anything but the last hidden state, and no EAGLE-3 "
                         "loader has fuse; retrain it with experiment=eagle3 for the published EAGLE-3 design")
    keys = layer_keys(head)
    layer = {k.removeprefix("layer."): v for k, v in state_tensors(head, dtype).items() if k.startswith("layer.")}
    qkv_bias = bool(keys & QKV_BIAS)
    o_bias = layer.pop("self_attn.o_proj.bias", None)
    if o_bias is not None and bool(o_bias.any()):
        raise ValueError("this head's o_proj has a bias, which no published EAGLE-1 loader builds")
    notes = []
    tensors = {"fc.weight": head.fc.weight.detach().to("cpu", dtype).contiguous(),
               "fc.bias": (head.fc.bias.detach().to("cpu", dtype).contiguous() if head.fc_bias
                           else torch.zeros(head.fc.out_features, dtype=dtype))}
    if head.input_norm:
        tensors.update({f"layers.0.{k}": (torch.ones_like(v) if k.endswith("layernorm.weight") else torch.zeros_like(v))
                        for k, v in layer.items() if k != "input_layernorm.weight"})
        tensors.update({f"layers.1.{k}": v for k, v in layer.items()})
        layers = 2
        notes.append("this head's decoder layer normalizes its input (it was trained so), which layer 0 of a "
                     "published EAGLE head never does: it is written as layer 1 behind an exact identity layer 0 "
                     "(zero o_proj and down_proj). Official EAGLE and SGLang build num_hidden_layers layers and load "
                     "it exactly; the draft runs one extra (zero) layer. vLLM builds that many layers too, but some "
                     "versions' EAGLE proposer accepts only one draft attention layer")
    else:
        tensors.update({f"layers.0.{k}": v for k, v in layer.items()})
        layers = 1
    config = {"architectures": ARCHITECTURES, **config_fields(head.config, target.vocab_size, dtype),
              "num_hidden_layers": layers, **({"qkv_bias": True} if qkv_bias else {}), "eagle_lite": meta}
    if engine == "vllm" and vllm_carries_bias(head):
        vllm_bias_layout(tensors, config, qkv_bias)
        notes.append("written for vLLM only: fc's bias rides on the identity layer 0 as its o_proj bias "
                     "(attention_bias true, qkv_bias false), which vLLM builds and loads; official EAGLE and SGLang "
                     "read this folder differently: export with --engine official or sglang for them")
    if qkv_bias:
        notes.append("q/k/v have biases (config qkv_bias: official EAGLE and vLLM build them); SGLang's Llama layer "
                     "reads only attention_bias and drops them")
    out = Path(out)
    write_folder(out, tensors, config)
    (out / TOKEN_MAP).unlink(missing_ok=True)
    if head.d2t is not None:
        save_tensor_pickle(head.d2t.detach().to("cpu", torch.long).contiguous(), out / TOKEN_MAP)
        notes.append(f"the head drafts over {head.d2t.numel()} of {target.vocab_size} tokens: written as SGLang's "
                     f"hot-token map {TOKEN_MAP} (--speculative-token-map {out / TOKEN_MAP}); vLLM and the official "
                     f"EAGLE code have no such map and draft over the full vocabulary with this head")
    return notes
