"""The Python API: load a target (and its draft head), then generate or stream text from a prompt or chat.

    from eagle_lite import load
    lm = load()                                   # embedded SmolLM2 target + its default head
    out = lm.generate("Why is the sky blue?")     # out.text, out.token_ids, out.stats
    for piece in lm.stream([{"role": "user", "content": "Hi!"}]):
        print(piece, end="")
"""
from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

import torch

from .config import GenerationConfig, TreeConfig, resolve_tree
from .decoding.drafter import Drafter, NoDrafter
from .decoding.engine import Engine, GenerationStats
from .drafters import registry
from .targets.loading import load_target
from .targets.model import Target
from .text.chat_format import chat_ids, text_ids
from .text.detokenize import Detokenizer

if TYPE_CHECKING:
    from .decoding.static_step import StaticEngine


@dataclass
class Output:
    text: str
    token_ids: list[int]
    stats: GenerationStats


class Pipeline:
    """A target with one drafter (`drafters.build`; `for_target` makes both); `generate`/`stream` take text or chat
    messages. engine: what generates instead of `Engine(target, drafter)` (the static step: `StaticEngine`).
    options: the method's options the drafter was built with (None: its defaults)."""

    def __init__(self, target: Target, drafter: Drafter | None, method: str, engine=None, options=None) -> None:
        self.target, self.method, self.options = target, method, options
        self.static: str | None = None   # the static step's mode where `engine` is one (`load(static=...)`)
        self.recorder = None   # text.record.Recorder: every completed answer recorded as token ids (--record)
        self.adapter = None    # heads.adapt.Adapter: the head learns from the answers it serves (--adapt)
        self.engine = engine if engine is not None else engine_for(target, drafter)
        # the tree the drafter recommends for this device (a head's config.json), else the device's default
        source = drafter if engine is None else engine
        self.tree: TreeConfig = resolve_tree(getattr(source, "recommended_tree", None), device=str(target.device))
        # a tree drafter (an EAGLE head) whose head recommends no tree here: the device's default stands in
        self.tree_unrecommended = hasattr(source, "recommended_tree") and source.recommended_tree is None

    def drafter_factory(self, options=None) -> Callable[[], Drafter]:
        """A function making fresh drafters of this method (one per sequence of a batch: a drafter keeps
        per-sequence state); the pipeline's EAGLE head is shared, with its speed-ups and output weight.
        options: the method's (None: the pipeline's own; options of another method, given for "auto": ignored)."""
        method = self.method
        if method == "vanilla":
            return NoDrafter
        options = options if options is not None else self.options
        if options is not None and not isinstance(options, registry.METHODS[method].options):
            options = None   # options given for "auto", which resolved to another method
        options = registry.options_for(method, options)
        if method in registry.HEAD_METHODS and options.head is None:   # the pipeline's head, with its speed-ups
            options = replace(options, head=self.engine.drafter.head)
        first = registry.build(method, self.target, options)
        # head drafters: siblings of one, sharing its head's output weight instead of a copy each
        return getattr(first, "sibling", None) or (lambda: registry.build(method, self.target, options))

    def pinned(self, options=None) -> Pipeline:
        """Method auto's pipeline as eagle with the same head (`options`: eagle's, the head set here), for a tree
        the caller pins: the controller chooses none."""
        options = replace(options or registry.EagleOptions(), head=self.engine.drafter.head)
        pipeline = for_target(self.target, "eagle", options)
        pipeline.recorder = self.recorder
        if self.adapter is not None:   # the head adapts on in the pinned pipeline
            self.adapter.bind(pipeline)
        return pipeline

    def config(self, **overrides) -> GenerationConfig:
        """A GenerationConfig with this pipeline's tree; keyword arguments set its other fields."""
        return GenerationConfig(**{"tree": self.tree, **overrides})

    # -- prompts ---------------------------------------------------------------------------------
    def encode(self, prompt: str | list[dict], chat_template: bool = True) -> list[int]:
        """Text (one user message) or chat messages -> prompt token ids, through the chat template (a base model
        without one: its plain layout, text/chat_format.py); chat_template=False: the text as it is. Either way the
        text is made valid first (`chat_format.clean_text`: undecodable bytes -> U+FFFD, NUL dropped)."""
        tok = self.target.tokenizer
        if tok is None:
            raise ValueError(f"target '{self.target.name}' has no tokenizer; pass token ids to Engine instead")
        if chat_template:   # the tokenizer's template, or for a base model the plain layout (text/chat_format.py)
            messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
            return chat_ids(tok, messages)
        if not isinstance(prompt, str):
            raise ValueError("chat_template=False takes the prompt as text, not as messages")
        return text_ids(tok, prompt)

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
        ids = self.prompt_ids(prompt, chat_template)
        result = self.engine.generate(ids, config or self.config())
        if self.recorder is not None:
            self.recorder.add(ids, result.token_ids)
        text = self.decode(result.token_ids) if self.target.tokenizer is not None else ""
        return Output(text, result.token_ids, result.stats)

    def stream(self, prompt: str | list[dict] | list[int], config: GenerationConfig | None = None,
               chat_template: bool = True, stats: GenerationStats | None = None,
               token_ids: list[int] | None = None) -> Iterator[str]:
        """Yield text as tokens are accepted (a multi-byte character once it is whole; text/detokenize.py decodes a
        short window of the latest tokens, not the whole answer, at each step); `stats` and `token_ids` (if given)
        are filled in as it goes, so whoever stops the stream early (Ctrl-C) still holds what was generated."""
        ids: list[int] = token_ids if token_ids is not None else []
        text = Detokenizer(self.decode)
        prompt_ids = self.prompt_ids(prompt, chat_template)
        for step in self.engine.stream(prompt_ids, config or self.config(), stats):
            ids += step
            piece = text.add(step)
            if piece:
                yield piece
        if self.recorder is not None:   # a whole answer only: one stopped early (Ctrl-C) never gets here
            self.recorder.add(prompt_ids, ids)
        rest = text.add([], final=True)
        if rest:
            yield rest


