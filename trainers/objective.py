"""What the draft head is trained to do: the EAGLE loss, training-time test, and the metrics.

Alignment (exactly what `eagle_lite.drafters.eagle` does at inference): the target read x_0..x_{T-1}
and gave features f_0..f_{T-1}. The head's input at position t is the pair (f_t, embed(x_{t+1})) with
position id t; it predicts f_{t+1}, and the target's lm_head on that prediction gives the draft's
distribution over x_{t+2}. The loss at t counts when x_{t+2} is a target-written (loss-masked) token:

  loss_reg = SmoothL1(f^_{t+1}, f_{t+1}), averaged over H
  loss_cls = cross-entropy of softmax(W f^_{t+1}) against the target's softmax(W f_{t+1})
             (lk_weight > 0: mixed with the LK loss -log sum_x min(p(x), q(x)), minus the log of the chance that
             speculative sampling accepts the draft's token: (1 - lk_weight) * CE + lk_weight * LK)
  loss     = w_reg * loss_reg + w_cls * loss_cls

W is the target's frozen lm_head, or its rows `d2t` with a reduced draft vocabulary (then the target's
distribution is the one restricted to, and renormalised over, the draft vocabulary).

Training-time test (EAGLE-3): step k >= 1 re-runs the head at every position t on its *own* step-(k-1)
prediction made at t-1 (instead of the real f_t), attending to the real pairs up to the chain's root
t-k and to the chain's own drafted nodes at t-k+1..t - exactly what a chain drafted k steps ahead sees
at inference. The keys of all steps go into one concatenating cache; per-step losses are summed with
weights ttt_decay**k.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class ObjectiveConfig:
    w_reg: float = 1.0           # weight of the feature regression (EAGLE: 1.0)
    w_cls: float = 0.1           # weight of the token cross-entropy (EAGLE: 0.1)
    ttt_steps: int = 1           # 1: plain EAGLE; k > 1: unroll k draft steps on the head's own features
    ttt_decay: float = 0.8       # step k's losses are weighted ttt_decay**k
    noise: str = "uniform"       # noise on the input features while training: "uniform" | "gaussian" | "none"
    noise_scale: float = 0.1     # uniform: U(-scale, scale); gaussian: N(0, scale^2)
    val_depth: int = 5           # chain length unrolled by validation for val/accept_len_est
    copy_weight: float = 1.0     # loss weight of tokens a 3-gram prompt lookup would propose (1: plain EAGLE)
    labels: str = "distribution"  # the token loss's labels: the target's distribution (KL distillation) | its
                                  # greedy "token" (hard labels)
    label_top_k: int = 0         # > 0: the target's distribution cut to its top-k tokens and renormalised (HASS)
    lk_weight: float = 0.0       # the token loss's share of the LK loss, -log(acceptance rate) (Samarin et al. 2026)

    def __post_init__(self) -> None:
        if self.ttt_steps < 1:
            raise ValueError("draft.objective.ttt_steps must be >= 1 (1 = no training-time test), "
                             f"got {self.ttt_steps}")
        if self.val_depth < 1:
            raise ValueError(f"draft.objective.val_depth must be >= 1, got {self.val_depth}")
        if self.noise not in ("uniform", "gaussian", "none"):
            raise ValueError(f"draft.objective.noise must be 'uniform', 'gaussian' or 'none', got {self.noise!r}")
        if self.labels not in ("distribution", "token"):
            raise ValueError(f"draft.objective.labels must be 'distribution' or 'token', got {self.labels!r}")
        if self.label_top_k < 0:
            raise ValueError(f"draft.objective.label_top_k must be >= 0, got {self.label_top_k}")
        if self.copy_weight < 0:
            raise ValueError(f"draft.objective.copy_weight must be >= 0, got {self.copy_weight}")
        if not 0.0 <= self.lk_weight <= 1.0:
            raise ValueError(f"draft.objective.lk_weight must be within [0, 1], got {self.lk_weight}")


class ConcatKV:
    """A cache that keeps every key/value it is given, in order (transformers' `Cache.update` protocol).

    Training-time test step k writes its T' keys after those of steps 0..k-1, so its mask is over
    (k+1) * T' key slots: block j holds step j's keys. Gradients flow through (nothing is detached).
    """

    def __init__(self) -> None:
        self.keys: torch.Tensor | None = None
        self.values: torch.Tensor | None = None

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        if self.keys is None:
            self.keys, self.values = key_states, value_states
        else:
            self.keys = torch.cat([self.keys, key_states], dim=2)        # B H_kv S+T' D
            self.values = torch.cat([self.values, value_states], dim=2)
        return self.keys, self.values

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return 0 if self.keys is None else self.keys.shape[2]


def collate(items: list[dict[str, torch.Tensor]], max_len: int, pack: bool, device=None) -> dict[str, torch.Tensor]:
    """Pack (first fit, longest first) or pad sequences into rows; see the module doc for the layout. device: where
    the batch is made (None: the CPU)."""
    rows: list[list[dict]] = []
    if pack:
        space: list[int] = []
        for item in sorted(items, key=lambda it: -len(it["input_ids"])):
            n = len(item["input_ids"])
            fit = next((r for r, free in enumerate(space) if free >= n), None)
            if fit is None:
                rows.append([item])
                space.append(max_len - n)
            else:
                rows[fit].append(item)
                space[fit] -= n
    else:
        rows = [[item] for item in items]
    width = max(sum(len(it["input_ids"]) for it in row) for row in rows)
    hidden_size = items[0]["hidden"].shape[-1]
    b = len(rows)
    batch = {
        "input_ids": torch.zeros(b, width, dtype=torch.long, device=device),
        "hidden": torch.zeros(b, width, hidden_size, dtype=items[0]["hidden"].dtype, device=device),
        "loss_mask": torch.zeros(b, width, dtype=torch.bool, device=device),
        "segment": torch.zeros(b, width, dtype=torch.long, device=device),
        "position_ids": torch.zeros(b, width, dtype=torch.long, device=device),
    }
    if "taps" in items[0]:
        batch["taps"] = torch.zeros(b, width, items[0]["taps"].shape[-1], dtype=items[0]["taps"].dtype, device=device)
    if "group" in items[0]:
        batch["group"] = torch.full((b, width), -1, dtype=torch.long, device=device)
    for r, row in enumerate(rows):
        start = 0
        for s, item in enumerate(row, start=1):
            n = len(item["input_ids"])
            span = slice(start, start + n)
            batch["input_ids"][r, span] = item["input_ids"]
            batch["hidden"][r, span] = item["hidden"]
            if "taps" in batch:
                batch["taps"][r, span] = item["taps"]
            if "group" in batch:
                batch["group"][r, span] = int(item["group"])
            batch["loss_mask"][r, span] = item["loss_mask"]
            batch["segment"][r, span] = s
            batch["position_ids"][r, span] = torch.arange(n, device=device)
            start += n
    return batch


@dataclass
class Pairs:
    """The head's inputs and targets for a batch, T' = T - 1 pairs per row."""

    hidden: torch.Tensor      # [B, T', H] f_t (float); EAGLE-3 heads: the target's tapped layers [B, T', K*H]
    embeds: torch.Tensor      # [B, T', H] embed(x_{t+1})
    positions: torch.Tensor   # [B, T'] position id of pair t
    segment: torch.Tensor     # [B, T'] segment of the pair (0: not a pair: padding or a segment border)
    target: torch.Tensor      # [B, T', H] f_{t+1}
    weight: torch.Tensor      # [B, T'] bool: x_{t+2} exists in the same segment and is loss-masked


def make_pairs(batch: dict, embed_weight: torch.Tensor, taps: bool = False) -> Pairs:
    """batch: input_ids [B, T], hidden [B, T, H], loss_mask [B, T], segment [B, T], position_ids [B, T]; and
    taps [B, T, K*H] where the caches hold several layers' outputs. taps=True: those are the head's input at step
    0 (EAGLE-3 heads; `hidden` stays the target); False: the last hidden state is."""
    ids, hidden, seg = batch["input_ids"], batch["hidden"], batch["segment"]
    if taps and "taps" not in batch:
        raise ValueError("this head reads the target's tapped layers, but the feature cache holds only its last "
                         "hidden states: cache them with the head's draft.feature_layers")
    inputs = batch["taps"] if taps else hidden
    pair_seg = torch.where(seg[:, 1:] == seg[:, :-1], seg[:, :-1], torch.zeros_like(seg[:, :-1]))  # B T'
    weight = torch.zeros_like(pair_seg, dtype=torch.bool)                                          # B T'
    weight[:, :-1] = batch["loss_mask"][:, 2:] & (seg[:, 2:] == pair_seg[:, :-1]) & (pair_seg[:, :-1] > 0)
    return Pairs(
        hidden=inputs[:, :-1].float(),
        embeds=F.embedding(ids[:, 1:], embed_weight).float(),
        positions=batch["position_ids"][:, :-1],
        segment=pair_seg,
        target=hidden[:, 1:].float(),
        weight=weight,
    )


def novel_pairs(batch: dict) -> torch.Tensor:
    """[B, T'] bool: pair t predicts x_{t+2}; True where no 3-gram lookup proposes that token."""
    copy = lookup_predictable(batch["input_ids"], batch["segment"])
    novel = torch.zeros_like(copy[:, 1:])
    novel[:, :-1] = ~copy[:, 2:]
    return novel


def chain_mask(segment: torch.Tensor, step: int) -> torch.Tensor:
    """[B, 1, T', (step+1) T'] bool: what the step-`step` node at each position may attend to.

    Block 0 (real pairs): s <= t - step in the same segment. Block j = 1..step (drafted nodes of the
    chain rooted at t - step): only s == t - step + j. Every query sees itself, so padding rows are
    never empty (an all-False row makes SDPA return NaN).
    """
    b, n = segment.shape
    idx = torch.arange(n, device=segment.device)
    same = (segment[:, :, None] == segment[:, None, :]) & (segment[:, :, None] > 0)  # B T' T'
    blocks = [same & (idx[None, :] <= idx[:, None] - step)]
    for j in range(1, step + 1):
        blocks.append(same & (idx[None, :] == idx[:, None] - step + j))
    mask = torch.cat(blocks, dim=-1)                                                # B T' (step+1)T'
    mask[:, idx, step * n + idx] = True
    return mask[:, None]


def step_weight(pairs: Pairs, step: int) -> torch.Tensor:
    """[B, T'] bool: positions whose step-`step` prediction has a real chain root t - step in its segment."""
    if step == 0:
        return pairs.weight
    w = torch.zeros_like(pairs.weight)
    w[:, step:] = pairs.weight[:, step:] & (pairs.segment[:, :-step] == pairs.segment[:, step:])
    return w


def add_noise(hidden: torch.Tensor, cfg: ObjectiveConfig) -> torch.Tensor:
    if cfg.noise == "uniform":
        return hidden + (torch.rand_like(hidden) * 2 - 1) * cfg.noise_scale
    if cfg.noise == "gaussian":
        return hidden + torch.randn_like(hidden) * cfg.noise_scale
    return hidden


def unroll(head, pairs: Pairs, steps: int, inputs: torch.Tensor | None = None) -> list[torch.Tensor]:
    """Run `steps` draft steps; returns each step's predicted features [B, T', H] (see module doc).

    A parallel head (`DraftHead.parallel`): step k >= 1 reads the mask rows' learned inputs instead of a prediction
    and a token, so that step k at t is the k-th mask row of the one forward drafted from the root t - k: it sees
    the real pairs up to t - k and the mask rows t-k+1..t, as at inference."""
    cache = ConcatKV()
    hidden = pairs.hidden if inputs is None else inputs
    embeds = pairs.embeds
    preds: list[torch.Tensor] = []
    for k in range(steps):
        if k > 0 and getattr(head, "parallel", 0):
            b, n = pairs.segment.shape
            masks = head.mask_rows(b * n, pairs.embeds.dtype)
            hidden, embeds = (m.reshape(b, n, -1) for m in masks)
        elif k > 0:
            # step k at t reads step k-1's prediction made at t-1; t = 0 has none (its weight is 0)
            hidden = F.pad(preds[-1][:, :-1], (0, 0, 1, 0))  # B T' H
        preds.append(head(hidden, embeds, pairs.positions, chain_mask(pairs.segment, k), cache=cache))
    return preds


def token_loss(q_logp: torch.Tensor, p: torch.Tensor, lk_weight: float = 0.0) -> torch.Tensor:
    """[N] the draft's token loss per row: cross-entropy of its log-distribution q_logp against the target's p
    ([N, V] each), mixed with lk_weight of the LK loss -log(sum_x min(p(x), q(x))): the sum is the chance that
    speculative sampling accepts the draft's token, which that loss raises directly."""
    ce = -(p * q_logp).sum(-1)
    if lk_weight == 0.0:
        return ce
    accept = torch.minimum(p, q_logp.exp()).sum(-1)
    return (1.0 - lk_weight) * ce - lk_weight * torch.log(accept.clamp_min(1e-6))


def step_losses(pred: torch.Tensor, pairs: Pairs, weight: torch.Tensor, lm_weight: torch.Tensor,
                p_target: torch.Tensor, rows: torch.Tensor, scale: torch.Tensor | None = None,
                per_rank: Callable[[torch.Tensor], torch.Tensor] | None = None, lk_weight: float = 0.0
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Mean (reg, cls, top1) over the rows `weight` marks. p_target: [N0, V_draft] target distribution on
    the rows of `pairs.weight`; rows: [N0] bool, which of those rows `weight` keeps; scale: [B, T'] per-pair
    loss weights (None: all 1), the losses then being weighted means. top1 (no gradient, unweighted):
    how often the draft's argmax is the target's, both within the draft vocabulary. per_rank: over several
    ranks, the mean over the ranks of this rank's count of weighted rows; the losses are then sums over that, so
    that the ranks' gradients, averaged by DDP, are those of the mean over every rank's rows. lk_weight: see
    `token_loss`."""
    count = (weight.sum() if scale is None else scale[weight].sum()).float()
    if per_rank is not None:
        count = per_rank(count.detach())   # every rank, whether or not it has rows: it is a collective
    if not bool(weight.any()):
        zero = pred.sum() * 0.0  # keeps the graph: every parameter still gets a (zero) gradient
        return zero, zero, zero.detach()
    p, f = pred[weight], pairs.target[weight]                               # N H
    reg = F.smooth_l1_loss(p, f, reduction="none").mean(-1)                  # N
    q_logp = torch.log_softmax((p @ lm_weight.T).float(), dim=-1)           # N V_draft
    p_rows = p_target[rows]                                                  # N V_draft
    cls = token_loss(q_logp, p_rows, lk_weight)                              # N
    top1 = (q_logp.detach().argmax(-1) == p_rows.argmax(-1)).float().mean()
    if per_rank is not None:
        s = 1.0 if scale is None else scale[weight].to(reg.dtype)
        total = count.clamp_min(1e-8)
        return (reg * s).sum() / total, (cls * s).sum() / total, top1
    if scale is None:
        return reg.mean(), cls.mean(), top1
    s = scale[weight].to(reg.dtype)
    total = s.sum().clamp_min(1e-8)
    return (reg * s).sum() / total, (cls * s).sum() / total, top1


def target_distribution(pairs: Pairs, lm_weight: torch.Tensor, labels: str = "distribution",
                        top_k: int = 0) -> torch.Tensor:
    """[N0, V_draft] softmax of the target's own logits (restricted to the draft vocabulary) on weighted rows;
    labels="token": one-hot on its argmax instead; top_k > 0: only its top_k tokens, renormalised."""
    with torch.no_grad():
        logits = (pairs.target[pairs.weight] @ lm_weight.T).float()
        if labels == "token":
            return F.one_hot(logits.argmax(-1), logits.shape[-1]).float()
        if 0 < top_k < logits.shape[-1]:
            kept = logits.topk(top_k, dim=-1)
            logits = torch.full_like(logits, float("-inf")).scatter(-1, kept.indices, kept.values)
        return torch.softmax(logits, dim=-1)


def objective(preds: list[torch.Tensor], pairs: Pairs, lm_weight: torch.Tensor, cfg: ObjectiveConfig,
              novel: torch.Tensor | None = None, q_weight: torch.Tensor | None = None,
              per_rank: Callable[[torch.Tensor], torch.Tensor] | None = None) -> dict:
    """The loss over the first cfg.ttt_steps predictions: {"loss", "loss_reg", "loss_cls"} (decay-weighted
    sums over steps) and "top1" (step 0, within the draft vocabulary, no gradient). With cfg.copy_weight != 1,
    `novel` ([B, T'] bool, `novel_pairs`) is required: the other (lookup-copyable) pairs weigh copy_weight.
    lm_weight [V_draft, H] gives the target's distribution; q_weight [V_draft, H] scores the predictions (an
    EAGLE-3 head's own lm_head, the predictions then being its normed outputs); None: lm_weight. per_rank: see
    `step_losses` (training over several ranks)."""
    scale = None
    if cfg.copy_weight != 1.0:
        if novel is None:
            raise ValueError("draft.objective.copy_weight needs the novel-token mask (novel_pairs(batch))")
        scale = torch.where(novel, 1.0, cfg.copy_weight).to(preds[0].device)
    p_target = target_distribution(pairs, lm_weight, cfg.labels, cfg.label_top_k)
    total_reg = total_cls = preds[0].new_zeros(())
    top1 = None
    for k, pred in enumerate(preds[:cfg.ttt_steps]):
        w = step_weight(pairs, k)
        reg, cls, hits = step_losses(pred, pairs, w, lm_weight if q_weight is None else q_weight, p_target,
                                     w[pairs.weight], scale, per_rank, cfg.lk_weight)
        total_reg = total_reg + cfg.ttt_decay ** k * reg
        total_cls = total_cls + cfg.ttt_decay ** k * cls
        top1 = hits if top1 is None else top1
    return {"loss": cfg.w_reg * total_reg + cfg.w_cls * total_cls, "loss_reg": total_reg, "loss_cls": total_cls,
            "top1": top1}


def scored(head, preds: list[torch.Tensor], draft_weight: torch.Tensor) -> tuple[list[torch.Tensor], torch.Tensor]:
    """(what the output projection reads of each step's prediction, the rows it scores with): an EAGLE-3 head's own
    norm and lm_head (trained with it), else the predictions and the target's rows `draft_weight` ([V_draft, H])."""
    if head.lm_head is None:
        return preds, draft_weight
    return [head.logit_features(p) for p in preds], head.lm_head.weight


def head_loss(head, batch: dict, embed_weight: torch.Tensor, draft_weight: torch.Tensor, cfg: ObjectiveConfig,
              per_rank: Callable[[torch.Tensor], torch.Tensor] | None = None) -> dict:
    """The training loss of `head` on a batch (`collate`'s layout): noised inputs, cfg.ttt_steps unrolled, then
    `objective`. embed_weight: the target's token embeddings; draft_weight: its lm_head rows over the draft
    vocabulary. What training (trainers/module.py) and online adaptation (eagle_lite_wing/learner.py) both minimise."""
    pairs = make_pairs(batch, embed_weight, taps=bool(head.feature_layers))
    preds = unroll(head, pairs, cfg.ttt_steps, inputs=add_noise(pairs.hidden, cfg))
    novel = novel_pairs(batch) if cfg.copy_weight != 1.0 else None
    features, weight = scored(head, preds, draft_weight)
    return objective(features, pairs, draft_weight, cfg, novel, q_weight=weight, per_rank=per_rank)


def lookup_predictable(ids: torch.Tensor, segment: torch.Tensor, n: int = 3) -> torch.Tensor:
    """[B, T] bool: token i is what an n-gram prompt lookup would propose there, i.e. the n tokens before it
    occurred earlier in the same segment and were then (at their latest occurrence) followed by ids[i].

    Greedy answers of a small target repeat themselves and copy their prompt; a draft head scores well on
    such tokens by copying, so validation reports its top-1 on the other ("novel") tokens apart."""
    out = torch.zeros(ids.shape, dtype=torch.bool)
    for b, (row, seg) in enumerate(zip(ids.tolist(), segment.tolist())):
        seen: dict[tuple, int] = {}
        start = 0
        for i in range(len(row)):
            if i and seg[i] != seg[i - 1]:
                seen, start = {}, i   # a new packed segment: lookups never cross its border
            if seg[i] == 0 or i - start < n:
                continue
            key = tuple(row[i - n:i])
            out[b, i] = seen.get(key) == row[i]
            seen[key] = row[i]
    return out.to(ids.device)


@torch.no_grad()
def agreement(preds: list[torch.Tensor], pairs: Pairs, full_weight: torch.Tensor, draft_weight: torch.Tensor,
              d2t: torch.Tensor | None, novel: torch.Tensor | None = None, groups: torch.Tensor | None = None,
              num_groups: int = 0) -> dict:
    """Token agreement of draft and target, as sums and counts (so epochs can be averaged exactly).

    top1 / top3: the target's argmax over the full vocabulary is the draft's top-1 / among its top-3
    (step 0, i.e. drafting from real features). accept: for each root r (a weighted step-0 position),
    the chain length a greedy chain drafter would get: 1 (the bonus token) + the number of leading steps
    k = 0, 1, ... whose top-1 at position r + k equals the target's argmax. Step k reads the head's own
    step-(k-1) features and the sequence's tokens; on greedy self-distilled data those tokens are the
    target's argmax, i.e. exactly the drafted tokens whenever the chain is still accepted, so the
    estimate is the chain's true mean accepted length (bounded by len(preds) + 1). A chain also stops
    where the sequence leaves the loss mask. Tree drafting accepts at least as much.

    novel: [B, T'] bool, the pairs whose predicted token no n-gram lookup proposes (see `lookup_predictable`);
    given, "top1_novel" / "novel" count the step-0 top-1 hits on those rows and the rows.

    groups: [B, T'] long, each pair's validation group (0 .. num_groups - 1; -1: none); given, "group_top1",
    "group_tokens" and "group_accept" are [num_groups] tensors of the same sums per group (tokens = roots).
    """
    rows = pairs.weight
    n = int(rows.sum())
    out = {"top1": 0.0, "top3": 0.0, "tokens": n, "accept": 0.0, "roots": n}
    if novel is not None:
        out.update(top1_novel=0.0, novel=float((rows & novel).sum()))
    if groups is not None:
        zeros = torch.zeros(num_groups, dtype=torch.float32, device=rows.device)
        out.update(group_top1=zeros, group_tokens=zeros.clone(), group_accept=zeros.clone())
    if n == 0:
        return out
    target_top = (pairs.target[rows] @ full_weight.T).argmax(-1)   # N0 target ids
    hits = []
    for k, pred in enumerate(preds):
        logits = pred[rows] @ draft_weight.T                        # N0 V_draft
        top = logits.topk(min(3, logits.shape[-1]), dim=-1).indices
        top = top if d2t is None else d2t[top]                      # N0 3 target ids
        if k == 0:
            out["top1"] = float((top[:, 0] == target_top).sum())
            out["top3"] = float((top == target_top[:, None]).any(-1).sum())
            if novel is not None:
                out["top1_novel"] = float(((top[:, 0] == target_top) & novel[rows]).sum())
        hit = torch.zeros_like(rows)
        hit[rows] = top[:, 0] == target_top
        hits.append(hit & step_weight(pairs, k))                    # B T'
    run = torch.ones_like(rows)
    length = rows.float()                                            # the bonus token of every root
    for k, hit in enumerate(hits):
        shifted = torch.zeros_like(hit)                              # shifted[r] = hit[r + k]
        shifted[:, :hit.shape[1] - k] = hit[:, k:]
        run = run & shifted
        length = length + (run & rows).float()
    out["accept"] = float(length[rows].sum())
    out["lengths"] = length[rows]                                    # [roots] each root's chain length
    if groups is not None:
        g = groups[rows]
        keep = g >= 0
        for key, values in (("group_top1", hits[0][rows].float()), ("group_tokens", torch.ones_like(length[rows])),
                            ("group_accept", length[rows])):
            out[key] = torch.bincount(g[keep], weights=values[keep], minlength=num_groups).float()
    return out


@torch.no_grad()
def chain_lengths(head, batch: dict, embed_weight: torch.Tensor, full_weight: torch.Tensor,
                  draft_weight: torch.Tensor, depth: int) -> torch.Tensor:
    """[roots] the chain length (bonus included) a greedy chain of `depth` head tokens gets at each of a batch's
    loss-masked positions, in order (`agreement`'s "accept"): how much `head` would accept per step on that text."""
    pairs = make_pairs(batch, embed_weight, taps=bool(head.feature_layers))
    preds = unroll(head, pairs, depth)
    features, weight = scored(head, preds, draft_weight)
    return agreement(features, pairs, full_weight, weight, head.d2t)["lengths"]
