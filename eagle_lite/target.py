"""The target model: any transformers causal LM, run one forward at a time over a static KV cache.

`Target.forward` takes a block of tokens that is either a chain (prefill, plain decoding) or a draft
tree (given by its ancestor mask and depths) and returns the last hidden states of every token (what
the draft head reads) plus logits for only the rows the caller asks for: the lm_head is the single
most expensive matrix of a small model, so prefill computes one row, not the whole prompt, and a tree
verification hands acceptance a `NodeLogits` that projects a node only when the walk reaches it. Greedy
decoding needs only each row's argmax: `top_token` finds it from a float16 copy of the lm_head on CPU,
exactly (certified_argmax.py).

A model is taken only after it proves it runs this way: at load, a few tokens through the cached tree forward
must give its own full forward's logits (`_check_tree_forward`), and `logits` applies whatever scaling or
soft cap the model puts on its lm_head output (`logits_transform`), so sampling draws from the model's own law.
"""
from __future__ import annotations

import contextlib
import hashlib
import inspect
from typing import Iterator

import torch
from torch import nn

from .attention import select_attention
from .certified_argmax import CertifiedArgmax
from .cpu_linear import few_rows_product, pack_linears, unpacked
from .fused_layer import FusedStack, fuse_decoder_layers, fuse_stack, unfused_layers
from .fused_norm import fuse_rms_norms, unfused
from .grid_linear import GridWeight, grid_of
from .kv_cache import StaticKVCache, cache_keyword, with_cache
from .tree import attention_mask

# On CPU a one-row lm_head product streams a transposed (H x V) copy of the weight about twice as fast
# as the row-major original (MKL's gemv), so targets whose lm_head is at most this large keep one.
TRANSPOSED_LM_HEAD_MAX_BYTES = 512 << 20


