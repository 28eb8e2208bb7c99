"""The PyTorch robust solver: ``(Psi, eta*)`` of ``L(eta) = mean_i lam psi*((l_i - eta)/lam) + eta`` and the
worst-case distribution at ``eta*`` (docs/design.md section 1.7), written once for the single-process fallback
(``dro_ext.robust``) and the ``group=`` path (``dro_ext.distributed``).

The two differ only in their reducer, which turns this process's partial results into totals over every loss:

- ``sum(v)``: a float64 vector of partial sums (and counts), summed over every process, on ``v``'s device;
- ``max(v)``: the same with the elementwise maximum;
- ``tail_split(x, j, lo, hi)``: the j-th largest loss and the float64 sum and count of the losses above it.

:class:`LocalReducer` holds every loss in one tensor (its sums and maxima are the partials themselves, its
``tail_split`` a ``topk``); ``dro_ext.distributed`` all-reduces, and selects the tail boundary by a search over
float64 bit patterns. Every rank then holds the same totals and takes the same branches.

How this solver differs from the native CPU solver (``csrc/robust_objective.cpp``), and why. Both take the same
steps: the closed forms of ``kl`` and ``cvar``, and for the others the same safeguarded Newton/bisection
(:func:`find_eta` is ``solve_newton`` test for test, with the exact segment solve for the piecewise-linear
weights), from the same start. Two things differ:

1. Precision of the sums, hence the stopping tolerance. This solver sums in float64 and stops within
   ``4 * eps64 * s``, ``s = 2|eta| + (psi*''-weighted mean |l - eta|)``. The native solver sums in the accumulate
   dtype (float32 for float16, bfloat16 and float32 losses wherever float32 resolves eta at this lam, float64
   otherwise), as the loss does, and stops within ``4 * eps * s`` of that dtype: a PyTorch composition cannot
   look at its sums to choose a dtype without a host read per choice, so the fallback takes float64 throughout.
2. The start. For ``kl_cvar``, ``smoothed_cvar`` and ``cressie_read`` (k != 2) at N >= 65536 the native solver
   starts Newton from the root on a strided subsample of 8192 losses, which saves it passes over all N; this
   solver starts from ``min l``, as the native one does below that size. Every start in the bracket leads to the
   same root within the tolerance, so the answers agree to it; a subsample of the losses of every rank would
   need the ranks' offsets in the concatenation (one more collective) for passes that the fallback, which reads
   its sums on the host anyway, has no reason to save.

So the two agree within the accumulate dtype's tolerance: eta* to ``32 * eps * s`` (where the minimizers form an
interval, as when every weight sits at 0 or its cap, each may return another point of it) and Psi to a few dozen
roundings of the size of its terms, which ``tests/test_robust.py`` (``test_native_and_fallback_solvers_agree``)
pins across divergences, dtypes, sizes (past the warm start's) and the extreme cases of
``tests/test_exactness_properties.py``. The CUDA solver runs multisection instead (docs/design.md section 1.7).
"""
from __future__ import annotations

import math
import struct
import sys
from typing import Callable, NamedTuple, Protocol, Sequence

import torch

from dro_ext._divergences import Spec, blocked_sums, fixed_order_sum, required, sum_blocks
from dro_ext._divergences import excess_first as _excess_first
from dro_ext._divergences import penalized_value as _penalized_value
from dro_ext._divergences import psi_star as _psi_star

# Enough for any float64 bracket: _WIDTH_HALVINGS halvings of its width, 64 of the floats' order, Newton's steps.
_MAX_ITERATIONS = 200
# Bisection halves the bracket's width this many times, then the float64 values in it (bisection_point): a bracket
# still unresolved by then spans binades (a loss of -1e30 beside losses near 1), which halving the width would
# take ~100 more steps to cross. Every other input converges long before, on the same steps as always.
_WIDTH_HALVINGS = 48
# The most floats find_eta steps up from a final eta where a weight overflows (newton_root's kMaxOverflowSteps).
_MAX_OVERFLOW_STEPS = 64
# expm1(t) is finite in float64 for t below this (log of the largest float64, 709.78, rounded down).
_EXPM1_FINITE_BELOW = 709.0


