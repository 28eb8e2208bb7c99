"""The whole training step (forward, per-sample loss, objective, backward, optimizer step) of plain ERM, of dro_ext
and of what DRO users run today, side by side on the same model and data:

    python -m bench.bench_train [--device cpu|cuda] [--cases resnet18 mlp-large-batch lm-head] [--modes eager ...]
    python -m bench.bench_train --quick      # narrow models, small batches, 2 short rounds: seconds

Cases (the model, the batch and the per-sample loss):
  resnet18         the CIFAR variant of ResNet-18 (3x3 stem, no max-pool), batch 128 of 3x32x32, 10 classes,
                   per-sample cross-entropy (the paper's setting; --quick narrows it)
  mlp-large-batch  a 3-layer MLP regression at batch 2^16, per-sample squared error: the loss is a visible share
  lm-head          a language model's last norm and head, hidden (tokens, H) -> V, per-token cross-entropy
                   (CUDA: 16384 tokens, H=768, V=50257, bfloat16; CPU: 2048 tokens, H=128, V=4096, float32)

Implementations (every optimizer with lr 1e-3, momentum 0.9):
  ERM                                mean loss + torch.optim.SGD: the floor every DRO step is measured against
  DROLoss + NormalizedSGD            dro_ext's chi2 loss (lam 0.1, eta trained with the model) and its optimizer
  DROLoss + SGD                      the same loss with ERM's optimizer: the loss's own cost
  robust_objective + SGD             dro_ext's exact robust objective (the worst case of every batch) as the loss
  fast-dro chi2 + SGD                daniellevy/fast-dro's RobustLoss, penalized chi^2 (the same objective as
                                     dro_ext's chi2 at lam 0.1: its reg is 2 lam in its parametrization)
  fast-dro cvar + SGD                its CVaR at alpha 0.02 (sorts the losses)
  dro_cross_entropy + SGD            (lm-head) dro_ext's cross-entropy fused from the logits
  dro_linear_cross_entropy + SGD     (lm-head) from the hidden states and the head's weight: no logits held
fast-dro runs from a checkout (--fast-dro PATH or FAST_DRO_PATH, as in bench_robust; bench/fast_dro_peer.py); its
rows are left out, with a message, without one. Its forward runs with the losses' device as the default one
(fast_dro_peer.call: it makes tensors with torch.ones(m), on the CPU otherwise).

Modes: `eager`; on CUDA also `graph` (the whole step captured in one CUDA graph and replayed: PyTorch's whole-network
capture, fast-dro excluded since its bisection reads the device every iteration) and `compile` (the objective,
model forward included, under torch.compile; backward and the optimizer step eager).

On the CPU each case runs in a process of its own (`--in-process` keeps them in one, as on CUDA, where a process
start would cost the lease its CUDA context): measured in one process, an earlier case left it slower for the later
ones. Within a case the implementations run side by side, in interleaved rounds.

Recorded per row: the step time (median and quartiles of interleaved rounds; on CUDA each timed call runs several
steps back to back, as a training loop does, and the time is per step), samples or tokens per second, the ratio to
ERM's step in the same mode (and for fast-dro's rows, to dro_ext's exact robust objective's with the same
optimizer: its chi2 is the problem of fast-dro's chi2 row), the bytes autograd saves for backward (every device) and
the peak memory a step allocates (CUDA: the allocator's peak; CPU: torch.profiler's allocation events), and the host
synchronizations in one step (CUDA: counted with torch.cuda.set_sync_debug_mode; not applicable on the CPU). Writes
<out>/train.{json,csv,md,png} (train_<card>.* on CUDA).
"""
from __future__ import annotations

import argparse
import copy
import math
import types
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

import dro_ext
from bench import fast_dro_peer
from bench.common import (add_common_arguments, capture_cuda_graph, check_device, count_host_syncs,
                          default_min_seconds, device_info, interleaved_rounds, loadavg, markdown_table,
                          partial_writer, peak_bytes, progress, publish, result_name, saved_tensor_bytes, Timer)

