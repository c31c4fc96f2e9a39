"""Attention backends for tree verification, chosen at run time and registered with transformers.

Verifying a draft tree attends T new tokens to P cached prefix tokens plus the T tokens themselves: every
token sees the whole prefix, and inside the tree block only its ancestors (`tree.attention_mask` builds
that dense boolean mask [1, 1, T, P + T]). Four ways to compute the same thing:

  sdpa       transformers' own SDPA call with the dense boolean mask (the reference). With a mask it repeats
             the k/v heads of grouped-query attention into full heads first (a copy of the cache per layer).
  gqa        the same torch SDPA kernel and mask with `enable_gqa=True`: no k/v repeat, which makes a CPU
             verify of SmolLM2 (3 kv heads for 9 query heads) cheaper, the more so the longer the prefix
             (docs/attention.md). 'auto' picks it on CPU. There, calls of up to 8 fp32 queries (a small
             tree, a decoding step) run eagle_lite's native loop (csrc/tree_attention.cpp) where it builds:
             the same arithmetic without SDPA's per-call setup, [T, H, D] out with no transpose. A
             prompt read from an empty cache (a plain causal mask, T = S) runs SDPA's causal kernel,
             which skips the hidden half a mask makes it compute (a long prefill's attention shrinks by that).
  flex       PyTorch FlexAttention with a BlockMask made from the dense mask: fully visible blocks (the
             prefix) run without evaluating the mask, fully hidden blocks are skipped. Compiled on CUDA; eager
             on CPU, where torch 2.13's compiled CPU kernel fails to build once the query length changes.
  lse_merge  split: unmasked attention over the P prefix keys (a flash-class kernel that also returns the
             log-sum-exp; torch's CPU flash kernel here) merged by log-sum-exp with a small dense masked
             attention over the T x T tree block.
  flash      the same split with flash-attn's kernel for the prefix (CUDA, fp16/bf16). flash-attn is an
             optional package: importing it is guarded, and asking for 'flash' without it is a clear error.

Each non-default backend is registered with transformers' `AttentionInterface` (and, for plain calls such
as `generate()`, with `AttentionMaskInterface` as SDPA's boolean mask), so the library's own model classes
call it through `config._attn_implementation`; nothing is set on the model and no modeling file is copied.
The split backends rely on the contract of `tree.attention_mask` (the first S - T keys are visible to every
query); they check it once per forward and refuse other masks (e.g. left padding) instead of answering wrong.
"""
from __future__ import annotations

import functools
import math
import warnings

import torch
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from . import native

try:  # FlexAttention arrived in torch 2.5
    from torch.nn.attention.flex_attention import BlockMask, create_block_mask, flex_attention
except ImportError:
    BlockMask = create_block_mask = flex_attention = None

# torch's CPU flash kernel: the only public-in-practice CPU kernel that returns the log-sum-exp
_CPU_FLASH = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)

BACKENDS = ("sdpa", "gqa", "flex", "lse_merge", "flash")
# Keys in transformers' registries. They avoid the substrings "sdpa", "flash" and "flex_attention", which
# transformers matches to run its own checks (any key containing "flash" makes it import flash-attn).
KEYS = {"sdpa": "sdpa", "gqa": "eagle_lite_gqa", "flex": "eagle_lite_flex", "lse_merge": "eagle_lite_lse_merge",
        "flash": "eagle_lite_fa2_split"}
_HALF = (torch.float16, torch.bfloat16)
_SDPA_HAS_GQA = "enable_gqa" in (torch.nn.functional.scaled_dot_product_attention.__doc__ or "")  # torch >= 2.5


class BackendUnavailableError(ValueError):
    """The backend exists but cannot run here (a missing package, the wrong device or dtype)."""


# -- choosing a backend ------------------------------------------------------------------------------
@functools.cache
def flash_attn_func():
    """flash-attn's `flash_attn_func`, or None where the package is not importable (it is optional)."""
    try:
        from flash_attn import flash_attn_func as func
    except (ImportError, OSError, RuntimeError):  # not installed, or built for another torch/CUDA
        return None
    return func


def _flex_kernel(device_type: str):
    """FlexAttention as it should run on this device: compiled on CUDA (the fused Triton kernel), eager on
    CPU (correct but unfused; inductor's CPU template fails to build when the query length changes)."""
    return _compiled_flex() if device_type == "cuda" else flex_attention


