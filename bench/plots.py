"""Plots of the benchmark rows, written next to the tables (PNG, matplotlib's Agg renderer).

Figures are built with matplotlib.figure.Figure on an Agg canvas directly, not through pyplot: no global
backend switch and no GUI, so the benchmarks plot the same way on a headless machine, in a test, or inside
a user's notebook.
"""
from __future__ import annotations

import math

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

IMPL_STYLE = {"fused": ("tab:blue", "o"), "module": ("tab:purple", "D"), "eager": ("tab:orange", "s"),
              "compiled": ("tab:green", "^"),
              "fused (graph)": ("tab:blue", "."), "eager (graph)": ("tab:orange", ".")}


def _figure(**kwargs) -> Figure:
    fig = Figure(layout="constrained", **kwargs)
    FigureCanvasAgg(fig)
    return fig


def _grid(count: int, columns: int):
    columns = min(columns, count)
    return columns, math.ceil(count / columns)


def plot_loss(rows: list[dict], path: str, title: str = "") -> str:
    """Time per sample against N, one panel per case: fused, eager and compiled, and the floor (dashed)."""
    cases = list(dict.fromkeys(r["case"] for r in rows))
    columns, lines = _grid(len(cases), 4)
    fig = _figure(figsize=(4.2 * columns, 3.4 * lines))
    axes = fig.subplots(lines, columns, squeeze=False, sharex=True)
    for ax, case in zip(axes.flat, cases):
        case_rows = [r for r in rows if r["case"] == case]
        for impl in dict.fromkeys(r["impl"] for r in case_rows):
            pts = sorted((r["n"], r["ns_per_sample"]) for r in case_rows if r["impl"] == impl)
            color, marker = IMPL_STYLE.get(impl, ("tab:gray", "x"))
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker=marker, color=color, label=impl)
        floor = sorted({(r["n"], 1e6 * r["floor_ms"] / r["n"]) for r in case_rows if r["impl"] == "fused"})
        ax.plot([p[0] for p in floor], [p[1] for p in floor], "k--", label="floor (12 B/sample at copy bandwidth)")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_title(case)
        ax.grid(True, which="both", alpha=0.3)
    for ax in axes.flat[len(cases):]:
        ax.set_visible(False)
    for ax in axes[:, 0]:
        ax.set_ylabel("ns per sample (fwd + bwd)")
    for ax in axes[-1, :]:
        ax.set_xlabel("N (samples)")
    handles, labels = axes.flat[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="outside lower center", ncols=len(labels))
    fig.suptitle(title or "dro_loss forward + backward")
    fig.savefig(path, dpi=100)
    return path


def plot_optim(rows: list[dict], path: str, title: str = "") -> str:
    """Achieved GB/s of each peer's step (24 B/param), one panel per (threads, list); the floor is the
    copy bandwidth (a step at the floor achieves it)."""
    panels = list(dict.fromkeys((r["threads"], r["list"]) for r in rows))
    columns, lines = _grid(len(panels), 2)
    fig = _figure(figsize=(6.5 * columns, 1.0 + 0.42 * len({r["peer"] for r in rows}) * lines))
    axes = fig.subplots(lines, columns, squeeze=False)
    for ax, (threads, label) in zip(axes.flat, panels):
        panel = [r for r in rows if r["threads"] == threads and r["list"] == label]
        names = [r["peer"] for r in panel]
        colors = ["tab:blue" if n.startswith("NormalizedSGD fused") else "tab:gray" for n in names]
        ax.barh(range(len(panel)), [r["gb_per_s"] for r in panel], color=colors)
        ax.set_yticks(range(len(panel)), names, fontsize=8)
        ax.invert_yaxis()
        ax.axvline(panel[0]["copy_gb_per_s"], color="k", linestyle="--", label="floor (copy bandwidth)")
        ax.set_xlabel("GB/s (24 bytes per parameter / step time)")
        ax.set_title(f"{label}" + (f", {threads} threads" if threads else ""), fontsize=10)
        ax.legend(loc="lower right", fontsize=8)
    for ax in axes.flat[len(panels):]:
        ax.set_visible(False)
    fig.suptitle(title or "NormalizedSGD step")
    fig.savefig(path, dpi=100)
    return path


