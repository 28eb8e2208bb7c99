"""The backend rule of dro_ext/_backend.py: every public function runs the compiled ops on a device type only when
they are loaded, not set aside, and have kernels for it (`native_for`), and the PyTorch fallback otherwise.

A CPU-only build has no CUDA kernels, so CUDA tensors must take the fallback there. Without a GPU this is checked
on the CPU: the dispatcher is made to answer that the CPU has no dro_ext kernel, and every native op is replaced by
a stub that records the call. Each public function must then give the fallback's answer without calling an op."""
import pytest
import torch

import dro_ext
from dro_ext import _backend, ops

# The ops the public functions call (NormalizedSGD's fused step included).
NATIVE_OPS = ["dro_loss", "psi_star_terms", "robust_objective", "robust_weights", "weight_stats",
              "dro_cross_entropy", "dro_cross_entropy_chunk_", "normalized_sgd_step_"]


def _every_public_function():
    """name -> the results of one call of each public function on fresh CPU tensors (the same on each call)."""
    gen = torch.Generator().manual_seed(3)
    losses = torch.rand(57, generator=gen, dtype=torch.float64)
    eta = torch.tensor(0.4, dtype=torch.float64)
    logits = torch.randn(9, 5, generator=gen, dtype=torch.float64)
    targets = torch.randint(0, 5, (9,), generator=gen)
    hidden = torch.randn(9, 4, generator=gen, dtype=torch.float64)
    weight = torch.randn(5, 4, generator=gen, dtype=torch.float64)
    params = [torch.nn.Parameter(torch.randn(3, generator=gen)), torch.nn.Parameter(torch.randn(2, generator=gen))]
    for p in params:
        p.grad = torch.randn(p.shape, generator=gen)
    opt = dro_ext.NormalizedSGD(params, lr=0.1)
    opt.step()
    module = dro_ext.DROLoss("chi2", lam=0.5)
    return {
        "dro_loss": dro_ext.dro_loss(losses, eta, 0.5, "kl"),
        "DROLoss": module(losses.float()),
        "dro_weights": dro_ext.dro_weights(losses, eta, 0.5, "chi2"),
        "psi_star": dro_ext.psi_star(losses, "smoothed_cvar", alpha=0.3),
        "robust_objective": dro_ext.robust_objective(losses, 0.5, "cressie_read", k=3.0),
        "worst_case_weights": dro_ext.worst_case_weights(losses, 0.5, "cvar", alpha=0.3),
        "weight_stats": dro_ext.weight_stats(losses)[:3],
        "dro_cross_entropy": dro_ext.dro_cross_entropy(logits, targets, eta, 0.5, "chi2"),
        "dro_linear_cross_entropy": dro_ext.dro_linear_cross_entropy(hidden, weight, targets, eta, 0.5, "kl"),
        "NormalizedSGD": [p.detach().clone() for p in params],
    }


def test_a_device_type_without_kernels_runs_the_fallback(monkeypatch):
    if _backend._force_python:
        pytest.skip("DRO_EXT_FORCE_PYTHON=1: this run covers the fallback only")
    assert _backend.native_available(), f"native extension not loaded: {_backend.load_error()}"
    with _backend.forced_backend("python"):
        expected = _every_public_function()

    query = torch._C._dispatch_has_kernel_for_dispatch_key
    monkeypatch.setattr(torch._C, "_dispatch_has_kernel_for_dispatch_key",
                        lambda op, key: False if key == "CPU" else query(op, key))
    monkeypatch.setattr(_backend, "_KERNEL_DEVICE_TYPES", {})
    called = []
    for name in NATIVE_OPS:
        monkeypatch.setattr(torch.ops.dro_ext, name, lambda *args, name=name: called.append(name))
    monkeypatch.setattr(ops, "_dro_loss_op", lambda *args: called.append("dro_loss"))
    with _backend.forced_backend("native"):
        assert dro_ext.backend() == "native" and not _backend.native_for("cpu")
        got = _every_public_function()
    assert not called, f"native ops called for a device type without kernels: {called}"
    for name, value in expected.items():
        for a, b in zip(torch.utils._pytree.tree_leaves(got[name]), torch.utils._pytree.tree_leaves(value)):
            assert torch.equal(a, b), f"{name}: {a} != {b}"


def test_the_rule_reads_the_dispatcher_and_the_forced_backend():
    if _backend._force_python:
        pytest.skip("DRO_EXT_FORCE_PYTHON=1: this run covers the fallback only")
    assert _backend.native_available(), f"native extension not loaded: {_backend.load_error()}"
    with _backend.forced_backend("native"):
        assert _backend.native_for("cpu")
        assert not _backend.native_for("meta")  # no dispatch key of that spelling: no kernel of ours
    with _backend.forced_backend("python"):
        assert not _backend.native_for("cpu")


