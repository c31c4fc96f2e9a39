"""The Python API: load a target (and its draft head), then generate or stream text from a prompt or chat.

    from eagle_lite import load
    lm = load()                                   # embedded SmolLM2 target + its default head
    out = lm.generate("Why is the sky blue?")     # out.text, out.token_ids, out.stats
    for piece in lm.stream([{"role": "user", "content": "Hi!"}]):
        print(piece, end="")
"""
from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace

import torch

from .config import GenerationConfig, TreeConfig, resolve_tree, tree_given
from .decoding.drafter import Drafter, NoDrafter
from .decoding.engine import Engine, GenerationStats
from .drafters import plugins, registry
from .targets.loading import load_target
from .targets.model import Target
from .text.chat_format import chat_ids, text_ids
from .text.detokenize import Detokenizer

log = logging.getLogger("eagle_lite")


@dataclass
class Output:
    text: str
    token_ids: list[int]
    stats: GenerationStats


class Pipeline:
    """A target with one drafter (`drafters.build`; `for_target` makes both); `generate`/`stream` take text or chat
    messages. options: the method's options the drafter was built with (None: its defaults). static: the engine's
    step backend (`step_backend`: None, the fixed-shape step where it is the faster exact one; "off"; a mode)."""

    def __init__(self, target: Target, drafter: Drafter | None, method: str, options=None,
                 static: str | None = None) -> None:
        self.target, self.method, self.options = target, method, options
        self.recorder = None   # text.record.Recorder: every completed answer recorded as token ids (--record)
        self.adapter = None    # a plugin's learner of the head from the answers it serves (--adapt), with `bind`
        drafter = drafter if drafter is not None else NoDrafter()
        self.engine = Engine(target, drafter, step_backend(target, drafter, static))
        # the drafter's observer of its steps (method auto: its choices); None: none
        self.statistics = drafter.statistics()
        if self.statistics is not None:
            self.engine.observers.append(self.statistics)
        # the tree the drafter recommends for this device (a head's config.json), else the device's default
        self.tree: TreeConfig = resolve_tree(drafter.recommended_tree, device=str(target.device))
        # an EAGLE head that recommends no tree here: the device's default stands in
        self.tree_unrecommended = drafter.head is not None and drafter.recommended_tree is None

    def describe(self) -> str:
        """What runs, in one line: the target, the method (and what "default" resolved to), the draft head (shipped,
        a folder, or random) and the fixed-shape step's mode where it runs."""
        ran = self.engine.drafter.name
        method = self.method if ran == self.method else f"{self.method} ({ran})"
        head = ""
        if self.engine.drafter.head is not None:
            draft = getattr(self.options, "draft", None) or registry.AUTO
            head = " · head " + (f"shipped for {self.target.name}" if draft == registry.AUTO else str(draft))
        static = f" · static step, mode {self.static}" if self.static else ""
        return f"target {self.target.name} · method {method}{head}{static}"

    @property
    def static(self) -> str | None:
        """The fixed-shape step's mode where it runs the steps (`step_backend`); None: the engine's tree step."""
        return self.engine.backend.mode if self.engine.backend is not None else None

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
        if method in registry.head_methods() and options.head is None:   # the pipeline's head, with its speed-ups
            options = replace(options, head=self.engine.drafter.head)
        first = registry.build(method, self.target, options)
        # head drafters: siblings of one, sharing its head's output weight instead of a copy each
        return lambda: first.sibling() or registry.build(method, self.target, options)

    def pinned_to(self, method: str, options) -> Pipeline:
        """This pipeline's head drafting by `method` instead (its `options`, the head set here), its recorder and
        adapter carried over: the method a registry entry runs where the caller pins a tree (`Method.pinned`)."""
        options = replace(options, head=self.engine.drafter.head)
        # a head that adapts is the drafter's, which the fixed-shape step would not follow
        out = for_target(self.target, method, options, "off" if self.adapter is not None else None)
        out.recorder = self.recorder
        if self.adapter is not None:   # the head adapts on in the pinned pipeline
            self.adapter.bind(out)
        return out

    def config(self, **overrides) -> GenerationConfig:
        """A GenerationConfig with this pipeline's tree; keyword arguments set its other fields."""
        return GenerationConfig(**{"tree": self.tree, **overrides})

    def completed(self, config: GenerationConfig | None) -> GenerationConfig:
        """config as given, with this pipeline's tree where it sets none (None: `self.config()`): the generic
        `TreeConfig()` is a GPU-sized tree, several times slower a step than a head's CPU tree."""
        if config is None:
            return self.config()
        return config if tree_given(config) else replace(config, tree=self.tree)

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
        """config: None means `self.config()` (the head's recommended tree, greedy, 256 new tokens); a config
        without a tree of its own runs `self.tree` too."""
        ids = self.prompt_ids(prompt, chat_template)
        result = self.engine.generate(ids, self.completed(config))
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
        for step in self.engine.stream(prompt_ids, self.completed(config), stats):
            ids += step
            piece = text.add(step)
            if piece:
                yield piece
        if self.recorder is not None:   # a whole answer only: one stopped early (Ctrl-C) never gets here
            self.recorder.add(prompt_ids, ids)
        rest = text.add([], final=True)
        if rest:
            yield rest


