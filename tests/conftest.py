"""Shared fixtures: every numerical test runs on both the native ops and the PyTorch fallback."""
import os
import sys
import zlib


def _share_the_cores_among_workers() -> None:
    """Under pytest-xdist, each worker's torch (and every process it starts) gets its share of the cores for its
    intra-op threads, unless OMP_NUM_THREADS says otherwise: on two cores, two workers of two threads each took 301 s
    over the four heaviest test files, two of one thread each 241 s (each worker's threads waited on the other's).
    The tests of thread counts set their own."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "0"))
    if workers < 2 or "OMP_NUM_THREADS" in os.environ:
        return
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    os.environ["OMP_NUM_THREADS"] = str(max(1, cores // workers))
    if "torch" in sys.modules:  # (a plugin imported it first: its thread pool may have read the variable already)
        sys.modules["torch"].set_num_threads(int(os.environ["OMP_NUM_THREADS"]))


_share_the_cores_among_workers()

import pytest  # noqa: E402  (after the thread share: torch's thread pool reads OMP_NUM_THREADS once)
import torch  # noqa: E402

from cpu_builds import runnable_builds
from dro_ext import _backend


def _cpu_builds():
    """The SIMD builds of the CPU kernels (default, avx2, avx512) this processor runs, the one dro_ext picked
    first: each gets its own native run of every test that takes the `backend` fixture, pinned for every call
    whatever its size (on Intel processors dro_ext otherwise runs small calls on AVX2 where it picked AVX-512,
    csrc/cpu/kernels.h), so that every build (what another machine runs) is tested here at every size."""
    if not _backend.native_available():
        return [None]
    picked = torch.ops.dro_ext._cpu_capability()
    return [picked] + [build for build in runnable_builds() if build != picked]


_BUILDS = _cpu_builds()
_BACKEND_PARAMS = (
    [pytest.param(("native", _BUILDS[0]), id="native")]
    + [pytest.param(("native", build), id=f"native-{build}") for build in _BUILDS[1:]]
    + [pytest.param(("python", None), id="python")]
)


@pytest.fixture(params=_BACKEND_PARAMS)
def backend(request):
    """Runs the test once on the compiled ops (once per SIMD build of the CPU kernels the processor runs, each
    pinned) and once on the fallback; the test sees "native" or "python".

    The native run fails (it is not skipped) when the extension did not load, unless
    DRO_EXT_FORCE_PYTHON=1 says the whole run is meant for the fallback.
    """
    name, build = request.param
    if name == "native" and _backend._force_python:
        pytest.skip("DRO_EXT_FORCE_PYTHON=1: this run covers the fallback only")
    previous = torch.ops.dro_ext._cpu_capability(build) if build is not None else None
    try:
        with _backend.forced_backend(name):
            yield name
    finally:
        if previous is not None:
            torch.ops.dro_ext._cpu_capability(previous)


@pytest.fixture(autouse=True)
def _seed(request):
    # Fresh random inputs per test, but reproducible from the test id when a failure must be replayed.
    # crc32, not hash(): str hashes are salted per process, which made the seeds differ from run to run.
    seed = int(os.environ.get("DRO_EXT_TEST_SEED", "0")) + (zlib.crc32(request.node.nodeid.encode()) & 0xFFFF)
    torch.manual_seed(seed)
    yield
