"""The exact robust objective Psi = min_eta L(eta): dro_ext.robust_objective against the two ways it is
computed today, side by side in one run on the same losses, for every divergence.

- ``fast-dro``: daniellevy/fast-dro's ``RobustLoss`` with its default tolerance, for the divergences it
  shares (cvar, kl_cvar, cressie_read at k = 2), when a checkout of it is given (``--fast-dro PATH`` or
  ``FAST_DRO_PATH``; it is not on PyPI and not copied here, see bench/fast_dro_peer.py);
- ``bisection``: the Python loop such libraries use, for every divergence: per iteration one torch
  reduction of the weights psi*'((l - eta)/lam) and a host-side ``.item()`` convergence test, tolerance
  1e-4 on eta;
- ``scipy``: ``scipy.optimize.minimize_scalar(method="bounded")`` (default xatol) on the float64 dual in
  numpy, on the host.

Accuracy is |Psi - reference| where the reference is an independent float64 computation in numpy: closed
forms for kl (log-sum-exp) and cvar (the tail mean with the fractional boundary sample), otherwise brentq
on the optimality condition mean psi*'((l - eta)/lam) = 1 to xtol 1e-15, then L(eta) with math.fsum.

    python -m bench.bench_robust [--device cpu|cuda] [--quick] [--fast-dro PATH]

Writes <out>/robust.{json,csv,md,png} (robust_<card>.* on CUDA).
"""
from __future__ import annotations

import argparse
import math

import numpy as np
import torch
from scipy import optimize, special

import dro_ext
from bench.bench_loss import eager_psi_star
from bench import fast_dro_peer
from bench.common import (add_common_arguments, case_label, CASES, check_device, default_min_seconds, device_info,
                          interleaved_rounds, loadavg, markdown_table, partial_writer, progress, publish, result_name,
                          select_cases, Timer)

LAM = 0.1
DTYPES = (torch.float32, torch.float64)
FULL_SIZES = (128, 4096, 1 << 16, 1 << 22)
QUICK_SIZES = (1 << 12,)
METHODS = ("dro_ext", "bisection (torch, tol 1e-4)", "scipy bounded (numpy f64)")
FAST_DRO = "fast-dro RobustLoss"


# ---------------------------------------------------------------------------------------------------
# float64 reference, in numpy, written independently of dro_ext
# ---------------------------------------------------------------------------------------------------

def np_psi_star(t, name, params, order):
    alpha, k = params.get("alpha"), params.get("k")
    if name == "chi2":
        u = np.maximum(t + 2.0, 0.0)
        return u * u / 4.0 - 1.0 if order == 0 else u / 2.0
    if name == "kl":
        return np.expm1(t) if order == 0 else np.exp(t)
    if name == "cvar":
        return np.maximum(t, 0.0) / alpha if order == 0 else (t > 0) / alpha
    if name == "kl_cvar":
        cut = -math.log(alpha)
        if order == 0:
            return np.expm1(np.minimum(t, cut)) + np.maximum(t - cut, 0.0) / alpha
        return np.exp(np.minimum(t, cut))
    if name == "cressie_read":
        u = np.maximum(1.0 + (k - 1.0) * t, 0.0)
        return (u ** (k / (k - 1.0)) - 1.0) / k if order == 0 else u ** (1.0 / (k - 1.0))
    if name == "smoothed_cvar":
        s = t + math.log(alpha / (1.0 - alpha))
        if order == 0:
            return (math.log1p(-alpha) + np.logaddexp(0.0, s)) / alpha
        return special.expit(s) / alpha
    raise ValueError(name)


def exact_root(g, g_guess, lo: float, hi: float) -> float:
    """The root of g in [lo, hi] by brentq to 1e-15, g evaluated only inside a bracket of relative width 1e-9 around
    the root of g_guess (a cheaper approximation of g) when that bracket holds g's root, over [lo, hi] otherwise: a
    few fsum passes over the losses instead of ~50 (seconds a case at 2^22, much of a GPU run's budget here)."""
    tol = dict(rtol=4 * np.finfo(float).eps, maxiter=500)
    guess = optimize.brentq(g_guess, lo, hi, xtol=1e-13, **tol)
    width = 1e-9 * max(1.0, abs(guess))
    try:
        return optimize.brentq(g, max(lo, guess - width), min(hi, guess + width), xtol=1e-15, **tol)
    except ValueError:  # no sign change: g's root lies outside the narrow bracket
        return optimize.brentq(g, lo, hi, xtol=1e-15, **tol)


