"""Precision where the naive formulas lose it (the ERM limit and small t), on both paths (the `backend` fixture):

- the ERM limit: robust_objective and dro_loss at lam from 1e-6 to 1e30, against an mpmath reference of the
  literal formulas at 60 digits (where the cancellation of lam * psi*(t) + eta costs nothing);
- the small-t conjugates: psi*, psi*' and psi*'' near t = 0, relative to their size;
- cressie_read's powers: the pure-arithmetic exponents (k = 2, 1.5), general k, and k -> 1 (the KL limit);
- a parameter the divergence does not take is an error naming it.
"""
from __future__ import annotations

import math
from fractions import Fraction

import mpmath
import numpy as np
import pytest
import torch

import dro_ext
import reference as ref
from dro_ext import _backend

mp = mpmath.mp
mp.dps = 60

LAMS = (1e-6, 1e-2, 1.0, 1e2, 1e6, 1e30)
# Every divergence (tests/reference.py's table) plus cressie_read at k = 3, whose power 1/(k-1) = 1/2 has no
# pure-arithmetic path: the general log1p/expm1 form between the k = 2 and k = 3.5 cases.
CASES = ref.CASES + [("cressie_read", {"k": 3.0})]
CASE_IDS = ref.CASE_IDS + ["cressie_read-k3.0"]
# float64 input: 1e-9 relative; float32 input: 1e-4.
RTOL = {torch.float64: 1e-9, torch.float32: 1e-4}


# --------------------------------------------------------------------------------------------------
# The mpmath reference: docs/design.md section 1.3's table written literally, evaluated at 60 digits.
# --------------------------------------------------------------------------------------------------


def mp_psi_star(t, name, alpha=None, k=None, order=0):
    t = mp.mpf(t)
    if name == "chi2":
        u = max(t + 2, 0)
        return (u * u / 4 - 1, u / 2, mp.mpf(0.5) if u > 0 else mp.mpf(0))[order]
    if name == "kl":
        return mp.exp(t) - 1 if order == 0 else mp.exp(t)
    if name == "cvar":
        a = mp.mpf(alpha)
        return (max(t, 0) / a, (1 / a if t > 0 else mp.mpf(0)), mp.mpf(0))[order]
    if name == "kl_cvar":
        a = mp.mpf(alpha)
        cut = -mp.log(a)
        if t <= cut:
            return mp.exp(t) - 1 if order == 0 else mp.exp(t)
        return ((1 + t + mp.log(a)) / a - 1, 1 / a, mp.mpf(0))[order]
    if name == "cressie_read":
        k = mp.mpf(k)
        u = (k - 1) * t + 1
        if u <= 0:
            return -1 / k if order == 0 else mp.mpf(0)
        return ((u ** (k / (k - 1)) - 1) / k, u ** (1 / (k - 1)), u ** ((2 - k) / (k - 1)))[order]
    if name == "smoothed_cvar":
        a = mp.mpf(alpha)
        if order == 0:
            return mp.log(1 - a + a * mp.exp(t)) / a
        total = 1 - a + a * mp.exp(t)
        # psi*'' = p (1 - p) / alpha with p = alpha e^t / total, as (1 - alpha) e^t / total^2: 1 - p would keep only
        # the working precision's digits beyond those of e^-t (t = 130 left 9 of 60).
        return mp.exp(t) / total if order == 1 else (1 - a) * mp.exp(t) / (total * total)
    raise AssertionError(name)


def mp_loss(losses, eta, lam, name, alpha=None, k=None):
    """mean_i lam psi*((l_i - eta)/lam) + eta, literally."""
    lam, eta = mp.mpf(lam), mp.mpf(eta)
    return mp.fsum(lam * mp_psi_star((mp.mpf(v) - eta) / lam, name, alpha, k) for v in losses) / len(losses) + eta


def np_first(t, name, alpha=None, k=None):
    """psi*'(t) literally, in float64 numpy: only to locate eta* (see mp_robust)."""
    if name == "chi2":
        return np.maximum(t + 2, 0) / 2
    if name == "kl_cvar":
        return np.exp(np.minimum(t, -math.log(alpha)))
    if name == "cressie_read":
        with np.errstate(over="ignore"):
            return np.maximum((k - 1) * t + 1, 0) ** (1 / (k - 1))
    if name == "smoothed_cvar":
        with np.errstate(over="ignore"):
            return 1 / (alpha + (1 - alpha) * np.exp(-t))
    raise AssertionError(name)


def mp_robust(losses, lam, name, alpha=None, k=None):
    """Psi = min_eta L(eta): the tail mean (exact fractions) for cvar, the closed form for kl, else L at eta*.

    eta* is located by float64 bisection on mean psi*'((l - eta)/lam) = 1, and L evaluated there at 60
    digits. That suffices: L is stationary at eta*, L(eta* + d) = Psi + d^2 mean(psi*'')/(2 lam) + ..., and d is
    a rounding of eta (even at lam = 1e30, where float64 cannot tell psi*' from 1, d <= max l - min l
    moves L by ~1e-30)."""
    values = [float(v) for v in losses]
    n = len(values)
    if name == "cvar":
        tail = Fraction(alpha) * n
        top = sorted((Fraction(v) for v in values), reverse=True)
        whole = math.floor(tail)
        total = sum(top[:whole], Fraction(0)) + (tail - whole) * (top[whole] if whole < n else 0)
        return float(total / tail)
    lam_mp = mp.mpf(lam)
    if name == "kl":
        return lam_mp * mp.log(mp.fsum(mp.exp(mp.mpf(v) / lam_mp) for v in values) / n)
    x = np.array(values)
    lo, hi = x.min(), x.max()
    while True:
        mid = 0.5 * (lo + hi)
        if not lo < mid < hi:
            break
        if np.mean(np_first((x - mid) / lam, name, alpha, k)) > 1:
            lo = mid
        else:
            hi = mid
    return mp_loss(values, 0.5 * (lo + hi), lam, name, alpha, k)


def assert_close(actual, expected, rtol, what):
    actual, expected = float(actual), float(expected)
    assert math.isfinite(actual), f"{what}: got {actual}, expected {expected}"
    assert abs(actual - expected) <= rtol * abs(expected), (
        f"{what}: got {actual!r}, expected {expected!r} (relative error {abs(actual - expected) / abs(expected):.3g})")


def _losses(dtype, n=100):
    return torch.rand(n, dtype=torch.float64).to(dtype)