LAM = 0.1
LR = 1e-3
MOMENTUM = 0.9
CVAR_ALPHA = 0.02
SEED = 0

ERM = "ERM"
DRO_NSGD = "DROLoss + NormalizedSGD"
DRO_SGD = "DROLoss + SGD"
ROBUST = "robust_objective + SGD"
FAST_DRO_CHI2 = "fast-dro chi2 + SGD"
FAST_DRO_CVAR = "fast-dro cvar + SGD"
FUSED_CE = "dro_cross_entropy + SGD"
FUSED_LINEAR_CE = "dro_linear_cross_entropy + SGD"
# dro_ext's rows held to ERM's step time: its per-sample losses (1.05x), the exact objective (1.10x).
SAMPLE_LEVEL = (DRO_NSGD, DRO_SGD, FUSED_CE, FUSED_LINEAR_CE)
EXACT = (ROBUST,)
FAST_DRO = (FAST_DRO_CHI2, FAST_DRO_CVAR)

CASE_NAMES = ("resnet18", "mlp-large-batch", "lm-head")
MODES = ("eager", "graph", "compile")


# ---------------------------------------------------------------------------------------------------
# Models
# ---------------------------------------------------------------------------------------------------

class BasicBlock(nn.Module):
    def __init__(self, cin: int, cout: int, stride: int):
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.shortcut = nn.Sequential()
        if stride != 1 or cin != cout:
            self.shortcut = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x):
        out = F.relu(self.bn1(self.conv1(x)))
        return F.relu(self.bn2(self.conv2(out)) + self.shortcut(x))


class CifarResNet18(nn.Module):
    """ResNet-18 for 32x32 images: a 3x3 stride-1 stem and no max-pool, then torchvision's four stages of two basic
    blocks (width, 2 width, 4 width, 8 width channels; width 64 is the real network)."""

    def __init__(self, num_classes: int = 10, width: int = 64):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, width, 3, 1, 1, bias=False), nn.BatchNorm2d(width), nn.ReLU())
        blocks, cin = [], width
        for stage, stride in enumerate((1, 2, 2, 2)):
            cout = width << stage
            blocks += [BasicBlock(cin, cout, stride), BasicBlock(cout, cout, 1)]
            cin = cout
        self.blocks = nn.Sequential(*blocks)
        self.fc = nn.Linear(cin, num_classes)

    def forward(self, x):
        return self.fc(torch.flatten(F.adaptive_avg_pool2d(self.blocks(self.stem(x)), 1), 1))


class LMHead(nn.Module):
    """A language model's last layer norm and its head (no bias): hidden (tokens, H) -> logits (tokens, V)."""

    def __init__(self, hidden: int, vocab: int):
        super().__init__()
        self.norm = nn.LayerNorm(hidden)
        self.head = nn.Linear(hidden, vocab, bias=False)

    def forward(self, x):
        return self.head(self.norm(x))


# ---------------------------------------------------------------------------------------------------
# Problems: a model, one batch, and its per-sample and mean losses
# ---------------------------------------------------------------------------------------------------

@dataclass
class Problem:
    case: str
    unit: str  # what a step's batch counts: "samples" or "tokens"
    size: str  # the sizes, for the table
    model: nn.Module  # the initial model, copied for each implementation
    batch: tuple  # (inputs, targets) on the device
    per_sample: Callable  # (model, batch) -> the per-sample losses, shape (batch,)
    mean: Callable  # (model, batch) -> ERM's loss, the way a user writes it

    @property
    def batch_size(self) -> int:
        return self.batch[1].shape[0]


def _cross_entropy_each(model, batch):
    x, y = batch
    return F.cross_entropy(model(x), y, reduction="none")


def _cross_entropy_mean(model, batch):
    x, y = batch
    return F.cross_entropy(model(x), y)


def _squared_error_each(model, batch):
    # The same function as ERM's loss with reduction="none" (as the cross-entropy pair is): written as
    # (pred - y).square() it would be three ops and their backward where ERM pays one.
    x, y = batch
    return F.mse_loss(model(x).squeeze(1), y, reduction="none")