def test_meta_tensors_give_the_shapes_or_a_clear_refusal(backend):
    """On the meta device (shape inference, a model built before it is materialized) the ops whose checks read values
    skip those reads and return meta tensors of the right shapes, as F.cross_entropy does (they raised "Tensor.item()
    cannot be called on meta tensors"); the solvers, which need the values, refuse naming themselves."""
    meta = dict(device="meta")
    logits, hidden, weight = torch.empty(6, 5, **meta), torch.empty(6, 3, **meta), torch.empty(5, 3, **meta)
    targets, groups, losses = (torch.empty(6, dtype=torch.long, **meta), torch.empty(6, dtype=torch.long, **meta),
                               torch.empty(6, **meta))
    shapes = {
        "cross_entropy_losses": (dro_ext.cross_entropy_losses(logits, targets), (6,)),
        "linear_cross_entropy_losses": (dro_ext.linear_cross_entropy_losses(hidden, weight, targets), (6,)),
        "dro_cross_entropy": (dro_ext.dro_cross_entropy(logits, targets, 0.1, 0.5), ()),
        "dro_linear_cross_entropy": (dro_ext.dro_linear_cross_entropy(hidden, weight, targets, 0.1, 0.5), ()),
        "group_sums": (dro_ext.group_sums(losses, groups, 3)[0], (3,)),
        "group_dro_loss": (dro_ext.group_dro_loss(losses, groups, 3, 0.1, 0.5), ()),
    }
    for name, (out, shape) in shapes.items():
        assert out.device.type == "meta" and tuple(out.shape) == shape, name
    for name, call in (("robust_objective", lambda: dro_ext.robust_objective(losses, 0.5)),
                       ("worst_case_weights", lambda: dro_ext.worst_case_weights(losses, 0.5))):
        with pytest.raises(NotImplementedError, match=f"dro_ext.{name} solves over the losses' values"):
            call()


def _op_calls():
    """op name -> (a function making its arguments, every tensor on the CPU, with the operands' names), for the ops
    whose fake kernel a call with an operand on the meta device reaches: the compiled ops, when loaded, and the
    custom ops of the Python layer (which exist on both backends)."""
    n, g, c, h = 6, 3, 5, 4
    ids = lambda: torch.tensor([0, 1, 2, 0, 1, 2])  # noqa: E731
    state = lambda: [torch.zeros(g), torch.zeros(g), torch.zeros(g), torch.zeros(g, dtype=torch.bool),  # noqa: E731
                     torch.ones(g, dtype=torch.bool), torch.zeros(g)]
    calls = {
        "cross_entropy_row_losses": lambda: [torch.randn(n, c), torch.randint(0, c, (n,)), -100, 0.0, False],
        "linear_cross_entropy_row_losses": lambda: [torch.randn(n, h), torch.randn(c, h), torch.randn(c),
                                                    torch.randint(0, c, (n,)), -100, 0.0, 4, False],
        "linear_cross_entropy_with_grads": lambda: [torch.randn(n, h), torch.randn(c, h), torch.randn(c),
                                                    torch.randint(0, c, (n,)), torch.tensor(0.1), 0.5, "chi2", None,
                                                    None, 1.0, -100, 0.0, 4, False, True, True, True, []],
    }
    if _backend.native_available() and not _backend._force_python:
        calls.update({
            "dro_loss": lambda: [torch.rand(n), torch.tensor(0.1), 0.5, "chi2"],
            "psi_star_terms": lambda: [torch.rand(n), torch.tensor(0.1), torch.tensor(1.0), 0.5, "chi2"],
            "dro_loss_backward": lambda: [torch.tensor(1.0), torch.rand(n), torch.tensor(0.1), torch.tensor(1.0), 0.5,
                                          "chi2"],
            "robust_weights": lambda: [torch.rand(n), torch.tensor(0.1), 0.5, "chi2"],
            "weight_stats": lambda: [torch.rand(n), ids(), g],
            "group_sums": lambda: [torch.rand(n), ids(), g],
            "group_sums_backward": lambda: [torch.rand(g), ids(), torch.float32],
            "group_dro_step_": lambda: [torch.rand(g), torch.ones(g), *state(), 0.01, 0.1, False, False, True],
            "group_dro_loss_": lambda: [torch.rand(n), ids(), g, *state(), 0.01, 0.1, False, False, True, True],
            "dro_cross_entropy": lambda: [torch.randn(n, c), torch.randint(0, c, (n,)), torch.tensor(0.1), 0.5,
                                          "chi2"],
            "dro_cross_entropy_chunk_": lambda: [torch.randn(n, c), torch.randint(0, c, (n,)), torch.tensor(0.1),
                                                 torch.tensor(1.0 / n), 0.5, "chi2"],
            "dro_cross_entropy_backward": lambda: [torch.tensor(1.0), torch.randn(n, c), torch.randint(0, c, (n,)),
                                                   torch.zeros(n, 2), torch.ones(n)],
        })
    return calls


