"""The fused DRO loss, its weights and psi*: against float64 autograd references, on both backends."""
import math
import os
import pathlib
import sys

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import dro_ext
import reference as ref
from reference import DTYPES, case_kwargs
from dro_ext import _backend

SIZES = [1, 7, 1000, 65537]


def random_losses(n, dtype, spread=1.0):
    # Per-sample losses around 1 with a spread that puts t = (l - eta)/lam on both sides of every kink.
    return (1.0 + spread * torch.randn(n, dtype=torch.float64)).to(dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("name,params", ref.CASES, ids=ref.CASE_IDS)
def test_loss_and_gradients_match_float64_reference(backend, name, params, n, dtype):
    lam, scale = 0.7, 1.3
    losses = random_losses(n, dtype).requires_grad_()
    eta = torch.tensor(0.6, requires_grad=True)  # a float32 parameter, as DROLoss makes it
    value = dro_ext.dro_loss(losses, eta, lam, name, scale=scale, **params)
    assert value.dtype == dtype and value.dim() == 0
    grad_l, grad_eta = torch.autograd.grad(value, (losses, eta))
    assert grad_l.dtype == dtype and grad_eta.dtype == torch.float32

    # The reference sees exactly the rounded inputs the op saw.
    e64 = eta.detach().double().requires_grad_()
    expected = ref.dro_loss(losses.detach().double(), e64, lam, name, scale=scale, **case_kwargs(params))
    (exp_eta,) = torch.autograd.grad(expected, e64)

    tol = ref.tolerances(dtype)
    torch.testing.assert_close(value.double(), expected, **tol)
    # grad_l = w/N: compare w, which is O(1), allowing for what rounding t and storing w/N can move it by.
    ref.assert_weights_close(grad_l.double() * n, losses, eta, lam, name, scale=scale, **case_kwargs(params))
    eta_tol = ref.tolerances(torch.float32) if dtype != torch.float64 else dict(rtol=1e-6, atol=1e-6)
    if dtype in (torch.float16, torch.bfloat16):
        eta_tol = dict(rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(grad_eta.double(), exp_eta, **eta_tol)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("name,params", ref.CASES, ids=ref.CASE_IDS)
def test_weights_are_the_loss_gradient_times_n(backend, name, params, dtype):
    n = 513
    losses = random_losses(n, dtype).requires_grad_()
    eta, lam = torch.tensor(0.8), 0.5
    w = dro_ext.dro_weights(losses, eta, lam, name, **params)
    assert w.shape == (n,) and w.dtype == dtype
    (grad_l,) = torch.autograd.grad(dro_ext.dro_loss(losses, eta, lam, name, **params), losses)
    torch.testing.assert_close(w.double(), grad_l.double() * n, **ref.tolerances(dtype))
    assert (w.double() >= 0).all()


@pytest.mark.parametrize("name,params", ref.CASES, ids=ref.CASE_IDS)
def test_psi_star_matches_numerical_conjugate_of_psi(backend, name, params):
    """psi* derived from psi by sup_s (s t - psi(s)), and psi*' as the maximizing s (envelope theorem)."""
    alpha, k = params.get("alpha"), params.get("k")
    ts = torch.linspace(-4.0, 2.5, 27, dtype=torch.float64)
    values = dro_ext.psi_star(ts, name, alpha=alpha, k=k)
    weights = dro_ext.dro_weights(ts, 0.0, 1.0, name, alpha=alpha, k=k)
    for t, v, w in zip(ts.tolist(), values.tolist(), weights.tolist()):
        conj, argmax = ref.numerical_conjugate(t, name, alpha, k)
        assert v == pytest.approx(conj, abs=1e-7, rel=1e-7), (t, v, conj)
        if not (name == "cvar" and abs(t) < 1e-9):  # the cvar argmax is a whole interval at t == 0
            assert w == pytest.approx(argmax, abs=2e-4, rel=2e-4), (t, w, argmax)


@pytest.mark.parametrize("shape", [(), (1,), (3, 5), (2, 3, 4)])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("name,params", ref.CASES, ids=ref.CASE_IDS)
def test_psi_star_elementwise_any_shape(backend, name, params, dtype, shape):
    t = (2 * torch.randn(shape, dtype=torch.float64)).to(dtype)
    out = dro_ext.psi_star(t, name, **params)
    assert out.shape == t.shape and out.dtype == dtype
    expected = ref.psi_star(t.double(), name, **case_kwargs(params))
    torch.testing.assert_close(out.double(), expected, **ref.tolerances(dtype))


@pytest.mark.parametrize("name,params", ref.CASES, ids=ref.CASE_IDS)
def test_gradcheck_float64(backend, name, params):
    losses = random_losses(7, torch.float64).requires_grad_()
    eta = torch.tensor(0.5, dtype=torch.float64, requires_grad=True)

    def loss(l, e):
        return dro_ext.dro_loss(l, e, 0.8, name, scale=1.5, **params)

    def weights(l, e):
        return dro_ext.dro_weights(l, e, 0.8, name, scale=1.5, **params)

    assert torch.autograd.gradcheck(loss, (losses, eta))
    assert torch.autograd.gradcheck(weights, (losses, eta))
    # Second derivatives of the loss (Hessian-vector products) go through psi*''.
    assert torch.autograd.gradgradcheck(loss, (losses, eta))


def test_non_contiguous_losses(backend):
    base = random_losses(2 * 1001, torch.float32).reshape(1001, 2)
    strided = base[:, 1]
    assert not strided.is_contiguous()
    for name, params in ref.CASES:
        a = dro_ext.dro_loss(strided, 0.3, 0.5, name, **params)
        b = dro_ext.dro_loss(strided.contiguous(), 0.3, 0.5, name, **params)
        assert torch.equal(a, b)
        wa = dro_ext.dro_weights(strided, 0.3, 0.5, name, **params)
        assert torch.equal(wa, dro_ext.dro_weights(strided.contiguous(), 0.3, 0.5, name, **params))
    leaf = strided.clone().requires_grad_()
    grad_strided = torch.zeros(1001, 2)
    view = grad_strided[:, 1]
    view.copy_(leaf.detach())
    view.requires_grad_()
    (g,) = torch.autograd.grad(dro_ext.dro_loss(view, 0.3, 0.5, "kl"), view)
    (g_ref,) = torch.autograd.grad(dro_ext.dro_loss(leaf, 0.3, 0.5, "kl"), leaf)
    torch.testing.assert_close(g, g_ref)


def test_nan_propagates_never_dropped(backend):
    for name, params in ref.CASES:
        losses = random_losses(100, torch.float32)
        losses[17] = float("nan")
        losses.requires_grad_()
        eta = torch.tensor(0.0, requires_grad=True)
        value = dro_ext.dro_loss(losses, eta, 0.5, name, **params)
        assert torch.isnan(value), name
        w = dro_ext.dro_weights(losses.detach(), 0.0, 0.5, name, **params)
        assert torch.isnan(w[17]) and not torch.isnan(torch.cat([w[:17], w[18:]])).any(), name
        grad_l, grad_eta = torch.autograd.grad(value, (losses, eta))
        assert torch.isnan(grad_l[17]) and torch.isnan(grad_eta), name
        assert torch.isnan(dro_ext.psi_star(torch.tensor([float("nan")]), name, **params)).all(), name


@pytest.mark.parametrize("name,params", ref.CASES, ids=ref.CASE_IDS)
def test_nan_propagates_through_the_weights_gradient_and_second_derivatives(backend, name, params):
    # The fallback dropped a NaN loss from the gradient of the weights of kl_cvar (torch.clamp's gradient is 0 at
    # NaN) and, for every divergence built on its NaN-keeping select, from the loss's second derivatives (the select's
    # NaN lane had a second derivative of 2).
    losses = random_losses(9, torch.float64)
    losses[4] = float("nan")
    losses.requires_grad_()
    eta = torch.tensor(0.2, dtype=torch.float64, requires_grad=True)
    weights = dro_ext.dro_weights(losses, eta, 0.5, name, **params)
    grad_l, grad_eta = torch.autograd.grad(weights[4], (losses, eta))
    assert torch.isnan(grad_l[4]) and torch.isnan(grad_eta), (grad_l, grad_eta)
    value = dro_ext.dro_loss(losses, eta, 0.5, name, **params)
    (grad_l,) = torch.autograd.grad(value, losses, create_graph=True)
    curvature_l, curvature_eta = torch.autograd.grad(grad_l[4], (losses, eta))
    assert torch.isnan(curvature_l[4]) and torch.isnan(curvature_eta), (curvature_l, curvature_eta)


@pytest.mark.parametrize("alpha", [0.1, 0.5, 0.95])
def test_smoothed_cvar_second_derivative_at_a_loss_equal_to_g_eta(backend, alpha):
    # t = 0 exactly (a hinge loss of 0 at the default eta of 0): psi*''(0) = 1 - alpha. The fallback took psi*(t)
    # as expm1(t) there (the value to the last bit, but with a curvature of 1: 20x off at alpha = 0.95).
    losses = torch.tensor([0.0, 0.7, 1.3], dtype=torch.float64, requires_grad=True)
    eta = torch.tensor(0.0, dtype=torch.float64, requires_grad=True)
    lam = 0.5
    value = dro_ext.dro_loss(losses, eta, lam, "smoothed_cvar", alpha=alpha)
    (grad_l,) = torch.autograd.grad(value, losses, create_graph=True)
    curvature_l, curvature_eta = torch.autograd.grad(grad_l[0], (losses, eta))
    want = (1.0 - alpha) / (lam * 3)
    torch.testing.assert_close(curvature_l[0].item(), want, rtol=1e-12, atol=0)
    torch.testing.assert_close(curvature_eta.item(), -want, rtol=1e-12, atol=0)


def test_smoothed_cvar_weight_gradient_at_a_tiny_alpha_in_float32(backend):
    # psi*''(t) = (1 - alpha) q / s^2 with q = e^-|t| and s of about alpha: s^2 underflowed float32 below alpha
    # ~ 1e-19 (NaN, or 2% off). The exact value is sigmoid(u) sigmoid(-u) / alpha with u = t + log(alpha / (1 - alpha)).
    # (Past t ~ 87, q itself is below float32's normal range: not covered.)
    alpha, lam = 1e-30, 1.0
    losses = torch.tensor([50.0, 69.0, 80.0], requires_grad=True)
    weights = dro_ext.dro_weights(losses, 0.0, lam, "smoothed_cvar", alpha=alpha)
    (grad,) = torch.autograd.grad(weights.sum(), losses)
    u = losses.detach().double() / lam + math.log(alpha) - math.log1p(-alpha)
    want = torch.sigmoid(u) * torch.sigmoid(-u) / alpha / lam
    torch.testing.assert_close(grad.double(), want, rtol=1e-5, atol=0)


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32, torch.float64], ids=str)
@pytest.mark.parametrize("bad", [math.inf, -math.inf], ids=["plus_inf", "minus_inf"])
@pytest.mark.parametrize("name,params", ref.CASES, ids=ref.CASE_IDS)
def test_infinite_loss_gives_the_limit_not_nan(backend, name, params, bad, dtype):
    # 1500 samples: several of the native kernel's blocks, of which only the one holding the infinity is special.
    lam, scale, eta = 0.7, 1.3, torch.tensor(0.6, requires_grad=True)
    losses = random_losses(1500, dtype)
    losses[17] = bad
    losses.requires_grad_()
    value = dro_ext.dro_loss(losses, eta, lam, name, scale=scale, **params)
    grads = torch.autograd.grad(value, (losses, eta))
    ref.assert_matches_one_infinite(value, grads, losses, eta, lam, name, 17, scale=scale, **case_kwargs(params))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("k", [1.5, 3.0, 5.0])
