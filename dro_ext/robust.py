"""The exact robust objective ``Psi = min over eta of L(eta)``, its worst-case distribution, weight
diagnostics and a whole-dataset evaluation helper (docs/design.md section 1.7).

With ``L(eta) = mean_i lam * psi*((l_i - eta)/lam) + eta`` (G = 1), ``eta*`` lies in ``[min l, max l]``
because ``psi*'(0) = 1``, and the worst-case distribution is ``q_i = psi*'((l_i - eta*)/lam) / N``:

- ``kl``: ``Psi = eta* = lam * logsumexp(l/lam) - lam*log N`` (never overflows);
- ``cvar``: the tail mean over the top ``alpha*N`` losses, with the fractional boundary sample;
- ``chi2`` and ``cressie_read`` at ``k = 2``: Newton from ``min l`` on the piecewise-linear mean weight stops
  on the exact segment, whose root is then solved in closed form (float64 sums);
- ``kl_cvar``, ``cressie_read``, ``smoothed_cvar``: safeguarded Newton/bisection on
  ``mean psi*'((l - eta)/lam) = 1`` inside the bracket, to the rounding of the sums.

The condition is summed as ``psi*'(t) - 1`` and the value formed as ``mean l + lam * mean(psi*(t) - t)``,
both accurate for small ``t``, so ``Psi -> mean l`` keeps its precision as ``lam -> inf`` (the ERM limit).

The native op does each Newton iteration as one fused pass of the loss kernel (sum psi*' and sum psi*'');
the PyTorch fallback is dro_ext._solver, in float64 with a Python loop (its docstring says how the two differ).
"""
from __future__ import annotations

import functools
import sys
from collections.abc import Iterable, Iterator, Sequence, Sized
from types import ModuleType
from typing import TYPE_CHECKING, Any, Callable, ContextManager, NamedTuple, TypeVar, cast, overload

import torch

from dro_ext import _backend, _solver
from dro_ext import group_evaluation as _group_evaluation
from dro_ext._first_order import first_order_only
from dro_ext._divergences import (
    Divergence,
    Spec,
    accumulate_dtype,
    as_eta,
    check_divergence,
    check_losses,
    check_lam,
    checked_scalars,
    fixed_order_sum,
    input_device,
    op_scalars,
)
from dro_ext.group_reduction import check_groups, check_num_groups
from dro_ext.groups import _bad_ids_message
from dro_ext.ops import dro_weights

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

    from dro_ext.distributed import AgreedSettings

__all__ = ["WeightStats", "evaluate", "robust_objective", "weight_stats", "worst_case_weights"]

# robust_objective's default weighting, which its fast path recognizes by identity (an equal string passed by the
# caller takes the checked path, which accepts it too).
_BATCH_WEIGHTING = "batch"

# ---------------------------------------------------------------------------------------------------
# Native ops: fake kernels (their autograd is C++: csrc/autograd.cpp). Registered only when loaded.
# ---------------------------------------------------------------------------------------------------

