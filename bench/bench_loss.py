"""Fused DRO loss, forward + backward, side by side with the eager PyTorch composition of the same formula
and that composition under torch.compile.

    python -m bench.bench_loss [--sizes 4096 1048576 16777216] [--divergences chi2 smoothed_cvar] [--device cpu]

Writes bench/results/loss.{json,csv,md}: one row per (device, divergence, N, implementation) with the
median time, the achieved bandwidth over the bytes that must move (read l forward; read l and write
grad_l backward: 12 bytes per float32 sample), that floor over the copy bandwidth measured at the same
size, and the bytes each implementation keeps alive for backward beyond the losses themselves.
"""
from __future__ import annotations

import argparse
import math
import statistics

import torch

import dro_ext
from bench.common import (cuda_peak_bytes, markdown_table, saved_tensor_bytes, time_fn,
                          write_results)

PARAMS = {"chi2": {}, "kl": {}, "cvar": {"alpha": 0.1}, "kl_cvar": {"alpha": 0.1},
          "cressie_read": {"k": 2.0}, "smoothed_cvar": {"alpha": 0.1}}
LAM = 0.5


def eager_psi_star(t, name, alpha=None, k=None):
    """The formula of DESIGN.md as a user would write it in PyTorch (stable smoothed-CVaR form)."""
    if name == "chi2":
        return torch.clamp(t + 2, min=0) ** 2 / 4 - 1
    if name == "kl":
        return torch.exp(t) - 1
    if name == "cvar":
        return torch.clamp(t, min=0) / alpha
    if name == "kl_cvar":
        c = -math.log(alpha)
        return torch.expm1(torch.clamp(t, max=c)) + torch.clamp(t - c, min=0) / alpha
    if name == "cressie_read":
        return (torch.clamp((k - 1) * t + 1, min=0) ** (k / (k - 1)) - 1) / k
    if name == "smoothed_cvar":
        s = t + math.log(alpha / (1 - alpha))
        return (math.log1p(-alpha) + torch.nn.functional.softplus(s)) / alpha
    raise ValueError(name)


def eager_loss(losses, eta, name, params):
    return LAM * eager_psi_star((losses - eta) / LAM, name, **params).mean() + eta


def fused_loss(losses, eta, name, params):
    return dro_ext.dro_loss(losses, eta, LAM, name, **params)


def forward_backward(loss_fn, losses, eta, name, params):
    def run():
        value = loss_fn(losses, eta, name, params)
        return torch.autograd.grad(value, (losses, eta))
    return run


def bench(device, sizes, divergences, min_seconds, rounds):
    rows = []
    for n in sizes:
        # The floor's bandwidth is that of a copy of the losses, timed in the same rounds as the losses.
        copy_src = torch.rand(n, device=device)
        copy_dst = torch.empty_like(copy_src)
        for name in divergences:
            params = PARAMS[name]
            losses = (1 + torch.randn(n, device=device)).requires_grad_()
            eta = torch.tensor(0.5, device=device, requires_grad=True)
            torch._dynamo.reset()
            compiled = torch.compile(eager_loss, fullgraph=True)
            impls = {"fused": fused_loss, "eager": eager_loss, "compiled": compiled}
            runs = {impl: forward_backward(fn, losses, eta, name, params) for impl, fn in impls.items()}
            # Interleaved rounds: each round times every implementation once (median of its repetitions), and
            # the result is the median over rounds, so a slow spell of this shared machine hits all of them.
            timed = dict(runs, copy=lambda: copy_dst.copy_(copy_src))
            per_round = {impl: [] for impl in timed}
            for _ in range(rounds):
                for impl, run in timed.items():
                    per_round[impl].append(time_fn(run, device, min_seconds=min_seconds / rounds,
                                                   min_reps=3 if n >= 1 << 24 else 10))
            bandwidth = 8 * n / statistics.median(r["median_s"] for r in per_round["copy"])
            floor_s = 12 * n / bandwidth  # read l (fwd), read l + write grad_l (bwd)
            results = {}
            for impl, fn in impls.items():
                run = runs[impl]
                t = {key: statistics.median(r[key] for r in per_round[impl]) for key in ("median_s", "p25_s", "p75_s")}
                t["reps"] = sum(r["reps"] for r in per_round[impl])
                # Saved-tensor hooks do not see inside a compiled graph's own saved activations.
                saved = None if impl == "compiled" else saved_tensor_bytes(
                    lambda: fn(losses, eta, name, params), exclude=(losses, eta))
                peak = cuda_peak_bytes(run, device)
                results[impl] = t["median_s"]
                rows.append({
                    "device": str(device), "divergence": name, "n": n, "dtype": "float32", "impl": impl,
                    "median_ms": 1e3 * t["median_s"], "p25_ms": 1e3 * t["p25_s"], "p75_ms": 1e3 * t["p75_s"],
                    "reps": t["reps"], "achieved_GBps": 12 * n / t["median_s"] / 1e9,
                    "copy_bandwidth_GBps": bandwidth / 1e9, "floor_ms": 1e3 * floor_s,
                    "x_floor": t["median_s"] / floor_s, "saved_for_backward_bytes": saved,
                    "cuda_peak_bytes": peak,
                })
            for row in rows[-len(impls):]:
                row["fused_speedup"] = row["median_ms"] / (1e3 * results["fused"])
            print(f"{device} {name:>14} n={n:>9}: " + "  ".join(
                f"{k}={1e3 * v:.3f}ms" for k, v in results.items()) + f"  floor={1e3 * floor_s:.3f}ms", flush=True)
    return rows


def table(rows):
    header = ["device", "divergence", "N", "impl", "median ms", "GB/s", "x floor", "fused speedup",
              "saved bytes"]
    body = [[r["device"], r["divergence"], r["n"], r["impl"], r["median_ms"], r["achieved_GBps"], r["x_floor"],
             r["fused_speedup"], r["saved_for_backward_bytes"]] for r in rows]
    return (markdown_table(header, body) + "\n\n`x floor` is the time over (12 bytes per sample / copy "
            "bandwidth at the same size); `fused speedup` is that row's time over the fused op's time; "
            "`saved bytes` is what autograd keeps for backward beyond the losses and eta (not measurable inside "
            "a compiled graph; on CUDA the JSON also has the peak allocated memory of a forward+backward, "
            "`cuda_peak_bytes`).")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", type=int, nargs="+", default=[4096, 1 << 20, 1 << 24])
    parser.add_argument("--divergences", nargs="+", default=["chi2", "smoothed_cvar", "kl"], choices=list(PARAMS))
    parser.add_argument("--device", nargs="+", default=None, help="default: cpu, plus cuda when available")
    parser.add_argument("--min-seconds", type=float, default=1.5, help="per implementation, over all rounds")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--name", default="loss")
    args = parser.parse_args(argv)
    devices = args.device or (["cpu"] + (["cuda"] if torch.cuda.is_available() else []))
    print(f"dro_ext backend: {dro_ext.backend()}")
    rows = []
    for device in devices:
        rows += bench(torch.device(device), args.sizes, args.divergences, args.min_seconds, args.rounds)
    write_results(args.name, rows, table(rows))


if __name__ == "__main__":
    main()
