"""The type hints as users' type checkers read them: the package says it has them (PEP 561's
``py.typed``), every documented call type-checks, and the misuses stay errors."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

import vitprune

ROOT = Path(__file__).resolve().parent.parent


def test_the_package_marks_itself_typed():
    assert (Path(vitprune.__file__).parent / "py.typed").is_file()
    package_data = re.search(r"\[tool\.setuptools\.package-data\]\s*vitprune\s*=\s*\[([^\]]*)\]",
                             (ROOT / "pyproject.toml").read_text())
    assert package_data is not None and '"py.typed"' in package_data.group(1)  # so wheels carry it


@pytest.fixture(scope="module")
def mypy_cache(tmp_path_factory):
    pytest.importorskip("mypy")
    return str(tmp_path_factory.mktemp("mypy_cache"))  # one cache for both checks


def run_mypy(cache, *arguments):
    return subprocess.run([sys.executable, "-m", "mypy", "--cache-dir", cache, "--no-error-summary", *arguments],
                          capture_output=True, text=True, cwd=ROOT, env={**os.environ, "MYPYPATH": str(ROOT)})


@pytest.mark.slow
def test_documented_calls_type_check_and_misuses_do_not(mypy_cache):
    # The package as source (the editable install's import hook is invisible to mypy); errors
    # inside it are not reported, as for an installed package: only the calls are checked.
    result = run_mypy(mypy_cache, "--strict", "--warn-unused-ignores", "--follow-imports=silent",
                      str(ROOT / "tests" / "typecheck" / "public_api.py"))
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.slow
def test_the_package_code_type_checks(mypy_cache):
    # its own annotations against its code, strict: every function annotated, no bare generics,
    # no call into its own unannotated code. pyproject.toml's [tool.mypy] adds what torch and timm
    # need (their re-exports by import, torch's unannotated functions) and leaves out the
    # warning on returning Any, which every nn.Module call does. The flags are named here too,
    # so a config loosened later still fails. Code mypy takes for unreachable is not checked at
    # all: `isinstance(n, Integral)` on an int once hid the rest of unmerge() from it, so
    # unreachable code is an error here.
    result = run_mypy(mypy_cache, "--strict", "--no-warn-return-any", "--warn-unreachable", str(ROOT / "vitprune"))
    assert result.returncode == 0, result.stdout + result.stderr
