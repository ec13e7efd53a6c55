"""Anchor sampling and supervised slots (SPEC section 3)."""

from __future__ import annotations

import torch

from drafters.anchors import sample_anchors, supervised_slots, valid_anchor_positions

#            pos: 0  1  2  3  4  5  6  7
MASK = torch.tensor([0, 0, 1, 1, 1, 0, 1, 1], dtype=torch.uint8)
VALID = [2, 3, 6]  # p with mask[p] = mask[p + 1] = 1


def test_valid_anchor_positions():
    assert valid_anchor_positions(MASK).tolist() == VALID
    assert valid_anchor_positions(torch.ones(5, dtype=torch.bool)).tolist() == [0, 1, 2, 3]
    assert valid_anchor_positions(torch.tensor([1, 0, 1, 0, 1])).numel() == 0
    # the last position can never be an anchor (there is no p + 1)
    assert valid_anchor_positions(torch.tensor([0, 0, 0, 1])).numel() == 0


def test_sample_anchors_returns_valid_distinct_sorted():
    g = torch.Generator().manual_seed(0)
    mask = (torch.rand(300, generator=g) < 0.7).to(torch.uint8)
    candidates = set(valid_anchor_positions(mask).tolist())
    assert len(candidates) > 60
    seen = set()
    for seed in range(30):
        a = sample_anchors(mask, 20, torch.Generator().manual_seed(seed))
        lst = a.tolist()
        assert a.dtype == torch.long
        assert len(lst) == 20  # capped at num_anchors
        assert lst == sorted(lst) and len(set(lst)) == len(lst)
        for p in lst:
            assert mask[p] == 1 and mask[p + 1] == 1
        seen.update(lst)
    assert seen <= candidates
    assert len(seen) > 0.8 * len(candidates)  # a random subset, not always the same one
    # fewer candidates than the cap: all of them
    assert sample_anchors(MASK, 512).tolist() == VALID
    assert sample_anchors(MASK, 3).tolist() == VALID
    two = sample_anchors(MASK, 2, torch.Generator().manual_seed(1)).tolist()
    assert len(two) == 2 and set(two) <= set(VALID) and two == sorted(two)


def test_sample_anchors_is_seeded():
    mask = torch.ones(200, dtype=torch.uint8)
    a = sample_anchors(mask, 10, torch.Generator().manual_seed(5))
    b = sample_anchors(mask, 10, torch.Generator().manual_seed(5))
    c = sample_anchors(mask, 10, torch.Generator().manual_seed(6))
    assert torch.equal(a, b) and not torch.equal(a, c)


def test_supervised_slots():
    s = supervised_slots(MASK, torch.tensor([2, 3, 6]), 3)
    assert s.dtype == torch.bool
    assert s.tolist() == [
        [True, True, False],    # p=2 predicts x3, x4, x5 (mask 1, 1, 0)
        [True, False, False],   # p=3 predicts x4, x5, x6 (1, 0, 1): stops at the first 0
        [True, False, False],   # p=6 predicts x7, x8, x9: sequence ends after x7
    ]
    # a 1 after a gap does not re-enable later slots
    mask = torch.tensor([1, 1, 0, 1, 1, 1])
    assert supervised_slots(mask, torch.tensor([0]), 5).tolist() == [[True, False, False, False,
                                                                     False]]
    assert supervised_slots(torch.ones(10), torch.tensor([1, 8]), 4).tolist() == [
        [True, True, True, True], [True, False, False, False]]
