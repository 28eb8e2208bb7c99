"""The demo (python -m dro_ext.demo): outputs well-formed, deterministic, and the method's claims on small problems.

The claim tests run the demo's own experiment functions on small fixed-seed problems, on the same learning
rate grids as the full demo, and compare the lowest final Psi each optimizer reaches over that grid.
"""
import dataclasses
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from cpu_builds import runnable_builds
from dro_ext.demo import claims, experiments, report
from dro_ext.demo.training import Run

REPO = Path(__file__).resolve().parents[1]
CLAIM_SEEDS = (0, 1, 2)


@pytest.fixture(autouse=True)
def _one_thread():
    # The demo's models are tiny: with several intra-op threads on a busy machine each step waits on the
    # others (the CLI sets --threads 1 for the same reason). Repeatability is tested below.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _strict_json(text):
    def reject(constant):
        raise ValueError(f"non-standard JSON constant {constant}")
    return json.loads(text, parse_constant=reject)


def _quick_demo(out: Path, cpu_capability=None, extra_args=()):
    """`python -m dro_ext.demo --quick --seed 3` in a fresh process (it sets torch's global determinism flag),
    with ATEN_CPU_CAPABILITY set to ``cpu_capability``, or unset (the widest build the processor runs)."""
    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    env.pop("ATEN_CPU_CAPABILITY", None)
    if cpu_capability is not None:
        env["ATEN_CPU_CAPABILITY"] = cpu_capability
    proc = subprocess.run([sys.executable, "-m", "dro_ext.demo", "--quick", "--seed", "3", "--out", str(out),
                           *extra_args],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return out, proc


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory):
    """The quick demo on the widest CPU build the processor runs."""
    return _quick_demo(tmp_path_factory.mktemp("demo_quick"))


@pytest.fixture(scope="module")
def quick_run_portable(tmp_path_factory):
    """The quick demo on the portable CPU build (what a processor without AVX2 runs)."""
    return _quick_demo(tmp_path_factory.mktemp("demo_quick_portable"), "default")


def test_quick_run_writes_every_output(quick_run):
    out, proc = quick_run
    assert sorted(p.name for p in out.iterdir()) == ["figure.png", "report.md", "results.json", "tables.md"]
    for key in "abcdef":
        assert f"claim ({key}) reproduced:" in proc.stdout


def test_results_json_holds_every_curve_seed_and_version(quick_run):
    out, _ = quick_run
    payload = _strict_json((out / "results.json").read_text())
    meta, results = payload["meta"], payload["experiments"]
    settings = experiments.Settings.quick()
    assert meta["seed"] == 3 and meta["quick"] is True and meta["device"] == "cpu"
    assert meta["seeds"] == [3, 4]
    for key in ("python", "torch", "dro_ext", "dro_ext_backend", "numpy", "scikit-learn", "matplotlib"):
        assert meta["versions"][key]
    assert meta["machine"]["cpu"] and meta["machine"]["logical_cpus"] >= 1
    assert meta["cpu_seconds_total"] > 0 and set(meta["load_average"]) == {"start", "end"}
    from dro_ext.demo.__main__ import source_revision

    assert meta["source"] == source_revision()  # the code the run ran (None outside a git checkout)
    assert report.source_phrase(meta) in (out / "report.md").read_text()
    expected = {
        "example_3_1": (("sgd", "nsgd"), settings.example_grid, settings.example_epochs),
        "regression": (("sgd", "nsgd"), settings.regression_grid, settings.regression_epochs),
        "digits_chi2": (("sgd", "nsgd"), settings.digits_grid, settings.digits_epochs),
        "digits_cvar": (("cvar", "smoothed_cvar"), settings.digits_grid, settings.digits_epochs),
    }
    for name, (methods, grid, epochs) in expected.items():
        result = results[name]
        assert result["grid"] == list(grid)
        for method in methods:
            runs, seed_runs = result["runs"][method], result["seed_runs"][method]
            assert [r["lr"] for r in runs] == list(grid)
            assert [r["seed"] for r in seed_runs] == [3, 4]  # the search on the first seed, then every seed
            assert {r["lr"] for r in seed_runs} == {result["best"][method]["lr"]}
            assert seed_runs[0] == result["best"][method]
            for run in runs + seed_runs:
                assert len(run["curve"]) == epochs + 1 or run["diverged"], (name, method, run["lr"])
                assert all(v is None or (isinstance(v, float) and v >= 0) for v in run["curve"])
            assert all(run["seed"] == 3 for run in runs)
            assert result["best"][method]["lr"] in grid
            if name.startswith("digits"):
                for run in seed_runs:
                    assert len(run["extra"]["test_accuracy_per_class"]) == 10
                    assert all(0 <= a <= 100 for a in run["extra"]["test_accuracy_per_class"])
    assert set(payload["claims"]) == {"a", "b", "c", "d", "e", "f"}
    for judged in (*payload["claims"]["a"]["tasks"].values(), payload["claims"]["b"],
                   *payload["claims"]["e"]["tasks"].values(), payload["claims"]["f"]):
        assert judged["seeds"] == [3, 4] and judged["seeds_needed"] == 2
    assert set(payload["claims"]["e"]["tasks"]) == {"group_dro", "group_chi2"}
    # Each rounding probe ran every experiment again, searches and seeds, and judged every claim and task.
    assert meta["settings"]["rounding_probes"] == settings.rounding_probes >= 1
    probes = payload["rounding_probes"]
    assert len(probes) == settings.rounding_probes and all(list(probe) == list(results) for probe in probes)
    for probe in probes:
        for name, result in probe.items():
            assert {m: [r["seed"] for r in runs] for m, runs in result["seed_runs"].items()} == \
                   {m: [r["seed"] for r in runs] for m, runs in results[name]["seed_runs"].items()}
    for judged in (*payload["claims"].values(), *payload["claims"]["a"]["tasks"].values(),
                   *payload["claims"]["e"]["tasks"].values()):
        assert len(judged["verdicts"]) == 1 + settings.rounding_probes
        assert judged["verdict"] == claims.settled_verdict(judged["verdicts"])