# --------------------------------------------------------------------------------------------------
# The ERM limit: robust_objective and dro_loss at every lam.
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["float64", "float32"])
@pytest.mark.parametrize("name,params", CASES, ids=CASE_IDS)
def test_robust_objective_at_every_lam(backend, name, params, dtype):
    losses = _losses(dtype)
    mean = losses.double().mean().item()
    for lam in LAMS:
        value, eta = dro_ext.robust_objective(losses, lam, name, **params)
        assert value.dtype == dtype
        expected = mp_robust(losses.tolist(), lam, name, **params)
        assert_close(value, expected, RTOL[dtype], f"{name} lam={lam}")
        if lam >= 1e6 and name != "cvar":
            # The ERM limit: Psi -> mean l, and eta* -> mean l for the divergences with a smooth psi*'.
            assert_close(value, mean, 1e3 * RTOL[dtype] if lam == 1e6 else RTOL[dtype], f"{name} lam={lam} vs mean")
            if lam == 1e30:
                assert_close(eta, mean, RTOL[dtype], f"{name} eta* lam={lam}")


def test_robust_objective_of_uniform_losses_at_huge_lam_is_their_mean(backend):
    # l = rand(100) at lam = 1e30 once gave 0.997 (kl), 0.0012 (kl_cvar, cressie_read) and 5.7e14 / -6.0e23
    # (smoothed_cvar, float64 / float32), where the cancellation of lam * psi*(t) + eta lost every digit; every one
    # must be mean(l).
    losses = torch.rand(100, dtype=torch.float64)
    mean = losses.mean().item()
    for name, params in [("kl", {}), ("kl_cvar", {"alpha": 0.1}), ("cressie_read", {"k": 2.0}),
                         ("smoothed_cvar", {"alpha": 0.1}), ("chi2", {})]:
        for dtype in (torch.float64, torch.float32):
            value, _ = dro_ext.robust_objective(losses.to(dtype), 1e30, name, **params)
            assert_close(value, losses.to(dtype).double().mean(), RTOL[dtype], f"{name} {dtype}")
        assert abs(dro_ext.robust_objective(losses, 1e30, name, **params)[0].item() - mean) <= 1e-15


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["float64", "float32"])
@pytest.mark.parametrize("name,params", CASES, ids=CASE_IDS)
def test_dro_loss_at_every_lam(backend, name, params, dtype):
    losses = _losses(dtype)
    values = losses.tolist()
    scale = 1.5
    for lam in LAMS:
        # eta at the top of the losses (every t <= 0, so kl never overflows), and for lam >= 1 also at the
        # bottom (t in [0, 1/lam]) and in the middle.
        etas = [max(values) / scale] + ([min(values) / scale, 0.3] if lam >= 1.0 else [])
        for eta in etas:
            eta_t = torch.tensor(eta, dtype=torch.float64 if dtype == torch.float64 else torch.float32)
            value = dro_ext.dro_loss(losses, eta_t, lam, name, scale=scale, **params)
            expected = mp_loss(values, mp.mpf(float(eta_t)) * mp.mpf(scale), lam, name, **params)
            # float32 accumulation of N = 100 terms, each with a few roundings.
            assert_close(value, expected, RTOL[dtype], f"{name} lam={lam} eta={eta}")


@pytest.mark.parametrize("name,params", CASES, ids=CASE_IDS)
def test_dro_loss_gradient_in_the_erm_limit(backend, name, params):
    # dL/deta = G (1 - mean psi*'): at lam = 1e30 and eta = mean l it is ~1e-30, and the weights are 1.
    losses = _losses(torch.float64).requires_grad_()
    eta = losses.detach().mean().clone().requires_grad_()
    value = dro_ext.dro_loss(losses, eta, 1e30, name, **params)
    grad_l, grad_eta = torch.autograd.grad(value, (losses, eta))
    if name == "cvar":  # lam cancels from cvar's L(eta) = mean (l - eta)_+ / alpha + eta
        expected = mp_loss(losses.tolist(), eta.item(), 1e30, name, **params)
        assert_close(value.detach(), expected, 1e-15, name)
        return
    assert_close(value.detach(), losses.detach().mean(), 1e-15, name)
    torch.testing.assert_close(grad_l, torch.full_like(grad_l, 1.0 / 100), rtol=1e-12, atol=0)
    assert abs(grad_eta.item()) <= 1e-12


# --------------------------------------------------------------------------------------------------
# Small t: psi*, psi*' and psi*'' relative to their size.
# --------------------------------------------------------------------------------------------------

SMALL_T = [0.0, 1e-30, -1e-30, 1e-12, -1e-12, 3e-7, -3e-7, 1e-3, -1e-3, 0.2, -0.2, 0.34, -0.35, 0.7, -0.7, 2.5, -2.5]


def _relative_errors(actual, expected):
    out = []
    for a, e in zip(actual, expected):
        e = float(e)
        out.append(abs(a - e) / abs(e) if e != 0 else abs(a))
    return max(out)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["float64", "float32"])
@pytest.mark.parametrize("name,params", CASES, ids=CASE_IDS)
def test_small_t_conjugates(backend, name, params, dtype):
    t = torch.tensor(SMALL_T, dtype=dtype)
    tol = {torch.float64: 1e-13, torch.float32: 2e-6}[dtype]
    ts = [float(v) for v in t]
    value = dro_ext.psi_star(t, name, **params)
    assert _relative_errors(value.tolist(), [mp_psi_star(v, name, order=0, **params) for v in ts]) <= tol
    # psi*' = dro_weights at eta = 0, lam = 1 (G = 1); psi*'' through the weights' autograd.
    tt = t.clone().requires_grad_()
    weights = dro_ext.dro_weights(tt, 0.0, 1.0, name, **params)
    assert _relative_errors(weights.tolist(), [mp_psi_star(v, name, order=1, **params) for v in ts]) <= tol
    (second,) = torch.autograd.grad(weights.sum(), tt)
    expected_second = [mp_psi_star(v, name, order=2, **params) for v in ts]
    if name == "cvar":
        expected_second = [0.0] * len(ts)
    assert _relative_errors(second.tolist(), expected_second) <= tol


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["float64", "float32"])
@pytest.mark.parametrize("name,params", CASES, ids=CASE_IDS)
def test_excess_terms(name, params, dtype):
    # The fallback's excess and excess_first (the native ones are what dro_loss and robust_objective sum,
    # tested above): a few roundings of |t| + |result| however small t is.
    from dro_ext._divergences import check_divergence, excess, excess_first

    spec = check_divergence(name, **params)
    ts = [v for v in SMALL_T + [-40.0, 40.0] if not (name == "kl" and v > 30)]
    t = torch.tensor(ts, dtype=dtype)
    eps = torch.finfo(dtype).eps
    for fn, order, shift in ((excess, 0, 1), (excess_first, 1, 0)):
        got = fn(t, spec).tolist()
        for v, g in zip(t.tolist(), got):
            exact = mp_psi_star(v, name, order=order, **params) - (mp.mpf(v) if shift else 1)
            assert abs(g - float(exact)) <= 8 * eps * (abs(v) + abs(float(exact))), (fn.__name__, v, g, exact)


