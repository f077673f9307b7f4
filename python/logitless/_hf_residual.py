"""Residual adds fused into the next norm (``fused_residual=``). A pre-norm decoder layer adds a block's output to the
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
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
from torch import Tensor

from ._hf_layers import _names_in, _relative_error
from .nn import RMSNorm

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
