"""One table from method names to drafters: every entry point (CLI, `eagle_lite.load`, eval, trainers) builds its
drafter here, and "auto" is resolved here alone.

    drafter = build("eagle", target, EagleOptions(draft="auto"))
    drafter = build("lookup", target)                 # default options

A new method is one module in drafters/ (its drafter, its options dataclass and a function building the one from the
other) plus one `Method` line in `METHODS`. An options field declared with `config.option` is a flag of every entry
point and a key of every config (eagle_lite/options.py); `check` validates what can be checked before the (slow)
target load; `tune` is the grid `python -m eval.tune` sweeps for it (`Tuning`), or why it sweeps none.
"""
from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, replace
from functools import partial
from pathlib import Path
from typing import Any

from ..config import DRAFT_HELP, DRAFT_SAMPLING, DRAFT_VOCAB, option
from ..decoding.drafter import Drafter, NoDrafter

log = logging.getLogger("eagle_lite")

# each method's sampling rule for its head where none is given (EagleOptions.draft_sampling): eagle's q accepts more
# in its trees; auto's match makes a seed's sampled answer the target's own draws, whatever the controller proposes
# (the very tokens vanilla emits for that seed), and accepted more a step than q in auto's chains (docs/methods.md)
DRAFT_SAMPLING_OF = {"eagle": "q", "auto": "match"}


@dataclass(frozen=True)
class EagleOptions:
    """draft: "auto" (the head shipped for the target), "random" (untrained: exact but slow, for tests), or a head
    folder. head: an already loaded DraftHead (overrides draft). copy_mode: see lookup_graft.LookupGraft.
    draft_sampling: with temperature > 0, "q" draws the tree from the head's distribution and accepts sibling by
    sibling by recursive rejection (EAGLE's sampling); "match" drafts the head's top-k as in greedy decoding and
    accepts by sample-and-match (drafters/eagle.py). Both are exact; greedy decoding ignores it. None: the method's
    own, DRAFT_SAMPLING_OF (q for eagle and staged; match for auto, whose sampled answer for a seed is then the
    target's own draws whatever it proposes).
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
                                        "the target's sample matches. Both exact. Default: q for eagle and staged, "
                                        "match for auto", choices=DRAFT_SAMPLING)
    draft_vocab: str = option("head", "draft-vocab", "'head' drafts over the head's own draft vocabulary; 'full' over "
                              "the target's whole vocabulary (heads that score through the target's lm_head): each "
                              "draft row costs more, and wide trees accept more", choices=DRAFT_VOCAB)


@dataclass(frozen=True)
class LookupOptions:
    """max_ngram..min_ngram: context suffixes matched, longest first; num_tokens: chain length to start with."""

    max_ngram: int = 5
    min_ngram: int = 1
    num_tokens: int = 10
    adaptive: bool = True


@dataclass(frozen=True)
class DraftModelOptions:
    """model: a smaller LM sharing the target's tokenizer (any spec `load_target` takes), or `draft_target`
    already loaded. num_tokens: chain length to start with (adaptive: grows and shrinks with acceptance)."""

    model: str | None = option(None, "draft-model", "the smaller model (same tokenizer as the target), given like "
                               "--target", metavar="SPEC")
    draft_target: Any = None
    num_tokens: int = 4
    adaptive: bool = True


@dataclass(frozen=True)
class LayerSkipOptions:
    """exit_layer: the target's first N decoder layers draft (None: half of them)."""

    exit_layer: int | None = option(None, "exit-layer", "draft with the target's first N decoder layers (None: half "
                                    "of them)", type=int, metavar="N")
    num_tokens: int = 4
    adaptive: bool = True


@dataclass(frozen=True)
class MedusaOptions:
    """heads: a folder written by `save_medusa`, "random" (untrained: exact but slow), or loaded MedusaHeads.
    choices: the tree as rank paths, JSON text or a .json file (None: drafters.medusa.DEFAULT_CHOICES)."""

    heads: Any = option(None, "medusa", "heads saved by `python -m trainers.train experiment=medusa`, or 'random'",
                        metavar="PATH")
    choices: Any = option(None, "medusa-choices", "the tree as rank paths, e.g. '[[0],[1],[0,0]]', or a .json file "
                          "(None: a 12-node tree)", metavar="JSON")


