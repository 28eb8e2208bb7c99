"""dro_ext.group_sums on the CPU, native op and fallback, against float64 references written from the definition
(sums[g] = sum of l_i over g_i = g, counts[g] = n_g): every float dtype, int32/int64 ids, odd sizes, G from 1 to
more than N, strided inputs, the empty batch, NaN, gradients (gradcheck, the group-means composition), bitwise
independence of the thread count, opcheck, torch.compile, out-of-range ids and every bad input; and the same for
the float64 sums of any dtype (dtype=torch.float64, the op's wide=True).

tests/test_cuda_group_sums.py runs the CUDA kernel (and, under tools/cuda_emulation, its C++ emulation).
"""
import math

import numpy as np
import pytest
import torch

import dro_ext
from dro_ext import _backend
from dro_ext.group_reduction import gather_by_group, wide_group_sums

DTYPES = [torch.float16, torch.bfloat16, torch.float32, torch.float64]
SIZES = [1, 7, 1000, 2**16 + 3]
ID_DTYPES = [torch.int64, torch.int32]
# G from 1 to more than N: num_groups as a function of N.
GROUP_COUNTS = {"G1": lambda n: 1, "G5": lambda n: 5, "G300": lambda n: 300, "G_above_N": lambda n: n + 7}


def sum_dtype(dtype):
    return torch.float64 if dtype == torch.float64 else torch.float32


def reference(losses, groups, num_groups):
    """(sums, counts, sums of |l|) in float64, from the values the op saw: a one-hot matmul where the G x N
    matrix is small, numpy's weighted bincount otherwise (two constructions independent of index_add_)."""
    x = losses.detach().cpu().double()
    ids = groups.cpu().long()
    if ids.numel() * num_groups <= 2**22:
        one_hot = (ids[None, :] == torch.arange(num_groups)[:, None]).double()
        return one_hot @ x, one_hot.sum(1), one_hot @ x.abs()
    ids_np, x_np = ids.numpy(), x.numpy()

    def bincount(weights):
        return torch.from_numpy(np.bincount(ids_np, weights=weights, minlength=num_groups).astype(np.float64))
    return bincount(x_np), bincount(None), bincount(np.abs(x_np))


def assert_sums_close(sums, counts, losses, groups, num_groups, dtype=None):
    """The sums and counts within a rounding of the reference, in ``dtype`` (by default the accumulation dtype)."""
    want, want_counts, abs_sums = reference(losses, groups, num_groups)
    assert sums.dtype == (dtype or sum_dtype(losses.dtype)) and counts.dtype == sums.dtype
    assert sums.shape == counts.shape == (num_groups,)
    assert sums.device == losses.device and counts.device == losses.device
    assert torch.equal(counts.cpu().double(), want_counts)
    # Rounding of the sum in its accumulation dtype: a random walk of n_g roundings of partial sums at most sum |l|.
    eps = torch.finfo(sums.dtype).eps
    allowed = 4 * eps * torch.sqrt(want_counts + 1) * abs_sums + 1e-300
    err = (sums.cpu().double() - want).abs()
    worst = int(torch.argmax(err - allowed))
    assert bool((err <= allowed).all()), (f"group {worst}: got {sums[worst].item()!r}, want {want[worst].item()!r} "
                                          f"(n_g = {int(want_counts[worst])}, allowed {allowed[worst].item():.3g})")


def make(n, dtype, num_groups, id_dtype=torch.int64, layout="contiguous"):
    losses = (1.0 + torch.randn(n, dtype=torch.float64)).to(dtype)
    groups = torch.randint(0, num_groups, (n,), dtype=id_dtype)
    if layout == "strided":
        lbuf = torch.zeros(2 * n, dtype=dtype)
        lbuf[::2] = losses
        gbuf = torch.full((3 * n,), -5, dtype=id_dtype)  # the gaps hold bad ids: a read of them would show
        gbuf[::3] = groups
        losses, groups = lbuf[::2], gbuf[::3]
        assert n == 1 or not (losses.is_contiguous() or groups.is_contiguous())
    return losses, groups


# ------------------------------------------------------------------------------------------------- values