class Reducer(Protocol):
    """Totals over the losses of every process: this process's alone (LocalReducer) or a process group's
    (dro_ext.distributed). ``where`` names the public function in error messages."""

    where: str

    def sum(self, v: torch.Tensor) -> torch.Tensor: ...

    def max(self, v: torch.Tensor) -> torch.Tensor: ...

    def tail_split(self, x: torch.Tensor, j: int, lo: float, hi: float) -> tuple[float, float, float]: ...


class LocalReducer:
    """Totals over the losses of one process: every loss is in the tensor at hand."""

    where = "robust_objective"

    def sum(self, v: torch.Tensor) -> torch.Tensor:
        return v

    def max(self, v: torch.Tensor) -> torch.Tensor:
        return v

    def tail_split(self, x: torch.Tensor, j: int, lo: float, hi: float) -> tuple[float, float, float]:
        top = torch.topk(x, j).values
        eta = top[-1].item()
        above = top[top > eta]
        return eta, fixed_order_sum(above).item(), float(above.numel())


LOCAL = LocalReducer()


def totals(reducer: Reducer, *parts: torch.Tensor | float) -> list[float]:
    """The totals of this process's partial sums (0-d tensors or numbers) over every process, as Python floats."""
    device = next((p.device for p in parts if isinstance(p, torch.Tensor)), None)
    v = torch.stack([torch.as_tensor(p, dtype=torch.float64, device=device) for p in parts])
    return reducer.sum(v).tolist()


class Solution(NamedTuple):
    value: float
    eta: float
    n: float  # the number of losses over every process (with per-point weights: their total weight)


def tail_size(alpha: float, n: float) -> float:
    """alpha * N, snapped to an integer when it is one up to rounding (0.3 * 10 == 3.0000000000000004)."""
    k = alpha * n
    r = round(k)
    return float(r) if abs(k - r) <= 8.0 * sys.float_info.epsilon * k else k


def _ordered(x: float) -> int:
    """float64 x as an integer of the same order (-0.0 and 0.0 alike)."""
    bits = struct.unpack("<q", struct.pack("<d", x))[0]
    return bits if bits >= 0 else -(bits & 0x7FFFFFFFFFFFFFFF)


def bisection_point(a: float, b: float) -> float:
    """The middle of the float64 values in [a, b]: the arithmetic midpoint within a binade, a geometric one across
    many, so that any bracket narrows to adjacent floats within 64 halvings however many binades it spans
    (csrc/robust_objective.cpp's bisection_point: the same point for the same bracket)."""
    middle = (_ordered(a) + _ordered(b)) // 2
    bits = middle if middle >= 0 else (-middle) | -0x8000000000000000
    return struct.unpack("<d", struct.pack("<q", bits))[0]


