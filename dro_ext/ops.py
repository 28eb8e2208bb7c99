"""The public loss functions, dispatching to the native ops or to the PyTorch fallback, and the
fake (meta) kernels and autograd formulas of the native ops.

Math (docs/design.md sections 1.1-1.2), with t_i = (l_i - G*eta) / lam and w_i = psi*'(t_i):

    L(eta)   = mean_i lam * psi*(t_i) + G*eta  = mean_i l_i + lam * mean_i (psi*(t_i) - t_i)
    dL/dl_i  = w_i / N
    dL/deta  = G * (1 - mean_i w_i)
"""
from __future__ import annotations

from typing import Any

import torch

from dro_ext import _backend
from dro_ext._divergences import (
    DIVERGENCES,
    FLOATING_DTYPES,
    Divergence,
    Spec,
    accumulate_dtype,
    as_eta,
    check_dense,
    check_divergence,
    check_losses,
    checked_scalars,
    fallback_dtype,
    fixed_order_broadcast,
    fixed_order_sum,
    op_scalars,
)
from dro_ext._divergences import penalized_value as _penalized_value_torch
from dro_ext._divergences import psi_star as _psi_star_torch

__all__ = ["DIVERGENCES", "dro_loss", "dro_weights", "psi_star"]

# ---------------------------------------------------------------------------------------------------
# Native ops: fake (meta) kernels, for torch.compile. Registered only when the extension is loaded.
# ---------------------------------------------------------------------------------------------------

