"""Eagle3Drafter (drafters/eagle3.py; SPEC section 2, EAGLE-3 paper): training-time-test forward,
visibility of the packed blocks and of the causal chain, inference protocol equal to training,
checkpoints through load_drafter, and greedy losslessness through the real engine."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch
from safetensors.torch import load_file

from drafters.eagle3 import Eagle3Drafter, Eagle3DraftState
from drafters.loading import build_drafter, load_drafter
from drafters.base import WEIGHTS_NAME, BlockProposal
from drafters.packing import pack_blocks, pack_dense
from serve.engine.decoding import SpeculativeDecoder
from serve.engine.target_runner import TargetKV, TargetRunner
from tests.tiny import tiny_drafter, tiny_target
from tests.unit.helpers import _drafter_config, greedy_reference, permuted_target

B, T, K = 2, 14, 4
LAYERS = [1, 3]


@pytest.fixture(scope="module")
def target():
    return tiny_target()


def _eagle3(target, block_size: int = K, num_layers: int = 1, seed: int = 0) -> Eagle3Drafter:
    torch.manual_seed(seed)
    cfg = _drafter_config(target, LAYERS, block_size, "none", 16, drafter_type="eagle3",
                          num_layers=num_layers)
    d = build_drafter(cfg, target.get_input_embeddings().weight,
                      target.get_output_embeddings().weight)
    assert isinstance(d, Eagle3Drafter)
    return d.eval()


def _data(target, b=B, t=T, seed=0):
    """Random target features [b, t, m*H] and token ids [b, t]."""
    g = torch.Generator().manual_seed(seed)
    feats = torch.randn(b, t, len(LAYERS) * target.config.hidden_size, generator=g)
    ids = torch.randint(0, target.config.vocab_size, (b, t), generator=g)
    return feats, ids


def _packed(feats, anchors, ids, k=K):
    """pack_dense of given anchors plus the teacher-forcing tokens prev_tokens[:, j] = x_{p+j}."""
    b, a = anchors.shape
    packed = pack_dense(feats, anchors, ids.gather(1, anchors), ids)
    src = (anchors[..., None] + torch.arange(k)).clamp(max=ids.shape[1] - 1)  # [B, A, K]
    prev = ids.gather(1, src.reshape(b, a * k)).reshape(b * a, k)
    return replace(packed, prev_tokens=prev)


def _blocks(d, feats, anchors, ids, **override):
    """Training forward on given anchors: [B, A, K, H]; ``override`` replaces packed fields."""
    packed = replace(_packed(feats, anchors, ids, d.config.block_size), **override)
    out = d(packed)
    return out.view(*anchors.shape, *out.shape[1:])


def _state(d, feats, ids, p, cuts=()):
    """A draft state holding positions 0..p-1 of every row, extended in chunks split at ``cuts``."""
    state = d.new_draft_state()
    bounds = [0, *cuts, p]
    for lo, hi in zip(bounds[:-1], bounds[1:]):
        d.extend_context(state, feats[:, lo:hi], torch.arange(lo, hi).expand(feats.shape[0], -1),
                         ids[:, lo + 1:hi + 1])
    return state


def _changed(a, b) -> bool:
    return bool((a - b).abs().max() > 1e-3)


# ----------------------------------------------------------------------------- shapes, config
def test_config_forward_and_logit_shapes(target):
    d = _eagle3(target)
    assert d.config.num_block_inputs == K and d.config.anchor_slots == 0
    v, h = target.config.vocab_size, target.config.hidden_size
    feats, ids = _data(target)
    anchors = torch.tensor([[1, 4, 9], [2, 5, 10]])
    hidden = _blocks(d, feats, anchors, ids)
    assert hidden.shape == (B, 3, K, h) and torch.isfinite(hidden).all()
    prev = torch.zeros(B * 3, K, dtype=torch.long)
    logits, conf = d.draft_logits(hidden.reshape(B * 3, K, h), prev)
    assert logits.shape == (B * 3, K, v) and logits.dtype == torch.float32 and conf is None
    # the fused layer reads 2H, projects back to H
    attn = d.layers[0].self_attn
    assert attn.q_proj.in_features == 2 * h and attn.k_proj.in_features == 2 * h
    assert attn.o_proj.out_features == h and d.fc.in_features == len(LAYERS) * h


@pytest.mark.parametrize("num_layers", [1, 2])
def test_backward_through_pack_blocks_reaches_trainable_params_only(target, num_layers):
    """The trainer's path: the drafter's pack_blocks (the spec's min_anchor 1) -> forward ->
    draft_logits -> losses."""
    d = _eagle3(target, num_layers=num_layers).train()
    emb_before = target.get_input_embeddings().weight.clone()
    feats, ids = _data(target, t=24)
    samples = []
    for i in range(B):
        mask = torch.zeros(24, dtype=torch.uint8)
        mask[3 + i:] = 1
        samples.append({"input_ids": ids[i], "loss_mask": mask, "context_hidden": feats[i],
                        "last_hidden": torch.randn(24, target.config.hidden_size)})
    packed = d.pack_blocks(samples, 5, torch.Generator().manual_seed(0))
    hidden = d(packed)
    assert hidden.shape == (packed.num_blocks, K, target.config.hidden_size)
    logits, conf = d.draft_logits(hidden, packed.prev_tokens)
    assert conf is None and packed.label_valid.any()
    # TTT step weights 0.8^(k-1) (SPEC 2) on the supervised slots
    w = (0.8 ** torch.arange(K, dtype=torch.float32)).expand_as(packed.label_valid)
    ce = torch.nn.functional.cross_entropy(logits[packed.label_valid],
                                           packed.labels[packed.label_valid], reduction="none")
    loss = (w[packed.label_valid] * ce).sum() / w[packed.label_valid].sum()
    assert torch.isfinite(loss)
    loss.backward()
    params = dict(d.named_parameters())
    assert "embed_weight" not in params and "lm_head_weight" not in params
    assert d.embed_weight.grad is None and d.lm_head_weight.grad is None
    for name, p in params.items():
        assert p.grad is not None, f"no gradient for {name}"
        assert torch.isfinite(p.grad).all() and p.grad.abs().sum() > 0, name
    torch.optim.SGD(d.parameters(), lr=1.0).step()
    assert torch.equal(target.get_input_embeddings().weight, emb_before)


def test_forward_errors(target):
    d = _eagle3(target)
    feats, ids = _data(target)
    with pytest.raises(ValueError, match="min_anchor=1"):
        _blocks(d, feats, torch.tensor([[0, 4], [2, 5]]), ids)
    packed = _packed(feats, torch.tensor([[3], [5]]), ids)
    with pytest.raises(ValueError, match="prev_tokens"):
        d(replace(packed, prev_tokens=packed.prev_tokens[:, :2]))
    cfg = _drafter_config(target, LAYERS, K, "none", 16, drafter_type="dflash")
    with pytest.raises(ValueError, match="cannot build a dflash drafter"):
        Eagle3Drafter(cfg, d.embed_weight, d.lm_head_weight)


def _rope(x, pos, theta):
    """Half-split rotary embedding of x [heads, hd] at integer position ``pos``."""
    hd = x.shape[-1]
    ang = pos * theta ** (-torch.arange(0, hd, 2, dtype=torch.float32) / hd)
    cos, sin = torch.cat((ang, ang)).cos(), torch.cat((ang, ang)).sin()
    return x * cos + torch.cat((-x[..., hd // 2:], x[..., :hd // 2]), -1) * sin


@torch.no_grad()
def _reference_chain(d, feats, ids, p, steps):
    """EAGLE-3 written out token by token for one sequence (one layer, no packing, no cache):
    position t's step-1 input is [embed(x_{t+1}); g_t]; step 1 queries at p-1; step k >= 2 reads
    [embed(x_{p+k-1}); h_{k-1}] at position p-1+(k-1) and sees the context <= p-1 plus steps
    2..k."""
    c, layer = d.config, d.layers[0]
    a = layer.self_attn
    nh, nkv, hd = c.num_attention_heads, c.num_key_value_heads, c.head_dim
    g = feats @ d.fc.weight.T  # [T, H]

    def project(tok, h, pos):
        x = torch.cat((layer.input_layernorm(d.embed_weight[tok]), layer.hidden_norm(h)))
        q = _rope(a.q_norm(a.q_proj(x).view(nh, hd)), pos, c.rope_theta)
        k = _rope(a.k_norm(a.k_proj(x).view(nkv, hd)), pos, c.rope_theta)
        return q, k, a.v_proj(x).view(nkv, hd)

    keys, values = [], []
    for t in range(p):
        _, k, v = project(ids[t + 1], g[t], t)
        keys.append(k)
        values.append(v)
    h, outs = g[p - 1], []
    for step in range(steps):
        if step == 0:
            q, _, _ = project(ids[p], h, p - 1)
        else:
            q, k, v = project(ids[p + step], h, p - 1 + step)
            keys.append(k)
            values.append(v)
        kk, vv = torch.stack(keys), torch.stack(values)  # [L, nkv, hd]
        heads = []
        for i in range(nh):
            j = i // (nh // nkv)
            w = torch.softmax(kk[:, j] @ q[i] / hd ** 0.5, dim=0)
            heads.append(w @ vv[:, j])
        h = h + a.o_proj(torch.cat(heads))
        h = h + layer.mlp(layer.post_attention_layernorm(h))
        outs.append(d.norm(h))
    return torch.stack(outs)


def test_training_forward_matches_a_token_by_token_reference(target):
    d = _eagle3(target)
    feats, ids = _data(target, b=1)
    anchors = torch.tensor([[1, 5, 9]])
    out = _blocks(d, feats, anchors, ids)[0]  # [3, K, H]
    for a, p in enumerate(anchors[0].tolist()):
        ref = _reference_chain(d, feats[0], ids[0], p, K)
        torch.testing.assert_close(out[a], ref, rtol=1e-4, atol=1e-5)


# ----------------------------------------------------------------------------- visibility
@pytest.mark.parametrize("num_layers", [1, 2])
def test_context_visibility_is_strictly_before_anchor(target, num_layers):
    d = _eagle3(target, num_layers=num_layers)
    feats, ids = _data(target, b=1)
    anchors = torch.tensor([[2, 5, 9]])
    base = _blocks(d, feats, anchors, ids)

    # position 5 (>= p for the blocks at 2 and 5) is seen only by the block at 9
    f = feats.clone()
    f[0, 5] += 3.0 * torch.randn(f.shape[-1])
    out = _blocks(d, f, anchors, ids)
    torch.testing.assert_close(out[:, :2], base[:, :2], rtol=0, atol=1e-6)
    assert _changed(out[:, 2], base[:, 2])

    # position p - 1 = 4 (step 1's own state for the block at 5) changes the blocks at 5 and 9
    f = feats.clone()
    f[0, 4] += 3.0 * torch.randn(f.shape[-1])
    out = _blocks(d, f, anchors, ids)
    torch.testing.assert_close(out[:, 0], base[:, 0], rtol=0, atol=1e-6)
    assert _changed(out[:, 1, 0], base[:, 1, 0]) and _changed(out[:, 2], base[:, 2])

    # nothing at positions >= 9 is visible to any block
    f = feats.clone()
    f[0, 9:] = 100.0
    torch.testing.assert_close(_blocks(d, f, anchors, ids), base, rtol=0, atol=1e-6)

    # position 0 is visible to every block
    f = feats.clone()
    f[0, 0] += 3.0 * torch.randn(f.shape[-1])
    out = _blocks(d, f, anchors, ids)
    for a in range(3):
        assert _changed(out[:, a], base[:, a])


def test_blocks_and_sequences_do_not_see_each_other(target):
    d = _eagle3(target)
    feats, ids = _data(target)
    anchors = torch.tensor([[3, 4, 8], [3, 4, 8]])
    packed = _packed(feats, anchors, ids)
    base = d(packed).view(B, 3, K, -1)
    # another block's chain tokens (row 1 of the packed blocks = sequence 0, anchor 4)
    prev = packed.prev_tokens.clone()
    prev[1] = (prev[1] + 1) % target.config.vocab_size
    anchor_tokens = packed.anchor_tokens.clone()
    anchor_tokens[1] = (anchor_tokens[1] + 1) % target.config.vocab_size
    out = d(replace(packed, prev_tokens=prev, anchor_tokens=anchor_tokens)).view(B, 3, K, -1)
    torch.testing.assert_close(out[0, [0, 2]], base[0, [0, 2]], rtol=0, atol=1e-6)
    torch.testing.assert_close(out[1], base[1], rtol=0, atol=1e-6)
    assert _changed(out[0, 1], base[0, 1])
    # a block does not depend on which other blocks are packed with it
    alone = _blocks(d, feats, anchors[:, 2:], ids)
    torch.testing.assert_close(alone[:, 0], base[:, 2], rtol=1e-5, atol=1e-5)
    # nor on the other sequence
    f = feats.clone()
    f[1] += 1.0
    out = _blocks(d, f, anchors, ids)
    torch.testing.assert_close(out[0], base[0], rtol=0, atol=1e-6)
    assert _changed(out[1], base[1])


@pytest.mark.parametrize("num_layers", [1, 2])
def test_chain_is_causal(target, num_layers):
    """Step k depends on the teacher-forced tokens of steps <= k, never on later ones."""
    d = _eagle3(target, num_layers=num_layers)
    feats, ids = _data(target, b=1)
    anchors = torch.tensor([[6]])
    packed = _packed(feats, anchors, ids)
    base = d(packed)  # [1, K, H]
    for j in range(1, K):  # prev_tokens[:, j] is the input token of step j+1 (slot j)
        prev = packed.prev_tokens.clone()
        prev[:, j] = (prev[:, j] + 7) % target.config.vocab_size
        out = d(replace(packed, prev_tokens=prev))
        torch.testing.assert_close(out[:, :j], base[:, :j], rtol=0, atol=1e-6)
        for i in range(j, K):
            assert _changed(out[:, i], base[:, i]), (j, i)
    # the anchor token is step 1's input
    out = d(replace(packed, anchor_tokens=packed.anchor_tokens + 1))
    assert _changed(out[:, 0], base[:, 0])


# ----------------------------------------------------------------------------- inference path
@pytest.mark.parametrize("num_layers", [1, 2])
def test_inference_chain_matches_training_forward(target, num_layers):
    d = _eagle3(target, num_layers=num_layers)
    feats, ids = _data(target)
    for p in (1, 6, T - K):
        anchors = torch.full((B, 1), p)
        train_h = _blocks(d, feats, anchors, ids)[:, 0]  # [B, K, H]
        one = _state(d, feats, ids, p)
        two = _state(d, feats, ids, p, cuts=(p // 2,) if p > 1 else ())
        assert one.length == two.length == p
        for a, b in zip(one.keys + one.values + [one.hidden], two.keys + two.values + [two.hidden]):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
        assert torch.equal(two.last_token, ids[:, p])
        inf_h = d.chain_hidden(two, ids[:, p:p + K], torch.full((B,), p))
        torch.testing.assert_close(inf_h, train_h, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_proposals_match_teacher_forced_training_logits(target, temperature):
    """Re-scoring a proposal's own tokens with the training forward gives the distributions it
    was drafted from (greedy: the argmax tokens; sampled: ``probs``)."""
    d = _eagle3(target)
    feats, ids = _data(target)
    p = 7
    state = _state(d, feats, ids, p, cuts=(3,))
    anchor = ids[:, p]
    g = torch.Generator().manual_seed(0)
    prop = d.propose_block(state, anchor, torch.full((B,), p), K, temperature, g)
    assert prop.tokens.shape == (B, K) and prop.confidence_logits is None
    prev = torch.cat((anchor[:, None], prop.tokens[:, :-1]), dim=1)
    packed = replace(_packed(feats, torch.full((B, 1), p), ids), prev_tokens=prev)
    logits, _ = d.draft_logits(d(packed), prev)
    if temperature <= 0:
        assert prop.probs is None
        assert torch.equal(logits.argmax(-1), prop.tokens)
        assert len(set(prop.tokens.flatten().tolist())) > 1
    else:
        assert prop.probs.shape == (B, K, target.config.vocab_size)
        assert prop.probs.dtype == torch.float32
        torch.testing.assert_close(prop.probs, torch.softmax(logits / temperature, -1),
                                   rtol=1e-4, atol=1e-6)
    # a shorter proposal is a prefix of the same chain, and the state is not changed by drafting
    short = d.propose_block(state, anchor, torch.full((B,), p), 2, 0.0)
    full = d.propose_block(state, anchor, torch.full((B,), p), K, 0.0)
    assert torch.equal(short.tokens, full.tokens[:, :2]) and state.length == p


def test_inference_errors(target):
    d = _eagle3(target)
    feats, ids = _data(target, b=1)
    state = d.new_draft_state()
    assert isinstance(state, Eagle3DraftState) and state.length == 0
    with pytest.raises(ValueError, match="extend_context"):
        d.propose_block(state, ids[:, 0], torch.tensor([0]), 2, 0.0)
    with pytest.raises(ValueError, match="next token"):
        d.extend_context(state, feats[:, :3], torch.arange(3)[None])
    state = _state(d, feats, ids, 5)
    with pytest.raises(ValueError, match="positions start"):
        d.extend_context(state, feats[:, 6:8], torch.arange(6, 8)[None], ids[:, 7:9])
    with pytest.raises(ValueError, match="length 5"):
        d.propose_block(state, ids[:, 5], torch.tensor([6]), 2, 0.0)
    with pytest.raises(ValueError, match="anchor tokens"):
        d.propose_block(state, ids[:, 5] + 1, torch.tensor([5]), 2, 0.0)
    for n in (0, K + 1):
        with pytest.raises(ValueError, match="num_draft_tokens"):
            d.propose_block(state, ids[:, 5], torch.tensor([5]), n, 0.0)


# ----------------------------------------------------------------------------- checkpoints
def test_save_load_round_trip_through_load_drafter(target, tmp_path):
    d = _eagle3(target)
    d.save_pretrained(tmp_path)
    saved = load_file(str(tmp_path / WEIGHTS_NAME))
    assert set(saved) == set(d.state_dict())
    assert "embed_weight" not in saved and "lm_head_weight" not in saved
    cfg = json.loads((tmp_path / "config.json").read_text())
    assert cfg["drafter_type"] == "eagle3" and cfg["head_type"] == "none"
    assert cfg["block_size"] == K and cfg["target_layer_ids"] == LAYERS

    loaded = load_drafter(tmp_path, target, "tiny-qwen3")
    assert isinstance(loaded, Eagle3Drafter) and not loaded.training
    assert loaded.config.model_dump() == d.config.model_dump()
    feats, ids = _data(target)
    anchors = torch.tensor([[2, 6], [1, 9]])
    with torch.no_grad():
        assert torch.equal(_blocks(d, feats, anchors, ids), _blocks(loaded, feats, anchors, ids))
    s1, s2 = _state(d, feats, ids, 8), _state(loaded, feats, ids, 8)
    args = (ids[:, 8], torch.full((B,), 8), K, 1.0)
    p1 = d.propose_block(s1, *args, torch.Generator().manual_seed(3))
    p2 = loaded.propose_block(s2, *args, torch.Generator().manual_seed(3))
    assert torch.equal(p1.tokens, p2.tokens) and torch.equal(p1.probs, p2.probs)
    # a bf16 load runs and stays finite
    half = load_drafter(tmp_path, target, "tiny-qwen3", dtype=torch.bfloat16)
    with torch.no_grad():
        out = _blocks(half, feats, anchors, ids)
    assert out.dtype == torch.bfloat16 and torch.isfinite(out).all()
    state = _state(half, feats, ids, 8)
    assert half.propose_block(state, *args[:-1], 0.0).tokens.shape == (B, K)


def test_eagle3_is_smaller_than_a_two_layer_dspark(target):
    d = _eagle3(target)
    c = d.config
    h, i, hd = c.hidden_size, c.intermediate_size, c.head_dim
    nh, nkv = c.num_attention_heads, c.num_key_value_heads
    expected = (len(LAYERS) * h * h  # fc
                + 2 * h * (nh + 2 * nkv) * hd + nh * hd * h  # q/k/v from 2H, o_proj to H
                + 2 * hd  # qk norms
                + 3 * h * i  # SwiGLU
                + 4 * h)  # embed norm, hidden norm, post-attention norm, final norm
    assert d.num_trainable_parameters() == expected
    dspark = tiny_drafter(target, layer_ids=LAYERS, num_layers=2)
    assert d.num_trainable_parameters() < dspark.num_trainable_parameters()


# ----------------------------------------------------------------------------- engine
def _prompts(v, n, seed):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, v, (int(torch.randint(1, 16, (1,), generator=g)),),
                          generator=g).tolist() for _ in range(n)]


@pytest.mark.parametrize("block_size", [1, 4, 7])
def test_greedy_untrained_eagle3_matches_target_only(block_size):
    for target in (tiny_target(), permuted_target()):
        runner = TargetRunner(target, LAYERS)
        dec = SpeculativeDecoder(runner, _eagle3(target, block_size=block_size), eos_token_ids=[])
        for prompt in _prompts(target.config.vocab_size, 3, seed=block_size):
            spec = dec.generate(prompt, 12)
            assert spec.tokens == greedy_reference(target, prompt, 12)
            assert any(r.drafted > 0 for r in spec.rounds)


def _scripted(drafter, prompt, continuation, vocab_size, calls):
    """Run the real propose_block (recording the state it sees) but return the target's own
    continuation, with one token corrupted every third round: rounds then accept whole blocks or
    stop part-way, so extend_context gets chunks of every length."""
    original = drafter.propose_block

    def propose_block(state, anchor_tokens, anchor_positions, num_draft_tokens, temperature,
                      generator=None, top_p=1.0):
        assert bool((torch.as_tensor(temperature) <= 0).all()), "scripted drafter is greedy only"
        pos = int(anchor_positions[0])
        calls.append(([k.clone() for k in state.keys], [v.clone() for v in state.values],
                      state.hidden.clone(), int(anchor_tokens[0]), pos))
        original(state, anchor_tokens, anchor_positions, num_draft_tokens, temperature, generator,
                 top_p)
        i = pos - len(prompt)
        toks = continuation[i + 1:i + 1 + num_draft_tokens]
        toks = toks + [0] * (num_draft_tokens - len(toks))
        if len(calls) % 3 == 0:
            j = len(calls) % num_draft_tokens
            toks[j] = (toks[j] + 1) % vocab_size
        return BlockProposal(torch.tensor([toks]), None, None)

    drafter.propose_block = propose_block
    return drafter


def test_greedy_with_accepted_drafts_is_lossless_and_keeps_the_committed_state():
    target = permuted_target()
    runner = TargetRunner(target, LAYERS)
    prompt = [4, 8, 15, 16, 23]
    ref = greedy_reference(target, prompt, 40)
    calls = []
    d = _scripted(_eagle3(target), prompt, ref, target.config.vocab_size, calls)
    res = SpeculativeDecoder(runner, d, eos_token_ids=[]).generate(prompt, 30)
    assert res.tokens == ref[:30]
    assert any(r.drafted > 0 and r.accepted == r.drafted for r in res.rounds)
    assert any(r.accepted < r.drafted for r in res.rounds)
    # every block was drafted from exactly the committed prefix's state
    seq = prompt + res.tokens
    feats = runner.forward_batch([TargetKV()], [seq], with_features=True)[0].features
    ids = torch.tensor(seq)[None]
    for keys, values, hidden, anchor, pos in calls:
        assert seq[pos] == anchor and keys[0].shape[2] == pos
        fresh = _state(d, feats[None], ids, pos)
        for a, b in zip(keys + values + [hidden], fresh.keys + fresh.values + [fresh.hidden]):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)


def test_sampled_decoding_respects_budget_and_seed():
    target = tiny_target(vocab_size=12, num_layers=4, seed=0)
    d = _eagle3(target)
    dec = SpeculativeDecoder(TargetRunner(target, LAYERS), d, eos_token_ids=[])
    prompt = [3, 7, 2]
    for n in (1, 2, 6, 11):
        res = dec.generate(prompt, n, temperature=1.0, seed=n)
        assert len(res.tokens) == n
    a = dec.generate(prompt, 12, temperature=1.0, seed=5)
    assert a.tokens == dec.generate(prompt, 12, temperature=1.0, seed=5).tokens
    assert any(r.drafted > 0 for r in a.rounds) and sum(r.accepted for r in a.rounds) > 0
