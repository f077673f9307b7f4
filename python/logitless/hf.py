"""Hugging Face transformers (5.x) drop-in: `patch` a causal language model so that its RMSNorm modules run
``logitless.rms_norm`` and its loss runs ``logitless.linear_cross_entropy`` from the last hidden states, the
``[tokens, vocab]`` logits never formed; `unpatch` puts everything back.

Nothing here is keyed on an architecture's name or on the transformers version. `patch` decides from what the
model computes, checked before anything is changed:

* ``rms_norm=True``: every module that computes an RMSNorm of its one input is replaced by a
  ``logitless.nn.RMSNorm`` (or, for a norm without a weight, a subclass that scales by one). A module qualifies by
  its shape (no submodules, at most a 1-d ``weight`` parameter, an epsilon attribute: ``variance_epsilon``,
  ``eps`` or ``epsilon``, a forward of one argument) and then by its outputs: it is run on a probe input with a
  probe weight, in float32 (which fixes the form: weight or none, ``weight`` or ``1 + weight``, the epsilon) and
  in bfloat16 (which fixes where it rounds: logitless's casting modes "llama", "gemma", "none"). A module whose
  float32 output is not an RMSNorm (a LayerNorm without bias, say) is left as it is; one that is an RMSNorm in
  float32 but rounds as no casting mode does refuses the patch. The replacement keeps the module's weight
  Parameter (the same object: optimizers, state dicts and tied references see no change).
* ``cross_entropy=True``: the model must call ``get_output_embeddings()``, a ``torch.nn.Linear`` (tied or not,
  with or without bias), once on the decoder's output, and hand what comes out to the standard causal-LM loss
  (``ForCausalLMLoss`` as ``loss_function``), with at most scalings and one tanh softcap in between. `patch` checks
  this by running the model's own forward once with its decoder, head and loss stood in for by recorders (no
  weight is read; meta-device models work): the recorded ops give the logit scale (Cohere's ``logit_scale``,
  Granite's ``1 / logits_scaling``, Falcon-H1's ``lm_head_multiplier``) and the softcap (Gemma 2/3's
  ``final_logit_softcapping``), folded into the fused loss as ``hidden * scale`` and ``softcap=``.

  At run time, called with ``labels``, the patched model runs its own forward: the decoder with every argument
  as the original passes them, then the head's call, which computes the loss the original's ``ForCausalLMLoss``
  would compute (labels shifted inside the loss or ``shift_labels`` as given, ``ignore_index``, the mean over
  counted tokens, or with ``num_items_in_batch`` the sum divided by it) and returns it in place of the logits;
  ``loss_function`` hands that loss back. Whatever the forward adds to its loss afterwards (the routers'
  auxiliary loss of a mixture of experts with ``output_router_logits``) is added as the original adds it. The
  output's ``logits`` is None. Called without labels, it is the original forward: logits as before (generation,
  evaluation without labels). Because the loss runs inside the head's own call, a head wrapped on its own by
  FSDP2's ``fully_shard`` or partitioned by ZeRO-3 has its weight gathered for it and its gradient reduced as
  when the original forward calls it.

* ``swiglu=True``: every gated MLP (children ``gate_proj``, ``up_proj``, ``down_proj``, or ``gate_up_proj`` and
  ``down_proj``) whose probe shows ``down(act(gate(x)) * up(x))`` with SiLU or GELU runs as ``logitless.gated_mlp``
  over its projections' weights where they are plain, unhooked ``nn.Linear`` modules (the gated unit's output is then
  recomputed in the backward, not saved), else its own projections around ``logitless.glu``. ``rope="auto"``: each attention's ``apply_rotary_pos_emb`` is ``logitless.rope`` while that
  attention runs, where a probe shows the two compute the same; the module-level function is never changed for
  good. ``fused_residual=True``: in each decoder layer whose forward adds a block's output to the residual stream
  and then normalizes the sum with one of the replaced RMSNorms (pre-norm layers: Llama, Mistral, Qwen, Phi-3, ...;
  Gemma 2 and 3 between attention and MLP), the add and the norm run as one ``rms_norm(..., residual=)``.
  python/logitless/_hf_layers.py (MLPs, rotary) and _hf_residual.py (residual adds) say how they are recognized.

Patching is all or nothing: every check runs before the first change, and a refusal (`PatchRefused`, a
ValueError, listing every reason and what to pass instead) leaves the model as it was. `unpatch` restores it
exactly.

The fused loss is float32, like the original's (which upcasts the logits); it differs from it by the rounding
of the logits to the model's dtype that the original does before its upcast, i.e. within the dtype's noise.
One deliberate difference: a mean over a batch whose labels are all ignore_index is 0 with zero gradient
(the original gives NaN).

A model whose ``loss_function`` was replaced by a custom one keeps computing it: set before `patch`, the patch
is refused with cross_entropy=True; set after, the patched forward defers to the original forward (the logits
are formed, as the custom loss needs them).
"""
from __future__ import annotations

import inspect
import math
import types
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
from torch import Tensor

from . import _hf_layers, _hf_residual
from ._checks import is_dtensor
from .heads import as_vocab_sharded, beside
from .linear_cross_entropy import linear_cross_entropy
from .nn import RMSNorm
from .rms_norm import rms_norm

__all__ = ["patch", "unpatch", "is_patched", "describe", "PatchRefused", "SUPPORTED_ARCHITECTURES"]

