"""The data check between distill and features: are the target's own answers text worth learning?

A model prompted in a layout it was not trained for (a start token missing, the wrong template) answers with junk:
nothing at all, one token over and over, or a short phrase repeated from early on ("It is it it it ...",
"<h2><h2>..."). A head trained on such answers learns to predict repetition, and its acceptance then measures
nothing. A loop that starts in an answer's second half is kept: small models' greedy answers end so, and the head
meets those loops when it drafts. So every answered record is looked at before features are built: a degenerate
answer is counted and dropped, one is shown, and when they are more than `data.max_degenerate` of the answers the
run stops with one line saying what to try instead. Where distillation drew degenerate answers again
(trainers/resample.py, recorded in a record's "resampled"), the share that was degenerate at the first try is
reported beside the share left out, which is the one the limit applies to.
"""
from __future__ import annotations

import logging

log = logging.getLogger("trainers.train")

# Sources whose answers the target wrote (the others are ShareGPT's replies, random ids for tiny targets, or
# answers served to users, which are what they are)
CHECKED_SOURCES = ("sharegpt", "prompts")
MIN_LOOP_TOKENS = 16    # an answer shorter than this is never called a loop (a short reply may repeat a word)
NGRAM = 3               # a loop repeats its 3-grams: "1. Learn the basics.\n2. Learn the basics.\n3. ..." too
LOOP_SHARE = 0.5        # an answer whose first half's 3-grams repeat earlier ones at least this often is a loop


class DegenerateData(ValueError):
    """Too many degenerate answers: the run stops (one line, no traceback)."""


def degenerate(answer: list[int], eos: set[int] = frozenset()) -> str | None:
    """Why `answer` (a target-written span, its closing EOS allowed) is not text worth learning, or None."""
    ids = answer[:-1] if answer and answer[-1] in eos else answer
    if not ids or all(t in eos for t in ids):
        return "empty"
    if len(ids) >= 4 and len(set(ids)) == 1:
        return "one token repeated"
    if len(ids) < MIN_LOOP_TOKENS:
        return None
    # only the first half is read: a long greedy answer that starts as text and falls into a loop near its end is
    # what greedy decoding of that model does (the head meets it when drafting), while an answer that loops before
    # its second half is what a model prompted in a layout it was not trained for writes
    head = ids[:max(MIN_LOOP_TOKENS, len(ids) // 2)]
    seen, repeats = set(), 0
    for i in range(len(head) - NGRAM + 1):
        gram = tuple(head[i:i + NGRAM])
        repeats += gram in seen
        seen.add(gram)
    share = repeats / (len(head) - NGRAM + 1)
    if share >= LOOP_SHARE:
        return f"a repetition loop ({share:.0%} of its first half's {NGRAM}-grams repeat earlier ones)"
    return None


def record_reason(record: dict, eos: set[int]) -> str | None:
    """Why a record's answers are degenerate (the first span that is), or None."""
    ids = record["input_ids"]
    for start, end in record["spans"]:
        why = degenerate(ids[start:end], eos)
        if why:
            return why
    return None


def check_answers(records: list[dict], tokenizer, eos: set[int], max_share: float | None, where: str) -> list[dict]:
    """`records` without those whose answers are degenerate, after saying how many there were and showing one;
    DegenerateData (one line: why and what to try) when they are more than `max_share` of the records. None: no
    check."""
    if max_share is None or not records:
        return records
    reasons = [record_reason(r, eos) for r in records]
    bad = [(r, why) for r, why in zip(records, reasons) if why]
    share = len(bad) / len(records)
    first = first_try(records, reasons)
    if not bad:
        log.info("data check: %snone of the %d answers in %s is degenerate", first, len(records), where)
        return records
    record, why = bad[0]
    start, end = record["spans"][0]
    example = _shown(tokenizer, record["input_ids"][start:end])
    if share > max_share:
        raise DegenerateData(
            f"data check: {first}{len(bad)} of {len(records)} answers in {where} ({share:.0%}, over "
            f"data.max_degenerate={max_share:g}) are degenerate (e.g. {record['id']}: {why}: {example}): the target "
            f"is not prompted as it expects, or loops when greedy; try drawing them again (data.distill.resample."
            f"tries=4), sampled answers (data.distill.do_sample=true data.distill.temperature=0.8), its raw layout "
            f"(compare `python -m eagle_lite.generate --raw`), a chat template (a model folder with "
            f"chat_template.jinja as target=), or another prompt source (data.distill.source=prompts "
            f"data.distill.prompts=FILE); delete {where} before rerunning")
    log.warning("data check: %s%d of %d answers in %s (%.1f%%) are degenerate and left out (e.g. %s: %s: %s)",
                first, len(bad), len(records), where, 100 * share, record["id"], why, example)
    return [r for r, why in zip(records, reasons) if not why]


def first_try(records: list[dict], reasons: list[str | None]) -> str:
    """How many answers were degenerate at the first try and drawn again, as the start of the check's line ("" where
    none was drawn again)."""
    drawn = sum(1 for r in records if any(r.get("resampled", ())))
    if not drawn:
        return ""
    first = sum(1 for r, why in zip(records, reasons) if why or any(r.get("resampled", ())))
    return (f"{first} of {len(records)} answers ({100 * first / len(records):.1f}%) were degenerate at the first "
            f"try, {drawn} drawn again by sampling (data.distill.resample); now ")


def _shown(tokenizer, ids: list[int], limit: int = 80) -> str:
    """An answer as one short quoted line."""
    text = tokenizer.decode(ids, skip_special_tokens=False) if tokenizer is not None else " ".join(map(str, ids))
    text = " ".join(text.split())
    return repr(text[:limit] + ("..." if len(text) > limit else ""))
