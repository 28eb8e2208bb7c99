"""dro_ext on torch.distributed: 2 CPU processes (gloo) that the tests spawn themselves.

The checks themselves live in tests/distributed_jobs.py and run inside every rank; each rank compares
its results with the single-process answer on the concatenated data. To pay the process start-up once,
the DDP, compile, FSDP2 and robust-objective checks run as one spawned job (a module-scoped fixture, which
runs the checks of the selected tests only), and each test below reads its part of the result. Every
spawned process runs in its own session with a wall-clock bound: on timeout the whole session is killed
(SIGKILL) and the test fails with the logs. The ranks meet through a FileStore in the test's temporary
directory (no TCP port to pick, no clash between tests); gloo's own connections use ephemeral ports.
"""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch.distributed as dist

ROOT = Path(__file__).resolve().parent.parent
JOBS_SCRIPT = ROOT / "tests" / "distributed_jobs.py"
WORLD = 2
# Wall-clock bounds, wide because the machine may be shared: the whole file used about 40 s of CPU in all
# (both ranks, every job, the example runs) and took 90-120 s of wall time on 2 cores shared with a load of 10-200.
SUITE_TIMEOUT = float(os.environ.get("DRO_EXT_DIST_TIMEOUT", "300"))
SHORT_TIMEOUT = float(os.environ.get("DRO_EXT_DIST_SHORT_TIMEOUT", "150"))

pytestmark = pytest.mark.skipif(not (dist.is_available() and dist.is_gloo_available()),
                                reason="torch.distributed with the gloo backend is not available in this torch build")


def _env():
    env = dict(os.environ)
    env["OMP_NUM_THREADS"] = "1"  # two ranks on a small machine: no oversubscription
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    env.pop("TORCHELASTIC_RUN_ID", None)
    return env


def _kill(proc: subprocess.Popen) -> None:
    """Kill the process's whole session (it was started with start_new_session) and reap it."""
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    proc.wait()


def _run(commands, directory: Path, timeout: float):
    """Start every command (one per rank) and wait for all: [(returncode, log text)], or fail on timeout."""
    procs, logs = [], []
    try:
        for i, command in enumerate(commands):
            log = open(directory / f"rank{i}.log", "w")
            logs.append(log)
            procs.append(subprocess.Popen(command, cwd=ROOT, env=_env(), stdout=log, stderr=subprocess.STDOUT,
                                          start_new_session=True))
        deadline = time.monotonic() + timeout
        for proc in procs:
            try:
                proc.wait(timeout=max(deadline - time.monotonic(), 0.1))
            except subprocess.TimeoutExpired:
                for p in procs:
                    _kill(p)
                texts = [(directory / f"rank{i}.log").read_text()[-3000:] for i in range(len(procs))]
                pytest.fail(f"the spawned ranks did not finish within {timeout:.0f} s (killed):\n"
                            + "\n---\n".join(texts))
    finally:
        for p in procs:
            _kill(p)
        for log in logs:
            log.close()
    return [(p.returncode, (directory / f"rank{i}.log").read_text()) for i, p in enumerate(procs)]


def _ranks(jobs: str, directory: Path, results: Path | None = None):
    store = directory / "store"
    extra = [str(results)] if results is not None else []
    return [[sys.executable, str(JOBS_SCRIPT), jobs, str(rank), str(WORLD), str(store), *extra]
            for rank in range(WORLD)]


# The job of the shared spawn that each test reads: the fixture runs those of the selected tests only (CI's check
# against the GPU machines' torch selects `-k compile`, which needs loss_compile alone).
SUITE_JOBS = {
    "test_ddp_gradients_and_trajectory_equal_single_process": "ddp",
    "test_droloss_group_compiles_fullgraph": "loss_compile",
    "test_fsdp2_normalized_sgd_follows_unsharded": "fsdp",
    "test_distributed_robust_objective_equals_single_process": "robust",
}


