#!/usr/bin/env bash
# Everything issue 8 needs verified on a GPU, in one command, every log and result file written into DIR:
#
#   scripts/gpu_check.sh DIR [PHASES]        (or: make gpu-check OUT=DIR [PHASES=...])
#
# PHASES is a '+'-separated subset of build, test, suite, sanitize, bench (default: all of them). A machine
# with little time on it (~13 minutes of device time in all, 10 per command) runs the check in two halves,
# back to back while the machine is still warm (a fresh machine rebuilds first, ~2 minutes), the CPU suite
# left out (CI runs it):
#   scripts/gpu_check.sh DIR build+test+sanitize     # build for the visible card, the CUDA tests, compute-sanitizer
#   scripts/gpu_check.sh DIR bench                   # the benchmarks, each its own step (BENCHES, in that order)
# Every phase after `build` first makes sure the extension in this checkout runs on this card (and builds it
# if not, e.g. on a fresh machine). Each step runs under `timeout`; a failed step is recorded and the script
# goes on. DIR/summary.txt lists every step with its exit status, time and log; the script exits non-zero
# if any step failed. Step time limits (seconds) can be changed through the environment: BUILD_S, TEST_S,
# SUITE_S, MEMCHECK_S, RACECHECK_S, BENCH_S (per benchmark); BENCHES picks the benchmarks and their order
# (default: loss optim robust cross_entropy); BENCH_ARGS adds arguments to each benchmark run (e.g. --quick).
# PACK_TO=FILE.tar.gz packs DIR into one archive at the end, for a runner that returns only a few files:
#   PACK_TO=$OUT/gpu_check_1.tar.gz scripts/gpu_check.sh /tmp/gpu_check build+test; cp /tmp/gpu_check/summary.txt $OUT/
set -uo pipefail

