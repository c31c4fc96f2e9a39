"""Exactness: speculative greedy == the target's own greedy, token for token, whatever the draft."""
from __future__ import annotations

import pytest
import torch
from conftest import VOCAB, eagle_drafter, make_target, reference_greedy

from eagle_lite.config import GenerationConfig, TreeConfig
from eagle_lite.decoding.engine import Engine, depth_acceptance
from eagle_lite.drafters import Drafter, DraftInput, NoDrafter
from eagle_lite.heads.draft import DraftHead
from eagle_lite.tree import DraftTree

TREES = {
    "chain": TreeConfig(depth=4, top_k=1, total_tokens=4),
    "wide": TreeConfig(depth=1, top_k=6, total_tokens=6),
    "dynamic": TreeConfig(depth=4, top_k=4, total_tokens=12),
    "dynamic_big": TreeConfig(depth=6, top_k=5, total_tokens=40),
    "with_lookup": TreeConfig(depth=3, top_k=3, total_tokens=6, lookup=6),
    "min_prob": TreeConfig(depth=5, top_k=4, total_tokens=16, min_prob=0.02),
    "one_node_lookup": TreeConfig(depth=1, top_k=1, total_tokens=1, lookup=4),  # the shipped head's CPU tree
}


class OracleDrafter(Drafter):
    """Knows the target's greedy continuation and hides it among random siblings.

    Every drafted level holds `width` nodes; the true token sits at a random slot, so the accepted
    path is scattered through the tree and cache compaction really moves entries.
    """

    name = "oracle"

    def __init__(self, sequence: list[int], depth: int = 4, width: int = 3, seed: int = 0) -> None:
        self.sequence, self.depth, self.width = sequence, depth, width
        self.rng = torch.Generator().manual_seed(seed)

    def reset(self, max_len: int, keep: int = 0) -> int:
        return 0

    def max_tree_nodes(self, tree) -> int:
        return 64

    def propose(self, inp: DraftInput, tree: TreeConfig) -> DraftTree:
        n = len(inp.tokens)
        truth = self.sequence[n:n + self.depth]
        tokens, parents, on_path = [inp.root], [-1], 0
        for tok in truth:
            slot = int(torch.randint(self.width, (1,), generator=self.rng))
            parent, first = on_path, len(tokens)
            for j in range(self.width):
                wrong = int(torch.randint(VOCAB, (1,), generator=self.rng))
                tokens.append(tok if j == slot else (wrong if wrong != tok else (wrong + 1) % VOCAB))
                parents.append(parent)
            on_path = first + slot
        return DraftTree(torch.tensor(tokens), parents)


def eagle_engine(target, seed: int = 0) -> Engine:
    torch.manual_seed(seed)
    return Engine(target, eagle_drafter(target, DraftHead.for_target(target)))


@pytest.mark.parametrize("tree", list(TREES), ids=list(TREES))
@pytest.mark.parametrize("prompt_len", [1, 9, 47])
def test_eagle_greedy_equals_target_greedy(target, tree, prompt_len):
    prompt = torch.randint(VOCAB, (prompt_len,), generator=torch.Generator().manual_seed(prompt_len)).tolist()
    ref = reference_greedy(target, prompt, 30)
    result = eagle_engine(target).generate(prompt, GenerationConfig(max_new_tokens=30, tree=TREES[tree],
                                                                    stop_at_eos=False))
    assert result.token_ids == ref
    assert result.stats.new_tokens == 30
    assert result.stats.target_forwards == 1 + len(result.stats.accept_lengths)


def test_every_family_eagle_and_vanilla_equal_transformers_generate(any_family):
    prompt = list(range(3, 20))
    ref = reference_greedy(any_family, prompt, 24)
    cfg = GenerationConfig(max_new_tokens=24, stop_at_eos=False)
    assert Engine(any_family, NoDrafter()).generate(prompt, cfg).token_ids == ref
    assert eagle_engine(any_family).generate(prompt, cfg).token_ids == ref


def test_reduced_draft_vocabulary_stays_exact(llama):
    prompt = [9, 8, 7, 6]
    ref = reference_greedy(llama, prompt, 30)
    torch.manual_seed(1)
    d2t = torch.randperm(VOCAB)[:24]          # a draft that can only propose 24 of the 96 tokens
    engine = Engine(llama, eagle_drafter(llama, DraftHead.for_target(llama, d2t=d2t)))
    result = engine.generate(prompt, GenerationConfig(max_new_tokens=30, stop_at_eos=False,
                                                      tree=TreeConfig(depth=3, top_k=4, total_tokens=10)))
    assert result.token_ids == ref


