"""The bodies of tests/test_distributed.py: each job runs in every rank of a gloo group of CPU processes.

    python tests/distributed_jobs.py JOB RANK WORLD_SIZE STORE_FILE

The group meets through a FileStore (no TCP port to pick, so parallel tests cannot clash). Each rank
checks its own results against the single-process answer on the concatenated data, which it computes
itself (every rank can rebuild every rank's data from the seed), and exits non-zero on the first failed
check, with the reason on stderr. Collectives time out after COLLECTIVE_TIMEOUT seconds.
"""
from __future__ import annotations

import copy
import datetime
import json
import math
import os
import sys
import time
import traceback

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import dro_ext  # noqa: E402
from dro_ext import _backend  # noqa: E402
from dro_ext import distributed as dro_dist  # noqa: E402

COLLECTIVE_TIMEOUT = 60.0  # generous: the test machine may be heavily shared
PARAMS = {"cvar": {"alpha": 0.3}, "kl_cvar": {"alpha": 0.2}, "smoothed_cvar": {"alpha": 0.25},
          "cressie_read": {"k": 1.5}}
BACKENDS = ("native", "python") if _backend.native_available() and not _backend._force_python else ("python",)


def close(actual, expected, what, *, rtol=1e-12, atol=1e-12):
    actual = torch.as_tensor(actual, dtype=torch.float64)
    expected = torch.as_tensor(expected, dtype=torch.float64)
    if actual.shape != expected.shape:
        raise AssertionError(f"{what}: shape {tuple(actual.shape)} != {tuple(expected.shape)}")
    if not torch.allclose(actual, expected, rtol=rtol, atol=atol, equal_nan=True):
        diff = (actual - expected).abs().max().item()
        raise AssertionError(f"{what}: max |diff| {diff:.3e}\n  got      {actual}\n  expected {expected}")


def split(full: torch.Tensor, sizes, rank):
    begin = sum(sizes[:rank])
    return full[begin:begin + sizes[rank]]


# ---------------------------------------------------------------------------------------------------
# DDP: DROLoss gradients and NormalizedSGD trajectories equal single-process ones on the whole batch
# ---------------------------------------------------------------------------------------------------


class Net(nn.Module):
    def __init__(self, divergence, lam=0.5, group=None, **params):
        super().__init__()
        torch.manual_seed(1234)
        self.body = nn.Sequential(nn.Linear(7, 5), nn.Tanh(), nn.Linear(5, 3)).double()
        self.dro = dro_ext.DROLoss(divergence, lam, eta_init=0.3, group=group, **params).double()

    def forward(self, x, y):
        return self.dro(F.cross_entropy(self.body(x), y, reduction="none"))


def grads_of(module):
    return {name: p.grad.detach().clone() for name, p in module.named_parameters()}


def job_ddp(rank, world):
    from torch.nn.parallel import DistributedDataParallel as DDP

    group = dist.group.WORLD
    gen = torch.Generator().manual_seed(7)
    x_all, y_all = torch.randn(16, 7, generator=gen, dtype=torch.float64), torch.randint(0, 3, (16,), generator=gen)
    for backend in BACKENDS:
        with _backend.forced_backend(backend):
            for divergence in dro_ext.DIVERGENCES:
                params = PARAMS.get(divergence, {})
                for sizes, use_group in (((8, 8), False), ((11, 5), True), ((11, 5), False)):
                    n = sum(sizes)
                    reference = Net(divergence, **params)
                    reference(x_all[:n], y_all[:n]).backward()
                    expected = grads_of(reference)
                    ddp = DDP(Net(divergence, group=group if use_group else None, **params))
                    x, y = split(x_all[:n], sizes, rank), split(y_all[:n], sizes, rank)
                    value = ddp(x, y)
                    value.backward()
                    got = grads_of(ddp.module)
                    what = f"DDP {backend} {divergence} sizes={sizes} group={use_group}"
                    if sizes[0] == sizes[1] or use_group:
                        for name in expected:
                            close(got[name], expected[name], f"{what}: grad of {name}")
                        # The mean over the ranks of the returned values is the loss of the whole batch.
                        mean_value = value.detach().clone()
                        dist.all_reduce(mean_value)
                        close(mean_value / world, reference(x_all[:n], y_all[:n]).detach(), f"{what}: value")
                    else:
                        # Without group= unequal batches get the wrong gradient: the check above can fail.
                        assert any(not torch.allclose(got[name], expected[name]) for name in expected), what

    # NormalizedSGD under DDP: no collective of its own, the trajectory of the whole batch (unequal batches).
    sizes = (11, 5)
    reference = Net("cvar", alpha=0.3)
    ddp = DDP(Net("cvar", alpha=0.3, group=group))
    for backend in BACKENDS:
        with _backend.forced_backend(backend):
            ref_opt = dro_ext.NormalizedSGD(reference.parameters(), lr=0.05, momentum=0.8, weight_decay=0.01)
            opt = dro_ext.NormalizedSGD(ddp.parameters(), lr=0.05, momentum=0.8, weight_decay=0.01)
            calls = []
            original = dist.all_reduce
            for step in range(3):
                ref_opt.zero_grad()
                reference(x_all, y_all).backward()
                ref_opt.step()
                opt.zero_grad()
                ddp(split(x_all, sizes, rank), split(y_all, sizes, rank)).backward()
                dist.all_reduce = lambda *a, **kw: calls.append(a) or original(*a, **kw)
                try:
                    opt.step()
                finally:
                    dist.all_reduce = original
            assert not calls, f"NormalizedSGD.step issued {len(calls)} all-reduces under DDP"
            for (name, p), q in zip(ddp.module.named_parameters(), reference.parameters()):
                close(p, q, f"DDP + NormalizedSGD ({backend}) after 3 steps: {name}", rtol=1e-10, atol=1e-12)

    # A NaN loss on one rank: every rank's gradients, then parameters, are NaN (no silent divergence).
    ddp = DDP(Net("chi2"))
    opt = dro_ext.NormalizedSGD(ddp.parameters(), lr=0.05)
    x, y = split(x_all, (8, 8), rank).clone(), split(y_all, (8, 8), rank)
    if rank == 1:
        x[3, 2] = float("nan")
    ddp(x, y).backward()
    opt.step()
    for name, p in ddp.module.named_parameters():
        assert torch.isnan(p.grad).any(), f"rank {rank}: the NaN loss of rank 1 left {name}.grad finite"
        assert torch.isnan(p).any(), f"rank {rank}: the NaN loss of rank 1 left {name} finite"


def job_loss_compile(rank, world):
    # DROLoss(group=) under torch.compile(fullgraph=True): the count all-reduce is a functional collective.
    group = dist.group.WORLD
    torch.manual_seed(rank)
    losses = torch.rand(5 + 3 * rank, dtype=torch.float64, requires_grad=True)
    module = dro_ext.DROLoss("chi2", 0.5, eta_init=0.2, group=group).double()
    eager = module(losses)
    (g_eager,) = torch.autograd.grad(eager, losses)
    compiled = torch.compile(module, fullgraph=True, backend="aot_eager")
    value = compiled(losses)
    (g_compiled,) = torch.autograd.grad(value, losses)
    close(value, eager, "compiled DROLoss(group=) value")
    close(g_compiled, g_eager, "compiled DROLoss(group=) grad")
    close(dro_dist.batch_scale(5 + 3 * rank, group, "cpu"), 2 * (5 + 3 * rank) / 13.0, "batch_scale")
    close(dro_dist.batch_scale(torch.tensor(5 + 3 * rank), group, "cpu"), 2 * (5 + 3 * rank) / 13.0,
          "batch_scale of a tensor count")
    # A rank that refused, seen where the others do not raise (a compiled step; a device, where reading the refusal
    # would be a host sync): their factor is NaN, not the 0 that made their loss 0 with zero gradients.
    if rank == 1:
        dro_dist.batch_scale(0, group, "cpu", refused=True)
    else:
        compiling = torch.compiler.is_compiling
        torch.compiler.is_compiling = lambda: True
        try:
            factor = dro_dist.batch_scale(5, group, "cpu")
        finally:
            torch.compiler.is_compiling = compiling
        assert torch.isnan(factor), f"a refusal on rank 1 gave rank 0 the factor {factor}"


