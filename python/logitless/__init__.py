"""logitless: fused LLM training-loss kernels (CUDA C++ core, PyTorch binding)."""
from . import _C

__version__ = _C.version()
