"""The tuning runner every tree-searching entry point shares (`eval.tune`, `eval.ceiling`, `eval.profile_step`,
`eval.step_cost`): candidate settings of a drafting method, one builder per sweep its registry entry names
(`registry.Tuning`: chains, EAGLE trees, Medusa sizes, grids of option fields such as lookahead's),
decoded side by side through the runner of `eval.evaluation` (`tune`), the best one and how to select it, and the
parsers of the grid flags (`ints`, `counts`, `floats`; --trees is `options.tree_spec`).
"""
from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import logging
import shlex
from collections.abc import Callable
from dataclasses import dataclass, replace

from eagle_lite.config import OPTION, GenerationConfig, TreeConfig
from eagle_lite.drafters import registry
from eagle_lite.drafters.medusa import sized_choices
from eagle_lite.pipeline import engine_for
from eagle_lite.targets.model import Target

from . import report, runner
from .methods import Method, engine_method, static_method
from .tasks import Question

BASELINE = "vanilla"
log = logging.getLogger("eagle_lite")


@dataclass(frozen=True)
class Candidate:
    label: str                   # the method name the runner records, e.g. "eagle d=5 k=8 n=24"
    setting: dict                # what it sets, e.g. {"depth": 5, "top_k": 8, "total_tokens": 24}
    make: Callable[[], Method]   # builds its engine (each candidate has its own drafter and caches)


def with_tree(method: Method, tree: TreeConfig) -> Method:
    """The method run with its own tree, whatever tree the runner's GenerationConfig holds."""
    return lambda prompt, cfg: method(prompt, replace(cfg, tree=tree))


def chain_candidates(method: str, target: Target, num_tokens: list[int], base=None) -> list[Candidate]:
    """A fixed K per value (adaptive off), then the drafter's default: adaptive from its default K. base: the method's
    options the K values are set over (None: its defaults)."""
    base = registry.options_for(method, base)

    def drafter(k: int | None, adaptive: bool):
        kw = {"adaptive": adaptive} if k is None else {"num_tokens": k, "adaptive": adaptive}
        return registry.build(method, target, replace(base, **kw))

    out = [Candidate(f"{method} K={k}", {"num_tokens": k, "adaptive": False},
                     lambda k=k: engine_method(engine_for(target, drafter(k, False)))) for k in num_tokens]
    default_k = drafter(None, True).length.k
    out.append(Candidate(f"{method} K={default_k} adaptive", {"num_tokens": default_k, "adaptive": True},
                         lambda: engine_method(engine_for(target, drafter(None, True)))))
    return out


def tree_label(tree: TreeConfig, method: str = "eagle") -> str:
    """How eval tables name an eagle tree: 'eagle d=3 k=4 n=8 lookup=8 min_prob=0.1' (unset parts left out)."""
    return (f"{method} d={tree.depth} k={tree.top_k} n={tree.total_tokens}"
            + (f" lookup={tree.lookup}" if tree.lookup else "")
            + (f" min_prob={tree.min_prob:g}" if tree.min_prob else ""))


def eagle_candidates(target: Target, head, depths: list[int], top_ks: list[int], totals: list[int],
                     lookups: tuple[int, ...] = (0,), min_probs: tuple[float, ...] = (0.0,),
                     trees: list[TreeConfig] | None = None, static: str | None = None,
                     static_max_len: int | None = None, options=None) -> list[Candidate]:
    """Every valid (depth, top_k, total_tokens) of the grid x each lookup length x each min_prob, or the
    given `trees` instead of the grid; each with its own EagleDrafter (of `head` and the rest of `options`, eagle's:
    its draft sampling and vocabulary), or, with a static step mode `static`,
    its own static step (`static_method`: that mode, `static_max_len` cache slots; no lookup graft, so the trees'
    lookup lengths are dropped and the trees they then repeat run once)."""
    grid = trees or tree_grid(depths, top_ks, totals, lookups, min_probs)
    if static is None:
        options = replace(options or registry.EagleOptions(), head=head)
        make_method = lambda: engine_method(engine_for(target, "eagle", options))
    else:
        grid = list(dict.fromkeys(replace(tree, lookup=0) for tree in grid))
        make_method = lambda: static_method(target, head, static, static_max_len)
    return [Candidate(tree_label(tree), dataclasses.asdict(tree),
                      lambda tree=tree: with_tree(make_method(), tree)) for tree in grid]


