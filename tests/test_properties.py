"""Property test: random families, options (valid and not) and inputs.

For every draw: invalid options raise ``ValueError``/``TypeError`` and leave the model
bit-identical; valid ones give finite outputs of the unpatched shape; keep 1.0 equals the
unpatched model; in float64 a batch gives every image what it gives alone (random scores
aside: they are drawn per batch); ``unpatch`` restores everything. The default profile draws
``PROPERTY_EXAMPLES`` examples (the same ones every run); ``VITPRUNE_PROPERTIES=slow`` draws
ten times as many, new ones each run.
"""

import copy
import math
import os

import torch
import pytest
from hypothesis import HealthCheck, assume, event, example, given, settings
from hypothesis import strategies as st

import vitprune
from conftest import FAMILIES, assert_same, build, snapshot

PROPERTY_EXAMPLES = 60
PROFILES = {
    "fast": settings(max_examples=PROPERTY_EXAMPLES, deadline=None, derandomize=True,
                     suppress_health_check=[HealthCheck.too_slow]),
    "slow": settings(max_examples=10 * PROPERTY_EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.too_slow]),
}

_built = {}


def fresh(name):
    """A new copy of the family's model (built once per session: building is the slow part)."""
    if name not in _built:
        try:
            _built[name] = build(name)
        except pytest.skip.Exception:  # not in this timm version: draw another
            assume(False)
    return copy.deepcopy(_built[name])


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
}
valid_options = st.fixed_dictionaries({}, optional={key: st.sampled_from(v) for key, v in VALID.items()})
any_options = st.fixed_dictionaries({}, optional={key: st.sampled_from(VALID[key] + v) for key, v in INVALID.items()})
options = st.one_of(valid_options, any_options)


@PROFILES[os.environ.get("VITPRUNE_PROPERTIES", "fast")]
@example(name="flexivit", chosen={"keep_rate": 1.0}, batch=2, dtype=torch.float32)
@example(name="gap, no class token", chosen={"keep_rate": 1.0, "indicator": "medad", "stages": "all"}, batch=1,
         dtype=torch.float64)
@example(name="Eva02 (rope, SwiGLU, avg pool)", chosen={"keep_rate": 1.0, "reduction": "fuse"}, batch=3,
         dtype=torch.float32)
@given(name=st.sampled_from(sorted(FAMILIES)), chosen=options, batch=st.integers(0, 3),
       dtype=st.sampled_from([torch.float32, torch.float64]))
def test_any_options_and_inputs(name, chosen, batch, dtype):
    model = fresh(name).to(dtype)
    x = torch.randn(batch, 3, *model.patch_embed.img_size, dtype=dtype, generator=torch.Generator().manual_seed(batch))
    with torch.no_grad():
        try:
            expected = model(x)
        except RuntimeError:  # timm's own Eva/BEiT attention cannot reshape an empty batch
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
    with torch.no_grad():
        try:
            got = model(x)
        except RuntimeError:
            assert expected is None
            got = None
    if expected is not None:
        assert got.shape == expected.shape
        assert torch.isfinite(got).all()
        if vitprune.get_config(model).keep_rate and all(r == 1.0 for r in vitprune.get_config(model).keep_rate) \
                and chosen.get("overlap_stride") is None:
            event("patched, keep 1.0")
            tolerance = {"rtol": 1e-4, "atol": 1e-5} if dtype == torch.float32 else {"rtol": 1e-9, "atol": 1e-10}
            torch.testing.assert_close(got, expected, **tolerance)
        if dtype == torch.float64 and batch >= 2 and vitprune.get_config(model).indicator != "random":
            event("patched, batch against each image alone")
            with torch.no_grad():
                alone = torch.cat([model(image.unsqueeze(0)) for image in x])
            torch.testing.assert_close(got, alone, rtol=1e-9, atol=1e-10)
    vitprune.unpatch(model)
    assert_same(before, snapshot(model))
    with torch.no_grad():
        if expected is not None:
            assert torch.equal(model(x), expected)
