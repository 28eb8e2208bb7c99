"""The paper's experiments (Section 5) at laptop scale, one function per experiment.

Each function trains with :class:`dro_ext.DROLoss` and either ``torch.optim.SGD`` with momentum (the
baseline) or :class:`dro_ext.NormalizedSGD` (Algorithm 1), picks each optimizer's learning rate from a
grid by the speed of optimization on the first seed, trains that learning rate again on the further seeds
(model initialization and batch order; the data stay those of the first seed), and returns every run's
curve of the exact objective per epoch. ``probe`` > 0 runs the same experiment with every initial parameter
nudged by one rounding step (:func:`dro_ext.demo.training.rounding_nudge`): what the verdicts are checked against.

- :func:`example_3_1`: the paper's Example 3.1, a scalar non-convex loss whose chi2-DRO objective is
  quartic, so that its smoothness and gradient noise grow with ``x``.
- :func:`age_regression`: chi2-DRO regression of an imbalanced target with a small MLP (Figure 1a).
- :func:`digits_chi2`: chi2-DRO classification of imbalanced digits (Figure 1b, Table 2).
- :func:`digits_cvar`: CVaR against smoothed CVaR on the same digits, both judged by the CVaR objective
  (Figure 1d, Table 3).

Beyond the paper, :func:`spurious_digits` compares ERM with group-level DRO (:class:`dro_ext.GroupDROLoss`,
``DROLoss(num_groups=4)``) and sample-level chi2 DRO on digits with a spurious feature, by worst-group test
accuracy; its hyperparameters and each run's epoch are picked on a validation split, not by the speed of optimization.
"""
from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

import dro_ext
from dro_ext.demo.data import (PAPER_RHO, SPURIOUS_GROUPS, GroupSplit, Split, load_imbalanced_digits,
                               load_spurious_digits, make_age_regression, present_groups, worst_group)
from dro_ext.demo.training import (BATCH_SIZE, Run, RunOne, fixed_batches, lr_search, make_optimizer, seeded_model,
                                   shuffled_batches, train)

# The paper's DRO settings (Section 5.1): lam = 0.1 and the CVaR level alpha = 0.02 in every experiment.
LAM = 0.1
ALPHA = 0.02


@dataclass
class Settings:
    """Sizes of the runs. :meth:`full` is the default demo (about 100 s of CPU time per pass on one thread, three
    passes with its rounding probes: within ten minutes on 2 CPU cores), :meth:`quick` a smoke run of a few seconds
    that exercises every code path."""

    example_epochs: int
    example_steps_per_epoch: int
    example_grid: tuple
    regression_samples: int
    regression_epochs: int
    regression_grid: tuple
    digits_epochs: int
    digits_grid: tuple
    # The spurious-digits experiment: every (lr, strength) pair of each method is tried on the first seed.
    groups_epochs: int
    groups_lrs: tuple
    groups_step_sizes: tuple  # GroupDROLoss's step_size
    groups_lams: tuple  # lam of both chi2 objectives (over groups and over samples)
    # Each method's chosen learning rate is trained on this many seeds; every claim is judged over them all,
    # as one seed's training is chaotic enough that another processor's float32 rounding can change it.
    seeds: int
    # Every experiment (search and seeds) runs again this many times with its initial parameters nudged by
    # one rounding step (training.rounding_nudge); a verdict is stated only where they all agree
    # (claims.settle).
    rounding_probes: int

    @classmethod
    def full(cls) -> "Settings":
        return cls(
            example_epochs=100, example_steps_per_epoch=10, example_grid=lr_grid(1e-4, 1.0),
            regression_samples=4000, regression_epochs=100, regression_grid=lr_grid(1e-9, 1e-1),
            digits_epochs=100, digits_grid=lr_grid(1e-4, 1.0),
            groups_epochs=40, groups_lrs=(0.01, 0.03, 0.1), groups_step_sizes=(0.001, 0.01, 0.1, 1.0),
            groups_lams=(0.01, 0.1, 1.0, 10.0),
            seeds=5, rounding_probes=2,
        )

    @classmethod
    def quick(cls) -> "Settings":
        return cls(
            example_epochs=5, example_steps_per_epoch=4, example_grid=(1e-3, 1e-1),
            regression_samples=600, regression_epochs=3, regression_grid=(1e-7, 1e-2),
            digits_epochs=3, digits_grid=(1e-2, 1e-1),
            groups_epochs=3, groups_lrs=(0.03,), groups_step_sizes=(0.01, 0.1), groups_lams=(0.1, 1.0),
            seeds=2, rounding_probes=1,
        )


