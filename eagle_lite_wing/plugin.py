"""The wing's registration, called once by eagle_lite's plugin loader (the `eagle_lite.plugins` entry point in
pyproject.toml): method auto, the parallel head's drafter and `load(adapt=...)` / `--adapt`, each through the core's
own registries. The core names none of them."""
from __future__ import annotations

AUTO_SUMMARY = ("each step the fastest proposal by this machine's costs and the request's acceptance so far: a plain "
                "step, prompt lookup, or the draft head's tree with lookup grafted on (eagle_lite_wing/auto.py: "
                "unproven); lookup and plain steps where no head ships")
ADAPT_METHODS = ("default", "auto", "eagle")   # the methods whose head --adapt trains


def register() -> None:
    from eagle_lite.drafters import plugins, registry
    from eagle_lite.drafters.eagle_options import EagleOptions, check_eagle, register_head_drafter

    from . import auto

    registry.register("auto", registry.Method(
        EagleOptions, lambda target, o: auto.build(target, o), AUTO_SUMMARY, check_eagle,
        "its controller chooses each step's proposal (eval.profile_step shows its choices); tune the head's tree it "
        "grows from with --method eagle", resolve=auto.resolve, static="eagle", pinned="eagle",
        draft_sampling=auto.DRAFT_SAMPLING))
    register_head_drafter("parallel", _parallel_drafter)
    plugins.register_extension("adapt", plugins.Extension(_check_adapt, _resume, _attach))


def _parallel_drafter(target, head, **options):
    from .parallel import ParallelDrafter

    return ParallelDrafter(target, head, **options)


def _check_adapt(method: str) -> None:
    if method not in ADAPT_METHODS:
        raise ValueError(f"--adapt trains a draft head: use --method default, auto or eagle, not {method}")


def _resume(folder, options, draft, static):
    from .adapt import resume

    options, draft, start_draft = resume(folder, options, draft, static)
    return options, draft, "off", start_draft   # the head it learns is the drafter's: no fixed-shape step


def _attach(pipeline, folder, start_draft) -> None:
    from .adapt import attach

    attach(pipeline, folder, start_draft)
