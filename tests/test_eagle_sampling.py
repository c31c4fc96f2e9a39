"""EAGLE's sampling with the draft's probabilities (EagleOptions.draft_sampling="q"): trees drawn from the head's
distribution, accepted sibling by sibling by recursive rejection, keep the target's distribution exactly.

The Monte-Carlo tests run the real tree builder (`drafters.eagle_tree.grow_tree`) and acceptance (`accept_sampling`)
over a Markov toy: the target's next token after token a is drawn from P[a], the draft's from Q[a] (a different,
sharper matrix), over 6 tokens. Each draw decodes speculative steps from token 0 until two tokens are out, and the
law of those two tokens is compared with the exact P[0, a] P[a, b] by total variation (36 outcomes; with 12k
draws the estimate's own noise is ~0.02, TV_BOUND 0.035), and by a chi-square bound. The negative controls run the
same test on rules that are not exact, and it fails them: the test can tell.
"""
from __future__ import annotations

from collections import Counter

import pytest
import torch
from conftest import continuation_tv, eagle_drafter, reference_greedy, tv

from eagle_lite.config import GenerationConfig, SamplingConfig, TreeConfig
from eagle_lite.decoding.accept import accept_sampling, target_probs
from eagle_lite.decoding.engine import Engine
from eagle_lite.drafters import EagleOptions, registry
from eagle_lite.drafters import eagle_tree as eagle_module
from eagle_lite.heads.draft import DraftHead
from eagle_lite.tree import DraftTree, SampledRows, graft_chain

V = 6
P = torch.tensor([[0.05, 0.30, 0.10, 0.35, 0.15, 0.05],
                  [0.40, 0.05, 0.25, 0.10, 0.10, 0.10],
                  [0.10, 0.10, 0.10, 0.50, 0.10, 0.10],
                  [0.20, 0.20, 0.05, 0.05, 0.30, 0.20],
                  [0.30, 0.05, 0.30, 0.05, 0.25, 0.05],
                  [0.15, 0.15, 0.15, 0.15, 0.20, 0.20]])
# the draft: sharper than the target and often wrong about the likeliest token
Q = torch.tensor([[0.02, 0.60, 0.03, 0.20, 0.10, 0.05],
                  [0.10, 0.02, 0.70, 0.08, 0.05, 0.05],
                  [0.05, 0.05, 0.05, 0.10, 0.70, 0.05],
                  [0.60, 0.05, 0.05, 0.05, 0.20, 0.05],
                  [0.05, 0.05, 0.80, 0.03, 0.05, 0.02],
                  [0.05, 0.05, 0.05, 0.05, 0.05, 0.75]])
N_DRAWS = 12_000
TV_BOUND = 0.035
TEMPERATURE = SamplingConfig(temperature=1.0)


def exact_pairs(sampling: SamplingConfig) -> dict[tuple, float]:
    p = target_probs(P.log(), sampling)
    return {(a, b): float(p[0, a] * p[a, b]) for a in range(V) for b in range(V)}


def assert_exact(counts: Counter, probs: dict, total: int) -> None:
    """TV within the bound, no outcome outside the support, and Pearson's chi-square within 5 standard deviations of
    its mean (an exact sampler lands within one; a bias of a few draws in a hundred is far out)."""
    assert tv(counts, probs, total) < TV_BOUND
    assert all(probs.get(k, 0.0) > 0 for k in counts)
    support = [p for p in probs.values() if p > 0]
    chi2 = sum((counts.get(k, 0) - total * p) ** 2 / (total * p) for k, p in probs.items() if p > 0)
    df = len(support) - 1
    assert chi2 < df + 5 * (2 * df) ** 0.5, chi2


def q_tree(root: int, shape: TreeConfig, sampling: SamplingConfig, g: torch.Generator) -> DraftTree:
    """The sampled tree eagle drafts, with Q for its head."""
    return eagle_module.grow_tree(root, Q[root].log()[None], lambda rows, tokens: Q[tokens].log(), shape,
                                  sampling, g, None, V)


