"""The published EAGLE-3 draft layer (SafeAILab/EAGLE `cnets.py` `LlamaDecoderLayeremb`, SpecForge
`LlamaDecoderLayer` of `llama3_eagle.py`, vLLM/SGLang `llama_eagle3.py` `midlayer`).

A Llama decoder layer whose attention reads twice the hidden width: the token's embedding and the fused
feature, each under its own RMSNorm, side by side. The residual stream is the feature alone:

    x   = [input_layernorm(embed); hidden_norm(h)]      # B T 2H, embedding first
    h   = h + o_proj(attention(q_proj(x), k_proj(x), v_proj(x)))
    out = h + mlp(post_attention_layernorm(h))          # B T H, pre-norm: fed back at later draft steps

The projections, rotary embedding and attention are transformers' own `LlamaAttention` (its q/k/v swapped
for 2H-wide ones), so the layer runs on eagle_lite's static KV cache like any other head layer.
"""
from __future__ import annotations

import torch
from torch import nn

from ..kv_cache import with_cache


class Eagle3Layer(nn.Module):
    def __init__(self, config) -> None:
        """config: a LlamaConfig of the head's sizes (hidden_size, heads, head_dim, intermediate_size, eps)."""
        from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRMSNorm

        super().__init__()
        base = LlamaDecoderLayer(config, layer_idx=0)
        attn = base.self_attn
        width = 2 * config.hidden_size
        for name in ("q_proj", "k_proj", "v_proj"):
            old = getattr(attn, name)
            setattr(attn, name, nn.Linear(width, old.out_features, bias=old.bias is not None))
        self.self_attn, self.mlp = attn, base.mlp
        self.hidden_norm = LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.input_layernorm = base.input_layernorm
        self.post_attention_layernorm = base.post_attention_layernorm

    def forward(self, token_embeds: torch.Tensor, hidden: torch.Tensor, attention_mask: torch.Tensor | None,
                position_embeddings: tuple[torch.Tensor, torch.Tensor], cache=None) -> torch.Tensor:
        """token_embeds, hidden: [B, T, H]; attention_mask: [B|1, 1, T, kv_len] bool. Returns [B, T, H]."""
        residual = hidden
        x = torch.cat([self.input_layernorm(token_embeds), self.hidden_norm(hidden)], dim=-1)  # B T 2H
        attn, _ = self.self_attn(hidden_states=x, position_embeddings=position_embeddings,
                                 attention_mask=attention_mask, **with_cache(self.self_attn, cache))
        hidden = residual + attn
        return hidden + self.mlp(self.post_attention_layernorm(hidden))