def test_results_json_holds_the_spurious_digits_search_and_seeds(quick_run):
    out, _ = quick_run
    payload = _strict_json((out / "results.json").read_text())
    result, settings = payload["experiments"]["spurious_digits"], experiments.Settings.quick()
    assert result["grid"] == {"lr": list(settings.groups_lrs), "step_size": list(settings.groups_step_sizes),
                              "lam": list(settings.groups_lams)}
    assert list(result["methods"]) == ["erm", "group_dro", "group_chi2", "chi2"]
    strengths = {"erm": [None], "group_dro": list(settings.groups_step_sizes), "group_chi2": list(settings.groups_lams),
                 "chi2": list(settings.groups_lams)}
    for method, grid in strengths.items():
        runs, seed_runs = result["runs"][method], result["seed_runs"][method]
        # Every (lr, strength) pair on the first seed, then the one with the best validation score on every seed.
        pairs = [(lr, strength) for lr in settings.groups_lrs for strength in grid]
        assert [(r["lr"], r["extra"]["strength"]) for r in runs] == pairs
        assert all(r["seed"] == 3 for r in runs) and [r["seed"] for r in seed_runs] == [3, 4]
        assert seed_runs[0] == result["best"][method] and result["best"][method] in runs
        best_score = max((min(r["extra"]["val_group_accuracy"]), sum(r["extra"]["val_group_accuracy"])) for r in runs)
        assert (min(seed_runs[0]["extra"]["val_group_accuracy"]),
                sum(seed_runs[0]["extra"]["val_group_accuracy"])) == best_score
        for run in runs + seed_runs:
            assert run["extra"]["method"] == method
            assert len(run["curve"]) == settings.groups_epochs + 1
            # The numbers are those of the kept epoch, one of the run's epochs (not its initialization).
            assert 1 <= run["extra"]["selected_epoch"] <= settings.groups_epochs
            assert run["curve"][run["extra"]["selected_epoch"]] == min(run["extra"]["test_group_accuracy"])
            for accuracies in (run["extra"]["val_group_accuracy"], run["extra"]["test_group_accuracy"]):
                assert len(accuracies) == 4 and all(0 <= a <= 100 for a in accuracies)
            assert 0 <= run["extra"]["test_accuracy"] <= 100
    assert result["data"]["train"]["per_group"] == [426, 22, 22, 428]
    for key in ("e", "f"):
        assert payload["claims"][key]["verdict"] in ("yes", "partly", "no", claims.NOT_SETTLED)


def test_experiments_option_runs_only_those_and_their_claims(tmp_path):
    out, proc = _quick_demo(tmp_path, extra_args=("--experiments", "spurious_digits"))
    payload = _strict_json((out / "results.json").read_text())
    assert list(payload["experiments"]) == ["spurious_digits"] and payload["meta"]["experiments"] == ["spurious_digits"]
    assert list(payload["claims"]) == ["e", "f"]
    assert "claim (e) reproduced:" in proc.stdout and "claim (a)" not in proc.stdout
    text = (out / "report.md").read_text()
    rows = [line for line in text.splitlines() if line.startswith("| (")]
    assert [row[:5] for row in rows] == ["| (e)", "| (e)", "| (f)"]
    assert "Overall, beyond the paper, (e): **" in text and "## Per-class test accuracy" not in text
    tables = (out / "tables.md").read_text()
    assert "| Class |" not in tables and tables.count("| Method | Hyperparameters |") == 1
    import matplotlib.image

    height, width = matplotlib.image.imread(out / "figure.png").shape[:2]
    assert (width, height) == tuple(int(s * report.FIGURE_DPI) for s in report.FIGURE_SIZE_INCHES)


def test_rounding_probes_option(tmp_path):
    """--rounding-probes 0 runs each experiment once and says its verdicts are unchecked; a negative count is
    refused."""
    from dro_ext.demo.__main__ import parse_args

    out, proc = _quick_demo(tmp_path, extra_args=("--experiments", "example_3_1", "--rounding-probes", "0"))
    payload = _strict_json((out / "results.json").read_text())
    assert payload["meta"]["settings"]["rounding_probes"] == 0 and payload["rounding_probes"] == []
    assert "rounding probe" not in proc.stderr
    for task in payload["claims"]["a"]["tasks"].values():
        assert task["verdicts"] == [task["verdict"]] and task["verdict"] != claims.NOT_SETTLED
    assert "Rounding: not checked in this run (`--rounding-probes 0`)" in (out / "report.md").read_text()
    assert parse_args(["--rounding-probes", "3"]).rounding_probes == 3
    with pytest.raises(SystemExit):
        parse_args(["--rounding-probes", "-1"])


def test_bad_arguments_are_refused_before_any_training(tmp_path):
    """Seeds out of the data splits' range, a --readme with --quick or without probes (its block says "Full run"),
    an --out that takes no files and a README the run could not rewrite are refused with one line, before the
    run trains (they raised tracebacks after it, minutes in)."""
    from dro_ext.demo.__main__ import check_outputs, parse_args

    for bad in (["--seed", "-1"], ["--seed", str(2**32 - 1)], ["--quick", "--readme", "README.md"],
                ["--rounding-probes", "0", "--readme", "README.md"]):
        with pytest.raises(SystemExit):
            parse_args(bad)
    assert parse_args(["--seed", str(2**32 - 17)]).seed == 2**32 - 17  # (the run's seeds stay below 2**32)
    taken = tmp_path / "a_file"
    taken.write_text("")
    with pytest.raises(SystemExit, match="cannot write the outputs there"):
        check_outputs(taken, None)
    (tmp_path / "docs").mkdir()
    readme = tmp_path / "docs" / "README.md"
    readme.write_text("no block here\n")
    with pytest.raises(SystemExit, match="block to update"):
        check_outputs(tmp_path / "docs" / "out", readme)
    readme.write_text("<!-- demo-claims:begin -->\n<!-- demo-claims:end -->\n")
    with pytest.raises(SystemExit, match="must lie in the README's folder"):
        check_outputs(tmp_path / "elsewhere", readme)
    assert not (tmp_path / "elsewhere").exists() and not (tmp_path / "docs" / "out").exists()  # refused: nothing made
    check_outputs(tmp_path / "docs" / "out", readme)  # a README beside its outputs: fine
    assert (tmp_path / "docs" / "out").is_dir() and not list((tmp_path / "docs" / "out").iterdir())


def _without_timings(value):
    """``value`` with every run's wall time ("seconds") left out: what must not depend on how the demo ran."""
    if isinstance(value, dict):
        return {k: _without_timings(v) for k, v in value.items() if k != "seconds"}
    if isinstance(value, list):
        return [_without_timings(v) for v in value]
    return value


def test_jobs_run_the_passes_in_processes_with_the_same_numbers(quick_run, tmp_path):
    from dro_ext.demo import runner
    from dro_ext.demo.__main__ import parse_args

    out, proc = _quick_demo(tmp_path, extra_args=("--jobs", "2"))
    serial, parallel = (_strict_json((o / "results.json").read_text()) for o in (quick_run[0], out))
    assert serial["meta"]["jobs"] == 1 and parallel["meta"]["jobs"] == 2
    for key in ("experiments", "rounding_probes", "claims"):
        assert _without_timings(parallel[key]) == _without_timings(serial[key]), key
    assert "[dro_ext.demo] regression (rounding probe 1 of 1) done (" in proc.stderr
    assert "2 processes at once" in (out / "report.md").read_text()
    # The workers' CPU time counts (they, not this process, trained).
    assert parallel["meta"]["cpu_seconds_total"] >= 0.5 * sum(parallel["meta"]["seconds_per_experiment"].values())
    with pytest.raises(SystemExit):
        parse_args(["--jobs", "0"])
    with pytest.raises(ValueError, match="jobs must be >= 1"):
        runner.run_passes(["example_3_1"], experiments.Settings.quick(), 0, "cpu", 1, jobs=0)


