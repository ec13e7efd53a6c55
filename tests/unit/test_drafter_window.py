"""The drafter's sliding attention window (``sliding_window``): resolved from the target's own
config, applied identically in training (packed blocks) and inference (context cache, batched
proposals), recorded in checkpoints and written by the exports."""

from __future__ import annotations

import json

import pytest
import torch
import transformers

from drafters import DraftContextCache, DrafterConfig
from drafters.config import BoundDrafterConfig, read_drafter_config
from drafters.target_shape import target_layer_windows
from tests.tiny import tiny_drafter, tiny_target
from tests.unit.helpers import blocks, randomize_heads

B, T, K, WINDOW = 2, 14, 4, 6


@pytest.fixture(scope="module")
def target():
    return tiny_target()


def _drafter(target, kind: str, window, num_layers: int = 1):
    extra = {"drafter_type": "dflash"} if kind == "dflash" else {"head_type": kind}
    return randomize_heads(tiny_drafter(target, block_size=K, sliding_window=window,
                                        num_layers=num_layers, **extra))


def _features(target, drafter, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(B, T, drafter.config.num_context_layers * target.config.hidden_size,
                       generator=g)


# ----------------------------------------------------------------------------- config
def _cfg(cls, **kw):
    base = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=6,
                num_attention_heads=4, num_key_value_heads=2)
    return getattr(transformers, cls)(**{**base, **kw})


@pytest.mark.parametrize("cls, kw, expected", [
    ("LlamaConfig", {}, [None] * 6),
    ("MistralConfig", {"sliding_window": 16}, [16] * 6),
    ("MistralConfig", {"sliding_window": None}, [None] * 6),
    ("Qwen2Config", {"use_sliding_window": True, "sliding_window": 16, "max_window_layers": 3},
     [None] * 3 + [16] * 3),
    ("Qwen2Config", {"use_sliding_window": False, "sliding_window": 16}, [None] * 6),
    ("Gemma3TextConfig", {"sliding_window": 16}, [16] * 5 + [None]),
    ("GptOssConfig", {"sliding_window": 16, "num_local_experts": 2}, [16, None] * 3),
])
def test_target_layer_windows_read_the_configs_own_attributes(cls, kw, expected):
    assert target_layer_windows(_cfg(cls, **kw)) == expected


def test_target_resolution_mirrors_the_targets_last_layers():
    gemma = _cfg("Gemma3TextConfig", sliding_window=16)  # layers 0-4 slide, 5 is full
    two = DrafterConfig(num_layers=2).for_target(gemma, "g", [1, 3])
    assert two.layer_windows == [16, None]
    assert DrafterConfig(num_layers=1).for_target(gemma, "g", [1]).layer_windows is None
    assert DrafterConfig(num_layers=2, sliding_window=None).for_target(
        gemma, "g", [1]).layer_windows is None
    assert DrafterConfig(num_layers=2, sliding_window=9).for_target(
        _cfg("LlamaConfig"), "l", [1]).layer_windows == [9, 9]
    mistral = _cfg("MistralConfig", sliding_window=16)
    assert DrafterConfig(num_layers=8).for_target(mistral, "m", [1]).layer_windows == (
        [None] * 2 + [16] * 6)  # deeper than the target: the extra layers attend fully
    # Eagle3 attends its whole context: 'target' leaves it full, an explicit window is refused
    eagle = DrafterConfig(drafter_type="eagle3", head_type="none", confidence_head=False)
    assert eagle.for_target(mistral, "m", [1]).layer_windows is None
    with pytest.raises(ValueError, match="Eagle3 drafter attends its whole context"):
        DrafterConfig(drafter_type="eagle3", head_type="none", confidence_head=False,
                      sliding_window=64)


def test_windows_shorter_than_a_block_are_refused():
    with pytest.raises(ValueError, match="shorter than one block pass"):
        DrafterConfig(block_size=7, sliding_window=6)
    with pytest.raises(ValueError, match="shorter than one block pass"):  # DFlash: 8 inputs
        DrafterConfig(drafter_type="dflash", head_type="none", confidence_head=False,
                      block_size=7, sliding_window=7)
    with pytest.raises(ValueError, match="target's window 4 is shorter"):
        DrafterConfig(block_size=7).for_target(_cfg("MistralConfig", sliding_window=4), "m", [1])


def test_checkpoint_records_the_windows_and_old_checkpoints_load_full(target, tmp_path):
    d = _drafter(target, "markov", WINDOW)
    assert d.config.layer_windows == [WINDOW]
    d.save_pretrained(tmp_path)
    data = json.loads((tmp_path / "config.json").read_text())
    assert data["sliding_window"] == WINDOW and data["layer_windows"] == [WINDOW]
    assert read_drafter_config(tmp_path).layer_windows == [WINDOW]
    for key in ("sliding_window", "layer_windows"):  # written before windows existed
        del data[key]
    old = BoundDrafterConfig.from_json_dict(data)
    assert old.layer_windows is None and old.sliding_window is None
    data["layer_windows"] = [2]
    with pytest.raises(ValueError, match="layer_windows needs 1 entries"):
        BoundDrafterConfig.from_json_dict(data)


