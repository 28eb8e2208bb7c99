"""dro_ext on torch.distributed: the same answers as one process, without gathering data to one rank.

Three pieces, each reached from the public API by a keyword or by the parameters' type:

- ``DROLoss(..., group=pg)``: the loss of each rank is rescaled by ``world_size * n_local / N`` (``N``
  from one all-reduce of two numbers: the count and a refusal flag), so that the gradients DDP (or FSDP2)
  averages over the ranks are those of the objective on the concatenated batch, whatever the local batch sizes.
  See :func:`batch_scale`.
- ``NormalizedSGD`` on DTensor (FSDP2) parameters: :func:`sharded_normalized_sgd_step` updates the local
  shards and takes the norm of the whole, unsharded momentum from one all-reduce of per-tensor sums of
  squares per param group (on the device: no host sync). Plain tensors (DDP, or ``eta`` beside sharded
  weights) are replicated and counted once; they add no collective.
- ``robust_objective``, ``worst_case_weights``, ``weight_stats`` and ``evaluate`` with ``group=``: each
  rank holds its own losses; every sum, max and count is all-reduced (scalars, or one small vector), never
  the losses themselves, and every rank gets the single-process answer on the concatenated losses.

Every rank must make the same calls with the same arguments (lam, divergence, ...), as with any
collective. Every rank takes the same branches of the solvers because all-reduce results are identical on
every rank. A collective that fails (a rank died, or the process group's timeout passed) raises a
RuntimeError that names the dro_ext function it came from.
"""
from __future__ import annotations

import contextlib
import hashlib
import math
import struct
from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING, Any, Callable, TypeGuard

import torch
import torch.distributed as dist

from dro_ext import _solver
from dro_ext._first_order import first_order_only
from dro_ext._divergences import (
    DIVERGENCES, Divergence, Spec, accumulate_dtype, check_divergence, check_lam, check_losses,
    fixed_order_sum, input_device, wide_number,
)

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import DTensor

    from dro_ext.robust import WeightStats

__all__ = [
    "average_gradients",
    "batch_scale",
    "robust_objective",
    "sharded_normalized_sgd_step",
    "weight_stats",
    "worst_case_weights",
]

# ---------------------------------------------------------------------------------------------------
# Process groups and collectives
# ---------------------------------------------------------------------------------------------------


def check_group(group: object, where: str) -> dist.ProcessGroup:
    """The process group, after checking torch.distributed is initialized (a clear error otherwise)."""
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError(f"dro_ext.{where}: group= needs torch.distributed to be initialized "
                           f"(call torch.distributed.init_process_group first)")
    if not isinstance(group, dist.ProcessGroup):
        raise TypeError(f"dro_ext.{where}: group must be a torch.distributed.ProcessGroup "
                        f"(e.g. torch.distributed.group.WORLD), got {type(group).__name__}")
    return group


def _collective_device(group: dist.ProcessGroup, device: torch.device) -> torch.device:
    # gloo reduces CPU tensors (and CUDA ones through a host copy); NCCL needs CUDA tensors. The small
    # vectors reduced here go where the group's backend wants them.
    backend = str(dist.get_backend(group)).lower()
    if backend == "gloo":
        return torch.device("cpu")
    if backend == "nccl" and device.type == "cpu" and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())  # e.g. losses kept on the host
    return device


def _all_reduce_(tensor: torch.Tensor, op: dist.ReduceOp.RedOpType, group: dist.ProcessGroup,
                 where: str) -> torch.Tensor:
    try:
        dist.all_reduce(tensor, op=op, group=group)
    except RuntimeError as exc:  # DistBackendError and the gloo/NCCL errors derive from RuntimeError
        raise collective_failed(where, exc) from exc
    return tensor


def collective_failed(where: str, exc: RuntimeError) -> RuntimeError:
    """A failed collective's error, naming the dro_ext function it came from."""
    return RuntimeError(f"dro_ext.{where}: an all-reduce over the process group failed (a rank exited, crashed or did "
                        f"not call {where} with the same arguments, or the group's timeout passed): {exc}")


