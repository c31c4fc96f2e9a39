"""The training pipeline on tiny random targets: objective alignment, configs, fit, resume, export."""
from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from conftest import reference_greedy, tiny_train_config, train_config  # noqa: E402
from omegaconf import OmegaConf  # noqa: E402

from eagle_lite.formats import load_head  # noqa: E402
from eagle_lite.heads.checkpoint import HeadMismatchError, read_head_config  # noqa: E402
from eagle_lite.heads.draft import DraftHead  # noqa: E402
from eagle_lite.kv_cache import StaticKVCache  # noqa: E402
from trainers.datamodule import LoaderConfig, joint_index  # noqa: E402
from trainers.features import FeatureCache, FeatureConfig, cache_features  # noqa: E402
from trainers.objective import (  # noqa: E402
    ObjectiveConfig,
    agreement,
    collate,  # noqa: E402
    lookup_predictable,
    make_pairs,
    novel_pairs,
    objective,
    unroll,
)
from trainers.targets import TargetConfig, tiny_target  # noqa: E402
from trainers.vocab import build_d2t, count_tokens  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
CONF = ROOT / "conf"


@pytest.fixture(scope="module")
def target():
    return tiny_target(TargetConfig(name="tiny", kind="tiny", seed=0))


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> Path:
    """One runs/ root per module: the tiny data is distilled and cached once, then shared."""
    return tmp_path_factory.mktemp("runs")


def item(ids: list[int], hidden: torch.Tensor, mask: list[bool] | None = None) -> dict:
    return {"input_ids": torch.tensor(ids), "hidden": hidden,
            "loss_mask": torch.tensor(mask if mask is not None else [True] * len(ids))}


# -- the objective ----------------------------------------------------------------------------------
def test_unrolled_training_matches_chain_drafting_at_inference(target):
    """Training-time-test step k at position t == the runtime drafting k steps past the real root t-k."""
    check_unrolled_training_matches_chain_drafting(target)


def test_a_head_of_a_target_without_llama_layers_trains_as_it_drafts():
    from test_architectures import build

    check_unrolled_training_matches_chain_drafting(build("gpt2"))   # its head is a Llama layer of GPT-2's sizes


def test_an_eagle3_head_trains_on_the_taps_it_drafts_from():
    """EAGLE-3: step 0 reads the target's tapped layers (cached as `taps`), later steps the head's own output."""
    check_unrolled_training_matches_chain_drafting(tiny_target(TargetConfig(name="tiny4", kind="tiny", num_layers=4)),
                                                   taps=(0, 1, 2))


