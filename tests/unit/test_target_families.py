"""The engine on every target family users bring (issue 40), with tiny random targets of each
(tests/families.py: a sliding window of 8 tokens, crossed by every prompt): fp32 greedy output
equal token for token to the target's own, with a random drafter and with one that proposes the
target's own continuation (whole blocks accepted, so verification crosses the window), through
the decode attention kernel and through the PyTorch paths (batched single-token rows included);
T = 1 sampling checked by chi-square on a sliding-window target and on one with attention sinks;
a hybrid linear-attention target refused at build with its model type named; a request whose own
target pass raises fails alone."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from serve.engine.config import EngineConfig
from serve.engine.core import SpecEngine
from serve.engine.decoding import SpeculativeDecoder
from serve.engine.errors import UnsupportedTargetError
from serve.engine.requests import EngineRequest, SamplingParams
from serve.engine.target_runner import TargetKV, TargetRunner
from tests.families import (FAMILIES, HYBRID, SLIDING, SUPPORTED, WINDOW, family_config,
                            family_target)
from tests.tiny import tiny_drafter
from tests.unit.helpers import greedy_reference, randomize_heads, scripted_drafter
from tests.unit.test_speculative_lossless import _exact_first_tokens, _pooled_chisquare

LAYERS = (1, 2)
NEW = 24


def _prompts(n: int = 4, vocab: int = 96, seed: int = 0) -> list[list[int]]:
    """Prompts of 9-40 tokens: all longer than the window, some longer than a kernel batch."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(2, vocab, (length,), generator=g).tolist()
            for length in (9, 20, 40, 13)[:n]]


def _engine_greedy(target, prompts, attention: str, drafter=True) -> list[list[int]]:
    runner = TargetRunner(target, list(LAYERS) if drafter else [])
    d = tiny_drafter(target, layer_ids=LAYERS, block_size=4) if drafter else None
    # 16-token prompt chunks: a sliding layer's slot holds 2 x 8 - 1 + 16 = 31 positions, so
    # every long prompt's keys are moved back (kv_storage.SlotKVPool.prepare) while it decodes
    engine = SpecEngine(runner, d, [], EngineConfig(
        scheduler="fixed" if drafter else "none", sps_profile="off", attention=attention,
        max_num_requests=len(prompts), max_prefill_tokens=16))
    done = engine.generate([EngineRequest(f"r{i}", p, SamplingParams(NEW, 0.0))
                            for i, p in enumerate(prompts)])
    pool = runner._kv_pool()
    assert pool.reallocations == 0
    if runner.layer_windows:  # some slot's keys were moved back: the window path ran
        assert max(pool.offsets[WINDOW]) > 0
    return [c.tokens for c in done]


@pytest.fixture(scope="module", params=SUPPORTED)
def family(request):
    """(name, target, prompts, the target's own greedy continuations)."""
    target = family_target(request.param)
    prompts = _prompts()
    refs = [greedy_reference(target, p, NEW) for p in prompts]
    return request.param, target, prompts, refs


def test_the_reference_is_the_targets_own_generate(family):
    """The cache-free reference equals the target's own ``generate`` (its own cache, windowed)."""
    _, target, prompts, refs = family
    for p, ref in zip(prompts, refs):
        out = target.generate(torch.tensor([p]), max_new_tokens=NEW, do_sample=False,
                              min_new_tokens=NEW, eos_token_id=None, pad_token_id=0)
        assert out[0, len(p):].tolist() == ref


@pytest.mark.parametrize("attention", ["kernel", "pytorch"])
def test_engine_logits_equal_the_models_own(family, attention):
    """The engine's logits at every position equal the model's own forward over the whole
    sequence (fp32, 1e-4): prompt chunks, single-token decode steps, then verify blocks, so each
    attention path crosses the window (and Gemma 2's soft cap, which random weights rarely let
    change the greedy text, still shows in the logits); a sliding layer's slots hold 27
    positions of the 52, so its keys are moved back to the slot's start on the way."""
    name, target, prompts, _ = family
    seq = prompts[2] + prompts[1][:12]  # 52 tokens
    with torch.no_grad():
        own = target(input_ids=torch.tensor([seq]), use_cache=False).logits[0].float()
    runner = TargetRunner(target, list(LAYERS))
    runner.use_decode_kernel(attention == "kernel")
    runner.preallocate(slots=1, max_positions=64, memory_bytes=1 << 30, pass_tokens=12)
    kv, got, at = TargetKV(), [], 0
    for piece in (12, 12, 6, 1, 1, 1, 1, 6, 12):
        out = runner.forward_batch([kv], [seq[at:at + piece]], with_features=True)[0]
        out.keep(piece)
        got.append(out.logits)
        at += piece
    torch.testing.assert_close(torch.cat(got), own, atol=1e-4, rtol=1e-4, msg=name)
    pool = runner._kv_pool()
    if runner.layer_windows:  # the keys were moved: the slot now starts past position 0
        assert pool.offsets[WINDOW][kv.slot] > 0 and pool.reallocations == 0