@pytest.mark.parametrize("groups_of", GROUP_COUNTS.values(), ids=list(GROUP_COUNTS))
@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("id_dtype", ID_DTYPES, ids=str)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_matches_float64_reference(backend, dtype, id_dtype, n, groups_of):
    num_groups = groups_of(n)
    losses, groups = make(n, dtype, num_groups, id_dtype)
    sums, counts = dro_ext.group_sums(losses, groups, num_groups)
    assert_sums_close(sums, counts, losses, groups, num_groups)


@pytest.mark.parametrize("n", [1, 7, 1000, 2**16 + 3])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_strided_inputs_match_their_contiguous_copies(backend, dtype, n):
    losses, groups = make(n, dtype, 11, layout="strided")
    sums, counts = dro_ext.group_sums(losses, groups, 11)
    assert_sums_close(sums, counts, losses, groups, 11)
    # The same bits as the contiguous copies: the summation order follows the sample index, not the layout.
    sums_c, counts_c = dro_ext.group_sums(losses.contiguous(), groups.contiguous(), 11)
    assert torch.equal(sums, sums_c) and torch.equal(counts, counts_c)


def test_int32_and_int64_ids_give_the_same_bits(backend):
    losses, groups = make(50_001, torch.float32, 9)
    a = dro_ext.group_sums(losses, groups, 9)
    b = dro_ext.group_sums(losses, groups.int(), 9)
    assert all(torch.equal(x, y) for x, y in zip(a, b))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_empty_batch_gives_zero_sums_and_counts(backend, dtype):
    losses = torch.empty(0, dtype=dtype, requires_grad=True)
    sums, counts = dro_ext.group_sums(losses, torch.empty(0, dtype=torch.long), 4)
    assert sums.dtype == sum_dtype(dtype) and torch.equal(sums, torch.zeros(4, dtype=sum_dtype(dtype)))
    assert torch.equal(counts, torch.zeros(4, dtype=sum_dtype(dtype)))
    (grad,) = torch.autograd.grad(sums.sum(), losses)
    assert grad.shape == (0,) and grad.dtype == dtype


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32], ids=str)
def test_the_gathers_adjoint_sums_alike_terms_within_a_rounding(backend, dtype):
    check_gather_adjoint_sums_alike_terms(dtype, "cpu")


def check_gather_adjoint_sums_alike_terms(dtype, device):
    # The gather (group_sums' backward) has the group sums of its incoming gradient as its own backward, and a
    # gradient that reaches a gather is often alike within each group (every sample's equal share of its group's
    # weight). Added one after another in float32 each add rounds the same way (a group's sum of 2^18 drifted by
    # 1e-5); summed in float64 and rounded once, each sum is within one float32 rounding of the exact one.
    n, num_groups = 2**20 + 5, 4
    groups = torch.randint(0, num_groups, (n,), device=device)
    share = torch.tensor([1 / 3, 2 / 7, 1e-6 / 3, 5.0], dtype=torch.float64, device=device)
    alike = share[groups].to(dtype)
    losses = torch.randn(n, dtype=dtype, device=device, requires_grad=True)
    grad_sums = torch.randn(num_groups, dtype=sum_dtype(dtype), device=device, requires_grad=True)
    sums, _ = dro_ext.group_sums(losses, groups, num_groups)
    (gathered,) = torch.autograd.grad(sums, losses, grad_outputs=grad_sums, create_graph=True)
    (got,) = torch.autograd.grad(gathered, grad_sums, grad_outputs=alike)
    want, _, _ = reference(alike, groups, num_groups)
    err = (got.cpu().double() - want).abs()
    assert got.dtype == sum_dtype(dtype) and bool((err <= torch.finfo(torch.float32).eps * want.abs()).all()), (
        (err / want.abs()).tolist())


