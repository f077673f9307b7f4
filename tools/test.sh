#!/usr/bin/env bash
# The test command (README): installs what the build and the tests need, checks the style (ruff check, and
# clang-format 14 with .clang-format), builds the library, the C++ tests and the Python extension with every CUDA
# source (a CUDA compile error fails here; no GPU is needed), runs the C++ tests (GPU cases skip without a GPU),
# installs the CMake package and builds a consumer against it, and runs the Python tests.
#   tools/test.sh            BUILD=build/test by default; CUDA_ARCHS overrides the targets (default 90a;80)
set -euo pipefail
cd "$(dirname "$0")/.."
BUILD=${BUILD:-build/test}
JOBS=${JOBS:-$(nproc)}
PY=${PYTHON:-python3}
export PYTHONUNBUFFERED=1

step() { printf '\n==== %s (%s)\n' "$1" "$(date +%H:%M:%S)"; }

step "dependencies"
SUDO=""; [ "$(id -u)" -ne 0 ] && SUDO=sudo
if ! command -v cmake >/dev/null || ! command -v ninja >/dev/null || [ ! -f /usr/include/gtest/gtest.h ]; then
  if command -v apt-get >/dev/null; then
    $SUDO apt-get update -qq && $SUDO apt-get install -y -qq cmake ninja-build libgtest-dev g++ >/dev/null
  fi
fi
command -v nvcc >/dev/null || export PATH=/usr/local/cuda/bin:$PATH
"$PY" -m pip install -q --disable-pip-version-check "torch>=2.4" "nanobind>=2.0" "scikit-build-core>=0.10" pytest numpy \
  "transformers>=5.0,<6" "trl>=1.16,<1.17; python_version >= '3.11'"  # test_hf_patch.py, test_integrations.py (pyproject's hf, trl extras)
# The CuTe/CUTLASS headers of the Hopper kernels (the version CMakeLists.txt pins); its Python side is not used.
"$PY" -m pip install -q --disable-pip-version-check --no-deps "nvidia-cutlass==4.2.0.0"

step "lint (ruff, clang-format 14)"
# The versions .pre-commit-config.yaml pins: another clang-format release formats some constructs differently.
"$PY" -m pip install -q --disable-pip-version-check "ruff==0.17.6"
"$PY" -m ruff check .
CLANG_FORMAT=""
for c in clang-format-14 clang-format; do
  if command -v "$c" >/dev/null && "$c" --version | grep -q "version 14\."; then CLANG_FORMAT=$c; break; fi
done
if [ -z "$CLANG_FORMAT" ] && command -v apt-get >/dev/null; then
  { $SUDO apt-get update -qq && $SUDO apt-get install -y -qq clang-format-14 >/dev/null; } || true
  command -v clang-format-14 >/dev/null && CLANG_FORMAT=clang-format-14
fi
if [ -z "$CLANG_FORMAT" ]; then  # no such apt package here: the PyPI build of the same release
  "$PY" -m pip install -q --disable-pip-version-check "clang-format==14.0.6"
  CLANG_FORMAT="$("$PY" -c 'import sysconfig; print(sysconfig.get_path("scripts"))')/clang-format"
fi
git ls-files -z -- 'include/*' 'src/*' 'tests/cpp/*' 'bench/cpp/*' 'examples/*' \
  | grep -zE '\.(h|cpp|cu|cuh)$' | xargs -0 "$CLANG_FORMAT" --dry-run --Werror

step "configure and build (CUDA targets ${CUDA_ARCHS:-90a;80})"
cmake -S . -B "$BUILD" -G Ninja -DCMAKE_BUILD_TYPE=Release -DLOGITLESS_TESTS=ON -DLOGITLESS_PYTHON=ON \
  -DPython_EXECUTABLE="$(command -v "$PY")" ${CUDA_ARCHS:+-DCMAKE_CUDA_ARCHITECTURES=$CUDA_ARCHS} >/dev/null
cmake --build "$BUILD" -j "$JOBS"

step "C++ tests"
"$BUILD/tests/cpp/logitless_tests" --gtest_brief=1

step "installed CMake package and a consumer"
rm -rf "$BUILD/prefix" "$BUILD/consumer"
cmake --install "$BUILD" --prefix "$BUILD/prefix" >/dev/null
cmake -S examples/consumer -B "$BUILD/consumer" -G Ninja -DCMAKE_PREFIX_PATH="$PWD/$BUILD/prefix" >/dev/null
cmake --build "$BUILD/consumer" >/dev/null
"$BUILD/consumer/consumer"

step "Python tests"
PYTHONPATH="$PWD/$BUILD/python" "$PY" -m pytest -q tests/python

step "done"
