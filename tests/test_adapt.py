"""Online head adaptation (`--adapt`): capture at accept time, the learner, the guard, persistence, and that the output
stays the target's own whichever head serves."""
from __future__ import annotations

import json

import pytest
import torch
from conftest import make_target, reference_greedy

from eagle_lite.config import GenerationConfig, SamplingConfig
from eagle_lite.drafters import EagleOptions
from eagle_lite.heads.draft import DraftHead
from eagle_lite.pipeline import for_target
from eagle_lite_wing.adapt import Adapter, attach
from eagle_lite_wing.learner import LearnConfig
from eagle_lite_wing.traffic import TrafficStore
from trainers.features import target_features

SMALL = LearnConfig(batch_tokens=256, window=128, lr=1e-3, replay=0.0)


def prompts(n: int, seed: int = 0, length: int = 16) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 90, (length,), generator=g).tolist() for _ in range(n)]


def twin_heads(target, **kw) -> tuple[DraftHead, DraftHead]:
    """A head for the pipeline to serve and an identical trainable copy to start adaptation from."""
    torch.manual_seed(0)
    serving = DraftHead.for_target(target, **kw)
    start = DraftHead.for_target(target, **kw)
    start.load_state_dict(serving.state_dict())
    return serving, start


def adapting(target, folder, method="auto", cfg=SMALL, **kw):
    serving, start = twin_heads(target, **kw)
    pipeline = for_target(target, method, EagleOptions(head=serving))
    return pipeline, Adapter(pipeline, folder, start, cfg=cfg, judge_tokens=32)


def always_promote(adapter) -> None:
    """Every judgement finds the challenger a whole token a step better than the champion at every root."""
    adapter.learner.lengths = lambda head, records: torch.full((8,), 2.0 if head is adapter.learner.head else 1.0)


@pytest.fixture(scope="module")
def deep():
    return make_target("llama", layers=4)


@pytest.mark.parametrize("design", ["eagle", "eagle3"])
def test_capture_holds_the_targets_features_of_the_answer(llama, deep, tmp_path, design):
    target = deep if design == "eagle3" else llama
    kw = {"feature_layers": (0, 1, 2), "design": "eagle3"} if design == "eagle3" else {}
    pipeline, adapter = adapting(target, tmp_path, **kw)
    adapter.capture.context = 8
    prompt = prompts(1)[0]
    out = pipeline.engine.generate(prompt, GenerationConfig(max_new_tokens=20, tree=pipeline.tree))
    (record,) = adapter.capture.take()
    tokens = prompt + out.token_ids
    n = len(record)                          # 8 prompt tokens, the answer (its last token where a step read it)
    assert n in (27, 28) and record.input_ids.tolist() == tokens[len(prompt) - 8:len(prompt) - 8 + n]
    assert record.loss_mask.tolist() == [False] * 8 + [True] * (n - 8)
    full = target_features(target, [tokens[:len(prompt) - 8 + n]], kw.get("feature_layers", ()))[0]
    hidden, taps = full if design == "eagle3" else (full, None)
    torch.testing.assert_close(record.hidden.float(), hidden[len(prompt) - 8:], atol=0.05, rtol=0.02)
    if design == "eagle3":
        torch.testing.assert_close(record.taps.float(), taps[len(prompt) - 8:], atol=0.05, rtol=0.02)
    else:
        assert record.taps is None
    assert adapter.capture.seconds > 0


@pytest.mark.parametrize("method,moves", [("auto", "all"), ("eagle", "all"), ("auto", "layer")])
def test_greedy_output_is_the_targets_while_the_head_adapts(llama, tmp_path, method, moves):
    from dataclasses import replace

    from eagle_lite.formats import load_head

    pipeline, adapter = adapting(llama, tmp_path, method, cfg=replace(SMALL, moves=moves))
    always_promote(adapter)
    for prompt in prompts(6):
        out = pipeline.engine.generate(prompt, GenerationConfig(max_new_tokens=24, tree=pipeline.tree))
        assert out.token_ids == reference_greedy(llama, prompt, 24)
        adapter.round()
    assert adapter.card["promotions"] >= 2
    assert adapter.learner.steps > 0
    head = load_head(tmp_path, llama)               # the promoted head: an ordinary head folder
    for k, v in head.state_dict().items():
        torch.testing.assert_close(v.float(), adapter.champion.state_dict()[k].float())


