"""NormalizedSGD's CUDA kernel (csrc/cuda/normalized_sgd.cu) against the literal float64 Algorithm 1 of
tests/test_optim.py, run on the CPU: every dtype, mixed dtypes under one norm, both norms, weight decay,
maximize, several groups, odd, empty, non-contiguous, misaligned and large tensors, lists long enough for
several launches; GradScaler's unscale and skip, lr as a device tensor, no host sync, bitwise determinism.

Skipped (with the reason shown) where no CUDA device is visible. DRO_EXT_CUDA_TEST_DEVICE=cpu runs the
same numerical tests on the CPU kernel instead (the tests that only mean something on CUDA skip then):
a check of this file's references and tolerances on a machine without a GPU.
"""
import io
import pytest
import torch

import cuda_cases
from cuda_cases import ON_CUDA, needs_cuda
from dro_ext import _backend
from dro_ext.optim import NormalizedSGD
from test_optim import (SHAPES, assert_close_to_reference, assert_compiled_steps_follow_eager,
                        check_each_step_moves_the_group_by_lr, check_fused_and_foreach_agree,
                        check_grad_scaler_skips_an_inf_step_and_unscales, check_zero_gradients_leave_params_unchanged,
                        make_params, reference, tolerance, two_group_optimizer)

DEVICE = torch.device(cuda_cases.DEVICE)

# Not cuda_cases.SKIP_WITHOUT_CUDA: here a missing native extension is a failure (the fixture below), not a skip.
pytestmark = pytest.mark.skipif(ON_CUDA and not torch.cuda.is_available(),
                                reason="no CUDA device visible: the CUDA optimizer tests need one")

DTYPES = [torch.float32, torch.float64, torch.bfloat16, torch.float16]
OP = "dro_ext::normalized_sgd_step_"


@pytest.fixture(autouse=True)
def _native_kernel():
    # These tests are about the native kernel: a missing one is a failure, not a skip.
    if _backend._force_python:
        pytest.skip("DRO_EXT_FORCE_PYTHON=1: this run covers the fallback only")
    if not _backend.native_available():
        pytest.fail(f"the native extension did not load: {_backend.load_error()}")
    if ON_CUDA and not torch._C._dispatch_has_kernel_for_dispatch_key(OP, "CUDA"):
        pytest.fail("dro_ext was built without its CUDA kernels (build with DRO_EXT_CUDA=1)")


def on_device(params):
    """Device copies of CPU parameters, strides kept (a transposed parameter stays transposed)."""
    return [torch.nn.Parameter(p.detach().to(DEVICE)) for p in params]


def odd_params(dtype):
    """A parameter that is a strided (non-dense) view, and one whose data pointer is not 16-byte aligned."""
    strided = torch.randn(10, 8, dtype=torch.float64).to(dtype)[:, ::2]
    misaligned = torch.randn(1001, dtype=torch.float64).to(dtype)[1:]
    return [strided, misaligned]


def run(groups, grad_steps, **kwargs):
    """groups: (device params, options); grad_steps[t][i][j] a float64 CPU gradient (None: no gradient)."""
    opt = NormalizedSGD([dict(params=params, **o) for params, o in groups], lr=1.0, **kwargs)
    for grads in grad_steps:
        for (params, _), group_grads in zip(groups, grads):
            for p, g in zip(params, group_grads):
                p.grad = None if g is None else g.to(device=DEVICE, dtype=p.dtype)
        opt.step()
    return opt


def check(groups_cpu, groups_dev, grad_steps, loosest=torch.float64):
    """The device run against the float64 reference of the CPU twins (the parameters' starting values)."""
    expected = reference(groups_cpu, grad_steps)
    opt = run(groups_dev, grad_steps)
    got = [([p.detach().cpu() for p in params], o) for params, o in groups_dev]
    assert_close_to_reference(got, expected, loosest=loosest)
    return opt


def gradients(groups, steps, dtype=torch.float64):
    # Rounded to the parameters' dtype, so the reference sees exactly the gradient the optimizer sees.
    return [[[torch.randn(p.shape, dtype=torch.float64).to(dtype).to(torch.float64) for p in params]
             for params, _ in groups] for _ in range(steps)]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("norm", ["global", "tensor"])
