"""bench/targets.py: each target read from result files as the benchmarks write them, met or missed at its
threshold, the worst case named, partial and quick runs said as such. GPU result files are written here by hand
(no GPU is needed), with values on both sides of each threshold; the committed CPU results check that the reader
still matches the benchmarks' schema."""
import json
import os
import pathlib

import pytest
import torch

from bench import targets
from bench.common import CASES, case_label

ROOT = pathlib.Path(__file__).resolve().parents[2]


def write(folder, name, rows, **settings):
    with open(folder / f"{name}.json", "w") as f:
        json.dump({"meta": {"settings": {"quick": False, **settings}}, "rows": rows}, f)


def verdicts(folder, text_part):
    """{file: (measured, verdict)} of the targets whose text holds text_part."""
    _, rows = targets.report([str(folder)])
    return {r[2]: (r[3], r[4]) for r in rows if text_part in r[1]}


def loss_rows(fused_over_mean, n=4096, device="cuda:0", impl="mean"):
    """Per divergence: the fused row and the `impl` row, whose fused_speedup is its time over the fused op's."""
    rows = []
    for label, ratio in zip([case_label(*c) for c in CASES], fused_over_mean):
        fused = impl.replace("mean", "fused")
        rows.append({"device": device, "case": label, "n": n, "impl": fused, "fused_speedup": 1.0, "x_floor": 1.1})
        rows.append({"device": device, "case": label, "n": n, "impl": impl, "fused_speedup": 1 / ratio})
    return rows


MEAN_TARGET = "N=128 and 4096: within 1.25x of losses.mean()"


def test_a_target_met_in_every_case_and_missed_in_one(tmp_path):
    rows = loss_rows([1.25] * len(CASES), n=128) + loss_rows([1.0] * len(CASES), n=4096)
    write(tmp_path, "loss_h100", rows)
    measured, verdict = verdicts(tmp_path, MEAN_TARGET)["loss_h100.json"]
    assert measured == "1.25x mean's (worst: chi2 N=128)" and verdict == "met"
    rows[-1]["fused_speedup"] = 1 / 1.26  # the last divergence at 4096: the fused op 1.26x the mean's time
    write(tmp_path, "loss_h100", rows)
    measured, verdict = verdicts(tmp_path, MEAN_TARGET)["loss_h100.json"]
    assert measured == f"1.26x mean's (worst: {case_label(*CASES[-1])} N=4096)"
    assert verdict == f"MISSED in 1 of {2 * len(CASES)}"


def test_a_partial_verdict_names_the_targets_cases_that_were_measured():
    # A run at sizes the target does not name (N = 2^22 beside 4096, without 2^20) read as a full verdict: the rows
    # were counted, not matched with the target's cases.
    target = next(t for t in targets.TARGETS if t.bench == "groups" and t.device == "cpu" and "speedup" in t.text)
    rows = [{"device": "cpu", "case": f"N={n} G={g}", "n": n, "groups": g, "impl": "group_sums",
             "speedup_vs_best_composition": 2.5} for n in (4096, 1 << 22) for g in (4, 64, 1024)]
    _, verdict = targets.verdict(target, {"meta": {"settings": {}}, "rows": rows})
    assert verdict == f"met (partial: 3 of {len(target.cases)} cases measured)"


def test_the_gpu_linear_memory_target_also_reads_the_composition_without_the_upcast(tmp_path):
    # eager upcasts bfloat16 logits to float32 (as Hugging Face transformers does), holding twice what the composition
    # in the logits' dtype holds: the bound is read against both.
    from bench.bench_cross_entropy import EAGER_IN_INPUT_DTYPE
    sizes = targets.CE_GPU_LINEAR
    rows = [{"device": "cuda", "case": "linear", "sizes": sizes, "impl": impl, "time_vs_fused": 1.0,
             "peak_extra_MiB": peak, "memory_vs_eager": peak / 24048}
            for impl, peak in (("fused", 1631), ("eager", 24048), (EAGER_IN_INPUT_DTYPE, 12024))]
    write(tmp_path, "cross_entropy_h200", rows)
    assert verdicts(tmp_path, "<= 10% of eager's peak memory")["cross_entropy_h200.json"][1] == "met"
    measured, verdict = verdicts(tmp_path, "without the upcast")["cross_entropy_h200.json"]
    assert measured == "0.136x its" and verdict == "MISSED in 1 of 1"


