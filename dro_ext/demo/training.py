"""The training loop every experiment shares, and the learning-rate search around it.

The loop is plain PyTorch plus two pieces of ``dro_ext``: a :class:`dro_ext.DROLoss` turns the batch's
per-sample losses into the DRO objective (jointly minimized over the model and the loss's ``eta``), and
after every epoch the exact robust objective ``Psi = min over eta of L`` is computed on the whole training
set (paper Section 5.2) by a ``judge`` callable, usually a wrapper of :func:`dro_ext.evaluate`.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from collections.abc import Iterator, Sequence
from typing import Any, Callable, Iterable, Protocol, TypeVar

import torch
from tqdm import tqdm

import dro_ext

# The paper's training settings (Section 5.1 and Appendix E).
MOMENTUM = 0.9
BATCH_SIZE = 128
NSGD_EPS = 0.1  # Appendix E: "epsilon = 0.1 for normalized SGD" (dro_ext's default, 1e-8, is Algorithm 1 exactly)

ModuleT = TypeVar("ModuleT", bound=torch.nn.Module)

# Probe p of seed s draws its nudge directions from seed s * ROUNDING_PROBE_STRIDE + p: distinct for every
# (seed, probe) with probe < the stride.
ROUNDING_PROBE_STRIDE = 1000

OPTIMIZERS = {
    "sgd": "SGD + momentum",
    "nsgd": "Normalized SGD + momentum",
}


def make_optimizer(name: str, params: Iterable[torch.Tensor], lr: float) -> torch.optim.Optimizer:
    """``"sgd"``: the paper's baseline, torch's SGD with momentum 0.9. ``"nsgd"``: Algorithm 1."""
    if name == "sgd":
        return torch.optim.SGD(params, lr=lr, momentum=MOMENTUM)
    if name == "nsgd":
        return dro_ext.NormalizedSGD(params, lr=lr, momentum=MOMENTUM, eps=NSGD_EPS)
    raise ValueError(f"optimizer must be one of {sorted(OPTIMIZERS)}, got {name!r}")


def rounding_nudge(parameters: Iterable[torch.Tensor], seed: int, probe: int) -> None:
    """Rounding probe ``probe`` of a run on ``seed``: move every element of ``parameters`` one floating-point
    step up or down (``torch.nextafter``), each direction drawn from a CPU generator seeded by (seed, probe);
    probe 0 (the run as trained) leaves them as they are.

    Another processor or SIMD build rounds some operation of the first step differently, by about one step;
    a chaotic run amplifies that as it amplifies this, and a contracting one damps both. So a verdict that a
    probe changes is one that another processor's rounding could change (:func:`dro_ext.demo.claims.settle`).
    The data and the batch order stay the seed's.
    """
    if not 0 <= probe < ROUNDING_PROBE_STRIDE:
        raise ValueError(f"probe must be in [0, {ROUNDING_PROBE_STRIDE}), got {probe}")
    if probe == 0:
        return
    directions = torch.Generator().manual_seed(seed * ROUNDING_PROBE_STRIDE + probe)
    with torch.no_grad():
        for parameter in parameters:
            up = torch.randint(0, 2, parameter.shape, generator=directions).bool().to(parameter.device)
            toward = torch.where(up, torch.inf, -torch.inf).to(parameter.dtype)
            parameter.copy_(torch.nextafter(parameter, toward))


def seeded_model(build: Callable[[], ModuleT], seed: int, probe: int, device: str) -> ModuleT:
    """``build()`` initialized from ``torch.manual_seed(seed)``, nudged by :func:`rounding_nudge` ``probe`` on
    the CPU (the same nudge on every device), then moved to ``device``."""
    torch.manual_seed(seed)
    model = build()
    rounding_nudge(model.parameters(), seed, probe)
    return model.to(device)


def shuffled_batches(x: torch.Tensor, y: torch.Tensor, generator: torch.Generator,
                     batch_size: int = BATCH_SIZE) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """One epoch of mini-batches in a random order drawn from ``generator`` (a CPU generator, so the order
    is the same on every device)."""
    order = torch.randperm(len(x), generator=generator).to(x.device)
    for start in range(0, len(x), batch_size):
        index = order[start:start + batch_size]
        yield x[index], y[index]


def fixed_batches(x: torch.Tensor, y: torch.Tensor, batch_size: int = 1024) -> list:
    """The whole set in order, as ``(x, y)`` batches: what :func:`dro_ext.evaluate` iterates over."""
    return [(x[i:i + batch_size], y[i:i + batch_size]) for i in range(0, len(x), batch_size)]


@dataclass
class Run:
    """One training run: its optimizer and learning rate, and the judged objective after every epoch."""

    optimizer: str
    lr: float
    seed: int
    curve: list = field(default_factory=list)  # curve[0] is at initialization, curve[e] after epoch e
    diverged: bool = False
    seconds: float = 0.0
    extra: dict = field(default_factory=dict)  # per-experiment results (e.g. per-class test accuracy)

    @property
    def final(self) -> float:
        return self.curve[-1] if not self.diverged else math.inf

    def speed_score(self) -> float:
        """How fast the run optimized: the mean of log(objective) over the epochs, i.e. the area under the
        curve on the paper's log scale (lower is faster). A run that diverged scores +inf."""
        if self.diverged:
            return math.inf
        return sum(math.log(max(v, 1e-30)) for v in self.curve[1:]) / max(len(self.curve) - 1, 1)


def train(
    model: torch.nn.Module,
    criterion: dro_ext.DROLoss,
    optimizer: torch.optim.Optimizer,
    epoch_batches: Callable[[], Iterable],
    per_sample_loss: Callable[[torch.nn.Module, Any], torch.Tensor],
    judge: Callable[[], float],
    epochs: int,
    run: Run,
    desc: str = "",
) -> Run:
    """Minimize ``criterion(per_sample_loss(model, batch))`` for ``epochs`` epochs; ``judge()`` after each.

    The curve stops early if the judged objective stops being finite (the run diverged).
    """
    start = time.perf_counter()
    run.curve.append(judge())
    bar = tqdm(range(epochs), desc=desc, leave=False, dynamic_ncols=True, mininterval=0.5)
    for _ in bar:
        model.train()
        for batch in epoch_batches():
            loss = criterion(per_sample_loss(model, batch))
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
        value = judge()
        run.curve.append(value)
        bar.set_postfix(objective=f"{value:.4g}", refresh=False)
        if not math.isfinite(value):
            run.diverged = True
            break
    bar.close()
    run.seconds = time.perf_counter() - start
    return run


class RunOne(Protocol):
    """One training run of an experiment: ``run_one(optimizer, lr)`` on the experiment's first seed, or on another."""

    def __call__(self, optimizer_name: str, lr: float, run_seed: int = ..., /) -> Run: ...


def lr_search(run_one: RunOne, optimizer: str, grid: Sequence[float]) -> tuple[Run, list]:
    """Train once per learning rate in ``grid``; the best run is the fastest (lowest :meth:`Run.speed_score`),
    as the paper picks "the one that achieves the fastest optimization speed"."""
    runs = [run_one(optimizer, lr) for lr in grid]
    return min(runs, key=Run.speed_score), runs