@dataclass(frozen=True)
class LookaheadOptions:
    """window (W): Jacobi streams; ngram (N): n-gram length (the window has N - 1 levels); candidates (G): pool
    n-grams verified per step. A step verifies at most 1 + (W + G) * (N - 1) nodes (drafters/lookahead.py). The
    defaults suit a CPU, where each verified row costs a good fraction of a one-token forward: wider windows find
    more n-grams but pay only where extra rows are nearly free (a GPU)."""

    window: int = option(1, "lookahead-window", "Jacobi window width, W verify rows per level; 0: no window",
                         type=int, metavar="W")
    ngram: int = option(3, "lookahead-ngram", "n-gram length, >= 2 (the window has N - 1 levels)", type=int,
                        metavar="N")
    candidates: int = option(2, "lookahead-candidates", "pool n-grams verified per step", type=int, metavar="G")


@dataclass(frozen=True)
class VanillaOptions:
    """Plain decoding: nothing to set."""


def eagle_drafter(target, head, **options) -> Drafter:
    """The drafter of an EAGLE head (drafters/eagle.py's options); a parallel head's is eagle_lite_wing's, which
    only such a head brings in (unproven: eagle_lite_wing/parallel.py)."""
    if head.parallel:
        from eagle_lite_wing.parallel import ParallelDrafter

        return ParallelDrafter(target, head, **options)
    from .eagle import EagleDrafter

    return EagleDrafter(target, head, **options)


def _eagle(target, o: EagleOptions, staged: bool = False) -> Drafter:
    from .lookup_graft import LookupGraft

    drafter = eagle_drafter(target, eagle_head(target, o), round_head=o.round_head,
                            draft_sampling=o.draft_sampling or DRAFT_SAMPLING_OF["eagle"])
    return LookupGraft(drafter, copy_mode=o.copy_mode, staged=staged)


def _auto(target, o: EagleOptions) -> Drafter:
    """Method auto's drafter, eagle_lite_wing's (unproven: eagle_lite_wing/auto.py)."""
    from eagle_lite_wing.auto import build

    return build(target, o)


def _lookup(target, o: LookupOptions) -> Drafter:
    from .prompt_lookup import PromptLookupDrafter

    return PromptLookupDrafter(o.max_ngram, o.min_ngram, o.num_tokens, o.adaptive)


def _lookahead(target, o: LookaheadOptions) -> Drafter:
    from .lookahead import LookaheadDrafter

    return LookaheadDrafter(o.window, o.ngram, o.candidates)


def _check_lookahead(o: LookaheadOptions) -> None:
    from .lookahead import check_sizes

    check_sizes(o.window, o.ngram, o.candidates)


def _draft_model(target, o: DraftModelOptions) -> Drafter:
    from .draft_model import DraftModelDrafter

    draft = o.draft_target
    if draft is None:
        from ..targets.loading import load_target

        draft = load_target(o.model, dtype=target.dtype, device=str(target.device))
    return DraftModelDrafter(target, draft, o.num_tokens, o.adaptive)


def _layer_skip(target, o: LayerSkipOptions) -> Drafter:
    from .layer_skip import LayerSkipDrafter

    return LayerSkipDrafter(target, o.exit_layer, o.num_tokens, o.adaptive)


def _medusa(target, o: MedusaOptions) -> Drafter:
    from ..formats import load_medusa
    from ..heads.medusa import MedusaHeads
    from .medusa import MedusaDrafter

    heads = o.heads
    if isinstance(heads, (str, Path)):
        heads = MedusaHeads.for_target(target) if heads == "random" else load_medusa(heads, target)
    return MedusaDrafter(target, heads, o.choices)


def _check_folder(path: str | Path, method: str) -> None:
    """Refuse a head folder that is missing or of another kind (eagle_lite's own, or a published layout)."""
    from ..formats import KINDS, detect, is_eagle_lite
    from ..heads.checkpoint import MEDUSA_FORMAT, read_config, read_head_config

    if is_eagle_lite(Path(path)):
        read_head_config(path) if method == "eagle" else read_config(path, MEDUSA_FORMAT, "Medusa heads")
        return
    kind = detect(path).kind
    if (kind == "medusa") != (method == "medusa"):
        raise ValueError(f"{path} holds {KINDS[kind]}, which method '{method}' cannot use")


