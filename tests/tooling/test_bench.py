"""The benchmark harness (bench/): its timer on both code paths, file naming and headers by device, and
the `--quick` run end to end into a temporary folder (every case present in the JSON, readable PNGs).
Timings themselves are never asserted: the harness is tested, not the machine."""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import time
import warnings

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if ROOT not in sys.path:  # bench/ is not an installed package: `pytest tests` (not `python -m pytest`) finds it here
    sys.path.insert(0, ROOT)

from bench import common  # noqa: E402
from bench.common import CASES, HostEvent, Timer, case_label, interleaved_rounds, time_fn  # noqa: E402


# ------------------------------------------------------------------------------------------- timer
def test_host_event_measures_the_interval_in_milliseconds():
    start, end = HostEvent(), HostEvent()
    start.record()
    time.sleep(0.02)
    end.record()
    end.synchronize()
    assert 20.0 <= start.elapsed_time(end) < 2000.0


def test_host_event_refuses_an_unrecorded_interval():
    with pytest.raises(RuntimeError, match="recorded"):
        HostEvent().elapsed_time(HostEvent())


def test_timer_once_returns_seconds_of_the_call():
    assert 0.015 <= Timer("cpu").once(lambda: time.sleep(0.015)) < 2.0


def test_timer_rejects_other_devices():
    with pytest.raises(ValueError, match="cpu or cuda"):
        Timer("meta")


class _FakeCudaEvent(HostEvent):
    """Stands in for torch.cuda.Event: counts what the CUDA path of Timer calls."""
    made = 0
    synchronized = 0

    def __init__(self, enable_timing=False):
        assert enable_timing, "CUDA events only time when created with enable_timing=True"
        super().__init__()
        type(self).made += 1

    def synchronize(self):
        type(self).synchronized += 1


def test_timer_cuda_path_uses_timing_events_and_waits_for_the_end_event(monkeypatch):
    # No GPU here: the CUDA branch runs against a stand-in with torch.cuda.Event's interface.
    synced = []
    monkeypatch.setattr(torch.cuda, "Event", _FakeCudaEvent)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: synced.append(device))
    _FakeCudaEvent.made = _FakeCudaEvent.synchronized = 0
    timer = Timer("cuda")
    stats = time_fn(lambda: time.sleep(0.001), timer, warmup=2, min_reps=4, min_seconds=0.0)
    assert stats["reps"] == 4 and stats["median_s"] >= 0.001
    assert _FakeCudaEvent.made == 2 * 4 and _FakeCudaEvent.synchronized == 4
    assert synced == [torch.device("cuda")]  # once after the warm-up


def test_time_fn_honours_min_reps_and_max_reps():
    calls = []
    stats = time_fn(lambda: calls.append(1), "cpu", warmup=2, min_reps=7, min_seconds=0.0)
    assert stats["reps"] == 7 and len(calls) == 9
    assert stats["p25_s"] <= stats["median_s"] <= stats["p75_s"]
    stats = time_fn(lambda: None, "cpu", warmup=0, min_reps=1, min_seconds=10.0, max_reps=5)
    assert stats["reps"] == 5


def test_quartiles_stay_within_the_samples_and_pool_the_rounds():
    # The default (exclusive) method put p25 and p75 of two samples 1.5x their range beyond them; and a round of one
    # repetition has p25 = median = p75, so the median over rounds of per-round quartiles showed no spread.
    assert common.summarize([1.0, 2.0])["p25_s"] >= 1.0 and common.summarize([1.0, 2.0])["p75_s"] <= 2.0
    assert common.quartiles([5.0]) == (5.0, 5.0)
    rounds = [common.summarize([t]) for t in (3.0, 1.0, 2.0)]
    stats = common.pooled(rounds)
    assert stats["median_s"] == 2.0 and stats["reps"] == 3
    assert 1.0 <= stats["p25_s"] < 2.0 < stats["p75_s"] <= 3.0, stats
    # Rounds of many repetitions: the quartiles bracket the median of the rounds' medians, whatever the samples.
    uneven = common.pooled([common.summarize([1.0] * 7 + [10.0]), common.summarize([10.0]), common.summarize([10.0])])
    assert uneven["p25_s"] <= uneven["median_s"] == 10.0 <= uneven["p75_s"], uneven
    single = common.pooled([common.summarize([1.0, 2.0, 4.0])])
    assert (single["p25_s"], single["median_s"], single["p75_s"]) == (1.5, 2.0, 3.0)


def test_interleaved_rounds_alternate_the_functions():
    order = []
    timed = {"a": lambda: order.append("a"), "b": lambda: order.append("b")}
    stats = interleaved_rounds(timed, Timer("cpu"), rounds=3, min_seconds=0.0, min_reps=2, warmup=1)
    # Per round: a's warm-up + 2 reps, then b's; three rounds, so b runs between a's rounds.
    assert order == (["a"] * 3 + ["b"] * 3) * 3
    assert stats["a"]["reps"] == stats["b"]["reps"] == 6


