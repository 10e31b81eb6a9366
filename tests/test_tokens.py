"""Selection and fusion against hand-computed examples (docs/method.md §3-5)."""

import math

import pytest
import torch
from torch.testing import assert_close

from vitprune.core.config import keep_count
from vitprune.core.tokens import fuse_tokens, fusion_weights, prune_tokens, select_top, untracked


@pytest.mark.parametrize("rate, n, expected", [
    (0.7, 196, 138), (0.7, 139, 98), (0.7, 99, 70),  # DeiT-S at 224, the paper's schedule
    (0.7, 10, 7),
    (0.28, 25, 7), (0.56, 25, 14),  # 7.000000000000001 and 14.000000000000002 in floats: still 7 and 14
    (0.5, 7, 4), (1.0, 5, 5), (0.01, 5, 1),
])
def test_keep_count(rate, n, expected):
    assert keep_count(rate, n) == expected


@pytest.mark.parametrize("rate, n, error, message", [
    (1.5, 10, ValueError, r"keep_rate must be in \(0, 1\], got 1.5"),  # was 15 of 10
    (0.7, 0, ValueError, r"n must be >= 1 token, got 0"),  # was 1 of 0
    (True, 10, TypeError, r"keep_rate must be a number in \(0, 1\], got bool True"),  # was 10
    (0.5, 10.0, TypeError, r"n must be a whole number of tokens \(int\), got float 10.0"),  # was 5
])
def test_keep_count_refuses_what_no_stage_could_keep(rate, n, error, message):
    with pytest.raises(error, match=message):
        keep_count(rate, n)


def test_select_top_keeps_exactly_the_top_k_in_original_order():
    scores = torch.tensor([[0.1, 0.9, 0.3, 0.7, 0.5],
                           [5.0, 4.0, 3.0, 2.0, 1.0]])
    sel = select_top(scores, 3)
    assert sel.keep.tolist() == [[1, 3, 4], [0, 1, 2]]
    assert sel.drop.tolist() == [[2, 0], [3, 4]]  # highest pruned score first


def test_select_top_breaks_ties_towards_earlier_tokens():
    sel = select_top(torch.zeros(1, 4), 2)
    assert sel.keep.tolist() == [[0, 1]]


def test_fusion_weights_by_hand():
    # scores 1, 3 -> mean |s| = 2 -> s / (T * 2) = 0.5, 1.5 with T = 1
    w = fusion_weights(torch.tensor([[1.0, 3.0]]), T=1.0)
    e = torch.tensor([math.exp(0.5), math.exp(1.5)])
    assert_close(w, (e / e.sum()).unsqueeze(0))


def test_fusion_weights_infinite_temperature_is_mean_pooling():
    w = fusion_weights(torch.tensor([[1e-6, 5e-6, 2e-6, 9e-6]]), T=math.inf)
    assert_close(w, torch.full((1, 4), 0.25))


def test_fusion_weights_are_scale_free():
    s = torch.rand(2, 9)
    assert_close(fusion_weights(s, 0.5), fusion_weights(s * 1e-6, 0.5))


def test_fusion_weights_of_all_zero_scores_are_uniform():
    assert_close(fusion_weights(torch.zeros(1, 3), 1.0), torch.full((1, 3), 1 / 3))


def test_prune_tokens_keeps_prefix_and_top_k_and_fuses_the_rest():
    torch.manual_seed(0)
    x = torch.randn(2, 1 + 5, 4)  # one prefix token, five others
    scores = torch.tensor([[0.1, 0.9, 0.3, 0.7, 0.5],
                           [0.5, 0.4, 0.3, 0.2, 0.1]])
    out, sel = prune_tokens(x, scores, num_prefix=1, k=3, fuse=True, T=0.7)
    assert out.shape == (2, 1 + 3 + 1, 4)
    assert_close(out[:, 0], x[:, 0])
    assert_close(out[0, 1:4], x[0, 1 + torch.tensor([1, 3, 4])])
    assert_close(out[1, 1:4], x[1, 1 + torch.tensor([0, 1, 2])])
    # image 0 prunes patches 2 (score 0.3) and 0 (0.1): mean |s| = 0.2
    a, b = math.exp(0.3 / (0.7 * 0.2)), math.exp(0.1 / (0.7 * 0.2))
    assert_close(out[0, 4], (a * x[0, 1 + 2] + b * x[0, 1 + 0]) / (a + b))


def test_prune_tokens_without_fusion_drops_the_rest():
    x = torch.randn(1, 2 + 4, 3)
    out, _ = prune_tokens(x, torch.tensor([[4.0, 3.0, 2.0, 1.0]]), num_prefix=2, k=2, fuse=False, T=1.0)
    assert_close(out, x[:, :4])


def test_gradients_reach_kept_tokens_pruned_tokens_and_scores():
    x = torch.randn(2, 1 + 6, 5, requires_grad=True)
    scores = torch.rand(2, 6, requires_grad=True)
    out, _ = prune_tokens(x, scores, num_prefix=1, k=3, fuse=True, T=1.0)
    (out * torch.randn_like(out)).sum().backward()
    assert (x.grad.abs().sum(dim=-1) > 0).all()  # every token: kept, prefix, or fused
    assert scores.grad is not None and scores.grad.abs().sum() > 0  # through the fusion weights


def test_fuse_tokens_keeps_the_token_dtype():
    tokens = torch.randn(1, 3, 4, dtype=torch.bfloat16)
    out = fuse_tokens(tokens, torch.tensor([[0.2, 0.3, 0.5]]))
    assert out.dtype == torch.bfloat16 and out.shape == (1, 1, 4)


def test_untracked_detaches_only_what_autograd_tracks():
    plain = torch.randn(2, 3)
    assert untracked(plain) is plain  # no operation where there is no history to cut
    tracked = torch.randn(2, 3, requires_grad=True) * 2
    cut = untracked(tracked)
    assert not cut.requires_grad and cut.grad_fn is None
    assert cut.data_ptr() == tracked.data_ptr() and torch.equal(cut, tracked)