def functional_all_reduce(tensor: torch.Tensor, group: dist.ProcessGroup, where: str) -> torch.Tensor:
    """The sum over the ranks by a functional collective (which torch.compile traces), waited for in eager mode so that
    a failure raises here, naming ``where``, rather than from the first use of the result. (The wait orders the
    current stream after the collective, as that first use would; no host sync.)"""
    from torch.distributed import _functional_collectives as funcol

    if torch.compiler.is_compiling():
        return funcol.all_reduce(tensor, "sum", group)
    try:
        return funcol.wait_tensor(funcol.all_reduce(tensor, "sum", group))
    except RuntimeError as exc:
        raise collective_failed(where, exc) from exc


def another_rank_refused(where: str) -> ValueError:
    """The error of the ranks whose own inputs passed where another rank of the process group refused its own."""
    return ValueError(f"dro_ext.{where}: another rank of the process group refused its inputs (its own error says "
                      f"why); every rank raises, so that none waits in a collective")


# The dtypes whose presence on any rank checked_on_every_rank all-reduces (evaluate's losses).
_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)

# The calls whose checks checked_on_every_rank agrees on, coded in its vector (a rank in another of them than the
# others is a mismatch, caught as one).
_AGREED_CALLS = ("robust_objective", "worst_case_weights", "weight_stats", "evaluate")


class AgreedSettings:
    """What every rank of an evaluation call must pass alike, set inside checked_on_every_rank's ``with`` body once
    checked: the call's lam, divergence (with alpha and k), number of groups (0 over samples), group weights (None
    for the batch counts), and weight_stats' ``over``, ``eta`` and ``scale``. Those that decide which collectives the
    call makes (``num_groups``, ``over``, whether ``eta`` is given) would otherwise make ranks all-reduce vectors of
    different lengths, which gloo either aborts or lets some ranks finish with a mix of the others' numbers; the
    others would give each rank the answer to another problem."""

    def __init__(self) -> None:
        self.set(None, None, None)
        # evaluate's losses: their dtype on this rank (None where its loader held none), and, once agreed, the dtype
        # they all promote to over the ranks (None where no rank held any), which every rank then returns.
        self.dtype: torch.dtype | None = None
        self.promoted_dtype: torch.dtype | None = None

    def set(self, lam: float | None, spec: Spec | None, num_groups: int | None, *,
            weights: torch.Tensor | None = None, over: str = "samples", eta: float | torch.Tensor | None = None,
            scale: float = 1.0) -> None:
        # Kept as given: they are read (eta and the weights on the host) only where a process group compares them,
        # never on one process (no host read of a device tensor there).
        self.lam, self.spec, self.num_groups = lam, spec, num_groups
        self.weights, self.over, self.eta, self.scale = weights, over, eta, scale

    def named(self, where: str) -> list[tuple[str, float]]:
        """The settings as (name, number) pairs, as many whatever they are (the all-reduce's length); a name may
        repeat, over the numbers of one setting."""
        spec = Spec("chi2", None, None) if self.spec is None else self.spec
        eta = 0.0 if self.eta is None else float(self.eta)
        weights = [("weighting", piece) for piece in _weights_digest(self.weights)]
        return [("the call", float(_AGREED_CALLS.index(where))), ("lam", 0.0 if self.lam is None else self.lam),
                ("divergence", float(DIVERGENCES.index(spec.name))),
                ("alpha", -1.0 if spec.alpha is None else spec.alpha), ("k", -1.0 if spec.k is None else spec.k),
                ("num_groups", float(self.num_groups or 0)), *weights,
                ("over", float(self.over == "groups")), ("eta", 0.0 if self.eta is None else 1.0),
                ("eta's value", -math.inf if math.isnan(eta) else eta),  # (NaN never compares equal)
                ("scale", self.scale)]


_DIGEST_PIECES = 8  # SHA-256's 32 bytes as 4-byte integers, each exact in float64


def _weights_digest(weights: torch.Tensor | None) -> list[float]:
    """The group weights as the objective takes them (normalized, in float64) as numbers that compare equal exactly
    where the weights do, up to SHA-256's collisions: any few numbers made from the G weights by sums (two moments,
    once) tell some different weights apart only by chance. Zeros for the batch counts (None)."""
    if weights is None:
        return [0.0] * _DIGEST_PIECES
    p = weights.detach().to(device="cpu", dtype=torch.float64)
    p = (p / fixed_order_sum(p) + 0.0).contiguous()  # (+ 0.0: a weight of -0.0 hashes as 0.0)
    digest = hashlib.sha256(p.numpy().tobytes()).digest()
    return [float(int.from_bytes(digest[4 * i:4 * i + 4], "little")) for i in range(_DIGEST_PIECES)]


