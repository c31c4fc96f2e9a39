"""--record DIR: completed answers written as token ids in the distill shard format, opt-in, and trained on with
`python -m trainers.train data=recorded data.distill.start_from=DIR`."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(ROOT)}


def records_in(folder: Path) -> list[dict]:
    return [json.loads(line) for shard in sorted(folder.glob("shard-*.jsonl"))
            for line in shard.read_text().splitlines() if line]


def test_nothing_is_recorded_unless_asked(tiny_model_dir, tmp_path):
    from eagle_lite import load

    lm = load(str(tiny_model_dir), method="vanilla")
    assert lm.recorder is None
    lm.generate("hi", lm.config(max_new_tokens=4))
    assert not list(tmp_path.iterdir())


def test_each_completed_answer_is_one_record_and_a_stopped_one_none(tiny_model_dir, tmp_path):
    from eagle_lite import load
    from eagle_lite.text.record import SOURCE

    folder = tmp_path / "traffic"
    lm = load(str(tiny_model_dir), method="lookup", record=str(folder))
    out = lm.generate("Hello there", lm.config(max_new_tokens=12))
    chat = [{"role": "user", "content": "Hello there"}, {"role": "assistant", "content": out.text},
            {"role": "user", "content": "and then?"}]
    ids: list[int] = []
    text = "".join(lm.stream(chat, lm.config(max_new_tokens=10), token_ids=ids))
    stopped = lm.stream("never finished", lm.config(max_new_tokens=50))
    next(stopped)
    stopped.close()   # Ctrl-C in the middle of an answer: not recorded
    first, second = records_in(folder)
    assert first["input_ids"] == lm.encode("Hello there") + out.token_ids
    assert first["spans"] == [[len(lm.encode("Hello there")), len(first["input_ids"])]]
    assert second["input_ids"] == lm.encode(chat) + ids and text
    assert second["spans"] == [[len(lm.encode(chat)), len(second["input_ids"])]]   # earlier turns: context
    assert first["id"] != second["id"]
    meta = json.loads((folder / "distill.json").read_text())
    assert meta["settings"] == {"source": SOURCE} and meta["target"] == lm.target.fingerprint()
    # a second process recording into the same folder adds shards of its own
    again = load(str(tiny_model_dir), method="lookup", record=str(folder))
    again.generate("One more", again.config(max_new_tokens=6))
    assert len(records_in(folder)) == 3 and len(list(folder.glob("shard-*.jsonl"))) == 2


def test_a_record_folder_of_another_target_or_that_cannot_be_written_is_one_line(tiny_model_dir, tmp_path):
    from eagle_lite.text.record import Recorder
    from trainers.targets import tiny_target

    folder = tmp_path / "traffic"
    Recorder(folder, tiny_target())
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    for args, says, status in (
        (["--record", str(folder)], "holds the answers of target 'tiny', not of", 1),
        (["--record", str(blocker / "sub")], "Not a directory", 1),
    ):
        proc = subprocess.run([sys.executable, "-m", "eagle_lite.generate", "--target", str(tiny_model_dir),
                               "--method", "vanilla", "--prompt", "hi", "--max-new-tokens", "4", *args],
                              cwd=ROOT, capture_output=True, text=True, timeout=300, env=ENV)
        assert proc.returncode == status, proc.stderr
        [line] = [line for line in proc.stderr.strip().splitlines() if not line.startswith("Loading weights")]
        assert line.startswith("error: ") and says in line, line


def test_recorded_chat_trains_a_head_with_the_normal_recipe(tiny_model_dir, tmp_path):
    """The CLI's chat with --record, then `python -m trainers.train data=recorded data.distill.start_from=DIR`: the
    run takes every recorded answer as it was served (nothing answered again) and exports a head."""
    folder, runs = tmp_path / "traffic", tmp_path / "runs"
    turns = "".join(f"Tell me about {i}.\nAnd then?\n/reset\n" for i in range(6)) + "/quit\n"   # 6 chats of 2
    chat = subprocess.run([sys.executable, "-m", "eagle_lite.generate", "--target", str(tiny_model_dir),
                           "--method", "lookup", "--max-new-tokens", "24", "--record", str(folder)],
                          cwd=ROOT, input=turns, capture_output=True, text=True, timeout=300, env=ENV)
    assert chat.returncode == 0, chat.stderr
    recorded = records_in(folder)
    assert len(recorded) == 12
    # a chat's second answer is recorded with the conversation so far (re-rendered by the chat template) as its
    # context, its own answer the span
    for first, second in zip(recorded[::2], recorded[1::2]):
        assert second["input_ids"][:first["spans"][0][0]] == first["input_ids"][:first["spans"][0][0]]
        assert second["spans"][0][0] >= len(first["input_ids"])
    train = subprocess.run([sys.executable, "-m", "trainers.train", f"target={tiny_model_dir}", "data=recorded",
                            f"data.distill.start_from={folder}", f"paths.root={runs}", "trainer.max_epochs=2",
                            "data.loader.val_percent=25", "progress=false"],
                           cwd=ROOT, capture_output=True, text=True, timeout=600, env=ENV)
    assert train.returncode == 0, train.stderr[-3000:]
    name = Path(tiny_model_dir).name
    taken = records_in(runs / "data" / name / "recorded" / "distill")
    assert [r["input_ids"] for r in taken] == [r["input_ids"] for r in recorded]   # as served, not answered again
    assert (runs / "train" / name / "recorded" / "default" / "head" / "config.json").is_file()
    assert "nothing to answer" in train.stdout   # the estimate knew there was nothing to generate


def test_recorded_data_needs_its_folder_and_refuses_distilled_answers(tmp_path):
    from conftest import train_config

    from trainers.distill import DistillConfig, recorded_ids
    from trainers.train import check_settings

    with pytest.raises(ValueError, match="data.distill.source=recorded trains on answers recorded with --record"):
        DistillConfig(source="recorded")
    with pytest.raises(ValueError, match="set data.distill.start_from=DIR"):   # data=recorded alone: before the load
        check_settings(train_config("data=recorded"))
    with pytest.raises(FileNotFoundError, match="no recorded answers there"):
        recorded_ids(DistillConfig(source="recorded", start_from=str(tmp_path / "nowhere")))
    with pytest.raises(ValueError, match="holds distilled answers, not recorded traffic"):
        recorded_ids(DistillConfig(source="recorded", start_from=str(ROOT / "data" / "distill" / "smollm2-sharegpt")))
