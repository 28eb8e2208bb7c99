"""The native online Group DRO step (dro_ext::group_dro_step_ over group sums, dro_ext::group_dro_loss_ from the
losses; csrc/group_dro.cpp): against the PyTorch composition GroupDROLoss runs on the fallback, over state dtypes,
strides, masks, NaN and infinite losses and q far below its normals; the custom-op contract (opcheck), double
backward, the in-place update seen by autograd, and bad operands."""
import itertools
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import dro_ext
from dro_ext import _backend
from dro_ext import groups as groups_module

if not _backend.native_available() and not _backend._force_python:
    raise RuntimeError(f"dro_ext native extension failed to load: {_backend.load_error()}")
native_only = pytest.mark.skipif(not _backend.native_available(), reason="native extension not built")
BACKEND_NAMES = [pytest.param("native", marks=native_only), "python"]

CONFIGS = {
    "plain": dict(step_size=0.5),
    "stale": dict(step_size=0.5, missing="stale"),
    "adjusted-normalized": dict(step_size=2.0, normalize_loss=True, adjustment=torch.tensor([1.0, 0.5, 2.0, 0.0, 1.5]),
                                group_counts=torch.tensor([10.0, 40.0, 5.0, 100.0, 20.0])),
    "disabled": dict(step_size=0.5, q_init=torch.tensor([0.0, 1.0, 2.0, 0.0, 1.0]), ema_gamma=0.4),
}
STATE_DTYPES = [torch.float16, torch.bfloat16, torch.float32, torch.float64]
# How closely the native step (float64 arithmetic, rounded once into the state) follows the composition (in the
# wider of the state's and the losses' accumulate dtype): a few roundings of that dtype.
TOLERANCES = {torch.float16: (2e-2, 2e-3), torch.bfloat16: (6e-2, 1e-2), torch.float32: (1e-5, 1e-6),
              torch.float64: (1e-12, 1e-14)}


def batches(num_steps, n, num_groups, seed=0):
    """Batches with groups missing from some steps."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for step in range(num_steps):
        allowed = torch.tensor([g for g in range(num_groups) if (g + step) % 3 != 0 or step % 2])
        groups = allowed[torch.randint(len(allowed), (n,), generator=gen)]
        out.append((1.0 + torch.randn(n, generator=gen, dtype=torch.float64), groups))
    return out


def with_state_dtype(module, dtype):
    """The module with its state in dtype: a cast for float32 and float64; for 16-bit dtypes, which a cast of the
    module does not give the state (it keeps float32), what load_state_dict(assign=True) of a checkpoint saved in
    them leaves (the step takes any floating state)."""
    if dtype in (torch.float32, torch.float64):
        return module.to(dtype)
    state = {name: t.to(dtype) if t.is_floating_point() else t for name, t in module.state_dict().items()}
    module.load_state_dict(state, assign=True)
    assert module.log_q.dtype == dtype
    return module


def module_pair(num_groups, state_dtype, **kwargs):
    native, composed = dro_ext.GroupDROLoss(num_groups, **kwargs), dro_ext.GroupDROLoss(num_groups, **kwargs)
    return with_state_dtype(native, state_dtype), with_state_dtype(composed, state_dtype)


def run_step(module, losses, groups, backend, update=True, **kwargs):
    losses = losses.detach().clone().requires_grad_()
    with _backend.forced_backend(backend):
        value = module(losses, groups, update=update, **kwargs)
    (grad,) = torch.autograd.grad(value, losses)
    return value, grad


def assert_same_state(native, composed, rtol, atol):
    torch.testing.assert_close(native.q, composed.q, rtol=rtol, atol=atol)
    torch.testing.assert_close(native.ema_loss, composed.ema_loss, rtol=rtol, atol=atol)
    torch.testing.assert_close(native.last_loss, composed.last_loss, rtol=rtol, atol=atol)
    assert torch.equal(native.seen, composed.seen)


@native_only
@pytest.mark.parametrize("state_dtype", STATE_DTYPES, ids=str)
@pytest.mark.parametrize("losses_dtype", [torch.float32, torch.float64], ids=str)
@pytest.mark.parametrize("config", list(CONFIGS), ids=list(CONFIGS))
def test_native_step_follows_the_composition(config, losses_dtype, state_dtype):
    """q, the running means, the last means, seen, the value and the gradient over steps with missing groups and
    update=False steps, native against the fallback's composition, for every state dtype."""
    native, composed = module_pair(5, state_dtype, **CONFIGS[config])
    rtol, atol = TOLERANCES[state_dtype if state_dtype != torch.float64 else losses_dtype]
    for step, (losses, groups) in enumerate(batches(6, 13, 5)):
        losses = losses.to(losses_dtype)
        update = step % 3 != 2
        got, got_grad = run_step(native, losses, groups, "native", update)
        want, want_grad = run_step(composed, losses, groups, "python", update)
        assert got.dtype == want.dtype == losses_dtype
        torch.testing.assert_close(got, want, rtol=rtol, atol=atol)
        torch.testing.assert_close(got_grad, want_grad, rtol=rtol, atol=atol)
        assert_same_state(native, composed, rtol, atol)
    if "q_init" in CONFIGS[config]:
        assert torch.equal(native.q[CONFIGS[config]["q_init"] == 0], torch.zeros(2, dtype=state_dtype))