# The tested set: the causal LMs of transformers 5.24 that tests/python/test_hf_patch.py patched and checked (loss and
# every parameter's gradient against the unpatched model) as tiny random-init instances, 151 classes. Documentation,
# and a list that test holds the sweep to (none of these may be refused): `patch` itself never reads it, and accepts
# any model of the same structure.
SUPPORTED_ARCHITECTURES: Tuple[str, ...] = (
    "AXK1ForCausalLM", "AXK2ForCausalLM", "AfmoeForCausalLM", "Apertus1p5TextForCausalLM", "ApertusForCausalLM",
    "ArceeForCausalLM", "AriaTextForCausalLM", "BailingHybridForCausalLM", "BambaForCausalLM", "BeamForCausalLM",
    "BertGenerationDecoder", "BertLMHeadModel", "BigBirdForCausalLM", "BioGptForCausalLM", "BitNetForCausalLM",
    "BloomForCausalLM", "CTRLLMHeadModel", "CamembertForCausalLM", "CodeGenForCausalLM", "Cohere2ForCausalLM",
    "Cohere2MoeForCausalLM", "CohereCompassForCausalLM", "CohereForCausalLM", "CwmForCausalLM",
    "Data2VecTextForCausalLM", "DeepseekV2ForCausalLM", "DeepseekV32ForCausalLM", "DeepseekV3ForCausalLM",
    "DeepseekV4ForCausalLM", "DiffLlamaForCausalLM", "DogeForCausalLM", "Dots1ForCausalLM", "Dots3NoteForCausalLM",
    "ElectraForCausalLM", "Ernie4_5ForCausalLM", "Ernie4_5_MoeForCausalLM", "ErnieForCausalLM", "Exaone4ForCausalLM",
    "ExaoneMoeForCausalLM", "FalconForCausalLM", "FalconH1ForCausalLM", "FalconMambaForCausalLM",
    "FlexOlmoForCausalLM", "FlintForCausalLM", "GPT2LMHeadModel", "GPTBigCodeForCausalLM", "GPTJForCausalLM",
    "GPTNeoForCausalLM", "GPTNeoXForCausalLM", "GPTNeoXJapaneseForCausalLM", "Gemma2ForCausalLM",
    "Gemma3ForCausalLM", "Gemma3nForCausalLM", "Gemma4ForCausalLM", "Gemma4UnifiedForCausalLM", "GemmaForCausalLM",
    "Glm4ForCausalLM", "Glm4MoeForCausalLM", "Glm4MoeLiteForCausalLM", "GlmForCausalLM", "GlmMoeDsaForCausalLM",
    "GptOssForCausalLM", "GraniteForCausalLM", "GraniteMoeForCausalLM", "GraniteMoeHybridForCausalLM",
    "GraniteMoeSWAForCausalLM", "GraniteMoeSharedForCausalLM", "GraniteSWAForCausalLM", "HYV3ForCausalLM",
    "HYV4ForCausalLM", "HeliumForCausalLM", "HrmTextForCausalLM", "HunYuanDenseV1ForCausalLM",
    "HunYuanMoEV1ForCausalLM", "HyperCLOVAXForCausalLM", "Inkling2ForCausalLM", "Inkling2LoopForCausalLM",
    "InklingForCausalLM", "Jais2ForCausalLM", "JambaForCausalLM", "JetMoeForCausalLM", "KimiLinearForCausalLM",
    "Kolibri1ForCausalLM", "LagunaForCausalLM", "LaraMiniForCausalLM", "Lfm2ForCausalLM", "Lfm2MoeForCausalLM",
    "Lfm3ForCausalLM", "Llama4ForCausalLM", "LlamaForCausalLM", "LongcatFlashForCausalLM", "Mamba2ForCausalLM",
    "MambaForCausalLM", "MegatronBertForCausalLM", "MellumForCausalLM", "MiMoV2FlashForCausalLM",
    "MiniCPM3ForCausalLM", "MiniMaxForCausalLM", "MiniMaxM2ForCausalLM", "MiniMaxM3VLForCausalLM",
    "Ministral3ForCausalLM", "MinistralForCausalLM", "MistralForCausalLM", "MixtralForCausalLM",
    "ModernBertDecoderForCausalLM", "MptForCausalLM", "NanoChatForCausalLM", "NemotronForCausalLM",
    "NemotronHForCausalLM", "OPTForCausalLM", "Olmo2ForCausalLM", "Olmo3ForCausalLM", "OlmoForCausalLM",
    "OlmoHybridForCausalLM", "OlmoeForCausalLM", "OpenAIGPTLMHeadModel", "PersimmonForCausalLM", "Phi3ForCausalLM",
    "PhiForCausalLM", "PhimoeForCausalLM", "Qwen2ForCausalLM", "Qwen2MoeForCausalLM", "Qwen3ForCausalLM",
    "Qwen3MoeForCausalLM", "Qwen3NextForCausalLM", "Qwen3_5ForCausalLM", "Qwen3_5MoeForCausalLM",
    "Qwen4ExpForCausalLM", "RecurrentGemmaForCausalLM", "ReformerModelWithLMHead", "RemBertForCausalLM",
    "RoCBertForCausalLM", "RoFormerForCausalLM", "RobertaForCausalLM", "RobertaPreLayerNormForCausalLM",
    "RwkvForCausalLM", "SeedOssForCausalLM", "SmolLM3ForCausalLM", "SolarOpenForCausalLM", "StableLmForCausalLM",
    "Starcoder2ForCausalLM", "VaultGemmaForCausalLM", "XGLMForCausalLM", "XLMRobertaForCausalLM",
    "XLMRobertaXLForCausalLM", "XmodForCausalLM", "YoutuForCausalLM", "Zamba2ForCausalLM", "ZambaForCausalLM",
    "ZayaForCausalLM", "xLSTMForCausalLM",
)

# Options of linear_cross_entropy that patch() passes through; the others are fixed by the model's loss.
_LOSS_OPTIONS = ("z_loss", "schedule", "chunk_tokens", "chunk_vocab", "memory_budget", "grad_weight_accumulation",
                 "check_targets", "vocab_parallel")

_STATE = "_logitless_patch"


class PatchRefused(ValueError):
    """`patch` found something it cannot reproduce exactly; the model was not changed. ``reasons`` lists each
    finding (what was not recognized, where, and what to pass instead)."""

    def __init__(self, model_name: str, reasons: List[str]):
        self.reasons = tuple(reasons)
        super().__init__(f"{model_name}: not patched, the model is unchanged:\n  - " + "\n  - ".join(reasons))


class _Refusal(Exception):
    """One reason to refuse, raised inside a check and collected by patch()."""


# ----------------------------------------------------------------------------------------------------
# Module replacements. A kind is a family of modules that patch() swaps for a logitless module: its probe looks
# at one module and says whether it is of the kind (by what it computes), and if so returns the replacement, or
# a refusal when it is of the kind but cannot be reproduced. Gated MLPs and rotary embeddings are not swapped
# modules but forwards set on the module's instance (its children, and the attention, stay where they are):
# they live in _hf_layers.py and _hf_residual.py.


@dataclass(frozen=True)
class _Verdict:
    replacement: Optional[torch.nn.Module] = None  # the module to put in its place
    refusal: Optional[str] = None                  # it is of the kind, and cannot be reproduced: why
    note: Optional[str] = None                     # not of the kind (or left alone), for describe()


@dataclass(frozen=True)
class _Kind:
    option: str                                    # patch()'s keyword that enables it
    probe: Callable[[torch.nn.Module], Optional[_Verdict]]  # None: not even shaped like one (no note)


