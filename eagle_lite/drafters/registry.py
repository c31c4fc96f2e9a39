"""One table from method names to drafters: every entry point (CLI, `eagle_lite.load`, eval, trainers) builds its
drafter here, and a method's own resolution (default: eagle with its head, or lookup) runs here alone.

    drafter = build("eagle", target, EagleOptions(draft="auto"))
    drafter = build("lookup", target)                 # default options

A new method is one module in drafters/ (its drafter, its options dataclass and a function building the one from the
other) plus one `Method` line in `METHODS`; a package outside the core registers its own (`register`, called from its
plugin entry point: plugins.py). An options field declared with `config.option` is a flag of every entry point and a
key of every config (eagle_lite/options.py); `check` validates what can be checked before the (slow) target load;
`tune` is the grid `python -m eval.tune` sweeps for it (`Tuning`), or why it sweeps none.
"""
from __future__ import annotations

from collections.abc import Callable, Iterator, MutableMapping
from dataclasses import dataclass
from functools import partial
from typing import Any

from ..decoding.drafter import Drafter, NoDrafter, VanillaOptions
from . import plugins
from .draft_model import DraftModelOptions, build_draft_model, check_draft_model
from .eagle_options import AUTO, EagleOptions, build_eagle, check_eagle, eagle_head, load_eagle_head, resolve_default
from .grids import CHAIN, LOOKAHEAD, MEDUSA, TREE, Axis, Tuning
from .layer_skip import LayerSkipOptions, build_layer_skip
from .lookahead import LookaheadOptions, build_lookahead, check_lookahead
from .medusa import MedusaOptions, build_medusa, check_medusa
from .prompt_lookup import LookupOptions, build_lookup

__all__ = ["AUTO", "Axis", "CHAIN", "TREE", "Tuning", "DraftModelOptions", "EagleOptions", "LayerSkipOptions",
           "LookaheadOptions", "LookupOptions", "MedusaOptions", "VanillaOptions", "eagle_head", "load_eagle_head"]

DEFAULT = "default"   # the CLI's, the Python API's and the server's method: eagle with a head, else lookup


@dataclass(frozen=True)
class Method:
    """options: its options dataclass; build(target, options): its drafter; summary: its line of --help;
    check(options): refuses what cannot work, before the target loads; tune: its eval.tune grid (a str: why none);
    resolve(target, options) -> (method, options): what it runs as (None: itself); static: the method a forced
    fixed-shape step runs for it (None: it cannot run there); pinned: the method run where the caller pins a tree;
    draft_sampling: its heads' sampling rule where its options set none (EagleOptions.draft_sampling)."""

    options: type
    build: Callable[[Any, Any], Drafter]
    summary: str
    check: Callable[[Any], None] = lambda options: None
    tune: Tuning | str = "no tuning grid in its registry entry"
    resolve: Callable[[Any, Any], tuple[str, Any]] | None = None
    static: str | None = None
    pinned: str | None = None
    draft_sampling: str | None = None


class Table(MutableMapping):
    """Methods by name: the core's, then those the installed plugins register (loaded on first use)."""

    def __init__(self, methods: dict[str, Method]) -> None:
        self._methods = methods

    def __getitem__(self, name: str) -> Method:
        plugins.load()
        return self._methods[name]

    def __iter__(self) -> Iterator[str]:
        plugins.load()
        return iter(list(self._methods))

    def __len__(self) -> int:
        plugins.load()
        return len(self._methods)

    def __setitem__(self, name: str, method: Method) -> None:
        self._methods[name] = method

    def __delitem__(self, name: str) -> None:
        del self._methods[name]


METHODS = Table({
    DEFAULT: Method(EagleOptions, build_eagle, "eagle where a draft head ships for the target (or --draft names one), "
                    "else lookup: on held-out questions the faster of the fixed methods, greedy and sampled "
                    "(docs/benchmarks.md)", check_eagle, "it runs eagle or lookup: tune those", resolve_default,
                    static="eagle", draft_sampling="q"),
    "eagle": Method(EagleOptions, build_eagle, "an EAGLE draft head's dynamic tree (plus a prompt-lookup graft)",
                    check_eagle, TREE, static="eagle", draft_sampling="q"),
    "staged": Method(EagleOptions, partial(build_eagle, staged=True), "eagle whose head reads the prompt-lookup chain "
                     "in its own forward and grafts the part it agrees with plus its next token", check_eagle,
                     "it drafts eagle's tree with the same head: tune that with --method eagle", draft_sampling="q"),
    "lookup": Method(LookupOptions, build_lookup, "prompt n-gram lookup (training-free)", tune=CHAIN),
    "lookahead": Method(LookaheadOptions, build_lookahead, "lookahead decoding: Jacobi window + n-gram pool "
                        "(training-free)", check_lookahead, LOOKAHEAD),
    "draft_model": Method(DraftModelOptions, build_draft_model, "a smaller LM drafts a chain (--draft-model)",
                          check_draft_model, CHAIN),
    "layer_skip": Method(LayerSkipOptions, build_layer_skip,
                         "the target's first --exit-layer layers draft (no extra weights)", tune=CHAIN),
    "medusa": Method(MedusaOptions, build_medusa, "Medusa heads' static tree (--medusa)", check_medusa, MEDUSA),
    "vanilla": Method(VanillaOptions, lambda target, o: NoDrafter(), "one target forward per token",
                      tune="the baseline every candidate is timed against", static="vanilla"),
})
def register(name: str, method: Method) -> None:
    """Add method `name` (a plugin's: its registration function calls this)."""
    METHODS[name] = method


def names() -> tuple[str, ...]:
    return tuple(METHODS)


def head_methods() -> tuple[str, ...]:
    """The methods of an EAGLE head: those that take EagleOptions."""
    return tuple(name for name, m in METHODS.items() if m.options is EagleOptions)


def options_for(name: str, options: Any = None) -> Any:
    """`options` checked against method `name` (None: that method's defaults)."""
    method = _method(name)
    if options is None:
        return method.options()
    if not isinstance(options, method.options):
        raise TypeError(f"method '{name}' takes {method.options.__name__}, got {type(options).__name__}")
    return options


def check(name: str, options: Any = None) -> None:
    """Refuse a method or options that cannot work, before any model is loaded: an unknown method, one without
    what it needs, a head or Medusa folder that is missing or of another kind, a draft model spec naming nothing,
    lookahead sizes out of range."""
    _method(name).check(options_for(name, options))


def resolve(name: str, target, options: Any = None) -> tuple[str, Any]:
    """(method, options) that method `name` runs as for `target` (its `Method.resolve`: "default" is eagle with its
    head loaded into its options, or lookup where no head ships)."""
    method = _method(name)
    return (name, options_for(name, options)) if method.resolve is None else method.resolve(target, options)


def build(name: str, target, options: Any = None) -> Drafter:
    """The drafter of method `name` for `target` (resolved by `resolve`)."""
    name, options = resolve(name, target, options)
    return METHODS[name].build(target, options)


def _method(name: str) -> Method:
    if name not in METHODS:
        raise ValueError(f"unknown method '{name}': choose one of {', '.join(METHODS)}")
    return METHODS[name]
