"""The generation loop: prefill -> draft -> verify -> accept -> cache commit -> next.

One loop serves every method: plain decoding is speculative decoding whose drafter proposes the root
alone. The path of a token:
  1. prefill: the target reads the prompt; its last logits choose the first new token (the root).
  2. draft:   the drafter proposes a tree of continuations under the root (drafters/).
  3. verify:  the target reads the whole tree in one forward with the tree mask (target.py, tree.py).
  4. accept:  the longest path the target agrees with, plus one bonus token (accept.py); the lm_head
              projects only the nodes that walk reads (lm_head.NodeLogits; greedy: their certified argmax),
              and the tree's probes, whose outputs the drafter reads back (`observe`: lookahead's window).
  5. commit:  the accepted nodes' KV entries move next to the prefix (kv_cache.py); the bonus is the next root.
"""
from __future__ import annotations

import numbers
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch

from ..config import GenerationConfig
from ..kv_cache import ContextOverflowError, StaticKVCache
from ..targets.lm_head import NodeLogits
from ..targets.model import Target
from .accept import accept, sample, target_probs
from .drafter import Drafter, DraftInput, NoDrafter


@dataclass
class GenerationStats:
    prompt_tokens: int = 0
    reused_prompt_tokens: int = 0      # prompt tokens whose KV entries were kept from the previous call
    new_tokens: int = 0
    target_forwards: int = 0           # prefill included
    accept_lengths: list[int] = field(default_factory=list)  # tokens emitted per verify forward (bonus included)
    prefill_seconds: float = 0.0
    draft_seconds: float = 0.0
    verify_seconds: float = 0.0        # target forward over the tree (hidden states)
    accept_seconds: float = 0.0        # lm_head rows the acceptance walk reads, acceptance, cache commit
    seconds: float = 0.0               # wall time, prefill included
    stop_reason: str = ""              # "eos" | "length" | "context"; "interrupted" where a caller stopped it

    @property
    def tokens_per_s(self) -> float:
        return self.new_tokens / self.seconds if self.seconds > 0 else 0.0

    @property
    def accept_length_mean(self) -> float:
        return sum(self.accept_lengths) / len(self.accept_lengths) if self.accept_lengths else 0.0

    def as_dict(self) -> dict:
        return {
            "prompt_tokens": self.prompt_tokens, "new_tokens": self.new_tokens,
            "target_forwards": self.target_forwards, "accept_length_mean": round(self.accept_length_mean, 4),
            "seconds": round(self.seconds, 4), "tokens_per_s": round(self.tokens_per_s, 3),
            "prefill_seconds": round(self.prefill_seconds, 4), "draft_seconds": round(self.draft_seconds, 4),
            "verify_seconds": round(self.verify_seconds, 4), "accept_seconds": round(self.accept_seconds, 4),
            "stop_reason": self.stop_reason,
        }


@dataclass
class GenerationResult:
    token_ids: list[int]
    stats: GenerationStats


def token_budget(prompt_ids: list[int], target: Target, max_new_tokens: int) -> int:
    """How many new tokens `prompt_ids` may get: `max_new_tokens`, cut to the context window left. An empty prompt,
    one that fills the window, or one with an id that is not a token of the target's vocabulary is refused."""
    n_prompt = len(prompt_ids)
    if n_prompt == 0:
        raise ValueError("the prompt is empty: give at least one token")
    vocab = target.vocab_size
    bad = next((i for i, t in enumerate(prompt_ids)
                if isinstance(t, bool) or not isinstance(t, numbers.Integral) or not 0 <= t < vocab), None)
    if bad is not None:
        raise ValueError(f"prompt token {bad} is {prompt_ids[bad]!r}, not a token id of target '{target.name}' "
                         f"(0 to {vocab - 1})")
    if n_prompt >= target.max_context:
        raise ContextOverflowError(
            f"the prompt has {n_prompt} tokens but target '{target.name}' has a context window of "
            f"{target.max_context}: shorten the prompt (or drop earlier chat turns)"
        )
    return min(max_new_tokens, target.max_context - n_prompt)


def emit_tokens(new: list[int], stats: GenerationStats, eos: set[int], budget: int, max_new_tokens: int,
                start: float) -> list[int]:
    """`new` cut exactly where the target alone would stop (at EOS or the token budget); `stats` counts them and the
    wall time since `start`, and records why it stopped."""
    out = []
    for tok in new:
        out.append(tok)
        if tok in eos:
            stats.stop_reason = "eos"
            break
        if stats.new_tokens + len(out) == budget:
            stats.stop_reason = "length" if budget == max_new_tokens else "context"
            break
    stats.new_tokens += len(out)
    stats.seconds = time.perf_counter() - start
    return out


