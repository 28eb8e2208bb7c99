"""Per-token cross-entropies with a memory-light backward, and the DRO objective over groups of tokens (sequences,
domains) that dro_cross_entropy and dro_linear_cross_entropy take with ``groups=`` and ``num_groups=``.

A group's loss is the mean of the cross-entropies of its kept tokens (target not ``ignore_index``), and the value is
:func:`dro_ext.group_dro_loss` over the kept tokens with batch weighting:

    L = scale eta + sum_g (n_g / n) lam psi*((m_g - scale eta)/lam)        n_g kept tokens of group g, n = sum_g n_g

Its gradient with respect to a token's loss is psi*'(t_{g_i}) / n: the sample-level weight with the row's own t
replaced by its group's. So the objective is composed of two parts, each reusing what exists:

- the per-token losses, as custom ops whose backward takes any per-token gradient and forms the gradient of the
  logits with the native per-row gradient writer (dro_cross_entropy_backward: grad * row_weight_i * (softmax_i -
  q_i), from the saved per-row logsumexp): :func:`cross_entropy_losses` from logits, and
  :func:`linear_cross_entropy_losses` from the hidden states and the head, which never holds more than a chunk of
  logits: its forward is one chunked pass for the losses and logsumexps (no gradients), its backward a second pass
  that recomputes each chunk's logits (the extra matmul), overwrites them with their gradient and folds it into those
  of hidden, weight and bias;
- the O(N) + O(G) objective over the group sums, in PyTorch ops through dro_ext/groups.py (its per-group reduction
  and its formula), differentiated by autograd.

The same per-token losses feed :class:`dro_ext.GroupDROLoss` (``mask=targets != ignore_index``).
"""
from __future__ import annotations

from typing import Optional

import torch

from dro_ext import _backend
from dro_ext import groups as _groups
from dro_ext._divergences import accumulate_dtype, fallback_dtype, fixed_order_sums
from dro_ext._first_order import first_order_only, refuse_forward_ad
from dro_ext.cross_entropy import (_check_float_tensor, _check_ignore_index, _check_label_smoothing,
                                   _check_linear_args, _check_target_range, _check_targets,
                                   _weighted_residual, check_linear_target_range, chunk_logits, logits_buffer,
                                   losses_from_shifted_lse, shifted_logsumexp, shifted_softmax)

__all__ = ["cross_entropy_losses", "linear_cross_entropy_losses"]


# ---------------------------------------------------------------------------------------------------
# The per-row pieces, native or in PyTorch
# ---------------------------------------------------------------------------------------------------


def _row_lse(x, targets, ignore_index: int, native: bool):
    """logsumexp of each row of the (N, C) logits as (N, 2) (shift, log_sum) pairs in the accumulate dtype
    (csrc/cross_entropy_terms.h's ShiftedLogSumExp), 0 on ignored rows. Native: the forward
    kernel of dro_cross_entropy (one pass, nothing N x C allocated; its DRO sums, O(N), are not used), or, for
    column-major logits (the transpose of a contiguous (C, N) matrix), the column kernel over that matrix."""
    acc = accumulate_dtype(x.dtype)
    if native and x.dim() == 2 and x.shape[0] > 1 and x.t().is_contiguous():
        if x.device.type == "cpu":
            # The column kernel reads no target, so it cannot name a bad one as the row kernel does (CUDA: the
            # gather below asserts on the device, as the row kernel does, without a host sync).
            _check_target_range(targets, x.shape[1], ignore_index)
        return torch.where((targets != ignore_index)[:, None], torch.ops.dro_ext.logsumexp_columns(x.t()), 0.0)
    if native:
        zero = torch.zeros((), dtype=acc, device=x.device)
        return torch.ops.dro_ext.dro_cross_entropy(x, targets, zero, 1.0, "chi2", None, None, 1.0, ignore_index,
                                                   0.0)[2]
    # In pieces of rows, as _logits_gradient_ writes the gradient: whole, the cast, x - shift and torch.logsumexp's
    # own temporary took three chunks of logits beside the chunk (2.6x the native op's peak at V = 50000).
    lse = torch.cat([shifted_logsumexp(piece.to(acc)) for piece in x.split(_fallback_piece_rows(x))])
    return torch.where((targets != ignore_index)[:, None], lse, 0.0)