@functools.cache
def _compiled_flex():
    return torch.compile(flex_attention)


def resolve_backend(name: str, device: torch.device | str, dtype: torch.dtype | None = None) -> str:
    """The backend (one of BACKENDS) that `name` means for a model on `device` (in `dtype`, when known).

    'auto' picks flash > gqa > sdpa:
      flash  when flash-attn is importable, the device is CUDA and the dtype is fp16/bf16: the prefix, which
             is nearly all of the work, runs unmasked in the fastest kernel and the T x T tree block is tiny;
      gqa    otherwise: SDPA's own kernels with the mask, without the k/v repeat (sdpa where torch's SDPA has
             no enable_gqa). Not flex: compiled FlexAttention recompiles for every new query and key length,
             which the engine's steps change every time, and past dynamo's recompile limit runs unfused: on
             a GPU that held the engine far below its other backends (docs/attention.md). 'auto' never raises.
    An explicit name is checked: an unknown one raises ValueError, an unavailable one BackendUnavailableError.
    """
    device = torch.device(device)
    key = str(name).strip().lower()
    if key == "auto":
        if _flash_problem(device, dtype) is None:
            return "flash"
        return "gqa" if _SDPA_HAS_GQA else "sdpa"
    if key not in BACKENDS:
        raise ValueError(f"unknown attention backend {name!r}; choose one of: auto, {', '.join(BACKENDS)}")
    if key == "flash" and (problem := _flash_problem(device, dtype)) is not None:
        raise BackendUnavailableError(
            f"attention backend 'flash' cannot run here: {problem}. Use 'lse_merge' (the same prefix/tree "
            "split on torch kernels), 'sdpa', or 'auto' (picks the best available)")
    if key == "gqa" and not _SDPA_HAS_GQA:
        raise BackendUnavailableError(f"attention backend 'gqa' needs torch>=2.5 (SDPA's enable_gqa); this is "
                                      f"torch {torch.__version__}. Use 'sdpa' or 'auto'")
    if key == "flex" and flex_attention is None:
        raise BackendUnavailableError(f"attention backend 'flex' needs torch>=2.5 (FlexAttention); this is "
                                      f"torch {torch.__version__}. Use 'sdpa' or 'auto'")
    return key


def _flash_problem(device: torch.device, dtype: torch.dtype | None) -> str | None:
    if flash_attn_func() is None:
        return "the flash-attn package is not importable (pip install flash-attn, on a CUDA machine)"
    if device.type != "cuda":
        return f"flash-attn needs a CUDA device, the model is on {device}"
    if dtype is not None and dtype not in _HALF:
        return f"flash-attn needs fp16 or bf16, the model is {dtype}"
    return None


def select_attention(name: str, model: torch.nn.Module) -> str:
    """Resolve `name` for `model`'s device and dtype, register the backend, and return the key to pass to
    `model.set_attn_implementation`."""
    weight = next(model.parameters())
    backend = resolve_backend(name, weight.device, weight.dtype)
    if backend != "sdpa":  # the default touches nothing in transformers' registries
        _register()
    return KEYS[backend]


@functools.cache
def _register() -> None:
    for backend, fn in (("gqa", _gqa_forward), ("flex", _flex_forward), ("lse_merge", _split_forward),
                        ("flash", _flash_split_forward)):
        AttentionInterface.register(KEYS[backend], fn)
        # plain calls (generate(), a forward without a 4-D mask) get SDPA's boolean mask, or None when causal
        AttentionMaskInterface.register(KEYS[backend], sdpa_mask)


