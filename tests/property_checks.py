"""What the property tests draw (``patch`` options, valid and not; how many examples) and
what they check of every draw.

Shared by ``test_properties.py`` (timm) and ``test_transformers_properties.py``. The default
profile draws ``PROPERTY_EXAMPLES`` examples (the same ones every run);
``VITPRUNE_PROPERTIES=slow`` draws ten times as many, new ones each run.
"""

import math
import os
from typing import Any, Callable, Dict

import torch
from hypothesis import HealthCheck, event, settings
from hypothesis import strategies as st

import vitprune
from conftest import assert_same, snapshot

PROPERTY_EXAMPLES = 60
PROFILES = {
    "fast": settings(max_examples=PROPERTY_EXAMPLES, deadline=None, derandomize=True,
                     suppress_health_check=[HealthCheck.too_slow]),
    "slow": settings(max_examples=10 * PROPERTY_EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.too_slow]),
}

VALID = {
    "indicator": [None, "var", "medad", "cls", "random", "lowvar"],
    "keep_rate": [1.0, 0.9, 0.7, 0.5, 0.25, 0.01],
    "stages": [None, "spread", "spread2", "spread3", "all", (), (0,), (1, 3), (2,)],
    "T": [1.0, 0.3, 1e-30, math.inf],
    "selection": ["top", "redundant", "bipartite"],
    "reduction": ["merge", "fuse", "drop"],
    "size_aware": [True, False],
    "overlap_stride": [None, None, None, 8],
    "seed": [None, 0],
    "class_only_last": [False, True],
    "crowding": [None, 0.0, 0.5, 2.0],
}
INVALID = {
    "indicator": ["entropy", 3],
    "keep_rate": [0.0, -0.5, 1.5, math.nan, "0.7", True],
    "stages": [(3, 1), (1, 1), (9,), (-1,), "some", 2.5],
    "T": [0.0, -1.0, math.nan, "hot"],
    "selection": ["best", None],
    "reduction": ["pool", 1],
    "size_aware": [1, None, "yes"],
    "overlap_stride": [0, 99, 4.0],
    "seed": [-3, "x", 1.5],
    "class_only_last": [1, None],
    "crowding": [-1.0, math.nan, math.inf, "x"],
}
valid_options = st.fixed_dictionaries({}, optional={key: st.sampled_from(v) for key, v in VALID.items()})
any_options = st.fixed_dictionaries({}, optional={key: st.sampled_from(VALID[key] + v) for key, v in INVALID.items()})
options = st.one_of(valid_options, any_options)

#: The profile ``VITPRUNE_PROPERTIES`` names (``fast`` when unset).
PROFILE = PROFILES[os.environ.get("VITPRUNE_PROPERTIES", "fast")]


def check_any_options(model: torch.nn.Module, forward: Callable[[torch.nn.Module, torch.Tensor], torch.Tensor],
                      x: torch.Tensor, chosen: Dict[str, Any]) -> None:
    """Patch ``model`` with ``chosen`` and check it: options refused (``ValueError`` or
    ``TypeError``) leave it bit-identical and unpatched; accepted ones give finite outputs of
    the unpatched shape; keep 1.0 (at the model's own grid) equals the unpatched model; in
    float64 a batch gives every image what it gives alone (random scores aside: they are
    drawn per batch); ``unpatch`` restores everything. ``forward(model, x)`` is the output a
    user reads."""
    batch, dtype = x.shape[0], x.dtype
    with torch.no_grad():
        try:
            expected = forward(model, x)
        except RuntimeError:  # the model's own code cannot reshape an empty batch (timm's Eva, BEiT)
            assert batch == 0
            expected = None
    before = snapshot(model)
    try:
        vitprune.patch(model, **chosen)
    except (TypeError, ValueError) as error:
        event(f"refused: {type(error).__name__}")
        assert_same(before, snapshot(model))
        assert not vitprune.is_patched(model)
        return
    event("patched")
    config = vitprune.get_config(model)
    with torch.no_grad():
        try:
            got = forward(model, x)
        except RuntimeError:
            assert expected is None
            got = None
        if expected is not None:
            assert got.shape == expected.shape
            assert torch.isfinite(got).all()
            if all(rate == 1.0 for rate in config.keep_rate) and config.overlap_stride is None:
                event("patched, keep 1.0")
                tolerance = {"rtol": 1e-4, "atol": 1e-5} if dtype == torch.float32 else {"rtol": 1e-9, "atol": 1e-10}
                torch.testing.assert_close(got, expected, **tolerance)
            if dtype == torch.float64 and batch >= 2 and config.indicator != "random":
                event("patched, batch against each image alone")
                alone = torch.cat([forward(model, image.unsqueeze(0)) for image in x])
                torch.testing.assert_close(got, alone, rtol=1e-9, atol=1e-10)
    vitprune.unpatch(model)
    assert_same(before, snapshot(model))
    with torch.no_grad():
        if expected is not None:
            assert torch.equal(forward(model, x), expected)
