"""logitless.patch / logitless.unpatch on Hugging Face transformers causal LMs, patched against unpatched.

Two sets of models: tiny configs (hidden 64, 2 layers, vocabulary 1000) of six architectures for the features
(dtypes, options, compile, checkpointing, ...), and a tiny random-init instance of every causal LM the installed
transformers maps (tests/python/_hf_zoo.py), each patched whole or refused with its reasons. Nothing in the patch
is keyed on a name, so the sweep is what says which architectures it covers; `python tests/python/test_hf_patch.py`
prints its table.

The unpatched model is the reference: it forms the logits, upcasts them and runs torch's cross-entropy;
the patched one never forms them. In float32 the two agree to float32 rounding; in bfloat16 the patched
loss skips the rounding of the logits to bfloat16, so they agree to bfloat16's noise.

Skips when transformers is not importable (tools/test.sh installs it). CUDA tests skip without a GPU.
Run: PYTHONPATH=build/<dir>/python python -m pytest tests/python/test_hf_patch.py -q
"""
import copy
import inspect

import pytest
import torch

transformers = pytest.importorskip("transformers")

import _hf_zoo as zoo  # noqa: E402
import logitless  # noqa: E402
from _helpers import extra_peak_memory, needs_cuda  # noqa: E402
from logitless.hf import PatchRefused  # noqa: E402
from logitless.nn import RMSNorm  # noqa: E402

VOCAB = 1000
B, T = 2, 12

# (loss rtol, gradient tolerance relative to each gradient's largest element) per parameter dtype.
TOL = {torch.float32: (2e-5, 2e-5), torch.bfloat16: (2e-2, 6e-2)}


def _common(**extra):
    return dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                intermediate_size=128, vocab_size=VOCAB, max_position_embeddings=64, **extra)


def _configs():
    t = transformers
    return {
        # Tied embeddings (as Llama-3.2-1B) here, an lm_head of its own in the others.
        "llama": (t.LlamaConfig(**_common(tie_word_embeddings=True)), t.LlamaForCausalLM),
        "mistral": (t.MistralConfig(**_common(sliding_window=8)), t.MistralForCausalLM),
        "qwen2": (t.Qwen2Config(**_common()), t.Qwen2ForCausalLM),  # q/k/v projections with a bias
        "qwen3": (t.Qwen3Config(**_common(head_dim=16)), t.Qwen3ForCausalLM),  # q/k norms
        "gemma2": (t.Gemma2Config(**_common(head_dim=16, final_logit_softcapping=5.0, attn_logit_softcapping=50.0,
                                            query_pre_attn_scalar=16, sliding_window=8)), t.Gemma2ForCausalLM),
        "gemma3": (t.Gemma3TextConfig(**_common(head_dim=16, final_logit_softcapping=5.0, query_pre_attn_scalar=16,
                                                sliding_window=8)), t.Gemma3ForCausalLM),
    }


ARCHS = list(_configs())
_BASE = {}


def _model(arch, dtype=torch.float32):
    """A fresh copy of one randomly initialized tiny model per architecture (the same weights every call)."""
    if arch not in _BASE:
        config, cls = _configs()[arch]
        config._attn_implementation = "eager"
        torch.manual_seed(0)
        model = cls(config)
        # Random norm weights (the initial ones are all 1, or all 0 for Gemma's offset form) so that a
        # mistake in the weight's role shows.
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "norm" in name:
                    p.normal_(0.0 if "gemma" in arch else 1.0, 0.2)
        _BASE[arch] = model
    return copy.deepcopy(_BASE[arch]).to(dtype).train()


def _batch(seed=0, pad=3):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (B, T), generator=g)
    mask = torch.ones(B, T, dtype=torch.long)
    mask[1, :pad] = 0  # left padding in the second row
    labels = ids.masked_fill(mask == 0, -100)
    return ids, mask, labels


def _loss_and_grads(model, **inputs):
    model.zero_grad(set_to_none=True)
    out = model(**inputs)
    out.loss.backward()
    params = getattr(model, "_orig_mod", model).named_parameters()  # the names without torch.compile's prefix
    return out, {n: p.grad.detach().clone() for n, p in params if p.grad is not None}


def _assert_close_grads(got, want, tol, floor=0.0):
    assert got.keys() == want.keys()
    largest = max((g.abs().max().item() for g in want.values()), default=0.0)
    for name in want:
        scale = want[name].abs().max().item() + floor * largest + 1e-12
        err = (got[name].float() - want[name].float()).abs().max().item()
        assert err <= tol * scale, f"{name}: max error {err:.3g} above {tol} x {scale:.3g}"


def _head_outputs(module):
    """The shapes lm_head's calls return. The patched forward calls it once with labels (so that hooks of a
    sharding wrapper run), and what comes out must be the loss (one element, with as many dimensions as the
    logits), never the logits."""
    shapes = []
    handle = module.register_forward_hook(lambda module, args, out: shapes.append(tuple(out.shape)))
    return shapes, handle


# ----------------------------------------------------------------------------------------------------
# Loss and gradients against the unpatched model


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("arch", ARCHS)
def test_loss_and_gradients_match_unpatched(arch, dtype):
    ids, mask, labels = _batch()
    ref = _model(arch, dtype)
    want, want_grads = _loss_and_grads(ref, input_ids=ids, attention_mask=mask, labels=labels)

    model = logitless.patch(_model(arch, dtype))
    calls, _ = _head_outputs(model.lm_head)
    got, got_grads = _loss_and_grads(model, input_ids=ids, attention_mask=mask, labels=labels)
    assert calls == [(1, 1, 1)], f"lm_head returned {calls}: the logits were formed"
    assert got.logits is None
    assert got.loss.dtype == torch.float32
    rtol, gtol = TOL[dtype]
    torch.testing.assert_close(got.loss, want.loss, rtol=rtol, atol=0)
    _assert_close_grads(got_grads, want_grads, gtol)


