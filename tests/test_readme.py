"""The values the README's code comments show are what the code returns.

DeiT-S at 224 with random weights (FLOP counts and fits do not depend on the weights).
Each test reads the README, so a stale comment, or a change of the code that makes one
stale, fails here.
"""

from __future__ import annotations

import ast
import copy
import re
from pathlib import Path
from typing import Any, Dict

import pytest
import timm
import torch

import vitprune

README = Path(__file__).resolve().parents[1] / "README.md"


def _line(marker: str) -> str:
    """The one README line holding ``marker``."""
    lines = [line for line in README.read_text(encoding="utf-8").splitlines() if marker in line]
    assert len(lines) == 1, f"README should hold exactly one line with {marker!r}, found {len(lines)}"
    return lines[0]


def _comment(marker: str) -> str:
    return _line(marker).split("#", 1)[1]


def _keywords(marker: str) -> Dict[str, Any]:
    """The literal keyword arguments of the call (``f(...)`` or ``name = f(...)``) that starts on
    the README line with ``marker``, read over as many lines as the call takes."""
    lines = README.read_text(encoding="utf-8").splitlines()
    start = lines.index(_line(marker))
    for end in range(start + 1, start + 10):
        try:
            statement = ast.parse("\n".join(line.strip() for line in lines[start:end])).body[0]
        except SyntaxError:
            continue
        call = statement.value  # type: ignore[attr-defined]
        return {keyword.arg: ast.literal_eval(keyword.value) for keyword in call.keywords if keyword.arg}
    raise AssertionError(f"no complete call starts on the README line with {marker!r}")


@pytest.fixture(scope="module")
def deit_small() -> torch.nn.Module:
    torch.manual_seed(0)
    return timm.create_model("deit_small_patch16_224").eval()


def test_fit_keep_rate_comment(deit_small):
    shown = float(re.search(r"-> ([0-9.]+)", _comment("fit_keep_rate(model, target_gflops=3.0)")).group(1))
    assert vitprune.fit_keep_rate(deit_small, target_gflops=3.0) == shown


def test_fit_overlap_comment(deit_small):
    paper = _keywords('paper = dict(indicator="medad"')
    shown = dict(re.findall(r"(\w+)=([0-9.]+)", _comment("option = vitprune.fit_overlap(model, **paper)")))
    option = vitprune.fit_overlap(deit_small, **paper)
    assert (option.stride, option.keep_rate, option.tokens) == (
        int(shown["stride"]), float(shown["keep_rate"]), int(shown["tokens"]))
    assert round(option.gflops, 3) == float(shown["gflops"])
    model = vitprune.patch(copy.deepcopy(deit_small), keep_rate=option.keep_rate, overlap_stride=option.stride,
                           **paper)  # the README's next line: the fitted model costs what the fit says
    assert vitprune.analytic_flops(model) / 1e9 == pytest.approx(option.gflops, rel=1e-12)
    assert vitprune.analytic_flops(model) <= vitprune.analytic_flops(deit_small)


def test_default_config_comment(deit_small):
    comment = _comment("vitprune.get_config(model)      #")
    rate = float(re.search(r"keep_rate=\(([0-9.]+), \.\.\.\)", comment).group(1))
    last = int(re.search(r"stages=\(0, 1, \.\.\., (\d+)\)", comment).group(1))
    config = vitprune.get_config(vitprune.patch(copy.deepcopy(deit_small), keep_rate=0.7))
    assert config.schedule() == (tuple(range(last + 1)), (rate,) * (last + 1))
    assert config.class_only_last is ("class_only_last=True" in comment)


def test_opening_flop_ratios(deit_small):
    comment = _comment("fewer FLOPs (the paper's keep 0.7")
    defaults, paper = (float(value) for value in re.findall(r"([0-9.]+)x", comment))
    unpruned = vitprune.analytic_flops(deit_small)
    options = _keywords("vitprune.patch(model, indicator=\"var\", keep_rate=0.7, stages=None")
    ratios = [unpruned / vitprune.analytic_flops(vitprune.patch(copy.deepcopy(deit_small), **kwargs))
              for kwargs in (dict(keep_rate=0.7), options)]
    assert (round(ratios[0], 1), round(ratios[1], 1)) == (defaults, paper)


def test_the_development_section_names_every_module():
    # README's map of the package ("Development") names each module, so a new one is described
    text = README.read_text(encoding="utf-8")
    section = text[text.index("## Development"):]
    package = README.parent / "vitprune"
    modules = sorted(path.relative_to(package).as_posix() for path in package.rglob("*.py")
                     if path.name not in ("__init__.py", "__main__.py"))
    assert len(modules) > 40
    missing = [module for module in modules if f"`{Path(module).name}`" not in section]
    assert not missing, f"README's Development section does not name {missing}"
    scripts = [path.name for path in (README.parent / "examples").iterdir() if path.suffix in (".py", ".sh")]
    assert len(scripts) > 20
    unnamed = [name for name in scripts if f"`{name}`" not in section
               and not (name.startswith("experiment_") and "`experiment_*.py`" in section)]
    assert not unnamed, f"README's Development section does not name the scripts {unnamed}"


def test_every_command_line_option_is_named():
    # each subcommand's options appear in the README (their meaning is in --help and there)
    import argparse

    from vitprune.commands.cli import build_parser

    text = README.read_text(encoding="utf-8")
    named = set(re.findall(r"--[a-z][a-z0-9-]*", text))
    subcommands = next(action for action in build_parser()._actions
                       if isinstance(action, argparse._SubParsersAction)).choices
    assert set(subcommands) == {"demo", "bench", "show", "eval"}
    missing = {name: sorted(option for action in sub._actions for option in action.option_strings
                            if option.startswith("--") and option != "--help" and option not in named)
               for name, sub in subcommands.items()}
    assert not any(missing.values()), f"README does not name these options: {missing}"
