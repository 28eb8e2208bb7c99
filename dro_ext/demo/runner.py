"""Running the demo's experiments: every pass of every experiment (the runs as trained, then each rounding probe),
in this process or spread over worker processes.

Each (experiment, pass) is independent of the others: its runs seed the model, the data and the batch order
themselves, so a worker process gives bitwise the numbers this process would, and the order the passes finish in
changes nothing.
"""
from __future__ import annotations

import multiprocessing
import os
import sys
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ProcessPoolExecutor, as_completed
from typing import Any

import torch

from dro_ext.demo import experiments

# The experiments, by name, in the order the demo runs and reports them.
EXPERIMENTS: tuple[tuple[str, Callable[..., dict]], ...] = (
    ("example_3_1", experiments.example_3_1),
    ("regression", experiments.age_regression),
    ("digits_chi2", experiments.digits_chi2),
    ("digits_cvar", experiments.digits_cvar),
    ("spurious_digits", experiments.spurious_digits),
)


def use_determinism(threads: int, device: str) -> None:
    """This process's torch thread count, and ``torch.use_deterministic_algorithms(True)``: dro_ext's ops are
    deterministic by construction; this makes torch refuse (on the CPU) or warn about (on CUDA) any
    nondeterministic kernel the models might use."""
    torch.set_num_threads(threads)
    torch.use_deterministic_algorithms(True, warn_only=device == "cuda")


def _start_worker(threads: int, device: str) -> None:
    os.environ["TQDM_DISABLE"] = "1"  # the progress bars of parallel passes would write over each other
    use_determinism(threads, device)


def run_experiment(name: str, settings: experiments.Settings, seed: int, device: str, probe: int
                   ) -> tuple[dict, float]:
    """Pass ``probe`` of experiment ``name`` (0: the runs as trained): its result and its wall time in seconds."""
    start = time.perf_counter()
    return dict(EXPERIMENTS)[name](settings, seed, device, probe), time.perf_counter() - start


def _pass_name(name: str, probe: int, probes: int) -> str:
    return f"{name} (rounding probe {probe} of {probes})" if probe else name


def run_passes(names: Sequence[str], settings: experiments.Settings, seed: int, device: str, threads: int,
               jobs: int = 1) -> tuple[list[dict[str, Any]], dict[str, float]]:
    """Every experiment in ``names`` once per pass (1 + ``settings.rounding_probes``), in this process
    (``jobs`` = 1) or in ``jobs`` worker processes of ``threads`` torch threads each.

    Returns ``(results_by_pass, seconds)``: ``results_by_pass[p][name]`` is the result of pass ``p`` (0: the runs as
    trained), in the order of ``names``; ``seconds[name]`` the wall time of its passes added up.
    """
    if jobs < 1:
        raise ValueError(f"jobs must be >= 1, got {jobs}")
    passes = 1 + settings.rounding_probes
    # Experiment by experiment: the longest start early, and a pass of each is done before the next experiment's.
    tasks = [(name, probe) for name in names for probe in range(passes)]
    outcomes: dict[tuple[str, int], tuple[dict, float]] = {}
    if jobs == 1:
        for name, probe in tasks:
            print(f"[dro_ext.demo] {_pass_name(name, probe, settings.rounding_probes)} ...", file=sys.stderr,
                  flush=True)
            outcomes[name, probe] = run_experiment(name, settings, seed, device, probe)
    else:
        # spawn: a fresh interpreter per worker, never a fork of a process that has started torch's threads or CUDA.
        with ProcessPoolExecutor(max_workers=jobs, mp_context=multiprocessing.get_context("spawn"),
                                 initializer=_start_worker, initargs=(threads, device)) as pool:
            futures = {pool.submit(run_experiment, name, settings, seed, device, probe): (name, probe)
                       for name, probe in tasks}
            try:
                for future in as_completed(futures):
                    name, probe = futures[future]
                    outcomes[name, probe] = future.result()
                    print(f"[dro_ext.demo] {_pass_name(name, probe, settings.rounding_probes)} done "
                          f"({outcomes[name, probe][1]:.0f} s)", file=sys.stderr, flush=True)
            except BaseException:
                # A pass that failed (or Ctrl-C) ends the run: the passes not started yet are dropped, not waited for.
                for future in futures:
                    future.cancel()
                raise
    results_by_pass = [{name: outcomes[name, probe][0] for name in names} for probe in range(passes)]
    seconds = {name: sum(outcomes[name, probe][1] for probe in range(passes)) for name in names}
    return results_by_pass, seconds


def cpu_seconds() -> float:
    """The CPU time of this process and of its worker processes that have ended (where the OS reports it)."""
    total = time.process_time()
    try:
        import resource
    except ImportError:  # Windows: this process's time only
        return total
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    return total + children.ru_utime + children.ru_stime
