"""The exact robust objective over groups: robust_objective, worst_case_weights, weight_stats and evaluate with
groups= and num_groups= (dro_ext/group_evaluation.py, docs/design.md section 1.9).

The reference is written from the formula, in float64: Psi = min over eta of eta + lam sum_g p_g psi*((m_g - eta)/lam)
over the groups present, p_g = n_g / N, minimized by scipy's bounded scalar minimizer; q_g = p_g psi*'((m_g - eta)/lam).
"""
import math

import numpy as np
import pytest
import torch
from scipy.optimize import minimize_scalar

import dro_ext
import reference as ref
from reference import DTYPES, case_kwargs
from dro_ext import _backend



def random_batch(n, num_groups, dtype=torch.float64, absent=()):
    """n positive losses and their group ids in [0, num_groups), none of them in `absent`."""
    allowed = torch.tensor([g for g in range(num_groups) if g not in absent])
    groups = allowed[torch.randint(len(allowed), (n,))]
    return (torch.randn(n, dtype=torch.float64) * 0.8).exp().to(dtype), groups


# ---------------------------------------------------------------------------------------------------
# float64 references, from the formulas
# ---------------------------------------------------------------------------------------------------


def ref_means(losses, groups, num_groups, weights=None):
    """(m, p, present) over the present groups only: their mean losses and weights (n_g, or the given weights,
    renormalized over them), float64 numpy."""
    l, g = losses.detach().double().cpu().numpy(), groups.cpu().numpy()
    present = [h for h in range(num_groups) if np.any(g == h)]
    m = np.array([l[g == h].mean() for h in present])
    if weights is None:
        p = np.array([np.sum(g == h) for h in present], dtype=np.float64)
    else:
        p = np.asarray(weights, dtype=np.float64)[present]
    return m, p / p.sum(), present


def ref_dual(m, p, lam, name, alpha=None, k=None):
    def f(eta):
        t = torch.from_numpy((m - eta) / lam)
        return eta + lam * float(np.dot(p, ref.psi_star(t, name, alpha, k).numpy()))
    return f


def ref_psi(losses, groups, num_groups, lam, name, alpha=None, k=None, weights=None):
    """min over eta in [min m, max m] of the group dual, by a bounded scalar minimization in float64."""
    m, p, _ = ref_means(losses, groups, num_groups, weights)
    f = ref_dual(m, p, lam, name, alpha, k)
    lo, hi = float(m.min()), float(m.max())
    if lo == hi:
        return f(lo)
    res = minimize_scalar(f, bounds=(lo, hi), method="bounded",
                          options={"xatol": 1e-12 * max(1.0, abs(hi)), "maxiter": 2000})
    # The dual is piecewise smooth with kinks at the group means (cvar: piecewise linear): try them too.
    return min([res.fun, f(lo), f(hi)] + [f(x) for x in m])


def ref_group_weights(losses, groups, num_groups, eta, lam, name, alpha=None, k=None, weights=None):
    """q_g = p_g psi*'((m_g - eta)/lam) over all num_groups groups (0 for an absent one), float64."""
    m, p, present = ref_means(losses, groups, num_groups, weights)
    slope = ref.psi_star_first(torch.from_numpy((m - eta) / lam), name, alpha, k)
    q = np.zeros(num_groups)
    q[present] = p * slope.numpy()
    return q


# ---------------------------------------------------------------------------------------------------
# Value, eta* and q against the references
# ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("n,num_groups", [(1, 1), (7, 3), (60, 5), (333, 12), (5, 17)])
@pytest.mark.parametrize("lam", [0.1, 1.0])
@pytest.mark.parametrize("name,params", ref.CASES, ids=ref.CASE_IDS)
def test_matches_scalar_minimization(backend, name, params, lam, n, num_groups):
    kw = case_kwargs(params)
    losses, groups = random_batch(n, num_groups)
    value, eta = dro_ext.robust_objective(losses, lam, name, groups=groups, num_groups=num_groups, **kw)
    assert value.shape == () and value.dtype == torch.float64 and eta.dtype == torch.float64
    expected = ref_psi(losses, groups, num_groups, lam, name, **kw)
    assert abs(value.item() - expected) <= 1e-10 * (1.0 + abs(expected)), (value.item(), expected)
    m, p, _ = ref_means(losses, groups, num_groups)
    # eta* lies between the group means that group_sums formed, whose summation order (fixed lanes and parts) may
    # round a mean an ulp away from numpy's sequential one.
    slack = 4 * np.finfo(np.float64).eps * max(1.0, float(np.abs(m).max()))
    assert m.min() - slack <= eta.item() <= m.max() + slack
    assert abs(ref_dual(m, p, lam, name, **kw)(eta.item()) - expected) <= 1e-10 * (1.0 + abs(expected))
    # The minimum of group_dro_loss's objective (scale 1): equal at eta*, above it elsewhere.
    at_eta = dro_ext.group_dro_loss(losses, groups, num_groups, eta, lam, name, **kw)
    assert abs(at_eta.item() - value.item()) <= 1e-10 * (1.0 + abs(expected))
    for shift in (-0.1, 0.05):
        assert dro_ext.group_dro_loss(losses, groups, num_groups, eta + shift, lam, name, **kw) >= value - 1e-12


@pytest.mark.parametrize("n,num_groups", [(7, 3), (60, 5), (333, 12), (5, 17)])
@pytest.mark.parametrize("name,params", ref.CASES, ids=ref.CASE_IDS)
def test_worst_case_group_distribution(backend, name, params, n, num_groups):
    kw = case_kwargs(params)
    lam = 0.3
    losses, groups = random_batch(n, num_groups, absent=(1,))
    _, eta = dro_ext.robust_objective(losses, lam, name, groups=groups, num_groups=num_groups, **kw)
    q = dro_ext.worst_case_weights(losses, lam, name, groups=groups, num_groups=num_groups, **kw)
    assert q.shape == (num_groups,) and q.dtype == torch.float64 and not q.requires_grad
    assert q[1] == 0.0 and bool((q >= 0).all())
    assert abs(q.sum().item() - 1.0) <= 1e-12
    expected = ref_group_weights(losses, groups, num_groups, eta.item(), lam, name, **kw)
    m, p, present = ref_means(losses, groups, num_groups)
    if name == "cvar":
        # psi*' jumps at t = 0: above eta* a group weighs p_g/alpha, below 0, at eta* what makes the sum one.
        alpha = kw["alpha"]
        # (the reference means and ours may differ in the last bit: within a few roundings of eta* is the boundary)
        band = 1e-14 * abs(eta.item())
        for mean, share, g in zip(m, p, present):
            if mean > eta.item() + band:
                assert abs(q[g].item() - share / alpha) <= 1e-12
            elif mean < eta.item() - band:
                assert q[g].item() == 0.0
            else:
                assert -1e-12 <= q[g].item() <= share / alpha + 1e-12
    else:
        # the reference weights at eta* sum to one up to eta*'s rounding; compare them normalized
        np.testing.assert_allclose(q.numpy(), expected / expected.sum(), rtol=1e-8, atol=1e-12)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("name,params", ref.CASES, ids=ref.CASE_IDS)
