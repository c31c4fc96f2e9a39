"""`--format gguf-eagle3`: an EAGLE-3 head as the GGUF draft llama.cpp loads (formats/gguf_eagle3.py).

The file must hold the tensors and metadata llama.cpp's converter writes (`conversion/llama.py`, EAGLE-3 branch;
`src/models/eagle3.cpp` reads them): llama.cpp's names, q/k rows permuted for its RoPE, d2t as absolute target ids,
the taps as inputs of layers, the target GGUF's tokenizer. What llama.cpp's draft cannot run is refused in one line.
No llama.cpp and no download: a tiny random target, and a tiny target GGUF file written here for its tokenizer.
"""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from conftest import VOCAB, make_target
from test_interop import trained_like

from eagle_lite.export import export, main
from eagle_lite.formats.gguf_eagle3 import LAYER_NAMES, file_name, permute, unpermute
from eagle_lite.heads.checkpoint import save_head
from eagle_lite.heads.draft import DraftHead

TAPS = (1, 3, 5)                       # outputs of layers: llama.cpp's target_layers 2, 4, 6


@pytest.fixture(scope="module")
def deep():
    return make_target("llama", layers=8)


def target_gguf(path, target, tokens: int | None = None, layers: int | None = None):
    """A GGUF file standing in for the target's: llama sizes and a gpt2-style tokenizer, no tensors."""
    from gguf import GGUFWriter

    w = GGUFWriter(str(path), "llama")
    w.add_block_count(layers or target.config.num_hidden_layers)
    w.add_embedding_length(target.hidden_size)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("smollm")
    w.add_token_list([f"t{i}" for i in range(tokens or target.vocab_size)])
    w.add_token_types([1] * (tokens or target.vocab_size))
    w.add_token_merges(["t 1", "t 2"])
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_add_bos_token(False)
    w.add_chat_template("{{ messages }}")
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def eagle3_head(target, tmp_path, d2t=torch.arange(10, 70), **options):
    torch.manual_seed(0)
    head = trained_like(DraftHead.for_target(target, d2t, feature_layers=TAPS, design="eagle3", **options))
    save_head(head, tmp_path / "head", target, dtype=torch.float32)
    return head, tmp_path / "head"


def read(path):
    from gguf import GGUFReader

    reader = GGUFReader(str(path))
    fields = {k: f.contents() for k, f in reader.fields.items() if not k.startswith("GGUF.")}
    return fields, {t.name: t for t in reader.tensors}


def as_torch(tensor) -> torch.Tensor:
    data = np.asarray(tensor.data)
    if tensor.tensor_type.name == "BF16":
        return torch.from_numpy(data.view(np.int16).copy()).view(torch.bfloat16).float()
    return torch.from_numpy(data.copy())


def test_the_draft_file_holds_llama_cpps_tensors_and_metadata(deep, tmp_path):
    head, path = eagle3_head(deep, tmp_path)
    gguf = target_gguf(tmp_path / "target.gguf", deep)
    notes = export(path, "gguf-eagle3", tmp_path / "out", deep, torch.float32, target_gguf=gguf)
    out = tmp_path / "out" / file_name(deep.name)
    assert out.name == "eagle3-tiny-llama.gguf" and [p.name for p in (tmp_path / "out").iterdir()] == [out.name]
    assert "eagle3.target_layers [2, 4, 6]" in notes[0] and "a draft vocabulary of 60 (d2t)" in notes[0]
    fields, tensors = read(out)
    assert fields["general.architecture"] == "eagle3"
    assert fields["eagle3.target_layers"] == [2, 4, 6]                  # inputs of layers: outputs + 1
    assert fields["eagle3.target_hidden_size"] == deep.hidden_size
    assert fields["eagle3.norm_before_residual"] is False and fields["eagle3.norm_before_fc"] is False
    cfg = head.config
    assert fields["eagle3.block_count"] == 1 and fields["eagle3.embedding_length"] == cfg.hidden_size
    assert fields["eagle3.feed_forward_length"] == cfg.intermediate_size
    assert fields["eagle3.attention.head_count"] == 4 and fields["eagle3.attention.head_count_kv"] == 2
    assert fields["eagle3.attention.key_length"] == fields["eagle3.rope.dimension_count"] == cfg.hidden_size // 4
    assert fields["eagle3.vocab_size"] == VOCAB and fields["general.file_type"] == 0
    assert fields["tokenizer.ggml.tokens"] == [f"t{i}" for i in range(VOCAB)]       # the target file's tokenizer
    assert fields["tokenizer.ggml.model"] == "gpt2" and fields["tokenizer.ggml.bos_token_id"] == 1
    assert json.loads(fields["eagle_lite.record"])["target"]["name"] == "tiny-llama"
    assert set(tensors) == {"fc.weight", "output_norm.weight", "output.weight", "d2t", *LAYER_NAMES.values()}
    assert "token_embd.weight" not in tensors                        # llama.cpp takes the target's
    # GGUF shapes are innermost first: fc reads 3H, q/k/v read 2H
    h = deep.hidden_size
    assert [int(n) for n in tensors["fc.weight"].shape] == [3 * h, h]
    assert [int(n) for n in tensors["blk.0.attn_q.weight"].shape] == [2 * h, h]
    assert [int(n) for n in tensors["output.weight"].shape] == [h, 60]
    assert tensors["d2t"].tensor_type.name == "I64"
    assert np.array_equal(np.asarray(tensors["d2t"].data), np.arange(10, 70))        # absolute target ids


