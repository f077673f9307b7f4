#!/usr/bin/env python3
"""TRL's SFTTrainer three ways on one GPU, same model, same batches, same run: TRL as it ships, TRL with
``use_liger_kernel=True``, and TRL with ``logitless.integrations.use_logitless(trainer)``.

The model has Llama-3.2-1B's shape (examples/finetune.py's config, random weights: nothing is downloaded); the
data is pre-tokenized random ids of --seq tokens (the speed and memory of a step do not depend on the text).
Each mode runs in its own process (a clean CUDA context, peak-memory counter and no patch leaking between
modes). Reports tokens/s over the steps after --skip and the peak allocated memory, as a markdown table.

    PYTHONPATH=build/<dir>/python python bench/trl_sft.py --steps 30 --batch 8 --seq 2048 --out sft.md
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

MODES = ("trl", "trl+liger", "trl+logitless")
GIB = 1 << 30


def _tokenizer():
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<eos>": 1, "<bos>": 2, "<unk>": 3}
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    return PreTrainedTokenizerFast(tokenizer_object=core, pad_token="<pad>", eos_token="<eos>", bos_token="<bos>",
                                   unk_token="<unk>")


def _model(args):
    import torch
    import transformers

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
    from finetune import LLAMA_3_2_1B

    torch.manual_seed(args.seed)
    config = transformers.LlamaConfig(**LLAMA_3_2_1B, pad_token_id=0, eos_token_id=1, bos_token_id=2)
    dtype = torch.bfloat16 if args.master == "bf16" else torch.float32
    return transformers.LlamaForCausalLM(config).to(device="cuda", dtype=dtype)


def _dataset(args, vocab):
    import datasets
    import torch

    g = torch.Generator().manual_seed(args.seed + 1)
    n = args.batch * (args.steps + 1)
    ids = torch.randint(4, vocab, (n, args.seq), generator=g)
    return datasets.Dataset.from_dict({"input_ids": ids.tolist()})


class _Clock:
    """A TrainerCallback that times each optimizer step between CUDA synchronizations, and runs step
    ``profile_step`` (if any) under torch.profiler, keeping its table of kernels by device time."""

    def __init__(self, profile_step=None):
        import torch
        from transformers import TrainerCallback

        outer = self
        self.times = []
        self.kernels = None

        class Callback(TrainerCallback):
            def on_step_begin(self, *a, **k):
                torch.cuda.synchronize()
                if len(outer.times) == profile_step:
                    outer.prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA])
                    outer.prof.__enter__()
                outer.t0 = time.perf_counter()

            def on_step_end(self, *a, **k):
                torch.cuda.synchronize()
                outer.times.append(time.perf_counter() - outer.t0)
                if len(outer.times) == (profile_step or 0) + 1 and profile_step is not None:
                    outer.prof.__exit__(None, None, None)
                    outer.kernels = outer.prof.key_averages().table(sort_by="self_device_time_total", row_limit=30,
                                                                    max_name_column_width=90)

        self.callback = Callback()


def worker(args) -> dict:
    import torch
    import trl

    model = _model(args)
    config = dict(output_dir=tempfile.mkdtemp(), max_steps=args.steps, per_device_train_batch_size=args.batch,
                  max_length=args.seq, packing=False, logging_steps=1, save_strategy="no", report_to="none",
                  seed=args.seed, data_seed=args.seed, bf16=True, learning_rate=1e-4, disable_tqdm=True,
                  dataloader_num_workers=0, use_liger_kernel=args.worker == "trl+liger")
    trainer = trl.SFTTrainer(model=model, args=trl.SFTConfig(**config),
                             train_dataset=_dataset(args, model.config.vocab_size), processing_class=_tokenizer())
    if args.worker == "trl+logitless":
        from logitless.integrations import use_logitless

        use_logitless(trainer)
    clock = _Clock(args.profile_step)
    trainer.add_callback(clock.callback)
    torch.cuda.reset_peak_memory_stats()
    trainer.train()
    steady = [t for i, t in enumerate(clock.times[args.skip:], args.skip) if i != args.profile_step]
    losses = [e["loss"] for e in trainer.state.log_history if "loss" in e]
    return dict(mode=args.worker, tokens_per_s=args.batch * args.seq * len(steady) / sum(steady),
                step_ms=1e3 * sum(steady) / len(steady), peak_gib=torch.cuda.max_memory_allocated() / GIB,
                first_loss=losses[0], last_loss=losses[-1], gpu=torch.cuda.get_device_name(), kernels=clock.kernels)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--modes", default=",".join(MODES))
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--skip", type=int, default=5, help="steps left out of the timing (warm-up)")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--master", choices=("bf16", "fp32"), default="bf16",
                   help="weights in bf16, or float32 master weights under the trainer's bf16 autocast")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None, help="also write the table here")
    p.add_argument("--profile-step", type=int, default=None,
                   help="run this step under torch.profiler (left out of the timing) and print its kernels")
    p.add_argument("--worker", choices=MODES, help=argparse.SUPPRESS)
    p.add_argument("--result", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        Path(args.result).write_text(json.dumps(worker(args)))
        return 0
    rows = []
    for mode in args.modes.split(","):
        if mode not in MODES:
            p.error(f"--modes: unknown mode {mode!r}; choose from {', '.join(MODES)}")
        result = Path(tempfile.mkdtemp()) / "result.json"
        cmd = [sys.executable, __file__, "--worker", mode, "--result", str(result)] + (argv or sys.argv[1:])
        rc = subprocess.run(cmd, env=os.environ.copy()).returncode
        rows.append(json.loads(result.read_text()) if rc == 0 and result.exists() else dict(mode=mode, failed=rc))
    base = next((r for r in rows if r.get("mode") == "trl" and "failed" not in r), None)
    lines = [f"TRL SFTTrainer, Llama-3.2-1B shape, batch {args.batch} x seq {args.seq}, {args.master} weights, "
             f"{args.steps} steps ({args.skip} untimed)", "",
             "| mode | tokens/s | vs trl | step ms | peak GiB | vs trl | loss first → last |",
             "|---|---:|---:|---:|---:|---:|---|"]
    for r in rows:
        if "failed" in r:
            lines.append(f"| {r['mode']} | failed (rc {r['failed']}) | | | | | |")
            continue
        rel = (f"{r['tokens_per_s'] / base['tokens_per_s']:.2f}", f"{r['peak_gib'] / base['peak_gib']:.2f}") \
            if base else ("", "")
        lines.append(f"| {r['mode']} | {r['tokens_per_s'] / 1e3:.1f}k | {rel[0]} | {r['step_ms']:.0f} | "
                     f"{r['peak_gib']:.1f} | {rel[1]} | {r['first_loss']:.3f} → {r['last_loss']:.3f} |")
    if rows and "gpu" in rows[0]:
        lines.append(f"\nGPU: {rows[0]['gpu']}")
    for r in rows:
        if r.get("kernels"):
            lines += ["", f"Kernels of step {args.profile_step}, {r['mode']}:", "```", r["kernels"], "```"]
    text = "\n".join(lines)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")
    return 0 if all("failed" not in r for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