def reference(l64: np.ndarray, name: str, params: dict) -> float:
    n = l64.size
    if name == "kl":  # mean exp((l - eta)/lam) = 1 and then L(eta) = eta
        return LAM * (float(special.logsumexp(l64 / LAM)) - math.log(n))
    if name == "cvar":  # the mean of the top alpha*n losses, the boundary sample counted fractionally
        tail = params["alpha"] * n
        whole = int(math.floor(tail))
        top = np.sort(l64)[::-1]
        extra = (tail - whole) * top[whole] if whole < n else 0.0
        return (math.fsum(top[:whole]) + extra) / tail
    # eta: the root of the decreasing g(eta) = mean psi*'((l - eta)/lam) - 1, its sum exactly rounded (fsum).
    g = lambda eta: math.fsum(np_psi_star((l64 - eta) / LAM, name, params, 1)) / n - 1.0
    g_pairwise = lambda eta: float(np.sum(np_psi_star((l64 - eta) / LAM, name, params, 1))) / n - 1.0
    eta = exact_root(g, g_pairwise, float(l64.min()), float(l64.max()))
    return LAM * math.fsum(np_psi_star((l64 - eta) / LAM, name, params, 0)) / n + eta


# ---------------------------------------------------------------------------------------------------
# The peers
# ---------------------------------------------------------------------------------------------------

def torch_weight(t, name, params):
    """psi*'(t) in PyTorch, as a DRO library writes it."""
    alpha, k = params.get("alpha"), params.get("k")
    if name == "chi2":
        return torch.clamp(t + 2, min=0) / 2
    if name == "kl":
        return torch.exp(t)
    if name == "cvar":
        return (t > 0).to(t.dtype) / alpha
    if name == "kl_cvar":
        return torch.exp(torch.clamp(t, max=-math.log(alpha)))
    if name == "cressie_read":
        return torch.clamp((k - 1) * t + 1, min=0) ** (1 / (k - 1))
    if name == "smoothed_cvar":
        return torch.sigmoid(t + math.log(alpha / (1 - alpha))) / alpha
    raise ValueError(name)


def bisection_loop(losses: torch.Tensor, name: str, params: dict, tol: float = 1e-4) -> float:
    """A torch reduction and a host-side test per iteration. kl works in log space (logsumexp), as a
    careful library does: exp((l - eta)/lam) overflows float32 at lam = 0.1."""
    n = losses.numel()
    lo, hi = losses.min().item(), losses.max().item()
    while hi - lo > tol:
        mid = 0.5 * (lo + hi)
        t = (losses - mid) / LAM
        if name == "kl":
            too_heavy = (torch.logsumexp(t, 0) - math.log(n)).item() > 0.0
        else:
            too_heavy = torch_weight(t, name, params).mean().item() > 1.0
        if too_heavy:
            lo = mid
        else:
            hi = mid
    eta = 0.5 * (lo + hi)
    t = (losses - eta) / LAM
    if name == "kl":
        return LAM * math.expm1((torch.logsumexp(t, 0) - math.log(n)).item()) + eta
    return (LAM * eager_psi_star(t, name, **params).mean() + eta).item()


def scipy_bounded(l64: np.ndarray, name: str, params: dict) -> float:
    def dual(eta):
        with np.errstate(over="ignore"):
            return LAM * float(np.mean(np_psi_star((l64 - eta) / LAM, name, params, 0))) + eta
    return float(optimize.minimize_scalar(dual, bounds=(float(l64.min()), float(l64.max())), method="bounded").fun)


def make_methods(losses, name, params, fast_dro_class=None) -> dict:
    l64 = losses.detach().double().cpu().numpy()
    methods = {
        METHODS[0]: lambda: float(dro_ext.robust_objective(losses, LAM, name, **params)[0]),
        METHODS[1]: lambda: bisection_loop(losses, name, params),
        METHODS[2]: lambda: scipy_bounded(l64, name, params),
    }
    peer = fast_dro_peer.make_peer(fast_dro_class, name, params, LAM) if fast_dro_class is not None else None
    if peer is not None:
        try:
            fast_dro_peer.call(peer, losses)
            methods[FAST_DRO] = lambda: float(fast_dro_peer.call(peer, losses))
        except Exception as exc:  # noqa: BLE001 - the peer's own failure on this device or dtype: the rest run
            progress(f"[robust] {FAST_DRO} fails on {case_label(name, params)} {losses.dtype} {losses.device}: "
                     f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}; left out")
    return methods


def lognormal_losses(n: int, seed: int = 0) -> torch.Tensor:
    """Lognormal per-sample losses, like the cross-entropy losses of a trained classifier."""
    return torch.exp(torch.randn(n, generator=torch.Generator().manual_seed(seed), dtype=torch.float64) * 0.75)


