"""drafter_losses and position_weights against hand-computed values (SPEC section 3, Eqs. 9-12).

Worked example (V = 3, K = 2, N = 1, decay = 2 so w = [1, e^-0.5]):
  slot 1: draft logits [0, 0, 0]      -> p_d = [1/3, 1/3, 1/3]
          target logits [ln 2, 0, 0]  -> p_t = [1/2, 1/4, 1/4]
          L1 = 1/6 + 1/12 + 1/12 = 1/3, TV = 1/6, label 0: CE = ln 3
  slot 2: draft logits [ln 3, 0, 0]   -> p_d = [3/5, 1/5, 1/5]
          target logits [0, 0, 0]     -> p_t = [1/3, 1/3, 1/3]
          L1 = 4/15 + 2/15 + 2/15 = 8/15, TV = 4/15, label 1: CE = ln 5
  confidence logits [0, ln 3] -> c = [1/2, 3/4]; soft labels c* = 1 - TV = [5/6, 11/15]
          BCE_1 = -(5/6 ln 1/2 + 1/6 ln 1/2) = ln 2
          BCE_2 = -(11/15 ln 3/4 + 4/15 ln 1/4)
  accept_rate = [5/6, 5/6 * 11/15 = 11/18]; tau = 1 + 5/6 + 11/18 = 22/9
"""

from __future__ import annotations

import math

import pytest
import torch

from drafters.losses import (TARGET_SLICE_ROWS, drafter_losses, eagle3_step_weights,
                             position_weights, target_terms)

LN2, LN3, LN5 = math.log(2), math.log(3), math.log(5)
W2 = math.exp(-0.5)


def _example():
    draft = torch.tensor([[[0.0, 0.0, 0.0], [LN3, 0.0, 0.0]]])
    target = torch.tensor([[[LN2, 0.0, 0.0], [0.0, 0.0, 0.0]]])
    labels = torch.tensor([[0, 1]])
    valid = torch.tensor([[True, True]])
    conf = torch.tensor([[0.0, LN3]])
    return draft, target, labels, valid, conf


EXP_CE = (LN3 + W2 * LN5) / (1 + W2)
EXP_TV = (1 / 3 + W2 * 8 / 15) / (1 + W2)
EXP_BCE2 = -(11 / 15 * math.log(3 / 4) + 4 / 15 * math.log(1 / 4))
EXP_CONF = (LN2 + EXP_BCE2) / 2


def test_position_weights_values():
    w = position_weights(4, 2.0)
    assert w.dtype == torch.float32 and w.shape == (4,)
    expected = [1.0, 0.6065306597, 0.3678794412, 0.2231301601]
    assert w.tolist() == pytest.approx(expected, abs=1e-7)
    w7 = position_weights(7, 7.0)
    assert w7[0] == 1.0
    assert float(w7[6]) == pytest.approx(math.exp(-6 / 7), abs=1e-7)  # 0.4243...
    assert float(w7[6]) == pytest.approx(0.42437284567, abs=1e-7)


def test_hand_computed_example():
    draft, target, labels, valid, conf = _example()
    out = drafter_losses(draft, target, labels, valid, position_weights(2, 2.0), conf)
    assert float(out["ce"]) == pytest.approx(EXP_CE, abs=1e-6)
    assert float(out["ce"]) == pytest.approx(1.2915, abs=1e-4)  # (1.0986 + .6065 * 1.6094) / 1.6065
    assert float(out["tv"]) == pytest.approx(EXP_TV, abs=1e-6)
    assert float(out["tv"]) == pytest.approx(0.4088, abs=1e-4)
    assert float(out["conf"]) == pytest.approx(EXP_CONF, abs=1e-6)
    assert float(out["conf"]) == pytest.approx(0.6369, abs=1e-4)  # (0.6931 + 0.5806) / 2
    total = 0.1 * EXP_CE + 0.9 * EXP_TV + 1.0 * EXP_CONF
    assert float(out["loss"]) == pytest.approx(total, abs=1e-6)
    assert out["accept_rate"].tolist() == pytest.approx([5 / 6, 11 / 18], abs=1e-6)
    assert float(out["tau"]) == pytest.approx(22 / 9, abs=1e-6)


def test_custom_coefficients_and_uniform_weights():
    draft, target, labels, valid, conf = _example()
    out = drafter_losses(draft, target, labels, valid, torch.ones(2), conf,
                         coefficients=(1.0, 0.0, 0.0))
    assert float(out["ce"]) == pytest.approx((LN3 + LN5) / 2, abs=1e-6)
    assert float(out["loss"]) == pytest.approx((LN3 + LN5) / 2, abs=1e-6)
    out = drafter_losses(draft, target, labels, valid, torch.ones(2), conf,
                         coefficients=(0.0, 2.0, 0.0))
    assert float(out["loss"]) == pytest.approx(2 * (1 / 3 + 8 / 15) / 2, abs=1e-6)