def check_a_large_group_of_alike_float32_losses(num_groups, device, n=2**22):
    """group_sums of n float32 losses of 0.1, 6 in 7 of them in group 0: each sum within a rounding. The CPU op's parts
    run up to a third of the samples, and its float32 accumulators drifted by about a rounding a sample where a
    group's terms are alike (6e-4 relative at 2^16 groups; 4% at 2^24 samples); on CUDA, from num_groups = 1024 on,
    each thread of the one block of a group adds 1/256 of it one value after another."""
    losses = torch.full((n,), 0.1, device=device)
    groups = torch.zeros(n, dtype=torch.int64)
    groups[::7] = torch.arange(1, len(groups[::7]) + 1) % num_groups
    sums, _ = dro_ext.group_sums(losses, groups.to(device), num_groups)
    want, _, _ = reference(losses, groups, num_groups)
    relative = (sums.cpu().double() - want).abs() / want.abs()
    assert bool((relative <= 2.0**-24).all()), relative.max().item()


@pytest.mark.parametrize("num_groups", [4, 2**16])
def test_a_large_group_of_alike_float32_losses_sums_within_a_rounding(backend, num_groups):
    check_a_large_group_of_alike_float32_losses(num_groups, "cpu")


def test_the_fallbacks_float32_sums_are_formed_in_float64():
    # The fallback's index_add_ adds a group's samples one after another: in float32 a group's sum of 2^18 alike terms
    # drifted by 1e-5 (and 50x the native op's error on random ones); it adds in float64 and rounds once.
    from dro_ext.group_reduction import _fallback_group_sums
    n, num_groups = 2**20 + 5, 4
    groups = torch.randint(0, num_groups, (n,))
    alike = torch.tensor([1 / 3, 2 / 7, 1e-6 / 3, 5.0])[groups]
    for validate in (True, False):
        sums, counts = _fallback_group_sums(alike, groups, num_groups, validate)
        want, want_counts, _ = reference(alike, groups, num_groups)
        assert sums.dtype == torch.float32 and torch.equal(counts.double(), want_counts)
        assert bool(((sums.double() - want).abs() <= torch.finfo(torch.float32).eps * want.abs()).all())


def test_absent_groups_have_zero_sum_and_count(backend):
    losses = torch.tensor([1.5, -2.0, 4.0, 0.25])
    sums, counts = dro_ext.group_sums(losses, torch.tensor([3, 0, 3, 0]), 6)
    assert sums.tolist() == [-1.75, 0.0, 0.0, 5.5, 0.0, 0.0]
    assert counts.tolist() == [2.0, 0.0, 0.0, 2.0, 0.0, 0.0]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_nan_and_inf_reach_their_group_only(backend, dtype):
    losses, groups = make(40_000, dtype, 4)
    groups[:] = torch.arange(40_000) % 4
    losses[17] = float("nan")  # group 1
    losses[2] = float("inf")  # group 2
    losses[30_003] = float("-inf")  # group 3 (in another CPU chunk than the others)
    losses[30_007] = float("-inf")
    sums, counts = dro_ext.group_sums(losses, groups, 4)
    assert torch.isfinite(sums[0]) and torch.isnan(sums[1])
    assert sums[2].item() == math.inf and sums[3].item() == -math.inf
    assert counts.tolist() == [10_000.0] * 4


def test_float16_sums_past_float16_range_are_exact_in_float32(backend):
    # 70000 losses of 1.0 in one group: 70000 is past float16's largest value (65504); its float32 sum is exact.
    losses = torch.ones(70_000, dtype=torch.float16)
    sums, counts = dro_ext.group_sums(losses, torch.zeros(70_000, dtype=torch.long), 2)
    assert sums.dtype == torch.float32 and sums.tolist() == [70_000.0, 0.0] and counts.tolist() == [70_000.0, 0.0]


# ------------------------------------------------------------------------------------------------- gradients


def test_gradcheck_and_gradgradcheck_float64(backend):
    losses = torch.randn(37, dtype=torch.float64, requires_grad=True)
    groups = torch.randint(0, 5, (37,))

    def fn(x):
        return dro_ext.group_sums(x, groups, 5)[0]

    assert torch.autograd.gradcheck(fn, (losses,))
    assert torch.autograd.gradgradcheck(fn, (losses,))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_gradient_is_grad_sums_gathered_by_group(backend, dtype):
    losses, groups = make(1000, dtype, 13, torch.int32)
    losses.requires_grad_()
    sums, counts = dro_ext.group_sums(losses, groups, 13)
    assert not counts.requires_grad
    grad_sums = torch.randn(13, dtype=sums.dtype)
    (grad,) = torch.autograd.grad(sums, losses, grad_sums)
    assert grad.dtype == dtype
    torch.testing.assert_close(grad, grad_sums[groups.long()].to(dtype), rtol=0, atol=0)


