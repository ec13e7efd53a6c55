"""The training worker's frozen target head (``pipeline.train.worker.TargetHead``): the same
logits as the LM head under autocast, written into one reused buffer, and the same losses and
gradients through ``batch_losses`` as a head made for each call."""

from __future__ import annotations

import pytest
import torch

from drafters.target_weights import final_logit_softcap
from pipeline.config import TrainConfig
from pipeline.train.worker import TargetHead, batch_losses, target_head
from tests.families import FAMILIES, family_target
from tests.tiny import tiny_drafter, tiny_target

LAYERS = (1, 3)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_logits_equal_the_lm_head_under_autocast_and_reuse_one_buffer(dtype):
    g = torch.Generator().manual_seed(0)
    weight, rows = torch.randn(300, 16, generator=g), torch.randn(40, 16, generator=g)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype == torch.bfloat16):
        expected = torch.nn.functional.linear(rows, weight)
    head = TargetHead(weight, dtype)
    got = head.logits(rows)
    assert got.dtype == expected.dtype == dtype and torch.equal(got, expected)
    first = got.data_ptr()
    assert head.logits(rows[:7]).data_ptr() == first  # fewer rows: the same buffer
    bigger = head.logits(torch.cat([rows, rows]))     # more rows: the buffer grows once
    assert bigger.shape == (80, 300) and head.buffer.shape[0] == 80
    assert head.logits(rows).data_ptr() == bigger.data_ptr()


def _samples(target, n, seed):
    g = torch.Generator().manual_seed(seed)
    out = []
    with torch.no_grad():
        for _ in range(n):
            ids = torch.randint(2, target.config.vocab_size, (1, 24), generator=g)
            hs = target(input_ids=ids, output_hidden_states=True).hidden_states
            mask = torch.zeros(24, dtype=torch.uint8)
            mask[6:] = 1
            out.append({"input_ids": ids[0], "loss_mask": mask,
                        "context_hidden": torch.cat([hs[l + 1][0] for l in LAYERS], -1),
                        "last_hidden": hs[-1][0]})
    return out


class PerCallHead:
    """The path before TargetHead: ``F.linear`` under the ambient autocast, a fresh tensor per
    chunk (an independent reference: it shares no buffer with TargetHead)."""

    def __init__(self, weight):
        self.weight = weight

    def logits(self, rows):
        return torch.nn.functional.linear(rows.to(self.weight.dtype), self.weight)


@pytest.mark.parametrize("draft_vocab", [None, list(range(2, 60))])
@pytest.mark.parametrize("precision", ["bf16", "fp32"])
def test_a_reused_head_gives_the_losses_and_gradients_of_the_per_call_path(precision,
                                                                           draft_vocab):
    """Several loss chunks per micro-batch (recomputed in backward) and micro-batches of
    different sizes all go through one buffer: a chunk reading another chunk's logits, or a
    recomputation reading a later call's, would change the losses or the gradients."""
    target = tiny_target()
    drafter = tiny_drafter(target, LAYERS, block_size=3, draft_vocab=draft_vocab).train()
    tc = TrainConfig(num_workers=1, micro_batch_size=2, global_batch_size=2, num_anchors=4,
                     precision=precision, loss_chunk_rows=5)
    objective, weights = drafter.config.spec.training_objective(drafter.config)
    reused = target_head(drafter, tc)
    for seed in (1, 2):
        samples = _samples(target, 2 + seed, seed)
        results = []
        for head in (reused, PerCallHead(drafter.lm_head_weight)):
            gens = [torch.Generator().manual_seed(seed * 10 + i) for i in range(len(samples))]
            drafter.zero_grad()
            out = batch_losses(drafter, samples, tc, objective, weights, torch.device("cpu"),
                               gens, head)
            out["loss"].backward()
            results.append((out["loss"].detach(),
                            [p.grad.clone() for p in drafter.parameters() if p.grad is not None]))
        (loss_a, grads_a), (loss_b, grads_b) = results
        assert torch.equal(loss_a, loss_b) and grads_a
        assert all(torch.equal(a, b) for a, b in zip(grads_a, grads_b))
    assert reused.buffer.shape[0] == 5  # one chunk's rows, reused by every chunk


@pytest.mark.parametrize("family", FAMILIES)
def test_the_head_on_the_cached_final_state_gives_the_targets_own_logits(family):
    """What training's target side computes (the frozen LM head on ``last_hidden``, the decoder's
    final normed state as the cache stage takes it: ``model.model(...).last_hidden_state``) equals
    the target's own logits for every family, Gemma 2's final soft cap included (set low here so
    that it binds: without it the logits differ)."""
    # Gemma 2 ships a cap of 30; here one low enough to bind (the others: their defaults)
    target = family_target(family, **({"final_logit_softcapping": 1.0} if family == "gemma2"
                                      else {}))
    ids = torch.randint(2, target.config.vocab_size, (2, 20),
                        generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        last = target.model(input_ids=ids, use_cache=False).last_hidden_state  # [2, 20, H]
        expected = target(input_ids=ids, use_cache=False).logits  # [2, 20, V]
    weight = target.get_output_embeddings().weight
    cap = final_logit_softcap(target.config)
    assert (cap is not None) == (family == "gemma2")
    got = TargetHead(weight, torch.float32, cap).logits(last.flatten(0, 1)).view_as(expected)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    if cap is not None:  # the cap binds on these logits: leaving it out would be caught
        uncapped = TargetHead(weight, torch.float32).logits(last.flatten(0, 1)).view_as(expected)
        assert (uncapped - expected).abs().max() > 0.1