# --- RMSNorm

_EPS_ATTRIBUTES = ("variance_epsilon", "eps", "epsilon")
# Probe rows at these scales: the small ones make the epsilon matter (mean of squares 1e-8 against eps 1e-6).
_PROBE_SCALES = (1.0, 10.0, 1e-2, 1e-3, 1e-4, 3.0)


class _UnscaledRMSNorm(RMSNorm):
    """``logitless.rms_norm`` of a norm without a weight (Gemma 3n's value norm): scaled by ones made per call,
    so the module holds no tensor and the model's state dict and parameters stay as they were."""

    def __init__(self, eps: float, casting_mode: str) -> None:
        torch.nn.Module.__init__(self)
        self.eps = eps
        self.offset = 0.0
        self.casting_mode = casting_mode

    def forward(self, x: Tensor, residual: Optional[Tensor] = None):
        ones = torch.ones(x.shape[-1], dtype=x.dtype, device=x.device)
        return rms_norm(x, ones, eps=self.eps, offset=0.0, casting_mode=self.casting_mode, residual=residual)

    def extra_repr(self) -> str:
        return f"eps={self.eps}, no weight, casting_mode={self.casting_mode!r}"


def _one_argument(module: torch.nn.Module) -> bool:
    try:
        params = list(inspect.signature(module.forward).parameters.values())
    except (TypeError, ValueError):
        return False
    return len(params) == 1 and params[0].kind in (params[0].POSITIONAL_ONLY, params[0].POSITIONAL_OR_KEYWORD)


def _epsilon(module: torch.nn.Module) -> Optional[float]:
    for name in _EPS_ATTRIBUTES:
        value = module.__dict__.get(name, None)
        if isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0:
            return float(value)
    return None


def _width(module: torch.nn.Module) -> int:
    # A norm without a weight may still be built for one width (torch.nn.RMSNorm's normalized_shape); any other
    # width serves the probe.
    for name in ("normalized_shape", "dim", "hidden_size"):
        value = module.__dict__.get(name)
        if isinstance(value, (tuple, list)) and len(value) == 1:
            value = value[0]
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    return 24


def _run_with(module: torch.nn.Module, weight: Optional[Tensor], x: Tensor) -> Any:
    # The probe weight stands in for the module's own (which may be on another device, on meta, or sharded), and
    # copies for its buffers: nothing of the module is read on its device or changed.
    tensors = {name: b.detach().to("cpu", copy=True) for name, b in module.named_buffers(recurse=False)}
    if weight is not None:
        tensors["weight"] = weight
    with torch.no_grad():
        return torch.func.functional_call(module, tensors, (x,))


def _probe_rms_norm(module: torch.nn.Module) -> Optional[_Verdict]:
    if next(module.children(), None) is not None:
        return None
    # Buffers a checkpoint does not carry are constants of the module (Gemma 3n's weightless norm kept a scalar
    # weight of one as such in early 5.x); a persistent one is state that no RMSNorm has.
    buffers = dict(module.named_buffers(recurse=False))
    if any(name not in module._non_persistent_buffers_set or b.is_meta for name, b in buffers.items()):
        return None
    params = dict(module.named_parameters(recurse=False))
    weight = params.get("weight")
    if set(params) - {"weight"} or (weight is not None and weight.dim() != 1):
        return None
    eps = _epsilon(module)
    if eps is None or not _one_argument(module):
        return None
    what = f"{type(module).__name__} (eps {eps:g}{'' if weight is not None else ', no weight'})"
    dim = weight.shape[0] if weight is not None else _width(module)
    g = torch.Generator().manual_seed(0)
    scales = torch.tensor(_PROBE_SCALES).repeat(2)[:, None]
    x = (torch.randn(len(scales), dim, generator=g) * scales).reshape(2, -1, dim)
    w = torch.randn(dim, generator=g) * 0.5 + 0.5 if weight is not None else None
    try:
        y = _run_with(module, w, x)
    except Exception as e:  # not a module of this kind at all
        return _Verdict(note=f"{what}: not an RMSNorm (a float32 probe raised {type(e).__name__})")
    if not isinstance(y, Tensor) or y.shape != x.shape or not y.is_floating_point():
        return _Verdict(note=f"{what}: not an RMSNorm (its output is not the input's shape)")
    y = y.detach().float().cpu()
    ones = torch.ones(dim)
    offset = None
    for candidate in ((0.0, 1.0) if weight is not None else (0.0,)):
        want = rms_norm(x, w if weight is not None else ones, eps=eps, offset=candidate, casting_mode="gemma")
        if torch.all((want - y).abs() <= 1e-5 * y.abs() + 1e-6 * y.abs().max()):
            offset = candidate
            break
    if offset is None:
        return _Verdict(note=f"{what}: not an RMSNorm of its last dimension with that eps (float32 probe)")
    form = f"{'no weight' if weight is None else ('1 + weight' if offset else 'weight')}, eps {eps:g}"

    # Where it rounds: in bfloat16, each casting mode rounds at other places, so the right one agrees on almost
    # every element and the others differ by one unit in the last place on many.
    xb, wb = x.bfloat16(), (w if weight is not None else ones).bfloat16()
    try:
        yb = _run_with(module, wb if weight is not None else None, xb)
    except Exception as e:
        return _Verdict(refusal=f"{what} computes an RMSNorm ({form}) in float32 but raised {type(e).__name__} "
                                f"on bfloat16 input: {e}")
    if not isinstance(yb, Tensor) or yb.dtype != torch.bfloat16:
        got = yb.dtype if isinstance(yb, Tensor) else type(yb).__name__
        return _Verdict(refusal=f"{what} computes an RMSNorm ({form}) but returns {got} for bfloat16 input and "
                                f"weight, where logitless.rms_norm returns the input's dtype")
    yb = yb.cpu()
    tried = []
    for mode in ("llama", "gemma", "none"):
        want = rms_norm(xb, wb, eps=eps, offset=offset, casting_mode=mode)
        differ = (want != yb).float().mean().item()
        close = torch.all((want.float() - yb.float()).abs() <= 2.0 ** -7 * yb.float().abs() + 1e-6).item()
        tried.append((differ if close else math.inf, differ, mode))
    best, differ, mode = min(tried)
    if not best <= 0.01:
        closest = min(tried, key=lambda t: t[1])
        return _Verdict(refusal=f"{what} computes an RMSNorm ({form}) in float32 but rounds as none of the casting "
                                f"modes of logitless.rms_norm in bfloat16 (closest {closest[2]!r}: "
                                f"{closest[1]:.0%} of the elements differ)")
    if weight is None:
        norm = _UnscaledRMSNorm(eps, mode)
    else:
        norm = RMSNorm.from_module(module, offset=offset, casting_mode=mode)
        norm.eps = eps
    # The same buffers, still out of the state dict: code that reads them off the module (FalconMamba's mixer
    # passes its weightless norms' `weight` buffers to a kernel) finds them where they were.
    for name, b in buffers.items():
        norm.register_buffer(name, b, persistent=False)
    return _Verdict(replacement=norm)


