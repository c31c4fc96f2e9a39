"""Decoder layers run as one native op each (csrc/decoder_layer.cpp) for few-token forwards on CPU.

transformers' Llama decoder layer is ~125 torch ops: the norms, the projections, the views and splits, the
rotary embedding's cat/neg/mul/add, the cache write, the residual adds. In a one-token SmolLM2 forward on
a CPU the projections (4-bit grid codes, grid_linear.py) are under half of the time: the rest is op
dispatch and Python. Where a layer's projections all run from grid codes and its norms from the
native kernel, `fuse_decoder_layers` gives it an instance `forward` that runs the whole layer as
`torch.ops.eagle_lite.decoder_layer`: the same fp32 arithmetic (the rotary and residual adds to the bit,
the products, norms and attention as the native kernels compute them) in one call.

The model class stays in charge: transformers' `LlamaModel.forward` embeds, builds the mask and the
rotary cos/sin and calls each layer; only the layer's body changes. A layer is fused only after it
computed the same output and the same cache keys/values as its own forward on a probe (a short prefix,
then a small tree), so an architecture that differs (biases, Qwen 3's q/k norms, another rotary layout, another
activation) keeps its own forward. Calls the op cannot take (a batch, more than `MAX_FUSED_ROWS` tokens,
another cache class, gradients) run the layer's own forward.

A Gemma 3 layer (q/k norms, a norm on the attention's and the MLP's outputs before their residual adds, GELU-tanh,
its own rotary per layer type: sliding or full attention) runs as the same op with those norms (`extra_norms`) and
`act=1`; a sliding layer's mask hides the keys past its window (`tree.windowed`), a full layer's sees the whole prefix.

An EAGLE-3 draft layer (heads/eagle3_layer.py: its attention reads [input_layernorm(embeds); hidden_norm(h)], 2H
wide, the residual stream being h) runs as the same op, given the token embeddings beside h.

Where every layer of a stack is fused, `fuse_stack` goes one step further for `Target.forward`: a
`FusedStack` runs the model's few-token forward itself (embed, cos/sin, the layers' ops, final norm), the
same ops in the same order as `LlamaModel.forward` without its Python around them (decorators, mask
building, the layer slice and calls: a tenth or so of a one-token SmolLM2 forward); its cos/sin are the rotary
module's own rows, gathered from a table of positions (rotary_table.py). It too is taken only after
it gave the model's own output on a probe; anything else goes through the model.
"""
from __future__ import annotations

import functools
from collections.abc import Iterable

import torch
from torch import nn

from ..kv_cache import StaticKVCache, with_cache
from ..tree import attention_mask, windowed
from .grid_linear import MAX_GRID_ROWS, Grid4, Grid8, GridK, GridWeight
from .instance_forward import class_forwards
from .native import kernel_available
from .rotary_table import RotaryTable

MAX_FUSED_ROWS = MAX_GRID_ROWS   # past this many tokens (a prompt's prefill) the layer's own forward is as fast
GELU_TANH = ("GELUTanh", "PytorchGELUTanh")   # transformers' gelu_pytorch_tanh: the op's act=1


def _grid(linear: nn.Module, siblings: tuple[str, ...], parent: nn.Module) -> GridWeight | None:
    """The grid codes `linear` runs from: its own product, or the product it shares with `siblings`
    (in that order, all of them, no bias)."""
    if len(siblings) > 1:
        group = getattr(linear, "sibling_product", None)
        members = [getattr(parent, name, None) for name in siblings]
        if group is None or any(getattr(m, "sibling_product", None) is not group for m in members):
            return None
        product, bias = group.product, group.bias
    else:
        product, bias = getattr(linear, "cpu_product", None), getattr(linear, "bias", None)
    grid = getattr(product, "grid", None)
    return grid if isinstance(grid, (Grid4, Grid8, GridK)) and bias is None else None


def _sandwich(layer: nn.Module) -> bool:
    """Whether `layer` has Gemma 2/3's norms before the MLP and after the attention and the MLP."""
    return getattr(layer, "pre_feedforward_layernorm", None) is not None


