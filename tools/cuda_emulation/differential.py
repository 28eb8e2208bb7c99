"""Edge cases the test files do not try, run on dro_ext's real CPU kernels and then on the emulated CUDA kernels
of one .cu file (emulate.py builds them), in one process: every output must agree (NaN where NaN, inf where
inf, values to a dtype tolerance: the summation orders differ).

    python tools/cuda_emulation/differential.py --kernel loss|robust|cross_entropy|all

Masked (-inf) logits, infinite and NaN losses, ties, views at odd offsets, sizes around the block and vector
widths, groups with empty segments. A case that raises on one side must raise on the other.
"""
import argparse
import math
import pathlib
import sys
import warnings

import torch

HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parents[1]))

import dro_ext  # noqa: E402,F401
from dro_ext.cross_entropy import shifted_logsumexp  # noqa: E402
import emulate  # noqa: E402

ops = torch.ops.dro_ext
DIVS = [("chi2", {}), ("kl", {}), ("cvar", {"alpha": 0.3}), ("kl_cvar", {"alpha": 0.2}),
        ("cressie_read", {"k": 1.5}), ("smoothed_cvar", {"alpha": 0.1})]


def loss_cases():
    g = torch.Generator().manual_seed(1)
    for n in (1, 2, 3, 5, 8, 17, 255, 256, 257, 1023, 4097, 16411):
        for dtype in (torch.float32, torch.float64, torch.float16):
            x = torch.randn(n + 3, generator=g, dtype=torch.float64).to(dtype)[3:]  # odd offset view
            for name, kw in DIVS:
                yield f"dro_loss n={n} {dtype} {name}", lambda x=x, name=name, kw=kw: ops.dro_loss(
                    x, torch.tensor(0.3), 0.7, name, kw.get("alpha"), kw.get("k"), 1.5)
                yield f"dro_loss_backward n={n} {dtype} {name}", lambda x=x, name=name, kw=kw: ops.dro_loss_backward(
                    torch.tensor(2.0), x, torch.tensor(0.3), torch.tensor(0.9), 0.7, name, kw.get("alpha"),
                    kw.get("k"), 1.5)
                yield f"psi_star_terms n={n} {dtype} {name}", lambda x=x, name=name, kw=kw: ops.psi_star_terms(
                    x, torch.tensor(0.3), torch.tensor(1.25), 0.7, name, kw.get("alpha"), kw.get("k"), 1.5, 2)
    for special in (math.inf, -math.inf, math.nan):
        for where in (0, 700, 4096):
            x = torch.randn(4097, generator=g)
            x[where] = special
            for name, kw in DIVS:
                yield f"dro_loss {special}@{where} {name}", lambda x=x, name=name, kw=kw: ops.dro_loss(
                    x, torch.tensor(0.3), 0.7, name, kw.get("alpha"), kw.get("k"), 1.0)
    for eta in (math.inf, -math.inf, math.nan, 1e30):
        x = torch.randn(300, generator=g)
        for name, kw in DIVS:
            yield f"dro_loss eta={eta} {name}", lambda x=x, eta=eta, name=name, kw=kw: ops.dro_loss(
                x, torch.tensor(eta), 0.7, name, kw.get("alpha"), kw.get("k"), 1.0)


