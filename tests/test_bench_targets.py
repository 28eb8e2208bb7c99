"""bench/targets.py: each issue target read from result files as the benchmarks write them, met or missed at its
threshold, the worst case named, partial and quick runs said as such. GPU result files are written here by hand
(no GPU is needed), with values on both sides of each threshold; the committed CPU results check that the reader
still matches the benchmarks' schema."""
import json
import pathlib

import pytest
import torch

from bench import targets
from bench.common import CASES, case_label

ROOT = pathlib.Path(__file__).resolve().parent.parent


def write(folder, name, rows, **settings):
    with open(folder / f"{name}.json", "w") as f:
        json.dump({"meta": {"settings": {"quick": False, **settings}}, "rows": rows}, f)


def verdicts(folder, text_part):
    """{file: (measured, verdict)} of the targets whose text holds text_part."""
    _, rows = targets.report([str(folder)])
    return {r[2]: (r[3], r[4]) for r in rows if text_part in r[1]}


def loss_rows(eager_speedup, n=4096, device="cuda:0"):
    rows = []
    for i, (label, speedup) in enumerate(zip([case_label(*c) for c in CASES], eager_speedup)):
        rows.append({"device": device, "case": label, "n": n, "impl": "fused", "fused_speedup": 1.0, "x_floor": 1.1})
        rows.append({"device": device, "case": label, "n": n, "impl": "eager", "fused_speedup": speedup})
    return rows


def test_a_target_met_in_every_case_and_missed_in_one(tmp_path):
    write(tmp_path, "loss_h100", loss_rows([3.0] * len(CASES)))
    assert verdicts(tmp_path, "3x faster than eager") == {"loss_h100.json": ("3x (worst: chi2)", "met")}
    speedups = [4.0] * len(CASES)
    speedups[2] = 2.99
    write(tmp_path, "loss_h100", loss_rows(speedups))
    measured, verdict = verdicts(tmp_path, "3x faster than eager")["loss_h100.json"]
    assert measured == f"2.99x (worst: {case_label(*CASES[2])})"
    assert verdict == f"MISSED in 1 of {len(CASES)}"


def test_a_bandwidth_target_reads_the_time_over_the_floor(tmp_path):
    rows = loss_rows([4.0] * len(CASES), n=1 << 24)
    write(tmp_path, "loss_h100", rows)  # x_floor 1.1: 91% of the copy bandwidth
    assert verdicts(tmp_path, "85% of copy bandwidth")["loss_h100.json"][1] == "met"
    rows[-2]["x_floor"] = 1.25  # the last case's fused row: 80%
    write(tmp_path, "loss_h100", rows)
    measured, verdict = verdicts(tmp_path, "85% of copy bandwidth")["loss_h100.json"]
    assert measured.startswith("0.8 of copy bw (worst: smoothed_cvar") and verdict.startswith("MISSED in 1 of")


def test_the_graph_replay_targets_read_the_graph_rows_only(tmp_path):
    # The per-call rows say missed, the graph rows met: each target reads its own rows.
    rows = loss_rows([2.0] * len(CASES)) + loss_rows([4.0] * len(CASES), n=1 << 24)
    for r in rows:
        r["x_floor"] = 2.0  # 50% of the copy bandwidth per call
    graph = [dict(r, impl=f"{r['impl']} (graph)") for r in rows]
    for r in graph:
        r["fused_speedup"] = 3.5 if r["impl"] == "eager (graph)" else 1.0
        r["x_floor"] = 1.1
    write(tmp_path, "loss_h100", rows + graph)
    assert verdicts(tmp_path, "3x faster than eager")["loss_h100.json"][1].startswith("MISSED in 7")
    assert verdicts(tmp_path, "85% of copy bandwidth")["loss_h100.json"][1].startswith("MISSED in 7")
    assert verdicts(tmp_path, "3x less time than eager's")["loss_h100.json"] == ("3.5x (worst: chi2)", "met")
    assert verdicts(tmp_path, "replayed from a CUDA graph: >= 85%")["loss_h100.json"][1] == "met"
    graph[-2]["x_floor"] = 1.25  # the last case's fused graph row: 80%
    write(tmp_path, "loss_h100", rows + graph)
    assert (verdicts(tmp_path, "replayed from a CUDA graph: >= 85%")["loss_h100.json"][1]
            == f"MISSED in 1 of {len(CASES)}")