def test_an_operand_left_on_the_meta_device_is_refused_by_every_op():
    """The dispatcher runs an op's fake kernel when any operand is on the meta device: a CPU call with one operand
    left there (a buffer of a model built on meta and never materialized) returned uninitialized CPU memory, and
    GroupDROLoss wrote it into its state. Every op refuses it, as its native kernel refuses a CUDA operand beside
    CPU ones, with a ValueError naming the devices; with every operand on meta it gives meta tensors."""
    for name, make in _op_calls().items():
        op = getattr(torch.ops.dro_ext, name).default
        operands = [i for i, arg in enumerate(make()) if isinstance(arg, torch.Tensor)]
        assert len(operands) >= 2, name
        for i in operands:
            args = make()
            args[i] = args[i].to("meta")
            with pytest.raises(ValueError, match="is on (meta|cpu) but .* (is|are) on (cpu|meta); move the"):
                op(*args)
        args = [arg.to("meta") if isinstance(arg, torch.Tensor) else arg for arg in make()]
        outputs = [t for t in torch.utils._pytree.tree_leaves(op(*args)) if isinstance(t, torch.Tensor)]
        assert all(t.device.type == "meta" for t in outputs), name


def test_group_dro_loss_refuses_ids_on_the_meta_device_and_keeps_its_state(backend):
    module = dro_ext.GroupDROLoss(3, step_size=0.5)
    module(torch.tensor([1.0, 2.0, 3.0]), torch.tensor([0, 1, 2]))
    before = {k: v.clone() for k, v in module.state_dict().items()}
    losses, groups = torch.rand(6), torch.empty(6, dtype=torch.long, device="meta")
    for update in (True, False):
        with pytest.raises(ValueError, match="groups is on meta but losses is on cpu"):
            module(losses, groups, update=update)
    for key, value in module.state_dict().items():
        assert torch.equal(value, before[key]), key


# A copy of the package (without its compiled library) imported in a fresh process, with setuptools' editable
# finder taken out, which would otherwise hand the copy this checkout's library.
_IMPORT_COPY = """
import sys, warnings
sys.meta_path[:] = [f for f in sys.meta_path if "Editable" not in getattr(f, "__name__", type(f).__name__)]
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    import torch, dro_ext
    from dro_ext import _backend
assert dro_ext.__file__.startswith(sys.argv[1]), dro_ext.__file__
assert dro_ext.backend() == "python"
print("ERROR:", _backend.load_error())
print("WARNINGS:", [str(w.message) for w in caught if str(w.message).startswith("dro_ext")])
print("VALUE:", dro_ext.dro_loss(torch.tensor([1.0, 2.0, 3.0]), 0.5, 1.0).item())
"""


