"""Medusa heads behind the same verifier: exactness, tree layout, checkpoints, training, tuning."""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")


from conftest import VOCAB, make_target, reference_greedy, tiny_train_config, train_config  # noqa: E402

from eagle_lite.config import GenerationConfig, SamplingConfig  # noqa: E402
from eagle_lite.decoding.engine import Engine  # noqa: E402
from eagle_lite.drafters import DraftInput, MedusaDrafter, NoDrafter  # noqa: E402
from eagle_lite.drafters.medusa import DEFAULT_CHOICES, check_choices, parse_choices, sized_choices  # noqa: E402
from eagle_lite.formats import load_head, load_medusa  # noqa: E402
from eagle_lite.heads.checkpoint import HeadMismatchError, save_head  # noqa: E402
from eagle_lite.heads.draft import DraftHead  # noqa: E402
from eagle_lite.heads.medusa import MedusaHeads, save_medusa  # noqa: E402
from trainers.medusa_objective import MedusaObjectiveConfig, medusa_agreement, medusa_objective  # noqa: E402
from trainers.objective import collate  # noqa: E402
from trainers.targets import TargetConfig, tiny_target  # noqa: E402


def random_heads(target, num_heads: int = 4, seed: int = 0) -> MedusaHeads:
    torch.manual_seed(seed)
    heads = MedusaHeads.for_target(target, num_heads)
    with torch.no_grad():
        for p in heads.parameters():
            p.normal_(0, 0.3)  # not the identity init: every head guesses something different
    return heads


class OracleMedusa(MedusaDrafter):
    """Knows the target's greedy continuation and puts it at the ranks of `path` (wrong tokens elsewhere),
    so the whole path is accepted every step and it is not the tree's first branch."""

    def __init__(self, target, heads, choices, sequence: list[int], path: list[int]) -> None:
        super().__init__(target, heads, choices)
        self.sequence, self.path = sequence, path

    def propose(self, inp: DraftInput, tree):
        self.n = len(inp.tokens)
        return super().propose(inp, tree)

    def top_tokens(self, hidden):
        top = torch.arange(self.depth * self.width).view(self.depth, self.width) % VOCAB  # L W: distinct guesses
        for d, rank in enumerate(self.path):
            truth = self.sequence[self.n + d] if self.n + d < len(self.sequence) else 0
            top[d][top[d] == truth] = (truth + 1) % VOCAB  # the truth only where the oracle puts it
            top[d, rank] = truth
        return top


# -- exactness ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("choices", [None, [[0], [0, 0], [0, 0, 0]], [[0], [1], [2], [3], [1, 0], [1, 1]]],
                         ids=["default", "chain", "wide"])
@pytest.mark.parametrize("prompt_len", [1, 23])
def test_medusa_greedy_equals_target_greedy(target, choices, prompt_len):
    prompt = torch.randint(VOCAB, (prompt_len,), generator=torch.Generator().manual_seed(prompt_len)).tolist()
    ref = reference_greedy(target, prompt, 30)
    engine = Engine(target, MedusaDrafter(target, random_heads(target), choices))
    result = engine.generate(prompt, GenerationConfig(max_new_tokens=30, stop_at_eos=False))
    assert result.token_ids == ref
    assert result.stats.target_forwards == 1 + len(result.stats.accept_lengths)


def test_oracle_heads_are_accepted_along_a_scattered_path_and_stay_exact(llama):
    prompt = [4, 9, 16, 25]
    ref = reference_greedy(llama, prompt, 41)
    path = [1, 0, 1]                                     # the truth sits on the second branch at depths 1 and 3
    choices = [[0], [1], [0, 0], [1, 0], [1, 1], [1, 0, 0], [1, 0, 1]]
    drafter = OracleMedusa(llama, random_heads(llama, 3), choices, prompt + ref, path)
    result = Engine(llama, drafter).generate(prompt, GenerationConfig(max_new_tokens=41, stop_at_eos=False))
    assert result.token_ids == ref
    assert result.stats.accept_lengths == [4] * 10       # 3 drafted + bonus per verify: 40 / 4
    # sampling: the same tree, exact acceptance of point-mass children; the oracle still gets accepted
    sampled = Engine(llama, drafter).generate(prompt, GenerationConfig(
        max_new_tokens=20, stop_at_eos=False, seed=0, sampling=SamplingConfig(temperature=1e-4)))
    assert sampled.token_ids == ref[:20] and sampled.stats.accept_length_mean > 1


