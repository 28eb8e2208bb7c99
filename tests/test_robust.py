"""robust_objective, worst_case_weights, weight_stats and evaluate.

The references are independent of dro_ext: psi* and psi are written out below from docs/design.md section 1.3
(numpy, float64), and Psi = min_eta L(eta) is found by scipy's bounded scalar minimizer.
"""
import math
import os
import subprocess
import sys

import numpy as np
import pytest
import torch
from scipy.optimize import minimize_scalar
from scipy.special import logsumexp, xlogy

import dro_ext
from dro_ext import _backend

CASES = [
    ("chi2", {}),
    ("kl", {}),
    ("cvar", {"alpha": 0.3}),
    ("kl_cvar", {"alpha": 0.2}),
    ("cressie_read", {"k": 3.0}),
    ("smoothed_cvar", {"alpha": 0.1}),
]
CASE_IDS = [name for name, _ in CASES]


# ------------------------------------------------------------------------------------------------
# Independent float64 references (docs/design.md section 1.3)
# ------------------------------------------------------------------------------------------------


def np_psi_star(t, name, alpha=None, k=None):
    """psi*(t) in float64."""
    if name == "chi2":
        return np.maximum(t + 2.0, 0.0) ** 2 / 4.0 - 1.0
    if name == "kl":
        return np.expm1(t)
    if name == "cvar":
        return np.maximum(t, 0.0) / alpha
    if name == "kl_cvar":
        cut = -math.log(alpha)
        return np.where(t <= cut, np.expm1(np.minimum(t, cut)), (1.0 + t + math.log(alpha)) / alpha - 1.0)
    if name == "cressie_read":
        return (np.maximum((k - 1.0) * t + 1.0, 0.0) ** (k / (k - 1.0)) - 1.0) / k
    if name == "smoothed_cvar":
        return np.logaddexp(math.log1p(-alpha), math.log(alpha) + t) / alpha
    raise AssertionError(name)


def np_psi(s, name, alpha=None, k=None):
    """psi(s), the divergence itself (chi2: (s-1)^2, the erratum; smoothed_cvar: paper eq. 3.3)."""
    if name == "chi2":
        return (s - 1.0) ** 2
    if name in ("kl", "kl_cvar"):
        if name == "kl_cvar":
            assert np.all(s <= 1.0 / alpha * (1 + 1e-9)), "q outside the kl_cvar domain"
        return xlogy(s, s) - s + 1.0
    if name == "cvar":
        assert np.all(s <= 1.0 / alpha * (1 + 1e-9)), "q outside the cvar domain"
        return np.zeros_like(s)
    if name == "cressie_read":
        return (s**k - k * s + k - 1.0) / (k * (k - 1.0))
    if name == "smoothed_cvar":
        assert np.all(s <= 1.0 / alpha * (1 + 1e-9)), "q outside the smoothed_cvar domain"
        r = np.maximum(1.0 - alpha * s, 0.0)
        return xlogy(s, s) + xlogy(r, r / (1.0 - alpha)) / alpha
    raise AssertionError(name)


def dual(l, lam, name, kw):
    return lambda eta: lam * float(np.mean(np_psi_star((l - eta) / lam, name, **kw))) + eta


def reference_psi(l, lam, name, kw):
    """min over eta in [min l, max l] of L(eta), by scipy's bounded minimizer in float64."""
    l = np.asarray(l, dtype=np.float64)
    lo, hi = float(l.min()), float(l.max())
    f = dual(l, lam, name, kw)
    if lo == hi:
        return f(lo)
    res = minimize_scalar(f, bounds=(lo, hi), method="bounded", options={"xatol": 1e-12 * max(1.0, abs(hi)),
                                                                         "maxiter": 2000})
    best = min(res.fun, f(lo), f(hi))
    if name == "cvar":
        # L is piecewise linear with its kinks at the losses: the minimum is at the kink nearest res.x,
        # which Brent's parabolic steps only approach.
        u = np.unique(l)
        i = int(np.searchsorted(u, res.x))
        best = min([best] + [f(x) for x in u[max(0, i - 5): i + 5]])
    return best


def make_losses(n, dtype=torch.float64):
    return (torch.randn(n, dtype=torch.float64) * 0.8).exp().to(dtype)


# ------------------------------------------------------------------------------------------------
# Value and eta* against the scalar minimization, on both paths
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("n", [1, 2, 50, 4097, (1 << 16) + 5])
@pytest.mark.parametrize("lam", [0.05, 1.0])
@pytest.mark.parametrize("name,kw", CASES, ids=CASE_IDS)
def test_matches_scalar_minimization(backend, name, kw, lam, n):
    losses = make_losses(n)
    value, eta = dro_ext.robust_objective(losses, lam, name, **kw)
    assert value.dtype == torch.float64 and value.shape == () and eta.dtype == torch.float64 and eta.shape == ()
    l = losses.numpy()
    ref = reference_psi(l, lam, name, kw)
    assert abs(value.item() - ref) <= 1e-10 * (1.0 + abs(ref)), (value.item(), ref)
    # eta* is a minimizer: L(eta*) is the minimum, and eta* lies in the bracket.
    assert l.min() <= eta.item() <= l.max()
    assert abs(dual(l, lam, name, kw)(eta.item()) - ref) <= 1e-10 * (1.0 + abs(ref))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
@pytest.mark.parametrize("k", [1.001, 1.1, 3.0, 30.0])
@pytest.mark.parametrize("lam", [1e-65, 2.8e-38, 1e-20])
def test_worst_case_weights_at_a_lam_far_below_the_float_spacing(backend, k, lam, dtype):
    """lam far finer than the losses' float spacing (|l| / lam up to 1e68, inside the documented range): the weights
    are a distribution, and where the root lies within a rounding of max l (k near 1 at the smallest lam: it is
    max l - lam (N^(k-1) - 1)/(k-1)) all the mass is on the largest loss. The solver used to stop a few floats below
    max l, where cressie_read's u^(1/(k-1)) overflows (inf/inf: NaN weights, for about two thirds of such inputs
    at k near 1), and float32 sums formed t = (l - eta*)/lam as inf at lam = 2.8e-38, where 1/lam is still a
    float32 (NaN weights at k = 30)."""
    gen = torch.Generator().manual_seed(int(1e6 * k) + int(-math.log10(lam)))
    for _ in range(4):
        x = (torch.rand(61, generator=gen, dtype=torch.float64) * 4000 - 2000).to(dtype)
        value, eta = dro_ext.robust_objective(x, lam, "cressie_read", k=k)
        q = dro_ext.worst_case_weights(x, lam, "cressie_read", k=k).double()
        assert torch.isfinite(q).all() and (q >= 0).all(), (k, lam, dtype, q)
        assert abs(float(q.sum()) - 1.0) <= 64 * torch.finfo(dtype).eps, (k, lam, dtype, float(q.sum()))
        assert float(x.min()) <= float(eta) <= float(x.max()) and float(value) <= float(x.max())
        if lam == 1e-65 and k <= 1.1:
            top = int(x.argmax())
            assert abs(float(q[top]) - 1.0) <= 4 * torch.finfo(dtype).eps and int((q != 0).sum()) == 1, (k, q[top])
            assert float(x.max()) - float(value) <= 4 * torch.finfo(dtype).eps * abs(float(x.max()))


