"""NormalizedSGD against a literal float64 Algorithm 1, on the fused native op and the foreach fallback."""
import copy
import math
import warnings
import weakref

import pytest
import torch

import dro_ext
from dro_ext import _backend
from dro_ext.optim import NormalizedSGD

# Assorted shapes: one element, odd sizes, a non-contiguous tensor (transposed), and one large enough to
# cross chunk boundaries and take the multi-threaded path of the CPU kernel.
SHAPES = [(1,), (7,), (3, 5), (2, 3, 4), (1003,), (70001,)]


def needs_native():
    if _backend._force_python:
        pytest.skip("DRO_EXT_FORCE_PYTHON=1: this run covers the fallback only")
    if not _backend.native_available():
        pytest.fail(f"the native extension did not load: {_backend.load_error()}")


def make_params(shapes, dtype=torch.float32, device="cpu"):
    params = [torch.nn.Parameter(torch.randn(s, dtype=torch.float64).to(dtype).to(device)) for s in shapes]
    # A transposed (non-contiguous) parameter, as a weight tied to its transpose would be.
    params.append(torch.nn.Parameter(torch.randn(6, 9, dtype=torch.float64).to(dtype).to(device).t()))
    return params


def reference(groups, grad_steps):
    """Algorithm 1 in float64, literally: groups is a list of (params, options); grad_steps[t][i][j] is the
    gradient of parameter j of group i at step t (None: no gradient)."""
    state = [[{"m": None} for _ in params] for params, _ in groups]
    values = [[p.detach().to(torch.float64).clone() for p in params] for params, _ in groups]
    for grads in grad_steps:
        for gi, (_, opt) in enumerate(groups):
            active = [j for j, g in enumerate(grads[gi]) if g is not None]
            for j in active:
                g = grads[gi][j].to(torch.float64) * (-1.0 if opt.get("maximize") else 1.0)
                m = state[gi][j]["m"]
                state[gi][j]["m"] = g.clone() if m is None else opt["momentum"] * m + (1 - opt["momentum"]) * g
            sq = {j: float((state[gi][j]["m"] ** 2).sum()) for j in active}
            group_norm = math.sqrt(sum(sq.values()))
            for j in active:
                norm = math.sqrt(sq[j]) if opt.get("norm") == "tensor" else group_norm
                p = values[gi][j] * (1 - opt["lr"] * opt.get("weight_decay", 0.0))
                if norm > 0:
                    p = p - opt["lr"] * state[gi][j]["m"] / (norm + opt["eps"])
                values[gi][j] = p
    return values


def run_optimizer(groups, grad_steps, **kwargs):
    opt = NormalizedSGD([dict(params=params, **o) for params, o in groups], lr=1.0, **kwargs)
    for grads in grad_steps:
        for (params, _), group_grads in zip(groups, grads):
            for p, g in zip(params, group_grads):
                p.grad = None if g is None else g.to(p.dtype)
        opt.step()
    return opt


def tolerance(dtype):
    return {torch.float64: dict(rtol=1e-11, atol=1e-11), torch.float32: dict(rtol=1e-5, atol=2e-5),
            torch.bfloat16: dict(rtol=2e-2, atol=5e-2), torch.float16: dict(rtol=2e-3, atol=5e-3)}[dtype]


