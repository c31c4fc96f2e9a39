"""The fixed-shape step: a backend of the engine (`Engine.backend`) that runs an EAGLE drafter's steps in fixed shapes
on device tensors (step.py), over slot-indexed caches (kv_cache.py), padded trees (tree.py) and the target's layers in
fewer ops (stack.py). A drafter hands it what it runs (`Drafter.fixed_shape`); docs/gpu.md has the design."""
