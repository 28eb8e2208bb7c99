"""The demo's outputs: a figure with four panels like the paper's Figure 1 and two for the spurious-digits
experiment beyond it, per-class accuracy tables like the paper's Tables 2 and 3 and a per-group table,
``report.md`` with a verdict per claim, and ``results.json`` with every number."""
from __future__ import annotations

import dataclasses
import json
import math
import re
import statistics
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from dro_ext.demo.claims import (CLAIMS, GAIN_STANDARD_ERRORS, NOT_SETTLED, TAIL_EPOCHS, mean_accuracy, seeds_needed,
                                 worst_group_accuracy)
from dro_ext.demo.experiments import GROUP_METHODS
from dro_ext.demo.training import OPTIMIZERS, Run

FIGURE_SIZE_INCHES = (12.0, 13.5)
FIGURE_DPI = 100  # figure.png is 1200 x 1350 pixels

# One panel per comparison: (results key, title, y label, [(run key, label), (run key, label)]).
PANELS = (
    ("example_3_1", "(a) Example 3.1, chi2 DRO (lam = 1), from x = 10", "exact Psi",
     (("sgd", OPTIMIZERS["sgd"]), ("nsgd", OPTIMIZERS["nsgd"]))),
    ("regression", "(b) Regression, imbalanced ages, chi2 DRO", "exact Psi (training set)",
     (("sgd", OPTIMIZERS["sgd"]), ("nsgd", OPTIMIZERS["nsgd"]))),
    ("digits_chi2", "(c) Classification, imbalanced digits, chi2 DRO", "exact Psi (training set)",
     (("sgd", OPTIMIZERS["sgd"]), ("nsgd", OPTIMIZERS["nsgd"]))),
    ("digits_cvar", "(d) Classification, imbalanced digits, CVaR objective", "CVaR at alpha = 0.02 (training set)",
     (("cvar", "trained on CVaR"), ("smoothed_cvar", "trained on smoothed CVaR"))),
)
COLORS = ("tab:red", "tab:blue")
GROUP_COLORS = {"erm": "tab:gray", "group_dro": "tab:blue", "group_chi2": "tab:green", "chi2": "tab:orange"}
# The groups of the spurious digits, 2 * label + bar (label 1: digit < 5); in training, 0 and 3 are the majority.
GROUP_NAMES = ("digit >= 5, no bar", "digit >= 5, bar", "digit < 5, no bar", "digit < 5, bar")


def median_and_band(runs: list) -> tuple:
    """Per epoch, the median of the seeds' curves and their lowest and highest value (three arrays). A seed
    that diverged counts as +inf from its last epoch on, so the median is +inf once most seeds diverged."""
    table = np.full((len(runs), max(len(run.curve) for run in runs)), math.inf)
    for row, run in zip(table, runs):
        curve = np.asarray(run.curve, dtype=float)
        row[:len(curve)] = np.where(np.isfinite(curve), curve, math.inf)
    return np.median(table, axis=0), table.min(axis=0), table.max(axis=0)


def _plottable(values: npt.ArrayLike) -> np.ndarray:
    """Values for a log axis: non-finite and non-positive ones left out (NaN leaves a gap in the line)."""
    array = np.asarray(values, dtype=float)
    return np.where(np.isfinite(array) & (array > 0), array, math.nan)


def _percent_axis(ax: Any) -> None:
    """0-100% with room above for the legend, which would otherwise hide the curves or bars near 100%."""
    ax.set_ylim(0, 118)
    ax.set_yticks(range(0, 101, 20))


def plot_worst_group_curves(ax: Any, result: dict) -> None:
    """Panel (e): the worst-group test accuracy after every epoch, for each method at its chosen hyperparameters:
    the median over the seeds, with a band from the lowest to the highest seed. Shown, not used to stop early."""
    for method, label in result["methods"].items():
        median, low, high = median_and_band(result["seed_runs"][method])
        color, epochs = GROUP_COLORS[method], range(len(median))
        ax.fill_between(epochs, low, high, color=color, alpha=0.15, linewidth=0)
        ax.plot(epochs, median, color=color, linewidth=2.0, label=label)
    _percent_axis(ax)
    ax.set_title("(e) Beyond the paper: digits with a spurious bar, worst-group test accuracy", fontsize=10)
    ax.set_xlabel("epoch")
    ax.set_ylabel("worst-group test accuracy (%)")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8, loc="upper center", ncol=4)