def test_report_says_where_a_rounding_probe_picked_other_hyperparameters():
    def searched(nsgd_lr, step_size):
        return {"regression": {"best": {"sgd": Run("sgd", 1e-7, 0), "nsgd": Run("nsgd", nsgd_lr, 0)}},
                "spurious_digits": {"best": {"erm": Run("nsgd", 0.1, 0, extra={"strength": None}),
                                             "group_dro": Run("nsgd", 0.1, 0, extra={"strength": step_size})}}}

    trained = searched(0.03, 0.01)
    notes = report.probe_choice_notes(trained, [searched(0.03, 0.01), searched(0.01, 0.01), searched(0.03, 0.1)])
    assert notes == [
        "- The search of nsgd in regression picked lr 0.03 as trained, and lr 0.03 in probe 1, lr 0.01 in probe 2, "
        "lr 0.03 in probe 3.",
        "- The search of group_dro in spurious_digits picked lr 0.1, step_size 0.01 as trained, and lr 0.1, step_size "
        "0.01 in probe 1, lr 0.1, step_size 0.01 in probe 2, lr 0.1, step_size 0.1 in probe 3."]
    assert report.probe_choice_notes(trained, [searched(0.03, 0.01)]) == [
        "Every search picked the same hyperparameters in the rounding probes as in the runs as trained."]
    assert report.probe_choice_notes(trained, []) == []


def test_a_pass_that_fails_in_a_worker_fails_the_run():
    from dro_ext.demo import runner

    settings = _tiny(example_grid=(), rounding_probes=3)  # no learning rate to search: every pass raises
    with pytest.raises(ValueError):
        runner.run_passes(["example_3_1"], settings, 0, "cpu", 1, jobs=2)


def test_experiments_option_rejects_what_it_cannot_do(tmp_path):
    from dro_ext.demo.__main__ import parse_args, run_demo

    assert parse_args(["--experiments", "regression", "spurious_digits"]).experiments == ["regression",
                                                                                        "spurious_digits"]
    with pytest.raises(SystemExit):
        parse_args(["--experiments", "imagenet"])
    with pytest.raises(SystemExit):  # the README's block records a run of every experiment
        parse_args(["--experiments", "regression", "--readme", "README.md"])
    with pytest.raises(ValueError, match="only must name some of the experiments"):
        run_demo(tmp_path, quick=True, only=[])


def test_figure_is_a_png_of_the_expected_size(quick_run):
    import matplotlib.image

    out, _ = quick_run
    image = matplotlib.image.imread(out / "figure.png")
    width, height = (int(s * report.FIGURE_DPI) for s in report.FIGURE_SIZE_INCHES)
    assert image.shape[:2] == (height, width)
    assert image[..., :3].std() > 0.05  # something is drawn


def test_report_names_every_claim_with_a_verdict(quick_run):
    out, _ = quick_run
    text = (out / "report.md").read_text()
    rows = [line for line in text.splitlines() if line.startswith("| (")]
    for key in "abcd":
        keyed = [row for row in rows if row.startswith(f"| ({key})")]
        assert keyed, f"claim ({key}) missing from report.md"
        for row in keyed:
            verdict = row.rstrip(" |").rsplit("| ", 1)[1]
            assert verdict in ("yes", "partly", "no") or verdict.startswith(f"{claims.NOT_SETTLED} ("), row
    assert rows[0].startswith("| (a) Example 3.1") and len(rows) == 9
    assert [row.split(" |")[0] for row in rows[6:]] == ["| (e) spurious digits, GroupDROLoss",
                                                       "| (e) spurious digits, DROLoss(num_groups=4)",
                                                       "| (f) spurious digits, DROLoss over samples"]
    assert "![training curves](figure.png)" in text
    assert "on seed 3, then every seed (3, 4:" in text and "on the medians and on at least 2 of 2 seeds" in text
    assert "Rounding: every experiment (the searches and the seeds) ran once more with each initial parameter" in text
    assert ("Every search picked the same hyperparameters in the rounding probes" in text) != ("- The search of " in text)
    tables = (out / "tables.md").read_text()
    assert tables.count("| Class |") == 2 and tables.count("| Test acc (") == 4
    assert text.count("| Class |") == 2
    for markdown in (text, tables):  # the spurious digits' table: once, a row per method
        assert markdown.count("| Method | Hyperparameters | Kept epoch | Worst-group | Average |") == 1
        assert sum(markdown.count(f"\n| {label} | lr ") for label, _ in experiments.GROUP_METHODS.values()) == 4


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_rounding_nudge_moves_every_element_one_floating_point_step(dtype):
    from dro_ext.demo.training import rounding_nudge

    original = [torch.randn(7, 5, dtype=dtype), torch.tensor(10.0, dtype=dtype), torch.zeros(3, dtype=dtype)]

    def nudged(seed, probe):
        params = [p.clone() for p in original]
        rounding_nudge(params, seed, probe)
        return params

    assert all(torch.equal(a, b) for a, b in zip(nudged(0, 0), original))  # probe 0: the run as trained
    for new, old in zip(nudged(0, 1), original):
        up, down = torch.nextafter(old, old.new_tensor(math.inf)), torch.nextafter(old, old.new_tensor(-math.inf))
        assert ((new == up) | (new == down)).all() and (new != old).all()
    moved_up = torch.cat([(new > old).flatten() for new, old in zip(nudged(0, 1), original)])
    assert 0 < moved_up.sum() < len(moved_up)  # both directions, drawn at random
    assert all(torch.equal(a, b) for a, b in zip(nudged(0, 1), nudged(0, 1)))
    for other in (nudged(0, 2), nudged(1, 1)):  # another probe, another seed: other directions
        assert not all(torch.equal(a, b) for a, b in zip(other, nudged(0, 1)))
    with pytest.raises(ValueError, match="probe must be in"):
        rounding_nudge([torch.zeros(2)], 0, -1)


def test_a_rounding_probe_moves_the_start_by_rounding_and_keeps_the_data():
    """Probe 1 of an experiment starts one rounding step from the run as trained, and ends elsewhere; probe 0
    is the run as trained. Example 3.1 keeps its one parameter's end point."""
    settings = _tiny(example_epochs=3, example_grid=(0.1,), seeds=1)
    trained, again, probed = (experiments.example_3_1(settings, seed=0, probe=probe) for probe in (0, 0, 1))
    x_final = [result["runs"]["nsgd"][0].extra["x_final"] for result in (trained, again, probed)]
    assert x_final[0] == x_final[1] != x_final[2]
    assert x_final[2] == pytest.approx(x_final[0], rel=1e-4)  # the same noise draws: nearly the same path
    start = [result["runs"]["sgd"][0].curve[0] for result in (trained, probed)]
    assert start[1] == pytest.approx(start[0], rel=1e-6)