@native_only
def test_masked_step_and_strided_state_follow_the_composition():
    """With a mask (group_dro_step_ over the masked sums), and with the state in strided buffers (written in place
    through their strides)."""
    native, composed = module_pair(5, torch.float64, step_size=0.7, missing="stale")
    for name in ("log_q", "ema_loss", "last_loss", "seen"):
        buffer = native._buffers[name]
        strided = torch.empty(2 * buffer.numel(), dtype=buffer.dtype)[::2]
        native._buffers[name] = strided.copy_(buffer)
    gen = torch.Generator().manual_seed(3)
    for losses, groups in batches(5, 17, 5, seed=1):
        mask = torch.rand(17, generator=gen) < 0.7
        got, got_grad = run_step(native, losses, groups, "native", mask=mask)
        want, want_grad = run_step(composed, losses, groups, "python", mask=mask)
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-14)
        torch.testing.assert_close(got_grad, want_grad, rtol=1e-12, atol=1e-14)
        assert torch.equal(got_grad[~mask], torch.zeros_like(got_grad[~mask]))
        assert_same_state(native, composed, 1e-12, 1e-14)
    assert native._buffers["log_q"].stride() == (2,)


@native_only
def test_the_native_path_runs_the_fused_ops(monkeypatch):
    """GroupDROLoss calls group_dro_loss_ (one call a step) without a mask, group_dro_step_ with one, neither in
    greedy_cvar mode or on the fallback: the comparisons above compare two implementations."""
    calls = []
    for name in ("_group_dro_loss_op", "_group_dro_step_op"):
        op = getattr(groups_module, name)
        monkeypatch.setattr(groups_module, name,
                            lambda *a, _op=op, _name=name, **k: calls.append(_name) or _op(*a, **k))
    losses, groups = torch.rand(10), torch.randint(3, (10,))
    with _backend.forced_backend("native"):
        dro_ext.GroupDROLoss(3)(losses, groups)
        dro_ext.GroupDROLoss(3)(losses, groups, mask=losses > 0.5)
        dro_ext.GroupDROLoss(3, mode="greedy_cvar", alpha=0.5)(losses, groups)
    with _backend.forced_backend("python"):
        dro_ext.GroupDROLoss(3)(losses, groups)
    assert calls == ["_group_dro_loss_op", "_group_dro_step_op"]


class _TaggedTensor(torch.Tensor):
    """A tensor subclass that changes nothing: GroupDROLoss checks it in Python before its native call."""


@native_only
def test_tensor_subclasses_take_the_checked_call_to_the_same_step():
    """A plain tensor goes straight to the native op (which checks it); a subclass passes the Python checks first.
    Both give the same loss, gradient and state, bitwise, step after step."""
    plain, tagged = dro_ext.GroupDROLoss(5, step_size=0.5), dro_ext.GroupDROLoss(5, step_size=0.5)
    with _backend.forced_backend("native"):
        for losses, groups in batches(4, 13, 5):
            plain_value, plain_grad = run_step(plain, losses, groups, "native")
            tagged_value, tagged_grad = run_step(tagged, losses.as_subclass(_TaggedTensor), groups, "native")
            assert torch.equal(plain_value, tagged_value) and torch.equal(plain_grad, tagged_grad)
            assert_same_state(plain, tagged, 0.0, 0.0)
        with pytest.raises(TypeError, match="groups must be a torch.Tensor"):
            plain(losses, groups.tolist())
        with pytest.raises(TypeError, match="update must be a bool"):
            plain(losses, groups, update=1)


NOT_FINITE_CONFIGS = {**CONFIGS, "greedy": dict(mode="greedy_cvar", alpha=0.4, min_var_weight=0.2)}


