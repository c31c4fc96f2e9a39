"""`python -m eagle_lite.generate`: chat with a model, or answer one prompt, with lossless speculative decoding.

  python -m eagle_lite.generate                         # interactive chat with the embedded SmolLM2 target
  python -m eagle_lite.generate --prompt "Hi" --json    # one answer, machine-readable
  python -m eagle_lite.generate --method vanilla ...    # the same output without speculation

The prompt, typed or piped text included, reaches the tokenizer as valid text: bytes that are not UTF-8 become
U+FFFD and NUL characters are dropped (chat_format.clean_text). Ctrl-C stops an answer: what was generated stays
on screen, followed by "[stopped]" and the stats (exit status 130 for a one-shot answer); in a chat the
conversation goes on, and an error inside one turn is reported in one line without ending the session.
This is the only module that prints.
"""
from __future__ import annotations

import argparse
import json
import logging
import sys

from .cli import STOPPED, TERMINATED, Terminated, arguments, entry_point, one_line
from .config import GenerationConfig, SamplingConfig, TreeConfig, default_tree, resolve_tree
from .drafters.registry import (
    AUTO,
    DRAFT_SAMPLING,
    DRAFT_VOCAB,
    NAMES,
    EagleOptions,
    LookaheadOptions,
    options_from_flags,
)
from .threads import check_threads, set_threads

CHAT_HELP = "commands: /reset (new conversation)  /stats (totals so far)  /quit (or Ctrl-D); Ctrl-C stops an answer"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m eagle_lite.generate",
        description="Generate with lossless EAGLE speculative decoding: the output is exactly the target's own "
                    "(greedy: token for token; sampling: the same distribution). Without --prompt, starts a chat.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--prompt", help="answer this one prompt and exit (through the chat template, or a base "
                                    "model's plain layout, unless --raw); bytes that are not UTF-8 become U+FFFD "
                                    "and NUL characters are dropped, here and in a chat")
    add_model_flags(p)
    p.add_argument("--static", nargs="?", const="auto", default=None, metavar="MODE",
                   choices=["auto", "eager", "compile", "reduce-overhead", "cuda-graph"],
                   help="greedy decoding through the fixed-shape step (methods eagle, without the lookup graft, and "
                        "vanilla): MODE auto = CUDA graphs on CUDA, eager on a CPU; or eager, compile, "
                        "reduce-overhead, cuda-graph (docs/gpu.md)")
    p.add_argument("--raw", action="store_true", help="feed --prompt as plain text, without the chat template")
    p.add_argument("--json", action="store_true", help="print one JSON object (text, token ids, stats)")
    p.add_argument("--verbose", action="store_true", help="show loading logs and progress bars")
    return p


def add_model_flags(p: argparse.ArgumentParser) -> None:
    """The flags of the model, the method, the draft tree and sampling: the CLI's and the server's
    (`python -m eagle_lite.serve`) alike."""
    tree, sampling = TreeConfig(), SamplingConfig()
    p.add_argument("--target", default=None,
                   help="target model: 'smollm2' (embedded default), a .gguf file, a local folder or a hub id; any "
                        "transformers causal LM whose cached tree forward matches its own (checked at load)")
    p.add_argument("--draft", default="auto",
                   help="draft head: 'auto' (shipped for the target), 'random' (untrained, exact but slow), "
                        "or a folder")
    p.add_argument("--method", default="auto",
                   choices=[AUTO, *NAMES],
                   help="eagle: EAGLE draft head; staged: eagle whose head reads the prompt-lookup chain in its own "
                        "forward and proposes the part it agrees with; lookup: prompt n-gram lookup (training-free); "
                        "lookahead: lookahead decoding, a Jacobi window and an n-gram pool (training-free); "
                        "draft_model: a smaller LM drafts (needs --draft-model); layer_skip: the target's first "
                        "--exit-layer layers draft (no extra weights); "
                        "medusa: Medusa heads' static tree (needs --medusa); "
                        "vanilla: one target forward per token; "
                        "auto: eagle if a head exists, else lookup (training-free)")
    p.add_argument("--draft-sampling", default=None, choices=DRAFT_SAMPLING,
                   help="--method eagle/staged with --temperature > 0: 'q' draws the tree from the head's distribution "
                        "and accepts sibling by sibling by recursive rejection (EAGLE's sampling); 'match' drafts the "
                        "head's top-k and accepts the child the target's sample matches. Both exact (default: "
                        f"{EagleOptions().draft_sampling})")
    p.add_argument("--draft-vocab", default=None, choices=DRAFT_VOCAB,
                   help="--method eagle/staged: 'head' drafts over the head's own draft vocabulary; 'full' over the "
                        "target's whole vocabulary (heads that score through the target's lm_head): each draft row "
                        f"costs more, and wide trees accept more (default: {EagleOptions().draft_vocab})")
    p.add_argument("--draft-model", default=None, metavar="SPEC",
                   help="--method draft_model: the smaller model (same tokenizer as the target), given like --target")
    p.add_argument("--exit-layer", type=int, default=None, metavar="N",
                   help="--method layer_skip: draft with the target's first N decoder layers (None: half of them)")
    p.add_argument("--medusa", default=None, metavar="PATH",
                   help="--method medusa: heads saved by `python -m trainers.train experiment=medusa`, or 'random'")
    p.add_argument("--medusa-choices", default=None, metavar="JSON",
                   help="--method medusa: the tree as rank paths, e.g. '[[0],[1],[0,0]]', or a .json file "
                        "(default: a 12-node tree)")
    add_lookahead_flags(p)
    p.add_argument("--max-new-tokens", type=int, default=256, help="stop after this many new tokens")
    g = p.add_argument_group("sampling (temperature 0 = greedy)")
    g.add_argument("--temperature", type=float, default=sampling.temperature)
    g.add_argument("--top-p", type=float, default=sampling.top_p)
    g.add_argument("--top-k", type=int, default=sampling.top_k, help="0 = off")
    g.add_argument("--seed", type=int, default=None, help="seed for sampling (reproducible outputs)")
    cpu, gpu = default_tree("cpu"), default_tree("cuda")
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
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"], help="target weights dtype")
    p.add_argument("--device", default="cpu", help="torch device of the target (cpu, cuda, ...)")
    p.add_argument("--threads", type=int, default=None,
                   help="torch CPU threads, >= 1 (default: one per core). Use 1 when other jobs share the cores: "
                        "threads that wait for a busy core stall every step")
    p.add_argument("--attention", default="auto", choices=["auto", "sdpa", "gqa", "flex", "lse_merge", "flash"],
                   help="tree-verification attention backend (see docs/attention.md); auto picks the fastest here")


