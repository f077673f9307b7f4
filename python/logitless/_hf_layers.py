"""The layer kinds of the Hugging Face patch (logitless.hf) that change what a module computes without replacing it:
gated MLPs (``swiglu=``) and rotary embeddings (``rope=``). Recognized, like the norms and the loss, by structure
and by what they compute on a probe, never by an architecture's name.

Gated MLPs. A module with children ``gate_proj``, ``up_proj`` and ``down_proj`` (or ``gate_up_proj`` and
``down_proj``, gate then up in one projection as Phi-3 has it), a forward of one argument, and no parameter
outside those children, is run on a probe input with probe weights standing in for all of its parameters (its own
may be on meta or sharded). If in float32 it computes ``down(act(gate(x)) * up(x))`` for act SiLU, tanh-approximated
GELU or exact GELU, and agrees within the dtype's noise in bfloat16 (and in the model's dtype), its forward is
replaced by an instance attribute that calls the same child modules around ``logitless.glu``: the children's own
hooks (FSDP2's, ZeRO-3's, a LoRA wrapper's forward) run as before. A module of that shape that computes something
else is left alone and noted; one that agrees in float32 but not in 16 bits refuses the patch (``swiglu=False``
leaves the MLPs alone). Experts held as fused parameter tensors (a mixture of experts' ``experts`` with
``gate_up_proj`` as a Parameter) have no such children: they are left as they are, noted, and do not refuse.

Rotary embeddings. Attention forwards call a function of their modeling module, ``apply_rotary_pos_emb(q, k, cos,
sin, ...)`` (or ``apply_rotary_pos_emb(x, cos, sin, ...)``, one tensor a call, in Gemma 3n and 4), looked up as a
module global at each call. The global is shared by every model of that architecture,
so the patch never changes it for good: the forward of each module whose code names it becomes an instance
attribute that swaps the global for a replacement while it runs and puts back what was there in a ``finally``.
The replacement is installed only after a probe showed that ``logitless.rope`` computes what the original does,
on random q, k and tables (so that a function rotating interleaved pairs, GPT-J's or GLM's, or anything but
Hugging Face's rotate_half, fails it) in float32 and within bfloat16's noise, for the full head width and, where
the original accepts them, tables narrower than the head (partial rotary applied to the first channels). At run
time, a call unlike every probed one (another layout, a position_ids argument, tables of another dtype than q,
tables that require grad) goes to the original function. An architecture whose function fails the probe keeps
it: with ``rope="auto"`` (the default) that is noted and the rest of the patch goes ahead; with ``rope=True`` it
refuses the patch. Under torch.compile the swap is not made (the original function is traced), as changing a
module global inside a traced region would cost a graph break at every attention layer.

Residual adds fused into the next norm (``fused_residual=``). A pre-norm decoder layer adds a block's output to the
residual stream and normalizes the sum for the next block, in three statements of its forward::

    hidden_states = residual + hidden_states        # any sum a + b (Phi-3: residual + dropout(hidden_states))
    residual = hidden_states
    hidden_states = self.post_attention_layernorm(hidden_states)

The layer's forward is recognized by these statements in its source (any names, in any block of the function,
the norm a child that the patch replaced by a ``logitless.nn.RMSNorm``), and rewritten with each such triple as one
statement, ``hidden_states, residual = <add_norm>(self.post_attention_layernorm, residual, hidden_states)``: the
sum and the norm of it in one pass (``rms_norm(..., residual=)``), forward and backward. Everything else of the
forward is the original's code, recompiled in its modeling module's globals with its decorators; before anything
is used, the unchanged source recompiled the same way must give the running function's bytecode (else the source
is not what runs, and the layer is left alone). The fused call is then checked on a probe, through the layer's own
norms (probe weights in place of theirs): the sum must equal torch's to the bit, and the norm of it what the
replacement norm computes on torch's sum, in float32, in bfloat16 and with a float32 residual and a bfloat16 block
output (autocast). At run time, a call the fused op cannot take (other shapes, devices or dtypes, tensor
subclasses such as DTensor, a norm with hooks or that is no longer the patch's) runs the three statements as
written. A sandwich-norm layer (Gemma 2 and 3: a norm on each block's output before the add, another before the
MLP) has one such triple, the add after the attention and the pre-feedforward norm, and gets that one fused.

The add that ends a layer is not fused with the next layer's input norm (nor the last with the model's final
norm): the two sit in different modules' forwards, and the layer's output, a sum, is what activation
checkpointing, per-layer sharding wrappers (FSDP2, ZeRO-3), hooks and ``output_hidden_states`` see between them.
"""
from __future__ import annotations
import __future__

import ast
import copy
import inspect
import types
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
from torch import Tensor

from .glu import glu
from .mlp import gated_mlp
from .nn import RMSNorm
from .rope import rope as _rope

ROPE_NAME = "apply_rotary_pos_emb"

# ----------------------------------------------------------------------------------------------------
# Gated MLPs

_GLU_ACTIVATIONS = ("silu", "gelu_tanh", "gelu")
_REFERENCE_ACTIVATIONS = {
    "silu": torch.nn.functional.silu,
    "gelu_tanh": lambda t: torch.nn.functional.gelu(t, approximate="tanh"),
    "gelu": torch.nn.functional.gelu,
}


@dataclass
class MLPSwap:
    module: torch.nn.Module
    path: str
    activation: str
    concatenated: bool


def _bare(*children: torch.nn.Module) -> bool:
    """Whether the projections are plain nn.Linear modules that nothing hooks (no adapter, quantized layer or sharding
    hook), so that `gated_mlp` may read their weights instead of calling them: it then keeps gate and up for the
    backward but not the gated unit's output."""
    return all(type(c) is torch.nn.Linear and not (c._forward_hooks or c._forward_pre_hooks) for c in children) \
        and not (torch.nn.modules.module._global_forward_hooks or torch.nn.modules.module._global_forward_pre_hooks)


