"""Property test: random families, options (valid and not) and inputs, each draw checked by
``property_checks.check_any_options`` (refusals leave the model untouched; keep 1.0 equals
the unpatched model; a float64 batch gives every image what it gives alone; ``unpatch``
restores everything). How many draws: ``property_checks``.
"""

import copy

import torch
import pytest
from hypothesis import assume, example, given
from hypothesis import strategies as st

from conftest import FAMILIES, build
from property_checks import PROFILE, check_any_options, options

_built = {}


def fresh(name):
    """A new copy of the family's model (built once per session: building is the slow part)."""
    if name not in _built:
        try:
            _built[name] = build(name)
        except pytest.skip.Exception:  # not in this timm version: draw another
            assume(False)
    return copy.deepcopy(_built[name])


@PROFILE
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
    check_any_options(model, lambda model, x: model(x), x, chosen)
