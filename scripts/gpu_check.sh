#!/usr/bin/env bash
# Everything the GPU kernels need verified and measured on a card, in one command, every log and result file
# written into DIR:
#
#   scripts/gpu_check.sh DIR [PHASES]        (or: make gpu-check OUT=DIR [PHASES=...])
#
# PHASES is a '+'-separated list of build, test, suite, sanitize, bench, profile, probe, train, train_compile, demo,
# run in the order given (default: build+test+suite+sanitize+bench+profile). profile (python -m bench.profile_kernels,
# ~30 s) splits each op's time into host work, kernel launches and kernel time (CUDA-graph replay), into
# DIR/bench/profile_<card>.json; probe (python -m bench.probe_matmul_alignment) times the fused linear
# cross-entropy's matmuls at an unaligned vocabulary, as laid out today and with a padded row stride. train
# (python -m bench.bench_train) times the whole training step of ERM, dro_ext and fast-dro (FAST_DRO_PATH) in
# TRAIN_MODES (default: eager graph), train_compile the same under torch.compile (its cases in the order
# TRAIN_COMPILE_CASES gives, the quick compiles first by default); demo runs the paper's experiments on the card
# (DIR/demo).
# Every phase first makes sure the extension in this checkout runs on this card; if not (a fresh machine), it
# takes the prebuilt library when that was built from exactly these sources, else builds (~2 minutes). `build`
# rebuilds in place for the visible card whatever is there. Each step runs under `timeout`; a failed step is
# recorded and the script goes on. DIR/summary.txt lists every step with its exit status, time and log; the
# script exits non-zero if any step failed or was skipped. After the benchmarks,
# DIR/targets.md (python -m bench.targets) says which speed and memory targets they met.
#
# Run again with the same DIR (the machine still warm), it runs only the steps that DIR/summary.txt does not show
# as run to an end (ok, FAILED or TIMEOUT at the step's own limit): those skipped for lack of TOTAL_S, those CUT
# (stopped by what was left of TOTAL_S, short of their own limit) and the one a killed run was in. So the second
# call of a lease is the first call's command again, with the time that is left.
#
# Step time limits (seconds) can be changed through the environment: BUILD_S, TEST_S, SUITE_S, MEMCHECK_S,
# RACECHECK_S, BENCH_S (per benchmark), PROFILE_S, PROBE_S, TRAIN_S, DEMO_S (DEMO_PROBES: the demo's rounding
# probes, default 0); CUDA_TEST_WORKERS (default 8) sets the
# test processes and CUDA_TEST_FILES (space-separated) the test files (default: every tests/test_cuda_*.py); BENCHES
# picks the benchmarks and their order (default: loss optim robust cross_entropy groups); BENCH_ARGS adds arguments to
# each benchmark run (e.g. --quick). TOTAL_S (seconds) caps the whole run: each step gets at most what is left, and a
# step that would get under 20 s is skipped (and left for a rerun). PACK_TO=FILE.tar.gz packs DIR into one archive
# after every step, for a runner that returns only a few files and may kill the run at its limit.
#
# A lease of 15 minutes of device time, the machine's start (one to two minutes) included, 10 minutes per command:
# build the library beforehand on the CPU machine (`make gpu-prebuilt`), carry build/gpu-prebuilt (and a fast-dro
# checkout for FAST_DRO_PATH), leave the CPU suite out (CI runs it), order the phases by value, and make two calls
# back to back while the machine is warm (it stays so 30 s):
#   timeout_s=600:  TOTAL_S=585 TRAIN_S=200 TEST_S=150 BENCH_S=150 PACK_TO=$OUT/check.tar.gz FAST_DRO_PATH=... \
#                     bash scripts/gpu_check.sh /tmp/gc train+test+bench+profile+train_compile+sanitize+demo
#   timeout_s=L:    the same command with TOTAL_S=L-15, L = the lease's budget_left_s less ~20 s: it runs what the
#                   first call skipped or was stopped in.
# The limits are caps, not estimates: a step ends when its work does. On a fresh machine torch.compile of the
# benchmarks' compiled peers is the largest unknown.
set -uo pipefail

