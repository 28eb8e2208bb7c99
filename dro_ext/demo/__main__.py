"""``python -m dro_ext.demo [--quick] [--device cpu|cuda] [--seed N] [--out DIR] [--experiments NAME ...]
[--rounding-probes N] [--jobs N] [--readme README.md]``: the paper's experiments.

Runs Example 3.1, the imbalanced regression, the imbalanced digits (chi2 and CVaR) and, beyond the paper,
ERM against group and sample-level DRO on digits with a spurious feature, then writes
figure.png, tables.md, report.md and results.json to ``--out`` (default ``demo_out/``). With
``--readme README.md`` it also rewrites the README's demo block (figure and claims table) from this run.
``--experiments spurious_digits`` (say) runs only the experiments named and assesses only the claims they make.
Every experiment then runs again per rounding probe (``--rounding-probes``, default 2) with its initial
parameters nudged by one rounding step; a verdict that a probe changes is reported as "not settled".
``--jobs N`` runs these passes in N processes at once, with the same numbers.
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime
import os
import platform
import shlex
import sys
import time
from collections.abc import Sequence
from typing import Any
from pathlib import Path

import torch

import dro_ext
from dro_ext.demo import claims as claims_module
from dro_ext.demo import experiments, report
from dro_ext.demo.runner import EXPERIMENTS, cpu_seconds, run_passes, use_determinism


# scikit-learn's splits take seeds below 2**32, and a run takes its seed and the few after it.
MAX_SEED = 2**32 - 16


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m dro_ext.demo", description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="tiny settings that run in seconds (a smoke test)")
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    parser.add_argument("--seed", type=int, default=0, help="seed of the data, the model inits and the batch order "
                        f"(in [0, {MAX_SEED}); the runs take it and the seeds after it)")
    parser.add_argument("--out", type=Path, default=Path("demo_out"), help="output folder (default demo_out/)")
    parser.add_argument("--rounding-probes", type=int, default=None, metavar="N",
                        help="run every experiment N more times with its initial parameters nudged by one rounding "
                        "step, and state a verdict only where all agree (default: 2, 1 with --quick; 0 skips the "
                        "check, and the verdicts are then unchecked)")
    parser.add_argument("--jobs", type=int, default=1, metavar="N",
                        help="run the experiments' passes in N worker processes at once (default 1: one after "
                        "another in this process); the numbers are the same either way")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch CPU threads (default 1: these models are too small to gain from more)")
    parser.add_argument("--experiments", nargs="+", choices=[name for name, _ in EXPERIMENTS], default=None,
                        metavar="NAME", help="run only these experiments, and assess only the claims they make "
                        f"(default: all of {', '.join(name for name, _ in EXPERIMENTS)})")
    parser.add_argument("--readme", type=Path, default=None,
                        help="also rewrite this README's demo block with the figure and the claims table")
    args = parser.parse_args(argv)
    if not 0 <= args.seed < MAX_SEED:
        parser.error(f"--seed must be in [0, {MAX_SEED}), got {args.seed}")
    if args.readme is not None and args.experiments is not None and len(set(args.experiments)) < len(EXPERIMENTS):
        parser.error("--readme records a run of every experiment: leave out --experiments")
    if args.readme is not None and (args.quick or args.rounding_probes == 0):
        parser.error("--readme records a full run with its rounding probes: leave out --quick and "
                     "--rounding-probes 0")
    if args.threads < 1:
        parser.error(f"--threads must be >= 1, got {args.threads}")
    if args.jobs < 1:
        parser.error(f"--jobs must be >= 1, got {args.jobs}")
    if args.rounding_probes is not None and args.rounding_probes < 0:
        parser.error(f"--rounding-probes must be >= 0, got {args.rounding_probes}")
    return args


def check_outputs(out: Path, readme: Path | None) -> None:
    """What the run writes at its end, checked before it trains for minutes: ``out`` (created) takes files, and
    ``readme`` holds the demo block and the folder ``out`` lies in (checked first: a refusal creates nothing). Exits
    with the reason otherwise."""
    if readme is not None:
        try:
            report.check_readme(readme, out / "figure.png")
        except (OSError, ValueError) as error:
            raise SystemExit(f"python -m dro_ext.demo: error: --readme {readme}: {error}") from None
    try:
        out.mkdir(parents=True, exist_ok=True)
        probe = out / ".dro_ext_demo_write_check"
        probe.write_text("")
        probe.unlink()
    except OSError as error:
        raise SystemExit(f"python -m dro_ext.demo: error: --out {out}: cannot write the outputs there "
                         f"({error.strerror or error})") from None


def machine_description(device: str) -> dict:
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    info = {"cpu": cpu, "logical_cpus": os.cpu_count(), "torch_threads": torch.get_num_threads(),
            "platform": platform.platform(), "gpu": None}
    if device == "cuda":
        info["gpu"] = torch.cuda.get_device_name()
    info["description"] = f"{info['logical_cpus']}-vCPU {cpu}" + (f", GPU {info['gpu']}" if info["gpu"] else
                                                                   ", no GPU used")
    return info


def cpu_builds() -> dict:
    """The SIMD builds of the CPU kernels this process runs: ATen's and dro_ext's widest (None on the fallback;
    where it is avx512 on an Intel processor, small calls run avx2, csrc/cpu/kernels.h). Both follow
    ATEN_CPU_CAPABILITY; they round float32 differently, so they are part of what a run's digits depend on."""
    from dro_ext import _backend

    return {"aten": torch.backends.cpu.get_cpu_capability().lower(),
            "dro_ext": torch.ops.dro_ext._cpu_capability() if _backend.use_native() else None}