@contextlib.contextmanager
def checked_on_every_rank(group: dist.ProcessGroup | None, where: str,
                          device: torch.device) -> Iterator[AgreedSettings]:
    """The checks of an evaluation call over a process group (the ``with`` body, which makes no collective), agreed
    on by every rank before the call's first collective, in one all-reduce (max) of a few numbers:

    - a rank whose checks raise joins it and re-raises its own error; the others raise :func:`another_rank_refused`,
      instead of waiting in the call's collectives for a rank that is not coming (or pairing them with its next
      call's);
    - the settings the body stored in the yielded :class:`AgreedSettings` (lam, the divergence, num_groups, the
      group weights; weight_stats' over, eta and scale), and which of the calls this is, must be the same on every
      rank, or every rank raises ValueError naming those that differ: ranks solving with different lam would reduce
      sums that belong to no one objective, silently, and a different over or num_groups would not pair the
      collectives that follow.

    The evaluation calls branch on all-reduced numbers read on the host anyway, so this read adds nothing of a new
    kind; a training step carries its refusal inside its one collective instead (dro_ext.groups, :func:`batch_scale`),
    where an extra collective and a host read per step would show, and checks no settings. No-op without a group."""
    settings = AgreedSettings()
    if group is None:
        yield settings
        settings.promoted_dtype = settings.dtype
        return
    check_group(group, where)
    reducer = _GroupReducer(group, device, where)
    names = [name for name, _ in settings.named(where)]
    try:
        yield settings
        mine = torch.tensor([number for _, number in settings.named(where)], dtype=torch.float64)
        held = torch.tensor([float(settings.dtype == dtype) for dtype in _FLOAT_DTYPES], dtype=torch.float64)
    except Exception:
        # (max over the ranks: the refusal flag first; the settings of a refusing rank are never compared)
        reducer.max(torch.cat([torch.ones(1), torch.zeros(2 * len(names) + len(_FLOAT_DTYPES))]).to(torch.float64))
        raise
    highest = reducer.max(torch.cat([torch.zeros(1, dtype=torch.float64), mine, -mine, held])).tolist()
    if highest[0] > 0:
        raise another_rank_refused(where)
    for dtype, anywhere in zip(_FLOAT_DTYPES, highest[1 + 2 * len(names):]):
        if anywhere:
            promoted = settings.promoted_dtype
            settings.promoted_dtype = dtype if promoted is None else torch.promote_types(promoted, dtype)
    # Every rank's value equals the maximum and the minimum alike where they agree.
    differ = list(dict.fromkeys(name for i, name in enumerate(names)
                                if highest[1 + i] != -highest[1 + len(names) + i]))
    if differ:
        raise ValueError(f"dro_ext.{where}: the ranks of the process group differ in {', '.join(differ)}; "
                         f"every rank must make the same call with the same lam, divergence (alpha, k), num_groups, "
                         f"weighting (group_counts) and, for weight_stats, over, eta and scale")


class _GroupReducer:
    """The reducer of dro_ext._solver over the ranks of a group: sums and maxima of small float64 vectors are
    all-reduced, and the tail boundary is an exact selection over the losses of every rank (_kth_largest)."""

    def __init__(self, group: dist.ProcessGroup, device: torch.device, where: str) -> None:
        self.group, self.where = group, where
        self.device = _collective_device(group, device)

    def _reduce(self, v: torch.Tensor, op: dist.ReduceOp.RedOpType) -> torch.Tensor:
        """An all-reduced copy of a small tensor, on the tensor's device."""
        out = v.detach().to(self.device, copy=True)
        return _all_reduce_(out, op, self.group, self.where).to(v.device)

    def sum(self, v: torch.Tensor) -> torch.Tensor:
        return self._reduce(v, dist.ReduceOp.SUM)

    def max(self, v: torch.Tensor) -> torch.Tensor:
        return self._reduce(v, dist.ReduceOp.MAX)

    def tail_split(self, x: torch.Tensor, j: int, lo: float, hi: float) -> tuple[float, float, float]:
        eta = _kth_largest(x, j, lo, hi, self)
        above = x > eta
        sum_above, n_above = _solver.totals(self, fixed_order_sum(x[above]), above.sum())
        return eta, sum_above, n_above


