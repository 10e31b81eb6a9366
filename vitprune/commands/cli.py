"""The ``vitprune`` command."""

from __future__ import annotations

import argparse
import sys
from typing import Optional, Sequence

from . import bench, demo, show


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="vitprune", description="Patch pruning for timm Vision Transformers.")
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    demo.add_parser(subparsers)
    bench.add_parser(subparsers)
    show.add_parser(subparsers)
    return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    return args.run(args)


if __name__ == "__main__":
    sys.exit(main())
