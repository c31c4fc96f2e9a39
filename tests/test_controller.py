"""Method auto: the controller chooses each step's proposal (eagle_lite_wing/controller.py, eagle_lite_wing/auto.py)
from the step costs measured here (decoding/cost.py). It changes what is proposed, never what is accepted."""
from __future__ import annotations

import dataclasses
import json
import random
from collections import Counter

import pytest
import torch
from conftest import continuation_tv, reference_greedy

from eagle_lite.config import GenerationConfig, SamplingConfig, TreeConfig
from eagle_lite.decoding import cost as cost_module
from eagle_lite.decoding.cost import StepCost, step_cost
from eagle_lite.decoding.engine import Engine
from eagle_lite.drafters import EagleOptions, build
from eagle_lite.drafters.eagle import EagleDrafter
from eagle_lite.heads.draft import DraftHead
from eagle_lite_wing.auto import AutoDrafter, Choices, auto_tree
from eagle_lite_wing.controller import ALONE, EXPLORE, Calibration, ChainRate, Controller, Mates, Plan, seat, time_head

# a CPU-like machine: a plain step 8 ms, each more node 1 ms, a head forward 1 ms (its catch-up 1.5)
COST = {1: 0.008, 2: 0.009, 4: 0.011, 8: 0.015, 16: 0.023, 32: 0.039}
TREE = TreeConfig(depth=3, top_k=1, total_tokens=3, lookup=4)


def fixed_cost() -> StepCost:
    return StepCost(dict(COST), head=0.001, catch_up=0.0015)


def auto(target, head=None, cost=None) -> AutoDrafter:
    inner = EagleDrafter(target, head) if head is not None else None
    return AutoDrafter(target, inner, cost or fixed_cost())


def every_choice(monkeypatch, seed: int = 0) -> Counter:
    """Make every controller pick its plan at random each step (any plan must be exact, with the controller's own
    floors); returns the count of each kind run, filled in as it runs."""
    rng, seen = random.Random(seed), Counter()
    choose = Controller.choose

    def pick(self, match, chain, most):
        best = choose(self, match, chain, most)
        kind = rng.choice(["plain"] + (["lookup"] if chain else []) + (["head"] if self.has_head else []))
        seen[kind] += 1
        lookup = 0 if kind == "plain" else rng.randint(1, min(chain, most)) if chain else 0
        return Plan(kind, lookup, best.min_prob, 1.0, 0.01, self, match)

    monkeypatch.setattr(Controller, "choose", pick)
    return seen


PROMPTS = ([5, 6, 7, 5, 6, 7, 5, 6], list(range(20, 50)), [9, 3, 9, 3, 9, 3, 9, 3, 9, 11, 12])


@pytest.mark.parametrize("with_head", [True, False])
def test_auto_greedy_output_is_the_targets(llama, with_head):
    torch.manual_seed(0)
    head = DraftHead.for_target(llama) if with_head else None
    cfg = GenerationConfig(max_new_tokens=40, tree=auto_tree(TREE) if with_head else TREE, stop_at_eos=False)
    drafter = auto(llama, head)
    engine = Engine(llama, drafter)
    for prompt in PROMPTS:
        watched = drafter.statistics()
        engine.observers[:] = [watched]
        out = engine.generate(prompt, cfg)
        assert out.token_ids == reference_greedy(llama, prompt, 40), prompt
        assert sum(row[0] for row in watched.rows.values()) == len(out.stats.accept_lengths)


@pytest.mark.parametrize("with_head", [True, False])
def test_auto_greedy_is_exact_whatever_the_controller_chooses(llama, with_head, monkeypatch):
    torch.manual_seed(1)
    seen = every_choice(monkeypatch)
    drafter = auto(llama, DraftHead.for_target(llama) if with_head else None)
    engine = Engine(llama, drafter)
    cfg = GenerationConfig(max_new_tokens=48, tree=auto_tree(TREE), stop_at_eos=False)
    for prompt in PROMPTS:
        assert engine.generate(prompt, cfg).token_ids == reference_greedy(llama, prompt, 48), prompt
    assert seen["plain"] and seen["lookup"] and (seen["head"] or not with_head)


