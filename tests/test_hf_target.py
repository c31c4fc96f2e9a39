"""`python -m eagle_lite.export --target SPEC --out DIR`: the target as a standard Hugging Face folder.

A tiny tied Llama stands in for the embedded SmolLM2 (tied embedding, rope_theta 100000, a fast tokenizer): the
folder must hold the embedding under its own name, the fields transformers 4.x reads at the top level of
config.json, a tokenizer class every version knows and a one-shard index, and reload to the same logits.
"""
from __future__ import annotations

import json

import pytest
import torch
from conftest import tiny_tokenizer
from safetensors import safe_open
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM

from eagle_lite import export as export_cli
from eagle_lite.formats.hf_target import write_target


def tied_llama(theta: float = 100000.0) -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                         tie_word_embeddings=True, rope_parameters={"rope_type": "default", "rope_theta": theta},
                         eos_token_id=2, pad_token_id=1, bos_token_id=None)
    model = LlamaForCausalLM(config).eval()
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    return model


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    model, tokenizer = tied_llama(), tiny_tokenizer()
    out = tmp_path_factory.mktemp("hf-target")
    files = write_target(model, tokenizer, out)
    return model, tokenizer, out, files


def test_the_tied_embedding_is_stored_under_its_own_name_with_an_index(written):
    model, _, out, files = written
    assert {"model.safetensors", "model.safetensors.index.json", "config.json", "tokenizer.json",
            "tokenizer_config.json"} <= set(files)
    with safe_open(out / "model.safetensors", "pt") as f:
        keys = set(f.keys())
        embed = f.get_tensor("model.embed_tokens.weight")
    assert "lm_head.weight" not in keys                    # tied: the embedding is the only copy
    assert torch.equal(embed, model.model.embed_tokens.weight)
    assert keys == set(model.state_dict()) - {"lm_head.weight"}
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert index["weight_map"] == {k: "model.safetensors" for k in keys}
    assert index["metadata"]["total_size"] == sum(p.numel() * 4 for k, p in model.state_dict().items()
                                                  if k != "lm_head.weight")


def test_config_carries_what_transformers_4_and_other_loaders_read(written):
    _, _, out, _ = written
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert config["rope_theta"] == 100000.0                # 4.x reads this key, not rope_parameters
    assert config["rope_parameters"]["rope_theta"] == 100000.0
    assert config["rope_scaling"] is None
    assert config["tie_word_embeddings"] is True
    assert config["torch_dtype"] == config["dtype"] == "float32"
    assert "quantization_config" not in config
    tok = json.loads((out / "tokenizer_config.json").read_text())
    assert tok["tokenizer_class"] == "PreTrainedTokenizerFast"
    assert tok["chat_template"] == (out / "chat_template.jinja").read_text()


def test_the_folder_reloads_to_the_same_logits_and_tokens(written):
    model, tokenizer, out, _ = written
    reloaded = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    assert reloaded.config.rope_parameters["rope_theta"] == 100000.0
    ids = torch.tensor([[5, 17, 40, 3, 88, 61, 9]])
    with torch.no_grad():
        assert torch.equal(reloaded(ids).logits, model(ids).logits)
    again = AutoTokenizer.from_pretrained(out)
    text = "Hello, world!"
    assert again(text)["input_ids"] == tokenizer(text)["input_ids"]
    chat = [{"role": "user", "content": "hi"}]
    assert again.apply_chat_template(chat, tokenize=False) == tokenizer.apply_chat_template(chat, tokenize=False)


def test_export_cli_writes_the_target_folder_and_checks_it(tmp_path, capsys):
    src, out = tmp_path / "src", tmp_path / "out"
    tied_llama(theta=50000.0).save_pretrained(src)
    tiny_tokenizer().save_pretrained(src)
    assert export_cli.main(["--target", str(src), "--out", str(out)]) == 0
    assert "same logits" in capsys.readouterr().out
    assert json.loads((out / "config.json").read_text())["rope_theta"] == 50000.0


def test_export_cli_without_a_head_or_target_is_one_line(tmp_path, capsys):
    assert export_cli.main(["--out", str(tmp_path / "x")]) == 2            # a bad command line: exit status 2
    assert export_cli.main(["--format", "eagle", "--target", "smollm2", "--out", str(tmp_path / "x")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 2 and all(line.startswith("error: ") for line in err)
