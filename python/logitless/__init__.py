"""logitless: fused LLM training-loss kernels (CUDA C++ core, PyTorch binding)."""
# torch first: the extension links cuBLAS (libcublas.so.13), and loaded this way it binds to the copy torch
# already brought into the process rather than to whichever one the system's library path finds first.
import torch  # noqa: F401

from . import _C
from . import nn
from .cross_entropy import cross_entropy
from .linear_cross_entropy import linear_cross_entropy
from .policy_loss import grpo_loss, selective_log_softmax
from .rms_norm import rms_norm

__version__ = _C.version()

__all__ = ["cross_entropy", "grpo_loss", "linear_cross_entropy", "nn", "rms_norm", "selective_log_softmax"]