def test_matches_algorithm_1(dtype, norm):
    first = make_params(SHAPES, dtype) + odd_params(dtype)
    second = make_params(SHAPES[:3], dtype)
    options = [dict(lr=0.1, momentum=0.9, eps=1e-3, weight_decay=0.01, norm=norm),
               dict(lr=0.05, momentum=0.5, eps=0.0, maximize=True, norm=norm)]
    groups_cpu = list(zip([first, second], options))
    groups_dev = list(zip([on_device(first), on_device(second)], options))
    check(groups_cpu, groups_dev, gradients(groups_cpu, 8, dtype))


def test_mixed_dtypes_share_one_global_norm():
    dtypes = [torch.float32, torch.float64, torch.bfloat16, torch.float16, torch.float32, torch.float64]
    cpu = [torch.randn(s, dtype=torch.float64).to(d) for s, d in zip(SHAPES, dtypes)]
    groups_cpu = [(cpu, dict(lr=0.01, momentum=0.9, eps=0.0, weight_decay=0.1))]
    groups_dev = [(on_device(cpu), groups_cpu[0][1])]
    # float16-representable gradients are exact in float32/float64 too; bfloat16 rounds them (its own
    # tolerance covers that, and the shared norm is held to bfloat16's).
    opt = check(groups_cpu, groups_dev, gradients(groups_cpu, 10, torch.float16), loosest=torch.bfloat16)
    for p in groups_dev[0][0]:
        assert opt.state[p]["momentum_buffer"].dtype == p.dtype
        assert opt.state[p]["step"].device == p.device


@pytest.mark.parametrize("norm", ["global", "tensor"])
def test_many_tensors_and_a_large_one(norm):
    # 150 tensors (several launches of the kernel's metadata), empty ones, and one of 2^20 + 3 elements
    # (65 chunks, the last one odd), all under one global norm.
    torch.manual_seed(11)
    shapes = [(int(n),) for n in torch.randint(0, 300, (150,))] + [(0,), (2 ** 20 + 3,), (0, 4)]
    dtypes = [torch.float32, torch.float64]
    cpu = [torch.randn(s, dtype=torch.float64).to(dtypes[i % 2]) for i, s in enumerate(shapes)]
    options = dict(lr=0.02, momentum=0.9, eps=1e-6, weight_decay=0.01, norm=norm)
    groups_cpu, groups_dev = [(cpu, options)], [(on_device(cpu), options)]
    check(groups_cpu, groups_dev, gradients(groups_cpu, 3))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_each_step_moves_the_group_by_lr(dtype):
    check_each_step_moves_the_group_by_lr(dtype, DEVICE)


@pytest.mark.parametrize("scale", [1e-25, 1e25])
@pytest.mark.parametrize("norm", ["global", "tensor"])
def test_tiny_and_huge_gradients_still_move_by_lr(scale, norm):
    # float32 squares of 1e-25 underflow and of 1e25 overflow: the chunks are summed again in float64.
    lr = 0.1
    params = on_device(make_params(SHAPES, torch.float32))
    opt = NormalizedSGD(params, lr=lr, momentum=0.0, eps=0.0, norm=norm)
    before = [p.detach().clone() for p in params]
    for p in params:
        p.grad = torch.randn_like(p) * scale
    opt.step()
    moves = [(p.detach() - b).double() for p, b in zip(params, before)]
    if norm == "global":
        assert float(sum((d ** 2).sum() for d in moves).sqrt()) == pytest.approx(lr, rel=1e-5)
    else:
        for d in moves:
            assert float(d.norm()) == pytest.approx(lr, rel=1e-5)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("eps", [0.0, 1e-8])
def test_zero_gradients_leave_params_unchanged(dtype, eps):
    check_zero_gradients_leave_params_unchanged(dtype, eps, DEVICE)


def test_nan_gradient_propagates():
    params = on_device(make_params(SHAPES[:3]))
    opt = NormalizedSGD(params, lr=0.1)
    for p in params:
        p.grad = torch.randn_like(p)
    params[1].grad.view(-1)[0] = float("nan")
    opt.step()
    assert torch.isnan(params[1]).any()
    assert torch.isnan(opt.state[params[1]]["momentum_buffer"]).any()