def test_a_verdict_that_a_rounding_probe_changes_is_not_settled():
    def assessed(verdict, task_verdicts):
        return {"a": {"claim": "x", "verdict": verdict, "level_ratio": 2.0,
                      "tasks": {task: {"verdict": v, "seeds": [0]} for task, v in task_verdicts.items()}},
                "c": {"claim": "y", "verdict": verdict, "mean_gain": 1.5}}

    trained = assessed("partly", {"regression": "yes", "digits": "no"})
    agreeing, disagreeing = assessed("partly", {"regression": "yes", "digits": "no"}), \
        assessed("partly", {"regression": "partly", "digits": "no"})
    settled = claims.settle(trained, [agreeing, disagreeing])
    assert settled["a"]["verdict"] == "partly" and settled["a"]["verdicts"] == ["partly"] * 3
    assert settled["a"]["tasks"]["regression"]["verdict"] == claims.NOT_SETTLED
    assert settled["a"]["tasks"]["regression"]["verdicts"] == ["yes", "yes", "partly"]
    assert settled["a"]["tasks"]["digits"]["verdict"] == "no"
    assert settled["a"]["level_ratio"] == 2.0 and settled["c"]["mean_gain"] == 1.5  # the numbers as trained
    assert trained["a"]["tasks"]["regression"]["verdict"] == "yes"  # the input is left as it was
    assert claims.settle(trained, [])["a"]["tasks"]["regression"]["verdict"] == "yes"  # nothing to check against
    assert claims.settle(trained, [assessed("no", {"regression": "yes", "digits": "no"})])["c"]["verdict"] == \
        claims.NOT_SETTLED
    assert report.verdict_cell(settled["a"]["tasks"]["regression"]) == "not settled (yes / yes / partly)"
    assert report.verdict_cell(settled["a"]["tasks"]["digits"]) == "no"
    with pytest.raises(ValueError, match="verdicts must hold"):
        claims.settled_verdict([])


def test_a_seed_judged_verdict_keeps_each_probes_seed_count():
    """How far from its threshold each rounding probe left a verdict judged over seeds (4 of 5 as trained: a probe
    at 3/5 is one seed from a flip, at 5/5 one seed from it the other way) is reported beside the count needed."""
    def assessed(holding, higher):
        return {"a": {"claim": "x", "verdict": "yes", "tasks": {"digits": {
                    "verdict": "yes", "seeds": [0, 1, 2, 3, 4], "seeds_holding": holding, "seeds_needed": 4}}},
                "f": {"claim": "y", "verdict": "yes", "seeds": [0, 1, 2, 3, 4], "seeds_higher": higher,
                      "seeds_needed": 4},
                "c": {"claim": "z", "verdict": "no", "mean_gain": 1.5}}

    settled = claims.settle(assessed(4, 5), [assessed(5, 4), assessed(4, 5)])
    assert settled["a"]["tasks"]["digits"]["probe_seed_counts"] == [5, 4]
    assert settled["f"]["probe_seed_counts"] == [4, 5]
    assert settled["f"]["seeds_higher"] == 5  # the count as trained
    assert "probe_seed_counts" not in settled["c"] and "probe_seed_counts" not in settled["a"]
    assert report._needed_phrase(settled["f"]) == "4 needed; the rounding probes 4/5, 5/5"
    assert report._needed_phrase(claims.settle(assessed(4, 5), [])["f"]) == "4 needed"


def _tiny(**changes):
    return dataclasses.replace(experiments.Settings.quick(), **changes)


def test_same_seed_gives_the_same_numbers():
    settings = _tiny(example_epochs=3, regression_epochs=2, digits_epochs=2, groups_epochs=2, seeds=1)
    threads = torch.get_num_threads()

    def numbers(seed):
        ex = experiments.example_3_1(settings, seed=seed)
        reg = experiments.age_regression(settings, seed=seed)
        dig = experiments.digits_cvar(settings, seed=seed)
        spurious = experiments.spurious_digits(settings, seed=seed)
        curves = [r.curve for result in (ex, reg, dig, spurious) for runs in result["runs"].values() for r in runs]
        accuracies = [r.extra["test_accuracy_per_class"] for runs in dig["seed_runs"].values() for r in runs]
        accuracies += [r.extra["val_group_accuracy"] for runs in spurious["runs"].values() for r in runs]
        return repr(curves + accuracies)  # repr: exact floats, and NaN (a diverged run) compares equal to itself

    # At one thread count: the BLAS splits some float32 matmuls by the thread count, which is part of the build
    # (README), as the SIMD builds are.
    try:
        torch.set_num_threads(2)
        first = numbers(5)
        again = numbers(5)
    finally:
        torch.set_num_threads(threads)
    assert first == again
    assert numbers(6) != first


def _verdicts(claims_payload: dict) -> dict:
    verdicts = {key: claims_payload[key]["verdict"] for key in "abcdef"}
    for key in "ae":
        verdicts.update({f"{key} {task}": c["verdict"] for task, c in claims_payload[key]["tasks"].items()})
    return verdicts


def test_verdicts_are_the_same_on_the_portable_and_the_widest_cpu_build(quick_run, quick_run_portable):
    """The quick demo under ATEN_CPU_CAPABILITY=default and without it: every verdict the same.

    The variable steers both ATen's kernels (the models' layers) and dro_ext's own SIMD dispatch, so one
    process per build covers both; the builds each process reports are checked, so that a dro_ext that
    stopped following the variable fails here instead of comparing a build with itself.
    """
    from dro_ext import _backend

    widest, portable = (_strict_json((out / "results.json").read_text()) for out, _ in (quick_run, quick_run_portable))
    native = _backend.use_native()
    assert portable["meta"]["cpu_builds"] == {"aten": "default", "dro_ext": "default" if native else None}
    assert widest["meta"]["cpu_builds"]["dro_ext"] == (runnable_builds()[-1] if native else None)
    if widest["meta"]["cpu_builds"] == portable["meta"]["cpu_builds"]:
        pytest.skip("this processor runs only the portable build: there is no second build to compare")
    assert _verdicts(widest["claims"]) == _verdicts(portable["claims"])


