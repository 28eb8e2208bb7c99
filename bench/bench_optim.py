"""NormalizedSGD step throughput: the fused native op against foreach implementations of Algorithm 1,
one of them under torch.compile, and torch.optim.SGD (fused=True and foreach=True; a lower bound: SGD
does no norm).

    python -m bench.bench_optim [--device cpu|cuda]   # ResNet-18-shaped list (11.7M) and a 100M-param list
    python -m bench.bench_optim --quick               # ResNet-18-shaped list only, 5 rounds, default threads

The floor is 24 bytes per float32 parameter (read g, m, p, write m, p, read m again for the norm) over
the copy bandwidth measured on a tensor of the list's size on the same device. Peers run interleaved step
by step, in rounds, and each reports the median of its steps. Writes <out>/optim.{json,csv,md,png}
(optim_<card>.* on CUDA).
"""
from __future__ import annotations

import argparse

import torch

from bench.common import (GRAPH_SUFFIX, add_common_arguments, check_device, copy_pair, cuda_peak_bytes,
                          device_info, graph_replays, loadavg, markdown_table, partial_writer, progress, publish,
                          result_name, summarize, Timer)
from dro_ext import _backend
from dro_ext.optim import NormalizedSGD

LR, BETA, EPS = 0.01, 0.9, 1e-8
BYTES_PER_PARAM = 24
FUSED = "NormalizedSGD fused"
SGD_FUSED = "torch.optim.SGD(fused=True) (no norm)"  # strictly less work than a NormalizedSGD step: its floor


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


def make_list(shapes, device="cpu"):
    params = [torch.randn(s, device=device) for s in shapes]
    grads = [torch.randn(s, device=device) for s in shapes]
    momenta = [torch.randn(s, device=device) for s in shapes]
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


PEERS = (FUSED, "NormalizedSGD foreach (fallback)", "foreach lerp_tensor", "foreach lerp_item", "foreach mul_add_item",
         "torch.compile(foreach lerp_tensor)", SGD_FUSED,
         "torch.optim.SGD(foreach=True) (no norm)")
_FOREACH = {f"foreach {fn.__name__[len('foreach_'):]}": fn
            for fn in (foreach_lerp_tensor, foreach_lerp_item, foreach_mul_add_item)}


def make_peer(name, params, grads, momenta):
    """One peer's step as a zero-argument function on its own copy of the list (params, momenta)."""
    if name in _FOREACH:
        fn, ps, ms = _FOREACH[name], [p.clone() for p in params], [m.clone() for m in momenta]
        return lambda: fn(ps, grads, ms)
    if name == "torch.compile(foreach lerp_tensor)":
        compiled = torch.compile(foreach_lerp_tensor, fullgraph=True)
        ps, ms = [p.clone() for p in params], [m.clone() for m in momenta]
        return lambda: compiled(ps, grads, ms)
    copies = [torch.nn.Parameter(p.clone()) for p in params]
    if name == FUSED:
        return optimizer_step(NormalizedSGD(copies, lr=LR, momentum=BETA, eps=EPS, fused=True), grads)
    if name == "NormalizedSGD foreach (fallback)":
        return optimizer_step(NormalizedSGD(copies, lr=LR, momentum=BETA, eps=EPS, foreach=True), grads)
    if name == SGD_FUSED:
        return optimizer_step(torch.optim.SGD(copies, lr=LR, momentum=BETA, fused=True), grads)
    if name == "torch.optim.SGD(foreach=True) (no norm)":
        return optimizer_step(torch.optim.SGD(copies, lr=LR, momentum=BETA, foreach=True), grads)
    raise ValueError(f"unknown peer {name!r}")


def fused_available(device) -> bool:
    return _backend.native_for(torch.device(device).type)