def load(target: str | None = None, method: str = "auto", options=None, draft: str | None = None,
         dtype: str = "float32", device: str = "cpu", attention: str = "auto", static: str | None = None,
         record: str | None = None, adapt: str | None = None) -> Pipeline:
    """Load a target (the embedded SmolLM2 by default; a .gguf, folder or hub id) and a drafting method.

    method: one of `drafters.NAMES`; "auto" (the default) chooses each step between a plain step, prompt lookup and
    the draft head shipped for the target (or the one `draft` names) from this machine's costs (drafters/auto.py).
    options: that method's options dataclass (`drafters.EagleOptions` for auto, eagle and staged, `LookupOptions`,
    `LookaheadOptions`, `DraftModelOptions`, `LayerSkipOptions`, `MedusaOptions`).
    draft: shorthand for EagleOptions(draft=...): "auto", "random" (untrained: exact but slow) or a head folder.
    static: decode greedily through the fixed-shape step (static_step.py) in this mode ("auto": CUDA graphs on CUDA,
    eager on a CPU; see `static_step.MODES`); methods eagle (without the prompt-lookup graft; auto runs it there)
    and vanilla, a mode of theirs (`Pipeline.static`). None: the engine.
    record: a folder where every completed answer is recorded as token ids, for training a head on them
    (`text.record`; `python -m trainers.train data=recorded data.distill.start_from=FOLDER`). None: nothing recorded.
    adapt: a folder where the head learns from the answers it serves (heads/adapt.py: `pipeline.adapter.round()`
    between answers, as the chat and the server do); a folder holding an adapted head resumes from it. Methods auto
    and eagle.
    """
    if adapt is not None:
        from .heads.adapt import adapted_draft

        if static is not None:
            raise ValueError("--adapt runs on the engine, not the static step: drop --static")
        eagle_options = isinstance(options, registry.EagleOptions)
        start_draft = options.draft if eagle_options else draft
        resumed = adapted_draft(adapt, None)
        if resumed is not None and eagle_options:
            options = replace(options, draft=resumed, head=None)
        elif resumed is not None:
            draft = resumed
    if draft is not None and (method == registry.AUTO or method in registry.HEAD_METHODS):
        if options is not None:
            raise ValueError("pass the head either as draft=... or inside options, not both")
        options = registry.EagleOptions(draft=draft)
    elif draft not in (None, registry.AUTO):
        raise ValueError(f"draft={draft!r} names an EAGLE head, but method is '{method}'")
    torch_dtype = getattr(torch, dtype, None)
    if not isinstance(torch_dtype, torch.dtype):
        raise ValueError(f"unknown dtype '{dtype}': use float32 or bfloat16")
    if static is not None and method == registry.AUTO:
        method = "eagle"   # the fixed-shape step runs one tree: eagle's
    registry.check(method, options)              # before the (slow) target load
    if static is not None:
        check_static(method, static)
    tgt = load_target(target, dtype=torch_dtype, device=device, attention=attention)
    method, options = registry.resolve(method, tgt, options)
    if static is not None:
        from .drafters.registry import eagle_head

        check_static(method, static)
        head = eagle_head(tgt, options) if method == "eagle" else None
        pipeline = Pipeline(tgt, None, method, static_engine_for(tgt, head, static))
        pipeline.static = static
    else:
        pipeline = for_target(tgt, method, options)
    if record is not None:
        from .text.record import Recorder

        pipeline.recorder = Recorder(record, tgt)
    if adapt is not None:
        from .heads.adapt import attach

        attach(pipeline, adapt, start_draft)
    return pipeline


def engine_for(target: Target, method: str | Drafter | None = registry.AUTO, options=None) -> Engine:
    """The engine that decodes `target` with method `method`'s drafter (its `options`; "auto" resolved), with a drafter
    already built, or with none (None: each request brings its own, as the server's do). The one place an `Engine` is
    assembled: the pipeline, the server, custom_generate and eval all come here."""
    drafter = registry.build(method, target, options) if isinstance(method, str) else method
    return Engine(target, drafter)


def static_engine_for(target: Target, head=None, mode: str = "auto", **options) -> StaticEngine:
    """The fixed-shape step's engine (decoding/static_step.py) for `target`: plain decoding (head None) or greedy
    EAGLE with `head`, its steps run in `mode` (`static_step.MODES`); options: StaticEngine's others (max_len,
    profile, compile_backend, lookahead, fused). The one place a `StaticEngine` is assembled: `load` and eval."""
    from .decoding.static_step import StaticEngine

    return StaticEngine(target, head, mode=mode, **options)


def for_target(target: Target, method: str = registry.AUTO, options=None) -> Pipeline:
    """The drafter of `method` (its `options`; "auto" resolved) for a loaded target, with its tree: the one place
    a drafter and its tree are made for a target (`load`, the server, training's answers)."""
    method, options = registry.resolve(method, target, options)
    return Pipeline(target, registry.METHODS[method].build(target, options), method, options=options)


def check_static(method: str, mode: str) -> None:
    """Refuse what the static step cannot run: a method other than eagle and vanilla (`load` runs auto as eagle
    there), an unknown mode."""
    from .decoding.static_step import MODES

    if mode not in MODES:
        raise ValueError(f"unknown static step mode {mode!r}: choose one of {', '.join(MODES)}")
    if method not in (registry.AUTO, "eagle", "vanilla"):
        raise ValueError(f"the static step runs methods eagle and vanilla, not '{method}'")
