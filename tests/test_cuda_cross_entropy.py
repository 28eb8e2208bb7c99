"""The CUDA kernels of the fused DRO cross-entropy: against the float64 reference, bitwise repeatable, free of host
synchronization, and capturable in a CUDA graph. Skipped (visibly) without a GPU."""
import math

import pytest
import torch
import torch.nn.functional as F

import dro_ext
import reference as ref
from cuda_cases import DEVICE, SKIP_WITHOUT_CUDA, native_backend, needs_cuda  # noqa: F401 (an autouse fixture)
from test_cross_entropy import (GRAD_SCALER_CALLS, LAMS_BEYOND_FLOAT32, SECOND_DERIVATIVE_CALLS,
                                SINGLE_INPUT_CALLS, check_a_grad_scaler_scale_reaches_float16_gradients,
                                check_a_second_derivative_raises, check_a_second_derivative_through_one_input_raises,
                                check_hidden_size_zero, check_lam_beyond_float32, check_shift_float32_does_not_hold)

pytestmark = SKIP_WITHOUT_CUDA

LAM, SCALE = 0.8, 1.3


def reference_value(logits, targets, eta, name, params, label_smoothing):
    losses = F.cross_entropy(logits, targets, reduction="none", label_smoothing=label_smoothing)
    keep = targets != -100
    return ref.dro_loss(losses[keep], eta, LAM, name, params.get("alpha"), params.get("k"), SCALE)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float64], ids=str)
@pytest.mark.parametrize("n,c", [(1, 2), (7, 50257), (1000, 7)])
@pytest.mark.parametrize("name,params", ref.CASES, ids=ref.CASE_IDS)
def test_cuda_matches_float64_reference(name, params, n, c, dtype):
    logits = torch.randn(n, c, device=DEVICE, dtype=torch.float64).to(dtype).requires_grad_()
    targets = torch.randint(0, c, (n,), device=DEVICE)
    if n > 1:
        targets[::3] = -100
    eta = torch.tensor((math.log(c) + 0.3) / SCALE, device=DEVICE, requires_grad=True)
    value = dro_ext.dro_cross_entropy(logits, targets, eta, LAM, name, scale=SCALE, label_smoothing=0.1, **params)
    grads = torch.autograd.grad(value, (logits, eta))
    x64, e64 = logits.detach().double().requires_grad_(), eta.detach().double().requires_grad_()
    expected = reference_value(x64, targets, e64, name, params, 0.1)
    exp_x, exp_eta = torch.autograd.grad(expected, (x64, e64))
    kept = int((targets != -100).sum())
    tol = ref.tolerances(dtype)
    torch.testing.assert_close(value.double(), expected.detach(), **tol)
    torch.testing.assert_close(grads[0].double() * kept, exp_x * kept, **dict(tol, atol=max(tol["atol"], 5e-5)))
    torch.testing.assert_close(grads[1].double(), exp_eta, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float64], ids=str)
def test_cuda_masked_logits_match_cpu(dtype):
    """-inf logits (masked classes): a thread whose first logits are all -inf must not turn the row's
    logsumexp into NaN (it did, before the fix the CPU emulation found)."""
    from test_cross_entropy import masked_batch

    batch_logits, batch_targets = masked_batch(dtype=dtype)
    results = {}
    for key, device in (("cpu", "cpu"), ("device", DEVICE)):
        logits = batch_logits.detach().to(device).requires_grad_()
        targets = batch_targets.to(device)
        eta = torch.tensor(5.0, device=device, requires_grad=True)
        value = dro_ext.dro_cross_entropy(logits, targets, eta, LAM, "kl", scale=SCALE)
        results[key] = [value] + list(torch.autograd.grad(value, (logits, eta)))
    assert results["device"][0].isfinite()
    tol = ref.tolerances(dtype)
    for got, want in zip(results["device"], results["cpu"]):
        torch.testing.assert_close(got.cpu().double(), want.double(), **tol)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_cuda_linear_matches_cpu(dtype):
    hidden = torch.randn(300, 64, dtype=dtype) / 8
    weight = torch.randn(5000, 64, dtype=dtype)
    targets = torch.randint(0, 5000, (300,))
    targets[::7] = -100
    results = {}
    for key, device in (("cpu", "cpu"), ("device", DEVICE)):
        h = hidden.to(device).requires_grad_()
        w = weight.to(device).requires_grad_()
        eta = torch.tensor(8.0, device=device, requires_grad=True)
        value = dro_ext.dro_linear_cross_entropy(h, w, targets.to(device), eta, LAM, "kl", chunk_size=64)
        results[key] = [value] + list(torch.autograd.grad(value, (h, w, eta)))
    tol = dict(rtol=2e-2, atol=2e-2) if dtype == torch.bfloat16 else dict(rtol=1e-4, atol=1e-5)
    for got, want in zip(results["device"], results["cpu"]):
        torch.testing.assert_close(got.cpu().double(), want.double(), **tol)


