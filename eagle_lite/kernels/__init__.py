"""Optional speed-ups that leave every result exact: CPU linears from grid codes or packed weights, fused norms
and decoder layers (native C++ in csrc/), the certified float16 argmax, and the attention backends for tree
verification. `accelerate.py` is the one entry point the runtime calls; docs/cpu.md explains the design."""
from .accelerate import Accelerated, accelerate_head, accelerate_target, stock

__all__ = ["Accelerated", "accelerate_head", "accelerate_target", "stock"]