@pytest.mark.parametrize("rule", ["q", "match"])
def test_auto_sampling_matches_the_target_distribution(llama, rule, monkeypatch):
    """Sampled, with the controller made to pick plans at random: the 3-token continuations' law is the target's."""
    sampling = SamplingConfig(temperature=0.8, top_k=4)
    prompt = [5, 6, 5, 6, 5, 6, 5]              # lookup matches: all three kinds are possible
    torch.manual_seed(0)
    drafter = AutoDrafter(llama, EagleDrafter(llama, DraftHead.for_target(llama), draft_sampling=rule), fixed_cost())
    seen = every_choice(monkeypatch, seed=3)
    engine = Engine(llama, drafter)
    tree = TreeConfig(depth=2, top_k=2, total_tokens=3, lookup=3)
    distance = continuation_tv(llama, engine, prompt, sampling, tree)
    assert min(seen.values()) > 50 and len(seen) == 3
    assert distance < 0.12


def test_auto_match_samples_the_very_tokens_vanilla_does(llama, monkeypatch):
    """Method auto (the registry's, the match rule) sampled with a seed emits vanilla decoding's tokens for that seed,
    whatever its controller chooses (here at random) and whatever shares its batch: every token is the target's own
    draw."""
    torch.manual_seed(0)
    head = DraftHead.for_target(llama)
    cfg = GenerationConfig(max_new_tokens=40, tree=auto_tree(TREE), sampling=SamplingConfig(temperature=0.9),
                           seed=11, stop_at_eos=False)
    want = [Engine(llama).generate(p, cfg).token_ids for p in PROMPTS[:2]]
    drafter = build("auto", llama, EagleOptions(head=head))
    assert drafter.inner.draft_sampling == "match" and not drafter.moves_samples
    seen = every_choice(monkeypatch, seed=5)
    assert Engine(llama, drafter).generate(PROMPTS[0], cfg).token_ids == want[0]
    engine = Engine(llama)
    greedy = dataclasses.replace(cfg, sampling=SamplingConfig(), seed=None)
    seqs = [engine.begin(p, c, drafter=drafter.sibling())
            for p, c in ((PROMPTS[0], cfg), (PROMPTS[1], cfg), (PROMPTS[2], greedy))]
    out = [list(first) for _, first in seqs]
    while not all(seq.done for seq, _ in seqs):
        running = [(i, seq) for i, (seq, _) in enumerate(seqs) if not seq.done]
        for (i, _), new in zip(running, engine.step([seq for _, seq in running])):
            out[i] += new
    assert out[:2] == want
    assert len(seen) == 3


def test_a_seed_reproduces_a_sampled_answer(llama):
    """The controller's choices depend on the cached costs and the tokens, never on a clock: the same seed gives
    the same sampled tokens, alone or beside another sequence."""
    torch.manual_seed(0)
    head = DraftHead.for_target(llama)
    cfg = GenerationConfig(max_new_tokens=40, tree=auto_tree(TREE), sampling=SamplingConfig(temperature=0.9),
                           seed=7, stop_at_eos=False)
    first = Engine(llama, auto(llama, head)).generate(PROMPTS[0], cfg).token_ids
    assert Engine(llama, auto(llama, head)).generate(PROMPTS[0], cfg).token_ids == first
    engine = Engine(llama)
    seqs = [engine.begin(p, cfg, drafter=auto(llama, head)) for p in (PROMPTS[0], PROMPTS[1])]
    out = [list(first_token) for _, first_token in seqs]
    while not all(seq.done for seq, _ in seqs):
        running = [(i, seq) for i, (seq, _) in enumerate(seqs) if not seq.done]
        for (i, _), new in zip(running, engine.step([seq for _, seq in running])):
            out[i] += new
    assert out[0] == first