def decode_pairs(propose, sampling: SamplingConfig, draws: int = N_DRAWS, seed: int = 0) -> tuple[Counter, float]:
    """The law of the first two tokens after token 0 (speculative steps until two are out), and the mean number of
    tokens a step emits."""
    g = torch.Generator().manual_seed(seed)
    counts, emitted, steps = Counter(), 0, 0
    for _ in range(draws):
        out = []
        while len(out) < 2:
            tree = propose(out[-1] if out else 0, g)
            path, bonus = accept_sampling(tree, P[tree.tokens].log(), sampling, g)
            new = tree.tokens[path[1:]].tolist() + [bonus]
            out += new
            emitted, steps = emitted + len(new), steps + 1
        counts[tuple(out[:2])] += 1
    return counts, emitted / steps


SHAPES = {
    "one child (the CPU tree)": TreeConfig(depth=1, top_k=1, total_tokens=1),
    "siblings, pruned": TreeConfig(depth=1, top_k=4, total_tokens=2),
    "depth 2, pruned": TreeConfig(depth=2, top_k=2, total_tokens=3),
    "depth 3, pruned, min_prob": TreeConfig(depth=3, top_k=3, total_tokens=5, min_prob=0.02),
    "a chain, min_prob": TreeConfig(depth=3, top_k=1, total_tokens=2, min_prob=0.3),
}


@pytest.mark.parametrize("shape", SHAPES.values(), ids=SHAPES.keys())
def test_sampled_trees_keep_the_targets_law(shape):
    counts, per_step = decode_pairs(lambda root, g: q_tree(root, shape, TEMPERATURE, g), TEMPERATURE)
    assert_exact(counts, exact_pairs(TEMPERATURE), N_DRAWS)
    assert per_step > 1.2                     # drafted tokens were accepted: the rejection branches all ran


@pytest.mark.parametrize("chain", [[1, 2], [3, 0, 4]])
def test_sampled_trees_with_a_grafted_chain_keep_the_targets_law(chain):
    """A deterministic chain grafted on (as LookupGraft does): its nodes are point masses tried after the sampled
    siblings, or it runs through a sampled node of the same token."""
    shape = TreeConfig(depth=2, top_k=2, total_tokens=3)
    counts, _ = decode_pairs(lambda root, g: graft_chain(q_tree(root, shape, TEMPERATURE, g), chain), TEMPERATURE)
    assert_exact(counts, exact_pairs(TEMPERATURE), N_DRAWS)


def test_sampled_trees_keep_the_law_under_temperature_top_k_and_top_p():
    """q and p both under the same truncation: q may draw tokens p cannot take, and the other way round."""
    sampling = SamplingConfig(temperature=0.7, top_k=4, top_p=0.9)
    shape = TreeConfig(depth=2, top_k=3, total_tokens=4)
    counts, _ = decode_pairs(lambda root, g: q_tree(root, shape, sampling, g), sampling)
    assert_exact(counts, exact_pairs(sampling), N_DRAWS)


# -- negative controls: the same test fails rules that are not exact ------------------------------------------

def top_k_with_q_rows(root: int, shape: TreeConfig, sampling: SamplingConfig, g: torch.Generator) -> DraftTree:
    """The inexact rule: the deterministic top-k tree, accepted sibling-wise as if each child had been drawn from
    the draft's q (less its earlier siblings)."""
    tree = eagle_module.grow_tree(root, Q[root].log()[None], lambda rows, tokens: Q[tokens].log(), shape)
    tokens = tree.tokens.tolist()
    rows = torch.zeros(len(tree), V)
    for parent, kids in enumerate(tree.children):
        q = target_probs(Q[tokens[parent]].log(), sampling)
        for kid in kids:
            rows[kid] = q / q.sum()
            q = q.clone()
            q[tokens[kid]] = 0.0
    return DraftTree(tree.tokens, tree.parents, rows)


