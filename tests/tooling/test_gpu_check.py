"""scripts/gpu_check.sh's own logic, without a GPU: which library it uses (a carried prebuilt one only when it
was built from the tree's sources), the TOTAL_S cap, the per-step archive and the summary. A GPU lease runs
this script once with minutes to spare, so its bash must be right before it gets there.

The script runs in a copy of the files it reads, with a stand-in for python that answers as a GPU machine's
would: the capability query says 9.0, the "does the library run here" probe passes when dro_ext/_C.abi3.so
holds the word `runs`, and pytest, the benchmarks and the build only say what they were asked."""
import os
import pathlib
import re
import shutil
import signal
import subprocess
import tarfile
import time

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]

STAND_IN_PYTHON = r"""#!/usr/bin/env bash
echo "$*" >>"$CALLS"
if [[ "$*" == *"get_device_capability"* ]]; then echo 9.0; exit 0; fi
if [[ $# -eq 1 && "$1" == "-" ]]; then cat >/dev/null; grep -qs runs dro_ext/_C.abi3.so; exit; fi
if [[ "$1" == "-c" ]]; then exit 0; fi  # import xdist / pytest_timeout: installed
if [[ "$1" == "-m" && "$2" == "pytest" ]]; then echo "stand-in pytest"; exit 0; fi
if [[ "$1" == "-m" && "$2" == "bench.targets" ]]; then echo "stand-in targets of $3"; exit 0; fi
if [[ "$1" == "-m" && "$2" == "bench.run" ]]; then echo "stand-in bench"; echo $$ >"$CALLS.bench_pid"; exec sleep "${BENCH_SLEEP:-0}"; fi
if [[ "$1" == "-m" && "$2" == "bench.profile_kernels" ]]; then echo "stand-in profile into $4"; exit 0; fi
if [[ "$1" == "-m" && "$2" == "bench.bench_train" ]]; then echo "stand-in train"; exit 0; fi
if [[ "$1" == "-m" && "$2" == "dro_ext.demo" ]]; then echo "stand-in demo"; exit 0; fi
if [[ "$1" == "setup.py" ]]; then echo runs >dro_ext/_C.abi3.so; echo "stand-in build"; exit 0; fi
echo "unexpected call: $*" >&2; exit 3
"""

pytestmark = pytest.mark.skipif(shutil.which("bash") is None or shutil.which("timeout") is None,
                                reason="needs bash and coreutils' timeout")


@pytest.fixture
def tree(tmp_path):
    """A copy of what gpu_check.sh reads (scripts, csrc, setup.py, the test file names), a stand-in python."""
    work = tmp_path / "tree"
    for name in ("scripts", "csrc"):
        shutil.copytree(ROOT / name, work / name, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "setup.py", work / "setup.py")
    (work / "tests").mkdir()
    for test_file in ROOT.glob("tests/test_cuda_*.py"):
        (work / "tests" / test_file.name).write_text("")
    (work / "dro_ext").mkdir()
    python = tmp_path / "python"
    python.write_text(STAND_IN_PYTHON)
    python.chmod(0o755)
    return work


def sources_hash(work) -> str:
    return subprocess.run(["bash", "scripts/sources_hash.sh"], cwd=work, capture_output=True, text=True,
                          check=True).stdout.strip()


def prebuild(work, content="runs", sources=None):
    prebuilt = work / "build" / "gpu-prebuilt"
    prebuilt.mkdir(parents=True)
    (prebuilt / "_C.abi3.so").write_text(content)
    (prebuilt / "sources.sha256").write_text((sources or sources_hash(work)) + "\n")
    (prebuilt / "torch_version.txt").write_text("2.11.0+cu130\n")


def check_env(work, **env):
    """The environment of a gpu_check.sh run in `work`: the stand-in python, its call log, the archive."""
    return {**os.environ, "PYTHON": str(work.parent / "python"), "CALLS": str(work.parent / "calls.txt"),
            "PACK_TO": str(work.parent / "check.tar.gz"), **{k: str(v) for k, v in env.items()}}


def run_check(work, phases, **env):
    out, calls = work.parent / "out", work.parent / "calls.txt"
    proc = subprocess.run(["bash", "scripts/gpu_check.sh", str(out), phases], cwd=work, env=check_env(work, **env),
                          capture_output=True, text=True, timeout=120)
    summary = (out / "summary.txt").read_text()
    return proc, summary, calls.read_text() if calls.exists() else ""


def test_sources_hash_follows_the_sources(tree):
    before = sources_hash(tree)
    assert len(before) == 64 and before == sources_hash(tree)
    with open(tree / "csrc" / "checks.h", "a") as f:
        f.write("// an edit\n")
    assert sources_hash(tree) != before