def load(target: str | None = None, method: str = registry.DEFAULT, options=None, draft: str | None = None,
         dtype: str = "float32", device: str = "cpu", attention: str = "auto", static: str | None = None,
         record: str | None = None, adapt: str | None = None) -> Pipeline:
    """Load a target (the embedded SmolLM2 by default; a .gguf, folder or hub id) and a drafting method.

    method: one of `drafters.names()`; "default" runs eagle with the draft head shipped for the target (or the one
    `draft` names), or prompt lookup where no head ships; "auto" chooses each step between a plain step, prompt lookup
    and the head from this machine's costs (eagle_lite_wing/auto.py: unproven).
    options: that method's options dataclass (`drafters.EagleOptions` for auto, eagle and staged, `LookupOptions`,
    `LookaheadOptions`, `DraftModelOptions`, `LayerSkipOptions`, `MedusaOptions`).
    draft: shorthand for EagleOptions(draft=...): "auto", "random" (untrained: exact but slow) or a head folder.
    static: the fixed-shape step (static/step.py) runs the steps in this mode ("auto": CUDA graphs on CUDA, eager on a
    CPU; see `static.step.MODES`), greedy or sampled; methods eagle (without the prompt-lookup graft; auto runs it
    there) and vanilla (`Pipeline.static`). None: it does where it is the faster exact step (CUDA; vanilla, eagle
    with a sequential head), else the engine's tree step; "off": never.
    record: a folder where every completed answer is recorded as token ids, for training a head on them
    (`text.record`; `python -m trainers.train data=recorded data.distill.start_from=FOLDER`). None: nothing recorded.
    adapt: a folder where the head learns from the answers it serves (the wing's `adapt` extension, registered
    through drafters/plugins.py; unproven: `pipeline.adapter.round()` between answers, as the chat and the server
    do); a folder holding an adapted head resumes from it. Methods default, auto and eagle.
    """
    adapting = plugins.extension("adapt") if adapt is not None else None
    if adapting is not None:
        adapting.check(method)
        options, draft, static, state = adapting.before(adapt, options, draft, static)
    if draft is not None and method in registry.head_methods():
        if options is not None:
            raise ValueError("pass the head either as draft=... or inside options, not both")
        options = registry.EagleOptions(draft=draft)
    elif draft not in (None, registry.AUTO):
        raise ValueError(f"draft={draft!r} names an EAGLE head, but method is '{method}'")
    torch_dtype = getattr(torch, dtype, None)
    if not isinstance(torch_dtype, torch.dtype):
        raise ValueError(f"unknown dtype '{dtype}': use float32 or bfloat16")
    registry.check(method, options)              # before the (slow) target load
    if static is not None:
        check_static(method, static)
    if static not in (None, "off"):
        method = registry.METHODS[method].static   # the fixed-shape step runs one tree: eagle's
    tgt = load_target(target, dtype=torch_dtype, device=device, attention=attention)
    pipeline = for_target(tgt, method, options, static)
    if record is not None:
        from .text.record import Recorder

        pipeline.recorder = Recorder(record, tgt)
    if adapting is not None:
        adapting.after(pipeline, adapt, state)
    return pipeline


