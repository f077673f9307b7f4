"""logitless.patch's gated-MLP (swiglu=), rotary (rope=) and fused residual (fused_residual=) kinds on every causal LM
of the installed transformers, and each of the five kinds turned off alone.

For every entry of tests/python/_hf_zoo.py that patches: the loss and every parameter's gradient equal the
unpatched model's with all kinds on and with each kind off alone; describe() says what was swapped where, and
nothing of a kind turned off; unpatch restores the model (modules, instance attributes, state) and the modeling
modules' apply_rotary_pos_emb globals exactly. Refusals of the whole patch are test_hf_patch.py's.

Skips when transformers is not importable. `python tests/python/test_hf_layers.py` prints which architectures got
their MLPs and rotary embeddings swapped and their residual adds fused.
Run: PYTHONPATH=build/<dir>/python python -m pytest tests/python/test_hf_layers.py -q
"""
import copy
import sys

import pytest
import torch

transformers = pytest.importorskip("transformers")

import _hf_zoo as zoo  # noqa: E402
import logitless  # noqa: E402
from logitless import _hf_layers, _hf_residual  # noqa: E402
from logitless.hf import PatchRefused  # noqa: E402

KINDS = ("rope", "swiglu", "fused_residual", "rms_norm", "cross_entropy")
ENTRIES = zoo.entries()