@pytest.mark.parametrize("name,params", ref.CASES, ids=ref.CASE_IDS)
def test_cuda_infinite_row_loss_makes_the_objective_infinite(name, params):
    """A target logit of -inf: that row's cross-entropy is +inf, and so is the objective (not NaN)."""
    logits = torch.randn(9, 5, device=DEVICE)
    targets = torch.randint(0, 5, (9,), device=DEVICE)
    logits[4, targets[4]] = -math.inf
    value = dro_ext.dro_cross_entropy(logits, targets, 0.5, LAM, name, scale=SCALE, **params)
    assert float(value) == math.inf


@pytest.mark.parametrize("lam", LAMS_BEYOND_FLOAT32, ids=str)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("path", ["logits", "linear"])
@pytest.mark.parametrize("name,params", ref.CASES, ids=ref.CASE_IDS)
def test_cuda_a_lam_beyond_float32_matches_the_exact_objective(name, params, path, dtype, lam):
    """The row terms are formed in float64 on CUDA as on the CPU: float32 would form every row's t as +-inf or NaN
    where 1/lam is no normal float32 (lam = 1e39: lam itself inf), and psi*(t) as inf at lam = 1e-36."""
    check_lam_beyond_float32(name, params, path, dtype, lam, DEVICE)


@pytest.mark.parametrize("eta_dtype, eta_value, scale", ref.SHIFTS_FLOAT32_DOES_NOT_HOLD, ids=ref.SHIFT_IDS)
@pytest.mark.parametrize("path", ["logits", "linear"])
@pytest.mark.parametrize("name,params", ref.CASES, ids=ref.CASE_IDS)
def test_cuda_a_shift_float32_does_not_hold_is_not_rounded_to_it(name, params, path, eta_dtype, eta_value, scale):
    """Each row's t = (l_i - G eta)/lam is formed in float64 from G eta as given (float32 rounded G eta and moved
    every t by up to 0.6 here)."""
    check_shift_float32_does_not_hold(name, params, path, eta_dtype, eta_value, scale, DEVICE)


@needs_cuda
def test_cuda_bitwise_repeatable_and_no_host_sync():
    logits = torch.randn(4097, 3001, device=DEVICE)
    targets = torch.randint(0, 3001, (4097,), device=DEVICE)
    eta = torch.tensor(8.0, device=DEVICE)
    torch.cuda.set_sync_debug_mode("error")  # any host synchronization raises
    try:
        first = torch.ops.dro_ext.dro_cross_entropy(logits, targets, eta, LAM, "smoothed_cvar", 0.1, None, 1.0,
                                                    -100, 0.0)
        second = torch.ops.dro_ext.dro_cross_entropy(logits, targets, eta, LAM, "smoothed_cvar", 0.1, None, 1.0,
                                                     -100, 0.0)
        grad = torch.ops.dro_ext.dro_cross_entropy_backward(torch.ones((), device=DEVICE), logits, targets,
                                                            first[2], first[3], -100, 0.0)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert all(torch.equal(a, b) for a, b in zip(first, second))
    assert torch.isfinite(grad).all()


def test_cuda_backward_in_place_matches_the_backward():
    # The in-place gradient writer of the grouped linear cross-entropy's second pass: bit for bit what the
    # out-of-place op returns (each block reads its row's target logit before any thread overwrites the row).
    for dtype in (torch.float32, torch.bfloat16, torch.float64):
        logits = (3 * torch.randn(37, 1029, device=DEVICE)).to(dtype)
        targets = torch.randint(0, 1029, (37,), device=DEVICE)
        targets[5] = -100
        acc = torch.float64 if dtype == torch.float64 else torch.float32
        lse = ref.shifted_lse(logits.to(acc))
        row_weight = torch.rand(37, device=DEVICE, dtype=acc)
        grad = torch.tensor(1.3, device=DEVICE, dtype=dtype)
        expected = torch.ops.dro_ext.dro_cross_entropy_backward(grad, logits, targets, lse, row_weight, -100, 0.1)
        overwritten = logits.clone()
        torch.ops.dro_ext.dro_cross_entropy_backward_(grad, overwritten, targets, lse, row_weight, -100, 0.1)
        assert torch.equal(overwritten, expected)


def test_cuda_logsumexp_columns():
    matrix = 4 * torch.randn(1031, 67, device=DEVICE)
    got = torch.ops.dro_ext.logsumexp_columns(matrix)
    assert got.dtype == torch.float32 and got.shape == (67, 2)
    torch.testing.assert_close(got.cpu(), torch.ops.dro_ext.logsumexp_columns(matrix.cpu()), rtol=2e-6, atol=1e-7)
    torch.testing.assert_close(ref.combined_lse(got).cpu(), torch.logsumexp(matrix.double().cpu(), dim=0), rtol=2e-6,
                               atol=0)


