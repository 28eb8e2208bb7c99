"""The paper's four claims and two beyond it, each checked against this run's numbers.

(a) chi2 DRO: SGD with momentum converges slowly or not at all, normalized SGD with momentum fast
    (Figure 1a/b; here also on Example 3.1);
(b) smoothed CVaR is optimized far better than CVaR, judged by the CVaR objective (Figure 1c/d);
(c) the normalized-momentum model has higher test accuracy on every class, most on the worst (Table 2);
(d) the smoothed-CVaR model beats the CVaR model on every class likewise (Table 3).

Beyond the paper, on digits with a spurious feature (:func:`dro_ext.demo.experiments.spurious_digits`):

(e) Group DRO (with group labels: GroupDROLoss, and chi2 DROLoss over groups) raises the worst-group test
    accuracy over ERM;
(f) chi2 DRO over samples (DROLoss without group labels) raises it too.

Each check returns a verdict, ``"yes"``, ``"partly"`` or ``"no"``, with the numbers behind it; nothing
here is tuned to make a verdict come out one way. :func:`settle` then checks every verdict against rounding:
the experiments run again with their initial parameters nudged by one rounding step
(:func:`dro_ext.demo.training.rounding_nudge`), and a verdict that any of these probes changes is reported as
``"not settled"`` (:data:`NOT_SETTLED`), with what each gave.

(a) and (b) are judged over seeds, as one seed's training is chaotic: another processor's float32 rounding
(another SIMD build of the same kernels) changes its last epochs. Per seed, a run's level is the mean of its
exact objective over the last :data:`TAIL_EPOCHS` epochs and its speed the mean log-objective over the
epochs; the claim holds when the method's level and speed are both below the baseline's. The verdict is
``yes`` when it holds on the medians over the seeds and on at least :func:`seeds_needed` of the seeds,
``partly`` when it holds on the medians only, ``no`` otherwise (:func:`optimization_verdict`). (e) and (f)
follow the same rule with the worst-group test accuracy in place of level and speed
(:func:`compare_worst_group`). (c) and (d) compare the mean per-class test accuracy; a gain counts only beyond
:data:`GAIN_STANDARD_ERRORS` standard errors of it over the seeds (:func:`compare_accuracy`).
"""
from __future__ import annotations

import math
import statistics
from collections.abc import Iterable, Sequence
from typing import Any

from dro_ext.demo.data import worst_group
from dro_ext.demo.training import Run

# A run's level: the mean of its exact objective over its last TAIL_EPOCHS epochs, not the last epoch alone.
TAIL_EPOCHS = 10
# "yes" needs the claim on at least this fraction of the seeds besides the medians: 4 of 5.
SEED_FRACTION_FOR_YES = 0.8
# (c)/(d): a mean accuracy gain counts only beyond this many standard errors of it over the seeds (about a one-sided
# 95% bound). Within it, the sign of the gain is what another seed, or another processor's rounding of the same
# seeds, decides: measured on one Xeon, the mean gain of (d) moved between -8.9 and +4.4 points over the passes of
# its three CPU builds, with standard errors of 1.4 to 14.
GAIN_STANDARD_ERRORS = 2.0
# The verdict of a claim on which the runs as trained and their rounding probes disagree.
NOT_SETTLED = "not settled"

CLAIMS = {
    "a": "chi2 DRO: SGD+momentum converges slowly or not at all, normalized SGD+momentum converges fast",
    "b": "smoothed CVaR is optimized far better than CVaR, judged by the CVaR objective",
    "c": "normalized SGD+momentum has higher test accuracy on every class, most on the worst class",
    "d": "smoothed CVaR has higher test accuracy than CVaR on every class, most on the worst class",
    "e": "(beyond the paper) Group DRO raises the worst-group test accuracy over ERM",
    "f": "(beyond the paper) chi2 DRO over samples, without group labels, raises the worst-group test accuracy "
         "over ERM",
}


def tail_level(run: Run) -> float:
    """The mean exact objective over the run's last :data:`TAIL_EPOCHS` epochs (all of them when it has
    fewer), +inf if it diverged: where the run settled, less at the mercy of one epoch's rounding."""
    if run.diverged:
        return math.inf
    epochs = run.curve[1:] or run.curve  # curve[0] is the initialization
    return statistics.fmean(epochs[-TAIL_EPOCHS:])


def seeds_needed(seeds: int) -> int:
    """How many of ``seeds`` seeds the claim must hold on for a ``yes``: 4 of 5 (2 of 2 in the quick run)."""
    return math.ceil(SEED_FRACTION_FOR_YES * seeds - 1e-9)


