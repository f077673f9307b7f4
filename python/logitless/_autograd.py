"""What the op modules share: the custom ops' direct eager path, the autograd helpers of the fused schedules, and
the tables and constants more than one family uses.

Every op is declared with `custom_op` (this module's), which registers it with torch.library as usual and returns a
`DirectOp`: calling it runs the registered op where torch has to see it (torch.compile, a FakeTensorMode or any other
dispatch or function mode, functorch transforms, tensor subclasses such as DTensor, meta tensors), and otherwise the
op's own Python implementation directly, with the op's registered autograd formula run by one generic
autograd.Function (`_Direct`). The custom-op dispatch costs several times the op's own host time per call (schema
parsing, the Python dispatcher, the autograd wrapper, alias and mutation checks), more than the kernels take on a
GPU at small shapes; the direct path is the same implementation and the same formula, so both agree to the bit
(tested), and opcheck, fake kernels, torch.compile(fullgraph=True) and CUDA graphs keep the op.

The generic layers still cost more than torch's own fused ops take on the host, for the most frequent small calls.
rms_norm and cross_entropy therefore run their own autograd.Function on the direct path (where `eager_ok` and a
gradient is needed): the same implementations and formula, without the layers, and their backward calls the backward
op's implementation directly where the backward is eager_ok too (not under compiled autograd or a mode entered for
it). Their scalar arguments are checked and turned into the binding's options once per distinct tuple
(`cached_settings`), and their direct calls make only what is used: no rstd where rms_norm records no graph, no
lse or z-loss where cross_entropy's caller asked for neither.

Every op module imports from here at its top, and this module imports none of them, so the op modules need no
import inside a function to break a cycle.

The fused schedules (cross-entropy and policy loss over logits, the linear heads, the vocabulary-parallel path)
compute the gradient in the forward pass and save it; their backward only multiplies it by the incoming gradient
(`scale_saved`, through the ``logitless::scale_rows_`` op) and refuses a double backward (`no_double_backward`).
"""
from __future__ import annotations

import atexit
from typing import Optional

import torch
from torch import Tensor

from . import _C
from ._checks import register_fake
from ._tensor import descriptor, stream_of

__all__ = ["REDUCTIONS", "REDUCTION_NONE", "SCHEDULES", "DEFAULT_MEMORY_BUDGET", "enum", "no_double_backward",
           "scale_saved", "custom_op", "DirectOp", "eager_ok", "direct_apply", "empty_rows",
           "cached", "cached_settings", "checkpointed", "autocast_dtype", "cast_operands"]

# Must match logitless::Reduction (include/logitless/cross_entropy.h); the linear cross-entropy and the
# vocabulary-parallel path use the same enum.
REDUCTIONS = {"none": 0, "sum": 1, "mean": 2}
REDUCTION_NONE = REDUCTIONS["none"]

# The linear heads' schedules and default chunk budget (linear_cross_entropy and linear_policy_loss), as the C++
# options' default memory_budget.
SCHEDULES = ("auto", "gradient_in_forward", "recompute")
DEFAULT_MEMORY_BUDGET = 512 << 20


# ----------------------------------------------------------------------------------------------------
# The direct eager path.

_PLAIN = (Tensor, torch.nn.Parameter)
_dispatch_modes = torch._C._len_torch_dispatch_stack
_function_mode_on = torch._C._is_torch_function_mode_enabled
_functorch_level = torch._C._functorch.peek_interpreter_stack
_profiling = torch.autograd._profiler_enabled

# Counts the calls that took the direct path, per op name; tests read it to see which path ran. A dict increment
# per call: cheap enough to keep on.
direct_calls: dict = {}


def eager_ok(tensors) -> bool:
    """Whether a call over `tensors` (None entries allowed) may skip the dispatcher: no compilation, no dispatch or
    function mode (FakeTensorMode, FunctionalTensorMode, make_fx, a device context), no functorch transform, and
    only plain CPU or CUDA tensors (no subclass such as DTensor or FakeTensor, no meta tensor)."""
    if torch.compiler.is_compiling():
        return False
    if _dispatch_modes() or _function_mode_on() or _functorch_level() is not None:
        return False
    for t in tensors:
        if t is not None and (type(t) not in _PLAIN or not (t.is_cuda or t.is_cpu)):
            return False
    return True


def direct_apply(run, name: str, *args):
    """run(*args) (an autograd.Function's apply, or an op's implementation) as the direct call of the op `name`:
    counted in `direct_calls` and named in a profile as the dispatcher would have named the op."""
    direct_calls[name] = direct_calls.get(name, 0) + 1
    if _profiling():
        with torch.autograd.profiler.record_function(name):
            return run(*args)
    return run(*args)