def plot_group_accuracy(ax: Any, result: dict) -> None:
    """Panel (f): each group's test accuracy at the epoch kept for its best validation score, one bar per method
    (the mean over the seeds), a line from the lowest to the highest seed."""
    methods = list(result["methods"])
    width = 0.8 / len(methods)
    for i, method in enumerate(methods):
        per_seed = np.array([run.extra["test_group_accuracy"] for run in result["seed_runs"][method]])
        mean = per_seed.mean(axis=0)
        positions = np.arange(len(GROUP_NAMES)) + (i - (len(methods) - 1) / 2) * width
        ax.bar(positions, mean, width, color=GROUP_COLORS[method], label=result["methods"][method])
        ax.vlines(positions, per_seed.min(axis=0), per_seed.max(axis=0), color="black", linewidth=0.8)
    counts = result["data"]["train"]["per_group"]
    ax.set_xticks(range(len(GROUP_NAMES)), [f"{name}\n({n} training)" for name, n in zip(GROUP_NAMES, counts)],
                  fontsize=8)
    _percent_axis(ax)
    ax.set_title("(f) Spurious digits: test accuracy per group (bar: mean; line: seed range)", fontsize=10)
    ax.set_ylabel("test accuracy (%)")
    ax.grid(True, axis="y", alpha=0.3)
    ax.legend(fontsize=8, loc="upper center", ncol=4)


def plot_objective_panel(ax: Any, result: dict, title: str, ylabel: str, series: Sequence[tuple[Any, ...]]) -> None:
    """One of the paper's panels: the judged objective against epochs, log scale, for each method of ``series``:
    at its chosen learning rate the median over the seeds in bold with a band from the lowest to the highest
    seed, the rest of its grid (the first seed's runs) faint, an x where a run diverged."""
    runs = [run for name, _ in series for run in (*result["runs"][name], *result["seed_runs"][name])]
    # The axis spans the finite values but stops at 30x the starting value: a diverging run would
    # otherwise squash every other curve into a line (it is marked with an x at the top instead).
    top = 30 * max(run.curve[0] for run in runs)
    bottom = np.nanmin(np.concatenate([_plottable(run.curve) for run in runs])) / 3
    for (name, label), color in zip(series, COLORS):
        best, seed_runs = result["best"][name], result["seed_runs"][name]
        for run in result["runs"][name]:
            if run is not best:
                ax.plot(range(len(run.curve)), _plottable(run.curve), color=color, linewidth=0.8, alpha=0.25)
        median, low, high = median_and_band(seed_runs)
        epochs = range(len(median))
        ax.fill_between(epochs, _plottable(low), np.minimum(_plottable(high), top), color=color, alpha=0.2,
                        linewidth=0)
        ax.plot(epochs, _plottable(median), color=color, linewidth=2.2, zorder=3,
                label=f"{label}, lr={best.lr:g}, median of {len(seed_runs)} seeds")
        for run in (*result["runs"][name], *seed_runs[1:]):
            if run.diverged:
                ax.plot(len(run.curve) - 1, top / 1.5, marker="x", color=color, alpha=0.6)
    ax.set_ylim(bottom, top)
    ax.set_yscale("log")
    ax.set_title(title, fontsize=10)
    ax.set_xlabel("epoch")
    ax.set_ylabel(ylabel)
    ax.grid(True, which="major", alpha=0.3)
    ax.legend(fontsize=8, loc="upper right")


def _not_run(ax: Any, title: str) -> None:
    ax.set_axis_off()
    ax.text(0.5, 0.5, f"{title}: not run (--experiments)", ha="center", va="center", transform=ax.transAxes)


def plot_figure(results: dict, path: Path) -> None:
    """Six panels: the paper's four (:func:`plot_objective_panel`), then the spurious digits' worst-group test
    accuracy per epoch and per-group test accuracy at the end. An experiment that did not run leaves its panel
    blank but for a note, so that every panel keeps its place."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(3, 2, figsize=FIGURE_SIZE_INCHES, dpi=FIGURE_DPI)
    for ax, (key, title, ylabel, series) in zip(axes.flat, PANELS):
        if key in results:
            plot_objective_panel(ax, results[key], title, ylabel, series)
        else:
            _not_run(ax, title)
    if "spurious_digits" in results:
        plot_worst_group_curves(axes[2, 0], results["spurious_digits"])
        plot_group_accuracy(axes[2, 1], results["spurious_digits"])
    else:
        _not_run(axes[2, 0], "(e) spurious digits")
        _not_run(axes[2, 1], "(f) spurious digits")
    fig.suptitle("dro_ext demo: bold = median over the seeds at each method's chosen lr (and strength in (e)), "
                 "band = lowest to highest seed;\nfaint = rest of the grid (first seed); x = diverged", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=FIGURE_DPI)
    plt.close(fig)


def accuracy_table(title: str, train_counts: list, rows: list, worst: int) -> str:
    """A markdown table like the paper's Tables 2/3: one column per class, the worst class in bold."""
    bold = lambda text, c: f"**{text}**" if c == worst else str(text)  # noqa: E731
    classes = range(len(train_counts))
    lines = [
        f"{title}",
        "",
        "| Class | " + " | ".join(bold(c, c) for c in classes) + " |",
        "|---|" + "---|" * len(train_counts),
        "| Training samples | " + " | ".join(bold(n, c) for c, n in enumerate(train_counts)) + " |",
    ]
    for label, accuracy in rows:
        cells = " | ".join(bold(f"{a:.1f}", c) for c, a in enumerate(accuracy))
        lines.append(f"| Test acc ({label}) | {cells} |")
    return "\n".join(lines) + "\n"


