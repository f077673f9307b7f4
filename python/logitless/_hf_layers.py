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

Residual adds fused into the next norm (``fused_residual=``): python/logitless/_hf_residual.py.
"""
from __future__ import annotations

import copy
import inspect
import types
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Dict, List, Optional, Tuple

import torch
from torch import Tensor

from .glu import glu
from .mlp import gated_mlp
from .rope import rope as _rope

if TYPE_CHECKING:
    from ._hf_residual import ResidualSwap

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