if _backend.native_available():
    # Looked up once, as ops.py's loss is.
    _robust_objective_op = torch.ops.dro_ext.robust_objective.default

    @torch.library.register_fake("dro_ext::robust_objective")
    def _robust_objective_fake(losses: torch.Tensor, lam: float, divergence: str, alpha: float | None = None,
                               k: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        torch._check(losses.dim() == 1, lambda: "dro_ext: losses must be a 1-D tensor")
        return losses.new_empty(()), losses.new_empty((), dtype=accumulate_dtype(losses.dtype))

    @torch.library.register_fake("dro_ext::robust_weights")
    def _robust_weights_fake(losses: torch.Tensor, eta_star: torch.Tensor, lam: float, divergence: str,
                             alpha: float | None = None, k: float | None = None) -> torch.Tensor:
        _backend.check_fake_devices("losses", losses, eta_star=eta_star)
        return torch.empty_like(losses, memory_format=torch.contiguous_format)

    @torch.library.register_fake("dro_ext::weight_stats")
    def _weight_stats_fake(weights: torch.Tensor, groups: torch.Tensor | None = None, num_groups: int = 0
                           ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        _backend.check_fake_devices("weights", weights, groups=groups)
        acc = accumulate_dtype(weights.dtype)
        scalar = weights.new_empty((), dtype=acc)
        width = num_groups if groups is not None else 0
        return scalar, scalar.clone(), scalar.clone(), weights.new_empty((width,), dtype=acc)


# ---------------------------------------------------------------------------------------------------
# The PyTorch fallback: dro_ext._solver over this process's losses, in float64.
# ---------------------------------------------------------------------------------------------------


class _RobustObjective(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, losses: torch.Tensor, lam: float, spec: Spec) -> tuple[torch.Tensor, torch.Tensor]:
        # contiguous: a strided view would be summed in another order than its copy
        value, eta, _ = _solver.solve(losses.detach().to(torch.float64).contiguous(), lam, spec)
        eta_t = torch.tensor(eta, dtype=accumulate_dtype(losses.dtype), device=losses.device)
        ctx.save_for_backward(losses, eta_t)
        ctx.args = (lam, spec)
        ctx.mark_non_differentiable(eta_t)
        return torch.tensor(value, dtype=losses.dtype, device=losses.device), eta_t

    @staticmethod
    def backward(ctx: Any, grad_value: torch.Tensor, _grad_eta: torch.Tensor | None
                 ) -> tuple[torch.Tensor | None, None, None]:
        losses, eta_t = ctx.saved_tensors
        lam, spec = ctx.args
        with torch.no_grad():
            grad = _fallback_weights(losses, eta_t, lam, spec) * grad_value.to(losses.dtype)
        # Recorded (create_graph=True): differentiating the weights would hold eta* fixed, but eta* moves with the
        # losses, so a second backward raises, as the native op's does (csrc/autograd.cpp).
        return first_order_only("robust_objective", (grad,), losses, grad_value)[0], None, None


# ---------------------------------------------------------------------------------------------------
# Public API
# ---------------------------------------------------------------------------------------------------


def robust_objective(
    losses: torch.Tensor, lam: float, divergence: Divergence = "chi2", *, alpha: float | None = None,
    k: float | None = None, group: ProcessGroup | None = None,
    groups: torch.Tensor | None = None, num_groups: int | None = None,
    weighting: str | torch.Tensor | Sequence[float] = _BATCH_WEIGHTING, group_counts: Any = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The robust objective ``Psi = min_eta mean_i lam*psi*((l_i - eta)/lam) + eta`` and its minimizer.

    Returns ``(value, eta_star)``: ``value`` is 0-d in the dtype of ``losses``; ``eta_star`` is 0-d in the
    accumulate dtype (float64 for float64 losses, float32 otherwise). Exact to the rounding of the
    accumulate dtype: closed forms for ``kl`` and ``cvar``, an exact segment solve for ``chi2`` and
    safeguarded Newton/bisection for the others. NaN in ``losses`` gives NaN, and so does ``-inf``;
    ``+inf`` gives ``inf``.

    If ``losses`` requires grad, ``value`` is differentiable: by Danskin's theorem its gradient is the
    worst-case distribution :func:`worst_case_weights` (times the incoming gradient), so it can serve as a
    training loss. ``eta_star`` carries no gradient.

    ``group`` (a torch.distributed process group): ``losses`` is this rank's share, and every rank gets
    the answer on the losses of all the ranks concatenated, from all-reduces (dro_ext.distributed).

    ``groups`` (int64 or int32 ids in ``[0, num_groups)``, the shape of ``losses``) with ``num_groups``: ``Psi``
    over the group means instead, ``min_eta eta + lam sum_g p_g psi*((m_g - eta)/lam)`` over the groups present,
    the minimum of :func:`dro_ext.group_dro_loss` (``weighting`` and ``group_counts`` as it takes them:
    ``"batch"`` by the backend's solver, the others by the PyTorch solver in float64); the gradient of ``l_i``
    is ``q_{g_i} / n_{g_i}`` (dro_ext.group_evaluation). With ``group=``, over the groups of every rank's losses.
    """
    if (group is None and groups is None and num_groups is None and weighting is _BATCH_WEIGHTING
            and group_counts is None and losses.__class__ is torch.Tensor and losses.layout is torch.strided
            and _backend.native_for_tensor(losses)):
        # The sample-level call on the native op, which checks the losses itself with the same errors; the Python
        # numbers were checked when first seen. (This call is a few microseconds: every check here shows.)
        return _robust_objective_op(losses, *op_scalars(divergence, alpha, k, lam))
    if group is not None and _plainly_over_samples(groups, num_groups, weighting, group_counts):
        return _distributed().robust_objective(losses, lam, divergence, alpha=alpha, k=k, group=group)
    spec, lam, num_groups, group_weights = _checked_arguments(
        "robust_objective", losses, lam, divergence, alpha, k, groups, num_groups, weighting, group_counts, group)
    if num_groups is not None:
        assert groups is not None  # given with num_groups (check_group_arguments)
        return _group_evaluation.robust_objective(losses, groups, num_groups, lam, spec, group_weights, group)
    if _backend.native_for(losses.device.type):
        return _robust_objective_op(losses, lam, spec.name, spec.alpha, spec.k)
    return _RobustObjective.apply(losses, lam, spec)


def worst_case_weights(losses: torch.Tensor, lam: float, divergence: Divergence = "chi2", *,
                       alpha: float | None = None, k: float | None = None, group: ProcessGroup | None = None,
                       groups: torch.Tensor | None = None, num_groups: int | None = None,
                       weighting: str | torch.Tensor | Sequence[float] = "batch",
                       group_counts: Any = None) -> torch.Tensor:
    """The worst-case distribution ``q_i = psi*'((l_i - eta*)/lam) / N`` over the samples (sums to one).

    For ``cvar`` the samples above ``eta*`` get ``1/(alpha N)`` each and the samples equal to ``eta*``
    share the remaining mass equally (fractional when ``alpha*N`` is not an integer). Shape ``(N,)``,
    dtype of ``losses``; no gradient flows through it. With ``group``, this rank's share of the
    distribution over the losses of every rank (the shares sum to one over the ranks).

    With ``groups`` and ``num_groups`` (as :func:`robust_objective` takes them): the worst-case distribution over
    the groups instead, ``q_g = p_g psi*'((m_g - eta*)/lam)``, shape ``(num_groups,)``, 0 for an absent group.
    """
    if group is not None and _plainly_over_samples(groups, num_groups, weighting, group_counts):
        return _distributed().worst_case_weights(losses, lam, divergence, alpha=alpha, k=k, group=group)
    spec, lam, num_groups, group_weights = _checked_arguments(
        "worst_case_weights", losses, lam, divergence, alpha, k, groups, num_groups, weighting, group_counts, group)
    if num_groups is not None:
        assert groups is not None  # given with num_groups (check_group_arguments)
        return _group_evaluation.worst_case_weights(losses, groups, num_groups, lam, spec, group_weights, group)
    losses = losses.detach()
    _, eta = robust_objective(losses, lam, spec.name, alpha=spec.alpha, k=spec.k)
    if _backend.native_for(losses.device.type):
        return torch.ops.dro_ext.robust_weights(losses, eta, lam, spec.name, spec.alpha, spec.k)
    return _fallback_weights(losses, eta, lam, spec)


def _plainly_over_samples(groups: torch.Tensor | None, num_groups: int | None,
                          weighting: str | torch.Tensor | Sequence[float], group_counts: Any) -> bool:
    """No argument over groups: the call is the sample-level one (a weighting without groups is refused by the checks,
    with a process group as without one; the distributed sample-level call would ignore it)."""
    return (groups is None and num_groups is None and group_counts is None
            and isinstance(weighting, str) and weighting == _BATCH_WEIGHTING)


def _checked_arguments(where: str, losses: torch.Tensor, lam: float, divergence: Divergence, alpha: float | None,
                       k: float | None, groups: torch.Tensor | None, num_groups: int | None,
                       weighting: str | torch.Tensor | Sequence[float], group_counts: Any,
                       group: ProcessGroup | None) -> tuple[Spec, float, int | None, torch.Tensor | None]:
    """robust_objective's and worst_case_weights' checks: (spec, lam, num_groups, group weights), num_groups None
    over samples. With group=, agreed on by every rank before the first collective."""
    with _checked_on_every_rank(group, where, losses) as agreed:
        spec = check_divergence(divergence, alpha, k)
        check_losses(losses, allow_empty=group is not None)
        if losses.device.type == "meta":
            raise NotImplementedError(f"dro_ext.{where} solves over the losses' values, which a meta tensor does not "
                                      f"hold")
        lam = check_lam(lam)
        checked_num_groups, group_weights = _group_evaluation.check_group_arguments(
            losses, groups, num_groups, weighting, group_counts, where)
        agreed.set(lam, spec, checked_num_groups, weights=group_weights)
    return spec, lam, checked_num_groups, group_weights


def _fallback_weights(losses: torch.Tensor, eta: torch.Tensor, lam: float, spec: Spec) -> torch.Tensor:
    """The worst-case distribution at eta (normalized to sum to one), in the losses' dtype."""
    x = losses.detach().to(torch.float64)
    return _solver.weights(x, eta.detach().to(torch.float64), x.numel(), lam, spec).to(losses.dtype)


class WeightStats(NamedTuple):
    """Diagnostics of a distribution over N samples (0-d tensors, float32 or float64)."""

    ess: torch.Tensor            # effective sample size (sum w)^2 / sum w^2, in [1, N]
    max_weight: torch.Tensor     # the largest normalized weight max_i q_i, in [1/N, 1]
    zero_fraction: torch.Tensor  # the fraction of samples with zero weight
    group_mass: torch.Tensor | None  # (num_groups,) total q per group, when groups are given


def weight_stats(
    weights: torch.Tensor | None = None,
    *,
    losses: torch.Tensor | None = None,
    eta: float | torch.Tensor | None = None,
    lam: float | None = None,
    divergence: Divergence = "chi2",
    alpha: float | None = None,
    k: float | None = None,
    scale: float = 1.0,
    groups: torch.Tensor | None = None,
    num_groups: int | None = None,
    group: ProcessGroup | None = None,
    over: str = "samples",
) -> WeightStats:
    """Effective sample size, max weight, zero fraction and per-group mass of a sample weighting.

    Give either ``weights`` (any non-negative 1-D tensor; it is normalized to sum to one; a negative weight raises
    ValueError on the CPU, and fails an asynchronous device assertion on CUDA (a RuntimeError at the next sync, with
    no host read here); NaN gives a NaN ``ess`` and ``max_weight``, ``zero_fraction`` counting the exact zeros) or
    ``losses`` and
    ``lam`` (with ``divergence``, ``alpha``, ``k``): then the weights are ``dro_weights(losses, eta, ...)``
    at the given ``eta`` (e.g. the trained ``DROLoss.eta``), or the worst-case distribution when ``eta`` is
    None. ``groups`` is an optional integer tensor of group ids in ``[0, num_groups)``, one per sample; ids
    outside ``[0, num_groups)`` raise IndexError, for which the CUDA op reads one flag on the host, so a call
    with ``groups`` waits for the device once (and once more for ``groups.max()`` without ``num_groups``). One
    pass over the weights in the native op (four small reductions in the fallback); never differentiable.
    ``group`` (a process group): the statistics of the weights (or losses) of every rank together.

    ``over="groups"`` (with ``losses``, ``lam``, ``groups`` and ``num_groups``): the weighting is the one over the
    group means that :func:`robust_objective` with ``groups`` solves (the worst case, or ``dro_weights`` of the
    group means at ``eta``), spread over the samples as ``q_{g_i} / n_{g_i}``: the statistics stay those of a
    distribution over the N samples, and ``group_mass`` is the group distribution ``q`` itself.
    """
    # Every check before the first collective (with group=, agreed on by every rank: a rank refusing alone would
    # leave the others waiting in the solver's or the statistics' all-reduces).
    with _checked_on_every_rank(group, "weight_stats", weights, losses) as agreed:
        width, spec = _check_weight_stats_arguments(weights, losses, eta, lam, divergence, alpha, k, scale, groups,
                                                    num_groups, group, over)
        # (given weights, lam and the divergence are not used: spec is None)
        agreed.set(lam if spec is not None else None, spec, width, over=over, eta=eta,
                   scale=1.0 if eta is None else scale)
    # The statistics come in the accumulate dtype of what was given (the losses, or the weights); the weights at a
    # given eta are formed in float64, where float32 ones overflow (kl's e^t past t = 88) though their ratios do not.
    given = losses if losses is not None else weights
    assert given is not None  # (checked)
    out_dtype = accumulate_dtype(given.dtype)
    with torch.no_grad():
        if over == "groups":
            assert losses is not None and groups is not None and lam is not None  # (checked)
            assert width is not None and spec is not None  # (checked)
            w = _group_evaluation.sample_weights(losses, groups, width, lam, spec, eta, scale, group)
        elif weights is not None:
            if group is None:  # (with group=, every rank raises after its reduction)
                _check_nonnegative_weights(weights)
            w = weights
        else:
            assert losses is not None and lam is not None  # (checked)
            if eta is None and group is not None:
                w = _distributed().worst_case_weights(losses, lam, divergence, alpha=alpha, k=k, group=group,
                                                      where="weight_stats")
            elif eta is None:
                w = worst_case_weights(losses, lam, divergence, alpha=alpha, k=k)
            elif group is not None and losses.numel() == 0:
                # A rank without samples has no weights of its own (dro_weights takes no empty batch), and still
                # takes part in the collectives below.
                w = losses.detach()
            else:
                w = dro_weights(losses.detach().to(torch.float64), eta, lam, divergence, alpha=alpha, k=k,
                                scale=scale)
        w = w.detach()
        if groups is not None and width is None:
            width = int(groups.max().item()) + 1
        width = width or 0  # the number of groups, where groups are given
        if group is not None:
            stats = _distributed().weight_stats(w, groups, width, group)
        elif _backend.native_for(w.device.type):
            ess, max_weight, zero_fraction, group_mass = torch.ops.dro_ext.weight_stats(w, groups, width)
            stats = WeightStats(ess, max_weight, zero_fraction, group_mass if groups is not None else None)
        else:
            stats = _fallback_weight_stats(w, groups, width)
    return WeightStats(stats.ess.to(out_dtype), stats.max_weight.to(out_dtype), stats.zero_fraction.to(out_dtype),
                       None if stats.group_mass is None else stats.group_mass.to(out_dtype))


def _fallback_weight_stats(w: torch.Tensor, groups: torch.Tensor | None, width: int) -> WeightStats:
    """The statistics in float64, as the native op forms them (float32 squares of weights past 1e19 or below 1e-19
    overflowed or underflowed: NaN statistics)."""
    x = w.to(torch.float64)
    total = fixed_order_sum(x)
    ess = total * total / fixed_order_sum(x * x)
    max_weight = x.amax() / total
    zero_fraction = (x == 0).sum().to(torch.float64) / x.numel()
    group_mass = None
    if groups is not None:
        if groups.numel() and (int(groups.min()) < 0 or int(groups.max()) >= width):
            raise IndexError(_bad_ids_message(width))
        group_mass = torch.zeros(width, dtype=torch.float64, device=w.device)
        group_mass.index_add_(0, groups.long(), x)
        group_mass = group_mass / total
    return WeightStats(ess, max_weight, zero_fraction, group_mass)


def _check_weight_stats_arguments(weights: torch.Tensor | None, losses: torch.Tensor | None,
                                  eta: float | torch.Tensor | None, lam: float | None, divergence: Divergence,
                                  alpha: float | None, k: float | None, scale: float, groups: torch.Tensor | None,
                                  num_groups: int | None, group: ProcessGroup | None,
                                  over: str) -> tuple[int | None, Spec | None]:
    """weight_stats' arguments, every check that can fail before its collectives: (the number of groups, None where
    groups are given without num_groups on one process: then from the ids; the divergence, None for given
    weights)."""
    if over not in ("samples", "groups"):
        raise ValueError(f"dro_ext: over must be 'samples' or 'groups', got over={over!r}")
    if over == "groups":
        if weights is not None or losses is None or lam is None or groups is None or num_groups is None:
            raise ValueError("dro_ext: weight_stats with over='groups' needs losses, lam, groups and num_groups "
                             "(and no weights)")
    elif weights is not None:
        if losses is not None or eta is not None:
            raise ValueError("dro_ext: give either weights or losses (+ eta), not both")
        check_losses(weights, "weights", allow_empty=group is not None)
    elif losses is None:
        raise ValueError("dro_ext: weight_stats needs weights, or losses and lam")
    elif lam is None:
        raise ValueError("dro_ext: weight_stats with losses needs lam > 0, got lam=None")
    spec = None
    if losses is not None:
        check_losses(losses, allow_empty=group is not None)  # a rank may hold no samples
        # (scale enters only the weights at a given eta)
        spec, _, _ = checked_scalars(divergence, alpha, k, cast(float, lam), 1.0 if eta is None else scale)
        if eta is not None:
            as_eta(eta, losses)
    if over == "groups":
        checked, _ = _group_evaluation.check_group_arguments(cast(torch.Tensor, losses), groups, num_groups, "batch",
                                                             None, "weight_stats")
        return checked, spec
    if groups is None:
        if num_groups is not None:
            raise ValueError(f"dro_ext.weight_stats: num_groups={num_groups!r} was given without groups; pass groups "
                             f"(the group id of each sample) too")
        return 0, spec
    w = cast(torch.Tensor, weights if weights is not None else losses)
    if not isinstance(groups, torch.Tensor) or groups.dtype not in (torch.int64, torch.int32):
        raise TypeError("dro_ext: groups must be an int32 or int64 tensor of group ids")
    if groups.shape != w.shape:
        raise ValueError(f"dro_ext: groups must have shape {tuple(w.shape)}, got {tuple(groups.shape)}")
    if groups.device != w.device:
        raise ValueError(f"dro_ext: groups is on {groups.device} but the weights are on {w.device}")
    if num_groups is None:
        if group is not None:
            raise ValueError("dro_ext: weight_stats with group= and groups needs num_groups")
        return None, spec
    return check_num_groups(num_groups), spec


def _checked_on_every_rank(group: ProcessGroup | None, where: str, *inputs: object) -> ContextManager[AgreedSettings]:
    """dro_ext.distributed.checked_on_every_rank over the device of the first tensor of inputs (nothing to agree on
    without a process group)."""
    return _distributed().checked_on_every_rank(group, where, input_device(*inputs))


def _check_nonnegative_weights(weights: torch.Tensor) -> None:
    """weights >= 0 (NaN passes, to give NaN statistics): ValueError on the CPU, where reading them costs no sync; an
    asynchronous device assertion elsewhere and while compiling (no host read)."""
    negative = weights < 0
    if weights.device.type == "cpu" and not torch.compiler.is_compiling():
        if bool(negative.any()):
            raise ValueError(f"dro_ext: weights must be >= 0, got {int(negative.sum())} negative weights")
    else:
        torch._assert_async(~negative.any(), "dro_ext: weights must be >= 0, got a negative weight")


def _distributed() -> ModuleType:
    from dro_ext import distributed

    return distributed


def _to_device(batch: Any, device: torch.device | str | int) -> Any:
    if isinstance(batch, torch.Tensor):
        return batch.to(device, non_blocking=True)
    if isinstance(batch, (list, tuple)):
        moved = [_to_device(b, device) for b in batch]
        return type(batch)(*moved) if hasattr(batch, "_fields") else type(batch)(moved)
    if isinstance(batch, dict):
        return {key: _to_device(v, device) for key, v in batch.items()}
    return batch


_Item = TypeVar("_Item")


def _progress(iterable: Iterable[_Item], enabled: bool) -> Iterator[_Item]:
    """tqdm when it is installed, else a plain counter on stderr; nothing when disabled."""
    if not enabled:
        yield from iterable
        return
    try:
        total = len(iterable) if isinstance(iterable, Sized) else None
    except TypeError:  # a __len__ that raises, e.g. a DataLoader over an IterableDataset
        total = None
    try:
        from tqdm.auto import tqdm
    except ImportError:
        tqdm = None
    if tqdm is not None:
        yield from tqdm(iterable, total=total, desc="dro_ext.evaluate", unit="batch")
        return
    suffix = f"/{total}" if total is not None else ""
    count = 0
    for item in iterable:
        yield item
        count += 1
        sys.stderr.write(f"\rdro_ext.evaluate: {count}{suffix} batches")
        sys.stderr.flush()
    sys.stderr.write("\n")


# The return type follows num_groups: a (value, eta_star) pair without groups, a GroupEvaluation with them.
@overload
def evaluate(
    model: torch.nn.Module,
    loader: Iterable[Any],
    per_sample_loss_fn: Callable[[torch.nn.Module, Any], torch.Tensor],
    lam: float,
    divergence: Divergence = "chi2",
    *,
    alpha: float | None = None,
    k: float | None = None,
    device: torch.device | str | int | None = None,
    progress: bool = True,
    group: ProcessGroup | None = None,
    groups_fn: None = None,
    num_groups: None = None,
    weighting: str | torch.Tensor | Sequence[float] = "batch",
    group_counts: Any = None,
) -> tuple[torch.Tensor, torch.Tensor]: ...


@overload
def evaluate(
    model: torch.nn.Module,
    loader: Iterable[Any],
    per_sample_loss_fn: Callable[[torch.nn.Module, Any], torch.Tensor],
    lam: float,
    divergence: Divergence = "chi2",
    *,
    alpha: float | None = None,
    k: float | None = None,
    device: torch.device | str | int | None = None,
    progress: bool = True,
    group: ProcessGroup | None = None,
    groups_fn: Callable[[Any], torch.Tensor],
    num_groups: int,
    weighting: str | torch.Tensor | Sequence[float] = "batch",
    group_counts: Any = None,
) -> _group_evaluation.GroupEvaluation: ...


def evaluate(
    model: torch.nn.Module,
    loader: Iterable[Any],
    per_sample_loss_fn: Callable[[torch.nn.Module, Any], torch.Tensor],
    lam: float,
    divergence: Divergence = "chi2",
    *,
    alpha: float | None = None,
    k: float | None = None,
    device: torch.device | str | int | None = None,
    progress: bool = True,
    group: ProcessGroup | None = None,
    groups_fn: Callable[[Any], torch.Tensor] | None = None,
    num_groups: int | None = None,
    weighting: str | torch.Tensor | Sequence[float] = "batch",
    group_counts: Any = None,
) -> tuple[torch.Tensor, torch.Tensor] | _group_evaluation.GroupEvaluation:
    """``Psi`` over a whole dataset: ``robust_objective`` of the per-sample losses of every batch.

    ``per_sample_loss_fn(model, batch)`` returns the 1-D tensor of per-sample losses of one batch (e.g.
    ``lambda m, b: F.cross_entropy(m(b[0]), b[1], reduction="none")``). The model runs in eval mode under
    ``torch.no_grad()``; only the N losses are kept; the train/eval mode of every submodule is restored
    afterwards. ``device`` moves each batch (tensors in tuples, lists and dicts) there first. Returns
    ``(value, eta_star)`` as :func:`robust_objective` does. With ``group``, each rank evaluates its own
    loader (e.g. with a ``DistributedSampler``, which pads with repeated samples unless the dataset
    divides evenly) and every rank gets ``Psi`` over the losses of all the ranks, in the dtype they promote to (a rank
    whose loader is empty too); it raises ValueError on every rank where no rank holds a loss.

    Over groups: ``groups_fn(batch)`` returns the group id of each sample of the (moved) batch, an int64 or int32
    tensor shaped as the losses (e.g. ``lambda b: b[2]`` for a loader of ``(x, y, group)``), with ``num_groups``.
    The group ids come from the data, so the per-sample loss function stays the one of the sample-level call.
    Then ``Psi`` is :func:`robust_objective` over the group means (``weighting``, ``group_counts`` as it takes
    them) and the result is a
    :class:`dro_ext.GroupEvaluation`: ``(value, eta_star, group_loss, group_count, worst_group,
    worst_group_loss)``, each group's mean loss (NaN where a group has no sample) and the worst group's; with
    ``group``, over the samples of every rank.

    ``progress`` (default True) shows the batches as they are evaluated: a tqdm bar where tqdm is installed, else a
    count on stderr; ``progress=False`` prints nothing.
    """
    # The checks and the loop before the first collective: with group=, a rank whose checks raise (or whose loop does)
    # raises on every rank, agreed on once the loops are done (a rank's loader may be longer than another's).
    group_weights: torch.Tensor | None = None
    group_chunks: list[torch.Tensor] = []
    chunks: list[torch.Tensor] = []
    with _checked_on_every_rank(group, "evaluate") as agreed:
        spec = check_divergence(divergence, alpha, k)
        lam = check_lam(lam)
        if (groups_fn is None) != (num_groups is None):
            given, missing = ("groups_fn", "num_groups") if num_groups is None else ("num_groups", "groups_fn")
            raise ValueError(f"dro_ext.evaluate: {given} was given without {missing}; over groups pass both")
        if num_groups is not None:
            if not callable(groups_fn):
                raise TypeError(f"dro_ext.evaluate: groups_fn must be callable (batch -> group ids), got "
                                f"{type(groups_fn).__name__}")
            num_groups = check_num_groups(num_groups)
            group_weights = _group_evaluation.check_weighting(weighting, group_counts, num_groups)  # before the loop
        elif not (isinstance(weighting, str) and weighting == "batch") or group_counts is not None:
            raise ValueError("dro_ext.evaluate: weighting and group_counts apply over groups; pass groups_fn and "
                             "num_groups with them")
        agreed.set(lam, spec, num_groups, weights=group_weights)
        modes = [(module, module.training) for module in model.modules()]
        try:
            model.eval()
            with torch.no_grad():
                for batch in _progress(loader, progress):
                    if device is not None:
                        batch = _to_device(batch, device)
                    losses = per_sample_loss_fn(model, batch)
                    if not isinstance(losses, torch.Tensor) or losses.dim() != 1:
                        shape = tuple(losses.shape) if isinstance(losses, torch.Tensor) else type(losses).__name__
                        raise ValueError(
                            f"dro_ext: per_sample_loss_fn must return a 1-D tensor of per-sample losses, got {shape}"
                        )
                    # Copies: a loss function may hand back the same buffer each batch (an out= tensor, a replayed
                    # CUDA graph's static output: every chunk was then the last batch's) or a view of a larger one
                    # (which the chunk kept alive whole). So may groups_fn.
                    chunks.append(losses.detach().clone(memory_format=torch.contiguous_format))
                    if groups_fn is not None:
                        ids = groups_fn(batch)
                        check_groups(ids, losses)
                        group_chunks.append(ids.clone(memory_format=torch.contiguous_format))
        finally:
            for module, training in modes:
                module.training = training
        if chunks:
            agreed.dtype = functools.reduce(torch.promote_types, (c.dtype for c in chunks))
    if not chunks:
        if group is None:
            raise ValueError("dro_ext: evaluate got an empty loader (no losses to evaluate)")
        # This rank holds none; the others may. Every rank returns the dtype the losses of all of them promote to.
        chunks.append(torch.empty(0, dtype=agreed.promoted_dtype or torch.get_default_dtype(), device=device))
        group_chunks.append(torch.empty(0, dtype=torch.int64, device=device))
    losses = torch.cat(chunks).to(agreed.promoted_dtype or chunks[0].dtype)
    if groups_fn is not None:
        groups = torch.cat(group_chunks)
        weights = group_weights.to(losses.device) if group_weights is not None else None
        assert num_groups is not None  # given with groups_fn (checked above)
        return _group_evaluation.report(losses, groups, num_groups, lam, spec, weights, group)
    if group is not None:
        # The losses' dtype is the one all ranks promote to, so a dtype refused here is refused on every rank.
        check_losses(losses, allow_empty=True)
        return _distributed().checked_robust_objective(losses, lam, spec, group, "evaluate")
    return robust_objective(losses, lam, spec.name, alpha=spec.alpha, k=spec.k)