def tree_grid(depths: list[int], top_ks: list[int], totals: list[int], lookups: tuple[int, ...] = (0,),
              min_probs: tuple[float, ...] = (0.0,)) -> list[TreeConfig]:
    """Every valid tree of the grid (combinations TreeConfig rejects are skipped); ValueError if none is."""
    trees = []
    for depth, top_k, total, lookup, min_prob in itertools.product(depths, top_ks, totals, lookups, min_probs):
        try:
            trees.append(TreeConfig(depth=depth, top_k=top_k, total_tokens=total, lookup=lookup, min_prob=min_prob))
        except ValueError:
            continue  # more nodes than depth x top_k can draft
    if not trees:
        raise ValueError(f"no valid tree in depths {depths} x top_ks {top_ks} x totals {totals}: total_tokens "
                         f"must be <= top_k + (depth - 1) * top_k**2")
    return trees


def medusa_candidates(target: Target, heads, sizes: list[int]) -> list[Candidate]:
    """A tree of each size (drafted nodes), the likeliest paths the heads can reach (`sized_choices`)."""
    out, seen = [], set()
    for n in sizes:
        choices = sized_choices(n, heads.num_heads)  # fewer than n when shallow heads cannot hold n nodes
        if len(choices) in seen:
            continue
        seen.add(len(choices))
        out.append(Candidate(f"medusa nodes={len(choices)}", {"nodes": len(choices), "choices": choices},
                             lambda c=choices: engine_method(
                                 engine_for(target, "medusa", registry.MedusaOptions(heads, c)))))
    return out


def grid_candidates(method: str, target: Target, values: dict[str, list], base=None) -> list[Candidate]:
    """Every combination of `values` (an options field of `method` -> its values; a "grid" sweep), each with its own
    drafter over `base` (the method's other options; None: its defaults), named by the axes' labels ('lookahead W=2
    N=3 G=2'). A combination the registry's check refuses is a ValueError."""
    labels = {axis.field: axis.label for axis in registry.METHODS[method].tune.axes}
    base = registry.options_for(method, base)
    out = []
    for combo in itertools.product(*values.values()):
        setting = dict(zip(values, combo))
        options = replace(base, **setting)
        registry.check(method, options)
        out.append(Candidate(f"{method} " + " ".join(f"{labels[k]}={v}" for k, v in setting.items()), setting,
                             lambda o=options: engine_method(engine_for(target, method, o))))
    return out


def tune(target: Target, questions: list[Question], candidates: list[Candidate], max_new_tokens: int = 64,
         warmup: bool = True, baseline: str = BASELINE,
         make_baseline: Callable[[], Method] | None = None,
         on_record: Callable[[runner.Record], None] | None = None) -> list[dict]:
    """Run the baseline (vanilla decoding, or what `make_baseline` builds, named `baseline`) and every candidate on
    `questions`; one 'overall' summary row per method, the candidate's `setting` added (None for the baseline).
    on_record: called with each turn's record of each method as it is made (runner.run's)."""
    if not questions:
        raise ValueError("no questions to tune on: check --task / --questions and --limit")
    labels = [c.label for c in candidates]
    if baseline in labels or len(set(labels)) != len(labels):
        raise ValueError(f"candidate labels must be unique and not '{baseline}', got {labels}")
    methods = {baseline: make_baseline() if make_baseline is not None
               else engine_method(engine_for(target, baseline))}
    methods.update({c.label: c.make() for c in candidates})
    records = runner.run(target, questions, methods, GenerationConfig(max_new_tokens=max_new_tokens),
                         baseline=baseline, warmup=warmup, on_record=on_record)
    settings = {c.label: c.setting for c in candidates}
    rows = [row for row in report.summarize(records, baseline) if row["category"] == "overall"]
    return [{**row, "setting": settings.get(row["method"])} for row in rows]


