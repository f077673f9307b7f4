"""A patched Hugging Face model under FSDP2 (``fully_shard``) and DeepSpeed ZeRO-3, data parallel over two ranks: the
loss and every parameter's gradient against one process running the unpatched model over the whole batch.

The wrappings a user picks: the head in a unit of its own (alone, or with the final norm), every decoder layer and
the root, or the whole model only; tied and untied embeddings; the weights resharded after the forward or kept;
float32 or bf16 parameters, and float32 parameters under a bf16 mixed-precision policy with float32 gradient
reduction. A head wrapped on its own must be reached through its module: read directly, its weight is a
``Shard(0)`` DTensor that the fused loss would otherwise take for vocabulary parallelism over ranks that hold
other tokens (every gradient wrong); ZeRO-3 leaves a parameter empty outside its module's forward. Ranks are
spawned on the CPU (gloo) and on two GPUs (NCCL; skipped with fewer; ZeRO-3 there only, where deepspeed imports).
"""
from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist

import logitless
from _ranks import spawn

transformers = pytest.importorskip("transformers")

_SEQS_PER_RANK, _SEQ = 2, 24


@pytest.fixture(scope="module")
def gloo2():
    yield from spawn(2, "gloo", __name__)


@pytest.fixture(scope="module")
def nccl2():
    yield from spawn(2, "nccl", __name__)


# ----------------------------------------------------------------------------------------------------
# Inside the ranks.


def _model(tied: bool, dtype: torch.dtype, device: torch.device):
    config = transformers.LlamaConfig(vocab_size=389, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                      tie_word_embeddings=tied)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).to(device=device, dtype=dtype)
    with torch.no_grad():  # every rank starts from rank 0's values, whatever the initializers drew
        for p in model.parameters():
            dist.broadcast(p, src=0)
    return model


def _batch(world: int, vocab: int, device: torch.device):
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, vocab, (world * _SEQS_PER_RANK, _SEQ), generator=g)
    labels = ids.clone()
    labels[:, :4] = -100  # the same count per sequence: the mean of the ranks' means is the global mean
    return ids.to(device), labels.to(device)


def _shard(model, wrap: str, reshard: bool, mixed: bool, device_type: str, world: int):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if mixed else \
        MixedPrecisionPolicy()
    kw = dict(mesh=init_device_mesh(device_type, (world,)), reshard_after_forward=reshard, mp_policy=mp)
    if wrap != "root":
        for layer in model.model.layers:
            fully_shard(layer, **kw)
    if wrap == "head":
        fully_shard(model.lm_head, **kw)
    elif wrap == "head_norm":
        fully_shard([model.model.norm, model.lm_head], **kw)
    fully_shard(model, **kw)


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    got, want = got.double(), want.double()
    return float((got - want).norm() / want.norm().clamp_min(1e-30))


def _fsdp_case(rank, world, dev, wrap, tied, reshard, precision):
    device = torch.device(f"cuda:{rank}") if dev == "cuda" else torch.device("cpu")
    # "mixed": float32 parameters, bf16 compute under the policy; the reference computes with bf16 parameters.
    param_dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "mixed": torch.float32}[precision]
    compute_dtype = torch.float32 if precision == "float32" else torch.bfloat16
    model = _model(tied, param_dtype, device)
    reference = copy.deepcopy(model).to(compute_dtype)
    ids, labels = _batch(world, model.config.vocab_size, device)

    ref_loss = reference(input_ids=ids, labels=labels).loss
    ref_loss.backward()
    ref_grads = {name: p.grad for name, p in reference.named_parameters()}

    logitless.patch(model)
    _shard(model, wrap, reshard, precision == "mixed", dev, world)
    rows = slice(rank * _SEQS_PER_RANK, (rank + 1) * _SEQS_PER_RANK)
    loss = model(input_ids=ids[rows], labels=labels[rows]).loss
    loss.backward()

    mean_loss = loss.detach().float().clone()
    dist.all_reduce(mean_loss)
    mean_loss /= world
    tol = 2e-4 if precision == "float32" else 3e-2
    errors = {"loss": _rel(mean_loss, ref_loss.detach().float())}
    for name, p in model.named_parameters():
        assert p.grad is not None, f"{name}: no gradient"
        errors[name] = _rel(p.grad.full_tensor(), ref_grads[name])
    bad = {k: v for k, v in errors.items() if not v <= tol}
    assert not bad, f"relative errors above {tol}: {bad}"
    assert set(errors) - {"loss"} == set(ref_grads), "a parameter of the reference has no counterpart"
    if rank == 0:  # seen with pytest -s: the figures for the record
        print(f"fsdp2 {dev} wrap={wrap} tied={tied} reshard={reshard} {precision}: loss rel err {errors['loss']:.1e}, "
              f"largest gradient rel err {max(errors.values()):.1e}", flush=True)
    return max(errors.values())


