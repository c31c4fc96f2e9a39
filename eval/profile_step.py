"""`python -m eval.profile_step`: where the milliseconds of one decoding step go, per method and tree.

    python -m eval.profile_step --draft runs/train/smollm2/sharegpt/default/head --threads 1
    python -m eval.profile_step --draft random --trees 3,8,8 5,8,24
    python -m eval.profile_step --questions eval/questions/heldout12.jsonl --limit 1 --trees 1,1,1,4
    python -m eval.profile_step --device cuda --dtype bfloat16 --static cuda-graph   # adds the static step's rows
    python -m eval.profile_step --verify-rows 1,4,16,32            # what a verified row costs against a plain step

Per step: draft, verify (the target's forward over the tree), accept + cache commit, and their sum; plus tokens per
step and tokens/s, for vanilla decoding, prompt lookup (its default adaptive chain: the drafter a head has to beat)
and EAGLE at each tree (depth,top_k,total_tokens[,lookup[,min_prob]]), then method auto (the controller choosing
each step: eagle_lite_wing/controller.py). A second table gives each drafting method's conditional acceptance
at each draft position (what trees are tuned from); a third, auto's choices: the share of steps of each, their tokens,
and the step time (draft + verify + accept) the controller predicted against the time measured. One prompt
(`--prompt`), or the first turn of the first `--limit` questions of each category of a question file
(`--questions`), every method run on each prompt in turn and the steps of all prompts summed. With --static, the
same through the fixed-shape step (static/step.py), synchronised between draft and verify to time them (its
accept+commit runs inside the verify step's time).
"""
from __future__ import annotations

import argparse
import sys

import torch

from eagle_lite.cli import arguments, entry_point
from eagle_lite.config import GenerationConfig, SamplingConfig, TreeConfig
from eagle_lite.decoding.engine import Engine, depth_acceptance
from eagle_lite.drafters import registry
from eagle_lite.options import add_device_flags, add_flag, add_static_flag
from eagle_lite.pipeline import engine_for, static_engine_for
from eagle_lite.targets.loading import load_target
from eagle_lite.text.chat_format import chat_ids
from eagle_lite.threads import check_threads, set_threads

from .evaluation import head_for
from .tasks import load_question_file
from .tuning import tree_label

PROMPT = "Explain how a hash map works, with an example in Python."


def profile(runs: list[tuple[str, Engine, GenerationConfig]], prompts: list[list[int]]) -> dict[str, dict]:
    """runs: (name, engine, config); every one warms up, then each prompt is decoded by every run in turn (machine
    drift hits them alike). Per run: ms a step of draft, verify and accept + commit (all prompts' steps together),
    tokens a step, tokens/s and prefill ms a prompt; for method auto, "choices": per choice of its controller,
    [steps, tokens, predicted seconds, measured seconds] summed."""
    sums = {name: dict.fromkeys(("draft", "verify", "accept", "prefill", "seconds", "tokens", "steps"), 0.0)
            for name, _, _ in runs}
    steps_of = {name: ([], []) for name, _, _ in runs}   # (accept lengths, tree depths) of every step
    watched = {}   # method auto: the observer of its controller's choices (eagle_lite_wing/auto.py `Choices`)
    for name, engine, cfg in runs:
        engine.generate(prompts[0], GenerationConfig(max_new_tokens=8, tree=cfg.tree))   # warm-up
        made = engine.drafter.statistics() if engine.drafter is not None else None
        if made is not None:
            watched[name] = made
            engine.observers.append(made)
    for ids in prompts:
        for name, engine, cfg in runs:
            engine.reset()
            s, total = engine.generate(ids, cfg).stats, sums[name]
            for key, value in (("draft", s.draft_seconds), ("verify", s.verify_seconds), ("accept", s.accept_seconds),
                               ("prefill", s.prefill_seconds), ("seconds", s.seconds), ("tokens", s.new_tokens),
                               ("steps", len(s.accept_lengths))):
                total[key] += value
            steps_of[name][0].extend(s.accept_lengths)
            steps_of[name][1].extend(s.draft_depths)
    rows = {}
    for name, t in sums.items():
        steps = max(t["steps"], 1)
        rows[name] = {"draft": 1000 * t["draft"] / steps, "verify": 1000 * t["verify"] / steps,
                      "accept": 1000 * t["accept"] / steps, "tokens_per_step": (t["tokens"] - len(prompts)) / steps,
                      "tokens_per_s": t["tokens"] / t["seconds"] if t["seconds"] else 0.0,
                      "prefill": 1000 * t["prefill"] / len(prompts),
                      "choices": watched[name].snapshot() if name in watched else {},
                      "per_depth": depth_acceptance(*steps_of[name])}
    return rows


