"""Every entry point's options in one place: the flags of `python -m eagle_lite.generate` and `python -m
eagle_lite.serve`, the method flags of the eval tools, and the method keys of their configs and of training's.

A method's own settings are declared once, on its options dataclass (`drafters/registry.py`), with `option`:

    exit_layer: int | None = option(None, "exit-layer", "draft with the target's first N layers", type=int)

is the flag `--exit-layer` of every entry point and the key `exit_layer` of every config (a config's nested keys
joined by `_`: `lookahead: {window: 2}` is `lookahead_window`). Flags more than one entry point takes are
eagle_lite/config.py's `SHARED` (`add_flag`).
"""
from __future__ import annotations

import argparse
import dataclasses
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any, NamedTuple

from .cli import arguments
from .config import (
    OPTION,
    SHARED,
    STATIC_MODES,
    Flag,
    GenerationConfig,
    SamplingConfig,
    TreeConfig,
    add_flag,
    default_tree,
    option,
    resolve_tree,
    tree_spec,
)
from .drafters import registry
from .threads import check_threads, set_threads

__all__ = ["Flag", "option", "method_flags", "add_method_flags", "option_values", "options_of", "every_options",
           "config_keys", "SHARED", "add_flag", "add_method_flag", "tree_spec", "add_model_flags",
           "add_sampling_flags", "add_tree_flags", "add_device_flags", "tree_flags", "generation_config", "check_flags",
           "load_from_flags", "note_default_tree", "quiet_libraries", "target_of"]


class Declared(NamedTuple):
    flag: Flag
    methods: list[str]   # the methods whose options have it
    default: Any         # its field's default


def options_class(method: str) -> type:
    """The options dataclass of `method`."""
    return type(registry.options_for(method))


def method_flags(methods=None) -> dict[str, Declared]:
    """Flag key -> its declaration, over `methods` (None: every registered one), in their order."""
    flags: dict[str, Declared] = {}
    for name in methods if methods is not None else registry.METHODS:
        for f in dataclasses.fields(registry.METHODS[name].options):
            if OPTION in f.metadata:
                declared = flags.setdefault(f.metadata[OPTION].key, Declared(f.metadata[OPTION], [], f.default))
                declared.methods.append(name)
    return flags


def add_method_flags(parser, methods=None, skip=()) -> None:
    """`--name` for every option of `methods` (None: every registered method) but the keys in `skip`, its default the
    field's."""
    for key, (flag, names, default) in method_flags(methods).items():
        if key in skip:
            continue
        shown = "" if default is None else " (default: %(default)s)"
        parser.add_argument(f"--{flag.name}", dest=key, default=default, type=flag.type, choices=flag.choices,
                            metavar=flag.metavar, help=f"--method {'/'.join(names)}: {flag.help}{shown}")


def option_values(source) -> dict[str, Any]:
    """The method options `source` gives, by key: parsed flags (an argparse Namespace) or a config (a mapping,
    nested keys joined by `_`). Unset ones (None) are left out: their method's default stands."""
    items = vars(source) if isinstance(source, argparse.Namespace) else _flat(source)
    keys = method_flags()
    return {k: v for k, v in items.items() if k in keys and v is not None}