# ---------------------------------------------------------------------------------------------------
# FSDP2: NormalizedSGD on sharded parameters (eta unsharded in the same group) follows the unsharded run
# ---------------------------------------------------------------------------------------------------


def build_model(dtype):
    torch.manual_seed(99)
    # Odd sizes: shards of unequal length, and rank 1 holds an empty shard of the last layer.
    model = nn.Sequential(nn.Linear(6, 5), nn.Tanh(), nn.Linear(5, 3), nn.Tanh(), nn.Linear(3, 1)).to(dtype)
    eta = nn.Parameter(torch.tensor(0.25, dtype=dtype))
    return model, eta


def shard(model, mesh):
    from torch.distributed.fsdp import fully_shard

    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def synthetic_grads(step, shapes, dtype):
    gen = torch.Generator().manual_seed(1000 + step)
    return [torch.randn(shape, generator=gen, dtype=torch.float64).to(dtype) for shape in shapes]


def set_grads(params, full_grads, mesh):
    from torch.distributed.tensor import DTensor, distribute_tensor

    for p, g in zip(params, full_grads):
        p.grad = distribute_tensor(g, mesh, p.placements) if isinstance(p, DTensor) else g.clone()


def full(p):
    from torch.distributed.tensor import DTensor

    return (p.full_tensor() if isinstance(p, DTensor) else p).detach()