# ------------------------------------------------------------------------------- naming and headers
@pytest.mark.parametrize("name, tag", [("NVIDIA H100 80GB HBM3", "h100"), ("NVIDIA H200", "h200"),
                                       ("NVIDIA A100-SXM4-80GB", "a100"), ("NVIDIA GeForce RTX 4090", "rtx4090"),
                                       ("Tesla V100-PCIE-16GB", "v100"), ("NVIDIA", "gpu")])
def test_card_tag(name, tag):
    assert common.card_tag(name) == tag


def test_cuda_result_names_and_header_carry_the_card_driver_and_torch(tmp_path):
    info = dict(common.device_info("cpu"), device="cuda", card="NVIDIA H100 80GB HBM3", card_tag="h100",
                driver="580.65.06", cuda_runtime="13.0", compute_capability="9.0", memory_gib=79.2)
    assert common.result_name("loss", info) == "loss_h100"
    assert common.result_name("loss", common.device_info("cpu")) == "loss"
    paths = common.write_report(str(tmp_path), "loss_h100", [{"x": 1.5}], "| x |", info, load=(1.0, 2.0))
    header = open(paths["md"]).read().splitlines()[2]
    for text in ("NVIDIA H100 80GB HBM3", "driver 580.65.06", "sm_90", f"torch {torch.__version__}", "load average"):
        assert text in header
    assert json.load(open(paths["json"]))["meta"]["info"]["card_tag"] == "h100"


def test_console_table_aligns_columns():
    text = common.console_table(["case", "ms"], [["chi2", 1.5], ["smoothed_cvar alpha=0.1", 12.25]])
    lines = text.splitlines()
    assert len({len(line) for line in lines}) == 1  # numbers right-aligned to one width
    assert lines[2].startswith("chi2 ") and lines[3].endswith("12.2")


# ------------------------------------------------------------------------------------------- host syncs

class StandInSyncDebug:
    """torch.cuda.set_sync_debug_mode and a synchronizing call, on the CPU: the call warns as torch's does while the
    mode is "warn"."""

    def __init__(self):
        self.mode = "default"
        self.modes = []

    def set_mode(self, mode):
        self.mode = mode
        self.modes.append(mode)

    def get_mode(self):
        return self.mode

    def synchronize(self):
        if self.mode == "warn":
            warnings.warn(common.SYNC_WARNING, UserWarning)


def test_the_sync_counter_counts_each_synchronizing_call():
    sync = StandInSyncDebug()

    def step():
        for _ in range(3):
            sync.synchronize()
        warnings.warn("an unrelated warning", UserWarning)

    assert common.count_host_syncs(step, sync.set_mode, sync.get_mode) == 3
    assert sync.modes == ["warn", "default"]
    assert common.count_host_syncs(lambda: None, sync.set_mode, sync.get_mode) == 0
    sync.synchronize()  # the mode is back to default: no warning escapes
    # The same warning twice from one line is counted twice (Python's default filter would show it once).
    assert common.count_host_syncs(lambda: [sync.synchronize() for _ in range(2)], sync.set_mode,
                                   sync.get_mode) == 2


def test_the_sync_counter_restores_the_mode_when_the_step_raises():
    sync = StandInSyncDebug()

    def failing():
        sync.synchronize()
        raise RuntimeError("out of memory")

    with pytest.raises(RuntimeError, match="out of memory"):
        common.count_host_syncs(failing, sync.set_mode, sync.get_mode)
    assert sync.mode == "default"
    sync.set_mode("error")  # a caller's own mode is put back, not the default
    common.count_host_syncs(lambda: None, sync.set_mode, sync.get_mode)
    assert sync.mode == "error"


# ------------------------------------------------------------------------------- the --quick run
# A stand-in for a checkout of daniellevy/fast-dro (not on PyPI): the same module-level imports as its
# robust_losses.py (its own utils, and datasets, which needs torchvision and Python < 3.10) and the same
# RobustLoss signature, computing the objective with dro_ext itself. What it tests is the benchmark's loader and
# parameter mapping; bench/results/robust.md names the real checkout it ran.
FAKE_ROBUST_LOSSES = """
import torch
import utils  # noqa: F401
from datasets import CustomDistributionSampler  # noqa: F401
import dro_ext


class RobustLoss(torch.nn.Module):
    def __init__(self, size, reg, geometry, tol=1e-4, max_iter=1000, debugging=False):
        super().__init__()
        self.size, self.reg, self.geometry = size, reg, geometry

    def forward(self, v):
        if self.geometry == "cvar" and self.reg == 0:
            return dro_ext.robust_objective(v, 1.0, "cvar", alpha=self.size)[0]
        if self.geometry == "cvar":
            return dro_ext.robust_objective(v, self.reg, "kl_cvar", alpha=self.size)[0]
        assert self.geometry == "chi-square" and self.size == float("inf")
        return dro_ext.robust_objective(v, self.reg, "cressie_read", k=2.0)[0]
"""


