"""The instruction count of each CUDA kernel's main loop, from the SASS nvcc generates (no GPU needed).

Without a GPU, the compute cost of a kernel can still be read off the machine code: this compiles csrc/cuda/*.cu
(device code only, for one architecture), disassembles it with cuobjdump and, for every kernel whose demangled
name matches --kernel, prints each of its loops that load from global memory (a backward branch and what it jumps over): SASS instructions
(NOPs left out), those on the loop's cheapest path through its branches, MUFU operations (exp2, log2, reciprocal: a quarter rate) and global loads. The loops of
csrc/cuda/common.cuh's for_each_vector load one 16-byte vector a trip (4 float32, 8 half, 2 float64), so
instructions / (4 * loads) is the float32 cost per loss of every branch in the body together, and the cheapest
path's count / (4 * loads) that of the common case where the other branches are rare (a division's slow path,
the ERM vectors of thread_loss_sums_coarse); --listing prints the body, to follow any other path.

Against an H100 SXM's ~40 instructions a lane per float32 read from HBM (132 SMs x 128 lanes x 1.98 GHz for
3.35 TB/s) this tells a memory-bound loop from a compute-bound one. It is not a timing: speed is claimed only
from bench/ on a GPU.

    python tools/sass_loops.py [--arch sm_90] [--kernel REGEX] [--listing] [csrc/cuda/X.cu ...]

Needs nvcc (CUDA_HOME or PATH) and cuobjdump (CUDA_HOME/bin, PATH, or the copy triton ships).
"""
from __future__ import annotations

import argparse
import os
import pathlib
import re
import shutil
import subprocess
import sys
import sysconfig
import tempfile

ROOT = pathlib.Path(__file__).resolve().parents[1]
INSTRUCTION = re.compile(r"/\*([0-9a-f]{4,})\*/\s+((?:@!?U?P\w+\s+)?[A-Z][^;]*);")
BRANCH_TARGET = re.compile(r"\bBRA\b.*?0x([0-9a-f]+)")


def tool(name: str) -> str:
    cuda_home = os.environ.get("CUDA_HOME", "/usr/local/cuda")
    for candidate in (pathlib.Path(cuda_home) / "bin" / name, shutil.which(name)):
        if candidate and pathlib.Path(candidate).exists():
            return str(candidate)
    try:
        import triton  # ships cuobjdump with its NVIDIA backend
        bundled = pathlib.Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / name
        if bundled.exists():
            return str(bundled)
    except ImportError:
        pass
    sys.exit(f"sass_loops.py: {name} not found (set CUDA_HOME)")


def compile_cubin(source: pathlib.Path, arch: str, out: pathlib.Path) -> None:
    from torch.utils.cpp_extension import include_paths
    # The csrc/ the source lives in (csrc/cuda/X.cu), so that another checkout's file takes its own headers.
    includes = [source.resolve().parents[1], *include_paths(), sysconfig.get_paths()["include"]]
    command = [tool("nvcc"), "-cubin", f"-arch={arch}", "-O3", "-std=c++20", "--expt-relaxed-constexpr",
               "-DDRO_EXT_WITH_CUDA", "-D__CUDA_NO_HALF_OPERATORS__", "-D__CUDA_NO_HALF_CONVERSIONS__",
               "-D__CUDA_NO_BFLOAT16_CONVERSIONS__", "-D__CUDA_NO_HALF2_OPERATORS__",
               *(f"-I{p}" for p in includes), str(source), "-o", str(out)]
    subprocess.run(command, check=True)


def demangle(names: list[str]) -> list[str]:
    cxxfilt = shutil.which("c++filt")
    if cxxfilt is None:
        return names
    out = subprocess.run([cxxfilt], input="\n".join(names), capture_output=True, text=True).stdout.splitlines()
    return [re.sub(r"dro_ext::(cuda::)?(\(anonymous namespace\)::)?", "", n) for n in out]


def loops(body: str) -> list[list[tuple[int, str]]]:
    """The body of every loop (a backward branch and the instructions it jumps back over) that loads from global
    memory, in address order."""
    instructions = [(int(a, 16), i.strip()) for a, i in INSTRUCTION.findall(body) if not i.startswith("NOP")]
    found = []
    for address, text in instructions:
        match = BRANCH_TARGET.search(text)
        if match and int(match.group(1), 16) < address:
            loop = [(a, t) for a, t in instructions if int(match.group(1), 16) <= a <= address]
            if any(re.search(r"\bLDG\b", t) for _, t in loop):
                found.append(loop)
    return found


def shortest_trip(loop: list[tuple[int, str]]) -> int:
    """Instructions on the cheapest way from the loop's head to its backward branch, every forward branch free to
    go either way (Dijkstra on the body's control flow; the slow path of a division is a CALL outside)."""
    import heapq
    index = {address: k for k, (address, _) in enumerate(loop)}
    best = {0: 1}
    queue = [(1, 0)]
    while queue:
        cost, k = heapq.heappop(queue)
        if k == len(loop) - 1:
            return cost
        if cost > best.get(k, 1 << 30):
            continue
        text = loop[k][1]
        match = BRANCH_TARGET.search(text)
        successors = []
        if match and int(match.group(1), 16) in index and int(match.group(1), 16) > loop[k][0]:
            successors.append(index[int(match.group(1), 16)])
        if not (match and not text.startswith("@")):  # an unconditional branch has no fall-through
            successors.append(k + 1)
        for nxt in successors:
            if nxt < len(loop) and cost + 1 < best.get(nxt, 1 << 30):
                best[nxt] = cost + 1
                heapq.heappush(queue, (cost + 1, nxt))
    return len(loop)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("sources", nargs="*", type=pathlib.Path)
    parser.add_argument("--arch", default="sm_90")
    parser.add_argument("--kernel", default=".", help="regular expression on the demangled kernel name")
    parser.add_argument("--listing", action="store_true", help="print each matching loop's body")
    args = parser.parse_args()
    sources = args.sources or sorted((ROOT / "csrc" / "cuda").glob("*.cu"))
    pattern = re.compile(args.kernel)
    with tempfile.TemporaryDirectory() as scratch:
        for source in sources:
            cubin = pathlib.Path(scratch) / (source.stem + ".cubin")
            compile_cubin(source, args.arch, cubin)
            sass = subprocess.run([tool("cuobjdump"), "-sass", str(cubin)], check=True, capture_output=True,
                                  text=True).stdout
            functions = sass.split("Function : ")[1:]
            names = demangle([f.split("\n", 1)[0].strip() for f in functions])
            print(f"# {source.relative_to(ROOT) if source.is_relative_to(ROOT) else source} ({args.arch})")
            for name, function in sorted(zip(names, functions)):
                if not pattern.search(name):
                    continue
                for loop in loops(function):
                    texts = [t for _, t in loop]
                    mufu = sum("MUFU" in t for t in texts)
                    loads = sum(re.search(r"\bLDG\b", t) is not None for t in texts)
                    print(f"{len(texts):6d} instructions ({shortest_trip(loop):4d} on the cheapest path) {mufu:4d} "
                          f"MUFU {loads:3d} loads  {name[:150]}")
                    if args.listing:
                        for address, text in loop:
                            print(f"    {address:#06x}  {text}")


if __name__ == "__main__":
    main()