def test_sampled_output_does_not_depend_on_capture(llama, tmp_path):
    sampling = SamplingConfig(temperature=1.0)
    pipeline, adapter = adapting(llama, tmp_path)
    assert pipeline.engine.observers[-1:] == [adapter.capture]   # capture alone (no lookup store: it is opt-in)
    prompt = prompts(1)[0]
    cfg = GenerationConfig(max_new_tokens=24, tree=pipeline.tree, sampling=sampling, seed=3)
    with_capture = pipeline.engine.generate(prompt, cfg).token_ids
    assert len(adapter.capture) == 1
    pipeline.engine.observers.remove(adapter.capture)
    assert pipeline.engine.generate(prompt, cfg).token_ids == with_capture


def test_learner_lowers_the_training_loss_on_what_it_saw(llama, tmp_path):
    pipeline, adapter = adapting(llama, tmp_path)
    for prompt in prompts(3):
        pipeline.engine.generate(prompt, GenerationConfig(max_new_tokens=30, tree=pipeline.tree))
    adapter.learner.add(adapter.capture.take())
    first = adapter.learner.train(1)
    adapter.learner.train(30)
    assert adapter.learner.train(1) < 0.8 * first


def test_the_learner_can_train_on_the_prompts_positions_too(llama, tmp_path):
    from dataclasses import replace

    pipeline, adapter = adapting(llama, tmp_path, cfg=replace(SMALL, prompts=True))
    for prompt in prompts(2):
        pipeline.engine.generate(prompt, GenerationConfig(max_new_tokens=12, tree=pipeline.tree))
    records = adapter.capture.take()
    assert all(not r.loss_mask.all() for r in records)           # the record's own mask: its answer alone
    adapter.learner.add(records)
    batch = adapter.learner._batch()
    real = batch["segment"] > 0
    assert batch["loss_mask"][real].all()                        # every position of a record is trained on
    adapter.learner.cfg = SMALL
    answers = adapter.learner._batch()
    assert not answers["loss_mask"][answers["segment"] > 0].all()


def test_guard_drops_a_challenger_that_accepts_less(llama, tmp_path):
    pipeline, adapter = adapting(llama, tmp_path)
    adapter.confidence = 0.0       # the plain comparison: a random target's heads differ by little on its text
    serving = pipeline.engine.drafter.inner
    for prompt in prompts(2):
        pipeline.engine.generate(prompt, GenerationConfig(max_new_tokens=30, tree=pipeline.tree))
    adapter.round()                                   # the first answers join the pool; training starts
    with torch.no_grad():                             # a challenger gone bad
        for p in adapter.learner.head.parameters():
            p.normal_(0, 1)
    before = {k: v.clone() for k, v in adapter.champion.state_dict().items()}
    for prompt in prompts(2, seed=1):
        pipeline.engine.generate(prompt, GenerationConfig(max_new_tokens=30, tree=pipeline.tree))
    report = adapter.round(steps=0)
    champion, challenger = report["judged"]
    assert challenger < champion and not report["promoted"]
    assert pipeline.engine.drafter.inner is serving                          # still the same serving head
    for k, v in adapter.champion.state_dict().items():
        torch.testing.assert_close(v, before[k])
        torch.testing.assert_close(adapter.learner.head.state_dict()[k], v)  # the learner restarts from it
    assert not (tmp_path / "config.json").exists()                          # nothing promoted, nothing written