def find_eta(newton_sums: Callable[[float], list[float]], segment_sums: Callable[[float], list[float]], n: float,
             lo: float, hi: float, lam: float, spec: Spec) -> float:
    """eta* of the iterative divergences: safeguarded Newton/bisection on mean psi*'((l - eta)/lam) = 1 in [lo, hi].

    newton_sums(eta) gives (sum_i psi*'(t_i) - 1, sum_i psi*''(t_i), sum_i psi*''(t_i) |l_i - eta|) and
    segment_sums(cut) gives (sum of the losses above cut, their count), over every loss. The steps are those of
    csrc/robust_objective.cpp's solve_newton, which explains each test.
    """
    # psi*' = (1 + t/width)_+ is piecewise linear for chi2 (width 2) and cressie_read at k = 2 (width 1).
    width = 2.0 if spec.name == "chi2" else (1.0 if spec.name == "cressie_read" and spec.k == 2.0 else 0.0)
    linear = width > 0.0
    eps = sys.float_info.epsilon
    a, b, eta = lo, hi, lo
    step_before_last = last_step = b - a
    previous_active, previous_g, last_was_newton, converged = -1.0, math.nan, False, False
    probing, probe_origin, probe_origin_g = False, math.nan, math.nan
    halvings, by_order = 0, False
    lower_overflows = False  # g = +inf at a: a weight overflows there
    for _ in range(_MAX_ITERATIONS):
        s1, s2, s3 = newton_sums(eta)
        g = s1 / n
        if math.isnan(g):
            return math.nan
        if g == 0.0:
            converged = True
            break
        if g > 0.0:
            a, lower_overflows = eta, g == math.inf
        else:
            b = eta
        # eta to a few roundings of |eta| and of the psi*''-weighted mean |l| (the bracket's ends without a slope).
        scale = 2.0 * abs(eta) + s3 / s2 if s2 > 0.0 and math.isfinite(s3) else max(abs(a), abs(b))
        tol = 4.0 * eps * scale
        converging = last_was_newton and abs(g) <= 0.5 * abs(previous_g)  # Newton's model holds
        bisect = False
        if probing:
            probing = False
            if (g > 0.0) != (probe_origin_g > 0.0):
                if abs(probe_origin_g) < abs(g):
                    eta = probe_origin
                converged = True
                break
            bisect = True
        try:
            newton = lam * s1 / s2 if linear else lam * math.log1p(g) * ((n + s1) / s2)
        except (ValueError, ZeroDivisionError, OverflowError):
            newton = math.nan
        if linear and last_was_newton and s2 == previous_active and abs(newton) <= tol:
            converged = True
            break
        previous_active = s2
        use_newton = False
        if not bisect and abs(newton) <= tol:
            # Tiny Newton step: the root, after a Newton step that halved |g|; else probe a tolerance towards it.
            if converging:
                converged = True
                break
            nxt = eta + math.copysign(tol, g)
            if not a < nxt < b:
                converged = True
                break
            probing, probe_origin, probe_origin_g = True, eta, g
        else:
            nxt = eta + newton
            use_newton = (
                not bisect and math.isfinite(nxt) and a < nxt < b
                and (linear or abs(newton) <= 0.5 * abs(step_before_last))
            )
            if not use_newton:
                by_order = halvings >= _WIDTH_HALVINGS
                nxt = bisection_point(a, b) if by_order else 0.5 * (a + b)
                halvings += not by_order
        previous_g = g
        step_before_last, last_step = last_step, nxt - eta
        eta, last_was_newton = nxt, use_newton
        # (A step through the floats' order can be tiny beside a wide bracket: it is no sign of convergence.)
        if not probing and (b - a <= tol
                            or (abs(last_step) <= tol and (converging if use_newton else not by_order))):
            converged = True
            break
    # lam far finer than the losses' float spacing: a stop within tol can leave eta a few floats below the root,
    # where a weight overflows; step up to the first float where none does (csrc/robust_objective.cpp's newton_root).
    for _ in range(_MAX_OVERFLOW_STEPS if lower_overflows else 0):
        if eta >= hi or newton_sums(eta)[0] != math.inf:
            break
        eta = math.nextafter(eta, math.inf)
    if linear and converged:
        sum_active, count = segment_sums(eta - width * lam)
        if count > 0:
            exact = (sum_active + width * lam * (count - n)) / count
            if lo <= exact <= hi:
                eta = exact
    return eta


def weighted_tail_split(x: torch.Tensor, w: torch.Tensor, tail: float) -> tuple[float, float, float]:
    """The weighted tail_split of one process: the loss where the weight of the losses from the largest down first
    reaches ``tail``, and the float64 weighted sum and the weight of the losses above it."""
    order = torch.sort(x, descending=True, stable=True).indices
    reached = torch.cumsum(w[order], 0) >= tail
    # The last point of positive weight when the rounded cumulative weight stays just below tail (tail = W).
    j = int(reached.to(torch.int8).argmax()) if bool(reached.any()) else int(torch.nonzero(w[order] > 0).max())
    eta = x[order[j]].item()
    above = x > eta
    return eta, fixed_order_sum((w * x)[above]).item(), fixed_order_sum(w[above]).item()


def relative_weights(w: torch.Tensor) -> torch.Tensor:
    """Weights >= 0 scaled to sum to one, through their largest first: finite weights of 1e308 overflowed their total
    (a tail size of inf, log(inf/inf); a group weight of 1e10 times a term of 1e300), subnormal ones (1e-323, 2e-323)
    lost their ratio in every product. All 0 stay 0. Only the ratios of the weights count: solve and weights take
    their per-point weights through here (Solution.n is then the total weights uses), and the objectives over
    groups their group weights (dro_ext.groups)."""
    top = w.amax()
    w = w / torch.where(top > 0, top, 1.0)
    total = fixed_order_sum(w)
    return w / torch.where(total > 0, total, 1.0)


