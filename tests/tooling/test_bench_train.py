"""bench/bench_train.py: the training steps it times are the ones they claim to be, and its host-sync counter counts.

Each implementation's first steps, run by the benchmark's own Run on a float64 copy of each case, reach the
parameters of the same step composed here by hand: the per-sample losses of the model, the objective written from
its formula (chi2's psi*, the exact robust objective from a root found by scipy, cross-entropy from log-softmax),
gradients by autograd, and the update rule of torch.optim.SGD or of NormalizedSGD (Algorithm 1) written out.
"""
import copy
import math

import pytest
import torch
import torch.nn.functional as F
from scipy import optimize

from bench import bench_train

STEPS = 3
# Small float64 versions of the cases: the same models and losses, sizes that take milliseconds.
SMALL = {
    "resnet18": dict(batch=6, width=2),
    "mlp-large-batch": dict(batch=257, features=5, hidden=7),
    "lm-head": dict(tokens=33, hidden=6, vocab=11),
}
REFERENCE_IMPLS = (bench_train.ERM, bench_train.DRO_NSGD, bench_train.DRO_SGD, bench_train.ROBUST,
                   bench_train.FUSED_CE, bench_train.FUSED_LINEAR_CE)


def chi2_psi_star(t):
    return torch.clamp(t + 2, min=0) ** 2 / 4 - 1


def chi2_objective(losses, eta, lam):
    return lam * chi2_psi_star((losses - eta) / lam).mean() + eta


def exact_eta(losses, lam) -> float:
    """The minimizer of the chi2 objective over eta: mean psi*'((l - eta)/lam) = 1, psi*'(t) = (t + 2)_+ / 2."""
    l64 = losses.detach().double()

    def condition(eta):
        return float(torch.clamp((l64 - eta) / lam + 2, min=0).mean() / 2 - 1)

    return optimize.brentq(condition, float(l64.min()) - 2 * lam, float(l64.max()), xtol=1e-15, rtol=1e-15)


def per_sample(problem, model, case):
    x, y = problem.batch
    if case == "mlp-large-batch":
        return (model(x).squeeze(1) - y) ** 2
    return -torch.log_softmax(model(x), dim=1).gather(1, y[:, None]).squeeze(1)


def reference_steps(problem, case, impl):
    """The parameters after each of STEPS steps, composed by hand."""
    model = copy.deepcopy(problem.model)
    params = list(model.parameters())
    dro = impl in (bench_train.DRO_NSGD, bench_train.DRO_SGD, bench_train.FUSED_CE, bench_train.FUSED_LINEAR_CE)
    eta = torch.zeros((), dtype=torch.float64, requires_grad=True)
    if dro:
        params.append(eta)
    momenta = [None] * len(params)
    after = []
    for _ in range(STEPS):
        losses = per_sample(problem, model, case)
        if impl == bench_train.ERM:
            objective = losses.mean()
        elif impl == bench_train.ROBUST:
            # Danskin: the gradient of min over eta is the objective's at the minimizer, held fixed.
            objective = chi2_objective(losses, exact_eta(losses, bench_train.LAM), bench_train.LAM)
        else:
            objective = chi2_objective(losses, eta, bench_train.LAM)
        grads = torch.autograd.grad(objective, params)
        with torch.no_grad():
            if impl == bench_train.DRO_NSGD:  # m = g, then beta m + (1 - beta) g; p -= lr m / (||m|| + eps)
                momenta = [g.clone() if m is None else bench_train.MOMENTUM * m + (1 - bench_train.MOMENTUM) * g
                           for m, g in zip(momenta, grads)]
                norm = math.sqrt(sum(float((m * m).sum()) for m in momenta))
                for p, m in zip(params, momenta):
                    p -= bench_train.LR * m / (norm + 1e-8)
            else:  # torch.optim.SGD: b = g, then mu b + g; p -= lr b
                momenta = [g.clone() if m is None else bench_train.MOMENTUM * m + g for m, g in zip(momenta, grads)]
                for p, m in zip(params, momenta):
                    p -= bench_train.LR * m
        after.append([p.detach().clone() for p in params])
    return after


# The fused cross-entropies run on lm-head only: they need a head's logits.
@pytest.mark.parametrize("case, impl", [(case, impl) for case in SMALL for impl in REFERENCE_IMPLS
                                        if case == "lm-head" or impl not in bench_train.LM_HEAD_ONLY])
def test_each_step_reaches_the_parameters_of_the_step_composed_by_hand(case, impl):
    problem = bench_train.make_problem(case, "cpu", dtype=torch.float64, sizes=SMALL[case])
    expected = reference_steps(problem, case, impl)
    run = bench_train.Run(problem, bench_train.IMPLS[impl])
    assert run.params[0].dtype == torch.float64
    for step, reference in enumerate(expected, 1):
        run.step()
        assert len(run.params) == len(reference)
        for p, r in zip(run.params, reference):
            torch.testing.assert_close(p.detach(), r, rtol=1e-9, atol=1e-12, msg=lambda m: f"step {step}: {m}")
    # The steps moved the parameters: a step that did nothing would have matched nothing above but the start.
    assert any(not torch.equal(p, q) for p, q in zip(expected[-1], problem.model.parameters()))


def test_the_dro_rows_train_eta_with_the_model_and_erm_has_none():
    problem = bench_train.make_problem("mlp-large-batch", "cpu", dtype=torch.float64, sizes=SMALL["mlp-large-batch"])
    dro = bench_train.Run(problem, bench_train.IMPLS[bench_train.DRO_NSGD])
    assert dro.params[-1] is dro.criterion.eta and isinstance(dro.optimizer, bench_train.dro_ext.NormalizedSGD)
    erm = bench_train.Run(problem, bench_train.IMPLS[bench_train.ERM])
    assert erm.criterion is None and len(erm.params) == len(dro.params) - 1
    assert type(erm.optimizer) is torch.optim.SGD