@pytest.mark.parametrize("arch", ARCHS)
def test_every_rms_norm_is_replaced_with_the_right_variant(arch):
    model = logitless.patch(_model(arch), cross_entropy=False)
    norms = [m for m in model.modules() if type(m).__name__.endswith("RMSNorm")]
    assert norms and all(isinstance(m, RMSNorm) for m in norms)
    gemma = arch.startswith("gemma")
    for m in norms:
        assert m.offset == (1.0 if gemma else 0.0)
        assert m.casting_mode == ("gemma" if gemma else "llama")
    if arch in ("qwen3", "gemma3"):  # q/k norms over the head dimension
        assert isinstance(model.model.layers[0].self_attn.q_norm, RMSNorm)
        assert isinstance(model.model.layers[0].self_attn.k_norm, RMSNorm)


# The norm each architecture's layers fuse their residual add into: the second of a pre-norm layer, Gemma 2 and 3's
# pre-feedforward norm (their attention output is normalized before the add, the sum only before the MLP).
FUSED_INTO = dict(llama="post_attention_layernorm", mistral="post_attention_layernorm",
                  qwen2="post_attention_layernorm", qwen3="post_attention_layernorm",
                  gemma2="pre_feedforward_layernorm", gemma3="pre_feedforward_layernorm")


@pytest.mark.parametrize("arch", ARCHS)
def test_fused_residual_sites(arch):
    model = logitless.patch(_model(arch))
    lines = [line for line in logitless.hf.describe(model).splitlines() if "residual add fused" in line]
    assert lines == [f"model.layers.{i}: {type(model.model.layers[i]).__name__} forward -> residual add fused into "
                     f"{FUSED_INTO[arch]} (rms_norm with residual=)" for i in range(len(model.model.layers))]
    assert all("forward" in layer.__dict__ for layer in model.model.layers)
    logitless.unpatch(model)
    assert all("forward" not in layer.__dict__ for layer in model.model.layers)
    # Without the norms replaced there is nothing to fuse into.
    logitless.patch(model, rms_norm=False)
    assert "residual add fused" not in logitless.hf.describe(model)


@pytest.mark.parametrize("arch", ["llama", "gemma2"])
def test_rms_norm_only_and_cross_entropy_only(arch):
    ids, mask, labels = _batch()
    want, want_grads = _loss_and_grads(_model(arch), input_ids=ids, attention_mask=mask, labels=labels)
    for options in (dict(rms_norm=False), dict(cross_entropy=False)):
        model = logitless.patch(_model(arch), **options)
        assert ("forward" in model.__dict__) == options.get("cross_entropy", True)
        assert isinstance(model.model.norm, RMSNorm) == options.get("rms_norm", True)
        got, got_grads = _loss_and_grads(model, input_ids=ids, attention_mask=mask, labels=labels)
        assert (got.logits is None) == options.get("cross_entropy", True)
        torch.testing.assert_close(got.loss, want.loss, rtol=2e-5, atol=0)
        _assert_close_grads(got_grads, want_grads, 2e-5)


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_num_items_in_batch_gradient_accumulation(arch):
    """Two micro-batches, each loss = sum / (counted tokens of both): their sum is the full batch's mean, and
    each equals the unpatched model's with the same num_items_in_batch."""
    ids, mask, labels = _batch(pad=5)
    counted = (labels[:, 1:] != -100).sum()
    full = _model(arch)
    want_full, want_grads = _loss_and_grads(full, input_ids=ids, attention_mask=mask, labels=labels)

    ref, model = _model(arch), logitless.patch(_model(arch))
    total = 0.0
    for i in range(B):
        micro = dict(input_ids=ids[i:i + 1], attention_mask=mask[i:i + 1], labels=labels[i:i + 1],
                     num_items_in_batch=counted)
        want = ref(**micro).loss
        got = model(**micro).loss
        torch.testing.assert_close(got, want, rtol=2e-5, atol=0)
        got.backward()  # accumulates
        total = total + got.detach()
    torch.testing.assert_close(total, want_full.loss, rtol=2e-5, atol=0)
    got_grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    _assert_close_grads(got_grads, want_grads, 2e-5)
    # A plain int works as well (the original accepts it).
    micro = dict(input_ids=ids, attention_mask=mask, labels=labels, num_items_in_batch=int(counted))
    torch.testing.assert_close(model(**micro).loss, ref(**micro).loss, rtol=2e-5, atol=0)


def test_shift_labels_ignore_index_and_logits_to_keep():
    ids, mask, labels = _batch()
    ref, model = _model("qwen2"), logitless.patch(_model("qwen2"))
    shifted = torch.cat((labels[:, 1:], torch.full((B, 1), -100)), dim=1)
    relabeled = labels.masked_fill(labels == -100, -1)
    cases = [
        dict(labels=labels, shift_labels=shifted),                      # labels shifted by the caller
        dict(labels=relabeled, ignore_index=-1),                        # another ignore_index
        dict(labels=labels[:, -5:], logits_to_keep=5),                  # the last 5 positions only
        dict(labels=labels[:, [1, 4, 7]], logits_to_keep=torch.tensor([1, 4, 7])),
        dict(labels=labels.reshape(-1)),                                # flattened labels: counts agree
    ]
    for case in cases:
        want, want_grads = _loss_and_grads(ref, input_ids=ids, attention_mask=mask, **case)
        got, got_grads = _loss_and_grads(model, input_ids=ids, attention_mask=mask, **case)
        torch.testing.assert_close(got.loss, want.loss, rtol=2e-5, atol=0, msg=str(list(case)))
        _assert_close_grads(got_grads, want_grads, 2e-5)
    with pytest.raises(ValueError, match="labels"):
        model(input_ids=ids, labels=labels[:, :5])