def tables_markdown(results: dict, claims: dict) -> str:
    """The per-class tables (the paper's Tables 2 and 3) of the digits experiments that ran, in markdown."""
    tables = []
    for key in ("digits_chi2", "digits_cvar"):
        if key in results:
            seeds = len(next(iter(results[key]["seed_runs"].values())))
            note = (f"mean over {seeds} seed{'s' if seeds > 1 else ''} at each method's chosen learning rate; "
                    "the bold column is the class the baseline classifies worst")
            tables.append(PAPER_TABLES[key](results[key], claims, note))
    return "\n".join(tables)


def table_2(chi2: dict, claims: dict, note: str) -> str:
    return accuracy_table(
        f"Table 2 (here): chi2-penalized DRO, imbalanced digits, test accuracy (%) per class ({note}).",
        chi2["data"]["train_per_class"],
        [("SGD+Momentum", mean_accuracy(chi2["seed_runs"]["sgd"])),
         ("Normalized SGD+Mom.", mean_accuracy(chi2["seed_runs"]["nsgd"]))],
        claims["c"]["worst_class"],
    )


def table_3(cvar: dict, claims: dict, note: str) -> str:
    return accuracy_table(
        f"Table 3 (here): CVaR-DRO, imbalanced digits, test accuracy (%) per class ({note}).",
        cvar["data"]["train_per_class"],
        [("CVaR", mean_accuracy(cvar["seed_runs"]["cvar"])),
         ("Smoothed CVaR", mean_accuracy(cvar["seed_runs"]["smoothed_cvar"]))],
        claims["d"]["worst_class"],
    )


PAPER_TABLES = {"digits_chi2": table_2, "digits_cvar": table_3}


def _mean_std_range(values: list) -> str:
    std = float(np.std(values, ddof=1)) if len(values) > 1 else 0.0
    return f"{np.mean(values):.1f} +- {std:.1f} [{min(values):.1f}, {max(values):.1f}]"


def _hyperparameters(run: Run) -> str:
    knob = GROUP_METHODS[run.extra["method"]][1]
    return f"lr {run.lr:g}" + (f", {knob} {run.extra['strength']:g}" if knob else "")


def group_table(result: dict) -> str:
    """The spurious digits as a markdown table: per method its chosen hyperparameters, the epoch its runs kept, the
    worst-group and overall test accuracy (mean +- std [lowest, highest] over the seeds) and each group's mean test
    accuracy."""
    seeds = len(result["seed_runs"]["erm"])
    counts = result["data"]["train"]["per_group"]
    lines = [
        f"Beyond the paper: digits with a spurious bar, test accuracy (%) (mean +- std [lowest, highest] over "
        f"{seeds} seed{'s' if seeds > 1 else ''}; per group: the mean; hyperparameters and each run's epoch picked "
        "on the validation split; kept epoch: median [lowest, highest] over the seeds).",
        "",
        "| Method | Hyperparameters | Kept epoch | Worst-group | Average | "
        + " | ".join(f"{name} ({n} train)" for name, n in zip(GROUP_NAMES, counts)) + " |",
        "|---|---|---|---|---|" + "---|" * len(GROUP_NAMES),
    ]
    for method, label in result["methods"].items():
        runs = result["seed_runs"][method]
        per_group = np.mean([run.extra["test_group_accuracy"] for run in runs], axis=0)
        epochs = [run.extra["selected_epoch"] for run in runs]
        lines.append(f"| {label} | {_hyperparameters(runs[0])} | "
                     f"{statistics.median(epochs):g} [{min(epochs)}, {max(epochs)}] | "
                     f"{_mean_std_range([worst_group_accuracy(r) for r in runs])} | "
                     f"{_mean_std_range([r.extra['test_accuracy'] for r in runs])} | "
                     + " | ".join(f"{a:.1f}" for a in per_group) + " |")
    return "\n".join(lines) + "\n"


def _fmt(value: float) -> str:
    return ("inf" if value > 0 else "-inf") if math.isinf(value) else f"{value:.3g}"


def _median_with_spread(stats: dict) -> str:
    return f"{_fmt(stats['median'])} [{_fmt(stats['low'])}, {_fmt(stats['high'])}]"


def _comparison_phrase(c: dict, baseline: str, method: str) -> tuple:
    """How the two methods' medians compare, in words: (level, speed). A median is +inf when most seeds
    diverged."""
    base_diverged, method_diverged = (math.isinf(c["level"][who]["median"]) for who in ("baseline", "method"))
    if base_diverged or method_diverged:
        who = "both" if base_diverged and method_diverged else baseline if base_diverged else method
        return (f"{who} diverged on most seeds",) * 2
    ratio, gap = c["level_ratio"], c["speed_gap"]
    if math.isinf(ratio):
        level = f"{method} settles at 0"
    else:
        level = f"{method} {ratio:.3g}x lower" if ratio >= 1 else f"{method} {1 / ratio:.3g}x higher"
    return level, f"{method} {abs(gap):.2f} {'lower (faster)' if gap > 0 else 'higher (slower)'}"