def test_group_means_gradient_is_grad_mean_over_group_size(backend):
    # Group DRO's use: means = sums / counts.clamp_min(1), then a weighted sum of the means.
    n, num_groups = 2000, 7
    losses = torch.randn(n, dtype=torch.float64, requires_grad=True)
    groups = torch.randint(0, num_groups - 1, (n,))  # the last group is absent
    q = torch.rand(num_groups, dtype=torch.float64)
    sums, counts = dro_ext.group_sums(losses, groups, num_groups)
    means = sums / counts.clamp_min(1)
    (grad,) = torch.autograd.grad((q * means).sum(), losses)
    n_g = torch.bincount(groups, minlength=num_groups).double()
    torch.testing.assert_close(grad, q[groups] / n_g[groups], rtol=1e-15, atol=0)
    ref_sums, ref_counts, _ = reference(losses, groups, num_groups)
    torch.testing.assert_close(means.detach(), ref_sums / ref_counts.clamp_min(1), rtol=1e-13, atol=1e-13)


@pytest.mark.parametrize("use_reentrant", [False, True])
@pytest.mark.parametrize("op", ["group_sums", "gather_by_group"])
def test_checkpointed_sums_and_gathers_match_the_plain_ones(backend, op, use_reentrant):
    # torch.utils.checkpoint recomputes the region's forward where backward first unpacks a saved tensor (non-reentrant:
    # in the Node's own unpack). The native Nodes unpacked below autograd at first, so the recomputation recorded
    # nothing and checkpoint refused it.
    values = torch.randn(200 if op == "group_sums" else 6, dtype=torch.float64)
    groups = torch.randint(0, 6, (200,))
    weight = torch.randn((), dtype=torch.float64, requires_grad=True)
    grad_out = torch.randn(6 if op == "group_sums" else 200, dtype=torch.float64)

    def region(w):
        if op == "group_sums":
            return dro_ext.group_sums(w * values, groups, 6)[0]
        return gather_by_group(w * values, groups)

    (want,) = torch.autograd.grad(region(weight), weight, grad_out)
    # (.backward(): a reentrant checkpoint takes no torch.autograd.grad)
    torch.utils.checkpoint.checkpoint(region, weight, use_reentrant=use_reentrant).backward(grad_out)
    assert torch.equal(weight.grad, want)


# ------------------------------------------------------------------------------------------------- determinism


@pytest.mark.parametrize("num_groups", [3, 5000])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_bitwise_independent_of_the_thread_count(backend, dtype, num_groups):
    losses, groups = make(2**18 + 3, dtype, num_groups)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = dro_ext.group_sums(losses, groups, num_groups)
        torch.set_num_threads(2)
        two = dro_ext.group_sums(losses, groups, num_groups)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one[0], two[0]) and torch.equal(one[1], two[1])
    again = dro_ext.group_sums(losses, groups, num_groups)
    assert torch.equal(one[0], again[0])


# ------------------------------------------------------------------------------------------------- ids out of range


@pytest.mark.parametrize("bad", [-1, 4, 2**40], ids=["negative", "num_groups", "huge"])
@pytest.mark.parametrize("id_dtype", ID_DTYPES, ids=str)
def test_out_of_range_id_raises_index_error_naming_groups(backend, bad, id_dtype):
    if bad == 2**40 and id_dtype == torch.int32:
        bad = 2**31 - 1
    losses = torch.randn(100_000)
    groups = torch.randint(0, 4, (100_000,), dtype=id_dtype)
    groups[77_777] = bad
    with pytest.raises(IndexError, match=r"groups .*\[0, num_groups\).*num_groups=4"):
        dro_ext.group_sums(losses, groups, 4)


