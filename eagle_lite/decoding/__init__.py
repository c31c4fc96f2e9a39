"""Decoding: the loops that turn a target and a drafter into tokens, and what only they use.

engine.py       the host-side loop (prefill -> draft -> verify -> accept -> commit) for every method and sampling
                setting: THE loop, the reference every other path is tested against.
drafter.py      the contract a drafter implements (`Drafter`), and `propose_together` (drafters in lockstep).
accept.py       which drafted nodes the target accepts: the greedy walk, and exact rejection sampling for trees.
static/step.py  the engine's fixed-shape step backend on device tensors (static/tree.py, static/kv_cache.py), for
                CUDA graphs and torch.compile.

The rules (a new method is a drafter, nothing copies the engine's step, batching extends the engine):
docs/methods.md, "The loops".
"""