_KINDS: Tuple[_Kind, ...] = (_Kind("rms_norm", _probe_rms_norm),)


@dataclass
class _Swap:
    parent: torch.nn.Module
    attr: str
    original: torch.nn.Module
    replacement: torch.nn.Module
    path: str


def _plan_swaps(model: torch.nn.Module, kinds: Tuple[_Kind, ...], reasons: List[str],
                notes: List[str]) -> List[_Swap]:
    """The swaps for every module of the enabled kinds; nothing is changed. A module reachable at several places
    gets one replacement, put at each."""
    verdicts: Dict[int, Optional[_Verdict]] = {}
    swaps = []
    for parent_name, parent in model.named_modules(remove_duplicate=False):
        for attr, child in parent.named_children():
            path = f"{parent_name}.{attr}" if parent_name else attr
            if id(child) not in verdicts:
                verdict = None
                for kind in kinds:
                    verdict = kind.probe(child)
                    if verdict is not None and (verdict.replacement is not None or verdict.refusal is not None):
                        break
                verdicts[id(child)] = verdict
                if verdict is not None and verdict.refusal is not None:
                    reasons.append(f"{path}: {verdict.refusal}; pass {kind.option}=False to leave these modules as "
                                   f"they are")
                elif verdict is not None and verdict.note is not None:
                    notes.append(f"{path}: {verdict.note}")
            verdict = verdicts[id(child)]
            if verdict is not None and verdict.replacement is not None:
                swaps.append(_Swap(parent, attr, child, verdict.replacement, path))
    return swaps


# ----------------------------------------------------------------------------------------------------
# The loss: what the forward does between the decoder and the loss, found by running it on recorders.


def _standard_loss():
    from transformers.loss.loss_utils import ForCausalLMLoss

    return ForCausalLMLoss


class _ProbeLogits(Tensor):
    """What the head's recorder returns in place of the logits: a real tensor of the logits' shape (zeros, on the
    head's device, meta included) that notes every op applied to it. Scalings, one tanh and casts are what the
    fused loss can fold; any other op is noted as one it cannot."""

    _steps: Tuple[Tuple[str, float], ...]
    _log: List[str]

    @classmethod
    def __torch_function__(cls, func, types_, args=(), kwargs=None):
        kwargs = kwargs or {}
        with torch._C.DisableTorchFunctionSubclass():
            out = func(*args, **kwargs)
        if not isinstance(out, Tensor):  # shape, dtype, device and other questions
            return out
        sources = [a for a in torch.utils._pytree.tree_leaves((args, kwargs)) if isinstance(a, _ProbeLogits)]
        if not sources:
            return out
        source = sources[0]
        step = _fold_step(func, args, kwargs, source)
        if step is None:
            source._log.append(getattr(func, "__name__", repr(func)))
            return out.as_subclass(Tensor)
        if out is source:  # an in-place op
            source._steps = source._steps + (step,)
            return source
        out = out.as_subclass(cls)
        out._steps, out._log = source._steps + (step,), source._log
        return out


def _number(value) -> Optional[float]:
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    return None


def _fold_step(func, args, kwargs, source) -> Optional[Tuple[str, float]]:
    name = getattr(func, "__name__", "")
    others = [a for a in args if a is not source]
    if name in ("float", "half", "bfloat16", "double", "to", "type", "type_as", "contiguous"):
        return ("cast", 1.0)
    if name == "tanh" or name == "tanh_":
        return ("tanh", 1.0)
    if kwargs or len(others) != 1:
        return None
    value = _number(others[0])
    if value is None or value == 0 or not math.isfinite(value):
        return None
    if name in ("mul", "__mul__", "__rmul__", "mul_", "__imul__", "multiply"):
        return ("scale", value)
    if name in ("div", "__truediv__", "div_", "__itruediv__", "true_divide", "divide") and args[0] is source:
        return ("scale", 1.0 / value)
    return None


def _fold(steps) -> Tuple[float, Optional[float]]:
    """(scale, softcap) with ``softcap * tanh(scale * z / softcap)`` (or ``scale * z``) what the steps compute
    from the head's output z."""
    before, after, capped = 1.0, 1.0, False
    for kind, value in steps:
        if kind == "scale":
            if capped:
                after *= value
            else:
                before *= value
        elif kind == "tanh":
            if capped:
                raise _Refusal("the forward applies tanh to the logits twice")
            capped = True
    if not capped:
        return _snap(before), None
    if after <= 0:
        raise _Refusal(f"the forward scales the logits by {after} after their tanh; only a positive softcap folds")
    # after * tanh(before * z) = c * tanh(z' / c) with c = after and z' = before * after * z.
    return _snap(before * after), after


def _snap(scale: float) -> float:
    # Gemma's softcap divides by c and multiplies by c again: 1.0 up to the rounding of the two Python floats.
    return 1.0 if abs(scale - 1.0) <= 1e-12 else scale


class _Stand(torch.nn.Module):
    """A recorder standing in for a submodule during the probe: calls go to `fn`, attributes to the real module
    (the forward may read ``self.lm_head.weight`` or ``self.model.lm_head_multiplier``)."""

    def __init__(self, real: torch.nn.Module, fn: Callable):
        super().__init__()
        object.__setattr__(self, "_real", real)
        object.__setattr__(self, "_fn", fn)

    def forward(self, *args, **kwargs):
        return self.__dict__["_fn"](*args, **kwargs)

    def __getattr__(self, name):
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(self.__dict__["_real"], name)


class _DecoderOutput:
    """The decoder's output during the probe: the hidden states, and None for anything else asked."""

    def __init__(self, hidden: Tensor):
        self.last_hidden_state = hidden

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return None

    def __getitem__(self, index):
        return (self.last_hidden_state,)[index]


