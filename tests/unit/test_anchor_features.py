"""The first-slot variant (issue 42 item 2, ``drafter.anchor_features``): the anchor slot also
reads H_ctx[p-1], the fused target state of the last context position, as Eagle3's first step
does. It must start as the plain drafter, train the same way it serves (packed training forward =
the engine's cached path, one request or many), reach its weight through the loss, survive a
checkpoint, and be refused where no engine can hold it."""

from __future__ import annotations

import pytest
import torch

from drafters import DraftContextCache, DSparkDrafter
from drafters.config import DrafterConfig
from drafters.export.common import ExportError, check_qwen3_layers
from tests.tiny import tiny_drafter, tiny_target
from tests.unit.helpers import blocks, randomize_heads

B, T, K = 2, 12, 4


@pytest.fixture(scope="module")
def target():
    return tiny_target()


def _pair(target, drafter_type="dspark"):
    """A plain drafter and an anchor-features one with the same weights (W_a at its zero start)."""
    kw = dict(block_size=K, drafter_type=drafter_type,
              head_type="markov" if drafter_type == "dspark" else "none")
    plain = randomize_heads(tiny_drafter(target, **kw))
    variant = randomize_heads(tiny_drafter(target, anchor_features=True, **kw))
    missing, unexpected = variant.load_state_dict(plain.state_dict(), strict=False)
    assert missing == ["anchor_proj.weight"] and not unexpected
    return plain, variant


def _trained(variant, seed=1):
    """Give W_a values, as training would."""
    with torch.no_grad():
        g = torch.Generator().manual_seed(seed)
        w = variant.anchor_proj.weight
        w.copy_(torch.randn(w.shape, generator=g) * 0.3)
    return variant


