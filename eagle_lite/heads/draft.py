"""The EAGLE draft head: fc([embed(token); hidden]) -> one decoder layer, of the target's own architecture
where its layers follow Llama's interface (`Target.llama_layers`), else a Llama layer of the target's sizes
(`head_layer_classes`).

At sequence position t it reads the target's last hidden state f_t and the embedding of the token that
followed, x_{t+1}, and predicts f_{t+1}; the target's frozen lm_head turns that into a distribution over
x_{t+2}. The embeddings and lm_head are the target's (not stored with the head); the head may be
restricted to a reduced draft vocabulary, `d2t[i]` being the target id of draft token i.

Options, so that the published layouts load exactly (eagle_lite/formats/, docs/deploy.md "The head's options"):
`input_norm`, `fc_bias`, `design="eagle3"` (with `fc_norm`, `norm_output`), `feature_layers` (the default design
fuses the taps by `fuse`), and `parallel=K` (P-EAGLE's mask vectors, kept so such heads load; it drafts in
eagle_lite_wing/parallel.py).
"""
from __future__ import annotations

import copy

import torch
from torch import nn

from ..kernels import MAX_FUSED_ROWS, RotaryTable, running_fused
from ..kv_cache import PackedKVCache, with_cache
from ..tree import attention_mask, packed_mask
from .eagle3_layer import Eagle3Layer

DESIGNS = ("eagle", "eagle3")