def _records(results: Path) -> dict:
    """{job: {rank: record}} from the ranks' results file."""
    records: dict = {}
    if results.exists():
        for line in results.read_text().splitlines():
            record = json.loads(line)
            records.setdefault(record["job"], {})[record["rank"]] = record
    return records


@pytest.fixture(scope="module")
def suite(request, tmp_path_factory):
    """Runs the jobs of the selected tests once in 2 ranks; {job: {rank: record}} and logs."""
    selected = {item.originalname for item in request.session.items if getattr(item, "module", None) is request.module}
    jobs = [job for test, job in SUITE_JOBS.items() if test in selected]
    directory = tmp_path_factory.mktemp("dist_suite")
    results = directory / "results.jsonl"
    outcome = _run(_ranks(",".join(jobs), directory, results), directory, SUITE_TIMEOUT)
    return _records(results), outcome


def _check(suite, job):
    records, outcome = suite
    per_rank = records.get(job, {})
    failures = [f"rank {r}: {rec['detail']}" for r, rec in sorted(per_rank.items()) if rec["status"] != "passed"]
    if failures:
        pytest.fail(f"{job} failed:\n" + "\n".join(failures))
    if sorted(per_rank) != list(range(WORLD)):
        logs = "\n---\n".join(f"rank {i} (exit {rc}):\n{text[-3000:]}" for i, (rc, text) in enumerate(outcome))
        pytest.fail(f"{job} did not run on every rank (an earlier job failed or a rank crashed):\n{logs}")


def test_ddp_gradients_and_trajectory_equal_single_process(suite):
    """DDP + DROLoss (all six divergences, both backends): model and eta gradients equal the single-process
    ones on the concatenated batch for equal local batches, and for unequal ones with DROLoss(group=)
    (without it they differ); 3 NormalizedSGD steps follow the single-process trajectory and the
    optimizer issues no collective; a NaN loss on one rank makes every rank's gradients and parameters NaN."""
    _check(suite, "ddp")


def test_droloss_group_compiles_fullgraph(suite):
    """DROLoss(group=) under torch.compile(fullgraph=True): same value and gradient as eager."""
    _check(suite, "loss_compile")


def test_fsdp2_normalized_sgd_follows_unsharded(suite):
    """FSDP2-sharded NormalizedSGD (uneven shards, one empty; eta unsharded in the same group) over 5 steps
    equals the unsharded run: global and tensor norms, fused and foreach, float64 and float32 with weight
    decay and maximize; GradScaler unscale and skip; one all-reduce per step; HSDP (2-D mesh) reduces over
    the shard dim only; FSDP2 training with DROLoss(group=) on unequal batches
    equals single-process training; a torch.distributed.checkpoint round trip of the sharded state
    resumes bit for bit."""
    _check(suite, "fsdp")


def test_distributed_robust_objective_equals_single_process(suite):
    """robust_objective (value, eta*, Danskin gradient), worst_case_weights and weight_stats with group=
    equal the single-process answers on the concatenated losses for every divergence, on unequal shards,
    an empty shard, ties (cvar's fractional boundary), float64 and float32; evaluate with group=; NaN on
    one rank gives NaN on every rank."""
    _check(suite, "robust")


def test_distributed_robust_objective_over_groups(tmp_path):
    """robust_objective, worst_case_weights and evaluate over groups with group= equal the single-process answers
    on the concatenated losses and ids (every divergence, batch and population weighting, an empty shard)."""
    directory = tmp_path / "group_robust"
    directory.mkdir()
    results = directory / "results.jsonl"
    outcome = _run(_ranks("group_robust", directory, results), directory, SHORT_TIMEOUT)
    _check((_records(results), outcome), "group_robust")


