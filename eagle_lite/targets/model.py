"""The target model: any transformers causal LM, run one forward at a time over a static KV cache.

`Target.forward` takes a block of tokens that is either a chain (prefill, plain decoding) or a draft
tree (given by its ancestor mask and depths) and returns the last hidden states of every token (what
the draft head reads); the lm_head runs separately, over only the rows acceptance reads (lm_head.py).

A model is taken only after it proves it runs this way: at load, a few tokens through the cached tree forward
must give its own full forward's logits (`_check_tree_forward`), and `logits` applies whatever scaling or
soft cap the model puts on its lm_head output (`logits_transform`), so sampling draws from the model's own law.
Speed-ups (kernels/) are applied by one call at load and never change what a forward computes.
"""
from __future__ import annotations

import contextlib
import hashlib
import inspect
from collections.abc import Iterator

import torch
from torch import nn

from ..kernels import Accelerated, accelerate_target, stock
from ..kernels.attention import select_attention
from ..kv_cache import PackedKVCache, StaticKVCache, cache_keyword, with_cache
from ..tree import attention_mask, packed_mask, windowed
from .lm_head import LmHead


class Target:
    """A loaded transformers causal LM (`model`) and its tokenizer, with the pieces EAGLE needs."""

    def __init__(self, model: nn.Module, tokenizer=None, name: str = "target", attention: str = "sdpa",
                 accelerate: bool = True) -> None:
        """attention: the tree-verification backend (kernels/attention.py). accelerate: apply the speed-ups of
        kernels/ (CPU, fp32: grid-code or packed linears, fused norms and layers; a no-op elsewhere); they
        compute what the model's own forward does, to fp32 rounding. `stock()` runs a block without them."""
        if getattr(model.config, "is_encoder_decoder", False):
            raise ValueError(f"target '{name}' is an encoder-decoder model; eagle_lite needs a causal LM")
        if not (getattr(model, "_supports_attention_backend", False) or getattr(model, "_supports_sdpa", False)):
            raise unverifiable(name, model, "its attention takes neither transformers' attention interface nor SDPA "
                                            "(state-space and recurrent models such as Mamba have no attention "
                                            "to mask)")
        self.model = model.eval()
        self.tokenizer = tokenizer
        self.name = name
        self.config = model.config
        self.decoder = model.get_decoder()            # the transformer stack without the lm_head
        self.lm_head = model.get_output_embeddings()  # hidden -> vocab logits
        self.embed_tokens = model.get_input_embeddings()
        # the sliding window the masks give the sliding layers (their own mask, by layer type); None: none to give
        self.window = mask_window(self.config, self.decoder)
        self._use_attention(attention)
        self.accelerated = accelerate_target(self.decoder, self.lm_head) if accelerate else Accelerated()
        # one forward of the model's own on a few tokens serves both load-time checks
        ids, expected = probe_logits(model, self.lm_head, name)
        # what the model does to lm_head's output (a scale, a soft cap; None: nothing)
        self.lm = LmHead(self.lm_head, logits_transform(model, self.decoder, self.lm_head, ids, expected, name),
                         self.accelerated.lm_grid)
        self._check_tree_forward(ids, expected)

    def _use_attention(self, attention: str) -> None:
        """Run the model's attention through the tree-verification backend `attention` (kernels/attention.py).
        Tree masks are boolean 4-D masks, which transformers' SDPA path takes as they are ("eager" would read them
        as additive and silently give wrong logits)."""
        if getattr(self.config, "attn_logit_softcapping", None) and attention in ("auto", "sdpa"):
            attention = "gqa"   # Gemma 2 soft-caps attention scores: no SDPA kernel does, gqa's torch path does
        implementation = select_attention(attention, self.model)
        if self.config._attn_implementation != implementation:
            self.model.set_attn_implementation(implementation)

    def speed_up(self, attention: str = "auto") -> None:
        """Apply the speed-ups and the tree-verification backend now, to a target built with accelerate=False
        (training reads it in long batches; distillation then decodes with it). `stock()` still runs it as built."""
        if not self.accelerated.applied:
            self.accelerated = accelerate_target(self.decoder, self.lm_head)
            self.lm.grid = self.accelerated.lm_grid
        self._use_attention(attention)

    def _check_tree_forward(self, ids: torch.Tensor, expected: torch.Tensor) -> None:
        """Refuse a model that the cached tree forward would run wrong, before it answers anything.

        A prompt, then two sibling nodes after it (each may see the prompt and itself only, at the same position),
        then the chain that continues the prompt: their logits must be the model's own full forwards'. Models whose
        attention ignores a boolean mask or computes ALiBi positions itself (MPT, Bloom; GPT-J and CodeGen before
        transformers 5.24) fail here;
        recurrent ones (Mamba, RWKV, Jamba) cannot run on a cache of keys and values at all.
        ids [6], expected [6, V]: `probe_logits`."""
        sibling = (ids[4:5] + 1) % self.vocab_size
        problem = None
        try:
            with torch.inference_mode():
                expected_sibling = self.model(input_ids=torch.cat([ids[:4], sibling])[None]).logits[0, -1].float()
                cache = self.new_cache(8)
                self.forward(ids[:4], cache)
                cache.commit(4)
                nodes = torch.cat([ids[4:5], sibling])
                _, hidden = self.forward(nodes, cache, torch.eye(2, dtype=torch.bool, device=self.device),
                                         torch.zeros(2, dtype=torch.long, device=self.device))
                tree = self.logits(hidden).float()                                                      # 2 V
                _, hidden = self.forward(ids[4:], cache)
                chain = self.logits(hidden).float()                                                     # 2 V
            want, got = torch.stack([expected[4], expected_sibling, expected[4], expected[5]]), torch.cat([tree, chain])
            tolerance = 1e-3 if self.dtype == torch.float32 else 3e-2
            if float((got - want).norm()) > tolerance * float(want.norm()) + 1e-5:
                problem = "its logits over a draft tree after a cached prompt differ from its own full forward"
        except Exception as err:  # noqa: BLE001 (any failure here means the model cannot run this way)
            problem = f"a cached tree forward fails ({type(err).__name__}: {err})"
        if problem:
            raise unverifiable(self.name, self.model, problem)

    # -- shape facts ---------------------------------------------------------------------------------
    @property
    def hidden_size(self) -> int:
        return self.config.hidden_size

    @property
    def vocab_size(self) -> int:
        return self.lm_head.weight.shape[0]

    @property
    def device(self) -> torch.device:
        return self.lm_head.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.lm_head.weight.dtype

    @property
    def max_context(self) -> int:
        """Tokens the target can attend over: its position limit. Where its sliding layers take a mask of their own
        (`window`: Gemma 2/3, Qwen 2), each gets the tree mask with the keys past its window hidden; a model with a
        sliding window and one mask for every layer (Mistral-style configs) is capped at the window, inside which
        the two agree."""
        cfg = self.config
        limit = int(getattr(cfg, "max_position_embeddings", 0) or 1 << 20)
        window = getattr(cfg, "sliding_window", None)
        layer_types = getattr(cfg, "layer_types", None)
        if window and self.window is None and (layer_types is None or "sliding_attention" in layer_types):
            limit = min(limit, int(window))
        return limit

    def masks(self, mask: torch.Tensor, windowed_mask) -> torch.Tensor | dict:
        """The attention mask the model's forward takes: `mask` (4-D), or, for a target with sliding layers, a
        mapping by layer type whose sliding entry is `windowed_mask()` (the same mask, keys past the window hidden)."""
        if self.window is None:
            return mask
        return {"full_attention": mask, "sliding_attention": windowed_mask()}

    @property
    def llama_layers(self) -> bool:
        """Whether the decoder's `layers` are called as Llama's are (a KV cache keyword, cos/sin in
        `position_embeddings` from a `rotary_emb` that needs only (x, position_ids)): Llama, Qwen, Mistral, Phi,
        Gemma 1/2, ... A draft head may then be one of its layers. Not GPT-2, GPT-NeoX, Falcon or Gemma 3."""
        decoder = self.decoder
        layers, rotary = getattr(decoder, "layers", None), getattr(decoder, "rotary_emb", None)
        if not layers or rotary is None:
            return False
        takes = inspect.signature(type(layers[0]).forward).parameters
        rotary_needs = [n for n, p in inspect.signature(type(rotary).forward).parameters.items()
                        if n != "self" and p.default is inspect.Parameter.empty
                        and p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL)]
        return (cache_keyword(type(layers[0]).forward) in takes and "position_embeddings" in takes
                and rotary_needs == ["x", "position_ids"])

    @property
    def eos_token_ids(self) -> set[int]:
        ids: set[int] = set()
        for source in (getattr(self.model, "generation_config", None), self.config):
            eos = getattr(source, "eos_token_id", None)
            if eos is not None:
                ids.update([eos] if isinstance(eos, int) else eos)
        return ids

    def fingerprint(self) -> dict:
        """What a draft head must match: architecture sizes plus a hash of the token embeddings.

        The hash is taken over the first 64 embedding rows rounded to bf16, so the same target loaded
        in fp32 or bf16 has the same fingerprint.
        """
        rows = self.embed_tokens.weight[:64].detach().to("cpu", torch.bfloat16).contiguous()
        digest = hashlib.sha256(rows.view(torch.int16).numpy().tobytes()).hexdigest()[:16]
        return {
            "name": self.name,
            "model_type": self.config.model_type,
            "hidden_size": self.hidden_size,
            "vocab_size": self.vocab_size,
            "num_hidden_layers": self.config.num_hidden_layers,
            "embedding_sha": digest,
        }

    @contextlib.contextmanager
    def stock(self) -> Iterator[None]:
        """Run a block on the model as transformers built it: its own linears and SDPA attention (baselines)."""
        implementation = self.model.config._attn_implementation
        stack, self.accelerated.stack = self.accelerated.stack, None
        with stock(self.model):
            if implementation != "sdpa":
                self.model.set_attn_implementation("sdpa")
            try:
                yield
            finally:
                self.accelerated.stack = stack
                if implementation != "sdpa":
                    self.model.set_attn_implementation(implementation)

    # -- running it ----------------------------------------------------------------------------------
    def new_cache(self, max_len: int) -> StaticKVCache:
        """A cache of max_len slots (the engine checks the context window; slots past it hold only
        tree nodes whose tokens are never emitted)."""
        cfg = self.config
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        kv_heads = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
        return StaticKVCache(cfg.num_hidden_layers, kv_heads, head_dim, max_len, self.dtype, self.device)

    def forward(self, input_ids: torch.Tensor, cache: StaticKVCache, ancestors: torch.Tensor | None = None,
                depths: torch.Tensor | None = None, logits_rows: torch.Tensor | slice | None = None,
                taps: tuple[int, ...] = ()):
        """Run T new tokens after the cache's committed prefix.

        input_ids: [T]. ancestors: [T, T] bool, row i marks the tokens node i may see (itself included);
        None means a causal chain. depths: [T] distance from the block's first token (positions are
        prefix_len + depth); None means 0..T-1. logits_rows: which rows get lm_head logits (None: none).
        Returns (logits [R, V] or None, hidden [T, H]). The caller commits or compacts the cache.
        taps: decoder layers (0-based, not the last) whose outputs a draft head reads besides the final hidden
        states (EAGLE-3's low/mid/high features, `DraftHead.feature_layers`); then the return value is
        (logits, hidden, features [T, len(taps) * H]), the layers' outputs concatenated in the order given.
        """
        t = input_ids.numel()
        start = cache.length
        cache.reserve(t)
        steps = torch.arange(t, device=input_ids.device) if depths is None else depths
        features = None
        stack = self.accelerated.stack
        if stack is not None and stack.takes(t, cache):
            visible = None if ancestors is None else attention_mask(start, ancestors)[0, 0]   # T start+T
            hidden = stack(input_ids, steps + start, cache, visible, taps)                    # T H
            if taps:
                hidden, features = hidden
        else:
            if ancestors is None:
                ancestors = torch.ones(t, t, dtype=torch.bool, device=input_ids.device).tril_()
            mask = attention_mask(start, ancestors)
            out = self.decoder(
                input_ids=input_ids.view(1, t),
                attention_mask=self.masks(mask, lambda: windowed(mask[0, 0], start, steps + start,
                                                                 self.window)[None, None]),
                position_ids=(steps + start).view(1, t),
                use_cache=True,
                output_hidden_states=bool(taps),
                **with_cache(self.decoder, cache),
            )
            hidden = out.last_hidden_state[0]  # T H
            if taps:  # hidden_states[0] is the embedding output, [i + 1] layer i's
                features = torch.cat([out.hidden_states[i + 1][0] for i in taps], dim=-1)
        logits = None if logits_rows is None else self.logits(hidden[logits_rows])
        return (logits, hidden, features) if taps else (logits, hidden)

    def verify(self, blocks: list[tuple], taps: tuple[int, ...] = ()) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Run several sequences' blocks in ONE forward: blocks [(input_ids [n_i], cache_i, ancestors [n_i, n_i]
        or None, depths [n_i] or None)], each as `forward` takes it on its own cache.

        The blocks are packed into one row of sum n_i tokens; token j of block i sits at position
        cache_i.length + depth_j and sees its own cache's committed prefix and its own ancestors only (a
        block-diagonal tree mask over per-sequence caches), so every block's hidden states are the ones its own
        forward gives, to fp32 rounding (bit for bit through the fused stack). The linears read their weights once
        for all the rows, which is what makes a batch cheaper than its sequences one by one on a memory-bound CPU.
        One block runs `forward` itself: batch 1 is exactly what a single sequence runs.
        Returns per block (hidden [n_i, H], features [n_i, H'] = hidden, or the taps' outputs when given)."""
        if len(blocks) == 1:
            out = self.forward(*blocks[0], taps=taps)
            return [(out[1], out[2]) if taps else (out[1], out[1])]
        rows = [ids.numel() for ids, *_ in blocks]
        caches = [cache for _, cache, *_ in blocks]
        positions, visible = [], []
        for (ids, cache, ancestors, depths), n in zip(blocks, rows):
            if ancestors is None:
                ancestors = torch.ones(n, n, dtype=torch.bool, device=ids.device).tril_()
            steps = torch.arange(n, device=ids.device) if depths is None else depths
            positions.append(steps + cache.length)
            visible.append(attention_mask(cache.length, ancestors)[0, 0])   # n_i length_i+n_i
            cache.reserve(n)
        input_ids, positions = torch.cat([b[0] for b in blocks]), torch.cat(positions)   # T, T
        t = input_ids.numel()
        features = None
        stack = self.accelerated.stack
        if stack is not None and stack.takes_packed(t, caches):
            hidden = stack.packed(input_ids, positions, caches, visible, taps)            # T H
            if taps:
                hidden, features = hidden
        else:
            out = self.decoder(
                input_ids=input_ids.view(1, t),
                attention_mask=self.masks(packed_mask(visible), lambda: packed_mask([
                    windowed(v, c.length, p, self.window) for v, c, p in zip(visible, caches, positions.split(rows))])),
                position_ids=positions.view(1, t),
                use_cache=True,
                output_hidden_states=bool(taps),
                **with_cache(self.decoder, PackedKVCache(caches, rows)),
            )
            hidden = out.last_hidden_state[0]  # T H
            if taps:
                features = torch.cat([out.hidden_states[i + 1][0] for i in taps], dim=-1)
        hidden = hidden.split(rows)
        features = hidden if features is None else features.split(rows)
        return list(zip(hidden, features))

    def check_taps(self, taps: tuple[int, ...], what: str = "a draft head") -> None:
        """Refuse feature layers this target does not have (the last layer's output is the final hidden state)."""
        layers = self.config.num_hidden_layers
        bad = [i for i in taps if not 0 <= i <= layers - 2]
        if bad or len(set(taps)) != len(taps):
            example = sorted({0, (layers - 2) // 2, max(layers - 2, 0)})
            raise ValueError(f"{what} reads the outputs of decoder layers {list(taps)}, but target '{self.name}' has "
                             f"{layers} layers: feature layers are distinct, from 0 to {layers - 2} (e.g. "
                             f"{example})")

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The lm_head's logits [R, V] of final hidden states [R, H] (lm_head.LmHead.logits)."""
        return self.lm.logits(hidden)

    def top_token(self, hidden: torch.Tensor) -> int:
        """The greedy token for one final hidden state [H] (lm_head.LmHead.top_token: exact fp32 argmax)."""
        return self.lm.top_token(hidden)

    @property
    def lm_grid(self):
        """The lm_head's grid codes (None where its weight lies on no GGUF grid or the speed-ups are off)."""
        return self.lm.grid


def mask_window(config, decoder: nn.Module) -> int | None:
    """The sliding window of a model whose sliding layers take a mask of their own: its decoder's forward takes a
    mapping of masks by layer type (transformers' Gemma 2/3, Qwen 2 and the like). None: no sliding layers, or one
    mask for every layer (Mistral: `Target.max_context` is then capped at the window)."""
    window, types = getattr(config, "sliding_window", None), getattr(config, "layer_types", None)
    if not window or not types or "sliding_attention" not in types:
        return None
    try:
        source = inspect.getsource(type(decoder).forward)
    except (OSError, TypeError):
        return None
    return int(window) if "causal_mask_mapping := attention_mask, dict" in source else None


def unverifiable(name: str, model: nn.Module, problem: str) -> ValueError:
    """The error for a model eagle_lite cannot verify draft trees on, saying why and what would work."""
    return ValueError(f"target '{name}' ({type(model).__name__}) cannot be verified exactly by eagle_lite: {problem}. "
                      f"It needs attention through transformers' attention interface with boolean masks and a "
                      f"key/value cache (Llama, Qwen, Mistral, Gemma, Phi, GPT-2, GPT-NeoX, Falcon, OPT, ... do)")


def probe_logits(model: nn.Module, lm_head: nn.Module, name: str = "target") -> tuple[torch.Tensor, torch.Tensor]:
    """(ids [6], the model's own fp32 logits of them [6, V]): any few tokens, for the load-time checks."""
    ids = (torch.arange(6, device=lm_head.weight.device) * 7919 + 3) % lm_head.weight.shape[0]
    try:
        with torch.inference_mode():
            return ids, model(input_ids=ids[None]).logits[0].float()
    except Exception as err:  # noqa: BLE001 (whatever fails, the model cannot be run this way)
        raise unverifiable(name, model, f"its own forward fails on a few tokens ({type(err).__name__}: {err})") from err


def logits_transform(model: nn.Module, decoder: nn.Module, lm_head: nn.Module, ids: torch.Tensor,
                     expected: torch.Tensor, name: str = "target"):
    """What `model` does to lm_head(last hidden state) to make its logits: None (nothing, most models), or the
    function that does it. Some models scale (Granite divides by `logits_scaling`, Cohere multiplies by
    `logit_scale`) or soft-cap them (Gemma 2/3: `final_logit_softcapping`); all keep the argmax, but sampling
    from unscaled logits would not sample the target. Found against the model's own logits `expected` of `ids`
    (`probe_logits`), so a model that does something else is refused instead of sampled wrong."""
    cfg = model.config
    candidates: list = [None]
    cap = getattr(cfg, "final_logit_softcapping", None)
    if cap:
        candidates.append(lambda x: torch.tanh(x / cap) * cap)
    for key in ("logits_scaling", "logit_scale"):
        scale = getattr(cfg, key, None)
        if isinstance(scale, (int, float)) and scale not in (0, 1):
            candidates += [lambda x, s=scale: x / s, lambda x, s=scale: x * s]
    with torch.inference_mode():
        raw = lm_head(decoder(input_ids=ids[None]).last_hidden_state)[0].float()  # T V
        errors = [float(((raw if f is None else f(raw)) - expected).norm()) for f in candidates]
        best = min(range(len(candidates)), key=errors.__getitem__)   # the closest: a soft cap barely moves small logits
        if errors[best] <= 1e-2 * float(expected.norm()) + 1e-6:       # bf16 rounding passes, a wrong form does not
            return candidates[best]
    raise unverifiable(name, model, "it computes its logits as something other than its lm_head of the last hidden "
                                    "state (or a scaling or soft cap of it)")
