"""The token-alignment benchmark (examples/token_alignment.py): its aligned schedules are
what it says, and the patched models run exactly those counts."""

import copy
import sys
from pathlib import Path

import torch

import vitprune
from conftest import images, small_vit
from vitprune.measure.flops import token_schedule

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))

import token_alignment  # noqa: E402


def test_the_token_total_counts_every_blocks_attention_and_mlp_by_hand():
    # 20 patches + 1 prefix; blocks 0, 1, 2 leave 15, 11, 6; block 3 runs at 6
    assert token_alignment.token_total((0, 1, 2), [15, 11, 6], 4, 20, 1) == 21 + 16 + 16 + 12 + 12 + 7 + 7 + 7


def test_the_token_total_is_what_the_flop_counter_runs():
    config = vitprune.PruneConfig(keep_rate=(0.8, 0.6), stages=(1, 3))
    schedule = token_schedule(config, 5, 1, 49)
    counts = token_alignment.stage_counts(config, 5, 49)
    assert token_alignment.token_total((1, 3), counts, 5, 49, 1) == sum(b.attn + b.mlp for b in schedule)


def test_aligned_counts_by_hand():
    # nearest multiples of 4 with the prefix: 16, 12, 8 -> 15, 11, 7; 101 tokens > 98, so the
    # last stage drops by 4
    assert token_alignment.aligned_counts((0, 1, 2), [15, 11, 6], 4, 20, 1, 4) == [15, 11, 3]
    # no prefix: 16, 12, 8 (84 > 78); the last to 4 (80 > 78), then the one before to 8 (72)
    assert token_alignment.aligned_counts((0, 1, 2), [16, 10, 6], 3, 20, 0, 4) == [16, 8, 4]
    # already on the multiples: unchanged
    assert token_alignment.aligned_counts((0, 2), [15, 7], 3, 20, 1, 8) == [15, 7]


def test_the_aligned_schedule_runs_exactly_its_counts_and_never_more_tokens():
    model = small_vit()  # deit_tiny at 64x64: 16 patches, 12 blocks
    n, prefix, depth = model.patch_embed.num_patches, model.num_prefix_tokens, len(model.blocks)
    rows = token_alignment.settings(model, ["spread"], 0.7, 4)
    base, counts = rows["spread"]
    config, aligned = rows["spread, aligned"]
    stages, _ = base.schedule()
    assert all((prefix + c) % 4 == 0 for c in aligned) and aligned != counts
    assert token_alignment.token_total(stages, aligned, depth, n, prefix) <= \
        token_alignment.token_total(stages, counts, depth, n, prefix)
    patched = vitprune.patch(copy.deepcopy(model), config)
    seen = []
    hooks = [block.register_forward_hook(lambda module, args, out: seen.append(out.shape[1])) for block in patched.blocks]
    with torch.inference_mode():
        patched.forward_features(images(patched, batch=2))
    for hook in hooks:
        hook.remove()
    assert [seen[s] for s in stages] == [prefix + c for c in aligned]
    assert [c + 1 for c in rows["spread, control"][1]] == aligned
