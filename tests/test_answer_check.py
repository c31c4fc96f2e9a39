"""The data check between distill and features: degenerate answers are counted, shown, dropped, or stop the run."""
from __future__ import annotations

import json
import logging
import random
from types import SimpleNamespace

import pytest
from omegaconf import OmegaConf

from trainers.answer_check import DegenerateData, check_answers, degenerate

EOS = 0


def prose(seed: int, n: int = 40) -> list[int]:
    """An answer without repetition loops: random ids over a large vocabulary, closed by EOS."""
    rng = random.Random(seed)
    return [rng.randrange(10, 5000) for _ in range(n)] + [EOS]


def loop(n: int = 60) -> list[int]:
    """'It is it it it ...': a short opening, then one short pattern to the end."""
    return [11, 12, 13] + [14, 15] * (n // 2)


def record(i: int, answer: list[int], prompt=(1, 2, 3)) -> dict:
    ids = list(prompt) + answer
    return {"id": f"q{i}", "input_ids": ids, "spans": [[len(prompt), len(ids)]]}


def test_each_kind_of_degenerate_answer_is_named_and_real_answers_pass():
    assert degenerate([EOS], {EOS}) == "empty"
    assert degenerate([], {EOS}) == "empty"
    assert degenerate([7] * 30, {EOS}) == "one token repeated"
    assert "repetition loop" in degenerate(loop(), {EOS})
    assert "repetition loop" in degenerate([5, 6, 7] * 20 + [EOS], {EOS})
    numbered = [t for k in range(1, 9) for t in (100 + k, 5, 6, 7, 8, 9, 10, 11)]  # "1. Learn the basics.\n2. ..."
    assert "repetition loop" in degenerate(numbered + [EOS], {EOS})
    assert degenerate(prose(0), {EOS}) is None
    assert degenerate([42, EOS], {EOS}) is None                      # "Yes." is a fine answer
    assert degenerate([42, 42, 43, EOS], {EOS}) is None               # a short reply may repeat a word
    # a few repeated tokens inside a real answer (a list's "- ", a table's dashes) are not a loop
    assert degenerate(prose(1, 30) + [9] * 6 + prose(2, 30), {EOS}) is None
    # text that falls into a loop in its second half is the target's own greedy habit, kept; in its first half, not
    assert degenerate(prose(3, 60)[:-1] + [14, 15] * 25 + [EOS], {EOS}) is None
    assert "repetition loop" in degenerate(prose(3, 20)[:-1] + [14, 15] * 40 + [EOS], {EOS})


def test_a_mostly_good_stream_keeps_the_good_answers_and_reports_the_share(caplog):
    records = [record(i, prose(i)) for i in range(18)] + [record(18, loop()), record(19, [EOS])]
    with caplog.at_level(logging.WARNING, logger="trainers.train"):
        kept = check_answers(records, None, {EOS}, 0.2, "runs/data/x/distill")
    assert [r["id"] for r in kept] == [f"q{i}" for i in range(18)]
    assert "2 of 20 answers" in caplog.text and "10.0%" in caplog.text and "q18" in caplog.text


def test_a_degenerate_stream_stops_the_run_with_one_line_saying_what_to_try():
    records = [record(i, loop()) for i in range(8)] + [record(8, prose(8)), record(9, prose(9))]
    with pytest.raises(DegenerateData) as err:
        check_answers(records, None, {EOS}, 0.2, "runs/data/x/distill")
    line = str(err.value)
    assert "\n" not in line
    assert "8 of 10 answers" in line and "80%" in line and "--raw" in line and "data.distill.prompts" in line
    assert isinstance(err.value, ValueError)   # the command line's boundary prints it as one line, exit non-zero


def test_no_limit_means_no_check():
    records = [record(i, loop()) for i in range(4)]
    assert check_answers(records, None, {EOS}, None, "x") == records


def test_the_training_run_checks_the_target_written_sources_only(tmp_path):
    """train.checked_records: answers the target wrote are checked; ShareGPT's own replies are not."""
    from trainers.train import DataSource, checked_records

    folder = tmp_path / "distill"
    folder.mkdir()
    (folder / "distill.json").write_text("{}")
    shard = [record(i, loop()) for i in range(5)] + [{"id": "long", "skipped": "prompt too long"}]
    (folder / "shard-00000.jsonl").write_text("".join(json.dumps(r) + "\n" for r in shard))
    target = SimpleNamespace(eos_token_ids={EOS}, tokenizer=None)
    cfg = OmegaConf.create({"data": {"max_degenerate": 0.2}})
    with pytest.raises(DegenerateData, match="5 of 5 answers"):
        checked_records(cfg, target, DataSource("main", {"source": "sharegpt"}, str(folder), "f"))
    assert len(checked_records(cfg, target, DataSource("text", {"source": "sharegpt_text"}, str(folder), "f"))) == 5
    off = OmegaConf.create({"data": {}})
    assert len(checked_records(off, target, DataSource("main", {"source": "sharegpt"}, str(folder), "f"))) == 5


def test_answers_drawn_again_are_reported_with_their_first_try_share(caplog):
    """Distillation drew some degenerate answers again (trainers/resample.py): the line says how many were
    degenerate at the first try, and the limit applies to those still degenerate, which are left out."""
    records = [record(i, prose(i)) for i in range(16)]
    for r in records[:12]:
        r["resampled"] = [1]
    records += [{**record(16, loop()), "resampled": [2]}, {**record(17, loop()), "resampled": [2]}]
    with caplog.at_level(logging.WARNING, logger="trainers.train"):
        kept = check_answers(records, None, {EOS}, 0.2, "d")
    assert len(kept) == 16
    assert "14 of 18 answers (77.8%) were degenerate at the first try, 14 drawn again" in caplog.text
    assert "now 2 of 18 answers in d (11.1%) are degenerate and left out" in caplog.text