if [[ $# -lt 1 ]]; then
  echo "usage: $0 DIR [build+test+suite+sanitize+bench]" >&2
  exit 2
fi
OUT_DIR="$(mkdir -p "$1" && cd "$1" && pwd)"
PHASES="${2:-build+test+suite+sanitize+bench+profile}"
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
PROFILE_S="${PROFILE_S:-120}"
PROBE_S="${PROBE_S:-90}"
TRAIN_S="${TRAIN_S:-300}"
DEMO_S="${DEMO_S:-300}"
BENCHES="${BENCHES:-loss optim robust cross_entropy groups}"
BENCH_ARGS="${BENCH_ARGS:-}"

has_phase() { [[ "+$PHASES+" == *"+$1+"* ]]; }

# TOTAL_S caps the whole run (a lease's command limit): each step's limit shrinks to what is left of it, less a
# margin for packing, and a step that would get under 20 s is skipped and recorded as such.
STARTED=$(date +%s)
TOTAL_S="${TOTAL_S:-}"

# pack: DIR into PACK_TO, after every step, so that a run killed from outside still returns what it finished.
pack() {
  if [[ -n "${PACK_TO:-}" ]]; then tar czf "$PACK_TO" -C "$(dirname "$OUT_DIR")" "$(basename "$OUT_DIR")"; fi
}

# step NAME LIMIT_S COMMAND...: runs the command under timeout with its output in DIR/NAME.log.
step() {
  local name="$1" limit="$2"
  shift 2
  local log="$OUT_DIR/$name.log" start end rc cut_short=0
  # A rerun into the same DIR runs only what an earlier run skipped or did not reach (killed mid-step): a step
  # that ran to an end, even a failed or timed-out one, would spend the lease on the same answer again.
  local earlier
  earlier="$(grep -Es "^$name +(ok|FAILED|TIMEOUT) " "$SUMMARY" | tail -n 1 | awk '{print $2}')"
  if [[ -n "$earlier" ]]; then
    echo "== $name: $earlier in an earlier run into $OUT_DIR, not run again" | tee -a "$OUT_DIR/gpu_check.log"
    [[ "$earlier" != ok ]] && FAILED=1
    return 0
  fi
  start=$(date +%s)
  if [[ -n "$TOTAL_S" ]]; then
    local left=$((TOTAL_S - (start - STARTED) - 15))
    if ((left < 20)); then
      printf '%-22s %-8s (%ss of TOTAL_S=%s left)\n' "$name" "SKIPPED" "$left" "$TOTAL_S" | tee -a "$SUMMARY"
      FAILED=1
      return 1
    fi
    ((left < limit)) && limit=$left && cut_short=1
  fi
  echo "== $name (limit ${limit}s): $*" | tee -a "$OUT_DIR/gpu_check.log"
  timeout --kill-after=10 "$limit" "$@" >"$log" 2>&1
  rc=$?
  end=$(date +%s)
  local status="ok"
  # A step stopped by TOTAL_S's remainder, short of its own limit, is CUT: unlike a TIMEOUT, a rerun with more time
  # may finish it, so a rerun into the same DIR runs it again.
  if [[ $rc -eq 124 || $rc -eq 137 ]]; then
    if ((cut_short)); then status="CUT"; else status="TIMEOUT"; fi
  elif [[ $rc -ne 0 ]]; then
    status="FAILED"
  fi
  [[ $rc -ne 0 ]] && FAILED=1
  printf '%-22s %-8s rc=%-4s %5ss  %s\n' "$name" "$status" "$rc" "$((end - start))" "$log" >>"$SUMMARY"
  tail -n 3 "$log" | sed 's/^/   /' | tee -a "$OUT_DIR/gpu_check.log"
  pack
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

# A library built elsewhere against this machine's torch (make gpu-prebuilt, carried in PREBUILT_DIR), put in
# place only if it was built from exactly the sources of this tree: it saves a short lease the build's minutes.
PREBUILT_DIR="${PREBUILT_DIR:-build/gpu-prebuilt}"
place_prebuilt() {
  [[ -f "$PREBUILT_DIR/_C.abi3.so" && -f "$PREBUILT_DIR/sources.sha256" ]] || return 1
  if [[ "$(cat "$PREBUILT_DIR/sources.sha256")" != "$(bash scripts/sources_hash.sh)" ]]; then
    echo "prebuilt library in $PREBUILT_DIR is stale (built from other sources): not used" | tee -a "$SUMMARY"
    return 1
  fi
  cp "$PREBUILT_DIR/_C.abi3.so" dro_ext/_C.abi3.so
}

# Each probe starts python and a CUDA context: a few seconds of the lease, so every path probes as few times
# as it can and `ready` remembers a probe that passed.
ready=0
if has_phase build; then
  step build "$BUILD_S" "${BUILD_CMD[@]}"
elif has_phase test || has_phase suite || has_phase sanitize || has_phase bench || has_phase profile || \
  has_phase probe || has_phase train || has_phase train_compile || has_phase demo; then
  if runs_here; then
    ready=1
  elif place_prebuilt; then
    if runs_here; then
      ready=1
      echo "using the prebuilt library from $PREBUILT_DIR (torch $(cat "$PREBUILT_DIR/torch_version.txt" 2>/dev/null))" \
        | tee -a "$SUMMARY"
    else
      echo "prebuilt library in $PREBUILT_DIR does not run here: building" | tee -a "$SUMMARY"
      rm -f dro_ext/_C.abi3.so
    fi
  fi
  if [[ $ready == 0 ]]; then step build "$BUILD_S" "${BUILD_CMD[@]}"; fi
fi
if [[ $ready == 0 ]] && ! runs_here; then
  echo "the extension does not run on this card after the build: see $OUT_DIR/build.log" | tee -a "$SUMMARY"
  FAILED=1
fi

# CUDA_TEST_FILES (space-separated) picks the CUDA test files, e.g. those of what changed since the last GPU run.
if [[ -n "${CUDA_TEST_FILES:-}" ]]; then
  read -r -a CUDA_TESTS <<<"$CUDA_TEST_FILES"
else
  CUDA_TESTS=(tests/test_cuda_*.py)
fi
# A hung kernel fails its test after a minute (with every thread's stack in the log) instead of the whole step.
per_test=()
if "$PYTHON" -c "import pytest_timeout" 2>/dev/null; then per_test=(--timeout=90 --timeout-method=thread); fi
# The CUDA tests spread over CUDA_TEST_WORKERS processes sharing the card where pytest-xdist is installed (it is
# on the GPU machines' image): the kernels take little of the card, and torch.compile's and the float64 CPU
# references' host work is what takes the time. Each worker has its own context, so the sync-debug, graph and
# determinism checks are unaffected; CUDA_TEST_WORKERS=0 runs them in one process.
cuda_parallel=()
if [[ "${CUDA_TEST_WORKERS:-8}" != 0 ]] && "$PYTHON" -c "import xdist" 2>/dev/null; then
  cuda_parallel=(-n "${CUDA_TEST_WORKERS:-8}")
fi

phase_test() {
  step cuda_tests "$TEST_S" env PYTHONUNBUFFERED=1 "$PYTHON" -m pytest -q -rs --durations=15 "${cuda_parallel[@]}" \
    "${per_test[@]}" --junitxml="$OUT_DIR/cuda_tests.xml" "${CUDA_TESTS[@]}"
}

phase_suite() {
  local ignores=() parallel=() f
  for f in "${CUDA_TESTS[@]}"; do ignores+=("--ignore=$f"); done
  # The CPU tests spread over the cores where pytest-xdist is installed.
  if "$PYTHON" -c "import xdist" 2>/dev/null; then parallel=(-n 4); fi
  step suite "$SUITE_S" env PYTHONUNBUFFERED=1 "$PYTHON" -m pytest -q -rs "${parallel[@]}" "${per_test[@]}" \
    --junitxml="$OUT_DIR/suite.xml" tests "${ignores[@]}"
}

phase_sanitize() {
  if ! command -v compute-sanitizer >/dev/null 2>&1; then
    echo "compute-sanitizer not found (looked in PATH and $CUDA_HOME/bin)" | tee -a "$SUMMARY"
    FAILED=1
    return
  fi
  # The caching allocator would hide out-of-bounds accesses inside its larger blocks from memcheck.
  step memcheck "$MEMCHECK_S" env PYTORCH_NO_CUDA_MEMORY_CACHING=1 compute-sanitizer --tool memcheck --error-exitcode 1 \
    --print-limit 50 "$PYTHON" scripts/cuda_smoke.py
  step racecheck "$RACECHECK_S" compute-sanitizer --tool racecheck --error-exitcode 1 --print-limit 50 \
    "$PYTHON" scripts/cuda_smoke.py
}

phase_bench() {
  local bench
  mkdir -p "$OUT_DIR/bench"
  # One step per benchmark, each under its own limit and writing its own result files, in the order the targets
  # need them: a slow one (torch.compile of the peers dominates on a fresh machine) cannot cost the others
  # their results.
  for bench in $BENCHES; do
    # shellcheck disable=SC2086  # BENCH_ARGS is a list of words
    step "bench_$bench" "$BENCH_S" "$PYTHON" -m bench.run --only "$bench" --device cuda --out "$OUT_DIR/bench" $BENCH_ARGS
  done
  # Every target against what the benchmarks wrote so far (this run's and an earlier one's into DIR), in
  # DIR/targets.md and on the console: a second, not a step, and so run again after every rerun.
  timeout 60 "$PYTHON" -m bench.targets "$OUT_DIR/bench" >"$OUT_DIR/targets.md" 2>&1
  cat "$OUT_DIR/targets.md"
  pack
}

# The whole training step of ERM, dro_ext and fast-dro (FAST_DRO_PATH: a checkout carried to the machine), mode by
# mode (TRAIN_MODES, default eager graph): a run stopped at its limit keeps the modes and cases it finished. The
# compiled steps are a phase of their own, train_compile (DIR/bench/train_compile_<card>.*): compiling every
# implementation of every case takes minutes of a lease that the eager and captured steps need first.
phase_train() {
  mkdir -p "$OUT_DIR/bench"
  # shellcheck disable=SC2086  # TRAIN_MODES is a list of words
  step train "$TRAIN_S" env PYTHONUNBUFFERED=1 "$PYTHON" -m bench.bench_train --device cuda --out "$OUT_DIR/bench" \
    --modes ${TRAIN_MODES:-eager graph}
}

# TRAIN_COMPILE_CASES orders its cases, by default the quick compiles first: Inductor compiles resnet18's forward and
# backward once per implementation (six, over 120 s in all on the first H200 run), the MLP's and the head's in seconds,
# and a run stopped at its limit keeps the cases it finished.
phase_train_compile() {
  mkdir -p "$OUT_DIR/bench"
  # shellcheck disable=SC2086  # TRAIN_COMPILE_CASES is a list of words
  step train_compile "$TRAIN_S" env PYTHONUNBUFFERED=1 "$PYTHON" -m bench.bench_train --device cuda \
    --out "$OUT_DIR/bench" --modes compile --name train_compile \
    --cases ${TRAIN_COMPILE_CASES:-mlp-large-batch lm-head resnet18}
}

# The paper's experiments on the card, for their time and for their verdicts beside the CPU run's. DEMO_PROBES
# (default 0) rounding probes: each runs the whole demo again, which a lease rarely has time for; without them
# the card's verdicts are those of its runs as trained, to be read beside the CPU run's first verdicts.
phase_demo() {
  step demo "$DEMO_S" env PYTHONUNBUFFERED=1 "$PYTHON" -m dro_ext.demo --device cuda --out "$OUT_DIR/demo" \
    --rounding-probes "${DEMO_PROBES:-0}"
}

phase_profile() {
  mkdir -p "$OUT_DIR/bench"
  step profile "$PROFILE_S" env PYTHONUNBUFFERED=1 "$PYTHON" -m bench.profile_kernels --out "$OUT_DIR/bench"
}

# Whether a vocabulary that is not a multiple of 8 slows the fused linear cross-entropy's matmuls, and whether a
# padded row stride of its logits would recover the time (bench/probe_matmul_alignment.py, under a minute).
phase_probe() {
  mkdir -p "$OUT_DIR/bench"
  step probe "$PROBE_S" env PYTHONUNBUFFERED=1 "$PYTHON" -m bench.probe_matmul_alignment --device cuda \
    --out "$OUT_DIR/bench"
}

# The phases in the order PHASES names them (build ran above, before anything that needs the library).
IFS='+' read -r -a phase_list <<<"$PHASES"
for phase in "${phase_list[@]}"; do
  case "$phase" in
    build) ;;
    test | suite | sanitize | bench | profile | probe | train | train_compile | demo) "phase_$phase" ;;
    *) echo "unknown phase '$phase' (build, test, suite, sanitize, bench, profile, probe, train, train_compile, demo)" \
         | tee -a "$SUMMARY"
       FAILED=1 ;;
  esac
done

echo "# done $(date -u +%Y-%m-%dT%H:%M:%SZ), $([[ $FAILED -eq 0 ]] && echo 'all steps passed' || echo 'SOME STEPS FAILED')" >>"$SUMMARY"
cat "$SUMMARY"
if [[ -n "${PACK_TO:-}" ]]; then
  pack && echo "packed $OUT_DIR into $PACK_TO"
fi
exit $FAILED
