"""Moving a trained head into the serving engines' layout (no fc bias, no input norm): trainers/relayout.py."""
from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from conftest import tiny_train_config  # noqa: E402

from eagle_lite.formats import load_head  # noqa: E402
from eagle_lite.heads.checkpoint import read_head_config  # noqa: E402
from eagle_lite.heads.draft import DraftHead  # noqa: E402
from trainers.relayout import fc_rms, relayout  # noqa: E402
from trainers.targets import TargetConfig, tiny_target  # noqa: E402


@pytest.fixture(scope="module")
def target():
    return tiny_target(TargetConfig(name="tiny", kind="tiny", seed=0))


def one_token(head, hidden, embeds):
    mask = torch.ones(1, 1, 1, 1, dtype=torch.bool)
    return head(hidden[None], embeds[None], torch.zeros(1, 1, dtype=torch.long), mask)[0]


def test_folding_the_input_norm_is_exact_at_the_folded_rms(target):
    torch.manual_seed(0)
    head = DraftHead.for_target(target).float()
    with torch.no_grad():
        head.fc.bias.zero_()                                   # a zero bias: dropping it changes nothing
        head.layer.input_layernorm.weight.uniform_(0.5, 1.5)   # a norm that does something
    hidden, embeds = torch.randn(1, 64), torch.randn(1, 64)
    rms = fc_rms(head, hidden, embeds)
    served = relayout(head, target, fc_bias=False, input_norm=False, rms=rms)
    assert not served.fc_bias and not served.input_norm
    assert torch.allclose(one_token(served, hidden, embeds), one_token(head, hidden, embeds), atol=1e-5)
    # another token's fc output has another RMS: close, not exact, which fine-tuning then corrects
    other = relayout(head, target, fc_bias=False, input_norm=False, rms=rms * 2)
    assert not torch.allclose(one_token(other, hidden, embeds), one_token(head, hidden, embeds), atol=1e-3)


def test_relayout_refuses_what_it_cannot_carry(target):
    head = DraftHead.for_target(target, fc_bias=False, input_norm=False).float()
    with pytest.raises(ValueError, match="input norm it was not trained with"):
        relayout(head, target, fc_bias=False, input_norm=True)
    with pytest.raises(ValueError, match="mean RMS"):
        relayout(DraftHead.for_target(target).float(), target, fc_bias=True, input_norm=False)
    grown = relayout(head, target, fc_bias=True, input_norm=False)    # a zero bias is the same function
    assert grown.fc_bias and torch.count_nonzero(grown.fc.bias) == 0


def test_fine_tuning_into_the_served_layout_exports_it(tmp_path, target):
    from trainers.train import train

    source = Path(train(tiny_train_config(tmp_path, "debug=fdr", "name=src", "draft.vocab_size=32"))["export"])
    assert load_head(source, target).fc_bias and load_head(source, target).input_norm
    result = train(tiny_train_config(tmp_path, "debug=fdr", "name=served", f"draft.init_from={source}",
                                     "draft.fc_bias=false", "draft.input_norm=false"))
    config = read_head_config(result["export"])
    assert config["fc_bias"] is False and config["input_norm"] is False
    head = load_head(result["export"], target)
    assert not head.fc_bias and not head.input_norm and head.draft_vocab_size == 32
    scratch = train(tiny_train_config(tmp_path, "debug=fdr", "name=scratch", "draft.fc_bias=false",
                                      "draft.input_norm=false"))
    assert read_head_config(scratch["export"])["fc_bias"] is False
