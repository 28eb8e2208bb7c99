"""group_sums on CUDA (csrc/cuda/group_sums.cu) against float64 references: every dtype, id dtype, size and layout;
out-of-range ids; bitwise determinism; no host sync with validate=False; CUDA-graph capture; opcheck; bad input;
the float64 sums of any dtype (dtype=torch.float64, the op's wide=True) and their gradient.

Skipped (with the reason shown) where no CUDA device is visible; scripts/gpu_check.sh runs them on a GPU, and
tools/cuda_emulation runs them on the CPU against the kernel compiled as C++ (`--kernel groups`).
"""
import pytest
import torch

import dro_ext
from cuda_cases import (DEVICE, DTYPES, ON_CUDA, SKIP_WITHOUT_CUDA, make_losses, native_backend,  # noqa: F401
                        needs_cuda, on_test_device)
from test_group_sums import (assert_sums_close, check_a_large_group_of_alike_float32_losses,
                             check_gather_adjoint_sums_alike_terms, sum_dtype)

pytestmark = SKIP_WITHOUT_CUDA

SIZES = [1, 7, 1000, 2**16 + 3, 2**20 + 5]


def make_ids(n, num_groups, id_dtype, layout):
    ids = torch.randint(0, num_groups, (n,), device=DEVICE, dtype=id_dtype)
    if layout == "strided":
        buffer = torch.full((2 * n,), -7, device=DEVICE, dtype=id_dtype)  # bad ids in the gaps
        buffer[::2] = ids
        return buffer[::2]
    return ids


@needs_cuda
def test_group_sums_ops_have_cuda_kernels():
    for op in ("group_sums", "group_sums_backward"):
        assert torch._C._dispatch_has_kernel_for_dispatch_key(f"dro_ext::{op}", "CUDA"), op


@pytest.mark.parametrize("num_groups", [1, 4, 1024, 70_000])
@pytest.mark.parametrize("layout", ["contiguous", "strided", "offset"])
@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_matches_float64_reference(dtype, n, layout, num_groups):
    if num_groups == 70_000 and n > 2**16 + 3:
        pytest.skip("covered at the smaller sizes")
    losses = make_losses(n, dtype, layout)
    id_dtype = torch.int32 if n % 2 else torch.int64
    groups = make_ids(n, num_groups, id_dtype, "strided" if layout == "strided" else "contiguous")
    sums, counts = dro_ext.group_sums(losses, groups, num_groups)
    assert on_test_device(sums) and on_test_device(counts)
    assert_sums_close(sums, counts, losses, groups, num_groups)


@pytest.mark.parametrize("num_groups", [1, 4, 1024])
@pytest.mark.parametrize("layout", ["contiguous", "strided", "offset"])
@pytest.mark.parametrize("n", SIZES[:-1])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_float64_sums_match_float64_reference(dtype, n, layout, num_groups):
    losses = make_losses(n, dtype, layout)
    groups = make_ids(n, num_groups, torch.int32 if n % 2 else torch.int64,
                      "strided" if layout == "strided" else "contiguous")
    sums, counts = dro_ext.group_sums(losses, groups, num_groups, dtype=torch.float64)
    assert on_test_device(sums) and on_test_device(counts)
    assert_sums_close(sums, counts, losses, groups, num_groups, dtype=torch.float64)
    # The same totals as the sums in the accumulation dtype, which round them once.
    narrow, narrow_counts = dro_ext.group_sums(losses, groups, num_groups)
    assert torch.equal(sums.to(narrow.dtype), narrow) and torch.equal(counts.to(narrow.dtype), narrow_counts)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_float64_sums_gradient_is_grad_sums_cast_to_the_losses_dtype(dtype):
    losses = make_losses(5003, dtype, "strided").requires_grad_()
    groups = make_ids(5003, 9, torch.int32, "contiguous")
    groups[::10] = 9  # dropped: a zero gradient
    sums, counts = dro_ext.group_sums(losses, groups, 9, validate=False, dtype=torch.float64)
    assert sums.dtype == counts.dtype == torch.float64 and not counts.requires_grad
    grad_sums = torch.randn(9, device=DEVICE, dtype=torch.float64) * (1 + 2.0**-40)
    (grad,) = torch.autograd.grad(sums, losses, grad_sums)
    want = torch.cat([grad_sums, grad_sums.new_zeros(1)])[groups.long()].to(dtype)
    assert grad.dtype == dtype and on_test_device(grad) and torch.equal(grad, want)


