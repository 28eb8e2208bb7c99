"""The loss ops on CUDA (csrc/cuda/dro_loss.cu): the float64 reference matrix, agreement with the CPU kernels,
bitwise determinism, zero host syncs, CUDA-graph capture, torch.compile(mode="reduce-overhead") and opcheck.

Skipped (with the reason shown) where no CUDA device is visible; scripts/gpu_check.sh runs them on a GPU.
"""
import pytest
import torch

import dro_ext
import reference as ref
from reference import case_kwargs
from cuda_cases import (DEVICE, DTYPES, LAYOUTS, ON_CUDA, SIZES, SKIP_WITHOUT_CUDA, make_losses,
                        native_backend, needs_cuda, on_test_device)  # noqa: F401 (native_backend: an autouse fixture)
from test_precision import (FAR_ALPHAS, KINK_KS, check_cressie_read_derivatives_above_the_kink,
                            check_smoothed_cvar_derivatives_where_exp_minus_abs_t_underflows)

pytestmark = SKIP_WITHOUT_CUDA


@needs_cuda
def test_loss_ops_have_cuda_kernels():
    for op in ("dro_loss", "dro_loss_backward", "psi_star_terms"):
        assert torch._C._dispatch_has_kernel_for_dispatch_key(f"dro_ext::{op}", "CUDA"), op


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("name,params", ref.CASES, ids=ref.CASE_IDS)
def test_loss_and_gradients_match_float64_reference(name, params, n, dtype, layout):
    if n == SIZES[-1] and layout != "contiguous" and dtype != torch.float32:
        pytest.skip("the 2^24+3 size runs every layout in float32 and every dtype contiguous (time on the GPU)")
    lam, scale = 0.7, 1.3
    losses = make_losses(n, dtype, layout).requires_grad_()
    eta = torch.tensor(0.6, device=DEVICE, requires_grad=True)
    value = dro_ext.dro_loss(losses, eta, lam, name, scale=scale, **params)
    assert value.dtype == dtype and value.dim() == 0 and on_test_device(value)
    grad_l, grad_eta = torch.autograd.grad(value, (losses, eta))
    assert grad_l.dtype == dtype and grad_eta.dtype == torch.float32 and grad_l.shape == losses.shape

    # The float64 reference sees exactly the rounded inputs the op saw; on the CPU up to 65537 samples, on
    # the device (still float64, the same formulas) for 2^24+3, where the CPU reference would dominate the run.
    ref_device = "cpu" if n <= 65537 else DEVICE
    e64 = eta.detach().to(ref_device, torch.float64).requires_grad_()
    expected = ref.dro_loss(losses.detach().to(ref_device, torch.float64), e64, lam, name, scale=scale,
                            **case_kwargs(params))
    (exp_eta,) = torch.autograd.grad(expected, e64)

    tol = ref.tolerances(dtype)
    torch.testing.assert_close(value.double().cpu(), expected.cpu(), **tol)
    # grad_l = w/N: compare w, which is O(1), allowing for what rounding t and storing w/N can move it by.
    ref.assert_weights_close(grad_l.to(ref_device).double() * n, losses.detach().to(ref_device), eta, lam, name,
                             scale=scale, **case_kwargs(params))
    eta_tol = dict(rtol=1e-5, atol=1e-5) if dtype != torch.float64 else dict(rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(grad_eta.double().cpu(), exp_eta.cpu(), **eta_tol)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=str)
@pytest.mark.parametrize("k", KINK_KS)
def test_cressie_read_derivatives_within_a_rounding_above_the_kink(k, dtype):
    check_cressie_read_derivatives_above_the_kink(k, dtype, DEVICE)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=str)
@pytest.mark.parametrize("alpha", FAR_ALPHAS)
def test_smoothed_cvar_derivatives_stay_normal_where_exp_minus_abs_t_underflows(alpha, dtype):
    check_smoothed_cvar_derivatives_where_exp_minus_abs_t_underflows(alpha, dtype, DEVICE)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("name,params", ref.CASES, ids=ref.CASE_IDS)
