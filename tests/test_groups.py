"""DRO over groups: group_dro_loss (the penalized objective over group means), GroupDROLoss (online Group DRO) and
DROLoss(num_groups=...), against float64 references written from the formulas of docs/design.md section 1.9."""
import copy
import functools
import gc
import math
import weakref

import numpy as np
import pytest
import torch

import dro_ext
import reference as ref
from reference import DTYPES, case_kwargs
from dro_ext.groups import _group_sums



def random_batch(n, num_groups, dtype=torch.float64, absent=()):
    """n losses around 1 and their group ids in [0, num_groups), none of them in `absent`."""
    allowed = torch.tensor([g for g in range(num_groups) if g not in absent])
    groups = allowed[torch.randint(len(allowed), (n,))]
    return (1.0 + torch.randn(n, dtype=torch.float64)).to(dtype), groups


# ---------------------------------------------------------------------------------------------------
# float64 references, from the formulas
# ---------------------------------------------------------------------------------------------------


def ref_group_means(losses, groups, num_groups):
    """(m, n): the mean loss and the count of each group, 0 and 0 for an absent group (float64, differentiable)."""
    means, counts = [], []
    for g in range(num_groups):
        members = losses[groups == g]
        counts.append(float(members.numel()))
        means.append(members.mean() if members.numel() else losses.new_zeros(()))
    return torch.stack(means), torch.tensor(counts, dtype=torch.float64)


def ref_group_dro_loss(losses, groups, num_groups, eta, lam, name, alpha=None, k=None, scale=1.0, weights=None):
    """scale*eta + sum_g p_g lam psi*((m_g - scale*eta)/lam) over the present groups, p renormalized over them;
    p_g = n_g when weights is None."""
    m, n = ref_group_means(losses, groups, num_groups)
    p = n if weights is None else torch.as_tensor(weights, dtype=torch.float64)
    present = n > 0
    p = p[present] / p[present].sum()
    return scale * eta + (p * lam * ref.psi_star((m[present] - scale * eta) / lam, name, alpha, k)).sum()


# ---------------------------------------------------------------------------------------------------
# The stand-in reduction
# ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_group_sums_and_counts(dtype):
    losses, groups = random_batch(23, 6, dtype, absent=(4,))
    losses.requires_grad_()
    sums, counts = _group_sums(losses, groups, 6)
    assert sums.dtype == counts.dtype == (torch.float64 if dtype == torch.float64 else torch.float32)
    m, n = ref_group_means(losses.detach().double(), groups, 6)
    torch.testing.assert_close(counts.double(), n, rtol=0, atol=0)
    torch.testing.assert_close(sums.double(), m * n, rtol=1e-6, atol=1e-6)
    assert sums[4] == 0 and counts[4] == 0
    upstream = torch.randn(6, dtype=sums.dtype)
    (grad,) = torch.autograd.grad(sums, losses, upstream)
    assert torch.equal(grad, upstream[groups].to(dtype))


# ---------------------------------------------------------------------------------------------------
# group_dro_loss
# ---------------------------------------------------------------------------------------------------

WEIGHTINGS = ["batch", "population", "tensor"]