@dataclass
class _LossPlan:
    head: torch.nn.Module
    scale: float
    softcap: Optional[float]


def _output_head(model) -> torch.nn.Module:
    try:
        head = model.get_output_embeddings()
    except (AttributeError, NotImplementedError):
        head = None
    if not isinstance(head, torch.nn.Linear):
        got = "none" if head is None else type(head).__name__
        raise _Refusal(f"expected get_output_embeddings() to be a torch.nn.Linear over the hidden states, got {got}")
    if type(head).forward is not torch.nn.Linear.forward:
        raise _Refusal(f"the output head {type(head).__name__} overrides torch.nn.Linear's forward")
    return head


def _decoder(model, head) -> torch.nn.Module:
    """The child of the model that holds its input embeddings (the decoder), else base_model."""
    try:
        embeddings = model.get_input_embeddings()
    except (AttributeError, NotImplementedError):
        embeddings = None
    if isinstance(embeddings, torch.nn.Module):
        for child in model.children():
            if child is not head and any(m is embeddings for m in child.modules()):
                return child
    decoder = getattr(model, "base_model", model)
    if decoder is model:
        raise _Refusal("expected the decoder as a submodule holding the input embeddings")
    return decoder


def _sites(model, target) -> List[Tuple[torch.nn.Module, str]]:
    return [(parent, attr) for _, parent in model.named_modules(remove_duplicate=False)
            for attr, child in parent.named_children() if child is target]


def _plan_loss(model, forward: Callable) -> _LossPlan:
    """Checks that the forward computes ForCausalLMLoss of (scaled, softcapped) head outputs and returns how."""
    head = _output_head(model)
    loss_function = model.loss_function
    if loss_function is not _standard_loss():
        name = getattr(loss_function, "__name__", repr(loss_function))
        raise _Refusal(f"expected the standard causal-LM loss (ForCausalLMLoss) as loss_function, got {name}")
    decoder = _decoder(model, head)
    vocab, hidden_size = head.weight.shape
    # What the decoder returns: its width may differ from the head's (Electra's and RemBERT's heads take a
    # projection of it).
    text_config = getattr(getattr(model, "config", None), "get_text_config", lambda: None)()
    width = getattr(text_config, "hidden_size", None)
    hidden_size = width if isinstance(width, int) and width > 0 else hidden_size
    device, dtype = head.weight.device, head.weight.dtype
    steps = 3
    hidden = torch.zeros(1, steps, hidden_size, device=device, dtype=dtype)
    log: List[str] = []
    seen: Dict[str, list] = {"head": [], "loss": []}

    def head_call(x, *args, **kwargs):
        logits = torch.zeros(*x.shape[:-1], vocab, device=device, dtype=dtype).as_subclass(_ProbeLogits)
        logits._steps, logits._log = (), log
        seen["head"].append(logits)
        return logits

    loss_value = torch.zeros((), device=device)

    def loss_call(logits=None, labels=None, vocab_size=None, *args, **kwargs):
        seen["loss"].append((logits, labels, vocab_size, args, kwargs))
        return loss_value

    ids = torch.zeros(1, steps, dtype=torch.long, device=device)
    labels = torch.zeros(1, steps, dtype=torch.long, device=device)
    count = torch.ones((), device=device)
    kwargs = dict(input_ids=ids, labels=labels, num_items_in_batch=count)
    names = inspect.signature(forward).parameters
    for name, value in (("output_router_logits", False), ("use_cache", False)):
        if name in names:  # nothing to route or cache: the decoder is a recorder
            kwargs[name] = value
    swapped = [(parent, attr, child) for target, stand in ((head, _Stand(head, head_call)),
                                                          (decoder, _Stand(decoder, lambda *a, **k: _DecoderOutput(hidden))))
               for parent, attr in _sites(model, target) for child in (stand,)]
    originals = [(parent, attr, getattr(parent, attr)) for parent, attr, _ in swapped]
    had_loss, old_loss = "_loss_function" in model.__dict__, model.__dict__.get("_loss_function")
    try:
        for parent, attr, stand in swapped:
            setattr(parent, attr, stand)
        model.__dict__["_loss_function"] = loss_call
        with torch.no_grad():
            output = forward(**kwargs)
    except _Refusal:
        raise
    except Exception as e:
        raise _Refusal(f"its forward, run with recorders in place of the decoder, head and loss, raised "
                       f"{type(e).__name__}: {e}") from e
    finally:
        if had_loss:
            model.__dict__["_loss_function"] = old_loss
        else:
            model.__dict__.pop("_loss_function", None)
        for parent, attr, original in reversed(originals):
            setattr(parent, attr, original)

    head_name = type(head).__name__
    if len(seen["head"]) != 1:
        raise _Refusal(f"expected the forward to call the output head ({head_name}) once, it called it "
                       f"{len(seen['head'])} times")
    if not seen["loss"]:
        raise _Refusal("its forward computes the loss without calling loss_function (its own cross-entropy, say), "
                       "so there is no loss to fuse")
    if len(seen["loss"]) != 1:
        raise _Refusal(f"expected the forward to call loss_function once, it called it {len(seen['loss'])} times")
    if log:
        raise _Refusal(f"the forward applies {', '.join(sorted(set(log)))} to the logits; only scalings by a "
                       f"number, one tanh softcap and casts fold into the fused loss")
    logits, got_labels, vocab_size, args, loss_kwargs = seen["loss"][0]
    if not isinstance(logits, _ProbeLogits) or logits._log is not log:
        raise _Refusal("the logits reaching loss_function are not the output head's")
    if got_labels is not labels:
        raise _Refusal("the forward passes loss_function other labels than it was given")
    if vocab_size != vocab or args:
        raise _Refusal(f"the forward passes loss_function vocab_size {vocab_size} (and {len(args)} more positional "
                       f"arguments) for an output head of {vocab} rows")
    if loss_kwargs.get("num_items_in_batch") is not count:
        raise _Refusal("the forward does not pass its keyword arguments (num_items_in_batch) on to loss_function")
    values = output if isinstance(output, tuple) else list(output.values()) if hasattr(output, "values") else ()
    if not any(v is logits for v in values):
        raise _Refusal("the forward's output does not hold the logits it passed to loss_function")
    scale, softcap = _fold(logits._steps)
    return _LossPlan(head=head, scale=scale, softcap=softcap)


# ----------------------------------------------------------------------------------------------------
# State and the public API.