def test_native_ops_and_fallback_train_alike():
    """The demo on the compiled ops and on the PyTorch fallback: the same curves to float32 rounding."""
    from dro_ext import _backend

    if _backend._force_python:
        pytest.skip("DRO_EXT_FORCE_PYTHON=1: the native ops are disabled in this run")
    settings = experiments.Settings.quick()
    curves = {}
    for name in ("native", "python"):
        with _backend.forced_backend(name):
            results = (experiments.example_3_1(settings, seed=0), experiments.digits_chi2(settings, seed=0))
        curves[name] = [run.curve for result in results for runs in result["runs"].values() for run in runs]
    native = torch.tensor([v for curve in curves["native"] for v in curve], dtype=torch.float64)
    python = torch.tensor([v for curve in curves["python"] for v in curve], dtype=torch.float64)
    assert native.isfinite().sum() > len(native) // 2
    torch.testing.assert_close(native, python, rtol=1e-4, atol=0, equal_nan=True)


# --- the method's claim (a) on small fixed-seed problems -----------------------------------------------------


def _lowest_final(result, optimizer):
    return min(run.final for run in result["runs"][optimizer])


@pytest.mark.parametrize("seed", CLAIM_SEEDS)
def test_normalized_momentum_reaches_lower_psi_on_example_3_1(seed):
    """Example 3.1 from x = 10, 10 epochs of 10 steps, the demo's grid: the best NSGD run ends below the best
    SGD run."""
    settings = _tiny(example_epochs=10, example_steps_per_epoch=10,
                     example_grid=experiments.Settings.full().example_grid)
    result = experiments.example_3_1(settings, seed=seed)
    sgd, nsgd = _lowest_final(result, "sgd"), _lowest_final(result, "nsgd")
    assert nsgd < sgd, (seed, sgd, nsgd)


@pytest.mark.parametrize("seed", CLAIM_SEEDS)
def test_normalized_momentum_reaches_lower_psi_on_regression(seed):
    """The imbalanced-age regression with 1000 samples and 40 epochs, the demo's grid."""
    settings = _tiny(regression_samples=1000, regression_epochs=40,
                     regression_grid=experiments.Settings.full().regression_grid)
    result = experiments.age_regression(settings, seed=seed)
    sgd, nsgd = _lowest_final(result, "sgd"), _lowest_final(result, "nsgd")
    assert nsgd < sgd, (seed, sgd, nsgd)


# --- the pieces the report is built from ----------------------------------------------------------------------


def test_lr_grid_is_one_three_steps_inclusive():
    assert experiments.lr_grid(1e-4, 1.0) == (1e-4, 3e-4, 1e-3, 3e-3, 1e-2, 3e-2, 0.1, 0.3, 1.0)
    assert experiments.lr_grid(1e-9, 1e-8) == (1e-9, 3e-9, 1e-8)


def _run(curve, optimizer="sgd", lr=0.1, diverged=False, accuracy=None, seed=0):
    run = Run(optimizer, lr, seed, list(curve), diverged)
    if accuracy is not None:
        run.extra["test_accuracy_per_class"] = accuracy
    return run


def _seed_runs(levels, optimizer="sgd", epochs=3, start=10.0):
    """One run per seed, seed i flat at levels[i] after the first epoch (level and speed both order like it);
    None for a seed that diverged."""
    return [_run([start, math.nan], optimizer, diverged=True, seed=seed) if level is None
            else _run([start] + [level] * epochs, optimizer, seed=seed)
            for seed, level in enumerate(levels)]


def _compare(baseline_runs, method_runs):
    return claims.compare_optimization(baseline_runs, method_runs, baseline_runs[:1], method_runs[:1])


def test_tail_level_is_the_mean_of_the_last_epochs():
    curve = [100.0] + [50.0] * 5 + list(range(1, claims.TAIL_EPOCHS + 1))
    assert claims.tail_level(_run(curve)) == pytest.approx((claims.TAIL_EPOCHS + 1) / 2)
    assert claims.tail_level(_run([100.0, 4.0, 2.0])) == pytest.approx(3.0)  # fewer epochs: all of them
    assert claims.tail_level(_run([100.0, math.nan], diverged=True)) == math.inf


def test_the_report_names_the_epochs_the_level_averages():
    """A quick run's 3-epoch runs read "mean exact objective of the last 10 epochs": the level averages all 3."""
    short = _compare(_seed_runs([2.0, 3.0]), _seed_runs([1.0, 1.0], optimizer="nsgd"))
    assert short["tail_epochs"] == 3
    assert "mean exact objective of the last 3 epochs" in report._optimization_cell(short, "SGD", "NSGD")
    long = _compare(_seed_runs([2.0, 3.0], epochs=40), _seed_runs([1.0, 1.0], optimizer="nsgd", epochs=40))
    assert long["tail_epochs"] == claims.TAIL_EPOCHS


def test_seeds_needed_for_yes_is_four_of_five():
    assert [claims.seeds_needed(n) for n in (1, 2, 3, 5)] == [1, 2, 3, 4]


def test_optimization_verdict_needs_the_medians_and_four_of_five_seeds():
    baseline = _seed_runs([2.0, 2.0, 2.0, 2.0, 2.0])
    everywhere = _compare(baseline, _seed_runs([1.0, 1.0, 1.0, 1.0, 1.0], "nsgd"))
    assert everywhere["verdict"] == "yes" and everywhere["seeds_holding"] == 5
    assert everywhere["level_ratio"] == pytest.approx(2.0) and everywhere["speed_gap"] == pytest.approx(math.log(2))
    assert everywhere["level"]["method"] == {"median": 1.0, "low": 1.0, "high": 1.0}
    four = _compare(baseline, _seed_runs([1.0, 1.0, 1.0, 1.0, 3.0], "nsgd"))
    assert four["verdict"] == "yes" and four["seeds_holding"] == 4
    three = _compare(baseline, _seed_runs([1.0, 1.0, 1.0, 3.0, 3.0], "nsgd"))
    assert three["holds_on_medians"] and three["seeds_holding"] == 3 and three["verdict"] == "partly"
    assert _compare(baseline, _seed_runs([3.0] * 5, "nsgd"))["verdict"] == "no"


def test_optimization_verdict_is_no_when_the_medians_disagree_with_most_seeds():
    # The method beats the baseline on seeds 1-4, each by a little, but its median is the higher.
    baseline = _seed_runs([1.0, 2.0, 3.0, 4.0, 5.0])
    method = _seed_runs([10.0, 1.9, 2.9, 3.9, 4.9], "nsgd")
    c = _compare(baseline, method)
    assert c["seeds_holding"] == 4 and not c["holds_on_medians"] and c["verdict"] == "no"


