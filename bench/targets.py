"""The speed and memory targets, checked against the benchmarks' result files: each one met, missed, or not measured.

- training step (bench_train): every dro_ext sample-level row within 1.05x of ERM's step time on every case, the
  exact robust objective within 1.10x, eager and (CUDA) graph-captured; no host synchronization in a dro_ext step
  on CUDA. fast-dro's rows are readings, not targets.
- loss call (bench_loss): the fused loss's forward + backward against `losses.mean()`'s, the floor any loss pays:
  within 1.25x at N = 128 and 4096, 1.6x at 2^20 (12 bytes move per float32 sample against the mean's 8); at 2^24
  the kernels (graph replay) at >= 85% of copy bandwidth.
- optimizer step (bench_optim): NormalizedSGD at 100M parameters within 1.1x of torch.optim.SGD(momentum=0.9,
  fused=True), which does strictly less work (no norm), per call and replayed from a CUDA graph.
- robust objective (bench_robust): at N = 128, 4096 and 65536 at least 20x faster than fast-dro's RobustLoss on
  the same device; solved to the rounding of its dtype at 2^22.
- cross-entropy (bench_cross_entropy): time and memory against the eager and compiled logits paths; the linear op over
  groups of sequences within 1.35x of the ungrouped op's time at the same chunk size (its second pass recomputes the
  logits: one more matmul of the three), and its peak extra memory within GROUPED_CE_MEMORY_RATIO of the ungrouped
  op's.
- group sums (bench_groups): group_sums forward + backward at least 2x faster than the fastest composition (one-hot
  matmul, index_add_) at every N >= 4096 and G; its peak extra memory O(N + G), at most GROUP_SUMS_BYTES_PER_ITEM
  bytes per sample or group at every (N, G); a whole GroupDROLoss step at least 2x faster than the same step composed
  on the fastest of the two, at every N >= 4096 and G, and its peak extra memory within the same bytes per item.

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
import re
from dataclasses import dataclass
from typing import Callable

import torch

from bench.bench_cross_entropy import EAGER_IN_INPUT_DTYPE
from bench.common import CASES, RESULTS_DIR, case_label, markdown_table

LOSS_CASES = [case_label(*c) for c in CASES]
ROBUST_CASES = [f"{label} {dtype}" for label in LOSS_CASES for dtype in ("float32", "float64")]
# The divergences fast-dro's RobustLoss shares with dro_ext (bench/fast_dro_peer.py), and the sizes they race at.
FAST_DRO_CASES = ("cvar alpha=0.1", "kl_cvar alpha=0.1", "cressie_read k=2")
FAST_DRO_SIZES = (128, 4096, 1 << 16)


@dataclass(frozen=True)
class Target:
    topic: str  # what it measures: "training step", "loss call", "optimizer step", "robust objective", ...
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


def _inverse(value) -> float:
    """1 / a row's ratio, NaN where the row has none (a replay whose fused reference failed to capture)."""
    return math.nan if value is None else 1 / float(value)


def _number(value) -> float:
    """A row's figure, NaN where the row has none (an implementation that failed: never a met target)."""
    return math.nan if value is None else float(value)


# ----------------------------------------------------------------------------------------------- training step

def _train_key(r):
    return f"{r['case']} {r['mode']}: {r['impl']}"


def _train_cases(devices_modes, impls) -> tuple[str, ...]:
    from bench.bench_train import CASE_NAMES, LM_HEAD_ONLY
    return tuple(f"{case} {mode}: {impl}" for mode in devices_modes for case in CASE_NAMES for impl in impls
                 if case == "lm-head" or impl not in LM_HEAD_ONLY)


def _train_over_erm(device: str, impls, bound: float, text: str) -> Target:
    """The `impls` rows' step time over ERM's in the same mode, eager (and graph-captured on CUDA), every case."""
    modes = ("eager", "graph") if device == "cuda" else ("eager",)
    return Target("training step", "train", device, text,
                  lambda rows: _by_case(rows, _train_key, lambda r: _number(r["x_erm"]),
                                        mode=lambda m: m in modes, impl=lambda i: i in impls),
                  at_most=bound, cases=_train_cases(modes, impls), unit="x ERM's")