def assert_close_to_reference(groups, expected, loosest=torch.float64):
    # loosest: the least precise dtype whose rounded momentum enters the same norm.
    floor = tolerance(loosest)
    for (params, _), ref in zip(groups, expected):
        for p, r in zip(params, ref):
            assert torch.isfinite(p).all()
            tol = {k: max(v, floor[k] / 100) for k, v in tolerance(p.dtype).items()}
            torch.testing.assert_close(p.detach().to(torch.float64), r, **tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("norm", ["global", "tensor"])
def test_matches_algorithm_1(backend, dtype, norm):
    groups = [
        (make_params(SHAPES, dtype), dict(lr=0.1, momentum=0.9, eps=1e-3, weight_decay=0.01, norm=norm)),
        (make_params(SHAPES[:3], dtype), dict(lr=0.05, momentum=0.5, eps=0.0, maximize=True, norm=norm)),
    ]
    steps = 12
    grad_steps = [[[torch.randn(p.shape, dtype=torch.float64) for p in params] for params, _ in groups]
                  for _ in range(steps)]
    expected = reference(groups, grad_steps)
    run_optimizer(groups, grad_steps)
    assert_close_to_reference(groups, expected)


def test_mixed_dtypes_share_one_global_norm(backend):
    # One group of float32, float64, bfloat16 and float16 parameters: the norm spans all of them.
    dtypes = [torch.float32, torch.float64, torch.bfloat16, torch.float16, torch.float32]
    params = [torch.nn.Parameter(torch.randn(s, dtype=torch.float64).to(d)) for s, d in zip(SHAPES, dtypes)]
    groups = [(params, dict(lr=0.01, momentum=0.9, eps=0.0))]
    # Gradients exactly representable in every dtype, so the reference sees what the optimizer sees.
    grad_steps = [[[torch.randn(p.shape).to(torch.float16).to(torch.float64) for p in params]] for _ in range(10)]
    expected = reference(groups, grad_steps)
    opt = run_optimizer(groups, grad_steps)
    assert_close_to_reference(groups, expected, loosest=torch.bfloat16)
    for p in params:
        assert opt.state[p]["momentum_buffer"].dtype == p.dtype


@pytest.mark.parametrize(("dtype", "momentum"), [(torch.bfloat16, 0.999), (torch.float16, 0.9998)], ids=str)
def test_a_half_momentum_is_rounded_once_a_step(backend, dtype, momentum):
    """m = beta m + (1 - beta) g formed wide and rounded once into the half momentum (the float64 formula rounded
    once, here exactly), on both implementations. From m = 1 with g = -1, bfloat16 at beta = 0.999: 0.998 rounds to
    0.99609375. Rounded after each op, 0.999 m came back as 1 and 1 - 0.001 as 1 again: a momentum stuck at 1."""
    param = torch.nn.Parameter(torch.zeros(5, dtype=dtype))
    opt = NormalizedSGD([param], lr=0.1, momentum=momentum)
    expected = torch.ones(5, dtype=dtype)
    param.grad = torch.ones(5, dtype=dtype)
    opt.step()
    for _ in range(20):
        param.grad = -torch.ones(5, dtype=dtype)
        opt.step()
        expected = (momentum * expected.double() - (1.0 - momentum)).to(dtype)
        torch.testing.assert_close(opt.state[param]["momentum_buffer"], expected, rtol=0.0, atol=0.0)
    assert float(expected[0]) < 0.995  # it decays


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_each_step_moves_the_group_by_lr(backend, dtype):
    check_each_step_moves_the_group_by_lr(dtype, "cpu")


# The check_* bodies below are shared with tests/test_cuda_optim.py, which runs them on the device.
def check_each_step_moves_the_group_by_lr(dtype, device):
    lr = 0.3
    global_params = make_params(SHAPES, dtype, device)
    tensor_params = make_params(SHAPES, dtype, device)
    opt = NormalizedSGD([dict(params=global_params), dict(params=tensor_params, norm="tensor")], lr=lr, eps=0.0)
    rtol = 1e-12 if dtype == torch.float64 else 1e-5
    for _ in range(10):
        before = [p.detach().clone() for p in global_params + tensor_params]
        for p in global_params + tensor_params:
            p.grad = torch.randn_like(p)
        opt.step()
        moves = [(p.detach() - b).to(torch.float64).cpu() for p, b in zip(global_params + tensor_params, before)]
        group_move = math.sqrt(sum(float((d ** 2).sum()) for d in moves[: len(global_params)]))
        assert group_move == pytest.approx(lr, rel=rtol)
        for d in moves[len(global_params):]:
            assert float(d.norm()) == pytest.approx(lr, rel=rtol)


@pytest.mark.parametrize("scale", [1e-25, 1e25])
def test_tiny_and_huge_gradients_still_move_by_lr(backend, scale):
    # float32 squares of 1e-25 underflow and of 1e25 overflow: the norm must still come out right.
    lr = 0.1
    params = make_params(SHAPES, torch.float32)
    opt = NormalizedSGD(params, lr=lr, momentum=0.0, eps=0.0)
    before = [p.detach().clone() for p in params]
    for p in params:
        p.grad = torch.randn_like(p) * scale
    opt.step()
    move = math.sqrt(sum(float(((p.detach() - b).double() ** 2).sum()) for p, b in zip(params, before)))
    assert move == pytest.approx(lr, rel=1e-5)


@pytest.mark.parametrize("eps", [0.0, 1e-8])
def test_zero_gradients_leave_params_unchanged(backend, eps):
    check_zero_gradients_leave_params_unchanged(torch.float32, eps, "cpu")


def check_zero_gradients_leave_params_unchanged(dtype, eps, device):
    params = make_params(SHAPES, dtype, device)
    opt = NormalizedSGD([dict(params=params[:3]), dict(params=params[3:], norm="tensor")], lr=0.1, eps=eps)
    before = [p.detach().clone() for p in params]
    for _ in range(2):
        for p in params:
            p.grad = torch.zeros_like(p)
        opt.step()
    for p, b in zip(params, before):
        assert torch.equal(p.detach(), b)  # no NaN either: NaN != NaN
        m = opt.state[p]["momentum_buffer"]
        assert torch.equal(m, torch.zeros_like(m))
        assert float(opt.state[p]["step"]) == 2.0


def test_params_without_grad_are_skipped(backend):
    params = make_params(SHAPES)
    frozen = params[2]
    frozen_before = frozen.detach().clone()
    active = [p for p in params if p is not frozen]
    groups = [(active, dict(lr=0.1, momentum=0.9, eps=0.0))]
    grad_steps = [[[torch.randn(p.shape, dtype=torch.float64) for p in active]] for _ in range(4)]
    expected = reference(groups, grad_steps)  # the norm leaves out the frozen tensor
    opt = NormalizedSGD(params, lr=0.1, momentum=0.9, eps=0.0)
    for grads in grad_steps:
        for p, g in zip(active, grads[0]):
            p.grad = g.to(p.dtype)
        frozen.grad = None
        opt.step()
    assert_close_to_reference(groups, expected)
    assert torch.equal(frozen.detach(), frozen_before)
    assert frozen not in opt.state


def test_momentum_starts_at_the_first_gradient_of_each_param(backend):
    # A parameter whose gradient appears late gets m = g on its own first step, not (1 - beta) g.
    a, b = torch.nn.Parameter(torch.zeros(3)), torch.nn.Parameter(torch.zeros(3))
    opt = NormalizedSGD([a, b], lr=1.0, momentum=0.9, eps=0.0, norm="tensor")
    a.grad = torch.tensor([1.0, 0.0, 0.0])
    opt.step()
    a.grad, b.grad = torch.tensor([0.0, 1.0, 0.0]), torch.tensor([0.0, 0.0, 2.0])
    opt.step()
    torch.testing.assert_close(opt.state[b]["momentum_buffer"], torch.tensor([0.0, 0.0, 2.0]))
    torch.testing.assert_close(opt.state[a]["momentum_buffer"], torch.tensor([0.9, 0.1, 0.0]))


def test_lr_as_tensor_matches_float(backend):
    results = []
    for lr in (0.05, torch.tensor(0.05, dtype=torch.float64)):
        torch.manual_seed(1)
        params = make_params(SHAPES[:4])
        opt = NormalizedSGD(params, lr=lr, weight_decay=0.1)
        for _ in range(3):
            for p in params:
                p.grad = torch.randn_like(p)
            opt.step()
        results.append([p.detach().clone() for p in params])
    for x, y in zip(*results):
        torch.testing.assert_close(x, y, rtol=1e-6, atol=1e-7)


def test_state_dict_round_trip_is_bitwise(backend):
    params = make_params(SHAPES)
    opt = NormalizedSGD([dict(params=params[:4]), dict(params=params[4:], lr=0.01, norm="tensor")], lr=0.1,
                        weight_decay=0.01)
    grads = [[torch.randn_like(p) for p in params] for _ in range(6)]

    def steps(optimizer, ps, gs):
        for step_grads in gs:
            for p, g in zip(ps, step_grads):
                p.grad = g.clone()
            optimizer.step()

    steps(opt, params, grads[:3])
    saved_params = [p.detach().clone() for p in params]
    saved_state = copy.deepcopy(opt.state_dict())
    steps(opt, params, grads[3:])

    resumed = [torch.nn.Parameter(p.clone().t().contiguous().t() if not p.is_contiguous() else p.clone())
               for p in saved_params]
    opt2 = NormalizedSGD([dict(params=resumed[:4]), dict(params=resumed[4:])], lr=0.5)
    opt2.load_state_dict(saved_state)
    assert opt2.param_groups[1]["lr"] == 0.01 and opt2.param_groups[1]["norm"] == "tensor"
    steps(opt2, resumed, grads[3:])
    for p, q in zip(params, resumed):
        assert torch.equal(p.detach(), q.detach())
    for p, q in zip(params, resumed):
        assert torch.equal(opt.state[p]["momentum_buffer"], opt2.state[q]["momentum_buffer"])
        assert torch.equal(opt.state[p]["step"], opt2.state[q]["step"])


def test_grad_scaler_skips_an_inf_step_and_unscales(backend):
    check_grad_scaler_skips_an_inf_step_and_unscales(torch.device("cpu"))


def check_grad_scaler_skips_an_inf_step_and_unscales(device):
    torch.manual_seed(3)
    model = torch.nn.Linear(5, 3).to(device)
    twin = copy.deepcopy(model)
    opt = NormalizedSGD(model.parameters(), lr=0.1, eps=0.0)
    twin_opt = NormalizedSGD(twin.parameters(), lr=0.1, eps=0.0)
    scaler = torch.amp.GradScaler(device.type, init_scale=2.0 ** 10)
    x = torch.randn(8, 5, device=device)

    # An inf gradient on the very first step: nothing moves, not even the step count.
    before = [p.detach().clone() for p in model.parameters()]
    scaler.scale(model(x).square().mean()).backward()
    model.weight.grad[0, 0] = float("inf")
    scaler.step(opt)
    scaler.update()
    assert scaler.get_scale() == 2.0 ** 9
    for p, b in zip(model.parameters(), before):
        assert torch.equal(p.detach(), b)
        assert float(opt.state[p]["step"]) == 0.0
        assert torch.equal(opt.state[p]["momentum_buffer"], torch.zeros_like(p))

    # Finite steps: the same as the optimizer given the unscaled gradients (m = g on the first real step).
    for _ in range(3):
        opt.zero_grad()
        twin_opt.zero_grad()
        scaler.scale(model(x).square().mean()).backward()
        twin(x).square().mean().backward()
        scaler.step(opt)
        scaler.update()
        twin_opt.step()
    for p, q in zip(model.parameters(), twin.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-6)


def test_fused_and_foreach_agree():
    needs_native()
    check_fused_and_foreach_agree("cpu")


def check_fused_and_foreach_agree(device):
    dtypes = [torch.float32, torch.float64, torch.bfloat16, torch.float16, torch.float32, torch.float32]
    results = {}
    for impl in ("fused", "foreach"):
        torch.manual_seed(4)
        params = [torch.nn.Parameter(torch.randn(s).to(d).to(device)) for s, d in zip(SHAPES, dtypes)]
        opt = NormalizedSGD([dict(params=params[:3]), dict(params=params[3:], norm="tensor", maximize=True)],
                            lr=0.05, weight_decay=0.1, **{impl: True})
        for _ in range(5):
            for p in params:
                p.grad = torch.randn_like(p)
            opt.step()
        results[impl] = (params, opt)
    (fused_params, fused_opt), (foreach_params, foreach_opt) = results["fused"], results["foreach"]
    for i, (p, q) in enumerate(zip(fused_params, foreach_params)):
        # The first group shares one norm with a bfloat16 momentum; the second normalizes per tensor.
        tol = tolerance(torch.bfloat16 if i < 3 else p.dtype)
        torch.testing.assert_close(p, q, **tol)
        torch.testing.assert_close(fused_opt.state[p]["momentum_buffer"], foreach_opt.state[q]["momentum_buffer"],
                                   **tol)


@pytest.mark.parametrize("kwargs", [{}, dict(foreach=True), dict(fused=False)])
def test_which_implementation_runs(backend, kwargs, monkeypatch):
    # The native runs of every other test must really exercise the fused op.
    calls = []
    real = torch.ops.dro_ext.normalized_sgd_step_ if _backend.native_available() else None
    monkeypatch.setattr(torch.ops.dro_ext, "normalized_sgd_step_",
                        lambda *args: calls.append(1) or real(*args), raising=False)
    params = make_params(SHAPES[:2])
    opt = NormalizedSGD(params, lr=0.1, **kwargs)
    for p in params:
        p.grad = torch.randn_like(p)
    opt.step()
    assert len(calls) == (1 if backend == "native" and not kwargs else 0)


def test_cached_step_lists_follow_every_change_to_the_optimizer(backend, monkeypatch):
    # A step reuses its group's lists while nothing they came from has changed (dro_ext.optim._GroupPlan). After
    # each change below the next step must do exactly what an optimizer that rebuilds them every step does.
    from dro_ext import optim

    def run(cached):
        torch.manual_seed(0)
        params = make_params(SHAPES[:3])
        extra = torch.nn.Parameter(torch.randn(5))
        swapped_in = torch.nn.Parameter(torch.randn(SHAPES[0]))
        opt = NormalizedSGD(params, lr=0.1, momentum=0.8)
        rebuilt = []
        init_group = opt._init_group
        opt._init_group = lambda *args: rebuilt.append(1) or init_group(*args)

        def step():
            for p in opt.param_groups[0]["params"] + [extra]:
                p.grad = torch.randn_like(p)
            if changes:
                changes.pop(0)()
            opt.step()

        changes = [
            lambda: None, lambda: None,
            lambda: setattr(params[1], "grad", None),  # a param without a gradient this step
            lambda: None,
            lambda: opt.state[params[0]].__setitem__("momentum_buffer", torch.zeros_like(params[0])),
            lambda: opt.state[params[2]].clear(),  # a param that starts over (m = g)
            lambda: None,
            lambda: opt.state.pop(params[1]),  # del opt.state[p]: p starts over
            lambda: None,
            lambda: opt.state.clear(),  # every param starts over
            lambda: None,
            lambda: opt.state.__setitem__(params[0], {}),  # a state entry replaced by an empty one
            lambda: None,
            lambda: opt.load_state_dict(copy.deepcopy(opt.state_dict())),
            lambda: opt.add_param_group({"params": [extra], "lr": 0.3}),
            lambda: opt.param_groups[0].__setitem__("lr", 0.05),
            lambda: opt.param_groups[0].__setitem__("foreach", True),
            lambda: None,
            lambda: opt.param_groups[0].__setitem__("foreach", None),
            lambda: None,
            # A param of the group replaced in its list: the new one steps, the old one no longer (last: the old
            # one's state entry, no longer any group's, is what torch's state_dict cannot save)
            lambda: (opt.param_groups[0]["params"].__setitem__(0, swapped_in),
                     setattr(swapped_in, "grad", torch.randn_like(swapped_in))),
            lambda: None,
        ]
        for _ in range(len(changes)):
            step()
        return [p.detach().clone() for p in params + [extra, swapped_in]], opt, len(rebuilt)

    with monkeypatch.context() as patch:
        patch.setattr(optim._GroupPlan, "valid_for", lambda self, optimizer, group: False)
        expected, ref_opt, ref_rebuilds = run(cached=False)
    got, opt, rebuilds = run(cached=True)
    assert rebuilds < ref_rebuilds  # the cached lists were used (else this test would compare a run with itself)
    for a, b in zip(got, expected):
        assert torch.equal(a, b)
    for p, q in zip(opt.param_groups[0]["params"], ref_opt.param_groups[0]["params"]):
        assert torch.equal(opt.state[p]["momentum_buffer"], ref_opt.state[q]["momentum_buffer"])


def test_cached_step_lists_let_go_of_a_replaced_state(backend):
    # After load_state_dict the old momentum buffers belong to nobody: the optimizer's cached lists must not keep
    # them alive (on a GPU that would be a second copy of every buffer).
    import gc
    import weakref
    params = make_params(SHAPES[:2])
    opt = NormalizedSGD(params, lr=0.1)
    for _ in range(2):
        for p in params:
            p.grad = torch.randn_like(p)
        opt.step()
    old = weakref.ref(opt.state[params[0]]["momentum_buffer"])
    opt.load_state_dict(copy.deepcopy(opt.state_dict()))
    opt.step()
    gc.collect()
    assert old() is None


def test_a_step_under_fake_tensor_mode_leaves_later_real_steps_alone(backend):
    # torch.compile and the registration tests step optimizers on FakeTensors; nothing made then (an lr tensor
    # kept for later steps, say) may reach a real step afterwards. The fake step takes the lr of the real steps
    # that follow (check_each_step_moves_the_group_by_lr's 0.3), so a cache keyed by lr would hand them its tensor.
    from torch._subclasses.fake_tensor import FakeTensorMode
    with FakeTensorMode():
        fake = make_params(SHAPES[:2])
        fake_opt = NormalizedSGD(fake, lr=0.3)
        for p in fake:
            p.grad = torch.randn_like(p)
        fake_opt.step()
    check_each_step_moves_the_group_by_lr(torch.float32, "cpu")


def test_fused_step_is_deterministic():
    needs_native()
    runs = []
    for _ in range(2):
        torch.manual_seed(5)
        params = [torch.nn.Parameter(torch.randn(s)) for s in [(300000,), (70001,), (5,)]]
        opt = NormalizedSGD(params, lr=0.1, fused=True)
        for _ in range(3):
            for p in params:
                p.grad = torch.randn_like(p)
            opt.step()
        runs.append(params)
    for p, q in zip(*runs):
        assert torch.equal(p, q)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(lr=-0.1), "lr"),
        (dict(lr=float("nan")), "lr"),
        (dict(lr=float("inf")), "lr"),
        (dict(lr=0.1, momentum=1.0), "momentum"),
        (dict(lr=0.1, momentum=-0.5), "momentum"),
        (dict(lr=0.1, eps=-1e-8), "eps"),
        (dict(lr=0.1, weight_decay=-0.1), "weight_decay"),
        (dict(lr=0.1, norm="layer"), "norm"),
        (dict(lr=torch.tensor([0.1, 0.2])), "lr"),
        (dict(lr=0.1, fused=True, foreach=True), "mutually exclusive"),
    ],
)
def test_bad_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        NormalizedSGD([torch.nn.Parameter(torch.zeros(2))], **kwargs)


