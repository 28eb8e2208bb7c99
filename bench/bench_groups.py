"""Per-group sums (dro_ext.group_sums), forward + backward, side by side with the two compositions Group DRO code
writes: a G x N one-hot matrix times the losses (as kohpangwei/group_DRO's loss does), and index_add_ over zeros
(the scatter composition), at every (N, G); and a whole online Group DRO step (dro_ext.GroupDROLoss: the group means,
the exponentiated-gradient update of q, the loss sum_g q_g m_g, and its backward) against the same step composed on
each of the two compositions.

    python -m bench.bench_groups [--sizes 128 4096 1048576] [--groups 4 64 1024] [--device cpu|cuda]
    python -m bench.bench_groups --quick      # N = 4096 and 2^14, G = 4 and 64, 2 short rounds: seconds

Writes <out>/groups.{json,csv,md,png} (groups_<card>.* on CUDA): one row per (N, G, implementation) with the
median time of a forward (sums and counts) + backward (the gradient of the losses for a fixed upstream gradient
of the sums), taken in interleaved rounds, its ratio to the fastest composition, and the peak extra memory one
forward + backward allocates above its inputs: on CUDA torch.cuda.max_memory_allocated, on the CPU the running sum
of the allocations and frees of PyTorch's CPU allocator recorded by torch.profiler (profile_memory=True), each op's
net allocation at its start (or its net free at its end), so the group_sums op's per-part partials count (they are
ATen tensors its aten::empty children allocate); on CUDA also the host synchronizations of one forward + backward
(torch.cuda.set_sync_debug_mode). The one-hot composition is left out (a row that says so) where its G x N matrix
would pass ONE_HOT_MAX_ELEMENTS.

Each implementation is a function (losses, groups, G) -> tensor whose gradient is taken, in one of two FAMILIES
(the sums, the Group DRO step), each with its fused implementation and its compositions: a row's ratios are to its
own family's. The Group DRO steps keep their q between calls (one state per G and device), as a training run does.
"""
from __future__ import annotations

import argparse
import functools

import torch

import dro_ext
from bench.common import (add_common_arguments, check_device, count_host_syncs, default_min_seconds, device_info,
                          interleaved_rounds, loadavg, markdown_table, partial_writer, peak_bytes, progress, publish,
                          result_name, Timer)

FULL_SIZES = (128, 4096, 1 << 20)
FULL_GROUPS = (4, 64, 1024)
QUICK_SIZES = (4096, 1 << 14)
QUICK_GROUPS = (4, 64)
# A one-hot matrix of more elements than this (1 GiB as float32, with its bool mask beside it) is not built.
ONE_HOT_MAX_ELEMENTS = 1 << 28


def fused(losses, groups, num_groups):
    return dro_ext.group_sums(losses, groups, num_groups)[0]


def one_hot_sums(losses, groups, num_groups):
    """The G x N one-hot composition: the group map times the losses; the counts are its row sums."""
    group_map = (groups == torch.arange(num_groups, device=groups.device).unsqueeze(1)).to(losses.dtype)
    return group_map @ losses, group_map.sum(1)


def index_add_sums(losses, groups, num_groups):
    """The scatter composition: index_add_ of the losses, and of ones for the counts, over zeros."""
    sums = losses.new_zeros(num_groups).index_add(0, groups, losses)
    counts = losses.new_zeros(num_groups).index_add_(0, groups, torch.ones_like(losses))
    return sums, counts


def one_hot(losses, groups, num_groups):
    return one_hot_sums(losses, groups, num_groups)[0]


def index_add(losses, groups, num_groups):
    return index_add_sums(losses, groups, num_groups)[0]


# The online Group DRO step, fused and composed. One q (or module) per (G, device), kept between calls.
STEP_SIZE = 0.01


@functools.lru_cache(maxsize=None)
def _group_dro_module(num_groups, device):
    return dro_ext.GroupDROLoss(num_groups, STEP_SIZE).to(device)


@functools.lru_cache(maxsize=None)
def _composed_q(name, num_groups, device):
    return torch.full((num_groups,), 1.0 / num_groups, device=device)


def group_dro_fused(losses, groups, num_groups):
    return _group_dro_module(num_groups, str(losses.device))(losses, groups)


def _composed_group_dro(name, reduce):
    """The step as Group DRO code writes it on a reduction: group means, q <- q exp(step m) / sum (q detached), the
    loss sum_g q_g m_g."""
    def step(losses, groups, num_groups):
        sums, counts = reduce(losses, groups, num_groups)
        means = sums / counts.clamp_min(1)
        q = _composed_q(name, num_groups, str(losses.device))
        with torch.no_grad():
            q.mul_(torch.exp(STEP_SIZE * means))
            q.div_(q.sum())
        return (q * means).sum()
    return step