@native_only
@pytest.mark.parametrize("backend_name", ["native", "python"])
@pytest.mark.parametrize("bad", [math.inf, math.nan, -math.inf], ids=["inf", "nan", "-inf"])
@pytest.mark.parametrize("state_dtype", [torch.float32, torch.float64], ids=str)
@pytest.mark.parametrize("config", list(NOT_FINITE_CONFIGS), ids=list(NOT_FINITE_CONFIGS))
def test_a_batch_with_a_loss_not_finite_takes_no_step(backend_name, bad, state_dtype, config):
    """A batch in which a present group's mean is infinite or NaN returns that inf or NaN (the value under the current
    q, with its gradient q_g / n_g) and leaves the state bitwise as it was, in every mode, so the run goes on as if
    the batch (which GradScaler, or the loop, skips) had not come. Taken into the state, one NaN loss made every q
    NaN for good, an infinite one its group's q NaN and every other 0 (inf - inf), and -inf its group's q 0 for good.
    A group of q = 0 (disabled) blocks the step as well: its running mean would become inf or NaN."""
    kwargs = NOT_FINITE_CONFIGS[config]
    module, untouched = (with_state_dtype(dro_ext.GroupDROLoss(5, **kwargs), state_dtype) for _ in range(2))
    data = batches(6, 23, 5, seed=3)
    for losses, groups in data[:2]:
        run_step(module, losses, groups, backend_name)
        run_step(untouched, losses, groups, backend_name)
    losses, groups = data[2]
    for where in (groups == 0, groups == 2):  # (group 0 is disabled in the "disabled" config)
        broken = torch.where(where & (torch.cumsum(where, 0) == 1), bad, losses)
        before = {name: t.clone() for name, t in module.state_dict().items()}
        value, grad = run_step(module, broken, groups, backend_name)
        for name, t in module.state_dict().items():
            assert torch.equal(t, before[name]), name
        want_value, want_grad = run_step(untouched, broken, groups, backend_name, update=False)
        torch.testing.assert_close(value, want_value, rtol=0, atol=0, equal_nan=True)
        torch.testing.assert_close(grad, want_grad, rtol=0, atol=0, equal_nan=True)
        assert value.isnan() if math.isnan(bad) or bool(module.q[groups[where][0]] == 0) else value == bad
        assert torch.isfinite(grad).all()
    for losses, groups in data[3:]:
        for one in (module, untouched):
            run_step(one, losses, groups, backend_name)
        for name, t in module.state_dict().items():
            assert torch.equal(t, untouched.state_dict()[name]), name


@native_only
@pytest.mark.parametrize("backend_name", ["native", "python"])
@pytest.mark.parametrize("config", list(NOT_FINITE_CONFIGS), ids=list(NOT_FINITE_CONFIGS))
def test_a_mean_past_the_states_range_takes_no_step(backend_name, config):
    """float64 losses whose group mean (1e39) is finite but past a float32 state's range: the state stored it as inf
    (its last and running means), and the next batches' q went NaN for good (missing="stale"), or greedy CVaR kept
    the whole weight on that group whatever came after. Such a batch now takes no step, as one of a mean not finite;
    its value and gradient are those under the current q, in float64."""
    kwargs = NOT_FINITE_CONFIGS[config]
    module, untouched = (dro_ext.GroupDROLoss(5, **kwargs) for _ in range(2))
    assert module.log_q.dtype == torch.float32
    data = batches(5, 23, 5, seed=4)
    for losses, groups in data[:2]:
        for one in (module, untouched):
            run_step(one, losses, groups, backend_name)
    losses, groups = data[2]
    broken = torch.where(groups == 2, 1e39, losses)
    before = {name: t.clone() for name, t in module.state_dict().items()}
    value, grad = run_step(module, broken, groups, backend_name)
    for name, t in module.state_dict().items():
        assert torch.equal(t, before[name]), name
    want_value, want_grad = run_step(untouched, broken, groups, backend_name, update=False)
    assert torch.equal(value, want_value) and torch.equal(grad, want_grad)
    assert value.dtype == torch.float64 and math.isfinite(float(value))
    for losses, groups in data[3:]:
        for one in (module, untouched):
            run_step(one, losses, groups, backend_name)
        assert torch.isfinite(module.q).all()
        for name, t in module.state_dict().items():
            assert torch.equal(t, untouched.state_dict()[name]), name


@native_only
@pytest.mark.parametrize("backend_name", ["native", "python"])
@pytest.mark.parametrize("state_dtype", [torch.float32, torch.float64], ids=str)
def test_a_step_beyond_the_range_puts_q_on_the_largest_scores(backend_name, state_dtype):
    """step_size * a_g overflows from finite scores (float64: 1e300 * 2e30, beyond the native step's double range;
    float32: 1e30 * 2e20, beyond the float32 composition's range): q_g exp(step_size a_g) / sum_h q_h exp(step_size
    a_h) in the limit, q on the groups of the largest score shared as their q was, a disabled group kept at 0,
    where inf - inf gave NaN. The same again on the next step, from that q, and on a step where a group now at
    q = 0 has the largest score (q = 0 stays 0: the live groups' x_g no longer all underflow to -inf)."""
    q_init = torch.tensor([0.1, 0.2, 0.6, 0.1, 0.0])
    step_size, scale = (1e300, 1e30) if state_dtype == torch.float64 else (1e30, 1e20)
    module = with_state_dtype(dro_ext.GroupDROLoss(5, step_size, q_init=q_init), state_dtype)
    prior = module.q[1:3] / module.q[1:3].sum()  # as the state holds it
    # group means (1, 2, 2, 2e-30, 3) * scale, the largest that of the disabled group 4
    losses = torch.tensor([1.0, 2.0, 1.5, 2.5, 2e-30, 3.0], dtype=state_dtype) * scale
    groups = torch.tensor([0, 1, 2, 2, 3, 4])
    zero = torch.zeros(1, dtype=state_dtype)
    for _ in range(2):
        value, grad = run_step(module, losses, groups, backend_name)
        torch.testing.assert_close(module.q, torch.cat([zero, prior, zero, zero]), rtol=1e-6, atol=0.0)
        torch.testing.assert_close(value, torch.tensor(2 * scale, dtype=state_dtype), rtol=1e-6, atol=0.0)
        torch.testing.assert_close(grad, torch.cat([zero, prior[:1], prior[1:] / 2, prior[1:] / 2, zero, zero]),
                                   rtol=1e-6, atol=0.0)
    # group 0 (now at q = 0) the largest, 9 * scale: the live groups 1 and 2 keep q; the value counts their losses
    value, grad = run_step(module, torch.cat([losses[:1] * 9, losses[1:]]), groups, backend_name)
    torch.testing.assert_close(module.q, torch.cat([zero, prior, zero, zero]), rtol=1e-6, atol=0.0)
    torch.testing.assert_close(value, torch.tensor(2 * scale, dtype=state_dtype), rtol=1e-6, atol=0.0)