def test_bad_param_group_override():
    opt = NormalizedSGD([torch.nn.Parameter(torch.zeros(2))], lr=0.1)
    with pytest.raises(ValueError, match="momentum"):
        opt.add_param_group(dict(params=[torch.nn.Parameter(torch.zeros(2))], momentum=1.5))
    # The refused group is not kept: a caller that catches the error must not step it (with lr=-1, uphill).
    bad = torch.nn.Parameter(torch.ones(2))
    with pytest.raises(ValueError, match="lr"):
        opt.add_param_group(dict(params=[bad], lr=-1.0))
    assert len(opt.param_groups) == 1
    bad.grad = torch.ones(2)
    opt.step()
    assert torch.equal(bad.detach(), torch.ones(2))


def test_numbers_of_any_real_type_and_a_clear_type_error(backend):
    # numpy's scalars are numbers, as torch.optim.SGD and dro_loss take them; a string is a TypeError naming lr.
    import numpy as np

    def run(lr, momentum):
        p = torch.nn.Parameter(torch.arange(3.0))
        opt = NormalizedSGD([p], lr=lr, momentum=momentum)
        for g in ([1.0, 0.0, 2.0], [0.5, -1.0, 0.0]):
            p.grad = torch.tensor(g)
            opt.step()
        return p.detach()

    want = run(0.25, 0.5)
    assert torch.equal(run(np.float32(0.25), np.float64(0.5)), want)
    assert torch.equal(run(np.float16(0.25), np.float32(0.5)), want)
    assert torch.equal(run(np.int64(1), 0.5), run(1.0, 0.5))
    with pytest.raises(TypeError, match="lr must be a number"):
        NormalizedSGD([torch.nn.Parameter(torch.zeros(2))], lr="0.1")


