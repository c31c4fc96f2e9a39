"""Method staged: the EAGLE head checks the prompt-lookup chain in its own forward before the target verifies."""
from __future__ import annotations

from collections import Counter

import pytest
import torch
from conftest import eagle_drafter, exact_continuations, reference_greedy

from eagle_lite.config import GenerationConfig, SamplingConfig, TreeConfig
from eagle_lite.decoding.engine import Engine
from eagle_lite.drafters import Drafter, DraftInput, EagleOptions, registry
from eagle_lite.drafters.lookup_graft import LookupGraft
from eagle_lite.heads.draft import DraftHead
from eagle_lite.tree import DraftTree

PROMPT = [5, 6, 7, 8, 9, 5, 6, 7, 8, 9, 5, 6, 7]   # the context repeats: lookup proposes every step


def staged_drafter(target, head, **options):
    return registry.build("staged", target, EagleOptions(head=head, **options))


@pytest.mark.parametrize("shape", [TreeConfig(depth=1, top_k=1, total_tokens=1, lookup=4),
                                   TreeConfig(depth=3, top_k=2, total_tokens=4, lookup=3)])
def test_staged_greedy_equals_generate(target, shape):
    torch.manual_seed(0)
    drafter = staged_drafter(target, DraftHead.for_target(target))
    cfg = GenerationConfig(max_new_tokens=40, tree=shape, stop_at_eos=False)
    engine = Engine(target, drafter)
    for prompt in (PROMPT, [3, 1, 4, 1, 5, 9, 2, 6]):
        assert engine.generate(prompt, cfg).token_ids == reference_greedy(target, prompt, 40)
    assert drafter.name == "staged" and drafter.probes > 0


def test_staged_proposes_the_heads_own_tree_where_the_head_rejects_the_chain(llama):
    """Side by side on the same inputs: where the head's first token is not the chain's (an untrained head: nearly
    always), the staged tree is the unstaged head's tree, without the lookup nodes eagle would verify."""
    torch.manual_seed(1)
    head = DraftHead.for_target(llama)
    staged = staged_drafter(llama, head, copy_mode=False)
    plain = eagle_drafter(llama, head)                  # the same head, no graft (tree.lookup = 0)
    shape = TreeConfig(depth=2, top_k=2, total_tokens=3, lookup=4)
    rejected = 0
    propose = staged.propose

    def side_by_side(inp, tree):
        nonlocal rejected
        probes = staged.probes
        got = propose(inp, tree)
        alone = plain.propose(inp, TreeConfig(depth=2, top_k=2, total_tokens=3, lookup=0))
        if staged.probes > probes and staged.inner.probe_top[0] != staged.lookup.lookup(inp.tokens, 1)[0]:
            rejected += 1
            assert got.tokens.tolist() == alone.tokens.tolist() and got.parents == alone.parents
        return got

    staged.propose = side_by_side
    plain.reset(512)
    cfg = GenerationConfig(max_new_tokens=40, tree=shape, stop_at_eos=False)
    assert Engine(llama, staged).generate(PROMPT, cfg).token_ids == reference_greedy(llama, PROMPT, 40)
    assert rejected > 5


def _paths(tree) -> list[list[int]]:
    """Every root-to-node path of `tree` (node indices, the root left out)."""
    out = []
    for node in range(1, len(tree)):
        path = []
        while node > 0:
            path.append(node)
            node = tree.parents[node]
        out.append(path[::-1])
    return out


class ProbedDrafter(Drafter):
    """An inner drafter whose tree is the root and one child, and whose probe answers are set by the test."""

    name, feature_layers, keep_features = "probed", (), False

    def __init__(self, answers: list[int]) -> None:
        self.answers = answers
        self.probe_top: list[int] = []
        self.probed = None

    def reset(self, max_len, keep=0):
        return keep

    def max_tree_nodes(self, tree):
        return 2

    def propose(self, inp, tree, probe=None):
        self.probed, self.probe_top = probe, list(self.answers) if probe else []
        return DraftTree(torch.tensor([inp.root, self.answers[0]]), [-1, 0])


