"""Acceptance: greedy follows the argmax; sampling reproduces the target's distribution exactly.

The Monte-Carlo tests bound the total-variation distance between the tokens speculative sampling
emits and the target's own distribution. With 20k seeded draws the sampling error of a TV estimate
over a handful of outcomes is ~0.01; a broken rule (e.g. accepting a child whenever q_draft likes it)
is off by 0.1-0.3.
"""
from __future__ import annotations

from collections import Counter

import pytest
import torch
from conftest import continuation_tv, exact_continuations, make_target, top_two_levels, tv
from test_grid_linear import needs_kernel

from eagle_lite.config import GenerationConfig, SamplingConfig
from eagle_lite.decoding.accept import _top_p_sorted, accept_greedy, accept_sampling, sample, target_probs
from eagle_lite.decoding.engine import Engine
from eagle_lite.drafters import Drafter, NoDrafter
from eagle_lite.tree import DraftTree

V = 6
P_ROOT = torch.tensor([0.05, 0.30, 0.10, 0.35, 0.15, 0.05])
P_AFTER_1 = torch.tensor([0.40, 0.05, 0.25, 0.10, 0.10, 0.10])
SAMPLING = SamplingConfig(temperature=1.0)
N_DRAWS = 20_000
TV_BOUND = 0.025


def logits_for(tree_tokens: list[int], parents: list[int]) -> torch.Tensor:
    """Stub target: next-token distribution P_AFTER_1 after token 1, P_ROOT everywhere else."""
    rows = [P_AFTER_1 if (i > 0 and tree_tokens[i] == 1) else P_ROOT for i in range(len(tree_tokens))]
    return torch.stack(rows).log()


def joint_target(first_probs: torch.Tensor, with_second: bool = True) -> dict:
    """The target's own distribution of (first, second) tokens, second only reported after token 1."""
    out = {}
    for a in range(V):
        if a == 1 and with_second:
            for b in range(V):
                out[(a, b)] = float(first_probs[a] * P_AFTER_1[b])
        else:
            out[(a,)] = float(first_probs[a])
    return out


def emitted(tree: DraftTree, path: list[int], bonus: int) -> tuple:
    toks = tree.tokens[path[1:]].tolist() + [bonus]
    return tuple(toks[:2]) if toks[0] == 1 else (toks[0],)


def test_greedy_follows_the_argmax_path():
    tree = DraftTree(torch.tensor([0, 3, 1, 2, 0]), [-1, 0, 0, 2, 2])
    logits = logits_for(tree.tokens.tolist(), tree.parents)
    path, bonus = accept_greedy(tree, logits)
    assert path == [0, 1] and bonus == 3   # argmax after root is 3 (node 1); node 1 has no children


@pytest.mark.parametrize("children", [[3, 1], [1], [4, 5], []])
def test_deterministic_tree_sampling_matches_target(children):
    tokens = [0] + children + [2, 0]   # node(1) (if drafted) gets children 2 and 0
    parents = [-1] + [0] * len(children)
    if 1 in children:
        one = 1 + children.index(1)
        parents += [one, one]
    else:
        tokens = tokens[:len(children) + 1]
    tree = DraftTree(torch.tensor(tokens), parents)
    logits = logits_for(tokens, parents)
    g = torch.Generator().manual_seed(0)
    counts = Counter(emitted(tree, *accept_sampling(tree, logits, SAMPLING, g)) for _ in range(N_DRAWS))
    assert tv(counts, joint_target(P_ROOT, with_second=1 in children), N_DRAWS) < TV_BOUND


def test_sampled_children_recursive_rejection_matches_target():
    """Children drawn without replacement from a q_draft far from the target, each round anew."""
    q = torch.tensor([0.40, 0.05, 0.05, 0.10, 0.10, 0.30])
    g = torch.Generator().manual_seed(1)
    counts = Counter()
    for _ in range(N_DRAWS):
        first = int(torch.multinomial(q, 1, generator=g))
        q2 = q.clone()
        q2[first] = 0
        q2 /= q2.sum()
        second = int(torch.multinomial(q2, 1, generator=g))
        tree = DraftTree(torch.tensor([0, first, second]), [-1, 0, 0],
                         q_draft=torch.stack([q, q, q2]))
        logits = logits_for(tree.tokens.tolist(), tree.parents)
        path, bonus = accept_sampling(tree, logits, SAMPLING, g)
        counts[tuple(tree.tokens[path[1:]].tolist() + [bonus])[:1]] += 1
    assert tv(counts, {(a,): float(P_ROOT[a]) for a in range(V)}, N_DRAWS) < TV_BOUND


