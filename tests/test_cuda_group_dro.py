"""The online Group DRO step on CUDA (csrc/cuda/group_dro.cu, composed with group_sums' kernels): against the PyTorch
composition on the same device and against the CPU kernel, over configurations, state dtypes and numbers of groups
on both sides of one block's threads; CUDA-graph capture of a whole step; opcheck.

Skipped (with the reason shown) where no CUDA device is visible; scripts/gpu_check.sh runs them on a GPU, and
tools/cuda_emulation runs them on the CPU against the kernel compiled as C++ (`--kernel group_dro`).
"""
import pytest
import torch

import dro_ext
from cuda_cases import DEVICE, SKIP_WITHOUT_CUDA, native_backend, needs_cuda  # noqa: F401
from dro_ext import _backend
from test_group_dro_step import (CONFIGS, STATE_DTYPES, TOLERANCES, assert_a_dropped_groups_term_still_counts,
                                 assert_float32_group_sums_past_the_range_keep_a_finite_mean,
                                 assert_out_dtype_sets_the_result_dtype, assert_same_state,
                                 assert_scores_past_float64s_range_from_finite_parts, with_state_dtype)

pytestmark = SKIP_WITHOUT_CUDA


def step(module, losses, groups, backend, update=True):
    losses = losses.detach().clone().requires_grad_()
    with _backend.forced_backend(backend):
        value = module(losses, groups, update=update)
    (grad,) = torch.autograd.grad(value, losses)
    return value, grad


def batch(n, num_groups, gen, dtype):
    groups = torch.randint(num_groups, (n,), generator=gen)
    groups[groups % 5 == 3] = 0  # some groups absent
    losses = (1.0 + torch.randn(n, generator=gen, dtype=torch.float64)).to(dtype)
    return losses.to(DEVICE), groups.to(DEVICE)


@needs_cuda
def test_group_dro_ops_have_cuda_kernels():
    for op in ("group_dro_step_", "group_dro_loss_"):
        assert torch._C._dispatch_has_kernel_for_dispatch_key(f"dro_ext::{op}", "CUDA"), op


@pytest.mark.parametrize("state_dtype", STATE_DTYPES, ids=str)
@pytest.mark.parametrize("config", list(CONFIGS), ids=list(CONFIGS))
def test_matches_the_composition_on_the_device(config, state_dtype):
    native = with_state_dtype(dro_ext.GroupDROLoss(5, **CONFIGS[config]).to(DEVICE), state_dtype)
    composed = with_state_dtype(dro_ext.GroupDROLoss(5, **CONFIGS[config]).to(DEVICE), state_dtype)
    rtol, atol = TOLERANCES[state_dtype]
    gen = torch.Generator().manual_seed(0)
    for i in range(6):
        losses, groups = batch(301, 5, gen, torch.float32 if state_dtype != torch.float64 else torch.float64)
        got, got_grad = step(native, losses, groups, "native", update=i % 3 != 2)
        want, want_grad = step(composed, losses, groups, "python", update=i % 3 != 2)
        torch.testing.assert_close(got, want, rtol=rtol, atol=atol)
        torch.testing.assert_close(got_grad, want_grad, rtol=rtol, atol=atol)
        assert_same_state(native, composed, rtol, atol)