def _squared_error_mean(model, batch):
    x, y = batch
    return F.mse_loss(model(x).squeeze(1), y)


# The sizes of each case: the full run's, the CPU's where the GPU's would take minutes a step, and --quick's.
SIZES = {
    "resnet18": {"full": dict(batch=128, width=64), "quick": dict(batch=16, width=8)},
    "mlp-large-batch": {"full": dict(batch=1 << 16, features=16, hidden=64),
                        "quick": dict(batch=1 << 12, features=16, hidden=32)},
    "lm-head": {"cuda": dict(tokens=16384, hidden=768, vocab=50257, dtype=torch.bfloat16),
                "full": dict(tokens=2048, hidden=128, vocab=4096, dtype=torch.float32),
                "quick": dict(tokens=256, hidden=32, vocab=512, dtype=torch.float32)},
}


def case_sizes(case: str, device, quick: bool) -> dict:
    sizes = SIZES[case]
    if quick:
        return sizes["quick"]
    return sizes.get("cuda", sizes["full"]) if torch.device(device).type == "cuda" else sizes["full"]


def make_problem(case: str, device, *, quick: bool = False, dtype: torch.dtype | None = None,
                 sizes: dict | None = None) -> Problem:
    """The case's model (seeded) and batch on `device`; dtype overrides the case's (the tests' float64)."""
    sizes = dict(sizes or case_sizes(case, device, quick))
    dtype = dtype or sizes.pop("dtype", torch.float32)
    sizes.pop("dtype", None)
    gen = torch.Generator().manual_seed(SEED)
    torch.manual_seed(SEED)
    if case == "resnet18":
        model = CifarResNet18(10, sizes["width"])
        x = torch.randn(sizes["batch"], 3, 32, 32, generator=gen)
        y = torch.randint(0, 10, (sizes["batch"],), generator=gen)
        size = f"batch {sizes['batch']}, 3x32x32, width {sizes['width']}"
        unit, per_sample, mean = "samples", _cross_entropy_each, _cross_entropy_mean
    elif case == "mlp-large-batch":
        d, h = sizes["features"], sizes["hidden"]
        model = nn.Sequential(nn.Linear(d, h), nn.ReLU(), nn.Linear(h, h), nn.ReLU(), nn.Linear(h, 1))
        x = torch.randn(sizes["batch"], d, generator=gen)
        y = x[:, :4].sum(1).sin() + 0.1 * torch.randn(sizes["batch"], generator=gen)
        size = f"batch {sizes['batch']}, {d}-{h}-{h}-1"
        unit, per_sample, mean = "samples", _squared_error_each, _squared_error_mean
    elif case == "lm-head":
        model = LMHead(sizes["hidden"], sizes["vocab"])
        x = torch.randn(sizes["tokens"], sizes["hidden"], generator=gen)
        y = torch.randint(0, sizes["vocab"], (sizes["tokens"],), generator=gen)
        size = f"{sizes['tokens']} tokens, H={sizes['hidden']}, V={sizes['vocab']}"
        unit, per_sample, mean = "tokens", _cross_entropy_each, _cross_entropy_mean
    else:
        raise ValueError(f"bench_train: unknown case {case!r}; cases: {', '.join(CASE_NAMES)}")
    model = model.to(device=device, dtype=dtype)
    batch = (x.to(device=device, dtype=dtype), y.to(device=device, dtype=dtype if y.is_floating_point() else None))
    return Problem(case, unit, f"{size}, {str(dtype).removeprefix('torch.')}", model, batch, per_sample, mean)


# ---------------------------------------------------------------------------------------------------
# Implementations: an objective (model, criterion, batch) -> loss, a criterion owning eta, an optimizer
# ---------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Impl:
    name: str
    objective: Callable  # (problem, model, criterion, batch) -> the scalar loss
    criterion: Callable | None = None  # () -> the module owning eta (its parameters are optimized with the model)
    normalized: bool = False  # NormalizedSGD instead of torch.optim.SGD
    capturable: bool = True  # whether a CUDA graph can hold the whole step
    peer: Callable | None = None  # fast-dro: (RobustLoss class) -> its module