def optimization_verdict(holds_on_medians: bool, seeds_holding: int, seeds: int) -> str:
    """``yes``: the claim holds on the medians and on :func:`seeds_needed` seeds; ``partly``: on the medians
    only; ``no``: not on the medians (whatever the seeds)."""
    if not holds_on_medians:
        return "no"
    return "yes" if seeds_holding >= seeds_needed(seeds) else "partly"


def overall_verdict(task_verdicts: Iterable[str]) -> str:
    """A claim judged on several tasks: ``yes`` on every task, ``no`` on every task, else ``partly``."""
    task_verdicts = list(task_verdicts)
    if all(v == "yes" for v in task_verdicts):
        return "yes"
    return "no" if all(v == "no" for v in task_verdicts) else "partly"


def _median_and_range(values: list) -> dict:
    """The median over the seeds and the seed-to-seed spread (lowest and highest seed)."""
    return {"median": statistics.median(values), "low": min(values), "high": max(values)}


def compare_optimization(baseline_seed_runs: list, method_seed_runs: list, baseline_grid_runs: list,
                         method_grid_runs: list) -> dict:
    """Whether ``method`` optimized lower and faster than ``baseline``, each at its chosen learning rate,
    over the same seeds (``*_seed_runs[i]`` both on seed i); ``*_grid_runs`` are the learning-rate searches.

    ``level``/``speed``: each method's :func:`tail_level` and mean log-objective (:meth:`Run.speed_score`),
    median and spread over the seeds. ``level_ratio`` is the baseline's median level over the method's (> 1:
    the method settles lower); ``speed_gap`` the baseline's median speed score minus the method's (> 0: the
    method is faster, by that many e-folds on average). ``seeds_lower``/``seeds_faster``/``seeds_holding``
    count the seeds on which the method settles lower / is faster / both. Verdict: :func:`optimization_verdict`.
    """
    seeds = [run.seed for run in baseline_seed_runs]
    if seeds != [run.seed for run in method_seed_runs]:
        raise ValueError(f"the two methods ran on different seeds: {seeds} and {[r.seed for r in method_seed_runs]}")
    base_levels, method_levels = [tail_level(r) for r in baseline_seed_runs], [tail_level(r) for r in method_seed_runs]
    base_speeds = [r.speed_score() for r in baseline_seed_runs]
    method_speeds = [r.speed_score() for r in method_seed_runs]
    lower = [m < b for b, m in zip(base_levels, method_levels)]
    faster = [m < b for b, m in zip(base_speeds, method_speeds)]
    level = {"baseline": _median_and_range(base_levels), "method": _median_and_range(method_levels)}
    speed = {"baseline": _median_and_range(base_speeds), "method": _median_and_range(method_speeds)}
    base_level, method_level = level["baseline"]["median"], level["method"]["median"]
    # inf: the method settled at 0; 0: it diverged on most seeds, the baseline not; nan: both did.
    level_ratio = base_level / method_level if method_level != 0 else math.inf
    speed_gap = speed["baseline"]["median"] - speed["method"]["median"]  # nan when both diverged on most seeds
    holds_on_medians = method_level < base_level and speed_gap > 0
    seeds_holding = sum(a and b for a, b in zip(lower, faster))
    return {
        "baseline_lr": baseline_seed_runs[0].lr, "method_lr": method_seed_runs[0].lr, "seeds": seeds,
        # (the epochs the level averages: all of a run's where it has fewer than TAIL_EPOCHS, as in --quick)
        "tail_epochs": min(TAIL_EPOCHS, max(len(r.curve[1:] or r.curve)
                                            for r in baseline_seed_runs + method_seed_runs)),
        "level": level, "speed": speed, "level_ratio": level_ratio, "speed_gap": speed_gap,
        "seeds_lower": sum(lower), "seeds_faster": sum(faster), "seeds_holding": seeds_holding,
        "seeds_needed": seeds_needed(len(seeds)), "holds_on_medians": holds_on_medians,
        "baseline_diverged_seeds": [r.seed for r in baseline_seed_runs if r.diverged],
        "method_diverged_seeds": [r.seed for r in method_seed_runs if r.diverged],
        "baseline_diverged_lrs": [r.lr for r in baseline_grid_runs if r.diverged],
        "method_diverged_lrs": [r.lr for r in method_grid_runs if r.diverged],
        "verdict": optimization_verdict(holds_on_medians, seeds_holding, len(seeds)),
    }


def mean_accuracy(runs: list) -> list:
    """Per-class test accuracy averaged over the seeds of ``runs``."""
    per_seed = [r.extra["test_accuracy_per_class"] for r in runs]
    return [statistics.fmean(column) for column in zip(*per_seed)]


