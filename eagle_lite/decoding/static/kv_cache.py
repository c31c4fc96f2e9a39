"""The static step's caches: every layer's keys/values in one preallocated buffer, written at slots given by a
tensor and read under a boolean mask over all slots, with the committed length kept on the device (static/step.py).
"""
from __future__ import annotations

import torch


class DeviceKVCache:
    """Keys/values of every layer: [layers, 1, H_kv, slots, D] each, written at slots given by a tensor.

    Both live in one buffer `kv` [layers, 1, 2 H_kv, slots, D] (keys: the first H_kv heads, values the rest;
    `keys` and `values` are views), so a layer that has its keys and values side by side writes them in one op
    and a commit moves both in one gather and one copy (static/stack.py).
    There is no host-side length: the caller keeps it on the device and masks what a forward may see.
    `writer(slots)` is what a model's layers receive as their cache during one forward.
    """

    is_compileable = True

    def __init__(self, num_layers: int, kv_heads: int, head_dim: int, slots: int,
                 dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu") -> None:
        self.kv = torch.zeros((num_layers, 1, 2 * kv_heads, slots, head_dim), dtype=dtype, device=device)
        self.keys, self.values = self.kv[:, :, :kv_heads], self.kv[:, :, kv_heads:]
        self.slots = slots

    def writer(self, slots: torch.Tensor) -> SlotWriter:
        return SlotWriter(self, slots)

    def move(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Copy the entries at slots `src` to slots `dst` (all layers; a gather first, so overlaps are safe)."""
        self.kv.index_copy_(3, dst, self.kv.index_select(3, src))


class SlotWriter:
    """The cache a model's layers see during one forward: `update` writes the T new keys/values at `slots` [T]
    and returns the whole buffer (the mask hides what the tokens may not see). It duck-types the two methods of
    `transformers.Cache` that decoder layers and the Llama-family models call."""

    is_compileable = True

    def __init__(self, cache: DeviceKVCache, slots: torch.Tensor) -> None:
        self.cache, self.slots = cache, slots

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        """key/value_states: [1, H_kv, T, D] -> all keys/values: [1, H_kv, slots, D]."""
        keys, values = self.cache.keys[layer_idx], self.cache.values[layer_idx]
        keys.index_copy_(2, self.slots, key_states.to(keys.dtype))
        values.index_copy_(2, self.slots, value_states.to(values.dtype))
        return keys, values

    def get_seq_length(self, layer_idx: int = 0) -> int:
        raise RuntimeError("the static step gives every forward its position ids; a model that asks its cache for "
                           "its length cannot run it (use the engine)")


def slot_mask(start: torch.Tensor, visible: torch.Tensor, slots: int | torch.Tensor,
              at: torch.Tensor | None = None) -> torch.Tensor:
    """The boolean mask [1, 1, T, S] of T tokens whose own block sits at slots [start, start + W): every slot
    before `start` (the committed prefix) is visible, and inside the block what `visible` [T, W] says. Slots after
    the block hold stale entries and stay hidden. start: a 0-d long tensor (on the device: no host read).
    slots: S, or `arange(S)` on the device where the caller keeps one; at: the block's slots, start + arange(W),
    where the caller has them (each saves an op)."""
    t, w = visible.shape
    cols = torch.arange(slots, device=visible.device) if isinstance(slots, int) else slots
    at = start + torch.arange(w, device=visible.device) if at is None else at
    # a real [T, S] copy of the prefix row, not an expanded view: inductor's CPU code scattered the block into an
    # expanded one as if its rows shared one row (tests/test_static_step.py)
    mask = (cols < start).repeat(t, 1).index_copy(1, at, visible)
    return mask.view(1, 1, t, cols.numel())


def probe_ids(vocab_size: int, device) -> torch.Tensor:
    """The 6 token ids a probe of the static step reads, spread over the vocabulary."""
    return (torch.arange(6, device=device) * 7919 + 3) % vocab_size


def probe_error(mine: list[torch.Tensor], own: list[torch.Tensor]) -> float:
    """The largest relative error of a probe's outputs computed one way (`mine`) against the model's own (`own`),
    pair by pair."""
    return max(float((a.float() - b.float()).norm()) / (float(b.float().norm()) + 1e-6) for a, b in zip(mine, own))


def probe_calls(rows: int, device) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """A probe's two calls, (positions, mask, slots) through a 16-slot cache: `rows` rows from slot 0 (causal), then
    two sibling nodes after them (what the step and the draft check a fused layer or the static cache with)."""
    zero, at = torch.zeros((), dtype=torch.long, device=device), torch.full((), rows, device=device)
    ar = torch.arange(rows, device=device)
    return [(ar, slot_mask(zero, torch.ones(rows, rows, dtype=torch.bool, device=device).tril_(), 16), ar),
            (at.expand(2), slot_mask(at, torch.eye(2, dtype=torch.bool, device=device), 16),
             at + torch.arange(2, device=device))]


def cache_shape(config) -> tuple[int, int, int]:
    """(layers, kv heads, head dim) of a transformers config."""
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    return config.num_hidden_layers, kv_heads, head_dim
