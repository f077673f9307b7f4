#!/usr/bin/env bash
# The main job (README): install the package, then run the benchmark command. On a GPU it prints the
# comparison table (logitless, torch eager, torch.compile, Liger and the seed kernels when importable) on
# the default Llama-3 shapes; without a GPU it runs the CPU backend on small shapes.
#   tools/bench.sh [bench.py arguments...]
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
command -v nvcc >/dev/null || { [ -x /usr/local/cuda/bin/nvcc ] && export PATH=/usr/local/cuda/bin:$PATH; } || true
"$PY" -m pip install -q --disable-pip-version-check "torch>=2.4"
"$PY" -m pip install -q --disable-pip-version-check .
extra=()
"$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" || extra=(--quick)
# Run from outside the source tree so that the installed package (with its extension) is the one imported.
cd bench && exec "$PY" bench.py "${extra[@]}" "$@"
