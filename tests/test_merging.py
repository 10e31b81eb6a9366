"""Merging, matching, size bookkeeping and size-aware attention, against hand-computed cases."""

import math

import pytest
import timm
import torch
from torch.testing import assert_close

import vitprune
from conftest import PAPER, assert_same_per_stage, image_batch
from vitprune.families.attention import attend
from vitprune.measure.baseline import fit_merging, merging_config
from vitprune.measure.flops import schedule_flops
from vitprune.core.merging import (CROWDING_MARGIN, Matched, Merged, bipartite_keep, bipartite_merge, bipartite_slots,
                                   cosines, crowding_scores, key_metric,
                                   match_bipartite, match_redundant, match_top, merge_tokens, size_bias, token_slots)


def unit(*rows):
    t = torch.tensor(rows, dtype=torch.float32)
    return (t / t.norm(dim=-1, keepdim=True)).unsqueeze(0)


def test_merge_is_the_size_weighted_average_of_each_kept_token_and_what_joins_it():
    tokens = torch.tensor([[[1.0, 0.0], [0.0, 1.0], [2.0, 2.0], [4.0, 0.0]]])
    sizes = torch.tensor([[1.0, 2.0, 1.0, 3.0]])
    # token 1 joins kept token 2 (position 1 of keep), token 3 joins kept token 0 (position 0)
    matched = Matched(keep=torch.tensor([[0, 2]]), drop=torch.tensor([[1, 3]]), dest=torch.tensor([[1, 0]]))
    merged, new_sizes = merge_tokens(tokens, sizes, matched)
    # by hand: (1 * [1, 0] + 3 * [4, 0]) / 4 and (1 * [2, 2] + 2 * [0, 1]) / 3
    assert_close(merged, torch.tensor([[[13 / 4, 0.0], [2 / 3, 4 / 3]]]))
    assert_close(new_sizes, torch.tensor([[4.0, 3.0]]))


def test_merge_copies_the_prefix_tokens_and_indexes_past_them_in_every_image():
    prefix = torch.tensor([[[9.0, 9.0], [8.0, 8.0]], [[7.0, 7.0], [6.0, 6.0]]])
    first = torch.tensor([[1.0, 0.0], [0.0, 1.0], [2.0, 2.0], [4.0, 0.0]])
    tokens = torch.cat([prefix, torch.stack([first, first.flip(0)])], dim=1)  # (2, 2 + 4, 2)
    sizes = torch.tensor([[1.0, 2.0, 1.0, 3.0], [3.0, 1.0, 2.0, 1.0]])
    matched = Matched(keep=torch.tensor([[0, 2], [0, 2]]), drop=torch.tensor([[1, 3], [1, 3]]),
                      dest=torch.tensor([[1, 0], [1, 1]]))
    merged, new_sizes = merge_tokens(tokens, sizes, matched, num_prefix=2)
    # image 0 as in the test above; image 1 holds [4, 0] (3), [2, 2] (1), [0, 1] (2), [1, 0] (1):
    # [4, 0] stays alone, [0, 1] receives [2, 2] and [1, 0]: (2 * [0, 1] + [2, 2] + [1, 0]) / 4
    expected = torch.tensor([[[9.0, 9.0], [8.0, 8.0], [13 / 4, 0.0], [2 / 3, 4 / 3]],
                             [[7.0, 7.0], [6.0, 6.0], [4.0, 0.0], [3 / 4, 4 / 4]]])
    assert_close(merged, expected)
    assert_close(new_sizes, torch.tensor([[4.0, 3.0], [3.0, 4.0]]))
    alone, _ = merge_tokens(tokens[:, 2:], sizes, matched)
    assert torch.equal(merged[:, 2:], alone)


