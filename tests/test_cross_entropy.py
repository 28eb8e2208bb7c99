"""The fused DRO cross-entropy (from logits and from the LM head) against a float64 reference built from
F.linear, F.cross_entropy(reduction="none") and the DRO formula, on both backends."""
import math

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

import dro_ext
import reference as ref
from reference import DTYPES
from dro_ext import _backend

native_only = pytest.mark.skipif(not _backend.native_available(), reason="native extension not built")
if not _backend.native_available() and not _backend._force_python:
    raise RuntimeError(f"dro_ext native extension failed to load: {_backend.load_error()}")

LAM, SCALE = 0.8, 1.3


class LargestAllocation(TorchDispatchMode):
    """The element count of the largest tensor an op allocates under it (``largest``): the memory tests' probe."""

    def __init__(self):
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        # In-place and out= ops write into a buffer that exists, views alias one: neither allocates.
        if not func._schema.is_mutable and not any(r.alias_info for r in func._schema.returns):
            for t in out if isinstance(out, (tuple, list)) else (out,):
                if isinstance(t, torch.Tensor):
                    self.largest = max(self.largest, t.numel())
        return out


def reference_value(logits, targets, eta, lam, name, params, ignore_index=-100, label_smoothing=0.0, scale=SCALE):
    """The objective in float64 from F.cross_entropy's per-sample losses, over the kept rows (0 if none)."""
    losses = F.cross_entropy(logits, targets, reduction="none", ignore_index=ignore_index,
                             label_smoothing=label_smoothing)
    keep = targets != ignore_index
    if not bool(keep.any()):
        return (logits * 0).sum() + eta * 0
    return ref.dro_loss(losses[keep], eta, lam, name, params.get("alpha"), params.get("k"), scale)


def make_batch(n, c, dtype, ignore_every=3, ignore_index=-100):
    logits = torch.randn(n, c, dtype=torch.float64).to(dtype)
    targets = torch.randint(0, c, (n,))
    if n > 1:
        targets[::ignore_every] = ignore_index  # some ignored rows, never all of them
    # eta near the typical loss (log C), so t = (l - G eta)/lam falls on both sides of every kink.
    eta = torch.tensor((math.log(c) + 0.3) / SCALE, requires_grad=True)
    return logits.requires_grad_(), targets, eta


def grad_tolerances(dtype):
    # Gradients are compared after multiplying by n, where they are O(1): w_i (softmax - q). For float32 the
    # rounding of t to float32 moves w by psi*'' times a few ulps of t (cressie_read k > 2 is steep at its kink).
    tol = ref.tolerances(dtype)
    return dict(tol, atol=5e-5) if dtype == torch.float32 else tol


def check_against_reference(value, grads, logits, targets, eta, name, params, **kwargs):
    x64 = logits.detach().double().requires_grad_()
    e64 = eta.detach().double().requires_grad_()
    expected = reference_value(x64, targets, e64, LAM, name, params, **kwargs)
    exp_x, exp_eta = torch.autograd.grad(expected, (x64, e64))
    n = max(1, int((targets != kwargs.get("ignore_index", -100)).sum()))
    dtype = logits.dtype
    torch.testing.assert_close(value.double(), expected.detach(), **ref.tolerances(dtype))
    torch.testing.assert_close(grads[0].double() * n, exp_x * n, **grad_tolerances(dtype))
    # eta is a float32 parameter, so its gradient is float32 whatever the logits are.
    eta_tol = dict(rtol=1e-6, atol=1e-6) if dtype == torch.float64 else dict(rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(grads[1].double(), exp_eta, **eta_tol)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("n,c", [(1, 2), (7, 7), (1000, 7)])
@pytest.mark.parametrize("name,params", ref.CASES, ids=ref.CASE_IDS)
def test_dro_cross_entropy_matches_float64_reference(backend, name, params, n, c, dtype):
    logits, targets, eta = make_batch(n, c, dtype)
    value = dro_ext.dro_cross_entropy(logits, targets, eta, LAM, name, scale=SCALE, **params)
    assert value.dtype == ref.cross_entropy_value_dtype(dtype) and value.dim() == 0
    grads = torch.autograd.grad(value, (logits, eta))
    assert grads[0].dtype == dtype and grads[0].shape == logits.shape and grads[1].dtype == torch.float32
    check_against_reference(value, grads, logits, targets, eta, name, params)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("n", [1, 7])
@pytest.mark.parametrize("name,params", [("chi2", {}), ("kl", {}), ("smoothed_cvar", {"alpha": 0.1})],
                         ids=["chi2", "kl", "smoothed_cvar"])
def test_dro_cross_entropy_vocabulary_50257(backend, name, params, n, dtype):
    logits, targets, eta = make_batch(n, 50257, dtype)
    value = dro_ext.dro_cross_entropy(logits, targets, eta, LAM, name, scale=SCALE, **params)
    grads = torch.autograd.grad(value, (logits, eta))
    check_against_reference(value, grads, logits, targets, eta, name, params)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("label_smoothing", [0.1, 1.0])
@pytest.mark.parametrize("name,params", [("chi2", {}), ("cvar", {"alpha": 0.3}), ("cressie_read", {"k": 1.5})],
                         ids=["chi2", "cvar", "cressie_read"])
def test_label_smoothing_and_ignore_index(backend, name, params, label_smoothing, dtype):
    logits, targets, eta = make_batch(300, 33, dtype, ignore_every=4, ignore_index=5)
    value = dro_ext.dro_cross_entropy(logits, targets, eta, LAM, name, scale=SCALE, ignore_index=5,
                                      label_smoothing=label_smoothing, **params)
    grads = torch.autograd.grad(value, (logits, eta))
    check_against_reference(value, grads, logits, targets, eta, name, params, ignore_index=5,
                            label_smoothing=label_smoothing)
    # Ignored rows get exactly zero gradient.
    assert (grads[0][targets == 5] == 0).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
def test_batch_shaped_and_non_contiguous_logits(backend, dtype):
    base = torch.randn(3, 11, 4, dtype=dtype)  # (batch, classes, time): classes moved last by a view
    logits = base.transpose(1, 2).requires_grad_()
    assert not logits.is_contiguous()
    targets = torch.randint(0, 11, (3, 4))
    targets[0, 1] = -100
    eta = torch.tensor(2.0, requires_grad=True)
    value = dro_ext.dro_cross_entropy(logits, targets, eta, LAM, "kl_cvar", alpha=0.2, scale=SCALE)
    grads = torch.autograd.grad(value, (logits, eta))
    assert grads[0].shape == logits.shape
    flat = logits.detach().reshape(-1, 11).requires_grad_()
    check_against_reference(value, (grads[0].reshape(-1, 11), grads[1]), flat, targets.reshape(-1), eta,
                            "kl_cvar", {"alpha": 0.2})


def test_every_row_ignored_gives_zero_and_zero_gradients(backend):
    logits = torch.randn(5, 9, requires_grad=True)
    hidden, weight = torch.randn(5, 4, requires_grad=True), torch.randn(9, 4, requires_grad=True)
    bias = torch.randn(9, requires_grad=True)
    targets = torch.full((5,), -100)
    eta = torch.tensor(0.4, requires_grad=True)
    value = dro_ext.dro_cross_entropy(logits, targets, eta, LAM, "chi2")
    assert value.item() == 0.0
    for g in torch.autograd.grad(value, (logits, eta)):
        assert (g == 0).all()
    value = dro_ext.dro_linear_cross_entropy(hidden, weight, targets, eta, LAM, "kl", bias=bias, chunk_size=2)
    assert value.item() == 0.0
    for g in torch.autograd.grad(value, (hidden, weight, bias, eta)):
        assert (g == 0).all()


@pytest.mark.parametrize("name,params", [("kl", {}), ("cressie_read", {"k": 3.0})])
def test_every_row_ignored_gives_zero_gradients_where_the_ignored_rows_would_overflow(backend, name, params):
    # An ignored row's loss stands at 0, whose t = (0 - eta)/lam = 200 overflows kl's weight: the row takes no part
    # in the value, so it must take none in the gradients either (the fallback once gave eta NaN: 0 * inf).
    logits = torch.randn(4, 6, requires_grad=True)
    eta = torch.tensor(-2.0, requires_grad=True)
    value = dro_ext.dro_cross_entropy(logits, torch.full((4,), -100), eta, 0.01, name, **params)
    assert value.item() == 0.0
    for g in torch.autograd.grad(value, (logits, eta)):
        assert (g == 0).all(), g


def test_overflowing_weight_moves_only_the_classes_it_moves(backend):
    # logits [0, 100] with target 0: l = 100, kl's weight e^100 overflows float32. The value is +inf (as dro_loss
    # gives it) and the gradient (w/n)(softmax - q) is -inf at the target and +inf at the other class; a class whose
    # residual is 0 (softmax and q both 0) gets 0. Native and fallback once gave [[nan, nan]] and [[nan, inf]].
    logits = torch.tensor([[0.0, 100.0, -200.0]], requires_grad=True)
    eta = torch.tensor(0.0, requires_grad=True)
    value = dro_ext.dro_cross_entropy(logits, torch.tensor([0]), eta, 1.0, "kl")
    grad_logits, grad_eta = torch.autograd.grad(value, (logits, eta))
    assert value.item() == math.inf
    assert grad_logits.tolist() == [[-math.inf, math.inf, 0.0]]
    assert grad_eta.item() == -math.inf


def test_empty_batch_gives_zero(backend):
    logits = torch.randn(0, 9, requires_grad=True)
    value = dro_ext.dro_cross_entropy(logits, torch.zeros(0, dtype=torch.long), 0.5, LAM, "chi2")
    assert value.item() == 0.0
    assert torch.autograd.grad(value, logits)[0].shape == (0, 9)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64], ids=str)
def test_linear_empty_batch_gives_zero_with_zero_gradients(backend, dtype):
    # (a rank or micro-batch without tokens; float16's two passes raised there, their dro_loss taking no empty batch)
    hidden = torch.zeros(0, 4, dtype=dtype, requires_grad=True)
    weight = torch.randn(3, 4).to(dtype).requires_grad_()
    bias = torch.randn(3).to(dtype).requires_grad_()
    eta = torch.tensor(0.5, requires_grad=True)
    value = dro_ext.dro_linear_cross_entropy(hidden, weight, torch.zeros(0, dtype=torch.long), eta, LAM, "kl",
                                             bias=bias)
    assert value.item() == 0.0
    grads = torch.autograd.grad(value, (hidden, weight, bias, eta))
    assert grads[0].shape == (0, 4) and all(not bool(g.any()) for g in grads[1:]), grads


