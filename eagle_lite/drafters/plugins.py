"""Packages that extend eagle_lite register themselves through the `eagle_lite.plugins` entry points: each names a
function that the registries' first use calls once (a method, a head kind's drafter, a `load` extension; the wing's
is eagle_lite_wing/plugin.py). The core imports none of them by name.
"""
from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from importlib.metadata import entry_points

log = logging.getLogger("eagle_lite")

GROUP = "eagle_lite.plugins"
_loaded = False


@dataclass(frozen=True)
class Extension:
    """A keyword of `load` that a plugin adds (the wing's `adapt`): check(method) refuses a method before the target
    loads; before(value, options, draft, static) -> (options, draft, static, state) runs before the pipeline is
    built; after(pipeline, value, state) once it is."""

    check: Callable[[str], None]
    before: Callable
    after: Callable


EXTENSIONS: dict[str, Extension] = {}


def register_extension(name: str, extension: Extension) -> None:
    EXTENSIONS[name] = extension


def extension(name: str) -> Extension:
    """The `load` keyword `name` a plugin registered; ValueError where none is installed."""
    load()
    if name not in EXTENSIONS:
        raise ValueError(f"--{name} comes with eagle_lite's wing, which is not installed here: install eagle_lite "
                         f"from its source checkout (pip install -e .)")
    return EXTENSIONS[name]


def load() -> None:
    """Call every installed plugin's registration once; one that fails is logged and skipped."""
    global _loaded
    if _loaded:
        return
    _loaded = True
    for entry in entry_points(group=GROUP):
        try:
            entry.load()()
        except Exception as err:  # noqa: BLE001 (a broken plugin must not stop the core's own methods)
            log.warning("the eagle_lite plugin %r failed to register (%s: %s)", entry.name, type(err).__name__, err)
