"""A flag more than one entry point takes is declared once (eagle_lite/config.py's SHARED, added by `add_flag`): every
entry point's parser, eval/ and trainers/ included, gets the same name, type and help from that one declaration."""
from __future__ import annotations

import argparse
import importlib
from pathlib import Path

import pytest

from eagle_lite.config import SHARED, add_flag

ROOT = Path(__file__).parents[1]
ENTRY_POINTS = ["eagle_lite.generate", "eagle_lite.serve.__main__", "eagle_lite.export", "eval.tune", "eval.adapt",
                "eval.adapt_curves", "eval.step_cost", "eval.gpu_day", "eval.serve_bench", "eval.profile_step",
                "eval.ceiling", "eval.head_cost", "eval.benchmark", "eval.kinds", "trainers.validate",
                "trainers.val_features", "trainers.sharegpt", "trainers.seed_prompts", "trainers.device_bundle",
                "trainers.curves"]
# a name a tool gives another meaning (its own declaration, not the shared flag's): (tool, flag)
OTHER_MEANING = {("eval.gpu_day", "--skip"), ("trainers.sharegpt", "--limit"), ("eagle_lite.export", "--dtype")}
# names each tool declares for its own thing: what it writes (--out, --json), what it answers (--prompt), ...
OWN = {"--out", "--json", "--prompt", "--all", "--carry", "--help"}


class Parsed(BaseException):
    """Raised in place of parsing: carries the parser the entry point built."""

    def __init__(self, parser):
        self.parser = parser


def parsers_of(tool: str, monkeypatch) -> list[argparse.ArgumentParser]:
    """The parser `tool`'s main builds, and its subcommands' (without running anything)."""
    def caught(self, *args, **kwargs):
        raise Parsed(self)

    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", caught)
    module = importlib.import_module(tool)
    entry = getattr(module, "build_parser", None)
    if entry is not None:
        parser = entry()
    else:
        with pytest.raises(Parsed) as got:
            (getattr(module, "parse_args", None) or module.main)([])
        parser = got.value.parser
    subs = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    return [parser, *(p for a in subs for p in a.choices.values())]


def declared_in(flag: str) -> list[str]:
    """The source files (outside tests and eval/peers) that declare `flag` literally."""
    return [str(p.relative_to(ROOT)) for p in ROOT.glob("*/**/*.py")
            if not {"peers", ".venv", "tests"} & set(p.parts) and f'add_argument("{flag}"' in p.read_text()]


def test_every_shared_flag_is_declared_in_one_place():
    assert declared_in("--target") == []   # flags.SHARED's alone, added by add_flag
    for name in [*SHARED, "method"]:
        assert len(declared_in(f"--{name}")) <= 1, name


def test_the_entry_points_take_each_shared_flag_from_its_one_declaration(monkeypatch):
    seen: dict[str, set[str]] = {}
    for tool in ENTRY_POINTS:
        for parser in parsers_of(tool, monkeypatch):
            for action in parser._actions:
                for flag in action.option_strings:
                    if not flag.startswith("--") or (tool, flag) in OTHER_MEANING:
                        continue
                    seen.setdefault(flag, set()).add(tool)
                    shared = SHARED.get(flag[2:])
                    if shared is not None:   # the shared help, then what the flag means in this tool
                        assert shared["help"] in action.help, (tool, flag, action.help)
    repeated = sorted(flag for flag, tools in seen.items() if len(tools) > 1 and flag not in OWN)
    assert {"--target", "--draft", "--threads", "--max-new-tokens", "--questions", "--trees"} <= set(repeated)
    for flag in repeated:   # declared once: in flags.SHARED, in options.py or on a method's options
        assert len(declared_in(flag)) <= 1, (flag, declared_in(flag), seen[flag])


def test_a_tool_sets_its_own_default_and_note_over_the_shared_help():
    p = argparse.ArgumentParser()
    add_flag(p, "max-new-tokens", default=64)
    add_flag(p, "questions", note="instead of --tasks")
    add_flag(p, "tasks", "--task", dest="task", default="humaneval")
    actions = {a.dest: a for a in p._actions}
    assert actions["max_new_tokens"].default == 64 and actions["max_new_tokens"].type is int
    assert actions["max_new_tokens"].help == SHARED["max-new-tokens"]["help"] + " (default: %(default)s)"
    assert actions["questions"].help == SHARED["questions"]["help"] + "; instead of --tasks"
    assert p.parse_args(["--task", "sharegpt"]).task == "sharegpt" == p.parse_args(["--tasks", "sharegpt"]).task
    with pytest.raises(SystemExit):
        p.parse_args(["--max-new-tokens", "many"])
