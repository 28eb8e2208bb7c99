"""pytest-benchmark set-up for bench/: `python -m pytest bench --benchmark-only [--bench-device cuda]`.

The timed function synchronizes the device on CUDA, so pytest-benchmark's host clock sees the kernels'
time and not only their launch. `python -m pytest -q tests` does not collect this folder (testpaths).
"""
import pytest
import torch

from bench.common import Timer


def pytest_addoption(parser):
    parser.addoption("--bench-device", default="cpu", choices=("cpu", "cuda"),
                     help="device the bench/ benchmarks run on (default cpu)")


@pytest.fixture(scope="session")
def bench_device(request):
    device = request.config.getoption("--bench-device")
    if device == "cuda" and not torch.cuda.is_available():
        pytest.fail("--bench-device cuda, but torch.cuda.is_available() is False")
    return torch.device(device)


def run_measured(benchmark, timer, device, fn, group, **extra_info):
    """benchmark(fn) under `group` with extra_info, synchronizing after each call on CUDA; returns fn's result on
    either device (the benchmarks check it)."""
    benchmark.group = group
    benchmark.extra_info.update(device=str(device), **extra_info)
    timer.synchronize()
    if device.type == "cuda":
        def synchronized():
            out = fn()
            timer.synchronize()
            return out

        return benchmark(synchronized)
    return benchmark(fn)


@pytest.fixture
def measure(benchmark, bench_device):
    """measure(fn, group, **extra_info): benchmarks fn() under `group`, synchronizing after each call on
    CUDA; extra_info (sizes, bytes moved) lands in --benchmark-json."""
    timer = Timer(bench_device)
    return lambda fn, group, **extra_info: run_measured(benchmark, timer, bench_device, fn, group, **extra_info)