def _zero3_case(rank, world, dev, tied):
    """DeepSpeed ZeRO-3 (bf16, parameters partitioned over the ranks): the same comparison as _fsdp_case."""
    import os

    import deepspeed

    os.environ.setdefault("LOCAL_RANK", str(rank))
    device = torch.device(f"cuda:{rank}")
    model = _model(tied, torch.bfloat16, device)
    reference = copy.deepcopy(model)
    ids, labels = _batch(world, model.config.vocab_size, device)
    ref_loss = reference(input_ids=ids, labels=labels).loss
    ref_loss.backward()
    ref_grads = {name: p.grad for name, p in reference.named_parameters()}

    logitless.patch(model)
    config = {"train_micro_batch_size_per_gpu": _SEQS_PER_RANK, "gradient_accumulation_steps": 1,
              "zero_allow_untested_optimizer": True, "bf16": {"enabled": True},
              "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}}
    engine, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.0),
                                      config=config)
    rows = slice(rank * _SEQS_PER_RANK, (rank + 1) * _SEQS_PER_RANK)
    loss = engine(input_ids=ids[rows], labels=labels[rows]).loss
    engine.backward(loss)
    mean_loss = loss.detach().float().clone()
    dist.all_reduce(mean_loss)
    mean_loss /= world
    errors = {"loss": _rel(mean_loss, ref_loss.detach().float())}
    for name, p in engine.module.named_parameters():
        grad = deepspeed.utils.safe_get_full_grad(p)
        assert grad is not None, f"{name}: no gradient"
        errors[name] = _rel(grad, ref_grads[name])
    bad = {k: v for k, v in errors.items() if not v <= 3e-2}
    assert not bad, f"relative errors above 3e-2: {bad}"
    if rank == 0:
        print(f"zero3 tied={tied}: loss rel err {errors['loss']:.1e}, largest gradient rel err "
              f"{max(errors.values()):.1e}", flush=True)
    return max(errors.values())