@native_only
def test_a_float32_state_takes_a_step_size_past_float32_as_the_native_step_does():
    """step_size 1e39 (no float32) on a float32 state: the step is formed in float64 on both backends and rounded once
    into the state, so a group 1e-3 below the largest score goes to log q ~ -1e36 (a float32) and comes back when it
    leads by 1e-2 on the next step. Formed in float32, the fallback's step_size was inf: the group went to q = 0 for
    good and the two backends disagreed from the second step on."""
    modules = {b: dro_ext.GroupDROLoss(2, 1e39) for b in ("native", "python")}
    groups = torch.tensor([0, 1])
    for losses, expected_q in (([1.0, 1.001], [0.0, 1.0]), ([1.01, 1.0], [1.0, 0.0])):
        for backend_name, module in modules.items():
            value, _ = run_step(module, torch.tensor(losses), groups, backend_name)
            assert module.log_q.dtype == torch.float32
            torch.testing.assert_close(module.q, torch.tensor(expected_q), rtol=0.0, atol=0.0, msg=backend_name)
            torch.testing.assert_close(value, torch.tensor(max(losses)), msg=backend_name)
        torch.testing.assert_close(modules["python"].log_q, modules["native"].log_q, rtol=1e-6, atol=0.0)


@native_only
@settings(max_examples=150, deadline=None)
@given(num_groups=st.integers(1, 8), log10_step=st.floats(-3, 305), log10_scale=st.floats(-5, 35),
       normalize_loss=st.booleans(), stale=st.booleans(), disabled=st.booleans(), seed=st.integers(0, 2**31 - 1))
def test_native_and_fallback_steps_agree_and_stay_a_distribution_at_any_scale(num_groups, log10_step, log10_scale,
                                                                              normalize_loss, stale, disabled, seed):
    """Three float64 steps at step sizes up to 1e305 and losses up to 1e35 (step_size * a_g far past the double
    range), some groups absent, one disabled: the native step and the composition give the same finite value and
    q, a distribution, however far the step size takes log q."""
    gen = torch.Generator().manual_seed(seed)
    q_init = torch.ones(num_groups, dtype=torch.float64)
    if disabled and num_groups > 1:
        q_init[0] = 0.0
    kwargs = dict(normalize_loss=normalize_loss, missing="stale" if stale else "zero", q_init=q_init)
    modules = {b: dro_ext.GroupDROLoss(num_groups, 10.0 ** log10_step, **kwargs).double() for b in ("native", "python")}
    for _ in range(3):
        n = int(torch.randint(1, 3 * num_groups + 2, (), generator=gen))
        groups = torch.randint(num_groups, (n,), generator=gen)
        losses = torch.rand(n, generator=gen, dtype=torch.float64) * 10.0 ** log10_scale
        values = {}
        for backend_name, module in modules.items():
            with _backend.forced_backend(backend_name):
                values[backend_name] = module(losses, groups)
        q = modules["native"].q
        assert torch.isfinite(values["native"]) and torch.isfinite(q).all(), (values, q)
        assert math.isclose(float(q.sum()), 1.0, rel_tol=1e-12), q
        torch.testing.assert_close(q, modules["python"].q, rtol=1e-9, atol=1e-12)
        # (atol: a value of q_g m_g with q_g subnormal, 5e-324 x 5 = 2.5e-323 in the composition, is 0 natively)
        torch.testing.assert_close(values["native"], values["python"], rtol=1e-9,
                                   atol=torch.finfo(torch.float64).tiny)


