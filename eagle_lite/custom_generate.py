"""eagle_lite's lossless speculative decoding inside transformers' own `model.generate()`, through its supported
extension point: a `custom_generate` callable, which `generate` calls as the decoding loop after its usual input
preparation (generation config, stopping criteria, logits processors, max_length).

    from eagle_lite.custom_generate import generate as eagle_generate
    out = model.generate(input_ids, max_new_tokens=64, custom_generate=eagle_generate, draft="path/to/head")

`draft`: a head folder (`--draft` takes the same: eagle_lite's own or a published layout), a loaded DraftHead, or
None for prompt lookup (training-free). `tree`: a TreeConfig (default: the head's recommended tree). The result is
what `generate()` returns: the sequences [1, prompt + new] (a GenerateDecoderOnlyOutput with
`return_dict_in_generate=True`), token for token the same as greedy `generate()` and the same distribution when
sampling (temperature, top_k, top_p). One sequence at a time, without padding; logits processors other than those
three, and scores/logits/attentions in the output, are refused rather than silently ignored.

The user's model is used as it is: eagle_lite's CPU speed-ups (packed linears, fused norms) that would set instance
forwards on its modules are left off, so plain `generate()` on the same model is unchanged afterwards.
"""
from __future__ import annotations

from pathlib import Path

import torch

from .config import GenerationConfig, SamplingConfig, TreeConfig, resolve_tree

SAMPLING_WARPERS = {"TemperatureLogitsWarper", "TopKLogitsWarper", "TopPLogitsWarper"}
# model attribute holding (its Target, {draft key: Engine}): the load-time checks and KV caches are made once per
# model. It lives on the model itself, so model, Target and engines are freed together (a weak-key table would not
# do: its value, the Target, holds the model).
ENGINES_ATTR = "_eagle_lite_engines"


def sampling_of(config, logits_processor) -> SamplingConfig:
    """The SamplingConfig equivalent to what generate() prepared, or a ValueError naming what has none."""
    other = [type(p).__name__ for p in logits_processor if type(p).__name__ not in SAMPLING_WARPERS]
    if other:
        raise ValueError(f"eagle_lite's speculative decoding is exact for temperature, top_k and top_p only; this call "
                         f"also has {', '.join(other)}: drop it (or generate without custom_generate)")
    if not config.do_sample:
        return SamplingConfig()
    return SamplingConfig(temperature=float(config.temperature or 1.0), top_p=float(config.top_p or 1.0),
                          top_k=int(config.top_k or 0))


def model_engine(model, draft):
    """The Engine for `model` and `draft` (cached per model)."""
    from .drafters import EagleOptions
    from .formats import load_head
    from .heads.draft import DraftHead
    from .pipeline import engine_for
    from .targets.model import Target

    if ENGINES_ATTR not in model.__dict__:
        name = getattr(model.config, "name_or_path", None) or type(model).__name__
        # object.__setattr__: not an nn.Module attribute, so the model's submodules and state_dict are unchanged
        object.__setattr__(model, ENGINES_ATTR, (Target(model, name=name, attention="sdpa", accelerate=False), {}))
    target, engines = model.__dict__[ENGINES_ATTR]
    key = id(draft) if isinstance(draft, DraftHead) else str(draft)
    if key not in engines:
        if draft is None:
            engines[key] = engine_for(target, "lookup")
        else:
            head = draft if isinstance(draft, DraftHead) else load_head(Path(draft), target)
            head = head.to(device=target.device, dtype=target.dtype)
            engines[key] = engine_for(target, "eagle", EagleOptions(head=head, round_head=False))
    return engines[key]


def generate(model, input_ids: torch.LongTensor, logits_processor, stopping_criteria, generation_config,
             synced_gpus: bool = False, streamer=None, draft=None, tree: TreeConfig | None = None, **model_kwargs):
    """The decoding loop `GenerationMixin.generate(custom_generate=generate, draft=..., tree=...)` runs."""
    # generate() has already copied the prompt once per beam or sequence: say which setting asked for it
    beams = getattr(generation_config, "num_beams", None) or 1
    if beams > 1:
        raise ValueError(f"num_beams={beams}: beam search is not supported; eagle_lite's speculative decoding "
                         f"reproduces greedy decoding and sampling (num_beams=1)")
    sequences = getattr(generation_config, "num_return_sequences", None) or 1
    if sequences > 1:
        raise ValueError(f"num_return_sequences={sequences}: multiple sequences per prompt are not supported; call "
                         f"generate once per sequence (with do_sample=True, each call draws anew)")
    if input_ids.shape[0] != 1:
        raise ValueError(f"eagle_lite decodes one sequence at a time, got a batch of {input_ids.shape[0]}: call "
                         f"generate once per prompt")
    mask = model_kwargs.get("attention_mask")
    if mask is not None and not bool(mask.all()):
        raise ValueError("the attention_mask masks prompt tokens: eagle_lite decodes unpadded prompts only")
    wanted = [k for k in ("output_scores", "output_logits", "output_attentions", "output_hidden_states")
              if getattr(generation_config, k, False)]
    if wanted:
        raise ValueError(f"{', '.join(wanted)}: eagle_lite's speculative decoding returns the sequences only")
    engine = model_engine(model, draft)
    tree = tree or resolve_tree(engine.drafter.recommended_tree, device=str(engine.target.device))
    prompt = input_ids[0].tolist()
    new_max = generation_config.max_length - len(prompt)
    seed = int(torch.randint(1 << 62, (1,))) if generation_config.do_sample else None   # torch.manual_seed applies
    cfg = GenerationConfig(max_new_tokens=max(new_max, 1), sampling=sampling_of(generation_config, logits_processor),
                           tree=tree, seed=seed, stop_at_eos=False)
    sequence = input_ids.clone()
    if new_max > 0:
        for step in engine.stream(prompt, cfg):
            done = False
            for token in step:   # generate()'s own stopping criteria (EOS, max_length, stop strings), token by token
                sequence = torch.cat([sequence, sequence.new_tensor([[token]])], dim=1)
                if streamer is not None:
                    streamer.put(sequence[:, -1:].cpu())
                if bool(stopping_criteria(sequence, None).all()):
                    done = True
                    break
            if done:
                break
    if streamer is not None:
        streamer.end()
    if generation_config.return_dict_in_generate:
        from transformers.generation.utils import GenerateDecoderOnlyOutput

        return GenerateDecoderOnlyOutput(sequences=sequence)
    return sequence