def add_lookahead_flags(p: argparse.ArgumentParser) -> None:
    """--lookahead-window, --lookahead-ngram, --lookahead-candidates (unset: LookaheadOptions' defaults)."""
    o = LookaheadOptions()
    p.add_argument("--lookahead-window", type=int, default=None, metavar="W",
                   help=f"--method lookahead: Jacobi window width, W verify rows per level; 0: no window "
                        f"(default {o.window})")
    p.add_argument("--lookahead-ngram", type=int, default=None, metavar="N",
                   help=f"--method lookahead: n-gram length, >= 2 (the window has N - 1 levels; default {o.ngram})")
    p.add_argument("--lookahead-candidates", type=int, default=None, metavar="G",
                   help=f"--method lookahead: pool n-grams verified per step (default {o.candidates})")


def lookahead_flags(args: argparse.Namespace) -> dict:
    """The --lookahead-* flags as `options_from_flags` keywords."""
    return {"lookahead_window": args.lookahead_window, "lookahead_ngram": args.lookahead_ngram,
            "lookahead_candidates": args.lookahead_candidates}


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


def check_flags(args: argparse.Namespace) -> None:
    """Refuse, before the (slow) model load, every flag that is wrong whatever the model: ValueError."""
    TreeConfig.check_overrides(tree_flags(args))
    GenerationConfig(max_new_tokens=args.max_new_tokens, seed=args.seed,
                     sampling=SamplingConfig(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k))
    check_threads(args.threads)
    if args.static is not None:
        if args.temperature > 0:
            raise ValueError("--static decodes greedily: drop --temperature (or --static)")
        from .pipeline import check_static

        check_static(args.method, args.static)


def stats_line(stats) -> str:
    return (f"[{stats.new_tokens} tokens in {stats.seconds:.2f} s: {stats.tokens_per_s:.1f} tokens/s, "
            f"mean accepted length {stats.accept_length_mean:.2f}, {stats.target_forwards} target forwards]")


def one_shot(lm, args, cfg: GenerationConfig) -> int:
    """Answer --prompt, streaming the text as it is accepted (all at once with --json); returns the exit status.

    Ctrl-C (or SIGTERM) keeps what was generated: the text so far, then "[stopped]" and the stats (with --json,
    the object with stop_reason "interrupted"), and STOPPED (TERMINATED)."""
    from .decoding.engine import GenerationStats

    stats, ids, status = GenerationStats(), [], 0
    try:
        for piece in lm.stream(args.prompt, cfg, chat_template=not args.raw, stats=stats, token_ids=ids):
            if not args.json:
                print(piece, end="", flush=True)
    except KeyboardInterrupt as err:
        stats.stop_reason = "interrupted"
        status = TERMINATED if isinstance(err, Terminated) else STOPPED
    if args.json:
        print(json.dumps({"text": lm.decode(ids), "token_ids": ids, "method": lm.method,
                          "target": lm.target.name, **stats.as_dict()}))
    else:
        print()
    if stats.stop_reason == "interrupted":
        print("[stopped]", file=sys.stderr)
    if not args.json:
        print(stats_line(stats), file=sys.stderr)
    return status