def _wide(layer: nn.Module) -> bool:
    """Whether `layer` is an EAGLE-3 draft layer: its attention reads the token embeddings beside the hidden state."""
    return getattr(layer, "hidden_norm", None) is not None


class _LayerParts:
    """What the op reads of one layer: norm weights and eps, grid codes/scales of qkv, o, gate_up, down (and an
    EAGLE-3 layer's norm of the token embeddings, `wide`)."""

    def __init__(self, layer: nn.Module) -> None:
        attn, mlp = layer.self_attn, layer.mlp
        self.index = attn.layer_idx
        self.layer_type = _layer_type(layer)
        self.window = getattr(attn, "sliding_window", None)   # a sliding layer's window (Gemma 3), else None
        self.heads = attn.q_proj.out_features // attn.head_dim
        self.scale = float(attn.scaling)
        self.wide = _wide(layer)
        gemma = _sandwich(layer)
        norms = (layer.hidden_norm if self.wide else layer.input_layernorm,
                 layer.pre_feedforward_layernorm if gemma else layer.post_attention_layernorm)
        self.norms = [n.fused_weight.detach() for n in norms]
        self.eps = [float(n.fused_eps) for n in norms]
        extra = (attn.q_norm, attn.k_norm, layer.post_attention_layernorm, layer.post_feedforward_layernorm) if gemma \
            else ()
        self.extra = torch.cat([n.fused_weight.detach() for n in extra]) if gemma else None   # one eps: _structured
        self.extra_eps = float(attn.q_norm.fused_eps) if gemma else 0.0
        self.act = int(type(mlp.act_fn).__name__ in GELU_TANH)
        self.embed_norm = layer.input_layernorm.fused_weight.detach() if self.wide else None
        self.embed_eps = float(layer.input_layernorm.fused_eps) if self.wide else 0.0
        grids = [_grid(attn.q_proj, ("q_proj", "k_proj", "v_proj"), attn), _grid(attn.o_proj, ("o_proj",), attn),
                 _grid(mlp.gate_proj, ("gate_proj", "up_proj"), mlp), _grid(mlp.down_proj, ("down_proj",), mlp)]
        self.complete = all(g is not None for g in grids)
        self._kv: tuple = (None, None, None)   # (cache.keys, this layer's key view, value view)
        self.codes = [g.codes for g in grids] if self.complete else []
        self.scales = [g.scales for g in grids] if self.complete else []

    def __call__(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache: StaticKVCache,
                 mask: torch.Tensor | None, embeds: torch.Tensor | None = None) -> torch.Tensor:
        """x [T, hidden]; cos/sin [T, head_dim]; mask [T, length + T] bool or None (causal); embeds [T, hidden]:
        the token embeddings a `wide` layer reads (None for the others)."""
        if self._kv[0] is not cache.keys:      # views of this layer's slots, made once per cache
            self._kv = (cache.keys, cache.keys[self.index, 0], cache.values[self.index, 0])
        return torch.ops.eagle_lite.decoder_layer(
            x, cos, sin, self._kv[1], self._kv[2], cache.length, mask,
            self.norms[0], self.norms[1], self.eps[0], self.eps[1], self.codes, self.scales, self.heads, self.scale,
            embeds, self.embed_norm, self.embed_eps, 0, self.extra, self.extra_eps, self.act)


    def packed(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, caches: list[StaticKVCache],
               rows: list[int], masks: list[torch.Tensor], embeds: torch.Tensor | None = None,
               skips: list[int] | None = None) -> torch.Tensor:
        """Several sequences' rows packed in x [T, hidden] (`FusedStack.packed`): sequence i's rows[i] rows write
        into and attend over caches[i] under masks[i] [rows[i], length_i + rows[i]]; embeds as `__call__`.
        skips: the first skips[i] rows of sequence i only write their keys and values (a draft head's catch-up,
        whose outputs no one reads); the result holds the other rows alone [sum(rows) - sum(skips), hidden]."""
        return torch.ops.eagle_lite.decoder_layer_packed(
            x, cos, sin, [c.keys[self.index, 0] for c in caches], [c.values[self.index, 0] for c in caches],
            [c.length for c in caches], rows, masks, self.norms[0], self.norms[1], self.eps[0], self.eps[1],
            self.codes, self.scales, self.heads, self.scale, embeds, self.embed_norm, self.embed_eps, skips,
            self.extra, self.extra_eps, self.act)