# (-1e300 is -inf in float32, where Psi is NaN by definition.)
@pytest.mark.parametrize("dtype,far", [(torch.float64, -1e30), (torch.float64, -1e300), (torch.float32, -1e30)],
                         ids=["f64-1e30", "f64-1e300", "f32-1e30"])
@pytest.mark.parametrize("bulk", ["above-0", "up-to-0"])
@pytest.mark.parametrize("lam", [1e-3, 1.0])
@pytest.mark.parametrize("name,kw", CASES + [("cressie_read", {"k": 1.5}), ("cressie_read", {"k": 2.0})],
                         ids=CASE_IDS + ["cressie_read-k1.5", "cressie_read-k2"])
def test_a_far_outlier_below_changes_nothing(backend, name, kw, lam, dtype, far, bulk):
    # A loss far below the rest has weight 0 and adds lam psi*(-inf) / N, whether it is -1e3 or -1e30: the answer
    # must not move. Bisecting [-1e30, max l] by halving its width needed ~100 steps to reach the root, past the
    # solvers' iteration cap (Psi came out as max l), and a linear Newton step from -1e18 rounded onto the right
    # piece but not to its root (chi2 at lam = 1e-3, from -1e20 on). The other losses lie above 2, or below 0 with
    # max l = 0 exactly (nothing then gives the root's scale but the losses near it).
    rest = make_losses(78)
    rest = rest + 2.0 if bulk == "above-0" else rest - rest.max()
    mild, wide = (torch.cat([rest, torch.tensor([outlier], dtype=torch.float64)]).to(dtype) for outlier in (-1e3, far))
    expected, expected_eta = dro_ext.robust_objective(mild, lam, name, **kw)
    value, eta = dro_ext.robust_objective(wide, lam, name, **kw)
    rtol = 1e-12 if dtype == torch.float64 else 1e-5
    torch.testing.assert_close(value, expected, rtol=rtol, atol=0)
    torch.testing.assert_close(eta, expected_eta, rtol=rtol * 10, atol=rtol * 10 * lam)
    q = dro_ext.worst_case_weights(wide, lam, name, **kw)
    assert q[-1].item() == 0.0 and abs(q.double().sum().item() - 1.0) <= 10 * rtol


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["f64", "f32"])
@pytest.mark.parametrize("name,kw", CASES, ids=CASE_IDS)
def test_unrepresentative_subsample(backend, name, kw, dtype):
    # Every 8th loss large: an evenly strided subsample (the native solver's warm start, nested) sees only those,
    # so Newton over all the losses starts far right of the root and must still end on it.
    n = 4096 * 8 + 3
    losses = make_losses(n)
    losses[::8] += 50.0
    losses = losses.to(dtype)
    value, eta = dro_ext.robust_objective(losses, 0.1, name, **kw)
    ref = reference_psi(losses.double().numpy(), 0.1, name, kw)
    tol = 1e-10 if dtype == torch.float64 else 1e-5
    assert abs(value.item() - ref) <= tol * (1.0 + abs(ref)), (value.item(), ref)


@pytest.mark.parametrize("n", [1, 2, 50, 4097])
@pytest.mark.parametrize("name,kw", CASES, ids=CASE_IDS)
def test_strong_duality(backend, name, kw, n):
    """q sums to one and the primal value sum q l - lam mean psi(N q) equals Psi."""
    lam = 0.3
    losses = make_losses(n)
    value, _ = dro_ext.robust_objective(losses, lam, name, **kw)
    q = dro_ext.worst_case_weights(losses, lam, name, **kw)
    assert q.shape == losses.shape and q.dtype == losses.dtype
    q = q.numpy()
    assert np.all(q >= 0.0)
    assert abs(q.sum() - 1.0) <= 1e-12
    primal = float(np.dot(q, losses.numpy())) - lam * float(np.mean(np_psi(n * q, name, **kw)))
    assert abs(primal - value.item()) <= 1e-9 * (1.0 + abs(value.item())), (primal, value.item())


# ------------------------------------------------------------------------------------------------
# Special cases
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "losses,alpha,value,eta,q",
    [
        # alpha*N = 1.5: the top loss plus half of the next one.
        ([1.0, 2.0, 3.0, 4.0, 5.0], 0.3, (5.0 + 0.5 * 4.0) / 1.5, 4.0, [0, 0, 0, 1 / 3, 2 / 3]),
        # alpha*N = 2 inside a three-way tie: the tied losses share the mass.
        ([1.0, 5.0, 5.0, 5.0, 2.0], 0.4, 5.0, 5.0, [0, 1 / 3, 1 / 3, 1 / 3, 0]),
        # the boundary mass (1/2) split between two tied boundary losses.
        ([0.0, 3.0, 3.0, 7.0], 0.5, 5.0, 3.0, [0, 0.25, 0.25, 0.5]),
        # 0.3 * 10 == 3.0000000000000004 in floating point: still the top three, 1/3 each.
        (list(range(10)), 0.3, 8.0, 7.0, [0] * 7 + [1 / 3] * 3),
        # alpha*N < 1: the maximum alone.
        ([2.0, 9.0, 4.0, 1.0, 3.0], 0.1, 9.0, 9.0, [0, 1, 0, 0, 0]),
    ],
)
def test_cvar_ties_and_fractional_tail(backend, losses, alpha, value, eta, q):
    l = torch.tensor(losses, dtype=torch.float64)
    v, e = dro_ext.robust_objective(l, 0.7, "cvar", alpha=alpha)
    assert v.item() == pytest.approx(value, rel=1e-14, abs=1e-14)
    assert e.item() == eta
    w = dro_ext.worst_case_weights(l, 0.7, "cvar", alpha=alpha)
    torch.testing.assert_close(w, torch.tensor(q, dtype=torch.float64), rtol=1e-13, atol=1e-14)
    assert v.item() == pytest.approx(reference_psi(np.array(losses, float), 0.7, "cvar", {"alpha": alpha}), rel=1e-10)


def test_cvar_of_one_boundary_loss_is_not_above_it(backend):
    # alpha N < 1: the tail is the largest loss alone, and (alpha N * max l) / (alpha N) rounded one ulp above max l
    # in the fallback (found by the property test's deep profile).
    losses = torch.tensor([0.0, 0.0, 0.0, 0.0, 9.401369007415575e-08, 7.277747464928079e-08, -1.0079480274223642e-07,
                           4.06875845661677e-09], dtype=torch.float64)
    value, eta = dro_ext.robust_objective(losses, 1.9480849281639218e-07, "cvar", alpha=0.01)
    assert value.item() == losses.max().item() == eta.item()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_kl_huge_losses_over_lambda(backend, dtype):
    l = torch.tensor([1000.0, 2500.0, 3000.0, 2999.0], dtype=dtype)
    lam = 0.01  # l/lam up to 3e5: exp overflows in any dtype
    value, eta = dro_ext.robust_objective(l, lam, "kl")
    l64 = l.double().numpy()
    expected = lam * (logsumexp(l64 / lam) - math.log(l64.size))
    assert math.isfinite(value.item())
    assert value.item() == pytest.approx(expected, rel=1e-6 if dtype == torch.float32 else 1e-13)
    assert eta.item() == pytest.approx(expected, rel=1e-6 if dtype == torch.float32 else 1e-13)
    q = dro_ext.worst_case_weights(l, lam, "kl")
    assert torch.isfinite(q).all()
    assert q.double().sum().item() == pytest.approx(1.0, abs=1e-6)
    assert q[2].item() == pytest.approx(1.0 / (1.0 + math.exp(-100.0)), abs=1e-6)


