"""The fused DRO cross-entropy over groups of tokens (groups=, num_groups=), the per-token losses it is built on
(cross_entropy_losses, linear_cross_entropy_losses) and GroupDROLoss on them, against a float64 reference built from
F.cross_entropy(reduction="none"), masked per-group means and the formula, on both backends."""
import math

import pytest
import torch
import torch.nn.functional as F

import dro_ext
import reference as ref
from reference import DTYPES
from dro_ext import _backend
from dro_ext import cross_entropy_groups as ceg
from test_cross_entropy import LargestAllocation, assert_close_to_scale, linear_reference

LAM, SCALE, IGNORE = 0.8, 1.3, -100
native_only = pytest.mark.skipif(not _backend.native_available(), reason="native extension not built")


def reference_value(losses, targets, token_groups, num_groups, eta, lam, name, params, scale=SCALE,
                    ignore_index=IGNORE):
    """scale*eta + sum_g (n_g/n) lam psi*((m_g - scale*eta)/lam) over the groups with kept tokens, from the flat
    float64 per-token losses; m_g and n_g through a one-hot matrix (no scatter), 0 when no token is kept."""
    keep = (targets != ignore_index).double()
    onehot = F.one_hot(torch.where(targets != ignore_index, token_groups, 0), num_groups).double() * keep[:, None]
    counts = onehot.sum(0)
    if float(counts.sum()) == 0:
        return (losses * 0).sum() + eta * 0
    present = counts > 0
    means = (onehot * torch.where(keep > 0, losses, 0.0)[:, None]).sum(0)[present] / counts[present]
    t = (means - scale * eta) / lam
    p = counts[present] / counts.sum()
    return (p * lam * ref.psi_star(t, name, params.get("alpha"), params.get("k"))).sum() + scale * eta


def make_tokens(batch, seq, c, dtype, num_groups, per_sequence, seed=0):
    generator = torch.Generator().manual_seed(seed)
    logits = torch.randn(batch, seq, c, dtype=torch.float64, generator=generator).to(dtype)
    targets = torch.randint(0, c, (batch, seq), generator=generator)
    targets[:, ::3] = IGNORE  # some ignored tokens in every sequence
    shape = (batch,) if per_sequence else (batch, seq)
    groups = torch.randint(0, num_groups, shape, generator=generator)
    # eta near the typical loss (log C), so the groups' t fall on both sides of every kink.
    eta = torch.tensor((math.log(c) + 0.2) / SCALE, requires_grad=True)
    return logits.requires_grad_(), targets, groups, eta


def other_ignore_index(targets, per_sequence):
    """(ignore_index, targets): the default for per-token groups; for per-sequence groups -7, the ignored targets
    moved to it, so that an ignore_index other than the default is checked against the reference too."""
    if not per_sequence:
        return IGNORE, targets
    return -7, torch.where(targets == IGNORE, -7, targets)


def token_groups_of(groups, targets):
    return (groups if groups.shape == targets.shape else groups[..., None].expand(targets.shape)).reshape(-1)


def grad_tolerances(dtype):
    tol = ref.tolerances(dtype)
    return dict(tol, atol=5e-5) if dtype == torch.float32 else tol


