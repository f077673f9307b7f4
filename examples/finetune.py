#!/usr/bin/env python3
"""End-to-end training of a Hugging Face causal LM with and without logitless, same seed, same data.

The model (--config) has the shape of Llama-3.2-1B (the default: hidden 2048, 16 layers, 32 heads, 8 key/value
heads, intermediate 8192, vocabulary 128256, tied embeddings, llama3 RoPE with theta 500000), of Qwen3-1.7B
(``qwen3``: hidden 2048, 28 layers, 16 heads of 128, 8 key/value heads, intermediate 6144, vocabulary 151936, tied
embeddings, q/k norms, RoPE theta 1e6) or of Gemma-2-2B (``gemma2``: hidden 2304, 26 layers, 8 heads of 256, 4
key/value heads, intermediate 9216 GeGLU, vocabulary 256000, tied embeddings, sandwich norms, attention softcap 50,
final logit softcap 30, query_pre_attn_scalar 256, a 4096-token sliding window every other layer, RoPE theta 10000;
eager attention, as transformers runs Gemma 2 with its softcap), built from its config with random weights:
nothing is downloaded. It trains with AdamW on real token data and reports, per mode, tokens/s, peak memory, the
loss curve and (--find-max-batch) the largest batch that fits.

Precision (--master): ``bf16`` (the default on a GPU) trains bfloat16 weights directly; ``fp32`` keeps float32
master weights (and gradients and optimizer state) and runs forward and loss under
``torch.autocast(dtype=torch.bfloat16)``, as transformers' Trainer does with bf16=True. Every mode runs under the
same regime.

Modes, each in its own process (a clean CUDA context and peak-memory counter, and no monkey patch leaking
from one mode into the next):

* ``baseline``: the model as transformers ships it (eager RMSNorm, logits, float32 upcast, torch's CE).
* ``logitless``: ``logitless.patch(model)`` with its defaults: fused RMSNorm, SwiGLU / GeGLU MLPs, RoPE, the
  residual adds fused into the norms after them, and linear cross-entropy (no logits).
* ``liger``: Liger's RMSNorm and fused linear cross-entropy only (its RoPE and SwiGLU / GeGLU kernels off): what
  the head and the norms alone are worth, when liger_kernel is importable and on a GPU.
* ``liger-full``: Liger's default ``apply_liger_kernel_to_llama`` / ``_qwen3`` / ``_gemma2`` (RoPE, SwiGLU or
  GeGLU, RMSNorm and fused linear cross-entropy): the like-for-like peer of ``logitless``, under the same
  conditions as ``liger``.

The data: real text tokenized with a real BPE, nothing downloaded. The corpus is the Python standard
library's source files (``*.py`` under ``sysconfig.get_paths()["stdlib"]``, site-packages excluded, sorted
by path, up to --corpus-mb of text): code, comments and docstrings present on any machine with Python. A
byte-level BPE tokenizer (the ``tokenizers`` package that transformers depends on) is trained on that text
with --tokenizer-vocab entries (default 32000), the files are encoded and joined with an end-of-text token,
and training windows of --seq tokens are drawn at random offsets from one seeded generator, so that every
mode sees the same batches. "Real" here means natural token statistics (Zipf-like frequencies, repeated
structure a model can learn, so the loss falls) rather than uniformly random ids; the model keeps its own
vocabulary (128256 entries for Llama) so that the head costs what it costs in the real model, and the ids come
from the first --tokenizer-vocab entries. The tokenizer and the token ids are cached (--cache).

Output (--out DIR): report.md (the table and the targets), report.png (throughput, memory, largest batch and
loss curves; needs matplotlib, else the report says so) and results.json (every number, per mode).

Without a GPU it runs a tiny Llama config on the CPU (logitless's CPU backend) with a short sequence
(``tiny-qwen3`` and ``tiny-gemma2`` are the other two architectures at that size).

    PYTHONPATH=build/<dir>/python python examples/finetune.py                       # whatever device there is
    PYTHONPATH=build/<dir>/python python examples/finetune.py --steps 50 --seq 2048 --batch 8 \\
        --modes baseline,logitless,liger,liger-full --find-max-batch --out finetune-out
    PYTHONPATH=build/<dir>/python python examples/finetune.py --config qwen3 --master fp32 --out qwen3-fp32
"""
from __future__ import annotations

import os
import sys

# examples/profile.py, next to this file, has the name of the standard library's profile module, which
# cProfile imports (transformers' import machinery can get there): with this directory first on the path that
# import would find the example. Move the directory to the end of the path.
_HERE = os.path.dirname(os.path.abspath(__file__))
if sys.path and os.path.abspath(sys.path[0] or os.getcwd()) == _HERE:
    sys.path.append(sys.path.pop(0))

import argparse  # noqa: E402
import contextlib  # noqa: E402
import datetime  # noqa: E402
import gc  # noqa: E402
import json  # noqa: E402
import platform  # noqa: E402
import resource  # noqa: E402
import subprocess  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import numpy as np  # noqa: E402
import torch  # noqa: E402

MODES = ("baseline", "logitless", "liger", "liger-full")
LIGER_MODES = ("liger", "liger-full")

