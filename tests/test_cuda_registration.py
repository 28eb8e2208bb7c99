"""The CUDA path, checked without a GPU:
 - every dro_ext op has a CUDA kernel in a CUDA build of the extension (the dispatcher knows which kernels are
   registered whether or not a device is visible; docs/design.md section 4, rule 4);
 - the Python layer around the ops reads nothing back to the host for CUDA tensors: run on fake CUDA tensors
   (FakeTensorMode needs no device), every public function's forward and the optimizer step are recorded op by
   op, and a host read (.item(), bool(), float(), a copy to the CPU) fails the test; so are the backward
   formulas written in Python, called directly (the autograd engine cannot run on fake CUDA tensors). The kernels'
   own host code and the C++ backward of dro_loss are left to the sync-debug tests of tests/test_cuda_*.py on a
   GPU."""
import os
import pathlib

import pytest
import torch
import torch.utils._pytree as pytree
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode

import reference as ref
from dro_ext import _backend

# Every op needs a CUDA kernel: these by name, and any other op the extension defines too (checked below).
REQUIRED_OPS = [
    "dro_loss",
    "dro_loss_backward",
    "psi_star_terms",
    "normalized_sgd_step_",
    "robust_objective",
    "robust_weights",
    "weight_stats",
    "group_sums",
    "group_sums_backward",
    "dro_cross_entropy_backward_",
    "logsumexp_columns",
]


def _extension_path():
    from dro_ext import _C

    return pathlib.Path(_C.__file__)


def _built_with_cuda() -> bool:
    """The extension links the CUDA side of torch (libc10_cuda) exactly when setup.py compiled csrc/cuda."""
    return b"libc10_cuda.so" in _extension_path().read_bytes()


# Ops on no tensors, with no device to run on: which SIMD build of the CPU kernels runs (the tests switch it).
NOT_DEVICE_OPS = {"_cpu_capability"}


def _defined_ops():
    names = torch._C._dispatch_get_all_op_names()
    ops = {n.split("::", 1)[1].split(".", 1)[0] for n in names if n.startswith("dro_ext::")}
    return sorted(ops - NOT_DEVICE_OPS)


pytestmark = [
    pytest.mark.skipif(not _backend.native_available(), reason="the dro_ext extension is not built"),
    pytest.mark.skipif(torch.version.cuda is None, reason="this torch is a CPU-only build: no CUDA kernels to check"),
]


def test_cuda_builds_when_asked():
    # DRO_EXT_CUDA=1 (as .ci/run sets) must give a CUDA build; otherwise a CPU-only build is legitimate.
    if os.environ.get("DRO_EXT_CUDA") == "1":
        assert _built_with_cuda(), f"DRO_EXT_CUDA=1 but {_extension_path().name} was built without the CUDA kernels"


@pytest.mark.parametrize("op", REQUIRED_OPS)
def test_op_has_cuda_kernel(op):
    if not _built_with_cuda():
        pytest.skip("the extension was built without CUDA (DRO_EXT_CUDA=0 or no toolkit)")
    assert f"dro_ext::{op}" in [f"dro_ext::{o}" for o in _defined_ops()], f"dro_ext::{op} is not defined"
    assert torch._C._dispatch_has_kernel_for_dispatch_key(f"dro_ext::{op}", "CUDA"), (
        f"dro_ext::{op} has no CUDA kernel")


def test_every_defined_op_has_cuda_kernel():
    if not _built_with_cuda():
        pytest.skip("the extension was built without CUDA (DRO_EXT_CUDA=0 or no toolkit)")
    ops = _defined_ops()
    assert set(REQUIRED_OPS) <= set(ops), f"missing ops: {set(REQUIRED_OPS) - set(ops)}"
    # An op defined in Python from torch ops and the other dro_ext ops (linear_cross_entropy_with_grads: matmuls
    # around the native chunk op) has one backend-agnostic kernel, which serves CUDA; its native parts are checked
    # here as ops of their own.
    missing = [op for op in ops
               if not any(torch._C._dispatch_has_kernel_for_dispatch_key(f"dro_ext::{op}", key)
                          for key in ("CUDA", "CompositeExplicitAutograd"))]
    assert not missing, f"dro_ext ops without a CUDA kernel: {missing}"