def test_a_reduced_vocabulary_head_drafting_over_the_whole_vocabulary_stays_exact(llama):
    prompt = [9, 8, 7, 6]
    ref = reference_greedy(llama, prompt, 30)
    torch.manual_seed(1)
    d2t = torch.randperm(VOCAB)[:24]
    head = DraftHead.for_target(llama, d2t=d2t)
    full = head.over_full_vocabulary()
    assert full.d2t is None and full.fc is head.fc and torch.equal(head.d2t, d2t)   # shared weights, head as it was
    assert full.output_weight(llama.lm_head.weight).shape[0] == VOCAB
    tree = TreeConfig(depth=3, top_k=4, total_tokens=10)
    proposed: set[int] = set()
    for vocab in ("head", "full"):
        drafter = eagle_drafter(llama, head, draft_vocab=vocab)
        drafter.propose = recording(drafter.propose, proposed)
        result = Engine(llama, drafter).generate(prompt, GenerationConfig(max_new_tokens=30, stop_at_eos=False,
                                                                          tree=tree))
        assert result.token_ids == ref
        if vocab == "head":
            assert proposed <= set(d2t.tolist())
    assert proposed - set(d2t.tolist())                 # over the whole vocabulary it proposed tokens d2t lacks


def recording(propose, seen: set[int]):
    """`propose` that also adds each tree's drafted tokens to `seen`."""
    def wrapped(*args, **kwargs):
        tree = propose(*args, **kwargs)
        seen.update(tree.tokens[1:].tolist())
        return tree
    return wrapped


def test_an_eagle3_head_cannot_draft_over_the_whole_vocabulary():
    deep = make_target("llama", layers=4)
    head = DraftHead.for_target(deep, torch.arange(10, 50), feature_layers=(0, 1, 2), design="eagle3")
    with pytest.raises(ValueError, match="own lm_head; it cannot draft over the target's whole vocabulary"):
        head.over_full_vocabulary()


def test_vanilla_equals_transformers_generate(target):
    prompt = list(range(3, 20))
    ref = reference_greedy(target, prompt, 40)
    result = Engine(target, NoDrafter()).generate(prompt, GenerationConfig(max_new_tokens=40, stop_at_eos=False))
    assert result.token_ids == ref
    assert result.stats.accept_length_mean == 1.0
    assert result.stats.target_forwards == 40


@pytest.mark.parametrize("prompt_len", [2, 30])
def test_oracle_draft_accepts_everything_and_stays_exact(target, prompt_len):
    prompt = list(range(5, 5 + prompt_len))
    ref = reference_greedy(target, prompt, 41)
    drafter = OracleDrafter(prompt + ref, depth=4, width=3)
    result = Engine(target, drafter).generate(prompt, GenerationConfig(max_new_tokens=41, stop_at_eos=False))
    assert result.token_ids == ref
    # 1 token from prefill, then 5 per verify (4 drafted + bonus): 40 / 5 = 8 verifications
    assert result.stats.accept_lengths == [5] * 8
    assert result.stats.target_forwards == 9
    assert result.stats.draft_depths == [4] * 8   # every tree four levels deep


def test_acceptance_at_each_depth_counts_the_steps_that_drafted_and_took_it():
    # steps: (tokens emitted, bonus included; tree depth): a plain step, then trees of depth 3, 3, 2, 1
    rows = depth_acceptance([1, 4, 2, 1, 2], [0, 3, 3, 2, 1])
    assert [(r["depth"], r["drafted"], r["accepted"]) for r in rows] == [(1, 4, 3), (2, 3, 1), (3, 2, 1)]
    assert [r["rate"] for r in rows] == [3 / 4, 1 / 3, 1 / 2]
    # depth 2: of the 3 steps that drafted it, 2 had taken depth 1 and 1 took depth 2; depth 3: 1 of 1
    assert [r["conditional"] for r in rows] == [3 / 4, 1 / 2, 1.0]
    assert depth_acceptance([1, 1], [0, 0]) == []


def test_max_new_tokens_inside_an_accepted_path(llama):
    prompt = [7, 8, 9]
    ref = reference_greedy(llama, prompt, 40)
    for budget in (1, 2, 4, 7, 13):
        result = Engine(llama, OracleDrafter(prompt + ref, depth=4)).generate(
            prompt, GenerationConfig(max_new_tokens=budget, stop_at_eos=False))
        assert result.token_ids == ref[:budget]
        assert result.stats.stop_reason == "length"


