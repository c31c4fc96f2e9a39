"""Exporting a head to an engine that cannot build part of it: never silently approximated.

formats/fidelity.py says per engine what it runs of an EAGLE-1/2 head; the export states what differs with a
measured first-token agreement, and refuses a folder some engine would draft worse from (by more than
AGREEMENT_MARGIN) unless --allow-lossy. A head
without an fc bias exports exactly; a head with one whose layer normalizes its input exports exactly to vLLM too,
through the vLLM layout (the bias on the identity layer 0's o_proj, which vLLM builds with attention_bias).
"""
from __future__ import annotations

import json

import pytest
import torch
from conftest import make_target
from interop_reference import eagle1_forward
from safetensors.torch import load_file
from test_interop import assert_same_tensors, head_out, tokens_and_hidden, trained_like

from eagle_lite import export as export_module
from eagle_lite.export import AGREEMENT_MARGIN, LossyExport, export
from eagle_lite.formats import load_head
from eagle_lite.formats.fidelity import (
    View,
    engine_view,
    first_token_agreement,
    first_token_drafts,
    reference_sequences,
)
from eagle_lite.heads.checkpoint import save_head
from eagle_lite.heads.draft import DraftHead


@pytest.fixture(scope="module")
def llama():
    return make_target("llama")


def saved(target, tmp_path, name, fc_bias=True, input_norm=True, d2t=None, seed=0):
    torch.manual_seed(seed)
    head = trained_like(DraftHead.for_target(target, d2t, fc_bias=fc_bias, input_norm=input_norm))
    if fc_bias:
        with torch.no_grad():
            head.fc.bias.copy_(torch.randn(head.fc.bias.shape) * 2.0)     # a bias that changes the drafts
    save_head(head, tmp_path / name, target, dtype=torch.float32)
    return head, tmp_path / name


def drafting_bias(target, tmp_path, name):
    """A head whose fc bias carries its drafts: the bias points at the target's commonest continuation token, so
    the head's first drafted token agrees with the target far more often with the bias than without it."""
    head, path = saved(target, tmp_path, name)
    tokens = torch.cat([ids[prompt:] for ids, prompt in reference_sequences(target)])
    with torch.no_grad():
        head.fc.bias.copy_(4 * target.lm_head.weight[tokens.mode().values])
    save_head(head, path, target, dtype=torch.float32)
    return head, path


def test_a_head_that_drafts_worse_without_its_fc_bias_is_refused_for_vllm_with_the_measured_loss(llama, tmp_path):
    head, path = drafting_bias(llama, tmp_path, "biased")
    with pytest.raises(LossyExport) as err:
        export(path, "eagle", tmp_path / "out", llama, torch.float32)
    message = str(err.value)
    assert message.startswith("vLLM builds fc without its bias (norm ")
    assert "its first drafted token is the target's on " in message and "% of " in message
    drop = float(message.split(" points below")[0].rsplit(" ", 1)[1])
    assert drop > 100 * AGREEMENT_MARGIN and f"more than the {100 * AGREEMENT_MARGIN:g} the export allows" in message
    assert "--engine official writes it exactly" in message and "--allow-lossy" in message
    assert not (tmp_path / "out").exists()                                  # nothing written
    notes = export(path, "eagle", tmp_path / "out", llama, torch.float32, allow_lossy=True)
    assert [n for n in notes if n.startswith("lossy, written with --allow-lossy: vLLM builds fc without")]
    assert_same_tensors(head, load_head(tmp_path / "out", llama))          # the folder itself is exact


def test_a_head_no_engine_drafts_worse_from_is_written_with_what_differs(llama, tmp_path, monkeypatch):
    head, path = saved(llama, tmp_path, "biased", input_norm=False)          # a random bias: it decides nothing
    notes = export(path, "eagle", tmp_path / "out", llama, torch.float32)
    differs = [n for n in notes if n.startswith("differs, written (within the margin): vLLM builds fc without its ")]
    assert len(differs) == 1 and "of 160 positions, against " in differs[0], notes
    assert not [n for n in notes if "lossy" in n]
    assert_same_tensors(head, load_head(tmp_path / "out", llama))
    monkeypatch.setattr(export_module, "AGREEMENT_MARGIN", -1.0)             # the margin is what decides
    with pytest.raises(LossyExport, match="vLLM builds fc without its bias"):
        export(path, "eagle", tmp_path / "out2", llama, torch.float32)