def test_dtypes(backend, name, params, dtype):
    kw = case_kwargs(params)
    lam = 0.5
    losses, groups = random_batch(101, 7, dtype, absent=(3,))
    value, eta = dro_ext.robust_objective(losses, lam, name, groups=groups.to(torch.int32), num_groups=7, **kw)
    assert value.dtype == dtype and eta.dtype == (torch.float64 if dtype == torch.float64 else torch.float32)
    # The reference on the rounded inputs, in float64.
    expected = ref_psi(losses.double(), groups, 7, lam, name, **kw)
    torch.testing.assert_close(value.double(), torch.tensor(expected, dtype=torch.float64), **ref.tolerances(dtype))
    q = dro_ext.worst_case_weights(losses, lam, name, groups=groups, num_groups=7, **kw)
    assert q.dtype == dtype and q.shape == (7,) and q[3] == 0
    torch.testing.assert_close(q.double().sum(), torch.tensor(1.0, dtype=torch.float64), **ref.tolerances(dtype))


# ---------------------------------------------------------------------------------------------------
# Population and tensor weightings: the solver over weighted group means
# ---------------------------------------------------------------------------------------------------

WEIGHTINGS = {
    # population counts unlike the batch's; a tensor with a zero weight on a present group and one on an absent one
    "population": lambda g: dict(weighting="population", group_counts=[3.0, 1.0, 7.0, 2.0, 5.0, 0.5][:g]),
    "tensor": lambda g: dict(weighting=torch.tensor([0.0, 2.0, 1.0, 0.25, 4.0, 1.5][:g], dtype=torch.float64)),
}


def weighting_vector(options):
    return options["group_counts"] if options["weighting"] == "population" else options["weighting"].tolist()


@pytest.mark.parametrize("weighting", list(WEIGHTINGS))
@pytest.mark.parametrize("n", [1, 9, 80])
@pytest.mark.parametrize("lam", [0.1, 1.0])
@pytest.mark.parametrize("name,params", ref.CASES, ids=ref.CASE_IDS)
def test_weighted_matches_scalar_minimization(backend, name, params, lam, n, weighting):
    kw = case_kwargs(params)
    options = WEIGHTINGS[weighting](6)
    losses, groups = random_batch(n, 6, absent=(5,))
    if n == 1:
        groups[:] = 1  # a present group of positive weight
    value, eta = dro_ext.robust_objective(losses, lam, name, groups=groups, num_groups=6, **options, **kw)
    assert value.dtype == torch.float64 and eta.dtype == torch.float64
    weights = weighting_vector(options)
    expected = ref_psi(losses, groups, 6, lam, name, **kw, weights=weights)
    assert abs(value.item() - expected) <= 1e-10 * (1.0 + abs(expected)), (value.item(), expected)
    m, p, present = ref_means(losses, groups, 6, weights)
    assert abs(ref_dual(m, p, lam, name, **kw)(eta.item()) - expected) <= 1e-10 * (1.0 + abs(expected))
    # group_dro_loss's objective at eta* is the minimum
    at_eta = dro_ext.group_dro_loss(losses, groups, 6, eta, lam, name, **options, **kw)
    assert abs(at_eta.item() - value.item()) <= 1e-10 * (1.0 + abs(expected))
    q = dro_ext.worst_case_weights(losses, lam, name, groups=groups, num_groups=6, **options, **kw)
    assert q.shape == (6,) and q[5] == 0 and bool((q >= 0).all()) and abs(q.sum().item() - 1.0) <= 1e-12
    if name != "cvar" and n > 1:
        expected_q = ref_group_weights(losses, groups, 6, eta.item(), lam, name, **kw, weights=weights)
        np.testing.assert_allclose(q.numpy(), expected_q / expected_q.sum(), rtol=1e-8, atol=1e-12)
    if name == "cvar":
        # q_g <= p_g / alpha, and the mass above eta* is taken whole
        cap = np.zeros(6)
        cap[present] = p / kw["alpha"]
        assert bool(np.all(q.numpy() <= cap * (1 + 1e-12) + 1e-15))
        for mean, g in zip(m, present):
            if mean > eta.item() * (1 + 1e-14):
                assert abs(q[g].item() - cap[g]) <= 1e-12


