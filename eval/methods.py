"""The decoding methods an evaluation compares, each behind one call: prompt ids -> tokens + stats.

`hf_generate`, `hf_prompt_lookup` and `hf_assisted` (assisted generation with the draft_model's smaller LM) are
transformers' own `generate()` (the baselines users know);
`vanilla` and `eagle` are eagle_lite's engine without and with speculation; the other drafters
(staged, lookup, lookahead, draft_model, layer_skip, medusa) run through the same engine and verifier. `eagle_q`
and `eagle_match` are eagle with one sampling rule each (EagleOptions.draft_sampling), so that one run compares them;
`auto_q` and `auto_match` the same for method auto's head.
With a static step mode (`--static MODE`), `vanilla` and `eagle` run through the fixed-shape step instead
(static/step.py): captured in CUDA graphs on CUDA, eager on a CPU (greedy only; eagle without the prompt-lookup
graft); the other engine methods have no such mode. `llama_cpp` is
llama.cpp's own greedy decoding of the target's GGUF file (an optional comparison, needs
`llama-cpp-python`; it runs the file's quantized weights, so its tokens may differ from the fp32 target's).
"""
from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch

from eagle_lite.config import GenerationConfig
from eagle_lite.decoding.engine import Engine
from eagle_lite.drafters import registry
from eagle_lite.drafters.registry import eagle_head
from eagle_lite.pipeline import engine_for, static_engine_for
from eagle_lite.targets.loading import gguf_file
from eagle_lite.targets.model import Target


@dataclass
class Run:
    token_ids: list[int]
    seconds: float
    target_forwards: int | None        # None where the method does not report it
    accept_lengths: list[int]
    draft_depths: list[int] = field(default_factory=list)   # each step's tree depth, where the method drafts trees


Method = Callable[[list[int], GenerationConfig], Run]


def hf_generate(target: Target, prompt_lookup_num_tokens: int | None = None, assistant: Target | None = None) -> Method:
    """transformers' generate() on the stock model; prompt_lookup_num_tokens: its prompt lookup; assistant: its
    assisted generation with that smaller model drafting (both stock)."""
    eos = sorted(target.eos_token_ids) or None
    pad = getattr(target.tokenizer, "pad_token_id", None) if target.tokenizer is not None else None

    @torch.inference_mode()
    def run(prompt: list[int], cfg: GenerationConfig) -> Run:
        ids = torch.tensor([prompt], device=target.device)
        extra = {} if prompt_lookup_num_tokens is None else {"prompt_lookup_num_tokens": prompt_lookup_num_tokens}
        if assistant is not None:
            extra["assistant_model"] = assistant.model
        with target.stock(), (assistant.stock() if assistant is not None else contextlib.nullcontext()):
            # the baseline is stock transformers: its linears and attention
            start = time.perf_counter()
            out = target.model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=cfg.max_new_tokens,
                                        eos_token_id=eos, pad_token_id=pad if pad is not None else
                                        (eos[0] if eos else 0), **_hf_sampling(cfg), **extra)
            seconds = time.perf_counter() - start
        new = out[0, len(prompt):].tolist()
        forwards = len(new) if prompt_lookup_num_tokens is None and assistant is None else None
        return Run(new, seconds, forwards, [])

    return run


def _hf_sampling(cfg: GenerationConfig) -> dict:
    """generate()'s arguments for the engine's sampling settings (its own defaults, e.g. top_k 50, switched off)."""
    s = cfg.sampling
    if s.greedy:
        return {"do_sample": False}
    if cfg.seed is not None:
        torch.manual_seed(cfg.seed)          # generate() draws from the global generator
    return {"do_sample": True, "temperature": s.temperature, "top_p": s.top_p, "top_k": s.top_k or None}


def gguf_of(spec: str | None) -> Path:
    """The GGUF file behind a target spec (the embedded alias or a .gguf path), for llama.cpp."""
    gguf = gguf_file(spec)
    if gguf is None:
        raise ValueError(f"method 'llama_cpp' runs a GGUF file; target '{spec}' is not one (use the embedded "
                         f"alias or a .gguf path)")
    return gguf


def llama_cpp(target: Target, gguf: Path, threads: int | None = None) -> Method:
    """llama.cpp's decoding of `gguf` (same token ids as the target's tokenizer), timed like the others: greedy, or
    sampled with the same temperature / top-p / top-k (its min-p and penalties off)."""
    try:
        from llama_cpp import Llama
    except ImportError as err:
        raise ValueError("method 'llama_cpp' needs the optional package llama-cpp-python "
                         "(pip install llama-cpp-python: it compiles llama.cpp, several minutes)") from err
    n_ctx = min(target.max_context or 2048, 8192)
    threads = threads or torch.get_num_threads()
    llm = Llama(model_path=str(gguf), n_ctx=n_ctx, n_threads=threads, n_threads_batch=threads, verbose=False, seed=0)
    eos = target.eos_token_ids

    def run(prompt: list[int], cfg: GenerationConfig) -> Run:
        new: list[int] = []
        start = time.perf_counter()
        if cfg.max_new_tokens > 0:
            s = cfg.sampling
            if s.greedy:
                settings = dict(top_k=1, temp=0.0)
            else:
                llm.set_seed(cfg.seed if cfg.seed is not None else 0)
                settings = dict(top_k=s.top_k, top_p=s.top_p, min_p=0.0, temp=s.temperature)
            for token in llm.generate(prompt, reset=True, **settings):
                new.append(int(token))
                if token in eos or len(new) >= cfg.max_new_tokens:
                    break
        return Run(new, time.perf_counter() - start, len(new), [])

    return run