def make_peers(params, grads, momenta, device) -> tuple[dict, list[str]]:
    """Every peer that runs here; notes say which could not and why."""
    peers, notes = {}, []
    for name in PEERS:
        if name == FUSED and not fused_available(device):
            notes.append(f"{FUSED}: no {torch.device(device).type} kernel in this build (skipped)")
            continue
        # A peer that cannot run here (torch.compile without a working compiler for the device, say) is
        # reported and left out rather than ending the benchmark.
        try:
            peers[name] = make_peer(name, params, grads, momenta)
            peers[name]()
        except Exception as exc:  # noqa: BLE001 - any failure of a peer is reported in the table notes
            first_line = str(exc).splitlines()[0] if str(exc) else ""
            notes.append(f"{name}: {type(exc).__name__}: {first_line} (skipped)")
            peers.pop(name, None)
    return peers, notes


def bench_size(name, shapes, rounds, device, timer):
    numel = sum(torch.Size(s).numel() for s in shapes)
    label = f"{name} ({len(shapes)} tensors, {numel / 1e6:.1f}M)"
    params, grads, momenta = make_list(shapes, device)
    peers, notes = make_peers(params, grads, momenta, device)
    # The floor's bandwidth comes from a copy of a tensor of the list's size, timed beside the steps.
    timed = dict(peers, copy=copy_pair(numel, device))
    # On CUDA the fused step, the foreach one that needs no host sync and torch's fused SGD also replay from a CUDA
    # graph: the kernels' own time, without the host's work of launching them, which on the H100 was a third of the
    # fused step's.
    timed.update(graph_replays(peers, (FUSED, "foreach lerp_tensor", SGD_FUSED), device))
    load_before = loadavg()
    for fn in timed.values():
        fn()
    timer.synchronize()
    # Step by step in rounds: every peer runs once per round, so a slow spell of a shared machine lands on
    # all of them alike; each peer's time is the median of its steps.
    samples = {peer: [] for peer in timed}
    for _ in range(rounds):
        for peer, fn in timed.items():
            samples[peer].append(timer.once(fn))
    bandwidth = 8 * numel / summarize(samples.pop("copy"))["median_s"]
    floor_s = BYTES_PER_PARAM * numel / bandwidth
    stats = {peer: summarize(s) for peer, s in samples.items()}
    foreach_names = [n for n in peers if n.startswith("foreach ")]  # per call: the graph rows are not in peers
    best_foreach = min(foreach_names, key=lambda n: stats[n]["median_s"])
    reference = FUSED if FUSED in stats else best_foreach
    rows = []
    for peer, t in stats.items():
        graph = peer.endswith(GRAPH_SUFFIX)
        # A replay against the fused step's replay only (no ratio where that capture failed: see bench_loss).
        base = (FUSED + GRAPH_SUFFIX if FUSED + GRAPH_SUFFIX in stats else None) if graph else reference
        rows.append({
            "device": str(device), "list": label, "tensors": len(shapes), "params": numel, "peer": peer,
            "median_s": t["median_s"], "p25_s": t["p25_s"], "p75_s": t["p75_s"], "steps": t["reps"],
            "gb_per_s": BYTES_PER_PARAM * numel / t["median_s"] / 1e9,
            "fused_speedup": t["median_s"] / stats[base]["median_s"] if base else None,
            "over_floor": t["median_s"] / floor_s,
            "floor_s": floor_s, "copy_gb_per_s": bandwidth / 1e9, "best_foreach": peer == best_foreach,
            "loadavg_1m": [load_before, loadavg()],
            "cuda_peak_bytes": None if graph else cuda_peak_bytes(peers[peer], device),
        })
    return rows, notes


HEADER = ["threads", "list", "peer", "ms/step", "GB/s", "x fused", "x floor"]


