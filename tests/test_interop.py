"""Heads in the published layouts: each imported folder (written here, from tensors, exactly as official EAGLE,
SpecForge and FasterDecoding write theirs) gives the logits of a reference forward written from the published
description (tests/interop_reference.py) and drafts exactly; eagle_lite's heads export and re-import bit for bit."""
from __future__ import annotations

import ast
import json

import pytest
import torch
from conftest import VOCAB, make_target, reference_greedy
from interop_reference import eagle1_forward, eagle3_forward, llama_config, medusa_logits, random_layer, write

from eagle_lite.config import GenerationConfig, TreeConfig
from eagle_lite.decoding.engine import Engine
from eagle_lite.drafters import DraftInput, EagleDrafter, MedusaDrafter
from eagle_lite.formats import load_head, load_medusa
from eagle_lite.heads.checkpoint import HeadMismatchError, save_head
from eagle_lite.heads.draft import DraftHead, published_feature_layers
from eagle_lite.tree import attention_mask

TREE = TreeConfig(depth=3, top_k=3, total_tokens=8)


@pytest.fixture(scope="module")
def deep():
    """8 layers: the published EAGLE-3 taps (inputs of layers 2, 4, 5) are three distinct layers."""
    return make_target("llama", layers=8)


def tokens_and_hidden(width: int, n: int = 9, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(VOCAB, (n,), generator=g), torch.randn(n, width, generator=g)


def head_out(head: DraftHead, target, hidden: torch.Tensor, tokens: torch.Tensor):
    """eagle_lite's head over a causal chain: (output [T, H], draft logits [T, V_draft])."""
    t = tokens.numel()
    with torch.no_grad():
        out = head(hidden[None], target.embed_tokens(tokens)[None], torch.arange(t)[None],
                   attention_mask(0, torch.ones(t, t, dtype=torch.bool).tril()))[0]
        return out, head.logit_features(out) @ head.output_weight(target.lm_head.weight).T


def greedy_is_exact(target, drafter, prompt_len: int = 11, new: int = 24) -> None:
    prompt = torch.randint(VOCAB, (prompt_len,), generator=torch.Generator().manual_seed(prompt_len)).tolist()
    got = Engine(target, drafter).generate(prompt, GenerationConfig(max_new_tokens=new, tree=TREE, stop_at_eos=False))
    assert got.token_ids == reference_greedy(target, prompt, new)


# -- EAGLE-1/2 -----------------------------------------------------------------------------------------------------
def official_eagle(folder, target, bias: bool | None = True, file: str = "pytorch_model.bin", seed: int = 0,
                   qkv_bias: bool = False, **config_extra):
    """An official EAGLE-1/2 head folder. bias: True/False written as the config key, None: key absent (= True)."""
    g = torch.Generator().manual_seed(seed)
    h = target.hidden_size
    extra = {} if bias is None else {"bias": bias}
    cfg = llama_config(h, target.vocab_size, **extra, **({"qkv_bias": True} if qkv_bias else {}), **config_extra)
    w = {"fc.weight": torch.randn(h, 2 * h, generator=g) * 0.1,
         "embed_tokens.weight": torch.randn(target.vocab_size, h, generator=g),   # published files carry one
         **random_layer(g, "layers.0.", cfg, h, input_norm=False, qkv_bias=qkv_bias)}
    if bias is not False:
        w["fc.bias"] = torch.randn(h, generator=g) * 0.1
    return write(folder, cfg, w, file), cfg, w


@pytest.mark.parametrize("file", ["pytorch_model.bin", "model.safetensors"])
@pytest.mark.parametrize("bias", [None, False], ids=["bias-key-absent", "bias-false"])
def test_official_eagle_head_gives_the_published_logits_and_drafts_exactly(llama, tmp_path, file, bias):
    folder, cfg, w = official_eagle(tmp_path / "eagle", llama, bias, file)
    head = load_head(folder, llama)
    assert not head.input_norm and head.fc_bias == (bias is None) and head.d2t is None
    tokens, hidden = tokens_and_hidden(llama.hidden_size)
    want = eagle1_forward(w, cfg, llama.embed_tokens(tokens), hidden, torch.arange(tokens.numel()))
    out, logits = head_out(head, llama, hidden, tokens)
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(logits, want @ llama.lm_head.weight.T, rtol=1e-5, atol=1e-4)
    greedy_is_exact(llama, EagleDrafter(llama, head))


def test_official_eagle_head_with_qkv_biases(tmp_path):
    qwen = make_target("qwen2")
    folder, cfg, w = official_eagle(tmp_path / "eagle", qwen, None, qkv_bias=True)
    head = load_head(folder, qwen)
    tokens, hidden = tokens_and_hidden(qwen.hidden_size)
    want = eagle1_forward(w, cfg, qwen.embed_tokens(tokens), hidden, torch.arange(tokens.numel()))
    torch.testing.assert_close(head_out(head, qwen, hidden, tokens)[0], want, rtol=1e-5, atol=1e-5)


def test_a_hot_token_map_restricts_the_draft_vocabulary(llama, tmp_path):
    folder, cfg, w = official_eagle(tmp_path / "eagle", llama, None, "model.safetensors")
    hot = torch.tensor([0, 2, 3, 5, 8, 13, 21, 34, 55, 89])
    torch.save(hot, folder / "hot_token_ids.pt")
    head = load_head(folder, llama)
    assert head.d2t.tolist() == hot.tolist()
    tokens, hidden = tokens_and_hidden(llama.hidden_size)
    want = eagle1_forward(w, cfg, llama.embed_tokens(tokens), hidden, torch.arange(tokens.numel()))
    torch.testing.assert_close(head_out(head, llama, hidden, tokens)[1], want @ llama.lm_head.weight[hot].T,
                               rtol=1e-5, atol=1e-4)
    drafter = EagleDrafter(llama, head)
    drafter.reset(64)
    tree = drafter.propose(DraftInput(tokens.tolist() + [1], hidden), TREE)
    assert set(tree.tokens[1:].tolist()) <= set(hot.tolist())
    greedy_is_exact(llama, EagleDrafter(llama, head))


# -- EAGLE-3 -------------------------------------------------------------------------------------------------------
def eagle3_folder(folder, target, layout: str, draft_vocab: int = 40, seed: int = 0, **config_extra):
    """An EAGLE-3 head folder: "official" (LlamaForCausalLM config, pytorch_model.bin) or "specforge"
    (LlamaForCausalLMEagle3, model.safetensors, no embedding)."""
    g = torch.Generator().manual_seed(seed)
    h, vocab = target.hidden_size, target.vocab_size
    cfg = llama_config(h, vocab, draft_vocab_size=draft_vocab, **config_extra)
    if layout == "specforge":
        cfg["architectures"] = ["LlamaForCausalLMEagle3"]
    used = torch.randperm(vocab, generator=g)[:draft_vocab].sort().values     # the top-Vd target ids, sorted
    t2d = torch.zeros(vocab, dtype=torch.bool)
    t2d[used] = True
    w = {"fc.weight": torch.randn(h, 3 * h, generator=g) * 0.1,
         **random_layer(g, "midlayer.", cfg, 2 * h),
         "midlayer.hidden_norm.weight": 1 + torch.randn(h, generator=g) * 0.1,
         "norm.weight": 1 + torch.randn(h, generator=g) * 0.1,
         "lm_head.weight": torch.randn(draft_vocab, h, generator=g),
         "d2t": used - torch.arange(draft_vocab), "t2d": t2d}
    file = "pytorch_model.bin" if layout == "official" else "model.safetensors"
    return write(folder, cfg, w, file), cfg, w


@pytest.mark.parametrize("layout", ["official", "specforge"])
def test_eagle3_head_gives_the_published_logits_and_drafts_exactly(deep, tmp_path, layout):
    folder, cfg, w = eagle3_folder(tmp_path / "eagle3", deep, layout)
    head = load_head(folder, deep)
    assert head.design == "eagle3" and head.feature_layers == (1, 3, 4)
    assert head.d2t.tolist() == (torch.arange(40) + w["d2t"]).tolist()
    tokens, taps = tokens_and_hidden(3 * deep.hidden_size)
    positions = torch.arange(tokens.numel())
    embeds = deep.embed_tokens(tokens)
    want_out, want_logits = eagle3_forward(w, cfg, embeds, taps, positions)
    out, logits = head_out(head, deep, taps, tokens)
    torch.testing.assert_close(out, want_out, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(logits, want_logits, rtol=1e-5, atol=1e-4)
    # a later draft step reads the pre-norm output, H wide, without fc
    want_out2, want_logits2 = eagle3_forward(w, cfg, embeds, want_out, positions)
    out2, logits2 = head_out(head, deep, out, tokens)
    torch.testing.assert_close(logits2, want_logits2, rtol=1e-5, atol=1e-4)
    greedy_is_exact(deep, EagleDrafter(deep, head))


def test_eagle3_taps_are_the_residual_stream_entering_layers_2_mid_and_l_minus_3(deep):
    """HF's hidden_states[j] is the input of layer j (j < L): the published taps are hidden_states[2, L//2, L-3]."""
    taps = published_feature_layers(deep.config.num_hidden_layers)
    ids = torch.arange(5)
    cache = deep.new_cache(8)
    with torch.no_grad():
        _, _, features = deep.forward(ids, cache, taps=taps)
        states = deep.model(ids[None], output_hidden_states=True).hidden_states
    layers = deep.config.num_hidden_layers
    want = torch.cat([states[2][0], states[layers // 2][0], states[layers - 3][0]], dim=-1)
    torch.testing.assert_close(features, want, rtol=1e-5, atol=1e-5)


def test_explicit_aux_layer_ids_follow_specforge_unless_read_as_vllm_does(deep, tmp_path):
    from eagle_lite.formats import detect
    from eagle_lite.formats.eagle3 import read_eagle3

    folder, _, _ = eagle3_folder(tmp_path / "e3", deep, "specforge",
                                 eagle_config={"eagle_aux_hidden_state_layer_ids": [1, 3, 5]})
    assert load_head(folder, deep).feature_layers == (1, 3, 5)                        # output of layer i
    assert read_eagle3(detect(folder), deep, aux_ids="input").feature_layers == (0, 2, 4)   # input of layer i


# -- Medusa --------------------------------------------------------------------------------------------------------
def medusa_folder(folder, target, version: str, heads: int = 3, layers: int = 1, seed: int = 0):
    """FasterDecoding's layout: v1 (per-head vocabulary projections, medusa_lm_head.pt) or version "2"
    (ResBlocks only, medusa_lm_head.safetensors). One ResBlock repeated per head, as its list multiplication makes."""
    g = torch.Generator().manual_seed(seed)
    h = target.hidden_size
    w = {}
    for k in range(heads):
        weight, bias = torch.randn(h, h, generator=g) * 0.1, torch.randn(h, generator=g) * 0.1
        for l in range(layers):
            w[f"{k}.{l}.linear.weight"], w[f"{k}.{l}.linear.bias"] = weight.clone(), bias.clone()
        if version == "1":
            w[f"{k}.{layers}.weight"] = torch.randn(target.vocab_size, h, generator=g)
    cfg = {"medusa_num_heads": heads, "medusa_num_layers": layers, "base_model_name_or_path": "tiny",
           **({"version": "2"} if version == "2" else {})}
    file = "medusa_lm_head.pt" if version == "1" else "medusa_lm_head.safetensors"
    return write(folder, cfg, w, file), w


@pytest.mark.parametrize("version", ["1", "2"])
def test_medusa_heads_give_the_published_logits_and_draft_exactly(llama, tmp_path, version):
    folder, w = medusa_folder(tmp_path / "medusa", llama, version, layers=2)
    heads = load_medusa(folder, llama)
    assert (heads.lm_heads is not None) == (version == "1")
    _, hidden = tokens_and_hidden(llama.hidden_size)
    with torch.no_grad():
        got = heads.logits(heads(hidden), llama.lm_head)
    torch.testing.assert_close(got, medusa_logits(w, hidden, 3, 2, llama.lm_head.weight), rtol=1e-5, atol=1e-4)
    greedy_is_exact(llama, MedusaDrafter(llama, heads))


# -- export, then import -------------------------------------------------------------------------------------------
def trained_like(head: torch.nn.Module, seed: int = 1) -> torch.nn.Module:
    """Random weights everywhere (norms off 1, biases off 0), as a trained head has."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in head.parameters():
            p.copy_(p + torch.randn(p.shape, generator=g) * 0.05)
    return head


def export_import(head_dir, fmt, target, tmp_path, loader=load_head, **options):
    from eagle_lite.export import export

    out = tmp_path / f"exported-{fmt}"
    notes = export(head_dir, fmt, out, target, torch.float32, **options)
    return loader(out, target), out, notes


def same_proposals(a: DraftHead, b: DraftHead, target) -> None:
    prompt = list(range(3, 17))
    with torch.no_grad():
        out = target.forward(torch.tensor(prompt), target.new_cache(32), taps=a.feature_layers)
    features = out[2] if a.feature_layers else out[1]
    trees = []
    for head in (a, b):
        drafter = EagleDrafter(target, head)
        drafter.reset(64)
        trees.append(drafter.propose(DraftInput(prompt + [5], features), TreeConfig(depth=4, top_k=4, total_tokens=12)))
    assert trees[0].tokens.tolist() == trees[1].tokens.tolist() and trees[0].parents == trees[1].parents


def assert_same_tensors(a: torch.nn.Module, b: torch.nn.Module) -> None:
    sa, sb = a.state_dict(), b.state_dict()
    assert sorted(sa) == sorted(sb)
    assert all(torch.equal(sa[k], sb[k]) for k in sa), [k for k in sa if not torch.equal(sa[k], sb[k])]


@pytest.mark.parametrize("input_norm,fc_bias,vocab", [(True, True, 24), (False, False, None)],
                         ids=["eagle_lite-layout", "published-layout"])
def test_eagle_heads_round_trip_bit_for_bit(llama, tmp_path, input_norm, fc_bias, vocab):
    d2t = None if vocab is None else torch.arange(0, 2 * vocab, 2)
    torch.manual_seed(0)
    head = trained_like(DraftHead.for_target(llama, d2t, fc_bias=fc_bias, input_norm=input_norm))
    save_head(head, tmp_path / "head", llama, dtype=torch.float32, extra={"tree": {"depth": 3, "top_k": 2,
                                                                                    "total_tokens": 4}})
    # SGLang runs both exactly (fc bias, hot-token map); official EAGLE and vLLM would draft over the full vocabulary
    back, out, notes = export_import(tmp_path / "head", "eagle", llama, tmp_path, engine="sglang")
    assert_same_tensors(head, back)
    assert back.input_norm == input_norm and back.fc_bias == fc_bias and back.tree == TreeConfig(3, 2, 4)
    assert (out / "hot_token_ids.pt").is_file() == (vocab is not None)
    assert any("hot-token map" in n for n in notes) == (vocab is not None)
    same_proposals(head, back, llama)


def test_eagle3_heads_round_trip_bit_for_bit(deep, tmp_path):
    torch.manual_seed(0)
    taps = published_feature_layers(deep.config.num_hidden_layers)
    head = trained_like(DraftHead.for_target(deep, torch.arange(5, 45), feature_layers=taps, design="eagle3"))
    save_head(head, tmp_path / "head", deep, dtype=torch.float32)
    back, out, notes = export_import(tmp_path / "head", "eagle3", deep, tmp_path)
    assert_same_tensors(head, back)
    assert notes == []   # the published taps: nothing for a loader to read differently
    same_proposals(head, back, deep)
    greedy_is_exact(deep, EagleDrafter(deep, back))


def test_medusa_heads_round_trip_for_both_loaders(llama, tmp_path):
    from eagle_lite.heads.medusa import MedusaHeads, save_medusa

    torch.manual_seed(0)
    heads = trained_like(MedusaHeads.for_target(llama, num_heads=3, num_layers=1))
    save_medusa(heads, tmp_path / "heads", llama, dtype=torch.float32)
    back, out, _ = export_import(tmp_path / "heads", "medusa", llama, tmp_path, loader=load_medusa)
    assert_same_tensors(heads, back)
    for name in ("medusa_lm_head.safetensors", "medusa_lm_head.pt"):   # then vLLM's files alone
        (out / name).unlink()
    assert_same_tensors(heads, load_medusa(out, llama))


# -- what each server's loader makes of an exported folder --------------------------------------------------------
# (SafeAILab/EAGLE cnets1.py / cnets.py module keys; vLLM llama_eagle.py, llama_eagle3.py, medusa.py and SGLang
# llama_eagle.py, llama_eagle3.py load_weights: INTEROP.md sections 1-5)
STACKED = [(".qkv_proj", ".q_proj"), (".qkv_proj", ".k_proj"), (".qkv_proj", ".v_proj"),
           (".gate_up_proj", ".gate_proj"), (".gate_up_proj", ".up_proj")]


def load_as(tensors: dict, rename, params: dict) -> tuple[dict, list]:
    """Apply a loader's renames; stacked shards are concatenated (q, k, v / gate, up) as the fused parameter
    loaders do. Returns ({param: shape}, names the loader skips)."""
    loaded, skipped = {}, []
    for name, tensor in tensors.items():
        name = rename(name)
        if name is None:
            continue
        for fused, part in STACKED:
            if part in name:
                name = name.replace(part, fused)
                break
        if name not in params:
            skipped.append(name)
            continue
        loaded[name] = tensor if name not in loaded else torch.cat([loaded[name], tensor])
    return {k: tuple(v.shape) for k, v in loaded.items()}, skipped


def llama_params(cfg: dict, prefix: str, in_width: int, fused: bool, input_norm_from: int = 1,
                 layer_names=None) -> dict:
    h, i, nh, nkv = cfg["hidden_size"], cfg["intermediate_size"], cfg["num_attention_heads"], cfg["num_key_value_heads"]
    d = cfg["head_dim"]
    out = {}
    for n in range(cfg["num_hidden_layers"]):
        p = f"{prefix}{layer_names or 'layers.'}{'' if layer_names else f'{n}.'}"
        if fused:
            out[p + "self_attn.qkv_proj.weight"] = ((nh + 2 * nkv) * d, in_width)
            out[p + "mlp.gate_up_proj.weight"] = (2 * i, h)
        else:
            out.update({p + "self_attn.q_proj.weight": (nh * d, in_width),
                        p + "self_attn.k_proj.weight": (nkv * d, in_width),
                        p + "self_attn.v_proj.weight": (nkv * d, in_width), p + "mlp.gate_proj.weight": (i, h),
                        p + "mlp.up_proj.weight": (i, h)})
        out.update({p + "self_attn.o_proj.weight": (h, nh * d), p + "mlp.down_proj.weight": (h, i),
                    p + "post_attention_layernorm.weight": (h,)})
        if n >= input_norm_from:
            out[p + "input_layernorm.weight"] = (h,)
    return out


def read_export(out):
    import json

    from safetensors.torch import load_file

    return json.loads((out / "config.json").read_text()), load_file(out / "model.safetensors")


def test_eagle_export_loads_in_official_eagle_vllm_and_sglang(llama, tmp_path):
    torch.manual_seed(0)
    head = trained_like(DraftHead.for_target(llama, torch.arange(30), fc_bias=False))   # input norm: two layers
    save_head(head, tmp_path / "head", llama)
    from eagle_lite.export import export

    # official EAGLE and vLLM draft over the full vocabulary: written only when asked
    export(tmp_path / "head", "eagle", tmp_path / "out", llama, torch.bfloat16, allow_lossy=True)
    cfg, tensors = read_export(tmp_path / "out")
    h = cfg["hidden_size"]
    assert cfg["architectures"][0] == "LlamaForCausalLMEagle" and cfg["architectures"][1] == "LlamaForCausalLM"
    assert "bias" not in cfg and cfg["num_hidden_layers"] == 2 and cfg["tie_word_embeddings"] is False
    assert all(t.dtype == torch.bfloat16 for t in tensors.values())
    # official EAGLE (cnets1.Model, bias absent = True): its module keys, unfused, layer 0 without input norm
    official = {"fc.weight": (h, 2 * h), "fc.bias": (h,), **llama_params(cfg, "", h, fused=False)}
    assert {k: tuple(v.shape) for k, v in tensors.items()} == official
    # SGLang (LlamaForCausalLMEagle): "model." before every non-lm_head key, fused q/k/v and gate/up, fc with bias
    sglang = {"model.fc.weight": (h, 2 * h), "model.fc.bias": (h,), **llama_params(cfg, "model.", h, fused=True)}
    loaded, skipped = load_as(tensors, lambda n: n if "lm_head" in n else "model." + n, sglang)
    assert loaded == sglang and skipped == []
    # vLLM (EagleLlamaForCausalLM): the same renames; fc has no bias, so it skips fc.bias: zero for this head
    vllm = {"model.fc.weight": (h, 2 * h), **llama_params(cfg, "model.", h, fused=True)}
    loaded, skipped = load_as(tensors, lambda n: n if "lm_head" in n else "model." + n, vllm)
    assert loaded == vllm and skipped == ["model.fc.bias"] and not tensors["fc.bias"].any()
    # the hot-token map SGLang reads with torch.load(weights_only=True): one int64 tensor
    hot = torch.load(tmp_path / "out" / "hot_token_ids.pt", weights_only=True)
    assert hot.dtype == torch.int64 and hot.tolist() == list(range(30))


def test_eagle3_export_loads_in_official_eagle3_vllm_and_sglang(deep, tmp_path):
    torch.manual_seed(0)
    taps = published_feature_layers(deep.config.num_hidden_layers)
    head = trained_like(DraftHead.for_target(deep, torch.arange(10, 50), feature_layers=taps, design="eagle3"))
    save_head(head, tmp_path / "head", deep)
    from eagle_lite.export import export

    export(tmp_path / "head", "eagle3", tmp_path / "out", deep, torch.bfloat16)
    cfg, tensors = read_export(tmp_path / "out")
    h, vd, v = cfg["hidden_size"], cfg["draft_vocab_size"], cfg["vocab_size"]
    assert cfg["architectures"] == ["LlamaForCausalLMEagle3"] and vd == 40 and "eagle_config" not in cfg
    assert tensors["d2t"].dtype == torch.int64 and tensors["t2d"].dtype == torch.bool
    assert (tensors["d2t"] + torch.arange(vd)).tolist() == list(range(10, 50)) and int(tensors["t2d"].sum()) == vd
    midlayer = {**llama_params(cfg, "", 2 * h, fused=False, input_norm_from=0, layer_names="midlayer."),
                "midlayer.hidden_norm.weight": (h,)}
    # official EAGLE-3 (cnets.Model) and SpecForge: these module keys exactly (embed_tokens: the target's)
    official = {"fc.weight": (h, 3 * h), **midlayer, "norm.weight": (h,), "lm_head.weight": (vd, h), "d2t": (vd,),
                "t2d": (v,)}
    assert {k: tuple(t.shape) for k, t in tensors.items()} == official
    # vLLM (Eagle3LlamaForCausalLM): t2d dropped, d2t -> draft_id_to_target_id, midlayer. -> layers.0., "model."
    vllm = {"model.fc.weight": (h, 3 * h), "model.norm.weight": (h,), "lm_head.weight": (vd, h),
            "draft_id_to_target_id": (vd,), "model.layers.0.hidden_norm.weight": (h,),
            **llama_params(cfg, "model.", 2 * h, fused=True, input_norm_from=0)}

    def vllm_rename(name):
        if "t2d" in name:
            return None
        if "d2t" in name:
            return name.replace("d2t", "draft_id_to_target_id")
        name = name.replace("midlayer.", "layers.0.")
        return name if "lm_head" in name else "model." + name

    loaded, skipped = load_as(tensors, vllm_rename, vllm)
    assert loaded == vllm and skipped == []
    # SGLang (LlamaForCausalLMEagle3): d2t -> hot_token_id = d2t + arange, t2d ignored, "model." + midlayer keys
    sglang = {"model.fc.weight": (h, 3 * h), "model.norm.weight": (h,), "lm_head.weight": (vd, h),
              "model.midlayer.hidden_norm.weight": (h,),
              **llama_params(cfg, "model.", 2 * h, fused=True, input_norm_from=0, layer_names="midlayer.")}
    loaded, skipped = load_as(tensors, lambda n: None if n in ("d2t", "t2d") else
                              (n if "lm_head" in n else "model." + n), sglang)
    assert loaded == sglang and skipped == []


def test_medusa_export_loads_in_vllm_and_fasterdecoding(llama, tmp_path):
    from safetensors.torch import load_file

    from eagle_lite.export import export
    from eagle_lite.heads.medusa import MedusaHeads, save_medusa

    heads = trained_like(MedusaHeads.for_target(llama, num_heads=2, num_layers=1))
    save_medusa(heads, tmp_path / "heads", llama)
    export(tmp_path / "heads", "medusa", tmp_path / "out", llama, torch.bfloat16)
    cfg, tensors = read_export(tmp_path / "out")
    h, v = llama.hidden_size, llama.vocab_size
    # vLLM's Medusa: blocks.{h}.layers.{l}.weight/.bias (medusa_fc_bias), one lm_head (original_lm_head)
    assert cfg["num_heads"] == 2 and cfg["num_hidden_layers"] == 1 and cfg["medusa_fc_bias"] and cfg["original_lm_head"]
    assert {k: tuple(t.shape) for k, t in tensors.items()} == {
        "blocks.0.layers.0.weight": (h, h), "blocks.0.layers.0.bias": (h,), "blocks.1.layers.0.weight": (h, h),
        "blocks.1.layers.0.bias": (h,), "lm_head.weight": (v, h)}
    # FasterDecoding version 2: the medusa_head ModuleList's keys, in the .safetensors and the .pt it loads
    fd = {"0.0.linear.weight": (h, h), "0.0.linear.bias": (h,), "1.0.linear.weight": (h, h), "1.0.linear.bias": (h,)}
    assert cfg["version"] == "2" and cfg["medusa_num_heads"] == 2 and cfg["medusa_num_layers"] == 1
    pt = torch.load(tmp_path / "out" / "medusa_lm_head.pt", weights_only=True)
    for found in (load_file(tmp_path / "out" / "medusa_lm_head.safetensors"), pt):
        assert {k: tuple(t.shape) for k, t in found.items()} == fd


# -- refusals ------------------------------------------------------------------------------------------------------
def test_a_head_for_another_target_is_refused(llama, deep, tmp_path):
    folder, _, _ = official_eagle(tmp_path / "eagle", make_target("llama", hidden=32), None)
    with pytest.raises(HeadMismatchError, match=r"hidden size 32 .*target 'tiny-llama' has hidden size 64"):
        load_head(folder, llama)
    folder, _, _ = eagle3_folder(tmp_path / "eagle3", deep, "official")
    with pytest.raises(ValueError, match="2 decoder layers has too few for the published EAGLE-3 taps"):
        load_head(folder, llama)
    with pytest.raises(HeadMismatchError, match="hidden size 64 and vocabulary 96; target .* hidden size 32"):
        load_head(folder, make_target("llama", hidden=32, layers=8))


def test_an_fc_that_contradicts_the_config_is_refused(llama, tmp_path):
    folder, cfg, w = official_eagle(tmp_path / "eagle", llama, None, "model.safetensors")
    w["fc.weight"] = torch.zeros(llama.hidden_size, 3 * llama.hidden_size)
    write(folder, cfg, w, "model.safetensors")
    with pytest.raises(ValueError, match=r"fc.weight has shape \[64, 192\].*expected \[64, 128\]"):
        load_head(folder, llama)


def test_a_pickle_holding_anything_but_tensors_is_refused(llama, tmp_path):
    folder, cfg, w = official_eagle(tmp_path / "eagle", llama, None)
    torch.save({**w, "step": 3}, folder / "pytorch_model.bin")
    with pytest.raises(ValueError, match=r"non-tensor entries \('step': int\)"):
        load_head(folder, llama)
    torch.save({**w, "extra": torch.nn.Linear(2, 2)}, folder / "pytorch_model.bin")   # an object: never built
    with pytest.raises(ValueError, match=r"not a file of tensors .*weights_only"):
        load_head(folder, llama)
    torch.save([w["fc.weight"]], folder / "pytorch_model.bin")
    with pytest.raises(ValueError, match="holds a list: expected a flat dict"):
        load_head(folder, llama)


def test_unknown_and_inconsistent_layouts_are_refused(llama, deep, tmp_path):
    write(tmp_path / "unknown", {"foo": 1}, {"x.weight": torch.zeros(2)})
    with pytest.raises(ValueError, match=r"no draft head layout .*config keys \['foo'\], weights x.weight.*Expected"):
        load_head(tmp_path / "unknown", llama)
    folder, cfg, w = official_eagle(tmp_path / "mixed", llama, None, "model.safetensors")
    write(folder, {**cfg, "draft_vocab_size": 40}, w)
    with pytest.raises(ValueError, match="inconsistent: its config.json describes an EAGLE-3 head.*keys of an EAG"):
        load_head(folder, llama)
    folder, cfg, w = official_eagle(tmp_path / "normed", llama, None, "model.safetensors")
    write(folder, cfg, {**w, "layers.0.input_layernorm.weight": torch.ones(llama.hidden_size)})
    with pytest.raises(ValueError, match="layers.0.input_layernorm.weight is not part of the EAGLE layout"):
        load_head(folder, llama)
    medusa, _ = medusa_folder(tmp_path / "medusa", llama, "2")
    with pytest.raises(ValueError, match="holds Medusa heads .*pass it with --medusa"):
        load_head(medusa, llama)


def test_export_refuses_what_a_format_cannot_express(llama, deep, tmp_path):
    from eagle_lite.export import export

    save_head(DraftHead.for_target(llama), tmp_path / "eagle", llama)
    with pytest.raises(ValueError, match="EAGLE-1/2 head .*export it with --format eagle"):
        export(tmp_path / "eagle", "eagle3", tmp_path / "o1", llama, torch.float32)
    save_head(DraftHead.for_target(deep, feature_layers=(1, 3, 4)), tmp_path / "fuse", deep)
    with pytest.raises(ValueError, match="through `fuse`"):
        export(tmp_path / "fuse", "eagle", tmp_path / "o2", deep, torch.float32)
    save_head(DraftHead.for_target(deep, feature_layers=(1, 3, 4), design="eagle3"), tmp_path / "e3", deep)
    with pytest.raises(ValueError, match="EAGLE-3 head .*--format eagle3"):
        export(tmp_path / "e3", "eagle", tmp_path / "o3", deep, torch.float32)
    with pytest.raises(ValueError, match="holds an EAGLE draft head"):
        export(tmp_path / "eagle", "medusa", tmp_path / "o4", llama, torch.float32)


def test_export_cli_errors_are_one_line_and_exit_non_zero(tmp_path, capsys):
    from eagle_lite.export import main

    assert main([str(tmp_path / "nowhere"), "--format", "eagle", "--out", str(tmp_path / "o")]) == 1
    err = capsys.readouterr().err
    assert err.startswith("error: no head folder at") and err.count("\n") == 1 and "Traceback" not in err
    with pytest.raises(SystemExit) as exit_:
        main(["x", "--format", "gguf", "--out", "o"])
    assert exit_.value.code == 2
    capsys.readouterr()
    for text, says in (("[1, 2]", "holds a list, not a JSON object"), ("{oops", "is corrupt: Expecting")):
        (tmp_path / "bad").mkdir(exist_ok=True)
        (tmp_path / "bad" / "config.json").write_text(text)
        assert main([str(tmp_path / "bad"), "--format", "eagle", "--out", str(tmp_path / "o")]) == 1
        err = capsys.readouterr().err
        assert err.startswith(f"error: draft head config {tmp_path / 'bad' / 'config.json'} ") and says in err
        assert err.count("\n") == 1


def test_export_cli_writes_a_folder_and_prints_its_notes(tiny_model_dir, tmp_path, capsys):
    from eagle_lite.export import main
    from eagle_lite.targets.loading import load_target

    target = load_target(str(tiny_model_dir))
    save_head(DraftHead.for_target(target, torch.arange(20)), tmp_path / "head", target)
    out = tmp_path / "out"
    assert main([str(tmp_path / "head"), "--format", "eagle", "--engine", "sglang", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert printed.startswith(f"wrote eagle head to {out}: config.json, hot_token_ids.pt, model.safetensors, "
                              "vllm_speculative_config.json")
    # vLLM's static tree goes in a file its line passes whole, not a 60-tuple line to copy
    vllm = json.loads((out / "vllm_speculative_config.json").read_text())
    assert vllm["method"] == "eagle" and vllm["model"] == str(out.resolve())
    assert vllm["num_speculative_tokens"] == len(ast.literal_eval(vllm["speculative_token_tree"])) == 60
    line = next(x for x in printed.splitlines() if x.startswith("vllm:"))
    assert f'--speculative-config "$(cat {out / "vllm_speculative_config.json"})"' in line and "(0, 0" not in line
    assert "note: the head drafts over 20 of" in printed
    assert load_head(out, target).d2t.tolist() == list(range(20))


@pytest.mark.slow
def test_the_shipped_head_exports_to_eagle3_and_drafts_the_same(tmp_path):
    from eagle_lite.export import export
    from eagle_lite.heads.checkpoint import default_head_path
    from eagle_lite.targets.loading import load_target

    target = load_target("smollm2")
    shipped = default_head_path("smollm2")
    a = load_head(shipped, target)
    assert a.design == "eagle3"
    export(shipped, "eagle3", tmp_path / "out", target, torch.bfloat16)   # the official layout vLLM and SGLang load
    b = load_head(tmp_path / "out", target)
    assert_same_tensors(a, b)
    prompt = target.tokenizer.apply_chat_template([{"role": "user", "content": "Why is the sky blue?"}],
                                                  add_generation_prompt=True, return_dict=False)
    cfg = GenerationConfig(max_new_tokens=48, tree=a.tree)
    ra = Engine(target, EagleDrafter(target, a)).generate(prompt, cfg)
    rb = Engine(target, EagleDrafter(target, b)).generate(prompt, cfg)
    assert ra.token_ids == rb.token_ids and ra.stats.accept_lengths == rb.stats.accept_lengths


def test_serving_flags_map_the_tree_onto_each_server():
    from eagle_lite.export import serving_flags, vllm_tree

    flags = serving_flags({"depth": 3, "top_k": 4, "total_tokens": 10})
    assert flags["sglang"] == "--speculative-num-steps 3 --speculative-eagle-topk 4 --speculative-num-draft-tokens 11"
    assert flags["official"].endswith("depth=2, top_k=4, total_token=11)")
    tree = vllm_tree(3, 4, 10)   # 3 branches (3 * 3 <= 10 nodes), each a chain of 3
    assert tree == [(0,), (1,), (2,), (0, 0), (1, 0), (2, 0), (0, 0, 0), (1, 0, 0), (2, 0, 0)]
    assert f'"num_speculative_tokens": {len(tree)}' in flags["vllm"]


def test_serving_lines_take_the_heads_gpu_tree_else_the_gpu_default_never_the_cpu_one():
    from eagle_lite.export import serving_lines

    tuned = serving_lines({"depth": 4, "top_k": 8, "total_tokens": 31})
    assert len(tuned) == 3 and all("the head's recommended GPU tree: depth 4, top_k 8, 31 nodes" in x for x in tuned)
    assert any("--speculative-num-draft-tokens 32" in x for x in tuned)
    bare = serving_lines(None)   # a head tuned on a CPU only: its 1-node tree would throw a GPU's budget away
    assert all("no GPU tree recorded: the GPU default: depth 6, top_k 10, 60 nodes" in x for x in bare)