def test_momentum_starts_at_the_first_gradient_of_each_param():
    a = torch.nn.Parameter(torch.zeros(3, device=DEVICE))
    b = torch.nn.Parameter(torch.zeros(3, device=DEVICE))
    opt = NormalizedSGD([a, b], lr=1.0, momentum=0.9, eps=0.0, norm="tensor")
    a.grad = torch.tensor([1.0, 0.0, 0.0], device=DEVICE)
    opt.step()
    a.grad = torch.tensor([0.0, 1.0, 0.0], device=DEVICE)
    b.grad = torch.tensor([0.0, 0.0, 2.0], device=DEVICE)
    opt.step()
    torch.testing.assert_close(opt.state[b]["momentum_buffer"].cpu(), torch.tensor([0.0, 0.0, 2.0]))
    torch.testing.assert_close(opt.state[a]["momentum_buffer"].cpu(), torch.tensor([0.9, 0.1, 0.0]))


def _op_args(dtypes=(torch.float32, torch.float64, torch.bfloat16, torch.float16), shapes=((1,), (7, 3), (100,), (33,))):
    params = [torch.randn(s, dtype=d, device=DEVICE) for s, d in zip(shapes, dtypes)]
    grads = [torch.randn_like(p) for p in params]
    momenta = [torch.randn_like(p) for p in params]
    steps = [torch.tensor(float(i), device=DEVICE) for i in range(len(params))]
    return params, grads, momenta, steps


def _clone(tensors):
    return [t.clone() for t in tensors]


@pytest.mark.parametrize("norm", ["global", "tensor"])
def test_found_inf_skips_everything_on_the_device(norm):
    params, grads, momenta, steps = _op_args()
    before = [_clone(params), _clone(momenta), _clone(steps)]
    lr = torch.tensor(0.1, dtype=torch.float64, device=DEVICE)
    for flag in (torch.ones(1, device=DEVICE), torch.tensor([float("inf")], device=DEVICE)):
        torch.ops.dro_ext.normalized_sgd_step_(params, grads, momenta, steps, lr, 0.9, 1e-8, 0.1, norm, False,
                                                torch.ones(1, device=DEVICE), flag)
        for now, then in zip([params, momenta, steps], before):
            for x, y in zip(now, then):
                assert torch.equal(x, y)
    # found_inf == 0 steps exactly as no found_inf at all.
    twins = [_clone(params), _clone(momenta), _clone(steps)]
    torch.ops.dro_ext.normalized_sgd_step_(params, grads, momenta, steps, lr, 0.9, 1e-8, 0.1, norm, False,
                                            None, torch.zeros(1, device=DEVICE))
    torch.ops.dro_ext.normalized_sgd_step_(twins[0], grads, twins[1], twins[2], lr, 0.9, 1e-8, 0.1, norm)
    for now, twin in zip([params, momenta, steps], twins):
        for x, y in zip(now, twin):
            assert torch.equal(x, y)
    assert [float(s) for s in steps] == [1.0, 2.0, 3.0, 4.0]


def test_grad_scale_unscales():
    # A power-of-two scale is exact: scaled gradients with grad_scale give the very same bits.
    params, grads, momenta, steps = _op_args()
    twins = [_clone(params), _clone(momenta), _clone(steps)]
    lr = torch.tensor(0.1, dtype=torch.float64, device=DEVICE)
    scale = torch.full((1,), 1024.0, device=DEVICE)
    torch.ops.dro_ext.normalized_sgd_step_(params, [g * 1024 for g in grads], momenta, steps, lr, 0.9, 1e-8, 0.0,
                                            "global", False, scale, torch.zeros(1, device=DEVICE))
    torch.ops.dro_ext.normalized_sgd_step_(twins[0], grads, twins[1], twins[2], lr, 0.9, 1e-8, 0.0)
    for now, twin in zip([params, momenta], twins):
        for x, y in zip(now, twin):
            assert torch.equal(x, y)


def test_grad_scaler_skips_an_inf_step_and_unscales():
    check_grad_scaler_skips_an_inf_step_and_unscales(DEVICE)


