"""Property-based tests of the public API against an 80-digit reference of the README's formulas.

Hypothesis draws sizes, dtypes, strides, losses from subnormals to 1e30 of both signs (clustered, spread, with
outliers far below or above the rest), eta, lam across the documented range, alpha near 0 and 1 and extreme k,
and checks, on every backend and SIMD build (the `backend` fixture):

- psi_star, dro_loss's value and both gradients, robust_objective and worst_case_weights against mpmath at
  80 digits, within the README's bound (`Exact` and the functions beside it: a few roundings of the accumulate
  dtype times the size of each sample's terms and what rounding t = (l - G eta)/lam moves them by, plus each
  divergence's conditioning; never a fixed tolerance);
- the contract: robust_objective lies in [mean l, max l], its weights are a distribution;
- NormalizedSGD moves a float16 group by lr however small its gradient; the fused cross-entropy's gradient is
  (w/n)(softmax - q) without NaN where the loss overflows.

Two profiles: `ci` (the default: a fixed seed and few examples, well under a minute on two cores) and `deep`
(many more examples, random seeds, larger sizes), for a developer to run by hand:

    DRO_EXT_HYPOTHESIS_PROFILE=deep python -m pytest -q tests/test_exactness_properties.py
"""
from __future__ import annotations

import math
import os
import subprocess
import sys

import mpmath
import pytest
import torch
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

import dro_ext
from dro_ext import _backend
from reference import DTYPES, mp_conjugate

mp = mpmath.mp
MP_DIGITS = 80
mp.dps = MP_DIGITS

