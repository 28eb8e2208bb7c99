"""DRO cross-entropy fused from the logits, and from the LM head without materializing the logits.

With l_i = F.cross_entropy(logits, targets, reduction="none", ignore_index=..., label_smoothing=...)[i],
t_i = (l_i - G*eta)/lam and w_i = psi*'(t_i), over the n rows whose target is not ``ignore_index``:

    L        = (1/n) sum_i lam*psi*(t_i) + G*eta                 (0 when every row is ignored)
    dL/dz_i  = (w_i/n) (softmax(z_i) - q_i)                     q_i = (1-eps) onehot(y_i) + eps/C
    dL/deta  = G (1 - (1/n) sum_i w_i)

w_i needs only the row's own loss and eta, so the gradient of a row of logits is final as soon as that row's
loss is known: dro_linear_cross_entropy computes the logits of a chunk of rows, turns them in place into
their gradient and folds it into the gradients of hidden, weight and bias, chunk after chunk.

Classes are the LAST dimension: logits (..., C) with targets (...), as in language modeling (F.cross_entropy
puts them in dimension 1).
"""
from __future__ import annotations

import math
from typing import Any, Optional

import torch
import torch.nn.functional as F
from torch import nn

from dro_ext import _backend
from dro_ext._first_order import first_order_only, refuse_forward_ad
from dro_ext.group_reduction import check_forward_groups, check_num_groups
from dro_ext._divergences import (
    Divergence, Spec, accumulate_dtype, as_eta, check_dense, check_divergence, check_floating_dtype,
    check_lam, check_positive, fallback_dtype, fixed_order_sum, fixed_order_sums, real_number,
)
from dro_ext._divergences import penalized_value as _penalized_value_torch
from dro_ext._divergences import psi_star as _psi_star_torch

__all__ = ["DROCrossEntropyLoss", "DROLinearCrossEntropyLoss", "dro_cross_entropy", "dro_linear_cross_entropy"]


# ---------------------------------------------------------------------------------------------------
# Argument checks (the native ops check again, with the same messages, below the reshape).
# ---------------------------------------------------------------------------------------------------


def _check_ignore_index(ignore_index) -> int:
    if isinstance(ignore_index, bool) or not isinstance(ignore_index, int):
        raise TypeError(f"dro_ext: ignore_index must be an int, got {ignore_index!r}")
    return ignore_index


def _check_label_smoothing(label_smoothing) -> float:
    value = real_number("label_smoothing", label_smoothing)
    if not 0.0 <= value <= 1.0:
        raise ValueError(f"dro_ext: label_smoothing must be in [0, 1], got label_smoothing={label_smoothing}")
    return value


def _check_targets(targets, batch_shape, batch_name: str, device) -> None:
    if not isinstance(targets, torch.Tensor):
        raise TypeError(f"dro_ext: targets must be a torch.Tensor, got {type(targets).__name__}")
    if targets.dtype != torch.int64:
        raise TypeError(f"dro_ext: targets must be int64 class indices, got {targets.dtype}")
    if tuple(targets.shape) != tuple(batch_shape):
        raise ValueError(f"dro_ext: targets must have shape {tuple(batch_shape)} to match {batch_name}, "
                         f"got {tuple(targets.shape)}")
    if targets.device != device:
        raise ValueError(f"dro_ext: targets is on {targets.device} but {batch_name.split()[0]} is on {device}; "
                         "move them to the same device")


def _check_float_tensor(name: str, value, min_dim: int = 1) -> None:
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"dro_ext: {name} must be a torch.Tensor, got {type(value).__name__}")
    check_dense(name, value)
    check_floating_dtype(name, value)
    if value.dim() < min_dim:
        raise ValueError(f"dro_ext: {name} must have at least {min_dim} dimension(s), got shape {tuple(value.shape)}")


def _check_target_range(targets, num_classes: int, ignore_index: int) -> None:
    # The native ops check on their own; the fallback checks here so that its error is as clear (a host sync,
    # skipped while compiling, where F.cross_entropy's own check still fails out-of-range indices).
    if torch.compiler.is_compiling() or targets.numel() == 0 or targets.device.type == "meta":  # (meta: no values)
        return
    bad = (targets != ignore_index) & ((targets < 0) | (targets >= num_classes))
    if bool(bad.any()):
        i = int(bad.nonzero()[0, 0])
        raise IndexError(f"dro_ext: targets must be class indices in [0, {num_classes}) or "
                         f"ignore_index={ignore_index}, got targets[{i}]={int(targets[i])}")


def check_linear_target_range(targets, num_classes: int, ignore_index: int, native: bool) -> None:
    """The linear cross-entropies' target check: the fallback's, and on the CPU the native path's too, whose chunk
    kernel checks on its own but counts the failing target's index from its chunk's start."""
    if not native or targets.device.type == "cpu":
        _check_target_range(targets, num_classes, ignore_index)


def _checked_scalars(lam, divergence, alpha, k, scale, ignore_index, label_smoothing):
    spec = check_divergence(divergence, alpha, k)
    return (spec, check_lam(lam), check_positive("scale", scale), _check_ignore_index(ignore_index),
            _check_label_smoothing(label_smoothing))


# ---------------------------------------------------------------------------------------------------
# The per-row DRO terms on the PyTorch side, mirroring csrc/cross_entropy_terms.h.
# ---------------------------------------------------------------------------------------------------


def _row_losses(x, targets, ignore_index, label_smoothing):
    """F.cross_entropy(x, targets, reduction="none") on the (N, C) logits x, 0 on ignored rows."""
    return F.cross_entropy(x, targets, reduction="none", ignore_index=ignore_index, label_smoothing=label_smoothing)


def _row_shift(x):
    """The shift of each row's logsumexp (csrc/cross_entropy_terms.h's ShiftedLogSumExp): its max, or 0 where that is
    -inf or NaN (the column kernel's choice: no -inf - -inf; a NaN row stays NaN through its sum). A +inf max stays:
    the row's loss is then NaN (inf - inf), as F.cross_entropy and the native kernels give it."""
    return x.amax(dim=1).nan_to_num_(nan=0.0, posinf=math.inf, neginf=0.0)


