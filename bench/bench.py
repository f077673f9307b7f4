"""The benchmark command: every selected op against its peers, in one process, one table.

    python bench/bench.py                              # every suite, default (GPU) shapes
    python bench/bench.py --ops cross_entropy --shapes 8192x128256 --out bench/out.md
    python bench/bench.py --quick                      # small shapes; runs on the CPU backend without a GPU

Each op is a module bench/suites/<op>.py with a `run(ctx, shapes) -> list[Row]` function and
QUICK_SHAPES / DEFAULT_SHAPES lists (see bench/common.py). Needs `import logitless` to work, e.g.
PYTHONPATH=build/<dir>/python. Results worth keeping go to bench/RESULTS.md with the header printed here.
"""
from __future__ import annotations

import argparse
import datetime
import importlib
import os
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import torch  # noqa: E402

import common  # noqa: E402


def available_suites():
    return sorted(p.stem for p in (HERE / "suites").glob("*.py") if not p.stem.startswith("_"))


def header(args, device) -> dict:
    import logitless

    # Set by the caller (LOGITLESS_COMMIT=<sha> tools/device-check.sh ...) where git has no history of the tree.
    # Otherwise HEAD, marked "-dirty" where tracked files differ from it (a copy of a newer tree over an old checkout).
    commit = os.environ.get("LOGITLESS_COMMIT", "")
    try:
        commit = commit or subprocess.run(["git", "describe", "--always", "--dirty", "--abbrev=7"], cwd=HERE,
                                          capture_output=True, text=True, check=True).stdout.strip()
    except Exception:
        commit = "unknown"
    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else f"CPU ({os.cpu_count()} cores)"
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "device": gpu,
        "commit": commit,
        "torch": torch.__version__,
        "logitless": f"{logitless.__version__} (CUDA backend: {logitless._C.built_with_cuda()})",
        "command": "python bench/bench.py " + " ".join(sys.argv[1:]),
    }


def main(argv=None) -> int:
    suites = available_suites()
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ops", default=",".join(suites), help=f"comma-separated suites (default: all of {suites})")
    ap.add_argument("--shapes", default=None, help="comma-separated shapes in the suites' format (default: theirs)")
    ap.add_argument("--quick", action="store_true", help="small shapes, few iterations (the CPU mode)")
    ap.add_argument("--device", default=None, help="cuda or cpu (default: cuda when available)")
    ap.add_argument("--warmup", type=int, default=None)
    ap.add_argument("--iters", type=int, default=None)
    ap.add_argument("--out", default=None, help="write the table to this .md or .json file as well")
    ap.add_argument("--algo", default="auto", help="cross_entropy: CUDA kernel (auto, row_resident, streaming)")
    ap.add_argument("--seed-dir", default=None,
                    help="directory of seed000_cross_entropy.py (default: ../shared/seeds/baselines from the repo)")
    args = ap.parse_args(argv)

    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type == "cpu" and not args.quick:
        print("no GPU: running the quick CPU mode (--quick)", file=sys.stderr)
        args.quick = True
    ctx = common.Context(device=device, quick=args.quick,
                         warmup=args.warmup if args.warmup is not None else (2 if args.quick else 5),
                         iters=args.iters if args.iters is not None else (5 if args.quick else 20),
                         options={"algo": args.algo, "seed_dir": args.seed_dir})

    rows = []
    for op in [o.strip() for o in args.ops.split(",") if o.strip()]:
        if op not in suites:
            ap.error(f"--ops: unknown suite {op!r}; available: {', '.join(suites)}")
        suite = importlib.import_module(f"suites.{op}")
        shapes = args.shapes.split(",") if args.shapes else (suite.QUICK_SHAPES if args.quick else suite.DEFAULT_SHAPES)
        print(f"[{op}] shapes {', '.join(shapes)} on {device}", file=sys.stderr, flush=True)
        rows += suite.run(ctx, shapes)

    info = header(args, device)
    if args.out:
        common.write(rows, args.out, info)
    print("\n".join(f"{k}: {v}" for k, v in info.items()))
    print()
    print(common.text_table(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