def test_the_loss_targets_read_the_mean_row_at_their_own_sizes(tmp_path):
    # 2^20 allows 1.6x; the 128/4096 target does not read the 2^20 rows, nor the graph replays.
    rows = loss_rows([1.5] * len(CASES), n=1 << 20) + loss_rows([3.0] * len(CASES), n=4096, impl="mean (graph)")
    write(tmp_path, "loss_h100", rows)
    assert verdicts(tmp_path, "N=2^20: within 1.6x")["loss_h100.json"] == ("1.5x mean's (worst: chi2 N=1048576)", "met")
    assert verdicts(tmp_path, MEAN_TARGET)["loss_h100.json"] == ("", "not measured (no such rows)")


def test_the_bandwidth_target_reads_the_graph_rows_only(tmp_path):
    rows = loss_rows([1.0] * len(CASES), n=1 << 24)
    for r in rows:
        r["x_floor"] = 2.0  # 50% of the copy bandwidth per call
    graph = [dict(r, impl=f"{r['impl']} (graph)", x_floor=1.1) for r in rows]
    write(tmp_path, "loss_h100", rows + graph)
    assert verdicts(tmp_path, "85% of copy bandwidth")["loss_h100.json"] == ("0.909 of copy bw (worst: chi2)", "met")
    graph[-2]["x_floor"] = 1.25  # the last case's fused graph row: 80%
    write(tmp_path, "loss_h100", rows + graph)
    measured, verdict = verdicts(tmp_path, "85% of copy bandwidth")["loss_h100.json"]
    assert measured.startswith("0.8 of copy bw (worst: smoothed_cvar") and verdict == f"MISSED in 1 of {len(CASES)}"


def test_a_run_that_did_not_end_says_how_many_cases_it_saw(tmp_path):
    write(tmp_path, "loss_h100", loss_rows([1.1, 1.1, 1.1], n=128), partial="3 of 28 cases, the run had not ended")
    assert verdicts(tmp_path, MEAN_TARGET)["loss_h100.json"][1] == f"met (partial: 3 of {2 * len(CASES)} cases measured)"
    # the 2^24 rows were not reached at all
    assert verdicts(tmp_path, "85% of copy bandwidth")["loss_h100.json"] == ("", "not measured (no such rows)")


def test_quick_runs_other_devices_and_missing_files_do_not_count(tmp_path):
    write(tmp_path, "loss_h100", loss_rows([1.0] * len(CASES), n=128), quick=True)
    write(tmp_path, "loss", loss_rows([1.0] * len(CASES), n=128, device="cpu"))  # a CPU run: its own targets
    cuda = [t.text for t in targets.TARGETS if t.bench == "loss" and t.device == "cuda"][0]
    assert verdicts(tmp_path, MEAN_TARGET) == {"loss_h100.json": ("", "not measured (a --quick run)"),
                                                "loss.json": ("1x mean's (worst: chi2 N=128)", "met (partial: 7 of 14 "
                                                                                               "cases measured)")}
    assert cuda
    assert ("", "not measured (no optim result on cuda)") in verdicts(tmp_path, "100M params: within 1.1x").values()


def optim_rows(device="cuda:0", threads=16):
    rows = []
    for lst in ("resnet18 (62 tensors, 11.7M)", "gpt-100M (148 tensors, 101.2M)"):
        big = lst.startswith("gpt")
        rows += [{"device": device, "threads": threads, "list": lst, "peer": "NormalizedSGD fused",
                  "fused_speedup": 1.0},
                 {"device": device, "threads": threads, "list": lst, "peer": targets.SGD_FUSED,
                  "fused_speedup": 1 / 1.05 if big else 1 / 3.0},  # NormalizedSGD 1.05x SGD's time on 100M
                 {"device": device, "threads": threads, "list": lst, "peer": "foreach lerp_item",
                  "fused_speedup": 1 / 1.5}]
    return rows


def test_the_optimizer_target_takes_the_100m_list_and_torch_fused_sgd(tmp_path):
    from bench import bench_optim
    assert targets.SGD_FUSED == bench_optim.SGD_FUSED
    rows = optim_rows()
    write(tmp_path, "optim_h100", rows)
    per_call = "NormalizedSGD step at 100M params: within 1.1x"
    assert verdicts(tmp_path, per_call) == {"optim_h100.json": ("1.05x SGD's", "met"),
                                            "": ("", "not measured (no optim result on cpu)")}
    assert verdicts(tmp_path, "replayed from a CUDA graph: within 1.1x") == {
        "optim_h100.json": ("", "not measured (no such rows)")}
    # The graph row: read by its own target only.
    rows.append({"device": "cuda:0", "threads": 16, "list": "gpt-100M (148 tensors, 101.2M)",
                 "peer": targets.SGD_FUSED + " (graph)", "fused_speedup": 1 / 1.2})
    write(tmp_path, "optim_h100", rows)
    assert verdicts(tmp_path, "replayed from a CUDA graph: within 1.1x") == {
        "optim_h100.json": ("1.2x SGD's", "MISSED in 1 of 1")}
    assert verdicts(tmp_path, per_call)["optim_h100.json"] == ("1.05x SGD's", "met")
    # On the CPU one verdict per thread count.
    write(tmp_path, "optim", optim_rows("cpu", 2) + optim_rows("cpu", 1))
    assert verdicts(tmp_path, per_call)["optim.json"] == ("1.05x SGD's (worst: 2 threads)", "met")