# --------------------------------------------------------------------------------------------------
# cressie_read: powers, and k -> 1.
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["float64", "float32"])
@pytest.mark.parametrize("k", [1.0 + 1e-12, 1.0 + 1e-6, 1.001, 1.25, 1.5, 2.0, 2.5, 3.0, 5.0, 20.0])
def test_cressie_read_powers(backend, k, dtype):
    # Random t over the whole domain, including u = 1 + (k-1) t <= 0 and large t.
    t = (torch.randn(257, dtype=torch.float64) * 3).to(dtype)
    tol = {torch.float64: 1e-12, torch.float32: 2e-5}[dtype]
    ts = t.tolist()
    for order in (0, 1):
        if order == 0:
            got = dro_ext.psi_star(t, "cressie_read", k=k)
        else:
            got = dro_ext.dro_weights(t, 0.0, 1.0, "cressie_read", k=k)
        expected = [mp_psi_star(v, "cressie_read", k=k, order=order) for v in ts]
        for v, g, e in zip(ts, got.tolist(), expected):
            e = float(e)
            if math.isinf(e):
                assert g == e, (order, v, g, e)
            else:
                # relative to the value, or to |t| where the value passes through 0
                assert abs(g - e) <= tol * max(abs(e), abs(v) * 1e-3, 1e-300), (order, v, g, e)


KINK_KS = [4.0, 6.0, 100.0]


def check_cressie_read_derivatives_above_the_kink(k, dtype, device):
    """Losses at and just above u = 1 + (k-1) t = 0, where t (k - 1) rounds to -1 itself: the SIMD builds chose the
    branch on u formed in one fused rounding (u > 0) and took log1p of the product rounded on its own, log1p(-1):
    psi*'' came out inf (float64, k = 4; the AVX2 float32 log1p returns an arbitrary finite value there instead).
    nvcc contracts the same u into an FMA on the device. At the kink the derivatives jump from 0 within a rounding
    of t, so a build may give 0 (u rounded to 0) or the power of a u within a rounding of the true one."""
    a = k - 1.0
    t = torch.tensor([-1.0 / a], dtype=dtype)
    losses = [t]
    for _ in range(8):  # the next floats up, across the point where the product leaves -1
        losses.append(torch.nextafter(losses[-1], torch.zeros_like(t)))
    x = torch.cat(losses).to(device).requires_grad_()
    weights = dro_ext.dro_weights(x, 0.0, 1.0, "cressie_read", k=k)
    (second,) = torch.autograd.grad(weights.sum(), x)
    unit = 2.0 ** (-52 if dtype == torch.float64 else -23)
    for v, w, d in zip(x.tolist(), weights.tolist(), second.tolist()):
        u = 1 + mpmath.mpf(a) * mpmath.mpf(v)  # exactly, from the loss as given
        if u <= 0:
            assert w == 0 and d == 0, (v, w, d)
            continue
        # u is known to the rounding of its product, about `unit`: the power of any u in [u - unit, u + unit]
        # (clamped at 0), or 0 where the rounding left none above 0.
        low, high = max(u - unit, mpmath.mpf(0)), u + unit
        first_range = (low ** (1 / mpmath.mpf(a)), high ** (1 / mpmath.mpf(a)))
        assert math.isfinite(w) and math.isfinite(d), (v, w, d)
        assert w == 0 or float(first_range[0]) * (1 - 1e-3) <= w <= float(first_range[1]) * (1 + 1e-3), (
            v, w, [float(b) for b in first_range])


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["float64", "float32"])
@pytest.mark.parametrize("k", KINK_KS)
def test_cressie_read_derivatives_within_a_rounding_above_the_kink(backend, k, dtype):
    check_cressie_read_derivatives_above_the_kink(k, dtype, "cpu")


@pytest.mark.parametrize("divergence", ["chi2", "kl"])
def test_a_long_sum_of_alike_terms_stays_within_a_few_roundings(backend, divergence):
    """2^22 float32 losses alike: the native kernels added their 256 chunks' sums one after another in float32,
    which drifted by a rounding each (19 float32 roundings off here); in float64 the value is the chunks' own
    roundings off."""
    x = torch.full((2**22,), 0.1)
    value = dro_ext.dro_loss(x, torch.tensor(0.0), 1.0, divergence)
    exact = dro_ext.dro_loss(x.double(), torch.tensor(0.0, dtype=torch.float64), 1.0, divergence)
    assert abs(value.double().item() / exact.item() - 1) <= 8 * 2.0**-24 * 2, (value.item(), exact.item())


def test_cressie_read_float32_weights_where_k_minus_1_times_t_passes_float32(backend):
    """cressie_read's u = 1 + (k - 1) t overflowed float32 where t and the weight u^(1/(k-1)) do not (k = 100,
    lam = 1e-37, t near 1e37: u = 1e39, a weight near 2.5): the float32 map gave inf weights, and so the loss's
    gradient; it is now redone in float64 as a t past float32 is (within the README's range: 1/lam a normal float32,
    t finite in float64)."""
    losses = torch.tensor([0.1, 0.5, 0.9, 1.3, 1.7]).requires_grad_()
    eta, lam, k = torch.tensor(0.3), 1e-37, 100.0
    value = dro_ext.dro_loss(losses, eta, lam, "cressie_read", k=k)
    (grad,) = torch.autograd.grad(value, losses)
    weights = dro_ext.dro_weights(losses.detach(), eta, lam, "cressie_read", k=k)
    for i, v in enumerate(losses.tolist()):
        t = (mp.mpf(v) - mp.mpf(eta.item())) / mp.mpf(lam)
        w = float(mp_psi_star(t, "cressie_read", k=k, order=1))
        assert weights[i].item() == pytest.approx(w, rel=1e-6), (i, weights[i].item(), w)
        assert grad[i].item() == pytest.approx(w / 5, rel=1e-6), (i, grad[i].item(), w / 5)