@pytest.mark.parametrize("foreach", [None, True], ids=["default", "foreach"])
@pytest.mark.parametrize("option,value,match", [
    ("momentum", 1.5, r"momentum must be in \[0, 1\)"),
    ("eps", -1.0, "eps must be a finite number >= 0"),
    ("eps", math.inf, "eps must be a finite number >= 0"),
    ("weight_decay", -1.0, "weight_decay must be a finite number >= 0"),
    ("norm", "layer", "norm must be 'global' or 'tensor'"),
], ids=["momentum", "eps", "eps-inf", "weight_decay", "norm"])
def test_an_option_set_after_construction_is_checked_at_the_step(backend, foreach, option, value, match):
    """Set on a group after construction, an option the constructor refuses is refused by the step, with the same
    error on the fused op and on the foreach step (which took eps=-1 or norm='layer' without a word)."""
    p = torch.nn.Parameter(torch.ones(2))
    opt = NormalizedSGD([p], lr=0.1, foreach=foreach)
    opt.param_groups[0][option] = value
    p.grad = torch.ones(2)
    with pytest.raises(ValueError, match=match):
        opt.step()
    assert torch.equal(p.detach(), torch.ones(2))


_REFUSED_OPTIONS = {"momentum": 1.0, "eps": -1.0, "weight_decay": math.nan, "norm": "layer", "lr": -0.5,
                    "lr-nan": math.nan}


@pytest.mark.parametrize("foreach", [None, True], ids=["default", "foreach"])
@pytest.mark.parametrize("case,tensor_momentum",
                         [(case, False) for case in _REFUSED_OPTIONS]
                         # beside a tensor momentum, and the momentum refused as a tensor: the fused op took a tensor
                         # option and refused it itself, after the groups before its own had stepped
                         + [(case, True) for case in _REFUSED_OPTIONS])
def test_a_refused_option_of_one_group_steps_no_group(backend, foreach, case, tensor_momentum):
    """A later group's option refused at the step (a momentum schedule that reached 1, say) left the groups before
    it stepped: a caller that caught the error, set the option right and stepped again stepped them twice. Every
    group's options are now checked before any group steps, numbers and tensors alike."""
    option, value = case.removesuffix("-nan"), _REFUSED_OPTIONS[case]
    if tensor_momentum and option == "momentum":
        value = torch.tensor(value)
    first, second = torch.nn.Parameter(torch.ones(3)), torch.nn.Parameter(torch.ones(2))
    momentum = torch.tensor(0.9) if tensor_momentum else 0.9
    opt = NormalizedSGD([dict(params=[first]), dict(params=[second])], lr=0.1, momentum=momentum, foreach=foreach)
    right = opt.param_groups[1][option]
    opt.param_groups[1][option] = value
    first.grad, second.grad = torch.ones(3), torch.ones(2)
    with pytest.raises(ValueError, match=f"{option} must be"):
        opt.step()
    assert torch.equal(first.detach(), torch.ones(3)) and torch.equal(second.detach(), torch.ones(2))
    assert all(float(opt.state[p].get("step", 0.0)) == 0.0 for p in (first, second))
    opt.param_groups[1][option] = right
    opt.step()
    once = [torch.nn.Parameter(torch.ones(3)), torch.nn.Parameter(torch.ones(2))]
    reference = NormalizedSGD([dict(params=[once[0]]), dict(params=[once[1]])], lr=0.1, momentum=momentum,
                              foreach=foreach)
    once[0].grad, once[1].grad = torch.ones(3), torch.ones(2)
    reference.step()
    assert torch.equal(first.detach(), once[0].detach()) and torch.equal(second.detach(), once[1].detach())
    assert float(opt.state[first]["step"]) == 1.0


