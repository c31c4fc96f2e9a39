"""EAGLE-3 heads as the GGUF draft llama.cpp runs (`llama-server -m TARGET.gguf -md DRAFT.gguf --spec-type
draft-eagle3`): architecture "eagle3" (llama.cpp `src/models/eagle3.cpp`, `common/speculative.cpp`).

Written with the `gguf` package; the tensors and metadata are those llama.cpp's own converter writes
(`convert_hf_to_gguf.py --target-model-dir`, `conversion/llama.py`) from the eagle3 folder of the same head:

  fc.weight                 [H, 3H]       fc over the three taps, low, middle, high (no bias)
  blk.0.attn_norm.weight    [H]           input_layernorm: normalises the token embedding
  blk.0.attn_norm_2.weight  [H]           hidden_norm: normalises fc's output
  blk.0.attn_{q,k,v}.weight [., 2H]       q and k rows permuted for llama.cpp's RoPE (as every Llama conversion)
  blk.0.attn_output.weight, blk.0.ffn_{norm,gate,up,down}.weight
  output_norm.weight, output.weight [Vd, H]  the head's own final norm and lm_head
  d2t                       [Vd] int64    the target id of each draft token (absolute, not EAGLE-3's offsets)

  eagle3.target_layers        the taps as llama.cpp reads them: the input of target layer i (eagle_lite's taps,
                              outputs of layer i, + 1); eagle3.target_hidden_size; eagle3.norm_before_residual
                              false and eagle3.norm_before_fc false (the official EAGLE-3 layer)
  eagle3.block_count 1, the layer's sizes (key_length and value_length: head_dim), rope.freq_base,
                              layer_norm_rms_epsilon, vocab_size (the target's)
  tokenizer.*                 copied from the target's GGUF file, so llama.cpp finds draft and target compatible

The draft has no token embedding: llama.cpp takes the target's, as eagle_lite does. What llama.cpp's draft cannot
run is refused with the reason (`unsupported`): an EAGLE-1/2 head, a per-tap norm before fc (EAGLE-3.1's fc_norm:
llama.cpp's norm_before_fc is one norm over the three taps together), a normalised output fed back (llama.cpp feeds
the pre-norm one back), parallel drafting, taps other than three, a tap llama.cpp cannot extract, RoPE scaling.
"""
from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import torch

from ..atomic import write_atomic
from .eagle3 import LAYER_KEYS, getattr_path

ARCH = "eagle3"
# The head's layer keys (eagle3.py LAYER_KEYS) and the tensor names llama.cpp's eagle3 draft loads for them
LAYER_NAMES = {
    "input_layernorm.weight": "blk.0.attn_norm.weight",
    "hidden_norm.weight": "blk.0.attn_norm_2.weight",
    "self_attn.q_proj.weight": "blk.0.attn_q.weight",
    "self_attn.k_proj.weight": "blk.0.attn_k.weight",
    "self_attn.v_proj.weight": "blk.0.attn_v.weight",
    "self_attn.o_proj.weight": "blk.0.attn_output.weight",
    "post_attention_layernorm.weight": "blk.0.ffn_norm.weight",
    "mlp.gate_proj.weight": "blk.0.ffn_gate.weight",
    "mlp.up_proj.weight": "blk.0.ffn_up.weight",
    "mlp.down_proj.weight": "blk.0.ffn_down.weight",
}
# GGML tensor types by torch dtype (llama.cpp's converter: --outtype bf16 / f16 / f32; 1-D norms always F32)
GGML_TYPES = {torch.bfloat16: "BF16", torch.float16: "F16", torch.float32: "F32"}


def file_name(target_name: str) -> str:
    """The draft file's name: llama.cpp looks for a target's EAGLE-3 draft under the prefix "eagle3-". A target named
    by its folder or hub id is named by the last part of it."""
    name = re.sub(r"[^A-Za-z0-9._-]+", "-", Path(str(target_name).rstrip("/")).name).strip("-.") or "target"
    return f"eagle3-{name}.gguf"