if _backend.native_available():

    @torch.library.register_fake("dro_ext::dro_loss")
    def _dro_loss_fake(losses: torch.Tensor, eta: torch.Tensor, lam: float, divergence: str, alpha: float | None = None,
                       k: float | None = None, scale: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
        torch._check(losses.dim() == 1, lambda: "dro_ext: losses must be a 1-D tensor")
        _backend.check_fake_devices("losses", losses, eta=eta)
        value = losses.new_empty(())
        mean_weight = losses.new_empty((), dtype=accumulate_dtype(losses.dtype))
        return value, mean_weight

    @torch.library.register_fake("dro_ext::psi_star_terms")
    def _psi_star_terms_fake(losses: torch.Tensor, eta: torch.Tensor, multiplier: torch.Tensor, lam: float,
                             divergence: str, alpha: float | None = None, k: float | None = None, scale: float = 1.0,
                             order: int = 1) -> torch.Tensor:
        _backend.check_fake_devices("losses", losses, eta=eta, multiplier=multiplier)
        return torch.empty_like(losses, memory_format=torch.contiguous_format)

    @torch.library.register_fake("dro_ext::dro_loss_backward")
    def _dro_loss_backward_fake(grad: torch.Tensor, losses: torch.Tensor, eta: torch.Tensor, mean_weight: torch.Tensor,
                                lam: float, divergence: str, alpha: float | None = None, k: float | None = None,
                                scale: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
        _backend.check_fake_devices("losses", losses, grad=grad, eta=eta, mean_weight=mean_weight)
        return torch.empty_like(losses, memory_format=torch.contiguous_format), torch.empty_like(eta)

    # The autograd formulas of these ops are registered in C++ (csrc/autograd.cpp): a Python
    # autograd.Function would cost more than the fused kernels themselves at typical batch sizes.

    # Looked up once: resolving torch.ops.dro_ext.dro_loss.default costs a few hundred ns per call.
    _dro_loss_op = torch.ops.dro_ext.dro_loss.default


# ---------------------------------------------------------------------------------------------------
# The PyTorch fallback: the same formulas, composed of PyTorch ops (autograd, compile, vmap for free).
# ---------------------------------------------------------------------------------------------------


def _fallback_dro_loss(losses: torch.Tensor, eta: torch.Tensor, lam: float, spec: Spec, scale: float) -> torch.Tensor:
    acc = fallback_dtype(losses.dtype, losses.device)
    x = losses.to(acc).contiguous()  # a strided view would be summed in another order than its copy
    g_eta = fixed_order_broadcast(scale * eta.to(acc), x.shape)  # eta's gradient: a fixed-order sum
    t = (x - g_eta) / lam
    value = fixed_order_sum(_penalized_value_torch(x, t, lam, g_eta, spec)) / x.shape[0]
    return value.to(losses.dtype)


def _fallback_terms(losses: torch.Tensor, eta: torch.Tensor, lam: float, spec: Spec, scale: float,
                    order: int) -> torch.Tensor:
    acc = fallback_dtype(losses.dtype, losses.device)
    t = (losses.to(acc) - fixed_order_broadcast(scale * eta.to(acc), losses.shape)) / lam
    return _psi_star_torch(t, spec, order).to(losses.dtype)


# ---------------------------------------------------------------------------------------------------
# Public API
# ---------------------------------------------------------------------------------------------------


def _checked_args(losses: torch.Tensor, eta: torch.Tensor | float, lam: float, divergence: str, alpha: float | None,
                  k: float | None, scale: float) -> tuple[Spec, torch.Tensor, float, float]:
    spec, lam, scale = checked_scalars(divergence, alpha, k, lam, scale)
    check_losses(losses)
    return spec, as_eta(eta, losses), lam, scale


def dro_loss(losses: torch.Tensor, eta: torch.Tensor | float, lam: float, divergence: Divergence = "chi2", *,
             alpha: float | None = None, k: float | None = None, scale: float = 1.0) -> torch.Tensor:
    """The penalized DRO objective ``mean_i lam * psi*((l_i - scale*eta)/lam) + scale*eta`` (a 0-d tensor).

    ``losses`` is a 1-D tensor of per-sample losses; ``eta`` a 0-d tensor (or a Python number, which gets
    no gradient). Gradients flow to both: ``dL/dl_i = w_i/N`` and ``dL/deta = scale*(1 - mean w)`` with
    ``w = dro_weights(...)``. The result has the dtype of ``losses``; sums accumulate in float32 (float64
    for float64 input). ``kl``'s weights (so its gradient) overflow to ``inf`` once ``(l - scale*eta)/lam``
    exceeds ~88 for float32 losses, and its value once it exceeds ~709 (``e^t`` past float64's range): ``inf``,
    never garbage; use :func:`dro_ext.robust_objective` for an overflow-free value. A loss of ``+inf`` gives
    ``+inf`` (its weight is ``psi*'(+inf)``); a loss of ``-inf`` adds ``lam*psi*(-inf) + scale*eta``, its limit, with
    weight 0.
    """
    if (losses.__class__ is torch.Tensor and isinstance(eta, torch.Tensor) and losses.layout is torch.strided
            and eta.device == losses.device and _backend.native_for_tensor(losses)):
        # The op checks the tensors itself, with the same errors; the Python numbers were checked when first seen.
        # (A training step's call: a few microseconds, where every check here shows.)
        return _dro_loss_op(losses, eta, *op_scalars(divergence, alpha, k, lam, scale))[0]
    spec, eta, lam, scale = _checked_args(losses, eta, lam, divergence, alpha, k, scale)
    if not _backend.native_for(losses.device.type):
        return _fallback_dro_loss(losses, eta, lam, spec, scale)
    return _dro_loss_op(losses, eta, lam, spec.name, spec.alpha, spec.k, scale)[0]


def dro_weights(losses: torch.Tensor, eta: torch.Tensor | float, lam: float, divergence: Divergence = "chi2", *,
                alpha: float | None = None, k: float | None = None, scale: float = 1.0) -> torch.Tensor:
    """The per-sample weights ``w_i = psi*'((l_i - scale*eta)/lam)`` (shape ``(N,)``, dtype of ``losses``).

    ``w_i / N`` is the gradient of :func:`dro_loss` with respect to ``l_i``; at the optimal ``eta`` it is
    the worst-case distribution over the batch. Differentiable (through ``psi*''``).
    """
    spec, eta, lam, scale = _checked_args(losses, eta, lam, divergence, alpha, k, scale)
    if _backend.native_for(losses.device.type):
        one = torch.ones((), dtype=accumulate_dtype(losses.dtype), device=losses.device)
        return torch.ops.dro_ext.psi_star_terms(losses, eta, one, lam, spec.name, spec.alpha, spec.k, scale, 1)
    return _fallback_terms(losses, eta, lam, spec, scale, 1)


def psi_star(t: torch.Tensor, divergence: Divergence = "chi2", *, alpha: float | None = None,
             k: float | None = None) -> torch.Tensor:
    """The conjugate ``psi*(t)`` of the divergence, elementwise over a floating tensor of any shape."""
    spec = check_divergence(divergence, alpha, k)
    if not isinstance(t, torch.Tensor) or t.dtype not in FLOATING_DTYPES:
        raise TypeError("dro_ext: t must be a floating-point torch.Tensor")
    check_dense("t", t)
    acc = accumulate_dtype(t.dtype)
    zero = torch.zeros((), dtype=acc, device=t.device)
    if _backend.native_for(t.device.type):
        one = torch.ones((), dtype=acc, device=t.device)
        return torch.ops.dro_ext.psi_star_terms(t, zero, one, 1.0, spec.name, spec.alpha, spec.k, 1.0, 0)
    return _fallback_terms(t, zero, 1.0, spec, 1.0, 0)
