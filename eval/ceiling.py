"""`python -m eval.ceiling`: how accurate a draft head must be for a tree to pay on this machine.

    python -m eval.ceiling --questions eval/questions/heldout12.jsonl --limit 2 --max-new-tokens 128 --threads 2
    python -m eval.ceiling --rates 0.7,0.8,0.9,1 --trees 1,1,1,4 2,1,2,4 3,1,3,4 --draft HEAD_DIR

Every tree is a chain here (top_k 1), with a prompt-lookup graft where the tree asks for one, run three ways on
the same prompts (interleaved per question, each output checked against vanilla decoding):
- `eagle`: the head's own proposals;
- `oracle@P`: the same head forwards, at the same cost, but each chain token is then replaced by the target's own
  next token with probability P (else by a token it is not), so the head's accuracy is P at every depth; the
  lookup graft, the verify forward and acceptance run as they do for eagle;
- `lookup`: prompt lookup alone (its default adaptive chain), the drafter a head has to beat.

The table gives tokens/s, the speedup over vanilla and over lookup, and the mean accepted length of each: the
head's accuracy (per token, at every depth) that reaches a given speedup over lookup with these costs, and where
the real head sits on that curve. For each oracle row it also counts how often the head's own depth-1 token, before
the oracle replaced it, was the target's next token, overall and (a second table) by kind of question: at rate 0
on a tree without a lookup graft every step emits one token, so the head is asked at every position of the
target's output, which is its top-1 along that output as training's validation measures it (teacher-forced), here
through the decoding path. The oracle knows the answer from the vanilla run of the same turn, so it measures only
what the step costs and returns: no head can run faster at a given accuracy with the same tree.
"""
from __future__ import annotations

import argparse
import logging
import sys

import torch

from eagle_lite.cli import arguments, entry_point
from eagle_lite.config import GenerationConfig, TreeConfig
from eagle_lite.decoding.drafter import DraftInput, Proposal, propose_together
from eagle_lite.drafters import registry
from eagle_lite.options import add_device_flags, add_flag
from eagle_lite.pipeline import engine_for
from eagle_lite.targets.model import Target
from eagle_lite.threads import check_threads, set_threads
from eagle_lite.tree import DraftTree

from .methods import Method, Run, engine_method
from .runner import Record
from .tuning import Candidate, check_counts, floats, skip_per_category, tree_label, tune, with_tree

BASELINE = "vanilla"
TASKS = ("sharegpt", "humaneval")   # built-in prompt sets --questions may name


class Reference:
    """The whole token sequence (prompt and answer) of the latest vanilla run: what the oracle proposes from.
    warmups: the first runs, which the oracles' counts leave out (the runner's warm-up generation)."""

    def __init__(self, warmups: int = 0) -> None:
        self.ids: list[int] = []
        self.runs, self.warmups = 0, warmups

    @property
    def counting(self) -> bool:
        return self.runs > self.warmups

    def recording(self, method: Method) -> Method:
        """`method` (vanilla decoding) that also records each run's prompt and answer here."""
        def run(prompt: list[int], cfg: GenerationConfig) -> Run:
            result = method(prompt, cfg)
            self.ids = list(prompt) + list(result.token_ids)
            self.runs += 1
            return result
        return run