def masked_batch(dtype=torch.float32):
    """Logits with masked classes (-inf), as a vocabulary mask or a constrained decoder gives: a masked prefix
    longer than a CUDA row block's threads and than the CPU kernel's block of a row (2048 logits, whose running
    sum came out NaN from an all-masked first block), single masked columns, and a row masked everywhere but its
    target. Targets are never masked (that loss is +inf)."""
    n, c = 6, 2100
    logits = torch.randn(n, c, dtype=torch.float64).to(dtype)
    targets = torch.randint(300, c, (n,))
    logits[0, :2060] = -math.inf
    targets[0] = 2070
    logits[1, ::7] = -math.inf
    logits[2, :] = -math.inf
    logits[2, targets[2]] = 0.5
    logits[3, 1:] = -math.inf
    targets[3] = 0
    targets[5] = -100
    keep = targets[:, None] == torch.arange(c)  # unmask each row's target
    logits[keep & (targets[:, None] >= 0)] = torch.randn(n, dtype=torch.float64).to(dtype)[(targets >= 0)]
    return logits.requires_grad_(), targets


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("name,params", [("chi2", {}), ("kl", {}), ("smoothed_cvar", {"alpha": 0.1})],
                         ids=["chi2", "kl", "smoothed_cvar"])
def test_masked_logits_are_left_out(backend, name, params, dtype):
    """A -inf logit adds nothing to its row's logsumexp and gets a zero gradient; the rest of the row is exact."""
    logits, targets = masked_batch(dtype=dtype)
    eta = torch.tensor(5.0 / SCALE, requires_grad=True)
    value = dro_ext.dro_cross_entropy(logits, targets, eta, LAM, name, scale=SCALE, **params)
    grads = torch.autograd.grad(value, (logits, eta))
    assert value.isfinite() and bool((grads[0][logits.detach() == -math.inf] == 0).all())
    check_against_reference(value, grads, logits, targets, eta, name, params)


@pytest.mark.parametrize("path", ["logits", "linear", "logits-groups", "linear-groups"])
@pytest.mark.parametrize("label_smoothing", [0.0, 0.1])
@pytest.mark.parametrize("name,params", [("kl", {}), ("chi2", {})], ids=["kl", "chi2"])
def test_confident_rows_at_large_logits_keep_float32_precision(backend, path, label_smoothing, name, params):
    """float32 rows whose logits sit far from 0 (here 50 to 200) with a confident target: the target's residual
    p_y - 1 and the loss are small differences, and must keep their own precision, not that of the logsumexp rounded
    at the logits' magnitude (which put 1 - p_y off by 7e-5 relatively at logits [64, 61]). Each path: from the
    logits, from the head (hidden = logits, weight = identity, exact), and both with one group per row."""
    generator = torch.Generator().manual_seed(11)
    rows, classes = 13, 7
    offset = 50 + 150 * torch.rand(rows, 1, generator=generator, dtype=torch.float64)
    logits = (offset + 2 * torch.rand(rows, classes, generator=generator, dtype=torch.float64)).float()
    targets = torch.randint(0, classes, (rows,), generator=generator)
    margin = 2 + 4 * torch.rand(rows, generator=generator, dtype=torch.float64)
    logits[torch.arange(rows), targets] = (logits.double().amax(dim=1) + margin).float()  # p_y from 0.8 to 0.99
    logits[0, :2], logits[0, 2:], targets[0] = torch.tensor([64.0, 61.0]), 40.0, 0
    eta = torch.tensor(0.1, requires_grad=True)
    groups = {"num_groups": rows, "groups": torch.arange(rows)} if path.endswith("groups") else {}
    x = logits.clone().requires_grad_()
    if path.startswith("linear"):
        value = dro_ext.dro_linear_cross_entropy(x, torch.eye(classes), targets, eta, 1.0, name,
                                                 label_smoothing=label_smoothing, **groups, **params)
    else:
        value = dro_ext.dro_cross_entropy(x, targets, eta, 1.0, name, label_smoothing=label_smoothing, **groups,
                                          **params)
    grad_logits, grad_eta = torch.autograd.grad(value, (x, eta))
    x64, e64 = logits.double().requires_grad_(), eta.detach().double().requires_grad_()
    losses64 = F.cross_entropy(x64, targets, reduction="none", label_smoothing=label_smoothing)
    expected = ref.dro_loss(losses64, e64, 1.0, name)
    row_scale, exp_logits, exp_eta = torch.autograd.grad(expected, (losses64, x64, e64))  # row_scale: w_i / n
    eps = torch.finfo(torch.float32).eps
    torch.testing.assert_close(value.double(), expected.detach(), rtol=8 * eps, atol=0)
    torch.testing.assert_close(grad_eta.double(), exp_eta, rtol=8 * eps, atol=8 * eps)
    # (w_i / n)(softmax_i - q_i) with the residual to a few roundings of the probabilities (absolute: p_y - 1 is
    # formed from p_y), the small probabilities relatively. The logsumexp rounded at 50 to 200 was 14 to 64 off.
    error = (grad_logits.double() - exp_logits).abs()
    allowed = 4 * eps * row_scale[:, None] + 16 * eps * exp_logits.abs()
    assert bool((error <= allowed).all()), f"worst error / allowed {float((error / allowed).max()):.3g}"


def test_nan_logit_is_not_dropped(backend):
    logits = torch.randn(6, 5)
    logits[2, 3] = float("nan")
    targets = torch.randint(0, 5, (6,))
    assert dro_ext.dro_cross_entropy(logits, targets, 0.5, LAM, "chi2").isnan()
    hidden, weight = torch.randn(6, 3), torch.randn(5, 3)
    hidden[4, 0] = float("nan")
    assert dro_ext.dro_linear_cross_entropy(hidden, weight, targets, 0.5, LAM, "chi2").isnan()


@pytest.mark.parametrize("grouped", [False, True], ids=["samples", "groups"])
def test_an_ignored_row_of_nan_logits_gets_a_zero_gradient(backend, grouped):
    """An ignored row takes no part in the value, whatever its logits: its gradient is 0, NaN logits included, on
    both backends (the fallback formed it as weight 0 times a NaN softmax: NaN, where the native kernel wrote 0). The
    other rows' gradients are those of a batch whose ignored row is finite."""
    targets = torch.tensor([-100, 2, 4, 1, 0, 3])
    options = dict(groups=torch.tensor([0, 1, 0, 1, 1, 0]), num_groups=2) if grouped else {}
    logits = torch.randn(6, 5, generator=torch.Generator().manual_seed(3))
    hidden, weight = torch.randn(6, 3), torch.randn(5, 3)
    grads = []
    for bad in (math.nan, 0.25):
        x, h = logits.clone(), hidden.clone()
        x[0, 1], h[0, 2] = bad, bad
        x.requires_grad_(), h.requires_grad_()
        (grad_x,) = torch.autograd.grad(dro_ext.dro_cross_entropy(x, targets, 0.5, LAM, "kl", **options), x)
        (grad_h,) = torch.autograd.grad(dro_ext.dro_linear_cross_entropy(h, weight, targets, 0.5, LAM, "kl",
                                                                         chunk_size=4, **options), h)
        assert (grad_x[0] == 0).all() and (grad_h[0] == 0).all(), (grad_x[0], grad_h[0])
        grads.append((grad_x, grad_h))
    for got, want in zip(*grads):
        assert torch.equal(got, want)


@pytest.mark.parametrize("name,params", ref.CASES, ids=ref.CASE_IDS)
def test_infinite_row_loss_makes_the_objective_infinite(backend, name, params):
    """A row whose target logit is -inf has a cross-entropy of +inf, and the objective is +inf, as the reference's
    (never NaN, though it is formed as l + lam (psi*(t) - t), which is inf - inf there); likewise from the LM head
    with a bias of -inf on the row's target class."""
    logits, targets, eta = make_batch(7, 5, torch.float32)  # rows 0, 3 and 6 are ignored
    logits = logits.detach()
    logits[1, targets[1]] = -math.inf
    value = dro_ext.dro_cross_entropy(logits, targets, eta, LAM, name, scale=SCALE, **params)
    expected = reference_value(logits.double(), targets, eta.detach().double(), LAM, name, params)
    assert float(expected) == math.inf and float(value.detach()) == math.inf
    hidden, weight, bias = torch.randn(7, 3), torch.randn(5, 3), torch.randn(5)
    bias[targets[1]] = -math.inf
    value = dro_ext.dro_linear_cross_entropy(hidden, weight, targets, eta, LAM, name, bias=bias, scale=SCALE,
                                             **params)
    assert float(value.detach()) == math.inf


# lam where float32 cannot form a row's DRO terms: 1/lam beyond float32's normal range (1e-44, 1e-39), lam itself
# beyond it (1e39), and psi*(t) overflowing where lam psi*(t) does not (cressie_read, chi2 at 1e-36).
LAMS_BEYOND_FLOAT32 = [1e-44, 1e-39, 1e-36, 1e39]


def exact_objective(logits64, targets, eta, lam, name, params, scale=SCALE):
    """(value, dL/dlogits, dL/deta) from float64 logits, each row's lam psi*(t) + G eta and psi*'(t) taken exactly
    (reference.mp_conjugate, at 120 digits around it): the float64 formulas fail at these t (psi*(t) rounds to 0
    against lam = 1e39, e^t overflows at t = 1e39 where smoothed_cvar's value does not). A row whose weight float64
    cannot hold gets an infinite gradient (NaN where its residual is 0, which the comparison leaves out)."""
    keep = targets != -100
    losses = F.cross_entropy(logits64, targets, reduction="none")
    n = int(keep.sum())
    weights = torch.zeros_like(losses)
    with ref.mp.workdps(120):
        shift, lam_mp = ref.mp.mpf(scale) * ref.mp.mpf(float(eta)), ref.mp.mpf(lam)
        total = ref.mp.mpf(0)
        for i in torch.nonzero(keep).flatten().tolist():
            value, weight, _ = ref.mp_conjugate((ref.mp.mpf(float(losses[i])) - shift) / lam_mp, name,
                                                params.get("alpha"), params.get("k"))
            total += lam_mp * value + shift
            weights[i] = float(weight)
        value = float(total / n)
    residual = torch.softmax(logits64, dim=1) - F.one_hot(torch.where(keep, targets, 0), logits64.shape[1])
    grad_logits = torch.where(keep[:, None], weights[:, None] / n * residual, 0.0)
    return value, grad_logits, float(scale * (1 - weights.sum() / n)), weights / n


