"""logitless.grpo_loss and logitless.selective_log_softmax against a float64 torch reference.

CPU tests run everywhere (the CPU backend is a real backend); CUDA tests skip without a GPU.
Run: PYTHONPATH=build/<dir>/python python -m pytest tests/python/test_policy_loss.py -q
"""
import pytest
import torch

import logitless
from _helpers import (
    CPU_GRAD_TOL,
    DTYPES,
    assert_compiled_matches_eager,
    assert_graph_replays_match_eager,
    capture_cuda_graph,
    extra_peak_memory,
    needs_cuda,
    on_a_side_stream_behind_a_sleep,
    run_or_skip_unavailable,
)
from logitless import grpo_loss, selective_log_softmax

LOSS_TYPES = ["grpo", "bnpo", "dr_grpo", "dapo"]
LEVELS = ["token", "sequence"]

# Error budget against the float64 reference on the same (already rounded) inputs: the loss and per-token values
# are float32; the gradient is stored in the logits' dtype. CPU computes in double, CUDA accumulates in float32.
LOSS_TOL = {"cpu": 2e-5, "cuda": 2e-4}
GRAD_TOL = {"cpu": CPU_GRAD_TOL, "cuda": {torch.float32: 2e-4, torch.float16: 2e-3, torch.bfloat16: 1e-2}}

# Option sets: every argument alone and together (mask kinds, old policy, reference KL, temperature, clip range).
OPTIONS = {
    "plain": dict(beta=0.0),
    "full": dict(mask="int", old=True, ref=True, beta=0.04, temperature=0.7, eps_high=0.28),
    "float_mask": dict(mask="float", old=True, ref=True, beta=0.1, eps_low=0.1),
    "seed": dict(mask="bool", ref=True, beta=0.04),  # seed 003's setting: no old policy, ratio 1 with gradient
}


# ----------------------------------------------------------------------------------------------------
# Reference and inputs


def reference(logits, ids, adv, mask=None, old=None, ref=None, beta=0.04, eps_low=0.2, eps_high=0.2,
              temperature=1.0, loss_type="grpo", importance_sampling_level="token", max_completion_length=None,
              num_items_in_batch=None):
    """float64 (loss, per-token dict), differentiable w.r.t. `logits` by autograd; TRL's formulas with the
    documented clamps (denominators that count tokens clamped at 1)."""
    B, L = ids.shape
    x = logits.double()
    if x.shape[1] == L + 1:
        x = x[:, :-1]
    x = x / temperature
    logprobs = x.log_softmax(-1)
    valid = torch.ones(B, L, dtype=torch.bool, device=x.device) if mask is None else mask != 0
    safe = torch.where(valid, ids.long(), torch.zeros_like(ids.long()))
    logp = logprobs.gather(-1, safe[..., None])[..., 0]
    loss, per_token = reference_from_logp(logp, adv, mask, old, ref, beta, eps_low, eps_high, loss_type,
                                          importance_sampling_level, max_completion_length, num_items_in_batch)
    entropy = -(logprobs.exp() * logprobs).sum(-1)
    per_token["entropy"] = torch.where(valid, entropy, torch.zeros_like(entropy)).detach()
    return loss, per_token


def reference_from_logp(logp, adv, mask=None, old=None, ref=None, beta=0.04, eps_low=0.2, eps_high=0.2,
                        loss_type="grpo", importance_sampling_level="token", max_completion_length=None,
                        num_items_in_batch=None):
    """The loss as a function of the float64 per-token log-probabilities [B, L] (the rest of `reference`)."""
    B, L = logp.shape
    w = torch.ones(B, L, dtype=torch.float64, device=logp.device) if mask is None else mask.double()
    valid = w != 0
    old_ = old.double() if old is not None else logp.detach()
    if importance_sampling_level == "token":
        log_ratio = logp - old_
    else:
        s = (w * (logp - old_)).sum(-1) / w.sum(-1).clamp(min=1.0)
        log_ratio = s[:, None].expand(B, L)
    ratio = torch.exp(log_ratio)
    A = adv.double()[:, None]
    kl = torch.zeros_like(logp)
    if ref is not None:
        d = ref.double() - logp
        kl = torch.exp(d) - d - 1
    tok = -torch.min(ratio * A, torch.clamp(ratio, 1 - eps_low, 1 + eps_high) * A) + beta * kl
    tok = torch.where(valid, tok, torch.zeros_like(tok))
    if loss_type == "grpo":
        loss = ((w * tok).sum(-1) / w.sum(-1).clamp(min=1.0)).sum() / max(B, 1)
    elif loss_type == "bnpo":
        loss = (w * tok).sum() / w.sum().clamp(min=1.0)
    elif loss_type == "dr_grpo":
        loss = (w * tok).sum() / (B * max_completion_length)
    else:
        norm = num_items_in_batch if num_items_in_batch else w.sum().clamp(min=1.0)
        loss = (w * tok).sum() / norm
    clipped = ((A > 0) & (ratio > 1 + eps_high)) | ((A < 0) & (ratio < 1 - eps_low))
    zero = torch.zeros_like(logp)
    per_token = dict(per_token_loss=tok.detach(), kl=torch.where(valid, kl, zero).detach(),
                     is_clipped=(clipped & valid).detach(), logp=torch.where(valid, logp, zero).detach())
    return loss, per_token


