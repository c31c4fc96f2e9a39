"""Method eagle's options, its head (the shipped one, an untrained one, or a folder) and the drafter of a head's kind.

A head kind without a drafter here brings its own (`register_head_drafter`: a parallel head's, eagle_lite_wing's,
registered through the plugin entry points, eagle_lite/drafters/plugins.py).
"""
from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from ..config import DRAFT_HELP, DRAFT_SAMPLING, DRAFT_VOCAB, option
from ..decoding.drafter import Drafter
from . import plugins
from .eagle import EagleDrafter
from .lookup_graft import LookupGraft
from .prompt_lookup import LookupOptions

log = logging.getLogger("eagle_lite")

AUTO = "auto"   # --draft auto: the head shipped for the target
EAGLE_SAMPLING = "q"   # eagle's draft_sampling where none is given: its q accepts more in its trees (docs/methods.md)


@dataclass(frozen=True)
class EagleOptions:
    """draft: "auto" (the head shipped for the target), "random" (untrained: exact but slow, for tests), or a head
    folder. head: an already loaded DraftHead (overrides draft). copy_mode: see lookup_graft.LookupGraft.
    draft_sampling: with temperature > 0, "q" draws the tree from the head's distribution and accepts sibling by
    sibling by recursive rejection (EAGLE's sampling); "match" drafts the head's top-k as in greedy decoding and
    accepts by sample-and-match (drafters/eagle.py). Both are exact; greedy decoding ignores it. None: the method's
    own (`Method.draft_sampling`: q for eagle and staged).
    draft_vocab: "head" drafts over the head's own draft vocabulary; "full" over the target's whole vocabulary,
    for heads that score through the target's lm_head (DraftHead.over_full_vocabulary): costlier per draft row,
    and it accepts more in wide trees (docs/training.md)."""

    draft: str | None = option("auto", "draft", DRAFT_HELP)   # the eval tools' --draft too (flags.SHARED)
    head: Any = None
    round_head: bool = True
    copy_mode: bool = True
    draft_sampling: str | None = option(None, "draft-sampling", "with --temperature > 0: 'q' draws the tree from the "
                                        "head's distribution and accepts sibling by sibling by recursive rejection "
                                        "(EAGLE's sampling); 'match' drafts the head's top-k and accepts the child "
                                        "the target's sample matches. Both exact. Default: the method's own (q for "
                                        "eagle and staged)", choices=DRAFT_SAMPLING)
    draft_vocab: str = option("head", "draft-vocab", "'head' drafts over the head's own draft vocabulary; 'full' over "
                              "the target's whole vocabulary (heads that score through the target's lm_head): each "
                              "draft row costs more, and wide trees accept more", choices=DRAFT_VOCAB)


# a head kind -> the drafter of its heads: "sequential" (one token a head forward) is drafters/eagle.py's
HEAD_DRAFTERS: dict[str, Callable[..., Drafter]] = {"sequential": EagleDrafter}


def register_head_drafter(kind: str, make: Callable[..., Drafter]) -> None:
    """`make(target, head, **options)` drafts with heads of `kind` (`head_kind`)."""
    HEAD_DRAFTERS[kind] = make


def head_kind(head) -> str:
    return "parallel" if head.parallel else "sequential"


def eagle_drafter(target, head, **options) -> Drafter:
    """The drafter of an EAGLE head of any registered kind (drafters/eagle.py's options)."""
    kind = head_kind(head)
    if kind not in HEAD_DRAFTERS:
        plugins.load()
    if kind not in HEAD_DRAFTERS:
        raise ValueError(f"no drafter is installed for a {kind} head: install eagle_lite with its wing "
                         f"(pip install -e . from a source checkout)")
    return HEAD_DRAFTERS[kind](target, head, **options)


def build_eagle(target, o: EagleOptions, staged: bool = False) -> Drafter:
    drafter = eagle_drafter(target, eagle_head(target, o), round_head=o.round_head,
                            draft_sampling=o.draft_sampling or EAGLE_SAMPLING)
    return LookupGraft(drafter, copy_mode=o.copy_mode, staged=staged)


def check_eagle(o: EagleOptions) -> None:
    if o.draft_sampling is not None and o.draft_sampling not in DRAFT_SAMPLING:
        raise ValueError(f"draft_sampling must be one of {', '.join(DRAFT_SAMPLING)}, got {o.draft_sampling!r}")
    if o.draft_vocab not in DRAFT_VOCAB:
        raise ValueError(f"draft_vocab must be one of {', '.join(DRAFT_VOCAB)}, got {o.draft_vocab!r}")
    if o.head is None and o.draft not in (None, AUTO, "random"):
        from ..formats import check_folder

        check_folder(o.draft, "eagle")


def resolve_default(target, options) -> tuple[str, Any]:
    """Method default: eagle with the head `options` names (the shipped one by default), or lookup where no head
    ships for `target`."""
    eagle = options if isinstance(options, EagleOptions) else EagleOptions()
    head = eagle.head if eagle.head is not None else load_eagle_head(target, eagle.draft)
    if head is None:
        log.warning("no draft head ships for target '%s': the default method is lookup (training-free); train a "
                    "head with `python -m trainers.train` and pass it with --draft", target.name)
        return "lookup", LookupOptions()
    return "eagle", replace(eagle, head=head)


def eagle_head(target, options=None):
    """The EAGLE head method eagle runs (the drafter, and the static step): the one `options` (EagleOptions) holds
    or names, the shipped one by default, over the vocabulary `options.draft_vocab` says."""
    options = options or EagleOptions()
    head = options.head if options.head is not None else load_eagle_head(target, options.draft)
    if head is None:
        raise FileNotFoundError(f"no draft head ships for target '{target.name}': pass --draft PATH (a trained head), "
                                f"--draft random (untrained: exact but slow), or --method lookup / vanilla")
    return head.over_full_vocabulary() if options.draft_vocab == "full" else head


def load_eagle_head(target, draft: str | Path | None):
    """The EAGLE head `draft` names for `target`: "auto"/None -> the shipped one (None if none ships), "random" ->
    an untrained head (the same one each time: with draft_sampling "q" the draws depend on the head, and a seed
    reproduces them), else a head folder."""
    import torch

    from ..formats import load_head
    from ..heads.checkpoint import default_head_path
    from ..heads.draft import DraftHead

    if draft == "random":
        with torch.random.fork_rng(devices=[]):          # the caller's random state is left as it was
            torch.manual_seed(0)
            return DraftHead.for_target(target)
    if draft in (None, AUTO):
        path = default_head_path(target.name)
        return load_head(path, target) if path is not None else None
    return load_head(Path(draft), target)
