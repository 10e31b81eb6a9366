"""Accuracy against GFLOPs, or against measured speedup: one line per method, the unpruned
model as a point, every point labelled with its keep rate or FLOP budget, and the Pareto
front marked."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Dict, List, Literal, Sequence, Tuple, get_args

from . import pyplot

if TYPE_CHECKING:  # matplotlib is an optional extra, imported when a figure is drawn
    from matplotlib.figure import Figure

#: What a frontier's horizontal axis shows: analytic GFLOPs per image (fewer is better) or the
#: speedup measured against the unpruned model in the same run (more is better).
Axis = Literal["gflops", "speedup"]
AXES: Tuple[Axis, ...] = get_args(Axis)
_AXIS_LABELS = {"gflops": "GFLOPs per image", "speedup": "speedup over the unpruned model (measured)"}


def pareto_front(points: Sequence[Sequence[float]]) -> List[int]:
    """Indices of the ``(cost, accuracy)`` points no other point beats: none has at most
    their cost (GFLOPs, or minus a speedup) and at least their accuracy, better in one. In
    order of cost."""
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


def draw_frontier(rows: Sequence[Dict[str, Any]], title: str, metric: str = "top1", axis: Any = None,
                  x: Axis = "gflops") -> "Figure":
    """A ``matplotlib`` figure of ``rows`` (``vitprune.measure.evaluate.Row`` dicts: ``setting``,
    ``method``, ``keep_rate``, ``budget``, ``gflops`` (or ``speedup``) and ``metric`` in
    percent); drawn into ``axis`` when given (and its figure returned).

    Args:
        x: The horizontal axis, ``"gflops"`` or ``"speedup"``; the Pareto front is of the
            points no other beats at a lower cost (fewer GFLOPs, or a higher speedup).
    """
    if x not in AXES:
        raise ValueError(f"x must be one of {AXES}, got {x!r}")
    if axis is None:
        figure, axis = pyplot().subplots(figsize=(6.5, 4.5))
    else:
        figure = axis.figure
    lines: Dict[str, List[Dict[str, Any]]] = {}
    for row in rows:
        if row["method"] != "unpruned":
            lines.setdefault(line_name(row), []).append(row)
    for name, members in lines.items():
        members = sorted(members, key=lambda r: r[x])
        axis.plot([r[x] for r in members], [r[metric] for r in members], marker="o", label=name)
        for r in members:
            axis.annotate(point_label(r), (r[x], r[metric]), textcoords="offset points", xytext=(4, 4),
                          fontsize=7)
    for row in rows:
        if row["method"] == "unpruned":
            axis.plot([row[x]], [row[metric]], marker="*", markersize=13, color="black", linestyle="",
                      label="unpruned")
    sign = 1.0 if x == "gflops" else -1.0  # the front is of the cheapest: fewest GFLOPs, highest speedup
    front = pareto_front([(sign * r[x], r[metric]) for r in rows])
    axis.plot([rows[i][x] for i in front], [rows[i][metric] for i in front], linestyle=":", color="grey",
              marker="o", markersize=11, markerfacecolor="none", label="Pareto front")
    axis.set_xlabel(_AXIS_LABELS[x])
    axis.set_ylabel("top-1 accuracy (%)" if metric == "top1" else f"{metric} (%)")
    axis.set_title(title, fontsize=10)
    axis.grid(alpha=0.3)
    axis.legend(fontsize=8)
    figure.tight_layout()
    return figure


def draw_frontiers(rows: Sequence[Dict[str, Any]], title: str, axes: Sequence[Any]) -> None:
    """:func:`draw_frontier` of ``rows`` against each of :data:`AXES` in turn, into ``axes``
    (one per axis: against GFLOPs, then against the measured speedup)."""
    if len(axes) != len(AXES):
        raise ValueError(f"need {len(AXES)} axes, one for each of {AXES}, got {len(axes)}")
    for axis, x in zip(axes, AXES):
        draw_frontier(rows, title, axis=axis, x=x)