class DraftHead(nn.Module):
    def __init__(self, target_config, layer_cls: type[nn.Module], rotary_cls: type[nn.Module],
                 d2t: torch.Tensor | None = None, feature_layers: tuple[int, ...] = (), fc_bias: bool = True,
                 input_norm: bool = True, design: str = "eagle", fc_norm: bool = False,
                 norm_output: bool = False, parallel: int = 0) -> None:
        super().__init__()
        if design not in DESIGNS:
            raise ValueError(f"draft head design {design!r} is unknown: expected one of {', '.join(DESIGNS)}")
        if len(feature_layers) == 1:
            raise ValueError("feature_layers takes two or more decoder layers (EAGLE-3: low, middle, high), or none "
                             "for the target's last hidden state")
        if fc_norm and design != "eagle3":
            raise ValueError("fc_norm (EAGLE-3.1's norm of each tapped layer before fc) is an option of design eagle3")
        if norm_output and design != "eagle3":
            raise ValueError("norm_output (EAGLE-3.1's normalised output fed back) is an option of design eagle3")
        self.norm_output = bool(norm_output)
        if design == "eagle3" and not feature_layers:
            raise ValueError("an EAGLE-3 head reads the target's tapped layers: give feature_layers (low, mid, high)")
        config = copy.deepcopy(target_config)
        config.num_hidden_layers = 1
        config._attn_implementation = "sdpa"
        if getattr(config, "attn_logit_softcapping", None):
            config.attn_logit_softcapping = None   # a Gemma 2 layer without its soft cap, which SDPA cannot do
        config.use_cache = True
        hidden = config.hidden_size
        self.config = config
        self.design = design
        self.feature_layers = tuple(int(i) for i in feature_layers)
        if d2t is not None:
            d2t = torch.as_tensor(d2t, dtype=torch.long)
        if design == "eagle3":
            from transformers.models.llama.modeling_llama import LlamaRMSNorm

            self.fc = nn.Linear(len(feature_layers) * hidden, hidden, bias=False)
            self.fc_norm = (nn.ModuleList(LlamaRMSNorm(hidden, eps=config.rms_norm_eps) for _ in feature_layers)
                            if fc_norm else None)
            self.fuse = None
            self.layer = Eagle3Layer(config)
            self.norm = LlamaRMSNorm(hidden, eps=config.rms_norm_eps)
            self.lm_head = nn.Linear(hidden, config.vocab_size if d2t is None else d2t.numel(), bias=False)
        else:
            self.fc = nn.Linear(2 * hidden, hidden, bias=fc_bias)
            self.fc_norm = None
            # the target's tapped layers, concatenated, down to one feature; None: the head reads the last hidden state
            self.fuse = nn.Linear(len(feature_layers) * hidden, hidden, bias=False) if feature_layers else None
            self.layer = layer_cls(config, layer_idx=0)
            if not input_norm:
                self.layer.input_layernorm = nn.Identity()
            self.norm = self.lm_head = None   # logits: the target's lm_head of the predicted feature
        self.rotary = rotary_cls(config=config)
        self.rope_table = RotaryTable(self.rotary)   # its cos/sin by position, for the fused inference path
        self.register_buffer("d2t", d2t, persistent=True)
        self.tree = None  # the TreeConfig its checkpoint recommends (formats.load_head), if any
        self.parallel = 0                     # K > 1: drafts K tokens in one forward (module docstring)
        self.mask_hidden = self.mask_embed = None
        if parallel:
            self.make_parallel(parallel)

    @property
    def input_width(self) -> int:
        """How wide the feature input of a real pair is: the tapped layers side by side (EAGLE-3 designs), else H."""
        return self.config.hidden_size * max(1, len(self.feature_layers))

    def make_parallel(self, k: int) -> DraftHead:
        """Give the head K-token parallel drafting: the mask rows' two learned vectors, small and random (a
        fine-tune from a sequential head learns them with the rest). Returns the head."""
        if int(k) < 2:
            raise ValueError(f"parallel drafting takes K >= 2 tokens a forward, got {k}")
        self.parallel = int(k)
        if self.mask_hidden is None:
            ref = self.fc.weight
            gen = torch.Generator().manual_seed(0)
            width, hidden = self.input_width, self.config.hidden_size
            self.mask_hidden = nn.Parameter((torch.randn(width, generator=gen) * 0.02).to(ref))
            self.mask_embed = nn.Parameter((torch.randn(hidden, generator=gen) * 0.02).to(ref))
        return self

    def mask_rows(self, n: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """(hidden [n, input_width], embeds [n, H]): n mask rows' inputs, in `dtype`."""
        return (self.mask_hidden.to(dtype).expand(n, -1), self.mask_embed.to(dtype).expand(n, -1))

    @classmethod
    def for_target(cls, target, d2t: torch.Tensor | None = None, layer_class: str | None = None,
                   feature_layers: tuple[int, ...] = (), fc_bias: bool = True, input_norm: bool = True,
                   design: str = "eagle", config=None, fc_norm: bool = False,
                   norm_output: bool = False, parallel: int = 0) -> DraftHead:
        """A fresh (randomly initialised) head shaped for `target`, in its dtype and device. layer_class: the
        decoder layer a saved head was built with (its config.json's "layer_class"); None: `head_layer_classes`.
        feature_layers: the target's decoder layers it reads (EAGLE-3; `auto_feature_layers`), () for the last
        hidden state. config: the head's own sizes (a LlamaConfig, e.g. from an imported head's config.json); the
        head then has Llama layers of those sizes, as published heads do. EAGLE-3 heads always have them."""
        if feature_layers:
            target.check_taps(tuple(feature_layers))
        if config is not None or design == "eagle3":
            from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRotaryEmbedding

            config = llama_config_for(target.config) if config is None else config
            layer_cls, rotary_cls = LlamaDecoderLayer, LlamaRotaryEmbedding
        else:
            config, layer_cls, rotary_cls = head_layer_classes(target, layer_class)
        head = cls(config, layer_cls, rotary_cls, d2t, tuple(feature_layers), fc_bias, input_norm, design, fc_norm,
                   norm_output, parallel)
        return head.to(device=target.device, dtype=target.dtype)

    @property
    def input_norm(self) -> bool:
        """Whether the decoder layer normalizes its input (eagle_lite's own EAGLE heads; not official ones)."""
        return not isinstance(self.layer.input_layernorm, nn.Identity)

    @property
    def fc_bias(self) -> bool:
        return self.fc.bias is not None

    @property
    def draft_vocab_size(self) -> int | None:
        return None if self.d2t is None else self.d2t.numel()

    def forward(self, hidden: torch.Tensor, token_embeds: torch.Tensor, position_ids: torch.Tensor,
                mask: torch.Tensor, cache=None) -> torch.Tensor:
        """hidden, token_embeds: [B, T, H]; position_ids: [B, T]; mask: [B|1, 1, T, kv_len] bool.

        Returns the predicted next hidden states [B, T, H]. `hidden` may instead be the target's tapped layers
        [B, T, len(feature_layers) * H] (EAGLE-3 heads), which `fuse` (or an EAGLE-3 head's fc) projects to H first.
        """
        x = self.layer_input(hidden, token_embeds)              # B T H
        cos_sin = self.rotary(x, position_ids=position_ids)
        if self.design == "eagle3":
            return self.layer(token_embeds, x, mask, cos_sin, cache)
        out = self.layer(x, attention_mask=mask, position_ids=position_ids, use_cache=cache is not None,
                         position_embeddings=cos_sin, **with_cache(self.layer, cache))
        return out[0] if isinstance(out, tuple) else out

    def layer_input(self, hidden: torch.Tensor, token_embeds: torch.Tensor) -> torch.Tensor:
        """The decoder layer's input [..., H] (the residual stream) from the features `hidden`, in the embeddings'
        dtype: an EAGLE-3 head's fc of the target's tapped layers (3H wide; at later draft steps the head's own
        output, H wide, is read as it is, or under its final norm with `norm_output`, its embeddings going beside it
        into the layer); the other designs'
        fc([embed(token); feature])."""
        hidden = hidden.to(token_embeds.dtype)
        if self.design == "eagle3":
            if hidden.shape[-1] == token_embeds.shape[-1]:    # the head's own output, fed back
                return self.norm(hidden) if self.norm_output else hidden
            return self.fc(hidden if self.fc_norm is None else self.normed_taps(hidden))
        return self._layer_input(hidden, token_embeds)

    def normed_taps(self, hidden: torch.Tensor) -> torch.Tensor:
        """The tapped layers [..., n * H] each under its own `fc_norm` RMSNorm (EAGLE-3.1): the arithmetic of
        transformers' LlamaRMSNorm on each, in one pass over the n taps side by side."""
        n, width = len(self.fc_norm), hidden.shape[-1] // len(self.fc_norm)
        x = hidden.unflatten(-1, (n, width)).float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.fc_norm[0].variance_epsilon)
        weight = torch.stack([norm.weight for norm in self.fc_norm])                  # n H
        return (weight * x.to(hidden.dtype)).flatten(-2)

    def _layer_input(self, hidden: torch.Tensor, token_embeds: torch.Tensor) -> torch.Tensor:
        """The decoder layer's input [..., H] (designs other than eagle3): fc([embed(token); feature])."""
        if self.fuse is not None and hidden.shape[-1] != token_embeds.shape[-1]:
            hidden = self.fuse(hidden)
        return self.fc(torch.cat([token_embeds, hidden], dim=-1))

    def logit_features(self, hidden: torch.Tensor) -> torch.Tensor:
        """What the output projection reads of predicted features [..., H]: an EAGLE-3 head's own final norm of
        them; the features themselves for the others (the target's lm_head reads them, as its final norm's output)."""
        return hidden if self.norm is None else self.norm(hidden)

    def output_weight(self, target_lm_weight: torch.Tensor) -> torch.Tensor:
        """[V_draft, H]: the rows the draft scores. An EAGLE-3 head's own lm_head; else the target's lm_head
        `target_lm_weight` [V, H], restricted to the draft vocabulary `d2t` where there is one."""
        if self.lm_head is not None:
            return self.lm_head.weight
        return target_lm_weight if self.d2t is None else target_lm_weight[self.d2t]

    def over_full_vocabulary(self) -> DraftHead:
        """This head scoring the target's whole vocabulary instead of its draft vocabulary `d2t`, its weights
        shared (itself where it has no `d2t`). Only for heads that score through the target's lm_head: the draft
        vocabulary narrows which rows they read, not what they learned, while an EAGLE-3 head's own lm_head has
        rows for its draft tokens alone. Over the whole vocabulary the tree may hold tokens the draft vocabulary
        lacks, and its path probabilities are not renormalised over a subset (docs/training.md measures both)."""
        if self.lm_head is not None:
            raise ValueError(f"this {self.design} head scores its draft vocabulary of {self.lm_head.out_features} "
                             f"tokens with its own lm_head; it cannot draft over the target's whole vocabulary")
        if self.d2t is None:
            return self
        twin = copy.copy(self)
        twin._buffers = {**self._buffers, "d2t": None}
        return twin

    def step(self, hidden: torch.Tensor, token_embeds: torch.Tensor, cache, positions: torch.Tensor,
             visible: torch.Tensor, skip: int = 0) -> torch.Tensor:
        """Inference over a static cache: T new inputs ([T, H] each) after its committed slots.

        positions: [T]. visible: [T, S] over the last S slots (see tree.attention_mask); the slots
        before those are visible to all. skip: the first rows whose outputs are not wanted (a catch-up's: only their
        keys and values matter; computed here all the same, left out of the result). Returns the predicted hidden
        states of rows skip.. [T - skip, H].
        """
        t, s = visible.shape
        kv_len = cache.reserve(t)
        out = self.forward(hidden[None], token_embeds[None], positions[None],
                           attention_mask(kv_len - s, visible), cache)
        return out[0, skip:]

    def step_packed(self, blocks: list[tuple]) -> list[torch.Tensor]:
        """Several sequences' `step`s, packed: blocks [(hidden [t_i, H], token_embeds [t_i, H], cache_i,
        positions [t_i], visible [t_i, S_i], skip_i)] (skip_i may be left out: 0), each as `step` takes it on its own
        cache. Returns each block's predicted hidden states [t_i - skip_i, H], what its own `step` gives (to the
        rounding of the products' sums). The native op leaves the skipped rows' query, attention and MLP out.

        Blocks run together in forwards of at most MAX_FUSED_ROWS rows in all, and a larger block on its own: past
        that many rows the head's products read its exact fp32 weights instead of the codes it runs from (a rounded
        head, cpu_linear.pack_linears) and its layer leaves the native op, so a block never computes with other
        weights than alone. Each forward reads the weights once for all its rows."""
        chunks: list[list[int]] = []
        rows = 0
        for i, block in enumerate(blocks):
            t = block[4].shape[0]
            if not chunks or t > MAX_FUSED_ROWS or rows + t > MAX_FUSED_ROWS:
                chunks.append([])
                rows = 0
            chunks[-1].append(i)
            rows += t
        outs: list = [None] * len(blocks)
        for chunk in chunks:
            for i, out in zip(chunk, self._packed_forward([blocks[i] for i in chunk])):
                outs[i] = out
        return outs

    def _packed_forward(self, blocks: list[tuple]) -> list[torch.Tensor]:
        """`step_packed`'s blocks in ONE forward: the rows packed into one, each seeing its own cache and its own
        `visible` slots only (`Target.verify`'s block-diagonal mask over per-sequence caches). Where the layer runs
        as the native op, one block too (cos/sin from `rope_table`: ~25 fewer torch ops than `step`'s way through
        the modules); else one block runs `step` itself."""
        parts = running_fused(self.layer)
        fused = parts is not None and blocks[0][1].dtype == torch.float32
        if len(blocks) == 1 and not fused:
            return [self.step(*blocks[0])]
        skips = [block[5] if len(block) > 5 else 0 for block in blocks]
        rows, caches, masks = [], [], []
        for _, _, cache, _, visible, *_ in blocks:
            t, s = visible.shape
            kv_len = cache.reserve(t)
            rows.append(t)
            caches.append(cache)
            masks.append(attention_mask(kv_len - s, visible)[0, 0])     # t_i length_i+t_i
        if len(blocks) == 1:
            hidden, embeds, _, positions, *_ = blocks[0]
        else:
            hidden, embeds = torch.cat([b[0] for b in blocks]), torch.cat([b[1] for b in blocks])
            positions = torch.cat([b[3] for b in blocks])
        if fused:
            x = self.layer_input(hidden, embeds).contiguous()                                 # T H
            beside = embeds.contiguous() if self.design == "eagle3" else None   # the op reads them beside x
            cos, sin = self.rope_table(x, positions)            # then the native op, as `step` runs it
            out = parts.packed(x, cos, sin, caches, rows, [m.contiguous() for m in masks], beside,
                               skips if any(skips) else None)
            return list(out.split([t - skip for t, skip in zip(rows, skips)]))
        out = self.forward(hidden[None], embeds[None], positions[None], packed_mask(masks),
                           PackedKVCache(caches, rows))[0]
        return [part[skip:] for part, skip in zip(out.split(rows), skips)]