@native_only
@pytest.mark.parametrize("backend_name", ["native", "python"])
def test_log_q_stays_normalized_after_steps_far_past_its_float_spacing(backend_name):
    """x = (0, -1e17) + 1e17 * (scores less their largest) ties at -1e17: q = (1/2, 1/2), log q = -log 2 each. The
    log-sum-exp formed as shift + log(sum), -1e17 + log 2, loses the log 2 and stored log q = 0 twice (q summing to
    2); formed as (x - shift) - log(sum) it keeps it."""
    with _backend.forced_backend(backend_name):
        module = dro_ext.GroupDROLoss(2, 1e17).double()
        with torch.no_grad():
            module.log_q.copy_(torch.tensor([0.0, -1e17], dtype=torch.float64))
        value = module(torch.tensor([1.0, 2.0], dtype=torch.float64), torch.tensor([0, 1]))
    torch.testing.assert_close(module.log_q, torch.full((2,), -math.log(2.0), dtype=torch.float64), rtol=1e-15,
                               atol=0.0)
    assert math.isclose(float(value), 1.5, rel_tol=1e-15)


@native_only
@pytest.mark.parametrize("backend_name", ["native", "python"])
def test_a_group_at_q_zero_stays_there_and_its_nan_loss_reaches_the_value(backend_name):
    """A live group whose q is exactly 0 (log q = -inf) keeps it whatever its score, infinite or NaN included (its
    -inf + step_size * a_g is never formed): a huge finite loss in the batch, or, absent from it, a stale score from
    a loaded last mean of inf or NaN (a batch whose mean is not finite takes no step at all). The value
    sum_g q_g m_g still carries a NaN or infinite m_g of the batch (0 * NaN, 0 * inf)."""
    with _backend.forced_backend(backend_name):
        module = dro_ext.GroupDROLoss(3, 0.5, missing="stale").double()
        for bad in (math.inf, math.nan, 1e300):
            module.reset_parameters()
            with torch.no_grad():
                module.log_q.copy_(torch.tensor([-math.inf, math.log(0.25), math.log(0.75)], dtype=torch.float64))
            before = module.log_q.clone()
            value = module(torch.tensor([bad, 1.0, 1.0], dtype=torch.float64), torch.tensor([0, 1, 2]))
            assert module.q[0] == 0 and torch.isfinite(module.log_q[1:]).all()
            torch.testing.assert_close(module.q[1:], torch.tensor([0.25, 0.75], dtype=torch.float64), rtol=1e-12,
                                       atol=0.0)
            if bad == 1e300:
                assert math.isclose(float(value), 1.0, rel_tol=1e-15)  # 0 * 1e300 + 0.25 + 0.75
            else:
                assert math.isnan(float(value))
                assert torch.equal(module.log_q, before)  # no step taken
            with torch.no_grad():  # group 0's loaded last mean; absent from the batch, it scores it
                module.last_loss[0] = bad
            value = module(torch.tensor([1.0, 1.0], dtype=torch.float64), torch.tensor([1, 2]))
            assert module.q[0] == 0, module.log_q
            torch.testing.assert_close(module.q[1:], torch.tensor([0.25, 0.75], dtype=torch.float64), rtol=1e-12,
                                       atol=0.0)
            assert math.isclose(float(value), 1.0, rel_tol=1e-15)


@native_only
@pytest.mark.parametrize("dtype,log_q", [(torch.float32, -50.0), (torch.float64, -700.0)], ids=["float32", "float64"])
def test_negligible_q_weigh_nothing_but_keep_their_log(dtype, log_q):
    """A group whose q lies below the dtype's normals (after the division by the counts) gets weight 0 in the loss
    and gradient (no subnormal arithmetic), while log q keeps its value: the group can come back."""
    module = dro_ext.GroupDROLoss(3, 1.0).to(dtype)
    with torch.no_grad():
        module.log_q.copy_(torch.tensor([log_q, -0.5, -1.0], dtype=dtype))
        module.log_q.sub_(torch.logsumexp(module.log_q, 0))
    before = module.log_q.clone()
    losses = torch.tensor([1.0, 2.0, 3.0, 1.0], dtype=dtype, requires_grad=True)
    groups = torch.tensor([0, 1, 2, 0])
    with _backend.forced_backend("native"):
        value = module(losses, groups, update=False)
    (grad,) = torch.autograd.grad(value, losses)
    assert grad[0] == 0 and grad[3] == 0 and (grad[1:3] > 0).all()
    assert torch.equal(module.log_q, before)
    q = before.double().exp()
    torch.testing.assert_close(value.double(), q[1] * 2.0 + q[2] * 3.0, rtol=1e-6, atol=0)


def assert_a_dropped_groups_term_still_counts(device, backend_name):
    """A group whose q the native step drops from the loss (below e^-44 for a float32 loss, e^-660 for float64) still
    counts where its mean makes q m large: training had all but dropped group 0 (log q = -50 or -700), whose mean
    then blows up (1e25, 1e305). Its term was missing from the native value (1.0 against 1929.75); its gradient
    weight, q / n, stays dropped. With update=False and with a step too small to move q much."""
    for dtype, log_q0, big in ((torch.float32, -50.0, 1e25), (torch.float64, -700.0, 1e305)):
        for update in (False, True):
            for sign in (1.0, -1.0):
                module = dro_ext.GroupDROLoss(3, 1e-3 / big).to(device=device, dtype=dtype)  # a step of 1e-3
                with torch.no_grad():
                    module.log_q.copy_(torch.tensor([log_q0, -0.5, -1.0], dtype=dtype))
                    module.log_q.sub_(torch.logsumexp(module.log_q.double(), 0).to(dtype))
                losses = torch.tensor([sign * big, 2.0, 3.0, sign * big], dtype=dtype, device=device)
                groups = torch.tensor([0, 1, 2, 0], device=device)
                with _backend.forced_backend(backend_name):
                    value = module(losses, groups, update=update)
                q = module.log_q.double().exp().cpu()  # the q the value is taken under (after the step)
                want = q[0] * sign * big + q[1] * 2.0 + q[2] * 3.0
                assert abs(q[0] * big) > 1.0  # (the term matters)
                torch.testing.assert_close(value.double().cpu(), want, rtol=1e-6, atol=0.0,
                                           msg=f"{dtype} update={update} sign={sign}")