@pytest.mark.parametrize("answers,path", [([1, 2, 3, 4, 5], [1, 2, 3, 4, 5]),   # agrees with all: + its next token
                                          ([1, 2, 7, 0, 0], [1, 2, 7]),         # agrees with two, then its own
                                          ([8, 0, 0, 0, 0], [8])])               # rejects the first: its tree alone
def test_staged_grafts_the_chain_the_head_agrees_with_and_its_next_token(answers, path):
    inner = ProbedDrafter(answers)
    staged = LookupGraft(inner, copy_mode=False, staged=True)
    tokens = [9, 0, 1, 2, 3, 4, 6, 9, 0]                # the chain after "9 0" is 1 2 3 4
    shape = TreeConfig(depth=1, top_k=1, total_tokens=1, lookup=4)
    tree = staged.propose(DraftInput(tokens, torch.zeros(1, 4)), shape)
    assert inner.keep_features and inner.probed == (2, [1, 2, 3, 4])   # the chain copied from tokens[2:]
    assert [tree.tokens[p].tolist() for p in _paths(tree)][-1] == path
    assert len(tree) == 1 + len(path)                   # the head's tree and the grafted path share the first node
    assert staged.probes == 1 and staged.probe_agreed == len(path) - 1


def test_probe_rows_predict_as_the_head_reading_the_chain_would(llama):
    """The head's answer after the chain's last token equals its catch-up over the context with the chain appended
    and the copied features beside it: what `probe_top` is documented to be."""
    torch.manual_seed(3)
    head = DraftHead.for_target(llama)
    a, b = eagle_drafter(llama, head), eagle_drafter(llama, head)
    a.inner.keep_features = True
    for d in (a, b):
        d.reset(256)
    hidden = torch.randn(len(PROMPT) - 1, llama.hidden_size)
    start, chain = a.lookup.match(PROMPT, 3)
    a.inner.propose(DraftInput(PROMPT, hidden), TreeConfig(depth=1, top_k=1, total_tokens=1), probe=(start, chain))
    copied = hidden[start - 1:start - 1 + len(chain)]
    read = b.inner.propose(DraftInput(PROMPT + chain, torch.cat([hidden, copied])),
                           TreeConfig(depth=1, top_k=1, total_tokens=1))
    assert a.inner.probe_top[-1] == int(read.tokens[1])


def test_staged_sampling_matches_target(llama):
    sampling = SamplingConfig(temperature=0.8, top_k=4)
    prompt = [5, 6, 5, 6, 5, 6, 5]
    torch.manual_seed(0)
    engine = Engine(llama, staged_drafter(llama, DraftHead.for_target(llama)))
    tree = TreeConfig(depth=2, top_k=2, total_tokens=3, lookup=3)
    draws, counts = 800, Counter()
    for seed in range(draws):
        cfg = GenerationConfig(max_new_tokens=3, sampling=sampling, tree=tree, seed=seed, stop_at_eos=False)
        counts[tuple(engine.generate(prompt, cfg).token_ids)] += 1
    exact = exact_continuations(llama, prompt, sampling)
    keys = set(counts) | set(exact)
    assert 0.5 * sum(abs(counts.get(k, 0) / draws - exact.get(k, 0.0)) for k in keys) < 0.12


def test_the_probe_leaves_the_heads_own_proposal_alone(llama):
    """With the chain read in the same forward, the head's catch-up rows (and so its tree) are unchanged."""
    torch.manual_seed(2)
    head = DraftHead.for_target(llama)
    a, b = eagle_drafter(llama, head), eagle_drafter(llama, head)
    a.inner.keep_features = b.inner.keep_features = True
    for d in (a, b):
        d.reset(256)
    hidden = torch.randn(len(PROMPT) - 1, llama.hidden_size)
    shape = TreeConfig(depth=3, top_k=2, total_tokens=4)
    start, chain = a.lookup.match(PROMPT, 3)
    plain = a.inner.propose(DraftInput(PROMPT, hidden), shape)
    probed = b.inner.propose(DraftInput(PROMPT, hidden), shape, probe=(start, chain))
    assert plain.tokens.tolist() == probed.tokens.tolist() and plain.parents == probed.parents
    assert len(b.inner.probe_top) == len(chain) + 1 and a.inner.probe_top == []
    assert b.inner.cache.length == a.inner.cache.length == len(PROMPT) - 1