# ---------------------------------------------------------------------------------------------------
# DROLoss with unequal local batches
# ---------------------------------------------------------------------------------------------------


def batch_scale(num_local: int | torch.Tensor, group: dist.ProcessGroup, device: torch.device | str, *,
                refused: bool = False) -> torch.Tensor:
    """``world_size * n_local / N`` as a 0-d float64 tensor on ``device``: one all-reduce of two numbers.
    ``num_local`` is an int, or a 0-d tensor (a count of kept samples, on the device).

    The DRO objective of the concatenated batch is the sample-weighted mean of the local objectives,
    ``L = sum_r (n_r/N) L_r`` (the ``scale*eta`` term included, since the weights sum to one), so scaling
    each rank's loss by ``R n_r / N`` makes DDP's (or FSDP2's) average over the R ranks the gradient of
    ``L``, for the model and for ``eta`` alike. With equal local batches the factor is 1; with no sample on any rank
    it is 0 (the loss and its gradients 0, as group_dro_loss gives them; 0/0 before).

    ``refused``: this rank's losses were refused (it raises its own error after this call): it still joins the
    all-reduce, contributing NaN and one refusal, so that the other ranks neither wait for it nor pair their
    collective with its next one. On the CPU they then raise too; on a device (where reading the count would be a
    host sync) their factor, and so their loss, is NaN.

    The all-reduce is a functional collective (``torch.distributed._functional_collectives``), which
    ``torch.compile`` traces; the factor carries no gradient.
    """
    check_group(group, "DROLoss")
    coll_device = _collective_device(group, torch.device(device))
    if isinstance(num_local, torch.Tensor):  # (a count on the device, e.g. of a mask: never read on the host)
        count = torch.stack([num_local.detach().to(coll_device, torch.float64),
                             torch.zeros((), dtype=torch.float64, device=coll_device)])
    else:
        count = torch.tensor([math.nan if refused else float(num_local), float(refused)], dtype=torch.float64,
                             device=coll_device)
    total = functional_all_reduce(count, group, "DROLoss")
    if (not refused and coll_device.type == "cpu" and not torch.compiler.is_compiling()
            and bool(total[1] > 0)):
        raise another_rank_refused("DROLoss")
    world = dist.get_world_size(group)
    # 0 where no rank holds a sample; NaN where a rank refused (a NaN total: `> 0` would have made it 0, a loss of 0
    # with zero gradients on a device, where the ranks that passed do not raise).
    return torch.where(total[0] == 0, 0.0, count[0] * world / total[0]).to(device)


def average_gradients(params: Iterable[torch.Tensor], group: dist.ProcessGroup) -> None:
    """Average the gradients of plain (replicated) parameters over the ranks: one all-reduce in all.

    FSDP2 (``fully_shard``) reduces the gradients of the parameters it manages, but it cannot manage a
    0-d parameter such as ``DROLoss.eta``, which then stays a plain tensor whose gradient is local to
    each rank. Call this after ``backward()`` on those parameters (e.g. ``dro_loss.parameters()``);
    under DDP it is not needed (DDP averages every parameter it wraps). DTensor parameters and
    parameters without a gradient are left alone.
    """
    group = check_group(group, "average_gradients")
    grads = [p.grad for p in params if p.grad is not None and not has_dtensor([p]) and not has_dtensor([p.grad])]
    if not grads:
        return
    flat = torch.cat([g.reshape(-1).to(torch.float64) for g in grads])
    device = flat.device
    flat = _all_reduce_(flat.to(_collective_device(group, device)), dist.ReduceOp.SUM, group, "average_gradients")
    flat = flat.to(device) / dist.get_world_size(group)
    offset = 0
    for g in grads:
        g.copy_(flat[offset:offset + g.numel()].view_as(g))
        offset += g.numel()