def table_rows(rows):
    return [[r["threads"], r["list"], r["peer"] + (" (best foreach)" if r["best_foreach"] else ""),
             r["median_s"] * 1e3, r["gb_per_s"], r["fused_speedup"], r["over_floor"]] for r in rows]


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common_arguments(parser, quick_help="ResNet-18-shaped list only, 5 rounds, default thread count")
    parser.add_argument("--threads", type=int, nargs="+", default=None,
                        help="CPU intra-op thread counts to run at (default: torch's default, then 1)")
    parser.add_argument("--rounds", type=int, default=None, help="steps per peer (default 80 / 20 by list size)")
    parser.add_argument("--name", default="optim")
    args = parser.parse_args(argv)
    device = check_device(args.device)
    if not _backend.native_available():
        raise SystemExit(f"dro_ext native ops not loaded: {_backend.load_error()}")
    torch.manual_seed(0)
    sizes = [("resnet18", resnet18_shapes(), args.rounds or (5 if args.quick else 80))]
    if not args.quick:
        sizes.append(("gpt-100M", gpt_shapes(), args.rounds or 20))
    default_threads = torch.get_num_threads()
    if device.type == "cpu":
        threads_list = args.threads or ([default_threads] if args.quick else [default_threads, 1])
    else:
        threads_list = [default_threads]  # the host threads do not change a GPU step
    info = device_info(device)
    timer = Timer(device)
    load_before = loadavg()
    rows, notes = [], []
    total = len(threads_list) * len(sizes)
    name = result_name(args.name, info)
    settings = {"rounds": [s[2] for s in sizes], "threads": threads_list, "quick": args.quick}
    on_case = partial_writer(args, name, info, lambda rows: markdown_table(HEADER, table_rows(rows)),
                             load_before=load_before, settings=settings)
    try:
        for i, (threads, (label, shapes, rounds)) in enumerate(
                ((t, s) for t in dict.fromkeys(threads_list) for s in sizes), 1):
            torch.set_num_threads(threads)
            size_rows, size_notes = bench_size(label, shapes, rounds, device, timer)
            rows += [{"threads": threads, **row} for row in size_rows]
            notes += [n for n in size_notes if n not in notes]
            progress(f"[optim {i}/{total}] {size_rows[0]['list']}, {threads} threads: " + "  ".join(
                f"{r['peer']} {1e3 * r['median_s']:.2f} ms" for r in size_rows))
            on_case(rows, i, total)
    finally:  # bench.run runs the next benchmark in this process
        torch.set_num_threads(default_threads)
    bandwidths = ", ".join(f"{r['list']} at {r['threads']} threads: {r['copy_gb_per_s']:.1f} GB/s" for r in rows
                           if r["best_foreach"])
    loads = ", ".join("{:.1f}-{:.1f}".format(*r["loadavg_1m"]) for r in rows if r["best_foreach"])
    reference = FUSED if any(r["peer"] == FUSED for r in rows) else "the best foreach"
    note = (f"Time per step (ms); GB/s counts {BYTES_PER_PARAM} bytes per parameter; 'x fused' is the peer's "
            f"time over {reference}'s; 'x floor' is the time over {BYTES_PER_PARAM} B/param at the measured "
            f"copy bandwidth ({bandwidths}). The copy's bandwidth counts read + write bytes only (the "
            f"cache also reads the destination before writing it) and a copy keeps fewer streams in flight than "
            f"a step, so a step can beat this floor (x floor < 1). torch.optim.SGD does no norm: a lower bound. "
            f"1-minute load average during each list (before, after): {loads} on {info['cores']} cores. "
            f"On CUDA a peer named '...{GRAPH_SUFFIX}' is that step replayed from a CUDA graph (the kernels' own time, "
            f"without the host's launching), its 'x fused' over {FUSED}{GRAPH_SUFFIX}'s."
            + "".join(f" {n}." for n in notes))
    return publish(args, "optim", name, rows, HEADER, table_rows(rows), info, load_before=load_before,
                   settings=settings, after="\n\n" + note, plot="plot_optim")


if __name__ == "__main__":
    main()
