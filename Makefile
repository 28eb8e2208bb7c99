# Set-up and everyday commands. `make test` and `make bench` do all the set-up on a fresh machine.
PYTHON ?= python3
PIP ?= $(PYTHON) -m pip
TORCH_VERSION ?= 2.14.1
export CUDA_HOME ?= /usr/local/cuda
STAMP := build/.setup-done

.PHONY: setup build test bench bench-loss cmake clean gpu-check compat gpu-prebuilt torch-venv

# Dependencies, then the extension (C++ CPU kernels; CUDA ones too when a toolkit is present). Beside the build's and
# the tests': the framework recipes' (transformers, accelerate, lightning; tests/test_examples.py), the type checker
# (mypy) and `build` (tests/tooling/test_wheel.py builds the wheel and the sdist with it). The editable install keeps
# its objects in build/temp.*/ (setup.py), so running this again after a change here only links.
$(STAMP): setup.py pyproject.toml Makefile
	$(PIP) install -q "torch==$(TORCH_VERSION)" numpy scipy pytest hypothesis mpmath ninja expecttest scikit-learn \
	  matplotlib tqdm pytest-benchmark pytest-xdist transformers accelerate lightning mypy build
	$(PIP) install -q --no-build-isolation -e .
	mkdir -p build && touch $(STAMP)

setup: $(STAMP)

# Rebuild the extension in place after a C++ change.
build: $(STAMP)
	$(PYTHON) setup.py build_ext --inplace

# Two pytest workers (pytest-xdist), each taking whole files (a module's fixtures, such as the quick benchmark run or
# the wheel build, then run once): on a fresh 2-vCPU machine the suite took 485 s against 727 s in one process.
test: $(STAMP)
	$(PYTHON) -m pytest -q -n 2 --dist loadfile tests

# The paper's experiments at laptop scale, each run three times (as trained and two rounding probes), in one
# process per CPU core: figure, tables, report.md and results.json in demo_out/. Options pass through, e.g.
# `make demo DEMO_ARGS="--device cuda --seed 1" DEMO_JOBS=1`.
DEMO_JOBS ?= $(shell nproc 2>/dev/null || echo 1)
.PHONY: demo
demo: $(STAMP)
	$(PYTHON) -m dro_ext.demo --out demo_out --jobs $(DEMO_JOBS) $(DEMO_ARGS)

bench: $(STAMP)
	$(PYTHON) -m bench.run

bench-loss: $(STAMP)
	$(PYTHON) -m bench.bench_loss

# The LibTorch build of the same ops (CMakeLists.txt), loaded once through torch.ops.load_library. Release (-O3) unless
# CMAKE_BUILD_TYPE says otherwise: CI, which only checks that this build compiles, links and loads, passes None (no
# optimization flags), which compiles in half the time.
CMAKE_BUILD_TYPE ?= Release
cmake: $(STAMP)
	TORCH_CUDA_ARCH_LIST="$${TORCH_CUDA_ARCH_LIST:-9.0}" cmake -S . -B build/cmake -DCMAKE_BUILD_TYPE=$(CMAKE_BUILD_TYPE) -DCMAKE_PREFIX_PATH="$$($(PYTHON) -c 'import torch;print(torch.utils.cmake_prefix_path)')" \
	  -DCUDA_TOOLKIT_ROOT_DIR=$(CUDA_HOME) -DCMAKE_CUDA_COMPILER=$(CUDA_HOME)/bin/nvcc >/dev/null
	cmake --build build/cmake -j2
	$(PYTHON) -c "import torch; torch.ops.load_library('build/cmake/libdro_ext_ops.so'); \
	  v, w = torch.ops.dro_ext.dro_loss(torch.arange(5.), torch.tensor(1.), 0.5, 'chi2'); print('cmake build loads:', v.item(), w.item())"

# The GPU machines' torch (2.11.0+cu130, Python 3.12) differs from the pinned one in C++ standard and autograd API.
GPU_TORCH_VERSION ?= 2.11.0

# The virtual environment with that torch which gpu-prebuilt and compat build in, build/torch-$(GPU_TORCH_VERSION)
# (scripts/torch_venv.sh): they make it themselves when it is missing. It needs nothing of setup's, so .ci/run makes
# it while `make setup` runs (pip leaves a core idle).
torch-venv:
	PYTHON=$(PYTHON) bash scripts/torch_venv.sh $(GPU_TORCH_VERSION)

# The sources built, CPU and CUDA kernels, against the GPU machines' torch, registered and passing opcheck and the
# Python layer's torch.compile tests there (scripts/build_against_torch.sh; the in-place build is left alone), into
# build/gpu-prebuilt: before a GPU lease, on the CPU machine, for the lease to carry so that the device's minutes go
# to tests and benchmarks (gpu-check uses it while it matches the sources).
gpu-prebuilt: $(STAMP)
	PYTHON=$(PYTHON) bash scripts/build_against_torch.sh $(GPU_TORCH_VERSION) build/gpu-prebuilt

# CI's check of the same build and tests, for the CPU kernels only (the CUDA objects were most of its time; a GPU
# session's gpu-prebuilt compiles them against this torch before its lease) and the host C++ unoptimized (-O0: its
# kernels are only tested, never timed; on a 2-vCPU EPYC the build took 58 s, against 77 s at -O1; the same objects
# take about 330 CPU-s at -O3 in `make setup`), into build/compat, which no lease takes for a prebuilt library (it has
# no sources hash).
compat: $(STAMP)
	DRO_EXT_CUDA=0 DRO_EXT_CXX_OPT=-O0 PYTHON=$(PYTHON) \
	  bash scripts/build_against_torch.sh $(GPU_TORCH_VERSION) build/compat

# On a GPU machine: build for the visible card (or take the carried prebuilt library), CUDA tests, the suite,
# compute-sanitizer and the GPU benchmarks, every log into OUT (scripts/gpu_check.sh: PHASES in the order given;
# run again into the same OUT, it runs only what the first run skipped or was stopped in).
gpu-check:
	@test -n "$(OUT)" || (echo "usage: make gpu-check OUT=DIR [PHASES=build+test+suite+sanitize+bench+profile]" >&2; exit 2)
	PYTHON=$(PYTHON) bash scripts/gpu_check.sh "$(OUT)" $(PHASES)

clean:
	rm -rf build dro_ext/*.so *.egg-info
