"""What the Python test modules share: the CUDA marker, the common parameter lists, and the harnesses that more than
one family's tests run (an upstream gradient, central differences, torch.compile against eager, CUDA streams, graphs
and peak memory). Imported by the test modules as `_helpers` (pytest puts this folder on sys.path)."""
import pytest
import torch
import torch.nn.functional as F

import logitless

HAS_CUDA = torch.cuda.is_available() and logitless._C.built_with_cuda()
needs_cuda = pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device and a CUDA build of logitless")

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
REDUCTIONS = ["mean", "sum", "none"]
SCHEDULES = ["gradient_in_forward", "recompute"]

# The CPU backend computes in double: its gradients carry only their rounding to the inputs' dtype.
CPU_GRAD_TOL = {torch.float32: 2e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}


def upstream_grad(loss, seed=1):
    """A non-trivial incoming gradient of `loss`'s shape, in [0.5, 1.5)."""
    g = torch.Generator().manual_seed(seed)
    return (torch.rand(loss.shape, generator=g) + 0.5).to(loss.device)


def run_or_skip_unavailable(fn, *words):
    """fn(), skipping the test where it raises that an algorithm (an error naming one of `words`) is not available on
    this device."""
    try:
        return fn()
    except (ValueError, RuntimeError) as e:
        if any(word in str(e) for word in words):
            pytest.skip(f"algorithm not available on this device: {e}")
        raise


def assert_grads_match_central_differences(f, inputs, scale=2.0, eps=1e-3):
    """Each input's .grad, of `scale` * f(*inputs) (the caller's backward), against central differences of f in
    float32 with a wide step and loose tolerances: enough to catch a wrong formula (a sign, a missing term, a bad chain
    rule), for the backwards that gradcheck's repeated passes cannot run."""
    with torch.no_grad():
        for i, x in enumerate(inputs):
            numeric = torch.zeros_like(x)
            flat = x.detach().clone().reshape(-1)
            for k in range(flat.numel()):
                args = [t.detach() for t in inputs]
                old = flat[k].item()
                flat[k] = old + eps
                args[i] = flat.view_as(x)
                hi = f(*args).item()
                flat[k] = old - eps
                lo = f(*args).item()
                flat[k] = old
                numeric.reshape(-1)[k] = scale * (hi - lo) / (2 * eps)
            torch.testing.assert_close(x.grad, numeric, atol=2e-3, rtol=2e-2)


def check_second_backward(loss_with_schedule, h, leaves):
    """The linear losses' second backward over a retained graph: the gradient-in-forward schedule's backward consumes
    the gradient saved by the forward, so a second one raises; the recompute schedule's runs again and accumulates the
    same gradient of `h` (the leaves' gradients are cleared between the two)."""
    loss = loss_with_schedule("gradient_in_forward")
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward()
    for t in leaves:
        t.grad = None
    loss = loss_with_schedule("recompute")
    loss.backward(retain_graph=True)
    first = h.grad.clone()
    loss.backward()
    torch.testing.assert_close(h.grad, 2 * first)


def assert_compiled_matches_eager(model, leaves, *args, upstream=1.0, rtol, atol):
    """model(*leaves, *args) eager and compiled with fullgraph=True: the same loss and the same gradients of the leaves
    (through an upstream factor)."""
    results = []
    for fn in (model, torch.compile(model, fullgraph=True)):
        for t in leaves:
            t.grad = None
        loss = fn(*leaves, *args)
        (upstream * loss).backward()
        results.append([loss.detach()] + [t.grad.clone() for t in leaves])
    for a, b in zip(*results):
        torch.testing.assert_close(a, b, rtol=rtol, atol=atol)


def check_dynamic_shapes_against_torch(loss_fn):
    """loss_fn(h, W, t, reduction), compiled with dynamic shapes for two token counts and two reductions: the loss and
    the hidden states' gradient against torch's cross-entropy of h @ W.T."""
    torch._dynamo.reset()
    W = torch.randn(13, 8, requires_grad=True)
    fn = torch.compile(lambda h, W, t, red: loss_fn(h, W, t, red).sum(), fullgraph=True, dynamic=True)
    for n in (5, 9):
        for reduction in ("mean", "none"):
            h = torch.randn(n, 8, requires_grad=True)
            t = torch.randint(0, 13, (n,))
            loss = fn(h, W, t, reduction)
            loss.backward()
            hr = h.detach().clone().requires_grad_(True)
            want = F.cross_entropy(hr @ W.detach().t(), t, reduction=reduction).sum()
            want.backward()
            torch.testing.assert_close(loss, want, rtol=1e-5, atol=1e-6)
            torch.testing.assert_close(h.grad, hr.grad, rtol=1e-5, atol=1e-6)


# ----------------------------------------------------------------------------------------------------
# CUDA


def on_a_side_stream_behind_a_sleep(fn):
    """fn() on a side stream behind a long sleep, its result once the stream is done. What fn computes its inputs from
    is written there, after the sleep: a kernel launched on any stream other than torch's current one would read
    them before they are there."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        torch.cuda._sleep(100_000_000)
        out = fn()
    side.synchronize()
    return out


def capture_cuda_graph(step, leaves):
    """Warms step() up twice on a side stream (allocations, library handles, lazy initialization outside the capture),
    then captures it in a CUDA graph with the leaves' gradients cleared. Returns the graph and what the captured step
    returned."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            for t in leaves:
                t.grad = None
            step()
    torch.cuda.current_stream().wait_stream(side)
    for t in leaves:
        t.grad = None
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()
    return graph, out


def assert_graph_replays_match_eager(graph, static_loss, leaves, refill, eager_loss):
    """Replays a graph of capture_cuda_graph twice, after refill(generator) rewrote its inputs in place (seeds 1 and
    2): the captured loss and the leaves' gradients against eager_loss(*fresh copies of the leaves) and its backward
    (a loss per token summed)."""
    for seed in (1, 2):
        gen = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            refill(gen)
        graph.replay()
        torch.cuda.synchronize()
        fresh = [t.detach().clone().requires_grad_(True) for t in leaves]
        want = eager_loss(*fresh)
        (want.sum() if want.dim() else want).backward()
        torch.testing.assert_close(static_loss, want.detach(), rtol=1e-5, atol=1e-5)
        for t, f in zip(leaves, fresh):
            torch.testing.assert_close(t.grad, f.grad, rtol=1e-4, atol=1e-5)


def extra_peak_memory(fn, *args, **kwargs):
    """The peak of allocated CUDA memory while fn(*args, **kwargs) runs, beyond what was allocated before it, in
    bytes."""
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    fn(*args, **kwargs)
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - base
