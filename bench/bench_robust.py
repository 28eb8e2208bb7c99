"""The exact robust objective Psi = min_eta L(eta): dro_ext.robust_objective against the two ways it is
computed today, side by side in one run on the same losses.

- ``bisection``: the Python loop fast-dro-style libraries use: per iteration one torch reduction of the
  weights psi*'((l - eta)/lam) and a host-side ``.item()`` convergence test, tolerance 1e-4 on eta;
- ``scipy``: ``scipy.optimize.minimize_scalar(method="bounded")`` (default xatol) on the float64 dual in
  numpy.

Accuracy is |Psi - reference| where the reference is an independent float64 computation: brentq on the
optimality condition mean psi*'((l - eta)/lam) = 1 to xtol 1e-15 in numpy, then L(eta) with math.fsum.

    python -m bench.bench_robust [--quick]
"""
from __future__ import annotations

import argparse
import math

import numpy as np
import torch
from scipy import optimize

import dro_ext
from bench.common import machine, markdown_table, time_fn, write_results
from dro_ext._divergences import check_divergence, psi_star

LAM = 0.1
ALPHA = 0.1
CASES = (("chi2", {}), ("smoothed_cvar", {"alpha": ALPHA}), ("kl_cvar", {"alpha": ALPHA}))


# numpy float64 psi* and psi*' of the benchmarked divergences, written independently of dro_ext.
def np_psi_star(t, name, alpha, order):
    if name == "chi2":
        u = np.maximum(t + 2.0, 0.0)
        return u * u / 4.0 - 1.0 if order == 0 else u / 2.0
    if name == "smoothed_cvar":
        s = t + math.log(alpha / (1.0 - alpha))
        if order == 0:
            return (math.log1p(-alpha) + np.logaddexp(0.0, s)) / alpha
        return 1.0 / (1.0 + np.exp(-s)) / alpha
    if name == "kl_cvar":
        cut = -math.log(alpha)
        if order == 0:
            return np.expm1(np.minimum(t, cut)) + np.maximum(t - cut, 0.0) / alpha
        return np.exp(np.minimum(t, cut))
    raise ValueError(name)


def reference(l64: np.ndarray, name: str, alpha) -> float:
    lo, hi = float(l64.min()), float(l64.max())
    g = lambda eta: float(np.mean(np_psi_star((l64 - eta) / LAM, name, alpha, 1))) - 1.0
    eta = optimize.brentq(g, lo, hi, xtol=1e-15, rtol=4 * np.finfo(float).eps, maxiter=500)
    return LAM * math.fsum(np_psi_star((l64 - eta) / LAM, name, alpha, 0)) / l64.size + eta


def bisection_loop(losses: torch.Tensor, spec, tol: float = 1e-4) -> float:
    """The fast-dro-style loop: a torch reduction and a host-side test per iteration."""
    lo, hi = losses.min().item(), losses.max().item()
    while hi - lo > tol:
        mid = 0.5 * (lo + hi)
        if psi_star((losses - mid) / LAM, spec, 1).mean().item() > 1.0:
            lo = mid
        else:
            hi = mid
    eta = 0.5 * (lo + hi)
    return (LAM * psi_star((losses - eta) / LAM, spec, 0).mean() + eta).item()


def scipy_bounded(l64: np.ndarray, name: str, alpha) -> float:
    f = lambda eta: LAM * float(np.mean(np_psi_star((l64 - eta) / LAM, name, alpha, 0))) + eta
    return float(optimize.minimize_scalar(f, bounds=(float(l64.min()), float(l64.max())), method="bounded").fun)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true", help="N = 2^16 only, fewer repetitions")
    args = parser.parse_args(argv)
    sizes = (1 << 16,) if args.quick else (1 << 16, 1 << 22)
    dtypes = (torch.float32, torch.float64)
    print(machine(), f"backend={dro_ext.backend()}")
    rows, table = [], []
    gen = torch.Generator().manual_seed(0)
    for n in sizes:
        # Lognormal per-sample losses, like cross-entropy losses of a trained classifier.
        base = torch.exp(torch.randn(n, generator=gen, dtype=torch.float64) * 0.75)
        for dtype in dtypes:
            losses = base.to(dtype)
            l64 = losses.double().numpy()
            for name, kw in CASES:
                spec = check_divergence(name, **kw)
                alpha = kw.get("alpha")
                ref = reference(l64, name, alpha)
                big = n > (1 << 20)
                results = {}
                value = float(dro_ext.robust_objective(losses, LAM, name, **kw)[0])
                results["dro_ext"] = (time_fn(lambda: dro_ext.robust_objective(losses, LAM, name, **kw),
                                              min_reps=10 if big else 30, min_seconds=1.0), value)
                value = bisection_loop(losses, spec)
                results["bisection (torch, tol 1e-4)"] = (
                    time_fn(lambda: bisection_loop(losses, spec), warmup=1, min_reps=5 if big else 20,
                            min_seconds=1.0), value)
                value = scipy_bounded(l64, name, alpha)
                results["scipy bounded (numpy f64)"] = (
                    time_fn(lambda: scipy_bounded(l64, name, alpha), warmup=1, min_reps=3 if big else 10,
                            min_seconds=0.5), value)
                ours = results["dro_ext"][0]["median_s"]
                for method, (timing, value) in results.items():
                    err = abs(value - ref)
                    row = {"divergence": name, "n": n, "dtype": str(dtype).replace("torch.", ""), "method": method,
                           "median_ms": 1e3 * timing["median_s"], "p25_ms": 1e3 * timing["p25_s"],
                           "p75_ms": 1e3 * timing["p75_s"], "reps": timing["reps"],
                           "time_vs_dro_ext": timing["median_s"] / ours, "psi": value, "reference": ref,
                           "abs_error": err}
                    rows.append(row)
                    table.append([name, f"2^{int(math.log2(n))}", row["dtype"], method, row["median_ms"],
                                  row["time_vs_dro_ext"], f"{err:.1e}"])
                    print(table[-1], flush=True)
    header = ["divergence", "N", "dtype", "method", "median ms", "time / dro_ext", "abs error"]
    note = (f"lam={LAM}, alpha={ALPHA}, lognormal losses; reference: float64 brentq (xtol 1e-15) + fsum; "
            "the bisection loop and scipy run on the same losses; `time / dro_ext` > 1 means dro_ext is faster.")
    write_results("robust", rows, note + "\n\n" + markdown_table(header, table))


if __name__ == "__main__":
    main()