def test_optimization_verdict_reads_the_tail_not_the_last_epoch():
    # On every seed the method is faster and its last epoch is lower, but it settled higher over the tail.
    epochs = claims.TAIL_EPOCHS + 2
    baseline = [_run([10.0] + [2.0] * epochs, seed=s) for s in range(5)]
    method = [_run([10.0, 0.01, 0.01] + [3.0] * (claims.TAIL_EPOCHS - 1) + [1.0], "nsgd", seed=s) for s in range(5)]
    assert all(m.final < b.final and m.speed_score() < b.speed_score() for b, m in zip(baseline, method))
    c = _compare(baseline, method)
    assert c["seeds_faster"] == 5 and c["seeds_lower"] == 0 and c["verdict"] == "no"


def test_optimization_verdict_needs_speed_as_well_as_level():
    # On every seed the method settles lower but got there slower (a worse mean log-objective): not the claim.
    baseline = [_run([10.0] + [1.5] * (claims.TAIL_EPOCHS + 2), seed=s) for s in range(5)]
    method = [_run([10.0, 20.0, 20.0] + [1.0] * claims.TAIL_EPOCHS, "nsgd", seed=s) for s in range(5)]
    c = _compare(baseline, method)
    assert c["seeds_lower"] == 5 and c["seeds_faster"] == 0 and c["speed_gap"] < 0 and c["verdict"] == "no"


def test_optimization_verdict_with_diverged_seeds():
    c = _compare(_seed_runs([None, None, None, 2.0, 2.0]), _seed_runs([1.0] * 5, "nsgd"))
    assert c["verdict"] == "yes" and c["baseline_diverged_seeds"] == [0, 1, 2] and c["method_diverged_seeds"] == []
    assert c["level"]["baseline"]["median"] == math.inf and c["level_ratio"] == math.inf
    assert "SGD+mom diverged on most seeds" in report._optimization_cell(c, "SGD+mom", "NSGD+mom")
    c = _compare(_seed_runs([2.0] * 5), _seed_runs([1.0, None, None, None, 1.0], "nsgd"))
    assert c["verdict"] == "no" and c["seeds_holding"] == 2
    with pytest.raises(ValueError, match="different seeds"):
        _compare(_seed_runs([2.0] * 5), _seed_runs([1.0] * 4, "nsgd"))


def test_overall_verdict_of_a_claim_over_tasks():
    assert claims.overall_verdict(["yes", "yes", "yes"]) == "yes"
    assert claims.overall_verdict(["yes", "no", "no"]) == "partly"
    assert claims.overall_verdict(["no", "partly", "no"]) == "partly"
    assert claims.overall_verdict(["no", "no", "no"]) == "no"


def test_median_and_band_over_seeds():
    runs = [_run([1.0, 2.0, 3.0]), _run([3.0, 2.0, 1.0]), _run([2.0, math.nan], diverged=True)]
    median, low, high = report.median_and_band(runs)
    assert median.tolist() == [2.0, 2.0, 3.0]  # the diverged seed counts as +inf from its last epoch on
    assert low.tolist() == [1.0, 2.0, 1.0] and high.tolist() == [3.0, math.inf, math.inf]


def test_compare_accuracy_marks_the_baselines_worst_class():
    base = [_run([1], accuracy=[90, 50, 80]), _run([1], accuracy=[92, 54, 80])]
    better = [_run([1], accuracy=[91, 60, 81]), _run([1], accuracy=[93, 62, 83])]
    c = claims.compare_accuracy(base, better)
    assert c["worst_class"] == 1 and c["worst_class_gain"] == pytest.approx(9)
    assert c["classes_improved"] == 3 and c["verdict"] == "yes" and c["largest_gain_class"] == 1
    mixed = [_run([1], accuracy=[88, 60, 81]), _run([1], accuracy=[88, 62, 83])]  # class 0 worse
    assert claims.compare_accuracy(base, mixed)["verdict"] == "partly"
    assert claims.compare_accuracy(better, base)["verdict"] == "no"


def test_compare_accuracy_counts_a_gain_only_beyond_two_standard_errors_over_the_seeds():
    base = [_run([1], accuracy=[90, 50, 80], seed=s) for s in range(3)]

    def method(per_seed_gain):  # every class of seed s gains per_seed_gain[s]
        return [_run([1], accuracy=[90 + g, 50 + g, 80 + g], seed=s) for s, g in enumerate(per_seed_gain)]

    steady = claims.compare_accuracy(base, method([2.0, 3.0, 4.0]))  # mean 3, standard error 1/sqrt(3)
    assert steady["per_seed_mean_gains"] == [2.0, 3.0, 4.0]
    assert steady["mean_gain_standard_error"] == pytest.approx(1 / math.sqrt(3))
    assert steady["gain_counts"] and steady["verdict"] == "yes"
    # The same mean gain, but one seed carries it: standard error 3, the gain is within 2 of them.
    noisy = claims.compare_accuracy(base, method([-3.0, 3.0, 9.0]))
    assert noisy["mean_gain"] == pytest.approx(3)
    assert noisy["mean_gain_standard_error"] == pytest.approx(2 * math.sqrt(3))
    assert noisy["classes_improved"] == 3 and not noisy["gain_counts"] and noisy["verdict"] == "no"
    # Just beyond and just within 2 standard errors (the gains 1 +- d have standard error d / sqrt(3)).
    for d, counts in ((0.99 * math.sqrt(3) / 2, True), (1.01 * math.sqrt(3) / 2, False)):
        c = claims.compare_accuracy(base, method([1 - d, 1.0, 1 + d]))
        assert c["gain_counts"] is counts and c["verdict"] == ("yes" if counts else "no"), d
    one_seed = claims.compare_accuracy(base[:1], method([5.0])[:1])
    assert math.isinf(one_seed["mean_gain_standard_error"]) and one_seed["verdict"] == "no"
    with pytest.raises(ValueError, match="different seeds"):
        claims.compare_accuracy(base, method([1.0, 1.0, 1.0])[::-1])


