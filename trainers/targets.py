"""The target a head is trained for: a real model through `eagle_lite.targets.loading`, or a tiny random Llama.

The tiny target is built in-process from a seed (no downloads, no tokenizer), so tests and
`target=tiny` runs exercise the whole pipeline in seconds; the same seed always rebuilds the same
weights, hence the same fingerprint, so its feature caches and checkpoints stay reusable.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

import torch

from eagle_lite.targets.loading import alias_name
from eagle_lite.targets.model import Target
from eagle_lite.threads import check_threads, set_threads

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class TargetConfig:
    """`kind`: "pretrained" (loaded by `spec`: alias, GGUF, folder or hub id) or "tiny" (random Llama)."""

    name: str = "smollm2"
    kind: str = "pretrained"
    spec: str | None = "smollm2"
    dtype: str = "float32"
    device: str = "cpu"
    # tiny only
    vocab_size: int = 128
    hidden_size: int = 64
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int = 2
    max_position_embeddings: int = 512
    eos_token_id: int = 1
    pad_token_id: int = 0
    seed: int = 0
    threads: int | None = None  # torch CPU threads while this process runs (None: torch's default)

    def __post_init__(self) -> None:
        if self.kind not in ("pretrained", "tiny"):
            raise ValueError(f"target.kind must be 'pretrained' or 'tiny', got {self.kind!r}")
        if self.dtype not in _DTYPES:
            raise ValueError(f"target.dtype must be one of {sorted(_DTYPES)}, got {self.dtype!r}")
        check_threads(self.threads, "target.threads")


def run_name(spec: str | None) -> str:
    """The name a target's runs are filed under (`target.name`, in paths.data and paths.output): an alias as it is
    ('smollm2'), a local folder or .gguf file by its own name ('./models/my-qwen' -> 'my-qwen'), a hub id with its
    organisation ('Qwen/Qwen2.5-0.5B-Instruct' -> 'Qwen--Qwen2.5-0.5B-Instruct', as shipped heads are named)."""
    spec = str(spec or "smollm2").strip()
    named = alias_name(spec)   # a packaged GGUF's alias: its target's name ('gemma3' -> 'gemma-3-270m-q4_k_m')
    if named is not None:
        return named
    path = Path(spec).expanduser()
    if spec.endswith(".gguf"):
        spec = path.stem
    elif path.exists() or spec.startswith(("/", "./", "../", "~")):
        spec = path.resolve().name
    return re.sub(r"[^A-Za-z0-9._-]+", "--", spec).strip("-.") or "target"


def tiny_target(cfg: TargetConfig = TargetConfig(kind="tiny", name="tiny")) -> Target:
    """A random LlamaForCausalLM with sharpened logits (so greedy continuations are not all ties)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size, intermediate_size=2 * cfg.hidden_size,
        num_hidden_layers=cfg.num_layers, num_attention_heads=cfg.num_heads,
        num_key_value_heads=cfg.num_kv_heads, max_position_embeddings=cfg.max_position_embeddings,
        eos_token_id=cfg.eos_token_id, pad_token_id=cfg.pad_token_id, bos_token_id=None,
        tie_word_embeddings=False,
    )
    with torch.random.fork_rng(devices=[]):  # the seed fixes the weights without touching global RNG
        torch.manual_seed(cfg.seed)
        model = LlamaForCausalLM(config)
        with torch.no_grad():
            model.lm_head.weight.mul_(8.0)
    model.generation_config.eos_token_id = cfg.eos_token_id
    model.generation_config.pad_token_id = cfg.pad_token_id
    model = model.to(device=cfg.device, dtype=_DTYPES[cfg.dtype]).eval()
    return Target(model, tokenizer=None, name=cfg.name, accelerate=False)


def build_target(cfg: TargetConfig) -> Target:
    # Tiny models are all OpenMP overhead: one thread is far faster than two on a busy machine.
    set_threads(cfg.threads, "target.threads")
    if cfg.kind == "tiny":
        return tiny_target(cfg)
    from eagle_lite.targets.loading import load_target

    # Training reads the target in batches of whole sequences with causal + padding masks, never a tree: plain
    # SDPA and no few-row speed-ups ('auto' would mean FlexAttention on CUDA, compiled again for every batch
    # shape). Distillation through the engine applies them when it starts (answering.py: Target.speed_up).
    return load_target(cfg.spec or cfg.name, dtype=_DTYPES[cfg.dtype], device=cfg.device, attention="sdpa",
                       accelerate=False)


def pad_token_id(target: Target) -> int:
    """The id used to pad batches (its value never matters: padded slots are masked out)."""
    for source in (target.tokenizer, getattr(target.model, "generation_config", None), target.config):
        pad = getattr(source, "pad_token_id", None)
        if isinstance(pad, int):
            return pad
    eos = sorted(target.eos_token_ids)
    return eos[0] if eos else 0