LLAMA_3_2_1B = dict(hidden_size=2048, num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8,
                    head_dim=64, intermediate_size=8192, vocab_size=128256, tie_word_embeddings=True,
                    max_position_embeddings=131072, rms_norm_eps=1e-5, hidden_act="silu",
                    rope_parameters=dict(rope_type="llama3", rope_theta=500000.0, factor=32.0, low_freq_factor=1.0,
                                         high_freq_factor=4.0, original_max_position_embeddings=8192))
TINY = dict(hidden_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
            intermediate_size=384, vocab_size=2048, tie_word_embeddings=True, max_position_embeddings=4096,
            rms_norm_eps=1e-5, hidden_act="silu", rope_parameters=dict(rope_type="default", rope_theta=500000.0))
# Qwen3-1.7B's and Gemma-2-2B's published configurations (the sizes and the options that change what is computed).
QWEN3_1_7B = dict(hidden_size=2048, num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8, head_dim=128,
                  intermediate_size=6144, vocab_size=151936, tie_word_embeddings=True, max_position_embeddings=40960,
                  rms_norm_eps=1e-6, hidden_act="silu", attention_bias=False,
                  rope_parameters=dict(rope_type="default", rope_theta=1000000.0))
GEMMA2_2B = dict(hidden_size=2304, num_hidden_layers=26, num_attention_heads=8, num_key_value_heads=4, head_dim=256,
                 intermediate_size=9216, vocab_size=256000, tie_word_embeddings=True, max_position_embeddings=8192,
                 rms_norm_eps=1e-6, hidden_activation="gelu_pytorch_tanh", query_pre_attn_scalar=256,
                 sliding_window=4096, final_logit_softcapping=30.0, attn_logit_softcapping=50.0,
                 rope_parameters=dict(rope_type="default", rope_theta=10000.0))
TINY_QWEN3 = dict(TINY, rms_norm_eps=1e-6, rope_parameters=dict(rope_type="default", rope_theta=1000000.0))
TINY_GEMMA2 = dict(hidden_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                   intermediate_size=384, vocab_size=2048, tie_word_embeddings=True, max_position_embeddings=4096,
                   rms_norm_eps=1e-6, hidden_activation="gelu_pytorch_tanh", query_pre_attn_scalar=32,
                   sliding_window=32, final_logit_softcapping=30.0, attn_logit_softcapping=50.0,
                   rope_parameters=dict(rope_type="default", rope_theta=10000.0))
CONFIGS = {"llama-3.2-1b": LLAMA_3_2_1B, "tiny": TINY, "qwen3": QWEN3_1_7B, "tiny-qwen3": TINY_QWEN3,
           "gemma2": GEMMA2_2B, "tiny-gemma2": TINY_GEMMA2}
# The architecture each config builds: (name in the report, transformers config and model classes, Liger's function).
ARCH_OF = {"llama-3.2-1b": "llama", "tiny": "llama", "qwen3": "qwen3", "tiny-qwen3": "qwen3", "gemma2": "gemma2",
           "tiny-gemma2": "gemma2"}
ARCHS = {
    "llama": ("Llama", "LlamaConfig", "LlamaForCausalLM", "apply_liger_kernel_to_llama"),
    "qwen3": ("Qwen3", "Qwen3Config", "Qwen3ForCausalLM", "apply_liger_kernel_to_qwen3"),
    "gemma2": ("Gemma 2", "Gemma2Config", "Gemma2ForCausalLM", "apply_liger_kernel_to_gemma2"),
}

GIB = 1 << 30
EOT = "<|endoftext|>"