def llama_config_for(config) -> LlamaConfig:  # noqa: F821
    """A Llama config of the target's sizes, for a head over a target whose own layer cannot serve."""
    from transformers import LlamaConfig

    hidden = config.hidden_size
    heads = config.num_attention_heads
    intermediate = (getattr(config, "intermediate_size", None) or getattr(config, "n_inner", None)
                    or getattr(config, "ffn_hidden_size", None) or 4 * hidden)
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or hidden // heads
    return LlamaConfig(vocab_size=config.vocab_size, hidden_size=hidden, intermediate_size=intermediate,
                       num_attention_heads=heads, num_key_value_heads=kv_heads if heads % kv_heads == 0 else heads,
                       head_dim=head_dim, num_hidden_layers=1,
                       max_position_embeddings=getattr(config, "max_position_embeddings", None) or 4096,
                       rms_norm_eps=getattr(config, "rms_norm_eps", None) or getattr(config, "layer_norm_eps", None)
                       or 1e-6)


def head_layer_classes(target, layer_class: str | None = None) -> tuple[object, type[nn.Module], type[nn.Module]]:
    """(config, decoder layer class, rotary class) of the head for `target`.

    The target's own layer where it follows Llama's interface and is dense (the head then shares its
    architecture, as in EAGLE), else `LlamaDecoderLayer` over `llama_config_for` (the head is only trained, never
    copied from the target, so any layer of the right width serves). layer_class names a saved head's layer: the
    target's own (an older saved head may name an MoE layer) or Llama's."""
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRotaryEmbedding

    decoder = target.decoder
    cfg = target.config
    experts = any(getattr(cfg, key, None) for key in ("num_experts", "num_local_experts", "n_routed_experts"))
    # a mixture-of-experts layer is no draft head: its expert weights are left to the model's own init
    # (uninitialised memory in a head built outside it) and a head gains nothing from routing
    own_name = type(decoder.layers[0]).__name__ if target.llama_layers else None
    if layer_class is None:
        use_own = own_name is not None and not experts
    elif layer_class == own_name:
        use_own = True
    elif layer_class == LlamaDecoderLayer.__name__:
        use_own = False
    else:
        raise ValueError(f"the draft head was built with a {layer_class}; for target '{target.name}' eagle_lite "
                         f"builds heads of {own_name or 'no layer of its own'} or LlamaDecoderLayer")
    if use_own:
        return target.config, type(decoder.layers[0]), type(decoder.rotary_emb)
    return llama_config_for(target.config), LlamaDecoderLayer, LlamaRotaryEmbedding


