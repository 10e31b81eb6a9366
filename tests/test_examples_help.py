"""Every example script answers ``--help`` with its usage and does nothing else: one that
imports a vitprune name since renamed, or that starts its work whatever its arguments say
(``make_pictures.py`` once did, writing over docs/images), fails here."""

import importlib
import sys
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
SCRIPTS = sorted(path.stem for path in EXAMPLES.glob("*.py") if "\ndef main(" in path.read_text())
#: Optional packages an example may import at its top: where one is missing, its test skips.
OPTIONAL = {"transformers", "sklearn", "matplotlib", "onnx", "onnxruntime", "onnxscript"}


def test_the_examples_are_found():
    assert {"finetune", "inference", "make_pictures", "experiment_merging"} <= set(SCRIPTS)


@pytest.mark.parametrize("name", SCRIPTS)
def test_every_example_answers_help_and_does_nothing_else(name, monkeypatch, capsys, tmp_path):
    monkeypatch.syspath_prepend(str(EXAMPLES))
    monkeypatch.chdir(tmp_path)  # a script that wrote anything would leave it here
    monkeypatch.setattr(sys, "argv", [f"{name}.py", "--help"])
    try:
        module = importlib.import_module(name)
    except ModuleNotFoundError as error:
        if error.name and error.name.split(".")[0] in OPTIONAL:
            pytest.skip(f"{name}.py needs {error.name}")
        raise
    with pytest.raises(SystemExit) as exited:
        module.main()
    assert exited.value.code == 0
    assert capsys.readouterr().out.startswith(f"usage: {name}.py")
    assert list(tmp_path.iterdir()) == []
