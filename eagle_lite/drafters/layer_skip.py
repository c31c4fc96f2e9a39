"""Self-speculative drafting by early exit (LayerSkip, Elhoushi et al. 2024; Draft & Verify, Zhang et al. 2023).

The target's own first N decoder layers, its final norm and its lm_head form the draft model: no
extra weights, the same tokenizer by construction. Drafting then works as with any draft model
(draft_model.py): a chain of K tokens from a cache of its own, N layers deep.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..config import option
from ..kv_cache import StaticKVCache, with_cache
from ..tree import attention_mask
from .draft_model import DraftModelDrafter


class EarlyExit:
    """The first `exit_layer` layers of a Target, run like a Target (`new_cache`, `forward`).

    The modules are the target's own (shared, not copied). Models that scale the embeddings inside
    the decoder's forward rather than inside the embedding module (Gemma 1/2) draft worse here; the
    output stays exact, since the target verifies every token.
    """

    def __init__(self, target, exit_layer: int | None = None) -> None:
        """exit_layer: 1 <= exit_layer < layers; None: half the layers."""
        if not (target.llama_layers and all(hasattr(target.decoder, a) for a in ("embed_tokens", "norm"))):
            raise ValueError(f"layer_skip runs the first layers of a Llama-style decoder stack; target "
                             f"'{target.name}' ({type(target.model).__name__}) has none: use eagle, lookup or "
                             f"draft_model")
        num_layers = len(target.decoder.layers)
        if exit_layer is None:
            exit_layer = max(1, num_layers // 2)
        if not isinstance(exit_layer, int) or not 1 <= exit_layer < num_layers:
            raise ValueError(f"exit_layer must be an int in [1, {num_layers - 1}] for target '{target.name}' "
                             f"({num_layers} decoder layers), got {exit_layer!r}")
        self.target, self.exit_layer = target, exit_layer
        self.name = f"{target.name}[:{exit_layer}]"
        self.tokenizer = target.tokenizer

    @property
    def vocab_size(self) -> int:
        return self.target.vocab_size

    @property
    def device(self) -> torch.device:
        return self.target.device

    def new_cache(self, max_len: int) -> StaticKVCache:
        """Like Target.new_cache, with only the exit_layer layers the draft runs."""
        cfg = self.target.config
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        kv_heads = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
        return StaticKVCache(self.exit_layer, kv_heads, head_dim, max_len, self.target.dtype, self.target.device)

    def forward(self, input_ids: torch.Tensor, cache: StaticKVCache, logits_rows: slice | None = None):
        """A causal chain input_ids [T] after the cache's committed prefix.

        Returns (logits [R, V] for `logits_rows` or None, hidden [T, H] after the final norm); the
        caller commits the cache.
        """
        decoder, t = self.target.decoder, input_ids.numel()
        start = cache.length
        cache.reserve(t)
        positions = torch.arange(start, start + t, device=input_ids.device).view(1, t)  # B=1 T
        mask = attention_mask(start, torch.ones(t, t, dtype=torch.bool, device=input_ids.device).tril_())
        h = decoder.embed_tokens(input_ids.view(1, t))                                   # 1 T H
        cos_sin = decoder.rotary_emb(h, position_ids=positions)
        # layers[:N] carry layer_idx 0..N-1: exactly the layers of the N-layer cache
        for layer in decoder.layers[:self.exit_layer]:
            out = layer(h, attention_mask=mask, position_ids=positions, use_cache=True,
                        position_embeddings=cos_sin, **with_cache(layer, cache))
            h = out[0] if isinstance(out, tuple) else out
        hidden = decoder.norm(h)[0]                                                       # T H
        logits = None if logits_rows is None else self.target.lm_head(hidden[logits_rows])
        return logits, hidden


class LayerSkipDrafter(DraftModelDrafter):
    """Drafts K tokens with the target's first `exit_layer` layers (1 <= exit_layer < layers; None: half)."""

    name = "layer_skip"

    def __init__(self, target, exit_layer: int | None = None, num_tokens: int = 4, adaptive: bool = True) -> None:
        super().__init__(target, EarlyExit(target, exit_layer), num_tokens, adaptive)


@dataclass(frozen=True)
class LayerSkipOptions:
    """exit_layer: the target's first N decoder layers draft (None: half of them)."""

    exit_layer: int | None = option(None, "exit-layer", "draft with the target's first N decoder layers (None: half "
                                    "of them)", type=int, metavar="N")
    num_tokens: int = 4
    adaptive: bool = True


def build_layer_skip(target, o: LayerSkipOptions) -> LayerSkipDrafter:
    return LayerSkipDrafter(target, o.exit_layer, o.num_tokens, o.adaptive)