def assert_rows_match_where_weights_fit(got, want, fits, tol, nan_free=True):
    """got (any dtype) against the float64 want, on the rows whose weight w_i/n float32 holds (fits), relative to the
    largest of them: a row whose weight overflows the accumulate dtype has an infinite gradient (documented), and
    none may be NaN (nan_free; a hidden state's gradient, that row's logits' +-inf times the weight matrix, is)."""
    assert not (got if nan_free else got[fits]).isnan().any()
    # The entries beyond got's dtype are its infinities; the rest compare relative to the largest.
    got, want = got[fits].double(), want[fits].to(got.dtype).double()
    beyond = want.isinf()
    assert torch.equal(got[beyond], want[beyond])
    got, want = got[~beyond], want[~beyond]
    size = float(want.abs().max()) if want.numel() else 0.0
    if size > 0:
        torch.testing.assert_close(got / size, want / size, **tol)


@pytest.mark.parametrize("lam", LAMS_BEYOND_FLOAT32, ids=str)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("path", ["logits", "linear"])
@pytest.mark.parametrize("name,params", ref.CASES, ids=ref.CASE_IDS)
def test_a_lam_beyond_float32_matches_the_exact_objective(backend, name, params, path, dtype, lam):
    """Where float32 cannot form t = (l - G eta)/lam or psi*(t), the row terms are formed in float64, on both
    backends. They were not: cvar's value came out inf for losses near 5 at lam = 1e-39, every divergence's NaN at
    lam = 1e39, cressie_read's inf for 1e18 at lam = 1e-36."""
    check_lam_beyond_float32(name, params, path, dtype, lam, "cpu")


def check_lam_beyond_float32(name, params, path, dtype, lam, device):
    """The value is the exact one rounded to the dtype (inf where that overflows); the gradients are compared on
    the rows whose weight float32 holds."""
    torch.manual_seed(0)
    n, c = 13, 7
    targets = torch.randint(0, c, (n,))
    targets[::4] = -100
    eta_value = 1.5
    eta = torch.tensor(eta_value, device=device, requires_grad=True)
    if path == "logits":
        logits = torch.randn(n, c, dtype=torch.float64).to(dtype).to(device).requires_grad_()
        value = dro_ext.dro_cross_entropy(logits, targets.to(device), eta, lam, name, scale=SCALE, **params)
        inputs = [logits, eta]
        logits64 = logits.detach().cpu().double()
    else:
        hidden = torch.randn(n, 5, dtype=torch.float64).to(dtype).to(device).requires_grad_()
        weight = torch.randn(c, 5, dtype=torch.float64).to(dtype).to(device).requires_grad_()
        value = dro_ext.dro_linear_cross_entropy(hidden, weight, targets.to(device), eta, lam, name, scale=SCALE,
                                                 chunk_size=4, **params)
        inputs = [hidden, weight, eta]
        # As the op's matmuls round them: a chunk of 4 rows at a time.
        logits64 = torch.cat([torch.mm(h, weight.detach().t()) for h in hidden.detach().split(4)]).cpu().double()
    grads = [g.cpu() for g in torch.autograd.grad(value, inputs)]
    exact, grad_logits, grad_eta, row_weights = exact_objective(logits64, targets, eta_value, lam, name, params)
    float32_max = torch.finfo(torch.float32).max
    fits = row_weights.abs() <= float32_max  # the rows whose weight w_i/n float32 holds
    tol = dict(rtol=1e-4, atol=1e-4) if dtype == torch.float32 else ref.tolerances(dtype)
    expected_value = torch.tensor(exact, dtype=torch.float64).to(ref.cross_entropy_value_dtype(dtype))
    torch.testing.assert_close(value.cpu(), expected_value, **tol)
    if path == "logits":
        assert_rows_match_where_weights_fit(grads[0], grad_logits, fits, tol)
    else:
        hidden64, weight64 = (t.detach().cpu().double() for t in inputs[:2])
        assert_rows_match_where_weights_fit(grads[0], torch.where(fits[:, None], grad_logits, 0.0) @ weight64, fits,
                                            tol, nan_free=False)
        # The weight's gradient where no row's weight overflows and the matmul's float32 sums cannot on the way
        # (their terms' magnitudes sum within float32).
        magnitudes = torch.where(fits[:, None], grad_logits.abs(), math.inf).t() @ hidden64.abs()
        bounded = (magnitudes <= float32_max).flatten()
        if bool(bounded.any()):
            assert_close_to_scale(grads[1].double().flatten()[bounded],
                                  (grad_logits.t() @ hidden64).flatten()[bounded], tol)
    torch.testing.assert_close(grads[-1], torch.tensor(grad_eta, dtype=torch.float32), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("eta_dtype, eta_value, scale", ref.SHIFTS_FLOAT32_DOES_NOT_HOLD, ids=ref.SHIFT_IDS)
@pytest.mark.parametrize("path", ["logits", "linear"])
@pytest.mark.parametrize("name,params", ref.CASES, ids=ref.CASE_IDS)
def test_a_shift_float32_does_not_hold_is_not_rounded_to_it(backend, name, params, path, eta_dtype, eta_value, scale):
    """Each row's t = (l_i - G eta)/lam is formed from G eta as given, not from its float32 rounding (CUDA rounded
    it, moving every t by up to 0.6 here)."""
    check_shift_float32_does_not_hold(name, params, path, eta_dtype, eta_value, scale, "cpu")


def check_shift_float32_does_not_hold(name, params, path, eta_dtype, eta_value, scale, device):
    """Rows whose cross-entropy is ref.losses_near_a_shift_float32_does_not_hold() exactly, in any precision: two
    classes, logits 0 and -(1e6 + j/16) at the target (the linear path through an identity weight). The target's
    softmax is then e^-(1e6 + j/16) = 0, the other's 1, so the target logit's gradient is -w_i / N."""
    rows, classes = 24, 2
    targets = torch.arange(rows) % classes
    losses = ref.losses_near_a_shift_float32_does_not_hold(rows)
    logits = torch.zeros(rows, classes)
    logits[torch.arange(rows), targets] = -losses
    assert torch.equal(F.cross_entropy(logits.double(), targets, reduction="none"), losses.double())
    logits = logits.to(device).requires_grad_()
    eta = torch.tensor(eta_value, dtype=eta_dtype, device=device, requires_grad=True)
    lam, kw = ref.LAM_BELOW_THE_SHIFTS_SPACING, ref.case_kwargs(params)
    if path == "logits":
        value = dro_ext.dro_cross_entropy(logits, targets.to(device), eta, lam, name, scale=scale, **kw)
    else:
        identity = torch.eye(classes, device=device)
        value = dro_ext.dro_linear_cross_entropy(logits, identity, targets.to(device), eta, lam, name, scale=scale,
                                                 chunk_size=7, **kw)
    grad_logits, grad_eta = torch.autograd.grad(value, (logits, eta))
    weights = -grad_logits.cpu()[torch.arange(rows), targets] * rows
    ref.assert_exact_at_a_shift_float32_does_not_hold("w", value.cpu(), weights, grad_eta.cpu(), losses, eta.cpu(),
                                                      name, scale, **kw)


# ---------------------------------------------------------------------------------------------------
# dro_linear_cross_entropy
# ---------------------------------------------------------------------------------------------------


def linear_reference(inputs, dtype, with_bias):
    """F.linear in float64, differentiable, whose VALUE is the logits rounded as the op's matmul in ``dtype``
    rounds them (straight through): the float64 reference then sees the logits the kernel saw, so a row whose
    t sits within rounding of a kink (cvar) is weighted alike on both sides."""
    inputs64 = [t.detach().double().requires_grad_() for t in inputs]
    bias64 = inputs64[2] if with_bias else None
    logits64 = F.linear(inputs64[0], inputs64[1], bias64)
    with torch.no_grad():
        rounded = F.linear(*(t.detach() for t in inputs[:2]), inputs[2].detach() if with_bias else None).double()
    return inputs64, rounded + (logits64 - logits64.detach())


def assert_close_to_scale(got, want, tol):
    # A gradient that a matmul in the input dtype produces is accurate relative to the size of its terms, not
    # elementwise: an entry that cancels to near zero keeps the absolute error of the large ones.
    torch.testing.assert_close(got, want, rtol=tol["rtol"], atol=max(tol["atol"], 2 * tol["rtol"] * float(
        want.abs().max())))


LINEAR_SHAPES = [(1, 2, None, False), (7, 7, 3, True), (1000, 7, 64, True)]  # (N, V, chunk_size, bias)
LINEAR_VOCAB_50257 = [(7, 50257, 2, True)]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("n,v,chunk,with_bias", LINEAR_SHAPES, ids=lambda p: str(p))
@pytest.mark.parametrize("name,params", ref.CASES, ids=ref.CASE_IDS)
def test_linear_cross_entropy_matches_float64_reference(backend, name, params, n, v, chunk, with_bias, dtype):
    check_linear_against_reference(name, params, n, v, chunk, with_bias, dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float64], ids=str)
@pytest.mark.parametrize("n,v,chunk,with_bias", LINEAR_VOCAB_50257, ids=lambda p: str(p))
@pytest.mark.parametrize("name,params", [("chi2", {}), ("smoothed_cvar", {"alpha": 0.1})],
                         ids=["chi2", "smoothed_cvar"])
def test_linear_cross_entropy_vocabulary_50257(backend, name, params, n, v, chunk, with_bias, dtype):
    check_linear_against_reference(name, params, n, v, chunk, with_bias, dtype)