def _import_a_copy(tmp_path, library_file=None, library_text=None):
    """Imports a copy of dro_ext holding `library_file` (written from `library_text`) in place of dro_ext._C, in a
    fresh process; returns its printed lines."""
    import os
    import pathlib
    import shutil
    import subprocess
    import sys

    source = pathlib.Path(dro_ext.__file__).parent
    shutil.copytree(source, tmp_path / "dro_ext", ignore=shutil.ignore_patterns("*.so", "__pycache__"))
    if library_file is not None:
        (tmp_path / "dro_ext" / library_file).write_text(library_text)
    env = {k: v for k, v in os.environ.items() if k not in ("DRO_EXT_FORCE_PYTHON", "DRO_EXT_WARN_FALLBACK")}
    env["PYTHONPATH"] = str(tmp_path)
    proc = subprocess.run([sys.executable, "-c", _IMPORT_COPY, str(tmp_path)], env=env, cwd=tmp_path,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout


def test_without_its_library_the_package_runs_the_fallback_quietly(tmp_path):
    out = _import_a_copy(tmp_path)
    assert "ERROR: No module named 'dro_ext._C'" in out, out  # not "partially initialized module" (a circular import)
    assert "WARNINGS: []" in out and "VALUE:" in out, out


def test_a_library_that_cannot_load_is_said_at_import(tmp_path):
    """A library there but unusable (built for another torch, truncated: here an empty file) is a broken install that
    would run the slower fallback in silence: the import warns, naming the loader's error, and the fallback runs."""
    out = _import_a_copy(tmp_path, "_C.abi3.so", "")
    assert "WARNINGS: ['dro_ext: native ops unavailable, using the PyTorch fallback (" in out, out
    assert "VALUE:" in out, out


def test_a_library_older_than_the_python_layer_is_set_aside(tmp_path):
    """A library that loads but lacks ops the Python layer calls (an editable install after a pull that added an op,
    before the rebuild): `import dro_ext` raised "operator dro_ext::group_sums does not exist" from a fake kernel's
    registration. It now runs the fallback and warns, naming the missing ops and the rebuild."""
    stale = ("import torch\n_lib = torch.library.Library('dro_ext', 'DEF')\n"
             "_lib.define('dro_loss(Tensor losses, Tensor eta, float lam, str divergence, float? alpha=None, "
             "float? k=None, float scale=1.) -> (Tensor, Tensor)')\n")
    out = _import_a_copy(tmp_path, "_C.py", stale)
    assert "lacks the ops _cpu_capability, dro_cross_entropy" in out and "rebuild it" in out, out
    assert "WARNINGS: ['dro_ext: native ops unavailable" in out and "VALUE:" in out, out


@pytest.mark.parametrize("op,argument", [(op, argument) for op, arguments in _backend._ADDED_ARGUMENTS.items()
                                          for argument in arguments], ids=lambda v: str(v))
def test_a_library_whose_op_lacks_an_added_argument_is_set_aside(tmp_path, op, argument):
    """Every op there, each with the arguments added to it since, but op without argument (group_sums' wide=, the
    float64 sums the objectives over groups ask it for; group_dro_step_'s out_dtype=): a library built before it
    would have raised a TypeError at every call that passes it. It is set aside, as one that lacks an op."""
    def stub(name: str) -> str:
        kept = [a for a in _backend._ADDED_ARGUMENTS.get(name, ()) if (name, a) != (op, argument)]
        return f"{name}(Tensor x{''.join(f', int {a}=0' for a in kept)}) -> Tensor"

    stale = ("import torch\n_lib = torch.library.Library('dro_ext', 'DEF')\n"
             + "".join(f"_lib.define('{stub(name)}')\n" for name in _backend.COMPILED_OPS))
    out = _import_a_copy(tmp_path, "_C.py", stale)
    assert f"lacks the ops {op}({argument}=):" in out and "rebuild it" in out, out
    assert "WARNINGS: ['dro_ext: native ops unavailable" in out and "VALUE:" in out, out


def test_the_compiled_ops_list_is_what_the_library_defines():
    """_backend.COMPILED_OPS, which a stale library is checked against, is every op the library registers: loaded
    alone in a fresh process, without the Python layer's own custom ops."""
    import subprocess
    import sys

    if not _backend.native_available():
        pytest.fail(f"the extension did not load: {_backend.load_error()}")
    from dro_ext import _C

    script = ("import sys, torch\ntorch.ops.load_library(sys.argv[1])\n"
              "print(sorted(n.split('::')[1].split('.')[0] for n in torch._C._dispatch_get_all_op_names() "
              "if n.startswith('dro_ext::')))")
    proc = subprocess.run([sys.executable, "-c", script, _C.__file__], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert eval(proc.stdout) == sorted(_backend.COMPILED_OPS)


@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.float8_e5m2], ids=str)
def test_float8_is_refused_naming_the_argument(backend, dtype):
    """float8 is a floating dtype to torch, but no kernel is compiled for it: the fallback computed in it (a float8
    value) where the native ops failed inside their dispatch macro ("not implemented for 'Float8_e4m3fn'"). Both
    refuse it with a TypeError naming the argument."""
    losses, groups = torch.rand(8).to(dtype), torch.randint(0, 3, (8,))
    logits, targets = torch.randn(8, 5).to(dtype), torch.randint(0, 5, (8,))
    calls = {
        "losses": [lambda: dro_ext.dro_loss(losses, 0.0, 0.5), lambda: dro_ext.robust_objective(losses, 0.5),
                   lambda: dro_ext.group_sums(losses, groups, 3), lambda: dro_ext.group_dro_loss(losses, groups, 3,
                                                                                               0.0, 0.5),
                   lambda: dro_ext.GroupDROLoss(3)(losses, groups), lambda: dro_ext.DROLoss()(losses)],
        "logits": [lambda: dro_ext.dro_cross_entropy(logits, targets, 0.0, 0.5)],
        "t": [lambda: dro_ext.psi_star(losses)],
    }
    for name, group in calls.items():
        for call in group:
            with pytest.raises(TypeError, match=f"{name} must (have a floating dtype|be a floating)"):
                call()
    with pytest.raises(ValueError, match="parameters must be floating point"):
        dro_ext.NormalizedSGD([torch.nn.Parameter(torch.zeros(3).to(dtype))], lr=0.1)