def lr_grid(low: float, high: float) -> tuple:
    """Learning rates 1, 3, 10, 30, ... times ``low`` up to ``high`` (about half a decade apart). Every
    optimizer of a comparison gets the same grid, wide enough to hold each one's best rate inside it."""
    rates, decade = [], low
    while decade <= high * (1 + 1e-9):
        rates += [decade] + ([3 * decade] if 3 * decade <= high * (1 + 1e-9) else [])
        decade *= 10
    return tuple(float(f"{r:.3g}") for r in rates)


def _generator(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


# ---------------------------------------------------------------------------------------------------
# Example 3.1
# ---------------------------------------------------------------------------------------------------

EXAMPLE_LAM = 1.0  # Example 3.1 fixes lam = 1
EXAMPLE_X0 = 10.0


class Example31(nn.Module):
    """``l(x; xi) = x^2 (1 + xi/(x^2 + 1))^2`` with one scalar parameter ``x``; ``forward(xi)`` gives one
    loss per noise sample."""

    def __init__(self, x0: float = EXAMPLE_X0):
        super().__init__()
        self.x = nn.Parameter(torch.tensor(x0))

    def forward(self, xi: torch.Tensor) -> torch.Tensor:
        x2 = self.x ** 2
        return x2 * (1 + xi / (x2 + 1)) ** 2


def example_3_1(settings: Settings, seed: int, device: str = "cpu", probe: int = 0) -> dict:
    """SGD with momentum against normalized momentum on Example 3.1, chi2 DRO, from ``x = 10``.

    xi is Rademacher, so the population is two equally likely points and the exact
    ``Psi(x) = min_eta L(x, eta)`` is :func:`dro_ext.robust_objective` of the two losses ``l(x; -1)``,
    ``l(x; +1)``. An epoch is ``example_steps_per_epoch`` steps on fresh batches of 128 draws of xi.
    """
    both_signs = torch.tensor([-1.0, 1.0], device=device)

    def run_one(optimizer_name: str, lr: float, run_seed: int = seed) -> Run:
        model = seeded_model(Example31, run_seed, probe, device)
        criterion = dro_ext.DROLoss("chi2", lam=EXAMPLE_LAM).to(device)
        optimizer = make_optimizer(optimizer_name, [*model.parameters(), *criterion.parameters()], lr)
        noise = _generator(run_seed)  # x starts at 10 on every seed: the seed draws the noise

        def epoch_batches() -> Iterator[torch.Tensor]:
            for _ in range(settings.example_steps_per_epoch):
                yield (torch.randint(0, 2, (128,), generator=noise) * 2.0 - 1.0).to(device)

        def judge() -> float:
            with torch.no_grad():
                return dro_ext.robust_objective(model(both_signs), EXAMPLE_LAM, "chi2")[0].item()

        run = Run(optimizer_name, lr, run_seed)
        train(model, criterion, optimizer, epoch_batches, lambda m, xi: m(xi), judge,
              settings.example_epochs, run, desc=f"Example 3.1 {optimizer_name} lr={lr:g}")
        run.extra["x_final"] = model.x.item()
        return run

    return _compare_optimizers(run_one, settings.example_grid, _seeds(settings, seed))


def _seeds(settings: Settings, seed: int) -> range:
    return range(seed, seed + settings.seeds)


def _compare(runners: dict[str, tuple[str, RunOne]], grid: Sequence[float], seeds: Sequence[int]) -> dict:
    """``runners[method] = (optimizer, run_one)`` with ``run_one(optimizer, lr, seed) -> Run``: grid-search
    each method's learning rate on the first seed (``runs``, ``best``), then train the chosen rate on every
    seed (``seed_runs``, whose first run is the grid's)."""
    result: dict[str, Any] = {"grid": list(grid), "best": {}, "runs": {}, "seed_runs": {}}
    for method, (optimizer, run_one) in runners.items():
        best, runs = lr_search(run_one, optimizer, grid)
        result["best"][method], result["runs"][method] = best, runs
        result["seed_runs"][method] = [best] + [run_one(best.optimizer, best.lr, s) for s in seeds if s != best.seed]
    return result


def _compare_optimizers(run_one: RunOne, grid: Sequence[float], seeds: Sequence[int]) -> dict:
    """SGD+momentum against NormalizedSGD through the same ``run_one``: :func:`_compare` of the two."""
    return _compare({name: (name, run_one) for name in ("sgd", "nsgd")}, grid, seeds)


# ---------------------------------------------------------------------------------------------------
# Regression on an imbalanced target
# ---------------------------------------------------------------------------------------------------


def small_mlp(n_in: int, n_out: int, hidden: int = 64) -> nn.Module:
    """Two hidden ReLU layers: small enough to train in a second on a CPU, non-convex all the same."""
    return nn.Sequential(nn.Linear(n_in, hidden), nn.ReLU(), nn.Linear(hidden, hidden), nn.ReLU(),
                         nn.Linear(hidden, n_out))


def squared_error(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """Per-sample loss of the regression (reduction="none"): what DROLoss reweights."""
    x, age = batch
    return (model(x).squeeze(-1) - age) ** 2


def age_regression(settings: Settings, seed: int, device: str = "cpu", probe: int = 0) -> dict:
    """chi2-DRO regression (lam = 0.1) of the synthetic ages with a small MLP: SGD+momentum vs NormalizedSGD."""
    data = make_age_regression(settings.regression_samples, seed=seed)
    x, y = data.x_train.to(device), data.y_train.to(device)
    whole_train = fixed_batches(x, y)
    x_test, y_test = data.x_test.to(device), data.y_test.to(device)

    def run_one(optimizer_name: str, lr: float, run_seed: int = seed) -> Run:
        model = seeded_model(lambda: small_mlp(x.shape[1], 1), run_seed, probe, device)
        criterion = dro_ext.DROLoss("chi2", lam=LAM).to(device)
        optimizer = make_optimizer(optimizer_name, [*model.parameters(), *criterion.parameters()], lr)
        order = _generator(run_seed)

        def judge() -> float:
            psi, _ = dro_ext.evaluate(model, whole_train, squared_error, LAM, "chi2", progress=False)
            return psi.item()

        run = Run(optimizer_name, lr, run_seed)
        train(model, criterion, optimizer, lambda: shuffled_batches(x, y, order), squared_error, judge,
              settings.regression_epochs, run, desc=f"regression {optimizer_name} lr={lr:g}")
        with torch.no_grad():
            model.eval()
            run.extra["test_mae_years"] = (model(x_test).squeeze(-1) - y_test).abs().mean().item()
        return run

    result = _compare_optimizers(run_one, settings.regression_grid, _seeds(settings, seed))
    result["n_train"], result["n_test"] = len(x), len(x_test)
    result["band_18_30_fraction"] = ((data.y_train >= 18) & (data.y_train <= 30)).float().mean().item()
    return result


# ---------------------------------------------------------------------------------------------------
# Imbalanced digits: chi2 (SGD+momentum vs NormalizedSGD) and CVaR vs smoothed CVaR
# ---------------------------------------------------------------------------------------------------


def cross_entropy(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    x, label = batch
    return F.cross_entropy(model(x), label, reduction="none")


def per_class_accuracy(model: nn.Module, x: torch.Tensor, y: torch.Tensor, num_classes: int = 10) -> list:
    """Test accuracy (%) of each class."""
    model.eval()
    with torch.no_grad():
        correct = (model(x).argmax(1) == y).float()
    return [100.0 * correct[y == c].mean().item() for c in range(num_classes)]


def _digits_runner(data: Split, seed: int, device: str, divergence: dro_ext.Divergence,
                   judge_by: tuple[dro_ext.Divergence, float | None], epochs: int, probe: int = 0) -> RunOne:
    """A ``run_one(optimizer, lr, seed)`` for the digits: trains with ``DROLoss(divergence)``, judges the
    training set by ``judge_by = (divergence, alpha)`` each epoch and records the per-class test accuracy."""
    x, y = data.x_train.to(device), data.y_train.to(device)
    x_test, y_test = data.x_test.to(device), data.y_test.to(device)
    whole_train = fixed_batches(x, y)
    alpha = ALPHA if divergence in ("cvar", "smoothed_cvar") else None

    def run_one(optimizer_name: str, lr: float, run_seed: int = seed) -> Run:
        model = seeded_model(lambda: small_mlp(x.shape[1], 10, hidden=128), run_seed, probe, device)
        criterion = dro_ext.DROLoss(divergence, lam=LAM, alpha=alpha).to(device)
        optimizer = make_optimizer(optimizer_name, [*model.parameters(), *criterion.parameters()], lr)
        order = _generator(run_seed)

        def judge() -> float:
            psi, _ = dro_ext.evaluate(model, whole_train, cross_entropy, LAM, judge_by[0], alpha=judge_by[1],
                                      progress=False)
            return psi.item()

        run = Run(optimizer_name, lr, run_seed)
        train(model, criterion, optimizer, lambda: shuffled_batches(x, y, order), cross_entropy, judge, epochs,
              run, desc=f"digits {divergence} {optimizer_name} lr={lr:g}")
        run.extra["divergence"] = divergence
        run.extra["test_accuracy_per_class"] = per_class_accuracy(model, x_test, y_test)
        return run

    return run_one


def _digits_data_summary(data: Split) -> dict:
    return {
        "rho": list(PAPER_RHO),
        "train_per_class": torch.bincount(data.y_train, minlength=10).tolist(),
        "test_per_class": torch.bincount(data.y_test, minlength=10).tolist(),
    }


def digits_chi2(settings: Settings, seed: int, device: str = "cpu", probe: int = 0) -> dict:
    """chi2-DRO classification of the imbalanced digits: SGD+momentum vs NormalizedSGD, Psi each epoch."""
    data = load_imbalanced_digits(seed=seed)
    run_one = _digits_runner(data, seed, device, "chi2", judge_by=("chi2", None), epochs=settings.digits_epochs,
                             probe=probe)
    result = _compare_optimizers(run_one, settings.digits_grid, _seeds(settings, seed))
    result["data"] = _digits_data_summary(data)
    return result


def digits_cvar(settings: Settings, seed: int, device: str = "cpu", probe: int = 0) -> dict:
    """CVaR against smoothed CVaR (alpha = 0.02) on the imbalanced digits, both trained with SGD+momentum
    (Section 3.3: SGD suffices for smoothed CVaR) and both judged by the CVaR objective each epoch."""
    data = load_imbalanced_digits(seed=seed)
    runners = {divergence: ("sgd", _digits_runner(data, seed, device, divergence, judge_by=("cvar", ALPHA),
                                                  epochs=settings.digits_epochs, probe=probe))
               for divergence in ("cvar", "smoothed_cvar")}
    result = _compare(runners, settings.digits_grid, _seeds(settings, seed))
    result["data"] = _digits_data_summary(data)
    return result


# ---------------------------------------------------------------------------------------------------
# Beyond the paper: group DRO on digits with a spurious feature
# ---------------------------------------------------------------------------------------------------

# The methods compared, each with the name of the knob that sets how robust it is (None: ERM has none).
GROUP_METHODS = {
    "erm": ("ERM", None),  # the mean loss
    "group_dro": ("GroupDROLoss", "step_size"),  # online Group DRO
    "group_chi2": ("chi2 over groups", "lam"),  # DROLoss(num_groups=4)
    "chi2": ("chi2 over samples", "lam"),  # DROLoss: needs no group labels
}


def group_objective(method: str, strength: float | None
                    ) -> tuple[Callable[[torch.Tensor, torch.Tensor], torch.Tensor], nn.Module | None]:
    """``(objective, module)``: ``objective(losses, groups)`` is the loss to minimize from the per-sample losses
    and the group ids; ``module`` is the dro_ext module behind it (None for ERM), whose parameters (DROLoss's
    ``eta``) join the model's in the optimizer."""
    if method == "erm":
        return (lambda losses, groups: losses.mean()), None
    if strength is None:  # only ERM's grid holds None
        raise ValueError(f"method {method!r} needs a strength (its step size or lam), got None")
    module: nn.Module
    if method == "group_dro":  # Sagawa et al.: a distribution q over the groups, updated from every batch
        module = dro_ext.GroupDROLoss(SPURIOUS_GROUPS, step_size=strength)
        return module, module
    if method == "group_chi2":  # the penalized chi2 objective over the batch's group mean losses
        module = dro_ext.DROLoss("chi2", lam=strength, num_groups=SPURIOUS_GROUPS)
        return module, module
    if method == "chi2":  # the same over samples: the group ids go unused
        module = dro_ext.DROLoss("chi2", lam=strength)
        return (lambda losses, groups: module(losses)), module
    raise ValueError(f"method must be one of {sorted(GROUP_METHODS)}, got {method!r}")


def group_accuracy(model: nn.Module, x: torch.Tensor, y: torch.Tensor, groups: torch.Tensor) -> list:
    """Accuracy (%) of each group (NaN for a group without samples in the split)."""
    model.eval()
    with torch.no_grad():
        correct = (model(x).argmax(1) == y).float()
    return [100.0 * correct[groups == g].mean().item() for g in range(SPURIOUS_GROUPS)]


def train_with_groups(data: GroupSplit, method: str, lr: float, strength: float | None, seed: int, epochs: int,
                      device: str = "cpu", probe: int = 0) -> Run:
    """Train the small MLP on ``data``'s training split with ``method``'s objective (NormalizedSGD at ``lr``) and
    keep the epoch with the best :func:`validation_score` (the earliest among equals): the model selection of
    Group DRO's evaluations, never on the test set.

    ``run.curve`` is the worst-group test accuracy after every epoch; ``run.extra`` holds the kept epoch
    (``selected_epoch``, 1 to ``epochs``) and its per-group accuracies (validation and test) and overall test
    accuracy. Why not the last epoch: with a constant learning rate the worst group's accuracy swings by tens of
    points from one epoch to the next, so the last epoch's is a draw that one rounding step can change (measured:
    the hyperparameter searches and the claims on it moved between rounding probes).
    """
    x, y, groups = data.x_train.to(device), data.y_train.to(device), data.g_train.to(device)
    x_test, y_test, g_test = data.x_test.to(device), data.y_test.to(device), data.g_test.to(device)
    x_val, y_val, g_val = data.x_val.to(device), data.y_val.to(device), data.g_val.to(device)
    model = seeded_model(lambda: small_mlp(x.shape[1], 2), seed, probe, device)
    objective, module = group_objective(method, strength)
    robust_parameters = [] if module is None else list(module.to(device).parameters())  # DROLoss's eta
    optimizer = make_optimizer("nsgd", [*model.parameters(), *robust_parameters], lr)
    order = _generator(seed)
    run = Run("nsgd", lr, seed, curve=[worst_group(group_accuracy(model, x_test, y_test, g_test))])
    run.extra.update(method=method, strength=strength)
    best_score = None
    for epoch in range(1, epochs + 1):
        model.train()
        for index in torch.randperm(len(x), generator=order).to(device).split(BATCH_SIZE):
            losses = F.cross_entropy(model(x[index]), y[index], reduction="none")
            loss = objective(losses, groups[index])
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
        test_group_accuracy = group_accuracy(model, x_test, y_test, g_test)
        run.curve.append(worst_group(test_group_accuracy))
        val_group_accuracy = group_accuracy(model, x_val, y_val, g_val)
        score = validation_score(val_group_accuracy)
        if best_score is None or score > best_score:
            best_score = score
            with torch.no_grad():
                test_accuracy = 100.0 * (model(x_test).argmax(1) == y_test).float().mean().item()
            run.extra.update(selected_epoch=epoch, val_group_accuracy=val_group_accuracy,
                             test_group_accuracy=test_group_accuracy, test_accuracy=test_accuracy)
    return run


def validation_score(val_group_accuracy: Sequence[float]) -> tuple:
    """What model selection maximizes, over a run's epochs and then over the hyperparameter grid: the worst-group
    validation accuracy, then the mean of the groups' validation accuracies (a tie-break: a model that predicts
    one class everywhere scores 0 on both groups of the other label, whatever its strength), over the groups with
    samples."""
    present = present_groups(val_group_accuracy)
    if not present:
        return float("nan"), float("nan")
    return min(present), sum(present) / len(present)


def spurious_digits(settings: Settings, seed: int, device: str = "cpu", probe: int = 0) -> dict:
    """ERM against GroupDROLoss, DROLoss(num_groups=4) and sample-level chi2 DROLoss on the spurious digits.

    Each method's learning rate and strength (GroupDROLoss's step_size, chi2's lam) are the grid pair with the
    best :func:`validation_score` (at its kept epoch, :func:`train_with_groups`) on the first seed; that pair then
    trains on every seed (model initialization and batch order; the data are the first seed's). Every method trains
    with NormalizedSGD and reads the per-sample cross-entropy; only the objective built from it differs.
    """
    data = load_spurious_digits(seed=seed)
    grids = {"erm": (None,), "group_dro": settings.groups_step_sizes, "group_chi2": settings.groups_lams,
             "chi2": settings.groups_lams}
    result: dict[str, Any] = {"methods": {m: label for m, (label, _) in GROUP_METHODS.items()},
              "grid": {"lr": list(settings.groups_lrs)}, "best": {}, "runs": {}, "seed_runs": {}}
    for method, (_, knob) in GROUP_METHODS.items():
        if knob is not None:
            result["grid"][knob] = list(grids[method])
        runs = [train_with_groups(data, method, lr, strength, seed, settings.groups_epochs, device, probe)
                for lr in settings.groups_lrs for strength in grids[method]]
        best = max(runs, key=lambda run: validation_score(run.extra["val_group_accuracy"]))  # the first among equals
        result["runs"][method], result["best"][method] = runs, best
        result["seed_runs"][method] = [best] + [
            train_with_groups(data, method, best.lr, best.extra["strength"], s, settings.groups_epochs, device,
                              probe)
            for s in _seeds(settings, seed) if s != seed]
    result["data"] = spurious_data_summary(data)
    return result


def spurious_data_summary(data: GroupSplit) -> dict:
    """Per split: its size, the samples in each group, and how often the bar agrees with the label."""
    summary = {}
    for split in ("train", "val", "test"):
        y, groups = getattr(data, f"y_{split}"), getattr(data, f"g_{split}")
        summary[split] = {"samples": len(y), "per_group": torch.bincount(groups, minlength=SPURIOUS_GROUPS).tolist(),
                          "agreement": (groups % 2 == y).double().mean().item()}
    return summary