_LARGE_REFERENCE = {}


@pytest.mark.parametrize("name,kw", CASES, ids=CASE_IDS)
def test_float32_large(backend, name, kw):
    n = 1 << 20
    gen = torch.Generator().manual_seed(1234)
    losses = (torch.randn(n, generator=gen, dtype=torch.float64) * 0.8).exp().to(torch.float32)
    lam = 0.1
    if name not in _LARGE_REFERENCE:
        _LARGE_REFERENCE[name] = reference_psi(losses.double().numpy(), lam, name, kw)
    ref = _LARGE_REFERENCE[name]
    value, eta = dro_ext.robust_objective(losses, lam, name, **kw)
    assert value.dtype == torch.float32 and eta.dtype == torch.float32
    # float32 rounding: a few ulps of the value.
    assert abs(value.item() - ref) <= 2e-6 * abs(ref), (value.item(), ref)
    q = dro_ext.worst_case_weights(losses, lam, name, **kw)
    assert q.dtype == torch.float32 and bool((q >= 0).all())
    assert abs(q.double().sum().item() - 1.0) <= 1e-5


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_low_precision_inputs(backend, dtype):
    losses = make_losses(300).to(dtype)
    value, eta = dro_ext.robust_objective(losses, 0.5, "chi2")
    assert value.dtype == dtype and eta.dtype == torch.float32
    ref = reference_psi(losses.double().numpy(), 0.5, "chi2", {})
    assert value.item() == pytest.approx(ref, rel=1e-2)


@pytest.mark.parametrize("name,kw", CASES, ids=CASE_IDS)
def test_nan_propagates(backend, name, kw):
    losses = make_losses(64)
    losses[17] = float("nan")
    value, eta = dro_ext.robust_objective(losses, 0.5, name, **kw)
    assert math.isnan(value.item()) and math.isnan(eta.item())
    q = dro_ext.worst_case_weights(losses, 0.5, name, **kw)
    assert bool(torch.isnan(q).all())


def test_all_equal_and_single_sample(backend):
    for name, kw in CASES:
        for losses in (torch.tensor([2.5], dtype=torch.float64), torch.full((9,), -1.25, dtype=torch.float64)):
            value, eta = dro_ext.robust_objective(losses, 0.2, name, **kw)
            assert value.item() == losses[0].item() and eta.item() == losses[0].item()
            q = dro_ext.worst_case_weights(losses, 0.2, name, **kw)
            torch.testing.assert_close(q, torch.full_like(losses, 1.0 / losses.numel()))


def test_native_and_fallback_agree():
    if _backend._force_python:
        pytest.skip("DRO_EXT_FORCE_PYTHON=1: this run covers the fallback only")
    assert _backend.native_available(), f"native extension not loaded: {_backend.load_error()}"
    losses = make_losses(3000)
    for name, kw in CASES:
        with _backend.forced_backend("native"):
            v_native, e_native = dro_ext.robust_objective(losses, 0.2, name, **kw)
            q_native = dro_ext.worst_case_weights(losses, 0.2, name, **kw)
        with _backend.forced_backend("python"):
            v_python, e_python = dro_ext.robust_objective(losses, 0.2, name, **kw)
            q_python = dro_ext.worst_case_weights(losses, 0.2, name, **kw)
        torch.testing.assert_close(v_native, v_python, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(e_native, e_python, rtol=1e-9, atol=1e-9)
        torch.testing.assert_close(q_native, q_python, rtol=1e-7, atol=1e-12)


def _solver_agreement_inputs(dtype):
    """(what, losses in dtype, lam): random losses of sizes on both sides of the native solver's warm start
    (N >= 65536) at lam far below, at and far above their spread, and the extreme cases of
    tests/test_exactness_properties.py (lam far below the float32 resolution of 1e20- and 1e30-scale losses,
    kl_cvar's tiny lam) with a root beside losses of weight 0 and the ERM limit."""
    gen = torch.Generator().manual_seed(7)
    for n in (2, 7, 3000):
        base = (torch.randn(n, generator=gen, dtype=torch.float64) * 0.8).exp()
        for lam in (1e-6, 0.3, 1e6):
            yield f"n={n} lam={lam}", base.to(dtype), lam
    if dtype in (torch.float32, torch.float64):
        yield "n=70000 lam=0.3", (torch.randn(70000, generator=gen, dtype=torch.float64) * 0.8).exp().to(dtype), 0.3
    big = torch.full((8,), 1e20, dtype=torch.float64)
    big[0] = 5e19
    huge = torch.full((9,), 1e30, dtype=torch.float64)
    huge[0] = 9e29
    extremes = [
        ("1e20-scale, lam 1", big, 1.0),
        ("1e30-scale, lam 1e4", huge, 1e4),
        ("0 and 1000, lam 1e-6", torch.tensor([0.0, 1000.0], dtype=torch.float64), 1e-6),
        ("a root beside -1e20", torch.tensor([-1e20, -5.0, -4.0, -3.5, -3.0], dtype=torch.float64), 1.0),
        ("spread 1e-7 around 1", 1.0 + 1e-7 * torch.rand(50, generator=gen, dtype=torch.float64), 1e-9),
        ("ERM limit", base[:50], 1e30),
    ]
    for what, x, lam in extremes:
        x = x.to(dtype)
        if torch.isfinite(x).all():
            yield what, x, lam


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64])
@pytest.mark.parametrize("name,kw", CASES + [("cressie_read", {"k": 2.0}), ("cressie_read", {"k": 1.5})],
                         ids=CASE_IDS + ["cressie_read-2", "cressie_read-1.5"])