def test_a_run_that_did_not_end_says_how_many_cases_it_saw(tmp_path):
    write(tmp_path, "loss_h100", loss_rows([5.0, 5.0, 5.0]), partial="3 of 21 cases, the run had not ended")
    assert verdicts(tmp_path, "3x faster than eager")["loss_h100.json"][1] == \
        f"met (partial: 3 of {len(CASES)} cases measured)"
    # the 2^24 rows were not reached at all
    assert verdicts(tmp_path, "85% of copy bandwidth")["loss_h100.json"] == ("", "not measured (no such rows)")


def test_quick_runs_other_devices_and_missing_files_do_not_count(tmp_path):
    write(tmp_path, "loss_h100", loss_rows([5.0] * len(CASES)), quick=True)
    write(tmp_path, "loss", loss_rows([5.0] * len(CASES), device="cpu"))  # a CPU run: not a CUDA target's
    assert verdicts(tmp_path, "3x faster than eager") == {"loss_h100.json": ("", "not measured (a --quick run)")}
    assert verdicts(tmp_path, "1.5x faster than the best foreach") == {
        "": ("", "not measured (no optim result on cuda)")}


def test_the_optimizer_targets_take_the_100m_list_and_the_best_foreach(tmp_path):
    rows = []
    for lst in ("resnet18 (62 tensors, 11.7M)", "gpt-100M (148 tensors, 101.2M)"):
        big = lst.startswith("gpt")
        rows += [{"device": "cuda:0", "list": lst, "peer": "NormalizedSGD fused", "fused_speedup": 1.0,
                  "over_floor": 1.2 if big else 3.0, "best_foreach": False},
                 {"device": "cuda:0", "list": lst, "peer": "foreach lerp_item", "fused_speedup": 1.4 if big else 9.0,
                  "over_floor": 2.0, "best_foreach": True},
                 {"device": "cuda:0", "list": lst, "peer": "foreach mul_add_item", "fused_speedup": 1.6,
                  "over_floor": 2.2, "best_foreach": False}]
    write(tmp_path, "optim_h100", rows)
    assert verdicts(tmp_path, "80% of copy bandwidth") == {"optim_h100.json": ("0.833 of copy bw", "met")}
    assert verdicts(tmp_path, "1.5x faster than the best foreach") == {"optim_h100.json": ("1.4x", "MISSED in 1 of 1")}
    assert verdicts(tmp_path, "replayed from a CUDA graph: >= 80%") == {
        "optim_h100.json": ("", "not measured (no such rows)")}
    # The graph rows: read by their own target only, and never the best foreach.
    rows.append({"device": "cuda:0", "list": "gpt-100M (148 tensors, 101.2M)", "peer": "NormalizedSGD fused (graph)",
                 "fused_speedup": 1.0, "over_floor": 0.9, "best_foreach": False})
    write(tmp_path, "optim_h100", rows)
    assert verdicts(tmp_path, "replayed from a CUDA graph: >= 80%") == {"optim_h100.json": ("1.11 of copy bw", "met")}
    assert verdicts(tmp_path, "80% of copy bandwidth") == {"optim_h100.json": ("0.833 of copy bw", "met")}


@pytest.mark.parametrize("dtype,error,met", [
    ("float64", 0.0, True), ("float64", 60 * 2.0**-52 * 4, True), ("float64", 70 * 2.0**-52 * 4, False),
    ("float32", 60 * 2.0**-23 * 4, True), ("float32", 70 * 2.0**-23 * 4, False)])
