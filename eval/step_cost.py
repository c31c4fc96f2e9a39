"""`python -m eval.step_cost`: what one static step costs: the verify forward against tree size, and the draft step.

    python -m eval.step_cost --device cuda --dtype bfloat16        # SmolLM2 + its head, and a ~1B random Llama
    python -m eval.step_cost --tiny                                # tiny random models on the CPU: a check it runs
    python -m eval.step_cost --device cuda --targets llama1b --sizes 1,8,64 --prefix 2048 --modes eager,cuda-graph

For each target, the static step's verify (target forward over a tree of N nodes after a prefix of `--prefix`
tokens, the lm_head over all N rows, tensor acceptance, the cache commit) is timed at each tree size, in each
mode (eager: every kernel launched from Python; cuda-graph: one graph replay), wall clock with the device
synchronised before and after, the step state restored between repetitions (so every repetition sees the same
prefix), median of `--reps`. N = 1 is plain decoding's step, a one-token forward. The ratio column is the
verify's cost in units of that one-token step in the same mode: the issue's aim is a 64-node verify within 1.3x.
The draft step (the head reads the accepted features, then grows the tree: `depth` head forwards, top-k, rerank)
is timed for each `--trees` (default: the head's recommended tree on the device, without its lookup graft).

`--count-ops` counts instead of timing (eval/op_count.py): the device operations the steps launch, run eagerly on
the CPU through the models' own modules (the code a CUDA graph captures), per step, per emitted token, per draft
depth and per target layer, for vanilla_graph and eagle_graph over `--count-prompts` held-out prompts (random
tokens for a target without a tokenizer) at the `--trees` given (default depth 6, top_k 10, 60 nodes: the GPU's
tree), with the host reads inside the steps. `--launch-us` prices a launch (the H100's plain graph step, ~4.3 ms
for 1,143 launches: ~3.8 us). Counting needs no exclusive machine: the counts do not depend on its load.

    python -m eval.step_cost --count-ops                     # SmolLM2 and its head
    python -m eval.step_cost --count-ops --targets tiny      # a 2-layer random Llama, seconds

Targets: `smollm2` (the embedded target; the head shipped for it, else a random one), `llama1b` (a random-weight
Llama of Llama-3.2-1B's shape, ~1.2B parameters, built in-process on the device: no download), `tiny` (a 2-layer
random Llama), or any spec `load_target` takes (with a random head).
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

from eagle_lite.atomic import check_writable, write_text_atomic
from eagle_lite.cli import arguments, entry_point
from eagle_lite.config import TreeConfig
from eagle_lite.decoding.static.tree import BUCKETS, StaticTree, bucket_for
from eagle_lite.options import add_flag
from eagle_lite.pipeline import static_engine_for
from eagle_lite.threads import check_threads, set_threads

from .tuning import ints

ROOT = Path(__file__).resolve().parents[1]

LLAMA_1B = dict(vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=8192, rope_theta=500000.0,
                tie_word_embeddings=True)
TINY = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=2048)


def random_llama(sizes: dict, name: str, device: str, dtype: torch.dtype, attention: str):
    """A Llama of these sizes with random weights, built on `device` (no download), as a Target."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from eagle_lite.targets.model import Target

    torch.manual_seed(0)
    with torch.device(device):
        model = LlamaForCausalLM(LlamaConfig(**sizes, eos_token_id=None, bos_token_id=None, pad_token_id=0))
    return Target(model.to(dtype).eval(), name=name, attention=attention)