# ---------------------------------------------------------------------------------------------------
# The robust objective over the losses of every rank
# ---------------------------------------------------------------------------------------------------

# Thresholds per round of the distributed selection: the count vector of one round is one all-reduce,
# and each round narrows the search over the 2^64 float64 bit patterns by this factor (8 rounds at most).
_SELECTION_FANOUT = 255


def _ordered_keys(x: torch.Tensor) -> torch.Tensor:
    """int64 keys in the order of the float64 values (-0.0 and 0.0 share a key; no NaN in x)."""
    bits = (x + 0.0).view(torch.int64)  # + 0.0 turns -0.0 into 0.0
    return torch.where(bits < 0, bits ^ 0x7FFFFFFFFFFFFFFF, bits)


def _key_to_float(key: int) -> float:
    bits = key if key >= 0 else key ^ 0x7FFFFFFFFFFFFFFF
    return struct.unpack("<d", struct.pack("<q", bits))[0]


def _float_to_key(value: float) -> int:
    bits = struct.unpack("<q", struct.pack("<d", value + 0.0))[0]
    return bits if bits >= 0 else bits ^ 0x7FFFFFFFFFFFFFFF


def _kth_largest(x: torch.Tensor, j: int, lo: float, hi: float, reducer: _GroupReducer) -> float:
    """The j-th largest of the losses of every rank (exact), by a search over the float64 bit patterns.

    Each round counts, for 255 thresholds, the losses at or above each (a binary search in the sorted
    local keys) and all-reduces the 255 counts: about 8 rounds, nothing N-sized leaves a rank.
    """
    keys = torch.sort(_ordered_keys(x)).values
    n_local = keys.numel()
    # Invariant: count(key >= a) >= j > count(key >= b); the answer is the largest such a.
    a, b = _float_to_key(lo), _float_to_key(hi) + 1
    while b - a > 1:
        width = b - a
        steps = min(_SELECTION_FANOUT, width - 1)
        thresholds = sorted({a + (width * i) // (steps + 1) for i in range(1, steps + 1)} - {a})
        t = torch.tensor(thresholds, dtype=torch.int64, device=keys.device)
        local = n_local - torch.searchsorted(keys, t, side="left")
        counts = reducer.sum(local.to(torch.float64)).tolist()
        for threshold, count in zip(thresholds, counts):
            if count >= j:
                a = threshold
            else:
                b = threshold
                break
    return _key_to_float(a)


def _weights(x: torch.Tensor, solution: _solver.Solution, lam: float, spec: Spec,
             reducer: _GroupReducer) -> torch.Tensor:
    eta = torch.tensor(solution.eta, dtype=torch.float64, device=x.device)
    return _solver.weights(x, eta, solution.n, lam, spec, reducer)


class _DistributedRobustObjective(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, losses: torch.Tensor, lam: float, spec: Spec, group: dist.ProcessGroup, where: str
                ) -> tuple[torch.Tensor, torch.Tensor]:
        reducer = _GroupReducer(group, losses.device, where)
        solution = _solver.solve(losses.detach().to(torch.float64), lam, spec, reducer)
        eta_t = torch.tensor(solution.eta, dtype=accumulate_dtype(losses.dtype), device=losses.device)
        ctx.save_for_backward(losses)
        ctx.args = (lam, spec, group, solution)
        ctx.mark_non_differentiable(eta_t)
        return torch.tensor(solution.value, dtype=losses.dtype, device=losses.device), eta_t

    @staticmethod
    def backward(ctx: Any, grad_value: torch.Tensor, _grad_eta: torch.Tensor | None
                 ) -> tuple[torch.Tensor | None, None, None, None, None]:
        # Danskin: d Psi / d l_i = q_i, this rank's share of the worst-case distribution. Every rank's
        # value is the same Psi, so each rank backpropagates into its own losses only.
        (losses,) = ctx.saved_tensors
        lam, spec, group, solution = ctx.args
        reducer = _GroupReducer(group, losses.device, "robust_objective (backward)")
        q = _weights(losses.detach().to(torch.float64), solution, lam, spec, reducer)
        grad = (q * grad_value.to(torch.float64)).to(losses.dtype)
        return first_order_only("robust_objective", (grad,), losses, grad_value)[0], None, None, None, None


def robust_objective(losses: torch.Tensor, lam: float, divergence: Divergence = "chi2", *, alpha: float | None = None,
                     k: float | None = None, group: dist.ProcessGroup) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`dro_ext.robust_objective` of the losses of every rank of ``group`` (see that function).

    Collectives: two scalar all-reduces (count and range), then ``kl`` one, ``cvar`` about 8 of a
    255-vector (the exact selection of the tail boundary) and one of two scalars, the iterative solvers
    one of two scalars per iteration (about 5 to 40). The backward pass adds one or two.
    """
    group = check_group(group, "robust_objective")
    with checked_on_every_rank(group, "robust_objective", input_device(losses)) as agreed:
        spec = check_divergence(divergence, alpha, k)
        check_losses(losses, allow_empty=True)
        lam = check_lam(lam)
        agreed.set(lam, spec, None)
    return checked_robust_objective(losses, lam, spec, group, "robust_objective")


def checked_robust_objective(losses: torch.Tensor, lam: float, spec: Spec, group: dist.ProcessGroup,
                             where: str) -> tuple[torch.Tensor, torch.Tensor]:
    """robust_objective of arguments already checked on every rank (by ``where``, the public call that names its
    errors: evaluate's checks agree on its settings once, not again here)."""
    return _DistributedRobustObjective.apply(losses, lam, spec, group, where)


def worst_case_weights(losses: torch.Tensor, lam: float, divergence: Divergence = "chi2", *,
                       alpha: float | None = None, k: float | None = None,
                       group: dist.ProcessGroup, where: str = "worst_case_weights") -> torch.Tensor:
    """This rank's share of :func:`dro_ext.worst_case_weights` over the losses of every rank.

    The returned weights (dtype of ``losses``) sum to one over all the ranks together. ``where``: the public call
    that the errors name (weight_stats takes its weights from here).
    """
    group = check_group(group, where)
    with checked_on_every_rank(group, where, input_device(losses)) as agreed:
        spec = check_divergence(divergence, alpha, k)
        check_losses(losses, allow_empty=True)
        lam = check_lam(lam)
        agreed.set(lam, spec, None)
    reducer = _GroupReducer(group, losses.device, where)
    x = losses.detach().to(torch.float64)
    solution = _solver.solve(x, lam, spec, reducer)
    return _weights(x, solution, lam, spec, reducer).to(losses.dtype)


_STATS = 7  # the statistics before the per-group sums in weight_stats' all-reduce


def weight_stats(w: torch.Tensor, groups: torch.Tensor | None, num_groups: int,
                 group: dist.ProcessGroup) -> WeightStats:
    """:class:`dro_ext.robust.WeightStats` of the weights of every rank (``w``: this rank's, checked).

    One all-reduce (sum) of ``[sum w, sum w^2, #zeros, n, #NaN, #negative, #bad ids, per-group sums...]`` and one
    (max) of the largest weight. NaN anywhere gives NaN statistics everywhere. A negative weight (``negative``:
    given weights, not computed ones) or an id outside ``[0, num_groups)`` on any rank raises on every rank, after
    the collectives: a rank that raised before them would leave the others waiting there.
    """
    from dro_ext.robust import WeightStats

    group = check_group(group, "weight_stats")
    reducer = _GroupReducer(group, w.device, "weight_stats")
    acc = accumulate_dtype(w.dtype)
    x = w.detach().to(torch.float64)
    width = int(num_groups) if groups is not None else 0
    sums = torch.zeros(_STATS + width, dtype=torch.float64, device=x.device)
    if x.numel():
        sums[0], sums[1] = fixed_order_sum(x), fixed_order_sum(x * x)
        sums[2], sums[3], sums[4], sums[5] = (x == 0).sum(), x.numel(), torch.isnan(x).sum(), (x < 0).sum()
        if groups is not None:
            bad = ((groups < 0) | (groups >= width)).sum()
            sums[6] = bad
            if not bool(bad):
                sums[_STATS:].index_add_(0, groups.long(), x)
    local_max = x.max().item() if x.numel() else -math.inf
    sums = reducer.sum(sums)
    largest = reducer.max(torch.tensor([local_max], dtype=torch.float64, device=x.device)).item()
    total, total_sq, zeros, n, nans, negative, bad_ids = sums[:_STATS].tolist()
    if bad_ids > 0:
        from dro_ext.groups import _bad_ids_message

        raise IndexError(f"{_bad_ids_message(width)} (on some rank)")
    if negative > 0:
        raise ValueError(f"dro_ext: weights must be >= 0, got {int(negative)} negative weights (on some rank)")
    if n == 0:
        raise ValueError("dro_ext.weight_stats: the weights of every rank together are empty")
    if nans > 0:
        largest = math.nan  # the MAX all-reduce of gloo and NCCL need not propagate NaN
    # Divided as tensors: every weight 0 gives NaN statistics, as the single-process call does (Python floats
    # would raise ZeroDivisionError).
    ratios = (torch.tensor([total * total, largest, zeros], dtype=torch.float64)
              / torch.tensor([total_sq, total, n], dtype=torch.float64)).to(device=w.device, dtype=acc)
    group_mass = (sums[_STATS:] / total).to(acc) if groups is not None else None
    return WeightStats(ratios[0], ratios[1], ratios[2], group_mass)



# ---------------------------------------------------------------------------------------------------
# NormalizedSGD on DTensor (FSDP2) parameters
# ---------------------------------------------------------------------------------------------------


# The DTensor class, looked up once at import (torch's own imports have loaded it by then): a cached lookup function
# (functools.lru_cache) made torch.compile warn on every optimizer step it traced.
try:
    from torch.distributed.tensor import DTensor as _DTENSOR_TYPE
except ImportError:  # pragma: no cover - torch without DTensor
    _DTENSOR_TYPE = None  # type: ignore[misc, assignment]


def has_dtensor(params: Iterable[object]) -> bool:
    return _DTENSOR_TYPE is not None and any(isinstance(p, _DTENSOR_TYPE) for p in params)


def _is_dtensor(t: object) -> TypeGuard[DTensor]:
    return _DTENSOR_TYPE is not None and isinstance(t, _DTENSOR_TYPE)


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if _is_dtensor(t) else t


def _shard_key(p: torch.Tensor) -> tuple[DeviceMesh, tuple[int, ...]] | None:
    """(mesh, sharded mesh dims) of a DTensor sharded on some mesh dim, else None (replicated/plain)."""
    if not _is_dtensor(p):
        return None
    for placement in p.placements:
        if placement.is_partial():
            raise ValueError("dro_ext.NormalizedSGD: a parameter or gradient is a DTensor with a Partial "
                             "placement (not reduced yet); reduce it before the optimizer step")
    dims = tuple(i for i, placement in enumerate(p.placements) if placement.is_shard())
    return (p.device_mesh, dims) if dims else None


def _check_grad_layout(p: torch.Tensor, g: torch.Tensor, index: int) -> None:
    if _is_dtensor(p) != _is_dtensor(g) or (
            _is_dtensor(p) and _is_dtensor(g)
            and (tuple(p.placements) != tuple(g.placements) or p.device_mesh != g.device_mesh)):
        where = f"{tuple(g.placements)}" if _is_dtensor(g) else "a plain tensor"
        what = f"{tuple(p.placements)}" if _is_dtensor(p) else "a plain tensor"
        raise ValueError(f"dro_ext.NormalizedSGD: parameter {index} is {what} but its gradient is {where}; "
                         f"the sharded step needs the gradient laid out as its parameter")


def sharded_normalized_sgd_step(params: list[torch.Tensor], grads: list[torch.Tensor], momenta: list[torch.Tensor],
                                steps: list[torch.Tensor], *, lr: float | torch.Tensor, momentum: float, eps: float,
                                weight_decay: float, norm: str, maximize: bool, grad_scale: torch.Tensor | None,
                                found_inf: torch.Tensor | None, fused: bool,
                                foreach_momentum: Callable[..., None], descend: Callable[..., None]) -> None:
    """One NormalizedSGD step over a param group holding DTensor (FSDP2-sharded) parameters.

    The update is elementwise, so it runs on the local shards (``to_local()``, which shares storage with
    the DTensor). Only the norm spans ranks: the per-tensor sums of squares of the local momenta
    (float64) are all-reduced, once per param group (once per distinct mesh when a group mixes meshes),
    over the mesh dims each tensor is sharded on; plain tensors and replicated DTensors are whole on every
    rank and counted once. Both ``norm="global"`` and ``norm="tensor"`` read the same reduced vector.

    With the fused op the momentum pass is the native kernel on the local shards (first-step rule,
    ``maximize``, ``grad_scale`` and ``found_inf`` read where it runs), called with ``lr = 0`` so that it
    leaves the parameters as they are; the update with the reduced norm is a second, ``torch._foreach``
    pass. No host sync on that path. Without it, ``foreach_momentum`` (dro_ext.optim's momentum rule, on tensors
    of any devices and dtypes) updates the local momenta. ``descend`` (dro_ext.optim's update, likewise) moves the
    local params: half ones in float32, rounded once, as the unsharded steps do.
    """
    for i, (p, g) in enumerate(zip(params, grads)):
        _check_grad_layout(p, g, i)
    local_params = [_local(p) for p in params]
    local_grads = [_local(g) for g in grads]
    local_momenta = [_local(m) for m in momenta]
    device = local_params[0].device
    skip = None
    if fused:
        zero_lr = torch.zeros((), dtype=torch.float64)
        torch.ops.dro_ext.normalized_sgd_step_(local_params, local_grads, local_momenta, steps, zero_lr, momentum,
                                               0.0, 0.0, "tensor", maximize, grad_scale, found_inf)
        if found_inf is not None:
            skip = found_inf.to(device=device).reshape(()).ne(0)
    else:
        if found_inf is not None and bool(found_inf.ne(0).any()):
            return
        foreach_momentum(local_grads, local_momenta, steps, momentum=momentum, maximize=maximize, grad_scale=grad_scale)

    # Per-tensor sums of squares of the whole momenta: local partials, all-reduced over the shards. Built
    # from per-tensor device scalars (no host-made index tensors: a host-to-device copy would sync). In
    # float64, as the foreach step does: float32 squares of tiny or huge momenta under- or overflow. On the
    # CPU this converts each float32 shard (measured as the largest part of the sharded step there).
    sumsq = [n.to(device).square() for n in torch._foreach_norm(local_momenta, 2, dtype=torch.float64)]
    keys = [_shard_key(p) for p in params]
    for key in dict.fromkeys(k for k in keys if k is not None):
        mesh, dims = key
        members = [i for i, k in enumerate(keys) if k == key]
        partial = torch.stack([sumsq[i] for i in members])
        for dim in dims:
            group = mesh.get_group(dim)
            coll_device = _collective_device(group, device)
            partial = _all_reduce_(partial.to(coll_device), dist.ReduceOp.SUM, group, "NormalizedSGD.step").to(device)
        for j, i in enumerate(members):
            sumsq[i] = partial[j]
    sumsq_vector = torch.stack(sumsq)
    norms = sumsq_vector.sqrt() if norm == "tensor" else sumsq_vector.sum().sqrt().expand_as(sumsq_vector)

    # p <- (1 - lr wd) p - lr m / (||m|| + eps); a zero momentum does not move p.
    if isinstance(lr, torch.Tensor) and lr.device.type == "cpu":
        lr = float(lr)  # a CPU scalar is read on the host, without a device sync
    lr, weight_decay = wide_number(lr), wide_number(weight_decay)  # 1 - lr wd in float64, as the fused op forms it
    scale = torch.where(norms > 0, lr / (norms + eps), 0.0)
    decay = 1.0 - lr * weight_decay  # a float, or a tensor on the device of a device-resident lr
    if skip is not None:  # GradScaler found inf/NaN: the fused op skipped the momentum, skip the update too
        scale = torch.where(skip, 0.0, scale)
        if weight_decay != 0.0:
            if not isinstance(decay, torch.Tensor):
                decay = torch.full((), decay, dtype=torch.float64, device=device)  # a fill, not a copy
            decay = torch.where(skip, 1.0, decay)
    # Per-tensor device scalars, no momentum-sized temporary. (The factor rounded to a half param's dtype overflowed
    # float16 where ||m|| < lr / 65504, and a float16 step came out inf and NaN.)
    descend(local_params, local_momenta, list(scale.unbind()), decay if weight_decay != 0.0 else None)
