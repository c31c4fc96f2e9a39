"""Score exported draft heads on a feature cache's validation split, with the metrics training logs.

    python -m trainers.validate eagle_lite/heads/smollm2 path/to/other/head \\
        --features runs/data/smollm2/sharegpt/features
    python -m trainers.validate HEAD --features DIR [DIR ...] --target smollm2 --threads 2

Every head is scored on the same sequences: the cache's held-out split as training draws it (a hash of each
record's id, `data.loader.val_percent`), so heads trained on different data or machines compare
like for like. `--split dedup` holds out only the records no near-duplicate of which trains (a subset of the id
split's: see `trainers.sharegpt.dedup_split_of`; docs/training.md compares the two). Printed per head: validation
loss, top-1 / top-3 agreement with the target's greedy token (and
top-1 on the "novel" answer tokens, those no 3-gram prompt lookup proposes: copying the rest is easy) and
the estimated chain acceptance (`val/accept_len_est`, `val_depth` unrolled steps; see `objective.agreement`).
Heads are loaded like any head (checked against the target); nothing is trained. Where the caches hold several
kinds of data (the seed prompts' kinds, named in their ids, or several caches, named by their folders' parents), a
second table gives each head's top-1 and estimated acceptance per kind.
"""
from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

from eagle_lite.cli import arguments, entry_point
from eagle_lite.options import add_flag, quiet_libraries, target_of
from eagle_lite.threads import check_threads

from .datamodule import DraftDataModule, LoaderConfig
from .features import FeatureCache, FeatureCacheMismatch, check_fingerprint
from .module import DraftLightningModule
from .objective import ObjectiveConfig

METRICS = ("val/top1", "val/top1_novel", "val/top3", "val/accept_len_est", "val/loss")


def validate_heads(target, heads: list[str | Path], features: list[str | Path], batch_size: int = 8,
                   val_percent: float = LoaderConfig.val_percent,
                   val_depth: int = ObjectiveConfig.val_depth, split: str = LoaderConfig.split) -> list[dict]:
    """One row per head: {"head", "sequences", "tokens", METRICS, and "kinds": {kind: {"top1", "accept_len_est"}}
    where the validation rows are of several kinds}, all on the same validation rows (`split`: "id" or "dedup", as
    `data.loader.split`)."""
    import lightning.pytorch as L

    from eagle_lite.formats import load_head

    data = DraftDataModule([str(f) for f in features],
                           LoaderConfig(batch_size=batch_size, val_percent=val_percent, split=split),
                           expect_target=target.fingerprint())
    data.setup("validate")
    split = {"sequences": len(data.val_rows), "tokens": int(sum(data.val_rows["loss_tokens"]))}
    trainer = L.Trainer(accelerator="auto", devices=1, logger=False, enable_progress_bar=False,
                        enable_model_summary=False, enable_checkpointing=False)
    rows = []
    held = data.caches[0].feature_layers
    groups = data.groups if len(data.groups) > 1 else []
    for path in heads:
        head = load_head(path, target).float().eval()
        if head.feature_layers and head.feature_layers != held:
            raise ValueError(f"head {path} reads decoder layers {list(head.feature_layers)}, but the feature caches "
                             f"hold {list(held) or 'only the last hidden state'}: score it on a cache built for it")
        # an EAGLE-3 head has no feature to regress (its loss is the token loss alone, as it was trained)
        losses = {"w_reg": 0.0, "w_cls": 1.0} if head.design == "eagle3" else {}
        module = DraftLightningModule(head, target.lm_head.weight, target.embed_tokens.weight,
                                      ObjectiveConfig(val_depth=val_depth, **losses), val_groups=groups)
        metrics = trainer.validate(module, datamodule=data, verbose=False)[0]
        kinds = {g: {k: float(metrics[f"val_kind/{g}/{k}"]) for k in ("top1", "accept_len_est")}
                 for g in groups if f"val_kind/{g}/top1" in metrics}
        rows.append({"head": str(path), **split, **{k: float(metrics[k]) for k in METRICS},
                     **({"kinds": kinds} if kinds else {})})
    return rows


