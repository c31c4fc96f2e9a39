"""A static, preallocated KV cache that a transformers model writes through its cache keyword.

The buffers are allocated once. Every forward writes its T new keys/values into the slots right after
the committed prefix, `[length, length + T)`, and attends over `[0, length + T)`. A tree verification
therefore writes all of its nodes; `compact(path)` then moves the accepted nodes next to the prefix and
commits them, and whatever was rejected is simply overwritten by the next forward (no rollback code).
"""
from __future__ import annotations

import inspect

import torch


class ContextOverflowError(ValueError):
    """The tokens do not fit the cache (the model's context window, or the size it was built with)."""


_KEYWORDS: dict = {}   # forward -> its cache keyword (a plain dict: torch.compile traces a lookup in it)


def cache_keyword(forward) -> str:
    """The keyword a transformers module's `forward` takes its KV cache by: `cache` since transformers 5.24
    (which still maps `past_key_values` onto it, with a deprecation warning), `past_key_values` before."""
    keyword = _KEYWORDS.get(forward)
    if keyword is None:
        keyword = _KEYWORDS[forward] = ("cache" if "cache" in inspect.signature(forward).parameters
                                        else "past_key_values")
    return keyword


def with_cache(module, cache) -> dict:
    """{keyword: cache} for calling `module` (a decoder, or one of its layers) with a KV cache."""
    return {cache_keyword(type(module).forward): cache}


class StaticKVCache:
    """Keys/values of every layer in one tensor each: [layers, B=1, H_kv, max_len, D].

    It duck-types the two methods of `transformers.Cache` that decoder layers and the model call
    (`update`, `get_seq_length`), so the library's own model classes run unchanged on top of it.
    """

    # Not compileable: the committed length is a host int and `update` returns the first length + T slots, a shape
    # that changes every step. static.kv_cache.DeviceKVCache is the compileable form (slots by tensor, a device length).
    is_compileable = False

    def __init__(self, num_layers: int, kv_heads: int, head_dim: int, max_len: int,
                 dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu") -> None:
        shape = (num_layers, 1, kv_heads, max_len, head_dim)  # L B H_kv T D
        self.keys = torch.zeros(shape, dtype=dtype, device=device)
        self.values = torch.zeros(shape, dtype=dtype, device=device)
        self.is_sliding = [False] * num_layers  # read by transformers' mask helpers
        self.max_len = max_len
        self.length = 0        # committed tokens: slots [0, length) hold the sequence so far
        self.pending = 0      # tokens written by the forward in flight, at [length, length + pending)

    # -- the engine's side -------------------------------------------------------------------------
    def reserve(self, num_tokens: int) -> int:
        """Announce the next forward's token count; returns the kv length it will attend over."""
        end = self.length + num_tokens
        if end > self.max_len:
            raise ContextOverflowError(
                f"{end} tokens do not fit the KV cache of {self.max_len} slots "
                f"({self.length} committed + {num_tokens} new)"
            )
        self.pending = num_tokens
        return end

    def commit(self, num_tokens: int) -> None:
        """Keep the first `num_tokens` written by the last forward (prefill, or a chain)."""
        self.length += num_tokens
        self.pending = 0

    def compact(self, path: torch.Tensor) -> None:
        """Keep the tree nodes `path` (indices into the last forward's tokens, in sequence order).

        Node i was written at slot `length + i`; the kept nodes move to `length, length + 1, ...`.
        """
        n = int(path.numel())
        src = path.to(self.keys.device) + self.length
        if not torch.equal(src, torch.arange(self.length, self.length + n, device=src.device)):
            dst = slice(self.length, self.length + n)
            # index_select copies first, so overlapping source and destination slots are safe
            self.keys[:, :, :, dst] = self.keys.index_select(3, src)
            self.values[:, :, :, dst] = self.values.index_select(3, src)
        self.commit(n)

    def grown(self, max_len: int) -> StaticKVCache:
        """A larger cache holding the same committed tokens (the old buffers can then be dropped)."""
        layers, _, kv_heads, _, head_dim = self.keys.shape
        new = StaticKVCache(layers, kv_heads, head_dim, max_len, self.keys.dtype, self.keys.device)
        new.keys[:, :, :, :self.length] = self.keys[:, :, :, :self.length]
        new.values[:, :, :, :self.length] = self.values[:, :, :, :self.length]
        new.length = self.length
        return new

    def truncate(self, length: int) -> None:
        """Forget everything after `length` tokens (e.g. when a chat turn is edited or reset)."""
        if not 0 <= length <= self.length:
            raise ValueError(f"cannot truncate a cache of {self.length} tokens to {length}")
        self.length = length
        self.pending = 0

    # -- the model's side (transformers' Cache protocol) -------------------------------------------
    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        """key/value_states: [1, H_kv, T, D] -> all keys/values to attend over: [1, H_kv, length + T, D]."""
        t = key_states.shape[2]
        if t != self.pending:
            raise RuntimeError(f"forward wrote {t} tokens but {self.pending} were reserved; call reserve() first")
        end = self.length + t
        self.keys[layer_idx, :, :, self.length:end] = key_states
        self.values[layer_idx, :, :, self.length:end] = value_states
        return self.keys[layer_idx, :, :, :end], self.values[layer_idx, :, :, :end]

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.length


class PackedKVCache:
    """Several sequences' caches as one forward sees them when their new tokens are packed into one row.

    Sequence i's n_i new tokens are rows [r_i, r_i + n_i) of the forward. `update` writes each sequence's
    keys/values into its own `StaticKVCache` right after its committed prefix (as that cache's own forward
    would) and returns the sequences' keys/values side by side, [1, H_kv, sum(length_i + n_i), D]; the forward's
    block-diagonal mask (`tree.packed_mask`) lets each row see only its own sequence's columns. Each cache must
    have `reserve(n_i)`-ed first; the caller commits or compacts each one.
    """

    is_compileable = False

    def __init__(self, caches: list[StaticKVCache], rows: list[int]) -> None:
        for cache, n in zip(caches, rows):
            if cache.pending != n:
                raise RuntimeError(f"a packed forward of {n} tokens over a cache that reserved {cache.pending}")
        self.caches, self.rows = caches, rows
        self.is_sliding = caches[0].is_sliding

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        """key/value_states: [1, H_kv, sum n_i, D] -> [1, H_kv, sum(length_i + n_i), D] each."""
        keys, values, r = [], [], 0
        for cache, n in zip(self.caches, self.rows):
            end = cache.length + n
            cache.keys[layer_idx, :, :, cache.length:end] = key_states[:, :, r:r + n]
            cache.values[layer_idx, :, :, cache.length:end] = value_states[:, :, r:r + n]
            keys.append(cache.keys[layer_idx, :, :, :end])
            values.append(cache.values[layer_idx, :, :, :end])
            r += n
        return torch.cat(keys, dim=2), torch.cat(values, dim=2)

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return sum(cache.length for cache in self.caches)
