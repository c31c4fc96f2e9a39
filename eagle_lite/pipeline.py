"""The Python API: load a target (and its draft head), then generate or stream text from a prompt or chat.

    from eagle_lite import load
    lm = load()                                   # embedded SmolLM2 target + its default head
    out = lm.generate("Why is the sky blue?")     # out.text, out.token_ids, out.stats
    for piece in lm.stream([{"role": "user", "content": "Hi!"}]):
        print(piece, end="")
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import torch

from .chat_format import chat_ids, clean_text
from .checkpoint import MEDUSA_FORMAT, default_head_path, load_head, read_config, read_head_config
from .config import GenerationConfig, TreeConfig
from .draft import DraftHead
from .drafters import DraftModelDrafter, EagleDrafter, LayerSkipDrafter, MedusaDrafter, NoDrafter, PromptLookupDrafter
from .drafters.medusa import parse_choices
from .engine import Engine, GenerationStats
from .loading import load_target, target_source
from .medusa import MedusaHeads, load_medusa
from .target import Target

log = logging.getLogger("eagle_lite")

METHODS = ("eagle", "lookup", "draft_model", "layer_skip", "medusa", "vanilla")


@dataclass
class Output:
    text: str
    token_ids: list[int]
    stats: GenerationStats


class Pipeline:
    """A target with one drafting method; `generate`/`stream` take text or chat messages."""

    def __init__(self, target: Target, method: str = "vanilla", head: DraftHead | None = None,
                 draft_target: Target | None = None, exit_layer: int | None = None,
                 medusa_heads: MedusaHeads | None = None, medusa_choices: list[list[int]] | str | None = None) -> None:
        if method not in METHODS:
            raise ValueError(f"unknown method '{method}': choose one of {', '.join(METHODS)}")
        if method == "eagle" and head is None:
            raise ValueError("method 'eagle' needs a draft head")
        if method == "draft_model" and draft_target is None:
            raise ValueError(f"method 'draft_model' needs a draft model sharing the tokenizer of target "
                             f"'{target.name}': pass --draft-model SPEC (a smaller model of the same family)")
        if method == "medusa" and medusa_heads is None:
            raise ValueError("method 'medusa' needs Medusa heads: pass --medusa PATH (trained with "
                             "`python -m trainers.train experiment=medusa`) or --medusa random")
        self.target, self.method, self.head = target, method, head
        drafters = {"eagle": lambda: EagleDrafter(target, head), "lookup": PromptLookupDrafter, "vanilla": NoDrafter,
                    "draft_model": lambda: DraftModelDrafter(target, draft_target),
                    "layer_skip": lambda: LayerSkipDrafter(target, exit_layer),
                    "medusa": lambda: MedusaDrafter(target, medusa_heads, medusa_choices)}
        self.engine = Engine(target, drafters[method]())
        # the tree the head recommends (tuned for it on a CPU like ours), else the library default
        self.tree: TreeConfig = head.tree if method == "eagle" and head.tree else TreeConfig()

    def config(self, **overrides) -> GenerationConfig:
        """A GenerationConfig with this pipeline's tree; keyword arguments set its other fields."""
        return GenerationConfig(**{"tree": self.tree, **overrides})

    # -- prompts ---------------------------------------------------------------------------------
    def encode(self, prompt: str | list[dict], chat_template: bool = True) -> list[int]:
        """Text (one user message) or chat messages -> prompt token ids, through the chat template (a base model
        without one: its plain layout, chat_format.py); chat_template=False: the text as it is. Either way the
        text is made valid first (`chat_format.clean_text`: undecodable bytes -> U+FFFD, NUL dropped)."""
        tok = self.target.tokenizer
        if tok is None:
            raise ValueError(f"target '{self.target.name}' has no tokenizer; pass token ids to Engine instead")
        if chat_template:   # the tokenizer's template, or for a base model the plain layout (chat_format.py)
            messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
            return chat_ids(tok, messages)
        if not isinstance(prompt, str):
            raise ValueError("chat_template=False takes the prompt as text, not as messages")
        return tok.encode(clean_text(prompt))

    def decode(self, token_ids: list[int]) -> str:
        return self.target.tokenizer.decode(token_ids, skip_special_tokens=True)

    # -- generating ------------------------------------------------------------------------------
    def prompt_ids(self, prompt: str | list[dict] | list[int], chat_template: bool = True) -> list[int]:
        """Token ids given directly are used as they are; text and messages are encoded."""
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], int):
            return list(prompt)
        return self.encode(prompt, chat_template)

    def generate(self, prompt: str | list[dict] | list[int], config: GenerationConfig | None = None,
                 chat_template: bool = True) -> Output:
        """config: None means `self.config()` (the head's recommended tree, greedy, 256 new tokens)."""
        result = self.engine.generate(self.prompt_ids(prompt, chat_template), config or self.config())
        text = self.decode(result.token_ids) if self.target.tokenizer is not None else ""
        return Output(text, result.token_ids, result.stats)

    def stream(self, prompt: str | list[dict] | list[int], config: GenerationConfig | None = None,
               chat_template: bool = True, stats: GenerationStats | None = None,
               token_ids: list[int] | None = None) -> Iterator[str]:
        """Yield text as tokens are accepted; `stats` and `token_ids` (if given) are filled in as it goes, so
        whoever stops the stream early (Ctrl-C) still holds what was generated."""
        ids: list[int] = token_ids if token_ids is not None else []
        shown = ""
        for step in self.engine.stream(self.prompt_ids(prompt, chat_template), config or self.config(), stats):
            ids += step
            text = self.decode(ids)
            # hold back a trailing replacement char: the rest of a multi-byte character is still coming
            if not text.endswith("\ufffd"):
                yield text[len(shown):]
                shown = text
        rest = self.decode(ids)[len(shown):]
        if rest:
            yield rest


