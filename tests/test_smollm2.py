"""On the real embedded target (slow: run with `make test-slow`): every method gives the target's greedy output."""
from __future__ import annotations

import pytest
import torch
from conftest import eagle_drafter

from eagle_lite.config import GenerationConfig
from eagle_lite.decoding.engine import Engine
from eagle_lite.drafters import NoDrafter
from eagle_lite.heads.draft import DraftHead

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def smollm2():
    from eagle_lite.targets.loading import load_target

    return load_target("smollm2")


def test_eagle_random_head_equals_vanilla_equals_transformers(smollm2):
    ids = smollm2.tokenizer.apply_chat_template([{"role": "user", "content": "Write a haiku about autumn."}],
                                                add_generation_prompt=True, return_dict=False)
    x = torch.tensor([ids])
    with smollm2.stock():  # the reference is stock transformers
        ref = smollm2.model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=48, do_sample=False)
    ref = ref[0, len(ids):].tolist()
    cfg = GenerationConfig(max_new_tokens=48)
    assert Engine(smollm2, NoDrafter()).generate(ids, cfg).token_ids == ref
    torch.manual_seed(0)
    eagle = Engine(smollm2, eagle_drafter(smollm2, DraftHead.for_target(smollm2)))
    assert eagle.generate(ids, cfg).token_ids == ref


def test_shipped_head_is_the_default_and_exact(smollm2):
    """`load()` speculates with the head shipped for SmolLM2 (if one ships): same tokens as transformers,
    more than one token per target forward on a chat prompt, with the head's recommended tree."""
    from eagle_lite.formats import load_head
    from eagle_lite.heads.checkpoint import default_head_path

    path = default_head_path("smollm2")
    if path is None:
        pytest.skip("no head ships for smollm2")
    head = load_head(path, smollm2)
    assert head.tree is not None, "a shipped head records the tree eval.tune found fastest"
    ids = smollm2.tokenizer.apply_chat_template([{"role": "user", "content": "Explain what a linked list is."}],
                                                add_generation_prompt=True, return_dict=False)
    x = torch.tensor([ids])
    with smollm2.stock():
        ref = smollm2.model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=64, do_sample=False)
    ref = ref[0, len(ids):].tolist()
    out = Engine(smollm2, eagle_drafter(smollm2, head)).generate(
        ids, GenerationConfig(max_new_tokens=64, tree=head.tree))
    assert out.token_ids == ref
    assert out.stats.accept_length_mean > 1.25   # the head drafts (vanilla: 1.00); its CPU tree is one node + lookup


def test_the_gguf_weights_run_from_their_grid_codes(smollm2):
    """SmolLM2's GGUF is Q4_1 (decoder linears) and Q8_0 (embeddings / lm_head): after de-quantization every
    one of those fp32 weights is found on its grid, so all of them run through the native kernels, and every
decoder layer as one op (fused_layer.py)."""
    from eagle_lite.kernels.cpu_linear import _GridProduct
    from eagle_lite.kernels.grid_linear import Grid4, Grid8
    from eagle_lite.kernels.native import kernel_available

    if not kernel_available():
        pytest.skip("eagle_lite's native kernels do not build here")
    linears = [m for m in smollm2.decoder.modules() if isinstance(m, torch.nn.Linear)]
    products = []
    for linear in linears:        # per layer 4 products: q/k/v (shared), o, gate/up (shared), down
        product = linear.cpu_product if hasattr(linear, "cpu_product") else linear.sibling_product.product
        if not any(product is seen for seen in products):
            products.append(product)
    assert len(linears) == 210 and len(products) == 4 * 30
    assert all(isinstance(p, _GridProduct) and isinstance(p.grid, Grid4) for p in products)
    assert isinstance(smollm2.lm_grid, Grid8)
    assert all(hasattr(layer, "fused_parts") for layer in smollm2.decoder.layers)   # each layer one native op