def test_native_and_fallback_solvers_agree(name, kw, dtype):
    """The native solver and dro_ext._solver differ in the precision of their sums and in the native warm start
    (dro_ext._solver's docstring); their answers agree within what that allows, with eps the accumulate dtype's
    epsilon and s = 2|eta*| + the psi*''-weighted mean |l - eta*| (the scale both solvers resolve eta* to; plus
    |max l - eta*| for kl's closed form):
      eta*: |difference| <= 32 eps s (cvar: the same loss, exactly), or, where the minimizers form an interval,
            the native eta* is one of them too (|mean psi*'(t) - 1| <= 32 eps mean psi*'(t) there);
      Psi:  |difference| <= 64 eps mean_i(|l_i| + |eta*| + lam |psi*(t_i) - t_i| + psi*'(t_i) (|l_i| + |eta*|))
            + mean psi*''(t) / lam * (32 eps s)^2 (L at an eta* that far off) + two roundings of Psi to the dtype."""
    _require_native()
    from dro_ext._divergences import check_divergence, excess, excess_first, psi_star

    spec = check_divergence(name, kw.get("alpha"), kw.get("k"))
    eps = torch.finfo(torch.float64 if dtype == torch.float64 else torch.float32).eps
    for what, losses, lam in _solver_agreement_inputs(dtype):
        with _backend.forced_backend("native"):
            v_native, e_native = dro_ext.robust_objective(losses, lam, name, **kw)
        with _backend.forced_backend("python"):
            v_python, e_python = dro_ext.robust_objective(losses, lam, name, **kw)
        where = f"{name} {kw} {dtype} {what}"
        x = losses.to(torch.float64)
        eta = float(e_python)
        if name == "cvar":
            assert float(e_native) == eta, f"{where}: eta* {float(e_native)!r} vs {eta!r}"
            allowed = 16 * torch.finfo(torch.float64).eps * float(x.abs().max())
            allowed += 2 * torch.finfo(dtype).eps * abs(float(v_python))
            assert abs(float(v_native) - float(v_python)) <= allowed, f"{where}: Psi {v_native} vs {v_python}"
            continue
        t = (x - eta) / lam
        first, second = psi_star(t, spec, 1), psi_star(t, spec, 2)
        distance = (x - eta).abs()
        spread = float((second * distance).sum() / second.sum()) if second.sum() > 0 else float(distance.max())
        s = 2 * abs(eta) + spread + (abs(float(x.max()) - eta) if name == "kl" else 0.0)
        eta_allowed = 32 * eps * s
        if abs(float(e_native) - eta) > eta_allowed:
            # Minimizers that form an interval (every weight at 0 or its cap, alpha N losses above: L is flat
            # there) may each be given: the native eta* must then be a root of the condition as well.
            t_native = (x - float(e_native)) / lam
            condition = float(excess_first(t_native, spec).mean())
            assert abs(condition) <= 32 * eps * float(psi_star(t_native, spec, 1).mean()), (
                f"{where}: eta* {float(e_native)!r} vs {eta!r}, allowed {eta_allowed:.3g}; "
                f"mean psi*'(t) - 1 = {condition:.3g} there")
        size = float((x.abs() + abs(eta) + lam * excess(t, spec).abs() + first * (x.abs() + abs(eta))).mean())
        allowed = (64 * eps * size + float(second.mean()) / lam * eta_allowed ** 2
                   + 2 * torch.finfo(dtype).eps * abs(float(v_python)))
        assert abs(float(v_native) - float(v_python)) <= allowed, (
            f"{where}: Psi {float(v_native)!r} vs {float(v_python)!r}, allowed {allowed:.3g}")


# ------------------------------------------------------------------------------------------------
# Danskin gradient
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name,kw", CASES, ids=CASE_IDS)
def test_danskin_gradient(backend, name, kw):
    losses = make_losses(23).requires_grad_()
    lam = 0.4
    value, eta = dro_ext.robust_objective(losses, lam, name, **kw)
    assert value.requires_grad and not eta.requires_grad
    (grad,) = torch.autograd.grad(value * 3.0, losses)
    torch.testing.assert_close(grad, 3.0 * dro_ext.worst_case_weights(losses, lam, name, **kw), rtol=1e-12, atol=1e-15)
    # Finite differences (central, float64) of the exact objective.
    assert torch.autograd.gradcheck(
        lambda l: dro_ext.robust_objective(l, lam, name, **kw)[0], (losses,), eps=1e-6, atol=1e-6, rtol=1e-5
    )


@pytest.mark.parametrize("name,kw", [("chi2", {}), ("cvar", {"alpha": 0.3}), ("cressie_read", {"k": 1.5})])
def test_a_recorded_gradient_is_the_gradient_and_a_second_derivative_raises(backend, name, kw):
    # create_graph=True gives the same first derivative. Differentiating it again would need how eta* moves with the
    # losses: not implemented, so it raises instead of returning the weights' derivative at a fixed eta*.
    losses = make_losses(31).requires_grad_()
    (plain,) = torch.autograd.grad(dro_ext.robust_objective(losses, 0.4, name, **kw)[0], losses)
    (recorded,) = torch.autograd.grad(dro_ext.robust_objective(losses, 0.4, name, **kw)[0], losses,
                                      create_graph=True)
    torch.testing.assert_close(recorded, plain, rtol=0, atol=0)
    assert recorded.requires_grad
    with pytest.raises(RuntimeError, match="derivative for dro_ext::robust_objective's backward is not implemented"):
        torch.autograd.grad((recorded * torch.arange(31.0, dtype=recorded.dtype)).sum(), losses)


def test_usable_as_training_loss(backend):
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 1).double()
    x, y = torch.randn(40, 3, dtype=torch.float64), torch.randn(40, dtype=torch.float64)
    losses = (model(x).squeeze(-1) - y) ** 2
    value, _ = dro_ext.robust_objective(losses, 0.5, "chi2")
    value.backward(retain_graph=True)
    q = dro_ext.worst_case_weights(losses.detach(), 0.5, "chi2")
    expected = torch.autograd.grad((q * losses).sum(), model.weight)[0]
    torch.testing.assert_close(model.weight.grad, expected, rtol=1e-10, atol=1e-12)


# ------------------------------------------------------------------------------------------------
# The native ops: opcheck
# ------------------------------------------------------------------------------------------------


def _require_native():
    if _backend._force_python:
        pytest.skip("DRO_EXT_FORCE_PYTHON=1: this run covers the fallback only")
    assert _backend.native_available(), f"native extension not loaded: {_backend.load_error()}"


@pytest.mark.parametrize("name,kw", CASES, ids=CASE_IDS)
@pytest.mark.parametrize("requires_grad", [False, True])
def test_opcheck(name, kw, requires_grad):
    _require_native()
    losses = make_losses(37).requires_grad_(requires_grad)
    args = (losses, 0.3, name, kw.get("alpha"), kw.get("k"))
    torch.library.opcheck(torch.ops.dro_ext.robust_objective.default, args)
    _, eta = torch.ops.dro_ext.robust_objective(*args)
    torch.library.opcheck(
        torch.ops.dro_ext.robust_weights.default, (losses.detach(), eta, 0.3, name, kw.get("alpha"), kw.get("k"))
    )


def test_compile_fullgraph():
    _require_native()
    losses = make_losses(100)

    @torch.compile(fullgraph=True, backend="eager")
    def f(l):
        return dro_ext.robust_objective(l, 0.3, "smoothed_cvar", alpha=0.2)

    torch.testing.assert_close(f(losses), dro_ext.robust_objective(losses, 0.3, "smoothed_cvar", alpha=0.2))


def test_compile_fullgraph_of_the_first_call_on_a_device_type(monkeypatch):
    # A process whose first robust_objective on a device type is compiled (the CPU's answer is known at import, so
    # this forgets it, as a CUDA process has not asked yet): the dispatcher query cannot be traced.
    _require_native()
    monkeypatch.setattr(_backend, "_KERNEL_DEVICE_TYPES", {})
    torch._dynamo.reset()
    losses = make_losses(100)
    f = torch.compile(lambda l: dro_ext.robust_objective(l, 0.3, "chi2")[0], fullgraph=True, backend="eager")
    torch.testing.assert_close(f(losses), dro_ext.robust_objective(losses, 0.3, "chi2")[0])
    assert _backend._KERNEL_DEVICE_TYPES == {"cpu": True}