def _optimization_cell(c: dict, baseline: str, method: str) -> str:
    """The numbers behind an (a)/(b) verdict: medians over the seeds, each with its seed-to-seed spread."""
    level_phrase, speed_phrase = _comparison_phrase(c, baseline, method)
    diverged = ""
    if c["baseline_diverged_lrs"] or c["method_diverged_lrs"]:
        diverged = (f"; diverged at {len(c['baseline_diverged_lrs'])} grid lrs ({baseline}) vs "
                    f"{len(c['method_diverged_lrs'])} ({method})")
    if c["baseline_diverged_seeds"] or c["method_diverged_seeds"]:
        diverged += (f"; at the chosen lr diverged on seeds {c['baseline_diverged_seeds']} ({baseline}) and "
                     f"{c['method_diverged_seeds']} ({method})")
    seeds, level, speed_stats = len(c["seeds"]), c["level"], c["speed"]
    return (f"median [lowest, highest seed] of the level (mean exact objective of the last {c['tail_epochs']} "
            f"epochs): {baseline} (lr {c['baseline_lr']:g}) {_median_with_spread(level['baseline'])} vs {method} "
            f"(lr {c['method_lr']:g}) {_median_with_spread(level['method'])}, "
            f"{level_phrase}; of the speed (mean log-objective over the epochs): "
            f"{_median_with_spread(speed_stats['baseline'])} vs {_median_with_spread(speed_stats['method'])}, "
            f"{speed_phrase}; per seed, {method} lower on {c['seeds_lower']}/{seeds}, "
            f"faster on {c['seeds_faster']}/{seeds}, both on {c['seeds_holding']}/{seeds} "
            f"({_needed_phrase(c)}){diverged}")


def _needed_phrase(c: dict) -> str:
    """How many seeds a ``yes`` needs, and on how many each rounding probe held (how near its threshold it was)."""
    probes = c.get("probe_seed_counts") or []
    held = "" if not probes else "; the rounding probes " + ", ".join(f"{n}/{len(c['seeds'])}" for n in probes)
    return f"{c['seeds_needed']} needed{held}"


def _accuracy_cell(c: dict, method: str) -> str:
    if math.isinf(c["mean_gain_standard_error"]):
        noise = "one seed: no gain counts"
    else:
        # Where it does not count, the gain is within the noise or below it (a loss beyond the noise is no "within").
        below = c["mean_gain"] < -GAIN_STANDARD_ERRORS * c["mean_gain_standard_error"]
        counts = "beyond" if c["gain_counts"] else ("below minus" if below else "within")
        # To two decimals, the mean gain and the threshold both: at one, a gain of 0.45 "within 2" standard errors
        # of 0.24 read as +0.5 within 2 x 0.2.
        threshold = GAIN_STANDARD_ERRORS * c["mean_gain_standard_error"] * (-1.0 if below else 1.0)
        noise = (f"the mean gain's standard error over the seeds {c['mean_gain_standard_error']:.2f} points (the gain "
                 f"is {counts} {GAIN_STANDARD_ERRORS:g} of them, {threshold:.2f})")
    return (f"{method} better on {c['classes_improved']}/{c['num_classes']} classes; mean gain {c['mean_gain']:+.2f} "
            f"points; worst class (digit {c['worst_class']}) {c['worst_class_gain']:+.1f}; largest gain on digit "
            f"{c['largest_gain_class']} ({c['gains'][c['largest_gain_class']]:+.1f}); {c['seeds']} seeds; {noise}")


def _worst_group_cell(c: dict, method: str) -> str:
    """The numbers behind an (e)/(f) verdict: worst-group and average test accuracy over the seeds."""
    wg, average, seeds = c["worst_group"], c["average"], len(c["seeds"])

    def stats(s: dict[str, float]) -> str:
        return f"{s['mean']:.1f} +- {s['std']:.1f} (median {s['median']:.1f} [{s['low']:.1f}, {s['high']:.1f}])"

    return (f"worst-group test accuracy (%), mean +- std (median [lowest, highest seed]): ERM {stats(wg['baseline'])} "
            f"vs {method} {stats(wg['method'])}; {method} higher on {c['seeds_higher']}/{seeds} seeds "
            f"({_needed_phrase(c)}); average test accuracy {average['baseline']['mean']:.1f} +- "
            f"{average['baseline']['std']:.1f} vs {average['method']['mean']:.1f} +- {average['method']['std']:.1f}")


TASK_NAMES = {"example_3_1": "Example 3.1", "regression": "regression", "digits_chi2": "digits",
              "group_dro": "spurious digits, GroupDROLoss", "group_chi2": "spurious digits, DROLoss(num_groups=4)",
              "chi2": "spurious digits, DROLoss over samples"}