# ----------------------------------------------------------------------------- model
@pytest.mark.parametrize("kind", ["markov", "dflash"])
def test_inference_matches_training_under_a_window(target, kind):
    d = _drafter(target, kind, WINDOW, num_layers=2)
    full = _drafter(target, kind, None, num_layers=2)
    full.load_state_dict(d.state_dict())
    feats = _features(target, d)
    tok = torch.tensor([[17], [42]])
    for p in (1, 5, T - 1):
        anchors = torch.full((B, 1), p)
        train_h = blocks(d, feats, anchors, tok)[:, 0]
        cache = DraftContextCache()
        d.extend_context(cache, feats[:, :p], torch.arange(p).expand(B, p))
        inf_h = d.block_hidden(cache, tok[:, 0], torch.full((B,), p))
        torch.testing.assert_close(inf_h, train_h, rtol=1e-4, atol=1e-5)
        differs = not torch.allclose(blocks(full, feats, anchors, tok)[:, 0], train_h, atol=1e-4)
        # the last slot (position p + S - 1) loses position 0 once p + S - 1 - WINDOW >= 0
        assert differs == (p >= WINDOW - d.config.num_block_inputs + 1)


def test_window_hides_exactly_the_keys_beyond_it(target):
    """Changing a context feature outside every block query's window leaves the block unchanged;
    one inside it changes it."""
    d = _drafter(target, "markov", WINDOW)
    feats = _features(target, d)
    p = T - 1
    anchors, tok = torch.full((B, 1), p), torch.tensor([[17], [42]])
    base = blocks(d, feats, anchors, tok)
    s = d.config.num_block_inputs
    hidden_from_all = p - WINDOW  # the first slot (position p) sees positions > p - WINDOW
    seen_by_last = p + s - WINDOW  # the oldest position the last slot still sees
    moved = feats.clone()
    moved[:, :hidden_from_all + 1] += 5.0  # positions every query has left behind
    torch.testing.assert_close(blocks(d, moved, anchors, tok), base, rtol=1e-5, atol=1e-6)
    moved = feats.clone()
    moved[:, seen_by_last] += 5.0
    changed = (blocks(d, moved, anchors, tok) - base).abs().amax(dim=(0, 1, 3))  # per slot
    assert bool((changed > 1e-4).all())


def test_batched_proposals_follow_the_window(target):
    """propose_block_batch over caches of different lengths (left padding + window masks) gives
    each row what its own block_hidden gives."""
    d = _drafter(target, "markov", WINDOW, num_layers=2)
    feats = _features(target, d)
    lengths = [T - 1, 4]
    caches = []
    for j, n in enumerate(lengths):
        c = DraftContextCache()
        d.extend_context(c, feats[j:j + 1, :n], torch.arange(n)[None])
        caches.append(c)
    anchors = torch.tensor([17, 42])
    positions = torch.tensor(lengths)
    batched = d.propose_block_batch(caches, anchors, positions, K, temperature=0.0)
    for j in range(2):
        own = d.propose_block(caches[j], anchors[j:j + 1], positions[j:j + 1], K, 0.0)
        assert torch.equal(batched.tokens[j:j + 1], own.tokens)
        torch.testing.assert_close(batched.confidence_logits[j:j + 1], own.confidence_logits,
                                   rtol=1e-4, atol=1e-5)


def test_windowed_training_scores_fewer_context_rows(target):
    from drafters.packing import pack_dense, packed_attention

    d = _drafter(target, "markov", WINDOW)
    feats = _features(target, d)
    packed = pack_dense(feats, torch.tensor([[12, 13], [11, 13]]), torch.tensor([[1, 2], [3, 4]]))
    s, hd = d.config.num_block_inputs, d.config.head_dim
    n = packed.anchor_positions.numel()
    g = torch.Generator().manual_seed(0)
    q = torch.randn(n, 4, s, hd, generator=g)
    kb, vb = torch.randn(n, 2, s, hd, generator=g), torch.randn(n, 2, s, hd, generator=g)
    nc = packed.context_positions.numel()
    kc, vc = torch.randn(nc, 2, hd, generator=g), torch.randn(nc, 2, hd, generator=g)
    full, windowed = {}, {}
    packed_attention(q, kb, vb, kc, vc, packed, stats=full)
    packed_attention(q, kb, vb, kc, vc, packed, stats=windowed, window=WINDOW)
    assert windowed["score_entries"] < full["score_entries"]