def _check_eagle(o: EagleOptions) -> None:
    if o.draft_sampling is not None and o.draft_sampling not in DRAFT_SAMPLING:
        raise ValueError(f"draft_sampling must be one of {', '.join(DRAFT_SAMPLING)}, got {o.draft_sampling!r}")
    if o.draft_vocab not in DRAFT_VOCAB:
        raise ValueError(f"draft_vocab must be one of {', '.join(DRAFT_VOCAB)}, got {o.draft_vocab!r}")
    if o.head is None and o.draft not in (None, AUTO, "random"):
        _check_folder(o.draft, "eagle")


def _check_draft_model(o: DraftModelOptions) -> None:
    if o.model is None and o.draft_target is None:
        raise ValueError("method 'draft_model' needs --draft-model SPEC: a smaller model with the target's tokenizer")
    if o.draft_target is None:
        from ..targets.loading import target_source

        target_source(o.model, "draft model")        # a spec naming no file, folder or hub id


def _check_medusa(o: MedusaOptions) -> None:
    if o.heads is None:
        raise ValueError("method 'medusa' needs --medusa PATH (heads trained with `python -m trainers.train "
                         "experiment=medusa`) or --medusa random (untrained: exact but slow)")
    if isinstance(o.heads, (str, Path)) and o.heads != "random":
        _check_folder(o.heads, "medusa")
    if isinstance(o.choices, str):
        from .medusa import parse_choices

        parse_choices(o.choices)


@dataclass(frozen=True)
class Axis:
    """One axis of a method's tuning grid: eval.tune's flag `--{flag}` lists its values (default `values`, each
    >= `least`; `kind` float: probabilities), each set as `field` of the method's options (a "tree" sweep: of its
    TreeConfig) and shown as `{label}={value}` in the table."""

    flag: str
    field: str
    values: tuple
    help: str
    label: str
    least: int = 1
    kind: type = int


@dataclass(frozen=True)
class Tuning:
    """How `python -m eval.tune` sweeps a method (eval/tuning.py builds the candidates of each `sweep`): "chain", a
    fixed num_tokens K per value (adaptive off) and then the method's adaptive default; "grid", every combination of
    the axes' option fields; "tree", the draft trees of an EAGLE head (TreeConfig fields; the static step too);
    "sizes", Medusa trees of each size."""

    sweep: str
    axes: tuple[Axis, ...] = ()


CHAIN = Tuning("chain", (Axis("num-tokens", "num_tokens", (1, 2, 3, 4, 6, 8), "chain lengths K, each fixed (adaptive "
                              "off), and the method's adaptive default beside them", "K"),))
TREE = Tuning("tree", (
    Axis("depths", "depth", (3, 5), "tree depths", "d"),
    Axis("top-ks", "top_k", (4, 8), "tree top_k values", "k"),
    Axis("totals", "total_tokens", (12, 24, 48), "tree total_tokens values", "n"),
    Axis("lookups", "lookup", (), "prompt-lookup lengths to graft onto the tree, each tried beside 0 (off); --static "
         "ignores them (no graft in the static step)", "lookup"),
    Axis("min-probs", "min_prob", (), "TreeConfig.min_prob values (verify only nodes this likely under the draft), "
         "each tried beside 0 (off)", "min_prob", least=0, kind=float)))


@dataclass(frozen=True)
class Method:
    options: type
    build: Callable[[Any, Any], Drafter]
    summary: str
    check: Callable[[Any], None] = lambda options: None
    tune: Tuning | str = "no tuning grid in its registry entry"   # a str: why eval.tune does not tune it