@pytest.mark.parametrize("k", [1e38, 1e39], ids=["k-1 in float32", "k-1 past float32"])
def test_cressie_read_float32_robust_objective_at_a_k_near_float32s_largest(backend, k):
    """At such a k, psi*(t) = (u^(k/(k-1)) - 1)/k is t to within 1e-36 for u > 0, so Psi is the mean loss and the
    worst case the uniform distribution; the float32 solver's (k - 1) t overflowed (Psi 1.43 for a mean of 0.9, all
    the weight on the largest loss) or was NaN where k - 1 is no float32. The solve now runs on a float64 copy."""
    losses = torch.tensor([0.1, 0.5, 0.9, 1.3, 1.7])
    value, _ = dro_ext.robust_objective(losses, 0.1, "cressie_read", k=k)
    assert value.item() == pytest.approx(0.9, rel=1e-6)
    weights = dro_ext.worst_case_weights(losses, 0.1, "cressie_read", k=k)
    torch.testing.assert_close(weights, torch.full((5,), 0.2), rtol=1e-6, atol=0)


@pytest.mark.parametrize("k", [2.0, 1.5])
def test_cressie_read_integer_powers_psi_star_meets_kappa_4_at_large_t(backend, k):
    """The README's bound for psi_star at k = 2 and 3/2, kappa u |psi*(t)| with kappa = 4: the fallback formed psi*
    as exp(p log u) at every k, whose error grows with log u (4.1x the bound at k = 3/2, t = 2e7); its autograd
    gradient is psi*' to a few roundings too."""
    t = torch.logspace(0, 12, 601, dtype=torch.float64).requires_grad_()
    value = dro_ext.psi_star(t, "cressie_read", k=k)
    (grad,) = torch.autograd.grad(value.sum(), t)
    eps = 2.0**-52
    for v, g, d in zip(t.tolist(), value.tolist(), grad.tolist()):
        exact = mp_psi_star(v, "cressie_read", k=k, order=0)
        assert abs(g - float(exact)) <= 4 * eps * abs(float(exact)), (v, g, exact)
        slope = mp_psi_star(v, "cressie_read", k=k, order=1)
        assert abs(d - float(slope)) <= 8 * eps * abs(float(slope)), (v, d, slope)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["float64", "float32"])
def test_cressie_read_k_near_one_is_kl(backend, dtype):
    # k = 1 + 1e-12 returned 0 in float32 (1 + (k - 1) t rounds to 1); the limit k -> 1 is the KL value.
    losses = _losses(dtype, 1000)
    eta = torch.tensor(0.4, dtype=torch.float64 if dtype == torch.float64 else torch.float32)
    near = dro_ext.dro_loss(losses, eta, 0.5, "cressie_read", k=1.0 + 1e-12)
    kl = dro_ext.dro_loss(losses, eta, 0.5, "kl")
    assert_close(near, kl, RTOL[dtype], "dro_loss")
    value_near, _ = dro_ext.robust_objective(losses, 0.5, "cressie_read", k=1.0 + 1e-12)
    value_kl, _ = dro_ext.robust_objective(losses, 0.5, "kl")
    assert_close(value_near, value_kl, RTOL[dtype] * 10, "robust_objective")
    t = torch.linspace(-3, 3, 61, dtype=dtype)
    torch.testing.assert_close(dro_ext.psi_star(t, "cressie_read", k=1.0 + 1e-12), torch.expm1(t),
                               rtol=RTOL[dtype] * 10, atol=RTOL[dtype] * 10)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["float64", "float32"])
@pytest.mark.parametrize("lam", [1e-3, 0.1, 1.0, 10.0])
def test_cressie_read_k2_robust_is_exact(backend, lam, dtype):
    # k = 2: psi*'(t) = (1 + t)_+, piecewise linear; eta* is solved exactly on its segment, so the optimality
    # condition holds to the rounding of the float64 sums.
    losses = torch.randn(5000, dtype=torch.float64).exp().to(dtype)
    value, eta = dro_ext.robust_objective(losses, lam, "cressie_read", k=2.0)
    x = losses.double()
    weights = torch.clamp(1 + (x - eta.double()) / lam, min=0)
    assert abs(weights.mean().item() - 1.0) <= (1e-12 if dtype == torch.float64 else 1e-5)
    expected = mp_robust(losses.tolist(), lam, "cressie_read", k=2.0)
    assert_close(value, expected, RTOL[dtype], f"lam={lam}")


# --------------------------------------------------------------------------------------------------
# A parameter the divergence does not take is an error naming it.
# --------------------------------------------------------------------------------------------------

UNUSED = [
    ("chi2", {"alpha": 0.1}, "alpha"),
    ("chi2", {"k": 2.0}, "k"),
    ("kl", {"alpha": 0.1}, "alpha"),
    ("kl", {"k": 2.0}, "k"),
    ("cvar", {"alpha": 0.1, "k": 2.0}, "k"),
    ("kl_cvar", {"alpha": 0.1, "k": 2.0}, "k"),
    ("smoothed_cvar", {"alpha": 0.1, "k": 2.0}, "k"),
    ("cressie_read", {"alpha": 0.1, "k": 2.0}, "alpha"),
]


@pytest.mark.parametrize("name,params,arg", UNUSED, ids=[f"{n}-{a}" for n, _, a in UNUSED])
def test_unused_parameter_is_an_error(backend, name, params, arg):
    losses = torch.rand(8)
    eta = torch.tensor(0.5)
    match = f"'{name}' takes no {arg}"
    calls = [
        lambda: dro_ext.dro_loss(losses, eta, 0.5, name, **params),
        lambda: dro_ext.dro_loss(losses, 0.5, 0.5, name, **params),
        lambda: dro_ext.dro_weights(losses, eta, 0.5, name, **params),
        lambda: dro_ext.psi_star(losses, name, **params),
        lambda: dro_ext.robust_objective(losses, 0.5, name, **params),
        lambda: dro_ext.worst_case_weights(losses, 0.5, name, **params),
        lambda: dro_ext.DROLoss(name, 0.5, **params),
    ]
    for call in calls:
        with pytest.raises(ValueError, match=match):
            call()