def permute(weight: torch.Tensor, heads: int) -> torch.Tensor:
    """q/k rows from Hugging Face's rotate-half RoPE layout to the interleaved pairs llama.cpp's rope
    (LLAMA_ROPE_TYPE_NORM) rotates: within each head, row 2j <- j and 2j+1 <- j + d/2."""
    rows = weight.shape[0]
    return weight.reshape(heads, 2, rows // heads // 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


def unpermute(weight: torch.Tensor, heads: int) -> torch.Tensor:
    """`permute`'s inverse (reading a written file back)."""
    rows = weight.shape[0]
    return weight.reshape(heads, rows // heads // 2, 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


def unsupported(head, target) -> str | None:
    """Why llama.cpp's EAGLE-3 draft cannot run `head` exactly, or None."""
    if head.design != "eagle3":
        what = ("reads its taps through `fuse` into an EAGLE-1 layer" if head.fuse is not None
                else "is an EAGLE-1/2 head (fc over the embedding and the last hidden state)")
        return (f"this head {what}: llama.cpp's only EAGLE draft is EAGLE-3 (fc over three tapped layers, a 2H-wide "
                f"attention, its own norms and lm_head); train experiment=eagle3 for llama.cpp")
    if len(head.feature_layers) != 3:
        return (f"this head reads {len(head.feature_layers)} tapped layers {list(head.feature_layers)}: llama.cpp's "
                f"EAGLE-3 draft reads exactly three")
    if head.fc_norm is not None:
        return ("this head normalises each tapped layer before fc (EAGLE-3.1's fc_norm): llama.cpp's "
                "norm_before_fc is one norm over the three taps together, which computes something else")
    if head.norm_output:
        return ("this head feeds its normalised output back to the next draft step (norm_output): llama.cpp's "
                "EAGLE-3 draft feeds back the output before the final norm")
    if head.parallel:
        return f"this head drafts {head.parallel} tokens a forward (P-EAGLE): llama.cpp's draft has no mask rows"
    if head.fc.bias is not None:
        return "this head's fc has a bias: llama.cpp's EAGLE-3 fc has none"
    keys = {k.removeprefix("layer.") for k in head.state_dict() if k.startswith("layer.")}
    if keys != LAYER_KEYS:
        return f"this head's layer has {sorted(keys ^ LAYER_KEYS)} where llama.cpp's EAGLE-3 layer has not"
    layers = target.config.num_hidden_layers
    if max(head.feature_layers) + 1 >= layers or min(head.feature_layers) < 0:
        return (f"this head taps the outputs of layers {list(head.feature_layers)}: llama.cpp extracts the inputs "
                f"of target layers 0..{layers - 1}, i.e. outputs of layers up to {layers - 2}")
    scaling = getattr(head.config, "rope_scaling", None) or {}
    kind = (getattr(head.config, "rope_parameters", None) or {}).get("rope_type", scaling.get("rope_type", "default"))
    if kind not in (None, "default"):
        return f"this head's RoPE is scaled ({kind}): the export writes plain RoPE only"
    return None


def target_layers(head) -> list[int]:
    """The taps as llama.cpp's eagle3.target_layers names them: the input of target layer i, one above eagle_lite's
    output-of-layer numbering (SmolLM2's 1, 14, 26 are 2, 15, 27, the defaults llama.cpp's converter derives)."""
    return [int(i) + 1 for i in head.feature_layers]


def check_target_gguf(fields: dict, target, path: Path) -> None:
    """Refuse a target GGUF file that is not `target` (its architecture's sizes and vocabulary)."""
    arch = fields.get("general.architecture")
    want = {"block_count": target.config.num_hidden_layers, "embedding_length": target.hidden_size}
    for key, value in want.items():
        got = fields.get(f"{arch}.{key}")
        if got is not None and int(got) != int(value):
            raise ValueError(f"{path} has {arch}.{key} {got}; the target has {value}: give the GGUF file of the "
                             f"target the head was made for")
    tokens = fields.get("tokenizer.ggml.tokens")
    if tokens is None:
        raise ValueError(f"{path} holds no tokenizer (tokenizer.ggml.tokens): give the target's own GGUF file")
    if len(tokens) != target.vocab_size:
        raise ValueError(f"{path} has {len(tokens)} tokens; the target has {target.vocab_size}: give the GGUF file of "
                         f"the target the head was made for")


def tokenizer_fields(path: Path):
    """The tokenizer.* key-value pairs of GGUF file `path`, each (key, value, type, array element type), and all of
    its plain fields as a dict (for `check_target_gguf`)."""
    from gguf import GGUFReader, GGUFValueType

    reader = GGUFReader(str(path))
    plain, copied = {}, []
    for key, field in reader.fields.items():
        if key.startswith("GGUF."):
            continue
        value = field.contents()
        plain[key] = value
        if key.startswith("tokenizer."):
            vtype = GGUFValueType(field.types[0])
            sub = GGUFValueType(field.types[1]) if vtype == GGUFValueType.ARRAY and len(field.types) > 1 else None
            copied.append((key, value, vtype, sub))
    return copied, plain


def draft_tensors(head, dtype: torch.dtype) -> list[tuple[str, np.ndarray, str]]:
    """(name, array, GGML type) of every tensor of the draft file, in llama.cpp's converter's order."""
    from gguf import GGMLQuantizationType
    from gguf.quants import quantize

    cfg = head.config
    heads, kv_heads = cfg.num_attention_heads, getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
    named = {"fc.weight": head.fc.weight, "output_norm.weight": head.norm.weight, "output.weight": head.lm_head.weight}
    for key, name in LAYER_NAMES.items():
        weight = getattr_path(head.layer, key).detach()
        if key == "self_attn.q_proj.weight":
            weight = permute(weight, heads)
        elif key == "self_attn.k_proj.weight":
            weight = permute(weight, kv_heads)
        named[name] = weight
    out = []
    for name in sorted(named, key=tensor_order):
        data = named[name].detach().to("cpu", torch.float32).contiguous().numpy()
        kind = "F32" if data.ndim == 1 else GGML_TYPES[dtype]
        qtype = GGMLQuantizationType[kind]
        out.append((name, data if kind == "F32" else quantize(data, qtype), kind))
    if head.d2t is not None:
        out.append(("d2t", head.d2t.detach().cpu().long().numpy().astype(np.int64), "I64"))
    return out


def tensor_order(name: str) -> tuple[int, str]:
    """The converter's order: the layer's tensors, then fc, output_norm and output (d2t is written last)."""
    return (0 if name.startswith("blk.") else 1, name)


def write_gguf_eagle3(head, target, out: str | Path, meta: dict, dtype: torch.dtype = torch.bfloat16,
                      target_gguf: str | Path | None = None) -> list[str]:
    """Write `head` (an EAGLE-3 DraftHead of `target`) into folder `out` as llama.cpp's EAGLE-3 draft GGUF file
    (`file_name`). target_gguf: the target's GGUF file, whose tokenizer goes into the draft (default: the file
    eagle_lite loaded the target from, if it was one). Returns the notes for the user; raises ValueError (one
    line) where llama.cpp cannot run the head or no target GGUF file is known."""
    from gguf import GGMLQuantizationType, GGUFValueType, GGUFWriter

    from ..targets.loading import gguf_file

    reason = unsupported(head, target)
    if reason is not None:
        raise ValueError(f"{reason}. Not written")
    if dtype not in GGML_TYPES:
        raise ValueError(f"--dtype {dtype}: llama.cpp's draft is written in bfloat16, float16 or float32")
    if target_gguf is None and getattr(target, "spec", None):
        target_gguf = gguf_file(target.spec)          # None where the target came from a folder or hub id
    if target_gguf is None:
        raise ValueError(f"target '{target.name}' was not loaded from a GGUF file: pass --target-gguf FILE, the GGUF "
                         f"file llama.cpp runs the target from (the draft carries its tokenizer)")
    target_gguf = Path(target_gguf)
    if not target_gguf.is_file():
        raise FileNotFoundError(f"--target-gguf {target_gguf}: no such file")
    copied, fields = tokenizer_fields(target_gguf)
    check_target_gguf(fields, target, target_gguf)
    cfg = head.config
    heads = cfg.num_attention_heads
    kv_heads = getattr(cfg, "num_key_value_heads", None) or heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    tensors = draft_tensors(head, dtype)
    path = Path(out) / file_name(target.name)

    def write(tmp: str) -> None:
        w = GGUFWriter(tmp, ARCH)
        w.add_type("model")
        w.add_name(f"eagle_lite EAGLE-3 draft for {target.name}")
        w.add_block_count(1)
        w.add_context_length(int(getattr(cfg, "max_position_embeddings", 4096) or 4096))
        w.add_embedding_length(cfg.hidden_size)
        w.add_feed_forward_length(cfg.intermediate_size)
        w.add_head_count(heads)
        w.add_head_count_kv(kv_heads)
        w.add_rope_freq_base(float(rope_theta(cfg)))
        w.add_layer_norm_rms_eps(float(cfg.rms_norm_eps))
        w.add_file_type({"BF16": 32, "F16": 1, "F32": 0}[GGML_TYPES[dtype]])
        w.add_key_length(head_dim)
        w.add_value_length(head_dim)
        w.add_vocab_size(target.vocab_size)
        w.add_rope_dimension_count(head_dim)
        w.add_key_value(f"{ARCH}.target_layers", target_layers(head), GGUFValueType.ARRAY, GGUFValueType.INT32)
        w.add_uint32(f"{ARCH}.target_hidden_size", target.hidden_size)
        w.add_bool(f"{ARCH}.norm_before_residual", False)
        w.add_bool(f"{ARCH}.norm_before_fc", False)
        for key, value, vtype, sub in copied:
            w.add_key_value(key, value, vtype, sub)
        w.add_quantization_version(2)
        # the head's provenance (target fingerprint, training); llama.cpp ignores keys it does not read
        w.add_string("eagle_lite.record", json.dumps(meta, sort_keys=True))
        for name, data, kind in tensors:
            w.add_tensor(name, data, raw_dtype=GGMLQuantizationType[kind])
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()

    write_atomic(path, write)
    vocab = "the whole vocabulary" if head.d2t is None else f"a draft vocabulary of {head.d2t.numel()} (d2t)"
    return [f"llama.cpp EAGLE-3 draft {path.name}: taps {list(head.feature_layers)} (outputs of layers) written as "
            f"eagle3.target_layers {target_layers(head)} (inputs of layers, llama.cpp's reading); {vocab}; the "
            f"tokenizer of {target_gguf.name}; no embedding (llama.cpp takes the target's)"]


def rope_theta(cfg) -> float:
    params = getattr(cfg, "rope_parameters", None) or {}
    return params.get("rope_theta") or getattr(cfg, "rope_theta", None) or 10000.0


def serving_line(target_gguf: str | Path, draft: str | Path, drafted: int = 3) -> str:
    """The llama-server command that serves the target with this draft (a chain of `drafted` tokens a round)."""
    return (f"llama-server -m {target_gguf} -md {draft} --spec-type draft-eagle3 --spec-draft-n-max {drafted} "
            f"--temp 0")
