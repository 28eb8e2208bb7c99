"""Every CUDA kernel of dro_ext once per divergence and dtype, on small odd-sized and misaligned inputs: the
focused workload scripts/gpu_check.sh runs under compute-sanitizer (memcheck, racecheck), where a full test
run would take far too long. Exits non-zero if any result disagrees with the CPU kernels."""
import pathlib
import sys

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))  # this checkout's dro_ext
import dro_ext  # noqa: F401  (registers torch.ops.dro_ext)

CASES = [("chi2", None, None), ("kl", None, None), ("cvar", 0.3, None), ("kl_cvar", 0.2, None),
         ("cressie_read", None, 1.5), ("cressie_read", None, 3.0), ("smoothed_cvar", 0.1, None)]
DTYPES = [torch.float16, torch.bfloat16, torch.float32, torch.float64]


def inputs(n, dtype, offset):
    buffer = (1.0 + torch.randn(n + offset, dtype=torch.float64)).to(dtype).cuda()
    return buffer[offset:]


def close(got, want, dtype):
    tol = {torch.float16: 3e-3, torch.bfloat16: 2e-2, torch.float32: 1e-4, torch.float64: 1e-9}[dtype]
    return torch.allclose(got.cpu().double(), want.double(), rtol=tol, atol=tol, equal_nan=True)


def group_dro_step(sums, state_dtype, label):
    """group_dro_step_ over given group sums, updating and not, against the CPU kernel."""
    failures = []
    num_groups = sums[0].numel()
    operands = []
    for device in ("cuda", "cpu"):
        log_q = torch.full((2 * num_groups,), -1.6, dtype=state_dtype, device=device)[::2]
        state = [log_q, torch.zeros(num_groups, dtype=state_dtype, device=device),
                 torch.zeros(num_groups, dtype=state_dtype, device=device),
                 torch.zeros(num_groups, dtype=torch.bool, device=device),
                 torch.ones(num_groups, dtype=torch.bool, device=device),
                 torch.zeros(num_groups, dtype=torch.float64, device=device)]
        operands.append(([t.to(device) for t in sums], state))
    for update in (True, False):
        results = [torch.ops.dro_ext.group_dro_step_(*s, *state, 0.5, 0.1, True, True, update)
                   for s, state in operands]
        (loss, weights), (loss_cpu, weights_cpu) = results
        if not (close(loss, loss_cpu, state_dtype) and close(weights, weights_cpu, state_dtype)
                and close(operands[0][1][0], operands[1][1][0], state_dtype)):
            failures.append(f"group_dro_step_ update={update} {label}")
    return failures


def linear_cross_entropy_agrees(hidden, weight, targets, groups=None, *, divergence, **options):
    """dro_linear_cross_entropy (eta 0.1, lam 0.5) forward and backward on CUDA against the same call on the CPU:
    the value and the gradients to hidden, weight and eta."""
    results = []
    for device in ("cpu", "cuda"):
        h = hidden.detach().to(device).requires_grad_(True)
        w = weight.detach().to(device).requires_grad_(True)
        eta = torch.tensor(0.1, device=device, requires_grad=True)
        value = dro_ext.dro_linear_cross_entropy(h, w, targets.to(device), eta, 0.5, divergence, **options,
                                                 groups=None if groups is None else groups.to(device))
        value.backward()
        results.append((value.detach(), h.grad, w.grad, eta.grad))
    return all(close(a, b.cpu(), a.dtype) for a, b in zip(results[1], results[0]))


def optimizer_and_cross_entropy():
    """The NormalizedSGD step (mixed dtypes, both norms, a misaligned view) and the fused cross-entropy ops (the linear
    one per sample and over groups), through the public API, against the same calls on the CPU."""
    failures = []
    for norm in ("global", "tensor"):
        shapes = [(7,), (33, 5), (1,), (4099,)]
        dtypes = [torch.float32, torch.float16, torch.bfloat16, torch.float64]
        cpu = [torch.randn(s, dtype=torch.float64).to(d) for s, d in zip(shapes, dtypes)]
        dev = [p.cuda() for p in cpu]
        for params in (cpu, dev):
            for p in params:
                p.requires_grad_(True)
        opts = [dro_ext.NormalizedSGD(ps, lr=0.1, momentum=0.9, weight_decay=0.01, norm=norm) for ps in (cpu, dev)]
        for _ in range(3):
            grads = [torch.randn(p.shape, dtype=torch.float64) for p in cpu]
            for ps, opt in zip((cpu, dev), opts):
                for p, g in zip(ps, grads):
                    p.grad = g.to(device=p.device, dtype=p.dtype)
                opt.step()
        for a, b in zip(dev, cpu):
            if not close(a.detach(), b.detach(), b.dtype):
                failures.append(f"normalized_sgd_step_ norm={norm} {b.dtype} {tuple(b.shape)}")
    for dtype in DTYPES:
        logits = torch.randn(9, 37, dtype=torch.float64).to(dtype)
        targets = torch.randint(0, 37, (9,))
        targets[2] = -100
        results = []
        for device in ("cpu", "cuda"):
            x = logits.detach().to(device).requires_grad_(True)
            eta = torch.tensor(0.3, device=device, requires_grad=True)
            value = dro_ext.dro_cross_entropy(x, targets.to(device), eta, 0.5, "cvar", alpha=0.3, label_smoothing=0.1)
            value.backward()
            results.append((value.detach(), x.grad, eta.grad))
        if not all(close(a, b.cpu(), dtype if a.dtype == dtype else a.dtype) for a, b in zip(results[1], results[0])):
            failures.append(f"dro_cross_entropy {dtype}")
        hidden = torch.randn(11, 16, dtype=torch.float64).to(dtype)
        weight = torch.randn(23, 16, dtype=torch.float64).to(dtype)
        if not linear_cross_entropy_agrees(hidden, weight, torch.arange(11), divergence="kl", chunk_size=4):
            failures.append(f"dro_linear_cross_entropy {dtype}")
        # Over groups: the second chunked pass writes each chunk's gradient over its logits in place
        # (dro_cross_entropy_backward_, whose rows read their target logit before any thread writes).
        targets = torch.arange(11)
        targets[3] = -100
        groups = torch.tensor([0, 2, 1, 0, 2, 2, 1, 0, 0, 1, 2])
        if not linear_cross_entropy_agrees(hidden, weight, targets, groups, divergence="chi2", chunk_size=4,
                                           label_smoothing=0.1, num_groups=3):
            failures.append(f"dro_linear_cross_entropy over groups {dtype}")
    return failures


