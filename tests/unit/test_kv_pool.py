"""The target's KV pool (serve/engine/kv_pool.py, serve/engine/target_runner.py): in-place slots
give the same logits and layer features as a plain forward over the whole sequence, for batches of
requests at different lengths, across uncommitted (rejected) positions and pool growth; slots are
freed with their requests; chunked prefill decodes exactly as one-shot prefill and lets running
requests keep decoding meanwhile."""

from __future__ import annotations

import gc

import pytest
import torch

from serve.engine.config import EngineConfig
from serve.engine.core import SpecEngine
from serve.engine.requests import EngineRequest, SamplingParams
from serve.engine.target_runner import TargetKV, TargetRunner
from tests.tiny import tiny_drafter, tiny_target

LAYERS = [1, 3, 5]  # 5 is the last layer of the tiny target


def _full(model, seq: list[int]):
    """Logits fp32 [T, V] and hidden_states of a plain forward over the whole sequence."""
    out = model(input_ids=torch.tensor([seq]), output_hidden_states=True)
    return out.logits[0].float(), out.hidden_states


@pytest.fixture(scope="module")
def model():
    return tiny_target()


@pytest.mark.parametrize("kernel", [True, False], ids=["decode kernel", "pytorch"])
def test_batched_slots_match_a_plain_forward_over_each_sequence(model, kernel):
    runner = TargetRunner(model, LAYERS)
    assert runner.use_decode_kernel(kernel) == kernel  # CI builds the kernel: it must be in use
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(2, 96, (n,), generator=g).tolist() for n in (5, 17, 9, 1)]
    kvs = [TargetKV() for _ in prompts]
    runner.forward_batch(kvs, prompts, with_features=False, logits="last")
    for kv, p in zip(kvs, prompts):
        kv.length = len(p)  # commit every prompt token
    seqs = [list(p) for p in prompts]
    for step in range(4):
        # verify blocks of different sizes; commit only part of each (the rest was "rejected")
        blocks = [torch.randint(2, 96, (1 + (j + step) % 4,), generator=g).tolist()
                  for j in range(len(kvs))]
        outs = runner.forward_batch(kvs, blocks, with_features=True)
        for j, (o, block) in enumerate(zip(outs, blocks)):
            logits, hidden = _full(model, seqs[j] + block)
            n = len(block)
            torch.testing.assert_close(o.logits, logits[-n:], atol=1e-4, rtol=1e-4)
            expected = torch.cat([hidden[i + 1][0, -n:] for i in LAYERS], dim=-1)
            torch.testing.assert_close(o.features, expected, atol=1e-4, rtol=1e-4)
            keep = 1 + (j + step) % n if n > 1 else 1
            o.keep(keep)
            seqs[j] += block[:keep]
    assert [kv.length for kv in kvs] == [len(s) for s in seqs]


def test_which_single_token_requests_are_attended_together():
    from serve.engine.kv_pool import batched_single_tokens

    assert batched_single_tokens([0, 1, 2, 3], [100] * 4, [1] * 4) == [0, 1, 2, 3]
    # one long request would make every row attend 1,000 positions: it goes alone
    assert batched_single_tokens([0, 1, 2, 3], [100, 110, 1000, 105], [1] * 4) == [0, 3, 1]
    assert batched_single_tokens([0, 1], [100, 100], [1, 3]) == []  # one single: nothing to batch
    assert batched_single_tokens([0, 9], [100, 100], [1, 1]) == []  # a range mostly of holes


def test_the_batched_width_comes_in_few_sizes_and_never_passes_the_pool():
    """The batched product's width is rounded up to WIDTH_STEP (a few buffer sizes the allocator
    reuses, instead of a heap that grows step by step), capped at the pool's capacity; the extra
    positions are masked out."""
    from serve.engine.kv_pool import WIDTH_STEP, SingleTokenRows

    rows = SingleTokenRows([0, 1], [10, 70], [0, 1], "cpu")
    assert rows.width == 2 * WIDTH_STEP  # 71 keys, the new token's included
    assert rows.mask.shape[-1] == rows.width
    assert rows.mask[:, 0, 0].sum(-1).tolist() == [11, 71]
    assert SingleTokenRows([0, 1], [10, 70], [0, 1], "cpu", max_width=100).width == 100