def test_a_t_past_float32_with_a_weight_within_it(backend, k, dtype):
    # t = 1e10 / 1e-30 = 1e40 is no float32, but cressie_read's weight (1 + (k - 1) t)^(1/(k - 1)) is for k > 2
    # (about 1.4e20 at k = 3): the CPU map formed t in float32 and wrote inf; it now redoes the map in float64, as
    # the loss's sums are redone where float32 overflows (at k = 1.5 the weight overflows float32 itself: inf).
    lam = 1e-30
    losses = torch.tensor([1e10, 0.0, 3.0, 1e9], dtype=dtype).requires_grad_()
    eta = torch.tensor(0.0, requires_grad=True)
    value = dro_ext.dro_loss(losses, eta, lam, "cressie_read", k=k)
    grad_l, grad_eta = torch.autograd.grad(value, (losses, eta))
    weights = dro_ext.dro_weights(losses, eta, lam, "cressie_read", k=k)

    e64 = eta.detach().double().requires_grad_()
    expected = ref.dro_loss(losses.detach().double(), e64, lam, "cressie_read", k=k)
    (expected_grad_eta,) = torch.autograd.grad(expected, e64)
    t = (losses.detach().double() - e64.detach()) / lam
    # What the dtype holds: inf where the weight itself overflows it.
    expected_w = ref.psi_star_first(t, "cressie_read", k=k).to(dtype).double()
    assert torch.equal(torch.isinf(weights.double()), torch.isinf(expected_w))
    tol = ref.tolerances(dtype)
    torch.testing.assert_close(weights.double(), expected_w, **tol)
    torch.testing.assert_close(grad_l.double() * 4, expected_w, **tol)
    torch.testing.assert_close(value.double(), expected.detach().to(dtype).double(), **tol)
    torch.testing.assert_close(grad_eta.double(), expected_grad_eta.float().double(), **tol)