@pytest.mark.parametrize("dtype,error,met", [
    ("float64", 0.0, True), ("float64", 60 * 2.0**-52 * 4, True), ("float64", 70 * 2.0**-52 * 4, False),
    ("float32", 60 * 2.0**-23 * 4, True), ("float32", 70 * 2.0**-23 * 4, False)])
def test_the_robust_objective_is_solved_to_the_rounding_of_its_dtype(tmp_path, dtype, error, met):
    # Psi = 4: the error allowed is ROUNDING_EPS = 64 epsilons of the dtype times 4.
    assert targets.ROUNDING_EPS == 64
    rows = [{"device": "cuda:0", "case": "chi2", "n": 1 << 22, "dtype": dtype, "method": "dro_ext",
             "time_vs_dro_ext": 1.0, "abs_error": error, "reference": -4.0}]
    write(tmp_path, "robust_h100", rows)
    measured, verdict = verdicts(tmp_path, "rounding of its dtype")["robust_h100.json"]
    assert measured == f"{error / (4 * {'float32': 2.0**-23, 'float64': 2.0**-52}[dtype]):.3g} eps*Psi"
    assert verdict.startswith("met (partial" if met else "MISSED in 1 of 1")


def test_the_robust_speed_target_races_fast_dro_at_the_small_sizes(tmp_path):
    rows = []
    for case in targets.FAST_DRO_CASES:
        for dtype in ("float32", "float64"):
            for n in (*targets.FAST_DRO_SIZES, 1 << 22):
                rows.append({"device": "cuda:0", "case": case, "n": n, "dtype": dtype, "method": "fast-dro RobustLoss",
                             "time_vs_dro_ext": 25.0 if n < 1 << 22 else 2.0})  # 2^22: not the target's size
                rows.append({"device": "cuda:0", "case": case, "n": n, "dtype": dtype, "method": "bisection (torch)",
                             "time_vs_dro_ext": 1.0})  # not the peer the target names
    write(tmp_path, "robust_h100", rows)
    assert verdicts(tmp_path, "20x faster than fast-dro")["robust_h100.json"] == ("25x (worst: cvar alpha=0.1 float32 "
                                                                                 "N=128)", "met")
    rows[0]["time_vs_dro_ext"] = 19.0
    write(tmp_path, "robust_h100", rows[2:])  # the peer failed on one case: partial
    assert verdicts(tmp_path, "20x faster than fast-dro")["robust_h100.json"][1] == "met (partial: 17 of 18 cases measured)"


# ----------------------------------------------------------------------------------------------- training step

def train_rows(device="cuda:0", modes=("eager", "graph"), x_erm=1.0, syncs=0):
    from bench import bench_train
    rows = []
    for mode in modes:
        for case in bench_train.CASE_NAMES:
            for impl in bench_train.impls_for(case):
                rows.append({"device": device, "case": case, "mode": mode, "impl": impl.name,
                             "x_erm": 1.0 if impl.name == bench_train.ERM else x_erm,
                             "host_syncs": None if device == "cpu" else syncs})
    return rows


