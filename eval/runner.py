"""Run questions x methods, interleaved per question, and record one row per (question, method)."""
from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field

from eagle_lite.config import GenerationConfig
from eagle_lite.targets.model import Target
from eagle_lite.text.chat_format import chat_ids

from .methods import Method
from .tasks import Question


@dataclass
class Record:
    question_id: str
    category: str
    method: str
    new_tokens: int
    seconds: float
    tokens_per_s: float
    target_forwards: int | None
    accept_length_mean: float | None
    accept_lengths: list[int] = field(default_factory=list)
    draft_depths: list[int] = field(default_factory=list)   # each step's tree depth (empty: not a tree drafter)
    identical_to_baseline: bool | None = None
    first_mismatch: int | None = None   # first differing token position against the baseline

    def as_dict(self) -> dict:
        return asdict(self)


def first_difference(a: list[int], b: list[int]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def conversation_prompts(target: Target, question: Question, answers: list[list[int]]) -> list[int]:
    """Chat-template ids for the next turn (a base model: the plain layout): earlier turns with the baseline's
    own answers."""
    messages = []
    for turn, answer in zip(question.turns, answers):
        messages.append({"role": "user", "content": turn})
        messages.append({"role": "assistant", "content": target.tokenizer.decode(answer, skip_special_tokens=True)})
    messages.append({"role": "user", "content": question.turns[len(answers)]})
    return chat_ids(target.tokenizer, messages)


def run(target: Target, questions: Iterable[Question], methods: dict[str, Method], cfg: GenerationConfig,
        baseline: str, warmup: bool = True, on_record: Callable[[Record], None] | None = None,
        repeats: int = 1) -> list[Record]:
    """Every turn of every question through every method (interleaved, so machine drift hits all alike; the methods
after the baseline take turns going first, so none always runs right after the same one).

    Multi-turn questions run in one conversation; the baseline's answers form the history so every
    method sees the same prompt. The greedy output of each method is compared to the baseline's (a sampled
    one is not: two exact samplers draw different tokens; `identical_to_baseline` stays None).
    repeats: each turn runs through every method this many times in a row (the order rotating each time), and a
    record keeps the fastest time: other work on a shared host only slows a run down, so the least time is the closest
    to the method's own (a host whose speed drifts between repeats is not corrected for). Every repeat of a greedy
    turn must give the same tokens (else the record is not identical). A method's record is emitted after its last
    repeat, so a run stopped part way through a turn keeps the methods that finished it.
    """
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    if baseline not in methods:
        raise ValueError(f"baseline '{baseline}' is not among the methods {list(methods)}")
    order = [baseline] + [m for m in methods if m != baseline]
    if warmup:
        warm = GenerationConfig(max_new_tokens=8, sampling=cfg.sampling, tree=cfg.tree)
        ids = chat_ids(target.tokenizer, [{"role": "user", "content": "Hello!"}])
        for name in order:
            methods[name](ids, warm)
    records: list[Record] = []
    others, shift = order[1:], 0
    for q in questions:
        answers: list[list[int]] = []
        for turn in range(len(q.turns)):
            prompt = conversation_prompts(target, q, answers)
            ref, runs = None, {}
            for repeat in range(repeats):
                k = shift % max(1, len(others))
                shift += 1
                for name in [baseline] + others[k:] + others[:k]:
                    result = methods[name](prompt, cfg)
                    if ref is None:
                        ref = result.token_ids
                        answers.append(ref)
                    runs.setdefault(name, []).append(result)
                    if repeat == repeats - 1:   # the method's last repeat: its record is final
                        rec = record_of(q, turn, name, runs[name], ref, cfg.sampling.greedy)
                        records.append(rec)
                        if on_record is not None:
                            on_record(rec)
    return records


def record_of(q: Question, turn: int, name: str, results: list, ref: list[int], greedy: bool) -> Record:
    """One method's record of one turn from its repeats: the fastest run's figures; a greedy record is identical
    only if every repeat gave the baseline's tokens."""
    result = min(results, key=lambda r: r.seconds)
    diffs = (first_difference(r.token_ids, ref) for r in results) if greedy else ()
    diff = next((d for d in diffs if d is not None), None)
    n = len(result.token_ids)
    return Record(
        question_id=f"{q.question_id}#{turn}" if len(q.turns) > 1 else q.question_id,
        category=q.category, method=name, new_tokens=n, seconds=result.seconds,
        tokens_per_s=n / result.seconds if result.seconds > 0 else 0.0,
        target_forwards=result.target_forwards,
        accept_length_mean=(sum(result.accept_lengths) / len(result.accept_lengths)
                            if result.accept_lengths else None),
        accept_lengths=result.accept_lengths, draft_depths=list(result.draft_depths),
        identical_to_baseline=(diff is None) if greedy else None, first_mismatch=diff,
    )


def finished_turns(records: list[Record], methods: int) -> list[Record]:
    """The records of the turns every one of the `methods` finished (a run stopped part way through a turn leaves
    some methods without it: comparing them would compare different prompts)."""
    counts: dict[str, int] = {}
    for r in records:
        counts[r.question_id] = counts.get(r.question_id, 0) + 1
    return [r for r in records if counts[r.question_id] == methods]