def autograd_floor(losses, groups, num_groups):
    """The cheapest forward + backward through the same harness (torch.autograd.grad of one op): what every row pays
    whatever it computes, and what a training step pays once for its whole backward, not once per op."""
    return losses.sum()


FLOOR = "autograd floor"
IMPLS = {FLOOR: autograd_floor, "group_sums": fused, "one-hot matmul": one_hot, "index_add": index_add,
         "GroupDROLoss": group_dro_fused,
         "Group DRO, one-hot": _composed_group_dro("one-hot", one_hot_sums),
         "Group DRO, index_add": _composed_group_dro("index_add", index_add_sums)}
# family (its fused implementation) -> its compositions
FAMILIES = {"group_sums": ("one-hot matmul", "index_add"),
            "GroupDROLoss": ("Group DRO, one-hot", "Group DRO, index_add")}
FUSED = "group_sums"
COMPOSITIONS = FAMILIES[FUSED]
ONE_HOT_IMPLS = ("one-hot matmul", "Group DRO, one-hot")


def family_of(name):
    """The fused implementation of name's family (None for the floor, which belongs to none)."""
    return next((fused_name for fused_name, compositions in FAMILIES.items()
                 if name == fused_name or name in compositions), None)


def forward_backward(fn, losses, groups, num_groups, grad_out):
    def run():
        out = fn(losses, groups, num_groups)
        # The sums get the fixed upstream gradient; a scalar (a loss over the groups) gets 1.
        return torch.autograd.grad(out, losses, grad_out if out.dim() else None)
    return run


def make_inputs(n, num_groups, device, seed=0):
    gen = torch.Generator().manual_seed(seed)
    losses = (1 + torch.randn(n, generator=gen)).to(device).requires_grad_()
    groups = torch.randint(0, num_groups, (n,), generator=gen).to(device)
    grad_out = torch.rand(num_groups, generator=gen).to(device)
    return losses, groups, grad_out


def host_syncs(run, device) -> int | None:
    """The host synchronizations of one call on CUDA (None on the CPU, where every call is synchronous)."""
    return count_host_syncs(run) if torch.device(device).type == "cuda" else None


def bench_case(n, num_groups, device, timer, impls, *, rounds, min_seconds, count_syncs=host_syncs) -> list[dict]:
    losses, groups, grad_out = make_inputs(n, num_groups, device)
    skipped = {}
    for name in ONE_HOT_IMPLS:
        if n * num_groups > ONE_HOT_MAX_ELEMENTS and name in impls:
            skipped[name] = (f"not run: its G x N matrix would take {5 * n * num_groups / 2**30:.1f} GiB "
                             "(float32 and bool)")
    runs = {name: forward_backward(fn, losses, groups, num_groups, grad_out)
            for name, fn in impls.items() if name not in skipped}
    stats = interleaved_rounds(runs, timer, rounds=rounds, min_seconds=min_seconds,
                               min_reps=3 if n >= 1 << 20 else 10)
    best, fused_s = {}, {}
    for family, compositions in FAMILIES.items():
        measured = [c for c in compositions if c in stats]
        best[family] = min(measured, key=lambda c: stats[c]["median_s"]) if measured else None
        fused_s[family] = stats[family]["median_s"] if family in stats else None
    rows = []
    for name in impls:
        family = family_of(name)
        row = {"device": str(device), "case": f"N={n} G={num_groups}", "n": n, "groups": num_groups,
               "dtype": "float32", "ids": "int64", "impl": name}
        if name in skipped:
            rows.append({**row, "skipped": skipped[name]})
            continue
        t = stats[name]
        peak = peak_bytes(runs[name], device)
        row.update({
            "family": family,
            "median_ms": 1e3 * t["median_s"], "p25_ms": 1e3 * t["p25_s"], "p75_ms": 1e3 * t["p75_s"],
            "reps": t["reps"], "ns_per_sample": 1e9 * t["median_s"] / n,
            "peak_extra_bytes": peak, "peak_bytes_per_n_plus_g": peak / (n + num_groups),
            "host_syncs": count_syncs(runs[name], device),
        })
        if family is not None:
            best_name = best[family]
            best_s, floor_s = stats[best_name]["median_s"] if best_name else None, stats.get(FLOOR, {}).get("median_s")
            above_floor = None
            if best_s is not None and floor_s is not None and t["median_s"] > floor_s:
                above_floor = (best_s - floor_s) / (t["median_s"] - floor_s)
            row.update({
                "time_vs_fused": t["median_s"] / fused_s[family] if fused_s[family] else None,
                "best_composition": best_name,
                "speedup_vs_best_composition": best_s / t["median_s"] if best_s is not None else None,
                "speedup_above_floor": above_floor,
            })
        rows.append(row)
    return rows


