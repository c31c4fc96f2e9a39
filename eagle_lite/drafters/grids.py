"""How `python -m eval.tune` sweeps a method: its registry entry's `Tuning`, over `Axis`es of its options."""
from __future__ import annotations

from dataclasses import dataclass


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
LOOKAHEAD = Tuning("grid", (Axis("lookahead-windows", "window", (1, 2, 4), "window widths W", "W", least=0),
                            Axis("lookahead-ngrams", "ngram", (2, 3), "n-gram lengths N (>= 2)", "N"),
                            Axis("lookahead-candidates", "candidates", (2,), "pool n-grams verified G", "G", least=0)))
MEDUSA = Tuning("sizes", (Axis("nodes", "choices", (4, 8, 12, 16, 24), "tree sizes (drafted nodes)", "nodes"),))