def _erm(problem, model, criterion, batch):
    return problem.mean(model, batch)


def _dro_loss(problem, model, criterion, batch):
    return criterion(problem.per_sample(model, batch))


def _robust(problem, model, criterion, batch):
    return dro_ext.robust_objective(problem.per_sample(model, batch), LAM, "chi2")[0]


def _fast_dro(problem, model, criterion, batch):
    return fast_dro_peer.call(criterion, problem.per_sample(model, batch))


def _fused_cross_entropy(problem, model, criterion, batch):
    x, y = batch
    return criterion(model(x), y)


def _fused_linear_cross_entropy(problem, model, criterion, batch):
    x, y = batch
    return criterion(model.norm(x), model.head.weight, y)


def _chi2_criterion():
    return dro_ext.DROLoss("chi2", LAM)


IMPLS = {
    ERM: Impl(ERM, _erm),
    DRO_NSGD: Impl(DRO_NSGD, _dro_loss, _chi2_criterion, normalized=True),
    DRO_SGD: Impl(DRO_SGD, _dro_loss, _chi2_criterion),
    ROBUST: Impl(ROBUST, _robust),
    # fast-dro's penalized chi^2 is (reg/2) mean((m p - 1)^2): dro_ext's chi2 at lam is reg = 2 lam.
    FAST_DRO_CHI2: Impl(FAST_DRO_CHI2, _fast_dro, capturable=False,
                        peer=lambda cls: cls(size=math.inf, reg=2 * LAM, geometry="chi-square")),
    FAST_DRO_CVAR: Impl(FAST_DRO_CVAR, _fast_dro, capturable=False,
                        peer=lambda cls: cls(size=CVAR_ALPHA, reg=0.0, geometry="cvar")),
    FUSED_CE: Impl(FUSED_CE, _fused_cross_entropy, lambda: dro_ext.DROCrossEntropyLoss("chi2", LAM)),
    FUSED_LINEAR_CE: Impl(FUSED_LINEAR_CE, _fused_linear_cross_entropy,
                          lambda: dro_ext.DROLinearCrossEntropyLoss("chi2", LAM)),
}
LM_HEAD_ONLY = (FUSED_CE, FUSED_LINEAR_CE)


def impls_for(case: str, fast_dro_class=None) -> list[Impl]:
    """The implementations run on a case: fast-dro's only with a checkout, the fused cross-entropies on lm-head."""
    return [impl for name, impl in IMPLS.items()
            if (case == "lm-head" or name not in LM_HEAD_ONLY) and (impl.peer is None or fast_dro_class is not None)]


def with_own_code(fn: Callable) -> Callable:
    """fn with a code object of its own. Dynamo keeps its compiled graphs, and counts recompilations against its
    limit (torch._dynamo.config.recompile_limit, 8), per code object: every Run's objective is a closure of the same
    function, so one count would hold every graph compiled since the last reset (prepare's, once per case; the
    lm-head case alone compiles 7), and past the limit a Run would fail under fullgraph=True, or a peer without it
    silently run eager."""
    return types.FunctionType(fn.__code__.replace(), fn.__globals__, fn.__name__, fn.__defaults__, fn.__closure__)


