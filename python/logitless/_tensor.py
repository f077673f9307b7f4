"""torch.Tensor -> the plain values the C++ binding takes (see src/bindings/common.h).

Conversion only: which op runs and with which checks is decided in the op files and in C++.
A tensor travels as None or as the tuple (data_ptr, dtype_code, device_type, device_index, sizes, strides),
strides in elements as torch counts them; a workspace as None or (data_ptr, bytes); a stream as the integer
value of a cudaStream_t (0 on the CPU).
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch

# Must match logitless::DType (include/logitless/tensor.h).
DTYPE_CODES = {
    torch.float32: 0,
    torch.float16: 1,
    torch.bfloat16: 2,
    torch.float64: 3,
    torch.int32: 4,
    torch.int64: 5,
    torch.uint8: 6,
    torch.bool: 7,
}

# Must match logitless::DeviceType.
DEVICE_CODES = {"cpu": 0, "cuda": 1}

Descriptor = Tuple[int, int, int, int, Tuple[int, ...], Tuple[int, ...]]


def descriptor(t: Optional[torch.Tensor], name: str) -> Optional[Descriptor]:
    """The binding's description of `t` (None stays None). `name` is the argument named in errors.

    Runs for every tensor of every call, so the common case reads only attributes that make no new Python object
    beyond the tuple: the sizes go as the torch.Size itself (a tuple), the device as is_cuda / get_device()."""
    if t is None:
        return None
    code = DTYPE_CODES.get(t.dtype)
    if code is not None:
        if t.is_cuda:
            return (t.data_ptr(), code, 1, t.get_device(), t.shape, t.stride())
        if t.is_cpu:
            return (t.data_ptr(), code, 0, 0, t.shape, t.stride())
    if code is None:
        raise ValueError(f"{name}: dtype {t.dtype} is not supported by logitless")
    dev = DEVICE_CODES.get(t.device.type)
    if dev is None:
        raise ValueError(f"{name}: expected a CPU or CUDA tensor, got a tensor on {t.device}")
    return (t.data_ptr(), code, dev, t.device.index or 0, tuple(t.shape), tuple(t.stride()))


def rows_ready(t: torch.Tensor) -> torch.Tensor:
    """`t`, or a contiguous copy where its last dimension is not contiguous: the C++ side takes any row strides but
    wants the last dimension contiguous."""
    return t if t.dim() == 0 or t.stride(-1) == 1 or t.shape[-1] <= 1 else t.contiguous()


def workspace(nbytes: int, device: torch.device) -> Tuple[Optional[torch.Tensor], Optional[Tuple[int, int]]]:
    """Scratch of `nbytes` from torch's allocator (the caching allocator on CUDA, so the memory is
    recorded by CUDA graph capture and freed in stream order). Returns (owner, binding value); keep the
    owner alive until the call that uses the workspace has been enqueued."""
    if nbytes == 0:
        return None, None
    buf = torch.empty(nbytes, dtype=torch.uint8, device=device)
    return buf, (buf.data_ptr(), nbytes)


def stream(device: torch.device) -> int:
    """torch's current stream on `device` (the capture stream inside torch.cuda.graph), as an integer. The raw
    handle, without the torch.cuda.Stream object current_stream() would build on every call."""
    if device.type != "cuda":
        return 0
    index = device.index if device.index is not None else torch.cuda.current_device()
    return _raw_stream(index) if _raw_stream is not None else torch.cuda.current_stream(index).cuda_stream


def stream_of(t: torch.Tensor) -> int:
    """`stream(t.device)` for a CPU or CUDA tensor, without making a device object."""
    index = t.get_device()
    if index < 0:
        return 0
    return _raw_stream(index) if _raw_stream is not None else torch.cuda.current_stream(index).cuda_stream


_raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None)