def test_cuda_tensors_route_to_native_ops():
    # With the kernels registered, the Python side sends CUDA tensors to the native ops (unless
    # DRO_EXT_FORCE_PYTHON=1): the routing decision is made from the dispatcher, without a device.
    if not _built_with_cuda():
        pytest.skip("the extension was built without CUDA (DRO_EXT_CUDA=0 or no toolkit)")
    with _backend.forced_backend("native"):
        assert _backend.native_for("cuda")
    with _backend.forced_backend("python"):
        assert not _backend.native_for("cuda")


class _HostReads(TorchDispatchMode):
    """Records every op that would bring device data to the host: a scalar read, or an op with a CUDA input and
    a CPU output (a copy to the CPU). A scalar read answers a stand-in number so that the run goes on and every
    read is found, not just the first."""

    def __init__(self):
        super().__init__()
        self.reads = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.ops.aten._local_scalar_dense.default:
            self.reads.append(func.name())
            return 1.0 if args[0].dtype.is_floating_point else (False if args[0].dtype == torch.bool else 1)
        out = func(*args, **kwargs)
        tensors_in = [t for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        tensors_out = [t for t in pytree.tree_leaves(out) if isinstance(t, torch.Tensor)]
        if any(t.device.type == "cuda" for t in tensors_in) and any(t.device.type == "cpu" for t in tensors_out):
            self.reads.append(func.name())
        return out


def _public_forwards(dev):
    """(name, thunk) for every public function's forward and the optimizer step, on tensors on `dev`."""
    import dro_ext
    from dro_ext import cross_entropy

    losses = torch.randn(1001, device=dev)
    eta = torch.zeros((), device=dev, requires_grad=True)
    calls = []
    for (div, kw), case in zip(ref.CASES, ref.CASE_IDS):
        calls += [
            (f"dro_loss[{case}]", lambda div=div, kw=kw: dro_ext.dro_loss(losses.requires_grad_(), eta, 0.5, div, **kw)),
            (f"dro_weights[{case}]", lambda div=div, kw=kw: dro_ext.dro_weights(losses, eta, 0.5, div, **kw)),
            (f"psi_star[{case}]", lambda div=div, kw=kw: dro_ext.psi_star(losses, div, **kw)),
            (f"robust_objective[{case}]", lambda div=div, kw=kw: dro_ext.robust_objective(losses, 0.5, div, **kw)),
            (f"worst_case_weights[{case}]",
             lambda div=div, kw=kw: dro_ext.worst_case_weights(losses, 0.5, div, **kw)),
        ]
    module = dro_ext.DROLoss("kl_cvar", lam=0.5, alpha=0.2)
    module.eta = torch.nn.Parameter(torch.zeros((), device=dev))  # (.to() cannot swap a fake tensor in)
    calls += [("DROLoss", lambda: module(losses)),
              ("weight_stats", lambda: dro_ext.weight_stats(losses.detach().abs())),
              ("weight_stats(losses, eta)", lambda: dro_ext.weight_stats(losses=losses, eta=eta, lam=0.5))]
    ids = torch.randint(0, 5, (1001,), device=dev)
    # The op reads its bad-id flag in C++ (validate=True); the Python layer reads nothing either way.
    calls += [("group_sums", lambda: dro_ext.group_sums(losses, ids, 5)),
              ("group_sums(validate=False)", lambda: dro_ext.group_sums(losses, ids.int(), 5, validate=False))]

    logits = torch.randn(3, 7, 50, device=dev, dtype=torch.bfloat16, requires_grad=True)
    targets = torch.randint(0, 50, (3, 7), device=dev)
    hidden = torch.randn(21, 16, device=dev, requires_grad=True)
    weight = torch.randn(50, 16, device=dev, requires_grad=True)
    bias = torch.randn(50, device=dev, requires_grad=True)
    ce_module = dro_ext.DROCrossEntropyLoss("chi2", lam=0.5, label_smoothing=0.1)
    ce_module.eta = torch.nn.Parameter(torch.zeros((), device=dev))
    calls += [
        ("dro_cross_entropy", lambda: dro_ext.dro_cross_entropy(logits, targets, eta, 0.5, "kl", ignore_index=3)),
        ("DROCrossEntropyLoss", lambda: ce_module(logits, targets)),
        ("dro_linear_cross_entropy", lambda: dro_ext.dro_linear_cross_entropy(
            hidden, weight, targets.reshape(-1), eta, 0.5, bias=bias, chunk_size=8)),
        # The op's chunk loop itself: the op above runs its fake kernel under FakeTensorMode.
        ("linear cross-entropy chunk loop", lambda: cross_entropy._linear_cross_entropy_chunks(
            hidden.detach(), weight.detach(), bias.detach(), targets.reshape(-1), eta.detach(), 0.5, "cvar", 0.3,
            None, 1.0, 3, 0.1, 8, True, True, True, True)),
    ]
    from dro_ext import cross_entropy_groups

    groups = torch.randint(0, 4, (3,), device=dev)
    calls += [
        ("dro_cross_entropy(groups=)", lambda: dro_ext.dro_cross_entropy(
            logits, targets, eta, 0.5, "kl", ignore_index=3, groups=groups, num_groups=4)),
        ("dro_linear_cross_entropy(groups=)", lambda: dro_ext.dro_linear_cross_entropy(
            hidden, weight, targets.reshape(-1), eta, 0.5, bias=bias, chunk_size=8,
            groups=groups[:, None].expand(3, 7).reshape(-1), num_groups=4)),
        # The two chunk loops themselves (the ops above run their fake kernels under FakeTensorMode).
        ("grouped linear cross-entropy passes", lambda: cross_entropy_groups._linear_row_losses_backward_op._init_fn(
            torch.rand(21, device=dev), hidden.detach(), weight.detach(), bias.detach(), targets.reshape(-1),
            cross_entropy_groups._linear_row_losses._init_fn(hidden.detach(), weight.detach(), bias.detach(),
                                                             targets.reshape(-1), 3, 0.1, 8, True)[1],
            3, 0.1, 8, True, True, True, True)),
        ("GroupDROLoss(mask=)", lambda: dro_ext.GroupDROLoss(4).to(dev)(
            torch.rand(21, device=dev), targets.reshape(-1) % 4, mask=targets.reshape(-1) != 3)),
    ]

    params = [torch.nn.Parameter(torch.randn(s, device=dev, dtype=d))
              for s, d in (((33, 5), torch.float32), ((7,), torch.bfloat16), ((4,), torch.float16))]
    for p in params:
        p.grad = torch.randn_like(p)
    plain = dro_ext.NormalizedSGD(params, lr=0.1)
    decayed = dro_ext.NormalizedSGD(params, lr=0.1, weight_decay=0.01, norm="tensor", maximize=True)
    decayed.param_groups[0]["lr"] = torch.tensor(0.05, device=dev)  # a device lr, as a scheduler may set

    def amp_step():
        plain.grad_scale, plain.found_inf = torch.full((), 1024.0, device=dev), torch.zeros((), device=dev)
        try:
            plain.step()
        finally:
            del plain.grad_scale, plain.found_inf

    calls += [("NormalizedSGD.step", plain.step), ("NormalizedSGD.step(lr tensor, decay, tensor norm)", decayed.step),
              ("NormalizedSGD.step(grad_scale, found_inf)", amp_step)]
    return calls


class _Ctx:
    """The part of an autograd ctx that the ops' Python setup_context and backward functions use."""

    def __init__(self, needs_input_grad):
        self.needs_input_grad = needs_input_grad

    def save_for_backward(self, *tensors):
        self.saved_tensors = tensors

    def mark_non_differentiable(self, *tensors):
        pass

    def set_materialize_grads(self, value):
        pass


def _python_backwards(dev):
    """(name, thunk) running setup_context on a forward's inputs and output, then backward, for each op whose
    autograd formula is written in Python (the autograd engine itself cannot run on fake CUDA tensors)."""
    from dro_ext import cross_entropy, cross_entropy_groups

    eta = torch.zeros((), device=dev)
    logits = torch.randn(21, 50, device=dev, dtype=torch.bfloat16)
    targets = torch.randint(0, 50, (21,), device=dev)
    hidden, weight, bias = torch.randn(21, 16, device=dev), torch.randn(50, 16, device=dev), torch.randn(50, device=dev)
    grad = torch.ones((), device=dev)
    ops = [
        ("dro_cross_entropy backward", cross_entropy._dro_cross_entropy_setup_context,
         cross_entropy._dro_cross_entropy_backward, torch.ops.dro_ext.dro_cross_entropy,
         (logits, targets, eta, 0.5, "kl", None, None, 1.0, 3, 0.1), (True, False, True), grad.bfloat16()),
        ("dro_linear_cross_entropy backward", cross_entropy._linear_setup_context, cross_entropy._linear_backward,
         cross_entropy._linear_cross_entropy_with_grads,
         (hidden, weight, bias, targets, eta, 0.5, "chi2", None, None, 1.0, -100, 0.0, 8, True, True, True, True,
          [hidden[:1, :1].clone()]),
         (True, True, True, False, True), grad),
        ("cross_entropy_row_losses backward", cross_entropy_groups._row_losses_setup_context,
         cross_entropy_groups._row_losses_backward, torch.ops.dro_ext.cross_entropy_row_losses,
         (logits, targets, 3, 0.1, True), (True,), torch.rand(21, device=dev)),
        ("linear_cross_entropy_row_losses backward", cross_entropy_groups._linear_row_losses_setup_context,
         cross_entropy_groups._linear_row_losses_backward, torch.ops.dro_ext.linear_cross_entropy_row_losses,
         (hidden, weight, bias, targets, -100, 0.0, 8, True), (True, True, True), torch.rand(21, device=dev)),
    ]

    def thunk(setup_context, backward, forward, inputs, needs, grad_value):
        ctx = _Ctx(needs + (False,) * (len(inputs) - len(needs)))
        setup_context(ctx, inputs, forward(*inputs))
        grads = [g for g in backward(ctx, grad_value, None) if isinstance(g, torch.Tensor)]  # (a list input: a list)
        assert len(grads) == sum(needs), "a gradient that was asked for did not come back"
        return grads
    return [(name, lambda args=args: thunk(*args)) for name, *args in ops]


def test_the_python_layer_reads_nothing_on_the_host_for_cuda_tensors():
    if not _built_with_cuda():
        pytest.skip("the extension was built without CUDA (DRO_EXT_CUDA=0 or no toolkit): CUDA tensors take "
                    "the fallback, whose robust objective iterates on the host by design")
    reads = {}
    with _backend.forced_backend("native"), FakeTensorMode():
        for name, call in _public_forwards("cuda") + _python_backwards("cuda"):
            recorder = _HostReads()
            with recorder:
                out = call()
            assert all(t.device.type == "cuda" for t in pytree.tree_leaves(out) if isinstance(t, torch.Tensor)), name
            if recorder.reads:
                reads[name] = recorder.reads
    assert not reads, f"host reads on the CUDA path: {reads}"


def test_the_host_read_recorder_sees_each_kind_of_read():
    # The recorder itself: each way of reading device data on the host is caught, and device work is not.
    with FakeTensorMode():
        x = torch.randn(5, device="cuda")
        for read in (lambda: x.sum().item(), lambda: bool(x.gt(0).any()), lambda: float(x[0]), lambda: x.cpu(),
                     lambda: x.to("cpu", torch.float64), lambda: x.tolist()):
            recorder = _HostReads()
            with recorder:
                read()
            assert recorder.reads, "a host read went unrecorded"
        recorder = _HostReads()
        with recorder:
            torch.where(x > 0, x * 2, x.new_zeros(())).sum().to(torch.float64)
        assert recorder.reads == []