# ----------------------------------------------------------------------------------------------------
# Arguments


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", choices=("cuda", "cpu"), default=None,
                   help="default: cuda when there is a GPU (and logitless was built with CUDA), else cpu")
    p.add_argument("--config", choices=tuple(CONFIGS), default=None,
                   help="model shape: llama-3.2-1b, qwen3 (Qwen3-1.7B), gemma2 (Gemma-2-2B), or tiny, tiny-qwen3, "
                   "tiny-gemma2 for the CPU; default llama-3.2-1b on cuda, tiny on cpu")
    p.add_argument("--steps", type=int, default=None, help="training steps per mode (default 50 on cuda, 12 on cpu)")
    p.add_argument("--batch", type=int, default=None,
                   help="sequences per step (default on cuda 8, or 4 with --master fp32: an estimated 55 GB peak for "
                        "the Llama baseline at 2048 tokens, a batch that fills the GPU as a real run would; a quarter "
                        "of that for gemma2, whose eager attention and 256000-entry logits cost more; 4 on cpu)")
    p.add_argument("--seq", type=int, default=None, help="tokens per sequence (default 2048 on cuda, 128 on cpu)")
    p.add_argument("--modes", default="baseline,logitless,liger,liger-full",
                   help="comma-separated, from " + ", ".join(MODES) + " (the liger modes are skipped when it is not "
                   "importable)")
    p.add_argument("--find-max-batch", action="store_true",
                   help="after training, search the largest batch that fits at --seq (CUDA only)")
    p.add_argument("--max-batch-limit", type=int, default=256, help="the search stops here")
    p.add_argument("--search-seconds", type=float, default=180.0,
                   help="time budget of the search per mode; past it the best batch found so far is reported")
    p.add_argument("--out", default="finetune-out", help="report directory")
    p.add_argument("--dtype", choices=("bf16", "fp32"), default=None,
                   help="the weights' dtype (default bf16 on cuda, fp32 on cpu); with --master fp32, the autocast "
                        "dtype (bf16 only)")
    p.add_argument("--master", choices=("bf16", "fp32"), default=None,
                   help="fp32: float32 master weights, forward and loss under bfloat16 autocast (transformers' "
                        "Trainer with bf16=True); bf16: bfloat16 weights, no autocast (the default on cuda; without "
                        "--master the weights are in --dtype)")
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--warmup", type=int, default=5, help="steps of linear learning-rate warm-up")
    p.add_argument("--timing-skip", type=int, default=3,
                   help="first steps left out of the throughput (allocator growth, cuBLAS and kernel autotuning)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--grad-ckpt", action="store_true", help="activation checkpointing of the decoder layers")
    p.add_argument("--compile", action="store_true", help="torch.compile the model (every mode)")
    p.add_argument("--attn", default=None,
                   help="transformers attention implementation (default sdpa; eager for gemma2, whose attention "
                        "softcap sdpa does not apply)")
    p.add_argument("--tokenizer-vocab", type=int, default=32000,
                   help="BPE vocabulary trained on the corpus (capped at the model's vocabulary)")
    p.add_argument("--corpus-mb", type=float, default=None, help="MB of standard-library text (default 16; 2 on cpu)")
    p.add_argument("--cache", default=None,
                   help="tokenizer and token cache (default $XDG_CACHE_HOME or ~/.cache, /logitless-examples)")
    # Internal: a worker process runs one mode.
    p.add_argument("--worker", choices=MODES, help=argparse.SUPPRESS)
    p.add_argument("--tokens", help=argparse.SUPPRESS)
    p.add_argument("--result", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    return resolve_defaults(args, p)


def logitless_has_cuda() -> bool:
    try:
        import logitless
    except ImportError:
        return False
    return logitless._C.built_with_cuda()


def resolve_defaults(args, parser):
    if args.device is None:
        args.device = "cuda" if torch.cuda.is_available() and logitless_has_cuda() else "cpu"
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA device is available")
    gpu = args.device == "cuda"
    master = getattr(args, "master", None)  # examples/profile.py shares these defaults and has no --master
    if master is not None and args.dtype == "fp32":
        parser.error(f"--master {master}: bfloat16 weights, or float32 ones under bfloat16 autocast; --dtype fp32 "
                     f"contradicts it")
    config = args.config or ("llama-3.2-1b" if gpu else "tiny")
    batch = (4 if master == "fp32" else 8) // (4 if config == "gemma2" else 1) if gpu else 4
    defaults = dict(config=config, steps=50 if gpu else 12, batch=max(batch, 1), seq=2048 if gpu else 128,
                    dtype="bf16" if gpu or master is not None else "fp32", corpus_mb=16.0 if gpu else 2.0,
                    attn="eager" if ARCH_OF[config] == "gemma2" else "sdpa")
    for name, value in defaults.items():
        if getattr(args, name, None) is None:
            setattr(args, name, value)
    args.mode_list = [m.strip() for m in args.modes.split(",") if m.strip()]
    bad = [m for m in args.mode_list if m not in MODES]
    if bad or not args.mode_list:
        parser.error(f"--modes: expected some of {', '.join(MODES)}, got {args.modes!r}")
    if args.cache is None:
        base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
        args.cache = os.path.join(base, "logitless-examples")
    return args


def torch_dtype(args):
    """The weights' dtype."""
    if getattr(args, "master", None) == "fp32":
        return torch.float32
    return torch.bfloat16 if args.dtype == "bf16" else torch.float32


def autocast(args):
    """What forward and loss run under: bfloat16 autocast with float32 master weights, else nothing."""
    if getattr(args, "master", None) == "fp32":
        return torch.autocast(args.device, dtype=torch.bfloat16)
    return contextlib.nullcontext()


def regime(args) -> str:
    if getattr(args, "master", None) == "fp32":
        return "fp32 master weights, forward and loss under bf16 autocast (Trainer's bf16=True)"
    return f"{args.dtype} weights, no autocast"


# ----------------------------------------------------------------------------------------------------
# Progress bar: tqdm when importable, else a line rewritten in place.


class _SimpleBar:
    def __init__(self, total, desc):
        self.total, self.desc, self.n, self.t0, self.postfix = total, desc, 0, time.perf_counter(), ""

    def update(self, n=1):
        self.n += n
        rate = self.n / max(time.perf_counter() - self.t0, 1e-9)
        width = 30
        done = int(width * self.n / max(self.total, 1))
        sys.stderr.write(f"\r{self.desc}: {self.n}/{self.total} [{'#' * done}{'.' * (width - done)}] "
                         f"{rate:.2f} it/s {self.postfix}")
        sys.stderr.flush()

    def set_postfix(self, **values):
        self.postfix = ", ".join(f"{k}={v}" for k, v in values.items())

    def close(self):
        sys.stderr.write("\n")


def progress(total, desc):
    try:
        from tqdm.auto import tqdm
    except ImportError:
        return _SimpleBar(total, desc)
    return tqdm(total=total, desc=desc, dynamic_ncols=True)


# ----------------------------------------------------------------------------------------------------
# Corpus: the Python standard library's sources, a byte-level BPE trained on them.


def stdlib_sources(megabytes):
    import sysconfig

    root = Path(sysconfig.get_paths()["stdlib"])
    texts, total, files = [], 0, 0
    limit = int(megabytes * 1e6)
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in ("site-packages", "dist-packages", "__pycache__"))
        for name in sorted(filenames):
            if not name.endswith(".py") or total >= limit:
                continue
            text = Path(dirpath, name).read_text(encoding="utf-8", errors="replace")
            texts.append(text)
            total += len(text.encode("utf-8"))
            files += 1
    if total < 100_000:
        raise SystemExit(f"corpus: expected Python's standard library sources under {root}, found {total} bytes")
    return texts, dict(source=str(root), files=files, bytes=total)


