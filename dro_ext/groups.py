"""DRO over groups: the per-group mean losses m_g = (sum of l_i over the samples i of group g) / n_g, and the two
objectives built on them (docs/design.md, section 1.9):

- :func:`group_dro_loss`: the penalized psi-divergence objective of :func:`dro_ext.dro_loss` with the groups in
  place of the samples, ``scale*eta + sum_g p_g lam psi*((m_g - scale*eta)/lam)`` over the groups present in the
  batch, ``p`` renormalized over them.
- :class:`GroupDROLoss`: the online Group DRO of Sagawa et al. (ICLR 2020): a distribution ``q`` over the groups
  updated by exponentiated gradient ascent on the group losses (or by a greedy CVaR over their running averages),
  the loss being ``sum_g q_g m_g``.

The O(N) work is the reduction of the losses to per-group sums and counts; the rest is O(G) and composed of
PyTorch ops on either backend.
"""
from __future__ import annotations

import math

import torch
from torch import nn

from dro_ext._divergences import (
    accumulate_dtype,
    as_eta,
    check_dense,
    check_divergence,
    check_losses,
    check_positive,
    fallback_dtype,
    fixed_order_sum,
    penalized_value,
    real_number,
)

__all__ = ["group_dro_loss"]


def _group_sums(losses: torch.Tensor, groups: torch.Tensor, num_groups: int):
    """(sums, counts) per group: ``sums[g]`` the sum of the losses of group g, ``counts[g]`` its number of samples
    as a float; both (num_groups,) in the accumulate dtype (float32 for half inputs), 0 and 0 for an absent group;
    the gradient of ``l_i`` is ``grad_sums[g_i]``; an id outside [0, num_groups) raises IndexError naming groups.

    This is the stand-in, in PyTorch ops, for the native op ``dro_ext.group_sums(losses, groups, num_groups,
    validate=True)`` with the same signature and results; it is the only place this module reduces the losses, so
    that the native op replaces it here alone. index_add_ adds the samples in order on the CPU (deterministic);
    on CUDA it adds with atomics, which the native op will not.
    """
    _check_group_ids(groups, num_groups)
    acc = accumulate_dtype(losses.dtype)
    index = groups.long()
    sums = torch.zeros(num_groups, dtype=acc, device=losses.device).index_add(0, index, losses.to(acc))
    ones = torch.ones(index.shape, dtype=acc, device=losses.device)
    counts = torch.zeros(num_groups, dtype=acc, device=losses.device).index_add_(0, index, ones)
    return sums, counts


def _check_group_ids(groups: torch.Tensor, num_groups: int) -> None:
    message = f"dro_ext: groups holds an id outside [0, num_groups) with num_groups={num_groups}"
    if groups.device.type == "cpu" and not torch.compiler.is_compiling():
        # Reading a CPU tensor costs no device sync.
        if groups.numel() and (int(groups.min()) < 0 or int(groups.max()) >= num_groups):
            raise IndexError(message)
    else:
        # An asynchronous device-side check: no host sync (it fails at the next sync, as a RuntimeError).
        torch._assert_async(((groups >= 0) & (groups < num_groups)).all(), message)


# ---------------------------------------------------------------------------------------------------
# Argument checks
# ---------------------------------------------------------------------------------------------------


def check_num_groups(num_groups) -> int:
    if isinstance(num_groups, bool) or not isinstance(num_groups, int):
        raise TypeError(f"dro_ext: num_groups must be an int, got {num_groups!r} ({type(num_groups).__name__})")
    if num_groups < 1:
        raise ValueError(f"dro_ext: num_groups must be >= 1, got num_groups={num_groups}")
    return num_groups


def check_groups(groups, losses: torch.Tensor) -> None:
    if not isinstance(groups, torch.Tensor):
        raise TypeError(f"dro_ext: groups must be a torch.Tensor of group ids, got {type(groups).__name__}")
    check_dense("groups", groups)
    if groups.dtype not in (torch.int64, torch.int32):
        raise TypeError(f"dro_ext: groups must be an int64 or int32 tensor of group ids, got {groups.dtype}")
    if groups.shape != losses.shape:
        raise ValueError(f"dro_ext: groups must have the shape of losses, {tuple(losses.shape)}, "
                         f"got {tuple(groups.shape)}")
    if groups.device != losses.device:
        raise ValueError(f"dro_ext: groups is on {groups.device} but losses is on {losses.device}; "
                         f"move them to the same device")


