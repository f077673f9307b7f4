#!/usr/bin/env bash
# The whole GPU round in one command: build (Hopper only, all cores), C++ tests, compute-sanitizer on the
# GPU suite's small shapes, the kernel micro-benchmark, the Python tests and the peer benchmark. Logs go to
# $OUT (or ./device-out); a short summary is printed last.
#   tools/device-check.sh [steps...]   steps, run in the order given: build cpp sanitize cppbench py bench
#   (default: all, in that order)
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/device-out}
mkdir -p "$OUT"
steps=("$@")
[ ${#steps[@]} -eq 0 ] && steps=(build cpp sanitize cppbench py bench)
BUILD=${BUILD:-build/gpu}
case $BUILD in /*) ;; *) BUILD=$PWD/$BUILD ;; esac  # absolute: a build kept outside the tree survives between calls
summary=()
note() { summary+=("$1"); echo "== $1"; }
export PYTHONUNBUFFERED=1

# Wheels carried in .whl (e.g. liger-kernel) go to a private site dir.
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi

nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.mem --format=csv,noheader > "$OUT/gpu.txt" 2>&1
note "gpu: $(head -1 "$OUT/gpu.txt")"

step_build() {
  t0=$(date +%s)
  # CUTLASS headers: the nvidia-cutlass wheel carried in .whl (installed into /tmp/site above).
  local cutlass=/tmp/site/cutlass_library/source/include
  if cmake -S . -B "$BUILD" -G Ninja -DCMAKE_CUDA_ARCHITECTURES=${CUDA_ARCHS:-90a} -DLOGITLESS_PYTHON=${PY:-ON} \
       -DLOGITLESS_TESTS=ON $([ -d $cutlass ] && echo -DLOGITLESS_CUTLASS_DIR=$cutlass) > "$OUT/configure.log" 2>&1 && cmake --build "$BUILD" -j "$(nproc)" > "$OUT/build.log" 2>&1; then
    note "build: ok ($(( $(date +%s) - t0 )) s)"
  else
    note "build: FAILED (see build.log)"; tail -40 "$OUT/build.log"
    printf '%s\n' "${summary[@]}"; exit 1
  fi
}
TESTS=$BUILD/tests/cpp/logitless_tests

step_cpp() {
  # Four gtest shards side by side (4 OpenMP threads each): much of the harness is single-threaded, so
  # shards finish the suite about three times sooner than one 16-thread process.
  t0=$(date +%s)
  local shards=${CPP_SHARDS:-4} i pids=()
  for ((i = 0; i < shards; i++)); do
    GTEST_TOTAL_SHARDS=$shards GTEST_SHARD_INDEX=$i OMP_NUM_THREADS=$(( $(nproc) / shards )) \
      timeout ${CPP_TIMEOUT:-420} stdbuf -oL -eL "$TESTS" --gtest_print_time=1 ${GTEST_FILTER:+--gtest_filter=$GTEST_FILTER} \
      > "$OUT/gtest.$i.log" 2>&1 &
    pids+=($!)
  done
  local rc=0 r
  for i in "${!pids[@]}"; do wait "${pids[$i]}"; r=$?; [ $r -ne 0 ] && rc=$r; done
  cat "$OUT"/gtest.[0-9]*.log > "$OUT/gtest.log"
  local passed failed skipped
  passed=$(grep -hE '^\[  PASSED  \] [0-9]+' "$OUT"/gtest.[0-9]*.log | awk '{s += $4} END {print s+0}')
  failed=$(grep -hE '^\[  FAILED  \] [0-9]+ test' "$OUT"/gtest.[0-9]*.log | awk '{s += $4} END {print s+0}')
  skipped=$(grep -hE '^\[  SKIPPED \] [0-9]+' "$OUT"/gtest.[0-9]*.log | awk '{s += $4} END {print s+0}')
  note "c++ tests: rc=$rc, passed $passed, failed $failed, skipped $skipped ($(( $(date +%s) - t0 )) s)"
  grep -hE '^\[  FAILED  \] .*\(' "$OUT"/gtest.[0-9]*.log | head -20
  for ((i = 0; i < shards; i++)); do
    grep -qE '^\[==========\] [0-9]+ tests? .* ran' "$OUT/gtest.$i.log" || { echo "shard $i did not finish; last:"; grep -E '^\[ RUN' "$OUT/gtest.$i.log" | tail -1; }
  done
  # The slowest cases (gtest prints each case's time).
  grep -hE '^\[       OK \]' "$OUT"/gtest.[0-9]*.log | sed -E 's/.*\(([0-9]+) ms\)/\1 &/' | sort -rn | head -5
  rm -f "$OUT"/gtest.[0-9]*.log  # at most 8 files come back from the device
}

step_sanitize() {
  t0=$(date +%s)
  # Small shapes of every family: memcheck slows kernels down by orders of magnitude.
  filter=${SANITIZE_FILTER:-'Shapes/CrossEntropyCuda.*N7_V*:Shapes/CrossEntropyCuda.*N1_V*:CrossEntropyCudaErrors.*:CrossEntropyNumerics.*:Shapes/RMSNormCuda.*N1_*:Shapes/RMSNormCuda.*N7_*:Shapes/LinearCrossEntropyCuda.*N7_*:Shapes/LinearCrossEntropyCuda.*N1_*:Shapes/PolicyLossCuda.MatchesCpuBackend/B3_L5_V1000_*:PolicyLossCudaErrors.*:Shapes/SelectiveLogSoftmaxCuda.MatchesCpuBackend/N37_*:*VocabParallel*Cuda*:Shapes/PolicyLossCuda.EveryAlgorithmMatchesCpuBackend/*V1000*:Shapes/LinearPolicyLossCuda.*B3_L5_H64_V1000*:Shapes/LinearSelectiveLogSoftmaxCuda.*N37_*-CrossEntropyCudaErrors.RefusedLaunchDoesNotFailTheNextCall'}
  timeout ${SAN_TIMEOUT:-240} compute-sanitizer --tool memcheck --error-exitcode 9 "$TESTS" --gtest_brief=1 --gtest_filter="$filter" > "$OUT/memcheck.log" 2>&1
  rc=$?
  note "memcheck: rc=$rc, $(grep -E 'ERROR SUMMARY' "$OUT/memcheck.log" | tail -1) ($(( $(date +%s) - t0 )) s)"
  t0=$(date +%s)
  timeout ${SAN_TIMEOUT:-240} compute-sanitizer --tool racecheck --error-exitcode 9 "$TESTS" --gtest_brief=1 \
    --gtest_filter="${RACECHECK_FILTER:-Shapes/CrossEntropyCuda.MatchesCpuBackend/N7_V32003*:Shapes/CrossEntropyCuda.MatchesCpuBackend/N7_V1000_*:Shapes/PolicyLossCuda.EveryAlgorithmMatchesCpuBackend/B3_L5_V1000_bf16_shifted_full_grpo_*}" > "$OUT/racecheck.log" 2>&1
  rc=$?
  note "racecheck: rc=$rc, $(grep -E 'RACECHECK SUMMARY|ERROR SUMMARY' "$OUT/racecheck.log" | tail -1) ($(( $(date +%s) - t0 )) s)"
}

step_cppbench() {
  timeout 120 "$BUILD/bench_cross_entropy" > "$OUT/cppbench.txt" 2>&1
  note "kernel bench: rc=$?"
  timeout 120 "$BUILD/bench_rms_norm" >> "$OUT/cppbench.txt" 2>&1
  note "rms_norm kernel bench: rc=$?"
  timeout 120 "$BUILD/bench_lce_gemm" >> "$OUT/cppbench.txt" 2>&1
  note "linear cross-entropy GEMM bench: rc=$?"
  cat "$OUT/cppbench.txt"
}

step_profile() {
  # Nsight Compute on one launch of the fused row-resident kernel and one of the streaming backward, for the
  # stall reasons behind the fused kernel's distance from the copy bandwidth. Clocks are left alone.
  command -v ncu >/dev/null || { note "profile: no ncu"; return 0; }
  t0=$(date +%s)
  # The kernel benchmark's first row-resident launch is the default plan's fused forward+backward.
  timeout ${PROFILE_TIMEOUT:-120} ncu --clock-control none --set full -k regex:row_resident_kernel -c 1 -o "$OUT/rr" -f \
    "$BUILD/bench_cross_entropy" 16384 128256 > "$OUT/ncu_rr.log" 2>&1
  ncu -i "$OUT/rr.ncu-rep" --page details > "$OUT/ncu_rr_details.txt" 2>&1
  note "profile: done ($(( $(date +%s) - t0 )) s)"
  grep -E "Duration|Memory Throughput|DRAM Throughput|Compute \(SM\) Throughput|Issue Slots Busy|Achieved Occupancy|Registers Per|Warp Cycles Per Issued|One or More Eligible" "$OUT/ncu_rr_details.txt" | head -20
}

export PYTHONPATH=$BUILD/python${PYTHONPATH:+:$PYTHONPATH}
step_py() {
  [ -d tests/python ] || return 0
  t0=$(date +%s)
  # PYTEST_ARGS is split on spaces: pass one-word expressions (-k cuda), or PYTEST_K for a -k with spaces.
  timeout ${PY_TIMEOUT:-420} python3 -m pytest -q -rf --tb=line ${PYTEST_ARGS:-tests/python} ${PYTEST_K:+-k "$PYTEST_K"} \
    > "$OUT/pytest.log" 2>&1
  note "pytest: rc=$?, $(tail -1 "$OUT/pytest.log") ($(( $(date +%s) - t0 )) s)"
  grep -E '^FAILED' "$OUT/pytest.log" | cut -c1-200 | head -25
}

step_bench() {
  [ -f bench/bench.py ] || return 0
  timeout ${BENCH_TIMEOUT:-420} python3 bench/bench.py --seed-dir "${SEED_DIR:-.seeds}" --out "$OUT/bench.md" ${BENCH_ARGS:-} > "$OUT/bench.log" 2>&1
  note "bench: rc=$?"
  tail -40 "$OUT/bench.log"
}

for s in "${steps[@]}"; do "step_$s"; done

echo
echo "==== summary ===="
printf '%s\n' "${summary[@]}" | tee "$OUT/summary.txt"
# At most 8 files come back from the device: everything but the headline files goes into one archive.
(cd "$OUT" && shopt -s nullglob && files=(*.log *details.txt gpu.txt) && [ ${#files[@]} -gt 0 ] \
  && tar czf logs.tar.gz "${files[@]}" && rm -f "${files[@]}")