def test_the_tensors_are_the_heads_exactly(deep, tmp_path):
    head, path = eagle3_head(deep, tmp_path)
    gguf = target_gguf(tmp_path / "target.gguf", deep)
    export(path, "gguf-eagle3", tmp_path / "out", deep, torch.float32, target_gguf=gguf)
    _, tensors = read(tmp_path / "out" / file_name(deep.name))
    layer = head.layer
    want = {"fc.weight": head.fc.weight, "output_norm.weight": head.norm.weight,
            "output.weight": head.lm_head.weight, "blk.0.attn_norm.weight": layer.input_layernorm.weight,
            "blk.0.attn_norm_2.weight": layer.hidden_norm.weight, "blk.0.attn_v.weight": layer.self_attn.v_proj.weight,
            "blk.0.attn_output.weight": layer.self_attn.o_proj.weight,
            "blk.0.ffn_norm.weight": layer.post_attention_layernorm.weight,
            "blk.0.ffn_gate.weight": layer.mlp.gate_proj.weight, "blk.0.ffn_up.weight": layer.mlp.up_proj.weight,
            "blk.0.ffn_down.weight": layer.mlp.down_proj.weight}
    for name, weight in want.items():
        assert torch.equal(as_torch(tensors[name]).reshape(weight.shape), weight.detach().float()), name
    q = as_torch(tensors["blk.0.attn_q.weight"]).reshape(layer.self_attn.q_proj.weight.shape)
    k = as_torch(tensors["blk.0.attn_k.weight"]).reshape(layer.self_attn.k_proj.weight.shape)
    assert torch.equal(unpermute(q, 4), layer.self_attn.q_proj.weight.detach().float())
    assert torch.equal(unpermute(k, 2), layer.self_attn.k_proj.weight.detach().float())
    assert not torch.equal(q, layer.self_attn.q_proj.weight.detach().float())


def test_the_file_is_named_after_the_target():
    assert file_name("smollm2") == "eagle3-smollm2.gguf"
    assert file_name("/models/SmolLM2-135M/") == "eagle3-SmolLM2-135M.gguf"
    assert file_name("HuggingFaceTB/SmolLM2-135M-Instruct") == "eagle3-SmolLM2-135M-Instruct.gguf"


def test_bfloat16_weights_keep_float32_norms(deep, tmp_path):
    head, path = eagle3_head(deep, tmp_path, d2t=None)
    gguf = target_gguf(tmp_path / "target.gguf", deep)
    export(path, "gguf-eagle3", tmp_path / "out", deep, torch.bfloat16, target_gguf=gguf)
    fields, tensors = read(tmp_path / "out" / file_name(deep.name))
    assert fields["general.file_type"] == 32
    assert {n: t.tensor_type.name for n, t in tensors.items() if n.endswith("norm.weight") or "norm_2" in n} == {
        "blk.0.attn_norm.weight": "F32", "blk.0.attn_norm_2.weight": "F32", "blk.0.ffn_norm.weight": "F32",
        "output_norm.weight": "F32"}
    assert tensors["fc.weight"].tensor_type.name == "BF16"
    fc = as_torch(tensors["fc.weight"]).reshape(head.fc.weight.shape)
    assert torch.equal(fc, head.fc.weight.detach().to(torch.bfloat16).float())
    assert "d2t" not in tensors                                      # the whole vocabulary: no map
    assert [int(n) for n in tensors["output.weight"].shape] == [deep.hidden_size, VOCAB]


