"""NormalizedSGD step throughput: the fused native op against foreach implementations of Algorithm 1,
one of them under torch.compile, and torch.optim.SGD(fused=True) (a lower bound: it does no norm).

    python -m bench.bench_optim            # ResNet-18-shaped list (11.7M) and a 100M-param list
    python -m bench.bench_optim --quick    # ResNet-18-shaped list only, 10 rounds

The floor is 24 bytes per float32 parameter (read g, m, p, write m, p, read m again for the norm) over
the copy bandwidth measured on a tensor of the list's size. Peers run interleaved step by step, in
rounds, and each reports the median of its steps.
"""
from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

from bench.common import markdown_table, write_results
from dro_ext import _backend
from dro_ext.optim import NormalizedSGD

LR, BETA, EPS = 0.01, 0.9, 1e-8
BYTES_PER_PARAM = 24


def resnet18_shapes():
    """The 62 parameter shapes of torchvision's resnet18 (11,689,512 parameters)."""
    shapes = [(64, 3, 7, 7), (64,), (64,)]
    in_ch = 64
    for out_ch, stride in ((64, 1), (128, 2), (256, 2), (512, 2)):
        for block in range(2):
            cin = in_ch if block == 0 else out_ch
            shapes += [(out_ch, cin, 3, 3), (out_ch,), (out_ch,), (out_ch, out_ch, 3, 3), (out_ch,), (out_ch,)]
            if block == 0 and (stride != 1 or cin != out_ch):
                shapes += [(out_ch, cin, 1, 1), (out_ch,), (out_ch,)]
        in_ch = out_ch
    return shapes + [(1000, 512), (1000,)]


def gpt_shapes(vocab=20000, d=768, layers=12):
    """A GPT-2-small-shaped list with a 20k vocabulary: about 100M parameters."""
    shapes = [(vocab, d), (1024, d)]
    for _ in range(layers):
        shapes += [(d,), (d,), (3 * d, d), (3 * d,), (d, d), (d,), (d,), (d,), (4 * d, d), (4 * d,), (d, 4 * d), (d,)]
    return shapes + [(d,), (d,)]


def make_list(shapes):
    params = [torch.randn(s) for s in shapes]
    grads = [torch.randn(s) for s in shapes]
    momenta = [torch.randn(s) for s in shapes]
    return params, grads, momenta


# Foreach implementations of Algorithm 1 (steady state, global norm); the fastest is the peer.
def foreach_lerp_tensor(params, grads, momenta):
    """lerp, norm, add with the scale kept a tensor (no host sync; what torch.compile gets)."""
    torch._foreach_lerp_(momenta, grads, 1 - BETA)
    total = torch.linalg.vector_norm(torch.stack(torch._foreach_norm(momenta)))
    torch._foreach_add_(params, torch._foreach_mul(momenta, -LR / (total + EPS)))


def foreach_lerp_item(params, grads, momenta):
    """lerp, norm, add with the scale read on the host: no temporary list (a host sync, free on CPU)."""
    torch._foreach_lerp_(momenta, grads, 1 - BETA)
    total = torch.linalg.vector_norm(torch.stack(torch._foreach_norm(momenta))).item()
    torch._foreach_add_(params, momenta, alpha=-LR / (total + EPS))


def foreach_mul_add_item(params, grads, momenta):
    """mul + add for the momentum instead of lerp, scale on the host."""
    torch._foreach_mul_(momenta, BETA)
    torch._foreach_add_(momenta, grads, alpha=1 - BETA)
    total = torch.linalg.vector_norm(torch.stack(torch._foreach_norm(momenta))).item()
    torch._foreach_add_(params, momenta, alpha=-LR / (total + EPS))


def optimizer_step(opt, grads):
    params = [p for g in opt.param_groups for p in g["params"]]
    for p, g in zip(params, grads):
        p.grad = g
    return opt.step


