"""The SIMD builds of dro_ext's CPU kernels this processor can run, for the tests that pin or compare them."""
import torch

from dro_ext import _backend

BUILDS = ("default", "avx2", "avx512")  # narrowest first


def runnable_builds() -> list:
    """The builds of :data:`BUILDS` this processor can run, narrowest first, found by pinning each in turn (a process
    under ATEN_CPU_CAPABILITY picks a narrower one than the processor has, so its own pick does not tell); empty
    where the native extension did not load."""
    if not _backend.native_available():
        return []
    capability = torch.ops.dro_ext._cpu_capability
    runnable = []
    for build in BUILDS:
        try:
            previous = capability(build)
        except RuntimeError:  # the processor cannot run it
            continue
        capability(previous)
        runnable.append(build)
    return runnable
