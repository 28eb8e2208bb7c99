"""Fused DRO cross-entropy, forward + backward, side by side with its peers, with the peak memory of each.

    python -m bench.bench_cross_entropy [--quick] [--device cpu|cuda] [--rounds 3] [--case logits|linear]

Two cases (float32 on the CPU; bfloat16 and a large language model's head on CUDA):
  - logits:  dro_cross_entropy(logits (N, C), targets, eta) against the eager composition
             F.cross_entropy(reduction="none") + dro_ext.dro_loss, that composition under torch.compile, and plain
             mean cross-entropy (the non-robust cost). Gradients with respect to logits and eta. The composition
             upcasts the logits to float32 first, as Hugging Face transformers' causal-LM loss does; for half logits
             (CUDA) `eager, no upcast` is the same without it.
  - linear:  dro_linear_cross_entropy(hidden (N, H), weight (V, H), targets, eta) against F.linear +
             F.cross_entropy(reduction="none") + dro_loss, that under torch.compile, and F.linear + mean
             cross-entropy. Gradients with respect to hidden, weight and eta. Also `fused grouped`: the same op over
             GROUPS_IN_BATCH groups of sequences (groups=, num_groups=), whose second chunked pass recomputes the
             logits, at the same (default) chunk size.

Times are medians over interleaved rounds (each round times every implementation once, so a slow spell of a shared
machine hits all of them). Peak extra memory is what one forward+backward needs above its inputs, gradients
included: on the CPU the resident-set high-water mark, in a fresh subprocess per case measuring one implementation
after the other, each after a warm-up run of its own (glibc told to return large blocks to the system at once, so
the high-water mark is the real peak and nothing of the one before stays resident: measured, the same to 0.2 MiB
as a process per implementation, for a process start per case instead); on CUDA torch.cuda.max_memory_allocated.
Writes bench/results/cross_entropy.{json,csv,md} (cross_entropy_<card> on CUDA).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

import torch
import torch.nn.functional as F

import dro_ext
from dro_ext.cross_entropy import default_chunk_size
from bench.common import (add_common_arguments, default_min_seconds, device_info, loadavg, markdown_table,
                          output_dir, partial_writer, pooled, result_name, synchronize, time_fn, write_report)

LAM, DIVERGENCE = 0.5, "chi2"
IMPLS = ("fused", "eager", "compiled", "mean_ce")
CASES = {
    # name: (kind, sizes, dtype) per device; --quick shrinks them for a smoke run.
    "cpu": {"logits": dict(n=4096, c=32000, dtype="float32"),
            "linear": dict(n=2048, h=1024, v=32000, dtype="float32")},
    "cuda": {"logits": dict(n=16384, c=128256, dtype="bfloat16"),
             "linear": dict(n=16384, h=4096, v=128256, dtype="bfloat16")},
}
QUICK = {"logits": dict(n=512, c=4096), "linear": dict(n=256, h=128, v=4096)}
# Chunk sizes the linear case also runs on CUDA beside the default one (default_chunk_size: 2048 rows at the target's
# sizes), so that the one GPU run shows where the default stands: each chunk reads and writes the whole weight
# gradient in its addmm, whose arithmetic intensity grows with the chunk.
CUDA_CHUNK_SIZES = (512, 1024, 2048, 4096)
# The grouped rows of the linear case: the batch's rows as sequences of SEQUENCE_LENGTH tokens, sequence s in group
# s % GROUPS_IN_BATCH (a per-token id tensor, as a data loader of domain-tagged sequences gives).
GROUPS_IN_BATCH, SEQUENCE_LENGTH = 4, 256


def eager_logits_loss(logits, targets, eta):
    # The logits upcast to float32 first, as Hugging Face transformers' causal-LM loss does: on CUDA's bfloat16 the
    # composition then holds a float32 copy of the logits and its gradient (twice mean_ce's peak memory).
    return dro_ext.dro_loss(F.cross_entropy(logits.float(), targets, reduction="none"), eta, LAM, DIVERGENCE)


def eager_logits_loss_in_input_dtype(logits, targets, eta):
    # The same without the upcast: the per-token losses in the logits' dtype (half types: float32 inside
    # F.cross_entropy, rounded on the way out), whose sums dro_loss takes in float32.
    return dro_ext.dro_loss(F.cross_entropy(logits, targets, reduction="none"), eta, LAM, DIVERGENCE)


def eager_linear_loss(hidden, weight, targets, eta):
    return eager_logits_loss(F.linear(hidden, weight), targets, eta)


def eager_linear_loss_in_input_dtype(hidden, weight, targets, eta):
    return eager_logits_loss_in_input_dtype(F.linear(hidden, weight), targets, eta)


# The row of the composition without the upcast, for half logits only (float32 logits: the same work as "eager").
EAGER_IN_INPUT_DTYPE = "eager, no upcast"


def make_case(kind, sizes, device, chunk_sizes=()):
    """The inputs and, per implementation, a function running one forward + backward. For the linear case,
    `fused chunk=C` runs the fused op at chunk_size C beside its default (`fused`), for each C in chunk_sizes."""
    # The inputs are drawn where they live, in their dtype: at the CUDA sizes a host draw of 2 billion float32
    # normals and their copy would take seconds of a short GPU lease (the CPU inputs are what they were).
    g = torch.Generator(device=device).manual_seed(0)
    dtype = getattr(torch, sizes["dtype"])
    draw = dict(generator=g, device=device, dtype=dtype)
    eta = torch.tensor(float(torch.log(torch.tensor(float(sizes.get("c", sizes.get("v")))))), device=device,
                       requires_grad=True)
    if kind == "logits":
        n, c = sizes["n"], sizes["c"]
        logits = torch.randn(n, c, **draw).requires_grad_()
        targets = torch.randint(0, c, (n,), generator=g, device=device)
        inputs = (logits, targets, eta)
        wrt = (logits, eta)
        fns = {
            "fused": lambda x, y, e: dro_ext.dro_cross_entropy(x, y, e, LAM, DIVERGENCE),
            "eager": eager_logits_loss,
            "compiled": torch.compile(eager_logits_loss, fullgraph=True),
            "mean_ce": lambda x, y, e: F.cross_entropy(x, y),
        }
        if dtype in (torch.float16, torch.bfloat16):
            fns[EAGER_IN_INPUT_DTYPE] = eager_logits_loss_in_input_dtype
    else:
        n, h, v = sizes["n"], sizes["h"], sizes["v"]
        hidden = (torch.randn(n, h, **draw) / h**0.5).requires_grad_()
        weight = torch.randn(v, h, **draw).requires_grad_()
        targets = torch.randint(0, v, (n,), generator=g, device=device)
        inputs = (hidden, weight, targets, eta)
        wrt = (hidden, weight, eta)
        fns = {
            "fused": lambda x, w, y, e: dro_ext.dro_linear_cross_entropy(x, w, y, e, LAM, DIVERGENCE),
            "eager": eager_linear_loss,
            "compiled": torch.compile(eager_linear_loss, fullgraph=True),
            "mean_ce": lambda x, w, y, e: F.cross_entropy(F.linear(x, w), y),
        }
        if dtype in (torch.float16, torch.bfloat16):
            fns[EAGER_IN_INPUT_DTYPE] = eager_linear_loss_in_input_dtype
        def fused_at(chunk):
            return lambda x, w, y, e: dro_ext.dro_linear_cross_entropy(x, w, y, e, LAM, DIVERGENCE, chunk_size=chunk)
        default = default_chunk_size(n, h, v, hidden.element_size(), hidden.device.type)
        fns.update({f"fused chunk={c}": fused_at(c) for c in chunk_sizes if c != default})
        groups = (torch.arange(n, device=device) // SEQUENCE_LENGTH) % GROUPS_IN_BATCH

        def grouped_at(chunk):
            return lambda x, w, y, e: dro_ext.dro_linear_cross_entropy(x, w, y, e, LAM, DIVERGENCE, groups=groups,
                                                                       num_groups=GROUPS_IN_BATCH, chunk_size=chunk)
        fns["fused grouped"] = grouped_at(None)

    def runner(impl):
        fn = fns[impl]
        targets_wrt = wrt if impl != "mean_ce" else wrt[:-1]  # plain cross-entropy has no eta

        def run():
            value = fn(*inputs)
            return torch.autograd.grad(value, targets_wrt)
        return run
    return {impl: runner(impl) for impl in fns}


def case_sizes(kind, device, quick):
    sizes = dict(CASES[device.type][kind])
    if quick:
        sizes.update(QUICK[kind])
    return sizes


def describe(kind, sizes):
    dims = f"N={sizes['n']}, C={sizes['c']}" if kind == "logits" else f"N={sizes['n']}, H={sizes['h']}, V={sizes['v']}"
    return f"{dims}, {sizes['dtype']}"


# ---------------------------------------------------------------------------------------------------
# Peak memory
# ---------------------------------------------------------------------------------------------------


def _status_kib(field):
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"no {field} in /proc/self/status")


def probe_cpu_memory(kind, quick, chunk_sizes=()):
    """Runs in a fresh process: {implementation: the peak resident memory of one forward+backward above the resident
    memory just before it}, one implementation after the other, each after a warm-up run of its own."""
    runs = make_case(kind, case_sizes(kind, torch.device("cpu"), quick), "cpu", chunk_sizes)
    peaks = {}
    for impl, run in runs.items():
        out = run()  # warm-up: compiles, loads kernels, builds the thread pool
        del out
        baseline = _status_kib("VmRSS")
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # reset VmHWM to the current resident size
        out = run()
        peaks[impl] = 1024 * (_status_kib("VmHWM") - baseline)
        del out
    return peaks


def cpu_peak_bytes(kind, quick, chunk_sizes=()):
    """{implementation: peak extra bytes} of one case, measured in a process of its own (probe_cpu_memory). What an
    implementation frees goes back to the system at once (glibc's thresholds below), so the one before it leaves
    nothing resident that would hide from its peak."""
    # DRO_EXT_CPU_BUFFER_CACHE=0: a buffer the extension keeps from the warm-up run would be resident before the
    # measured run and hide from its peak.
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="131072", MALLOC_TRIM_THRESHOLD_="131072",
               DRO_EXT_CPU_BUFFER_CACHE="0")
    cmd = [sys.executable, "-m", "bench.bench_cross_entropy", "--probe", kind,
           "--chunk-sizes", *map(str, chunk_sizes)] + (["--quick"] if quick else [])
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    result = subprocess.run(cmd, env=env, cwd=root, capture_output=True, text=True, check=True)
    return json.loads(result.stdout.strip().splitlines()[-1])["peak_extra_bytes"]


def cuda_peak_bytes(run):
    out = run()
    del out
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    out = run()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    del out
    return peak


# ---------------------------------------------------------------------------------------------------
# Timing
# ---------------------------------------------------------------------------------------------------


def bench(device, quick, rounds, min_seconds, kinds=("logits", "linear"), on_case=None, chunk_sizes=()):
    """Each case in kinds; on_case(rows, done, total) after each (bench.common.partial_writer)."""
    rows = []
    for done, kind in enumerate(kinds, 1):
        sizes = case_sizes(kind, device, quick)
        torch._dynamo.reset()
        runs = make_case(kind, sizes, device, chunk_sizes)
        impls = list(runs)
        per_round = {impl: [] for impl in impls}
        for _ in range(rounds):
            for impl in impls:
                per_round[impl].append(time_fn(runs[impl], device, warmup=1, min_reps=1,
                                               min_seconds=min_seconds / rounds))
        if device.type == "cuda":
            peaks = {impl: cuda_peak_bytes(runs[impl]) for impl in impls}
        else:
            del runs  # the probe runs in a fresh process; free this one's inputs first
            peaks = cpu_peak_bytes(kind, quick, chunk_sizes)
        stats = {impl: pooled(per_round[impl]) for impl in impls}
        times = {impl: stats[impl]["median_s"] for impl in impls}
        for impl in impls:
            rows.append({
                "device": str(device), "case": kind, "sizes": describe(kind, sizes), "divergence": DIVERGENCE,
                "impl": impl, "median_ms": 1e3 * times[impl],
                "p25_ms": 1e3 * stats[impl]["p25_s"], "p75_ms": 1e3 * stats[impl]["p75_s"],
                "reps": stats[impl]["reps"],
                "time_vs_fused": times[impl] / times["fused"],
                "peak_extra_MiB": peaks[impl] / 2**20,
                "memory_vs_eager": peaks[impl] / peaks["eager"] if peaks["eager"] else None,
            })
        print(f"{device} {kind} ({describe(kind, sizes)}): " + "  ".join(
            f"{impl}={1e3 * times[impl]:.1f}ms/{peaks[impl] / 2**20:.0f}MiB" for impl in impls), flush=True)
        if on_case:
            on_case(rows, done, len(kinds))
    return rows


def table(rows):
    header = ["device", "case", "sizes", "impl", "median ms", "time / fused", "peak extra MiB", "memory / eager"]
    body = [[r["device"], r["case"], r["sizes"], r["impl"], r["median_ms"], r["time_vs_fused"], r["peak_extra_MiB"],
             r["memory_vs_eager"]] for r in rows]
    return (markdown_table(header, body) + "\n\nForward + backward (gradients to the logits or to hidden and weight, "
            "and to eta), divergence chi2, lam 0.5. `eager` is F.cross_entropy(reduction=\"none\") + dro_ext.dro_loss "
            "(after F.linear for the linear case) on the logits upcast to float32, as Hugging Face transformers' "
            f"causal-LM loss takes them (`{EAGER_IN_INPUT_DTYPE}`, for half logits: the same in their dtype), "
            "`compiled` that under torch.compile(fullgraph=True), `mean_ce` "
            "plain mean cross-entropy (no DRO, no eta), `fused chunk=C` the fused linear op at chunk_size C (`fused`: "
            f"its default), `fused grouped` the fused linear op over {GROUPS_IN_BATCH} groups of sequences "
            f"(groups=, num_groups=; sequences of {SEQUENCE_LENGTH} rows) at the default chunk size. "
            "`time / fused` is that row's time over the fused op's; "
            "`peak extra` is the memory one forward+backward needs above its inputs, gradients included (CPU: "
            "resident-set high-water mark in a fresh process per case, one implementation after the other; CUDA: "
            "max_memory_allocated).")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common_arguments(parser, quick_help="small sizes, for a smoke run")
    parser.add_argument("--rounds", type=int, default=None, help="default 3 (1 with --quick)")
    parser.add_argument("--min-seconds", type=float, default=None, help="per implementation, over all rounds "
                        "(default 3 s on the CPU, 0.3 s on CUDA; 0.2 with --quick)")
    parser.add_argument("--chunk-sizes", type=int, nargs="*", default=None,
                        help="the linear case also runs the fused op at these chunk sizes (default: "
                        f"{' '.join(map(str, CUDA_CHUNK_SIZES))} on CUDA, none on the CPU or with --quick)")
    parser.add_argument("--probe", metavar="CASE", help=argparse.SUPPRESS)
    parser.add_argument("--name", default=None)
    parser.add_argument("--case", choices=["logits", "linear"], default=None,
                        help="run one case only (its results go to <name>_<case> unless --name is given)")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    if args.chunk_sizes is None:
        args.chunk_sizes = CUDA_CHUNK_SIZES if device.type == "cuda" and not args.quick else ()
    if args.probe:
        print(json.dumps({"peak_extra_bytes": probe_cpu_memory(args.probe, args.quick, args.chunk_sizes)}))
        return
    print(f"dro_ext backend: {dro_ext.backend()}", flush=True)
    load_before = loadavg()
    args.rounds = args.rounds or (1 if args.quick else 3)
    args.min_seconds = default_min_seconds(args, device, quick=0.2, full=3.0)
    kinds = (args.case,) if args.case else ("logits", "linear")
    info = device_info(device)
    name = args.name or result_name("cross_entropy", info)
    if args.case and not args.name:
        name += "_" + args.case
    settings = {"quick": args.quick, "rounds": args.rounds, "chunk_sizes": list(args.chunk_sizes)}
    on_case = partial_writer(args, name, info, table, load_before=load_before, settings=settings)
    rows = bench(device, args.quick, args.rounds, args.min_seconds, kinds, on_case, args.chunk_sizes)
    # Tables only: the memory column is the point of this benchmark and reads best as a table (--no-plot is implied).
    return write_report(output_dir(args), name, rows, table(rows), info, load=(load_before, loadavg()),
                        note=args.note, settings=settings)


if __name__ == "__main__":
    main()