def corpus_tokens(args, vocab_size):
    """(token ids as int32, description); cached under --cache."""
    vocab = min(args.tokenizer_vocab, vocab_size)
    tag = f"stdlib-py{sys.version_info[0]}{sys.version_info[1]}-{args.corpus_mb:g}mb-bpe{vocab}"
    cache = Path(args.cache) / tag
    if (cache / "tokens.npy").exists() and (cache / "info.json").exists():
        return cache / "tokens.npy", json.loads((cache / "info.json").read_text())
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    t0 = time.perf_counter()
    texts, info = stdlib_sources(args.corpus_mb)
    print(f"corpus: {info['files']} files, {info['bytes'] / 1e6:.1f} MB from {info['source']}; training a "
          f"{vocab}-entry byte-level BPE", file=sys.stderr, flush=True)
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab, special_tokens=[EOT], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(texts, trainer=trainer, length=len(texts))
    eot = tokenizer.token_to_id(EOT)
    ids = []
    for enc in tokenizer.encode_batch(texts):
        ids.extend(enc.ids)
        ids.append(eot)
    tokens = np.asarray(ids, dtype=np.int32)
    info.update(tokenizer="byte-level BPE (tokenizers) trained on the corpus",
                tokenizer_vocab=tokenizer.get_vocab_size(),
                tokens=int(tokens.size), bytes_per_token=round(info["bytes"] / tokens.size, 2),
                python=platform.python_version(), seconds=round(time.perf_counter() - t0, 1))
    cache.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(cache / "tokenizer.json"))
    np.save(cache / "tokens.npy", tokens)
    (cache / "info.json").write_text(json.dumps(info, indent=1))
    print(f"corpus: {tokens.size} tokens ({info['bytes_per_token']} bytes per token) in {info['seconds']} s, "
          f"cached in {cache}", file=sys.stderr, flush=True)
    return cache / "tokens.npy", info


class Batches:
    """Windows of `seq` tokens at random offsets, from a generator seeded once: the same batches in every
    mode. Labels are the inputs (transformers shifts them inside the loss)."""

    def __init__(self, tokens: np.ndarray, seq: int, seed: int):
        if tokens.size <= seq:
            raise SystemExit(f"corpus: {tokens.size} tokens, fewer than one sequence of {seq}")
        self.tokens = torch.from_numpy(tokens.astype(np.int64))
        self.seq = seq
        self.offsets = torch.arange(seq)
        self.generator = torch.Generator().manual_seed(seed)

    def next(self, batch: int) -> torch.Tensor:
        starts = torch.randint(0, self.tokens.numel() - self.seq, (batch, 1), generator=self.generator)
        return self.tokens[starts + self.offsets]


# ----------------------------------------------------------------------------------------------------
# Model, modes, training


def build_model(args, device):
    import transformers

    _, config_class, model_class, _ = ARCHS[ARCH_OF[args.config]]
    config = getattr(transformers, config_class)(**CONFIGS[args.config], attn_implementation=args.attn,
                                                 use_cache=False)
    torch.manual_seed(args.seed)
    with torch.device(device):
        model = getattr(transformers, model_class)(config)
    return model.to(torch_dtype(args)).train()


def liger_unavailable(device: str):
    if device != "cuda":
        return "Liger's kernels are Triton kernels: they need a GPU"
    try:
        import liger_kernel.transformers  # noqa: F401 (what the liger mode imports)
    except Exception as e:  # ImportError, or a Triton that does not load
        return f"liger_kernel not importable ({type(e).__name__}: {e})"
    return None


def liger_call(arch: str, mode: str):
    """(Liger's function for the architecture, its keyword arguments in this mode)."""
    function = ARCHS[arch][3]
    if mode == "liger-full":
        return function, {}  # Liger's own defaults: rope, swiglu / geglu, rms_norm, fused_linear_cross_entropy
    mlp = "geglu" if arch == "gemma2" else "swiglu"
    return function, dict(rope=False, **{mlp: False}, rms_norm=True, cross_entropy=False,
                          fused_linear_cross_entropy=True)


def apply_mode(model, mode):
    if mode == "logitless":
        import logitless

        # The defaults: RMSNorm, gated MLP, RoPE (what verifies on this model), the residual adds fused into the
        # norms and the fused loss.
        logitless.patch(model)
    elif mode in LIGER_MODES:
        import liger_kernel.transformers

        function, kwargs = liger_call(model.config.model_type, mode)
        getattr(liger_kernel.transformers, function)(model=model, **kwargs)
    return model