def test_each_request_has_its_own_controller(llama):
    torch.manual_seed(0)
    first = auto(llama, DraftHead.for_target(llama))
    second = first.sibling()
    assert second.controller is not first.controller and second.cost is first.cost
    assert second.inner is not first.inner and second.inner.head is first.inner.head
    engine = Engine(llama, first)
    engine.generate([5, 6, 7, 5, 6, 7, 5, 6], GenerationConfig(max_new_tokens=30, tree=auto_tree(TREE)))
    learnt = first.controller
    assert learnt.lookup.first != ChainRate().first          # it learnt from the request's tokens
    assert second.controller.lookup.first == ChainRate().first   # the sibling (another user) did not
    first.reset(64)
    assert first.controller is not learnt and first.controller.lookup.first == ChainRate().first


def test_calibration_is_monotone_and_learns():
    cal = Calibration()
    assert cal(0.95) == pytest.approx(0.95) and cal(0.05) == pytest.approx(0.05)   # the head at its word
    for _ in range(50):
        cal.add(0.95, False)          # a confident head that is always wrong
        cal.add(0.45, True)
    assert cal(0.95) == cal(0.45) > 0.8    # never below a less likely bin
    assert cal.floor(0.5) == pytest.approx(0.4)
    assert cal.floor(1.5) == 0.999


def test_chain_rate_learns_by_match_length():
    rate = ChainRate()
    for _ in range(40):
        rate.add(2, 4, 0)               # 2-gram matches never right
        rate.add(ChainRate.COPY, 8, 8)  # copying: whole chains accepted
    assert rate.expect(2, 3)[0] < 0.1
    copy = rate.expect(ChainRate.COPY, 8)
    assert copy[0] > 0.95 and copy[-1] > 0.8 and copy == sorted(copy, reverse=True)
    assert ChainRate.key(0, True) == 0 and ChainRate.key(3, False) == 3 and ChainRate.key(9, False) == 5


def test_controller_chooses_what_pays():
    control = Controller(fixed_cost(), head=True)
    for m in control.head:
        control.head[m] = [1.05, 1.0, 10]   # a head step returns 1.05 tokens: not worth its cost
    for _ in range(40):
        control.lookup.add(ChainRate.COPY, 8, 8)
        control.lookup.add(2, 4, 0)
    assert control.choose(ChainRate.COPY, 8, 16).kind == "lookup"
    assert control.choose(ChainRate.COPY, 8, 16).lookup >= 6
    assert control.choose(2, 4, 16).kind == "plain"       # a lookup that is never right, a head that does not pay
    control.head[0] = [3.0, 2.0, 10]
    assert control.choose(0, 0, 16).kind == "head"
    control.head[0] = [1.05, 1.0, 10]
    control.since_head = EXPLORE
    assert control.choose(0, 0, 16).kind == "plain"       # far behind: it explores less often than every EXPLORE
    control.since_head = 20 * EXPLORE
    assert control.choose(0, 0, 16).kind == "head"        # but it does draft again, to follow the text
    control.mates = Mates(count=7, rows=7.0, tokens=7.0)
    assert control.choose(0, 0, 16).kind == "plain"       # in a batch of 8, eight times less often
    control.since_head = 8 * 20 * EXPLORE
    assert control.choose(0, 0, 16).kind == "head"


def test_a_batch_makes_each_node_cost_more_and_the_plans_smaller():
    """Seated with mates whose rows reach where the forward's cost climbs (past the native op's rows), a lookup chain
    worth verifying alone is not, and the step is a plain one; the seconds a plan is predicted are its share."""
    cost = StepCost({1: 0.008, 8: 0.015, 32: 0.039, 48: 0.080, 64: 0.120})
    control = Controller(cost, head=False)
    for _ in range(40):        # a 3-gram's chain: its first token right 3 times in 10, each next one half the time
        control.lookup.add(3, 4, 0)
    for _ in range(17):
        control.lookup.add(3, 4, 2)
    alone = control.choose(3, 4, 16)
    assert alone.kind == "lookup" and alone.seconds == pytest.approx(cost.step(1 + alone.lookup))
    control.mates = Mates(count=7, rows=40.0, tokens=7.0)
    crowded = control.choose(3, 4, 16)
    assert crowded.kind == "plain" and crowded.seconds == pytest.approx(cost.step(41) / 8)
    assert control.node_cost(1) > 2 * Controller(cost, head=False).node_cost(1)


