"""The divergences on the Python side: argument validation and the PyTorch fallback of psi* and its
derivatives. It mirrors csrc/divergences.h formula for formula (see that file for the derivations and
DESIGN.md section 1 for the errata against the paper's Table 1).
"""
from __future__ import annotations

import math
from typing import NamedTuple

import torch

DIVERGENCES = ("chi2", "kl", "cvar", "kl_cvar", "cressie_read", "smoothed_cvar")
_NEEDS_ALPHA = ("cvar", "kl_cvar", "smoothed_cvar")


class Spec(NamedTuple):
    """A validated divergence with the parameters it uses (the others are None)."""

    name: str
    alpha: float | None
    k: float | None


def _finite_float(name: str, value) -> float:
    if isinstance(value, torch.Tensor):
        raise TypeError(f"dro_ext: {name} must be a Python number, got a Tensor")
    try:
        out = float(value)
    except (TypeError, ValueError):
        raise TypeError(f"dro_ext: {name} must be a number, got {value!r}") from None
    return out


def check_divergence(divergence: str, alpha=None, k=None) -> Spec:
    if divergence not in DIVERGENCES:
        raise ValueError(f"dro_ext: unknown divergence {divergence!r}; expected one of {', '.join(DIVERGENCES)}")
    if divergence in _NEEDS_ALPHA:
        if alpha is None:
            raise ValueError(f"dro_ext: divergence {divergence!r} needs alpha in (0, 1), got alpha=None")
        alpha = _finite_float("alpha", alpha)
        if not 0.0 < alpha < 1.0:
            raise ValueError(f"dro_ext: alpha must be in (0, 1) for divergence {divergence!r}, got alpha={alpha}")
        return Spec(divergence, alpha, None)
    if divergence == "cressie_read":
        if k is None:
            raise ValueError("dro_ext: divergence 'cressie_read' needs k > 1, got k=None")
        k = _finite_float("k", k)
        if not 1.0 < k < math.inf:
            raise ValueError(f"dro_ext: k must be a finite number > 1 for divergence 'cressie_read', got k={k}")
        return Spec(divergence, None, k)
    return Spec(divergence, None, None)


def check_positive(name: str, value) -> float:
    value = _finite_float(name, value)
    # Comparisons rather than math.isfinite, which torch.compile cannot trace on symbolic floats.
    if not 0.0 < value < math.inf:
        raise ValueError(f"dro_ext: {name} must be a finite number > 0, got {name}={value}")
    return value


def check_losses(losses) -> None:
    if not isinstance(losses, torch.Tensor):
        raise TypeError(f"dro_ext: losses must be a torch.Tensor, got {type(losses).__name__}")
    if losses.dim() != 1:
        raise ValueError(f"dro_ext: losses must be a 1-D tensor of per-sample losses, got shape {tuple(losses.shape)}")
    if losses.numel() == 0:
        raise ValueError("dro_ext: losses must not be empty")
    if not losses.is_floating_point():
        raise TypeError(f"dro_ext: losses must have a floating dtype (float16, bfloat16, float32, float64), got {losses.dtype}")


def as_eta(eta, losses: torch.Tensor) -> torch.Tensor:
    """eta as a 0-d tensor on the losses' device; a Python number becomes a constant (no gradient)."""
    if isinstance(eta, torch.Tensor):
        if eta.dim() != 0:
            raise ValueError(f"dro_ext: eta must be a 0-d tensor, got shape {tuple(eta.shape)}")
        if not eta.is_floating_point():
            raise TypeError(f"dro_ext: eta must have a floating dtype, got {eta.dtype}")
        if eta.device != losses.device:
            raise ValueError(
                f"dro_ext: eta is on {eta.device} but losses is on {losses.device}; move them to the same device"
            )
        return eta
    return torch.tensor(_finite_float("eta", eta), dtype=accumulate_dtype(losses.dtype), device=losses.device)


def accumulate_dtype(dtype: torch.dtype) -> torch.dtype:
    """float32 for half/bfloat16/float32 inputs, float64 for float64 inputs (DESIGN.md section 1)."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def _select_positive(x, if_pos, if_nonpos):
    # x > 0 ? if_pos : (x <= 0 ? if_nonpos : x), so a NaN in x comes out as NaN.
    return torch.where(x > 0, if_pos, torch.where(x <= 0, if_nonpos, x))


def _relu(x):
    # max(x, 0) whose value and gradient are NaN at a NaN (torch.relu's gradient there is 0, which would
    # silently drop the sample from the gradient); the gradient at 0 is 0, the subgradient of DESIGN.md.
    return x * _select_positive(x, 1.0, 0.0)


def psi_star(t: torch.Tensor, spec: Spec, order: int = 0) -> torch.Tensor:
    """psi*^(order)(t) for order 0, 1, 2, in t's dtype, differentiable by autograd."""
    name = spec.name
    if name == "chi2":
        u = _relu(t + 2.0)
        if order == 0:
            return u * u * 0.25 - 1.0
        if order == 1:
            return u * 0.5
        return _select_positive(t + 2.0, 0.5, 0.0)
    if name == "kl":
        return torch.expm1(t) if order == 0 else torch.exp(t)
    if name == "cvar":
        inv_alpha = 1.0 / spec.alpha
        if order == 0:
            return _relu(t) * inv_alpha
        return _select_positive(t, inv_alpha if order == 1 else 0.0, 0.0)
    if name == "kl_cvar":
        cut = -math.log(spec.alpha)
        # clamp (not minimum) so that the gradient at t == cut is exp(cut), as in the closed form.
        below = torch.clamp(t, max=cut)
        if order == 0:
            return torch.expm1(below) + _relu(t - cut) / spec.alpha
        if order == 1:
            return torch.exp(below)
        return _select_positive(t - cut, 0.0, torch.exp(below))
    if name == "cressie_read":
        k = spec.k
        u = t * (k - 1.0) + 1.0
        # Powers of u below 1 have an infinite slope at u = 0: evaluate them only where u > 0 (safe_u is 1
        # elsewhere), so that autograd never multiplies that infinity by the zero slope of the clamp.
        safe_u = _select_positive(u, u, torch.ones_like(u))
        if order == 0:
            return (_relu(u) * safe_u ** (1.0 / (k - 1.0)) - 1.0) / k  # u_+^(k/(k-1))
        power = 1.0 / (k - 1.0) if order == 1 else (2.0 - k) / (k - 1.0)
        return _select_positive(u, safe_u**power, 0.0)
    if name == "smoothed_cvar":
        alpha = spec.alpha
        s = t + (math.log(alpha) - math.log1p(-alpha))
        if order == 0:
            # softplus(s) written out: F.softplus switches to the identity above s = 20, ~2e-9 off in float64.
            softplus = _relu(s) + torch.log1p(torch.exp(-s.abs()))
            return (math.log1p(-alpha) + softplus) / alpha
        p = torch.sigmoid(s)
        return p / alpha if order == 1 else p * (1.0 - p) / alpha
    raise AssertionError(name)
