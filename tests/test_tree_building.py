"""The host side of drafting in few ops: ancestor masks, the rerank, greedy chains and the rotary table give what
the plain computations give."""
from __future__ import annotations

import math
import random

import pytest
import torch

from eagle_lite.config import TreeConfig
from eagle_lite.drafters.eagle_tree import grow_tree, grow_tree_steps
from eagle_lite.kernels import RotaryTable
from eagle_lite.tree import DraftTree, rerank


def naive_ancestors(parents: list[int]) -> torch.Tensor:
    n = len(parents)
    anc = torch.eye(n, dtype=torch.bool)
    for i in range(1, n):
        anc[i] |= anc[parents[i]]
    return anc


@pytest.mark.parametrize("n", [1, 2, 7, 63, 64, 100])
def test_ancestor_masks_match_the_row_by_row_closure(n):
    rng = random.Random(n)
    for _ in range(5):
        parents = [-1] + [rng.randrange(i) for i in range(1, n)]
        tree = DraftTree(torch.arange(n), parents)
        assert torch.equal(tree.ancestors, naive_ancestors(parents))
        assert tree.depths.tolist() == [int(row.sum()) - 1 for row in naive_ancestors(parents)]


def test_rerank_keeps_the_best_connected_nodes_with_their_parents():
    rng = random.Random(0)
    for _ in range(50):
        m = rng.randint(1, 40)
        parents = [-1 if i < 3 or rng.random() < 0.2 else rng.randrange(i) for i in range(m)]
        scores = []
        for p in parents:   # a child never scores above its parent
            scores.append((0.0 if p < 0 else scores[p]) - rng.random())
        budget = rng.randint(0, m)
        kept, tree_parents = rerank(torch.tensor(scores), torch.tensor(parents) + 1, budget)   # by number: c + 1
        best = sorted(range(m), key=lambda c: -scores[c])[:budget]
        assert kept.tolist() == sorted(best)
        slot = {c: j + 1 for j, c in enumerate(kept.tolist())}
        assert tree_parents.tolist() == [0 if parents[c] < 0 else slot[parents[c]] for c in kept.tolist()]


def reference_chain(table: torch.Tensor, root: int, tree: TreeConfig) -> list[int]:
    """The greedy chain by hand: each likeliest next token while the path log-probability stays >= log(min_prob)."""
    floor = math.log(tree.min_prob) if tree.min_prob > 0 else -math.inf
    chain, cum, token = [root], 0.0, root
    while len(chain) - 1 < min(tree.depth, tree.total_tokens):
        logp = torch.log_softmax(table[token], -1)
        token = int(logp.argmax())
        cum += float(logp[token])
        if cum < floor:
            break
        chain.append(token)
    return chain


@pytest.mark.parametrize("spec", [(1, 1, 1, 0, 0.0), (3, 1, 3, 0, 0.0), (5, 1, 3, 0, 0.0), (4, 1, 4, 0, 0.3),
                                  (6, 1, 6, 0, 0.05)])
def test_a_top1_greedy_tree_is_the_greedy_chain_with_no_wasted_expansion(spec):
    tree = TreeConfig(*spec)
    vocab = 50
    for seed in range(20):
        torch.manual_seed(seed)
        table = torch.randn(vocab, vocab) * 3      # the next token's logits after each token
        calls: list[list[int]] = []

        def expand(parent_row, tokens, table=table, calls=calls):
            calls.append(tokens.tolist())
            return table[tokens]

        root = seed % vocab
        drafted = grow_tree(root, table[root][None], expand, tree)
        chain = reference_chain(table, root, tree)
        assert drafted.tokens.tolist() == chain and drafted.parents == list(range(-1, len(chain) - 1))
        # one expansion after each kept token that may still have a child: none past the budget
        assert len(calls) == min(len(chain) - 1, min(tree.depth, tree.total_tokens) - 1)


def test_a_top1_chain_maps_draft_ids_to_target_ids():
    vocab = torch.tensor([5, 9, 11, 20])          # draft token i is target token vocab[i]
    logits = torch.tensor([[0.0, 4.0, 1.0, 0.0]])
    steps = grow_tree_steps(3, logits, TreeConfig(2, 1, 2, 0, 0.0), vocab=vocab)
    parent_row, tokens = next(steps)
    assert parent_row.tolist() == [0] and tokens.tolist() == [9]      # the head embeds the target's id
    with pytest.raises(StopIteration) as done:
        steps.send(torch.tensor([[0.0, 0.0, 0.0, 5.0]]))
    assert done.value.value.tokens.tolist() == [3, 9, 20]


def rotary(rope_type: str = "default"):
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    params = {"rope_type": rope_type, "rope_theta": 10000.0}
    if rope_type == "dynamic":
        params["factor"] = 2.0
    config = LlamaConfig(hidden_size=64, num_attention_heads=4, max_position_embeddings=64, rope_parameters=params)
    return LlamaRotaryEmbedding(config)


def test_the_rotary_table_gives_the_modules_own_rows_bit_for_bit():
    module = rotary()
    table = RotaryTable(module)
    x = torch.zeros(3, 64)
    with torch.inference_mode():
        for positions in (torch.tensor([0]), torch.tensor([5, 6, 6, 7]), torch.tensor([2000, 3]), torch.arange(40)):
            cos, sin = table(x, positions)
            want_cos, want_sin = module(x[None], positions[None])
            assert torch.equal(cos, want_cos[0]) and torch.equal(sin, want_sin[0])
            assert cos.is_contiguous() and cos.shape == (positions.numel(), 16)
    assert table._cos.shape[0] >= 2001                                  # grown on demand


def test_a_length_dependent_rotary_is_recomputed_every_time():
    table = RotaryTable(rotary("dynamic"))
    assert not table.static
    with torch.inference_mode():
        cos, _ = table(torch.zeros(1, 64), torch.tensor([3, 500]))
    assert table._cos is None and cos.shape == (2, 16)