class Run:
    """One implementation's training state on a problem: its copy of the model, its criterion, its optimizer, and
    the step it is timed on."""

    def __init__(self, problem: Problem, impl: Impl, fast_dro_class=None, *, compiled: bool = False):
        self.problem, self.impl = problem, impl
        self.model = copy.deepcopy(problem.model)
        device = problem.batch[0].device
        if impl.peer is not None:
            self.criterion = impl.peer(fast_dro_class)
        elif impl.criterion is not None:
            # eta in the batch's dtype, float32 for half types (as a user keeps a dual variable)
            dtype = problem.batch[0].dtype
            self.criterion = impl.criterion().to(device=device, dtype=dtype if dtype.itemsize >= 4 else torch.float32)
        else:
            self.criterion = None
        params = list(self.model.parameters())
        if self.criterion is not None:
            params += list(self.criterion.parameters())
        self.params = params
        optimizer = dro_ext.NormalizedSGD if impl.normalized else torch.optim.SGD
        self.optimizer = optimizer(params, lr=LR, momentum=MOMENTUM)

        def objective():
            return impl.objective(problem, self.model, self.criterion, problem.batch)

        # fast-dro's bisection is Python control flow on the device's values: graph breaks, not a full graph.
        self.objective = (torch.compile(with_own_code(objective), fullgraph=impl.peer is None) if compiled
                          else objective)

    def step(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)
        self.objective().backward()
        self.optimizer.step()

    def saved_bytes(self) -> int:
        """What autograd keeps for backward in one forward, beyond the parameters and the batch."""
        return saved_tensor_bytes(self.objective, exclude=(*self.params, *self.problem.batch))


# ---------------------------------------------------------------------------------------------------
# The benchmark
# ---------------------------------------------------------------------------------------------------

WARMUP_STEPS = 3  # cudnn's algorithm search, the momentum buffers' first step, torch.compile's compilation


def steps_per_call(device) -> int:
    """Steps in one timed call: on CUDA several back to back, as a training loop runs them (the host launches the
    next step while the device runs this one); on the CPU one (each step is synchronous)."""
    return 5 if torch.device(device).type == "cuda" else 1


def _failure(exc: BaseException) -> str:
    """The exception's first line, and its root cause's: Dynamo wraps what failed in a tracing error whose own message
    ("RuntimeError when making fake tensor call") says nothing about it."""
    def first_line(e: BaseException) -> str:
        return f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
    root = exc
    while root.__cause__ is not None and root.__cause__ is not root:
        root = root.__cause__
    text = first_line(exc) if root is exc else f"{first_line(exc)} (cause: {first_line(root)})"
    return text[:300]


def prepare(problem: Problem, impls: list[Impl], mode: str, fast_dro_class, device) -> tuple[dict, dict, dict]:
    """({impl name: the timed function (one step, or a replay of its graph)}, {impl name: its Run}, {impl name: why it
    is not timed in this mode})."""
    timed, runs, skipped = {}, {}, {}
    if mode == "compile":
        # Each case compiles as in a process of its own (as a user's training run does). Otherwise a peer's helpers,
        # shared by every case, were compiled again for the next case's batch with dynamic shapes, where fast-dro's
        # CVaR failed inside Dynamo ("'NoneType' object has no attribute 'item'") after resnet18's case.
        torch._dynamo.reset()
    for impl in impls:
        if mode == "graph" and not impl.capturable:
            skipped[impl.name] = "not capturable: its bisection reads the device every iteration"
            continue
        try:
            run = Run(problem, impl, fast_dro_class, compiled=mode == "compile")
            for _ in range(WARMUP_STEPS):
                run.step()
            fn = run.step
            if mode == "graph":
                reason = []
                fn = capture_cuda_graph(run.step, on_failure=reason.append)
                if fn is None:
                    skipped[impl.name] = f"capture failed: {reason[0] if reason else 'unknown'}"
                    continue
        except Exception as exc:  # noqa: BLE001 - one implementation failing (a compiler, memory) leaves the rest
            skipped[impl.name] = f"failed: {_failure(exc)}"
            progress(f"[train] {problem.case} {mode} {impl.name}: {skipped[impl.name]}")
            if torch.device(device).type == "cuda":
                torch.cuda.synchronize(device)
            continue
        timed[impl.name], runs[impl.name] = fn, run
    return timed, runs, skipped