def test_a_promoted_head_is_an_ordinary_head_folder_and_resumes(llama, tmp_path):
    from eagle_lite.formats import load_head

    pipeline, adapter = adapting(llama, tmp_path)
    always_promote(adapter)
    for prompt in prompts(4):
        pipeline.engine.generate(prompt, GenerationConfig(max_new_tokens=24, tree=pipeline.tree))
        adapter.round()
    assert adapter.card["promotions"] >= 1
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["adapted"]["promotions"] == adapter.card["promotions"]
    assert "answer tokens seen" in (tmp_path / "README.md").read_text()
    loaded = load_head(tmp_path, llama)
    for k, v in adapter.champion.state_dict().items():
        torch.testing.assert_close(loaded.state_dict()[k], v)
    # a new pipeline with the folder resumes from its head (`load(adapt=...)` does this with the folder's head)
    resumed_pipeline = for_target(llama, "auto", EagleOptions(draft=str(tmp_path)))
    _, start = twin_heads(llama)
    resumed = Adapter(resumed_pipeline, tmp_path, start, champion=load_head(tmp_path, llama), cfg=SMALL)
    assert resumed.card["promotions"] == adapter.card["promotions"]
    for k, v in adapter.champion.state_dict().items():
        torch.testing.assert_close(resumed.champion.state_dict()[k], v)
    prompt = prompts(1, seed=5)[0]
    out = resumed_pipeline.engine.generate(prompt, GenerationConfig(max_new_tokens=24, tree=resumed_pipeline.tree))
    assert out.token_ids == reference_greedy(llama, prompt, 24)
    resumed.reset()                                   # back to the head adaptation started from
    for k, v in start.state_dict().items():
        torch.testing.assert_close(resumed.champion.state_dict()[k], v.float())


def test_a_save_that_fails_keeps_serving(llama, tmp_path, monkeypatch, caplog):
    import eagle_lite_wing.adapt as adapt

    pipeline, adapter = adapting(llama, tmp_path)
    always_promote(adapter)

    def full(*args, **kwargs):
        raise OSError(28, "No space left on device")
    monkeypatch.setattr(adapt, "save_head", full)
    for prompt in prompts(4):
        out = pipeline.engine.generate(prompt, GenerationConfig(max_new_tokens=24, tree=pipeline.tree))
        assert out.token_ids == reference_greedy(llama, prompt, 24)
        adapter.round()
    assert adapter.card["promotions"] >= 1
    assert "No space left on device" in caplog.text


def test_bad_folders_and_methods_are_refused_in_one_line(llama, tmp_path):
    file = tmp_path / "a-file"
    file.write_text("")
    pipeline, _ = adapting(llama, tmp_path / "ok")
    _, start = twin_heads(llama)
    with pytest.raises(ValueError, match="cannot write there"):
        Adapter(pipeline, file / "sub", start, cfg=SMALL)
    lookup = for_target(llama, "lookup")
    with pytest.raises(ValueError, match="drafts without one"):
        attach(lookup, tmp_path / "lookup", "random")
    with pytest.raises(ValueError, match="adapt moves"):
        LearnConfig(moves="everything")


def test_a_folder_with_another_targets_head_is_refused(llama, tmp_path):
    from eagle_lite.heads.checkpoint import HeadMismatchError, save_head

    other = make_target("qwen2")
    save_head(DraftHead.for_target(other), tmp_path, other)
    with pytest.raises(HeadMismatchError):
        attach(for_target(llama, "auto", EagleOptions(draft="random")), tmp_path, "random")


def test_idle_learning_spends_the_credit_and_stops(llama, tmp_path):
    """What the chat (while the user types) and the server (while idle) run: a step at a time while there is work."""
    pipeline, adapter = adapting(llama, tmp_path)
    for prompt in prompts(3):
        pipeline.engine.generate(prompt, GenerationConfig(max_new_tokens=30, tree=pipeline.tree))
    adapter.round(steps=0)
    while adapter.has_work():
        assert adapter.round(steps=1)["steps"] == 1
    assert adapter.credit == 0 and adapter.learner.steps == 3 * adapter.steps


def test_eval_adapt_writes_fifths_per_kind_with_identical_outputs(tiny_model_dir, tmp_path):
    from eval.adapt import main

    questions = tmp_path / "q.jsonl"
    questions.write_text("".join(json.dumps({"question_id": f"{kind}-{i}", "category": kind,
                                             "turns": [f"tell me about {kind} number {i}"]}) + "\n"
                                 for kind in ("alpha", "beta") for i in range(5)))
    out = tmp_path / "out"
    assert main(["--target", str(tiny_model_dir), "--draft", "random", "--questions", str(questions),
                 "--max-new-tokens", "16", "--judge-tokens", "16", "--replay", "0", "--out", str(out)]) == 0
    report = json.loads((out / "adapt.json").read_text())
    assert sorted(report["kinds"]) == ["alpha", "beta"]
    for kind in report["kinds"].values():
        assert len(kind["fifths"]) == 5
        assert all(f["frozen"]["tokens_per_s"] > 0 and f["adapted"]["accepted"] >= 1 for f in kind["fifths"])
    assert report["identical"] == 1.0 and report["learner_seconds"] >= 0
    assert (out / "heads" / "alpha").is_dir()