def patched_summary(model) -> str:
    """What logitless.patch changed, counted from describe()."""
    import logitless

    lines = logitless.hf.describe(model).splitlines()
    counts = [(sum(" -> RMSNorm(" in line for line in lines), "RMSNorms"),
              (sum("-> down_proj(glu(" in line for line in lines), "gated MLPs"),
              (sum("-> residual add fused" in line for line in lines), "layers with the residual add fused"),
              (sum(line.startswith("rope: ") for line in lines), "rope sites"),
              (sum(line.startswith("loss: ") for line in lines), "fused loss")]
    return ", ".join(f"{n} {what}" for n, what in counts)


def enable_checkpointing(model):
    kwargs = {"use_reentrant": False}
    if hasattr(model, "activation_checkpointing_enable"):  # the later 5.x name
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)


def make_optimizer(model, args, device):
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1,
                            fused=device == "cuda")
    warmup = max(args.warmup, 1)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: min(1.0, (step + 1) / warmup))
    return opt, sched


def train_step(model, opt, sched, ids, precision=None):
    """One step; `precision` (a context manager, e.g. autocast(args)) around forward and loss."""
    with precision or contextlib.nullcontext():
        loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    sched.step()
    opt.zero_grad(set_to_none=True)
    return loss.detach()


def is_oom(e: BaseException) -> bool:
    if isinstance(e, torch.OutOfMemoryError):
        return True
    text = str(e)
    return isinstance(e, RuntimeError) and ("out of memory" in text or "ALLOC_FAILED" in text)


def free_cuda():
    gc.collect()
    torch.cuda.empty_cache()


def search_max_batch(fits, start_fit: int, limit: int, deadline: float):
    """The largest batch b <= limit with fits(b), given that start_fit fits (0: none known): doubling until a
    failure, then bisection. Returns (batch, exact, tries); exact is False when the limit or the deadline
    cut the search short (the batch is then a lower bound)."""
    lo, hi, tries = start_fit, None, []
    while time.perf_counter() < deadline:
        if hi is None:
            b = min(max(2 * lo, 1), limit)
            if b <= lo:  # lo == limit
                break
        else:
            if hi - lo <= 1:
                break
            b = (lo + hi) // 2
        ok = fits(b)
        tries.append((b, ok))
        if ok:
            lo = b
        else:
            hi = b
    exact = hi is not None and hi - lo <= 1
    return lo, exact, tries


def worker(args):
    device = args.device
    mode = args.worker
    if device == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    tokens = np.load(args.tokens)
    batches = Batches(tokens, args.seq, args.seed)
    model = apply_mode(build_model(args, device), mode)
    if args.grad_ckpt:
        enable_checkpointing(model)
    step_model = torch.compile(model) if args.compile else model
    opt, sched = make_optimizer(model, args, device)
    result = dict(mode=mode, batch=args.batch, seq=args.seq, steps=args.steps, config=args.config,
                  arch=ARCHS[ARCH_OF[args.config]][0], regime=regime(args),
                  parameters=sum(p.numel() for p in model.parameters()))
    if mode == "logitless":
        result["patched"] = patched_summary(model)
    elif mode in LIGER_MODES:
        function, kwargs = liger_call(ARCH_OF[args.config], mode)
        result["patched"] = f"{function}({', '.join(f'{k}={v}' for k, v in kwargs.items())})"

    if device == "cuda":
        free_cuda()
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    losses, t0, timed = [], None, 0
    bar = progress(args.steps, mode)
    try:
        for step in range(args.steps):
            if step == min(args.timing_skip, args.steps - 1):
                if device == "cuda":
                    torch.cuda.synchronize()
                t0, timed = time.perf_counter(), args.steps - step
            ids = batches.next(args.batch).to(device, non_blocking=True)
            losses.append(train_step(step_model, opt, sched, ids, autocast(args)))
            bar.update(1)
            if step % 10 == 9 or step == args.steps - 1:
                bar.set_postfix(loss=f"{losses[-1].item():.3f}")
        if device == "cuda":
            torch.cuda.synchronize()
        elapsed = time.perf_counter() - t0
        result.update(ok=True, losses=[float(x) for x in losses], seconds=elapsed,
                      tokens_per_s=timed * args.batch * args.seq / elapsed, step_ms=1e3 * elapsed / timed)
    except Exception as e:  # an OOM at this batch is a result; anything else is reported and re-raised
        if not is_oom(e):
            raise
        result.update(ok=False, error=f"out of memory at batch {args.batch}")
    finally:
        bar.close()
    del losses
    if device == "cuda":
        result.update(peak_allocated=torch.cuda.max_memory_allocated(), peak_reserved=torch.cuda.max_memory_reserved())
    else:
        result.update(peak_rss=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)

    if args.find_max_batch and device == "cuda":
        free_cuda()

        def fits(b):
            try:
                for _ in range(2):  # the second step runs with the optimizer state in place
                    train_step(step_model, opt, sched, batches.next(b).to(device), autocast(args))
                torch.cuda.synchronize()
                ok = True
            except Exception as e:
                if not is_oom(e):
                    raise
                ok = False
            opt.zero_grad(set_to_none=True)
            free_cuda()
            print(f"{mode}: batch {b} x {args.seq}: {'fits' if ok else 'out of memory'}", file=sys.stderr, flush=True)
            return ok

        start = args.batch if result["ok"] else 0
        best, exact, tries = search_max_batch(fits, start, args.max_batch_limit,
                                              time.perf_counter() + args.search_seconds)
        result.update(max_batch=best, max_batch_exact=exact, max_batch_tries=tries)
    Path(args.result).write_text(json.dumps(result, indent=1))