def _fake_fast_dro_checkout(path):
    (path / "utils.py").write_text("import numpy\n")
    (path / "robust_losses.py").write_text(FAKE_ROBUST_LOSSES)
    return path


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench_quick")
    env = {**os.environ, "FAST_DRO_PATH": str(_fake_fast_dro_checkout(tmp_path_factory.mktemp("fast_dro")))}
    proc = subprocess.run([sys.executable, "-m", "bench.run", "--quick", "--out", str(out)], cwd=ROOT,
                          capture_output=True, text=True, timeout=900, env=env)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return out, proc


def _rows(out, name):
    with open(out / f"{name}.json") as f:
        data = json.load(f)
    assert data["meta"]["settings"]["quick"] is True and data["meta"]["machine"]
    assert "partial" not in data["meta"]["settings"]  # the finished run's report replaced the checkpoints
    return data["rows"]


def test_quick_loss_json_has_every_case_size_and_implementation(quick_run):
    out, _ = quick_run
    rows = _rows(out, "loss")
    from bench.bench_loss import IMPLS, QUICK_SIZES
    expected = {(case_label(*c), n, impl) for c in CASES for n in QUICK_SIZES for impl in IMPLS}
    assert {(r["case"], r["n"], r["impl"]) for r in rows} == expected and len(rows) == len(expected)
    for r in rows:
        assert r["median_ms"] > 0 and math.isfinite(r["median_ms"]) and r["floor_ms"] > 0
        assert r["p25_ms"] <= r["median_ms"] <= r["p75_ms"]
        assert r["cuda_peak_bytes"] is None  # CPU run
    assert all(r["fused_speedup"] == 1.0 for r in rows if r["impl"] == "fused")


def test_quick_optim_json_has_every_peer(quick_run):
    out, _ = quick_run
    rows = _rows(out, "optim")
    from bench.bench_optim import PEERS
    assert [r["peer"] for r in rows] == list(PEERS)
    assert all(r["gb_per_s"] > 0 and r["copy_gb_per_s"] > 0 for r in rows)
    assert sum(r["best_foreach"] for r in rows) == 1


def _stand_in_graph_replays(fns, names, device):
    # The CUDA-graph replays as bench.common.graph_replays names them, each the function itself: the rows built
    # from them are checked on the CPU, where nothing can be captured.
    return {name + common.GRAPH_SUFFIX: fns[name] for name in names if name in fns}


def test_loss_graph_rows_are_rated_against_the_fused_graph(monkeypatch):
    from bench import bench_loss
    monkeypatch.setattr(bench_loss, "graph_replays", _stand_in_graph_replays)
    impls = {"fused": bench_loss.fused_loss, "eager": bench_loss.eager_loss, "compiled": bench_loss.eager_loss}
    rows = bench_loss.bench_case("kl", {}, 1000, "cpu", Timer("cpu"), impls, rounds=1, min_seconds=0.01)
    by_impl = {r["impl"]: r for r in rows}
    assert list(by_impl) == ["fused", "eager", "compiled", "fused (graph)", "eager (graph)"]
    fused_graph = by_impl["fused (graph)"]
    assert fused_graph["fused_speedup"] == 1.0 and by_impl["fused"]["fused_speedup"] == 1.0
    eager_graph = by_impl["eager (graph)"]
    assert eager_graph["fused_speedup"] == pytest.approx(eager_graph["median_ms"] / fused_graph["median_ms"])
    assert all(by_impl[i]["saved_for_backward_bytes"] is None and by_impl[i]["cuda_peak_bytes"] is None
               for i in ("fused (graph)", "eager (graph)"))
    assert by_impl["fused"]["saved_for_backward_bytes"] is not None
    # Where the fused op's capture failed, a replay has no ratio: it read the per-call fused time before, silently.
    monkeypatch.setattr(bench_loss, "graph_replays",
                        lambda fns, names, device: _stand_in_graph_replays(fns, [n for n in names if n != "fused"],
                                                                           device))
    rows = bench_loss.bench_case("kl", {}, 1000, "cpu", Timer("cpu"), impls, rounds=1, min_seconds=0.01)
    by_impl = {r["impl"]: r for r in rows}
    assert by_impl["eager (graph)"]["fused_speedup"] is None and by_impl["eager"]["fused_speedup"] is not None


