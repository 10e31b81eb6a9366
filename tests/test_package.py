"""The package as installed: what importing it loads, its version, its public signature."""

import dataclasses
import inspect
import re
import subprocess
import sys
from importlib.metadata import version
from pathlib import Path

import pytest

import vitprune
from vitprune.commands.cli import main


def loaded_after(code):
    """The top-level modules a fresh interpreter has loaded after running ``code``."""
    probe = f"{code}\nimport sys\nprint(' '.join(sorted({{m.split('.')[0] for m in sys.modules}})))"
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True).stdout
    return set(out.split())


def test_importing_vitprune_and_building_the_command_line_load_no_heavy_library():
    heavy = {"torch", "timm", "fvcore", "matplotlib", "tqdm", "transformers"}
    assert not heavy & loaded_after("import vitprune")
    assert not heavy & loaded_after("from vitprune.commands.cli import build_parser; build_parser()")


def test_patching_loads_fvcore_and_matplotlib_only_when_their_feature_is_used():
    loaded = loaded_after("import timm, vitprune\nvitprune.patch(timm.create_model('deit_tiny_patch16_224'))")
    assert {"torch", "timm"} <= loaded and not {"fvcore", "matplotlib", "transformers"} & loaded


def test_version_matches_the_installed_distribution(capsys):
    assert vitprune.__version__ == version("vitprune")
    try:
        main(["--version"])
    except SystemExit as done:
        assert done.code == 0
    assert capsys.readouterr().out.strip() == f"vitprune {vitprune.__version__}"


def test_help_shows_defaults_as_plain_text(capsys):
    try:
        main(["show", "--help"])
    except SystemExit:
        pass
    text = capsys.readouterr().out
    assert "(default: 0.7)" in text and "random weights" in text and "``" not in text


@pytest.mark.parametrize("command", ["demo", "bench", "show", "eval"])
def test_help_states_each_default_once_and_only_where_there_is_one(command, capsys):
    try:
        main([command, "--help"])
    except SystemExit:
        pass
    text = " ".join(capsys.readouterr().out.split())  # argparse wraps lines
    assert "(default: None)" not in text and "(default: False)" not in text
    assert not re.search(r"\(default: [^)]*\) \(default:", text)
    if command == "eval":
        assert "--workers WORKERS data-loading worker processes (default: 0)" in text
        assert "/data/imagenet/val \\ --budgets" in text  # the example's line break, as typed


def test_patch_lists_every_option_as_a_typed_keyword():
    parameters = inspect.signature(vitprune.patch).parameters
    fields = [f.name for f in dataclasses.fields(vitprune.PruneConfig)]
    keywords = [name for name, p in parameters.items() if p.kind is inspect.Parameter.KEYWORD_ONLY]
    assert sorted(keywords) == sorted(fields + ["generator"])
    assert all(parameters[name].annotation is not inspect.Parameter.empty for name in keywords)


def test_every_public_name_resolves():
    for name in vitprune.__all__:
        assert getattr(vitprune, name) is not None, name


def test_dir_lists_every_public_name_once_after_use():
    vitprune.patch, vitprune.PruneConfig  # noqa: B018 (resolved and cached in the module)
    listed = dir(vitprune)
    assert len(listed) == len(set(listed)) and set(vitprune.__all__) <= set(listed)


def test_the_minimums_ci_installs_are_the_ones_pyproject_states():
    root = Path(__file__).resolve().parent.parent
    pins = dict(line.split("==") for line in (root / ".ci" / "minimum.txt").read_text().splitlines()
                if "==" in line and not line.startswith("#"))
    stated = re.findall(r'"(torch|timm)>=([0-9.]+)"', (root / "pyproject.toml").read_text())
    assert {name: version for name, version in stated} == {
        "torch": ".".join(pins["torch"].split(".")[:2]), "timm": pins["timm"]}


def test_ci_runs_the_minimums_on_the_oldest_python_pyproject_states():
    # .ci/run builds the minimum-versions environment from that Python where the machine has it
    root = Path(__file__).resolve().parent.parent
    oldest = re.search(r'requires-python = ">=([0-9.]+)"', (root / "pyproject.toml").read_text()).group(1)
    run = (root / ".ci" / "run").read_text()
    assert 'pythons="${PYENV_ROOT:-$HOME/.pyenv}/versions"' in run
    assert f'oldest="$(first_python "$pythons"/{oldest}*/bin/python python{oldest})"' in run
