"""Independent float64 references for the tests: the conjugates exactly as DESIGN.md's table writes them,
and the divergences psi(s) they are conjugate to, from which a numerical conjugate is derived."""
from __future__ import annotations

import math

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


def psi_star(t: torch.Tensor, name: str, alpha=None, k=None) -> torch.Tensor:
    """The table of DESIGN.md section 1, written literally (no stabilization): valid for moderate t."""
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


def dro_loss(losses, eta, lam, name, alpha=None, k=None, scale=1.0):
    """mean_i lam * psi*((l_i - G eta)/lam) + G eta in float64, differentiable by autograd."""
    t = (losses - scale * eta) / lam
    return lam * psi_star(t, name, alpha, k).mean() + scale * eta


def psi(s: float, name: str, alpha=None, k=None) -> float:
    """The divergence whose conjugate the table lists (chi2 per DESIGN.md's erratum: (s-1)^2)."""
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


def tolerances(dtype: torch.dtype) -> dict:
    return {
        torch.float16: dict(rtol=2e-3, atol=2e-3),
        torch.bfloat16: dict(rtol=1.6e-2, atol=1.6e-2),
        torch.float32: dict(rtol=2e-5, atol=2e-6),
        torch.float64: dict(rtol=1e-11, atol=1e-12),
    }[dtype]


def as_numpy(t: torch.Tensor) -> np.ndarray:
    return t.detach().cpu().double().numpy()