def test_cuda_matches_cpu_kernels(name, params, dtype):
    # Same inputs, same accumulate dtype: the CUDA and CPU kernels differ only in summation order.
    losses = make_losses(100_003, dtype, "contiguous")
    eta = torch.tensor(0.4, device=DEVICE)
    args = (0.5, name, params.get("alpha"), params.get("k"), 1.2)
    value, mean_w = torch.ops.dro_ext.dro_loss(losses, eta, *args)
    value_cpu, mean_w_cpu = torch.ops.dro_ext.dro_loss(losses.cpu(), eta.cpu(), *args)
    tol = ref.tolerances(dtype)
    torch.testing.assert_close(value.cpu(), value_cpu, **tol)
    torch.testing.assert_close(mean_w.cpu(), mean_w_cpu, **ref.tolerances(mean_w.dtype))
    grad = torch.tensor(1.7, device=DEVICE)
    g_l, g_eta = torch.ops.dro_ext.dro_loss_backward(grad, losses, eta, mean_w, *args)
    g_l_cpu, g_eta_cpu = torch.ops.dro_ext.dro_loss_backward(grad.cpu(), losses.cpu(), eta.cpu(), mean_w.cpu(), *args)
    torch.testing.assert_close(g_l.cpu(), g_l_cpu, **tol)
    torch.testing.assert_close(g_eta.cpu(), g_eta_cpu, **ref.tolerances(torch.float32))


@pytest.mark.parametrize("lam", [1e-39, 1e-44])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("name,params", ref.CASES, ids=ref.CASE_IDS)
def test_a_lam_with_no_float32_reciprocal_matches_cpu(name, params, dtype, lam):
    """1/lam is no normal float32, so float32 kernels would form every t = (l - eta)/lam as +-inf or 0 (NaN at
    l = eta): the ops run the float64 kernels on a copy of the losses, as the CPU kernels do. The losses lie within
    a few lam of eta (t of order 10), scaled out before comparing."""
    scale = 1000.0 * lam
    losses = (make_losses(10_001, torch.float64, "contiguous", spread=0.01) * scale).to(dtype)
    eta = torch.tensor(scale, device=DEVICE)
    args = (lam, name, params.get("alpha"), params.get("k"), 1.0)
    tol = ref.tolerances(dtype)
    value, mean_w = torch.ops.dro_ext.dro_loss(losses, eta, *args)
    value_cpu, mean_w_cpu = torch.ops.dro_ext.dro_loss(losses.cpu(), eta.cpu(), *args)
    assert torch.isfinite(value_cpu) and torch.isfinite(mean_w_cpu)
    torch.testing.assert_close(value.cpu().double() / scale, value_cpu.double() / scale, **tol)
    torch.testing.assert_close(mean_w.cpu(), mean_w_cpu, **ref.tolerances(torch.float32))
    n = losses.numel()
    grad = torch.tensor(1.7, device=DEVICE)
    g_l, g_eta = torch.ops.dro_ext.dro_loss_backward(grad, losses, eta, mean_w, *args)
    g_l_cpu, g_eta_cpu = torch.ops.dro_ext.dro_loss_backward(grad.cpu(), losses.cpu(), eta.cpu(), mean_w_cpu, *args)
    torch.testing.assert_close(g_l.cpu().double() * n, g_l_cpu.double() * n, **tol)
    torch.testing.assert_close(g_eta.cpu(), g_eta_cpu, **ref.tolerances(torch.float32))
    for order in (0, 1, 2):
        multiplier = torch.tensor(lam if order == 2 else 1.0, dtype=torch.float64, device=DEVICE)
        terms = torch.ops.dro_ext.psi_star_terms(losses, eta, multiplier, *args, order)
        want = torch.ops.dro_ext.psi_star_terms(losses.cpu(), eta.cpu(), multiplier.cpu(), *args, order)
        torch.testing.assert_close(terms.cpu(), want, **tol)


@pytest.mark.parametrize("eta_dtype, eta_value, scale", ref.SHIFTS_FLOAT32_DOES_NOT_HOLD, ids=ref.SHIFT_IDS)
@pytest.mark.parametrize("name,params", ref.CASES, ids=ref.CASE_IDS)
def test_cuda_a_shift_float32_does_not_hold_is_not_rounded_to_it(name, params, eta_dtype, eta_value, scale):
    """The kernels read G eta on the device in float64 and form t = ((l - hi) - lo)/lam from its float32 parts
    hi + lo: rounding G eta to float32 moved every t by up to 0.6 here."""
    from test_loss import check_shift_float32_does_not_hold

    check_shift_float32_does_not_hold(name, params, eta_dtype, eta_value, scale, DEVICE)