def empty_rows(t: Tensor) -> Tensor:
    """A new contiguous tensor of t's shape, dtype and device: what torch.empty(t.shape, dtype=t.dtype,
    device=t.device) makes, at a third of its Python cost (no shape, dtype and device parsed from arguments)."""
    return torch.empty_like(t, memory_format=torch.contiguous_format)


class _Direct(torch.autograd.Function):
    """The registered autograd formula of a DirectOp around its implementation: forward(*args, op, ctx_attrs). The
    op's setup_context and backward see the ctx they see under the dispatcher (needs_input_grad indexed by the op's
    arguments); `ctx_attrs` are set on the ctx first (eager-only choices, such as an in-place backward)."""

    @staticmethod
    def forward(ctx, *args):
        op, attrs = args[-2], args[-1]
        args = args[:-2]
        out = op._run(args)
        for k, v in attrs.items():
            setattr(ctx, k, v)
        ctx.direct_op = op
        op.setup_context(ctx, args, out)
        return out

    @staticmethod
    def backward(ctx, *grads):
        got = ctx.direct_op.backward(ctx, *grads)
        return (tuple(got) if isinstance(got, (tuple, list)) else (got,)) + (None, None)


class DirectOp:
    """A custom op (torch.library's CustomOpDef, whose attributes it forwards) that eager calls run directly (see the
    module docstring). Call it with every argument positionally; `ctx_attrs` reach the autograd ctx on the direct
    path only."""

    def __init__(self, op, impl, name: str):
        self.op = op
        self._overload = op._opoverload
        self.impl = impl
        self.name = name
        args = self._overload._schema.arguments
        self.tensor_args = tuple(i for i, a in enumerate(args) if str(a.type) in ("Tensor", "Optional[Tensor]"))
        self.mutated = tuple(i for i, a in enumerate(args) if a.alias_info is not None and a.alias_info.is_write)
        self.backward = self.setup_context = None

    def __getattr__(self, name):
        return getattr(self.op, name)

    def register_autograd(self, backward, *, setup_context) -> None:
        self.op.register_autograd(backward, setup_context=setup_context)
        self.backward, self.setup_context = backward, setup_context

    def _run(self, args):
        out = self.impl(*args)
        for i in self.mutated:  # what the dispatcher does for a declared mutation
            if args[i] is not None:
                torch.autograd.graph.increment_version(args[i])
        return out

    def __call__(self, *args, ctx_attrs: Optional[dict] = None):
        if torch.compiler.is_compiling():
            return self._overload(*args)
        tensors = [args[i] for i in self.tensor_args]
        if not eager_ok(tensors):
            return self._overload(*args)
        grad = torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)
        if grad and self.backward is None:  # no formula: torch's own handling of the call (an error on backward)
            return self._overload(*args)
        if grad:
            return direct_apply(_Direct.apply, self.name, *args, self, ctx_attrs or {})
        return self.run_direct(*args)

    def run_direct(self, *args):
        """The op's implementation over `args`, for a caller that found them eager_ok and records no graph of the
        op (grad mode off, or inside its own autograd.Function)."""
        return direct_apply(self._run, self.name, args)


def custom_op(name: str, mutates_args=(), device_types=("cpu", "cuda")):
    """torch.library.custom_op, returning a DirectOp."""
    def decorate(fn):
        op = torch.library.custom_op(name, mutates_args=mutates_args, device_types=device_types)(fn)
        return DirectOp(op, fn, name)

    return decorate


def cached(factory):
    """`factory` (a binding's options constructor over hashable scalars) behind a small dictionary: one options
    object per distinct argument tuple, made once. The objects are shared: never modify one (copy.copy it)."""
    cache: dict = {}

    def get(*key):
        o = cache.get(key)
        if o is None:
            if len(cache) >= 256:
                cache.clear()
            o = cache[key] = factory(*key)
        return o

    get.__wrapped__ = factory
    # Emptied before the extension module is torn down, whose leak check would otherwise report the objects held.
    atexit.register(cache.clear)
    return get


_KEY_TYPES = frozenset((int, float, str, bool, type(None)))


def cached_settings(build):
    """`build` (a public function's validation of its scalar arguments, returning what its calls use) behind a small
    dictionary keyed by the arguments and their types, so that a call repeating earlier arguments skips the checks:
    True, 1 and 1.0 are equal keys but stay apart here, as a check that refuses a bool or a float must see each.
    Only arguments of immutable built-in types are keys: anything else (a 0-d tensor, which could change in place
    under the same key, an unhashable value) is built every time, and build raises its error."""
    cache: dict = {}

    def get(*args):
        types = tuple(map(type, args))
        if not _KEY_TYPES.issuperset(types):
            return build(*args)
        key = args + types
        got = cache.get(key)
        if got is None:
            got = build(*args)
            if len(cache) >= 256:
                cache.clear()
            cache[key] = got
        return got

    get.__wrapped__ = build
    atexit.register(cache.clear)  # as in `cached`: nothing of the extension module left for its leak check
    return get