def _glu_forward(activation: str, concatenated: bool):
    # One function per form, bound to each module with MethodType: copy.deepcopy(model) binds the copy's forward to
    # the copy, and the module holds no attribute of the patch besides its forward.
    if concatenated:
        def forward(self, x):
            if _bare(self.gate_up_proj, self.down_proj):
                return gated_mlp(x, self.gate_up_proj.weight, None, self.down_proj.weight, self.gate_up_proj.bias,
                                 None, self.down_proj.bias, activation=activation)
            return self.down_proj(glu(self.gate_up_proj(x), None, activation=activation))
    else:
        def forward(self, x):
            if _bare(self.gate_proj, self.up_proj, self.down_proj):
                return gated_mlp(x, self.gate_proj.weight, self.up_proj.weight, self.down_proj.weight,
                                 self.gate_proj.bias, self.up_proj.bias, self.down_proj.bias, activation=activation)
            return self.down_proj(glu(self.gate_proj(x), self.up_proj(x), activation=activation))
    forward.__doc__ = f"down_proj(logitless.glu({'gate_up_proj(x)' if concatenated else 'gate_proj(x), up_proj(x)'}, " \
                      f"activation={activation!r})): the module's computation, fused (logitless.patch)"
    forward._logitless_glu = (activation, concatenated)
    return forward


_FORWARDS = {(a, c): _glu_forward(a, c) for a in _GLU_ACTIVATIONS for c in (False, True)}


def _one_argument(module: torch.nn.Module) -> bool:
    try:
        params = list(inspect.signature(module.forward).parameters.values())
    except (TypeError, ValueError):
        return False
    return len(params) == 1 and params[0].kind in (params[0].POSITIONAL_ONLY, params[0].POSITIONAL_OR_KEYWORD)


def _probe_tensors(module: torch.nn.Module, dtype: torch.dtype, g: torch.Generator) -> Dict[str, Tensor]:
    # Random stand-ins for every parameter (scaled as an initializer would, so that the activations sit where they
    # bend), copies of the buffers: nothing of the module is read on its device or changed.
    tensors = {}
    for name, p in module.named_parameters():
        fan_in = p.shape[-1] if p.dim() > 1 else 1
        tensors[name] = (torch.randn(tuple(p.shape), generator=g) * fan_in ** -0.5 * 2.0).to(dtype)
    for name, b in module.named_buffers():
        tensors[name] = b.detach().to("cpu", copy=True)
    return tensors


def _children_call(module, tensors, name, x):
    child = getattr(module, name)
    prefix = name + "."
    sub = {k[len(prefix):]: v for k, v in tensors.items() if k.startswith(prefix)}
    return torch.func.functional_call(child, sub, (x,))


def _expected(module, tensors, x, activation: str, concatenated: bool) -> Tensor:
    """down(act(gate(x)) * up(x)) through the module's own children, in x's dtype with torch's ops."""
    if concatenated:
        gate, up = _children_call(module, tensors, "gate_up_proj", x).chunk(2, dim=-1)
    else:
        gate, up = _children_call(module, tensors, "gate_proj", x), _children_call(module, tensors, "up_proj", x)
    return _children_call(module, tensors, "down_proj", _REFERENCE_ACTIVATIONS[activation](gate) * up)


def _fused(module, tensors, x, activation: str, concatenated: bool) -> Tensor:
    """What the replacement forward computes, on the probe's tensors."""
    if concatenated:
        h = glu(_children_call(module, tensors, "gate_up_proj", x), None, activation=activation)
    else:
        h = glu(_children_call(module, tensors, "gate_proj", x), _children_call(module, tensors, "up_proj", x),
                activation=activation)
    return _children_call(module, tensors, "down_proj", h)


def _relative_error(got: Any, want: Tensor) -> float:
    if not isinstance(got, Tensor) or got.shape != want.shape or got.dtype != want.dtype:
        return float("inf")
    scale = want.float().abs().max().item() + 1e-30
    return (got.float().cpu() - want.float()).abs().max().item() / scale