def test_all_labels_ignored_gives_zero():
    ids, mask, _ = _batch()
    model = logitless.patch(_model("llama"))
    out = model(input_ids=ids, labels=torch.full_like(ids, -100))
    assert out.loss.item() == 0.0  # the unpatched model gives NaN here
    out.loss.backward()
    assert all(torch.all(p.grad == 0) for p in model.parameters() if p.grad is not None)


# ----------------------------------------------------------------------------------------------------
# Forward semantics


@pytest.mark.parametrize("arch", ["mistral", "gemma2"])
def test_without_labels_the_original_forward_runs(arch):
    ids, mask, _ = _batch()
    ref, model = _model(arch).eval(), logitless.patch(_model(arch)).eval()
    calls, _ = _head_outputs(model.lm_head)
    with torch.no_grad():
        want = ref(input_ids=ids, attention_mask=mask)
        got = model(input_ids=ids, attention_mask=mask)
        assert calls == [tuple(want.logits.shape)] and got.loss is None
        torch.testing.assert_close(got.logits, want.logits, rtol=1e-5, atol=1e-5)
        if arch == "gemma2":  # the softcap applies to the logits returned
            assert got.logits.abs().max() <= 5.0
        # Generation goes through the original forward too.
        model.generation_config.pad_token_id = 0
        want_ids = ref.generate(ids[:1], max_new_tokens=3, do_sample=False)
        got_ids = model.generate(ids[:1], max_new_tokens=3, do_sample=False)
        assert torch.equal(got_ids, want_ids)


def test_return_dict_hidden_states_and_cache():
    ids, mask, labels = _batch()
    ref, model = _model("llama"), logitless.patch(_model("llama"))
    want = ref(input_ids=ids, labels=labels, return_dict=False, use_cache=False)
    got = model(input_ids=ids, labels=labels, return_dict=False, use_cache=False)
    assert isinstance(got, tuple) and len(got) == 1  # (loss,): no logits, to_tuple drops None
    torch.testing.assert_close(got[0], want[0], rtol=2e-5, atol=0)
    got = model(input_ids=ids, labels=labels, output_hidden_states=True, use_cache=True)
    want = ref(input_ids=ids, labels=labels, output_hidden_states=True, use_cache=True)
    assert len(got.hidden_states) == len(want.hidden_states) == 3
    for g, w in zip(got.hidden_states, want.hidden_states):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5)
    assert got.past_key_values is not None and got.past_key_values.get_seq_length() == T


def test_signature_and_positional_arguments():
    """The patched forward shows the original's signature (transformers' Trainer reads it to choose the
    dataset columns it keeps and whether to pass num_items_in_batch) and maps positional arguments as it does."""
    ids, mask, labels = _batch()
    ref, model = _model("llama"), logitless.patch(_model("llama"))
    assert inspect.signature(model.forward) == inspect.signature(ref.forward)
    want = ref(ids, mask, labels=labels)
    got = model(ids, mask, labels=labels)
    torch.testing.assert_close(got.loss, want.loss, rtol=2e-5, atol=0)
    with pytest.raises(TypeError, match="input_ids"):
        model(ids, input_ids=ids, labels=labels)


def test_custom_loss_function():
    ids, mask, labels = _batch()
    model = _model("llama")
    custom = lambda logits, labels, vocab_size, **kw: logits.float().square().mean()  # noqa: E731
    model.loss_function = custom
    with pytest.raises(ValueError, match="ForCausalLMLoss"):
        logitless.patch(model)
    logitless.patch(model, cross_entropy=False)  # the norms alone are fine
    # A custom loss set after patching is honored: the original forward runs (with logits).
    model = logitless.patch(_model("llama"))
    model.loss_function = custom
    out = model(input_ids=ids, labels=labels)
    assert out.logits is not None
    torch.testing.assert_close(out.loss, out.logits.float().square().mean())


def test_autocast():
    ids, mask, labels = _batch()
    ref, model = _model("llama"), logitless.patch(_model("llama"))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        want, want_grads = _loss_and_grads(ref, input_ids=ids, labels=labels)
        got, got_grads = _loss_and_grads(model, input_ids=ids, labels=labels)
    torch.testing.assert_close(got.loss, want.loss, rtol=2e-2, atol=0)
    _assert_close_grads(got_grads, want_grads, 6e-2)
    assert all(g.dtype == torch.float32 for g in got_grads.values())


def test_loss_options_pass_through():
    ids, mask, labels = _batch()
    plain = logitless.patch(_model("llama"))(input_ids=ids, labels=labels).loss
    recompute = logitless.patch(_model("llama"), schedule="recompute")(input_ids=ids, labels=labels).loss
    torch.testing.assert_close(recompute, plain, rtol=1e-6, atol=0)
    with_z = logitless.patch(_model("llama"), z_loss=1e-2)(input_ids=ids, labels=labels).loss
    assert with_z > plain
    with pytest.raises(ValueError, match="label_smoothing"):
        logitless.patch(_model("llama"), label_smoothing=0.1)


# ----------------------------------------------------------------------------------------------------
# Patching and unpatching


