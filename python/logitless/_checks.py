"""Argument checks shared by every public function and every fake kernel (issue 19, "hostile inputs").

Why they live in Python as well as in C++: some bad arguments never reach the C++ checks.

* Devices. A custom op whose tensors are on different devices is dispatched by the highest-priority device: with
  one tensor on ``meta`` that is the fake kernel, which allocates outputs and returns them unfilled, so a real
  call would hand back uninitialized memory. Every fake kernel is therefore registered through `register_fake`,
  which first checks that all tensor arguments share one device. Under torch.compile (FakeTensorMode) every
  tensor of a graph is on the traced device, so the check passes there; it fails only for a call a real kernel
  should have run. The public functions run the same check on entry (`check_tensors`), so a mixed call fails
  with the same message on every path (eager, custom op, CUDA device against CUDA device).
* Types the binding cannot describe: None or a non-tensor where a tensor is required, a DTensor (a wrapper with
  no storage of its own: its data pointer is null), more dimensions than the binding's TensorView holds, an
  integer outside int64 (the op schema's own cast error names no argument).
* Leading dimensions that do not collapse to the strided dimensions the kernels index (`check_rows`): the C++
  check collapses the tensors of a call jointly and names only the first; here the argument at fault is named.

The checks cost a few attribute reads per tensor (the eager RMSNorm path counts microseconds).
"""
from __future__ import annotations

import operator
import sys
from typing import Any, Callable, Iterable, Optional, Sequence, Tuple

import torch
from torch import Tensor

# logitless::kMaxDims (include/logitless/tensor.h) and kMaxRowDims (src/common/layout.h).
MAX_DIMS = 8
MAX_ROW_DIMS = 3
_INT64_MIN, _INT64_MAX = -(1 << 63), (1 << 63) - 1
_PLAIN = (Tensor, torch.nn.Parameter)


def is_dtensor(t: Tensor) -> bool:
    if type(t) in _PLAIN:  # the common case, without a module lookup
        return False
    # No DTensor exists unless its module was imported: looking it up in sys.modules spares `import logitless`
    # the seconds torch.distributed.tensor takes to import.
    mod = sys.modules.get("torch.distributed.tensor")
    cls = getattr(mod, "DTensor", None) if mod is not None else None
    return cls is not None and isinstance(t, cls)


def _device_error(name: str, device: torch.device, first: str, first_device: torch.device,
                  where: str = "") -> ValueError:
    return ValueError(f"{name}: expected a tensor on {first_device} (the device of {first}), got one on {device}; "
                      f"every tensor argument{where} must be on one device")


def check_tensors(named: Iterable[Tuple[str, Any]], optional: Sequence[str] = (),
                  dtensor_ok: Sequence[str] = ()) -> None:
    """The public functions' entry check over (argument name, value) pairs: each a tensor (None allowed for the
    names in `optional`), not complex, not a DTensor (except the names in `dtensor_ok`), at most MAX_DIMS
    dimensions, and all on one device. Raises TypeError for a non-tensor, ValueError otherwise, naming the argument."""
    device: Optional[torch.device] = None
    first = ""
    for name, t in named:
        if not isinstance(t, Tensor):
            if t is None and name in optional:
                continue
            raise TypeError(f"{name}: expected a torch.Tensor, got {'None' if t is None else type(t).__name__}")
        if t.is_complex():  # .to(float32) would drop the imaginary part with only a warning
            raise ValueError(f"{name}: complex tensors are not supported, got {t.dtype}")
        if name not in dtensor_ok and is_dtensor(t):
            raise ValueError(f"{name}: DTensor is not supported here; pass a local tensor (.to_local() for this "
                             f"rank's shard, .full_tensor() for the whole tensor)")
        if t.dim() > MAX_DIMS:
            raise ValueError(f"{name}: expected at most {MAX_DIMS} dimensions, got {t.dim()} (shape {list(t.shape)})")
        if device is None:
            device, first = t.device, name
        elif t.device != device:
            raise _device_error(name, t.device, first, device)


