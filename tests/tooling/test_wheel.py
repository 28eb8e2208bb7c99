"""The package as a user gets it: the wheel and the sdist of this checkout, built the way a user builds them.

The wheel (`python -m build --wheel --no-isolation`) is installed into a fresh virtual environment that sees the
system's packages (torch is not installed again) but not this checkout: it is imported from a folder outside the
checkout, and must come from the environment's own site-packages, not from the checkout's editable install nor from
its source tree. There it must load its compiled ops (CPU kernels, and CUDA kernels where the toolkit is present),
compute a DROLoss forward and backward and a NormalizedSGD step as their formulas say, and run the quick demo.
The sdist (`python -m build --sdist --no-isolation`, which compiles nothing) must hold every source the build needs
(MANIFEST.in adds the headers, CMakeLists.txt and CHANGELOG.md to what setuptools takes by itself).

Why the wheel build reuses the set-up's build: compiling the extension (CPU kernels three times for the SIMD builds,
CUDA kernels) takes about 4 minutes on CI's 2 cores. setup.py keeps every build's objects in build/temp.*/ (the editable
install of `make setup` included, which would otherwise compile into a temporary folder), and a wheel built from the
checkout itself (not from a copy) runs the same ninja build there with the same sources and flags, so ninja compiles
nothing and the wheel only links. The test therefore needs that build: without one (an extension copied in or built
elsewhere) it is skipped, saying so, except on CI, where it fails; and CI also fails when ninja compiled anything.
"""
import email.parser
import importlib.util
import os
import re
import shutil
import subprocess
import sys
import tarfile
import textwrap
import warnings
import zipfile
from pathlib import Path

import pytest
import torch

import dro_ext

REPO = Path(__file__).resolve().parents[2]
ON_CI = os.environ.get("CI", "").lower() in ("1", "true", "yes")
# Building from reused objects takes seconds; a build that compiles everything, far longer (still bounded).
BUILD_TIMEOUT_S = 3600
EXTRAS = {"demo", "bench", "test", "examples"}
SOURCE_SUFFIXES = {".cpp", ".h", ".cu", ".cuh"}
# What building the extension from the sdist needs besides csrc/, and what a user is owed with it.
SDIST_FILES = ["setup.py", "pyproject.toml", "CMakeLists.txt", "README.md", "LICENSE", "CHANGELOG.md",
               "dro_ext/py.typed", "dro_ext/__init__.py"]


def _setup_script():
    """setup.py as a module: its functions, without running setup() (which runs only as __main__)."""
    spec = importlib.util.spec_from_file_location("dro_ext_setup_script", REPO / "setup.py")
    setup_script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(setup_script)
    return setup_script


def _cuda_expected() -> bool:
    """setup.py's own rule (want_cuda, without its side effects): the CUDA kernels are compiled when it finds a
    toolkit (CUDA_HOME, CUDA_PATH, /usr/local/cuda or nvcc's) and torch is a CUDA build, unless DRO_EXT_CUDA=0."""
    return (os.environ.get("DRO_EXT_CUDA", "auto") != "0" and torch.version.cuda is not None
            and _setup_script().find_cuda_home() is not None)


def test_a_check_build_takes_its_host_optimization_from_dro_ext_cxx_opt(monkeypatch):
    """DRO_EXT_CXX_OPT (CI's build against the GPU machines' torch) replaces -O3 for the C++ and for nvcc's host
    code, and nothing else; a value that is no optimization level is refused, naming the variable."""
    setup_script = _setup_script()
    # (want_cuda sets these two for the build; monkeypatch puts them back)
    monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", os.environ.get("TORCH_CUDA_ARCH_LIST", "9.0"))
    monkeypatch.setenv("CUDA_HOME", setup_script.find_cuda_home() or "")

    def flags() -> dict:
        (extension,) = setup_script.extensions()
        args = extension.extra_compile_args
        return args if isinstance(args, dict) else {"cxx": args}

    monkeypatch.delenv("DRO_EXT_CXX_OPT", raising=False)
    release = flags()
    monkeypatch.setenv("DRO_EXT_CXX_OPT", "-O1")
    check = flags()
    assert set(check) == set(release) and "cxx" in check
    for compiler in release:
        assert "-O3" in release[compiler] and "-O1" not in release[compiler], compiler
        assert check[compiler] == ["-O1" if flag == "-O3" else flag for flag in release[compiler]], compiler
    monkeypatch.setenv("DRO_EXT_CXX_OPT", "fast")
    with pytest.raises(SystemExit, match="DRO_EXT_CXX_OPT must be"):
        setup_script.extensions()