def test_every_node_holds_its_heads_rank_and_parent():
    target = make_target("llama")
    choices = [[1, 0], [0], [2], [0, 1], [1], [0, 0], [1, 0, 0]]   # unsorted on purpose
    drafter = MedusaDrafter(target, random_heads(target, 3), choices)
    top = torch.tensor([[10, 11, 12], [20, 21, 22], [30, 31, 32]])  # head d's rank-i token: 10(d+1) + i
    drafter.top_tokens = lambda hidden: top
    tree = drafter.propose(DraftInput([5, 6, 7], torch.zeros(2, target.hidden_size)), None)
    # sorted by (depth, path): [0] [1] [2] [0,0] [0,1] [1,0] [1,0,0]
    assert drafter.choices == [[0], [1], [2], [0, 0], [0, 1], [1, 0], [1, 0, 0]]
    assert tree.tokens.tolist() == [7, 10, 11, 12, 20, 21, 20, 30]
    assert tree.parents == [-1, 0, 0, 0, 1, 1, 2, 6]
    assert tree.depths.tolist() == [0, 1, 1, 1, 2, 2, 2, 3]
    assert drafter.max_tree_nodes(None) == 8 and drafter.reset(100, keep=7) == 7


def test_medusa_reads_the_feature_of_the_token_before_the_root(llama):
    """head k's guesses come from hidden[-1] (the root was chosen from it) and fill depth k + 1."""
    heads = random_heads(llama, 2)
    drafter = MedusaDrafter(llama, heads, [[0], [0, 0]])
    hidden = torch.randn(3, llama.hidden_size)
    tree = drafter.propose(DraftInput([1, 2, 3, 4], hidden), None)
    with torch.no_grad():
        expected = llama.lm_head(heads(hidden[-1])).argmax(-1)   # [2]: head 0, head 1
    assert tree.tokens.tolist() == [4] + expected.tolist()


def test_choices_are_validated_and_parsed(tmp_path):
    assert DEFAULT_CHOICES == sized_choices(12, 4) and len(DEFAULT_CHOICES) == 12
    for n in (1, 5, 24):
        paths = check_choices(sized_choices(n, 3), 3, VOCAB)   # prefix-closed, no deeper than the heads
        assert len(paths) == n and max(len(p) for p in paths) <= 3
    bad = {"has no parent": [[0], [1, 0]], "listed twice": [[0], [0]], "heads guess only 2": [[0], [0, 0], [0, 0, 0]],
           "ranks must be <": [[VOCAB]], "non-empty list of ranks": [[0], []]}
    for message, choices in bad.items():
        with pytest.raises(ValueError, match=message):
            check_choices(choices, 2, VOCAB)
    assert parse_choices("[[0], [1], [0, 0]]") == [[0], [1], [0, 0]]
    file = tmp_path / "tree.json"
    file.write_text("[[0], [0, 0]]")
    assert parse_choices(str(file)) == [[0], [0, 0]]
    with pytest.raises(ValueError, match="not valid JSON"):
        parse_choices("[[0], [1")
    target = make_target("llama")
    shallow = [c for c in DEFAULT_CHOICES if len(c) <= 2]                  # what 2 heads can fill
    assert MedusaDrafter(target, random_heads(target, 2)).choices == sorted(shallow, key=lambda c: (len(c), c))


# -- checkpoints --------------------------------------------------------------------------------------
def test_heads_round_trip_and_refuse_the_wrong_target_or_kind(llama, tmp_path):
    heads = random_heads(llama, 3)
    path = save_medusa(heads, tmp_path / "medusa", llama, dtype=torch.float32, extra={"note": "test"})
    loaded = load_medusa(path, llama)
    x = torch.randn(5, llama.hidden_size)
    with torch.no_grad():
        torch.testing.assert_close(loaded(x), heads(x))
    config = json.loads((path / "config.json").read_text())
    assert config["format"] == "eagle_lite.medusa_heads" and config["num_heads"] == 3
    assert config["target"] == llama.fingerprint() and config["note"] == "test"
    with pytest.raises(HeadMismatchError, match=r"Medusa heads .* trained for target 'tiny-llama'.*embeddings"):
        load_medusa(path, make_target("llama", seed=1))
    with pytest.raises(ValueError, match="holds Medusa heads .*not an EAGLE draft head"):
        load_head(path, llama)
    eagle = save_head(DraftHead.for_target(llama), tmp_path / "eagle", llama)
    with pytest.raises(ValueError, match="holds an EAGLE draft head .*not Medusa heads"):
        load_medusa(eagle, llama)
    weights = path / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    with pytest.raises(ValueError, match="Medusa heads weights .* corrupt or truncated"):
        load_medusa(path, llama)
    with pytest.raises(FileNotFoundError, match="no Medusa heads at"):
        load_medusa(tmp_path / "nowhere", llama)


