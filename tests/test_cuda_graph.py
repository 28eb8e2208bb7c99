"""A whole training step (model under autocast + dro_ext.DROLoss + NormalizedSGD + GradScaler) captured in
one CUDA graph and replayed, against the same steps run eagerly: PyTorch's "whole network capture" recipe
(warm-up on a side stream, zero_grad(set_to_none=True), capture, copy each batch into the static input,
replay). The optimizer state is capturable as it is: the step counts live on the device, lr is a device
tensor (changed between replays), GradScaler's scale and found_inf never leave the device, and a step
with an inf gradient is skipped inside the graph.

Skipped (with the reason shown) where no CUDA device is visible.
"""
import copy

import pytest
import torch
import torch.nn.functional as F

import dro_ext
from dro_ext import _backend

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(),
                                reason="no CUDA device visible: CUDA graph capture needs one")

WARMUP, REPLAYS = 3, 6
OVERFLOW_AT = WARMUP + 2  # this batch overflows float16: GradScaler skips that step (in the graph too)
NEW_LR_AT = WARMUP + 4    # lr is changed in place before this step


@pytest.fixture(autouse=True)
def _native_cuda_kernels():
    if _backend._force_python:
        pytest.skip("DRO_EXT_FORCE_PYTHON=1: the fallback's step syncs (found_inf is read on the host)")
    if not _backend.native_available():
        pytest.fail(f"the native extension did not load: {_backend.load_error()}")
    for op in ("dro_loss", "dro_loss_backward", "normalized_sgd_step_"):
        if not torch._C._dispatch_has_kernel_for_dispatch_key(f"dro_ext::{op}", "CUDA"):
            pytest.fail(f"dro_ext::{op} has no CUDA kernel (build with DRO_EXT_CUDA=1)")


def make_run(seed=0):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 10)).cuda()
    criterion = dro_ext.DROLoss("chi2", lam=1.0).cuda()
    lr = torch.tensor(0.05, device="cuda")
    opt = dro_ext.NormalizedSGD(list(model.parameters()) + list(criterion.parameters()), lr=lr, momentum=0.9,
                                weight_decay=1e-4)
    # growth_interval=2: the scale also grows during the run, on the device.
    scaler = torch.amp.GradScaler("cuda", init_scale=2.0 ** 10, growth_interval=2)
    return model, criterion, opt, scaler, lr


def train_step(model, criterion, opt, scaler, x, y):
    # Autocast's weight cache must be off under capture (PyTorch's CUDA-graph notes).
    with torch.autocast("cuda", dtype=torch.float16, cache_enabled=False):
        logits = model(x)
    loss = criterion(F.cross_entropy(logits.float(), y, reduction="none"))
    scaler.scale(loss).backward()
    scaler.step(opt)
    scaler.update()
    return loss


def batches(count):
    gen = torch.Generator(device="cuda").manual_seed(1)
    xs = [torch.randn(128, 32, device="cuda", generator=gen) for _ in range(count)]
    ys = [torch.randint(0, 10, (128,), device="cuda", generator=gen) for _ in range(count)]
    xs[OVERFLOW_AT][0] = 1e6  # float16 overflows to inf: inf/NaN gradients, found_inf on the device
    return xs, ys


def state_of(model, criterion, opt, scaler):
    params = list(model.parameters()) + list(criterion.parameters())
    return ([p.detach().clone() for p in params]
            + [opt.state[p]["momentum_buffer"].clone() for p in params]
            + [opt.state[p]["step"].clone() for p in params]
            + [scaler._scale.clone()])


def test_captured_training_step_matches_eager():
    xs, ys = batches(WARMUP + REPLAYS)

    # Eager.
    model, criterion, opt, scaler, lr = make_run()
    initial = [p.detach().clone() for p in model.parameters()]
    for i in range(WARMUP + REPLAYS):
        if i == NEW_LR_AT:
            lr.fill_(0.02)
        opt.zero_grad(set_to_none=True)
        train_step(model, criterion, opt, scaler, xs[i], ys[i])
    eager = state_of(model, criterion, opt, scaler)

    # Captured.
    model, criterion, opt, scaler, lr = make_run()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up: creates the optimizer state and the scaler's tensors
        for i in range(WARMUP):
            opt.zero_grad(set_to_none=True)
            train_step(model, criterion, opt, scaler, xs[i], ys[i])
    torch.cuda.current_stream().wait_stream(side)

    static_x, static_y = xs[0].clone(), ys[0].clone()
    graph = torch.cuda.CUDAGraph()
    opt.zero_grad(set_to_none=True)
    with torch.cuda.graph(graph):
        train_step(model, criterion, opt, scaler, static_x, static_y)
    for i in range(WARMUP, WARMUP + REPLAYS):
        if i == NEW_LR_AT:
            lr.fill_(0.02)
        static_x.copy_(xs[i])
        static_y.copy_(ys[i])
        graph.replay()
    torch.cuda.synchronize()
    captured = state_of(model, criterion, opt, scaler)

    for e, c in zip(eager, captured):
        torch.testing.assert_close(c, e, rtol=1e-5, atol=1e-6)
    # The run did something: the model moved, the overflowing step was skipped, the scale changed.
    assert not all(torch.equal(a, b.detach()) for a, b in zip(initial, model.parameters()))
    assert all(float(opt.state[p]["step"]) == WARMUP + REPLAYS - 1 for p in model.parameters())
    assert float(scaler._scale) != 2.0 ** 10