def check_unrolled_training_matches_chain_drafting(target, taps: tuple[int, ...] = ()) -> None:
    torch.manual_seed(0)
    head = DraftHead.for_target(target, feature_layers=taps).eval()
    n, steps = 12, 3
    ids = torch.randint(2, target.vocab_size, (n,)).tolist()
    with torch.no_grad():
        out = target.decoder(input_ids=torch.tensor([ids]), output_hidden_states=True)
        hidden = out.last_hidden_state[0]  # T H
        example = item(ids, hidden)
        if taps:
            example["taps"] = torch.cat([out.hidden_states[i + 1][0] for i in taps], dim=-1)  # T K*H
        pairs = make_pairs(collate([example], max_len=n, pack=False), target.embed_tokens.weight, taps=bool(taps))
        preds = unroll(head, pairs, steps)  # steps x [1, T', H]
        cfg = head.config
        features = example.get("taps", hidden)  # what the drafter reads of the real tokens
        for root in (0, 4, 7):
            cache = StaticKVCache(1, cfg.num_key_value_heads, cfg.hidden_size // cfg.num_attention_heads, 64)
            m = root + 1  # the real pairs (f_t, x_{t+1}) for t = 0..root, as the drafter catches up
            h = head.step(features[:m], target.embed_tokens(torch.tensor(ids[1:m + 1])), cache,
                          torch.arange(m), torch.ones(m, m, dtype=torch.bool).tril_())
            cache.commit(m)
            torch.testing.assert_close(h[-1], preds[0][0, root], atol=1e-5, rtol=1e-4)
            for k in range(1, steps):  # drafted nodes: the head's own feature + the next sequence token
                t = root + k
                h = head.step(h[-1:], target.embed_tokens(torch.tensor([ids[t + 1]])), cache,
                              torch.tensor([t]), torch.ones(1, 1, dtype=torch.bool))
                cache.commit(1)
                torch.testing.assert_close(h[-1], preds[k][0, t], atol=1e-5, rtol=1e-4)


def test_packed_rows_give_the_same_predictions_as_padded_rows(target):
    torch.manual_seed(1)
    head = DraftHead.for_target(target).eval()
    seqs = [torch.randint(2, target.vocab_size, (n,)).tolist() for n in (9, 5)]
    with torch.no_grad():
        items = [item(s, target.decoder(input_ids=torch.tensor([s])).last_hidden_state[0]) for s in seqs]
        packed, padded = (collate(items, max_len=16, pack=p) for p in (True, False))
        assert packed["input_ids"].shape == (1, 14) and padded["input_ids"].shape == (2, 9)
        emb = target.embed_tokens.weight
        p_pack, p_pad = (unroll(head, make_pairs(b, emb), 2) for b in (packed, padded))
        w_pack, w_pad = make_pairs(packed, emb).weight, make_pairs(padded, emb).weight
    assert int(w_pack.sum()) == int(w_pad.sum()) == (9 - 2) + (5 - 2)
    for k in range(2):  # sequence 0 fills columns 0..8 of the packed row, sequence 1 columns 9..13
        torch.testing.assert_close(p_pack[k][0, :8], p_pad[k][0, :8], atol=1e-5, rtol=1e-4)
        torch.testing.assert_close(p_pack[k][0, 9 + k:13], p_pad[k][1, k:4], atol=1e-5, rtol=1e-4)


def test_accept_length_estimate_with_oracle_and_one_step_drafters(target):
    n, depth = 10, 4
    ids = torch.randint(2, target.vocab_size, (n,)).tolist()
    with torch.no_grad():
        hidden = target.decoder(input_ids=torch.tensor([ids])).last_hidden_state[0]
    pairs = make_pairs(collate([item(ids, hidden)], max_len=n, pack=False), target.embed_tokens.weight)
    weight = target.lm_head.weight
    oracle = unroll(lambda h, e, p, m, cache=None: pairs.target, pairs, depth)
    stats = agreement(oracle, pairs, weight, weight, None)
    roots = n - 2  # pairs t = 0..n-3 have a next-next token
    assert stats["top1"] == stats["top3"] == stats["tokens"] == roots
    assert stats["accept"] / roots == pytest.approx(sum(1 + min(depth, roots - r) for r in range(roots)) / roots)
    calls = []

    def first_step_only(h, e, p, m, cache=None):  # right at step 0, always wrong afterwards
        calls.append(1)
        return pairs.target if len(calls) == 1 else -pairs.target
    stats = agreement(unroll(first_step_only, pairs, depth), pairs, weight, weight, None)
    assert stats["accept"] / stats["roots"] == pytest.approx(2.0)


def test_lookup_predictable_marks_what_a_trigram_lookup_would_propose():
    #                     0  1  2  3  4  5  6  7  8  9
    ids = torch.tensor([[5, 6, 7, 8, 5, 6, 7, 9, 5, 6],
                        [5, 6, 7, 8, 5, 6, 7, 8, 0, 0]])
    segment = torch.tensor([[1, 1, 1, 1, 1, 1, 1, 1, 1, 1],
                            [1, 1, 1, 1, 2, 2, 2, 2, 0, 0]])  # row 1: two packed segments, then padding
    got = lookup_predictable(ids, segment)
    # row 0: the trigram (5, 6, 7) recurs before position 7, but it was followed by 8, not 9; no other recurs
    assert got[0].tolist() == [False] * 10
    # the second segment repeats the first one's tokens, but a lookup never crosses a segment border
    assert got[1].tolist() == [False] * 10
    loop = torch.tensor([[1, 2, 3, 1, 2, 3, 1, 2, 3]])
    assert lookup_predictable(loop, torch.ones_like(loop)).tolist() == [[False] * 6 + [True] * 3]
    # pair t predicts token t + 2; the last pair has no token to predict
    batch = {"input_ids": loop, "segment": torch.ones_like(loop)}
    assert novel_pairs(batch).tolist() == [[True] * 4 + [False] * 3 + [False]]


def one_row_pairs(target, n: int, novel_first: int):
    """(batch, pairs, novel) for one random row of n tokens read by the target; pairs 0..novel_first-1 novel."""
    ids = torch.randint(2, target.vocab_size, (n,)).tolist()
    with torch.no_grad():
        hidden = target.decoder(input_ids=torch.tensor([ids])).last_hidden_state[0]
    batch = collate([item(ids, hidden)], max_len=n, pack=False)
    pairs = make_pairs(batch, target.embed_tokens.weight)
    novel = torch.zeros_like(pairs.weight)
    novel[0, :novel_first] = True
    return batch, pairs, novel


def test_agreement_splits_top1_into_novel_tokens(target):
    _, pairs, novel = one_row_pairs(target, 10, novel_first=3)         # pairs 0-2 novel, the rest copyable
    weight = target.lm_head.weight
    wrong_after_3 = pairs.target.clone()
    wrong_after_3[:, 3:] = -wrong_after_3[:, 3:]
    stats = agreement([wrong_after_3], pairs, weight, weight, None, novel)
    assert stats["novel"] == 3 and stats["top1_novel"] == 3
    stats = agreement([-pairs.target], pairs, weight, weight, None, novel)
    assert stats["novel"] == 3 and stats["top1_novel"] == 0
    assert "novel" not in agreement([pairs.target], pairs, weight, weight, None)


def test_copy_weight_scales_the_loss_of_lookup_copyable_tokens(target):
    _, pairs, novel = one_row_pairs(target, 12, novel_first=4)
    weight = target.lm_head.weight
    pred = [pairs.target + 0.3 * torch.randn_like(pairs.target)]
    plain = objective(pred, pairs, weight, ObjectiveConfig())
    assert torch.allclose(objective(pred, pairs, weight, ObjectiveConfig(copy_weight=1.0), novel)["loss"],
                          plain["loss"])
    only_novel = objective(pred, pairs, weight, ObjectiveConfig(copy_weight=0.0), novel)
    expected = objective(pred, dataclasses.replace(pairs, weight=pairs.weight & novel), weight, ObjectiveConfig())
    assert (torch.allclose(only_novel["loss"], expected["loss"])
            and not torch.allclose(only_novel["loss"], plain["loss"]))
    with pytest.raises(ValueError, match="copy_weight"):
        objective(pred, pairs, weight, ObjectiveConfig(copy_weight=0.5))
    with pytest.raises(ValueError, match="copy_weight"):
        ObjectiveConfig(copy_weight=-1)


# -- configs and the CLI ----------------------------------------------------------------------------
def test_every_experiment_debug_and_trainer_config_composes():
    from trainers.datamodule import LoaderConfig
    from trainers.distill import DistillConfig
    from trainers.medusa_objective import MedusaObjectiveConfig
    from trainers.module import OptimConfig
    from trainers.objective import ObjectiveConfig
    from trainers.train import _typed

    experiments = sorted(p.stem for p in (CONF / "experiment").glob("*.yaml"))
    assert {"default", "full_vocab", "ttt"} <= set(experiments)
    expected = {"default": (1, 8192), "ttt": (3, 8192), "full_vocab": (1, None)}
    for name in experiments:
        for extra in ([], ["target=tiny", "data=tiny"]):
            cfg = train_config(f"experiment={name}", *extra)
            assert cfg.name == name and cfg.paths.output.endswith(f"/{name}")
            if name in expected:
                assert (cfg.draft.objective.ttt_steps, cfg.draft.vocab_size) == expected[name]
            objective_cls = MedusaObjectiveConfig if cfg.draft.get("kind") == "medusa" else ObjectiveConfig
            for cls, node in ((TargetConfig, cfg.target), (DistillConfig, cfg.data.distill),
                              (FeatureConfig, cfg.data.features), (LoaderConfig, cfg.data.loader),
                              (objective_cls, cfg.draft.objective), (OptimConfig, cfg.draft.optim)):
                _typed(cls, node)  # every key is a dataclass field
            OmegaConf.to_yaml(cfg, resolve=True)  # every interpolation resolves
    assert train_config("debug=fdr").trainer.fast_dev_run is True
    assert train_config("debug=overfit").trainer.overfit_batches == 2
    assert train_config("debug=limit").trainer.limit_train_batches == 10
    assert train_config("trainer=ddp").trainer.strategy.broadcast_buffers is False
    assert train_config("trainer=gpu").trainer.accelerator == "gpu"
    with pytest.raises(ValueError, match="ttt_steps must be >= 1"):
        _typed(ObjectiveConfig, train_config("draft.objective.ttt_steps=0").draft.objective)


def test_an_eagle3_head_trains_end_to_end_and_decodes_exactly(tmp_path):
    """draft.feature_layers=auto: the features stage caches the taps, the head trains on them, the exported head
    loads with its layers and decodes the target's own greedy output; a plain head trains on the same cache, a head
    reading other layers is refused."""
    from conftest import eagle_drafter

    from eagle_lite.config import GenerationConfig, TreeConfig
    from eagle_lite.decoding.engine import Engine
    from trainers.features import FeatureCacheMismatch
    from trainers.train import train

    deep = ["target.num_layers=4", "target.name=tiny4"]
    result = train(tiny_train_config(tmp_path, "debug=fdr", "draft.feature_layers=auto", "name=eagle3", *deep))
    cfg = tiny_train_config(tmp_path, *deep)
    taps_cache = FeatureCache(cfg.paths.features)
    assert taps_cache.feature_layers == (0, 1, 2)
    row = taps_cache.index()[0]
    assert taps_cache.read(row["file"], row["start"], row["length"])["taps"].shape == (row["length"], 3 * 64)
    target = tiny_target(TargetConfig(name="tiny4", kind="tiny", num_layers=4))
    head = load_head(result["export"], target)
    assert head.feature_layers == (0, 1, 2)
    prompt = [5, 17, 33, 2, 9, 71]
    ref = reference_greedy(target, prompt, 20)
    out = Engine(target, eagle_drafter(target, head)).generate(
        prompt, GenerationConfig(max_new_tokens=20, stop_at_eos=False,
                                 tree=TreeConfig(depth=3, top_k=3, total_tokens=6)))
    assert out.token_ids == ref
    plain = train(tiny_train_config(tmp_path, "debug=fdr", "name=plain", *deep))  # a plain head reads the same cache
    assert load_head(plain["export"], target).feature_layers == ()
    with pytest.raises(FeatureCacheMismatch, match=r"holds the outputs of decoder layers \[0, 1, 2\], this head reads"):
        train(tiny_train_config(tmp_path, "debug=fdr", "name=other", "draft.feature_layers=[0,2]", *deep))


def test_the_published_eagle3_head_trains_end_to_end_exports_and_decodes_exactly(tmp_path):
    """experiment=eagle3 on an 8-layer tiny target: the cache holds the published taps (outputs of 1, 3, 4), the head
    (own norm and lm_head) trains by the token loss, exports as an EAGLE-3 folder and decodes the target's output."""
    from eagle_lite.config import GenerationConfig, TreeConfig
    from eagle_lite.decoding.engine import Engine
    from eagle_lite.drafters import EagleDrafter
    from eagle_lite.export import export
    from trainers.train import train

    deep = ["target.num_layers=8", "target.name=tiny8"]
    result = train(tiny_train_config(tmp_path, "debug=fdr", "experiment=eagle3", "draft.vocab_size=48", *deep))
    assert (FeatureCache(tiny_train_config(tmp_path, "experiment=eagle3", *deep).paths.features).feature_layers
            == (1, 3, 4))
    target = tiny_target(TargetConfig(name="tiny8", kind="tiny", num_layers=8))
    head = load_head(result["export"], target)
    assert head.design == "eagle3" and head.feature_layers == (1, 3, 4) and head.lm_head.weight.shape[0] == 48
    export(result["export"], "eagle3", tmp_path / "published", target, torch.float32)
    published = load_head(tmp_path / "published", target)
    prompt = [5, 17, 33, 2, 9, 71]
    ref = reference_greedy(target, prompt, 20)
    cfg = GenerationConfig(max_new_tokens=20, stop_at_eos=False, tree=TreeConfig(depth=3, top_k=3, total_tokens=6))
    runs = [Engine(target, EagleDrafter(target, h)).generate(prompt, cfg) for h in (head, published)]
    assert runs[0].token_ids == runs[1].token_ids == ref
    assert runs[0].stats.accept_lengths == runs[1].stats.accept_lengths


def test_an_eagle31_head_normalises_each_tap_as_specforge_does_and_round_trips(tmp_path):
    """fc_norm (EAGLE-3.1): fc reads each tapped layer under its own RMSNorm, exactly as three LlamaRMSNorm modules
    give it; the head saves and loads in its own layout, the published one (fc_norm.{0,1,2}.weight and
    "fc_norm": true, SpecForge's names) and the speculators one (vLLM's) with the same outputs."""
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    from eagle_lite.export import export
    from eagle_lite.heads.checkpoint import save_head

    target = tiny_target(TargetConfig(name="tiny8", kind="tiny", num_layers=8))
    torch.manual_seed(0)
    head = DraftHead.for_target(target, feature_layers=(1, 3, 4), design="eagle3", fc_norm=True).float()
    with torch.no_grad():
        for norm in head.fc_norm:
            norm.weight.uniform_(0.5, 2.0)
    h = target.config.hidden_size
    taps = torch.randn(5, 3 * h) * torch.tensor([0.3, 4.0, 40.0]).repeat_interleave(h)
    embeds = torch.randn(5, h)
    reference = head.fc(torch.cat([norm(c) for norm, c in zip(
        [LlamaRMSNorm(h, eps=head.fc_norm[0].variance_epsilon) for _ in range(3)], taps.chunk(3, -1))], -1)
        * torch.cat([n.weight for n in head.fc_norm]))
    assert torch.equal(head.normed_taps(taps), torch.cat([n(c) for n, c in zip(head.fc_norm, taps.chunk(3, -1))], -1))
    torch.testing.assert_close(head.layer_input(taps, embeds), reference)
    without = DraftHead.for_target(target, feature_layers=(1, 3, 4), design="eagle3").float()
    without.load_state_dict({k: v for k, v in head.state_dict().items() if not k.startswith("fc_norm")})
    assert not torch.allclose(without.layer_input(taps, embeds), head.layer_input(taps, embeds))

    save_head(head, tmp_path / "own", target, dtype=torch.float32)
    export(tmp_path / "own", "eagle3", tmp_path / "published", target, torch.float32)
    config = json.loads((tmp_path / "published" / "config.json").read_text())
    assert config["fc_norm"] is True
    export(tmp_path / "own", "eagle3", tmp_path / "speculators", target, torch.float32, engine="speculators")
    config = json.loads((tmp_path / "speculators" / "config.json").read_text())
    assert config["fc_norm"] is True and "fc_norm" not in config["transformer_layer_config"]
    for folder in ("own", "published", "speculators"):
        back = load_head(tmp_path / folder, target).float()
        assert back.fc_norm is not None
        assert torch.equal(back.layer_input(taps, embeds), head.layer_input(taps, embeds)), folder
    with pytest.raises(ValueError, match="fc_norm .* is an option of design eagle3"):
        DraftHead.for_target(target, fc_norm=True)


def test_an_eagle31_head_feeds_back_its_normalised_output_as_vllm_reads_norm_output(tmp_path):
    """norm_output (EAGLE-3.1, vLLM's meaning): later draft steps read the head's output under its final norm; the
    taps still go through fc. It saves and loads in eagle_lite's layout, exports to the speculators layout with
    "norm_output": true and reads back from it (a norm_before_residual layer is refused there), and the official
    layout, which has no field that says it, is refused."""
    from eagle_lite.export import export
    from eagle_lite.heads.checkpoint import save_head

    target = tiny_target(TargetConfig(name="tiny8", kind="tiny", num_layers=8))
    torch.manual_seed(2)
    head = DraftHead.for_target(target, feature_layers=(1, 3, 4), design="eagle3", norm_output=True).float()
    with torch.no_grad():
        head.norm.weight.uniform_(0.5, 2.0)
    h = target.config.hidden_size
    out, taps, embeds = torch.randn(3, h) * 7.0, torch.randn(3, 3 * h), torch.randn(3, h)
    assert torch.equal(head.layer_input(out, embeds), head.norm(out))
    assert torch.equal(head.layer_input(taps, embeds), head.fc(taps))
    save_head(head, tmp_path / "own", target, dtype=torch.float32)
    back = load_head(tmp_path / "own", target).float()
    assert back.norm_output and torch.equal(back.layer_input(out, embeds), head.layer_input(out, embeds))
    export(tmp_path / "own", "eagle3", tmp_path / "speculators", target, torch.float32, engine="speculators")
    config = json.loads((tmp_path / "speculators" / "config.json").read_text())
    assert config["norm_output"] is True and config["fc_norm"] is False
    back = load_head(tmp_path / "speculators", target).float()
    assert back.norm_output and back.feature_layers == (1, 3, 4)
    assert torch.equal(back.layer_input(out, embeds), head.layer_input(out, embeds))
    config["norm_before_residual"] = True      # the speculators package's other layer: refused, not misread
    (tmp_path / "speculators" / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="norm_before_residual True"):
        load_head(tmp_path / "speculators", target)
    with pytest.raises(ValueError, match="speculators layout"):
        export(tmp_path / "own", "eagle3", tmp_path / "published", target, torch.float32)
    assert not (tmp_path / "published" / "config.json").exists()


def test_fc_norm_added_to_a_trained_eagle3_head_keeps_its_function_at_the_taps_mean_rms():
    """draft.fc_norm=true on a head trained without it (trainers/relayout.py `with_fc_norm`): each norm starts at its
    tap's mean RMS, so a token whose taps have exactly those RMS values reaches fc as before; others move."""
    from trainers.relayout import tap_rms, with_fc_norm

    target = tiny_target(TargetConfig(name="tiny8", kind="tiny", num_layers=8))
    torch.manual_seed(1)
    head = DraftHead.for_target(target, feature_layers=(1, 3, 4), design="eagle3").float()
    h = target.config.hidden_size
    sample = torch.randn(64, 3 * h) * torch.tensor([0.5, 3.0, 20.0]).repeat_interleave(h)
    rms = tap_rms(sample, 3)
    torch.testing.assert_close(rms, sample.unflatten(-1, (3, h)).pow(2).mean(-1).sqrt().mean(0))
    normed = with_fc_norm(head, target, rms)
    assert normed.fc_norm is not None and torch.equal(normed.fc.weight, head.fc.weight)
    unit = torch.randn(4, 3, h)
    at_mean = (unit / unit.pow(2).mean(-1, keepdim=True).sqrt() * rms[None, :, None]).flatten(-2)
    embeds = torch.randn(4, h)
    torch.testing.assert_close(normed.layer_input(at_mean, embeds), head.layer_input(at_mean, embeds),
                               rtol=1e-4, atol=1e-4)
    off = at_mean * 3.0
    assert not torch.allclose(normed.layer_input(off, embeds), head.layer_input(off, embeds), rtol=1e-3, atol=1e-3)
    with pytest.raises(ValueError, match="applies to design eagle3"):
        with_fc_norm(DraftHead.for_target(target), target, rms)


def test_an_eagle31_fine_tune_trains_exports_and_decodes_exactly(tmp_path):
    """experiment=eagle3 fine-tuned with draft.fc_norm=true and draft.norm_output=true from a head without them: the run
    adds the norms, fits, exports, and the head drafts for an engine whose output is the target's own greedy output
    (its later draft steps reading the normalised output); draft.fc_norm=false
    from it then is refused in one line, and a new EAGLE-1 head is refused fc_norm before any stage runs."""
    from eagle_lite.config import GenerationConfig, TreeConfig
    from eagle_lite.decoding.engine import Engine
    from eagle_lite.drafters import EagleDrafter
    from trainers.train import check_draft_settings, train

    deep = ["target.num_layers=8", "target.name=tiny8"]
    first = train(tiny_train_config(tmp_path, "debug=fdr", "experiment=eagle3", "draft.vocab_size=48", *deep))
    result = train(tiny_train_config(tmp_path, "debug=fdr", "experiment=eagle3", "name=eagle31", *deep,
                                     f"draft.init_from={first['export']}", "draft.fc_norm=true",
                                     "draft.norm_output=true"))
    target = tiny_target(TargetConfig(name="tiny8", kind="tiny", num_layers=8))
    head = load_head(result["export"], target)
    assert head.fc_norm is not None and head.norm_output and head.lm_head.weight.shape[0] == 48
    assert read_head_config(result["export"])["fc_norm"] is True
    prompt = [5, 17, 33, 2, 9, 71]
    ref = reference_greedy(target, prompt, 20)
    cfg = GenerationConfig(max_new_tokens=20, stop_at_eos=False, tree=TreeConfig(depth=3, top_k=3, total_tokens=6))
    assert Engine(target, EagleDrafter(target, head)).generate(prompt, cfg).token_ids == ref
    with pytest.raises(ValueError, match="draft.fc_norm=false"):
        train(tiny_train_config(tmp_path, "debug=fdr", "experiment=eagle3", "name=back", *deep,
                                f"draft.init_from={result['export']}", "draft.fc_norm=false"))
    with pytest.raises(ValueError, match="is an option of EAGLE-3 heads"):
        check_draft_settings(tiny_train_config(tmp_path, "draft.fc_norm=true"))


def test_an_eagle3_head_refuses_a_feature_regression_loss():
    from eagle_lite.heads.draft import DraftHead
    from trainers.module import DraftLightningModule
    from trainers.objective import ObjectiveConfig

    target = tiny_target(TargetConfig(name="tiny8", kind="tiny", num_layers=8))
    head = DraftHead.for_target(target, feature_layers=(1, 3, 4), design="eagle3")
    with pytest.raises(ValueError, match="w_reg must be 0"):
        DraftLightningModule(head, target.lm_head.weight, target.embed_tokens.weight, ObjectiveConfig(w_reg=1.0))


def test_cli_answers_help():
    out = subprocess.run([sys.executable, "-m", "trainers.train", "--help"], cwd=ROOT, capture_output=True,
                         text=True, timeout=120, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert out.returncode == 0, out.stderr
    for group in ("experiment:", "target:", "trainer:", "debug:"):
        assert group in out.stdout


# -- fit, resume, export ----------------------------------------------------------------------------
@pytest.mark.parametrize("experiment, extra", [("default", ["draft.vocab_size=32"]), ("ttt", []),
                                               ("full_vocab", [])])
def test_fast_dev_run_exports_a_head_that_loads(runs, target, experiment, extra):
    from trainers.train import train

    cfg = tiny_train_config(runs, "debug=fdr", f"experiment={experiment}", *extra)
    result = train(cfg)
    assert result["global_step"] == 1 and 0.0 <= result["val/top1"] <= 1.0
    assert 1.0 <= result["val/accept_len_est"] <= cfg.draft.objective.val_depth + 1
    export = Path(result["export"])
    head = load_head(export, target)
    assert json.loads((export / "config.json").read_text())["target"] == target.fingerprint()
    # the tiny target's 128 tokens are fewer than ttt's 8192: the head keeps the whole vocabulary
    assert head.draft_vocab_size == (32 if experiment == "default" else None)
    assert OmegaConf.load(export / "train_config.yaml").name == experiment
    assert json.loads((export / "train_log.json").read_text())["summary"]["global_step"] == 1
    assert not (Path(cfg.paths.output) / "checkpoints").exists()  # fast_dev_run writes no checkpoints
    with pytest.raises(HeadMismatchError, match="trained for target"):
        load_head(export, tiny_target(TargetConfig(name="tiny", kind="tiny", seed=1)))


def test_loss_falls_when_overfitting_a_tiny_cache(runs):
    from trainers.train import train

    result = train(tiny_train_config(runs, "debug=overfit", "trainer.max_epochs=20"))
    first, last = result["epochs_log"][0], result["epochs_log"][-1]
    assert len(result["epochs_log"]) == 20 and last["step"] == 40
    # the soft-label cross-entropy can only fall to the target's own entropy; the regression to 0
    assert last["train/loss_reg"] < 0.5 * first["train/loss_reg"], result["epochs_log"]
    assert last["train/loss"] < 0.8 * first["train/loss"]
    assert last["train/top1"] > first["train/top1"] + 0.2


@pytest.mark.parametrize("design", ["eagle", "eagle3"])
def test_an_eagle3_heads_token_loss_falls_when_overfitting(tmp_path, design):
    """EAGLE-3's objective (token loss only, 3 unrolled steps) on the taps of a 4-layer tiny target, for the fused
    variant (design eagle) and the published head (design eagle3: its own norm and lm_head)."""
    from trainers.train import train

    result = train(tiny_train_config(tmp_path, "debug=overfit", "trainer.max_epochs=20", "target.num_layers=4",
                                     "target.name=tiny4", "draft.feature_layers=[0,1,2]", f"draft.design={design}",
                                     "draft.objective.w_reg=0",
                                     "draft.objective.w_cls=1", "draft.objective.ttt_steps=3"))
    first, last = result["epochs_log"][0], result["epochs_log"][-1]
    # the soft-label cross-entropy (3 steps, decay-weighted) can only fall to the target's own entropy
    assert last["train/loss_cls"] < 0.95 * first["train/loss_cls"], result["epochs_log"]
    assert last["train/top1"] > first["train/top1"] + 0.2


def test_interrupted_training_resumes_from_its_checkpoint(runs, monkeypatch):
    from trainers.module import DraftLightningModule
    from trainers.train import train

    overrides = ("name=resume", "trainer.max_steps=6", "checkpoint.every_n_train_steps=2",
                 "data.loader.batch_size=2", "trainer.num_sanity_val_steps=0", "trainer.limit_val_batches=1")
    step = DraftLightningModule.training_step

    def crash_at_step_3(self, batch, batch_idx):
        if self.global_step == 3:
            raise RuntimeError("simulated crash")
        return step(self, batch, batch_idx)

    monkeypatch.setattr(DraftLightningModule, "training_step", crash_at_step_3)
    with pytest.raises(RuntimeError, match="simulated crash"):
        train(tiny_train_config(runs, *overrides))
    cfg = tiny_train_config(runs, *overrides)
    assert (Path(cfg.paths.output) / "checkpoints" / "last.ckpt").is_file()
    monkeypatch.setattr(DraftLightningModule, "training_step", step)
    result = train(cfg)
    assert result["resumed_from_step"] == 3  # continued where the crash stopped it, not from 0
    assert result["global_step"] == 6
    assert train(cfg)["resumed_from_step"] == 6  # a finished run reruns as a no-op


@pytest.mark.parametrize("crash_at, in_validation", [(3, False), (23, False), (21, True)])
def test_a_resumed_run_trains_on_the_batches_an_uninterrupted_run_does(runs, monkeypatch, crash_at, in_validation):
    """Not a replay of the epoch's first batches: the data order goes on where the checkpoint left it (a crash
    part way into epoch 1 or 2, and one in the validation after epoch 1's last batch; 21 batches an epoch)."""
    from trainers.module import DraftLightningModule
    from trainers.train import train

    overrides = ("trainer.max_steps=26", "checkpoint.every_n_train_steps=2", "data.loader.batch_size=2",
                 "estimate=false",   # its probe's training step would be recorded too
                 "trainer.num_sanity_val_steps=0", "trainer.limit_val_batches=1", "trainer.val_check_interval=1.0")
    step, check = DraftLightningModule.training_step, DraftLightningModule.validation_step
    seen: list[tuple] = []

    def crash(self):
        if self.global_step == crash_at and getattr(self, "crash", False):
            raise RuntimeError("simulated crash")

    def recording(self, batch, batch_idx):
        if not in_validation:
            crash(self)
        seen.append((self.current_epoch, batch_idx, tuple(batch["input_ids"][:, :8].flatten().tolist())))
        return step(self, batch, batch_idx)

    def validating(self, batch, batch_idx):
        if in_validation:
            crash(self)
        return check(self, batch, batch_idx)

    monkeypatch.setattr(DraftLightningModule, "training_step", recording)
    monkeypatch.setattr(DraftLightningModule, "validation_step", validating)
    train(tiny_train_config(runs, f"name=order_ref_{crash_at}_{in_validation}", *overrides))
    reference, seen[:] = list(seen), []
    name = f"name=order_{crash_at}_{in_validation}"
    monkeypatch.setattr(DraftLightningModule, "crash", True, raising=False)
    with pytest.raises(RuntimeError, match="simulated crash"):
        train(tiny_train_config(runs, name, *overrides))
    monkeypatch.setattr(DraftLightningModule, "crash", False, raising=False)
    assert train(tiny_train_config(runs, name, *overrides))["resumed_from_step"] == crash_at
    first = [b for epoch, _, b in reference if epoch == 0]
    assert len(reference) == 26 and len(first) == len(set(first)) == 21  # an epoch trains on each batch once
    assert seen == reference


# -- the reduced vocabulary -------------------------------------------------------------------------
def test_reduced_vocab_keeps_the_most_frequent_answer_tokens(target, tmp_path):
    # Answers (loss-masked) use 5 most, then 6, then 7; token 9 is frequent but only in prompts.
    records = [{"id": f"v{i}", "input_ids": [9] * 6 + [5, 5, 5, 6, 6, 7, 3 + i % 2], "spans": [[6, 13]]}
               for i in range(8)]
    cache_features(target, records, tmp_path, FeatureConfig(max_len=32, shard_size=3), progress=False)
    cache = FeatureCache(tmp_path)
    counts = count_tokens([cache], joint_index([cache]), target.vocab_size)
    assert counts[5] == 24 and counts[6] == 16 and counts[7] == 8 and counts[9] == 0
    d2t = build_d2t(counts, 4, always={1})
    assert d2t.tolist() == [1, 5, 6, 7]
    assert build_d2t(counts, 6, always={1}).tolist() == [1, 3, 4, 5, 6, 7]
    with pytest.raises(ValueError, match="draft.vocab_size=500 must be in"):
        build_d2t(counts, 500)


def test_loader_config_rejects_a_bad_value():
    with pytest.raises(ValueError, match="val_percent must be in"):
        LoaderConfig(val_percent=0)


def test_data_only_prepares_the_cache_and_fits_nothing(tmp_path):
    from trainers.features import FeatureCache
    from trainers.train import train

    cfg = tiny_train_config(tmp_path, "debug=fdr", "data_only=true")
    result = train(cfg)
    assert "export" not in result and result["tokens"] > 0
    assert FeatureCache(cfg.paths.features).index() is not None
    assert not Path(cfg.paths.output, "checkpoints").exists() and not Path(cfg.paths.export).exists()


def test_stop_after_distill_answers_the_prompts_and_caches_nothing(tmp_path):
    from trainers.distill import read_records
    from trainers.train import train

    cfg = tiny_train_config(tmp_path, "debug=fdr", "stop_after=distill")
    result = train(cfg)
    assert result["stage"] == "distill" and result["sequences"] == len(list(read_records(cfg.paths.distill))) > 0
    written = sum(end - start for r in read_records(cfg.paths.distill) for start, end in r["spans"])
    assert result["new_tokens"] == written > 0 and result["new_tokens_per_s"] > 0
    assert train(cfg)["new_tokens"] == 0  # resumed: nothing left to answer
    assert not Path(cfg.paths.features).exists() and not Path(cfg.paths.output, "checkpoints").exists()
    with pytest.raises(ValueError, match="stop_after must be distill, features or null"):
        train(tiny_train_config(tmp_path, "debug=fdr", "stop_after=fit"))


def test_init_from_fine_tunes_an_exported_head_with_its_draft_vocabulary(runs, target, caplog):
    from trainers.train import build_module, train

    source = Path(train(tiny_train_config(runs, "debug=fdr", "name=warm_source", "draft.vocab_size=32"))["export"])
    exported = load_head(source, target)
    cfg = tiny_train_config(runs, "debug=fdr", "name=warm", "draft.vocab_size=64", f"draft.init_from={source}")
    with caplog.at_level("WARNING", logger="trainers.train"):
        module = build_module(cfg, target, data=None)  # the draft vocabulary is not re-chosen from the data
    assert "draft.vocab_size=64 is ignored" in caplog.text
    assert module.head.d2t.tolist() == exported.d2t.tolist() and module.head.tree is None
    start = module.head.state_dict()
    for name, tensor in exported.state_dict().items():
        assert torch.equal(start[name], tensor.float()), name
    result = train(cfg)  # one fast_dev_run step on top of the exported weights
    assert load_head(result["export"], target).draft_vocab_size == 32
    lineage = read_head_config(result["export"])["training"]["init_from"]  # what it started from, and its training
    assert lineage["path"] == str(source) and lineage["experiment"] == "warm_source"
    other = tiny_target(TargetConfig(name="tiny", kind="tiny", seed=1))
    with pytest.raises(HeadMismatchError, match="trained for target"):
        build_module(cfg, other, data=None)


def test_a_pretrained_training_target_reads_through_plain_sdpa(tiny_model_dir):
    # Training never verifies a tree; 'auto' would pick gqa on CPU and a per-shape-compiled flex on CUDA.
    from trainers.targets import build_target

    target = build_target(TargetConfig(name="chat", kind="pretrained", spec=str(tiny_model_dir)))
    assert target.model.config._attn_implementation == "sdpa"


def test_validate_scores_exported_heads_as_training_did(runs, target, tmp_path, capsys):
    from eagle_lite.heads.checkpoint import save_head
    from trainers.train import train
    from trainers.validate import main, validate_heads

    cfg = tiny_train_config(runs, "name=validated", "trainer.max_epochs=20", "draft.optim.lr=3e-3")
    result = train(cfg)
    random_head = tmp_path / "random"
    torch.manual_seed(0)
    save_head(DraftHead.for_target(target), random_head, target)
    rows = validate_heads(target, [result["export"], random_head], [cfg.paths.features],
                          batch_size=cfg.data.loader.batch_size, val_percent=cfg.data.loader.val_percent)
    trained, untrained = rows
    assert trained["sequences"] == untrained["sequences"] > 0
    # the same held-out rows and metrics as the training run's last validation
    for key in ("val/top1", "val/top1_novel", "val/top3", "val/accept_len_est"):
        assert trained[key] == pytest.approx(result[key], abs=1e-4), key
    assert trained["val/top1"] > untrained["val/top1"] + 0.1
    with pytest.raises(SystemExit):
        main(["--help"])
    assert "--features" in capsys.readouterr().out


# -- a user's mistake is one line ---------------------------------------------------------------------------------
def test_train_refuses_zero_threads_in_one_line(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "trainers.train", "target=tiny", "data=tiny", f"paths.root={tmp_path}",
                           "target.threads=0"], cwd=ROOT, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert proc.returncode == 1 and "Traceback" not in proc.stderr
    [line] = proc.stderr.strip().splitlines()     # not Hydra's "Error executing job with overrides: [...]" too
    assert line.startswith("error: target.threads must be a whole number >= 1")
    with pytest.raises(ValueError, match="target.threads must be"):
        TargetConfig(kind="tiny", threads=-2)


@pytest.mark.parametrize("args, message, status", [   # 2: a flag wrong in itself; 1: what it names is not there
    (["{head}", "--features", "{nowhere}", "--threads", "0"], "--threads must be a whole number >= 1", 2),
    (["{nowhere}", "--features", "{nowhere}"], "no draft head at", 1),
    (["{head}", "--features", "{nowhere}"], "no feature cache at", 1),
    (["{head}", "--features", "{nowhere}", "--batch-size", "0"], "--batch-size must be >= 1", 2),
])
def test_validate_checks_its_inputs_before_loading_the_target(args, message, status, tmp_path, capsys, monkeypatch):
    import trainers.targets
    from trainers.validate import main

    def refuse(*a, **k):
        raise AssertionError("the target was loaded before the inputs were checked")

    monkeypatch.setattr(trainers.targets, "build_target", refuse)
    head = ROOT / "eagle_lite" / "heads" / "smollm2"
    assert main([a.format(head=head, nowhere=tmp_path / "nowhere") for a in args]) == status
    err = capsys.readouterr().err
    assert err.startswith("error: ") and message in err and len(err.strip().splitlines()) == 1


def test_a_question_file_and_a_mix_train_with_validation_by_kind_early_stopping_and_a_curve(tmp_path, tiny_model_dir):
    """experiment=gpu_eagle3_all's pieces on a tiny chat model: a seed-style question file (kinds in the ids) as the
    main source beside a synthetic mix source; validation reports each kind; early stopping exports the best epoch,
    and the export holds training_curve.png."""
    from trainers.train import train

    questions = tmp_path / "q.jsonl"
    lines = [{"question_id": f"{kind}:{i:03d}", "category": kind,
              "turns": [f"{kind} {i}?"] + ([f"and {i}?"] if i % 3 == 0 else [])}
             for kind in ("qa", "math") for i in range(40)]
    questions.write_text("".join(json.dumps(line) + "\n" for line in lines))
    cfg = tiny_train_config(
        tmp_path, "target.kind=pretrained", f"target.spec={tiny_model_dir}", "target.name=chat",
        "data.distill.source=prompts", f"data.distill.prompts={questions}", "++data.distill.multi_turn=true",
        "++data.distill.max_turns=2", "++data.distill.max_prompt_tokens=60", "data.distill.max_new_tokens=12",
        "data.distill.limit=1000", "+data.mix.syn.distill.source=synthetic", "+data.mix.syn.distill.limit=16",
        "+data.mix.syn.distill.prompts=null", "+data.mix.syn.distill.multi_turn=false",
        "data.loader.val_percent=25", "trainer.max_epochs=12", "trainer.limit_train_batches=2",
        "draft.optim.lr=3e-2", "draft.optim.warmup_steps=1",
        "early_stopping={monitor: val/accept_len_est, mode: max, patience: 1, min_delta: 0.5}")
    result = train(cfg)
    epochs, export = result["epochs_log"], Path(result["export"])
    assert len(epochs) < 12 and result["best_epoch"] < len(epochs)         # stopped early; the best epoch exported
    best = next(row for row in epochs if row["epoch"] == result["best_epoch"])
    assert result["val/accept_len_est"] == best["val/accept_len_est"] == max(r["val/accept_len_est"] for r in epochs)
    for kind in ("qa", "math", "syn"):
        assert 0.0 <= best[f"val_kind/{kind}/top1"] <= 1.0 and best[f"val_kind/{kind}/accept_len_est"] >= 1.0
    assert (export / "training_curve.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "Validation by kind" in (export / "train_log.md").read_text()
    log = json.loads((export / "train_log.json").read_text())
    assert log["summary"]["best_epoch"] == result["best_epoch"] and len(log["epochs"]) == len(epochs)
    ckpt = torch.load(Path(cfg.paths.output) / "checkpoints" / "best.ckpt", weights_only=True, map_location="cpu")
    chat = build_chat_target(tiny_model_dir)
    head = load_head(export, chat)
    for name, tensor in head.state_dict().items():   # the exported weights are the best checkpoint's
        torch.testing.assert_close(tensor.float(), ckpt["state_dict"][f"head.{name}"].float(), atol=1e-2, rtol=1e-2)
    from trainers.validate import table, validate_heads

    # each kind scored as training scored it (up to the export's bf16 weights)
    (row,) = validate_heads(chat, [export], [cfg.paths.features, Path(cfg.paths.data) / "syn" / "features"],
                            batch_size=cfg.data.loader.batch_size, val_percent=25)
    assert set(row["kinds"]) == {"qa", "math", "syn"}
    assert abs(row["kinds"]["qa"]["accept_len_est"] - best["val_kind/qa/accept_len_est"]) < 0.3
    assert "per kind" in table([row])


def build_chat_target(folder):
    from trainers.targets import build_target

    return build_target(TargetConfig(name="chat", kind="pretrained", spec=str(folder)))


def test_early_stopping_settings_are_checked():
    from trainers.train import early_stop_of

    assert early_stop_of(train_config()) is None
    assert early_stop_of(train_config("experiment=gpu_eagle3_all")).patience == 3
    assert early_stop_of(train_config("experiment=gpu_eagle3_all", "debug=fdr")) is None   # one batch: nothing to stop
    with pytest.raises(ValueError, match="unknown keys"):
        early_stop_of(train_config("early_stopping={monitor: val/loss, wait: 2}"))
    with pytest.raises(ValueError, match="mode max or min"):
        early_stop_of(train_config("early_stopping={monitor: val/loss, mode: lower}"))
    with pytest.raises(ValueError, match="early_stopping must be null or a mapping"):
        early_stop_of(train_config("early_stopping=5"))
    with pytest.raises(ValueError, match="early_stopping.monitor must be a validation metric"):
        early_stop_of(train_config("early_stopping={monitor: val_loss}"))


@pytest.mark.parametrize("override, message", [
    ("data.loader.batch_size=0", "data.loader.batch_size must be >= 1"),
    ("data.distill.limit=-1", "data.distill.limit must be >= 1"),
    ("data.features.shard_size=0", "data.features.shard_size must be >= 1"),
    ("early_stopping=5", "early_stopping must be null or a mapping"),
    ("target.threads=0", "target.threads must be a whole number >= 1"),
])
def test_every_stages_settings_are_checked_before_the_first_stage_runs(override, message, tmp_path):
    from trainers.train import train

    with pytest.raises(ValueError, match=message):
        train(tiny_train_config(tmp_path, override))
    assert not (tmp_path / "data").exists()     # nothing distilled before the refusal


def test_gpu_eagle3_all_composes_its_three_sources():
    """One GPU: every ShareGPT training prompt, multi-turn conversations after the first answer, the seed kinds."""
    from trainers.distill import DistillConfig, prompts_path
    from trainers.train import _typed, data_sources, group_names

    cfg = train_config("experiment=gpu_eagle3_all")
    sources = data_sources(cfg)
    assert group_names(cfg, sources) == ["sharegpt", "multi", "seed"]
    main, multi, seed = (_typed(DistillConfig, s.settings) for s in sources)
    assert (main.limit, main.source, main.multi_turn) == (100000, "sharegpt", False)
    assert (multi.min_user_turns, multi.loss_from_turn, multi.multi_turn) == (2, 1, True)
    assert (main.start_from, multi.start_from, seed.start_from) == tuple(  # each its own committed answers
        f"data/distill/smollm2-sharegpt_all{suffix}" for suffix in ("", "-multi", "-seed"))
    assert seed.source == "prompts" and prompts_path(seed.prompts).is_file()
    assert all(s.features.endswith("features_eagle3") for s in sources) and cfg.draft.design == "eagle3"
    assert cfg.early_stopping.monitor == "val/accept_len_est" and cfg.trainer.accelerator == "gpu"


def test_cpu_head_composes_the_served_layout_on_complete_caches_only():
    """The CPU recipe: its fit reads the caches experiment=cpu_data computes, null mix entries left out."""
    from trainers.train import data_sources, group_names

    cfg = train_config("experiment=cpu_head")
    assert (cfg.draft.fc_bias, cfg.draft.input_norm, cfg.draft.design) == (False, False, "eagle")
    assert group_names(cfg, data_sources(cfg)) == ["sharegpt", "text1", "seed"]
    assert group_names(cfg, data_sources(train_config("experiment=cpu_head", "data.mix.text1=null",
                                                      "data.mix.seed=null"))) == ["sharegpt"]
    data = train_config("experiment=cpu_data")
    sources = data_sources(data)
    assert [s.features for s in sources if s.name in ("main", "text1", "seed")] == [
        s.features for s in data_sources(cfg)]
    assert group_names(data, sources) == ["sharegpt", "text1", "text2", "text3", "text4", "seed", "seed2"]
    seed = data_sources(train_config("experiment=cpu_seed"))   # stage 0: the answers, no text caches
    assert [s.name for s in seed] == ["main", "seed"]
    assert seed[1].settings["start_from"] == "data/distill/smollm2-sharegpt_all-seed"
    assert seed[1].settings["source"] == "prompts"
    seed2 = data_sources(train_config("experiment=cpu_seed2"))   # the second seed set's answers
    assert [s.name for s in seed2] == ["main", "seed2"]
    assert seed2[1].settings["start_from"] == "data/distill/smollm2-sharegpt_all-seed2"
    assert seed2[1].settings["prompts"] == "data/prompts/seed_kinds2.jsonl"


def test_revocab_rechooses_the_draft_vocabulary_keeping_the_rows_it_had():
    from trainers.vocab import with_draft_vocab

    target = tiny_target(TargetConfig(name="tiny4", kind="tiny", num_layers=4))
    torch.manual_seed(0)
    head = DraftHead.for_target(target, torch.tensor([0, 1, 2, 3, 5, 8]), feature_layers=(0, 1, 2), design="eagle3")
    old = dict(zip(head.d2t.tolist(), head.lm_head.weight.detach().clone()))
    new_vocab = torch.tensor([1, 2, 4, 8, 9])
    head, added = with_draft_vocab(head, new_vocab, target.lm_head.weight)
    assert added == 2 and head.d2t.tolist() == [1, 2, 4, 8, 9] and head.draft_vocab_size == 5
    assert head.lm_head.weight.shape == (5, target.config.hidden_size)
    for row, token in zip(head.lm_head.weight, new_vocab.tolist()):
        want = old[token] if token in old else target.lm_head.weight[token].float()
        assert torch.equal(row.detach(), want), token
    plain = DraftHead.for_target(target, torch.tensor([0, 1, 2]))     # scores through the target's lm_head
    plain, added = with_draft_vocab(plain, torch.tensor([0, 2, 7, 9]), target.lm_head.weight)
    assert added == 2 and plain.d2t.tolist() == [0, 2, 7, 9] and plain.lm_head is None


def test_a_fine_tune_with_revocab_drafts_over_its_new_vocabulary_and_decodes_exactly(tmp_path, caplog):
    from conftest import eagle_drafter

    from eagle_lite.config import GenerationConfig, TreeConfig
    from eagle_lite.decoding.engine import Engine
    from trainers.train import train

    deep = ["target.num_layers=4", "target.name=tiny4", "draft.objective.w_reg=0"]
    source = train(tiny_train_config(tmp_path, "debug=fdr", "draft.design=eagle3", "draft.feature_layers=[0,1,2]",
                                     "draft.vocab_size=32", "name=source", *deep))["export"]
    with caplog.at_level("INFO", logger="trainers.train"):
        result = train(tiny_train_config(tmp_path, "debug=fdr", f"draft.init_from={source}", "draft.revocab=true",
                                         "draft.vocab_size=48", "name=revocab", *deep))
    assert "draft.revocab:" in caplog.text and "draft tokens are new" in caplog.text
    target = tiny_target(TargetConfig(name="tiny4", kind="tiny", num_layers=4))
    head = load_head(result["export"], target)
    assert head.draft_vocab_size == 48 and head.lm_head.weight.shape[0] == 48
    prompt = [5, 17, 33, 2, 9, 71]
    ref = reference_greedy(target, prompt, 20)
    out = Engine(target, eagle_drafter(target, head)).generate(
        prompt, GenerationConfig(max_new_tokens=20, stop_at_eos=False, tree=TreeConfig(depth=3, top_k=1,
                                                                                       total_tokens=3)))
    assert out.token_ids == ref
    with pytest.raises(ValueError, match="draft.revocab re-chooses the draft vocabulary of the head draft.init_from"):
        train(tiny_train_config(tmp_path, "debug=fdr", "draft.revocab=true", "name=nothing", *deep))


@pytest.mark.parametrize("setting, message", [
    ("draft.objective.lk_weight=1.5", "lk_weight"),
    ("draft.objective.label_top_k=-1", "label_top_k"),
    ("draft.revocab=true", "draft.revocab re-chooses"),
])
def test_fitting_settings_are_refused_before_any_data_stage(tmp_path, setting, message):
    from trainers.train import train

    cfg = tiny_train_config(tmp_path, "debug=fdr", setting)
    with pytest.raises(ValueError, match=message):
        train(cfg)
    assert not Path(cfg.paths.distill).exists() and not Path(cfg.paths.features).exists()   # nothing was answered


def test_the_distill_line_counts_answers_and_skipped_prompts_apart_from_what_the_call_went_through():
    from trainers.distill import DistillSummary, summary_line

    line = summary_line(DistillSummary(Path("d"), records=187, skipped=69, generated=256, tokens=61234))
    assert line == ("187 answers (61234 tokens) in d, 69 prompts skipped (too long or empty); "
                    "this call went through 256 prompts")
    assert summary_line(DistillSummary(Path("d"), records=1, tokens=9)) == "1 answer (9 tokens) in d"
