"""DROLoss: the penalized DRO objective as an nn.Module that owns its dual variable eta."""
from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING, Literal

import torch
from torch import nn

from dro_ext._divergences import (
    Divergence,
    check_divergence,
    check_losses,
    check_lam,
    check_positive,
    fallback_dtype,
    fixed_order_broadcast,
    real_number,
)
from dro_ext.group_reduction import check_forward_groups
from dro_ext.groups import (
    _Float64Configuration,
    _group_dro_objective,
    _group_weights,
    _refuse_on_every_rank,
    check_mask,
    check_num_groups,
)
from dro_ext.ops import dro_loss

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup


class DROLoss(_Float64Configuration):
    """``forward(losses) = mean_i lam * psi*((l_i - scale*eta)/lam) + scale*eta``.

    ``eta`` is a 0-d ``nn.Parameter``: put the module's parameters in the optimizer beside the model's,
    and minimizing the loss jointly over both minimizes the DRO objective (paper eq. 2.1). ``scale`` is
    the paper's G (Theorem 2.2's rescaling of eta).

    Under ``DistributedDataParallel`` (or FSDP2) ``eta`` is a parameter like any other and its gradient
    is averaged over the ranks; with equal local batch sizes the averaged gradients (model and eta) are
    exactly those of this loss on the concatenated batch. For unequal local batches pass ``group`` (a
    process group, e.g. ``torch.distributed.group.WORLD``): each rank's loss is then multiplied by
    ``world_size * n_local / N`` (N from one all-reduce of two numbers per call, see
    :func:`dro_ext.distributed.batch_scale`), so that the averaged gradients are again those of the
    concatenated batch; the mean over the ranks of the returned values is the loss of that batch.

    With ``num_groups=G`` the objective is over groups instead of samples (:func:`dro_ext.group_dro_loss`):
    ``forward(losses, groups, *, mask=None)`` takes the group id of each loss (and, as :class:`GroupDROLoss`, a
    bool ``mask`` of the samples that count), and ``weighting`` (``"batch"``, ``"population"`` with
    ``group_counts``, or G weights as a tensor or a sequence) weighs the groups present. With ``group`` every rank
    then returns the objective of the concatenated batch (the per-group sums and counts are all-reduced once), its
    local gradients scaled so that DDP's average is that objective's gradient.
    Without ``num_groups``, ``groups`` must not be passed and the module is the per-sample loss above; ``mask`` (a
    bool tensor of the losses' shape: padding tokens out) then makes it that loss over the True samples alone, the
    others getting a zero gradient, with no boolean indexing (no host read on CUDA); with ``group`` the scale is then
    ``world_size * n_kept_local / N_kept``. Where no sample is kept (on every rank, with ``group``) the value is 0
    with zero gradients, as over groups.
    """

    eta: nn.Parameter
    group_weights: torch.Tensor | None  # a buffer, with num_groups only: None for batch weighting

    def __init__(self, divergence: Divergence = "chi2", lam: float = 0.1, *, alpha: float | None = None,
                 k: float | None = None, scale: float = 1.0, eta_init: float = 0.0, group: ProcessGroup | None = None,
                 num_groups: int | None = None,
                 weighting: Literal["batch", "population"] | torch.Tensor | Sequence[float] = "batch",
                 group_counts: torch.Tensor | Sequence[float] | None = None) -> None:
        super().__init__()
        spec = check_divergence(divergence, alpha, k)
        self.divergence, self.alpha, self.k = spec
        self.lam = check_lam(lam)
        self.scale = check_positive("scale", scale)
        self.eta_init = real_number("eta_init", eta_init)
        if not math.isfinite(self.eta_init):
            raise ValueError(f"dro_ext: eta_init must be finite, got eta_init={self.eta_init}")
        self.eta = nn.Parameter(torch.empty(()))
        self.reset_parameters()
        self.group = group
        self.num_groups: int | None = None
        if num_groups is None:
            if not (isinstance(weighting, str) and weighting == "batch") or group_counts is not None:
                raise ValueError("dro_ext: weighting and group_counts weigh groups: pass num_groups as well")
            return
        self.num_groups = check_num_groups(num_groups)
        # Checked here once, and kept outside the state_dict (which stays {"eta"}): None for batch weighting.
        self._register_configuration("group_weights", _group_weights(weighting, group_counts, self.num_groups, "cpu"))

    def reset_parameters(self) -> None:
        """eta = eta_init (what a construction on the meta device followed by to_empty() needs)."""
        with torch.no_grad():
            self.eta.fill_(self.eta_init)

    def forward(self, losses: torch.Tensor, groups: torch.Tensor | None = None, *,
                mask: torch.Tensor | None = None) -> torch.Tensor:
        # What self.eta resolves to, without nn.Module.__getattr__'s search (half a microsecond of a call of a few);
        # under torch.nn.utils.parametrize the parameter dict has no eta, and the attribute serves the parametrized one.
        eta = self._parameters.get("eta")
        if eta is None:
            eta = self.eta
        if self.num_groups is None and groups is None and mask is None and self.group is None:
            return dro_loss(losses, eta, self.lam, self.divergence, alpha=self.alpha, k=self.k, scale=self.scale)
        try:
            check_forward_groups("DROLoss", self.num_groups, groups, "losses, groups")
            if self.num_groups is None:
                check_losses(losses, allow_empty=self.group is not None)  # a rank may hold no samples
                if mask is not None:
                    check_mask(mask, losses)
        except Exception as error:  # (whatever a check raises: see group_dro_loss)
            if self.group is None:
                raise
            # Refused on this rank only, perhaps: raised after the collective the other ranks make (group_dro_loss's
            # reduction, or batch_scale's), which they then raise after too (neither waiting for this rank nor
            # pairing with its next collective).
            if self.num_groups is not None:
                _refuse_on_every_rank(error, self.num_groups, self.group, "DROLoss", eta.device)
            from dro_ext.distributed import batch_scale

            batch_scale(0, self.group, eta.device, refused=True)
            raise
        if self.num_groups is not None:
            assert groups is not None  # given with num_groups (check_forward_groups)
            weighting = "batch" if self.group_weights is None else self.group_weights
            return _group_dro_objective(losses, groups, self.num_groups, eta, self.lam, self.divergence,
                                        weighting=weighting, group_counts=None, alpha=self.alpha, k=self.k,
                                        scale=self.scale, group=self.group, mask=mask, where="DROLoss")
        # Over samples, with a process group or a mask (the plain call returned above).
        if losses.numel() == 0:
            # A rank without samples (only with a group: checked above): its share of the concatenated batch's
            # objective is 0 (batch_scale below is 0), with zero gradients to the losses and to eta (which the graph
            # still reaches, as DDP expects of every parameter); it still takes part in batch_scale's collective,
            # where raising (dro_loss takes no empty batch) would leave the other ranks waiting.
            value = losses.sum() + 0.0 * eta.to(losses.dtype)
        elif mask is not None:
            value = masked_dro_loss(losses, mask, eta, self.lam, self.divergence, self.alpha, self.k, self.scale)
        else:
            value = dro_loss(losses, eta, self.lam, self.divergence, alpha=self.alpha, k=self.k, scale=self.scale)
        if self.group is None:
            return value
        from dro_ext.distributed import batch_scale

        count = losses.shape[0] if mask is None else mask.sum()  # (kept samples: a count on the device)
        return value * batch_scale(count, self.group, losses.device).to(value.dtype)

    def extra_repr(self) -> str:
        params = "".join(f", {n}={v}" for n, v in (("alpha", self.alpha), ("k", self.k)) if v is not None)
        groups = "" if self.num_groups is None else f", num_groups={self.num_groups}"
        if self.num_groups is not None:
            groups += self._configuration_repr("group_weights")
        eta_init = "" if self.eta_init == 0.0 else f", eta_init={self.eta_init}"
        group = "" if self.group is None else f", group={type(self.group).__name__}"
        return f"divergence={self.divergence!r}, lam={self.lam}{params}, scale={self.scale}{eta_init}{groups}{group}"


