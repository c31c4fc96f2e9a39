"""A target as a standard Hugging Face model folder that other engines load as they are
(`python -m eagle_lite.export --target smollm2 --out DIR`: the exact weights eagle_lite runs, de-quantized from its
GGUF): transformers names with the tied embedding under `model.embed_tokens.weight` (vLLM reads an `lm_head.weight`
-only folder as a zero embedding), a one-shard safetensors index, config keys both transformers 4.x and 5 read, and
the fast tokenizer with its chat template in both places. docs/deploy.md, "The target as a Hugging Face folder".
"""
from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

import torch
from safetensors.torch import save_file

TOKENIZER_CLASS = "PreTrainedTokenizerFast"
WEIGHTS = "model.safetensors"
INDEX = "model.safetensors.index.json"


def target_tensors(model: torch.nn.Module, dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    """The model's parameters and persistent buffers under their transformers names; a tied output weight is
    stored once, as the input embedding."""
    state = {k: v.detach().to("cpu") for k, v in model.state_dict().items()}
    embed = model.get_input_embeddings().weight
    out = model.get_output_embeddings()
    tied = bool(getattr(model.config, "tie_word_embeddings", False)) and out is not None and \
        out.weight.data_ptr() == embed.data_ptr()
    if tied:
        state = {k: v for k, v in state.items() if k != "lm_head.weight"}
    embed_keys = [k for k in state if k.endswith("embed_tokens.weight")]
    if not embed_keys:
        raise ValueError(f"{type(model).__name__} has no parameter named *embed_tokens.weight: eagle_lite writes "
                         f"Llama-family targets (model.embed_tokens, model.layers.*, model.norm, lm_head)")
    cast = (lambda v: v.to(dtype) if dtype is not None and v.is_floating_point() else v)
    return {k: cast(v).contiguous() for k, v in state.items()}


def target_config(model: torch.nn.Module, dtype: torch.dtype) -> dict:
    """config.json for the folder: transformers' own fields plus what transformers 4.x and other loaders read."""
    config = model.config.to_dict()
    for key in ("quantization_config", "_name_or_path", "_model_name_or_path", "transformers_version"):
        config.pop(key, None)
    config["architectures"] = [type(model).__name__]
    name = str(dtype).removeprefix("torch.")
    config["dtype"] = config["torch_dtype"] = name
    params = config.get("rope_parameters") or {}
    theta = params.get("rope_theta", config.get("rope_theta"))
    if theta is not None:
        config["rope_theta"] = float(theta)
    kind = params.get("rope_type", "default")
    if "rope_scaling" not in config or config["rope_scaling"] is None:
        # 4.x reads rope_scaling: null means plain RoPE; otherwise the legacy dict ("type" for older readers)
        extra = {k: v for k, v in params.items() if k != "rope_theta"}
        config["rope_scaling"] = None if kind == "default" else {**extra, "type": kind}
    config["tie_word_embeddings"] = bool(getattr(model.config, "tie_word_embeddings", False))
    return config


def tokenizer_files(tokenizer, folder: Path) -> None:
    """tokenizer.json, tokenizer_config.json (a class every version knows), special tokens, chat template."""
    backend = getattr(tokenizer, "backend_tokenizer", None) or getattr(tokenizer, "_tokenizer", None)
    if backend is None:
        raise ValueError(f"the target's tokenizer ({type(tokenizer).__name__}) has no tokenizer.json backend: "
                         f"eagle_lite writes fast (tokenizers) tokenizers only")
    backend.save(str(folder / "tokenizer.json"))
    special = {k: str(v) for k, v in tokenizer.special_tokens_map.items() if isinstance(v, str)}
    config = {"tokenizer_class": TOKENIZER_CLASS, **special,
              "model_max_length": int(min(tokenizer.model_max_length, 1 << 31)),
              "clean_up_tokenization_spaces": False}
    template = getattr(tokenizer, "chat_template", None)
    if isinstance(template, str):
        config["chat_template"] = template
        (folder / "chat_template.jinja").write_text(template)
    (folder / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    (folder / "special_tokens_map.json").write_text(json.dumps(special, indent=2) + "\n")


def write_target(model: torch.nn.Module, tokenizer, out: str | Path, dtype: torch.dtype = torch.float32) -> list[str]:
    """Write `model` (a transformers causal LM) and `tokenizer` to the folder `out` as described above; written
    whole in a temporary folder, then moved into place. Returns the names of the files written."""
    out = Path(out)
    tensors = target_tensors(model, dtype)
    config = target_config(model, dtype)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=out.name + ".", dir=out.parent))
    try:
        save_file(tensors, str(tmp / WEIGHTS), metadata={"format": "pt"})
        total = sum(v.numel() * v.element_size() for v in tensors.values())
        index = {"metadata": {"total_size": total}, "weight_map": {k: WEIGHTS for k in sorted(tensors)}}
        (tmp / INDEX).write_text(json.dumps(index, indent=2) + "\n")
        (tmp / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
        generation = getattr(model, "generation_config", None)
        if generation is not None:
            generation.save_pretrained(tmp)
        tokenizer_files(tokenizer, tmp)
        out.mkdir(exist_ok=True)
        for file in tmp.iterdir():
            file.chmod(0o644)                      # mkdtemp and safetensors make owner-only files
            os.replace(file, out / file.name)      # same file system: each file appears whole
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return sorted(p.name for p in out.iterdir())