def bench(device, sizes, cases, *, rounds, min_seconds, quick=False, fast_dro_class=None, on_case=None) -> list[dict]:
    """Every (N, dtype, case); on_case(rows, done, total) after each (bench.common.partial_writer)."""
    timer = Timer(device)
    rows = []
    total = len(sizes) * len(DTYPES) * len(cases)
    step = 0
    for n in sizes:
        base = lognormal_losses(n)
        big = n > (1 << 20)
        for dtype in DTYPES:
            losses = base.to(device=device, dtype=dtype)
            l64 = losses.double().cpu().numpy()
            for name, params in cases:
                step += 1
                ref = reference(l64, name, params)
                methods = make_methods(losses, name, params, fast_dro_class)
                # This first call of each method is its warm-up too (at 2^22 the loop takes seconds a call).
                values = {method: fn() for method, fn in methods.items()}
                stats = interleaved_rounds(methods, timer, rounds=rounds, min_seconds=min_seconds,
                                           min_reps=1 if big else (3 if quick else 10), warmup=0)
                ours = stats[METHODS[0]]["median_s"]
                label = case_label(name, params)
                for method, t in stats.items():
                    rows.append({
                        "device": str(device), "case": label, "divergence": name, **params, "n": n,
                        "dtype": str(dtype).replace("torch.", ""), "method": method,
                        "median_ms": 1e3 * t["median_s"], "p25_ms": 1e3 * t["p25_s"], "p75_ms": 1e3 * t["p75_s"],
                        "reps": t["reps"], "time_vs_dro_ext": t["median_s"] / ours, "psi": values[method],
                        "reference": ref, "abs_error": abs(values[method] - ref),
                    })
                progress(f"[robust {step}/{total}] {label:>22} N=2^{int(math.log2(n))} {rows[-1]['dtype']}: " +
                         "  ".join(f"{r['method'].split(' ')[0]} {r['median_ms']:.3f} ms (err {r['abs_error']:.1e})"
                                   for r in rows[-len(stats):]))
                if on_case:
                    on_case(rows, step, total)
    return rows


HEADER = ["case", "N", "dtype", "method", "median ms", "time / dro_ext", "abs error"]


def table_rows(rows):
    return [[r["case"], f"2^{int(math.log2(r['n']))}", r["dtype"], r["method"], r["median_ms"], r["time_vs_dro_ext"],
             f"{r['abs_error']:.1e}"] for r in rows]


NOTE = (f"lam={LAM}, lognormal losses (exp(0.75 z)); reference: float64 closed forms (kl, cvar) or brentq "
        "(xtol 1e-15) + fsum; the three methods run on the same losses in interleaved rounds; `time / dro_ext` > 1 "
        "means dro_ext is faster. scipy runs on the host in float64 whatever the device. The bisection loop is "
        "the algorithm DRO libraries use (one reduction and a host-side test per iteration), run for every "
        "divergence.")
NOTE_FAST_DRO = ("Peer: daniellevy/fast-dro's RobustLoss (default tol 1e-4) from the checkout at `{path}` (commit "
                 "{commit}), on the divergences it shares: cvar (size=alpha, reg=0), kl_cvar (size=alpha, reg=lam), "
                 "cressie_read k=2 (its penalized chi-square: size=inf, reg=lam).")
NOTE_NO_FAST_DRO = ("Peer daniellevy/fast-dro not run: no checkout given (`--fast-dro PATH` or FAST_DRO_PATH; it is "
                    "not on PyPI).")


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common_arguments(parser, quick_help="N = 2^12 only, 2 short rounds")
    parser.add_argument("--sizes", type=int, nargs="+", default=None)
    parser.add_argument("--divergences", nargs="+", default=None, choices=sorted({c[0] for c in CASES}))
    parser.add_argument("--rounds", type=int, default=None)
    parser.add_argument("--min-seconds", type=float, default=None,
                        help="per method, over all rounds (default 1 s on the CPU, 0.3 s on CUDA)")
    parser.add_argument("--name", default="robust")
    parser.add_argument("--fast-dro", default=None, metavar="PATH",
                        help="a checkout of daniellevy/fast-dro to run as a peer (default: $FAST_DRO_PATH)")
    args = parser.parse_args(argv)
    fast_dro_path = fast_dro_peer.checkout_path(args.fast_dro)
    fast_dro_class = fast_dro_peer.load_robust_loss(fast_dro_path) if fast_dro_path else None
    device = check_device(args.device)
    sizes = args.sizes or (QUICK_SIZES if args.quick else FULL_SIZES)
    rounds = args.rounds or (2 if args.quick else 3)
    min_seconds = default_min_seconds(args, device, quick=0.02, full=1.0)
    info = device_info(device)
    load_before = loadavg()
    peer_note = (NOTE_FAST_DRO.format(path=fast_dro_path, commit=fast_dro_peer.commit_of(fast_dro_path))
                 if fast_dro_path else NOTE_NO_FAST_DRO)
    name = result_name(args.name, info)
    settings = {"sizes": list(sizes), "rounds": rounds, "min_seconds": min_seconds, "quick": args.quick,
                "backend": dro_ext.backend(), "fast_dro": fast_dro_path}
    before = NOTE + " " + peer_note + "\n\n"
    on_case = partial_writer(args, name, info, lambda rows: before + markdown_table(HEADER, table_rows(rows)),
                             load_before=load_before, settings=settings)
    rows = bench(device, sizes, select_cases(args.divergences), rounds=rounds, min_seconds=min_seconds,
                 quick=args.quick, fast_dro_class=fast_dro_class, on_case=on_case)
    return publish(args, "robust", name, rows, HEADER, table_rows(rows), info, load_before=load_before,
                   settings=settings, before=before, plot="plot_robust",
                   plot_title="robust_objective vs peers")


if __name__ == "__main__":
    main()
