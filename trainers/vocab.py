"""A reduced draft vocabulary: the target tokens the head may propose (EAGLE-3's `d2t`).

The draft scores only `size` rows of the target's lm_head — the tokens that are most frequent among the
tokens it learns to predict (the loss-masked, target-written tokens of the training split) — plus every
EOS/special token, so it can always end a turn. `d2t[i]` is the target id of draft token i (sorted).
"""
from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable

import torch

from eagle_lite.targets.model import Target

from .features import FeatureCache


def count_tokens(caches: list[FeatureCache], rows, vocab_size: int) -> torch.Tensor:
    """[V] counts of loss-masked token ids over the sequences `rows` (rows of `joint_index(caches)`)."""
    counts = torch.zeros(vocab_size, dtype=torch.long)
    by_file: dict[tuple[int, str], list[tuple[int, int]]] = defaultdict(list)
    for row in rows:
        by_file[row["cache"], row["file"]].append((row["start"], row["start"] + row["length"]))
    for (cache, file), ranges in by_file.items():
        ids, mask = caches[cache].token_ids(file)  # N, N
        keep = torch.zeros_like(mask)
        for a, b in ranges:
            keep[a:b] = mask[a:b]
        counts += torch.bincount(ids[keep], minlength=vocab_size)[:vocab_size]
    return counts


def special_ids(target: Target) -> set[int]:
    """EOS ids and the tokenizer's special tokens: always in the draft vocabulary."""
    ids = set(target.eos_token_ids)
    if target.tokenizer is not None:
        ids.update(getattr(target.tokenizer, "all_special_ids", []) or [])
    return {i for i in ids if 0 <= i < target.vocab_size}


def build_d2t(counts: torch.Tensor, size: int, always: Iterable[int] = ()) -> torch.Tensor:
    """LongTensor [size], sorted: the ids in `always` plus the most frequent others (ties: lower id)."""
    vocab = counts.numel()
    if not 0 < size <= vocab:
        raise ValueError(f"draft.vocab_size={size} must be in [1, {vocab}] (the target's vocabulary); "
                         f"use null for the full vocabulary")
    must = sorted(set(always))
    if len(must) > size:
        raise ValueError(f"draft.vocab_size={size} is smaller than the {len(must)} special tokens it must "
                         f"contain ({must[:10]}...); raise draft.vocab_size")
    order = torch.sort(counts, descending=True, stable=True).indices.tolist()  # stable: ties by lower id
    chosen = set(must)
    for token in order:
        if len(chosen) == size:
            break
        chosen.add(token)
    return torch.tensor(sorted(chosen), dtype=torch.long)


def with_draft_vocab(head, d2t: torch.Tensor, target_lm: torch.Tensor):
    """`head` (modified in place and returned) drafting over the vocabulary `d2t` instead of its own. An EAGLE-3
    head's own output rows carry over for the tokens both vocabularies hold and the new tokens' rows start as the
    target's lm_head rows, as a new EAGLE-3 head's all do (a trained head's rows stay close to them); a head that
    scores through the target's lm_head just reads other rows. Returns the head and how many of the new vocabulary's
    tokens its old one lacked."""
    old = head.d2t.tolist() if head.d2t is not None else list(range(target_lm.shape[0]))
    where = {token: i for i, token in enumerate(old)}
    new = d2t.tolist()
    kept = [(j, where[token]) for j, token in enumerate(new) if token in where]
    if head.lm_head is not None:
        weight = head.lm_head.weight
        with torch.no_grad():
            rows = target_lm.detach()[d2t.to(target_lm.device)].to(device=weight.device, dtype=weight.dtype).clone()
            if kept:
                into, out_of = zip(*kept)
                rows[list(into)] = weight.detach()[list(out_of)]
        head.lm_head = torch.nn.Linear(weight.shape[1], len(new), bias=False, device=weight.device, dtype=weight.dtype)
        with torch.no_grad():
            head.lm_head.weight.copy_(rows)
    head.d2t = d2t.to(device=head.d2t.device if head.d2t is not None else target_lm.device, dtype=torch.long)
    return head, len(new) - len(kept)

