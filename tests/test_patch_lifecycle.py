"""unpatch restores everything; patched models serialize, copy and re-patch cleanly."""

import copy
import io

import pytest
import torch
from torch.testing import assert_close

import vitprune
from vitprune.families.vit import PruneBlock
from conftest import assert_same, image_batch, make_model, paper, snapshot


def test_unpatch_restores_everything(tiny):
    x = image_batch(tiny)
    before = snapshot(tiny)
    with torch.no_grad():
        expected = tiny(x)
        assert vitprune.patch(tiny, keep_rate=0.5) is tiny
        assert type(tiny.blocks[3]) is PruneBlock and vitprune.is_patched(tiny)
        assert tiny(x).shape == expected.shape
        assert vitprune.unpatch(tiny) is tiny
        actual = tiny(x)
    assert not vitprune.is_patched(tiny)
    assert_same(before, snapshot(tiny))
    assert torch.equal(actual, expected)


def test_unpatch_of_an_unpatched_model_is_a_no_op(tiny):
    before = snapshot(tiny)
    vitprune.unpatch(tiny)
    assert_same(before, snapshot(tiny))


def test_patching_again_replaces_the_previous_patch(tiny):
    vitprune.patch(tiny, keep_rate=0.5, stages=(1, 2))
    vitprune.patch(tiny, indicator="medad", keep_rate=0.8, **paper(stages=(4,)))
    assert vitprune.get_config(tiny).stages == (4,)
    assert [type(b) is PruneBlock for b in tiny.blocks] == [i == 4 for i in range(12)]
    with torch.no_grad():
        tiny(image_batch(tiny))
    assert len(vitprune.kept_positions(tiny)) == 1


def test_get_config_reads_back_the_resolved_config(tiny):
    vitprune.patch(tiny, indicator="medad", keep_rate=0.6, T=0.5, fuse=True, stages=None)
    cfg = vitprune.get_config(tiny)
    # class_only_last=None is read back as what it became: on (a class-token head, no stage at the last block)
    assert cfg == vitprune.PruneConfig("medad", (0.6, 0.6, 0.6), (3, 6, 9), 0.5, True, class_only_last=True)


def test_patch_accepts_a_config_object_with_overrides(tiny):
    base = vitprune.PruneConfig(indicator="cls", keep_rate=0.9, stages=(2,))
    vitprune.patch(tiny, base, keep_rate=0.4)
    assert vitprune.get_config(tiny) == vitprune.PruneConfig("cls", (0.4,), (2,), class_only_last=True)


def test_state_dict_moves_between_patched_and_unpatched(tiny):
    x = image_batch(tiny)
    patched = vitprune.patch(make_model("deit_tiny", seed=5), keep_rate=0.7)
    patched.load_state_dict(tiny.state_dict())  # unpatched -> patched, strict
    assert patched.state_dict().keys() == tiny.state_dict().keys()
    fresh = make_model("deit_tiny", seed=9)
    fresh.load_state_dict(patched.state_dict())  # patched -> unpatched, strict
    with torch.no_grad():
        assert torch.equal(fresh(x), tiny(x))


def test_whole_model_save_load_and_deepcopy(tiny):
    x = image_batch(tiny)
    vitprune.patch(tiny, keep_rate=0.6)
    with torch.no_grad():
        expected = tiny(x)
    buffer = io.BytesIO()
    torch.save(tiny, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    for other in (loaded, copy.deepcopy(tiny)):
        assert vitprune.get_config(other) == vitprune.get_config(tiny)
        # the blocks share the copy's state, not the original's
        assert other.blocks[3].vitprune_state is other.vitprune_state is not tiny.vitprune_state
        with torch.no_grad():
            assert_close(other(x), expected)
        vitprune.unpatch(other)
        assert not any(isinstance(b, PruneBlock) for b in other.blocks)


def test_readers_of_an_unpatched_model_raise(tiny):
    for reader in (vitprune.get_config, vitprune.kept_positions):
        with pytest.raises(ValueError, match="not patched"):
            reader(tiny)