def bench_size(name, shapes, rounds):
    numel = sum(torch.Size(s).numel() for s in shapes)
    label = f"{name} ({len(shapes)} tensors, {numel / 1e6:.1f}M)"
    params, grads, momenta = make_list(shapes)
    peers = {}
    fused_params = [torch.nn.Parameter(p.clone()) for p in params]
    peers["NormalizedSGD fused"] = optimizer_step(NormalizedSGD(fused_params, lr=LR, momentum=BETA, eps=EPS,
                                                                fused=True), grads)
    fallback_params = [torch.nn.Parameter(p.clone()) for p in params]
    peers["NormalizedSGD foreach (fallback)"] = optimizer_step(
        NormalizedSGD(fallback_params, lr=LR, momentum=BETA, eps=EPS, foreach=True), grads)
    for fn in (foreach_lerp_tensor, foreach_lerp_item, foreach_mul_add_item):
        ps, ms = [p.clone() for p in params], [m.clone() for m in momenta]
        peers[f"foreach {fn.__name__[len('foreach_'):]}"] = (lambda fn, ps, ms: lambda: fn(ps, grads, ms))(fn, ps, ms)
    compiled = torch.compile(foreach_lerp_tensor, fullgraph=True)
    ps_c, ms_c = [p.clone() for p in params], [m.clone() for m in momenta]
    peers["torch.compile(foreach lerp_tensor)"] = lambda: compiled(ps_c, grads, ms_c)
    sgd_params = [torch.nn.Parameter(p.clone()) for p in params]
    peers["torch.optim.SGD(fused=True) (no norm)"] = optimizer_step(
        torch.optim.SGD(sgd_params, lr=LR, momentum=BETA, fused=True), grads)

    # The floor's bandwidth comes from a copy of a tensor of the list's size, timed beside the steps.
    copy_src = torch.rand(numel)
    copy_dst = torch.empty_like(copy_src)
    timed = dict(peers, copy=lambda: copy_dst.copy_(copy_src))
    load_before = os.getloadavg()[0]
    for fn in timed.values():
        fn()
    # Step by step in rounds: every peer runs once per round, so a slow spell of this shared machine lands on
    # all of them alike; each peer's time is the median of its steps.
    samples = {name: [] for name in timed}
    for _ in range(rounds):
        for name, fn in timed.items():
            t0 = time.perf_counter()
            fn()
            samples[name].append(time.perf_counter() - t0)
    bandwidth = 8 * numel / statistics.median(samples.pop("copy"))
    floor_s = BYTES_PER_PARAM * numel / bandwidth
    medians = {name: statistics.median(s) for name, s in samples.items()}
    foreach_names = [n for n in peers if n.startswith("foreach ")]
    best_foreach = min(foreach_names, key=medians.get)
    fused_s = medians["NormalizedSGD fused"]
    rows = []
    for name, t in medians.items():
        rows.append({
            "list": label, "tensors": len(shapes), "params": numel, "peer": name, "median_s": t,
            "steps": len(samples[name]), "gb_per_s": BYTES_PER_PARAM * numel / t / 1e9,
            "fused_speedup": t / fused_s, "over_floor": t / floor_s, "floor_s": floor_s,
            "copy_gb_per_s": bandwidth / 1e9, "best_foreach": name == best_foreach,
            "loadavg_1m": [load_before, os.getloadavg()[0]],
        })
    return rows


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="ResNet-18-shaped list only, 10 rounds")
    parser.add_argument("--threads", type=int, nargs="+", default=[torch.get_num_threads(), 1],
                        help="intra-op thread counts to run at (default: torch's default, then 1)")
    args = parser.parse_args(argv)
    if not _backend.native_available():
        raise SystemExit(f"dro_ext native ops not loaded: {_backend.load_error()}")
    torch.manual_seed(0)
    sizes = [("resnet18", resnet18_shapes(), 10 if args.quick else 80)]
    if not args.quick:
        sizes.append(("gpt-100M", gpt_shapes(), 20))
    rows = []
    default_threads = torch.get_num_threads()
    try:
        for threads in dict.fromkeys(args.threads):
            torch.set_num_threads(threads)
            for label, shapes, rounds in sizes:
                for row in bench_size(label, shapes, rounds):
                    rows.append({"threads": threads, **row})
    finally:  # bench.run runs the next benchmark in this process
        torch.set_num_threads(default_threads)
    table = []
    for r in rows:
        table.append([r["threads"], r["list"], r["peer"] + (" (best foreach)" if r["best_foreach"] else ""),
                      r["median_s"] * 1e3, r["gb_per_s"], r["fused_speedup"], r["over_floor"]])
    bandwidths = ", ".join(f"{r['list']} at {r['threads']} threads: {r['copy_gb_per_s']:.1f} GB/s" for r in rows
                           if r["peer"] == "NormalizedSGD fused")
    loads = ", ".join("{:.1f}-{:.1f}".format(*r["loadavg_1m"]) for r in rows if r["peer"] == "NormalizedSGD fused")
    note = (f"Time per step (ms); GB/s counts {BYTES_PER_PARAM} bytes per parameter; 'x fused' is the peer's "
            f"time over the fused step's; 'x floor' is the time over {BYTES_PER_PARAM} B/param at the measured "
            f"copy bandwidth ({bandwidths}). The copy's bandwidth counts read + write bytes only (the "
            f"cache also reads the destination before writing it) and a copy keeps fewer streams in flight than "
            f"a step, so a step can beat this floor (x floor < 1). The machine is shared: 1-minute load "
            f"average during each list (before, after): {loads} on {os.cpu_count()} cores.")
    md = markdown_table(["threads", "list", "peer", "ms/step", "GB/s", "x fused", "x floor"], table) + "\n\n" + note
    write_results("optim", rows, md)
    print(md)


if __name__ == "__main__":
    main()
