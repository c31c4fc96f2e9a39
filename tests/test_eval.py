"""The evaluation runner: methods interleaved per question, identical-output check, summary table."""
from __future__ import annotations

import json

import pytest
import torch

from eagle_lite.config import GenerationConfig, TreeConfig
from eagle_lite.draft import DraftHead
from eagle_lite.loading import load_target
from eval import report, runner
from eval.methods import build_methods
from eval.runner import first_difference
from eval.tasks import load_question_file


@pytest.fixture(scope="module")
def chat_target(tiny_model_dir):
    return load_target(str(tiny_model_dir))


def test_runner_compares_every_method_to_the_baseline(chat_target, tmp_path):
    qfile = tmp_path / "q.jsonl"
    qfile.write_text("\n".join(json.dumps(q) for q in [
        {"question_id": 1, "category": "writing", "turns": ["write a poem", "shorter"]},
        {"question_id": 2, "category": "code", "turns": ["def f(x):"]},
    ]))
    questions = load_question_file(qfile)
    torch.manual_seed(0)
    methods = build_methods(chat_target, ["hf_generate", "vanilla", "eagle"], DraftHead.for_target(chat_target))
    cfg = GenerationConfig(max_new_tokens=10, tree=TreeConfig(depth=3, top_k=3, total_tokens=8))
    records = runner.run(chat_target, questions, methods, cfg, baseline="hf_generate", warmup=False)
    assert len(records) == 3 * 3                      # 3 turns (2 + 1) x 3 methods
    assert [r.method for r in records[:3]] == ["hf_generate", "vanilla", "eagle"]   # interleaved
    assert all(r.identical_to_baseline for r in records), [r for r in records if not r.identical_to_baseline]
    assert {r.question_id for r in records} == {"1#0", "1#1", "2"}
    rows = report.summarize(records, "hf_generate")
    assert {(r["category"], r["method"]) for r in rows} >= {("overall", "eagle"), ("code", "vanilla")}
    table = report.markdown_table(rows, "hf_generate")
    assert "| overall | eagle |" in table and "100%" in table


def test_first_difference():
    assert first_difference([1, 2, 3], [1, 2, 3]) is None
    assert first_difference([1, 5, 3], [1, 2, 3]) == 1
    assert first_difference([1, 2], [1, 2, 3]) == 2


def test_unknown_method_is_refused(chat_target):
    with pytest.raises(ValueError, match="unknown method"):
        build_methods(chat_target, ["medusa"])
