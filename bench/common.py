"""Shared benchmark machinery: timing, the copy-bandwidth yardstick, peak memory, rows and tables.

Writing a suite (bench/suites/<op>.py, picked up by `python bench/bench.py --ops <op>`):

    from common import Context, Row, Impl, run_impls

    QUICK_SHAPES = ["256x4096"]        # used by --quick (small enough for the CPU backend)
    DEFAULT_SHAPES = ["16384x4096"]    # the real GPU shapes

    def run(ctx: Context, shapes: list[str]) -> list[Row]:
        ...build inputs for each shape string (the suite parses its own format)...
        impls = [Impl("logitless fwd+bwd", fn, setup=..., traffic_bytes=..., check=...), ...]
        return run_impls(ctx, op="rms_norm", shape="16384x4096 bf16", impls=impls, copy_bytes=...)

`fn(*setup(i))` is one timed call; `setup(i)` (untimed) returns its arguments for iteration i, e.g. a
fresh copy of inputs the call overwrites, or one of several rotated inputs (`ctx.rotation`) so the L2 cache
does not hold them between iterations. `traffic_bytes` is the minimum memory traffic of the call (what the
GB/s column counts); `copy_bytes` is the size of the device copy timed as the yardstick (a copy of the
op's input: its GB/s count one read and one write), reported as the last row of each shape. A suite may return
Rows of its own; any exception in one Impl becomes a row with the error as its note, so one broken peer does not
stop the run.
"""
from __future__ import annotations

import gc
import json
import math
import statistics
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Dict, List, Optional, Sequence

import torch

MiB = 1 << 20