def bench_case(problem: Problem, impls: list[Impl], mode: str, device, timer: Timer, *, rounds: int,
               min_seconds: float, min_reps: int, fast_dro_class=None) -> list[dict]:
    timed, runs, skipped = prepare(problem, impls, mode, fast_dro_class, device)
    steps = steps_per_call(device)
    calls = {name: (lambda fn=fn: [fn() for _ in range(steps)]) for name, fn in timed.items()}
    stats = interleaved_rounds(calls, timer, rounds=rounds, min_seconds=min_seconds, min_reps=min_reps,
                               warmup=1) if calls else {}
    cuda = torch.device(device).type == "cuda"
    erm_s = stats[ERM]["median_s"] / steps if ERM in stats else None
    robust_s = stats[ROBUST]["median_s"] / steps if ROBUST in stats else None
    rows = []
    for impl in impls:
        name = impl.name
        row = {"device": str(device), "case": problem.case, "size": problem.size, "mode": mode, "impl": name,
               "unit": problem.unit, "batch": problem.batch_size, "steps_per_call": steps,
               "median_ms": None, "p25_ms": None, "p75_ms": None, "reps": 0, "per_s": None, "x_erm": None,
               "x_dro_ext": None, "saved_MiB": None, "peak_MiB": None, "host_syncs": None,
               "note": skipped.get(name, "")}
        if name in stats:
            t = stats[name]
            median_s = t["median_s"] / steps
            run = runs[name]
            row.update(median_ms=1e3 * median_s, p25_ms=1e3 * t["p25_s"] / steps, p75_ms=1e3 * t["p75_s"] / steps,
                       reps=t["reps"] * steps, per_s=problem.batch_size / median_s,
                       x_erm=median_s / erm_s if erm_s else None)
            # Against dro_ext's exact chi2 step: fast-dro's chi2 row only, the same problem (its CVaR is another).
            if name == FAST_DRO_CHI2 and robust_s:
                row["x_dro_ext"] = median_s / robust_s
            if mode == "eager":  # saved-tensor hooks do not see inside a compiled graph, nor a replay
                row["saved_MiB"] = run.saved_bytes() / 2**20
            if mode != "graph":  # a replay allocates from the pool its capture set aside
                row["peak_MiB"] = peak_bytes(run.step, device) / 2**20
            if cuda:
                row["host_syncs"] = count_host_syncs(timed[name])
        elif name not in skipped:
            row["note"] = "not timed"
        rows.append(row)
    del runs, timed, calls
    if cuda:
        torch.cuda.empty_cache()
    return rows


def bench(device, cases, modes, *, quick: bool, rounds: int, min_seconds: float, fast_dro_class=None,
          on_case=None, isolate_with: list[str] | None = None) -> list[dict]:
    """Every (mode, case); on_case(rows, done, total) after each (bench.common.partial_writer).

    isolate_with (the command-line arguments every case shares): each (mode, case) runs in a process of its own
    (`python -m bench.bench_train ... --rows-json FILE`), its implementations still side by side within it. On the
    CPU an earlier case left the process slower for the later ones: the MLP's DRO rows measured 1.86x ERM's step
    after resnet18 in one process and 1.02-1.05x alone (the memory allocator's state after resnet18's large
    activations, in part; not pinned down further)."""
    timer = Timer(device)
    rows = []
    total = len(cases) * len(modes)
    done = 0
    # Mode by mode, so that a run stopped at a time limit (a GPU lease) has every case's eager rows first.
    for mode in modes:
        for case in cases:
            if isolate_with is not None:
                case_rows = _bench_case_in_a_process(case, mode, isolate_with)
            else:
                problem = make_problem(case, device, quick=quick)
                impls = impls_for(case, fast_dro_class)
                # One step takes seconds on the CPU at full width: there two per round are enough for a median.
                min_reps = 2 if torch.device(device).type == "cpu" and not quick else 3
                case_rows = bench_case(problem, impls, mode, device, timer, rounds=rounds, min_seconds=min_seconds,
                                       min_reps=min_reps, fast_dro_class=fast_dro_class)
            rows += case_rows
            done += 1
            progress(f"[train {done}/{total}] {case} {mode}: " + "  ".join(
                f"{r['impl']} {r['median_ms']:.3g} ms" for r in case_rows if r["median_ms"] is not None))
            if on_case:
                on_case(rows, done, total)
    return rows


