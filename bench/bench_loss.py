"""Fused DRO loss, forward + backward, side by side with the eager PyTorch composition of the same formula,
that composition under torch.compile, and ERM's ``losses.mean()`` (the floor any loss pays), for every divergence;
and the same fused loss through ``DROLoss``, the module a training loop calls (the op plus the module's call).

    python -m bench.bench_loss [--sizes 4096 1048576 16777216] [--divergences chi2 kl] [--device cpu|cuda]
    python -m bench.bench_loss --quick        # N = 4096 and 2^16, 2 short rounds: well under a minute

Writes <out>/loss.{json,csv,md,png} (loss_<card>.* on CUDA): one row per (case, N, implementation) with
the median time, the achieved bandwidth over the bytes that must move (read l forward; read l and write
grad_l backward: 12 bytes per float32 sample), that floor over the copy bandwidth measured at the same
size on the same device, the bytes each implementation keeps alive for backward beyond the losses
themselves and, on CUDA, the peak memory a forward + backward allocates.
"""
from __future__ import annotations

import argparse
import math

import torch

import dro_ext
from bench.common import (GRAPH_SUFFIX, add_common_arguments, case_label, CASES, check_device, copy_pair,
                          cuda_peak_bytes, default_min_seconds, device_info, graph_replays, interleaved_rounds,
                          loadavg, markdown_table, partial_writer, progress, publish, result_name,
                          saved_tensor_bytes, select_cases, Timer)

LAM = 0.5
BYTES_PER_SAMPLE = 12  # float32: read l forward, read l + write grad_l backward
IMPLS = ("fused", "module", "eager", "compiled", "mean")
FULL_SIZES = (128, 4096, 1 << 20, 1 << 24)
QUICK_SIZES = (4096, 1 << 16)


def eager_psi_star(t, name, alpha=None, k=None):
    """The formula of docs/design.md section 1.1 as a user would write it in PyTorch (stable smoothed-CVaR form)."""
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


_MODULES: dict[tuple, dro_ext.DROLoss] = {}


def loss_module(name, params, device) -> dro_ext.DROLoss:
    """One DROLoss per (case, device), its eta starting where the other rows' eta is."""
    key = (name, tuple(sorted(params.items())), str(device))
    if key not in _MODULES:
        _MODULES[key] = dro_ext.DROLoss(name, LAM, eta_init=0.5, **params).to(device)
    return _MODULES[key]


def module_loss(losses, eta, name, params):
    """DROLoss(losses): the fused loss with the module's own eta (which takes the gradient instead of ``eta``)."""
    return loss_module(name, params, losses.device)(losses)


def mean_loss(losses, eta, name, params):
    """ERM's loss: the floor any loss over the samples pays (one read forward, one write backward)."""
    return losses.mean()


def differentiated(loss_fn, losses, eta, name, params) -> tuple:
    """What a forward + backward of loss_fn takes gradients of: the mean has no eta, the module its own."""
    if loss_fn is mean_loss:
        return (losses,)
    return (losses, loss_module(name, params, losses.device).eta if loss_fn is module_loss else eta)


def forward_backward(loss_fn, losses, eta, name, params):
    inputs = differentiated(loss_fn, losses, eta, name, params)
    if loss_fn is module_loss:  # the module looked up once, as a training loop holds it: its call alone is timed
        module = loss_module(name, params, losses.device)

        def run_module():
            return torch.autograd.grad(module(losses), inputs)
        return run_module

    def run():
        value = loss_fn(losses, eta, name, params)
        return torch.autograd.grad(value, inputs)
    return run