def check_int64(value: Any, name: str) -> int:
    """`value` as an int in int64's range (what the op schemas and the C++ options hold), or ValueError naming
    `name`. bools are refused: an integer argument given True is a mistake, not 1."""
    if isinstance(value, bool):
        raise TypeError(f"{name}: expected an integer, got bool")
    if not isinstance(value, int):
        try:
            value = operator.index(value)  # numpy and 0-d integer tensors
        except TypeError:
            raise TypeError(f"{name}: expected an integer, got {type(value).__name__}") from None
    if not _INT64_MIN <= value <= _INT64_MAX:
        raise ValueError(f"{name}: expected an integer in int64's range [-2**63, 2**63 - 1], got {value}")
    return int(value)


def check_float(value: Any, name: str) -> float:
    """`value` as a float, or TypeError naming `name` (float() alone names nothing: "could not convert string")."""
    if isinstance(value, (str, bytes)):
        raise TypeError(f"{name}: expected a number, got {type(value).__name__}")
    try:
        return float(value)
    except (TypeError, ValueError):
        raise TypeError(f"{name}: expected a number, got {type(value).__name__}") from None


def check_index_dtype(t: Tensor, name: str) -> None:
    """Ids converted to int64 where they are not int32/int64 already: refused for a dtype whose conversion would
    invent ids (floats truncate, bool and complex are no ids at all)."""
    if t.dtype.is_floating_point or t.dtype.is_complex or t.dtype == torch.bool:
        raise ValueError(f"{name}: expected an integer dtype (int32 or int64), got {t.dtype}")


def check_writable_rows(t: Tensor, name: str, why: str) -> None:
    """`t` [*, V] will be written row by row (an in-place gradient): no two of its rows may share memory. The
    C++ side checks it too, but under the name of the gradient it writes."""
    if t.numel() == 0:
        return
    extent = t.shape[-1] if t.dim() else 1
    dims = sorted((t.stride(d), t.shape[d]) for d in range(t.dim() - 1) if t.shape[d] > 1)
    for stride, size in dims:  # src/common/layout.cpp's rows_disjoint
        if stride < extent:
            raise ValueError(f"{name}: {why} needs rows that do not share memory (the gradient is written over "
                             f"them), got a broadcast or overlapping view (strides {list(t.stride())}); pass a "
                             f"tensor of its own (e.g. .contiguous()) or do without the in-place option")
        extent = stride * (size - 1) + extent


def check_process_group(group: Any) -> None:
    """None or a torch.distributed ProcessGroup; anything else fails here rather than as an AttributeError deep in
    the collectives."""
    if group is None:
        return
    import torch.distributed as dist

    cls = getattr(dist, "ProcessGroup", None) if dist.is_available() else None
    if cls is None or not isinstance(group, cls):
        raise TypeError(f"process_group: expected None or a torch.distributed.ProcessGroup, got {type(group).__name__}")


def _collapsed_dims(sizes: Sequence[int], strides_list: Sequence[Sequence[int]]) -> int:
    # src/common/layout.cpp's collapse_rows, counting only: innermost first, size-1 dimensions dropped, two adjacent
    # dimensions merged where they merge in every tensor given.
    count, prev_size, prev = 0, 0, None
    for d in range(len(sizes) - 1, -1, -1):
        if sizes[d] == 1:
            continue
        cur = [s[d] for s in strides_list]
        if prev is not None and all(c == p * prev_size for c, p in zip(cur, prev)):
            prev_size *= sizes[d]  # the merged dimension keeps its innermost strides
            continue
        count += 1
        prev, prev_size = cur, sizes[d]
    return count


