"""The loss, optimizer and robust-objective cases as pytest-benchmark benchmarks, grouped by case so that
each group's table shows the implementations side by side with the floor (a copy that moves the bytes
the operation must move):

    python -m pytest bench --benchmark-only [--benchmark-json out.json] [--bench-device cuda]

Sizes are moderate (each benchmark takes about a second); `python -m bench.run` is the full side-by-side
run with larger N, interleaved rounds and plots.
"""
from __future__ import annotations

import math

import pytest
import torch

from bench import bench_loss, bench_optim, bench_robust
from bench.common import CASES, case_label, copy_pair

CASE_IDS = [case_label(*case).replace(" ", "-") for case in CASES]


# ------------------------------------------------------------------------------------------- loss
_COMPILED = {}


def _loss_impl(impl, name, params):
    if impl != "compiled":
        return {"fused": bench_loss.fused_loss, "eager": bench_loss.eager_loss}[impl]
    key = case_label(name, params)
    if key not in _COMPILED:
        # One dynamic-shape graph per case serves every N (the cases run one after another).
        _COMPILED.clear()
        _COMPILED[key] = bench_loss.make_impls(dynamic=True)["compiled"]
    return _COMPILED[key]


# The last parametrize varies slowest: every (N, implementation) of one case runs before the next case, so
# each case compiles once.
@pytest.mark.parametrize("impl", ["fused", "eager", "compiled", "floor"])
@pytest.mark.parametrize("n", [4096, 1 << 20])
@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
def test_loss(measure, bench_device, case, n, impl):
    name, params = case
    group = f"loss {case_label(name, params)} N={n}"
    nbytes = bench_loss.BYTES_PER_SAMPLE * n
    if impl == "floor":
        measure(bench_loss.floor_copy(n, bench_device), group, n=n, bytes=nbytes)
        return
    losses, eta = bench_loss.make_inputs(n, bench_device)
    run = bench_loss.forward_backward(_loss_impl(impl, name, params), losses, eta, name, params)
    grads = measure(run, group, n=n, bytes=nbytes)
    assert all(torch.isfinite(g).all() for g in grads)


# -------------------------------------------------------------------------------------- optimizer
@pytest.fixture(scope="module")
def resnet18_list(bench_device):
    torch.manual_seed(0)
    return bench_optim.make_list(bench_optim.resnet18_shapes(), bench_device)


@pytest.mark.parametrize("peer", list(bench_optim.PEERS) + ["floor"])
def test_optim(measure, bench_device, resnet18_list, peer):
    params, grads, momenta = resnet18_list
    numel = sum(p.numel() for p in params)
    nbytes = bench_optim.BYTES_PER_PARAM * numel
    group = f"optim resnet18 ({numel / 1e6:.1f}M params)"
    if peer == "floor":
        measure(copy_pair(nbytes // 8, bench_device), group, params=numel, bytes=nbytes)
        return
    if peer == bench_optim.FUSED and not bench_optim.fused_available(bench_device):
        pytest.skip(f"{peer}: this build has no {bench_device.type} kernel")
    measure(bench_optim.make_peer(peer, params, grads, momenta), group, params=numel, bytes=nbytes)


# ---------------------------------------------------------------------------------- robust objective
@pytest.mark.parametrize("method", bench_robust.METHODS)
@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
def test_robust(measure, bench_device, case, method):
    name, params = case
    n = 1 << 16
    losses = bench_robust.lognormal_losses(n).to(device=bench_device, dtype=torch.float32)
    run = bench_robust.make_methods(losses, name, params)[method]
    value = measure(run, f"robust {case_label(name, params)} N=2^{int(math.log2(n))} float32", n=n)
    # The value stays an honest answer while being timed: float32 input, tolerance 1e-4 on eta.
    reference = bench_robust.reference(losses.double().cpu().numpy(), name, params)
    assert abs(value - reference) <= 1e-3 * max(1.0, abs(reference))