def test_eos_inside_an_accepted_path(llama):
    prompt = [11, 12, 13, 14]
    ref = reference_greedy(llama, prompt, 40)
    eos = ref[6]  # a token the target emits mid-path, so it stops there
    llama.model.generation_config.eos_token_id = eos
    try:
        expected = reference_greedy(llama, prompt, 40, eos=eos)
        assert expected[-1] == eos and len(expected) < 40
        for drafter in (OracleDrafter(prompt + ref, depth=4), NoDrafter()):
            result = Engine(llama, drafter).generate(prompt, GenerationConfig(max_new_tokens=40))
            assert result.token_ids == expected
            assert result.stats.stop_reason == "eos"
    finally:
        llama.model.generation_config.eos_token_id = None


def test_engine_reuses_its_cache_across_calls(llama):
    engine = eagle_engine(llama)
    prompts = [[1, 2, 3], list(range(10, 60)), [4]]
    for prompt in prompts + prompts[::-1]:
        assert engine.generate(prompt, GenerationConfig(max_new_tokens=12, stop_at_eos=False)).token_ids == \
            reference_greedy(llama, prompt, 12)
    # grown once for the longest prompt, then reused: not one allocation per call
    assert engine._cache.max_len == 50 + 12 + 1 + GenerationConfig().tree.total_tokens


def test_streaming_yields_what_generate_returns(llama):
    engine = eagle_engine(llama)
    cfg = GenerationConfig(max_new_tokens=20, stop_at_eos=False)
    steps = list(engine.stream([3, 4, 5], cfg))
    assert [t for s in steps for t in s] == engine.generate([3, 4, 5], cfg).token_ids
    assert all(len(s) >= 1 for s in steps)


def test_next_turn_keeps_the_prefix_past_a_hole_in_the_heads_cache(llama, monkeypatch):
    """A head that sat out copied stretches of the answer (lookup chains verified alone) and, back, read none of the
    rows it missed (catch_up_window 0) has holes in its cache; the next turn still reuses the whole cached prefix
    and stays the target's greedy output."""
    from eagle_lite.drafters.eagle import EagleDrafter

    monkeypatch.setattr(EagleDrafter, "catch_up_window", 0)
    engine = eagle_engine(llama)
    cfg = GenerationConfig(max_new_tokens=40, stop_at_eos=False, tree=TreeConfig(depth=2, top_k=2, total_tokens=3,
                                                                                  lookup=4))
    first = [3, 4, 5, 6, 7, 8] * 4
    answer = engine.generate(first, cfg).token_ids
    assert answer == reference_greedy(llama, first, 40)
    head = engine.drafter.inner
    assert head._holes, "the answer left no hole: nothing tested"
    second = first + answer + [9, 10, 11]
    result = engine.generate(second, cfg)
    assert result.token_ids == reference_greedy(llama, second, 40)
    assert result.stats.reused_prompt_tokens >= len(first) + len(answer) - 2


@pytest.mark.parametrize("method", ["vanilla", "eagle"])
def test_next_turn_reuses_the_cached_prefix_and_stays_exact(llama, method):
    engine = eagle_engine(llama) if method == "eagle" else Engine(llama, NoDrafter())
    cfg = GenerationConfig(max_new_tokens=15, stop_at_eos=False)
    first = [3, 4, 5, 6, 7, 8]
    answer = engine.generate(first, cfg).token_ids
    second = first + answer + [9, 10, 11]             # the next chat turn
    result = engine.generate(second, cfg)
    assert result.token_ids == reference_greedy(llama, second, 15)
    assert result.stats.reused_prompt_tokens >= len(first) + len(answer) - 2
    diverged = [3, 4, 60, 61]                           # shares only two tokens with the cache
    result = engine.generate(diverged, cfg)
    assert result.token_ids == reference_greedy(llama, diverged, 15)
    assert result.stats.reused_prompt_tokens == 1
    engine.reset()
    assert engine.generate(diverged, cfg).stats.reused_prompt_tokens == 0


