"""A Llama-family decoder layer in fewer device operations, for the static step (static/step.py): `StaticLayer`
computes transformers' layer (36 ops in fp32, 44 in bf16) in 13, with q/k/v and gate/up stacked (`qkv`,
`gate_up`), the rotary embedding over q, k and v at once, the residual adds inside `addmm` and keys and values
written in one `index_copy_` (`DeviceKVCache.kv`). Results may differ from the model's layer in the last bits; the
static step keeps it only where a probe agrees within float rounding (`StaticStep._fused_problem`). docs/gpu.md,
"Fewer launches", has the details.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
from transformers.models.llama.modeling_llama import eager_attention_forward


def rms_norm(norm: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """`norm` (a Llama RMSNorm: weight * (x / rms(x)), computed in fp32 and cast back before the weight) of x."""
    if x.dtype == torch.float32:
        return F.rms_norm(x, norm.weight.shape, norm.weight, norm.variance_epsilon)
    return norm.weight * F.rms_norm(x.float(), norm.weight.shape, None, norm.variance_epsilon).to(x.dtype)


def supported(layer: nn.Module) -> bool:
    """Whether `layer` has the parts `StaticLayer` reads (the probe then checks it computes the same thing)."""
    attn, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
    parts = [getattr(attn, n, None) for n in ("q_proj", "k_proj", "v_proj", "o_proj")]
    parts += [getattr(mlp, n, None) for n in ("gate_proj", "up_proj", "down_proj")]
    norms = [getattr(layer, n, None) for n in ("input_layernorm", "post_attention_layernorm")]
    if hasattr(layer, "hidden_norm"):
        norms.append(layer.hidden_norm)
    return (all(isinstance(p, nn.Linear) for p in parts) and callable(getattr(mlp, "act_fn", None))
            and all(supported_norm(n) for n in norms)
            and not any(hasattr(attn, n) for n in ("q_norm", "k_norm", "sinks"))
            and getattr(attn, "sliding_window", None) is None and getattr(attn, "head_dim", None) is not None
            and getattr(attn.config, "attn_logit_softcapping", None) is None)


class StaticLayer:
    """One decoder layer's forward over T tokens [T, H] through the static cache (see the module)."""

    def __init__(self, layer: nn.Module, index: int) -> None:
        attn, mlp = layer.self_attn, layer.mlp
        self.layer, self.index = layer, index
        self.heads = attn.q_proj.out_features // attn.head_dim
        self.kv_heads = attn.k_proj.out_features // attn.head_dim
        self.head_dim = attn.head_dim
        with torch.no_grad():
            self.qkv = torch.cat([attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight]).detach()
            biases = [attn.q_proj.bias, attn.k_proj.bias, attn.v_proj.bias]
            self.qkv_bias = None if all(b is None for b in biases) else torch.cat(
                [b if b is not None else torch.zeros(p.out_features, dtype=self.qkv.dtype, device=self.qkv.device)
                 for b, p in zip(biases, (attn.q_proj, attn.k_proj, attn.v_proj))]).detach()
            self.gate_up = torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight]).detach()
            self.gate_up_bias = None if mlp.gate_proj.bias is None else torch.cat(
                [mlp.gate_proj.bias, mlp.up_proj.bias]).detach()
        self.intermediate = mlp.gate_proj.out_features
        self.eagle3 = isinstance(getattr(layer, "hidden_norm", None), nn.Module)   # heads/eagle3_layer.py
        self.fold = attn.o_proj.bias is None and mlp.down_proj.bias is None    # residual adds inside the products

    def __call__(self, x: torch.Tensor, rotary: tuple[torch.Tensor, torch.Tensor], mask: torch.Tensor,
                 kv: torch.Tensor, slots: torch.Tensor, embeds: torch.Tensor | None = None) -> torch.Tensor:
        """x [T, H]; rotary: (cos', sin') [T, heads + 2 kv heads, D] (`RotaryTables`); kv: this layer's cache
        [1, 2 kv heads, S, D]. Returns the layer's output [T, H]. Attention runs through the function the layer's
        own attention would call (its config's implementation). embeds [T, H]: an EAGLE-3 layer's token
        embeddings, normed beside the normed x as its attention's input (heads/eagle3_layer.py)."""
        layer, t, hq, hk = self.layer, x.shape[0], self.heads, self.kv_heads
        attn, mlp = layer.self_attn, layer.mlp
        attention = ALL_ATTENTION_FUNCTIONS.get_interface(attn.config._attn_implementation, eager_attention_forward)
        if self.eagle3:
            normed = torch.cat([rms_norm(layer.input_layernorm, embeds), rms_norm(layer.hidden_norm, x)], dim=-1)
        else:
            normed = rms_norm(layer.input_layernorm, x)
        qkv = F.linear(normed, self.qkv, self.qkv_bias).view(t, -1, self.head_dim)
        cos, sin = rotary
        qkv = torch.addcmul(qkv * cos, qkv.roll(self.head_dim // 2, dims=-1), sin)
        kv[0].index_copy_(1, slots, qkv[:, hq:].transpose(0, 1))
        out, _ = attention(attn, qkv[:, :hq].transpose(0, 1)[None], kv[:, :hk], kv[:, hk:], mask, dropout=0.0,
                           scaling=attn.scaling)
        out = out.reshape(t, hq * self.head_dim)
        x = torch.addmm(x, out, attn.o_proj.weight.t()) if self.fold else x + attn.o_proj(out)
        gate, up = F.linear(rms_norm(layer.post_attention_layernorm, x), self.gate_up,
                            self.gate_up_bias).split(self.intermediate, dim=-1)
        act = mlp.act_fn(gate) * up
        return torch.addmm(x, act, mlp.down_proj.weight.t()) if self.fold else x + mlp.down_proj(act)


class RotaryTables:
    """(cos', sin') [T, heads + 2 kv heads, D] for a `StaticLayer`, from a model's own rotary embedding, once per
    forward: cos over q and k heads and 1 over v heads; sin with its first half negated and 0 over v heads."""

    def __init__(self, rotary: nn.Module, layer: StaticLayer) -> None:
        d, dev, dtype = layer.head_dim, layer.qkv.device, layer.qkv.dtype
        self.rotary, self.qk = rotary, layer.heads + layer.kv_heads
        self.sign = torch.cat([-torch.ones(d // 2), torch.ones(d - d // 2)]).to(dev, dtype)
        self.v_cos = torch.ones(1, layer.kv_heads, d, dtype=dtype, device=dev)
        self.v_sin = torch.zeros(1, layer.kv_heads, d, dtype=dtype, device=dev)

    def __call__(self, x: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        cos, sin = self.rotary(x[None], positions[None])                      # 1 T D each
        t = positions.numel()
        cos = torch.cat([cos[0, :, None].expand(t, self.qk, -1), self.v_cos.expand(t, -1, -1)], dim=1)
        sin = torch.cat([(sin[0] * self.sign)[:, None].expand(t, self.qk, -1), self.v_sin.expand(t, -1, -1)], dim=1)
        return cos, sin


class StaticStack:
    """The target's decoder (embedding, layers, final norm) as `StaticLayer`s over a `DeviceKVCache`.

    `build` returns None where the decoder is not a plain Llama-family stack; the caller then runs the model."""

    def __init__(self, decoder: nn.Module, taps: tuple[int, ...]) -> None:
        self.decoder, self.taps = decoder, taps
        self.layers = [StaticLayer(layer, i) for i, layer in enumerate(decoder.layers)]
        self.rotary = RotaryTables(decoder.rotary_emb, self.layers[0])

    @classmethod
    def build(cls, decoder: nn.Module, taps: tuple[int, ...]) -> StaticStack | None:
        layers = getattr(decoder, "layers", None)
        if (not layers or not all(supported(layer) for layer in layers)
                or not all(hasattr(decoder, n) for n in ("embed_tokens", "rotary_emb", "norm"))
                or not supported_norm(decoder.norm)):
            return None
        shapes = {(layer.self_attn.head_dim, layer.self_attn.k_proj.out_features) for layer in layers}
        return cls(decoder, taps) if len(shapes) == 1 else None

    def __call__(self, tokens: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor, kv: torch.Tensor,
                 slots: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """(final hidden states [T, H] after the final norm, the tapped layers' outputs [T, H] each)."""
        x = self.decoder.embed_tokens(tokens)
        rotary = self.rotary(x, positions)
        tapped = []
        for layer in self.layers:
            x = layer(x, rotary, mask, kv[layer.index], slots)
            if layer.index in self.taps:
                tapped.append(x)
        return rms_norm(self.decoder.norm, x), tapped


def supported_norm(norm: nn.Module) -> bool:
    """Whether `norm` is a Llama-style RMSNorm `rms_norm` computes: a weight and a float `variance_epsilon`."""
    return isinstance(getattr(norm, "variance_epsilon", None), float) and getattr(norm, "weight", None) is not None