METHODS: dict[str, Method] = {
    "default": Method(EagleOptions, lambda target, o: METHODS["eagle"].build(target, o),
                      "eagle where a draft head ships for the target (or --draft names one), else lookup: on held-out "
                      "questions the faster of the fixed methods, greedy and sampled (docs/benchmarks.md)",
                      _check_eagle, "it runs eagle or lookup: tune those"),
    "auto": Method(EagleOptions, _auto, "each step the fastest proposal by this machine's costs and the request's "
                   "acceptance so far: a plain step, prompt lookup, or the draft head's tree with lookup grafted on "
                   "(eagle_lite_wing/auto.py: unproven); lookup and plain steps where no head ships", _check_eagle,
                   "its controller chooses each step's proposal (eval.profile_step shows its choices); tune the head's "
                   "tree it grows from with --method eagle"),
    "eagle": Method(EagleOptions, _eagle, "an EAGLE draft head's dynamic tree (plus a prompt-lookup graft)",
                    _check_eagle, TREE),
    "staged": Method(EagleOptions, partial(_eagle, staged=True), "eagle whose head reads the prompt-lookup chain in "
                     "its own forward and grafts the part it agrees with plus its next token", _check_eagle,
                     "it drafts eagle's tree with the same head: tune that with --method eagle"),
    "lookup": Method(LookupOptions, _lookup, "prompt n-gram lookup (training-free)", tune=CHAIN),
    "lookahead": Method(LookaheadOptions, _lookahead, "lookahead decoding: Jacobi window + n-gram pool (training-free)",
                        _check_lookahead, Tuning("grid", (
                            Axis("lookahead-windows", "window", (1, 2, 4), "window widths W", "W", least=0),
                            Axis("lookahead-ngrams", "ngram", (2, 3), "n-gram lengths N (>= 2)", "N"),
                            Axis("lookahead-candidates", "candidates", (2,), "pool n-grams verified G", "G",
                                 least=0)))),
    "draft_model": Method(DraftModelOptions, _draft_model, "a smaller LM drafts a chain (--draft-model)",
                          _check_draft_model, CHAIN),
    "layer_skip": Method(LayerSkipOptions, _layer_skip,
                         "the target's first --exit-layer layers draft (no extra weights)", tune=CHAIN),
    "medusa": Method(MedusaOptions, _medusa, "Medusa heads' static tree (--medusa)", _check_medusa,
                     Tuning("sizes", (Axis("nodes", "choices", (4, 8, 12, 16, 24), "tree sizes (drafted nodes)",
                                           "nodes"),))),
    "vanilla": Method(VanillaOptions, lambda target, o: NoDrafter(), "one target forward per token",
                      tune="the baseline every candidate is timed against"),
}
NAMES = tuple(METHODS)
AUTO = "auto"   # the controller's choice each step (eagle_lite_wing/auto.py)
DEFAULT = "default"   # the CLI's, the Python API's and the server's method: eagle with a head, else lookup


HEAD_METHODS = ("default", "auto", "eagle", "staged")   # the methods of an EAGLE head, which take EagleOptions
# what a forced fixed-shape step (--static MODE) runs for each method it can run: one tree, eagle's, or plain steps
STATIC = {"default": "eagle", "auto": "eagle", "eagle": "eagle", "vanilla": "vanilla"}


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
    method = _method(name)
    method.check(options_for(name, options))


def resolve(name: str, target, options: Any = None) -> tuple[str, Any]:
    """(method, options) with the head "auto" runs loaded into its options (None where no head ships for `target`:
    auto then chooses between prompt lookup and plain steps); "default" resolved to eagle with its head, or to lookup
    where no head ships."""
    if name not in (AUTO, DEFAULT):
        return name, options_for(name, options)
    eagle = options if isinstance(options, EagleOptions) else EagleOptions()
    head = eagle.head if eagle.head is not None else load_eagle_head(target, eagle.draft)
    if name == DEFAULT:
        if head is None:
            log.warning("no draft head ships for target '%s': the default method is lookup (training-free); train a "
                        "head with `python -m trainers.train` and pass it with --draft", target.name)
            return "lookup", LookupOptions()
        return "eagle", replace(eagle, head=head)
    if head is None:
        log.warning("no draft head ships for target '%s': method auto drafts by prompt lookup (training-free); "
                    "train a head with `python -m trainers.train` and pass it with --draft", target.name)
    return AUTO, replace(eagle, head=head)


def build(name: str, target, options: Any = None) -> Drafter:
    """The drafter of method `name` for `target` ("auto" resolved by `resolve`)."""
    name, options = resolve(name, target, options)
    return METHODS[name].build(target, options)


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


def _method(name: str) -> Method:
    if name not in METHODS:
        raise ValueError(f"unknown method '{name}': choose one of {', '.join(NAMES)}")
    return METHODS[name]