def test_target_probs_applies_temperature_top_k_top_p():
    logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0])
    p = target_probs(logits, SamplingConfig(temperature=0.5, top_k=3))
    assert (p[3:] == 0).all() and torch.isclose(p.sum(), torch.tensor(1.0))
    torch.testing.assert_close(p[:3], torch.softmax(logits[:3] / 0.5, -1))
    p = target_probs(logits, SamplingConfig(temperature=1.0, top_p=0.7))
    full = torch.softmax(logits, -1)   # 0.61, 0.22, ...: the first two reach 0.7
    assert (p[2:] == 0).all()
    torch.testing.assert_close(p[:2], full[:2] / full[:2].sum())


@pytest.mark.parametrize("scale,top_p", [(8.0, 0.9), (3.0, 0.9), (3.0, 0.95), (0.5, 0.9)])
def test_top_p_over_a_large_vocabulary_equals_sorting_all_of_it(scale, top_p):
    """Few candidates (peaked), hundreds, thousands past the first floor, and a flat distribution (the sort)."""
    logits = torch.randn(49152, generator=torch.Generator().manual_seed(1)) * scale
    p = target_probs(logits, SamplingConfig(temperature=1.0, top_p=top_p))
    assert torch.equal(p, _top_p_sorted(torch.softmax(logits, -1), top_p))


def test_sample_draws_from_the_distribution_and_never_a_zero():
    probs = torch.tensor([0.0, 0.1, 0.0, 0.2, 0.3, 0.4, 0.0])
    gen = torch.Generator().manual_seed(0)
    draws = 20000
    counts = Counter(sample(probs, gen) for _ in range(draws))
    assert set(counts) <= {1, 3, 4, 5}
    for token, p in enumerate(probs.tolist()):   # each share within ~4 standard errors
        assert abs(counts[token] / draws - p) <= 4 * (p * (1 - p) / draws) ** 0.5 + 1e-9
    assert sample(torch.tensor([0.0, 0.0, 2.0, 0.0]), gen) == 2      # unnormalized, one possible token


class TargetTopKDrafter(Drafter):
    """Drafts from the target itself: the root's top-4 tokens, each with its own top-2 children.

    With a top-k=4 target every first token is drafted, so acceptance (and compaction) happens on
    most steps and the test exercises the accepting branches, not just the bonus token.
    """

    name = "target-top-k"

    def __init__(self, target) -> None:
        self.target = target

    def reset(self, max_len: int, keep: int = 0) -> int:
        return 0

    def max_tree_nodes(self, tree) -> int:
        return 64

    def propose(self, inp, tree):
        tokens, parents = top_two_levels(self.target.model, inp.tokens, inp.root, 4, 2)
        return DraftTree(torch.tensor(tokens), parents)


@pytest.mark.parametrize("weights", ["fp32", "q4_1"])
def test_engine_sampling_matches_target_distribution(llama, weights):
    """End to end on a tiny target: the first three sampled tokens, speculative vs exact enumeration; also
    with GGUF-grid weights, whose lm_head logits come from the native grid kernel."""
    if weights == "q4_1":
        llama = make_target("llama", grid=True)
    sampling = SamplingConfig(temperature=0.8, top_k=4)
    engines = {"vanilla": Engine(llama, NoDrafter()), "speculative": Engine(llama, TargetTopKDrafter(llama))}
    draws = 1000
    dists, accept = {}, {}
    for name, engine in engines.items():
        counts, lengths = Counter(), []
        for seed in range(draws):
            cfg = GenerationConfig(max_new_tokens=3, sampling=sampling, seed=seed, stop_at_eos=False)
            result = engine.generate([5, 6, 7], cfg)
            counts[tuple(result.token_ids)] += 1
            lengths += result.stats.accept_lengths
        dists[name], accept[name] = counts, sum(lengths) / len(lengths)
    assert accept["speculative"] >= 1.9   # the drafted branches are really taken
    exact = exact_continuations(llama, [5, 6, 7], sampling)   # by enumeration over the top-4 supports
    for name, counts in dists.items():
        assert tv(counts, exact, draws) < 0.12, name


def _node_logits_case(target):
    """7 random final hidden states, their lm_head logits, each row's argmax and a token that is not it."""
    torch.manual_seed(0)
    hidden = torch.randn(7, target.hidden_size)
    full = target.lm_head(hidden)
    choice = full.argmax(-1).tolist()
    return hidden, full, choice, [(c + 1) % full.shape[1] for c in choice]


