"""DRO over groups: the per-group mean losses m_g = (sum of l_i over the samples i of group g) / n_g, and the two
objectives built on them (docs/design.md, section 1.9):

- :func:`group_dro_loss`: the penalized psi-divergence objective of :func:`dro_ext.dro_loss` with the groups in
  place of the samples, ``scale*eta + sum_g p_g lam psi*((m_g - scale*eta)/lam)`` over the groups present in the
  batch, ``p`` renormalized over them.
- :class:`GroupDROLoss`: the online Group DRO of Sagawa et al. (ICLR 2020): a distribution ``q`` over the groups
  updated by exponentiated gradient ascent on the group losses (or by a greedy CVaR over their running averages),
  the loss being ``sum_g q_g m_g``.

The O(N) work is the reduction of the losses to per-group sums and counts (:func:`dro_ext.group_sums`); the rest is
O(G). GroupDROLoss's exponentiated-gradient step is one native op over the sums where the extension is built
(``dro_ext::group_dro_step_``, csrc/group_dro.cpp: at a few thousand samples some twenty PyTorch ops on (G,) tensors
would cost more than the pass over the losses); its greedy CVaR mode, the penalized objective and the fallback are
composed of PyTorch ops.
"""
from __future__ import annotations

import copy
import math
import numbers
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, NoReturn

import torch
from torch import nn

from dro_ext import _backend
from dro_ext._divergences import (
    accumulate_dtype,
    as_eta,
    check_dense,
    check_divergence,
    check_losses,
    check_lam,
    check_positive,
    fallback_dtype,
    fixed_order_broadcast,
    fixed_order_sum,
    input_device,
    penalized_value,
    real_number,
)
from dro_ext._solver import relative_weights
from dro_ext.group_reduction import check_groups, check_num_groups, group_sums, wide_group_sums

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

    from dro_ext._divergences import Divergence, Spec

__all__ = ["GroupDROLoss", "group_dro_loss"]

# GroupDROLoss's error for its state on another device than the losses (csrc/group_dro_step.h's check says it too).
_STATE_DEVICE_MESSAGE = ("dro_ext: GroupDROLoss's state is on {device} but the losses are on {expected}; move the "
                         "module to the losses' device (module.to(device))")
# (csrc/group_dro.cpp's refuse_update_inside_backward says it too)
_UPDATE_INSIDE_BACKWARD_MESSAGE = (
    "dro_ext.GroupDROLoss: an updating forward ran inside a backward pass (a checkpoint recomputing its region?), "
    "which would update q twice from one batch; call the module outside the checkpointed region")


def _refuse_inside_backward() -> None:
    """An updating forward run by a backward pass (torch.utils.checkpoint recomputing the region that holds the
    module) is refused: updated again, q would take two steps from one batch, and the gradient would be that of a
    loss under another q than the one returned."""
    if torch._C._current_graph_task_id() != -1:
        raise RuntimeError(_UPDATE_INSIDE_BACKWARD_MESSAGE)


@torch.library.custom_op("dro_ext::refuse_update_inside_backward_", mutates_args=("log_q",))
def _refuse_update_inside_backward(log_q: torch.Tensor) -> None:
    """GroupDROLoss's refusal of an updating forward inside a backward pass, as an op of the graphs torch.compile
    makes of its composed update (the greedy CVaR mode, the fallback; the native step checks itself). Its Python
    check runs once, while the graph is traced; and a checkpoint region that torch.compile traces has its ops
    recomputed in the backward pass from the state as the forward left it, updated: the loss's gradient would then
    weigh the groups by q after a second step, silently. The op runs again with that recomputation, and refuses.
    It declares log_q updated (and leaves it alone) so that the step's reads of the state come after it."""
    _refuse_inside_backward()


@_refuse_update_inside_backward.register_fake
def _(log_q: torch.Tensor) -> None:
    return None


if _backend.native_available():

    @torch.library.register_fake("dro_ext::group_dro_step_")
    def _group_dro_step_fake(sums: torch.Tensor, counts: torch.Tensor, log_q: torch.Tensor, ema_loss: torch.Tensor,
                             last_loss: torch.Tensor, seen: torch.Tensor, active: torch.Tensor,
                             adjustment: torch.Tensor, step_size: float, ema_gamma: float, stale: bool,
                             normalize_loss: bool, update: bool, *, out_dtype: torch.dtype | None = None
                             ) -> tuple[torch.Tensor, torch.Tensor]:
        _check_state_device(sums, (counts, log_q, ema_loss, last_loss, seen, active, adjustment))
        dtype = torch.promote_types(sums.dtype, log_q.dtype) if out_dtype is None else out_dtype
        if dtype not in (torch.float32, torch.float64):
            raise TypeError(f"dro_ext: out_dtype must be float32 or float64, got {dtype}")
        return sums.new_empty((), dtype=dtype), sums.new_empty(sums.shape, dtype=dtype)

    @torch.library.register_fake("dro_ext::group_dro_loss_")
    def _group_dro_loss_fake(losses: torch.Tensor, groups: torch.Tensor, num_groups: int, log_q: torch.Tensor,
                             ema_loss: torch.Tensor, last_loss: torch.Tensor, seen: torch.Tensor,
                             active: torch.Tensor, adjustment: torch.Tensor, step_size: float, ema_gamma: float,
                             stale: bool, normalize_loss: bool, update: bool, validate: bool) -> torch.Tensor:
        _backend.check_fake_devices("losses", losses, groups=groups)
        _check_state_device(losses, (log_q, ema_loss, last_loss, seen, active, adjustment))
        return losses.new_empty(())

    def _check_state_device(operand: torch.Tensor, others: tuple[torch.Tensor, ...]) -> None:
        _backend.check_fake_operands_on(operand.device, others, _STATE_DEVICE_MESSAGE)

    # Looked up once: resolving an overload costs a few hundred ns per call.
    _group_dro_step_op = torch.ops.dro_ext.group_dro_step_.default
    _group_dro_loss_op = torch.ops.dro_ext.group_dro_loss_.default


def _ids_checked_by_the_op(groups: torch.Tensor, num_groups: int) -> bool:
    """The validate argument of an op that reduces by ``groups``, without a host sync on a device: there the ids are
    checked here by an asynchronous device-side assertion (a bad id fails at the next sync, as a RuntimeError) and
    the op runs with validate=False; on the CPU, where reading the ids costs no sync, the op checks them
    (IndexError naming groups)."""
    if groups.device.type == "cpu" and not torch.compiler.is_compiling():
        return True
    _check_group_ids(groups, num_groups)
    return False