@pytest.mark.parametrize("lr_dtype", [torch.float64, torch.float32])
def test_lr_as_device_tensor(lr_dtype):
    results = []
    for lr in (0.05, torch.tensor(0.05, dtype=lr_dtype, device=DEVICE)):
        torch.manual_seed(1)
        params = on_device(make_params(SHAPES[:4]))
        opt = NormalizedSGD([dict(params=params[:2]), dict(params=params[2:], norm="tensor")], lr=lr,
                            weight_decay=0.1)
        for _ in range(3):
            for p in params:
                p.grad = torch.randn_like(p)
            opt.step()
        results.append([p.detach().clone() for p in params])
    for x, y in zip(*results):
        if lr_dtype == torch.float64:
            assert torch.equal(x, y)  # the same double read on the host or on the device
        else:
            torch.testing.assert_close(x, y, rtol=1e-6, atol=1e-7)


def test_lr_tensor_is_read_at_each_step():
    # Changed in place between steps (as a scheduler would), it takes effect without a new optimizer.
    lr = torch.tensor(0.5, device=DEVICE)
    p = torch.nn.Parameter(torch.zeros(4, device=DEVICE))
    opt = NormalizedSGD([p], lr=lr, momentum=0.0, eps=0.0)
    for value in (0.5, 0.25):
        lr.fill_(value)
        before = p.detach().clone()
        p.grad = torch.ones(4, device=DEVICE)
        opt.step()
        assert float((p.detach() - before).norm()) == pytest.approx(value, rel=1e-6)


def _grad_step_inputs(dtypes, norm):
    torch.manual_seed(7)
    cpu = [torch.randn(s, dtype=torch.float64).to(d) for s, d in zip(SHAPES + [(300000,)], dtypes)]
    params = on_device(cpu + odd_params(torch.float32))
    groups = [dict(params=params[:4]), dict(params=params[4:], norm=norm, maximize=True, weight_decay=0.01)]
    return params, groups


@pytest.mark.parametrize("norm", ["global", "tensor"])
def test_bitwise_deterministic_over_10_runs(norm):
    dtypes = [torch.float32, torch.float64, torch.bfloat16, torch.float16, torch.float32, torch.float32,
              torch.float32]
    runs = []
    torch.manual_seed(8)
    grads = None
    for _ in range(10):
        params, groups = _grad_step_inputs(dtypes, norm)
        if grads is None:
            grads = [[torch.randn_like(p) for p in params] for _ in range(3)]
        opt = NormalizedSGD(groups, lr=0.1)
        for step_grads in grads:
            for p, g in zip(params, step_grads):
                p.grad = g.clone()
            opt.step()
        runs.append([p.detach().clone() for p in params] + [opt.state[p]["momentum_buffer"] for p in params])
    for other in runs[1:]:
        for x, y in zip(runs[0], other):
            assert torch.equal(x, y)


@needs_cuda
@pytest.mark.parametrize("lr_kind", ["float", "device tensor"])
@pytest.mark.parametrize("norm", ["global", "tensor"])
def test_step_makes_no_host_sync(lr_kind, norm):
    dtypes = [torch.float32, torch.float64, torch.bfloat16, torch.float16, torch.float32, torch.float32,
              torch.float32]
    params, groups = _grad_step_inputs(dtypes, norm)
    lr = 0.1 if lr_kind == "float" else torch.tensor(0.1, device=DEVICE)
    opt = NormalizedSGD(groups, lr=lr)
    for step in range(3):  # the first step creates the state: that must not sync either
        for p in params:
            p.grad = torch.randn_like(p)
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            opt.step()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    assert all(float(opt.state[p]["step"]) == 3.0 for p in params)


@needs_cuda
def test_step_with_grad_scaler_makes_no_host_sync():
    torch.manual_seed(9)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4)).to(DEVICE)
    opt = NormalizedSGD(model.parameters(), lr=0.01)
    scaler = torch.amp.GradScaler("cuda", init_scale=2.0 ** 12)
    x = torch.randn(64, 16, device=DEVICE)
    for step in range(4):
        opt.zero_grad()
        with torch.autocast("cuda", dtype=torch.float16):
            loss = model(x).float().square().mean()
        scaler.scale(loss).backward()
        if step == 2:
            model[0].weight.grad[0, 0] = float("inf")  # this step is skipped, on the device
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            scaler.step(opt)
            scaler.update()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    assert all(float(opt.state[p]["step"]) == 3.0 for p in model.parameters())
    assert scaler.get_scale() == 2.0 ** 11