def test_a_unity_build_compiles_every_source_once_and_the_simd_builds_apart(tmp_path, monkeypatch):
    """unity_sources: every .cpp in one translation unit and every .cu in another, each source #included exactly
    once by a path that reaches it from the unit's folder; the SIMD builds of the kernels and the Python module's
    init compiled on their own; a unit rewritten only when its text changes (ninja recompiles what is newer)."""
    setup_script = _setup_script()
    monkeypatch.chdir(REPO)
    cpp_sources, cuda_sources = setup_script.source_files()
    sources = cpp_sources + cuda_sources
    apart = [s for s in sources if s == "csrc/module.cpp" or Path(s).name.startswith("kernels_")]
    assert len(apart) == 4, apart  # module.cpp and the default, AVX2 and AVX-512 builds
    units = setup_script.unity_sources(sources, str(tmp_path))
    assert units[len(units) - len(apart):] == apart
    included = {}
    for unit in units[:len(units) - len(apart)]:
        lines = [line for line in Path(unit).read_text().splitlines() if line.startswith("#include")]
        included[Path(unit).suffix] = [(Path(unit).parent / re.fullmatch(r'#include "(.+)"', line)[1]).resolve()
                                       for line in lines]
    assert set(included) == {".cpp", ".cu"}
    for suffix, paths in included.items():
        expected = [(REPO / s).resolve() for s in sources if s.endswith(suffix) and s not in apart]
        assert paths == expected and all(p.is_file() for p in paths), suffix
    # The same sources again: no unit is written (its time stays in the past); a unit whose text differs is.
    past = 1_000_000_000
    for unit in units[:2]:
        os.utime(unit, (past, past))
    Path(units[0]).write_text(Path(units[0]).read_text() + "// edited\n")
    os.utime(units[0], (past, past))
    assert setup_script.unity_sources(sources, str(tmp_path)) == units
    assert os.stat(units[0]).st_mtime != past and "edited" not in Path(units[0]).read_text()
    assert os.stat(units[1]).st_mtime == past
    monkeypatch.setenv("DRO_EXT_UNITY_BUILD", "yes")
    with pytest.raises(SystemExit, match="DRO_EXT_UNITY_BUILD must be 0 or 1"):
        setup_script.unity_build()


def test_a_unity_unit_is_rewritten_when_a_source_or_header_it_reads_changes(tmp_path, monkeypatch):
    """The units carry a digest of their members and of csrc/'s headers: ninja's log of what a unit includes can be
    lost (a build of another configuration in the same folder drops it), and the CUDA unit then kept its old object
    through edits to its .cu files; a unit whose digest moves is rewritten, so ninja recompiles it regardless."""
    setup_script = _setup_script()
    tree = tmp_path / "tree"
    shutil.copytree(REPO / "csrc", tree / "csrc")
    monkeypatch.setattr(setup_script, "ROOT", str(tree))
    monkeypatch.chdir(REPO)
    cpp_sources, cuda_sources = setup_script.source_files()
    folder = str(tmp_path / "unity")
    units = setup_script.unity_sources(cpp_sources + cuda_sources, folder)
    cpp_unit, cuda_unit = (Path(u) for u in units[:2])
    assert cpp_unit.suffix == ".cpp" and cuda_unit.suffix == ".cu"

    def texts():
        setup_script.unity_sources(cpp_sources + cuda_sources, folder)
        return cpp_unit.read_text(), cuda_unit.read_text()

    before = texts()
    assert texts() == before  # nothing changed: nothing rewritten
    a_cu = tree / cuda_sources[0]
    a_cu.write_text(a_cu.read_text() + "// edited\n")
    after_cu = texts()
    assert after_cu[0] == before[0] and after_cu[1] != before[1]  # the .cu unit alone
    header = tree / "csrc" / "checks.h"
    header.write_text(header.read_text() + "// edited\n")
    after_header = texts()
    assert after_header[0] != after_cu[0] and after_header[1] != after_cu[1]  # both units read the headers


def _build(kind: str, out: Path) -> tuple[Path, str]:
    """`python -m build --<kind> --no-isolation` of the checkout into out: the one file it makes, and its log."""
    proc = subprocess.run([sys.executable, "-m", "build", f"--{kind}", "--no-isolation", "--outdir", str(out)],
                          cwd=REPO, capture_output=True, text=True, timeout=BUILD_TIMEOUT_S)
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, log[-5000:]
    (made,) = out.iterdir()
    return made, log


def _metadata(text: str):
    return email.parser.Parser().parsestr(text)