def test_validate_false_drops_out_of_range_ids(backend):
    n = 50_000
    losses = torch.randn(n, dtype=torch.float64, requires_grad=True)
    groups = torch.randint(0, 6, (n,))
    bad = torch.rand(n) < 0.1
    groups[bad] = torch.where(torch.rand(int(bad.sum())) < 0.5, -3, 6)
    sums, counts = dro_ext.group_sums(losses, groups, 6, validate=False)
    kept = ~bad
    assert_sums_close(sums, counts, losses[kept], groups[kept], 6)
    (grad,) = torch.autograd.grad(sums, losses, torch.arange(1.0, 7.0, dtype=torch.float64))
    assert torch.equal(grad[bad], torch.zeros(int(bad.sum()), dtype=torch.float64))
    assert torch.equal(grad[kept], groups[kept].double() + 1)


# ------------------------------------------------------------------------------------------------- torch.compile


@pytest.mark.parametrize("validate", [True, False])
def test_compiled_group_means_match_eager_without_graph_breaks(backend, validate):
    torch._dynamo.reset()

    def step(losses, groups, q):
        sums, counts = dro_ext.group_sums(losses, groups, 5, validate=validate)
        return (q * (sums / counts.clamp_min(1))).sum()

    losses = torch.randn(301, requires_grad=True)
    groups = torch.randint(0, 5, (301,), dtype=torch.int32)
    q = torch.softmax(torch.randn(5), 0)
    eager = step(losses, groups, q)
    (eager_grad,) = torch.autograd.grad(eager, losses)
    compiled = torch.compile(step, fullgraph=True)(losses, groups, q)
    (grad,) = torch.autograd.grad(compiled, losses)
    torch.testing.assert_close(compiled, eager)
    torch.testing.assert_close(grad, eager_grad)


# ------------------------------------------------------------------------------------------------- float64 sums


def wide_sums(losses, groups, num_groups, how, **kwargs):
    """Float64 sums through the public keyword or the objectives' wide_group_sums."""
    if how == "dtype":
        return dro_ext.group_sums(losses, groups, num_groups, dtype=torch.float64, **kwargs)
    return wide_group_sums(losses, groups, num_groups, **kwargs)


@pytest.mark.parametrize("how", ["dtype", "wide_group_sums"])
@pytest.mark.parametrize("layout", ["contiguous", "strided"])
@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_float64_sums_match_float64_reference(backend, dtype, n, layout, how):
    for num_groups in (5, n + 7):
        losses, groups = make(n, dtype, num_groups, torch.int32 if n % 2 else torch.int64, layout)
        sums, counts = wide_sums(losses, groups, num_groups, how)
        assert_sums_close(sums, counts, losses, groups, num_groups, dtype=torch.float64)
        # The same totals as the sums in the accumulation dtype, which round them once.
        narrow, narrow_counts = dro_ext.group_sums(losses, groups, num_groups)
        assert torch.equal(sums.to(narrow.dtype), narrow) and torch.equal(counts.to(narrow.dtype), narrow_counts)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32], ids=str)
def test_float64_sums_of_float32_losses_past_float32_range_are_finite(backend, dtype):
    # Finite losses whose group sum passes float32's largest value (3.4e38, or about 3.4e38 of bfloat16):
    # a float32 sum is +inf, a float64 one exact.
    big = torch.finfo(dtype).max if dtype != torch.float32 else 3e38
    losses = torch.tensor([big, big, big, 1.0, -big], dtype=dtype)
    groups = torch.tensor([0, 0, 0, 1, 0])
    sums, counts = dro_ext.group_sums(losses, groups, 2, dtype=torch.float64)
    exact = 2 * float(torch.tensor(big, dtype=dtype).double())
    assert sums.tolist() == [exact, 1.0] and counts.tolist() == [4.0, 1.0]
    if dtype == torch.float16:
        return  # (float16's largest values add up within float32)
    many = torch.full((3,), big, dtype=dtype)
    assert torch.isinf(dro_ext.group_sums(many, torch.zeros(3, dtype=torch.long), 1)[0]).all()
    assert torch.isfinite(dro_ext.group_sums(many, torch.zeros(3, dtype=torch.long), 1, dtype=torch.float64)[0]).all()