def make_inputs(n: int, device, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    losses = (1 + torch.randn(n, generator=gen)).to(device).requires_grad_()
    eta = torch.tensor(0.5, device=device, requires_grad=True)
    return losses, eta


def make_impls(dynamic: bool = False) -> dict:
    """The implementations; the compiled one is fresh (dynamo reset), so each (case, N) gets the
    static-shape code a user with a fixed batch size gets (dynamic=True: one graph for every N)."""
    torch._dynamo.reset()
    return {"fused": fused_loss, "module": module_loss, "eager": eager_loss,
            "compiled": torch.compile(eager_loss, fullgraph=True, dynamic=True if dynamic else None),
            "mean": mean_loss}


def floor_copy(n: int, device):
    """A copy that moves the floor's bytes: 1.5 N float32 read and written is 12 bytes per sample."""
    return copy_pair(n * BYTES_PER_SAMPLE // 8, device)


def bench_case(name, params, n, device, timer, impls, *, rounds, min_seconds) -> list[dict]:
    losses, eta = make_inputs(n, device)
    runs = {impl: forward_backward(fn, losses, eta, name, params) for impl, fn in impls.items()}
    try:
        runs["compiled"]()
    except Exception as exc:  # noqa: BLE001 - e.g. no working compiler for the device: report, run the rest
        progress(f"[loss] {case_label(name, params)} N={n}: torch.compile failed ({type(exc).__name__}: "
                 f"{str(exc).splitlines()[0] if str(exc) else ''}); compiled left out")
        impls = {k: v for k, v in impls.items() if k != "compiled"}
        del runs["compiled"]
    copy = copy_pair(n, device)
    timed = dict(runs, copy=copy)
    # On CUDA the fused and eager forward + backward also replay from a CUDA graph: their kernels' own time.
    graphs = graph_replays(runs, ("fused", "eager", "mean"), device)
    timed.update(graphs)
    stats = interleaved_rounds(timed, timer, rounds=rounds, min_seconds=min_seconds,
                               min_reps=3 if n >= 1 << 24 else 10)
    bandwidth = 8 * n / stats["copy"]["median_s"]
    floor_s = BYTES_PER_SAMPLE * n / bandwidth
    fused_s = stats["fused"]["median_s"]
    rows = []
    fused_graph = "fused" + GRAPH_SUFFIX
    for impl in [*impls, *graphs]:
        fn = impls.get(impl)
        t = stats[impl]
        graph = impl in graphs
        # A replay is rated against the fused op's replay only: where that capture failed, the row has no ratio (it
        # fell back to the per-call time, silently, where the replay was all the note said it read).
        base_s = (stats[fused_graph]["median_s"] if fused_graph in stats else None) if graph else fused_s
        # Saved-tensor hooks do not see inside a compiled graph's own saved activations.
        saved = None if impl == "compiled" or graph else saved_tensor_bytes(
            lambda: fn(losses, eta, name, params), exclude=differentiated(fn, losses, eta, name, params))
        rows.append({
            "device": str(device), "case": case_label(name, params), "divergence": name, **params, "n": n,
            "dtype": "float32", "impl": impl, "median_ms": 1e3 * t["median_s"], "p25_ms": 1e3 * t["p25_s"],
            "p75_ms": 1e3 * t["p75_s"], "reps": t["reps"], "ns_per_sample": 1e9 * t["median_s"] / n,
            "achieved_GBps": BYTES_PER_SAMPLE * n / t["median_s"] / 1e9, "copy_bandwidth_GBps": bandwidth / 1e9,
            "floor_ms": 1e3 * floor_s, "x_floor": t["median_s"] / floor_s,
            "fused_speedup": t["median_s"] / base_s if base_s else None,
            "saved_for_backward_bytes": saved,
            "cuda_peak_bytes": None if graph else cuda_peak_bytes(runs[impl], device),
        })
    return rows


def bench(device, sizes, cases, *, rounds, min_seconds, dynamic=False, on_case=None) -> list[dict]:
    """Every (case, N); on_case(rows, done, total) after each (bench.common.partial_writer)."""
    timer = Timer(device)
    rows = []
    total = len(sizes) * len(cases)
    impls = None
    for i, ((name, params), n) in enumerate(((c, n) for c in cases for n in sizes), 1):
        if not dynamic or n == sizes[0]:
            impls = make_impls(dynamic)
        case_rows = bench_case(name, params, n, device, timer, impls, rounds=rounds, min_seconds=min_seconds)
        rows += case_rows
        progress(f"[loss {i}/{total}] {case_label(name, params):>22} N={n:>9}: " + "  ".join(
            f"{r['impl']} {r['median_ms']:.3f} ms" for r in case_rows) + f"  floor {case_rows[0]['floor_ms']:.3f} ms")
        if on_case:
            on_case(rows, i, total)
    return rows


HEADER = ["case", "N", "impl", "median ms", "ns/sample", "GB/s", "x floor", "x fused", "saved bytes"]


def table_rows(rows):
    return [[r["case"], r["n"], r["impl"], r["median_ms"], r["ns_per_sample"], r["achieved_GBps"], r["x_floor"],
             r["fused_speedup"], r["saved_for_backward_bytes"]] for r in rows]


NOTE = ("Forward + backward of the loss at lam = 0.5, float32. `x floor` is the time over (12 bytes per sample / "
        "copy bandwidth at the same size, timed in the same interleaved rounds); `x fused` is that row's time over "
        "the fused op's time; `saved bytes` is what autograd keeps for backward beyond the losses and eta (not "
        "measurable inside a compiled graph; on CUDA the JSON also has the peak allocated memory of a "
        "forward + backward, `cuda_peak_bytes`). `mean` is ERM's losses.mean() forward + backward, the floor any loss "
        "pays (8 bytes per sample). `module` is the fused op called through `DROLoss` (its forward and nn.Module's "
        "call): its `x fused` is what the module adds. On CUDA, `fused (graph)`, `eager (graph)` and `mean (graph)` "
        "are the same forward + backward replayed from a CUDA graph: the kernels' own time, without the host's work "
        "of launching them; their `x fused` is over `fused (graph)`.")


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common_arguments(parser, quick_help="N = 4096 and 2^16, 2 short rounds, one dynamic-shape compile per case")
    parser.add_argument("--sizes", type=int, nargs="+", default=None)
    parser.add_argument("--divergences", nargs="+", default=None, choices=sorted({c[0] for c in CASES}))
    parser.add_argument("--min-seconds", type=float, default=None,
                        help="per implementation, over all rounds (default 1.5 s on the CPU, 0.3 s on CUDA)")
    parser.add_argument("--rounds", type=int, default=None)
    parser.add_argument("--name", default="loss")
    args = parser.parse_args(argv)
    device = check_device(args.device)
    sizes = args.sizes or (QUICK_SIZES if args.quick else FULL_SIZES)
    rounds = args.rounds or (2 if args.quick else 3)
    min_seconds = default_min_seconds(args, device, quick=0.04, full=1.5)
    settings = {"sizes": list(sizes), "rounds": rounds, "min_seconds": min_seconds, "quick": args.quick,
                "compile": "dynamic shapes, one graph per case" if args.quick else "static shapes, per (case, N)",
                "backend": dro_ext.backend()}
    info = device_info(device)
    load_before = loadavg()
    name = result_name(args.name, info)
    after = "\n\n" + NOTE
    on_case = partial_writer(args, name, info, lambda rows: markdown_table(HEADER, table_rows(rows)) + after,
                             load_before=load_before, settings=settings)
    rows = bench(device, sizes, select_cases(args.divergences), rounds=rounds, min_seconds=min_seconds,
                 dynamic=args.quick, on_case=on_case)
    return publish(args, "loss", name, rows, HEADER, table_rows(rows), info, load_before=load_before,
                   settings=settings, after=after, plot="plot_loss")


if __name__ == "__main__":
    main()
