"""Independent float64 references for the tests: the conjugates exactly as docs/design.md section 1.3's table writes them,
and the divergences psi(s) they are conjugate to, from which a numerical conjugate is derived."""
from __future__ import annotations

import math

import mpmath
import numpy as np
import torch
from scipy.optimize import minimize_scalar

# (divergence, keyword parameters) covering every divergence, with a second parameter value where the
# formula changes shape (cressie_read with k < 2 and k > 2).
CASES = [
    ("chi2", {}),
    ("kl", {}),
    ("cvar", {"alpha": 0.3}),
    ("kl_cvar", {"alpha": 0.2}),
    ("cressie_read", {"k": 2.0}),
    ("cressie_read", {"k": 1.5}),
    ("cressie_read", {"k": 3.5}),
    ("smoothed_cvar", {"alpha": 0.1}),
]
CASE_IDS = [d + "".join(f"-{k}{v}" for k, v in p.items()) for d, p in CASES]

# Every floating dtype the ops take.
DTYPES = [torch.float16, torch.bfloat16, torch.float32, torch.float64]


def case_kwargs(params: dict) -> dict:
    """A CASES entry's parameters as the API's keywords (None for a parameter the divergence does not take)."""
    return dict(alpha=params.get("alpha"), k=params.get("k"))


def psi_star(t: torch.Tensor, name: str, alpha=None, k=None) -> torch.Tensor:
    """The table of docs/design.md section 1.3, written literally (no stabilization): valid for moderate t."""
    if name == "chi2":
        return -1 + torch.clamp(t + 2, min=0) ** 2 / 4
    if name == "kl":
        return torch.exp(t) - 1
    if name == "cvar":
        return torch.clamp(t, min=0) / alpha
    if name == "kl_cvar":
        return torch.where(t <= -math.log(alpha), torch.exp(t) - 1, (1 + t + math.log(alpha)) / alpha - 1)
    if name == "cressie_read":
        return (torch.clamp((k - 1) * t + 1, min=0) ** (k / (k - 1)) - 1) / k
    if name == "smoothed_cvar":
        return torch.log(1 - alpha + alpha * torch.exp(t)) / alpha
    raise AssertionError(name)


def psi_star_first(t: torch.Tensor, name: str, alpha=None, k=None) -> torch.Tensor:
    """psi*'(t) elementwise, the gradient of psi_star by autograd (float64 t in, float64 out)."""
    t = t.detach().clone().requires_grad_()
    (w,) = torch.autograd.grad(psi_star(t, name, alpha, k).sum(), t)
    return w


def dro_loss(losses, eta, lam, name, alpha=None, k=None, scale=1.0):
    """mean_i lam * psi*((l_i - G eta)/lam) + G eta in float64, differentiable by autograd."""
    t = (losses - scale * eta) / lam
    return lam * psi_star(t, name, alpha, k).mean() + scale * eta


def weight_at_infinity(sign: float, name: str, alpha=None, k=None) -> float:
    """psi*'(+inf) (sign > 0: the slope of psi* at infinity, 1/alpha where the density ratio is capped at
    1/alpha, else +inf) or psi*'(-inf) (sign < 0: 0 for every divergence)."""
    if sign < 0:
        return 0.0
    return 1.0 / alpha if name in ("cvar", "kl_cvar", "smoothed_cvar") else math.inf


def weight_slope_at_infinity(sign: float, name: str, alpha=None, k=None) -> float:
    """psi*''(+inf) (sign > 0) or psi*''(-inf) (sign < 0): the limits of the table's second derivatives. chi2's
    psi*'' is 1/2 past t = -2, kl's e^t, cressie_read's (1 + (k - 1) t)^(1/(k - 1) - 1) (+inf for k < 2, 1 at
    k = 2, 0 for k > 2); the capped divergences' psi*' is constant far right (cvar, kl_cvar) or tends to a
    constant (smoothed_cvar); every psi*'' is 0 at -inf."""
    if sign < 0:
        return 0.0
    if name == "chi2":
        return 0.5
    if name == "kl":
        return math.inf
    if name == "cressie_read":
        return math.inf if k < 2.0 else (1.0 if k == 2.0 else 0.0)
    return 0.0