@pytest.mark.parametrize("order", ["slot order", "reversed"])
def test_single_token_requests_attended_together_match_a_plain_forward(model, order, monkeypatch):
    """Decode steps where most requests run one token (attended together in one batched product
    over a slot range, serve/engine/kv_pool.py: SingleTokenRows) beside a multi-token one, with a
    freed slot inside the range, give each request the logits and features of a plain forward; also
    when the pass lists the requests in another order than their slots (reused slots)."""
    import serve.engine.kv_pool as kv_pool

    monkeypatch.setattr(kv_pool, "PER_REQUEST_COST", 1e9)  # every single-token request batched
    runner = TargetRunner(model, LAYERS)
    runner.use_decode_kernel(False)  # the PyTorch path (where the kernel cannot be built)
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(2, 96, (n,), generator=g).tolist() for n in (6, 23, 2, 11, 8)]
    kvs = [TargetKV() for _ in prompts]
    runner.forward_batch(kvs, prompts, with_features=False, logits="last")
    for kv, p in zip(kvs, prompts):
        kv.length = len(p)
    seqs = [list(p) for p in prompts]
    kvs[2].release()  # a hole in the slot range: its row is computed and discarded
    live = [0, 1, 3, 4] if order == "slot order" else [4, 3, 1, 0]
    for step in range(5):
        blocks = {j: torch.randint(2, 96, (3 if j == live[step % 4] else 1,),
                                   generator=g).tolist() for j in live}
        outs = runner.forward_batch([kvs[j] for j in live], [blocks[j] for j in live],
                                    with_features=True)
        for j, o in zip(live, outs):
            logits, hidden = _full(model, seqs[j] + blocks[j])
            n = len(blocks[j])
            torch.testing.assert_close(o.logits, logits[-n:], atol=1e-4, rtol=1e-4)
            expected = torch.cat([hidden[i + 1][0, -n:] for i in LAYERS], dim=-1)
            torch.testing.assert_close(o.features, expected, atol=1e-4, rtol=1e-4)
            o.keep(n)
            seqs[j] += blocks[j]


def test_the_pool_grows_and_frees_slots_with_their_requests(model):
    runner = TargetRunner(model, LAYERS)
    kvs = [TargetKV() for _ in range(6)]  # more than the 4 initial slots
    long = list(range(2, 90)) * 4  # 352 positions: more than the 256 initial capacity
    runner.forward_batch(kvs, [long[:10 + j] for j in range(5)] + [long], with_features=False,
                         logits="last")
    pool = runner._kv_pool()
    assert pool.num_slots >= 6 and pool.capacity >= len(long)
    assert len({kv.slot for kv in kvs}) == 6
    kvs[5].length = len(long)
    o = runner.forward_batch([kvs[5]], [[7]], with_features=False)[0]
    torch.testing.assert_close(o.logits, _full(model, long + [7])[0][-1:], atol=1e-4, rtol=1e-4)
    free_before = len(pool.free_slots)
    freed = kvs[2].slot
    del kvs[2], o
    gc.collect()
    assert len(pool.free_slots) == free_before + 1 and freed in pool.free_slots
    assert TargetKV().bind(pool) == freed  # the next request reuses it


def test_plain_generate_on_the_same_model_is_unchanged():
    """The runner registers its attention with transformers; any other call keeps SDPA."""
    model = tiny_target(seed=3)
    ids = torch.tensor([[5, 9, 11, 4, 3]])
    before = model.generate(ids, max_new_tokens=8, do_sample=False)
    TargetRunner(model, LAYERS)
    padded = torch.tensor([[0, 0, 5, 9, 11, 4, 3]])
    mask = torch.tensor([[0, 0, 1, 1, 1, 1, 1]])
    after = model.generate(ids, max_new_tokens=8, do_sample=False)
    after_padded = model.generate(padded, attention_mask=mask, max_new_tokens=8, do_sample=False)
    assert torch.equal(before, after)
    assert torch.equal(after_padded[0, 2:], before[0])


def _greedy(engine, prompts, steps_log=None):
    for i, p in enumerate(prompts):
        engine.add_request(EngineRequest(f"r{i}", p, SamplingParams(max_tokens=12,
                                                                    temperature=0.0)))
    out = {f"r{i}": [] for i in range(len(prompts))}
    while engine.has_unfinished():
        emitted = engine.step()
        if steps_log is not None:
            steps_log.append(({o.request_id for o in emitted if o.new_token_ids},
                              [r.req.request_id for r in engine.prefilling]))
        for o in emitted:
            out[o.request_id] += o.new_token_ids
    return out