def _bench_case_in_a_process(case: str, mode: str, shared_args: list[str]) -> list[dict]:
    """The rows of one (mode, case), measured by a fresh `python -m bench.bench_train` (its stderr passed through)."""
    import json
    import pathlib
    import subprocess
    import sys
    import tempfile

    root = pathlib.Path(__file__).resolve().parent.parent
    with tempfile.TemporaryDirectory() as tmp:
        rows_json = pathlib.Path(tmp) / "rows.json"
        subprocess.run([sys.executable, "-m", "bench.bench_train", *shared_args, "--cases", case, "--modes", mode,
                        "--rows-json", str(rows_json)], cwd=root, check=True)
        return json.loads(rows_json.read_text())


# ---------------------------------------------------------------------------------------------------
# Report
# ---------------------------------------------------------------------------------------------------

def target_of(impl: str) -> float | None:
    """The most a row may take over ERM's step in the same mode: None for the readings (ERM itself, fast-dro)."""
    if impl in SAMPLE_LEVEL:
        return 1.05
    if impl in EXACT:
        return 1.10
    return None


HEADER = ["case", "mode", "impl", "ms/step", "p25", "p75", "per s", "x ERM", "target", "x dro_ext", "saved MiB",
          "peak MiB", "syncs", "note"]


def table_rows(rows, *, quick: bool = False):
    """The table's rows; a --quick run states no verdict on the targets (its sizes and rounds are not the
    measurement's, as bench/targets.py says of it)."""
    out = []
    for r in rows:
        target = target_of(r["impl"])
        verdict = None
        if target is not None and r["x_erm"] is not None:
            verdict = (f"<= {target:g}: not measured (--quick)" if quick
                       else f"<= {target:g}: {'met' if r['x_erm'] <= target else 'MISSED'}")
        out.append([r["case"], r["mode"], r["impl"], r["median_ms"], r["p25_ms"], r["p75_ms"], r["per_s"], r["x_erm"],
                    verdict, r["x_dro_ext"], r["saved_MiB"], r["peak_MiB"], r["host_syncs"], r["note"] or None])
    return out


NOTE = ("The whole step: zero_grad, forward, per-sample loss, objective, backward, optimizer step, on one fixed batch "
        "per case. `x ERM` is the step time over ERM's in the same mode (eager, graph: the step replayed from one CUDA "
        "graph, compile: the objective under torch.compile); `target` is dro_ext's bound on it (1.05 for the "
        "sample-level rows, 1.10 for the exact robust objective; ERM and fast-dro are readings). `x dro_ext` "
        "(fast-dro's chi2 row): the step time over dro_ext's exact robust objective's, with the same optimizer (its "
        "chi2 at lam 0.1 is that row's problem, solved exactly each step as fast-dro's is; fast-dro's CVaR solves "
        "another, and has no such ratio). `saved MiB`: "
        "what autograd keeps for backward beyond the parameters and the batch; `peak MiB`: the most a step allocates "
        "above what was held before it (CUDA: the allocator's peak; CPU: torch.profiler's allocation events); `syncs` "
        "(CUDA): the host synchronizations in one step, from torch.cuda.set_sync_debug_mode (a graph replay makes "
        "none by construction: the eager row's count says whether a step reads the device). Times are medians over "
        "interleaved rounds{steps}.")
STEPS_NOTE = ("; each timed call runs {steps} steps back to back (the host launching ahead of the device) and the time "
              "is per step")