def test_a_batch_step_costs_each_sequence_its_own_cache_and_commit():
    """Each more sequence of a batch adds its `sequence` seconds and its cache's read at its context; a longer context
    makes every row cost more: read linearly between the two measured contexts."""
    cost = StepCost({1: 0.008, 8: 0.016}, verify_long={1: 0.009, 8: 0.020}, sequence=0.0005)
    assert cost.step(8) == pytest.approx(0.016)
    assert cost.step(8, context=cost_module.PREFIX + cost_module.LONG / 2) == pytest.approx(0.018)
    assert cost.step(1, context=cost_module.PREFIX + 2 * cost_module.LONG) == pytest.approx(0.010)
    assert cost.step(8, sequences=8) == pytest.approx(0.016 + 7 * 0.0005)
    # 4 sequences of mean context PREFIX + LONG: each other one's cache read costs what one's did (0.001 more)
    assert cost.step(4, context=cost_module.PREFIX + cost_module.LONG, sequences=4) == pytest.approx(
        StepCost({1: 0.008, 8: 0.016}, verify_long={1: 0.009, 8: 0.020}).step(4, cost_module.PREFIX
                                                                               + cost_module.LONG) + 3 * 0.0015)
    flat = StepCost({1: 0.008, 8: 0.016})           # no long context measured: a context costs nothing more
    assert flat.step(8, context=4000) == pytest.approx(0.016)


def test_what_each_sequence_adds_makes_a_batched_lookup_chain_worth_it():
    """The seconds a batch spends per sequence are fixed whatever the trees: the dearer they are, the more a chain's
    tokens are worth against its nodes. Among mates, a chain priced as plain without that term is run with it, and
    a sequence's predicted share includes its part of it."""
    curve = {1: 0.008, 8: 0.015, 32: 0.039, 48: 0.080, 64: 0.120}
    plans = {}
    for sequence in (0.0, 0.004):
        control = Controller(StepCost(dict(curve), sequence=sequence), head=False)
        for _ in range(40):
            control.lookup.add(3, 4, 0)
        for _ in range(17):
            control.lookup.add(3, 4, 2)
        control.mates = Mates(count=7, rows=24.0, tokens=7.0)
        plans[sequence] = control.choose(3, 4, 16)
    assert plans[0.0].kind == "plain" and plans[0.004].kind == "lookup"
    assert plans[0.004].seconds == pytest.approx(
        StepCost(dict(curve)).step(25 + plans[0.004].lookup) / 8 + 7 * 0.004 / 8)


def test_seat_gives_each_controller_the_others_running_figures():
    controllers = [Controller(fixed_cost(), head=True) for _ in range(3)]
    for i, c in enumerate(controllers):
        c.rows, c.tokens, c.drafting, c.context = 1.0 + i, 1.5 * (i + 1), 0.001 * i, 100.0 * (i + 1)
    seat(controllers)
    assert controllers[0].mates == Mates(2, 2.0 + 3.0, 3.0 + 4.5, 0.001 + 0.002, 200.0 + 300.0)
    assert controllers[2].mates.count == 2 and controllers[2].mates.rows == pytest.approx(1.0 + 2.0)
    seat(controllers[:1])
    assert controllers[0].mates is ALONE