class _Call:
    """One labeled forward in flight: what the head's call needs to compute the loss, and what it computed."""

    def __init__(self, labels, shift_labels, ignore_index, num_items_in_batch):
        self.labels = labels
        self.shift_labels = shift_labels
        self.ignore_index = ignore_index
        self.num_items_in_batch = num_items_in_batch
        self.loss = None
        self.logits = None


@dataclass
class _PatchState:
    rms_norm: bool
    cross_entropy: bool
    loss_options: Dict[str, Any]
    swaps: List[_Swap] = field(default_factory=list)
    notes: List[str] = field(default_factory=list)
    # Gated MLPs and the rotary function's sites (python/logitless/_hf_layers.py), the fused residual adds
    # (python/logitless/_hf_residual.py).
    mlps: List[Any] = field(default_factory=list)
    ropes: List[Any] = field(default_factory=list)
    residuals: List[Any] = field(default_factory=list)
    loss: Optional[_LossPlan] = None
    # The instance attributes patch() set, as they were: (had one, its value).
    forward_before: Tuple[bool, Any] = (False, None)
    head_forward_before: Tuple[bool, Any] = (False, None)
    loss_function_before: Tuple[bool, Any] = (False, None)
    loss_function_set_after: bool = False  # found by unpatch: the user replaced ours
    # The original forward's named parameters in order (without self): how positional arguments map.
    parameters: Tuple[str, ...] = ()
    signature: Optional[inspect.Signature] = None
    standard_loss: Any = None
    call: Optional[_Call] = None  # set while a labeled forward runs


def patch(model: torch.nn.Module, rms_norm: bool = True, cross_entropy: bool = True, *, swiglu: bool = True,
          rope: Any = "auto", fused_residual: bool = True, **loss_options) -> torch.nn.Module:
    """Patch a transformers causal LM in place (see the module docstring) and return `model`.

    Args:
        model: a transformers causal LM, e.g. from ``AutoModelForCausalLM.from_pretrained``. A
            ``torch.compile``d model is patched through to the module it wraps; patch before compiling to avoid a
            recompilation.
        rms_norm: replace the modules that compute an RMSNorm by ``logitless.nn.RMSNorm``.
        cross_entropy: compute the loss with ``logitless.linear_cross_entropy`` when labels are given.
        swiglu: run the gated MLPs (SwiGLU, GeGLU: gate_proj, up_proj and down_proj, or gate_up_proj and
            down_proj) through ``logitless.glu``, calling their own projections. Experts held as fused tensors are
            left as they are.
        rope: run each attention's ``apply_rotary_pos_emb`` as ``logitless.rope`` while it runs, where a probe shows
            that the two compute the same (Hugging Face's rotate_half form, partial rotary included; interleaved
            pairs are not). "auto" (default): swap what verifies and note in `describe` what does not; True: refuse
            the patch if any does not; False: leave them all.
        fused_residual: in the decoder layers, fuse each residual add into the RMSNorm that normalizes the sum next
            (``h = residual + attn_out; residual = h; h = post_attention_layernorm(h)`` as one
            ``rms_norm(..., residual=)``, forward and backward). Needs rms_norm=True (only replaced norms are
            fused); layers of another form are left as they are and noted in `describe`.
        **loss_options: passed on to ``linear_cross_entropy``: z_loss, schedule, chunk_tokens, chunk_vocab,
            memory_budget, grad_weight_accumulation, check_targets, vocab_parallel (z_loss adds a term the original loss does not have;
            vocab_parallel=True for an lm_head whose weight is a tensor-parallel DTensor sharded along the
            vocabulary, as torch's ColwiseParallel lays it out, whatever its output layout: the loss then stands in
            for the head's sharded logits, one column a rank).

    A patched model is first unpatched, so patching again with other options replaces the earlier patch (and a
    refused one leaves the earlier patch in place).

    Raises:
        PatchRefused (a ValueError): for anything the patch cannot reproduce exactly, with every reason; the model
            is unchanged.
        ValueError: an unknown loss option.
    """
    given, model = model, _unwrap(model)
    if not (rope is True or rope is False or rope == "auto"):
        raise ValueError(f"rope: expected True, False or 'auto', got {rope!r}")
    unknown = sorted(set(loss_options) - set(_LOSS_OPTIONS))
    if unknown:
        raise ValueError(f"loss_options: expected any of {', '.join(_LOSS_OPTIONS)}, got {', '.join(unknown)}")
    earlier: Optional[_PatchState] = model.__dict__.get(_STATE)
    if earlier is not None:
        _revert(model, earlier)
    try:
        state = _plan(model, bool(rms_norm), bool(cross_entropy), dict(loss_options), bool(swiglu), rope,
                      bool(fused_residual))
    except BaseException:
        if earlier is not None:  # the earlier patch stays
            _apply(model, earlier)
        raise
    _apply(model, state)
    return given


def unpatch(model: torch.nn.Module) -> torch.nn.Module:
    """Undo `patch`: the original modules back in their places and the instance attributes as they were.
    Returns `model`; one that is not patched is left unchanged."""
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"model: expected a torch.nn.Module, got {type(model).__name__}")
    given, model = model, _unwrap(model)
    state: Optional[_PatchState] = model.__dict__.get(_STATE)
    if state is not None:
        _revert(model, state)
    return given


def is_patched(model: torch.nn.Module) -> bool:
    """Whether `patch` was applied to this model (and not undone)."""
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"model: expected a torch.nn.Module, got {type(model).__name__}")
    return _STATE in _unwrap(model).__dict__


def describe(model: torch.nn.Module) -> str:
    """What `patch` replaced in this model and what it left alone (empty for a model that is not patched)."""
    state: Optional[_PatchState] = _unwrap(model).__dict__.get(_STATE)
    if state is None:
        return ""
    lines = []
    for swap in state.swaps:
        lines.append(f"{swap.path}: {type(swap.original).__name__} -> {type(swap.replacement).__name__}"
                     f"({swap.replacement.extra_repr()})")
    lines += _hf_layers.describe_lines(state.mlps, state.ropes, state.residuals)
    if state.loss is not None:
        fold = [] if state.loss.scale == 1.0 else [f"hidden scaled by {state.loss.scale:g}"]
        fold += [] if state.loss.softcap is None else [f"softcap {state.loss.softcap:g}"]
        lines.append(f"loss: linear_cross_entropy from the output head's input{' (' + ', '.join(fold) + ')' if fold else ''}")
    lines += [f"left alone: {note}" for note in state.notes]
    return "\n".join(lines)