class OracleDraft:
    """A chain drafter's proposals with each token replaced by the target's own next one (`reference`) with
    probability `rate`, else by a token that is not it. The inner drafter runs first, so each step costs what its
    own proposal costs. Every other attribute is the inner drafter's (so it composes with LookupGraft)."""

    def __init__(self, inner, reference: Reference, rate: float, seed: int = 0) -> None:
        if not 0.0 <= rate <= 1.0:
            raise ValueError(f"the oracle's rate must be in [0, 1], got {rate}")
        self.inner, self.reference, self.rate = inner, reference, rate
        self.generator = torch.Generator().manual_seed(seed)
        self.asked = self.head_right = 0   # depth-1 nodes proposed; those where the head had the target's token

    def __getattr__(self, name: str):
        inner = self.__dict__.get("inner")
        if inner is None:
            raise AttributeError(name)
        return getattr(inner, name)

    def propose(self, inp: DraftInput, tree: TreeConfig) -> DraftTree:
        return propose_together([self.proposal(inp, tree)])[0]

    def proposal(self, inp: DraftInput, tree: TreeConfig, **probe) -> Proposal:
        if tree.top_k != 1:
            raise ValueError(f"the oracle replaces a chain's tokens: its trees need top_k 1, got {tree.top_k}")
        drafted = yield from self.inner.proposal(inp, tree, **probe)
        return self.rewrite(drafted, len(inp.tokens))

    def rewrite(self, drafted: DraftTree, length: int) -> DraftTree:
        """`drafted` (a chain from the root at position length - 1) with the oracle's tokens."""
        tokens = drafted.tokens.clone()
        ref = self.reference.ids
        for node in range(1, len(tokens)):
            pos = length + int(drafted.depths[node]) - 1   # the position this node's token would take
            if pos >= len(ref):
                continue                                   # past the reference's end: the head's own token
            truth = ref[pos]
            if drafted.depths[node] == 1 and self.reference.counting:
                self.asked += 1
                self.head_right += int(tokens[node]) == truth
            right = bool(torch.rand((), generator=self.generator) < self.rate)
            if right:
                tokens[node] = truth
            elif int(tokens[node]) == truth:
                tokens[node] = (truth + 1) % self.inner.target.vocab_size
        return DraftTree(tokens, drafted.parents, drafted.q_draft, drafted.probes, drafted.likely)


class KindCounts:
    """Each oracle's depth-1 counts (`OracleDraft.asked`, `head_right`) split by the kind of question: `record` is
    the runner's hook, called after each turn of each method, which gives the counts added since that oracle's last
    turn to the turn's category."""

    def __init__(self, oracles: dict[str, OracleDraft]) -> None:
        self.oracles = oracles
        self.seen = {label: (0, 0) for label in oracles}
        self.by_kind: dict[str, dict[str, list[int]]] = {label: {} for label in oracles}   # kind -> [asked, right]

    def record(self, rec: Record) -> None:
        oracle = self.oracles.get(rec.method)
        if oracle is None:
            return
        asked, right = self.seen[rec.method]
        counts = self.by_kind[rec.method].setdefault(rec.category, [0, 0])
        counts[0] += oracle.asked - asked
        counts[1] += oracle.head_right - right
        self.seen[rec.method] = (oracle.asked, oracle.head_right)

    def markdown(self) -> str:
        """The head's own depth-1 accuracy by kind, one row per oracle that asked it anything ('' if none)."""
        rows = {label: kinds for label, kinds in self.by_kind.items() if any(a for a, _ in kinds.values())}
        if not rows:
            return ""
        kinds = sorted({kind for per in rows.values() for kind in per})
        lines = ["| head's own depth-1 token right | " + " | ".join(kinds) + " | overall |",
                 "|---|" + "---:|" * (len(kinds) + 1)]
        for label, per in rows.items():
            cells = [f"{per[k][1] / per[k][0]:.3f}" if per.get(k, [0])[0] else "—" for k in kinds]
            oracle = self.oracles[label]
            lines.append(f"| {label} | " + " | ".join(cells) + f" | {oracle.head_right / oracle.asked:.3f} |")
        return "\n".join(lines)


def eagle_drafter(target: Target, options: registry.EagleOptions, oracle: OracleDraft | None = None):
    """Method eagle's drafter (lookup graft included); with `oracle`, that oracle over its head, inside the graft."""
    drafter = registry.build("eagle", target, options)
    if oracle is None:
        return drafter
    if hasattr(drafter, "inner"):                   # LookupGraft(EagleDrafter)
        oracle.inner, drafter.inner = drafter.inner, oracle
        return drafter
    oracle.inner = drafter
    return oracle


def candidates(target: Target, options: registry.EagleOptions, trees: list[TreeConfig], rates: list[float],
               reference: Reference) -> tuple[list[Candidate], dict[str, OracleDraft]]:
    """lookup, then for each tree eagle and oracle@P for each rate; and each oracle by its label."""
    out = [Candidate("lookup", {}, lambda: _engine(target, registry.build("lookup", target)))]
    oracles: dict[str, OracleDraft] = {}
    for tree in trees:
        out.append(Candidate(tree_label(tree), {"tree": tree},
                             lambda t=tree: with_tree(_engine(target, eagle_drafter(target, options)), t)))
        for rate in rates:
            label = tree_label(tree, f"oracle@{rate:g}")
            oracles[label] = OracleDraft(None, reference, rate)
            out.append(Candidate(label, {"tree": tree, "rate": rate}, lambda t=tree, o=oracles[label]: with_tree(
                _engine(target, eagle_drafter(target, options, o)), t)))
    return out, oracles