def best(rows: list[dict], baseline: str = BASELINE) -> dict | None:
    """The fastest candidate whose outputs all equal the baseline's (None if there is none)."""
    exact = [r for r in rows if r["method"] != baseline and r["identical"] == 1.0]
    return max(exact, key=lambda r: r["tokens_per_s"]) if exact else None


def how_to_select(method: str, setting: dict, static: str | None = None) -> str:
    """The flags that pick `setting` (eagle's tree flags, with static: that static step mode; else the flags its
    options declare), or, where no flag sets it (a chain's K), the options the Python API takes."""
    if registry.METHODS[method].tune == registry.TREE:   # the --tree-* flags set it
        lookup = f" --static {static}" if static else f" --tree-lookup {setting.get('lookup', 0)}"
        return (f"--tree-depth {setting['depth']} --tree-top-k {setting['top_k']} "
                f"--tree-total-tokens {setting['total_tokens']}"
                f" --tree-min-prob {setting.get('min_prob', 0.0):g}{lookup}")
    options = registry.METHODS[method].options
    flags = {f.name: f.metadata[OPTION].name for f in dataclasses.fields(options) if OPTION in f.metadata}
    if flags.keys() & setting.keys():
        return " ".join(f"--{flags[k]} {shlex.quote(json.dumps(v, separators=(',', ':')))}"
                        for k, v in setting.items() if k in flags)
    fields = ", ".join(f"{k}={v}" for k, v in setting.items())
    return f"load(..., method={method!r}, options={options.__name__}({fields}))"


def markdown(rows: list[dict], baseline: str = BASELINE) -> str:
    lines = [f"| setting | tokens/s | speedup vs {baseline} | mean accepted length | identical output |",
             "|---|---:|---:|---:|---:|"]
    for r in sorted(rows, key=lambda r: -r["tokens_per_s"]):
        accept = "—" if r["accept_length_mean"] is None else f"{r['accept_length_mean']:.2f}"
        speed = "—" if r["speedup"] is None else f"{r['speedup']:.2f}x"
        lines.append(f"| {r['method']} | {r['tokens_per_s']:.1f} | {speed} | {accept} | {100 * r['identical']:.0f}% |")
    return "\n".join(lines)


def whole_numbers(text: str, least: int, example: str) -> list[int]:
    """Comma-separated integers >= `least` (a flag's value: ArgumentTypeError otherwise)."""
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers like {example}, got {text!r}") from None
    if not values or min(values) < least:
        raise argparse.ArgumentTypeError(f"expected integers >= {least}, got {text!r}")
    return values


def ints(text: str) -> list[int]:
    """Comma-separated integers >= 1, e.g. 2,4,8."""
    return whole_numbers(text, 1, "2,4,8")


def counts(text: str) -> list[int]:
    """Comma-separated integers >= 0, e.g. 0,2,4."""
    return whole_numbers(text, 0, "0,2,4")


def floats(text: str, one: bool = False) -> list[float]:
    """Probabilities in [0, 1) (one: [0, 1]), comma-separated, e.g. 0.02,0.05,0.1."""
    try:
        values = [float(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers like 0.02,0.05, got {text!r}") from None
    if not values or not all(0.0 <= v < 1.0 or (one and v == 1.0) for v in values):
        raise argparse.ArgumentTypeError(f"expected probabilities in [0, {'1]' if one else '1)'}, got {text!r}")
    return values


def skip_per_category(questions: list[Question], skip: int) -> list[Question]:
    """Drop the first `skip` questions of each category (input order kept)."""
    seen: dict[str, int] = {}
    kept = []
    for q in questions:
        seen[q.category] = seen.get(q.category, 0) + 1
        if seen[q.category] > skip:
            kept.append(q)
    return kept


def check_counts(args: argparse.Namespace) -> None:
    """--limit and --max-new-tokens >= 1, --skip >= 0: ValueError naming the flag."""
    for flag, value, least in (("--limit", args.limit, 1), ("--skip", args.skip, 0),
                               ("--max-new-tokens", args.max_new_tokens, 1)):
        if value < least:
            raise ValueError(f"{flag} must be >= {least}, got {value}")