def test_optim_graph_rows_are_rated_against_the_fused_graph_and_never_the_best_foreach(monkeypatch):
    from bench import bench_optim
    monkeypatch.setattr(bench_optim, "graph_replays", _stand_in_graph_replays)
    monkeypatch.setattr(bench_optim, "PEERS", (bench_optim.FUSED, "foreach lerp_item", "foreach lerp_tensor"))
    rows, _ = bench_optim.bench_size("small", [(7,), (33, 5)], 3, "cpu", Timer("cpu"))
    by_peer = {r["peer"]: r for r in rows}
    fused_graph = by_peer[bench_optim.FUSED + common.GRAPH_SUFFIX]
    lerp_graph = by_peer["foreach lerp_tensor" + common.GRAPH_SUFFIX]
    assert fused_graph["fused_speedup"] == 1.0
    assert lerp_graph["fused_speedup"] == pytest.approx(lerp_graph["median_s"] / fused_graph["median_s"])
    assert not fused_graph["best_foreach"] and not lerp_graph["best_foreach"]
    assert sum(r["best_foreach"] for r in rows) == 1


def test_quick_robust_json_has_every_case_dtype_and_method(quick_run):
    out, _ = quick_run
    rows = _rows(out, "robust")
    from bench.bench_robust import FAST_DRO, METHODS, QUICK_SIZES
    def methods(case):  # the fast-dro stand-in runs on the divergences fast-dro shares with dro_ext
        shared = case[0] in ("cvar", "kl_cvar") or case == ("cressie_read", {"k": 2.0})
        return METHODS + ((FAST_DRO,) if shared else ())
    expected = {(case_label(*c), n, d, m) for c in CASES for n in QUICK_SIZES for d in ("float32", "float64")
                for m in methods(c)}
    assert {(r["case"], r["n"], r["dtype"], r["method"]) for r in rows} == expected and len(rows) == len(expected)
    for r in rows:
        assert math.isfinite(r["abs_error"]) and r["median_ms"] > 0
        # Every method solves the same problem: float32 input within 1e-4 on eta of the float64 reference.
        assert r["abs_error"] <= 1e-3 * max(1.0, abs(r["reference"])), r
    robust_md = (out / "robust.md").read_text()
    assert "Peer: daniellevy/fast-dro's RobustLoss" in robust_md and "fast-dro RobustLoss" in robust_md


def test_fast_dro_loader_leaves_no_stand_in_modules(tmp_path):
    from bench import fast_dro_peer
    before = {name: sys.modules.get(name) for name in ("datasets", "utils", "robust_losses")}
    cls = fast_dro_peer.load_robust_loss(str(_fake_fast_dro_checkout(tmp_path)))
    assert cls.__name__ == "RobustLoss"
    assert {name: sys.modules.get(name) for name in before} == before
    peer = fast_dro_peer.make_peer(cls, "kl_cvar", {"alpha": 0.2}, 0.5)
    assert (peer.size, peer.reg, peer.geometry) == (0.2, 0.5, "cvar")
    assert fast_dro_peer.make_peer(cls, "cressie_read", {"k": 1.5}, 0.5) is None
    assert fast_dro_peer.make_peer(cls, "kl", {}, 0.5) is None
    with pytest.raises(FileNotFoundError, match="robust_losses.py"):
        fast_dro_peer.load_robust_loss(str(tmp_path / "missing"))


def test_fast_dro_runs_without_a_device_mode_where_the_losses_are_on_the_default_device(tmp_path):
    # ``with torch.device(...)`` installs a mode every torch call inside goes through: on the CPU, where it changes
    # nothing, it nearly doubled fast-dro's call at N = 128, and every ratio against fast-dro was inflated by it.
    from bench import fast_dro_peer

    modes = []

    def peer(losses):
        modes.append(len(torch.overrides._get_current_function_mode_stack()))
        return losses.mean()

    fast_dro_peer.call(peer, torch.ones(3))
    with torch.device("meta"):  # another default device: the losses' device is made the default for the call
        fast_dro_peer.call(peer, torch.ones(3, device="cpu"))
    assert modes[0] == 0 and modes[1] >= 1


def test_measure_returns_the_functions_value_on_cuda_too():
    # On CUDA the timed function synchronizes after fn; it returned (fn(), None), and the benchmarks' checks of the
    # value (isfinite of the gradients, the objective's distance to its reference) raised TypeError.
    from bench.conftest import run_measured

    class Benchmark:
        group, extra_info = None, {}

        def __call__(self, fn):
            return fn()

    class Timer:
        synced = 0

        def synchronize(self):
            Timer.synced += 1

    for device in ("cpu", "cuda"):
        assert run_measured(Benchmark(), Timer(), torch.device(device), lambda: 1.5, "g", n=3) == 1.5
    assert Timer.synced == 3  # once before each run, and after the call on CUDA