def _flat(config: Mapping, prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in config.items():
        if isinstance(value, Mapping):
            out.update(_flat(value, f"{prefix}{key}_"))
        else:
            out[f"{prefix}{key}"] = value
    return out


def config_keys() -> dict[str, Any]:
    """Every registered method's options as config keys, each null (unset: the method's default): `{method}_{name}`
    nested under its method where that name is no key itself (`lookahead: {window: null}`, set as
    lookahead.window=2), the rest flat (`exit_layer`, `medusa`, `medusa_choices`). `_flat` reads them back."""
    keys = method_flags()
    config: dict[str, Any] = {}
    for key in keys:
        method, _, name = key.partition("_")
        if name and method in registry.METHODS and method not in keys:
            config.setdefault(method, {})[name] = None
        else:
            config[key] = None
    return config


def unknown_keys(values: Mapping) -> list[str]:
    """The keys of `values` (a config: nested keys joined by `_`) that are no method's option."""
    return sorted(set(_flat(values)) - set(method_flags()))


def options_of(method: str, values: Mapping | argparse.Namespace | None = None, **fields) -> Any:
    """Method `method`'s options dataclass from `values` (`option_values`' keys; the rest are ignored) and `fields`
    (its own field names: what a caller sets that no flag does, a loaded head)."""
    values = option_values(values) if isinstance(values, argparse.Namespace) else dict(values or {})
    cls = options_class(method)
    given = {f.name: values[f.metadata[OPTION].key] for f in dataclasses.fields(cls)
             if OPTION in f.metadata and values.get(f.metadata[OPTION].key) is not None}
    return cls(**{**given, **fields})


def every_options(values: Mapping | None = None) -> dict[str, Any]:
    """Every registered method's options from `values` (`option_values`)."""
    return {name: options_of(name, values) for name in registry.METHODS}


def add_method_flag(p, methods=None, note: str | None = None, **changes) -> argparse.Action:
    """--method over `methods` (None: every registered one; default: the registry's default method where it is among
    them, else auto where it is), each named with its registry summary."""
    names = list(registry.METHODS) if methods is None else list(methods)
    text = "; ".join(f"{name}: {registry.METHODS[name].summary}" for name in names) + (f"; {note}" if note else "")
    default = next((name for name in (registry.DEFAULT, registry.AUTO) if name in names), None)
    kwargs = {"default": default, "choices": names, **changes}
    return p.add_argument("--method", help=text, **kwargs)


# -- the CLI's and the server's flags ---------------------------------------------------------------------------
def add_model_flags(p: argparse.ArgumentParser) -> None:
    """The flags of the model, the method (every registered method's own), the draft tree and sampling: the CLI's
    (`python -m eagle_lite.generate`) and the server's (`python -m eagle_lite.serve`) alike."""
    add_flag(p, "target")
    add_method_flag(p, note="auto with a --tree-* flag runs eagle on that tree")
    add_method_flags(p)
    add_flag(p, "max-new-tokens")
    p.add_argument("--record", default=None, metavar="DIR",
                   help="record every completed answer as token ids in DIR, to train a head on this traffic "
                        "(python -m trainers.train data=recorded data.distill.start_from=DIR); off by default")
    p.add_argument("--adapt", default=None, metavar="DIR",
                   help="the head keeps learning from the answers it serves (between chat turns, while a server is "
                        "idle), kept in DIR as a head folder and resumed from it; methods auto and eagle")
    add_sampling_flags(p.add_argument_group("sampling (temperature 0 = greedy)"))
    add_tree_flags(p)
    add_device_flags(p)


def add_sampling_flags(g, seed: int | None = None, seed_note: str | None = None) -> None:
    """--temperature, --top-p, --top-k and --seed (default `seed`): `SamplingConfig`'s fields and the draws' seed."""
    for name in ("temperature", "top-p", "top-k"):
        add_flag(g, name)
    add_flag(g, "seed", default=seed, note=seed_note)


def add_tree_flags(p: argparse.ArgumentParser) -> None:
    """The --tree-* flags, in their own group: `TreeConfig`'s fields, unset by default (`tree_flags`)."""
    tree, cpu, gpu = TreeConfig(), default_tree("cpu"), default_tree("cuda")
    t = p.add_argument_group("draft tree (EAGLE-2 dynamic tree; unset: the tree the draft head recommends for the "
                             f"device, else depth {cpu.depth}, top_k {cpu.top_k}, total_tokens {cpu.total_tokens}, "
                             f"lookup {cpu.lookup} on a CPU and depth {gpu.depth}, top_k {gpu.top_k}, total_tokens "
                             f"{gpu.total_tokens}, lookup {gpu.lookup} on a GPU)")
    t.add_argument("--tree-depth", type=int, default=None, help="expansion steps (longest drafted path)")
    t.add_argument("--tree-top-k", type=int, default=None, help="children per expanded node")
    t.add_argument("--tree-total-tokens", type=int, default=None, help="drafted nodes verified per step")
    t.add_argument("--tree-lookup", type=int, default=None,
                   help="graft up to N prompt-lookup tokens onto the tree as one more path; once one is accepted "
                        "whole, the next trees are lookup chains alone while they keep being accepted (0: off)")
    t.add_argument("--tree-min-prob", type=float, default=None,
                   help="verify only drafted nodes whose path probability under the draft is at least P, and stop "
                        f"expanding below it (0: off; default {tree.min_prob})")


def add_device_flags(p: argparse.ArgumentParser, attention: bool = True) -> None:
    """--dtype, --device, --threads and (attention=True) --attention: where and how the target runs (every tool that
    loads one)."""
    for name in ("dtype", "device", "threads", *(("attention",) if attention else ())):
        add_flag(p, name)


def add_static_flag(p, what: str = "decoding through", off: bool = False) -> None:
    """--static [MODE]: methods eagle (without the lookup graft) and vanilla through the fixed-shape step
    (decoding/static/step.py), a mode of theirs rather than other methods (the CLI, eval.benchmark, eval.tune,
    eval.profile_step). off: MODE off too, the CLI's, which runs the step unasked where it is the faster exact one."""
    p.add_argument("--static", nargs="?", const="auto", default=None, metavar="MODE",
                   choices=(*STATIC_MODES, "off") if off else STATIC_MODES,
                   help=f"{what} the fixed-shape step (methods eagle, without the lookup graft, and vanilla): MODE "
                        f"auto = CUDA graphs on CUDA, eager on a CPU; or eager, compile, cuda-graph"
                        + ("; off: never (unset: auto on CUDA for vanilla and eagle with a sequential head)" if off
                           else "") + " (docs/gpu.md)")


def target_of(target: str | None, draft=None) -> str | None:
    """--target as given; without it, the target the head `draft` (a folder) was trained for, where that target
    loads here (`targets.loading.resolves`), said in one line on stderr; else None (the default target). Every tool
    that takes --draft starts here."""
    from .heads.checkpoint import recorded_target
    from .targets.loading import resolves

    if target or draft is None or str(draft) in ("auto", "random") or not Path(draft).is_dir():
        return target
    spec = recorded_target(draft)
    if spec is None or not resolves(spec):
        return None
    print(f"target: {spec} (the one {draft} was trained for)", file=sys.stderr)
    return spec


def tree_flags(args: argparse.Namespace) -> dict:
    """The --tree-* flags as TreeConfig fields (None: unset, the drafter's recommendation stands)."""
    return {"depth": args.tree_depth, "top_k": args.tree_top_k, "total_tokens": args.tree_total_tokens,
            "lookup": args.tree_lookup, "min_prob": args.tree_min_prob}


def generation_config(args: argparse.Namespace, recommended: TreeConfig | None = None) -> GenerationConfig:
    """The flags' config; the tree is resolved by `config.resolve_tree` over the drafter's recommendation."""
    return GenerationConfig(
        max_new_tokens=args.max_new_tokens,
        sampling=SamplingConfig(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k),
        tree=resolve_tree(recommended, **tree_flags(args)),
        seed=args.seed,
    )


def check_flags(args: argparse.Namespace) -> None:
    """Refuse, before the (slow) model load, every flag that is wrong whatever the model: ValueError."""
    TreeConfig.check_overrides(tree_flags(args))
    GenerationConfig(max_new_tokens=args.max_new_tokens, seed=args.seed,
                     sampling=SamplingConfig(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k))
    check_threads(args.threads)
    for flag in ("record", "adapt"):   # a folder that cannot be written to is found before the target loads
        if getattr(args, flag, None):
            from .atomic import check_folder_writable

            check_folder_writable(getattr(args, flag))
    if getattr(args, "adapt", None):
        from .drafters.plugins import extension

        extension("adapt").check(args.method)
    if args.static is not None:
        from .pipeline import check_static

        check_static(args.method, args.static)


def note_default_tree(lm, args: argparse.Namespace, cfg: GenerationConfig) -> None:
    """One `note:` line on stderr where a trained EAGLE head recommends no tree for the device and no tree flag chose
    one: which tree runs (the device's default) and how to find this machine's (the CLI and the server). An untrained
    head (`--draft random`) checks exactness, not speed, and gets none."""
    chosen = any(v is not None for v in tree_flags(args).values())
    if lm.tree_unrecommended and not chosen and args.draft != "random":
        t = cfg.tree
        print(f"note: the head recommends no draft tree for {args.device}, so the device's default runs (depth "
              f"{t.depth}, top_k {t.top_k}, total_tokens {t.total_tokens}, lookup {t.lookup}); python -m eval.tune "
              f"--method eagle --draft {args.draft} --save-tree finds and records the fastest here", file=sys.stderr)


def quiet_libraries(verbose: bool) -> None:
    """transformers' loading logs and progress bars only with --verbose."""
    if not verbose:
        import transformers

        transformers.logging.set_verbosity_error()
        transformers.logging.disable_progress_bar()


def load_from_flags(args: argparse.Namespace):
    """The flags' threads, then `load()` of their target and method, then their GenerationConfig over the
    pipeline's tree: (pipeline, config). The CLI and the server both start here."""
    from .pipeline import load

    set_threads(args.threads)
    args.target = target_of(args.target, getattr(args, "draft", None) or getattr(args, "medusa", None))
    lm = load(args.target, method=args.method, options=options_of(args.method, args), dtype=args.dtype,
              device=args.device, attention=args.attention, static=args.static, record=args.record,
              adapt=getattr(args, "adapt", None))
    pinned = registry.METHODS[lm.method].pinned
    if pinned and lm.engine.drafter.head is not None and \
            any(v is not None for v in tree_flags(args).values()):   # a tree given is pinned: eagle runs it
        lm = lm.pinned_to(pinned, options_of(pinned, args))
    with arguments():   # a tree flag that does not fit the head's recommended tree
        cfg = generation_config(args, lm.tree)
    note_default_tree(lm, args, cfg)
    return lm, cfg