def dro_loss_with_one_infinite(losses, eta, lam, name, bad_index, alpha=None, k=None, scale=1.0):
    """(value, w, dL/deta) in float64 for losses whose entry bad_index is +inf or -inf and the rest finite.

    The value is mean_i lam psi*(t_i) + G eta with psi*(+inf) = +inf and psi*(-inf) its finite limit (the table
    above gives both); w_i = psi*'(t_i), the finite samples' by autograd and the infinite one's from
    weight_at_infinity; dL/deta = G (1 - mean w)."""
    losses = losses.detach().double()
    eta = float(eta.detach()) if isinstance(eta, torch.Tensor) else float(eta)
    n = losses.numel()
    keep = torch.arange(n, device=losses.device) != bad_index
    finite = losses[keep].clone().requires_grad_()
    total = lam * psi_star((finite - scale * eta) / lam, name, alpha, k).sum()
    (w_finite,) = torch.autograd.grad(total, finite)  # lam * psi*'(t) * (1/lam)
    bad = float(losses[bad_index])
    limit = lam * float(psi_star(torch.tensor(bad, dtype=torch.float64), name, alpha, k))
    w = torch.empty(n, dtype=torch.float64, device=losses.device)
    w[keep] = w_finite
    w[bad_index] = weight_at_infinity(bad, name, alpha, k)
    value = (float(total.detach()) + limit) / n + scale * eta
    return value, w, scale * (1.0 - float(w.sum()) / n)


def assert_weights_close(got_w, losses, eta, lam, name, alpha=None, k=None, scale=1.0):
    """got_w (N * dL/dl, in the losses' dtype) against w_i = psi*'(t_i) of the float64 reference, elementwise
    within the dtype's tolerances plus what the op's own rounding can move w by:
      - the kernels form t = (l - G eta) / lam in the accumulate dtype (float32 below float64): a few of its
        ulps of (|l| + |G eta|) / lam, which psi*'' multiplies (steep at cressie_read's kink for k > 2, where one
        sample in millions lands close enough to move w by more than any flat tolerance);
      - w / N is stored in the losses' dtype: below its smallest normal only the subnormal spacing is left,
        which is N times that in units of w (float16 at N = 2^24: about 1).
    """
    dtype, n = losses.dtype, losses.numel()
    tol = tolerances(dtype)
    acc_eps = torch.finfo(torch.float64 if dtype == torch.float64 else torch.float32).eps
    l64 = losses.detach().double()
    eta = float(eta.detach()) if isinstance(eta, torch.Tensor) else float(eta)
    t = (l64 - scale * eta) / lam
    wiggle = 4 * acc_eps * (l64.abs() + abs(scale * eta)) / lam

    expected = psi_star_first(t, name, alpha, k)
    band = (psi_star_first(t + wiggle, name, alpha, k) - psi_star_first(t - wiggle, name, alpha, k)).abs()
    finfo = torch.finfo(dtype)
    storage = n * finfo.smallest_normal * finfo.eps
    allowed = tol["atol"] + tol["rtol"] * expected.abs() + band + storage
    assert_within(f"{name}: w", got_w.detach().double().to(expected.device), expected, allowed, "t", t)


def assert_within(what, got, expected, allowed, at_name, at):
    """|got - expected| <= allowed elementwise (float64 tensors of one shape); a failure names the worst element,
    the input `at` it was computed at, and how many elements are outside."""
    error = (got - expected).abs()
    worst = int(torch.argmax(error - allowed))
    assert bool((error <= allowed).all()), (
        f"{what}[{worst}] = {float(got[worst])}, expected {float(expected[worst])} at {at_name} = "
        f"{float(at[worst])} (error {float(error[worst]):.3g} > allowed {float(allowed[worst]):.3g}); "
        f"{int((error > allowed).sum())} of {error.numel()} outside")


def assert_matches_one_infinite(value, grads, losses, eta, lam, name, bad_index, alpha=None, k=None, scale=1.0):
    """dro_loss's value and (dL/dl, dL/deta) at losses with one +-inf entry against dro_loss_with_one_infinite:
    +inf gives +inf (never NaN, though the ops form the value as mean l + lam mean (psi*(t) - t), which is
    inf - inf there), -inf the finite limit; the infinite sample's gradient is psi*'(+-inf) / N."""
    n, dtype = losses.numel(), losses.dtype
    exp_value, exp_w, exp_eta = dro_loss_with_one_infinite(losses, eta, lam, name, bad_index, alpha, k, scale)
    tol = tolerances(dtype)
    # assert_close compares infinities exactly (same sign) and treats NaN as a mismatch.
    torch.testing.assert_close(value.double().cpu(), torch.tensor(exp_value, dtype=torch.float64), **tol)
    torch.testing.assert_close(grads[0].double().cpu() * n, exp_w.cpu(), **dict(tol, atol=max(tol["atol"], 5e-5)))
    torch.testing.assert_close(grads[1].double().cpu(), torch.tensor(exp_eta, dtype=torch.float64),
                               rtol=1e-4, atol=1e-4)