def solve(x: torch.Tensor, lam: float, spec: Spec, reducer: Reducer = LOCAL,
          w: torch.Tensor | None = None) -> Solution:
    """(Psi, eta*) of the losses of every process; x holds this process's losses in float64 (possibly none).

    ``w`` (float64, >= 0 with some > 0, the shape of x; one process only): per-point weights, the mean over the
    losses becoming the w-weighted mean (``dro_ext.group_evaluation``'s weighted group means); without it every
    weight is one. Only their ratios count: they are scaled to sum to one (relative_weights), Solution.n then
    being that sum."""
    if w is not None and reducer is not LOCAL:
        raise NotImplementedError("dro_ext: per-point weights are solved on one process only")
    if w is not None:
        w = relative_weights(w)

    def weighted(v: torch.Tensor, w: torch.Tensor | None) -> torch.Tensor:
        return v if w is None else w * v

    # Every pass over the losses below sums f(x, w) by blocks (blocked_sums): a few float64 vectors a block, not a
    # few N-vectors, with the bits of fixed_order_sum(f(x, w)).
    def summed(f: Callable[[torch.Tensor, torch.Tensor | None], Sequence[torch.Tensor]]) -> list[torch.Tensor]:
        return blocked_sums(f, x, w)

    n_local = x.numel()
    nan_local: torch.Tensor | bool
    lo_local: torch.Tensor | float
    hi_local: torch.Tensor | float
    if n_local:
        lo_local, hi_local = torch.aminmax(x)  # NaN where x holds one
        nan_local = torch.isnan(lo_local) | torch.isnan(hi_local)
        lo_local, hi_local = torch.where(nan_local, math.inf, lo_local), torch.where(nan_local, -math.inf, hi_local)
    else:
        nan_local, lo_local, hi_local = False, math.inf, -math.inf
    n_f, nan_count = totals(reducer, n_local, nan_local)
    # Maxima, not a NaN-propagating reduction: the MAX all-reduces of gloo and NCCL need not propagate NaN.
    neg_lo, hi = reducer.max(torch.stack([torch.as_tensor(-lo_local, dtype=torch.float64, device=x.device),
                                          torch.as_tensor(hi_local, dtype=torch.float64, device=x.device)])).tolist()
    n: float  # the count of losses, or with per-point weights their total weight
    n, lo = int(n_f), -neg_lo
    if n == 0:
        raise ValueError(f"dro_ext.{reducer.where}: the losses of every rank together are empty")
    if w is not None:
        n = fixed_order_sum(w).item()  # the total weight takes the count's place in every mean below
    if nan_count > 0 or lo == -math.inf:  # -inf has no dual optimum
        return Solution(math.nan, math.nan, n)
    if hi == math.inf:
        return Solution(math.inf, math.inf, n)
    if lo == hi:  # N = 1 or all equal: psi*(0) = 0
        return Solution(lo, lo, n)
    if spec.name == "kl":
        def exp_sums(x: torch.Tensor, w: torch.Tensor | None) -> list[torch.Tensor]:
            t = (x - hi) / lam
            return [weighted(torch.exp(t), w), weighted(torch.expm1(t), w)]

        sum_exp, sum_expm1 = totals(reducer, *summed(exp_sums))
        # Near 1, log loses the digits of mean exp - 1 that lam multiplies; log1p of the mean expm1 keeps them.
        eta = hi + lam * (math.log1p(sum_expm1 / n) if sum_exp / n > 0.5 else math.log(sum_exp / n))
        if w is not None and math.isfinite(eta) and (hi - eta) / lam < _EXPM1_FINITE_BELOW:
            # A weighted mean can lie far below max l, whose weight may be tiny: eta* is then a few roundings of max l
            # that cancelled (with means (1e28, 2), weights (1, 1e15), lam = 1e30: 12% low) though the weights do not
            # make it that sensitive to max l. Centred on that eta the sum is near 0 and every term rounds in
            # proportion to itself; one more pass (over G group means) recovers the digits.
            # (As the first pass: log of the mean exp where it is below 0.5, which rounding may have made 0.)
            def centred_sums(x: torch.Tensor, w: torch.Tensor | None) -> list[torch.Tensor]:
                t = (x - eta) / lam
                return [weighted(torch.exp(t), w), weighted(torch.expm1(t), w)]

            sum_exp, sum_expm1 = totals(reducer, *summed(centred_sums))
            if sum_exp > 0:
                eta += lam * (math.log1p(sum_expm1 / n) if sum_exp / n > 0.5 else math.log(sum_exp / n))
        return Solution(eta, eta, n)
    if spec.name == "cvar":
        tail = tail_size(required(spec.alpha), n)
        if w is None:
            eta, sum_above, n_above = reducer.tail_split(x, int(min(n, max(1, math.ceil(tail)))), lo, hi)
        else:
            eta, sum_above, n_above = weighted_tail_split(x, w, tail)
        # min: the tail mean of one boundary loss, (tail * eta) / tail, can round one ulp above it (and above max l).
        return Solution(min((sum_above + (tail - n_above) * eta) / tail, hi), eta, n)

    def newton_sums(eta: float) -> list[float]:
        def block_sums(x: torch.Tensor, w: torch.Tensor | None) -> list[torch.Tensor]:
            t = (x - eta) / lam
            second = _psi_star(t, spec, 2)
            return [weighted(_excess_first(t, spec), w), weighted(second, w), weighted(second * (x - eta).abs(), w)]

        return totals(reducer, *summed(block_sums))

    def segment_sums(cut: float) -> list[float]:
        def block_sums(x: torch.Tensor, w: torch.Tensor | None) -> list[torch.Tensor]:
            active = x > cut
            # (a count of ones in float64 is exact: the count that active.sum() gives over the whole)
            return [weighted(x, w)[active], active.to(x.dtype) if w is None else w[active]]

        return totals(reducer, *summed(block_sums))

    eta = find_eta(newton_sums, segment_sums, n, lo, hi, lam, spec)
    g_eta = torch.tensor(eta, dtype=x.dtype, device=x.device)
    (sum_value,) = totals(reducer, *summed(
        lambda x, w: [weighted(_penalized_value(x, (x - g_eta) / lam, lam, g_eta, spec), w)]))
    # Psi <= L(max l) <= max l: where lam is below float64's resolution of the losses, L at the rounded eta* is not.
    return Solution(min(sum_value / n, hi), eta, n)


