"""Run the CPU tests against the CUDA kernels of csrc/cuda/*.cu emulated on the CPU (no GPU needed).

Each .cu file (and the csrc/cuda headers it includes) is compiled as C++ with a few textual changes: each
`kernel<<<grid, block, 0, stream>>>(args)` becomes `emulate_launch(kernel, grid, block, args)` (the kernel
wrapped in a generic lambda, so its template arguments are deduced as nvcc does; prelude.h: one
std::thread per CUDA thread of the launch's block size, the blocks of a launch one after another, blockDim and
gridDim per launch, a std::barrier for __syncthreads, __shared__ variables as statics), the stream, guard and
launch-check headers are stubs (shim/), cub::BlockReduce combines in a fixed order (valid in thread 0 only,
and it raises on a TempStorage reused without a __syncthreads; cub::BlockScan likewise, in thread order),
cub::DeviceRadixSort is a stable sort on the same radix digits, atomicAdd is a std::atomic_ref, CUDA_KERNEL_ASSERT
raises after the launch, and the file registers its ops for the CPU in place of the real CPU kernels. The CPU
tests then run the CUDA code:

    --kernel optim          csrc/cuda/normalized_sgd.cu   (the default; tests/test_optim.py, tests/test_cuda_optim.py)
    --kernel loss           csrc/cuda/dro_loss.cu         (tests/test_loss.py, tests/test_precision.py)
    --kernel robust         csrc/cuda/robust_objective.cu (tests/test_robust.py, tests/test_precision.py)
    --kernel cross_entropy  csrc/cuda/cross_entropy.cu    (tests/test_cross_entropy.py)
    --kernel groups         csrc/cuda/group_sums.cu       (tests/test_group_sums.py, tests/test_cuda_group_sums.py)
    --kernel group_dro      csrc/cuda/group_dro.cu        (tests/test_group_dro_step.py, tests/test_groups.py,
                                                          tests/test_cuda_group_dro.py)
    --kernel all            each of them in turn, with its default tests, and a summary

The native test repeats per CPU SIMD build (ids native-avx2, native-default, native-avx512) only rerun the same
emulated code, so the default runs deselect them. --quick also deselects the tests with 2^19+ losses of loss and
robust (about two minutes of the runs on two cores). Pytest arguments that
name test files replace the default selection; options alone (-x, -rf, --lf) are added to it.

DRO_EXT_EMULATION_CHAOS=1 makes the threads sleep at random around every __syncthreads (prelude.h), to make a
race on a missing barrier likelier to show; it slows the runs several-fold.

For optim, by default every scalar (lr, grad_scale, found_inf) is read through its pointer, as on the device;
--host-scalars keeps the host read the CUDA kernel uses for CPU scalars.

Not covered: the GPU memory model, warps and CUB's real reduction trees (the emulated order is sequential, so
sums differ from the GPU's in rounding), vectorized-load alignment faults, races other than a reused
BlockReduce TempStorage (the threads run preemptively, so other races show only by chance), nvcc's code
generation and fast-math, timing, streams, graphs and host syncs: those need a GPU (tests/test_cuda_*.py).

    python tools/cuda_emulation/emulate.py [--kernel K] [--host-scalars] [--quick] [pytest arguments]
"""
import argparse
import dataclasses
import os
import pathlib
import re
import subprocess
import sys
import time

HERE = pathlib.Path(__file__).resolve().parent
ROOT = HERE.parents[1]
CUDA_DIR = ROOT / "csrc" / "cuda"

# The tests that only repeat the native run on another SIMD build of the (here unused) CPU kernels.
SIMD_REPEATS = "not native-avx2 and not native-default and not native-avx512"


@dataclasses.dataclass
class Kernel:
    source: str
    headers: tuple  # csrc/cuda headers the source includes, rewritten beside it
    tests: tuple
    large: str = ""  # -k expression deselecting the tests with very large N, for --quick
    deselect_simd_repeats: bool = True
    # -k expression deselecting the CPU tests of a range the README says the CUDA kernels do not have (they never
    # redo a float32 pass in float64 after looking at its result), from the default runs.
    beyond_cuda_range: str = ""


