"""Smoke runs of examples/finetune.py and examples/profile.py on the CPU: tiny Llama, Qwen3 and Gemma 2 configs, a few
steps, a small slice of the standard-library corpus (tokenized once for all the runs); the reports they write are
checked for their content.

Skips when transformers is not importable (tools/test.sh installs it).
Run: PYTHONPATH=build/<dir>/python python -m pytest tests/python/test_examples.py -q
"""
import gzip
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers")

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
SMALL = ["--device", "cpu", "--seq", "64", "--batch", "2", "--corpus-mb", "0.5", "--tokenizer-vocab", "512"]


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    """The tokenizer and tokens, shared by the runs (training the BPE is most of a run's setup)."""
    return tmp_path_factory.mktemp("cache")


def _run(script, tmp_path, cache, *args):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
    proc = subprocess.run([sys.executable, str(EXAMPLES / script), *SMALL, "--cache", str(cache),
                           "--out", str(tmp_path / "out"), *args], env=env, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return tmp_path / "out", proc.stdout


def test_finetune_trains_every_mode_and_writes_the_report(tmp_path, cache):
    out, stdout = _run("finetune.py", tmp_path, cache, "--steps", "3", "--timing-skip", "1",
                       "--modes", "baseline,logitless,liger,liger-full")
    results = json.loads((out / "results.json").read_text())["results"]
    assert results["liger"]["skipped"] and results["liger-full"]["skipped"]  # Liger needs a GPU
    for mode in ("baseline", "logitless"):
        r = results[mode]
        assert r["ok"] and len(r["losses"]) == 3 and r["tokens_per_s"] > 0 and r["peak_rss"] > 0
    # float32 on the CPU: the same losses up to float32 rounding, from the same weights and batches.
    for a, b in zip(results["baseline"]["losses"], results["logitless"]["losses"]):
        assert abs(a - b) <= 1e-4 * abs(a)
    # Few files: a device run sends back at most a handful.
    assert {p.name for p in out.iterdir()} <= {"report.md", "report.png", "results.json"}
    report = (out / "report.md").read_text()
    assert report in stdout
    for text in ("| baseline |", "| logitless |", "| liger |", "| liger-full |", "standard library", "## Loss curve",
                 "## Chart", "Llama architecture", "precision: fp32 weights, no autocast",
                 "2 layers with the residual add fused"):
        assert text in report
    try:
        import matplotlib  # noqa: F401 (the report has a chart when it is importable)
    except ImportError:
        assert "matplotlib is not importable" in report
    else:
        assert (out / "report.png").stat().st_size > 0


@pytest.mark.parametrize("config,master", [("tiny-qwen3", "fp32"), ("tiny-gemma2", None)])
def test_finetune_other_architectures_and_fp32_master(tmp_path, cache, config, master):
    """Qwen3 under float32 master weights and bfloat16 autocast, Gemma 2 (sandwich norms, softcaps, sliding window,
    eager attention) in float32: both modes train, the report names the architecture and the regime."""
    extra = ["--master", master] if master else []
    out, stdout = _run("finetune.py", tmp_path, cache, "--steps", "2", "--timing-skip", "1", "--config", config,
                       "--modes", "baseline,logitless,liger-full", *extra)
    saved = json.loads((out / "results.json").read_text())
    results = saved["results"]
    assert results["liger-full"]["skipped"]
    arch = {"tiny-qwen3": "Qwen3", "tiny-gemma2": "Gemma 2"}[config]
    for mode in ("baseline", "logitless"):
        r = results[mode]
        assert r["ok"] and len(r["losses"]) == 2 and r["arch"] == arch and r["config"] == config
    # bfloat16 autocast: the loss within bfloat16's noise of the baseline's; float32: to float32 rounding.
    tol = 2.0 ** -7 if master else 1e-4
    for a, b in zip(results["baseline"]["losses"], results["logitless"]["losses"]):
        assert abs(a - b) <= tol * abs(a)
    report = (out / "report.md").read_text()
    regime = "fp32 master weights, forward and loss under bf16 autocast" if master else "fp32 weights, no autocast"
    for text in (f"{config}, {arch} architecture", f"precision: {regime}", "2 layers with the residual add fused"):
        assert text in report
    if config == "tiny-gemma2":
        assert "attention eager" in report and "final logit softcap 30" in report


def test_profile_writes_tables_and_traces(tmp_path, cache):
    out, stdout = _run("profile.py", tmp_path, cache, "--warmup", "1", "--row-limit", "5")
    text = (out / "profile.md").read_text()
    assert "## baseline: top 5" in text and "## logitless: top 5" in text
    assert "aten::_log_softmax" in text or "aten::mm" in text  # a real ops table
    assert "logitless::" in text.split("## logitless")[1]  # the fused ops show up after patching
    for mode in ("baseline", "logitless"):
        trace = json.loads(gzip.decompress((out / f"trace_{mode}.json.gz").read_bytes()))
        assert trace["traceEvents"]