def test_negative_control_deterministic_children_with_q_rows_fail():
    shape = TreeConfig(depth=2, top_k=2, total_tokens=3)
    counts, _ = decode_pairs(lambda root, g: top_k_with_q_rows(root, shape, TEMPERATURE, g), TEMPERATURE)
    assert tv(counts, exact_pairs(TEMPERATURE), N_DRAWS) > 2 * TV_BOUND


def test_negative_control_ranking_drawn_children_by_their_own_probability_fails(monkeypatch):
    """EAGLE-2's rank (a node's own path probability) over drawn children: the pruning keeps the likelier of the
    draws, which are then no longer distributed as q."""
    monkeypatch.setattr(eagle_module, "sampled_values", lambda parent_cum, p: (parent_cum[:, None] + p.log(),) * 2)
    shape = TreeConfig(depth=1, top_k=3, total_tokens=1)
    counts, _ = decode_pairs(lambda root, g: q_tree(root, shape, TEMPERATURE, g), TEMPERATURE)
    assert tv(counts, exact_pairs(TEMPERATURE), N_DRAWS) > 2 * TV_BOUND


# -- the tree's rows and the drafter -------------------------------------------------------------------------

def test_sampled_rows_are_the_draws_distributions_less_earlier_siblings():
    dists = torch.tensor([[0.5, 0.3, 0.2], [0.1, 0.1, 0.8]])
    vocab = torch.tensor([4, 0, 2])            # draft token i is target token vocab[i]
    rows = SampledRows(dists, vocab, 5, tokens=[1, 4, 0, 2, 3], source=[-1, 0, 0, 1, -1],
                       excluded=[[], [], [4], [], []])
    torch.testing.assert_close(rows[1], torch.tensor([0.3, 0.0, 0.2, 0.0, 0.5]))
    torch.testing.assert_close(rows[2], torch.tensor([0.6, 0.0, 0.4, 0.0, 0.0]))   # 4 drawn before it
    torch.testing.assert_close(rows[3], torch.tensor([0.1, 0.0, 0.8, 0.0, 0.1]))
    torch.testing.assert_close(rows[4], torch.tensor([0.0, 0.0, 0.0, 1.0, 0.0]))   # chosen, not drawn


def test_grow_tree_keeps_sibling_prefixes_and_values_never_increase():
    """Children come in draw order; a kept child's rank value is at most its parent's and its earlier siblings'."""
    g = torch.Generator().manual_seed(3)
    for _ in range(200):
        shape = TreeConfig(depth=3, top_k=3, total_tokens=6)
        tree = q_tree(int(torch.randint(V, (1,), generator=g)), shape, TEMPERATURE, g)
        rows: SampledRows = tree.q_draft
        tokens = tree.tokens.tolist()
        for kids in tree.children:
            assert len({tokens[c] for c in kids}) == len(kids)            # drawn without replacement
            for i, kid in enumerate(kids):
                assert rows.excluded[kid] == [tokens[c] for c in kids[:i]]
                assert rows.source[kid] >= 0


def test_greedy_output_is_unchanged_by_the_sampling_rule(llama):
    torch.manual_seed(0)
    head = DraftHead.for_target(llama)
    prompt = [5, 6, 5, 6, 5, 6, 5]
    cfg = GenerationConfig(max_new_tokens=24, tree=TreeConfig(depth=3, top_k=3, total_tokens=5, lookup=3),
                           stop_at_eos=False)
    for rule in ("q", "match"):
        out = Engine(llama, eagle_drafter(llama, head, draft_sampling=rule)).generate(prompt, cfg)
        assert out.token_ids == reference_greedy(llama, prompt, 24), rule


