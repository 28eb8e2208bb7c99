"""The three SIMD builds of the CPU kernels (csrc/cpu/kernels_default.cpp, kernels_avx2.cpp, kernels_avx512.cpp: one
source compiled with three instruction sets) linked into one library without lending each other code.

An inline function that the builds compile alike (the same signature, as for the divergences' scalar constructors)
is one weak symbol in each build's object, and the linker keeps one body for all. That is sound only while the kept
body is one every build may run: the default build's (no VEX or EVEX instruction), or for a function the default
build does not have, the AVX2 build's (no 512-bit register or mask). A body from a wider build would stop a narrower
processor with an illegal instruction. And a function whose body differs between the builds must have a name of its
own in each: the hand-written SIMD math (csrc/cpu/simd_float.h) shared the AVX2 build's names, and at -O0 the AVX-512
build ran AVX2 bodies and computed wrong values; it lives in one namespace per capability since.

Reads the objects of this checkout's build (build/temp.*/, which `make setup` leaves): without them (an extension
copied in or built elsewhere) it is skipped, saying so, except on CI, where it fails.
"""
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
ON_CI = os.environ.get("CI", "").lower() in ("1", "true", "yes")
BUILDS = ("default", "avx2", "avx512")


def _objects() -> dict[str, Path]:
    for temp in sorted((REPO / "build").glob("temp.*")):
        found = {build: next(iter(temp.glob(f"**/csrc/cpu/kernels_{build}.o")), None) for build in BUILDS}
        if all(found.values()):
            return found
    message = "no objects of this checkout's build in build/temp.*/ (an extension copied in or built elsewhere)"
    if ON_CI:
        pytest.fail(f"{message}. On CI, `make setup` must have left them: check setup.py's BUILD_TEMP")
    pytest.skip(message)


def _weak_symbols(path: Path) -> set[str]:
    out = subprocess.run(["nm", "--defined-only", str(path)], check=True, capture_output=True, text=True).stdout
    return {line.split()[-1] for line in out.splitlines() if line.split()[1:2] == ["W"]
            and line.split()[-1].startswith("_ZN7dro_ext")}


def _linked_bodies(library: Path, names: set[str]) -> dict[str, list[str]]:
    """The instructions the library links for each of `names` (mangled)."""
    out = subprocess.run(["objdump", "-d", "--no-show-raw-insn", str(library)], check=True, capture_output=True,
                         text=True).stdout
    bodies: dict[str, list[str]] = {}
    current = None
    for line in out.splitlines():
        header = re.match(r"^[0-9a-f]+ <(.*)>:$", line)
        if header:
            current = header.group(1) if header.group(1) in names else None
            if current:
                bodies[current] = []
        elif current and "\t" in line:
            bodies[current].append(line.split("\t", 1)[1])
    return bodies


def test_the_builds_lend_each_other_no_code():
    if shutil.which("nm") is None or shutil.which("objdump") is None:
        pytest.fail("nm and objdump (binutils) are needed: they come with the compiler the build uses")
    objects = _objects()
    import dro_ext._C as library_module

    weak = {build: _weak_symbols(path) for build, path in objects.items()}
    simd = [name for name in weak["avx2"] & weak["avx512"] if name.startswith("_ZN7dro_ext3cpu4simd")]
    assert not simd, f"simd_float.h functions with one name in the AVX2 and AVX-512 builds: {simd}"
    shared = {name for name in set().union(*weak.values()) if sum(name in names for names in weak.values()) > 1}
    bodies = _linked_bodies(Path(library_module.__file__), shared)
    assert bodies or not shared, f"none of the symbols the builds share was found in {library_module.__file__}"
    for name, body in bodies.items():
        if name in weak["default"]:
            wide = [insn for insn in body if re.match(r"v[a-z]", insn)]
            assert not wide, f"{name}, which the default build calls, links another build's body: {wide[:3]}"
        else:
            wide = [insn for insn in body if "zmm" in insn or re.search(r"%k[0-7]", insn)]
            assert not wide, f"{name}, which the AVX2 build calls, links the AVX-512 build's body: {wide[:3]}"