def plot_robust(rows: list[dict], path: str, title: str = "") -> str:
    """Time (top) and absolute error against the float64 reference (bottom) of every method, per case,
    one column per N; float32 inputs filled markers, float64 hollow."""
    sizes = sorted({r["n"] for r in rows})
    cases = list(dict.fromkeys(r["case"] for r in rows))
    methods = list(dict.fromkeys(r["method"] for r in rows))
    colors = ["tab:blue", "tab:red", "tab:purple", "tab:green", "tab:orange"]
    fig = _figure(figsize=(max(9.0, 2.0 + 0.9 * len(cases) * len(sizes)), 7.5))
    axes = fig.subplots(2, len(sizes), squeeze=False, sharey="row")
    width = 0.8 / max(1, len(methods))
    for column, n in enumerate(sizes):
        for m, method in enumerate(methods):
            for dtype, fill in (("float32", True), ("float64", False)):
                pts = [(cases.index(r["case"]) + (m - (len(methods) - 1) / 2) * width, r)
                       for r in rows if r["n"] == n and r["method"] == method and r["dtype"] == dtype]
                if not pts:
                    continue
                color = colors[m % len(colors)]
                kwargs = dict(color=color, marker="o" if fill else "s", linestyle="none",
                              markerfacecolor=color if fill else "none")
                label = f"{method}, {dtype}" if column == 0 else None
                axes[0, column].plot([p[0] for p in pts], [p[1]["median_ms"] for p in pts], label=label, **kwargs)
                # An exact answer (error 0) is drawn at the bottom of the axis rather than dropped.
                axes[1, column].plot([p[0] for p in pts], [max(p[1]["abs_error"], 1e-17) for p in pts], **kwargs)
        for row in (0, 1):
            ax = axes[row, column]
            ax.set_yscale("log")
            ax.set_xticks(range(len(cases)), cases if row == 1 else [""] * len(cases), rotation=40, ha="right",
                          fontsize=8)
            ax.grid(True, axis="y", which="both", alpha=0.3)
        axes[0, column].set_title(f"N = 2^{int(math.log2(n))}" if n & (n - 1) == 0 else f"N = {n}")
    axes[0, 0].set_ylabel("median ms")
    axes[1, 0].set_ylabel("|Psi - float64 reference| (0 drawn at 1e-17)")
    fig.legend(loc="outside lower center", ncols=len(methods), fontsize=8)
    fig.suptitle(title or "robust_objective")
    fig.savefig(path, dpi=100)
    return path


def plot_train(rows: list[dict], path: str, title: str = "") -> str:
    """Step time of every implementation, one panel per case, one bar per (implementation, mode); ERM's bars dark,
    dro_ext's blue, the peers' gray, and each bar labelled with its ratio to ERM's step in its mode."""
    cases = list(dict.fromkeys(r["case"] for r in rows))
    columns, lines = _grid(len(cases), 3)
    bars_most = max(sum(1 for r in rows if r["case"] == case) for case in cases)
    fig = _figure(figsize=(5.6 * columns, 1.2 + 0.32 * bars_most * lines))
    axes = fig.subplots(lines, columns, squeeze=False)
    for ax, case in zip(axes.flat, cases):
        panel = [r for r in rows if r["case"] == case and r["median_ms"] is not None]
        labels = [f"{r['impl']} [{r['mode']}]" for r in panel]
        colors = ["black" if r["impl"] == "ERM" else "tab:gray" if r["impl"].startswith("fast-dro") else "tab:blue"
                  for r in panel]
        ax.barh(range(len(panel)), [r["median_ms"] for r in panel], color=colors)
        for i, r in enumerate(panel):
            if r["x_erm"] is not None:
                ax.annotate(f" {r['x_erm']:.2f}x", (r["median_ms"], i), va="center", fontsize=7)
        ax.set_yticks(range(len(panel)), labels, fontsize=7)
        ax.invert_yaxis()
        ax.set_xscale("log")
        ax.set_xlabel("ms per step (median)")
        ax.set_title(f"{case}: {panel[0]['size']}" if panel else case, fontsize=9)
        ax.grid(True, axis="x", which="both", alpha=0.3)
    for ax in axes.flat[len(cases):]:
        ax.set_visible(False)
    fig.suptitle(title or "training step")
    fig.savefig(path, dpi=100)
    return path


def plot_groups(rows: list[dict], path: str, title: str = "") -> str:
    """Time per sample against N, one panel per G, a line per implementation (rows left out are not drawn)."""
    group_counts = sorted({r["groups"] for r in rows})
    columns, lines = _grid(len(group_counts), 3)
    fig = _figure(figsize=(4.2 * columns, 3.4 * lines))
    axes = fig.subplots(lines, columns, squeeze=False, sharex=True)
    styles = {"group_sums": ("tab:blue", "o"), "one-hot matmul": ("tab:orange", "s"), "index_add": ("tab:green", "^"),
              "GroupDROLoss": ("tab:purple", "D"), "Group DRO, one-hot": ("tab:red", "v"),
              "Group DRO, index_add": ("tab:olive", "<"), "autograd floor": ("tab:gray", ".")}
    for ax, g in zip(axes.flat, group_counts):
        g_rows = [r for r in rows if r["groups"] == g and "median_ms" in r]
        for impl in dict.fromkeys(r["impl"] for r in g_rows):
            pts = sorted((r["n"], r["ns_per_sample"]) for r in g_rows if r["impl"] == impl)
            color, marker = styles.get(impl, ("tab:gray", "x"))
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker=marker, color=color, label=impl)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_title(f"G = {g}", fontsize=9)
        ax.set_xlabel("N")
        ax.set_ylabel("ns per sample (fwd+bwd)")
        ax.grid(True, which="both", alpha=0.3)
    for ax in list(axes.flat)[len(group_counts):]:
        ax.set_visible(False)
    axes.flat[0].legend(fontsize=8)
    if title:
        fig.suptitle(title, fontsize=10)
    fig.savefig(path, dpi=110)
    return path