def test_the_training_step_targets_read_every_case_and_mode(tmp_path):
    from bench import bench_train
    rows = train_rows(x_erm=1.04)
    write(tmp_path, "train_h100", rows)
    sample = verdicts(tmp_path, "sample-level step (eager and graph-captured)")["train_h100.json"]
    assert sample == ("1.04x ERM's (worst: resnet18 eager: DROLoss + NormalizedSGD)", "met")
    assert verdicts(tmp_path, "exact robust_objective step (eager and graph")["train_h100.json"][1] == "met"
    assert verdicts(tmp_path, "no host synchronization")["train_h100.json"][1] == "met"
    # One slow captured step, one failed eager step (no time: missed), one host sync.
    slow = next(r for r in rows if r["mode"] == "graph" and r["impl"] == bench_train.FUSED_LINEAR_CE)
    slow["x_erm"] = 1.06
    failed = next(r for r in rows if r["mode"] == "eager" and r["impl"] == bench_train.ROBUST)
    failed["x_erm"] = None
    rows[1]["host_syncs"] = 1
    write(tmp_path, "train_h100", rows)
    n_sample = len(_train_cases_of(bench_train.SAMPLE_LEVEL))
    assert verdicts(tmp_path, "sample-level step (eager and graph")["train_h100.json"][1] == f"MISSED in 1 of {n_sample}"
    measured, verdict = verdicts(tmp_path, "exact robust_objective step (eager and graph")["train_h100.json"]
    assert measured == "nanx ERM's (worst: resnet18 eager: robust_objective + SGD)" and verdict == "MISSED in 1 of 6"
    assert verdicts(tmp_path, "no host synchronization")["train_h100.json"][1].startswith("MISSED in 1 of")


def _train_cases_of(impls):
    from bench import bench_train
    return [(mode, case, impl) for mode in ("eager", "graph") for case in bench_train.CASE_NAMES for impl in impls
            if case == "lm-head" or impl not in bench_train.LM_HEAD_ONLY]


def test_the_cpu_training_step_targets_are_eager_only_and_the_compiled_file_is_not_read(tmp_path):
    write(tmp_path, "train", train_rows("cpu", modes=("eager",), x_erm=1.02))
    write(tmp_path, "train_compile_h100", train_rows(modes=("compile",), x_erm=3.0))
    found = verdicts(tmp_path, "sample-level step (eager)")
    assert found == {"train.json": ("1.02x ERM's (worst: resnet18 eager: DROLoss + NormalizedSGD)", "met")}
    assert verdicts(tmp_path, "sample-level step (eager and graph") == {
        "": ("", "not measured (no train result on cuda)")}


def test_the_gpu_cross_entropy_target_takes_its_own_sizes_only(tmp_path):
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


def test_the_grouped_linear_targets_read_the_grouped_row_against_the_ungrouped_one(tmp_path):
    def rows(grouped, other_chunk, grouped_peak=100.0):
        common = {"device": "cuda:0", "case": "linear", "sizes": targets.CE_GPU_LINEAR, "memory_vs_eager": 0.1}
        return [dict(common, impl="fused", time_vs_fused=1.0, peak_extra_MiB=100.0),
                dict(common, impl="fused chunk=512", time_vs_fused=other_chunk, peak_extra_MiB=10.0),
                dict(common, impl="fused grouped", time_vs_fused=grouped, peak_extra_MiB=grouped_peak)]
    time, memory = "ungrouped op's time", "peak extra memory within"
    write(tmp_path, "cross_entropy_h100", rows(1.3, 2.0, grouped_peak=105.0))
    assert verdicts(tmp_path, time)["cross_entropy_h100.json"] == ("1.3x ungrouped", "met")
    assert verdicts(tmp_path, memory)["cross_entropy_h100.json"] == ("1.05x ungrouped", "met")
    write(tmp_path, "cross_entropy_h100", rows(1.4, 1.0, grouped_peak=150.0))
    assert verdicts(tmp_path, time)["cross_entropy_h100.json"] == ("1.4x ungrouped", "MISSED in 1 of 1")
    assert verdicts(tmp_path, memory)["cross_entropy_h100.json"] == ("1.5x ungrouped", "MISSED in 1 of 1")


def test_the_committed_cpu_results_match_the_readers_schema():
    # Every CPU target finds its rows in the committed CPU results (a renamed field, a changed size label or a
    # benchmark that stopped measuring a case would leave them 'not measured'); the verdicts themselves are the
    # results'.
    cpu = [t for t in targets.TARGETS if t.device == "cpu"]
    assert len(cpu) == 17
    for target in cpu:
        files = targets.result_files([str(ROOT / "bench" / "results")], target.bench, "cpu")
        assert [os.path.basename(path) for path, _ in files] == [f"{target.bench}.json"], target.text
        measured, verdict = targets.verdict(target, files[0][1])
        assert measured and verdict.split(" ")[0] in ("met", "MISSED") and "partial" not in verdict, (target.text,
                                                                                                        verdict)