def compare_accuracy(baseline_runs: list, method_runs: list) -> dict:
    """Per-class test accuracy of ``method`` against ``baseline`` (means over the same seeds, run i of each on
    seed i).

    The worst class is the one the baseline classifies worst (the paper's bold column). A gain counts only where
    the mean gain (over the classes and the seeds) exceeds :data:`GAIN_STANDARD_ERRORS` standard errors of it, from
    the per-seed mean gains. Verdict: ``yes`` when the gain counts, every class improves and the worst class gains
    at least the mean gain; ``partly`` when the gain counts and the worst class improves; ``no`` otherwise.
    """
    seeds = [run.seed for run in baseline_runs]
    if seeds != [run.seed for run in method_runs]:
        raise ValueError(f"the two methods ran on different seeds: {seeds} and {[r.seed for r in method_runs]}")
    base, method = mean_accuracy(baseline_runs), mean_accuracy(method_runs)
    gains = [m - b for b, m in zip(base, method)]
    worst = min(range(len(base)), key=base.__getitem__)
    mean_gain = statistics.fmean(gains)
    per_seed_gains = [statistics.fmean(m - b for b, m in zip(b_run.extra["test_accuracy_per_class"],
                                                             m_run.extra["test_accuracy_per_class"]))
                      for b_run, m_run in zip(baseline_runs, method_runs)]
    # One seed says nothing of the noise: no gain counts.
    standard_error = (statistics.stdev(per_seed_gains) / math.sqrt(len(seeds)) if len(seeds) > 1 else math.inf)
    gain_counts = mean_gain > GAIN_STANDARD_ERRORS * standard_error
    improved = sum(g > 0 for g in gains)
    if gain_counts and improved == len(gains) and gains[worst] >= mean_gain:
        verdict = "yes"
    elif gain_counts and gains[worst] > 0:
        verdict = "partly"
    else:
        verdict = "no"
    return {
        "baseline_accuracy": base, "method_accuracy": method, "gains": gains,
        "worst_class": worst, "worst_class_gain": gains[worst], "mean_gain": mean_gain,
        "per_seed_mean_gains": per_seed_gains, "mean_gain_standard_error": standard_error,
        "gain_counts": gain_counts, "classes_improved": improved, "num_classes": len(gains), "seeds": len(seeds),
        "largest_gain_class": max(range(len(gains)), key=gains.__getitem__),
        "verdict": verdict,
    }


def worst_group_accuracy(run: Run) -> float:
    """The test accuracy (%) of the run's worst group (:func:`dro_ext.demo.experiments.spurious_digits`)."""
    return worst_group(run.extra["test_group_accuracy"])


def _mean_and_spread(values: list) -> dict:
    """Mean, standard deviation (0 for one seed), median, lowest and highest over the seeds."""
    std = statistics.stdev(values) if len(values) > 1 else 0.0
    return {"mean": statistics.fmean(values), "std": std, **_median_and_range(values)}


def compare_worst_group(baseline_runs: list, method_runs: list) -> dict:
    """Whether ``method`` has a higher worst-group test accuracy than ``baseline``, over the same seeds.

    The claim holds on a seed when the method's worst group is more accurate than the baseline's (strictly),
    and on the medians when its median over the seeds is higher; verdict by :func:`optimization_verdict`.
    ``worst_group`` and ``average`` (the accuracy over the whole test set, reported, not judged): mean, std,
    median, lowest and highest seed of each.
    """
    seeds = [run.seed for run in baseline_runs]
    if seeds != [run.seed for run in method_runs]:
        raise ValueError(f"the two methods ran on different seeds: {seeds} and {[r.seed for r in method_runs]}")
    base = [worst_group_accuracy(r) for r in baseline_runs]
    method = [worst_group_accuracy(r) for r in method_runs]
    holds_on_medians = statistics.median(method) > statistics.median(base)
    seeds_higher = sum(m > b for b, m in zip(base, method))
    return {
        "seeds": seeds, "baseline_lr": baseline_runs[0].lr, "method_lr": method_runs[0].lr,
        "baseline_strength": baseline_runs[0].extra["strength"], "method_strength": method_runs[0].extra["strength"],
        "worst_group": {"baseline": _mean_and_spread(base), "method": _mean_and_spread(method)},
        "average": {who: _mean_and_spread([r.extra["test_accuracy"] for r in runs])
                    for who, runs in (("baseline", baseline_runs), ("method", method_runs))},
        "seeds_higher": seeds_higher, "seeds_needed": seeds_needed(len(seeds)), "holds_on_medians": holds_on_medians,
        "verdict": optimization_verdict(holds_on_medians, seeds_higher, len(seeds)),
    }


