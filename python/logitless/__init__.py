"""logitless: fused LLM training-loss kernels (CUDA C++ core, PyTorch binding)."""
from . import _C
from . import nn
from .cross_entropy import cross_entropy
from .policy_loss import grpo_loss, selective_log_softmax
from .rms_norm import rms_norm

__version__ = _C.version()

__all__ = ["cross_entropy", "grpo_loss", "nn", "rms_norm", "selective_log_softmax"]