def test_the_measured_figure_is_the_agreement_of_the_engines_view(llama, tmp_path):
    head, _ = saved(llama, tmp_path, "biased", input_norm=False)
    seqs = reference_sequences(llama, new_tokens=24)
    exact, n = first_token_agreement(head, llama, seqs, View())
    dropped, m = first_token_agreement(head, llama, seqs, View(drop_bias=True))
    assert n == m == sum(ids.numel() - max(prompt, 2) for ids, prompt in seqs)
    drafts = [p for p, _ in first_token_drafts(head, llama, seqs, View())]
    without = [p for p, _ in first_token_drafts(head, llama, seqs, View(drop_bias=True))]
    assert any(not torch.equal(a, b) for a, b in zip(drafts, without))     # the bias changes what is drafted
    assert torch.count_nonzero(head.fc.bias) > 0                            # and the head was left as it was
    # by hand: the head's argmax at each continuation position against the target's next token
    ids, prompt = seqs[0]
    with torch.no_grad(), llama.stock():
        hidden = llama.decoder(ids[None]).last_hidden_state[0, :-2]
    out, logits = head_out(head, llama, hidden, ids[1:-1])
    hits = (logits.argmax(-1) == ids[2:])[prompt - 2:]
    one, total = first_token_agreement(head, llama, seqs[:1], View())
    assert (one, total) == (int(hits.sum()), hits.numel())


def test_heads_without_the_bias_export_exactly_to_every_engine(llama, tmp_path):
    head, path = saved(llama, tmp_path, "plain", fc_bias=False)
    assert all(engine_view(load_head(path, llama), e).exact for e in ("official", "sglang", "vllm"))
    notes = export(path, "eagle", tmp_path / "out", llama, torch.float32)
    assert not [n for n in notes if "lossy" in n]
    assert_same_tensors(head, load_head(tmp_path / "out", llama))


def test_a_reduced_vocabulary_differs_for_official_eagle_and_vllm_only(llama, tmp_path, monkeypatch):
    _, path = saved(llama, tmp_path, "reduced", fc_bias=False, d2t=torch.arange(0, 60, 2))
    notes = export(path, "eagle", tmp_path / "o1", llama, torch.float32)
    assert sorted(n.split(": ")[1].split(" drafts")[0] for n in notes if n.startswith("differs")) == [
        "official EAGLE", "vLLM"], notes
    assert [n for n in notes if "drafts over the full vocabulary, not the head's 30 tokens" in n]
    notes = export(path, "eagle", tmp_path / "o2", llama, torch.float32, engine="sglang")   # the hot-token map
    assert not [n for n in notes if n.startswith(("differs", "lossy"))]
    monkeypatch.setattr(export_module, "AGREEMENT_MARGIN", -1.0)
    with pytest.raises(LossyExport, match="official EAGLE drafts over the full vocabulary, not the head's 30 tokens"):
        export(path, "eagle", tmp_path / "o3", llama, torch.float32)


def test_the_vllm_layout_carries_the_bias_exactly(llama, tmp_path):
    head, path = saved(llama, tmp_path, "biased")                            # input norm: the two-layer form
    notes = export(path, "eagle", tmp_path / "out", llama, torch.float32, engine="vllm")
    assert not [n for n in notes if "lossy" in n] and [n for n in notes if "written for vLLM only" in n]
    cfg = json.loads((tmp_path / "out" / "config.json").read_text())
    w = load_file(tmp_path / "out" / "model.safetensors")
    # vLLM's Llama layer: attention_bias -> o_proj bias; qkv_bias false -> no q/k/v bias; fc never has one
    assert cfg["attention_bias"] is True and cfg["qkv_bias"] is False and "fc.bias" not in w
    assert torch.equal(w["layers.0.self_attn.o_proj.bias"], head.fc.bias.detach())
    assert not w["layers.1.self_attn.o_proj.bias"].any()
    assert not any(k.endswith(("q_proj.bias", "k_proj.bias", "v_proj.bias")) for k in w)
    # what vLLM computes (fc without bias, layer 0 without input norm, o_proj biases) is the head's output
    tokens, hidden = tokens_and_hidden(llama.hidden_size)
    expected, _ = head_out(head, llama, hidden, tokens)
    got = eagle1_forward(w, cfg, llama.embed_tokens(tokens).detach(), hidden, torch.arange(tokens.numel()))
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    assert_same_tensors(head, load_head(tmp_path / "out", llama))           # and it reads back as the same head