def test_without_confidence_head():
    draft, target, labels, valid, _ = _example()
    out = drafter_losses(draft, target, labels, valid, position_weights(2, 2.0), None)
    assert float(out["conf"]) == 0.0
    assert float(out["loss"]) == pytest.approx(0.1 * EXP_CE + 0.9 * EXP_TV, abs=1e-6)


def test_invalid_slots_are_ignored():
    draft, target, labels, valid, conf = _example()
    # second block: only slot 1 supervised, a copy of the first block's slot 1
    junk = torch.tensor([[50.0, -50.0, 7.0]])
    d2 = torch.cat((draft, torch.cat((draft[:, :1], junk[:, None]), 1)), 0).requires_grad_(True)
    t2 = torch.cat((target, torch.cat((target[:, :1], -junk[:, None]), 1)), 0)
    l2 = torch.cat((labels, torch.tensor([[0, 2]])), 0)
    v2 = torch.tensor([[True, True], [True, False]])
    c2 = torch.cat((conf, torch.tensor([[0.0, 99.0]])), 0)
    out = drafter_losses(d2, t2, l2, v2, position_weights(2, 2.0), c2)
    # rows: (ln3, w=1), (ln5, w=W2), (ln3, w=1)
    assert float(out["ce"]) == pytest.approx((2 * LN3 + W2 * LN5) / (2 + W2), abs=1e-6)
    assert float(out["tv"]) == pytest.approx((2 / 3 + W2 * 8 / 15) / (2 + W2), abs=1e-6)
    assert float(out["conf"]) == pytest.approx((2 * LN2 + EXP_BCE2) / 3, abs=1e-6)
    # accept_rate@2 averages over blocks whose slot 2 is supervised (only the first)
    assert out["accept_rate"].tolist() == pytest.approx([5 / 6, 11 / 18], abs=1e-6)
    # tau: block 1 = 22/9, truncated block 2 = 1 + 5/6
    assert float(out["tau"]) == pytest.approx((22 / 9 + 11 / 6) / 2, abs=1e-6)
    out["loss"].backward()
    assert torch.all(d2.grad[1, 1] == 0)
    assert d2.grad[0].abs().sum() > 0 and d2.grad[1, 0].abs().sum() > 0
    # changing anything in the unsupervised slot changes nothing
    d3 = d2.detach().clone()
    d3[1, 1] = torch.tensor([-3.0, 4.0, 0.5])
    out3 = drafter_losses(d3, t2, l2, v2, position_weights(2, 2.0), c2)
    for key in ("loss", "ce", "tv", "conf", "tau"):
        assert float(out3[key].detach()) == pytest.approx(float(out[key].detach()), abs=1e-7), key


def test_tau_ignores_blocks_without_supervised_slots():
    draft, target, labels, valid, conf = _example()
    pad = lambda x, fill: torch.cat((x, torch.full_like(x, fill)), 0)  # noqa: E731
    out = drafter_losses(pad(draft, 0.0), pad(target, 0.0), pad(labels, 0),
                         torch.tensor([[True, True], [False, False]]), position_weights(2, 2.0),
                         pad(conf, 0.0))
    assert float(out["ce"]) == pytest.approx(EXP_CE, abs=1e-6)  # losses already ignore it
    assert out["accept_rate"].tolist() == pytest.approx([5 / 6, 11 / 18], abs=1e-6)
    assert float(out["tau"]) == pytest.approx(22 / 9, abs=1e-6)


def test_ce_only_mode():
    draft, target, labels, valid, conf = _example()
    draft = draft.clone().requires_grad_(True)
    out = drafter_losses(draft, target, labels, valid, position_weights(2, 2.0), None,
                         objective="ce")  # DFlash: no confidence head
    assert float(out["loss"].detach()) == pytest.approx(EXP_CE, abs=1e-6)
    assert float(out["tv"]) == pytest.approx(EXP_TV, abs=1e-6)  # still reported
    out["loss"].backward()
    # d/dlogits of sum_k w_k CE_k / sum w = w_k / sum w * (p_d - onehot(label))
    s = 1 + W2
    g1 = [(1 / 3 - 1) / s, (1 / 3) / s, (1 / 3) / s]
    g2 = [W2 * 3 / 5 / s, W2 * (1 / 5 - 1) / s, W2 * 1 / 5 / s]
    assert draft.grad[0, 0].tolist() == pytest.approx(g1, abs=1e-6)
    assert draft.grad[0, 1].tolist() == pytest.approx(g2, abs=1e-6)


def test_confidence_label_is_detached():
    """With only the confidence term, no gradient reaches the draft logits (the soft label
    1 - TV is a constant), but the confidence logits get sigma(z) - c*."""
    draft, target, labels, valid, conf = _example()
    draft = draft.clone().requires_grad_(True)
    conf = conf.clone().requires_grad_(True)
    out = drafter_losses(draft, target, labels, valid, position_weights(2, 2.0), conf,
                         coefficients=(0.0, 0.0, 1.0))
    out["loss"].backward()
    assert draft.grad is None or torch.all(draft.grad == 0)
    # d mean BCE / dz = (sigma(z) - c*) / 2
    assert conf.grad[0].tolist() == pytest.approx([(1 / 2 - 5 / 6) / 2, (3 / 4 - 11 / 15) / 2],
                                                  abs=1e-6)