def test_quick_train_json_has_every_case_and_implementation(quick_run):
    # The fake fast-dro checkout computes its objectives with dro_ext: its rows are there, run like the others.
    out, _ = quick_run
    rows = _rows(out, "train")
    from bench import bench_train
    expected = [(case, impl) for case in bench_train.CASE_NAMES for impl in _names_with_peer(bench_train, case)]
    assert [(r["case"], r["impl"]) for r in rows] == expected
    for r in rows:
        assert r["mode"] == "eager" and r["median_ms"] > 0 and r["p25_ms"] <= r["median_ms"] <= r["p75_ms"], r
        assert r["per_s"] == pytest.approx(r["batch"] / (r["median_ms"] / 1e3)) and r["saved_MiB"] > 0
        assert r["host_syncs"] is None and r["peak_MiB"] > 0 and r["note"] == ""  # CPU run
        # against dro_ext's exact chi2 step: fast-dro's chi2 row alone, the same problem (its CVaR is another)
        assert (r["x_dro_ext"] is not None) == (r["impl"] == bench_train.FAST_DRO_CHI2), r
    assert all(r["x_erm"] == 1.0 for r in rows if r["impl"] == bench_train.ERM)
    # the linear cross-entropy keeps no logits for backward
    lm = {r["impl"]: r for r in rows if r["case"] == "lm-head"}
    assert lm[bench_train.FUSED_LINEAR_CE]["saved_MiB"] < lm[bench_train.ERM]["saved_MiB"] / 2
    md = (out / "train.md").read_text()
    assert "<= 1.05: not measured (--quick)" in md and "Sizes: resnet18: batch=16, width=8" in md
    assert ": met" not in md and "MISSED" not in md  # a quick run's sizes state no verdict (as bench/targets.py)


def test_a_quick_run_writes_beside_the_committed_results_unless_told_where():
    """Without --out a --quick run writes to bench/results/tmp (ignored by git), not over bench/results' committed
    files, which it used to overwrite with numbers bench/targets.py then read as not measured."""
    import argparse

    from bench import common
    parser = argparse.ArgumentParser()
    common.add_common_arguments(parser, quick_help="")
    assert common.output_dir(parser.parse_args(["--quick"])) == common.QUICK_RESULTS_DIR
    assert common.output_dir(parser.parse_args([])) == common.RESULTS_DIR
    assert common.output_dir(parser.parse_args(["--quick", "--out", "x"])) == "x"
    ignored = subprocess.run(["git", "check-ignore", "-q", os.path.join(common.QUICK_RESULTS_DIR, "loss.md")],
                             cwd=ROOT)
    assert ignored.returncode == 0


def test_train_cases_run_in_a_process_each_on_the_cpu(tmp_path, monkeypatch):
    """On the CPU each (mode, case) is measured by a process of its own (an earlier case left the process slower for
    the later ones), given the shared settings; --in-process keeps them in this one."""
    from bench import bench_train
    calls = []

    def fake_case(case, mode, shared):
        calls.append((case, mode, shared))
        return [{"device": "cpu", "case": case, "mode": mode, "impl": bench_train.ERM, "median_ms": 1.0,
                 "p25_ms": 1.0, "p75_ms": 1.0, "per_s": 1.0, "x_erm": 1.0, "x_dro_ext": None, "saved_MiB": 1.0,
                 "peak_MiB": 1.0, "host_syncs": None, "note": ""}]

    monkeypatch.setattr(bench_train, "_bench_case_in_a_process", fake_case)
    args = ["--quick", "--out", str(tmp_path), "--no-plot", "--cases", "resnet18", "lm-head", "--rounds", "1",
            "--min-seconds", "0.25"]
    bench_train.main(args)
    assert [(case, mode) for case, mode, _ in calls] == [("resnet18", "eager"), ("lm-head", "eager")]
    shared = calls[0][2]
    assert shared[:2] == ["--device", "cpu"] and "--quick" in shared
    assert shared[shared.index("--rounds") + 1] == "1" and float(shared[shared.index("--min-seconds") + 1]) == 0.25
    assert "cases_in=a process each" in (tmp_path / "train.md").read_text()
    calls.clear()
    monkeypatch.setattr(bench_train, "bench_case", lambda problem, impls, mode, *a, **k: fake_case(
        problem.case, mode, None))
    bench_train.main([*args, "--in-process"])
    assert [(case, shared) for case, _, shared in calls] == [("resnet18", None), ("lm-head", None)]


