"""Spawned ranks for the distributed tests: `world` processes joined in one torch.distributed group (gloo on the CPU,
NCCL on one GPU each), kept for a test module (a module fixture) and asked to run one case function at a time.

A case is ``module.function(rank, world, *args)``, looked up by name in the child (spawned children import the test
module again; pytest's sys.path travels with them). Its return value comes back to the test; an exception in any
rank fails the test with that rank's traceback. Collectives time out after a minute, so a rank that failed before
one does not hang the others for ever.
"""
from __future__ import annotations

import datetime
import importlib
import os
import socket
import traceback

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import logitless

TIMEOUT_S = 240


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank, world, port, backend, module, tasks, results):
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    torch.set_num_threads(1)
    if backend == "nccl":
        torch.cuda.set_device(rank)
    dist.init_process_group(backend, rank=rank, world_size=world, timeout=datetime.timedelta(seconds=60))
    cases = importlib.import_module(module)
    while True:
        item = tasks.get()
        if item is None:
            break
        name, args = item
        try:
            results.put((rank, "ok", getattr(cases, name)(rank, world, *args)))
        except BaseException:  # noqa: BLE001 - reported to the test, which fails with it
            results.put((rank, "err", traceback.format_exc()))
    dist.destroy_process_group()


class Ranks:
    """`world` spawned ranks that run the case functions of `module` (a module name) on request."""

    def __init__(self, world: int, backend: str, module: str):
        ctx = mp.get_context("spawn")
        self.world, self.device = world, "cuda" if backend == "nccl" else "cpu"
        self.tasks = [ctx.Queue() for _ in range(world)]
        self.results = ctx.Queue()
        port = _free_port()
        self.procs = [ctx.Process(target=_worker, args=(r, world, port, backend, module, self.tasks[r], self.results),
                                  daemon=True) for r in range(world)]
        for p in self.procs:
            p.start()

    def run(self, name, *args):
        for q in self.tasks:
            q.put((name, args))
        out, errors = {}, []
        for _ in range(self.world):
            rank, status, value = self.results.get(timeout=TIMEOUT_S)
            if status == "err":
                errors.append(f"rank {rank}:\n{value}")
            out[rank] = value
        if errors:
            pytest.fail("\n".join(errors), pytrace=False)
        return [out[r] for r in range(self.world)]

    def close(self):
        for q in self.tasks:
            q.put(None)
        for p in self.procs:
            p.join(timeout=30)
            if p.is_alive():
                p.terminate()


def spawn(world: int, backend: str, module: str):
    """A fixture body: the ranks, or a skip where the backend cannot run here."""
    if backend == "nccl":
        if not torch.cuda.is_available() or torch.cuda.device_count() < world or not dist.is_nccl_available():
            pytest.skip(f"needs {world} CUDA devices and NCCL")
        if not logitless._C.built_with_cuda():
            pytest.skip("logitless was built without its CUDA backend")
    ranks = Ranks(world, backend, module)
    yield ranks
    ranks.close()