@pytest.mark.parametrize("with_drafter", [False, True])
def test_chunked_prefill_decodes_as_one_shot_prefill(model, with_drafter):
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(2, 96, (n,), generator=g).tolist() for n in (3, 40, 11)]
    drafter = tiny_drafter(model, layer_ids=(1, 3)) if with_drafter else None

    def engine(budget):
        return SpecEngine(TargetRunner(model, [1, 3]), drafter, [], EngineConfig(
            scheduler="fixed" if with_drafter else "none", sps_profile="off",
            max_prefill_tokens=budget))

    one_shot = _greedy(engine(4096), prompts)
    log: list = []
    chunked = _greedy(engine(8), prompts, log)
    assert chunked == one_shot
    # the 40-token prompt took several steps, and r0 (3 tokens) decoded during them
    prefill_steps = [emitted for emitted, prefilling in log if "r1" in prefilling]
    assert len(prefill_steps) >= 3
    assert sum("r0" in emitted for emitted in prefill_steps) >= 2


def test_the_kv_store_never_reallocates_during_decoding(model):
    """Admission reserves each request's whole length (prompt + max_tokens + a block): after the
    prefill steps, decoding steps never grow the pool."""
    drafter = tiny_drafter(model, layer_ids=(1, 3))
    runner = TargetRunner(model, [1, 3])
    engine = SpecEngine(runner, drafter, [], EngineConfig(scheduler="fixed", sps_profile="off"))
    g = torch.Generator().manual_seed(2)
    for i, (n, max_tokens) in enumerate([(5, 300), (30, 200), (3, 40)]):  # > 256 positions
        engine.add_request(EngineRequest(f"r{i}", torch.randint(2, 96, (n,), generator=g).tolist(),
                                         SamplingParams(max_tokens=max_tokens, temperature=1.0,
                                                        seed=i, ignore_eos=True)))
    engine.step()  # decodes nothing yet; prefills all three
    assert not engine.prefilling
    grown = runner._kv_pool().reallocations
    while engine.has_unfinished():
        engine.step()
    assert runner._kv_pool().reallocations == grown


def test_the_engine_preallocates_the_whole_pool_and_serves_within_it(model):
    """The pool is sized at construction (max_num_requests slots of max_model_len + a block, under
    the memory budget) and a full batch of maximal requests never grows it."""
    drafter = tiny_drafter(model, layer_ids=(1, 3))
    runner = TargetRunner(model, [1, 3])
    cfg = EngineConfig(scheduler="fixed", sps_profile="off", max_num_requests=3, max_model_len=120)
    engine = SpecEngine(runner, drafter, [], cfg)
    state = runner.kv_pool_state()
    assert state["slots"] == 3 and state["free_slots"] == 3
    assert state["capacity"] == 120 + engine.num_speculative_tokens + 1
    assert state["reallocations"] == 0
    g = torch.Generator().manual_seed(3)
    for i in range(5):  # more requests than slots: they wait, slots are reused
        engine.add_request(EngineRequest(f"r{i}", torch.randint(2, 96, (20,), generator=g).tolist(),
                                         SamplingParams(max_tokens=100, temperature=1.0, seed=i,
                                                        ignore_eos=True)))
    while engine.has_unfinished():
        engine.step()
    gc.collect()
    assert runner.kv_pool_state() == {**state, "free_slots": 3}

    # a budget smaller than the full length caps the positions per slot
    small = TargetRunner(model, [1, 3])
    per_position = small.preallocate(2, 10_000, 10**12)["bytes"] // (2 * 10_000)
    capped = TargetRunner(model, [1, 3]).preallocate(2, 10_000, per_position * 2 * 500)
    assert capped["capacity"] == 500 and capped["slots"] == 2