def _refused_case(rank, world, dev):
    """A DTensor weight reaching the loss directly (an FSDP2 shard read outside the head's call) is refused with
    both readings named; vocab_parallel=True takes it for tensor parallelism."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    device = torch.device(f"cuda:{rank}") if dev == "cuda" else torch.device("cpu")
    mesh = init_device_mesh(dev, (world,))
    weight = distribute_tensor(torch.randn(10, 8, device=device), mesh, [Shard(0)])
    hidden, target = torch.randn(5, 8, device=device), torch.randint(0, 10, (5,), device=device)
    for fn, args in ((logitless.linear_cross_entropy, (target,)),
                     (logitless.linear_selective_log_softmax, (target,))):
        with pytest.raises(ValueError, match=r"weight: got a DTensor.*fully_shard.*tensor-parallel"):
            fn(hidden, weight, *args)
    full = weight.full_tensor()
    want = logitless.linear_cross_entropy(hidden, full, target)
    got = logitless.linear_cross_entropy(hidden, weight, target, vocab_parallel=True)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="vocab_parallel: expected a DTensor weight"):
        logitless.linear_cross_entropy(hidden, full, target, vocab_parallel=True)


def _head_loss_case(rank, world, dev, loss_name):
    """logitless.linear_head_loss through a head wrapped alone: the policy losses get the gathered weight, and
    the head's gradient is reduced over the ranks (each rank holds other tokens)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    device = torch.device(f"cuda:{rank}") if dev == "cuda" else torch.device("cpu")
    torch.manual_seed(0)
    head = torch.nn.Linear(16, 37, bias=True, device=device)
    with torch.no_grad():
        for p in head.parameters():
            dist.broadcast(p, src=0)
    reference = copy.deepcopy(head)
    g = torch.Generator().manual_seed(2)
    hidden = torch.randn(world, 3, 6, 16, generator=g).to(device)
    ids = torch.randint(0, 37, (world, 3, 5), generator=g).to(device)
    adv = torch.randn(world, 3, generator=g).to(device)

    def run(module, h, i, a):
        h = h.clone().requires_grad_(True)
        if loss_name == "grpo":
            loss = logitless.linear_head_loss(module, logitless.linear_grpo_loss, h, i, a, beta=0.0)
        elif loss_name == "selective_log_softmax":
            loss = logitless.linear_head_loss(module, logitless.linear_selective_log_softmax, h[:, :-1], i).mean()
        else:
            loss = logitless.linear_head_loss(module, logitless.linear_cross_entropy, h[:, :-1], i)
        loss.backward()
        return loss.detach(), h.grad

    losses, grads = zip(*(run(reference, hidden[r], ids[r], adv[r]) for r in range(world)))
    fully_shard(head, mesh=init_device_mesh(dev, (world,)))
    loss, grad_hidden = run(head, hidden[rank], ids[rank], adv[rank])
    torch.testing.assert_close(loss, losses[rank], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(grad_hidden, grads[rank], rtol=1e-5, atol=1e-6)
    # FSDP2 averages the ranks' gradients; the reference summed them over its `world` calls.
    for name, p in head.named_parameters():
        want = dict(reference.named_parameters())[name].grad / world
        torch.testing.assert_close(p.grad.full_tensor(), want, rtol=1e-5, atol=1e-6)


# ----------------------------------------------------------------------------------------------------
# On the CPU (gloo): the wrappings that read the head, both reshard settings, float32 and mixed precision.


@pytest.mark.parametrize("wrap,tied,reshard,precision", [
    ("head", False, True, "float32"),
    ("head", False, False, "mixed"),
    ("head_norm", False, True, "float32"),
    ("root", True, True, "float32"),
    ("layers", True, False, "float32"),
])
def test_patched_model_matches_one_process(gloo2, wrap, tied, reshard, precision):
    gloo2.run("_fsdp_case", "cpu", wrap, tied, reshard, precision)


def test_dtensor_weight_is_refused_without_vocab_parallel(gloo2):
    gloo2.run("_refused_case", "cpu")


@pytest.mark.parametrize("loss_name", ["cross_entropy", "grpo", "selective_log_softmax"])
def test_linear_head_loss_through_a_sharded_head(gloo2, loss_name):
    gloo2.run("_head_loss_case", "cpu", loss_name)


def test_patch_after_sharding_is_refused(gloo2):
    gloo2.run("_patch_after_sharding_case", "cpu")


def test_trl_models_sharded_before_use_logitless(gloo2):
    gloo2.run("_trl_sharded_case", "cpu")


def test_through_module_calls_directly_without_hooks():
    head = torch.nn.Linear(4, 3)
    assert logitless.through_module(head, lambda x: x + 1, torch.zeros(2)).tolist() == [1.0, 1.0]
    assert "forward" not in head.__dict__
    seen = []
    head.register_forward_pre_hook(lambda m, args: seen.append(args[0].shape))
    out = logitless.through_module(head, lambda x: x * 2, torch.ones(5))
    assert seen == [torch.Size([5])] and out.tolist() == [2.0] * 5
    assert "forward" not in head.__dict__  # put back after the call
    assert head(torch.ones(2, 4)).shape == (2, 3)


def _patch_after_sharding_case(rank, world, dev):
    """Patched after fully_shard, the replacement norms would hold the shards (the wrapper gathers into the modules
    it wrapped): refused, naming the remedy, the model unchanged; the loss alone (rms_norm=False) still patches,
    and matches the unpatched model over the whole batch."""
    device = torch.device("cpu")
    model = _model(False, torch.float32, device)
    reference = copy.deepcopy(model)
    ids, labels = _batch(world, model.config.vocab_size, device)
    want = reference(input_ids=ids, labels=labels).loss
    want.backward()
    _shard(model, "layers", True, False, dev, world)
    with pytest.raises(logitless.hf.PatchRefused, match=r"already sharded \(fully_shard at the model itself\).*patch "
                       r"before sharding, or pass rms_norm=False"):
        logitless.patch(model)
    assert not logitless.hf.is_patched(model)
    logitless.patch(model, rms_norm=False)
    rows = slice(rank * _SEQS_PER_RANK, (rank + 1) * _SEQS_PER_RANK)
    loss = model(input_ids=ids[rows], labels=labels[rows]).loss
    loss.backward()
    mean = loss.detach().clone()
    dist.all_reduce(mean)
    assert _rel(mean / world, want.detach()) < 1e-5
    for name, p in model.named_parameters():
        assert _rel(p.grad.full_tensor(), dict(reference.named_parameters())[name].grad) < 2e-4, name


def _trl_sharded_case(rank, world, dev):
    """A TRL trainer whose reference model is already sharded (as a trainer that prepares it at construction
    leaves it): use_logitless with its norms refuses before changing either model; without them it installs."""
    trl_utils = pytest.importorskip("trl.trainer.utils")
    from types import SimpleNamespace

    from logitless import integrations

    device = torch.device("cpu")
    policy, ref = _model(False, torch.float32, device), _model(False, torch.float32, device)
    for m in (policy, ref):
        trl_utils.add_fused_lm_head(m)
    _shard(ref, "layers", True, False, dev, world)
    trainer = SimpleNamespace(model=policy, ref_model=ref)
    with pytest.raises(ValueError, match=r"already sharded \(fully_shard at the model itself\).*rms_norm=False"):
        integrations._install(trainer, True, [])
    assert not logitless.hf.is_patched(policy) and integrations._STATE not in policy.__dict__
    integrations._install(trainer, False, [])
    assert integrations._STATE in policy.__dict__ and integrations._STATE in ref.__dict__


# ----------------------------------------------------------------------------------------------------
# On two GPUs (NCCL): every wrapping × tied/untied × reshard, bf16 parameters and the mixed-precision policy.


@pytest.mark.parametrize("precision", ["bfloat16", "mixed"])
@pytest.mark.parametrize("reshard", [True, False])
@pytest.mark.parametrize("wrap,tied", [("head", False), ("head_norm", False), ("layers", False), ("root", False),
                                       ("layers", True), ("root", True)])
def test_cuda_patched_model_matches_one_process(nccl2, wrap, tied, reshard, precision):
    nccl2.run("_fsdp_case", "cuda", wrap, tied, reshard, precision)


@pytest.mark.parametrize("loss_name", ["cross_entropy", "grpo", "selective_log_softmax"])
def test_cuda_linear_head_loss_through_a_sharded_head(nccl2, loss_name):
    nccl2.run("_head_loss_case", "cuda", loss_name)


def test_cuda_dtensor_weight_is_refused_without_vocab_parallel(nccl2):
    nccl2.run("_refused_case", "cuda")


@pytest.mark.parametrize("tied", [False, True])
def test_cuda_zero3_patched_model_matches_one_process(nccl2, tied):
    pytest.importorskip("deepspeed")
    nccl2.run("_zero3_case", "cuda", tied)