def weights(x: torch.Tensor, eta: torch.Tensor, n: float, lam: float, spec: Spec, reducer: Reducer = LOCAL,
            w: torch.Tensor | None = None) -> torch.Tensor:
    """This process's share of the worst-case distribution at eta (a 0-d float64 tensor) over the n losses of every
    process, for float64 losses x: float64, summing to one over every process. No host read.

    With per-point weights ``w`` (as :func:`solve` takes them, scaled alike; n is then Solution.n): point i gets
    ``w_i psi*'(t_i)`` normalized, and for cvar the boundary's mass is shared in proportion to w.

    Formed by blocks into the result (sum_blocks, blocked_sums), which is then normalized in place: the vectors that
    the weights are formed from take the memory of a block, the result's own aside."""
    def ones_or_w(x: torch.Tensor, w: torch.Tensor | None) -> torch.Tensor:
        return torch.ones_like(x) if w is None else w

    if w is not None:
        w = relative_weights(w)  # as solve takes them: n is their total

    if spec.name == "cvar":
        tail = tail_size(required(spec.alpha), n)
        n_above, n_at = reducer.sum(torch.stack(blocked_sums(
            lambda x, w: [ones_or_w(x, w) * (x > eta), ones_or_w(x, w) * (x == eta)], x, w))).unbind()
        # (the weight at eta*: a count without w, a sum of weights that may be below one with it)
        share_at = torch.clamp(1.0 - n_above / tail, min=0.0) / torch.where(n_at > 0, n_at, 1.0)
        boundary = torch.where(n_at > 0, share_at, 0.0)

        def unnormalized(x: torch.Tensor, w: torch.Tensor | None) -> torch.Tensor:
            # The last branch is reached only when x or eta is NaN, and x + eta is NaN then.
            return ones_or_w(x, w) * torch.where(x > eta, 1.0 / tail, torch.where(
                x == eta, boundary, torch.where(x < eta, 0.0, x + eta)))
    else:
        def unnormalized(x: torch.Tensor, w: torch.Tensor | None) -> torch.Tensor:
            q = _psi_star((x - eta) / lam, spec, 1)
            return q if w is None else w * q

    q = torch.empty_like(x)
    for block in sum_blocks(x.shape[0]):
        q[block] = unnormalized(x[block], None if w is None else w[block])
    if spec.name == "cvar":  # normalized already: 1/tail is the total weight
        return q
    return q.div_(reducer.sum(fixed_order_sum(q).reshape(1))[0])