def test_a_matching_prebuilt_library_replaces_the_build(tree):
    prebuild(tree)
    proc, summary, calls = run_check(tree, "test+bench", BENCHES="loss")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "using the prebuilt library from build/gpu-prebuilt (torch 2.11.0+cu130)" in summary
    assert "setup.py" not in calls  # nothing was built
    # Python on stdin: the environment report, then the probe without a library and the one with it; no third
    # probe (each costs the lease a python start and a CUDA context).
    assert calls.splitlines().count("-") == 3
    assert (tree / "dro_ext" / "_C.abi3.so").read_text() == "runs"
    assert "-n 8" in calls and "test_cuda_loss.py" in calls  # the CUDA tests, on 8 workers
    assert "--only loss --device cuda" in calls
    assert "cuda_tests" in summary and "bench_loss" in summary and "all steps passed" in summary
    # The targets, checked against the benchmarks' results, on the console and in DIR/targets.md.
    out = tree.parent / "out"
    assert (out / "targets.md").read_text() == f"stand-in targets of {out}/bench\n"
    assert f"stand-in targets of {out}/bench" in proc.stdout
    with tarfile.open(tree.parent / "check.tar.gz") as archive:
        names = archive.getnames()
    assert {"out/summary.txt", "out/cuda_tests.log", "out/bench_loss.log", "out/targets.md"} <= set(names)


@pytest.mark.parametrize("problem", ["stale", "does_not_run"])
def test_an_unusable_prebuilt_library_is_built_instead(tree, problem):
    if problem == "stale":
        prebuild(tree, sources="0" * 64)
    else:
        prebuild(tree, content="broken")
    proc, summary, calls = run_check(tree, "test")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    expected = "is stale" if problem == "stale" else "does not run here: building"
    assert expected in summary
    assert "setup.py build_ext --inplace" in calls
    assert (tree / "dro_ext" / "_C.abi3.so").read_text().strip() == "runs"  # the fresh build's


def test_total_s_shrinks_the_steps_and_skips_what_cannot_start(tree):
    prebuild(tree)
    proc, summary, _ = run_check(tree, "bench", BENCHES="loss optim robust", TOTAL_S=40, BENCH_S=100,
                                 BENCH_SLEEP=7)
    assert proc.returncode == 1  # a skipped step fails the run
    limit = int(re.search(r"bench_loss \(limit (\d+)s\)", proc.stdout).group(1))
    assert 20 <= limit <= 25  # what is left of TOTAL_S less 15 s of margin, not BENCH_S
    assert re.search(r"bench_loss +ok", summary)
    # 7 s later less than 20 s would be left for each of the others (40 - 7 - 15)
    assert re.search(r"bench_optim +SKIPPED", summary) and re.search(r"bench_robust +SKIPPED", summary)
    assert "SOME STEPS FAILED" in summary