def test_a_train_case_process_writes_its_rows(tmp_path):
    """The child's side: --rows-json writes the rows of its one case and no report."""
    import json
    from bench import bench_train
    rows_json = tmp_path / "rows.json"
    assert bench_train.main(["--quick", "--out", str(tmp_path), "--cases", "mlp-large-batch", "--rounds", "1",
                             "--min-seconds", "0.01", "--rows-json", str(rows_json)]) == {}
    rows = json.loads(rows_json.read_text())
    assert {r["case"] for r in rows} == {"mlp-large-batch"} and rows[0]["impl"] == bench_train.ERM
    assert all(r["median_ms"] > 0 for r in rows if r["impl"] in (bench_train.ERM, bench_train.DRO_SGD))
    assert not (tmp_path / "train.md").exists()


def test_compiled_implementations_in_one_process_stay_under_the_recompile_limit(monkeypatch):
    """On CUDA every case's implementations are compiled in one process, more of them than Dynamo's recompile limit
    per code object: each Run's objective has a code object of its own, so none fails under fullgraph=True (or, a
    peer, silently runs eager). Here with the limit at 2 and four implementations, traced by the eager backend."""
    import functools
    import torch._dynamo
    from bench import bench_train
    monkeypatch.setattr(torch, "compile", functools.partial(torch.compile, backend="eager"))
    problem = bench_train.make_problem("mlp-large-batch", "cpu", quick=True)
    impls = [i for i in bench_train.impls_for("mlp-large-batch") if i.peer is None]
    assert len(impls) == 4
    torch._dynamo.reset()
    with torch._dynamo.config.patch(recompile_limit=2):
        runs = [bench_train.Run(problem, impl, compiled=True) for impl in impls]
        for run in runs + runs:  # the second pass: each finds its own compiled graph again
            run.step()
    torch._dynamo.reset()


def test_compile_mode_starts_each_case_from_a_fresh_dynamo(monkeypatch):
    """In one process (CUDA) each case's compiled implementations start from a reset Dynamo, as in a process of their
    own: a peer's helpers are not recompiled with dynamic shapes for the next case's batch."""
    import torch._dynamo
    from bench import bench_train
    order = []

    class StandInRun:
        def __init__(self, problem, impl, fast_dro_class=None, *, compiled=False):
            order.append(("run", compiled))

        def step(self):
            pass

    monkeypatch.setattr(torch._dynamo, "reset", lambda: order.append("reset"))
    monkeypatch.setattr(bench_train, "Run", StandInRun)
    problem = bench_train.make_problem("mlp-large-batch", "cpu", quick=True)
    impls = bench_train.impls_for("mlp-large-batch")[:2]
    bench_train.prepare(problem, impls, "compile", None, "cpu")
    bench_train.prepare(problem, impls, "eager", None, "cpu")
    assert order == ["reset", ("run", True), ("run", True), ("run", False), ("run", False)]


def _names_with_peer(bench_train, case):
    return [impl.name for impl in bench_train.impls_for(case, fast_dro_class=object)]


@pytest.mark.parametrize("name", ["loss", "optim", "robust", "groups", "train"])
def test_quick_writes_table_csv_and_png(quick_run, name):
    out, proc = quick_run
    md = (out / f"{name}.md").read_text()
    assert md.startswith(f"# {name}\n") and "Machine:" in md and "|---|" in md
    with open(out / f"{name}.csv") as f:
        assert sum(1 for _ in f) == len(_rows(out, name)) + 1
    from matplotlib.image import imread
    image = imread(out / f"{name}.png")
    assert image.ndim == 3 and image.shape[0] >= 300 and image.shape[1] >= 500
    assert image[..., :3].std() > 0.05  # something is drawn, not a blank canvas


def test_quick_groups_json_has_every_size_group_count_and_implementation(quick_run):
    out, _ = quick_run
    rows = _rows(out, "groups")
    from bench.bench_groups import FAMILIES, FLOOR, IMPLS, QUICK_GROUPS, QUICK_SIZES
    assert {(r["n"], r["groups"], r["impl"]) for r in rows} == {
        (n, g, impl) for n in QUICK_SIZES for g in QUICK_GROUPS for impl in IMPLS}
    for r in rows:
        assert r["median_ms"] > 0 and r["peak_extra_bytes"] >= 0, r
        if r["impl"] == FLOOR:
            assert r["family"] is None and "speedup_vs_best_composition" not in r
            continue
        assert r["peak_extra_bytes"] > 0, r
        assert r["best_composition"] in FAMILIES[r["family"]]
        if r["impl"] in FAMILIES:  # above the floor: both times less the floor's row's
            times = {(x["n"], x["groups"], x["impl"]): x["median_ms"] for x in rows}
            best, floor = (times[r["n"], r["groups"], name] for name in (r["best_composition"], FLOOR))
            if r["median_ms"] > floor:
                assert r["speedup_above_floor"] == pytest.approx((best - floor) / (r["median_ms"] - floor)), r
    assert all(r["host_syncs"] is None for r in rows)  # counted on CUDA only: every CPU call is synchronous
    # The one-hot matrix's memory grows with G; group_sums' stays O(N + G).
    fused = {(r["n"], r["groups"]): r["peak_bytes_per_n_plus_g"] for r in rows if r["impl"] == "group_sums"}
    one_hot = {(r["n"], r["groups"]): r["peak_bytes_per_n_plus_g"] for r in rows if r["impl"] == "one-hot matmul"}
    assert all(one_hot[key] > fused[key] for key in fused)