def published_feature_layers(num_layers: int) -> tuple[int, ...]:
    """The published EAGLE-3 taps as `Target.forward` numbers them (the output of decoder layer i): the residual
    stream entering layers 2, L//2 and L-3 (official EAGLE, vLLM and SGLang defaults), i.e. the outputs of layers
    1, L//2-1 and L-4 (SpecForge's convention). SmolLM2's 30 layers: 1, 14, 26."""
    taps = (1, num_layers // 2 - 1, num_layers - 4)
    if len(set(taps)) != 3 or min(taps) < 0:
        raise ValueError(f"a target of {num_layers} decoder layers has too few for the published EAGLE-3 taps "
                         f"(inputs of layers 2, L//2 and L-3 are three distinct layers from L = 7 on): give "
                         f"draft.feature_layers explicitly")
    return taps


def auto_feature_layers(num_layers: int) -> tuple[int, ...]:
    """EAGLE-3's low, middle and high layers for a stack of `num_layers` (SmolLM2's 30: 2, 15, 27)."""
    if num_layers < 3:
        raise ValueError(f"a target of {num_layers} decoder layers has too few to tap (EAGLE-3 needs 3 or more)")
    low, mid, high = (2 if num_layers >= 8 else 0), num_layers // 2, max(num_layers - 3, 1)
    return tuple(sorted({min(low, num_layers - 2), min(mid, num_layers - 2), min(high, num_layers - 2)}))
