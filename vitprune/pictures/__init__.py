"""Pictures of what a pruned model keeps (matplotlib, imported when a figure is drawn)."""

from __future__ import annotations

from typing import Any, Literal, Tuple, get_args

#: What ``visualize`` draws per stage: the kept patches, or the groups each token holds
#: (here, not in ``visualize``, so the command line reads it without importing torch).
Show = Literal["kept", "groups"]
SHOW: Tuple[str, ...] = get_args(Show)


def pyplot(files_only: bool = False) -> Any:
    """``matplotlib.pyplot``, or an ``ImportError`` that says how to install it.

    Args:
        files_only: Use the Agg backend (a command writing files: no window), unless a
            backend was chosen already.
    """
    try:
        import matplotlib
    except ImportError:
        raise ImportError("drawing needs matplotlib: pip install 'vitprune[plot]' (or matplotlib)") from None
    if files_only:
        matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt

    return plt
