"""Shared fixtures: every numerical test runs on both the native ops and the PyTorch fallback."""
import os
import zlib

import pytest
import torch

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