def check_grads(got, expected, dtype, n, to_scale=False):
    # Gradients are compared after multiplying by the kept count n, where they are O(1); those of a matmul in the
    # input dtype relative to the size of their terms (to_scale).
    for g, e in zip(got[:-1], expected[:-1]):
        assert g.dtype == dtype
        if to_scale:
            assert_close_to_scale(g.double() * n, e * n, grad_tolerances(dtype))
        else:
            torch.testing.assert_close(g.double() * n, e * n, **grad_tolerances(dtype))
    eta_tol = dict(rtol=1e-6, atol=1e-6) if dtype == torch.float64 else dict(rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(got[-1].double(), expected[-1], **eta_tol)


FEW_CASES = [("chi2", {}), ("kl_cvar", {"alpha": 0.2})]


def grouped_cases():
    """Every divergence in float32 and float64, two of them in every dtype."""
    cases = [(d, n, p) for d in (torch.float32, torch.float64) for n, p in ref.CASES]
    cases += [(d, n, p) for d in (torch.float16, torch.bfloat16) for n, p in FEW_CASES]
    return [pytest.param(d, n, p, id=f"{str(d)[6:]}-{i}") for d, n, p, i in
            [(d, n, p, ref.CASE_IDS[ref.CASES.index((n, p))]) for d, n, p in cases]]


# ---------------------------------------------------------------------------------------------------
# The grouped objective against the float64 reference
# ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype,name,params", grouped_cases())
@pytest.mark.parametrize("num_groups", [1, 3, 21])
@pytest.mark.parametrize("per_sequence", [False, True], ids=["per_token", "per_sequence"])
def test_grouped_cross_entropy_matches_float64_reference(backend, dtype, name, params, num_groups, per_sequence):
    logits, targets, groups, eta = make_tokens(3, 7, 11, dtype, num_groups, per_sequence)
    label_smoothing = 0.1 if name == "chi2" else 0.0
    ignore, targets = other_ignore_index(targets, per_sequence)
    value = dro_ext.dro_cross_entropy(logits, targets, eta, LAM, name, scale=SCALE, groups=groups,
                                      num_groups=num_groups, label_smoothing=label_smoothing, ignore_index=ignore,
                                      **params)
    assert value.dtype == ref.cross_entropy_value_dtype(dtype) and value.dim() == 0
    grads = torch.autograd.grad(value, (logits, eta))

    x64, e64 = logits.detach().double().requires_grad_(), eta.detach().double().requires_grad_()
    losses = F.cross_entropy(x64.reshape(-1, 11), targets.reshape(-1), reduction="none", ignore_index=ignore,
                             label_smoothing=label_smoothing)
    expected = reference_value(losses, targets.reshape(-1), token_groups_of(groups, targets), num_groups, e64, LAM,
                               name, params, ignore_index=ignore)
    torch.testing.assert_close(value.double(), expected.detach(), **ref.tolerances(dtype))
    check_grads(grads, torch.autograd.grad(expected, (x64, e64)), dtype, int((targets != ignore).sum()))


@pytest.mark.parametrize("dtype,name,params", [pytest.param(d, *FEW_CASES[i], id=f"{str(d)[6:]}-{FEW_CASES[i][0]}")
                                               for d in DTYPES for i in range(2)])
@pytest.mark.parametrize("num_groups,chunk", [(1, 4), (4, 5), (21, 64)])
@pytest.mark.parametrize("per_sequence", [False, True], ids=["per_token", "per_sequence"])
def test_grouped_linear_cross_entropy_matches_float64_reference(backend, dtype, name, params, num_groups, chunk,
                                                                 per_sequence):
    _, targets, groups, eta = make_tokens(3, 7, 13, dtype, num_groups, per_sequence)
    generator = torch.Generator().manual_seed(5)
    hidden = torch.randn(3, 7, 6, dtype=torch.float64, generator=generator).to(dtype).requires_grad_()
    weight = (torch.randn(13, 6, dtype=torch.float64, generator=generator) / 2).to(dtype).requires_grad_()
    bias = torch.randn(13, dtype=torch.float64, generator=generator).to(dtype).requires_grad_()
    label_smoothing = 0.1 if name == "chi2" else 0.0
    ignore, targets = other_ignore_index(targets, per_sequence)
    value = dro_ext.dro_linear_cross_entropy(hidden, weight, targets, eta, LAM, name, bias=bias, scale=SCALE,
                                             groups=groups, num_groups=num_groups, chunk_size=chunk,
                                             label_smoothing=label_smoothing, ignore_index=ignore, **params)
    assert value.dtype == ref.cross_entropy_value_dtype(dtype) and value.dim() == 0
    grads = torch.autograd.grad(value, (hidden, weight, bias, eta))

    # The reference sees the logits rounded as the op's matmul rounds them (test_cross_entropy.linear_reference).
    inputs64, logits64 = linear_reference((hidden, weight, bias), dtype, True)
    e64 = eta.detach().double().requires_grad_()
    losses = F.cross_entropy(logits64.reshape(-1, 13), targets.reshape(-1), reduction="none", ignore_index=ignore,
                             label_smoothing=label_smoothing)
    expected = reference_value(losses, targets.reshape(-1), token_groups_of(groups, targets), num_groups, e64, LAM,
                               name, params, ignore_index=ignore)
    torch.testing.assert_close(value.double(), expected.detach(), **ref.tolerances(dtype))
    check_grads(grads, torch.autograd.grad(expected, inputs64 + [e64]), dtype, int((targets != ignore).sum()),
                to_scale=True)


@pytest.mark.parametrize("piece_rows", [1, 3])
def test_fallback_linear_backward_pieces_do_not_change_the_result(monkeypatch, piece_rows):
    # The fallback writes a chunk's gradient over its logits a piece of rows at a time (the native op writes the
    # whole chunk in place): any piece size (here 1 and 3 rows, in 5-row chunks, against one piece per chunk) gives
    # the same gradients, bitwise.
    _, targets, groups, eta = make_tokens(3, 7, 13, torch.float32, 3, per_sequence=True, seed=9)
    generator = torch.Generator().manual_seed(9)
    inputs = [torch.randn(3, 7, 6, generator=generator).requires_grad_(),
              torch.randn(13, 6, generator=generator).requires_grad_(), torch.randn(13, generator=generator)]
    inputs[2].requires_grad_()

    def grads():
        value = dro_ext.dro_linear_cross_entropy(inputs[0], inputs[1], targets, eta, LAM, "kl", bias=inputs[2],
                                                 groups=groups, num_groups=3, chunk_size=5, label_smoothing=0.1)
        return torch.autograd.grad(value, (*inputs, eta))

    with _backend.forced_backend("python"):
        whole = grads()
        monkeypatch.setattr(ceg, "FALLBACK_PIECE_LOGIT_BYTES", piece_rows * 13 * 4)
        for got, want in zip(grads(), whole):
            assert torch.equal(got, want)


def test_value_is_group_dro_loss_of_the_kept_tokens(backend):
    logits, targets, groups, eta = make_tokens(4, 9, 6, torch.float64, 5, per_sequence=False, seed=3)
    groups[targets == IGNORE] = 99  # the ids of ignored tokens are not read
    kwargs = dict(scale=SCALE, label_smoothing=0.05, groups=groups, num_groups=5)
    value = dro_ext.dro_cross_entropy(logits, targets, eta, LAM, "kl", **kwargs)
    keep = targets != IGNORE
    losses = F.cross_entropy(logits.reshape(-1, 6), targets.reshape(-1), reduction="none", label_smoothing=0.05)
    expected = dro_ext.group_dro_loss(losses[keep.reshape(-1)], groups[keep], 5, eta, LAM, "kl", scale=SCALE)
    torch.testing.assert_close(value, expected, rtol=1e-13, atol=1e-13)
    torch.testing.assert_close(torch.autograd.grad(value, (logits, eta)), torch.autograd.grad(expected, (logits, eta)),
                               rtol=1e-12, atol=1e-14)


def test_float32_group_means_are_not_rounded_before_the_objective(backend):
    """The grouped cross-entropy takes float64 group sums of its float32 per-token losses, as group_dro_loss does: a
    float32 group mean moved t = (m - eta)/lam by its rounding over lam, which at eta within a few roundings of the
    largest mean and lam = 1e-6 moved that group's weight psi*'(t), and the gradient of eta, by tens of percent."""
    logits, targets, groups, _ = make_tokens(8, 301, 7, torch.float32, 3, per_sequence=False, seed=5)
    keep = (targets != IGNORE).reshape(-1)
    ids = groups.reshape(-1)[keep]
    # the float64 means of the op's own float32 token losses
    losses = dro_ext.cross_entropy_losses(logits.detach(), targets).reshape(-1)[keep].double()
    m = torch.stack([losses[ids == g].mean() for g in range(3)])
    n = torch.stack([(ids == g).sum() for g in range(3)]).double()
    for eta0 in (m.max().float(), torch.nextafter(m.max().float(), torch.tensor(math.inf))):
        eta = eta0.clone().requires_grad_()
        value = dro_ext.dro_cross_entropy(logits, targets, eta, 1e-6, "chi2", groups=groups, num_groups=3)
        (grad_eta,) = torch.autograd.grad(value, eta)
        eta64 = eta0.double().requires_grad_()
        expected = dro_ext.group_dro_loss(m, torch.arange(3), 3, eta64, 1e-6, "chi2", weighting=n)
        (expected_grad_eta,) = torch.autograd.grad(expected, eta64)
        torch.testing.assert_close(value.double(), expected, rtol=1e-6, atol=0.0)
        torch.testing.assert_close(grad_eta.double(), expected_grad_eta, rtol=1e-4, atol=1e-4)


def test_one_token_per_group_is_the_ungrouped_objective(backend):
    # G = N with token i in group i: each group's mean is its token's loss, and batch weighting is 1/n each.
    logits, targets, _, eta = make_tokens(2, 8, 5, torch.float64, 1, per_sequence=False, seed=4)
    groups = torch.arange(16).reshape(2, 8)
    grouped = dro_ext.dro_cross_entropy(logits, targets, eta, LAM, "cressie_read", k=1.5, scale=SCALE, groups=groups,
                                        num_groups=16)
    plain = dro_ext.dro_cross_entropy(logits, targets, eta, LAM, "cressie_read", k=1.5, scale=SCALE)
    torch.testing.assert_close(grouped, plain, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(torch.autograd.grad(grouped, (logits, eta)), torch.autograd.grad(plain, (logits, eta)),
                               rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("name,params", FEW_CASES, ids=["chi2", "kl_cvar"])
def test_a_single_group_is_the_objective_at_the_mean_loss(backend, name, params):
    # With one group, the objective is lam psi*((mean l - G eta)/lam) + G eta: dro_loss of the single "sample"
    # whose loss is the mean over the kept tokens (not the ungrouped objective, which is the mean of the psi*).
    logits, targets, groups, eta = make_tokens(3, 5, 7, torch.float64, 1, per_sequence=True, seed=2)
    value = dro_ext.dro_cross_entropy(logits, targets, eta, LAM, name, scale=SCALE, groups=groups, num_groups=1,
                                      **params)
    keep = targets.reshape(-1) != IGNORE
    mean_loss = F.cross_entropy(logits.reshape(-1, 7), targets.reshape(-1), reduction="none")[keep].mean()
    expected = dro_ext.dro_loss(mean_loss.reshape(1), eta, LAM, name, scale=SCALE, **params)
    torch.testing.assert_close(value, expected, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(torch.autograd.grad(value, (logits, eta)), torch.autograd.grad(expected, (logits, eta)))


def test_absent_groups_change_nothing(backend):
    logits, targets, groups, eta = make_tokens(3, 6, 5, torch.float64, 3, per_sequence=False, seed=6)
    few = dro_ext.dro_cross_entropy(logits, targets, eta, LAM, "kl", groups=groups, num_groups=3)
    many = dro_ext.dro_cross_entropy(logits, targets, eta, LAM, "kl", groups=groups + 4, num_groups=10)
    torch.testing.assert_close(many, few, rtol=1e-14, atol=1e-14)


def test_batch_shaped_and_non_contiguous_inputs(backend):
    base = torch.randn(7, 4, 9, dtype=torch.float64)
    logits = base.transpose(0, 1).requires_grad_()  # (4, 7, 9), not contiguous
    targets = torch.randint(0, 9, (7, 4)).t()
    targets[1, 2] = IGNORE
    groups = torch.randint(0, 3, (7, 4), dtype=torch.int32).t()  # non-contiguous int32 ids
    eta = torch.tensor(2.0, dtype=torch.float64, requires_grad=True)
    value = dro_ext.dro_cross_entropy(logits, targets, eta, LAM, "chi2", groups=groups, num_groups=3)
    flat = dro_ext.dro_cross_entropy(logits.detach().contiguous().reshape(28, 9), targets.reshape(28), eta, LAM,
                                     "chi2", groups=groups.reshape(28).long(), num_groups=3)
    torch.testing.assert_close(value, flat, rtol=1e-14, atol=1e-14)
    (grad,) = torch.autograd.grad(value, logits)
    assert grad.shape == logits.shape


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
def test_strided_logits_and_weight_give_their_copies_bits(backend, dtype):
    # A strided input is made contiguous first, so it is summed in the same order as its copy: the row means of
    # label smoothing were taken over the strided view, and the linear op multiplied a transposed weight as it was.
    logits = torch.randn(4, 300, 74, dtype=dtype)[..., ::2]
    targets = torch.randint(0, 37, (4, 300))
    strided = dro_ext.cross_entropy_losses(logits, targets, label_smoothing=0.2)
    assert torch.equal(strided, dro_ext.cross_entropy_losses(logits.contiguous(), targets, label_smoothing=0.2))
    hidden = torch.randn(900, 16, dtype=dtype)
    weight = 0.3 * torch.randn(16, 500, dtype=dtype).t()  # (500, 16), not contiguous
    y = torch.randint(0, 500, (900,))
    strided = dro_ext.linear_cross_entropy_losses(hidden, weight, y, chunk_size=256)
    assert torch.equal(strided, dro_ext.linear_cross_entropy_losses(hidden, weight.contiguous(), y, chunk_size=256))


# ---------------------------------------------------------------------------------------------------
# Empty batches, every token ignored, NaN
# ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("linear", [False, True], ids=["logits", "linear"])
def test_every_token_ignored_gives_zero_and_zero_gradients(backend, linear):
    targets = torch.full((2, 3), IGNORE)
    groups = torch.tensor([0, 1])
    eta = torch.tensor(1e4, requires_grad=True)  # far from every loss: nothing of the ignored rows may leak
    if linear:
        inputs = [torch.randn(2, 3, 4, requires_grad=True), torch.randn(5, 4, requires_grad=True)]
        value = dro_ext.dro_linear_cross_entropy(*inputs, targets, eta, LAM, "kl", groups=groups, num_groups=2)
    else:
        inputs = [torch.randn(2, 3, 5, requires_grad=True)]
        value = dro_ext.dro_cross_entropy(*inputs, targets, eta, LAM, "kl", groups=groups, num_groups=2)
    assert value.item() == 0.0
    for grad in torch.autograd.grad(value, (*inputs, eta)):
        assert torch.equal(grad, torch.zeros_like(grad))


@pytest.mark.parametrize("linear", [False, True], ids=["logits", "linear"])
def test_empty_batch_gives_zero(backend, linear):
    eta = torch.tensor(0.5, requires_grad=True)
    targets, groups = torch.empty((0, 4), dtype=torch.int64), torch.empty((0,), dtype=torch.int64)
    if linear:
        inputs = [torch.randn(0, 4, 3, requires_grad=True), torch.randn(5, 3, requires_grad=True)]
        value = dro_ext.dro_linear_cross_entropy(*inputs, targets, eta, LAM, "chi2", groups=groups, num_groups=2)
    else:
        inputs = [torch.randn(0, 4, 5, requires_grad=True)]
        value = dro_ext.dro_cross_entropy(*inputs, targets, eta, LAM, "chi2", groups=groups, num_groups=2)
    assert value.item() == 0.0
    grads = torch.autograd.grad(value, (*inputs, eta))
    assert all(torch.equal(g, torch.zeros_like(g)) for g in grads)


def test_nan_logit_is_not_dropped(backend):
    logits = torch.randn(2, 3, 4)
    logits[1, 0, 2] = math.nan
    targets = torch.randint(0, 4, (2, 3))
    value = dro_ext.dro_cross_entropy(logits, targets, 0.0, LAM, "chi2", groups=torch.tensor([0, 1]), num_groups=2)
    assert math.isnan(value.item())


# ---------------------------------------------------------------------------------------------------
# Per-token losses, and GroupDROLoss on them
# ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("linear", [False, True], ids=["logits", "linear"])
def test_per_token_losses_match_f_cross_entropy(backend, dtype, linear):
    generator = torch.Generator().manual_seed(7)
    targets = torch.randint(0, 10, (3, 5), generator=generator)
    targets[0, 1] = IGNORE
    upstream = torch.randn(3, 5, dtype=torch.float64, generator=generator)
    if linear:
        inputs = [torch.randn(3, 5, 4, dtype=torch.float64, generator=generator).to(dtype).requires_grad_(),
                  torch.randn(10, 4, dtype=torch.float64, generator=generator).to(dtype).requires_grad_(),
                  torch.randn(10, dtype=torch.float64, generator=generator).to(dtype).requires_grad_()]
        losses = dro_ext.linear_cross_entropy_losses(inputs[0], inputs[1], targets, bias=inputs[2],
                                                     label_smoothing=0.2, chunk_size=4)
    else:
        inputs = [torch.randn(3, 5, 10, dtype=torch.float64, generator=generator).to(dtype).requires_grad_()]
        losses = dro_ext.cross_entropy_losses(inputs[0], targets, label_smoothing=0.2)
    assert losses.shape == targets.shape and losses.dtype == (torch.float64 if dtype == torch.float64
                                                              else torch.float32)
    grads = torch.autograd.grad(losses, inputs, upstream.to(losses.dtype))
    inputs64 = [t.detach().double().requires_grad_() for t in inputs]
    logits64 = F.linear(*inputs64) if linear else inputs64[0]
    expected = F.cross_entropy(logits64.reshape(-1, 10), targets.reshape(-1), reduction="none",
                               label_smoothing=0.2).reshape(3, 5)
    torch.testing.assert_close(losses.double(), expected.detach(), **ref.tolerances(dtype))
    for g, e in zip(grads, torch.autograd.grad(expected, inputs64, upstream)):
        assert g.dtype == dtype
        torch.testing.assert_close(g.double(), e, **grad_tolerances(dtype))


@pytest.mark.parametrize("linear", [False, True], ids=["logits", "linear"])
def test_group_dro_module_on_the_per_token_losses(backend, linear):
    # GroupDROLoss(per-token losses, per-token groups, mask=targets != ignore_index) is GroupDROLoss over the kept
    # tokens alone: the same q updates, the same loss and the same gradients.
    generator = torch.Generator().manual_seed(8)
    hidden = torch.randn(4, 6, 5, dtype=torch.float64, generator=generator, requires_grad=True)
    weight = torch.randn(9, 5, dtype=torch.float64, generator=generator, requires_grad=True)
    masked, kept_only = dro_ext.GroupDROLoss(3, step_size=0.5), dro_ext.GroupDROLoss(3, step_size=0.5)
    for step in range(3):
        targets = torch.randint(0, 9, (4, 6), generator=generator)
        targets[:, -2:] = IGNORE  # padding
        groups = torch.randint(0, 3, (4,), generator=generator)[:, None].expand(4, 6)
        if linear:
            losses = dro_ext.linear_cross_entropy_losses(hidden, weight, targets, chunk_size=5)
        else:
            losses = dro_ext.cross_entropy_losses(F.linear(hidden, weight), targets)
        keep = targets != IGNORE
        value = masked(losses.reshape(-1), groups.reshape(-1), mask=keep.reshape(-1))
        losses64 = F.cross_entropy(F.linear(hidden, weight).reshape(-1, 9), targets.reshape(-1), reduction="none")
        expected = kept_only(losses64[keep.reshape(-1)], groups[keep])
        torch.testing.assert_close(masked.q, kept_only.q, rtol=1e-13, atol=1e-15)
        torch.testing.assert_close(value, expected, rtol=1e-12, atol=1e-14)
        torch.testing.assert_close(torch.autograd.grad(value, (hidden, weight)),
                                   torch.autograd.grad(expected, (hidden, weight)), rtol=1e-10, atol=1e-13)


def test_group_dro_module_mask_errors_name_the_argument():
    module = dro_ext.GroupDROLoss(2)
    losses, groups = torch.rand(4), torch.tensor([0, 1, 0, 1])
    with pytest.raises(TypeError, match="mask"):
        module(losses, groups, mask=torch.ones(4))
    with pytest.raises(ValueError, match="mask"):
        module(losses, groups, mask=torch.ones(3, dtype=torch.bool))
    with pytest.raises(IndexError, match="groups"):  # a counted sample's id is still checked
        module(losses, torch.tensor([0, 1, 0, 2]), mask=torch.tensor([True, True, False, True]))
    module(losses, torch.tensor([0, 1, 0, 2]), mask=torch.tensor([True, True, True, False]))  # ignored: not read


# ---------------------------------------------------------------------------------------------------
# Modules
# ---------------------------------------------------------------------------------------------------


def test_modules_take_groups(backend):
    logits, targets, groups, _ = make_tokens(3, 4, 6, torch.float32, 2, per_sequence=True)
    criterion = dro_ext.DROCrossEntropyLoss("kl", lam=0.5, eta_init=1.0, num_groups=2)
    assert "num_groups=2" in repr(criterion)
    loss = criterion(logits, targets, groups)
    loss.backward()
    torch.testing.assert_close(loss, dro_ext.dro_cross_entropy(logits, targets, 1.0, 0.5, "kl", groups=groups,
                                                               num_groups=2))
    assert criterion.eta.grad is not None and logits.grad is not None

    head = torch.nn.Linear(8, 6)
    hidden = torch.randn(3, 4, 8, requires_grad=True)
    linear = dro_ext.DROLinearCrossEntropyLoss("chi2", lam=0.5, chunk_size=5, num_groups=2)
    loss = linear(hidden, head.weight, targets, head.bias, groups=groups)
    loss.backward()
    torch.testing.assert_close(loss, dro_ext.dro_cross_entropy(head(hidden), targets, 0.0, 0.5, "chi2",
                                                               groups=groups, num_groups=2))
    assert all(p.grad is not None for p in (linear.eta, head.weight, head.bias, hidden))
    with pytest.raises(ValueError, match="groups"):
        criterion(logits, targets)  # num_groups given at construction, no groups


# ---------------------------------------------------------------------------------------------------
# Memory: the linear case never holds N x V
# ---------------------------------------------------------------------------------------------------


def test_grouped_linear_never_allocates_the_logits_of_the_batch(backend, monkeypatch):
    rows, hidden_size, vocab, chunk = 40, 4, 30, 4  # N x V = 1200, above the weight (120) and hidden (160)
    hidden = torch.randn(rows, hidden_size, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(vocab, hidden_size, dtype=torch.float64, requires_grad=True)
    bias = torch.randn(vocab, dtype=torch.float64, requires_grad=True)
    targets, groups = torch.randint(0, vocab, (rows,)), torch.randint(0, 3, (rows,))
    eta = torch.tensor(1.0, dtype=torch.float64, requires_grad=True)
    native = _backend.use_native()
    piece = 3
    # The fallback's 3-row pieces of the 4-row chunks (the native op writes a chunk's gradient over it, in place).
    monkeypatch.setattr(ceg, "FALLBACK_PIECE_LOGIT_BYTES", piece * vocab * 8)
    allocations = LargestAllocation()
    with allocations:
        value = dro_ext.dro_linear_cross_entropy(hidden, weight, targets, eta, LAM, "chi2", bias=bias,
                                                 groups=groups, num_groups=3, chunk_size=chunk)
        torch.autograd.grad(value, (hidden, weight, bias, eta))
        # The two chunk loops themselves: a dispatch mode sees a custom op, not the ops inside it.
        losses, lse = ceg._linear_row_losses._init_fn(hidden.detach(), weight.detach(), bias.detach(), targets,
                                                      IGNORE, 0.0, chunk, native)
        ceg._linear_row_losses_backward_op._init_fn(torch.rand(rows, dtype=torch.float64), hidden.detach(),
                                                    weight.detach(), bias.detach(), targets, lse, IGNORE, 0.0, chunk,
                                                    native, True, True, True)
    assert allocations.largest <= max(rows * hidden_size, vocab * hidden_size, chunk * vocab)
    # The backward's gradient: besides a chunk of logits, no second chunk-sized tensor.
    allocations = LargestAllocation()
    with allocations:
        ceg._linear_row_losses_backward_op._init_fn(torch.rand(rows, dtype=torch.float64), hidden.detach(),
                                                    weight.detach(), bias.detach(), targets, lse, IGNORE, 0.0, chunk,
                                                    native, False, False, False)
    assert allocations.largest == chunk * vocab  # the chunk's logits (the fallback's pieces are 3 x V)


def test_the_fallback_forward_takes_a_chunk_in_pieces(monkeypatch):
    """The fallback's first pass takes each chunk's logsumexp in pieces of rows, as its backward writes the gradient:
    taken whole, the cast to float64, x - shift and torch.logsumexp's own temporary were each a chunk of logits (the
    grouped linear op peaked at 2.6x the native op's memory at 2048 x 50000 logits in chunks of 256 rows)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Allocations(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.sizes = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if not func._schema.is_mutable and not any(r.alias_info for r in func._schema.returns):
                self.sizes += [t.numel() for t in (out if isinstance(out, (tuple, list)) else (out,))
                               if isinstance(t, torch.Tensor)]
            return out

    rows, hidden_size, vocab, chunk, piece = 40, 4, 30, 8, 3
    hidden, weight = torch.randn(rows, hidden_size), torch.randn(vocab, hidden_size)
    targets = torch.randint(0, vocab, (rows,))
    monkeypatch.setattr(ceg, "FALLBACK_PIECE_LOGIT_BYTES", piece * vocab * 4)
    allocations = Allocations()
    with allocations:
        losses, lse = ceg._linear_row_losses._init_fn(hidden, weight, None, targets, IGNORE, 0.0, chunk, False)
    chunk_sized = [size for size in allocations.sizes if size > piece * vocab]
    assert chunk_sized == [chunk * vocab], chunk_sized  # the chunk's logits, once
    want = F.cross_entropy(hidden.double() @ weight.double().t(), targets, reduction="none")
    torch.testing.assert_close(losses, want.float(), rtol=1e-6, atol=1e-6)


@native_only
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
@pytest.mark.parametrize("with_bias", [False, True], ids=["no_bias", "bias"])
def test_linear_first_pass_reads_float32_logits_column_major_on_the_cpu(dtype, with_bias):
    # On the CPU with the native kernels, the forward's chunk loop forms float32 logits as weight @ h.T and takes
    # their logsumexp with the column kernel (the row kernel does not run); other dtypes keep the row layout (the
    # transposed matmul measured slower for them). Either way the losses and logsumexps are F.cross_entropy's,
    # ignored rows 0, over odd chunks (5 rows of 23).
    from torch.utils._python_dispatch import TorchDispatchMode

    class Calls(TorchDispatchMode):
        names = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            Calls.names.append(str(func))
            return func(*args, **(kwargs or {}))

    generator = torch.Generator().manual_seed(4)
    hidden = torch.randn(23, 6, generator=generator, dtype=torch.float64)
    weight = torch.randn(11, 6, generator=generator, dtype=torch.float64)
    bias = torch.randn(11, generator=generator, dtype=torch.float64) if with_bias else None
    targets = torch.randint(0, 11, (23,), generator=generator)
    targets[[0, 9, 22]] = IGNORE
    inputs = [t.to(dtype) if t is not None else None for t in (hidden, weight, bias)]
    with Calls():
        losses, lse = ceg._linear_row_losses._init_fn(*inputs, targets, IGNORE, 0.1, 5, True)
    column_major = dtype == torch.float32
    assert ("dro_ext.logsumexp_columns.default" in Calls.names) == column_major
    assert ("dro_ext.dro_cross_entropy.default" in Calls.names) != column_major
    logits = F.linear(hidden, weight, bias)
    keep = targets != IGNORE
    tolerance = ref.tolerances(dtype)
    torch.testing.assert_close(losses.double(), F.cross_entropy(logits, targets, reduction="none",
                                                                ignore_index=IGNORE, label_smoothing=0.1), **tolerance)
    torch.testing.assert_close(ref.combined_lse(lse), torch.where(keep, torch.logsumexp(logits, dim=1), 0.0),
                               **tolerance)


# ---------------------------------------------------------------------------------------------------
# The custom-op contract, gradcheck, torch.compile
# ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("native", [True, False], ids=["native", "python"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float64], ids=str)
def test_opcheck_row_loss_ops(native, dtype):
    if native and not _backend.native_available():
        pytest.skip("native extension not built")
    grad = dtype == torch.float64
    logits = torch.randn(9, 7, dtype=dtype, requires_grad=grad)
    targets = torch.randint(0, 7, (9,))
    targets[3] = IGNORE
    torch.library.opcheck(torch.ops.dro_ext.cross_entropy_row_losses.default, (logits, targets, IGNORE, 0.1, native))
    hidden = torch.randn(9, 5, dtype=dtype, requires_grad=grad)
    weight = torch.randn(7, 5, dtype=dtype, requires_grad=grad)
    bias = torch.randn(7, dtype=dtype, requires_grad=grad)
    torch.library.opcheck(torch.ops.dro_ext.linear_cross_entropy_row_losses.default,
                          (hidden, weight, bias, targets, IGNORE, 0.1, 4, native))
    _, lse = torch.ops.dro_ext.linear_cross_entropy_row_losses(hidden.detach(), weight.detach(), bias.detach(),
                                                               targets, IGNORE, 0.1, 4, native)
    row_weight = torch.rand(9, dtype=lse.dtype)
    torch.library.opcheck(torch.ops.dro_ext.linear_cross_entropy_row_losses_backward.default,
                          (row_weight, hidden.detach(), weight.detach(), bias.detach(), targets, lse, IGNORE, 0.1, 4,
                           native, True, True, True))


@pytest.mark.parametrize("name,params", [("chi2", {}), ("kl_cvar", {"alpha": 0.2}), ("smoothed_cvar", {"alpha": 0.1})],
                         ids=["chi2", "kl_cvar", "smoothed_cvar"])
def test_gradcheck(backend, name, params):
    targets = torch.tensor([[0, 4, IGNORE], [2, 2, 1]])
    groups = torch.tensor([[0, 1, 1], [1, 2, 0]])
    logits = torch.randn(2, 3, 5, dtype=torch.float64, requires_grad=True)
    eta = torch.tensor(1.4, dtype=torch.float64, requires_grad=True)
    torch.autograd.gradcheck(
        lambda x, e: dro_ext.dro_cross_entropy(x, targets, e, LAM, name, scale=SCALE, label_smoothing=0.1,
                                               groups=groups, num_groups=3, **params), (logits, eta))
    hidden = torch.randn(2, 3, 3, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(5, 3, dtype=torch.float64, requires_grad=True)
    bias = torch.randn(5, dtype=torch.float64, requires_grad=True)
    torch.autograd.gradcheck(
        lambda h, w, b, e: dro_ext.dro_linear_cross_entropy(h, w, targets, e, LAM, name, bias=b, scale=SCALE,
                                                            groups=groups[:, 0], num_groups=3, chunk_size=4,
                                                            **params),
        (hidden, weight, bias, eta))


def test_compiled_fullgraph_matches_eager(backend):
    torch._dynamo.reset()

    def step(logits, hidden, weight, bias, targets, groups, eta):
        return (dro_ext.dro_cross_entropy(logits, targets, eta, LAM, "smoothed_cvar", alpha=0.1, label_smoothing=0.1,
                                          groups=groups, num_groups=3)
                + dro_ext.dro_linear_cross_entropy(hidden, weight, targets, eta, LAM, "kl", bias=bias, chunk_size=5,
                                                   groups=groups[:, 0], num_groups=3))

    def make():
        torch.manual_seed(1)
        targets = torch.randint(0, 9, (3, 4))
        targets[0, 0] = IGNORE
        return (torch.randn(3, 4, 9, requires_grad=True), torch.randn(3, 4, 4, requires_grad=True),
                torch.randn(9, 4, requires_grad=True), torch.randn(9, requires_grad=True),
                targets, torch.randint(0, 3, (3, 4)), torch.tensor(2.0, requires_grad=True))

    eager_inputs, compiled_inputs = make(), make()
    eager = step(*eager_inputs)
    eager.backward()
    compiled = torch.compile(step, fullgraph=True)(*compiled_inputs)
    compiled.backward()
    torch.testing.assert_close(compiled, eager)
    for a, b in zip(compiled_inputs, eager_inputs):
        if a.grad is not None or b.grad is not None:
            torch.testing.assert_close(a.grad, b.grad)


# ---------------------------------------------------------------------------------------------------
# Bad input
# ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("linear", [False, True], ids=["logits", "linear"])
def test_bad_groups_name_the_argument(backend, linear):
    targets = torch.tensor([[0, 1, 2], [3, IGNORE, 1]])
    if linear:
        head = (torch.randn(2, 3, 4), torch.randn(5, 4))

        def call(**kwargs):
            return dro_ext.dro_linear_cross_entropy(*head, targets, 0.0, LAM, "chi2", **kwargs)
    else:
        logits = torch.randn(2, 3, 5)

        def call(**kwargs):
            return dro_ext.dro_cross_entropy(logits, targets, 0.0, LAM, "chi2", **kwargs)

    good = torch.tensor([0, 1])
    with pytest.raises(TypeError, match="groups must be an int32 or int64"):
        call(groups=good.float(), num_groups=2)
    with pytest.raises(TypeError, match="groups must be a torch.Tensor"):
        call(groups=[0, 1], num_groups=2)
    with pytest.raises(ValueError, match=r"groups must have the shape of targets, \(2, 3\).*\(2,\).*got \(3,\)"):
        call(groups=torch.tensor([0, 1, 0]), num_groups=2)
    with pytest.raises(IndexError, match="groups holds an id outside"):
        call(groups=torch.tensor([0, 2]), num_groups=2)
    with pytest.raises(IndexError, match="groups holds an id outside"):
        call(groups=torch.tensor([[0, 1, 0], [1, 0, -1]]), num_groups=2)
    call(groups=torch.tensor([[0, 1, 0], [1, 7, 1]]), num_groups=2)  # the ignored token's id is not read
    with pytest.raises(ValueError, match="without num_groups"):
        call(groups=good)
    with pytest.raises(ValueError, match="num_groups=2 was given without groups"):
        call(num_groups=2)
    with pytest.raises(ValueError, match="num_groups must be >= 1"):
        call(groups=good, num_groups=0)
    with pytest.raises(TypeError, match="num_groups must be an int"):
        call(groups=good, num_groups=2.0)
    with pytest.raises(ValueError, match="num_groups must be >= 1"):
        dro_ext.DROCrossEntropyLoss(num_groups=0)
    # A module's num_groups is its constructor's, groups its forward's: the error says which to pass where.
    if linear:
        grouped, plain = dro_ext.DROLinearCrossEntropyLoss(num_groups=2), dro_ext.DROLinearCrossEntropyLoss()
        module_args = (*head, targets)
    else:
        grouped, plain = dro_ext.DROCrossEntropyLoss(num_groups=2), dro_ext.DROCrossEntropyLoss()
        module_args = (logits, targets)
    name = type(grouped).__name__
    with pytest.raises(ValueError, match=rf"this {name} was built with num_groups=2; pass forward\(.*groups=\.\.\.\)"):
        grouped(*module_args)
    without = rf"this {name} was built without num_groups; pass {name}\(\.\.\., num_groups=G\)"
    with pytest.raises(ValueError, match=without):
        plain(*module_args, groups=good)
    grouped(*module_args, groups=good)


@pytest.mark.parametrize("layout", ["logits-row-major", "logits-column-major", "linear"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16], ids=str)
def test_target_out_of_range_names_targets(backend, layout, dtype):
    # Column-major logits (and the linear op's float32 first pass) take the column logsumexp kernel, which reads no
    # target: the check must not be left to a gather's bare index error.
    groups = torch.zeros(4, dtype=torch.int64)
    for bad in (9, -3):
        targets = torch.tensor([0, bad, 1, 2])
        if layout == "linear":
            hidden, weight = torch.randn(4, 3, dtype=dtype), torch.randn(5, 3, dtype=dtype)
            calls = [lambda: dro_ext.dro_linear_cross_entropy(hidden, weight, targets, 0.0, LAM, groups=groups,
                                                              num_groups=1),
                     lambda: dro_ext.linear_cross_entropy_losses(hidden, weight, targets)]
        else:
            column_major = layout == "logits-column-major"
            logits = torch.randn(5, 4, dtype=dtype).t() if column_major else torch.randn(4, 5, dtype=dtype)
            calls = [lambda: dro_ext.dro_cross_entropy(logits, targets, 0.0, LAM, groups=groups, num_groups=1),
                     lambda: dro_ext.cross_entropy_losses(logits, targets)]
        for call in calls:
            with pytest.raises(IndexError, match=rf"targets must be class indices in \[0, 5\).*got targets\[1\]={bad}"):
                call()


@pytest.mark.parametrize("chunk_size", [1, 2, 4])
def test_a_target_out_of_range_in_a_later_chunk_is_named_by_its_index_in_the_batch(backend, chunk_size):
    """The linear cross-entropies' native CPU chunk kernel counted the failing target from its chunk's start
    (targets[1] for the batch's targets[5] at chunk_size 4)."""
    hidden, weight = torch.randn(7, 3), torch.randn(5, 3)
    for bad in (5, -1):
        targets = torch.tensor([0, 1, 2, 3, 4, bad, 1])
        calls = [lambda: dro_ext.dro_linear_cross_entropy(hidden, weight, targets, 0.0, LAM, chunk_size=chunk_size),
                 lambda: dro_ext.dro_linear_cross_entropy(hidden, weight, targets, 0.0, LAM, chunk_size=chunk_size,
                                                          groups=torch.zeros(7, dtype=torch.int64), num_groups=1),
                 lambda: dro_ext.linear_cross_entropy_losses(hidden, weight, targets, chunk_size=chunk_size)]
        for call in calls:
            with pytest.raises(IndexError, match=rf"got targets\[5\]={bad}$"):
                call()


@pytest.mark.parametrize("classes", [300, 2048, 32000])
def test_confident_rows_over_many_classes_keep_their_small_losses(backend, classes):
    """float32 rows with a confident target over many classes: the loss log(1 + s) has s spread over thousands of
    probabilities each below half float32's step at 1, which a float32 sum after the target's term drops (the head's
    first pass lost most of such losses, 65% on average at 32000 classes). Each path within a few of those steps of
    the float64 loss of the same float32 logits: per token, from the logits and from the head (logits formed exactly:
    a bias column and a one-hot margin)."""
    generator = torch.Generator().manual_seed(classes)
    rows, margin = 37, 17.0 + 3.5 * (classes > 1000)
    background = torch.randn(classes, generator=generator)
    targets = torch.randint(0, classes, (rows,), generator=generator)
    hidden = torch.zeros(rows, rows + 1)
    hidden[:, 0] = 1.0
    hidden[torch.arange(rows), torch.arange(rows) + 1] = 1.0
    weight = torch.zeros(classes, rows + 1)
    weight[:, 0] = background
    weight[targets, torch.arange(rows) + 1] = margin
    logits = background.expand(rows, classes).clone()
    logits[torch.arange(rows), targets] += margin
    assert torch.equal(hidden @ weight.t(), logits)  # exact: each logit is one float32 sum of two terms
    expected = F.cross_entropy(logits.double(), targets, reduction="none")
    step = torch.finfo(torch.float32).eps
    # The row kernel's lane that holds the target's 1 still rounds its later terms within a block, and the fallback
    # sums in float32 too: up to 17 and 5 steps measured (F.cross_entropy's own float32 sum: up to 420); the head's
    # column pass sums compensated (half a step), the fallback's head as its logits.
    row_allowed = 32 * step
    for name, got, allowed in (("logits", dro_ext.cross_entropy_losses(logits, targets), row_allowed),
                               ("head", dro_ext.linear_cross_entropy_losses(hidden, weight, targets),
                                row_allowed if backend == "python" else 4 * step)):
        error = (got.double() - expected).abs()
        assert bool((error <= allowed).all()), f"{name}: worst error {error.max().item() / step:.3g} steps"