@needs_cuda
def test_cuda_graph_capture():
    logits = torch.randn(64, 1000, device=DEVICE)
    targets = torch.randint(0, 1000, (64,), device=DEVICE)
    eta = torch.tensor(7.0, device=DEVICE)
    op = torch.ops.dro_ext.dro_cross_entropy
    eager = op(logits, targets, eta, LAM, "chi2", None, None, 1.0, -100, 0.0)[0]
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        op(logits, targets, eta, LAM, "chi2", None, None, 1.0, -100, 0.0)  # warm-up on the side stream
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = op(logits, targets, eta, LAM, "chi2", None, None, 1.0, -100, 0.0)[0]
    eta.fill_(6.0)  # read on the device at replay
    graph.replay()
    expected = op(logits, targets, eta, LAM, "chi2", None, None, 1.0, -100, 0.0)[0]
    assert not torch.equal(expected, eager)
    torch.testing.assert_close(captured, expected)


@pytest.mark.parametrize("linear", [False, True], ids=["logits", "linear"])
def test_cuda_grouped_matches_the_cpu(linear):
    # Over groups of tokens (dro_ext/cross_entropy_groups.py) the CUDA path runs the same native per-row kernels as
    # the CPU one around the same PyTorch objective: the value and gradients agree to float32 rounding.
    torch.manual_seed(0)
    targets = torch.randint(0, 50257, (4, 9))
    targets[:, :2] = -100
    groups = torch.tensor([0, 2, 2, 1])
    if linear:
        inputs = [torch.randn(4, 9, 64) / 8, torch.randn(50257, 64)]
    else:
        inputs = [torch.randn(4, 9, 50257)]
    results = []
    for device in ("cpu", DEVICE):
        xs = [t.to(device).requires_grad_() for t in inputs]
        eta = torch.tensor(10.0, device=device, requires_grad=True)
        y, g = targets.to(device), groups.to(device)
        if linear:
            value = dro_ext.dro_linear_cross_entropy(*xs, y, eta, LAM, "kl", groups=g, num_groups=3, chunk_size=16)
        else:
            value = dro_ext.dro_cross_entropy(*xs, y, eta, LAM, "kl", groups=g, num_groups=3, label_smoothing=0.1)
        results.append([value] + list(torch.autograd.grad(value, (*xs, eta))))
    for cpu, cuda in zip(*results):
        torch.testing.assert_close(cuda.cpu(), cpu, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("linear", [False, True], ids=["logits", "linear"])
def test_cuda_grouped_reads_nothing_on_the_host(linear):
    # Over groups (per sequence and per token, ignored tokens, label smoothing), forward and backward: the group
    # sums, their objective and the linear op's two chunked passes read no device value on the host.
    torch.manual_seed(0)
    targets = torch.randint(0, 3001, (4, 9), device=DEVICE)
    targets[:, :2] = -100
    eta = torch.tensor(8.0, device=DEVICE, requires_grad=True)
    if linear:
        inputs = [(torch.randn(4, 9, 64, device=DEVICE) / 8).requires_grad_(),
                  torch.randn(3001, 64, device=DEVICE, requires_grad=True)]
    else:
        inputs = [torch.randn(4, 9, 3001, device=DEVICE, requires_grad=True)]
    per_sequence = torch.tensor([0, 2, 2, 1], device=DEVICE)
    per_token = torch.randint(0, 3, (4, 9), device=DEVICE)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")  # any host synchronization raises
    try:
        for groups in (per_sequence, per_token):
            if linear:
                value = dro_ext.dro_linear_cross_entropy(*inputs, targets, eta, LAM, "kl", groups=groups,
                                                         num_groups=3, chunk_size=16)
            else:
                value = dro_ext.dro_cross_entropy(*inputs, targets, eta, LAM, "kl", groups=groups, num_groups=3,
                                                  label_smoothing=0.1)
            grads = torch.autograd.grad(value, (*inputs, eta))
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert torch.isfinite(value) and all(torch.isfinite(g).all() for g in grads)


@pytest.mark.parametrize("call", list(SECOND_DERIVATIVE_CALLS))
def test_cuda_a_second_derivative_raises(call):
    check_a_second_derivative_raises(call, DEVICE)


@pytest.mark.parametrize("call", list(SINGLE_INPUT_CALLS))
def test_cuda_a_second_derivative_through_one_input_raises(call):
    check_a_second_derivative_through_one_input_raises(call, DEVICE)


@pytest.mark.parametrize("call", GRAD_SCALER_CALLS)
def test_cuda_a_grad_scaler_scale_reaches_float16_gradients(call):
    check_a_grad_scaler_scale_reaches_float16_gradients(call, DEVICE)


@pytest.mark.parametrize("with_bias", [False, True], ids=["no-bias", "bias"])
def test_cuda_linear_cross_entropy_of_a_hidden_size_zero(with_bias):
    check_hidden_size_zero(with_bias, DEVICE)