# ------------------------------------------------------------------------------------------------
# Bad inputs
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "args,kwargs,exc,word",
    [
        ((torch.ones(4), 0.1, "tv"), {}, ValueError, "divergence"),
        ((torch.ones(4), 0.0, "chi2"), {}, ValueError, "lam"),
        ((torch.ones(4), -1.0, "chi2"), {}, ValueError, "lam"),
        ((torch.ones(4), float("nan"), "chi2"), {}, ValueError, "lam"),
        ((torch.ones(4), 0.1, "cvar"), {}, ValueError, "alpha"),
        ((torch.ones(4), 0.1, "smoothed_cvar"), {"alpha": 1.0}, ValueError, "alpha"),
        ((torch.ones(4), 0.1, "kl_cvar"), {"alpha": 0.0}, ValueError, "alpha"),
        ((torch.ones(4), 0.1, "cressie_read"), {}, ValueError, "k"),
        ((torch.ones(4), 0.1, "cressie_read"), {"k": 1.0}, ValueError, "k"),
        ((torch.ones(2, 3), 0.1, "chi2"), {}, ValueError, "losses"),
        ((torch.ones(()), 0.1, "chi2"), {}, ValueError, "losses"),
        ((torch.ones(0), 0.1, "chi2"), {}, ValueError, "losses"),
        ((torch.ones(4, dtype=torch.int64), 0.1, "chi2"), {}, TypeError, "losses"),
        (([1.0, 2.0], 0.1, "chi2"), {}, TypeError, "losses"),
    ],
)
def test_bad_inputs(backend, args, kwargs, exc, word):
    with pytest.raises(exc, match=word):
        dro_ext.robust_objective(*args, **kwargs)
    with pytest.raises(exc, match=word):
        dro_ext.worst_case_weights(*args, **kwargs)


def test_the_remembered_numbers_keep_their_checks(backend):
    # robust_objective remembers the Python numbers it checked: a call with an equal number of another type (True ==
    # 1, 0.5 + 0j == 0.5), an equal "batch" that is not the default's object, a Parameter (a Tensor subclass) and a
    # sparse tensor each still take the checks; a repeated call gives the first call's answer bitwise.
    losses = make_losses(37)
    first = dro_ext.robust_objective(losses, 1.0, "cvar", alpha=0.5)
    again = dro_ext.robust_objective(losses, 1.0, "cvar", alpha=0.5)
    assert all(torch.equal(a, b) for a, b in zip(first, again))
    with pytest.raises(TypeError, match="lam"):
        dro_ext.robust_objective(losses, True, "cvar", alpha=0.5)
    with pytest.raises(TypeError, match="alpha"):
        dro_ext.robust_objective(losses, 1.0, "cvar", alpha=0.5 + 0j)
    batch = "".join(["ba", "tch"])
    assert batch == "batch" and batch is not dro_ext.robust._BATCH_WEIGHTING
    other = dro_ext.robust_objective(losses, 1.0, "cvar", alpha=0.5, weighting=batch)
    assert all(torch.equal(a, b) for a, b in zip(first, other))
    parameter = dro_ext.robust_objective(torch.nn.Parameter(losses.clone()), 1.0, "cvar", alpha=0.5)
    assert all(torch.equal(a, b) for a, b in zip(first, parameter))
    with pytest.raises(ValueError, match="weighting"):
        dro_ext.robust_objective(losses, 1.0, "cvar", alpha=0.5, weighting="population")
    with pytest.raises(TypeError, match="losses"):
        dro_ext.robust_objective(losses.to_sparse(), 1.0, "cvar", alpha=0.5)


@pytest.mark.parametrize(
    "args,exc,word",
    [
        ((torch.ones(4), 0.1, "tv", None, None), ValueError, "divergence"),
        ((torch.ones(4), -0.1, "chi2", None, None), ValueError, "lam"),
        ((torch.ones(4), 0.1, "cvar", None, None), ValueError, "alpha"),
        ((torch.ones(4), 0.1, "cressie_read", None, 0.5), ValueError, "k"),
        ((torch.ones(2, 2), 0.1, "chi2", None, None), ValueError, "losses"),
        ((torch.ones(0), 0.1, "chi2", None, None), ValueError, "losses"),
        # A wrong dtype is a TypeError, as in the Python API.
        ((torch.ones(3, dtype=torch.int32), 0.1, "chi2", None, None), TypeError, "losses"),
    ],
)
def test_native_op_checks(args, exc, word):
    _require_native()
    with pytest.raises(exc, match=word):
        torch.ops.dro_ext.robust_objective(*args)


# ------------------------------------------------------------------------------------------------
# weight_stats
# ------------------------------------------------------------------------------------------------


def test_weight_stats_from_weights(backend):
    w = torch.tensor([1.0, 1.0, 0.0, 2.0], dtype=torch.float64)
    stats = dro_ext.weight_stats(w, groups=torch.tensor([0, 1, 1, 0]), num_groups=3)
    assert stats.ess.item() == pytest.approx(16.0 / 6.0)
    assert stats.max_weight.item() == pytest.approx(0.5)
    assert stats.zero_fraction.item() == pytest.approx(0.25)
    torch.testing.assert_close(stats.group_mass, torch.tensor([0.75, 0.25, 0.0], dtype=torch.float64))
    # num_groups inferred from the ids.
    assert dro_ext.weight_stats(w, groups=torch.tensor([0, 1, 1, 0])).group_mass.shape == (2,)
    assert dro_ext.weight_stats(w).group_mass is None


def test_weight_stats_from_losses(backend):
    losses = make_losses(500)
    q = dro_ext.worst_case_weights(losses, 0.2, "cvar", alpha=0.1)
    stats = dro_ext.weight_stats(losses=losses, lam=0.2, divergence="cvar", alpha=0.1)
    # CVaR at alpha = 0.1: 50 samples of weight 1/50 each.
    assert stats.ess.item() == pytest.approx(50.0)
    assert stats.max_weight.item() == pytest.approx(1.0 / 50.0)
    assert stats.zero_fraction.item() == pytest.approx(0.9)
    assert stats.ess.item() == pytest.approx((q.sum() ** 2 / (q * q).sum()).item())
    # At a given eta: the weights of dro_weights there.
    eta = torch.tensor(1.5, dtype=torch.float64)
    w = dro_ext.dro_weights(losses, eta, 0.2, "chi2")
    stats = dro_ext.weight_stats(losses=losses, eta=eta, lam=0.2, divergence="chi2")
    assert stats.ess.item() == pytest.approx((w.sum() ** 2 / (w * w).sum()).item(), rel=1e-12)
    assert stats.max_weight.item() == pytest.approx((w.max() / w.sum()).item(), rel=1e-12)
    assert stats.zero_fraction.item() == pytest.approx((w == 0).double().mean().item())


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_weight_stats_random(backend, dtype):
    w = torch.rand(70001, dtype=torch.float64)
    w[w < 0.2] = 0.0
    groups = torch.randint(0, 5, (w.numel(),))
    stats = dro_ext.weight_stats(w.to(dtype), groups=groups, num_groups=5)
    q = w / w.sum()
    assert stats.ess.dtype == dtype and stats.group_mass.dtype == dtype
    rtol = 1e-5 if dtype == torch.float32 else 1e-12
    assert stats.ess.item() == pytest.approx(1.0 / (q * q).sum().item(), rel=rtol)
    assert stats.max_weight.item() == pytest.approx(q.max().item(), rel=rtol)
    assert stats.zero_fraction.item() == pytest.approx((w == 0).double().mean().item(), rel=rtol)
    expected = torch.zeros(5, dtype=torch.float64).index_add_(0, groups, q)
    torch.testing.assert_close(stats.group_mass.double(), expected, rtol=rtol, atol=1e-7)
    with pytest.raises(IndexError, match="groups holds an id outside"):
        dro_ext.weight_stats(w, groups=groups, num_groups=4)


