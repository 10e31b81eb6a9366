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


def unique_runs(rows: Iterable[Dict], identity: Sequence[str], value: str = "accuracy") -> List[Dict]:
    """``rows`` with every run counted once: rows equal in ``identity`` (keys absent from a row
    read as ``None``) are one run recorded twice, as when two results files hold the same
    unpruned model. Raises ``ValueError`` when two such rows disagree on ``value``."""
    seen: Dict[tuple, Dict] = {}
    for row in rows:
        key = tuple(row.get(k) for k in identity)
        if key not in seen:
            seen[key] = row
        elif seen[key][value] != row[value]:
            raise ValueError(f"two runs of {dict(zip(identity, key))} disagree: {value} "
                             f"{seen[key][value]!r} and {row[value]!r}")
    return list(seen.values())


def paired(rows: Iterable[Dict], reference: str, match: Sequence[str], keys: Sequence[str],
           value: str = "accuracy") -> List[Dict]:
    """Each method's difference from ``reference`` run for run, grouped by ``keys``.

    A row is paired with the ``reference`` method's row that equals it in ``match`` (the
    model, the repeat, the budget); rows with no such partner are left out. Each group
    gets the mean and sample standard deviation of its differences, their count ``n``,
    and ``ahead``, how many are above zero.
    """
    rows = list(rows)
    partner = {tuple(r.get(k) for k in match): r[value] for r in rows if r["method"] == reference}
    groups: Dict[tuple, List[float]] = {}
    for row in rows:
        key = tuple(row.get(k) for k in match)
        if row["method"] != reference and key in partner:
            groups.setdefault(tuple(row[k] for k in keys), []).append(row[value] - partner[key])
    out = []
    for group, differences in groups.items():
        mean, std = mean_std(differences)
        out.append({**dict(zip(keys, group)), "mean": mean, "std": std, "n": len(differences),
                    "ahead": sum(d > 0 for d in differences)})
    return out


def markdown_table(header: Sequence[str], rows: Iterable[Sequence[object]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def percent(mean: float, std: float, n: int) -> str:
    """``89.12 ± 0.31`` in percent, or ``89.12`` for a single run."""
    return f"{100 * mean:.2f} ± {100 * std:.2f}" if n > 1 else f"{100 * mean:.2f}"