@pytest.mark.parametrize("order", [0, 1, 2])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("name,params", ref.CASES, ids=ref.CASE_IDS)
def test_psi_star_terms_match_cpu(name, params, dtype, order):
    acc = torch.float64 if dtype == torch.float64 else torch.float32
    for shape, layout in (((), "contiguous"), ((3, 5, 7), "contiguous"), ((1001,), "offset"), ((1001,), "strided")):
        t = make_losses(int(torch.tensor(shape).prod()), dtype, layout).reshape(shape) if layout == "contiguous" \
            else make_losses(shape[0], dtype, layout)
        eta = torch.tensor(0.3, dtype=acc, device=DEVICE)
        mult = torch.tensor(0.9, dtype=torch.float64, device=DEVICE)
        args = (0.8, name, params.get("alpha"), params.get("k"), 1.1, order)
        got = torch.ops.dro_ext.psi_star_terms(t, eta, mult, *args)
        want = torch.ops.dro_ext.psi_star_terms(t.cpu(), eta.cpu(), mult.cpu(), *args)
        assert got.shape == t.shape and got.dtype == dtype and got.is_contiguous()
        torch.testing.assert_close(got.cpu(), want, **ref.tolerances(dtype))


def test_psi_star_and_weights_public_api_on_cuda():
    t = torch.linspace(-3, 3, 97, device=DEVICE)
    for name, params in ref.CASES:
        torch.testing.assert_close(dro_ext.psi_star(t, name, **params).cpu(),
                                   ref.psi_star(t.cpu().double(), name, **case_kwargs(params)).float(),
                                   rtol=2e-5, atol=2e-6)
        w = dro_ext.dro_weights(t, 0.2, 0.5, name, **params)
        assert on_test_device(w)
        torch.testing.assert_close(w.cpu(), dro_ext.dro_weights(t.cpu(), 0.2, 0.5, name, **params))


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32, torch.float64], ids=str)
def test_bitwise_deterministic_over_10_runs(dtype):
    losses = make_losses(2**20 + 5, dtype, "offset")
    eta = torch.tensor(0.2, device=DEVICE, requires_grad=True)
    for name, params in ref.CASES:
        runs = []
        for _ in range(10):
            l = losses.detach().requires_grad_()
            value = dro_ext.dro_loss(l, eta, 0.5, name, **params)
            g_l, g_eta = torch.autograd.grad(value, (l, eta))
            runs.append((value, g_l, g_eta))
        for run in runs[1:]:
            for a, b in zip(runs[0], run):
                assert torch.equal(a, b), name


@needs_cuda
def test_forward_and_backward_never_sync():
    losses = make_losses(100_001, torch.float32, "contiguous").requires_grad_()
    eta = torch.tensor(0.1, device=DEVICE, requires_grad=True)
    torch.cuda.synchronize()
    previous = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for name, params in ref.CASES:
            value = dro_ext.dro_loss(losses, eta, 0.5, name, **params)
            value.backward()
            w = dro_ext.dro_weights(losses.detach(), eta.detach(), 0.5, name, **params)
            del w
    finally:
        torch.cuda.set_sync_debug_mode(previous)
    assert losses.grad is not None and eta.grad is not None


@pytest.mark.parametrize("name,params", ref.CASES, ids=ref.CASE_IDS)
def test_dro_loss_module_with_a_mask_matches_cpu_and_never_syncs(name, params):
    """DROLoss()(losses, mask=): the CPU's value and gradients, with no host read on CUDA (the kept count stays on
    the device)."""
    gen = torch.Generator().manual_seed(5)
    losses = (1.0 + torch.randn(1001, generator=gen)).requires_grad_()
    keep = torch.rand(1001, generator=gen) < 0.7
    results = []
    for device in ("cpu", DEVICE):
        module = dro_ext.DROLoss(name, lam=0.5, eta_init=0.4, scale=1.2, **params).to(device)
        x = losses.detach().to(device).requires_grad_()
        mask = keep.to(device)
        checked = ON_CUDA and device != "cpu"
        if checked:
            torch.cuda.synchronize()
            torch.cuda.set_sync_debug_mode("error")
        try:
            value = module(x, mask=mask)
            grads = torch.autograd.grad(value, (x, module.eta))
        finally:
            if checked:
                torch.cuda.set_sync_debug_mode("default")
        results.append([value, *grads])
    for cpu, cuda in zip(*results):
        torch.testing.assert_close(cuda.cpu(), cpu, rtol=2e-5, atol=2e-6)