def grad_unit(logp, adv, upstream=1.0, temperature=1.0, **options):
    """The natural size of the logits' gradient: the largest per-token coefficient |upstream * dloss/dlogp| / T,
    which multiplies ([j == id] - p_j) in every element of the token's row (float64, at the given logp, with the
    `reference_from_logp` options)."""
    lp = logp.detach().double().requires_grad_(True)
    loss, _ = reference_from_logp(lp, adv, **options)
    if lp.numel() == 0:
        return 0.0
    (d,) = torch.autograd.grad(loss, lp)
    return abs(upstream) * d.abs().max().item() / temperature


def policy_arguments(g, B, L, V, option, logits, device="cpu"):
    """grpo_loss's arguments besides the logits for the option set `option`, drawn from `g` after the logits' own
    inputs, on `device`: ids, advantages, the mask (masked ids set to -100) and the scalar options, with old and
    reference log-probs near the true ones at `logits`."""
    o = OPTIONS[option]
    ids = torch.randint(0, V, (B, L), generator=g)
    adv = torch.randn(B, generator=g)
    kw = dict(beta=o.get("beta", 0.04), eps_low=o.get("eps_low", 0.2), eps_high=o.get("eps_high", 0.2),
              temperature=o.get("temperature", 1.0))
    mask = None
    if o.get("mask"):
        m = torch.ones(B, L)
        m[::2, (L + 1) // 2:] = 0  # every other sequence has its second half masked
        if o["mask"] == "float":
            m = m * torch.tensor([0.5, 1.0, 2.0, 1.0]).repeat(L)[:L]
        mask = {"int": m.int(), "bool": m.bool(), "float": m}[o["mask"]]
        ids = torch.where(mask != 0, ids, torch.full_like(ids, -100))  # padding ids are never read
    # Old and reference log-probs near the true ones, so ratios spread around 1 and some clip.
    true = reference(logits, ids, adv, mask=mask, beta=0.0, temperature=kw["temperature"])[1]["logp"].float()
    old = true + 0.3 * torch.randn(B, L, generator=g) if o.get("old") else None
    ref = true + 0.5 * torch.randn(B, L, generator=g) if o.get("ref") else None
    to = lambda t: None if t is None else t.to(device)  # noqa: E731
    return dict(completion_ids=ids.to(device), advantages=adv.to(device), completion_mask=to(mask),
                old_logp=to(old), ref_logp=to(ref), **kw)


def make_inputs(B, L, V, dtype, option="full", device="cpu", aligned=False, seed=0):
    g = torch.Generator().manual_seed(seed)
    logits = (torch.randn(B, L if aligned else L + 1, V, generator=g) * 2).to(dtype)
    return dict(logits=logits.to(device), **policy_arguments(g, B, L, V, option, logits, device))


def split(inputs):
    args = (inputs["logits"], inputs["completion_ids"], inputs["advantages"])
    kw = {k: v for k, v in inputs.items() if k not in ("logits", "completion_ids", "advantages")}
    return args, kw


def assert_close(got, want, tol, scale=None):
    want = want.to(torch.float64)
    s = want.abs().max().item() if scale is None and want.numel() else (scale or 0.0)
    torch.testing.assert_close(got.double(), want, rtol=tol, atol=tol * max(s, 1.0))


def assert_grad_close(got, want, tol, unit):
    """A gradient of the logits: `tol` relative to each element and, absolutely, to the gradient's natural size
    `unit` (grad_unit: the largest per-token coefficient of ([j == id] - p_j)). Neither max|want| alone (0 where
    every row cancels exactly, as at V = 1, where an error still scales with the coefficient) nor a floor of 1
    (for a loss averaged over tokens, tens of times the coefficient)."""
    want = want.to(torch.float64)
    s = max(want.abs().max().item() if want.numel() else 0.0, unit)
    torch.testing.assert_close(got.double(), want, rtol=tol, atol=tol * s)


def reference_kwargs(kw):
    """grpo_loss's keyword arguments under the names `reference` takes (a linear loss's bias left out)."""
    names = dict(completion_mask="mask", old_logp="old", ref_logp="ref")
    return {names.get(k, k): v for k, v in kw.items() if k != "bias"}


def reference_grad_unit(logp, adv, upstream, kw, **options):
    """grad_unit at grpo_loss's keyword arguments `kw` and `options` (loss_type, importance_sampling_level, ...)."""
    return grad_unit(logp, adv, upstream, **reference_kwargs(dict(kw, **options)))


def assert_loss_and_per_token_close(loss, tok, want, want_tok, ids, tol):
    """The loss (a float32 scalar, `tol` relative to 1) and the float32 per-token outputs (`tol` relative to the
    log-probabilities' size) against the reference's; is_clipped, a bool tensor, is compared by the caller."""
    assert loss.dtype == torch.float32 and loss.shape == ()
    assert_close(loss, want.detach(), tol, scale=1.0)
    logp_scale = want_tok["logp"].abs().max().item() if ids.numel() else 1.0
    for name in ("per_token_loss", "kl", "logp", "entropy"):
        got = getattr(tok, name)
        assert got.shape == ids.shape and got.dtype == torch.float32 and not got.requires_grad, name
        assert_close(got, want_tok[name], tol, scale=max(1.0, logp_scale))
    assert tok.is_clipped.dtype == torch.bool


def assert_per_token_outputs_close(got, want):
    """Per-token outputs of the CUDA backend against the CPU backend's: values to 1e-4; is_clipped may differ at one
    token (a ratio within float32 rounding of the clip edge may land either side)."""
    for a, b in zip(got, want):
        if a.dtype == torch.bool:
            assert (a != b).sum() <= 1
        else:
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)