def _snapshot(model):
    """Everything patch may touch: the module tree, the parameters, every module's instance attributes (their
    names, and the model's values), the state dict's values."""
    return ([(name, id(m), type(m), sorted(m.__dict__)) for name, m in model.named_modules(remove_duplicate=False)],
            [(name, id(p)) for name, p in model.named_parameters()],
            dict(model.__dict__), repr(model),
            {k: v.detach().clone() for k, v in model.state_dict().items()})


def _same(got, want):
    """`_snapshot`s equal, the state dicts bit for bit."""
    assert got[:4] == want[:4]
    assert got[4].keys() == want[4].keys()
    assert all(torch.equal(got[4][k], want[4][k]) for k in want[4])


@pytest.mark.parametrize("arch", ARCHS)
def test_unpatch_restores_everything(arch):
    ids, mask, labels = _batch()
    model = _model(arch)
    before = _snapshot(model)
    want = model(input_ids=ids, attention_mask=mask, labels=labels)
    logitless.patch(model)
    assert logitless.hf.is_patched(model)
    # The replaced norms keep the original weight Parameters: same parameters, same state dict keys.
    assert [(n, id(p)) for n, p in model.named_parameters()] == before[1]
    logitless.patch(model, rms_norm=False)  # patching again replaces the earlier patch
    assert not isinstance(model.model.norm, RMSNorm)
    logitless.patch(model)
    logitless.unpatch(model)
    assert not logitless.hf.is_patched(model)
    _same(_snapshot(model), before)
    assert model.forward.__func__ is type(model).forward
    got = model(input_ids=ids, attention_mask=mask, labels=labels)
    assert torch.equal(got.loss, want.loss) and torch.equal(got.logits, want.logits)
    assert logitless.unpatch(model) is model  # unpatching an unpatched model changes nothing
    _same(_snapshot(model), before)


def test_instance_forward_kept_and_restored():
    """A forward already set on the instance (as hooks of other libraries do) is what runs without labels and
    what unpatch puts back."""
    ids, _, labels = _batch()
    model = _model("llama")
    seen = []
    original = model.forward

    def wrapped(*args, **kwargs):
        seen.append(1)
        return original(*args, **kwargs)

    model.forward = wrapped
    logitless.patch(model)
    seen.clear()  # patch ran it once, with recorders for the decoder, head and loss
    assert model(input_ids=ids).logits is not None and seen == [1]
    logitless.unpatch(model)
    assert model.__dict__["forward"] is wrapped


def test_deepcopy_of_a_patched_model_is_patched_on_its_own():
    ids, _, labels = _batch()
    model = logitless.patch(_model("llama"))
    clone = copy.deepcopy(model)
    assert clone.forward.__self__ is clone
    assert clone.model.norm.weight is not model.model.norm.weight
    want = model(input_ids=ids, labels=labels).loss
    with torch.no_grad():
        clone.model.norm.weight.mul_(2)
    assert torch.equal(model(input_ids=ids, labels=labels).loss, want)
    assert not torch.equal(clone(input_ids=ids, labels=labels).loss, want)
    logitless.unpatch(clone)
    assert clone.model.norm.weight is clone.model.norm.weight
    assert type(clone.model.norm).__name__ == "LlamaRMSNorm" and logitless.hf.is_patched(model)


def test_subclass_is_supported_and_unrecognized_models_are_refused():
    class MyLlama(transformers.LlamaForCausalLM):
        pass

    config, _ = _configs()["llama"]
    assert logitless.hf.is_patched(logitless.patch(MyLlama(config)))
    # GPT-2: LayerNorms (not an RMSNorm: left alone) and a linear head, tied: the loss is fused.
    gpt2 = transformers.GPT2LMHeadModel(transformers.GPT2Config(n_embd=32, n_layer=1, n_head=2, vocab_size=100))
    logitless.patch(gpt2)
    assert not any(isinstance(m, RMSNorm) for m in gpt2.modules()) and "forward" in gpt2.__dict__

    class OwnLoss(transformers.LlamaForCausalLM):
        """Computes its loss itself, not through loss_function."""

        def forward(self, input_ids=None, labels=None, **kwargs):
            out = super().forward(input_ids=input_ids, **kwargs)
            loss = None if labels is None else torch.nn.functional.cross_entropy(
                out.logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten())
            return transformers.modeling_outputs.CausalLMOutputWithPast(loss=loss, logits=out.logits)

    cases = ((torch.nn.Linear(2, 2), "get_output_embeddings"), (OwnLoss(config), "without calling loss_function"))
    for bad, reason in cases:
        with pytest.raises(logitless.hf.PatchRefused, match=reason) as info:
            logitless.patch(bad)
        assert "cross_entropy=False" in str(info.value) and not logitless.hf.is_patched(bad)
    logitless.patch(cases[1][0], cross_entropy=False)  # the norms alone


# ----------------------------------------------------------------------------------------------------
# RMSNorm modules: recognized by what they compute, whatever their names


def _rms(x, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


class GemmaRMSNorm(torch.nn.Module):
    """Named as Gemma's, computes as Gemma 3n's: a plain weight, in float32, one rounding."""

    def __init__(self, n, eps=1e-6):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(n))
        self.eps = eps

    def forward(self, x):
        return (_rms(x.float(), self.eps) * self.weight.float()).to(x.dtype)


class LlamaRMSNorm(torch.nn.Module):
    """Named as Llama's, computes as Gemma's (and Qwen3-Next's, VaultGemma's): 1 + weight."""

    def __init__(self, n, eps=1e-6):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(n))
        self.variance_epsilon = eps

    def forward(self, x):
        return (_rms(x.float(), self.variance_epsilon) * (1.0 + self.weight.float())).to(x.dtype)