def _layer_type(layer: nn.Module) -> str | None:
    """The layer's type where its model's rotary differs by type (Gemma 3: sliding or full attention), else None."""
    return getattr(layer.self_attn, "layer_type", None)


def _rotary_for(rotary: nn.Module, layer: nn.Module):
    """`rotary` as `layer` calls it: rotary(x, position_ids), its layer type given where the module takes one."""
    kind = _layer_type(layer)
    return functools.partial(rotary, layer_type=kind) if kind and isinstance(getattr(rotary, "rope_type", None),
                                                                          dict) else rotary


def _structured(layer: nn.Module) -> bool:
    """Whether `layer` has the Llama layout the op computes (the probe then checks the arithmetic)."""
    attn, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
    if attn is None or mlp is None:
        return False
    names = [(attn, "q_proj"), (attn, "k_proj"), (attn, "v_proj"), (attn, "o_proj"),
             (mlp, "gate_proj"), (mlp, "up_proj"), (mlp, "down_proj")]
    norms = [getattr(layer, n, None) for n in ("input_layernorm", "post_attention_layernorm")
             + (("hidden_norm",) if _wide(layer) else ())]
    if _sandwich(layer):   # Gemma 3: q/k norms, every norm of one eps, attention scores not soft-capped
        norms += [layer.pre_feedforward_layernorm, getattr(layer, "post_feedforward_layernorm", None),
                  getattr(attn, "q_norm", None), getattr(attn, "k_norm", None)]
        if getattr(attn, "attn_logit_softcapping", None) is not None or len({getattr(n, "fused_eps", None)
                                                                                for n in norms[-4:]}) != 1:
            return False
    return (all(isinstance(getattr(m, n, None), nn.Linear) for m, n in names)
            and all(n is not None and getattr(n, "fused_eps", None) is not None for n in norms)
            and type(getattr(mlp, "act_fn", None)).__name__ in ("SiLU", "SiLUActivation") + GELU_TANH
            and isinstance(getattr(attn, "layer_idx", None), int)
            and isinstance(getattr(attn, "head_dim", None), int) and isinstance(getattr(attn, "scaling", None), float)
            and "forward" not in layer.__dict__)


# What every layer of one forward reads the same way, prepared by the first: the model passes each layer the same
# position_embeddings and mask objects. ((position_embeddings, mask), (cos [T, D], sin [T, D], mask [T, S] or None))
_SHARED: list = [(None, None), None]


def _shared(position_embeddings: tuple[torch.Tensor, torch.Tensor], mask: torch.Tensor | None, t: int) -> tuple:
    seen = _SHARED[0]
    if seen[0] is not position_embeddings or seen[1] is not mask:
        cos, sin = position_embeddings
        _SHARED[0] = (position_embeddings, mask)
        _SHARED[1] = (cos.reshape(t, -1).contiguous(), sin.reshape(t, -1).contiguous(),
                      None if mask is None else mask[0, 0])
    return _SHARED[1]


def _fused_forward(layer: nn.Module, hidden_states: torch.Tensor, attention_mask: torch.Tensor | None = None,
                   position_ids: torch.Tensor | None = None, cache=None, use_cache: bool | None = False,
                   position_embeddings: tuple[torch.Tensor, torch.Tensor] | None = None, past_key_values=None,
                   **kwargs) -> torch.Tensor:
    """The layer's forward, by the fused op where it applies. The KV cache comes as `cache` (transformers
    >= 5.24) or `past_key_values` (before) and goes on to the layer's own forward under the name it takes."""
    cache = cache if cache is not None else past_key_values
    if not _fits(hidden_states, cache, position_embeddings, attention_mask):
        return type(layer).forward(layer, hidden_states, attention_mask=attention_mask, position_ids=position_ids,
                                   use_cache=use_cache, position_embeddings=position_embeddings,
                                   **with_cache(layer, cache), **kwargs)
    cos, sin, visible = _shared(position_embeddings, attention_mask, hidden_states.shape[1])
    return layer.fused_parts(hidden_states[0].contiguous(), cos, sin, cache, visible)[None]