def test_a_run_killed_from_outside_still_leaves_its_finished_steps_packed(tree):
    # As the device tool stops a command at its limit: the whole process group goes, mid-step.
    prebuild(tree)
    out, archive = tree.parent / "out", tree.parent / "check.tar.gz"
    env = check_env(tree, BENCHES="loss", BENCH_SLEEP=60)
    proc = subprocess.Popen(["bash", "scripts/gpu_check.sh", str(out), "test+bench"], cwd=tree, env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    # The stand-in benchmark writes its pid just before it sleeps: then the step is in flight.
    bench_pid, deadline = pathlib.Path(env["CALLS"] + ".bench_pid"), time.monotonic() + 60
    try:
        while not (bench_pid.exists() and bench_pid.read_text().strip()):
            assert time.monotonic() < deadline, "the benchmark step never started"
            time.sleep(0.2)
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
        # coreutils' timeout runs the step in a process group of its own: end the sleeping stand-in too.
        if bench_pid.exists() and bench_pid.read_text().strip():
            try:
                os.kill(int(bench_pid.read_text()), signal.SIGKILL)
            except ProcessLookupError:
                pass
    with tarfile.open(archive) as packed:
        names = packed.getnames()
    assert "out/cuda_tests.log" in names and "out/summary.txt" in names
    assert "out/bench_loss.log" not in names  # the step in flight had not finished


def test_phases_run_in_the_order_given(tree):
    prebuild(tree)
    proc, summary, calls = run_check(tree, "bench+profile+test", BENCHES="optim loss")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    steps = re.findall(r"^(\w+) +ok ", summary, flags=re.M)
    assert steps == ["bench_optim", "bench_loss", "profile", "cuda_tests"]
    assert (calls.index("--only optim") < calls.index("--only loss") < calls.index("-m bench.profile_kernels")
            < calls.index("-m pytest"))
    assert re.search(r"bench\.profile_kernels --out \S+/out/bench", calls)
    proc, summary, _ = run_check(tree, "test+sanitise")
    assert proc.returncode == 1 and "unknown phase 'sanitise'" in summary


def test_the_train_and_demo_phases_and_a_choice_of_test_files(tree):
    prebuild(tree)
    proc, summary, calls = run_check(tree, "train+test+train_compile+demo", TRAIN_MODES="graph",
                                     CUDA_TEST_FILES="tests/test_cuda_loss.py tests/test_cuda_optim.py")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert re.findall(r"^(\w+) +ok ", summary, flags=re.M) == ["train", "cuda_tests", "train_compile", "demo"]
    assert re.search(r"-m bench\.bench_train --device cuda --out \S+/out/bench --modes graph\n", calls)
    # the compiled steps: the cases whose compilation takes seconds first, resnet18's (minutes) last
    assert re.search(r"-m bench\.bench_train --device cuda --out \S+/out/bench --modes compile --name train_compile "
                     r"--cases mlp-large-batch lm-head resnet18\n", calls)
    assert re.search(r"-m dro_ext\.demo --device cuda --out \S+/out/demo --rounding-probes 0\n", calls)
    pytest_call = next(line for line in calls.splitlines() if "-m pytest" in line)
    assert pytest_call.endswith("tests/test_cuda_loss.py tests/test_cuda_optim.py")
    # By default every CUDA test file, and every mode of the training step.
    (tree.parent / "calls.txt").unlink()
    (tree.parent / "out" / "summary.txt").unlink()
    proc, _, calls = run_check(tree, "train+test")
    assert proc.returncode == 0 and "--modes eager graph\n" in calls
    pytest_call = next(line for line in calls.splitlines() if "-m pytest" in line)
    assert all(f"tests/{f.name}" in pytest_call for f in ROOT.glob("tests/test_cuda_*.py"))


def test_a_rerun_into_the_same_folder_runs_only_what_the_first_left(tree):
    # The lease's second call: the first ran out of TOTAL_S after one benchmark; the same command again runs the
    # two it skipped, and neither the tests nor the finished benchmark a second time.
    prebuild(tree)
    first, summary, _ = run_check(tree, "test+bench", BENCHES="loss optim robust", TOTAL_S=40, BENCH_SLEEP=7)
    assert first.returncode == 1
    assert re.search(r"bench_optim +SKIPPED", summary) and re.search(r"bench_robust +SKIPPED", summary)
    calls_file = tree.parent / "calls.txt"
    calls_file.unlink()
    second, summary, calls = run_check(tree, "test+bench", BENCHES="loss optim robust", BENCH_SLEEP=0)
    assert second.returncode == 0, second.stdout + second.stderr
    assert "-m pytest" not in calls and "--only loss" not in calls
    assert "--only optim" in calls and "--only robust" in calls
    assert "-m bench.targets" in calls  # the targets again, over both runs' results
    assert "cuda_tests: ok in an earlier run" in second.stdout
    assert re.search(r"bench_optim +ok", summary) and re.search(r"bench_robust +ok", summary)
    with tarfile.open(tree.parent / "check.tar.gz") as archive:  # the archive holds both runs' logs
        names = archive.getnames()
    assert {"out/cuda_tests.log", "out/bench_loss.log", "out/bench_optim.log", "out/bench_robust.log"} <= set(names)


def test_a_step_cut_short_by_total_s_runs_again_but_a_timeout_at_its_own_limit_does_not(tree):
    # The first call's last benchmark runs out of what TOTAL_S left it, short of its own BENCH_S: CUT, and the second
    # call runs it again. A step that ran out of its own limit (TIMEOUT) would only time out again: not rerun.
    prebuild(tree)
    first, summary, _ = run_check(tree, "bench", BENCHES="loss", TOTAL_S=40, BENCH_S=300, BENCH_SLEEP=60)
    assert first.returncode == 1
    assert re.search(r"^bench_loss +CUT +rc=124", summary, flags=re.M), summary
    (tree.parent / "calls.txt").unlink()
    second, summary, calls = run_check(tree, "bench", BENCHES="loss", BENCH_SLEEP=0)
    assert second.returncode == 0, second.stdout + second.stderr
    assert "--only loss" in calls and re.search(r"^bench_loss +ok ", summary, flags=re.M)
    out = tree.parent / "out"
    (out / "summary.txt").write_text("bench_loss             TIMEOUT  rc=124    150s  /x/bench_loss.log\n")
    (tree.parent / "calls.txt").unlink()
    third, _, calls = run_check(tree, "bench", BENCHES="loss")
    assert "--only loss" not in calls and "bench_loss: TIMEOUT in an earlier run" in third.stdout


def test_a_rerun_does_not_repeat_a_failed_step(tree):
    prebuild(tree)
    out = tree.parent / "out"
    out.mkdir()
    (out / "summary.txt").write_text("cuda_tests             FAILED   rc=1       80s  /x/cuda_tests.log\n")
    proc, summary, calls = run_check(tree, "test")
    assert proc.returncode == 1  # the earlier failure still fails the run
    assert "-m pytest" not in calls and "cuda_tests: FAILED in an earlier run" in proc.stdout
