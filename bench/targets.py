"""The speed and memory targets of issues 8 and 11, checked against the benchmarks' result files: each one met,
missed, or not measured. Issue 8 sets the CUDA targets of the loss, the optimizer step and the robust objective;
issue 11 those of the fused cross-entropy, on the CPU and on a GPU.

    python -m bench.targets [DIR ...]       # default: bench/results

A DIR holds what bench.run writes there: <bench>.json from a CPU run, <bench>_<card>.json from a GPU run
(loss_h100.json). Prints one markdown table, a row per target and result file. A --quick run does not count (its
sizes are not the targets'); a run that did not end (its settings say partial) counts for the cases it finished,
and a verdict on fewer cases than its target covers says how many it saw. scripts/gpu_check.sh prints this table
after the benchmarks.
"""
from __future__ import annotations

import argparse
import glob
import json
import math
import os
from dataclasses import dataclass
from typing import Callable

import torch

from bench.common import CASES, RESULTS_DIR, case_label, markdown_table

LOSS_CASES = [case_label(*c) for c in CASES]
ROBUST_CASES = [f"{label} {dtype}" for label in LOSS_CASES for dtype in ("float32", "float64")]


@dataclass(frozen=True)
class Target:
    issue: int
    bench: str  # the result file's base name
    device: str  # "cpu" or "cuda": the rows' device type
    text: str
    values: Callable[[list[dict]], dict[str, float]]  # one value per case, from the file's rows
    at_least: float | None = None
    at_most: float | None = None
    cases: tuple[str, ...] = ("",)  # every case the target covers; fewer measured is a partial verdict
    unit: str = "x"

    def holds(self, value: float) -> bool:
        if math.isnan(value):
            return False
        return (self.at_least is None or value >= self.at_least) and (self.at_most is None or value <= self.at_most)


def _by_case(rows, key: Callable[[dict], str], value: Callable[[dict], float], **where) -> dict[str, float]:
    """{key(row): value(row)} over the rows whose fields equal `where` (a callable field test where one is given)."""
    def matches(row):
        return all(test(row.get(f)) if callable(test) else row.get(f) == test for f, test in where.items())
    return {key(r): value(r) for r in rows if matches(r)}


def _case(r):
    return r["case"]


def _case_dtype(r):
    return f"{r['case']} {r['dtype']}"


# Issue 8 asks for the robust objective "at a tighter tolerance" than the bisection (1e-4 on eta) without a number.
# dro_ext solves to the rounding of the input dtype, so this reads it as: |Psi - float64 reference| within
# ROUNDING_EPS machine epsilons of the dtype times |Psi|. The committed CPU run is within 22 in every case (3.3 in
# float32); the bisection is within 1 in float32 (Psi is flat at its optimum) and 200 to 300,000 in float64.
ROUNDING_EPS = 64


def _robust_rounding(rows):
    """dro_ext's |Psi - reference| in units of eps(dtype) |Psi|, per case and dtype at 2^22."""
    def in_eps(r):
        return r["abs_error"] / (torch.finfo(getattr(torch, r["dtype"])).eps * max(abs(r["reference"]), 1e-300))
    return _by_case(rows, _case_dtype, in_eps, n=1 << 22, method="dro_ext")


def _cross_entropy(device, case, sizes, text, impl, value, **bound) -> Target:
    """An issue-11 target on the `case` rows of that size, read from the `impl` row by `value`."""
    op = "dro_cross_entropy" if case == "logits" else "dro_linear_cross_entropy"
    return Target(11, "cross_entropy", device, f"{op} {sizes}: {text}",
                  lambda rows: _by_case(rows, _case, value, sizes=sizes, impl=impl), cases=(case,), **bound)


def _time_over_fused(r):  # a peer's row: its time over the fused op's
    return r["time_vs_fused"]


def _fused_over_time(r):  # a peer's row: the fused op's time over the peer's
    return 1 / r["time_vs_fused"]


def _memory_over_eager(r):
    return r["memory_vs_eager"]


CE_CPU_LOGITS = "N=4096, C=32000, float32"
CE_CPU_LINEAR = "N=2048, H=1024, V=32000, float32"
CE_GPU_LINEAR = "N=16384, H=4096, V=128256, bfloat16"

def _loss_at_4096(impl: str, text: str, at_least: float) -> Target:
    """The fused loss's speedup over the `impl` rows at N = 4096, every divergence."""
    return Target(8, "loss", "cuda", text,
                  lambda rows: _by_case(rows, _case, lambda r: r["fused_speedup"], n=4096, impl=impl),
                  at_least=at_least, cases=tuple(LOSS_CASES))


def _loss_bandwidth(impl: str, text: str) -> Target:
    """The `impl` rows' share of the copy bandwidth at N = 2^24 (12 B/sample), every divergence."""
    return Target(8, "loss", "cuda", text,
                  lambda rows: _by_case(rows, _case, lambda r: 1 / r["x_floor"], n=1 << 24, impl=impl),
                  at_least=0.85, cases=tuple(LOSS_CASES), unit=" of copy bw")


def _optim_bandwidth(peer: str, text: str) -> Target:
    """The `peer` row's share of the copy bandwidth (24 B/param) on the 100M-parameter list."""
    return Target(8, "optim", "cuda", text,
                  lambda rows: _by_case(rows, lambda r: "", lambda r: 1 / r["over_floor"],
                                        list=lambda s: str(s).startswith("gpt-100M"), peer=peer),
                  at_least=0.8, unit=" of copy bw")