KERNELS = {
    "optim": Kernel("normalized_sgd.cu", ("multi_tensor.cuh", "common.cuh"),
                    ("tests/test_optim.py", "tests/test_cuda_optim.py"),
                    deselect_simd_repeats=False),  # its selection as before --kernel existed
    "loss": Kernel("dro_loss.cu", ("psi_star_kernels.cuh", "common.cuh", "divergence_dispatch.cuh"),
                   ("tests/test_loss.py", "tests/test_precision.py"),
                   large="not test_large_outputs_never_share_live_memory",
                   # t past float32 where the weight is within it (the CPU redoes the map in float64)
                   beyond_cuda_range="not t_past_float32_with_a_weight_within_it"),
    "robust": Kernel("robust_objective.cu", ("psi_star_kernels.cuh", "common.cuh", "divergence_dispatch.cuh",
                                             "radix_select.cuh"),
                     ("tests/test_robust.py", "tests/test_precision.py"),
                     large="not test_float32_large and not test_cvar_large_matches_full_sort and not 524291 "
                           "and not test_linear_exact_segment_large"),
    "cross_entropy": Kernel("cross_entropy.cu", ("common.cuh", "divergence_dispatch.cuh"),
                            ("tests/test_cross_entropy.py",)),
    # One block per group part, 256 std::threads each: the cases with tens of thousands of groups take minutes.
    "groups": Kernel("group_sums.cu", ("common.cuh",), ("tests/test_group_sums.py", "tests/test_cuda_group_sums.py"),
                     large="not G_above_N and not 5000"),
    # One block of 256 std::threads a step, against the composition and the float64 references of the module.
    "group_dro": Kernel("group_dro.cu", ("common.cuh",),
                        ("tests/test_group_dro_step.py", "tests/test_groups.py", "tests/test_cuda_group_dro.py")),
}


def fail(message):
    raise SystemExit(f"emulate.py: {message}; update emulate.py")


def replace_count(text, old, new, count, name):
    if text.count(old) != count:
        fail(f"expected {old!r} {count} time(s) in {name}, found {text.count(old)}")
    return text.replace(old, new)


def split_top_level(text):
    """Splits a launch configuration at its top-level commas (commas inside (), [] or {} stay)."""
    parts, depth, start = [], 0, 0
    for i, ch in enumerate(text):
        if ch in "([{":
            depth += 1
        elif ch in ")]}":
            depth -= 1
        elif ch == "," and depth == 0:
            parts.append(text[start:i].strip())
            start = i + 1
    parts.append(text[start:].strip())
    return parts


LAUNCH = re.compile(r"(\w+(?:<[^<>]*>)?)\s*<<<(.*?)>>>\s*\(", re.S)


def rewrite_launches(source, name):
    """kernel<T...><<<grid, block, 0, stream>>>(args) -> emulate_launch(wrapper, grid, block, args). The wrapper
    is a generic lambda, so the kernel's remaining template arguments are deduced from the arguments as nvcc does."""
    launches = source.count("<<<")

    def launch(match):
        kernel, config = match.group(1), split_top_level(match.group(2))
        if len(config) != 4 or config[2] != "0" or not config[0] or not config[1]:
            fail(f"launch {match.group(0)!r} in {name}: expected <<<grid, block, 0, stream>>>")
        return f"emulate_launch([](auto&&... emu_a) {{ {kernel}(emu_a...); }}, {config[0]}, {config[1]}, "

    source, replaced = LAUNCH.subn(launch, source)
    if replaced != launches or "<<<" in source:
        fail(f"rewrote {replaced} of {launches} kernel launches in {name}")
    return source


def transform(name, source, device_scalars):
    source = rewrite_launches(source, name)
    if name == "normalized_sgd.cu":
        source = replace_count(source, "device.is_cuda()", "device.is_cpu()", 1, name)
    if name == "common.cuh":
        source = replace_count(source, "t.is_cuda()", "t.is_cpu()", 2, name)
        if device_scalars:  # scalar_arg: a CPU tensor is the 'device' one here
            source = replace_count(source, "if (t.device().is_cpu()) {",
                                   "if (false) {  // emulation: read on the 'device'", 1, name)
    if name == "cross_entropy.cu":
        source = replace_count(source, "CUDA_KERNEL_ASSERT(", "EMU_KERNEL_ASSERT(", 2, name)
    if name.endswith(".cu"):
        source = replace_count(source, "TORCH_LIBRARY_IMPL(dro_ext, CUDA, m)", "TORCH_LIBRARY_IMPL(dro_ext, CPU, m)",
                               1, name)
        source = '#include "prelude.h"\n' + source
    return source


