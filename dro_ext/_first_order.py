"""Backwards that are first order only, made to say so.

A backward formed by a kernel (or from values its forward saved detached: a logsumexp, the worst case's eta*) has no
derivative of its own. Where autograd records a backward (``create_graph=True``: a gradient penalty, a Hessian-vector
product), it would take those values as constants and return a wrong second derivative without a word (at most a
warning that an op has no autograd kernel). :func:`first_order_only` records such gradients instead as the outputs of
a node whose own derivative raises, naming the op.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.autograd.forward_ad as fwAD

__all__ = ["first_order_only", "refuse_forward_ad", "second_derivative_message"]


def second_derivative_message(op: str) -> str:
    """What a second derivative through ``op``'s backward raises."""
    return f"derivative for dro_ext::{op}'s backward is not implemented (its gradient is first order only)"


class _FirstOrderOnly(torch.autograd.Function):
    """Copies of the gradients, recorded as a function of what they depend on; its own derivative raises."""

    @staticmethod
    def forward(ctx: Any, message: str, count: int, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        ctx.message = message
        # Copies: an autograd.Function that returns its inputs as they are makes views of them, which autograd then
        # guards against in-place changes (AccumulateGrad's, say).
        return tuple(t.clone() for t in tensors[:count])

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> Any:
        raise RuntimeError(ctx.message)


def first_order_only(op: str, grads: Sequence[torch.Tensor | None],
                     *depends_on: torch.Tensor | None) -> tuple[torch.Tensor | None, ...]:
    """``grads`` (a backward's gradients, None where none flows) as they are, unless autograd records this backward
    (grad mode is on in a backward only under ``create_graph=True``) and something in ``depends_on`` (the op's inputs
    and upstream gradient) requires grad: then the same values, whose derivative raises
    :func:`second_derivative_message` for ``op``. Costs nothing in a first-order backward."""
    if not torch.is_grad_enabled():
        return tuple(grads)
    inputs = [t for t in depends_on if isinstance(t, torch.Tensor) and t.requires_grad]
    present = [g for g in grads if g is not None]
    if not inputs or not present:
        return tuple(grads)
    recorded = iter(_FirstOrderOnly.apply(second_derivative_message(op), len(present), *present, *inputs))
    return tuple(None if g is None else next(recorded) for g in grads)


def refuse_forward_ad(op: str, *inputs: torch.Tensor | float | None) -> None:
    """Raises where an input carries a forward-mode tangent (``torch.func.jvp``, ``torch.autograd.forward_ad``):
    the autograd formulas written in Python (torch.library's, a custom op's) have no forward derivative, and
    PyTorch runs them under forward AD with a tangent of 0, a silently wrong directional derivative. (The native
    ops' C++ autograd raises the same way.) While compiling, where a traced tensor shows no tangent, whenever a
    forward-AD level is open (``torch.func.jvp`` opens one too): a constant of the trace, which then holds no check."""
    if torch.compiler.is_compiling():
        refused = fwAD._current_level >= 0
    else:
        refused = any(isinstance(t, torch.Tensor) and fwAD.unpack_dual(t).tangent is not None for t in inputs)
    if refused:
        raise RuntimeError(f"dro_ext: forward-mode AD is not implemented for {op} (its derivatives are first order "
                           f"and reverse mode only); use reverse mode (torch.autograd.grad, torch.func.grad or vjp)")
