"""Anchor-bounded packing (SPEC section 3; DSpark paper section 5.1): the packed layout, the
visibility rule (no query sees another sequence or its own future) and attention work that is set
by the anchors, not by the context length."""

from __future__ import annotations

import pytest
import torch

from drafters.packing import pack_blocks
from tests.tiny import tiny_drafter, tiny_target
from tests.unit.helpers import randomize_heads

#            pos: 0  1  2  3  4  5  6  7
MASK = [0, 0, 1, 1, 1, 0, 1, 1]  # anchors p with mask[p] = mask[p+1] = 1: 2, 3, 6


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


def test_pack_blocks_hand_example():
    s0 = _sample(8, MASK)                          # ids 10..17, anchors 2, 3, 6
    s1 = _sample(5, [1, 1, 1, 0, 0], offset=50)    # ids 60..64, anchors 0, 1
    pb = pack_blocks([s0, s1], num_anchors=16, block_size=3)
    assert pb.num_sequences == 2 and pb.num_blocks == 5
    assert pb.anchor_positions.tolist() == [2, 3, 6, 0, 1]
    assert pb.anchor_tokens.tolist() == [12, 13, 16, 60, 61]
    assert pb.block_offsets.tolist() == [0, 3, 5]
    assert pb.block_sequence_ids().tolist() == [0, 0, 0, 1, 1]
    # anchor-bounded context: positions < the last anchor only (6 rows of s0, 1 row of s1)
    assert pb.context_offsets.tolist() == [0, 6, 7]
    assert pb.context_positions.tolist() == [0, 1, 2, 3, 4, 5, 0]
    assert pb.context_sequence_ids().tolist() == [0] * 6 + [1]
    assert pb.context_next_tokens.tolist() == [11, 12, 13, 14, 15, 16, 61]
    torch.testing.assert_close(pb.context_features[:6], s0["context_hidden"][:6])
    torch.testing.assert_close(pb.context_features[6], s1["context_hidden"][0])
    # prev_tokens: x_{p+k-1}; labels: x_{p+k}; label_valid: the supervised prefix
    assert pb.prev_tokens[:3].tolist() == [[12, 13, 14], [13, 14, 15], [16, 17, 17]]
    assert pb.labels[0].tolist() == [13, 14, 15]
    assert pb.label_valid.tolist() == [[True, True, False], [True, False, False],
                                       [True, False, False], [True, True, False],
                                       [True, False, False]]
    # target_hidden = last_hidden[p + k - 1] where supervised, zeros elsewhere
    th = pb.target_hidden[..., 0]
    assert th.tolist() == [[102.0, 103.0, 0.0], [103.0, 0.0, 0.0], [106.0, 0.0, 0.0],
                           [150.0, 151.0, 0.0], [151.0, 0.0, 0.0]]


def test_pack_blocks_caps_anchors_keeps_dtypes_and_min_anchor():
    t = 40
    s = _sample(t, [1] * t)
    s["context_hidden"] = s["context_hidden"].to(torch.bfloat16)
    s["last_hidden"] = s["last_hidden"].to(torch.bfloat16)
    pb = pack_blocks([s], num_anchors=5, block_size=4, generator=torch.Generator().manual_seed(0))
    pos = pb.anchor_positions.tolist()
    assert len(pos) == 5 and pos == sorted(pos) and len(set(pos)) == 5
    assert pb.context_features.dtype == torch.bfloat16 and pb.target_hidden.dtype == torch.bfloat16
    assert pb.context_features.shape[0] == max(pos)
    assert pb.anchor_tokens.tolist() == [10 + p for p in pos]
    # min_anchor excludes early positions (Eagle3 needs the target state at p - 1)
    pb = pack_blocks([_sample(4, [1, 1, 1, 1])], num_anchors=8, block_size=2, min_anchor=1)
    assert pb.anchor_positions.tolist() == [1, 2]
    assert torch.equal(pb.to("cpu").labels, pb.labels)


def test_pack_blocks_rejects_sample_without_anchor():
    good = _sample(6, [1] * 6)
    bad = _sample(6, [1, 0, 1, 0, 1, 0], sample_id="conv-42")
    with pytest.raises(ValueError, match="conv-42"):
        pack_blocks([good, bad], num_anchors=4, block_size=2)
    with pytest.raises(ValueError, match="sample 1"):
        pack_blocks([good, _sample(4, [0, 0, 0, 1])], num_anchors=4, block_size=2)
    with pytest.raises(ValueError, match="p >= 1"):
        pack_blocks([_sample(3, [1, 1, 0])], num_anchors=4, block_size=2, min_anchor=1)
    with pytest.raises(ValueError):
        pack_blocks([], num_anchors=4, block_size=2)


