"""The divergences on the Python side: argument validation and the PyTorch fallback of psi* and its
derivatives. It mirrors csrc/divergences.h formula for formula (see that file for the derivations and
docs/design.md section 1.4 for the errata against the paper's Table 1).
"""
from __future__ import annotations

import math
import numbers
import sys
from typing import Any, Callable, Literal, NamedTuple, Sequence, TypeVar, get_args

import torch

# The divergences' names: a type for the signatures that take one, and the tuple that the checks read, made from it.
Divergence = Literal["chi2", "kl", "cvar", "kl_cvar", "cressie_read", "smoothed_cvar"]
DIVERGENCES: tuple[Divergence, ...] = get_args(Divergence)
_NEEDS_ALPHA = ("cvar", "kl_cvar", "smoothed_cvar")
# alpha's documented range is [MIN_ALPHA, 1) (csrc/checks.h): 1/alpha and alpha itself stay normal float32 numbers
# with room to spare, which the float32 kernels need.
MIN_ALPHA = 1e-30

_Checked = TypeVar("_Checked")


class Spec(NamedTuple):
    """A validated divergence with the parameters it uses (the others are None)."""

    name: Divergence
    alpha: float | None
    k: float | None


def real_number(name: str, value: object) -> float:
    """A real number as a float. bool, str and complex are refused, though float() takes them (float(True) == 1.0,
    float("0.1") == 0.1): each is more likely a mistake than a parameter."""
    if isinstance(value, torch.Tensor):
        raise TypeError(f"dro_ext: {name} must be a Python number, got a Tensor")
    if isinstance(value, bool) or not isinstance(value, (numbers.Real, torch.SymFloat, torch.SymInt)):
        raise TypeError(f"dro_ext: {name} must be a real number, got {value!r} ({type(value).__name__})")
    try:
        return float(value)
    except OverflowError:  # an int (or Fraction) past float64's range
        raise ValueError(f"dro_ext: {name} must be within float64's range, got {value!r}") from None


def wide_number(value: Any) -> Any:
    """A hyperparameter as the fused ops read it, in float64: a tensor widened (on its device), a numpy scalar as a
    Python float (numpy would form ``1 - lr * weight_decay`` in float32, and a float16 tensor in float16); a Python
    number, symbolic under torch.compile or not, as it is."""
    if isinstance(value, torch.Tensor):
        return value.to(torch.float64)
    return value if isinstance(value, (int, float)) else float(value)


def check_divergence(divergence: str, alpha: float | None = None, k: float | None = None) -> Spec:
    if divergence not in DIVERGENCES:
        raise ValueError(f"dro_ext: unknown divergence {divergence!r}; expected one of {', '.join(DIVERGENCES)}")
    # A parameter the divergence does not take is an error, not silently ignored.
    if alpha is not None and divergence not in _NEEDS_ALPHA:
        raise ValueError(f"dro_ext: divergence {divergence!r} takes no alpha, got alpha={alpha!r}; pass alpha=None")
    if k is not None and divergence != "cressie_read":
        raise ValueError(f"dro_ext: divergence {divergence!r} takes no k, got k={k!r}; pass k=None")
    if divergence in _NEEDS_ALPHA:
        if alpha is None:
            raise ValueError(f"dro_ext: divergence {divergence!r} needs alpha in [1e-30, 1), got alpha=None")
        alpha = real_number("alpha", alpha)
        if not MIN_ALPHA <= alpha < 1.0:
            raise ValueError(f"dro_ext: alpha must be in [{MIN_ALPHA:g}, 1) for divergence {divergence!r}, "
                             f"got alpha={alpha}")
        return Spec(divergence, alpha, None)
    if divergence == "cressie_read":
        if k is None:
            raise ValueError("dro_ext: divergence 'cressie_read' needs k > 1, got k=None")
        k = real_number("k", k)
        if not 1.0 < k < math.inf:
            raise ValueError(f"dro_ext: k must be a finite number > 1 for divergence 'cressie_read', got k={k}")
        return Spec(divergence, None, k)
    return Spec(divergence, None, None)


def check_positive(name: str, value: object) -> float:
    value = real_number(name, value)
    # Comparisons rather than math.isfinite, which torch.compile cannot trace on symbolic floats.
    if not 0.0 < value < math.inf:
        raise ValueError(f"dro_ext: {name} must be a finite number > 0, got {name}={value}")
    return value


# The smallest lam taken: float64's smallest normal number, whose reciprocal is finite (a subnormal lam's 1/lam is inf
# or loses digits, and the kernels multiply by it: t = 0 * inf gave NaN at a loss equal to the shift).
MIN_LAM = sys.float_info.min


def check_lam(value: object) -> float:
    """lam, a finite number >= MIN_LAM (csrc/checks.h's check_lam, with its message)."""
    value = real_number("lam", value)
    if not MIN_LAM <= value < math.inf:
        raise ValueError(f"dro_ext: lam must be a finite number > 0 (and no smaller than {MIN_LAM!r}, float64's "
                         f"smallest normal number), got lam={value}")
    return value


