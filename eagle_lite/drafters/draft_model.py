"""Classic speculative decoding (Leviathan et al. 2023; Chen et al. 2023): a smaller LM drafts a chain.

A draft model sharing the target's tokenizer proposes K tokens one at a time from its own KV cache;
the target verifies them in one forward. Greedy: the draft's argmax chain, accepted where it equals
the target's argmax. Sampling: each token is drawn from the draft's own sampling distribution
q_draft and returned with it, so acceptance applies min(1, p_target / q_draft) and resamples the
residual on rejection: the output is distributed exactly as the target's.

The draft cache follows the sequence by token comparison: each round it keeps the longest prefix it
already holds (committed tokens and whichever drafted tokens the target accepted) and reads the rest.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from ..config import TreeConfig, option
from ..decoding.accept import sample, target_probs
from ..decoding.drafter import Drafter, DraftInput
from ..kv_cache import StaticKVCache
from ..tree import DraftTree
from .prompt_lookup import AdaptiveLength

VOCAB_SAMPLE = 64  # token ids compared between the two tokenizers


def check_same_vocabulary(target, draft) -> None:
    """Raise ValueError unless `draft` tokenizes like `target`.

    With both tokenizers present they must map a spread sample of ids to the same strings and have
    the same length; the lm_heads may then differ in padding rows past the tokenizer (Qwen2.5-0.5B
    has 151936, Qwen2.5-7B 152064). Without tokenizers the lm_head sizes must be equal.
    """
    t_tok, d_tok = getattr(target, "tokenizer", None), getattr(draft, "tokenizer", None)
    names = f"draft model '{draft.name}' and target '{target.name}'"
    advice = "pick a draft model from the target's family (the same tokenizer)"
    if t_tok is None or d_tok is None:
        if draft.vocab_size != target.vocab_size:
            raise ValueError(f"{names} have different vocabularies ({draft.vocab_size} vs {target.vocab_size} "
                             f"tokens): {advice}")
        return
    if t_tok is d_tok:
        return
    if len(d_tok) != len(t_tok):
        raise ValueError(f"{names} have different tokenizers ({len(d_tok)} vs {len(t_tok)} tokens): {advice}")
    if len(t_tok) > min(draft.vocab_size, target.vocab_size):
        raise ValueError(f"{names}: the tokenizer has {len(t_tok)} tokens but the lm_heads have "
                         f"{draft.vocab_size} and {target.vocab_size} rows: {advice}")
    ids = sorted(set(torch.linspace(0, len(t_tok) - 1, VOCAB_SAMPLE).long().tolist()))
    for i, d_str, t_str in zip(ids, d_tok.convert_ids_to_tokens(ids), t_tok.convert_ids_to_tokens(ids)):
        if d_str != t_str:
            raise ValueError(f"{names} have different tokenizers: token id {i} is {d_str!r} for the draft "
                             f"but {t_str!r} for the target: {advice}")


class DraftModelDrafter(Drafter):
    """Drafts a chain of K tokens with `draft`, anything shaped like a Target (`new_cache`, `forward`).

    num_tokens: K at the start; with adaptive=True it grows after a fully accepted chain and shrinks
    after a rejection (see AdaptiveLength), up to max(num_tokens, 16).
    """

    name = "draft_model"

    def __init__(self, target, draft, num_tokens: int = 4, adaptive: bool = True) -> None:
        if num_tokens < 1:
            raise ValueError(f"num_tokens must be >= 1 (tokens drafted per step), got {num_tokens}")
        check_same_vocabulary(target, draft)
        self.target, self.draft = target, draft
        self.length = AdaptiveLength(num_tokens, high=max(num_tokens, 16) if adaptive else num_tokens)
        self.adaptive = adaptive
        self.cache: StaticKVCache | None = None
        self._fed: list[int] = []   # the tokens whose KV entries the draft cache holds, in order
        self._valid = 0             # how many of them are known to equal the current sequence

    def reset(self, max_len: int, keep: int = 0) -> int:
        need = max_len + self.length.high
        if self.cache is None:
            self.cache = self.draft.new_cache(need)
        elif self.cache.max_len < need:
            self.cache = self.cache.grown(need)
        # the first `keep` tokens equal the last call's committed ones; of ours, only the `_valid`
        # prefix was committed (later entries may be drafts the target rejected)
        self._valid = min(keep, self._valid, self.cache.length)
        self.cache.truncate(self._valid)
        del self._fed[self._valid:]
        self.length.proposed = 0
        return keep  # the draft cache is ours alone: the target may keep all it has

    def max_tree_nodes(self, tree: TreeConfig) -> int:
        return 1 + self.length.high

    def _read(self, tokens: list[int]) -> torch.Tensor:
        """Feed `tokens` after the cache's prefix and commit them. Returns the last one's logits [V_target]."""
        ids = torch.tensor(tokens, device=self.draft.device)
        logits, _ = self.draft.forward(ids, self.cache, logits_rows=slice(-1, None))  # 1 V_draft
        self.cache.commit(len(tokens))
        self._fed += tokens
        logits = logits[0].float()
        v_target = self.target.vocab_size
        if logits.numel() > v_target:    # padding rows past the shared tokenizer
            logits = logits[:v_target]
        elif logits.numel() < v_target:
            logits = torch.nn.functional.pad(logits, (0, v_target - logits.numel()), value=float("-inf"))
        return logits

    def _sync(self, tokens: list[int]) -> None:
        """Roll the draft cache back to the longest prefix of `tokens` it holds (never the root)."""
        n, limit = self._valid, min(len(self._fed), len(tokens) - 1)
        while n < limit and self._fed[n] == tokens[n]:
            n += 1
        self.cache.truncate(n)
        del self._fed[n:]

    def propose(self, inp: DraftInput, tree: TreeConfig) -> DraftTree:
        if self.cache is None:
            raise RuntimeError(f"{type(self).__name__}.reset(max_len) must be called before propose()")
        if self.adaptive:
            self.length.update(inp.hidden.shape[0] - 1)   # features arrive for the root + accepted tokens
        k, sampling = self.length.k, inp.sampling
        self._sync(inp.tokens)
        logits = self._read(inp.tokens[len(self._fed):])  # the new tokens, root last
        self._valid = len(inp.tokens)                      # all of them are the target's from now on
        dev = inp.hidden.device                            # the target's, where the generator lives
        drafted, rows = [], []
        for i in range(k):
            if sampling.greedy:
                tok = int(logits.argmax())
            else:
                q_draft = target_probs(logits, sampling).to(dev)  # V: the draft's own sampling distribution
                tok = sample(q_draft, inp.generator)
                rows.append(q_draft)
            drafted.append(tok)
            if i + 1 < k:                                  # the last token's successor is not needed
                logits = self._read([tok])
        self.length.proposed = k
        tokens = torch.tensor([inp.root] + drafted, device=dev)
        if sampling.greedy:
            return DraftTree.chain(tokens)
        q_rows = torch.stack(rows)                         # K V
        return DraftTree.chain(tokens, torch.cat([torch.zeros_like(q_rows[:1]), q_rows]))  # K+1 V, row 0 unused


@dataclass(frozen=True)
class DraftModelOptions:
    """model: a smaller LM sharing the target's tokenizer (any spec `load_target` takes), or `draft_target`
    already loaded. num_tokens: chain length to start with (adaptive: grows and shrinks with acceptance)."""

    model: str | None = option(None, "draft-model", "the smaller model (same tokenizer as the target), given like "
                               "--target", metavar="SPEC")
    draft_target: Any = None
    num_tokens: int = 4
    adaptive: bool = True


def build_draft_model(target, o: DraftModelOptions) -> DraftModelDrafter:
    draft = o.draft_target
    if draft is None:
        from ..targets.loading import load_target

        draft = load_target(o.model, dtype=target.dtype, device=str(target.device))
    return DraftModelDrafter(target, draft, o.num_tokens, o.adaptive)


def check_draft_model(o: DraftModelOptions) -> None:
    if o.model is None and o.draft_target is None:
        raise ValueError("method 'draft_model' needs --draft-model SPEC: a smaller model with the target's tokenizer")
    if o.draft_target is None:
        from ..targets.loading import target_source

        target_source(o.model, "draft model")        # a spec naming no file, folder or hub id
