"""Vocabulary parallelism (logitless.cross_entropy / linear_cross_entropy with a process group or a DTensor):
every rank's loss and gradients against the unsharded call, with ranks spawned on the CPU (gloo; 2 and 3 ranks,
uneven and empty shards; 4 for FSDP2 over a tensor-parallel head) and on two GPUs (NCCL; skipped with fewer; four
for the 2-D case). Every option, every reduction, both
schedules, sequence parallelism, every token ignored, every target in the last shard, a weight whose storage is
replaced between forward and backward (as FSDP2 frees and regathers it), bad targets raised on every rank.

The ranks are spawned once per group size (a module fixture) and run one case per test; each case builds the same
global inputs on every rank from a seed, computes the unsharded reference locally and compares inside the rank.
"""
from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.distributed as dist

import logitless
from _ranks import spawn


@pytest.fixture(scope="module")
def gloo2():
    yield from spawn(2, "gloo", __name__)


@pytest.fixture(scope="module")
def gloo3():
    yield from spawn(3, "gloo", __name__)


@pytest.fixture(scope="module")
def gloo4():
    yield from spawn(4, "gloo", __name__)


@pytest.fixture(scope="module")
def nccl2():
    yield from spawn(2, "nccl", __name__)


@pytest.fixture(scope="module")
def nccl4():
    yield from spawn(4, "nccl", __name__)


# ----------------------------------------------------------------------------------------------------
# Inputs and checks, inside the ranks.

# Options by name: what each case passes to the loss (on top of the reduction).
PRESETS = {
    "plain": {},
    "ignore": {"ignore_index": -100},
    "ignore_in_range": {"ignore_index": 2},
    "smoothing": {"label_smoothing": 0.1},
    "z_loss": {"z_loss": 1e-2},
    "softcap": {"softcap": 4.0},
    "class_weight": {"weight": True},
    "all": {"label_smoothing": 0.05, "z_loss": 1e-2, "softcap": 8.0, "weight": True, "ignore_index": 2},
    "all_ignored": {"all_ignored": True},
    "targets_in_last_shard": {"last_shard": True},
}


def _device(world_device, rank):
    return torch.device(f"cuda:{rank}") if world_device == "cuda" else torch.device("cpu")


def _targets(n, v, preset, last_width, gen, device):
    opts = PRESETS[preset]
    ignore = opts.get("ignore_index", -100)
    t = torch.randint(0, v, (n,), generator=gen)
    if opts.get("last_shard"):
        t = torch.randint(v - last_width, v, (n,), generator=gen)
    t[0] = v - 1  # a target in the last class
    if ignore == 2:
        t[t == 2] = v - 1
    if "ignore_index" in opts or preset == "all":
        t[1::3] = ignore
    if opts.get("all_ignored"):
        t[:] = -100
    return t.to(device)


def _class_weight(v, gen, device):
    return (torch.rand(v, generator=gen) * 1.75 + 0.25).to(device)


def _tols(dtype, device):
    # CPU: the same float64 math either way, the partials rounded to float32 in between. CUDA: cuBLAS sums the
    # GEMMs of different shapes in different orders, and 16-bit gradients round at the last bit.
    if dtype == torch.float32:
        return (1e-5, 1e-6) if device.type == "cpu" else (2e-4, 2e-5)
    return (2e-2, 2e-2)


def _close(got, want, dtype, device, what):
    rtol, atol = _tols(dtype, device)
    got, want = got.detach().double().cpu(), want.detach().double().cpu()
    assert got.shape == want.shape, f"{what}: shape {tuple(got.shape)} vs {tuple(want.shape)}"
    scale = max(want.abs().max().item(), 1e-30) if want.numel() else 1.0
    err = (got - want).abs()
    bound = atol * scale + rtol * want.abs()
    assert torch.equal(got.isnan(), want.isnan()), f"{what}: NaN patterns differ"
    ok = (err <= bound) | want.isnan()
    assert bool(ok.all()), f"{what}: max error {err[~ok].max().item():.3g} (scale {scale:.3g})"