def describe_sizes(case: str, device, quick: bool) -> str:
    return ", ".join(f"{k}={str(v).removeprefix('torch.')}" for k, v in case_sizes(case, device, quick).items())


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common_arguments(parser, quick_help="narrow models and small batches, 2 short rounds, eager only")
    parser.add_argument("--cases", nargs="+", choices=CASE_NAMES, default=list(CASE_NAMES))
    parser.add_argument("--modes", nargs="+", choices=MODES, default=None,
                        help="default: eager on the CPU; eager, graph and compile on CUDA (eager only with --quick)")
    parser.add_argument("--rounds", type=int, default=None, help="default 3 (2 with --quick)")
    parser.add_argument("--min-seconds", type=float, default=None,
                        help="per implementation, over all rounds (default 4 s on the CPU, 0.3 s on CUDA)")
    parser.add_argument("--fast-dro", default=None, metavar="PATH",
                        help="a checkout of daniellevy/fast-dro to run as a peer (default: $FAST_DRO_PATH)")
    parser.add_argument("--name", default="train")
    parser.add_argument("--in-process", action="store_true",
                        help="every case in this process (default on CUDA; on the CPU each case gets its own)")
    parser.add_argument("--rows-json", default=None, help=argparse.SUPPRESS)  # a case's process: its rows, no report
    args = parser.parse_args(argv)
    device = check_device(args.device)
    cuda = device.type == "cuda"
    if cuda:
        torch.backends.cudnn.benchmark = True  # what a user training a convolutional network sets
    modes = args.modes or (["eager", "graph", "compile"] if cuda and not args.quick else ["eager"])
    if not cuda and "graph" in modes:
        parser.error("--modes graph needs --device cuda")
    rounds = args.rounds or (2 if args.quick else 3)
    min_seconds = default_min_seconds(args, device, quick=0.05, full=4.0)
    fast_dro_path = fast_dro_peer.checkout_path(args.fast_dro)
    fast_dro_class = fast_dro_peer.load_robust_loss(fast_dro_path) if fast_dro_path else None
    if fast_dro_class is None:
        progress("[train] no fast-dro checkout (--fast-dro PATH or FAST_DRO_PATH): its rows are left out")
    settings = {"cases": list(args.cases), "modes": list(modes), "rounds": rounds, "min_seconds": min_seconds,
                "quick": args.quick, "backend": dro_ext.backend(), "lam": LAM, "lr": LR, "momentum": MOMENTUM,
                "fast_dro": f"{fast_dro_path} ({fast_dro_peer.commit_of(fast_dro_path)})" if fast_dro_path else None}
    info = device_info(device)
    load_before = loadavg()
    name = result_name(args.name, info)
    sizes = "; ".join(f"{case}: {describe_sizes(case, device, args.quick)}" for case in args.cases)
    steps = steps_per_call(device)
    after = "\n\n" + NOTE.format(steps=STEPS_NOTE.format(steps=steps) if steps > 1 else "") + f"\n\nSizes: {sizes}."
    if args.rows_json:
        import json
        import pathlib

        rows = bench(device, args.cases, modes, quick=args.quick, rounds=rounds, min_seconds=min_seconds,
                     fast_dro_class=fast_dro_class)
        pathlib.Path(args.rows_json).write_text(json.dumps(rows))
        return {}
    isolate = not (cuda or args.in_process) and len(args.cases) * len(modes) > 1
    settings["cases_in"] = "a process each" if isolate else "one process"
    shared = ["--device", args.device, "--rounds", str(rounds), "--min-seconds", repr(min_seconds),
              *(["--quick"] if args.quick else []), *(["--fast-dro", str(fast_dro_path)] if fast_dro_path else [])]
    on_case = partial_writer(args, name, info,
                             lambda rows: markdown_table(HEADER, table_rows(rows, quick=args.quick)) + after,
                             load_before=load_before, settings=settings)
    rows = bench(device, args.cases, modes, quick=args.quick, rounds=rounds, min_seconds=min_seconds,
                 fast_dro_class=fast_dro_class, on_case=on_case, isolate_with=shared if isolate else None)
    return publish(args, "train", name, rows, HEADER, table_rows(rows, quick=args.quick), info, load_before=load_before,
                   settings=settings, after=after, plot="plot_train", plot_title="training step per implementation")


if __name__ == "__main__":
    main()