class Scale(torch.nn.Module):
    """Llama's rounding: the normalized input rounded to its dtype, then times the weight."""

    def __init__(self, n, eps=1e-5):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(n))
        self.epsilon = eps

    def forward(self, x):
        return self.weight * _rms(x.float(), self.epsilon).to(x.dtype)


class NoWeight(torch.nn.Module):
    def __init__(self, eps=1e-6):
        super().__init__()
        self.eps = eps

    def forward(self, x):
        return _rms(x.float(), self.eps).to(x.dtype)


class Centered(torch.nn.Module):
    """A LayerNorm without bias (Cohere's, OLMo's shape): subtracts the mean, so not an RMSNorm."""

    def __init__(self, n, eps=1e-5):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(n))
        self.eps = eps

    def forward(self, x):
        h = x.float()
        h = h - h.mean(-1, keepdim=True)
        return (self.weight.float() * _rms(h, self.eps)).to(x.dtype)


class Float32Out(torch.nn.Module):
    """An RMSNorm that returns float32 for any input: nothing of logitless.rms_norm's computes that."""

    def __init__(self, n, eps=1e-6):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(n))
        self.variance_epsilon = eps

    def forward(self, x):
        return self.weight.float() * _rms(x.float(), self.variance_epsilon)


def _randomize(module, center):
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(center + 0.3 * torch.randn(p.shape))
    return module


def test_rms_norm_form_is_read_from_the_computation():
    torch.manual_seed(0)
    n = 48
    originals = {"gemma_named": _randomize(GemmaRMSNorm(n), 1.0), "llama_named": _randomize(LlamaRMSNorm(n), 0.0),
                 "scale": _randomize(Scale(n), 1.0), "no_weight": NoWeight(), "centered": _randomize(Centered(n), 1.0)}
    container = torch.nn.ModuleDict(originals)
    logitless.patch(container, cross_entropy=False)
    forms = {name: (type(m).__name__, getattr(m, "offset", None), getattr(m, "casting_mode", None),
                    getattr(m, "eps", None)) for name, m in container.items()}
    assert forms == {"gemma_named": ("RMSNorm", 0.0, "gemma", 1e-6), "llama_named": ("RMSNorm", 1.0, "gemma", 1e-6),
                     "scale": ("RMSNorm", 0.0, "llama", 1e-5), "no_weight": ("_UnscaledRMSNorm", 0.0, "gemma", 1e-6),
                     "centered": ("Centered", None, None, 1e-5)}
    assert container["scale"].weight is originals["scale"].weight
    assert "not an RMSNorm" in logitless.hf.describe(container)
    for dtype, exact in ((torch.float32, False), (torch.bfloat16, True)):
        x = torch.randn(3, 5, n, dtype=dtype)
        container.to(dtype)  # the replacements hold the originals' Parameters: both convert
        for name, original in originals.items():
            with torch.no_grad():
                want, got = original(x), container[name](x)
            if exact:  # the detected rounding is the module's: bit for bit (as good as, for the rsqrt)
                assert (got != want).float().mean() < 0.01, name
            torch.testing.assert_close(got, want, rtol=1e-5 if dtype == torch.float32 else 8e-3, atol=1e-6)
    logitless.unpatch(container)
    assert all(container[name] is m for name, m in originals.items())


def test_a_refused_patch_leaves_the_model_untouched():
    """A norm it cannot reproduce, met after others it can: nothing is swapped, not even those before it."""
    model = _model("llama")
    odd = Float32Out(64)
    odd.weight = model.model.layers[1].input_layernorm.weight
    model.model.layers[1].input_layernorm = odd
    before = _snapshot(model)
    with pytest.raises(PatchRefused, match=r"layers\.1\.input_layernorm: Float32Out") as info:
        logitless.patch(model)
    assert "float32 for bfloat16 input" in str(info.value) and "rms_norm=False" in str(info.value)
    assert len(info.value.reasons) == 1 and isinstance(info.value, ValueError)
    assert not logitless.hf.is_patched(model)
    _same(_snapshot(model), before)
    assert logitless.unpatch(model) is model
    _same(_snapshot(model), before)
    # The remedy it names: the loss alone.
    ids, mask, labels = _batch()
    want, want_grads = _loss_and_grads(copy.deepcopy(model), input_ids=ids, labels=labels)
    logitless.patch(model, rms_norm=False)
    got, got_grads = _loss_and_grads(model, input_ids=ids, labels=labels)
    assert got.logits is None
    torch.testing.assert_close(got.loss, want.loss, rtol=2e-5, atol=0)
    _assert_close_grads(got_grads, want_grads, 2e-5)


def test_a_refused_repatch_keeps_the_earlier_patch():
    ids, _, labels = _batch()
    model = logitless.patch(_model("llama"))
    custom = lambda logits, labels, vocab_size, **kw: logits.float().square().mean()  # noqa: E731
    model.loss_function = custom
    with pytest.raises(PatchRefused, match="ForCausalLMLoss"):
        logitless.patch(model)  # the custom loss is set now
    assert logitless.hf.is_patched(model) and isinstance(model.model.norm, RMSNorm)
    assert model.loss_function is custom
    out = model(input_ids=ids, labels=labels)  # the custom loss, on the logits
    torch.testing.assert_close(out.loss, out.logits.float().square().mean())
    logitless.unpatch(model)
    assert model.loss_function is custom and type(model.model.norm).__name__ == "LlamaRMSNorm"


# The forms of transformers' own norms, as patch finds them: not what the class names suggest.
NORM_FORMS = [
    ("llama", 1.0, "llama"), ("gemma", 2.0, "gemma"), ("gemma3n_text", 1.0, "gemma"), ("olmo2", 1.0, "gemma"),
    ("qwen3_next", 2.0, "gemma"), ("vaultgemma", 2.0, "gemma"), ("recurrent_gemma", 2.0, "gemma"),
    ("cpmant", 1.0, "llama"),  # CpmAntLayerNorm computes an RMSNorm
]