def _fused_wide_forward(layer: nn.Module, token_embeds: torch.Tensor, hidden: torch.Tensor,
                        attention_mask: torch.Tensor | None, position_embeddings: tuple[torch.Tensor, torch.Tensor],
                        cache=None) -> torch.Tensor:
    """An EAGLE-3 layer's forward (`Eagle3Layer.forward`'s arguments), by the fused op where it applies."""
    if not (_fits(hidden, cache, position_embeddings, attention_mask) and token_embeds.shape == hidden.shape
            and token_embeds.dtype == hidden.dtype):
        return type(layer).forward(layer, token_embeds, hidden, attention_mask, position_embeddings, cache)
    cos, sin, visible = _shared(position_embeddings, attention_mask, hidden.shape[1])
    return layer.fused_parts(hidden[0].contiguous(), cos, sin, cache, visible, token_embeds[0].contiguous())[None]


def _fits(x: torch.Tensor, cache, position_embeddings, mask: torch.Tensor | None) -> bool:
    """Whether the op takes this call: one sequence of a few fp32 rows [1, T, hidden] over a StaticKVCache that
    reserved them, without gradients, under no mask (causal) or a bool [1, 1, T, length + T] one."""
    t = x.shape[1] if x.dim() == 3 else 0
    return (x.dim() == 3 and x.shape[0] == 1 and 0 < t <= MAX_FUSED_ROWS
            and x.dtype == torch.float32 and not torch.is_grad_enabled()
            and isinstance(cache, StaticKVCache) and cache.pending == t and position_embeddings is not None
            and (mask is None or (mask.dtype == torch.bool and mask.dim() == 4
                                  and tuple(mask.shape) == (1, 1, t, cache.length + t))))


def _agrees(layer: nn.Module, parts: _LayerParts, rotary: nn.Module) -> bool:
    """Whether the op gives the layer's own output and cache entries on a probe: 3 tokens after a
    2-token prefix, then a 3-node tree (root, two children), to float32 rounding."""
    hidden = parts.norms[0].numel()
    kv_heads = layer.self_attn.k_proj.out_features // layer.self_attn.head_dim
    cache = StaticKVCache(parts.index + 1, kv_heads, layer.self_attn.head_dim, 8)
    x = (torch.linspace(-3.0, 3.0, 5 * hidden).view(1, 5, hidden).sin()
         * torch.linspace(0.5, 4.0, 5)[None, :, None])
    embeds = torch.linspace(-2.0, 2.0, 5 * hidden).view(1, 5, hidden).cos()   # a wide layer's token embeddings
    tree = torch.tensor([[1, 0, 0], [1, 1, 0], [1, 0, 1]], dtype=torch.bool)

    def call(forward, rows: slice, mask, positions, cos_sin):
        if parts.wide:
            return forward(layer, embeds[:, rows], x[:, rows], mask, cos_sin, cache)
        return forward(layer, x[:, rows], attention_mask=mask, position_ids=positions, use_cache=True,
                       position_embeddings=cos_sin, **with_cache(layer, cache))

    def run(forward):
        cache.truncate(0)
        outs = []
        for rows, positions, visible in ((slice(0, 2), torch.arange(2), None), (slice(2, 5), torch.tensor([2, 3, 3]),
                                                                                tree)):
            n = positions.numel()
            cache.reserve(n)
            mask = None if visible is None else attention_mask(cache.length, visible)
            cos_sin = rotary(x[:, rows], positions.view(1, n))
            outs.append(call(forward, rows, mask, positions.view(1, n), cos_sin))
            cache.commit(n)
        kv = (cache.keys[parts.index, 0, :, :5].clone(), cache.values[parts.index, 0, :, :5].clone())
        return torch.cat(outs, dim=1), kv

    try:
        with torch.inference_mode():
            own, own_kv = run(type(layer).forward)
            fused, fused_kv = run(_fused_wide_forward if parts.wide else _fused_forward)
    except (RuntimeError, TypeError, ValueError, AttributeError):
        return False
    scale = float(own.abs().max())
    return (bool(torch.isfinite(own).all()) and torch.allclose(fused, own, rtol=1e-4, atol=1e-5 * scale)
            and all(torch.allclose(a, b, rtol=1e-4, atol=1e-5 * float(b.abs().max() + 1))
                    for a, b in zip(fused_kv, own_kv)))