def job_fsdp(rank, world):
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world,))
    configs = [(b, norm, torch.float64, 0.0, False) for b in BACKENDS for norm in ("global", "tensor")]
    configs += [(b, "global", torch.float32, 0.05, True) for b in BACKENDS]
    for backend, norm, dtype, weight_decay, maximize in configs:
        what = f"FSDP2 NormalizedSGD {backend} norm={norm} {dtype} wd={weight_decay} maximize={maximize}"
        tol = dict(rtol=1e-12, atol=1e-13) if dtype == torch.float64 else dict(rtol=2e-6, atol=2e-6)
        with _backend.forced_backend(backend):
            ref_model, ref_eta = build_model(dtype)
            model, eta = build_model(dtype)
            shard(model, mesh)
            ref_params = [*ref_model.parameters(), ref_eta]
            params = [*model.parameters(), eta]
            shapes = [p.shape for p in ref_params]
            kw = dict(lr=0.1, momentum=0.7, norm=norm, weight_decay=weight_decay, maximize=maximize)
            ref_opt = dro_ext.NormalizedSGD(ref_params, **kw)
            opt = dro_ext.NormalizedSGD(params, **kw)
            calls = []
            original = dist.all_reduce
            for step in range(5):
                grads = synthetic_grads(step, shapes, dtype)
                for p, g in zip(ref_params, grads):
                    p.grad = g.clone()
                ref_opt.step()
                set_grads(params, grads, mesh)
                dist.all_reduce = lambda *a, **k: calls.append(a) or original(*a, **k)
                try:
                    opt.step()
                finally:
                    dist.all_reduce = original
                for i, (p, q) in enumerate(zip(params, ref_params)):
                    close(full(p), q, f"{what}: param {i} after step {step + 1}", **tol)
            assert len(calls) == 5, f"{what}: {len(calls)} all-reduces in 5 steps, expected one per step"
            if norm == "global" and dtype == torch.float64:
                # GradScaler: scaled gradients are unscaled in the step; a found inf skips it entirely.
                grads = synthetic_grads(5, shapes, dtype)
                for p, g in zip(ref_params, grads):
                    p.grad = g.clone()
                ref_opt.step()
                set_grads(params, [g * 4.0 for g in grads], mesh)
                opt.grad_scale, opt.found_inf = torch.tensor(4.0), torch.tensor(0.0)
                opt.step()
                before = [full(p).clone() for p in params]
                opt.found_inf = torch.tensor(1.0)
                opt.step()
                del opt.grad_scale, opt.found_inf
                for i, (p, q, b) in enumerate(zip(params, ref_params, before)):
                    close(full(p), q, f"{what}: param {i} after a grad_scale step", **tol)
                    close(full(p), b, f"{what}: param {i} moved on a found_inf step", rtol=0, atol=0)
                    assert float(opt.state[p]["step"]) == 6.0, f"{what}: found_inf step counted"
            for i, (p, q) in enumerate(zip(params, ref_params)):
                close(full(opt.state[p]["momentum_buffer"]), ref_opt.state[q]["momentum_buffer"],
                      f"{what}: momentum {i}", **tol)

    # Half params under a momentum far below lr / 65504: the step's factor lr / (||m|| + eps) lies past float16's
    # range though the step does not; formed in float32 and rounded once, as the unsharded steps form it (rounded to
    # the params' dtype first, it made a float16 step inf and NaN, and a bfloat16 one off by its rounding).
    for backend in BACKENDS:
        for dtype in (torch.float16, torch.bfloat16):
            for options in (dict(), dict(foreach=True)):
                what = f"FSDP2 NormalizedSGD {backend} {dtype} {options}, a momentum of 2e-7"
                with _backend.forced_backend(backend):
                    ref_model, _ = build_model(dtype)
                    model, _ = build_model(dtype)
                    shard(model, mesh)
                    ref_params, params = list(ref_model.parameters()), list(model.parameters())
                    grads = [torch.full(p.shape, 2e-7, dtype=dtype) for p in ref_params]
                    grads[0][0, 0] = 0.0  # a zero entry: 0 times the factor, NaN where it was inf
                    for p, g in zip(ref_params, grads):
                        p.grad = g.clone()
                    set_grads(params, grads, mesh)
                    dro_ext.NormalizedSGD(ref_params, lr=0.1, weight_decay=0.01, **options).step()
                    dro_ext.NormalizedSGD(params, lr=0.1, weight_decay=0.01, **options).step()
                    for i, (p, q) in enumerate(zip(params, ref_params)):
                        close(full(p), q, f"{what}: param {i}", rtol=0, atol=0)

    # A single process's optimizer state_dict loaded into the sharded model's optimizer (whole momenta beside local
    # shards): refused on every rank at the step, before any collective. The foreach step broadcast a gradient
    # shard into a whole momentum on one rank and waited in the norm's all-reduce on the other.
    for options in (dict(), dict(foreach=True)):
        ref_model, _ = build_model(torch.float64)
        model, _ = build_model(torch.float64)
        shard(model, mesh)
        ref_params, params = list(ref_model.parameters()), list(model.parameters())
        grads = synthetic_grads(0, [p.shape for p in ref_params], torch.float64)
        for p, g in zip(ref_params, grads):
            p.grad = g.clone()
        ref_opt = dro_ext.NormalizedSGD(ref_params, lr=0.1, **options)
        ref_opt.step()
        opt = dro_ext.NormalizedSGD(params, lr=0.1, **options)
        opt.load_state_dict(ref_opt.state_dict())
        set_grads(params, grads, mesh)
        before = [full(p).clone() for p in params]
        try:
            opt.step()
        except ValueError as exc:
            assert "set_optimizer_state_dict" in str(exc), exc
        else:
            raise AssertionError(f"FSDP2 NormalizedSGD {options} stepped from a single process's state")
        assert all(torch.equal(full(p), b) for p, b in zip(params, before)), "a refused step moved the params"

    # HSDP (a 2-D mesh: replicate x shard): the norm is reduced over the shard dim only, never double
    # counted over the replicas. On 2 ranks: 2 replicas of a 1-way shard, then 1 replica of a 2-way shard.
    for shape in ((world, 1), (1, world)):
        mesh2 = init_device_mesh("cpu", shape, mesh_dim_names=("replicate", "shard"))
        ref_model, ref_eta = build_model(torch.float64)
        model, eta = build_model(torch.float64)
        shard(model, mesh2)
        ref_params, params = [*ref_model.parameters(), ref_eta], [*model.parameters(), eta]
        placements = params[0].placements
        assert len(placements) == 2 and placements[0].is_replicate() and placements[1].is_shard(), placements
        shapes = [p.shape for p in ref_params]
        ref_opt = dro_ext.NormalizedSGD(ref_params, lr=0.1, momentum=0.5)
        opt = dro_ext.NormalizedSGD(params, lr=0.1, momentum=0.5)
        for step in range(2):
            grads = synthetic_grads(step, shapes, torch.float64)
            for p, g in zip(ref_params, grads):
                p.grad = g.clone()
            ref_opt.step()
            set_grads(params, grads, mesh2)
            opt.step()
        for i, (p, q) in enumerate(zip(params, ref_params)):
            close(full(p), q, f"HSDP mesh {shape}: param {i} after 2 steps", rtol=1e-12, atol=1e-13)
        # Options set on the group after construction are refused by the sharded step too (on every rank alike,
        # before any collective), which passes the fused op its own eps, weight_decay and norm.
        before = [full(p).clone() for p in params]
        for option, value in (("eps", -1.0), ("weight_decay", -1.0), ("norm", "layer")):
            saved = opt.param_groups[0][option]
            opt.param_groups[0][option] = value
            try:
                opt.step()
            except ValueError as exc:
                assert f"{option} must be" in str(exc), exc
            else:
                raise AssertionError(f"HSDP mesh {shape}: the sharded step took {option}={value!r}")
            opt.param_groups[0][option] = saved
        assert all(torch.equal(full(p), b) for p, b in zip(params, before)), "a refused step moved the params"

    # A real FSDP2 backward: DROLoss(group=) on unequal local batches, eta beside the sharded weights
    # (average_gradients reduces its gradient), follows single-process training on the whole batch.
    group = dist.group.WORLD
    gen = torch.Generator().manual_seed(5)
    x_all, y_all = torch.randn(13, 6, generator=gen, dtype=torch.float64), torch.rand(13, generator=gen).double()
    sizes = (9, 4)
    for backend in BACKENDS:
        with _backend.forced_backend(backend):
            ref_model, _ = build_model(torch.float64)
            model, _ = build_model(torch.float64)
            shard(model, mesh)
            ref_dro = dro_ext.DROLoss("kl", 0.7, eta_init=0.1).double()
            dro = dro_ext.DROLoss("kl", 0.7, eta_init=0.1, group=group).double()
            ref_opt = dro_ext.NormalizedSGD([*ref_model.parameters(), *ref_dro.parameters()], lr=0.05)
            opt = dro_ext.NormalizedSGD([*model.parameters(), *dro.parameters()], lr=0.05)
            x, y = split(x_all, sizes, rank), split(y_all, sizes, rank)
            for step in range(3):
                ref_opt.zero_grad()
                ref_dro((ref_model(x_all).squeeze(1) - y_all) ** 2).backward()
                ref_opt.step()
                opt.zero_grad()
                dro((model(x).squeeze(1) - y) ** 2).backward()
                dro_dist.average_gradients(dro.parameters(), group)
                opt.step()
            for i, (p, q) in enumerate(zip([*model.parameters(), dro.eta], [*ref_model.parameters(), ref_dro.eta])):
                close(full(p), q, f"FSDP2 training ({backend}): param {i} after 3 steps", rtol=1e-10, atol=1e-12)

    # torch.distributed.checkpoint round trip of the sharded optimizer state: 2 steps, save, load into a
    # fresh model and optimizer, 3 more steps == 5 uninterrupted steps.
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    directory = sys.argv[4] + ".ckpt"
    runs = []
    for resume in (False, True):
        model, eta = build_model(torch.float64)
        shard(model, mesh)
        holder = nn.ParameterDict({"eta": eta})
        net = nn.ModuleDict({"model": model, "dro": holder})
        opt = dro_ext.NormalizedSGD(net.parameters(), lr=0.1, momentum=0.6)
        params = list(net.parameters())
        shapes = [full(p).shape for p in params]
        for step in range(5):
            if resume and step == 2:
                model_sd, optim_sd = get_state_dict(net, opt)
                dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=directory)
                model, eta = build_model(torch.float64)
                model[0].weight.data.fill_(123.0)  # a fresh model that must be overwritten by the load
                shard(model, mesh)
                net = nn.ModuleDict({"model": model, "dro": nn.ParameterDict({"eta": eta})})
                opt = dro_ext.NormalizedSGD(net.parameters(), lr=0.1, momentum=0.6)
                model_sd, optim_sd = get_state_dict(net, opt)
                state = {"model": model_sd, "optim": optim_sd}
                dcp.load(state, checkpoint_id=directory)
                set_state_dict(net, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
                params = list(net.parameters())
            set_grads(params, synthetic_grads(step, shapes, torch.float64), mesh)
            opt.step()
        runs.append([full(p) for p in params])
    for i, (a, b) in enumerate(zip(*runs)):
        close(a, b, f"DCP round trip: param {i}", rtol=0, atol=0)


# ---------------------------------------------------------------------------------------------------
# robust_objective, worst_case_weights, weight_stats and evaluate over the losses of every rank
# ---------------------------------------------------------------------------------------------------


def job_robust(rank, world):
    group = dist.group.WORLD
    gen = torch.Generator().manual_seed(11)
    base = torch.randn(57, generator=gen, dtype=torch.float64).exp()
    ties = torch.tensor([0.5, 1.0, 1.0, 1.0, 2.0, 2.0, 0.5, 1.0, 3.0, 1.0, -0.0, 0.0], dtype=torch.float64)
    cases = {
        "unequal": (base, (37, 20)),
        "one rank empty": (base[:23], (23, 0)),
        "ties": (ties, (5, 7)),
        "equal": (base[:40] * 30 - 10, (20, 20)),
    }
    group_ids_all = torch.randint(0, 4, (57,), generator=gen)
    # The distributed path is the same on both backends (float64 torch ops); the single-process answers
    # it must equal come from each backend.
    for divergence in dro_ext.DIVERGENCES:
        params = PARAMS.get(divergence, {})
        for case, (all_losses, sizes) in cases.items():
            for dtype, lam in ((torch.float64, 0.3), (torch.float64, 2.0), (torch.float32, 0.3)):
                tol = dict(rtol=1e-12, atol=1e-13) if dtype == torch.float64 else dict(rtol=1e-4, atol=1e-6)
                x_all = all_losses.to(dtype)
                x = split(x_all, sizes, rank).clone().requires_grad_(True)
                value, eta = dro_ext.robust_objective(x, lam, divergence, group=group, **params)
                # Danskin: each rank's losses get their share of the worst-case distribution.
                (grad,) = torch.autograd.grad(value * 3.0, x)
                q = dro_ext.worst_case_weights(x, lam, divergence, group=group, **params)
                ids_all = group_ids_all[:x_all.numel()]
                ids = split(ids_all, sizes, rank)
                stats = dro_ext.weight_stats(losses=x, lam=lam, divergence=divergence, groups=ids, num_groups=4,
                                             group=group, **params)
                # (an empty rank included: it has no weights of its own and still takes part)
                stats_at = dro_ext.weight_stats(losses=x, eta=0.7, lam=lam, divergence=divergence, group=group,
                                                **params)
                for backend in BACKENDS:
                    what = f"{backend} {divergence} {case} {dtype} lam={lam}"
                    with _backend.forced_backend(backend):
                        x_ref = x_all.clone().requires_grad_(True)
                        ref_value, ref_eta = dro_ext.robust_objective(x_ref, lam, divergence, **params)
                        (ref_grad,) = torch.autograd.grad(ref_value * 3.0, x_ref)
                        ref_q = dro_ext.worst_case_weights(x_ref, lam, divergence, **params)
                        ref_stats = dro_ext.weight_stats(losses=x_ref, lam=lam, divergence=divergence, groups=ids_all,
                                                         num_groups=4, **params)
                        ref_stats_at = dro_ext.weight_stats(losses=x_ref, eta=0.7, lam=lam, divergence=divergence,
                                                            **params)
                    assert value.dtype == ref_value.dtype and eta.dtype == ref_eta.dtype, what
                    close(value, ref_value, f"{what}: value", **tol)
                    close(eta, ref_eta, f"{what}: eta*", rtol=tol["rtol"] * 100, atol=tol["atol"] * 100)
                    close(grad, split(ref_grad, sizes, rank), f"{what}: grad", **tol)
                    close(q, split(ref_q, sizes, rank), f"{what}: worst_case_weights", **tol)
                    close(dro_ext.weight_stats(q, group=group)[0], dro_ext.weight_stats(ref_q)[0],
                          f"{what}: weight_stats(weights) ess", **tol)
                    if dtype == torch.float32:
                        continue  # zero_fraction counts float32 underflows, which depend on the rounding of eta*
                    for field, a, b in zip(ref_stats._fields, stats, ref_stats):
                        close(a, b, f"{what}: weight_stats {field}", **tol)
                    for field, a, b in zip(ref_stats._fields[:3], stats_at, ref_stats_at):
                        close(a, b, f"{what}: weight_stats at eta {field}", **tol)

    # Every weight 0 (cvar at an eta above every loss): NaN statistics, as in one process (ZeroDivisionError before).
    for sizes in ((37, 20), (23, 0)):
        x_all = base[:sum(sizes)]
        x, ids = split(x_all, sizes, rank), split(group_ids_all[:sum(sizes)], sizes, rank)
        at = dict(eta=float(x_all.max()) + 1.0, lam=0.5, divergence="cvar", alpha=0.3)
        ref = dro_ext.weight_stats(losses=x_all, **at)
        assert math.isnan(ref.ess) and math.isnan(ref.max_weight) and ref.zero_fraction == 1, ref
        for stats in (dro_ext.weight_stats(losses=x, group=group, **at),
                      dro_ext.weight_stats(losses=x, groups=ids, num_groups=4, over="groups", group=group, **at)):
            assert math.isnan(stats.ess) and math.isnan(stats.max_weight) and stats.zero_fraction == 1, stats

    # A negative weight or a bad group id on one rank only: every rank raises, after the collectives (the rank that
    # raised before them left the other waiting there), and the next collective still pairs up.
    w = torch.tensor([1.0, 2.0, 0.5], dtype=torch.float64)
    for bad_w, ids, exc in ((torch.tensor([1.0, -2.0, 0.5], dtype=torch.float64), None, ValueError),
                            (w, torch.tensor([0, 5, 1]), IndexError)):
        mine = bad_w if rank == 1 else w
        try:
            dro_ext.weight_stats(mine, groups=None if ids is None else (ids if rank == 0 else torch.tensor([0, 1, 1])),
                                 num_groups=None if ids is None else 3, group=group)
        except exc as error:
            assert "weights must be >= 0" in str(error) or "outside [0, num_groups)" in str(error), error
        else:
            raise AssertionError(f"rank {rank}: weight_stats with a bad input on one rank did not raise {exc}")
    close(dro_ext.weight_stats(w, group=group).ess, dro_ext.weight_stats(torch.cat([w, w])).ess,
          "weight_stats after the errors", rtol=1e-15, atol=0)

    # DROLoss(group=) with an empty rank: its share is 0, and the ranks' gradients averaged (as DDP averages them)
    # are the single-process gradients on the concatenated batch (dro_loss raised on the empty rank before, and
    # the other rank waited in batch_scale's all-reduce).
    for divergence in dro_ext.DIVERGENCES:
        params = PARAMS.get(divergence, {})
        x_all = base[:23]
        criterion = dro_ext.DROLoss(divergence, 0.5, eta_init=0.8, group=group, **params).double()
        x = split(x_all, (23, 0), rank).clone().requires_grad_(True)
        value = criterion(x)
        grad_x, grad_eta = torch.autograd.grad(value, (x, criterion.eta))
        grad_eta = grad_eta.clone()
        dist.all_reduce(grad_eta)
        reference = dro_ext.DROLoss(divergence, 0.5, eta_init=0.8, **params).double()
        x_ref = x_all.clone().requires_grad_(True)
        ref_grad_x, ref_grad_eta = torch.autograd.grad(reference(x_ref), (x_ref, reference.eta))
        close(grad_x / world, split(ref_grad_x, (23, 0), rank), f"DROLoss empty rank {divergence}: grad")
        close(grad_eta / world, ref_grad_eta, f"DROLoss empty rank {divergence}: grad eta")

    # DROLoss(group=)(losses, mask=): equal local batches (padded), unequal kept counts; the ranks' gradients
    # averaged are the single-process gradients of the kept samples of the concatenated batch, and their values
    # average to its loss.
    for divergence in dro_ext.DIVERGENCES:
        params = PARAMS.get(divergence, {})
        x_all, keep_all = base[:40], torch.arange(40) % 7 < 2
        keep_all[:20] = torch.arange(20) % 5 != 0  # rank 0 keeps 16 of its 20, rank 1 about a third of its 20
        criterion = dro_ext.DROLoss(divergence, 0.5, eta_init=0.8, group=group, **params).double()
        x = split(x_all, (20, 20), rank).clone().requires_grad_(True)
        value = criterion(x, mask=split(keep_all, (20, 20), rank))
        grad_x, grad_eta = torch.autograd.grad(value, (x, criterion.eta))
        total = torch.stack([value.detach(), grad_eta])
        dist.all_reduce(total)
        reference = dro_ext.DROLoss(divergence, 0.5, eta_init=0.8, **params).double()
        x_ref = x_all[keep_all].clone().requires_grad_(True)
        ref_value = reference(x_ref)
        ref_grad_x, ref_grad_eta = torch.autograd.grad(ref_value, (x_ref, reference.eta))
        want_x = torch.zeros(40, dtype=torch.float64).masked_scatter(keep_all, ref_grad_x)
        close(total[0] / world, ref_value, f"DROLoss masked {divergence}: value")
        close(grad_x / world, split(want_x, (20, 20), rank), f"DROLoss masked {divergence}: grad")
        close(total[1] / world, ref_grad_eta, f"DROLoss masked {divergence}: grad eta")

    # evaluate: each rank its own loader (rank 1's loader holds nothing in the second round).
    torch.manual_seed(3)  # the same model on every rank
    model = nn.Linear(3, 1).double()
    gen = torch.Generator().manual_seed(3)
    data = [(torch.randn(n, 3, generator=gen, dtype=torch.float64), torch.randn(n, generator=gen, dtype=torch.float64))
            for n in (4, 7, 5)]
    loss_fn = lambda m, b: (m(b[0]).squeeze(1) - b[1]) ** 2  # noqa: E731
    for mine in ((data[:1], data[1:]), (data, [])):
        got = dro_ext.evaluate(model, mine[rank], loss_fn, 0.5, "cvar", alpha=0.3, progress=False, group=group)
        ref = dro_ext.evaluate(model, data, loss_fn, 0.5, "cvar", alpha=0.3, progress=False)
        # A rank whose loader is empty returns the dtype of the others' losses (it returned the default dtype, float32
        # here, rounding the value the others returned in float64).
        assert got[0].dtype == torch.float64, got[0].dtype
        close(got[0], ref[0], "evaluate value", rtol=1e-12, atol=0)
        close(got[1], ref[1], "evaluate eta*", rtol=1e-12, atol=0)
    # Losses of different dtypes on the ranks: every rank returns the dtype they promote to.
    halves = [tuple(t.float() if torch.is_floating_point(t) else t for t in batch) for batch in data[:1]]
    got = dro_ext.evaluate(model.float() if rank == 0 else model, halves if rank == 0 else data[1:], loss_fn, 0.5,
                           "cvar", alpha=0.3, progress=False, group=group)
    model.double()
    assert got[0].dtype == got[1].dtype == torch.float64, (got[0].dtype, got[1].dtype)
    close(got[0], dro_ext.evaluate(model, data, loss_fn, 0.5, "cvar", alpha=0.3, progress=False)[0],
          "evaluate value over float32 and float64 losses", rtol=1e-6, atol=0)

    # NaN on one rank: every rank gets NaN (value, eta*, weights, stats).
    for divergence in dro_ext.DIVERGENCES:
        params = PARAMS.get(divergence, {})
        x = split(base, (37, 20), rank).clone()
        if rank == 1:
            x[4] = float("nan")
        value, eta = dro_ext.robust_objective(x, 0.5, divergence, group=group, **params)
        assert torch.isnan(value) and torch.isnan(eta), f"rank {rank} {divergence}: NaN on rank 1 gave {value}"
        q = dro_ext.worst_case_weights(x, 0.5, divergence, group=group, **params)
        assert torch.isnan(q).all(), f"rank {rank} {divergence}: NaN on rank 1 left weights finite"
        stats = dro_ext.weight_stats(losses=x, eta=0.5, lam=0.5, divergence=divergence, group=group, **params)
        assert all(torch.isnan(s) for s in stats[:2]), f"rank {rank} {divergence}: stats {stats}"

    # A second derivative raises (it would need how eta* moves with the losses), as in one process, on every rank
    # alike (nothing collective in it); the recorded first derivative is the plain one.
    x = split(base, (37, 20), rank).clone().requires_grad_(True)
    (plain,) = torch.autograd.grad(dro_ext.robust_objective(x, 0.5, "kl", group=group)[0], x)
    (recorded,) = torch.autograd.grad(dro_ext.robust_objective(x, 0.5, "kl", group=group)[0], x, create_graph=True)
    close(recorded, plain, "robust_objective(group=) recorded gradient", rtol=0, atol=0)
    try:
        torch.autograd.grad((recorded * torch.arange(recorded.numel(), dtype=recorded.dtype)).sum(), x)
    except RuntimeError as exc:
        assert "derivative for dro_ext::robust_objective's backward is not implemented" in str(exc), exc
    else:
        raise AssertionError(f"rank {rank}: a second derivative of robust_objective(group=) did not raise")

    # A group id out of range on one rank only: every rank raises IndexError, after the all-reduce (raised before it
    # on its rank, the other rank waited there), for each function that reduces over the ranks; then the next
    # collective still pairs up.
    losses = torch.tensor([1.0, 2.0, 0.5], dtype=torch.float64)
    ids = torch.tensor([0, 7, 1]) if rank == 0 else torch.tensor([0, 1, 1])
    calls = {
        "group_dro_loss": lambda: dro_ext.group_dro_loss(losses, ids, 3, 0.5, 0.5, "kl", group=group),
        "group_dro_loss with a mask": lambda: dro_ext.group_dro_loss(
            losses, ids, 3, 0.5, 0.5, "kl", group=group, mask=torch.tensor([True, True, False])),
        "GroupDROLoss": lambda: dro_ext.GroupDROLoss(3, group=group)(losses, ids),
        "DROLoss": lambda: dro_ext.DROLoss("chi2", 0.5, num_groups=3, group=group)(losses, ids),
        "robust_objective": lambda: dro_ext.robust_objective(losses, 0.5, "kl", groups=ids, num_groups=3, group=group),
    }
    for name, call in calls.items():
        try:
            call()
        except IndexError as exc:
            assert "outside [0, num_groups)" in str(exc), (name, exc)
        else:
            raise AssertionError(f"rank {rank}: {name} with a bad id on rank 0 did not raise")
    # Inputs refused on one rank only (a 0-d loss from .squeeze() of a one-sample batch, float ids from an empty
    # rank's torch.tensor([]), a mask of another shape, groups not passed): the refusing rank raises its own error
    # after joining the collective, the other rank raises too, and the next collective still pairs up.
    one = torch.tensor([1.5], dtype=torch.float64)
    refusals = {
        "DROLoss": (lambda: dro_ext.DROLoss("chi2", 0.5, group=group)(one.squeeze() if rank == 1 else one),
                    "1-D"),
        "group_dro_loss": (lambda: dro_ext.group_dro_loss(
            torch.empty(0) if rank == 1 else losses, torch.tensor([]) if rank == 1 else ids.clamp(max=2), 3, 0.5,
            0.5, "kl", group=group), "int32 or int64"),
        "GroupDROLoss": (lambda: dro_ext.GroupDROLoss(3, group=group, mode="greedy_cvar", alpha=0.5)(
            losses, ids.clamp(max=2), mask=torch.ones(2 if rank == 0 else 3, dtype=torch.bool)), "mask"),
        "DROLoss(num_groups)": (lambda: dro_ext.DROLoss("chi2", 0.5, num_groups=3, group=group)(
            losses, ids.clamp(max=2) if rank == 0 else None), "groups is required"),
        # The settings too (they were checked before the collective: the other rank waited there).
        "group_dro_loss, a negative weight": (lambda: dro_ext.group_dro_loss(
            losses, ids.clamp(max=2), 3, 0.5, 0.5, "kl", weighting=[1.0, -1.0 if rank == 1 else 1.0, 1.0],
            group=group), ">= 0"),
        "group_dro_loss, a population count of 0": (lambda: dro_ext.group_dro_loss(
            losses, ids.clamp(max=2), 3, 0.5, 0.5, "kl", weighting="population",
            group_counts=[3, 0 if rank == 1 else 2, 1], group=group), "group_counts"),
        "group_dro_loss, lam": (lambda: dro_ext.group_dro_loss(
            losses, ids.clamp(max=2), 3, 0.5, -0.5 if rank == 1 else 0.5, "kl", group=group), "lam"),
        # (an OverflowError from float() before, which the refusal did not catch)
        "group_dro_loss, lam past float64": (lambda: dro_ext.group_dro_loss(
            losses, ids.clamp(max=2), 3, 0.5, 10**400 if rank == 1 else 0.5, "kl", group=group), "lam"),
    }
    for name, (call, word) in refusals.items():
        try:
            call()
        except (TypeError, ValueError) as exc:
            want = word if rank == (0 if name == "GroupDROLoss" else 1) else "another rank"
            assert want in str(exc), (name, rank, exc)
            # The other rank names the call it made (DROLoss over groups named group_dro_loss there).
            if want == "another rank":
                assert f"dro_ext.{name.split('(')[0].split(',')[0]}:" in str(exc), (name, rank, exc)
        else:
            raise AssertionError(f"rank {rank}: {name} with inputs refused on one rank did not raise")
    # The evaluation calls likewise (their checks agreed on by one all-reduce before their first collective): inputs
    # refused on rank 1 only, the other rank raising "another rank" instead of waiting in the solver's collectives.
    fine = ids.clamp(max=2)
    model = nn.Linear(3, 1).double()
    batch = (torch.randn(4, 3, dtype=torch.float64), torch.randn(4, dtype=torch.float64),
             torch.tensor([0, 1, 2, 1]))
    loss_fn = lambda m, b: (m(b[0]).squeeze(1) - b[1]) ** 2  # noqa: E731

    def failing_loss_fn(m, b):
        if rank == 1:
            raise KeyError("the batch has no labels")  # a user's own error, raised inside the loop
        return loss_fn(m, b)

    mine = (lambda bad, good: bad if rank == 1 else good)  # noqa: E731
    evaluations = {
        "robust_objective": (lambda: dro_ext.robust_objective(mine(losses[:, None], losses), 0.5, "kl", group=group),
                             "1-D"),
        "worst_case_weights": (lambda: dro_ext.worst_case_weights(mine(fine, losses), 0.5, "cvar", alpha=0.5,
                                                                   group=group), "floating dtype"),
        "robust_objective over groups": (lambda: dro_ext.robust_objective(
            mine(torch.empty(0), losses), 0.5, "chi2", groups=mine(torch.tensor([]), fine), num_groups=3,
            group=group), "int32 or int64"),
        "worst_case_weights over groups": (lambda: dro_ext.worst_case_weights(
            losses, 0.5, "chi2", groups=mine(fine[:2], fine), num_groups=3, group=group), "shape"),
        "weight_stats": (lambda: dro_ext.weight_stats(mine(w[:, None], w), group=group), "1-D"),
        "weight_stats, groups without num_groups": (lambda: dro_ext.weight_stats(
            w, groups=mine(torch.tensor([0, 1, 1]), None), group=group), "needs num_groups"),
        "weight_stats at eta": (lambda: dro_ext.weight_stats(losses=losses, eta=mine(torch.ones(2), 0.5), lam=0.5,
                                                             group=group), "0-d"),
        "weight_stats over groups": (lambda: dro_ext.weight_stats(
            losses=losses, lam=0.5, groups=mine(None, fine), num_groups=3, over="groups", group=group), "needs"),
        "evaluate": (lambda: dro_ext.evaluate(model, [batch], mine(lambda m, b: loss_fn(m, b)[:, None], loss_fn),
                                              0.5, progress=False, group=group), "1-D"),
        "evaluate over groups": (lambda: dro_ext.evaluate(
            model, [batch], loss_fn, 0.5, groups_fn=mine(lambda b: b[2].double(), lambda b: b[2]), num_groups=3,
            progress=False, group=group), "int32 or int64"),
        "evaluate, the loss function raising": (lambda: dro_ext.evaluate(
            model, [batch], failing_loss_fn, 0.5, progress=False, group=group), "no labels"),
    }
    for name, (call, word) in evaluations.items():
        try:
            call()
        except (TypeError, ValueError, KeyError) as exc:
            want = word if rank == 1 else "another rank"
            assert want in str(exc), (name, rank, exc)
        else:
            raise AssertionError(f"rank {rank}: {name} with inputs refused on one rank did not raise")
    # Settings that differ between the ranks (each rank's own inputs fine): every rank raises, naming them, where the
    # ranks solved with their own lam before (sums of no one objective, silently) or aborted on vectors of differing
    # lengths (num_groups). The settings of a call that differs from the others' are caught alike.
    mismatches = [
        ("lam", lambda: dro_ext.robust_objective(losses, mine(0.6, 0.5), "kl", group=group)),
        ("divergence, alpha", lambda: dro_ext.worst_case_weights(losses, 0.5, mine("cvar", "chi2"),
                                                                 alpha=mine(0.5, None), group=group)),
        ("num_groups", lambda: dro_ext.robust_objective(losses, 0.5, "chi2", groups=fine, num_groups=mine(4, 3),
                                                        group=group)),
        ("k", lambda: dro_ext.weight_stats(losses=losses, lam=0.5, divergence="cressie_read", k=mine(1.5, 2.0),
                                           group=group)),
        ("the call", lambda: (dro_ext.robust_objective if rank == 1 else dro_ext.worst_case_weights)(
            losses, 0.5, "chi2", group=group)),
        # Those that decide which collectives weight_stats makes (gloo aborted the processes with SIGABRT) ...
        ("over", lambda: dro_ext.weight_stats(losses=losses, lam=0.5, groups=fine, num_groups=3,
                                              over=mine("groups", "samples"), group=group)),
        ("eta, eta's value", lambda: dro_ext.weight_stats(losses=losses, lam=0.5, eta=mine(1.0, None),
                                                          group=group)),
        # ... and those that gave each rank another answer.
        ("eta's value", lambda: dro_ext.weight_stats(losses=losses, lam=0.5, eta=mine(1.0, 2.0), group=group)),
        ("scale", lambda: dro_ext.weight_stats(losses=losses, lam=0.5, eta=1.0, scale=mine(2.0, 1.0),
                                               group=group)),
        ("weighting", lambda: dro_ext.robust_objective(losses, 0.5, "chi2", groups=fine, num_groups=3,
                                                       weighting=mine([1.0, 1.0, 5.0], "batch"), group=group)),
        ("weighting", lambda: dro_ext.worst_case_weights(losses, 0.5, "chi2", groups=fine, num_groups=3,
                                                          weighting=mine([1.0, 2.0, 3.0], [3.0, 2.0, 1.0]),
                                                          group=group)),
        # Weights with the same sum of i p_i and of p_i^2 (what the check compared before: it let these through).
        ("weighting", lambda: dro_ext.robust_objective(losses, 0.5, "kl", groups=fine, num_groups=4,
                                                       weighting=mine([1.0, 3.0, 6.0, 6.0], [2.0, 2.0, 5.0, 7.0]),
                                                       group=group)),
    ]
    for names, call in mismatches:
        try:
            call()
        except ValueError as exc:
            assert f"differ in {names};" in str(exc), (names, rank, exc)
        else:
            raise AssertionError(f"rank {rank}: ranks passing different {names} did not raise")
    # A weighting without groups is refused on every rank, as on one process (the sample-level call over the ranks
    # ignored it).
    for call in (dro_ext.robust_objective, dro_ext.worst_case_weights):
        for options in (dict(weighting="population", group_counts=[1.0, 9.0]), dict(weighting=[1.0, 2.0]),
                        dict(group_counts=[1.0, 9.0])):
            try:
                call(losses, 0.5, "kl", group=group, **options)
            except ValueError as exc:
                assert "weighting and group_counts apply over groups" in str(exc), (call, options, rank, exc)
            else:
                raise AssertionError(f"rank {rank}: {call.__name__}(group=) with {options} and no groups did not raise")
    close(dro_ext.weight_stats(w, group=group).ess, dro_ext.weight_stats(torch.cat([w, w])).ess,
          "weight_stats after the refusals", rtol=1e-15, atol=0)
    # An empty rank's float32 torch.empty(0) beside float64 losses: the reduction is in float64 (gloo aborted the
    # process on the differing sizes), and the answer is the concatenated batch's.
    mine, mine_ids = (losses, ids.clamp(max=2)) if rank == 0 else (torch.empty(0), torch.empty(0, dtype=torch.long))
    want_ids = torch.tensor([0, 2, 1])
    rtol = 1e-15 if rank == 0 else 1e-6  # each rank's value in its losses' dtype
    close(dro_ext.group_dro_loss(mine, mine_ids, 3, 0.5, 0.5, "kl", group=group).double(),
          dro_ext.group_dro_loss(losses, want_ids, 3, 0.5, 0.5, "kl"), "an empty float32 rank", rtol=rtol, atol=0)
    close(dro_ext.GroupDROLoss(3, group=group)(mine, mine_ids).double(),
          dro_ext.GroupDROLoss(3)(losses, want_ids), "GroupDROLoss beside an empty float32 rank", rtol=rtol, atol=0)
    # ... with every rank's q that of one process to the bit (the empty rank rounded the sums to float32, and its q
    # then stayed apart from the others').
    for backend in ("native", "python") if _backend.native_available() else ("python",):
        spread = dro_ext.GroupDROLoss(3, step_size=2.0, group=group).double()
        single = dro_ext.GroupDROLoss(3, step_size=2.0).double()
        with _backend.forced_backend(backend):
            for _ in range(2):  # (in thirds: sums that float32 does not hold)
                spread(mine / 3, mine_ids)
                single(losses / 3, want_ids)
        assert torch.equal(spread.log_q, single.log_q), (rank, backend, spread.log_q, single.log_q)
    # No sample on any rank: DROLoss(group=)'s loss and gradients are 0 (0/0 = NaN before), as group_dro_loss's.
    criterion = dro_ext.DROLoss("chi2", 0.5, eta_init=0.3, group=group).double()
    nothing = torch.zeros(0, dtype=torch.float64, requires_grad=True)
    value = criterion(nothing)
    value.backward()
    assert value.item() == 0.0 and criterion.eta.grad.item() == 0.0, (value, criterion.eta.grad)

    # copy.deepcopy of a model holding a group= loss (an EMA or best-model snapshot) raised "cannot pickle
    # ProcessGroup": the copy shares the group, as a DDP model's copy does, and computes what the original does.
    online = dro_ext.GroupDROLoss(3, group=group, step_size=0.7)
    holder = nn.ModuleDict({"online": online, "penalized": dro_ext.DROLoss("kl", 0.5, eta_init=0.2, group=group,
                                                                          num_groups=3)})
    online(mine, mine_ids)
    snapshot = copy.deepcopy(holder)
    assert snapshot["online"].group is group and snapshot["penalized"].group is group
    assert snapshot["online"].log_q is not online.log_q and torch.equal(snapshot["online"].log_q, online.log_q)
    for name in ("online", "penalized"):
        close(snapshot[name](mine, mine_ids), holder[name](mine, mine_ids), f"a deep copy of {name}", rtol=0, atol=0)

    # A bad id where the mask drops the sample is never read.
    masked = dro_ext.group_dro_loss(losses, ids, 3, 0.5, 0.5, "kl", group=group, mask=ids < 3)
    close(masked, dro_ext.group_dro_loss(torch.cat([losses[[0, 2]], losses]), torch.tensor([0, 1, 0, 1, 1]), 3, 0.5,
                                         0.5, "kl"), "a masked bad id", rtol=1e-14, atol=0)

    # Errors name the argument.
    try:
        dro_ext.robust_objective(torch.ones(3), 0.5, group="world")
    except TypeError as exc:
        assert "group must be a torch.distributed.ProcessGroup" in str(exc), exc
    else:
        raise AssertionError("group='world' was accepted")


# ---------------------------------------------------------------------------------------------------
# A rank that dies: the survivors get a clear error, not a hang
# ---------------------------------------------------------------------------------------------------


def job_group_robust(rank, world):
    """robust_objective, worst_case_weights and evaluate over groups with group=: every rank gets the single-process
    answer on the concatenated losses and group ids (value, eta*, q, report), and each rank's losses their share of
    its gradient, for every divergence, batch and population weighting, unequal shards and an empty one."""
    group = dist.group.WORLD
    gen = torch.Generator().manual_seed(5)
    all_losses = torch.randn(41, generator=gen, dtype=torch.float64).exp()
    all_ids = torch.randint(0, 5, (41,), generator=gen)  # group 5 of 6 absent
    weightings = {"batch": {}, "population": dict(weighting="population", group_counts=[4.0, 1.0, 3.0, 2.0, 6.0, 1.0])}
    for divergence in dro_ext.DIVERGENCES:
        params = PARAMS.get(divergence, {})
        for sizes in ((30, 11), (41, 0)):
            for wname, options in weightings.items():
                for dtype in (torch.float64, torch.float32):
                    tol = dict(rtol=1e-11, atol=1e-13) if dtype == torch.float64 else dict(rtol=1e-5, atol=1e-7)
                    x_all = all_losses.to(dtype)
                    x = split(x_all, sizes, rank).clone().requires_grad_(True)
                    ids = split(all_ids, sizes, rank)
                    kw = dict(groups=ids, num_groups=6, **options, **params)
                    value, eta = dro_ext.robust_objective(x, 0.4, divergence, group=group, **kw)
                    (grad,) = torch.autograd.grad(value * 3.0, x)
                    q = dro_ext.worst_case_weights(x, 0.4, divergence, group=group, **kw)
                    for backend in BACKENDS:
                        what = f"{backend} {divergence} {sizes} {wname} {dtype}"
                        with _backend.forced_backend(backend):
                            x_ref = x_all.clone().requires_grad_(True)
                            kw_ref = dict(groups=all_ids, num_groups=6, **options, **params)
                            ref_value, ref_eta = dro_ext.robust_objective(x_ref, 0.4, divergence, **kw_ref)
                            (ref_grad,) = torch.autograd.grad(ref_value * 3.0, x_ref)
                            ref_q = dro_ext.worst_case_weights(x_ref, 0.4, divergence, **kw_ref)
                        assert value.dtype == ref_value.dtype and eta.dtype == ref_eta.dtype, what
                        close(value, ref_value, f"{what}: value", **tol)
                        if divergence != "cvar":  # cvar's minimizers may form an interval
                            close(eta, ref_eta, f"{what}: eta*", rtol=tol["rtol"] * 100, atol=tol["atol"] * 100)
                        close(grad, split(ref_grad, sizes, rank), f"{what}: grad", **tol)
                        close(q, ref_q, f"{what}: worst_case_weights", **tol)
                    if wname != "batch" or dtype != torch.float64:
                        continue
                    # weight_stats over groups (batch weighting): the worst case, and the weights at a given eta.
                    stats = [dro_ext.weight_stats(losses=x, eta=eta_at, lam=0.4, divergence=divergence, groups=ids,
                                                  num_groups=6, group=group, over="groups", **params)
                             for eta_at in (None, 1.1)]
                    for backend in BACKENDS:
                        with _backend.forced_backend(backend):
                            ref_stats = [dro_ext.weight_stats(losses=x_all, eta=eta_at, lam=0.4, divergence=divergence,
                                                              groups=all_ids, num_groups=6, over="groups", **params)
                                         for eta_at in (None, 1.1)]
                        for got, want, at in zip(stats, ref_stats, ("worst case", "eta 1.1")):
                            for field in got._fields:
                                close(getattr(got, field), getattr(want, field),
                                      f"{backend} {divergence} {sizes} weight_stats over groups, {at}: {field}", **tol)

    # evaluate over groups: each rank its own loader (rank 1's empty in the second round)
    torch.manual_seed(3)
    model = nn.Linear(3, 1).double()
    gen = torch.Generator().manual_seed(3)
    data = [(torch.randn(n, 3, generator=gen, dtype=torch.float64), torch.randn(n, generator=gen, dtype=torch.float64),
             torch.randint(0, 3, (n,), generator=gen)) for n in (4, 7, 5)]
    loss_fn = lambda m, b: (m(b[0]).squeeze(1) - b[1]) ** 2  # noqa: E731
    reductions = []
    all_reduce_group_sums = dro_ext.groups._all_reduce_group_sums

    def counted(*args, **kwargs):
        reductions.append(1)
        return all_reduce_group_sums(*args, **kwargs)

    for mine in ((data[:1], data[1:]), (data, [])):
        dro_ext.groups._all_reduce_group_sums, reductions[:] = counted, []
        try:
            got = dro_ext.evaluate(model, mine[rank], loss_fn, 0.5, "chi2", groups_fn=lambda b: b[2], num_groups=4,
                                   progress=False, group=group)
        finally:
            dro_ext.groups._all_reduce_group_sums = all_reduce_group_sums
        # The report's group means are those the objective was solved over: the sums cross the ranks once.
        assert len(reductions) == 1, f"evaluate over groups all-reduced the group sums {len(reductions)} times"
        ref = dro_ext.evaluate(model, data, loss_fn, 0.5, "chi2", groups_fn=lambda b: b[2], num_groups=4,
                               progress=False)
        assert got.value.dtype == got.group_loss.dtype == torch.float64, (got.value.dtype, got.group_loss.dtype)
        for field in ("value", "eta_star", "group_loss", "worst_group_loss"):
            close(getattr(got, field), getattr(ref, field), f"evaluate {field}", rtol=1e-12, atol=0)
        assert got.group_count.tolist() == ref.group_count.tolist() and got.worst_group == ref.worst_group
    # No rank holds a loss: every rank raises, as over samples (it returned NaN with group 0 as the worst).
    for groups_fn, num_groups in ((None, None), (lambda b: b[2], 4)):
        try:
            dro_ext.evaluate(model, [], loss_fn, 0.5, "chi2", groups_fn=groups_fn, num_groups=num_groups,
                             progress=False, group=group)
        except ValueError as e:
            assert "dro_ext.evaluate: the losses of every rank together are empty" in str(e), e
        else:
            raise AssertionError(f"evaluate over no loss on any rank (num_groups={num_groups}) did not raise")
    # ... and robust_objective and worst_case_weights over groups (they returned NaN).
    nothing, no_ids = torch.empty(0, dtype=torch.float64), torch.empty(0, dtype=torch.long)
    for call in (dro_ext.robust_objective, dro_ext.worst_case_weights):
        for options in ({}, dict(weighting="population", group_counts=[1.0, 2.0, 3.0, 4.0])):
            try:
                call(nothing, 0.5, "chi2", groups=no_ids, num_groups=4, group=group, **options)
            except ValueError as e:
                assert f"dro_ext.{call.__name__}: the losses of every rank together are empty" in str(e), e
            else:
                raise AssertionError(f"{call.__name__} over groups with no loss on any rank did not raise")
    # weight_stats over samples takes the worst case from worst_case_weights, whose errors named that call.
    try:
        dro_ext.weight_stats(losses=nothing, lam=0.5, group=group)
    except ValueError as e:
        assert "dro_ext.weight_stats: the losses of every rank together are empty" in str(e), e
    else:
        raise AssertionError("weight_stats with no loss on any rank did not raise")


def job_dies(rank, world):
    losses = torch.rand(10, dtype=torch.float64)
    dro_ext.robust_objective(losses, 0.5, "chi2", group=dist.group.WORLD)  # a healthy first call
    dist.barrier()
    if rank == 1:
        os._exit(3)  # dies without a word, as a crashed or killed process would
    calls = {  # each raises naming its function, the training objectives' functional collectives included
        "robust_objective": lambda: dro_ext.robust_objective(losses, 0.5, "smoothed_cvar", alpha=0.2,
                                                             group=dist.group.WORLD),
        "DROLoss": lambda: dro_ext.DROLoss("chi2", 0.5, group=dist.group.WORLD)(losses),
        "group_dro_loss": lambda: dro_ext.group_dro_loss(losses, torch.zeros(10, dtype=torch.int64), 2, 0.1, 0.5,
                                                         group=dist.group.WORLD),
    }
    for name, call in calls.items():
        try:
            call()
        except RuntimeError as exc:
            message = str(exc)
            assert f"dro_ext.{name}" in message and "all-reduce over the process group failed" in message, message
            print("SURVIVOR-RAISED:", message.splitlines()[0][:200], flush=True)
        else:
            raise AssertionError(f"rank 0 finished {name} although rank 1 is dead")
    os._exit(0)  # the group is broken: skip destroy_process_group, which would wait on the dead peer


JOBS = {"ddp": job_ddp, "loss_compile": job_loss_compile, "fsdp": job_fsdp, "robust": job_robust, "dies": job_dies,
        "group_robust": job_group_robust}


def main():
    """Runs the comma-separated jobs in order; RESULTS (optional) gets one JSON line per job and rank.

    On the first failure the rank records it and exits at once: its peers then fail fast in their next
    collective instead of running the later jobs against a broken group.
    """
    jobs, rank, world, store_file = sys.argv[1].split(","), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
    results = sys.argv[5] if len(sys.argv) > 5 else None

    def record(job, status, detail="", seconds=0.0):
        if results is not None:
            with open(results, "a") as f:
                f.write(json.dumps({"job": job, "rank": rank, "status": status, "detail": detail,
                                    "seconds": round(seconds, 2)}) + "\n")

    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.FileStore(store_file, world), rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=COLLECTIVE_TIMEOUT))
    for job in jobs:
        start = time.perf_counter()
        try:
            JOBS[job](rank, world)
            dist.barrier()
        except BaseException:
            record(job, "failed", traceback.format_exc(), time.perf_counter() - start)
            traceback.print_exc()
            sys.stderr.flush()
            os._exit(1)
        record(job, "passed", "", time.perf_counter() - start)
        print(f"rank {rank}: {job} passed in {time.perf_counter() - start:.1f} s", flush=True)
    dist.destroy_process_group()
    exit_without_teardown(0)


def exit_without_teardown(code: int) -> None:
    """Ends the process without the interpreter's teardown. torch's functional collectives keep a gloo process
    group, and its worker threads, alive past destroy_process_group(); a worker still releasing the last
    collective's tensors when the interpreter finalizes needs the GIL there and aborts the process (SIGABRT,
    "terminate called without an active exception": seen in about one run in ten on a loaded 2-core machine,
    torch 2.14). Everything this process had to do is done and flushed."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    main()