def test_dead_rank_gives_clear_error_not_hang(tmp_path):
    start = time.monotonic()
    (rc0, log0), (rc1, log1) = _run(_ranks("dies", tmp_path), tmp_path, SHORT_TIMEOUT)
    assert rc1 == 3, f"rank 1 should have died with exit code 3, got {rc1}:\n{log1[-2000:]}"
    assert rc0 == 0, log0[-3000:]
    for name in ("robust_objective", "DROLoss", "group_dro_loss"):
        assert f"SURVIVOR-RAISED: dro_ext.{name}: an all-reduce" in log0, log0[-3000:]
    assert time.monotonic() - start < SHORT_TIMEOUT


def _torchrun(tmp_path, *flags):
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={WORLD}",
               str(ROOT / "examples" / "ddp_classification.py"), "--steps", "30", "--eval-every", "15",
               "--backend", "gloo", *flags]
    ((rc, log),) = _run([command], tmp_path, SHORT_TIMEOUT)
    assert rc == 0, log[-4000:]
    assert "largest parameter difference between ranks 0.0e+00" in log, log[-4000:]
    return re.findall(r"step +\d+ +robust objective .*", log)


def test_example_ddp_and_fsdp2_train_the_same_model(tmp_path):
    """examples/ddp_classification.py under torchrun: DDP with equal local batches and FSDP2 with unequal
    ones (DROLoss(group=)) both follow single-process training on the global batch, so they print the
    same robust objective and accuracy."""
    printed = {}
    for name, flags in (("ddp", ()), ("fsdp2_unequal", ("--fsdp", "--unequal"))):
        directory = tmp_path / name
        directory.mkdir()
        printed[name] = _torchrun(directory, *flags)
    assert len(printed["ddp"]) == 2 and printed["ddp"] == printed["fsdp2_unequal"], printed


HF_RECIPE_RANK = """
import os, sys, importlib.util, torch
spec = importlib.util.spec_from_file_location("recipe", sys.argv[1])
recipe = importlib.util.module_from_spec(spec)
spec.loader.exec_module(recipe)
trainer, losses = recipe.train(steps=3, output_dir=sys.argv[2], batch_size=4, length=16, vocab=128)
assert type(trainer.model_wrapped).__name__ == "DistributedDataParallel", type(trainer.model_wrapped)
torch.save([p.detach() for p in trainer.model.parameters()], os.path.join(sys.argv[2], f"rank{os.environ['RANK']}.pt"))
# Leave in order: a rank that exited with the Trainer's gloo group alive aborted now and then in its teardown
# ("terminate called without an active exception", SIGABRT after training had finished).
torch.distributed.barrier()
torch.distributed.destroy_process_group()
"""


def test_example_hf_trainer_trains_one_model_under_ddp(tmp_path):
    """examples/hf_trainer.py under torchrun (2 ranks, DDP over gloo): the loss is computed inside the model's
    forward, so DDP averages every gradient, eta's included, and the ranks, which read different batches, hold the
    same parameters after every step. (The recipe called the body of the model past DDP's wrapper: an
    AttributeError, and with the wrapper taken off, ranks whose parameters drifted apart.)"""
    pytest.importorskip("transformers", reason="the examples extra: pip install 'dro_ext[examples]'")
    import torch

    script = tmp_path / "hf_rank.py"
    script.write_text(HF_RECIPE_RANK)
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={WORLD}", str(script),
               str(ROOT / "examples" / "hf_trainer.py"), str(tmp_path)]
    ((rc, log),) = _run([command], tmp_path, SHORT_TIMEOUT)
    assert rc == 0, log[-4000:]
    rank0, rank1 = (torch.load(tmp_path / f"rank{rank}.pt") for rank in range(WORLD))
    assert len(rank0) == len(rank1) > 0
    for a, b in zip(rank0, rank1):
        assert torch.equal(a, b)
    untrained = load_example_model()
    assert any(not torch.equal(a, b) for a, b in zip(rank0, untrained.parameters()))


