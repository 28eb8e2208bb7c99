"""Build dro_ext._C: C++ CPU kernels always, CUDA kernels when a toolkit and a CUDA torch are present.

DRO_EXT_CUDA=auto|0|1 (default auto) chooses whether the csrc/cuda/*.cu sources are compiled. They are
compiled whenever nvcc and a CUDA build of torch exist, whether or not a GPU is visible, so the CUDA
code is at least compiled and linked on every machine that can.
"""
import glob
import hashlib
import os
import shutil
import sys
import sysconfig

from setuptools import setup

ROOT = os.path.dirname(os.path.abspath(__file__))
DEFAULT_CUDA_ARCH_LIST = "8.0;9.0"  # A100/H100-class; override with TORCH_CUDA_ARCH_LIST
# Where the compiled objects stay between builds, whichever command builds: `setup.py build_ext --inplace`, a wheel
# (`python -m build --wheel`, `pip wheel`) and `pip install -e .`, which would otherwise compile into a temporary
# folder and delete it. Ninja then recompiles only what changed (a source, a header it includes, or the flags), so a
# wheel built after the editable install only links (a full compile takes minutes on 2 cores). It is setuptools'
# own default for the first two.
BUILD_TEMP = os.path.join(ROOT, "build", f"temp.{sysconfig.get_platform()}-{sys.implementation.cache_tag}")


def find_cuda_home():
    """The CUDA toolkit root, resolving nvcc wrappers (e.g. /usr/local/bin/nvcc) to the real toolkit."""
    for var in ("CUDA_HOME", "CUDA_PATH"):
        if os.environ.get(var):
            return os.environ[var]
    candidates = ["/usr/local/cuda"]
    nvcc = shutil.which("nvcc")
    if nvcc:
        candidates.append(os.path.dirname(os.path.dirname(os.path.realpath(nvcc))))
    for home in candidates:
        # A real toolkit has the runtime library beside nvcc; a wrapper's parent does not.
        if os.path.exists(os.path.join(home, "bin", "nvcc")) and glob.glob(os.path.join(home, "lib*", "libcudart*")):
            return home
    return None


def want_cuda():
    mode = os.environ.get("DRO_EXT_CUDA", "auto").lower()
    if mode not in ("auto", "0", "1"):
        raise SystemExit(f"DRO_EXT_CUDA must be auto, 0 or 1, got {mode!r}")
    if mode == "0":
        return False
    import torch

    cuda_home = find_cuda_home()
    available = cuda_home is not None and torch.version.cuda is not None
    if mode == "1" and not available:
        raise SystemExit(
            "DRO_EXT_CUDA=1 but no CUDA build is possible: "
            f"torch.version.cuda={torch.version.cuda}, CUDA toolkit={cuda_home} (set CUDA_HOME)"
        )
    if available:
        # torch.utils.cpp_extension reads CUDA_HOME when it is imported; set it before that.
        os.environ["CUDA_HOME"] = cuda_home
        if not os.environ.get("TORCH_CUDA_ARCH_LIST") and not torch.cuda.is_available():
            os.environ["TORCH_CUDA_ARCH_LIST"] = DEFAULT_CUDA_ARCH_LIST
    return available


def source_files():
    """(the C++ sources, the CUDA sources) of the extension, as paths relative to the checkout, each list sorted."""
    return sorted(glob.glob("csrc/*.cpp") + glob.glob("csrc/cpu/*.cpp")), sorted(glob.glob("csrc/cuda/*.cu"))


def extensions():
    with_cuda = want_cuda()
    from torch.utils.cpp_extension import CppExtension, CUDAExtension

    cpp_sources, cuda_sources = source_files()
    debug = os.environ.get("DEBUG", "0") == "1"
    # DRO_EXT_CXX_OPT (e.g. -O1) replaces -O3 for the host's C++ (the .cpp sources, and the host side of the .cu
    # ones; nvcc's -O is the host compiler's, and the device code stays optimized): for a build that only checks that
    # the sources compile, link and register (CI's build against the GPU machines' torch, `make compat`), whose CPU
    # kernels run slower. The AVX-512 kernels compile in 30 s at -O1 against 75 s at -O3; the .cu files, hardly
    # faster.
    cxx_opt = os.environ.get("DRO_EXT_CXX_OPT") or "-O3"
    if cxx_opt not in ("-O0", "-O1", "-O2", "-O3", "-Os"):
        raise SystemExit(f"DRO_EXT_CXX_OPT must be -O0, -O1, -O2, -O3 or -Os, got {cxx_opt!r}")
    opt = ["-O0", "-g"] if debug else [cxx_opt]
    # -fopenmp: at::parallel_for is inlined from ATen's headers as an OpenMP parallel region, so without it
    # every kernel silently runs on one thread (and -Wno-unknown-pragmas, needed for ATen's "#pragma unroll",
    # hid the warning). The symbols resolve to the libgomp torch has already loaded.
    # -std=c++20: the kernels use concepts; torch 2.14 asks for C++20 itself, while 2.11 (the GPU machines')
    # would pass -std=c++17 unless the flag is given here.
    # -g0 (release builds): Python's own compiler flags, which setuptools puts first, carry -g. Debug information for
    # these kernels' templates took longer to write than the code (the AVX-512 kernels: 83 s with it, 46 s without)
    # and made the library four times larger (112 MB against 26 MB); function names stay in the symbol table.
    release = [] if debug else ["-g0"]
    # -ffp-contract=off: GCC fuses a multiply and an add into one FMA where it sees fit, and may fuse in one inlined
    # copy of a function and not in another: at::parallel_for's body is compiled twice (called directly on one
    # thread, from the OpenMP region on several), and the same chunk of a reduction summed to other last bits on
    # one thread than on two. The kernels ask for their FMAs by name (csrc/cpu/simd_float.h).
    cxx_flags = opt + release + ["-std=c++20", "-fopenmp", "-ffp-contract=off", "-Wno-unknown-pragmas", "-Wno-psabi"]
    common = dict(
        name="dro_ext._C",
        include_dirs=[os.path.join(ROOT, "csrc")],
        extra_link_args=["-fopenmp"],
        py_limited_api=True,
    )
    if with_cuda:
        return [
            CUDAExtension(
                sources=cpp_sources + cuda_sources,
                extra_compile_args={"cxx": cxx_flags + ["-DDRO_EXT_WITH_CUDA"], "nvcc": opt + ["-std=c++20", "-DDRO_EXT_WITH_CUDA"]},
                **common,
            )
        ]
    return [CppExtension(sources=cpp_sources, extra_compile_args={"cxx": cxx_flags}, **common)]