def write_if_changed(path, text):
    if not path.exists() or path.read_text() != text:  # keep the file (and ninja's cache) when unchanged
        path.write_text(text)


def build(kernel: Kernel, device_scalars: bool = True) -> pathlib.Path:
    import dro_ext  # noqa: F401
    from torch.utils.cpp_extension import load

    stem = kernel.source.removesuffix(".cu")
    name = stem + "_emulated" + ("" if device_scalars or stem != "normalized_sgd" else "_host_scalars")
    out = ROOT / "build" / "cuda_emulation" / name
    (out / "cuda").mkdir(parents=True, exist_ok=True)
    for header in kernel.headers:  # found before csrc/cuda's own: "cuda/x.cuh" resolves against out first
        write_if_changed(out / "cuda" / header, transform(header, (CUDA_DIR / header).read_text(), device_scalars))
    included = set()
    for path in [CUDA_DIR / kernel.source, *(CUDA_DIR / h for h in kernel.headers)]:
        included.update(re.findall(r'#include\s+"cuda/([^"]+)"', path.read_text()))
    if included - set(kernel.headers):
        fail(f"{kernel.source} includes csrc/cuda/{sorted(included - set(kernel.headers))}, not in its headers")
    cpp = out / f"{name}.cpp"
    write_if_changed(cpp, transform(kernel.source, (CUDA_DIR / kernel.source).read_text(), device_scalars))
    load(name=name, sources=[str(cpp)],
         extra_include_paths=[str(out), str(HERE / "shim"), str(HERE), str(ROOT / "csrc")],
         extra_cflags=["-O1", "-std=c++20", "-Wno-unknown-pragmas"], is_python_module=False,
         build_directory=str(out))
    return out / f"{name}.so"


def default_tests(kernel, quick):
    selection = [SIMD_REPEATS] if kernel.deselect_simd_repeats else []
    if kernel.beyond_cuda_range:
        selection.append(kernel.beyond_cuda_range)
    if kernel.large and quick:
        selection.append(kernel.large)
    return ["-q", *kernel.tests, *(["-k", " and ".join(selection)] if selection else [])]


def run_pytest(library, tests):
    env = dict(os.environ, DRO_EXT_EMULATED_KERNEL=str(library), DRO_EXT_CUDA_TEST_DEVICE="cpu",
               PYTHONPATH=os.pathsep.join(filter(None, [str(HERE), os.environ.get("PYTHONPATH")])))
    return subprocess.call([sys.executable, "-m", "pytest", "-p", "emulated_kernel", *tests], cwd=ROOT, env=env)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kernel", choices=[*KERNELS, "all"], default="optim", help="the .cu file to emulate")
    parser.add_argument("--host-scalars", action="store_true", help="optim: read CPU scalars on the host, as CUDA does")
    parser.add_argument("--quick", action="store_true", help="deselect the tests with very large N")
    args, pytest_args = parser.parse_known_args()
    keys = list(KERNELS) if args.kernel == "all" else [args.kernel]
    results = []
    for key in keys:
        kernel = KERNELS[key]
        library = build(kernel, device_scalars=not args.host_scalars)
        # Test paths in the arguments replace the default selection; options alone (-x, -rf, ...) add to it.
        names_tests = any(not a.startswith("-") and (".py" in a or a.startswith("tests")) for a in pytest_args)
        tests = pytest_args if names_tests else [*default_tests(kernel, args.quick), *pytest_args]
        start = time.monotonic()
        rc = run_pytest(library, tests)
        results.append((key, rc, time.monotonic() - start))
    if len(results) > 1:
        for key, rc, seconds in results:
            print(f"emulate.py: {key:14s} {'passed' if rc == 0 else f'FAILED (pytest exit {rc})'} in {seconds:.0f} s")
    sys.exit(max(rc for _, rc, _ in results))


if __name__ == "__main__":
    main()
