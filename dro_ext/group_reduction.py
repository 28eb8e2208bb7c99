"""Per-group sums of per-sample losses: the segment reduction group-level DRO (Group DRO, domain reweighting)
is built on. With l_i the loss of sample i, g_i in [0, G) its group and n_g the number of samples of group g:

    sums[g]   = sum_{i : g_i = g} l_i        counts[g] = n_g
    d sums[g] / d l_i = [g_i = g]            so  d l_i = grad_sums[g_i]

A caller's group means are sums / counts.clamp_min(1) (docs/design.md, "Group sums").
"""
from __future__ import annotations

import numbers
from typing import Any, cast

import torch

from dro_ext import _backend
from dro_ext._divergences import accumulate_dtype, check_dense, check_losses, fallback_dtype

__all__ = ["check_groups", "check_num_groups", "gather_by_group", "group_sums"]

_ID_DTYPES = (torch.int32, torch.int64)


# ---------------------------------------------------------------------------------------------------
# Native ops: fake (meta) kernels, for torch.compile. The autograd of both ops is C++ (csrc/group_sums.cpp): each
# op's backward is the other op, so double backward works.
# ---------------------------------------------------------------------------------------------------

if _backend.native_available():

    @torch.library.register_fake("dro_ext::group_sums")
    def _group_sums_fake(losses: torch.Tensor, groups: torch.Tensor, num_groups: int, validate: bool = True, *,
                         wide: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        torch._check(losses.dim() == 1, lambda: "dro_ext: losses must be a 1-D tensor")
        _backend.check_fake_devices("losses", losses, groups=groups)
        out = torch.float64 if wide else accumulate_dtype(losses.dtype)
        return losses.new_empty((num_groups,), dtype=out), losses.new_empty((num_groups,), dtype=out)

    @torch.library.register_fake("dro_ext::group_sums_backward")
    def _group_sums_backward_fake(grad_sums: torch.Tensor, groups: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        _backend.check_fake_devices("grad_sums", grad_sums, groups=groups)
        return groups.new_empty(groups.shape, dtype=dtype)

    # Looked up once: resolving the overload costs a few hundred ns per call.
    _group_sums_op = torch.ops.dro_ext.group_sums.default
    # The gather, the group sums' backward and, in its own backward, their adjoint.
    _group_gather_op = torch.ops.dro_ext.group_sums_backward.default


# ---------------------------------------------------------------------------------------------------
# The PyTorch fallback, which is also the reference semantics of the native op.
# ---------------------------------------------------------------------------------------------------


def _bad_id_message(num_groups: int) -> str:
    return (f"dro_ext: groups holds an id outside [0, num_groups) with num_groups={num_groups}; pass ids in range "
            "(or validate=False to drop them)")


def _fallback_group_sums(losses: torch.Tensor, groups: torch.Tensor, num_groups: int, validate: bool,
                         wide: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """index_add_ over zeros in the accumulation dtype. On the CPU index_add_ into a 1-D tensor adds the samples
    one after another in index order: deterministic, whatever the thread count. On CUDA it adds with float
    atomics, so the sums may differ in their last bits from run to run, unless torch.use_deterministic_algorithms(True)
    is set (PyTorch then takes a sorted, deterministic path for index_add_ on CUDA).

    float32 (and half) losses are added in float64 and the sums rounded once: one after another in float32, a group's
    sum drifts by up to n_g roundings, and systematically where its terms are alike (a gradient of equal weights
    within a group: 9e-4 relative at 2^18 terms a group), as the native op does on the CPU and on CUDA. ``wide``:
    the sums and counts are left in that float64 (fallback_dtype: float32 on MPS, which has no float64)."""
    wider = fallback_dtype(losses.dtype, losses.device)
    out = wider if wide else accumulate_dtype(losses.dtype)
    x = losses.to(wider)
    width = num_groups
    if validate:
        if torch.compiler.is_compiling():
            # A compiled graph cannot branch on the ids: an assertion in the graph checks them (index_add_'s own
            # bounds check took a -1 to the last group under inductor).
            torch._assert_async(((groups >= 0) & (groups < num_groups)).all(), _bad_id_message(num_groups))
        elif groups.device.type != "meta":  # (meta: no values to check)
            # The one host read (a sync on CUDA).
            if bool(((groups < 0) | (groups >= num_groups)).any()):
                raise IndexError(_bad_id_message(num_groups))
        ids = groups
    else:
        # Out-of-range ids are dropped, as the native op drops them: they go to one spare slot past the last
        # group, which is cut off (its samples get no gradient either).
        ids = torch.where((groups >= 0) & (groups < num_groups), groups, num_groups)
        width = num_groups + 1
    sums = torch.zeros(width, dtype=x.dtype, device=losses.device).index_add(0, ids, x).to(out)
    # Counted in int64 (exact at any N) and converted once, as the native op counts.
    ones = torch.ones((), dtype=torch.int64, device=losses.device).expand(ids.shape)
    counts = torch.zeros(width, dtype=torch.int64, device=losses.device).index_add_(0, ids, ones).to(out)
    return sums[:num_groups], counts[:num_groups]


class _FallbackGatherByGroup(torch.autograd.Function):
    """values[groups], whose backward sums the incoming gradient by group with _fallback_group_sums."""

    @staticmethod
    def forward(values: torch.Tensor, groups: torch.Tensor) -> torch.Tensor:
        return values[groups.long()]

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[torch.Tensor, torch.Tensor], output: torch.Tensor) -> None:
        values, groups = inputs
        ctx.save_for_backward(groups)
        ctx.num_groups = values.shape[0]

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        (groups,) = ctx.saved_tensors
        return _fallback_group_sums(grad, groups, ctx.num_groups, validate=False)[0].to(grad.dtype), None


def gather_by_group(values: torch.Tensor, groups: torch.Tensor) -> torch.Tensor:
    """``values[groups]``: each sample's entry of a per-group tensor (G,), for ids already checked to lie in
    ``[0, G)``. Its backward sums the incoming gradient by group in float64 and rounds each sum once (the native
    gather's adjoint, csrc/group_sums.cpp; the fallback's float64 sums), not as indexing's backward does: that adds a
    group's terms one after another in the gradient's dtype, so a float32 gradient alike within each group (each
    sample's share of its group's weight) drifted by 9e-4 relative at N = 2^20 over 4 groups."""
    if _backend.native_for(values.device.type):
        return _group_gather_op(values, groups, values.dtype)
    return _FallbackGatherByGroup.apply(values, groups)


# ---------------------------------------------------------------------------------------------------
# Public API
# ---------------------------------------------------------------------------------------------------


def check_num_groups(num_groups: object) -> int:
    if isinstance(num_groups, bool) or not isinstance(num_groups, (numbers.Integral, torch.SymInt)):
        raise TypeError(f"dro_ext: num_groups must be an int, got {num_groups!r} ({type(num_groups).__name__})")
    if num_groups < 1:
        raise ValueError(f"dro_ext: num_groups must be >= 1, got num_groups={num_groups}")
    # A SymInt while compiling (a traced int, which stands in for one), else a plain int.
    return cast(int, num_groups) if isinstance(num_groups, torch.SymInt) else int(num_groups)


def check_forward_groups(module: str, num_groups: int | None, groups: object, forward: str,
                         mask: object = None) -> None:
    """A loss module's forward arguments against the module's own ``num_groups``: ``groups`` exactly when it was built
    with one (``mask`` only then), each error naming what the module's caller can change (``forward`` shows the call
    that passes groups)."""
    if num_groups is not None and groups is None:
        raise ValueError(f"dro_ext: groups is required: this {module} was built with num_groups={num_groups}; "
                         f"pass forward({forward})")
    if num_groups is None and (groups is not None or mask is not None):
        raise ValueError(f"dro_ext: {'groups' if groups is not None else 'mask'} given, but this {module} was built "
                         f"without num_groups; pass {module}(..., num_groups=G) to take the objective over groups")


def check_groups(groups: object, losses: torch.Tensor) -> None:
    """Group ids for ``losses``: an int32 or int64 dense tensor of its shape, on its device."""
    if not isinstance(groups, torch.Tensor):
        raise TypeError(f"dro_ext: groups must be a torch.Tensor of group ids, got {type(groups).__name__}")
    check_dense("groups", groups)
    if groups.dtype not in _ID_DTYPES:
        raise TypeError(f"dro_ext: groups must be an int32 or int64 tensor of group ids, got {groups.dtype}")
    if groups.shape != losses.shape:
        raise ValueError(f"dro_ext: groups must have the shape of losses, {tuple(losses.shape)}, "
                         f"got {tuple(groups.shape)}")
    if groups.device != losses.device:
        raise ValueError(f"dro_ext: groups is on {groups.device} but losses is on {losses.device}; "
                         "move them to the same device")


def _check_args(losses: torch.Tensor, groups: torch.Tensor, num_groups: object, validate: object) -> int:
    check_losses(losses, allow_empty=True)
    check_groups(groups, losses)
    num_groups = check_num_groups(num_groups)
    if not isinstance(validate, bool):
        raise TypeError(f"dro_ext: validate must be a bool, got {validate!r} ({type(validate).__name__})")
    return num_groups


def group_sums(losses: torch.Tensor, groups: torch.Tensor, num_groups: int, *, validate: bool = True,
               dtype: torch.dtype | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-group sums and counts of per-sample losses: ``(sums, counts)``, each of shape ``(num_groups,)``.

    ``sums[g]`` is the sum of ``losses[i]`` over the samples with ``groups[i] == g`` and ``counts[g]`` their number;
    a group with no sample has sum 0 and count 0, and a NaN loss makes its group's sum NaN. ``losses`` is a 1-D
    floating tensor (any stride, N = 0 included); ``groups`` an int32 or int64 tensor of the same shape and device
    with ids in ``[0, num_groups)``; ``num_groups`` an int >= 1.

    dtypes: float32 and float64 losses give sums in their dtype. float16 and bfloat16 losses are summed in float32
    and give float32 sums: a group's sum outgrows float16's range (65504) at a few thousand samples of loss ~10, and
    bfloat16's 8-bit mantissa stops adding a loss of 1 to a sum past 256, so a sum rounded back to them would be
    wrong where Group DRO needs it (the largest groups). ``counts`` has the dtype of ``sums`` (exact up to 2^24
    samples a group in float32), so that a distributed caller can all-reduce sums and counts together, as 2G
    floats in one collective.

    ``dtype``: the dtype of ``sums`` and ``counts``, as ``torch.sum``'s: ``None`` (the default) or that dtype itself
    for the one above, or ``torch.float64`` for float64 sums of losses of any dtype, as if the losses were cast to
    float64 first but with no copy of them (the sums are added in float64 whatever the dtype, and rounded only into
    a narrower result): float32 sums of finite float32 losses overflow to inf past 3.4e38, and a float32 group mean
    is off by a rounding. Not on MPS, which has no float64. Any other dtype raises ValueError.

    Gradient: ``d losses[i] = grad_sums[groups[i]]`` (``counts`` has none), cast to the losses' dtype, so group means
    ``sums / counts.clamp_min(1)`` give ``d losses[i] = grad_means[g_i] / n_{g_i}``. The backward is a gather,
    itself differentiable (double backward works).

    Deterministic: the sums are formed in a fixed order (fixed chunks and a fixed-order combine, no float atomics),
    bitwise the same run to run and whatever the CPU thread count; one pass over the samples, O(N + G) memory.

    ``validate``: ids outside ``[0, num_groups)`` raise IndexError. On CUDA that costs one host sync (the kernel
    raises a flag on the device; the op reads it once). ``validate=False`` skips the check, and the sync, for
    CUDA-graph capture or a sync-free step: an out-of-range id is then dropped (its sample counts in no group,
    adds to no sum and gets a zero gradient), never written out of bounds.
    """
    return _sums(losses, groups, num_groups, validate, dtype is not None and _wide_for(dtype, losses))


def _wide_for(dtype: object, losses: torch.Tensor) -> bool:
    """Whether group_sums' ``dtype`` asks for float64 sums of these losses (False for their accumulation dtype)."""
    check_losses(losses, allow_empty=True)
    if not isinstance(dtype, torch.dtype):
        raise TypeError(f"dro_ext: dtype must be a torch.dtype or None, got {dtype!r} ({type(dtype).__name__})")
    acc = accumulate_dtype(losses.dtype)
    if dtype == acc:
        return False
    if dtype == torch.float64 and fallback_dtype(losses.dtype, losses.device) == torch.float64:
        return True
    allowed = "None or torch.float64" if acc == torch.float64 else f"None, {acc} or torch.float64"
    where = " (MPS has no float64)" if dtype == torch.float64 else ""
    raise ValueError(f"dro_ext: dtype must be {allowed} for {losses.dtype} losses on {losses.device.type}{where}, "
                     f"got {dtype}")


def _sums(losses: torch.Tensor, groups: torch.Tensor, num_groups: int, validate: bool,
          wide: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """group_sums, ``wide`` for its sums in float64 (where the device has it: fallback_dtype)."""
    if (type(num_groups) is int and num_groups >= 1 and type(validate) is bool and isinstance(losses, torch.Tensor)
            and isinstance(groups, torch.Tensor) and losses.layout == groups.layout == torch.strided
            and losses.device == groups.device and _backend.native_for(losses.device.type)):
        # The op checks the tensors' dtypes and shapes itself, with the same errors; at a few thousand samples
        # checking them here too would be a visible share of the call. (Devices are compared here: a meta tensor
        # beside a CPU one would dispatch to the fake kernel, which checks nothing.)
        return _group_sums_op(losses, groups, num_groups, validate, wide=wide)
    num_groups = _check_args(losses, groups, num_groups, validate)
    if _backend.native_for(losses.device.type):
        return _group_sums_op(losses, groups, num_groups, validate, wide=wide)
    return _fallback_group_sums(losses, groups, num_groups, validate, wide)


def wide_group_sums(losses: torch.Tensor, groups: torch.Tensor, num_groups: int, *,
                    validate: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`group_sums` with sums and counts in float64 whatever the losses' dtype (where the device has float64:
    fallback_dtype; float32 on MPS), for the objectives over groups: float32 sums of finite float32 losses overflow
    to +inf past 3.4e38, and a group mean rounded to float32 moves t = (m - G eta)/lam by its rounding over lam. The
    gradient is that of group_sums, d l_i = grad_sums[g_i], cast once to the losses' dtype.

    The op's float64 totals as they are (its kernels add in float64 for every dtype; ``wide`` skips the rounding into
    float32), so no float64 copy of the losses is made and float64 sums cost what float32 ones do."""
    return _sums(losses, groups, num_groups, validate, True)