def load(spec: str, device: str, dtype: torch.dtype, attention: str, draft: str = "auto"):
    """(target, head, note) for a --targets entry; `draft`: the head ("auto": the shipped one, or a head folder)."""
    from eagle_lite.drafters import registry
    from eagle_lite.heads.draft import DraftHead
    from eagle_lite.targets.loading import load_target

    if spec == "llama1b":
        target = random_llama(LLAMA_1B, "llama-1b-random", device, dtype, attention)
    elif spec == "tiny":
        target = random_llama(TINY, "tiny-llama-random", device, dtype, attention)
    else:
        target = load_target(spec, dtype=dtype, device=device, attention=attention)
    head = registry.load_eagle_head(target, draft) if spec not in ("llama1b", "tiny") else None
    note = "shipped head" if draft == "auto" else f"head {draft}"
    if head is None:
        torch.manual_seed(0)
        head, note = DraftHead.for_target(target), "random head"
    return target, head, note


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def median_ms(run, restore, reps: int, device: torch.device, warmup: int = 2) -> float:
    """Median wall time of `run()` in ms, the device synchronised around it and `restore()` before each run."""
    times = []
    for i in range(warmup + reps):
        restore()
        sync(device)
        start = time.perf_counter()
        run()
        sync(device)
        if i >= warmup:
            times.append(1e3 * (time.perf_counter() - start))
    return statistics.median(times)


def random_tree(nodes: int, depth: int, vocab: int, seed: int) -> tuple[list[int], list[int]]:
    """(tokens, parents) of a random tree of `nodes` nodes at most `depth` levels deep (root: node 0)."""
    g = torch.Generator().manual_seed(seed)
    parents, depths = [-1], [0]
    for i in range(1, nodes):
        allowed = [j for j in range(i) if depths[j] < depth]
        parent = allowed[int(torch.randint(len(allowed), (1,), generator=g))]
        parents.append(parent)
        depths.append(depths[parent] + 1)
    return torch.randint(vocab, (nodes,), generator=g).tolist(), parents


def snapshot(engine):
    saved = [t.clone() for t in engine._state.small()]

    def restore() -> None:
        for t, v in zip(engine._state.small(), saved):
            t.copy_(v)

    return restore


def tree_of_size(nodes: int) -> TreeConfig:
    """A tree config whose verify bucket holds `nodes` nodes (its contents are filled in at random)."""
    depth = max(1, min(6, nodes - 1))
    return TreeConfig(depth=depth, top_k=10, total_tokens=max(1, nodes - 1))


def verify_ms(engine, prompt: list[int], nodes: int, reps: int) -> float:
    """The verify step over a random tree of `nodes` nodes (plain decoding's step for 1), after `prompt`."""
    target = engine.target
    tree = tree_of_size(nodes)
    need = len(prompt) + bucket_for(nodes) + tree.depth + 2
    engine._prepare(need, tree)
    engine._prefill(prompt)
    if engine.draft is not None:
        tokens, parents = random_tree(nodes, tree.depth, target.vocab_size, nodes)
        engine._state.tree.fill(StaticTree.build(tokens, parents, engine._state.tree.tokens.numel(), target.device))
    restore = snapshot(engine)
    run = engine._runner("verify")          # a CUDA graph is captured here, outside the timing
    return median_ms(run, restore, reps, target.device)


def draft_ms(engine, prompt: list[int], tree: TreeConfig, reps: int) -> float:
    engine._prepare(len(prompt) + bucket_for(1 + tree.total_tokens) + tree.depth + 2, tree)
    engine._prefill(prompt)
    restore = snapshot(engine)
    run = engine._runner("draft")
    return median_ms(run, restore, reps, engine.target.device)


def measure(target, head, args) -> dict:
    """{"verify": {mode: {nodes: ms}}, "draft": {mode: {tree label: ms}}} for one target."""
    g = torch.Generator().manual_seed(1)
    prompt = torch.randint(target.vocab_size, (args.prefix,), generator=g).tolist()
    out: dict = {"verify": {}, "draft": {}}
    trees = args.trees or [head_tree(head)]
    with torch.inference_mode():
        for mode in args.modes:
            plain, eagle = (static_engine_for(target, h, mode).backend for h in (None, head))
            with plain.running(), eagle.running():
                out["verify"][mode] = {n: verify_ms(plain if n == 1 else eagle, prompt, n, args.reps)
                                       for n in args.sizes}
                out["draft"][mode] = {tree_label(t): draft_ms(eagle, prompt, t, args.reps) for t in trees}
    return out