def test_lookup_graft_adds_the_prompt_continuation_as_a_path(llama):
    """tokens end in the 2-gram (5, 6), which occurred before followed by 7 8 9: the tree holds that path."""
    from eagle_lite.tree import graft_chain

    drafter = eagle_drafter(llama, DraftHead.for_target(llama))
    drafter.reset(64)
    tokens = [5, 6, 7, 8, 9, 3, 5, 6]
    inp = DraftInput(tokens, torch.randn(len(tokens) - 1, llama.hidden_size))
    with torch.inference_mode():
        tree = drafter.propose(inp, TreeConfig(depth=2, top_k=2, total_tokens=3, lookup=3))
    walk, node = [], 0
    for want in (7, 8, 9):
        node = next(c for c in tree.children[node] if int(tree.tokens[c]) == want)
        walk.append(node)
    assert len(walk) == 3 and len(tree) <= 1 + 3 + 3
    # grafting follows existing nodes: the same chain again adds nothing, a new branch adds only its new tail
    assert graft_chain(tree, [7, 8, 9]) is tree
    longer = graft_chain(tree, [7, 8, 4])
    assert len(longer) == len(tree) + 1 and longer.parents[-1] == walk[1]


@pytest.mark.parametrize("seed", [0, 2])
def test_copy_mode_verifies_lookup_chains_alone_and_stays_exact(llama, seed):
    """Once a whole prompt-lookup chain was accepted, the next tree is the lookup chain alone (these prompts
    make the tiny target loop, so its answer copies itself); the head sits those steps out and reads the
    features it missed later. The output stays the target's."""
    prompt = torch.randint(VOCAB, (12,), generator=torch.Generator().manual_seed(seed)).tolist()
    ref = reference_greedy(llama, prompt, 60)
    tree = TreeConfig(depth=2, top_k=2, total_tokens=3, lookup=3)
    cfg = GenerationConfig(max_new_tokens=60, stop_at_eos=False, tree=tree)
    engine = eagle_engine(llama)
    sizes = []
    propose = engine.drafter.propose
    engine.drafter.propose = lambda inp, t: sizes.append(len(out := propose(inp, t))) or out
    assert engine.generate(prompt, cfg).token_ids == ref
    assert engine.drafter.copy_steps > 0 and max(sizes) <= engine.drafter.max_tree_nodes(tree)
    torch.manual_seed(0)
    plain = Engine(llama, eagle_drafter(llama, DraftHead.for_target(llama), copy_mode=False))
    assert plain.generate(prompt, cfg).token_ids == ref and plain.drafter.copy_steps == 0


def test_copy_chains_double_while_accepted_whole_and_the_head_catches_up(llama):
    """A passage of the prompt being copied: the lookup chain grafted on the first tree is accepted whole, so
    the next trees are lookup chains alone, 10 then 16 tokens (COPY_START, then doubled to COPY_MAX); when the
    answer leaves the passage the head drafts again, first reading the features of every token it skipped."""
    from eagle_lite.drafters.lookup_graft import COPY_MAX

    torch.manual_seed(0)
    drafter = eagle_drafter(llama, DraftHead.for_target(llama))
    drafter.reset(128)
    passage = list(range(10, 40))                       # 30 distinct tokens
    tree_cfg = TreeConfig(depth=2, top_k=2, total_tokens=3, lookup=3)
    tokens = passage + [90] + passage[:4]
    hidden = lambda n: torch.randn(n, llama.hidden_size)
    with torch.inference_mode():
        first = drafter.propose(DraftInput(tokens, hidden(len(tokens) - 1)), tree_cfg)
        assert drafter.copy_steps == 0 and len(first) > 1 + tree_cfg.lookup
        sizes = []
        for accepted, bonus in ((passage[4:7], passage[7]), (passage[8:18], passage[18])):
            tokens = tokens + accepted + [bonus]            # the last chain accepted whole, then the target's token
            tree = drafter.propose(DraftInput(tokens, hidden(len(accepted) + 1)), tree_cfg)
            follow = (passage + [90] + passage)[bonus - 10 + 1:]
            assert (tree.tokens.tolist() == [bonus] + follow[:len(tree) - 1]
                    and tree.parents == list(range(-1, len(tree) - 1)))
            sizes.append(len(tree) - 1)
        assert sizes == [10, COPY_MAX] and drafter.copy_steps == 2
        assert drafter.cache.length == len(passage) + 5 - 1    # the head has not read the copied stretch yet
        tokens = tokens + [91]                              # the answer leaves the passage: nothing accepted
        drafter.propose(DraftInput(tokens, hidden(1)), tree_cfg)
        assert drafter.copy_steps == 2 and drafter.cache.length == len(tokens) - 1