def test_psi_star_and_weights_at_infinity(backend):
    t = torch.tensor([-math.inf, math.inf], dtype=torch.float64, requires_grad=True)
    for name, params in ref.CASES:
        kwargs = case_kwargs(params)
        value = dro_ext.psi_star(t, name, **params)
        expected = ref.psi_star(t.detach(), name, **kwargs)
        assert expected[1] == math.inf and expected[0].isfinite(), name
        torch.testing.assert_close(value, expected, rtol=1e-12, atol=0.0)
        w = torch.tensor([ref.weight_at_infinity(s, name, **kwargs) for s in (-1.0, 1.0)], dtype=torch.float64)
        torch.testing.assert_close(dro_ext.dro_weights(t.detach(), 0.0, 1.0, name, **params), w)
        (slope,) = torch.autograd.grad(value.sum(), t)  # psi*'s gradient is the weight, infinities included
        torch.testing.assert_close(slope, w)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
@pytest.mark.parametrize("name,params", ref.CASES + [("cressie_read", {"k": 1.2}), ("cressie_read", {"k": 5.0})],
                         ids=ref.CASE_IDS + ["cressie_read-k1.2", "cressie_read-k5.0"])
def test_weight_gradient_at_infinity_is_the_limit(backend, name, params, dtype):
    # d w / d l = psi*''(t) / lam at a loss of +-inf: its limit, never NaN (the fallback's cressie_read at k > 2 formed
    # exp(p log1p(inf))'s gradient as inf * 0). A finite loss beside them keeps the same formula's finite lanes honest.
    lam = 0.5
    losses = torch.tensor([math.inf, -math.inf, 0.75], dtype=dtype, requires_grad=True)
    weights = dro_ext.dro_weights(losses, 0.25, lam, name, **params)
    (slope,) = torch.autograd.grad(weights.sum(), losses)
    kwargs = case_kwargs(params)
    at_infinity = [ref.weight_slope_at_infinity(s, name, **kwargs) / lam for s in (1.0, -1.0)]
    torch.testing.assert_close(slope[:2].double(), torch.tensor(at_infinity, dtype=torch.float64), rtol=1e-6, atol=0)
    t = torch.tensor((0.75 - 0.25) / lam, dtype=torch.float64, requires_grad=True)
    (first,) = torch.autograd.grad(ref.psi_star(t, name, **kwargs), t, create_graph=True)
    # cvar's psi*' is a constant past its kink, with no graph left to differentiate: psi*'' = 0.
    second = torch.autograd.grad(first, t)[0] if first.requires_grad else torch.zeros_like(t)
    torch.testing.assert_close(slope[2].double(), second / lam, **ref.tolerances(dtype))


def test_cvar_subgradient_is_zero_at_the_kink(backend):
    losses = torch.tensor([0.5, 1.0, 2.0])
    w = dro_ext.dro_weights(losses, 1.0, 0.5, "cvar", alpha=0.25)
    assert w.tolist() == [0.0, 0.0, 4.0]


def test_kl_overflow_is_inf_not_garbage(backend):
    # (l - eta)/lam = 100 > 88: exp overflows float32. The value and weight are inf, never NaN or finite junk.
    losses = torch.tensor([0.0, 10.0])
    value = dro_ext.dro_loss(losses, 0.0, 0.1, "kl")
    assert torch.isinf(value) and value > 0
    w = dro_ext.dro_weights(losses, 0.0, 0.1, "kl")
    assert w[0] == 1.0 and torch.isinf(w[1])


def test_smoothed_cvar_is_stable_for_large_and_small_t(backend):
    alpha = 0.02
    t = torch.tensor([-200.0, -30.0, 0.0, 30.0, 500.0, 1e4], dtype=torch.float32)
    out = dro_ext.psi_star(t, "smoothed_cvar", alpha=alpha).double()
    t64 = t.double()
    # log(1 - a + a e^t) = t + log(a) + log1p((1-a)/a e^-t) for large t, log(1-a) + log1p(a/(1-a) e^t) else.
    big = t64 + math.log(alpha) + torch.log1p((1 - alpha) / alpha * torch.exp(-t64))
    small = math.log1p(-alpha) + torch.log1p(alpha / (1 - alpha) * torch.exp(torch.clamp(t64, max=50)))
    expected = torch.where(t64 > 0, big, small) / alpha
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out, expected, rtol=1e-6, atol=1e-6)
    # The loss's reduction sums the same values (the native one multiplies the log1p factors over a block
    # and takes one log): over several blocks and a partial vector at the end.
    value = dro_ext.dro_loss(t.repeat(341), 0.0, 1.0, "smoothed_cvar", alpha=alpha).double()
    torch.testing.assert_close(value, expected.mean(), rtol=1e-6, atol=1e-6)
    w = dro_ext.dro_weights(t, 0.0, 1.0, "smoothed_cvar", alpha=alpha)
    assert torch.isfinite(w).all() and (w >= 0).all() and (w <= 1 / alpha + 1e-3).all()


