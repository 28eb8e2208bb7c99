"""Timing, device description, reporting and console helpers shared by the benchmarks.

Every benchmark writes one row per measurement to <out>/<name>.json and .csv, a markdown table with the
ratios to <out>/<name>.md and a plot to <out>/<name>.png (default out: bench/results). On CUDA the name
carries the card (loss_h100.md). Timings are medians of many repetitions, taken side by side in one
process in interleaved rounds; the floor is the bytes that must move over the bandwidth of a copy of the
same size on the same device, timed in the same rounds as the implementations.

CPU and CUDA share one timing path: :class:`Timer` brackets a call with two events, torch.cuda.Event on
CUDA and :class:`HostEvent` (the same interface on the host clock) on the CPU, so the code that runs on a
GPU is the code the CPU tests exercise.
"""
from __future__ import annotations

import csv
import json
import os
import platform
import re
import statistics
import subprocess
import sys
import time
import warnings
from typing import Callable

import torch

RESULTS_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
# Where a --quick run writes without --out: beside the committed results, not over them (git ignores it).
QUICK_RESULTS_DIR = os.path.join(RESULTS_DIR, "tmp")


def output_dir(args) -> str:
    """The folder a benchmark writes to: --out, else bench/results, or bench/results/tmp for a --quick run."""
    return args.out or (QUICK_RESULTS_DIR if args.quick else RESULTS_DIR)

# The divergences every benchmark covers: cressie_read at the piecewise-linear k = 2 and at a
# non-integer k, the alpha ones at alpha = 0.1.
CASES = (
    ("chi2", {}),
    ("kl", {}),
    ("cvar", {"alpha": 0.1}),
    ("kl_cvar", {"alpha": 0.1}),
    ("cressie_read", {"k": 2.0}),
    ("cressie_read", {"k": 1.5}),
    ("smoothed_cvar", {"alpha": 0.1}),
)


def case_label(name: str, params: dict) -> str:
    """'chi2', 'cvar alpha=0.1', 'cressie_read k=1.5': one string per case, for tables, plots and groups."""
    return " ".join([name] + [f"{key}={value:g}" for key, value in params.items()])


def select_cases(divergences=None) -> list[tuple[str, dict]]:
    """The cases whose divergence name is in divergences (all of them when None)."""
    return [case for case in CASES if divergences is None or case[0] in divergences]


# ---------------------------------------------------------------------------------------------------
# Timing
# ---------------------------------------------------------------------------------------------------

class HostEvent:
    """torch.cuda.Event's timing interface on the host clock (perf_counter): record, synchronize and
    elapsed_time in milliseconds. CPU work is synchronous, so recording the time is all there is."""

    def __init__(self, enable_timing: bool = True):
        self._time = None

    def record(self, stream=None) -> None:
        self._time = time.perf_counter()

    def synchronize(self) -> None:
        pass

    def elapsed_time(self, end: "HostEvent") -> float:
        if self._time is None or end._time is None:
            raise RuntimeError("HostEvent.elapsed_time: both events must be recorded first")
        return (end._time - self._time) * 1e3


