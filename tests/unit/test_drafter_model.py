"""DSparkDrafter / DFlash backbone, heads, inference path, checkpoints and config validation."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from drafters import DraftContextCache, DSparkDrafter, check_target_compatibility
from drafters.base import WEIGHTS_NAME
from drafters.config import BoundDrafterConfig
from tests.tiny import tiny_drafter, tiny_target
from tests.unit.helpers import blocks, randomize_heads

B, T, K = 2, 12, 4


@pytest.fixture(scope="module")
def target():
    return tiny_target()


def _features(target, drafter, b=B, t=T, seed=0):
    g = torch.Generator().manual_seed(seed)
    m_h = drafter.config.num_context_layers * target.config.hidden_size
    return torch.randn(b, t, m_h, generator=g)


def _drafter(target, kind: str, block_size: int = K):
    if kind == "dflash":
        d = tiny_drafter(target, block_size=block_size, drafter_type="dflash")
    else:
        d = tiny_drafter(target, block_size=block_size, head_type=kind)
    return randomize_heads(d)


KINDS = ["markov", "rnn", "dflash"]


# ----------------------------------------------------------------------------- shapes
@pytest.mark.parametrize("kind", KINDS)
def test_forward_and_head_shapes(target, kind):
    d = _drafter(target, kind)
    v, h = target.config.vocab_size, target.config.hidden_size
    feats = _features(target, d)
    pos = torch.tensor([[0, 3, 7], [2, 5, 10]])
    tok = torch.randint(0, v, (B, 3))
    hidden = blocks(d, feats, pos, tok)
    assert hidden.shape == (B, 3, K, h)
    assert torch.isfinite(hidden).all()
    prev = torch.randint(0, v, (B * 3, K))
    logits, conf = d.draft_logits(hidden.reshape(B * 3, K, h), prev)
    assert logits.shape == (B * 3, K, v) and logits.dtype == torch.float32
    if kind == "dflash":
        assert conf is None
        assert d.config.num_block_inputs == K + 1 and d.config.anchor_slots == 1
    else:
        assert conf.shape == (B * 3, K) and conf.dtype == torch.float32
        assert d.config.num_block_inputs == K and d.config.anchor_slots == 0


def test_dflash_has_no_heads(target):
    d = tiny_drafter(target, drafter_type="dflash")
    assert d.head is None and d.confidence is None
    dspark = tiny_drafter(target)
    assert dspark.num_trainable_parameters() > d.num_trainable_parameters()


# ----------------------------------------------------------------------------- visibility
@pytest.mark.parametrize("kind", KINDS)
def test_context_visibility_is_strictly_before_anchor(target, kind):
    d = _drafter(target, kind)
    feats = _features(target, d, b=1)
    anchors = torch.tensor([[2, 5, 9]])
    tok = torch.tensor([[7, 11, 13]])
    base = blocks(d, feats, anchors, tok)

    # perturb position 5: invisible to the blocks at 2 and 5 (>= p), visible to the block at 9
    f = feats.clone()
    f[0, 5] += 3.0 * torch.randn(f.shape[-1])
    out = blocks(d, f, anchors, tok)
    torch.testing.assert_close(out[:, 0], base[:, 0], rtol=0, atol=1e-6)
    torch.testing.assert_close(out[:, 1], base[:, 1], rtol=0, atol=1e-6)
    assert (out[:, 2] - base[:, 2]).abs().max() > 1e-3

    # perturb position p - 1 = 4: visible to the blocks at 5 and 9, not to the block at 2
    f = feats.clone()
    f[0, 4] += 3.0 * torch.randn(f.shape[-1])
    out = blocks(d, f, anchors, tok)
    torch.testing.assert_close(out[:, 0], base[:, 0], rtol=0, atol=1e-6)
    assert (out[:, 1] - base[:, 1]).abs().max() > 1e-3
    assert (out[:, 2] - base[:, 2]).abs().max() > 1e-3

    # everything at positions >= 9 (incl. padding) is invisible to every block
    f = feats.clone()
    f[0, 9:] = 100.0
    out = blocks(d, f, anchors, tok)
    torch.testing.assert_close(out, base, rtol=0, atol=1e-6)

    # position 0 is visible to all three blocks
    f = feats.clone()
    f[0, 0] += 3.0 * torch.randn(f.shape[-1])
    out = blocks(d, f, anchors, tok)
    for a in range(3):
        assert (out[:, a] - base[:, a]).abs().max() > 1e-3


@pytest.mark.parametrize("kind", KINDS)
def test_blocks_do_not_see_each_other(target, kind):
    d = _drafter(target, kind)
    feats = _features(target, d, b=1)
    anchors = torch.tensor([[3, 4, 8]])
    tok = torch.tensor([[7, 11, 13]])
    base = blocks(d, feats, anchors, tok)
    out = blocks(d, feats, anchors, torch.tensor([[7, 50, 13]]))
    torch.testing.assert_close(out[:, 0], base[:, 0], rtol=0, atol=1e-6)
    torch.testing.assert_close(out[:, 2], base[:, 2], rtol=0, atol=1e-6)
    assert (out[:, 1] - base[:, 1]).abs().max() > 1e-3
    # a block's output does not depend on which other blocks are in the batch either
    alone = blocks(d, feats, anchors[:, 2:], tok[:, 2:])
    torch.testing.assert_close(alone[:, 0], base[:, 2], rtol=1e-5, atol=1e-5)


def test_batch_rows_are_independent(target):
    d = _drafter(target, "markov")
    feats = _features(target, d)
    anchors = torch.tensor([[3, 6], [3, 6]])
    tok = torch.tensor([[7, 11], [7, 11]])
    base = blocks(d, feats, anchors, tok)
    f = feats.clone()
    f[1] += 1.0
    out = blocks(d, f, anchors, tok)
    torch.testing.assert_close(out[0], base[0], rtol=0, atol=1e-6)
    assert (out[1] - base[1]).abs().max() > 1e-3


@pytest.mark.parametrize("kind", ["markov", "rnn"])
def test_slots_inside_block_are_bidirectional(target, kind):
    """DSpark's anchor slot (returned as prediction slot 0) depends on the mask embedding only
    through the later slots (bidirectional attention inside a block), so changing the mask
    embedding changes slot 0's output."""
    d = _drafter(target, kind)
    feats = _features(target, d, b=1)
    anchors, tok = torch.tensor([[5]]), torch.tensor([[9]])
    base = blocks(d, feats, anchors, tok)
    with torch.no_grad():
        d.mask_embedding.add_(1.0)
    out = blocks(d, feats, anchors, tok)
    assert (out[:, :, 0] - base[:, :, 0]).abs().max() > 1e-3