def test_a_small_kv_budget_shortens_the_model_length_instead_of_growing(model):
    """When max_num_requests slots of max_model_len do not fit engine.kv_cache_memory_gib, the
    slots hold fewer positions and the engine's model length shrinks to match: a longer request
    is refused (413) rather than growing the pool."""
    from serve.engine.errors import RequestError
    from serve.engine.kv_storage import SlotKVPool

    runner = TargetRunner(model, [1, 3])
    cfg = model.config
    per_position = SlotKVPool.bytes_per_position(cfg.num_hidden_layers, cfg.num_key_value_heads,
                                                 cfg.head_dim, runner.dtype)
    budget = 2 * 100 * per_position  # two slots of 100 positions
    engine = SpecEngine(runner, tiny_drafter(model, layer_ids=(1, 3)), [],
                        EngineConfig(scheduler="fixed", sps_profile="off", max_num_requests=2,
                                     max_model_len=1000, kv_cache_memory_gib=budget / 2**30))
    assert runner.kv_pool_state()["capacity"] == 100
    assert engine.max_model_len == 100 - engine.num_speculative_tokens - 1
    with pytest.raises(RequestError) as err:
        engine.add_request(EngineRequest("long", [5] * 50, SamplingParams(max_tokens=60)))
    assert err.value.status == 413 and "kv_cache_memory_gib" in str(err.value)
    fits = engine.max_model_len - 10
    engine.add_request(EngineRequest("ok", [5] * 10, SamplingParams(max_tokens=fits,
                                                                    ignore_eos=True)))
    while engine.has_unfinished():
        engine.step()
    assert runner.kv_pool_state()["reallocations"] == 0


def test_offline_generate_reuses_slots_of_finished_requests(model):
    """SpecEngine.generate keeps every finished request alive until it returns: the explicit
    release (not garbage collection) is what lets 5 requests run through 2 slots."""
    runner = TargetRunner(model, [1, 3])
    engine = SpecEngine(runner, tiny_drafter(model, layer_ids=(1, 3)), [],
                        EngineConfig(scheduler="fixed", sps_profile="off", max_num_requests=2,
                                     max_model_len=100))
    g = torch.Generator().manual_seed(4)
    done = engine.generate([EngineRequest(f"r{i}", torch.randint(2, 96, (8,), generator=g).tolist(),
                                          SamplingParams(max_tokens=20, ignore_eos=True))
                            for i in range(5)])
    assert len(done) == 5
    state = runner.kv_pool_state()
    assert state["slots"] == 2 and state["free_slots"] == 2 and state["reallocations"] == 0


def test_a_released_cache_cannot_write_into_its_old_slot(model):
    runner = TargetRunner(model, [1, 3])
    kv = TargetKV()
    runner.forward_batch([kv], [[3, 4, 5]], with_features=False, logits="none")
    kv.release()
    kv.release()  # idempotent
    with pytest.raises(ValueError, match="released"):
        runner.forward_batch([kv], [[6]], with_features=False, logits="none")


def test_a_budget_too_small_for_a_useful_model_length_is_refused(model):
    from serve.engine.kv_storage import SlotKVPool

    cfg = model.config
    per_position = SlotKVPool.bytes_per_position(cfg.num_hidden_layers, cfg.num_key_value_heads,
                                                 cfg.head_dim, torch.float32)
    with pytest.raises(ValueError, match="kv_cache_memory_gib"):
        SpecEngine(TargetRunner(model, [1, 3]), tiny_drafter(model, layer_ids=(1, 3)), [],
                   EngineConfig(scheduler="fixed", sps_profile="off", max_num_requests=4,
                                kv_cache_memory_gib=4 * 10 * per_position / 2**30))


def test_single_token_groups_gather_similar_lengths_and_keep_a_clean_range_in_place():
    from serve.engine.kv_pool import single_token_groups

    # four requests of one length filling slots 0..3: one product over the range, in place
    assert single_token_groups([0, 1, 2, 3], [100] * 4, [1] * 4) == [([0, 1, 2, 3], False)]
    # 64 requests, lengths 100..1,000, in slots among 128 others left free by finished ones:
    # gathered groups of similar lengths
    lengths = [100 + (j * 37) % 900 for j in range(64)]
    slots = [3 * ((j * 11) % 64) for j in range(64)]
    groups = single_token_groups(slots, lengths, [1] * 64)
    assert len(groups) > 1 and all(gathered for _, gathered in groups)
    assert sorted(j for grp, _ in groups for j in grp) == list(range(64))
    tops = [max(lengths[j] for j in grp) for grp, _ in groups]
    assert tops == sorted(tops)  # each group holds the next lengths
    assert single_token_groups([0, 1], [100, 100], [1, 3]) == []  # one single: nothing to batch