@pytest.mark.parametrize("backend_name", BACKEND_NAMES)
def test_a_dropped_groups_term_still_counts_where_its_mean_is_large(backend_name):
    assert_a_dropped_groups_term_still_counts("cpu", backend_name)


def assert_scores_past_float64s_range_from_finite_parts(device, backend_name):
    """A live group's score (mean plus adjustment) can pass float64's range though both are finite: the step took
    that infinite largest score off it (inf - inf), and log q stayed NaN for every later batch. Such a batch takes no
    step, as one with a mean not finite; the next batch steps as usual. With normalize_loss, finite scores can sum
    past the range: the step divided by that infinite sum and q stood still; it follows the scores' shares."""
    groups = torch.tensor([0, 1], device=device)
    module = dro_ext.GroupDROLoss(2, adjustment=[1e308, 0.0], group_counts=[1.0, 1.0]).to(device, torch.float64)
    before = {name: t.clone() for name, t in module.state_dict().items()}
    with _backend.forced_backend(backend_name):
        value = module(torch.tensor([1e308, 1.0], dtype=torch.float64, device=device), groups)
    for name, t in module.state_dict().items():
        assert torch.equal(t, before[name]), name
    q = module.q.double().cpu()
    assert math.isclose(float(value), float(q[0] * 1e308 + q[1]), rel_tol=1e-15)  # under the q it had
    with _backend.forced_backend(backend_name):
        value = module(torch.tensor([1.0, 1.0], dtype=torch.float64, device=device), groups)
    # the adjusted score of group 0 (1 + 1e308) is far ahead: all of q on it
    assert torch.isfinite(module.log_q).all() and float(module.q[0]) == 1.0 and float(value) == 1.0

    module = dro_ext.GroupDROLoss(3, 1.0, normalize_loss=True).to(device, torch.float64)
    with _backend.forced_backend(backend_name):
        module(torch.tensor([1e308, 1e308, 0.0], dtype=torch.float64, device=device),
               torch.tensor([0, 1, 2], device=device))
    want = torch.softmax(torch.tensor([0.5, 0.5, 0.0], dtype=torch.float64), 0)  # exp(a_g / sum a), normalized
    torch.testing.assert_close(module.q.cpu(), want, rtol=1e-12, atol=0.0)

    # A disabled group's score enters normalize_loss's mean (every group's does): overflowing there, it blocks the
    # step (it made every score a / inf = 0, q standing still); without normalize_loss it changes nothing.
    for normalize_loss in (True, False):
        module = dro_ext.GroupDROLoss(3, 1.0, adjustment=[1e308, 0.0, 0.0], group_counts=[1.0, 1.0, 1.0],
                                      q_init=[0.0, 0.5, 0.5], normalize_loss=normalize_loss).to(device, torch.float64)
        before = module.log_q.clone()
        with _backend.forced_backend(backend_name):
            module(torch.tensor([1e308, 1.0, 5.0], dtype=torch.float64, device=device),
                   torch.tensor([0, 1, 2], device=device))
        assert bool(module.seen.any()) != normalize_loss, normalize_loss  # a blocked batch marks no group seen
        assert module.q[0] == 0 and torch.isfinite(module.log_q[1:]).all()
        assert torch.equal(module.log_q, before) == normalize_loss, module.log_q


@pytest.mark.parametrize("backend_name", BACKEND_NAMES)
def test_scores_past_float64s_range_from_finite_parts(backend_name):
    assert_scores_past_float64s_range_from_finite_parts("cpu", backend_name)