@dataclass
class Context:
    device: torch.device
    quick: bool = False
    warmup: int = 3
    iters: int = 10
    options: Dict[str, Any] = field(default_factory=dict)  # op-specific CLI settings (e.g. algo)
    _copy_cache: Dict[int, tuple] = field(default_factory=dict)

    @property
    def is_cuda(self) -> bool:
        return self.device.type == "cuda"

    def sync(self) -> None:
        if self.is_cuda:
            torch.cuda.synchronize(self.device)

    def rotation(self, nbytes: int) -> int:
        """How many copies of an input of `nbytes` to cycle through so that the L2 cache (or, on the CPU,
        the last-level cache) cannot serve it from one iteration to the next: enough to cover 4x the
        cache, at most 8, and 1 once a single copy already dwarfs the cache."""
        if self.is_cuda:
            cache = getattr(torch.cuda.get_device_properties(self.device), "L2_cache_size", 50 * MiB)
        else:
            cache = 64 * MiB
        if nbytes >= 4 * cache:
            return 1
        return max(2, min(8, math.ceil(4 * cache / max(nbytes, 1))))

    def copy_time(self, nbytes: int) -> tuple:
        """(median ms, GB/s) of a device-to-device (on the CPU: host) copy of `nbytes`, GB/s counting the
        read and the write, measured in this process: the yardstick every row's "% copy BW" refers to."""
        if nbytes not in self._copy_cache:
            n = max(nbytes // 4, 1)
            src = torch.empty(n, dtype=torch.float32, device=self.device).uniform_()
            dst = torch.empty_like(src)
            ms = time_call(self, lambda: dst.copy_(src), lambda i: ())
            self._copy_cache[nbytes] = (ms, 2 * n * 4 / (ms * 1e-3) / 1e9)
            del src, dst
        return self._copy_cache[nbytes]


@dataclass
class Row:
    op: str
    shape: str
    impl: str
    ms: Optional[float] = None
    gbps: Optional[float] = None
    pct_copy: Optional[float] = None
    peak_extra_mib: Optional[float] = None
    note: str = ""


@dataclass
class Impl:
    name: str
    fn: Callable[..., Any]
    setup: Callable[[int], Sequence[Any]] = lambda i: ()
    traffic_bytes: int = 0
    # Optional correctness check: called with the value `fn` returned on one untimed call; returns a note
    # (e.g. "loss matches") or raises.
    check: Optional[Callable[[Any], str]] = None


class Source(torch.autograd.Function):
    """``Source.apply(t, anchor)`` hands `t` on as a non-leaf activation that requires grad (through `anchor`, a
    scalar leaf), without a copy and without being a view of `t` (a view of a leaf is not an activation an op may
    write over); its backward drops the gradient. A fwd+bwd row built on it times the op's own backward only."""

    @staticmethod
    def forward(ctx, t, anchor):
        return torch.ops.aten._unsafe_view(t, t.shape)

    @staticmethod
    def backward(ctx, grad):
        return None, None


def time_call(ctx: Context, fn: Callable[..., Any], setup: Callable[[int], Sequence[Any]]) -> float:
    """Median milliseconds of `fn(*setup(i))`. On CUDA each call sits between two events on the current
    stream, so work `setup` enqueued before the start event is not counted; warm-up calls come first
    (compilation, autotuning, allocator growth)."""
    for i in range(ctx.warmup):
        fn(*setup(i))
    ctx.sync()
    times: List[float] = []
    if ctx.is_cuda:
        events = []
        for i in range(ctx.iters):
            args = setup(i)
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn(*args)
            end.record()
            events.append((start, end))
        torch.cuda.synchronize(ctx.device)
        times = [s.elapsed_time(e) for s, e in events]
    else:
        for i in range(ctx.iters):
            args = setup(i)
            t0 = time.perf_counter()
            fn(*args)
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def peak_extra_mib(ctx: Context, fn: Callable[..., Any], setup: Callable[[int], Sequence[Any]]) -> Optional[float]:
    """Peak memory `fn` allocates beyond what exists when it starts (its inputs, made by `setup`), in MiB.
    CUDA only (torch.cuda.max_memory_allocated); None on the CPU."""
    if not ctx.is_cuda:
        return None
    args = setup(0)
    gc.collect()
    torch.cuda.synchronize(ctx.device)
    torch.cuda.reset_peak_memory_stats(ctx.device)
    base = torch.cuda.memory_allocated(ctx.device)
    out = fn(*args)
    torch.cuda.synchronize(ctx.device)
    peak = torch.cuda.max_memory_allocated(ctx.device) - base
    del out, args
    return peak / MiB


def failure_note(e: Exception) -> str:
    """A row's note for an implementation that raised: its exception's type and first line."""
    return f"failed: {type(e).__name__}: {str(e).splitlines()[0][:120] if str(e) else ''}"


def interleaved_rounds(steps: Dict[str, Any], measure: Callable[[Any], float], rounds: int,
                       between: Optional[Callable[[], None]] = None) -> Dict[str, Any]:
    """`measure` of every step in `rounds` interleaved rounds (each round measures every step once, in turn, and
    calls `between` after each): a GPU under sustained load lowers its clocks and a shared host drifts, so the
    things compared are measured close together, each keeping one value per round. A step that fails keeps its
    exception instead of its list."""
    got: Dict[str, Any] = {name: [] for name in steps}
    for _ in range(rounds):
        for name, step in steps.items():
            if isinstance(got[name], Exception):
                continue
            try:
                got[name].append(measure(step))
            except Exception as e:  # one failing peer must not end the run
                got[name] = e
            if between is not None:
                between()
    return got


def release(ctx: Context) -> None:
    gc.collect()
    if ctx.is_cuda:
        torch.cuda.empty_cache()


def run_impls(ctx: Context, op: str, shape: str, impls: Sequence[Impl], copy_bytes: int) -> List[Row]:
    copy_ms, copy = ctx.copy_time(copy_bytes)
    rows = []
    for impl in impls:
        row = Row(op=op, shape=shape, impl=impl.name)
        try:
            notes = []
            if impl.check is not None:
                notes.append(impl.check(impl.fn(*impl.setup(0))))
            row.ms = time_call(ctx, impl.fn, impl.setup)
            if impl.traffic_bytes:
                row.gbps = impl.traffic_bytes / (row.ms * 1e-3) / 1e9
                row.pct_copy = 100.0 * row.gbps / copy
            row.peak_extra_mib = peak_extra_mib(ctx, impl.fn, impl.setup)
            row.note = "; ".join(n for n in notes if n)
        except Exception as e:  # one failing peer (OOM, missing kernel) must not end the run
            row.note = failure_note(e)
        release(ctx)
        rows.append(row)
    rows.append(Row(op=op, shape=shape, impl="copy (yardstick)", ms=copy_ms, gbps=copy, pct_copy=100.0,
                    note=f"{copy_bytes / MiB:.0f} MiB read + written"))
    return rows


# ----------------------------------------------------------------------------------------------------
# Output


COLUMNS = [("op", "op"), ("shape", "shape"), ("impl", "impl"), ("ms", "median ms"), ("gbps", "GB/s"),
           ("pct_copy", "% copy BW"), ("peak_extra_mib", "peak extra MiB"), ("note", "note")]


def _fmt(key: str, v: Any) -> str:
    if v is None:
        return "-"
    if key == "ms":
        return f"{v:.3f}"
    if key == "pct_copy":
        return f"{v:.1f}"
    if key in ("gbps", "peak_extra_mib"):
        return f"{v:.0f}" if v >= 100 else f"{v:.3g}"
    return str(v)


def markdown_table(rows: Sequence[Row], columns=COLUMNS) -> str:
    head = "| " + " | ".join(title for _, title in columns) + " |"
    sep = "|" + "|".join("---" if k in ("op", "shape", "impl", "note") else "---:" for k, _ in columns) + "|"
    body = ["| " + " | ".join(_fmt(k, getattr(r, k)) for k, _ in columns) + " |" for r in rows]
    return "\n".join([head, sep, *body])


def text_table(rows: Sequence[Row], columns=COLUMNS) -> str:
    cells = [[title for _, title in columns]] + [[_fmt(k, getattr(r, k)) for k, _ in columns] for r in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(columns))]
    lines = []
    for n, row in enumerate(cells):
        lines.append("  ".join(c.ljust(w) if i in (0, 1, 2, 7) else c.rjust(w)
                               for i, (c, w) in enumerate(zip(row, widths))).rstrip())
        if n == 0:
            lines.append("  ".join("-" * w for w in widths))
    return "\n".join(lines)


def write(rows: Sequence[Row], path: str, header: Dict[str, Any]) -> None:
    if path.endswith(".json"):
        with open(path, "w") as f:
            json.dump({"header": header, "rows": [asdict(r) for r in rows]}, f, indent=2)
    else:
        with open(path, "w") as f:
            for k, v in header.items():
                f.write(f"- {k}: {v}\n")
            f.write("\n" + markdown_table(rows) + "\n")
