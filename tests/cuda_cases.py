"""What the CUDA test files of the loss and the robust objective share: the skip marks (every test is skipped,
with its reason shown, where no GPU is visible), the dtype/size/layout matrix, the loss layouts and the fixture
that pins the native backend."""
import os

import pytest
import torch

from dro_ext import _backend
from reference import DTYPES

# DRO_EXT_CUDA_TEST_DEVICE=cpu runs the tests on the CPU, where tools/cuda_emulation registers the CUDA kernels,
# compiled as C++, as the ops' CPU kernels; the tests marked needs_cuda (graphs, streams, sync checks) skip.
DEVICE = os.environ.get("DRO_EXT_CUDA_TEST_DEVICE", "cuda")
ON_CUDA = torch.device(DEVICE).type == "cuda"
SKIP_WITHOUT_CUDA = [
    pytest.mark.skipif(ON_CUDA and not torch.cuda.is_available(),
                       reason="no CUDA device visible (run scripts/gpu_check.sh on a GPU)"),
    pytest.mark.skipif(not _backend.native_available(), reason="the dro_ext extension is not built"),
]
needs_cuda = pytest.mark.skipif(not ON_CUDA, reason="DRO_EXT_CUDA_TEST_DEVICE=cpu: this test is about CUDA only")


def on_test_device(t: torch.Tensor) -> bool:
    """Whether t lives on the device under test (a CUDA device, or the CPU under the emulation)."""
    return t.device.type == torch.device(DEVICE).type

SIZES = [1, 7, 65537, 2**24 + 3]
# contiguous; strided (every other element of a buffer); offset (contiguous, but one element past a 16-byte
# boundary, so the vectorized loops take their scalar head and tail).
LAYOUTS = ["contiguous", "strided", "offset"]


def make_losses(n, dtype, layout, device=DEVICE, spread=1.0):
    """n losses 1 + spread * N(0, 1) of dtype on device, laid out as `layout` says."""
    values = (1.0 + spread * torch.randn(n, dtype=torch.float64, device=device)).to(dtype)
    if layout == "contiguous":
        return values
    if layout == "strided":
        buffer = torch.zeros(2 * n, dtype=dtype, device=device)
        buffer[::2] = values
        view = buffer[::2]
        assert not view.is_contiguous() or n == 1
        return view
    buffer = torch.zeros(n + 1, dtype=dtype, device=device)
    buffer[1:] = values
    return buffer[1:]


@pytest.fixture(autouse=True)
def native_backend():
    """Imported by a test module, runs its every test on the native backend (the CUDA kernels)."""
    if _backend._force_python:
        pytest.skip("DRO_EXT_FORCE_PYTHON=1: the CUDA kernels are not in use")
    with _backend.forced_backend("native"):
        yield