@pytest.mark.parametrize("seed", (0, 7))
def test_spurious_digits_agree_with_the_label_as_specified(seed):
    """The bar agrees with the label on 95% of each label's training images and on half of each label's
    validation and test images; groups are 2 * label + bar; the bar is the left column at full brightness; the
    rest of each image is a digit of scikit-learn's set, untouched, each used once; the label is digit < 5."""
    from sklearn.datasets import load_digits

    from dro_ext.demo.data import load_spurious_digits

    def right_columns(pixels):  # columns 1-7 of each image in the digits' own units, 0-16
        return [tuple(row) for row in (pixels.reshape(-1, 8, 8)[:, :, 1:] * 16).round().reshape(len(pixels), -1)
                .astype(int).tolist()]

    images, digits = load_digits(return_X_y=True)
    digit_of = dict(zip(right_columns(images / 16.0), digits))  # columns 1-7 tell the 1797 digits apart
    assert len(digit_of) == len(digits)
    data = load_spurious_digits(seed=seed)
    seen = []
    for split, agreement in (("train", 0.95), ("val", 0.5), ("test", 0.5)):
        x, y, groups = (getattr(data, f"{name}_{split}") for name in "xyg")
        assert x.dtype == torch.float32 and y.dtype == groups.dtype == torch.int64
        bar = groups % 2
        assert torch.equal(groups // 2, y)
        for label in (0, 1):
            members = y == label
            assert (bar[members] == label).sum().item() == round(agreement * members.sum().item()), (split, label)
        pixels = x.reshape(-1, 8, 8)
        assert torch.equal(pixels[bar == 1][:, :, 0], torch.ones(int(bar.sum()), 8))
        assert pixels[bar == 0][:, :, 0].max() < 1  # the digits never ink the left column at full brightness
        keys = right_columns(x.numpy())
        assert [int(digit_of[key] < 5) for key in keys] == y.tolist()
        seen += keys
    assert sorted(seen) == sorted(digit_of)  # the three splits partition the digits
    train_counts = torch.bincount(data.g_train, minlength=4)
    assert train_counts[[1, 2]].max() < 0.06 * len(data.y_train) / 2 < train_counts[[0, 3]].min()
    test_counts = torch.bincount(data.g_test, minlength=4)
    assert (test_counts.max() - test_counts.min()).item() <= 2  # the test groups about equal


def test_spurious_digits_group_counts_at_seed_0():
    from dro_ext.demo.data import load_spurious_digits

    data = load_spurious_digits(seed=0)
    assert [torch.bincount(g, minlength=4).tolist() for g in (data.g_train, data.g_val, data.g_test)] == [
        [426, 22, 22, 428], [90, 89, 90, 90], [134, 135, 135, 136]]


def test_group_objectives_are_the_documented_losses():
    import dro_ext

    losses = torch.tensor([0.5, 2.0, 1.0, 3.0, 0.25], dtype=torch.float64)
    groups = torch.tensor([0, 1, 1, 3, 0])
    erm, module = experiments.group_objective("erm", None)
    assert module is None and erm(losses, groups) == losses.mean()
    for method in ("group_dro", "group_chi2", "chi2"):
        objective, module = experiments.group_objective(method, 0.5)
        module.double()
        value = objective(losses, groups)
        if method == "group_dro":
            expected = dro_ext.GroupDROLoss(4, step_size=0.5).double()(losses, groups)
        elif method == "group_chi2":
            expected = dro_ext.group_dro_loss(losses, groups, 4, module.eta, 0.5, "chi2")
        else:
            expected = dro_ext.dro_loss(losses, module.eta, 0.5, "chi2")
        assert torch.equal(value, expected), method
        assert [name for name, _ in module.named_parameters()] == ([] if method == "group_dro" else ["eta"])
    with pytest.raises(ValueError, match="method must be one of"):
        experiments.group_objective("irm", 1.0)


def test_train_with_groups_keeps_the_earliest_epoch_of_best_validation_score(monkeypatch):
    """The kept epoch maximizes (worst-group, then mean) validation accuracy over the epochs, the earliest among
    equals; its test accuracies are reported, whatever the last epoch's."""
    from dro_ext.demo.data import load_spurious_digits

    data = load_spurious_digits(seed=0)
    val_scripts = iter([[50.0, 60, 70, 80], [70.0, 70, 90, 90], [50.0, 99, 99, 99], [70.0, 70, 90, 90],
                        [70.0, 90, 70, 75]])  # epochs 1-5: epoch 2 ties epoch 4 and beats epoch 5 on the mean
    test_values = iter(range(100))  # each test evaluation gives the next number, as every group's accuracy
    true_group_accuracy = experiments.group_accuracy

    def scripted(model, x, y, groups):
        true_group_accuracy(model, x, y, groups)  # the real thing runs (and must not fail) on every split
        if x.shape == data.x_val.shape and torch.equal(x, data.x_val):
            return next(val_scripts)
        return [float(next(test_values))] * 4

    monkeypatch.setattr(experiments, "group_accuracy", scripted)
    run = experiments.train_with_groups(data, "erm", 0.01, None, seed=0, epochs=5)
    assert run.curve == [0.0, 1.0, 2.0, 3.0, 4.0, 5.0]  # initialization, then epochs 1-5
    assert run.extra["selected_epoch"] == 2
    assert run.extra["val_group_accuracy"] == [70.0, 70, 90, 90]
    assert run.extra["test_group_accuracy"] == [2.0] * 4
    assert 0 <= run.extra["test_accuracy"] <= 100
    assert experiments.validation_score([70.0, 70, 90, 90]) == (70.0, 80.0)


def _wg_runs(worst, method="erm"):
    runs = []
    for seed, w in enumerate(worst):
        run = _run([w], seed=seed)
        run.extra.update(test_group_accuracy=[90.0, w, 95.0, 90.0], test_accuracy=85.0, strength=None, method=method)
        runs.append(run)
    return runs


def test_worst_group_verdict_needs_the_medians_and_four_of_five_seeds():
    erm = _wg_runs([40.0, 50.0, 60.0, 30.0, 20.0])
    better = claims.compare_worst_group(erm, _wg_runs([45.0, 55.0, 65.0, 35.0, 25.0], "group_dro"))
    assert better["verdict"] == "yes" and better["seeds_higher"] == 5 and better["holds_on_medians"]
    assert better["worst_group"]["method"]["mean"] == pytest.approx(45.0)
    assert better["worst_group"]["method"]["median"] == 45.0 and better["worst_group"]["method"]["low"] == 25.0
    assert better["worst_group"]["baseline"]["std"] == pytest.approx(15.811388300841896)
    three = claims.compare_worst_group(erm, _wg_runs([45.0, 55.0, 65.0, 10.0, 10.0], "group_dro"))
    assert three["seeds_higher"] == 3 and three["holds_on_medians"] and three["verdict"] == "partly"
    equal = claims.compare_worst_group(erm, _wg_runs([40.0, 50.0, 60.0, 30.0, 20.0], "group_dro"))
    assert equal["seeds_higher"] == 0 and equal["verdict"] == "no"  # a tie is not a rise
    # Higher on four seeds by a little, far lower on one: the medians decide against it.
    mixed = claims.compare_worst_group(_wg_runs([10.0, 20.0, 30.0, 40.0, 50.0]),
                                       _wg_runs([0.0, 21.0, 29.0, 41.0, 51.0], "chi2"))
    assert mixed["seeds_higher"] == 3 and mixed["holds_on_medians"] is False and mixed["verdict"] == "no"
    with pytest.raises(ValueError, match="different seeds"):
        claims.compare_worst_group(erm, _wg_runs([1.0] * 4))


def test_update_readme_replaces_only_the_marked_block(tmp_path):
    readme = tmp_path / "README.md"
    readme.write_text(f"intro\n{report.README_BEGIN}\nstale block\n{report.README_END}\noutro\n")
    (tmp_path / "docs").mkdir()
    figure = tmp_path / "docs" / "figure.png"
    fake_claims = {"a": {"tasks": {}}, **{k: {} for k in "bcd"}}
    meta = {"date_utc": "2026-01-02 03:04", "machine": {"description": "test box", "logical_cpus": 2}, "device": "cpu",
            "seconds_total": 12.0, "cpu_seconds_total": 9.0, "command": "python -m dro_ext.demo",
            "load_average": {"start": 2.5, "end": 3.5},
            "seeds": [0, 1, 2, 3, 4], "cpu_builds": {"aten": "avx2", "dro_ext": "avx2"},
            "settings": {"rounding_probes": 2}}
    original = report.claims_table
    report.claims_table = lambda c: "| claims |\n"
    try:
        report.update_readme(readme, fake_claims, meta, figure)
    finally:
        report.claims_table = original
    text = readme.read_text()
    assert text.startswith("intro\n") and text.endswith("outro\n") and "stale block" not in text
    assert "![training curves](docs/figure.png)" in text and "2026-01-02 on test box" in text
    assert "ATen `avx2`, dro_ext `avx2`" in text and "on the medians and on at least 4 of 5 seeds" in text
    assert "ran 2 more times with each initial parameter moved one floating-point step" in text
    assert "12 s wall, 9 s CPU (75% of one core; load average 2.5 at the start" in text
    readme.write_text("no markers")
    with pytest.raises(ValueError, match="demo-claims"):
        report.update_readme(readme, fake_claims, meta, figure)


def test_timing_phrase_says_when_other_jobs_shared_the_machine():
    meta = {"seconds_total": 100.0, "cpu_seconds_total": 96.0, "machine": {"logical_cpus": 2},
            "load_average": {"start": 1.0, "end": 1.5}}
    quiet = report.timing_phrase(meta)
    assert quiet == "100 s wall, 96 s CPU (96% of one core; load average 1.0 at the start and 1.5 at the end on 2 CPUs)"
    shared = dict(meta, load_average={"start": 1.0, "end": 4.0})
    assert "other jobs shared the machine" in report.timing_phrase(shared)
    slowed = dict(meta, cpu_seconds_total=50.0, load_average={"start": None, "end": None})
    assert report.timing_phrase(slowed).startswith("100 s wall, 50 s CPU (50% of one core; other jobs shared")
    parallel = dict(meta, cpu_seconds_total=190.0, jobs=2)
    assert report.timing_phrase(parallel) == ("100 s wall, 190 s CPU (190% of one core, 2 processes at once; load "
                                              "average 1.0 at the start and 1.5 at the end on 2 CPUs)")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error raised where no CUDA device exists")
def test_device_cuda_without_a_gpu_says_so(tmp_path):
    from dro_ext.demo.__main__ import run_demo

    with pytest.raises(SystemExit, match="no CUDA device"):
        run_demo(tmp_path, quick=True, device="cuda")


def test_the_demo_without_its_extras_names_the_install_command(monkeypatch):
    import importlib
    import importlib.util

    import dro_ext.demo
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *args: None if name in ("sklearn", "tqdm") else real_find_spec(name, *args))
    with pytest.raises(ModuleNotFoundError, match=r'needs scikit-learn, tqdm, .*pip install "dro_ext\[demo\]"'):
        importlib.reload(dro_ext.demo)
    monkeypatch.undo()
    importlib.reload(dro_ext.demo)  # every extra there again: imports


