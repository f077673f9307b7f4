"""logitless: fused LLM training-loss kernels (CUDA C++ core, PyTorch binding)."""
# torch first: the extension links cuBLAS (libcublas.so.13), and loaded this way it binds to the copy torch
# already brought into the process rather than to whichever one the system's library path finds first.
import torch  # noqa: F401

from . import _C, heads, hf, integrations, nn
from .cross_entropy import cross_entropy
from .glu import geglu, glu, swiglu
from .heads import linear_head_loss, through_module
from .hf import patch, unpatch
from .linear_cross_entropy import linear_cross_entropy
from .linear_policy_loss import linear_grpo_loss, linear_selective_log_softmax
from .mlp import gated_mlp
from .policy_loss import grpo_loss, selective_log_softmax
from .rms_norm import rms_norm
from .rope import rope

__version__ = _C.version()

__all__ = ["cross_entropy", "gated_mlp", "geglu", "glu", "grpo_loss", "heads", "hf", "integrations",
           "linear_cross_entropy", "linear_grpo_loss", "linear_head_loss", "linear_selective_log_softmax", "nn",
           "patch", "rms_norm", "rope", "selective_log_softmax", "swiglu", "through_module", "unpatch"]