def _loss_and_grads(model, **inputs):
    torch.manual_seed(1)  # the same dropout draws in every run
    model.zero_grad(set_to_none=True)
    out = model(**inputs)
    out.loss.backward()
    return out.loss.detach(), {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def _close(got, want, exact=None):
    """Loss to 2e-5 and each gradient to 1e-4 of its largest element (and of the largest of all); where the model's
    own float32 noise is larger, as close to the float64 model as the float32 one is (`exact`: a thunk)."""
    (loss, grads), (want_loss, want_grads) = got, want
    assert grads.keys() == want_grads.keys()
    largest = max((g.abs().max().item() for g in want_grads.values()), default=0.0)
    ok = abs(loss.item() - want_loss.item()) <= 2e-5 * abs(want_loss.item()) and all(
        (grads[n] - g).abs().max().item() <= 1e-4 * (g.abs().max().item() + 1e-4 * largest) + 1e-12
        for n, g in want_grads.items())
    if ok:
        return
    assert exact is not None, "loss or gradients differ from the unpatched model's"
    exact_loss, exact_grads = exact()
    assert abs(loss.item() - exact_loss.item()) <= 2 * abs(want_loss.item() - exact_loss.item()) + 1e-6
    largest = max(g.abs().max().item() for g in exact_grads.values())
    for name, g in exact_grads.items():
        err = (grads[name].double() - g).abs().max().item()
        err_want = (want_grads[name].double() - g).abs().max().item()
        assert err <= 2 * err_want + 1e-5 * largest, f"{name}: {err:.3g} from float64 (float32: {err_want:.3g})"


def _rope_globals(model):
    """The apply_rotary_pos_emb of every modeling module the model's classes come from."""
    found = {}
    for m in model.modules():
        namespace = _hf_layers._calls_rope(type(m))
        if namespace is not None:
            found[namespace["__name__"]] = namespace.get(_hf_layers.ROPE_NAME)
    return found


def _snapshot(model):
    return ([(n, id(m), type(m), "forward" in m.__dict__) for n, m in model.named_modules(remove_duplicate=False)],
            {k: v.detach().clone() for k, v in model.state_dict().items()}, dict(model.__dict__), _rope_globals(model))


def _assert_same(got, want):
    assert got[0] == want[0] and got[2] == want[2] and got[3] == want[3]
    assert got[1].keys() == want[1].keys() and all(torch.equal(got[1][k], want[1][k]) for k in want[1])


_OUTCOMES = {}
FUSED = "-> residual add fused into "


def _summary(described):
    mlps = [line for line in described if "-> down_proj(glu(" in line]
    acts = sorted({line.split("activation=")[1].rstrip(")'").strip("'") for line in mlps})
    ropes = [line for line in described if line.startswith("rope: ")]
    not_ropes = [line.split("rope not swapped: ", 1)[1] for line in described if "rope not swapped: " in line]
    fused = [line.split(FUSED, 1)[1].split(" (", 1)[0] for line in described if FUSED in line]
    return dict(mlps=len(mlps), activations=acts, concatenated=any("gate_up_proj" in line for line in mlps),
                rope=len(ropes), rope_not=not_ropes,
                fused_experts=any("fused parameter tensors" in line for line in described),
                residual_layers=len(fused), residual=sorted(set(", ".join(fused).split(", ")) - {""}))


def _outcome(model_type, class_name):
    if model_type in _OUTCOMES:
        return _OUTCOMES[model_type]
    try:
        model = zoo.build(model_type, class_name)
    except zoo.Skip as e:
        _OUTCOMES[model_type] = ("skipped", str(e))
        return _OUTCOMES[model_type]
    ids, _, labels = zoo.batch()
    inputs = dict(input_ids=ids, labels=labels)
    ref = copy.deepcopy(model)
    try:
        want = _loss_and_grads(ref, **inputs)
    except Exception as e:
        _OUTCOMES[model_type] = ("skipped", f"the unpatched model fails at this size: {type(e).__name__}")
        return _OUTCOMES[model_type]
    # A first forward may change a model (BigBird rebuilds its attention): the snapshots are taken after one.
    with torch.no_grad():
        torch.manual_seed(1)
        model(**inputs)
    before = _snapshot(model)
    exact = lambda: _loss_and_grads(copy.deepcopy(ref).double(), **inputs)  # noqa: E731
    try:
        logitless.patch(model)
    except PatchRefused as e:
        _assert_same(_snapshot(model), before)
        _OUTCOMES[model_type] = ("refused", list(e.reasons))
        return _OUTCOMES[model_type]
    try:
        _close(_loss_and_grads(model, **inputs), want, exact)
        described = logitless.hf.describe(model).splitlines()
        logitless.unpatch(model)
        _assert_same(_snapshot(model), before)
        summary = _summary(described)
        # A kind that swapped nothing in this model patches it as all kinds on did: that run stands for it.
        swapped = dict(rope=summary["rope"] or summary["rope_not"], swiglu=summary["mlps"],
                       fused_residual=summary["residual_layers"],
                       rms_norm=any("RMSNorm(" in line for line in described), cross_entropy=True)
        for kind in (k for k in KINDS if swapped[k]):
            logitless.patch(model, **{kind: False})
            _close(_loss_and_grads(model, **inputs), want, exact)
            text = logitless.hf.describe(model)
            if kind == "swiglu":
                assert "-> down_proj(glu(" not in text
            elif kind == "rope":
                assert "\nrope: " not in "\n" + text and "rope not swapped" not in text
            elif kind == "cross_entropy":
                assert "\nloss: " not in "\n" + text
            elif kind == "rms_norm":
                assert "-> RMSNorm(" not in text and FUSED not in text  # only replaced norms are fused
            elif kind == "fused_residual":
                assert FUSED not in text
            logitless.unpatch(model)
            _assert_same(_snapshot(model), before)
    except Exception as e:
        _OUTCOMES[model_type] = ("failed", f"{type(e).__name__}: {e}")
        raise
    _OUTCOMES[model_type] = ("patched", summary)
    return _OUTCOMES[model_type]


@pytest.mark.parametrize("model_type,class_name", ENTRIES, ids=[e[0] for e in ENTRIES])
def test_every_kind_on_and_each_off_alone(model_type, class_name):
    outcome = _outcome(model_type, class_name)
    if outcome[0] == "failed":
        pytest.fail(outcome[1])
    if outcome[0] != "patched":
        pytest.skip(f"{outcome[0]}: {outcome[1]}")


def table() -> str:
    lines = []
    for model_type, class_name in ENTRIES:
        kind, detail = _outcome(model_type, class_name)
        if kind != "patched":
            lines.append(f"{model_type:28s} {kind}")
            continue
        mlp = f"{detail['mlps']} MLP ({', '.join(detail['activations'])}" \
              f"{', gate_up' if detail['concatenated'] else ''})" if detail["mlps"] else "no MLP swapped"
        mlp += " + fused experts left" if detail["fused_experts"] else ""
        rope = "rope swapped" if detail["rope"] else (
            "rope left: " + "; ".join(r.split(": ", 1)[1][:70] for r in detail["rope_not"]) if detail["rope_not"]
            else "no apply_rotary_pos_emb")
        residual = f"residual fused into {', '.join(detail['residual'])}" if detail["residual"] else \
            "no residual add fused"
        lines.append(f"{model_type:28s} {mlp:40s} {residual:50s} {rope}")
    return "\n".join(lines)


# Architectures whose form the sweep must find (what each stands for): silu, tanh GELU, the concatenated
# projection, the one-tensor rotary function, a shared expert beside fused experts; rope kept for GLM's
# interleaved pairs and GPT-J's signature; the residual add fused into the pre-norm layer's second norm (Phi-3's
# through its dropout), into Gemma 2's pre-feedforward norm (sandwich norms), and nowhere in OLMo-2's post-norm
# layers.
EXPECTED = {
    "llama": dict(activations=["silu"], rope=1, residual=["post_attention_layernorm"]),
    "gemma": dict(activations=["gelu_tanh"], rope=1),
    "phi3": dict(concatenated=True, rope=1, residual=["post_attention_layernorm"]),
    "qwen3": dict(residual=["post_attention_layernorm"], residual_layers=2),
    "gemma2": dict(residual=["pre_feedforward_layernorm"]),
    "gemma3_text": dict(residual=["pre_feedforward_layernorm"]),
    "olmo2": dict(residual=[]),
    "gemma4_text": dict(activations=["gelu_tanh"], rope=1),  # the one-tensor apply_rotary_pos_emb(x, cos, sin)
    "qwen2_moe": dict(fused_experts=True, rope=1),
    "glm": dict(rope=0),
    "gptj": dict(rope=0),
}


@pytest.mark.parametrize("model_type", list(EXPECTED))
def test_forms_found(model_type):
    entries = dict(ENTRIES)
    if model_type not in entries:
        pytest.skip(f"{model_type} is not in this transformers")
    kind, detail = _outcome(model_type, entries[model_type])
    if kind == "skipped":
        pytest.skip(detail)
    assert kind == "patched", detail
    for key, value in EXPECTED[model_type].items():
        assert detail[key] == value, (key, detail)
    if model_type in ("qwen2_moe",):
        assert detail["mlps"] >= 1  # its shared expert
    if EXPECTED[model_type].get("rope") == 0:
        assert detail["rope_not"]


def _llama():
    return zoo.build("llama", "LlamaForCausalLM")


def test_rope_true_refuses_what_does_not_verify():
    entries = dict(ENTRIES)
    if "glm" not in entries:
        pytest.skip("glm is not in this transformers")
    model = zoo.build("glm", entries["glm"])
    before = _snapshot(model)
    with pytest.raises(PatchRefused, match="rope: .*another rotation"):
        logitless.patch(model, rope=True)
    _assert_same(_snapshot(model), before)
    logitless.patch(model)  # "auto": the rest goes ahead
    assert "rope not swapped" in logitless.hf.describe(model)
    with pytest.raises(ValueError, match="rope"):
        logitless.patch(model, rope="sometimes")


def test_rope_swapped_only_while_the_patched_model_runs(monkeypatch):
    from transformers.models.llama import modeling_llama

    original = modeling_llama.apply_rotary_pos_emb
    calls = []
    fused = _hf_layers._rope
    monkeypatch.setattr(_hf_layers, "_rope", lambda *a, **k: calls.append(1) or fused(*a, **k))
    model, other = _llama(), _llama()
    ids, _, labels = zoo.batch()
    logitless.patch(model)
    calls.clear()  # the probe's
    model(input_ids=ids, labels=labels).loss.backward()
    assert len(calls) == model.config.num_hidden_layers
    assert modeling_llama.apply_rotary_pos_emb is original
    other(input_ids=ids, labels=labels)  # an unpatched model of the same architecture: the original function
    assert len(calls) == model.config.num_hidden_layers
    # A function someone else put there after the patch is left to them.
    theirs = lambda *a, **k: original(*a, **k)  # noqa: E731
    monkeypatch.setattr(modeling_llama, "apply_rotary_pos_emb", theirs)
    model(input_ids=ids, labels=labels)
    assert len(calls) == model.config.num_hidden_layers and modeling_llama.apply_rotary_pos_emb is theirs


def test_rope_replacement_passes_unprobed_calls_on():
    from transformers.models.llama import modeling_llama

    original = modeling_llama.apply_rotary_pos_emb
    replacement, what = _hf_layers._probe_rope(original)
    assert replacement is not None and "full" in what
    q, k = torch.randn(1, 2, 4, 8), torch.randn(1, 2, 4, 8)
    cos, sin = torch.randn(1, 4, 8), torch.randn(1, 4, 8)
    calls = [((q, k, cos, sin), {}), ((q, k, cos.double(), sin.double()), {}),  # the tables' dtype: the original's
             ((q.transpose(1, 2), k.transpose(1, 2), cos, sin), {"unsqueeze_dim": 2})]
    for args, kwargs in calls:
        for got, want in zip(replacement(*args, **kwargs), original(*args, **kwargs)):
            assert got.dtype == want.dtype
            torch.testing.assert_close(got, want)


def test_mlp_forward_calls_the_child_modules():
    model = _llama()
    logitless.patch(model, cross_entropy=False)
    mlp = model.model.layers[0].mlp
    seen = []
    for name in ("gate_proj", "up_proj", "down_proj"):
        getattr(mlp, name).register_forward_hook(lambda m, a, o, name=name: seen.append(name))
    mlp(torch.randn(1, 3, model.config.hidden_size))
    assert sorted(seen) == ["down_proj", "gate_proj", "up_proj"]
    assert "-> down_proj(glu(gate_proj, up_proj, activation='silu'))" in logitless.hf.describe(model)
    copied = copy.deepcopy(model)  # the copy's forward is bound to the copy
    assert copied.model.layers[0].mlp.forward.__self__ is copied.model.layers[0].mlp


def test_mlp_of_another_computation_is_left_alone():
    class Reordered(torch.nn.Module):  # act on up, not gate
        def __init__(self):
            super().__init__()
            self.gate_proj, self.up_proj, self.down_proj = (torch.nn.Linear(8, 16), torch.nn.Linear(8, 16),
                                                            torch.nn.Linear(16, 8))

        def forward(self, x):
            return self.down_proj(self.gate_proj(x) * torch.nn.functional.silu(self.up_proj(x)))

    swap, refusal, note = _hf_layers.probe_gated_mlp(Reordered(), "mlp")
    assert swap is None and refusal is None and "not down(act(gate(x)) * up(x))" in note


# ----------------------------------------------------------------------------------------------------
# Fused residual adds


def _fused_calls(monkeypatch):
    """The dtypes of every fused add-norm call (an RMSNorm called with a residual) from now on."""
    calls = []
    forward = logitless.nn.RMSNorm.forward

    def counting(self, x, residual=None):
        if residual is not None:
            calls.append(x.dtype)
        return forward(self, x, residual)

    monkeypatch.setattr(logitless.nn.RMSNorm, "forward", counting)
    return calls


def _llama_run(model, **extra):
    ids, _, labels = zoo.batch()
    return _loss_and_grads(model, input_ids=ids, labels=labels, **extra)


def test_fused_residual_runs_fused_and_only_when_on(monkeypatch):
    from transformers.models.llama import modeling_llama

    calls = _fused_calls(monkeypatch)
    model = _llama()
    want = _llama_run(copy.deepcopy(model))
    logitless.patch(model)
    layers = model.config.num_hidden_layers
    calls.clear()
    _close(_llama_run(model), want)
    assert calls == [torch.float32] * layers
    text = logitless.hf.describe(model)
    assert text.count("LlamaDecoderLayer forward -> residual add fused into post_attention_layernorm") == layers
    # The rewritten forward lives in closures: nothing was added to the modeling module.
    assert not [name for name in vars(modeling_llama) if "logitless" in name]
    copied = copy.deepcopy(model)  # the copy's layers run their own forward
    assert copied.model.layers[0].forward.__self__ is copied.model.layers[0]
    logitless.patch(model, fused_residual=False)
    calls.clear()
    _close(_llama_run(model), want)
    assert calls == [] and "residual add fused" not in logitless.hf.describe(model)
    assert all("forward" not in layer.__dict__ for layer in model.model.layers)


def test_fused_residual_under_autocast_with_float32_weights(monkeypatch):
    """float32 master weights under bfloat16 autocast: a float32 residual plus a bfloat16 attention output, summed in
    float32 as torch sums them; the same bits as the unfused patch."""
    calls = _fused_calls(monkeypatch)
    model = _llama()
    unfused = logitless.patch(copy.deepcopy(model), fused_residual=False)
    logitless.patch(model)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        want = _llama_run(unfused)
        calls.clear()
        got = _llama_run(model)
    assert calls == [torch.float32] * model.config.num_hidden_layers
    assert torch.equal(got[0], want[0])
    for name, g in want[1].items():
        torch.testing.assert_close(got[1][name], g, rtol=1e-5, atol=1e-7)


def _checkpointing(model):
    kwargs = {"use_reentrant": False}
    if hasattr(model, "activation_checkpointing_enable"):  # the later 5.x name
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)