@pytest.mark.parametrize("mode", ["gathered", "in place"])
def test_grouped_single_token_attention_matches_a_plain_forward(model, mode, monkeypatch):
    """Single-token requests attended in gathered length groups (or one in-place range), beside a
    multi-token one and a freed slot, give each request the logits of a plain forward."""
    import serve.engine.kv_pool as kv_pool

    monkeypatch.setattr(kv_pool, "PER_REQUEST_COST", 1e9)  # batch every single-token request
    monkeypatch.setattr(kv_pool, "GROUP_COST", 0)
    monkeypatch.setattr(kv_pool, "GATHER_COST", 1e-9 if mode == "gathered" else 1e9)
    monkeypatch.setattr(kv_pool, "WIDTH_STEP", 1)  # groups of different widths
    runner = TargetRunner(model, LAYERS)
    runner.use_decode_kernel(False)
    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(2, 96, (n,), generator=g).tolist() for n in (6, 23, 2, 11, 8, 15)]
    kvs = [TargetKV() for _ in prompts]
    runner.forward_batch(kvs, prompts, with_features=False, logits="last")
    for kv, p in zip(kvs, prompts):
        kv.length = len(p)
    seqs = [list(p) for p in prompts]
    kvs[2].release()
    live = [5, 0, 3, 1, 4]
    for step in range(4):
        blocks = {j: torch.randint(2, 96, (2 if j == live[step] else 1,),
                                   generator=g).tolist() for j in live}
        outs = runner.forward_batch([kvs[j] for j in live], [blocks[j] for j in live],
                                    with_features=False)
        for j, o in zip(live, outs):
            n = len(blocks[j])
            torch.testing.assert_close(o.logits, _full(model, seqs[j] + blocks[j])[0][-n:],
                                       atol=1e-4, rtol=1e-4)
            o.keep(n)
            seqs[j] += blocks[j]


def test_a_sliding_group_moves_its_last_window_keys_back_when_a_pass_would_overflow():
    """SlotKVPool.prepare: a sliding layer's slot holds 2 x window - 1 + pass positions; a pass
    that would run past them first moves the last window - 1 committed keys of every layer of
    the group to the slot's start (the full layers untouched), and reports the lengths as
    stored. Each stored key here is its own position, so what moved is visible."""
    from serve.engine.kv_storage import SlotKVPool

    window, passes = 4, 2
    pool = SlotKVPool(3, 1, 1, torch.float32, torch.device("cpu"), slots=2, capacity=64,
                      windows={0: window, 2: window}, pass_tokens=passes)
    assert pool.group_positions(window) == 2 * window - 1 + passes == 9
    slot = pool.allocate()
    length = 0
    for count in (2, 2, 2, 1, 2, 2):  # the last pass (from 9) would end at 11 > 9
        stored = pool.prepare([slot], [length], [count])
        at = stored[window][0]
        for layer in range(3):
            held = stored[None][0] if pool.window_of[layer] is None else at
            for store in (pool.keys, pool.values):
                store[layer][slot, 0, held:held + count, 0] = torch.arange(length, length + count)
        length += count
    offset = pool.offsets[window][slot]
    assert offset == 9 - (window - 1)  # the last pass starts at 9: keys from 6 on kept
    for layer in (0, 2):
        kept = pool.keys[layer][slot, 0, :length - offset, 0]
        assert kept.tolist() == list(range(offset, length))
    assert pool.keys[1][slot, 0, :length, 0].tolist() == list(range(length))
    assert pool.reallocations == 0
    pool.release(slot)
    assert pool.allocate() == slot and pool.offsets[window][slot] == 0


def test_a_pass_longer_than_a_sliding_slot_grows_the_group_only():
    from serve.engine.kv_storage import SlotKVPool

    pool = SlotKVPool(2, 1, 1, torch.float32, torch.device("cpu"), slots=1, capacity=64,
                      windows={0: 4}, pass_tokens=2)
    slot = pool.allocate()
    stored = pool.prepare([slot], [0], [20])
    assert stored == {None: [0], 4: [0]}
    assert pool.group_positions(4) >= 20 and pool.capacity == 64 and pool.reallocations == 1


def test_a_pool_whose_layers_all_slide_holds_any_length_without_growing():
    """Mistral-style: every layer slides, so no full-length slot exists to grow."""
    from serve.engine.kv_storage import SlotKVPool

    pool = SlotKVPool(2, 1, 1, torch.float32, torch.device("cpu"), slots=1, capacity=16,
                      windows={0: 4, 1: 4}, pass_tokens=4)
    slot = pool.allocate()
    length = 0
    for _ in range(40):
        pool.prepare([slot], [length], [3])
        length += 3
    assert pool.reallocations == 0 and pool.nbytes == 2 * 2 * 4 * (2 * 4 - 1 + 4)
    pool.reserve_window_positions(8)  # a second engine with longer passes: grown up front
    assert pool.group_positions(4) == min(16, 2 * 4 - 1 + 8)