def _upstream(loss, gen, device):
    # A random upstream gradient: per row for reduction none, a scalar otherwise.
    return (torch.rand(loss.shape, generator=gen) + 0.5).to(device)


def _widths_of(rank, world, v):
    # torch.chunk's split (what a DTensor Shard places).
    chunk = -(-v // world)
    return [max(0, min(v, (r + 1) * chunk) - min(v, r * chunk)) for r in range(world)]


def _mesh(device, world):
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh(device.type, (world,))


# ----------------------------------------------------------------------------------------------------
# Case functions (run on every rank: first arguments rank, world).


def _ce_case(rank, world, dev, widths, dtype_name, preset, reduction, inplace, return_z, use_dtensor):
    device = _device(dev, rank)
    dtype = getattr(torch, dtype_name)
    v = sum(widths)
    if use_dtensor:
        widths = _widths_of(rank, world, v)
    off, width = sum(widths[:rank]), widths[rank]
    gen = torch.Generator().manual_seed(1234 + v)
    n = 11
    logits = (torch.randn(n, v, generator=gen) * 3).to(device, dtype)
    target = _targets(n, v, preset, [w for w in widths if w][-1], gen, device)
    opts = dict(PRESETS[preset])
    weight = _class_weight(v, gen, device) if opts.pop("weight", False) else None
    for k in ("all_ignored", "last_shard"):
        opts.pop(k, None)
    kw = dict(opts, reduction=reduction, return_lse=True, return_z_loss=return_z)

    x = logits.clone().requires_grad_(True)
    ref = logitless.cross_entropy(x * 1, target, weight, **kw)
    up = _upstream(ref[0], gen, device)
    (ref[0] * up).sum().backward()

    leaf = logits[:, off:off + width].clone().requires_grad_(True)
    if use_dtensor:
        from torch.distributed.tensor import Shard, distribute_tensor

        leaf = distribute_tensor(logits.clone(), _mesh(device, world), [Shard(1)]).requires_grad_(True)
        got = logitless.cross_entropy(leaf * 1, target, weight, inplace_backward=inplace, **kw)
    else:
        got = logitless.cross_entropy(leaf * 1, target, weight, inplace_backward=inplace,
                                      process_group=dist.group.WORLD, **kw)
    (got[0] * up).sum().backward()
    grad = leaf.grad.to_local() if use_dtensor else leaf.grad
    for name, a, b in zip(("loss", "lse", "z_loss"), got, ref):
        _close(a, b, torch.float32, device, name)
    _close(grad, x.grad[:, off:off + width], dtype, device, "grad_logits")
    if preset == "all_ignored" and reduction == "mean":
        assert float(got[0]) == 0.0 and not grad.any()


def _lce_case(rank, world, dev, widths, dtype_name, preset, reduction, schedule, sequence_parallel, bias,
              use_dtensor, lse_out, autocast=False):
    """autocast: float32 operands, both calls under torch.autocast(bfloat16), the reference being the one-device call
    there (bfloat16 products, float32 gradients)."""
    device = _device(dev, rank)
    dtype = getattr(torch, dtype_name)
    v = sum(widths)
    if use_dtensor:
        widths = _widths_of(rank, world, v)
    off, width = sum(widths[:rank]), widths[rank]
    gen = torch.Generator().manual_seed(4321 + v)
    n, h = 12, 16
    hidden = torch.randn(n, h, generator=gen).to(device, dtype)
    weight = (torch.randn(v, h, generator=gen) * (2.0 / math.sqrt(h))).to(device, dtype)
    b = (torch.randn(v, generator=gen) * 0.5).to(device, dtype) if bias else None
    target = _targets(n, v, preset, [w for w in widths if w][-1], gen, device)
    opts = dict(PRESETS[preset])
    class_weight = _class_weight(v, gen, device) if opts.pop("weight", False) else None
    for k in ("all_ignored", "last_shard"):
        opts.pop(k, None)
    kw = dict(opts, reduction=reduction, schedule=schedule, class_weight=class_weight, return_lse=lse_out)
    ac = torch.autocast(device.type, dtype=torch.bfloat16, enabled=autocast)

    hx, wx = hidden.clone().requires_grad_(True), weight.clone().requires_grad_(True)
    bx = b.clone().requires_grad_(True) if bias else None
    with ac:
        ref = logitless.linear_cross_entropy(hx, wx, target, bx, **kw)
    ref_loss, ref_lse = ref if lse_out else (ref, None)
    if autocast:  # the reference's bfloat16 products are told apart from float32 ones at lse's tolerance
        assert lse_out, "lse tells the products' dtype apart"
        _, f32_lse = logitless.linear_cross_entropy(hx.detach(), wx.detach(), target, b, **kw)
        with pytest.raises(AssertionError):
            _close(f32_lse, ref_lse, torch.float32, device, "lse")
    up = _upstream(ref_loss, gen, device)
    (ref_loss * up).sum().backward()

    rows = slice(None)
    if sequence_parallel:
        per = n // world
        rows = slice(rank * per, (rank + 1) * per)
    hl = hidden[rows].clone().requires_grad_(True)
    if use_dtensor:
        from torch.distributed.tensor import Shard, distribute_tensor

        mesh = _mesh(device, world)
        wl = distribute_tensor(weight.clone(), mesh, [Shard(0)]).requires_grad_(True)
        bl = distribute_tensor(b.clone(), mesh, [Shard(0)]).requires_grad_(True) if bias else None
        with ac:
            got = logitless.linear_cross_entropy(hl, wl, target[rows], bl, vocab_parallel=True,
                                                 sequence_parallel=sequence_parallel, **kw)
    else:
        wl = weight[off:off + width].clone().requires_grad_(True)
        bl = b[off:off + width].clone().requires_grad_(True) if bias else None
        with ac:
            got = logitless.linear_cross_entropy(hl, wl, target[rows], bl, process_group=dist.group.WORLD,
                                                 sequence_parallel=sequence_parallel, **kw)
    loss, lse = got if lse_out else (got, None)
    if autocast:  # a call that needs no gradient takes the forward alone, under autocast as well
        with ac, torch.no_grad():
            again = logitless.linear_cross_entropy(hl, wl, target[rows], bl, vocab_parallel=use_dtensor,
                                                   process_group=None if use_dtensor else dist.group.WORLD,
                                                   sequence_parallel=sequence_parallel, **kw)
        _close(again[0] if lse_out else again, loss, torch.float32, device, "loss without gradients")
    up_local = up[rows] if (reduction == "none" and sequence_parallel) else up
    (loss * up_local).sum().backward()

    _close(loss, ref_loss[rows] if reduction == "none" else ref_loss, torch.float32, device, "loss")
    if lse_out:
        _close(lse, ref_lse[rows], torch.float32, device, "lse")
    local = (lambda g: g.to_local()) if use_dtensor else (lambda g: g)
    if autocast:  # the gradients of float32 arguments, in float32; on CUDA from bfloat16 products on both sides
        assert hl.grad.dtype == local(wl.grad).dtype == torch.float32
        dtype = torch.float32 if device.type == "cpu" else torch.bfloat16
    _close(hl.grad, hx.grad[rows], dtype, device, "grad_hidden")
    _close(local(wl.grad), wx.grad[off:off + width], dtype, device, "grad_weight")
    if bias:
        _close(local(bl.grad), bx.grad[off:off + width], dtype, device, "grad_bias")


def _regathered_weight_case(rank, world, dev, schedule, how, autocast=False):
    """The weight's storage is replaced between forward and backward (FSDP2 frees the unsharded weight after the
    forward and regathers it, into new memory, for the backward): the backward must read the new storage (under
    autocast too, where the forward's products read a bfloat16 copy)."""
    device = _device(dev, rank)
    widths = [9, 14, 0][:world] if world == 3 else [9, 14]
    v = sum(widths)
    off, width = sum(widths[:rank]), widths[rank]
    gen = torch.Generator().manual_seed(99)
    n, h = 10, 8
    hidden = torch.randn(n, h, generator=gen).to(device)
    weight = (torch.randn(v, h, generator=gen) * 0.5).to(device)
    target = torch.randint(0, v, (n,), generator=gen).to(device)
    ac = torch.autocast(device.type, dtype=torch.bfloat16, enabled=autocast)
    hx, wx = hidden.clone().requires_grad_(True), weight.clone().requires_grad_(True)
    with ac:
        ref = logitless.linear_cross_entropy(hx, wx, target, schedule=schedule)
    ref.backward()

    hl = hidden.clone().requires_grad_(True)
    wl = weight[off:off + width].clone().requires_grad_(True)
    with ac:
        loss = logitless.linear_cross_entropy(hl, wl, target, schedule=schedule, process_group=dist.group.WORLD)
    values = wl.detach().clone()
    if how == "resize":  # FSDP2's way: the same tensor, its storage freed and allocated anew
        storage = wl.untyped_storage()
        nbytes = storage.nbytes()
        storage.resize_(0)
        storage.resize_(nbytes)
        wl.data.copy_(values)
    else:  # new storage under the same tensor, the old one poisoned
        old = wl.data
        wl.data = values.clone()
        old.fill_(float("nan"))
    loss.backward()
    gdt = torch.bfloat16 if autocast and device.type == "cuda" else torch.float32
    _close(hl.grad, hx.grad, gdt, device, "grad_hidden")
    _close(wl.grad, wx.grad[off:off + width], gdt, device, "grad_weight")


def _tiny_llama_twins(device, sequences):
    """A tiny untied Llama, a copy of it, and a batch of `sequences` x 24 tokens with their labels (the first 4 of
    each sequence ignored), the same on every rank."""
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(vocab_size=389, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                      tie_word_embeddings=False)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).to(device)
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 389, (sequences, 24), generator=gen).to(device)
    labels = ids.clone()
    labels[:, :4] = -100
    return model, copy.deepcopy(model), ids, labels