def test_fused_residual_with_activation_checkpointing(monkeypatch):
    """The layers' checkpointing wrapper still applies (transformers wraps the class's forward, whose wrappers the
    patched forward reuses): every layer runs twice, and the gradients are the unpatched model's."""
    calls = _fused_calls(monkeypatch)
    model = _llama()
    want = _llama_run(copy.deepcopy(model))
    logitless.patch(model)
    _checkpointing(model)
    calls.clear()
    _close(_llama_run(model), want)
    assert len(calls) == 2 * model.config.num_hidden_layers


def test_fused_residual_after_the_layer_class_changed(monkeypatch):
    """FSDP2's fully_shard swaps a layer's class for a subclass of it (which transformers wraps again for
    checkpointing): the patched forward follows the new class's wrappers, checkpointing included."""
    calls = _fused_calls(monkeypatch)
    model = _llama()
    want = _llama_run(copy.deepcopy(model))
    logitless.patch(model)
    for layer in model.model.layers:
        layer.__class__ = type(f"Sharded{type(layer).__name__}", (type(layer),), {})
    calls.clear()
    _close(_llama_run(model), want)
    assert len(calls) == model.config.num_hidden_layers
    _checkpointing(model)
    calls.clear()
    _close(_llama_run(model), want)
    assert len(calls) == 2 * model.config.num_hidden_layers