settings.register_profile(
    "ci", max_examples=25, derandomize=True, database=None, deadline=None, print_blob=True,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
settings.register_profile(
    "deep", max_examples=1000, deadline=None, print_blob=True,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
PROFILE = os.environ.get("DRO_EXT_HYPOTHESIS_PROFILE", "ci")
DEEP = PROFILE == "deep"
# Applied per test (not load_profile), so the other test files keep their own settings.
profile = settings.get_profile(PROFILE)
MAX_N = 700 if DEEP else 80  # past the CPU kernels' 512-element blocks in the deep profile

DIVERGENCES = ["chi2", "kl", "cvar", "kl_cvar", "cressie_read", "smoothed_cvar"]
# The documented ranges: alpha in [1e-30, 1) (any float64 below 1), k in (1, inf), lam in (0, inf) with
# |l - G eta| / lam at most 1e150 (psi*(t) and its square stay finite in float64).
MIN_ALPHA = 1e-30
MAX_T = 1e150


# --------------------------------------------------------------------------------------------------
# The reference: the README's table, literally, at 80 digits (reference.mp_conjugate), and what bounds each result.
# --------------------------------------------------------------------------------------------------


def spec_kwargs(name, alpha, k):
    return dict(alpha=alpha if name in ("cvar", "kl_cvar", "smoothed_cvar") else None,
                k=k if name == "cressie_read" else None)


def unit(dtype):
    """The accumulate dtype's machine epsilon (float32 for half, bfloat16 and float32 input)."""
    return torch.finfo(torch.float64 if dtype == torch.float64 else torch.float32).eps


def conditioning(t, name, alpha, k, value):
    """kappa: what evaluating psi* at t costs beyond a few roundings of |psi*(t)| (README, "Exactness")."""
    if name == "cressie_read" and k not in (2.0, 1.5):
        u = (k - 1) * t + 1
        return 4 + 2 * abs(math.log(u)) / (k - 1) if u > 0 else 4
    if name == "smoothed_cvar":
        x = alpha * float(mp.expm1(t))
        if -0.5 <= x <= 1:
            return 4
        q = float(mp.exp(-abs(t)))
        c1, c2 = (alpha, 1 - alpha) if t > 0 else (1 - alpha, alpha)
        return 4 + 2 * (max(t, 0) + abs(math.log(c1 + c2 * q))) / (alpha * abs(value)) if value != 0 else 4
    return 4


def weight_conditioning(t, name, alpha, k, weight):
    """kappa for psi*'(t): cressie_read's power as for psi*; smoothed_cvar's sigmoid(t + log(alpha/(1 - alpha)))
    (with the shortcuts, alpha in [1/16, 15/16]) rounds t + that log."""
    if name == "cressie_read":
        return conditioning(t, name, alpha, k, weight)
    if name == "smoothed_cvar" and 1 / 16 <= alpha <= 15 / 16:
        return 4 + 2 * abs(math.log(alpha) - math.log1p(-alpha))
    return 4


def coarse_rounding(t, name, alpha):
    """The sum-level shortcut of kl, kl_cvar and smoothed_cvar (alpha in [1/16, 15/16]) rounds each sample's
    psi*(t) to a few roundings of 1 + |psi*(t)| (times 1/alpha and log(1 - alpha)'s size for smoothed_cvar),
    only in blocks where min(|t|, 1) averages at least 1/2: per sample, at most this many lam-roundings."""
    if name in ("kl", "kl_cvar"):
        return 8 * min(abs(t), 1.0)
    if name == "smoothed_cvar" and 1 / 16 <= alpha <= 15 / 16:
        shift = math.log(alpha) - math.log1p(-alpha)
        return (8 * (2 + abs(math.log1p(-alpha)) + abs(shift)) * min(abs(t), 1.0) + abs(t)) / alpha
    return 0.0


class Exact:
    """dro_loss's exact value, weights and dL/deta at (losses, eta, lam), with the bound of each (README)."""

    def __init__(self, losses, eta, lam, name, alpha, k, scale, dtype):
        self.n = n = len(losses)
        s = mp.mpf(scale) * mp.mpf(eta)
        self.s = float(s)
        lam_mp = mp.mpf(lam)
        eps = unit(dtype)
        tiny = torch.finfo(torch.float64 if dtype == torch.float64 else torch.float32).smallest_normal
        total, size, w_sum, w_size = mp.mpf(0), 0.0, mp.mpf(0), 0.0
        self.w, self.w_allowed = [], []
        for v in losses:
            t = (mp.mpf(v) - s) / lam_mp
            value, first, _ = mp_conjugate(t, name, alpha, k)
            total += lam_mp * value + s
            tf, vf, wf = float(t), float(value), float(first)
            # What rounding t moves the weight by: t is formed in the accumulate dtype from l and G eta (and
            # underflows below its smallest subnormal).
            wiggle = 4 * eps * (abs(v) + abs(self.s)) / lam + 2 * tiny * eps
            band = abs(float(mp_conjugate(t + wiggle, name, alpha, k)[1] - mp_conjugate(t - wiggle, name, alpha, k)[1]))
            kappa_w = weight_conditioning(tf, name, alpha, k, wf)
            self.w.append(wf)
            # + the accumulate dtype's smallest normal: the vector exponentials flush subnormal weights to 0.
            self.w_allowed.append(kappa_w * eps * abs(wf) + band + tiny)
            # |G eta| + lam |psi*(t)| kappa, what rounding t moves lam psi*(t) by (relative, and absolute where t
            # underflows), and the coarse sums' roundings.
            size += (abs(self.s) + lam * abs(vf) * conditioning(tf, name, alpha, k, vf)
                     + wf * (abs(v) + abs(self.s) + lam * tiny) + lam * coarse_rounding(tf, name, alpha))
            w_sum += first
            w_size += abs(wf - 1) + band
        self.value = float(total / n)
        # Every operation may also round by half the accumulate dtype's smallest subnormal.
        self.size = size / n + tiny
        self.deta = float(mp.mpf(scale) * (1 - w_sum / n))
        self.deta_allowed = scale * (32 * eps * (w_size / n + 1) + sum(self.w_allowed) / n)


def output_rounding(exact, dtype):
    finfo = torch.finfo(dtype)
    return finfo.eps * abs(exact) + finfo.smallest_normal * finfo.eps


def assert_close_or_overflowing(what, got, exact, allowed, dtype):
    """|got - exact| <= allowed; where the exact result overflows the dtype (by more than the allowance), got is
    the infinity of its sign; in between, either."""
    got = float(got)
    big = torch.finfo(dtype).max
    if abs(exact) - allowed > big:
        assert got == math.copysign(math.inf, exact), f"{what}: got {got!r}, exact {exact!r} overflows {dtype}"
        return
    if math.isinf(got) and abs(exact) + allowed >= big:
        return
    assert abs(got - exact) <= allowed, (
        f"{what}: got {got!r}, exact {exact!r}: error {abs(got - exact):.3g} > allowed {allowed:.3g}")


# --------------------------------------------------------------------------------------------------
# Strategies
# --------------------------------------------------------------------------------------------------


@st.composite
def magnitudes(draw, dtype):
    """A positive float across the dtype's range: subnormal, tiny, ordinary, huge (up to 1e30)."""
    finfo = torch.finfo(dtype)
    low = math.log10(finfo.smallest_normal * finfo.eps)  # the smallest subnormal
    high = min(30.0, math.log10(finfo.max) - 1)
    kind = draw(st.sampled_from(["ordinary", "ordinary", "any"]))
    exponent = draw(st.floats(-3, 3) if kind == "ordinary" else st.floats(low, high))
    return 10.0 ** exponent


@st.composite
def loss_vectors(draw, dtype, max_n=MAX_N):
    """1-D losses: a cluster (spread relative to its centre from 1e-7 to 1e3) of either sign, sometimes with
    outliers far below or above it; returned as float64 values exactly representable in dtype."""
    n = draw(st.integers(1, max_n))
    centre = draw(magnitudes(dtype)) * draw(st.sampled_from([1.0, -1.0, 0.0]))
    spread = max(abs(centre), 1.0) * 10.0 ** draw(st.floats(-7, 3))
    values = [centre + spread * draw(st.floats(-1, 1)) for _ in range(min(n, 4))]
    generator = torch.Generator().manual_seed(draw(st.integers(0, 2**31)))
    rest = centre + spread * (2 * torch.rand(n - len(values), generator=generator, dtype=torch.float64) - 1)
    values = values + rest.tolist()
    for _ in range(draw(st.integers(0, 2))):  # outliers
        values[draw(st.integers(0, n - 1))] = draw(magnitudes(dtype)) * draw(st.sampled_from([1.0, -1.0]))
    big = torch.finfo(dtype).max
    x = torch.tensor(values, dtype=torch.float64).clamp(-big, big).to(dtype)
    return x.double().tolist()


def as_input(values, dtype, layout):
    """The losses as a tensor of dtype: contiguous, strided (every other element of a larger buffer) or reversed."""
    x = torch.tensor(values, dtype=torch.float64).to(dtype)
    if layout == "strided":
        buffer = torch.full((2 * len(values),), float("nan"), dtype=dtype)
        buffer[::2] = x
        return buffer[::2]
    if layout == "reversed":
        return x.flip(0).contiguous().flip(0)  # a negative-stride view of a copy
    return x


@st.composite
def divergence_params(draw):
    name = draw(st.sampled_from(DIVERGENCES))
    alpha = None
    if name in ("cvar", "kl_cvar", "smoothed_cvar"):
        side = draw(st.sampled_from(["mid", "near 0", "near 1"]))
        if side == "mid":
            alpha = draw(st.floats(0.01, 0.99))
        elif side == "near 0":
            alpha = 10.0 ** draw(st.floats(math.log10(MIN_ALPHA), -2))
        else:
            alpha = 1.0 - 10.0 ** draw(st.floats(-15, -2))
    k = None
    if name == "cressie_read":
        k = draw(st.one_of(st.sampled_from([2.0, 1.5, 3.0]), st.floats(1e-3, 30).map(lambda d: 1.0 + d)))
    return name, alpha, k


@st.composite
def eta_and_lam(draw, values, dtype, robust=False):
    """eta (a number at a loss, 0 or anywhere) and lam relative to the losses' scale |l - G eta|, from 1e-150 of
    it (the documented floor) to 1e30 times it."""
    lo, hi = min(values), max(values)
    eta = draw(st.one_of(st.sampled_from([0.0, lo, hi, 0.5 * (lo + hi)]),
                         magnitudes(dtype).map(lambda m: m * draw(st.sampled_from([1.0, -1.0])))))
    scale = draw(st.sampled_from([1.0, 1.0, 0.5, 3.0]))
    eta = float(torch.tensor(eta, dtype=torch.float32 if dtype != torch.float64 else torch.float64))
    spread = max(abs(v - (0.0 if robust else scale * eta)) for v in values) or 1.0
    if robust:
        spread = (hi - lo) or max(abs(hi), 1.0)
    lam = spread * 10.0 ** draw(st.floats(-math.log10(MAX_T), 30))
    return eta, min(max(lam, 1e-300), 1e300), scale


LAYOUTS = ["contiguous", "strided", "reversed"]


# --------------------------------------------------------------------------------------------------
# psi_star and dro_loss
# --------------------------------------------------------------------------------------------------


@profile
@given(params=divergence_params(), dtype=st.sampled_from(DTYPES), data=st.data())
def test_psi_star_is_the_exact_conjugate_to_its_conditioning(backend, params, dtype, data):
    name, alpha, k = params
    values = data.draw(loss_vectors(dtype, max_n=16))
    t = as_input(values, dtype, data.draw(st.sampled_from(LAYOUTS)))
    got = dro_ext.psi_star(t, name, **spec_kwargs(name, alpha, k))
    eps = unit(dtype)
    # An intermediate that underflows (cressie_read's (k - 1) t) loses absolute digits, which psi* scales by 1/(k - 1).
    subnormal = torch.finfo(torch.float64 if dtype == torch.float64 else torch.float32).smallest_normal * eps
    floor = 8 * subnormal * (1 + (1 / (k - 1) if name == "cressie_read" else 0))
    for i, v in enumerate(values):
        exact = float(mp_conjugate(v, name, alpha, k)[0])
        allowed = conditioning(v, name, alpha, k, exact) * eps * abs(exact) + output_rounding(exact, dtype) + floor
        assert_close_or_overflowing(f"{name} alpha={alpha} k={k}: psi*({v!r})", got[i], exact, allowed, dtype)


@profile
@given(params=divergence_params(), dtype=st.sampled_from(DTYPES), data=st.data())
def test_dro_loss_value_and_gradients_are_exact_to_their_bound(backend, params, dtype, data):
    name, alpha, k = params
    values = data.draw(loss_vectors(dtype))
    eta_value, lam, scale = data.draw(eta_and_lam(values, dtype))
    x = as_input(values, dtype, data.draw(st.sampled_from(LAYOUTS))).requires_grad_()
    eta = torch.tensor(eta_value, dtype=torch.float64 if dtype == torch.float64 else torch.float32,
                       requires_grad=True)
    kwargs = spec_kwargs(name, alpha, k)
    value = dro_ext.dro_loss(x, eta, lam, name, scale=scale, **kwargs)
    grad_l, grad_eta = torch.autograd.grad(value, (x, eta))

    exact = Exact(values, eta_value, lam, name, alpha, k, scale, dtype)
    what = f"{name} alpha={alpha} k={k} lam={lam!r} eta={eta_value!r} G={scale} {dtype}"
    eps, n = unit(dtype), len(values)
    assert_close_or_overflowing(f"{what}: value", value, exact.value, 64 * eps * exact.size
                                + output_rounding(exact.value, dtype), dtype)
    acc_max = torch.finfo(torch.float64 if dtype == torch.float64 else torch.float32).max
    for i in range(n):
        w = exact.w[i]
        if w > acc_max and math.isinf(float(grad_l[i])):
            continue  # the weight itself overflows the accumulate dtype
        assert_close_or_overflowing(f"{what}: dL/dl[{i}] (loss {values[i]!r})", grad_l[i], w / n,
                                    8 * exact.w_allowed[i] / n + output_rounding(w / n, dtype), dtype)
    if max(exact.w) > acc_max and math.isinf(float(grad_eta)):
        return
    assert_close_or_overflowing(f"{what}: dL/deta", grad_eta, exact.deta,
                                exact.deta_allowed + output_rounding(exact.deta, eta.dtype), eta.dtype)


# --------------------------------------------------------------------------------------------------
# robust_objective and worst_case_weights
# --------------------------------------------------------------------------------------------------


def _float_weight(t, name, alpha, k):
    """psi*'(t) in float64 (inf where it overflows), only to locate eta* before the 80-digit refinement."""
    if name == "chi2":
        return max(t + 2, 0) / 2
    if name in ("kl", "kl_cvar"):
        cap = -math.log(alpha) if name == "kl_cvar" else math.inf
        return math.exp(min(t, cap, 710.0)) if t < 710 or name == "kl_cvar" else math.inf
    if name == "cressie_read":
        u = (k - 1) * t + 1
        if u <= 0:
            return 0.0
        try:
            return u ** (1 / (k - 1))
        except OverflowError:
            return math.inf
    if name == "smoothed_cvar":
        return 1 / (alpha + (1 - alpha) * math.exp(-t)) if t > -700 else 0.0
    raise AssertionError(name)


def working_digits(values, lam):
    """mpmath's precision for the robust objective at this lam: MP_DIGITS, plus the digits by which the losses
    outsize lam. eta* lies among the losses, and t = (l - eta)/lam must still resolve to 40 digits where lam is far
    below them (the strategies reach 1e-150 of their spread): with k = 1.001, psi*(t) is a power 1001 of t."""
    largest = max(max(abs(v) for v in values), lam)
    return MP_DIGITS + max(0, math.ceil(math.log10(largest / lam)))


def mp_robust(values, lam, name, alpha, k):
    """(Psi, eta*) to ~30 digits, under working_digits(values, lam) (the caller's mp.workdps): cvar's tail mean and
    kl's logsumexp; the others at eta* found by float64 bisection on mean psi*'((l - eta)/lam) = 1, then bisection
    in a bracket around it to below 1e-40 of lam, which resolves every t = (l - eta)/lam to 40 digits (L is convex,
    so L(eta) - Psi <= |g(eta)| |eta - eta*| then)."""
    n = len(values)
    xs = [mp.mpf(v) for v in values]
    lam_mp = mp.mpf(lam)
    if name == "cvar":
        tail = mp.mpf(alpha) * n
        top = sorted(xs, reverse=True)
        whole = int(mp.floor(tail))
        total = mp.fsum(top[:whole]) + (tail - whole) * (top[whole] if whole < n else 0)
        return total / tail, top[min(n, max(1, int(mp.ceil(tail)))) - 1]
    if name == "kl":
        top = max(xs)
        eta = top + lam_mp * mp.log(mp.fsum(mp.exp((v - top) / lam_mp) for v in xs) / n)
        return eta, eta

    def g(eta):
        return mp.fsum(mp_conjugate((v - eta) / lam_mp, name, alpha, k)[1] for v in xs) / n - 1

    lo, hi = min(values), max(values)
    if lo == hi:
        return mp.mpf(lo), mp.mpf(lo)
    a, b = lo, hi
    while True:
        mid = 0.5 * (a + b)
        if not a < mid < b:
            break
        if sum(_float_weight((v - mid) / lam, name, alpha, k) for v in values) > n:
            a = mid
        else:
            b = mid
    width = 1e-12 * (abs(a) + abs(b) + lam)
    a_mp, b_mp = mp.mpf(a), mp.mpf(b)
    while True:
        a_mp, b_mp = max(mp.mpf(lo), a_mp - width), min(mp.mpf(hi), b_mp + width)
        if (g(a_mp) >= 0 or a_mp == lo) and (g(b_mp) <= 0 or b_mp == hi):
            break
        width *= 1e4
    while b_mp - a_mp > mp.mpf(10) ** -40 * lam_mp:
        mid = (a_mp + b_mp) / 2
        if g(mid) > 0:
            a_mp = mid
        else:
            b_mp = mid
    eta = (a_mp + b_mp) / 2
    return mp.fsum(lam_mp * mp_conjugate((v - eta) / lam_mp, name, alpha, k)[0] for v in xs) / n + eta, eta


@profile
@given(params=divergence_params(), dtype=st.sampled_from(DTYPES), data=st.data())
def test_robust_objective_is_exact_and_between_the_mean_and_the_max(backend, params, dtype, data):
    name, alpha, k = params
    values = data.draw(loss_vectors(dtype, max_n=24 if not DEEP else 200))
    _, lam, _ = data.draw(eta_and_lam(values, dtype, robust=True))
    x = as_input(values, dtype, data.draw(st.sampled_from(LAYOUTS)))
    kwargs = spec_kwargs(name, alpha, k)
    value, eta_star = dro_ext.robust_objective(x, lam, name, **kwargs)
    q = dro_ext.worst_case_weights(x, lam, name, **kwargs)

    with mp.workdps(working_digits(values, lam)):
        psi, eta = mp_robust(values, lam, name, alpha, k)
        exact = Exact(values, float(eta), lam, name, alpha, k, 1.0, dtype)
        n, eps = len(values), unit(dtype)
        lam_mp = mp.mpf(lam)
        seconds = [mp_conjugate((mp.mpf(v) - eta) / lam_mp, name, alpha, k)[2] for v in values]
        # How finely the solver resolves eta* (csrc/robust_objective.cpp): roundings of 2|eta| plus the psi*''-weighted
        # mean |l - eta|, in float64 where it solves in float64 (float64 input, the fallback, or float32 sums that
        # cannot resolve this lam); L at an eta that far from eta* exceeds Psi by mean psi*'' / lam times its square.
        iterative = name not in ("kl", "cvar")
        largest = max(abs(v) for v in values)
        wide = (dtype == torch.float64 or backend == "python" or lam < 256 * eps * largest
                or not 1.2e-38 < 1 / lam < 3.4e38)
        solve_eps = torch.finfo(torch.float64).eps if wide else eps
        total_second = float(mp.fsum(seconds))
        spread = float(mp.fsum(s * abs(mp.mpf(v) - eta) for s, v in zip(seconds, values))) / total_second \
            if total_second > 0 else largest
        resolution = 8 * solve_eps * (2 * abs(float(eta)) + spread) if iterative else 0.0
        rounding_of_eta = total_second / n / lam * resolution ** 2
        allowed = 64 * eps * exact.size + rounding_of_eta + output_rounding(float(psi), dtype)
        what = f"{name} alpha={alpha} k={k} lam={lam!r} {dtype}"

        got = float(value)
        mean = float(mp.fsum(mp.mpf(v) for v in values) / n)
        assert got <= max(values), f"{what}: Psi = {got!r} above max l = {max(values)!r}"
        assert got >= mean - allowed, f"{what}: Psi = {got!r} below mean l = {mean!r} by more than {allowed:.3g}"
        assert abs(got - float(psi)) <= allowed, (
            f"{what}: Psi = {got!r}, exact {float(psi)!r}: error {abs(got - float(psi)):.3g} > allowed {allowed:.3g}")

        # The worst-case weights: a distribution, and psi*'(t_i) / N at eta* to what rounding eta* and t move them by.
        qs = [float(v) for v in q]
        assert all(v >= 0 and math.isfinite(v) for v in qs), f"{what}: weights {qs}"
        assert abs(sum(qs) - 1) <= 64 * eps + 2 * n * torch.finfo(dtype).eps, f"{what}: weights sum to {sum(qs)!r}"
        if name == "cvar":
            return  # the tail's ties share their mass in any split; test_robust.py checks cvar's weights
        offset = resolution + 4 * eps * abs(float(eta))
        ws, bands = [], []
        for v in values:
            t = (mp.mpf(v) - eta) / lam_mp
            wiggle = (4 * eps * (abs(v) + abs(float(eta))) + offset) / lam + 2 * exact_tiny(dtype)
            ws.append(float(mp_conjugate(t, name, alpha, k)[1]))
            moved_by_wiggle = mp_conjugate(t + wiggle, name, alpha, k)[1] - mp_conjugate(t - wiggle, name, alpha, k)[1]
            bands.append(abs(float(moved_by_wiggle)) + 8 * eps * ws[-1] + exact_tiny(dtype))
        # q_i = w_i / sum w at the rounded eta*: each w_i moves by its band, and the sum by all of them.
        for i, v in enumerate(values):
            w = ws[i]
            moved = w * (2 * sum(bands) / n + 64 * eps) if w > 0 else 0.0
            allowed_q = (2 * bands[i] + moved) / n + output_rounding(w / n, dtype)
            assert abs(qs[i] - w / n) <= allowed_q, (
                f"{what}: q[{i}] = {qs[i]!r} at loss {v!r}, exact {w / n!r}: error {abs(qs[i] - w / n):.3g} > "
                f"allowed {allowed_q:.3g}")


def exact_tiny(dtype):
    """The accumulate dtype's smallest normal: weights below it may flush to 0 (the vector exponentials)."""
    return torch.finfo(torch.float64 if dtype == torch.float64 else torch.float32).smallest_normal


def test_robust_objective_is_the_same_on_every_simd_build_in_a_fresh_process():
    """ATEN_CPU_CAPABILITY picks the build at load time: each in its own process, on losses whose lam is far below
    their float32 resolution (the avx2 and default builds once returned 1.69e25 for chi2 here, avx512 1e20, and
    overflowed converting 1e30-scale values) and on kl_cvar's tiny lam (Psi above max l)."""
    if not _backend.native_available():
        pytest.skip("the native extension is not built: no SIMD build to pick")
    script = (
        "import torch, dro_ext\n"
        "print(torch.ops.dro_ext._cpu_capability())\n"
        "torch.ops.dro_ext._cpu_capability(torch.ops.dro_ext._cpu_capability())  # that build at every size\n"
        "x = torch.full((8,), 1e20); x[0] = 5e19\n"
        "y = torch.full((9,), 1e30); y[0] = 9e29\n"
        "print(dro_ext.robust_objective(x, 1.0, 'chi2')[0].item(),\n"
        "      dro_ext.robust_objective(y, 1e4, 'chi2')[0].item(),\n"
        "      dro_ext.robust_objective(torch.tensor([0., 1000.]), 1e-6, 'kl_cvar', alpha=0.3)[0].item())\n"
    )
    results = {}
    for build in ("default", "avx2", "avx512"):
        env = dict(os.environ, ATEN_CPU_CAPABILITY=build, DRO_EXT_FORCE_PYTHON="0")
        out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, check=True)
        picked, *values = out.stdout.split()
        if picked == build:  # a build the processor runs (ATEN_CPU_CAPABILITY only caps the widest)
            results[build] = [float(v) for v in values]
    assert "default" in results
    for build, (chi2_20, chi2_30, kl_cvar) in results.items():
        assert 9.375e19 <= chi2_20 <= float(torch.tensor(1e20)), (build, chi2_20)  # in [mean l, max l]
        assert chi2_30 == pytest.approx(float(torch.tensor(1e30)), rel=1e-6), (build, chi2_30)
        assert kl_cvar == pytest.approx(1000.0, rel=1e-6), (build, kl_cvar)


# --------------------------------------------------------------------------------------------------
# NormalizedSGD in float16/bfloat16, and the fused cross-entropy where the weight overflows
# --------------------------------------------------------------------------------------------------


@profile
@given(dtype=st.sampled_from([torch.float16, torch.bfloat16]), foreach=st.booleans(), data=st.data())
def test_normalized_sgd_moves_low_precision_params_by_lr_however_small_the_gradient(backend, dtype, foreach, data):
    n = data.draw(st.integers(1, 16))
    finfo = torch.finfo(dtype)
    params = [data.draw(st.floats(-100, 100)) for _ in range(n)]
    grads = [data.draw(magnitudes(dtype)) * data.draw(st.sampled_from([1.0, -1.0, 0.0])) for _ in range(n)]
    assume(any(g != 0 for g in grads))
    lr = 10.0 ** data.draw(st.floats(-4, 0))
    eps = data.draw(st.sampled_from([1e-8, 0.0]))
    p = torch.nn.Parameter(torch.tensor(params, dtype=torch.float64).to(dtype))
    p.grad = torch.tensor(grads, dtype=torch.float64).clamp(-finfo.max, finfo.max).to(dtype)
    assume(bool(p.grad.ne(0).any()))
    before, g = p.detach().double().clone(), p.grad.double()
    dro_ext.NormalizedSGD([p], lr=lr, momentum=0.9, eps=eps, foreach=True if foreach else None).step()
    # The first step takes m = g: p - lr g / (||g|| + eps), formed in float32 and rounded once to the dtype.
    expected = before - lr * g / (g.norm() + eps)
    allowed = finfo.eps * expected.abs() + finfo.smallest_normal * finfo.eps + 1e-6 * lr
    error = (p.detach().double() - expected).abs()
    assert bool((error <= allowed).all()), f"{dtype} foreach={foreach}: got {p.detach()}, expected {expected}"


@profile
@given(divergence=st.sampled_from(["kl", "chi2", "cressie_read"]),
       dtype=st.sampled_from([torch.float32, torch.float64]), data=st.data())
def test_dro_cross_entropy_gradient_is_the_weighted_residual_without_nan(backend, divergence, dtype, data):
    """(w_i / n)(softmax_i - q_i) row by row: +-inf where the weight overflows and the residual is not 0, 0 where
    it is (inf * 0 made whole rows NaN), the exact product elsewhere."""
    rows, classes = data.draw(st.integers(1, 4)), data.draw(st.integers(1, 5))
    logits = torch.tensor([[data.draw(st.floats(-200, 200)) for _ in range(classes)] for _ in range(rows)],
                          dtype=dtype, requires_grad=True)
    targets = torch.tensor([data.draw(st.integers(0, classes - 1)) for _ in range(rows)])
    lam, eta = 10.0 ** data.draw(st.floats(-1, 1)), torch.tensor(data.draw(st.floats(-5, 5)), requires_grad=True)
    kwargs = {"k": 3.0} if divergence == "cressie_read" else {}
    value = dro_ext.dro_cross_entropy(logits, targets, eta, lam, divergence, **kwargs)
    grad_logits, grad_eta = torch.autograd.grad(value, (logits, eta))
    x = logits.detach().double()
    losses = torch.nn.functional.cross_entropy(x, targets, reduction="none")
    s = float(eta.detach())
    weights = [float(mp_conjugate((mp.mpf(float(v)) - s) / lam, divergence, None, kwargs.get("k"))[1]) for v in losses]
    residual = torch.softmax(x, dim=1) - torch.nn.functional.one_hot(targets, classes).double()
    acc_max = torch.finfo(torch.float64 if dtype == torch.float64 else torch.float32).max
    for i in range(rows):
        for j in range(classes):
            got, r, w = float(grad_logits[i, j]), float(residual[i, j]), weights[i]
            assert not math.isnan(got), f"{divergence}: NaN gradient at row {i} class {j} (logits {x[i].tolist()})"
            if r == 0:
                assert got == 0
                continue
            # w to what rounding t moves it by, the residual to a few absolute roundings (softmax - q).
            t = abs(float(losses[i]) - s) / lam
            exact = w / rows * r
            allowed = w / rows * 16 * unit(dtype) * (1 + t) + 1e-300
            if w > acc_max and got == math.copysign(math.inf, r):
                continue  # the weight itself overflows the accumulate dtype (the fallback's float64 may not)
            assert abs(got - exact) <= allowed, f"row {i} class {j}: got {got!r}, exact {exact!r}"
    assert not math.isnan(float(grad_eta))
