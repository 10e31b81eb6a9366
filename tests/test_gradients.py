"""Gradients of a reduced model against finite differences, for every selection and reduction.

Which tokens go and where they join is piecewise constant in the input, so near a point
where no choice flips the reduced model is as smooth as the unreduced one, and autograd's
derivative along a direction must equal the central difference quotient there. float64
throughout; the fusion token is checked at ``T = inf`` (its weights at a finite ``T`` come
from float32 scores, whose rounding the quotient would read as an error).
"""

import copy
import math

import pytest
import torch

import vitprune
from conftest import build

#: selection x reduction, and one bipartite stage that removes more than half its tokens
#: (several rounds of matching, merged by ``merging.merge_tokens``).
#: The score-based selections read the class token's attention (``cls``); ``T = inf`` (above).
CASES = {f"{selection}, {reduction}": dict(selection=selection, reduction=reduction, keep_rate=0.5,
                                           **({"T": math.inf} if reduction == "fuse" else {}),
                                           **({} if selection == "bipartite" else {"indicator": "cls"}))
         for selection in ("top", "redundant", "bipartite") for reduction in ("merge", "fuse", "drop")}
CASES["bipartite rounds, merge"] = dict(keep_rate=0.3, stages=(1,))

_built = {}


def model_of(name):
    if name not in _built:
        _built[name] = build(name).double()
    return copy.deepcopy(_built[name])


def directional_errors(model, x, directions=2, eps=1e-6):
    """Relative differences between autograd's derivative of a random projection of the
    output along random directions and the central difference quotient."""
    weight = torch.randn(model(x).shape, dtype=x.dtype, generator=torch.Generator().manual_seed(3))

    def f(z):
        return (model(z) * weight).sum()

    gradient, = torch.autograd.grad(f(x.requires_grad_(True)), x)
    errors = []
    for k in range(directions):
        d = torch.randn(x.shape, dtype=x.dtype, generator=torch.Generator().manual_seed(10 + k))
        with torch.no_grad():
            quotient = (f(x + eps * d) - f(x - eps * d)).item() / (2 * eps)
        exact = (gradient * d).sum().item()
        errors.append(abs(quotient - exact) / abs(exact))
    return errors


@pytest.mark.parametrize("options", CASES.values(), ids=CASES.keys())
@pytest.mark.parametrize("name", ["gap, no class token", "ResPostBlock"])
def test_gradients_equal_finite_differences(name, options):
    model = vitprune.patch(model_of(name), **options)
    x = torch.randn(2, 3, *model.patch_embed.img_size, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    assert max(directional_errors(model, x)) < 1e-6


@pytest.mark.parametrize("options", [CASES["top, merge"], CASES["redundant, fuse"], CASES["bipartite rounds, merge"]],
                         ids=["top, merge", "redundant, fuse", "bipartite rounds, merge"])
@pytest.mark.parametrize("name", ["DeiTForImageClassificationWithTeacher", "SiglipVisionModel (attention-pool head)"])
def test_transformers_gradients_equal_finite_differences(name, options):
    """The same through a ``transformers`` layer (SDPA: their eager softmax runs in float32,
    whose rounding the quotient would read as an error)."""
    from conftest import require_transformers
    require_transformers()
    from test_transformers import MainOutput, build as build_hf, images

    model = vitprune.patch(build_hf(name, "sdpa").double(), **options)
    assert max(directional_errors(MainOutput(model), images(2).double())) < 1e-6
