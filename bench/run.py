"""Runs every benchmark in bench/ in turn, each with its default (full) settings: python -m bench.run."""
import argparse
import importlib
import sys

BENCHMARKS = ["bench.bench_loss", "bench.bench_optim", "bench.bench_robust"]


def main():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--only", nargs="+", help="module names to run (default: all present)")
    args = parser.parse_args()
    for name in args.only or BENCHMARKS:
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError as exc:
            if exc.name != name:
                raise
            continue
        print(f"== {name}", flush=True)
        module.main([])
    return 0


if __name__ == "__main__":
    sys.exit(main())
