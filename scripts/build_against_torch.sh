#!/usr/bin/env bash
# Builds the extension, CPU and CUDA kernels (the CPU ones only with DRO_EXT_CUDA=0), against a torch release other
# than the installed one, in a virtual environment of its own, into DIR/_C.abi3.so (stripped of debug info), and
# checks it there:
#
#   scripts/build_against_torch.sh VERSION DIR [PYTEST_ARGS...]
#
# The in-place build (dro_ext/_C.abi3.so) is left alone. Two make targets run it for the GPU machines' torch
# (2.11.0+cu130): `make gpu-prebuilt` into build/gpu-prebuilt, a release build that a short GPU lease carries instead
# of building there (scripts/gpu_check.sh uses it when DIR/sources.sha256 matches the tree); and `make compat`, CI's
# check that the sources build against it, not only against the pinned 2.14.1 (the two differ in C++ standard and
# autograd API), and that the Python layer's torch.compile tests pass under its Dynamo: into build/compat, the CPU
# kernels only (DRO_EXT_CUDA=0: the CUDA objects were most of its time, and each GPU session's own gpu-prebuilt
# compiles them against this torch before its lease), with the host C++ unoptimized (DRO_EXT_CXX_OPT=-O0, setup.py;
# the CPU kernels in a quarter of the time), and no sources hash.
# The library is abi3 (py_limited_api), so a build made with this Python loads in the GPU machines' 3.12.
# The virtual environment is scripts/torch_venv.sh's. Importing its torch needs its CUDA libraries: they are taken
# from the installed torch's nvidia packages (same CUDA major version) instead of downloading several GB of them again.
set -euo pipefail