def read_turn() -> str:
    """The next line the user types or pipes in. The `you>` prompt is shown only to a person at a terminal, on
    stderr where stdout is not the terminal (a piped transcript holds the answers alone)."""
    if not sys.stdin.isatty():
        return input()
    if sys.stdout.isatty():
        return input("you> ")
    print("you> ", end="", file=sys.stderr, flush=True)
    return input()


def chat(lm, cfg: GenerationConfig) -> None:
    from .decoding.engine import GenerationStats
    from .kv_cache import ContextOverflowError

    print(f"eagle_lite chat · target {lm.target.name} · method {lm.method}\n{CHAT_HELP}", file=sys.stderr)
    if hasattr(sys.stdin, "reconfigure"):  # bytes that are not UTF-8 reach clean_text instead of failing input()
        sys.stdin.reconfigure(errors="surrogateescape")
    messages: list[dict] = []
    totals = {"answers": 0, "tokens": 0, "seconds": 0.0, "forwards": 0}
    while True:
        try:
            line = read_turn().strip()
        except EOFError:
            print(file=sys.stderr)
            return
        except Terminated:
            raise
        except KeyboardInterrupt:  # a second Ctrl-C meant for an answer must not end the conversation
            print("\n(/quit or Ctrl-D ends the chat)", file=sys.stderr)
            continue
        if not line:
            continue
        if line in ("/quit", "/exit"):
            return
        if line == "/reset":
            messages.clear()
            print("(new conversation)", file=sys.stderr)
            continue
        if line == "/stats":
            rate = totals["tokens"] / totals["seconds"] if totals["seconds"] else 0.0
            print(f"[{totals['answers']} answers, {totals['tokens']} tokens, {rate:.1f} tokens/s, "
                  f"{totals['forwards']} target forwards]", file=sys.stderr)
            continue
        if line.startswith("/"):
            print(f"unknown command {line}; {CHAT_HELP}", file=sys.stderr)
            continue
        messages.append({"role": "user", "content": line})
        stats, answer = GenerationStats(), []
        print("bot> ", end="", flush=True)
        try:
            for piece in lm.stream(messages, cfg, stats=stats):
                answer.append(piece)
                print(piece, end="", flush=True)
        except (Terminated, BrokenPipeError):   # the session itself ends (a kill, or the reader of stdout left)
            raise
        except KeyboardInterrupt:
            print(" [stopped]", end="")
        except ContextOverflowError as err:  # the conversation outgrew the window: keep the session
            print()
            print(f"error: {err}; /reset starts a new conversation", file=sys.stderr)
            messages.pop()
            continue
        except Exception as err:  # any error of one turn: it must not end the session and lose the conversation
            print()
            print(f"error: this turn failed ({type(err).__name__}: {one_line(err)}); the conversation goes on "
                  f"without it", file=sys.stderr)
            messages.pop()
            continue
        print()
        messages.append({"role": "assistant", "content": "".join(answer)})
        totals["answers"] += 1
        totals["tokens"] += stats.new_tokens
        totals["seconds"] += stats.seconds
        totals["forwards"] += stats.target_forwards
        print(stats_line(stats), file=sys.stderr)


def quiet_libraries(verbose: bool) -> None:
    """transformers' loading logs and progress bars only with --verbose."""
    if not verbose:
        import transformers

        transformers.logging.set_verbosity_error()
        transformers.logging.disable_progress_bar()


def run(args: argparse.Namespace) -> int:
    """Load, then answer --prompt or chat; returns the exit status."""
    from .pipeline import load

    set_threads(args.threads)
    options = options_from_flags(args.method, draft=args.draft, draft_model=args.draft_model,
                                 exit_layer=args.exit_layer, medusa=args.medusa, medusa_choices=args.medusa_choices,
                                 draft_sampling=args.draft_sampling, draft_vocab=args.draft_vocab,
                                 **lookahead_flags(args))
    lm = load(args.target, method=args.method, options=options, dtype=args.dtype, device=args.device,
              attention=args.attention, static=args.static)
    with arguments():   # a tree flag that does not fit the head's recommended tree
        cfg = generation_config(args, lm.tree)
    note_default_tree(lm, args, cfg)
    if args.prompt is not None:
        return one_shot(lm, args, cfg)
    chat(lm, cfg)
    return 0


# Ctrl-C in an answer is handled where it streams; one that reaches the boundary came while loading
@entry_point(stopped="[stopped while loading: nothing was generated]")
def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, format="%(message)s")
    with arguments():
        check_flags(args)
    quiet_libraries(args.verbose)
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