def _train_targets() -> tuple[Target, ...]:
    from bench.bench_train import EXACT, SAMPLE_LEVEL
    targets = []
    for device in ("cpu", "cuda"):
        where = "eager and graph-captured" if device == "cuda" else "eager"
        targets += [
            _train_over_erm(device, SAMPLE_LEVEL, 1.05, f"dro_ext sample-level step ({where}): within 1.05x of "
                            "ERM's step time, every case"),
            _train_over_erm(device, EXACT, 1.10, f"dro_ext exact robust_objective step ({where}): within 1.10x of "
                            "ERM's step time, every case"),
        ]
    targets.append(Target(
        "training step", "train", "cuda", "dro_ext step: no host synchronization, every case, eager and captured",
        lambda rows: _by_case(rows, _train_key, lambda r: _number(r["host_syncs"]), mode=lambda m: m != "compile",
                              impl=lambda i: i in SAMPLE_LEVEL + EXACT),
        at_most=0, cases=_train_cases(("eager", "graph"), SAMPLE_LEVEL + EXACT), unit=" syncs"))
    return tuple(targets)


# ----------------------------------------------------------------------------------------------- loss call

def _loss_over_mean(device: str, sizes: tuple[int, ...], bound: float, text: str) -> Target:
    """The fused loss's forward + backward time over losses.mean()'s, per call, at `sizes`, every divergence."""
    return Target("loss call", "loss", device, text,
                  lambda rows: _by_case(rows, lambda r: f"{r['case']} N={r['n']}",
                                        lambda r: _inverse(r["fused_speedup"]), n=lambda n: n in sizes, impl="mean"),
                  at_most=bound, cases=tuple(f"{c} N={n}" for c in LOSS_CASES for n in sizes), unit="x mean's")


def _loss_bandwidth(impl: str, text: str) -> Target:
    """The `impl` rows' share of the copy bandwidth at N = 2^24 (12 B/sample), every divergence."""
    return Target("loss call", "loss", "cuda", text,
                  lambda rows: _by_case(rows, _case, lambda r: 1 / r["x_floor"], n=1 << 24, impl=impl),
                  at_least=0.85, cases=tuple(LOSS_CASES), unit=" of copy bw")


# ----------------------------------------------------------------------------------------------- optimizer step

SGD_FUSED = "torch.optim.SGD(fused=True) (no norm)"  # bench_optim's peer of that name


def _optim_over_sgd(device: str, graph: bool, text: str) -> Target:
    """NormalizedSGD's step time over torch's fused SGD's on the 100M-parameter list (per thread count on the CPU)."""
    peer = SGD_FUSED + (" (graph)" if graph else "")
    return Target("optimizer step", "optim", device, text,
                  lambda rows: _by_case(rows, lambda r: f"{r['threads']} threads" if device == "cpu" else "",
                                        lambda r: _inverse(r["fused_speedup"]),
                                        list=lambda s: str(s).startswith("gpt-100M"), peer=peer),
                  at_most=1.1, unit="x SGD's")


# ----------------------------------------------------------------------------------------------- robust objective

# A "tighter tolerance" than the bisection (1e-4 on eta) is read as: |Psi - float64 reference| within ROUNDING_EPS
# machine epsilons of the dtype times |Psi|. The committed CPU run is within 1.7 in every case (0.7 in float32); the
# bisection is within 1 in float32 (Psi is flat at its optimum) and 200 to 300,000 in float64.
ROUNDING_EPS = 64


def _robust_rounding(rows):
    """dro_ext's |Psi - reference| in units of eps(dtype) |Psi|, per case and dtype at 2^22."""
    def in_eps(r):
        return r["abs_error"] / (torch.finfo(getattr(torch, r["dtype"])).eps * max(abs(r["reference"]), 1e-300))
    return _by_case(rows, _case_dtype, in_eps, n=1 << 22, method="dro_ext")


def _robust_over_fast_dro(device: str) -> Target:
    return Target("robust objective", "robust", device,
                  "robust_objective at N=128, 4096, 65536: >= 20x faster than fast-dro's RobustLoss, every shared case",
                  lambda rows: _by_case(rows, lambda r: f"{_case_dtype(r)} N={r['n']}", lambda r: r["time_vs_dro_ext"],
                                        n=lambda n: n in FAST_DRO_SIZES, method="fast-dro RobustLoss"),
                  at_least=20, cases=tuple(f"{c} {d} N={n}" for c in FAST_DRO_CASES for d in ("float32", "float64")
                                           for n in FAST_DRO_SIZES))


# ----------------------------------------------------------------------------------------------- cross-entropy

def _cross_entropy(device, case, sizes, text, impl, value, **bound) -> Target:
    """A cross-entropy target on the `case` rows of that size, read from the `impl` row by `value`."""
    op = "dro_cross_entropy" if case == "logits" else "dro_linear_cross_entropy"
    return Target("cross-entropy", "cross_entropy", device, f"{op} {sizes}: {text}",
                  lambda rows: _by_case(rows, _case, value, sizes=sizes, impl=impl), cases=(case,), **bound)


def _time_over_fused(r):  # a peer's row: its time over the fused op's
    return r["time_vs_fused"]