def check_inputs(method: str, draft: str | None, draft_model: str | None, medusa: str | None,
                 medusa_choices: list[list[int]] | str | None) -> None:
    """Refuse what `load` would refuse only after loading the target (20-80 s): an unknown method, a method
    without the draft it needs, a draft head / Medusa folder that is missing or of another kind, a draft model
    spec naming no file or folder, Medusa choices that are not JSON. Raises ValueError / FileNotFoundError."""
    if method not in ("auto", *METHODS):
        raise ValueError(f"unknown method '{method}': choose auto or one of {', '.join(METHODS)}")
    if method == "draft_model" and draft_model is None:
        raise ValueError("method 'draft_model' needs --draft-model SPEC: a smaller model with the target's tokenizer")
    if method == "medusa" and medusa is None:
        raise ValueError("method 'medusa' needs --medusa PATH (heads trained with `python -m trainers.train "
                         "experiment=medusa`) or --medusa random (untrained: exact but slow)")
    if method in ("auto", "eagle") and draft not in (None, "auto", "random"):
        read_head_config(draft)
    if method == "draft_model":
        target_source(draft_model, "draft model")
    if method == "medusa" and medusa != "random":
        read_config(medusa, MEDUSA_FORMAT, "Medusa heads")
    if method == "medusa" and isinstance(medusa_choices, str):
        parse_choices(medusa_choices)


def load(target: str | None = None, draft: str | None = "auto", method: str = "auto",
         dtype: str = "float32", device: str = "cpu", draft_model: str | None = None,
         exit_layer: int | None = None, attention: str = "auto", medusa: str | None = None,
         medusa_choices: list[list[int]] | str | None = None) -> Pipeline:
    """Load a target and a drafting method.

    draft: "auto" (the head shipped for this target, if any), "random" (an untrained head: slow,
    still exact, for testing), or a folder written by `save_head`. method: "auto" picks eagle when a
    head is available, else prompt lookup (training-free and as exact: 1.25x vanilla on the benchmark's
    prompts, session 9). draft_model: the smaller LM of method "draft_model" (any spec
    `load_target` takes); exit_layer: the draft depth of method "layer_skip" (default half the layers).
    medusa: method "medusa"'s heads, a folder written by `save_medusa` or "random" (untrained: exact
    but slow); medusa_choices: its tree as rank paths or JSON text (default: drafters.medusa.DEFAULT_CHOICES).
    """
    torch_dtype = getattr(torch, dtype, None)
    if not isinstance(torch_dtype, torch.dtype):
        raise ValueError(f"unknown dtype '{dtype}': use float32 or bfloat16")
    check_inputs(method, draft, draft_model, medusa, medusa_choices)
    tgt = load_target(target, dtype=torch_dtype, device=device, attention=attention)
    medusa_heads = None
    if method == "medusa":
        medusa_heads = MedusaHeads.for_target(tgt) if medusa == "random" else load_medusa(medusa, tgt)
    draft_tgt = load_target(draft_model, dtype=torch_dtype, device=device) if method == "draft_model" else None
    head = None
    if method in ("auto", "eagle"):
        if draft == "random":
            head = DraftHead.for_target(tgt)
        elif draft in (None, "auto"):
            path = default_head_path(tgt.name)
            if path is not None:
                head = load_head(path, tgt)
            elif method == "eagle":
                raise FileNotFoundError(
                    f"no draft head ships for target '{tgt.name}': pass --draft PATH (a trained head), "
                    f"--draft random (untrained: exact but slow), or --method vanilla"
                )
        else:
            head = load_head(Path(draft), tgt)
    if method == "auto":
        method = "eagle" if head is not None else "lookup"
        if head is None:
            log.warning("no draft head ships for target '%s': drafting by prompt lookup (training-free); train a "
                        "head with `python -m trainers.train` and pass it with --draft for EAGLE", tgt.name)
    return Pipeline(tgt, method, head, draft_target=draft_tgt, exit_layer=exit_layer, medusa_heads=medusa_heads,
                    medusa_choices=medusa_choices)