@entry_point
def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m eval.profile_step", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_flag(p, "target")
    add_flag(p, "draft")
    add_flag(p, "trees", nargs="*", default=[TreeConfig(3, 8, 8), TreeConfig(5, 8, 24)],
             note="default: 3,8,8 5,8,24")
    add_flag(p, "max-new-tokens", default=128)
    p.add_argument("--prompt", default=PROMPT, help="the one prompt profiled (unless --questions)")
    add_flag(p, "questions", note="profile the first turn of its questions instead of --prompt")
    add_flag(p, "limit", default=1, note="with --questions")
    add_flag(p, "temperature", note="draws with seed 0")
    add_device_flags(p, attention=False)
    add_static_flag(p, "also profile, beside the engine's rows,")
    p.add_argument("--verify-rows", type=row_counts, default=None,
                   help="instead: time the target's verify forward and lm_head over chains of these many rows after "
                        "the first prompt (e.g. 1,4,16,32): what a verified row costs against a plain step")
    return run(p.parse_args(argv))


def run(args: argparse.Namespace) -> int:
    """Check the flags, load, profile and print the table; returns the exit status."""
    from eagle_lite.options import quiet_libraries, target_of

    quiet_libraries(False)
    with arguments():
        for flag, value in (("--max-new-tokens", args.max_new_tokens), ("--limit", args.limit)):
            if value < 1:
                raise ValueError(f"{flag} must be >= 1, got {value}")
        SamplingConfig(temperature=args.temperature)   # a negative or non-finite temperature: one line
        check_threads(args.threads)
    registry.check("eagle", registry.EagleOptions(draft=args.draft))
    texts = [args.prompt]
    if args.questions is not None:
        texts = [q.turns[0] for q in load_question_file(args.questions, per_category_limit=args.limit)]
    set_threads(args.threads)
    target = load_target(target_of(args.target, getattr(args, "draft", None)), dtype=getattr(torch, args.dtype),
                         device=args.device)
    prompts = [chat_ids(target.tokenizer, [{"role": "user", "content": text}]) for text in texts]
    if args.verify_rows:
        print(row_costs(target, prompts[0], args.verify_rows))
        return 0
    head, note = head_for(target, args.draft)
    sampling = SamplingConfig(temperature=args.temperature)
    plain = GenerationConfig(args.max_new_tokens, sampling=sampling, seed=0)
    runs = [("vanilla", engine_for(target, "vanilla"), plain)]
    if args.static:
        runs.append(("vanilla (static)", static_engine_for(target, None, args.static, profile=True), plain))
    runs.append(("lookup", engine_for(target, "lookup"), plain))
    for tree in args.trees:
        cfg = GenerationConfig(args.max_new_tokens, tree=tree, sampling=sampling, seed=0)
        runs.append((tree_label(tree), engine_for(target, "eagle", registry.EagleOptions(head=head)), cfg))
        if args.static:
            runs.append((f"{tree_label(tree)} (static)", static_engine_for(target, head, args.static, profile=True),
                         cfg))
    auto = engine_for(target, "auto", registry.EagleOptions(head=head))
    runs.append(("auto", auto, GenerationConfig(args.max_new_tokens, tree=auto.drafter.recommended_tree,
                                                sampling=sampling, seed=0)))
    rows = profile(runs, prompts)
    where = f"{args.questions}: {len(prompts)} prompts" if args.questions else "one prompt"
    sampled = f" · temperature {args.temperature:g}" if args.temperature else ""
    print(f"target {target.name} · {torch.get_num_threads()} threads · {note} · {where}{sampled}\n")
    print("| method | draft ms/step | verify ms/step | accept+commit ms/step | step ms | tokens/step | tokens/s |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for name, r in rows.items():
        draft = "—" if name.startswith("vanilla") else f"{r['draft']:.1f}"
        step = r["draft"] + r["verify"] + r["accept"]
        print(f"| {name} | {draft} | {r['verify']:.1f} | {r['accept']:.2f} | {step:.1f} | {r['tokens_per_step']:.2f} | "
              f"{r['tokens_per_s']:.1f} |")
    print_depths(rows)
    print_choices(rows["auto"]["choices"])
    return 0


def row_counts(text: str) -> list[int]:
    """--verify-rows' value: comma-separated counts of rows >= 1 ('1,4,16,32')."""
    try:
        counts = [int(x) for x in text.split(",")]
    except ValueError:
        counts = []
    if not counts or min(counts) < 1:
        raise argparse.ArgumentTypeError(f"expected comma-separated counts of rows >= 1 (1,4,16,32), got {text!r}")
    return counts


def row_costs(target, prompt: list[int], sizes: list[int], reps: int = 30) -> str:
    """A markdown table: the target's verify forward (its decoder layers) and its lm_head over a chain of n rows after
    `prompt`, median ms of `reps` (the cache cut back to the prompt each time), and each extra row's cost against
    the one-row step's: what a verified row costs on this machine's vector unit."""
    import os
    import statistics
    import time

    if any(n < 1 for n in sizes):
        raise ValueError(f"--verify-rows must be counts >= 1, got {sizes}")
    cache = target.new_cache(len(prompt) + max(sizes))
    with torch.inference_mode():
        target.forward(torch.tensor(prompt), cache)
        cache.commit(len(prompt))
        gen = torch.Generator().manual_seed(0)
        timed = {}
        for n in sizes:
            ids = torch.randint(target.vocab_size, (n,), generator=gen)
            layers, head = [], []
            for _ in range(reps + 2):
                t0 = time.perf_counter()
                _, hidden = target.forward(ids, cache)
                t1 = time.perf_counter()
                target.logits(hidden)
                layers.append(t1 - t0)
                head.append(time.perf_counter() - t1)
                cache.truncate(len(prompt))
            timed[n] = (1e3 * statistics.median(layers[2:]), 1e3 * statistics.median(head[2:]))
    one = sum(timed[1]) if 1 in timed else None
    wide = os.environ.get("EAGLE_LITE_AVX512", "1") != "0"
    lines = [f"target {target.name} · {torch.get_num_threads()} threads · prefix {len(prompt)} tokens · "
             f"products {'16 lanes (AVX-512)' if wide else '8 lanes (AVX2)'} where the CPU has them · median of "
             f"{reps}", "",
             "| rows | layers ms | lm_head ms | verify ms | vs 1 row | each extra row ms |",
             "|---:|---:|---:|---:|---:|---:|"]
    for n, (layers, head) in timed.items():
        total = layers + head
        ratio = f"{total / one:.2f}x" if one else "—"
        extra = f"{(total - one) / (n - 1):.2f}" if one and n > 1 else "—"
        lines.append(f"| {n} | {layers:.2f} | {head:.2f} | {total:.2f} | {ratio} | {extra} |")
    return "\n".join(lines)


def print_depths(rows: dict[str, dict]) -> None:
    """Each drafting method's conditional acceptance at each draft position (`depth_acceptance`), with the share of
    its steps whose tree reached that depth: what a tree's depth and width are tuned from."""
    deepest = max((len(r["per_depth"]) for r in rows.values()), default=0)
    if not deepest:
        return
    print("\n| method | " + " | ".join(f"depth {k}" for k in range(1, deepest + 1)) + " |")
    print("|---|" + "---:|" * deepest)
    for name, r in rows.items():
        if not r["per_depth"]:
            continue
        cells = [f"{d['conditional']:.2f} ({d['drafted']})" for d in r["per_depth"]]
        print(f"| {name} | " + " | ".join(cells + [""] * (deepest - len(cells))) + " |")
    print("(conditional acceptance at each depth: the share of the steps that accepted depth k - 1 and drafted depth k "
          "that accepted depth k; in brackets the steps that drafted depth k)")


def print_choices(choices: dict[str, list[float]]) -> None:
    """Method auto's steps by the controller's choice: share, tokens a step, step ms (draft + verify + accept: the
    stats' step, without the loop's own time) and of it the draft's, as the controller predicted them and as
    measured, and the tokens/s of each."""
    steps = sum(row[0] for row in choices.values()) or 1
    print("\n| auto's choice | steps | tokens/step predicted | measured | ms/step predicted | measured | "
          "draft ms predicted | measured | tok/s predicted | measured |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for kind, (n, tokens, expected, predicted, measured, pdraft, mdraft) in sorted(choices.items()):
        print(f"| {kind} | {100 * n / steps:.0f}% | {expected / n:.2f} | {tokens / n:.2f} | "
              f"{1e3 * predicted / n:.2f} | {1e3 * measured / n:.2f} | {1e3 * pdraft / n:.2f} | "
              f"{1e3 * mdraft / n:.2f} | "
              f"{expected / predicted:.1f} | {tokens / measured:.1f} |")


if __name__ == "__main__":
    sys.exit(main())