def _losses_from_lse(x, targets, lse, ignore_index: int, label_smoothing: float):
    """F.cross_entropy's per-row loss (1-eps)(lse - x_y) + eps(lse - mean_c x_c) from the row's logsumexp pairs, in
    lse's dtype; 0 on ignored rows. Reads N target logits, and (eps > 0) the logits once more for their row means."""
    keep = targets != ignore_index
    target_logit = x.gather(1, torch.where(keep, targets, 0)[:, None]).squeeze(1).to(lse.dtype)
    row_mean = fixed_order_sums(x, 1, dtype=lse.dtype) / x.shape[1] if label_smoothing else None  # x.mean(dim=1)
    return torch.where(keep, losses_from_shifted_lse(lse, target_logit, row_mean, label_smoothing), 0.0)


# Logit bytes (at least) of the pieces of rows the fallback works through a chunk by (_row_lse, _logits_gradient_),
# so that its temporaries, several per piece and in float64, stay a fraction of the chunk; the native ops take the
# whole chunk in place. At 8 MiB the grouped linear op's peak was 2.6x the native op's (2048 x 50000 logits in
# chunks of 256 rows: 160 MiB against 62), at 1 MiB 1.23x, and its forward and backward ran 1.8x faster (one
# thread of a 2-vCPU Intel Xeon; measured alone, not in a result file).
FALLBACK_PIECE_LOGIT_BYTES = 1 << 20


