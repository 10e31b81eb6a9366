"""Mean and spread over seeds, and markdown tables, for the experiment scripts."""

from __future__ import annotations

import statistics
from typing import Dict, Iterable, List, Sequence, Tuple


def mean_std(values: Sequence[float]) -> Tuple[float, float]:
    """Mean and sample standard deviation (0 for a single value)."""
    values = list(values)
    return statistics.fmean(values), (statistics.stdev(values) if len(values) > 1 else 0.0)


def summarise(rows: Iterable[Dict], keys: Sequence[str], value: str = "accuracy") -> List[Dict]:
    """Group ``rows`` by ``keys`` and give each group's mean, std and count of ``value``."""
    groups: Dict[tuple, List[float]] = {}
    for row in rows:
        groups.setdefault(tuple(row[k] for k in keys), []).append(row[value])
    out = []
    for group, values in groups.items():
        mean, std = mean_std(values)
        out.append({**dict(zip(keys, group)), "mean": mean, "std": std, "n": len(values)})
    return out


def markdown_table(header: Sequence[str], rows: Iterable[Sequence[object]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def percent(mean: float, std: float, n: int) -> str:
    """``89.12 ± 0.31`` in percent, or ``89.12`` for a single run."""
    return f"{100 * mean:.2f} ± {100 * std:.2f}" if n > 1 else f"{100 * mean:.2f}"
