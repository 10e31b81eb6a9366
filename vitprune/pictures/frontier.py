"""Accuracy against GFLOPs: one line per method, the unpruned model as a point, every point
labelled with its keep rate or FLOP budget, and the Pareto front marked."""

from __future__ import annotations

from typing import Any, Dict, List, Sequence

from . import pyplot


def pareto_front(points: Sequence[Sequence[float]]) -> List[int]:
    """Indices of the ``(gflops, accuracy)`` points no other point beats: none has at most
    their FLOPs and at least their accuracy, better in one. In order of FLOPs."""
    front = []
    for i, (flops, accuracy) in enumerate(points):
        beaten = any((f <= flops and a >= accuracy) and (f < flops or a > accuracy)
                     for j, (f, a) in enumerate(points) if j != i)
        if not beaten:
            front.append(i)
    return sorted(front, key=lambda i: points[i][0])


def point_label(row: Dict[str, Any]) -> str:
    if row.get("budget") is not None:
        return f"{row['budget']:.0%}"
    if row.get("keep_rate") is not None:
        return f"{row['keep_rate']:g}"
    return ""


def line_name(row: Dict[str, Any]) -> str:
    """The line a row belongs to: its setting without the keep rate or budget."""
    words = row["setting"].split()
    for marker in ("keep", "at"):
        if marker in words:
            return " ".join(words[:words.index(marker)])
    return " ".join(w for w in words if not w.endswith("%") and w != "FLOPs")


def draw_frontier(rows: Sequence[Dict[str, Any]], title: str, metric: str = "top1", axis: Any = None):
    """A ``matplotlib`` figure of ``rows`` (``vitprune.measure.evaluate.Row`` dicts: ``setting``,
    ``method``, ``keep_rate``, ``budget``, ``gflops`` and ``metric`` in percent); drawn into
    ``axis`` when given (and its figure returned)."""
    if axis is None:
        figure, axis = pyplot().subplots(figsize=(6.5, 4.5))
    else:
        figure = axis.figure
    lines: Dict[str, List[Dict[str, Any]]] = {}
    for row in rows:
        if row["method"] != "unpruned":
            lines.setdefault(line_name(row), []).append(row)
    for name, members in lines.items():
        members = sorted(members, key=lambda r: r["gflops"])
        axis.plot([r["gflops"] for r in members], [r[metric] for r in members], marker="o", label=name)
        for r in members:
            axis.annotate(point_label(r), (r["gflops"], r[metric]), textcoords="offset points", xytext=(4, 4),
                          fontsize=7)
    for row in rows:
        if row["method"] == "unpruned":
            axis.plot([row["gflops"]], [row[metric]], marker="*", markersize=13, color="black", linestyle="",
                      label="unpruned")
    points = [(r["gflops"], r[metric]) for r in rows]
    front = pareto_front(points)
    axis.plot([points[i][0] for i in front], [points[i][1] for i in front], linestyle=":", color="grey",
              marker="o", markersize=11, markerfacecolor="none", label="Pareto front")
    axis.set_xlabel("GFLOPs per image")
    axis.set_ylabel("top-1 accuracy (%)" if metric == "top1" else f"{metric} (%)")
    axis.set_title(title, fontsize=10)
    axis.grid(alpha=0.3)
    axis.legend(fontsize=8)
    figure.tight_layout()
    return figure
