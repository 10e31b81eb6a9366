"""The norm-keeping merge of examples/experiment_norm_merge.py, on a hand-computed case, and its
wrapper around the library's merge."""

import sys
from pathlib import Path

import pytest
import torch

import vitprune
from vitprune.core import merging, state
from vitprune.data.shipped import load_shipped

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))

import experiment_norm_merge  # noqa: E402


def test_a_destination_that_receives_is_rescaled_to_the_largest_norm_it_holds():
    # one prefix token, then four: destinations 0 and 2, candidates 1 and 3
    tokens = torch.tensor([[[9.0, 9.0], [3.0, 0.0], [0.0, 1.0], [0.0, 2.0], [5.0, 5.0]]])
    # keys: the first candidate (token [0, 1]) is a copy of the first destination, the second unlike both
    keys = torch.tensor([[[[0.0, 0.0], [1.0, 0.0], [1.0, 0.0], [0.0, 1.0], [-1.0, 1.0]]]])
    merged = merging.bipartite_merge(tokens, keys, torch.ones(1, 4), k=3, num_prefix=1)
    assert merged.removed.tolist() == [[0]] and merged.dest.tolist() == [[0]]
    # the plain average of [3, 0] and [0, 1] is [1.5, 0.5]; the norm kept is 3, the larger
    kept = experiment_norm_merge.keep_norms(merged, tokens, 1)
    scale = 3.0 / torch.tensor([1.5, 0.5]).norm()
    expected = torch.tensor([[[9.0, 9.0], [5.0, 5.0], [1.5 * scale, 0.5 * scale], [0.0, 2.0]]])
    assert torch.allclose(merged.tokens, torch.tensor([[[9.0, 9.0], [5.0, 5.0], [1.5, 0.5], [0.0, 2.0]]]))
    assert torch.equal(kept.tokens[:, [0, 1, 3]], expected[:, [0, 1, 3]])  # the rest untouched, bit for bit
    assert torch.allclose(kept.tokens, expected)
    assert torch.equal(kept.sizes, merged.sizes)


def test_the_wrapper_changes_the_merged_tokens_only_inside_and_restores_the_merge():
    model, _ = load_shipped("fashion_mnist")
    images = torch.randn(3, 1, 28, 28)
    vitprune.patch(model, keep_rate=0.6)
    plain = model(images)
    library_merge = state.bipartite_merge
    with experiment_norm_merge.norm_keeping_merges():
        rescaled = model(images)
    assert state.bipartite_merge is library_merge
    assert not torch.allclose(rescaled, plain)
    assert torch.equal(model(images), plain)
    with pytest.raises(RuntimeError, match="inside"), experiment_norm_merge.norm_keeping_merges():
        raise RuntimeError("inside")
    assert state.bipartite_merge is library_merge