def unity_build():
    """DRO_EXT_UNITY_BUILD=1|0 (default 1): whether the sources are compiled as a few translation units (unity_sources)
    or one object per file, which recompiles faster after an edit to a single file."""
    mode = os.environ.get("DRO_EXT_UNITY_BUILD", "1")
    if mode not in ("0", "1"):
        raise SystemExit(f"DRO_EXT_UNITY_BUILD must be 0 or 1, got {mode!r}")
    return mode == "1"


def unity_sources(sources, folder):
    """`sources` as the translation units a unity build compiles, written into `folder`: every .cpp in one, every .cu
    in another, each #including its files in order. Two kinds stay on their own: csrc/cpu/kernels_*.cpp, as each
    compiles the same kernels for another SIMD capability (kernel_tables.h is included once per translation unit),
    and csrc/module.cpp, whose Python.h must come before any standard header.

    Each translation unit parses torch's headers once, where one per file parsed them in each: on 2 cores that was
    most of a clean build (the six .cu files: 493 CPU-s apart, 185 s as one; the eight .cpp: 166 s apart, 60 s as
    one). A unit is rewritten only when its text changes, so that ninja recompiles it only when a source it
    includes does. Its text carries a digest of its members and of every header under csrc/: ninja's log of what a
    unit includes is dropped by a build of another configuration in the same folder (one without the CUDA
    extension, say), after which the CUDA unit kept its old object through edits to its .cu files; with the digest,
    an edit rewrites the unit, which ninja then recompiles whatever its log holds."""
    os.makedirs(folder, exist_ok=True)
    separate = [s for s in sources if os.path.basename(s).startswith("kernels_") or s == "csrc/module.cpp"]
    units = []
    for suffix, name in ((".cpp", "ops_unity.cpp"), (".cu", "cuda_unity.cu")):
        members = [s for s in sources if s.endswith(suffix) and s not in separate]
        if not members:
            continue
        unit = os.path.join(folder, name)
        text = ("// Generated by setup.py (unity_sources): one translation unit of the sources below.\n"
                f"// sources digest {_digest(members + _headers())}\n" + "".join(
                    f'#include "{os.path.relpath(os.path.join(ROOT, m), folder)}"\n' for m in members))
        if not os.path.exists(unit) or _read(unit) != text:
            with open(unit, "w") as f:
                f.write(text)
        units.append(unit)
    return units + separate


def _read(path):
    with open(path) as f:
        return f.read()


def _headers():
    """Every header under csrc/ (relative to ROOT), in a fixed order."""
    return sorted(os.path.relpath(p, ROOT) for ext in ("h", "cuh")
                  for p in glob.glob(os.path.join(ROOT, "csrc", "**", f"*.{ext}"), recursive=True))


def _digest(paths):
    """SHA-256 of the files' names and contents."""
    digest = hashlib.sha256()
    for path in paths:
        digest.update(path.encode() + b"\0")
        with open(os.path.join(ROOT, path), "rb") as f:
            digest.update(f.read())
    return digest.hexdigest()


def cmdclass():
    from torch.utils.cpp_extension import BuildExtension

    class BuildExtensionInBuildTemp(BuildExtension):
        """BuildExtension with its objects in BUILD_TEMP unless --build-temp is given (scripts/build_against_torch.sh
        gives one). The editable install sets `build`'s build_temp to a temporary folder and drops an option given
        to build_ext in setup(options=...), so the default is set here, where both are overridden. A unity build's
        translation units are written beside the objects, here rather than in extensions(), so that the sdist, which
        takes the extension's sources, still lists the sources themselves."""

        def finalize_options(self):
            if self.build_temp is None:
                self.build_temp = BUILD_TEMP
            super().finalize_options()

        def build_extensions(self):
            if unity_build():
                for extension in self.extensions:
                    extension.sources = unity_sources(extension.sources, os.path.join(self.build_temp, "unity"))
            super().build_extensions()

    return {"build_ext": BuildExtensionInBuildTemp.with_options(use_ninja=shutil.which("ninja") is not None)}


# The metadata (name, version, dependencies, extras) is pyproject.toml's [project]; this builds dro_ext._C. Guarded
# so that the tests can import find_cuda_home (setuptools' build backend runs this file as __main__ too).
if __name__ == "__main__":
    setup(
        ext_modules=extensions(),
        cmdclass=cmdclass(),
        options={"bdist_wheel": {"py_limited_api": "cp310"}},
    )