@pytest.mark.parametrize("foreach", [None, True], ids=["default", "foreach"])
@pytest.mark.parametrize("value", [-0.5, math.nan, math.inf], ids=["negative", "nan", "inf"])
def test_an_lr_set_after_construction_is_checked_at_the_step(backend, foreach, value):
    """A number set as lr after construction (by hand, by a scheduler's bug): a negative one stepped uphill and a NaN
    one made the params NaN, on either step, where the constructor refuses both."""
    p = torch.nn.Parameter(torch.ones(2))
    opt = NormalizedSGD([p], lr=0.1, foreach=foreach)
    opt.param_groups[0]["lr"] = value
    p.grad = torch.ones(2)
    with pytest.raises(ValueError, match="lr must be a finite number >= 0.0"):
        opt.step()
    assert torch.equal(p.detach(), torch.ones(2))


@pytest.mark.parametrize("foreach", [None, True], ids=["default", "foreach"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float16], ids=["to-float64", "to-float16"])
def test_a_model_cast_after_a_step_steps_as_a_loaded_state_would(backend, foreach, dtype):
    """model.double() after a step casts each param in place (the same object): the fused step refused the float32
    momentum it had made ("momenta[0] must match params[0]") where the foreach step carried it on in float32. Both
    now cast the momentum to the param, as load_state_dict casts a loaded one: the steps equal a resumed run's."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 2))
    opt = NormalizedSGD(model.parameters(), lr=0.1, foreach=foreach)
    x = torch.randn(5, 3)
    model(x).square().sum().backward()
    opt.step()
    resumed_model = copy.deepcopy(model).to(dtype)
    resumed = NormalizedSGD(resumed_model.parameters(), lr=0.1, foreach=foreach)
    resumed.load_state_dict(opt.state_dict())
    model.to(dtype)
    for m, o in ((model, opt), (resumed_model, resumed)):
        for _ in range(2):
            o.zero_grad()
            m(x.to(dtype)).square().sum().backward()
            o.step()
    for p, q in zip(model.parameters(), resumed_model.parameters()):
        assert p.dtype == dtype and torch.equal(p.detach(), q.detach())
        assert opt.state[p]["momentum_buffer"].dtype == dtype
        assert torch.equal(opt.state[p]["momentum_buffer"], resumed.state[q]["momentum_buffer"])


@pytest.mark.parametrize("foreach", [None, True], ids=["default", "foreach"])
def test_hyperparameters_of_a_narrow_type_act_at_the_value_given(backend, foreach):
    """lr, momentum and weight_decay given as float32 or float16 numbers (numpy scalars, 0-d tensors) act at the value
    they hold, in float64 as the fused op reads them: the foreach step formed 1 - lr * weight_decay in the number's
    own dtype (an error of 2e-4 on a float64 param for a float16 weight_decay, 4e-8 for a float32 lr)."""
    import numpy as np

    def run(lr, momentum, weight_decay):
        p = torch.nn.Parameter(torch.linspace(1.0, 2.0, 5, dtype=torch.float64))
        opt = NormalizedSGD([p], lr=lr, momentum=momentum, weight_decay=weight_decay, eps=0.0, foreach=foreach)
        for g in ([1.0, 0.0, 2.0, 0.0, 0.5], [0.5, -1.0, 0.0, 3.0, 1.0]):
            p.grad = torch.tensor(g, dtype=torch.float64)
            opt.step()
        return p.detach()

    def reference(lr, momentum, weight_decay):
        p, m = torch.linspace(1.0, 2.0, 5, dtype=torch.float64), None
        for g in ([1.0, 0.0, 2.0, 0.0, 0.5], [0.5, -1.0, 0.0, 3.0, 1.0]):
            g = torch.tensor(g, dtype=torch.float64)
            m = g if m is None else momentum * m + (1 - momentum) * g
            p = (1 - lr * weight_decay) * p - lr * m / m.norm()
        return p

    for lr, momentum, weight_decay in ((np.float32(0.3), np.float32(0.7), np.float32(0.1)),
                                       (0.3, 0.7, torch.tensor(0.1, dtype=torch.float16)),
                                       (torch.tensor(0.3), 0.7, torch.tensor(0.1))):
        values = [float(v) for v in (lr, momentum, weight_decay)]
        torch.testing.assert_close(run(lr, momentum, weight_decay), reference(*values), rtol=4e-16, atol=0)


def test_a_loaded_state_keeps_this_optimizers_implementation():
    """fused and foreach are how this process steps, not what the run learned: torch.optim's load took the saved
    ones, so a checkpoint saved with fused=True overrode foreach=True, and raised at the first step of a process
    whose native ops are off (a machine without the built extension, DRO_EXT_FORCE_PYTHON=1)."""
    needs_native()

    def trained(**implementation):
        p = torch.nn.Parameter(torch.arange(4.0))
        opt = NormalizedSGD([p], lr=0.1, **implementation)
        for k in range(3):
            p.grad = torch.full((4,), float(k + 1)) - p.detach()
            opt.step()
        return p, opt

    saved_param, saved_opt = trained(fused=True)
    fused_state = copy.deepcopy(saved_opt.state_dict())
    results = []
    for implementation, backend_name in ((dict(foreach=True), "native"), (dict(), "python"), (dict(), "native")):
        p = torch.nn.Parameter(saved_param.detach().clone())
        opt = NormalizedSGD([p], lr=0.5, **implementation)
        opt.load_state_dict(copy.deepcopy(fused_state))  # (a loaded state is not copied: as torch.optim's)
        group = opt.param_groups[0]
        assert (group["fused"], group["foreach"]) == (None, implementation.get("foreach")), group
        assert group["lr"] == 0.1  # the run's settings are the checkpoint's
        p.grad = torch.ones(4)
        with _backend.forced_backend(backend_name):
            opt.step()
        results.append(p.detach())
    for result in results[1:]:
        torch.testing.assert_close(result, results[0], rtol=1e-6, atol=1e-7)


def test_a_state_dict_it_did_not_save_is_named_at_the_step(backend):
    """torch.optim.SGD's state_dict (no step count), a momentum of another shape: a clear error on either step (a bare
    KeyError, or on the fallback a broadcasting error, before); a Python number as the step count is taken."""
    p, q = torch.nn.Parameter(torch.ones(3)), torch.nn.Parameter(torch.ones(2))
    sgd = torch.optim.SGD([p, q], lr=0.1, momentum=0.9)
    p.grad, q.grad = torch.ones(3), torch.ones(2)
    sgd.step()
    opt = NormalizedSGD([p, q], lr=0.1)
    opt.load_state_dict(sgd.state_dict())
    with pytest.raises(ValueError, match="state of param 0 of its group has no 'momentum_buffer' tensor and 'step'"):
        opt.step()
    opt = NormalizedSGD([p, q], lr=0.1)
    opt.step()
    saved = copy.deepcopy(opt.state_dict())
    saved["state"][1]["momentum_buffer"] = torch.ones(5)
    opt = NormalizedSGD([p, q], lr=0.1)
    opt.load_state_dict(saved)
    with pytest.raises(ValueError, match=r"momentum_buffer of param 1 of its group has shape \(5,\), the param \(2,\)"):
        opt.step()
    saved["state"][1]["momentum_buffer"] = torch.ones(2)
    saved["state"][0]["step"] = 3.0
    opt = NormalizedSGD([p, q], lr=0.1)
    opt.load_state_dict(saved)
    opt.step()
    assert float(opt.state[p]["step"]) == 4.0 and float(opt.state[q]["step"]) == 2.0


@pytest.mark.parametrize("foreach", [None, True], ids=["default", "foreach"])
def test_a_loaded_state_takes_the_defaults_and_step_counts_of_any_dtype(backend, foreach):
    """A state_dict that torch.optim.SGD saved without momentum has no state and groups without eps (a bare KeyError
    at the step before); a step count saved as an int64, float64 or float16 tensor (another optimizer's, a converted
    checkpoint) raised on the fused step and inside torch on the foreach one. Both now step as a fresh state would."""
    p = torch.nn.Parameter(torch.ones(3))
    sgd = torch.optim.SGD([p], lr=0.1)
    opt = NormalizedSGD([p], lr=0.1, foreach=foreach)
    opt.load_state_dict(sgd.state_dict())
    assert opt.param_groups[0]["eps"] == dro_ext.optim.DEFAULT_EPS and opt.param_groups[0]["weight_decay"] == 0.0
    p.grad = torch.tensor([3.0, 0.0, 4.0])
    opt.step()
    torch.testing.assert_close(p.detach(), torch.tensor([1.0 - 0.1 * 0.6, 1.0, 1.0 - 0.1 * 0.8]), rtol=1e-6, atol=0)
    for dtype in (torch.int64, torch.float64, torch.float16):
        saved = copy.deepcopy(opt.state_dict())
        saved["state"][0]["step"] = torch.tensor([2], dtype=dtype)
        resumed = NormalizedSGD([p], lr=0.1, foreach=foreach)
        resumed.load_state_dict(saved)
        resumed.step()
        step = resumed.state[p]["step"]
        assert step.dtype == torch.float32 and step.shape == () and float(step) == 3.0, (dtype, step)


def test_maximize_must_be_a_bool():
    with pytest.raises(TypeError, match="maximize must be a bool"):
        NormalizedSGD([torch.nn.Parameter(torch.ones(2))], lr=0.1, maximize=1)


@pytest.mark.parametrize("foreach", [None, True], ids=["default", "foreach"])
def test_a_param_given_twice_is_refused_by_every_step(backend, foreach):
    """torch.optim only warns of a param given twice in a group; the fused op refuses it (it would update it twice),
    and so does the foreach step now (it did update it twice: momentum 2g, two counts a step)."""
    p, q = torch.nn.Parameter(torch.ones(3)), torch.nn.Parameter(torch.ones(2))
    with pytest.warns(UserWarning, match="duplicate parameters"):
        opt = NormalizedSGD([p, q, p], lr=0.1, foreach=foreach)
    p.grad, q.grad = torch.ones(3), torch.ones(2)
    with pytest.raises(ValueError, match=r"params\[0\] and params\[2\] of param group 0 share memory"):
        opt.step()
    assert torch.equal(p.detach(), torch.ones(3)) and torch.equal(q.detach(), torch.ones(2))


def test_native_op_rejects_mismatched_lists():
    needs_native()
    p, g, m = torch.zeros(3), torch.zeros(4), torch.zeros(3)
    step, lr = torch.zeros(()), torch.tensor(0.1)
    with pytest.raises(ValueError, match="grads"):
        torch.ops.dro_ext.normalized_sgd_step_([p], [g], [m], [step], lr, 0.9, 0.0)
    with pytest.raises(ValueError, match="same length"):
        torch.ops.dro_ext.normalized_sgd_step_([p], [], [m], [step], lr, 0.9, 0.0)
    with pytest.raises(ValueError, match="norm"):
        torch.ops.dro_ext.normalized_sgd_step_([p], [p], [m], [step], lr, 0.9, 0.0, 0.0, "layer")


def test_native_op_rejects_a_tensor_given_twice():
    # The step updates params, momenta and steps in place (the CUDA kernel from blocks that run at once): a tensor
    # given twice in one of those lists is an error naming both places; grads are only read and may repeat.
    needs_native()
    p, q, m, n = torch.zeros(3), torch.zeros(2), torch.zeros(3), torch.zeros(2)
    g = torch.ones(3)
    step, lr = torch.zeros(()), torch.tensor(0.1)
    with pytest.raises(ValueError, match=r"steps\[0\] and steps\[1\] share memory"):
        torch.ops.dro_ext.normalized_sgd_step_([p, q], [g, g[:2]], [m, n], [step, step], lr, 0.9, 0.0)
    with pytest.raises(ValueError, match=r"params\[0\] and params\[2\] share memory"):
        torch.ops.dro_ext.normalized_sgd_step_([p, q, p], [g, g[:2], g], [m, n, m.clone()],
                                               [step, torch.zeros(()), torch.zeros(())], lr, 0.9, 0.0)
    with pytest.raises(ValueError, match=r"momenta\[0\] and momenta\[1\] share memory"):
        torch.ops.dro_ext.normalized_sgd_step_([p, p.clone()], [g, g], [m, m], [step, torch.zeros(())], lr, 0.9, 0.0)
    # Nothing was touched by the refused calls; the same call with distinct tensors runs (the same grad twice too).
    assert float(step) == 0.0 and not p.any() and not m.any()
    torch.ops.dro_ext.normalized_sgd_step_([p, q], [g, g[:2]], [m, n], [step, torch.zeros(())], lr, 0.9, 0.0)
    assert float(step) == 1.0 and p.ne(0).all()
    # Empty tensors hold no memory to share.
    e1, e2 = torch.zeros(0), torch.zeros(0)
    torch.ops.dro_ext.normalized_sgd_step_([e1, e2], [e1, e2], [torch.zeros(0), torch.zeros(0)],
                                           [torch.zeros(()), torch.zeros(())], lr, 0.9, 0.0)


def _op_args(grad_scale=None, found_inf=None, norm="global"):
    shapes = [(1,), (7, 3), (100,)]
    dtypes = [torch.float32, torch.float64, torch.bfloat16]
    params = [torch.randn(s, dtype=d) for s, d in zip(shapes, dtypes)]
    grads = [torch.randn_like(p) for p in params]
    momenta = [torch.randn_like(p) for p in params]
    steps = [torch.tensor(float(i)) for i in range(len(params))]
    return (params, grads, momenta, steps, torch.tensor(0.1, dtype=torch.float64), 0.9, 1e-8, 0.01, norm, False,
            grad_scale, found_inf)


@pytest.mark.parametrize(
    "args",
    [_op_args(), _op_args(norm="tensor"), _op_args(grad_scale=torch.tensor([4.0]), found_inf=torch.tensor([0.0])),
     _op_args(grad_scale=torch.tensor([4.0]), found_inf=torch.tensor([1.0]))],
    ids=["global", "tensor", "scaled", "skipped"],
)
def test_opcheck(args):
    needs_native()
    torch.library.opcheck(torch.ops.dro_ext.normalized_sgd_step_.default, args)


def assert_compiled_steps_follow_eager(make_optimizer, steps, compile_options, before_step=None) -> None:
    """``steps`` steps of a fresh (params, optimizer) from make_optimizer(), eager and then with
    torch.compile(opt.step, **compile_options), on the same random gradients: the same parameters.
    before_step(opt, i) runs before step i (a scheduler's change, say). Tracing the step warns of nothing in it
    that Dynamo cannot honour (a functools.lru_cache it traces through, for one)."""
    torch._dynamo.reset()
    results = []
    for compiled in (False, True):
        torch.manual_seed(6)
        params, opt = make_optimizer()
        step = torch.compile(opt.step, **compile_options) if compiled else opt.step
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for i in range(steps):
                if before_step is not None:
                    before_step(opt, i)
                for p in params:
                    p.grad = torch.randn_like(p)
                step()
        dynamo_warnings = [str(w.message) for w in caught if "Dynamo" in str(w.message)]
        assert not dynamo_warnings, dynamo_warnings
        results.append(params)
    for p, q in zip(*results):
        # float64 to float64's rounding: a compiled step that ran float64 parameters in float32 was 2e-8 off
        tolerance = 1e-13 if p.dtype == torch.float64 else 1e-6
        torch.testing.assert_close(p, q, rtol=tolerance, atol=tolerance)


def two_group_optimizer(device="cpu"):
    params = make_params(SHAPES[:4], device=device)
    return params, NormalizedSGD([dict(params=params[:2]), dict(params=params[2:], norm="tensor")], lr=0.1,
                                 weight_decay=0.01)


def test_torch_compile_step(backend):
    # Inductor on the fused op (one custom op in the graph); aot_eager keeps the fallback's compile short.
    assert_compiled_steps_follow_eager(two_group_optimizer, 3, dict(
        backend="inductor" if backend == "native" else "aot_eager", fullgraph=backend == "native"))


@pytest.mark.parametrize("foreach", [None, True], ids=["default", "foreach"])
def test_a_compiled_step_keeps_each_dtype(backend, foreach):
    """One group of float64, float32 and bfloat16 parameters: compiled, the foreach step got them in one part without
    a dtype (Optimizer._group_tensors_by_device_and_dtype's, for Inductor) and ran the float64 ones in float32."""
    def mixed():
        params = [*make_params(SHAPES[1:3], torch.float64), *make_params(SHAPES[3:4]),
                  *make_params(SHAPES[:2], torch.bfloat16)]
        return params, NormalizedSGD(params, lr=0.1, weight_decay=0.01, foreach=foreach)

    assert_compiled_steps_follow_eager(mixed, 3, dict(backend="aot_eager", fullgraph=foreach is None))


@pytest.mark.parametrize("foreach", [None, True], ids=["default", "foreach"])
def test_a_step_compiled_again_after_the_model_is_cast_follows_it(backend, foreach):
    """A step compiled before model.double() and compiled again after it (torch._dynamo.reset(): Dynamo's guards do
    not see a param cast in place) refused the float32 momentum inside the traced step, where the eager step casts
    it; both now step as a run resumed from a state_dict into the float64 model."""
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    opt = NormalizedSGD(model.parameters(), lr=0.1, foreach=foreach)
    x = torch.randn(4, 3)
    torch._dynamo.reset()
    try:
        model(x).square().sum().backward()
        torch.compile(opt.step, backend="aot_eager")()
        resumed_model = copy.deepcopy(model).double()
        resumed = NormalizedSGD(resumed_model.parameters(), lr=0.1, foreach=foreach)
        resumed.load_state_dict(opt.state_dict())
        model.double()
        torch._dynamo.reset()
        step = torch.compile(opt.step, backend="aot_eager")
        for m, run_step in ((model, step), (resumed_model, resumed.step)):
            m.zero_grad()
            m(x.double()).square().sum().backward()
            run_step()
    finally:
        torch._dynamo.reset()
    for p, q in zip(model.parameters(), resumed_model.parameters()):
        assert opt.state[p]["momentum_buffer"].dtype == torch.float64
        torch.testing.assert_close(p.detach(), q.detach(), rtol=1e-15, atol=0)


def test_a_compiled_step_leaves_float64_parameters_alone_at_lr_0(backend):
    p = torch.nn.Parameter(torch.tensor([1.0 + 1e-10, 2.0 + 3e-12], dtype=torch.float64))
    opt = NormalizedSGD([p], lr=0.0, foreach=True)
    p.grad = torch.tensor([3.0, 4.0], dtype=torch.float64)
    torch._dynamo.reset()
    torch.compile(opt.step, backend="aot_eager")()
    assert p.tolist() == [1.0 + 1e-10, 2.0 + 3e-12]


@pytest.mark.parametrize("foreach", [None, True], ids=["default", "foreach"])
def test_a_compiled_step_follows_a_changing_lr_weight_decay_and_eps(backend, foreach):
    """A scheduler changes lr every step: the fused step baked each float lr into its graph (a recompile a step, and
    fullgraph=True failed at the recompile limit); the foreach step could not trace its check of a weight_decay or
    eps that changed (math.isfinite of a symbolic float). Both follow eager."""
    def one_group():
        params = make_params(SHAPES[:2])
        return params, NormalizedSGD(params, lr=0.1, weight_decay=0.01, foreach=foreach)

    def schedule(opt, i):
        opt.param_groups[0].update(lr=0.1 / (i + 1), weight_decay=0.01 * (i % 3), eps=1e-8 * (1 + i % 2))

    assert_compiled_steps_follow_eager(one_group, 10, dict(
        backend="aot_eager", fullgraph=backend == "native" and foreach is None), before_step=schedule)


def test_an_inductor_compiled_foreach_step_follows_a_changing_momentum_and_lr(backend):
    """A scheduler changing momentum and lr (OneCycleLR's way) under Inductor: the foreach step passed momentum and
    the weight decay's factor 1 - lr*wd to torch._foreach_mul_ as floats, whose example values (those of the first
    recompile) Inductor wrote into its kernel, so the compiled step kept them (a momentum update 0.8 m + 0.5 g)."""
    def one_group():
        params = make_params(SHAPES[:2])
        return params, NormalizedSGD(params, lr=0.1, momentum=0.9, weight_decay=0.1, foreach=True)

    def schedule(opt, i):
        opt.param_groups[0].update(lr=0.1 / (i + 1), momentum=0.9 - 0.1 * i)

    assert_compiled_steps_follow_eager(one_group, 5, dict(backend="inductor"), before_step=schedule)


@pytest.mark.parametrize("foreach", [None, True], ids=["default", "foreach"])
def test_a_one_element_lr_tensor_with_weight_decay_steps(backend, foreach):
    # An lr of shape (1,) (the docs take a one-element tensor) made a (1,) decay factor, which torch._foreach_mul_
    # refused ("scalar tensor expected to be 0 dim"); the fused op took it.
    want = make_params(SHAPES[:3])
    got = [p.detach().clone().requires_grad_() for p in want]
    steppers = (NormalizedSGD(want, lr=0.1, weight_decay=0.2, foreach=foreach),
                NormalizedSGD(got, lr=torch.tensor([0.1]), weight_decay=0.2, foreach=foreach))
    for _ in range(2):
        for opt, params in zip(steppers, (want, got)):
            for p in params:
                p.grad = torch.full_like(p, 0.5)
            opt.step()
    for p, q in zip(want, got):
        torch.testing.assert_close(q, p, rtol=0, atol=0)


@pytest.mark.parametrize("foreach", [None, True], ids=["default", "foreach"])
@pytest.mark.parametrize("views", ["one tensor twice", "overlapping", "one strided view twice", "a transpose"])
def test_parameters_on_shared_memory_are_refused_on_every_path(backend, foreach, views):
    # The foreach step compared Python objects, and updated shared elements twice; the fused op compared start
    # addresses only, and updated the elements two overlapping views share from two threads at once. Both now refuse
    # dense tensors whose spans meet and a strided view given twice, naming the params by their places in their group
    # (a frozen param before them has no gradient).
    memory = torch.ones(4, 40)
    first, second = {"one tensor twice": (memory, memory), "overlapping": (memory[:3], memory[2:]),
                     "one strided view twice": (memory[:, ::2], memory[:, ::2]),
                     "a transpose": (memory[1:], memory.t())}[views]
    frozen = torch.nn.Parameter(torch.ones(2))
    params = [frozen, torch.nn.Parameter(torch.zeros(0)), torch.nn.Parameter(first), torch.nn.Parameter(torch.ones(5)),
              torch.nn.Parameter(second), torch.nn.Parameter(torch.zeros(0))]
    other = torch.nn.Parameter(torch.ones(3))
    for p in [other, *params[1:]]:
        p.grad = torch.ones_like(p)
    opt = NormalizedSGD([dict(params=[other]), dict(params=params)], lr=0.1, foreach=foreach)
    with pytest.raises(ValueError, match=r"params\[2\] and params\[4\] of param group 1 share memory"):
        opt.step()
    assert torch.equal(memory, torch.ones(4, 40))


@pytest.mark.parametrize("foreach", [None, True], ids=["default", "foreach"])
@pytest.mark.parametrize("halves", ["rows", "columns", "every other column"])
def test_views_of_one_tensor_apart_step_as_separate_tensors(backend, foreach, halves):
    # Row halves hold spans that do not meet; column halves and interleaved columns share no element, and as in
    # ATen's overlap checks a view with gaps is not compared by span (no refusal where nothing is shared).
    memory = torch.ones(4, 40)
    views = {"rows": (memory[:2], memory[2:]), "columns": (memory[:, :20], memory[:, 20:]),
             "every other column": (memory[:, ::2], memory[:, 1::2])}[halves]
    params = [torch.nn.Parameter(view) for view in views]
    apart = [torch.nn.Parameter(view.clone()) for view in views]
    for group in (params, apart):
        for p in group:
            p.grad = torch.arange(80.0).reshape(p.shape)
        NormalizedSGD(group, lr=0.1, foreach=foreach).step()
    for p, q in zip(params, apart):
        assert torch.equal(p.detach(), q.detach())


def test_converges_on_example_3_1_where_sgd_momentum_diverges(backend):
    # Paper Example 3.1: l(x; xi) = x^2 (1 + xi/(x^2+1))^2, Rademacher xi, chi2 DRO with lambda = 1.
    # The objective grows like x^4 and its gradient noise like x, so from x = 10 a step size that SGD
    # with momentum survives only near the optimum throws it off, while normalized steps walk in.
    def train(make_optimizer, steps=400, batch=32):
        torch.manual_seed(7)
        x = torch.nn.Parameter(torch.tensor(10.0))
        criterion = dro_ext.DROLoss("chi2", lam=1.0)
        opt = make_optimizer([x, criterion.eta])
        for _ in range(steps):
            xi = torch.randint(0, 2, (batch,)).float() * 2 - 1
            losses = x ** 2 * (1 + xi / (x ** 2 + 1)) ** 2
            opt.zero_grad()
            criterion(losses).backward()
            opt.step()
            if not torch.isfinite(x):
                break
        return float(x.detach()), float(criterion.eta.detach())

    lr = 0.05
    x, eta = train(lambda p: dro_ext.NormalizedSGD(p, lr=lr, momentum=0.9))
    # The stationary point is (x, eta) = (0, 0); constant normalized steps settle within a few lr of it.
    assert abs(x) < 4 * lr and abs(eta) < 4 * lr
    x_sgd, _ = train(lambda p: torch.optim.SGD(p, lr=lr, momentum=0.9))
    assert not math.isfinite(x_sgd) or abs(x_sgd) > 1e3


def test_a_group_taken_out_of_param_groups_is_freed(backend):
    """param_groups.pop() then a step (or add_param_group): the group's kept step plan held its params and momenta
    alive for good (torch.optim.SGD frees them)."""
    kept, dropped = torch.nn.Parameter(torch.ones(3)), torch.nn.Parameter(torch.ones(4))
    opt = NormalizedSGD([{"params": [kept]}, {"params": [dropped]}], lr=0.1)
    for p in (kept, dropped):
        p.grad = torch.ones_like(p)
    opt.step()
    gone, gone_momentum = weakref.ref(dropped), weakref.ref(opt.state[dropped]["momentum_buffer"])
    opt.param_groups.pop()
    del opt.state[dropped], dropped, p
    opt.step()
    assert gone() is None and gone_momentum() is None
