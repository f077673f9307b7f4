"""Hostile inputs (issue 19): every public op against wrong devices, dtypes, ranks and shapes, empty and huge sizes,
NaN and inf in every float input, odd strides, aliasing, double and repeated backward, and gradients shared with
other consumers. The cases and what each must end in are in _hostile.py.

Each (family, device setup) runs in child processes that report every case as JSON lines; a crash is the failure of
the case it happened in, and a new child carries on from the next case. The children of all families start at once
(the suite's time is mostly imports). CUDA setups run where a GPU is present; "cuda+cuda1" needs two.
"""
import json
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

import _hostile
from _helpers import HAS_CUDA, needs_cuda

HERE = Path(__file__).resolve().parent
TWO_GPUS = HAS_CUDA and torch.cuda.device_count() >= 2
needs_two_cuda = pytest.mark.skipif(not TWO_GPUS, reason="needs two CUDA devices")
MARKS = {"cpu": [], "cuda": [needs_cuda], "cpu+cuda": [needs_cuda], "cuda+cuda1": [needs_two_cuda]}
CHILD_TIMEOUT_S = 600


def _setups_here():
    return [s for s in _hostile.SETUPS if s == "cpu" or (HAS_CUDA and (s != "cuda+cuda1" or TWO_GPUS))]


def _run_family(family: str, setup: str) -> dict:
    """{case index: (ok, detail)} for one family and setup, restarting the child after a crash."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(HERE)] + [p for p in sys.path if p]))
    results, first = {}, 0
    total = len(_hostile.cases_for(family, setup))
    while first < total:
        try:
            proc = subprocess.run([sys.executable, str(HERE / "_hostile.py"), family, setup, str(first)], env=env,
                                  capture_output=True, text=True, timeout=CHILD_TIMEOUT_S)
            out, err, code = proc.stdout, proc.stderr, proc.returncode
        except subprocess.TimeoutExpired as e:
            out = e.stdout.decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
            err, code = f"timed out after {CHILD_TIMEOUT_S} s", None
        started = None
        for line in out.splitlines():
            try:
                r = json.loads(line)
            except ValueError:
                continue
            if r["event"] == "start":
                started = r["index"]
            else:
                results[r["index"]] = (r["ok"], r["detail"])
                started = None
        if started is not None:  # the child died inside this case
            results[started] = (False, f"the child process died in this case (exit code {code}): {err[-2000:]}")
        elif code != 0 and not results:
            results[first] = (False, f"the child process failed (exit code {code}): {err[-2000:]}")
        done = [i for i in results if i >= first]
        first = (max(done) + 1) if done else total
    return results


@pytest.fixture(scope="session")
def hostile_results():
    jobs = [(f, s) for f in _hostile.FAMILIES for s in _setups_here()]
    workers = max(2, min(len(jobs), os.cpu_count() or 2))
    with ThreadPoolExecutor(workers) as pool:
        outcomes = list(pool.map(lambda job: _run_family(*job), jobs))
    return dict(zip(jobs, outcomes))


def _params():
    for family in _hostile.FAMILIES:
        for setup in _hostile.SETUPS:
            for index, (name, _) in enumerate(_hostile.cases_for(family, setup)):
                yield pytest.param(family, setup, index, id=f"{family}-{setup}-{name}", marks=MARKS[setup])


@pytest.mark.parametrize("family,setup,index", list(_params()))
def test_hostile(hostile_results, family, setup, index):
    ok, detail = hostile_results[(family, setup)].get(index, (False, "the case did not run"))
    assert ok, detail