def shifted_logsumexp(x):
    """Each row's logsumexp of the (N, C) x as (N, 2) (shift, log_sum) pairs, in x's dtype: the layout the native
    cross-entropy ops save and take."""
    shift = _row_shift(x)
    if x.shape[0] == 1:  # torch.logsumexp's one sum would be split between threads: the same form, in fixed order
        return torch.stack([shift, fixed_order_sums(torch.exp(x - shift[:, None]), 1).log()], dim=1)
    return torch.stack([shift, torch.logsumexp(x - shift[:, None], dim=1)], dim=1)


def shifted_softmax(x, lse):
    """softmax of the rows of x from their logsumexp as (shift, log_sum) pairs (N, 2): exp((x - shift) - log_sum),
    which keeps the probabilities near 1 to their own rounding (csrc/cross_entropy_terms.h)."""
    return torch.exp((x - lse[:, :1]) - lse[:, 1:])


def losses_from_shifted_lse(lse, target_logit, row_mean, label_smoothing: float):
    """F.cross_entropy's per-row loss (1-eps)(lse - x_y) + eps(lse - mean_c x_c) from the (N, 2) (shift, log_sum)
    pairs, each difference formed from the shift (csrc/cross_entropy_terms.h's cross_entropy_loss)."""
    shift, log_sum = lse.unbind(1)
    if not label_smoothing:
        return (shift - target_logit) + log_sum
    return (1.0 - label_smoothing) * (shift - target_logit) + label_smoothing * (shift - row_mean) + log_sum


def _weighted_residual(c, r):
    """csrc/cross_entropy_terms.h's weighted_residual: c r, and 0 where r is 0 (an overflowed weight c = inf moves
    only the classes whose residual softmax_j - q_j is not 0)."""
    return torch.where(r == 0, torch.zeros_like(r), c * r)


# ---------------------------------------------------------------------------------------------------
# dro_cross_entropy: the native op's fake kernels and autograd, and the fallback.
# ---------------------------------------------------------------------------------------------------

if _backend.native_available():

    @torch.library.register_fake("dro_ext::dro_cross_entropy")
    def _dro_cross_entropy_fake(logits, targets, eta, lam, divergence, alpha=None, k=None, scale=1.0,
                                ignore_index=-100, label_smoothing=0.0):
        torch._check(logits.dim() == 2, lambda: "dro_ext: logits must be a 2-D tensor (N, C)")
        _backend.check_fake_devices("logits", logits, targets=targets, eta=eta)
        acc = accumulate_dtype(logits.dtype)
        rows = logits.shape[0]
        return (logits.new_empty((), dtype=acc), logits.new_empty((), dtype=acc),
                logits.new_empty((rows, 2), dtype=acc), logits.new_empty((rows,), dtype=acc))

    @torch.library.register_fake("dro_ext::dro_cross_entropy_backward")
    def _dro_cross_entropy_backward_fake(grad, logits, targets, lse, row_weight, ignore_index=-100,
                                         label_smoothing=0.0):
        _backend.check_fake_devices("logits", logits, grad=grad, targets=targets, lse=lse, row_weight=row_weight)
        return torch.empty_like(logits, memory_format=torch.contiguous_format)

    @torch.library.register_fake("dro_ext::dro_cross_entropy_backward_")
    def _dro_cross_entropy_backward_inplace_fake(grad, logits, targets, lse, row_weight, ignore_index=-100,
                                                 label_smoothing=0.0):
        _backend.check_fake_devices("logits", logits, grad=grad, targets=targets, lse=lse, row_weight=row_weight)
        return None

    @torch.library.register_fake("dro_ext::logsumexp_columns")
    def _logsumexp_columns_fake(matrix):
        torch._check(matrix.dim() == 2, lambda: "dro_ext: matrix must be a 2-D tensor (R, C)")
        return matrix.new_empty((matrix.shape[1], 2), dtype=accumulate_dtype(matrix.dtype))

    @torch.library.register_fake("dro_ext::dro_cross_entropy_chunk_")
    def _dro_cross_entropy_chunk_fake(logits, targets, eta, inv_count, lam, divergence, alpha=None, k=None,
                                      scale=1.0, ignore_index=-100, label_smoothing=0.0, compute_grad=True):
        _backend.check_fake_devices("logits", logits, targets=targets, eta=eta, inv_count=inv_count)
        return logits.new_empty((2,), dtype=torch.float64)

    def _dro_cross_entropy_setup_context(ctx, inputs, output):
        logits, targets, eta, lam, divergence, alpha, k, scale, ignore_index, label_smoothing = inputs
        _, mean_weight, lse, row_weight = output
        ctx.mark_non_differentiable(mean_weight, lse, row_weight)
        ctx.save_for_backward(logits, targets, lse, row_weight, mean_weight, eta)
        ctx.scale, ctx.ignore_index, ctx.label_smoothing = scale, ignore_index, label_smoothing
        ctx.eta_dtype = eta.dtype

    def _dro_cross_entropy_backward(ctx, grad_value, *unused):
        logits, targets, lse, row_weight, mean_weight, eta = ctx.saved_tensors
        grad_logits = grad_eta = None
        if grad_value is None:
            grad_value = torch.zeros((), dtype=mean_weight.dtype, device=logits.device)
        if ctx.needs_input_grad[0]:
            grad_logits = torch.ops.dro_ext.dro_cross_entropy_backward(
                grad_value, logits, targets, lse, row_weight, ctx.ignore_index, ctx.label_smoothing)
        if ctx.needs_input_grad[2]:
            grad_eta = (grad_value.to(mean_weight.dtype) * (ctx.scale * (1.0 - mean_weight))).to(ctx.eta_dtype)
        grad_logits, grad_eta = first_order_only("dro_cross_entropy", (grad_logits, grad_eta), logits, eta,
                                                 grad_value)
        return grad_logits, None, grad_eta, None, None, None, None, None, None, None

    # In Python rather than C++ (as dro_loss's is): every call moves N x C logits, so a Python backward's
    # microseconds are noise here, and the formulas sit beside the fallback that must agree with them.
    # First order only: the backward op has no derivative of its own (a second derivative raises: first_order_only).
    torch.library.register_autograd("dro_ext::dro_cross_entropy", _dro_cross_entropy_backward,
                                    setup_context=_dro_cross_entropy_setup_context)


