"""`python -m eagle_lite.generate`: chat with a model, or answer one prompt, with lossless speculative decoding.

  python -m eagle_lite.generate                         # interactive chat with the embedded SmolLM2 target
  python -m eagle_lite.generate --prompt "Hi" --json    # one answer, machine-readable
  python -m eagle_lite.generate --method vanilla ...    # the same output without speculation

The prompt, typed or piped text included, reaches the tokenizer as valid text: bytes that are not UTF-8 become
U+FFFD and NUL characters are dropped (chat_format.clean_text). Ctrl-C stops an answer: what was generated stays
on screen, followed by "[stopped]" and the stats (exit status 130 for a one-shot answer); in a chat the
conversation goes on, and an error inside one turn is reported in one line without ending the session.
This is the only module that prints. Its model, method and tree flags are eagle_lite/options.py's (shared with
`python -m eagle_lite.serve`); the error boundary every entry point runs under is eagle_lite/cli.py.
"""
from __future__ import annotations

import argparse
import json
import logging
import sys

from .cli import STOPPED, TERMINATED, Terminated, arguments, entry_point, one_line
from .config import GenerationConfig
from .options import add_flag, add_model_flags, add_static_flag, check_flags, load_from_flags, quiet_libraries

CHAT_HELP = ("commands: /reset (new conversation)  /stats (totals so far; with method auto, its choices; with --adapt, "
             "what the head learned)  /reset-head (with --adapt: back to the head it started from)  /quit (or "
             "Ctrl-D); Ctrl-C stops an answer")


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
    add_static_flag(p, off=True)
    p.add_argument("--raw", action="store_true", help="feed --prompt as plain text, without the chat template")
    p.add_argument("--json", action="store_true", help="print one JSON object (text, token ids, stats)")
    add_flag(p, "verbose")
    return p


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
        watched = getattr(lm, "statistics", None)   # the drafter's observer (method auto: its choices)
        print(json.dumps({"text": lm.decode(ids), "token_ids": ids, "method": lm.method,
                          "static": getattr(lm, "static", None), "target": lm.target.name, **stats.as_dict(),
                          **({"choices": watched.as_dict()} if watched is not None and watched.rows else {})}))
    else:
        print()
    if stats.stop_reason == "interrupted":
        print("[stopped]", file=sys.stderr)
    if not args.json:
        print(f"{stats_line(stats)} {lm.describe()}", file=sys.stderr)
    adapter = getattr(lm, "adapter", None)
    if adapter is not None and stats.stop_reason != "interrupted":   # the answer joins what the head learns from
        adapter.round()
    return status


def read_turn(adapter=None) -> str:
    """The next line the user types or pipes in. The `you>` prompt is shown only to a person at a terminal, on
    stderr where stdout is not the terminal (a piped transcript holds the answers alone). adapter (--adapt): while
    the user types, the head learns, one optimizer step at a time on this thread (torch's own), until a line
    arrives or the steps its answers bought are spent."""
    if sys.stdin.isatty():
        print("you> ", end="", file=sys.stdout if sys.stdout.isatty() else sys.stderr, flush=True)
    if adapter is not None:
        import select

        while adapter.has_work() and not select.select([sys.stdin], [], [], 0)[0]:
            if not adapter.round(steps=1)["steps"]:
                break
    line = sys.stdin.readline()
    if not line:
        raise EOFError
    return line.rstrip("\n")


def chat(lm, cfg: GenerationConfig) -> None:
    from .decoding.engine import GenerationStats
    from .kv_cache import ContextOverflowError

    print(f"eagle_lite chat · {lm.describe()}\n{CHAT_HELP}", file=sys.stderr)
    if hasattr(sys.stdin, "reconfigure"):  # bytes that are not UTF-8 reach clean_text instead of failing input()
        sys.stdin.reconfigure(errors="surrogateescape")
    messages: list[dict] = []
    totals = {"answers": 0, "tokens": 0, "seconds": 0.0, "forwards": 0}
    watched = getattr(lm, "statistics", None)   # method auto: its controller's choices over the session
    adapter = getattr(lm, "adapter", None)   # --adapt: the head learning from this chat
    while True:
        try:
            line = read_turn(adapter).strip()
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
            if watched is not None and watched.rows:
                print(watched.line(), file=sys.stderr)
            if adapter is not None:
                adapter.round(steps=0)   # the answers so far taken in (and judged, where enough came)
                print(adapter.stats_line(), file=sys.stderr)
            continue
        if line == "/reset-head" and adapter is not None:
            adapter.reset()
            print("(the head adaptation started from serves again)", file=sys.stderr)
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


def run(args: argparse.Namespace) -> int:
    """Load, then answer --prompt or chat; returns the exit status."""
    lm, cfg = load_from_flags(args)
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