# ----------------------------------------------------------------------------- real drafter
@pytest.fixture(scope="module")
def drafter():
    target = tiny_target()
    return randomize_heads(tiny_drafter(target, block_size=4)).eval()


def _features(t, m_h, seed):
    return torch.randn(t, m_h, generator=torch.Generator().manual_seed(seed))


def _real_samples(drafter, lengths, seed=0):
    m_h = drafter.config.num_context_layers * drafter.config.target_hidden_size
    out = []
    for i, t in enumerate(lengths):
        g = torch.Generator().manual_seed(seed + i)
        out.append({"input_ids": torch.randint(0, 96, (t,), generator=g),
                    "loss_mask": torch.ones(t, dtype=torch.uint8),
                    "context_hidden": _features(t, m_h, seed + 100 + i),
                    "last_hidden": torch.zeros(t, drafter.config.hidden_size)})
    return out


def test_no_query_sees_another_sequence_or_its_own_future(drafter):
    samples = _real_samples(drafter, [24, 30, 18])
    gen = lambda: torch.Generator().manual_seed(3)
    with torch.no_grad():
        base = drafter(pack_blocks(samples, 6, 4, gen()))
        pb = pack_blocks(samples, 6, 4, gen())
        seq = pb.block_sequence_ids()
        # another sequence's tokens: rewrite sequence 1 entirely
        changed = [dict(s) for s in samples]
        changed[1]["context_hidden"] = changed[1]["context_hidden"] + 5.0
        out = drafter(pack_blocks(changed, 6, 4, gen()))
        others = seq != 1
        torch.testing.assert_close(out[others], base[others], rtol=0, atol=1e-6)
        assert (out[seq == 1] - base[seq == 1]).abs().max() > 1e-3
        # its own future: perturb sequence 0 at positions >= p of its middle block
        anchors0 = pb.anchor_positions[seq == 0]
        p = int(anchors0[len(anchors0) // 2])
        changed = [dict(s) for s in samples]
        feats = changed[0]["context_hidden"].clone()
        feats[p:] += 5.0
        changed[0]["context_hidden"] = feats
        out = drafter(pack_blocks(changed, 6, 4, gen()))
        blind = (seq != 0) | (pb.anchor_positions <= p)
        torch.testing.assert_close(out[blind], base[blind], rtol=0, atol=1e-6)
        assert (out[~blind] - base[~blind]).abs().max() > 1e-3


def _attention_work(drafter, samples, num_anchors, seed=0):
    """Score entries per head over all layers, counted inside packed_attention itself."""
    from drafters import packing

    stats = {}
    real = packing.packed_attention

    def counting(*args, **kwargs):
        return real(*args, **kwargs, stats=stats)

    packing.packed_attention = counting
    try:
        with torch.no_grad():
            drafter(pack_blocks(samples, num_anchors, drafter.config.block_size,
                                torch.Generator().manual_seed(seed)))
    finally:
        packing.packed_attention = real
    return stats["score_entries"]


def test_attention_work_follows_anchors_not_context_length(drafter):
    """Doubling a sample's context at a fixed anchor count leaves the attention work within 2x
    (and unchanged when the anchors stay where they were), while the work grows linearly, not
    quadratically, with the number of anchors."""
    short = _real_samples(drafter, [64])[0]
    long = _real_samples(drafter, [128])[0]
    long["context_hidden"][:64] = short["context_hidden"]
    # same anchors (only the first 64 positions are supervised): identical work
    fixed = dict(long, loss_mask=torch.cat((torch.ones(64), torch.zeros(64))).to(torch.uint8))
    w_short = _attention_work(drafter, [short], 8)
    assert _attention_work(drafter, [fixed], 8) == w_short
    # anchors drawn over the doubled context: within a factor of 2 (context up to the last anchor)
    w_long = sum(_attention_work(drafter, [long], 8, seed) for seed in range(6))
    w_short = sum(_attention_work(drafter, [short], 8, seed) for seed in range(6))
    assert 1.2 < w_long / w_short <= 2.2, (w_long, w_short)
    # a dense [A*S, T + A*S] mask would make the block part quadratic in anchors; packed work for
    # 4x the anchors over the same context stays <= 4x (plus the anchor-bounded context growth)
    every = dict(short, loss_mask=torch.ones(64, dtype=torch.uint8))
    w8 = _attention_work(drafter, [every], 8, seed=1)
    w32 = _attention_work(drafter, [every], 32, seed=1)
    assert w32 <= 4 * w8 * 1.5, (w8, w32)
