"""Run the NormalizedSGD tests against csrc/cuda/normalized_sgd.cu emulated on the CPU (no GPU needed).

The .cu file is compiled as C++ with a few textual changes: each `kernel<<<grid, ...>>>(args)` becomes
`emulate_launch(kernel, grid, args)` (prelude.h: one std::thread per CUDA thread, the blocks of a launch
one after another, a std::barrier for __syncthreads, __shared__ variables as statics), the stream, guard and
launch-check headers are stubs (shim/), cub::BlockReduce is a fixed-order sum, and the kernel registers
for the CPU in place of the real CPU kernel. The CPU tests (tests/test_optim.py) and the CUDA tests with
DRO_EXT_CUDA_TEST_DEVICE=cpu then run the kernel's own indexing, chunking, launch splitting, partial sums,
norm, skip and update logic. By default every scalar (lr, grad_scale, found_inf) is read through its
pointer, as on the device; --host-scalars keeps the host read the CUDA kernel uses for CPU scalars.

Not covered: the GPU memory model, warps, vectorized-load alignment faults, the real CUB, nvcc's code
generation, timing, streams, graphs and host syncs: those need a GPU (tests/test_cuda_*.py).

    python tools/cuda_emulation/emulate.py [--host-scalars] [pytest arguments]
"""
import argparse
import os
import pathlib
import re
import subprocess
import sys

HERE = pathlib.Path(__file__).resolve().parent
ROOT = HERE.parents[1]
SOURCE = ROOT / "csrc" / "cuda" / "normalized_sgd.cu"


def transform(source: str, device_scalars: bool) -> str:
    launches = source.count("<<<")
    source, replaced = re.subn(r"(\w+(?:<[^<>]*>)?)<<<([^,]+), kThreads, 0, stream>>>\(",
                               r"emulate_launch(\1, \2, ", source)
    if replaced != launches:
        raise SystemExit(f"emulate.py: rewrote {replaced} of {launches} kernel launches; update the pattern")

    def replace_once(text, old, new):
        if text.count(old) != 1:
            raise SystemExit(f"emulate.py: expected {old!r} once in {SOURCE.name}; update emulate.py")
        return text.replace(old, new)

    source = replace_once(source, "device.is_cuda()", "device.is_cpu()")
    if device_scalars:
        source = replace_once(source, "if (t.device().is_cpu()) {", "if (false) {  // emulation: read on the 'device'")
    source = replace_once(source, "TORCH_LIBRARY_IMPL(dro_ext, CUDA, m)", "TORCH_LIBRARY_IMPL(dro_ext, CPU, m)")
    return '#include "prelude.h"\n' + source


def build(device_scalars: bool) -> pathlib.Path:
    import dro_ext  # noqa: F401
    from torch.utils.cpp_extension import load

    name = "normalized_sgd_emulated" + ("" if device_scalars else "_host_scalars")
    out = ROOT / "build" / "cuda_emulation" / name
    out.mkdir(parents=True, exist_ok=True)
    cpp = out / f"{name}.cpp"
    text = transform(SOURCE.read_text(), device_scalars)
    if not cpp.exists() or cpp.read_text() != text:  # keep the file (and ninja's cache) when unchanged
        cpp.write_text(text)
    load(name=name, sources=[str(cpp)], extra_include_paths=[str(HERE / "shim"), str(HERE), str(ROOT / "csrc")],
         extra_cflags=["-O1", "-std=c++20"], is_python_module=False, build_directory=str(out))
    return out / f"{name}.so"


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--host-scalars", action="store_true", help="read CPU scalars on the host, as CUDA does")
    args, pytest_args = parser.parse_known_args()
    library = build(device_scalars=not args.host_scalars)
    env = dict(os.environ, DRO_EXT_EMULATED_KERNEL=str(library), DRO_EXT_CUDA_TEST_DEVICE="cpu",
               PYTHONPATH=os.pathsep.join(filter(None, [str(HERE), os.environ.get("PYTHONPATH")])))
    tests = pytest_args or ["-q", "tests/test_optim.py", "tests/test_cuda_optim.py"]
    sys.exit(subprocess.call([sys.executable, "-m", "pytest", "-p", "emulated_kernel", *tests], cwd=ROOT, env=env))


if __name__ == "__main__":
    main()