def test_weight_stats_are_the_same_bits_on_one_and_two_threads(backend):
    # The fallback's sums of a long tensor take fixed chunks (PyTorch's own split it by the thread count), as the
    # native kernels do.
    w = torch.rand(300_001, dtype=torch.float64).to(torch.float32)
    threads = torch.get_num_threads()
    try:
        results = []
        for n_threads in (1, max(2, threads)):
            torch.set_num_threads(n_threads)
            results.append(dro_ext.weight_stats(w))
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(results[0].ess, results[1].ess) and torch.equal(results[0].max_weight, results[1].max_weight)


def test_weight_stats_opcheck():
    _require_native()
    w = torch.rand(300, dtype=torch.float64)
    torch.library.opcheck(torch.ops.dro_ext.weight_stats.default, (w, torch.randint(0, 3, (300,)), 3))
    torch.library.opcheck(torch.ops.dro_ext.weight_stats.default, (w.float(), None, 0))


def test_weight_stats_bad_inputs():
    w = torch.ones(4)
    with pytest.raises(ValueError, match="not both"):
        dro_ext.weight_stats(w, losses=w, lam=0.1)
    with pytest.raises(ValueError, match="lam"):
        dro_ext.weight_stats(losses=w)
    with pytest.raises(ValueError, match="weights"):
        dro_ext.weight_stats()
    with pytest.raises(ValueError, match="groups"):
        dro_ext.weight_stats(w, groups=torch.zeros(3, dtype=torch.long))
    with pytest.raises(TypeError, match="groups"):
        dro_ext.weight_stats(w, groups=torch.zeros(4))
    with pytest.raises(TypeError, match="weights"):
        dro_ext.weight_stats(torch.ones(4, dtype=torch.long))
    with pytest.raises(TypeError, match="weights must be a dense"):
        dro_ext.weight_stats(torch.ones(4).to_sparse())
    with pytest.raises(ValueError, match="weights must be >= 0, got 1 negative"):
        dro_ext.weight_stats(torch.tensor([1.0, -1.0, 0.0, 2.0]))
    assert math.isnan(dro_ext.weight_stats(torch.tensor([1.0, math.nan, 2.0])).ess)  # NaN is not dropped
    with pytest.raises(TypeError, match="losses must be a dense"):
        dro_ext.robust_objective(torch.ones(4).to_sparse(), 0.1)
    # num_groups as every other entry point checks it (3.5 was truncated, True taken as 1), and not without groups
    ids = torch.tensor([0, 1, 1, 0])
    for bad in (3.5, True, "3"):
        with pytest.raises(TypeError, match="num_groups must be an int"):
            dro_ext.weight_stats(w, groups=ids, num_groups=bad)
    with pytest.raises(ValueError, match="num_groups must be >= 1"):
        dro_ext.weight_stats(w, groups=ids, num_groups=0)
    with pytest.raises(ValueError, match="num_groups=2 was given without groups"):
        dro_ext.weight_stats(w, num_groups=2)


@pytest.mark.parametrize("weights,ess", [([1e20] * 3, 3.0), ([3e38, 3e38], 2.0), ([1e-30, 2e-30, 3e-30], 36 / 14)],
                         ids=["1e20", "3e38", "1e-30"])
def test_weight_stats_of_float32_weights_past_their_squares_range(backend, weights, ess):
    """The fallback squared float32 weights in float32 (NaN past 1e19 or below 1e-19); both backends form the
    statistics in float64 and return them in float32."""
    stats = dro_ext.weight_stats(torch.tensor(weights, dtype=torch.float32))
    assert stats.ess.dtype == torch.float32
    torch.testing.assert_close(stats.ess, torch.tensor(ess, dtype=torch.float32), rtol=1e-6, atol=0)
    torch.testing.assert_close(stats.max_weight, torch.tensor(max(weights) / sum(weights), dtype=torch.float32),
                               rtol=1e-6, atol=0)


@pytest.mark.parametrize("over", ["samples", "groups"])
def test_weight_stats_at_an_eta_where_float32_weights_overflow(backend, over):
    """kl's weights at a given eta pass float32's range (t = 150 here) though their ratios do not: formed in float64,
    the statistics are those of the float64 losses (NaN before), in float32."""
    losses, groups = torch.tensor([0.0, 1.0, 2.0, 1.5]), torch.tensor([0, 1, 2, 2])
    kw = dict(eta=0.5, lam=0.01, divergence="kl", groups=groups, num_groups=3, over=over)
    got, want = dro_ext.weight_stats(losses=losses, **kw), dro_ext.weight_stats(losses=losses.double(), **kw)
    for field, a, b in zip(got._fields, got, want):
        assert a.dtype == torch.float32, field
        assert torch.isfinite(a).all(), field
        torch.testing.assert_close(a, b.float(), rtol=1e-6, atol=1e-30, msg=field)


# ------------------------------------------------------------------------------------------------
# evaluate
# ------------------------------------------------------------------------------------------------


