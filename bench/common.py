"""Timing, bandwidth and reporting helpers shared by the benchmarks.

Every benchmark writes one row per measurement to bench/results/<name>.json and .csv and a markdown
table with the ratios to bench/results/<name>.md. Timings are medians of many repetitions, taken side by
side in one process; the floor is bytes that must move over the bandwidth of a copy of the same size, timed
in the same rounds as the implementations.
"""
from __future__ import annotations

import csv
import json
import os
import platform
import statistics
import time
from typing import Callable

import torch

RESULTS_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")


def synchronize(device: torch.device | str) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def time_fn(fn: Callable[[], object], device="cpu", *, warmup: int = 3, min_reps: int = 10, min_seconds: float = 0.5,
            max_reps: int = 1000) -> dict:
    """Median wall time of fn() over repetitions (at least min_reps and min_seconds in all)."""
    for _ in range(warmup):
        fn()
    synchronize(device)
    samples = []
    start = time.perf_counter()
    while len(samples) < max_reps and (len(samples) < min_reps or time.perf_counter() - start < min_seconds):
        t0 = time.perf_counter()
        fn()
        synchronize(device)
        samples.append(time.perf_counter() - t0)
    q = statistics.quantiles(samples, n=4) if len(samples) >= 2 else [samples[0]] * 3
    return {"median_s": statistics.median(samples), "p25_s": q[0], "p75_s": q[2], "reps": len(samples)}


def machine() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    desc = f"{cpu}, {os.cpu_count()} cores, torch {torch.__version__}, {torch.get_num_threads()} threads"
    if torch.cuda.is_available():
        desc += f"; {torch.cuda.get_device_name()}"
    return desc


def saved_tensor_bytes(fn: Callable[[], torch.Tensor], exclude: tuple = ()) -> int:
    """Bytes autograd keeps alive for backward when fn() runs, not counting the tensors in exclude
    (the inputs, which exist anyway). Works on every device, unlike allocator statistics."""
    excluded = {t.untyped_storage().data_ptr() for t in exclude}
    seen = set()
    total = 0

    def pack(t):
        nonlocal total
        ptr = t.untyped_storage().data_ptr()
        if ptr not in excluded and ptr not in seen:
            seen.add(ptr)
            total += t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    del out
    return total


def cuda_peak_bytes(fn: Callable[[], object], device) -> int | None:
    """Peak CUDA memory allocated while fn() runs, above what was allocated before (None off CUDA)."""
    if torch.device(device).type != "cuda":
        return None
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    fn()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - base


def write_results(name: str, rows: list[dict], table_md: str) -> None:
    os.makedirs(RESULTS_DIR, exist_ok=True)
    base = os.path.join(RESULTS_DIR, name)
    meta = {"machine": machine(), "date": time.strftime("%Y-%m-%d %H:%M:%S")}
    with open(base + ".json", "w") as f:
        json.dump({"meta": meta, "rows": rows}, f, indent=1)
    keys = sorted({k for r in rows for k in r})
    with open(base + ".csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=keys)
        w.writeheader()
        w.writerows(rows)
    with open(base + ".md", "w") as f:
        f.write(f"# {name}\n\nMachine: {meta['machine']}. Date: {meta['date']}.\n\n{table_md}\n")


def markdown_table(header: list[str], rows: list[list]) -> str:
    def fmt(v):
        return f"{v:.3g}" if isinstance(v, float) else str(v)

    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(fmt(v) for v in r) + " |" for r in rows]
    return "\n".join(lines)