def test_merge_gradient_by_hand_when_two_tokens_join_one():
    """Tokens 1 and 3 join kept token 2 (sizes 1, 1, 2, 1): its row is (2 x2 + x1 + x3) / 4, so the
    sum's gradient is 1 for token 0, 1/2 for token 2 and 1/4 for tokens 1 and 3. (Until stop 52
    the kept token's share was applied once per arrival on the way back: 1 for token 2.)"""
    tokens = torch.randn(1, 4, 3, requires_grad=True)
    matched = Matched(keep=torch.tensor([[0, 2]]), drop=torch.tensor([[1, 3]]), dest=torch.tensor([[1, 1]]))
    merged, _ = merge_tokens(tokens, torch.tensor([[1.0, 1.0, 2.0, 1.0]]), matched)
    assert_close(merged[0, 1], (2 * tokens[0, 2] + tokens[0, 1] + tokens[0, 3]) / 4)
    merged.sum().backward()
    assert_close(tokens.grad, torch.tensor([1.0, 0.25, 0.5, 0.25]).view(1, 4, 1).expand(1, 4, 3))


def test_merge_passes_gradcheck_with_a_prefix_and_shared_destinations():
    """float64, two images, two prefix tokens, three removed tokens of one image joining one
    kept token: autograd's gradient equals the numerical one."""
    tokens = torch.randn(2, 2 + 6, 3, dtype=torch.float64, requires_grad=True)
    sizes = torch.tensor([[1.0, 2.0, 1.0, 3.0, 1.0, 1.0], [2.0, 1.0, 1.0, 1.0, 4.0, 1.0]], dtype=torch.float64)
    matched = Matched(keep=torch.tensor([[0, 2, 5], [1, 3, 4]]), drop=torch.tensor([[1, 3, 4], [0, 2, 5]]),
                      dest=torch.tensor([[2, 2, 2], [0, 2, 0]]))
    assert torch.autograd.gradcheck(lambda t: merge_tokens(t, sizes, matched, num_prefix=2)[0], (tokens,))


def test_match_top_keeps_the_best_scores_and_sends_the_rest_to_their_closest_kept_token():
    scores = torch.tensor([[0.9, 0.1, 0.8, 0.2]])
    metric = unit([1, 0], [0.1, 1], [0, 1], [1, 0.1])
    matched = match_top(scores, metric, 2)
    assert matched.keep.tolist() == [[0, 2]]
    assert matched.drop.tolist() == [[3, 1]]  # highest pruned score first
    assert matched.dest.tolist() == [[0, 1]]  # 3 is like 0, 1 is like 2


def test_match_redundant_protects_the_best_scored_half_and_removes_the_closest_copy():
    scores = torch.tensor([[0.9, 0.1, 0.8, 0.2, 0.3]])
    # destinations: the best min(k, n // 2) = 2 scores, tokens 0 and 2. Of the rest, token 3
    # copies token 0 almost exactly, token 1 is between, token 4 is like nothing
    metric = unit([1, 0, 0], [1, 1, 0], [0, 1, 0], [1, 0.01, 0], [0, 0, 1])
    matched = match_redundant(scores, metric, 4)
    assert matched.keep.tolist() == [[0, 1, 2, 4]] and matched.drop.tolist() == [[3]]
    assert matched.dest.tolist() == [[0]]
    matched = match_redundant(scores, metric, 3)  # two go: 3 (to 0), then 1 (to 0 or 2: a tie, 0 first)
    assert matched.keep.tolist() == [[0, 2, 4]] and matched.drop.tolist() == [[3, 1]]
    assert matched.dest.tolist() == [[0, 0]]


def test_match_bipartite_alternates_and_concatenates_as_token_merging_does():
    metric = unit([1, 0], [1, 0.05], [0, 1], [0.05, 1], [1, 1])
    # destinations 0, 2, 4; candidates 1 (like 0) and 3 (like 2); the closest pair goes
    matched = match_bipartite(metric, 4)
    assert matched.drop.tolist() == [[1]] or matched.drop.tolist() == [[3]]
    stays = 3 if matched.drop.item() == 1 else 1
    assert matched.keep.tolist() == [[stays, 0, 2, 4]]  # [candidates that stay, destinations]
    merged_into = matched.keep[0, matched.dest[0, 0]].item()
    assert merged_into == (0 if matched.drop.item() == 1 else 2)
    # to keep fewer than half, rounds: 1 -> 0 and 3 -> 2 (keys merged: ~[1, 0] and ~[0, 1]), then of
    # the three left ([0, 2, 4] as destinations 0 and 4 with candidate 2), 2 goes to 4 ([1, 1])
    matched = match_bipartite(metric, 2)
    assert matched.keep.tolist() == [[0, 4]]
    assert matched.drop.tolist() == [[1, 2, 3]]
    assert matched.dest.tolist() == [[0, 1, 1]]  # 3 followed 2 into 4