if [[ $# -lt 1 ]]; then
  echo "usage: $0 DIR [build+test+suite+sanitize+bench]" >&2
  exit 2
fi
OUT_DIR="$(mkdir -p "$1" && cd "$1" && pwd)"
PHASES="${2:-build+test+suite+sanitize+bench}"
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3}"
export CUDA_HOME="${CUDA_HOME:-/usr/local/cuda}"
export PATH="$CUDA_HOME/bin:$PATH"
SUMMARY="$OUT_DIR/summary.txt"
FAILED=0

BUILD_S="${BUILD_S:-240}"
TEST_S="${TEST_S:-180}"
SUITE_S="${SUITE_S:-90}"
MEMCHECK_S="${MEMCHECK_S:-90}"
RACECHECK_S="${RACECHECK_S:-90}"
BENCH_S="${BENCH_S:-135}"
BENCHES="${BENCHES:-loss optim robust cross_entropy}"
BENCH_ARGS="${BENCH_ARGS:-}"

has_phase() { [[ "+$PHASES+" == *"+$1+"* ]]; }

# step NAME LIMIT_S COMMAND...: runs the command under timeout with its output in DIR/NAME.log.
step() {
  local name="$1" limit="$2"
  shift 2
  local log="$OUT_DIR/$name.log" start end rc
  start=$(date +%s)
  echo "== $name (limit ${limit}s): $*" | tee -a "$OUT_DIR/gpu_check.log"
  timeout --kill-after=10 "$limit" "$@" >"$log" 2>&1
  rc=$?
  end=$(date +%s)
  local status="ok"
  if [[ $rc -eq 124 || $rc -eq 137 ]]; then status="TIMEOUT"; elif [[ $rc -ne 0 ]]; then status="FAILED"; fi
  [[ $rc -ne 0 ]] && FAILED=1
  printf '%-22s %-8s rc=%-4s %5ss  %s\n' "$name" "$status" "$rc" "$((end - start))" "$log" >>"$SUMMARY"
  tail -n 3 "$log" | sed 's/^/   /' | tee -a "$OUT_DIR/gpu_check.log"
  return $rc
}

{
  echo "# dro_ext gpu_check $(date -u +%Y-%m-%dT%H:%M:%SZ), phases: $PHASES"
  echo "# commit: $(git rev-parse --short HEAD 2>/dev/null || echo unknown)$(git diff --quiet 2>/dev/null || echo ' (+ local changes)')"
} >>"$SUMMARY"

# The card, driver and software versions, for every result file to refer to.
{
  nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm,clocks.max.mem --format=csv 2>&1
  "$PYTHON" - <<'EOF' 2>&1
import torch
print("torch", torch.__version__, "cuda", torch.version.cuda, "cudnn", torch.backends.cudnn.version())
if torch.cuda.is_available():
    p = torch.cuda.get_device_properties(0)
    print("device", p.name, "capability", f"{p.major}.{p.minor}", "SMs", p.multi_processor_count,
          "memory GiB", round(p.total_memory / 2**30, 1))
EOF
  nvcc --version 2>&1 | tail -n 2
  compute-sanitizer --version 2>&1 | head -n 2
} >"$OUT_DIR/environment.txt"
cat "$OUT_DIR/environment.txt"

ARCH="$("$PYTHON" -c 'import torch; print("%d.%d" % torch.cuda.get_device_capability())' 2>/dev/null)"
if [[ -z "$ARCH" ]]; then
  echo "no CUDA device visible to torch: nothing to check" | tee -a "$SUMMARY"
  exit 1
fi

# In place for exactly this card; every .cu of csrc/cuda is compiled (DRO_EXT_CUDA=1 fails loudly otherwise).
BUILD_CMD=(env DRO_EXT_CUDA=1 TORCH_CUDA_ARCH_LIST="$ARCH" MAX_JOBS="${MAX_JOBS:-$(nproc)}" "$PYTHON" setup.py build_ext --inplace)

# True when the extension in this checkout loads and its CUDA kernels run on this card.
runs_here() {
  "$PYTHON" - <<'EOF' >/dev/null 2>&1
import torch, dro_ext
assert dro_ext.backend() == "native"
x = torch.arange(5.0, device="cuda")
v, w = torch.ops.dro_ext.dro_loss(x, torch.zeros((), device="cuda"), 1.0, "chi2")
torch.cuda.synchronize()
assert abs(v.item() - torch.ops.dro_ext.dro_loss(x.cpu(), torch.zeros(()), 1.0, "chi2")[0].item()) < 1e-4
EOF
}

if has_phase build; then
  step build "$BUILD_S" "${BUILD_CMD[@]}"
elif has_phase test || has_phase suite || has_phase sanitize || has_phase bench; then
  if ! runs_here; then step build "$BUILD_S" "${BUILD_CMD[@]}"; fi
fi
if ! runs_here; then
  echo "the extension does not run on this card after the build: see $OUT_DIR/build.log" | tee -a "$SUMMARY"
  FAILED=1
fi

CUDA_TESTS=(tests/test_cuda_*.py)
# A hung kernel fails its test after a minute (with every thread's stack in the log) instead of the whole step.
per_test=()
if "$PYTHON" -c "import pytest_timeout" 2>/dev/null; then per_test=(--timeout=90 --timeout-method=thread); fi
if has_phase test; then
  step cuda_tests "$TEST_S" env PYTHONUNBUFFERED=1 "$PYTHON" -m pytest -q -rs --durations=15 "${per_test[@]}" \
    --junitxml="$OUT_DIR/cuda_tests.xml" "${CUDA_TESTS[@]}"
fi
if has_phase suite; then
  ignores=()
  for f in "${CUDA_TESTS[@]}"; do ignores+=("--ignore=$f"); done
  # The CPU tests spread over the cores where pytest-xdist is installed.
  parallel=()
  if "$PYTHON" -c "import xdist" 2>/dev/null; then parallel=(-n 4); fi
  step suite "$SUITE_S" env PYTHONUNBUFFERED=1 "$PYTHON" -m pytest -q -rs "${parallel[@]}" "${per_test[@]}" \
    --junitxml="$OUT_DIR/suite.xml" tests "${ignores[@]}"
fi
if has_phase sanitize; then
  if command -v compute-sanitizer >/dev/null 2>&1; then
    # The caching allocator would hide out-of-bounds accesses inside its larger blocks from memcheck.
    step memcheck "$MEMCHECK_S" env PYTORCH_NO_CUDA_MEMORY_CACHING=1 compute-sanitizer --tool memcheck --error-exitcode 1 \
      --print-limit 50 "$PYTHON" scripts/cuda_smoke.py
    step racecheck "$RACECHECK_S" compute-sanitizer --tool racecheck --error-exitcode 1 --print-limit 50 \
      "$PYTHON" scripts/cuda_smoke.py
  else
    echo "compute-sanitizer not found (looked in PATH and $CUDA_HOME/bin)" | tee -a "$SUMMARY"
    FAILED=1
  fi
fi
if has_phase bench; then
  mkdir -p "$OUT_DIR/bench"
  # One step per benchmark, each under its own limit and writing its own result files, in the order the issues
  # need them: a slow one (torch.compile of the peers dominates on a fresh machine) cannot cost the others
  # their results.
  for bench in $BENCHES; do
    # shellcheck disable=SC2086  # BENCH_ARGS is a list of words
    step "bench_$bench" "$BENCH_S" "$PYTHON" -m bench.run --only "$bench" --device cuda --out "$OUT_DIR/bench" $BENCH_ARGS
  done
fi

echo "# done $(date -u +%Y-%m-%dT%H:%M:%SZ), $([[ $FAILED -eq 0 ]] && echo 'all steps passed' || echo 'SOME STEPS FAILED')" >>"$SUMMARY"
cat "$SUMMARY"
if [[ -n "${PACK_TO:-}" ]]; then
  tar czf "$PACK_TO" -C "$(dirname "$OUT_DIR")" "$(basename "$OUT_DIR")" && echo "packed $OUT_DIR into $PACK_TO"
fi
exit $FAILED