def test_python_float_eta_gets_no_gradient_and_matches_tensor_eta(backend):
    losses = random_losses(50, torch.float32).requires_grad_()
    a = dro_ext.dro_loss(losses, 0.25, 0.5, "chi2")
    b = dro_ext.dro_loss(losses, torch.tensor(0.25), 0.5, "chi2")
    torch.testing.assert_close(a, b)
    (g,) = torch.autograd.grad(a, losses)
    assert g.shape == losses.shape


def test_deterministic_across_calls_and_thread_counts(backend):
    # Both backends repeat bitwise, across thread counts too: the native kernels and the fallback's sums take fixed
    # chunks (PyTorch's own sum of a long tensor splits it by the thread count).
    losses = random_losses(300_001, torch.float32)
    threads = torch.get_num_threads()
    thread_counts = (1, max(2, threads))
    try:
        results = []
        for n_threads in thread_counts:
            torch.set_num_threads(n_threads)
            for _ in range(2):
                results.append(dro_ext.dro_loss(losses, 0.1, 0.5, "smoothed_cvar", alpha=0.1))
    finally:
        torch.set_num_threads(threads)
    assert all(torch.equal(results[0], r) for r in results[1:])


def test_native_kernels_are_built_to_run_in_parallel():
    # at::parallel_for is an OpenMP region that ATen's headers inline into our own object code. Built
    # without -fopenmp it compiles to a serial loop: every kernel runs on one thread and no numerical test
    # notices. That shipped once (the warning was hidden by -Wno-unknown-pragmas); this pins the flag.
    if _backend._force_python:
        pytest.skip("DRO_EXT_FORCE_PYTHON=1: this run covers the fallback only")
    from dro_ext import _C

    assert b"GOMP_parallel" in pathlib.Path(_C.__file__).read_bytes()


def test_autograd_graph_rules(backend):
    # The native backward is a hand-written autograd node: it must keep the rules every PyTorch op keeps.
    losses = random_losses(50, torch.float32).requires_grad_()
    eta = torch.tensor(0.2, requires_grad=True)
    value = dro_ext.dro_loss(losses, eta, 0.5, "kl")
    assert value.grad_fn is not None
    value.backward()
    with pytest.raises(RuntimeError, match="second time"):  # saved tensors are freed after backward
        value.backward()

    value = dro_ext.dro_loss(losses * 1, eta, 0.5, "kl")
    (g_eta,) = torch.autograd.grad(value, eta)  # only eta asked for
    weights = dro_ext.dro_weights(losses.detach(), eta.detach(), 0.5, "kl").double()
    torch.testing.assert_close(g_eta.double(), 1 - weights.mean(), rtol=1e-5, atol=1e-6)

    if backend == "native":  # the native backward reads the losses again, so it must see them unchanged
        mutated = losses * 1
        value = dro_ext.dro_loss(mutated, eta, 0.5, "kl")
        with torch.no_grad():
            mutated.add_(1.0)
        with pytest.raises(RuntimeError, match="inplace"):
            value.backward()

    with torch.no_grad():
        assert dro_ext.dro_loss(losses, eta, 0.5, "kl").grad_fn is None


def test_forward_mode_ad(backend):
    import torch.autograd.forward_ad as fwAD

    losses = random_losses(7, torch.float64)
    eta = torch.tensor(0.3, dtype=torch.float64)
    tangent = torch.randn(7, dtype=torch.float64)
    with fwAD.dual_level():
        dual = fwAD.make_dual(losses, tangent)
        if backend == "native":
            with pytest.raises(RuntimeError, match="forward-mode AD"):
                dro_ext.dro_loss(dual, eta, 0.5, "kl")
            return
        jvp = fwAD.unpack_dual(dro_ext.dro_loss(dual, eta, 0.5, "kl")).tangent
    weights = dro_ext.dro_weights(losses, eta, 0.5, "kl")
    torch.testing.assert_close(jvp, (weights * tangent).mean())


def test_bad_scalars_are_rejected_after_good_ones(backend):
    # The Python numbers are validated once per distinct value; a bad value must still fail every time.
    losses = random_losses(5, torch.float32)
    eta = torch.tensor(0.0)
    dro_ext.dro_loss(losses, eta, 0.5, "cvar", alpha=0.1)
    for _ in range(2):
        with pytest.raises(ValueError, match="lam"):
            dro_ext.dro_loss(losses, eta, float("nan"), "cvar", alpha=0.1)
        with pytest.raises(TypeError, match="alpha"):
            dro_ext.dro_loss(losses, eta, 0.5, "cvar", alpha=[0.1])
        with pytest.raises(TypeError, match="lam"):
            dro_ext.dro_loss(losses, eta, torch.tensor(0.5), "cvar", alpha=0.1)


def test_bad_scalars_are_rejected_whatever_was_accepted_before(backend):
    # 0.1 + 0j == 0.1 and True == 1 (and hash alike): neither may pass as the number once that number was checked,
    # nor may a string that float() would take.
    losses = random_losses(5, torch.float32)
    eta = torch.tensor(0.0)
    for lam in (0.1, 1):
        dro_ext.dro_loss(losses, eta, lam, "chi2")
    for bad in (0.1 + 0j, True, "0.1"):
        with pytest.raises(TypeError, match="lam must be a real number"):
            dro_ext.dro_loss(losses, eta, bad, "chi2")
    dro_ext.dro_loss(losses, eta, 0.5, "cvar", alpha=0.5)
    with pytest.raises(TypeError, match="alpha must be a real number"):
        dro_ext.dro_loss(losses, eta, 0.5, "cvar", alpha=0.5 + 0j)
    with pytest.raises(TypeError, match="eta_init"):
        dro_ext.DROLoss("chi2", lam=0.1, eta_init="x")


@pytest.mark.parametrize("name,params,below", [("chi2", {}, -3.0), ("cvar", {"alpha": 0.3}, 0.0),
                                               ("cressie_read", {"k": 3.0}, -0.6)])