def probe_gated_mlp(module: torch.nn.Module, path: str) -> Tuple[Optional[MLPSwap], Optional[str], Optional[str]]:
    """(swap, refusal, note) for one module; all None when it is not shaped like a gated MLP at all."""
    children = dict(module.named_children())
    own = dict(module.named_parameters(recurse=False))
    if "down_proj" in own and ("gate_up_proj" in own or "gate_proj" in own):
        # A mixture of experts' experts, all in one tensor per projection: no child Linear to call.
        return None, None, f"{type(module).__name__}: experts as fused parameter tensors, left as they are"
    if "down_proj" not in children:
        return None, None, None
    if {"gate_proj", "up_proj"} <= set(children):
        concatenated = False
    elif "gate_up_proj" in children:
        concatenated = True
    else:
        return None, None, None
    what = type(module).__name__
    used = {"gate_up_proj", "down_proj"} if concatenated else {"gate_proj", "up_proj", "down_proj"}
    if "forward" in module.__dict__:
        return None, None, f"{what}: a gated MLP's shape, with a forward set on the instance (a hook's): left alone"
    if not _one_argument(module):
        return None, None, f"{what}: a gated MLP's children, a forward of more than one argument: left alone"
    own = [n for n, _ in module.named_parameters() if n.split(".", 1)[0] not in used]
    if own:
        return None, None, f"{what}: a gated MLP's children and parameters besides ({', '.join(own)}): left alone"
    for name in used:
        if not isinstance(getattr(module, name), torch.nn.Module):
            return None, None, None
    weights = [p for p in module.parameters()]
    if not weights:
        return None, None, None
    width = getattr(module, "gate_up_proj" if concatenated else "gate_proj")
    width = getattr(width, "in_features", None) or next(p for p in width.parameters() if p.dim() == 2).shape[-1]
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 3, width, generator=g)
    tensors = _probe_tensors(module, torch.float32, g)
    try:
        with torch.no_grad():
            y = torch.func.functional_call(module, tensors, (x,))
    except Exception as e:
        return None, None, f"{what}: a gated MLP's children, a float32 probe raised {type(e).__name__}: left alone"
    # The activation it computes: the one whose reference agrees to float32 rounding (exact and tanh GELU differ by
    # 1e-4 relative on these inputs, far above it).
    found = None
    try:
        with torch.no_grad():
            for activation in _GLU_ACTIVATIONS:
                if _relative_error(y, _expected(module, tensors, x, activation, concatenated)) <= 1e-5:
                    found = activation
                    break
    except Exception as e:
        return None, None, f"{what}: its children do not compose as a gated MLP ({type(e).__name__}): left alone"
    if found is None:
        return None, None, f"{what}: not down(act(gate(x)) * up(x)) for SiLU or GELU on a float32 probe: left alone"
    # In 16 bits (bfloat16, and the model's dtype if it is another), the replacement must agree with the module as
    # its own torch ops would with a float32 reference: within the dtype's noise. What this catches is a module
    # whose computation depends on the dtype (an upcast the fused op does not make, a branch).
    dtypes = [torch.bfloat16]
    model_dtype = weights[0].dtype
    if model_dtype.is_floating_point and model_dtype not in (torch.float32, torch.bfloat16, torch.float64):
        dtypes.append(model_dtype)
    try:
        with torch.no_grad():
            for dtype in dtypes:
                t16 = {k: (v.to(dtype) if v.is_floating_point() else v) for k, v in tensors.items()}
                y16 = torch.func.functional_call(module, t16, (x.to(dtype),))
                err = _relative_error(_fused(module, t16, x.to(dtype), found, concatenated), y16)
                if not err <= 2.0 ** -5:
                    return None, (f"{what} computes down({found}-GLU) in float32 but differs from logitless.glu by "
                                  f"{err:.2g} (relative) in {dtype}"), None
    except Exception as e:
        return None, f"{what} computes down({found}-GLU) in float32 but raised {type(e).__name__} in 16 bits: {e}", None
    return MLPSwap(module, path, found, concatenated), None, None


def plan_mlps(model: torch.nn.Module, reasons: List[str], notes: List[str]) -> List[MLPSwap]:
    """The gated MLPs to swap (each module once, wherever it is reachable); nothing is changed."""
    swaps, seen = [], set()
    for path, module in model.named_modules():
        if id(module) in seen:
            continue
        seen.add(id(module))
        swap, refusal, note = probe_gated_mlp(module, path)
        if refusal is not None:
            reasons.append(f"{path}: {refusal}; pass swiglu=False to leave the MLPs as they are")
        elif note is not None:
            notes.append(f"{path}: {note}")
        elif swap is not None:
            swaps.append(swap)
    return swaps


def apply_mlps(swaps: List[MLPSwap]) -> None:
    for swap in swaps:
        swap.module.forward = types.MethodType(_FORWARDS[(swap.activation, swap.concatenated)], swap.module)


def revert_mlps(swaps: List[MLPSwap]) -> None:
    for swap in reversed(swaps):
        swap.module.__dict__.pop("forward", None)


# ----------------------------------------------------------------------------------------------------
# Rotary embeddings


@dataclass
class RopeSite:
    """One modeling module's apply_rotary_pos_emb, verified: the globals it lives in, the original, the
    replacement, and the modules whose forward swaps it in while they run."""
    namespace: Dict[str, Any]
    module_name: str
    original: Callable
    replacement: Callable
    calls: str                                   # what the probe verified, for describe()
    modules: List[Tuple[torch.nn.Module, str]] = field(default_factory=list)

    def __deepcopy__(self, memo):
        # copy.deepcopy(model) copies the modules; the modeling module's globals and its functions are shared (a
        # namespace holds modules, which cannot be copied, and the copy's forwards swap the same global).
        return RopeSite(self.namespace, self.module_name, self.original, self.replacement, self.calls,
                        copy.deepcopy(self.modules, memo))


def _names_in(code: types.CodeType) -> set:
    names = set(code.co_names)
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            names |= _names_in(const)
    return names


def _calls_rope(cls) -> Optional[Dict[str, Any]]:
    """The globals in which the class's forward looks up apply_rotary_pos_emb, if its code names it."""
    for klass in cls.__mro__:
        fn = klass.__dict__.get("forward")
        fn = getattr(fn, "__wrapped__", fn)
        code = getattr(fn, "__code__", None)
        if code is not None:
            return fn.__globals__ if ROPE_NAME in _names_in(code) else None
    return None


_ROPE_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def _bind(signature: inspect.Signature, args, kwargs):
    try:
        bound = signature.bind(*args, **kwargs)
    except TypeError:
        return None
    bound.apply_defaults()
    return bound.arguments