@pytest.mark.parametrize("validate", [True, False])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_float64_sums_gradient_is_grad_sums_cast_to_the_losses_dtype(backend, dtype, validate):
    losses, groups = make(1001, dtype, 13, torch.int32)
    losses.requires_grad_()
    if not validate:
        groups[::10] = 13  # dropped: a zero gradient
    sums, counts = dro_ext.group_sums(losses, groups, 13, dtype=torch.float64, validate=validate)
    assert sums.dtype == counts.dtype == torch.float64 and not counts.requires_grad
    # Float64 values that no narrower dtype holds: each sample's gradient is its group's, cast once, as indexing and
    # .to() give it.
    grad_sums = torch.randn(13, dtype=torch.float64) * (1 + 2.0**-40)
    (grad,) = torch.autograd.grad(sums, losses, grad_sums)
    want = torch.cat([grad_sums, torch.zeros(1, dtype=torch.float64)])[groups.long()].to(dtype)
    assert grad.dtype == dtype and torch.equal(grad, want)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32], ids=str)
def test_float64_sums_double_backward_sums_in_float64(backend, dtype):
    # The backward's backward (d/d grad_sums of the gathered gradient) is the sums again: of the incoming gradient,
    # into float64 grad_sums.
    losses, groups = make(3001, dtype, 7)
    losses.requires_grad_()
    sums, _ = dro_ext.group_sums(losses, groups, 7, dtype=torch.float64)
    grad_sums = torch.randn(7, dtype=torch.float64, requires_grad=True)
    (gathered,) = torch.autograd.grad(sums, losses, grad_sums, create_graph=True)
    assert gathered.dtype == dtype
    incoming = torch.randn(3001, dtype=dtype)
    (got,) = torch.autograd.grad(gathered, grad_sums, incoming)
    want, counts, abs_sums = reference(incoming, groups, 7)
    allowed = 4 * torch.finfo(torch.float64).eps * torch.sqrt(counts + 1) * abs_sums
    assert got.dtype == torch.float64 and bool(((got - want).abs() <= allowed).all())


def test_float64_sums_gradcheck_and_gradgradcheck(backend):
    losses = torch.randn(37, dtype=torch.float64, requires_grad=True)
    groups = torch.randint(0, 5, (37,))
    for fn in (lambda x: dro_ext.group_sums(x, groups, 5, dtype=torch.float64)[0],
               lambda x: wide_group_sums(x, groups, 5)[0]):
        assert torch.autograd.gradcheck(fn, (losses,))
        assert torch.autograd.gradgradcheck(fn, (losses,))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_float64_sums_empty_batch(backend, dtype):
    losses = torch.empty(0, dtype=dtype, requires_grad=True)
    sums, counts = dro_ext.group_sums(losses, torch.empty(0, dtype=torch.long), 3, dtype=torch.float64)
    assert torch.equal(sums, torch.zeros(3, dtype=torch.float64)) and torch.equal(counts, sums)
    (grad,) = torch.autograd.grad(sums.sum(), losses)
    assert grad.shape == (0,) and grad.dtype == dtype


@pytest.mark.parametrize("validate", [True, False])
def test_compiled_float64_group_means_match_eager_without_graph_breaks(backend, validate):
    torch._dynamo.reset()

    def step(losses, groups, q):
        sums, counts = dro_ext.group_sums(losses, groups, 5, validate=validate, dtype=torch.float64)
        return (q * (sums / counts.clamp_min(1))).sum()

    losses = torch.randn(301, requires_grad=True)
    groups = torch.randint(0, 5, (301,), dtype=torch.int32)
    q = torch.softmax(torch.randn(5, dtype=torch.float64), 0)
    eager = step(losses, groups, q)
    (eager_grad,) = torch.autograd.grad(eager, losses)
    compiled = torch.compile(step, fullgraph=True)(losses, groups, q)
    (grad,) = torch.autograd.grad(compiled, losses)
    assert compiled.dtype == torch.float64 and grad.dtype == torch.float32
    torch.testing.assert_close(compiled, eager)
    torch.testing.assert_close(grad, eager_grad)