def bench(device, sizes, group_counts, *, rounds, min_seconds, impls=None, on_case=None) -> list[dict]:
    timer = Timer(device)
    impls = impls or IMPLS
    cases = [(n, g) for n in sizes for g in group_counts]
    rows = []
    for i, (n, num_groups) in enumerate(cases, 1):
        case_rows = bench_case(n, num_groups, device, timer, impls, rounds=rounds, min_seconds=min_seconds)
        rows += case_rows
        progress(f"[groups {i}/{len(cases)}] N={n:>8} G={num_groups:>5}: " + "  ".join(
            f"{r['impl']} {r['median_ms']:.3f} ms" if "median_ms" in r else f"{r['impl']} skipped"
            for r in case_rows))
        if on_case:
            on_case(rows, i, len(cases))
    return rows


HEADER = ["N", "G", "impl", "median ms", "ns/sample", "x fused", "fused speedup", "above the floor", "peak extra KiB",
          "B per (N+G)", "syncs"]


def table_rows(rows):
    out = []
    for r in rows:
        if "skipped" in r:
            out.append([r["n"], r["groups"], r["impl"], r["skipped"], None, None, None, None, None, None, None])
            continue
        fused_row = r["impl"] in FAMILIES
        out.append([r["n"], r["groups"], r["impl"], r["median_ms"], r["ns_per_sample"], r.get("time_vs_fused"),
                    r["speedup_vs_best_composition"] if fused_row else None,
                    r["speedup_above_floor"] if fused_row else None,
                    r["peak_extra_bytes"] / 1024, r["peak_bytes_per_n_plus_g"], r["host_syncs"]])
    return out


NOTE = ("Forward (sums and counts) + backward (the losses' gradient for a fixed upstream gradient of the sums), "
        "float32 losses, int64 ids drawn uniformly from [0, G). The GroupDROLoss rows are a whole online Group DRO "
        f"step (step_size {STEP_SIZE}): the group means, the update of q, the loss sum_g q_g m_g and its backward; "
        "its compositions are the same step on the one-hot matrix and on index_add_. `x fused` is that row's time "
        "over its family's fused implementation (group_sums or GroupDROLoss); `fused speedup` is the family's "
        "fastest composition's time over the fused one's (the target's measure), and `above the floor` the same ratio "
        "of the two times less the `autograd floor` row's (the same harness around losses.sum(): the fixed cost of "
        "one torch.autograd.grad call, which a training step pays once for its whole backward, not once per op). "
        "`peak extra KiB` is the peak "
        "memory one forward + backward allocates above its inputs (CPU: PyTorch's allocator events under "
        "torch.profiler, group_sums' per-part partials included; CUDA: max_memory_allocated); `B per (N+G)` is that "
        "peak over N + G, bounded for an O(N + G) implementation and growing with G for the one-hot matrix. `syncs` "
        "(CUDA): the host synchronizations of one forward + backward, from torch.cuda.set_sync_debug_mode "
        "(group_sums' default validate=True reads one flag; GroupDROLoss runs it with validate=False); on the CPU "
        "not applicable.")


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common_arguments(parser, quick_help="N = 4096 and 2^14, G = 4 and 64, 2 short rounds")
    parser.add_argument("--sizes", type=int, nargs="+", default=None)
    parser.add_argument("--groups", type=int, nargs="+", default=None)
    parser.add_argument("--min-seconds", type=float, default=None,
                        help="per implementation, over all rounds (default 1.0 s on the CPU, 0.3 s on CUDA)")
    parser.add_argument("--rounds", type=int, default=None)
    parser.add_argument("--threads", type=int, default=None,
                        help="torch.set_num_threads for the run (default: torch's own); recorded in the results")
    parser.add_argument("--name", default="groups")
    args = parser.parse_args(argv)
    device = check_device(args.device)
    if args.threads:
        torch.set_num_threads(args.threads)
    sizes = args.sizes or (QUICK_SIZES if args.quick else FULL_SIZES)
    group_counts = args.groups or (QUICK_GROUPS if args.quick else FULL_GROUPS)
    rounds = args.rounds or (2 if args.quick else 3)
    min_seconds = default_min_seconds(args, device, quick=0.03, full=1.0)
    settings = {"sizes": list(sizes), "groups": list(group_counts), "rounds": rounds, "min_seconds": min_seconds,
                "quick": args.quick, "backend": dro_ext.backend()}
    info = device_info(device)
    load_before = loadavg()
    name = result_name(args.name, info)
    after = "\n\n" + NOTE
    on_case = partial_writer(args, name, info, lambda rows: markdown_table(HEADER, table_rows(rows)) + after,
                             load_before=load_before, settings=settings)
    rows = bench(device, sizes, group_counts, rounds=rounds, min_seconds=min_seconds, on_case=on_case)
    return publish(args, "groups", name, rows, HEADER, table_rows(rows), info, load_before=load_before,
                   settings=settings, after=after, plot="plot_groups")


if __name__ == "__main__":
    main()