def test_groups_bench_leaves_out_a_one_hot_matrix_past_its_limit(monkeypatch):
    from bench import bench_groups
    monkeypatch.setattr(bench_groups, "ONE_HOT_MAX_ELEMENTS", 1000)
    rows = bench_groups.bench_case(300, 4, "cpu", Timer("cpu"), bench_groups.IMPLS, rounds=1, min_seconds=0.01)
    by_impl = {r["impl"]: r for r in rows}
    assert "not run" in by_impl["one-hot matmul"]["skipped"] and "median_ms" not in by_impl["one-hot matmul"]
    assert by_impl["group_sums"]["best_composition"] == "index_add"


def test_groups_bench_counts_each_implementations_host_syncs():
    # On the CPU through a stand-in for the sync debug mode: a composition that reads a group's count on the host
    # (as code with .item() or boolean indexing does) is counted, once per call, and the others are not.
    from bench import bench_groups
    sync = StandInSyncDebug()

    def index_add_with_a_host_read(losses, groups, num_groups):
        sync.synchronize()
        return bench_groups.index_add(losses, groups, num_groups)

    impls = {"group_sums": bench_groups.fused, "one-hot matmul": bench_groups.one_hot,
             "index_add": index_add_with_a_host_read}
    rows = bench_groups.bench_case(64, 4, "cpu", Timer("cpu"), impls, rounds=1, min_seconds=0.0,
                                   count_syncs=lambda run, device: common.count_host_syncs(run, sync.set_mode,
                                                                                         sync.get_mode))
    assert {r["impl"]: r["host_syncs"] for r in rows} == {"group_sums": 0, "one-hot matmul": 0, "index_add": 1}
    assert [row[-1] for row in bench_groups.table_rows(rows)] == [0, 0, 1]


def test_quick_cross_entropy_json_has_both_cases_and_every_implementation(quick_run):
    out, _ = quick_run
    rows = _rows(out, "cross_entropy")
    from bench.bench_cross_entropy import IMPLS
    # The linear case also runs the op over groups of sequences.
    assert [(r["case"], r["impl"]) for r in rows] == (
        [(case, impl) for case in ("logits", "linear") for impl in IMPLS] + [("linear", "fused grouped")])
    for r in rows:
        assert r["median_ms"] > 0 and r["peak_extra_MiB"] > 0 and r["memory_vs_eager"] > 0
    assert all(r["time_vs_fused"] == 1.0 for r in rows if r["impl"] == "fused")


def test_the_linear_case_runs_other_chunk_sizes_beside_the_default(tmp_path):
    # As on CUDA by default: each chunk size given (but the default's, 256 rows at the quick sizes) is one more
    # implementation, timed and measured like the others.
    from bench import bench_cross_entropy
    from dro_ext.cross_entropy import default_chunk_size
    quick = bench_cross_entropy.QUICK["linear"]
    assert default_chunk_size(quick["n"], quick["h"], quick["v"]) == 256
    bench_cross_entropy.main(["--quick", "--case", "linear", "--chunk-sizes", "64", "256", "--out", str(tmp_path)])
    with open(tmp_path / "cross_entropy_linear.json") as f:
        data = json.load(f)
    assert data["meta"]["settings"]["chunk_sizes"] == [64, 256]
    rows = {r["impl"]: r for r in data["rows"]}
    assert list(rows) == [*bench_cross_entropy.IMPLS, "fused chunk=64", "fused grouped"]
    assert rows["fused chunk=64"]["median_ms"] > 0 and rows["fused chunk=64"]["peak_extra_MiB"] > 0
    # a quarter of the chunk: less memory than the default's chunk of logits
    assert rows["fused chunk=64"]["peak_extra_MiB"] < rows["fused"]["peak_extra_MiB"]


def test_quick_prints_progress_on_stderr_and_tables_on_stdout(quick_run):
    _, proc = quick_run
    assert "[loss 1/" in proc.stderr and "[optim 1/" in proc.stderr and "[robust 1/" in proc.stderr
    assert "[train 1/" in proc.stderr
    assert "case" in proc.stdout and "ms/step" in proc.stdout
    assert not any(line.startswith(("[loss", "[optim", "[robust", "[train")) for line in proc.stdout.splitlines())