def test_the_robust_objective_is_solved_to_the_rounding_of_its_dtype(tmp_path, dtype, error, met):
    # Psi = 4: the error allowed is ROUNDING_EPS = 64 epsilons of the dtype times 4.
    assert targets.ROUNDING_EPS == 64
    rows = [{"device": "cuda:0", "case": "chi2", "n": 1 << 22, "dtype": dtype, "method": "dro_ext",
             "time_vs_dro_ext": 1.0, "abs_error": error, "reference": -4.0},
            {"device": "cuda:0", "case": "chi2", "n": 1 << 22, "dtype": dtype,
             "method": "bisection (torch, tol 1e-4)", "time_vs_dro_ext": 25.0, "abs_error": 1e-3, "reference": -4.0},
            {"device": "cuda:0", "case": "chi2", "n": 1 << 16, "dtype": dtype,  # not the target's N
             "method": "bisection (torch, tol 1e-4)", "time_vs_dro_ext": 2.0, "abs_error": 0.0, "reference": -4.0}]
    write(tmp_path, "robust_h100", rows)
    assert verdicts(tmp_path, "20x faster")["robust_h100.json"][1].startswith("met (partial: 1 of")
    measured, verdict = verdicts(tmp_path, "tighter tolerance")["robust_h100.json"]
    assert measured == f"{error / (4 * {'float32': 2.0**-23, 'float64': 2.0**-52}[dtype]):.3g} eps*Psi"
    assert verdict.startswith("met (partial" if met else "MISSED in 1 of 1")


def test_the_gpu_cross_entropy_target_takes_the_issues_sizes_only(tmp_path):
    def rows(sizes, eager_time, memory):
        return [{"device": "cuda:0", "case": "linear", "sizes": sizes, "impl": "fused", "time_vs_fused": 1.0,
                 "memory_vs_eager": memory},
                {"device": "cuda:0", "case": "linear", "sizes": sizes, "impl": "eager", "time_vs_fused": eager_time,
                 "memory_vs_eager": 1.0}]
    write(tmp_path, "cross_entropy_h100", rows(targets.CE_GPU_LINEAR, 1 / 1.05, 0.08) +
          rows("N=256, H=128, V=4096, bfloat16", 0.5, 0.9))
    assert verdicts(tmp_path, "within 1.1x of eager's time")["cross_entropy_h100.json"] == ("1.05x eager's", "met")
    assert verdicts(tmp_path, "10% of eager's peak memory")["cross_entropy_h100.json"] == ("0.08x eager's", "met")
    write(tmp_path, "cross_entropy_h100", rows(targets.CE_GPU_LINEAR, 1 / 1.2, 0.12))
    assert verdicts(tmp_path, "within 1.1x of eager's time")["cross_entropy_h100.json"][1] == "MISSED in 1 of 1"
    assert verdicts(tmp_path, "10% of eager's peak memory")["cross_entropy_h100.json"][1] == "MISSED in 1 of 1"


def test_the_committed_cpu_results_match_the_readers_schema():
    # Every CPU target finds its rows in the committed cross-entropy results (a renamed field or changed size
    # label in the benchmark would leave them 'not measured'); the verdicts themselves are the results'.
    _, rows = targets.report([str(ROOT / "bench" / "results")])
    cpu = [r for r in rows if r[2] == "cross_entropy.json"]
    assert len(cpu) == sum(t.device == "cpu" for t in targets.TARGETS) == 5
    for r in cpu:
        assert r[3] and r[4].split(" ")[0] in ("met", "MISSED"), r


def test_the_benchmarks_full_settings_measure_every_targets_sizes():
    # The targets hold the issues' sizes; a benchmark whose full run stopped measuring them would leave its
    # targets 'not measured' on the one GPU run there is.
    from bench import bench_cross_entropy, bench_loss, bench_optim, bench_robust
    assert {4096, 1 << 24} <= set(bench_loss.FULL_SIZES) and 1 << 22 in bench_robust.FULL_SIZES
    assert bench_robust.DTYPES == (torch.float32, torch.float64) and bench_robust.METHODS[1].startswith("bisection")
    assert sum(t.cases == tuple(targets.ROBUST_CASES) for t in targets.TARGETS) == 2
    assert 100e6 < sum(torch.Size(s).numel() for s in bench_optim.gpt_shapes()) < 110e6
    describe, cases = bench_cross_entropy.describe, bench_cross_entropy.CASES
    assert describe("linear", cases["cuda"]["linear"]) == targets.CE_GPU_LINEAR
    assert describe("linear", cases["cpu"]["linear"]) == targets.CE_CPU_LINEAR
    assert describe("logits", cases["cpu"]["logits"]) == targets.CE_CPU_LOGITS