@pytest.mark.skipif(not _backend.native_available(), reason="the native extension is not built")
@pytest.mark.parametrize("name,params,arg", UNUSED, ids=[f"{n}-{a}" for n, _, a in UNUSED])
def test_unused_parameter_is_an_error_in_the_ops(name, params, arg):
    # The C++ ops check it themselves (check_divergence_args), whoever calls them.
    losses = torch.rand(8)
    eta = torch.tensor(0.5)
    alpha, k = params.get("alpha"), params.get("k")
    ops = torch.ops.dro_ext
    match = f"'{name}' takes no {arg}"
    with pytest.raises(ValueError, match=match):
        ops.dro_loss(losses, eta, 0.5, name, alpha, k)
    with pytest.raises(ValueError, match=match):
        ops.psi_star_terms(losses, eta, torch.tensor(1.0), 0.5, name, alpha, k, 1.0, 1)
    with pytest.raises(ValueError, match=match):
        ops.robust_objective(losses, 0.5, name, alpha, k)
    with pytest.raises(ValueError, match=match):
        ops.robust_weights(losses, torch.tensor(0.5), 0.5, name, alpha, k)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["float64", "float32"])
def test_dense_sweep_of_the_vector_expm1_and_log1p(backend, dtype):
    # The CPU kernels evaluate expm1 and log1p with their own vector code (csrc/cpu/vectorized_math.h): sweep
    # t over every scale, both signs, across the range reductions' boundaries (|t| = ln(2)/2, k = 0 of log1p)
    # and up to the overflow threshold, against float64 (float32 input) or mpmath (float64 input).
    magnitudes = torch.logspace(-30, math.log10(80.0), 4001, dtype=torch.float64)
    t64 = torch.cat([magnitudes, -magnitudes, torch.linspace(-1.5, 1.5, 3001, dtype=torch.float64)])
    t = t64.to(dtype)
    exact_t = t.double()
    eps = torch.finfo(dtype).eps
    kl = dro_ext.psi_star(t, "kl").double()
    if dtype == torch.float32:
        expected = torch.expm1(exact_t)
    else:
        expected = torch.tensor([float(mp.expm1(mp.mpf(v))) for v in exact_t.tolist()], dtype=torch.float64)
    assert ((kl - expected).abs() <= 4 * eps * expected.abs()).all(), "expm1"
    # log1p through smoothed_cvar's value for t <= 0: log1p(alpha expm1(t)) / alpha.
    alpha = 0.7
    neg = exact_t[exact_t <= 0]
    value = dro_ext.psi_star(neg.to(dtype), "smoothed_cvar", alpha=alpha).double()
    if dtype == torch.float32:
        expected = torch.log1p(alpha * torch.expm1(neg)) / alpha
    else:
        expected = torch.tensor([float(mp.log1p(alpha * mp.expm1(mp.mpf(v))) / alpha) for v in neg.tolist()],
                                dtype=torch.float64)
    assert ((value - expected).abs() <= 8 * eps * expected.abs()).all(), "log1p"
    # k = 1.25 (general power): exp(4 log1p(t / 4)) - 1 over u > 0.
    value = dro_ext.dro_weights(t, 0.0, 1.0, "cressie_read", k=1.25).double() - 1
    if dtype == torch.float32:
        expected = torch.where(exact_t > -4, torch.expm1(4 * torch.log1p(exact_t.clamp(min=-4) / 4)), -1.0)
    else:
        expected = torch.tensor([float(mp.expm1(4 * mp.log1p(mp.mpf(v) / 4))) if v > -4 else -1.0
                                 for v in exact_t.tolist()], dtype=torch.float64)
    finite = expected.isfinite()
    assert ((value - expected).abs()[finite] <= 16 * eps * (expected.abs() + 1)[finite]).all(), "power"


def test_float64_exp_weights_to_one_rounding(backend):
    # kl's weight psi*'(t) = exp(t) in float64: the AVX builds' own exp (csrc/cpu/simd_float.h, in place of Sleef's)
    # over the whole range, against mpmath: within two roundings down to log(DBL_MIN) = -708.40 (AVX2: 0 below
    # -708.05, where its scale leaves the normal range), 0 or a normal number below that (never a subnormal), inf
    # past log(DBL_MAX) = 709.78, NaN for NaN.
    t = torch.cat([torch.linspace(-760.0, 709.75, 20001, dtype=torch.float64),
                   torch.linspace(-0.4, 0.4, 2001, dtype=torch.float64),  # across the reduction's |r| = ln(2)/2
                   torch.tensor([0.0, -0.0, 1e-300, -1e-300, 709.78, 709.7827, 709.79, 710.0, 1e308, math.inf,
                                 -708.0, -708.39, -708.41, -745.2, -1e308, -math.inf], dtype=torch.float64)])
    w = dro_ext.dro_weights(t, 0.0, 1.0, "kl")
    exact = torch.tensor([float(mp.exp(mp.mpf(v))) if math.isfinite(v) else math.exp(v) for v in t.tolist()],
                         dtype=torch.float64)
    tiny = torch.finfo(torch.float64).tiny
    if backend == "native" and torch.ops.dro_ext._cpu_capability() != "default":
        assert bool(((w == 0) | (w >= tiny)).all()), w[(w != 0) & (w < tiny)]
    accurate = (t >= -708.0) & exact.isfinite()
    ulps = (w - exact).abs()[accurate] / torch.finfo(torch.float64).eps / exact[accurate]
    assert float(ulps.max()) <= 2.0, float(ulps.max())
    assert bool((w[exact == math.inf] == math.inf).all())
    assert math.isnan(dro_ext.dro_weights(torch.tensor([math.nan], dtype=torch.float64), 0.0, 1.0, "kl").item())


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["float64", "float32"])
@pytest.mark.parametrize("name,params", CASES, ids=CASE_IDS)
def test_blocks_of_large_and_small_t(backend, name, params, dtype):
    # The CPU kernels sum blocks of 512 samples whose mean |t| is at least 1 with the coarse value of the
    # exponential divergences and the others with the accurate excess: one tensor with both kinds of blocks
    # (and blocks near the switch) must match the reference either way.
    spread = torch.cat([torch.randn(1536, dtype=torch.float64) * 3, torch.randn(1536, dtype=torch.float64) * 0.05,
                        torch.randn(1100, dtype=torch.float64) * 1.25])
    losses = (2.0 + spread).to(dtype)
    eta = torch.tensor(2.0, dtype=torch.float64 if dtype == torch.float64 else torch.float32)
    values = losses.tolist()
    for lam in (1.0, 1e3):
        value = dro_ext.dro_loss(losses, eta, lam, name, **params)
        assert_close(value, mp_loss(values, 2.0, lam, name, **params), RTOL[dtype], f"dro_loss lam={lam}")
        value, _ = dro_ext.robust_objective(losses, lam, name, **params)
        assert_close(value, mp_robust(values, lam, name, **params), RTOL[dtype], f"robust_objective lam={lam}")