class _Stopped(Exception):
    """Stands in for the time limit that kills a benchmark mid-run."""


@pytest.mark.parametrize("module, argv", [
    ("bench_loss", ["--divergences", "chi2", "--sizes", "4096", "8192"]),
    ("bench_robust", ["--divergences", "chi2", "--sizes", "4096"]),
    ("bench_optim", ["--threads", "1", "2"]),
    ("bench_cross_entropy", []),
    ("bench_train", ["--cases", "mlp-large-batch", "lm-head"]),
])
def test_a_stopped_benchmark_leaves_the_cases_it_finished(tmp_path, monkeypatch, module, argv):
    # The run stops right after its first case's checkpoint, as a GPU lease's limit would stop it: the result files
    # hold that case, marked partial.
    import importlib
    bench_module = importlib.import_module(f"bench.{module}")
    real_writer = bench_module.partial_writer

    def writer_then_stop(*args, **kwargs):
        write = real_writer(*args, **kwargs)

        def write_and_stop(rows, done, total):
            write(rows, done, total)
            raise _Stopped
        return write_and_stop

    monkeypatch.setattr(bench_module, "partial_writer", writer_then_stop)
    with pytest.raises(_Stopped):
        bench_module.main(["--quick", "--no-plot", "--out", str(tmp_path), *argv])
    name = module.removeprefix("bench_")
    with open(tmp_path / f"{name}.json") as f:
        data = json.load(f)
    assert data["meta"]["settings"]["partial"] == "1 of 2 cases, the run had not ended"
    assert data["rows"] and all(r["median_ms" if "median_ms" in r else "median_s"] > 0 for r in data["rows"])
    md = (tmp_path / f"{name}.md").read_text()
    assert "partial=1 of 2 cases" in md and "|---|" in md
    with open(tmp_path / f"{name}.csv") as f:
        assert sum(1 for _ in f) == len(data["rows"]) + 1


def test_robust_reference_root_is_brentqs_to_1e15_with_a_good_or_a_bad_guess():
    # The reference eta: brentq on the costly exact g, inside a narrow bracket from a cheap guess when that holds the
    # root, and over the whole bracket when it does not.
    from bench.bench_robust import exact_root
    calls = []

    def g(x):
        calls.append(x)
        return math.tan(0.3 - x)  # decreasing, root 0.3, not linear (brentq would be exact at once on a line)

    eta = exact_root(g, lambda x: math.tan(0.3 - x) * 1.001, 0.0, 1.0)  # a close guess
    assert abs(eta - 0.3) <= 2e-15 and all(abs(x - 0.3) <= 1.1e-9 for x in calls) and len(calls) <= 6
    calls.clear()
    eta = exact_root(g, lambda x: 0.5 - x, 0.0, 1.0)  # the guess's root, 0.5, is far from g's
    assert abs(eta - 0.3) <= 2e-15 and any(abs(x - 0.3) > 1e-3 for x in calls)


# ------------------------------------------------------------------------------- the matmul alignment probe

def test_alignment_probe_rows_cover_every_vocab_and_layout(tmp_path):
    from bench import probe_matmul_alignment as probe

    probe.main(["--quick", "--out", str(tmp_path), "--no-plot", "--dtype", "float32"])
    rows = json.loads((tmp_path / "matmul_alignment.json").read_text())["rows"]
    assert [(r["vocab"], r["variant"]) for r in rows] == [(v, name) for v in (1001, 1024) for name in probe.VARIANTS]
    assert all(r["median_ms"] > 0 and r["max_rel_error"] < 1e-5 for r in rows)
    assert {r["x_contiguous"] for r in rows if r["variant"] == "contiguous"} == {1.0}


def test_alignment_probe_refuses_a_layout_that_leaves_output_unwritten(monkeypatch):
    from bench import probe_matmul_alignment as probe

    written = probe.chunk_matmuls

    def strided_logits_skip_the_weight_gradient(hidden, weight, logits, grad_hidden, grad_weight):
        if logits.stride(0) == logits.shape[1]:  # contiguous and padded vocab: every output written
            return written(hidden, weight, logits, grad_hidden, grad_weight)
        torch.mm(hidden, weight.t(), out=logits)
        torch.mm(logits, weight, out=grad_hidden)

    monkeypatch.setattr(probe, "chunk_matmuls", strided_logits_skip_the_weight_gradient)
    with pytest.raises(RuntimeError, match="padded stride left part of its output unwritten"):
        probe.probe(8, 4, 13, torch.float32, torch.device("cpu"), rounds=1, min_seconds=0.0)