@needs_cuda
@pytest.mark.parametrize("name,params", [("chi2", {}), ("smoothed_cvar", {"alpha": 0.1}), ("cressie_read", {"k": 1.5})],
                         ids=["chi2", "smoothed_cvar", "cressie_read"])
def test_cuda_graph_capture_and_replay_match_eager(name, params):
    n = 65537
    static_losses = make_losses(n, torch.float32, "contiguous").requires_grad_()
    eta = torch.tensor(0.3, device=DEVICE, requires_grad=True)

    def step():
        value = dro_ext.dro_loss(static_losses, eta, 0.5, name, **params)
        g_l, g_eta = torch.autograd.grad(value, (static_losses, eta))
        return value, g_l, g_eta

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):  # warm up the caching allocator outside the capture
            step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = step()
    for trial in range(3):
        fresh = make_losses(n, torch.float32, "contiguous")
        with torch.no_grad():
            static_losses.copy_(fresh)
            eta.fill_(0.1 * trial)
        graph.replay()
        eager = step()
        for got, want in zip(static_out, eager):
            assert torch.equal(got, want)


@needs_cuda
def test_compile_reduce_overhead_training_step():
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1)).to(DEVICE)
    criterion = dro_ext.DROLoss("kl_cvar", lam=0.5, alpha=0.2, eta_init=0.1).to(DEVICE)
    x, y = torch.randn(4096, 8, device=DEVICE), torch.randn(4096, device=DEVICE)

    def loss_fn(x, y):
        return criterion((model(x).squeeze(1) - y) ** 2)

    eager = loss_fn(x, y)
    eager.backward()
    eager_grads = [p.grad.clone() for p in list(model.parameters()) + [criterion.eta]]
    compiled = torch.compile(loss_fn, mode="reduce-overhead", fullgraph=True)
    for _ in range(3):  # the first calls record the CUDA graph, later ones replay it
        for p in list(model.parameters()) + [criterion.eta]:
            p.grad = None
        loss = compiled(x, y)
        loss.backward()
        torch.testing.assert_close(loss, eager)
        for p, e in zip(list(model.parameters()) + [criterion.eta], eager_grads):
            torch.testing.assert_close(p.grad, e)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
@pytest.mark.parametrize("name,params", ref.CASES, ids=ref.CASE_IDS)
def test_opcheck_on_cuda(name, params, dtype):
    differentiable = dtype == torch.float64
    losses = (1 + torch.randn(65, dtype=torch.float64, device=DEVICE)).to(dtype).requires_grad_(differentiable)
    eta = torch.tensor(0.2, dtype=dtype, device=DEVICE, requires_grad=differentiable)
    torch.library.opcheck(torch.ops.dro_ext.dro_loss.default,
                          (losses, eta, 0.5, name, params.get("alpha"), params.get("k"), 1.5))
    mult = torch.tensor(0.7, dtype=dtype, device=DEVICE, requires_grad=True)
    for order in (0, 1, 2):
        torch.library.opcheck(torch.ops.dro_ext.psi_star_terms.default,
                              (losses.detach().requires_grad_(differentiable and order < 2),
                               eta.detach().requires_grad_(differentiable and order < 2), mult, 0.5, name,
                               params.get("alpha"), params.get("k"), 1.5, order))
    _, mean_w = torch.ops.dro_ext.dro_loss(losses.detach(), eta.detach(), 0.5, name, params.get("alpha"),
                                           params.get("k"), 1.5)
    torch.library.opcheck(torch.ops.dro_ext.dro_loss_backward.default,
                          (torch.tensor(1.0, dtype=dtype, device=DEVICE), losses.detach(), eta.detach(), mean_w,
                           0.5, name, params.get("alpha"), params.get("k"), 1.5))


