"""Decoding: the loops that turn a target and a drafter into tokens, and what only they use.

engine.py       the host-side loop, prefill -> draft -> verify -> accept -> cache commit -> next, for every
                method (drafters/) and every sampling setting; the reference every other path is tested against.
drafter.py      the contract a drafter implements (`Drafter`: reset, max_tree_nodes, propose; optionally observe,
                proposal), and `propose_together`, which runs several drafters' proposals in lockstep.
accept.py       which drafted nodes the target accepts: the greedy walk, and exact rejection sampling for trees.
static_step.py  the engine's other step backend: the same step in fixed shapes on device tensors (static_tree.py:
                the EAGLE-2 tree and tensor acceptance; device_kv_cache.py: slot-indexed caches), for CUDA graphs
                and torch.compile.

The rule for the loops:
- The engine is THE loop. A new method is a drafter (drafters/), a new sampling rule lives in accept.py, and
  both run through `Engine.stream`; nothing copies its step.
- The fixed-shape step exists only because a GPU cannot afford the engine's host reads. It is a step backend of
  the engine (`Engine.backend`): the engine's loop prefills through it, stops and counts; it runs EAGLE (and plain
  decoding), greedy with the engine's tokens exactly and sampled with accept.py's rule; whatever it cannot express
  (host-side drafters such as prompt lookup) stays with the engine's tree step.
- Batching extends the engine: a batch is a set of the engine's sequences whose per-sequence steps (their drafts,
  acceptance and cache commits) are the engine's own, with the verify forwards of all sequences fused into one
  target forward under a block-diagonal tree mask, and the draft heads' forwards of the sequences that draft
  together (`drafter.propose_together`) fused the same way. Batch 1 is the engine as the CLI runs it.

Below this package: config, tree (draft trees and their masks), kv_cache, kernels/, target/. Above it:
drafters/ (which implement `drafter.Drafter`), and the front doors (pipeline, generate, custom_generate, serve).
"""