def _unwrap(model):
    # Anything else would fail on a missing __dict__ with an AttributeError that names nothing of the call.
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"model: expected a torch.nn.Module, got {type(model).__name__}")
    # torch.compile(model) returns an OptimizedModule around the original module.
    inner = getattr(model, "_orig_mod", None)
    return inner if isinstance(inner, torch.nn.Module) else model


def _original_forward_function(model):
    for cls in type(model).__mro__:
        if "forward" in cls.__dict__:
            return cls.__dict__["forward"]
    raise RuntimeError(f"{type(model).__name__} has no forward")


def _plan(model, rms_norm: bool, cross_entropy: bool, loss_options: Dict[str, Any], swiglu: bool = False,
          rope: Any = False, fused_residual: bool = False) -> _PatchState:
    """Every check; returns what to change, or raises PatchRefused. Changes nothing."""
    state = _PatchState(rms_norm=rms_norm, cross_entropy=cross_entropy, loss_options=loss_options)
    reasons: List[str] = []
    kinds = tuple(k for k in _KINDS if {"rms_norm": rms_norm}.get(k.option, False))
    if kinds:
        state.swaps = _plan_swaps(model, kinds, reasons, state.notes)
    if swiglu:
        state.mlps = _hf_layers.plan_mlps(model, reasons, state.notes)
    if rope is not False:
        state.ropes = _hf_layers.plan_rope(model, rope, reasons, state.notes)
    if fused_residual:
        norms = {(id(s.parent), s.attr): (s.original, s.replacement) for s in state.swaps}
        taken = {id(s.module) for s in state.mlps} | {id(m) for site in state.ropes for m, _ in site.modules}
        state.residuals = _hf_residual.plan_residuals(model, norms, taken, reasons, state.notes)
    refusal = sharded_refusal(model, "patch before sharding") if state.swaps else None
    if refusal is not None:
        reasons.append(refusal)
    if cross_entropy:
        had_forward = "forward" in model.__dict__
        state.forward_before = (had_forward, model.__dict__.get("forward"))
        function = _original_forward_function(model)
        signature = inspect.signature(function)  # through functools.wraps decorators
        forward = model.__dict__["forward"] if had_forward else types.MethodType(function, model)
        try:
            state.loss = _plan_loss(model, forward)
        except _Refusal as e:
            reasons.append(f"loss: {e}; pass cross_entropy=False to patch only the modules")
        else:
            params = list(signature.parameters.values())[1:]
            state.parameters = tuple(p.name for p in params
                                     if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD))
            state.signature = signature.replace(parameters=params)
            state.standard_loss = _standard_loss()
            head = state.loss.head
            state.head_forward_before = ("forward" in head.__dict__, head.__dict__.get("forward"))
            state.loss_function_before = ("_loss_function" in model.__dict__, model.__dict__.get("_loss_function"))
            if isinstance(head.__dict__.get(_STATE), _PatchState):
                reasons.append("loss: the output head is that of another patched model; unpatch it first")
    if reasons:
        raise PatchRefused(type(model).__name__, reasons)
    return state


def sharded_refusal(model: torch.nn.Module, remedy: str) -> Optional[str]:
    """Why the norms of `model` cannot be replaced, if FSDP2 or ZeRO-3 has already sharded it (`remedy`: what to do
    instead, besides rms_norm=False), or None."""
    where = _sharded_at(model)
    if where is None:
        return None
    return (f"rms_norm: the model is already sharded ({where}): its replacement norms would hold the shards, which "
            f"the wrapper gathers only into the modules it wrapped; {remedy}, or pass rms_norm=False")


def _sharded_at(model: torch.nn.Module) -> Optional[str]:
    """Where FSDP2's fully_shard or DeepSpeed ZeRO-3 has already sharded `model`, or None."""
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # pragma: no cover - torch without distributed
        FSDPModule = None
    if FSDPModule is not None:
        for name, module in model.named_modules():
            if isinstance(module, FSDPModule):
                return f"fully_shard at {name or 'the model itself'}"
    for name, param in model.named_parameters():
        if hasattr(param, "ds_id"):  # a parameter that DeepSpeed ZeRO-3 partitioned
            return f"DeepSpeed ZeRO-3 partitions {name}"
    return None


def _apply(model, state: _PatchState) -> None:
    for swap in state.swaps:
        setattr(swap.parent, swap.attr, swap.replacement)
    _hf_layers.apply_mlps(state.mlps)
    _hf_layers.apply_rope(state.ropes)
    _hf_residual.apply_residuals(state.residuals)
    if state.loss is not None:
        head = state.loss.head
        object.__setattr__(head, _STATE, state)
        head.forward = types.MethodType(_head_forward, head)
        if not state.loss_function_set_after:
            model.__dict__["_loss_function"] = types.MethodType(_loss_function, model)
        # A bound method, not a closure over the model: copy.deepcopy(model) then binds the copy's forward to
        # the copy. It shows the original's signature, which is what transformers' Trainer inspects (the
        # dataset columns it keeps, whether the model takes num_items_in_batch).
        model.forward = types.MethodType(_forward_with_signature(state.signature), model)
    object.__setattr__(model, _STATE, state)


def _restore(obj, name: str, before: Tuple[bool, Any]) -> None:
    if before[0]:
        obj.__dict__[name] = before[1]
    else:
        obj.__dict__.pop(name, None)


def _revert(model, state: _PatchState) -> None:
    for swap in reversed(state.swaps):
        setattr(swap.parent, swap.attr, swap.original)
    _hf_residual.revert_residuals(state.residuals)
    _hf_layers.revert_rope(state.ropes)
    _hf_layers.revert_mlps(state.mlps)
    if state.loss is not None:
        head = state.loss.head
        _restore(head, "forward", state.head_forward_before)
        head.__dict__.pop(_STATE, None)
        # A loss_function the user set after patching is theirs to keep (and stays if the patch is applied again).
        current = model.__dict__.get("_loss_function")
        state.loss_function_set_after = getattr(current, "__func__", None) is not _loss_function
        if not state.loss_function_set_after:
            _restore(model, "_loss_function", state.loss_function_before)
        _restore(model, "forward", state.forward_before)
    model.__dict__.pop(_STATE, None)


# ----------------------------------------------------------------------------------------------------
# The patched forward, the head's forward and loss_function.