def test_gradcheck_float64_on_cuda():
    for name, params in ref.CASES:
        losses = (1 + torch.randn(17, dtype=torch.float64, device=DEVICE)).requires_grad_()
        eta = torch.tensor(0.4, dtype=torch.float64, device=DEVICE, requires_grad=True)
        assert torch.autograd.gradcheck(lambda l, e: dro_ext.dro_loss(l, e, 0.6, name, **params), (losses, eta))


def test_nan_propagates():
    for name, params in ref.CASES:
        losses = torch.tensor([0.5, float("nan"), 1.0], device=DEVICE, requires_grad=True)
        value = dro_ext.dro_loss(losses, 0.1, 0.5, name, **params)
        assert torch.isnan(value).item(), name
        (g,) = torch.autograd.grad(value, losses)
        assert torch.isnan(g[1]).item(), name


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32, torch.float64], ids=str)
@pytest.mark.parametrize("bad", [float("inf"), float("-inf")], ids=["plus_inf", "minus_inf"])
@pytest.mark.parametrize("name,params", ref.CASES, ids=ref.CASE_IDS)
def test_infinite_loss_gives_the_limit_not_nan(name, params, bad, dtype):
    # 20001 samples: many blocks, of which one holds the infinity (value_term's per-element fallback). Not more:
    # float16 stores w / N, which near 2^-16 keeps only a few bits.
    lam, scale = 0.7, 1.3
    losses = make_losses(20001, dtype, "contiguous")
    losses[12345] = bad
    losses.requires_grad_()
    eta = torch.tensor(0.6, device=DEVICE, requires_grad=True)
    value = dro_ext.dro_loss(losses, eta, lam, name, scale=scale, **params)
    grads = torch.autograd.grad(value, (losses, eta))
    ref.assert_matches_one_infinite(value, grads, losses.cpu(), eta, lam, name, 12345, scale=scale,
                                    **case_kwargs(params))


def test_bad_inputs_name_the_argument():
    losses = torch.randn(5, device=DEVICE)
    if ON_CUDA:  # (under the CPU emulation the CPU is the device)
        with pytest.raises(ValueError, match="eta"):
            torch.ops.dro_ext.dro_loss(losses, torch.tensor(0.1), 0.5, "chi2")  # eta on the CPU
    with pytest.raises(ValueError, match="lam"):
        torch.ops.dro_ext.dro_loss(losses, torch.tensor(0.1, device=DEVICE), -1.0, "chi2")
    with pytest.raises(ValueError, match="alpha"):
        torch.ops.dro_ext.dro_loss(losses, torch.tensor(0.1, device=DEVICE), 0.5, "cvar")
    with pytest.raises(ValueError, match="losses"):
        torch.ops.dro_ext.dro_loss(losses.reshape(5, 1), torch.tensor(0.1, device=DEVICE), 0.5, "chi2")
    with pytest.raises(TypeError, match="losses"):
        torch.ops.dro_ext.dro_loss(torch.ones(5, dtype=torch.int32, device=DEVICE),
                                   torch.tensor(0.1, device=DEVICE), 0.5, "chi2")
    with pytest.raises(ValueError, match="order"):
        torch.ops.dro_ext.psi_star_terms(losses, torch.tensor(0.1, device=DEVICE), torch.tensor(1.0, device=DEVICE),
                                         0.5, "chi2", None, None, 1.0, 3)


@needs_cuda
def test_runs_on_the_tensors_device_and_current_stream():
    if torch.cuda.device_count() > 1:
        losses = make_losses(1000, torch.float32, "contiguous", device="cuda:1")
        value = dro_ext.dro_loss(losses, torch.tensor(0.1, device="cuda:1"), 0.5, "kl")
        assert value.device == losses.device
    stream = torch.cuda.Stream()
    losses = make_losses(1000, torch.float32, "contiguous")
    eta = torch.tensor(0.1, device=DEVICE)
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        value = dro_ext.dro_loss(losses, eta, 0.5, "kl")
    torch.cuda.current_stream().wait_stream(stream)
    torch.testing.assert_close(value.cpu(), dro_ext.dro_loss(losses.cpu(), eta.cpu(), 0.5, "kl"))