def check_against_reference(inputs, loss_type="grpo", level="token", inplace=False, upstream=1.3, algo="auto",
                            extra=None):
    """Loss, every per-token output and the gradient (through a non-trivial upstream gradient)."""
    extra = dict(extra or {})
    if loss_type == "dr_grpo":
        extra.setdefault("max_completion_length", inputs["completion_ids"].shape[1] + 3)
    (logits, ids, adv), kw = split(inputs)
    ref_in = logits.detach().clone().requires_grad_(True)
    rkw = reference_kwargs(kw)
    want, want_tok = reference(ref_in, ids, adv, loss_type=loss_type, importance_sampling_level=level, **rkw,
                               **extra)
    (upstream * want).backward()

    leaf = logits.detach().clone().requires_grad_(True)
    x = leaf * 1 if inplace else leaf  # in place needs a non-leaf, as a model hands it over
    loss, tok = grpo_loss(x, ids, adv, loss_type=loss_type, importance_sampling_level=level, inplace_backward=inplace,
                          return_per_token=True, algo=algo, **kw, **extra)
    dev = logits.device.type
    assert_loss_and_per_token_close(loss, tok, want, want_tok, ids, LOSS_TOL[dev])
    assert torch.equal(tok.is_clipped.cpu(), want_tok["is_clipped"].cpu())
    (upstream * loss).backward()
    unit = reference_grad_unit(want_tok["logp"], adv, upstream, kw, loss_type=loss_type,
                               importance_sampling_level=level, **extra)
    assert_grad_close(leaf.grad, ref_in.grad, GRAD_TOL[dev][logits.dtype], unit)
    return loss, tok


# ----------------------------------------------------------------------------------------------------
# Values and gradients (CPU backend)


