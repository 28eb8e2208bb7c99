"""The paper's four claims, each checked against this run's numbers.

(a) chi2 DRO: SGD with momentum converges slowly or not at all, normalized SGD with momentum fast
    (Figure 1a/b; here also on Example 3.1);
(b) smoothed CVaR is optimized far better than CVaR, judged by the CVaR objective (Figure 1c/d);
(c) the normalized-momentum model has higher test accuracy on every class, most on the worst (Table 2);
(d) the smoothed-CVaR model beats the CVaR model on every class likewise (Table 3).

Each check returns a verdict, ``"yes"``, ``"partly"`` or ``"no"``, with the numbers behind it; nothing
here is tuned to make a verdict come out one way.
"""
from __future__ import annotations

import math
import statistics

from dro_ext.demo.training import Run

CLAIMS = {
    "a": "chi2 DRO: SGD+momentum converges slowly or not at all, normalized SGD+momentum converges fast",
    "b": "smoothed CVaR is optimized far better than CVaR, judged by the CVaR objective",
    "c": "normalized SGD+momentum has higher test accuracy on every class, most on the worst class",
    "d": "smoothed CVaR has higher test accuracy than CVaR on every class, most on the worst class",
}


def first_epoch_at_or_below(curve: list, level: float):
    """The first epoch whose value is <= level, or None."""
    return next((epoch for epoch, value in enumerate(curve) if value <= level), None)


def compare_optimization(baseline: Run, method: Run, baseline_runs: list, method_runs: list) -> dict:
    """How much faster/lower ``method`` optimized than ``baseline`` (each at its best learning rate).

    ``final_ratio`` is the baseline's final objective over the method's (> 1: the method ends lower);
    ``speed_gap`` the difference of their mean log-objective over the epochs (> 0: the method is faster,
    by that many e-folds on average); ``epochs_to_baseline_final`` when the method first reached the
    baseline's final value. Verdict: ``yes`` when the method both ends lower and is faster, ``partly`` when
    one of the two holds, ``no`` otherwise.
    """
    final_ratio = baseline.final / method.final if method.final > 0 else math.inf
    speed_gap = baseline.speed_score() - method.speed_score()
    lower, faster = method.final < baseline.final, speed_gap > 0
    return {
        "baseline_lr": baseline.lr, "method_lr": method.lr,
        "baseline_final": baseline.final, "method_final": method.final,
        "final_ratio": final_ratio, "speed_gap": speed_gap,
        "epochs_to_baseline_final": first_epoch_at_or_below(method.curve, baseline.final),
        "baseline_diverged_lrs": [r.lr for r in baseline_runs if r.diverged],
        "method_diverged_lrs": [r.lr for r in method_runs if r.diverged],
        "verdict": "yes" if lower and faster else "partly" if lower or faster else "no",
    }


def mean_accuracy(runs: list) -> list:
    """Per-class test accuracy averaged over the seeds of ``runs``."""
    per_seed = [r.extra["test_accuracy_per_class"] for r in runs]
    return [statistics.fmean(column) for column in zip(*per_seed)]


def seed_spread(runs: list) -> float:
    """The standard deviation of a class's test accuracy across seeds, averaged over the classes: how much
    of a per-class difference is noise."""
    per_seed = [r.extra["test_accuracy_per_class"] for r in runs]
    return statistics.fmean(statistics.stdev(column) for column in zip(*per_seed))


def compare_accuracy(baseline_runs: list, method_runs: list) -> dict:
    """Per-class test accuracy of ``method`` against ``baseline`` (means over the seeds).

    The worst class is the one the baseline classifies worst (the paper's bold column). Verdict: ``yes``
    when every class improves and the worst class gains at least the mean gain, ``partly`` when the
    mean accuracy and the worst class both improve, ``no`` otherwise.
    """
    base, method = mean_accuracy(baseline_runs), mean_accuracy(method_runs)
    gains = [m - b for b, m in zip(base, method)]
    worst = min(range(len(base)), key=base.__getitem__)
    mean_gain = statistics.fmean(gains)
    improved = sum(g > 0 for g in gains)
    if improved == len(gains) and gains[worst] >= mean_gain:
        verdict = "yes"
    elif mean_gain > 0 and gains[worst] > 0:
        verdict = "partly"
    else:
        verdict = "no"
    seeds = len(baseline_runs)
    return {
        "baseline_accuracy": base, "method_accuracy": method, "gains": gains,
        "worst_class": worst, "worst_class_gain": gains[worst], "mean_gain": mean_gain,
        "classes_improved": improved, "num_classes": len(gains), "seeds": seeds,
        "largest_gain_class": max(range(len(gains)), key=gains.__getitem__),
        "seed_spread": statistics.fmean([seed_spread(baseline_runs), seed_spread(method_runs)]) if seeds > 1 else None,
        "verdict": verdict,
    }


def assess(results: dict) -> dict:
    """Every claim's verdict and numbers from the experiments' results (see :mod:`dro_ext.demo.experiments`)."""
    chi2 = {}
    for task in ("example_3_1", "regression", "digits_chi2"):
        r = results[task]
        chi2[task] = compare_optimization(r["best"]["sgd"], r["best"]["nsgd"], r["runs"]["sgd"], r["runs"]["nsgd"])
    verdicts = [c["verdict"] for c in chi2.values()]
    cvar = results["digits_cvar"]
    return {
        "a": {"claim": CLAIMS["a"], "tasks": chi2,
              "verdict": "yes" if all(v == "yes" for v in verdicts) else "no" if all(v == "no" for v in verdicts)
              else "partly"},
        "b": {"claim": CLAIMS["b"], **compare_optimization(cvar["best"]["cvar"], cvar["best"]["smoothed_cvar"],
                                                            cvar["runs"]["cvar"], cvar["runs"]["smoothed_cvar"])},
        "c": {"claim": CLAIMS["c"], **compare_accuracy(results["digits_chi2"]["seed_runs"]["sgd"],
                                                        results["digits_chi2"]["seed_runs"]["nsgd"])},
        "d": {"claim": CLAIMS["d"], **compare_accuracy(cvar["seed_runs"]["cvar"], cvar["seed_runs"]["smoothed_cvar"])},
    }