def load_example_model():
    """The recipe's untrained model, as each rank builds it (seed 0)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("hf_recipe", ROOT / "examples" / "hf_trainer.py")
    recipe = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(recipe)
    return recipe.add_dro_loss(recipe.tiny_gpt2(128, 16, seed=0))


NUM_GROUPS_RANK = """
import datetime, os, sys, torch, torch.distributed as dist
import dro_ext, dro_ext.distributed
rank, world, store = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
dist.init_process_group("gloo", store=dist.FileStore(store, world), rank=rank, world_size=world,
                        timeout=datetime.timedelta(seconds=20))
losses = torch.tensor([0.5, 1.5, -0.25, 2.0, 0.75], dtype=torch.float64)[: rank + 2]
ids = torch.arange(rank + 2) % 3


def call(num_groups, phase):
    try:
        value = dro_ext.group_dro_loss(losses, ids, num_groups, 0.1, 0.5, group=dist.group.WORLD)
        print(f"{phase} RETURNED {value.item()!r}", flush=True)
    except Exception as e:
        print(f"{phase} RAISED {type(e).__name__}: {e}", flush=True)


# The check itself: every rank passes num_groups=3, but rank 1 sees the count of another rank's num_groups in the
# reduced vector (as a rank whose vector was cut short by a longer one would).
reduce = dro_ext.distributed.functional_all_reduce
if rank == 1:
    dro_ext.distributed.functional_all_reduce = lambda t, *a: reduce(t, *a) + (torch.arange(t.numel()) == 0)
call(3, "CHECK")
dro_ext.distributed.functional_all_reduce = reduce
dist.barrier()
# The user error: rank 0 passes num_groups=4, the others 3 (vectors of 11 and 9 numbers).
call(4 if rank == 0 else 3, "MISMATCH")
os._exit(0)
"""


def test_num_groups_that_differ_between_ranks_give_no_value(tmp_path):
    """group_dro_loss(group=) (so GroupDROLoss and DROLoss(num_groups=) too) with num_groups 4 on one rank and 3 on
    two others: gloo let the two finish their all-reduce of a shorter vector, and they returned a value made of the
    other ranks' numbers (0.757 for 1.307). The vector now carries num_groups, whose sum over the ranks shows a rank
    given another; no rank returns a value."""
    script = tmp_path / "num_groups_rank.py"
    script.write_text(NUM_GROUPS_RANK)
    world = 3
    commands = [[sys.executable, str(script), str(rank), str(world), str(tmp_path / "store")] for rank in range(world)]
    logs = [log for _, log in _run(commands, tmp_path, SHORT_TIMEOUT)]
    checks = [re.findall(r"CHECK (RETURNED|RAISED) (.*)", log) for log in logs]
    assert checks[1] == [("RAISED", "ValueError: dro_ext.group_dro_loss: num_groups differs between the ranks of the "
                                    "process group (this rank's is 3); pass the same num_groups on every rank")], logs
    for rank in (0, 2):  # the ranks that saw a sum of num_groups that agrees: the value of the concatenated batch
        assert checks[rank] and checks[rank][0][0] == "RETURNED", logs[rank][-3000:]
    assert not any("MISMATCH RETURNED" in log for log in logs), logs


def test_group_errors_name_the_problem():
    """In this (non-distributed) process: group= without an initialized process group, or of a wrong type,
    is a clear error, raised before any collective."""
    import torch

    import dro_ext

    if dist.is_initialized():  # pragma: no cover - the suite never initializes a group in-process
        pytest.skip("a process group is initialized in this process")
    losses = torch.rand(5)
    for call in (
        lambda g: dro_ext.robust_objective(losses, 0.5, group=g),
        lambda g: dro_ext.worst_case_weights(losses, 0.5, "kl", group=g),
        lambda g: dro_ext.weight_stats(losses, group=g),
        lambda g: dro_ext.DROLoss("chi2", 0.5, group=g)(losses),
    ):
        with pytest.raises(RuntimeError, match="needs torch.distributed to be initialized"):
            call(object())