def test_engine_sampling_with_q_trees_and_a_lookup_graft_matches_target(llama):
    """End to end: the EAGLE drafter's sampled trees under a tree with a lookup graft set, through the engine (the
    graft joins greedy trees only: test_the_lookup_graft_joins_greedy_trees_only; a grafted chain's sampled law:
    test_sampled_trees_with_a_grafted_chain_keep_the_targets_law)."""
    sampling = SamplingConfig(temperature=0.8, top_k=4)
    prompt = [5, 6, 5, 6, 5, 6, 5]             # the 2-gram before each root has occurred: lookup proposes
    torch.manual_seed(0)
    drafter = eagle_drafter(llama, DraftHead.for_target(llama), draft_sampling="q")
    sampled = []
    propose = drafter.propose
    drafter.propose = lambda inp, tree: sampled.append((t := propose(inp, tree)).q_draft is not None) or t
    engine = Engine(llama, drafter)
    tree = TreeConfig(depth=2, top_k=2, total_tokens=3, lookup=3)
    distance = continuation_tv(llama, engine, prompt, sampling, tree)
    assert any(sampled)
    assert distance < 0.12


def test_the_lookup_graft_joins_greedy_trees_only(llama):
    """LookupGraft grafts its chain onto greedy trees; a sampled step verifies the head's tree alone (a copied token is
    accepted with the target's probability of it, and the graft did not pay on held-out prompts sampled)."""
    prompt = [5, 6, 5, 6, 5, 6, 5]             # the 2-gram before each root has occurred: lookup proposes
    tree = TreeConfig(depth=2, top_k=2, total_tokens=3, lookup=3)
    sizes = {}
    for name, sampling in (("greedy", SamplingConfig()), ("sampled", SamplingConfig(temperature=0.8))):
        drafter = eagle_drafter(llama, DraftHead.for_target(llama), draft_sampling="q")
        seen, propose = [], drafter.propose
        drafter.propose = lambda inp, tree, seen=seen, propose=propose: seen.append(len(t := propose(inp, tree))) or t
        Engine(llama, drafter).generate(prompt, GenerationConfig(max_new_tokens=12, sampling=sampling, tree=tree,
                                                                 seed=0))
        sizes[name] = max(seen)
    assert sizes["greedy"] > 1 + tree.total_tokens      # the chain's nodes beside the head's
    assert sizes["sampled"] <= 1 + tree.total_tokens


def test_draft_sampling_option_is_checked():
    with pytest.raises(ValueError, match="draft_sampling"):
        registry.check("eagle", EagleOptions(draft="random", draft_sampling="top"))


@pytest.mark.parametrize("shape", [TreeConfig(depth=1, top_k=1, total_tokens=1),
                                   TreeConfig(depth=4, top_k=1, total_tokens=4),
                                   TreeConfig(depth=4, top_k=1, total_tokens=2),
                                   TreeConfig(depth=5, top_k=1, total_tokens=5, min_prob=0.3)])
def test_a_sampled_chain_is_the_tree_the_expansion_grows(shape):
    """A top_k 1 sampled tree takes `sampled_chain_steps`: the same draws, nodes, scores and q rows as the expansion
    and rerank (`expanded_tree_steps`), the generator left in the same state."""
    vocab = torch.tensor([4, 0, 2, 5, 1, 3])             # draft token i is target token vocab[i]
    table = (torch.randn(V, V, generator=torch.Generator().manual_seed(5)) * 2).log_softmax(-1)
    for seed in range(40):
        trees, after = [], []
        for steps in (eagle_module.sampled_chain_steps, eagle_module.expanded_tree_steps):
            g = torch.Generator().manual_seed(seed)
            grow = steps(seed % V, table[seed % V][None], shape, TEMPERATURE, g, vocab, V)
            try:
                rows, tokens = next(grow)
                while True:
                    rows, tokens = grow.send(table[tokens])
            except StopIteration as grown:
                trees.append(grown.value)
            after.append(torch.rand(1, generator=g))
        chain, expanded = trees
        assert chain.tokens.tolist() == expanded.tokens.tolist() and chain.parents == expanded.parents
        assert chain.scores == expanded.scores
        assert chain.q_draft.source == expanded.q_draft.source and chain.q_draft.excluded == expanded.q_draft.excluded
        for node in range(1, len(chain)):
            assert torch.equal(chain.q_draft[node], expanded.q_draft[node])
        assert torch.equal(after[0], after[1])