# Validated Python numbers: checked_scalars' (divergence, alpha, k, lam, scale) and op_scalars' tuples. A
# training step calls the loss with the same Python numbers every time, and at a few thousand samples checking them
# again costs a visible share of the step.
_CHECKED_SCALARS: dict[tuple[Any, ...], Any] = {}
_REMEMBERED_AT_MOST = 256


def _remember(key: tuple[Any, ...], checked: _Checked) -> _Checked:
    """checked, kept under key for the next call with the same arguments (the key holds their types too: 0.1 + 0j
    == 0.1 and True == 1 hash alike, and must not pass as them). The lookup is inlined in each caller: these calls
    are on paths of a few microseconds, where even a function call shows."""
    # The cache is a side effect torch.compile need not trace (nor guard on).
    if not torch.compiler.is_compiling() and len(_CHECKED_SCALARS) < _REMEMBERED_AT_MOST:
        _CHECKED_SCALARS[key] = checked
    return checked


def checked_scalars(divergence: str, alpha: float | None, k: float | None, lam: float,
                    scale: float = 1.0) -> tuple[Spec, float, float]:
    """(check_divergence, check_positive of lam, of scale), remembered for the Python numbers seen before."""
    key = (divergence, alpha, k, lam, scale, type(alpha), type(k), type(lam), type(scale))
    try:
        if not torch.compiler.is_compiling():
            return _CHECKED_SCALARS[key]
    except (KeyError, TypeError):  # TypeError: an unhashable argument, which the checks below reject
        pass
    return _remember(key, (check_divergence(divergence, alpha, k), check_lam(lam),
                           check_positive("scale", scale)))


def op_scalars(divergence: str, alpha: float | None, k: float | None, lam: float,
               scale: float = 1.0) -> tuple[Any, ...]:
    """The checked ``(lam, divergence, alpha, k, scale)`` in the order the native ops (``dro_loss``, the robust
    objective's) take them after their tensors, without the trailing defaults (scale 1.0, then Nones: the robust
    objective's schema has no scale), remembered as checked_scalars are: the sample-level call is a few microseconds,
    and unpacking a Spec on every call costs a visible share of it (as does each default passed, about 0.08 us)."""
    # "op" tags the key apart from checked_scalars' keys in the same cache.
    key = ("op", divergence, alpha, k, lam, scale, type(alpha), type(k), type(lam), type(scale))
    try:
        if not torch.compiler.is_compiling():
            return _CHECKED_SCALARS[key]
    except (KeyError, TypeError):
        pass
    spec, checked_lam, checked_scale = checked_scalars(divergence, alpha, k, lam, scale)
    args: tuple[Any, ...] = (checked_lam, *spec, checked_scale)
    if checked_scale == 1.0:
        args = args[:-1]
    while args[-1] is None:
        args = args[:-1]
    return _remember(key, args)


# The floating dtypes the kernels are compiled for (csrc/floating_types.h), and the only ones the checks accept: the
# fallback would otherwise compute in a float8 dtype the native backend refuses.
FLOATING_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def check_floating_dtype(name: str, value: torch.Tensor) -> None:
    """One of FLOATING_DTYPES, or a TypeError naming the argument (csrc/checks.h's message)."""
    if value.dtype not in FLOATING_DTYPES:
        raise TypeError(f"dro_ext: {name} must have a floating dtype (float16, bfloat16, float32, float64), "
                        f"got {value.dtype}")


def check_dense(name: str, value: torch.Tensor) -> None:
    """A strided (dense) tensor: the ops have no sparse or other layouts' kernels."""
    if value.layout != torch.strided:
        raise TypeError(f"dro_ext: {name} must be a dense (strided) tensor, got layout {value.layout}")


def check_losses(value: object, name: str = "losses", *, allow_empty: bool = False) -> None:
    """A dense 1-D floating tensor: the losses (or weight_stats' weights), checked with csrc/checks.h's messages.
    allow_empty: a rank of a group= call may hold none (dro_ext.distributed checks the total)."""
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"dro_ext: {name} must be a torch.Tensor, got {type(value).__name__}")
    check_dense(name, value)
    per_sample = " of per-sample losses" if name == "losses" else ""
    if value.dim() != 1:
        raise ValueError(f"dro_ext: {name} must be a 1-D tensor{per_sample}, got shape {tuple(value.shape)}")
    if value.numel() == 0 and not allow_empty:
        raise ValueError(f"dro_ext: {name} must not be empty")
    check_floating_dtype(name, value)


def input_device(*values: object) -> torch.device:
    """The device of the first tensor among values (the CPU without one), where an input checked on every rank of a
    process group may be refused: the device of that rank's collective then."""
    for value in values:
        if isinstance(value, torch.Tensor):
            return value.device
    return torch.device("cpu")