@pytest.mark.parametrize("kwargs", [{}, dict(fused=True), dict(foreach=True), dict(fused=False)])
def test_fused_is_picked_on_the_device(kwargs, monkeypatch):
    calls = []
    real = torch.ops.dro_ext.normalized_sgd_step_
    monkeypatch.setattr(torch.ops.dro_ext, "normalized_sgd_step_", lambda *args: calls.append(1) or real(*args))
    params = on_device(make_params(SHAPES[:2]))
    opt = NormalizedSGD(params, lr=0.1, **kwargs)
    for p in params:
        p.grad = torch.randn_like(p)
    opt.step()
    assert len(calls) == (0 if kwargs.get("foreach") or kwargs.get("fused") is False else 1)


def test_fused_and_foreach_agree():
    check_fused_and_foreach_agree(DEVICE)


@needs_cuda
def test_state_loaded_from_a_cpu_checkpoint():
    # load_state_dict keeps "step" on the CPU where it was saved; the step moves it beside the parameter. The state
    # goes through a saved checkpoint: a live optimizer's state_dict() shares its "step" tensors (as torch.optim's
    # does), so loading it directly would count the CPU optimizer's next step on the GPU one too.
    cpu_params = make_params(SHAPES[:3])
    cpu_opt = NormalizedSGD(cpu_params, lr=0.1)
    for p in cpu_params:
        p.grad = torch.randn_like(p)
    cpu_opt.step()
    params = on_device(cpu_params)
    opt = NormalizedSGD(params, lr=0.1)
    checkpoint = io.BytesIO()
    torch.save(cpu_opt.state_dict(), checkpoint)
    checkpoint.seek(0)
    opt.load_state_dict(torch.load(checkpoint))
    grads = [torch.randn_like(p) for p in cpu_params]
    for p, q, g in zip(cpu_params, params, grads):
        p.grad, q.grad = g, g.to(DEVICE)
    cpu_opt.step()
    opt.step()
    for p, q in zip(cpu_params, params):
        assert opt.state[q]["step"].device == q.device and float(opt.state[q]["step"]) == 2.0
        torch.testing.assert_close(q.detach().cpu(), p.detach(), rtol=1e-5, atol=1e-6)


@needs_cuda
def test_clear_errors_for_tensors_off_the_device():
    params, grads, momenta, steps = _op_args(dtypes=(torch.float32,), shapes=((5,),))
    lr = torch.tensor(0.1, device=DEVICE)
    with pytest.raises(ValueError, match=r"grads\[0\]"):
        torch.ops.dro_ext.normalized_sgd_step_(params, [grads[0].cpu()], momenta, steps, lr, 0.9, 0.0)
    with pytest.raises(ValueError, match=r"steps\[0\]"):
        torch.ops.dro_ext.normalized_sgd_step_(params, grads, momenta, [steps[0].cpu()], lr, 0.9, 0.0)
    with pytest.raises(ValueError, match="params"):
        torch.ops.dro_ext.normalized_sgd_step_([params[0].cpu()] + params, grads * 2, momenta * 2, steps * 2, lr,
                                                0.9, 0.0)
    with pytest.raises(ValueError, match="found_inf"):
        torch.ops.dro_ext.normalized_sgd_step_(params, grads, momenta, steps, lr, 0.9, 0.0, 0.0, "global", False,
                                                None, torch.zeros(2, device=DEVICE))
    with pytest.raises(ValueError, match="norm"):
        torch.ops.dro_ext.normalized_sgd_step_(params, grads, momenta, steps, lr, 0.9, 0.0, 0.0, "layer")


@pytest.mark.parametrize("norm", ["global", "tensor"])
@pytest.mark.parametrize("scaled", [False, True])
def test_opcheck(norm, scaled):
    params, grads, momenta, steps = _op_args()
    extra = (torch.tensor([4.0], device=DEVICE), torch.tensor([0.0], device=DEVICE)) if scaled else (None, None)
    args = (params, grads, momenta, steps, torch.tensor(0.1, dtype=torch.float64, device=DEVICE), 0.9, 1e-8, 0.01,
            norm, False, *extra)
    torch.library.opcheck(torch.ops.dro_ext.normalized_sgd_step_.default, args)


@needs_cuda
def test_torch_compile_step():
    assert_compiled_steps_follow_eager(lambda: two_group_optimizer(DEVICE), 3, dict(fullgraph=True))