def test_bipartite_merge_by_hand():
    # one prefix token, patches 0..4 with one head whose keys are the rows below: destinations
    # 0, 2, 4; candidate 1 is closest to 0 (cosine 0.99...), candidate 3 to 2 but less so
    keys = torch.tensor([[9, 9], [1, 0], [1, 0.1], [0, 1], [0.5, 1], [-1, 0]], dtype=torch.float32)[None, None]
    tokens = torch.tensor([[5.0], [10.0], [20.0], [30.0], [40.0], [50.0]])[None]
    sizes = torch.tensor([[1.0, 3.0, 1.0, 1.0, 2.0]])
    result = bipartite_merge(tokens, keys, sizes, 4, 1)
    merged, new_sizes, stays = result.tokens, result.sizes, result.stays
    assert stays.tolist() == [[1]]  # candidate 1 is patch 3
    assert bipartite_keep(stays, 5).tolist() == [[3, 0, 2, 4]]  # [candidate that stays, destinations]
    # destination 0 (size 1) receives candidate 1 (size 3): (1 * 10 + 3 * 20) / 4
    assert_close(merged, torch.tensor([[[5.0], [40.0], [70 / 4], [30.0], [50.0]]]))
    assert new_sizes.tolist() == [[1.0, 4.0, 1.0, 2.0]]
    # patches 0 and 1 are now token 1 (destination 0 after the one candidate that stays),
    # patch 2 token 2, patch 3 (the candidate that stays) token 0, patch 4 token 3
    assert bipartite_slots(result.stays, result.removed, result.dest, 5).tolist() == [[1, 1, 2, 0, 3]]


def test_token_slots_by_hand():
    keep, drop = torch.tensor([[4, 0, 2]]), torch.tensor([[1, 3]])
    # kept token keep[i] is new token i; removed ones go where ``into`` says
    assert token_slots(keep, drop, torch.tensor([[0, 2]])).tolist() == [[1, 0, 2, 2, 0]]
    assert token_slots(keep, drop, 3).tolist() == [[1, 3, 2, 3, 0]]  # a fusion token after the kept
    assert token_slots(keep, drop, -1).tolist() == [[1, -1, 2, -1, 0]]  # dropped


