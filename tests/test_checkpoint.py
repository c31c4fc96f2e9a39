"""Draft heads round-trip through safetensors and refuse the wrong target or damaged files."""
from __future__ import annotations

import json

import pytest
import torch
from conftest import make_target

from eagle_lite.config import TreeConfig
from eagle_lite.formats import load_head
from eagle_lite.heads.checkpoint import HeadMismatchError, save_head
from eagle_lite.heads.draft import DraftHead
from eagle_lite.tree import attention_mask


def head_outputs(head: DraftHead, target) -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(1, 5, target.hidden_size, generator=g)
    embeds = target.embed_tokens(torch.tensor([[1, 2, 3, 4, 5]]))
    mask = attention_mask(0, torch.ones(5, 5, dtype=torch.bool).tril())
    with torch.no_grad():
        return head(hidden, embeds, torch.arange(5)[None], mask)


def test_head_round_trips(llama, tmp_path):
    torch.manual_seed(0)
    head = DraftHead.for_target(llama, d2t=torch.tensor([3, 1, 4, 15, 9]))
    save_head(head, tmp_path / "head", llama, dtype=torch.float32, extra={"note": "test"})
    loaded = load_head(tmp_path / "head", llama)
    torch.testing.assert_close(head_outputs(loaded, llama), head_outputs(head, llama))
    assert loaded.d2t.tolist() == [3, 1, 4, 15, 9]
    config = json.loads((tmp_path / "head" / "config.json").read_text())
    assert config["target"] == llama.fingerprint() and config["note"] == "test"


def test_head_for_another_architecture_is_refused(llama, tmp_path):
    save_head(DraftHead.for_target(llama), tmp_path / "head", llama)
    other = make_target("llama", hidden=32)
    with pytest.raises(HeadMismatchError, match=r"trained for target 'tiny-llama' \(llama, hidden 64.*got.*hidden 32"):
        load_head(tmp_path / "head", other)


def test_head_for_same_shaped_but_different_weights_is_refused(llama, tmp_path):
    save_head(DraftHead.for_target(llama), tmp_path / "head", llama)
    with pytest.raises(HeadMismatchError, match="embeddings"):
        load_head(tmp_path / "head", make_target("llama", seed=1))


def test_truncated_weights_are_a_clear_error(llama, tmp_path):
    path = save_head(DraftHead.for_target(llama), tmp_path / "head", llama)
    weights = path / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    with pytest.raises(ValueError, match="corrupt or truncated"):
        load_head(path, llama)


def test_corrupt_or_missing_config_is_a_clear_error(llama, tmp_path):
    with pytest.raises(FileNotFoundError, match="no draft head"):
        load_head(tmp_path / "nowhere", llama)
    path = save_head(DraftHead.for_target(llama), tmp_path / "head", llama)
    (path / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match="config .* is corrupt"):
        load_head(path, llama)


def test_recommended_tree_round_trips_and_a_bad_one_is_refused(llama, tmp_path):
    path = save_head(DraftHead.for_target(llama), tmp_path / "head", llama,
                     extra={"tree": {"depth": 3, "top_k": 4, "total_tokens": 8}})
    assert load_head(path, llama).tree == TreeConfig(3, 4, 8)
    assert load_head(save_head(DraftHead.for_target(llama), tmp_path / "plain", llama), llama).tree is None
    bad = save_head(DraftHead.for_target(llama), tmp_path / "bad", llama,
                    extra={"tree": {"depth": 2, "top_k": 2, "total_tokens": 99}})
    with pytest.raises(ValueError, match='invalid "tree"'):
        load_head(bad, llama)


def test_each_device_gets_its_own_recommended_tree(llama, tmp_path):
    from eagle_lite.heads.checkpoint import read_head_config, recommend_tree, recommended_tree

    path = save_head(DraftHead.for_target(llama), tmp_path / "head", llama,
                     extra={"tree": {"depth": 2, "top_k": 2, "total_tokens": 2, "lookup": 4}})
    config = read_head_config(path)
    assert recommended_tree(config, path, "cuda") is None   # no GPU tree yet: a CPU's says nothing of a GPU's
    recommend_tree(path, TreeConfig(6, 10, 60, 8), "python -m eval.tune --save-tree", device="cuda")
    config = read_head_config(path)
    assert recommended_tree(config, path, "cuda") == TreeConfig(6, 10, 60, 8)
    assert recommended_tree(config, path, "cpu") == TreeConfig(2, 2, 2, 4)    # the CPU's tree is untouched
    assert config["tree_cuda_command"] == "python -m eval.tune --save-tree" and "tree_command" not in config
    assert load_head(path, llama).tree == TreeConfig(2, 2, 2, 4)              # a CPU target reads "tree"


def test_the_shipped_head_recommends_a_valid_tree_on_each_device():
    from eagle_lite.heads.checkpoint import default_head_path, read_head_config, recommended_tree

    path = default_head_path("smollm2")
    config = read_head_config(path)
    cpu, cuda = recommended_tree(config, path, "cpu"), recommended_tree(config, path, "cuda")
    assert cpu is not None and cuda is not None
    assert cuda.total_tokens > cpu.total_tokens   # a GPU verifies a big tree for about the price of one token