# ----------------------------------------------------------------------------------------------------
# The driver: corpus once, a process per mode, the report.


def run_modes(args, tokens_path, out):
    results = {}
    env = dict(os.environ)
    # Fewer fragmentation failures in the largest-batch search; the same for every mode.
    env.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    for mode in args.mode_list:
        why = liger_unavailable(args.device) if mode in LIGER_MODES else None
        if why:
            print(f"{mode}: skipped: {why}", file=sys.stderr, flush=True)
            results[mode] = dict(mode=mode, skipped=why)
            continue
        path = out / f"{mode}.json"
        path.unlink(missing_ok=True)
        cmd = [sys.executable, os.path.abspath(__file__), *sys.argv[1:], "--device", args.device,
               "--worker", mode, "--tokens", str(tokens_path), "--result", str(path)]
        rc = subprocess.run(cmd, env=env).returncode
        if rc != 0 or not path.exists():
            results[mode] = dict(mode=mode, failed=f"worker exited with status {rc}")
        else:
            results[mode] = json.loads(path.read_text())
            path.unlink()  # results.json gathers them all
    return results


def versions():
    v = dict(python=platform.python_version(), torch=torch.__version__)
    try:
        import transformers

        v["transformers"] = transformers.__version__
    except ImportError:
        pass
    try:
        import logitless

        v["logitless"] = logitless.__version__
    except ImportError:
        pass
    try:
        from importlib.metadata import version

        v["liger_kernel"] = version("liger-kernel")
    except Exception:
        pass
    try:
        # As bench/bench.py: LOGITLESS_COMMIT names the tree where git has no history of it; otherwise HEAD,
        # "-dirty" where tracked files differ from it.
        v["commit"] = os.environ.get("LOGITLESS_COMMIT") or subprocess.run(
            ["git", "describe", "--always", "--dirty", "--abbrev=7"], capture_output=True, text=True,
            cwd=os.path.dirname(os.path.abspath(__file__)), check=True).stdout.strip()
    except Exception:
        pass
    return v


def _ratio(x, base):
    return None if x is None or not base else x / base


def _fmt(x, spec):
    return "-" if x is None else format(x, spec)


def summarize(results):
    base = results.get("baseline", {})
    rows = []
    for mode, r in results.items():
        if "skipped" in r or "failed" in r:
            rows.append(dict(mode=mode, note=r.get("skipped") or r.get("failed")))
            continue
        mem = r.get("peak_allocated", r.get("peak_rss"))
        base_mem = base.get("peak_allocated", base.get("peak_rss"))
        row = dict(mode=mode, tokens_per_s=r.get("tokens_per_s"), step_ms=r.get("step_ms"), memory=mem,
                   tokens_ratio=_ratio(r.get("tokens_per_s"), base.get("tokens_per_s")) if base.get("ok") else None,
                   memory_ratio=_ratio(mem, base_mem) if base.get("ok") else None,
                   max_batch=r.get("max_batch"), max_batch_exact=r.get("max_batch_exact"),
                   batch_ratio=_ratio(r.get("max_batch"), base.get("max_batch")), note=r.get("error", ""))
        losses = r.get("losses") or []
        if losses:
            row.update(first_loss=losses[0], last_loss=losses[-1])
        base_losses = base.get("losses") or []
        if losses and base_losses and mode != "baseline":
            n = min(len(losses), len(base_losses))
            rel = [abs(a - b) / abs(b) for a, b in zip(losses[:n], base_losses[:n])]
            row.update(first_rel=rel[0], mean_rel=sum(rel) / n, max_rel=max(rel))
        rows.append(row)
    return rows


# The end-to-end targets: against the baseline, and ahead of Liger's full patch where it ran in the same report.
# "Agree with the baseline": at step 1 (the same weights and batch) the losses differ by at most bf16's epsilon
# (2^-8, relative), and along the curve by at most 1e-3 on average.
LOSS_FIRST_TOL, LOSS_MEAN_TOL = 2.0 ** -8, 1e-3
TARGETS = dict(memory=0.40, tokens=1.45)
PEER = "liger-full"