def test_a_copy_chain_taken_in_part_is_followed_by_one_a_token_longer_than_it_took(llama):
    """Copying a passage the context also holds with a variation: a copy chain of which at least a graft's length was
    taken keeps the answer in copy mode with one more token than it took, as prompt lookup's own chain shrinks; one
    taken for less than that hands the step back to the head."""
    torch.manual_seed(0)
    drafter = eagle_drafter(llama, DraftHead.for_target(llama))
    drafter.reset(256)
    p = list(range(10, 60))                               # 50 distinct tokens
    q = p[:15] + [95] + p[15:40]                          # the same passage with a token inserted
    tree_cfg = TreeConfig(depth=2, top_k=2, total_tokens=3, lookup=3)
    tokens = p + [90] + q + [91] + p[:4]                  # the answer starts copying p (the lookup matches q, later)
    hidden = lambda n: torch.randn(n, llama.hidden_size)
    sizes = []
    with torch.inference_mode():
        drafter.propose(DraftInput(tokens, hidden(len(tokens) - 1)), tree_cfg)
        for taken, bonus in ((p[4:7], p[7]), (p[8:15], p[15])):   # the graft whole; 7 of q's 10 (q has 95 next)
            tokens = tokens + taken + [bonus]
            chain = drafter.propose(DraftInput(tokens, hidden(len(taken) + 1)), tree_cfg)
            sizes.append(len(chain) - 1)
        assert sizes == [10, 8] and drafter.copy_steps == 2
        assert chain.tokens.tolist() == [p[15]] + p[16:24] and chain.parents == list(range(-1, 8))
        tokens = tokens + p[16:18] + [94]                 # 2 of the 8 taken (fewer than a graft's 3)
        drafter.propose(DraftInput(tokens, hidden(3)), tree_cfg)
        assert drafter.copy_steps == 2                    # the head's tree, not a chain alone


def test_copy_chains_stop_shorter_after_a_long_context(llama, monkeypatch):
    """Past LONG_CONTEXT tokens every verified row attends over the whole context: chains double only to
    COPY_MAX_LONG, and the output stays the target's."""
    from eagle_lite.drafters import lookup_graft as eagle

    monkeypatch.setattr(eagle, "LONG_CONTEXT", 20)      # the tiny passage below counts as a long context
    torch.manual_seed(0)
    drafter = eagle_drafter(llama, DraftHead.for_target(llama))
    drafter.reset(128)
    passage = list(range(10, 40))
    tree_cfg = TreeConfig(depth=2, top_k=2, total_tokens=3, lookup=3)
    tokens = passage + [90] + passage[:4]
    hidden = lambda n: torch.randn(n, llama.hidden_size)
    with torch.inference_mode():
        drafter.propose(DraftInput(tokens, hidden(len(tokens) - 1)), tree_cfg)
        sizes = []
        for accepted, bonus in ((passage[4:7], passage[7]), (passage[8:14], passage[14]),
                                (passage[15:23], passage[23])):
            tokens = tokens + accepted + [bonus]
            sizes.append(len(drafter.propose(DraftInput(tokens, hidden(len(accepted) + 1)), tree_cfg)) - 1)
    assert sizes == [eagle.COPY_MAX_LONG] * 3
    prompt = passage + [90] + passage[:4]
    cfg = GenerationConfig(max_new_tokens=40, stop_at_eos=False, tree=tree_cfg)
    assert Engine(llama, eagle_drafter(llama, DraftHead.for_target(llama))).generate(prompt, cfg).token_ids == \
        reference_greedy(llama, prompt, 40)


def test_min_prob_verifies_only_nodes_the_draft_finds_likely(llama):
    """The tree keeps the nodes whose draft path probability reaches min_prob: all of them for a tiny
    threshold, the root alone for one no path reaches, a subtree of the unpruned tree in between."""
    torch.manual_seed(0)
    drafter = eagle_drafter(llama, DraftHead.for_target(llama))
    tokens = [5, 6, 7, 8, 9, 3, 5, 6]
    sizes = {}
    for min_prob in (0.0, 1e-12, 0.005, 0.999):
        drafter.reset(64)
        inp = DraftInput(tokens, torch.randn(len(tokens) - 1, llama.hidden_size,
                                             generator=torch.Generator().manual_seed(0)))
        with torch.inference_mode():
            tree = drafter.propose(inp, TreeConfig(depth=3, top_k=4, total_tokens=12, min_prob=min_prob))
        sizes[min_prob] = tree
    full = sizes[0.0]
    assert len(full) == 13 and torch.equal(sizes[1e-12].tokens, full.tokens)
    assert len(sizes[0.999]) == 1
    mid = sizes[0.005]
    assert 1 < len(mid) < len(full)
    paths = lambda t: {tuple(int(t.tokens[j]) for j in range(len(t)) if t.ancestors[i, j])  # noqa: E731
                       for i in range(len(t))}
    assert paths(mid) <= paths(full)