def masked_dro_loss(losses: torch.Tensor, mask: torch.Tensor, eta: torch.Tensor, lam: float, divergence: Divergence,
                    alpha: float | None, k: float | None, scale: float) -> torch.Tensor:
    """The per-sample objective over the samples where mask is True (DROLoss's mask; the float16 linear
    cross-entropy's kept tokens), from one dro_loss of all of them: a sample left out stands at l = scale*eta, where
    its term lam psi*(0) + scale*eta is scale*eta for every divergence (and, since it moves with eta, its gradient
    to eta cancels out), so that with n samples, n_kept kept,

        value = scale*eta + (dro_loss - scale*eta) * n / n_kept.

    In float64 (where the device has it): the difference cancels the digits of scale*eta. No host read: n_kept
    stays a tensor, and 0 kept gives 0 with zero gradients, an empty batch too (which dro_loss does not take)."""
    acc = fallback_dtype(losses.dtype, losses.device)
    eta_acc = eta.to(acc)
    shift = scale * eta_acc
    # (a fixed-order broadcast: eta's gradient through the samples left out, summed in a fixed order)
    x = torch.where(mask, losses.to(acc), fixed_order_broadcast(shift, losses.shape))
    # (empty: x's sum, 0, keeps the losses in the graph, for their empty gradient)
    full = shift + x.sum() if x.numel() == 0 else dro_loss(x, eta_acc, lam, divergence, alpha=alpha, k=k, scale=scale)
    kept = mask.sum()
    value = shift + (full - shift) * (x.numel() / torch.clamp(kept, min=1).to(acc))
    return torch.where(kept > 0, value, 0.0).to(losses.dtype)