def rope_half(x: torch.Tensor, pos: int, d: int) -> torch.Tensor:
    """Hugging Face's RoPE of one head's vector: rotate the halves (i, i + d/2)."""
    inv = 1.0 / (10000 ** (torch.arange(0, d, 2, dtype=torch.float64) / d))
    cos, sin = torch.cos(pos * inv), torch.sin(pos * inv)
    a, b = x[: d // 2], x[d // 2:]
    return torch.cat([a * cos - b * sin, b * cos + a * sin])


def rope_pairs(x: torch.Tensor, pos: int, d: int) -> torch.Tensor:
    """llama.cpp's LLAMA_ROPE_TYPE_NORM: rotate adjacent pairs (2i, 2i + 1)."""
    inv = 1.0 / (10000 ** (torch.arange(0, d, 2, dtype=torch.float64) / d))
    cos, sin = torch.cos(pos * inv), torch.sin(pos * inv)
    a, b = x[0::2], x[1::2]
    out = torch.empty_like(x)
    out[0::2], out[1::2] = a * cos - b * sin, b * cos + a * sin
    return out


def test_permuted_rows_under_llama_cpps_rope_give_the_heads_attention_scores():
    heads, d, width = 3, 8, 5
    g = torch.Generator().manual_seed(0)
    wq, wk = torch.randn(heads * d, width, generator=g, dtype=torch.float64), torch.randn(
        heads * d, width, generator=g, dtype=torch.float64)
    x, y = torch.randn(width, generator=g, dtype=torch.float64), torch.randn(width, generator=g, dtype=torch.float64)
    assert torch.equal(unpermute(permute(wq, heads), heads), wq)
    for h in range(heads):
        rows = slice(h * d, (h + 1) * d)
        hf = rope_half((wq @ x)[rows], 7, d) @ rope_half((wk @ y)[rows], 3, d)
        cpp = rope_pairs((permute(wq, heads) @ x)[rows], 7, d) @ rope_pairs((permute(wk, heads) @ y)[rows], 3, d)
        assert torch.allclose(hf, cpp, atol=1e-12)


@pytest.mark.parametrize("options, says", [
    (dict(design="eagle", feature_layers=()), "is an EAGLE-1/2 head"),
    (dict(fc_norm=True), "normalises each tapped layer before fc"),
    (dict(norm_output=True), "feeds its normalised output back"),
])
def test_what_llama_cpp_cannot_run_is_refused_in_one_line(deep, tmp_path, options, says):
    torch.manual_seed(0)
    design = options.pop("design", "eagle3")
    taps = options.pop("feature_layers", TAPS)
    head = trained_like(DraftHead.for_target(deep, None, feature_layers=taps, design=design, **options))
    save_head(head, tmp_path / "head", deep, dtype=torch.float32)
    gguf = target_gguf(tmp_path / "target.gguf", deep)
    with pytest.raises(ValueError) as err:
        export(tmp_path / "head", "gguf-eagle3", tmp_path / "out", deep, torch.float32, target_gguf=gguf)
    message = str(err.value)
    assert says in message and "\n" not in message and message.endswith("Not written")
    assert not (tmp_path / "out").exists()


def test_the_target_gguf_must_be_given_and_be_the_targets(deep, tmp_path):
    _, path = eagle3_head(deep, tmp_path)
    with pytest.raises(ValueError, match=r"^target 'tiny-llama' was not loaded from a GGUF file: pass --target-gguf"):
        export(path, "gguf-eagle3", tmp_path / "out", deep, torch.float32)
    other = target_gguf(tmp_path / "other.gguf", deep, tokens=VOCAB + 4)
    with pytest.raises(ValueError, match=r"has 100 tokens; the target has 96"):
        export(path, "gguf-eagle3", tmp_path / "out", deep, torch.float32, target_gguf=other)
    shallow = target_gguf(tmp_path / "shallow.gguf", deep, layers=4)
    with pytest.raises(ValueError, match=r"llama.block_count 4; the target has 8"):
        export(path, "gguf-eagle3", tmp_path / "out", deep, torch.float32, target_gguf=shallow)
    with pytest.raises(FileNotFoundError, match="no such file"):
        export(path, "gguf-eagle3", tmp_path / "out", deep, torch.float32, target_gguf=tmp_path / "none.gguf")
    assert not (tmp_path / "out").exists()


def test_target_gguf_belongs_to_gguf_eagle3_on_the_command_line(tmp_path, capsys):
    code = main(["somewhere", "--format", "eagle3", "--out", str(tmp_path / "o"), "--target-gguf", "x.gguf"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1 and "--target-gguf is an option of --format gguf-eagle3" in err