def test_samples_of_weight_zero_get_a_gradient_of_exactly_zero(backend, name, params, below):
    # A sample on psi*'s flat side (w = 0) has dL/dl = 0, not 1/N minus lam (1/N) / lam rounded (-7.45e-9 once).
    lam = 10.0
    losses = torch.tensor([5.0, 2.0, 1.0, 7.0, 3.0, 0.5, 4.0, 6.0, lam * below], requires_grad=True)
    eta = torch.tensor(0.0, requires_grad=True)
    (grad,) = torch.autograd.grad(dro_ext.dro_loss(losses, eta, lam, name, **params), losses)
    weights = dro_ext.dro_weights(losses.detach(), eta, lam, name, **params)
    assert weights[-1].item() == 0.0
    assert grad[-1].item() == 0.0


def test_mixed_eta_dtype_and_double_losses(backend):
    losses = random_losses(33, torch.float64).requires_grad_()
    eta = torch.tensor(0.4, dtype=torch.float32, requires_grad=True)
    value = dro_ext.dro_loss(losses, eta, 0.5, "kl")
    assert value.dtype == torch.float64
    grads = torch.autograd.grad(value, (losses, eta))
    assert grads[0].dtype == torch.float64 and grads[1].dtype == torch.float32


@pytest.mark.parametrize("eta_dtype, eta_value, scale", ref.SHIFTS_FLOAT32_DOES_NOT_HOLD, ids=ref.SHIFT_IDS)
@pytest.mark.parametrize("name,params", ref.CASES, ids=ref.CASE_IDS)
def test_a_shift_float32_does_not_hold_is_not_rounded_to_it(backend, name, params, eta_dtype, eta_value, scale):
    check_shift_float32_does_not_hold(name, params, eta_dtype, eta_value, scale, "cpu")


def check_shift_float32_does_not_hold(name, params, eta_dtype, eta_value, scale, device):
    """The value, the weights and both gradients over ref.losses_near_a_shift_float32_does_not_hold()."""
    kw = case_kwargs(params)
    losses = ref.losses_near_a_shift_float32_does_not_hold().to(device).requires_grad_()
    eta = torch.tensor(eta_value, dtype=eta_dtype, device=device, requires_grad=True)
    value = dro_ext.dro_loss(losses, eta, ref.LAM_BELOW_THE_SHIFTS_SPACING, name, scale=scale, **kw)
    grad_l, grad_eta = torch.autograd.grad(value, (losses, eta))
    weights = dro_ext.dro_weights(losses, eta, ref.LAM_BELOW_THE_SHIFTS_SPACING, name, scale=scale, **kw)
    for what, w in (("w", weights), ("N dL/dl", grad_l * losses.numel())):
        ref.assert_exact_at_a_shift_float32_does_not_hold(what, value.cpu(), w.cpu(), grad_eta.cpu(), losses.cpu(),
                                                          eta.cpu(), name, scale, **kw)


BAD_INPUTS = [
    (dict(divergence="hellinger"), ValueError, "unknown divergence"),
    (dict(lam=0.0), ValueError, "lam"),
    (dict(lam=-1.0), ValueError, "lam"),
    (dict(lam=float("inf")), ValueError, "lam"),
    (dict(scale=0.0), ValueError, "scale"),
    (dict(divergence="cvar"), ValueError, "alpha"),
    (dict(divergence="cvar", alpha=1.0), ValueError, "alpha"),
    (dict(divergence="kl_cvar", alpha=0.0), ValueError, "alpha"),
    (dict(divergence="smoothed_cvar", alpha=-0.5), ValueError, "alpha"),
    (dict(divergence="cressie_read"), ValueError, "k"),
    (dict(divergence="cressie_read", k=1.0), ValueError, "k"),
    (dict(divergence="cressie_read", k=0.5), ValueError, "k"),
    (dict(losses=torch.ones(2, 3)), ValueError, "1-D"),
    (dict(losses=torch.ones(())), ValueError, "1-D"),
    (dict(losses=torch.ones(0)), ValueError, "empty"),
    (dict(losses=torch.ones(4, dtype=torch.int64)), TypeError, "floating"),
    # (float8 is floating to torch, but the kernels have none: the fallback computed in it, the native op failed
    # inside its dispatch macro)
    (dict(losses=torch.ones(4).to(torch.float8_e4m3fn)), TypeError, "losses must have a floating dtype"),
    (dict(eta=torch.tensor(0.0).to(torch.float8_e5m2)), TypeError, "eta must have a floating"),
    (dict(eta=torch.ones(1)), ValueError, "eta must be a 0-d"),
    (dict(eta=torch.tensor(1)), TypeError, "eta must have a floating"),
    (dict(eta=torch.tensor(0.0, device="meta")), ValueError, "same device"),
    (dict(losses=torch.ones(4).to_sparse()), TypeError, "losses must be a dense"),
    (dict(lam=True), TypeError, "lam must be a real number"),
    (dict(lam="0.5"), TypeError, "lam must be a real number"),
    (dict(lam=0.5 + 0j), TypeError, "lam must be a real number"),
    (dict(divergence="cvar", alpha=True), TypeError, "alpha must be a real number"),
    (dict(lam=10**400), ValueError, "lam must be within float64's range"),  # (float() raised OverflowError)
]


@pytest.mark.parametrize("fn", [dro_ext.dro_loss, dro_ext.dro_weights])
@pytest.mark.parametrize("override,exc,match", BAD_INPUTS)
def test_bad_input_names_the_argument(backend, fn, override, exc, match):
    args = dict(losses=torch.ones(4), eta=torch.tensor(0.0), lam=0.5, divergence="chi2")
    args.update(override)
    kwargs = {k: args.pop(k) for k in ("alpha", "k", "scale") if k in args}
    with pytest.raises(exc, match=match):
        fn(args["losses"], args["eta"], args["lam"], args["divergence"], **kwargs)


@pytest.mark.skipif(not _backend.native_available(), reason="native extension not built")
@pytest.mark.parametrize("override,match", [
    (dict(divergence="hellinger"), "unknown divergence"),
    (dict(lam=0.0), "lam"),
    (dict(divergence="cvar", alpha=None), "alpha"),
    (dict(divergence="cressie_read", k=1.0), "k"),
    (dict(losses=torch.ones(2, 2)), "1-D"),
    (dict(losses=torch.ones(0)), "empty"),
    (dict(eta=torch.ones(2)), "eta"),
    (dict(losses=torch.ones(4).to(torch.float8_e4m3fn)), "losses must have a floating dtype"),
])
def test_native_op_checks_its_own_arguments(override, match):
    """Called directly through torch.ops (bypassing the Python checks), the op still names the argument."""
    args = dict(losses=torch.ones(4), eta=torch.tensor(0.0), lam=0.5, divergence="chi2", alpha=None, k=None)
    args.update(override)
    with pytest.raises((ValueError, TypeError, RuntimeError), match=match):
        torch.ops.dro_ext.dro_loss(args["losses"], args["eta"], args["lam"], args["divergence"], args["alpha"], args["k"])