def verdict_cell(c: dict) -> str:
    """A claim's verdict; where the rounding probes disagreed, what the runs as trained and each probe gave."""
    if c["verdict"] == NOT_SETTLED:
        return f"{NOT_SETTLED} ({' / '.join(c['verdicts'])})"
    return c["verdict"]


def claims_table(claims: dict) -> str:
    """The claims as a markdown table: what the paper says, what happened here, whether it reproduced."""
    rows = ["| Claim | Paper | Here | Reproduced |", "|---|---|---|---|"]

    def row(key: str, task: str, here: str, c: dict) -> None:
        rows.append(f"| ({key}) {task} | {CLAIMS[key]} | {here} | {verdict_cell(c)} |")

    for task, c in claims.get("a", {}).get("tasks", {}).items():
        row("a", TASK_NAMES[task], _optimization_cell(c, "SGD+mom", "NSGD+mom"), c)
    if "b" in claims:
        row("b", "digits", _optimization_cell(claims["b"], "CVaR", "smoothed CVaR"), claims["b"])
    if "c" in claims:
        row("c", "digits", _accuracy_cell(claims["c"], "NSGD+mom"), claims["c"])
    if "d" in claims:
        row("d", "digits", _accuracy_cell(claims["d"], "smoothed CVaR"), claims["d"])
    for task, c in claims.get("e", {}).get("tasks", {}).items():
        row("e", TASK_NAMES[task], _worst_group_cell(c, GROUP_METHODS[task][0]), c)
    if "f" in claims:
        row("f", TASK_NAMES["chi2"], _worst_group_cell(claims["f"], GROUP_METHODS["chi2"][0]), claims["f"])
    return "\n".join(rows) + "\n"


def grid_edge_notes(results: dict) -> list:
    """A line per best learning rate at an end of its grid: the search may not have found the best rate."""
    notes = []
    for key, result in results.items():
        grid = result["grid"]
        if key == "spurious_digits":
            notes += group_grid_edge_notes(result)
            continue
        for name, best in result["best"].items():
            if best.lr in (grid[0], grid[-1]):
                notes.append(f"- Note: the chosen learning rate of {name} in {key} ({best.lr:g}) is at an end of "
                             "the grid.")
    return notes or ["Every chosen learning rate lies inside its grid."]


def _chosen(result: dict, method: str) -> str:
    """The hyperparameters a search picked for ``method``: its learning rate, and its strength where it has one."""
    best = result["best"][method]
    strength = best.extra.get("strength")
    knob = GROUP_METHODS[method][1] if method in GROUP_METHODS else None
    return f"lr {best.lr:g}" + (f", {knob} {strength:g}" if knob is not None and strength is not None else "")


def probe_choice_notes(results: dict, probe_results: Sequence[dict]) -> list:
    """A line per method whose search picked other hyperparameters in a rounding probe than in the runs as trained:
    a verdict that then moves compares other settings, not only other rounding."""
    if not probe_results:
        return []
    notes = []
    for key, result in results.items():
        for method in result["best"]:
            chosen = [_chosen(result, method)] + [_chosen(probe[key], method) for probe in probe_results]
            if len(set(chosen)) > 1:
                notes.append(f"- The search of {method} in {key} picked {chosen[0]} as trained, and "
                             + ", ".join(f"{c} in probe {i}" for i, c in enumerate(chosen[1:], 1)) + ".")
    return notes or ["Every search picked the same hyperparameters in the rounding probes as in the runs as trained."]


def group_grid_edge_notes(result: dict) -> list:
    """:func:`grid_edge_notes` for the spurious digits: a chosen learning rate or strength at an end of its grid."""
    notes = []
    for method, best in result["best"].items():
        knob = GROUP_METHODS[method][1]
        for name, value in (("lr", best.lr), (knob, best.extra["strength"])):
            grid = result["grid"].get(name)
            if name is not None and len(grid) > 1 and value in (grid[0], grid[-1]):
                notes.append(f"- Note: the chosen {name} of {method} in spurious_digits ({value:g}) is at an end of "
                             "its grid.")
    return notes