def weighting_args(weighting, num_groups):
    if weighting == "batch":
        return dict(weighting="batch"), None
    counts = torch.rand(num_groups, dtype=torch.float64) * 100 + 1
    if weighting == "population":
        return dict(weighting="population", group_counts=counts), counts
    counts[1] = 0.0  # a weight of 0 is allowed: that group does not count
    return dict(weighting=counts), counts


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("weighting", WEIGHTINGS)
@pytest.mark.parametrize("name,params", ref.CASES, ids=ref.CASE_IDS)
def test_group_dro_loss_matches_float64_reference(backend, name, params, weighting, dtype):
    lam, scale, num_groups = 0.7, 1.3, 6
    losses, groups = random_batch(29, num_groups, dtype, absent=(2,))
    losses.requires_grad_()
    eta = torch.tensor(0.6, requires_grad=True)
    kwargs, weights = weighting_args(weighting, num_groups)
    value = dro_ext.group_dro_loss(losses, groups, num_groups, eta, lam, name, scale=scale, **kwargs, **params)
    assert value.dtype == dtype and value.dim() == 0
    grad_l, grad_eta = torch.autograd.grad(value, (losses, eta))
    assert grad_l.dtype == dtype and grad_eta.dtype == torch.float32

    l64 = losses.detach().double().requires_grad_()
    e64 = eta.detach().double().requires_grad_()
    expected = ref_group_dro_loss(l64, groups, num_groups, e64, lam, name, scale=scale, weights=weights,
                                  **case_kwargs(params))
    exp_l, exp_eta = torch.autograd.grad(expected, (l64, e64))
    tol = ref.tolerances(dtype)
    torch.testing.assert_close(value.double(), expected, **tol)
    torch.testing.assert_close(grad_l.double(), exp_l, **tol)
    # eta is float32, and so is its gradient.
    torch.testing.assert_close(grad_eta.double(), exp_eta, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("name,params", ref.CASES, ids=ref.CASE_IDS)
def test_a_group_of_weight_zero_is_dropped_whatever_its_mean(backend, name, params):
    """A group of weight 0 counts as absent: the value is that of the batch without its losses and they get a zero
    gradient, even where its mean lies so far above the others that psi*(t) overflows (0 * inf gave NaN). A NaN
    mean of weight 0 still makes the value NaN."""
    losses = torch.tensor([1.0, 2.0, 1.5, 1e300, 3e300], dtype=torch.float64)
    groups = torch.tensor([0, 1, 1, 2, 2])
    weights = torch.tensor([1.0, 3.0, 0.0], dtype=torch.float64)
    eta = torch.tensor(1.2, dtype=torch.float64, requires_grad=True)
    options = dict(weighting=weights, **case_kwargs(params))
    l = losses.clone().requires_grad_()
    value = dro_ext.group_dro_loss(l, groups, 3, eta, 1e-3, name, **options)
    grad_l, grad_eta = torch.autograd.grad(value, (l, eta))
    l_kept = losses[:3].clone().requires_grad_()
    expected = dro_ext.group_dro_loss(l_kept, groups[:3], 3, eta, 1e-3, name, **options)
    exp_l, exp_eta = torch.autograd.grad(expected, (l_kept, eta))
    assert torch.isfinite(expected)
    torch.testing.assert_close(value, expected, rtol=1e-15, atol=0.0)
    torch.testing.assert_close(grad_l, torch.cat([exp_l, torch.zeros(2, dtype=torch.float64)]), rtol=1e-15, atol=0.0)
    torch.testing.assert_close(grad_eta, exp_eta, rtol=1e-15, atol=0.0)
    losses[3] = math.nan
    assert math.isnan(dro_ext.group_dro_loss(losses, groups, 3, eta, 1e-3, name, **options).item())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("weighting", ["batch", "population"])
def test_a_group_whose_sum_passes_the_dtypes_range_keeps_its_finite_mean(backend, dtype, weighting):
    """A group of float32 (or bfloat16) losses whose sum passes float32's largest number has a finite mean: the
    objective is formed from group sums wider than the losses', not from a sum rounded to +inf."""
    losses = torch.tensor([3e38, 3e38, 1.0], dtype=dtype, requires_grad=True)
    groups = torch.tensor([0, 0, 1])
    options = dict(weighting="population", group_counts=[1.0, 3.0]) if weighting == "population" else {}
    weights = None if weighting == "batch" else [1.0, 3.0]
    eta = torch.tensor(2.9e38, dtype=torch.float64, requires_grad=True)
    value = dro_ext.group_dro_loss(losses, groups, 2, eta, 1e38, "chi2", **options)
    grad_l, grad_eta = torch.autograd.grad(value, (losses, eta))
    l64 = losses.detach().double().requires_grad_()
    e64 = eta.detach().clone().requires_grad_()
    expected = ref_group_dro_loss(l64, groups, 2, e64, 1e38, "chi2", weights=weights)
    exp_l, exp_eta = torch.autograd.grad(expected, (l64, e64))
    assert torch.isfinite(expected) and value.dtype == dtype
    tol = ref.tolerances(dtype)
    torch.testing.assert_close(value.double(), expected, **tol)
    torch.testing.assert_close(grad_l.double(), exp_l, **tol)
    torch.testing.assert_close(grad_eta, exp_eta, rtol=1e-12, atol=0.0)


@pytest.mark.parametrize("name,params,lam", [("kl", {}, 1e-10), ("chi2", {}, 1e-18),
                                             ("cressie_read", dict(k=3.0), 1e-12),
                                             ("kl_cvar", dict(alpha=1e-8), 1e-10)])
def test_float32_group_means_are_not_rounded_before_the_objective(backend, name, params, lam):
    """float32 losses whose group mean float32 cannot hold, with lam below its spacing there: the objective at
    eta = the exact mean is that mean (t = 0), each loss's gradient half its group's weight and eta's 0. A mean
    rounded to float32 first moved t by (its rounding)/lam: inf, or values off by orders of magnitude."""
    losses = torch.tensor([1 + 2**-23, 1 + 2**-22, 1.0], dtype=torch.float32, requires_grad=True)
    groups = torch.tensor([0, 0, 1])
    mean = 1 + 1.5 * 2**-23  # group 0's exact mean, a float64
    kw = case_kwargs(params)
    for weights in (None, [1.0, 0.0]):  # group 1, far below eta, weighs 1/3 of the batch or nothing
        options = {} if weights is None else dict(weighting=torch.tensor(weights, dtype=torch.float64))
        eta = torch.tensor(mean, dtype=torch.float64, requires_grad=True)
        value = dro_ext.group_dro_loss(losses, groups, 2, eta, lam, name, **options, **kw)
        grad_l, grad_eta = torch.autograd.grad(value, (losses, eta))
        l64 = losses.detach().double().requires_grad_()
        e64 = eta.detach().clone().requires_grad_()
        expected = ref_group_dro_loss(l64, groups, 2, e64, lam, name, weights=weights, **kw)
        exp_l, exp_eta = torch.autograd.grad(expected, (l64, e64))
        torch.testing.assert_close(value.double(), expected, rtol=1.2e-7, atol=0.0)
        torch.testing.assert_close(grad_l.double(), exp_l, rtol=1.2e-7, atol=1e-30)
        torch.testing.assert_close(grad_eta, exp_eta, rtol=1e-9, atol=1e-9)
    module = dro_ext.DROLoss(name, lam=lam, num_groups=2, weighting="population", group_counts=[10, 1], **kw).double()
    with torch.no_grad():
        module.eta.fill_(mean)
    value = module(losses, groups)
    grad_l, grad_eta = torch.autograd.grad(value, (losses, module.eta))
    l64 = losses.detach().double().requires_grad_()
    e64 = module.eta.detach().clone().requires_grad_()
    expected = ref_group_dro_loss(l64, groups, 2, e64, lam, name, weights=[10.0, 1.0], **kw)
    exp_l, exp_eta = torch.autograd.grad(expected, (l64, e64))
    torch.testing.assert_close(value.double(), expected, rtol=1.2e-7, atol=0.0)
    torch.testing.assert_close(grad_l.double(), exp_l, rtol=1.2e-7, atol=1e-30)
    torch.testing.assert_close(grad_eta, exp_eta, rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize("name,params", [("chi2", {}), ("cvar", dict(alpha=0.5)), ("kl", {})])
def test_group_weights_count_relative_to_each_other_whatever_their_scale(backend, name, params):
    """Group weights are normalized before they multiply the terms: weights of 1e10 or 1e308 overflowed p * term
    (inf, NaN with zero gradients, an OverflowError), subnormal ones lost their ratio (1e-323 and 2e-323 read as
    1 to 2 only roughly), where the objective depends on their ratios alone."""
    kw = case_kwargs(params)
    cases = [(torch.tensor([1e300, 2e300], dtype=torch.float64), 1.5e300, 1e300,
              [[1e10, 1e10], [1e308, 1e308], [3e-320, 3e-320]], [1.0, 1.0]),
             (torch.tensor([1.0, 2.0], dtype=torch.float64), 1.5, 1.0, [[1e-323, 2e-323], [1e308, 2e307]],
              None)]
    groups = torch.tensor([0, 1])
    for losses, eta, lam, weightings, _ in cases:
        for weights in weightings:
            ratio = [w / max(weights) for w in weights]
            l64 = losses.clone().requires_grad_()
            e64 = torch.tensor(eta, dtype=torch.float64, requires_grad=True)
            expected = ref_group_dro_loss(l64, groups, 2, e64, lam, name, weights=ratio, **kw)
            exp_l, exp_eta = torch.autograd.grad(expected, (l64, e64))
            assert torch.isfinite(expected)
            for options in (dict(weighting=torch.tensor(weights, dtype=torch.float64)), dict(weighting=weights),
                            dict(weighting="population", group_counts=weights)):
                if options.get("weighting") == "population" and min(weights) == 0:
                    continue
                l = losses.clone().requires_grad_()
                e = torch.tensor(eta, dtype=torch.float64, requires_grad=True)
                value = dro_ext.group_dro_loss(l, groups, 2, e, lam, name, **options, **kw)
                grad_l, grad_eta = torch.autograd.grad(value, (l, e))
                torch.testing.assert_close(value, expected, rtol=1e-14, atol=0.0)
                torch.testing.assert_close(grad_l, exp_l, rtol=1e-14, atol=1e-300)
                torch.testing.assert_close(grad_eta, exp_eta, rtol=1e-14, atol=1e-14)


DRO_LOSS_DTYPES = [torch.float16, torch.float32, torch.float64]


def ulps(value, expected, dtype):
    value, expected = float(value.detach()), float(expected.detach())
    return abs(value - expected) / (torch.finfo(dtype).eps * max(abs(expected), 1e-30))


@pytest.mark.parametrize("dtype", DRO_LOSS_DTYPES, ids=str)
@pytest.mark.parametrize("name,params", ref.CASES, ids=ref.CASE_IDS)
def test_one_sample_per_group_is_dro_loss(backend, name, params, dtype):
    """With batch weighting and one sample per group, the group objective is dro_loss: bitwise against the
    fallback's dro_loss when the ids are 0..N-1 in sample order (the same terms summed by the same torch.sum);
    within a few ulps against the native kernels' float32 sums, when the ids are permuted, or when absent groups
    lie between them (zeros between the terms change how torch.sum's vector lanes pair them up)."""
    n, lam, scale = 37, 0.6, 1.4
    losses = (1.0 + torch.randn(n, dtype=torch.float64)).to(dtype).requires_grad_()
    eta = torch.tensor(0.7, dtype=torch.float64, requires_grad=True)
    expected = dro_ext.dro_loss(losses, eta, lam, name, scale=scale, **params)
    exp_l, exp_eta = torch.autograd.grad(expected, (losses, eta))
    in_order = torch.arange(n)
    gaps = torch.arange(n) * 2 + 1  # ids in sample order with absent groups between them, G > N
    for groups, num_groups, exact in ((in_order, n, True), (gaps, 2 * n + 3, False), (torch.randperm(n), n, False)):
        value = dro_ext.group_dro_loss(losses, groups, num_groups, eta, lam, name, scale=scale, **params)
        if exact and backend == "python":
            assert torch.equal(value, expected), (value, expected)
        else:
            assert ulps(value, expected, dtype) <= 4, (value, expected)
        grad_l, grad_eta = torch.autograd.grad(value, (losses, eta))
        torch.testing.assert_close(grad_l, exp_l, **ref.tolerances(dtype))
        torch.testing.assert_close(grad_eta, exp_eta, rtol=1e-5 if dtype != torch.float64 else 1e-12, atol=1e-9)


@pytest.mark.parametrize("num_groups", [1, 2, 7, 40])
def test_any_number_of_groups(backend, num_groups):
    """G = 1 (the whole batch is one group), G < N, G close to N, G > N (most groups absent)."""
    losses, groups = random_batch(9, num_groups)
    losses.requires_grad_()
    eta = torch.tensor(0.4, dtype=torch.float64, requires_grad=True)
    value = dro_ext.group_dro_loss(losses, groups, num_groups, eta, 0.5, "kl")
    expected = ref_group_dro_loss(losses, groups, num_groups, eta, 0.5, "kl")
    torch.testing.assert_close(value, expected, rtol=1e-12, atol=1e-12)
    got = torch.autograd.grad(value, (losses, eta))
    want = torch.autograd.grad(expected, (losses, eta))
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    if num_groups == 1:  # one group: lam psi*((mean - eta)/lam) + eta
        mean = losses.detach().mean()
        assert math.isclose(float(value.detach()), float(0.5 * torch.expm1((mean - 0.4) / 0.5) + 0.4), rel_tol=1e-13)


@pytest.mark.parametrize("name,params", ref.CASES, ids=ref.CASE_IDS)
def test_group_dro_loss_gradcheck(backend, name, params):
    losses, groups = random_batch(11, 5, absent=(3,))
    losses.requires_grad_()
    eta = torch.tensor(0.5, dtype=torch.float64, requires_grad=True)
    weights = torch.tensor([1.0, 2.0, 0.5, 4.0, 3.0], dtype=torch.float64)

    def batch(l, e):
        return dro_ext.group_dro_loss(l, groups, 5, e, 0.8, name, scale=1.5, **params)

    def weighted(l, e):
        return dro_ext.group_dro_loss(l, groups, 5, e, 0.8, name, weighting=weights, **params)

    assert torch.autograd.gradcheck(batch, (losses, eta))
    assert torch.autograd.gradcheck(weighted, (losses, eta))


def test_group_dro_loss_non_contiguous_and_int32_ids(backend):
    base = torch.randn(40, dtype=torch.float32)
    losses = base[::2]
    groups = torch.randint(4, (20,))
    eta = torch.tensor(0.1)
    want = dro_ext.group_dro_loss(losses.contiguous(), groups, 4, eta, 0.5, "chi2")
    assert torch.equal(dro_ext.group_dro_loss(losses, groups, 4, eta, 0.5, "chi2"), want)
    assert torch.equal(dro_ext.group_dro_loss(losses, groups.int(), 4, eta, 0.5, "chi2"), want)
    wide = torch.stack([groups, groups], 1)[:, 0]  # a strided view of the ids
    assert torch.equal(dro_ext.group_dro_loss(losses, wide, 4, eta, 0.5, "chi2"), want)


def test_group_dro_loss_nan_and_inf(backend):
    losses = torch.tensor([0.5, 1.0, 2.0, 0.3], requires_grad=True)
    groups = torch.tensor([0, 1, 1, 2])
    losses_nan = losses.detach().clone()
    losses_nan[2] = math.nan
    value = dro_ext.group_dro_loss(losses_nan.requires_grad_(), groups, 4, torch.tensor(0.0), 0.5, "cvar", alpha=0.5)
    assert torch.isnan(value)
    (grad,) = torch.autograd.grad(value, losses_nan)
    assert torch.isnan(grad).any()
    losses_inf = losses.detach().clone()
    losses_inf[3] = math.inf
    value = dro_ext.group_dro_loss(losses_inf, groups, 4, torch.tensor(0.0), 0.5, "chi2")
    assert value == math.inf


@pytest.mark.parametrize("weighting", ["batch", "population"])
def test_group_dro_loss_mask_is_the_kept_samples_alone(backend, weighting):
    # mask= counts only the True samples, reads only their ids (the masked ones may be anything) and gives the others
    # a zero gradient: the objective and gradients of the kept samples alone. DROLoss(num_groups) passes it on.
    losses, groups = random_batch(23, 5, absent=(4,))
    keep = torch.rand(23, generator=torch.Generator().manual_seed(3)) < 0.6
    ids = torch.where(keep, groups, torch.tensor(99))  # out of range where masked: never read
    counts = torch.tensor([3.0, 1.0, 2.0, 5.0, 4.0]) if weighting == "population" else None
    x = losses.clone().requires_grad_()
    eta = torch.tensor(0.2, dtype=torch.float64, requires_grad=True)
    value = dro_ext.group_dro_loss(x, ids, 5, eta, 0.4, "kl", weighting=weighting, group_counts=counts, mask=keep)
    grad, grad_eta = torch.autograd.grad(value, (x, eta))
    kept = losses[keep].clone().requires_grad_()
    eta_kept = eta.detach().clone().requires_grad_()
    want = dro_ext.group_dro_loss(kept, groups[keep], 5, eta_kept, 0.4, "kl", weighting=weighting,
                                  group_counts=counts)
    want_grad, want_eta = torch.autograd.grad(want, (kept, eta_kept))
    torch.testing.assert_close(value, want, rtol=1e-14, atol=0)
    torch.testing.assert_close(grad[keep], want_grad, rtol=1e-14, atol=1e-16)
    assert bool((grad[~keep] == 0).all())
    torch.testing.assert_close(grad_eta, want_eta, rtol=1e-14, atol=1e-16)
    module = dro_ext.DROLoss("kl", lam=0.4, num_groups=5, weighting=weighting, group_counts=counts).double()
    torch.testing.assert_close(module(losses, ids, mask=keep), dro_ext.group_dro_loss(
        losses[keep], groups[keep], 5, module.eta.detach(), 0.4, "kl", weighting=weighting, group_counts=counts),
        rtol=1e-14, atol=0)
    with pytest.raises(IndexError, match="groups holds an id outside"):  # a kept sample's id is still checked
        dro_ext.group_dro_loss(losses, ids, 5, eta, 0.4, "kl", mask=torch.ones(23, dtype=torch.bool))
    with pytest.raises(TypeError, match="mask must be a bool tensor"):
        dro_ext.group_dro_loss(losses, groups, 5, eta, 0.4, "kl", mask=keep.double())
    with pytest.raises(ValueError, match="mask must have the shape"):
        dro_ext.group_dro_loss(losses, groups, 5, eta, 0.4, "kl", mask=keep[1:])


def test_given_weights_as_a_sequence_are_the_tensor_weighting(backend):
    """weighting as a list, a tuple or a numpy array is the tensor of those weights (a sequence was refused, though
    the annotation and group_counts take one), in group_dro_loss, DROLoss and the exact objective."""
    import numpy as np

    losses, groups = random_batch(13, 4, torch.float64, absent=(2,))
    as_tensor = torch.tensor([0.5, 2.0, 1.0, 0.0], dtype=torch.float64)
    want = dro_ext.group_dro_loss(losses, groups, 4, 0.3, 0.7, "kl", weighting=as_tensor)
    want_module = dro_ext.DROLoss("kl", 0.7, eta_init=0.3, num_groups=4, weighting=as_tensor).double()(losses, groups)
    want_exact = dro_ext.robust_objective(losses, 0.7, "kl", groups=groups, num_groups=4, weighting=as_tensor)[0]
    for weights in ([0.5, 2.0, 1.0, 0.0], (0.5, 2, 1, 0), np.array([0.5, 2.0, 1.0, 0.0])):
        assert torch.equal(dro_ext.group_dro_loss(losses, groups, 4, 0.3, 0.7, "kl", weighting=weights), want)
        module = dro_ext.DROLoss("kl", 0.7, eta_init=0.3, num_groups=4, weighting=weights).double()
        assert torch.equal(module(losses, groups), want_module)
        assert torch.equal(dro_ext.robust_objective(losses, 0.7, "kl", groups=groups, num_groups=4,
                                                    weighting=weights)[0], want_exact)
    with pytest.raises(ValueError, match=r"weighting must have shape \(4,\)"):
        dro_ext.group_dro_loss(losses, groups, 4, 0.3, 0.7, weighting=[1.0, 2.0])


@pytest.mark.parametrize("divergence,params", [("chi2", {}), ("kl", {}), ("cvar", {"alpha": 0.3})])
def test_group_dro_loss_where_no_group_counts_is_zero_with_zero_gradients(backend, divergence, params):
    # A batch of padding alone (an all-False mask), or weights of 0 on every group present: nothing counts, and the
    # value is 0 with zero gradients, as GroupDROLoss and the fused grouped cross-entropy give (not 0/0 = NaN, which
    # would poison eta's gradient in an accumulated step).
    losses, groups = random_batch(17, 4, absent=(3,))
    nothing = torch.zeros(17, dtype=torch.bool)
    weights = torch.tensor([0.0, 0.0, 0.0, 1.0], dtype=torch.float64)  # all on the group absent from the batch
    for dtype in (torch.float32, torch.float64):
        for kwargs in ({"mask": nothing}, {"weighting": weights}, {"mask": nothing, "weighting": weights}):
            x = losses.to(dtype).requires_grad_()
            eta = torch.tensor(0.3, dtype=dtype, requires_grad=True)
            value = dro_ext.group_dro_loss(x, groups, 4, eta, 0.5, divergence, **params, **kwargs)
            grad, grad_eta = torch.autograd.grad(value, (x, eta))
            assert value.dtype == dtype and value.item() == 0.0, kwargs
            assert bool((grad == 0).all()) and grad_eta.item() == 0.0, kwargs
        module = dro_ext.DROLoss(divergence, lam=0.5, num_groups=4, **params).to(dtype)
        x = losses.to(dtype).requires_grad_()
        value = module(x, groups, mask=nothing)
        value.backward()
        assert value.item() == 0.0 and bool((x.grad == 0).all()) and module.eta.grad.item() == 0.0
    # A NaN loss still makes the value NaN where its group counts, and one kept sample is a batch again.
    x = losses.clone()
    x[3] = math.nan
    assert math.isnan(dro_ext.group_dro_loss(x, groups, 4, 0.3, 0.5, divergence, **params).item())
    one = nothing.clone()
    one[5] = True
    torch.testing.assert_close(dro_ext.group_dro_loss(losses, groups, 4, 0.3, 0.5, divergence, **params, mask=one),
                               dro_ext.dro_loss(losses[5:6], 0.3, 0.5, divergence, **params), rtol=1e-14, atol=0)


@pytest.mark.parametrize("weighting", ["batch", "population", "tensor", "population-list", "list"])
def test_group_dro_loss_compiles_fullgraph(backend, weighting):
    # (sequences of weights or counts failed fullgraph=True: their host check branched on a tensor made of them)
    losses, groups = random_batch(17, 5, torch.float32, absent=(1,))
    losses.requires_grad_()
    eta = torch.tensor(0.3, requires_grad=True)
    options = {"batch": {}, "population": dict(weighting="population", group_counts=torch.tensor([3, 1, 2, 5, 4])),
               "tensor": dict(weighting=torch.tensor([0.5, 1.0, 0.0, 2.0, 1.0])),
               "population-list": dict(weighting="population", group_counts=[3, 1, 2, 5, 4]),
               "list": dict(weighting=[0.5, 1.0, 0.0, 2.0, 1.0])}[weighting]

    def fn(l, g, e):
        return dro_ext.group_dro_loss(l, g, 5, e, 0.5, "smoothed_cvar", alpha=0.2, **options)

    torch._dynamo.reset()
    compiled = torch.compile(fn, fullgraph=True)
    got = compiled(losses, groups, eta)
    want = fn(losses, groups, eta)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(torch.autograd.grad(got, (losses, eta)), torch.autograd.grad(want, (losses, eta)),
                               rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("bad", ["negative weight", "zero weights", "NaN weight", "zero count", "id -1"])
def test_compiled_group_calls_refuse_bad_values(backend, bad):
    # While compiling, the host checks of a tensor's values give way to assertions in the graph: a compiled
    # group_dro_loss returned a number for negative, all-zero or NaN weights and zero counts, and the fallback's
    # compiled group_sums added a sample of id -1 to the last group.
    losses, groups = torch.tensor([1.0, 2.0, 4.0, 8.0]), torch.tensor([0, 1, 2, 1])
    weights = {"negative weight": torch.tensor([-1.0, 2.0, 0.5]), "zero weights": torch.zeros(3),
               "NaN weight": torch.tensor([1.0, math.nan, 1.0])}
    if bad in weights:
        def fn(l, g):
            return dro_ext.group_dro_loss(l, g, 3, 0.0, 0.5, weighting=weights[bad])
    elif bad == "zero count":
        def fn(l, g):
            return dro_ext.group_dro_loss(l, g, 3, 0.0, 0.5, weighting="population",
                                          group_counts=torch.tensor([3.0, 0.0, 2.0]))
    else:
        groups = torch.tensor([0, 1, 2, -1])

        def fn(l, g):
            return dro_ext.group_sums(l, g, 3)[0]
    with pytest.raises((ValueError, IndexError)):
        fn(losses, groups)
    torch._dynamo.reset()
    with pytest.raises((RuntimeError, IndexError), match="dro_ext: (weighting|group_counts|groups)"):
        torch.compile(fn, fullgraph=True)(losses, groups)


GROUP_LOSS_BAD_INPUTS = [
    (dict(groups=torch.tensor([0.0, 1.0, 0.0, 1.0])), TypeError, "groups must be an int32 or int64"),
    (dict(groups=torch.tensor([0, 1, 0])), ValueError, "groups must have the shape"),
    (dict(groups=torch.tensor([[0, 1, 0, 1]])), ValueError, "groups must have the shape"),
    (dict(groups=[0, 1, 0, 1]), TypeError, "groups must be a torch.Tensor"),
    (dict(groups=torch.tensor([0, -1, 0, 1])), IndexError, "groups holds an id outside"),
    (dict(groups=torch.tensor([0, 3, 0, 1])), IndexError, "groups holds an id outside"),
    (dict(groups=torch.tensor([0, 1, 0, 1], device="meta")), ValueError, "groups is on meta"),
    (dict(num_groups=0), ValueError, "num_groups must be >= 1"),
    (dict(num_groups=3.0), TypeError, "num_groups must be an int"),
    (dict(num_groups=True), TypeError, "num_groups must be an int"),
    (dict(weighting="population"), ValueError, "needs group_counts"),
    (dict(weighting="uniform"), ValueError, "weighting must be"),
    (dict(group_counts=torch.ones(3)), ValueError, "group_counts is used by weighting='population' only"),
    (dict(weighting="population", group_counts=torch.ones(4)), ValueError, r"group_counts must have shape \(3,\)"),
    (dict(weighting="population", group_counts=torch.tensor([1.0, 0.0, 2.0])), ValueError,
     "group_counts must be > 0"),
    (dict(weighting="population", group_counts=torch.tensor([1.0, math.nan, 2.0])), ValueError,
     "group_counts must be finite"),
    (dict(weighting=torch.tensor([1.0, -1.0, 2.0])), ValueError, "weighting must be >= 0"),
    (dict(weighting=torch.zeros(3)), ValueError, "weighting must be >= 0 with a positive sum"),
    (dict(weighting=torch.ones(2)), ValueError, r"weighting must have shape \(3,\)"),
    (dict(losses=torch.ones(0), groups=torch.ones(0, dtype=torch.int64)), ValueError, "empty"),
    (dict(losses=torch.ones(4, dtype=torch.int64)), TypeError, "floating"),
    (dict(lam=0.0), ValueError, "lam"),
    (dict(scale=-1.0), ValueError, "scale"),
    (dict(divergence="cvar"), ValueError, "alpha"),
    (dict(divergence="cvar", alpha=1.5), ValueError, "alpha"),
    (dict(divergence="cressie_read", k=1.0), ValueError, "k"),
    (dict(divergence="chi2", alpha=0.5), ValueError, "takes no alpha"),
    (dict(eta=torch.ones(2)), ValueError, "eta must be a 0-d"),
]


@pytest.mark.parametrize("override,exc,match", GROUP_LOSS_BAD_INPUTS)
def test_group_dro_loss_bad_input_names_the_argument(backend, override, exc, match):
    args = dict(losses=torch.ones(4), groups=torch.tensor([0, 1, 0, 1]), num_groups=3, eta=torch.tensor(0.0),
                lam=0.5, divergence="chi2")
    args.update(override)
    positional = [args.pop(k) for k in ("losses", "groups", "num_groups", "eta", "lam", "divergence")]
    with pytest.raises(exc, match=match):
        dro_ext.group_dro_loss(*positional, **args)


# ---------------------------------------------------------------------------------------------------
# GroupDROLoss
# ---------------------------------------------------------------------------------------------------


def group_dro64(*args, **kwargs):
    """A GroupDROLoss whose state is float64 from the start (built under the default dtype float64)."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        return dro_ext.GroupDROLoss(*args, **kwargs)
    finally:
        torch.set_default_dtype(previous)


class RefGroupDRO:
    """Online Group DRO in float64, written from the update rules (q itself, not its logarithm)."""

    def __init__(self, num_groups, step_size=0.01, adjustment=None, group_counts=None, normalize_loss=False,
                 missing="zero", q_init=None, mode="eg", alpha=None, ema_gamma=0.1, min_var_weight=0.0):
        self.G, self.step, self.normalize, self.missing = num_groups, step_size, normalize_loss, missing
        self.mode, self.alpha, self.gamma, self.mvw = mode, alpha, ema_gamma, min_var_weight
        q = torch.ones(num_groups, dtype=torch.float64) if q_init is None else torch.as_tensor(q_init).double()
        self.q = q / q.sum()
        self.active = self.q > 0
        self.N = None if group_counts is None else torch.as_tensor(group_counts).double()
        self.adj = torch.zeros(num_groups, dtype=torch.float64)
        if adjustment is not None:
            self.adj = torch.as_tensor(adjustment, dtype=torch.float64) / self.N.sqrt()
        self.ema = torch.zeros(num_groups, dtype=torch.float64)
        self.last = torch.zeros(num_groups, dtype=torch.float64)
        self.seen = [False] * num_groups

    def __call__(self, losses, groups, update=True):
        m, n = ref_group_means(losses, groups, self.G)
        if update:
            self.update(m.detach(), n)
        return (self.q * m).sum()

    def update(self, m, n):
        for g in range(self.G):
            if n[g] > 0:
                self.ema[g] = (1 - self.gamma) * self.ema[g] + self.gamma * m[g] if self.seen[g] else m[g]
                self.last[g] = m[g]
                self.seen[g] = True
        if self.mode == "eg":
            a = (m if self.missing == "zero" else self.last) + self.adj
            if self.normalize and a.sum() != 0:
                a = a / a.sum()
            q = self.q * torch.exp(self.step * a)
            self.q = q / q.sum()
            return
        base = self.N if self.N is not None else n
        shares = torch.where(self.active, base, 0.0)
        if shares.sum() == 0:
            return
        shares = shares / shares.sum()
        ranking = (self.ema + self.adj).tolist()
        order = sorted(range(self.G), key=lambda g: -ranking[g])  # sorted() is stable: ties keep the group order
        w = torch.zeros(self.G, dtype=torch.float64)
        room = self.alpha
        for g in order:
            w[g] = min(float(shares[g]), max(room, 0.0))
            room -= float(shares[g])
        w = w / w.sum()
        self.q = (1 - self.mvw) * w + self.mvw * shares


def batches(num_steps, n, num_groups, dtype=torch.float64):
    """A run of batches where some groups are missing from some steps (and every group from none at the end)."""
    out = []
    for step in range(num_steps):
        absent = {(step + j) % num_groups for j in range(step % 3)}
        losses, groups = random_batch(n, num_groups, dtype, absent=absent)
        out.append((losses * (1 + step % 2), groups))  # group losses that change over the run
    return out


EG_CONFIGS = {
    "plain": dict(step_size=0.5),
    "stale": dict(step_size=0.5, missing="stale"),
    "adjusted": dict(step_size=0.3, adjustment=torch.tensor([1.0, 0.5, 2.0, 0.0, 1.5]),
                     group_counts=torch.tensor([10.0, 40.0, 5.0, 100.0, 20.0])),
    "adjusted-scalar-stale": dict(step_size=0.3, adjustment=2.0, missing="stale",
                                  group_counts=torch.tensor([10.0, 40.0, 5.0, 100.0, 20.0])),
    "normalized": dict(step_size=2.0, normalize_loss=True),
    "normalized-stale": dict(step_size=2.0, normalize_loss=True, missing="stale"),
    "adjusted-normalized-stale": dict(step_size=2.0, adjustment=torch.tensor([1.0, 0.5, 2.0, 0.0, 1.5]),
                                      group_counts=torch.tensor([10.0, 40.0, 5.0, 100.0, 20.0]), normalize_loss=True,
                                      missing="stale"),
    "disabled": dict(step_size=0.5, q_init=torch.tensor([0.0, 1.0, 2.0, 0.0, 1.0])),
    "greedy": dict(mode="greedy_cvar", alpha=0.3),
    "greedy-population": dict(mode="greedy_cvar", alpha=0.45, group_counts=torch.tensor([10.0, 40.0, 5.0, 100.0, 20.0]),
                              adjustment=1.0, ema_gamma=0.3),
    "greedy-mixed": dict(mode="greedy_cvar", alpha=0.2, min_var_weight=0.25),
    "greedy-alpha1": dict(mode="greedy_cvar", alpha=1.0),
    "greedy-alpha3": dict(mode="greedy_cvar", alpha=3.0, group_counts=torch.tensor([10.0, 40.0, 5.0, 100.0, 20.0])),
    "greedy-disabled": dict(mode="greedy_cvar", alpha=0.5, q_init=torch.tensor([1.0, 0.0, 1.0, 1.0, 1.0])),
}


@pytest.mark.parametrize("config", list(EG_CONFIGS), ids=list(EG_CONFIGS))
def test_group_dro_trajectory_matches_float64_reference(backend, config):
    """q, the running means, the value and its gradient over several steps, groups missing from some of them, and
    update=False steps in between, against the float64 reference."""
    kwargs = EG_CONFIGS[config]
    module = group_dro64(5, **kwargs)
    reference = RefGroupDRO(5, **kwargs)
    for step, (losses, groups) in enumerate(batches(8, 11, 5)):
        update = step % 4 != 3
        losses = losses.requires_grad_()
        value = module(losses, groups, update=update)
        (grad,) = torch.autograd.grad(value, losses)
        l64 = losses.detach().clone().requires_grad_()
        expected = reference(l64, groups, update=update)
        (exp_grad,) = torch.autograd.grad(expected, l64)
        torch.testing.assert_close(module.q, reference.q, rtol=1e-12, atol=1e-15)
        torch.testing.assert_close(value, expected, rtol=1e-12, atol=1e-15)
        torch.testing.assert_close(grad, exp_grad, rtol=1e-12, atol=1e-15)
        torch.testing.assert_close(module.ema_loss, reference.ema, rtol=1e-12, atol=1e-15)
        assert module.seen.tolist() == reference.seen
    if "q_init" in kwargs:
        assert torch.equal(module.q[kwargs["q_init"] == 0], torch.zeros(2 if config == "disabled" else 1,
                                                                       dtype=torch.float64))
        assert not torch.isnan(module.log_q).any()


def test_missing_modes_differ_as_documented(backend):
    """A group absent from a batch scores 0 ("zero": its q falls against the present groups) or its last mean
    loss ("stale": here the largest, so its q rises)."""
    losses, groups = torch.tensor([3.0, 1.0, 1.0]), torch.tensor([0, 1, 2])
    later, later_groups = torch.tensor([1.0, 1.0]), torch.tensor([1, 2])
    q = {}
    for missing in ("zero", "stale"):
        module = dro_ext.GroupDROLoss(3, 1.0, missing=missing)
        module(losses, groups)
        before = module.q.clone()
        module(later, later_groups)
        q[missing] = (before, module.q)
    assert q["zero"][1][0] < q["zero"][0][0]
    assert q["stale"][1][0] > q["stale"][0][0]


@pytest.mark.parametrize("mode", ["eg", "greedy_cvar"])
@pytest.mark.parametrize("masked", [False, True], ids=["plain", "masked"])
def test_eval_mode_leaves_the_state_alone_by_default(backend, mode, masked):
    """update=None (the default) follows module.training: in eval() a call is the update=False call (the value
    under the current q, the state bitwise unchanged), an explicit update=True still updates, and train() updates
    again, each against the float64 reference."""
    kwargs = dict(step_size=0.7) if mode == "eg" else dict(mode="greedy_cvar", alpha=0.3)
    module, reference = group_dro64(5, **kwargs), RefGroupDRO(5, **kwargs)
    run = batches(4, 9, 5)
    mask = (lambda losses: torch.ones_like(losses, dtype=torch.bool)) if masked else (lambda losses: None)

    def call(losses, groups, update, ref_update):
        value = module(losses, groups, **({} if update is None else {"update": update}), mask=mask(losses))
        torch.testing.assert_close(value, reference(losses, groups, update=ref_update), rtol=1e-12, atol=1e-15)
        torch.testing.assert_close(module.q, reference.q, rtol=1e-12, atol=1e-15)

    call(*run[0], None, True)  # as constructed: training, so it updates
    module.eval()
    state = {key: value.clone() for key, value in module.state_dict().items()}
    call(*run[1], None, False)
    for key, value in module.state_dict().items():
        assert torch.equal(value, state[key]), key
    call(*run[2], True, True)  # an explicit update in eval()
    module.train()
    call(*run[3], None, True)


def test_greedy_cvar_weights_by_hand():
    """Four groups of population shares 0.1, 0.2, 0.3, 0.4 ranked 3 > 1 > 0 > 2: at alpha = 0.5 the CVaR takes
    group 3 whole (0.4) and 0.1 of group 1, so q = (0, 0.2, 0, 0.8); at alpha >= 1 q is the shares."""
    counts = torch.tensor([1.0, 2.0, 3.0, 4.0])
    losses, groups = torch.tensor([2.0, 3.0, 1.0, 4.0], dtype=torch.float64), torch.tensor([0, 1, 2, 3])
    for alpha, want in ((0.5, [0.0, 0.2, 0.0, 0.8]), (1.0, [0.1, 0.2, 0.3, 0.4]), (7.0, [0.1, 0.2, 0.3, 0.4])):
        module = group_dro64(4, mode="greedy_cvar", alpha=alpha, group_counts=counts)
        value = module(losses, groups)
        torch.testing.assert_close(module.q, torch.tensor(want, dtype=torch.float64), rtol=1e-15, atol=1e-15)
        torch.testing.assert_close(value, (module.q * losses).sum(), rtol=1e-15, atol=0)
    mixed = group_dro64(4, mode="greedy_cvar", alpha=0.5, group_counts=counts, min_var_weight=0.5)
    mixed(losses, groups)
    torch.testing.assert_close(mixed.q, torch.tensor([0.05, 0.2, 0.15, 0.6], dtype=torch.float64), rtol=1e-15,
                               atol=1e-16)



@pytest.mark.parametrize("alpha", [1e-30, 1e-46, 1e-300], ids=["1e-30", "below-float32", "1e-300"])
def test_greedy_cvar_at_a_tiny_alpha_in_a_float32_state(backend, alpha):
    """Any alpha > 0 puts the whole CVaR on the worst group, also where alpha is below float32's smallest subnormal
    (the state's dtype here): a float32 alpha - before was 0 for every group, and q 0/0 = NaN."""
    losses, groups = torch.tensor([1.0, 2.0, 3.0, 0.5]), torch.tensor([0, 1, 2, 2])  # means 1, 2, 1.75
    module = dro_ext.GroupDROLoss(3, mode="greedy_cvar", alpha=alpha)
    value = module(losses, groups)
    assert module.log_q.dtype == torch.float32
    assert torch.equal(module.q, torch.tensor([0.0, 1.0, 0.0])) and float(value) == 2.0
    mixed = dro_ext.GroupDROLoss(3, mode="greedy_cvar", alpha=alpha, min_var_weight=0.5)
    mixed(losses, groups)  # half the batch shares (1/4, 1/4, 1/2) mixed in
    torch.testing.assert_close(mixed.q, torch.tensor([0.125, 0.625, 0.25]), rtol=2e-7, atol=0)


def test_greedy_cvar_counts_a_tiny_share_before_a_large_one(backend):
    """Shares (5e-21, 0.5, 0.5) ranked 0 > 1 > 2 at alpha = 1e-20: group 0 whole (5e-21), group 1 the rest up to alpha
    (5e-21), group 2 nothing, so q = (1/2, 1/2, 0). The total before group 1, formed as the running sum minus its own
    share, cancelled group 0's share (5e-21 + 0.5 - 0.5 = 0) and group 1 took alpha whole: q = (1/3, 2/3, 0)."""
    losses, groups = torch.tensor([3.0, 2.0, 1.0], dtype=torch.float64), torch.tensor([0, 1, 2])
    module = group_dro64(3, mode="greedy_cvar", alpha=1e-20, group_counts=[1.0, 1e20, 1e20])
    value = module(losses, groups)
    torch.testing.assert_close(module.q, torch.tensor([0.5, 0.5, 0.0], dtype=torch.float64), rtol=1e-15, atol=0)
    assert math.isclose(float(value), 2.5, rel_tol=1e-15)


def test_initial_q_and_population_counts_of_any_finite_scale(backend):
    """q_init and group_counts count by their ratios: of 1e308 each, their sum overflowed and q_init read as q = 0 (every
    group disabled, NaN after a step), greedy CVaR's population shares as 0 (q NaN); an adjustment term C / sqrt(N)
    that overflows is refused by name, not left to make q NaN."""
    losses, groups = torch.tensor([1.0, 2.0], dtype=torch.float64), torch.tensor([0, 1])
    module = group_dro64(2, q_init=[1e308, 1e308])
    assert torch.equal(module.active, torch.tensor([True, True]))
    assert torch.equal(module.q, torch.tensor([0.5, 0.5], dtype=torch.float64))
    module(losses, groups)
    assert torch.isfinite(module.q).all() and float(module.q[1]) > 0.5
    greedy = group_dro64(2, mode="greedy_cvar", alpha=0.5, group_counts=[1e308, 1e308])
    value = greedy(losses, groups)
    assert torch.equal(greedy.q, torch.tensor([0.0, 1.0], dtype=torch.float64)) and float(value) == 2.0
    with pytest.raises(ValueError, match=r"adjustment / sqrt\(group_counts\) must be finite"):
        dro_ext.GroupDROLoss(2, adjustment=1e300, group_counts=[1e-20, 1.0])


def test_adjustment_enters_the_update_not_the_value(backend):
    counts = torch.tensor([4.0, 100.0])
    losses, groups = torch.tensor([1.0, 1.0], dtype=torch.float64), torch.tensor([0, 1])
    module = group_dro64(2, 1.0, adjustment=2.0, group_counts=counts)
    value = module(losses, groups)
    assert math.isclose(float(value), 1.0, rel_tol=1e-15)  # sum_g q_g m_g with m = (1, 1): 1 whatever q
    # a = m + 2 / sqrt(N) = (2, 1.2): q_0 / q_1 = exp(0.8)
    assert math.isclose(float(module.q[0] / module.q[1]), math.exp(0.8), rel_tol=1e-14)
    assert torch.equal(losses, torch.tensor([1.0, 1.0], dtype=torch.float64))


def test_an_adjustment_of_any_real_type(backend):
    """A numpy scalar adjustment acts as the same Python number (np.float32 and np.int64 raised a TypeError that did
    not name the argument: they are numbers.Real, not float or int)."""
    import numpy as np

    losses, groups = torch.tensor([0.5, 1.5, 2.5, 0.25]), torch.tensor([0, 1, 2, 1])
    counts = [10.0, 20.0, 40.0]
    want = dro_ext.GroupDROLoss(3, 0.5, adjustment=2.0, group_counts=counts)
    want(losses, groups)
    for adjustment in (np.float32(2.0), np.int64(2), np.float64(2.0)):
        module = dro_ext.GroupDROLoss(3, 0.5, adjustment=adjustment, group_counts=counts)
        module(losses, groups)
        assert torch.equal(module.log_q, want.log_q), type(adjustment)


def test_log_space_update_does_not_overflow(backend):
    module = dro_ext.GroupDROLoss(3, 50.0)
    for _ in range(20):
        module(torch.tensor([100.0, 90.0, 1.0]), torch.tensor([0, 1, 2]))
    q = module.q
    assert torch.isfinite(q).all() and math.isclose(float(q.sum()), 1.0, rel_tol=1e-6)
    assert q[0] == 1.0 and q[2] == 0.0  # exp(-big) underflows to 0, not NaN


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("mode", ["eg", "greedy_cvar"])
def test_group_dro_dtypes(backend, dtype, mode):
    """Half, bfloat16, float32 and float64 losses with the default float32 state: the value in the losses' dtype,
    the state in float32, against the float64 reference on the rounded losses."""
    kwargs = dict(step_size=0.5) if mode == "eg" else dict(mode=mode, alpha=0.4)
    module = dro_ext.GroupDROLoss(4, **kwargs)
    reference = RefGroupDRO(4, **kwargs)
    for losses, groups in batches(5, 13, 4, dtype):
        losses.requires_grad_()
        value = module(losses, groups)
        assert value.dtype == dtype and module.log_q.dtype == torch.float32
        (grad,) = torch.autograd.grad(value, losses)
        assert grad.dtype == dtype
        l64 = losses.detach().double().requires_grad_()
        expected = reference(l64, groups)
        (exp_grad,) = torch.autograd.grad(expected, l64)
        tol = ref.tolerances(dtype) if dtype != torch.float64 else ref.tolerances(torch.float32)
        torch.testing.assert_close(value.double(), expected, **tol)
        torch.testing.assert_close(grad.double(), exp_grad, **tol)
        torch.testing.assert_close(module.q.double(), reference.q, **ref.tolerances(torch.float32))


def test_empty_batch_single_group_and_more_groups_than_samples(backend):
    module = group_dro64(3, 0.5)
    reference = RefGroupDRO(3, 0.5)
    empty = torch.zeros(0, dtype=torch.float64, requires_grad=True)
    value = module(empty, torch.zeros(0, dtype=torch.int64))
    assert value == 0 and value.dtype == torch.float64
    (grad,) = torch.autograd.grad(value, empty)
    assert grad.shape == (0,)
    reference(empty.detach(), torch.zeros(0, dtype=torch.int64))
    torch.testing.assert_close(module.q, reference.q, rtol=1e-15, atol=1e-15)

    single = group_dro64(1, 0.5)  # one group: q = 1, the loss is the batch mean
    losses = torch.rand(6, dtype=torch.float64)
    assert math.isclose(float(single(losses, torch.zeros(6, dtype=torch.int64))), float(losses.mean()),
                        rel_tol=1e-15)
    assert single.q.tolist() == [1.0]

    many = group_dro64(50, 0.5)  # G > N: most groups absent every step
    reference = RefGroupDRO(50, 0.5)
    for losses, groups in batches(3, 7, 50):
        torch.testing.assert_close(many(losses, groups), reference(losses, groups), rtol=1e-12, atol=1e-15)
        torch.testing.assert_close(many.q, reference.q, rtol=1e-12, atol=1e-15)

    greedy = group_dro64(3, mode="greedy_cvar", alpha=0.5)
    greedy(torch.tensor([1.0, 2.0], dtype=torch.float64), torch.tensor([0, 1]))
    before = greedy.q.clone()
    greedy(torch.zeros(0, dtype=torch.float64), torch.zeros(0, dtype=torch.int64))  # no batch shares: q kept
    assert torch.equal(greedy.q, before)


@pytest.mark.parametrize("config", ["stale", "greedy-population"])
def test_state_dict_resumes_bitwise(backend, config):
    kwargs = EG_CONFIGS[config]
    run = batches(6, 9, 5, torch.float32)
    unbroken = dro_ext.GroupDROLoss(5, **kwargs)
    values = [unbroken(l, g) for l, g in run]
    first = dro_ext.GroupDROLoss(5, **kwargs)
    for l, g in run[:3]:
        first(l, g)
    state = first.state_dict()
    assert sorted(state) == ["ema_loss", "last_loss", "log_q", "seen"]
    resumed = dro_ext.GroupDROLoss(5, **kwargs)
    resumed.load_state_dict(state)
    for (l, g), want in zip(run[3:], values[3:]):
        assert torch.equal(resumed(l, g), want)
    for name, buffer in unbroken.state_dict().items():
        assert torch.equal(resumed.state_dict()[name], buffer), name


@pytest.mark.parametrize("config", ["adjusted", "disabled", "greedy-population"])
def test_modules_built_on_the_meta_device_are_as_constructed_after_to_empty(backend, config):
    # The recipe for large models: build on the meta device, to_empty(), then reset_parameters() where a module has
    # it. The loss modules' state and configuration must come back as constructed, not as uninitialized memory.
    kwargs = EG_CONFIGS[config]

    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.online = dro_ext.GroupDROLoss(5, **kwargs)
            self.penalized = dro_ext.DROLoss("kl", lam=0.4, eta_init=0.25, num_groups=5, weighting="population",
                                             group_counts=[70000.0, 30000.0, 5.0, 1.0, 2.0])
            # (the cross-entropy modules had no reset_parameters: their eta stayed uninitialized memory)
            self.token_level = dro_ext.DROCrossEntropyLoss("chi2", lam=0.5, eta_init=0.75)
            self.head = dro_ext.DROLinearCrossEntropyLoss("kl", lam=0.5, eta_init=-1.5, num_groups=3)

    torch.manual_seed(0)
    junk = torch.full((1 << 16,), 3.0e27)  # freed memory that to_empty may hand back
    del junk
    with torch.device("meta"):
        lazy = Model()
    # Every tensor on the device the model is built on (the configuration buffers stayed on the CPU).
    assert {t.device.type for t in (*lazy.parameters(), *lazy.buffers())} == {"meta"}
    lazy.to_empty(device="cpu")
    for module in lazy.modules():
        if hasattr(module, "reset_parameters"):
            module.reset_parameters()
    built = Model()
    for (name, a), (_, b) in zip(lazy.named_buffers(), built.named_buffers()):
        assert a.dtype == b.dtype and torch.equal(a, b), name
    for name, value in (("penalized", 0.25), ("token_level", 0.75), ("head", -1.5)):
        assert getattr(lazy, name).eta.item() == getattr(built, name).eta.item() == value, name
    for losses, groups in batches(3, 9, 5, torch.float32):
        assert torch.equal(lazy.online(losses, groups), built.online(losses, groups))
        assert torch.equal(lazy.penalized(losses, groups), built.penalized(losses, groups))


@pytest.mark.parametrize("load", ["to_empty", "assign"])
@pytest.mark.parametrize("config", ["adjusted", "disabled", "greedy-population"])
def test_a_checkpoint_loaded_into_modules_built_on_the_meta_device_resumes_bitwise(backend, config, load):
    # A checkpoint restores the state; the configuration (which groups are enabled, adjustment terms, weights) is
    # the module's own. to_empty() left the enabled groups as uninitialized memory (groups turned off for good), and
    # load_state_dict(assign=True), torch's recipe for a model built on the meta device, left the configuration on
    # the meta device, where the native step returned uninitialized memory.
    kwargs = EG_CONFIGS[config]
    penalized_kwargs = dict(num_groups=5, weighting="population", group_counts=[70000.0, 30000.0, 5.0, 1.0, 2.0])
    run = batches(6, 9, 5, torch.float32)
    online, penalized = dro_ext.GroupDROLoss(5, **kwargs), dro_ext.DROLoss("kl", lam=0.4, **penalized_kwargs)
    for losses, groups in run[:3]:
        online(losses, groups)
    checkpoint = copy.deepcopy((online.state_dict(), penalized.state_dict()))
    junk = torch.full((1 << 16,), -1, dtype=torch.int64)  # freed memory that to_empty may hand back: bytes of 0xff
    del junk
    with torch.device("meta"):
        lazy_online, lazy_penalized = dro_ext.GroupDROLoss(5, **kwargs), dro_ext.DROLoss("kl", lam=0.4,
                                                                                         **penalized_kwargs)
    for module, state in zip((lazy_online, lazy_penalized), checkpoint):
        if load == "to_empty":
            module.to_empty(device="cpu")
            module.load_state_dict(state)
        else:
            module.load_state_dict(state, assign=True)
        assert {t.device.type for t in module.buffers()} | {p.device.type for p in module.parameters()} == {"cpu"}
    for losses, groups in run[3:]:
        assert torch.equal(lazy_penalized(losses, groups), penalized(losses, groups))
        assert torch.equal(lazy_online(losses, groups), online(losses, groups))
    for name, buffer in online.named_buffers():
        assert torch.equal(getattr(lazy_online, name), buffer), name


def test_a_step_with_its_state_on_the_meta_device_raises(backend):
    # The dispatcher runs an op's fake kernel where any operand is on the meta device: the native step returned
    # uninitialized memory (the fallback raised).
    with torch.device("meta"):
        online = dro_ext.GroupDROLoss(4)
    with pytest.raises((ValueError, RuntimeError), match="meta"):
        online(torch.rand(8), torch.randint(0, 4, (8,)))


@pytest.mark.parametrize("cast", ["half", "bfloat16", "double"])
def test_dtype_casts_keep_the_float64_configuration(backend, cast):
    # module.half() casts every floating buffer: population counts past 65504 became inf (a ValueError naming a
    # `weighting` the caller never passed) and every weight lost its digits. The configuration stays float64; eta
    # takes the cast, and q's state too, but not below float32.
    counts = [70000.0, 30000.0, 3.0]
    losses, groups = random_batch(11, 3)
    penalized = getattr(dro_ext.DROLoss("chi2", lam=0.5, num_groups=3, weighting="population",
                                        group_counts=counts), cast)()
    assert penalized.group_weights.dtype == torch.float64 and penalized.group_weights.tolist() == counts
    dtype = penalized.eta.dtype
    assert dtype == getattr(torch, {"half": "float16", "bfloat16": "bfloat16", "double": "float64"}[cast])
    want = dro_ext.group_dro_loss(losses, groups, 3, 0.0, 0.5, "chi2", weighting="population", group_counts=counts)
    got = penalized(losses.to(dtype), groups)
    torch.testing.assert_close(got.double(), want, rtol=2 * torch.finfo(dtype).eps * 8, atol=0)
    online = getattr(dro_ext.GroupDROLoss(3, step_size=0.5, group_counts=counts, adjustment=1.0), cast)()
    assert online.log_q.dtype == (torch.float64 if cast == "double" else torch.float32)  # (16-bit casts: float32)
    assert online.adjustment_term.dtype == online.population_shares.dtype == torch.float64
    reference = dro_ext.GroupDROLoss(3, step_size=0.5, group_counts=counts, adjustment=1.0).double()
    torch.testing.assert_close(online(losses.to(dtype), groups).double(), reference(losses, groups),
                               rtol=16 * torch.finfo(dtype).eps, atol=0)
    torch.testing.assert_close(online.q.double(), reference.q, rtol=16 * torch.finfo(dtype).eps, atol=0)


def test_eta_init_must_be_finite():
    for bad in (math.nan, math.inf, -math.inf):
        with pytest.raises(ValueError, match="eta_init must be finite"):
            dro_ext.DROLoss("chi2", eta_init=bad)


def test_group_dro_gradcheck(backend):
    losses, groups = random_batch(9, 4, absent=(2,))
    for kwargs in (dict(step_size=0.7, missing="stale"), dict(mode="greedy_cvar", alpha=0.3)):
        module = group_dro64(4, **kwargs)
        module(losses, groups)  # a q away from uniform

        def value(l):
            return module(l, groups, update=False)

        assert torch.autograd.gradcheck(value, (losses.clone().requires_grad_(),))


@pytest.mark.parametrize("kwargs", [dict(step_size=0.5, missing="stale"), dict(mode="greedy_cvar", alpha=0.4)],
                         ids=["eg", "greedy_cvar"])
def test_group_dro_compiles_fullgraph(backend, kwargs):
    """forward, update included (buffer mutation), compiled without graph breaks, follows eager step by step."""
    run = batches(4, 10, 4, torch.float32)
    eager = dro_ext.GroupDROLoss(4, **kwargs)
    compiled_module = dro_ext.GroupDROLoss(4, **kwargs)
    torch._dynamo.reset()
    compiled = torch.compile(compiled_module, fullgraph=True)
    for step, (losses, groups) in enumerate(run):
        update = step != 2
        l1, l2 = losses.clone().requires_grad_(), losses.clone().requires_grad_()
        want, got = eager(l1, groups, update=update), compiled(l2, groups, update=update)
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-7)
        torch.testing.assert_close(torch.autograd.grad(got, l2), torch.autograd.grad(want, l1), rtol=1e-6, atol=1e-7)
        torch.testing.assert_close(compiled_module.q, eager.q, rtol=1e-6, atol=1e-7)


MODES = [dict(step_size=0.7, missing="stale"), dict(mode="greedy_cvar", alpha=0.4)]


@pytest.mark.parametrize("use_reentrant", [False, True])
@pytest.mark.parametrize("kwargs", MODES, ids=["eg", "greedy_cvar"])
def test_group_dro_without_update_under_checkpoint_matches_the_plain_call(backend, kwargs, use_reentrant):
    # The native step's Node unpacked its saved tensors below autograd, where non-reentrant checkpointing recomputes
    # the region: the recomputation recorded nothing and checkpoint refused it.
    losses, groups = random_batch(12, 4, absent=(1,))
    module = group_dro64(4, **kwargs)
    module(losses, groups)  # a q away from uniform
    weight = torch.tensor(1.3, dtype=torch.float64, requires_grad=True)

    def region(w):
        return module(w * losses, groups, update=False)

    (want,) = torch.autograd.grad(region(weight), weight)
    # (.backward(): a reentrant checkpoint takes no torch.autograd.grad)
    torch.utils.checkpoint.checkpoint(region, weight, use_reentrant=use_reentrant).backward()
    assert torch.equal(weight.grad, want)


@pytest.mark.parametrize("use_reentrant", [False, True])
@pytest.mark.parametrize("kwargs", MODES, ids=["eg", "greedy_cvar"])
def test_an_updating_forward_that_a_checkpoint_recomputes_raises(backend, kwargs, use_reentrant):
    # Recomputed in backward, the update would run twice for one batch (two steps of q), and the gradient would be
    # that of the loss under the second q, not of the value returned.
    losses, groups = random_batch(12, 4, absent=(1,))
    module, once = group_dro64(4, **kwargs), group_dro64(4, **kwargs)
    weight = torch.tensor(1.3, dtype=torch.float64, requires_grad=True)

    def region(w):
        return module(w * losses, groups)

    value = torch.utils.checkpoint.checkpoint(region, weight, use_reentrant=use_reentrant)
    with pytest.raises(RuntimeError, match="updating forward ran inside a backward pass"):
        value.backward()
    once(losses * 1.3, groups)
    assert torch.equal(module.log_q, once.log_q) and torch.equal(module.ema_loss, once.ema_loss)
    # The pattern the message offers: the model checkpointed, the module called on its outputs.
    weight.grad = None
    outputs = torch.utils.checkpoint.checkpoint(lambda w: w * losses, weight, use_reentrant=use_reentrant)
    module(outputs, groups).backward()
    (want,) = torch.autograd.grad(once(weight * losses, groups), weight)
    assert torch.equal(weight.grad, want) and torch.equal(module.log_q, once.log_q)


@pytest.mark.parametrize("placement", ["checkpoint compiled", "compiled module in an eager checkpoint"])
@pytest.mark.parametrize("kwargs", MODES, ids=["eg", "greedy_cvar"])
def test_a_compiled_updating_forward_that_a_checkpoint_recomputes_raises(backend, kwargs, placement):
    # The Python check runs once, while the graph is traced. A checkpoint that torch.compile traces recomputed the
    # update in the backward pass from the state the forward had updated: the value and q were right, but the
    # gradient weighed the groups by q after a second step. Around a compiled module, an eager checkpoint ran its
    # graph again: q took two steps.
    losses, groups = random_batch(12, 4, absent=(1,))
    module, once = group_dro64(4, **kwargs), group_dro64(4, **kwargs)
    module(2 * losses.flip(0), groups)  # an EMA and a q away from their start, so that a second step moves them
    once(2 * losses.flip(0), groups)
    weight = torch.tensor(1.3, dtype=torch.float64, requires_grad=True)
    torch._dynamo.reset()
    if placement == "checkpoint compiled":
        region = torch.compile(lambda w: torch.utils.checkpoint.checkpoint(lambda v: module(v * losses, groups), w,
                                                                         use_reentrant=False),
                               backend="aot_eager", fullgraph=True)
    else:
        compiled = torch.compile(lambda w: module(w * losses, groups), backend="aot_eager", fullgraph=True)
        region = functools.partial(torch.utils.checkpoint.checkpoint, compiled, use_reentrant=False)
    value = region(weight)
    with pytest.raises(RuntimeError, match="updating forward ran inside a backward pass"):
        value.backward()
    torch.testing.assert_close(value, once(losses * 1.3, groups), rtol=1e-12, atol=0)
    torch.testing.assert_close(module.log_q, once.log_q, rtol=1e-12, atol=0)
    torch.testing.assert_close(module.ema_loss, once.ema_loss, rtol=1e-12, atol=0)


def test_group_dro_nan_is_not_dropped(backend):
    # The value carries the NaN; the state takes no step from it (tests/test_group_dro_step.py has the rule).
    module = dro_ext.GroupDROLoss(3, 0.5)
    losses = torch.tensor([1.0, math.nan, 2.0])
    before = module.log_q.clone()
    assert torch.isnan(module(losses, torch.tensor([0, 1, 2])))
    assert torch.equal(module.log_q, before)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_group_dro_step_has_no_host_sync_on_cuda():
    module = dro_ext.GroupDROLoss(6, 0.5, missing="stale").cuda()
    greedy = dro_ext.GroupDROLoss(6, mode="greedy_cvar", alpha=0.3, min_var_weight=0.1).cuda()
    losses = torch.rand(1000, device="cuda", requires_grad=True)
    groups = torch.randint(6, (1000,), device="cuda")
    eta = torch.zeros((), device="cuda", requires_grad=True)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        (module(losses, groups) + greedy(losses, groups)).backward()
        dro_ext.group_dro_loss(losses, groups, 6, eta, 0.5, "kl").backward()
        keep = groups != 2  # a mask (padding tokens, say): still no host read
        masked = dro_ext.group_dro_loss(losses, groups, 6, eta, 0.5, "kl", mask=keep)
        (module(losses, groups, mask=keep) + masked).backward()
    finally:
        torch.cuda.set_sync_debug_mode("default")


GROUP_DRO_BAD_INPUTS = [
    (dict(num_groups=0), ValueError, "num_groups must be >= 1"),
    (dict(num_groups=2.5), TypeError, "num_groups must be an int"),
    (dict(step_size=0.0), ValueError, "step_size must be a finite number > 0"),
    (dict(step_size=-1.0), ValueError, "step_size"),
    (dict(mode="cvar"), ValueError, "mode must be"),
    (dict(missing="drop"), ValueError, "missing must be"),
    (dict(mode="greedy_cvar"), ValueError, "needs alpha"),
    (dict(mode="greedy_cvar", alpha=0.0), ValueError, "alpha must be a finite number > 0"),
    (dict(mode="greedy_cvar", alpha=-0.5), ValueError, "alpha"),
    (dict(mode="greedy_cvar", alpha=math.inf), ValueError, "alpha"),
    (dict(alpha=0.5), ValueError, "alpha is used by mode='greedy_cvar' only"),
    (dict(min_var_weight=0.5), ValueError, "min_var_weight is used by mode='greedy_cvar' only"),
    (dict(mode="greedy_cvar", alpha=0.5, min_var_weight=1.5), ValueError, r"min_var_weight must be in \[0, 1\]"),
    (dict(mode="greedy_cvar", alpha=0.5, normalize_loss=True), ValueError, "normalize_loss applies to mode='eg'"),
    (dict(ema_gamma=0.0), ValueError, r"ema_gamma must be in \(0, 1\]"),
    (dict(normalize_loss=1), TypeError, "normalize_loss must be a bool"),
    (dict(adjustment=1.0), ValueError, "adjustment needs group_counts"),
    (dict(adjustment=torch.ones(2), group_counts=torch.ones(3)), ValueError, r"adjustment must be a number or have"),
    (dict(adjustment=math.nan, group_counts=torch.ones(3)), ValueError, "adjustment must be finite"),
    (dict(group_counts=torch.tensor([1.0, 0.0, 1.0])), ValueError, "group_counts must be > 0"),
    (dict(group_counts=torch.ones(4)), ValueError, r"group_counts must have shape \(3,\)"),
    (dict(q_init=torch.zeros(3)), ValueError, "q_init must be >= 0 with a positive sum"),
    (dict(q_init=torch.tensor([1.0, -1.0, 1.0])), ValueError, "q_init must be >= 0"),
    (dict(q_init=torch.tensor([1.0, math.inf, 1.0])), ValueError, "q_init must be finite"),
    (dict(group=object()), (RuntimeError, TypeError), "group"),
]


@pytest.mark.parametrize("override,exc,match", GROUP_DRO_BAD_INPUTS)
def test_group_dro_bad_construction_names_the_argument(override, exc, match):
    args = dict(num_groups=3)
    args.update(override)
    with pytest.raises(exc, match=match):
        dro_ext.GroupDROLoss(args.pop("num_groups"), **args)


# Settings set after construction, each with the error the constructor gives for it: set unchecked, a negative
# step_size turned the ascent into a descent, and missing="Stale" read as "zero" natively, as "stale" in the fallback.
GROUP_DRO_BAD_SETTINGS = [
    (dict(), "step_size", -0.5, ValueError, "step_size must be a finite number > 0"),
    (dict(), "step_size", math.nan, ValueError, "step_size must be a finite number > 0"),
    (dict(), "step_size", torch.tensor(0.5), TypeError, "step_size must be a Python number"),
    (dict(), "missing", "Stale", ValueError, "missing must be 'zero' or 'stale'"),
    (dict(), "mode", "cvar", ValueError, "mode is fixed at construction"),
    (dict(), "num_groups", 4, ValueError, "num_groups is fixed at construction"),
    (dict(), "group", object(), (RuntimeError, TypeError), "group"),
    (dict(), "ema_gamma", 5.0, ValueError, r"ema_gamma must be in \(0, 1\]"),
    (dict(), "normalize_loss", 1, TypeError, "normalize_loss must be a bool"),
    (dict(), "alpha", 0.5, ValueError, "alpha is used by mode='greedy_cvar' only"),
    (dict(), "min_var_weight", 0.5, ValueError, "min_var_weight is used by mode='greedy_cvar' only"),
    (dict(), "mode", "greedy_cvar", ValueError, "mode is fixed at construction"),
    (dict(mode="greedy_cvar", alpha=0.5), "mode", "eg", ValueError, "mode is fixed at construction"),
    (dict(mode="greedy_cvar", alpha=0.5), "alpha", None, ValueError, "needs alpha"),
    (dict(mode="greedy_cvar", alpha=0.5), "alpha", -1.0, ValueError, "alpha must be a finite number > 0"),
    (dict(mode="greedy_cvar", alpha=0.5), "normalize_loss", True, ValueError, "normalize_loss applies to mode='eg'"),
    (dict(mode="greedy_cvar", alpha=0.5), "min_var_weight", 1.5, ValueError, r"min_var_weight must be in \[0, 1\]"),
]


@pytest.mark.parametrize("settings,name,value,exc,match", GROUP_DRO_BAD_SETTINGS)
def test_group_dro_settings_set_later_are_checked_as_constructed(backend, settings, name, value, exc, match):
    module = dro_ext.GroupDROLoss(3, **settings)
    before = getattr(module, name)
    with pytest.raises(exc, match=match):
        setattr(module, name, value)
    assert getattr(module, name) is before  # left as it was: the next step runs the valid settings
    # A module unpickled from before these checks (its __dict__ restored as it was) is checked alike.
    restored = dro_ext.GroupDROLoss.__new__(dro_ext.GroupDROLoss)
    restored.__dict__.update(copy.deepcopy(module.__dict__))
    with pytest.raises(exc, match=match):
        setattr(restored, name, value)
    losses, groups = random_batch(12, 3)
    module(losses.float(), groups)
    assert not module.log_q.isnan().any() and abs(float(module.q.sum()) - 1.0) < 1e-6


def test_group_dro_settings_set_later_take_effect(backend):
    # A valid setting set later is taken as the constructor takes it (numbers of any real type, as floats) and runs
    # the next step as a module built with it.
    losses, groups = random_batch(20, 4)
    for name, value in (("step_size", np.float32(0.75)), ("step_size", 2), ("missing", "stale"),
                        ("normalize_loss", True), ("ema_gamma", 0.5)):
        changed, built = group_dro64(4), group_dro64(4, **{name: value})
        setattr(changed, name, value)
        assert type(getattr(changed, name)) is type(getattr(built, name))
        for _ in range(3):
            torch.testing.assert_close(changed(losses, groups), built(losses, groups), rtol=0, atol=0)
        torch.testing.assert_close(changed.log_q, built.log_q, rtol=0, atol=0)
    greedy, built = (group_dro64(4, mode="greedy_cvar", alpha=0.5),
                     group_dro64(4, mode="greedy_cvar", alpha=0.25, min_var_weight=0.5))
    greedy.alpha, greedy.min_var_weight = 0.25, 0.5
    for _ in range(3):
        torch.testing.assert_close(greedy(losses, groups), built(losses, groups), rtol=0, atol=0)


@pytest.mark.parametrize("cast", [torch.float16, torch.bfloat16])
def test_a_16_bit_cast_keeps_the_group_dro_state_in_float32(backend, cast):
    # model.to(torch.bfloat16) over a model holding the loss module cast q's state to 16 bits, where a step of the
    # usual step_size is below half the spacing of log q (bfloat16's 0.008 near log(1/4)): every update was rounded
    # away and q stayed uniform, Group DRO running as ERM. The state stays float32, so the cast module follows a
    # float32 module fed the same (16-bit) losses bit for bit.
    generator = torch.Generator().manual_seed(5)
    cast_module = torch.nn.Sequential(torch.nn.Linear(2, 2), dro_ext.GroupDROLoss(4, step_size=0.01)).to(cast)[1]
    float32_module = dro_ext.GroupDROLoss(4, step_size=0.01)
    assert cast_module.log_q.dtype == cast_module.ema_loss.dtype == cast_module.last_loss.dtype == torch.float32
    for _ in range(300):
        groups = torch.randint(4, (32,), generator=generator)
        losses = (groups.double() + torch.rand(32, generator=generator, dtype=torch.float64)).to(cast)
        got, want = cast_module(losses, groups), float32_module(losses, groups)
        assert got.dtype == cast
        torch.testing.assert_close(got, want.to(cast), rtol=0, atol=0)
    torch.testing.assert_close(cast_module.log_q, float32_module.log_q, rtol=0, atol=0)
    assert cast_module.q[3] > 0.9  # the worst group's weight grew, as it does in float32


def test_a_16_bit_cast_of_a_float64_state_rounds_it_once_to_float32(backend):
    module = group_dro64(3, step_size=0.3)
    losses, groups = random_batch(15, 3)
    module(losses, groups)
    log_q = module.log_q.clone()
    module.half()
    assert module.log_q.dtype == torch.float32
    torch.testing.assert_close(module.log_q, log_q.float(), rtol=0, atol=0)  # not rounded through float16
    module.double()
    assert module.log_q.dtype == torch.float64
    with torch.device("meta"):
        on_meta = dro_ext.GroupDROLoss(3)
    assert on_meta.to(torch.bfloat16).log_q.dtype == torch.float32
    assert on_meta.to_empty(device="cpu").log_q.device.type == "cpu"


_OUT_OF_RANGE_3 = r"groups holds an id outside \[0, num_groups\) with num_groups=3$"


@pytest.mark.parametrize("losses,groups,exc,match", [
    (torch.ones(3), torch.tensor([0.0, 1.0, 2.0]), TypeError, "groups must be an int32 or int64"),
    (torch.ones(3), torch.tensor([0, 1]), ValueError, "groups must have the shape"),
    # (without group_sums' hint of validate=False, which the module does not take: the native step gave it)
    (torch.ones(3), torch.tensor([0, 1, 3]), IndexError, _OUT_OF_RANGE_3),
    (torch.ones(3), torch.tensor([0, -1, 2]), IndexError, _OUT_OF_RANGE_3),
    (torch.ones(3, 1), torch.tensor([0, 1, 2]), ValueError, "losses must be a 1-D"),
    (torch.ones(3, dtype=torch.int64), torch.tensor([0, 1, 2]), TypeError, "floating"),
    (torch.ones(0, dtype=torch.int64), torch.ones(0, dtype=torch.int64), TypeError, "floating"),
])
def test_group_dro_bad_batch_names_the_argument(backend, losses, groups, exc, match):
    module = dro_ext.GroupDROLoss(3)
    before = module.state_dict()
    with pytest.raises(exc, match=match):
        module(losses, groups)
    for name, buffer in module.state_dict().items():
        assert torch.equal(buffer, before[name]), name


# ---------------------------------------------------------------------------------------------------
# DROLoss(num_groups=...)
# ---------------------------------------------------------------------------------------------------


def test_droloss_without_groups_is_unchanged(backend):
    module = dro_ext.DROLoss("kl", lam=0.5, eta_init=0.2)
    assert list(module.state_dict()) == ["eta"] and [n for n, _ in module.named_buffers()] == []
    losses = torch.rand(9)
    assert torch.equal(module(losses), dro_ext.dro_loss(losses, module.eta, 0.5, "kl"))
    with pytest.raises(ValueError, match="built without num_groups"):
        module(losses, torch.zeros(9, dtype=torch.int64))


def test_reprs_tell_configurations_apart():
    # Every setting that changes the objective or the update shows: two modules that print alike computed different
    # losses (the group weights, the adjustment, the population shares, q_init and min_var_weight were left out).
    droloss = [dro_ext.DROLoss("chi2", 0.5, num_groups=3), dro_ext.DROLoss("chi2", 0.5, num_groups=3, eta_init=0.2),
               dro_ext.DROLoss("chi2", 0.5, num_groups=3, weighting=[1.0, 0.0, 5.0])]
    greedy = dict(mode="greedy_cvar", alpha=0.3)
    group_dro = [dro_ext.GroupDROLoss(3, 0.1, **greedy), dro_ext.GroupDROLoss(3, 0.1, **greedy, min_var_weight=0.5),
                 dro_ext.GroupDROLoss(3, 0.1, **greedy, q_init=[1, 0, 1]),
                 dro_ext.GroupDROLoss(3, 0.1, **greedy, group_counts=[1, 2, 3]),
                 dro_ext.GroupDROLoss(3, 0.1, **greedy, group_counts=[1, 2, 3], adjustment=3.0)]
    for modules in (droloss, group_dro):
        reprs = [repr(m) for m in modules]
        assert len(set(reprs)) == len(reprs), reprs
    assert "group_weights=[1, 0, 5]" in repr(droloss[2]) and "q_init=[0.5, 0, 0.5]" in repr(group_dro[2])
    # ... and only those: greedy_cvar reads no step size, missing or normalize_loss, eg no alpha or min_var_weight.
    eg = repr(dro_ext.GroupDROLoss(3, 0.1, missing="stale", normalize_loss=True))
    assert all(s in eg for s in ("step_size=0.1", "missing='stale'", "normalize_loss=True")), eg
    assert not any(s in repr(group_dro[0]) for s in ("step_size", "missing", "normalize_loss")), repr(group_dro[0])
    assert not any(s in eg for s in ("alpha", "min_var_weight")), eg
    many = dro_ext.GroupDROLoss(20, 0.1, group_counts=list(range(1, 21)))
    assert repr(many).count(",") < 30 and "..." in repr(many)  # a long vector is elided


@pytest.mark.parametrize("weighting", WEIGHTINGS)
@pytest.mark.parametrize("name,params", [("chi2", {}), ("cvar", {"alpha": 0.3}), ("cressie_read", {"k": 1.5})],
                         ids=["chi2", "cvar", "cressie_read"])
def test_droloss_over_groups_is_group_dro_loss(backend, name, params, weighting):
    kwargs, _ = weighting_args(weighting, 4)
    module = dro_ext.DROLoss(name, lam=0.6, scale=1.2, eta_init=0.4, num_groups=4, **kwargs, **params)
    assert list(module.state_dict()) == ["eta"]
    assert "num_groups=4" in repr(module)
    losses, groups = random_batch(15, 4, torch.float32, absent=(0,))
    losses.requires_grad_()
    value = module(losses, groups)
    eta = module.eta.detach().clone().requires_grad_()
    want = dro_ext.group_dro_loss(losses, groups, 4, eta, 0.6, name, scale=1.2, **kwargs, **params)
    assert torch.equal(value, want)
    got_grads = torch.autograd.grad(value, (losses, module.eta))
    want_grads = torch.autograd.grad(want, (losses, eta))
    assert all(torch.equal(a, b) for a, b in zip(got_grads, want_grads))
    with pytest.raises(ValueError, match="groups is required"):
        module(losses)


@pytest.mark.parametrize("kwargs,exc,match", [
    (dict(weighting="population", group_counts=torch.ones(3)), ValueError, "pass num_groups as well"),
    (dict(group_counts=torch.ones(3)), ValueError, "pass num_groups as well"),
    (dict(weighting=torch.ones(3)), ValueError, "pass num_groups as well"),
    (dict(num_groups=0), ValueError, "num_groups must be >= 1"),
    (dict(num_groups=3, weighting="population"), ValueError, "needs group_counts"),
    (dict(num_groups=3, weighting="population", group_counts=torch.ones(2)), ValueError, "group_counts must have"),
])
def test_droloss_group_arguments_are_checked(kwargs, exc, match):
    with pytest.raises(exc, match=match):
        dro_ext.DROLoss("chi2", lam=0.5, **kwargs)


@pytest.mark.parametrize("weighting", ["batch", "population", "tensor"])
def test_droloss_over_groups_compiles_fullgraph(backend, weighting):
    """Every weighting: the weights checked at construction are not read again while tracing (a data-dependent
    guard that broke the graph)."""
    options = {"batch": {}, "population": dict(weighting="population", group_counts=[3, 1, 2, 5, 4, 1]),
               "tensor": dict(weighting=torch.tensor([0.5, 1.0, 0.0, 2.0, 1.0, 1.0]))}[weighting]
    module = dro_ext.DROLoss("kl", lam=0.5, num_groups=6, **options)
    losses, groups = random_batch(20, 6, torch.float32, absent=(5,))
    losses.requires_grad_()
    torch._dynamo.reset()
    compiled = torch.compile(module, fullgraph=True)
    got, want = compiled(losses, groups), module(losses, groups)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(torch.autograd.grad(got, (losses, module.eta)),
                               torch.autograd.grad(want, (losses, module.eta)), rtol=1e-6, atol=1e-7)


# ---------------------------------------------------------------------------------------------------
# Over the ranks of a process group (2 gloo CPU processes, spawned by the test with a wall-clock bound)
# ---------------------------------------------------------------------------------------------------

WORLD = 2
DIST_TIMEOUT = 150.0  # wall-clock seconds for both ranks, start-up included: the machine may be heavily shared


def _distributed_ranks(rank, world, store_path):
    """Run in every rank: GroupDROLoss, group_dro_loss and DROLoss(num_groups) with group=WORLD against the
    single process on the concatenated batch; unequal local batches, a group only one rank holds, and a step
    where rank 0 holds nothing; batch, population and given weightings, population shares for greedy CVaR."""
    import datetime

    import torch.distributed as dist

    dist.init_process_group("gloo", store=dist.FileStore(store_path, world), rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=60))
    world_group = dist.group.WORLD
    torch.manual_seed(1234)  # the same data on every rank
    split = [(5, 9), (8, 4), (0, 10), (6, 6)]
    run = []
    for step, sizes in enumerate(split):
        losses, groups = random_batch(sum(sizes), 5, absent=(step % 5,))
        groups[:sizes[0]] = groups[:sizes[0]] % 3  # groups 3 and 4 only on rank 1
        run.append((losses, groups, sizes))

    def local(full, sizes):
        begin = sum(sizes[:rank])
        return full[begin:begin + sizes[rank]]

    population = dict(group_counts=[50.0, 20.0, 5.0, 3.0, 1.0])
    for kwargs in (dict(step_size=0.5, missing="stale"), dict(mode="greedy_cvar", alpha=0.4),
                   dict(mode="greedy_cvar", alpha=0.4, min_var_weight=0.2, **population),
                   dict(step_size=0.5, adjustment=1.0, **population)):
        spread, single = group_dro64(5, group=world_group, **kwargs), group_dro64(5, **kwargs)
        for losses, groups, sizes in run:
            mine = local(losses, sizes).clone().requires_grad_()
            value = spread(mine, local(groups, sizes))
            (grad,) = torch.autograd.grad(value, mine)
            whole = losses.clone().requires_grad_()
            want = single(whole, groups)
            (want_grad,) = torch.autograd.grad(want, whole)
            torch.testing.assert_close(value, want, rtol=1e-13, atol=1e-15)
            torch.testing.assert_close(spread.q, single.q, rtol=1e-13, atol=1e-15)
            torch.testing.assert_close(grad / world, local(want_grad, sizes), rtol=1e-13, atol=1e-15)

    weightings = [dict(), dict(weighting="population", **population), dict(weighting=[1.0, 0.0, 2.0, 3.0, 0.5])]
    for (losses, groups, sizes), weighting in zip(run, weightings * len(run)):
        # The mask (padding tokens, say) keeps about two thirds of the samples; where it is False the ids are junk.
        keep = torch.rand(len(losses)) < 0.67  # the same draw on every rank (seeded above)
        for module_or_fn, masked in (("function", False), ("module", False), ("function", True), ("module", True)):
            mine = local(losses, sizes).clone().requires_grad_()
            mine_groups = local(torch.where(keep, groups, -7) if masked else groups, sizes)
            mask = local(keep, sizes) if masked else None
            eta = torch.tensor(0.3, dtype=torch.float64, requires_grad=True)
            if module_or_fn == "function":
                value = dro_ext.group_dro_loss(mine, mine_groups, 5, eta, 0.5, "kl", group=world_group, mask=mask,
                                               **weighting)
            else:
                module = dro_ext.DROLoss("kl", lam=0.5, eta_init=0.3, num_groups=5, group=world_group,
                                         **weighting).double()
                eta = module.eta
                value = module(mine, mine_groups, mask=mask)
            grad, grad_eta = torch.autograd.grad(value, (mine, eta))
            whole = losses.clone().requires_grad_()
            e64 = eta.detach().clone().requires_grad_()  # the module's eta is 0.3 rounded to float32
            if masked:  # the single process on the kept samples of the concatenated batch
                kept = whole[keep]
                want = dro_ext.group_dro_loss(kept, groups[keep], 5, e64, 0.5, "kl", **weighting)
            else:
                want = dro_ext.group_dro_loss(whole, groups, 5, e64, 0.5, "kl", **weighting)
            want_grad, want_eta = torch.autograd.grad(want, (whole, e64))
            torch.testing.assert_close(value, want, rtol=1e-13, atol=1e-15)
            torch.testing.assert_close(grad / world, local(want_grad, sizes), rtol=1e-13, atol=1e-15)
            torch.testing.assert_close(grad_eta, want_eta, rtol=1e-13, atol=1e-15)  # the same on every rank
    dist.destroy_process_group()


@pytest.mark.skipif(not (torch.distributed.is_available() and torch.distributed.is_gloo_available()),
                    reason="torch.distributed with the gloo backend is not available in this torch build")
def test_group_objectives_over_ranks_equal_single_process(tmp_path):
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(root) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    procs = []
    try:
        for rank in range(WORLD):
            log = open(tmp_path / f"rank{rank}.log", "w")
            procs.append((subprocess.Popen([sys.executable, __file__, str(rank), str(WORLD), str(tmp_path / "store")],
                                           cwd=root, env=env, stdout=log, stderr=subprocess.STDOUT,
                                           start_new_session=True), log))
        for proc, _ in procs:
            try:
                proc.wait(timeout=DIST_TIMEOUT)
            except subprocess.TimeoutExpired:
                pytest.fail(f"the spawned ranks did not finish within {DIST_TIMEOUT:.0f} s (killed)")
    finally:
        for proc, log in procs:
            if proc.poll() is None:
                os.killpg(proc.pid, 9)  # the rank's own session, started above
                proc.wait()
            log.close()
    for rank, (proc, _) in enumerate(procs):
        assert proc.returncode == 0, (tmp_path / f"rank{rank}.log").read_text()[-4000:]


if __name__ == "__main__":
    import sys

    _distributed_ranks(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3])


def test_a_refused_call_frees_its_inputs_without_the_garbage_collector(backend):
    # The refusal re-raised a local reference to the error: the traceback held the frame that held the error, a
    # cycle that kept the caller's losses and their whole graph alive until the garbage collector ran (2 GiB after 30
    # caught refusals of 64 MiB activations in one report).
    calls = [
        lambda losses, groups: dro_ext.group_dro_loss(losses, groups, 3, 0.0, -1.0),
        lambda losses, groups: dro_ext.DROLoss(num_groups=3)(losses[None], groups),
        lambda losses, groups: dro_ext.GroupDROLoss(3)(losses, groups, mask=torch.ones(2, dtype=torch.bool)),
    ]
    enabled = gc.isenabled()
    gc.disable()
    try:
        for call in calls:
            losses = torch.rand(8, requires_grad=True) * 2.0
            freed = weakref.ref(losses)
            with pytest.raises((ValueError, TypeError)):
                call(losses, torch.randint(0, 3, (8,)))
            del losses
            assert freed() is None, call
    finally:
        if enabled:
            gc.enable()


@pytest.mark.parametrize("mode", ["eg", "greedy_cvar"])
def test_group_dro_state_on_another_device_is_named(backend, mode):
    """greedy_cvar (and eg on the fallback) raised torch's "Tensor on device cpu is not on the expected device meta!"
    from inside the composition; every path now says what the native eg step says."""
    module = dro_ext.GroupDROLoss(3, mode=mode, **({"alpha": 0.5} if mode == "greedy_cvar" else {})).to("meta")
    with pytest.raises(ValueError, match="GroupDROLoss's state is on meta but the losses are on cpu; move the module"):
        module(torch.rand(4), torch.tensor([0, 1, 2, 1]))