def check_rows(nd: int, named: Sequence[Tuple[str, Optional[Tensor]]], jointly: bool = True) -> None:
    """The `nd` leading dimensions that the tensors in `named` (None skipped) share, as the kernels index them:
    at most MAX_ROW_DIMS strided dimensions once size-1 dimensions are dropped and dimensions that are contiguous
    with each other are merged (`jointly`: only where they are so in every tensor, as the kernels that walk those
    tensors' rows together collapse them). Names the tensor whose own layout exceeds that, or every tensor when
    only their combination does. Free for nd <= MAX_ROW_DIMS (nothing to check)."""
    if nd <= MAX_ROW_DIMS:
        return
    sizes = tuple(named[0][1].shape[:nd])
    # A tensor of another leading shape is left to the C++ shape check, which names it.
    named = [(n, t) for n, t in named if t is not None and tuple(t.shape[:nd]) == sizes]
    for name, t in named:
        got = _collapsed_dims(sizes, [t.stride()[:nd]])
        if got > MAX_ROW_DIMS:
            raise ValueError(f"{name}: expected its first {nd} dimensions (the rows) to collapse to at most "
                             f"{MAX_ROW_DIMS} strided dimensions, got {got} (sizes {list(sizes)}, strides "
                             f"{list(t.stride()[:nd])}); make it contiguous first")
    got = _collapsed_dims(sizes, [t.stride()[:nd] for _, t in named]) if jointly else 0
    if got > MAX_ROW_DIMS:
        names = " and ".join(n for n, _ in named)
        raise ValueError(f"{names}: expected their first {nd} dimensions (the rows) to collapse jointly (merged only "
                         f"where they merge in every one of them) to at most {MAX_ROW_DIMS} strided dimensions, got "
                         f"{got}; make one of them contiguous first")


def check_bias(bias: Optional[Tensor], weight: Tensor, hidden: Tensor, dtype: Optional[torch.dtype] = None) -> None:
    """A linear head's bias, as the C++ check_bias sees it ([V], hidden's dtype or float32), checked before the
    gradient-in-forward schedules allocate grad_bias from it: C++ checks the gradient buffers first, and its error
    would name grad_bias for a bad bias. `dtype`: the products' dtype where it is not hidden's (autocast)."""
    if bias is None:
        return
    dtype = dtype or hidden.dtype
    if bias.dtype not in (dtype, torch.float32):
        raise ValueError(f"bias: expected dtype {dtype} (hidden's) or float32, got {bias.dtype}")
    if bias.dim() != 1 or (weight.dim() == 2 and bias.shape[0] != weight.shape[0]):
        want = f"[{weight.shape[0]}] (one per class, V from weight)" if weight.dim() == 2 else "[V]"
        raise ValueError(f"bias: expected shape {want}, got shape {list(bias.shape)}")


def rows_collapse(nd: int, *tensors: Tensor) -> bool:
    """Whether the `nd` leading dimensions (one shape) of `tensors` collapse jointly to at most MAX_ROW_DIMS strided
    ones (see `check_rows`): an incoming gradient that does not is made contiguous before it reaches C++ (it is not
    the caller's argument to fix)."""
    if nd <= MAX_ROW_DIMS:
        return True
    return _collapsed_dims(tuple(tensors[0].shape[:nd]), [t.stride()[:nd] for t in tensors]) <= MAX_ROW_DIMS


# ----------------------------------------------------------------------------------------------------
# Fake kernels.


def _argument_names(op) -> Tuple[str, ...]:
    schema = getattr(getattr(op, "_opoverload", None), "_schema", None)
    if schema is not None:
        return tuple(a.name for a in schema.arguments)
    import inspect

    return tuple(inspect.signature(op._init_fn).parameters)


def check_one_device(op_name: str, names: Sequence[str], args: Sequence[Any], kwargs: dict) -> None:
    """Every tensor among an op's arguments on one device, or ValueError naming the argument and both devices."""
    device: Optional[torch.device] = None
    first = ""
    for name, value in list(zip(names, args)) + list(kwargs.items()):
        if isinstance(value, Tensor):
            if device is None:
                device, first = value.device, name
            elif value.device != device:
                raise _device_error(name, value.device, first, device, f" of {op_name}")


def register_fake(op) -> Callable:
    """Decorator: registers the function as `op`'s fake kernel behind the one-device check (see the module
    docstring for why a fake kernel must never run for a call with tensors on several devices)."""
    op_name = f"logitless.{op._name}" if hasattr(op, "_name") else str(op)
    names: list = []

    def decorate(fn: Callable) -> Callable:
        def fake(*args, **kwargs):
            if not names:
                names.extend(_argument_names(op))
            check_one_device(op_name, names, args, kwargs)
            return fn(*args, **kwargs)

        fake.__name__ = getattr(fn, "__name__", "fake")
        fake.__doc__ = fn.__doc__
        op.register_fake(fake)
        return fn

    return decorate