def _usable(arguments, widths: set, layouts: set) -> bool:
    """Whether a call is one the probe verified: q and k [B, H, T, D] (or [B, T, H, D] with unsqueeze_dim 2), tables
    [B or 1, T, Dr] of q's dtype that need no gradient, no position_ids. The one-tensor form (x, cos, sin) is
    checked as q = k = x."""
    if "x" in arguments:
        q = k = arguments["x"]
        cos, sin = arguments.get("cos"), arguments.get("sin")
    else:
        q, k, cos, sin = (arguments.get(n) for n in ("q", "k", "cos", "sin"))
    if not all(isinstance(t, Tensor) for t in (q, k, cos, sin)):
        return False
    if arguments.get("position_ids") is not None:
        return False
    layout = arguments.get("unsqueeze_dim", 1)
    if layout not in layouts or q.dim() != 4 or k.dim() != 4 or cos.dim() != 3 or sin.shape != cos.shape:
        return False
    if not (q.dtype == k.dtype == cos.dtype == sin.dtype) or q.dtype not in _ROPE_DTYPES:
        return False
    if cos.requires_grad or sin.requires_grad or not (q.device == k.device == cos.device == sin.device):
        return False
    t_axis = 2 if layout == 1 else 1
    d, dr = q.shape[-1], cos.shape[-1]
    if k.shape[-1] != d or k.shape[0] != q.shape[0] or k.shape[t_axis] != q.shape[t_axis]:
        return False
    if cos.shape[1] != q.shape[t_axis] or cos.shape[0] not in (1, q.shape[0]) or dr % 2 or dr > d:
        return False
    return ("full" if dr == d else "partial") in widths


def _fused_rope(q, k, cos, sin, layout):
    """(q_rot, k_rot); q_rot alone when k is None (the one-tensor form)."""
    if layout == 2:  # [B, T, H, D]: the same rotation seen as [B, H, T, D] (views, no copy)
        q_rot, k_rot = _rope(q.transpose(1, 2), None if k is None else k.transpose(1, 2), cos, sin)
        q_rot, k_rot = q_rot.transpose(1, 2), (None if k is None else k_rot.transpose(1, 2))
    else:
        q_rot, k_rot = _rope(q, k, cos, sin)
    return q_rot if k is None else (q_rot, k_rot)


def _replacement(original: Callable, signature: inspect.Signature, widths: set, layouts: set) -> Callable:
    def apply_rotary_pos_emb(*args, **kwargs):
        arguments = _bind(signature, args, kwargs)
        if arguments is None or not _usable(arguments, widths, layouts):
            return original(*args, **kwargs)
        q, k = (arguments["x"], None) if "x" in arguments else (arguments["q"], arguments["k"])
        return _fused_rope(q, k, arguments["cos"], arguments["sin"], arguments.get("unsqueeze_dim", 1))

    apply_rotary_pos_emb.__wrapped__ = original
    apply_rotary_pos_emb.__doc__ = "logitless.rope in place of the modeling module's apply_rotary_pos_emb " \
                                   "(verified equal on a probe; other calls go to the original)"
    return apply_rotary_pos_emb