@pytest.mark.parametrize("crowding", [0.0, 0.5])
@pytest.mark.parametrize("seed", range(4))
def test_bipartite_merge_is_matching_then_merging_bit_for_bit(seed, crowding):
    """The defaults' one-round path against the general selection and merge it replaces."""
    g = torch.Generator().manual_seed(seed)
    for _ in range(40):
        B, P, n = (int(torch.randint(low, high, (1,), generator=g)) for low, high in ((1, 4), (0, 3), (2, 40)))
        k = int(torch.randint((n + 1) // 2, n, (1,), generator=g))
        tokens, keys = torch.randn(B, P + n, 8, generator=g), torch.randn(B, 3, P + n, 4, generator=g)
        keys[:, :, P + 1] = keys[:, :, P]  # a tie: candidate 0 is as close to destination 0 as can be
        sizes = torch.randint(1, 5, (B, n), generator=g).float()
        matched = match_bipartite(key_metric(keys, P), k, crowding=crowding)
        expected, expected_sizes = merge_tokens(tokens, sizes, matched, P)
        merged = bipartite_merge(tokens, keys, sizes, k, P, crowding)
        assert torch.equal(merged.tokens, expected) and torch.equal(merged.sizes, expected_sizes)
        assert torch.equal(bipartite_keep(merged.stays, n), matched.keep)
        slots = bipartite_slots(merged.stays, merged.removed, merged.dest, n)
        assert torch.equal(slots, token_slots(matched.keep, matched.drop, matched.dest))


@pytest.mark.parametrize("crowding", [None, 0.5])
def test_defaults_give_the_same_model_outputs_with_the_general_matching_and_merging(tiny, monkeypatch, crowding):
    import vitprune.core.state as state_module

    def general(tokens, keys, sizes, k, num_prefix, weight):
        matched = match_bipartite(key_metric(keys, num_prefix), k, crowding=weight)
        merged, new_sizes = merge_tokens(tokens, sizes, matched, num_prefix)
        m = k - (sizes.shape[1] + 1) // 2
        stays = (matched.keep[:, :m] - 1) // 2
        return Merged(merged, new_sizes, stays, (matched.drop - 1) // 2, matched.dest - m)

    model = vitprune.patch(tiny, keep_rate=0.7, crowding=crowding)
    x = image_batch(model, batch=3)
    runs = []
    for _ in range(2):
        with torch.no_grad():
            out = model(x)
        state = model.vitprune_state
        runs.append((out, vitprune.kept_positions(model), state.sizes.clone(), vitprune.token_groups(model)))
        monkeypatch.setattr(state_module, "bipartite_merge", general)
    (fast, fast_positions, fast_sizes, fast_groups), (slow, slow_positions, slow_sizes, slow_groups) = runs
    assert torch.equal(fast, slow) and torch.equal(fast_sizes, slow_sizes)
    stages = len(model.blocks) - 1  # the last block: the class token alone
    assert_same_per_stage(fast_positions, slow_positions, stages)
    assert_same_per_stage(fast_groups, slow_groups, stages)


def test_crowding_scores_by_hand():
    # one candidate, two destinations: cosine 0.9 counts as itself (above the margin 0.6),
    # cosine 0.2 as exp(0.2 - 0.6) - 1; a second candidate like neither destination
    similarity = torch.tensor([[[0.9, 0.2], [-1.0, 0.6]]])
    expected = torch.tensor([[(0.9 + math.exp(-0.4) - 1) / 2, (math.exp(-1.6) - 1 + math.exp(0.0) - 1) / 2]])
    assert CROWDING_MARGIN == 0.6
    assert_close(crowding_scores(similarity), expected)
    low_margin = torch.tensor([[(0.9 + 0.2) / 2, (math.exp(-1.1) - 1 + 0.6) / 2]])
    assert_close(crowding_scores(similarity, margin=0.1), low_margin)


def test_crowding_sends_the_candidate_with_more_near_copies_first():
    # destinations 0, 2, 4 and candidates 1, 3, each exactly like one destination (cosine 1):
    # candidate 1 is like destination 4 only, candidate 3 like destinations 0 and 2 (crowded)
    e1, e2 = [1.0, 0.0], [0.0, 1.0]
    metric = torch.tensor([[e1, e2, e1, e1, e2]])
    plain = match_bipartite(metric, 4)
    assert plain.drop.tolist() == [[1]]  # a tie: the earlier candidate goes
    crowded = match_bipartite(metric, 4, crowding=0.5)
    assert crowded.drop.tolist() == [[3]] and crowded.keep.tolist() == [[1, 0, 2, 4]]
    assert crowded.dest.tolist() == [[1]]  # into destination 0, the first of its two closest
    tokens, sizes = torch.arange(5.0).view(1, 5, 1), torch.ones(1, 5)
    merged = bipartite_merge(tokens, metric.view(1, 1, 5, 2), sizes, 4, 0, crowding=0.5)
    assert merged.removed.tolist() == [[1]] and merged.tokens.view(-1).tolist() == [1.0, 1.5, 2.0, 4.0]
    # more rounds weigh crowding in each: keeping 2 of 5 removes both candidates, then a destination
    assert match_bipartite(metric, 2, crowding=0.5).keep.shape == (1, 2)


def test_crowding_defaults_and_token_merging_keeps_its_own_order(tiny):
    from vitprune.core.config import DEFAULT_CROWDING
    assert vitprune.PruneConfig().crowding is None and vitprune.PruneConfig().crowding_weight == DEFAULT_CROWDING
    assert vitprune.PruneConfig(indicator="var").crowding_weight == 0.0
    assert vitprune.PruneConfig(crowding=1).crowding == 1.0
    assert merging_config(tiny, 2).crowding == 0.0
    x = image_batch(tiny, batch=3)
    with torch.no_grad():
        crowded = vitprune.patch(tiny, keep_rate=0.6, crowding=2.0)(x)
        state = tiny.vitprune_state
        assert state.config.crowding_weight == 2.0
        plain = vitprune.patch(tiny, keep_rate=0.6, crowding=0.0)(x)
        assert not torch.equal(crowded, plain)  # a weight this large reorders some candidates


def test_a_patch_pickled_before_crowding_existed_loads_and_runs_as_before(tiny):
    import pickle
    model = vitprune.patch(tiny, keep_rate=0.6)
    x = image_batch(model, batch=2)
    with torch.no_grad():
        expected = model(x)
    del model.vitprune_state.config.__dict__["crowding"]  # what an older pickle restores
    loaded = pickle.loads(pickle.dumps(model))
    assert loaded.vitprune_state.config.crowding_weight == 0.0
    with torch.no_grad():
        assert torch.equal(loaded(x), expected)


def test_bipartite_merge_refuses_more_than_one_round_and_passes_gradients():
    tokens, keys = torch.randn(1, 7, 4, requires_grad=True), torch.randn(1, 2, 7, 4)
    with pytest.raises(ValueError, match="between ceil"):
        bipartite_merge(tokens, keys, torch.ones(1, 6), 2, 1)
    bipartite_merge(tokens, keys, torch.ones(1, 6), 4, 1)[0].sum().backward()
    assert (tokens.grad.abs().sum(-1) > 0).all()  # every token reaches the output
    empty = bipartite_merge(torch.randn(0, 7, 4), torch.randn(0, 2, 7, 4), torch.ones(0, 6), 4, 1)
    assert [t.shape for t in empty] == [(0, 5, 4), (0, 4), (0, 1), (0, 2), (0, 2)]


def test_key_metric_averages_heads_and_skips_the_prefix():
    keys = torch.tensor([[[[9.0, 9.0], [3.0, 4.0]], [[9.0, 9.0], [3.0, 4.0]]]])  # (1, 2 heads, 2 tokens, 2)
    assert_close(key_metric(keys, 1), torch.tensor([[[0.6, 0.8]]]))


def test_key_metric_records_no_gradient_and_leaves_the_keys_alone():
    keys = torch.tensor([[[[9.0, 9.0], [3.0, 4.0]], [[9.0, 9.0], [0.0, 0.0]]]], requires_grad=True)
    before = keys.detach().clone()
    metric = key_metric(keys, 0)
    assert not metric.requires_grad and metric.grad_fn is None  # only indices leave a matching
    assert torch.equal(keys.detach(), before)  # normalised in place, but in new tensors
    assert_close(metric, torch.tensor([[[2 ** -0.5, 2 ** -0.5], [0.6, 0.8]]]))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_key_metric_is_float32_from_low_precision_keys_and_float64_stays(dtype):
    keys = torch.randn(2, 3, 5, 4, generator=torch.Generator().manual_seed(0))
    low = keys.to(dtype)
    assert key_metric(low, 1).dtype == torch.float32
    assert torch.equal(key_metric(low, 1), key_metric(low.float(), 1))  # the same sums, in float32
    assert key_metric(keys.double(), 1).dtype == torch.float64


def near_copies(dtype):
    """Tokens 0 and 2 are the destinations, 1 and 3 the candidates; both candidates lie within
    0.002 of token 0's direction, token 3 the closer (cosines 0.99851 and 0.99900 in float32),
    which bfloat16 cannot tell apart (its step below 1 is 2 ** -8)."""
    keys = torch.tensor([[1.0, 0.0], [1.0, 0.0547], [0.0, 1.0], [1.0, 0.0447]]).to(dtype)
    return keys.view(1, 1, 4, 2), torch.arange(4.0).view(1, 4, 1).to(dtype)


@pytest.mark.parametrize("autocast", [False, True], ids=["bfloat16 model", "float32 model under autocast"])
def test_near_copies_are_told_apart_in_bfloat16_as_in_float32(autocast):
    keys, tokens = near_copies(torch.float32 if autocast else torch.bfloat16)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        merged = bipartite_merge(tokens, keys, torch.ones(1, 4), k=3, num_prefix=0)
    assert merged.removed.tolist() == [[1]]  # candidate 1 (token 3), the closer; a tie would send token 1
    exact = bipartite_merge(*near_copies(torch.float32)[::-1], torch.ones(1, 4), k=3, num_prefix=0)
    assert torch.equal(merged.removed, exact.removed) and torch.equal(merged.dest, exact.dest)


def test_cosines_stay_in_float32_under_autocast():
    a, b = torch.randn(2, 3, 4), torch.randn(2, 5, 4)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = cosines(a, b)
        assert (a @ b.mT).dtype == torch.bfloat16  # what autocast does to a plain product
    assert got.dtype == torch.float32 and torch.equal(got, torch.bmm(a, b.mT))


@pytest.mark.parametrize("fused", [True, False])
def test_size_aware_attention_equals_attending_to_repeated_tokens(fused):
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 3, 4, 8) for _ in range(3))
    sizes = torch.tensor([[1.0, 3.0, 2.0], [2.0, 1.0, 4.0]])  # token 0 is the class token
    repeat = [[0] + [1 + i for i, s in enumerate(row) for _ in range(int(s))] for row in sizes.tolist()]
    drop = torch.nn.Dropout(0.0)
    out, scored = attend(q, k, v, scale=8 ** -0.5, fused=fused, attn_drop=drop, num_prefix=1, source="cls",
                         bias=size_bias(sizes, 1, q.dtype))
    for b, index in enumerate(repeat):
        kr, vr = k[b:b + 1, :, index], v[b:b + 1, :, index]
        expected, plain = attend(q[b:b + 1], kr, vr, scale=8 ** -0.5, fused=fused, attn_drop=drop, num_prefix=1,
                                 source="cls")
        assert_close(out[b:b + 1], expected, rtol=1e-5, atol=1e-6)
        # the class row over a merged token is the sum of its copies' rows
        copies = torch.zeros_like(scored.row[b:b + 1]).index_add_(2, torch.tensor(index[1:]) - 1, plain.row)
        assert_close(scored.row[b:b + 1], copies, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("options", [{}, {"reduction": "fuse"}, {"keep_rate": 0.4, "stages": "all"}])
def test_positions_worked_out_when_read_equal_those_worked_out_at_once(tiny, monkeypatch, options):
    """Eager forwards defer the kept positions until read; compiled and traced ones cannot."""
    model = vitprune.patch(tiny, **{"keep_rate": 0.7, **options})
    x = image_batch(model)
    with torch.no_grad():
        model(x)
        deferred = vitprune.kept_positions(model)
        monkeypatch.setattr("vitprune.core.state.is_compiling", lambda: True)
        model(x)
        at_once = vitprune.kept_positions(model)
    assert len(deferred) == len(at_once) == len(model.blocks) - 1  # the last: the class token alone
    assert all(torch.equal(a, b) for a, b in zip(deferred, at_once))
    # every stage's positions name distinct patches of the input (the fusion token: -1)
    last = at_once[-1]
    assert all(len(set(row[row >= 0].tolist())) == int((row >= 0).sum()) for row in last)


def test_size_bias_is_log_size_and_zero_for_prefix_tokens():
    bias = size_bias(torch.tensor([[1.0, 4.0]]), 2, torch.float32)
    assert bias.shape == (1, 1, 1, 4)
    assert_close(bias.flatten(), torch.tensor([0.0, 0.0, 0.0, math.log(4.0)]))


@pytest.mark.parametrize("selection", ["top", "redundant", "bipartite"])
@pytest.mark.parametrize("reduction", ["merge", "fuse", "drop"])
def test_sizes_add_up_to_the_patches_through_every_stage(tiny, selection, reduction):
    vitprune.patch(tiny, keep_rate=0.6, stages=(2, 5, 8), selection=selection, reduction=reduction)
    sizes_seen = []
    state = tiny.vitprune_state
    original = state.prune

    def spy(x, scored, stage):
        out = original(x, scored, stage)
        sizes_seen.append(state.sizes.clone())
        return out

    state.prune = spy
    with torch.no_grad():
        tiny(image_batch(tiny))
    del state.prune
    counts = (118, 71, 43) if reduction != "fuse" else (118 + 1, 72 + 1, 44 + 1)  # ceil(0.6 n) [+ fusion]
    assert [s.shape[1] for s in sizes_seen] == list(counts)
    expected = [196.0] * 3 if reduction != "drop" else [118.0, 71.0, 43.0]  # dropped patches are gone
    assert [s.sum(1)[0].item() for s in sizes_seen] == expected


def test_size_aware_following_blocks_add_the_bias_and_only_after_the_first_stage(tiny):
    vitprune.patch(tiny, keep_rate=0.5, stages=(3, 6))
    assert [type(b).__name__ for b in tiny.blocks] == ["Block"] * 3 + ["PruneBlock"] * 9
    assert [b.vitprune_stage for b in tiny.blocks[3:]] == [0, None, None, 1] + [None] * 5
    vitprune.patch(tiny, keep_rate=0.5, stages=(3, 6), size_aware=False, class_only_last=False)
    assert [type(b).__name__ for b in tiny.blocks].count("PruneBlock") == 2
    x = image_batch(tiny)
    with torch.no_grad():
        plain = tiny(x)
        vitprune.patch(tiny, keep_rate=0.5, stages=(3, 6), size_aware=True)
        aware = tiny(x)
    assert not torch.allclose(plain, aware)  # the bias reached the logits


def test_every_block_schedule_removes_tokens_in_each_block(tiny):
    vitprune.patch(tiny, keep_rate=0.9, stages="all", class_only_last=False)
    assert vitprune.get_config(tiny).stages == tuple(range(12))
    with torch.no_grad():
        tiny(image_batch(tiny))
    counts = [p.shape[1] for p in vitprune.kept_positions(tiny)]
    expected, n = [], 196
    for _ in range(12):
        n = math.ceil(0.9 * n)
        expected.append(n)
    assert counts == expected


def test_merging_config_removes_r_tokens_per_block(tiny):
    config = merging_config(tiny, 8)
    vitprune.patch(tiny, config)
    with torch.no_grad():
        tiny(image_batch(tiny))
    assert [p.shape[1] for p in vitprune.kept_positions(tiny)] == [196 - 8 * (i + 1) for i in range(12)]
    # more than half: each block merges floor(n / 2) of its n patch tokens, as the paper caps r
    vitprune.patch(tiny, merging_config(tiny, 100))
    with torch.no_grad():
        tiny(image_batch(tiny))
    assert [p.shape[1] for p in vitprune.kept_positions(tiny)] == [98, 49, 25, 13, 7, 4, 2, 1, 1, 1, 1, 1]
    for bad in (-1, [8] * 11, [8] * 11 + [-1]):
        with pytest.raises(ValueError, match=r"r must be an int >= 0 or 12 of them \(one per block\)"):
            merging_config(tiny, bad)
    for bad in (True, 2.5, None, "8" * 12, [8.0] * 12, [8] * 11 + ["8"]):
        with pytest.raises(TypeError, match=r"r must be an int >= 0 or 12 of them"):
            merging_config(tiny, bad)


@pytest.mark.parametrize("share", [0.9, 0.7, 0.55])
def test_fit_merging_fits_the_budget_within_one_token(tiny, share):
    target = share * schedule_flops(tiny, None) / 1e9
    config = fit_merging(tiny, target)
    reached = schedule_flops(tiny, config)
    assert reached <= target * 1e9
    counts, n = [], 196
    for rate in config.keep_rate:
        k = vitprune.keep_count(rate, n)
        counts.append(n - k)
        n = k
    r, j = min(counts), counts.count(min(counts) + 1)  # r + 1 in the first j blocks, r in the rest
    assert counts == [r + 1] * j + [r] * (12 - j)
    fewer = [r + 1] * (j - 1) + [r] * (13 - j) if j else [r] * 11 + [r - 1]  # one token less merged
    assert schedule_flops(tiny, merging_config(tiny, fewer)) > target * 1e9


@pytest.mark.parametrize("options", [
    {}, dict(stages="all"), dict(reduction="fuse"), dict(reduction="drop", stages="all"),
    dict(selection="top", reduction="merge"), dict(selection="bipartite", stages="all"),
], ids=str)
def test_fit_keep_rate_is_exact_to_one_token_for_every_schedule_and_reduction(tiny, options):
    target = 0.7 * schedule_flops(tiny, None) / 1e9
    rate = vitprune.fit_keep_rate(tiny, target, **options)
    reached = schedule_flops(tiny, vitprune.PruneConfig(keep_rate=rate, **options))
    assert reached <= target * 1e9
    for step in range(1, 2000):
        over = schedule_flops(tiny, vitprune.PruneConfig(keep_rate=min(1.0, rate + step * 1e-5), **options))
        if over != reached:
            break
    assert over > target * 1e9


@pytest.mark.parametrize("rate", [0.5, 1e-9], ids=["half", "one token per stage"])
def test_a_budget_equal_to_a_schedules_flops_is_met_by_that_schedule(tiny, rate):
    """The budget is met with equality allowed: a target that is exactly some rate's FLOPs,
    the least the schedule can cost included, fits at those FLOPs."""
    flops = schedule_flops(tiny, vitprune.PruneConfig(keep_rate=rate))
    assert flops / 1e9 * 1e9 == flops  # the budget in GFLOPs is this count exactly
    fitted = vitprune.fit_keep_rate(tiny, flops / 1e9)
    assert schedule_flops(tiny, vitprune.PruneConfig(keep_rate=fitted)) == flops


def test_keep_1_equals_the_unpatched_model_for_every_mode(tiny):
    x = image_batch(tiny)
    with torch.no_grad():
        expected = tiny(x)
        for selection in ("top", "redundant", "bipartite"):
            for reduction in ("merge", "fuse", "drop"):
                vitprune.patch(tiny, keep_rate=1.0, stages="all", selection=selection, reduction=reduction,
                               class_only_last=False)  # bit for bit; with it, test_class_only.py
                assert_close(tiny(x), expected, rtol=0, atol=0)


def test_defaults_are_the_measured_best_not_the_papers_fusion_token(tiny):
    config = vitprune.patch(tiny).vitprune_state.config
    assert (config.selection, config.reduction, config.size_aware) == ("bipartite", "merge", True)
    assert config.class_only_last is True  # a class-token head: the last block computes it alone
    assert vitprune.PruneConfig(**PAPER).reduction == "fuse"


@pytest.mark.parametrize("bad, error, message", [
    (dict(selection="best"), ValueError, "unknown selection 'best'; accepted: 'top', 'redundant', 'bipartite'"),
    (dict(reduction="pool"), ValueError, "unknown reduction 'pool'; accepted: 'merge', 'fuse', 'drop'"),
    (dict(size_aware=1), TypeError, "size_aware must be True or False"),
    (dict(fuse=True, reduction="merge"), ValueError, "fuse=True means reduction='fuse'"),
    (dict(stages="every"), ValueError, "unknown stages 'every'; accepted: 'spread', 'spread2', 'spread3', 'all'"),
    (dict(crowding=-0.5), ValueError, "crowding must be >= 0 and finite (0: token merging's order), got -0.5"),
    (dict(crowding=True), TypeError, "crowding must be a number >= 0 or None, got bool True"),
    (dict(crowding=math.inf), ValueError, "crowding must be >= 0 and finite (0: token merging's order), got inf"),
    (dict(crowding=math.nan), ValueError, "crowding must be >= 0 and finite (0: token merging's order), got nan"),
    (dict(crowding=0.5, indicator="var"), ValueError, "crowding only applies to selection='bipartite', not 'top'"),
])
def test_new_options_are_validated_before_the_model_changes(tiny, bad, error, message):
    before = {k: v.clone() for k, v in tiny.state_dict().items()}
    with pytest.raises(error, match=message.replace("(", r"\(").replace(")", r"\)")):
        vitprune.patch(tiny, **bad)
    assert not vitprune.is_patched(tiny) and type(tiny) is timm.models.vision_transformer.VisionTransformer
    assert all(torch.equal(v, tiny.state_dict()[k]) for k, v in before.items())
