"""Optional speed-ups that leave every result exact: CPU linears from grid codes or packed weights, fused norms
and decoder layers (native C++ in csrc/), the certified float16 argmax, and the attention backends for tree
verification. `accelerate.py` is the one entry point the runtime calls for the speed-ups (what it names is exported
here, and the runtime imports it from here); `attention.py` is the one for the attention backends. docs/cpu.md
explains the design."""
from .accelerate import (
    FEW_ROWS,
    MAX_FUSED_ROWS,
    MAX_GRID_ROWS,
    Accelerated,
    CertifiedArgmax,
    GridWeight,
    RotaryTable,
    accelerate_head,
    accelerate_target,
    attach_file_grids,
    draft_vocab_grid,
    few_rows_product,
    gguf_header,
    needs_build,
    running_fused,
    stock,
)

__all__ = ["FEW_ROWS", "MAX_FUSED_ROWS", "MAX_GRID_ROWS", "Accelerated", "CertifiedArgmax", "GridWeight",
           "RotaryTable", "accelerate_head", "accelerate_target", "attach_file_grids",
           "draft_vocab_grid", "few_rows_product", "gguf_header",
           "needs_build", "running_fused", "stock"]