# -- the kernels: q [B, H, T, D], k/v [B, Hkv, S, D], H a multiple of Hkv (GQA) -------------------------
def dense_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, visible: torch.Tensor | None,
                    scale: float, softcap: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """softmax(q k^T * scale, masked) v in plain torch, at least fp32 (float64 stays float64). softcap: the
    scores pass through softcap * tanh(score / softcap) first (Gemma 2's attention), as transformers' eager does.

    visible: [B|1, 1, T, S] bool, or None for all keys; every row must see at least one key.
    Returns (out [B, H, T, D], lse [B, H, T]) in the compute dtype.
    """
    b, h, t, d = q.shape
    kv_heads = k.shape[1]
    dtype = torch.promote_types(q.dtype, torch.float32)
    q5 = q.to(dtype).reshape(b, kv_heads, h // kv_heads, t, d)             # B Hkv R T D: head h reads kv h // R
    scores = q5 @ k.to(dtype).unsqueeze(2).transpose(-1, -2) * scale       # B Hkv R T S
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    if visible is not None:
        scores = scores.masked_fill(~visible.unsqueeze(2), float("-inf"))  # mask [B 1 1 T S] spans all heads
    lse = torch.logsumexp(scores, dim=-1)                                  # B Hkv R T
    out = torch.exp(scores - lse.unsqueeze(-1)) @ v.to(dtype).unsqueeze(2)  # B Hkv R T D
    return out.reshape(b, h, t, d), lse.reshape(b, h, t)


def prefix_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                     use_flash: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Unmasked attention of every query over all of k/v, with its log-sum-exp.

    Kernel: flash-attn when asked for and usable (CUDA, fp16/bf16), torch's CPU flash kernel on CPU, else
    plain torch. Returns (out [B, H, T, D], lse [B, H, T]); lse is fp32 or wider.
    """
    b, h, t, d = q.shape
    kv_heads = k.shape[1]
    if use_flash and q.is_cuda and q.dtype in _HALF and flash_attn_func() is not None:
        out, lse, _ = flash_attn_func()(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),  # B T H D
                                        softmax_scale=scale, causal=False, return_attn_probs=True)
        return out.transpose(1, 2), lse                                   # B H T D, B H T (fp32)
    if q.device.type == "cpu" and _CPU_FLASH is not None and q.dtype in (torch.float32, *_HALF):
        # With no mask the R query heads of a kv group are just more rows: no repeat of k/v needed
        rows = q.reshape(b, kv_heads, (h // kv_heads) * t, d)             # B Hkv R*T D
        out, lse = _CPU_FLASH(rows, k, v, 0.0, False, scale=scale)        # B Hkv R*T D, B Hkv R*T
        return out.reshape(b, h, t, d), lse.reshape(b, h, t)
    return dense_attention(q, k, v, None, scale)


def merge_lse(out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor,
              lse_b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention over keys A ∪ B from the attentions over A and over B (disjoint key sets).

    softmax over A ∪ B weighs A's normalised output by sum_A exp / sum_{A∪B} exp = exp(lse_a - lse), and
    likewise B. out_*: [..., T, D]; lse_*: [..., T]. Computed in the wider of the lse dtypes (>= fp32).
    """
    dtype = torch.promote_types(torch.promote_types(lse_a.dtype, lse_b.dtype), torch.float32)
    lse_a, lse_b = lse_a.to(dtype), lse_b.to(dtype)
    lse = torch.logaddexp(lse_a, lse_b)
    out = (out_a.to(dtype) * torch.exp(lse_a - lse).unsqueeze(-1)
           + out_b.to(dtype) * torch.exp(lse_b - lse).unsqueeze(-1))
    return out, lse


def split_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
                    scale: float, use_flash: bool = False) -> torch.Tensor:
    """Tree attention as prefix (unmasked) + tree block (dense, masked), merged by log-sum-exp.

    mask: [B|1, 1, T, S] bool whose first P = S - T columns are all True (not checked here), or None for
    causal. Returns [B, H, T, D] in q's dtype.
    """
    t, s = q.shape[2], k.shape[2]
    p = s - t
    visible = _causal(t, t, q.device) if mask is None else mask[..., p:]  # B|1 1 T T
    out_tree, lse_tree = dense_attention(q, k[:, :, p:], v[:, :, p:], visible, scale)
    if p == 0:
        return out_tree.to(q.dtype)
    out_prefix, lse_prefix = prefix_attention(q, k[:, :, :p], v[:, :, :p], scale, use_flash)
    return merge_lse(out_prefix, lse_prefix, out_tree, lse_tree)[0].to(q.dtype)


