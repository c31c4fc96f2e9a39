"""Lossless acceptance: walk the draft tree with the target's logits, return the accepted path + bonus.

Greedy: follow the child whose token is the target's argmax; the first node without such a child
yields the bonus token (the target's argmax there). The output is the target's greedy output exactly.

Sampling: at each node the target's next token must be distributed exactly as p_target (after
temperature / top-k / top-p). Two cases, both exact:
- children chosen deterministically (EAGLE's top-k tree, `tree.q_draft is None`): draw x ~ p_target;
  if a child carries x, descend into it, otherwise x is the bonus token. This is recursive rejection
  sampling with point-mass proposals, and it accepts with the largest probability any deterministic
  draft can: the target mass on the children.
- children sampled from q_draft (a draft model; siblings drawn without replacement, each child's row
  of q_draft being the distribution it was drawn from): sibling-wise recursive rejection sampling:
  accept child c with probability min(1, p(c) / q_c(c)), else p <- norm(max(p - q_c, 0)) and try the
  next sibling; if all are rejected, the bonus token is drawn from the final residual.
"""
from __future__ import annotations

import torch

from ..config import SamplingConfig
from ..tree import DraftTree


def target_probs(logits: torch.Tensor, sampling: SamplingConfig) -> torch.Tensor:
    """logits [..., V] -> the target's sampling distribution [..., V] (float32)."""
    logits = logits.float() / sampling.temperature
    if sampling.top_k > 0 and sampling.top_k < logits.shape[-1]:
        kth = torch.topk(logits, sampling.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if sampling.top_p < 1.0:
        probs = _top_p(probs, sampling.top_p)
    return probs


def _top_p(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """Keep the smallest set of likeliest tokens whose mass reaches top_p (the first token always stays),
    renormalized. Sorting all 49k tokens is costly on a CPU; the cut usually falls among a few hundred likely ones,
    so for one distribution [V] only the tokens above a small probability are sorted, where their mass
    reaches top_p (every other token is less likely than each of them, so it is dropped either way)."""
    if probs.dim() == 1:
        for floor in (1e-4, 1e-6):
            candidates = torch.nonzero(probs > floor).squeeze(1)                   # C
            sorted_p, order = torch.sort(probs[candidates], descending=True)
            cum = sorted_p.cumsum(0)
            if candidates.numel() and bool(cum[-1] >= top_p):
                kept = candidates[order[(cum - sorted_p) < top_p]]
                out = torch.zeros_like(probs)
                out[kept] = probs[kept]
                return out / out.sum()
    return _top_p_sorted(probs, top_p)


def _top_p_sorted(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    sorted_p, idx = torch.sort(probs, dim=-1, descending=True)
    drop_sorted = (sorted_p.cumsum(-1) - sorted_p) >= top_p
    probs = probs.masked_fill(torch.zeros_like(drop_sorted).scatter(-1, idx, drop_sorted), 0.0)
    return probs / probs.sum(-1, keepdim=True)


def sample(probs: torch.Tensor, generator: torch.Generator | None = None) -> int:
    """One token drawn from `probs` [V] (non-negative, summing to ~1): the inverse of its CDF at one uniform
    draw, the distribution `torch.multinomial(probs, 1)` draws from at a fraction of its cost (over 49k tokens
    on a CPU, multinomial takes longer than the rest of a sampled step's acceptance)."""
    cdf = probs.double().cumsum(0)                           # V, float64: no token's share is lost to rounding
    u = torch.rand((), generator=generator, dtype=torch.float64, device=probs.device) * cdf[-1]
    token = int(torch.searchsorted(cdf, u, right=True))      # the first token whose CDF exceeds u: p > 0
    if token >= cdf.numel():                                 # u rounded up onto the total: the last possible token
        token = int(torch.nonzero(probs).max())
    return token


def sample_rows(probs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """`sample` of each row of `probs` [R, V] at its own uniform draw in [0, 1) (`uniforms` [R]), in tensor ops (no
    read from the device: the fixed-shape step's, static/step.py) -> [R] long."""
    cdf = probs.double().cumsum(-1)                                          # R V
    token = torch.searchsorted(cdf, (uniforms.double() * cdf[:, -1])[:, None], right=True)[:, 0]
    cols = torch.arange(probs.shape[-1], device=probs.device)
    last = torch.where(probs > 0, cols, 0).amax(-1)     # where u is rounded onto the total: the last possible token
    return torch.minimum(token, last)


def accept_greedy(tree: DraftTree, logits) -> tuple[list[int], int]:
    """logits: node i's logits at `logits[i]` (an [N, V] tensor, or `target.NodeLogits`, which finds the
    argmax of only the nodes the walk reads). Returns (accepted node indices from the root, bonus token)."""
    tokens = tree.tokens.tolist()
    top_token = getattr(logits, "top_token", None) or (lambda node: int(logits[node].argmax()))
    path, node = [0], 0
    while True:
        choice = top_token(node)
        nxt = next((c for c in tree.children[node] if tokens[c] == choice), None)
        if nxt is None:
            return path, choice
        path.append(nxt)
        node = nxt


def accept_sampling(tree: DraftTree, logits, sampling: SamplingConfig,
                    generator: torch.Generator | None = None) -> tuple[list[int], int]:
    """Like accept_greedy, but the accepted tokens and bonus are distributed exactly as the target's samples."""
    tokens = tree.tokens.tolist()
    path, node = [0], 0
    while True:
        p_target = target_probs(logits[node], sampling)  # V
        kids = tree.children[node]
        if tree.q_draft is None:
            x = sample(p_target, generator)
            nxt = next((c for c in kids if tokens[c] == x), None)
            if nxt is None:
                return path, x
        else:
            nxt = None
            for c in kids:
                q_draft = tree.q_draft[c].float().to(p_target.device)
                tok = tokens[c]
                ratio = p_target[tok] / q_draft[tok]
                if torch.rand((), generator=generator, device=p_target.device) < ratio:
                    nxt = c
                    break
                residual = (p_target - q_draft).clamp_min_(0.0)
                total = residual.sum()
                # p_target <= q_draft everywhere only if they are equal, and then c was accepted surely
                p_target = residual / total if total > 0 else p_target
            if nxt is None:
                return path, sample(p_target, generator)
        path.append(nxt)
        node = nxt


def accept(tree: DraftTree, logits, sampling: SamplingConfig,
           generator: torch.Generator | None = None) -> tuple[list[int], int]:
    if sampling.greedy:
        return accept_greedy(tree, logits)
    return accept_sampling(tree, logits, sampling, generator)