def as_eta(eta: float | torch.Tensor, losses: torch.Tensor, losses_name: str = "losses") -> torch.Tensor:
    """eta as a 0-d tensor on the device of ``losses`` (the argument named ``losses_name``: the cross-entropies'
    logits or hidden); a Python number becomes a constant (no gradient)."""
    if isinstance(eta, torch.Tensor):
        if eta.dim() != 0:
            raise ValueError(f"dro_ext: eta must be a 0-d tensor, got shape {tuple(eta.shape)}")
        if eta.dtype not in FLOATING_DTYPES:
            raise TypeError(f"dro_ext: eta must have a floating dtype, got {eta.dtype}")
        if eta.device != losses.device:
            raise ValueError(
                f"dro_ext: eta is on {eta.device} but {losses_name} is on {losses.device}; move them to the same "
                f"device"
            )
        return eta
    return torch.tensor(real_number("eta", eta), dtype=accumulate_dtype(losses.dtype), device=losses.device)


def accumulate_dtype(dtype: torch.dtype) -> torch.dtype:
    """float32 for half/bfloat16/float32 inputs, float64 for float64 inputs (docs/design.md section 1.6)."""
    return torch.float64 if dtype == torch.float64 else torch.float32


# torch.sum splits a 1-D tensor of more than this many elements between threads, in as many parts as it has
# threads: the rounding then depends on the thread count.
_SINGLE_THREAD_SUM = 32768
_SUM_CHUNK = 16384


def fixed_order_sum(x: torch.Tensor) -> torch.Tensor:
    """x.sum(), the same bits whatever the thread count (as the native kernels' sums): beyond what one thread sums,
    fixed chunks of the flattened x (rows of a 2-D view, each summed by one thread) and then their sums."""
    x = x.reshape(-1)
    n = x.shape[0]
    if n <= _SINGLE_THREAD_SUM:
        return x.sum()
    # Rows of a contiguous x (a view, no copy of it): a strided row would be summed in another order.
    x = x.contiguous()
    whole = n - n % _SUM_CHUNK
    chunk_sums = x[:whole].reshape(-1, _SUM_CHUNK).sum(dim=1)
    if whole == n:
        return chunk_sums.sum()
    # The last, partial chunk padded with zeros to a whole one, which leave its sum alone: a row summed as the others.
    last = torch.nn.functional.pad(x[whole:], (0, _SUM_CHUNK - (n - whole))).reshape(1, _SUM_CHUNK).sum(dim=1)
    return torch.cat([chunk_sums, last]).sum()


# What blocked_sums hands its function at once: whole chunks, so that a block's chunk sums are those of
# fixed_order_sum over the whole. 1 MiB a float64 vector: the dozen vectors of a penalized_value take about 15 MiB
# (8 MiB blocks took 120 MiB, and left more of the heap behind them), and a block's vectors stay in the caches.
_SUM_BLOCK = 8 * _SUM_CHUNK


def sum_blocks(n: int) -> list[slice]:
    """Consecutive slices covering range(n) of _SUM_BLOCK elements each (the last one may have fewer)."""
    if _SUM_BLOCK % _SUM_CHUNK:
        raise AssertionError("dro_ext: a block of blocked_sums must be whole chunks of fixed_order_sum")
    return [slice(start, min(start + _SUM_BLOCK, n)) for start in range(0, n, _SUM_BLOCK)]


class _ChunkedSum:
    """fixed_order_sum of a vector of at most capacity chunks handed over in consecutive pieces. It holds the chunks'
    sums, in one vector allocated once (a small tensor kept per block would pin the holes that the freed blocks leave
    in the heap, which then grew by blocks), and the elements of the chunk still filling: all of them while the
    vector may still be one that fixed_order_sum sums whole (at most _SINGLE_THREAD_SUM elements)."""

    def __init__(self, capacity: int) -> None:
        self.capacity, self.count, self.filled = capacity, 0, 0
        self.pending: list[torch.Tensor] = []
        self.chunk_sums: torch.Tensor | None = None

    def _rest(self) -> torch.Tensor:
        nonempty = [piece for piece in self.pending if piece.shape[0]]
        return nonempty[0] if len(nonempty) == 1 else torch.cat(self.pending)  # (a block: no copy of it)

    def _sum_chunks(self, v: torch.Tensor) -> None:
        rows = v.shape[0] // _SUM_CHUNK
        if self.chunk_sums is None:
            self.chunk_sums = v.new_empty(self.capacity)
        torch.sum(v.reshape(rows, _SUM_CHUNK), dim=1, out=self.chunk_sums[self.filled:self.filled + rows])
        self.filled += rows

    def add(self, piece: torch.Tensor) -> None:
        self.pending.append(piece.reshape(-1))
        self.count += piece.numel()
        if self.count > _SINGLE_THREAD_SUM:
            rest = self._rest()
            full = rest.shape[0] - rest.shape[0] % _SUM_CHUNK
            self._sum_chunks(rest[:full])
            self.pending = [rest[full:].clone()]  # (a view would hold the whole block)

    def total(self) -> torch.Tensor:
        rest = self._rest()
        if self.count <= _SINGLE_THREAD_SUM:
            return rest.sum()
        if rest.shape[0]:
            self._sum_chunks(torch.nn.functional.pad(rest, (0, _SUM_CHUNK - rest.shape[0])))
        if self.chunk_sums is None:
            raise AssertionError("dro_ext: past _SINGLE_THREAD_SUM elements, add has summed chunks")
        return self.chunk_sums[:self.filled].sum()