def flex_tree_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask, scale: float) -> torch.Tensor:
    """FlexAttention with a BlockMask of `mask` ([B|1, 1, T, S] bool, None for causal, or a BlockMask).
    Exact for any boolean mask: the BlockMask only says which blocks to skip or run unmasked."""
    t, s = q.shape[2], k.shape[2]
    if BlockMask is not None and isinstance(mask, BlockMask):
        block_mask = mask
    else:
        block_mask = _per_forward("flex", mask, t, s, q.device, _block_mask)
    with warnings.catch_warnings():  # eager on CPU is deliberate (see _flex_kernel)
        warnings.filterwarnings("ignore", message="flex_attention called without torch.compile")
        return _flex_kernel(q.device.type)(q, k, v, block_mask=block_mask, scale=scale,
                                           enable_gqa=q.shape[1] != k.shape[1])


def _causal(t: int, s: int, device) -> torch.Tensor:
    """[1, 1, T, S] bool, bottom-right aligned: query i is the token at key slot S - T + i."""
    return torch.ones(t, s, dtype=torch.bool, device=device).tril_(s - t).view(1, 1, t, s)


def _causal_block_mask(t: int, s: int, device):
    offset = s - t
    return create_block_mask(lambda b, h, qi, ki: ki <= qi + offset, None, None, t, s, device=device)


def _block_mask(mask: torch.Tensor | None, t: int, s: int, device):
    if mask is None:
        return _causal_block_mask(t, s, device)
    if mask.shape[1] != 1:
        raise ValueError(f"attention backend 'flex' takes one mask for all heads, got shape {tuple(mask.shape)}")
    dense = mask[:, 0]                                                      # B|1 T S
    if dense.shape[0] == 1:
        grid = dense[0]                                                     # T S
        return create_block_mask(lambda b, h, qi, ki: grid[qi, ki], None, None, t, s, device=device)
    return create_block_mask(lambda b, h, qi, ki: dense[b, qi, ki], dense.shape[0], None, t, s, device=device)


# What was derived from the last mask, per kind. All layers of one forward receive the same mask object,
# so the BlockMask (or the prefix check) is made once per forward; holding the mask keeps `is` exact.
_LAST: dict[str, tuple] = {}


def _per_forward(kind: str, mask, t: int, s: int, device, make):
    last = _LAST.get(kind)
    if last is not None and last[0] is mask and last[1] == (t, s, device):
        return last[2]
    value = make(mask, t, s, device)
    _LAST[kind] = (mask, (t, s, device), value)
    return value


def _check_prefix_visible(mask: torch.Tensor | None, t: int, s: int, device) -> bool:
    if mask is None or s == t:
        return True
    if not isinstance(mask, torch.Tensor) or mask.dtype != torch.bool:
        raise TypeError("the split attention backends take boolean mask tensors (tree.attention_mask), "
                        f"got {getattr(mask, 'dtype', type(mask).__name__)}")
    # on CUDA this does not synchronise; a violation surfaces as a device-side assert
    torch._assert_async(mask[..., :s - t].all(), "lse_merge/flash attention needs every query to see the whole "
                        "prefix (a tree-verify mask); use attention='sdpa' or 'flex' for other masks")
    return True


# -- transformers' attention-function signature: (module, q, k, v, mask, ...) -> ([B, T, H, D], None) ----
def _refuse_unsupported(backend: str, dropout: float, kwargs: dict) -> None:
    if dropout:
        raise ValueError(f"attention backend {backend!r} is for inference; got dropout={dropout}")
    for feature in ("softcap", "s_aux"):
        if kwargs.get(feature) is not None:
            hint = "use attention='gqa' (or 'auto')" if feature == "softcap" else "use attention='sdpa'"
            raise ValueError(f"attention backend {backend!r} does not support {feature} (this model uses it); {hint}")


def _scale(query: torch.Tensor, scaling: float | None) -> float:
    return scaling if scaling is not None else 1.0 / math.sqrt(query.shape[-1])


# Past this many queries SDPA's blocked CPU kernel catches up: in interleaved A/B runs of whole SmolLM2 forwards
# after a short and a longer prefix the native loop was ahead for 1 and 5 queries and level or behind for 13.
NATIVE_MAX_QUERIES = 8