def test_tv_gradient_flows_to_draft_logits():
    draft, target, labels, valid, conf = _example()
    draft = draft.clone().requires_grad_(True)
    out = drafter_losses(draft, target, labels, valid, position_weights(2, 2.0), conf,
                         coefficients=(0.0, 1.0, 0.0))
    out["loss"].backward()
    assert draft.grad.abs().sum() > 0
    # moving p_d toward p_t (slot 1: raise logit 0) must lower the TV loss
    assert draft.grad[0, 0, 0] < 0


def test_identical_distributions():
    logits = torch.randn(3, 4, 5, generator=torch.Generator().manual_seed(0))
    labels = torch.zeros(3, 4, dtype=torch.long)
    valid = torch.ones(3, 4, dtype=torch.bool)
    out = drafter_losses(logits, logits.clone(), labels, valid, position_weights(4, 4.0),
                         torch.full((3, 4), 20.0))
    assert float(out["tv"]) == pytest.approx(0.0, abs=1e-6)
    assert out["accept_rate"].tolist() == pytest.approx([1.0] * 4, abs=1e-6)
    assert float(out["tau"]) == pytest.approx(5.0, abs=1e-5)  # 1 + gamma


def test_no_supervised_slot_raises():
    draft, target, labels, _, conf = _example()
    with pytest.raises(ValueError, match="supervised"):
        drafter_losses(draft, target, labels, torch.zeros(1, 2, dtype=torch.bool),
                       position_weights(2, 2.0), conf)


def test_soft_ce_objective_gradient():
    """Eagle3's soft CE: d/dlogits of sum_k w_k (-sum_v p_t log p_d) / sum w = w_k / sum w (p_d - p_t)."""
    draft, target, labels, valid, conf = _example()
    draft = draft.clone().requires_grad_(True)
    w = position_weights(2, 2.0)
    out = drafter_losses(draft, target, labels, valid, w, None, objective="soft_ce")
    p_d, p_t = torch.softmax(draft.detach(), -1), torch.softmax(target, -1)
    rows = -(p_t * torch.log(p_d)).sum(-1)[valid]
    wv = w[None].expand_as(valid)[valid]
    assert float(out["loss"].detach()) == pytest.approx(float((wv * rows).sum() / wv.sum()), abs=1e-6)
    out["loss"].backward()
    expected = (w / w[valid[0]].sum())[:, None] * (p_d[0] - p_t[0])
    torch.testing.assert_close(draft.grad[0], expected, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("objective,term", [("soft_ce", "soft_ce"), ("ce", "ce")])
def test_other_objectives_keep_the_confidence_term(objective, term):
    """A DSpark trained with DFlash's or Eagle3's objective (train.objective) still trains its
    confidence head: loss = that term + c_conf * L_conf, and the head gets a gradient."""
    draft, target, labels, valid, conf = _example()
    conf = conf.clone().requires_grad_(True)
    w = position_weights(2, 2.0)
    out = drafter_losses(draft, target, labels, valid, w, conf, (0.1, 0.9, 0.5), objective)
    assert float(out["conf"]) > 0
    assert float(out["loss"].detach()) == pytest.approx(float(out[term] + 0.5 * out["conf"]),
                                                        abs=1e-6)
    out["loss"].backward()
    assert conf.grad is not None and float(conf.grad.abs().sum()) > 0
    without = drafter_losses(draft, target, labels, valid, w, None, (0.1, 0.9, 0.5), objective)
    assert float(without["loss"]) == pytest.approx(float(out[term]), abs=1e-6)


def test_unknown_objective_is_rejected():
    draft, target, labels, valid, conf = _example()
    with pytest.raises(ValueError, match="unknown objective"):
        drafter_losses(draft, target, labels, valid, position_weights(2, 2.0), objective="kl")


def test_eagle3_step_weights():
    assert eagle3_step_weights(3).tolist() == pytest.approx([1.0, 0.8, 0.64])


@pytest.mark.parametrize("rows", [1, TARGET_SLICE_ROWS, 2 * TARGET_SLICE_ROWS + 5])
def test_target_terms_in_slices_equal_the_whole_softmax(rows):
    """target_terms normalises [rows, V] slice by slice (bf16 logits converted per slice): the
    same probabilities and outside mass as one fp32 softmax over all rows."""
    g = torch.Generator().manual_seed(rows)
    logits = (3 * torch.randn(rows, 300, generator=g)).bfloat16()
    subset = torch.randperm(300, generator=g)[:40]
    full = torch.softmax(logits.float(), dim=-1)
    p, outside = target_terms(logits)
    assert outside is None
    torch.testing.assert_close(p, full, rtol=1e-5, atol=1e-7)
    p_sub, outside = target_terms(logits, subset)
    torch.testing.assert_close(p_sub, full[:, subset], rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(outside, 1 - full[:, subset].sum(-1), rtol=1e-5, atol=1e-6)