def load_average() -> float | None:
    """The 1-minute load average (None where the OS has none): with the CPU time, how shared the machine was."""
    try:
        return os.getloadavg()[0]
    except (AttributeError, OSError):
        return None


def versions() -> dict:
    import matplotlib
    import numpy
    import sklearn

    return {"python": platform.python_version(), "torch": torch.__version__, "dro_ext": dro_ext.__version__,
            "dro_ext_backend": dro_ext.backend(), "numpy": numpy.__version__, "scikit-learn": sklearn.__version__,
            "matplotlib": matplotlib.__version__}


def source_revision() -> dict | None:
    """The git commit the package runs from, and whether its tracked files differ from it (None outside a git
    checkout, as for an installed wheel): the numbers of a committed run move with the code, so a run names its
    code."""
    import subprocess

    root = Path(dro_ext.__file__).resolve().parent.parent

    def git(*args: str) -> str:
        return subprocess.run(["git", "-C", str(root), *args], capture_output=True, text=True, timeout=10,
                              check=True).stdout.strip()

    try:
        # (Only where the package's folder is the checkout's top: an installed copy inside another repository, a
        # virtual environment in a project's folder, would otherwise name that repository's commit.)
        if Path(git("rev-parse", "--show-toplevel")).resolve() != root:
            return None
        commit = git("rev-parse", "HEAD")
        changes = git("status", "--porcelain", "--untracked-files=no")
    except (OSError, subprocess.SubprocessError):
        return None
    return {"git_commit": commit, "modified": bool(changes)}


def run_demo(out: Path, *, quick: bool = False, device: str = "cpu", seed: int = 0, threads: int = 1,
             command: str = "python -m dro_ext.demo", only: Sequence[str] | None = None,
             rounding_probes: int | None = None, jobs: int = 1
             ) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
    """Run every experiment (or those named in ``only``), then each again per rounding probe (``rounding_probes``,
    default the settings'), assess the claims they make, settle them over the probes and write the outputs;
    returns ``(paths, claims, meta)``. ``jobs`` > 1 spreads the passes over that many worker processes of ``threads``
    torch threads each (:func:`dro_ext.demo.runner.run_passes`).

    Sets this process's torch thread count and ``torch.use_deterministic_algorithms(True)``.
    """
    if threads < 1:
        raise ValueError(f"threads must be >= 1, got {threads}")
    names = [name for name, _ in EXPERIMENTS]
    if only is not None and (not only or not set(only) <= set(names)):
        raise ValueError(f"only must name some of the experiments {names}, got {only!r}")
    if device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: no CUDA device is available to torch on this machine")
    if device == "cuda":
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # deterministic cuBLAS
    use_determinism(threads, device)  # same seed, same numbers

    settings = experiments.Settings.quick() if quick else experiments.Settings.full()
    if rounding_probes is not None:
        if rounding_probes < 0:
            raise ValueError(f"rounding_probes must be >= 0, got {rounding_probes}")
        settings = dataclasses.replace(settings, rounding_probes=rounding_probes)
    start, cpu_start, load_at_start = time.perf_counter(), cpu_seconds(), load_average()
    # results_by_probe[0]: the runs as trained; [p]: rounding probe p of every experiment.
    results_by_probe, seconds = run_passes([name for name in names if only is None or name in only], settings, seed,
                                           device, threads, jobs)
    results = results_by_probe[0]
    claims = claims_module.settle(claims_module.assess(results), [claims_module.assess(r) for r in results_by_probe[1:]])
    meta = {
        "date_utc": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M"),
        "command": command, "quick": quick, "device": device, "seed": seed, "experiments": list(results), "jobs": jobs,
        "seeds": list(range(seed, seed + settings.seeds)),
        "settings": dataclasses.asdict(settings),
        "paper_settings": {"lam": experiments.LAM, "alpha": experiments.ALPHA, "example_lam": experiments.EXAMPLE_LAM,
                           "momentum": 0.9, "batch_size": 128, "nsgd_eps": 0.1},
        "versions": versions(), "source": source_revision(), "machine": machine_description(device),
        "cpu_builds": cpu_builds(),
        "seconds_per_experiment": seconds, "seconds_total": time.perf_counter() - start,
        # CPU time of this process and its workers: unlike the wall time, barely inflated when other jobs share
        # the cores.
        "cpu_seconds_total": cpu_seconds() - cpu_start,
        "load_average": {"start": load_at_start, "end": load_average()},
    }
    return report.write_outputs(Path(out), results, claims, meta, results_by_probe[1:]), claims, meta


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    check_outputs(args.out, args.readme)
    command = "python -m dro_ext.demo " + " ".join(shlex.quote(a) for a in (sys.argv[1:] if argv is None else argv))
    paths, claims, meta = run_demo(args.out, quick=args.quick, device=args.device, seed=args.seed,
                                   threads=args.threads, command=command.strip(), only=args.experiments,
                                   rounding_probes=args.rounding_probes, jobs=args.jobs)
    if args.readme is not None:
        report.update_readme(args.readme, claims, meta, paths["figure.png"])
    print(f"[dro_ext.demo] done in {meta['seconds_total']:.0f} s ({meta['cpu_seconds_total']:.0f} s CPU); "
          f"outputs in {args.out}/: " + ", ".join(p.name for p in paths.values()))
    for key in claims:
        print(f"  claim ({key}) reproduced: {claims[key]['verdict']:11s} {claims[key]['claim']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