def _fused_over_time(r):  # a peer's row: the fused op's time over the peer's
    return 1 / r["time_vs_fused"]


def _memory_over_eager(r):
    return r["memory_vs_eager"]


def _fused_memory_over(peer: str, sizes: str) -> Callable[[list[dict]], dict[str, float]]:
    """The linear rows of that size: the fused op's peak extra memory over the `peer` row's (none where either is
    missing: the peer runs for half dtypes only)."""
    def values(rows):
        peaks = {r["impl"]: r.get("peak_extra_MiB") for r in rows
                 if r.get("case") == "linear" and r.get("sizes") == sizes}
        if peaks.get("fused") is None or not peaks.get(peer):
            return {}
        return {"linear": peaks["fused"] / peaks[peer]}
    return values


# ----------------------------------------------------------------------------------------------- group sums

# group_sums' peak extra memory per sample or group, whatever N and G: the losses' gradient (4 B per float32 sample),
# the sums and counts (8 B per group) and, on the CPU, a part's accumulators (a float and an int64 per group in
# each of 4 lanes up to 256 groups: 48 B per group; parts <= 1 + N / 16384, so their total stays within 48 G + 0.75 N)
# fit; the one-hot matrix (5 G bytes per sample) does not once G passes a dozen.
GROUP_SUMS_BYTES_PER_ITEM = 64


# The (N, G) of bench_groups' full run.
GROUP_SUMS_SIZES = (128, 4096, 1 << 20)
GROUP_SUMS_GROUPS = (4, 64, 1024)


def _group_sums_target(device: str, text: str, value, min_n: int, impl: str = "group_sums", **bound) -> Target:
    """A bench_groups target, read from the rows of impl (group_sums, or GroupDROLoss) of every G at N >= min_n."""
    cases = tuple(f"N={n} G={g}" for n in GROUP_SUMS_SIZES if n >= min_n for g in GROUP_SUMS_GROUPS)
    return Target("group sums", "groups", device, text,
                  lambda rows: _by_case(rows, _case, value, impl=impl, n=lambda n: n >= min_n),
                  cases=cases, **bound)


def _group_sums_speedup(r):
    return _number(r.get("speedup_vs_best_composition"))


def _group_sums_memory(r):
    return _number(r.get("peak_bytes_per_n_plus_g"))


GROUP_SUMS_TARGETS = tuple(target for device in ("cpu", "cuda") for target in (
    _group_sums_target(device, "group_sums fwd+bwd at N >= 4096: speedup >= 2x over the fastest composition "
                       "(one-hot matmul, index_add_), every G", _group_sums_speedup, 4096, at_least=2.0),
    _group_sums_target(device, f"group_sums peak extra memory O(N + G): <= {GROUP_SUMS_BYTES_PER_ITEM} B per "
                       "(N + G), every (N, G)", _group_sums_memory, 0, at_most=GROUP_SUMS_BYTES_PER_ITEM,
                       unit=" B/(N+G)"),
    _group_sums_target(device, "GroupDROLoss step fwd+bwd at N >= 4096: speedup >= 2x over the same step composed on "
                       "the one-hot matmul or index_add_, every G", _group_sums_speedup, 4096, impl="GroupDROLoss",
                       at_least=2.0),
    _group_sums_target(device, f"GroupDROLoss step peak extra memory O(N + G): <= {GROUP_SUMS_BYTES_PER_ITEM} B per "
                       "(N + G), every (N, G)", _group_sums_memory, 0, impl="GroupDROLoss",
                       at_most=GROUP_SUMS_BYTES_PER_ITEM, unit=" B/(N+G)")))

# The grouped linear cross-entropy's peak extra memory over the ungrouped op's, at the same chunk size: "the same
# memory" (its per-row logsumexp, losses and group sums add O(N + G) to the chunk's logits).
GROUPED_CE_MEMORY_RATIO = 1.1


def _grouped_over_ungrouped_memory(sizes: str):
    """The linear case's `fused grouped` peak extra memory over the `fused` row's, at these sizes."""
    def values(rows):
        peaks = {r["impl"]: _number(r.get("peak_extra_MiB")) for r in rows
                 if r.get("case") == "linear" and r.get("sizes") == sizes}
        if "fused grouped" not in peaks:
            return {}
        return {"linear": peaks["fused grouped"] / peaks.get("fused", math.nan)}
    return values


CE_CPU_LOGITS = "N=4096, C=32000, float32"
CE_CPU_LINEAR = "N=2048, H=1024, V=32000, float32"
CE_GPU_LINEAR = "N=16384, H=4096, V=128256, bfloat16"

