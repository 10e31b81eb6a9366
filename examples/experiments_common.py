"""What the experiment scripts share: their inputs (checkpoints and test data from the
command line) and their results files (``docs/results/NAME.json`` with the command that
wrote them). Scaffolding for this repository's experiments, not part of the library."""

from __future__ import annotations

import argparse
import json
import shlex
import sys
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch

from vitprune.core.config import PAPER_OPTIONS, spread_blocks
from vitprune.data.datasets import load
from vitprune.data.shipped import load_checkpoint


def paper_method(indicator: str, seed: Optional[int] = None, **options: Any) -> Dict[str, Any]:
    """``patch`` options for the paper's method with ``indicator`` (``PAPER_OPTIONS``: its three
    stages, the top-scored tokens kept, one fusion token, plain attention), ``options``
    overriding them; ``seed`` seeds the random indicator (the other indicators take none).
    The experiments on the paper's indicators measured this; naming the indicator alone would
    run the library's schedule and reduction with a top-k selection."""
    seeded = {"seed": seed} if indicator == "random" else {}
    return {**PAPER_OPTIONS, "indicator": indicator, **seeded, **options}


def experiment_inputs(description: str) -> Tuple[argparse.Namespace, List[Tuple[torch.nn.Module, Dict[str, Any]]],
                                                 Dict[str, Tuple[torch.Tensor, torch.Tensor]]]:
    """The experiment scripts' common start: ``--checkpoints`` and ``--docs`` parsed, the
    checkpoints loaded, and the test split (or its first ``--limit`` images) of every
    dataset they were trained on."""
    parser = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--checkpoints", nargs="+", required=True, help="from examples/train_small_vit.py")
    parser.add_argument("--docs", default="docs", help="where the tables, plots and results/ go")
    parser.add_argument("--limit", type=int, default=None,
                        help="evaluate on the first LIMIT test images only (default: the whole split)")
    args = parser.parse_args()
    models = [load_checkpoint(Path(p)) for p in args.checkpoints]
    test = {d: load(d, "test") for d in {record["dataset"] for _, record in models}}
    if args.limit is not None:
        test = {d: (images[:args.limit], labels[:args.limit]) for d, (images, labels) in test.items()}
    return args, models, test


def save_results(docs: str, name: str, rows: Sequence[Dict[str, Any]],
                 commands: Optional[Sequence[str]] = None) -> str:
    """Write ``docs/results/NAME.json`` with the command that produced it (and, for merged
    results, the commands of the runs merged); return the command."""
    command = "python " + " ".join(shlex.quote(a) for a in sys.argv)
    folder = Path(docs) / "results"
    folder.mkdir(parents=True, exist_ok=True)
    record: Dict[str, Any] = {"command": command, "rows": list(rows)}
    if commands is not None:
        record["merged_commands"] = list(commands)
    (folder / f"{name}.json").write_text(json.dumps(record, indent=1))
    return command


def merge_results(paths: Sequence[str]) -> Tuple[List[Dict[str, Any]], List[str]]:
    """The rows of several results JSON files (as ``save_results`` writes them) and the
    commands that produced them, in order."""
    rows: List[Dict[str, Any]] = []
    commands: List[str] = []
    for path in paths:
        record = json.loads(Path(path).read_text())
        rows += record["rows"]
        commands += record.get("merged_commands", [record["command"]])
    return rows, commands


def every_stages(depth: int, step: int, class_only_last: bool = False) -> Tuple[int, ...]:
    """Stages in every ``step``-th of ``depth`` blocks, counted back from the last block as
    ``stages="spread2"``/``"spread3"`` count them (``spread_blocks``): ``(1, 3, ..., 11)`` and
    ``(2, 5, 8, 11)`` of 12. With ``class_only_last`` the last block computes the class token
    alone and is no stage (a stage there would give the same logits). Where ``step`` divides
    ``depth`` (the 6- and 12-block models of docs/) these are the blocks ``step - 1, 2 step - 1,
    ...`` that the experiments recorded there ran."""
    if step < 1:
        raise ValueError(f"step must be a positive number of blocks, got {step}")
    blocks = spread_blocks(depth, step)  # always ends at the last block
    return blocks[:-1] if class_only_last else blocks
