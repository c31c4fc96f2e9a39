"""eagle_lite: lossless EAGLE-style speculative decoding for Hugging Face causal LMs."""
from .config import GenerationConfig, SamplingConfig, TreeConfig

__all__ = ["GenerationConfig", "SamplingConfig", "TreeConfig", "load"]
__version__ = "0.1.0"


def load(*args, **kwargs):
    """Load a target and drafting method; see eagle_lite.pipeline.load."""
    from .pipeline import load as _load

    return _load(*args, **kwargs)