@pytest.mark.parametrize("option", list(OPTIONS))
@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("loss_type", LOSS_TYPES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_matches_reference(dtype, loss_type, level, option):
    inputs = make_inputs(3, 5, 37, dtype, option, seed=hash((loss_type, level, option)) % 1000)
    check_against_reference(inputs, loss_type, level)


@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("loss_type", LOSS_TYPES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_inplace_matches_reference(dtype, loss_type, level):
    inputs = make_inputs(4, 3, 41, dtype, "full", seed=7)
    check_against_reference(inputs, loss_type, level, inplace=True)


def test_dapo_global_normalizer_differs_from_bnpo():
    inputs = make_inputs(3, 6, 23, torch.float32, "full", seed=3)
    count = float((inputs["completion_mask"] != 0).sum())
    check_against_reference(inputs, "dapo", extra=dict(num_items_in_batch=2.5 * count))
    (a, i, v), kw = split(inputs)
    bnpo = grpo_loss(a, i, v, loss_type="bnpo", **kw)
    dapo_local = grpo_loss(a, i, v, loss_type="dapo", **kw)
    dapo_global = grpo_loss(a, i, v, loss_type="dapo", num_items_in_batch=2.5 * count, **kw)
    torch.testing.assert_close(dapo_local, bnpo)
    torch.testing.assert_close(dapo_global, bnpo / 2.5)


@pytest.mark.parametrize(
    "B,L,V,aligned", [(1, 1, 7, False), (2, 3, 1, False), (2, 4, 3, False), (2, 3, 32003, False), (3, 5, 11, True),
                      (0, 4, 9, False), (3, 0, 9, False)],
    ids=["one_token", "V1", "V3", "V32003", "aligned", "B0", "L0"])
@pytest.mark.parametrize("level", LEVELS)
def test_shapes(B, L, V, aligned, level):
    inputs = make_inputs(B, L, V, torch.float32, "full", aligned=aligned)
    check_against_reference(inputs, "grpo", level)
    check_against_reference(make_inputs(B, L, V, torch.float32, "full", aligned=aligned), "bnpo", level, inplace=True)


def test_strided_views_go_in_without_copy():
    # logits rows of a wider buffer, ids a view of prompt+completion ids, the mask and log-probs transposed.
    B, L, V, P = 3, 5, 19, 4
    inputs = make_inputs(B, L, V, torch.float32, "full", seed=5)
    wide = torch.randn(B, L + 1, V + 6)
    wide[..., :V] = inputs["logits"]
    inputs["logits"] = wide[..., :V]
    prompt_completion = torch.randint(0, V, (B, P + L))
    prompt_completion[:, P:] = inputs["completion_ids"]
    inputs["completion_ids"] = prompt_completion[:, -L:]
    for k in ("completion_mask", "old_logp", "ref_logp"):
        inputs[k] = inputs[k].t().contiguous().t()
    inputs["advantages"] = torch.stack([inputs["advantages"], torch.zeros(B)], 1)[:, 0]
    assert not inputs["logits"].is_contiguous() and not inputs["completion_ids"].is_contiguous()
    for level in LEVELS:
        check_against_reference(dict(inputs), "grpo", level)


@pytest.mark.parametrize("mask_dtype", [torch.bool, torch.uint8, torch.int32, torch.int64, torch.float32,
                                        torch.float16, torch.float64], ids=str)
def test_mask_dtypes(mask_dtype):
    inputs = make_inputs(3, 4, 13, torch.float32, "full", seed=2)
    inputs["completion_mask"] = inputs["completion_mask"].to(mask_dtype)
    check_against_reference(inputs, "bnpo", "token")


@pytest.mark.parametrize("inplace", [False, True])
@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_all_masked_is_zero_with_zero_gradient(loss_type, level, inplace):
    inputs = make_inputs(2, 4, 9, torch.float32, "full")
    inputs["completion_mask"] = torch.zeros_like(inputs["completion_mask"])
    (logits, ids, adv), kw = split(inputs)
    leaf = logits.clone().requires_grad_(True)
    loss, tok = grpo_loss(leaf * 1 if inplace else leaf, ids, adv, loss_type=loss_type, importance_sampling_level=level,
                          max_completion_length=4, inplace_backward=inplace, return_per_token=True, **kw)
    assert loss.item() == 0.0
    for t in tok:
        assert (t == 0).all()
    loss.backward()
    assert (leaf.grad == 0).all()


def test_per_token_outputs_and_masked_positions():
    inputs = make_inputs(2, 6, 17, torch.float32, "full")
    (logits, ids, adv), kw = split(inputs)
    loss = grpo_loss(logits, ids, adv, **kw)
    loss2, tok = grpo_loss(logits, ids, adv, return_per_token=True, **kw)
    assert isinstance(loss, torch.Tensor) and isinstance(tok, logitless.policy_loss.PolicyLossOutputs)
    torch.testing.assert_close(loss, loss2)
    masked = inputs["completion_mask"] == 0
    assert masked.any()
    for t in tok:
        assert t.shape == ids.shape and (t[masked] == 0).all()
    # The reported logp is what selective_log_softmax gives for the same tokens.
    lp = selective_log_softmax(logits[:, :-1], ids.clamp(min=0), temperature=kw["temperature"])
    torch.testing.assert_close(tok.logp[~masked], lp[~masked], rtol=1e-5, atol=1e-6)


def test_no_grad_leaves_logits_untouched_even_inplace():
    inputs = make_inputs(2, 3, 9, torch.float32)
    (logits, ids, adv), kw = split(inputs)
    x = logits.clone().requires_grad_(True) * 1
    before = x.detach().clone()
    with torch.no_grad():
        grpo_loss(x, ids, adv, inplace_backward=True, **kw)
    torch.testing.assert_close(x.detach(), before)


# The C++ API takes float32/16/bf16 only, so float64 gradcheck cannot run; float32 central differences with a
# wide step still catch a wrong formula (a sign, a missing term, a bad chain rule). The fused schedule consumes
# its gradient once (see test_second_backward_raises), which gradcheck's repeated backward trips over.
@pytest.mark.parametrize("inplace", [False, True])
@pytest.mark.parametrize("level", LEVELS)
def test_finite_differences(level, inplace):
    inputs = make_inputs(2, 3, 5, torch.float32, "full", seed=11)
    (logits, ids, adv), kw = split(inputs)
    old_free = dict(kw, old_logp=None)  # with old_logp the loss is smooth in logits everywhere but at clip edges
    f = lambda v: grpo_loss(v, ids, adv, importance_sampling_level=level, **old_free)  # noqa: E731
    x = logits.clone().requires_grad_(True)
    (2.0 * grpo_loss(x * 1 if inplace else x, ids, adv, importance_sampling_level=level, inplace_backward=inplace,
                     **old_free)).backward()
    eps = 1e-2
    numeric = torch.zeros_like(x)
    with torch.no_grad():
        flat = logits.clone().reshape(-1)
        for k in range(flat.numel()):
            v = flat[k].item()
            flat[k] = v + eps
            hi = f(flat.view_as(logits)).item()
            flat[k] = v - eps
            lo = f(flat.view_as(logits)).item()
            flat[k] = v
            numeric.reshape(-1)[k] = 2.0 * (hi - lo) / (2 * eps)
    # Without old_logp the ratio is exp(logp - logp.detach()): its value is 1 wherever the logits are, so central
    # differences see only the KL term; the ratio's gradient (-A per token, times the reduction factor) is added
    # back analytically from selective_log_softmax's own gradient.
    xr = logits.clone().requires_grad_(True)
    lp = selective_log_softmax(xr[:, :-1], ids.clamp(min=0), temperature=kw["temperature"])
    w = kw["completion_mask"].double()
    if level == "token":
        ratio_term = -(adv[:, None] * w * lp / w.sum(-1, keepdim=True).clamp(min=1)).sum() / ids.shape[0]
    else:  # d/dlogp of -A exp(S): -A * w / D at S = 0, times the sequence's factor sum_l w / (B D)
        D = w.sum(-1, keepdim=True).clamp(min=1)
        per_seq = (w * lp / D).sum(-1, keepdim=True) * w.sum(-1, keepdim=True) / D
        ratio_term = -(adv[:, None] * per_seq).sum() / ids.shape[0]
    (2.0 * ratio_term).backward()
    torch.testing.assert_close(x.grad, numeric + xr.grad, atol=2e-3, rtol=2e-2)


# ----------------------------------------------------------------------------------------------------
# In place and autograd safety


def test_inplace_writes_gradient_into_logits_storage_and_zeros_last_position():
    g = torch.Generator().manual_seed(11)
    B, L, H, V = 2, 4, 8, 13
    h = torch.randn(B, L + 1, H, generator=g, requires_grad=True)
    W = torch.randn(V, H, generator=g, requires_grad=True)
    inputs = make_inputs(B, L, V, torch.float32, "full")
    (_, ids, adv), kw = split(inputs)
    logits = h @ W.t()
    ptr = logits.data_ptr()
    loss = grpo_loss(logits, ids, adv, inplace_backward=True, **kw)
    ref_logits = (h @ W.t()).detach().requires_grad_(True)
    rkw = dict(mask=kw["completion_mask"], old=kw["old_logp"], ref=kw["ref_logp"], beta=kw["beta"],
               eps_high=kw["eps_high"], temperature=kw["temperature"])
    reference(ref_logits, ids, adv, **rkw)[0].backward()
    assert logits.data_ptr() == ptr
    torch.testing.assert_close(logits.detach(), ref_logits.grad.float(), rtol=1e-5, atol=1e-7)
    assert (logits.detach()[:, -1] == 0).all()
    (3.0 * loss).backward()
    h2, W2 = h.detach().clone().requires_grad_(True), W.detach().clone().requires_grad_(True)
    (3.0 * reference(h2 @ W2.t(), ids, adv, **rkw)[0]).backward()
    torch.testing.assert_close(h.grad, h2.grad.float(), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(W.grad, W2.grad.float(), rtol=1e-5, atol=1e-6)


def test_inplace_raises_when_another_node_saved_the_logits():
    inputs = make_inputs(2, 3, 9, torch.float32)
    (logits, ids, adv), kw = split(inputs)
    x = logits.clone().requires_grad_(True)
    loss = grpo_loss(torch.tanh(x), ids, adv, inplace_backward=True, **kw)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward()


def test_inplace_refuses_a_leaf():
    inputs = make_inputs(2, 3, 9, torch.float32)
    (logits, ids, adv), kw = split(inputs)
    x = logits.clone().requires_grad_(True)
    with pytest.raises(ValueError, match="logits"):
        grpo_loss(x, ids, adv, inplace_backward=True, **kw)


@pytest.mark.parametrize("inplace", [False, True])
def test_second_backward_raises(inplace):
    inputs = make_inputs(2, 3, 9, torch.float32)
    (logits, ids, adv), kw = split(inputs)
    x = logits.clone().requires_grad_(True)
    loss = grpo_loss(x * 1, ids, adv, inplace_backward=inplace, **kw)
    loss.backward(torch.tensor(2.0), retain_graph=True)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward()


def test_double_backward_raises():
    inputs = make_inputs(2, 3, 9, torch.float32)
    (logits, ids, adv), kw = split(inputs)
    x = logits.clone().requires_grad_(True)
    with pytest.raises(RuntimeError, match="double backward"):
        torch.autograd.grad(grpo_loss(x, ids, adv, **kw), x, create_graph=True)
    with pytest.raises(RuntimeError, match="double backward"):
        torch.autograd.grad(selective_log_softmax(x[:, :-1], ids.clamp(min=0)).sum(), x, create_graph=True)


# ----------------------------------------------------------------------------------------------------
# Errors


def _bad(**changes):
    inputs = make_inputs(2, 3, 9, torch.float32, "full")
    inputs.update(changes)
    return inputs


# Bad arguments of every policy loss (B = 2, L = 3) and the argument each error names; a loss adds its own.
BAD_POLICY_ARGUMENTS = [
    (dict(completion_ids=torch.zeros(6, dtype=torch.long)), "completion_ids"),
    (dict(advantages=torch.zeros(3)), "advantages"),
    (dict(completion_mask=torch.ones(2, 4)), "completion_mask"),
    (dict(old_logp=torch.zeros(3, 3)), "old_logp"),
    (dict(ref_logp=torch.zeros(2, 2)), "ref_logp"),
    (dict(ref_logp=None, beta=0.1), "ref_logp"),
    (dict(loss_type="ppo"), "loss_type"),
    (dict(loss_type="dr_grpo"), "max_completion_length"),
    (dict(importance_sampling_level="seq"), "importance_sampling_level"),
    (dict(temperature=0.0), "temperature"),
    (dict(eps_low=-0.1), "eps_low"),
]


@pytest.mark.parametrize(
    "changes,name",
    [
        (dict(logits=torch.randn(2, 5, 9)), "logits"),
        (dict(logits=torch.randn(3, 4, 9)), "logits"),
        (dict(logits=torch.randn(2, 4, 9, dtype=torch.float64)), "logits"),
        (dict(logits=torch.randn(2, 9, 4).transpose(1, 2)), "logits"),
        (dict(completion_ids=torch.zeros(2, 5, dtype=torch.long)), "logits"),
        *BAD_POLICY_ARGUMENTS,
        (dict(beta=-1.0), "beta"),
        (dict(algo="fastest"), "algo"),
    ],
    ids=lambda v: v if isinstance(v, str) else None,
)
def test_bad_arguments_raise_value_error_naming_them(changes, name):
    inputs = _bad(**{k: v for k, v in changes.items() if k not in ("loss_type", "importance_sampling_level", "algo")})
    extra = {k: v for k, v in changes.items() if k in ("loss_type", "importance_sampling_level", "algo")}
    (logits, ids, adv), kw = split(inputs)
    with pytest.raises(ValueError, match=name):
        grpo_loss(logits, ids, adv, **kw, **extra)


@pytest.mark.parametrize("requires_grad", [False, True])
def test_id_out_of_range_names_first_unmasked_token(requires_grad):
    inputs = make_inputs(2, 4, 9, torch.float32, "full")
    (logits, ids, adv), kw = split(inputs)
    ids = ids.clone()
    ids[0, 3] = 50  # masked (sequence 0's second half): ignored
    ids[1, 2] = 9   # the first bad unmasked token
    ids[1, 3] = -2
    with pytest.raises(ValueError, match=r"completion_ids.*got 9 at \[1, 2\]"):
        grpo_loss(logits.requires_grad_(requires_grad), ids, adv, **kw)


def test_unchecked_bad_id_gives_nan_row():
    inputs = make_inputs(2, 3, 9, torch.float32, "plain")
    (logits, ids, adv), kw = split(inputs)
    ids = ids.clone()
    ids[1, 1] = 99
    x = logits.clone().requires_grad_(True)
    loss, tok = grpo_loss(x, ids, adv, check_ids=False, return_per_token=True, **kw)
    assert torch.isnan(loss) and torch.isnan(tok.logp[1, 1]) and torch.isfinite(tok.logp[0]).all()
    loss.backward()
    assert torch.isnan(x.grad[1, 1]).all() and torch.isfinite(x.grad[0]).all()


# ----------------------------------------------------------------------------------------------------
# torch.library and torch.compile


def _op_samples(device="cpu"):
    inputs = make_inputs(2, 3, 9, torch.float32, "full", device=device)
    (logits, ids, adv), kw = split(inputs)
    mask, old, ref = kw["completion_mask"], kw["old_logp"], kw["ref_logp"]
    opts = lambda t, lvl, pt: (t, lvl, 0.04, 0.2, 0.28, 0.7, 6, 0.0, True, 0, 0, 0, pt, pt)  # noqa: E731
    ops = torch.ops.logitless
    lse = torch.logsumexp(logits[:, :-1], -1)
    flat, fids = logits[:, :-1].reshape(-1, 9), ids.clamp(min=0).reshape(-1)
    return [
        (ops.policy_loss_forward, (logits, ids, adv, mask, old, ref) + opts(0, 0, True)),
        (ops.policy_loss_forward, (logits, ids.clamp(min=0), adv, None, None, ref) + opts(2, 1, False)),
        (ops.policy_loss_forward_backward_out,
         (logits, ids, adv, mask, old, ref) + opts(1, 1, True) + (torch.empty_like(logits),)),
        (ops.policy_loss_forward_backward_, (logits.clone(), ids, adv, mask, None, ref) + opts(3, 0, False)),
        (ops.selective_log_softmax_forward, (flat, fids, 0.7, True, True)),
        (ops.selective_log_softmax_forward, (flat.clone().requires_grad_(True), fids, 1.0, True, False)),
        (ops.selective_log_softmax_backward, (flat, fids, lse.reshape(-1), torch.rand(6, device=device), 1.0)),
    ]


@pytest.mark.parametrize("index", range(7))
def test_opcheck(index):
    op, args = _op_samples()[index]
    torch.library.opcheck(op, args)


def _model(h, W, ids, adv, mask, old, ref, level, inplace):
    return grpo_loss(h @ W.t(), ids, adv, completion_mask=mask, old_logp=old, ref_logp=ref, temperature=0.9,
                     importance_sampling_level=level, inplace_backward=inplace)


def _compile_matches_eager(B, L, H, V, level, inplace):
    torch._dynamo.reset()
    g = torch.Generator().manual_seed(4)
    h = torch.randn(B, L + 1, H, generator=g, requires_grad=True)
    W = torch.randn(V, H, generator=g, requires_grad=True)
    inputs = make_inputs(B, L, V, torch.float32, "full")
    (_, ids, adv), kw = split(inputs)
    args = (ids, adv, kw["completion_mask"], kw["old_logp"], kw["ref_logp"], level, inplace)
    assert_compiled_matches_eager(_model, (h, W), *args, upstream=2, rtol=1e-5, atol=1e-6)


COMPILE_CASES = [("token", False), ("token", True), ("sequence", False), ("sequence", True)]


@pytest.mark.parametrize("level,inplace", COMPILE_CASES)
def test_compile_fullgraph_matches_eager(level, inplace):
    _compile_matches_eager(3, 5, 16, 33, level, inplace)


# Inductor pads the rows of intermediates on CUDA (comprehensive padding) and not on the CPU unless asked. With
# padding, the logits [B, L+1, V] are a view of a matmul whose rows are padded, the in-place forward writes the
# gradient back into that buffer, and the saved gradient has padded rows; the backward once scaled it in place, which
# compiled into a copy that read it as contiguous (rows after the first shifted, padding read as values).
@pytest.mark.parametrize("level,inplace", COMPILE_CASES)
def test_compile_fullgraph_with_padded_rows_matches_eager(level, inplace):
    cfg = torch._inductor.config
    if not hasattr(cfg, "disable_padding_cpu"):
        pytest.skip("this torch has no switch for inductor's padding on the CPU")
    from torch._inductor import metrics

    # V = 1031 float32 elements a row (more than inductor's 1024 threshold, not a multiple of its 32): padded to 1056.
    with cfg.patch(disable_padding_cpu=False, comprehensive_padding=True, fx_graph_cache=False):
        metrics.reset()
        _compile_matches_eager(2, 5, 16, 1031, level, inplace)
        assert metrics.num_comprehensive_padding > 0, "the test needs inductor to pad the matmul's rows"


def test_compile_fullgraph_per_token_and_selective():
    torch._dynamo.reset()

    @torch.compile(fullgraph=True)
    def f(logits, ids, adv, mask, ref):
        old = selective_log_softmax(logits[:, :-1].detach(), ids.clamp(min=0))
        loss, tok = grpo_loss(logits, ids, adv, completion_mask=mask, old_logp=old, ref_logp=ref,
                              return_per_token=True)
        return loss, tok.kl, tok.entropy

    inputs = make_inputs(2, 4, 17, torch.float32, "full")
    (logits, ids, adv), kw = split(inputs)
    loss, kl, ent = f(logits, ids, adv, kw["completion_mask"], kw["ref_logp"])
    want, wtok = reference(logits, ids, adv, mask=kw["completion_mask"], ref=kw["ref_logp"],
                           old=selective_log_softmax(logits[:, :-1], ids.clamp(min=0)))
    torch.testing.assert_close(loss.double(), want, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(kl.double(), wtok["kl"], rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(ent.double(), wtok["entropy"], rtol=1e-5, atol=1e-5)


# ----------------------------------------------------------------------------------------------------
# selective_log_softmax


def _sel_reference(logits, ids, temperature):
    lp = (logits.double() / temperature).log_softmax(-1)
    logp = lp.gather(-1, ids.long()[..., None])[..., 0]
    return logp, -(lp.exp() * lp).sum(-1)


@pytest.mark.parametrize("temperature", [1.0, 0.6])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape,V", [((5,), 37), ((2, 3), 1000), ((0,), 5), ((4,), 1)], ids=["1d", "2d", "empty", "V1"])
def test_selective_matches_reference(shape, V, dtype, temperature):
    g = torch.Generator().manual_seed(1)
    logits = (torch.randn(*shape, V, generator=g) * 2).to(dtype)
    ids = torch.randint(0, V, shape, generator=g)
    x = logits.clone().requires_grad_(True)
    logp, ent = selective_log_softmax(x, ids, temperature=temperature, return_entropy=True)
    xr = logits.clone().requires_grad_(True)
    want, went = _sel_reference(xr, ids, temperature)
    assert logp.dtype == torch.float32 and logp.shape == ids.shape and not ent.requires_grad
    torch.testing.assert_close(logp.double(), want.detach(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ent.double(), went.detach(), rtol=1e-5, atol=1e-5)
    gout = torch.rand(shape, generator=g) + 0.5
    logp.backward(gout)
    want.backward(gout.double())
    unit = gout.abs().max().item() / temperature if gout.numel() else 0.0  # a row is g ([j == id] - p_j) / T
    assert_grad_close(x.grad, xr.grad, GRAD_TOL["cpu"][dtype], unit)


def test_selective_strided_and_shifted_views():
    full = torch.randn(2, 6, 11)
    tokens = torch.randint(0, 11, (2, 6))
    logp = selective_log_softmax(full[:, :-1], tokens[:, 1:])
    torch.testing.assert_close(logp.double(), _sel_reference(full[:, :-1], tokens[:, 1:], 1.0)[0], rtol=1e-5, atol=1e-6)


@pytest.mark.filterwarnings("ignore:Input #0 requires gradient and is not a double")
def test_selective_gradcheck_float32():
    x = torch.randn(3, 7, requires_grad=True)
    ids = torch.tensor([1, 6, 0])
    assert torch.autograd.gradcheck(lambda v: selective_log_softmax(v, ids, temperature=0.8), (x,), eps=1e-3,
                                    atol=2e-3, rtol=2e-2)


def test_selective_bad_id_names_row():
    with pytest.raises(ValueError, match="ids.*got 7 at row 2"):
        selective_log_softmax(torch.randn(4, 7), torch.tensor([0, 1, 7, 3]))


# ----------------------------------------------------------------------------------------------------
# CUDA (skipped without a GPU)


@needs_cuda
@pytest.mark.parametrize("algo", ["auto", "streaming", "cluster", "row_resident"])
@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("V", [1, 3, 4099, 32003, 150000])
def test_cuda_matches_reference(V, dtype, level, algo):
    B, L = (2, 3) if V >= 32003 else (4, 9)
    inputs = make_inputs(B, L, V, dtype, "full", device="cuda", seed=V)
    for inplace in (False, True):
        run_or_skip_unavailable(lambda: check_against_reference(dict(inputs), "grpo", level, inplace=inplace,
                                                                algo=algo), "algo")


@needs_cuda
@pytest.mark.parametrize("loss_type", LOSS_TYPES)
@pytest.mark.parametrize("option", list(OPTIONS))
def test_cuda_matches_cpu_backend(option, loss_type):
    inputs = make_inputs(8, 65, 50257, torch.bfloat16, option, seed=1)
    extra = dict(max_completion_length=70) if loss_type == "dr_grpo" else {}
    outs, units = [], []
    for device in ("cpu", "cuda"):
        (logits, ids, adv), kw = split({k: (v.to(device) if torch.is_tensor(v) else v) for k, v in inputs.items()})
        for level in LEVELS:
            x = logits.detach().clone().requires_grad_(True)
            loss, tok = grpo_loss(x, ids, adv, loss_type=loss_type, importance_sampling_level=level,
                                  return_per_token=True, **kw, **extra)
            loss.backward()
            outs.append((loss.cpu(), [t.cpu() for t in tok], x.grad.cpu()))
            if device == "cpu":  # the gradient's unit at the CPU backend's logp
                units.append(reference_grad_unit(tok.logp, adv, 1.0, kw, loss_type=loss_type,
                                                 importance_sampling_level=level, **extra))
    for (lc, tc, gc), (lg, tg, gg), unit in zip(outs[:2], outs[2:], units):
        torch.testing.assert_close(lg, lc, rtol=1e-4, atol=1e-5)
        assert_per_token_outputs_close(tg, tc)
        assert_grad_close(gg, gc, GRAD_TOL["cuda"][torch.bfloat16], unit)


@needs_cuda
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_cuda_selective_matches_cpu(dtype):
    g = torch.Generator().manual_seed(2)
    logits = (torch.randn(300, 32003, generator=g) * 2).to(dtype)
    ids = torch.randint(0, 32003, (300,), generator=g)
    res = []
    for device in ("cpu", "cuda"):
        # detach(): on the CPU, .to("cpu") is `logits` itself, which requires_grad_ would turn into a leaf that
        # requires grad; its .to("cuda") is then a non-leaf whose .grad stays None.
        x = logits.detach().to(device).requires_grad_(True)
        logp, ent = selective_log_softmax(x, ids.to(device), temperature=0.7, return_entropy=True)
        logp.backward(torch.linspace(-1, 1, 300, device=device))
        res.append((logp.cpu(), ent.cpu(), x.grad.cpu()))
    torch.testing.assert_close(res[1][0], res[0][0], rtol=1e-5, atol=2e-5)
    torch.testing.assert_close(res[1][1], res[0][1], rtol=1e-5, atol=2e-5)
    assert_grad_close(res[1][2], res[0][2], GRAD_TOL["cuda"][dtype], 1.0 / 0.7)  # max |grad_logp| / T


@needs_cuda
@pytest.mark.parametrize("inplace", [False, True])
def test_cuda_runs_on_the_current_stream(inplace):
    inputs = make_inputs(4, 16, 32000, torch.bfloat16, "full", device="cuda")
    (logits, ids, adv), kw = split(inputs)
    want = grpo_loss(logits, ids, adv, **kw)
    leaf = torch.zeros_like(logits, requires_grad=True)

    def run():
        got = grpo_loss(leaf + logits, ids, adv, inplace_backward=inplace, **kw)
        got.backward()
        return got

    got = on_a_side_stream_behind_a_sleep(run)
    ref = logits.detach().clone().requires_grad_(True)
    rkw = dict(mask=kw["completion_mask"], old=kw["old_logp"], ref=kw["ref_logp"], beta=kw["beta"],
               eps_high=kw["eps_high"], temperature=kw["temperature"])
    want_ref, want_tok = reference(ref, ids, adv, **rkw)
    want_ref.backward()
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    temperature = rkw.pop("temperature")
    unit = grad_unit(want_tok["logp"], adv, 1.0, temperature, **rkw)
    assert_grad_close(leaf.grad, ref.grad, GRAD_TOL["cuda"][torch.bfloat16], unit)


@needs_cuda
def test_cuda_bad_id_raises_eagerly():
    inputs = make_inputs(2, 4, 100, torch.float32, "plain", device="cuda")
    (logits, ids, adv), kw = split(inputs)
    ids = ids.clone()
    ids[1, 0] = 100
    with pytest.raises(ValueError, match=r"completion_ids.*got 100 at \[1, 0\]"):
        grpo_loss(logits, ids, adv, **kw)


@needs_cuda
@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("inplace", [False, True])
def test_cuda_graph_capture(inplace, level):
    B, L, H, V = 4, 16, 32, 4099
    g = torch.Generator().manual_seed(21)
    h = torch.randn(B, L + 1, H, generator=g).cuda().requires_grad_(True)
    W = torch.randn(V, H, generator=g).cuda().requires_grad_(True)
    inputs = make_inputs(B, L, V, torch.float32, "full", device="cuda")
    (_, ids, adv), kw = split(inputs)

    def step():
        loss = grpo_loss(h @ W.t(), ids, adv, importance_sampling_level=level, inplace_backward=inplace, **kw)
        loss.backward()
        return loss.detach()

    def refill(gen):
        h.copy_(torch.randn(B, L + 1, H, generator=gen).cuda())
        adv.copy_(torch.randn(B, generator=gen).cuda())

    graph, static_loss = capture_cuda_graph(step, (h, W))
    assert_graph_replays_match_eager(graph, static_loss, (h, W), refill,
                                     lambda hr, Wr: grpo_loss(hr @ Wr.t(), ids, adv, importance_sampling_level=level,
                                                              **kw))


@needs_cuda
def test_cuda_compile_and_opcheck():
    for op, args in _op_samples("cuda"):
        torch.library.opcheck(op, args)
    torch._dynamo.reset()
    g = torch.Generator().manual_seed(4)
    B, L, H, V = 4, 64, 64, 4099
    h = torch.randn(B, L + 1, H, generator=g).cuda().requires_grad_(True)
    W = torch.randn(V, H, generator=g).cuda().requires_grad_(True)
    inputs = make_inputs(B, L, V, torch.float32, "full", device="cuda")
    (_, ids, adv), kw = split(inputs)
    for level, inplace in [("token", True), ("sequence", False)]:
        args = (ids, adv, kw["completion_mask"], kw["old_logp"], kw["ref_logp"], level, inplace)
        assert_compiled_matches_eager(_model, (h, W), *args, rtol=1e-4, atol=1e-5)


@needs_cuda
def test_cuda_inplace_needs_no_extra_logits_sized_memory():
    inputs = make_inputs(4, 256, 32000, torch.bfloat16, "full", device="cuda")
    (logits, ids, adv), kw = split(inputs)
    nbytes = logits.numel() * logits.element_size()
    for inplace, bound in ((True, nbytes // 8), (False, nbytes + nbytes // 8)):
        x = logits.clone().requires_grad_(True)
        y = x * 1
        extra = extra_peak_memory(grpo_loss, y, ids, adv, inplace_backward=inplace, **kw)
        assert extra < bound, f"inplace={inplace}: {extra} extra bytes for {nbytes} bytes of logits"
        del x, y
