"""Runs every benchmark in bench/ in turn and writes their tables and plots to one folder:

    python -m bench.run                          # full settings, CPU, into bench/results/
    python -m bench.run --quick --out /tmp/b     # small N, few rounds: under a minute on a quiet machine
    python -m bench.run --device cuda --out DIR  # on the GPU: DIR/loss_<card>.md, optim_<card>.md, ...

Each case prints a progress line on stderr; each benchmark prints its table on stdout when it ends.
FAST_DRO_PATH=<a checkout of daniellevy/fast-dro> adds its RobustLoss to the robust-objective benchmark.
"""
from __future__ import annotations

import argparse
import importlib
import sys
import time

from bench.common import RESULTS_DIR, progress

BENCHMARKS = ["bench.bench_loss", "bench.bench_optim", "bench.bench_robust"]
# Benchmarks other branches add; run when present (each main takes the same --device/--out/--quick/... flags).
OPTIONAL = ["bench.bench_cross_entropy"]


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    short_names = [b.split("_", 1)[1] for b in BENCHMARKS + OPTIONAL]
    parser.add_argument("--only", nargs="+", choices=BENCHMARKS + OPTIONAL + short_names,
                        help="benchmarks to run, e.g. loss optim robust (default: all present)")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--out", default=RESULTS_DIR, help="folder for the results (default bench/results)")
    parser.add_argument("--quick", action="store_true", help="each benchmark's --quick settings")
    parser.add_argument("--note", default="", help="free text for every table header (e.g. what else ran)")
    parser.add_argument("--no-plot", action="store_true", help="tables only")
    args = parser.parse_args(argv)
    selected = [b if b.startswith("bench.") else f"bench.bench_{b}" for b in (args.only or BENCHMARKS + OPTIONAL)]
    forwarded = ["--device", args.device, "--out", args.out] + (["--quick"] if args.quick else []) + \
        (["--note", args.note] if args.note else []) + (["--no-plot"] if args.no_plot else [])
    written = {}
    for name in selected:
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError as exc:
            if exc.name != name or name not in OPTIONAL:
                raise
            continue
        start = time.perf_counter()
        progress(f"== {name} {' '.join(forwarded)}")
        try:
            written[name] = module.main(forwarded)
        except SystemExit as exc:
            # A benchmark from another branch whose command line lacks one of the forwarded flags: say so
            # loudly and go on with the others rather than losing their results.
            if name not in OPTIONAL or exc.code in (0, None):
                raise
            progress(f"== {name} FAILED (exit {exc.code}) with {' '.join(forwarded)}: run it alone")
            written[name] = None
            continue
        progress(f"== {name} done in {time.perf_counter() - start:.0f} s")
    return written


if __name__ == "__main__":
    # The results of the benchmarks that ran are written either way; the status says whether all of them did.
    sys.exit(1 if None in main().values() else 0)
