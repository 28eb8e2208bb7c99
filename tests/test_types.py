"""The package's annotations, as a user's type checker reads them (dro_ext ships a py.typed marker).

mypy runs over dro_ext/ with the configuration in pyproject.toml ([tool.mypy]): every function annotated, every body
checked. Its cache lives in build/.mypy_cache (the configuration's cache_dir), outside the sources; a clean checkout
creates it on the first run, and later runs re-read only the modules that changed.
"""
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytest.importorskip("mypy", reason="mypy is not installed (it is in the test extra: pip install -e .[test])")

REPO = Path(__file__).resolve().parents[1]
# Not a timing assertion: a bound on a hung type checker (a first run over dro_ext takes tens of seconds).
MYPY_TIMEOUT_S = 900


def _mypy(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "mypy", *args], cwd=cwd, capture_output=True, text=True,
                          timeout=MYPY_TIMEOUT_S)


def test_package_type_checks():
    # No arguments: pyproject.toml names the files (dro_ext) and every setting, as for `python -m mypy` by hand.
    result = _mypy(cwd=REPO)
    assert result.returncode == 0, f"mypy reports errors in dro_ext:\n{result.stdout}{result.stderr}"


def test_configuration_requires_annotations(tmp_path):
    # The configuration itself, on a module beside the package: an unannotated function is an error, and so is a
    # type error in an unannotated body (so a new public function without annotations fails the test above).
    module = tmp_path / "unannotated.py"
    module.write_text(textwrap.dedent("""\
        def public(x):
            return x

        def typed() -> None:
            def untyped_inner():
                return 1 + "one"
    """))
    result = _mypy("--config-file", str(REPO / "pyproject.toml"), "--cache-dir", str(tmp_path / "cache"),
                   str(module), cwd=tmp_path)
    output = result.stdout + result.stderr
    assert result.returncode == 1, output
    assert "unannotated.py:1: error: Function is missing a type annotation" in output, output
    assert 'Unsupported operand types for + ("int" and "str")' in output, output
