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


@pytest.mark.slow
def test_documented_calls_type_check_and_misuses_do_not(tmp_path):
    pytest.importorskip("mypy")
    # The package as source (the editable install's import hook is invisible to mypy); errors
    # inside it are not reported, as for an installed package: only the calls are checked.
    result = subprocess.run(
        [sys.executable, "-m", "mypy", "--strict", "--warn-unused-ignores", "--follow-imports=silent",
         "--cache-dir", str(tmp_path), "--no-error-summary", str(ROOT / "tests" / "typecheck" / "public_api.py")],
        capture_output=True, text=True, cwd=ROOT, env={**os.environ, "MYPYPATH": str(ROOT)})
    assert result.returncode == 0, result.stdout + result.stderr