def test_fused_residual_runs_unfused_where_the_norm_has_a_hook(monkeypatch):
    calls = _fused_calls(monkeypatch)
    model = _llama()
    want = _llama_run(copy.deepcopy(model))
    logitless.patch(model)
    seen = []
    model.model.layers[0].post_attention_layernorm.register_forward_hook(lambda m, a, out: seen.append(type(out)))
    calls.clear()
    _close(_llama_run(model), want)
    assert seen == [torch.Tensor] and len(calls) == model.config.num_hidden_layers - 1


def test_fused_residual_probe_failure_refuses_and_leaves_the_model(monkeypatch):
    model = _llama()
    before = _snapshot(model)
    monkeypatch.setattr(_hf_residual, "_probe_add_norm", lambda original, replacement: "a test's reason")
    with pytest.raises(PatchRefused, match="a test's reason; pass fused_residual=False"):
        logitless.patch(model)
    _assert_same(_snapshot(model), before)
    logitless.patch(model, fused_residual=False)
    assert "residual add fused" not in logitless.hf.describe(model)


class _Toy(torch.nn.Module):
    """A pre-norm block written otherwise than transformers writes it: other names, the add inside a branch."""

    def __init__(self, width=16):
        super().__init__()
        self.first, self.second = torch.nn.Linear(width, width), torch.nn.Linear(width, width)
        self.norm_a, self.norm_b = logitless.nn.RMSNorm(width), logitless.nn.RMSNorm(width)
        with torch.no_grad():
            self.norm_b.weight.normal_(1.0, 0.2)

    def forward(self, x, twice: bool = True):
        skip = x
        y = self.first(self.norm_a(x))
        if twice:
            y = self.second(y) + skip
            skip = y
            y = self.norm_b(y)
        return skip + y