def settled_verdict(verdicts: Sequence[str]) -> str:
    """The verdict of the runs as trained (``verdicts[0]``) where every rounding probe gave the same,
    :data:`NOT_SETTLED` where one differs: a verdict that one rounding step can change is no finding."""
    if not verdicts:
        raise ValueError("verdicts must hold at least the verdict of the runs as trained")
    return verdicts[0] if all(v == verdicts[0] for v in verdicts) else NOT_SETTLED


# The count of seeds a seed-judged verdict reads: (a)/(b)'s (level and speed both below) and (e)/(f)'s.
SEED_COUNTS = ("seeds_holding", "seeds_higher")


def _settled(claim: dict, probes: list) -> dict:
    """One verdict checked against its probes' (see :func:`settle`); a verdict judged over seeds also keeps each
    probe's count of the seeds it holds on (``probe_seed_counts``), how far from its threshold a probe left it."""
    claim = {**claim, "verdicts": [claim["verdict"]] + [p["verdict"] for p in probes]}
    claim["verdict"] = settled_verdict(claim["verdicts"])
    for count in SEED_COUNTS:
        if count in claim:
            claim["probe_seed_counts"] = [p[count] for p in probes]
    return claim


def settle(claims: dict, probe_claims: Sequence[dict]) -> dict:
    """``claims`` (:func:`assess` of the runs as trained) with every verdict, and every task's of (a) and (e),
    checked against ``probe_claims`` (:func:`assess` of each rounding probe): ``verdicts`` lists the runs as
    trained first, then each probe's, and ``verdict`` becomes :func:`settled_verdict` of them. The numbers stay
    those of the runs as trained, but for ``probe_seed_counts`` (:func:`_settled`)."""
    settled = {}
    for key, claim in claims.items():
        probes = [probe[key] for probe in probe_claims]
        claim = _settled(claim, probes)
        if "tasks" in claim:
            claim["tasks"] = {task: _settled(c, [p["tasks"][task] for p in probes])
                              for task, c in claim["tasks"].items()}
        settled[key] = claim
    return settled


# The experiments each claim reads (dro_ext.demo.runner.EXPERIMENTS' names); (a) is judged on those of its
# three tasks that ran, every other claim only when all of its experiments ran.
CLAIM_EXPERIMENTS = {
    "a": ("example_3_1", "regression", "digits_chi2"),
    "b": ("digits_cvar",),
    "c": ("digits_chi2",),
    "d": ("digits_cvar",),
    "e": ("spurious_digits",),
    "f": ("spurious_digits",),
}


def assess(results: dict) -> dict:
    """The verdict and numbers of every claim whose experiments are in ``results`` (the experiments' results,
    see :mod:`dro_ext.demo.experiments`, by name), keyed and ordered as :data:`CLAIMS`."""
    def optimization(result: dict[str, Any], baseline: str, method: str) -> dict[str, Any]:
        return compare_optimization(result["seed_runs"][baseline], result["seed_runs"][method],
                                    result["runs"][baseline], result["runs"][method])

    def accuracy(result: dict[str, Any], baseline: str, method: str) -> dict[str, Any]:
        return compare_accuracy(result["seed_runs"][baseline], result["seed_runs"][method])

    def worst_group(result: dict[str, Any], method: str) -> dict[str, Any]:
        return compare_worst_group(result["seed_runs"]["erm"], result["seed_runs"][method])

    def over_tasks(tasks: dict[str, dict[str, Any]]) -> dict[str, Any]:
        return {"tasks": tasks, "verdict": overall_verdict(c["verdict"] for c in tasks.values())}

    judges = {
        "a": lambda: over_tasks({task: optimization(results[task], "sgd", "nsgd")
                                 for task in CLAIM_EXPERIMENTS["a"] if task in results}),
        "b": lambda: optimization(results["digits_cvar"], "cvar", "smoothed_cvar"),
        "c": lambda: accuracy(results["digits_chi2"], "sgd", "nsgd"),
        "d": lambda: accuracy(results["digits_cvar"], "cvar", "smoothed_cvar"),
        "e": lambda: over_tasks({method: worst_group(results["spurious_digits"], method)
                                 for method in ("group_dro", "group_chi2")}),
        "f": lambda: worst_group(results["spurious_digits"], "chi2"),
    }
    ran = {key: [name in results for name in names] for key, names in CLAIM_EXPERIMENTS.items()}
    return {key: {"claim": CLAIMS[key], **judge()} for key, judge in judges.items()
            if (any if key == "a" else all)(ran[key])}
