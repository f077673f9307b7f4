"""logitless: fused LLM training-loss kernels (CUDA C++ core, PyTorch binding)."""
from . import _C
from . import nn
from .cross_entropy import cross_entropy
from .rms_norm import rms_norm

__version__ = _C.version()

__all__ = ["cross_entropy", "nn", "rms_norm"]