class _FallbackCrossEntropy(torch.autograd.Function):
    """The fallback's dro_cross_entropy, with the native op's backward: (w_i / n)(softmax_i - q_i) through
    _weighted_residual and G (n - sum w) / n for eta. Autograd's own chain through F.cross_entropy multiplies a
    weight that overflowed to inf by the zeros of the softmax (NaN), and an ignored row's dropped terms by 0."""

    @staticmethod
    def forward(ctx, logits, targets, eta, lam, spec, scale, ignore_index, label_smoothing):
        acc = fallback_dtype(logits.dtype, logits.device)
        x = logits.detach().to(acc)
        keep = targets != ignore_index
        g_eta = scale * eta.detach().to(acc)
        # Ignored rows stand in at l = G eta (t = 0), so that nothing of theirs is inf or NaN.
        losses = torch.where(keep, _row_losses(x, targets, ignore_index, label_smoothing), g_eta)
        t = (losses - g_eta) / lam
        count = keep.sum().clamp(min=1).to(acc)
        total = fixed_order_sum(torch.where(keep, _penalized_value_torch(losses, t, lam, g_eta, spec), 0.0))
        weights = torch.where(keep, _psi_star_torch(t, spec, 1), 0.0)
        ctx.save_for_backward(logits, targets, eta, weights, count)
        ctx.args = (scale, ignore_index, label_smoothing, keep.sum())
        return (total / count).to(accumulate_dtype(logits.dtype))

    @staticmethod
    def backward(ctx, grad):
        logits, targets, eta, weights, count = ctx.saved_tensors
        scale, ignore_index, label_smoothing, kept = ctx.args
        grad = grad.to(weights.dtype)
        grad_logits = grad_eta = None
        if ctx.needs_input_grad[0]:
            x = logits.detach().to(weights.dtype)
            keep = targets != ignore_index
            q = torch.full_like(x, label_smoothing / x.shape[1])
            q.scatter_add_(1, torch.where(keep, targets, 0)[:, None],
                           torch.full_like(x[:, :1], 1.0 - label_smoothing))
            c = (grad * weights / count)[:, None]
            residual = torch.where(keep[:, None], torch.softmax(x, dim=1) - q, 0.0)
            grad_logits = _weighted_residual(c, residual).to(logits.dtype)
        if ctx.needs_input_grad[2]:
            grad_eta = (grad * scale * (kept - fixed_order_sum(weights)) / count).to(eta.dtype)
        # First order only, as the native op's backward (the weights were saved detached).
        grad_logits, grad_eta = first_order_only("dro_cross_entropy", (grad_logits, grad_eta), logits, eta, grad)
        return grad_logits, None, grad_eta, None, None, None, None, None


def _fallback_dro_cross_entropy(logits, targets, eta, lam, spec, scale, ignore_index, label_smoothing):
    return _FallbackCrossEntropy.apply(logits, targets, eta, lam, spec, scale, ignore_index, label_smoothing)


def dro_cross_entropy(logits: torch.Tensor, targets: torch.Tensor, eta: torch.Tensor | float, lam: float,
                      divergence: Divergence = "chi2", *, alpha: float | None = None, k: float | None = None,
                      scale: float = 1.0, ignore_index: int = -100, label_smoothing: float = 0.0,
                      groups: torch.Tensor | None = None, num_groups: int | None = None) -> torch.Tensor:
    """The DRO objective over per-sample cross-entropies, fused from the logits (a 0-d tensor).

    ``logits`` has shape (..., C) and ``targets`` (int64) shape (...); l_i is exactly
    ``F.cross_entropy(logits.reshape(-1, C), targets.reshape(-1), reduction="none", ignore_index=...,
    label_smoothing=...)``. Over the n rows whose target is not ``ignore_index``, the value is
    ``mean_i lam*psi*((l_i - scale*eta)/lam) + scale*eta`` (0 when n == 0, with zero gradients). Gradients
    flow to ``logits`` and ``eta``; the native op keeps only the per-row logsumexp (as the row's max and the log
    of the sum below it) and weight (3N floats) for backward. Each row's loss is formed in float32 (float64 for
    float64 logits); its t, weight and value term and their sums in float64, on the CPU, on CUDA and in the
    fallback. The result is float32 for float16/bfloat16 logits (as
    ``F.cross_entropy``'s under autocast, so that GradScaler's scaled gradient does not overflow on its way in), and
    has the logits' dtype otherwise.

    ``groups`` with ``num_groups`` (both or neither): the objective over groups of tokens instead of tokens.
    ``groups`` (int64 or int32 ids in ``[0, num_groups)``) has the shape of ``targets`` (one id per token) or
    ``targets.shape[:-1]`` (one per sequence). A group's loss is the mean of its kept tokens' l_i (a group without
    kept tokens is absent) and the value is exactly :func:`dro_ext.group_dro_loss` of the kept tokens' losses with
    batch weighting, ``scale*eta + sum_g (n_g/n) lam psi*((m_g - scale*eta)/lam)`` (0 when n == 0); the ids of
    ignored tokens are not read. Its backward forms the logits' gradient in one pass from the per-row logsumexp
    (dro_ext/cross_entropy_groups.py).
    """
    spec, lam, scale, ignore_index, label_smoothing = _checked_scalars(
        lam, divergence, alpha, k, scale, ignore_index, label_smoothing)
    refuse_forward_ad("dro_cross_entropy", logits, eta)
    _check_float_tensor("logits", logits)
    _check_targets(targets, logits.shape[:-1], f"logits of shape {tuple(logits.shape)}", logits.device)
    eta = as_eta(eta, logits, "logits")
    num_classes = logits.shape[-1]
    if num_classes == 0:  # before the reshape, which cannot infer -1 beside a 0
        raise ValueError(f"dro_ext: logits must have at least one class, got shape {tuple(logits.shape)}")
    x, y = logits.reshape(-1, num_classes), targets.reshape(-1)
    token_groups, num_groups = _check_token_groups(groups, num_groups, targets)
    if token_groups is not None:
        from dro_ext.cross_entropy_groups import grouped_dro_cross_entropy

        return grouped_dro_cross_entropy(x, y, token_groups, num_groups, eta, lam, spec, scale, ignore_index,
                                         label_smoothing)
    if _backend.native_for(x.device.type):
        return torch.ops.dro_ext.dro_cross_entropy(x, y, eta, lam, spec.name, spec.alpha, spec.k, scale,
                                                   ignore_index, label_smoothing)[0]
    _check_target_range(y, num_classes, ignore_index)
    return _fallback_dro_cross_entropy(x, y, eta, lam, spec, scale, ignore_index, label_smoothing)