TARGETS = (
    *_train_targets(),
    *(target for device in ("cpu", "cuda") for target in (
        _loss_over_mean(device, (128, 4096), 1.25, "loss fwd+bwd at N=128 and 4096: within 1.25x of losses.mean()'s, "
                        "every divergence"),
        _loss_over_mean(device, (1 << 20,), 1.6, "loss fwd+bwd at N=2^20: within 1.6x of losses.mean()'s (12 B/sample "
                        "against 8), every divergence"))),
    _loss_bandwidth("fused (graph)", "loss kernels at N=2^24, replayed from a CUDA graph: >= 85% of copy bandwidth "
                    "(12 B/sample), every divergence"),
    _optim_over_sgd("cpu", False, "NormalizedSGD step at 100M params: within 1.1x of torch.optim.SGD(fused=True)'s"),
    _optim_over_sgd("cuda", False, "NormalizedSGD step at 100M params: within 1.1x of torch.optim.SGD(fused=True)'s"),
    _optim_over_sgd("cuda", True, "NormalizedSGD step at 100M params, replayed from a CUDA graph: within 1.1x of "
                    "torch.optim.SGD(fused=True)'s"),
    _robust_over_fast_dro("cpu"),
    _robust_over_fast_dro("cuda"),
    Target("robust objective", "robust", "cuda", f"robust_objective at N=2^22: solved to the rounding of its dtype, "
           f"an error <= {ROUNDING_EPS} eps(dtype) * Psi, every case", _robust_rounding, at_most=ROUNDING_EPS,
           cases=tuple(ROBUST_CASES), unit=" eps*Psi"),
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
    # eager upcasts the logits to float32, as Hugging Face transformers does; the same bound against the composition
    # in the logits' own dtype, which holds half as much.
    Target("cross-entropy", "cross_entropy", "cuda", f"dro_linear_cross_entropy {CE_GPU_LINEAR}: <= 10% of the peak "
           f"memory of eager without the upcast ({EAGER_IN_INPUT_DTYPE})",
           _fused_memory_over(EAGER_IN_INPUT_DTYPE, CE_GPU_LINEAR), at_most=0.10, cases=("linear",),
           unit="x its"),
    *GROUP_SUMS_TARGETS,
    *(_cross_entropy(device, "linear", sizes, "over 4 groups of sequences, at the same chunk size (its memory): "
                     "within 1.35x of the ungrouped op's time", "fused grouped", _time_over_fused, at_most=1.35,
                     unit="x ungrouped")
      for device, sizes in (("cpu", CE_CPU_LINEAR), ("cuda", CE_GPU_LINEAR))),
    *(Target("cross-entropy", "cross_entropy", device, f"dro_linear_cross_entropy {sizes}: over 4 groups of "
             f"sequences, peak extra memory within {GROUPED_CE_MEMORY_RATIO}x of the ungrouped op's",
             _grouped_over_ungrouped_memory(sizes), at_most=GROUPED_CE_MEMORY_RATIO, cases=("linear",),
             unit="x ungrouped")
      for device, sizes in (("cpu", CE_CPU_LINEAR), ("cuda", CE_GPU_LINEAR))),
)


def result_files(dirs: list[str], bench: str, device: str) -> list[tuple[str, dict]]:
    """(path, contents) of every <bench>.json and <bench>_*.json in dirs whose rows ran on `device`."""
    found = []
    for d in dirs:
        # <bench>.json and <bench>_<card>.json, not another benchmark's <bench>_<more>_<card>.json (train_compile)
        paths = glob.glob(os.path.join(d, f"{bench}.json")) + glob.glob(os.path.join(d, f"{bench}_*.json"))
        for path in sorted(p for p in paths if re.fullmatch(rf"{bench}(_[a-z0-9]+)?\.json", os.path.basename(p))):
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
    # Which of the target's cases were measured, not how many rows there are: a run at other sizes than the target
    # names (N = 2^22 beside 4096, without 2^20) read as a full verdict. ("",): the target names no case labels.
    if target.cases != ("",):
        measured_cases = sum(case in values for case in target.cases)
        if measured_cases < len(target.cases):
            text += f" (partial: {measured_cases} of {len(target.cases)} cases measured)"
    return measured, text


def report(dirs: list[str]) -> tuple[str, list[list]]:
    rows = []
    for target in TARGETS:
        files = result_files(dirs, target.bench, target.device)
        if not files:
            rows.append([target.topic, target.text, "", "", f"not measured (no {target.bench} result on "
                         f"{target.device})"])
        for path, data in files:
            rows.append([target.topic, target.text, os.path.basename(path), *verdict(target, data)])
    header = ["topic", "target", "file", "measured", "verdict"]
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