def _calls_taking_lam():
    """Every public call that takes lam, as lam -> its result (the native ops among them). The training objectives
    with cvar, linear in t: chi2's t^2 overflows float64 at such a lam (a documented limit), cvar's value is exact."""
    losses, eta, ids = torch.tensor([0.5, 1.0, 2.0], dtype=torch.float64), torch.tensor(1.0, dtype=torch.float64), \
        torch.tensor([0, 1, 1])
    logits, targets = torch.randn(3, 4, dtype=torch.float64), torch.tensor([0, 3, 1])
    hidden, weight = torch.randn(3, 2, dtype=torch.float64), torch.randn(4, 2, dtype=torch.float64)
    model = torch.nn.Identity()
    calls = {
        "dro_loss": lambda lam: dro_ext.dro_loss(losses, eta, lam, "cvar", alpha=0.5),
        "dro_weights": lambda lam: dro_ext.dro_weights(losses, eta, lam, "chi2"),
        "robust_objective": lambda lam: dro_ext.robust_objective(losses, lam, "chi2"),
        "worst_case_weights": lambda lam: dro_ext.worst_case_weights(losses, lam, "kl"),
        "robust_objective over groups": lambda lam: dro_ext.robust_objective(losses, lam, groups=ids, num_groups=2),
        "weight_stats": lambda lam: dro_ext.weight_stats(losses=losses, lam=lam),
        "evaluate": lambda lam: dro_ext.evaluate(model, [losses], lambda m, b: m(b), lam, progress=False),
        "DROLoss": lambda lam: dro_ext.DROLoss("cvar", lam, alpha=0.5)(losses),
        "group_dro_loss": lambda lam: dro_ext.group_dro_loss(losses, ids, 2, eta, lam, "cvar", alpha=0.5),
        "dro_cross_entropy": lambda lam: dro_ext.dro_cross_entropy(logits, targets, eta, lam, "cvar", alpha=0.5),
        "dro_linear_cross_entropy": lambda lam: dro_ext.dro_linear_cross_entropy(hidden, weight, targets, eta, lam,
                                                                                 "cvar", alpha=0.5),
        "DROCrossEntropyLoss": lambda lam: dro_ext.DROCrossEntropyLoss("cvar", lam, alpha=0.5)(logits, targets),
    }
    if _backend.native_available():
        calls["native dro_loss"] = lambda lam: torch.ops.dro_ext.dro_loss(losses, eta, lam, "chi2", None, None)
        calls["native robust_objective"] = lambda lam: torch.ops.dro_ext.robust_objective(losses, lam, "kl", None,
                                                                                            None)
    return calls


@pytest.mark.parametrize("call", list(_calls_taking_lam()))
def test_a_lam_below_the_smallest_normal_double_is_refused(backend, call):
    """A subnormal lam passed 'lam > 0': the kernels multiply by 1/lam, inf there, and t = 0 * inf made the value NaN
    at a loss equal to the shift (the robust objective NaN for chi2, kl and cressie_read; the fallback's cvar inf).
    Every call refuses it, naming lam; the smallest normal double itself is taken, with no NaN (below the README's
    range, 1e-300, an intermediate such as t / alpha may overflow to inf, which says so)."""
    fn = _calls_taking_lam()[call]
    for lam in (1e-310, 5e-324, sys.float_info.min / 2):
        with pytest.raises(ValueError, match=r"lam must be a finite number > 0 \(and no smaller than "
                                             r"2\.2250738585072014e-308"):
            fn(lam)
    result = fn(sys.float_info.min)
    values = [t for t in (result if isinstance(result, tuple) else (result,)) if isinstance(t, torch.Tensor)]
    assert values and not any(bool(torch.isnan(t).any()) for t in values if t.is_floating_point()), result


@pytest.mark.parametrize("grouped", [False, True], ids=["samples", "groups"])
def test_dro_loss_module_with_a_parametrized_eta(backend, grouped):
    # torch.nn.utils.parametrize moves eta out of the parameter dict (the forward read it there: KeyError); the
    # loss is then the one at the parametrized eta, with its gradient to the raw parameter.
    import torch.nn.utils.parametrize as parametrize

    class Softplus(torch.nn.Module):
        def forward(self, x):
            return torch.nn.functional.softplus(x)

    options, args = (dict(num_groups=3), (torch.tensor([0, 1, 2, 0, 1]),)) if grouped else ({}, ())
    module = dro_ext.DROLoss("chi2", 0.5, eta_init=0.3, **options)
    parametrize.register_parametrization(module, "eta", Softplus())
    losses = random_losses(5, torch.float64)
    value = module(losses, *args)
    raw = module.parametrizations.eta.original
    eta = torch.nn.functional.softplus(raw.detach().double()).requires_grad_()
    expected = (dro_ext.group_dro_loss(losses, args[0], 3, eta, 0.5, "chi2") if grouped
                else dro_ext.dro_loss(losses, eta, 0.5, "chi2"))
    torch.testing.assert_close(value.double(), expected.detach(), rtol=1e-6, atol=1e-7)
    (grad,) = torch.autograd.grad(value, raw)
    (grad_eta,) = torch.autograd.grad(expected, eta)
    torch.testing.assert_close(grad.double(), grad_eta * torch.sigmoid(raw.detach().double()), rtol=1e-6, atol=1e-7)


