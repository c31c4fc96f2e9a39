"""`DraftLightningModule`: the trainable head plus the frozen pieces of the target it reads.

It holds only the head (trained), the target's lm_head weight and token embeddings (frozen, non-
persistent buffers: never in checkpoints, never broadcast by DDP when `broadcast_buffers` is off),
never the whole target: the target's features come precomputed from the feature cache.

Logged: train/loss, train/loss_reg, train/loss_cls, train/top1 (per step and epoch; top1 within the
draft vocabulary, from the loss's own logits: no extra lm_head product); val/loss, val/top1, val/top3,
val/accept_len_est and val/top1_novel (top-1 on the answer tokens no 3-gram prompt lookup proposes: a small
target's greedy answers repeat, and copying them is easy) per validation epoch, against the target's argmax
over its full vocabulary; see `objective.agreement`. With validation groups (`DraftDataModule.groups`: the kinds of
the seed prompts, the other sources by name), also val_kind/<group>/top1 and val_kind/<group>/accept_len_est.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import lightning.pytorch as L
import torch
from torchmetrics.aggregation import SumMetric

from eagle_lite.heads.draft import DraftHead

from .objective import (
    ObjectiveConfig,
    agreement,
    head_loss,
    make_pairs,
    novel_pairs,
    objective,
    scored,
    unroll,
)


@dataclass(frozen=True)
class OptimConfig:
    lr: float = 1e-3
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.95)
    warmup_steps: int = 50        # linear warm-up, capped at 10% of the run
    min_lr_ratio: float = 0.1     # cosine decay to lr * min_lr_ratio at the last step
    mask_lr: float | None = None  # a parallel head's mask vectors (new in a fine-tune: they move far); None: lr

    def __post_init__(self) -> None:
        if self.lr <= 0:
            raise ValueError(f"draft.optim.lr must be > 0, got {self.lr}")
        if not 0 <= self.min_lr_ratio <= 1:
            raise ValueError(f"draft.optim.min_lr_ratio must be in [0, 1], got {self.min_lr_ratio}")


def lr_factor(step: int, total: int, cfg: OptimConfig) -> float:
    """Multiplier of cfg.lr at optimizer step `step` of `total`: linear warm-up, then cosine decay."""
    warmup = min(cfg.warmup_steps, max(total // 10, 1))
    if step < warmup:
        return (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(total - warmup, 1))
    return cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


def add_val_batch(val_sums, stats: dict, loss: torch.Tensor, device) -> None:
    """Accumulate one validation batch: the agreement counts val_sums tracks, the loss and a batch count."""
    for key, value in stats.items():
        if key in val_sums:
            val_sums[key].update(torch.tensor(value, dtype=torch.float32, device=device))
    val_sums["loss"].update(loss.detach().float())
    val_sums["batches"].update(torch.ones((), device=device))


def val_epoch_metrics(val_sums) -> tuple[dict, dict]:
    """(sums, the val/* metrics every head kind logs) for the finished epoch; resets the sums."""
    sums = {k: float(m.compute()) for k, m in val_sums.items()}  # synced across DDP ranks
    for m in val_sums.values():
        m.reset()
    tokens, roots = max(sums["tokens"], 1.0), max(sums["roots"], 1.0)
    return sums, {
        "val/loss": sums["loss"] / max(sums["batches"], 1.0),
        "val/top1": sums["top1"] / tokens,
        "val/top3": sums["top3"] / tokens,
        "val/accept_len_est": sums["accept"] / roots,
        **({"val/top1_novel": sums["top1_novel"] / max(sums["novel"], 1.0)} if "novel" in sums else {}),
        "val/tokens": sums["tokens"],   # scored over every rank: the same count on any number of them
    }


GROUP_STATS = ("top1", "tokens", "accept")


def group_metrics(group_sums, groups: tuple[str, ...]) -> dict:
    """val_kind/<group>/top1 and /accept_len_est of the finished epoch for every group that had tokens; resets."""
    sums = {k: float(m.compute()) for k, m in group_sums.items()}
    for m in group_sums.values():
        m.reset()
    out = {}
    for i, name in enumerate(groups):
        tokens = sums[f"tokens_{i}"]
        if tokens > 0:
            out[f"val_kind/{name}/top1"] = sums[f"top1_{i}"] / tokens
            out[f"val_kind/{name}/accept_len_est"] = sums[f"accept_{i}"] / tokens
    return out


class DraftLightningModule(L.LightningModule):
    def __init__(self, head: DraftHead, lm_head_weight: torch.Tensor, embed_weight: torch.Tensor,
                 objective_cfg: ObjectiveConfig = ObjectiveConfig(), optim_cfg: OptimConfig = OptimConfig(),
                 val_groups: tuple[str, ...] | list[str] = ()) -> None:
        """lm_head_weight, embed_weight: [V, H], the target's (copied: the target may be freed). val_groups: the names
        of the groups validation batches index (`group`), reported apart."""
        super().__init__()
        self.head = head
        self.online = None   # an OnlineFeatures (data.features.mode=online): not a submodule, never checkpointed
        self.val_groups = tuple(val_groups)
        if head.design == "eagle3" and objective_cfg.w_reg:
            raise ValueError(f"an EAGLE-3 head predicts no target feature (its own norm and lm_head score its output): "
                             f"draft.objective.w_reg must be 0, got {objective_cfg.w_reg}")
        self.objective_cfg = objective_cfg
        self.optim_cfg = optim_cfg
        self.save_hyperparameters({"objective": asdict(objective_cfg), "optim": asdict(optim_cfg),
                                   "draft_vocab_size": head.draft_vocab_size})
        lm = lm_head_weight.detach().float().clone()
        self.register_buffer("lm_weight", lm, persistent=False)                       # V H
        self._tied = embed_weight.data_ptr() == lm_head_weight.data_ptr()
        if not self._tied:
            self.register_buffer("embed", embed_weight.detach().float().clone(), persistent=False)  # V H
        if head.d2t is not None:
            self.register_buffer("draft_lm", lm[head.d2t.to(lm.device)].clone(), persistent=False)  # V_draft H
        self.val_sums = torch.nn.ModuleDict({k: SumMetric() for k in
                                             ("loss", "top1", "top3", "tokens", "accept", "roots", "batches",
                                                  "top1_novel", "novel")})
        self.group_sums = torch.nn.ModuleDict({f"{k}_{i}": SumMetric() for i in range(len(self.val_groups))
                                               for k in GROUP_STATS})

    @property
    def embed_weight(self) -> torch.Tensor:
        return self.lm_weight if self._tied else self.embed

    @property
    def draft_weight(self) -> torch.Tensor:
        """[V_draft, H]: the target's lm_head rows over the draft vocabulary (all of them without a reduced one):
        the target's distribution the draft learns, and what a head without its own lm_head scores with."""
        return self.lm_weight if self.head.d2t is None else self.draft_lm

    def scored(self, preds: list[torch.Tensor]) -> tuple[list[torch.Tensor], torch.Tensor]:
        return scored(self.head, preds, self.draft_weight)

    def training_step(self, batch: dict, batch_idx: int) -> torch.Tensor:
        losses = head_loss(self.head, batch, self.embed_weight, self.draft_weight, self.objective_cfg,
                           per_rank=self._per_rank())
        rows = int(batch["input_ids"].shape[0])
        for key, value in losses.items():
            self.log(f"train/{key}", value, prog_bar=key == "loss", on_step=True, on_epoch=True, batch_size=rows,
                     sync_dist=True)
        return losses["loss"]

    def on_after_batch_transfer(self, batch, dataloader_idx: int):
        """Online features (`trainers.online`): the target computes this batch's features here, on this device."""
        if isinstance(batch, list):
            if self.online is None:
                raise ValueError("a batch of records without features, and no online features: set "
                                 "data.features.mode=online for both the data and the module")
            return self.online(batch, self.device)
        return batch

    def _per_rank(self):
        """Over several ranks, the mean of a count over them (`objective.step_losses`: the loss of a step is then the
        mean over every rank's tokens, as on one process with the ranks' batches together); None on one."""
        trainer = self._trainer
        if trainer is None or trainer.world_size == 1:
            return None
        return lambda count: trainer.strategy.reduce(count, reduce_op="mean")

    def validation_step(self, batch: dict, batch_idx: int) -> None:
        cfg = self.objective_cfg
        pairs = make_pairs(batch, self.embed_weight, taps=bool(self.head.feature_layers))
        preds = unroll(self.head, pairs, max(cfg.ttt_steps, cfg.val_depth))
        novel = novel_pairs(batch)
        features, weight = self.scored(preds)
        loss = objective(features, pairs, self.draft_weight, cfg, novel, q_weight=weight)["loss"]
        groups = batch["group"][:, :-1] if self.val_groups and "group" in batch else None   # pair t: token t's
        stats = agreement(features, pairs, self.lm_weight, weight, self.head.d2t, novel, groups=groups,
                          num_groups=len(self.val_groups))
        add_val_batch(self.val_sums, stats, loss, self.device)
        if groups is not None:
            for i in range(len(self.val_groups)):
                for key in GROUP_STATS:
                    self.group_sums[f"{key}_{i}"].update(stats[f"group_{key}"][i])

    def on_validation_epoch_end(self) -> None:
        # the sums are reduced over the ranks already (torchmetrics); sync_dist=True says so to Lightning
        metrics = val_epoch_metrics(self.val_sums)[1]
        # the progress bar shows the headline (top-1) beside the loss; the rest go to the loggers and the summary,
        # where a bar of every metric wrapped into a column of them on an 80-column terminal
        self.log_dict({k: v for k, v in metrics.items() if k == "val/top1"}, prog_bar=True, sync_dist=True)
        self.log_dict({k: v for k, v in metrics.items() if k != "val/top1"}, prog_bar=False, sync_dist=True)
        if self.val_groups:
            self.log_dict(group_metrics(self.group_sums, self.val_groups), sync_dist=True)

    def configure_optimizers(self):
        cfg = self.optim_cfg
        # a parallel head's mask vectors (MedusaLightningModule's heads, which share this method, have none)
        masks = [self.head.mask_hidden, self.head.mask_embed] if getattr(self.head, "parallel", 0) else []
        rest = [p for p in self.head.parameters() if all(p is not m for m in masks)]
        groups = [{"params": rest}] + ([{"params": masks, "lr": cfg.mask_lr or cfg.lr}] if masks else [])
        optimizer = torch.optim.AdamW(groups, lr=cfg.lr, betas=tuple(cfg.betas), weight_decay=cfg.weight_decay)
        total = max(int(self.trainer.estimated_stepping_batches), 1)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: lr_factor(step, total, cfg))
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}