if [[ $# -lt 2 ]]; then
  echo "usage: $0 TORCH_VERSION DIR [PYTEST_ARGS...]" >&2
  exit 2
fi
VERSION="$1"
OUT_DIR="$(mkdir -p "$2" && cd "$2" && pwd)"
shift 2
cd "$(dirname "$0")/.."
REPO="$(pwd)"
PYTHON="${PYTHON:-python3}"
export CUDA_HOME="${CUDA_HOME:-/usr/local/cuda}"
WITH_CUDA="${DRO_EXT_CUDA:-1}"
[[ "$WITH_CUDA" == 0 || "$WITH_CUDA" == 1 ]] || { echo "DRO_EXT_CUDA must be 0 or 1, got $WITH_CUDA" >&2; exit 2; }
# Objects and the check's copy of the package live beside DIR, so that DIR holds only what a lease carries.
WORK="$REPO/build/work-$(basename "$OUT_DIR")"

nvidia_libs="$("$PYTHON" - <<'EOF'
import glob, os, site
dirs = [d for s in site.getsitepackages() for d in glob.glob(os.path.join(s, "nvidia", "**", "lib"), recursive=True)]
print(":".join(sorted(set(dirs))))
EOF
)"
export LD_LIBRARY_PATH="$nvidia_libs${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"

VENV="$(PYTHON="$PYTHON" bash scripts/torch_venv.sh "$VERSION")"
TORCH_BUILT="$("$VENV/bin/python" -c 'import torch; print(torch.__version__)')"
echo "building against $TORCH_BUILT"

SOURCES_HASH="$(bash scripts/sources_hash.sh)"  # before the build: an edit during it must not pass for built
rm -rf "$WORK/lib" "$WORK/pkg"
rm -f "$OUT_DIR/_C.abi3.so" "$OUT_DIR/sources.sha256" "$OUT_DIR/torch_version.txt" "$OUT_DIR/tests.log"
mkdir -p "$WORK"
# The compiler's output (thousands of warning lines from that torch's headers) goes to a log, shown on failure.
if ! env DRO_EXT_CUDA="$WITH_CUDA" TORCH_CUDA_ARCH_LIST="${TORCH_CUDA_ARCH_LIST:-9.0}" \
  MAX_JOBS="${MAX_JOBS:-$(nproc)}" "$VENV/bin/python" setup.py -q build_ext --build-lib "$WORK/lib" \
  --build-temp "$WORK/tmp" >"$WORK/build.log" 2>&1; then
  { grep -E "error|Error" "$WORK/build.log" || true; } | head -n 40 >&2
  tail -n 20 "$WORK/build.log" >&2
  echo "the build against torch $VERSION failed: full log in $WORK/build.log" >&2
  exit 1
fi
strip --strip-debug -o "$OUT_DIR/_C.abi3.so" "$WORK/lib/dro_ext/_C.abi3.so"
if [[ "$(bash scripts/sources_hash.sh)" != "$SOURCES_HASH" ]]; then
  echo "the sources changed during the build: run it again" >&2
  exit 1
fi
# A library compiled with DRO_EXT_CXX_OPT (a check's faster, less optimized build: `make compat`) gets no sources hash,
# so that gpu_check.sh, which takes a prebuilt library only where the hash matches the tree, never times it.
[[ -n "${DRO_EXT_CXX_OPT:-}" ]] || echo "$SOURCES_HASH" >"$OUT_DIR/sources.sha256"
echo "$TORCH_BUILT" >"$OUT_DIR/torch_version.txt"

# The check: a copy of the package and its tests with this build in it, run from that copy (the checkout's
# conftest.py would put the checkout, and its own build, first on the path). A skip would hide a build that
# does not load, so any skip fails the check.
mkdir -p "$WORK/pkg"
git ls-files -z dro_ext tests conftest.py pyproject.toml | xargs -0 cp --parents -t "$WORK/pkg"
cp "$OUT_DIR/_C.abi3.so" "$WORK/pkg/dro_ext/"
cd "$WORK/pkg"
"$VENV/bin/python" - <<EOF
import dro_ext, torch
assert dro_ext.__file__.startswith("$WORK/pkg/"), dro_ext.__file__
assert dro_ext.backend() == "native", dro_ext._backend.load_error()
print("dro_ext", dro_ext.backend(), "on torch", torch.__version__)
EOF
# The registration and opcheck tests, and the torch.compile(fullgraph=True) tests of the Python layer (modules,
# optimizer, group and cross-entropy wrappers): what Dynamo can trace changes between releases (2.11 cannot trace
# bool() of a list, which 2.14 can), and the GPU machines run this torch. In two processes, a file each at a time.
# A build of the CPU kernels only has no CUDA kernels to register: it runs the compile tests alone. Each process at
# the machine's thread count (tests/conftest.py would give each one its share of the cores): at one thread, on a
# processor without AVX-512, torch 2.11's Inductor writes a kernel for the fallback group_sums' id check that gcc
# 12.2 stops on with an internal compiler error; at two it writes another.
if [[ "$WITH_CUDA" == 1 ]]; then
  selected=(-k "cuda_registration or compile" tests/test_cuda_registration.py)
else
  selected=(-k "compile")
fi
OMP_NUM_THREADS="${OMP_NUM_THREADS:-$(nproc)}" DRO_EXT_CUDA="$WITH_CUDA" \
  "$VENV/bin/python" -m pytest -q -rs -p no:cacheprovider -n 2 --dist loadfile \
  "${selected[@]}" tests/test_compile_and_opcheck.py tests/test_optim.py tests/test_robust.py tests/test_groups.py \
  tests/test_group_sums.py tests/test_group_dro_step.py tests/test_group_evaluation.py tests/test_cross_entropy.py \
  tests/test_cross_entropy_groups.py tests/test_distributed.py "$@" 2>&1 | tee "$OUT_DIR/tests.log"
if grep -q " skipped" "$OUT_DIR/tests.log"; then
  echo "the build against torch $VERSION skipped tests (see above): it must load and register everywhere" >&2
  exit 1
fi