def test_dro_loss_module(backend):
    module = dro_ext.DROLoss("smoothed_cvar", lam=0.5, alpha=0.2, eta_init=0.3)
    assert isinstance(module.eta, torch.nn.Parameter) and module.eta.dim() == 0
    assert [n for n, _ in module.named_parameters()] == ["eta"]
    losses = random_losses(20, torch.float32).requires_grad_()
    value = module(losses)
    torch.testing.assert_close(value, dro_ext.dro_loss(losses, module.eta, 0.5, "smoothed_cvar", alpha=0.2))
    value.backward()
    assert module.eta.grad is not None and losses.grad is not None
    assert "smoothed_cvar" in repr(module) and "alpha=0.2" in repr(module)
    restored = dro_ext.DROLoss("smoothed_cvar", lam=0.5, alpha=0.2)
    restored.load_state_dict(module.state_dict())
    assert torch.equal(restored.eta, module.eta)
    with pytest.raises(ValueError, match="alpha"):
        dro_ext.DROLoss("cvar", lam=0.5)
    with pytest.raises(ValueError, match="lam"):
        dro_ext.DROLoss("chi2", lam=0.0)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("name,params", ref.CASES, ids=ref.CASE_IDS)
def test_dro_loss_module_with_a_mask_is_the_loss_of_the_kept_samples(backend, name, params, dtype):
    """DROLoss()(losses, mask=keep): the per-sample objective over the kept samples alone, against the float64
    formula on them; the others get a zero gradient, and a NaN among them is not read."""
    gen = torch.Generator().manual_seed(11)
    n = 37
    losses = (1.0 + torch.randn(n, generator=gen, dtype=torch.float64)).to(dtype)
    keep = torch.rand(n, generator=gen) < 0.6
    losses[~keep] = torch.where(torch.arange(n)[~keep] % 2 == 0, float("nan"), 1e30).to(dtype)  # padding's junk
    losses.requires_grad_()
    module = dro_ext.DROLoss(name, lam=0.7, scale=1.3, eta_init=0.6, **params)
    value = module(losses, mask=keep)
    assert value.dtype == dtype and value.dim() == 0
    grad_l, grad_eta = torch.autograd.grad(value, (losses, module.eta))
    e64 = module.eta.detach().double().requires_grad_()
    kept = losses.detach()[keep].double().requires_grad_()
    expected = ref.dro_loss(kept, e64, 0.7, name, scale=1.3, **case_kwargs(params))
    exp_l, exp_eta = torch.autograd.grad(expected, (kept, e64))
    tol = ref.tolerances(dtype) if dtype != torch.float64 else dict(rtol=1e-13, atol=1e-14)
    torch.testing.assert_close(value.double(), expected, **tol)
    torch.testing.assert_close(grad_l[keep].double(), exp_l, **tol)
    assert bool((grad_l[~keep] == 0).all())
    torch.testing.assert_close(grad_eta.double(), exp_eta, rtol=1e-6, atol=1e-6)


def test_dro_loss_module_with_a_mask_edge_cases(backend):
    """Every sample kept: the unmasked loss; none kept: 0 with zero gradients (a micro-batch of padding adds
    nothing); a bad mask names the argument; groups still needs num_groups."""
    losses = random_losses(9, torch.float64).requires_grad_()
    module = dro_ext.DROLoss("kl", lam=0.4, eta_init=0.2).double()
    torch.testing.assert_close(module(losses, mask=torch.ones(9, dtype=torch.bool)), module(losses),
                               rtol=1e-14, atol=0)
    none = module(losses, mask=torch.zeros(9, dtype=torch.bool))
    assert none.item() == 0.0
    grads = torch.autograd.grad(none, (losses, module.eta))
    assert all(bool((g == 0).all()) for g in grads)
    with pytest.raises(TypeError, match="mask must be a bool tensor"):
        module(losses, mask=torch.ones(9))
    with pytest.raises(ValueError, match="mask must have the shape"):
        module(losses, mask=torch.ones(8, dtype=torch.bool))
    with pytest.raises(ValueError, match="groups given, but this DROLoss was built without num_groups"):
        module(losses, torch.zeros(9, dtype=torch.long))
    compiled = torch.compile(module, fullgraph=True, backend="aot_eager")
    keep = torch.arange(9) % 3 != 0
    torch.testing.assert_close(compiled(losses, mask=keep), module(losses, mask=keep), rtol=1e-14, atol=0)
    torch.autograd.gradcheck(lambda x, e: torch.func.functional_call(module, {"eta": e}, (x,), {"mask": keep}),
                             (losses.detach().requires_grad_(), module.eta.detach().requires_grad_()))


def test_dro_loss_module_reads_eta_and_its_settings_on_every_call(backend):
    """forward reads eta from the module's parameters directly (not through nn.Module.__getattr__): a parameter
    swapped in by torch.func.functional_call (or FSDP) is the one used and differentiated, and settings changed on
    the module after construction are the ones the next call uses."""
    module = dro_ext.DROLoss("chi2", lam=0.5, eta_init=0.3).double()
    losses = random_losses(17, torch.float64)
    swapped = torch.tensor(1.25, dtype=torch.float64, requires_grad=True)
    value = torch.func.functional_call(module, {"eta": swapped}, (losses,))
    reference_eta = torch.tensor(1.25, dtype=torch.float64, requires_grad=True)
    expected = ref.dro_loss(losses, reference_eta, 0.5, "chi2")
    torch.testing.assert_close(value, expected)
    torch.testing.assert_close(torch.autograd.grad(value, swapped), torch.autograd.grad(expected, reference_eta))
    assert module.eta.grad is None
    module.lam, module.scale = 2.0, 3.0
    torch.testing.assert_close(module(losses), ref.dro_loss(losses, 0.3, 2.0, "chi2", scale=3.0))


class _TaggedTensor(torch.Tensor):
    """A tensor subclass that changes nothing: dro_loss checks it in Python before its native call."""


def test_a_tensor_subclass_takes_the_checked_call_to_the_same_loss(backend):
    """Plain tensors go straight to the native op (which checks them); a subclass passes the Python checks first:
    the same value and gradients, bitwise."""
    losses, eta = random_losses(19, torch.float32), torch.tensor(0.25)
    results = []
    for make in (lambda t: t, lambda t: t.as_subclass(_TaggedTensor)):
        l, e = make(losses).requires_grad_(), eta.clone().requires_grad_()
        value = dro_ext.dro_loss(l, e, 0.5, "kl_cvar", alpha=0.3, scale=2.0)
        results.append((value, *torch.autograd.grad(value, (l, e))))
    for plain, tagged in zip(*results):
        assert torch.equal(plain, tagged)
    with pytest.raises(TypeError, match="losses must be a torch.Tensor"):
        dro_ext.dro_loss(losses.tolist(), eta, 0.5)