def check_batch_losses(losses) -> None:
    """As check_losses, except that the batch may be empty (GroupDROLoss: a step where a rank holds no samples)."""
    if isinstance(losses, torch.Tensor) and losses.dim() == 1 and losses.numel() == 0:
        if not losses.is_floating_point():
            raise TypeError(f"dro_ext: losses must have a floating dtype, got {losses.dtype}")
        return
    check_losses(losses)


def check_group_vector(name: str, value, num_groups: int, *, positive: bool) -> torch.Tensor:
    """A (num_groups,) tensor of finite numbers, > 0 (positive) or >= 0 with a positive sum, as float64.

    Its values are read on the host (a check at construction; for a device tensor, one sync)."""
    if isinstance(value, torch.Tensor):
        check_dense(name, value)
        if not (value.is_floating_point() or value.dtype in (torch.int64, torch.int32, torch.int16, torch.uint8)):
            raise TypeError(f"dro_ext: {name} must be a real tensor, got {value.dtype}")
        tensor = value.detach().to(torch.float64)
    else:
        try:
            tensor = torch.tensor([real_number(name, v) for v in value], dtype=torch.float64)
        except TypeError as exc:
            raise TypeError(f"dro_ext: {name} must be a tensor or a sequence of {num_groups} numbers "
                            f"({exc})") from None
    if tensor.shape != (num_groups,):
        raise ValueError(f"dro_ext: {name} must have shape ({num_groups},) (one entry per group), "
                         f"got {tuple(tensor.shape)}")
    host = tensor.cpu()
    if not bool(torch.isfinite(host).all()):
        raise ValueError(f"dro_ext: {name} must be finite, got {name}={host.tolist()}")
    if positive and not bool((host > 0).all()):
        raise ValueError(f"dro_ext: {name} must be > 0 for every group, got {name}={host.tolist()}")
    if not positive and (not bool((host >= 0).all()) or not bool(host.sum() > 0)):
        raise ValueError(f"dro_ext: {name} must be >= 0 with a positive sum, got {name}={host.tolist()}")
    return tensor


_WEIGHTINGS = ("batch", "population")


def _group_weights(weighting, group_counts, num_groups: int, device) -> torch.Tensor | None:
    """The unnormalized group weights: None for "batch" (the counts n_g), else a float64 (G,) tensor on device."""
    if isinstance(weighting, torch.Tensor):
        if group_counts is not None:
            raise ValueError("dro_ext: group_counts is used by weighting='population' only; with a tensor "
                             "weighting pass group_counts=None")
        weights = _weight_tensor("weighting", weighting, num_groups)
    elif weighting == "population":
        if group_counts is None:
            raise ValueError("dro_ext: weighting='population' needs group_counts (the population count of each "
                             "group), got group_counts=None")
        weights = _weight_tensor("group_counts", group_counts, num_groups)
    elif weighting == "batch":
        if group_counts is not None:
            raise ValueError("dro_ext: group_counts is used by weighting='population' only; with "
                             "weighting='batch' pass group_counts=None")
        return None
    else:
        raise ValueError(f"dro_ext: weighting must be 'batch', 'population' or a tensor of {num_groups} group "
                         f"weights, got {weighting!r}")
    return weights.to(device)


def _weight_tensor(name, value, num_groups: int) -> torch.Tensor:
    # Per call: a CPU tensor or a sequence is checked in full (no device sync); a device tensor by dtype and shape
    # only, its values being the caller's (a negative weight then gives a meaningless value, a zero sum NaN).
    if isinstance(value, torch.Tensor) and value.device.type != "cpu":
        check_dense(name, value)
        if not value.is_floating_point() or value.shape != (num_groups,):
            raise ValueError(f"dro_ext: {name} must be a floating tensor of shape ({num_groups},), got "
                             f"{value.dtype} of shape {tuple(value.shape)}")
        return value.detach().to(torch.float64)
    return check_group_vector(name, value, num_groups, positive=name == "group_counts")


# ---------------------------------------------------------------------------------------------------
# Group means, on one process or over the ranks of a process group
# ---------------------------------------------------------------------------------------------------