# -- the objective: the same alignment as the drafter --------------------------------------------------
def test_objective_alignment_with_oracle_features():
    """Features equal to f_{t+k+1} make head k's argmax the target's for x_{t+k+2}: top1 is perfect and
    the accept estimate is 1 + every head that still has a label."""
    target = tiny_target(TargetConfig(name="tiny", kind="tiny", seed=0))
    n, heads = 12, 3
    ids = torch.randint(2, target.vocab_size, (n,), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        hidden = target.decoder(input_ids=ids[None]).last_hidden_state[0]        # T H
    batch = collate([{"input_ids": ids, "hidden": hidden, "loss_mask": torch.ones(n, dtype=torch.bool)}],
                    max_len=n, pack=False)
    h = batch["hidden"].float()
    oracle = torch.stack([torch.nn.functional.pad(h[:, k + 1:], (0, 0, 0, k + 1)) for k in range(heads)])  # K B T H
    weight = target.lm_head.weight
    stats = medusa_agreement(oracle, batch, weight)
    roots = n - 2                                                                 # t with an x_{t+2}
    assert stats["roots"] == stats["tokens"] == stats["top1"] == roots
    assert [stats[f"hits{k}"] for k in range(heads)] == [roots - k for k in range(heads)]
    assert stats["accept"] == sum(1 + min(heads, roots - r) for r in range(roots))
    shifted = torch.stack([torch.nn.functional.pad(h[:, k:], (0, 0, 0, k)) for k in range(heads)])  # one too early
    assert medusa_agreement(shifted, batch, weight)["top1"] < roots / 2
    # soft labels: the oracle's distribution is the target's own, so its cross-entropy is the minimum
    soft = MedusaObjectiveConfig(labels="distribution")
    assert float(medusa_objective(oracle, batch, weight, soft)["loss"].detach()) < \
        float(medusa_objective(shifted, batch, weight, soft)["loss"].detach()) - 0.1


# -- training -----------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("medusa-runs")


def test_medusa_experiment_composes():
    from trainers.module import OptimConfig
    from trainers.train import _typed

    for extra in ([], ["target=tiny", "data=tiny"]):
        cfg = train_config("experiment=medusa", *extra)
        assert cfg.name == "medusa" and cfg.draft.kind == "medusa" and cfg.paths.output.endswith("/medusa")
        assert _typed(MedusaObjectiveConfig, cfg.draft.objective).labels == "distribution"
        _typed(OptimConfig, cfg.draft.optim)
    overfit = train_config("experiment=medusa", "debug=overfit")
    assert _typed(MedusaObjectiveConfig, overfit.draft.objective).noise == "none"
    with pytest.raises(ValueError, match="labels must be"):
        _typed(MedusaObjectiveConfig, train_config("draft=medusa", "draft.objective.labels=soft").draft.objective)


def test_fast_dev_run_exports_heads_that_load_and_draft_exactly(runs):
    from trainers.train import train

    result = train(tiny_train_config(runs, "draft=medusa", "debug=fdr", "draft.num_heads=3"))
    assert result["global_step"] == 1 and 0.0 <= result["val/top1"] <= 1.0
    assert 1.0 <= result["val/accept_len_est"] <= 4.0 and "val/top1_head2" in result
    target = tiny_target(TargetConfig(name="tiny", kind="tiny", seed=0))
    heads = load_medusa(result["export"], target)
    assert heads.num_heads == 3
    with pytest.raises(HeadMismatchError):
        load_medusa(result["export"], tiny_target(TargetConfig(name="tiny", kind="tiny", seed=1)))
    prompt = [5, 6, 7, 8]
    cfg = GenerationConfig(max_new_tokens=16, stop_at_eos=False)
    assert Engine(target, MedusaDrafter(target, heads)).generate(prompt, cfg).token_ids == \
        Engine(target, NoDrafter()).generate(prompt, cfg).token_ids


def test_loss_falls_when_overfitting_a_tiny_cache(runs):
    from trainers.train import train

    # hard labels: their cross-entropy can fall towards 0 (the soft labels' only to the target's entropy)
    result = train(tiny_train_config(runs, "experiment=medusa", "debug=overfit", "trainer.max_epochs=20",
                               "draft.objective.labels=token", "draft.optim.lr=1e-2"))
    first, last = result["epochs_log"][0], result["epochs_log"][-1]
    assert len(result["epochs_log"]) == 20 and last["step"] == 40
    assert last["train/loss"] < 0.7 * first["train/loss"], result["epochs_log"]
    assert last["train/top1"] > first["train/top1"] + 0.2


def test_a_run_folder_holding_the_other_kind_of_head_is_refused(runs):
    from trainers.train import check_run_folder

    cfg = tiny_train_config(runs, "draft=medusa", "name=shared")
    target = tiny_target(TargetConfig(name="tiny", kind="tiny", seed=0))
    save_head(DraftHead.for_target(target), cfg.paths.export, target)
    with pytest.raises(ValueError, match="holds an EAGLE draft head.*experiment=medusa"):
        check_run_folder(cfg)
    check_run_folder(tiny_train_config(runs, "name=shared"))             # the EAGLE run itself may resume
    check_run_folder(tiny_train_config(runs, "draft=medusa", "name=shared", "resume=false"))


# -- registration and tuning --------------------------------------------------------------------------
def test_pipeline_and_eval_methods_know_medusa(tiny_model_dir):
    from eagle_lite.drafters import MedusaOptions
    from eagle_lite.pipeline import load
    from eval.methods import build_methods

    lm = load(str(tiny_model_dir), method="medusa", options=MedusaOptions(heads="random", choices="[[0], [1], [0, 0]]"))
    vanilla = load(str(tiny_model_dir), method="vanilla")
    cfg = GenerationConfig(max_new_tokens=12)
    assert lm.generate("hello", cfg).token_ids == vanilla.generate("hello", cfg).token_ids
    assert lm.engine.drafter.choices == [[0], [1], [0, 0]]
    with pytest.raises(ValueError, match="needs --medusa PATH"):
        load(str(tiny_model_dir), method="medusa")
    with pytest.raises(ValueError, match="needs --medusa PATH"):
        build_methods(lm.target, ["medusa"])
    heads = MedusaOptions(heads=MedusaHeads.for_target(lm.target))
    assert set(build_methods(lm.target, ["medusa"], {"medusa": heads})) == {"medusa"}


def test_best_setting_must_reproduce_vanilla():
    from eval.tune import best

    rows = [{"method": "vanilla", "tokens_per_s": 10.0, "identical": 1.0},
            {"method": "fast but wrong", "tokens_per_s": 50.0, "identical": 0.5},
            {"method": "good", "tokens_per_s": 20.0, "identical": 1.0},
            {"method": "slow", "tokens_per_s": 5.0, "identical": 1.0}]
    assert best(rows)["method"] == "good"
    assert best(rows[:2]) is None


@pytest.mark.parametrize("method, extra, settings", [
    ("lookup", ["--num-tokens", "2,4"], ["lookup K=2", "lookup K=4", "lookup K=10 adaptive"]),
    ("eagle", ["--draft", "random", "--depths", "2", "--top-ks", "2,3", "--totals", "4,12"],
     ["eagle d=2 k=2 n=4", "eagle d=2 k=3 n=4", "eagle d=2 k=3 n=12"]),   # d=2 k=2 n=12 is not a valid tree
    ("medusa", ["--medusa", "random", "--nodes", "3,6"], ["medusa nodes=3", "medusa nodes=6"]),
])
def test_tune_prints_a_table_and_the_best_setting(tiny_model_dir, tmp_path, capsys, method, extra, settings):
    from eval.tune import main

    qfile = tmp_path / "questions.jsonl"
    qfile.write_text(json.dumps({"question_id": "a", "category": "chat", "turns": ["hi", "more"]}) + "\n"
                     + json.dumps({"question_id": "b", "category": "code", "turns": ["def f():"]}) + "\n")
    rc = main(["--method", method, "--target", str(tiny_model_dir), "--questions", str(qfile),
               "--max-new-tokens", "8", "--no-warmup", *extra])
    out = capsys.readouterr().out
    assert rc == 0, out
    table = [line.split("|")[1].strip() for line in out.splitlines() if line.startswith("| ") and "---" not in line]
    assert sorted(table[1:]) == sorted(settings + ["vanilla"])         # every candidate ran, nothing else
    assert out.count("| 100% |") == len(settings) + 1                   # every output equals vanilla's
    best_line = next(line for line in out.splitlines() if line.startswith("best: "))
    assert any(best_line.startswith(f"best: {s} at") for s in settings)
    assert "2 questions, 3 turns" in out


def test_tune_saves_the_best_tree_in_the_head_folder(tiny_model_dir, tmp_path, capsys):
    from eagle_lite.formats import load_head
    from eagle_lite.heads.checkpoint import read_head_config, save_head
    from eagle_lite.heads.draft import DraftHead
    from eagle_lite.pipeline import load
    from eval.tune import main

    target = load(str(tiny_model_dir), method="vanilla").target
    head_dir = save_head(DraftHead.for_target(target), tmp_path / "head", target)
    qfile = tmp_path / "questions.jsonl"
    qfile.write_text(json.dumps({"question_id": "a", "category": "chat", "turns": ["hi"]}) + "\n")
    common = ["--method", "eagle", "--target", str(tiny_model_dir), "--questions", str(qfile),
              "--max-new-tokens", "8", "--no-warmup", "--depths", "2", "--top-ks", "2", "--totals", "2,4"]
    assert main(common + ["--draft", "random", "--save-tree"]) == 2   # a flag combination wrong in itself
    assert "--save-tree records an eagle tree" in capsys.readouterr().err
    assert main(common + ["--draft", str(head_dir), "--save-tree"]) == 0
    out = capsys.readouterr().out
    best = next(line for line in out.splitlines() if line.startswith("best: "))
    tree = load_head(head_dir, target).tree
    assert best.startswith(f"best: eagle d=2 k=2 n={tree.total_tokens} at") and tree.depth == 2
    assert read_head_config(head_dir)["tree_command"].startswith("python -m eval.tune --method eagle")


def test_skip_per_category_keeps_later_questions_in_order():
    from eval.tasks import Question
    from eval.tune import skip_per_category

    qs = [Question(f"{c}{i}", c, [f"{c} {i}"]) for c in ("chat", "code") for i in range(4)]
    assert [q.question_id for q in skip_per_category(qs, 3)] == ["chat3", "code3"]
    assert skip_per_category(qs, 0) == qs


def test_tune_runs_explicit_trees_and_names_the_flags_that_select_the_best(tiny_model_dir, tmp_path, capsys):
    from eagle_lite.config import TreeConfig
    from eval.tune import main

    qfile = tmp_path / "questions.jsonl"
    qfile.write_text(json.dumps({"question_id": "a", "category": "chat", "turns": ["hi"]}) + "\n")
    rc = main(["--method", "eagle", "--target", str(tiny_model_dir), "--questions", str(qfile), "--draft", "random",
               "--max-new-tokens", "8", "--no-warmup", "--trees", "2,2,2", "3,2,4,0,0.01"])
    out = capsys.readouterr().out
    assert rc == 0, out
    table = [line.split("|")[1].strip() for line in out.splitlines() if line.startswith("| ") and "---" not in line]
    assert sorted(table[1:]) == ["eagle d=2 k=2 n=2", "eagle d=3 k=2 n=4 min_prob=0.01", "vanilla"]
    assert "--tree-min-prob" in next(line for line in out.splitlines() if line.startswith("best: "))
    assert TreeConfig.from_spec("3,2,4,0,0.01") == TreeConfig(3, 2, 4, 0, 0.01)
    with pytest.raises(ValueError, match="depth,top_k,total_tokens"):
        TreeConfig.from_spec("3,2")
    with pytest.raises(ValueError, match="min_prob must be in"):
        TreeConfig.from_spec("3,2,4,0,1.5")