def robust_cases():
    g = torch.Generator().manual_seed(2)
    inputs = {}
    for n in (1, 2, 3, 7, 255, 257, 4099):
        inputs[f"randn n={n}"] = torch.randn(n, generator=g, dtype=torch.float64)
    inputs["ties"] = torch.tensor([1.0, 2.0, 2.0, 2.0, 3.0, 3.0] * 50)
    inputs["two values"] = torch.tensor([0.0] * 99 + [1.0])
    inputs["all equal"] = torch.full((513,), 2.5)
    inputs["+inf"] = torch.cat([torch.randn(100, generator=g), torch.tensor([math.inf])])
    inputs["-inf"] = torch.cat([torch.randn(100, generator=g), torch.tensor([-math.inf])])
    inputs["nan"] = torch.cat([torch.randn(100, generator=g), torch.tensor([math.nan])])
    inputs["-0.0 and 0.0"] = torch.tensor([0.0, -0.0, -0.0, 0.0, 1.0, -1.0] * 7)
    inputs["huge"] = torch.randn(1000, generator=g, dtype=torch.float64) * 1e200
    inputs["tiny spread"] = 1e6 + torch.randn(1000, generator=g, dtype=torch.float64) * 1e-6
    inputs["odd view f32"] = torch.randn(1029, generator=g)[5:]
    inputs["bf16"] = torch.randn(2000, generator=g).bfloat16()
    for key, x in inputs.items():
        for name, kw in DIVS + [("cvar", {"alpha": 1.0}), ("cvar", {"alpha": 1e-4}), ("cressie_read", {"k": 2.0})]:
            for lam in (0.01, 1.0, 1e6):
                yield f"robust_objective {key} {name}{kw} lam={lam}", lambda x=x, name=name, kw=kw, lam=lam: (
                    ops.robust_objective(x, lam, name, kw.get("alpha"), kw.get("k")))
                yield f"robust_weights {key} {name}{kw} lam={lam}", lambda x=x, name=name, kw=kw, lam=lam: (
                    ops.robust_weights(x, torch.tensor(float(x.double().median())), lam, name, kw.get("alpha"),
                                       kw.get("k")))
    for n, groups in ((10, 3), (1000, 7), (1000, 1), (3000, 600), (5, 64)):
        w = torch.rand(n, generator=g, dtype=torch.float64)
        w[::7] = 0.0
        ids = torch.randint(0, max(1, groups // 2), (n,), generator=g)  # the upper half of the groups empty
        yield f"weight_stats n={n} groups={groups}", lambda w=w, ids=ids, groups=groups: ops.weight_stats(w, ids, groups)
        yield f"weight_stats n={n} int32 groups={groups}", lambda w=w, ids=ids, groups=groups: ops.weight_stats(
            w.float(), ids.int(), groups)
        yield f"weight_stats n={n}", lambda w=w: ops.weight_stats(w, None, 0)
    w = torch.rand(100, generator=g)
    w[3] = math.nan
    yield "weight_stats nan", lambda w=w: ops.weight_stats(w, None, 0)
    yield "weight_stats all zero", lambda: ops.weight_stats(torch.zeros(300), torch.zeros(300, dtype=torch.long), 2)


def _shifted_lse(x):
    """The per-row logsumexp pairs (shift, log_sum) the cross-entropy backward takes, in the accumulate dtype."""
    return shifted_logsumexp(x.float() if x.dtype != torch.float64 else x)


def cross_entropy_cases():
    g = torch.Generator().manual_seed(3)
    for rows, c in ((1, 1), (3, 2), (5, 255), (4, 256), (4, 257), (3, 1000)):
        for dtype in (torch.float32, torch.float64, torch.bfloat16):
            base = torch.randn(rows, c, generator=g).to(dtype)
            masked = base.clone()
            masked[:, : max(1, c // 3)] = -math.inf  # a masked prefix
            masked[:, 0] = 0.0 if c == 1 else -math.inf
            targets = torch.randint(max(1, c // 3), max(2, c), (rows,), generator=g) if c > 1 else torch.zeros(rows, dtype=torch.long)
            targets[0] = -100 if rows > 1 else targets[0]
            for label, x in (("plain", base), ("masked", masked)):
                for smoothing in (0.0, 0.1):
                    if label == "masked" and smoothing:
                        continue  # sum_j x_j = -inf: the smoothed loss is inf on both sides, nothing to compare
                    for name, kw in DIVS[:3]:
                        tag = f"{rows}x{c} {dtype} {label} ls={smoothing} {name}"
                        yield f"dro_cross_entropy {tag}", lambda x=x, t=targets, name=name, kw=kw, s=smoothing: (
                            ops.dro_cross_entropy(x, t, torch.tensor(0.5), 0.8, name, kw.get("alpha"), kw.get("k"),
                                                  1.0, -100, s))
                        yield f"dro_cross_entropy_chunk_ {tag}", lambda x=x, t=targets, name=name, kw=kw, s=smoothing: (
                            (lambda y: (ops.dro_cross_entropy_chunk_(y, t, torch.tensor(0.5), torch.tensor(0.25), 0.8,
                                                                     name, kw.get("alpha"), kw.get("k"), 1.0, -100, s,
                                                                     True), y))(x.clone()))
                        yield f"dro_cross_entropy_backward {tag}", lambda x=x, t=targets, s=smoothing: (
                            ops.dro_cross_entropy_backward(torch.tensor(1.5), x, t,
                                                           _shifted_lse(x),
                                                           torch.rand(x.shape[0], generator=torch.Generator().manual_seed(4),
                                                                      dtype=torch.float64 if x.dtype == torch.float64 else torch.float32),
                                                           -100, s))
                        yield f"dro_cross_entropy_backward_ {tag}", lambda x=x, t=targets, s=smoothing: (
                            (lambda y: (ops.dro_cross_entropy_backward_(
                                torch.tensor(1.5), y, t, _shifted_lse(x),
                                torch.rand(x.shape[0], generator=torch.Generator().manual_seed(4),
                                           dtype=torch.float64 if x.dtype == torch.float64 else torch.float32),
                                -100, s), y)[1])(x.clone()))
    row = torch.full((2, 300), -math.inf)
    row[1, 5] = 1.0
    yield "dro_cross_entropy a row all -inf", lambda: ops.dro_cross_entropy(row, torch.tensor([3, 5]), torch.tensor(0.5), 0.8, "kl", None, None, 1.0, -100, 0.0)


CASES = {"loss": loss_cases, "robust": robust_cases, "cross_entropy": cross_entropy_cases}


def flatten(out):
    if isinstance(out, torch.Tensor):
        return [out]
    return [t for o in out for t in flatten(o)]


def run(cases):
    results = []
    for name, fn in cases:
        try:
            results.append((name, [t.detach().clone() for t in flatten(fn())]))
        except Exception as e:  # noqa: BLE001
            results.append((name, f"{type(e).__name__}: {str(e).splitlines()[0]}"))
    return results


def same(a, b):
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    a, b = a.double(), b.double()
    if not torch.equal(a.isnan(), b.isnan()):
        return False
    finite = a.isfinite() & b.isfinite()
    if not torch.equal(a[~finite & ~a.isnan()], b[~finite & ~b.isnan()]):
        return False
    eps = {torch.float64: 1e-9, torch.float32: 2e-4}.get(a.dtype, 2e-2)
    return bool(((a[finite] - b[finite]).abs() <= eps * (1 + torch.maximum(a[finite].abs(), b[finite].abs()))).all())


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kernel", choices=[*CASES, "all"], default="all")
    args = parser.parse_args()
    failures = 0
    for key in CASES if args.kernel == "all" else [args.kernel]:
        library = emulate.build(emulate.KERNELS[key])
        cpu = run(CASES[key]())
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            torch.ops.load_library(str(library))  # from here on, the op's CPU kernel is the emulated CUDA code
        emulated = run(CASES[key]())
        bad = 0
        for (name, want), (_, got) in zip(cpu, emulated):
            if isinstance(want, str) or isinstance(got, str):
                ok = isinstance(want, str) == isinstance(got, str)
            else:
                ok = len(want) == len(got) and all(same(w, g) for w, g in zip(want, got))
            if not ok:
                bad += 1
                print(f"MISMATCH {name}\n  cpu:      {short(want)}\n  emulated: {short(got)}")
        print(f"differential.py: {key}: {len(cpu) - bad} of {len(cpu)} cases agree")
        failures += bad
    sys.exit(1 if failures else 0)


def short(v):
    if isinstance(v, str):
        return v
    return [t.flatten()[:6].tolist() if t.numel() > 1 else t.item() for t in v]


if __name__ == "__main__":
    main()