def test_the_models_own_generate_is_unchanged_once_a_runner_wraps_it(family):
    """A runner sets the model's attention to the engine's; outside the engine the model still
    attends as it did (SDPA, or its eager attention with sinks), so plain ``generate`` (the eval
    stage's baseline) is the target's own."""
    _, target, prompts, refs = family
    TargetRunner(target, list(LAYERS))
    TargetRunner(target, list(LAYERS))  # a second runner on the same model keeps the fallback
    out = target.generate(torch.tensor([prompts[2]]), max_new_tokens=NEW, do_sample=False,
                          min_new_tokens=NEW, eos_token_id=None, pad_token_id=0)
    assert out[0, len(prompts[2]):].tolist() == refs[2]


@pytest.mark.parametrize("attention", ["kernel", "pytorch"])
def test_engine_greedy_equals_target_greedy(family, attention):
    name, target, prompts, refs = family
    assert _engine_greedy(target, prompts, attention) == refs, name


def test_target_only_batched_decode_equals_target_greedy(family):
    """Scheduler "none" on the PyTorch path: every decode row single-token, attended in
    batched products over the pool (kv_pool.SingleTokenRows) with the window's masks."""
    name, target, prompts, refs = family
    assert _engine_greedy(target, prompts, "pytorch", drafter=False) == refs, name


def test_whole_blocks_accepted_across_the_window(family):
    """A drafter proposing the target's own continuation: every block is accepted, so each
    verification pass attends across the window's edge at several positions at once."""
    name, target, prompts, refs = family
    for block in (3, 7):
        d = scripted_drafter(tiny_drafter(target, layer_ids=LAYERS, block_size=block),
                             prompts[1], refs[1])
        res = SpeculativeDecoder(TargetRunner(target, list(LAYERS)), d, []).generate(prompts[1],
                                                                                     NEW)
        assert res.tokens == refs[1], name
        assert all(r.accepted == r.drafted for r in res.rounds)
        assert sum(r.accepted for r in res.rounds) >= NEW // 2


@pytest.mark.parametrize("name", SLIDING)
def test_the_window_changes_the_targets_text(name):
    """The test targets are strong enough to see a window that is ignored: the same weights
    without the window decode other text for some prompt (and gpt-oss's sinks matter too)."""
    prompts = _prompts()
    windowed = [greedy_reference(family_target(name), p, NEW) for p in prompts]
    unwindowed = [greedy_reference(family_target(name, window=4096), p, NEW) for p in prompts]
    assert windowed != unwindowed
    if name == "gpt-oss":
        sinkless = family_target(name)
        for m in sinkless.modules():
            if isinstance(getattr(m, "sinks", None), torch.nn.Parameter):
                m.sinks.data.fill_(-1e4)
        assert [greedy_reference(sinkless, p, NEW) for p in prompts] != windowed