class Target:
    """A loaded transformers causal LM (`model`) and its tokenizer, with the pieces EAGLE needs."""

    def __init__(self, model: nn.Module, tokenizer=None, name: str = "target", attention: str = "sdpa",
                 packed_linears: bool = True, fused_norms: bool = True) -> None:
        """packed_linears: on CPU in fp32, give the decoder's linears a faster few-row product for decoding and
        tree verification (eagle_lite/cpu_linear.py: an instance `forward` on each layer of `model`): 4-bit
        codes where the weights lie exactly on a GGUF grid (grid_linear.py), else a oneDNN-packed copy.
        fused_norms: run its RMSNorms as one op where that is exact to the bit (eagle_lite/fused_norm.py).
        Both: a decoder layer whose projections run from grid codes runs as one native op, and a stack of
        such layers runs few-token forwards without the model's forward around them (eagle_lite/fused_layer.py).
        `Target.stock()` runs a block on the library's own forwards and attention."""
        if getattr(model.config, "is_encoder_decoder", False):
            raise ValueError(f"target '{name}' is an encoder-decoder model; eagle_lite needs a causal LM")
        # Tree masks are boolean 4-D masks; transformers' SDPA path takes them as they are ("eager" would
        # read them as additive and silently give wrong logits).
        # --- attention backend (eagle_lite/attention.py): auto | sdpa | gqa | flex | lse_merge | flash ---
        if not (getattr(model, "_supports_attention_backend", False) or getattr(model, "_supports_sdpa", False)):
            raise unverifiable(name, model, "its attention takes neither transformers' attention interface nor SDPA "
                                            "(state-space and recurrent models such as Mamba have no attention to mask)")
        if getattr(model.config, "attn_logit_softcapping", None) and attention in ("auto", "sdpa"):
            attention = "gqa"   # Gemma 2 soft-caps attention scores: no SDPA kernel does, gqa's torch path does
        implementation = select_attention(attention, model)  # "sdpa" for the default
        if model.config._attn_implementation != implementation:
            model.set_attn_implementation(implementation)
        # --- end attention backend ---
        self.model = model.eval()
        self.tokenizer = tokenizer
        self.name = name
        self.config = model.config
        self.decoder = model.get_decoder()            # the transformer stack without the lm_head
        if packed_linears:
            pack_linears(self.decoder)                # no-op off CPU and for non-fp32 weights
        if fused_norms:
            fuse_rms_norms(self.decoder)              # no-op off CPU, for non-fp32 weights or inexact norms
        self._stack: FusedStack | None = None
        if packed_linears and fused_norms:
            # whole layers as one native op where they run from grid codes, and then the stack of them
            fuse_decoder_layers(getattr(self.decoder, "layers", []), getattr(self.decoder, "rotary_emb", None))
            self._stack = fuse_stack(self.decoder)
        self.lm_head = model.get_output_embeddings()  # hidden -> vocab logits
        self.embed_tokens = model.get_input_embeddings()
        # the lm_head as integer codes where its fp32 weight lies on a GGUF grid (SmolLM2's is Q8_0): exact
        # fp32 logits from 9 bits a weight, for greedy's argmax and for a few rows (grid_linear.py)
        plain_head = type(self.lm_head) is nn.Linear and self.lm_head.weight.device.type == "cpu"
        self._lm_grid = grid_of(self.lm_head.weight) if packed_linears and plain_head else None
        self._lm_head_t: torch.Tensor | None = None   # H V copy for one-row products on CPU (see logits)
        # one forward of the model's own on a few tokens serves both load-time checks
        ids, expected = probe_logits(model, self.lm_head, name)
        # what the model does to lm_head's output (a scale, a soft cap; None: nothing)
        self._finish = logits_transform(model, self.decoder, self.lm_head, ids, expected, name)
        self._argmax: CertifiedArgmax | None | bool = False  # float16 argmax path (see top_token); False: not built
        self._check_tree_forward(ids, expected)

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
        """Tokens the target can attend over. A sliding attention window caps it: the tree masks here
        give every token the whole prefix, which equals windowed attention only inside the window."""
        cfg = self.config
        limit = int(getattr(cfg, "max_position_embeddings", 0) or 1 << 20)
        window = getattr(cfg, "sliding_window", None)
        layer_types = getattr(cfg, "layer_types", None)
        if window and (layer_types is None or "sliding_attention" in layer_types):
            limit = min(limit, int(window))
        return limit

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
        stack, self._stack = self._stack, None
        with unpacked(self.model), unfused(self.model), unfused_layers(self.model):
            if implementation != "sdpa":
                self.model.set_attn_implementation("sdpa")
            try:
                yield
            finally:
                self._stack = stack
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
        if self._stack is not None and self._stack.takes(t, cache):
            visible = None if ancestors is None else attention_mask(start, ancestors)[0, 0]   # T start+T
            hidden = self._stack(input_ids, steps + start, cache, visible, taps)             # T H
            if taps:
                hidden, features = hidden
        else:
            if ancestors is None:
                ancestors = torch.ones(t, t, dtype=torch.bool, device=input_ids.device).tril_()
            out = self.decoder(
                input_ids=input_ids.view(1, t),
                attention_mask=attention_mask(start, ancestors),
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

    def check_taps(self, taps: tuple[int, ...], what: str = "a draft head") -> None:
        """Refuse feature layers this target does not have (the last layer's output is the final hidden state)."""
        layers = self.config.num_hidden_layers
        bad = [i for i in taps if not 0 <= i <= layers - 2]
        if bad or len(set(taps)) != len(taps):
            raise ValueError(f"{what} reads the outputs of decoder layers {list(taps)}, but target '{self.name}' has "
                             f"{layers} layers: feature layers are distinct, from 0 to {layers - 2}")

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The lm_head's logits [R, V] of final hidden states [R, H], in the fastest form for R and device.

        On CPU a few rows are memory-bound on the V x H weight: grid codes (Q8_0) where the weight has them;
        else one row streams the transposed copy
        (~2x faster than `F.linear`'s gemv), and 2-8 rows run as W @ h^T (~2x faster than `F.linear`'s
        small-M GEMM). Each product is the same sum of the same fp32 terms, to rounding.
        """
        out = self._lm_head_product(hidden)
        return out if self._finish is None else self._finish(out)

    def _lm_head_product(self, hidden: torch.Tensor) -> torch.Tensor:
        weight, bias = self.lm_head.weight, getattr(self.lm_head, "bias", None)
        if self._lm_grid is not None and self._lm_grid.takes(hidden):
            out = self._lm_grid(hidden)
            return out if bias is None else out + bias
        if weight.device.type != "cpu" or type(self.lm_head) is not nn.Linear or hidden.shape[0] > 8:
            return self.lm_head(hidden)
        if hidden.shape[0] == 1 and self._transposed_lm_head() is not None:
            out = hidden @ self._lm_head_t
        else:
            out = few_rows_product(hidden, weight)
        return out if bias is None else out + bias

    @property
    def lm_grid(self) -> GridWeight | None:
        """The lm_head's grid codes (None where its weight lies on no GGUF grid or the kernels do not run)."""
        return self._lm_grid

    def top_token(self, hidden: torch.Tensor) -> int:
        """The greedy token for one final hidden state [H]: argmax of its fp32 logits. On CPU they come from
        the lm_head's grid codes where it has them, else from a float16 copy of the lm_head with an error
        bound that makes the answer exact (certified_argmax.py)."""
        if self._lm_grid is not None:
            return int(self.logits(hidden[None])[0].argmax())
        if self._argmax is False:
            plain = type(self.lm_head) is nn.Linear and getattr(self.lm_head, "bias", None) is None
            had_transposed = self._lm_head_t is not None
            self._argmax = CertifiedArgmax.build(self.lm_head.weight, self._lm_head_product) if plain else None
            if self._argmax is not None and not had_transposed:
                self._lm_head_t = None   # built only to time the fp32 row against: greedy no longer needs it
        if self._argmax is None:
            return int(self.logits(hidden[None])[0].argmax())
        return self._argmax(hidden)

    def _transposed_lm_head(self) -> torch.Tensor | None:
        weight = self.lm_head.weight
        if self._lm_head_t is None and weight.numel() * weight.element_size() <= TRANSPOSED_LM_HEAD_MAX_BYTES:
            with torch.inference_mode(False):  # a normal tensor: callers may run outside inference mode
                self._lm_head_t = weight.detach().t().contiguous()
        return self._lm_head_t


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


class NodeLogits:
    """The target's logits of the nodes of a verified tree, projected through the lm_head on demand.

    Acceptance reads the logits of the nodes it walks through (the accepted path and the node where it
    stops), a few of the tree's nodes; on CPU each lm_head row costs as much as a decoder layer, so
    `lazy` projects a node when it is first read. Otherwise (GPU) all rows are projected in one product.
    `likely`: nodes the walk will probably read (the draft's likeliest path): where the lm_head runs from
    grid codes, the first read of one of them projects them all in one product, which reads the weight
    once for all of them (SmolLM2: 2.0 ms for 3 rows against 1.6 for one). `nodes[i]` is node i's logits [V].
    """

    def __init__(self, target: Target, hidden: torch.Tensor, lazy: bool | None = None,
                 likely: list[int] | None = None) -> None:
        self.target, self.hidden = target, hidden  # N H, final hidden states of the tree's nodes
        self.lazy = hidden.device.type == "cpu" if lazy is None else lazy
        self._all = None if self.lazy else target.logits(hidden)
        self._rows: dict[int, torch.Tensor] = {}
        self._tops: dict[int, int] = {}
        self._likely = likely if self.lazy and likely and len(likely) > 1 and target.lm_grid is not None else None
        self.projected = 0 if self.lazy else hidden.shape[0]   # nodes whose logits or argmax were computed

    def _project_likely(self, node: int) -> None:
        if self._likely is not None and node in self._likely:
            rows, self._likely = self._likely, None
            self._rows.update(zip(rows, self.target.logits(self.hidden[rows])))
            self.projected += len(rows)

    def top_token(self, node: int) -> int:
        """The target's greedy token at `node` (its logits' argmax); lazily, without an fp32 row on CPU."""
        if self._all is not None:
            return int(self._all[node].argmax())
        if node not in self._tops:
            self._project_likely(node)
        if node in self._rows:
            return int(self._rows[node].argmax())
        if node not in self._tops:
            self._tops[node] = self.target.top_token(self.hidden[node])
            self.projected += 1
        return self._tops[node]

    def __getitem__(self, node: int) -> torch.Tensor:
        if self._all is not None:
            return self._all[node]
        self._project_likely(node)
        row = self._rows.get(node)
        if row is None:
            row = self._rows[node] = self.target.logits(self.hidden[node:node + 1])[0]
            self.projected += 1
        return row
