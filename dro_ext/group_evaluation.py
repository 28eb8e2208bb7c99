"""The exact robust objective over groups: what :func:`dro_ext.robust_objective`, :func:`dro_ext.worst_case_weights`,
:func:`dro_ext.weight_stats` and :func:`dro_ext.evaluate` compute when given ``groups`` and ``num_groups``
(docs/design.md section 1.9).

With ``m_g`` the mean loss of group g and ``p_g`` its weight over the groups present in the batch (renormalized),

    Psi = min over eta of  eta + lam sum_g p_g psi*((m_g - eta)/lam),

the minimum of :func:`dro_ext.group_dro_loss`'s objective (scale 1), and the worst-case group distribution is
``q_g = p_g psi*'((m_g - eta*)/lam)`` (0 for an absent group).

For ``weighting="batch"`` (``p_g = n_g / N``) the sum over the groups is a sum over the samples,
``sum_g (n_g/N) f(m_g) = (1/N) sum_i f(m_{g_i})``: the group objective is the sample-level objective of the
N-vector ``m[groups]`` (each sample's group mean), exactly, so the sample-level solver of either backend serves
unchanged and the group distribution is the sample-level one summed within each group (``q_g = n_g q_i``, i in g;
for cvar the boundary mass is shared in proportion to ``n_g``, as ``p_g`` shares it). The value is differentiable to
the losses through the group means: the gradient of ``l_i`` is ``q_{g_i} / n_{g_i}`` (Danskin).

"population" and tensor weightings solve over the G group means with the weights ``p_g`` (dro_ext._solver's
per-point weights), in float64 on either backend (the native solver takes no weights), the value still
differentiable through the group means.

``group=`` (a process group): the per-group sums and counts of the ranks' losses are all-reduced once (2G + 3 numbers,
``dro_ext.groups``' reduction over ranks), and every rank solves the same weighted problem over the G global means
(weights n_g for "batch": the same Psi as over the concatenated losses), with no further collective; so every rank
gets the same value, eta* and q. As :func:`dro_ext.robust_objective` with ``group=`` and no groups, the gradient of
each local loss is its own Danskin partial ``q_{g_i} / n_{g_i}``, not scaled for DDP's averaging.
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, NamedTuple

import torch

from dro_ext import _solver
from dro_ext._first_order import first_order_only
from dro_ext._divergences import accumulate_dtype, check_losses, fixed_order_sum
from dro_ext.group_reduction import check_groups, check_num_groups, gather_by_group
from dro_ext.groups import (
    _counted_groups,
    _GlobalValueLocalGradient,
    _group_sums,
    _group_weights,
    _reduced_group_sums,
)

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

    from dro_ext._divergences import Spec

__all__ = ["GroupEvaluation"]


class GroupEvaluation(NamedTuple):
    """What :func:`dro_ext.evaluate` returns when given ``num_groups`` (the report Group DRO papers give)."""

    value: torch.Tensor             # Psi over the group means (0-d, dtype of the losses)
    eta_star: torch.Tensor          # its minimizer (0-d, accumulate dtype)
    group_loss: torch.Tensor        # (num_groups,) mean loss of each group; NaN for a group without samples
    group_count: torch.Tensor       # (num_groups,) int64 number of samples of each group
    worst_group: torch.Tensor       # 0-d int64: the group of the largest mean loss (the lowest id among ties)
    worst_group_loss: torch.Tensor  # 0-d: that group's mean loss, max over the groups present


def check_group_arguments(losses: torch.Tensor, groups: torch.Tensor | None, num_groups: int | None,
                          weighting: str | torch.Tensor | Sequence[float], group_counts: Any,
                          where: str) -> tuple[int, torch.Tensor | None] | tuple[None, None]:
    """(None, None) when neither groups nor num_groups is given (the sample-level call); else the checked
    num_groups and the unnormalized group weights (None for "batch", else float64 (G,) on the losses' device).

    Raises for one of the pair without the other and for a bad weighting."""
    if groups is None and num_groups is None:
        if not (isinstance(weighting, str) and weighting == "batch") or group_counts is not None:
            raise ValueError(f"dro_ext.{where}: weighting and group_counts apply over groups; pass groups and "
                             f"num_groups with them")
        return None, None
    if groups is None:
        raise ValueError(f"dro_ext.{where}: num_groups={num_groups!r} was given without groups; pass groups (the "
                         f"group id of each loss) too")
    if num_groups is None:
        raise ValueError(f"dro_ext.{where}: groups was given without num_groups; pass num_groups (the number of "
                         f"groups, ids in [0, num_groups))")
    num_groups = check_num_groups(num_groups)
    check_groups(groups, losses)
    return num_groups, _group_weights(weighting, group_counts, num_groups, losses.device)


def check_weighting(weighting: str | torch.Tensor | Sequence[float], group_counts: Any,
                    num_groups: int) -> torch.Tensor | None:
    """The group weights of check_group_arguments before any loss exists (evaluate checks them before its loop)."""
    return _group_weights(weighting, group_counts, num_groups, torch.device("cpu"))


def sample_group_means(losses: torch.Tensor, groups: torch.Tensor,
                       num_groups: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(x, sums, counts): x = m[groups], each sample's group mean, from float64 sums (where the device has float64)
    whatever the losses' dtype, so that a mean is neither rounded to the losses' dtype before the solve nor made
    +inf by a sum past float32's range; differentiable to the losses."""
    sums, counts = _group_sums(losses, groups, num_groups, wide=True)
    means = sums / torch.clamp(counts, min=1.0)
    return gather_by_group(means, groups), sums, counts


class _WeightedGroupObjective(torch.autograd.Function):
    """(Psi, eta*) of the group means m (G,) under the group weights p (G,), over the groups present."""

    @staticmethod
    def forward(ctx: Any, means: torch.Tensor, present: torch.Tensor, p: torch.Tensor, lam: float,
                spec: Spec) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        # Solved over the groups that count (q = 0 for the others): a group of weight 0 kept in the solve would still
        # set kl's shift and enter the Newton sums.
        means64 = means.detach().to(torch.float64)
        present = _counted_groups(present, p, means64)
        x, w = means64[present], p.to(torch.float64)[present]
        acc = means.dtype
        if x.numel() == 0 or not bool(w.sum() > 0):
            # No weight on any present group: p renormalized over them is 0/0, and the worst case over no
            # distribution is undefined: NaN, its distribution over the groups (and so the gradient) too, rather
            # than zeros that sum to no distribution. (The training objective, group_dro_loss, takes 0 there
            # instead, so that a micro-batch of padding adds nothing to a gradient.)
            solution = _solver.Solution(math.nan, math.nan, 0)
            q_groups = torch.full(means.shape, math.nan, dtype=torch.float64, device=means.device)
        else:
            solution = _solver.solve(x, lam, spec, w=w)
            eta = torch.tensor(solution.eta, dtype=torch.float64, device=x.device)
            q = _solver.weights(x, eta, solution.n, lam, spec, w=w)
            q_groups = torch.zeros(means.shape, dtype=torch.float64, device=means.device).masked_scatter(present, q)
        ctx.save_for_backward(q_groups, means)
        # eta* carries no gradient, as on the other paths (a gradient of zeros through it would be wrong).
        eta_star = torch.tensor(solution.eta, dtype=acc, device=means.device)
        ctx.mark_non_differentiable(eta_star, q_groups)
        value = torch.tensor(solution.value, dtype=acc, device=means.device)
        return value, eta_star, q_groups

    @staticmethod
    def backward(ctx: Any, grad_value: torch.Tensor, _grad_eta: torch.Tensor | None,
                 _grad_q: torch.Tensor | None) -> tuple[torch.Tensor | None, None, None, None, None]:
        q_groups, means = ctx.saved_tensors
        grad = (q_groups * grad_value.to(torch.float64)).to(grad_value.dtype)
        # q holds eta* fixed, which moves with the means: a second derivative raises, as the sample-level one does.
        return first_order_only("robust_objective", (grad,), means, grad_value)[0], None, None, None, None


def _weighted(losses: torch.Tensor, groups: torch.Tensor, num_groups: int, lam: float, spec: Spec,
              weights: torch.Tensor | None, group: ProcessGroup | None = None,
              where: str = "") -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(Psi, eta*, q, sums, counts) of the weighted problem over the G group means (weights None: the counts n_g),
    with the group sums and counts it solved over; with a process group, the means of the ranks' losses together
    (sums and counts all-reduced, float64), each local loss getting its own partial derivative."""
    eta_dtype = accumulate_dtype(losses.dtype)
    if group is not None:
        # One dtype on every rank for the all-reduce, whatever each rank's losses (an empty rank has no dtype of
        # its own to follow); the solve is in float64 anyway.
        losses = losses.to(torch.float64)
    sums, counts = _reduced_group_sums(losses, groups, num_groups, group, where)
    present = counts > 0
    if group is not None and not bool(present.any()):
        # As over samples (one process refuses an empty batch): not NaN. (The counts of every rank, so every rank
        # raises; an evaluation reads all-reduced numbers on the host anyway.)
        raise ValueError(f"dro_ext.{where}: the losses of every rank together are empty")
    value, eta, q = _WeightedGroupObjective.apply(sums / torch.clamp(counts, min=1.0), present,
                                                  counts if weights is None else weights, lam, spec)
    if group is not None:
        # _reduced_group_sums scales the local gradient by the world size for DDP's averaging; undo it here, so
        # that the gradient is the Danskin partial, as robust_objective(group=) gives it without groups.
        world = float(torch.distributed.get_world_size(group))
        value = _GlobalValueLocalGradient.apply(value.detach(), value, 1.0 / world)
    return value, eta.to(eta_dtype), q, sums, counts


def robust_objective(losses: torch.Tensor, groups: torch.Tensor, num_groups: int, lam: float, spec: Spec,
                     weights: torch.Tensor | None = None, group: ProcessGroup | None = None) -> tuple[torch.Tensor,
                                                                                                 torch.Tensor]:
    """(Psi, eta*) over the group means; Psi in the dtype of losses, eta* in its accumulate dtype."""
    value, eta, _, _ = _objective_and_sums(losses, groups, num_groups, lam, spec, weights, group, "robust_objective")
    return value, eta


def _objective_and_sums(losses: torch.Tensor, groups: torch.Tensor, num_groups: int, lam: float, spec: Spec,
                        weights: torch.Tensor | None, group: ProcessGroup | None,
                        where: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(Psi, eta*, sums, counts): robust_objective with the group sums and counts it solved over (all-reduced with a
    process group, in float64 there), so that evaluate's report reduces the losses once."""
    from dro_ext import robust

    check_losses(losses, allow_empty=group is not None)
    if weights is not None or group is not None:
        value, eta, _, sums, counts = _weighted(losses, groups, num_groups, lam, spec, weights, group, where)
        return value.to(losses.dtype), eta, sums, counts
    x, sums, counts = sample_group_means(losses, groups, num_groups)
    value, eta = robust.robust_objective(x, lam, spec.name, alpha=spec.alpha, k=spec.k)
    # (eta* in the accumulate dtype of the losses, as documented, though solved over float64 means)
    return value.to(losses.dtype), eta.to(accumulate_dtype(losses.dtype)), sums, counts


def worst_case_weights(losses: torch.Tensor, groups: torch.Tensor, num_groups: int, lam: float, spec: Spec,
                       weights: torch.Tensor | None = None, group: ProcessGroup | None = None) -> torch.Tensor:
    """q over the num_groups groups (0 for an absent group, sums to one), in the dtype of losses; no gradient."""
    check_losses(losses, allow_empty=group is not None)
    if weights is not None or group is not None:
        q = _weighted(losses.detach(), groups, num_groups, lam, spec, weights, group, "worst_case_weights")[2]
        return q.to(losses.dtype)
    q_samples = sample_weights(losses.detach(), groups, num_groups, lam, spec)
    # Summed in float64: a group's sample weights are alike (every sample of a group has its mean), and added one
    # after another in float32 each add rounds the same way (8e-6 relative at 2^18 samples a group).
    q, _ = _group_sums(q_samples.double(), groups, num_groups)
    # Renormalized over the G groups: exactly one for a single group, whatever the roundings of N terms.
    return (q / fixed_order_sum(q)).to(losses.dtype)


def sample_weights(losses: torch.Tensor, groups: torch.Tensor, num_groups: int, lam: float, spec: Spec,
                   eta: torch.Tensor | float | None = None, scale: float = 1.0,
                   group: ProcessGroup | None = None) -> torch.Tensor:
    """The distribution over the samples that the group distribution induces, q_{g_i} / n_{g_i} (float64, as
    the group means it is formed from, where the device has it): the worst case when eta is None, else the
    dro_weights of the group means at eta (unnormalized, as weight_stats takes them).

    With a process group, of this rank's samples within the ranks' samples together: the group means and counts
    are those of every rank (one all-reduce of 2G + 3 numbers), the worst case is solved over them as
    robust_objective(group=) solves it (the same q on every rank), and the weights of all ranks' samples sum to
    what they would over the concatenated batch."""
    from dro_ext import robust
    from dro_ext.ops import dro_weights

    losses = losses.detach()
    if group is None:
        x, _, _ = sample_group_means(losses, groups, num_groups)
    else:
        sums, counts = _reduced_group_sums(losses, groups, num_groups, group, "weight_stats")
        divisors = torch.clamp(counts, min=1.0)
        if eta is None:
            q = _WeightedGroupObjective.apply(sums / divisors, counts > 0, counts, lam, spec)[2]
            return (q / divisors)[groups.long()]
        x = (sums / divisors)[groups.long()]
        if x.numel() == 0:  # a rank without samples: no weights of its own (dro_weights takes no empty batch)
            return x
    if eta is None:
        return robust.worst_case_weights(x, lam, spec.name, alpha=spec.alpha, k=spec.k)
    # In float64: at a given eta the weights are unnormalized, and float32 ones overflow where their ratios do not.
    return dro_weights(x.to(torch.float64), eta, lam, spec.name, alpha=spec.alpha, k=spec.k, scale=scale)


def report(losses: torch.Tensor, groups: torch.Tensor, num_groups: int, lam: float, spec: Spec,
           weights: torch.Tensor | None = None, group: ProcessGroup | None = None) -> GroupEvaluation:
    """Psi over the group means with each group's mean loss and the worst group's, for dro_ext.evaluate."""
    value, eta, sums, counts = _objective_and_sums(losses, groups, num_groups, lam, spec, weights, group, "evaluate")
    present = counts > 0  # (some group is, with a process group too: robust_objective raised otherwise)
    means = sums / torch.clamp(counts, min=1.0)
    # The worst group in three tiers: a NaN mean above every number (+inf included), an absent group below every
    # present one (-inf included); within the top tier the largest mean, then the lowest id (argmax's first).
    nan = present & torch.isnan(means)
    tier = present.to(torch.int8) + nan.to(torch.int8)
    top = tier == tier.max()
    largest = torch.where(top & ~nan, means, -torch.inf).max()
    worst = torch.argmax((top & (nan | (means == largest))).to(torch.int8))
    dtype = losses.dtype
    group_loss = torch.where(present, means, torch.nan).to(dtype)
    # The counts as the objective took them are float32 for half and float32 losses (float64 over ranks), exact to
    # 2^24 samples a group, which a whole dataset passes: the report counts in int64.
    exact_counts = (counts.to(torch.int64) if counts.dtype == torch.float64
                    else torch.bincount(groups.reshape(-1).long(), minlength=num_groups))
    return GroupEvaluation(value, eta, group_loss, exact_counts, worst, group_loss[worst])