@pytest.mark.parametrize("name,params", [("kl", {}), ("kl_cvar", {"alpha": 0.1}), ("smoothed_cvar", {"alpha": 0.1})],
                         ids=["kl", "kl_cvar", "smoothed_cvar"])
def test_exponential_weights_far_below_zero(backend, name, params):
    # Weights of t far below 0 come from exp (kl, kl_cvar: exp(t); smoothed_cvar: sigmoid(t + shift) / alpha,
    # from e^-|s|). Down to log(FLT_MIN) = -87.3 they keep the accuracy float32 allows (exp(s) for an s rounded
    # to float32 is good to |s| eps); below it the AVX builds' own exp gives 0, never a subnormal, which would
    # cost a microcode assist in every addition that reads it (csrc/cpu/simd_float.h; measured: kl's robust
    # objective three times slower). The portable build and the fallback use ATen's exp, which may return them.
    t64 = torch.linspace(-200.0, -60.0, 14001, dtype=torch.float64)
    t = t64.float()
    w = dro_ext.dro_weights(t, 0.0, 1.0, name, **params).double()
    tiny = torch.finfo(torch.float32).tiny
    if name == "smoothed_cvar":
        alpha = params["alpha"]
        s = t.double() + math.log(alpha / (1 - alpha))
        exact = torch.sigmoid(s) / alpha
    else:
        s = t.double()
        exact = torch.exp(s)
    if backend == "native" and name != "smoothed_cvar" and torch.ops.dro_ext._cpu_capability() != "default":
        assert bool(((w == 0) | (w >= tiny)).all()), w[(w != 0) & (w < tiny)]
    normal = torch.exp(s) >= 2 * tiny
    rel = ((w - exact).abs() / exact)[normal]
    assert bool((rel <= 8 * torch.finfo(torch.float32).eps * (1 + s.abs()[normal])).all()), float(rel.max())


# (divergence, params, the lowest t of the sweep above its float32 / float64 weights' underflow)
FAR_BELOW = [("kl", {}), ("kl_cvar", {"alpha": 0.1}), ("smoothed_cvar", {"alpha": 0.5}),
             ("smoothed_cvar", {"alpha": 1e-6}), ("smoothed_cvar", {"alpha": 0.9}), ("cressie_read", {"k": 1.5}),
             ("cressie_read", {"k": 1.9})]


@pytest.mark.parametrize("k", [2.0, 1.5])
def test_cressie_read_integer_power_weights_are_exact_far_above(backend, k):
    """k = 2 and k = 3/2 weigh by psi*' = u and u^2 (u = 1 + (k - 1) t): formed by arithmetic, as the kernels form
    them, they keep a rounding or two at any t; the fallback once formed them as exp(p log u), a hundred roundings
    off at t = 1e138 (dL/deta of one loss 1 at lam = 1e-138, found by the deep property profile)."""
    t = torch.tensor([0.5, 3.0, 1e3, 1e20, 1e138, 1e150], dtype=torch.float64)
    eps = torch.finfo(torch.float64).eps
    exact = [float((1 + mpmath.mpf(k - 1) * mpmath.mpf(v)) ** int(1 / (k - 1))) for v in t.tolist()]
    weights = dro_ext.dro_weights(t, 0.0, 1.0, "cressie_read", k=k)
    for got, want in zip(weights.tolist(), exact):
        assert abs(got - want) <= 4 * eps * want, (k, got, want)
    eta = torch.tensor(0.0, dtype=torch.float64, requires_grad=True)
    (grad_eta,) = torch.autograd.grad(dro_ext.dro_loss(torch.ones(1, dtype=torch.float64), eta, 1e-138,
                                                       "cressie_read", k=k), eta)
    want = 1 - float((1 + mpmath.mpf(k - 1) / mpmath.mpf(1e-138)) ** int(1 / (k - 1)))
    assert abs(float(grad_eta) - want) <= 4 * eps * abs(want), (k, float(grad_eta), want)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["float64", "float32"])
@pytest.mark.parametrize("name,params", FAR_BELOW, ids=[f"{n}-{next(iter(p.values()), '')}" for n, p in FAR_BELOW])
def test_autograd_gradient_far_below_zero_is_the_weight(backend, name, params, dtype):
    # The gradient of a sample far on psi*'s flat side is its weight psi*'(t), however small, relative to its own
    # size: autograd through torch.expm1 forms it as expm1(t) + 1, which is exactly 0 once e^t is below a rounding
    # of 1 (the fallback's psi*, and so group_dro_loss on every backend, did). dro_loss, group_dro_loss over
    # singleton groups, and psi_star, at lam = 1 and eta = 0 (t = l exactly).
    if name == "cressie_read":  # down to u = 1 + (k - 1) t = 1e-6 (u = 0 at t = -1/(k - 1))
        top = -2.0 / params["k"]
        t = top + (-1.0 / (params["k"] - 1.0) * (1 - 1e-6) - top) * torch.linspace(0, 1, 301, dtype=torch.float64)
    else:
        t = torch.linspace(-2.5, -80.0 if dtype == torch.float32 else -700.0, 301, dtype=torch.float64)
    t = t.to(dtype)
    n, eps = len(t), torch.finfo(dtype).eps
    tiny = torch.finfo(dtype).smallest_normal
    ids = torch.arange(n)
    gradients = {}
    for what, fn in [("dro_loss", lambda x: dro_ext.dro_loss(x, 0.0, 1.0, name, **params) * n),
                     ("group_dro_loss", lambda x: dro_ext.group_dro_loss(x, ids, n, 0.0, 1.0, name, **params) * n),
                     ("psi_star", lambda x: dro_ext.psi_star(x, name, **params).sum())]:
        x = t.clone().requires_grad_()
        (gradients[what],) = torch.autograd.grad(fn(x), x)
    for i, ti in enumerate(t.tolist()):
        w, second = mp_psi_star(ti, name, order=1, **params), mp_psi_star(ti, name, order=2, **params)
        # exp, log and the powers are good to a few roundings of |t| times psi*'s own conditioning at t.
        allowed = 64 * eps * (1 + abs(ti) * float(second / w)) * float(w) + 4 * tiny
        for what, g in gradients.items():
            got = float(g[i])
            assert abs(got - float(w)) <= allowed, (
                f"{what} {name} {params} {dtype} t={ti!r}: gradient {got!r}, exact {float(w)!r}")


