"""Tree verification: each node's logits equal a plain forward along its root path."""
from __future__ import annotations

import pytest
import torch
from conftest import VOCAB

from eagle_lite.kv_cache import ContextOverflowError, StaticKVCache
from eagle_lite.tree import DraftTree, attention_mask, rerank


def random_tree(n: int, seed: int) -> DraftTree:
    g = torch.Generator().manual_seed(seed)
    parents = [-1] + [int(torch.randint(i, (1,), generator=g)) for i in range(1, n)]
    return DraftTree(torch.randint(VOCAB, (n,), generator=g), parents)


@pytest.mark.parametrize("n_nodes,prefix_len", [(1, 5), (7, 1), (25, 33)])
def test_tree_logits_match_sequential_forward(any_family, n_nodes, prefix_len):
    target = any_family
    prefix = torch.randint(VOCAB, (prefix_len,), generator=torch.Generator().manual_seed(1))
    tree = random_tree(n_nodes, seed=n_nodes)
    cache = target.new_cache(prefix_len + n_nodes)
    with torch.inference_mode():
        target.forward(prefix, cache)
        cache.commit(prefix_len)
        logits, hidden = target.forward(tree.tokens, cache, tree.ancestors, tree.depths, logits_rows=slice(None))
        for node in range(n_nodes):
            path = [node]
            while tree.parents[path[-1]] >= 0:
                path.append(tree.parents[path[-1]])
            seq = torch.cat([prefix, tree.tokens[path[::-1]]])
            out = target.model(seq[None], output_hidden_states=True)
            torch.testing.assert_close(logits[node], out.logits[0, -1], atol=1e-4, rtol=1e-4)
            torch.testing.assert_close(hidden[node], out.hidden_states[-1][0, -1], atol=1e-4, rtol=1e-4)


def test_only_requested_logit_rows_are_computed(llama):
    cache = llama.new_cache(16)
    with torch.inference_mode():
        logits, hidden = llama.forward(torch.arange(10), cache, logits_rows=slice(-1, None))
    assert logits.shape == (1, VOCAB) and hidden.shape == (10, llama.hidden_size)


def test_compaction_keeps_exactly_the_accepted_path():
    cache = StaticKVCache(num_layers=2, kv_heads=1, head_dim=3, max_len=20)
    cache.commit(4)
    cache.reserve(6)
    for layer in range(2):  # node i of the tree writes the value 100*layer + i into every slot of its row
        vals = (torch.arange(6.0) + 100 * layer).view(1, 1, 6, 1).expand(1, 1, 6, 3)
        keys, _ = cache.update(vals, vals + 0.5, layer)
        assert keys.shape[2] == 10
    cache.compact(torch.tensor([0, 2, 5]))
    assert cache.length == 7
    for layer in range(2):
        kept = cache.keys[layer, 0, 0, 4:7, 0]
        assert kept.tolist() == [100 * layer + i for i in (0, 2, 5)]
        assert cache.values[layer, 0, 0, 4:7, 0].tolist() == [100 * layer + i + 0.5 for i in (0, 2, 5)]


def test_cache_refuses_to_overflow():
    cache = StaticKVCache(1, 1, 2, max_len=8)
    cache.commit(6)
    with pytest.raises(ContextOverflowError, match="do not fit"):
        cache.reserve(3)


def test_attention_mask_shows_prefix_and_ancestors():
    tree = DraftTree(torch.tensor([5, 6, 7, 8]), [-1, 0, 0, 1])
    mask = attention_mask(3, tree.ancestors)[0, 0]
    assert mask.shape == (4, 7)
    assert mask[:, :3].all()
    assert mask[3, 3:].tolist() == [True, True, False, True]   # node 3 sees root, node 1, itself
    assert mask[2, 3:].tolist() == [True, False, True, False]
    assert tree.depths.tolist() == [0, 1, 1, 2]


def test_rerank_keeps_a_connected_tree_of_the_best_nodes():
    # candidates: 0,1 are root children; 2,3 children of 0; 4 child of 1; 5 child of 2 (parents by number: c + 1)
    scores = torch.tensor([-0.1, -2.0, -0.5, -0.5, -2.5, -0.5])
    parents = torch.tensor([0, 0, 1, 1, 2, 3])
    kept, tree_parents = rerank(scores, parents, budget=4)
    assert kept.tolist() == [0, 2, 3, 5]          # ties keep parents first, 1 and 4 drop
    assert tree_parents.tolist() == [0, 1, 1, 2]  # tree node j+1 for kept[j]
    with pytest.raises(ValueError, match="parent"):
        DraftTree(torch.tensor([1, 2]), [-1, 1])


def test_rerank_keeps_a_connected_tree_when_a_broken_draft_scores_nan():
    nan = float("nan")
    scores = torch.tensor([-3.4, -3.5, -3.6, nan, nan, nan, nan, nan, nan])   # the root's children, then theirs
    parents = torch.tensor([0, 0, 0, 1, 1, 1, 2, 2, 2])                      # by number: candidate c is c + 1
    kept, tree_parents = rerank(scores, parents, 5)
    assert all(p <= j for j, p in enumerate(tree_parents.tolist()))   # every kept node's parent is kept first
    assert kept[:3].tolist() == [0, 1, 2]