def _group_sums(losses: torch.Tensor, groups: torch.Tensor, num_groups: int,
                wide: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """(sums, counts) per group through :func:`dro_ext.group_sums`, the ids checked as _ids_checked_by_the_op says.
    With _masked_group_sums and GroupDROLoss's native step, the only places this module reduces the losses.

    ``wide``: in float64 whatever the losses' dtype (group_reduction.wide_group_sums), as the objectives over groups
    take them, and GroupDROLoss's steps)."""
    sums_of = wide_group_sums if wide else group_sums
    try:
        return sums_of(losses, groups, num_groups, validate=_ids_checked_by_the_op(groups, num_groups))
    except IndexError:
        # group_sums' own error suggests validate=False, which none of the functions reducing through here takes.
        raise IndexError(_bad_ids_message(num_groups)) from None


def _bad_ids_message(num_groups: int) -> str:
    return f"dro_ext: groups holds an id outside [0, num_groups) with num_groups={num_groups}"


def _masked_group_sums(losses: torch.Tensor, groups: torch.Tensor, num_groups: int,
                       mask: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """_group_sums(wide=True) over the samples where ``mask`` is True (all of them for ``mask=None``): the others
    count in neither sum nor count and their ids are not read (a padding token's id may be anything). They get the
    id -1, which group_sums(validate=False) drops (no boolean indexing: no data-dependent shape, no host sync), so
    their losses get a zero gradient; the kept ids are checked as _group_sums checks them. Float64 sums, as every
    caller takes them (the objectives over groups, the grouped cross-entropies, GroupDROLoss's steps)."""
    if mask is None:
        return _group_sums(losses, groups, num_groups, wide=True)
    _check_group_ids(torch.where(mask, groups, 0), num_groups)
    return wide_group_sums(losses, torch.where(mask, groups, -1), num_groups, validate=False)


def _check_group_ids(groups: torch.Tensor, num_groups: int) -> None:
    """Ids in [0, num_groups): IndexError naming groups on the CPU (a host read of a CPU tensor costs no sync), an
    asynchronous device-side assertion elsewhere and while compiling (no host sync; it fails at the next sync)."""
    message = _bad_ids_message(num_groups)
    if groups.device.type == "cpu" and not torch.compiler.is_compiling():
        if groups.numel() and (int(groups.min()) < 0 or int(groups.max()) >= num_groups):
            raise IndexError(message)
    else:
        torch._assert_async(((groups >= 0) & (groups < num_groups)).all(), message)


# ---------------------------------------------------------------------------------------------------
# Argument checks
# ---------------------------------------------------------------------------------------------------


def check_mask(mask: object, losses: torch.Tensor) -> None:
    if not isinstance(mask, torch.Tensor):
        raise TypeError(f"dro_ext: mask must be a torch.Tensor of bools, got {type(mask).__name__}")
    check_dense("mask", mask)
    if mask.dtype != torch.bool:
        raise TypeError(f"dro_ext: mask must be a bool tensor (True for the samples that count), got {mask.dtype}")
    if mask.shape != losses.shape or mask.device != losses.device:
        raise ValueError(f"dro_ext: mask must have the shape and device of losses, {tuple(losses.shape)} on "
                         f"{losses.device}, got {tuple(mask.shape)} on {mask.device}")


def _real_tensor(name: str, value: torch.Tensor) -> torch.Tensor:
    """A dense tensor of real numbers (floating or integer), as float64."""
    check_dense(name, value)
    if not (value.is_floating_point() or value.dtype in (torch.int64, torch.int32, torch.int16, torch.uint8)):
        raise TypeError(f"dro_ext: {name} must be a real tensor, got {value.dtype}")
    return value.detach().to(torch.float64)


def check_group_vector(name: str, value: Any, num_groups: int, *, positive: bool) -> torch.Tensor:
    """A (num_groups,) tensor of finite numbers, > 0 (positive) or >= 0 with a positive sum, as float64.

    Its values are read on the host (a check at construction; for a device tensor, one sync). A sequence's are checked
    as Python numbers, before the tensor is made: torch.compile traces that without a data-dependent branch."""
    if isinstance(value, torch.Tensor):
        tensor = _real_tensor(name, value)
        if tensor.shape != (num_groups,):
            raise ValueError(f"dro_ext: {name} must have shape ({num_groups},) (one entry per group), "
                             f"got {tuple(tensor.shape)}")
        values = tensor.cpu().tolist()
    else:
        try:
            values = [real_number(name, v) for v in value]
        except TypeError as exc:
            raise TypeError(f"dro_ext: {name} must be a tensor or a sequence of {num_groups} numbers "
                            f"({exc})") from None
        if len(values) != num_groups:
            raise ValueError(f"dro_ext: {name} must have shape ({num_groups},) (one entry per group), "
                             f"got ({len(values)},)")
        tensor = torch.tensor(values, dtype=torch.float64, device="cpu")
    if not all(math.isfinite(v) for v in values):
        raise ValueError(f"dro_ext: {name} must be finite, got {name}={values}")
    if positive and not all(v > 0 for v in values):
        raise ValueError(f"dro_ext: {name} must be > 0 for every group, got {name}={values}")
    # (some value > 0, not a sum > 0: a sum of finite weights may overflow, and math.fsum raised OverflowError)
    if not positive and (not all(v >= 0 for v in values) or not any(v > 0 for v in values)):
        raise ValueError(f"dro_ext: {name} must be >= 0 with a positive sum, got {name}={values}")
    return tensor


_WEIGHTINGS = ("batch", "population")


def _group_weights(weighting: str | torch.Tensor | Sequence[float], group_counts: Any, num_groups: int,
                   device: torch.device | str) -> torch.Tensor | None:
    """The unnormalized group weights: None for "batch" (the counts n_g), else a float64 (G,) tensor on device.
    Given weights may be a tensor or a sequence of numbers (a list, a tuple, a numpy array), as group_counts."""
    if not isinstance(weighting, str):
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
        raise ValueError(f"dro_ext: weighting must be 'batch', 'population' or {num_groups} group weights (a "
                         f"tensor or a sequence), got {weighting!r}")
    return weights.to(device)


def _weight_tensor(name: str, value: Any, num_groups: int) -> torch.Tensor:
    # Per call: a CPU tensor or a sequence is checked in full (no device sync); a device tensor by dtype and shape
    # only, its values being the caller's (a negative weight then gives a meaningless value, a zero sum NaN), and so
    # is any tensor while torch.compile traces (reading its values would break the graph: DROLoss(num_groups=G)
    # passes the weights it checked at construction).
    positive = name == "group_counts"  # (counts > 0; weights >= 0 with a positive sum)
    if isinstance(value, torch.Tensor) and (value.device.type != "cpu" or torch.compiler.is_compiling()):
        tensor = _real_tensor(name, value)
        if tensor.shape != (num_groups,):
            raise ValueError(f"dro_ext: {name} must have shape ({num_groups},) (one entry per group), "
                             f"got {tuple(tensor.shape)}")
        if torch.compiler.is_compiling():
            # An assertion in the graph stands in for the host check (eager refuses these values with a ValueError).
            valid = torch.isfinite(tensor).all() & ((tensor > 0).all() if positive
                                                    else (tensor >= 0).all() & (tensor.sum() > 0))
            torch._assert_async(valid, f"dro_ext: {name} must be finite and "
                                       f"{'> 0 for every group' if positive else '>= 0 with a positive sum'}")
        return tensor
    return check_group_vector(name, value, num_groups, positive=positive)


# ---------------------------------------------------------------------------------------------------
# Group means, on one process or over the ranks of a process group
# ---------------------------------------------------------------------------------------------------


class _GlobalValueLocalGradient(torch.autograd.Function):
    """Forward: ``global_value``; backward: ``factor`` times the gradient, to ``local`` (a tensor of its shape)."""

    @staticmethod
    def forward(global_value: torch.Tensor, local: torch.Tensor, factor: float) -> torch.Tensor:
        return global_value.clone()

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: torch.Tensor) -> None:
        ctx.factor = inputs[2]

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[None, torch.Tensor, None]:
        return None, grad * ctx.factor, None


def _reduced_group_sums(losses: torch.Tensor, groups: torch.Tensor, num_groups: int,
                        process_group: ProcessGroup | None, where: str,
                        mask: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(sums, counts) of the batch, or, with a process group, of the concatenated batch of its ranks: float64 sums
    and counts whatever the losses' dtype, as _masked_group_sums forms them.

    Over ranks, (sums, counts) are all-reduced together (one collective of 2G + 3 numbers: num_groups and two counts
    below) so every rank holds the same values; the sums' gradient goes to the local samples times the world size,
    which DDP's averaging of the gradients over the ranks divides out again: the averaged gradient is the one of the
    concatenated batch. The collective is in float64 whatever each rank's dtype (an empty rank's torch.empty(0) is
    float32 beside another's float64: gloo aborted the process on the differing sizes), and so are the sums it
    returns."""
    if process_group is None:
        return _masked_group_sums(losses, groups, num_groups, mask)
    # An id out of range on one rank only must raise on every rank, after the collective: raised before it, it left
    # the other ranks waiting there, or pairing their collective with its next one. On the CPU (a host read of the
    # ids costs no sync) the bad ids among the kept samples are counted and dropped, and the count travels with the
    # sums; on a device the asynchronous assertion of _check_group_ids stands (no host sync; a bad id fails its rank
    # at the next sync).
    counted = groups.device.type == "cpu" and not torch.compiler.is_compiling()
    if counted:
        keep = (groups >= 0) & (groups < num_groups)
        bad = (~keep if mask is None else mask & ~keep).sum().to(torch.float64)
        if mask is not None:
            keep = keep & mask
        sums, counts = wide_group_sums(losses, torch.where(keep, groups, -1), num_groups, validate=False)
    else:
        sums, counts = _masked_group_sums(losses, groups, num_groups, mask)
        bad = torch.zeros((), dtype=torch.float64, device=losses.device)
    refused = torch.zeros((), dtype=torch.float64, device=losses.device)  # inputs passed (_refuse_on_every_rank: 1)
    both = _all_reduce_group_sums([sums.detach().to(torch.float64), counts.to(torch.float64),
                                   torch.stack([bad, refused])], num_groups, process_group, where)
    if counted and bool(both[2 * num_groups] > 0):
        raise IndexError(f"{_bad_ids_message(num_groups)} (on {int(both[2 * num_groups])} samples of the ranks of "
                         f"the process group)")
    world = float(torch.distributed.get_world_size(process_group))
    # Sums and counts stay float64, whatever this rank's dtype: rounded to it, an empty rank's float32 torch.empty(0)
    # beside float64 losses updated GroupDROLoss's q from other sums than the other ranks' (their q then apart for
    # good).
    return _GlobalValueLocalGradient.apply(both[:num_groups], sums, world), both[num_groups:2 * num_groups]


def _all_reduce_group_sums(parts: list[torch.Tensor], num_groups: int, process_group: ProcessGroup,
                           where: str) -> torch.Tensor:
    """The all-reduce of _reduced_group_sums' vector [sums, counts, bad ids, refused ranks] (float64, 2G + 2, given as
    its parts, which are concatenated once here), back on the parts' device. Where a rank refused its inputs
    (_refuse_on_every_rank) a rank on the CPU raises (the count is read without a sync); on a device the refusing
    rank's NaN sums make every rank's result NaN instead.

    The vector travels behind one more number, num_groups, whose sum over the ranks must be the world size times this
    rank's: ranks given different num_groups all-reduce vectors of different lengths, which gloo let the ranks of the
    shorter one finish, each reading a mix of the others' sums and counts (silently wrong values and q), while the
    others failed. A mismatch raises on the CPU (no sync) and fails an asynchronous assertion on a device."""
    from dro_ext.distributed import _collective_device, another_rank_refused, check_group, functional_all_reduce

    check_group(process_group, where)
    local = parts[0].device
    device = _collective_device(process_group, local)
    vector = torch.cat([torch.full((1,), float(num_groups), dtype=torch.float64, device=local), *parts])
    reduced = functional_all_reduce(vector.to(device), process_group, where).to(local)
    expected = float(num_groups * torch.distributed.get_world_size(process_group))

    def mismatch() -> str:
        return (f"dro_ext.{where}: num_groups differs between the ranks of the process group (this rank's is "
                f"{num_groups}); pass the same num_groups on every rank")

    if reduced.device.type == "cpu" and not torch.compiler.is_compiling():
        if float(reduced[0]) != expected:
            raise ValueError(mismatch())
        if bool(reduced[2 * num_groups + 2] > 0):
            raise another_rank_refused(where)
    else:
        torch._assert_async(reduced[0] == expected, mismatch())
    return reduced[1:]


def _refuse_on_every_rank(error: Exception, num_groups: int, process_group: ProcessGroup | None, where: str,
                          device: torch.device) -> NoReturn:
    """Raises ``error`` (this rank's inputs refused) after joining the all-reduce that the other ranks of the process
    group make in _reduced_group_sums, so that they raise too instead of waiting for this rank (or pairing their
    collective with its next one): this rank contributes NaN sums and one refusal."""
    if process_group is not None:  # (num_groups was checked by every caller before its inputs)
        parts = [torch.full((num_groups,), torch.nan, dtype=torch.float64, device=device),
                 torch.zeros(num_groups + 1, dtype=torch.float64, device=device),
                 torch.ones(1, dtype=torch.float64, device=device)]
        try:
            _all_reduce_group_sums(parts, num_groups, process_group, where)
        except ValueError:
            pass  # the other ranks' view of this refusal: this rank raises its own error below
    try:
        raise error
    finally:
        # The traceback holds this frame: its reference to the error would make a cycle, which kept the caller's
        # frames (the losses and their whole graph) alive until the garbage collector ran.
        del error


def _group_means(sums: torch.Tensor, counts: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """(m, present): the mean loss of each group in dtype (0 for an absent group) and which groups are present. The
    mean is formed in the wider of the sums' dtype and dtype and rounded once: float64 sums past a float32 dtype's
    range still give the finite float32 mean of finite losses."""
    present = counts > 0
    wide = torch.promote_types(sums.dtype, dtype)
    return (sums.to(wide) / torch.clamp(counts, min=1.0).to(wide)).to(dtype), present


# ---------------------------------------------------------------------------------------------------
# The penalized objective over groups
# ---------------------------------------------------------------------------------------------------


def group_dro_loss(losses: torch.Tensor, groups: torch.Tensor, num_groups: int, eta: torch.Tensor | float,
                   lam: float, divergence: Divergence = "chi2", *,
                   weighting: str | torch.Tensor | Sequence[float] = "batch", group_counts: Any = None,
                   alpha: float | None = None, k: float | None = None, scale: float = 1.0,
                   group: ProcessGroup | None = None, mask: torch.Tensor | None = None) -> torch.Tensor:
    """The penalized DRO objective over groups (a 0-d tensor of the dtype of ``losses``):

        scale*eta + sum_g p_g lam psi*((m_g - scale*eta)/lam),   m_g = mean of the losses of group g

    over the groups present in the batch, ``p`` renormalized over them: ``weighting="batch"`` takes ``p_g``
    proportional to the batch count ``n_g``, ``"population"`` to ``group_counts[g]`` (required then, every count
    > 0), and ``num_groups`` weights (>= 0; a tensor or a sequence) to those weights (a group of weight 0 counts as
    absent; a NaN mean there still makes the value NaN). ``divergence``, ``lam``, ``alpha``, ``k``
    and ``scale`` are those of :func:`dro_ext.dro_loss`, which this equals when every group holds one sample
    (batch weighting). ``groups`` is an int64 or int32 tensor of ids in ``[0, num_groups)``, one per loss.
    Gradients flow to ``losses`` (``p_g psi*'(t_g) / n_g`` for each sample of group g) and to ``eta``.

    ``group`` (a process group): the objective of the concatenated batch of its ranks, the same value on every
    rank; the per-group sums and counts are all-reduced once, and the gradients of the local losses are scaled
    so that DDP's average over the ranks is the gradient of that objective. A rank may then hold no losses.

    ``mask`` (a bool tensor of the losses' shape), as :class:`GroupDROLoss` takes it: only the True samples count,
    in sums and counts, and only their ids are read (padding tokens), without the boolean indexing that would read
    the mask on the host; the others get a zero gradient.

    Where no group counts (an all-False mask; with ``group``, no sample on any rank; weights of 0 on every group
    present) the value is 0 with zero gradients, as :class:`GroupDROLoss` and the fused cross-entropy give for a
    batch of padding alone: a micro-batch of it then adds nothing to an accumulated gradient.
    """
    return _group_dro_objective(losses, groups, num_groups, eta, lam, divergence, weighting=weighting,
                                group_counts=group_counts, alpha=alpha, k=k, scale=scale, group=group, mask=mask,
                                where="group_dro_loss")


def _group_dro_objective(losses: torch.Tensor, groups: torch.Tensor, num_groups: int, eta: torch.Tensor | float,
                         lam: float, divergence: Divergence, *, weighting: str | torch.Tensor | Sequence[float],
                         group_counts: Any, alpha: float | None, k: float | None, scale: float,
                         group: ProcessGroup | None, mask: torch.Tensor | None, where: str) -> torch.Tensor:
    """:func:`group_dro_loss`, its errors naming ``where``, the public call (``DROLoss`` over groups is this too: a
    refusal on another rank then names the call every rank made)."""
    num_groups = check_num_groups(num_groups)  # (the length of the collective a refusal joins)
    try:
        spec = check_divergence(divergence, alpha, k)
        lam, scale = check_lam(lam), check_positive("scale", scale)
        # a rank may hold no samples (with group); the concatenated batch must hold some
        check_losses(losses, allow_empty=group is not None)
        check_groups(groups, losses)
        if mask is not None:
            check_mask(mask, losses)
        eta = as_eta(eta, losses)
        weights = _group_weights(weighting, group_counts, num_groups, losses.device)
    except Exception as error:
        # Every check, the settings' too, whatever it raises (an OverflowError for lam=10**400): a rank that raised
        # before the collective left the others waiting in it, or pairing it with that rank's next call (the sums of
        # another batch, silently).
        _refuse_on_every_rank(error, num_groups, group, where, input_device(losses, groups))
    # Float64 group sums (where the device has float64) for any losses: float32 ones overflowed to +inf where a
    # group's finite losses summed past 3.4e38, and a mean rounded to float32 moved t by its rounding over lam.
    sums, counts = _reduced_group_sums(losses, groups, num_groups, group, where, mask)
    acc = fallback_dtype(losses.dtype, losses.device)
    m, present = _group_means(sums, counts, acc)
    p = counts.to(acc) if weights is None else relative_weights(torch.where(present, weights.to(acc), 0.0))
    return _penalized_group_objective(m, present, p, scale * eta.to(acc), lam, spec).to(losses.dtype)


def _counted_groups(present: torch.Tensor, p: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    """The groups that enter the objective over groups (penalized or exact): those present with a weight p_g != 0. A
    group of weight 0 counts as absent: at its own mean, 0 * psi*(t) (or 0 * psi*'(t)) is NaN where that overflows, at
    a mean far above the others'. A NaN mean counts whatever its weight: it makes the value NaN, as any NaN loss
    does (NaN is never dropped)."""
    return present & ((p != 0) | torch.isnan(m))


def _penalized_group_objective(m: torch.Tensor, present: torch.Tensor, p: torch.Tensor, g_eta: torch.Tensor,
                               lam: float, spec: Spec) -> torch.Tensor:
    """sum_g p_g (lam psi*(t_g) + G eta) / sum_g p_g over the groups present, t_g = (m_g - G eta)/lam: the value of
    the objective over groups (the one place it is formed, for group_dro_loss and the grouped cross-entropy of
    dro_ext/cross_entropy_groups.py). 0 with zero gradients where no group counts (an all-False mask, a batch of
    padding tokens, a weight of 0 on every group present), as GroupDROLoss and dro_cross_entropy give for an
    empty batch: every p_g of the weighted sum is then 0, and a denominator of 1 keeps it at 0 instead of 0/0 (a
    NaN mean still makes it NaN)."""
    # A group that does not count is evaluated at m = scale*eta (t = 0, finite whatever eta), then weighted by
    # exactly 0: its term adds nothing to the value and a zero gradient.
    g_eta = fixed_order_broadcast(g_eta, m.shape)  # eta's gradient: a fixed-order sum over the groups
    x = torch.where(_counted_groups(present, p, m), m, g_eta)
    terms = penalized_value(x, (x - g_eta) / lam, lam, g_eta, spec)
    p = torch.where(present, p, 0.0)
    # Sums in group order, as dro_loss sums in sample order: with one sample per group (ids in sample order) the
    # two are the same sums, term for term.
    weighted_sum, total = fixed_order_sum(p * terms), fixed_order_sum(p)
    return weighted_sum / torch.where(total > 0, total, 1.0)


# ---------------------------------------------------------------------------------------------------
# Online Group DRO
# ---------------------------------------------------------------------------------------------------

_MODES = ("eg", "greedy_cvar")
_MISSING = ("zero", "stale")


def _fraction(name: str, value: object, *, low_open: bool) -> float:
    value = real_number(name, value)
    inside = (0.0 < value <= 1.0) if low_open else (0.0 <= value <= 1.0)
    if not inside:
        raise ValueError(f"dro_ext: {name} must be in {'(0, 1]' if low_open else '[0, 1]'}, got {name}={value}")
    return value


def _choice(name: str, value: object, choices: tuple[str, ...]) -> str:
    if value not in choices:
        raise ValueError(f"dro_ext: {name} must be {' or '.join(map(repr, choices))}, got {name}={value!r}")
    return value


def _flag(name: str, value: object) -> bool:
    if not isinstance(value, bool):
        raise TypeError(f"dro_ext: {name} must be a bool, got {value!r}")
    return value


# GroupDROLoss's settings, each with the rule of its value alone; _check_setting_combination holds the rules that
# tie them together. Both run where a setting is set, in the constructor or later (module.step_size = ...), never per
# step.
_SETTING_RULES: dict[str, Callable[[Any], Any]] = {
    "mode": lambda value: _choice("mode", value, _MODES),
    "missing": lambda value: _choice("missing", value, _MISSING),
    "normalize_loss": lambda value: _flag("normalize_loss", value),
    "step_size": lambda value: check_positive("step_size", value),
    "ema_gamma": lambda value: _fraction("ema_gamma", value, low_open=True),
    "min_var_weight": lambda value: _fraction("min_var_weight", value, low_open=False),
    "alpha": lambda value: None if value is None else check_positive("alpha", value),
}


_COMBINED_SETTINGS = ("mode", "alpha", "normalize_loss", "min_var_weight")
# Fixed at construction: the state's shape, and the mode (which the other settings are checked against: switching
# it would need two of them set at once).
_FIXED_SETTINGS = ("num_groups", "mode")


def _check_setting_combination(mode: str, alpha: object, normalize_loss: bool, min_var_weight: float) -> None:
    if mode == "greedy_cvar":
        if alpha is None:
            raise ValueError("dro_ext: mode='greedy_cvar' needs alpha > 0 (the CVaR level), got alpha=None")
        if normalize_loss:
            raise ValueError("dro_ext: normalize_loss applies to mode='eg' only; pass normalize_loss=False")
    else:
        if alpha is not None:
            raise ValueError(f"dro_ext: alpha is used by mode='greedy_cvar' only, got alpha={alpha!r}; "
                             f"pass alpha=None")
        if min_var_weight != 0.0:
            raise ValueError("dro_ext: min_var_weight is used by mode='greedy_cvar' only; pass 0")


# The state's floating buffers. They take the accumulate dtype of what the default dtype or a cast asks for: a
# 16-bit log q holds no step of a usual step_size (bfloat16's spacing near log(1/4) is 0.008: every update rounded
# away, q stayed uniform, Group DRO ran as ERM).
_STATE_FLOATS = ("log_q", "ema_loss", "last_loss")


def _greedy_cvar_weights(ranking: torch.Tensor, shares: torch.Tensor, alpha: float) -> torch.Tensor:
    """The worst-case weights of a CVaR at level alpha over groups of the given shares (summing to one), taken
    greedily in decreasing order of `ranking`: each group gets its whole share while the running total stays within
    alpha, the group that crosses alpha the part of its share up to alpha, the rest 0; normalized to sum to one.
    Ties keep the group order (a stable sort), so the result is deterministic. Formed in float64 whatever the state's
    dtype: a float32 alpha - before would be 0 for every group once alpha is below float32's smallest subnormal
    (1.4e-45), and the normalization 0/0."""
    if alpha >= 1.0:  # every group whole: the weights are the shares (no cumulative sum to round)
        return shares
    order = torch.sort(ranking, descending=True, stable=True).indices
    sorted_shares = shares[order].to(torch.float64)
    # The total taken before each group, as the sum of the shares before it (an exclusive cumulative sum): the
    # inclusive sum minus the group's own share cancelled the small shares before a large one (1e-20 + 0.5 - 0.5 is
    # 0), and at alpha = 1e-20 the group after them took alpha again.
    before = torch.cat([sorted_shares.new_zeros(1), torch.cumsum(sorted_shares, 0)[:-1]])
    taken = torch.clamp(torch.minimum(sorted_shares, alpha - before), min=0.0)
    return torch.zeros_like(taken).scatter(0, order, taken / fixed_order_sum(taken)).to(shares.dtype)


class _Float64Configuration(nn.Module):
    """A loss module's configuration tensors (group weights, adjustment terms, population shares in float64, which
    groups are enabled as bool): buffers outside the state_dict that follow the module's device moves and keep their
    values under its dtype casts and its loads, from the checked values kept on the host (module.half() would round
    population counts past 65504 to inf, every weight to 11 bits; to_empty() after a construction on the meta device
    would leave them uninitialized, and load_state_dict(assign=True) would leave them there)."""

    def _configuration_repr(self, name: str) -> str:
        """", name=[...]" of a configuration tensor for extra_repr (its host copy: no device read), "" where it is
        None."""
        return _vector_repr(name, self._configuration[name])

    def _register_configuration(self, name: str, value: torch.Tensor | None) -> None:
        if "_configuration" not in self.__dict__:
            self._configuration: dict[str, torch.Tensor | None] = {}
            # After a load the configuration joins the state's device: load_state_dict(assign=True) into a module
            # built on the meta device replaces the state with the checkpoint's tensors and leaves the rest there.
            self.register_load_state_dict_post_hook(_Float64Configuration._follow_the_state)
        dtype = torch.float64 if value is None or value.is_floating_point() else value.dtype
        self._configuration[name] = None if value is None else value.detach().to("cpu", dtype)
        # On the device the module is built on (a `with torch.device(...)` block), as its state is.
        self.register_buffer(name, None if value is None else value.detach().to(torch.get_default_device(), dtype,
                                                                                copy=True), persistent=False)

    def _restore_configuration(self, device: torch.device | None = None) -> None:
        """Each configuration buffer rewritten from its host value, on ``device`` (by default where it is)."""
        for name, value in self.__dict__.get("_configuration", {}).items():
            buffer = self._buffers.get(name)
            if value is not None and buffer is not None:
                self._buffers[name] = value.to(buffer.device if device is None else device)

    def _apply(self, fn, recurse=True):  # type: ignore[no-untyped-def]  # nn.Module's own signature
        super()._apply(fn, recurse)
        self._restore_configuration()
        return self

    def __deepcopy__(self, memo: dict[int, Any]) -> _Float64Configuration:
        """A copy that shares the process group (``group=``) instead of copying it, as a copy of a DDP model shares
        the group: a process group cannot be copied, so copy.deepcopy(model) (an EMA or best-model snapshot) raised
        where the loss module is part of the model."""
        group = self.__dict__.get("group")
        if group is not None:
            memo.setdefault(id(group), group)
        copied = type(self).__new__(type(self))
        memo[id(self)] = copied
        copied.__dict__.update(copy.deepcopy(self.__dict__, memo))
        return copied

    @staticmethod
    def _follow_the_state(module: _Float64Configuration, incompatible_keys: Any) -> None:
        state = [t for t in module.state_dict(keep_vars=True).values() if isinstance(t, torch.Tensor)]
        if state:
            module._restore_configuration(state[0].device)


class GroupDROLoss(_Float64Configuration):
    """Online Group DRO (Sagawa, Koh, Hashimoto, Liang, ICLR 2020): ``forward(losses, groups)`` returns
    ``sum_g q_g m_g``, with ``m_g`` the mean loss of group g in the batch (0 for a group absent from it) and ``q`` a
    distribution over the ``num_groups`` groups that the module keeps and updates from each batch.

    ``mode="eg"`` (the paper's Algorithm 1): ``q_g <- q_g exp(step_size * a_g) / sum_h q_h exp(step_size * a_h)``,
    computed on ``log q`` (no overflow, whatever the step), with the score ``a_g = m_g + C_g / sqrt(N_g)``:

    - ``adjustment`` C (a number or one per group) with ``group_counts`` N (the population count of each group,
      required then) is the paper's generalization adjustment. It enters the score only: the returned loss
      uses the unadjusted ``m_g``.
    - ``normalize_loss``: ``a`` divided by its sum over every group, disabled ones included (formed as ``(a / G) /
      mean(a)``; left as it is when that mean is 0).
    - ``missing``: what a group absent from the batch scores. ``"zero"`` (the default, as the authors' code,
      WILDS and DomainBed do, so that published settings reproduce): ``m_g = 0``, which lowers its ``q``
      against the groups that are present. ``"stale"`` (DoReMi's rule for an absent domain, not the rest of its
      update: docs/design.md): its last observed mean loss (0 before it was first seen), which keeps ``q`` from
      drifting with batch composition when groups are many and batches small.

    ``mode="greedy_cvar"`` (the paper's CVaR variant): ``q`` is the CVaR at level ``alpha`` (any ``alpha > 0``; at
    ``alpha >= 1`` every group) over the groups ranked by their running mean loss plus ``C_g / sqrt(N_g)``:
    taken greedily, each group weighs its share (``group_counts / sum``, or the batch shares ``n_g / n`` when
    ``group_counts`` is not given) until the running total reaches ``alpha``, the group that crosses it only the
    part up to ``alpha``; normalized to sum to one, then mixed with the shares as in the authors' code:
    ``q = (1 - min_var_weight) q + min_var_weight * shares``. The running mean is an exponential moving average,
    ``ema_g <- (1 - ema_gamma) ema_g + ema_gamma m_g`` over the batches where g is present, started at the first
    such ``m_g``; it is kept in both modes. A batch without samples of an enabled group leaves ``q`` as it was
    (batch shares only).

    ``q_init`` (``num_groups`` numbers >= 0, normalized; uniform by default): the initial ``q``. A group of initial
    weight 0 is disabled: its ``q`` stays exactly 0 in both modes.

    ``mask`` (a bool tensor of the shape of ``losses``, optional): only the samples where it is True count, in
    neither the sums nor the counts otherwise, and their group ids are not read; e.g. the tokens whose target is
    not ``ignore_index``, with the per-token losses of :func:`dro_ext.cross_entropy_losses` or
    :func:`dro_ext.linear_cross_entropy_losses` (the latter never holds the N x V logits).

    ``forward(losses, groups, update=None, *, mask=None)``: with ``update=True`` the state is first updated from the
    batch and the returned loss uses the updated ``q`` (as the references do); ``update=False`` returns the loss
    under the current ``q`` and leaves the state alone. Under gradient accumulation, one micro-batch with
    ``update=True`` and the rest with ``update=False`` move ``q`` once a step on that micro-batch's group means alone:
    not the step of the accumulated batch taken whole, whose update needs every micro-batch's group sums first.
    ``update=None`` (the default) is ``self.training``: a module in ``train()`` mode (as constructed) updates, one
    in ``eval()`` mode does not, as BatchNorm's running statistics (and the authors' evaluation passes) behave.
    ``q`` carries no gradient. An updating forward is refused inside a backward pass: torch.utils.checkpoint
    recomputes its region's forward there, which would update ``q`` twice from one batch: checkpoint the model,
    and call the module on its outputs, outside the region. A compiled module refuses it too: its graph runs the
    test again with the recomputation, whether torch.compile traced the checkpoint (which would otherwise recompute
    the loss's gradient weights from the updated ``q``) or an eager checkpoint runs the compiled module again (but a
    CUDA graph's replay, as ``mode="reduce-overhead"`` makes, runs kernels only: no check). The state lives in
    buffers, so ``state_dict()`` saves it and ``load_state_dict`` resumes the run bitwise: ``log_q``, ``ema_loss``,
    ``last_loss`` (each group's last mean loss) and ``seen`` (which groups have appeared). They are of the default
    dtype at construction (float32 where that is float16 or bfloat16); a cast of the module (``module.half()``,
    ``model.to(torch.bfloat16)``) takes them to float32 at the narrowest, as a 16-bit ``log q`` would round away a
    step of a usual ``step_size``; a step computes in the wider of their dtype and the losses' accumulate dtype.
    A float32 ``log q`` still rounds away a change below half its spacing (about 6e-8 near ``log(1/4)``): with a
    ``step_size`` of 1e-5 and group losses within a few hundredths of each other, ``q`` stays uniform (ERM) where
    float64 moves it; ``module.double()`` keeps such steps. The
    settings (``step_size``, ``missing``, ``normalize_loss``, ``ema_gamma``, greedy_cvar's ``alpha`` and
    ``min_var_weight``, ``group``) may be set on the module later, checked as the constructor checks them;
    ``num_groups`` and ``mode`` are fixed. An empty
    batch is allowed (a rank without samples): it returns 0 and updates the state as a batch where every group is
    absent. A batch in which a present group's mean loss is not finite (an infinite or NaN loss) takes no step:
    the state stays as it was and the loss returned is the one under the current ``q``, infinite or NaN as that mean
    is (never dropped), so a loop that skips the batch (``GradScaler`` skips such a step, and many loops any step of
    a non-finite loss) goes on from where it was; taken into the state, one such batch made ``q`` NaN for good. So
    does an ``"eg"`` batch in which a live group's score, its mean plus its adjustment, passes float64's range
    though both are finite.

    ``group`` (a process group): the per-group sums and counts are all-reduced once per call (one collective of
    ``2 * num_groups + 3`` numbers: with num_groups, checked to agree, and the counts of bad ids and of refusing
    ranks), so every rank updates the same ``q`` from the concatenated batch and returns the same loss, that of the
    concatenated batch; the gradients of the local losses are scaled so that DDP's average over the ranks is the
    gradient of that loss.

    Per step on CUDA nothing is read on the host: no ``.item()``, no data-dependent shapes (ids out of range fail
    through a device-side assertion; :func:`dro_ext.group_sums` runs with ``validate=False``).

    Where the extension is built, an ``"eg"`` step is one native call (the group sums, the update of the state in
    place, the loss and one autograd node; ``group_dro_step_`` over the sums with a mask or a process group). It
    computes in float64 and rounds once into the state, and takes a group's ``q`` as 0 in the loss and its
    gradient (never in ``log_q``) below ``e^-44`` (float32 loss) or ``e^-660`` (float64), where the products would
    be subnormal numbers. Its term ``q m`` still counts where the mean lifts it above that bound (a group that blows
    up in an ``update=False`` evaluation after training had all but dropped it), formed from its logarithm; its
    gradient weight ``q / n`` stays dropped. Its group sums are float64 (a group whose finite float32 losses sum
    past 3.4e38 keeps a finite mean), its loss and gradient weights in the wider of the state's dtype and the
    losses' accumulate dtype (float32 for float32 losses and state). The fallback composes the rest of these rules
    of PyTorch ops over float64 group sums (where the device has float64): the update in float64 rounded once into
    the state, and the loss in the same dtype.
    ``greedy_cvar`` is composed of PyTorch ops on either backend, its sums and update in float64 likewise.
    """

    # The state and configuration buffers (registered in __init__), declared for the type checker: nn.Module's
    # __getattr__ would type them Tensor | Module.
    alpha: float | None
    log_q: torch.Tensor
    ema_loss: torch.Tensor
    last_loss: torch.Tensor
    seen: torch.Tensor
    active: torch.Tensor
    adjustment_term: torch.Tensor
    population_shares: torch.Tensor


    def __init__(self, num_groups: int, step_size: float = 0.01, *, adjustment: float | torch.Tensor | None = None,
                 group_counts: Any = None, normalize_loss: bool = False, missing: str = "zero", q_init: Any = None,
                 mode: str = "eg", alpha: float | None = None, ema_gamma: float = 0.1, min_var_weight: float = 0.0,
                 group: ProcessGroup | None = None) -> None:
        super().__init__()
        self.num_groups = check_num_groups(num_groups)
        # Each checked as it is set (__setattr__), and together as the last of them, alpha, is (the combination's
        # errors before alpha's own: an eg module's alpha=-1 is refused as an alpha at all, not as a negative one).
        self.mode, self.missing, self.normalize_loss = mode, missing, normalize_loss
        self.step_size, self.ema_gamma, self.min_var_weight = step_size, ema_gamma, min_var_weight
        _check_setting_combination(self.mode, alpha, self.normalize_loss, self.min_var_weight)
        self.alpha = alpha
        counts = None if group_counts is None else check_group_vector("group_counts", group_counts, num_groups,
                                                                      positive=True)
        adjust = torch.zeros(num_groups, dtype=torch.float64, device="cpu")
        if adjustment is not None:
            if counts is None:
                raise ValueError("dro_ext: adjustment needs group_counts (the N_g of C_g / sqrt(N_g)), got "
                                 "group_counts=None")
            if isinstance(adjustment, torch.Tensor) or not isinstance(adjustment, numbers.Real):
                c = _finite_vector("adjustment", adjustment, num_groups)
            else:
                c = torch.full((num_groups,), real_number("adjustment", adjustment), dtype=torch.float64,
                               device="cpu")
                if not math.isfinite(float(c[0])):
                    raise ValueError(f"dro_ext: adjustment must be finite, got adjustment={adjustment}")
            adjust = c / counts.sqrt()
            if not bool(torch.isfinite(adjust).all()):  # (a host tensor: no device read)
                raise ValueError(f"dro_ext: adjustment / sqrt(group_counts) must be finite, got "
                                 f"{adjust.tolist()} (adjustment={adjustment}, group_counts={counts.tolist()})")
        q0 = (torch.full((num_groups,), 1.0 / num_groups, dtype=torch.float64, device="cpu") if q_init is None
              else check_group_vector("q_init", q_init, num_groups, positive=False))
        # Through the largest first (relative_weights): q_init of 1e308 each overflowed its sum, and read as q = 0,
        # every group disabled.
        self._q_init = relative_weights(q0)  # host float64, for reset_parameters
        active = self._q_init > 0
        dtype = accumulate_dtype(torch.get_default_dtype())  # (_STATE_FLOATS says why)
        # The state: persistent buffers, saved by state_dict (set by reset_parameters below).
        self.register_buffer("log_q", torch.empty(num_groups, dtype=dtype))
        self.register_buffer("ema_loss", torch.empty(num_groups, dtype=dtype))
        self.register_buffer("last_loss", torch.empty(num_groups, dtype=dtype))
        self.register_buffer("seen", torch.empty(num_groups, dtype=torch.bool))
        # The configuration: buffers (they follow the module to its device) outside the state_dict, in float64 so
        # that a float64 state (module.double()) gets them unrounded, whatever dtype the module is cast to.
        self._register_configuration("active", active)
        self._register_configuration("adjustment_term", adjust)
        shares = None
        if counts is not None:
            shares = relative_weights(torch.where(active, counts, 0.0))  # (counts of 1e308 each: as q_init)
        self._register_configuration("population_shares", shares)
        self.reset_parameters()
        self.group = group  # (checked as it is set: __setattr__)

    def __setattr__(self, name: str, value: Any) -> None:
        # A setting is checked where it is set, by the constructor's rules, and not at every step (whose checks
        # show at a few thousand losses): set later unchecked, a negative step_size turned the ascent on the worst
        # groups into a descent, and missing="Stale" read as "zero" natively and as "stale" in the fallback.
        if name in _FIXED_SETTINGS and name in self.__dict__ and value != self.__dict__[name]:
            raise ValueError(f"dro_ext: GroupDROLoss's {name} is fixed at construction; build another GroupDROLoss "
                             f"(load_state_dict carries q's state over where num_groups is the same)")
        rule = _SETTING_RULES.get(name)
        if rule is not None:
            value = rule(value)
            # (once every one of them is set: in the constructor, the last one's assignment; a module unpickled from
            # before these checks has them all)
            if name in _COMBINED_SETTINGS and all(key in self.__dict__ for key in _COMBINED_SETTINGS):
                settings = {key: self.__dict__[key] for key in _COMBINED_SETTINGS}
                settings[name] = value
                _check_setting_combination(**settings)
        elif name == "group" and value is not None:
            from dro_ext.distributed import check_group

            check_group(value, "GroupDROLoss")
        super().__setattr__(name, value)

    def _apply(self, fn, recurse=True):  # type: ignore[no-untyped-def]  # nn.Module's own signature
        # The state stays float32 or wider under module.half(), .to(torch.bfloat16) and the like (_STATE_FLOATS):
        # the accumulate dtype of the cast's, taken from the state as it was (not through the 16-bit dtype: a
        # float64 state is rounded once, to float32), on the device the cast chose.
        state = {id(self._buffers[name]) for name in _STATE_FLOATS if self._buffers.get(name) is not None}

        def keep_state_wide(t: torch.Tensor) -> torch.Tensor:
            out = fn(t)
            wide = accumulate_dtype(out.dtype)
            if id(t) in state and out.dtype != wide:
                return t.to(device=out.device, dtype=wide)
            return out

        return super()._apply(keep_state_wide, recurse)

    def reset_parameters(self) -> None:
        """The state as constructed: q = q_init (uniform without it), no EMA, no group seen. (As BatchNorm's resets
        its running statistics; also what a construction on the meta device followed by to_empty() needs.)"""
        with torch.no_grad():
            self.log_q.copy_(torch.log(self._q_init))
            self.ema_loss.zero_()
            self.last_loss.zero_()
            self.seen.fill_(False)
            self.active.copy_(self._q_init > 0)

    @property
    def q(self) -> torch.Tensor:
        """The current distribution over the groups (a new tensor; 0 for disabled groups)."""
        return self.log_q.exp()

    def forward(self, losses: torch.Tensor, groups: torch.Tensor, update: bool | None = None, *,
                mask: torch.Tensor | None = None) -> torch.Tensor:
        if update is None:
            # As BatchNorm's running statistics: a module in eval() mode evaluates under the current q and leaves
            # the state alone (an evaluation pass over held-out groups must not train q on them).
            update = self.training
        if update is True and not torch.compiler.is_compiling():
            _refuse_inside_backward()  # (compiled, the graph's ops check: the native step's, or the check op below)
        # A training step's call with plain dense tensors goes straight to the native step (group_sums and the update
        # in one call, csrc/group_dro.cpp), which checks them itself with the same errors as the checks below. (The
        # step is a few microseconds on the CPU at a few thousand losses: every check here shows.)
        one_call = (mask is None and self.group is None and update.__class__ is bool
                    and losses.__class__ is torch.Tensor and groups.__class__ is torch.Tensor
                    and losses.layout is torch.strided and groups.layout is torch.strided and self.mode == "eg"
                    and _backend.native_for_tensor(losses))
        fused = one_call
        if not one_call:  # tensor subclasses, masks, process groups, greedy_cvar, the fallback
            try:
                check_losses(losses, allow_empty=True)
                check_groups(groups, losses)
                _flag("update", update)
                if mask is not None:
                    check_mask(mask, losses)
                if self.log_q.device != losses.device:  # (the composition's first mixed op raised torch's own error)
                    raise ValueError(_STATE_DEVICE_MESSAGE.format(device=self.log_q.device, expected=losses.device))
            except Exception as error:  # (whatever a check raises: see group_dro_loss)
                _refuse_on_every_rank(error, self.num_groups, self.group, "GroupDROLoss", input_device(losses, groups))
            fused = self.mode == "eg" and _backend.native_for(losses.device.type)
            one_call = fused and mask is None and self.group is None
        if one_call:
            validate = _ids_checked_by_the_op(groups, self.num_groups)
            try:
                return _group_dro_loss_op(losses, groups, self.num_groups, *self._native_step_state(update), validate)
            except IndexError:  # (its message offers group_sums' validate=False, which this module does not take)
                raise IndexError(_bad_ids_message(self.num_groups)) from None
        # Float64 sums (where the device has float64), as the native one call takes them: float32 ones overflowed
        # to +inf where a group's finite float32 losses summed past 3.4e38.
        sums, counts = _reduced_group_sums(losses, groups, self.num_groups, self.group, "GroupDROLoss", mask)
        dtype = torch.promote_types(accumulate_dtype(losses.dtype), self.log_q.dtype)
        if fused:
            # The same step as the composition below, over the (masked, all-reduced) sums; its loss and weights in
            # the dtype of the one call's (float64 ones cost the step 7-35%: a float64 loss to round, float32
            # weights that underflow rounded from float64 instead of dropped below e^-44).
            loss, _ = _group_dro_step_op(sums, counts, *self._native_step_state(update), out_dtype=dtype)
            return loss.to(losses.dtype)
        m, present = _group_means(sums, counts, dtype)
        if update:
            if torch.compiler.is_compiling():
                _refuse_update_inside_backward(self.log_q)
            with torch.no_grad():
                # The update in float64 (where the device has it), rounded once into the state, as the native step
                # does: in a float32 state's dtype a step_size past 3.4e38 would act as infinite and send groups to
                # q = 0 for good where float64 keeps them.
                step_dtype = fallback_dtype(self.log_q.dtype, m.device)
                step_m, _ = _group_means(sums.detach(), counts, step_dtype)
                self._update(step_m, present, counts.to(step_dtype))
        q = self.log_q.to(dtype).exp()
        return fixed_order_sum(q * m).to(losses.dtype)

    def _native_step_state(self, update: bool) -> tuple[Any, ...]:
        """The arguments of the native step after the losses or sums: the state, read from the buffer dict (nn.Module's
        __getattr__ would cost a visible share of a small step), and the configuration."""
        buffers = self._buffers
        return (buffers["log_q"], buffers["ema_loss"], buffers["last_loss"], buffers["seen"], buffers["active"],
                buffers["adjustment_term"], self.step_size, self.ema_gamma, self.missing == "stale",
                self.normalize_loss, update)

    def _update(self, m: torch.Tensor, present: torch.Tensor, counts: torch.Tensor) -> None:
        dtype = m.dtype
        seen = self.seen
        ema = self.ema_loss.to(dtype)
        averaged = (1.0 - self.ema_gamma) * ema + self.ema_gamma * m
        ema = torch.where(present, torch.where(seen, averaged, m), ema)
        last = torch.where(present, m, self.last_loss.to(dtype))
        adjust = self.adjustment_term.to(dtype)
        log_q = self.log_q.to(dtype)
        if self.mode == "eg":
            base = m if self.missing == "zero" else last
            score = base + adjust
            live = self.active & (log_q != -math.inf)
            # A score past the dtype's range from finite parts blocks the step (below): a live group's, or with
            # normalize_loss any group's (every score enters the mean that divides them).
            counted = live | self.normalize_loss
            score_overflows = (counted & torch.isfinite(base) & torch.isinf(score)).any()
            if self.normalize_loss:
                # score / sum of scores as (score / G) / their mean (group_dro_step.h's step_score): finite scores
                # can sum past the dtype's range where their mean cannot.
                share = score / score.numel()
                mean = fixed_order_sum(share)
                score = torch.where(mean != 0, share / mean, score)
            # Groups at q = 0 (disabled, or log q = -inf) stay there exactly, whatever their score (infinite or NaN
            # included: a stale group's loaded last mean; a batch with a mean not finite takes no step, below); the
            # live groups' scores less their largest (csrc/group_dro_step.h's log_weight): the same
            # log q, without step_size * score overflowing or absorbing log q. The largest score's product is 0
            # also where step_size itself overflows the dtype (float32 past 3.4e38: inf * 0 would be NaN).
            below_top = torch.where(live, score, -math.inf)
            below_top = below_top - _shift_from_max(below_top)
            step = torch.where(below_top == 0, 0.0, self.step_size * below_top)
            log_q = torch.where(live, log_q + step, -math.inf)
            # x - logsumexp(x) as (x - shift) - log(sum exp(x - shift)) (csrc/group_dro_step.h's normalized_log_q):
            # torch.logsumexp's shift + log-sum would lose the log-sum to a shift past 2^53 of it, and its sum splits
            # between threads past 32768 groups (fixed_order_sum does not).
            log_q = log_q - _shift_from_max(log_q)
            log_q = log_q - torch.log(fixed_order_sum(log_q.exp()))
        else:
            score_overflows = torch.zeros((), dtype=torch.bool, device=m.device)  # greedy CVaR ranks the scores
            if self.population_shares is not None:
                shares = self.population_shares.to(dtype)
                usable = torch.ones((), dtype=torch.bool, device=m.device)
            else:
                shares = torch.where(self.active, counts, 0.0)
                total = fixed_order_sum(shares)
                usable = total > 0
                shares = shares / torch.where(usable, total, 1.0)
            assert self.alpha is not None  # greedy_cvar mode always has one (checked in __init__)
            weights = _greedy_cvar_weights(ema + adjust, shares, self.alpha)
            weights = (1.0 - self.min_var_weight) * weights + self.min_var_weight * shares
            log_q = torch.where(usable, torch.log(weights), log_q)
        # A batch in which a present group's mean is not finite, or past the state dtype's range (which would store
        # it as infinite), takes no step, in either mode, nor one whose score overflows in "eg" mode: the state stays
        # as it was (csrc/group_dro_step.h says why).
        largest_stored = torch.finfo(self.log_q.dtype).max
        step = ~(present & ~((m >= -largest_stored) & (m <= largest_stored))).any() & ~score_overflows
        self.log_q.copy_(torch.where(step, log_q, self.log_q))
        self.ema_loss.copy_(torch.where(step, ema, self.ema_loss))
        self.last_loss.copy_(torch.where(step, last, self.last_loss))
        self.seen.copy_(seen | (present & step))

    def extra_repr(self) -> str:
        # The settings the mode reads, only: greedy_cvar takes no step and scores no missing group.
        if self.mode == "greedy_cvar":
            mode = f"mode={self.mode!r}, alpha={self.alpha}, min_var_weight={self.min_var_weight}"
        else:
            mode = (f"step_size={self.step_size}, mode={self.mode!r}, missing={self.missing!r}, "
                    f"normalize_loss={self.normalize_loss}")
        adjustment = self._configuration["adjustment_term"]
        adjusted = adjustment is not None and bool((adjustment != 0).any())
        uniform = bool((self._q_init == self._q_init[0]).all())
        return (f"num_groups={self.num_groups}, {mode}, ema_gamma={self.ema_gamma}"
                + (self._configuration_repr("adjustment_term") if adjusted else "")
                + self._configuration_repr("population_shares")
                + ("" if uniform else _vector_repr("q_init", self._q_init))
                + ("" if self.group is None else f", group={type(self.group).__name__}"))


_REPR_VALUES = 8  # a configuration vector's values shown in a repr, the rest elided


def _vector_repr(name: str, values: torch.Tensor | None) -> str:
    """", name=[v0, v1, ...]" (at most _REPR_VALUES values, 4 significant digits), "" for None."""
    if values is None:
        return ""
    shown = ", ".join(f"{v:.4g}" for v in values[:_REPR_VALUES].tolist())
    return f", {name}=[{shown}{', ...' if values.numel() > _REPR_VALUES else ''}]"


def _shift_from_max(values: torch.Tensor) -> torch.Tensor:
    """The largest of the values, or 0 where it is infinite or NaN (csrc/group_dro_step.h's shift_from_max; there the
    maxima skip a NaN, here it gives 0: either way the NaN value itself makes the log-sum-exp NaN)."""
    return values.amax().nan_to_num(nan=0.0, posinf=0.0, neginf=0.0)


def _finite_vector(name: str, value: Any, num_groups: int) -> torch.Tensor:
    tensor = (value if isinstance(value, torch.Tensor)
              else torch.tensor([real_number(name, v) for v in value], dtype=torch.float64, device="cpu"))
    tensor = tensor.detach().to("cpu", torch.float64)
    if tensor.shape != (num_groups,):
        raise ValueError(f"dro_ext: {name} must be a number or have shape ({num_groups},), got {tuple(tensor.shape)}")
    if not bool(torch.isfinite(tensor).all()):
        raise ValueError(f"dro_ext: {name} must be finite, got {name}={tensor.tolist()}")
    return tensor