def test_bad_dtype_is_refused(backend):
    losses, groups = torch.randn(6), torch.zeros(6, dtype=torch.long)
    # The accumulation dtype is the default's.
    assert dro_ext.group_sums(losses.half(), groups, 2, dtype=torch.float32)[0].dtype == torch.float32
    for dtype in (torch.float16, torch.bfloat16, torch.int64):
        with pytest.raises(ValueError, match="dtype must be None, torch.float32 or torch.float64"):
            dro_ext.group_sums(losses, groups, 2, dtype=dtype)
    with pytest.raises(ValueError, match="dtype must be None or torch.float64"):
        dro_ext.group_sums(losses.double(), groups, 2, dtype=torch.float32)
    with pytest.raises(TypeError, match="dtype"):
        dro_ext.group_sums(losses, groups, 2, dtype="float64")
    with pytest.raises(TypeError, match="losses"):
        dro_ext.group_sums([1.0], groups, 2, dtype=torch.float64)


# ------------------------------------------------------------------------------------------------- bad input


def test_bad_inputs_name_the_argument(backend):
    losses, groups = torch.randn(6), torch.zeros(6, dtype=torch.long)
    cases = [
        (ValueError, "losses", (torch.randn(2, 3), groups.view(2, 3), 2)),
        (ValueError, "losses", (torch.tensor(1.0), torch.tensor(0), 2)),
        (TypeError, "losses", (torch.arange(6), groups, 2)),
        (TypeError, "losses", ([1.0, 2.0], groups, 2)),
        (TypeError, "losses", (losses.to_sparse(), groups, 2)),
        (TypeError, "groups", (losses, groups.float(), 2)),
        (TypeError, "groups", (losses, groups.bool(), 2)),
        (TypeError, "groups", (losses, groups.to(torch.int16), 2)),
        (TypeError, "groups", (losses, [0] * 6, 2)),
        (ValueError, "groups", (losses, groups[:5], 2)),
        (ValueError, "groups", (losses, groups.view(2, 3), 2)),
        (ValueError, "groups", (losses, groups.to("meta"), 2)),
        (ValueError, "num_groups", (losses, groups, 0)),
        (ValueError, "num_groups", (losses, groups, -3)),
        (TypeError, "num_groups", (losses, groups, 2.0)),
        (TypeError, "num_groups", (losses, groups, True)),
        (TypeError, "num_groups", (losses, groups, torch.tensor(2))),
        (TypeError, "num_groups", (losses, groups, None)),
    ]
    for error, name, args in cases:
        with pytest.raises(error, match=name):
            dro_ext.group_sums(*args)
    with pytest.raises(TypeError, match="validate"):
        dro_ext.group_sums(losses, groups, 2, validate=1)


# ------------------------------------------------------------------------------------------------- the raw ops

native_only = pytest.mark.skipif(not _backend.native_available(), reason="native extension not built")


@native_only
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_opcheck(dtype):
    differentiable = dtype == torch.float64
    losses = (1 + torch.randn(65, dtype=torch.float64)).to(dtype).requires_grad_(differentiable)
    groups = torch.randint(0, 4, (65,))
    for validate in (True, False):
        torch.library.opcheck(torch.ops.dro_ext.group_sums.default, (losses, groups, 4, validate))
        torch.library.opcheck(torch.ops.dro_ext.group_sums.default, (losses, groups, 4, validate), {"wide": True})
    torch.library.opcheck(torch.ops.dro_ext.group_sums.default, (losses[::2], groups[::2].int(), 70, True))
    torch.library.opcheck(torch.ops.dro_ext.group_sums.default, (losses[::2], groups[::2].int(), 70, True),
                          {"wide": True})
    for grad_dtype in {sum_dtype(dtype), torch.float64}:  # (wide sums' gradient: float64 into any dtype)
        grad = torch.randn(4, dtype=grad_dtype, requires_grad=differentiable)
        torch.library.opcheck(torch.ops.dro_ext.group_sums_backward.default, (grad, groups, dtype))
        torch.library.opcheck(torch.ops.dro_ext.group_sums_backward.default, (grad, groups.int()[::3], dtype))


