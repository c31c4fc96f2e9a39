"""Degenerate answers drawn again by sampling during self-distillation (trainers/resample.py), on tiny targets."""
from __future__ import annotations

import logging
import os
from types import SimpleNamespace

import pytest
import torch
from transformers import GenerationConfig

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from test_features import byte_tokenizer, write_questions  # noqa: E402

from trainers.answer_check import check_answers, record_reason  # noqa: E402
from trainers.distill import DistillConfig, distill, read_meta, read_records  # noqa: E402
from trainers.resample import model_sampling, resample_degenerate, resolved  # noqa: E402
from trainers.targets import TargetConfig, tiny_target  # noqa: E402

EOS = 257


def base_target(template: bool = False):
    """A tiny random model with a byte tokenizer: laid out plainly (no chat template) unless `template`."""
    from eagle_lite.targets.model import Target

    tokenizer = byte_tokenizer()
    if not template:
        tokenizer.chat_template = None
    tiny = tiny_target(TargetConfig(name="tiny-base", kind="tiny", vocab_size=260, eos_token_id=EOS,
                                    pad_token_id=258, seed=4))
    return Target(tiny.model, tokenizer, name="tiny-base")


def fake_target(generation_config=None, spec=None, template=None):
    return SimpleNamespace(model=SimpleNamespace(generation_config=generation_config or GenerationConfig()),
                           tokenizer=SimpleNamespace(chat_template=template), spec=spec)


def test_the_sampling_is_the_models_own_from_its_generation_config_or_gguf_file(tmp_path):
    import gguf

    # nothing set: what generate() samples with
    assert model_sampling(fake_target()) == {"temperature": 1.0, "top_p": 1.0, "top_k": 50}
    config = GenerationConfig(do_sample=True, temperature=0.7, top_p=0.8, top_k=20)
    assert model_sampling(fake_target(config)) == {"temperature": 0.7, "top_p": 0.8, "top_k": 20}
    path = tmp_path / "m.gguf"   # llama.cpp's general.sampling.* keys, over the generation config's
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_float32("general.sampling.temp", 0.5)
    writer.add_int32("general.sampling.top_k", 64)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    assert model_sampling(fake_target(config, spec=str(path))) == {"temperature": 0.5, "top_p": 0.8, "top_k": 64}


def test_auto_resamples_for_a_model_without_a_chat_template_only():
    plain, chat = fake_target(), fake_target(template="{{ messages }}")
    assert resolved(plain, "sharegpt", {"tries": "auto"}) == {"tries": 2, "temperature": 1.0, "top_p": 1.0,
                                                               "top_k": 50}
    assert resolved(chat, "sharegpt", {"tries": "auto"}) == {"tries": 0}          # its greedy answers stay
    assert resolved(chat, "prompts", {"tries": 3, "top_k": 10})["tries"] == 3       # unless asked
    assert resolved(plain, "sharegpt", {"tries": 1, "temperature": 0.6})["temperature"] == 0.6
    assert resolved(plain, "sharegpt_text", {"tries": "auto"}) == {"tries": 0}     # nothing the target wrote
    assert resolved(plain, "sharegpt", {"tries": 0}) == {"tries": 0}
    for bad in ({"tries": -1}, {"tries": "twice"}, {"tries": 2, "temperature": 0}, {"retries": 2}):
        with pytest.raises(ValueError, match="data.distill.resample"):
            DistillConfig(resample=bad)