def main():
    torch.manual_seed(0)
    ops = torch.ops.dro_ext
    failures = []
    for dtype in DTYPES:
        acc = torch.float64 if dtype == torch.float64 else torch.float32
        # Every dtype on a misaligned odd size; the single-sample and the multi-block sizes in float32 only,
        # which keeps the run short under the sanitizers (each kernel launch costs milliseconds there).
        sizes = ((7, 1), (4099, 3)) + (((1, 0), (70001, 0)) if dtype == torch.float32 else ())
        for n, offset in sizes:
            x = inputs(n, dtype, offset)
            eta = torch.tensor(0.7, dtype=acc, device="cuda")
            one = torch.tensor(1.0, dtype=acc, device="cuda")
            for name, alpha, k in CASES:
                label = f"{name} {dtype} n={n} offset={offset}"
                value, mean_w = ops.dro_loss(x, eta, 0.5, name, alpha, k, 1.2)
                v_cpu, m_cpu = ops.dro_loss(x.cpu(), eta.cpu(), 0.5, name, alpha, k, 1.2)
                if not (close(value, v_cpu, dtype) and close(mean_w, m_cpu, acc)):
                    failures.append(f"dro_loss {label}")
                g_l, g_e = ops.dro_loss_backward(one, x, eta, mean_w, 0.5, name, alpha, k, 1.2)
                g_l_cpu, _ = ops.dro_loss_backward(one.cpu(), x.cpu(), eta.cpu(), m_cpu, 0.5, name, alpha, k, 1.2)
                if not close(g_l * n, g_l_cpu * n, dtype):
                    failures.append(f"dro_loss_backward {label}")
                for order in (0, 1, 2):
                    t = ops.psi_star_terms(x, eta, one, 0.5, name, alpha, k, 1.0, order)
                    t_cpu = ops.psi_star_terms(x.cpu(), eta.cpu(), one.cpu(), 0.5, name, alpha, k, 1.0, order)
                    if not close(t, t_cpu, dtype):
                        failures.append(f"psi_star_terms order {order} {label}")
                psi, eta_star = ops.robust_objective(x, 0.5, name, alpha, k)
                psi_cpu, eta_cpu = ops.robust_objective(x.cpu().double(), 0.5, name, alpha, k)
                if not close(psi, psi_cpu, dtype):
                    failures.append(f"robust_objective {label}")
                q = ops.robust_weights(x, eta_star, 0.5, name, alpha, k)
                if not abs(q.double().sum().item() - 1.0) < 2e-2:
                    failures.append(f"robust_weights {label}")
                groups = torch.randint(0, 5, (n,), device="cuda")
                stats = ops.weight_stats(q, groups, 5)
                stats_cpu = ops.weight_stats(q.cpu(), groups.cpu(), 5)
                if not all(close(a, b, acc) for a, b in zip(stats, stats_cpu)):
                    failures.append(f"weight_stats {label}")
            # group_sums (a strided id view, an id out of range dropped) and its backward, once per size.
            ids = torch.randint(-1, 6, (2 * n,), device="cuda", dtype=torch.int32)[::2]
            sums = ops.group_sums(x, ids, 5, False)
            sums_cpu = ops.group_sums(x.cpu(), ids.cpu(), 5, False)
            if not all(close(a, b, acc) for a, b in zip(sums, sums_cpu)):
                failures.append(f"group_sums {dtype} n={n} offset={offset}")
            grad = ops.group_sums_backward(sums[0], ids, dtype)
            if not torch.equal(grad.cpu(), ops.group_sums_backward(sums[0].cpu(), ids.cpu(), dtype)):
                failures.append(f"group_sums_backward {dtype} n={n} offset={offset}")
            # The online Group DRO step, its state in this dtype (a strided log q), over the sums above.
            failures += group_dro_step(sums, dtype, f"{dtype} n={n} offset={offset}")
    failures += optimizer_and_cross_entropy()
    torch.cuda.synchronize()
    for f in failures:
        print("MISMATCH", f)
    print(f"cuda_smoke: {len(failures)} mismatches")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