# ----------------------------------------------------------------------------------------------------
# Tables and helpers.


def enum(table: dict, value, name: str) -> int:
    """The C++ enum value of the string `value` in `table`, or ValueError naming the argument and the choices."""
    code = table.get(value) if isinstance(value, str) else None
    if code is None:
        raise ValueError(f"{name}: expected one of {', '.join(map(repr, table))}, got {value!r}")
    return code


def checkpointed() -> bool:
    """Whether what is saved for the backward now goes through torch.utils.checkpoint (its non-reentrant form, the
    one transformers uses by default): dropped after the forward, made again by rerunning the forward in the backward.
    Saving a tensor there costs no memory beyond that layer's backward, so recomputing it instead only costs time."""
    hooks = torch._C._autograd._top_saved_tensors_default_hooks(False)
    return hooks is not None and getattr(hooks[0], "__module__", None) == "torch.utils.checkpoint"


def no_double_backward(name: str) -> None:
    """Raise where a backward runs under create_graph=True, naming the public function `name`.

    Backward runs with grad mode on only under create_graph=True. The gradients computed here have no graph of
    their own, so a second derivative would silently miss this loss's term: refuse instead.
    """
    if torch.is_grad_enabled():
        raise RuntimeError(f"logitless.{name}: double backward (create_graph=True) is not supported")


@custom_op("logitless::scale_rows_", mutates_args=("grad",))
def _scale_rows(grad: Tensor, scale: Tensor) -> None:
    """grad[i, :] *= scale ([] or one per row, float32, on grad's device); rows with scale exactly 1 are
    not touched."""
    _C.scale_rows(descriptor(grad, "grad"), descriptor(scale, "scale"), stream_of(grad))


def _scale_rows_direct(grad: Tensor, scale: Tensor) -> None:
    """The op's implementation and the version bump the dispatcher makes for its declared mutation, without the
    DirectOp layers (every fused loss's backward runs this)."""
    _scale_rows.impl(grad, scale)
    torch.autograd.graph.increment_version(grad)


@register_fake(_scale_rows)
def _(grad, scale):
    return None


def scale_saved(grad: Tensor, scale: Tensor, direct: bool = False) -> Tensor:
    """The backward of a gradient computed in the forward: `grad` times the upstream `scale` (float32, [] or one
    per row), in place in eager mode (free: rows with scale 1 are skipped) and out of place under torch.compile.
    `direct`: the forward ran the ops' implementations directly (eager_ok); so does this where `scale` is eager_ok.

    Functionalization turns an in-place scale of a saved tensor into a copy plus a scale of the copy, so in place
    saves nothing there, and that copy goes wrong where inductor lays the saved tensor out differently from eager:
    the copy is an as_strided with the strides traced in eager. Inductor pads the rows of intermediates (on CUDA by
    default: a float32 row of 4099 gets a stride of 4128); when the logits are a view of such a buffer (a matmul's
    output reshaped) an in-place forward writes the gradient into it and saves it with padded strides, and the copy
    read it as if contiguous. A product reads the real strides.
    """
    if torch.compiler.is_compiling():
        s = scale if scale.dim() == 0 else scale.reshape(scale.shape + (1,) * (grad.dim() - scale.dim()))
        return (grad * s).to(grad.dtype)
    if direct and eager_ok((scale,)):
        direct_apply(_scale_rows_direct, _scale_rows.name, grad, scale)
    else:
        _scale_rows(grad, scale)
    return grad


# ----------------------------------------------------------------------------------------------------
# The linear heads under torch.autocast (one device and vocabulary-parallel).


def autocast_dtype(hidden: Tensor, weight: Tensor) -> Optional[torch.dtype]:
    """The 16-bit dtype the products run in under torch.autocast, where hidden or weight is float32 (as F.linear
    would cast them); None outside autocast or where both are in its dtype already."""
    device = hidden.device.type
    if device not in ("cuda", "cpu") or not torch.is_autocast_enabled(device):
        return None
    dtype = torch.get_autocast_dtype(device)
    if dtype not in (torch.bfloat16, torch.float16) or (hidden.dtype == dtype and weight.dtype == dtype):
        return None
    if hidden.dtype not in (dtype, torch.float32) or weight.dtype not in (dtype, torch.float32):
        return None  # float64, or the other 16-bit type: as without autocast (the op's own dtype checks)
    return dtype


def cast_operands(hidden: Tensor, weight: Tensor, bias: Optional[Tensor], dtype: Optional[torch.dtype]):
    """The operands in the products' dtype; a float32 bias stays float32 (the kernels add it in float32)."""
    if dtype is None:
        return hidden, weight, bias
    if bias is not None and bias.dtype != torch.float32:
        bias = bias.to(dtype)
    return hidden.to(dtype), weight.to(dtype), bias
