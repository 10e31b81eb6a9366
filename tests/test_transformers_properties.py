"""Property test of the ``transformers`` models: random models, attention implementations,
options (valid and not; ``overlap_stride`` is refused there, timm only) and inputs, each
draw checked as ``test_properties.py`` checks timm's (``property_checks.check_any_options``).
"""

import copy

import torch
from hypothesis import example, given
from hypothesis import strategies as st

from conftest import require_transformers
from property_checks import PROFILE, check_any_options, options

require_transformers()

import vitprune  # noqa: E402
from test_transformers import MODELS, build, images, main_output  # noqa: E402

_built = {}


def fresh(name, attn_implementation):
    """A new copy of the model (built once per session and implementation)."""
    if (name, attn_implementation) not in _built:
        _built[name, attn_implementation] = build(name, attn_implementation)
    return copy.deepcopy(_built[name, attn_implementation])


@PROFILE
@example(name="ViTForImageClassification", attn_implementation="eager",
         chosen={"keep_rate": 1.0, "indicator": "var", "stages": "all"}, batch=2, dtype=torch.float64)
@example(name="SiglipVisionModel (attention-pool head)", attn_implementation="sdpa", chosen={"keep_rate": 0.5},
         batch=3, dtype=torch.float64)
@given(name=st.sampled_from(sorted(MODELS)), attn_implementation=st.sampled_from(["eager", "sdpa"]), chosen=options,
       batch=st.integers(0, 3), dtype=st.sampled_from([torch.float32, torch.float64]))
def test_any_options_and_inputs(name, attn_implementation, chosen, batch, dtype):
    model = fresh(name, attn_implementation).to(dtype)
    check_any_options(model, lambda model, x: main_output(model(pixel_values=x)), images(batch, seed=batch).to(dtype),
                      chosen)