def test_eval_adapt_takes_a_tree_and_a_learner(tiny_model_dir, tmp_path, capsys):
    from eval.adapt import main

    questions = tmp_path / "q.jsonl"
    questions.write_text("".join(json.dumps({"question_id": f"alpha-{i}", "category": "alpha",
                                             "turns": [f"tell me about number {i}"]}) + "\n" for i in range(3)))
    out = tmp_path / "out"
    assert main(["--target", str(tiny_model_dir), "--draft", "random", "--questions", str(questions),
                 "--max-new-tokens", "16", "--judge-tokens", "16", "--replay", "0", "--method", "eagle",
                 "--moves", "layer", "--lr", "1e-2", "--tree-depth", "3", "--tree-top-k", "1",
                 "--tree-total-tokens", "3", "--tree-lookup", "0", "--out", str(out)]) == 0
    header = capsys.readouterr().out.splitlines()[0]
    assert "tree depth 3, top_k 1, total_tokens 3, lookup 0" in header and "moves layer" in header
    assert json.loads((out / "adapt.json").read_text())["identical"] == 1.0
    with pytest.raises(SystemExit):   # the low-rank learner is gone: refused before anything loads
        main(["--target", str(tiny_model_dir), "--questions", str(questions), "--moves", "lowrank"])
    assert "lowrank" in capsys.readouterr().err


def test_load_with_adapt_resumes_and_a_pinned_tree_keeps_adapting(tiny_model_dir, tmp_path):
    from eagle_lite.drafters import EagleOptions
    from eagle_lite.pipeline import load

    lm = load(str(tiny_model_dir), draft="random", adapt=str(tmp_path / "head"))
    assert lm.adapter is not None and lm.adapter.capture in lm.engine.observers
    pinned = lm.pinned_to("eagle", EagleOptions())
    assert pinned.adapter is lm.adapter and lm.adapter.capture in pinned.engine.observers
    pinned.generate("hello there", pinned.config(max_new_tokens=12))
    assert len(lm.adapter.capture) == 1
    always_promote(lm.adapter)
    lm.adapter.judge_tokens = 16
    for text in ("one more question", "and another one", "the last question"):
        pinned.generate(text, pinned.config(max_new_tokens=30))
        lm.adapter.round()
    assert (tmp_path / "head" / "config.json").is_file()
    again = load(str(tiny_model_dir), draft="random", adapt=str(tmp_path / "head"))
    assert again.adapter.card["promotions"] == lm.adapter.card["promotions"] >= 1
    for k, v in lm.adapter.champion.state_dict().items():
        torch.testing.assert_close(again.adapter.champion.state_dict()[k], v)


def test_adapt_curves_replays_the_captured_answers_per_setting(tiny_model_dir, tmp_path, capsys):
    from eval.adapt_curves import load_records, main

    questions = tmp_path / "q.jsonl"
    questions.write_text("".join(json.dumps({"question_id": f"k-{i}", "category": "k",
                                             "turns": [f"question {i} about something"]}) + "\n" for i in range(5)))
    records = tmp_path / "answers.safetensors"
    argv = ["--target", str(tiny_model_dir), "--draft", "random", "--questions", str(questions),
            "--max-new-tokens", "16", "--records", str(records), "--settings",
            '{"replay": 0, "judge_tokens": 16, "batch_tokens": 128}', '{"replay": 0, "moves": "layer"}']
    assert main(argv) == 0
    assert len(load_records(str(records))) == 5
    first = capsys.readouterr().out
    assert first.count("| `{") == 2 and "fifth 5" in first
    assert main(argv) == 0                            # the second run replays the file: the same curves
    assert capsys.readouterr().out == first
    assert main(argv[:-2] + ['{"learning": 1}']) == 1   # one line: unknown learner settings
    assert main(argv[:-2] + ['{"confidence": -1}']) == 1   # one line: a guard that would swap on any gain
    bad = tmp_path / "bad.safetensors"
    bad.write_text("not safetensors")
    assert main(["--records", str(bad)]) == 1
    assert "is not a file of captured answers" in capsys.readouterr().err