def psi(s: float, name: str, alpha=None, k=None) -> float:
    """The divergence whose conjugate the table lists (chi2 per docs/design.md section 1.4's erratum: (s-1)^2)."""
    if s < 0:
        return math.inf
    xlogx = s * math.log(s) if s > 0 else 0.0
    if name == "chi2":
        return (s - 1) ** 2
    if name == "kl":
        return xlogx - s + 1
    if name == "cvar":
        return 0.0 if s <= 1 / alpha else math.inf
    if name == "kl_cvar":
        return xlogx - s + 1 if s <= 1 / alpha else math.inf
    if name == "cressie_read":
        return (s**k - k * s + k - 1) / (k * (k - 1))
    if name == "smoothed_cvar":
        if s > 1 / alpha:
            return math.inf
        rest = 1 - alpha * s
        tail = rest / alpha * math.log(rest / (1 - alpha)) if rest > 0 else 0.0
        return xlogx + tail
    raise AssertionError(name)


def numerical_conjugate(t: float, name: str, alpha=None, k=None) -> tuple[float, float]:
    """(sup_s s*t - psi(s), argmax s) by bounded maximization; the argmax is psi*'(t) (envelope theorem)."""
    upper = 1 / alpha if alpha is not None else 50.0
    res = minimize_scalar(
        lambda s: -(s * t - psi(s, name, alpha, k)), bounds=(0.0, upper), method="bounded",
        options={"xatol": 1e-12, "maxiter": 2000},
    )
    best_s, best = res.x, -res.fun
    for s in (0.0, upper):  # the sup may sit on the boundary of the domain
        v = s * t - psi(s, name, alpha, k)
        if v > best:
            best_s, best = s, v
    return best, best_s


def cross_entropy_value_dtype(dtype: torch.dtype) -> torch.dtype:
    """The fused cross-entropies' value dtype for logits of ``dtype``: float32 for the half types, as F.cross_entropy's
    under autocast, and ``dtype`` otherwise."""
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype


def tolerances(dtype: torch.dtype) -> dict:
    return {
        torch.float16: dict(rtol=2e-3, atol=2e-3),
        torch.bfloat16: dict(rtol=1.6e-2, atol=1.6e-2),
        torch.float32: dict(rtol=2e-5, atol=2e-6),
        torch.float64: dict(rtol=1e-11, atol=1e-12),
    }[dtype]


# float32 losses exact at 1e6 + j/16 (float32's spacing there), and a shift float32 does not hold: a float64 eta, or a
# float32 eta times a scale that rounds (3 * 333333.40625 = 1e6 + 7/32). LAM_BELOW_THE_SHIFTS_SPACING lies below that
# spacing, where rounding G eta to float32 moved every t by up to 0.6.
SHIFTS_FLOAT32_DOES_NOT_HOLD = [(torch.float64, 1e6 + 0.3, 1.0), (torch.float32, 333333.40625, 3.0)]
SHIFT_IDS = ["float64-eta", "scale-3"]
LAM_BELOW_THE_SHIFTS_SPACING = 0.05


def losses_near_a_shift_float32_does_not_hold(n: int = 24) -> torch.Tensor:
    """n float32 losses 1e6 + j/16, each exact in float32."""
    return (1e6 + torch.arange(n, dtype=torch.float64) / 16).float()


