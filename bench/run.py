"""Runs every benchmark in bench/ in turn and writes their tables and plots to one folder:

    python -m bench.run                          # full settings, CPU, into bench/results/
    python -m bench.run --quick                  # small N, few rounds, into bench/results/tmp/ (not committed)
    python -m bench.run --device cuda --out DIR  # on the GPU: DIR/loss_<card>.md, optim_<card>.md, ...

Each case prints a progress line on stderr; each benchmark prints its table on stdout when it ends.
FAST_DRO_PATH=<a checkout of daniellevy/fast-dro> adds its RobustLoss to the robust-objective and training-step
benchmarks.
"""
from __future__ import annotations

import argparse
import importlib
import time

from bench.common import progress

BENCHMARKS = ["bench.bench_loss", "bench.bench_optim", "bench.bench_robust", "bench.bench_cross_entropy",
              "bench.bench_groups", "bench.bench_train"]


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    short_names = [b.split("_", 1)[1] for b in BENCHMARKS]
    parser.add_argument("--only", nargs="+", choices=BENCHMARKS + short_names,
                        help="benchmarks to run, e.g. loss optim robust (default: all)")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--out", default=None, help="folder for the results (default bench/results; with --quick, "
                        "bench/results/tmp, which git ignores)")
    parser.add_argument("--quick", action="store_true", help="each benchmark's --quick settings")
    parser.add_argument("--note", default="", help="free text for every table header (e.g. what else ran)")
    parser.add_argument("--no-plot", action="store_true", help="tables only")
    args = parser.parse_args(argv)
    selected = [b if b.startswith("bench.") else f"bench.bench_{b}" for b in (args.only or BENCHMARKS)]
    forwarded = ["--device", args.device] + (["--out", args.out] if args.out else []) + \
        (["--quick"] if args.quick else []) + \
        (["--note", args.note] if args.note else []) + (["--no-plot"] if args.no_plot else [])
    written = {}
    for name in selected:
        module = importlib.import_module(name)
        start = time.perf_counter()
        progress(f"== {name} {' '.join(forwarded)}")
        written[name] = module.main(forwarded)
        progress(f"== {name} done in {time.perf_counter() - start:.0f} s")
    return written


if __name__ == "__main__":
    main()