class _Private(_Toy):
    def forward(self, x):
        skip = x
        y = self.__scaled(x)
        y = skip + y
        skip = y
        y = self.norm_b(y)
        return y

    def __scaled(self, x):
        return x * 2


def test_fused_residual_rewrite_by_structure():
    toy = _Toy()
    forward, fused, why = _hf_residual._rewritten(_Toy.forward, frozenset({"norm_a", "norm_b"}))
    assert fused == ("norm_b",) and why is None
    x = torch.randn(2, 3, 16, requires_grad=True)
    for twice in (True, False):
        want = toy(x, twice)
        got = forward(toy, x, twice=twice)
        assert torch.equal(got, want)
        (gx,) = torch.autograd.grad(got.sum(), x)
        (wx,) = torch.autograd.grad(want.sum(), x)
        torch.testing.assert_close(gx, wx)
    # Only the norms the patch replaced are fused; a layer that uses name-mangled names is left alone.
    assert _hf_residual._rewritten(_Toy.forward, frozenset({"norm_a"}))[:2] == (None, ())
    forward, fused, why = _hf_residual._rewritten(_Private.forward, frozenset({"norm_b"}))
    assert forward is None and "private" in why


if __name__ == "__main__":
    sys.setrecursionlimit(10000)
    print(table())