def test_evaluate(backend, capsys):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Dropout(0.5), torch.nn.Linear(8, 1)).double()
    model.train()
    model[2].eval()  # a mixed state, restored as it was
    x, y = torch.randn(53, 4, dtype=torch.float64), torch.randn(53, dtype=torch.float64)
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=10)
    seen = []

    def per_sample_loss(m, batch):
        assert not torch.is_grad_enabled() and not m.training and not m[1].training
        inputs, targets = batch
        seen.append(inputs.shape[0])
        return (m(inputs).squeeze(-1) - targets) ** 2

    value, eta = dro_ext.evaluate(model, loader, per_sample_loss, 0.5, "kl_cvar", alpha=0.2, progress=True)
    assert sum(seen) == 53
    assert model.training and model[0].training and model[1].training and not model[2].training
    model.eval()
    with torch.no_grad():
        losses = (model(x).squeeze(-1) - y) ** 2
    expected = dro_ext.robust_objective(losses, 0.5, "kl_cvar", alpha=0.2)
    torch.testing.assert_close(value, expected[0], rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(eta, expected[1], rtol=1e-12, atol=1e-12)
    assert not value.requires_grad
    assert "6" in capsys.readouterr().err  # 6 batches reported (tqdm or the plain counter)
    dro_ext.evaluate(model, loader, per_sample_loss, 0.5, "chi2", progress=False, device="cpu")
    assert capsys.readouterr().err == ""


def test_evaluate_keeps_each_batch_when_the_loss_function_reuses_its_output(backend):
    """A per-sample loss function that writes each batch's losses (and group ids) into one buffer, as an out= tensor
    or a replayed CUDA graph's static output does: evaluate kept that buffer by reference, so every batch counted as
    the last one (Psi 2.10 for 1.16). A view of a wider output kept the whole output alive."""
    torch.manual_seed(3)
    model = torch.nn.Linear(3, 1).double()
    batches = [(torch.randn(4, 3, dtype=torch.float64), torch.tensor([0, 1, 1, 2]) + i % 2) for i in range(3)]
    with torch.no_grad():
        losses = torch.cat([model(x).squeeze(1) ** 2 for x, _ in batches])
    all_ids = torch.cat([ids for _, ids in batches])
    buffer, id_buffer = torch.empty(4, dtype=torch.float64), torch.empty(4, dtype=torch.int64)

    def into_buffer(m, batch):
        return torch.pow(m(batch[0]).squeeze(1), 2, out=buffer)

    def ids_into_buffer(batch):
        return id_buffer.copy_(batch[1])

    value, eta = dro_ext.evaluate(model, batches, into_buffer, 0.5, progress=False)
    expected = dro_ext.robust_objective(losses, 0.5)
    torch.testing.assert_close((value, eta), expected, rtol=1e-12, atol=0)
    got = dro_ext.evaluate(model, batches, into_buffer, 0.5, groups_fn=ids_into_buffer, num_groups=4, progress=False)
    torch.testing.assert_close(got.value, dro_ext.robust_objective(losses, 0.5, groups=all_ids, num_groups=4)[0],
                               rtol=1e-12, atol=0)
    assert got.group_count.tolist() == torch.bincount(all_ids, minlength=4).tolist()
    kept = []

    def as_a_view(m, batch):
        wide = torch.cat([m(batch[0]) ** 2, torch.zeros(batch[0].shape[0], 1000, dtype=torch.float64)], 1)
        return wide[:, 0]

    real_cat = torch.cat

    def recording_cat(tensors, *args, **kwargs):
        kept.extend(t for t in tensors if isinstance(t, torch.Tensor) and t.dtype == torch.float64)
        return real_cat(tensors, *args, **kwargs)

    torch.cat = recording_cat
    try:
        dro_ext.evaluate(model, batches, as_a_view, 0.5, progress=False)
    finally:
        torch.cat = real_cat
    chunks = [t for t in kept if t.numel() == 4]
    assert chunks and all(t.untyped_storage().nbytes() == 4 * 8 for t in chunks), \
        [t.untyped_storage().nbytes() for t in chunks]


def test_evaluate_rejects_non_per_sample_losses():
    model = torch.nn.Linear(2, 1)
    loader = [(torch.randn(5, 2), torch.randn(5))]
    with pytest.raises(ValueError, match="per_sample_loss_fn"):
        dro_ext.evaluate(model, loader, lambda m, b: m(b[0]).mean(), 0.1, progress=False)
    assert model.training


def test_non_contiguous_losses(backend):
    base = make_losses(2 * 301)
    strided = base[::2]
    assert not strided.is_contiguous()
    for name, kw in CASES:
        torch.testing.assert_close(
            dro_ext.robust_objective(strided, 0.3, name, **kw),
            dro_ext.robust_objective(strided.contiguous(), 0.3, name, **kw),
            rtol=0, atol=0,
        )
        torch.testing.assert_close(
            dro_ext.worst_case_weights(strided, 0.3, name, **kw),
            dro_ext.worst_case_weights(strided.contiguous(), 0.3, name, **kw),
            rtol=0, atol=0,
        )


@pytest.mark.parametrize("name,kw", CASES, ids=CASE_IDS)
def test_infinite_losses(backend, name, kw):
    losses = make_losses(10)
    losses[3] = math.inf
    value, eta = dro_ext.robust_objective(losses, 0.5, name, **kw)
    assert value.item() == math.inf and eta.item() == math.inf
    losses[3] = -math.inf
    value, eta = dro_ext.robust_objective(losses, 0.5, name, **kw)
    assert math.isnan(value.item()) and math.isnan(eta.item())


# ------------------------------------------------------------------------------------------------
# Large inputs: cvar's sample select (N >= 1024 on the CPU), the vectorized min/max and tail sums
# ------------------------------------------------------------------------------------------------


def np_cvar(l, alpha):
    """The tail mean with the fractional boundary sample, by a full sort in float64."""
    l = np.sort(np.asarray(l, dtype=np.float64))[::-1]
    k = alpha * l.size
    j = min(l.size, max(1, math.ceil(k - 1e-12 * k)))
    eta = l[j - 1]
    above = l[l > eta]
    return (math.fsum(above) + (k - above.size) * eta) / k, eta


def _strided_trap(n):
    # Every 8th loss large, the others small: a sample strided by a multiple of 8 (the native select's stride is a
    # power of two near cbrt(N), at least 8 from 1024 losses on) sees only the large ones, so its bracket misses and
    # the exact fallback must answer.
    losses = torch.rand(n, dtype=torch.float64)
    losses[::8] += 100.0
    return losses


@pytest.mark.parametrize("alpha", [1e-4, 0.1, 0.5, 0.999])
@pytest.mark.parametrize("layout", ["lognormal", "ties", "sorted", "strided_trap"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16], ids=["f64", "f32", "bf16"])
@pytest.mark.parametrize("n", [1029, 4097, (1 << 14) + 7, (1 << 16) + 3, (1 << 20) + 17])
def test_cvar_large_matches_full_sort(backend, alpha, layout, dtype, n):
    if layout == "lognormal":
        losses = make_losses(n)
    elif layout == "ties":
        losses = torch.randint(0, 7, (n,)).double()  # seven distinct values: the boundary is a tie
    elif layout == "sorted":
        losses = torch.sort(make_losses(n)).values
    else:
        losses = _strided_trap(n)
    losses = losses.to(dtype)
    value, eta = dro_ext.robust_objective(losses, 0.5, "cvar", alpha=alpha)
    ref_value, ref_eta = np_cvar(losses.double().numpy(), alpha)
    assert eta.item() == ref_eta
    # The float64 sum of the tail in another order, then the value rounded to the input's dtype.
    tol = {torch.float64: 1e-13, torch.float32: 1e-6, torch.bfloat16: 2.0 ** -8}[dtype]
    assert value.item() == pytest.approx(ref_value, rel=tol), (value.item(), ref_value)


@pytest.mark.parametrize("name,kw", CASES, ids=CASE_IDS)
@pytest.mark.parametrize("where", ["first", "middle", "last"])
@pytest.mark.parametrize("n", [1001, (1 << 19) + 3])
def test_nan_anywhere_propagates(backend, name, kw, where, n):
    # The min/max pass reads whole vectors and then a scalar tail: a NaN in either part must be seen.
    losses = make_losses(n)
    losses[{"first": 0, "middle": n // 2 + 1, "last": n - 1}[where]] = float("nan")
    value, eta = dro_ext.robust_objective(losses, 0.5, name, **kw)
    assert math.isnan(value.item()) and math.isnan(eta.item())


@pytest.mark.parametrize("k", [2.0], ids=["k2"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["f64", "f32"])
def test_linear_exact_segment_large(backend, k, dtype):
    # cressie_read at k = 2 ends on an exact segment solve: sum and count of the losses above a cut, taken
    # by the vectorized tail-sum kernel; the value must match the scalar minimization.
    n = (1 << 19) + 5
    losses = make_losses(n, dtype)
    value, eta = dro_ext.robust_objective(losses, 0.1, "cressie_read", k=k)
    ref = reference_psi(losses.double().numpy(), 0.1, "cressie_read", {"k": k})
    tol = 1e-12 if dtype == torch.float64 else 2e-6
    assert value.item() == pytest.approx(ref, rel=tol)


# ------------------------------------------------------------------------------------------------
# The PyTorch solver's passes by blocks (dro_ext._divergences.blocked_sums)
# ------------------------------------------------------------------------------------------------


# Sizes at and past the thresholds of fixed_order_sum (32768 summed whole, chunks of 16384), and past the default
# block (8 chunks) with a partial last chunk.
_BLOCKED_SIZES = [1, 5, 32768, 32769, 16384 * 9 + 7]


@pytest.mark.parametrize("weighted", [False, True], ids=["unweighted", "weighted"])
@pytest.mark.parametrize("name,kw", CASES + [("cressie_read", {"k": 2.0}), ("cressie_read", {"k": 1.5})],
                         ids=CASE_IDS + ["cressie_read-2", "cressie_read-1.5"])
def test_solver_by_blocks_is_the_same_bits_as_whole(monkeypatch, name, kw, weighted):
    """(Psi, eta*) and the weights of dro_ext._solver are the same bits evaluated a chunk or two at a time as over
    the whole vector (a block past every size), whatever the size and with per-point weights: the blocks are whole
    chunks of fixed_order_sum, so every chunk's sum and the sum of the chunks' sums are the same."""
    from dro_ext import _divergences, _solver

    spec = _divergences.check_divergence(name, kw.get("alpha"), kw.get("k"))
    chunk = _divergences._SUM_CHUNK
    for n in _BLOCKED_SIZES:
        x = make_losses(n)
        # (cvar's weighted solve sorts: no pass by blocks past its boundary count)
        w = torch.rand(n, dtype=torch.float64) if weighted and (name != "cvar" or n < 100000) else None
        results = []
        for block in (1 << 40, chunk, 2 * chunk):
            monkeypatch.setattr(_divergences, "_SUM_BLOCK", block)
            solution = _solver.solve(x, 0.3, spec, w=w)
            q = _solver.weights(x, torch.tensor(solution.eta, dtype=torch.float64), solution.n, 0.3, spec, w=w)
            results.append((solution, q))
        (whole, q_whole), *blocked = results
        for solution, q in blocked:
            assert repr(solution) == repr(whole), (n, solution, whole)  # repr: the same bits, NaN included
            assert torch.equal(q, q_whole), n


def test_blocked_sums_of_a_selection_are_fixed_order_sum_bits(monkeypatch):
    """A selection v[mask] by blocks (the segment solve's sums) is summed as fixed_order_sum sums the whole
    selection: its chunks straddle the blocks, and a selection of at most 32768 is summed whole."""
    from dro_ext import _divergences

    monkeypatch.setattr(_divergences, "_SUM_BLOCK", _divergences._SUM_CHUNK)
    x = make_losses((1 << 18) + 3)
    for cut in (-1.0, 0.5, 2.0, 30.0, float(x.max())):
        expected = _divergences.fixed_order_sum(x[x > cut])
        (got,) = _divergences.blocked_sums(lambda v: [v[v > cut]], x)
        assert got.dtype == expected.dtype and repr(got.item()) == repr(expected.item()), cut


def _peak_growth_mib(script: str, n: int, **env: str) -> float:
    """How far ru_maxrss (KiB on Linux) rose over what script measures, in a fresh process of one thread given n."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    out = subprocess.run([sys.executable, "-c", script, str(n)], cwd=root, env=dict(os.environ, OMP_NUM_THREADS="1",
                         **env), capture_output=True, text=True, timeout=600, check=True)
    return int(out.stdout.split()[-1]) / 1024


_BACKWARD_PEAK_SCRIPT = """
import resource, sys, torch, dro_ext
warm = torch.rand(1 << 16, requires_grad=True)  # the allocator's and the solver's first calls
dro_ext.robust_objective(warm, 0.5, "chi2")[0].backward()
x = torch.rand(int(sys.argv[1]), requires_grad=True)
value, _ = dro_ext.robust_objective(x, 0.5, "chi2")
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
value.backward()
assert x.grad is not None and x.grad.shape == x.shape
print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="ru_maxrss in KiB is Linux's")
def test_the_backward_of_the_robust_objective_holds_one_gradient():
    """robust_objective's backward over 2^24 float32 losses (64 MiB) grows the peak memory by the gradient it returns,
    the weights scaled where they lie: not by the weights and their scaled copy (128 MiB). In a fresh process."""
    n = 1 << 24
    growth_mib = _peak_growth_mib(_BACKWARD_PEAK_SCRIPT, n)
    assert growth_mib <= 4 * n / 2**20 * 1.5, f"peak memory grew by {growth_mib:.0f} MiB"


_SUM_PEAK_SCRIPT = """
import resource, sys, torch
from dro_ext._divergences import fixed_order_sum
fixed_order_sum(torch.rand(1 << 16, dtype=torch.float64))  # warm-up
x = torch.rand(int(sys.argv[1]), dtype=torch.float64)
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
total = fixed_order_sum(x)
print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="ru_maxrss in KiB is Linux's")
def test_fixed_order_sum_makes_no_copy_of_its_input():
    """fixed_order_sum of 2^23 + 1 float64 numbers (64 MiB, a partial last chunk) grows the peak memory by its chunks'
    sums and one padded chunk, not by a padded copy of the whole (64 MiB). In a fresh process, where ru_maxrss is
    this call's peak alone."""
    growth_mib = _peak_growth_mib(_SUM_PEAK_SCRIPT, (1 << 23) + 1)
    assert growth_mib <= 16, f"peak memory grew by {growth_mib:.0f} MiB"


def test_fixed_order_sum_is_thread_independent_and_close_to_the_exact_sum():
    """The chunks' sums, the last one partial, at one and two threads: the same bits, within a float32 sum's
    rounding of the float64 sum."""
    from dro_ext import _divergences

    for n in (32769, 16384 * 5, 16384 * 5 + 1, 16384 * 40 + 9999):
        x = torch.randn(n, dtype=torch.float64, generator=torch.Generator().manual_seed(n)).float()
        threads = torch.get_num_threads()
        try:
            sums = []
            for count in (1, 2):
                torch.set_num_threads(count)
                sums.append(_divergences.fixed_order_sum(x))
        finally:
            torch.set_num_threads(threads)
        assert torch.equal(sums[0], sums[1]), n
        exact = x.double().sum()
        assert abs(float(sums[0]) - float(exact)) <= 1e-6 * float(x.double().abs().sum()), n


_PEAK_SCRIPT = """
import resource, sys, torch, dro_ext
cases = [("chi2", {}), ("cressie_read", {"k": 3.0})]
for name, kw in cases:  # warm-up: the allocator's and the solver's first calls
    dro_ext.robust_objective(torch.rand(1 << 16), 0.5, name, **kw)
x = torch.rand(int(sys.argv[1]))
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
for name, kw in cases:
    dro_ext.robust_objective(x, 0.5, name, **kw)
print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="ru_maxrss in KiB is Linux's")
def test_fallback_solve_memory_is_a_float64_copy_and_a_few_blocks():
    """The fallback's robust_objective over 2^23 float32 losses grows the peak memory by about its float64 copy of
    them (64 MiB) and a few blocks of the solver's passes (1 MiB a float64 vector) with the allocator's slack (about
    110 MiB in all, bounded here at 256 MiB beyond the copy): not by the float64 N-vectors that the passes over the
    whole vector took (1.4 GiB). In a fresh process, where ru_maxrss is this call's peak alone."""
    n = 1 << 23
    growth_mib = _peak_growth_mib(_PEAK_SCRIPT, n, DRO_EXT_FORCE_PYTHON="1")
    float64_copy_mib = 8 * n / 2**20
    assert growth_mib <= float64_copy_mib + 256, f"peak memory grew by {growth_mib:.0f} MiB"