# ---------------------------------------------------------------------------------------------------
# dro_linear_cross_entropy: a custom op (opaque to torch.compile) that runs the chunk loop, on the native
# chunk kernel or on its PyTorch twin, and returns the value with the gradients it already computed.
# ---------------------------------------------------------------------------------------------------


def _chunk_fallback_(logits, targets, eta, inv_count, lam, spec, scale, ignore_index, label_smoothing, compute_grad):
    """dro_cross_entropy_chunk_ in PyTorch: the chunk's {sum value_term, sum w} over kept rows (in the terms' dtype,
    float64 where the device has it, as the op returns them), and (compute_grad) the logits overwritten by
    inv_count * w_i * (softmax_i - q_i)."""
    acc = accumulate_dtype(logits.dtype)
    x = logits.to(acc)  # the logits themselves unless they must be cast up
    keep = targets != ignore_index
    safe_targets = torch.where(keep, targets, 0)
    # F.cross_entropy's loss from the logsumexp in two parts (losses_from_shifted_lse), the target logits and the row
    # means read first, so that the softmax can then be built in x in place. With the logits already in the accumulation
    # dtype, nothing chunk-sized is allocated (torch.logsumexp and F.cross_entropy would each allocate a chunk-sized
    # temporary).
    target_logit = x.gather(1, safe_targets[:, None]).squeeze(1)
    row_mean = fixed_order_sums(x, 1) / x.shape[1] if label_smoothing else None  # x.mean(dim=1)'s bits
    shift = _row_shift(x)
    if compute_grad:
        unnormalized = x.sub_(shift[:, None]).exp_()  # exp(x - shift): overwrites the logits (or their cast-up copy)
        row_sum = fixed_order_sums(unnormalized, 1)
    else:
        row_sum = fixed_order_sums((x - shift[:, None]).exp_(), 1)
    lse = torch.stack([shift, row_sum.log()], dim=1)
    # The DRO terms (a scalar per row) in the fallback's dtype, as the native kernel forms them in float64: float32
    # cannot form t = (l - G eta)/lam at a lam below about 2.9e-39 or above 3.4e38, nor psi*(t) where it overflows
    # though lam psi*(t) does not.
    terms = fallback_dtype(logits.dtype, logits.device)
    losses = torch.where(keep, losses_from_shifted_lse(lse, target_logit, row_mean, label_smoothing), 0.0).to(terms)
    g_eta = scale * eta.to(terms)
    t = (losses - g_eta) / lam
    weights = torch.where(keep, _psi_star_torch(t, spec, 1), 0.0)
    value_sum = fixed_order_sum(torch.where(keep, _penalized_value_torch(losses, t, lam, g_eta, spec), 0.0))
    sums = torch.stack([value_sum, fixed_order_sum(weights)])
    if compute_grad:
        grad = unnormalized.div_(row_sum[:, None])  # softmax
        grad.sub_(label_smoothing / x.shape[1])
        grad.scatter_add_(1, safe_targets[:, None], torch.full_like(row_sum[:, None], label_smoothing - 1.0))
        # _weighted_residual, in place: an overflowed weight times a zero residual is 0; and an ignored row's gradient
        # is 0 whatever its logits (NaN ones included, as the native kernel writes it), not weight 0 times them.
        unmoved = (grad == 0).logical_or_(~keep[:, None])
        grad.mul_((weights * inv_count.to(terms)).to(acc)[:, None]).masked_fill_(unmoved, 0.0)
        if grad.data_ptr() != logits.data_ptr():
            logits.copy_(grad)
    return sums


# Logit bytes per chunk that the default aims for, per device type. On the CPU 32 MiB keeps a chunk in the
# caches' reach. On a GPU each chunk's addmm reads and writes the whole (V, H) weight gradient, so fewer, larger
# chunks pay: on an H100 at N = 16384, H = 4096, V = 128256 in bf16 (bench/results/cross_entropy_h100.md) 512-row
# chunks took 105 ms, 2048-row chunks (501 MiB of logits) 86.8 ms and 4096-row chunks 88.9 ms.
CHUNK_LOGIT_BYTES = {"cpu": 32 << 20, "cuda": 512 << 20}


