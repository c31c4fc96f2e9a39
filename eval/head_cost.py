"""`python -m eval.head_cost`: what one draft forward of each head costs at the CPU tree, piece by piece.

    python -m eval.head_cost --threads 2 --draft auto /path/to/eagle3_head

At the CPU tree (depth 1) a step's draft is one head forward over the features the last verify accepted (`--rows`,
about the accepted length), then the head's logits of the last row. For each head, as method eagle runs it (its
speed-ups applied): the median ms of that forward and of its pieces (fc; the q/k/v, o, gate/up and down products;
the logits, of which the final norm and the lm_head product), and how many device ops the forward and logits
launch (as `eval.step_cost --count-ops` counts them: eval/op_count.py). `eval.profile_step` times whole decoding
steps; this splits the draft's share of them.

    python -m eval.head_cost --threads 2 --draft auto PARALLEL_HEAD --chain 1,2,3,4,5

`--chain`: also the whole draft of a K-token greedy chain, through the drafter's own `propose` (its catch-up over
`--rows` accepted features, then its tree): a sequential head runs K forwards, a parallel head (draft.parallel) one
forward with K-1 mask rows. Median ms and device ops per draft, for each K.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch

from eagle_lite.cli import arguments, entry_point
from eagle_lite.drafters.eagle import EagleDrafter
from eagle_lite.kernels import few_rows_product, running_fused
from eagle_lite.options import add_flag, quiet_libraries, target_of
from eagle_lite.threads import check_threads, set_threads

from .op_count import OpCounter

PREFIX = 200   # committed pairs in the draft cache: mid-answer


def _median_ms(fn, reps: int) -> float:
    for _ in range(max(3, reps // 10)):
        fn()
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return 1000 * statistics.median(times)


def head_cost(drafter: EagleDrafter, rows: int = 3, reps: int = 200) -> dict[str, float]:
    """ms of a `rows`-row head forward after PREFIX committed pairs and its pieces, and the device ops it launches."""
    head, target = drafter.head, drafter.target
    hidden = target.hidden_size
    width = len(head.feature_layers) * hidden if head.design == "eagle3" else hidden
    g = torch.Generator().manual_seed(0)
    embed = target.embed_tokens
    drafter.reset(PREFIX + rows + 8)
    visible = torch.ones(rows, rows, dtype=torch.bool).tril_()
    with torch.inference_mode():
        for start in range(0, PREFIX, 20):
            head.step(torch.randn(20, width, generator=g), embed(torch.arange(start, start + 20) % target.vocab_size),
                      drafter.cache, torch.arange(start, start + 20), torch.ones(20, 20, dtype=torch.bool).tril_())
            drafter.cache.commit(20)
        features = torch.randn(rows, width, generator=g)
        embeds = embed((torch.arange(rows) + 100) % target.vocab_size)
        positions = torch.arange(PREFIX, PREFIX + rows)

        def forward() -> torch.Tensor:
            out = head.step(features, embeds, drafter.cache, positions, visible)
            drafter.cache.truncate(PREFIX)
            return out

        h = forward()
        last = h[-1:]
        attn, mlp = head.layer.self_attn, head.layer.mlp
        fc_input = features if head.design == "eagle3" else torch.cat([embeds, features], dim=-1)
        attn_input = torch.cat([embeds, h], dim=-1) if head.design == "eagle3" else h
        inner = torch.randn(rows, mlp.down_proj.in_features, generator=g)
        with OpCounter() as count:
            drafter._logits(forward()[-1:])
        return {
            "forward": _median_ms(forward, reps),
            "  fc": _median_ms(lambda: head.fc(fc_input), reps),
            "  q/k/v": _median_ms(lambda: (attn.q_proj(attn_input), attn.k_proj(attn_input), attn.v_proj(attn_input)),
                                  reps),
            "  o": _median_ms(lambda: attn.o_proj(h), reps),
            "  gate/up": _median_ms(lambda: (mlp.gate_proj(h), mlp.up_proj(h)), reps),
            "  down": _median_ms(lambda: mlp.down_proj(inner), reps),
            "logits": _median_ms(lambda: drafter._logits(last), reps),
            "  final norm": _median_ms(lambda: head.logit_features(last), reps),
            "  lm_head": _median_ms(lambda: few_rows_product(last, drafter.lm_weight, drafter.lm_grid), reps),
            "ops": count.total,
        }


def chain_cost(drafter: EagleDrafter, k: int, rows: int = 3, reps: int = 100) -> tuple[float, int]:
    """(median ms, device ops) of the drafter's whole `propose` of a K-token greedy chain after PREFIX committed
    pairs, reading `rows` new features: the catch-up and the tree, as the engine asks for them."""
    from eagle_lite.config import SamplingConfig, TreeConfig
    from eagle_lite.decoding.drafter import DraftInput

    target, head = drafter.target, drafter.head
    width = head.input_width
    g = torch.Generator().manual_seed(0)
    tokens = ((torch.arange(PREFIX + rows + 1) * 7919 + 100) % target.vocab_size).tolist()
    features = torch.randn(PREFIX + rows, width, generator=g).to(target.dtype)
    tree = TreeConfig(depth=k, top_k=1, total_tokens=k, lookup=0, min_prob=0.0)
    greedy = SamplingConfig()
    with torch.inference_mode():
        drafter.reset(PREFIX + rows + 8)
        drafter.propose(DraftInput(tokens[:PREFIX + 1], features[:PREFIX], greedy, None), tree)   # the prefix

        def draft():
            drafter.propose(DraftInput(tokens, features[PREFIX:], greedy, None), tree)
            drafter.cache.truncate(PREFIX)

        with OpCounter() as count:
            draft()
        return _median_ms(draft, reps), count.total


@entry_point
def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m eval.head_cost", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_flag(p, "target")
    add_flag(p, "draft", nargs="+", default=["auto"], note="one or more, each timed (default: auto)")
    p.add_argument("--rows", type=int, default=3, help="rows of the head forward (about the accepted length)")
    add_flag(p, "reps", default=300)
    add_flag(p, "threads")
    p.add_argument("--plain", action="store_true", help="the heads' fp32 weights instead of rounded codes")
    p.add_argument("--chain", default=None,
                   help="comma-separated chain lengths K: also time each head's whole draft of K tokens")
    args = p.parse_args(argv)
    with arguments():
        for flag, value in (("--rows", args.rows), ("--reps", args.reps)):
            if not 1 <= value:
                raise ValueError(f"{flag} must be >= 1, got {value}")
        check_threads(args.threads)
        chains = [int(k) for k in args.chain.split(",")] if args.chain else []
        if any(k < 1 for k in chains):
            raise ValueError(f"--chain takes chain lengths >= 1, got {args.chain}")
    from eagle_lite.drafters.eagle_options import eagle_drafter, load_eagle_head
    from eagle_lite.targets.loading import load_target

    quiet_libraries(False)
    set_threads(args.threads)
    target = load_target(target_of(args.target, args.draft[0]))   # the first head's target
    costs, chain_costs = {}, {}
    for draft in args.draft:
        drafter = eagle_drafter(target, load_eagle_head(target, draft), round_head=not args.plain)
        costs[draft] = head_cost(drafter, args.rows, args.reps)
        chain_costs[draft] = {k: chain_cost(drafter, k, args.rows, max(10, args.reps // 3)) for k in chains}
        fused = "layer as one op" if running_fused(drafter.head.layer) is not None else "layer in torch"
        print(f"{draft}: {drafter.head.design} head, {fused}, lm_head "
              f"{'from grid codes' if drafter.lm_grid is not None else 'fp32'}", file=sys.stderr)
    print(f"target {target.name} · {torch.get_num_threads()} threads · {args.rows} rows · median of {args.reps}\n")
    print("| ms | " + " | ".join(args.draft) + " |")
    print("|---|" + "---:|" * len(args.draft))
    for piece in next(iter(costs.values())):
        cells = [f"{c[piece]:.0f}" if piece == "ops" else f"{c[piece]:.3f}" for c in costs.values()]
        label = "device ops (forward + logits)" if piece == "ops" else piece
        print(f"| {label} | " + " | ".join(cells) + " |")
    if chains:
        print(f"\nThe whole draft of a K-token chain (`propose`: catch-up over {args.rows} rows, then the tree; "
              f"median ms / device ops):\n")
        print("| K | " + " | ".join(f"{d} ms | ops" for d in args.draft) + " |")
        print("|---:|" + "---:|---:|" * len(args.draft))
        for k in chains:
            print(f"| {k} | " + " | ".join(f"{chain_costs[d][k][0]:.3f} | {chain_costs[d][k][1]}" for d in args.draft)
                  + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