def test_a_bfloat16_case_keeps_eta_in_float32():
    problem = bench_train.make_problem("lm-head", "cpu", sizes=dict(tokens=8, hidden=4, vocab=16,
                                                                    dtype=torch.bfloat16))
    run = bench_train.Run(problem, bench_train.IMPLS[bench_train.DRO_SGD])
    assert problem.batch[0].dtype == torch.bfloat16 and run.criterion.eta.dtype == torch.float32
    run.step()
    assert torch.isfinite(run.criterion.eta.detach()) and float(run.criterion.eta.detach()) != 0.0


def test_the_implementations_of_each_case():
    class Peer:  # a stand-in for fast-dro's RobustLoss class
        def __init__(self, size, reg, geometry):
            self.size, self.reg, self.geometry = size, reg, geometry

    names = {case: [i.name for i in bench_train.impls_for(case)] for case in bench_train.CASE_NAMES}
    assert names["resnet18"] == names["mlp-large-batch"] == [bench_train.ERM, bench_train.DRO_NSGD,
                                                             bench_train.DRO_SGD, bench_train.ROBUST]
    assert names["lm-head"] == names["resnet18"] + list(bench_train.LM_HEAD_ONLY)
    with_peer = bench_train.impls_for("resnet18", Peer)
    assert [i.name for i in with_peer][-2:] == list(bench_train.FAST_DRO)
    chi2, cvar = (i.peer(Peer) for i in with_peer[-2:])
    # fast-dro's penalized chi-square is (reg/2) chi^2: dro_ext's chi2 at lam is reg = 2 lam
    assert (chi2.size, chi2.reg, chi2.geometry) == (math.inf, 2 * bench_train.LAM, "chi-square")
    assert (cvar.size, cvar.reg, cvar.geometry) == (bench_train.CVAR_ALPHA, 0.0, "cvar")
    assert not any(i.capturable for i in with_peer[-2:]) and all(i.capturable for i in with_peer[:-2])


def test_targets_bound_dros_rows_only():
    assert [bench_train.target_of(n) for n in (bench_train.DRO_NSGD, bench_train.FUSED_LINEAR_CE)] == [1.05, 1.05]
    assert bench_train.target_of(bench_train.ROBUST) == 1.10
    assert bench_train.target_of(bench_train.ERM) is None and bench_train.target_of(bench_train.FAST_DRO_CHI2) is None


def test_a_failing_implementation_is_reported_in_its_row_and_the_others_run():
    def no_kernel(problem, model, criterion, batch):
        raise RuntimeError("no kernel")

    problem = bench_train.make_problem("mlp-large-batch", "cpu", sizes=dict(batch=64, features=3, hidden=4))
    broken = bench_train.Impl("broken", no_kernel)
    impls = [bench_train.IMPLS[bench_train.ERM], broken]
    rows = bench_train.bench_case(problem, impls, "eager", "cpu", bench_train.Timer("cpu"), rounds=1,
                                  min_seconds=0.01, min_reps=1)
    assert [r["impl"] for r in rows] == [bench_train.ERM, "broken"]
    assert rows[0]["median_ms"] > 0 and rows[0]["x_erm"] == 1.0 and rows[0]["host_syncs"] is None
    assert rows[1]["median_ms"] is None and rows[1]["note"] == "failed: RuntimeError: no kernel"


def test_rows_give_the_cpu_peak_memory_and_fast_dros_ratio_to_the_exact_objective():
    # fast-dro's rows are readings against ERM and against dro_ext's exact objective (a stand-in here: fast-dro's
    # checkout is not needed to check the row); every timed row records the peak memory of a step, CPU included.
    def stand_in(problem, model, criterion, batch):
        return bench_train.IMPLS[bench_train.ROBUST].objective(problem, model, criterion, batch)

    problem = bench_train.make_problem("mlp-large-batch", "cpu", sizes=dict(batch=256, features=3, hidden=16))
    impls = [bench_train.IMPLS[bench_train.ERM], bench_train.IMPLS[bench_train.ROBUST],
             bench_train.Impl(bench_train.FAST_DRO_CHI2, stand_in)]
    rows = bench_train.bench_case(problem, impls, "eager", "cpu", bench_train.Timer("cpu"), rounds=1,
                                  min_seconds=0.01, min_reps=1)
    by_impl = {r["impl"]: r for r in rows}
    fast_dro, robust = by_impl[bench_train.FAST_DRO_CHI2], by_impl[bench_train.ROBUST]
    assert fast_dro["x_dro_ext"] == pytest.approx(fast_dro["median_ms"] / robust["median_ms"])
    assert robust["x_dro_ext"] is None and by_impl[bench_train.ERM]["x_dro_ext"] is None
    # The hidden activations alone are 256 x 16 float32 (16 KiB) per layer.
    assert all(r["peak_MiB"] * 2**20 >= 256 * 16 * 4 for r in rows)


def test_a_failure_names_its_root_cause():
    # Dynamo raises a tracing error "from" the error that happened: the row must say what that was.
    def wrapped():
        try:
            raise RuntimeError("Expected all tensors to be on the same device\nmore detail")
        except RuntimeError as cause:
            raise TypeError("RuntimeError when making fake tensor call") from cause

    with pytest.raises(TypeError) as info:
        wrapped()
    assert bench_train._failure(info.value) == ("TypeError: RuntimeError when making fake tensor call "
                                                "(cause: RuntimeError: Expected all tensors to be on the same device)")
    assert bench_train._failure(RuntimeError("no kernel")) == "RuntimeError: no kernel"