def test_node_logits_project_only_the_walked_nodes(llama):
    """Acceptance reads the logits of the nodes it walks; the lazy projection computes those rows
    alone, and they equal the lm_head's row for row."""
    from eagle_lite.targets.lm_head import NodeLogits

    with torch.inference_mode():
        hidden, full, choice, other = _node_logits_case(llama)
        # root's argmax drafted at node 2, node 2's argmax drafted at node 4; nodes 1, 3, 5, 6 are misses
        tokens = torch.tensor([0, other[0], choice[0], other[2], choice[2], other[4], other[1]])
        tree = DraftTree(tokens, [-1, 0, 0, 2, 2, 4, 1])
        lazy = NodeLogits(llama.lm, hidden, lazy=True)
        path, bonus = accept_greedy(tree, lazy)
        assert path == [0, 2, 4] and bonus == choice[4]
        assert lazy.projected == 3                      # the walk read nodes 0, 2 and 4 only
        for node in path:
            torch.testing.assert_close(lazy[node], full[node], rtol=1e-5, atol=1e-5)
        eager = NodeLogits(llama.lm, hidden, lazy=False)
        assert accept_greedy(tree, eager) == (path, bonus) and eager.projected == 7


@needs_kernel
def test_node_logits_find_the_likely_paths_argmaxes_in_one_product():
    """With the lm_head on grid codes, the first read of the draft's likeliest path (root, first child, ...)
    projects all of it at once; a walk that leaves it projects the rest node by node; every argmax and row
    is the lm_head's."""
    from eagle_lite.targets.lm_head import NodeLogits

    target = make_target("llama", grid=True)
    with torch.inference_mode():
        hidden, full, choice, other = _node_logits_case(target)
        # the root's first child (node 1) is a miss: the walk goes to node 2, then node 4 (node 2's first child)
        tokens = torch.tensor([0, other[0], choice[0], other[1], choice[2], other[4], other[2]])
        tree = DraftTree(tokens, [-1, 0, 0, 1, 2, 4, 2])
        assert tree.likely_path() == [0, 1, 3]
        calls = []
        logits = target.lm.logits
        target.lm.logits = lambda h: calls.append(h.shape[0]) or logits(h)
        try:
            nodes = NodeLogits(target.lm, hidden, lazy=True, likely=tree.likely_path())
            path, bonus = accept_greedy(tree, nodes)
            assert path == [0, 2, 4] and bonus == choice[4]
            assert calls == [3, 1, 1]        # root, 1, 3 at once; then 2 and 4, which the walk also read
            assert nodes.projected == 5
            assert all(nodes.top_token(n) == choice[n] for n in (0, 1, 2, 3, 4))
            calls.clear()
            sampled = NodeLogits(target.lm, hidden, lazy=True, likely=tree.likely_path())   # sampling reads rows
            torch.testing.assert_close(sampled[1], full[1], rtol=1e-5, atol=1e-5)
            assert calls == [3] and sampled.projected == 3
            torch.testing.assert_close(sampled[0], full[0], rtol=1e-5, atol=1e-5)
            assert calls == [3]              # already projected with node 1
        finally:
            del target.lm.logits


@pytest.mark.parametrize("rows", [1, 2, 5, 8, 12])
def test_target_logits_equal_the_lm_head(llama, rows):
    hidden = torch.randn(rows, llama.hidden_size)
    with torch.inference_mode():
        torch.testing.assert_close(llama.logits(hidden), llama.lm_head(hidden), rtol=1e-5, atol=1e-5)


def test_engine_sampling_with_a_grafted_lookup_path_matches_target(llama):
    """EAGLE's tree plus a prompt-lookup path (TreeConfig.lookup): the sampled tokens keep the target's law. Method
    staged grafts onto sampled trees (eagle's graft joins greedy trees only)."""
    from eagle_lite.config import TreeConfig
    from eagle_lite.drafters import EagleOptions, build
    from eagle_lite.heads.draft import DraftHead

    sampling = SamplingConfig(temperature=0.8, top_k=4)
    prompt = [5, 6, 5, 6, 5, 6, 5]             # the 2-gram before each root has occurred: lookup proposes
    torch.manual_seed(0)
    drafter = build("staged", llama, EagleOptions(head=DraftHead.for_target(llama)))
    sizes = []
    propose = drafter.propose
    drafter.propose = lambda inp, tree: sizes.append(len(t := propose(inp, tree))) or t
    engine = Engine(llama, drafter)
    tree = TreeConfig(depth=2, top_k=2, total_tokens=3, lookup=3)
    distance = continuation_tv(llama, engine, prompt, sampling, tree)
    assert max(sizes) > 1 + tree.total_tokens          # grafted nodes were verified
    assert distance < 0.12