class _GlobalValueLocalGradient(torch.autograd.Function):
    """Forward: ``global_value``; backward: ``factor`` times the gradient, to ``local`` (a tensor of its shape)."""

    @staticmethod
    def forward(global_value, local, factor):
        return global_value.clone()

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.factor = inputs[2]

    @staticmethod
    def backward(ctx, grad):
        return None, grad * ctx.factor, None


def _reduced_group_sums(losses, groups, num_groups: int, process_group):
    """(sums, counts) of the batch, or, with a process group, of the concatenated batch of its ranks.

    Over ranks, (sums, counts) are all-reduced together (one collective of 2G numbers) so every rank holds the
    same values; the sums' gradient goes to the local samples times the world size, which DDP's averaging of the
    gradients over the ranks divides out again: the averaged gradient is the one of the concatenated batch."""
    sums, counts = _group_sums(losses, groups, num_groups)
    if process_group is None:
        return sums, counts
    import torch.distributed as dist
    from torch.distributed import _functional_collectives as funcol

    from dro_ext.distributed import _collective_device, check_group

    check_group(process_group, "GroupDROLoss")
    device = _collective_device(process_group, losses.device)
    both = torch.cat([sums.detach(), counts]).to(device)
    both = funcol.all_reduce(both, "sum", process_group).to(losses.device)
    world = float(dist.get_world_size(process_group))
    return _GlobalValueLocalGradient.apply(both[:num_groups], sums, world), both[num_groups:]


def _group_means(sums, counts, dtype):
    """(m, present): the mean loss of each group in dtype (0 for an absent group) and which groups are present."""
    present = counts > 0
    return sums.to(dtype) / torch.clamp(counts, min=1.0).to(dtype), present


# ---------------------------------------------------------------------------------------------------
# The penalized objective over groups
# ---------------------------------------------------------------------------------------------------


def group_dro_loss(losses, groups, num_groups, eta, lam, divergence="chi2", *, weighting="batch",
                   group_counts=None, alpha=None, k=None, scale=1.0, group=None) -> torch.Tensor:
    """The penalized DRO objective over groups (a 0-d tensor of the dtype of ``losses``):

        scale*eta + sum_g p_g lam psi*((m_g - scale*eta)/lam),   m_g = mean of the losses of group g

    over the groups present in the batch, ``p`` renormalized over them: ``weighting="batch"`` takes ``p_g``
    proportional to the batch count ``n_g``, ``"population"`` to ``group_counts[g]`` (required then, every count
    > 0), and a tensor of ``num_groups`` weights (>= 0) to those weights. ``divergence``, ``lam``, ``alpha``, ``k``
    and ``scale`` are those of :func:`dro_ext.dro_loss`, which this equals when every group holds one sample
    (batch weighting). ``groups`` is an int64 or int32 tensor of ids in ``[0, num_groups)``, one per loss.
    Gradients flow to ``losses`` (``p_g psi*'(t_g) / n_g`` for each sample of group g) and to ``eta``.

    ``group`` (a process group): the objective of the concatenated batch of its ranks, the same value on every
    rank; the per-group sums and counts are all-reduced once, and the gradients of the local losses are scaled
    so that DDP's average over the ranks is the gradient of that objective.
    """
    spec = check_divergence(divergence, alpha, k)
    lam, scale = check_positive("lam", lam), check_positive("scale", scale)
    check_losses(losses)
    num_groups = check_num_groups(num_groups)
    check_groups(groups, losses)
    eta = as_eta(eta, losses)
    weights = _group_weights(weighting, group_counts, num_groups, losses.device)
    sums, counts = _reduced_group_sums(losses, groups, num_groups, group)
    acc = fallback_dtype(losses.dtype, losses.device)
    m, present = _group_means(sums, counts, acc)
    g_eta = scale * eta.to(acc)
    # An absent group is evaluated at m = scale*eta (t = 0, finite whatever eta), then weighted by exactly 0: its
    # term adds nothing to the value and a zero gradient.
    x = torch.where(present, m, g_eta)
    terms = penalized_value(x, (x - g_eta) / lam, lam, g_eta, spec)
    p = counts.to(acc) if weights is None else torch.where(present, weights.to(acc), 0.0)
    # Sums in group order, as dro_loss sums in sample order: with one sample per group (ids in sample order) the
    # two are the same sums, term for term.
    value = fixed_order_sum(p * terms) / fixed_order_sum(p)
    return value.to(losses.dtype)
