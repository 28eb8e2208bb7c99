"""DRO over groups: group_dro_loss (the penalized objective over group means), GroupDROLoss (online Group DRO) and
DROLoss(num_groups=...), against float64 references written from the formulas of docs/design.md section 1.9."""
import math

import pytest
import torch

import dro_ext
import reference as ref
from dro_ext import _backend
from dro_ext.groups import _group_sums

DTYPES = [torch.float16, torch.bfloat16, torch.float32, torch.float64]


def case_kwargs(params):
    return dict(alpha=params.get("alpha"), k=params.get("k"))


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


def test_group_dro_loss_compiles_fullgraph(backend):
    losses, groups = random_batch(17, 5, torch.float32, absent=(1,))
    losses.requires_grad_()
    eta = torch.tensor(0.3, requires_grad=True)

    def fn(l, g, e):
        return dro_ext.group_dro_loss(l, g, 5, e, 0.5, "smoothed_cvar", alpha=0.2)

    torch._dynamo.reset()
    compiled = torch.compile(fn, fullgraph=True)
    got = compiled(losses, groups, eta)
    want = fn(losses, groups, eta)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(torch.autograd.grad(got, (losses, eta)), torch.autograd.grad(want, (losses, eta)),
                               rtol=1e-6, atol=1e-7)


GROUP_LOSS_BAD_INPUTS = [
    (dict(groups=torch.tensor([0.0, 1.0, 0.0, 1.0])), TypeError, "groups must be an int64 or int32"),
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
