"""`DraftDataModule`: batches of cached target features for the head.

A sequence longer than `max_len` is cropped to a random window while training (the first window for
validation); the window's features were computed with the full context, exactly what the target
gives at inference. Sequences are then either packed (several per row, each its own segment with
positions from 0 and attention that never crosses a segment) or padded one per row. Batches:

  input_ids [B, T] long, hidden [B, T, H] bf16, loss_mask [B, T] bool,
  segment [B, T] long (1, 2, ... per sequence in the row; 0 = padding), position_ids [B, T] long,
  and taps [B, T, K*H] bf16 where the caches hold the outputs of K decoder layers (EAGLE-3 heads),
  group [B, T] long: the validation group of each token's sequence (-1 = padding; `DraftDataModule.groups`)

Validation is a held-out part of the cache chosen by a hash of each record's id (all parts of a
ShareGPT chat on one side), so it does not change when the cache grows. Every sequence also belongs to a
group, reported apart in validation: its kind where its id says it ("<kind>:<n>", the seed prompts of
data/prompts/), else its cache's name (e.g. "sharegpt", "multi"). The hash holds out about val_percent of
each group.

Several caches of the same target (e.g. distilled answers plus ShareGPT's own text, `data.mix`) are
read as one: each index row names its cache.

Training order: a shuffle drawn from (seed, epoch) alone (`EpochShuffle`), and the datamodule's state in
Lightning's checkpoints says how far into which epoch a run got, so a run resumed mid-epoch goes on with that
epoch's remaining batches instead of replaying its first ones (`resume_at`), on the same or another number of ranks.
Over several ranks each reads its share of the one order (`EpochShuffle`), and validation reads every held-out
sequence once over all of them (`RankSlice`).
"""
from __future__ import annotations

import logging
import random
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import lightning.pytorch as L
import torch
from torch.utils.data import DataLoader, Dataset, DistributedSampler

from .features import FeatureCache, FeatureCacheMismatch
from .objective import collate
from .sharegpt import SPLITS, heldout_mask

log = logging.getLogger("trainers.datamodule")


@dataclass(frozen=True)
class LoaderConfig:
    max_len: int = 1024        # tokens per row (a packed row, or one cropped sequence)
    batch_size: int = 4        # sequences per batch (packing may put several in one row)
    pack: bool = True
    val_percent: float = 5.0   # share of cached sequences held out for validation
    split: str = "id"          # "dedup": near-duplicate ShareGPT chats held out only together (sharegpt.dedup_split_of)
    num_workers: int = 0
    seed: int = 0

    def __post_init__(self) -> None:
        if self.max_len < 3:
            raise ValueError(f"data.loader.max_len must be >= 3 (a pair and its next token), got {self.max_len}")
        if self.batch_size < 1:
            raise ValueError(f"data.loader.batch_size must be >= 1, got {self.batch_size}")
        if not 0 < self.val_percent < 100:
            raise ValueError(f"data.loader.val_percent must be in (0, 100), got {self.val_percent}")
        if self.split not in SPLITS:
            raise ValueError(f"data.loader.split must be one of {', '.join(SPLITS)}, got {self.split!r}")


def group_of(record_id: str, cache_name: str) -> str:
    """A sequence's validation group: the kind its id starts with ("qa:0012" -> "qa"), else its cache's name."""
    kind, sep, _ = record_id.partition(":")
    return kind if sep and kind else cache_name


class SequenceDataset(Dataset):
    """Sequences of the caches (rows of their joint index), each cut to at most max_len tokens; `groups` (one index a
    row) adds each item's validation group."""

    def __init__(self, caches: list[FeatureCache], rows, max_len: int, random_crop: bool,
                 groups: list[int] | None = None) -> None:
        self.caches = caches
        self.rows = rows.to_list() if hasattr(rows, "to_list") else list(rows)
        self.max_len = max_len
        self.random_crop = random_crop
        self.groups = groups

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        row = self.rows[i]
        length = min(row["length"], self.max_len)
        offset = random.randint(0, row["length"] - length) if self.random_crop else 0
        item = self.caches[row["cache"]].read(row["file"], row["start"] + offset, length)
        if self.groups is not None:
            item["group"] = self.groups[i]
        return item