def table(rows: list[dict]) -> str:
    lines = ["| head | sequences | answer tokens | top-1 | top-1 novel | top-3 | accept_len_est | loss |",
             "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['head']} | {r['sequences']} | {r['tokens']} | {r['val/top1']:.3f} "
                     f"| {r['val/top1_novel']:.3f} | {r['val/top3']:.3f} | {r['val/accept_len_est']:.2f} "
                     f"| {r['val/loss']:.3f} |")
    kinds = list(dict.fromkeys(k for r in rows for k in r.get("kinds", {})))
    if kinds:   # per kind: estimated acceptance (top-1)
        lines += ["", "| head | " + " | ".join(kinds) + " |", "|---|" + "---:|" * len(kinds)]
        for r in rows:
            cells = [f"{r['kinds'][k]['accept_len_est']:.2f} ({r['kinds'][k]['top1']:.3f})" if k in r.get("kinds", {})
                     else "" for k in kinds]
            lines.append(f"| {r['head']} | " + " | ".join(cells) + " |")
        lines.append("\nper kind: estimated accepted length (top-1)")
    return "\n".join(lines)


@entry_point
def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m trainers.validate", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("heads", nargs="+", help="exported head folders (config.json + model.safetensors)")
    parser.add_argument("--features", nargs="+", required=True,
                        help="feature cache folders of the heads' target (trainers.features), read as one")
    add_flag(parser, "target", note="unset: the one the first head was trained for, where it loads here; else smollm2")
    add_flag(parser, "device")
    add_flag(parser, "threads")
    parser.add_argument("--batch-size", type=int, default=8, help="sequences per validation batch")
    add_flag(parser, "val-percent", default=LoaderConfig.val_percent, note="as the heads were trained with")
    parser.add_argument("--val-depth", type=int, default=ObjectiveConfig.val_depth,
                        help="unrolled steps for accept_len_est")
    parser.add_argument("--split", default=LoaderConfig.split,
                        help="id: held out by a hash of each record's id (as training draws it); dedup: near-duplicate "
                             "ShareGPT chats held out only together, so no held-out prompt opens like a trained one")
    args = parser.parse_args(argv)
    quiet_libraries(False)   # transformers' loading bars: what a user reads is the table, or one line
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    logging.getLogger("lightning.pytorch").setLevel(logging.WARNING)
    print(table(run(args)))
    return 0


def run(args: argparse.Namespace) -> list[dict]:
    """Check what can be checked without the target, load it, and score the heads."""
    from eagle_lite.heads.checkpoint import read_head_config

    from .targets import TargetConfig, build_target

    with arguments():
        check_threads(args.threads)
        for flag, value in (("--batch-size", args.batch_size), ("--val-depth", args.val_depth)):
            if value < 1:
                raise ValueError(f"{flag} must be >= 1, got {value}")
        LoaderConfig(batch_size=args.batch_size, val_percent=args.val_percent, split=args.split)   # its checks
    for head in args.heads:
        read_head_config(head)
    caches = [FeatureCache(folder) for folder in args.features]
    spec = target_of(args.target, args.heads[0]) or "smollm2"
    target = build_target(TargetConfig(spec=spec, name=Path(spec).stem, device=args.device, threads=args.threads))
    for folder, cache in zip(args.features, caches):   # training's own check, with validate's fix
        built = cache.manifest["target"]
        try:
            check_fingerprint(built, target.fingerprint(), folder)
        except FeatureCacheMismatch:
            raise ValueError(f"feature cache {folder} holds the features of target '{built.get('name')}', not of "
                             f"'{spec}': pass --target {built.get('name')} (the cache stays as it is)") from None
    return validate_heads(target, args.heads, args.features, args.batch_size, args.val_percent, args.val_depth,
                          args.split)


if __name__ == "__main__":
    sys.exit(main())
