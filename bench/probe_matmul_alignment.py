"""Does a vocabulary that is not a multiple of 8 slow the fused linear cross-entropy's matmuls, and would padding the
logits' row stride alone recover the time?

    python -m bench.probe_matmul_alignment [--device cuda] [--rows 4096] [--hidden 768] [--vocab 50257 32000]

On the H200, `dro_linear_cross_entropy` on the lm-head case (16384 tokens, H = 768, V = 50257, bfloat16) took 36 ms
a step, about what eager ERM took (34 ms: F.linear and F.cross_entropy on the same shapes), while the same ERM
step under torch.compile took 9 ms: Inductor fuses the cross-entropy, and its shape padding can pad matmul
dimensions that are not a multiple of the alignment. A bfloat16 matrix whose leading dimension is 50257 elements is not 16-byte aligned, which
keeps cuBLAS off its fastest kernels. This probe times one chunk's three matmuls (the logits, the gradient of
hidden, the gradient of weight) three ways, side by side in interleaved rounds, before any change to the op:

- `contiguous`: the logits as the op forms them today, a contiguous (rows, V) buffer;
- `padded stride`: the same (rows, V) logits as a view of a (rows, V8) buffer, V8 = V rounded up to a multiple of 8,
  so that every leading dimension is aligned while the shapes, and so the results, stay the same; the cross-entropy
  kernels would then read rows with a stride (they require contiguous logits today);
- `padded vocab`: V itself rounded up to a multiple of 64 (a weight with zero rows appended): the bound.

Each variant's results are checked against `contiguous`'s before it is timed (no variant is timed that computes
something else). Rows go to <out>/matmul_alignment[_<card>].{json,csv,md}; nothing here is a test.
"""
from __future__ import annotations

import argparse

import torch

from bench.common import (Timer, add_common_arguments, check_device, device_info, interleaved_rounds, loadavg,
                          progress, publish, result_name)

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
VARIANTS = ("contiguous", "padded stride", "padded vocab")


def round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def chunk_matmuls(hidden: torch.Tensor, weight: torch.Tensor, logits: torch.Tensor, grad_hidden: torch.Tensor,
                  grad_weight: torch.Tensor) -> None:
    """One chunk's matmuls as the op runs them: logits = h W^T, then (logits standing in for their gradient)
    grad_hidden = logits W and grad_weight = logits^T h."""
    torch.mm(hidden, weight.t(), out=logits)
    torch.mm(logits, weight, out=grad_hidden)
    torch.mm(logits.t(), hidden, out=grad_weight)


def make_variant(name: str, hidden: torch.Tensor, weight: torch.Tensor):
    """(run, outputs): the variant's chunk matmuls into buffers of its layout, and its (logits, grad_hidden,
    grad_weight) cut back to the unpadded shapes."""
    rows, vocab = hidden.shape[0], weight.shape[0]
    if name == "padded vocab":
        weight = torch.cat([weight, weight.new_zeros(round_up(vocab, 64) - vocab, weight.shape[1])])
    width = round_up(vocab, 8) if name == "padded stride" else weight.shape[0]
    buffer = torch.full((rows, width), float("nan"), dtype=hidden.dtype, device=hidden.device)
    logits = buffer[:, : weight.shape[0]]
    grad_hidden = torch.full_like(hidden, float("nan"))
    grad_weight = torch.full_like(weight, float("nan"))

    def run():
        chunk_matmuls(hidden, weight, logits, grad_hidden, grad_weight)

    return run, lambda: (logits[:, :vocab], grad_hidden, grad_weight[:vocab])


def relative_error(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm().clamp(min=1e-300))


def probe(rows: int, hidden_size: int, vocab: int, dtype: torch.dtype, device, *, rounds: int, min_seconds: float):
    generator = torch.Generator(device="cpu").manual_seed(vocab)
    hidden = (torch.randn(rows, hidden_size, generator=generator) / hidden_size ** 0.5).to(device, dtype)
    weight = torch.randn(vocab, hidden_size, generator=generator).to(device, dtype)
    variants = {name: make_variant(name, hidden, weight) for name in VARIANTS}
    for run, _ in variants.values():
        run()
    reference = variants["contiguous"][1]()
    errors = {}
    for name, (_, outputs) in variants.items():
        got = outputs()
        if any(not bool(torch.isfinite(t).all()) for t in got):
            raise RuntimeError(f"probe: {name} left part of its output unwritten (NaN) at V={vocab}")
        errors[name] = max(relative_error(g, r) for g, r in zip(got, reference))
        # The same math in another kernel rounds differently, within the dtype's few ulps over a sum of H products.
        if errors[name] > 2e-2:
            raise RuntimeError(f"probe: {name} differs from contiguous by {errors[name]:.2e} at V={vocab}")
    timer = Timer(device)
    times = interleaved_rounds({name: run for name, (run, _) in variants.items()}, timer, rounds=rounds,
                               min_seconds=min_seconds, min_reps=5)
    flops = 3 * 2 * rows * hidden_size * vocab
    base = times["contiguous"]["median_s"]
    return [{"rows": rows, "hidden": hidden_size, "vocab": vocab, "dtype": str(dtype).removeprefix("torch."),
             "variant": name, "median_ms": 1e3 * t["median_s"], "p25_ms": 1e3 * t["p25_s"], "p75_ms": 1e3 * t["p75_s"],
             "tflops": flops / t["median_s"] / 1e12, "x_contiguous": t["median_s"] / base,
             "max_rel_error": errors[name]} for name, t in times.items()]


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_common_arguments(parser, quick_help="small shapes, few rounds (a smoke run)")
    parser.add_argument("--rows", type=int, default=4096, help="rows of one chunk (the op's default on CUDA here)")
    parser.add_argument("--hidden", type=int, default=768)
    parser.add_argument("--vocab", type=int, nargs="+", default=[50257, 32000])
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bfloat16")
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args(argv)
    device = check_device(args.device)
    if args.quick:
        args.rows, args.hidden, args.vocab, args.rounds = 64, 32, [1001, 1024], 2
    info, load_before = device_info(device), loadavg()
    rows = []
    for vocab in args.vocab:
        found = probe(args.rows, args.hidden, vocab, DTYPES[args.dtype], device, rounds=args.rounds,
                      min_seconds=0.05 if args.quick else 1.0)
        times = "  ".join(f"{r['variant']} {r['median_ms']:.3f} ms" for r in found)
        progress(f"[matmul_alignment] V={vocab}: {times}")
        rows += found
    header = ["rows", "H", "V", "dtype", "variant", "median ms", "TFLOP/s", "x contiguous", "max rel error"]
    table = [[r["rows"], r["hidden"], r["vocab"], r["dtype"], r["variant"], r["median_ms"], r["tflops"],
              r["x_contiguous"], r["max_rel_error"]] for r in rows]
    publish(args, "matmul_alignment", result_name("matmul_alignment", info), rows, header, table, info,
            load_before=load_before, settings={"rows": args.rows, "hidden": args.hidden, "dtype": args.dtype,
                                               "rounds": args.rounds, "quick": args.quick},
            after="\n\nOne chunk's three matmuls of the fused linear cross-entropy (logits, gradient of hidden, "
                  "gradient of weight). `padded stride`: the same shapes with every leading dimension a multiple of "
                  "8; `padded vocab`: V rounded up to a multiple of 64 (the bound). `x contiguous` < 1 is faster "
                  "than the layout the op uses today.")


if __name__ == "__main__":
    main()