@pytest.fixture(scope="module")
def wheel(tmp_path_factory):
    if not list((REPO / "build").glob("temp.*/build.ninja")):
        message = ("no earlier build of the extension in build/temp.*/ to reuse (this checkout's extension was "
                   "copied in or built elsewhere): the wheel would compile everything; `make build` makes one")
        if ON_CI:
            pytest.fail(f"{message}. On CI, `make setup` must have left it: check setup.py's BUILD_TEMP")
        pytest.skip(message)
    path, log = _build("wheel", tmp_path_factory.mktemp("wheel"))
    compiled = re.findall(r"^\[\d+/\d+\] .*", log, flags=re.MULTILINE)
    if compiled:
        message = (f"the wheel build compiled {len(compiled)} objects instead of reusing the set-up's "
                   f"(sources or flags changed since): {compiled[0][:200]}")
        if ON_CI:  # right after `make setup`, with the same environment: nothing is left to compile
            pytest.fail(message)
        warnings.warn(message)
    return path


@pytest.fixture(scope="module")
def venv_python(wheel, tmp_path_factory):
    """A fresh virtual environment over the system's packages, with the wheel installed into it: its python."""
    venv = tmp_path_factory.mktemp("venv")
    # --without-pip: the environment runs the system's pip, which installs into the environment. (ensurepip
    # would also install an old setuptools there, taking precedence over the system's.)
    subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", "--without-pip", str(venv)], check=True)
    python = venv / "bin" / "python"
    # --no-deps: torch is the system's; --ignore-installed: the checkout's editable install is the same version,
    # and pip would otherwise call the requirement satisfied by it.
    proc = subprocess.run([str(python), "-m", "pip", "install", "--no-deps", "--ignore-installed", "--no-index",
                           str(wheel)], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return python


def _run_in_venv(python: Path, args, cwd: Path, timeout: int):
    """python `args` from cwd, a folder outside the checkout, with nothing of the checkout on the path."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    env.pop("DRO_EXT_FORCE_PYTHON", None)
    proc = subprocess.run([str(python), *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


def test_wheel_is_abi3_and_holds_the_extension_and_the_metadata(wheel):
    assert re.fullmatch(rf"dro_ext-{re.escape(dro_ext.__version__)}-cp310-abi3-linux_\w+\.whl", wheel.name), wheel.name
    with zipfile.ZipFile(wheel) as archive:
        names = set(archive.namelist())
        (metadata_name,) = [n for n in names if n.endswith(".dist-info/METADATA")]
        metadata = _metadata(archive.read(metadata_name).decode())
        (wheel_info_name,) = [n for n in names if n.endswith(".dist-info/WHEEL")]
        wheel_info = _metadata(archive.read(wheel_info_name).decode())
        library = archive.read("dro_ext/_C.abi3.so")
    packaged = {n for n in names if n.startswith("dro_ext/")}
    sources = {p.relative_to(REPO).as_posix() for p in (REPO / "dro_ext").rglob("*.py")}
    assert sources <= packaged, sorted(sources - packaged)
    assert {"dro_ext/_C.abi3.so", "dro_ext/py.typed"} <= packaged
    assert not [n for n in names if n.startswith(("csrc/", "tests/", "build/")) or n.endswith((".o", ".pyc"))]
    assert any(n.endswith(".dist-info/licenses/LICENSE") for n in names), sorted(names)
    assert wheel_info["Root-Is-Purelib"] == "false" and wheel_info["Tag"] == "-".join(wheel.stem.split("-")[-3:])
    assert metadata["Name"] == "dro_ext" and metadata["Version"] == dro_ext.__version__
    assert metadata["License-Expression"] == "BSD-3-Clause"
    assert set(metadata.get_all("Provides-Extra")) == EXTRAS
    requires = metadata.get_all("Requires-Dist")
    assert any(re.fullmatch(r"torch\s*>=.*", r) for r in requires), requires
    # The library links the CUDA side of torch exactly when setup.py compiled csrc/cuda.
    assert (b"libc10_cuda.so" in library) == _cuda_expected()


VENV_CHECK = textwrap.dedent("""
    import json, math, sys
    import torch
    import dro_ext

    report = {"file": dro_ext.__file__, "prefix": sys.prefix, "backend": dro_ext.backend(),
              "load_error": str(dro_ext._backend.load_error())}
    ops = sorted({n.split("::")[1].split(".")[0] for n in torch._C._dispatch_get_all_op_names()
                  if n.startswith("dro_ext::")})
    has = torch._C._dispatch_has_kernel_for_dispatch_key
    report["cpu_ops"] = [op for op in ops if has("dro_ext::" + op, "CPU")]
    report["cuda_ops"] = [op for op in ops if has("dro_ext::" + op, "CUDA")]

    # DROLoss (chi2, lam, eta = 0): value mean(lam psi*(l/lam)) with psi*(t) = -1 + (t+2)_+^2/4, and gradients
    # dL/dl_i = w_i/N, dL/deta = 1 - mean(w) with w = (t+2)_+/2; on a linear model, then one NormalizedSGD step
    # from zero momentum: p - lr g/(||g|| + eps), ||g|| over every parameter, eta included.
    torch.manual_seed(0)
    lam, lr, eps = 0.5, 0.1, 1e-8
    model = torch.nn.Linear(5, 1).double()
    criterion = dro_ext.DROLoss("chi2", lam=lam).double()
    x, y = torch.randn(37, 5, dtype=torch.float64), torch.randn(37, dtype=torch.float64)
    per_sample = (model(x).squeeze(1) - y) ** 2
    per_sample.retain_grad()
    value = criterion(per_sample)
    value.backward()
    params = [*model.parameters(), *criterion.parameters()]
    before = [p.detach().clone() for p in params]
    grads = [p.grad.clone() for p in params]
    optimizer = dro_ext.NormalizedSGD(params, lr=lr, momentum=0.9, eps=eps)
    optimizer.step()

    l = per_sample.detach()
    t = l / lam
    w = (t + 2).clamp(min=0) / 2
    expected_value = (lam * (-1 + (t + 2).clamp(min=0) ** 2 / 4)).mean()
    norm = math.sqrt(sum(float((g * g).sum()) for g in grads))
    report["value_error"] = abs(value.item() - expected_value.item()) / abs(expected_value.item())
    report["loss_grad_error"] = float((per_sample.grad - w / len(l)).abs().max() / (w / len(l)).abs().max())
    report["eta_grad_error"] = abs(criterion.eta.grad.item() - (1 - w.mean().item()))
    report["step_error"] = max(float((p.detach() - (b - lr * g / (norm + eps))).abs().max())
                               for p, b, g in zip(params, before, grads)) / lr
    print(json.dumps(report))
""")


def test_installed_wheel_loads_its_kernels_and_computes(venv_python, tmp_path):
    import json

    proc = _run_in_venv(venv_python, ["-c", VENV_CHECK], cwd=tmp_path, timeout=300)
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    venv = venv_python.parent.parent
    # The wheel's files, not the checkout's (its editable install or its source tree).
    assert Path(report["file"]).resolve().is_relative_to((venv / "lib").resolve()), report["file"]
    assert Path(report["prefix"]).resolve() == venv.resolve()
    assert report["backend"] == "native", report["load_error"]
    for op in ("dro_loss", "dro_loss_backward", "normalized_sgd_step_", "robust_objective"):
        assert op in report["cpu_ops"], (op, report["cpu_ops"])
    if _cuda_expected():
        assert report["cuda_ops"] and set(report["cpu_ops"]) <= set(report["cuda_ops"]), report
    else:
        assert report["cuda_ops"] == []
    for key in ("value_error", "loss_grad_error", "eta_grad_error", "step_error"):
        assert report[key] < 1e-12, (key, report[key])


def test_installed_wheel_runs_the_quick_demo(venv_python, tmp_path):
    # The demo's extras (scikit-learn, matplotlib, tqdm) come from the system's packages, as `make setup` installs
    # them. --quick is the demo's smallest run.
    proc = _run_in_venv(venv_python, ["-m", "dro_ext.demo", "--quick", "--out", "demo"], cwd=tmp_path, timeout=600)
    assert sorted(p.name for p in (tmp_path / "demo").iterdir()) == ["figure.png", "report.md", "results.json",
                                                                    "tables.md"]
    assert "claim (a) reproduced:" in proc.stdout


def test_sdist_holds_every_source_the_build_needs(tmp_path):
    sdist, _ = _build("sdist", tmp_path)
    prefix = f"dro_ext-{dro_ext.__version__}/"
    assert sdist.name == f"dro_ext-{dro_ext.__version__}.tar.gz"
    with tarfile.open(sdist) as archive:
        members = {m.name[len(prefix):] for m in archive.getmembers() if m.isfile() and m.name.startswith(prefix)}
        metadata = _metadata(archive.extractfile(prefix + "PKG-INFO").read().decode())
    sources = {p.relative_to(REPO).as_posix() for p in (REPO / "csrc").rglob("*") if p.suffix in SOURCE_SUFFIXES}
    assert len(sources) > 20 and {s for s in sources if s.endswith((".cu", ".cuh"))}, sorted(sources)
    missing = sorted((sources | set(SDIST_FILES)) - members)
    assert not missing, f"the sdist lacks {missing}: add them to MANIFEST.in"
    assert not [m for m in members if m.endswith((".so", ".o", ".pyc")) or m.startswith(("build/", "tests/"))]
    assert metadata["Version"] == dro_ext.__version__ and metadata["License-Expression"] == "BSD-3-Clause"
    assert set(metadata.get_all("Provides-Extra")) == EXTRAS
