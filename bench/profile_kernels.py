"""Where the time of one call goes on a GPU: the host's wall time per call, the kernels it launches and their
summed device time, and the time per call when the calls replay from a captured CUDA graph (no host in the way).

    python -m bench.profile_kernels [--out DIR] [--only loss,robust,optim] [--calls 20]

The benchmarks (bench.run) time one call at a time from an idle stream, which is what a caller waiting on the
result sees; where the host's launch work is longer than the kernels, that time is the host's. This script
separates the two, so that a bandwidth target can be read off the kernels (`graph ms`, `kernel ms`) and the host
cost off the rest. Rows go to DIR/profile_<card>.json and a table to stdout; nothing here is a test.
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import statistics
import time

import torch

import dro_ext
from bench import bench_loss, bench_optim, bench_robust
from bench.common import CASES, capture_cuda_graph, case_label, copy_pair, device_info

GRAPH_REPS = 20  # calls per captured graph: one replay launch is spread over them


def wall_ms(fn, calls: int) -> float:
    """Median host-observed time of one call, from an idle stream to its end (what bench.run measures)."""
    samples = []
    for _ in range(calls):
        torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        samples.append(1e3 * (time.perf_counter() - start))
    return statistics.median(samples)


def kernels_per_call(fn, calls: int) -> dict:
    """Kernel launches and summed kernel time per call, from the profiler's device events."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile
    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    by_name = collections.defaultdict(lambda: [0, 0.0])
    for event in prof.events():
        if getattr(event, "device_type", None) != DeviceType.CUDA:
            continue
        entry = by_name[event.name[:90]]
        entry[0] += 1
        entry[1] += event.time_range.elapsed_us() / 1e3
    total_ms = sum(v[1] for v in by_name.values()) / calls
    launches = sum(v[0] for v in by_name.values()) / calls
    top = sorted(by_name.items(), key=lambda kv: -kv[1][1])[:6]
    return {"launches": launches, "kernel_ms": total_ms,
            "top": [{"name": k, "per_call": v[0] / calls, "ms_per_call": v[1] / calls} for k, v in top]}


def graph_ms(fn, replays: int) -> float | None:
    """Time per call replayed from a CUDA graph of GRAPH_REPS calls; None when fn cannot be captured."""
    replay = capture_cuda_graph(fn, GRAPH_REPS)
    if replay is None:
        return None
    samples = []
    for _ in range(replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        replay()
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end) / GRAPH_REPS)
    return statistics.median(samples)


def measure(group: str, case: str, n: int, impl: str, fn, floor_bytes: float, copy_gbps: float, calls: int,
            capture: bool = True) -> dict:
    row = {"group": group, "case": case, "n": n, "impl": impl, "wall_ms": wall_ms(fn, calls)}
    row.update(kernels_per_call(fn, calls))
    row["graph_ms"] = graph_ms(fn, calls) if capture else None
    best = row["graph_ms"] if row["graph_ms"] is not None else row["kernel_ms"]
    row["floor_ms"] = floor_bytes / copy_gbps / 1e6
    row["x_floor"] = best / row["floor_ms"]
    row["fraction_of_copy_bw"] = row["floor_ms"] / best
    graph = "none" if row["graph_ms"] is None else f"{row['graph_ms']:.4f} ms"
    print(f"  {group:6s} {case:26s} {n:>9d} {impl:22s} wall {row['wall_ms']:.4f} ms  kernels {row['launches']:.1f} "
          f"= {row['kernel_ms']:.4f} ms  graph {graph}  {row['fraction_of_copy_bw']:.2f} of copy bw", flush=True)
    return row


def copy_bandwidth(numel: int, calls: int) -> float:
    """GB/s of a device-to-device float32 copy of numel elements (read + write), from a captured graph."""
    copy = copy_pair(numel, "cuda")
    ms = graph_ms(copy, calls)
    return 8 * numel / (ms * 1e-3) / 1e9


def profile_loss(calls: int) -> list[dict]:
    rows = []
    for n in (4096, 1 << 24):
        copy_gbps = copy_bandwidth(bench_loss.BYTES_PER_SAMPLE * n // 8, calls)
        for name, params in CASES:
            losses, eta = bench_loss.make_inputs(n, "cuda")
            for impl, loss_fn in (("fused", bench_loss.fused_loss), ("eager", bench_loss.eager_loss)):
                fn = bench_loss.forward_backward(loss_fn, losses, eta, name, params)
                rows.append(measure("loss", case_label(name, params), n, impl, fn,
                                    bench_loss.BYTES_PER_SAMPLE * n, copy_gbps, calls))
    return rows


def profile_robust(calls: int) -> list[dict]:
    rows = []
    n = 1 << 22
    for dtype in (torch.float32, torch.float64):
        copy_gbps = copy_bandwidth(n * dtype.itemsize // 4, calls)
        losses = bench_robust.lognormal_losses(n).to(device="cuda", dtype=dtype)
        for name, params in CASES:
            fn = lambda: dro_ext.robust_objective(losses, bench_robust.LAM, name, **params)  # noqa: E731
            # One read of the losses is the floor's bytes; the multisection reads them once per pass.
            rows.append(measure("robust", f"{case_label(name, params)} {str(dtype)[6:]}", n, "dro_ext", fn,
                                n * dtype.itemsize, copy_gbps, calls))
    return rows


def profile_optim(calls: int) -> list[dict]:
    rows = []
    shapes = bench_optim.gpt_shapes()
    numel = sum(torch.Size(s).numel() for s in shapes)
    copy_gbps = copy_bandwidth(numel * bench_optim.BYTES_PER_PARAM // 8, calls)
    params, grads, momenta = bench_optim.make_list(shapes, "cuda")
    for peer in (bench_optim.FUSED, "foreach lerp_item", "foreach lerp_tensor",
                 "torch.optim.SGD(fused=True) (no norm)"):
        fn = bench_optim.make_peer(peer, params, grads, momenta)
        rows.append(measure("optim", "gpt-100M", numel, peer, fn, bench_optim.BYTES_PER_PARAM * numel, copy_gbps,
                            calls, capture=peer != "foreach lerp_item"))
        del fn
        torch.cuda.empty_cache()
    return rows


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=".")
    parser.add_argument("--only", default="loss,robust,optim")
    parser.add_argument("--calls", type=int, default=20)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("profile_kernels: no CUDA device")
        return 1
    info = device_info("cuda")
    print(f"profile_kernels on {info['card']} (torch {info['torch']})", flush=True)
    rows = []
    groups = {"loss": profile_loss, "robust": profile_robust, "optim": profile_optim}
    for group in args.only.split(","):
        rows += groups[group](args.calls)
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, f"profile_{info['card_tag']}.json"), "w") as f:
            json.dump({"machine": info, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