@pytest.mark.parametrize("name", SLIDING)
def test_sliding_layers_keep_only_their_window(name):
    """Each layer's window is the one transformers passes its attention (from layer_types,
    use_sliding_window / max_window_layers, or a model-wide sliding_window), and a sliding layer's
    slots hold 2 x window - 1 + the longest pass positions, not the model length: the pool's
    bytes, and a budget that buys longer slots than it would for full layers."""
    from serve.engine.kv_storage import SlotKVPool

    target = family_target(name)
    runner = TargetRunner(target, list(LAYERS))
    types = getattr(target.config, "layer_types", None) or ["sliding_attention"] * 4
    sliding = [i for i, t in enumerate(types) if t == "sliding_attention"]
    assert runner.layer_windows == {i: WINDOW for i in sliding}
    # the drafter reads the windows from the config; the engine learns them from the layers
    from drafters.target_shape import target_layer_windows
    assert {i: w for i, w in enumerate(target_layer_windows(target.config)) if w} == (
        runner.layer_windows)
    per_layer = SlotKVPool.bytes_per_position(1, 2, 16, torch.float32)
    state = runner.preallocate(slots=2, max_positions=512, memory_bytes=1 << 30, pass_tokens=16)
    kept = 2 * WINDOW - 1 + 16
    assert state["window_positions"] == {WINDOW: kept}
    assert state["bytes"] == 2 * per_layer * ((4 - len(sliding)) * 512 + len(sliding) * kept)
    # a budget of 100 full-length positions per layer buys more when some layers slide
    budget = 2 * per_layer * 4 * 100
    fresh = TargetRunner(family_target(name), list(LAYERS))
    capacity = fresh.preallocate(slots=2, max_positions=10_000, memory_bytes=budget,
                                 pass_tokens=16)["capacity"]
    full = 4 - len(sliding)
    assert capacity == (10_000 if not full else (4 * 100 - len(sliding) * kept) // full)


def test_a_layer_called_with_another_window_than_its_slots_keep_is_refused():
    """Keys older than a sliding layer's window are gone from its slots: a layer whose attention
    then asks for a longer window (or none) raises rather than attending fewer keys."""
    target = family_target("gemma3")
    runner = TargetRunner(target, list(LAYERS))
    runner.forward_batch([TargetKV()], [[3, 4, 5]], with_features=False, logits="none")
    target.get_decoder().layers[0].self_attn.sliding_window = 2 * WINDOW
    with pytest.raises(RuntimeError, match="layer 0 attends with sliding window 16"):
        runner.forward_batch([TargetKV()], [[3, 4, 5]], with_features=False, logits="none")


@pytest.mark.parametrize("name, head_scale", [("gemma3", 1.0), ("gpt-oss", 8.0),
                                              ("qwen3-next", 8.0)])
def test_sampling_matches_the_targets_distribution(name, head_scale):
    """T = 1: the joint distribution of the first three sampled tokens after a prompt longer
    than the window equals the target's own (exact, by enumeration), by chi-square."""
    target = family_target(name, vocab_size=12, num_hidden_layers=2)
    with torch.no_grad():  # gpt-oss's random head is near uniform: sharpen it (~90 cells >= 5)
        target.get_output_embeddings().weight.mul_(head_scale)
    prompt = [3, 7, 2, 9, 5, 11, 4, 6, 8, 10]
    assert len(prompt) > WINDOW
    exact = _exact_first_tokens(target, prompt)
    d = randomize_heads(tiny_drafter(target, layer_ids=(0, 1), block_size=4), seed=1, scale=1.0)
    dec = SpeculativeDecoder(TargetRunner(target, [0, 1]), d, eos_token_ids=[])
    v = target.config.vocab_size
    counts = np.zeros((v, v, v))
    accepted = 0
    for seed in range(2000):
        res = dec.generate(prompt, 4, temperature=1.0, seed=seed)
        counts[tuple(res.tokens[:3])] += 1
        accepted += res.rounds[0].accepted
    assert 0 < accepted < 2 * 2000  # the drafter is neither always right nor always wrong
    assert _pooled_chisquare(counts.sum(2), exact.sum(2)) > 1e-3
    assert _pooled_chisquare(counts, exact) > 1e-3


@pytest.mark.parametrize("name", HYBRID)
@pytest.mark.parametrize("kept", [0, 1, 3, 6])
def test_a_cut_block_leaves_the_linear_state_of_the_accepted_prefix(name, kept):
    """Verification of a 6-token block that keeps ``kept`` of them: the linear-attention states
    (and keys/values) equal those of a request that only ever ran the kept tokens; the next
    token's logits and the drafter features agree."""
    target = family_target(name)
    prompt, block, nxt = _prompts(1)[0][:20], [5, 17, 33, 8, 61, 2], [44]
    logits, feats = [], []
    for speculated in (True, False):
        runner = TargetRunner(target, list(LAYERS))
        kv = TargetKV()
        runner.forward_batch([kv], [prompt], with_features=True, logits="last")[0].keep(
            len(prompt))
        ran = block if speculated else block[:kept]
        if ran:
            runner.forward_batch([kv], [ran], with_features=True)[0].keep(kept)
        out = runner.forward_batch([kv], [nxt], with_features=True)[0]
        logits.append(out.logits)
        feats.append(out.features)
    torch.testing.assert_close(logits[0], logits[1], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(feats[0], feats[1], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("name", HYBRID)
def test_linear_attention_layers_take_no_kv_pool_memory_and_their_states_are_budgeted(name):
    """Only the full-attention layers of a hybrid target keep keys and values; the pool's bytes
    are theirs alone, and the linear layers' per-request states are counted in the budget."""
    from serve.engine.kv_storage import SlotKVPool

    target = family_target(name)
    runner = TargetRunner(target, list(LAYERS))
    full = [i for i, t in enumerate(target.config.layer_types) if t == "full_attention"]
    assert runner.num_kv_layers == len(full) == 2
    state = runner.preallocate(slots=3, max_positions=64, memory_bytes=1 << 30)
    per_position = SlotKVPool.bytes_per_position(len(full), 2, 16, torch.float32)
    assert state["bytes"] == 3 * 64 * per_position
    # the linear layers' states come out of the same budget: conv [1, C, K] and recurrent
    # [1, heads, d_k, d_v] per linear layer, twice (committed + a pass's copy), fp32
    cfg = target.config
    conv = (2 * cfg.linear_num_key_heads * cfg.linear_key_head_dim
            + cfg.linear_num_value_heads * cfg.linear_value_head_dim) * cfg.linear_conv_kernel_dim
    recurrent = cfg.linear_num_value_heads * cfg.linear_key_head_dim * cfg.linear_value_head_dim
    linear_layers = len(cfg.layer_types) - len(full)
    assert runner.state_bytes_per_request == 2 * 4 * linear_layers * (conv + recurrent)
    budget = 3 * runner.state_bytes_per_request + 3 * 40 * per_position
    fresh = TargetRunner(family_target(name), list(LAYERS))
    assert fresh.preallocate(slots=3, max_positions=64, memory_bytes=budget)["capacity"] == 40


def test_a_layer_that_ignores_the_engines_cache_is_refused_at_build():
    """The build probe compares the engine's logits with the model's own: a token mixer that
    drops the per-request state it is given (as an unknown recurrent layer would) is refused."""
    target = family_target("qwen3-next")
    mixer = target.get_decoder().layers[0].linear_attn
    own = mixer.forward

    def stateless(hidden_states, cache=None, attention_mask=None, **kwargs):
        return own(hidden_states=hidden_states, cache=None, attention_mask=attention_mask)

    mixer.forward = stateless
    with pytest.raises(UnsupportedTargetError, match="qwen3_next.*ignores the engine's cache"):
        TargetRunner(target, list(LAYERS))


def test_a_layer_type_the_engine_cannot_run_is_refused_at_build():
    """A Mamba-style layer type (no per-request state the engine implements) is refused when
    the runner is built, naming the model type, the layer type and its layers."""
    target = family_target("qwen3-next")
    target.config.layer_types = ["mamba", "full_attention", "mamba", "full_attention"]
    with pytest.raises(UnsupportedTargetError, match=r"qwen3_next.*'mamba' at layers \[0, 2\]"):
        TargetRunner(target, [1])


def test_an_unhonourable_feature_is_refused_with_the_model_type():
    target = family_target("llama")
    target.config.attention_chunk_size = 8  # as Llama 4 states chunked attention
    with pytest.raises(UnsupportedTargetError, match="'llama' uses chunked attention"):
        TargetRunner(target, [1])


@pytest.mark.parametrize("attention", ["kernel", "pytorch"])
@pytest.mark.parametrize("where", ["prefill", "verification"])
def test_a_request_whose_target_pass_raises_fails_alone(attention, where):
    """An injected failure: the target raises on any pass that holds the poison token, which is
    in one request's prompt (its prefill fails) or in its own greedy text only (a verification
    pass fails once that token is its anchor). Only that request fails (error finish, the text
    it had so far kept); the others, whose passes it shared, decode the target's text."""
    target = family_target("mistral")
    g = torch.Generator().manual_seed(0)  # seed 0: request 4's text has a token of its own
    prompts = [torch.randint(2, 96, (n,), generator=g).tolist() for n in (9, 20, 40, 13, 17)]
    refs = [greedy_reference(target, p, NEW) for p in prompts]
    if where == "prefill":  # a token in no request's prompt or text
        poison = max(set(range(2, 96)) - {t for seq in prompts + refs for t in seq})
        bad_prompt, kept = prompts[0][:5] + [poison] + prompts[0][5:], []
    else:  # a token only the bad request's own text holds, from its third new token on
        bad = 4
        others = {t for seq in prompts + refs[:bad] for t in seq}
        at = next(k for k in range(2, NEW) if refs[bad][k] not in others | set(refs[bad][:k]))
        poison, bad_prompt, kept = refs[bad][at], prompts[bad], refs[bad][:at + 1]
    good = [(p, r) for p, r in zip(prompts[:3], refs[:3])]
    draft_vocab = [t for t in range(96) if t != poison]  # the drafter never proposes it
    runner = TargetRunner(target, list(LAYERS))
    embed = target.get_input_embeddings()
    original = embed.forward

    def poisoned(ids):
        if bool((ids == poison).any()):
            raise RuntimeError("injected failure")
        return original(ids)

    embed.forward = poisoned
    drafter = tiny_drafter(target, layer_ids=LAYERS, block_size=4, draft_vocab=draft_vocab)
    engine = SpecEngine(runner, drafter, [],
                        EngineConfig(scheduler="fixed", sps_profile="off", attention=attention,
                                     max_num_requests=4))
    reqs = [EngineRequest(f"r{i}", p, SamplingParams(NEW, 0.0)) for i, (p, _) in enumerate(good)]
    reqs.insert(1, EngineRequest("bad", bad_prompt, SamplingParams(NEW, 0.0)))
    done = {c.request_id: c for c in engine.generate(reqs)}
    assert done["bad"].finish_reason == "error"
    assert done["bad"].tokens == kept
    assert [done[f"r{i}"].tokens for i in range(3)] == [r for _, r in good]
    assert engine.stats.failed_requests == 1


def test_a_failure_of_every_request_is_the_engines_not_theirs():
    """When every request of a packed pass also fails alone, the pass's error is raised (the
    engine's failure: a bug, memory), not turned into one failed request after another."""
    target = family_target("llama")
    runner = TargetRunner(target, [])
    embed = target.get_input_embeddings()

    def broken(ids):
        raise RuntimeError("engine-wide failure")

    embed.forward = broken
    with pytest.raises(RuntimeError, match="engine-wide failure"):
        runner.forward_isolated([TargetKV(), TargetKV()], [[1, 2], [3]], with_features=False)
    assert isinstance(runner.forward_isolated([TargetKV()], [[1]], with_features=False)[0],
                      RuntimeError)


# ----------------------------------------------------------------------------- drafter init
INITIALISABLE = ("llama", "llama-untied", "mistral", "phi3", "qwen3")  # Llama-shaped layers


@pytest.mark.parametrize("name", FAMILIES)
def test_init_target_layers_maps_the_layer_or_is_refused_with_its_names(name):
    """``drafter.init: target_layers``: a Llama-shaped layer (Phi-3's fused projections split)
    starts the drafter layer as the same function; any other is refused at config time naming
    the model type and what does not fit."""
    from drafters import DrafterConfig
    from drafters.layer_init import LayerInitError, check_drafter_init

    cfg = family_config(name)
    dcfg = DrafterConfig(num_layers=1, block_size=4, markov_rank=16, init="target_layers")
    if name not in INITIALISABLE:
        with pytest.raises(LayerInitError, match=f"the {cfg.model_type}"):
            check_drafter_init(dcfg, cfg, name, [1, 2])
        return
    check_drafter_init(dcfg, cfg, name, [1, 2])
    target = family_target(name)
    layer = target.get_decoder().layers[-1]
    d = tiny_drafter(target, layer_ids=LAYERS, num_layers=1)
    d.init_from_target([layer.state_dict()], target.get_decoder().norm.state_dict())
    x = torch.randn(3, 64)
    mine = d.layers[0]
    torch.testing.assert_close(mine.mlp(x), layer.mlp(x))
    torch.testing.assert_close(mine.input_layernorm(x), layer.input_layernorm(x))
    torch.testing.assert_close(d.norm(x), target.get_decoder().norm(x))
    attn = layer.self_attn
    qkv = (torch.cat([attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight])
           if hasattr(attn, "q_proj") else attn.qkv_proj.weight)
    assert torch.equal(torch.cat([mine.self_attn.q_proj.weight, mine.self_attn.k_proj.weight,
                                  mine.self_attn.v_proj.weight]), qkv)


def test_a_refused_init_stops_the_pipeline_before_any_stage(tmp_path, smollm2_dir):
    """preflight (pipeline/stages.py) names the target's model type and parameters for a Qwen2
    target with drafter.init target_layers, before any stage runs."""
    from drafters.layer_init import LayerInitError
    from pipeline.config import load_config
    from pipeline.stage_context import StageContext
    from pipeline.stages import preflight
    from tests.families import family_target_dir
    from tests.integration.pipeline_config import tiny_pipeline_config

    target = family_target_dir("qwen2-sliding", smollm2_dir, tmp_path / "target")
    ctx = StageContext.create(load_config(tiny_pipeline_config(tmp_path, target)))
    cfg = ctx.cfg.model_copy(update={"drafter": type(ctx.cfg.drafter)(
        **{**ctx.cfg.drafter.model_dump(), "init": "target_layers"})})
    ctx = StageContext(cfg, ctx.run_dir, ctx.target, ctx.layer_ids, ctx.cache_dir)
    with pytest.raises(LayerInitError, match=r"qwen2 layer 3 .*self_attn.q_proj.bias"):
        preflight(ctx, ["prompts", "generate", "cache", "train"], forced=[])
    assert not (ctx.run_dir / "prompts").exists()
