"""The Llama config fields of a published head's config.json, both ways.

Published heads (official EAGLE, SpecForge, vLLM, SGLang) are Llama decoder layers described by a plain HF
Llama config: the loaders read the size fields, `rms_norm_eps` and the rope fields, and ignore the rest.
"""
from __future__ import annotations

import torch

from ..targets.model import Target

SIZE_KEYS = ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim",
             "rms_norm_eps", "max_position_embeddings", "vocab_size", "rope_theta", "rope_scaling", "rope_parameters")


def head_config(config: dict, where: str):
    """A one-layer LlamaConfig of the sizes an imported head's config.json gives."""
    from transformers import LlamaConfig

    missing = [k for k in ("hidden_size", "intermediate_size", "num_attention_heads", "vocab_size") if k not in config]
    if missing:
        raise ValueError(f"{where} has no {', '.join(missing)}: a draft head's config.json gives the Llama sizes of "
                         f"its layer (hidden_size, intermediate_size, num_attention_heads, vocab_size, ...)")
    act = config.get("hidden_act", "silu")
    if act != "silu":
        raise ValueError(f"{where} has hidden_act={act!r}: published EAGLE heads are Llama layers (silu)")
    fields = {k: config[k] for k in SIZE_KEYS if config.get(k) is not None}
    fields.setdefault("num_key_value_heads", fields["num_attention_heads"])
    return LlamaConfig(num_hidden_layers=1, **fields)


def rope_fields(config) -> dict:
    """rope_theta and rope_scaling in the legacy form every loader reads (rope_scaling null: plain RoPE)."""
    params = dict(getattr(config, "rope_parameters", None) or {})
    theta = params.pop("rope_theta", None) or getattr(config, "rope_theta", None) or 10000.0
    kind = params.get("rope_type", params.get("type", "default"))
    # "type" beside "rope_type": the official EAGLE code reads rope_scaling["type"]
    scaling = None if kind == "default" else {**params, "rope_type": kind, "type": kind}
    return {"rope_theta": float(theta), "rope_scaling": scaling}


def config_fields(config, vocab_size: int, dtype: torch.dtype) -> dict:
    """The Llama fields of a head whose layer config is `config` (eagle_lite builds it from the target's)."""
    heads = config.num_attention_heads
    return {
        "model_type": "llama",
        "hidden_size": config.hidden_size,
        "intermediate_size": config.intermediate_size,
        "num_attention_heads": heads,
        "num_key_value_heads": getattr(config, "num_key_value_heads", None) or heads,
        "head_dim": getattr(config, "head_dim", None) or config.hidden_size // heads,
        "hidden_act": "silu",
        "rms_norm_eps": float(getattr(config, "rms_norm_eps", 1e-6)),
        "max_position_embeddings": int(getattr(config, "max_position_embeddings", 4096) or 4096),
        **rope_fields(config),
        "vocab_size": vocab_size,
        # SGLang ties lm_head to embed_tokens when true, and then overwrites the embedding with the hot-token rows
        "tie_word_embeddings": False,
        "torch_dtype": str(dtype).removeprefix("torch."),
    }


def check_sizes(config: dict, target: Target, where: str, hidden_key: str = "hidden_size") -> None:
    """Refuse a head whose hidden or vocabulary size is not the target's."""
    from ..heads.checkpoint import HeadMismatchError

    hidden, vocab = config.get(hidden_key), config.get("vocab_size")
    if hidden != target.hidden_size or vocab != target.vocab_size:
        raise HeadMismatchError(
            f"{where} is for a target of hidden size {hidden} and vocabulary {vocab}; target '{target.name}' has "
            f"hidden size {target.hidden_size} and vocabulary {target.vocab_size}: use the head made for this target")