def engine_for(target: Target, method: str | Drafter | None = registry.DEFAULT, options=None) -> Engine:
    """The engine that decodes `target` with method `method`'s drafter (its `options`; "auto" resolved), with a drafter
    already built, or with none (None: each request brings its own, as the server's do), on the tree step. The
    server, custom_generate and eval come here; the pipeline adds its step backend (`step_backend`)."""
    drafter = registry.build(method, target, options) if isinstance(method, str) else method
    return Engine(target, drafter)


def static_engine_for(target: Target, head=None, mode: str = "auto", **options) -> Engine:
    """An engine whose steps the fixed-shape step runs (decoding/static/step.py) for `target`: plain decoding (head
    None) or EAGLE with `head` (the eagle drafter's draft in fixed shapes, drafters/eagle_static.py), in `mode`
    (`static.step.MODES`); options: StaticStep's others (max_len, profile, compile_backend, lookahead, fused). Eval's
    static methods come here."""
    from .decoding.static.step import StaticStep
    from .drafters.eagle_static import StaticDraft

    draft = None if head is None else StaticDraft(target, head, fused=options.get("fused", True))
    return Engine(target, None, StaticStep(target, draft, mode=mode, **options))


def step_backend(target: Target, drafter: Drafter | None, static: str | None = None):
    """The fixed-shape step (decoding/static/step.py) that runs `drafter`'s steps, or None (the engine's tree step).
    static: a mode of `static.step.MODES` (forced: a drafter with a `fixed_shape`, the lookup graft left out); "off":
    none; None: chosen where the drafter says it is the faster exact step (`FixedShape.preferred`) on a CUDA target
    (where the target cannot run it, the tree step, said in the log)."""
    from .decoding.static.step import StaticStep

    fixed = (drafter or NoDrafter()).fixed_shape()   # None: each request's own drafter, plain by default
    if static is None:
        if target.device.type != "cuda" or fixed is None or not fixed.preferred:
            return None
        try:
            return StaticStep(target, _built(fixed))
        except ValueError as err:
            log.info("the engine's tree step runs: %s", err)
            return None
    if static == "off":
        return None
    if fixed is None:
        raise ValueError(f"the static step runs methods eagle and vanilla, not '{drafter.name}'")
    return StaticStep(target, _built(fixed), mode=static)


def _built(fixed) -> object | None:
    """The draft a drafter's `FixedShape` builds for the fixed-shape step (None: plain decoding)."""
    return None if fixed.draft is None else fixed.draft(True)


def for_target(target: Target, method: str = registry.DEFAULT, options=None, static: str | None = None) -> Pipeline:
    """The drafter of `method` (its `options`; "auto" resolved) for a loaded target, with its tree and its step
    backend (`static`: `step_backend`'s): the one place a drafter and its tree are made for a target (`load`, the
    server, training's answers)."""
    method, options = registry.resolve(method, target, options)
    return Pipeline(target, registry.METHODS[method].build(target, options), method, options=options, static=static)


def check_static(method: str, mode: str) -> None:
    """Refuse what the static step cannot run: a method other than eagle and vanilla (`load` runs default and auto
    as eagle there: `Method.static`), an unknown mode ("off": any method, the engine's tree step)."""
    from .decoding.static.step import MODES

    if mode == "off":
        return
    if mode not in MODES:
        raise ValueError(f"unknown static step mode {mode!r}: choose one of {', '.join(MODES)}, off")
    if registry.METHODS[method].static is None:
        raise ValueError(f"the static step runs methods eagle and vanilla, not '{method}'")