def test_the_guard_swaps_heads_only_past_the_noise():
    from eagle_lite_wing.adapt import verdict

    champion = torch.tensor([1.0, 2.0, 3.0, 1.0, 2.0] * 8)
    assert verdict(champion, champion.clone(), 2.0) == "wait"
    # one root in ten a token longer, one in twelve a token shorter: more on average, within the noise
    noisy = champion + torch.tensor([1.0 if i % 10 == 0 else -1.0 if i % 12 == 5 else 0.0 for i in range(40)])
    assert noisy.mean() > champion.mean() and verdict(champion, noisy, 2.0) == "wait"
    assert verdict(champion, champion + 0.5 + 0.1 * (torch.arange(40) % 3), 2.0) == "promote"
    assert verdict(champion, champion - 1.0 + 0.1 * (torch.arange(40) % 2), 2.0) == "drop"
    assert verdict(champion, noisy, 0.0) == "promote"          # no margin: the plain comparison


def test_answers_judged_within_the_noise_stay_held_out_until_the_limit(llama, tmp_path):
    pipeline, adapter = adapting(llama, tmp_path)
    adapter.max_judge_tokens = 3 * adapter.judge_tokens
    for prompt in prompts(2):
        pipeline.engine.generate(prompt, GenerationConfig(max_new_tokens=30, tree=pipeline.tree))
    adapter.round()                                   # training starts
    scored = []

    def lengths(head, records):                       # the challenger ahead on one root in twenty: noise
        scored.append(len(records))
        n = 60
        return torch.ones(n) + (torch.arange(n) % 20 == 0).float() * (head is adapter.learner.head)
    adapter.learner.lengths = lengths
    pooled = len(adapter.learner.pool)
    held = []
    for prompt in prompts(6, seed=2):
        pipeline.engine.generate(prompt, GenerationConfig(max_new_tokens=32, tree=pipeline.tree))
        report = adapter.round(steps=1)
        held.append(len(adapter.pending))
        assert not report["promoted"]
    assert adapter.card["promotions"] == 0 and not (tmp_path / "config.json").exists()
    assert max(held) >= 2                             # judged, within the noise: held out, judged again with more
    assert scored[2] > scored[0]                      # the second judgement scored the held answers and the new
    assert len(adapter.learner.pool) > pooled         # past the limit they joined the pool


def test_adapt_keeps_the_answers_it_serves_to_look_up(llama, tmp_path):
    # eagle: its lookup graft reads the store every step (auto's controller, timing this machine, may not)
    serving, start = twin_heads(llama)
    pipeline = for_target(llama, "eagle", EagleOptions(head=serving))
    adapter = Adapter(pipeline, tmp_path, start, cfg=SMALL, judge_tokens=32, traffic_tokens=4096)
    assert adapter.traffic in pipeline.engine.observers and len(adapter.traffic) == 0
    cfg = GenerationConfig(max_new_tokens=24, tree=pipeline.tree, stop_at_eos=False)
    first = pipeline.engine.generate(prompts(1)[0], cfg)
    assert len(adapter.traffic) == 1 and "1 answers to look up" in adapter.stats_line()
    pipeline.engine.reset()
    again = pipeline.engine.generate(prompts(1)[0], cfg)       # the same question: its answer is looked up
    assert again.token_ids == first.token_ids == reference_greedy(llama, prompts(1)[0], 24)
    assert again.stats.target_forwards < first.stats.target_forwards
    adapter.reset()                                            # back to the head it started from: the store empties
    assert len(adapter.traffic) == 0 and adapter.traffic in pipeline.engine.observers
    assert sum(isinstance(o, TrafficStore) for o in pipeline.engine.observers) == 1   # the old store went
    off = for_target(llama, "eagle", EagleOptions(head=serving))
    assert Adapter(off, tmp_path / "off", start, cfg=SMALL).traffic is None    # off unless asked
    assert not any(isinstance(o, TrafficStore) for o in off.engine.observers)
