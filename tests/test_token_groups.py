"""token_groups: which token holds each original patch after every stage."""

import pytest
import torch

import vitprune
from conftest import FAMILIES, build, images, paper, small_vit
from vitprune.core.state import ForwardRecords

#: The defaults (bipartite merge, every block), bipartite in rounds, score-guided merging,
#: the paper's fusion token and dropping, at three stages.
CONFIGS = [{}, dict(keep_rate=0.3, stages=(2, 5)), dict(indicator="var", selection="redundant", stages=None),
           paper(), paper(reduction="drop")]


def run(options, batch=3):
    model = vitprune.patch(small_vit(), **{"keep_rate": 0.6, **options})
    with torch.no_grad():
        model(images(model, batch))
    return model


@pytest.mark.parametrize("options", CONFIGS, ids=str)
def test_a_kept_patch_is_in_its_own_token_and_the_groups_are_as_large_as_the_sizes(options):
    model = run(options)
    groups, positions = vitprune.token_groups(model), vitprune.kept_positions(model)
    sizes = model.vitprune_state.stage_sizes
    assert len(groups) == len(positions) == len(vitprune.get_config(model).stages)
    for stage, (group, kept) in enumerate(zip(groups, positions)):
        assert group.shape == (3, 16)
        for b in range(3):
            patches = kept[b][kept[b] >= 0]
            # kept token i (not the fusion token) holds its own patch
            assert torch.equal(group[b, patches], torch.nonzero(kept[b] >= 0).flatten())
            assert int(group[b].max()) < kept.shape[1]
        held = group.clamp_min(0)
        counts = torch.zeros(3, kept.shape[1]).scatter_add_(1, held, (group >= 0).float())
        if options.get("reduction") == "drop":
            assert torch.equal(counts, torch.ones_like(counts))  # every token its own patch, the rest gone
            assert ((group == -1).sum(dim=1) == 16 - kept.shape[1]).all()
        else:
            assert (group >= 0).all()  # merged or fused: no patch is lost
            assert torch.equal(counts, sizes[stage])  # a token holds as many patches as its size says


def test_groups_compose_the_stages_by_hand():
    records = ForwardRecords()
    for stage, slots in enumerate(([[1, 1, 0, 2]], [[0, -1, 0]])):
        records.counts[stage] = (1, 3 - stage)
        records.record_slots(stage, None if stage == 0 else stage - 1, lambda s=slots: torch.tensor(s))
    groups = records.groups
    assert groups[0].tolist() == [[1, 1, 0, 2]]
    # patches 0 and 1 were token 1, dropped next; patches 2 and 3 (tokens 0 and 2) were merged
    assert groups[1].tolist() == [[-1, -1, 0, 0]]


def test_keeping_everything_groups_every_patch_alone():
    model = run(dict(keep_rate=1.0))
    for group in vitprune.token_groups(model):
        assert torch.equal(group, torch.arange(16).expand(3, 16))


def test_groups_need_a_patched_model_and_a_forward():
    with pytest.raises(ValueError, match="not patched"):
        vitprune.token_groups(small_vit())
    with pytest.raises(ValueError, match="no forward"):
        vitprune.token_groups(vitprune.patch(small_vit(), keep_rate=0.6))


@pytest.mark.slow
def test_a_compiled_forward_records_no_groups_and_says_so():
    model = vitprune.patch(small_vit(depth=4), keep_rate=0.6)
    x = images(model)
    torch._dynamo.reset()
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")  # dynamo's tracing decides it
    with torch.no_grad():
        compiled(x)
    with pytest.raises(RuntimeError, match="eager forwards only"):
        vitprune.token_groups(model)
    with torch.no_grad():
        model(x)
    assert len(vitprune.token_groups(model)) == 3  # the last block computes the class token alone


@pytest.mark.parametrize("options", CONFIGS, ids=str)
def test_the_records_hold_indices_not_tokens(options):
    # what stays behind after a forward for token_groups must not keep activations alive
    model = run(options)
    records = model.vitprune_state.records
    held = [a for _, make in records._slots.values() for a in make.args if isinstance(a, torch.Tensor)]
    assert held and all(not t.is_floating_point() for t in held)


@pytest.mark.parametrize("name", FAMILIES)
def test_every_family_groups_each_patch_once_into_tokens_as_large_as_their_sizes(name):
    model = vitprune.patch(build(name), keep_rate=0.5)
    with torch.no_grad():
        model(images(model, batch=2))
    sizes = model.vitprune_state.stage_sizes
    for stage, group in enumerate(vitprune.token_groups(model)):
        assert (group >= 0).all()  # merging keeps every patch in some token
        counts = torch.zeros_like(sizes[stage]).scatter_add_(1, group, torch.ones_like(group, dtype=sizes[stage].dtype))
        assert torch.equal(counts, sizes[stage])
