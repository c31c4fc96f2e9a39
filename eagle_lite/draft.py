"""The EAGLE draft head: fc([embed(token); hidden]) -> one decoder layer of the target's own architecture.

At sequence position t it reads the target's last hidden state f_t and the embedding of the token that
followed, x_{t+1}, and predicts f_{t+1}; the target's frozen lm_head turns that into a distribution over
x_{t+2}. The embeddings and lm_head are the target's (not stored with the head); the head may be
restricted to a reduced draft vocabulary, `d2t[i]` being the target id of draft token i.
"""
from __future__ import annotations

import copy

import torch
from torch import nn

from .tree import attention_mask


class DraftHead(nn.Module):
    def __init__(self, target_config, layer_cls: type[nn.Module], rotary_cls: type[nn.Module],
                 d2t: torch.Tensor | None = None) -> None:
        super().__init__()
        config = copy.deepcopy(target_config)
        config.num_hidden_layers = 1
        config._attn_implementation = "sdpa"
        config.use_cache = True
        hidden = config.hidden_size
        self.config = config
        self.fc = nn.Linear(2 * hidden, hidden, bias=True)
        self.layer = layer_cls(config, layer_idx=0)
        self.rotary = rotary_cls(config=config)
        if d2t is not None:
            d2t = torch.as_tensor(d2t, dtype=torch.long)
        self.register_buffer("d2t", d2t, persistent=True)
        self.tree = None  # the TreeConfig its checkpoint recommends (checkpoint.load_head), if any

    @classmethod
    def for_target(cls, target, d2t: torch.Tensor | None = None) -> "DraftHead":
        """A fresh (randomly initialised) head shaped for `target`, in its dtype and device."""
        head = cls(target.config, type(target.decoder.layers[0]), type(target.decoder.rotary_emb), d2t)
        return head.to(device=target.device, dtype=target.dtype)

    @property
    def draft_vocab_size(self) -> int | None:
        return None if self.d2t is None else self.d2t.numel()

    def forward(self, hidden: torch.Tensor, token_embeds: torch.Tensor, position_ids: torch.Tensor,
                mask: torch.Tensor, cache=None) -> torch.Tensor:
        """hidden, token_embeds: [B, T, H]; position_ids: [B, T]; mask: [B|1, 1, T, kv_len] bool.

        Returns the predicted next hidden states [B, T, H].
        """
        x = self.fc(torch.cat([token_embeds, hidden.to(token_embeds.dtype)], dim=-1))  # B T H
        cos_sin = self.rotary(x, position_ids=position_ids)
        out = self.layer(x, attention_mask=mask, position_ids=position_ids, past_key_values=cache,
                         use_cache=cache is not None, position_embeddings=cos_sin)
        return out[0] if isinstance(out, tuple) else out

    def step(self, hidden: torch.Tensor, token_embeds: torch.Tensor, cache, positions: torch.Tensor,
             visible: torch.Tensor) -> torch.Tensor:
        """Inference over a static cache: T new inputs ([T, H] each) after its committed slots.

        positions: [T]. visible: [T, S] over the last S slots (see tree.attention_mask); the slots
        before those are visible to all. Returns the predicted hidden states [T, H].
        """
        t, s = visible.shape
        kv_len = cache.reserve(t)
        out = self.forward(hidden[None], token_embeds[None], positions[None],
                           attention_mask(kv_len - s, visible), cache)
        return out[0]
