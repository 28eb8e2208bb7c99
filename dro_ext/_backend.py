"""Which implementation runs: the compiled ops (``native``) or the pure-PyTorch fallback (``python``).

``import dro_ext`` never fails because the extension is missing: it falls back to PyTorch. Setting
``DRO_EXT_FORCE_PYTHON=1`` selects the fallback even where the extension is built.
"""
from __future__ import annotations

import contextlib
import importlib
import os
import warnings
from collections.abc import Iterable, Iterator

import torch  # noqa: F401  (loads libtorch, which dro_ext._C links against)

# The ops of csrc/ that the Python layer calls or registers kernels for (tests/test_backend.py checks that the
# library defines exactly these). A library that loads without one of them was built from older sources than this
# Python layer (an editable install after a pull, before its rebuild): it is not used.
COMPILED_OPS = (
    "_cpu_capability", "dro_cross_entropy", "dro_cross_entropy_backward", "dro_cross_entropy_backward_",
    "dro_cross_entropy_chunk_", "dro_loss", "dro_loss_backward", "group_dro_loss_", "group_dro_step_", "group_sums",
    "group_sums_backward", "logsumexp_columns", "normalized_sgd_step_", "psi_star_terms", "robust_objective",
    "robust_weights", "weight_stats",
)
# Arguments added to an op's schema after the op itself: a library whose op lacks one was built from older sources
# too (its calls with the argument would fail with a TypeError).
_ADDED_ARGUMENTS = {"group_sums": ("wide",), "group_dro_step_": ("out_dtype",)}

_native_loaded = False
_load_error: Exception | None = None
try:
    # The compiled extension, which registers torch.ops.dro_ext.* (imported by its full name: a failed
    # `from dro_ext import _C` inside the package's own import reads as a circular import).
    importlib.import_module("dro_ext._C")
    _native_loaded = True
except ImportError as exc:  # built without the extension, or built for another torch
    _load_error = exc
if _native_loaded:
    _missing_ops = [name for name in COMPILED_OPS if not hasattr(torch.ops.dro_ext, name)]
    _missing_ops += [f"{name}({argument}=)" for name, arguments in _ADDED_ARGUMENTS.items()
                     if name not in _missing_ops for argument in arguments
                     if argument not in [a.name for a in getattr(torch.ops.dro_ext, name).default._schema.arguments]]
    if _missing_ops:
        _native_loaded = False
        _load_error = ImportError(
            f"dro_ext._C lacks the ops {', '.join(_missing_ops)}: it was built from older sources than this Python "
            "layer; rebuild it (pip install --no-build-isolation -e ., or make build)")

_force_python = os.environ.get("DRO_EXT_FORCE_PYTHON", "0").lower() not in ("", "0", "false", "no")


def native_available() -> bool:
    """True when the compiled ops are loaded (whether or not they are in use)."""
    return _native_loaded


def use_native() -> bool:
    """The compiled ops are loaded and not set aside (DRO_EXT_FORCE_PYTHON, forced_backend)."""
    return _native_loaded and not _force_python


# Whether the dispatcher has dro_ext kernels for a device type, asked once per type. Every op is compiled for the
# same device types (CPU always, CUDA in a CUDA build: tests/test_cuda_registration.py pins it), so one op answers.
_KERNEL_DEVICE_TYPES: dict[str, bool] = {}


# torch.compile takes the answer as a constant, computed when it traces: the dispatcher query itself cannot be traced,
# and a fullgraph compile of a process's first robust_objective on CUDA failed on it ("torch.* op returned non-Tensor").
@torch.compiler.assume_constant_result
def _has_kernels(device_type: str) -> bool:
    found = _KERNEL_DEVICE_TYPES.get(device_type)
    if found is None:
        try:
            found = torch._C._dispatch_has_kernel_for_dispatch_key("dro_ext::dro_loss", device_type.upper())
        except Exception:  # not a dispatch key's name (e.g. "meta"): no native kernel of ours
            found = False
        _KERNEL_DEVICE_TYPES[device_type] = found
    return found


def native_for(device_type: str) -> bool:
    """The rule every public function follows: the compiled ops run on tensors of this device type when they are
    loaded, not set aside (use_native) and have kernels for it; the PyTorch fallback runs otherwise (CUDA tensors
    in a CPU-only build, say)."""
    return _native_loaded and not _force_python and _has_kernels(device_type)


def native_for_tensor(t: torch.Tensor) -> bool:
    """native_for(t.device.type) for the hot paths (the loss, the robust objective): a CPU tensor's answer without
    building its torch.device, which costs a third of a microsecond a call."""
    return native_for("cpu" if t.is_cpu else t.device.type)


def backend() -> str:
    """``"native"`` when dro_ext runs its compiled ops, ``"python"`` when it runs the PyTorch fallback."""
    return "native" if use_native() else "python"


def load_error() -> Exception | None:
    """Why the compiled ops could not be loaded, or None."""
    return _load_error


@contextlib.contextmanager
def forced_backend(name: str) -> Iterator[None]:
    """Run a block on the given backend ("native" or "python"); used by the tests to cover both paths."""
    global _force_python
    if name not in ("native", "python"):
        raise ValueError(f"backend must be 'native' or 'python', got {name!r}")
    if name == "native" and not _native_loaded:
        raise RuntimeError(f"dro_ext: the native extension is not loaded: {_load_error}")
    previous = _force_python
    _force_python = name == "python"
    try:
        yield
    finally:
        _force_python = previous


# A library that is there but cannot be used (built for another torch, or from older sources) is a broken install
# that would silently run the slower fallback: it is said always. Without a library (a pure-Python install) the
# fallback is the install's own choice, said only when asked (DRO_EXT_WARN_FALLBACK=1).
_library_absent = isinstance(_load_error, ModuleNotFoundError) and _load_error.name == "dro_ext._C"
if not _native_loaded and not _force_python and (
        not _library_absent or os.environ.get("DRO_EXT_WARN_FALLBACK", "0") == "1"):
    warnings.warn(f"dro_ext: native ops unavailable, using the PyTorch fallback ({_load_error})")


def check_fake_devices(main_name: str, main: torch.Tensor, **others: torch.Tensor | None) -> None:
    """In a fake kernel, the native kernels' device check, with their message: each of ``others`` (None skipped) on
    the device of ``main``. The dispatcher runs the fake kernel whenever any operand is on the meta device, so a CPU
    call with one operand left there (a buffer of a model built on meta and never materialized) would otherwise
    return uninitialized CPU memory, and an op that updates a state would write it there."""
    for name, t in others.items():
        check_fake_operands_on(main.device, [t], f"dro_ext: {name} is on {{device}} but {main_name} is on "
                               "{expected}; move them to the same device")


def check_fake_operands_on(device: torch.device, tensors: Iterable[torch.Tensor | None], message: str) -> None:
    """In a fake kernel, every tensor of ``tensors`` (None skipped) on ``device``, or ``message``'s ValueError as the
    native kernel raises it. The dispatcher runs the fake kernel whenever any operand is on the meta device (a state
    buffer left there, say): without this the call would return uninitialized memory and write nothing."""
    for t in tensors:
        if t is not None and t.device != device:
            raise ValueError(message.format(device=t.device, expected=device))