def _probe_rope(original: Callable) -> Tuple[Optional[Callable], str]:
    """(replacement, what it verified) or (None, why not)."""
    try:
        signature = inspect.signature(original)
    except (TypeError, ValueError):
        return None, "its signature cannot be read"
    names = list(signature.parameters)
    # Two forms: q and k rotated by one call, or one tensor per call (Gemma 3n and 4 rotate q and k apart).
    single = names[:3] == ["x", "cos", "sin"]
    first = names[:3] if single else names[:4]
    if not single and first != ["q", "k", "cos", "sin"]:
        return None, f"its arguments are ({', '.join(names)}), not (q, k, cos, sin, ...) nor (x, cos, sin, ...)"
    rest = [p for n, p in signature.parameters.items() if n not in first]
    if any(p.default is inspect.Parameter.empty and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD) for p in rest):
        return None, f"it requires more arguments than ({', '.join(first)}): ({', '.join(names)})"
    b, hq, hk, t, d = 2, 3, 1, 5, 16
    g = torch.Generator().manual_seed(0)
    layouts = {1} | ({2} if "unsqueeze_dim" in signature.parameters else set())
    verified: Dict[Tuple[str, int], bool] = {}
    failures = []
    for layout in sorted(layouts):
        for width, dr in (("full", d), ("partial", d // 2)):
            ok = True
            for dtype in (torch.float32, torch.bfloat16):
                q = torch.randn(b, hq, t, d, generator=g)
                k = torch.randn(b, hk, t, d, generator=g)
                # Random tables, not cos and sin of angles: only the rotate_half form agrees on them everywhere.
                cos, sin = torch.randn(b, t, dr, generator=g), torch.randn(b, t, dr, generator=g)
                q, k, cos, sin = (x.to(dtype) for x in (q, k, cos, sin))
                if layout == 2:
                    q, k = q.transpose(1, 2).contiguous(), k.transpose(1, 2).contiguous()
                kwargs = {} if layout == 1 else {"unsqueeze_dim": 2}
                try:
                    with torch.no_grad():
                        if single:
                            want = (original(q.clone(), cos, sin, **kwargs), original(k.clone(), cos, sin, **kwargs))
                        else:
                            want = original(q.clone(), k.clone(), cos, sin, **kwargs)
                except Exception:
                    ok = False  # a call the original does not accept: the replacement passes it on
                    break
                if not isinstance(want, (tuple, list)) or len(want) != 2:
                    return None, "it does not return (q_embed, k_embed)"
                with torch.no_grad():
                    got = (_fused_rope(q, None, cos, sin, layout), _fused_rope(k, None, cos, sin, layout)) \
                        if single else _fused_rope(q, k, cos, sin, layout)
                tol = 1e-5 if dtype == torch.float32 else 2.0 ** -6
                errs = [_relative_error(gv, wv) if isinstance(wv, Tensor) else float("inf")
                        for gv, wv in zip(got, want)]
                if not max(errs) <= tol:
                    ok = False
                    failures.append(f"{width} width{'' if layout == 1 else ', [B, T, H, D]'} in {dtype}: "
                                    f"{max(errs):.2g} relative")
                    break
            verified[(width, layout)] = ok
    if failures:
        # Anything it computes that the rotate_half form does not: another convention (interleaved pairs), not
        # to be swapped for any call.
        return None, "it computes another rotation than logitless.rope (" + "; ".join(failures) + ")"
    widths = {w for (w, layout), ok in verified.items() if ok and layout == 1}
    layouts_ok = {layout for (w, layout), ok in verified.items() if ok}
    if "full" not in widths:
        return None, "it does not accept tables as wide as the head"
    # Layout 2 is used only for the widths verified in it too.
    if any(verified.get((w, 2)) is False for w in widths):
        layouts_ok.discard(2)
    calls = f"{' and '.join(sorted(widths))} width" + (", both layouts" if 2 in layouts_ok else "")
    return _replacement(original, signature, widths, layouts_ok), calls


class _Unswappable(Exception):
    pass


def plan_rope(model: torch.nn.Module, mode, reasons: List[str], notes: List[str]) -> List[RopeSite]:
    """The rotary functions to swap and the modules that swap them in; nothing is changed. mode: True (every one
    found must verify, else a refusal) or "auto" (what verifies; the rest noted)."""
    sites: Dict[int, RopeSite] = {}
    failed: Dict[int, str] = {}
    seen = set()
    for path, module in model.named_modules():
        if id(module) in seen:
            continue
        seen.add(id(module))
        namespace = _calls_rope(type(module))
        if namespace is None:
            continue
        key = id(namespace)
        if key not in sites and key not in failed:
            module_name = namespace.get("__name__", "?")
            original = namespace.get(ROPE_NAME)
            if getattr(original, "__wrapped__", None) is not None and original.__doc__ and \
                    original.__doc__.startswith("logitless.rope"):
                original = original.__wrapped__  # a patched model's forward is running: its original
            if not callable(original):
                failed[key] = f"{module_name}.{ROPE_NAME} is not a function"
            else:
                replacement, what = _probe_rope(original)
                if replacement is None:
                    failed[key] = f"{module_name}.{ROPE_NAME}: {what}"
                else:
                    sites[key] = RopeSite(namespace, module_name, original, replacement, what)
        if key in failed:
            continue
        if "forward" in module.__dict__:
            notes.append(f"{path}: calls {ROPE_NAME}, with a forward set on the instance (a hook's): left alone")
            continue
        sites[key].modules.append((module, path))
    for why in failed.values():
        if mode is True:
            reasons.append(f"rope: {why}; pass rope='auto' to swap only what verifies, or rope=False")
        else:
            notes.append(f"rope not swapped: {why}")
    return [s for s in sites.values() if s.modules]


def _rope_forward(site: RopeSite):
    namespace, original, replacement = site.namespace, site.original, site.replacement

    def forward(self, *args, **kwargs):
        current = namespace.get(ROPE_NAME)
        # Only over the function probed: one put there by someone else since (another library's patch) is theirs.
        if torch.compiler.is_compiling() or (current is not original and current is not replacement):
            return type(self).forward(self, *args, **kwargs)
        namespace[ROPE_NAME] = replacement
        try:
            return type(self).forward(self, *args, **kwargs)
        finally:
            namespace[ROPE_NAME] = current

    forward._logitless_rope = site.module_name
    return forward


def apply_rope(sites: List[RopeSite]) -> None:
    for site in sites:
        forward = _rope_forward(site)
        for module, _ in site.modules:
            module.forward = types.MethodType(forward, module)


def revert_rope(sites: List[RopeSite]) -> None:
    for site in reversed(sites):
        for module, _ in site.modules:
            module.__dict__.pop("forward", None)


# ----------------------------------------------------------------------------------------------------
# Residual adds fused into the next norm

_ADD_NORM = "_logitless_add_norm"  # the helper's name inside a rewritten forward (a closure variable)
_FUSABLE_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def _no_hooks(norm: torch.nn.Module) -> bool:
    # A hook on the norm would see a tuple come out of it (or, for a global one, of every norm): such calls run
    # unfused.
    own = (norm._forward_hooks, norm._forward_pre_hooks, norm._backward_hooks, norm._backward_pre_hooks)
    shared = (getattr(torch.nn.modules.module, name, None) for name in
              ("_global_forward_hooks", "_global_forward_pre_hooks", "_global_backward_hooks",
               "_global_backward_pre_hooks"))
    return not any(own) and not any(shared)


def _fusable(norm, a, b) -> bool:
    return (isinstance(norm, RMSNorm) and type(a) is Tensor and type(b) is Tensor and a.shape == b.shape
            and a.device == b.device and a.dtype in _FUSABLE_DTYPES and b.dtype in _FUSABLE_DTYPES
            and 1 <= a.dim() <= 4 and _no_hooks(norm))


def _fused_add_norm(norm: Callable, a: Tensor, b: Tensor) -> Tuple[Tensor, Tensor]:
    # Both in the dtype torch's a + b promotes to (a float32 residual and a bfloat16 block output under autocast):
    # the float32 sum of exactly converted operands, as torch computes it.
    dtype = torch.promote_types(a.dtype, b.dtype)
    return norm(a.to(dtype), residual=b.to(dtype))


def add_norm(norm, a, b):
    """(norm(a + b), a + b): what ``s = a + b; y = norm(s)`` gives, in one pass where `norm` is logitless's RMSNorm
    and the operands are tensors it takes; otherwise as written."""
    if _fusable(norm, a, b):
        return _fused_add_norm(norm, a, b)
    s = a + b
    return norm(s), s


@dataclass
class ResidualSwap:
    module: torch.nn.Module
    path: str
    norms: Tuple[str, ...]        # the children whose input sum is fused, in the forward's order
    forward: Callable             # the instance forward: the rewritten one, wrapped as the class's


def _pure(node: ast.AST) -> bool:
    """An expression whose evaluation order relative to an attribute lookup on self cannot matter."""
    return not any(isinstance(n, (ast.NamedExpr, ast.Yield, ast.YieldFrom, ast.Await)) for n in ast.walk(node))


def _name(node, expected: Optional[str] = None) -> Optional[str]:
    if isinstance(node, ast.Name) and (expected is None or node.id == expected):
        return node.id
    return None


def _match_triple(stmts: List[ast.stmt], i: int, self_name: str, norms: set) -> Optional[Tuple[str, str, str]]:
    """(sum's name, residual's name, norm child) if stmts[i:i + 3] are ``x = a + b; r = x; x = self.norm(x)``."""
    s1, s2, s3 = stmts[i:i + 3]
    if not all(isinstance(s, ast.Assign) and len(s.targets) == 1 for s in (s1, s2, s3)):
        return None
    x = _name(s1.targets[0])
    if x is None or not isinstance(s1.value, ast.BinOp) or not isinstance(s1.value.op, ast.Add):
        return None
    r = _name(s2.targets[0])
    if r is None or r == x or _name(s2.value, x) is None or _name(s3.targets[0], x) is None:
        return None
    call = s3.value
    if not (isinstance(call, ast.Call) and len(call.args) == 1 and not call.keywords and _name(call.args[0], x)
            and isinstance(call.func, ast.Attribute) and _name(call.func.value, self_name)):
        return None
    if call.func.attr not in norms or not _pure(s1.value):
        return None
    return x, r, call.func.attr


def _fused_statement(stmts, i, x: str, r: str, norm: str, self_name: str) -> ast.stmt:
    add = stmts[i].value
    new = ast.Assign(
        targets=[ast.Tuple(elts=[ast.Name(x, ast.Store()), ast.Name(r, ast.Store())], ctx=ast.Store())],
        value=ast.Call(func=ast.Name(_ADD_NORM, ast.Load()),
                       args=[ast.Attribute(ast.Name(self_name, ast.Load()), norm, ast.Load()), add.left, add.right],
                       keywords=[]))
    return ast.copy_location(new, stmts[i])


def _rewrite_blocks(node: ast.AST, self_name: str, norms: set, found: List[str]) -> None:
    """Replaces every matching triple in the function's statement lists (not in nested functions or classes)."""
    for field_name in ("body", "orelse", "finalbody", "handlers", "cases"):
        stmts = getattr(node, field_name, None)
        if not isinstance(stmts, list):
            continue
        i = 0
        while i < len(stmts):
            match = _match_triple(stmts, i, self_name, norms) if i + 3 <= len(stmts) else None
            if match is not None:
                stmts[i:i + 3] = [_fused_statement(stmts, i, *match, self_name)]
                found.append(match[2])
            elif not isinstance(stmts[i], (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                _rewrite_blocks(stmts[i], self_name, norms, found)
            i += 1


# The __future__ features a code object's flags carry, to compile the rewrite under the same ones.
_FUTURE_FLAGS = __future__.annotations.compiler_flag | __future__.generator_stop.compiler_flag | \
    __future__.barry_as_FLUFL.compiler_flag


def _compile_in_place(function, fdef: ast.FunctionDef) -> Callable:
    """The function `fdef` defines (its decorators left out: the running wrappers are reused, see _rewrap), in
    `function`'s module globals, with the helper and `__class__` (for a zero-argument super()) as closure
    variables, and `function`'s defaults."""
    fdef.decorator_list = []
    outer = ast.parse(f"def _logitless_make(__class__, {_ADD_NORM}):\n    pass\n").body[0]
    outer.body = [fdef, ast.Return(ast.Name(fdef.name, ast.Load()))]
    module = ast.fix_missing_locations(ast.Module(body=[outer], type_ignores=[]))
    code = compile(module, function.__code__.co_filename, "exec",
                   flags=function.__code__.co_flags & _FUTURE_FLAGS, dont_inherit=True)
    namespace: Dict[str, Any] = {}
    exec(code, function.__globals__, namespace)  # the def lands in `namespace`, not in the module's globals
    cells = dict(zip(function.__code__.co_freevars, function.__closure__ or ()))
    owner = cells["__class__"].cell_contents if "__class__" in cells else None
    compiled = namespace["_logitless_make"](owner, add_norm)
    compiled.__defaults__, compiled.__kwdefaults__ = function.__defaults__, function.__kwdefaults__
    compiled.__qualname__, compiled.__module__, compiled.__doc__ = \
        function.__qualname__, function.__module__, function.__doc__
    return compiled


def _same_code(a: types.CodeType, b: types.CodeType) -> bool:
    """The same bytecode, names and constants, nested code (comprehensions, lambdas) included; line numbers aside."""
    if not (a.co_code == b.co_code and a.co_names == b.co_names and a.co_varnames == b.co_varnames
            and a.co_freevars == b.co_freevars and a.co_cellvars == b.co_cellvars and a.co_argcount == b.co_argcount
            and a.co_kwonlyargcount == b.co_kwonlyargcount and len(a.co_consts) == len(b.co_consts)):
        return False
    for x, y in zip(a.co_consts, b.co_consts):
        if isinstance(x, types.CodeType) or isinstance(y, types.CodeType):
            if not (isinstance(x, types.CodeType) and isinstance(y, types.CodeType) and _same_code(x, y)):
                return False
        elif type(x) is not type(y) or x != y:
            return False
    return True


def _cell_contents(cell) -> Any:
    try:
        return cell.cell_contents
    except ValueError:  # an empty cell
        return None


def _rewrap(wrapper: Callable, inner: Callable) -> Optional[Callable]:
    """A copy of `wrapper` (a functools.wraps closure over the function it wraps) that calls `inner` instead: the
    same code and the same cells but the one holding the wrapped function. Its other cells are shared, so a wrapper
    that compares against itself (transformers' checkpointing wrapper asks whether it is the class's forward) still
    finds the class's."""
    target = wrapper.__wrapped__
    if not isinstance(wrapper, types.FunctionType):
        return None
    cells = wrapper.__closure__ or ()
    hits = [i for i, cell in enumerate(cells) if _cell_contents(cell) is target]
    if len(hits) != 1:
        return None
    closure = tuple(types.CellType(inner) if i == hits[0] else cell for i, cell in enumerate(cells))
    copied = types.FunctionType(wrapper.__code__, wrapper.__globals__, wrapper.__name__, wrapper.__defaults__,
                                closure)
    copied.__kwdefaults__ = wrapper.__kwdefaults__
    copied.__dict__.update(wrapper.__dict__)
    copied.__wrapped__ = inner
    copied.__qualname__, copied.__module__, copied.__doc__ = wrapper.__qualname__, wrapper.__module__, wrapper.__doc__
    return copied


def _rewrapped(decorated: Callable, inner: Callable) -> Optional[Callable]:
    """`decorated`'s chain of wrappers (its decorators, and what its class wrapped it in) around `inner` in place
    of the innermost function; None where a wrapper is not a closure over the function it wraps."""
    chain = [decorated]
    while hasattr(chain[-1], "__wrapped__"):
        chain.append(chain[-1].__wrapped__)
    for wrapper in reversed(chain[:-1]):
        inner = _rewrap(wrapper, inner)
        if inner is None:
            return None
    return inner


_REWRITES: Dict[Tuple[Any, frozenset], Tuple[Optional[Callable], Tuple[str, ...], Optional[str]]] = {}


def _source_tree(function) -> ast.FunctionDef:
    source = inspect.getsource(function)
    # A method's source is indented: parsed inside an `if` block rather than dedented, which would change the
    # contents of its multi-line strings (the docstring is a constant of the code compared with the running one).
    indented = source[:1] in (" ", "\t")
    tree = ast.parse("if 1:\n" + source if indented else source)
    fdef = tree.body[0].body[0] if indented else tree.body[0]
    ast.increment_lineno(fdef, function.__code__.co_firstlineno - (2 if indented else 1))
    if not isinstance(fdef, ast.FunctionDef) or fdef.name != function.__name__:
        raise ValueError("its source is not a def of that function")
    return fdef


def _rewritten(decorated: Callable, norms: frozenset):
    """(forward, fused norm children, None), or (None, (), why not; None if it has no such add). Cached per
    function and norm set."""
    key = (decorated, norms)
    if key not in _REWRITES:
        try:
            _REWRITES[key] = _rewrite(decorated, norms)
        except Exception as e:  # no source, or source that does not compile back to what runs
            _REWRITES[key] = (None, (), f"its forward's source cannot be read or recompiled ({type(e).__name__}: {e})")
    return _REWRITES[key]


def _rewrite(decorated: Callable, norms: frozenset):
    function = inspect.unwrap(decorated)
    fdef = _source_tree(function)
    args = fdef.args.posonlyargs + fdef.args.args
    if not args:
        return None, (), None
    original = copy.deepcopy(fdef)
    found: List[str] = []
    _rewrite_blocks(fdef, args[0].arg, set(norms), found)
    if not found:
        return None, (), None
    cells = set(function.__code__.co_freevars) - {"__class__"}
    if cells:
        return None, (), f"its forward is a closure (over {', '.join(sorted(cells))})"
    if any(isinstance(n, (ast.Name, ast.Attribute)) and _private(n) for n in ast.walk(original)):
        return None, (), "its forward uses private (name-mangled) names"
    if not _same_code(_compile_in_place(function, original).__code__, function.__code__):
        return None, (), "its forward's source does not compile to the code that runs"
    forward = _rewrapped(decorated, _compile_in_place(function, fdef))
    if forward is None:
        return None, (), "its forward is wrapped by something that is not a closure over it"
    return forward, tuple(found), None


def _private(node) -> bool:
    name = node.id if isinstance(node, ast.Name) else node.attr
    return name.startswith("__") and not name.endswith("__")


def _probe_add_norm(original: torch.nn.Module, replacement: torch.nn.Module) -> Optional[str]:
    """Why the fused call differs from torch's sum and the replacement norm on it (None: it does not), on probe
    weights standing in for the norm's own."""
    weight = getattr(replacement, "weight", None)
    dim = weight.shape[0] if isinstance(weight, Tensor) else 24
    g = torch.Generator().manual_seed(0)
    w = torch.randn(dim, generator=g) * 0.5 + 0.5
    for a_dtype, b_dtype in ((torch.float32,) * 2, (torch.bfloat16,) * 2, (torch.bfloat16, torch.float32)):
        a = (torch.randn(2, 5, dim, generator=g) * 3.0).to(a_dtype)
        b = (torch.randn(2, 5, dim, generator=g) * 3.0).to(b_dtype)
        dtype = torch.promote_types(a_dtype, b_dtype)
        tensors = {} if weight is None else {"weight": w.to(dtype)}

        def norm(x, residual=None):
            extra = {} if residual is None else {"residual": residual}
            return torch.func.functional_call(replacement, tensors, (x,), extra)

        with torch.no_grad():
            want_s = a + b
            want_y = norm(want_s)
            y, s = _fused_add_norm(norm, a, b)
            # The original module on torch's sum: within the dtype's noise (the norm's own swap fixed how it
            # rounds).
            module_y = torch.func.functional_call(original, _original_tensors(original, w.to(dtype)), (want_s,))
        if not torch.equal(s, want_s):
            return f"its sum differs from torch's in {a_dtype} + {b_dtype}"
        tol = 1e-6 if dtype == torch.float32 else 2.0 ** -7
        err = _relative_error(y, want_y)
        if not err <= tol:
            return f"the norm of the sum differs by {err:.2g} (relative) in {a_dtype} + {b_dtype}"
        err = _relative_error(y, module_y.to(y.dtype) if isinstance(module_y, Tensor) else module_y)
        if not err <= (1e-5 if dtype == torch.float32 else 2.0 ** -6):
            return f"the norm of the sum differs from {type(original).__name__}'s by {err:.2g} (relative) in " \
                   f"{a_dtype} + {b_dtype}"
    return None


def _original_tensors(original: torch.nn.Module, w: Tensor) -> Dict[str, Tensor]:
    # Probe stand-ins: the weight, and copies of the buffers (the module's own may be on meta or another device).
    tensors = {name: b.detach().to("cpu", copy=True) for name, b in original.named_buffers(recurse=False)}
    if isinstance(getattr(original, "weight", None), torch.nn.Parameter):
        tensors["weight"] = w
    return tensors


def plan_residuals(model: torch.nn.Module, norms: Dict[Tuple[int, str], Tuple[torch.nn.Module, torch.nn.Module]],
                   taken: set, reasons: List[str], notes: List[str]) -> List[ResidualSwap]:
    """The layers whose residual adds get fused into the norm after them; nothing is changed. `norms`: the children
    the patch replaces by a logitless RMSNorm, (id(parent), attr) -> (original, replacement); `taken`: ids of the
    modules whose forward another part of the patch sets."""
    swaps, seen, probed = [], set(), {}
    for path, module in model.named_modules():
        if id(module) in seen:
            continue
        seen.add(id(module))
        mine = {attr for attr, _ in module.named_children() if (id(module), attr) in norms}
        decorated = _class_forward(type(module))
        if not mine or decorated is None or not mine & _names_in(inspect.unwrap(decorated).__code__):
            continue
        what = type(module).__name__
        forward, fused, why = _rewritten(decorated, frozenset(mine))
        if forward is None:
            if why is not None:
                notes.append(f"{path}: {what}: residual adds not fused: {why}")
            continue
        if "forward" in module.__dict__ or id(module) in taken:
            notes.append(f"{path}: {what}: residual adds not fused: a forward set on the instance")
            continue
        for attr in fused:
            original, replacement = norms[(id(module), attr)]
            if id(replacement) not in probed:
                probed[id(replacement)] = _probe_add_norm(original, replacement)
            if probed[id(replacement)] is not None:
                reasons.append(f"{path}.{attr}: the residual add fused into it: {probed[id(replacement)]}; pass "
                               f"fused_residual=False to leave the adds as they are")
        swaps.append(ResidualSwap(module, path, fused, _layer_forward(decorated, forward, fused)))
    return swaps


def _class_forward(cls) -> Optional[Callable]:
    for klass in cls.__mro__:
        if "forward" in klass.__dict__:
            fn = klass.__dict__["forward"]
            return fn if isinstance(fn, types.FunctionType) else None
    return None


def _layer_forward(decorated: Callable, rewritten: Callable, fused: Tuple[str, ...]) -> Callable:
    """The patched layer's forward: the rewrite of its class's forward. A class that changed since (FSDP2's
    fully_shard swaps in a subclass, which transformers wraps again for checkpointing) gets the rewrite of its own
    forward, so that its wrappers run as its own would; where that rewrite fuses other norms or none, its forward as
    it is."""
    def forward(self, *args, **kwargs):
        current = type(self).forward
        if current is decorated:
            return rewritten(self, *args, **kwargs)
        again, fused_again, _ = _rewritten(current, frozenset(fused))
        if again is None or set(fused_again) != set(fused):
            return current(self, *args, **kwargs)
        return again(self, *args, **kwargs)

    forward._logitless_fused_residual = fused
    return forward


def apply_residuals(swaps: List[ResidualSwap]) -> None:
    for swap in swaps:
        swap.module.forward = types.MethodType(swap.forward, swap.module)


def revert_residuals(swaps: List[ResidualSwap]) -> None:
    for swap in reversed(swaps):
        swap.module.__dict__.pop("forward", None)


def describe_lines(mlps: List[MLPSwap], ropes: List[RopeSite], residuals: List[ResidualSwap]) -> List[str]:
    lines = []
    for swap in residuals:
        lines.append(f"{swap.path}: {type(swap.module).__name__} forward -> residual add fused into "
                     f"{', '.join(swap.norms)} (rms_norm with residual=)")
    for swap in mlps:
        form = "gate_up_proj" if swap.concatenated else "gate_proj, up_proj"
        lines.append(f"{swap.path}: {type(swap.module).__name__} forward -> down_proj(glu({form}, "
                     f"activation={swap.activation!r}))")
    for site in ropes:
        paths = [p for _, p in site.modules]
        lines.append(f"rope: {site.module_name}.{ROPE_NAME} -> logitless.rope ({site.calls}) while "
                     f"{len(paths)} module{'s' * (len(paths) != 1)} run ({', '.join(paths[:3])}"
                     f"{', ...' if len(paths) > 3 else ''})")
    return lines