def test_float64_sums_past_float32_range_and_of_an_empty_batch():
    many = torch.full((3,), 3e38, device=DEVICE)
    ids = torch.zeros(3, dtype=torch.long, device=DEVICE)
    assert torch.isinf(dro_ext.group_sums(many, ids, 1)[0]).all().item()
    sums, counts = dro_ext.group_sums(many, ids, 1, dtype=torch.float64)
    assert sums.tolist() == [3 * float(torch.tensor(3e38).double())] and counts.tolist() == [3.0]
    empty = torch.empty(0, device=DEVICE, dtype=torch.bfloat16)
    for out in dro_ext.group_sums(empty, ids[:0], 3, dtype=torch.float64):
        assert out.dtype == torch.float64 and on_test_device(out) and out.tolist() == [0.0, 0.0, 0.0]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_gradient_and_means_composition(dtype):
    losses = make_losses(5003, dtype, "strided").requires_grad_()
    groups = make_ids(5003, 9, torch.int32, "contiguous")
    sums, counts = dro_ext.group_sums(losses, groups, 9)
    means = sums / counts.clamp_min(1)
    q = torch.rand(9, device=DEVICE, dtype=sums.dtype)
    (grad,) = torch.autograd.grad((q * means).sum(), losses)
    assert grad.dtype == dtype and on_test_device(grad)
    want = (q / counts.clamp_min(1))[groups.long()].to(dtype)
    assert torch.equal(grad, want)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32], ids=str)
def test_the_gathers_adjoint_sums_alike_terms_within_a_rounding(dtype):
    check_gather_adjoint_sums_alike_terms(dtype, DEVICE)


@pytest.mark.parametrize("num_groups", [4, 2**16])
def test_a_large_group_of_alike_float32_losses_sums_within_a_rounding(num_groups):
    # (2^20 samples: a group of 900K; under the emulation 2^22 would sort for minutes)
    check_a_large_group_of_alike_float32_losses(num_groups, DEVICE, n=2**20)


def test_gradcheck_and_gradgradcheck_float64():
    losses = torch.randn(41, dtype=torch.float64, device=DEVICE, requires_grad=True)
    groups = torch.randint(0, 6, (41,), device=DEVICE)
    fn = lambda x: dro_ext.group_sums(x, groups, 6)[0]  # noqa: E731
    assert torch.autograd.gradcheck(fn, (losses,))
    assert torch.autograd.gradgradcheck(fn, (losses,))


def test_empty_batch_and_nan():
    sums, counts = dro_ext.group_sums(torch.empty(0, device=DEVICE), torch.empty(0, dtype=torch.long, device=DEVICE), 3)
    assert sums.tolist() == [0.0, 0.0, 0.0] and counts.tolist() == [0.0, 0.0, 0.0]
    losses = make_losses(100_000, torch.float32, "contiguous")
    groups = (torch.arange(100_000, device=DEVICE) % 3)
    losses[50_001] = float("nan")  # group 0
    sums, _ = dro_ext.group_sums(losses, groups, 3)
    assert torch.isnan(sums[0]).item() and torch.isfinite(sums[1:]).all().item()