def _features(drafter, b=B, t=T, seed=0):
    m_h = drafter.config.num_context_layers * drafter.config.target_hidden_size
    return torch.randn(b, t, m_h, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("kind", ["dspark", "dflash"])
def test_it_starts_as_the_plain_anchor_and_training_changes_it(target, kind):
    plain, variant = _pair(target, kind)
    feats = _features(plain)
    anchors, tok = torch.tensor([[1, 5], [3, 9]]), torch.tensor([[4, 5], [6, 7]])
    with torch.no_grad():
        torch.testing.assert_close(blocks(variant, feats, anchors, tok),
                                   blocks(plain, feats, anchors, tok), rtol=0, atol=0)
        _trained(variant)
        moved = blocks(variant, feats, anchors, tok)
    assert not torch.allclose(moved, blocks(plain, feats, anchors, tok), atol=1e-4)


def test_the_anchor_reads_the_state_before_it_and_nothing_later(target):
    """Changing the features of position p-1 moves the block at p more in the variant (it reads
    them twice: KV injection and the anchor input); positions >= p stay invisible."""
    _, variant = _pair(target)
    _trained(variant)
    feats = _features(variant)
    p = 7
    anchors, tok = torch.tensor([[p], [p]]), torch.tensor([[4], [6]])
    with torch.no_grad():
        base = blocks(variant, feats, anchors, tok)
        later = feats.clone()
        later[:, p:] += 5.0
        assert torch.equal(blocks(variant, later, anchors, tok), base)
        before = feats.clone()
        before[:, p - 1] += 1.0
        assert not torch.allclose(blocks(variant, before, anchors, tok), base, atol=1e-4)


@pytest.mark.parametrize("kind", ["dspark", "dflash"])
def test_serving_path_matches_the_training_forward(target, kind):
    _, variant = _pair(target, kind)
    _trained(variant)
    feats = _features(variant)
    tok = torch.tensor([17, 42])
    for p in (1, 6, T - 1):
        train_h = blocks(variant, feats, torch.full((B, 1), p), tok[:, None])[:, 0]
        cache = DraftContextCache()
        cut = p // 2
        if cut:
            variant.extend_context(cache, feats[:, :cut], torch.arange(cut).expand(B, cut))
        variant.extend_context(cache, feats[:, cut:p], torch.arange(cut, p).expand(B, p - cut))
        assert cache.last_state.shape == (B, variant.config.hidden_size)
        served = variant.block_hidden(cache, tok, torch.full((B,), p))
        torch.testing.assert_close(served, train_h, rtol=1e-4, atol=1e-5)


def test_batched_extend_and_propose_match_one_request_at_a_time(target):
    _, variant = _pair(target)
    _trained(variant)
    feats = _features(variant, b=3, t=10)
    lengths, grow = [4, 7, 2], [3, 0, 5]  # the middle request gets no new rows this round
    one, many = [], []
    for r in range(3):
        c1, c2 = DraftContextCache(), DraftContextCache()
        for c in (c1, c2):
            variant.extend_context(c, feats[r:r + 1, :lengths[r]], torch.arange(lengths[r])[None])
        variant.extend_context(c1, feats[r:r + 1, lengths[r]:lengths[r] + grow[r]],
                               torch.arange(lengths[r], lengths[r] + grow[r])[None]) if grow[r] else None
        one.append(c1)
        many.append(c2)
    variant.extend_context_batch(many, [feats[r, lengths[r]:lengths[r] + grow[r]] for r in range(3)],
                                 [torch.zeros(grow[r], dtype=torch.long) for r in range(3)])
    for c1, c2 in zip(one, many):
        torch.testing.assert_close(c2.last_state, c1.last_state, rtol=1e-5, atol=1e-6)
    anchors = torch.tensor([5, 9, 11])
    positions = torch.tensor([c.length for c in many])
    batched = variant.propose_block_batch(many, anchors, positions, K, temperature=0.0)
    for r, c in enumerate(one):
        alone = variant.propose_block(c, anchors[r:r + 1], positions[r:r + 1], K, temperature=0.0)
        assert torch.equal(batched.tokens[r], alone.tokens[0])
        torch.testing.assert_close(batched.confidence_logits[r], alone.confidence_logits[0],
                                   rtol=1e-4, atol=1e-5)


def test_drafting_before_any_context_is_refused_by_name(target):
    _, variant = _pair(target)
    with pytest.raises(ValueError, match="anchor_features"):
        variant.block_inputs(torch.tensor([3]))


def test_the_loss_reaches_w_a_from_its_zero_start(target):
    _, variant = _pair(target)
    variant.train()
    feats = _features(variant)
    hidden = blocks(variant, feats, torch.tensor([[2, 6], [4, 8]]), torch.tensor([[4, 5], [6, 7]]))
    logits, _ = variant.draft_logits(hidden.reshape(4, K, -1), torch.randint(0, 96, (4, K)))
    (logits.logsumexp(-1).mean() - logits[..., 5].mean()).backward()
    assert variant.anchor_proj.weight.grad.abs().sum() > 0


def test_checkpoint_round_trip_keeps_w_a(target, tmp_path):
    _, variant = _pair(target)
    _trained(variant)
    variant.save_pretrained(tmp_path)
    loaded = DSparkDrafter.from_pretrained(tmp_path, target.get_input_embeddings().weight,
                                           target.get_output_embeddings().weight)
    assert loaded.config.anchor_features
    assert torch.equal(loaded.anchor_proj.weight, variant.anchor_proj.weight)


def test_eagle3_and_exports_refuse_it(target):
    with pytest.raises(ValueError, match="anchor_features"):
        DrafterConfig(drafter_type="eagle3", head_type="none", confidence_head=False,
                      anchor_features=True)
    _, variant = _pair(target)
    with pytest.raises(ExportError, match="anchor_features"):
        check_qwen3_layers(variant.config, target.config.num_hidden_layers)


def test_the_batching_engine_stays_lossless_with_it():
    """Requests joining at different steps, greedy: each output is the target's own (the anchor
    state travels with each request's draft state through prefill, extension and rollback)."""
    from serve.engine.requests import EngineRequest, SamplingParams
    from tests.unit.helpers import greedy_reference, permuted_target
    from tests.unit.test_engine import _engine, _run

    tgt = permuted_target()
    variant = _trained(randomize_heads(tiny_drafter(tgt, block_size=K, anchor_features=True)))
    engine = _engine(tgt, variant, "fixed", max_num_requests=4)
    prompts = {"a": [5, 17, 33], "b": [9, 2], "c": [40, 41, 42, 43, 44]}
    out, _ = _run(engine, {0: [EngineRequest("a", prompts["a"], SamplingParams(14, 0.0)),
                               EngineRequest("b", prompts["b"], SamplingParams(9, 0.0))],
                           3: [EngineRequest("c", prompts["c"], SamplingParams(11, 0.0))]})
    for rid, prompt in prompts.items():
        assert out[rid] == greedy_reference(tgt, prompt, len(out[rid])), rid
    assert [len(out[r]) for r in "abc"] == [14, 9, 11]


def test_a_batch_whose_anchors_all_sit_at_position_0_has_no_context_and_still_runs(target):
    """Nothing precedes an anchor at 0: its W_a term is zero, as for the plain drafter."""
    plain, variant = _pair(target)
    feats = _features(variant)
    anchors, tok = torch.zeros(B, 1, dtype=torch.long), torch.tensor([[4], [6]])
    with torch.no_grad():
        torch.testing.assert_close(blocks(_trained(variant), feats, anchors, tok),
                                   blocks(plain, feats, anchors, tok), rtol=0, atol=0)
