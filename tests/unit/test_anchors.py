"""Anchor sampling, supervised slots and teacher-forced block batches (SPEC section 3)."""

from __future__ import annotations

import pytest
import torch

from drafters.anchors import (build_block_batch, sample_anchors, supervised_slots,
                              valid_anchor_positions)

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


def _sample(t, mask, sample_id=None, m_h=6, h=4, offset=0):
    s = {
        "input_ids": torch.arange(10 + offset, 10 + offset + t),
        "loss_mask": torch.as_tensor(mask, dtype=torch.uint8),
        # feature value = position (+ offset), so gathers are easy to check by hand
        "context_hidden": (torch.arange(t, dtype=torch.float32)[:, None] + offset).expand(t, m_h)
        + 0.01 * torch.arange(m_h),
        "last_hidden": 100.0 + offset + torch.arange(t, dtype=torch.float32)[:, None].expand(t, h)
        + 0.1 * torch.arange(h),
    }
    if sample_id is not None:
        s["sample_id"] = sample_id
    return s


def test_build_block_batch_hand_example():
    s0 = _sample(8, MASK.tolist())                 # ids 10..17, anchors 2, 3, 6
    s1 = _sample(5, [1, 1, 1, 0, 0], offset=50)    # ids 60..64, anchors 0, 1
    batch = build_block_batch([s0, s1], num_anchors=16, block_size=3)
    assert batch.context_features.shape == (2, 8, 6)
    assert batch.anchor_positions.tolist() == [[2, 3, 6], [0, 1, 0]]
    assert batch.anchor_valid.tolist() == [[True, True, True], [True, True, False]]
    assert batch.anchor_tokens.tolist() == [[12, 13, 16], [60, 61, 0]]
    # prev_tokens: x_{p+j}; labels: x_{p+1+j}; label_valid: supervised prefix
    assert batch.prev_tokens[0].tolist() == [[12, 13, 14], [13, 14, 15], [16, 17, 17]]
    assert batch.labels[0, 0].tolist() == [13, 14, 15]
    assert batch.labels[0, 1, 0] == 14 and batch.labels[0, 2, 0] == 17
    assert batch.label_valid[0].tolist() == [[True, True, False], [True, False, False],
                                             [True, False, False]]
    assert batch.prev_tokens[1, :2].tolist() == [[60, 61, 62], [61, 62, 63]]
    assert batch.labels[1, 0].tolist() == [61, 62, 63]
    assert batch.labels[1, 1, :1].tolist() == [62]
    assert batch.label_valid[1].tolist() == [[True, True, False], [True, False, False],
                                             [False, False, False]]
    # target_hidden[p + j] where supervised, zeros elsewhere
    th = batch.target_hidden[..., 0]
    assert th[0].tolist() == [[102.0, 103.0, 0.0], [103.0, 0.0, 0.0], [106.0, 0.0, 0.0]]
    assert th[1].tolist() == [[150.0, 151.0, 0.0], [151.0, 0.0, 0.0], [0.0, 0.0, 0.0]]
    torch.testing.assert_close(batch.target_hidden[0, 0, 1], s0["last_hidden"][3])
    # context features copied, padded with zeros beyond a sequence's length
    torch.testing.assert_close(batch.context_features[0], s0["context_hidden"])
    torch.testing.assert_close(batch.context_features[1, :5], s1["context_hidden"])
    assert torch.all(batch.context_features[1, 5:] == 0)


def test_build_block_batch_caps_anchors_and_keeps_dtypes():
    t = 40
    s = _sample(t, [1] * t)
    s["context_hidden"] = s["context_hidden"].to(torch.bfloat16)
    s["last_hidden"] = s["last_hidden"].to(torch.bfloat16)
    batch = build_block_batch([s], num_anchors=5, block_size=4,
                              generator=torch.Generator().manual_seed(0))
    pos = batch.anchor_positions[0].tolist()
    assert len(pos) == 5 and pos == sorted(pos) and len(set(pos)) == 5
    assert batch.context_features.dtype == torch.bfloat16
    assert batch.target_hidden.dtype == torch.bfloat16
    for a, p in enumerate(pos):
        assert batch.anchor_tokens[0, a] == 10 + p
        n_in = t - 1 - p  # slots whose label lies inside the sequence
        assert batch.labels[0, a].tolist()[:n_in] == list(range(11 + p, 15 + p))[:n_in]
    moved = batch.to("cpu")
    assert torch.equal(moved.labels, batch.labels)


def test_build_block_batch_rejects_sample_without_anchor():
    good = _sample(6, [1] * 6)
    bad = _sample(6, [1, 0, 1, 0, 1, 0], sample_id="conv-42")
    with pytest.raises(ValueError, match="conv-42"):
        build_block_batch([good, bad], num_anchors=4, block_size=2)
    with pytest.raises(ValueError, match="sample 1"):
        build_block_batch([good, _sample(4, [0, 0, 0, 1])], num_anchors=4, block_size=2)
    with pytest.raises(ValueError):
        build_block_batch([], num_anchors=4, block_size=2)