def engine_method(engine: Engine) -> Method:
    """The engine as a method; a drafter with `tree_for` (auto) runs the tree it makes of the configured one."""
    tree_for = getattr(getattr(engine, "drafter", None), "tree_for", None)

    def run(prompt: list[int], cfg: GenerationConfig) -> Run:
        if tree_for is not None:
            cfg = replace(cfg, tree=tree_for(cfg.tree))
        result = engine.generate(prompt, cfg)
        s = result.stats
        return Run(result.token_ids, s.seconds, s.target_forwards, s.accept_lengths, s.draft_depths)

    return run


def static_method(target: Target, head=None, mode: str = "auto", max_len: int | None = None) -> Method:
    """The engine on the fixed-shape step (static_step.StaticStep): plain decoding (head None) or EAGLE with `head`."""
    return engine_method(static_engine_for(target, head, mode, max_len=max_len))


HF_METHODS = ("hf_generate", "hf_prompt_lookup", "hf_assisted", "llama_cpp")
STATIC_METHODS = ("vanilla", "eagle")   # the methods a static step mode runs through the fixed-shape step
# eval's names for a registry method with some options set: (method, EagleOptions fields)
VARIANTS = {"eagle_q": ("eagle", {"draft_sampling": "q"}), "eagle_match": ("eagle", {"draft_sampling": "match"}),
            "auto_q": ("auto", {"draft_sampling": "q"}), "auto_match": ("auto", {"draft_sampling": "match"}),
            "eagle_full_vocab": ("eagle", {"draft_vocab": "full"}), "eagle_nocopy": ("eagle", {"copy_mode": False})}


def method_names() -> tuple[str, ...]:
    """Every method eval can run: the registry's as it is now (a method registered later included), and eval's own."""
    return (*HF_METHODS[:3], *registry.METHODS, *VARIANTS, "llama_cpp")


def check_static(names: list[str], static: str | None) -> None:
    """A static step mode runs vanilla and eagle alone among the engine's methods (transformers' and llama.cpp's run
    as they are beside them): ValueError naming the others."""
    if static is None:
        return
    engine = [n for n in names if n not in HF_METHODS and n not in STATIC_METHODS]
    if engine:
        raise ValueError(f"--static {static} runs methods vanilla and eagle through the fixed-shape step; {engine} "
                         f"run on the engine only: drop them, or --static")


def registry_method(name: str, options: dict[str, Any]) -> tuple[str, Any] | None:
    """(registry method, its options) that eval's method `name` runs; None for the HF, llama.cpp and static-step
    methods. options: each registry method's options (None: defaults)."""
    if name in VARIANTS:
        base, fields = VARIANTS[name]
        return base, replace(options.get(base) or registry.METHODS[base].options(), **fields)
    return (name, options.get(name)) if name in registry.METHODS else None


def build_methods(target: Target, names: list[str], options: dict[str, Any] | None = None,
                  gguf: Path | None = None, threads: int | None = None, static: str | None = None,
                  static_max_len: int | None = None) -> dict[str, Method]:
    """Method name -> callable. The engine's methods are the drafter registry's (`eagle_lite.drafters.names()`), each
    built with `options[name]` (its options dataclass; None: defaults), and their VARIANTS. Besides them: hf_generate,
    hf_prompt_lookup and hf_assisted (transformers' assisted generation with the draft_model method's smaller LM) and
    llama_cpp (needs gguf, the target's GGUF file, and llama-cpp-python; threads: its CPU threads). static: a static
    step mode, in which vanilla and eagle run through the fixed-shape step (its caches `static_max_len` slots; eagle
    with the head of `options["eagle"]`)."""
    options = dict(options or {})
    unknown = [n for n in names if n not in method_names()]
    if unknown:
        raise ValueError(f"unknown method(s) {unknown}: choose from {sorted(method_names())}")
    check_static(names, static)
    if "hf_assisted" in names or "draft_model" in names:
        # both run the same smaller LM: load it once
        o = options.get("draft_model") or registry.DraftModelOptions()
        registry.check("draft_model", o)
        if o.draft_target is None:
            from eagle_lite.targets.loading import load_target

            o = replace(o, draft_target=load_target(o.model, dtype=target.dtype, device=str(target.device)))
        options["draft_model"] = o
    engine = {n: None if static and n in STATIC_METHODS else registry_method(n, options) for n in names}
    for method in engine.values():
        if method is not None:
            registry.check(*method)
    if "llama_cpp" in names and gguf is None:
        raise ValueError("method 'llama_cpp' needs the target's GGUF file (gguf=...)")
    factories = {
        "hf_generate": lambda: hf_generate(target),
        "hf_prompt_lookup": lambda: hf_generate(target, prompt_lookup_num_tokens=10),
        "hf_assisted": lambda: hf_generate(target, assistant=options["draft_model"].draft_target),
        "llama_cpp": lambda: llama_cpp(target, gguf, threads),
    }
    if static:
        factories.update({
            "vanilla": lambda: static_method(target, None, static, static_max_len),
            "eagle": lambda: static_method(target, eagle_head(target, options.get("eagle")), static, static_max_len)})
    return {n: factories[n]() if n in factories else
            engine_method(engine_for(target, engine[n][0], engine[n][1])) for n in names}
