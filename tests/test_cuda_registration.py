"""Every dro_ext op has a CUDA kernel in a CUDA build of the extension. Needs no GPU: the dispatcher knows
which kernels are registered whether or not a device is visible (CONTRACTS.md rule 4)."""
import os
import pathlib

import pytest
import torch

from dro_ext import _backend

# The ops issue 8 gives a CUDA kernel; any other op the extension defines must have one too (checked below).
REQUIRED_OPS = [
    "dro_loss",
    "dro_loss_backward",
    "psi_star_terms",
    "normalized_sgd_step_",
    "robust_objective",
    "robust_weights",
    "weight_stats",
]


def _extension_path():
    from dro_ext import _C

    return pathlib.Path(_C.__file__)


def _built_with_cuda() -> bool:
    """The extension links the CUDA side of torch (libc10_cuda) exactly when setup.py compiled csrc/cuda."""
    return b"libc10_cuda.so" in _extension_path().read_bytes()


# Ops on no tensors, with no device to run on: which SIMD build of the CPU kernels runs (the tests switch it).
NOT_DEVICE_OPS = {"_cpu_capability"}


def _defined_ops():
    names = torch._C._dispatch_get_all_op_names()
    ops = {n.split("::", 1)[1].split(".", 1)[0] for n in names if n.startswith("dro_ext::")}
    return sorted(ops - NOT_DEVICE_OPS)


pytestmark = [
    pytest.mark.skipif(not _backend.native_available(), reason="the dro_ext extension is not built"),
    pytest.mark.skipif(torch.version.cuda is None, reason="this torch is a CPU-only build: no CUDA kernels to check"),
]


def test_cuda_builds_when_asked():
    # DRO_EXT_CUDA=1 (as .ci/run sets) must give a CUDA build; otherwise a CPU-only build is legitimate.
    if os.environ.get("DRO_EXT_CUDA") == "1":
        assert _built_with_cuda(), f"DRO_EXT_CUDA=1 but {_extension_path().name} was built without the CUDA kernels"


@pytest.mark.parametrize("op", REQUIRED_OPS)
def test_op_has_cuda_kernel(op):
    if not _built_with_cuda():
        pytest.skip("the extension was built without CUDA (DRO_EXT_CUDA=0 or no toolkit)")
    assert f"dro_ext::{op}" in [f"dro_ext::{o}" for o in _defined_ops()], f"dro_ext::{op} is not defined"
    assert torch._C._dispatch_has_kernel_for_dispatch_key(f"dro_ext::{op}", "CUDA"), (
        f"dro_ext::{op} has no CUDA kernel")


def test_every_defined_op_has_cuda_kernel():
    if not _built_with_cuda():
        pytest.skip("the extension was built without CUDA (DRO_EXT_CUDA=0 or no toolkit)")
    ops = _defined_ops()
    assert set(REQUIRED_OPS) <= set(ops), f"missing ops: {set(REQUIRED_OPS) - set(ops)}"
    # An op defined in Python from torch ops and the other dro_ext ops (linear_cross_entropy_with_grads: matmuls
    # around the native chunk op) has one backend-agnostic kernel, which serves CUDA; its native parts are checked
    # here as ops of their own.
    missing = [op for op in ops
               if not any(torch._C._dispatch_has_kernel_for_dispatch_key(f"dro_ext::{op}", key)
                          for key in ("CUDA", "CompositeExplicitAutograd"))]
    assert not missing, f"dro_ext ops without a CUDA kernel: {missing}"


def test_cuda_tensors_route_to_native_ops():
    # With the kernels registered, the Python side sends CUDA tensors to the native ops (unless
    # DRO_EXT_FORCE_PYTHON=1): the routing decision is made from the dispatcher, without a device.
    if not _built_with_cuda():
        pytest.skip("the extension was built without CUDA (DRO_EXT_CUDA=0 or no toolkit)")
    from dro_ext import robust

    with _backend.forced_backend("native"):
        assert robust._native_for_device_type("cuda")
    with _backend.forced_backend("python"):
        assert not robust._native_for_device_type("cuda")