def _fallback_piece_rows(x: torch.Tensor) -> int:
    """Rows of the (N, C) logits x per fallback piece: FALLBACK_PIECE_LOGIT_BYTES of them, rounded up to whole rows."""
    return max(1, -(-FALLBACK_PIECE_LOGIT_BYTES // max(1, x.shape[1] * x.element_size())))


def _logits_gradient_(x, targets, lse, row_weight, ignore_index: int, label_smoothing: float, native: bool):
    """x overwritten by row_weight_i (softmax_i - q_i) (0 on ignored rows): no second (N, C) tensor, no copy."""
    if native:
        one = torch.ones((), dtype=x.dtype, device=x.device)
        torch.ops.dro_ext.dro_cross_entropy_backward_(one, x, targets, lse, row_weight.contiguous(), ignore_index,
                                                      label_smoothing)
        return
    piece = _fallback_piece_rows(x)
    for start in range(0, x.shape[0], piece):
        rows = slice(start, start + piece)
        x[rows] = _logits_gradient(x[rows], targets[rows], lse[rows], row_weight[rows], ignore_index, label_smoothing,
                                   native=False)


def _logits_gradient(x, targets, lse, row_weight, ignore_index: int, label_smoothing: float, native: bool):
    """row_weight_i (softmax_i - q_i) in the logits' dtype (0 on ignored rows); a new tensor of x's shape."""
    if native:
        one = torch.ones((), dtype=x.dtype, device=x.device)
        return torch.ops.dro_ext.dro_cross_entropy_backward(one, x, targets, lse, row_weight.contiguous(),
                                                            ignore_index, label_smoothing)
    acc = fallback_dtype(x.dtype, x.device)
    keep = targets != ignore_index
    xa = x.to(acc)
    q = torch.full_like(xa, label_smoothing / x.shape[1])
    q.scatter_add_(1, torch.where(keep, targets, 0)[:, None], torch.full_like(xa[:, :1], 1.0 - label_smoothing))
    residual = torch.where(keep[:, None], shifted_softmax(xa, lse.to(acc)) - q, 0.0)
    return _weighted_residual(row_weight.to(acc)[:, None], residual).to(x.dtype)


# ---------------------------------------------------------------------------------------------------
# Per-token losses from the logits
# ---------------------------------------------------------------------------------------------------


@torch.library.custom_op("dro_ext::cross_entropy_row_losses", mutates_args=())
def _cross_entropy_row_losses(logits: torch.Tensor, targets: torch.Tensor, ignore_index: int,
                              label_smoothing: float, native: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(losses, lse) of the (N, C) logits, (N,) and (N, 2) (_row_lse) in the accumulate dtype, 0 on ignored rows."""
    logits = logits.contiguous()  # a strided view's row means would be summed in another order than its copy's
    lse = _row_lse(logits, targets, ignore_index, native)
    return _losses_from_lse(logits, targets, lse, ignore_index, label_smoothing), lse


@_cross_entropy_row_losses.register_fake
def _cross_entropy_row_losses_fake(logits, targets, ignore_index, label_smoothing, native):
    _backend.check_fake_devices("logits", logits, targets=targets)
    acc = accumulate_dtype(logits.dtype)
    rows = logits.shape[0]
    return logits.new_empty((rows,), dtype=acc), logits.new_empty((rows, 2), dtype=acc)


def _row_losses_setup_context(ctx, inputs, output):
    logits, targets, ignore_index, label_smoothing, native = inputs
    ctx.mark_non_differentiable(output[1])
    ctx.save_for_backward(logits, targets, output[1])
    ctx.args = (ignore_index, label_smoothing, native)


def _row_losses_backward(ctx, grad_losses, unused):
    logits, targets, lse = ctx.saved_tensors
    ignore_index, label_smoothing, native = ctx.args
    if grad_losses is None or not ctx.needs_input_grad[0]:
        return None, None, None, None, None
    grad_logits = _logits_gradient(logits, targets, lse, grad_losses.to(lse.dtype), ignore_index, label_smoothing,
                                   native)
    (grad_logits,) = first_order_only("cross_entropy_losses", (grad_logits,), logits, grad_losses)
    return grad_logits, None, None, None, None


# First order only, as dro_cross_entropy: the gradient writer has no derivative of its own (a second derivative
# raises: first_order_only).
_cross_entropy_row_losses.register_autograd(_row_losses_backward, setup_context=_row_losses_setup_context)


# ---------------------------------------------------------------------------------------------------
# Per-token losses from the hidden states and the head: two chunked passes
# ---------------------------------------------------------------------------------------------------


def _first_pass_column_major(hidden: torch.Tensor, native: bool) -> bool:
    """Whether the forward's chunk loop forms the logits column-major (weight @ h.T) and reads them with the column
    logsumexp kernel: that pass needs only each row's logsumexp and target logit, and the layout is the one the
    BLAS forms faster. Measured on the benchmark machine (2-core AMD EPYC, two threads, 256 x 32000 chunks from
    H = 1024): float32 about 12% faster (807-828 ms against 910-939 ms for 8 chunks), float64 and float16 26-32%
    slower, bfloat16 the same; so float32 on the CPU with the native kernels only. On CUDA cuBLAS forms either
    layout as fast, and the row kernel is the tuned one. The backward's pass keeps the row-major logits that its
    gradient writer and matmuls take."""
    return native and hidden.device.type == "cpu" and hidden.dtype == torch.float32


@torch.library.custom_op("dro_ext::linear_cross_entropy_row_losses", mutates_args=())
def _linear_row_losses(hidden: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
                       targets: torch.Tensor, ignore_index: int, label_smoothing: float, chunk_size: int,
                       native: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(losses, lse), (N,) and (N, 2) (_row_lse) in the accumulate dtype, of logits = hidden @ weight.T + bias, a
    chunk of rows at a time: each chunk's logits are freed before the next are formed."""
    rows = hidden.shape[0]
    hidden, weight = hidden.contiguous(), weight.contiguous()  # strided operands would be multiplied in other orders
    acc = accumulate_dtype(hidden.dtype)
    losses = torch.empty((rows,), dtype=acc, device=hidden.device)
    lse = torch.empty((rows, 2), dtype=acc, device=hidden.device)
    column_major = _first_pass_column_major(hidden, native)
    buffer = logits_buffer(rows, chunk_size, hidden, weight)
    for start in range(0, rows, chunk_size):
        end = min(rows, start + chunk_size)
        logits = chunk_logits(buffer, hidden[start:end], weight, bias, column_major=column_major)
        y = targets[start:end]
        lse[start:end] = _row_lse(logits, y, ignore_index, native)
        losses[start:end] = _losses_from_lse(logits, y, lse[start:end], ignore_index, label_smoothing)
        del logits
    return losses, lse


@_linear_row_losses.register_fake
def _linear_row_losses_fake(hidden, weight, bias, targets, ignore_index, label_smoothing, chunk_size, native):
    _backend.check_fake_devices("hidden", hidden, weight=weight, bias=bias, targets=targets)
    acc = accumulate_dtype(hidden.dtype)
    rows = hidden.shape[0]
    return hidden.new_empty((rows,), dtype=acc), hidden.new_empty((rows, 2), dtype=acc)


@torch.library.custom_op("dro_ext::linear_cross_entropy_row_losses_backward", mutates_args=())
def _linear_row_losses_backward_op(
        row_weight: torch.Tensor, hidden: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
        targets: torch.Tensor, lse: torch.Tensor, ignore_index: int, label_smoothing: float, chunk_size: int,
        native: bool, grad_hidden_needed: bool, grad_weight_needed: bool, grad_bias_needed: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(grad_hidden, grad_weight, grad_bias) for the per-row loss gradients ``row_weight``: each chunk's logits are
    recomputed, overwritten by row_weight_i (softmax_i - q_i) (the per-row gradient writer, in place), and folded in
    by matmuls in chunk order (deterministic). A gradient that is not needed comes back empty (shape (0,))."""
    rows = hidden.shape[0]
    acc = accumulate_dtype(hidden.dtype)
    hidden, weight = hidden.contiguous(), weight.contiguous()
    grad_hidden = torch.empty_like(hidden) if grad_hidden_needed else hidden.new_empty((0,))
    # In the weight's dtype, as dro_linear_cross_entropy's: every chunk's matmul accumulates in float32 and rounds
    # once into it; the first chunk writes it and the others add into it.
    grad_weight = torch.empty_like(weight) if grad_weight_needed else hidden.new_empty((0,))
    if grad_weight_needed and rows == 0:
        grad_weight.zero_()
    grad_bias = torch.zeros((weight.shape[0],), dtype=acc, device=hidden.device) if grad_bias_needed \
        else hidden.new_empty((0,))
    row_weight = row_weight.to(acc)
    buffer = logits_buffer(rows, chunk_size, hidden, weight)
    for start in range(0, rows, chunk_size):
        end = min(rows, start + chunk_size)
        h = hidden[start:end]
        grad = chunk_logits(buffer, h, weight, bias)  # the chunk's logits, overwritten by their gradient
        _logits_gradient_(grad, targets[start:end], lse[start:end], row_weight[start:end], ignore_index,
                          label_smoothing, native)
        if grad_hidden_needed:
            torch.mm(grad, weight, out=grad_hidden[start:end])
        if grad_weight_needed:
            if start == 0:
                torch.mm(grad.t(), h, out=grad_weight)
            else:
                grad_weight.addmm_(grad.t(), h)
        if grad_bias_needed:
            grad_bias += grad.sum(0, dtype=acc)
        del grad
    if grad_bias_needed:
        grad_bias = grad_bias.to(weight.dtype)  # bias has the dtype of weight and hidden (checked)
    return grad_hidden, grad_weight, grad_bias


@_linear_row_losses_backward_op.register_fake
def _linear_row_losses_backward_fake(row_weight, hidden, weight, bias, targets, lse, ignore_index, label_smoothing,
                                     chunk_size, native, grad_hidden_needed, grad_weight_needed, grad_bias_needed):
    _backend.check_fake_devices("hidden", hidden, row_weight=row_weight, weight=weight, bias=bias, targets=targets,
                                lse=lse)
    return (torch.empty_like(hidden, memory_format=torch.contiguous_format) if grad_hidden_needed
            else hidden.new_empty((0,)),
            torch.empty_like(weight, memory_format=torch.contiguous_format) if grad_weight_needed
            else hidden.new_empty((0,)),
            bias.new_empty(bias.shape) if grad_bias_needed else hidden.new_empty((0,)))


def _linear_row_losses_setup_context(ctx, inputs, output):
    hidden, weight, bias, targets, ignore_index, label_smoothing, chunk_size, native = inputs
    ctx.mark_non_differentiable(output[1])
    ctx.save_for_backward(hidden, weight, bias, targets, output[1])
    ctx.args = (ignore_index, label_smoothing, chunk_size, native)


def _linear_row_losses_backward(ctx, grad_losses, unused):
    hidden, weight, bias, targets, lse = ctx.saved_tensors
    needs = ctx.needs_input_grad[:3]
    if grad_losses is None or not any(needs):
        return (None,) * 8
    grads = torch.ops.dro_ext.linear_cross_entropy_row_losses_backward(
        grad_losses, hidden, weight, bias, targets, lse, *ctx.args, *needs)
    grads = first_order_only("linear_cross_entropy_losses", [g if need else None for g, need in zip(grads, needs)],
                             hidden, weight, bias, grad_losses)
    return tuple(grads) + (None,) * 5


_linear_row_losses.register_autograd(_linear_row_losses_backward, setup_context=_linear_row_losses_setup_context)


# ---------------------------------------------------------------------------------------------------
# Public per-token losses
# ---------------------------------------------------------------------------------------------------


def cross_entropy_losses(logits: torch.Tensor, targets: torch.Tensor, *, ignore_index: int = -100,
                         label_smoothing: float = 0.0) -> torch.Tensor:
    """``F.cross_entropy(logits, targets, reduction="none", ignore_index=..., label_smoothing=...)`` with the classes
    in the LAST dimension: logits (..., C), targets (...) int64, the result of the targets' shape, 0 where the target
    is ``ignore_index``, in the accumulate dtype (float32 for half/bfloat16 logits, as the sums that consume it).

    Native: one pass for the losses, and a backward that forms ``grad_i (softmax_i - q_i)`` in one pass from the
    logits and the per-row logsumexp it saved (2N floats; nothing N x C is kept but the logits themselves)."""

    refuse_forward_ad("cross_entropy_losses", logits)
    ignore_index, label_smoothing = _check_ignore_index(ignore_index), _check_label_smoothing(label_smoothing)
    x, y = _flat_logits(logits, targets)
    return _cross_entropy_row_losses_checked(x, y, ignore_index, label_smoothing).reshape(targets.shape)


def _flat_logits(logits, targets):
    _check_float_tensor("logits", logits)
    _check_targets(targets, logits.shape[:-1], f"logits of shape {tuple(logits.shape)}", logits.device)
    num_classes = logits.shape[-1]
    if num_classes == 0:
        raise ValueError(f"dro_ext: logits must have at least one class, got shape {tuple(logits.shape)}")
    return logits.reshape(-1, num_classes), targets.reshape(-1)


def _cross_entropy_row_losses_checked(x, y, ignore_index, label_smoothing):
    native = _backend.native_for(x.device.type)
    if not native:
        _check_target_range(y, x.shape[1], ignore_index)
    return _cross_entropy_row_losses(x, y, ignore_index, label_smoothing, native)[0]


def linear_cross_entropy_losses(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, *,
                                bias: torch.Tensor | None = None, ignore_index: int = -100,
                                label_smoothing: float = 0.0, chunk_size: int | None = None) -> torch.Tensor:
    """:func:`cross_entropy_losses` of ``logits = hidden @ weight.T (+ bias)``, never holding more than a chunk of
    them (``chunk_size`` rows; default :func:`dro_ext.cross_entropy.default_chunk_size`).

    The forward is one chunked pass (a matmul per chunk, then the per-row logsumexp and loss; no gradients); it
    saves the per-row logsumexp. The backward, given any gradient of the losses, is a second chunked pass: it
    recomputes each chunk's logits (one more matmul per chunk than :func:`dro_ext.dro_linear_cross_entropy`, which
    forms its gradients in its single pass), writes their gradient and folds it into the gradients of hidden, weight
    and bias. Peak extra memory: a chunk of logits (overwritten by their gradient in place) plus the gradients
    themselves."""

    refuse_forward_ad("linear_cross_entropy_losses", hidden, weight, bias)
    ignore_index, label_smoothing = _check_ignore_index(ignore_index), _check_label_smoothing(label_smoothing)
    h, weight, bias, y, chunk_size = _flat_hidden(hidden, weight, targets, bias, chunk_size)
    return _linear_row_losses_checked(h, weight, bias, y, ignore_index, label_smoothing, chunk_size
                                      ).reshape(targets.shape)


def _flat_hidden(hidden, weight, targets, bias, chunk_size):
    """The argument checks of dro_linear_cross_entropy (its own, called with the DRO scalars it does not need)."""
    return _check_linear_args(hidden, weight, targets, bias, chunk_size)


def _linear_row_losses_checked(h, weight, bias, y, ignore_index, label_smoothing, chunk_size):
    native = _backend.native_for(h.device.type)
    check_linear_target_range(y, weight.shape[0], ignore_index, native)
    return _linear_row_losses(h, weight, bias, y, ignore_index, label_smoothing, chunk_size, native)[0]


# ---------------------------------------------------------------------------------------------------
# The objective over groups of tokens
# ---------------------------------------------------------------------------------------------------


def check_token_groups(groups, num_groups, targets: torch.Tensor) -> tuple[torch.Tensor, int] | tuple[None, None]:
    """(groups as one id per flattened token, num_groups), or (None, None) when neither is given. ``groups`` has the
    targets' shape (one id per token) or targets.shape[:-1] (one per sequence, broadcast over its tokens)."""
    if groups is None and num_groups is None:
        return None, None
    if groups is None:
        raise ValueError(f"dro_ext: num_groups={num_groups!r} was given without groups; pass groups (a group id per "
                         "token or per sequence) or leave num_groups=None")
    if num_groups is None:
        raise ValueError("dro_ext: groups was given without num_groups; pass num_groups (the number of groups)")
    num_groups = _groups.check_num_groups(num_groups)
    if not isinstance(groups, torch.Tensor):
        raise TypeError(f"dro_ext: groups must be a torch.Tensor of group ids, got {type(groups).__name__}")
    _groups.check_dense("groups", groups)
    if groups.dtype not in (torch.int64, torch.int32):
        raise TypeError(f"dro_ext: groups must be an int32 or int64 tensor of group ids, got {groups.dtype}")
    if groups.device != targets.device:
        raise ValueError(f"dro_ext: groups is on {groups.device} but targets is on {targets.device}; move them to "
                         "the same device")
    per_token, per_sequence = tuple(targets.shape), tuple(targets.shape[:-1])
    if tuple(groups.shape) == per_token:
        return groups.reshape(-1), num_groups
    if targets.dim() >= 1 and tuple(groups.shape) == per_sequence:
        return groups.unsqueeze(-1).expand(targets.shape).reshape(-1), num_groups
    raise ValueError(f"dro_ext: groups must have the shape of targets, {per_token} (one id per token), or "
                     f"{per_sequence} (one per sequence), got {tuple(groups.shape)}")


def grouped_objective(losses, keep, token_groups, num_groups: int, eta, lam: float, spec, scale: float,
                      dtype) -> torch.Tensor:
    """group_dro_loss (batch weighting) of the kept rows' losses, in ``dtype``: 0 with zero gradients when no row is
    kept (as dro_cross_entropy)."""
    # float64 sums, as group_dro_loss takes them (a float32 mean moves t by its rounding over lam)
    sums, counts = _groups._masked_group_sums(losses, token_groups, num_groups, keep)
    acc = fallback_dtype(losses.dtype, losses.device)
    m, present = _groups._group_means(sums, counts, acc)
    return _groups._penalized_group_objective(m, present, counts.to(acc), scale * eta.to(acc), lam, spec).to(dtype)


def grouped_dro_cross_entropy(x, y, token_groups, num_groups, eta, lam, spec, scale, ignore_index, label_smoothing):
    losses = _cross_entropy_row_losses_checked(x, y, ignore_index, label_smoothing)
    return grouped_objective(losses, y != ignore_index, token_groups, num_groups, eta, lam, spec, scale,
                             accumulate_dtype(x.dtype))


def two_pass_dro_linear_cross_entropy(h, weight, bias, y, eta, lam, spec, scale, ignore_index, label_smoothing,
                                      chunk_size):
    """dro_linear_cross_entropy over the kept tokens from their losses (one chunked pass) and a second pass in
    backward that forms the logits' gradient with the upstream gradient in it: for float16, where the one-pass op's
    gradients, formed in the forward at a unit upstream gradient, underflowed before GradScaler's scale reached them."""
    from dro_ext.loss import masked_dro_loss

    losses = _linear_row_losses_checked(h, weight, bias, y, ignore_index, label_smoothing, chunk_size)
    value = masked_dro_loss(losses, y != ignore_index, eta, lam, spec.name, spec.alpha, spec.k, scale)
    return value.to(accumulate_dtype(h.dtype))


def grouped_dro_linear_cross_entropy(h, weight, bias, y, token_groups, num_groups, eta, lam, spec, scale,
                                     ignore_index, label_smoothing, chunk_size):
    losses = _linear_row_losses_checked(h, weight, bias, y, ignore_index, label_smoothing, chunk_size)
    return grouped_objective(losses, y != ignore_index, token_groups, num_groups, eta, lam, spec, scale,
                             accumulate_dtype(h.dtype))