def blocked_sums(f: Callable[..., Sequence[torch.Tensor]], *xs: torch.Tensor | None) -> list[torch.Tensor]:
    """[fixed_order_sum(v) for v in f(*xs)], the same bits, with f evaluated on one block of the 1-D xs (the same
    elements of each; None stays None) after the other: the vectors f forms take the memory of a block, not of the
    whole. Each of f's results must be a 1-D tensor whose concatenation over the blocks is f's result over the whole:
    elementwise values, or a selection v[mask] of them.

    The bits are fixed_order_sum's because a block is whole chunks: each chunk is summed as a row of its own, as
    there, and the chunks' sums are then summed as one vector, as there. That holds on the CPU, where one thread sums
    a row; a CUDA reduction may lay out a row's sum by the number of rows, so there the bits are the same from run to
    run but may differ from the whole vector's in the last place."""
    n = next(x for x in xs if x is not None).shape[0]
    if n <= max(_SUM_BLOCK, _SINGLE_THREAD_SUM):
        return [fixed_order_sum(v) for v in f(*xs)]
    sums: list[_ChunkedSum] = []
    for block in sum_blocks(n):
        pieces = f(*(None if x is None else x[block] for x in xs))
        sums = sums or [_ChunkedSum(-(-n // _SUM_CHUNK)) for _ in pieces]
        for chunked, piece in zip(sums, pieces):
            chunked.add(piece)
    return [chunked.total() for chunked in sums]


def fixed_order_sums(x: torch.Tensor, dim: int, dtype: torch.dtype | None = None) -> torch.Tensor:
    """x.sum(dim, dtype=dtype) of a 2-D x, the same bits whatever the thread count: torch sums each output on one
    thread where there are several, but splits the sum of a single output between threads (beyond 32768 elements),
    and that one sum takes fixed_order_sum here (a one-row chunk of logits, a one-class vocabulary)."""
    if x.shape[1 - dim] != 1:
        return x.sum(dim, dtype=dtype)
    line = x.select(1 - dim, 0)
    return fixed_order_sum(line if dtype is None else line.to(dtype)).reshape(1)


def fixed_order_broadcast(s: torch.Tensor, shape: torch.Size | tuple[int, ...]) -> torch.Tensor:
    """A 0-d s broadcast to shape (as s.expand(shape)), whose gradient autograd sums as fixed_order_sum does: the
    gradient of an expand is a torch.sum of the whole, split by the thread count beyond what one thread sums. Here
    it is two expands, each summed in one reduction of its own: the chunks' rows (one thread a row), then the rows."""
    n = math.prod(shape)
    if n <= _SINGLE_THREAD_SUM:
        return s.expand(shape)
    rows = -(-n // _SUM_CHUNK)
    return s.reshape(1, 1).expand(rows, 1).expand(rows, _SUM_CHUNK).reshape(-1)[:n].reshape(shape)


def fallback_dtype(dtype: torch.dtype, device: torch.device) -> torch.dtype:
    """What the fallback evaluates the loss and its weights in: float64 wherever the device has it. The native
    kernels sum in float32 and redo a pass in float64 where float32 intermediates overflow or cannot form
    t = (l - G eta)/lam (a tiny or huge lam); a composition of PyTorch ops cannot look at its result first without
    a host sync (and torch.func cannot at all), so the fallback takes float64 from the start."""
    return torch.float64 if device.type != "mps" else accumulate_dtype(dtype)


def _select_positive(x: torch.Tensor, if_pos: torch.Tensor | float, if_nonpos: torch.Tensor | float) -> torch.Tensor:
    # x > 0 ? if_pos : (x <= 0 ? if_nonpos : NaN), so a NaN in x comes out as NaN, and so does every derivative
    # there: the NaN lane is s e^s with s = x at NaN and 0 elsewhere, whose derivatives of every order are NaN at
    # NaN (a pass-through of x would have gradient 1 and hide the NaN from the gradient; x times s had a second
    # derivative of 2), and 0 elsewhere, an infinite x's included (s's masked-out gradient is 0).
    nan_only = torch.where(torch.isnan(x), x, 0.0)
    nan_lane = nan_only * torch.exp(nan_only)
    return torch.where(x > 0, if_pos, torch.where(x <= 0, if_nonpos, nan_lane))


def _at_most(t: torch.Tensor, cap: float) -> torch.Tensor:
    """min(t, cap), with the gradient of t up to t == cap (exp(cap) for kl_cvar's exp(min(t, cut)), as in the closed
    form), 0 above it, and NaN kept at a NaN t: torch.clamp's gradient is 0 there, which dropped a NaN loss from the
    gradient of the weights."""
    return torch.where(t > cap, cap, t)


def _relu(x: torch.Tensor) -> torch.Tensor:
    # max(x, 0) whose value and gradient are NaN at a NaN (torch.relu's gradient there is 0, which would
    # silently drop the sample from the gradient); the gradient at 0 is 0, the subgradient of docs/design.md section 1.3. A select,
    # not x times a 0/1 factor, so that -inf gives 0 (-inf * 0 is NaN).
    return _select_positive(x, x, 0.0)


def _neg_abs(t: torch.Tensor) -> torch.Tensor:
    # -|t| with derivative 1 at t = 0 (the t <= 0 branch), as the forms built on it need (psi*'(0) = 1).
    return torch.where(t > 0, -t, t)


def _sigmoid(s: torch.Tensor) -> torch.Tensor:
    """torch.sigmoid(s), the same bits whatever the thread count: ATen's sigmoid takes Sleef's exp in its vector loop
    and the libm's in the scalar loop of a range's tail, and the thread count moves where a thread's range ends, so an
    element's last bit depended on it (float64, 1 in 40001). exp itself takes the vector function to the last
    element. From q = e^-|s| (never overflowing) as 1/(1 + q) or q/(1 + q); _neg_abs's branch gives the derivative
    at 0, 1/4."""
    q = torch.exp(_neg_abs(s))
    return torch.where(s > 0, 1.0 / (1.0 + q), q / (1.0 + q))


def _expm1(z: torch.Tensor) -> torch.Tensor:
    """e^z - 1 whose autograd gradient is e^z to a few roundings of its own size, however small.

    torch.expm1's backward forms its gradient as result + 1, which keeps only the digits of e^z that 1 leaves: none
    once e^z is below a rounding of 1 (kl's psi*'(-40) in float64 came out 0 for e^-40 = 4.2e-18). Below z = -1
    the value is exp(z) - 1 instead, which loses nothing there (|e^z - 1| > 0.63), and whose gradient is exp's own;
    z is clamped in that branch so that torch.where's zero gradient never meets exp(+inf)."""
    return torch.where(z < -1.0, torch.exp(torch.clamp(z, max=-1.0)) - 1.0, torch.expm1(z))


def _cressie_read_parts(t: torch.Tensor, k: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(u, a t, log u) with a = k - 1 and u = 1 + a t, log u = log1p(a t) where u > 0.

    Where u <= 0, log1p is evaluated at 0 instead, so autograd never meets its pole (those lanes are selected
    away). Where a t overflows while t is finite (k = 1000 at t = 1e306: u^(1/a) is 2.04 there), log u is
    log(a) + log(t), to which log1p(1 / (a t)) adds less than a rounding (csrc/divergences.h's log_base)."""
    a = k - 1.0
    at = t * a
    u = at + 1.0
    overflowed = (at == math.inf) & (t != math.inf)
    log_near = torch.log1p(torch.where((u > 0) & ~overflowed, at, 0.0))
    log_far = math.log(a) + torch.log(torch.where(overflowed, t, 1.0))
    return u, at, torch.where(overflowed, log_far, log_near)


def _cressie_read_integer_power(k: float) -> int:
    """p = 1/(k - 1) where it is a small integer (k = 2: 1, k = 3/2: 2), else 0: csrc/divergences.h's kPower, which
    visit_divergence picks from k."""
    return 1 if k == 2.0 else (2 if k == 1.5 else 0)


def _cressie_read_integer(t: torch.Tensor, power: int, order: int | str) -> torch.Tensor:
    """psi*' (order 1), psi*'' (2), psi*' - 1 ("excess_first") or psi*(t) - t ("excess") for the integer powers p = 1
    (k = 2) and p = 2 (k = 3/2), by arithmetic on u = 1 + a t as the kernels form them (csrc/divergences.h):
    exp(p log u) carries the rounding of log u, which at t = 1e138 put psi*' and the gradient of the excess a hundred
    roundings off. (psi* itself keeps the general form: autograd differentiates it down to u -> 0, where the
    derivative of the factored form cancels.)
      k = 2:    psi*' = u_+,    psi*'' = [u > 0],  psi*' - 1 = m,          psi* - t = m^2/2 + (m - t)
      k = 3/2:  psi*' = u_+^2,  psi*'' = u_+,      psi*' - 1 = m + m^2/4,  psi* - t = m^2 (v + 2)/6 + (m - t)
    with m = max(t, -1/a) (u clamped at 0) and v = 1 + m/2. The excess is differentiated by autograd only above
    direct_below (penalized_value), where u >= 1/3 and its derivative's terms do not cancel."""
    if order in (1, 2):
        u = t * (1.0 if power == 1 else 0.5) + 1.0
        if order == 1:
            return _relu(u) if power == 1 else _relu(u) ** 2
        return _select_positive(u, 1.0, 0.0) if power == 1 else _relu(u)
    floor = -1.0 if power == 1 else -2.0
    # max(t, floor) through a select, whose value and gradient stay NaN at a NaN t (torch.clamp's gradient is 0).
    m = _select_positive(t - floor, t, floor)
    # Each product scaled before it is squared (m (m/2), not m m / 2): where the result is finite near the largest
    # float, the square is not.
    if order == "excess":
        return m * (m * 0.5) + (m - t) if power == 1 else m * (m * ((m * 0.5 + 3.0) * (1.0 / 6.0))) + (m - t)
    return m if power == 1 else m + m * (m * 0.25)  # excess_first


def _smoothed_cvar_parts(t: torch.Tensor, alpha: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(m, c1 + c2 q): m = expm1(-|t|) = q - 1 with q = e^-|t|, and (c1, c2) = (alpha, 1 - alpha) for t > 0, swapped
    otherwise, so that 1 - alpha + alpha e^t is e^t (c1 + c2 q) for t > 0 and c1 + c2 q otherwise: a sum of positive
    terms, never 1 + c m, which cancels for alpha near 0 or 1 (csrc/divergences.h)."""
    minus_abs = _neg_abs(t)
    m = torch.expm1(minus_abs)
    q = torch.exp(minus_abs)
    # Each constant times 0 or 1, so that alpha and 1 - alpha round only once (torch.where of two numbers would be
    # float32, and 1 - c1 would lose alpha near 0).
    positive = (t > 0).to(t.dtype)
    negative = 1.0 - positive
    c1 = alpha * positive + (1.0 - alpha) * negative
    c2 = (1.0 - alpha) * positive + alpha * negative
    return m, c1 + c2 * q


# In smallest normals, the gauge below which _unless_below_normal takes the log form: csrc/divergences.h's
# log_form_below, above the band where the AVX2 build's exp returns 0, so that every backend takes the same form.
_LOG_FORM_BELOW_NORMALS = 256.0


def _unless_below_normal(gauge: torch.Tensor, ratio: torch.Tensor, log_ratio: torch.Tensor) -> torch.Tensor:
    """``ratio`` where ``gauge`` (q = e^-|t|, 1, or the result itself) is well above the smallest normal, else
    exp(log_ratio): smoothed_cvar's weight and second derivative where q underflows while they do not
    (csrc/divergences.h's SmoothedCVaR::unless_below_normal)."""
    below = _LOG_FORM_BELOW_NORMALS * torch.finfo(gauge.dtype).smallest_normal
    return _select_positive(gauge - below, ratio, torch.exp(log_ratio))


def _smoothed_cvar_shortcuts(alpha: float) -> bool:
    """csrc/divergences.h's SmoothedCVaR::shortcuts: alpha in [1/16, 15/16]."""
    return 1.0 / 16.0 <= alpha <= 15.0 / 16.0


def _smoothed_cvar_value(t: torch.Tensor, alpha: float) -> torch.Tensor:
    """psi*(t) = log1p(x) / alpha with x = alpha expm1(t) in [-1/2, 1], else (t_+ + log(c1 + c2 q)) / alpha.

    expm1 is taken at t clamped to log1p(2 / alpha), where x = 2 already selects the second form, so that every
    branch torch.where drops is finite and so is its gradient."""
    _, total = _smoothed_cvar_parts(t, alpha)
    e = _expm1(torch.clamp(t, max=math.log1p(2.0 / alpha)))
    x = e * alpha
    # e (1 - x/2) where |x| < 2^-60: log1p(x) / alpha to the last bit (e itself), without alpha e's digits below the
    # smallest normal, and with log1p's curvature (psi*''(0) = 1 - alpha: e alone had 1, a wrong second derivative at
    # a loss equal to G eta).
    near = torch.where(x.abs() < 2.0**-60, e * (1.0 - x * 0.5), torch.log1p(x) / alpha)
    far = (_relu(t) + torch.log(total)) / alpha
    return torch.where((x >= -0.5) & (x <= 1.0), near, far)


def required(parameter: float | None) -> float:
    """alpha or k of a Spec whose divergence takes it: check_divergence sets exactly those (the others are None)."""
    if parameter is None:
        raise AssertionError("dro_ext: a divergence parameter is None in a Spec whose divergence takes it")
    return parameter


def psi_star(t: torch.Tensor, spec: Spec, order: int = 0) -> torch.Tensor:
    """psi*^(order)(t) for order 0, 1, 2, in t's dtype, differentiable by autograd.

    The values are written, as in csrc/divergences.h, to keep their relative precision near t = 0."""
    name = spec.name
    if name == "chi2":
        if order == 0:
            # m (1 + m/4) with m = max(t, -2), as csrc/divergences.h: a select of t + t^2/4 would send its zero
            # gradient through t + t^2/4 at t = -inf, where that gradient is 0 * -inf = NaN.
            m = _select_positive(t + 2.0, t, -2.0)
            return m + m * (m * 0.25)  # m/4 first: m m overflows before m^2/4 does
        if order == 1:
            return _relu(t + 2.0) * 0.5
        return _select_positive(t + 2.0, 0.5, 0.0)
    if name == "kl":
        return _expm1(t) if order == 0 else torch.exp(t)
    if name == "cvar":
        inv_alpha = 1.0 / required(spec.alpha)
        if order == 0:
            return _relu(t) * inv_alpha
        return _select_positive(t, inv_alpha if order == 1 else 0.0, 0.0)
    if name == "kl_cvar":
        alpha = required(spec.alpha)
        cut = -math.log(alpha)
        below = _at_most(t, cut)
        if order == 0:
            return _expm1(below) + _relu(t - cut) / alpha
        if order == 1:
            return torch.exp(below)
        return _select_positive(t - cut, 0.0, torch.exp(below))
    if name == "cressie_read":
        k = required(spec.k)
        if order > 0 and (integer_power := _cressie_read_integer_power(k)):
            return _cressie_read_integer(t, integer_power, order)
        power = 1.0 / (k - 1.0)
        # At t = +inf autograd through exp(p log1p(a t)) forms the gradient as exp(inf) * d log1p(inf) = inf * 0 (a
        # NaN): every form below is evaluated at a stand-in t = 0 there, and its limit selected instead, with t * t
        # standing for +inf with slope +inf.
        infinite = t == math.inf
        above = torch.where(infinite, t, 0.0)
        finite_t = torch.where(infinite, 0.0, t)
        u, _, log_u = _cressie_read_parts(finite_t, k)
        if order == 0:
            # (u^(p+1) - 1) / k = (e + a t (1 + e)) / k with e = u^p - 1, +inf with slope +inf at t = +inf, as psi*.
            # Where u^p < 1/e, as (u u^p - 1) / k: the gradient of 1 + e would keep only the digits of u^p that 1
            # leaves (see _expm1).
            z = log_u * power
            e = torch.expm1(z)
            small = (u * torch.exp(torch.clamp(z, max=-1.0)) - 1.0) / k
            # e / k + t ((a / k) (1 + e)) with a / k < 1: a t (1 + e) overflows before its division by k (k = 1000,
            # t = 1e306: a t is past float64's largest, psi* is 2.04e306).
            grown = finite_t * ((e + 1.0) * ((k - 1.0) / k))
            value = _select_positive(u, torch.where(z < -1.0, small, e / k + grown), -1.0 / k)
            if integer_power := _cressie_read_integer_power(k):
                # At t >= 0 the integer powers' products of positive terms, t (1 + t/2) (k = 2) and
                # t (v^2 + v + 1)/3 with v = 1 + t/2 (k = 3/2), a few roundings in all (README: kappa 4), where
                # exp(p log u) carries the rounding of log u (up to 4x the bound at t = 2e7). Below 0 the general
                # form stays: the factored forms' derivatives cancel as u -> 0, where its own keep their digits.
                # (Evaluated at t = 0 where not taken, so that no -inf reaches their backward.)
                at_least_zero = torch.where(t >= 0, finite_t, 0.0)
                half = at_least_zero * 0.5 + 1.0
                factored = (at_least_zero * half if integer_power == 1
                            else at_least_zero * ((half * half + half + 1.0) / 3.0))
                value = torch.where(t >= 0, factored, value)
            return torch.where(infinite, above * above, value)
        if order == 2:
            power -= 1.0
        # u^power at t = +inf is +inf (power > 0) or 0, with slope power a u^(power - 1): +inf for power > 1, else 0
        # (power = 1 is an integer power, above).
        finite = _select_positive(u, torch.exp(log_u * power), 0.0)
        at_infinity = above * above if power > 1.0 else (math.inf if power > 0.0 else 0.0)
        return torch.where(infinite, at_infinity, finite)
    if name == "smoothed_cvar":
        alpha = required(spec.alpha)
        if order == 0:
            return _smoothed_cvar_value(t, alpha)
        # e^t / (1 - alpha + alpha e^t) and its derivative from q = e^-|t|, without t + log(alpha/(1 - alpha)).
        minus_abs = _neg_abs(t)
        q = torch.exp(minus_abs)
        _, total = _smoothed_cvar_parts(t, alpha)
        if _smoothed_cvar_shortcuts(alpha):
            s = t + (math.log(alpha) - math.log1p(-alpha))
            # sigmoid(s) sigmoid(-s): no 1 - p to lose the small side's digits. Where e^-|s| underflows while the
            # result does not (up to 1/alpha^2 times above the smallest normal), the log forms below.
            if order == 1:
                weight = _sigmoid(s) / alpha
                return _unless_below_normal(weight, weight, minus_abs - torch.log(total))
            second = _sigmoid(s) * _sigmoid(-s) / alpha
            return _unless_below_normal(second, second, minus_abs + math.log1p(-alpha) - 2.0 * torch.log(total))
        if order == 1:
            numerator = torch.where(t > 0, torch.ones_like(q), q)
            return _unless_below_normal(numerator, numerator / total, minus_abs - torch.log(total))
        # (csrc/divergences.h: no square of total to underflow)
        return _unless_below_normal(q, (q / total) * ((1.0 - alpha) / total),
                                    minus_abs + math.log1p(-alpha) - 2.0 * torch.log(total))
    raise AssertionError(name)


def excess(t: torch.Tensor, spec: Spec) -> torch.Tensor:
    """psi*(t) - t, accurate to a few roundings of |t| however small t is (csrc/divergences.h's excess)."""
    name = spec.name
    if name == "chi2":
        return _select_positive(t + 2.0, t * (t * 0.25), -1.0 - t)
    if name == "kl":
        return torch.expm1(t) - t
    if name == "cvar":
        alpha = required(spec.alpha)
        return _select_positive(t, t * ((1.0 - alpha) / alpha), -t)
    if name == "kl_cvar":
        alpha = required(spec.alpha)
        cut = -math.log(alpha)
        below = _at_most(t, cut)
        return (torch.expm1(below) - below) + _relu(t - cut) * ((1.0 - alpha) / alpha)
    if name == "cressie_read":
        k = required(spec.k)
        if integer_power := _cressie_read_integer_power(k):
            return _cressie_read_integer(t, integer_power, "excess")
        u, _, log_u = _cressie_read_parts(t, k)
        e = torch.expm1(log_u / (k - 1.0))
        # (e - t + a t e) / k as (e - t) / k + t ((a / k) e): see psi_star.
        return _select_positive(u, (e - t) / k + t * (e * ((k - 1.0) / k)), -1.0 / k - t)
    if name == "smoothed_cvar":
        return _smoothed_cvar_value(t, required(spec.alpha)) - t
    raise AssertionError(name)


def excess_first(t: torch.Tensor, spec: Spec) -> torch.Tensor:
    """psi*'(t) - 1, accurate to a few roundings of |t| however small t is (csrc/divergences.h)."""
    name = spec.name
    if name == "chi2":
        return _select_positive(t + 2.0, t * 0.5, -1.0)
    if name == "kl":
        return torch.expm1(t)
    if name == "cvar":
        alpha = required(spec.alpha)
        return _select_positive(t, (1.0 - alpha) / alpha, -1.0)
    if name == "kl_cvar":
        return torch.expm1(_at_most(t, -math.log(required(spec.alpha))))
    if name == "cressie_read":
        k = required(spec.k)
        if integer_power := _cressie_read_integer_power(k):
            return _cressie_read_integer(t, integer_power, "excess_first")
        u, _, log_u = _cressie_read_parts(t, k)
        return _select_positive(u, torch.expm1(log_u / (k - 1.0)), -1.0)
    if name == "smoothed_cvar":
        alpha = required(spec.alpha)
        m, total = _smoothed_cvar_parts(t, alpha)
        ratio = m * (1.0 - alpha) / total
        return _select_positive(t, -ratio, ratio)
    raise AssertionError(name)


def direct_below(spec: Spec) -> float:
    """csrc/divergences.h's direct_below: t_d <= 0 with psi*(t) >= t/2 for every t <= t_d (2 psi*(-inf), or the top
    of psi*'s zero set where that is higher), where a sample's share of the objective is formed directly."""
    name = spec.name
    if name == "cvar":
        return 0.0
    if name == "cressie_read":
        k = required(spec.k)
        return max(-2.0 / k, -1.0 / (k - 1.0))
    if name == "smoothed_cvar":
        alpha = required(spec.alpha)
        return 2.0 * math.log1p(-alpha) / alpha
    return -2.0  # chi2, kl, kl_cvar: psi*(-inf) = -1


def penalized_value(x: torch.Tensor, t: torch.Tensor, lam: float, g_eta: torch.Tensor, spec: Spec) -> torch.Tensor:
    """Each sample's lam psi*(t) + G eta for t = (x - G eta) / lam, elementwise (csrc/divergences.h's
    penalized_value), differentiable by autograd.

    Above direct_below(spec) it is formed as x + lam (psi*(t) - t): the G eta terms cancel, and lam * excess keeps its
    precision as lam grows, where lam psi*(t) + G eta would not (docs/design.md section 1.6, the ERM limit). At or below it (psi* flat:
    a loss far below the others, or a sample of weight 0) as lam psi*(t) + G eta itself, which keeps the digits
    that x - x would lose, and gives those samples a gradient of exactly psi*'(t) (0 where the weight is 0).
    t = +inf (a loss of +inf) makes the excess form inf - inf; the kernels take lam psi*(t) + G eta there, +inf.
    Each sample's formula is evaluated at a stand-in t where it is not the one selected, so that autograd never
    meets inf - inf or 0 * inf (torch.where sends a zero gradient into the branch it drops):
      t = +inf: lam t w with w = psi*'(+inf) > 0, which is +inf with gradient w;
      t = -inf: the constant lam psi*(-inf) (its weight psi*'(-inf) is 0).
    """
    t_direct_max = direct_below(spec)
    above, below = t == math.inf, t == -math.inf
    direct = (t <= t_direct_max) & ~below
    t_above = torch.where(above, t, 0.0)
    w_above = psi_star(t_above.detach(), spec, 1)
    limit_below = psi_star(torch.where(below, t, 0.0).detach(), spec, 0)
    limits = torch.where(above, t_above * w_above, torch.where(below, limit_below, 0.0))
    special = direct | above | below
    from_excess = torch.where(special, g_eta, x) + lam * (excess(torch.where(special, 0.0, t), spec) + limits)
    from_value = g_eta + lam * psi_star(torch.where(direct, t, t_direct_max), spec, 0)
    return torch.where(direct, from_value, from_excess)
