"""The device bundle: files cut into parts that fit one device call each, and put back together exactly."""
from __future__ import annotations

import os

import pytest

from trainers.device_bundle import MANIFEST, device_calls, join, split


def test_files_split_into_calls_and_join_back_exactly(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    sizes = {"a.whl": 2500, "b.whl": 0, "c.whl": 999, "d.whl": 4096}
    files = []
    for name, size in sizes.items():
        (src / name).write_bytes(os.urandom(size))
        files.append(src / name)
    folders = split(files, tmp_path / "carry", call_bytes=1024)
    for folder in folders:                                  # no call carries more than its share
        assert sum(p.stat().st_size for p in folder.iterdir() if p.name != MANIFEST) <= 1024
    assert len(folders) == -(-sum(sizes.values()) // 1024)  # the parts fill each call before the next
    collected = tmp_path / "device"                          # what the calls copy to /tmp/carry
    collected.mkdir()
    for folder in folders:
        for p in folder.iterdir():
            (collected / p.name).write_bytes(p.read_bytes())
    out = join(collected, tmp_path / "joined")
    assert [p.name for p in out] == list(sizes)
    assert all((tmp_path / "joined" / n).read_bytes() == (src / n).read_bytes() for n in sizes)
    some = join(collected, tmp_path / "some", only={"c.whl", "a.whl"})   # the files a call has all the parts of
    assert [p.name for p in some] == ["a.whl", "c.whl"] and (tmp_path / "some" / "c.whl").read_bytes() == (
        src / "c.whl").read_bytes()
    calls = device_calls(folders, tmp_path)
    assert len(calls) == len(folders) + 1 and calls[0].startswith('run(carry=["carry/1"]')


def test_a_missing_or_damaged_part_is_named(tmp_path):
    (tmp_path / "x.whl").write_bytes(os.urandom(3000))
    folders = split([tmp_path / "x.whl"], tmp_path / "carry", call_bytes=1024)
    collected = tmp_path / "device"
    collected.mkdir()
    for p in folders[0].iterdir():                           # only the first call's parts arrived
        (collected / p.name).write_bytes(p.read_bytes())
    with pytest.raises(ValueError, match=r"x\.whl: part 2/000\.001 is missing"):
        join(collected, tmp_path / "joined")
    for folder in folders[1:]:
        for p in folder.iterdir():
            (collected / p.name).write_bytes(b"\0" * p.stat().st_size)   # arrived, but not the same bytes
    with pytest.raises(ValueError, match="does not match its checksum"):
        join(collected, tmp_path / "joined")


@pytest.mark.parametrize("text, problem", [("{oops", "not JSON: Expecting"), ('{"a": 1}', "not a list of files"),
                                           ('[{"name": "x.whl"}]', "not a list of files")])
def test_a_damaged_manifest_is_named(text, problem, tmp_path):
    (tmp_path / MANIFEST).write_text(text)
    with pytest.raises(ValueError, match=f"{MANIFEST} is not a bundle manifest \\({problem}"):
        join(tmp_path, tmp_path / "joined")