def fuse_decoder_layers(layers: Iterable[nn.Module], rotary: nn.Module | None) -> int:
    """Run each of `layers` (decoder layers, or EAGLE-3 draft layers, whose linears run from grid codes and whose
    norms are native: cpu_linear.pack_linears, fused_norm.fuse_rms_norms) as one native op where it computes the
    same thing; `rotary` is the module that makes their cos/sin. Returns how many."""
    if rotary is None or not kernel_available():
        return 0
    fused = 0
    for layer in layers:
        if not _structured(layer):
            continue
        parts = _LayerParts(layer)
        if not parts.complete:
            continue
        layer.fused_parts = parts
        if not _agrees(layer, parts, _rotary_for(rotary, layer)):
            del layer.fused_parts
            continue
        layer.forward = functools.partial(_fused_wide_forward if parts.wide else _fused_forward, layer)
        fused += 1
    return fused


def running_fused(layer: nn.Module) -> _LayerParts | None:
    """The op's parts of `layer` while it runs as one op (fused, and not inside `unfused_layers`); else None."""
    return getattr(layer, "fused_parts", None) if "forward" in layer.__dict__ else None


def unfused_layers(module: nn.Module):
    """A context: run a block with the library's own forward on the fused layers, then fuse them again."""
    return class_forwards(m for m in module.modules() if hasattr(m, "fused_parts"))


class FusedStack:
    """A decoder stack whose layers are all fused, run as embed -> rotary cos/sin -> each layer's op -> final
    norm for few-token forwards over a `StaticKVCache` (what `LlamaModel.forward` does for them, minus its
    Python); `Target.forward` calls it where `takes` says so and the model otherwise."""

    def __init__(self, decoder: nn.Module) -> None:
        self.embed, self.norm = decoder.embed_tokens, decoder.norm
        self.parts = [layer.fused_parts for layer in decoder.layers]
        per_type = isinstance(getattr(decoder.rotary_emb, "rope_type", None), dict)
        self.kinds = [p.layer_type if per_type else None for p in self.parts]
        self.rotary = {kind: RotaryTable(decoder.rotary_emb, kind) for kind in dict.fromkeys(self.kinds)}

    def _cos_sin(self, x: torch.Tensor, positions: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Each layer's (cos, sin), [T, D] each: one gather per rotary table (one per layer type)."""
        rows = {kind: table(x, positions) for kind, table in self.rotary.items()}
        return [rows[kind] for kind in self.kinds]

    def takes(self, t: int, cache) -> bool:
        return (0 < t <= MAX_FUSED_ROWS and isinstance(cache, StaticKVCache) and cache.pending == t
                and not torch.is_grad_enabled())

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor, cache: StaticKVCache,
                 visible: torch.Tensor | None, taps: tuple[int, ...] = ()):
        """input_ids, positions: [T]; visible: [T, cache.length + T] bool, or None for a causal chain.
        Returns the final hidden states [T, H]; the T keys/values are written after the committed slots.
        taps: decoder layers whose outputs are also returned, concatenated: (hidden [T, H], taps [T, len*H])."""
        x = self.embed(input_ids)                                  # T H
        tapped = {}
        masks = {None: visible}   # by window: a sliding layer's mask hides the keys past its window
        for i, (parts, (cos, sin)) in enumerate(zip(self.parts, self._cos_sin(x, positions))):
            if parts.window not in masks:
                masks[parts.window] = windowed(visible, cache.length, positions, parts.window)
            x = parts(x, cos, sin, cache, masks[parts.window])
            if i in taps:
                tapped[i] = x
        return (self.norm(x), torch.cat([tapped[i] for i in taps], dim=-1)) if taps else self.norm(x)


    def takes_packed(self, t: int, caches: list) -> bool:
        """Whether `packed` runs these: few rows in all, over StaticKVCaches that reserved their rows."""
        return (0 < t <= MAX_FUSED_ROWS and all(isinstance(c, StaticKVCache) and c.pending > 0 for c in caches)
                and not torch.is_grad_enabled())

    def packed(self, input_ids: torch.Tensor, positions: torch.Tensor, caches: list[StaticKVCache],
               visible: list[torch.Tensor], taps: tuple[int, ...] = ()):
        """Several sequences' new tokens in one forward (`Target.verify`): input_ids, positions [T] (sequence i's
        caches[i].pending rows in turn), visible[i] [n_i, length_i + n_i] bool. Each sequence's rows get what
        `__call__` gives them on their own cache (the layer op's arithmetic is row by row), the weights are read
        once for all rows. Returns hidden [T, H] (with taps: (hidden, taps [T, len*H]))."""
        rows = [c.pending for c in caches]
        masks = {None: [v.contiguous() for v in visible]}   # by window, as `__call__`
        x = self.embed(input_ids)                                  # T H
        tapped = {}
        for i, (parts, (cos, sin)) in enumerate(zip(self.parts, self._cos_sin(x, positions))):
            if parts.window not in masks:
                masks[parts.window] = [windowed(v, c.length, p, parts.window).contiguous()
                                       for v, c, p in zip(visible, caches, positions.split(rows))]
            x = parts.packed(x, cos, sin, caches, rows, masks[parts.window])
            if i in taps:
                tapped[i] = x
        return (self.norm(x), torch.cat([tapped[i] for i in taps], dim=-1)) if taps else self.norm(x)