def verdict_rule(seeds: list, rounding_probes: int) -> str:
    """How the verdicts are reached, in words (report.md and the README's claims block)."""
    n, needed = len(seeds), seeds_needed(len(seeds))
    return (
        f"(a)/(b): each method's learning rate is the fastest of the grid (lowest mean log-objective) on seed "
        f"{seeds[0]}, then every seed ({', '.join(map(str, seeds))}: model initialization and batch order) trains "
        f"at it. Per seed, a run's level is the mean of the exact objective on the training set over the last "
        f"{TAIL_EPOCHS} epochs and its speed the mean log-objective over the epochs; the claim holds on a seed "
        "when the method's level and speed are both below the baseline's on that seed, and on the medians when "
        f"each method's median over the seeds are. **yes**: it holds on the medians and on at least {needed} of "
        f"{n} seeds; **partly**: on the medians only, or (for (a)) on some of its three tasks; **no**: otherwise. "
        "Each figure is a median over the seeds, with the lowest and the highest seed beside it. (c)/(d) compare "
        "held-out per-class test accuracy, the mean over the same seeds at the same learning rates; a gain counts "
        f"when the mean gain exceeds {GAIN_STANDARD_ERRORS:g} standard errors of it (from the per-seed mean gains). "
        "**yes**: the gain counts, every class improves and the worst class gains at least the mean; **partly**: the "
        "gain counts and the worst class improves; **no**: otherwise. (e)/(f), "
        "beyond the paper: each method's learning rate and strength are the pair of the grid with the best "
        f"worst-group validation accuracy on seed {seeds[0]}, then every seed trains at them, each run judged at "
        "its epoch of best worst-group validation accuracy; the claim holds on a seed when the method's "
        "worst-group test accuracy is above ERM's on that seed, and on the medians when its "
        "median over the seeds is; **yes**/**partly**/**no** as for (a)/(b), and for (e) over its two methods as "
        "for (a) over its tasks. " + probes_rule(rounding_probes)
    )


def probes_rule(rounding_probes: int) -> str:
    """How the verdicts are checked against rounding, in words."""
    if rounding_probes == 0:
        return ("Rounding: not checked in this run (`--rounding-probes 0`); another processor's rounding may "
                "change a verdict.")
    runs = "once more" if rounding_probes == 1 else f"{rounding_probes} more times"
    return (f"Rounding: every experiment (the searches and the seeds) ran {runs} with each initial parameter moved "
            "one floating-point step up or down at random, a stand-in for another processor's float32 rounding; "
            "a verdict is stated only where the runs as trained and every such probe give the same one, else it is "
            f"**{NOT_SETTLED}**, followed by the verdict of the runs as trained and of each probe. The figures "
            "are those of the runs as trained, but for the count of seeds each probe holds on, beside the count a "
            "verdict needs.")


def cpu_builds_phrase(meta: dict) -> str:
    builds = meta["cpu_builds"]
    return f"CPU builds: ATen `{builds['aten']}`, dro_ext `{builds['dro_ext']}`"


def timing_phrase(meta: dict) -> str:
    """The run's wall and CPU time, and how busy the machine was: the demo runs on one thread (per process with
    ``--jobs``), so on a quiet machine its wall time is about its CPU time (over the processes); a smaller share of
    a core means other jobs shared it."""
    wall, cpu, load = meta["seconds_total"], meta["cpu_seconds_total"], meta["load_average"]
    cpus, jobs = meta["machine"]["logical_cpus"], meta.get("jobs", 1)
    phrase = f"{wall:.0f} s wall, {cpu:.0f} s CPU ({100 * cpu / wall:.0f}% of one core"
    if jobs > 1:
        phrase += f", {jobs} processes at once"
    if load["start"] is not None:
        phrase += f"; load average {load['start']:.1f} at the start and {load['end']:.1f} at the end on {cpus} CPUs"
    if (jobs == 1 and cpu < 0.9 * wall) or (load["start"] is not None and max(load["start"], load["end"]) > cpus):
        phrase += "; other jobs shared the machine: a quiet one's wall time is shorter"
    return phrase + ")"


def group_section(result: dict, settings: dict) -> list:
    """report.md's lines on the spurious digits: the task, how it was trained and tuned, what to read."""
    train, val, test = (result["data"][split] for split in ("train", "val", "test"))
    per_group = "; ".join(f"{name} {a} / {b} / {c}" for name, a, b, c in
                          zip(GROUP_NAMES, train["per_group"], val["per_group"], test["per_group"]))
    task = (
        "scikit-learn's digits as \"is the digit below 5?\", with a bright bar on the image's left edge (a column "
        f"the digits almost never ink) that agrees with the label in {100 * train['agreement']:.0f}% of the "
        f"{train['samples']} training images and in {100 * val['agreement']:.0f}% / {100 * test['agreement']:.0f}% "
        f"of the {val['samples']} validation / {test['samples']} test images. Groups: (label, bar), 4 of them; "
        f"training / validation / test images per group: {per_group}. A model that reads the bar instead of the "
        "digit is right on 95% of the training set and on half of the test set; the worst group's test accuracy "
        "says how much it does."
    )
    method = (
        "The same MLP 64-64-64-2 and NormalizedSGD (momentum 0.9, eps 0.1, batch 128, "
        f"{settings['groups_epochs']} epochs) train four objectives of the same per-sample cross-entropy: ERM (its "
        "mean), `GroupDROLoss` (online Group DRO, Sagawa et al.), chi2 over groups (`DROLoss(num_groups=4)`: the "
        "paper's penalized chi2 over the batch's group means) and chi2 over samples (`DROLoss`: the only one that "
        "needs no group labels in training). Each method's learning rate (grid "
        f"{list(settings['groups_lrs'])}) and strength (GroupDROLoss step_size {list(settings['groups_step_sizes'])},"
        f" chi2 lam {list(settings['groups_lams'])}) are the pair with the best worst-group validation accuracy "
        "(ties: the best mean over the groups) on the first seed, searched once, never on the test set; every "
        "method, sample-level chi2 included, uses the validation split's group labels for that search. Panel (e) "
        "of the figure shows the worst-group test accuracy per epoch. The numbers are those of each run's kept epoch: "
        "the one with the best worst-group validation accuracy (ties: the best mean over the groups, then the "
        "earliest), the model selection Group DRO is evaluated with. The last epoch's would be a draw: with a "
        "constant learning rate the worst group's accuracy swings by tens of points from one epoch to the next, "
        "and one rounding step changed which hyperparameters won and the verdicts (e) and (f) read on it."
    )
    return ["## Beyond the paper: Group DRO on digits with a spurious feature", "", task, "", method, "",
            group_table(result)]