def assert_exact_at_a_shift_float32_does_not_hold(what, value, weights, grad_eta, losses, eta, name, scale,
                                                  alpha=None, k=None):
    """value, the weights w_i (what names how they were read) and dL/deta of the DRO objective over the float32
    losses, against float64 with t = (l_i - G eta)/lam formed from G eta as given. The value rounds to float32 at
    G eta's magnitude (about 1e6): the value less G eta is compared within two of its roundings (CUDA's float32
    sums of l_i/lam add a rounding or two), which rounding G eta itself would not reach; the weights, whose t a
    rounded G eta moves by up to 0.6, are compared to float32 precision."""
    lam = LAM_BELOW_THE_SHIFTS_SPACING
    losses = losses.detach().double()
    e64 = eta.detach().double().requires_grad_()
    expected = dro_loss(losses, e64, lam, name, alpha=alpha, k=k, scale=scale)
    (expected_grad_eta,) = torch.autograd.grad(expected, e64)
    t = (losses - scale * e64.detach()) / lam
    expected_w = psi_star_first(t, name, alpha=alpha, k=k)
    g_eta = scale * float(eta.detach())
    value_spacing = 2 * torch.finfo(torch.float32).eps * abs(g_eta)
    torch.testing.assert_close(value.detach().double() - g_eta, expected.detach() - g_eta, rtol=1e-5,
                               atol=value_spacing)
    assert_within(f"{name}: {what}", weights.detach().double(), expected_w, 1e-5 * (1 + expected_w.abs()), "t", t)
    torch.testing.assert_close(grad_eta.double(), expected_grad_eta, rtol=1e-5, atol=1e-5)


def shifted_lse(x: torch.Tensor, dim: int = 1) -> torch.Tensor:
    """The logsumexp of x along dim as (shift, log_sum) pairs (..., 2), the layout the cross-entropy ops save: the
    max (0 where it is not finite) and the logsumexp of x minus it."""
    shift = x.amax(dim).nan_to_num(nan=0.0, posinf=0.0, neginf=0.0)
    return torch.stack([shift, torch.logsumexp(x - shift.unsqueeze(dim), dim)], -1)


def combined_lse(pairs: torch.Tensor) -> torch.Tensor:
    """shift + log_sum of (shift, log_sum) pairs, in float64."""
    return pairs[..., 0].double() + pairs[..., 1].double()


def as_numpy(t: torch.Tensor) -> np.ndarray:
    return t.detach().cpu().double().numpy()


# The README's table, literally, at 80 digits: the exact reference of tests/test_exactness_properties.py, and of any
# test whose t lies far beyond where the float64 formulas above hold.
mp = mpmath.mp


def mp_conjugate(t, name, alpha=None, k=None):
    """(psi*(t), psi*'(t), psi*''(t)) to 80 digits (psi*'' at a kink: its right limit). The literal formulas cancel
    near t = 0 (and for alpha or k - 1 near 0 or 1), so the working precision grows by the digits they lose."""
    t = mp.mpf(t)
    extra = 0
    for small in (abs(t), alpha, None if alpha is None else 1 - alpha, None if k is None else k - 1):
        if small is not None and small != 0:
            extra += max(0, int(-mpmath.log10(small)) + 1)
    with mp.workdps(80 + extra):
        return tuple(+v for v in _mp_conjugate(t, name, alpha, k))


def _mp_conjugate(t, name, alpha, k):
    if name == "chi2":
        u = max(t + 2, mp.mpf(0))
        return u * u / 4 - 1, u / 2, mp.mpf(0.5) if u > 0 else mp.mpf(0)
    if name == "kl":
        e = mp.exp(t)
        return mp.expm1(t), e, e
    if name == "cvar":
        a = mp.mpf(alpha)
        return max(t, mp.mpf(0)) / a, (1 / a if t > 0 else mp.mpf(0)), mp.mpf(0)
    if name == "kl_cvar":
        a = mp.mpf(alpha)
        cut = -mp.log(a)
        if t <= cut:
            e = mp.exp(t)
            return mp.expm1(t), e, e
        return (1 + t + mp.log(a)) / a - 1, 1 / a, mp.mpf(0)
    if name == "cressie_read":
        k = mp.mpf(k)
        u = (k - 1) * t + 1
        if u <= 0:
            return -1 / k, mp.mpf(0), mp.mpf(0)
        return (u ** (k / (k - 1)) - 1) / k, u ** (1 / (k - 1)), u ** ((2 - k) / (k - 1))
    if name == "smoothed_cvar":
        a = mp.mpf(alpha)
        d = 1 - a + a * mp.exp(t)
        p = a * mp.exp(t) / d
        return mp.log(d) / a, p / a, p * (1 - p) / a
    raise AssertionError(name)