class Engine:
    """Generates from one target with one drafter.

    The KV caches are allocated once (grown only when a longer sequence needs it, never past the
    context window), so memory stays bounded over a long conversation. A prompt that starts with the
    tokens of the previous call (the next turn of a chat) reuses their cache entries instead of
    re-reading them.
    """

    def __init__(self, target: Target, drafter: Drafter | None = None) -> None:
        self.target = target
        self.drafter = drafter or NoDrafter()
        self._cache: StaticKVCache | None = None
        self._cached_tokens: list[int] = []   # what the committed cache slots hold

    def _cache_for(self, prompt_ids: list[int], max_len: int) -> tuple[StaticKVCache, int]:
        """A cache for this call and how many leading prompt tokens it already holds."""
        if self._cache is None:
            self._cache = self.target.new_cache(max_len)
        elif self._cache.max_len < max_len:
            # grow geometrically (a chat grows a little every turn), keeping the committed entries
            self._cache = self._cache.grown(max(max_len, min(2 * self._cache.max_len, self.target.max_context)))
        common = 0
        for a, b in zip(self._cached_tokens, prompt_ids):
            if a != b:
                break
            common += 1
        # keep < common: the drafter's pair t holds token t + 1, which must be unchanged too;
        # keep < len(prompt): the last prompt token is always re-read for its logits
        keep = self.drafter.reset(max_len, max(0, min(common - 1, len(prompt_ids) - 1)))
        self._cache.truncate(keep)
        self._cached_tokens = []  # until this call commits a consistent state
        return self._cache, keep

    def reset(self) -> None:
        """Forget the cached conversation (the next call re-reads its whole prompt)."""
        self._cached_tokens = []

    def generate(self, prompt_ids: list[int], cfg: GenerationConfig = GenerationConfig()) -> GenerationResult:
        stats = GenerationStats()
        tokens = [t for step in self.stream(prompt_ids, cfg, stats) for t in step]
        return GenerationResult(tokens, stats)

    @torch.inference_mode()
    def stream(self, prompt_ids: list[int], cfg: GenerationConfig = GenerationConfig(),
               stats: GenerationStats | None = None) -> Iterator[list[int]]:
        """Yield the new tokens of each step; `stats` (if given) is filled in as it goes."""
        stats = stats if stats is not None else GenerationStats()
        target, sampling = self.target, cfg.sampling
        n_prompt = len(prompt_ids)
        budget = token_budget(prompt_ids, target, cfg.max_new_tokens)
        tree_nodes = self.drafter.max_tree_nodes(cfg.tree)
        cache, keep = self._cache_for(prompt_ids, n_prompt + budget + tree_nodes)
        eos = target.eos_token_ids if cfg.stop_at_eos else set()
        generator = None
        if not sampling.greedy:
            generator = torch.Generator(device=target.device)
            generator.manual_seed(cfg.seed if cfg.seed is not None else int(torch.seed()))
        stats.prompt_tokens, stats.reused_prompt_tokens = n_prompt, keep
        start = time.perf_counter()

        def emit(new: list[int]) -> list[int]:
            return emit_tokens(new, stats, eos, budget, cfg.max_new_tokens, start)

        taps = getattr(self.drafter, "feature_layers", ())  # EAGLE-3 heads read several layers' outputs
        observe = getattr(self.drafter, "observe", None)      # drafters that learn from each verify (lookahead)

        def read(tokens: torch.Tensor, *tree) -> tuple[torch.Tensor, torch.Tensor]:
            """(final hidden states for the lm_head, the features the drafter reads) of a target forward."""
            out = target.forward(tokens, cache, *tree, taps=taps)
            return (out[1], out[2]) if taps else (out[1], out[1])

        # 1. prefill (what the cache does not hold yet): only the last prompt token's next token is read
        ids = torch.tensor(prompt_ids[keep:], device=target.device)
        hidden, features = read(ids)  # T H, T H' (H' = H but for EAGLE-3 heads)
        cache.commit(n_prompt - keep)
        if sampling.greedy:
            first = target.top_token(hidden[-1])
        else:
            logits = target.logits(hidden[-1:])  # 1 V
            first = sample(target_probs(logits[0], sampling), generator)
        stats.target_forwards = 1
        stats.prefill_seconds = time.perf_counter() - start
        sequence = list(prompt_ids) + [first]
        self._cached_tokens = sequence[:cache.length]
        yield emit([first])
        while not stats.stop_reason:
            # 2. draft a tree rooted at the last chosen token
            t0 = time.perf_counter()
            tree = self.drafter.propose(DraftInput(sequence, features, sampling, generator), cfg.tree)
            t1 = time.perf_counter()
            # 3. verify every node in one forward  4. accept  5. commit the accepted path
            hidden, features = read(tree.tokens, tree.ancestors, tree.depths)  # N H, N H'
            t2 = time.perf_counter()
            likely = tree.likely_path()
            nodes = NodeLogits(target.lm, hidden, likely=likely)   # the likeliest path in one product
            if tree.probes:
                nodes.prefetch(tree.probes + likely)   # with the rows the drafter reads back: one product
            path, bonus = accept(tree, nodes, sampling, generator)
            if observe is not None:
                observe(tree, nodes)   # the target's outputs at the nodes it verified (e.g. a Jacobi window)
            self._cached_tokens = []  # an interrupted compaction would leave the cache inconsistent
            cache.compact(torch.tensor(path, device=target.device))
            features = features[path]  # the accepted nodes' features feed the drafter next round
            new = tree.tokens[path[1:]].tolist() + [bonus]
            sequence += new
            self._cached_tokens = sequence[:cache.length]
            stats.target_forwards += 1
            stats.draft_seconds += t1 - t0
            stats.verify_seconds += t2 - t1
            stats.accept_seconds += time.perf_counter() - t2
            out = emit(new)
            stats.accept_lengths.append(len(out))
            yield out
