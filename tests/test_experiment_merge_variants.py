"""The merge changes of examples/experiment_merge_variants.py, on a hand-computed case, and the
wrapper that applies them to a patched model's first rounds."""

import sys
from pathlib import Path

import pytest
import torch

import vitprune
from vitprune.core import merging, state
from vitprune.data.shipped import load_shipped

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))

import experiment_merge_variants as variants  # noqa: E402

# one prefix token, then four: destinations [3, 0] and [0, 2], candidates [0, 1] and [5, 5]
TOKENS = torch.tensor([[[9.0, 9.0], [3.0, 0.0], [0.0, 1.0], [0.0, 2.0], [5.0, 5.0]]])
# keys: the first candidate is a copy of the first destination, the second unlike both
KEYS = torch.tensor([[[[0.0, 0.0], [1.0, 0.0], [1.0, 0.0], [0.0, 1.0], [-1.0, 1.0]]]])


@pytest.fixture
def merged():
    merged = merging.bipartite_merge(TOKENS, KEYS, torch.ones(1, 4), k=3, num_prefix=1)
    assert merged.removed.tolist() == [[0]] and merged.dest.tolist() == [[0]]
    # [prefix, the candidate that stays, the two destinations]; [3, 0] and [0, 1] averaged
    assert torch.allclose(merged.tokens, torch.tensor([[[9.0, 9.0], [5.0, 5.0], [1.5, 0.5], [0.0, 2.0]]]))
    assert merged.sizes.tolist() == [[1.0, 2.0, 1.0]]
    return merged


def test_keeping_the_norm_rescales_a_destination_that_received_to_the_largest_norm_it_holds(merged):
    kept = variants.keep_norms(merged, TOKENS, 1)
    scale = 3.0 / torch.tensor([1.5, 0.5]).norm()  # the norms held are 3 and 1
    assert torch.allclose(kept.tokens[0, 2], torch.tensor([1.5, 0.5]) * scale)
    assert torch.equal(kept.tokens[:, [0, 1, 3]], merged.tokens[:, [0, 1, 3]])  # the rest bit for bit
    assert torch.equal(kept.sizes, merged.sizes)


def test_pruning_keeps_each_destination_as_it_was_and_its_size_as_merged(merged):
    pruned = variants.keep_destinations(merged, TOKENS, 1)
    assert torch.equal(pruned.tokens, torch.tensor([[[9.0, 9.0], [5.0, 5.0], [3.0, 0.0], [0.0, 2.0]]]))
    assert torch.equal(pruned.sizes, merged.sizes)  # the dropped candidate's patch still counted


def test_a_change_applies_to_the_first_rounds_of_every_forward_and_is_undone_on_leaving():
    model, _ = load_shipped("fashion_mnist")
    images = torch.randn(3, 1, 28, 28)
    vitprune.patch(model, keep_rate=0.6)
    plain = model(images)
    calls = []

    def record(merged, tokens, num_prefix):
        calls.append(tokens.shape[1])
        return merged

    library_merge, hooks = state.bipartite_merge, dict(model._forward_pre_hooks)
    with variants.changed_merges(model, record, rounds=2):
        model(images)
        model(images)
    # the first two rounds of each forward, in block order: the tokens each received
    first_two = calls[:2]
    assert len(calls) == 4 and calls == first_two * 2 and first_two[0] > first_two[1]
    with variants.changed_merges(model, variants.keep_norms):
        rescaled = model(images)
    assert state.bipartite_merge is library_merge and model._forward_pre_hooks == hooks
    assert not torch.allclose(rescaled, plain)
    assert torch.equal(model(images), plain)
    with pytest.raises(RuntimeError, match="inside"), variants.changed_merges(model, variants.keep_norms):
        raise RuntimeError("inside")
    assert state.bipartite_merge is library_merge and model._forward_pre_hooks == hooks
