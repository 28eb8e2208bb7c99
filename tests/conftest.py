"""Shared fixtures: every numerical test runs on both the native ops and the PyTorch fallback."""
import os
import zlib

import pytest
import torch

from dro_ext import _backend

BACKENDS = ("native", "python")


@pytest.fixture(params=BACKENDS)
def backend(request):
    """Runs the test once on the compiled ops and once on the fallback.

    The native run fails (it is not skipped) when the extension did not load, unless
    DRO_EXT_FORCE_PYTHON=1 says the whole run is meant for the fallback.
    """
    if request.param == "native" and _backend._force_python:
        pytest.skip("DRO_EXT_FORCE_PYTHON=1: this run covers the fallback only")
    with _backend.forced_backend(request.param):
        yield request.param


@pytest.fixture(autouse=True)
def _seed(request):
    # Fresh random inputs per test, but reproducible from the test id when a failure must be replayed.
    # crc32, not hash(): str hashes are salted per process, which made the seeds differ from run to run.
    seed = int(os.environ.get("DRO_EXT_TEST_SEED", "0")) + (zlib.crc32(request.node.nodeid.encode()) & 0xFFFF)
    torch.manual_seed(seed)
    yield