TARGETS = (
    _loss_at_4096("eager", "loss fwd+bwd at N=4096: >= 3x faster than eager, every divergence", 3),
    _loss_at_4096("compiled", "loss fwd+bwd at N=4096: no slower than torch.compile, every divergence", 1),
    _loss_bandwidth("fused", "loss fwd+bwd at N=2^24: >= 85% of copy bandwidth (12 B/sample), every divergence"),
    # The same readings from the CUDA-graph replays the benchmarks add on CUDA: the kernels' own time, where the
    # per-call times also hold the host's work of launching them (more than the kernels' at every N on the H100 of
    # bench/results/h100_2026-11-27). Reported beside the per-call verdicts, not instead of them.
    _loss_at_4096("eager (graph)", "loss kernels at N=4096, replayed from a CUDA graph: >= 3x less time than eager's",
                  3),
    _loss_bandwidth("fused (graph)", "loss kernels at N=2^24, replayed from a CUDA graph: >= 85% of copy bw"),
    _optim_bandwidth("NormalizedSGD fused", "NormalizedSGD step at 100M params: >= 80% of copy bandwidth (24 B/param)"),
    _optim_bandwidth("NormalizedSGD fused (graph)",
                     "NormalizedSGD kernels at 100M params, replayed from a CUDA graph: >= 80% of copy bw"),
    Target(8, "optim", "cuda", "NormalizedSGD step at 100M params: >= 1.5x faster than the best foreach",
           lambda rows: _by_case(rows, lambda r: "", lambda r: r["fused_speedup"],
                                 list=lambda s: str(s).startswith("gpt-100M"), best_foreach=True),
           at_least=1.5),
    Target(8, "robust", "cuda", "robust_objective at N=2^22: >= 20x faster than host-side bisection, every case",
           lambda rows: _by_case(rows, _case_dtype, lambda r: r["time_vs_dro_ext"], n=1 << 22,
                                 method=lambda m: str(m).startswith("bisection")),
           at_least=20, cases=tuple(ROBUST_CASES)),
    Target(8, "robust", "cuda", f"robust_objective at N=2^22: a tighter tolerance, read as an error <= {ROUNDING_EPS} "
           "eps(dtype) * Psi, every case", _robust_rounding, at_most=ROUNDING_EPS, cases=tuple(ROBUST_CASES),
           unit=" eps*Psi"),
    _cross_entropy("cpu", "logits", CE_CPU_LOGITS, ">= 1.5x faster than eager", "eager", _time_over_fused,
                   at_least=1.5),
    _cross_entropy("cpu", "logits", CE_CPU_LOGITS, "no slower than compiled", "compiled", _time_over_fused, at_least=1),
    _cross_entropy("cpu", "logits", CE_CPU_LOGITS, "<= 1/2 of eager's peak extra memory", "fused", _memory_over_eager,
                   at_most=0.5, unit="x eager's"),
    _cross_entropy("cpu", "linear", CE_CPU_LINEAR, "within 1.1x of eager's time", "eager", _fused_over_time,
                   at_most=1.1, unit="x eager's"),
    _cross_entropy("cpu", "linear", CE_CPU_LINEAR, "<= 25% of eager's peak memory", "fused", _memory_over_eager,
                   at_most=0.25, unit="x eager's"),
    _cross_entropy("cuda", "linear", CE_GPU_LINEAR, "within 1.1x of eager's time", "eager", _fused_over_time,
                   at_most=1.1, unit="x eager's"),
    _cross_entropy("cuda", "linear", CE_GPU_LINEAR, "<= 10% of eager's peak memory", "fused", _memory_over_eager,
                   at_most=0.10, unit="x eager's"),
)


def result_files(dirs: list[str], bench: str, device: str) -> list[tuple[str, dict]]:
    """(path, contents) of every <bench>.json and <bench>_*.json in dirs whose rows ran on `device`."""
    found = []
    for d in dirs:
        for path in sorted(glob.glob(os.path.join(d, f"{bench}.json")) + glob.glob(os.path.join(d, f"{bench}_*.json"))):
            with open(path) as f:
                data = json.load(f)
            if any(str(r.get("device", "")).split(":")[0] == device for r in data.get("rows", [])):
                found.append((path, data))
    return found


def verdict(target: Target, data: dict) -> tuple[str, str]:
    """(measured, verdict) of one target on one result file."""
    settings = data.get("meta", {}).get("settings", {})
    if settings.get("quick"):
        return "", "not measured (a --quick run)"
    values = target.values(data["rows"])
    if not values:
        return "", "not measured (no such rows)"
    worst = min(values, key=lambda c: (target.holds(values[c]), values[c] if target.at_least is not None
                                        else -values[c]))
    measured = f"{values[worst]:.3g}{target.unit}" + (f" (worst: {worst})" if len(values) > 1 else "")
    met = all(target.holds(v) for v in values.values())
    text = "met" if met else f"MISSED in {sum(not target.holds(v) for v in values.values())} of {len(values)}"
    if len(values) < len(target.cases):
        text += f" (partial: {len(values)} of {len(target.cases)} cases measured)"
    return measured, text


def report(dirs: list[str]) -> tuple[str, list[list]]:
    rows = []
    for target in TARGETS:
        files = result_files(dirs, target.bench, target.device)
        if not files:
            rows.append([target.issue, target.text, "", "", f"not measured (no {target.bench} result on "
                         f"{target.device})"])
        for path, data in files:
            rows.append([target.issue, target.text, os.path.basename(path), *verdict(target, data)])
    header = ["issue", "target", "file", "measured", "verdict"]
    return markdown_table(header, rows), rows


def main(argv=None) -> list[list]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("dirs", nargs="*", default=[RESULTS_DIR], help="folders with result files")
    args = parser.parse_args(argv)
    table, rows = report(args.dirs)
    print(table)
    return rows


if __name__ == "__main__":
    main()