@settings(max_examples=60, deadline=None)
@given(
    values=st.lists(st.floats(-50, 50, allow_nan=False), min_size=1, max_size=40),
    case=st.sampled_from(ref.CASES),
    lam=st.floats(0.05, 5.0),
    eta=st.floats(-5.0, 5.0),
)
def test_weights_nonnegative_and_monotone_in_the_loss(values, case, lam, eta):
    name, params = case
    losses = torch.tensor(sorted(values), dtype=torch.float64)
    for path in ("native", "python") if _backend.native_available() else ("python",):
        with _backend.forced_backend(path):
            w = dro_ext.dro_weights(losses, eta, lam, name, **params)
        assert (w >= 0).all()
        assert (w[1:] >= w[:-1]).all(), (path, w)


def test_autocast_and_torch_func(backend):
    x = torch.randn(16, 4)
    linear = torch.nn.Linear(4, 1)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        per_sample = linear(x).squeeze(1) ** 2
        value = dro_ext.dro_loss(per_sample, 0.0, 0.5, "chi2")
    assert value.dtype == per_sample.dtype
    value.float().backward()
    assert linear.weight.grad is not None

    losses = random_losses(9, torch.float64)
    eta = torch.tensor(0.3, dtype=torch.float64)
    grad_fn = torch.func.grad(lambda l, e: dro_ext.dro_loss(l, e, 0.5, "kl"), argnums=(0, 1))
    if backend == "native":
        # PyTorch (2.14) does not run functorch transforms through register_autograd formulas of custom
        # ops; it refuses loudly, which is what the README documents. Use the fallback for torch.func.
        with pytest.raises(RuntimeError, match="functorch"):
            grad_fn(losses, eta)
        return
    g_l, g_e = grad_fn(losses, eta)
    l64, e64 = losses.clone().requires_grad_(), eta.clone().requires_grad_()
    exp_l, exp_e = torch.autograd.grad(ref.dro_loss(l64, e64, 0.5, "kl"), (l64, e64))
    torch.testing.assert_close(g_l, exp_l)
    torch.testing.assert_close(g_e, exp_e)


def test_numpy_reference_sanity():
    # Guards the reference itself: the literal table agrees with the numerical conjugate.
    for name, params in ref.CASES:
        for t in (-3.0, -0.5, 0.7, 2.0):
            literal = ref.psi_star(torch.tensor(t, dtype=torch.float64), name, **case_kwargs(params)).item()
            assert np.isclose(literal, ref.numerical_conjugate(t, name, **case_kwargs(params))[0], atol=1e-7)


def test_large_outputs_never_share_live_memory(backend):
    # Outputs of 8 MiB and more come from a cache of freed buffers (csrc/cpu/output_buffer.h): a buffer may
    # only be handed out again once the tensor that owned it is gone.
    n = (1 << 21) + 3
    inputs = [random_losses(n, torch.float32) for _ in range(4)]
    live = [dro_ext.dro_weights(x, 0.2, 0.5, "chi2") for x in inputs[:3]]
    assert len({w.data_ptr() for w in live}) == 3
    snapshots = [w.clone() for w in live]
    del live[0]  # frees one buffer for reuse
    fresh = dro_ext.dro_weights(inputs[3], 0.2, 0.5, "chi2")
    for w, snap in zip(live, snapshots[1:]):
        assert torch.equal(w, snap)
    expected = torch.relu((inputs[3].double() - 0.2) / 0.5 + 2) / 2
    torch.testing.assert_close(fresh.double(), expected, rtol=2e-5, atol=2e-6)
    losses = inputs[0].clone().requires_grad_()
    for _ in range(3):  # the same N-sized gradient every step, as in training
        (g,) = torch.autograd.grad(dro_ext.dro_loss(losses, 0.2, 0.5, "chi2"), losses)
        torch.testing.assert_close(g.double() * n, torch.relu((losses.detach().double() - 0.2) / 0.5 + 2) / 2,
                                   rtol=2e-5, atol=5e-5)


def _resident_bytes() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def test_the_profiler_sees_the_large_outputs(backend):
    # The large outputs (8 MiB and up) come from the op's own buffer cache, not PyTorch's allocator: torch.profiler's
    # memory events, and the benchmarks' CPU peak memory built on them, saw none of them (a 2^21-sample gradient read
    # 0.04 MiB). The cache reports each buffer it hands out and takes back, as the allocator does.
    from torch.profiler import ProfilerActivity, profile

    losses = random_losses(1 << 22, torch.float32).requires_grad_()  # a 16 MiB gradient
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        (grad,) = torch.autograd.grad(dro_ext.dro_loss(losses, 0.2, 0.5, "chi2"), losses)
        del grad
    events = [e.self_cpu_memory_usage for e in prof.events() if e.self_cpu_memory_usage != 0]
    assert max(events) >= 16 << 20, max(events)
    assert sum(events) == 0  # every byte handed out was seen given back


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads the resident size from /proc/self/statm")
def test_the_output_buffer_cache_lets_go_of_a_size_no_longer_asked_for(backend):
    # The cache kept the first two buffers freed, of whatever size, for good: after a phase at a large N (a 500 MiB
    # gradient in one report) the process held them through every later, smaller step. It keeps the two most recently
    # freed ones, so a smaller size's buffers take their place. (The fallback allocates through torch: the same
    # bound holds.)
    large = random_losses(24 << 20, torch.float32)  # 96 MiB outputs
    small = random_losses(3 << 20, torch.float32)  # 12 MiB outputs
    before = _resident_bytes()
    first, second = dro_ext.dro_weights(large, 0.2, 0.5, "chi2"), dro_ext.dro_weights(large, 0.2, 0.5, "chi2")
    del first, second
    for _ in range(2):
        first, second = dro_ext.dro_weights(small, 0.2, 0.5, "chi2"), dro_ext.dro_weights(small, 0.2, 0.5, "chi2")
        del first, second
    held = _resident_bytes() - before
    assert held < (96 << 20), f"{held / 2**20:.0f} MiB still held after the large outputs were freed"