FAR_ALPHAS = [1e-6, 1e-3, 0.999, 1 - 1e-6]


def check_smoothed_cvar_derivatives_where_exp_minus_abs_t_underflows(alpha, dtype, device, autograd=True):
    """Outside the shortcuts' alpha in [1/16, 15/16], psi*'(t) = e^t / (1 - alpha + alpha e^t) and psi*''(t) are
    formed from q = e^-|t| over a sum that is down to min(alpha, 1 - alpha): at alpha = 1 - 1e-6, t = -100 in
    float32 the weight is e^-100 / 1e-6 = 3.7e-38, a normal number, where q is below the smallest normal (0 in the
    AVX builds, a subnormal short of digits elsewhere). Both must be the exact value to the conditioning of exp, a
    few roundings of |t|, wherever that value is normal: the weight (dro_weights), and with ``autograd`` the gradient
    and the second derivative (double backward) of psi_star, which the native ops form with the same functor."""
    eps, tiny = torch.finfo(dtype).eps, torch.finfo(dtype).smallest_normal
    reach = 130.0 if dtype == torch.float32 else 760.0
    t = torch.linspace(-reach, reach, 1301, dtype=torch.float64).to(device, dtype)
    got = {"dro_weights": dro_ext.dro_weights(t, 0.0, 1.0, "smoothed_cvar", alpha=alpha)}
    if autograd:
        x = t.clone().requires_grad_()
        (first,) = torch.autograd.grad(dro_ext.psi_star(x, "smoothed_cvar", alpha=alpha).sum(), x, create_graph=True)
        (second,) = torch.autograd.grad(first.sum(), x)
        got.update({"gradient": first.detach(), "second derivative": second})
    got = {what: values.cpu().tolist() for what, values in got.items()}
    checked = 0
    for i, ti in enumerate(t.cpu().tolist()):
        exact = {order: float(mp_psi_star(ti, "smoothed_cvar", alpha=alpha, order=order)) for order in (1, 2)}
        for what, values in got.items():
            want = exact[2 if what == "second derivative" else 1]
            if want < 2 * tiny:
                continue
            checked += 1
            assert abs(values[i] - want) <= 16 * eps * (2 + abs(ti)) * want, (
                f"{what} alpha={alpha} {dtype} t={ti!r}: {values[i]!r}, exact {want!r}")
    assert checked > len(t) * len(got) // 2  # most of the sweep is normal


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["float64", "float32"])
@pytest.mark.parametrize("alpha", FAR_ALPHAS)
def test_smoothed_cvar_derivatives_stay_normal_where_exp_minus_abs_t_underflows(backend, alpha, dtype):
    # The fallback's autograd differentiates its formulas: it keeps q's digits down to float64's smallest normal,
    # and its second derivative near t = 0 rounds 1 - alpha, a thousand roundings at alpha = 0.999: its weight only.
    check_smoothed_cvar_derivatives_where_exp_minus_abs_t_underflows(alpha, dtype, "cpu", autograd=backend != "python")


# The fallback only: the native kernels leave a (k - 1) t past the largest float out of their range (README,
# "Exactness"; csrc/divergences.h's CressieRead::log_base says what handling it cost them).
@pytest.mark.parametrize("k,t", [(1000.0, 1e306), (1e300, 1e10)], ids=["k1000-t1e306", "k1e300-t1e10"])
def test_the_fallback_cressie_read_where_k_minus_1_times_t_overflows(k, t):
    """u = 1 + (k - 1) t passes float64's largest while psi*'(t) = u^(1/(k-1)) is a modest number (2.04 at k = 1000,
    t = 1e306; 1 at k = 1e300, t = 1e10): log1p((k - 1) t) made the weight inf where it is finite."""
    x = torch.tensor([t], dtype=torch.float64)
    eps = torch.finfo(torch.float64).eps
    weight = float(mp_psi_star(t, "cressie_read", k=k, order=1))
    with _backend.forced_backend("python"):
        got = dro_ext.dro_weights(x, 0.0, 1.0, "cressie_read", k=k).item()
    # the power's argument, log(u) / (k - 1), rounds to a few roundings of itself: a few of the weight's.
    assert abs(got - weight) <= 8 * eps * weight, (got, weight)


def test_the_fallback_cressie_read_robust_objective_where_k_minus_1_times_t_overflows():
    """At k = 1e300, psi*(t) is max(t, -1/k) to within 1e-290: Psi of the losses [0, 1e10] at lam = 1 is their mean,
    5e9 (the objective is flat for eta <= 1e-300). With (k - 1) t overflowing at the larger loss, the solve returned
    Psi = 9.91e9. (The worst-case weights are not checked: eta* sits on the smaller loss's kink, t = -1/(k - 1), whose
    width 1e-300 in eta is far below the solve's tolerance, and a weight of 0 or 1 there are equally close.)"""
    losses = torch.tensor([0.0, 1e10], dtype=torch.float64)
    with _backend.forced_backend("python"):
        value, eta = dro_ext.robust_objective(losses, 1.0, "cressie_read", k=1e300)
    assert value.item() == pytest.approx(5e9, rel=1e-12)
    assert abs(eta.item()) <= 1e-6, eta.item()


# (dtype, t, divergence parameters): psi*(t) finite, and a product in its formula past the type's largest before the
# division that brings it back (cressie_read's a t (1 + e) / k, k = 3/2's m (v^2 + v + 1) / 3).
PRODUCTS_PAST_THE_LARGEST = [
    (torch.float32, 5e36, {"k": 30.0}), (torch.float32, 3.3e35, {"k": 1000.0}), (torch.float32, 1.3e13, {"k": 1.5}),
    (torch.float32, 1.35e23, {"k": 2.5}), (torch.float64, 1e297, {"k": 30.0}), (torch.float64, 1e305, {"k": 1000.0}),
    (torch.float64, 1e103, {"k": 1.5}),
]  # ((k - 1) t itself finite: past it, out of the native kernels' range)


@pytest.mark.parametrize("dtype,t,params", PRODUCTS_PAST_THE_LARGEST,
                         ids=[f"{str(d)[6:]}-k{p['k']}-t{t:g}" for d, t, p in PRODUCTS_PAST_THE_LARGEST])
def test_cressie_read_psi_star_finite_where_a_product_before_the_division_overflows(backend, dtype, t, params):
    got = dro_ext.psi_star(torch.tensor([t], dtype=dtype), "cressie_read", **params).item()
    exact = float(mp_psi_star(float(torch.tensor(t, dtype=dtype)), "cressie_read", **params))
    assert got == pytest.approx(exact, rel=64 * torch.finfo(dtype).eps), (got, exact)