def _native_fits(query, key, value, mask) -> bool:
    """Whether eagle_lite's native tree attention (csrc/tree_attention.cpp) takes this call: CPU, fp32, one
    sequence, a few queries, a boolean [1, 1, T, S] mask or none."""
    return (query.device.type == "cpu" and query.dtype == key.dtype == value.dtype == torch.float32
            and query.shape[0] == 1 and query.shape[2] <= NATIVE_MAX_QUERIES and query.shape[-1] % 8 == 0
            and query.shape[-1] <= 128 and not torch.is_grad_enabled()
            and (mask is None or (mask.dtype == torch.bool and mask.dim() == 4 and mask.shape[:2] == (1, 1)))
            and native.kernel_available())


def _is_plain_causal(mask: torch.Tensor, t: int, s: int, device) -> bool:
    """Whether a [1, 1, T, T] boolean mask is the causal one (a prompt read from an empty cache)."""
    return (mask.dtype == torch.bool and tuple(mask.shape) == (1, 1, t, s)
            and torch.equal(mask[0, 0], torch.ones(t, s, dtype=torch.bool, device=device).tril_()))


def _gqa_forward(module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None, softcap=None,
                 **kwargs):
    _refuse_unsupported("gqa", dropout, kwargs)
    t, s = query.shape[2], key.shape[2]
    if softcap is not None:                        # Gemma 2: no SDPA kernel soft-caps scores; plain torch does
        return _softcapped(query, key, value, attention_mask, _scale(query, scaling), softcap)
    mask, causal = attention_mask, attention_mask is None and t > 1
    # under torch.compile (the static step) neither the host-side mask check nor the native op is traced: SDPA
    compiling = torch.compiler.is_compiling()
    if (not compiling and t == s and t > NATIVE_MAX_QUERIES and isinstance(mask, torch.Tensor)
            and _per_forward("causal", mask, t, s, query.device, _is_plain_causal)):
        # a prompt from an empty cache: SDPA's causal kernel skips the blocks above the diagonal, which a
        # mask makes it compute and discard (half the attention of a long prefill)
        mask, causal = None, True
    if causal and t != s:                                              # causal after a cache: bottom-right
        mask, causal = _causal(t, s, query.device), False
    if not compiling and _native_fits(query, key, value, mask):        # CPU, a few queries: one native loop
        if causal:
            mask = _causal(t, s, query.device)
        visible = None if mask is None else mask[0, 0].expand(t, s)
        out = torch.ops.eagle_lite.tree_attention(query[0], key[0], value[0], visible, _scale(query, scaling))
        return out[None], None                                         # B T H D
    elif mask is not None and mask.dtype != torch.bool:
        mask = mask.to(query.dtype)                                    # an additive float mask
    out = torch.nn.functional.scaled_dot_product_attention(
        query, key, value, attn_mask=mask, scale=_scale(query, scaling), is_causal=causal,
        enable_gqa=query.shape[1] != key.shape[1])                     # B H T D
    return out.transpose(1, 2).contiguous(), None                     # B T H D


def _softcapped(query, key, value, attention_mask, scale: float, softcap: float):
    t, s = query.shape[2], key.shape[2]
    if attention_mask is None:
        visible = _causal(t, s, query.device) if t > 1 else None
    elif attention_mask.dtype == torch.bool:
        visible = attention_mask
    else:                                          # an additive float mask: 0 where visible, very negative where not
        visible = attention_mask > torch.finfo(attention_mask.dtype).min / 2
    out, _ = dense_attention(query, key, value, visible, scale, softcap)   # B H T D
    return out.to(query.dtype).transpose(1, 2).contiguous(), None           # B T H D


def _flex_forward(module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None, **kwargs):
    _refuse_unsupported("flex", dropout, kwargs)
    out = flex_tree_attention(query, key, value, attention_mask, _scale(query, scaling))  # B H T D
    return out.transpose(1, 2).contiguous(), None                                         # B T H D


def _split_forward(module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None,
                   _backend: str = "lse_merge", **kwargs):
    _refuse_unsupported(_backend, dropout, kwargs)
    t, s = query.shape[2], key.shape[2]
    _per_forward("prefix_check", attention_mask, t, s, query.device, _check_prefix_visible)
    out = split_attention(query, key, value, attention_mask, _scale(query, scaling),
                          use_flash=_backend == "flash")                                   # B H T D
    return out.transpose(1, 2).contiguous(), None                                         # B T H D


def _flash_split_forward(module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None, **kwargs):
    return _split_forward(module, query, key, value, attention_mask, dropout, scaling, _backend="flash", **kwargs)