@pytest.mark.parametrize("bad", [-1, 5])
def test_out_of_range_ids_raise_or_are_dropped(bad):
    losses = make_losses(30_000, torch.float64, "contiguous")
    groups = torch.randint(0, 5, (30_000,), device=DEVICE)
    groups[12_345] = bad
    with pytest.raises(IndexError, match="groups"):
        dro_ext.group_sums(losses, groups, 5)
    sums, counts = dro_ext.group_sums(losses, groups, 5, validate=False)
    keep = groups != bad
    assert_sums_close(sums, counts, losses[keep], groups[keep], 5)


def test_bitwise_deterministic_over_10_runs():
    losses = make_losses(2**20 + 7, torch.float32, "offset")
    for num_groups in (3, 1000):
        groups = torch.randint(0, num_groups, (losses.numel(),), device=DEVICE)
        runs = [dro_ext.group_sums(losses, groups, num_groups) for _ in range(10)]
        for sums, counts in runs[1:]:
            assert torch.equal(sums, runs[0][0]) and torch.equal(counts, runs[0][1])


@needs_cuda
def test_validate_false_never_syncs():
    losses = make_losses(300_001, torch.float32, "contiguous").requires_grad_()
    groups = torch.randint(0, 17, (300_001,), device=DEVICE, dtype=torch.int32)
    torch.cuda.synchronize()
    previous = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode("error")
    try:
        sums, counts = dro_ext.group_sums(losses, groups, 17, validate=False)
        means = sums / counts.clamp_min(1)
        (grad,) = torch.autograd.grad(means.sum(), losses)
    finally:
        torch.cuda.set_sync_debug_mode(previous)
    assert torch.isfinite(grad).all().item()


@needs_cuda
def test_cuda_graph_capture_with_validate_false_matches_eager():
    n, num_groups = 30_011, 12
    static_losses = make_losses(n, torch.float32, "contiguous")
    static_groups = torch.randint(0, num_groups, (n,), device=DEVICE)

    def step():
        return dro_ext.group_sums(static_losses, static_groups, num_groups, validate=False)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = step()
    for _ in range(2):
        static_losses.copy_(make_losses(n, torch.float32, "contiguous"))
        static_groups.copy_(torch.randint(0, num_groups + 2, (n,), device=DEVICE))  # some ids dropped
        graph.replay()
        for got, want in zip(static_out, step()):
            assert torch.equal(got, want)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16], ids=str)
def test_opcheck_on_cuda(dtype):
    losses = torch.randn(33, device=DEVICE, dtype=dtype, requires_grad=dtype == torch.float64)
    groups = torch.randint(0, 4, (33,), device=DEVICE)
    torch.library.opcheck(torch.ops.dro_ext.group_sums.default, (losses, groups, 4, True))
    torch.library.opcheck(torch.ops.dro_ext.group_sums.default, (losses, groups, 4, False), {"wide": True})
    for grad_dtype in {sum_dtype(dtype), torch.float64}:
        grad = torch.randn(4, device=DEVICE, dtype=grad_dtype, requires_grad=dtype == torch.float64)
        torch.library.opcheck(torch.ops.dro_ext.group_sums_backward.default, (grad, groups.int(), dtype))


def test_bad_inputs_name_the_argument():
    losses = torch.randn(5, device=DEVICE)
    ids = torch.zeros(5, dtype=torch.long, device=DEVICE)
    if ON_CUDA:  # (under the CPU emulation the CPU is the device)
        with pytest.raises(ValueError, match="groups"):
            torch.ops.dro_ext.group_sums(losses, ids.cpu(), 2, True)
    with pytest.raises(TypeError, match="groups"):
        torch.ops.dro_ext.group_sums(losses, ids.float(), 2, True)
    with pytest.raises(ValueError, match="num_groups"):
        torch.ops.dro_ext.group_sums(losses, ids, 0, True)
    with pytest.raises(ValueError, match="losses"):
        torch.ops.dro_ext.group_sums(losses.view(5, 1), ids.view(5, 1), 2, True)