def overall_line(claims: dict) -> str:
    """The verdict of each claim that was assessed, in one line."""
    def verdicts(keys: str) -> str:
        return ", ".join(f"({key}): **{claims[key]['verdict']}**" for key in keys if key in claims)

    paper, beyond = verdicts("abcd"), verdicts("ef")
    if not beyond:
        return f"Overall {paper}."
    return f"Overall {paper}; beyond the paper, {beyond}." if paper else f"Overall, beyond the paper, {beyond}."


def what_ran(results: dict, settings: dict) -> list:
    """report.md's bullet per experiment that ran."""
    lines = []
    if "example_3_1" in results:
        lines += [
            "- Example 3.1: l(x; xi) = x^2 (1 + xi/(x^2+1))^2, xi Rademacher, chi2 DRO with lam = 1 (the example's),",
            f"  x = 10 and eta = 0 at the start; an epoch is {settings['example_steps_per_epoch']} steps of 128 fresh "
            f"xi; {settings['example_epochs']} epochs; Psi exact over the two-point population;",
            f"  grid {list(settings['example_grid'])}.",
        ]
    if "regression" in results:
        regression = results["regression"]
        lines += [
            f"- Regression: {regression['n_train']} training / {regression['n_test']} test synthetic ages "
            f"({100 * regression['band_18_30_fraction']:.0f}% in 18-30, like AFAD-Full),",
            f"  targets in years, squared error, MLP 16-64-64-1, {settings['regression_epochs']} epochs;",
            f"  grid {list(settings['regression_grid'])}.",
        ]
    digits = results.get("digits_chi2", results.get("digits_cvar"))
    if digits is not None:
        lines += [
            "- Digits: scikit-learn 8x8 digits, a stratified third held out, training classes subsampled by the",
            f"  paper's rho ({sum(digits['data']['train_per_class'])} training images), MLP 64-128-128-10,",
            f"  cross-entropy, {settings['digits_epochs']} epochs; grid {list(settings['digits_grid'])}. CVaR and",
            "  smoothed CVaR both train with SGD+momentum (Section 3.3: SGD suffices for smoothed CVaR) and are",
            "  judged by the CVaR objective.",
        ]
    if "spurious_digits" in results:
        lines.append("- Spurious digits (beyond the paper): see the section above.")
    return lines


def source_phrase(meta: dict) -> str:
    """"; code: git commit X" (" with local changes" where the tracked files differed), "" where unknown (a run
    outside a git checkout, or one recorded before runs named their code)."""
    source = meta.get("source")
    if not source:
        return ""
    return f"; code: git commit `{source['git_commit'][:12]}`" + (" with local changes" if source["modified"] else "")


