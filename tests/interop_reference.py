"""Reference forwards of the published heads, written from their descriptions (shared/INTEROP.md: SafeAILab/EAGLE
`cnets1.py` and `cnets.py`, FasterDecoding/Medusa `medusa_model.py`) in plain torch, and the folders those
projects write, built here from tensors. Nothing here uses eagle_lite's head or transformers' layers.

Shapes: T tokens, H hidden, nH/nKV heads, d head_dim, I intermediate, V vocab, Vd draft vocab.
"""
from __future__ import annotations

import json
import math
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import save_file


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def rope(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """x: [heads, T, d] rotated by RoPE (the rotate-half form of Llama)."""
    d = x.shape[-1]
    inv_freq = 1.0 / theta ** (torch.arange(0, d, 2, dtype=torch.float32) / d)
    freqs = positions.float()[:, None] * inv_freq[None]          # T d/2
    emb = torch.cat([freqs, freqs], dim=-1)                      # T d
    half = torch.cat([-x[..., d // 2:], x[..., :d // 2]], dim=-1)
    return x * emb.cos() + half * emb.sin()


def attention(x: torch.Tensor, w: dict, prefix: str, cfg: dict, positions: torch.Tensor) -> torch.Tensor:
    """Causal GQA self-attention of x [T, in] with weights `{prefix}{q,k,v,o}_proj.weight` -> [T, H]."""
    nh, nkv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    d = cfg.get("head_dim") or cfg["hidden_size"] // nh
    t = x.shape[0]

    def proj(name, heads):
        out = x @ w[f"{prefix}{name}_proj.weight"].T
        if f"{prefix}{name}_proj.bias" in w:
            out = out + w[f"{prefix}{name}_proj.bias"]
        return out.view(t, heads, d).transpose(0, 1)              # heads T d

    q = rope(proj("q", nh), positions, cfg["rope_theta"])
    k = rope(proj("k", nkv), positions, cfg["rope_theta"]).repeat_interleave(nh // nkv, dim=0)
    v = proj("v", nkv).repeat_interleave(nh // nkv, dim=0)
    scores = q @ k.transpose(1, 2) / math.sqrt(d)                 # nH T T
    scores = scores.masked_fill(~torch.ones(t, t, dtype=torch.bool).tril(), float("-inf"))
    out = (scores.softmax(-1) @ v).transpose(0, 1).reshape(t, nh * d) @ w[f"{prefix}o_proj.weight"].T
    if f"{prefix}o_proj.bias" in w:     # vLLM's Llama layer builds one when config attention_bias is true
        out = out + w[f"{prefix}o_proj.bias"]
    return out


def mlp(x: torch.Tensor, w: dict, prefix: str) -> torch.Tensor:
    return (F.silu(x @ w[f"{prefix}gate_proj.weight"].T) * (x @ w[f"{prefix}up_proj.weight"].T)) @ \
        w[f"{prefix}down_proj.weight"].T


def eagle1_forward(w: dict, cfg: dict, embeds: torch.Tensor, hidden: torch.Tensor,
                   positions: torch.Tensor) -> torch.Tensor:
    """cnets1: fc([embed; feature]) -> layers (layer 0 without an input norm) -> un-normalized output [T, H]."""
    eps = cfg["rms_norm_eps"]
    x = torch.cat([embeds, hidden], dim=-1) @ w["fc.weight"].T
    if "fc.bias" in w:
        x = x + w["fc.bias"]
    for i in range(cfg["num_hidden_layers"]):
        p = f"layers.{i}."
        h = x if i == 0 else rms_norm(x, w[p + "input_layernorm.weight"], eps)
        x = x + attention(h, w, p + "self_attn.", cfg, positions)
        x = x + mlp(rms_norm(x, w[p + "post_attention_layernorm.weight"], eps), w, p + "mlp.")
    return x


def eagle3_forward(w: dict, cfg: dict, embeds: torch.Tensor, hidden: torch.Tensor,
                   positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """cnets.py: h = fc([low; mid; high]) (skipped when hidden is already H wide); attention over
    [input_layernorm(embed); hidden_norm(h)]; returns (pre-norm output [T, H], draft logits [T, Vd])."""
    eps = cfg["rms_norm_eps"]
    h = hidden if hidden.shape[-1] == cfg["hidden_size"] else hidden @ w["fc.weight"].T
    x = torch.cat([rms_norm(embeds, w["midlayer.input_layernorm.weight"], eps),
                   rms_norm(h, w["midlayer.hidden_norm.weight"], eps)], dim=-1)          # T 2H
    h = h + attention(x, w, "midlayer.self_attn.", cfg, positions)
    out = h + mlp(rms_norm(h, w["midlayer.post_attention_layernorm.weight"], eps), w, "midlayer.mlp.")
    return out, rms_norm(out, w["norm.weight"], eps) @ w["lm_head.weight"].T


def medusa_logits(w: dict, hidden: torch.Tensor, num_heads: int, num_layers: int,
                  base_lm_head: torch.Tensor) -> torch.Tensor:
    """medusa_model.py: head k = ResBlocks x + SiLU(W x + b), then its own projection {k}.{L}.weight (v1) or the
    base lm_head (version 2). hidden [T, H] -> [K, T, V]."""
    out = []
    for k in range(num_heads):
        x = hidden
        for l in range(num_layers):
            x = x + F.silu(x @ w[f"{k}.{l}.linear.weight"].T + w[f"{k}.{l}.linear.bias"])
        out.append(x @ w.get(f"{k}.{num_layers}.weight", base_lm_head).T)
    return torch.stack(out)


# -- folders in the published layouts ---------------------------------------------------------------------------
def llama_config(hidden: int, vocab: int, heads: int = 4, kv_heads: int = 2, layers: int = 1, **extra) -> dict:
    """A plain HF Llama config as the published heads carry it."""
    return {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": hidden,
            "intermediate_size": 2 * hidden, "num_attention_heads": heads, "num_key_value_heads": kv_heads,
            "num_hidden_layers": layers, "hidden_act": "silu", "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
            "max_position_embeddings": 512, "vocab_size": vocab, "torch_dtype": "float32", **extra}


def random_layer(g: torch.Generator, prefix: str, cfg: dict, in_width: int, input_norm: bool = True,
                 qkv_bias: bool = False) -> dict:
    h, i = cfg["hidden_size"], cfg["intermediate_size"]
    nh, nkv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    d = h // nh

    def rand(*shape, scale=0.2):
        return torch.randn(*shape, generator=g) * scale

    w = {f"{prefix}self_attn.q_proj.weight": rand(nh * d, in_width),
         f"{prefix}self_attn.k_proj.weight": rand(nkv * d, in_width),
         f"{prefix}self_attn.v_proj.weight": rand(nkv * d, in_width),
         f"{prefix}self_attn.o_proj.weight": rand(h, nh * d),
         f"{prefix}mlp.gate_proj.weight": rand(i, h), f"{prefix}mlp.up_proj.weight": rand(i, h),
         f"{prefix}mlp.down_proj.weight": rand(h, i),
         f"{prefix}post_attention_layernorm.weight": 1 + rand(h, scale=0.1)}
    if input_norm:
        w[f"{prefix}input_layernorm.weight"] = 1 + rand(h, scale=0.1)
    if qkv_bias:
        w.update({f"{prefix}self_attn.{n}_proj.bias": rand(w[f"{prefix}self_attn.{n}_proj.weight"].shape[0])
                  for n in "qkv"})
    return w


def write(folder: Path, config: dict, tensors: dict, file: str = "model.safetensors") -> Path:
    """config.json and the weights, as safetensors or (file ending .bin / .pt) a torch pickle."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config))
    tensors = {k: v.contiguous() for k, v in tensors.items()}
    if file.endswith(".safetensors"):
        save_file(tensors, folder / file)
    else:
        torch.save(tensors, folder / file)
    return folder