class Timer:
    """Times one call of a function on a device: events recorded around it, then the end event waited
    for. On CUDA that is the kernels' time on the stream (plus any host gap the stream sat idle through,
    as a host-side sync in the function costs), not the launch time."""

    def __init__(self, device: torch.device | str = "cpu"):
        self.device = torch.device(device)
        if self.device.type == "cuda":
            self._event = lambda: torch.cuda.Event(enable_timing=True)
        elif self.device.type == "cpu":
            self._event = HostEvent
        else:
            raise ValueError(f"bench: device must be cpu or cuda, got {device!r}")

    def synchronize(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def once(self, fn: Callable[[], object]) -> float:
        """Seconds one fn() takes. The device is idle before (synchronized) and after (end event)."""
        start, end = self._event(), self._event()
        start.record()
        fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1e3


def quartiles(samples: list[float]) -> tuple[float, float]:
    """(p25, p75) within the samples (the inclusive method: the default one extrapolates past them, as far as 1.5x
    the range of two samples beyond each end)."""
    if len(samples) < 2:
        return samples[0], samples[0]
    q = statistics.quantiles(samples, n=4, method="inclusive")
    return q[0], q[2]


def summarize(samples: list[float]) -> dict:
    p25, p75 = quartiles(samples)
    return {"median_s": statistics.median(samples), "p25_s": p25, "p75_s": p75, "reps": len(samples)}


def pooled(results: list[dict]) -> dict:
    """summarize()'s of several rounds as one: the median of the rounds' medians (a slow spell hits one round) between
    the quartiles of the rounds' medians, which bracket it (one round: its own quartiles), and the repetitions
    counted. (The median over rounds of per-round quartiles showed no spread where a round had one repetition.)"""
    medians = [r["median_s"] for r in results]
    p25, p75 = quartiles(medians) if len(results) > 1 else (results[0]["p25_s"], results[0]["p75_s"])
    return {"median_s": statistics.median(medians), "p25_s": p25, "p75_s": p75,
            "reps": sum(r["reps"] for r in results)}


def time_fn(fn: Callable[[], object], timer: Timer | str | torch.device = "cpu", *, warmup: int = 3,
            min_reps: int = 10, min_seconds: float = 0.5, max_reps: int = 1000) -> dict:
    """Median time of fn() over repetitions (at least min_reps and min_seconds of wall time in all)."""
    timer = timer if isinstance(timer, Timer) else Timer(timer)
    for _ in range(warmup):
        fn()
    timer.synchronize()
    samples = []
    start = time.perf_counter()
    while len(samples) < max_reps and (len(samples) < min_reps or time.perf_counter() - start < min_seconds):
        samples.append(timer.once(fn))
    return summarize(samples)


def interleaved_rounds(timed: dict[str, Callable[[], object]], timer: Timer, *, rounds: int, min_seconds: float,
                       min_reps: int, warmup: int = 3) -> dict[str, dict]:
    """Times every function of `timed` once per round (the median of its repetitions in that round) and
    returns, per function, the median over rounds: a slow spell of a shared machine hits all of them
    alike instead of the one that happened to run then; the quartiles are those of the rounds' medians (pooled()).
    min_seconds is per function over all rounds."""
    per_round = {key: [] for key in timed}
    for round_index in range(rounds):
        for key, fn in timed.items():
            per_round[key].append(time_fn(fn, timer, warmup=warmup if round_index == 0 else min(warmup, 1),
                                          min_reps=min_reps, min_seconds=min_seconds / rounds))
    return {key: pooled(results) for key, results in per_round.items()}


def default_min_seconds(args, device, *, quick: float, full: float) -> float:
    """The timing budget per implementation: --min-seconds if given, else the benchmark's quick or full one.
    On CUDA the full budget is at most 0.3 s: device events time a kernel to within a few percent in a
    fraction of a second, where host timers on a shared CPU need seconds; and a lent GPU's minutes are few
    (scripts/gpu_check.sh runs every benchmark in one lease)."""
    if args.min_seconds:
        return args.min_seconds
    if args.quick:
        return quick
    return min(full, 0.3) if torch.device(device).type == "cuda" else full


def capture_cuda_graph(fn: Callable[[], object], calls: int = 1,
                       on_failure: Callable[[str], object] | None = None) -> Callable[[], object] | None:
    """calls back-to-back fn() captured in one CUDA graph (after three warm-up calls on a side stream, as
    torch.cuda.graphs asks): a zero-argument function that replays them, or None (with the reason on stderr, and
    given to on_failure) where fn cannot be captured. A replay runs the kernels without the host work of launching
    them: its time is the kernels' own, launch gaps included."""
    try:
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(3):
                fn()
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for _ in range(calls):
                fn()
        graph.replay()
        torch.cuda.synchronize()
        return graph.replay
    except Exception as exc:  # noqa: BLE001 - not capturable (a host sync, say): the caller leaves it out
        reason = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
        progress(f"CUDA graph capture failed: {reason}")
        if on_failure is not None:
            on_failure(reason)
        torch.cuda.synchronize()
        return None


GRAPH_SUFFIX = " (graph)"  # a timed function's name with this suffix: the same function replayed from a CUDA graph


def graph_replays(fns: dict[str, Callable[[], object]], names, device) -> dict[str, Callable[[], object]]:
    """On CUDA, {name + GRAPH_SUFFIX: its replay} for each of `names` in fns that a CUDA graph captures
    (capture_cuda_graph); nothing on other devices. Timed beside the per-call functions, a replay gives the
    kernels' own time where the host's work of launching them takes longer (bench.profile_kernels)."""
    if torch.device(device).type != "cuda":
        return {}
    replays = {}
    for name in names:
        replay = capture_cuda_graph(fns[name]) if name in fns else None
        if replay is not None:
            replays[name + GRAPH_SUFFIX] = replay
    return replays


def copy_pair(numel: int, device) -> Callable[[], object]:
    """A copy of numel float32 between two buffers of the device (device to device on CUDA): 8 bytes
    move per element, read and write. Its bandwidth is the floor's."""
    src = torch.rand(numel, device=device)
    dst = torch.empty_like(src)
    return lambda: dst.copy_(src)


# ---------------------------------------------------------------------------------------------------
# Memory
# ---------------------------------------------------------------------------------------------------

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
    """Peak CUDA memory allocated while fn() runs (torch.cuda.max_memory_allocated), above what was
    allocated before; None off CUDA."""
    if torch.device(device).type != "cuda":
        return None
    torch.cuda.synchronize(device)
    base = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    fn()
    torch.cuda.synchronize(device)
    return torch.cuda.max_memory_allocated(device) - base


def cpu_peak_bytes(fn: Callable[[], object]) -> int:
    """Peak of the running sum of CPU allocations and frees while fn() executes (torch.profiler's memory events),
    above where it started: what one call needs beyond its inputs (its outputs freed at the end included)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    # Each op's own net allocation (its children's excluded; a free outside any op is a "[memory]" event), counted
    # when the op starts if it allocated and when it ends if it freed: a temporary that a child op (aten::empty)
    # allocates and its parent frees before returning is counted. Within one op's own code its allocations and
    # frees are netted.
    deltas = sorted((e.time_range.start if e.self_cpu_memory_usage > 0 else e.time_range.end, e.self_cpu_memory_usage)
                    for e in prof.events() if e.self_cpu_memory_usage != 0)
    live = peak = 0
    for _, delta in deltas:
        live += delta
        peak = max(peak, live)
    return peak


def peak_bytes(fn: Callable[[], object], device) -> int:
    """The peak memory fn() allocates above what was held before it, on the CPU or a CUDA device."""
    peak = cuda_peak_bytes(fn, device)
    return cpu_peak_bytes(fn) if peak is None else peak


# The start of the warning torch.cuda.set_sync_debug_mode("warn") gives for every synchronizing CUDA call.
SYNC_WARNING = "called a synchronizing CUDA operation"


def count_host_syncs(fn: Callable[[], object], set_sync_debug_mode: Callable | None = None,
                     get_sync_debug_mode: Callable | None = None) -> int:
    """How many times fn() makes the host wait for the device: the synchronizing calls torch reports in its sync
    debug mode (device-to-host copies such as .item(), stream and device synchronizations), each a warning. The
    mode is put back as it was (a caller's "error" stays), not to the default."""
    set_mode = set_sync_debug_mode or torch.cuda.set_sync_debug_mode
    get_mode = get_sync_debug_mode or torch.cuda.get_sync_debug_mode
    previous = get_mode()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        set_mode("warn")
        try:
            fn()
        finally:
            set_mode(previous)
    return sum(SYNC_WARNING in str(w.message) for w in caught)


# ---------------------------------------------------------------------------------------------------
# What ran where
# ---------------------------------------------------------------------------------------------------

def card_tag(card_name: str) -> str:
    """A short file-name tag for a GPU: 'NVIDIA H100 80GB HBM3' -> 'h100', 'NVIDIA A100-SXM4-80GB' ->
    'a100', 'NVIDIA GeForce RTX 4090' -> 'rtx4090'."""
    words = re.sub(r"\b(NVIDIA|GeForce|Tesla|Quadro|AMD|Radeon)\b", " ", card_name, flags=re.I).split()
    if not words:
        return "gpu"
    tag = re.split(r"[-_]", words[0])[0]
    if tag.lower() in ("rtx", "gtx", "titan", "pro") and len(words) > 1:
        tag += re.split(r"[-_]", words[1])[0]
    return re.sub(r"[^a-z0-9]", "", tag.lower()) or "gpu"


def cuda_driver_version() -> str:
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=20)
        if out.returncode == 0 and out.stdout.strip():
            return out.stdout.strip().splitlines()[0]
    except (OSError, subprocess.SubprocessError):
        pass
    try:
        with open("/proc/driver/nvidia/version") as f:
            match = re.search(r"Kernel Module\s+(\S+)", f.read())
            if match:
                return match.group(1)
    except OSError:
        pass
    return "unknown"


def host_cpu() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return cpu


def device_info(device) -> dict:
    """The machine a benchmark ran on, for result headers and file names."""
    device = torch.device(device)
    info = {"device": device.type, "host_cpu": host_cpu(), "cores": os.cpu_count(),
            "threads": torch.get_num_threads(), "torch": torch.__version__, "python": platform.python_version()}
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        info.update(card=props.name, card_tag=card_tag(props.name), driver=cuda_driver_version(),
                    cuda_runtime=torch.version.cuda, compute_capability=f"{props.major}.{props.minor}",
                    memory_gib=round(props.total_memory / 2**30, 1))
    return info


def describe(info: dict) -> str:
    host = f"{info['host_cpu']}, {info['cores']} cores, {info['threads']} threads"
    if info["device"] == "cuda":
        return (f"{info['card']} (driver {info['driver']}, CUDA runtime {info['cuda_runtime']}, "
                f"sm_{info['compute_capability'].replace('.', '')}, {info['memory_gib']} GiB); host {host}; "
                f"torch {info['torch']}")
    return f"{host}; torch {info['torch']}"


def result_name(base: str, info: dict) -> str:
    """'loss' on the CPU, 'loss_h100' on an H100."""
    return base if info["device"] == "cpu" else f"{base}_{info['card_tag']}"


def loadavg() -> float | None:
    try:
        return os.getloadavg()[0]
    except OSError:
        return None


def synchronize(device: torch.device | str) -> None:
    Timer(device).synchronize()


def machine(device="cpu") -> str:
    """One line naming the machine (kept for benchmarks written against the first version of this module)."""
    return describe(device_info(device))


def write_results(name: str, rows: list[dict], table_md: str, out_dir: str = RESULTS_DIR, device="cpu") -> dict:
    """The first version's signature: <out_dir>/<name>.{json,csv,md} on the described device."""
    return write_report(out_dir, name, rows, table_md, device_info(device), load=(loadavg(), loadavg()))


def write_report(out_dir: str, name: str, rows: list[dict], table_md: str, info: dict, *,
                 load: tuple = (None, None), note: str = "", settings: dict | None = None) -> dict[str, str]:
    """<out_dir>/<name>.json (meta + rows), .csv (rows) and .md (header + table); returns the paths."""
    os.makedirs(out_dir, exist_ok=True)
    base = os.path.join(out_dir, name)
    meta = {"machine": describe(info), "info": info, "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
            "loadavg_1m": list(load), "note": note, "settings": settings or {}}
    with open(base + ".json", "w") as f:
        json.dump({"meta": meta, "rows": rows}, f, indent=1)
    keys = sorted({k for r in rows for k in r})
    with open(base + ".csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=keys)
        w.writeheader()
        w.writerows(rows)
    header = f"# {name}\n\nMachine: {meta['machine']}. Date: {meta['date']}."
    if load[0] is not None and load[1] is not None:
        header += f" 1-minute load average {load[0]:.1f} before, {load[1]:.1f} after, on {info['cores']} cores."
    if settings:
        header += " Settings: " + ", ".join(f"{k}={v}" for k, v in settings.items()) + "."
    if note:
        header += f"\n\n{note}"
    with open(base + ".md", "w") as f:
        f.write(f"{header}\n\n{table_md}\n")
    return {"json": base + ".json", "csv": base + ".csv", "md": base + ".md"}


def partial_writer(args, name: str, info: dict, table_md: Callable[[list[dict]], str], *, load_before,
                   settings: dict) -> Callable[[list[dict], int, int], None]:
    """A benchmark loop's checkpoint, called as write(rows, done, total) after each case: the report of the cases so
    far (no plot), its settings marked partial, so that a run stopped at a time limit (a GPU lease) still leaves the
    cases it finished in its result files. The report at the end of the run overwrites it."""
    def write(rows: list[dict], done: int, total: int) -> None:
        if done < total:
            partial = {**settings, "partial": f"{done} of {total} cases, the run had not ended"}
            write_report(output_dir(args), name, rows, table_md(rows), info, load=(load_before, loadavg()),
                         note=args.note, settings=partial)
    return write


def publish(args, tag: str, name: str, rows: list[dict], header: list[str], table: list[list], info: dict, *,
            load_before, settings: dict, before: str = "", after: str = "", plot: str | None = None,
            plot_title: str = "") -> dict[str, str]:
    """The end of every benchmark: its report (write_report, the markdown table between `before` and `after`),
    its plot (bench.plots.<plot>, unless --no-plot), its console table and a progress line; returns the paths."""
    paths = write_report(output_dir(args), name, rows, before + markdown_table(header, table) + after, info,
                         load=(load_before, loadavg()), note=args.note, settings=settings)
    if plot and not args.no_plot:
        from bench import plots  # matplotlib only when plotting

        title = f"{name}: {info.get('card', info['host_cpu'])}" + (f", {plot_title}" if plot_title else "")
        paths["png"] = getattr(plots, plot)(rows, paths["md"][:-3] + ".png", title=title)
    print(console_table(header, table))
    progress(f"[{tag}] wrote {', '.join(paths.values())}")
    return paths


# ---------------------------------------------------------------------------------------------------
# Tables and progress
# ---------------------------------------------------------------------------------------------------

def fmt(v) -> str:
    if isinstance(v, float):
        return f"{v:.3g}"
    return "-" if v is None else str(v)


def markdown_table(header: list[str], rows: list[list]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(fmt(v) for v in r) + " |" for r in rows]
    return "\n".join(lines)


def console_table(header: list[str], rows: list[list]) -> str:
    """The same table with aligned columns, for a terminal: text left, numbers right."""
    cells = [[fmt(v) for v in r] for r in rows]
    widths = [max([len(h)] + [len(r[i]) for r in cells]) for i, h in enumerate(header)]
    numeric = [all(isinstance(r[i], (int, float)) or r[i] is None for r in rows) for i in range(len(header))]

    def line(values):
        return "  ".join(v.rjust(w) if num else v.ljust(w) for v, w, num in zip(values, widths, numeric)).rstrip()

    return "\n".join([line(header), line(["-" * w for w in widths])] + [line(r) for r in cells])


def progress(message: str) -> None:
    """One line per benchmark case on stderr, so a long run shows where it is (stdout keeps the tables)."""
    print(message, file=sys.stderr, flush=True)


def add_common_arguments(parser, *, quick_help: str) -> None:
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="where to run (default cpu)")
    parser.add_argument("--out", default=None, help="folder for the results (default bench/results; with --quick, "
                        "bench/results/tmp, which git ignores)")
    parser.add_argument("--quick", action="store_true", help=quick_help)
    parser.add_argument("--note", default="", help="free text for the table header (e.g. what else ran)")
    parser.add_argument("--no-plot", action="store_true", help="tables only")


def check_device(device: str) -> torch.device:
    device = torch.device(device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("bench: --device cuda, but torch.cuda.is_available() is False on this machine")
    return device