def test_only_degenerate_answers_are_drawn_again_sampled_and_at_most_tries_times():
    loop, prose = [5, 6] * 20, list(range(10, 50))
    stuck = [0, 0, 9]                      # prompt 2 loops whatever is drawn
    calls = []

    def generate(target, prompts, cfg):
        calls.append((prompts, cfg))
        return [loop if p == stuck else prose for p in prompts]

    prompts = [[0, 0, 7], [0, 0, 8], stuck, [0, 0, 10]]
    answers = [prose, loop, loop, [EOS]]
    cfg = DistillConfig(resample={"tries": 3, "temperature": 0.9, "top_p": 0.95, "top_k": 40})
    counts = resample_degenerate(None, prompts, answers, cfg, {EOS}, generate)
    assert counts == [0, 1, 3, 1]
    assert answers == [prose, prose, loop, prose]
    assert [c[0] for c in calls] == [[[0, 0, 8], stuck, [0, 0, 10]], [stuck], [stuck]]
    assert all(c.do_sample and (c.temperature, c.top_p, c.top_k) == (0.9, 0.95, 40) for _, c in calls)
    assert resample_degenerate(None, prompts, [loop] * 4, DistillConfig(resample={"tries": 0}), {EOS},
                               generate) == [0] * 4   # off: nothing drawn
    assert len(calls) == 3


def test_a_degenerate_stream_from_a_model_without_a_template_is_resampled_and_reported(tmp_path, caplog):
    """The tiny base model's greedy answers loop for some prompts: distillation draws those again (recorded per
    answer and in the folder's settings), keeps the others as the greedy answers, and the data check reports the
    first-try share beside the one left out; with tries 0 the same loops reach the data check."""
    target = base_target()
    questions = write_questions(tmp_path / "q.jsonl", [(f"qa:{i}", [f"Question {i}?"]) for i in range(8)])
    base = dict(source="prompts", prompts=str(questions), max_new_tokens=40, max_prompt_tokens=120, batch_size=4,
                shard_size=4)
    distill(target, DistillConfig(**base, resample={"tries": 0}), tmp_path / "greedy", progress=False)
    greedy = {r["id"]: r for r in read_records(tmp_path / "greedy")}
    looped = {key for key, r in greedy.items() if record_reason(r, {EOS})}
    assert looped and len(looped) < len(greedy)            # the test needs both kinds
    assert "resample" not in read_meta(tmp_path / "greedy")["settings"]

    distill(target, DistillConfig(**base), tmp_path / "auto", progress=False)   # tries auto: 2, no template
    records = list(read_records(tmp_path / "auto"))
    assert read_meta(tmp_path / "auto")["settings"]["resample"] == {"tries": 2, "temperature": 1.0, "top_p": 1.0,
                                                                    "top_k": 50}
    for r in records:
        if r["id"] in looped:
            assert r["resampled"][0] >= 1 and r["input_ids"] != greedy[r["id"]]["input_ids"]
        else:
            assert "resampled" not in r and r["input_ids"] == greedy[r["id"]]["input_ids"]
    assert not any(record_reason(r, {EOS}) for r in records)
    with caplog.at_level(logging.INFO, logger="trainers.train"):
        assert len(check_answers(records, None, {EOS}, 0.2, "d")) == len(records)
    share = 100 * len(looped) / len(records)
    assert f"{len(looped)} of {len(records)} answers ({share:.1f}%) were degenerate at the first try" in caplog.text
    assert f"none of the {len(records)} answers in d is degenerate" in caplog.text

    # a rerun draws the same answers
    distill(target, DistillConfig(**base), tmp_path / "again", progress=False)
    assert [r["input_ids"] for r in read_records(tmp_path / "again")] == [r["input_ids"] for r in records]


def test_a_model_with_a_chat_template_keeps_its_greedy_answers():
    from trainers.distill import chat_records
    from trainers.sharegpt import Conversation, Turn

    target = base_target(template=True)
    chats = [Conversation(f"c{i}", [Turn("user", f"Question {i}?")]) for i in range(6)]
    cfg = DistillConfig(max_new_tokens=40, max_prompt_tokens=120, batch_size=3)
    records = chat_records(target, chats, cfg)
    assert any(record_reason(r, {EOS}) for r in records)     # some loop, and stay as they are
    assert not any("resampled" in r for r in records)
    for r in records:
        start, end = r["spans"][0]
        with torch.no_grad():
            alone = target.model.generate(torch.tensor([r["input_ids"][:start]]), max_new_tokens=40,
                                          do_sample=False, pad_token_id=258)
        assert r["input_ids"][start:end] == alone[0, start:].tolist()[:end - start]