@pytest.mark.parametrize("bad", [float("inf"), float("nan"), -float("inf")], ids=["inf", "nan", "-inf"])
@pytest.mark.parametrize("num_groups", [5, 257])
def test_a_batch_with_a_mean_not_finite_takes_no_step_on_the_device(num_groups, bad):
    """The device kernel's rule (csrc/group_dro_step.h's blocks_the_step, one block reduction of a flag per group):
    a batch in which a present group's mean is infinite or NaN leaves the state bitwise as it was and returns the
    value and gradient under the current q, as the CPU kernel does, whichever thread holds the group (g = 0, and at
    257 groups g = 256, a thread's second group)."""
    gen = torch.Generator().manual_seed(num_groups)
    on_device = dro_ext.GroupDROLoss(num_groups, 0.3).to(DEVICE, torch.float64)
    on_cpu = dro_ext.GroupDROLoss(num_groups, 0.3).to("cpu", torch.float64)
    losses, groups = batch(4 * num_groups + 7, num_groups, gen, torch.float64)
    step(on_device, losses, groups, "native")
    step(on_cpu, losses.cpu(), groups.cpu(), "native")
    for broken_group in sorted({0, num_groups - 1}):
        losses, groups = batch(4 * num_groups + 7, num_groups, gen, torch.float64)
        groups[0] = broken_group
        losses[0] = bad
        before = {name: t.clone() for name, t in on_device.state_dict().items()}
        got, got_grad = step(on_device, losses, groups, "native")
        for name, t in on_device.state_dict().items():
            assert torch.equal(t, before[name]), name
        want, want_grad = step(on_cpu, losses.cpu(), groups.cpu(), "native")
        torch.testing.assert_close(got.cpu(), want, rtol=1e-12, atol=1e-15, equal_nan=True)
        torch.testing.assert_close(got_grad.cpu(), want_grad, rtol=1e-12, atol=1e-15)
        torch.testing.assert_close(on_device.log_q.cpu(), on_cpu.log_q, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("num_groups", [5, 257])
def test_a_mean_past_a_float32_states_range_takes_no_step_on_the_device(num_groups):
    """float64 losses whose group mean (1e39) is finite but past the default float32 state's range: the kernel's flag
    (blocks_the_step with the state dtype's largest value) leaves the state as it was, as the CPU kernel does."""
    gen = torch.Generator().manual_seed(num_groups)
    on_device = dro_ext.GroupDROLoss(num_groups, 0.3).to(DEVICE)
    on_cpu = dro_ext.GroupDROLoss(num_groups, 0.3)
    assert on_device.log_q.dtype == torch.float32
    losses, groups = batch(4 * num_groups + 7, num_groups, gen, torch.float64)
    step(on_device, losses, groups, "native")
    step(on_cpu, losses.cpu(), groups.cpu(), "native")
    losses, groups = batch(4 * num_groups + 7, num_groups, gen, torch.float64)
    groups[0] = num_groups - 1
    losses = torch.where(groups == num_groups - 1, 1e39, losses)
    before = {name: t.clone() for name, t in on_device.state_dict().items()}
    got, got_grad = step(on_device, losses, groups, "native")
    for name, t in on_device.state_dict().items():
        assert torch.equal(t, before[name]), name
    want, want_grad = step(on_cpu, losses.cpu(), groups.cpu(), "native")
    torch.testing.assert_close(got.cpu(), want, rtol=1e-12, atol=0)
    torch.testing.assert_close(got_grad.cpu(), want_grad, rtol=1e-12, atol=1e-15)


def test_a_dropped_groups_term_still_counts_on_the_device():
    """The native step's dropped q (below e^-44 / e^-660) still brings its term q m into the loss where the mean is
    large: test_group_dro_step's case, on the device."""
    assert_a_dropped_groups_term_still_counts(DEVICE, "native")


def test_scores_past_float64s_range_from_finite_parts_on_the_device():
    """test_group_dro_step's case on the device: a score overflowing from finite parts takes no step, and
    normalize_loss divides by the scores' mean over the groups."""
    assert_scores_past_float64s_range_from_finite_parts(DEVICE, "native")


def test_float32_group_sums_past_the_range_keep_a_finite_mean_on_the_device():
    """test_group_dro_step's case on the device: every step's group sums are float64 (group_sums.cu, wide), the
    native "eg" one's too (its loss and weights float32 through group_dro_step_'s out_dtype)."""
    assert_float32_group_sums_past_the_range_keep_a_finite_mean(DEVICE, "native")


def test_out_dtype_sets_the_result_dtype_on_the_device():
    """test_group_dro_step's case on the device: the kernel's loss and weights in out_dtype, or the promoted dtype."""
    assert_out_dtype_sets_the_result_dtype(DEVICE)


@pytest.mark.parametrize("num_groups", [1, 255, 257, 5000])
def test_any_number_of_groups_matches_the_cpu(num_groups):
    """One block of 256 threads strides over the groups: fewer, one more, and many more groups, float64, against
    the CPU kernel (the sums over the groups differ in order only)."""
    on_device = dro_ext.GroupDROLoss(num_groups, 0.3, missing="stale").to(DEVICE, torch.float64)
    on_cpu = dro_ext.GroupDROLoss(num_groups, 0.3, missing="stale").to("cpu", torch.float64)
    gen = torch.Generator().manual_seed(num_groups)
    for _ in range(4):
        losses, groups = batch(4 * num_groups + 7, num_groups, gen, torch.float64)
        got, got_grad = step(on_device, losses, groups, "native")
        want, want_grad = step(on_cpu, losses.cpu(), groups.cpu(), "native")
        torch.testing.assert_close(got.cpu(), want, rtol=1e-12, atol=1e-15)
        torch.testing.assert_close(got_grad.cpu(), want_grad, rtol=1e-12, atol=1e-15)
        torch.testing.assert_close(on_device.log_q.cpu(), on_cpu.log_q, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(on_device.ema_loss.cpu(), on_cpu.ema_loss, rtol=1e-12, atol=1e-15)


def test_a_step_beyond_the_double_range_matches_the_cpu():
    """step_size * a_g overflows from finite scores (the largest x_g is +inf): the device's extra reductions over
    the scores give the CPU's finite q, loss and gradient, with the largest score tied between a group of the block's
    first round of threads and one of its second; on the last step a group at q = 0 has the largest score."""
    num_groups = 300
    q_init = torch.rand(num_groups, generator=torch.Generator().manual_seed(1)) + 0.5
    on_device = dro_ext.GroupDROLoss(num_groups, 1e300, q_init=q_init).to(DEVICE, torch.float64)
    on_cpu = dro_ext.GroupDROLoss(num_groups, 1e300, q_init=q_init).to("cpu", torch.float64)
    shares = on_cpu.q[[20, 280]] / on_cpu.q[[20, 280]].sum()  # of q as the state holds it
    gen = torch.Generator().manual_seed(num_groups)
    for i in range(3):
        losses, groups = batch(4 * num_groups + 7, num_groups, gen, torch.float64)
        losses = losses.abs() * 1e30
        groups[(groups == 20) | (groups == 280)] = 21
        groups[:4] = torch.tensor([20, 280, 280, 20], device=groups.device)  # the mean of each exactly 1e40
        losses[:4] = 1e40
        if i == 2:
            groups[4] = 100
            losses[groups == 100] = 1e41  # q_100 = 0 since the first step
        got, got_grad = step(on_device, losses, groups, "native")
        want, want_grad = step(on_cpu, losses.cpu(), groups.cpu(), "native")
        torch.testing.assert_close(on_cpu.q[[20, 280]], shares, rtol=1e-12, atol=0.0)
        torch.testing.assert_close(got.cpu(), want, rtol=1e-12, atol=0.0)
        torch.testing.assert_close(got_grad.cpu(), want_grad, rtol=1e-12, atol=0.0)
        torch.testing.assert_close(on_device.log_q.cpu(), on_cpu.log_q, rtol=1e-12, atol=1e-12)


@needs_cuda
def test_cuda_graph_capture_of_a_step_matches_eager():
    """A whole step (group sums without the host read, the update of q in place, the loss) captured once and
    replayed on new batches follows the same steps run eagerly."""
    n, num_groups = 4099, 6
    captured = dro_ext.GroupDROLoss(num_groups, 0.5).to(DEVICE)
    eager = dro_ext.GroupDROLoss(num_groups, 0.5).to(DEVICE)
    static_losses = torch.rand(n, device=DEVICE)
    static_groups = torch.randint(num_groups, (n,), device=DEVICE)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side), torch.no_grad():
        dro_ext.GroupDROLoss(num_groups, 0.5).to(DEVICE)(static_losses, static_groups)  # warm-up, state elsewhere
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph), torch.no_grad():
        static_value = captured(static_losses, static_groups)
    # Capture records the step without running it: both modules start from the uniform q.
    for _ in range(3):
        static_losses.copy_(torch.rand(n, device=DEVICE))
        static_groups.copy_(torch.randint(num_groups, (n,), device=DEVICE))
        graph.replay()
        with torch.no_grad():
            want = eager(static_losses, static_groups)
        torch.testing.assert_close(static_value, want, rtol=1e-6, atol=1e-7)
        torch.testing.assert_close(captured.q, eager.q, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("update", [False, True], ids=["no-update", "update"])
def test_opcheck_on_the_device(update):
    module = dro_ext.GroupDROLoss(4, 0.5).to(DEVICE, torch.float64)
    b = module._buffers
    state = (b["log_q"], b["ema_loss"], b["last_loss"], b["seen"], b["active"], b["adjustment_term"], 0.5, 0.1,
             False, True, update)
    losses = torch.rand(37, device=DEVICE, dtype=torch.float64, requires_grad=True)
    groups = torch.randint(4, (37,), device=DEVICE)
    torch.library.opcheck(torch.ops.dro_ext.group_dro_loss_.default, (losses, groups, 4, *state, False))
    sums = torch.rand(4, device=DEVICE, dtype=torch.float64, requires_grad=True)
    counts = torch.tensor([2.0, 0.0, 5.0, 1.0], device=DEVICE, dtype=torch.float64)
    torch.library.opcheck(torch.ops.dro_ext.group_dro_step_.default, (sums, counts, *state))
