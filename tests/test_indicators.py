"""The indicators against values worked out by hand (docs/method.md §2)."""

import math

import pytest
import torch
from torch.testing import assert_close

from vitprune.core.indicators import head_agreement, head_mean, head_medad, head_variance, median, uniform_random

# One image, the class token's attention over 3 patches, for 2 heads: (B=1, H=2, N=3).
TWO_HEADS = torch.tensor([[[0.2, 0.5, 0.3],
                           [0.4, 0.1, 0.5]]])


def test_variance_by_hand():
    # patch 0: heads 0.2, 0.4 -> mean 0.3, deviations +-0.1 -> variance 0.01
    # patch 1: 0.5, 0.1 -> mean 0.3, +-0.2 -> 0.04;  patch 2: 0.3, 0.5 -> 0.01
    assert_close(head_variance(TWO_HEADS), torch.tensor([[0.01, 0.04, 0.01]]))


def test_variance_is_not_the_papers_printed_eq6():
    # Eq. 6 as printed, mean_h (a_h - mean), is zero for every patch; ours is not.
    printed = (TWO_HEADS - TWO_HEADS.mean(dim=1, keepdim=True)).mean(dim=1)
    assert_close(printed, torch.zeros(1, 3))
    assert (head_variance(TWO_HEADS) > 0).all()


def test_medad_even_heads_by_hand():
    # Four heads, one patch: values 0.1, 0.2, 0.4, 0.9.
    # median = (0.2 + 0.4) / 2 = 0.3; |deviations| = 0.2, 0.1, 0.1, 0.6 -> sorted 0.1, 0.1, 0.2, 0.6
    # median of those = (0.1 + 0.2) / 2 = 0.15
    attn = torch.tensor([0.1, 0.9, 0.4, 0.2]).reshape(1, 4, 1)
    assert_close(head_medad(attn), torch.tensor([[0.15]]))


def test_medad_two_heads_is_not_degenerate():
    # With the lower median, two heads would always give 0; the textbook median gives
    # half the gap: patch 0 |0.2 - 0.4| / 2 = 0.1, patch 1 0.2, patch 2 0.1.
    assert_close(head_medad(TWO_HEADS), torch.tensor([[0.1, 0.2, 0.1]]))


def test_medad_odd_heads_by_hand():
    # Five heads, two patches.
    # patch 0: 0.1 0.3 0.2 0.8 0.25 -> median 0.25; |dev| 0.15 0.05 0.05 0.55 0 -> median 0.05
    # patch 1: all 0.2 except one 0.6 -> median 0.2; |dev| 0 0 0 0.4 0 -> median 0
    attn = torch.tensor([[0.1, 0.2], [0.3, 0.2], [0.2, 0.6], [0.8, 0.2], [0.25, 0.2]]).unsqueeze(0)
    assert_close(head_medad(attn), torch.tensor([[0.05, 0.0]]))


@pytest.mark.parametrize("count", [1, 2, 3, 6, 7])
def test_median_matches_the_textbook_definition(count):
    values = torch.randperm(count).float().reshape(1, count, 1)
    expected = (count - 1) / 2  # the median of 0, 1, ..., count - 1
    assert median(values, dim=1).item() == expected


def test_lowvar_ranks_agreement_first():
    assert_close(head_agreement(TWO_HEADS), torch.tensor([[-0.01, -0.04, -0.01]]))


def test_cls_is_the_mean_over_heads():
    assert_close(head_mean(TWO_HEADS), torch.tensor([[0.3, 0.3, 0.4]]))


def test_scores_are_float32_for_half_inputs():
    attn = torch.softmax(torch.randn(2, 6, 197), dim=-1)[:, :, 1:]
    for score in (head_variance, head_medad, head_mean):
        out = score(attn.to(torch.bfloat16))
        assert out.dtype == torch.float32
        assert torch.isfinite(out).all()
    # The inputs are upcast before subtracting, so bf16 rounding of ~1/N values still
    # leaves a variance close to the float32 one.
    assert_close(head_variance(attn.to(torch.bfloat16)), head_variance(attn), rtol=0.05, atol=1e-7)


def test_random_is_seedable_and_uniform():
    attn = torch.rand(3, 4, 50)
    a = uniform_random(attn, torch.Generator().manual_seed(7))
    b = uniform_random(attn, torch.Generator().manual_seed(7))
    c = uniform_random(attn, torch.Generator().manual_seed(8))
    assert a.shape == (3, 50) and a.dtype == torch.float32
    assert torch.equal(a, b) and not torch.equal(a, c)
    assert ((a >= 0) & (a < 1)).all()


@pytest.mark.parametrize("layout", ["heads first", "as timm's fused qkv lays it out"])
def test_the_class_row_is_the_softmax_of_the_biased_logits_by_hand(layout):
    """One query per head (the class token), keys 0, 1, 2 (d = 1, scale 1), and a bias of
    log 2 on key 1 (a token holding two patches): the logits are 0, 1 + log 2, 2, so the row
    over the two patches is (2e, e^2) / (1 + e)^2. The second head's keys are doubled, and
    it gets no bias on the row: (e^2, e^4) / (1 + e^2 + e^4)."""
    from vitprune.families.attention import class_attention_row

    keys = torch.tensor([[0.0, 0.0], [1.0, 2.0], [2.0, 4.0]])  # (L, H)
    if layout == "heads first":
        k = keys.T.reshape(1, 2, 3, 1).contiguous()
    else:  # (B, L, H, d) in memory, viewed as (B, H, L, d)
        k = keys.reshape(1, 3, 2, 1).permute(0, 2, 1, 3)
        assert k.stride(1) == 1 and k.stride(3) == 1  # the product on that layout
    q = torch.ones(1, 2, 3, 1)
    bias = torch.zeros(1, 2, 3, 3)
    bias[0, 0, :, 1] = math.log(2)
    e = math.e
    expected = torch.tensor([[[2 * e, e ** 2], [e ** 2, e ** 4]]])
    expected /= torch.tensor([[[(1 + e) ** 2], [1 + e ** 2 + e ** 4]]])
    assert_close(class_attention_row(q, k, 1.0, 1, bias), expected)


def test_without_a_class_token_the_row_is_the_mean_attention_each_token_receives_by_hand():
    """Queries 0 and 1, keys 0 and 1 (d = 1, scale 1): the first query attends (1/2, 1/2),
    the second (1, e) / (1 + e); each key's row entry is the mean over the two queries."""
    from vitprune.families.attention import attend

    q = torch.tensor([0.0, 1.0]).reshape(1, 1, 2, 1)
    k = q.clone()
    _, scored = attend(q, k, k, scale=1.0, fused=True, attn_drop=torch.nn.Dropout(0.0), num_prefix=0,
                       source="mean")
    e = math.e
    expected = torch.tensor([[[(0.5 + 1 / (1 + e)) / 2, (0.5 + e / (1 + e)) / 2]]])
    assert_close(scored.row, expected)
