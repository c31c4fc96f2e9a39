"""What Medusa heads are trained to do, on the same cached features as the EAGLE head.

Alignment (exactly what `eagle_lite.drafters.medusa` does at inference): the target read x_0..x_{T-1}
and gave features f_0..f_{T-1}. Head k at position t reads f_t and predicts x_{t+s}, s = k + 2 (the
target's own lm_head on f_t predicts x_{t+1}). Its loss at t counts when x_{t+s} is a target-written
(loss-masked) token of t's sequence. The label is either
  "distribution": the target's own softmax(W f_{t+s-1}), its distribution over x_{t+s} (self-distillation,
                  as Medusa-2; on greedy self-distilled data its argmax is x_{t+s}), or
  "token":        x_{t+s} itself (Medusa-1's hard labels),
and head k's cross-entropy is weighted decay**k (later heads are less accurate and matter less: a
node is only reached when every node above it was accepted).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class MedusaObjectiveConfig:
    decay: float = 0.8            # head k's loss is weighted decay**k
    labels: str = "distribution"  # "distribution" (the target's softmax) | "token" (the sequence's next tokens)
    noise: str = "none"           # noise on the input features while training: "uniform" | "gaussian" | "none"
    noise_scale: float = 0.1      # uniform: U(-scale, scale); gaussian: N(0, scale^2) (see objective.add_noise)

    def __post_init__(self) -> None:
        if not 0 < self.decay <= 1:
            raise ValueError(f"draft.objective.decay must be in (0, 1], got {self.decay}")
        if self.labels not in ("distribution", "token"):
            raise ValueError(f"draft.objective.labels must be 'distribution' or 'token', got {self.labels!r}")
        if self.noise not in ("uniform", "gaussian", "none"):
            raise ValueError(f"draft.objective.noise must be 'uniform', 'gaussian' or 'none', got {self.noise!r}")


def head_rows(batch: dict, k: int) -> torch.Tensor:
    """[B, T] bool: positions t whose head-k label x_{t+k+2} lies in t's sequence and is loss-masked."""
    seg, mask = batch["segment"], batch["loss_mask"]
    s, width = k + 2, seg.shape[1]
    rows = torch.zeros_like(mask, dtype=torch.bool)
    if s < width:
        rows[:, :width - s] = mask[:, s:] & (seg[:, s:] == seg[:, :-s]) & (seg[:, :-s] > 0)
    return rows


def head_inputs(feats: torch.Tensor, batch: dict, k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Head k's rows: (its features [N, H], the target's features f_{t+s-1} that score x_{t+s} [N, H],
    the tokens x_{t+s} [N]), for the N positions of `head_rows` (all with t + s < T)."""
    s = k + 2
    end = max(feats.shape[2] - s, 0)                                       # rows shorter than s have no label
    rows = head_rows(batch, k)[:, :end]                                    # B T-s
    return (feats[k][:, :end][rows],                                       # N H
            batch["hidden"][:, s - 1:s - 1 + end][rows].float(),          # N H
            batch["input_ids"][:, s:s + end][rows])                        # N


def medusa_objective(feats: torch.Tensor, batch: dict, lm_weight: torch.Tensor, cfg: MedusaObjectiveConfig) -> dict:
    """feats: [K, B, T, H] the heads' features; lm_weight: [V, H] the target's lm_head.

    Returns {"loss": decay-weighted sum of the heads' cross-entropies, "top1": how often head 0's argmax
    is the target's (no gradient)}.
    """
    total = feats.new_zeros(())
    top1 = feats.new_zeros(())
    for k in range(feats.shape[0]):
        pred, target_h, tokens = head_inputs(feats, batch, k)
        if pred.shape[0] == 0:
            total = total + feats[k].sum() * 0.0  # keeps the graph: every parameter gets a (zero) gradient
            continue
        q_logp = torch.log_softmax((pred @ lm_weight.T).float(), dim=-1)  # N V
        with torch.no_grad():
            target_logits = target_h @ lm_weight.T                        # N V
        if cfg.labels == "distribution":
            ce = -(torch.softmax(target_logits.float(), dim=-1) * q_logp).sum(-1).mean()
        else:
            ce = F.nll_loss(q_logp, tokens)
        total = total + cfg.decay ** k * ce
        if k == 0:
            top1 = (q_logp.detach().argmax(-1) == target_logits.argmax(-1)).float().mean()
    return {"loss": total, "top1": top1}


@torch.no_grad()
def medusa_agreement(feats: torch.Tensor, batch: dict, lm_weight: torch.Tensor) -> dict:
    """Agreement of the heads with the target's argmax, as sums and counts (epochs average exactly).

    top1 / top3: head 0's top-1 / top-3 holds the target's argmax. hits_k / rows_k: the same top-1 for
    head k. accept: for each root (a position with a head-0 label), the length a greedy Medusa chain
    [0, 0, ...] would get: 1 (the bonus token) + the leading heads whose top-1 is the target's argmax.
    All heads read the same f_t, so head k's guess at t is checked against the target at t + k + 1; on
    greedy self-distilled data the sequence is the target's argmax, so while the chain is accepted that
    is the target's verdict at inference.
    """
    num_heads = feats.shape[0]
    out: dict = {"top1": 0.0, "top3": 0.0, "tokens": 0.0, "accept": 0.0, "roots": 0.0}
    run = head_rows(batch, 0)
    length = run.float()                                                   # B T: the bonus token of every root
    for k in range(num_heads):
        end = max(feats.shape[2] - (k + 2), 0)
        rows = head_rows(batch, k)
        hit = torch.zeros_like(rows)
        pred, target_h, _ = head_inputs(feats, batch, k)
        out[f"rows{k}"], out[f"hits{k}"] = float(pred.shape[0]), 0.0
        if pred.shape[0]:
            top = (pred @ lm_weight.T).topk(min(3, lm_weight.shape[0]), dim=-1).indices  # N 3
            target_top = (target_h @ lm_weight.T).argmax(-1)                          # N
            hit[:, :end][rows[:, :end]] = top[:, 0] == target_top
            out[f"hits{k}"] = float(hit.sum())
            if k == 0:
                out["top1"] = float((top[:, 0] == target_top).sum())
                out["top3"] = float((top == target_top[:, None]).any(-1).sum())
                out["tokens"] = float(pred.shape[0])
        run = run & hit
        length = length + run.float()
    roots = head_rows(batch, 0)
    out["roots"] = float(roots.sum())
    out["accept"] = float(length[roots].sum())
    return out