def _stack_agrees(decoder: nn.Module, stack: FusedStack) -> bool:
    """Whether the stack gives the model's own final hidden states and cache on a probe: 2 tokens, then a
    3-node tree (root, two children), to float32 rounding."""
    config = decoder.config
    layers = len(stack.parts)
    attn = decoder.layers[0].self_attn
    kv_heads = attn.k_proj.out_features // attn.head_dim
    cache = StaticKVCache(layers, kv_heads, attn.head_dim, 8)
    vocab = int(getattr(config, "vocab_size", 0) or stack.embed.weight.shape[0])
    ids = torch.tensor([1, 2, 3, 4, 5]) % vocab
    tree = torch.tensor([[1, 0, 0], [1, 1, 0], [1, 0, 1]], dtype=torch.bool)
    blocks = ((ids[:2], torch.arange(2), None), (ids[2:], torch.tensor([2, 3, 3]), tree))

    def run(own: bool):
        cache.truncate(0)
        outs = []
        for block, positions, visible in blocks:
            n = block.numel()
            cache.reserve(n)
            full = None if visible is None else attention_mask(cache.length, visible)
            if own:
                mask = full if full is not None else attention_mask(
                    cache.length, torch.ones(n, n, dtype=torch.bool).tril_())
                outs.append(decoder(input_ids=block[None], attention_mask=mask, position_ids=(positions)[None],
                                    use_cache=True, **with_cache(decoder, cache)).last_hidden_state[0])
            else:
                outs.append(stack(block, positions, cache, None if full is None else full[0, 0]))
            cache.commit(n)
        return torch.cat(outs), cache.keys[:, 0, :, :5].clone(), cache.values[:, 0, :, :5].clone()

    try:
        with torch.inference_mode():
            own, fused = run(True), run(False)
    except (RuntimeError, TypeError, ValueError, AttributeError):
        return False
    return bool(torch.isfinite(own[0]).all()) and all(
        torch.allclose(a, b, rtol=1e-4, atol=1e-5 * float(b.abs().max() + 1)) for a, b in zip(fused, own))


def fuse_stack(decoder: nn.Module) -> FusedStack | None:
    """The `FusedStack` of `decoder` (a transformers decoder stack, e.g. `LlamaModel`) where all its layers are
    fused (`fuse_decoder_layers`) and the stack computes what the model does; else None."""
    layers = getattr(decoder, "layers", None)
    if not layers or not all(running_fused(layer) is not None for layer in layers):
        return None
    if any(getattr(decoder, name, None) is None for name in ("embed_tokens", "rotary_emb", "norm", "config")):
        return None
    stack = FusedStack(decoder)
    return stack if _stack_agrees(decoder, stack) else None