def test_a_greedy_batch_is_seated_together_and_stays_exact(llama, monkeypatch):
    """Engine.step seats the controllers of its batch (a seeded sampled sequence plans alone) and every greedy
    sequence still gets the target's own tokens."""
    torch.manual_seed(0)
    head = DraftHead.for_target(llama)
    seen, choose = [], Controller.choose

    def record(self, *args):
        seen.append(self.mates.count)
        return choose(self, *args)

    monkeypatch.setattr(Controller, "choose", record)
    greedy = GenerationConfig(max_new_tokens=24, tree=auto_tree(TREE), stop_at_eos=False)
    seeded = GenerationConfig(max_new_tokens=24, tree=auto_tree(TREE), sampling=SamplingConfig(temperature=0.9),
                              seed=3, stop_at_eos=False)
    engine = Engine(llama)
    seqs = [engine.begin(p, cfg, drafter=auto(llama, head))
            for p, cfg in ((PROMPTS[0], greedy), (PROMPTS[1], greedy), (PROMPTS[2], seeded))]
    out = [list(first) for _, first in seqs]
    for _ in range(3):
        for i, new in enumerate(engine.step([seq for seq, _ in seqs])):
            out[i] += new
    assert seen[:3] == [2, 2, 0]
    while not all(seq.done for seq, _ in seqs[:2]):
        running = [(i, seq) for i, (seq, _) in enumerate(seqs[:2]) if not seq.done]
        for (i, _), new in zip(running, engine.step([seq for _, seq in running])):
            out[i] += new
    for i in range(2):
        assert out[i] == reference_greedy(llama, PROMPTS[i], 24)


def test_step_cost_read_from_its_cache_file_is_the_one_measured():
    """A cache file's sizes are strings ("12" sorts before "2"): read back, the curve is the same, in size order."""
    measured = StepCost({1: 0.006, 2: 0.007, 4: 0.0095, 12: 0.026, 16: 0.045}, 0.0006, 0.0007,
                        verify_long={1: 0.0075, 2: 0.0084, 4: 0.0123, 12: 0.030, 16: 0.050}, sequence=0.0007)
    data = json.loads(json.dumps(measured.as_dict()))
    read = StepCost(data["verify"], data["head"], data["catch_up"], "cached",
                    data["verify_long"], data["sequence"])
    for nodes in (1, 2, 3, 4, 8, 12, 14, 20):
        assert read.step(nodes, 300, 3) == pytest.approx(measured.step(nodes, 300, 3))
    assert read.step(2) == pytest.approx(0.007)


def test_step_cost_interpolates_monotone():
    cost = StepCost({1: 0.008, 4: 0.011, 8: 0.010, 16: 0.023})   # a noisy 8
    assert cost.step(1) == pytest.approx(0.008)
    assert cost.step(2) == pytest.approx(0.009)
    assert cost.step(8) >= cost.step(4)                            # a larger tree never costs less
    assert cost.step(32) > cost.step(16)
    assert StepCost({1: 0.01}, 0.001, 0.002).draft(3) == pytest.approx(0.004)


def test_a_chains_cost_is_timed_with_the_lm_head_rows_acceptance_projects(monkeypatch):
    """A chain's step is timed as acceptance runs it: on a grid lm_head every node's row in one product (the likely
    path's projection, lm_head.NodeLogits), a single node's argmax alone; a batch of one-node sequences, their roots
    together (NodeLogits.together)."""
    from conftest import make_target

    from eagle_lite.targets.lm_head import LmHead

    target = make_target("llama", grid=True)
    assert target.lm.grid is not None
    rows = []
    logits = LmHead.logits
    monkeypatch.setattr(LmHead, "logits", lambda self, hidden: rows.append(hidden.shape[0]) or logits(self, hidden))
    with torch.inference_mode():
        cost_module.measure(target, rows=(1, 4, 8), repeats=1)
    assert rows == [1, 4, 8, cost_module.BATCH]    # then a batch's roots, in one product as a batch's step has them