@native_only
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_the_fallbacks_float64_sums_match_the_native_ones(dtype):
    # The fallback adds in float64 by upcasting the losses; the same dtype, within a float64 rounding.
    from dro_ext.group_reduction import _fallback_group_sums
    losses, groups = make(20_001, dtype, 9, layout="strided")
    groups[7] = -1
    for validate in (True, False):
        if validate:
            losses_v, groups_v = losses[8:], groups[8:]
        else:
            losses_v, groups_v = losses, groups
        native = torch.ops.dro_ext.group_sums(losses_v, groups_v, 9, validate, wide=True)
        fallback = _fallback_group_sums(losses_v, groups_v, 9, validate, wide=True)
        assert native[0].dtype == fallback[0].dtype == native[1].dtype == fallback[1].dtype == torch.float64
        assert torch.equal(native[1], fallback[1])
        _, _, abs_sums = reference(losses_v, groups_v.clamp_min(0), 9)
        assert bool(((native[0] - fallback[0]).abs() <= 64 * torch.finfo(torch.float64).eps * abs_sums).all())


@native_only
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32], ids=str)
def test_float64_sums_make_no_float64_copy_of_the_losses(dtype):
    # The op's kernels add in float64 anyway: wide sums return those totals, where a float64 copy of the losses
    # (an N-sized float64 tensor) had cost a DROLoss(num_groups=64) step 1.5x its time at 2^20 float32 losses. (The
    # fallback upcasts the losses, by design: native only.)
    from torch.utils._python_dispatch import TorchDispatchMode

    class RecordOutputs(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.calls = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            outs = out if isinstance(out, (tuple, list)) else (out,)
            self.calls.append((str(func), [(t.dtype, t.numel()) for t in outs if isinstance(t, torch.Tensor)]))
            return out

    n = 1001
    losses = torch.randn(n, dtype=dtype, requires_grad=True)
    groups = torch.randint(0, 4, (n,))
    for how in ("wide_group_sums", "dtype"):
        with _backend.forced_backend("native"), RecordOutputs() as mode:
            sums, _ = wide_sums(losses, groups, 4, how)
            (grad,) = torch.autograd.grad(sums, losses, torch.ones(4, dtype=torch.float64))
        assert sums.dtype == torch.float64 and grad.dtype == dtype
        assert [name for name, outs in mode.calls if (torch.float64, n) in outs] == [], mode.calls
        assert [name for name, _ in mode.calls].count("dro_ext.group_sums.default") == 1, mode.calls


@native_only
def test_raw_ops_check_their_arguments():
    losses, ids = torch.randn(6), torch.zeros(6, dtype=torch.long)
    op, backward = torch.ops.dro_ext.group_sums, torch.ops.dro_ext.group_sums_backward
    with pytest.raises(ValueError, match="losses"):
        op(losses.view(2, 3), ids.view(2, 3), 2, True)
    with pytest.raises(TypeError, match="losses"):
        op(torch.arange(6), ids, 2, True)
    with pytest.raises(TypeError, match="groups"):
        op(losses, ids.double(), 2, True)
    with pytest.raises(ValueError, match="groups"):
        op(losses, ids[:4], 2, True)
    with pytest.raises(ValueError, match="num_groups"):
        op(losses, ids, 0, True)
    with pytest.raises(IndexError, match="groups"):
        op(losses, ids - 1, 2, True)
    assert op(losses, ids - 1, 2, False)[1].tolist() == [0.0, 0.0]  # dropped
    for dtype in DTYPES:
        assert [t.dtype for t in op(losses.to(dtype), ids, 2, True, wide=True)] == [torch.float64] * 2
        assert [t.dtype for t in op(losses.to(dtype), ids, 2, wide=False)] == [sum_dtype(dtype)] * 2
    with pytest.raises(ValueError, match="grad_sums"):
        backward(torch.randn(2, 2), ids, torch.float32)
    with pytest.raises(TypeError, match="groups"):
        backward(torch.randn(2), ids.float(), torch.float32)
    with pytest.raises(TypeError, match="dtype"):
        backward(torch.randn(2), ids, torch.int64)
    # The gather gives 0 to an id outside [0, G): what a dropped sample's gradient is.
    assert backward(torch.tensor([1.0, 2.0]), torch.tensor([1, -1, 2, 0]), torch.float16).tolist() == [2, 0, 0, 1]