def head_tree(head) -> TreeConfig:
    """The head's recommended tree on this device (as the static step drafts it: no lookup graft), else depth 6,
    top_k 10, total_tokens 60."""
    tree = getattr(head, "tree", None) or TreeConfig(depth=6, top_k=10, total_tokens=60)
    return TreeConfig(tree.depth, tree.top_k, tree.total_tokens, 0, tree.min_prob)


def tree_label(tree: TreeConfig) -> str:
    return f"d={tree.depth} k={tree.top_k} n={tree.total_tokens}" + (f" p={tree.min_prob:g}" if tree.min_prob else "")


def markdown(name: str, result: dict, modes: list[str], sizes: list[int]) -> str:
    lines = ["| tree nodes | " + " | ".join(f"verify {m} ms" for m in modes) + " | "
             + " | ".join(f"vs 1 node ({m})" for m in modes) + " |",
             "|---:|" + "---:|" * (2 * len(modes))]
    for n in sizes:
        times = [result["verify"][m][n] for m in modes]
        ratios = [result["verify"][m][n] / result["verify"][m][sizes[0]] if sizes[0] == 1 else float("nan")
                  for m in modes]
        lines.append(f"| {n} | " + " | ".join(f"{t:.3f}" for t in times) + " | "
                     + " | ".join(f"{r:.2f}x" for r in ratios) + " |")
    lines += ["", "| draft step | " + " | ".join(f"{m} ms" for m in modes) + " |", "|---|" + "---:|" * len(modes)]
    for label in result["draft"][modes[0]]:
        lines.append(f"| {label} | " + " | ".join(f"{result['draft'][m][label]:.3f}" for m in modes) + " |")
    return f"### {name}\n\n" + "\n".join(lines)


def count_ops(target, head, args) -> list:
    """[vanilla_graph, eagle_graph] StepOps over the prompts (eval/op_count.py)."""
    from eagle_lite.config import GenerationConfig

    from .op_count import count_generation
    prompts = count_prompts(target, args)
    tree = args.trees[0] if args.trees else TreeConfig(depth=6, top_k=10, total_tokens=60)
    cfg = GenerationConfig(max_new_tokens=args.count_tokens, stop_at_eos=False, tree=tree)
    with torch.inference_mode():
        return [count_generation(static_engine_for(target, h, "eager"), prompts, cfg) for h in (None, head)]


def count_prompts(target, args) -> list[list[int]]:
    """The first `--count-prompts` held-out questions in the target's chat format; random tokens where the target
    has no tokenizer (the random Llamas)."""
    if getattr(target, "tokenizer", None) is None:
        g = torch.Generator().manual_seed(1)
        return [torch.randint(target.vocab_size, (args.prefix,), generator=g).tolist()
                for _ in range(args.count_prompts)]
    from .runner import conversation_prompts
    from .tasks import load_question_file
    questions = load_question_file(args.count_questions, 1)[:args.count_prompts]
    return [conversation_prompts(target, q, []) for q in questions]


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m eval.step_cost", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--targets", default=None, help="comma-separated: smollm2, llama1b, tiny, or load_target specs "
                                                   "(default: smollm2,llama1b; --tiny: tiny)")
    p.add_argument("--tiny", action="store_true", help="tiny random models, few repetitions: a quick check on a CPU")
    add_flag(p, "device")
    add_flag(p, "dtype", default=None, note="unset: bfloat16 on CUDA, float32 elsewhere")
    add_flag(p, "attention", note="the static step runs gqa or sdpa")
    p.add_argument("--sizes", type=ints, default=[b for b in BUCKETS if b in (1, 2, 4, 8, 16, 32, 64, 128)],
                   help="tree sizes (nodes, root included); 1 = plain decoding's one-token step")
    p.add_argument("--prefix", type=int, default=None, help="prompt tokens before the tree (default 512; --tiny 32)")
    p.add_argument("--modes", default=None, help="comma-separated static step modes (default: eager,cuda-graph on "
                                                 "CUDA, eager elsewhere)")
    add_flag(p, "trees", note="the draft steps timed (default: the head's tree)")
    add_flag(p, "reps", note="of each cell (default 20; --tiny 3)")
    add_flag(p, "threads")
    p.add_argument("--out", type=Path, help="also write the numbers as JSON here")
    add_flag(p, "draft", note="the head of a real target")
    p.add_argument("--count-ops", action="store_true", help="count the device operations the steps launch "
                                                             "(eagerly, on the CPU) instead of timing them")
    p.add_argument("--count-prompts", type=int, default=3, help="--count-ops: held-out prompts (default 3)")
    p.add_argument("--count-questions", type=Path, default=ROOT / "eval" / "questions" / "heldout12.jsonl",
                   help="--count-ops: the question file whose first prompt of each kind is counted")
    p.add_argument("--count-tokens", type=int, default=16, help="--count-ops: new tokens a prompt (default 16)")
    p.add_argument("--launch-us", type=float, default=3.8, help="--count-ops: microseconds a launch costs, to price "
                                                                "the counts (default 3.8: the H100's graph step)")
    args = p.parse_args(argv)
    cuda = args.device.startswith("cuda")
    default = "tiny" if args.tiny else ("smollm2" if args.count_ops else "smollm2,llama1b")
    args.targets = [t.strip() for t in (args.targets or default).split(",")
                    if t.strip()]
    args.dtype = args.dtype or ("bfloat16" if cuda else "float32")
    args.prefix = args.prefix if args.prefix is not None else (32 if args.tiny else 512)
    args.reps = args.reps if args.reps is not None else (3 if args.tiny else 20)
    args.modes = [m.strip() for m in (args.modes or ("eager,cuda-graph" if cuda else "eager")).split(",") if m.strip()]
    args.sizes = sorted(set(args.sizes))
    return args