@pytest.mark.parametrize("model_type,scale,casting", NORM_FORMS, ids=[f[0] for f in NORM_FORMS])
def test_rms_norm_forms_of_transformers_models(model_type, scale, casting):
    """`scale`: what a zero weight scales by (1 + weight: 2 for a weight of one, i.e. offset 1)."""
    model = _zoo_model(model_type)
    logitless.patch(model, cross_entropy=False)
    norms = [m for m in model.modules() if isinstance(m, RMSNorm)]
    weighted = [m for m in norms if not isinstance(m, logitless.hf._UnscaledRMSNorm)]
    assert weighted and all((m.offset + 1.0, m.casting_mode) == (scale, casting) for m in weighted)
    assert not any(type(m).__name__.endswith("RMSNorm") and not isinstance(m, RMSNorm) for m in model.modules())


# ----------------------------------------------------------------------------------------------------
# What the forward does after the head: kept as the model does it


def _zoo_model(model_type):
    entries = dict(zoo.entries())
    if model_type not in entries:
        pytest.skip(f"{model_type} is not in this transformers")
    try:
        return zoo.build(model_type, entries[model_type])
    except zoo.Skip as e:
        pytest.skip(str(e))


def _seeded(model, **inputs):
    torch.manual_seed(1)  # the same dropout draws in both runs
    return _loss_and_grads(model, **inputs)


# (model type, what describe() says of the loss): Granite divides its logits by logits_scaling (4 here), Cohere
# multiplies by logit_scale, Falcon-H1 by lm_head_multiplier (0.5 here), Gemma 2 softcaps; Mixtral, Qwen2-MoE and
# GPT-OSS add their routers' auxiliary loss (output_router_logits here).
AFTER_HEAD = [("granite", "hidden scaled by 0.25"), ("cohere", "hidden scaled by 0.0625"),
              ("falcon_h1", "hidden scaled by 0.5"), ("gemma2", "softcap 5"), ("mixtral", "aux_loss"),
              ("qwen2_moe", "aux_loss"), ("gpt_oss", "aux_loss")]


@pytest.mark.parametrize("model_type,what", AFTER_HEAD, ids=[a[0] for a in AFTER_HEAD])
def test_logit_scales_softcaps_and_router_losses_are_kept(model_type, what):
    model = _zoo_model(model_type)
    ids, _, labels = zoo.batch()
    want, want_grads = _seeded(copy.deepcopy(model), input_ids=ids, labels=labels)
    logitless.patch(model)
    got, got_grads = _seeded(model, input_ids=ids, labels=labels)
    torch.testing.assert_close(got.loss, want.loss, rtol=2e-5, atol=0)
    _assert_close_grads(got_grads, want_grads, 1e-4)
    if what == "aux_loss":
        assert want.aux_loss is not None and want.aux_loss > 0
        torch.testing.assert_close(got.aux_loss, want.aux_loss, rtol=1e-6, atol=0)
        assert len(got.router_logits) == len(want.router_logits)
    else:
        assert what in logitless.hf.describe(model)
    with torch.no_grad():  # without labels: the model's own logits, scaled as it scales them
        torch.manual_seed(1)
        plain = copy.deepcopy(model)
        logitless.unpatch(plain)
        torch.testing.assert_close(model.eval()(input_ids=ids).logits, plain.eval()(input_ids=ids).logits)


# ----------------------------------------------------------------------------------------------------
# Every causal LM of the installed transformers

ENTRIES = zoo.entries()

# What patch refuses for a model's own structure, whatever the architecture: a loss computed without
# loss_function, a head that is not a plain Linear. With transformers 5.24 these are CpmAnt, TrOCR, XLM and XLNet
# (a cross-entropy of their own) and Dory (a head class of its own); earlier 5.x releases add the models that
# computed their own loss then (Mamba, xLSTM, ModernBERT's decoder, ...). Any other refusal fails the test.
STRUCTURAL_REFUSALS = ("computes the loss without calling loss_function", "overrides torch.nn.Linear's forward",
                       "expected get_output_embeddings() to be a torch.nn.Linear")

_OUTCOMES = {}


def _outcome(model_type, class_name):
    """("patched", RMSNorm sites replaced, the loss as describe() puts it, layers with a fused residual add),
    ("refused", reasons) or ("skipped", reason), each patched model checked against the unpatched one on the way.
    Cached: the coverage test reuses them."""
    if model_type not in _OUTCOMES:
        try:
            model = zoo.build(model_type, class_name)
            outcome = _check_entry(model)
        except zoo.Skip as e:
            outcome = ("skipped", str(e))
        _OUTCOMES[model_type] = outcome
    return _OUTCOMES[model_type]


def _tree(model):
    return ([(name, id(m), type(m)) for name, m in model.named_modules(remove_duplicate=False)],
            [(name, id(p)) for name, p in model.named_parameters()],
            {k: v.detach().clone() for k, v in model.state_dict().items()})


def _same_tree(got, want):
    assert got[:2] == want[:2]
    assert got[2].keys() == want[2].keys() and all(torch.equal(got[2][k], want[2][k]) for k in want[2])