class EpochShuffle(DistributedSampler):
    """A permutation of range(n) per epoch, drawn from (seed, epoch) alone; Lightning sets the epoch
    (`set_epoch`). `start(epoch, skip)` makes the next pass begin `skip` items into that epoch's order.

    Over `world` ranks, rank r takes items r, r + world, ... of that one order (padded at its end with its first
    items, as torch's DistributedSampler pads, so every rank has as many batches): step s of w ranks with batches of
    b reads items s*w*b ... (s+1)*w*b - 1 of the order, the batch one process with batches of w*b reads. It is a
    DistributedSampler, so Lightning uses it as it is instead of wrapping it in its own (which would not pass
    `set_epoch` on, nor `start`)."""

    def __init__(self, n: int, seed: int, rank: int = 0, world: int = 1) -> None:   # noqa: D107 (no super: no dataset)
        self.n, self.seed, self.epoch, self._skip = n, seed, 0, 0
        self.rank, self.world = rank, world

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def start(self, epoch: int, skip: int) -> None:
        self.epoch, self._skip = epoch, skip

    def __len__(self) -> int:
        return -(-self.n // self.world)

    def __iter__(self):
        order = torch.randperm(self.n, generator=torch.Generator().manual_seed(self.seed * 1_000_003 + self.epoch))
        skip, self._skip = self._skip, 0  # only the first pass after `start` is cut
        order = order[skip:].tolist()
        if self.world > 1 and order:
            order += order[:-len(order) % self.world]   # every rank as many items (pads by up to world - 1)
        return iter(order[self.rank::self.world])


class RankSlice(DistributedSampler):
    """Validation over `world` ranks: rank r reads items r, r + world, ... of range(n), none twice (unlike torch's
    DistributedSampler, which repeats items to even the ranks out): the metrics, summed over the ranks, are the
    metrics of one process."""

    def __init__(self, n: int, rank: int, world: int) -> None:   # noqa: D107 (no super: no dataset)
        self.n, self.rank, self.world = n, rank, world

    def set_epoch(self, epoch: int) -> None:
        pass

    def __len__(self) -> int:
        return len(range(self.rank, self.n, self.world))

    def __iter__(self):
        return iter(range(self.rank, self.n, self.world))


def collate_items(items: list[dict]) -> list[dict]:
    """The DataLoader's collate with online features: the items as they are (`trainers.online`)."""
    return items


def _seed_worker(worker_id: int) -> None:
    random.seed(torch.initial_seed() % 2**32)  # random crops differ per worker and follow Lightning's seed


def joint_index(caches: list[FeatureCache]):
    """One `datasets.Dataset` over every cache's index, with a `cache` column (its position in `caches`)."""
    import datasets

    parts = [cache.index() for cache in caches]
    parts = [part.add_column("cache", [k] * len(part)) for k, part in enumerate(parts)]
    return datasets.concatenate_datasets(parts)


class DraftDataModule(L.LightningDataModule):
    """`folder`: one feature cache folder, or a list of them (all built for the same target)."""

    def __init__(self, folder: str | list[str], cfg: LoaderConfig = LoaderConfig(),
                 expect_target: dict | None = None, feature_layers: tuple[int, ...] | None = None,
                 names: list[str] | None = None, records: list | None = None) -> None:
        """feature_layers: the decoder layers an EAGLE-3 head reads, which every cache must hold as its taps; () or
        None: the head reads the last hidden state, which every cache holds. names: one per folder, the validation
        group of its sequences whose ids name no kind (default: the folder's parent's name). records: online
        features (`trainers.online`): one `RecordCache` per folder, read instead of feature caches; the batches are
        then lists of items, made into batches by the module's `OnlineFeatures`."""
        super().__init__()
        self.folders = [str(folder)] if isinstance(folder, (str, Path)) else [str(f) for f in folder]
        self.names = list(names) if names is not None else [Path(f).parent.name for f in self.folders]
        if len(self.names) != len(self.folders):
            raise ValueError(f"{len(self.names)} names for {len(self.folders)} feature cache folders")
        self.groups: list[str] = []          # validation groups, sorted; batches carry their index
        self.train_groups = self.val_groups = None
        self.cfg = cfg
        self.expect_target = expect_target
        self.feature_layers = None if feature_layers is None else tuple(feature_layers)
        self.caches: list[FeatureCache] = []
        self.records = records
        self.train_rows = self.val_rows = None
        self.resume_at: tuple[int, int] | None = None  # (epoch, items done): where the next training pass starts

    def setup(self, stage: str | None = None) -> None:
        if self.caches:
            return
        self.caches = list(self.records) if self.records is not None else [
            FeatureCache(folder, self.expect_target) for folder in self.folders]
        for cache in self.caches if self.records is None else ():
            if self.feature_layers and cache.feature_layers != self.feature_layers:
                raise FeatureCacheMismatch(
                    f"feature cache {cache.folder} holds the outputs of decoder layers "
                    f"{list(cache.feature_layers) or 'none'}, the head reads {list(self.feature_layers)}: cache them "
                    f"for it in its own folder (paths.features=...)")
        index = joint_index(self.caches)
        if len(index) < 2:
            raise ValueError(f"feature cache {', '.join(self.folders)} holds {len(index)} sequence(s); training "
                             f"needs at least 2 (one for validation): raise data.distill.limit")
        heldout = heldout_mask(list(index["id"]), self.cfg.val_percent, self.cfg.split)
        if not any(heldout):
            heldout[-1] = True  # a tiny cache may hash nothing into validation: hold out its last sequence
        if all(heldout):
            heldout[0] = False
        self.train_rows = index.select([i for i, h in enumerate(heldout) if not h])
        self.val_rows = index.select([i for i, h in enumerate(heldout) if h])
        names = [group_of(i, self.names[c]) for i, c in zip(index["id"], index["cache"])]
        self.groups = sorted(set(names))
        number = {name: k for k, name in enumerate(self.groups)}
        self.train_groups = [number[n] for n, h in zip(names, heldout) if not h]
        self.val_groups = [number[n] for n, h in zip(names, heldout) if h]

    def _ranks(self) -> tuple[int, int]:
        trainer = self.trainer
        return (trainer.global_rank, trainer.world_size) if trainer is not None else (0, 1)

    def state_dict(self) -> dict:
        """Saved in Lightning's checkpoints: the epoch in progress, the batches each rank has trained on, and how many
        of the epoch's items that is over every rank (what a run resumed on another number of ranks goes on from)."""
        trainer = self.trainer
        if trainer is None:
            return {}
        batches = trainer.fit_loop.epoch_loop.batch_progress.current.processed
        return {"epoch": trainer.current_epoch, "batches": batches,
                "items": min(batches * self.cfg.batch_size * trainer.world_size, len(self.train_rows))}

    def load_state_dict(self, state: dict) -> None:
        if state:   # a checkpoint from before "items" was kept: one device
            items = state.get("items", int(state["batches"]) * self.cfg.batch_size)
            self.resume_at = (int(state["epoch"]), int(items))

    def _train_order(self, rows) -> EpochShuffle:
        """The shuffle of the training rows for this rank, started where `resume_at` says (once) after a resumed
        checkpoint: with the epoch's items not yet trained on, on whatever number of ranks this run has."""
        rank, world = self._ranks()
        order = EpochShuffle(len(rows), self.cfg.seed, rank, world)
        if self.resume_at is None:
            return order
        (epoch, items), self.resume_at = self.resume_at, None
        if items >= len(rows):  # saved on the epoch's last batch: the next starts afresh
            epoch, items = epoch + 1, 0
        order.start(epoch, items)
        return order

    def _loader(self, rows, train: bool) -> DataLoader:
        cfg = self.cfg
        return DataLoader(
            SequenceDataset(self.caches, rows, cfg.max_len, random_crop=train,
                            groups=self.train_groups if train else self.val_groups),
            batch_size=cfg.batch_size, num_workers=cfg.num_workers,
            sampler=self._train_order(rows) if train else RankSlice(len(rows), *self._ranks()),
            collate_fn=collate_items if self.records is not None else partial(collate, max_len=cfg.max_len,
                                                                               pack=cfg.pack),
            worker_init_fn=_seed_worker, persistent_workers=cfg.num_workers > 0,
        )

    def train_dataloader(self) -> DataLoader:
        return self._loader(self.train_rows, train=True)

    def val_dataloader(self) -> DataLoader:
        return self._loader(self.val_rows, train=False)