# (divergence, parameters, loss, lam): lam psi*(l / lam) finite, with psi*(t) - t formed through a square or a product
# past float64's largest (chi2's m m / 4, k = 2's m m / 2, general k's t a e / k).
EXCESS_PAST_THE_LARGEST = [("chi2", {}, 1.5e154, 1.0), ("cressie_read", {"k": 2.0}, 1.5e154, 1.0),
                           ("cressie_read", {"k": 1.5}, 1e103, 1.0), ("cressie_read", {"k": 30.0}, 1e297, 1.0),
                           ("chi2", {}, 1.5, 1e-154)]


@pytest.mark.parametrize("name,params,loss,lam", EXCESS_PAST_THE_LARGEST,
                         ids=[f"{n}-{p.get('k', '')}-l{v:g}-lam{lam:g}" for n, p, v, lam in EXCESS_PAST_THE_LARGEST])
def test_dro_loss_finite_where_the_excess_squares_past_the_largest(backend, name, params, loss, lam):
    losses = torch.tensor([loss], dtype=torch.float64)
    got = dro_ext.dro_loss(losses, torch.zeros((), dtype=torch.float64), lam, name, **params).item()
    exact = float(mp_loss([loss], 0.0, lam, name, **params))
    assert got == pytest.approx(exact, rel=1e-12), (got, exact)


SHORTCUT_ALPHAS = [1.0 / 16.0, 0.5, 15.0 / 16.0]


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["float64", "float32"])
@pytest.mark.parametrize("alpha", SHORTCUT_ALPHAS)
def test_smoothed_cvar_shortcut_derivatives_stay_normal_where_exp_minus_abs_s_underflows(backend, alpha, dtype):
    # With the shortcuts (alpha in [1/16, 15/16]) psi*' = sigmoid(s) / alpha and psi*'' = sigmoid(s) sigmoid(-s) /
    # alpha, s = t + log(alpha / (1 - alpha)), are formed from e^-|s|, which underflows (0 in the AVX builds) up to
    # 1/alpha (psi*') and 1/alpha^2 (psi*'') times above the smallest normal, where they are normal numbers
    # (alpha = 1/16, float32: the weight at t = -86 is 4.8e-38, psi*''(90.5) 1.2e-37). The same bound as outside the
    # shortcuts. (The fallback's float64 weights there were subnormal quotients, a few roundings off: within it.)
    # The native weights map (dro_weights, dro_loss's gradient) keeps the unscaled sigmoid with 1/alpha folded into
    # its multiplier, one multiplication a sample fewer, and so its zeros up to 1/alpha times above the smallest
    # normal (first() there, with its test of each lane, cost smoothed_cvar's backward 12% at 2^20, side by side on a
    # Xeon): natively the second derivative only.
    if backend == "python":
        check_smoothed_cvar_derivatives_where_exp_minus_abs_t_underflows(alpha, dtype, "cpu", autograd=False)
        return
    eps, tiny = torch.finfo(dtype).eps, torch.finfo(dtype).smallest_normal
    reach = 130.0 if dtype == torch.float32 else 760.0
    t = torch.linspace(-reach, reach, 1301, dtype=torch.float64).to(dtype).requires_grad_()
    (first,) = torch.autograd.grad(dro_ext.psi_star(t, "smoothed_cvar", alpha=alpha).sum(), t, create_graph=True)
    (second,) = torch.autograd.grad(first.sum(), t)
    checked = 0
    for ti, got in zip(t.detach().tolist(), second.tolist()):
        want = float(mp_psi_star(ti, "smoothed_cvar", alpha=alpha, order=2))
        if want >= 2 * tiny:
            checked += 1
            assert abs(got - want) <= 16 * eps * (2 + abs(ti)) * want, (alpha, dtype, ti, got, want)
    assert checked > len(t) // 2


# (dtype, alpha, t) where q = e^-|t| lies in [smallest normal, 256 smallest normals], where AVX2's exp gives 0.
AVX2_EXP_ZERO_BAND = [(torch.float64, 1e-30, 708.25), (torch.float64, 0.001, 708.25), (torch.float32, 1e-10, 87.0),
                      (torch.float64, 1 - 1e-6, -708.25), (torch.float32, 1 - 1e-6, -87.0)]


@pytest.mark.parametrize("dtype,alpha,t", AVX2_EXP_ZERO_BAND,
                         ids=[f"{str(d)[6:]}-alpha{a:g}-t{t:g}" for d, a, t in AVX2_EXP_ZERO_BAND])
def test_smoothed_cvar_derivatives_take_the_same_form_in_every_build(backend, dtype, alpha, t):
    """Outside the shortcuts, psi*' and psi*'' are q / (c1 + c2 q) (and the like) where q = e^-|t| is well above the
    smallest normal, else the exponential of their logarithm, a few roundings of |t| off. AVX2's exp returns 0 for
    results up to 1.7e-38 (float32) / 3.1e-308 (float64), above the smallest normal, so that build alone took the log
    form there: hundreds of roundings from the portable build at the same t. Every build and the fallback now agree
    to a few roundings."""
    x = torch.tensor([t], dtype=dtype)
    eps = torch.finfo(dtype).eps

    def derivatives():
        weight = dro_ext.dro_weights(x, 0.0, 1.0, "smoothed_cvar", alpha=alpha).item()
        if backend == "python":  # its autograd differentiates psi*'s formula: its weight only
            return [weight]
        y = x.clone().requires_grad_()
        (first,) = torch.autograd.grad(dro_ext.psi_star(y, "smoothed_cvar", alpha=alpha).sum(), y, create_graph=True)
        (second,) = torch.autograd.grad(first.sum(), y)
        return [weight, second.item()]

    got = derivatives()
    if backend == "python" and dtype == torch.float32:  # formed in float64, where q is far above the smallest normal
        exact = float(mp_psi_star(t, "smoothed_cvar", alpha=alpha, order=1))
        assert abs(got[0] - exact) <= eps * exact, (got, exact)
        return
    with _backend.forced_backend("native"):
        previous = torch.ops.dro_ext._cpu_capability("default")
        try:
            portable = derivatives()
        finally:
            torch.ops.dro_ext._cpu_capability(previous)
    for g, p in zip(got, portable):
        assert abs(g - p) <= 8 * eps * abs(p), (got, portable)
