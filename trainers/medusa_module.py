"""`MedusaLightningModule`: Medusa heads plus the target's frozen lm_head, trained on cached features.

The same data, trainer, checkpoints, optimizer and schedule as `DraftLightningModule` (the heads sit
in `self.head` so the pipeline treats both alike); only the objective differs (`medusa_objective`).

Logged: train/loss, train/top1 (head 0); val/loss, val/top1, val/top3 (head 0), val/top1_head{k},
val/accept_len_est (a greedy [0, 0, ...] chain; see `medusa_agreement`).
"""
from __future__ import annotations

from dataclasses import asdict

import lightning.pytorch as L
import torch
from torchmetrics.aggregation import SumMetric

from eagle_lite.heads.medusa import MedusaHeads

from .medusa_objective import MedusaObjectiveConfig, medusa_agreement, medusa_objective
from .module import DraftLightningModule, OptimConfig, add_val_batch, val_epoch_metrics
from .objective import add_noise


class MedusaLightningModule(L.LightningModule):
    def __init__(self, head: MedusaHeads, lm_head_weight: torch.Tensor,
                 objective_cfg: MedusaObjectiveConfig = MedusaObjectiveConfig(),
                 optim_cfg: OptimConfig = OptimConfig()) -> None:
        """lm_head_weight: [V, H], the target's (copied: the target may be freed)."""
        super().__init__()
        self.head = head
        self.objective_cfg = objective_cfg
        self.optim_cfg = optim_cfg
        self.save_hyperparameters({"objective": asdict(objective_cfg), "optim": asdict(optim_cfg),
                                   "num_heads": head.num_heads, "num_layers": head.num_layers})
        self.register_buffer("lm_weight", lm_head_weight.detach().float().clone(), persistent=False)  # V H
        keys = ["loss", "batches", "top1", "top3", "tokens", "accept", "roots"]
        keys += [f"{name}{k}" for k in range(head.num_heads) for name in ("hits", "rows")]
        self.val_sums = torch.nn.ModuleDict({k: SumMetric() for k in keys})

    def training_step(self, batch: dict, batch_idx: int) -> torch.Tensor:
        feats = self.head(add_noise(batch["hidden"].float(), self.objective_cfg))  # K B T H
        losses = medusa_objective(feats, batch, self.lm_weight, self.objective_cfg)
        rows = int(batch["input_ids"].shape[0])
        for key, value in losses.items():
            self.log(f"train/{key}", value, prog_bar=key == "loss", on_step=True, on_epoch=True, batch_size=rows,
                     sync_dist=True)
        return losses["loss"]

    def validation_step(self, batch: dict, batch_idx: int) -> None:
        feats = self.head(batch["hidden"].float())                                 # K B T H
        loss = medusa_objective(feats, batch, self.lm_weight, self.objective_cfg)["loss"]
        add_val_batch(self.val_sums, medusa_agreement(feats, batch, self.lm_weight), loss, self.device)

    def on_validation_epoch_end(self) -> None:
        sums, metrics = val_epoch_metrics(self.val_sums)
        for k in range(self.head.num_heads):
            metrics[f"val/top1_head{k}"] = sums[f"hits{k}"] / max(sums[f"rows{k}"], 1.0)
        self.log_dict(metrics, prog_bar=False, sync_dist=True)   # the sums are reduced over the ranks already

    def on_load_checkpoint(self, checkpoint: dict) -> None:
        """Refuse, by name, a resume checkpoint of another kind of head (an EAGLE run in the same folder)."""
        other = sorted(k for k in checkpoint.get("state_dict", {}) if not k.startswith("head.heads."))
        if other:
            raise ValueError(f"the checkpoint to resume from was not written by Medusa training (it holds {other[:3]}"
                             f"...): give this run its own folder (experiment=medusa, or name=...) or resume=false")

    # the same AdamW with linear warm-up and cosine decay over self.head's parameters
    configure_optimizers = DraftLightningModule.configure_optimizers
