"""A bounded resample, during self-distillation, of the answers that come out degenerate.

A model without a chat template is prompted in the plain layout (eagle_lite/text/chat_format.py): it continues the
prompt as text rather than answering it, and a small one continuing text greedily soon repeats itself (Gemma 3 270M,
a base model: 89% of its greedy answers to ShareGPT prompts are repetition loops). Such answers teach a head only to
predict repetition, and the data check (trainers/answer_check.py) drops them. So each answer the data check would
call degenerate is drawn again by sampling, up to `tries` times; the answers that were fine at the first try stay
the target's greedy ones. A record says how many times each of its answers was drawn again (`"resampled"`, one count
per span), so the data check reports the share that was degenerate at the first try beside the share left out.

`data.distill.resample`:
  tries        how many times an answer may be drawn again; "auto": 2 for a model laid out plainly (no chat
               template), 0 for one with a chat template (its greedy answers are its answers, and stay as they are)
  temperature, top_p, top_k
               the sampling; null: the model's own defaults (a GGUF file's `general.sampling.*`, llama.cpp's keys,
               else its generation config, with what transformers' generate() samples with where it sets nothing:
               temperature 1, top_k 50, top_p 1)

What the resample resolves to is part of the distill folder's settings (`distill.json`), so answers drawn with
other settings are never mixed into a folder; with tries 0 nothing is recorded (folders made before keep matching).
"""
from __future__ import annotations

import logging
import zlib
from dataclasses import replace
from pathlib import Path

import torch

from .answer_check import CHECKED_SOURCES, degenerate

log = logging.getLogger("trainers.distill")

AUTO_TRIES = 2
SAMPLING_KEYS = ("temperature", "top_p", "top_k")
# a GGUF file's sampling defaults (llama.cpp's `general.sampling.*` keys), by the name used here
GGUF_KEYS = {"temperature": "general.sampling.temp", "top_p": "general.sampling.top_p",
             "top_k": "general.sampling.top_k"}
# what transformers' generate() samples with where the model's generation config sets nothing
GENERATE_DEFAULTS = {"temperature": 1.0, "top_p": 1.0, "top_k": 50}
OFF = {"tries": 0}


def check_settings(resample: dict) -> None:
    """Refuse `data.distill.resample` settings that cannot work: ValueError naming the key."""
    unknown = set(resample) - {"tries", *SAMPLING_KEYS}
    if unknown:
        raise ValueError(f"data.distill.resample has unknown key(s) {sorted(unknown)}: it takes tries, "
                         f"temperature, top_p, top_k")
    tries = resample.get("tries", "auto")
    if tries != "auto" and (isinstance(tries, bool) or not isinstance(tries, int) or tries < 0):
        raise ValueError(f"data.distill.resample.tries must be 'auto' or a whole number >= 0, got {tries!r}")
    if resample.get("temperature") is not None and not resample["temperature"] > 0:
        raise ValueError(f"data.distill.resample.temperature must be > 0 (it samples), got {resample['temperature']}")


def model_sampling(target) -> dict:
    """The target's own sampling defaults: a GGUF file's `general.sampling.*`, else its generation config's."""
    config = getattr(getattr(target, "model", None), "generation_config", None)
    own = {k: type(v)(getattr(config, k, None) if getattr(config, k, None) is not None else v)
           for k, v in GENERATE_DEFAULTS.items()}
    spec = str(getattr(target, "spec", "") or "")
    if spec.endswith(".gguf") and Path(spec).is_file():
        from eagle_lite.kernels import gguf_header

        metadata = gguf_header(spec)[0]
        for key, name in GGUF_KEYS.items():
            if name in metadata:
                own[key] = type(own[key])(metadata[name])
    return own


def resolved(target, source: str, resample: dict) -> dict:
    """`resample` as it applies to `target` answering prompts of `source`: {"tries": 0} (off), or tries and the
    sampling, each setting given or the model's own."""
    check_settings(resample)
    tries = resample.get("tries", "auto")
    if source not in CHECKED_SOURCES or getattr(target, "tokenizer", None) is None:
        return dict(OFF)   # only answers the target writes to chat prompts are checked, so only they are resampled
    if tries == "auto":
        tries = 0 if getattr(target.tokenizer, "chat_template", None) else AUTO_TRIES
    if not tries:
        return dict(OFF)
    given = {k: resample[k] for k in SAMPLING_KEYS if resample.get(k) is not None}
    own = model_sampling(target) if len(given) < len(SAMPLING_KEYS) else {}
    return {"tries": int(tries), **{k: given.get(k, own.get(k)) for k in SAMPLING_KEYS}}


def resample_degenerate(target, prompts: list[list[int]], answers: list[list[int]], cfg, eos: set[int],
                        generate) -> list[int]:
    """Draw each degenerate answer of `answers` (replaced in place) again by `generate(target, prompts, cfg)`
    with `cfg.resample`'s sampling, up to its tries; returns how many times each answer was drawn again.

    The draws are seeded from the distill seed, the try and the prompts being drawn again, so a rerun of a shard
    draws the same answers."""
    settings = cfg.resample
    counts = [0] * len(answers)
    if not settings.get("tries"):
        return counts
    sampled = replace(cfg, do_sample=True, **{k: settings[k] for k in SAMPLING_KEYS})
    left = [i for i, answer in enumerate(answers) if degenerate(answer, eos)]
    for attempt in range(1, settings["tries"] + 1):
        if not left:
            break
        log.info("distill: %d of %d answers degenerate, drawn again by sampling (try %d of %d)", len(left),
                 len(answers), attempt, settings["tries"])
        key = zlib.crc32(repr([prompts[i] for i in left]).encode())
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed((cfg.seed * 7919 + attempt * 104729 + key) % 2**63)
            drawn = generate(target, [prompts[i] for i in left], sampled)
        for i, answer in zip(left, drawn):
            answers[i], counts[i] = answer, attempt
        left = [i for i in left if degenerate(answers[i], eos)]
    return counts