def target_lines(rows, args):
    by = {r["mode"]: r for r in rows}
    r = by.get("logitless")
    if not r or "tokens_per_s" not in r or not by.get("baseline", {}).get("tokens_per_s"):
        return ["(the targets need a baseline and a logitless run)"]
    peer = by.get(PEER) if "tokens_per_s" in by.get(PEER, {}) else None

    def verdict(ok):
        return "met" if ok else "missed"

    def against_peer(key, better):
        if peer is None or peer.get(key) is None:
            return "", True
        return f", and {'below' if better is min else 'above'} {PEER}'s {peer[key]:.2f}x", \
            better(r[key], peer[key]) == r[key] and r[key] != peer[key]

    lines = []
    if r.get("memory_ratio") is not None:
        text, ok = against_peer("memory_ratio", min)
        lines.append(f"- peak memory {r['memory_ratio']:.2f}x baseline (target <= {TARGETS['memory']}x{text}): "
                     f"{verdict(r['memory_ratio'] <= TARGETS['memory'] and ok)}")
    if r.get("tokens_ratio") is not None:
        text, ok = against_peer("tokens_ratio", max)
        lines.append(f"- tokens/s {r['tokens_ratio']:.2f}x baseline (target >= {TARGETS['tokens']}x{text}): "
                     f"{verdict(r['tokens_ratio'] >= TARGETS['tokens'] and ok)}")
    if r.get("max_batch") is not None and peer is not None and peer.get("max_batch") is not None:
        bound = "" if r.get("max_batch_exact") else " (a lower bound: the search limit or time ran out)"
        lines.append(f"- largest batch {r['max_batch']} vs {PEER}'s {peer['max_batch']} (target: at least as large)"
                     f"{bound}: {verdict(r['max_batch'] >= peer['max_batch'])}")
    if r.get("first_rel") is not None:
        ok = r["first_rel"] <= LOSS_FIRST_TOL and r["mean_rel"] <= LOSS_MEAN_TOL
        lines.append(f"- loss vs baseline over {args.steps} steps: step 1 differs by {r['first_rel']:.2e} "
                     f"(tolerance {LOSS_FIRST_TOL:.2e}), mean {r['mean_rel']:.2e} (tolerance {LOSS_MEAN_TOL:.2e}), "
                     f"max {r['max_rel']:.2e}: {verdict(ok)}")
    return lines


def _softcaps(cfg) -> str:
    parts = [f"{what} {cfg[key]:g}" for key, what in (("attn_logit_softcapping", "attention softcap"),
                                                      ("final_logit_softcapping", "final logit softcap"),
                                                      ("sliding_window", "sliding window"))
             if cfg.get(key) is not None]
    return "".join(", " + p for p in parts)


