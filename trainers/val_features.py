"""Feature caches of the held-out records alone: what `trainers.validate` scores heads on, without caching the other
95% of the data (on a CPU a whole cache takes hours: docs/training.md, the CPU recipe).

    python -m trainers.val_features data/distill/smollm2-sharegpt_all runs/val/sharegpt_all/features_eagle3
    python -m trainers.val_features data/distill/smollm2-sharegpt_all-seed runs/val/seed/features_eagle3
    python -m trainers.validate HEAD ... --features runs/val/sharegpt_all/features_eagle3 runs/val/seed/features_eagle3
    python -m trainers.validate HEAD ... --split dedup --features runs/val/sharegpt_all/features_eagle3

The records kept are those `data.loader.split=id` holds out at `--val-percent` (the split every head of this
project was trained with, so none of them trained on these); `--split dedup` in `trainers.validate` scores the
subset no near-duplicate of which trains. The cache stores the decoder layers EAGLE-3 heads read (`--taps`, the
published 1, 14, 26 by default), so plain and EAGLE-3 heads are scored on the same rows. A cache of held-out rows
only still leaves one row to the (unused) training side, its first: the same row for every head. Resumable shard
by shard, like every feature cache.
"""
from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

from eagle_lite.cli import arguments, entry_point
from eagle_lite.config import add_flag
from eagle_lite.threads import check_threads

from .distill import read_records
from .features import FeatureConfig, cache_features
from .sharegpt import split_of


def heldout_records(folders: list[str | Path], val_percent: float) -> list[dict]:
    """The records of the distill folders that the id split holds out, in folder and shard order."""
    return [r for folder in folders for r in read_records(folder) if split_of(r["id"], val_percent) == "heldout"]


@entry_point
def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m trainers.val_features", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("distill", nargs="+", help="distill folders (committed data/distill/... or a run's)")
    parser.add_argument("out", help="the feature cache folder to write")
    add_flag(parser, "val-percent", note="as the heads were trained with")
    parser.add_argument("--taps", default="1,14,26", help="decoder layers to store for EAGLE-3 heads ('' for none)")
    add_flag(parser, "target", default="smollm2")
    add_flag(parser, "threads")
    parser.add_argument("--max-len", type=int, default=1024)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    with arguments():
        check_threads(args.threads)
        try:
            taps = tuple(int(t) for t in args.taps.split(",") if t.strip())
        except ValueError:
            raise ValueError(f"--taps must be decoder layer numbers separated by commas, got {args.taps!r}") from None
        if not 0 <= args.val_percent <= 100:
            raise ValueError(f"--val-percent must be in [0, 100], got {args.val_percent}")
        cfg = FeatureConfig(max_len=args.max_len, shard_size=64, batch_size=4, feature_layers=taps)
        for folder in args.distill:
            if not (Path(folder) / "distill.json").is_file():
                raise FileNotFoundError(f"no distilled data in {folder} (missing distill.json)")
    records = heldout_records(args.distill, args.val_percent)
    from .targets import TargetConfig, build_target

    target = build_target(TargetConfig(spec=args.target, name=Path(args.target).stem, threads=args.threads))
    target.check_taps(taps, "--taps")
    manifest = cache_features(target, records, args.out, cfg)
    print(f"{args.out}: {manifest['total_sequences']} held-out sequences, {manifest['total_tokens']} tokens")
    return 0


if __name__ == "__main__":
    sys.exit(main())