def test_the_benchmarks_full_settings_measure_every_targets_sizes():
    # The targets hold their sizes; a benchmark whose full run stopped measuring them would leave its targets 'not
    # measured' on the one GPU run there is.
    from bench import bench_cross_entropy, bench_groups, bench_loss, bench_optim, bench_robust
    assert bench_groups.FULL_SIZES == targets.GROUP_SUMS_SIZES and bench_groups.FULL_GROUPS == targets.GROUP_SUMS_GROUPS
    assert {128, 4096, 1 << 20, 1 << 24} <= set(bench_loss.FULL_SIZES) and "mean" in bench_loss.IMPLS
    assert {*targets.FAST_DRO_SIZES, 1 << 22} <= set(bench_robust.FULL_SIZES)
    assert bench_robust.DTYPES == (torch.float32, torch.float64)
    assert set(targets.FAST_DRO_CASES) <= {case_label(*c) for c in CASES}
    assert sum(t.cases == tuple(targets.ROBUST_CASES) for t in targets.TARGETS) == 1
    assert 100e6 < sum(torch.Size(s).numel() for s in bench_optim.gpt_shapes()) < 110e6
    describe, cases = bench_cross_entropy.describe, bench_cross_entropy.CASES
    assert describe("linear", cases["cuda"]["linear"]) == targets.CE_GPU_LINEAR
    assert describe("linear", cases["cpu"]["linear"]) == targets.CE_CPU_LINEAR
    assert describe("logits", cases["cpu"]["logits"]) == targets.CE_CPU_LOGITS


def group_rows(speedups, bytes_per_item=4.0, device="cpu"):
    """group_sums rows of every (N, G) of the full run, with the given speedup over the fastest composition."""
    rows = []
    for (n, g), speedup in zip([(n, g) for n in targets.GROUP_SUMS_SIZES for g in targets.GROUP_SUMS_GROUPS], speedups):
        rows.append({"device": device, "case": f"N={n} G={g}", "n": n, "groups": g, "impl": "group_sums",
                     "speedup_vs_best_composition": speedup, "peak_bytes_per_n_plus_g": bytes_per_item})
        rows.append({"device": device, "case": f"N={n} G={g}", "n": n, "groups": g, "impl": "index_add",
                     "speedup_vs_best_composition": 1 / speedup, "peak_bytes_per_n_plus_g": 40.0})
    return rows


def test_group_sums_targets_read_n_from_4096_for_time_and_every_row_for_memory(tmp_path):
    # N = 128 is slower than its peers here, which the time target does not cover; the memory target covers it.
    write(tmp_path, "groups_h100", group_rows([0.5] * 3 + [2.0] * 6, device="cuda:0"))
    assert verdicts(tmp_path, "group_sums fwd+bwd")["groups_h100.json"] == ("2x (worst: N=4096 G=4)", "met")
    assert verdicts(tmp_path, "group_sums peak")["groups_h100.json"] == ("4 B/(N+G) (worst: N=128 G=4)", "met")
    rows = group_rows([3.0] * 8 + [1.9], device="cuda:0")
    rows[0]["peak_bytes_per_n_plus_g"] = targets.GROUP_SUMS_BYTES_PER_ITEM + 1.0
    write(tmp_path, "groups_h100", rows)
    assert verdicts(tmp_path, "group_sums fwd+bwd")["groups_h100.json"] == ("1.9x (worst: N=1048576 G=1024)",
                                                                           "MISSED in 1 of 6")
    assert verdicts(tmp_path, "group_sums peak")["groups_h100.json"] == (
        f"{targets.GROUP_SUMS_BYTES_PER_ITEM + 1} B/(N+G) (worst: N=128 G=4)", "MISSED in 1 of 9")


def test_the_group_dro_targets_read_the_group_dro_rows_for_time_and_memory(tmp_path):
    rows = [dict(r, impl="GroupDROLoss" if r["impl"] == "group_sums" else "Group DRO, index_add")
            for r in group_rows([2.5] * 9, bytes_per_item=6.0, device="cuda:0")]
    write(tmp_path, "groups_h100", rows)
    assert verdicts(tmp_path, "GroupDROLoss step fwd+bwd")["groups_h100.json"] == ("2.5x (worst: N=4096 G=4)", "met")
    assert verdicts(tmp_path, "GroupDROLoss step peak")["groups_h100.json"] == ("6 B/(N+G) (worst: N=128 G=4)", "met")
    rows[-2]["peak_bytes_per_n_plus_g"] = 10.0 * targets.GROUP_SUMS_BYTES_PER_ITEM
    write(tmp_path, "groups_h100", rows)
    assert verdicts(tmp_path, "GroupDROLoss step peak")["groups_h100.json"] == (
        f"{10 * targets.GROUP_SUMS_BYTES_PER_ITEM} B/(N+G) (worst: N=1048576 G=1024)", "MISSED in 1 of 9")
    assert verdicts(tmp_path, "group_sums peak")["groups_h100.json"][1] == "not measured (no such rows)"