def check_linear_against_reference(name, params, n, v, chunk, with_bias, dtype):
    h = 16
    hidden = (torch.randn(n, h, dtype=torch.float64) / math.sqrt(h)).to(dtype).requires_grad_()
    weight = torch.randn(v, h, dtype=torch.float64).to(dtype).requires_grad_()
    bias = (0.1 * torch.randn(v, dtype=torch.float64)).to(dtype).requires_grad_() if with_bias else None
    targets = torch.randint(0, v, (n,))
    if n > 1:
        targets[1::3] = -100
    eta = torch.tensor((math.log(v) + 0.3) / SCALE, requires_grad=True)
    value = dro_ext.dro_linear_cross_entropy(hidden, weight, targets, eta, LAM, name, bias=bias, scale=SCALE,
                                             chunk_size=chunk, label_smoothing=0.05, **params)
    inputs = [hidden, weight] + ([bias] if with_bias else []) + [eta]
    grads = torch.autograd.grad(value, inputs)
    assert value.dtype == ref.cross_entropy_value_dtype(dtype)
    assert all(g.dtype == i.dtype for g, i in zip(grads, inputs))

    inputs64, logits64 = linear_reference(inputs, dtype, with_bias)
    expected = reference_value(logits64, targets, inputs64[-1], LAM, name, params, label_smoothing=0.05)
    exp_grads = torch.autograd.grad(expected, inputs64)
    tol = ref.tolerances(dtype)
    torch.testing.assert_close(value.double(), expected.detach(), **tol)
    kept = int((targets != -100).sum())
    for got, want in zip(grads[:-1], exp_grads[:-1]):  # per-sample gradients are O(1/n): compare n times them
        assert_close_to_scale(got.double() * kept, want * kept, grad_tolerances(dtype))
    # eta is a float32 parameter; its gradient comes from float32 sums of the weights.
    torch.testing.assert_close(grads[-1].double(), exp_grads[-1], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("device_type", ["cpu", "cuda"])
@pytest.mark.parametrize("rows,hidden,vocab,element_size", [(2048, 1024, 32000, 4), (16384, 4096, 128256, 2),
                                                             (7, 16, 23, 4), (100000, 64, 50257, 8)])
def test_default_chunk_size_holds_about_its_device_budget_of_logits(device_type, rows, hidden, vocab, element_size):
    from dro_ext.cross_entropy import CHUNK_LOGIT_BYTES, default_chunk_size
    chunk = default_chunk_size(rows, hidden, vocab, element_size, device_type)
    assert 1 <= chunk <= rows and chunk & (chunk - 1) == 0 or chunk == rows
    budget_rows = CHUNK_LOGIT_BYTES[device_type] // (vocab * element_size)
    # A power of two within a factor 2 of the budget (or of N / ceil(V / H) rows, whichever is larger), capped by N.
    matched = -(-rows // -(-vocab // hidden))
    target = max(budget_rows, matched, 1)
    assert chunk == rows or target / 2 < chunk <= target


@pytest.mark.parametrize("chunk", [1, 5, 7, 100])
def test_linear_chunking_does_not_change_the_result(backend, chunk):
    hidden, weight = torch.randn(7, 6, dtype=torch.float64), torch.randn(13, 6, dtype=torch.float64)
    hidden.requires_grad_()
    targets = torch.randint(0, 13, (7,))
    eta = torch.tensor(2.0, dtype=torch.float64, requires_grad=True)
    value = dro_ext.dro_linear_cross_entropy(hidden, weight, targets, eta, LAM, "kl", chunk_size=chunk)
    whole = dro_ext.dro_cross_entropy(hidden @ weight.T, targets, eta, LAM, "kl")
    torch.testing.assert_close(value, whole, rtol=1e-13, atol=1e-13)
    for a, b in zip(torch.autograd.grad(value, (hidden, eta)), torch.autograd.grad(whole, (hidden, eta))):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-13)


def test_linear_batch_shape_and_eval_without_gradients(backend):
    hidden, weight = torch.randn(2, 5, 8), torch.randn(11, 8, requires_grad=True)
    targets = torch.randint(0, 11, (2, 5))
    value = dro_ext.dro_linear_cross_entropy(hidden, weight, targets, 1.0, LAM, "cvar", alpha=0.5, chunk_size=3)
    expected = dro_ext.dro_cross_entropy(hidden @ weight.T, targets, 1.0, LAM, "cvar", alpha=0.5)
    torch.testing.assert_close(value, expected.detach())
    with torch.no_grad():
        evaluated = dro_ext.dro_linear_cross_entropy(hidden, weight, targets, 1.0, LAM, "cvar", alpha=0.5)
    assert not evaluated.requires_grad
    torch.testing.assert_close(evaluated, expected.detach())


def test_linear_eta_only_gradient(backend):
    hidden, weight = torch.randn(9, 4, dtype=torch.float64), torch.randn(6, 4, dtype=torch.float64)
    targets = torch.randint(0, 6, (9,))
    eta = torch.tensor(1.0, dtype=torch.float64, requires_grad=True)
    (got,) = torch.autograd.grad(dro_ext.dro_linear_cross_entropy(hidden, weight, targets, eta, LAM, "chi2"), eta)
    (want,) = torch.autograd.grad(dro_ext.dro_cross_entropy(hidden @ weight.T, targets, eta, LAM, "chi2"), eta)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


SECOND_DERIVATIVE_CALLS = {
    "cross_entropy_losses": (lambda x, h, w, y, eta, g: (dro_ext.cross_entropy_losses(x, y) ** 2).sum(),
                             "cross_entropy_losses"),
    "dro_loss of cross_entropy_losses": (
        lambda x, h, w, y, eta, g: dro_ext.dro_loss(dro_ext.cross_entropy_losses(x, y), eta, 0.5),
        "cross_entropy_losses"),
    "dro_cross_entropy": (lambda x, h, w, y, eta, g: dro_ext.dro_cross_entropy(x, y, eta, 0.5) ** 2,
                          "dro_cross_entropy"),
    "dro_cross_entropy over groups": (
        lambda x, h, w, y, eta, g: dro_ext.dro_cross_entropy(x, y, eta, 0.5, groups=g, num_groups=2),
        "cross_entropy_losses"),
    "linear_cross_entropy_losses": (
        lambda x, h, w, y, eta, g: (dro_ext.linear_cross_entropy_losses(h, w, y) ** 2).sum(),
        "linear_cross_entropy_losses"),
    "dro_linear_cross_entropy": (lambda x, h, w, y, eta, g: dro_ext.dro_linear_cross_entropy(h, w, y, eta, 0.5) ** 2,
                                 "dro_linear_cross_entropy"),
    "dro_linear_cross_entropy over groups": (
        lambda x, h, w, y, eta, g: dro_ext.dro_linear_cross_entropy(h, w, y, eta, 0.5, groups=g, num_groups=2),
        "linear_cross_entropy_losses"),
}


def check_a_second_derivative_raises(call, device):
    """The cross-entropies' backwards are first order only (kernels, and a logsumexp saved detached): where autograd
    records them (create_graph=True) the gradient is the plain one, and differentiating it again raises naming the op,
    where it returned a wrong Hessian-vector product before (0 on the native path, another wrong number on the
    fallback; through dro_loss, a zero mixed derivative in eta)."""
    fn, op = SECOND_DERIVATIVE_CALLS[call]
    gen = torch.Generator().manual_seed(8)

    def leaf(*shape):
        return torch.randn(shape, generator=gen, dtype=torch.float64).to(device).requires_grad_()

    x, h, w, eta = leaf(5, 6), leaf(5, 3), leaf(6, 3), leaf()
    y, groups = torch.tensor([0, 5, 2, 3, 1], device=device), torch.tensor([0, 1, 0, 1, 1], device=device)
    inputs = (x, eta) if "linear" not in call else (h, w, eta)
    plain = torch.autograd.grad(fn(x, h, w, y, eta, groups), inputs, allow_unused=True)
    recorded = torch.autograd.grad(fn(x, h, w, y, eta, groups), inputs, create_graph=True, allow_unused=True)
    for a, b in zip(plain, recorded):
        assert (a is None) == (b is None)
        if a is not None:  # (dro_loss's recorded backward forms eta's gradient by other, differentiable, ops)
            torch.testing.assert_close(b, a, rtol=1e-13, atol=0)
    first = recorded[0]
    assert first.requires_grad
    with pytest.raises(RuntimeError, match=f"derivative for dro_ext::{op}'s backward is not implemented"):
        torch.autograd.grad((first * torch.ones_like(first).cumsum(0)).sum(), inputs, allow_unused=True)


@pytest.mark.parametrize("call", list(SECOND_DERIVATIVE_CALLS))
def test_a_second_derivative_raises_and_a_recorded_first_one_is_the_first(backend, call):
    check_a_second_derivative_raises(call, "cpu")


# Each call as a training step writes it (the value itself, or a sum of the per-token losses), with the inputs it is
# differentiable in; bias is passed to the linear ones.
SINGLE_INPUT_CALLS = {
    "cross_entropy_losses": (lambda x, h, w, b, y, eta, g: dro_ext.cross_entropy_losses(x, y).sum(), ("x",)),
    "dro_cross_entropy": (lambda x, h, w, b, y, eta, g: dro_ext.dro_cross_entropy(x, y, eta, 0.5), ("x", "eta")),
    "dro_cross_entropy over groups": (
        lambda x, h, w, b, y, eta, g: dro_ext.dro_cross_entropy(x, y, eta, 0.5, groups=g, num_groups=2),
        ("x", "eta")),
    "linear_cross_entropy_losses": (
        lambda x, h, w, b, y, eta, g: dro_ext.linear_cross_entropy_losses(h, w, y, bias=b).sum(), ("h", "w", "b")),
    "dro_linear_cross_entropy": (
        lambda x, h, w, b, y, eta, g: dro_ext.dro_linear_cross_entropy(h, w, y, eta, 0.5, bias=b),
        ("h", "w", "b", "eta")),
    "dro_linear_cross_entropy over groups": (
        lambda x, h, w, b, y, eta, g: dro_ext.dro_linear_cross_entropy(h, w, y, eta, 0.5, bias=b, groups=g,
                                                                        num_groups=2),
        ("h", "w", "b", "eta")),
}


def check_a_second_derivative_through_one_input_raises(call, device):
    """A gradient recorded (create_graph=True) straight from the value, as a gradient penalty takes it, with one
    input alone requiring grad (a frozen LM head, a fixed or a learned eta): differentiating it again raises (or,
    where the backward is differentiable, gives the second derivative). It
    came back as a constant before in two cases (dro_linear_cross_entropy's recorded against the upstream gradient
    alone, the native dro_cross_entropy's eta gradient against the logits alone), so that a penalty on it added
    nothing to a backward, without an error."""
    fn, names = SINGLE_INPUT_CALLS[call]
    gen = torch.Generator().manual_seed(9)
    values = {"x": (5, 6), "h": (5, 3), "w": (6, 3), "b": (6,), "eta": ()}
    y, groups = torch.tensor([0, 5, 2, 3, 1], device=device), torch.tensor([0, 1, 0, 1, 1], device=device)
    for name in names:
        tensors = {n: torch.randn(shape, generator=gen, dtype=torch.float64).to(device) for n, shape in values.items()}
        wrt = tensors[name].requires_grad_()
        (recorded,) = torch.autograd.grad(fn(**tensors, y=y, g=groups), wrt, create_graph=True)
        (plain,) = torch.autograd.grad(fn(**tensors, y=y, g=groups), wrt)
        torch.testing.assert_close(recorded, plain, rtol=1e-13, atol=0)
        assert recorded.requires_grad, name
        if name == "eta" and "groups" in call:
            # Over groups, eta's gradient comes from the objective over the group means, whose backward is formed by
            # differentiable ops: its second derivative is the true one (central differences of the first).
            (second,) = torch.autograd.grad(recorded, wrt)

            def first(at):
                eta = torch.tensor(at, dtype=torch.float64, device=device, requires_grad=True)
                return torch.autograd.grad(fn(**{**tensors, "eta": eta}, y=y, g=groups), eta)[0].item()

            step = 1e-5
            central = (first(wrt.item() + step) - first(wrt.item() - step)) / (2 * step)
            assert second.item() == pytest.approx(central, rel=1e-6)
            continue
        with pytest.raises(RuntimeError, match="derivative for dro_ext::.*'s backward is not implemented"):
            torch.autograd.grad((recorded * torch.ones_like(recorded).cumsum(-1)).sum(), wrt)


@pytest.mark.parametrize("call", list(SINGLE_INPUT_CALLS))
def test_a_second_derivative_through_one_input_raises(backend, call):
    check_a_second_derivative_through_one_input_raises(call, "cpu")


GRAD_SCALER_CALLS = [f"{form}-{kind}" for form in ("logits", "linear") for kind in ("tokens", "groups")]


def check_a_grad_scaler_scale_reaches_float16_gradients(call: str, device) -> None:
    """GradScaler multiplies the loss by 2^16 (its default first scale), past float16's largest number: the value is
    float32 (as F.cross_entropy's under autocast), so that scale reaches the float16 gradients as a factor of their
    float32 products, rounded once. A float16 value's gradient was inf, which skipped the step."""
    form, kind = call.split("-")
    gen = torch.Generator().manual_seed(21)
    targets = torch.randint(0, 13, (2, 5), generator=gen).to(device)
    targets[1, 2] = -100
    groups = dict(groups=torch.tensor([1, 0], device=device), num_groups=2) if kind == "groups" else {}
    if form == "logits":
        inputs = [torch.randn(2, 5, 13, generator=gen).half().to(device).requires_grad_()]
    else:
        inputs = [(torch.randn(2, 5, 8, generator=gen) / 3).half().to(device).requires_grad_(),
                  (torch.randn(13, 8, generator=gen) / 8).half().to(device).requires_grad_(),
                  torch.randn(13, generator=gen).half().to(device).requires_grad_()]
    eta = torch.tensor(0.5, device=device, requires_grad=True)

    def value():
        if form == "logits":
            return dro_ext.dro_cross_entropy(inputs[0], targets, eta, LAM, "chi2", **groups)
        return dro_ext.dro_linear_cross_entropy(inputs[0], inputs[1], targets, eta, LAM, "chi2", bias=inputs[2],
                                                chunk_size=4, **groups)

    unit = value()
    assert unit.dtype == torch.float32
    unit_grads = torch.autograd.grad(unit, inputs + [eta])
    scale = torch.tensor(2.0 ** 16, device=device)
    scaled_grads = torch.autograd.grad(value() * scale, inputs + [eta])
    for got, want in zip(scaled_grads, unit_grads):
        # (the test's premise: each scaled float16 gradient still fits; eta's is float32)
        assert want.dtype != torch.float16 or float(want.abs().max()) * 2.0 ** 16 < torch.finfo(torch.float16).max
        assert got.dtype == want.dtype and bool(torch.isfinite(got).all()), call
        expected = (want.double() * 2.0 ** 16).to(want.dtype)  # the float32 product, rounded once
        torch.testing.assert_close(got, expected, rtol=1e-3, atol=0)


def test_float16_linear_gradients_keep_what_the_grad_scaler_scale_keeps(backend):
    """Under float16 autocast and GradScaler's 2^16, the fused linear cross-entropy's gradients are as good as those
    of F.linear + dro_cross_entropy. It formed them in the forward at a unit upstream gradient: each logit's
    (w_i / N)(p - y) of 16384 tokens over 2048 classes lay in float16's subnormals, and the scale applied in backward
    could not restore them (the weight gradient of the rows no token targets was 90% off)."""
    gen = torch.Generator().manual_seed(3)
    n, h_size, vocab = 16384, 8, 2048
    eta = 7.5  # near the losses (log 2048 = 7.6): weights near 1, each logit's gradient near p / N
    hidden = torch.randn(n, h_size, generator=gen) * 0.5
    weight = torch.randn(vocab, h_size, generator=gen) * 0.05
    targets = torch.randint(0, 64, (n,), generator=gen)  # rows 64 and up are nobody's target: the softmax term alone
    targets[::97] = -100
    # float64 reference of the same float16 operands and logits (as autocast's F.linear rounds them)
    h64, w64 = hidden.half().double().requires_grad_(), weight.half().double().requires_grad_()
    z = h64 @ w64.T
    z = z + (z.detach().half().double() - z.detach())
    dro_ext.dro_cross_entropy(z, targets, eta, LAM).backward()

    def gradients(fused):
        h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
        with torch.autocast("cpu", dtype=torch.float16):
            value = (dro_ext.dro_linear_cross_entropy(h, w, targets, eta, LAM) if fused
                     else dro_ext.dro_cross_entropy(F.linear(h, w), targets, eta, LAM))
        (value * 2.0**16).backward()
        return h.grad.double() / 2.0**16, w.grad.double() / 2.0**16

    def error(got, want):
        return float((got - want).norm() / want.norm())

    fused = gradients(True)
    for got, unfused, want in zip(fused, gradients(False), (h64.grad, w64.grad)):
        assert error(got, want) <= 2 * error(unfused, want) + 1e-4, (error(got, want), error(unfused, want))
    # the rows of the classes no token targets
    assert error(fused[1][64:], w64.grad[64:]) <= 2e-3


@pytest.mark.parametrize("call", GRAD_SCALER_CALLS)
def test_a_grad_scaler_scale_reaches_float16_gradients(backend, call):
    check_a_grad_scaler_scale_reaches_float16_gradients(call, "cpu")


@pytest.mark.parametrize("with_groups", [False, True], ids=["tokens", "groups"])
def test_linear_ops_under_autocast_take_their_operands_as_f_linear_does(backend, with_groups):
    """Under autocast a model's bfloat16 hidden states meet the float32 master weight of its head: the linear
    cross-entropies cast both to autocast's dtype, as F.linear does (they raised on the dtypes before), and give
    F.linear + F.cross_entropy's per-token losses there; the gradients come back in float32."""
    gen = torch.Generator().manual_seed(12)
    hidden = torch.randn(2, 9, 8, generator=gen).requires_grad_()
    weight, bias = torch.randn(11, 8, generator=gen).requires_grad_(), torch.randn(11, generator=gen).requires_grad_()
    targets = torch.randint(0, 11, (2, 9), generator=gen)
    targets[0, 3] = -100
    groups = dict(groups=torch.tensor([0, 1]), num_groups=2) if with_groups else {}
    with torch.autocast("cpu", dtype=torch.bfloat16):
        body = hidden * 1.0  # stands for the model's last layer (autocast leaves a mul in float32)
        losses = dro_ext.linear_cross_entropy_losses(body.bfloat16(), weight, targets, bias=bias)
        want = F.cross_entropy(F.linear(body.bfloat16(), weight, bias).transpose(1, 2), targets, reduction="none")
        value = dro_ext.dro_linear_cross_entropy(body.bfloat16(), weight, targets, 0.2, LAM, "kl", bias=bias,
                                                 **groups)
    torch.testing.assert_close(losses, want, rtol=2e-6, atol=2e-6)  # (float32 losses of the same bfloat16 logits)
    cast = dict(weight=weight.bfloat16(), bias=bias.bfloat16())
    torch.testing.assert_close(value, dro_ext.dro_linear_cross_entropy(
        hidden.bfloat16(), cast["weight"], targets, 0.2, LAM, "kl", bias=cast["bias"], **groups), rtol=0, atol=0)
    grads = torch.autograd.grad(value, (hidden, weight, bias))
    assert [g.dtype for g in grads] == [torch.float32] * 3
    # float64 stays float64 under autocast, as F.linear keeps it (it was cast down, 2e-2 off)
    h64, w64 = hidden.detach().double(), weight.detach().double()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = dro_ext.linear_cross_entropy_losses(h64, w64, targets)
        want = F.cross_entropy(F.linear(h64, w64).transpose(1, 2), targets, reduction="none")
    assert got.dtype == want.dtype == torch.float64
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


def test_linear_op_keeps_none_of_its_inputs(backend):
    """The op saves one-element anchors for its inputs, not the inputs: no cast copy of the weight under autocast
    (V x H held until backward), and an input changed in place between forward and backward is no error, as
    before the anchors."""
    hidden = torch.randn(6, 8, requires_grad=True)
    weight, eta = torch.randn(11, 8, requires_grad=True), torch.tensor(0.3, requires_grad=True)
    targets = torch.randint(0, 11, (6,))
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            value = dro_ext.dro_linear_cross_entropy(hidden, weight, targets, eta, LAM)
    held = [t for t in saved if t is not None and t.shape == weight.shape]
    assert len(held) == 1, f"{len(held)} V x H tensors saved: the weight's gradient alone should be"
    with torch.no_grad():
        weight.mul_(2.0)
        eta.add_(1.0)
    torch.autograd.grad(value, (hidden, weight, eta))


@pytest.mark.parametrize("transform", ["torch.func.jvp", "forward_ad", "forward_ad, compiled"])
@pytest.mark.parametrize("call", list(SINGLE_INPUT_CALLS))
def test_forward_mode_ad_raises_naming_the_op(backend, call, transform):
    """Forward-mode AD through a cross-entropy raises naming it: PyTorch ran their autograd formulas, written in
    Python, under forward AD with a tangent of 0 (a directional derivative of 0, silently)."""
    fn, names = SINGLE_INPUT_CALLS[call]
    gen = torch.Generator().manual_seed(10)
    tensors = {n: torch.randn(shape, generator=gen, dtype=torch.float64)
               for n, shape in {"x": (5, 6), "h": (5, 3), "w": (6, 3), "b": (6,), "eta": ()}.items()}
    y, groups = torch.tensor([0, 5, 2, 3, 1]), torch.tensor([0, 1, 0, 1, 1])
    op = call.split(" ")[0]
    for name in names:
        def along(value):
            return fn(**{**tensors, name: value}, y=y, g=groups)

        if transform.endswith("compiled"):  # (a traced tensor shows no tangent: it returned none, silently)
            torch._dynamo.reset()
            along = torch.compile(along, backend="eager")
        with pytest.raises(RuntimeError, match=f"forward-mode AD is not implemented for {op}"):
            if transform == "torch.func.jvp":
                torch.func.jvp(along, (tensors[name],), (torch.ones_like(tensors[name]),))
            else:
                with torch.autograd.forward_ad.dual_level():
                    along(torch.autograd.forward_ad.make_dual(tensors[name], torch.ones_like(tensors[name])))


def test_linear_retained_graph_backward_twice(backend):
    hidden, weight = torch.randn(5, 4, requires_grad=True), torch.randn(6, 4)
    value = dro_ext.dro_linear_cross_entropy(hidden, weight, torch.randint(0, 6, (5,)), 1.0, LAM, "kl")
    (first,) = torch.autograd.grad(value * 2, hidden, retain_graph=True)
    (second,) = torch.autograd.grad(value * 3, hidden)
    torch.testing.assert_close(second, first * 1.5)


def test_linear_backward_accumulates_through_a_retained_graph(backend):
    # .grad accumulation across three backward passes, the first two retaining the graph: a backward that scaled
    # the forward's gradients in place, or an AccumulateGrad that kept them as .grad while the graph still held
    # them, would show here as a wrong sum.
    hidden = torch.randn(7, 5, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(9, 5, dtype=torch.float64, requires_grad=True)
    bias = torch.randn(9, dtype=torch.float64, requires_grad=True)
    targets = torch.randint(0, 9, (7,))
    eta = torch.tensor(1.5, dtype=torch.float64, requires_grad=True)
    value = dro_ext.dro_linear_cross_entropy(hidden, weight, targets, eta, LAM, "kl", bias=bias, chunk_size=3)
    whole = dro_ext.dro_cross_entropy(F.linear(hidden, weight, bias), targets, eta, LAM, "kl")
    once = torch.autograd.grad(whole * 2.0, (hidden, weight, bias, eta))
    for factor in (0.5, 1.0):
        (value * factor).backward(retain_graph=True)
    (value * 0.5).backward()
    for param, want in zip((hidden, weight, bias, eta), once):
        torch.testing.assert_close(param.grad, want, rtol=1e-12, atol=1e-13)


def test_linear_backward_allocates_no_second_weight_gradient(backend):
    # The forward computes the gradients for a unit upstream gradient; a backward that frees the graph scales
    # them in place and hands them on: no op in it may allocate a tensor of the weight's size (the peak-memory
    # target of the LM head rests on it), and the returned gradients are the forward's own buffers.
    hidden, weight = torch.randn(6, 16, requires_grad=True), torch.randn(50, 16, requires_grad=True)
    targets, eta = torch.randint(0, 50, (6,)), torch.tensor(3.0, requires_grad=True)
    value = dro_ext.dro_linear_cross_entropy(hidden, weight, targets, eta, LAM, "chi2", chunk_size=4)
    allocations = LargestAllocation()
    with allocations:
        grads = torch.autograd.grad(value * 0.25, (hidden, weight, eta))
    assert allocations.largest < hidden.numel()
    value = dro_ext.dro_linear_cross_entropy(hidden, weight, targets, eta, LAM, "chi2", chunk_size=4)
    torch.testing.assert_close(torch.autograd.grad(value, (hidden, weight, eta)), tuple(g * 4 for g in grads))


# ---------------------------------------------------------------------------------------------------
# Modules
# ---------------------------------------------------------------------------------------------------


def test_modules_own_eta_and_match_the_functions(backend):
    criterion = dro_ext.DROCrossEntropyLoss("smoothed_cvar", lam=0.5, alpha=0.2, eta_init=1.5, ignore_index=3,
                                            label_smoothing=0.1)
    assert isinstance(criterion.eta, torch.nn.Parameter) and "smoothed_cvar" in repr(criterion)
    logits, targets = torch.randn(20, 6, requires_grad=True), torch.randint(0, 6, (20,))
    loss = criterion(logits, targets)
    loss.backward()
    expected = dro_ext.dro_cross_entropy(logits, targets, 1.5, 0.5, "smoothed_cvar", alpha=0.2, ignore_index=3,
                                         label_smoothing=0.1)
    torch.testing.assert_close(loss, expected)
    assert criterion.eta.grad is not None and logits.grad is not None

    head = torch.nn.Linear(8, 6)
    linear = dro_ext.DROLinearCrossEntropyLoss("chi2", lam=0.5, eta_init=1.0, chunk_size=7)
    hidden = torch.randn(20, 8, requires_grad=True)
    loss = linear(hidden, head.weight, targets, head.bias)
    loss.backward()
    torch.testing.assert_close(loss, dro_ext.dro_cross_entropy(head(hidden), targets, 1.0, 0.5, "chi2"))
    assert all(p.grad is not None for p in (linear.eta, head.weight, head.bias, hidden))
    assert "chunk_size=7" in repr(linear)


@pytest.mark.parametrize("chunk_size", [0, -3, 2.5, True, "8"])
def test_linear_module_checks_chunk_size_at_construction(chunk_size):
    # As every other argument of the modules (it was accepted, and failed at the first forward).
    with pytest.raises(ValueError, match="chunk_size must be a positive int or None"):
        dro_ext.DROLinearCrossEntropyLoss("chi2", lam=0.5, chunk_size=chunk_size)


@pytest.mark.parametrize("with_bias", [False, True], ids=["no-bias", "bias"])
def test_linear_cross_entropy_of_a_hidden_size_zero_is_that_of_its_logits(backend, with_bias):
    check_hidden_size_zero(with_bias, "cpu")


def check_hidden_size_zero(with_bias, device):
    """H = 0: logits of zeros (plus the bias), as F.linear gives them (a reshape that could not infer the rows beside a
    0 raised before), with the bias's gradient; against the logits' own ops."""
    hidden = torch.randn(4, 0, dtype=torch.float64, device=device, requires_grad=True)
    weight = torch.randn(5, 0, dtype=torch.float64, device=device, requires_grad=True)
    bias = torch.randn(5, dtype=torch.float64, device=device, requires_grad=True) if with_bias else None
    targets, groups = torch.tensor([0, 4, 2, 1], device=device), torch.tensor([0, 1, 1, 0], device=device)
    leaves = [t for t in (hidden, weight, bias) if t is not None]
    calls = [
        (lambda: dro_ext.dro_linear_cross_entropy(hidden, weight, targets, 0.3, LAM, bias=bias),
         lambda x: dro_ext.dro_cross_entropy(x, targets, 0.3, LAM)),
        (lambda: dro_ext.dro_linear_cross_entropy(hidden, weight, targets, 0.3, LAM, bias=bias, groups=groups,
                                                  num_groups=2),
         lambda x: dro_ext.dro_cross_entropy(x, targets, 0.3, LAM, groups=groups, num_groups=2)),
        (lambda: dro_ext.linear_cross_entropy_losses(hidden, weight, targets, bias=bias).sum(),
         lambda x: F.cross_entropy(x, targets, reduction="sum")),
    ]
    for fused, composed in calls:
        got, want = fused(), composed(F.linear(hidden, weight, bias))
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
        for a, b in zip(torch.autograd.grad(got, leaves), torch.autograd.grad(want, leaves)):
            torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


# ---------------------------------------------------------------------------------------------------
# The custom-op contract, gradcheck, torch.compile
# ---------------------------------------------------------------------------------------------------


@native_only
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", [(1, 1), (7, 3), (300, 77), (129, 64), (1000, 257)], ids=str)
def test_logsumexp_columns_matches_float64_logsumexp(dtype, shape):
    # Fresh inputs of a wide range; odd sizes cover the partial vectors and slabs of the column blocks.
    matrix = (4 * torch.randn(shape, dtype=torch.float64)).to(dtype)
    got = torch.ops.dro_ext.logsumexp_columns(matrix)
    assert got.dtype == (torch.float64 if dtype == torch.float64 else torch.float32)
    assert got.shape == (shape[1], 2)
    # The shift is the column's max, and the log of the sum below it (at most log R) is within the rounding of a
    # float32 sum of R terms.
    torch.testing.assert_close(got[:, 0], matrix.to(got.dtype).amax(dim=0), rtol=0, atol=0)
    expected = torch.logsumexp(matrix.double() - got[:, :1].double().T, dim=0)
    torch.testing.assert_close(got[:, 1].double(), expected, rtol=1e-12 if dtype == torch.float64 else 2e-6,
                               atol=1e-14 if dtype == torch.float64 else 1e-5)
    # Non-contiguous input (read through a contiguous copy), and bitwise repeatable across thread counts.
    strided = torch.ops.dro_ext.logsumexp_columns(matrix.t().contiguous().t())
    assert torch.equal(strided, got)
    threads = torch.get_num_threads()
    try:
        for n in (1, 2):  # (the suite's workers may run at one thread already)
            torch.set_num_threads(n)
            assert torch.equal(torch.ops.dro_ext.logsumexp_columns(matrix), got)
    finally:
        torch.set_num_threads(threads)


@native_only
@pytest.mark.parametrize("rows", [300, 2048, 32000])
def test_logsumexp_columns_keeps_the_small_terms_after_a_confident_one(rows):
    # Each column: one term exp(0) = 1 (the target of a confident row) somewhere, and rows - 1 terms each below half
    # float32's step at 1, which a plain float32 sum after the 1 drops (a 32000-class loss came out 65% low). The
    # compensated sum keeps the log of the sum within a step at 1 of float64's.
    generator = torch.Generator().manual_seed(rows)
    columns = 9
    matrix = (-17.5 - torch.rand(rows, columns, generator=generator, dtype=torch.float64)).float()
    at = torch.tensor([0, 1, rows // 2, rows - 1, 63, 64, 65, rows // 3, rows - 2])  # the slab edges too
    matrix[at, torch.arange(columns)] = 0.0
    got = torch.ops.dro_ext.logsumexp_columns(matrix)
    assert torch.equal(got[:, 0], torch.zeros(columns))
    expected = torch.logsumexp(matrix.double(), dim=0)
    error = (got[:, 1].double() - expected).abs()
    assert bool((error <= torch.finfo(torch.float32).eps).all()), f"worst error {error.max().item():.3g}"


@native_only
def test_logsumexp_columns_infinities_nan_and_empty():
    matrix = torch.randn(150, 9, dtype=torch.float64)
    matrix[:, 1] = -math.inf              # every term 0: -inf
    matrix[70, 2] = math.inf              # NaN (inf - inf), as F.cross_entropy gives a row with a +inf logit
    matrix[3, 3] = math.nan               # NaN is never dropped
    matrix[:80, 4], matrix[80:, 4] = -1e300, -math.inf  # a finite max after an empty first slab
    matrix[:, 5] = 1e300                  # huge but finite
    matrix[100, 6] = math.inf
    matrix[101, 6] = math.nan             # NaN wins over inf
    for dtype in (torch.float64, torch.float32):
        got = torch.ops.dro_ext.logsumexp_columns(matrix.to(dtype))
        expected = torch.logsumexp(matrix.to(dtype), dim=0)
        expected[torch.isposinf(matrix.to(dtype)).any(dim=0)] = math.nan  # column 2; 5 too in float32 (1e300 is inf)
        torch.testing.assert_close(got.sum(dim=1), expected, equal_nan=True)
        assert got[1, 0] == 0  # a -inf max is no shift: no -inf - -inf
    empty = torch.ops.dro_ext.logsumexp_columns(torch.empty(0, 4))
    assert torch.equal(empty, torch.tensor([[0.0, -math.inf]] * 4))


@native_only
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float64], ids=str)
def test_opcheck_logsumexp_columns(dtype):
    torch.library.opcheck(torch.ops.dro_ext.logsumexp_columns.default, (torch.randn(37, 19, dtype=dtype),))


@native_only
def test_logsumexp_columns_checks_its_argument():
    with pytest.raises(ValueError, match="matrix must be a 2-D tensor"):
        torch.ops.dro_ext.logsumexp_columns(torch.randn(5))
    with pytest.raises(TypeError, match="matrix must have a floating dtype"):
        torch.ops.dro_ext.logsumexp_columns(torch.ones(3, 4, dtype=torch.long))


@native_only
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("label_smoothing", [0.0, 0.1])
def test_backward_in_place_writes_the_backward_over_the_logits(dtype, label_smoothing):
    # dro_cross_entropy_backward_ overwrites the logits with what dro_cross_entropy_backward returns, bit for bit:
    # each row's target logit is read before the row is written. Odd sizes, ignored rows, a large scale.
    generator = torch.Generator().manual_seed(5)
    logits = (3 * torch.randn(17, 37, generator=generator)).to(dtype)
    targets = torch.randint(0, 37, (17,), generator=generator)
    targets[[2, 11]] = -100
    acc = torch.float64 if dtype == torch.float64 else torch.float32
    lse = torch.where((targets != -100)[:, None], ref.shifted_lse(logits.to(acc)), 0.0)
    row_weight = torch.rand(17, generator=generator, dtype=acc)
    grad = torch.tensor(1.7, dtype=dtype)
    expected = torch.ops.dro_ext.dro_cross_entropy_backward(grad, logits, targets, lse, row_weight, -100,
                                                            label_smoothing)
    overwritten = logits.clone()
    torch.ops.dro_ext.dro_cross_entropy_backward_(grad, overwritten, targets, lse, row_weight, -100, label_smoothing)
    assert torch.equal(overwritten, expected)
    assert not torch.equal(overwritten, logits)


@native_only
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float64], ids=str)
@pytest.mark.parametrize("name,params", [("chi2", {}), ("kl_cvar", {"alpha": 0.2})], ids=["chi2", "kl_cvar"])
def test_opcheck_native_ops(name, params, dtype):
    logits = torch.randn(13, 10, dtype=dtype, requires_grad=dtype == torch.float64)
    targets = torch.randint(0, 10, (13,))
    targets[4] = -100
    eta = torch.tensor(2.0, dtype=torch.float64 if dtype == torch.float64 else torch.float32,
                       requires_grad=dtype == torch.float64)
    extra = (LAM, name, params.get("alpha"), params.get("k"), SCALE, -100, 0.1)
    torch.library.opcheck(torch.ops.dro_ext.dro_cross_entropy.default, (logits, targets, eta) + extra)
    _, _, lse, row_weight = torch.ops.dro_ext.dro_cross_entropy(logits.detach(), targets, eta.detach(), *extra)
    grad = torch.tensor(0.7, dtype=dtype)
    torch.library.opcheck(torch.ops.dro_ext.dro_cross_entropy_backward.default,
                          (grad, logits.detach(), targets, lse, row_weight, -100, 0.1))
    torch.library.opcheck(torch.ops.dro_ext.dro_cross_entropy_backward_.default,
                          (grad, logits.detach().clone(), targets, lse, row_weight, -100, 0.1))
    inv_count = torch.tensor(1.0 / 12, dtype=eta.dtype)
    torch.library.opcheck(torch.ops.dro_ext.dro_cross_entropy_chunk_.default,
                          (logits.detach().clone(), targets, eta.detach(), inv_count) + extra + (True,))