def test_worst_group_is_over_the_groups_present():
    """A split without one of the four groups (load_spurious_digits(held_out_agreement=0.0)) has a NaN accuracy for
    it, which min() returned or passed over by where it stood: the worst-group curve read [nan, nan, nan] and the
    model selection kept epoch 1 whatever followed."""
    from dro_ext.demo.data import load_spurious_digits
    from dro_ext.demo.experiments import group_accuracy, train_with_groups, validation_score

    assert validation_score([math.nan, 40.0, 10.0, math.nan]) == (10.0, 25.0)
    data = load_spurious_digits(seed=0, held_out_agreement=0.0)
    assert torch.bincount(data.g_test, minlength=4).tolist()[0] == 0  # the case: group 0 absent from the test split
    run = train_with_groups(data, "erm", 0.1, None, seed=0, epochs=2)
    accuracy = run.extra["test_group_accuracy"]
    assert math.isnan(accuracy[0]) and not any(math.isnan(v) for v in run.curve), run.curve
    assert claims.worst_group_accuracy(run) == min(v for v in accuracy if not math.isnan(v))


def test_accuracy_cell_says_below_for_a_loss_beyond_the_noise():
    """A mean gain of -10 points at a standard error of 0.3 read "the gain is within 2 of them"."""
    c = dict(mean_gain_standard_error=0.3, gain_counts=False, mean_gain=-10.0, classes_improved=0, num_classes=10,
             worst_class=0, worst_class_gain=-10.0, largest_gain_class=0, gains=[-10.0] * 10, seeds=3)
    assert "below minus 2 of them" in report._accuracy_cell(c, "m")
    c.update(mean_gain=-0.4)
    assert "within 2 of them" in report._accuracy_cell(c, "m")
    c.update(mean_gain=0.7, gain_counts=True)
    assert "beyond 2 of them" in report._accuracy_cell(c, "m")


def test_accuracy_cell_shows_the_gain_and_its_threshold_to_two_decimals():
    """A gain of 0.45 within 2 standard errors of 0.24 read "mean gain +0.5 ... standard error 0.2 (the gain is
    within 2 of them)", as if 0.5 were within 0.4."""
    c = dict(mean_gain_standard_error=0.24, gain_counts=False, mean_gain=0.45, classes_improved=6, num_classes=10,
             worst_class=0, worst_class_gain=0.1, largest_gain_class=3, gains=[0.45] * 10, seeds=5)
    cell = report._accuracy_cell(c, "m")
    assert "mean gain +0.45 points" in cell and "0.24 points (the gain is within 2 of them, 0.48)" in cell, cell


def test_a_run_names_its_code():
    """A committed run's numbers move with the code (the committed docs/demo run and the code of a week later gave
    other digits): results.json's meta records the git commit and whether the tracked files differed from it, and
    report.md says so; nothing outside a git checkout."""
    from dro_ext.demo.__main__ import source_revision

    source = source_revision()
    assert source is None or (len(source["git_commit"]) == 40 and isinstance(source["modified"], bool))
    commit = "0123456789abcdef" * 2 + "01234567"
    assert report.source_phrase({"source": {"git_commit": commit, "modified": False}}) == \
        "; code: git commit `0123456789ab`"
    assert report.source_phrase({"source": {"git_commit": commit, "modified": True}}).endswith("with local changes")
    assert report.source_phrase({"source": None}) == report.source_phrase({}) == ""