def _patched_tp_head_case(rank, world, dev, style, autocast):
    """A Hugging Face model patched with vocab_parallel=True whose lm_head torch's tensor parallelism shards along the
    vocabulary (ColwiseParallel: its input hook makes the hidden states a DTensor, its output hook takes the head's
    output for sharded logits, to unwrap, gather or keep), against the same model patched on one process."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module

    device = _device(dev, rank)
    ref, tp, ids, labels = _tiny_llama_twins(device, 2)
    ac = torch.autocast(device.type, dtype=torch.bfloat16, enabled=autocast)
    logitless.patch(ref)
    with ac:
        want = ref(input_ids=ids, labels=labels).loss
    want.backward()
    styles = {"default": ColwiseParallel(), "replicated": ColwiseParallel(output_layouts=Replicate()),
              "dtensor": ColwiseParallel(output_layouts=Shard(-1), use_local_output=False)}
    parallelize_module(tp, _mesh(device, world), {"lm_head": styles[style]})
    logitless.patch(tp, vocab_parallel=True)
    with ac:
        out = tp(input_ids=ids, labels=labels)
    out.loss.backward()
    assert getattr(out, "logits", None) is None
    _close(out.loss, want, torch.float32, device, "loss")
    _close(tp.lm_head.weight.grad.full_tensor(), ref.lm_head.weight.grad, torch.float32, device, "lm_head grad")
    # Under autocast on a GPU the body's backward runs bf16 products: grad_hidden's last-bit differences (the
    # shards' sums against one GEMM's) flip roundings there, so the embedding gradient agrees to bf16's precision.
    body = torch.bfloat16 if autocast and device.type == "cuda" else torch.float32
    _close(tp.model.embed_tokens.weight.grad, ref.model.embed_tokens.weight.grad, body, device, "embed grad")
    with torch.no_grad():  # without labels the head is the head: its logits as the style lays them out
        logits = tp(input_ids=ids).logits
        full = ref(input_ids=ids).logits
    if style == "dtensor":
        logits = logits.full_tensor()
    elif style == "default":  # each rank's own columns (torch.chunk's split)
        widths = _widths_of(rank, world, 389)
        full = full[..., sum(widths[:rank]):sum(widths[:rank + 1])]
    _close(logits, full, full.dtype, device, "logits")


def _tp_head_loss_case(rank, world, dev, style, reduction, schedule):
    """logitless.linear_head_loss(head, linear_cross_entropy, ..., vocab_parallel=True) on an nn.Linear that torch's
    ColwiseParallel shards along the vocabulary (its output hook gets a stand-in in the layout it asks for), against
    linear_cross_entropy of the whole head on one process: the loss (and lse, a tuple's second element), grad_hidden
    and the weight's and bias's gradients. A NaN row's loss stays in its row."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module

    device = _device(dev, rank)
    n, h, v = 40, 24, 389
    gen = torch.Generator().manual_seed(3)
    ref = torch.nn.Linear(h, v).to(device)
    with torch.no_grad():
        ref.weight.copy_(torch.randn(v, h, generator=gen))
        ref.bias.copy_(torch.randn(v, generator=gen))
    head = copy.deepcopy(ref)
    styles = {"default": ColwiseParallel(), "replicated": ColwiseParallel(output_layouts=Replicate()),
              "dtensor": ColwiseParallel(output_layouts=Shard(-1), use_local_output=False)}
    parallelize_module(head, _mesh(device, world), styles[style])
    hidden = torch.randn(n, h, generator=gen).to(device)
    target = torch.randint(0, v, (n,), generator=gen)
    target[:3] = -100
    target = target.to(device)
    opts = dict(reduction=reduction, schedule=schedule, return_lse=True)
    h_ref, h_tp = hidden.clone().requires_grad_(True), hidden.clone().requires_grad_(True)
    want, want_lse = logitless.linear_cross_entropy(h_ref, ref.weight, target, ref.bias, **opts)
    got, got_lse = logitless.linear_head_loss(head, logitless.linear_cross_entropy, h_tp, target, vocab_parallel=True,
                                              **opts)
    assert type(got) is torch.Tensor and type(got_lse) is torch.Tensor
    up = _upstream(want, gen, device)
    (want * up).sum().backward()
    (got * up).sum().backward()
    _close(got, want, torch.float32, device, "loss")
    _close(got_lse, want_lse, torch.float32, device, "lse")
    _close(h_tp.grad, h_ref.grad, torch.float32, device, "grad_hidden")
    _close(head.weight.grad.full_tensor(), ref.weight.grad, torch.float32, device, "grad_weight")
    _close(head.bias.grad.full_tensor(), ref.bias.grad, torch.float32, device, "grad_bias")
    if reduction == "none":  # the stand-in holds the losses' sum, NaN here: nothing of it reaches the rows
        hidden[5] = float("nan")
        got, _ = logitless.linear_head_loss(head, logitless.linear_cross_entropy, hidden.requires_grad_(True), target,
                                            vocab_parallel=True, **opts)
        assert bool(got[5].isnan()) and bool(got[torch.arange(n, device=device) != 5].isfinite().all())


def _fsdp_tp_head_case(rank, world, dev):
    """2-D parallelism on four ranks: the lm_head sharded along the vocabulary over a "tp" mesh dimension
    (ColwiseParallel), the model patched with vocab_parallel=True, then FSDP2 over "dp" (each decoder layer and the
    root); each dp rank trains on its half of the batch. Against one process's patched model over the whole batch:
    each half's loss, and every gradient (FSDP2 averages them over dp)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module

    device = _device(dev, rank)
    # As many tokens in each sequence: the mean of the halves' means is the batch's.
    ref, model, ids, labels = _tiny_llama_twins(device, 4)
    logitless.patch(ref)
    ref(input_ids=ids, labels=labels).loss.backward()
    mesh = init_device_mesh(device.type, (2, world // 2), mesh_dim_names=("dp", "tp"))
    parallelize_module(model, mesh["tp"], {"lm_head": ColwiseParallel()})
    logitless.patch(model, vocab_parallel=True)
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh["dp"])
    fully_shard(model, mesh=mesh["dp"])
    half = slice(2 * mesh["dp"].get_local_rank(), 2 * mesh["dp"].get_local_rank() + 2)
    loss = model(input_ids=ids[half], labels=labels[half]).loss
    loss.backward()
    with torch.no_grad():
        want = ref(input_ids=ids[half], labels=labels[half]).loss
    _close(loss, want, torch.float32, device, "loss")
    grads = dict(ref.named_parameters())
    for name, p in model.named_parameters():
        _close(p.grad.full_tensor(), grads[name].grad, torch.float32, device, name)


def _bad_target_case(rank, world, dev, linear):
    device = _device(dev, rank)
    widths = [5, 7, 0][:world] if world == 3 else [5, 7]  # V = 12
    width = widths[rank]
    target = torch.tensor([3, 11, 12, -100], device=device)  # 12 is outside [0, 12) on every rank
    with pytest.raises(ValueError, match=r"expected values in \[0, 12\).*row 2"):
        if linear:
            logitless.linear_cross_entropy(torch.randn(4, 6, device=device),
                                           torch.randn(width, 6, device=device), target,
                                           process_group=dist.group.WORLD)
        else:
            logitless.cross_entropy(torch.randn(4, width, device=device), target, process_group=dist.group.WORLD)
    # The group still works afterwards: every rank raised before any exchange.
    t = torch.ones(1, device=device)
    dist.all_reduce(t)
    assert float(t) == world


def _dtensor_leaf_inplace_case(rank, world, dev):
    """inplace_backward=True on a DTensor that is a leaf (a parameter) is refused, and the parameter is unchanged:
    its local shard is not a leaf, but it is the parameter's storage."""
    from torch.distributed.tensor import Shard, distribute_tensor

    device = _device(dev, rank)
    leaf = distribute_tensor(torch.randn(4, 6, device=device), _mesh(device, world), [Shard(1)]).requires_grad_(True)
    before = leaf.to_local().detach().clone()
    target = torch.tensor([0, 5, 2, 3], device=device)
    with pytest.raises(ValueError, match="logits: inplace_backward=True needs logits computed by an op"):
        logitless.cross_entropy(leaf, target, inplace_backward=True)
    assert torch.equal(leaf.to_local().detach(), before)


def _no_tokens_case(rank, world, dev, schedule):
    device = _device(dev, rank)
    widths = [3, 4, 2][:world] if world == 3 else [3, 4]
    width = widths[rank]
    hl = torch.randn(0, 5, device=device, requires_grad=True)
    wl = torch.randn(width, 5, device=device, requires_grad=True)
    loss = logitless.linear_cross_entropy(hl, wl, torch.zeros(0, dtype=torch.long, device=device), schedule=schedule,
                                          process_group=dist.group.WORLD)
    loss.backward()
    assert float(loss) == 0.0 and hl.grad.shape == (0, 5) and not wl.grad.any()


# ----------------------------------------------------------------------------------------------------
# Tests on the CPU (gloo).

CE_PRESETS = ["plain", "ignore", "ignore_in_range", "smoothing", "z_loss", "softcap", "class_weight", "all",
              "all_ignored", "targets_in_last_shard"]


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("preset", CE_PRESETS)
def test_cross_entropy_two_ranks(gloo2, preset, reduction):
    gloo2.run("_ce_case", "cpu", [17, 20], "float32", preset, reduction, False, True, False)


@pytest.mark.parametrize("preset", ["all", "targets_in_last_shard", "all_ignored"])
@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_cross_entropy_three_uneven_ranks_with_an_empty_shard(gloo3, preset, reduction):
    gloo3.run("_ce_case", "cpu", [4, 0, 33], "float32", preset, reduction, False, True, False)


@pytest.mark.parametrize("world", [2, 3])
def test_cross_entropy_inplace_backward(gloo2, gloo3, world):
    ranks = gloo2 if world == 2 else gloo3
    ranks.run("_ce_case", "cpu", [20, 7, 10][:world], "float32", "all", "mean", True, False, False)


def test_cross_entropy_bfloat16(gloo2):
    gloo2.run("_ce_case", "cpu", [30, 7], "bfloat16", "all", "sum", False, False, False)


@pytest.mark.parametrize("world", [2, 3])
def test_cross_entropy_dtensor_logits(gloo2, gloo3, world):
    (gloo2 if world == 2 else gloo3).run("_ce_case", "cpu", [37], "float32", "all", "mean", False, True, True)


LCE_PRESETS = ["plain", "ignore", "smoothing", "z_loss", "softcap", "class_weight", "all", "all_ignored",
               "targets_in_last_shard"]


@pytest.mark.parametrize("schedule", ["gradient_in_forward", "recompute"])
@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("preset", LCE_PRESETS)
def test_linear_cross_entropy_two_ranks(gloo2, preset, reduction, schedule):
    gloo2.run("_lce_case", "cpu", [13, 16], "float32", preset, reduction, schedule, False, preset == "all", False,
              True)


@pytest.mark.parametrize("preset", ["plain", "all"])
def test_linear_cross_entropy_reduction_none(gloo2, preset):
    gloo2.run("_lce_case", "cpu", [13, 16], "float32", preset, "none", "auto", False, True, False, True)


@pytest.mark.parametrize("schedule", ["gradient_in_forward", "recompute"])
@pytest.mark.parametrize("preset", ["all", "targets_in_last_shard", "all_ignored"])
def test_linear_cross_entropy_three_uneven_ranks_with_an_empty_shard(gloo3, preset, schedule):
    gloo3.run("_lce_case", "cpu", [2, 25, 0], "float32", preset, "mean", schedule, False, True, False, True)


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("reduction,schedule", [("mean", "gradient_in_forward"), ("sum", "recompute"),
                                                ("none", "recompute")])
def test_linear_cross_entropy_sequence_parallel(gloo2, gloo3, world, reduction, schedule):
    (gloo2 if world == 2 else gloo3).run("_lce_case", "cpu", [11, 9, 5][:world], "float32", "all", reduction,
                                         schedule, True, True, False, True)


@pytest.mark.parametrize("schedule", ["gradient_in_forward", "recompute"])
def test_linear_cross_entropy_dtensor_weight(gloo3, schedule):
    # 29 classes over 3 ranks: torch.chunk's split 10, 10, 9.
    gloo3.run("_lce_case", "cpu", [29], "float32", "all", "mean", schedule, False, True, True, True)


@pytest.mark.parametrize("schedule", ["gradient_in_forward", "recompute"])
def test_linear_cross_entropy_under_autocast(gloo2, gloo3, schedule):
    # Float32 hidden, weight and bias under autocast(bfloat16): bfloat16 products, float32 gradients, as on one
    # device; with sequence parallelism (3 ranks) and a DTensor weight too.
    gloo2.run("_lce_case", "cpu", [13, 16], "float32", "all", "mean", schedule, False, True, False, True, True)
    gloo3.run("_lce_case", "cpu", [11, 9, 5], "float32", "all", "sum", schedule, True, True, False, True, True)
    gloo3.run("_lce_case", "cpu", [29], "float32", "plain", "mean", schedule, False, False, True, True, True)
    gloo3.run("_regathered_weight_case", "cpu", schedule, "replace", True)


def test_linear_cross_entropy_bfloat16(gloo2):
    gloo2.run("_lce_case", "cpu", [21, 20], "bfloat16", "all", "mean", "gradient_in_forward", False, True, False,
              False)


@pytest.mark.parametrize("style", ["default", "replicated", "dtensor"])
def test_patched_model_with_a_tensor_parallel_head(gloo2, style):
    gloo2.run("_patched_tp_head_case", "cpu", style, False)
    gloo2.run("_patched_tp_head_case", "cpu", style, True)


@pytest.mark.parametrize("style", ["default", "replicated", "dtensor"])
def test_linear_head_loss_with_a_tensor_parallel_head(gloo2, style):
    gloo2.run("_tp_head_loss_case", "cpu", style, "mean", "gradient_in_forward")
    gloo2.run("_tp_head_loss_case", "cpu", style, "none", "recompute")


def test_fsdp_over_a_tensor_parallel_head(gloo4):
    gloo4.run("_fsdp_tp_head_case", "cpu")


@pytest.mark.parametrize("how", ["resize", "replace"])
@pytest.mark.parametrize("schedule", ["gradient_in_forward", "recompute"])
def test_weight_regathered_between_forward_and_backward(gloo3, schedule, how):
    gloo3.run("_regathered_weight_case", "cpu", schedule, how)


@pytest.mark.parametrize("linear", [False, True])
def test_bad_target_raises_on_every_rank(gloo3, linear):
    gloo3.run("_bad_target_case", "cpu", linear)


def test_inplace_on_a_dtensor_leaf_is_refused(gloo2):
    gloo2.run("_dtensor_leaf_inplace_case", "cpu")


@pytest.mark.parametrize("schedule", ["gradient_in_forward", "recompute"])
def test_no_tokens(gloo2, schedule):
    gloo2.run("_no_tokens_case", "cpu", schedule)


def test_sequence_parallel_needs_a_group():
    with pytest.raises(ValueError, match="sequence_parallel"):
        logitless.linear_cross_entropy(torch.randn(2, 3), torch.randn(4, 3), torch.tensor([0, 1]),
                                       sequence_parallel=True)


# ----------------------------------------------------------------------------------------------------
# The same on two GPUs (NCCL).


@pytest.mark.parametrize("reduction", ["mean", "none"])
@pytest.mark.parametrize("preset", CE_PRESETS)
def test_cuda_cross_entropy(nccl2, preset, reduction):
    nccl2.run("_ce_case", "cuda", [1000, 3001], "bfloat16", preset, reduction, False, True, False)
    nccl2.run("_ce_case", "cuda", [1000, 3001], "float32", preset, reduction, reduction != "none", True, False)


def test_cuda_cross_entropy_dtensor(nccl2):
    nccl2.run("_ce_case", "cuda", [4001], "float32", "all", "mean", False, True, True)


@pytest.mark.parametrize("schedule", ["gradient_in_forward", "recompute"])
@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("preset", LCE_PRESETS)
def test_cuda_linear_cross_entropy(nccl2, preset, reduction, schedule):
    for dtype in ("float32", "bfloat16"):
        nccl2.run("_lce_case", "cuda", [700, 1301], dtype, preset, reduction, schedule, False, True, False, True)


@pytest.mark.parametrize("reduction,schedule", [("mean", "gradient_in_forward"), ("none", "recompute")])
def test_cuda_linear_cross_entropy_sequence_parallel_and_dtensor(nccl2, reduction, schedule):
    nccl2.run("_lce_case", "cuda", [700, 1301], "bfloat16", "all", reduction, schedule, True, True, False, True)
    nccl2.run("_lce_case", "cuda", [2001], "float32", "all", reduction, schedule, False, True, True, True)


@pytest.mark.parametrize("schedule", ["gradient_in_forward", "recompute"])
def test_cuda_linear_cross_entropy_under_autocast(nccl2, schedule):
    nccl2.run("_lce_case", "cuda", [700, 1301], "float32", "all", "mean", schedule, False, True, False, True, True)
    nccl2.run("_lce_case", "cuda", [700, 1301], "float32", "plain", "sum", schedule, True, False, False, True, True)
    nccl2.run("_lce_case", "cuda", [2001], "float32", "plain", "mean", schedule, False, True, True, True, True)
    nccl2.run("_regathered_weight_case", "cuda", schedule, "resize", True)


def test_cuda_patched_model_with_a_tensor_parallel_head(nccl2):
    nccl2.run("_patched_tp_head_case", "cuda", "default", False)
    nccl2.run("_patched_tp_head_case", "cuda", "replicated", True)


def test_cuda_fsdp_over_a_tensor_parallel_head(nccl4):
    nccl4.run("_fsdp_tp_head_case", "cuda")


def test_cuda_linear_head_loss_with_a_tensor_parallel_head(nccl2):
    nccl2.run("_tp_head_loss_case", "cuda", "default", "mean", "gradient_in_forward")
    nccl2.run("_tp_head_loss_case", "cuda", "replicated", "none", "recompute")


@pytest.mark.parametrize("schedule", ["gradient_in_forward", "recompute"])
def test_cuda_weight_regathered_and_bad_target(nccl2, schedule):
    nccl2.run("_regathered_weight_case", "cuda", schedule, "resize")
    nccl2.run("_regathered_weight_case", "cuda", schedule, "replace")
    nccl2.run("_bad_target_case", "cuda", schedule == "recompute")
    nccl2.run("_no_tokens_case", "cuda", schedule)