# -- EAGLE-3 in its consumers' layouts -----------------------------------------------------------------------------
@pytest.fixture(scope="module")
def deep():
    return make_target("llama", layers=8)


def eagle3_head(target, tmp_path):
    from eagle_lite.heads.draft import published_feature_layers

    torch.manual_seed(0)
    taps = published_feature_layers(target.config.num_hidden_layers)
    head = trained_like(DraftHead.for_target(target, torch.arange(10, 50), feature_layers=taps, design="eagle3"))
    save_head(head, tmp_path / "head3", target, dtype=torch.float32)
    export(tmp_path / "head3", "eagle3", tmp_path / "default", target, torch.float32)
    return head, tmp_path / "head3", load_file(tmp_path / "default" / "model.safetensors")


def test_eagle3_in_the_speculators_layout_vllm_reads(deep, tmp_path):
    head, path, default = eagle3_head(deep, tmp_path)
    notes = export(path, "eagle3", tmp_path / "spec", deep, torch.float32, engine="speculators", verifier="/t/smol")
    cfg = json.loads((tmp_path / "spec" / "config.json").read_text())
    w = load_file(tmp_path / "spec" / "model.safetensors")
    assert {k.replace("layers.0.", "midlayer.", 1): v for k, v in w.items()}.keys() == default.keys()
    assert all(torch.equal(w[k.replace("midlayer.", "layers.0.", 1)], v) for k, v in default.items())
    assert cfg["speculators_model_type"] == "eagle3" and cfg["architectures"] == ["Eagle3Speculator"]
    assert cfg["norm_before_residual"] is False       # the official layer; the package's default is true
    assert cfg["draft_vocab_size"] == 40
    assert cfg["eagle_aux_hidden_state_layer_ids"] == [i + 1 for i in head.feature_layers]   # vLLM: inputs of
    layer = cfg["transformer_layer_config"]
    assert layer["model_type"] == "llama" and layer["hidden_size"] == deep.hidden_size
    assert layer["num_hidden_layers"] == 1 and layer["tie_word_embeddings"] is False
    spec = cfg["speculators_config"]                   # what vLLM's SpeculatorsConfig.validate_speculators_config reads
    assert spec["algorithm"] == "eagle3" and spec["proposal_methods"][0]["speculative_tokens"] >= 1
    assert spec["verifier"] == {"name_or_path": "/t/smol", "architectures": ["LlamaForCausalLM"]}
    assert any("vllm serve" in n for n in notes)
    back = load_head(tmp_path / "spec", deep)              # and it reads back as the same head: taps, d2t, weights
    assert back.feature_layers == head.feature_layers and torch.equal(back.d2t, head.d2t)
    assert_same_tensors(head, back)


def test_eagle3_for_openvino_carries_the_target_embedding(deep, tmp_path):
    _, path, default = eagle3_head(deep, tmp_path)
    export(path, "eagle3", tmp_path / "ov", deep, torch.float32, engine="openvino")
    w = load_file(tmp_path / "ov" / "model.safetensors")
    assert torch.equal(w.pop("embed_tokens.weight"), deep.embed_tokens.weight.detach())
    assert w.keys() == default.keys() and all(torch.equal(w[k], default[k]) for k in w)
    with pytest.raises(ValueError, match="layout of EAGLE-3 drafts only"):
        export(path, "eagle", tmp_path / "x", deep, torch.float32, engine="openvino")


def test_a_full_vocabulary_eagle3_head_is_written_without_a_vocabulary_map(deep, tmp_path):
    from eagle_lite.heads.draft import published_feature_layers

    torch.manual_seed(0)
    taps = published_feature_layers(deep.config.num_hidden_layers)
    head = trained_like(DraftHead.for_target(deep, feature_layers=taps, design="eagle3"))
    save_head(head, tmp_path / "full", deep, dtype=torch.float32)
    for engine in ("all", "speculators"):
        export(tmp_path / "full", "eagle3", tmp_path / engine, deep, torch.float32, engine=engine)
        w = load_file(tmp_path / engine / "model.safetensors")
        assert "d2t" not in w and "t2d" not in w       # vLLM refuses a d2t when draft_vocab_size == vocab_size
        assert json.loads((tmp_path / engine / "config.json").read_text())["draft_vocab_size"] == deep.vocab_size
    assert_same_tensors(head, load_head(tmp_path / "all", deep))
