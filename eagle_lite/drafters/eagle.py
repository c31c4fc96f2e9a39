"""EAGLE-2 drafting: the draft head grows a dynamic tree by cumulative log-probability, then reranks it
(optionally keeping only nodes whose path probability reaches `TreeConfig.min_prob`). A prompt-lookup path is
grafted on by composing it with `LookupGraft` (lookup_graft.py), as the registry does for method eagle."""
from __future__ import annotations

import math

import torch

from ..config import TreeConfig
from ..draft import DraftHead
from ..kernels import accelerate_head
from ..kernels.accelerate import draft_vocab_grid
from ..kernels.cpu_linear import few_rows_product
from ..kv_cache import StaticKVCache
from ..tree import DraftTree, rerank
from .base import DraftInput


class EagleDrafter:
    name = "eagle"

    def __init__(self, target, head: DraftHead, round_head: bool = True) -> None:
        """round_head: on CPU, run the head's linears from Q8_0 codes rounded from its fp32 weights (a
        quarter of the bytes; proposals barely move and acceptance keeps the output exact); else oneDNN's
        packed fp32 product. No-op elsewhere."""
        self.target = target
        self.head = head.eval()
        self.feature_layers = head.feature_layers   # the target's layers the head reads (EAGLE-3), else ()
        # the native layer op computes a Llama layer; an EAGLE-3 layer reads a 2H-wide input and keeps its own forward
        layer = self.head.layer if head.design != "eagle3" else None
        accelerate_head(self.head, layer, self.head.rotary, round_to_grid=round_head)
        # V_draft H: the target's lm_head (frozen, shared), or its draft-vocabulary rows, or an EAGLE-3 head's own
        self.lm_weight = head.output_weight(target.lm_head.weight).detach().contiguous()
        # its integer codes where it lies on a GGUF grid (grid_linear.py); the full vocabulary is the target's own
        shared = head.d2t is None and head.lm_head is None
        self.lm_grid = target.lm_grid if shared else draft_vocab_grid(self.lm_weight)
        self.cache: StaticKVCache | None = None
        self.recommended_tree = head.tree          # the tree its checkpoint recommends for this device, if any
        self._queued: list[torch.Tensor] = []     # features the head has not read yet (steps it sat out)

    def reset(self, max_len: int, keep: int = 0, tree_slots: int = 256) -> int:
        need = max_len + tree_slots
        if self.cache is None:
            cfg = self.head.config
            head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
            kv_heads = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
            self.cache = StaticKVCache(1, kv_heads, head_dim, need, self.lm_weight.dtype, self.lm_weight.device)
        elif self.cache.max_len < need:
            self.cache = self.cache.grown(need)
        # pair t holds (f_t, x_{t+1}): it stays valid while both tokens are unchanged
        self.cache.truncate(min(keep, self.cache.length))
        self._queued = []
        return self.cache.length

    def max_tree_nodes(self, tree: TreeConfig) -> int:
        return 1 + tree.total_tokens

    def sit_out(self, inp: DraftInput) -> None:
        """Another drafter proposed this step (a lookup chain): keep its features for the next `propose`."""
        self._queued.append(inp.hidden)

    def _top_k(self, h: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """h: [R, H] -> (log-probs [R, k], target token ids [R, k]) of the k likeliest next tokens."""
        h = self.head.logit_features(h)                      # an EAGLE-3 head's own final norm, else h
        logp = torch.log_softmax(few_rows_product(h, self.lm_weight, self.lm_grid).float(), dim=-1)  # R V_draft
        scores, ids = logp.topk(k, dim=-1)
        return scores, (ids if self.head.d2t is None else self.head.d2t[ids])

    def propose(self, inp: DraftInput, tree: TreeConfig) -> DraftTree:
        if self._queued:
            inp = DraftInput(inp.tokens, torch.cat(self._queued + [inp.hidden]), inp.sampling, inp.generator)
            self._queued = []
        cache, embed, k = self.cache, self.target.embed_tokens, tree.top_k
        dev = inp.hidden.device
        # 1. Catch up on the real features: pair (f_t, x_{t+1}) sits at x_t's position t.
        m = inp.hidden.shape[0]
        n = cache.length                                     # real pairs already in the draft cache
        if n + m + 1 != len(inp.tokens):
            raise RuntimeError(f"draft cache holds {n} pairs, but {len(inp.tokens)} tokens arrived with {m} new features")
        next_tokens = torch.tensor(inp.tokens[-m:], device=dev)
        h = self.head.step(inp.hidden, embed(next_tokens), cache, torch.arange(n, n + m, device=dev),
                           torch.ones(m, m, dtype=torch.bool, device=dev).tril_())  # m H
        cache.commit(m)
        n += m                                               # = the root's position
        # 2. The root's children, then `depth - 1` expansions of the best-k frontier.
        scores, tokens = self._top_k(h[-1:], k)              # 1 k
        cand_scores, cand_tokens = [scores[0]], [tokens[0]]
        cand_parents = [torch.full((k,), -1, device=dev)]
        front = torch.arange(k, device=dev)                  # candidate index of each frontier node
        front_scores, front_tokens = scores[0], tokens[0]    # k
        front_h = h[-1:].expand(k, -1)                       # k H: the feature each frontier node reads
        front_vis_parent = torch.zeros(k, 0, dtype=torch.bool, device=dev)  # k W: parent's view of written nodes
        written_vis = torch.zeros(0, 0, dtype=torch.bool, device=dev)       # W W
        floor = math.log(tree.min_prob) if tree.min_prob > 0 else -math.inf   # path log-prob worth verifying
        for depth in range(1, tree.depth):
            if tree.min_prob > 0 and float(front_scores.max()) < floor:
                break                                        # nothing left worth expanding
            vis = torch.cat([front_vis_parent, torch.eye(k, dtype=torch.bool, device=dev)], dim=1)  # k W+k
            h = self.head.step(front_h, embed(front_tokens), cache,
                               torch.full((k,), n + depth - 1, device=dev), vis)  # k H
            cache.commit(k)
            w = written_vis.shape[0]
            written_vis = torch.cat([torch.nn.functional.pad(written_vis, (0, k)), vis], dim=0)  # W+k W+k
            scores, tokens = self._top_k(h, k)               # k k
            cum = (front_scores[:, None] + scores).flatten()  # k*k
            base = sum(s.numel() for s in cand_scores)
            cand_scores.append(cum)
            cand_tokens.append(tokens.flatten())
            cand_parents.append(front.repeat_interleave(k))
            best = cum.topk(k).indices                       # k, into the k*k grid
            parent_row = best // k                           # which frontier node each came from
            front = base + best
            front_scores, front_tokens = cum[best], tokens.flatten()[best]
            front_h = h[parent_row]
            front_vis_parent = written_vis[w + parent_row]
        cache.truncate(n)                                    # drop the tree nodes; the real pairs stay
        scores = torch.cat(cand_scores)
        budget = tree.total_tokens if tree.min_prob <= 0 else min(tree.total_tokens, int((scores >= floor).sum()))
        kept, parents = rerank(scores, torch.cat(cand_parents), budget)
        root = torch.tensor([inp.root], device=dev)
        return DraftTree(torch.cat([root, torch.cat(cand_tokens)[kept]]), [-1] + parents)