def default_chunk_size(rows: int, hidden: int, vocab: int, element_size: int = 4, device_type: str = "cpu") -> int:
    """Rows per chunk of dro_linear_cross_entropy, a power of two, at most the batch: the larger of
     - about N / ceil(V / H) rows, so that a chunk's logits are about as large as the hidden states, and
     - about CHUNK_LOGIT_BYTES[device_type] of logits (32 MiB on the CPU, 512 MiB on CUDA): every chunk reads and
       writes the whole weight gradient once (its addmm), so too small a chunk turns the (V, H) accumulation into
       the bottleneck."""
    budget = CHUNK_LOGIT_BYTES.get(device_type, CHUNK_LOGIT_BYTES["cpu"])
    matched = _pow2_floor(max(1, -(-rows // max(1, -(-vocab // max(1, hidden))))))
    by_bytes = _pow2_floor(max(1, budget // max(1, vocab * element_size)))
    return max(1, min(rows, max(matched, by_bytes)))


def _pow2_floor(x: int) -> int:
    """The largest power of two at most x (x >= 1), found by comparisons: on a row count that torch.compile made
    symbolic each comparison guards a range, so one compiled graph serves every batch size of a power-of-two bucket
    (``int(x).bit_length()`` guarded the exact value: a recompile for every batch size, and a failure at the
    ninth under fullgraph=True)."""
    power = 1
    while 2 * power <= x:
        power *= 2
    return power


@torch.library.custom_op("dro_ext::linear_cross_entropy_with_grads", mutates_args=())
def _linear_cross_entropy_with_grads(
        hidden: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], targets: torch.Tensor,
        eta: torch.Tensor, lam: float, divergence: str, alpha: Optional[float], k: Optional[float], scale: float,
        ignore_index: int, label_smoothing: float, chunk_size: int, native: bool, grad_hidden_needed: bool,
        grad_weight_needed: bool, grad_bias_needed: bool, anchors: list[torch.Tensor],
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(value, mean_weight, grad_hidden, grad_weight, grad_bias) for a unit upstream gradient; a gradient that
    is not needed comes back empty (shape (0,)) and costs nothing. ``anchors`` are not read: see :func:`_anchor`."""
    return _linear_cross_entropy_chunks(hidden, weight, bias, targets, eta, lam, divergence, alpha, k, scale,
                                        ignore_index, label_smoothing, chunk_size, native, grad_hidden_needed,
                                        grad_weight_needed, grad_bias_needed)


def logits_buffer(rows: int, chunk_size: int, hidden: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """The (chunk, V) buffer every chunk's logits are formed in, allocated once per call: a fresh (chunk, V) tensor
    per chunk first-touches its pages every time on the CPU (measured: about 8 ms of a 115 ms matmul for 256 x
    32000 float32 logits), where the caching allocator of a GPU would have handed the same memory back anyway."""
    return torch.empty((min(rows, chunk_size), weight.shape[0]), dtype=hidden.dtype, device=hidden.device)


def chunk_logits(buffer: torch.Tensor, h: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, *,
                 column_major: bool = False) -> torch.Tensor:
    """h @ weight.T + bias (F.linear), (n, V), in buffer: its first rows, or (column_major) the transpose of a
    contiguous (V, n) matrix formed as weight @ h.T + bias[:, None] in its first n V elements."""
    if not column_major:
        out = buffer[: h.shape[0]]
        if bias is None:
            return torch.mm(h, weight.t(), out=out)
        return torch.addmm(bias, h, weight.t(), out=out)
    vocab = weight.shape[0]
    out = buffer.view(-1)[: h.shape[0] * vocab].view(vocab, h.shape[0])
    if bias is None:
        return torch.mm(weight, h.t(), out=out).t()
    return torch.addmm(bias[:, None], weight, h.t(), out=out).t()


def _anchor(t: torch.Tensor) -> torch.Tensor:
    """A copy of at most one element of t, which autograd records as a function of t: what the op's first-order-only
    backward records t's gradient against (a derivative of it must reach t's graph to raise), in place of t itself,
    which the op does not keep (hidden's N x H, read by its forward alone; under autocast, the weight's cast copy)."""
    return t[(slice(0, 1),) * t.dim()].clone()


def _linear_cross_entropy_chunks(hidden, weight, bias, targets, eta, lam, divergence, alpha, k, scale, ignore_index,
                                 label_smoothing, chunk_size, native, grad_hidden_needed, grad_weight_needed,
                                 grad_bias_needed):
    """The op's chunk loop (a function of its own so that a test can run it on fake CUDA tensors, where the op
    itself would run its fake kernel)."""
    spec = Spec(divergence, alpha, k)
    rows, vocab = hidden.shape[0], weight.shape[0]
    acc = accumulate_dtype(hidden.dtype)
    hidden, weight = hidden.contiguous(), weight.contiguous()
    keep = targets != ignore_index
    kept = keep.sum()
    count = kept.clamp(min=1)
    inv_count = 1.0 / count.to(acc)
    compute_grad = grad_hidden_needed or grad_weight_needed or grad_bias_needed
    grad_hidden = torch.empty_like(hidden) if grad_hidden_needed else hidden.new_empty((0,))
    # In the input dtype, like the gradient autograd would produce: each chunk's matmul accumulates in float32
    # and rounds once into it (a float32 copy of weight's size would cost more memory than the logits saved).
    # The first chunk's matmul writes it and the others add into it (addmm_, beta 1): no zero fill, no temporary.
    grad_weight = torch.empty_like(weight) if grad_weight_needed else hidden.new_empty((0,))
    if grad_weight_needed and rows == 0:
        grad_weight.zero_()
    grad_bias = torch.zeros((vocab,), dtype=acc, device=hidden.device) if grad_bias_needed else hidden.new_empty((0,))
    # The chunks' sums added up in float64 (the op's and the fallback's dtype; float32 on a device without float64)
    # and divided by the kept count last: in float32 a sum past its range was inf where the mean is not, and the
    # value moved with the chunk size (35 float32 steps at one-row chunks against 0.07 at one chunk).
    sums = torch.zeros((2,), dtype=fallback_dtype(hidden.dtype, hidden.device), device=hidden.device)
    buffer = logits_buffer(rows, chunk_size, hidden, weight)
    for start in range(0, rows, chunk_size):
        end = min(rows, start + chunk_size)
        h = hidden[start:end]
        logits = chunk_logits(buffer, h, weight, bias)
        y = targets[start:end]
        if native:
            sums += torch.ops.dro_ext.dro_cross_entropy_chunk_(
                logits, y, eta, inv_count, lam, spec.name, spec.alpha, spec.k, scale, ignore_index, label_smoothing,
                compute_grad)
        else:
            sums += _chunk_fallback_(logits, y, eta, inv_count, lam, spec, scale, ignore_index, label_smoothing,
                                     compute_grad)
        if compute_grad:  # logits now holds the chunk's gradient with respect to its logits
            if grad_hidden_needed:
                torch.mm(logits, weight, out=grad_hidden[start:end])
            if grad_weight_needed:
                if start == 0:
                    torch.mm(logits.t(), h, out=grad_weight)
                else:
                    grad_weight.addmm_(logits.t(), h)
            if grad_bias_needed:
                grad_bias += fixed_order_sums(logits, 0, dtype=acc)
        del logits
    any_kept = kept > 0
    means = sums / count.to(sums.dtype)
    value = torch.where(any_kept, means[0], 0.0).to(acc)
    mean_weight = torch.where(any_kept, means[1], 1.0).to(acc)
    if grad_bias_needed:
        grad_bias = grad_bias.to(bias.dtype)
    return value, mean_weight, grad_hidden, grad_weight, grad_bias


@_linear_cross_entropy_with_grads.register_fake
def _linear_cross_entropy_with_grads_fake(hidden, weight, bias, targets, eta, lam, divergence, alpha, k, scale,
                                          ignore_index, label_smoothing, chunk_size, native, grad_hidden_needed,
                                          grad_weight_needed, grad_bias_needed, anchors):
    _backend.check_fake_devices("hidden", hidden, weight=weight, bias=bias, targets=targets, eta=eta)
    acc = accumulate_dtype(hidden.dtype)
    return (hidden.new_empty((), dtype=acc), hidden.new_empty((), dtype=acc),
            torch.empty_like(hidden, memory_format=torch.contiguous_format) if grad_hidden_needed
            else hidden.new_empty((0,)),
            torch.empty_like(weight, memory_format=torch.contiguous_format) if grad_weight_needed
            else hidden.new_empty((0,)),
            bias.new_empty(bias.shape) if grad_bias_needed else hidden.new_empty((0,)))


def _linear_setup_context(ctx, inputs, output):
    eta, scale, anchors = inputs[4], inputs[9], inputs[17]
    _, mean_weight, grad_hidden, grad_weight, grad_bias = output
    ctx.mark_non_differentiable(mean_weight, grad_hidden, grad_weight, grad_bias)
    # Otherwise autograd would hand backward a zero-filled gradient for each of those outputs (a V x H one for
    # grad_weight) that it never reads; the value's gradient then comes as None where nothing flows into it.
    ctx.set_materialize_grads(False)
    # The anchors stand for the inputs in first_order_only (the op saves no input: under autocast the weight it
    # sees is a cast copy, V x H, that nothing else holds).
    ctx.save_for_backward(mean_weight, grad_hidden, grad_weight, grad_bias, *anchors)
    ctx.scale, ctx.eta_dtype = scale, eta.dtype


def _scaled_gradient(saved, grad_value, in_place: bool):
    """saved * grad_value. In place (no second V x H buffer) when the graph is freed after this backward: the buffer
    is the op's own and nothing reads it again, and once the autograd node releases it the returned tensor is its
    only reference, so AccumulateGrad takes it as .grad instead of cloning it.

    With half gradients, grad_value (float32, the value's dtype) may lie past their range, as GradScaler's 2^16 does
    past float16's: the product is then formed in float32 and rounded once. A CUDA mul would round the float32
    device scalar to float16 first (inf); GradScaler's own unscale op multiplies by a float32 device scalar in
    float32, on every device, without a host read (its found-inf flag is not needed here)."""
    if saved.dtype == grad_value.dtype or type(saved) is not torch.Tensor or type(grad_value) is not torch.Tensor:
        return saved.mul_(grad_value) if in_place else saved * grad_value
    out = saved if in_place else saved.clone()
    found_inf = torch.zeros((1,), dtype=torch.float32, device=saved.device)
    torch._amp_foreach_non_finite_check_and_unscale_([out], found_inf, grad_value.to(torch.float32))
    return out


def _linear_backward(ctx, grad_value, *unused):
    mean_weight, grad_hidden, grad_weight, grad_bias, *anchors = ctx.saved_tensors
    out: list[Any] = [None] * 17 + [[None] * len(anchors)]  # (the anchors, a list input, get a list of no gradient)
    if grad_value is None:
        return tuple(out)
    # A retained graph (retain_graph=True, create_graph, gradcheck's reentrancy check) runs this backward again, so
    # it must then leave the forward's gradients as they are and scale copies of them; otherwise it scales them in
    # place. While AOTAutograd traces this backward (torch.compile, opcheck) the tensors are fake/functional
    # wrappers (subclasses): out of place there, as a traced mutation of a forward output cannot be partitioned.
    # No host sync either way: the upstream gradient stays a device tensor.
    in_place = (not torch._C._autograd._get_current_graph_task_keep_graph()
                and type(grad_value) is torch.Tensor and type(mean_weight) is torch.Tensor)
    if ctx.needs_input_grad[0]:
        out[0] = _scaled_gradient(grad_hidden, grad_value, in_place)
    if ctx.needs_input_grad[1]:
        out[1] = _scaled_gradient(grad_weight, grad_value, in_place)
    if ctx.needs_input_grad[2]:
        out[2] = _scaled_gradient(grad_bias, grad_value, in_place)
    if ctx.needs_input_grad[4]:
        out[4] = (grad_value.to(mean_weight.dtype) * (ctx.scale * (1.0 - mean_weight))).to(ctx.eta_dtype)
    # The gradients were formed in the forward: first order only. Recorded against every input that requires grad
    # (through its anchor) and the upstream gradient, so that a second derivative through any of them raises: one
    # through grad_value would otherwise come out of its product with the forward's gradients, held constant, and
    # one through an input alone would be silently missing.
    out[0], out[1], out[2], out[4] = first_order_only("dro_linear_cross_entropy", (out[0], out[1], out[2], out[4]),
                                                      *anchors, grad_value)
    return tuple(out)


_linear_cross_entropy_with_grads.register_autograd(_linear_backward, setup_context=_linear_setup_context)


def _check_chunk_size(chunk_size) -> None:
    """A positive int, or None (the default chunk size)."""
    if chunk_size is not None and (isinstance(chunk_size, bool) or not isinstance(chunk_size, int)
                                   or chunk_size < 1):
        raise ValueError(f"dro_ext: chunk_size must be a positive int or None, got chunk_size={chunk_size!r}")


_AUTOCAST_CASTS = (torch.float32, torch.float16, torch.bfloat16)


def _autocast_operands(hidden, weight, bias):
    """(hidden, weight, bias) in autocast's dtype where autocast is on for hidden's device, as F.linear takes its
    operands there (a model's bfloat16 hidden states beside the float32 master weight of its head); as given
    otherwise. The casts are differentiable: the gradients come back in the given dtypes."""
    device_type = hidden.device.type
    # (is_autocast_enabled raises for a device type autocast does not know, such as meta; torch 2.11's Dynamo cannot
    # trace is_autocast_available, and nothing compiles on the meta device)
    known = torch.compiler.is_compiling() or torch.amp.is_autocast_available(device_type)
    if not (known and torch.is_autocast_enabled(device_type)):
        return hidden, weight, bias
    dtype = torch.get_autocast_dtype(device_type)
    # As autocast casts: the floating tensors but float64 (which F.linear keeps in float64 under autocast).
    return tuple(t.to(dtype) if t is not None and t.dtype in _AUTOCAST_CASTS else t for t in (hidden, weight, bias))


def _check_linear_args(hidden, weight, targets, bias, chunk_size):
    """The tensor checks of dro_linear_cross_entropy: (hidden as (N, H), weight, bias (in autocast's dtype where it is
    on: _autocast_operands), targets as (N,), the chunk size)."""
    _check_float_tensor("hidden", hidden)
    _check_float_tensor("weight", weight, min_dim=2)
    if bias is not None:
        _check_float_tensor("bias", bias)
    hidden, weight, bias = _autocast_operands(hidden, weight, bias)
    if weight.dim() != 2 or weight.shape[1] != hidden.shape[-1]:
        raise ValueError(f"dro_ext: weight must have shape (V, H) with H = hidden.shape[-1] = {hidden.shape[-1]}, "
                         f"got {tuple(weight.shape)}")
    if weight.shape[0] == 0:
        raise ValueError(f"dro_ext: weight must have at least one row (class), got shape {tuple(weight.shape)}")
    if weight.dtype != hidden.dtype or weight.device != hidden.device:
        raise ValueError(f"dro_ext: weight ({weight.dtype}, {weight.device}) must have the dtype and device of "
                         f"hidden ({hidden.dtype}, {hidden.device})")
    if bias is not None:
        if tuple(bias.shape) != (weight.shape[0],) or bias.dtype != hidden.dtype or bias.device != hidden.device:
            raise ValueError(f"dro_ext: bias must have shape ({weight.shape[0]},) and hidden's dtype and device, "
                             f"got shape {tuple(bias.shape)}, {bias.dtype}, {bias.device}")
    _check_targets(targets, hidden.shape[:-1], f"hidden of shape {tuple(hidden.shape)}", hidden.device)
    # The rows counted out: reshape(-1, 0) cannot infer them beside an H of 0 (logits of zeros, as F.linear gives).
    h, y = hidden.reshape(targets.numel(), hidden.shape[-1]), targets.reshape(-1)
    if chunk_size is None:
        chunk_size = default_chunk_size(h.shape[0], h.shape[1], weight.shape[0], h.element_size(), h.device.type)
    else:
        _check_chunk_size(chunk_size)
    return h, weight, bias, y, max(1, min(chunk_size, max(h.shape[0], 1)))


def _check_token_groups(groups, num_groups, targets):
    from dro_ext.cross_entropy_groups import check_token_groups

    return check_token_groups(groups, num_groups, targets)


def dro_linear_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
                             eta: torch.Tensor | float, lam: float, divergence: Divergence = "chi2", *,
                             bias: torch.Tensor | None = None, alpha: float | None = None, k: float | None = None,
                             scale: float = 1.0, ignore_index: int = -100, label_smoothing: float = 0.0,
                             chunk_size: int | None = None, groups: torch.Tensor | None = None,
                             num_groups: int | None = None) -> torch.Tensor:
    """:func:`dro_cross_entropy` of ``logits = hidden @ weight.T (+ bias)``, never holding more than a chunk of them.

    ``hidden`` (..., H), ``weight`` (V, H), ``bias`` (V,) or None, ``targets`` (...) int64. Rows are processed
    ``chunk_size`` at a time (default: :func:`default_chunk_size`): each chunk's logits come from a matmul, are
    turned in place into their loss and gradient, and matmuls fold that gradient into the gradients of hidden,
    weight and bias, computed in the forward when any of hidden, weight, bias or eta requires grad (none
    otherwise) and scaled by the upstream gradient in backward (in place, unless the graph is retained). Peak
    extra memory: one chunk of logits plus the gradients themselves, each held once. half/bfloat16 inputs give
    logits in their dtype with float32 loss accumulation and a float32 value (as :func:`dro_cross_entropy`); the
    weight gradient is accumulated in the weight's dtype over chunks. First-order gradients only.

    ``groups``/``num_groups``: the objective over groups of tokens, as in :func:`dro_cross_entropy`. The weight of a
    token then depends on its whole group's mean loss, known only after every chunk: the forward is one chunked pass
    for the per-token losses (no gradients, the value), and the backward a second one that recomputes each chunk's
    logits and writes their gradient (one more matmul per chunk; see :func:`dro_ext.linear_cross_entropy_losses`).
    float16 hidden takes the same two passes without groups, when anything requires grad: the logits' gradient is
    then formed with the upstream gradient (GradScaler's scale) in it, where at a unit upstream gradient it lay in
    float16's subnormals.
    """
    spec, lam, scale, ignore_index, label_smoothing = _checked_scalars(
        lam, divergence, alpha, k, scale, ignore_index, label_smoothing)
    refuse_forward_ad("dro_linear_cross_entropy", hidden, weight, bias, eta)
    h, weight, bias, y, chunk_size = _check_linear_args(hidden, weight, targets, bias, chunk_size)
    eta = as_eta(eta, h, "hidden")
    token_groups, num_groups = _check_token_groups(groups, num_groups, targets)
    if token_groups is not None:
        from dro_ext.cross_entropy_groups import grouped_dro_linear_cross_entropy

        return grouped_dro_linear_cross_entropy(h, weight, bias, y, token_groups, num_groups, eta, lam, spec, scale,
                                                ignore_index, label_smoothing, chunk_size)
    grad = torch.is_grad_enabled()
    if h.dtype == torch.float16 and grad and any(t is not None and t.requires_grad for t in (h, weight, bias, eta)):
        # The gradients formed in the forward are at a unit upstream gradient, where float16's range loses the small
        # ones (each logit's (w_i / N)(p - y) is 1e-8 and below at tens of thousands of tokens) before GradScaler's
        # scale can reach them: the second pass forms them in backward, with the scale in.
        from dro_ext.cross_entropy_groups import two_pass_dro_linear_cross_entropy

        return two_pass_dro_linear_cross_entropy(h, weight, bias, y, eta, lam, spec, scale, ignore_index,
                                                 label_smoothing, chunk_size)
    native = _backend.native_for(h.device.type)
    check_linear_target_range(y, weight.shape[0], ignore_index, native)
    needs = [grad and t is not None and t.requires_grad for t in (h, weight, bias)]
    anchors = [_anchor(t) for t in (h, weight, bias, eta) if grad and t is not None and t.requires_grad]
    value, *_ = _linear_cross_entropy_with_grads(
        h, weight, bias, y, eta, lam, spec.name, spec.alpha, spec.k, scale, ignore_index, label_smoothing,
        chunk_size, native, *needs, anchors)
    return value


# ---------------------------------------------------------------------------------------------------
# Modules
# ---------------------------------------------------------------------------------------------------


class _DROCrossEntropyBase(nn.Module):
    def __init__(self, divergence, lam, alpha, k, scale, eta_init, ignore_index, label_smoothing, num_groups):
        super().__init__()
        if num_groups is not None:
            num_groups = check_num_groups(num_groups)
        self.num_groups = num_groups
        self.divergence, self.alpha, self.k = check_divergence(divergence, alpha, k)
        self.lam = check_lam(lam)
        self.scale = check_positive("scale", scale)
        self.ignore_index = _check_ignore_index(ignore_index)
        self.label_smoothing = _check_label_smoothing(label_smoothing)
        self.eta_init = real_number("eta_init", eta_init)
        if not math.isfinite(self.eta_init):
            raise ValueError(f"dro_ext: eta_init must be finite, got eta_init={self.eta_init}")
        self.eta = nn.Parameter(torch.empty(()))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """eta = eta_init (what a construction on the meta device followed by to_empty() needs), as DROLoss."""
        with torch.no_grad():
            self.eta.fill_(self.eta_init)

    def _kwargs(self, groups, forward: str):
        """The functional op's keywords; ``groups`` (forward's) checked against the module's ``num_groups``, as
        :class:`dro_ext.DROLoss` checks them, so that the error names what the module's caller can change."""
        check_forward_groups(type(self).__name__, self.num_groups, groups, f"{forward}, groups=...")
        return dict(groups=groups, alpha=self.alpha, k=self.k, scale=self.scale, ignore_index=self.ignore_index,
                    label_smoothing=self.label_smoothing, num_groups=self.num_groups)

    def extra_repr(self) -> str:
        params = "".join(f", {n}={v}" for n, v in (("alpha", self.alpha), ("k", self.k)) if v is not None)
        return (f"divergence={self.divergence!r}, lam={self.lam}{params}, scale={self.scale}, "
                f"ignore_index={self.ignore_index}, label_smoothing={self.label_smoothing}"
                + (f", num_groups={self.num_groups}" if self.num_groups is not None else ""))


class DROCrossEntropyLoss(_DROCrossEntropyBase):
    """``forward(logits, targets)`` = :func:`dro_cross_entropy` with the module's own dual variable ``eta``
    (a 0-d ``nn.Parameter``: optimize it beside the model's parameters, as with :class:`dro_ext.DROLoss`).

    With ``num_groups=G``: ``forward(logits, targets, groups)``, the objective over groups of tokens (``groups`` one
    id per token or per sequence), as :class:`dro_ext.DROLoss` takes ``groups`` with ``num_groups``."""

    def __init__(self, divergence: Divergence = "chi2", lam: float = 0.1, *, alpha: float | None = None,
                 k: float | None = None, scale: float = 1.0, eta_init: float = 0.0, ignore_index: int = -100,
                 label_smoothing: float = 0.0, num_groups: int | None = None) -> None:
        super().__init__(divergence, lam, alpha, k, scale, eta_init, ignore_index, label_smoothing, num_groups)

    def forward(self, logits: torch.Tensor, targets: torch.Tensor, groups: torch.Tensor | None = None) -> torch.Tensor:
        return dro_cross_entropy(logits, targets, self.eta, self.lam, self.divergence,
                                 **self._kwargs(groups, "logits, targets"))


class DROLinearCrossEntropyLoss(_DROCrossEntropyBase):
    """``forward(hidden, weight, targets, bias=None)`` = :func:`dro_linear_cross_entropy` with the module's own
    ``eta``: the LM head's loss without materializing the logits. With ``num_groups=G``: ``forward(hidden, weight,
    targets, bias=None, groups=...)``, the objective over groups of tokens."""

    def __init__(self, divergence: Divergence = "chi2", lam: float = 0.1, *, alpha: float | None = None,
                 k: float | None = None, scale: float = 1.0, eta_init: float = 0.0, ignore_index: int = -100,
                 label_smoothing: float = 0.0, chunk_size: int | None = None, num_groups: int | None = None) -> None:
        super().__init__(divergence, lam, alpha, k, scale, eta_init, ignore_index, label_smoothing, num_groups)
        _check_chunk_size(chunk_size)
        self.chunk_size = chunk_size

    def extra_repr(self) -> str:
        return super().extra_repr() + (f", chunk_size={self.chunk_size}" if self.chunk_size is not None else "")

    def forward(self, hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
                bias: torch.Tensor | None = None, groups: torch.Tensor | None = None) -> torch.Tensor:
        return dro_linear_cross_entropy(hidden, weight, targets, self.eta, self.lam, self.divergence, bias=bias,
                                        chunk_size=self.chunk_size,
                                        **self._kwargs(groups, "hidden, weight, targets, bias"))