@pytest.mark.parametrize("native", [True, False], ids=["native_chunks", "python_chunks"])
def test_opcheck_linear_op(native):
    if native and not _backend.native_available():
        pytest.skip("native extension not built")
    hidden = torch.randn(9, 5, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(7, 5, dtype=torch.float64, requires_grad=True)
    bias = torch.randn(7, dtype=torch.float64, requires_grad=True)
    targets = torch.randint(0, 7, (9,))
    eta = torch.tensor(1.5, dtype=torch.float64, requires_grad=True)
    anchors = [t.reshape(-1)[:1].clone() for t in (hidden, weight, bias, eta)]
    args = (hidden, weight, bias, targets, eta, LAM, "chi2", None, None, SCALE, -100, 0.0, 4, native, True, True, True,
            anchors)
    torch.library.opcheck(torch.ops.dro_ext.linear_cross_entropy_with_grads.default, args)


GRADCHECK_CASES = [("chi2", {}), ("kl_cvar", {"alpha": 0.2}), ("cressie_read", {"k": 1.5}),
                   ("smoothed_cvar", {"alpha": 0.1})]


@pytest.mark.parametrize("name,params", GRADCHECK_CASES, ids=[c[0] for c in GRADCHECK_CASES])
def test_gradcheck(backend, name, params):
    logits = torch.randn(6, 5, dtype=torch.float64, requires_grad=True)
    targets = torch.tensor([0, 4, -100, 2, 2, 1])
    eta = torch.tensor(1.4, dtype=torch.float64, requires_grad=True)
    torch.autograd.gradcheck(
        lambda x, e: dro_ext.dro_cross_entropy(x, targets, e, LAM, name, scale=SCALE, label_smoothing=0.1, **params),
        (logits, eta))
    hidden = torch.randn(6, 3, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(5, 3, dtype=torch.float64, requires_grad=True)
    bias = torch.randn(5, dtype=torch.float64, requires_grad=True)
    torch.autograd.gradcheck(
        lambda h, w, b, e: dro_ext.dro_linear_cross_entropy(h, w, targets, e, LAM, name, bias=b, scale=SCALE,
                                                            chunk_size=4, **params),
        (hidden, weight, bias, eta))


def test_compiled_fullgraph_matches_eager(backend):
    torch._dynamo.reset()

    def step(logits, hidden, weight, bias, targets, eta):
        return (dro_ext.dro_cross_entropy(logits, targets, eta, LAM, "smoothed_cvar", alpha=0.1, label_smoothing=0.1)
                + dro_ext.dro_linear_cross_entropy(hidden, weight, targets, eta, LAM, "kl", bias=bias,
                                                   chunk_size=5))

    def make():
        torch.manual_seed(1)
        return (torch.randn(12, 9, requires_grad=True), torch.randn(12, 4, requires_grad=True),
                torch.randn(9, 4, requires_grad=True), torch.randn(9, requires_grad=True),
                torch.randint(0, 9, (12,)), torch.tensor(2.0, requires_grad=True))

    eager_inputs, compiled_inputs = make(), make()
    eager = step(*eager_inputs)
    eager.backward()
    compiled = torch.compile(step, fullgraph=True)(*compiled_inputs)
    compiled.backward()
    torch.testing.assert_close(compiled, eager)
    for a, b in zip(compiled_inputs, eager_inputs):
        if a.grad is not None or b.grad is not None:
            torch.testing.assert_close(a.grad, b.grad)


@pytest.mark.parametrize("grouped", [False, True], ids=["tokens", "groups"])
def test_compiled_with_dynamic_rows_serves_a_bucket_of_batch_sizes(backend, grouped):
    """Compiled with dynamic shapes and the default chunk size, one graph serves every row count of a power-of-two
    bucket of the chunk's rows (the chunk size's power of two was taken with int.bit_length(), which guarded the exact
    row count: a recompile for every batch size and, under fullgraph=True, a failure at the ninth); each call equals
    eager. Here ceil(V/H) = 32, so 12 row counts from 67 to 771 fall in 5 buckets."""
    torch._dynamo.reset()
    eta = torch.tensor(0.5)

    def loss(hidden, weight, targets, groups):
        extra = dict(groups=groups, num_groups=7) if grouped else {}
        return dro_ext.dro_linear_cross_entropy(hidden, weight, targets, eta, LAM, "chi2", **extra)

    graphs = []

    def counting_backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    compiled = torch.compile(loss, backend=counting_backend, fullgraph=True, dynamic=True)
    weight = torch.randn(256, 8)
    for n in (64 * j + 3 for j in range(1, 13)):
        hidden, targets = torch.randn(n, 8), torch.arange(n) % 256
        groups = torch.arange(n) % 7 if grouped else None
        torch.testing.assert_close(compiled(hidden, weight, targets, groups), loss(hidden, weight, targets, groups))
    assert len(graphs) <= 6, len(graphs)


@native_only
def test_native_result_is_the_same_on_any_thread_count():
    logits, targets = torch.randn(700, 300), torch.randint(0, 300, (700,))
    previous = torch.get_num_threads()
    results = []
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            results.append(torch.ops.dro_ext.dro_cross_entropy(logits, targets, torch.tensor(5.0), LAM, "kl", None,
                                                               None, 1.0, -100, 0.0)[:2])
    finally:
        torch.set_num_threads(previous)
    assert all(torch.equal(a, b) for a, b in zip(*results))


# ---------------------------------------------------------------------------------------------------
# Bad input
# ---------------------------------------------------------------------------------------------------


def test_bad_inputs_name_the_argument(backend):
    logits, targets = torch.randn(4, 5), torch.tensor([0, 1, 2, 3])
    ce = dro_ext.dro_cross_entropy
    with pytest.raises(IndexError, match="targets"):
        ce(logits, torch.tensor([0, 5, 1, 1]), 0.0, LAM)
    with pytest.raises(IndexError, match="targets"):
        ce(logits, torch.tensor([0, -1, 1, 1]), 0.0, LAM)
    with pytest.raises(TypeError, match="targets must be int64"):
        ce(logits, targets.int(), 0.0, LAM)
    with pytest.raises(ValueError, match="targets must have shape"):
        ce(logits, targets[:3], 0.0, LAM)
    with pytest.raises(TypeError, match="logits must have a floating dtype"):
        ce(logits.long(), targets, 0.0, LAM)
    with pytest.raises(ValueError, match="eta must be a 0-d tensor"):
        ce(logits, targets, torch.zeros(2), LAM)
    with pytest.raises(ValueError, match="targets is on meta"):
        ce(logits, targets.to("meta"), 0.0, LAM)
    with pytest.raises(ValueError, match="eta is on meta"):
        ce(logits, targets, torch.tensor(0.0, device="meta"), LAM)
    with pytest.raises(ValueError, match="label_smoothing"):
        ce(logits, targets, 0.0, LAM, label_smoothing=1.5)
    with pytest.raises(ValueError, match="lam"):
        ce(logits, targets, 0.0, -1.0)
    with pytest.raises(ValueError, match="alpha"):
        ce(logits, targets, 0.0, LAM, "cvar")
    with pytest.raises(TypeError, match="ignore_index"):
        ce(logits, targets, 0.0, LAM, ignore_index=1.5)
    with pytest.raises(ValueError, match="logits must have at least one class"):
        ce(torch.randn(3, 0), torch.zeros(3, dtype=torch.long), 0.0, LAM)
    with pytest.raises(TypeError, match="logits must be a dense"):
        ce(logits.to_sparse(), targets, 0.0, LAM)
    with pytest.raises(TypeError, match="label_smoothing"):
        ce(logits, targets, 0.0, LAM, label_smoothing="0.1")
    with pytest.raises(TypeError, match="eta_init"):
        dro_ext.DROCrossEntropyLoss("chi2", lam=LAM, eta_init="x")

    lce = dro_ext.dro_linear_cross_entropy
    hidden, weight = torch.randn(4, 3), torch.randn(5, 3)
    with pytest.raises(IndexError, match="targets"):
        lce(hidden, weight, torch.tensor([0, 9, 1, 1]), 0.0, LAM)
    with pytest.raises(ValueError, match="weight must have shape"):
        lce(hidden, weight.T, targets, 0.0, LAM)
    with pytest.raises(ValueError, match="weight .* must have the dtype"):
        lce(hidden, weight.double(), targets, 0.0, LAM)
    with pytest.raises(ValueError, match="bias must have shape"):
        lce(hidden, weight, targets, 0.0, LAM, bias=torch.zeros(4))
    with pytest.raises(ValueError, match="chunk_size"):
        lce(hidden, weight, targets, 0.0, LAM, chunk_size=0)
    with pytest.raises(ValueError, match="targets must have shape"):
        lce(hidden, weight, targets[:2], 0.0, LAM)


@native_only
def test_native_ops_check_their_arguments():
    logits, targets, eta = torch.randn(4, 5), torch.tensor([0, 1, 2, 3]), torch.tensor(0.0)
    op = torch.ops.dro_ext.dro_cross_entropy
    with pytest.raises(IndexError, match=r"targets\[1\]=7"):
        op(logits, torch.tensor([0, 7, 1, 1]), eta, LAM, "chi2", None, None, 1.0, -100, 0.0)
    with pytest.raises(ValueError, match="logits must be a 2-D tensor"):
        op(logits.reshape(-1), targets, eta, LAM, "chi2", None, None, 1.0, -100, 0.0)
    with pytest.raises(ValueError, match="label_smoothing"):
        op(logits, targets, eta, LAM, "chi2", None, None, 1.0, -100, -0.1)
    with pytest.raises(ValueError, match=r"lse must have shape \(4, 2\), got \[4\]"):
        torch.ops.dro_ext.dro_cross_entropy_backward(torch.tensor(1.0), logits, targets, torch.zeros(4),
                                                     torch.zeros(4), -100, 0.0)
    with pytest.raises(TypeError, match="row_weight must be"):
        torch.ops.dro_ext.dro_cross_entropy_backward(torch.tensor(1.0), logits, targets, torch.zeros(4, 2),
                                                     torch.zeros(4, dtype=torch.float64), -100, 0.0)
    with pytest.raises(ValueError, match="must be contiguous"):
        torch.ops.dro_ext.dro_cross_entropy_chunk_(torch.randn(5, 4).T, targets, eta, eta, LAM, "chi2")
    with pytest.raises(ValueError, match="dro_cross_entropy_backward_ overwrites logits in place"):
        torch.ops.dro_ext.dro_cross_entropy_backward_(torch.tensor(1.0), torch.randn(5, 4).T, targets,
                                                      torch.zeros(4, 2), torch.zeros(4), -100, 0.0)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_a_positive_infinite_logit_gives_nan_as_f_cross_entropy(backend, dtype):
    """A +inf logit off the target makes its row's loss NaN in F.cross_entropy (inf - inf in log_softmax), and so on
    every path here: per-row losses and the objective, per token and over groups, from logits and from an LM head
    whose bias is +inf (the grouped linear op's column logsumexp). The fallback's shift and the column kernels took 0
    for a +inf max and gave +inf there, so the grouped value came out +inf with finite gradients on the fallback."""
    n, c, h = 5, 7, 3
    hidden = torch.randn(n, h, dtype=torch.float64).to(dtype)
    weight = torch.randn(c, h, dtype=torch.float64).to(dtype)
    bias = torch.zeros(c, dtype=dtype)
    bias[0] = math.inf
    targets = torch.randint(1, c, (n,))
    logits = (hidden.double() @ weight.double().t() + bias.double()).to(dtype)
    assert torch.isnan(F.cross_entropy(logits.double(), targets, reduction="none")).all()
    assert torch.isnan(dro_ext.cross_entropy_losses(logits, targets)).all()
    assert torch.isnan(dro_ext.linear_cross_entropy_losses(hidden, weight, targets, bias=bias)).all()
    groups = dict(groups=torch.tensor([0, 1, 0, 1, 1]), num_groups=2)
    for by_group in ({}, groups):
        assert math.isnan(dro_ext.dro_cross_entropy(logits, targets, 0.5, LAM, "chi2", **by_group).item())
        assert math.isnan(dro_ext.dro_linear_cross_entropy(hidden, weight, targets, 0.5, LAM, "chi2", bias=bias,
                                                           **by_group).item())


def test_an_eta_on_another_device_names_logits_or_hidden(backend):
    """The device error named "losses", which neither cross-entropy takes."""
    logits, targets = torch.randn(4, 3), torch.randint(0, 3, (4,))
    hidden, weight = torch.randn(4, 2), torch.randn(3, 2)
    eta = torch.tensor(0.0, device="meta")
    with pytest.raises(ValueError, match="eta is on meta but logits is on cpu"):
        dro_ext.dro_cross_entropy(logits, targets, eta, 0.5)
    with pytest.raises(ValueError, match="eta is on meta but logits is on cpu"):
        dro_ext.DROCrossEntropyLoss().to("meta")(logits, targets)
    with pytest.raises(ValueError, match="eta is on meta but hidden is on cpu"):
        dro_ext.dro_linear_cross_entropy(hidden, weight, targets, eta, 0.5)


def test_linear_value_is_summed_over_chunks_in_float64(backend):
    """The chunk loop added the chunks' sums in float32 and divided by the count last: a chunk's sum past float32's
    range made the value inf where the mean is finite (kl, one row at t = 92 among 1000: the value is 9.0e36), and the
    value moved with the chunk size (35 float32 steps off at one-row chunks, 0.07 at one chunk)."""
    rows = 1000
    hidden, weight = torch.zeros(rows, 2), torch.zeros(3, 2)
    hidden[0, 0], weight[1, 0] = 100.0, 1.0  # row 0's logits (0, 100, 0), target 0: a loss of 100
    targets = torch.zeros(rows, dtype=torch.int64)
    losses = F.cross_entropy((hidden @ weight.T).double(), targets, reduction="none")
    expected = float((torch.expm1(losses - 8.0)).mean() + 8.0)
    for chunk_size in (None, 10):
        value = dro_ext.dro_linear_cross_entropy(hidden, weight, targets, 8.0, 1.0, "kl", chunk_size=chunk_size)
        assert math.isfinite(float(value)) and abs(float(value) - expected) <= 2e-7 * expected, (chunk_size, value)
    torch.manual_seed(0)
    hidden, weight = torch.randn(4096, 8), torch.randn(6, 8) / 3
    targets = torch.randint(0, 6, (4096,))
    losses = F.cross_entropy((hidden @ weight.T).double(), targets, reduction="none")
    expected = ref.dro_loss(losses, 1.5, 1.0, "chi2")
    for chunk_size in (None, 64, 1):
        value = dro_ext.dro_linear_cross_entropy(hidden, weight, targets, 1.5, 1.0, "chi2", chunk_size=chunk_size)
        # Each per-token loss is within a float32 rounding of the float64 one; their mean then within about that too,
        # whatever the chunks (summed in float32, one-row chunks put the value 4.4 float32 steps off here).
        assert abs(float(value) - float(expected)) <= 2 * 2**-23 * abs(float(expected)), (chunk_size, value, expected)
