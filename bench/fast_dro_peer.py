"""daniellevy/fast-dro's ``RobustLoss`` as a peer of ``robust_objective``, run from a checkout of that repository
(it is not on PyPI, and its code is not copied here): ``--fast-dro PATH`` or ``FAST_DRO_PATH=PATH``.

Its ``robust_losses.py`` is imported as it is. Two of its module-level imports are for its training code, not
for ``RobustLoss``: ``datasets`` (torchvision's ImageNet, and ``collections.Mapping``, gone since Python 3.10),
from which it only takes ``CustomDistributionSampler`` for another class, so a stand-in module provides that
name; ``utils`` is its own, imported for real (numpy, scipy).

The divergences it shares with dro_ext, in its parametrization (``RobustLoss(size, reg, geometry)``):
  cvar(alpha)               size=alpha, reg=0,    geometry="cvar"        (sorts the losses)
  kl_cvar(alpha), lam       size=alpha, reg=lam,  geometry="cvar"        (bisection)
  cressie_read(k=2), lam    size=inf,   reg=lam,  geometry="chi-square"  (penalized chi^2: bisection)
"""
from __future__ import annotations

import importlib
import math
import os
import subprocess
import sys
import types

import torch


def checkout_path(cli_value: str | None) -> str | None:
    return cli_value or os.environ.get("FAST_DRO_PATH") or None


def commit_of(path: str) -> str:
    """The checkout's git commit, or "unknown" (a copy of the files without .git)."""
    try:
        out = subprocess.run(["git", "-C", path, "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                             timeout=10)
        return out.stdout.strip() or "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def _one_openblas_thread() -> None:
    """fast-dro's ``utils`` imports scipy, whose OpenBLAS (beside numpy's) keeps a pool of threads of its own. On a
    machine with few cores that pool contends with torch's OpenMP threads, and every step in the process slows, not
    only the peer's: on 2 cores the CPU training step's per-sample rows (dro_ext's and fast-dro's alike) took 1.8x
    ERM's with the pools at 2 threads and 0.96-1.0x with OpenBLAS at 1. The peers do no BLAS work of their own that
    the benchmarks time (their losses are torch's), so OpenBLAS gets one thread (threadpoolctl, the benchmarks'
    dependency); torch's own threads are left as they are."""
    try:
        from threadpoolctl import threadpool_limits
    except ImportError:
        print("[fast-dro] threadpoolctl is not installed: OpenBLAS keeps its threads, which may slow every torch "
              "step beside it on a machine with few cores (pip install threadpoolctl)", file=sys.stderr)
        return
    threadpool_limits(limits={"openblas": 1})


def load_robust_loss(path: str):
    """The ``RobustLoss`` class of the fast-dro checkout at ``path`` (OpenBLAS then runs one thread: see
    _one_openblas_thread)."""
    if not os.path.isfile(os.path.join(path, "robust_losses.py")):
        raise FileNotFoundError(f"{path} is not a fast-dro checkout: robust_losses.py is missing")
    saved = {name: sys.modules.get(name) for name in ("datasets", "utils", "robust_losses")}
    stand_in = types.ModuleType("datasets")
    stand_in.CustomDistributionSampler = object  # only named by classes the benchmark does not use
    sys.modules["datasets"] = stand_in
    sys.path.insert(0, path)
    try:
        for name in ("utils", "robust_losses"):
            sys.modules.pop(name, None)
        robust_loss = importlib.import_module("robust_losses").RobustLoss
        _one_openblas_thread()
        return robust_loss
    finally:
        sys.path.remove(path)
        for name, module in saved.items():
            if module is None:
                sys.modules.pop(name, None)
            else:
                sys.modules[name] = module


def make_peer(robust_loss_class, name: str, params: dict, lam: float):
    """A module computing the same Psi as robust_objective(losses, lam, name, **params), or None."""
    if name == "cvar":
        return robust_loss_class(size=params["alpha"], reg=0.0, geometry="cvar")
    if name == "kl_cvar":
        return robust_loss_class(size=params["alpha"], reg=lam, geometry="cvar")
    if name == "cressie_read" and params.get("k") == 2.0:
        return robust_loss_class(size=math.inf, reg=lam, geometry="chi-square")
    return None


def call(peer, losses):
    """peer(losses) with the losses' device as the default for the tensors it makes: its chi-square value builds
    torch.ones(m) and its KL-regularized CVaR torch.Tensor([1 / size]) on the default device, so on CUDA losses those
    fail without it (seen in its code; the benchmarks report where it still fails).

    Only where the default device is another: ``with torch.device(...)`` installs a mode that every torch call inside
    passes through, which nearly doubled fast-dro's CPU call at N = 128, where it changes nothing (cvar: 92 against
    53 us, one thread of a 2-vCPU Xeon, side by side). On CUDA losses fast-dro cannot run without it, so its cost is
    in fast-dro's times there.
    """
    if losses.device == torch.get_default_device():
        return peer(losses)
    with torch.device(losses.device):
        return peer(losses)