def _assert_as_accurate(ref, inputs, got, got_grads, want, want_grads):
    """The loss and gradients as the unpatched model's: to 2e-5 (loss) and 1e-4 of each gradient's largest element
    (and of the largest of all, for gradients that are rounding noise around zero, such as an attention key
    bias's), the replaced norms rounding differently within float32. Where a model's own float32 noise is larger
    than that, the patched model must be as close to the unpatched model run in float64 as the float32 one is."""
    try:
        torch.testing.assert_close(got.loss, want.loss, rtol=2e-5, atol=0)
        _assert_close_grads(got_grads, want_grads, 1e-4, floor=1e-4)
        return
    except AssertionError as e:
        mismatch = e
    try:
        exact, exact_grads = _seeded(copy.deepcopy(ref).double(), **inputs)
    except Exception:
        raise mismatch
    assert abs(got.loss.item() - exact.loss.item()) <= 2 * abs(want.loss.item() - exact.loss.item()) + 1e-6
    largest = max(g.abs().max().item() for g in exact_grads.values())
    for name, g in exact_grads.items():
        err_got = (got_grads[name].double() - g).abs().max().item()
        err_want = (want_grads[name].double() - g).abs().max().item()
        assert err_got <= 2 * err_want + 1e-5 * largest, f"{name}: {err_got:.3g} from float64 (float32: {err_want:.3g})"


def _check_entry(model):
    ids, _, labels = zoo.batch()
    inputs = dict(input_ids=ids, labels=labels)
    ref = copy.deepcopy(model)
    try:
        want, want_grads = _seeded(ref, **inputs)
    except Exception as e:
        raise zoo.Skip(f"the unpatched model fails at this size: {type(e).__name__}: {zoo._message(e)}")
    before, attributes = _tree(model), dict(model.__dict__)
    try:
        logitless.patch(model)
    except PatchRefused as e:
        assert e.reasons and not logitless.hf.is_patched(model)
        _same_tree(_tree(model), before)
        assert dict(model.__dict__) == attributes
        # What each reason offers instead: the modules alone.
        if all("cross_entropy=False" in r for r in e.reasons):
            logitless.patch(model, cross_entropy=False)
            got, got_grads = _seeded(model, **inputs)
            _assert_as_accurate(ref, inputs, got, got_grads, want, want_grads)
            logitless.unpatch(model)
        return ("refused", e.reasons)
    got, got_grads = _seeded(model, **inputs)
    assert got.logits is None
    _assert_as_accurate(ref, inputs, got, got_grads, want, want_grads)
    described = logitless.hf.describe(model).splitlines()
    norms = sum(" -> " in line and "RMSNorm(" in line for line in described)  # not the MLP and rope lines
    fused = sum("-> residual add fused into" in line for line in described)
    loss = next(line for line in described if line.startswith("loss: ")).split("input", 1)[1].strip(" ()")
    swaps = model.__dict__["_logitless_patch"].swaps
    logitless.unpatch(model)
    # Against the reference, which ran the same step (BigBird rebuilds its attention in its first forward).
    assert [(n, type(m)) for n, m in model.named_modules()] == [(n, type(m)) for n, m in ref.named_modules()]
    assert all(getattr(swap.parent, swap.attr) is swap.original for swap in swaps)
    assert "forward" not in model.__dict__ and "_loss_function" not in model.__dict__
    assert [n for n, m in model.named_modules() if "forward" in m.__dict__] == \
        [n for n, m in ref.named_modules() if "forward" in m.__dict__]
    state, ref_state = model.state_dict(), ref.state_dict()
    assert state.keys() == ref_state.keys() and all(torch.equal(state[k], ref_state[k]) for k in state)
    with torch.no_grad():  # the same model again: both have run one step; the same draws, the same bits
        torch.manual_seed(2)
        again = model(**inputs).loss
        torch.manual_seed(2)
        assert torch.equal(again, ref(**inputs).loss)
    return ("patched", norms, loss, fused)


@pytest.mark.parametrize("model_type,class_name", ENTRIES, ids=[e[0] for e in ENTRIES])
def test_every_causal_lm_of_transformers(model_type, class_name):
    """Patched exactly (loss and every parameter's gradient as the unpatched model's, unpatch restoring it), or
    refused for its structure (STRUCTURAL_REFUSALS) with the model left as it was, or skipped for a reason given."""
    outcome = _outcome(model_type, class_name)
    if outcome[0] == "skipped":
        pytest.skip(outcome[1])
    if outcome[0] == "refused":
        for reason in outcome[1]:
            assert any(phrase in reason for phrase in STRUCTURAL_REFUSALS), f"{class_name} refused: {reason}"


def coverage_table() -> str:
    """The sweep's outcomes, one line per entry (README's table is this)."""
    lines = []
    for model_type, class_name in ENTRIES:
        kind, *detail = _outcome(model_type, class_name)
        if kind == "patched":
            norms, loss, fused = detail
            what = f"{norms} RMSNorm site{'s' * (norms != 1)}" + (f"; {fused} residual adds fused" if fused else "") \
                + (f"; {loss}" if loss else "")
        else:
            what = " | ".join(detail[0]) if kind == "refused" else detail[0]
        lines.append(f"{model_type:28s} {class_name:44s} {kind:8s} {what}")
    return "\n".join(lines)


def test_causal_lm_coverage():
    """The large majority of what can be built is patched; from transformers 5.24 on (the release the tested set
    was recorded with), nothing of SUPPORTED_ARCHITECTURES is refused (a later release that changes one fails here,
    to be looked at)."""
    outcomes = {model_type: _outcome(model_type, class_name) for model_type, class_name in ENTRIES}
    counts = {kind: sum(o[0] == kind for o in outcomes.values()) for kind in ("patched", "refused", "skipped")}
    print(f"\n{coverage_table()}\n{counts}")
    assert counts["patched"] >= 0.8 * (counts["patched"] + counts["refused"]), counts
    release = tuple(int(p) for p in transformers.__version__.split(".")[:2])
    if release >= (5, 24):
        refused = {class_name for model_type, class_name in ENTRIES if outcomes[model_type][0] == "refused"}
        assert not refused & set(logitless.hf.SUPPORTED_ARCHITECTURES)