@pytest.mark.parametrize("name,params", ref.CASES, ids=ref.CASE_IDS)
def test_population_at_the_batch_counts_is_the_batch_weighting(backend, name, params):
    kw = case_kwargs(params)
    losses, groups = random_batch(70, 5)
    counts = torch.bincount(groups, minlength=5).double()
    batch = dro_ext.robust_objective(losses, 0.3, name, groups=groups, num_groups=5, **kw)
    population = dro_ext.robust_objective(losses, 0.3, name, groups=groups, num_groups=5, weighting="population",
                                          group_counts=counts, **kw)
    torch.testing.assert_close(population[0], batch[0], rtol=1e-12, atol=1e-13)
    if name != "cvar":  # cvar's minimizers form an interval: each solver may return another point of it
        torch.testing.assert_close(population[1], batch[1], rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("name,params", ref.CASES, ids=ref.CASE_IDS)
def test_weighted_solver_equals_repeated_points(name, params):
    # Integer weights are repeated points: the solver with w equals the unweighted solver on the repetitions. (The
    # weights are scaled to sum to one: n is that sum.)
    from dro_ext import _solver
    from dro_ext._divergences import check_divergence

    spec = check_divergence(name, **case_kwargs(params))
    x = (torch.randn(9, dtype=torch.float64) * 0.8).exp()
    w = torch.tensor([1.0, 3.0, 2.0, 1.0, 5.0, 1.0, 2.0, 4.0, 1.0], dtype=torch.float64)
    got = _solver.solve(x, 0.3, spec, w=w)
    expected = _solver.solve(x.repeat_interleave(w.long()), 0.3, spec)
    assert abs(got.n - 1.0) <= 1e-15 and abs(got.value - expected.value) <= 1e-13 * abs(expected.value)
    q = _solver.weights(x, torch.tensor(got.eta, dtype=torch.float64), got.n, 0.3, spec, w=w)
    q_repeated = _solver.weights(x.repeat_interleave(w.long()), torch.tensor(expected.eta, dtype=torch.float64),
                                 expected.n, 0.3, spec)
    sums = torch.zeros(9, dtype=torch.float64).index_add(0, torch.arange(9).repeat_interleave(w.long()), q_repeated)
    torch.testing.assert_close(q, sums, rtol=1e-9, atol=1e-13)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("name,params", ref.CASES, ids=ref.CASE_IDS)
def test_weighted_dtypes(backend, name, params, dtype):
    kw = case_kwargs(params)
    options = WEIGHTINGS["population"](6)
    losses, groups = random_batch(64, 6, dtype)
    value, eta = dro_ext.robust_objective(losses, 0.5, name, groups=groups, num_groups=6, **options, **kw)
    assert value.dtype == dtype and eta.dtype == (torch.float64 if dtype == torch.float64 else torch.float32)
    expected = ref_psi(losses.double(), groups, 6, 0.5, name, **kw, weights=options["group_counts"])
    torch.testing.assert_close(value.double(), torch.tensor(expected, dtype=torch.float64), **ref.tolerances(dtype))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("weighting", ["batch", "population"])
def test_a_group_whose_sum_passes_the_dtypes_range_keeps_its_finite_mean(backend, dtype, weighting):
    """Group 0's float32 (or bfloat16) sum passes float32's largest number, its mean does not: Psi, q, the gradient
    and evaluate's report are those of the finite means, not of a sum rounded to +inf."""
    losses = torch.tensor([3e38, 3e38, 1.0], dtype=dtype)
    groups = torch.tensor([0, 0, 1])
    weights = None if weighting == "batch" else [1.0, 3.0]
    options = {} if weights is None else dict(weighting="population", group_counts=weights)
    kw = dict(groups=groups, num_groups=2, **options)
    tol = ref.tolerances(dtype)
    for name, params, lam in (("cvar", dict(alpha=0.5), 1.0), ("chi2", {}, 1e38)):
        l = losses.clone().requires_grad_()
        value, eta = dro_ext.robust_objective(l, lam, name, **kw, **params)
        (grad,) = torch.autograd.grad(value, l)
        expected = ref_psi(losses.double(), groups, 2, lam, name, **case_kwargs(params), weights=weights)
        assert math.isfinite(expected) and value.dtype == dtype
        torch.testing.assert_close(value.double(), torch.tensor(expected, dtype=torch.float64), **tol)
        q = dro_ext.worst_case_weights(losses, lam, name, **kw, **params)
        if name == "cvar":  # the tail of mass 1/2 from the top: group 0 whole where its weight reaches 1/2
            want_q = np.array([1.0, 0.0] if weights is None else [0.5, 0.5])
        else:
            want_q = ref_group_weights(losses.double(), groups, 2, float(eta), lam, name, weights=weights)
        torch.testing.assert_close(q.double(), torch.from_numpy(want_q), **tol)
        # d l_i = q_{g_i} / n_{g_i}
        torch.testing.assert_close(grad.double(), (q.double() / torch.tensor([2.0, 1.0]))[groups], **tol)
    report = dro_ext.evaluate(torch.nn.Identity(), [(losses, groups)], lambda m, b: m(b[0]), 1.0, "cvar", alpha=0.5,
                              groups_fn=lambda b: b[1], num_groups=2, progress=False, **options)
    torch.testing.assert_close(report.group_loss.double(), losses.double()[1:], rtol=0.0, atol=0.0)
    psi = losses.double()[0] if weights is None else (losses.double()[0] + 1.0) / 2
    torch.testing.assert_close(report.value.double(), psi.to(dtype).double(), rtol=0.0, atol=0.0)
    assert int(report.worst_group) == 0


@pytest.mark.parametrize("weighting", ["batch", "population"])
def test_float32_group_means_are_not_rounded_before_the_solve(backend, weighting):
    """Group 0's exact mean, 1 + 1.5 * 2^-23, lies between two float32 numbers, and group 1's is the upper one: at
    lam = 1e-10 the worst case is all on group 1 (exp(-596) on group 0). Means rounded to float32 first made the two
    equal, and q the weights p."""
    losses = torch.tensor([1 + 2**-23, 1 + 2**-22, 1 + 2**-22], dtype=torch.float32)
    groups = torch.tensor([0, 0, 1])
    options = {} if weighting == "batch" else dict(weighting="population", group_counts=[1.0, 1.0])
    kw = dict(groups=groups, num_groups=2, **options)
    for name, params in (("kl", {}), ("chi2", {}), ("cressie_read", dict(k=3.0))):
        q = dro_ext.worst_case_weights(losses, 1e-10, name, **kw, **params)
        torch.testing.assert_close(q.double(), torch.tensor([0.0, 1.0], dtype=torch.float64), rtol=0.0, atol=1e-7)
        stats = dro_ext.weight_stats(losses=losses, lam=1e-10, divergence=name, over="groups", groups=groups,
                                     num_groups=2, **params) if weighting == "batch" else None
        if stats is not None:
            torch.testing.assert_close(stats.group_mass.double(), q.double(), rtol=0.0, atol=1e-7)


@pytest.mark.parametrize("name,params", ref.CASES, ids=ref.CASE_IDS)
def test_group_weights_count_relative_to_each_other_whatever_their_scale(backend, name, params):
    """Psi, eta* and q depend on the ratios of the group weights alone: weights of 1e308 (population counts or a
    tensor) overflowed their total (NaN, q = 0, an OverflowError from the tail size, a math domain error) and
    subnormal ones lost their ratio; they give what the same weights scaled to a largest of 1 give."""
    kw = case_kwargs(params)
    losses = torch.tensor([1.0, 2.0, 1.25, 3.0], dtype=torch.float64)
    groups = torch.tensor([0, 1, 1, 2])
    lam = 0.7
    for weights in ([1e308, 1e308, 5e307], [1e-323, 2e-323, 1e-323], [1e10, 1e10, 5e9]):
        ratio = [w / max(weights) for w in weights]
        want_value, want_eta = dro_ext.robust_objective(losses, lam, name, groups=groups, num_groups=3,
                                                        weighting=torch.tensor(ratio, dtype=torch.float64), **kw)
        want_q = dro_ext.worst_case_weights(losses, lam, name, groups=groups, num_groups=3,
                                            weighting=torch.tensor(ratio, dtype=torch.float64), **kw)
        assert torch.isfinite(want_value) and abs(float(want_q.sum()) - 1.0) < 1e-12
        expected = ref_psi(losses, groups, 3, lam, name, **kw, weights=ratio)
        assert abs(want_value.item() - expected) <= 1e-10 * (1.0 + abs(expected))
        options = [dict(weighting=torch.tensor(weights, dtype=torch.float64)), dict(weighting=weights)]
        if min(weights) > 0:
            options.append(dict(weighting="population", group_counts=weights))
        for option in options:
            value, eta = dro_ext.robust_objective(losses, lam, name, groups=groups, num_groups=3, **option, **kw)
            q = dro_ext.worst_case_weights(losses, lam, name, groups=groups, num_groups=3, **option, **kw)
            torch.testing.assert_close(value, want_value, rtol=1e-14, atol=0.0)
            if name != "cvar":  # cvar's minimizers form an interval
                torch.testing.assert_close(eta, want_eta, rtol=1e-12, atol=1e-14)
            torch.testing.assert_close(q, want_q, rtol=1e-12, atol=1e-15)


@pytest.mark.parametrize("weighting", ["population", "tensor"])
def test_kl_over_groups_does_not_cancel_against_a_light_largest_mean(backend, weighting):
    """kl's closed form is max m + lam log(sum_g p_g e^((m_g - max m)/lam)) whatever max m's weight: with the largest
    mean's weight 1e-15 of the others and lam far above the means, that sum cancelled down to a few roundings of
    max m (12% low at means (1e28, 2), weights (1, 1e15), lam = 1e30), far more than a rounding of the means or the
    weights moves Psi. Random means and weights of that kind, against 60-digit arithmetic; and lam far below the
    means with a largest mean of weight 1e-17 of the others, where the pass that recovers those digits must not
    fail (its centred mean of expm1 rounds to -1 there: log1p(-1)) nor move eta* off."""
    mp = ref.mpmath.mp
    for case in range(16):
        far_above = case % 2 == 0
        big = 10.0 ** (20.0 + 8.0 * torch.rand(()).item()) if far_above else 1.0 + torch.rand(()).item()
        others = (5.0 if far_above else 0.5) * torch.rand(4, dtype=torch.float64)
        losses = torch.tensor([big, *others.tolist()], dtype=torch.float64)
        groups = torch.tensor([0, 1, 1, 2, 2])
        light = 9.0 + 6.0 * torch.rand(2) if far_above else 17.0 + torch.rand(2)
        weights = [1.0, 10.0 ** light[0].item(), 10.0 ** light[1].item()]
        lam = 10.0 ** ((28.0 + 5.0 * torch.rand(())).item() if far_above else (-20.0 + 3.0 * torch.rand(())).item())
        option = (dict(weighting="population", group_counts=weights) if weighting == "population"
                  else dict(weighting=torch.tensor(weights, dtype=torch.float64)))
        value, eta = dro_ext.robust_objective(losses, lam, "kl", groups=groups, num_groups=3, **option)
        q = dro_ext.worst_case_weights(losses, lam, "kl", groups=groups, num_groups=3, **option)
        with mp.workdps(60):
            m = [mp.mpf(big), mp.mpf(losses[1].item()) / 2 + mp.mpf(losses[2].item()) / 2,
                 mp.mpf(losses[3].item()) / 2 + mp.mpf(losses[4].item()) / 2]
            total = mp.fsum(mp.mpf(w) for w in weights)
            terms = [mp.mpf(w) / total * mp.exp(mg / lam) for w, mg in zip(weights, m)]
            exact = lam * mp.log(mp.fsum(terms))
            exact_q = [float(t / mp.fsum(terms)) for t in terms]
        at = f"max m {big:.3g}, weights {weights}, lam {lam:.3g}"
        assert abs(value.item() - float(exact)) <= 1e-13 * abs(float(exact)), (at, value.item(), float(exact))
        assert eta.item() == value.item(), at  # kl: Psi = eta*
        torch.testing.assert_close(q, torch.tensor(exact_q, dtype=torch.float64), rtol=1e-13, atol=0.0, msg=at)


@pytest.mark.parametrize("weighting", list(WEIGHTINGS))
@pytest.mark.parametrize("name,params", ref.CASES, ids=ref.CASE_IDS)
def test_weighted_gradcheck(backend, name, params, weighting):
    kw = case_kwargs(params)
    options = WEIGHTINGS[weighting](4)
    losses, groups = random_batch(12, 4)
    losses.requires_grad_()
    assert torch.autograd.gradcheck(
        lambda l: dro_ext.robust_objective(l, 0.7, name, groups=groups, num_groups=4, **options, **kw)[0],
        (losses,), eps=1e-6, atol=1e-7, rtol=1e-5)


@pytest.mark.parametrize("weighting", ["batch", *WEIGHTINGS])
def test_eta_star_carries_no_gradient(backend, weighting):
    # As the sample-level call's: a gradient of zeros through eta* would be silently wrong (it moves with the losses).
    options = WEIGHTINGS[weighting](4) if weighting in WEIGHTINGS else {}
    losses, groups = random_batch(12, 4)
    value, eta = dro_ext.robust_objective(losses.requires_grad_(), 0.7, "chi2", groups=groups, num_groups=4,
                                          **options)
    assert value.requires_grad and not eta.requires_grad


def test_weighted_without_weight_on_the_present_groups_is_nan(backend):
    # p renormalized over the present groups is 0/0: the value, eta*, the group distribution and the gradient are NaN
    # (q was zeros, which sum to no distribution, and the gradient 0)
    losses, groups = torch.rand(4, dtype=torch.float64).requires_grad_(), torch.tensor([0, 0, 2, 2])
    kw = dict(groups=groups, num_groups=3, weighting=torch.tensor([0.0, 1.0, 0.0], dtype=torch.float64))
    value, eta = dro_ext.robust_objective(losses, 0.3, "kl", **kw)
    assert math.isnan(value.item()) and math.isnan(eta.item())
    assert torch.isnan(dro_ext.worst_case_weights(losses, 0.3, "kl", **kw)).all()
    assert torch.isnan(torch.autograd.grad(value, losses)[0]).all()


@pytest.mark.parametrize("name,params", ref.CASES, ids=ref.CASE_IDS)
def test_a_group_of_weight_zero_is_dropped_whatever_its_mean(backend, name, params):
    """Psi, eta* and q with a group of weight 0 are those of the batch without it (q = 0 there, its losses a zero
    gradient), also where its mean lies far above the others': kept in the solve, it set kl's shift (every weighted
    exp underflowed: a math domain error) and psi*' overflowed in the Newton sums and q (0 * inf = NaN). A NaN mean
    of weight 0 still makes the solution NaN."""
    kw = dict(weighting=torch.tensor([1.0, 3.0, 0.0], dtype=torch.float64), **case_kwargs(params))
    losses = torch.tensor([1.0, 2.0, 1.5, 1e3, 3e3], dtype=torch.float64)
    groups = torch.tensor([0, 1, 1, 2, 2])
    l = losses.clone().requires_grad_()
    value, eta = dro_ext.robust_objective(l, 1e-3, name, groups=groups, num_groups=3, **kw)
    (grad,) = torch.autograd.grad(value, l)
    l_kept = losses[:3].clone().requires_grad_()
    expected, expected_eta = dro_ext.robust_objective(l_kept, 1e-3, name, groups=groups[:3], num_groups=3, **kw)
    (expected_grad,) = torch.autograd.grad(expected, l_kept)
    assert torch.isfinite(expected)
    assert value.item() == expected.item() and eta.item() == expected_eta.item()
    assert torch.equal(grad, torch.cat([expected_grad, torch.zeros(2, dtype=torch.float64)]))
    q = dro_ext.worst_case_weights(losses, 1e-3, name, groups=groups, num_groups=3, **kw)
    assert torch.equal(q, dro_ext.worst_case_weights(losses[:3], 1e-3, name, groups=groups[:3], num_groups=3, **kw))
    assert q[2] == 0
    losses[3] = math.nan
    value, eta = dro_ext.robust_objective(losses, 1e-3, name, groups=groups, num_groups=3, **kw)
    assert math.isnan(value.item())


# ---------------------------------------------------------------------------------------------------
# Special structures
# ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name,params", ref.CASES, ids=ref.CASE_IDS)
def test_single_group_is_its_mean(backend, name, params):
    # One group present (of four): the dual at eta is eta + lam psi*((m - eta)/lam), minimized at eta = m
    # (psi*'(0) = 1) with psi*(0) = 0: Psi = m, and q puts all the mass on that group.
    kw = case_kwargs(params)
    losses = torch.rand(13, dtype=torch.float64) + 0.5
    groups = torch.full((13,), 2)
    value, eta = dro_ext.robust_objective(losses, 0.2, name, groups=groups, num_groups=4, **kw)
    mean = losses.sum() / 13
    torch.testing.assert_close(value, mean, rtol=1e-15, atol=0)
    torch.testing.assert_close(eta, mean, rtol=1e-15, atol=0)
    q = dro_ext.worst_case_weights(losses, 0.2, name, groups=groups, num_groups=4, **kw)
    assert q.tolist() == [0.0, 0.0, 1.0, 0.0]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
@pytest.mark.parametrize("name,params", ref.CASES, ids=ref.CASE_IDS)
def test_one_sample_per_group_is_the_sample_level_objective(backend, name, params, dtype):
    # Each group holds one sample: the group means are the losses, so Psi is robust_objective's, bit for bit
    # (the group ids in any order: the group objective is the sample-level one of m[groups], which is the losses).
    # The means are formed in float64 whatever the losses' dtype: float32 losses' Psi and eta* are those of their
    # float64 copy, rounded to float32.
    kw = case_kwargs(params)
    n = 37
    losses, _ = random_batch(n, 1, dtype)
    groups = torch.randperm(n)
    got = dro_ext.robust_objective(losses, 0.4, name, groups=groups, num_groups=n + 3, **kw)
    expected = [r.to(dtype) for r in dro_ext.robust_objective(losses.double(), 0.4, name, **kw)]
    assert got[0].item() == expected[0].item() and got[1].item() == expected[1].item()
    q = dro_ext.worst_case_weights(losses, 0.4, name, groups=groups, num_groups=n + 3, **kw)
    q_samples = dro_ext.worst_case_weights(losses.double(), 0.4, name, **kw).to(dtype)
    # the same weights, renormalized over the groups (a few roundings)
    torch.testing.assert_close(q[groups], q_samples, rtol=8 * torch.finfo(dtype).eps, atol=0)
    assert bool((q[n:] == 0).all())


def test_batch_weighting_is_the_sample_level_objective_of_the_group_means(backend):
    # The identity the implementation rests on, for groups of several samples: robust_objective over groups equals
    # the sample-level robust_objective of each sample's group mean.
    losses, groups = random_batch(200, 9, absent=(0, 5))
    means = torch.stack([losses[groups == g].mean() if (groups == g).any() else losses.new_zeros(())
                         for g in range(9)])
    for name, params in ref.CASES:
        kw = case_kwargs(params)
        got, _ = dro_ext.robust_objective(losses, 0.3, name, groups=groups, num_groups=9, **kw)
        expected, _ = dro_ext.robust_objective(means[groups], 0.3, name, **kw)
        torch.testing.assert_close(got, expected, rtol=1e-13, atol=1e-13)


@pytest.mark.parametrize("weighting", ["batch", "population"])
def test_non_contiguous_inputs(backend, weighting):
    # strided views of the losses and the ids give the answer of their contiguous copies
    base, base_groups = random_batch(2 * 57, 5)
    losses, groups = base[::2], base_groups[1::2]
    assert not losses.is_contiguous() and not groups.is_contiguous()
    options = {} if weighting == "batch" else dict(weighting="population", group_counts=[1.0, 2.0, 3.0, 4.0, 5.0])
    for name, params in ref.CASES:
        kw = case_kwargs(params)
        got = dro_ext.robust_objective(losses, 0.3, name, groups=groups, num_groups=5, **options, **kw)
        expected = dro_ext.robust_objective(losses.contiguous(), 0.3, name, groups=groups.contiguous(),
                                            num_groups=5, **options, **kw)
        assert got[0].item() == expected[0].item() and got[1].item() == expected[1].item()
        q = dro_ext.worst_case_weights(losses, 0.3, name, groups=groups, num_groups=5, **options, **kw)
        assert torch.equal(q, dro_ext.worst_case_weights(losses.contiguous(), 0.3, name, groups=groups.contiguous(),
                                                         num_groups=5, **options, **kw))


@pytest.mark.parametrize("weighting", ["batch", "population"])
@pytest.mark.parametrize("name,params", ref.CASES, ids=ref.CASE_IDS)
def test_nan_propagates(backend, name, params, weighting):
    kw = case_kwargs(params)
    options = {} if weighting == "batch" else dict(weighting="population", group_counts=[1.0, 2.0, 3.0, 4.0])
    losses, groups = random_batch(30, 4)
    losses[11] = math.nan
    value, eta = dro_ext.robust_objective(losses, 0.3, name, groups=groups, num_groups=4, **options, **kw)
    assert math.isnan(value.item()) and math.isnan(eta.item())
    q = dro_ext.worst_case_weights(losses, 0.3, name, groups=groups, num_groups=4, **options, **kw)
    assert bool(torch.isnan(q).any())


# ---------------------------------------------------------------------------------------------------
# Gradients and compilation
# ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name,params", ref.CASES, ids=ref.CASE_IDS)
def test_gradient_is_the_group_distribution_over_the_counts(backend, name, params):
    kw = case_kwargs(params)
    num_groups = 6
    losses, groups = random_batch(40, num_groups, absent=(4,))
    losses.requires_grad_()
    value, _ = dro_ext.robust_objective(losses, 0.3, name, groups=groups, num_groups=num_groups, **kw)
    (grad,) = torch.autograd.grad(2.0 * value, losses)
    q = dro_ext.worst_case_weights(losses, 0.3, name, groups=groups, num_groups=num_groups, **kw)
    counts = torch.bincount(groups, minlength=num_groups).double()
    torch.testing.assert_close(grad, 2.0 * (q / counts.clamp(min=1))[groups], rtol=1e-12, atol=1e-15)


@pytest.mark.parametrize("name,params", [("chi2", {}), ("kl", {}), ("cvar", {"alpha": 0.4})])
def test_float32_gradient_and_weights_of_many_samples_a_group(backend, name, params):
    # 2^18 samples a group: each sample's gradient is its group's weight over the count, so a group's gradient is
    # 2^18 alike float32 terms, and worst_case_weights sums 2^18 alike sample weights a group. Summed one after
    # another in float32 (indexing's backward; the fallback's and the native op's float32 group sums) the gradient
    # drifted 9e-4 and the weights 8e-6 from the float64 solution.
    torch.manual_seed(0)
    n, num_groups, lam = 2**20 + 1, 4, 0.5
    losses = torch.rand(n) * 2
    groups = torch.randint(0, num_groups, (n,))
    kw = dict(groups=groups, num_groups=num_groups, **params)
    x = losses.clone().requires_grad_()
    (grad,) = torch.autograd.grad(dro_ext.robust_objective(x, lam, name, **kw)[0], x)
    x64 = losses.double().requires_grad_()
    (want_grad,) = torch.autograd.grad(dro_ext.robust_objective(x64, lam, name, **kw)[0], x64)
    # (Relative to the largest: a group of cvar may have weight 0.)
    rel = ((grad.double() - want_grad).abs().max() / want_grad.abs().max()).item()
    assert rel <= 2e-6, rel
    q = dro_ext.worst_case_weights(losses, lam, name, **kw).double()
    want_q = dro_ext.worst_case_weights(losses.double(), lam, name, **kw)
    rel = ((q - want_q).abs().max() / want_q.max()).item()
    assert rel <= 1e-6, rel


@pytest.mark.parametrize("name,params", ref.CASES, ids=ref.CASE_IDS)
def test_gradcheck(backend, name, params):
    kw = case_kwargs(params)
    losses, groups = random_batch(12, 4)
    losses.requires_grad_()
    assert torch.autograd.gradcheck(
        lambda l: dro_ext.robust_objective(l, 0.7, name, groups=groups, num_groups=4, **kw)[0], (losses,),
        eps=1e-6, atol=1e-7, rtol=1e-5)


@pytest.mark.parametrize("weighting", ["batch", "population", "tensor"])
def test_a_second_derivative_raises(backend, weighting):
    """Over groups as over samples: the recorded gradient (create_graph=True) is the gradient, and differentiating it
    again, which would need how eta* moves with the group means, raises (the weighted solve returned q's derivative at
    a fixed eta* before, silently)."""
    options = {"batch": {}, "population": dict(weighting="population", group_counts=[3.0, 1.0, 2.0, 5.0]),
               "tensor": dict(weighting=torch.tensor([0.5, 1.0, 2.0, 1.0]))}[weighting]
    losses, groups = random_batch(12, 4)
    losses.requires_grad_()

    def value():
        return dro_ext.robust_objective(losses, 0.7, "chi2", groups=groups, num_groups=4, **options)[0]

    (plain,) = torch.autograd.grad(value(), losses)
    (recorded,) = torch.autograd.grad(value(), losses, create_graph=True)
    torch.testing.assert_close(recorded, plain, rtol=0, atol=0)
    with pytest.raises(RuntimeError, match="derivative for dro_ext::robust_objective's backward is not implemented"):
        torch.autograd.grad((recorded * torch.arange(12.0, dtype=recorded.dtype)).sum(), losses)


def test_compile_fullgraph():
    if _backend._force_python:
        pytest.skip("DRO_EXT_FORCE_PYTHON=1: this run covers the fallback only")
    assert _backend.native_available(), f"native extension not loaded: {_backend.load_error()}"
    losses, groups = random_batch(100, 6)

    @torch.compile(fullgraph=True, backend="eager")
    def f(l, g):
        return dro_ext.robust_objective(l, 0.3, "smoothed_cvar", alpha=0.2, groups=g, num_groups=6)

    torch.testing.assert_close(
        f(losses, groups),
        dro_ext.robust_objective(losses, 0.3, "smoothed_cvar", alpha=0.2, groups=groups, num_groups=6))


# ---------------------------------------------------------------------------------------------------
# weight_stats over groups
# ---------------------------------------------------------------------------------------------------


def test_weight_stats_over_groups(backend):
    num_groups = 5
    losses, groups = random_batch(50, num_groups, absent=(2,))
    stats = dro_ext.weight_stats(losses=losses, lam=0.3, divergence="kl", groups=groups, num_groups=num_groups,
                                 over="groups")
    q = dro_ext.worst_case_weights(losses, 0.3, "kl", groups=groups, num_groups=num_groups)
    torch.testing.assert_close(stats.group_mass, q, rtol=1e-12, atol=1e-15)
    # The statistics of the distribution over the samples that q induces: q_{g_i} / n_{g_i}.
    counts = torch.bincount(groups, minlength=num_groups).double()
    w = (q / counts.clamp(min=1))[groups]
    torch.testing.assert_close(stats.ess, 1.0 / (w * w).sum(), rtol=1e-10, atol=0)
    torch.testing.assert_close(stats.max_weight, w.max(), rtol=1e-12, atol=0)
    assert stats.zero_fraction.item() == 0.0
    # At a given eta: the weights of the group means at eta, normalized.
    at_eta = dro_ext.weight_stats(losses=losses, lam=0.3, eta=0.9, divergence="cvar", alpha=0.4, groups=groups,
                                  num_groups=num_groups, over="groups")
    m = torch.stack([losses[groups == g].mean() if (groups == g).any() else losses.new_zeros(())
                     for g in range(num_groups)])
    mass = torch.where(counts > 0, counts * (m > 0.9).double(), 0.0)
    torch.testing.assert_close(at_eta.group_mass, mass / mass.sum(), rtol=1e-12, atol=0)
    # The default stays the sample-level weighting, grouped.
    samples = dro_ext.weight_stats(losses=losses, lam=0.3, divergence="kl", groups=groups, num_groups=num_groups)
    q_samples = dro_ext.worst_case_weights(losses, 0.3, "kl")
    torch.testing.assert_close(samples.group_mass, torch.zeros(num_groups, dtype=torch.float64)
                               .index_add(0, groups, q_samples), rtol=1e-12, atol=1e-15)


# ---------------------------------------------------------------------------------------------------
# evaluate's group report
# ---------------------------------------------------------------------------------------------------


def test_evaluate_group_report(backend):
    torch.manual_seed(0)
    num_groups = 5
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Tanh(), torch.nn.Linear(4, 1)).double()
    x, y = torch.randn(47, 3, dtype=torch.float64), torch.randn(47, dtype=torch.float64)
    g = torch.randint(0, num_groups - 1, (47,))  # group 4 never appears
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y, g), batch_size=8)

    def per_sample_loss(m, batch):
        return (m(batch[0]).squeeze(-1) - batch[1]) ** 2

    result = dro_ext.evaluate(model, loader, per_sample_loss, 0.5, "chi2", groups_fn=lambda b: b[2],
                              num_groups=num_groups, progress=False)
    assert isinstance(result, dro_ext.GroupEvaluation)
    with torch.no_grad():
        losses = (model(x).squeeze(-1) - y) ** 2
    value, eta = dro_ext.robust_objective(losses, 0.5, "chi2", groups=g, num_groups=num_groups)
    torch.testing.assert_close(result.value, value, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(result.eta_star, eta, rtol=1e-12, atol=1e-12)
    expected_means = [losses[g == h].mean().item() for h in range(num_groups - 1)]
    np.testing.assert_allclose(result.group_loss[:-1].numpy(), expected_means, rtol=1e-12)
    assert math.isnan(result.group_loss[-1].item())
    assert result.group_count.tolist() == [int((g == h).sum()) for h in range(num_groups)]
    worst = int(np.argmax(expected_means))
    assert result.worst_group.item() == worst
    assert result.worst_group_loss.item() == result.group_loss[worst].item()
    assert not result.value.requires_grad
    # The call without groups keeps its (value, eta_star) result.
    plain = dro_ext.evaluate(model, loader, per_sample_loss, 0.5, "chi2", progress=False)
    assert isinstance(plain, tuple) and len(plain) == 2
    torch.testing.assert_close(plain[0], dro_ext.robust_objective(losses, 0.5, "chi2")[0], rtol=1e-12, atol=1e-12)


def test_evaluate_worst_group_with_a_nan_group():
    model = torch.nn.Identity()
    loader = [(torch.tensor([1.0, math.nan, 3.0, 0.5]), torch.tensor([0, 1, 2, 2]))]
    result = dro_ext.evaluate(model, loader, lambda m, b: m(b[0]), 0.5, groups_fn=lambda b: b[1], num_groups=3,
                              progress=False)
    # A NaN group is the worst (its loss is unknown, not small), and Psi is NaN.
    assert result.worst_group.item() == 1 and math.isnan(result.worst_group_loss.item())
    assert math.isnan(result.value.item())


@pytest.mark.parametrize("weighting", ["batch", "population"])
def test_evaluate_counts_a_group_past_float32s_integers_exactly(backend, weighting):
    # float32 losses: the objective's group counts are float32, exact to 2^24 samples a group; the report's int64
    # counts were those rounded (2^24 + 1 read 2^24).
    big = 2**24 + 1
    groups = torch.zeros(big + 3, dtype=torch.int64)
    groups[-3:] = torch.tensor([1, 2, 2])
    losses = torch.ones(big + 3)
    result = dro_ext.evaluate(torch.nn.Identity(), [(losses, groups)], lambda m, b: m(b[0]), 0.5,
                              groups_fn=lambda b: b[1], num_groups=4, weighting=weighting,
                              group_counts=[big, 1, 2, 5] if weighting == "population" else None, progress=False)
    assert result.group_count.tolist() == [big, 1, 2, 0]
    assert result.group_loss[:3].tolist() == [1.0, 1.0, 1.0]


@pytest.mark.parametrize("losses, groups, worst, worst_loss", [
    ([-math.inf, 1.0], [2, 2], 2, -math.inf),            # the only present group's mean is -inf: absent ones rank below
    ([-math.inf, -math.inf], [1, 2], 1, -math.inf),      # present groups tied at -inf: the lowest present id
    ([math.inf, math.nan, 1.0], [0, 1, 2], 1, math.nan),  # NaN above +inf
    ([1.0, math.nan, math.nan], [2, 1, 3], 1, math.nan),  # two NaN groups: the lowest id
    ([math.inf, 2.0, math.inf], [3, 0, 1], 1, math.inf),  # +inf tied: the lowest id
    ([0.5, 2.0, 2.0], [0, 3, 1], 1, 2.0),                  # a finite tie: the lowest id
])
def test_evaluate_worst_group_ranks_absent_below_and_nan_above(losses, groups, worst, worst_loss):
    loader = [(torch.tensor(losses, dtype=torch.float64), torch.tensor(groups))]
    result = dro_ext.evaluate(torch.nn.Identity(), loader, lambda m, b: m(b[0]), 0.5, groups_fn=lambda b: b[1],
                              num_groups=4, progress=False)
    assert result.worst_group.item() == worst
    got = result.worst_group_loss.item()
    assert (math.isnan(got) and math.isnan(worst_loss)) or got == worst_loss


# ---------------------------------------------------------------------------------------------------
# Bad inputs
# ---------------------------------------------------------------------------------------------------

_L = torch.rand(6, dtype=torch.float64)
_G = torch.tensor([0, 1, 1, 2, 0, 2])


@pytest.mark.parametrize("kwargs,exc,word", [
    (dict(groups=_G.double(), num_groups=3), TypeError, "groups"),
    (dict(groups=_G[:5], num_groups=3), ValueError, "groups"),
    (dict(groups=_G.reshape(2, 3), num_groups=3), ValueError, "groups"),
    # (without group_sums' hint of validate=False, which these functions do not take)
    (dict(groups=_G, num_groups=2), IndexError, r"groups holds an id outside \[0, num_groups\) with num_groups=2$"),
    (dict(groups=_G - 1, num_groups=3), IndexError, r"groups holds an id outside \[0, num_groups\) with num_groups=3$"),
    (dict(groups=_G), ValueError, "num_groups"),
    (dict(num_groups=3), ValueError, "groups"),
    (dict(groups=_G, num_groups=0), ValueError, "num_groups"),
    (dict(groups=_G, num_groups=3.0), TypeError, "num_groups"),
    (dict(groups=[0, 1, 1, 2, 0, 2], num_groups=3), TypeError, "groups"),
    (dict(groups=_G, num_groups=3, weighting="population"), ValueError, "group_counts"),
    (dict(groups=_G, num_groups=3, weighting="population", group_counts=[1, 0, 3]), ValueError, "group_counts"),
    (dict(groups=_G, num_groups=3, weighting=torch.ones(4)), ValueError, "weighting"),
    (dict(groups=_G, num_groups=3, group_counts=[1, 2, 3]), ValueError, "group_counts"),
    (dict(groups=_G, num_groups=3, weighting="uniform"), ValueError, "weighting"),
    (dict(weighting="population"), ValueError, "groups"),
    (dict(groups=_G, num_groups=3, group=object()), RuntimeError, "torch.distributed"),
])
@pytest.mark.parametrize("fn", ["robust_objective", "worst_case_weights"])
def test_bad_inputs(backend, fn, kwargs, exc, word):
    with pytest.raises(exc, match=word):
        getattr(dro_ext, fn)(_L, 0.3, "chi2", **kwargs)


@pytest.mark.parametrize("kwargs,exc,word", [
    (dict(losses=_L, lam=0.3, groups=_G.float(), num_groups=3, over="groups"), TypeError, "groups"),
    (dict(losses=_L, lam=0.3, groups=_G, over="groups"), ValueError, "num_groups"),
    (dict(weights=_L, groups=_G, num_groups=3, over="groups"), ValueError, "losses"),
    (dict(losses=_L, lam=0.3, over="group"), ValueError, "over"),
    (dict(losses=_L, lam=0.3, groups=_G, num_groups=3, over="groups", group=object()), (RuntimeError, TypeError),
     "group"),
])
def test_weight_stats_bad_inputs(kwargs, exc, word):
    with pytest.raises(exc, match=word):
        dro_ext.weight_stats(**kwargs)


def test_evaluate_bad_inputs():
    model = torch.nn.Identity()
    loader = [(torch.rand(4), torch.tensor([0, 1, 1, 0]))]
    loss = lambda m, b: m(b[0])  # noqa: E731
    with pytest.raises(ValueError, match="num_groups"):
        dro_ext.evaluate(model, loader, loss, 0.3, groups_fn=lambda b: b[1], progress=False)
    with pytest.raises(ValueError, match="groups_fn"):
        dro_ext.evaluate(model, loader, loss, 0.3, num_groups=2, progress=False)
    with pytest.raises(TypeError, match="groups_fn"):
        dro_ext.evaluate(model, loader, loss, 0.3, groups_fn=3, num_groups=2, progress=False)
    with pytest.raises(TypeError, match="groups"):
        dro_ext.evaluate(model, loader, loss, 0.3, groups_fn=lambda b: b[1].float(), num_groups=2, progress=False)
    with pytest.raises(ValueError, match="groups"):
        dro_ext.evaluate(model, loader, loss, 0.3, groups_fn=lambda b: b[1][:3], num_groups=2, progress=False)
    with pytest.raises(IndexError, match="groups"):
        dro_ext.evaluate(model, loader, loss, 0.3, groups_fn=lambda b: b[1], num_groups=1, progress=False)


def test_evaluate_population_weighting():
    model = torch.nn.Identity()
    losses, groups = random_batch(30, 4)
    loader = [(losses[:16], groups[:16]), (losses[16:], groups[16:])]
    options = dict(weighting="population", group_counts=[5.0, 1.0, 2.0, 9.0])
    result = dro_ext.evaluate(model, loader, lambda m, b: m(b[0]), 0.3, "kl", groups_fn=lambda b: b[1],
                              num_groups=4, progress=False, **options)
    value, eta = dro_ext.robust_objective(losses, 0.3, "kl", groups=groups, num_groups=4, **options)
    assert result.value.item() == value.item() and result.eta_star.item() == eta.item()
    with pytest.raises(ValueError, match="group_counts"):
        dro_ext.evaluate(model, loader, lambda m, b: m(b[0]), 0.3, groups_fn=lambda b: b[1], num_groups=4,
                         weighting="population", progress=False)
    with pytest.raises(ValueError, match="weighting"):
        dro_ext.evaluate(model, loader, lambda m, b: m(b[0]), 0.3, weighting="population", progress=False)