@entry_point
def main(argv=None) -> int:
    args = parse_args(argv)
    from eagle_lite.decoding.static.step import MODES
    from eagle_lite.options import quiet_libraries
    from eagle_lite.targets.loading import check_device

    quiet_libraries(False)
    check_device(args.device)
    with arguments():
        check_threads(args.threads)
        bad = [m for m in args.modes if m not in MODES]
        if bad:
            raise ValueError(f"unknown mode(s) {bad}: choose from {', '.join(MODES)}")
        if args.prefix < 1 or args.reps < 1 or args.count_prompts < 1 or args.count_tokens < 2:
            raise ValueError("--prefix, --reps and --count-prompts must be >= 1, --count-tokens >= 2")
        if args.count_ops and args.device != "cpu":
            raise ValueError("--count-ops counts on the CPU (the counts are the device's launches): drop --device")
        if max(args.sizes) > BUCKETS[-1]:
            raise ValueError(f"--sizes: the largest tree the static step verifies is {BUCKETS[-1]} nodes")
        if args.out:
            check_writable(args.out, "--out")   # before the measurements it will hold
    set_threads(args.threads)
    results = {}
    for spec in args.targets:
        target, head, note = load(spec, args.device, getattr(torch, args.dtype), args.attention, args.draft)
        if args.count_ops:
            from .op_count import markdown as ops_markdown
            rows = count_ops(target, head, args)
            results[spec] = {"target": target.name, "note": note, "ops": [r.as_dict() for r in rows]}
            tree = args.trees[0] if args.trees else TreeConfig(depth=6, top_k=10, total_tokens=60)
            print(f"target {target.name} ({note}) · {args.dtype} · launches counted eagerly on the CPU · "
                  f"{tree_label(tree)} · {args.count_prompts} prompts x {args.count_tokens} tokens\n\n"
                  + ops_markdown(rows, args.launch_us) + "\n", flush=True)
            continue
        result = measure(target, head, args)
        results[spec] = {"target": target.name, "note": note, **result}
        header = (f"target {target.name} ({note}) · {target.device} · {args.dtype} · prefix {args.prefix} · "
                  f"median of {args.reps} · {torch.get_num_threads()} threads")
        print(header + "\n\n" + markdown(target.name, result, args.modes, args.sizes) + "\n", flush=True)
        del target, head
        if args.device.startswith("cuda"):
            torch.cuda.empty_cache()
    if args.out:
        write_text_atomic(args.out, json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