# ----------------------------------------------------------------------------- inference path
@pytest.mark.parametrize("kind", KINDS)
def test_inference_path_matches_training_forward(target, kind):
    d = _drafter(target, kind)
    feats = _features(target, d)
    for p in (1, 6, T - 1):
        anchors = torch.full((B, 1), p)
        tok = torch.tensor([[17], [42]])
        train_h = blocks(d, feats, anchors, tok)[:, 0]  # [B, K, H]
        cache = DraftContextCache()
        # extend in two chunks to exercise cache growth
        cut = p // 2
        if cut:
            d.extend_context(cache, feats[:, :cut], torch.arange(cut).expand(B, cut))
        d.extend_context(cache, feats[:, cut:p], torch.arange(cut, p).expand(B, p - cut))
        assert cache.length == p
        inf_h = d.block_hidden(cache, tok[:, 0], torch.full((B,), p))
        torch.testing.assert_close(inf_h, train_h, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("kind", ["markov", "rnn"])
def test_greedy_propose_agrees_with_teacher_forced_logits(target, kind):
    """propose() feeds the sampled token to the sequential head; re-scoring its own tokens with
    teacher forcing must give the same logits, hence the same argmax tokens and confidences."""
    d = _drafter(target, kind)
    with torch.no_grad():
        d.head.w2.weight.mul_(20.0)  # make the head bias matter for the argmax
    feats = _features(target, d)
    cache = DraftContextCache()
    d.extend_context(cache, feats[:, :7], torch.arange(7).expand(B, 7))
    anchor = torch.tensor([17, 42])
    hidden = d.block_hidden(cache, anchor, torch.full((B,), 7))
    prop = d.propose(hidden, anchor, K, temperature=0.0)
    assert prop.tokens.shape == (B, K) and prop.probs is None
    prev = torch.cat((anchor[:, None], prop.tokens[:, :-1]), dim=1)
    logits, conf = d.draft_logits(hidden, prev)
    assert torch.equal(logits.argmax(-1), prop.tokens)
    torch.testing.assert_close(prop.confidence_logits, conf, rtol=1e-5, atol=1e-5)
    # the head bias changes proposals relative to the backbone alone
    backbone_only = torch.nn.functional.linear(hidden, d.lm_head_weight).argmax(-1)
    assert not torch.equal(backbone_only, prop.tokens)


def test_sampled_propose_returns_the_distributions_it_sampled_from(target):
    d = _drafter(target, "markov")
    feats = _features(target, d, b=1)
    cache = DraftContextCache()
    d.extend_context(cache, feats[:, :5], torch.arange(5)[None])
    anchor = torch.tensor([3])
    hidden = d.block_hidden(cache, anchor, torch.tensor([5]))
    g = torch.Generator().manual_seed(0)
    prop = d.propose(hidden, anchor, 3, temperature=0.7, generator=g)
    assert prop.tokens.shape == (1, 3) and prop.probs.shape == (1, 3, target.config.vocab_size)
    prev = torch.cat((anchor[:, None], prop.tokens[:, :-1]), dim=1)
    logits, _ = d.draft_logits(hidden[:, :3], prev)
    torch.testing.assert_close(prop.probs, torch.softmax(logits / 0.7, -1), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(prop.probs.sum(-1), torch.ones(1, 3))


# ----------------------------------------------------------------------------- gradients
@pytest.mark.parametrize("kind", KINDS)
def test_backward_reaches_trainable_params_only(target, kind):
    d = _drafter(target, kind).train()
    emb_before = target.get_input_embeddings().weight.clone()
    feats = _features(target, d)
    anchors = torch.tensor([[1, 4], [2, 8]])
    tok = torch.tensor([[7, 11], [5, 3]])
    hidden = blocks(d, feats, anchors, tok)
    n = B * 2
    logits, conf = d.draft_logits(hidden.reshape(n, K, -1), torch.randint(0, 96, (n, K)))
    loss = logits.logsumexp(-1).mean() - logits[..., 5].mean()
    if conf is not None:
        loss = loss + conf.sigmoid().mean()
    loss.backward()
    params = dict(d.named_parameters())
    assert "embed_weight" not in params and "lm_head_weight" not in params
    assert not d.embed_weight.requires_grad and d.embed_weight.grad is None
    assert not d.lm_head_weight.requires_grad and d.lm_head_weight.grad is None
    for name, p in params.items():
        assert p.requires_grad, name
        assert p.grad is not None, f"no gradient for {name}"
        assert torch.isfinite(p.grad).all(), name
        assert p.grad.abs().sum() > 0, f"zero gradient for {name}"
    # an optimiser step on the drafter leaves the shared target tensors alone
    torch.optim.SGD(d.parameters(), lr=1.0).step()
    assert torch.equal(target.get_input_embeddings().weight, emb_before)


# ----------------------------------------------------------------------------- checkpoints
@pytest.mark.parametrize("kind", KINDS)
def test_save_load_round_trip(target, kind, tmp_path):
    d = _drafter(target, kind)
    if kind == "markov":
        d.config.calibration_temperatures = [1.5, 1.2, 0.9, 2.0]
    emb, head = target.get_input_embeddings().weight, target.get_output_embeddings().weight
    d.save_pretrained(tmp_path)
    assert (tmp_path / "config.json").is_file() and (tmp_path / WEIGHTS_NAME).is_file()
    saved = load_file(str(tmp_path / WEIGHTS_NAME))
    assert "embed_weight" not in saved and "lm_head_weight" not in saved
    assert not any(tuple(t.shape) == tuple(emb.shape) for t in saved.values())
    assert set(saved) == set(d.state_dict())
    cfg = json.loads((tmp_path / "config.json").read_text())
    assert cfg["target_name_or_path"] == "tiny-qwen3"
    assert cfg["target_layer_ids"] == [1, 3]
    assert cfg["block_size"] == K and cfg["drafter_type"] == d.config.drafter_type
    assert cfg["head_type"] == d.config.head_type

    loaded = DSparkDrafter.from_pretrained(tmp_path, emb, head)
    assert loaded.config.model_dump() == d.config.model_dump()
    assert loaded.config.head_type == d.config.head_type
    assert loaded.config.calibration_temperatures == d.config.calibration_temperatures
    feats = _features(target, d)
    anchors, tok = torch.tensor([[2, 6], [1, 9]]), torch.tensor([[4, 5], [6, 7]])
    with torch.no_grad():
        h1, h2 = blocks(d, feats, anchors, tok), blocks(loaded, feats, anchors, tok)
        assert torch.equal(h1, h2)
        prev = torch.randint(0, 96, (4, K), generator=torch.Generator().manual_seed(0))
        l1, c1 = d.draft_logits(h1.reshape(4, K, -1), prev)
        l2, c2 = loaded.draft_logits(h2.reshape(4, K, -1), prev)
    assert torch.equal(l1, l2)
    if c1 is not None:
        assert torch.equal(c1, c2)
        assert torch.equal(d.calibrated_confidence(c1), loaded.calibrated_confidence(c2))


def test_from_pretrained_errors(target, tmp_path):
    emb, head = target.get_input_embeddings().weight, target.get_output_embeddings().weight
    with pytest.raises(FileNotFoundError):
        DSparkDrafter.from_pretrained(tmp_path / "missing", emb, head)
    tiny_drafter(target).save_pretrained(tmp_path)
    other = tiny_target(vocab_size=40)
    with pytest.raises(ValueError, match="embed_weight"):
        DSparkDrafter.from_pretrained(tmp_path, other.get_input_embeddings().weight,
                                      other.get_output_embeddings().weight)


def test_calibrated_confidence(target):
    d = tiny_drafter(target, block_size=2)
    z = torch.tensor([[2.0, -1.0]])
    torch.testing.assert_close(d.calibrated_confidence(z), torch.sigmoid(z))
    d.config.calibration_temperatures = [2.0, 0.5]
    expected = torch.sigmoid(torch.tensor([[1.0, -2.0]]))
    torch.testing.assert_close(d.calibrated_confidence(z), expected)


def test_calibrated_confidence_of_a_short_block(target):
    d = tiny_drafter(target, block_size=4)
    d.config.calibration_temperatures = [2.0, 0.5, 1.0, 1.0]
    z = torch.tensor([[2.0, -1.0]])  # a proposal with l = 2 < K draft tokens
    torch.testing.assert_close(d.calibrated_confidence(z),
                               torch.sigmoid(torch.tensor([[1.0, -2.0]])))


# ----------------------------------------------------------------------------- compatibility
def test_check_target_compatibility(target):
    cfg = tiny_drafter(target).config  # "tiny-qwen3": vocab 96, hidden 64, layers [1, 3]
    check_target_compatibility(cfg, "tiny-qwen3", 96, 64, 6)  # compatible: no error
    check_target_compatibility(cfg, "/models/Tiny-Qwen3/", 96, 64, 6)  # a local copy matches
    with pytest.raises(ValueError, match="vocab size 96 != target's 100") as e:
        check_target_compatibility(cfg, "other-model", 100, 64, 6)
    assert "other-model" in str(e.value) and "tiny-qwen3" in str(e.value)
    assert "hidden size" not in str(e.value)
    with pytest.raises(ValueError, match="model name 'tiny-qwen3' != serving target's 'tiny-2'"):
        check_target_compatibility(cfg, "org/tiny-2", 96, 64, 6)
    check_target_compatibility(cfg, "org/tiny-2", 96, 64, 6, allow_name_mismatch=True)
    with pytest.raises(ValueError, match="hidden size 64 != target's 128"):
        check_target_compatibility(cfg, "tiny-qwen3", 96, 128, 6)
    with pytest.raises(ValueError, match="layer ids") as e:
        check_target_compatibility(cfg, "tiny-qwen3", 96, 64, 3)
    assert "vocab" not in str(e.value)
    check_target_compatibility(cfg, "tiny-qwen3", 96, 64, 4)  # layer 3 exists in a 4-layer target
    with pytest.raises(ValueError) as e:
        check_target_compatibility(cfg, "tiny-qwen3", 10, 32, 2)
    msg = str(e.value)
    assert "vocab size" in msg and "hidden size" in msg and "layer ids" in msg


def test_check_target_compatibility_rejects_negative_layer_ids(target):
    cfg = tiny_drafter(target).config
    with pytest.raises(ValueError, match="ascending and >= 0"):  # a config never holds them
        cfg.target.layer_ids = [-1, 3]
    cfg.target = cfg.target.model_copy(update={"layer_ids": [-1, 3]})  # unvalidated, as if
    with pytest.raises(ValueError, match="layer ids"):
        check_target_compatibility(cfg, "tiny-qwen3", 96, 64, 6)


def test_drafter_rejects_mismatched_target_tensors(target):
    cfg = tiny_drafter(target).config
    emb = target.get_input_embeddings().weight
    with pytest.raises(ValueError, match="lm_head_weight"):
        DSparkDrafter(cfg, emb, emb[:, :32])


# ----------------------------------------------------------------------------- config validation
def _cfg(**kw):
    """A config from the flat config.json fields a checkpoint records."""
    base = dict(target_vocab_size=96, target_hidden_size=64, hidden_size=64, block_size=4,
                num_attention_heads=4, num_key_value_heads=2, head_dim=16, markov_rank=8,
                target_layer_ids=[1], intermediate_size=512, rms_norm_eps=1e-6,
                rope_theta=10000.0, max_position_embeddings=4096)
    base.update(kw)
    return BoundDrafterConfig.from_json_dict(base)


def test_config_defaults():
    c = _cfg()
    assert c.loss_decay == 4.0  # paper: decay = gamma
    assert _cfg(loss_decay=4.0, block_size=7).loss_decay == 4.0
    assert _cfg(block_size=7).loss_decay == 7.0
    assert c.head_dim == 16 and c.target_vocab_size == 96
    assert c.num_context_layers == 1
    assert _cfg(target_layer_ids=[1, 9, 17]).num_context_layers == 3
    ok = _cfg(drafter_type="dflash", head_type="none", confidence_head=False)
    assert ok.num_block_inputs == 5


@pytest.mark.parametrize("kw, match", [
    (dict(drafter_type="dflash", head_type="markov"), "DFlash drafter has no sequential head"),
    (dict(drafter_type="dflash", head_type="markov", confidence_head=False),
     "DFlash drafter has no sequential head"),
    (dict(drafter_type="dflash", head_type="none", confidence_head=True),
     "DFlash drafter has no confidence head"),
    (dict(drafter_type="eagle"), "drafter_type"),
    (dict(head_type="lstm"), "head_type"),
    (dict(head_type="none", confidence_head=True), "confidence head"),
    (dict(calibration_temperatures=[1.0, 1.0, 1.0]), "calibration_temperatures"),
    (dict(calibration_temperatures=[1.0] * 5), "calibration_temperatures"),
    (dict(calibration_temperatures=[1.0, 0.0, 1.0, 1.0]), "calibration_temperatures"),
    (dict(block_size=0), "block_size"),
    (dict(target_layer_ids=[9, 1]), "ascending"),
    (dict(num_attention_heads=4, num_key_value_heads=3), "multiple"),
])
def test_config_validation_errors(kw, match):
    with pytest.raises(ValueError, match=match):
        _cfg(**kw)


def test_config_accepts_matching_calibration():
    c = _cfg(calibration_temperatures=[1.0, 1.1, 0.9, 1.3])
    assert c.calibration_temperatures == [1.0, 1.1, 0.9, 1.3]


# ----------------------------------------------------------------------------- heads
def test_markov_head_is_first_order():
    from drafters.heads import MarkovHead
    torch.manual_seed(0)
    head = MarkovHead(10, 4)
    with torch.no_grad():
        head.w2.weight.normal_()
    prev = torch.tensor([[3, 7, 7, 1]])
    bias, emb = head(torch.zeros(1, 4, 8), prev)
    w1, w2 = head.w1.weight.detach().numpy(), head.w2.weight.detach().numpy()
    for k in range(4):
        np.testing.assert_allclose(bias[0, k].detach().numpy(), w2 @ w1[prev[0, k]], rtol=1e-5,
                                   atol=1e-6)
    torch.testing.assert_close(bias[0, 1], bias[0, 2])  # same x_{k-1}, same bias
    # untrained: W2 = 0, the backbone's distribution is unchanged
    assert torch.all(MarkovHead(10, 4)(torch.zeros(1, 2, 8), prev[:, :2])[0] == 0)


def test_rnn_head_follows_eq6():
    """s_k = sig(g) s_{k-1} + (1 - sig(g)) tanh(c), B_k = W2 tanh(o), [g; c; o] = A [s; e; h] + a,
    s_0 = 0, checked step by step in float64 numpy."""
    from drafters.heads import RNNHead
    torch.manual_seed(0)
    r, v, h = 3, 7, 5
    head = RNNHead(v, r, h)
    with torch.no_grad():
        head.w2.weight.normal_()
        head.cell.weight.mul_(3.0)
    hidden = torch.randn(2, 4, h)
    prev = torch.tensor([[1, 4, 4, 0], [6, 2, 3, 3]])
    bias, emb = head(hidden, prev)
    a = head.cell.weight.detach().double().numpy()
    a0 = head.cell.bias.detach().double().numpy()
    w1 = head.w1.weight.detach().double().numpy()
    w2 = head.w2.weight.detach().double().numpy()
    sig = lambda x: 1 / (1 + np.exp(-x))  # noqa: E731
    for n in range(2):
        s = np.zeros(r)
        for k in range(4):
            e = w1[prev[n, k]]
            z = np.concatenate([s, e, hidden[n, k].double().numpy()])
            pre = a @ z + a0
            g, c, o = pre[:r], pre[r:2 * r], pre[2 * r:]
            s = sig(g) * s + (1 - sig(g)) * np.tanh(c)
            np.testing.assert_allclose(bias[n, k].detach().numpy(), w2 @ np.tanh(o), rtol=1e-4,
                                       atol=1e-5)
            np.testing.assert_allclose(emb[n, k].detach().numpy(), e, rtol=1e-6)


def test_rnn_bias_depends_on_the_whole_prefix_markov_only_on_last_token(target):
    rnn, markov = _drafter(target, "rnn"), _drafter(target, "markov")
    hidden = torch.randn(1, K, target.config.hidden_size)
    a = torch.tensor([[5, 9, 9, 9]])
    b = torch.tensor([[6, 9, 9, 9]])  # differs only in x_0
    for d, later_changes in ((rnn, True), (markov, False)):
        la, _ = d.draft_logits(hidden, a)
        lb, _ = d.draft_logits(hidden, b)
        assert (la[:, 0] - lb[:, 0]).abs().max() > 1e-4
        changed = bool((la[:, 1:] - lb[:, 1:]).abs().max() > 1e-4)
        assert changed == later_changes


def test_init_from_target_copies_the_last_layers_and_their_context_kv():
    """drafter.init = target_layers: the drafter layer takes the target's last decoder layer, the
    final norm the target's, and with the deepest feature layer feeding it the injected context
    values (and the RoPE-free position-0 keys) equal that target layer's own."""
    from transformers import DynamicCache

    from tests.tiny import tiny_drafter, tiny_target

    target = tiny_target(vocab_size=64, num_layers=6, seed=0)
    d = tiny_drafter(target, layer_ids=(1, 4), num_layers=1)
    layers = [{k: v.clone() for k, v in target.model.layers[-1].state_dict().items()}]
    d.init_from_target(layers, target.model.norm.state_dict())
    for k, v in layers[0].items():
        torch.testing.assert_close(d.layers[0].state_dict()[k], v)
    torch.testing.assert_close(d.norm.weight, target.model.norm.weight)
    ids = torch.tensor([[3, 9, 27, 5, 14, 40]])
    cache = DynamicCache(config=target.config)
    with torch.no_grad():
        out = target(input_ids=ids, cache=cache, use_cache=True, output_hidden_states=True)
    feats = torch.cat([out.hidden_states[l + 1] for l in (1, 4)], dim=-1)
    state = d.new_draft_state()
    d.extend_context(state, feats, torch.arange(6)[None])
    torch.testing.assert_close(state.values[0], cache.layers[5].values, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(state.keys[0][:, :, 0], cache.layers[5].keys[:, :, 0],
                               rtol=1e-4, atol=1e-5)


def test_init_from_target_layers_without_qk_norm_keeps_the_drafters_norms_at_one():
    """drafter.qk_norm true on a Llama-style target (no q/k norms to copy): every other tensor is
    the target layer's, the norms keep their own values (1 in a fresh drafter); a missing
    non-norm tensor still fails."""
    from tests.tiny import tiny_drafter, tiny_target

    target = tiny_target(vocab_size=64, num_layers=6, seed=0)
    d = tiny_drafter(target, layer_ids=(1, 4), num_layers=1)  # qk_norm true
    llama_like = {k: v.clone() for k, v in target.model.layers[-1].state_dict().items()
                  if "_norm.weight" not in k or "layernorm" in k}
    assert not any(k.endswith(("q_norm.weight", "k_norm.weight")) for k in llama_like)
    with torch.no_grad():
        d.layers[0].self_attn.q_norm.weight.fill_(3.0)
    d.init_from_target([llama_like], target.model.norm.state_dict())
    assert torch.equal(d.layers[0].self_attn.q_norm.weight, torch.full((16,), 3.0))
    torch.testing.assert_close(d.layers[0].self_attn.q_proj.weight,
                               llama_like["self_attn.q_proj.weight"])
    with pytest.raises(ValueError, match="target layer lacks: self_attn.q_proj.weight"):
        d.init_from_target([{k: v for k, v in llama_like.items() if "q_proj" not in k}],
                           target.model.norm.state_dict())