def write_report(args, out, results, corpus, chart_note):
    rows = summarize(results)
    v = versions()
    gpu = args.device == "cuda"
    device = torch.cuda.get_device_name(0) if gpu else f"CPU ({platform.processor() or platform.machine()})"
    cfg = CONFIGS[args.config]
    arch = ARCHS[ARCH_OF[args.config]][0]
    mem_name = "peak memory (GiB, allocated)" if gpu else "peak RSS (GiB)"
    lines = [
        "# End-to-end training: baseline vs logitless"
        + (" vs Liger" if any(m in results for m in LIGER_MODES) else ""),
        "",
        f"- date: {datetime.datetime.now().strftime('%Y-%m-%d %H:%M')}; device: {device}",
        "- versions: " + ", ".join(f"{k} {val}" for k, val in v.items()),
        f"- model: {args.config}, {arch} architecture (hidden {cfg['hidden_size']}, {cfg['num_hidden_layers']} "
        f"layers, {cfg['num_attention_heads']} heads of {cfg['head_dim']}, {cfg['num_key_value_heads']} kv heads, "
        f"intermediate {cfg['intermediate_size']}, vocab {cfg['vocab_size']}"
        f"{', tied embeddings' if cfg.get('tie_word_embeddings') else ''}{_softcaps(cfg)}), random init "
        f"(seed {args.seed}), attention {args.attn}" + (", activation checkpointing" if args.grad_ckpt else "") +
        (", torch.compile" if args.compile else ""),
        f"- precision: {regime(args)}; every mode runs under it",
        "- patches: " + "; ".join(f"{m}: {r['patched']}" for m, r in results.items() if r.get("patched")),
        f"- training: AdamW (lr {args.lr}, betas 0.9/0.95, weight decay 0.1, {args.warmup}-step warm-up, "
        f"clip 1.0), batch {args.batch} x {args.seq} tokens, {args.steps} steps; tokens/s over steps "
        f"{min(args.timing_skip, args.steps - 1) + 1}..{args.steps}",
        f"- data: {corpus['files']} source files of Python {corpus.get('python', '')}'s standard library "
        f"({corpus['bytes'] / 1e6:.1f} MB from {corpus['source']}), {corpus['tokenizer']}, "
        f"{corpus['tokenizer_vocab']} entries, {corpus['tokens']} tokens; the same random windows in every mode",
        "- command: `" + " ".join([os.path.relpath(sys.argv[0])] + sys.argv[1:]) + "`",
        "",
        f"| mode | tokens/s | vs baseline | step (ms) | {mem_name} | vs baseline | largest batch | vs baseline "
        f"| loss step 1 | loss last | loss vs baseline (mean rel.) | note |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for r in rows:
        if "tokens_per_s" not in r and "memory" not in r:
            lines.append(f"| {r['mode']} | | | | | | | | | | | {r.get('note', '')} |")
            continue
        mb = r.get("max_batch")
        mem = None if r.get("memory") is None else r["memory"] / GIB
        mb_text = "-" if mb is None else f"{mb}" + ("" if r.get("max_batch_exact") else "+")
        lines.append(
            f"| {r['mode']} | {_fmt(r.get('tokens_per_s'), ',.0f')} | {_fmt(r.get('tokens_ratio'), '.2f')} | "
            f"{_fmt(r.get('step_ms'), '.1f')} | {_fmt(mem, '.2f')} | "
            f"{_fmt(r.get('memory_ratio'), '.2f')} | {mb_text} | {_fmt(r.get('batch_ratio'), '.2f')} | "
            f"{_fmt(r.get('first_loss'), '.4f')} | {_fmt(r.get('last_loss'), '.4f')} | "
            f"{_fmt(r.get('mean_rel'), '.2e')} | "
            f"{r.get('note', '')} |")
    not_searched = "Largest batch: not searched" + (
        "." if gpu else " (the search needs a CUDA device: no OOM on the CPU).")
    lines += ["", "Largest batch: `N+` is a lower bound (the search reached --max-batch-limit or its time budget)."
              if args.find_max_batch and gpu else not_searched,
              "", "## Targets (logitless vs baseline, same batch)", ""]
    lines += target_lines(rows, args) if gpu else [
        "The targets are set for the GPU run (sequence 2048 at the real model's shape); on the CPU this run checks "
        "that every mode trains and that the loss curves agree."] + [
        line for line in target_lines(rows, args) if line.startswith("- loss")]
    curves = {m: r["losses"] for m, r in results.items() if r.get("losses")}
    if curves:
        n = max(len(c) for c in curves.values())
        every = max(1, n // 10)
        pick = sorted(set(list(range(0, n, every)) + [n - 1]))
        lines += ["", "## Loss curve", "", "| step | " + " | ".join(curves) + " |",
                  "|---:|" + "---:|" * len(curves)]
        for i in pick:
            values = (_fmt(c[i] if i < len(c) else None, ".4f") for c in curves.values())
            lines.append(f"| {i + 1} | " + " | ".join(values) + " |")
    lines += ["", "## Chart", "", chart_note, ""]
    text = "\n".join(lines)
    (out / "report.md").write_text(text)
    (out / "results.json").write_text(json.dumps(dict(args={k: v for k, v in vars(args).items()},
                                                      corpus=corpus, versions=v, results=results), indent=1))
    return text


def write_chart(out, results, args):
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib is not importable here: no chart (pip install matplotlib and rerun to get report.png)."
    done = {m: r for m, r in results.items() if "tokens_per_s" in r or "peak_allocated" in r or "peak_rss" in r}
    if not done:
        return "No mode completed: no chart."
    colors = {"baseline": "#7f7f7f", "logitless": "#1f77b4", "liger": "#ff7f0e", "liger-full": "#d62728"}
    modes = list(done)
    gpu = args.device == "cuda"
    fig, axes = plt.subplots(2, 2, figsize=(11, 8))
    panels = [
        (axes[0, 0], "tokens/s", [done[m].get("tokens_per_s") or 0 for m in modes], "{:,.0f}"),
        (axes[0, 1], "peak memory (GiB)" if gpu else "peak RSS (GiB)",
         [(done[m].get("peak_allocated") or done[m].get("peak_rss") or 0) / GIB for m in modes], "{:.1f}"),
        (axes[1, 0], f"largest batch at seq {args.seq}", [done[m].get("max_batch") or 0 for m in modes], "{:.0f}"),
    ]
    for ax, title, values, fmt in panels:
        ax.set_title(title)
        if not any(values):
            ax.text(0.5, 0.5, "not measured", transform=ax.transAxes, ha="center")
            ax.set_xticks([])
            ax.set_yticks([])
            continue
        bars = ax.bar(modes, values, color=[colors.get(m, "#2ca02c") for m in modes])
        ax.margins(y=0.12)  # room for the labels above the bars
        base = values[modes.index("baseline")] if "baseline" in modes else 0
        for bar, value in zip(bars, values):
            label = fmt.format(value) + (f" ({value / base:.2f}x)" if base and value else "")
            ax.annotate(label, (bar.get_x() + bar.get_width() / 2, bar.get_height()), ha="center", va="bottom",
                        fontsize=9)
    ax = axes[1, 1]
    for m in modes:
        if done[m].get("losses"):
            ax.plot(range(1, len(done[m]["losses"]) + 1), done[m]["losses"], label=m, color=colors.get(m),
                    linewidth=1.2)
    ax.set_title("training loss")
    ax.set_xlabel("step")
    ax.legend()
    fig.suptitle(f"{args.config} ({ARCHS[ARCH_OF[args.config]][0]}), {regime(args)}, batch {args.batch} x {args.seq}"
                 + (f", {torch.cuda.get_device_name(0)}" if gpu else ", CPU"))
    fig.tight_layout()
    fig.savefig(out / "report.png", dpi=110)
    plt.close(fig)
    return "![throughput, memory, largest batch and loss per mode](report.png)"


def main(argv=None):
    args = parse_args(argv)
    if args.worker:
        return worker(args)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    tokens_path, corpus = corpus_tokens(args, CONFIGS[args.config]["vocab_size"])
    results = run_modes(args, tokens_path, out)
    chart_note = write_chart(out, results, args)
    print(write_report(args, out, results, corpus, chart_note))
    print(f"\nreport: {out / 'report.md'}", file=sys.stderr)
    return 0 if all("failed" not in r for r in results.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