def assert_float32_group_sums_past_the_range_keep_a_finite_mean(device, backend_name):
    """float32 losses of one group whose sum passes 3.4e38 have a finite float32 mean: every step (the native "eg"
    one, greedy CVaR, the fallback; with and without a mask) takes float64 group sums, so the loss is finite and the
    batch steps (float32 sums read +inf: the loss inf, no step taken)."""
    losses = torch.tensor([3e38, 3e38, 1.0, 2.0], device=device)
    groups = torch.tensor([0, 0, 1, 1], device=device)
    mask = torch.tensor([True, True, True, False], device=device)
    greedy = dict(mode="greedy_cvar", alpha=0.5)
    cases = [(greedy, None), (greedy, mask), ({}, None), ({}, mask)]
    for kwargs, keep in cases:
        module = dro_ext.GroupDROLoss(2, 1e-40, **kwargs).to(device)  # a step that leaves q near (1/2, 1/2)
        x = losses.clone().requires_grad_()
        with _backend.forced_backend(backend_name):
            value = module(x, groups, mask=keep)
        (grad,) = torch.autograd.grad(value, x)
        q = module.q.double().cpu()
        mean1 = 1.0 if keep is not None else 1.5
        want = q[0] * 3e38 + q[1] * mean1
        at = f"{kwargs} mask={keep is not None}"
        assert bool(module.seen.all()), at  # the batch stepped
        torch.testing.assert_close(value.double().cpu(), want, rtol=1e-6, atol=0.0, msg=at)
        assert torch.isfinite(grad).all(), at


@pytest.mark.parametrize("backend_name", BACKEND_NAMES)
def test_float32_group_sums_past_the_range_keep_a_finite_mean(backend_name):
    assert_float32_group_sums_past_the_range_keep_a_finite_mean("cpu", backend_name)


def assert_out_dtype_sets_the_result_dtype(device):
    """group_dro_step_'s out_dtype: the loss and the gradient weights in that dtype (by default the wider of the
    sums' and the state's), their values those of the float64 result rounded once (no q_g here is near the bound
    below which a float32 result drops it), the state updated alike."""
    for sums_dtype, state_dtype in itertools.product((torch.float32, torch.float64), repeat=2):
        _, args = _step_operands(dtype=state_dtype)
        sums, counts = args[0].to(device, sums_dtype), args[1].to(device, sums_dtype)
        results = {}
        for out_dtype in (None, torch.float32, torch.float64):
            state = [t.to(device).clone() for t in args[2:8]]
            kwargs = {} if out_dtype is None else {"out_dtype": out_dtype}
            loss, weights = torch.ops.dro_ext.group_dro_step_(sums, counts, *state, *args[8:], True, **kwargs)
            want = torch.promote_types(sums_dtype, state_dtype) if out_dtype is None else out_dtype
            at = f"sums {sums_dtype}, state {state_dtype}, out_dtype {out_dtype}"
            assert loss.dtype == want and weights.dtype == want and loss.device == sums.device, at
            results[out_dtype] = (loss, weights, state)
        exact_loss, exact_weights, _ = results[torch.float64]
        for out_dtype, (loss, weights, state) in results.items():
            target = loss.dtype
            assert torch.equal(loss, exact_loss.to(target)) and torch.equal(weights, exact_weights.to(target)), out_dtype
            assert all(torch.equal(a, b) for a, b in zip(state, results[torch.float64][2])), out_dtype
    _, args = _step_operands()
    with pytest.raises(TypeError, match="out_dtype must be float32 or float64"):
        torch.ops.dro_ext.group_dro_step_(*args, True, out_dtype=torch.float16)


@native_only
def test_out_dtype_sets_the_result_dtype():
    assert_out_dtype_sets_the_result_dtype("cpu")


@native_only
def test_the_update_is_seen_by_autograd():
    """A tensor an earlier graph saved that the step then updates in place fails that graph's backward, as an
    in-place PyTorch op would make it."""
    module = dro_ext.GroupDROLoss(3)
    x = torch.ones(3, requires_grad=True)
    saved = (x * module.log_q).sum()  # the product saves log_q for x's gradient
    with _backend.forced_backend("native"):
        module(torch.rand(6), torch.tensor([0, 1, 2, 0, 1, 2]))
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        saved.backward()
    y = torch.ones(3, requires_grad=True)
    kept = (y * module.log_q).sum()
    with _backend.forced_backend("native"):
        module(torch.rand(6), torch.tensor([0, 1, 2, 0, 1, 2]), update=False)  # no update: nothing changed
    kept.backward()


def _step_operands(num_groups=5, dtype=torch.float64, requires_grad=False):
    module = dro_ext.GroupDROLoss(num_groups, 0.5, missing="stale").to(dtype)
    module(torch.rand(11, dtype=dtype), torch.randint(num_groups, (11,)))  # a state away from uniform
    b = module._buffers
    sums = (torch.rand(num_groups, dtype=torch.float64) * 4).requires_grad_(requires_grad)
    counts = torch.tensor([3.0, 0.0, 1.0, 2.0, 5.0], dtype=torch.float64)
    return module, (sums, counts, b["log_q"], b["ema_loss"], b["last_loss"], b["seen"], b["active"],
                    b["adjustment_term"], 0.5, 0.1, True, False)


@native_only
@pytest.mark.parametrize("update", [False, True], ids=["no-update", "update"])
@pytest.mark.parametrize("out_dtype", [None, torch.float32], ids=["out_dtype=None", "out_dtype=float32"])
def test_opcheck_group_dro_step(update, out_dtype):
    _, args = _step_operands(requires_grad=True)
    kwargs = {} if out_dtype is None else {"out_dtype": out_dtype}
    torch.library.opcheck(torch.ops.dro_ext.group_dro_step_.default, (*args, update), kwargs)