def report_markdown(results: dict, claims: dict, meta: dict, probe_results: Sequence[dict] = ()) -> str:
    settings = meta["settings"]
    lines = [
        "# dro_ext demo: the paper's experiments at laptop scale",
        "",
        f"Run on {meta['date_utc']} (UTC), {meta['machine']['description']}, device `{meta['device']}`, "
        f"backend `{meta['versions']['dro_ext_backend']}`, {cpu_builds_phrase(meta)}, seed {meta['seed']}, "
        f"{'quick' if meta['quick'] else 'full'} settings; took {timing_phrase(meta)}.",
        f"Command: `{meta['command']}`{source_phrase(meta)}",
        "",
        "## Claims",
        "",
        "Verdicts: yes = reproduced here, partly = part of it reproduced, no = not reproduced, not settled = one",
        "rounding step changes it; the numbers are this run's.",
        "",
        verdict_rule(meta["seeds"], meta["settings"]["rounding_probes"]),
        "",
        overall_line(claims),
        "",
        claims_table(claims),
        "## Figure",
        "",
        "![training curves](figure.png)",
        "",
        *(["## Per-class test accuracy", "", tables_markdown(results, claims)]
          if "digits_chi2" in results or "digits_cvar" in results else []),
        *(group_section(results["spurious_digits"], settings) if "spurious_digits" in results else []),
        "## What ran",
        "",
        "Shared settings (paper Section 5.1, Appendix E): lam = 0.1, alpha = 0.02, momentum 0.9, batch 128,",
        "NormalizedSGD eps = 0.1, each optimizer's learning rate picked from the same grid as the one with the",
        "lowest mean log-objective over the epochs (the fastest optimization); a run whose objective stops",
        "being finite counts as diverged.",
        "",
        *what_ran(results, settings),
        f"- Seeds {meta['seeds']}: the learning-rate search runs on the first; each chosen learning rate then",
        "  trains on every seed (model initialization and batch order; the data are the first seed's). The claims",
        "  and the tables use every seed.",
        "",
        *grid_edge_notes(results),
        *probe_choice_notes(results, probe_results),
        "",
        "Repeatability: the same seed on the same machine and build (processor, SIMD builds of ATen's and",
        "dro_ext's CPU kernels, library versions) and the same `--threads` gives bitwise the same numbers, with",
        "any `--jobs`. The thread count is part of the build: the BLAS splits some float32 matmuls by it.",
        "Another processor or SIMD build (`ATEN_CPU_CAPABILITY`) rounds float32 differently and the training",
        "is chaotic, so the digits differ; the verdicts are what carries over, which is why (a)/(b) are judged",
        "over seeds and epochs, and why a verdict that the rounding probes change is not stated.",
        "",
        "Scale: the paper trains ResNet-18 on AFAD-Full (160K images) and imbalanced CIFAR-10 for 100-200 epochs;",
        "this demo keeps its settings and shrinks the data and the model so that it runs in minutes on a CPU.",
        "Every curve, learning rate and seed is in `results.json`.",
        "",
    ]
    return "\n".join(lines)


def _jsonable(value: object) -> object:
    """Runs become dicts; non-finite floats become null (strict JSON)."""
    if isinstance(value, Run):
        return _jsonable(dataclasses.asdict(value))
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


def write_outputs(out: Path, results: dict, claims: dict, meta: dict, probe_results: Sequence[dict] = ()) -> dict:
    """Write figure.png, tables.md, report.md and results.json into ``out``; return their paths. The figure and
    the tables show ``results`` (the runs as trained); results.json also holds each rounding probe's."""
    out.mkdir(parents=True, exist_ok=True)
    paths = {name: out / name for name in ("figure.png", "tables.md", "report.md", "results.json")}
    plot_figure(results, paths["figure.png"])
    tables = [tables_markdown(results, claims)] if "digits_chi2" in results or "digits_cvar" in results else []
    if "spurious_digits" in results:
        tables.append(group_table(results["spurious_digits"]))
    paths["tables.md"].write_text("\n".join(tables))
    paths["report.md"].write_text(report_markdown(results, claims, meta, probe_results))
    payload = {"meta": meta, "claims": claims, "experiments": results, "rounding_probes": list(probe_results)}
    paths["results.json"].write_text(json.dumps(_jsonable(payload), indent=1, allow_nan=False) + "\n")
    return paths


README_BEGIN = "<!-- demo-claims:begin -->"
README_END = "<!-- demo-claims:end -->"


def check_readme(readme: Path, figure: Path) -> str:
    """``readme``'s text, after checking that update_readme can rewrite it: it holds the demo block, and the figure
    lies in its folder (the block links it by a relative path). Raises ValueError (OSError where it cannot be
    read)."""
    text = readme.read_text()
    if README_BEGIN not in text or README_END not in text:
        raise ValueError(f"{readme} has no {README_BEGIN} ... {README_END} block to update")
    if not Path(figure).resolve().is_relative_to(readme.resolve().parent):
        raise ValueError(f"the figure ({figure}) must lie in the README's folder, {readme.resolve().parent}, which "
                         f"links it by a relative path: pass an --out inside that folder")
    return text


def update_readme(readme: Path, claims: dict, meta: dict, figure: Path) -> None:
    """Replace the block between the demo markers in ``readme`` with this run's figure and claims table."""
    text = check_readme(readme, figure)
    rel = Path(figure).resolve().relative_to(readme.resolve().parent).as_posix()
    block = "\n".join([
        README_BEGIN,
        f"Full run of {meta['date_utc'][:10]} on {meta['machine']['description']}, device `{meta['device']}`, "
        f"{cpu_builds_phrase(meta)}, "
        f"{timing_phrase(meta)} (`{meta['command']}`):",
        "",
        f"![training curves]({rel})",
        "",
        verdict_rule(meta["seeds"], meta["settings"]["rounding_probes"]),
        "",
        claims_table(claims),
        README_END,
    ])
    pattern = re.escape(README_BEGIN) + ".*?" + re.escape(README_END)
    readme.write_text(re.sub(pattern, lambda _: block, text, flags=re.S))