def _forward_with_signature(signature: inspect.Signature):
    def forward(self, *args, **kwargs):
        return _patched_forward(self, *args, **kwargs)

    forward.__signature__ = signature.replace(
        parameters=[inspect.Parameter("self", inspect.Parameter.POSITIONAL_OR_KEYWORD)] +
        list(signature.parameters.values()))
    forward.__doc__ = _patched_forward.__doc__
    return forward


def _call_original(self, state: _PatchState, **kwargs):
    had, forward = state.forward_before
    if had:
        return forward(**kwargs)
    return _original_forward_function(self)(self, **kwargs)


def _patched_forward(self, *args, **kwargs):
    """The causal LM's forward; with labels, the loss by logitless.linear_cross_entropy and no logits."""
    state: _PatchState = self.__dict__[_STATE]
    if len(args) > len(state.parameters):
        raise TypeError(f"forward: expected at most {len(state.parameters)} positional arguments, got {len(args)}")
    for name in state.parameters[:len(args)]:
        if name in kwargs:
            raise TypeError(f"forward: got multiple values for argument {name!r}")
    kwargs.update(zip(state.parameters, args))
    labels = kwargs.get("labels")
    ours = getattr(self.__dict__.get("_loss_function"), "__func__", None) is _loss_function
    if labels is None or not ours:
        return _call_original(self, state, **kwargs)
    call = _Call(labels, kwargs.get("shift_labels"), kwargs.get("ignore_index", -100),
                 kwargs.get("num_items_in_batch"))
    state.call = call
    try:
        output = _call_original(self, state, **kwargs)
    finally:
        state.call = None
    if call.logits is None:
        raise RuntimeError(f"{type(self).__name__}: the patched forward did not reach its loss (head called: "
                           f"{call.loss is not None}); unpatch the model")
    # The head's call returned the loss where the logits would be; the output shows None there.
    logits = call.logits
    if isinstance(output, tuple):
        return tuple(v for v in output if v is not logits)
    return type(output)(**{k: v for k, v in output.items() if v is not logits})


def _head_forward(head, hidden, *args, **kwargs):
    """The output head's forward: within a labeled forward of the patched model, the loss from the hidden states
    it was called on; otherwise the head's own forward."""
    state: _PatchState = head.__dict__[_STATE]
    call = state.call
    if call is None or call.loss is not None or args or kwargs:
        had, forward = state.head_forward_before
        return forward(hidden, *args, **kwargs) if had else type(head).forward(head, hidden, *args, **kwargs)
    call.loss = _causal_lm_loss(head, state, hidden, call)
    # As many dimensions as the logits, each of size one: a forward that reads the logits' shape (Inkling passes
    # vocab_size=logits.shape[-1] to the loss) still can; what it applies to them costs nothing.
    out = call.loss.reshape((1,) * hidden.dim())
    return as_vocab_sharded(out, hidden) if is_dtensor(hidden) else out


def _loss_function(self, logits=None, labels=None, vocab_size=None, *args, **kwargs):
    """loss_function of a patched model: within a labeled forward, the loss the head's call computed."""
    state: _PatchState = self.__dict__[_STATE]
    call = state.call
    if call is None:
        return state.standard_loss(logits, labels, vocab_size, *args, **kwargs)
    if call.loss is None:
        raise RuntimeError(f"{type(self).__name__}: loss_function was called before the output head; unpatch the model")
    if (labels is not call.labels or kwargs.get("shift_labels") is not call.shift_labels
            or kwargs.get("ignore_index", -100) != call.ignore_index
            or kwargs.get("num_items_in_batch") is not call.num_items_in_batch):
        raise RuntimeError(f"{type(self).__name__}: the forward passed loss_function other labels or options than it "
                           f"was given; unpatch the model")
    call.logits = logits
    # `logits` is what the forward made of the head's output (the loss itself, perhaps scaled and softcapped as
    # the probe found; from a tensor-parallel head, a DTensor or one column a rank), kept in the graph (`beside`).
    return beside(call.loss, logits)


def _causal_lm_loss(head, state: _PatchState, hidden: Tensor, call: _Call) -> Tensor:
    """ForCausalLMLoss(softcap(scale * head(hidden)), labels, ...) without the logits."""
    labels, shift_labels, ignore_index = call.labels, call.shift_labels, call.ignore_index
    if shift_labels is not None:
        h, target = hidden, shift_labels
    elif labels.shape == hidden.shape[:-1] and hidden.dim() >= 2:
        # The shift as views: position t predicts labels[t + 1]; the last position, whose padded label the
        # original ignores, is left out (the same loss, one row less).
        h, target = hidden[..., :-1, :], labels[..., 1:]
    else:
        pad = torch.full(labels.shape[:-1] + (1,), ignore_index, dtype=labels.dtype, device=labels.device)
        h, target = hidden, torch.cat((labels[..., 1:], pad), dim=-1)
    target = target.to(h.device)
    if target.shape != h.shape[:-1]:
        # The original flattens both (logits.view(-1, V), labels.view(-1)): only the counts must agree.
        if target.numel() * h.shape[-1] != h.numel():
            raise ValueError(f"labels: expected {h.numel() // max(h.shape[-1], 1)} labels for the hidden states "
                             f"{tuple(h.shape)} (after logits_to_keep), got shape {tuple(target.shape)}")
        h, target = h.reshape(-1, h.shape[-1]), target.reshape(-1)
    reduction = "mean" if call.num_items_in_batch is None else "sum"
    # Read here, inside the head's call: a wrapper that shards them (FSDP2, ZeRO-3) has gathered them, and
    # reduces their gradients after the backward.
    weight, bias = head.weight, head.bias
    # Under autocast the fused op casts its operands itself (the products in the autocast dtype, a float32 weight's
    # gradient written in float32, no 16-bit gradient of it on top); outside autocast the head's dtype rules.
    if not torch.is_autocast_enabled(h.device.type) and h.dtype != weight.dtype:
        h = h.to(weight.dtype)
    plan = state.loss
    if plan.scale != 1.0:
        # scale * (h W^T + b) = (scale h) W^T + scale b: the logit scale moves onto the rows.
        h = h * plan.scale
        bias = None if bias is None else bias * plan.scale
    loss = linear_cross_entropy(h, weight, target, bias, ignore_index=ignore_index, reduction=reduction,
                                softcap=plan.softcap, **state.loss_options)
    num_items_in_batch = call.num_items_in_batch
    if num_items_in_batch is not None:
        if torch.is_tensor(num_items_in_batch):
            num_items_in_batch = num_items_in_batch.to(loss.device)
        loss = loss / num_items_in_batch
    return loss