def _engine(target: Target, drafter) -> Method:
    return engine_method(engine_for(target, drafter))


def markdown(rows: list[dict], oracles: dict[str, OracleDraft]) -> str:
    lookup = next((r["tokens_per_s"] for r in rows if r["method"] == "lookup"), None)
    lines = [f"| method | tokens/s | speedup vs {BASELINE} | vs lookup | mean accepted length | identical output "
             f"| head's own depth-1 token right |", "|---|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        accept = "—" if r["accept_length_mean"] is None else f"{r['accept_length_mean']:.2f}"
        speed = "—" if r["speedup"] is None else f"{r['speedup']:.2f}x"
        vs = "—" if not lookup else f"{r['tokens_per_s'] / lookup:.2f}x"
        o = oracles.get(r["method"])
        right = f"{o.head_right / o.asked:.3f} of {o.asked}" if o is not None and o.asked else "—"
        lines.append(f"| {r['method']} | {r['tokens_per_s']:.1f} | {speed} | {vs} | {accept} | "
                     f"{100 * r['identical']:.0f}% | {right} |")
    return "\n".join(lines)


def rates(text: str) -> list[float]:
    """The oracle's accuracies in [0, 1], comma-separated: 0.7,0.8,1."""
    return floats(text, one=True)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m eval.ceiling", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_flag(p, "questions", default="eval/questions/heldout12.jsonl", note="or a built-in task: sharegpt, humaneval")
    add_flag(p, "limit", default=2)
    add_flag(p, "skip")
    add_flag(p, "max-new-tokens", default=128)
    add_flag(p, "target")
    add_flag(p, "draft")
    add_flag(p, "trees", default=[TreeConfig(1, 1, 1, lookup=4)],
             note="here chains, each depth,1,depth[,lookup] (default: 1,1,1,4)")
    p.add_argument("--rates", type=rates, default=[0.7, 0.8, 0.9, 1.0],
                   help="the oracle's accuracies per token, each in [0, 1]")
    add_device_flags(p, attention=False)
    return p.parse_args(argv)


def check_args(args: argparse.Namespace) -> None:
    with arguments():   # the flags alone: a bad one is exit status 2
        check_counts(args)
        bad = [tree_label(t) for t in args.trees if t.top_k != 1 or t.total_tokens != t.depth]
        if bad:
            raise ValueError(f"--trees must be chains (depth,1,depth[,lookup]), got {', '.join(bad)}")
        check_threads(args.threads)
    registry.check("eagle", registry.EagleOptions(draft=args.draft))


@entry_point
def main(argv=None) -> int:
    args = parse_args(argv)
    check_args(args)
    from eagle_lite.options import quiet_libraries, target_of
    from eagle_lite.targets.loading import load_target

    from .evaluation import load_questions

    quiet_libraries(False)
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    task = ({"name": args.questions} if args.questions in TASKS else {"name": "file", "path": args.questions})
    questions = skip_per_category(load_questions([{**task, "limit": args.skip + args.limit}]), args.skip)
    if not questions:
        raise ValueError(f"no questions in {args.questions} after the first {args.skip}: lower --skip")
    set_threads(args.threads)
    target = load_target(target_of(args.target, getattr(args, "draft", None)), dtype=getattr(torch, args.dtype),
                         device=args.device)
    options = registry.EagleOptions(head=registry.eagle_head(target, registry.EagleOptions(draft=args.draft)))
    reference = Reference(warmups=1)   # tune's warm-up generation runs first
    baseline = reference.recording(_engine(target, registry.build(BASELINE, target)))
    runs, oracles = candidates(target, options, args.trees, args.rates, reference)
    counts = KindCounts(oracles)
    rows = tune(target, questions, runs, args.max_new_tokens, baseline=BASELINE, make_baseline=lambda: baseline,
                on_record=counts.record)
    print(f"target {target.name} · {args.dtype} · {args.device} · {args.questions}: {len(questions)} questions, "
          f"{sum(len(q.turns) for q in questions)} turns · max_new_tokens {args.max_new_tokens} · "
          f"{torch.get_num_threads()} threads · head {args.draft}\n")
    print(markdown(rows, oracles))
    by_kind = counts.markdown()
    if by_kind:
        print(f"\n{by_kind}")
    return 0 if all(r["identical"] == 1.0 for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