@native_only
@pytest.mark.parametrize("update", [False, True], ids=["no-update", "update"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
def test_opcheck_group_dro_loss(update, dtype):
    module, args = _step_operands()
    losses = (1 + torch.randn(23, dtype=torch.float64)).to(dtype).requires_grad_(dtype == torch.float64)
    groups = torch.randint(5, (23,))
    torch.library.opcheck(torch.ops.dro_ext.group_dro_loss_.default, (losses, groups, 5, *args[2:], update, True))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
def test_opcheck_refuse_update_inside_backward(dtype):
    # The composed update's check op (GroupDROLoss's greedy CVaR mode and the fallback, compiled): defined in
    # Python on both backends; it declares log_q updated and leaves it alone.
    log_q = torch.log(torch.full((5,), 0.2, dtype=dtype))
    torch.library.opcheck(torch.ops.dro_ext.refuse_update_inside_backward_.default, (log_q,))
    assert torch.equal(log_q, torch.log(torch.full((5,), 0.2, dtype=dtype)))


@native_only
def test_double_backward_of_the_fused_step():
    """The gradient weights are constants of the step: d loss / d l is linear in the upstream gradient, which the
    second derivative sees (gradgradcheck, update=False so that each call is the same function)."""
    module, _ = _step_operands()
    groups = torch.tensor([0, 1, 2, 3, 4, 0, 2, 2, 3])
    losses = (1 + torch.rand(9, dtype=torch.float64)).requires_grad_()

    def value(l):
        with _backend.forced_backend("native"):
            return module(l, groups, update=False)

    assert torch.autograd.gradcheck(value, (losses,))
    assert torch.autograd.gradgradcheck(value, (losses,))


BAD_OPERANDS = [
    (dict(sums=torch.ones(5, dtype=torch.float16)), TypeError, "sums must be float32 or float64"),
    (dict(counts=torch.ones(5, dtype=torch.float32)), TypeError, "counts must have the dtype of sums"),
    (dict(sums=torch.ones(5, 1, dtype=torch.float64)), ValueError, "sums must be a 1-D tensor"),
    (dict(counts=torch.ones(4, dtype=torch.float64)), ValueError, "must have the shape of sums"),
    (dict(ema_loss=torch.zeros(5, dtype=torch.float32)), TypeError, "share one floating dtype"),
    (dict(seen=torch.zeros(5)), TypeError, "seen and active must be bool"),
    (dict(adjustment=torch.zeros(5, dtype=torch.int64)), TypeError, "adjustment must be floating"),
]


@native_only
@pytest.mark.parametrize("override,exc,match", BAD_OPERANDS, ids=[str(i) for i in range(len(BAD_OPERANDS))])
def test_bad_operands_name_the_argument(override, exc, match):
    _, args = _step_operands()
    names = ["sums", "counts", "log_q", "ema_loss", "last_loss", "seen", "active", "adjustment"]
    operands = dict(zip(names, args))
    operands.update(override)
    with pytest.raises(exc, match=match):
        torch.ops.dro_ext.group_dro_step_(*(operands[n] for n in names), *args[len(names):], True)


@native_only
def test_repeatable_bitwise_whatever_the_thread_count():
    """Steps of the same batches from the same state give the same bits at 1 and 2 threads."""
    results = []
    previous = torch.get_num_threads()
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            module = dro_ext.GroupDROLoss(300, 0.3, missing="stale")
            values = []
            for losses, groups in batches(4, 50_000, 300, seed=5):
                with _backend.forced_backend("native"):
                    values.append(module(losses.float(), groups))
            results.append((torch.stack(values), module.log_q.clone(), module.ema_loss.clone()))
    finally:
        torch.set_num_threads(previous)
    for a, b in zip(*results):
        assert torch.equal(a, b)


@native_only
def test_masked_step_compiles_fullgraph():
    """group_dro_step_ (the masked step) under torch.compile(fullgraph=True): the in-place update of the state is
    functionalized and written back, step by step as in eager."""
    eager, compiled_module = dro_ext.GroupDROLoss(4, 0.5), dro_ext.GroupDROLoss(4, 0.5)
    compiled = torch.compile(compiled_module, fullgraph=True)
    gen = torch.Generator().manual_seed(7)
    for update in (True, True, False, True):
        losses = torch.rand(20, generator=gen)
        groups, mask = torch.randint(4, (20,), generator=gen), torch.rand(20, generator=gen) < 0.8
        l1, l2 = losses.clone().requires_grad_(), losses.clone().requires_grad_()
        with _backend.forced_backend("native"):
            want, got = eager(l1, groups, update, mask=mask), compiled(l2, groups, update, mask=mask)
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-7)
        torch.testing.assert_close(torch.autograd.grad(got, l2), torch.autograd.grad(want, l1), rtol=1e-6, atol=1e-7)
        torch.testing.assert_close(compiled_module.q, eager.q, rtol=1e-6, atol=1e-7)