def test_measure_times_a_long_context_and_a_batch_of_sequences():
    """Where the window holds PREFIX + LONG tokens the chains are timed there too, and a batch of one-node
    sequences against one chain gives what each more sequence adds; both are cached with the rest."""
    from conftest import make_target

    target = make_target("llama", max_pos=1024)
    with torch.inference_mode():
        cost = cost_module.measure(target, rows=(1, 4, 8), repeats=2)
    assert set(cost.verify_long) == {1, 4, 8} and all(cost.verify_long[n] >= cost.verify[n] for n in (1, 4, 8))
    assert cost.sequence >= 0.0
    again = StepCost(**{k: v for k, v in cost.as_dict().items() if k != "version"})
    assert again.step(4, context=700, sequences=3) == pytest.approx(cost.step(4, context=700, sequences=3))
    short = make_target("llama", max_pos=256)       # no room for the long context: none timed
    with torch.inference_mode():
        assert cost_module.measure(short, rows=(1, 4), repeats=1).verify_long == {}


def test_step_cost_is_measured_once_and_cached(llama, tmp_path, monkeypatch):
    monkeypatch.setenv("EAGLE_LITE_CACHE", str(tmp_path))
    calls = []
    measure = cost_module.measure
    monkeypatch.setattr(cost_module, "measure", lambda *a, **k: calls.append(1) or measure(*a, **k))
    torch.manual_seed(0)
    drafter = EagleDrafter(llama, DraftHead.for_target(llama))
    first = step_cost(llama, drafter, time_head=time_head)
    assert first.head > 0 and first.catch_up > 0 and all(s > 0 for s in first.verify.values())
    again = step_cost(llama, drafter, time_head=time_head)
    assert len(calls) == 1 and again.verify == first.verify and "cached" in again.source
    (file,) = (tmp_path / "costs").iterdir()
    file.write_text("{not json")
    step_cost(llama, drafter, time_head=time_head)  # an unreadable cache is measured again, with a warning
    assert len(calls) == 2 and json.loads(file.read_text())["version"] == cost_module.VERSION
    step_cost(llama, drafter, time_head=time_head, refresh=True)
    assert len(calls) == 3
    assert step_cost(llama).head == 0.0             # no head: another key, no head figures
    assert step_cost(llama, drafter).head == 0.0 and len(calls) == 4   # the head untimed (a server's caps): the same


def test_auto_is_the_default_method_and_runs_lookup_without_a_head(llama, caplog):
    torch.manual_seed(0)
    drafter = build("auto", llama, EagleOptions(head=DraftHead.for_target(llama)))
    assert isinstance(drafter, AutoDrafter) and drafter.inner is not None
    assert drafter.recommended_tree.depth >= 4 and drafter.recommended_tree.min_prob == 0.0
    bare = build("auto", llama)                     # no head ships for a tiny random target
    assert isinstance(bare, AutoDrafter) and bare.inner is None
    assert "prompt lookup" in caplog.text


def test_stats_show_the_split_by_choice(llama):
    torch.manual_seed(0)
    engine = Engine(llama, auto(llama, DraftHead.for_target(llama)))
    watched = Choices()     # the observer the pipeline attaches for method auto (AutoDrafter.statistics)
    engine.observers.append(watched)
    out = engine.generate(PROMPTS[0], GenerationConfig(max_new_tokens=30, tree=auto_tree(TREE), stop_at_eos=False))
    choices = watched.as_dict()
    assert set(choices) <= {"plain", "lookup", "head"}
    assert sum(c["steps"] for c in choices.values()) == len(out.stats.accept_lengths)
    assert all(c["predicted_ms"] > 0 and c["measured_ms"] > 0 for c in choices.values())
    # of each step, the draft's share: none predicted where the head sat out, some where it drafted
    assert all(c["predicted_draft_ms"] == 0 for kind, c in choices.items() if kind != "head")
    assert "head" in choices and choices["head"]["predicted_draft_ms"] > 0 and choices["head"]["measured_draft_ms"] > 0
    assert all(c["measured_draft_ms"] <= c["measured_ms"] for c in choices.values())