# ----------------------------------------------------------------------------------------------------
# Training features


def _enable_checkpointing(model, kwargs):
    # Renamed activation_checkpointing_enable in later 5.x releases (the old name warns there).
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)


@pytest.mark.parametrize("arch", ["qwen3", "gemma2"])
def test_gradient_checkpointing(arch):
    ids, mask, labels = _batch()
    want, want_grads = _loss_and_grads(_model(arch), input_ids=ids, attention_mask=mask, labels=labels)
    for reentrant in (False, True):
        model = logitless.patch(_model(arch))
        _enable_checkpointing(model, {"use_reentrant": reentrant})
        assert any(getattr(m, "gradient_checkpointing", False) for m in model.modules())
        got, got_grads = _loss_and_grads(model, input_ids=ids, attention_mask=mask, labels=labels)
        torch.testing.assert_close(got.loss, want.loss, rtol=2e-5, atol=0)
        _assert_close_grads(got_grads, want_grads, 2e-5)


# aot_eager: torch.compile's tracing (dynamo, AOTAutograd, the ops' fake kernels) without code generation;
# inductor generates and compiles C++ for the rest of the model (a minute and more on a 2-core CPU), so it runs
# the training step only.
@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_torch_compile(backend):
    ids, mask, labels = _batch()
    eager = logitless.patch(_model("llama"))
    want, want_grads = _loss_and_grads(eager, input_ids=ids, attention_mask=mask, labels=labels)
    model = logitless.patch(_model("llama"))
    compiled = torch.compile(model, backend=backend)
    calls, _ = _head_outputs(model.lm_head)
    for _ in range(2):  # the second call runs the compiled code
        got, got_grads = _loss_and_grads(compiled, input_ids=ids, attention_mask=mask, labels=labels)
        torch.testing.assert_close(got.loss, want.loss, rtol=2e-5, atol=0)
        _assert_close_grads(got_grads, want_grads, 2e-5)
    assert calls == [(1, 1, 1), (1, 1, 1)]
    assert logitless.hf.is_patched(compiled)
    assert logitless.patch(compiled) is compiled  # patching (again) through the wrapper returns the wrapper
    if backend == "inductor":
        return
    with torch.no_grad():  # without labels: the original forward, compiled
        logits = compiled(input_ids=ids, attention_mask=mask).logits
        torch.testing.assert_close(logits, eager(input_ids=ids, attention_mask=mask).logits, rtol=1e-5, atol=1e-5)
    logitless.unpatch(compiled)  # through the compiled wrapper
    assert not logitless.hf.is_patched(model)


# ----------------------------------------------------------------------------------------------------
# CUDA


@needs_cuda
@pytest.mark.parametrize("arch", ["llama", "gemma2"])
def test_cuda_bf16_matches_unpatched(arch):
    ids, mask, labels = (t.cuda() for t in _batch())
    ref = _model(arch, torch.bfloat16).cuda()
    want, want_grads = _loss_and_grads(ref, input_ids=ids, attention_mask=mask, labels=labels)
    model = logitless.patch(_model(arch, torch.bfloat16).cuda())
    got, got_grads = _loss_and_grads(model, input_ids=ids, attention_mask=mask, labels=labels)
    torch.testing.assert_close(got.loss, want.loss, rtol=2e-2, atol=0)
    _assert_close_grads(got_grads, want_grads, 6e-2)



@needs_cuda
def test_cuda_compile():
    ids, mask, labels = (t.cuda() for t in _batch())
    eager = logitless.patch(_model("gemma2", torch.bfloat16).cuda())
    want, want_grads = _loss_and_grads(eager, input_ids=ids, attention_mask=mask, labels=labels)
    model = logitless.patch(_model("gemma2", torch.bfloat16).cuda())
    compiled = torch.compile(model)
    for _ in range(2):
        got, got_grads = _loss_and_grads(compiled, input_ids=ids, attention_mask=mask, labels=labels)
        # The compiled decoder fuses (and rounds) differently from eager: bf16 tolerances.
        torch.testing.assert_close(got.loss, want.loss, rtol=2e-2, atol=0)
        _assert_close_grads(got_grads, want_grads, 6e-2)


@needs_cuda
def test_cuda_peak_memory_leaves_out_the_logits():
    """At a vocabulary where the logits dominate (32000 classes, 4096 tokens: 0.5 GB of float32 logits), the
    patched step's peak stays below the unpatched one's by more than one float32 copy of the logits."""
    config = transformers.LlamaConfig(**dict(_common(), vocab_size=32000), attn_implementation="sdpa")
    torch.manual_seed(0)
    base = transformers.LlamaForCausalLM(config).to("cuda", torch.bfloat16).train()
    ids = torch.randint(0, 32000, (4, 1024), device="cuda")
    peaks = []

    def train_step(model):
        model(input_ids=ids, labels=ids).loss.backward()

    for model in (copy.deepcopy(base), logitless.patch(copy.deepcopy(base), memory_budget=64 << 20)):
        for _ in range(2):  # the second step's peak, with the caching allocator warm
            model.zero_grad(set_to_none=True)
            peak = extra_peak_memory(train_step, model)
        peaks.append(peak)
        del model
    logits_f32 = ids.numel() * 32000 * 4
    assert peaks[1] < peaks[0] - logits_f32, [p / 2**20 for p in peaks]


if __name__ == "__main__":
    print(coverage_table())
