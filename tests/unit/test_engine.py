"""SpecEngine with continuous batching (SPEC sections 5, 6, 8): greedy output identical to the
target alone for every request of a changing batch, sampled token statistics equal to target-only
sampling for every shipped scheduler (chi-square), exact stopping, budgets, aborts, admission
limits, and SPS profiling."""

from __future__ import annotations

from collections import deque

import numpy as np
import pytest
import torch

from serve.engine.config import EngineConfig
from serve.engine.draft_planner import DraftCostTable
from serve.engine.floor_plan import StepRest
from serve.engine.core import SpecEngine
from serve.engine.errors import RequestError
from serve.engine.profiling import batch_grid, load_or_profile, profile_sps
from serve.engine.requests import EngineRequest, SamplingParams
from serve.engine.scheduler import SPSTable
from serve.engine.target_runner import TargetRunner
from tests.tiny import tiny_drafter, tiny_target
from tests.unit.helpers import (greedy_reference, oracle_drafter, permuted_target,
                                randomize_heads, scripted_drafter)
from tests.unit.test_speculative_lossless import (_exact_first_tokens, _pooled_chisquare,  # noqa: F401
                                                  corrupted_table)  # a shared fixture

LAYERS = [1, 3]
# a synthetic SPS curve: flat, then falling (a verification batch of B tokens costs more)
SPS = SPSTable.from_measurements({1: 100.0, 8: 95.0, 16: 80.0, 64: 30.0, 256: 8.0})


@pytest.fixture(scope="module")
def varied_target():
    return permuted_target()


def _engine(target, drafter, scheduler="fixed", eos=(), **cfg):
    config = EngineConfig(scheduler=scheduler, sps_profile="off", **cfg)
    return SpecEngine(TargetRunner(target, LAYERS if drafter is None else
                                   drafter.config.target_layer_ids), drafter, list(eos), config,
                      sps=SPS)


def _run(engine, pending: dict[int, list[EngineRequest]]):
    """Step until done, adding pending[step] requests before that step; returns id -> tokens."""
    out: dict[str, list[int]] = {}
    reasons: dict[str, str] = {}
    step = 0
    while engine.has_unfinished() or any(k >= step for k in pending):
        for req in pending.get(step, []):
            engine.add_request(req)
            out[req.request_id] = []
        for o in engine.step():
            out[o.request_id] += o.new_token_ids
            if o.finished:
                reasons[o.request_id] = o.finish_reason
        step += 1
    return out, reasons


# ----------------------------------------------------------------------------- greedy, batched
@pytest.mark.parametrize("scheduler", ["fixed", "dspark", "static_threshold", "async", "none"])
def test_batched_greedy_equals_target_alone_while_requests_join_and_leave(
        varied_target, corrupted_table, scheduler):
    d = randomize_heads(oracle_drafter(varied_target, corrupted_table, "markov", 4))
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 96, (n,), generator=g).tolist() for n in (3, 9, 1, 14, 6, 5)]
    budgets = [25, 7, 18, 30, 2, 12]
    reqs = [EngineRequest(f"r{i}", p, SamplingParams(max_tokens=m, temperature=0.0))
            for i, (p, m) in enumerate(zip(prompts, budgets))]
    engine = _engine(varied_target, d, scheduler, threshold=0.3)
    out, reasons = _run(engine, {0: reqs[:3], 2: reqs[3:5], 5: reqs[5:]})
    for i, (p, m) in enumerate(zip(prompts, budgets)):
        assert out[f"r{i}"] == greedy_reference(varied_target, p, m), f"request {i}"
        assert reasons[f"r{i}"] == "length"
    assert not engine.running and not engine.waiting  # finished requests leave the batch
    if scheduler != "none":
        assert engine.stats.accepted_tokens > 0 and engine.stats.verified_tokens > \
            engine.stats.accepted_tokens  # blocks both accepted and rejected


def test_eos_inside_an_accepted_block_ends_the_output_there(varied_target):
    prompt = [5, 17, 33]
    ref = greedy_reference(varied_target, prompt, 40)
    eos = ref[9]  # the 10th token: inside a block of the scripted (always accepted) drafter
    first = ref.index(eos)
    d = scripted_drafter(tiny_drafter(varied_target, block_size=4), prompt, ref)
    engine = _engine(varied_target, d, "fixed", eos=[eos])
    out, reasons = _run(engine, {0: [EngineRequest("a", prompt, SamplingParams(40, 0.0))]})
    assert out["a"] == ref[:first + 1] and reasons["a"] == "stop"
    # usage counts emitted tokens only: the prefill token plus what the rounds committed
    assert 1 + engine.stats.committed_tokens == first + 1


@pytest.mark.parametrize("budget", [1, 4, 5, 9, 13])
def test_output_never_exceeds_max_tokens_even_when_a_whole_block_is_accepted(varied_target,
                                                                             budget):
    prompt = [2, 4, 6]
    ref = greedy_reference(varied_target, prompt, 40)
    d = scripted_drafter(tiny_drafter(varied_target, block_size=4), prompt, ref)
    engine = _engine(varied_target, d, "fixed")
    out, reasons = _run(engine, {0: [EngineRequest("a", prompt, SamplingParams(budget, 0.0))]})
    assert out["a"] == ref[:budget] and reasons["a"] == "length"


def test_abort_frees_the_request_and_others_go_on(varied_target, corrupted_table):
    d = oracle_drafter(varied_target, corrupted_table, "markov", 4)
    engine = _engine(varied_target, d, "fixed")
    engine.add_request(EngineRequest("a", [1, 2, 3], SamplingParams(50, 0.0)))
    engine.add_request(EngineRequest("b", [4, 5], SamplingParams(20, 0.0)))
    engine.step()
    engine.step()
    assert engine.abort("a") and not engine.abort("a")
    tokens = []
    while engine.has_unfinished():
        tokens += [t for o in engine.step() if o.request_id == "b" for t in o.new_token_ids]
    assert [r.req.request_id for r in engine.running] == []
    ref = greedy_reference(varied_target, [4, 5], 20)
    assert ref[len(ref) - len(tokens):] == tokens  # b's remaining output continued correctly


def test_admission_errors_name_the_problem(varied_target):
    engine = _engine(varied_target, None, "none", max_num_requests=1, max_waiting=1,
                     max_model_len=64)
    with pytest.raises(RequestError, match="prompt is empty"):
        engine.add_request(EngineRequest("x", [], SamplingParams(4)))
    with pytest.raises(RequestError, match="exceeds the model length") as err:
        engine.add_request(EngineRequest("x", [1] * 60, SamplingParams(8)))
    assert err.value.status == 413
    with pytest.raises(RequestError, match="temperature"):
        engine.add_request(EngineRequest("x", [1], SamplingParams(4, temperature=-1)))
    with pytest.raises(RequestError, match="stop strings need"):
        engine.add_request(EngineRequest("x", [1], SamplingParams(4, stop=("a",))))
    engine.add_request(EngineRequest("a", [1], SamplingParams(4)))
    engine.add_request(EngineRequest("b", [1], SamplingParams(4)))  # fills the one waiting slot
    with pytest.raises(RequestError, match="capacity") as err:
        engine.add_request(EngineRequest("c", [1], SamplingParams(4)))
    assert err.value.status == 429


def test_confidence_schedulers_need_a_confidence_head_and_sps(varied_target):
    dflash = tiny_drafter(varied_target, drafter_type="dflash")
    with pytest.raises(ValueError, match="confidence head"):
        _engine(varied_target, dflash, "dspark")
    d = tiny_drafter(varied_target)
    with pytest.raises(ValueError, match="SPS"):
        SpecEngine(TargetRunner(varied_target, LAYERS), d, [], EngineConfig(scheduler="dspark"))


# ----------------------------------------------------------------------------- sampling
@pytest.fixture(scope="module")
def sampling_pair():
    target = tiny_target(vocab_size=12, num_layers=2, seed=0)
    with torch.no_grad():
        target.model.embed_tokens.weight.mul_(0.5)
    d = randomize_heads(tiny_drafter(target, layer_ids=(0, 1), block_size=4), seed=1, scale=1.0)
    with torch.no_grad():  # confidences that vary strongly with the drafted prefix
        d.confidence.proj.weight.mul_(4.0)
    return target, d


@pytest.mark.parametrize("scheduler,seeded_sampling", [
    ("dspark", "load_invariant"), ("async", "load_invariant"),
    ("static_threshold", "load_invariant"), ("fixed", "load_invariant"),
    ("none", "load_invariant"), ("dspark", "rejection"), ("fixed", "rejection")])
def test_sampled_tokens_follow_the_target_distribution_for_every_scheduler(sampling_pair,
                                                                          scheduler,
                                                                          seeded_sampling):
    """Many requests with different seeds decode together; the joint law of their first three
    tokens must be the target's exact one (lossless whatever the scheduler decides), with seeded
    requests sampled load-invariantly (the default) or by rejection sampling."""
    target, d = sampling_pair
    v = target.config.vocab_size
    prompt = [3, 7, 2, 9, 5]
    exact = _exact_first_tokens(target, prompt)
    engine = _engine(target, d, scheduler, threshold=0.4, max_num_requests=48, max_waiting=2000,
                     seeded_sampling=seeded_sampling)
    n = 1500
    reqs = [EngineRequest(f"s{i}", prompt, SamplingParams(4, temperature=1.0, seed=i))
            for i in range(n)]
    out, _ = _run(engine, {0: reqs})
    counts = np.zeros((v, v, v))
    for toks in out.values():
        counts[tuple(toks[:3])] += 1
    p12 = _pooled_chisquare(counts.sum(2), exact.sum(2))
    p123 = _pooled_chisquare(counts, exact)
    assert p12 > 1e-3 and p123 > 1e-3, (scheduler, p12, p123)
    if scheduler != "none":
        assert engine.stats.verified_tokens > 0
    if scheduler in ("dspark", "static_threshold"):
        # the policy really varied the verification length with the confidences
        assert 0 < engine.stats.verified_tokens < 2 * engine.stats.rounds


def test_requests_in_one_batch_do_not_influence_each_other(sampling_pair):
    """A request's sampled output depends only on its own seed, not on who shares the batch."""
    target, d = sampling_pair
    crowd = [EngineRequest(f"o{i}", [4, i % 12, 6], SamplingParams(9, 0.7, 0.9, seed=i))
             for i in range(6)]
    together, _ = _run(_engine(target, d, "fixed", max_num_requests=8),
                       {0: crowd[:3] + [EngineRequest("x", [1, 2, 3], SamplingParams(12, 1.0, seed=7))],
                        1: crowd[3:]})
    alone, _ = _run(_engine(target, d, "fixed"),
                    {0: [EngineRequest("x", [1, 2, 3], SamplingParams(12, 1.0, seed=7))]})
    assert together["x"] == alone["x"] and len(alone["x"]) == 12


# ----------------------------------------------------------------------------- SPS profiling
def test_sps_profile_is_measured_stored_and_reused(varied_target, tmp_path):
    runner = TargetRunner(varied_target, LAYERS)
    assert batch_grid(20) == [1, 2, 3, 4, 5, 6, 7, 8, 12, 18, 20]
    measured = profile_sps(runner, 12, block_tokens=4, context_len=16, repeats=1)
    assert set(measured) == set(batch_grid(12)) and all(v > 0 for v in measured.values())
    table = load_or_profile(runner, tmp_path, 12, block_tokens=4, repeats=1)
    assert table.max_tokens == 12 and (tmp_path / "sps_profile.json").is_file()
    stored = (tmp_path / "sps_profile.json").read_text()
    again = load_or_profile(runner, tmp_path, 12, block_tokens=4, repeats=1)
    assert again == table and (tmp_path / "sps_profile.json").read_text() == stored


def test_a_profile_from_another_cpu_class_is_measured_again(varied_target, tmp_path):
    """One CPU model name ("AMD EPYC") covers AVX2-only and AVX-512-BF16 generations: a stored
    profile whose instruction set differs is never reused, even with every other field equal."""
    import json

    runner = TargetRunner(varied_target, LAYERS)
    load_or_profile(runner, tmp_path, 6, block_tokens=4, repeats=1)
    path = tmp_path / "sps_profile.json"
    stored = json.loads(path.read_text())
    assert stored["fingerprint"]["capability"] == torch.backends.cpu.get_cpu_capability()
    other = "AVX2" if stored["fingerprint"]["capability"] != "AVX2" else "AVX512"
    stored["fingerprint"]["capability"] = other
    stored["measured_at"] = "copied from another machine"
    path.write_text(json.dumps(stored))
    load_or_profile(runner, tmp_path, 6, block_tokens=4, repeats=1)
    again = json.loads(path.read_text())
    assert again["fingerprint"]["capability"] != other
    assert again["measured_at"] != "copied from another machine"


# a drafter costing half a verification step at every batch and depth (seconds)
HALF_STEP = DraftCostTable((1,), ((0.005, 0.005),), ((0.005, 0.005),), 4)


# a jagged CPU profile (fp32 on AVX2, shape measured): passes of 2 to 4 tokens are slower than
# passes of 5 to 8, so Algorithm 1 on the measured curve stops before drafting at all
JAGGED_SPS = SPSTable((100.0, 40.0, 40.0, 40.0, 90.0, 88.0, 86.0, 84.0) + tuple(
    80.0 - 2.0 * i for i in range(24)))


@pytest.mark.parametrize("fill", [True, False])
def test_filled_passes_on_a_jagged_profile_stay_lossless_and_verify_more(
        varied_target, corrupted_table, fill):
    """engine.fill_passes: planning on the profile's upper envelope drafts and verifies where the
    measured curve's dip would stop Algorithm 1 (with it off the engine decodes target-only),
    and the output is still the target's greedy output for requests joining and leaving."""
    d = oracle_drafter(varied_target, corrupted_table, "markov", 4)
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 96, (n,), generator=g).tolist() for n in (4, 11, 2)]
    budgets = [24, 9, 17]
    reqs = [EngineRequest(f"r{i}", p, SamplingParams(max_tokens=m, temperature=0.0))
            for i, (p, m) in enumerate(zip(prompts, budgets))]
    engine = SpecEngine(TargetRunner(varied_target, d.config.target_layer_ids), d, [],
                        EngineConfig(scheduler="dspark", sps_profile="off", fill_passes=fill,
                                     draft_planning="off"), sps=JAGGED_SPS)
    # one request at a time: a batch of 3 starts past the dip, where both arms draft
    out, _ = _run(engine, {0: reqs[:1], 40: reqs[1:2], 80: reqs[2:]})
    for i, (p, m) in enumerate(zip(prompts, budgets)):
        assert out[f"r{i}"] == greedy_reference(varied_target, p, m), f"request {i}"
    if fill:
        assert engine.stats.verified_tokens > 0 and engine.stats.accepted_tokens > 0
    else:
        assert engine.stats.verified_tokens == 0


def _one_row_plan(confidences: list[float]):
    from serve.engine.step_plan import PlanRow, StepPlan
    row = PlanRow(request=None, cap=len(confidences), source="model",
                  num_draft_tokens=len(confidences), tokens=[1] * len(confidences),
                  confidences=list(confidences))
    return StepPlan([row])


def test_fill_passes_config_envelopes_and_schedule():
    """The planner fills passes only for the goodput schedulers with the option on; the table it
    schedules on is the measured one's envelope up to the pass the proposals allow; the fill
    really runs in ``schedule`` (not on a pass carrying prompt chunks); a rescaled profile
    drops the envelopes made from the old one."""
    from serve.engine.draft_planner import DraftCostTable
    from serve.engine.step_plan import StepPlanner
    on = StepPlanner(EngineConfig(scheduler="dspark"), "dspark", 7, 4096, JAGGED_SPS, None, True)
    assert on.fills and on.sps == JAGGED_SPS
    assert on.envelope(8)[0] == JAGGED_SPS.padded(8) and on.envelope(500)[0].max_tokens == 32
    off = StepPlanner(EngineConfig(scheduler="dspark", fill_passes=False), "dspark", 7, 4096,
                      JAGGED_SPS, None, True)
    assert not off.fills and off.envelope(8)[0] is JAGGED_SPS
    fixed = StepPlanner(EngineConfig(scheduler="fixed"), "fixed", 7, 4096, None, None, False)
    assert not fixed.fills
    capped = StepPlanner(EngineConfig(scheduler="dspark", max_batch_tokens=6), "dspark", 7, 4096,
                         JAGGED_SPS, None, True)
    assert capped.envelope(32)[0].max_tokens == 6

    # c = (0.9, 0, ...): Algorithm 1 verifies x_1 (B = 2, SPS 40); the fill takes the pass to
    # the measured 90 at B = 5 by verifying three more (a = 0: lossless, only unlikely to pay)
    plan = _one_row_plan([0.9] + [0.0] * 6)
    on.schedule(plan, [None])
    assert plan.rows[0].length == 4
    off.schedule(plan, [None])
    assert plan.rows[0].length == 0  # measured curve: 1.9 * 40 < 100
    on.schedule(plan, [None], riding=3)  # prompt tokens in the pass: no fill
    assert plan.rows[0].length <= 1
    # three drafts reach a pass of 4 tokens at most, all in the dip: nothing is verified (the
    # envelope of the whole table would have promised 90 and verified into the dip)
    short = _one_row_plan([0.9, 0.9, 0.9])
    on.schedule(short, [None])
    assert short.rows[0].length == 0

    on.draft_cost = DraftCostTable((1,), ((0.001, 0.002),), ((0.001, 0.002),), 7)
    on.checks_costs = True
    for _ in range(200):  # every pass measured 3x slower than profiled
        if on.check_costs(plan, 0.0, 5, 3.0 / JAGGED_SPS.sps(5)) == ["sps"]:
            break
    assert on.sps != JAGGED_SPS and on.envelope(8)[0] == on.sps.padded(8)


def test_a_pass_carrying_prompt_chunks_is_planned_without_fill():
    """The planner drafts for a fill only where ``schedule`` will fill: a pass with prompt
    chunks riding in it is not filled, so the plan for it is the unfilled one. On this table
    (SPS 50 from 2 to 7 tokens, 95 at 8) a request drafts 7 only for the fill to 8 tokens."""
    from types import SimpleNamespace

    from serve.engine.draft_planner import DraftCostTable, SPSTable
    from serve.engine.step_plan import StepPlanner
    table = SPSTable((100.0,) + (50.0,) * 6 + (95.0, 60.0))
    cost = DraftCostTable((1,), ((0.001, 0.002),), ((0.001, 0.002),), 7,
                          extend_s_per_position=0.001)
    planner = StepPlanner(EngineConfig(scheduler="dspark"), "dspark", 7, 4096, table, cost, True)
    request = SimpleNamespace(
        req=SimpleNamespace(params=SimpleNamespace(max_tokens=100, temperature=0.0)),
        output=[], pos=10, lookup=None, model_acc=SimpleNamespace(alpha=0.8),
        lookup_acc=SimpleNamespace(alpha=0.5), skipped=0, backoff=1000,
        pending=SimpleNamespace(tokens=[]))
    filled = planner.plan([request], 0.0)
    assert [(r.source, r.num_draft_tokens) for r in filled.rows] == [("model", 7)]
    riding = planner.plan([request], 0.0, riding=3)
    assert [(r.source, r.num_draft_tokens) for r in riding.rows] == [(None, 0)]


def _counting(drafter):
    """Count propose_block and context-extension calls (the drafter's work per step; the engine
    extends contexts through extend_context_batch)."""
    calls = {"propose": 0, "extend": 0}
    propose, extend = drafter.propose_block, drafter.extend_context_batch

    def counting_propose(*args, **kwargs):
        calls["propose"] += 1
        return propose(*args, **kwargs)

    def counting_extend(*args, **kwargs):
        calls["extend"] += 1
        return extend(*args, **kwargs)

    drafter.propose_block, drafter.extend_context_batch = counting_propose, counting_extend
    return calls


def test_planner_stops_drafting_a_request_whose_drafts_do_not_pay_and_probes_with_backoff(
        varied_target):
    """A drafter whose confidence is ~0 and whose cost is half a verification: after the first
    round the planner predicts that drafting lowers tokens/s, so the step runs target-only (no
    drafter call, not even a context extension); probes come after 4, then 8 skipped steps."""
    d = tiny_drafter(varied_target, block_size=4)
    with torch.no_grad():
        d.confidence.proj.bias.fill_(-20.0)  # c ~ 0: never worth verifying
    calls = _counting(d)
    prompt, budget = [3, 1, 4, 1, 5], 21
    engine = SpecEngine(TargetRunner(varied_target, LAYERS), d, [],
                        EngineConfig(scheduler="dspark", probe_interval=4, probe_budget=1.0),
                        sps=SPS, draft_cost=HALF_STEP)
    out, _ = _run(engine, {0: [EngineRequest("a", prompt, SamplingParams(budget, 0.0))]})
    assert out["a"] == greedy_reference(varied_target, prompt, budget)
    assert engine.stats.verified_tokens == 0
    # 20 rounds after the prefill: drafted at round 1, probes at rounds 6 and 15
    assert calls == {"propose": 3, "extend": 3}
    sources = [rec.source for rec in engine.running or []]
    assert sources == []


def test_probe_alpha_gates_probes_in_the_engine(varied_target):
    """engine.probe_alpha reaches the planner: with a drafter at half a verification's cost, a
    draft pays only if it is accepted often enough, so at probe_alpha 0.2 the engine drafts once
    (the first round) and never probes; at 1.0 it probes as before."""
    prompt, budget = [3, 1, 4, 1, 5], 21
    counts = {}
    for alpha in (0.2, 1.0):
        d = tiny_drafter(varied_target, block_size=4)
        with torch.no_grad():
            d.confidence.proj.bias.fill_(-20.0)
        calls = _counting(d)
        engine = SpecEngine(TargetRunner(varied_target, LAYERS), d, [],
                            EngineConfig(scheduler="dspark", probe_interval=4, probe_budget=1.0,
                                         probe_alpha=alpha), sps=SPS, draft_cost=HALF_STEP)
        out, _ = _run(engine, {0: [EngineRequest("a", prompt, SamplingParams(budget, 0.0))]})
        assert out["a"] == greedy_reference(varied_target, prompt, budget)
        counts[alpha] = calls["propose"]
    assert counts == {0.2: 1, 1.0: 3}


def test_a_draft_cost_profile_made_under_load_is_corrected_by_the_engines_own_steps(
        varied_target, tmp_path):
    """A draft-cost profile 10x the drafter's real cost (as if measured on a loaded machine)
    switches drafting off (not even a probe would pay at that cost); the engine's cost probes
    (one drafter call after max_probe_interval steps without one) time the drafter against the
    profile, the profile is rescaled, the stored file is marked to be profiled again at the next
    start, and the output stays the target's."""
    import json

    from serve.engine.profiling import (DRAFT_COST_NAME, mark_profile_stale,
                                        profile_draft_cost, profile_sps)
    from serve.engine.sps import SPSTable

    d = tiny_drafter(varied_target, block_size=4)
    runner = TargetRunner(varied_target, LAYERS)
    real = profile_draft_cost(d, 4, repeats=3)
    loaded = real.scaled(10.0)
    sps = SPSTable.from_measurements(profile_sps(runner, 20, block_tokens=5, repeats=3))
    engine = SpecEngine(runner, d, [], EngineConfig(scheduler="dspark", probe_interval=1,
                                                    max_probe_interval=8),
                        sps=sps, draft_cost=loaded)
    engine.planner.checks_costs = True  # as the builder sets it for measured profiles
    (tmp_path / DRAFT_COST_NAME).write_text(json.dumps({"table": loaded.to_dict()}))
    corrected = []
    engine.on_profile_correction = lambda name: (corrected.append(name),
                                                 mark_profile_stale(tmp_path, name))
    prompts = [[3, 1, 4, 1, 5], [2, 7, 1, 8], [1, 6, 1, 8, 0], [5, 7, 7, 2]]
    reqs = {0: [EngineRequest(f"r{i}", p, SamplingParams(96, 0.0))
                for i, p in enumerate(prompts)]}
    out, _ = _run(engine, reqs)
    for i, p in enumerate(prompts):
        assert out[f"r{i}"] == greedy_reference(varied_target, p, 96)
    assert "draft_cost" in corrected
    factor = engine.planner.draft_checker.corrections[0]
    assert factor < 0.5  # measured well below the profile's prediction
    assert engine.draft_cost.seconds(1, 4, False) < loaded.seconds(1, 4, False) / 2
    assert engine.draft_cost is engine.planner.draft_cost
    assert json.loads((tmp_path / DRAFT_COST_NAME).read_text())["stale"].startswith("contradicted")


def test_a_stale_profile_is_measured_again(varied_target, tmp_path):
    import json

    from serve.engine.profiling import PROFILE_NAME, load_or_profile, mark_profile_stale

    runner = TargetRunner(varied_target, LAYERS)
    load_or_profile(runner, tmp_path, 6, block_tokens=4, repeats=1)
    path = tmp_path / PROFILE_NAME
    mark_profile_stale(tmp_path, "sps")
    assert "stale" in json.loads(path.read_text())
    load_or_profile(runner, tmp_path, 6, block_tokens=4, repeats=1)
    assert "stale" not in json.loads(path.read_text())  # re-measured and stored afresh
    mark_profile_stale(tmp_path / "missing", "sps")  # nothing there: a warning, no error


def test_cost_check_corrects_only_beyond_its_tolerance():
    from serve.engine.cost_check import CostCheck
    from serve.engine.profiling import trimmed_mean

    check = CostCheck("test", window=6, tolerance=2.0)
    assert [check.observe(1.0, 1.9) for _ in range(8)] == [None] * 8  # within 2x: kept
    check = CostCheck("test", window=6, tolerance=2.0)
    assert check.observe(1.0, float("nan")) is None and check.observe(0.0, 1.0) is None
    check = CostCheck("test", window=6, tolerance=2.0)
    # slower than predicted: never during the warm-up (the first window of calls), however slow
    assert [check.observe(1.0, 9.0) for _ in range(6)] == [None] * 6
    verdicts = [check.observe(1.0, m) for m in (3.0, 3.5, 0.1, 2.5, 2.6, 3.0)]
    assert verdicts[:5] == [None] * 5  # mixed: not before the window is refilled
    assert verdicts[5] == pytest.approx(2.8)  # its median: one fast call does not decide
    assert len(check.ratios) == 0
    quick = [check.observe(1.0, m) for m in (0.1, 0.2, 0.1, 0.3)]  # 4 faster decide at once
    assert quick == [None] * 3 + [pytest.approx(0.15)]
    assert check.corrections == [verdicts[5], quick[3]]
    fresh = CostCheck("test", window=6, tolerance=2.0)
    assert [fresh.observe(1.0, 0.2) for _ in range(4)][-1] == pytest.approx(0.2)  # no warm-up
    with pytest.raises(ValueError):
        CostCheck("bad", tolerance=1.0)
    assert trimmed_mean([1.0, 100.0, 2.0]) == 2.0
    assert trimmed_mean([5.0, 1.0, 2.0, 3.0, 90.0]) == pytest.approx(10 / 3)
    assert trimmed_mean([4.0]) == 4.0
    with pytest.raises(ValueError):
        trimmed_mean([])


def _drafter_calls(drafter):
    """Record the rows of every drafter call (single-row and batched)."""
    rows: list[int] = []
    single, batch = drafter.propose_block, drafter.propose_block_batch

    def one(*args, **kwargs):
        rows.append(1)
        return single(*args, **kwargs)

    def many(states, *args, **kwargs):
        rows.append(len(states))
        return batch(states, *args, **kwargs)

    drafter.propose_block, drafter.propose_block_batch = one, many
    return rows


def test_probe_budget_defers_due_probes_and_drafts_them_together(varied_target):
    """Requests whose drafts never pay, joining one step apart so their probe back-offs are out of
    phase: without a binding budget every due probe costs a drafter call of its own; under a
    10 % budget the due probes wait and share calls, the drafter time the probes are predicted
    to add stays within the budget, and the output is still the target's."""
    prompts = [[3, 1, 4, 1, 5], [2, 7, 1, 8], [1, 6, 1, 8, 0], [5, 7, 7, 2]]
    refs = [greedy_reference(varied_target, p, 40) for p in prompts]
    calls = {}
    for budget in (1.0, 0.1):
        d = tiny_drafter(varied_target, block_size=4)
        with torch.no_grad():
            d.confidence.proj.bias.fill_(-20.0)  # c ~ 0: never worth verifying
        rows = calls[budget] = _drafter_calls(d)
        engine = SpecEngine(TargetRunner(varied_target, LAYERS), d, [],
                            # probe_alpha 1: probes pass the could-it-pay gate (a drafter
                            # at half a verification's cost pays only for perfect drafts),
                            # so the budget alone decides here
                            EngineConfig(scheduler="dspark", probe_interval=2,
                                         max_probe_interval=4, probe_budget=budget,
                                         probe_alpha=1.0),
                            sps=SPS, draft_cost=HALF_STEP)
        out, _ = _run(engine, {i: [EngineRequest(f"r{i}", p, SamplingParams(40, 0.0))]
                               for i, p in enumerate(prompts)})
        assert [out[f"r{i}"] for i in range(4)] == refs
        steps = engine.stats.steps
        if budget == 0.1:  # every call after the first rounds is a probe call of 5 ms
            assert (len(rows) - 4) * 0.005 <= budget * steps / SPS.sps(1) + 0.005
    # measured: 18 calls of 1.6 rows on average without a binding budget, 10 of 3.2 under it
    assert len(calls[0.1]) <= 0.6 * len(calls[1.0])
    assert sum(calls[0.1]) / len(calls[0.1]) >= 1.5 * sum(calls[1.0]) / len(calls[1.0])


def test_planner_keeps_drafting_a_drafter_that_pays(varied_target):
    """A drafter whose blocks are always accepted is drafted for every round even at half a
    verification's cost (planning changes nothing when drafting pays)."""
    prompt = [2, 5, 7]
    ref = greedy_reference(varied_target, prompt, 30)
    d = scripted_drafter(tiny_drafter(varied_target, block_size=4), prompt, ref)
    with torch.no_grad():
        d.confidence.proj.bias.fill_(20.0)  # c ~ 1
    calls = _counting(d)
    engine = SpecEngine(TargetRunner(varied_target, d.config.target_layer_ids), d, [],
                        EngineConfig(scheduler="dspark"), sps=SPS, draft_cost=HALF_STEP)
    done = engine.generate([EngineRequest("a", prompt, SamplingParams(30, 0.0))])[0]
    assert done.tokens == ref
    assert all(rec.source == "model" for rec in done.rounds[:-1])
    assert calls["propose"] >= len(done.rounds) - 1


def test_planner_trusts_realized_acceptance_over_an_optimistic_confidence_head(varied_target):
    """Confidence ~1 but drafts that are (almost) always rejected: the rounds are verified, so the
    planner learns the realized acceptance and stops paying for the drafter (probes aside)."""
    d = tiny_drafter(varied_target, block_size=4)  # random: its drafts are almost never right
    with torch.no_grad():
        d.confidence.proj.bias.fill_(20.0)  # ... but it is sure they are
    calls = _counting(d)
    engine = SpecEngine(TargetRunner(varied_target, LAYERS), d, [],
                        EngineConfig(scheduler="dspark"), sps=SPS, draft_cost=HALF_STEP)
    prompt = [9, 2, 6]
    done = engine.generate([EngineRequest("a", prompt, SamplingParams(40, 0.0))])[0]
    assert done.tokens == greedy_reference(varied_target, prompt, 40)
    assert engine.stats.accepted_tokens <= engine.stats.verified_tokens // 4
    assert calls["propose"] <= 10 < len(done.rounds)


def test_a_request_admitted_later_starts_from_the_drafters_realized_acceptance(varied_target):
    """Drafts that are verified and (almost) always rejected: a request admitted after another has
    finished starts from the engine-wide realized acceptance, not from 1/2, so it is not drafted
    for on its first steps; a greedy request's prior is not a sampled one's."""
    d = tiny_drafter(varied_target, block_size=4)  # random drafts ...
    with torch.no_grad():
        d.confidence.proj.bias.fill_(20.0)  # ... that it is sure of: they get verified
    engine = SpecEngine(TargetRunner(varied_target, LAYERS), d, [],
                        EngineConfig(scheduler="dspark"), sps=SPS, draft_cost=HALF_STEP)
    first = engine.generate([EngineRequest("a", [9, 2, 6], SamplingParams(40, 0.0))])[0]
    assert first.rounds[0].source == "model"  # the neutral prior: drafted at once
    calls = _counting(d)
    later = engine.generate([EngineRequest("b", [4, 4, 1], SamplingParams(6, 0.0))])[0]
    assert later.tokens == greedy_reference(varied_target, [4, 4, 1], 6)
    assert all(rec.source is None for rec in later.rounds) and calls["propose"] == 0
    assert engine.planner.drafter_prior[True].alpha == pytest.approx(0.5)
    assert engine.planner.drafter_prior[False].alpha < 0.25  # 0 of ~3 realized trials on a 1/2 prior


@pytest.mark.parametrize("scheduler", ["dspark", "async"])
def test_prompt_lookup_drafts_are_greedy_lossless_and_used(varied_target, scheduler):
    """A prompt that repeats itself: the lookup source is chosen (it costs nothing and matches),
    and the output still equals the target alone."""
    prompt = [7, 3, 9, 1, 4] * 4
    ref = greedy_reference(varied_target, prompt, 30)
    d = tiny_drafter(varied_target, block_size=4)
    with torch.no_grad():
        d.confidence.proj.bias.fill_(-20.0)
    engine = SpecEngine(TargetRunner(varied_target, LAYERS), d, [],
                        EngineConfig(scheduler=scheduler, prompt_lookup_max_ngram=3,
                                     prompt_lookup_min_ngram=1), sps=SPS, draft_cost=HALF_STEP)
    done = engine.generate([EngineRequest("a", prompt, SamplingParams(30, 0.0))])[0]
    assert done.tokens == ref
    assert any(rec.source == "lookup" and rec.verified for rec in done.rounds)


def test_sampled_tokens_stay_lossless_with_prompt_lookup(sampling_pair):
    """Lookup drafts are deterministic (one-hot draft distribution): the joint law of the first
    three tokens is still the target's (chi-square), with lookup rounds verified (a small batch:
    SPS(B) is flat there, so Algorithm 1 verifies what the lookup proposes)."""
    target, d = sampling_pair
    v = target.config.vocab_size
    prompt = [3, 7, 2, 9, 5, 0, 1, 4, 6, 8, 10, 11, 3, 7, 2]
    exact = _exact_first_tokens(target, prompt)
    engine = SpecEngine(TargetRunner(target, d.config.target_layer_ids), d, [],
                        EngineConfig(scheduler="dspark", max_num_requests=6, max_waiting=2000,
                                     prompt_lookup_max_ngram=2, prompt_lookup_min_ngram=1),
                        sps=SPS, draft_cost=HALF_STEP)
    n = 1500
    reqs = [EngineRequest(f"s{i}", prompt, SamplingParams(4, temperature=1.0, seed=i))
            for i in range(n)]
    states = []
    for req in reqs:
        engine.add_request(req)
        states.append(engine.waiting[-1])
    while engine.has_unfinished():
        engine.step()
    counts = np.zeros((v, v, v))
    for st in states:
        counts[tuple(st.output[:3])] += 1
    p12 = _pooled_chisquare(counts.sum(2), exact.sum(2))
    p123 = _pooled_chisquare(counts, exact)
    assert p12 > 1e-3 and p123 > 1e-3, (p12, p123)
    lookup_verified = sum(rec.verified for st in states for rec in st.rounds
                          if rec.source == "lookup")
    assert lookup_verified > 100


def test_tiny_temperature_is_greedy_and_never_nan(varied_target):
    """temperature 1e-38 passes validation as greedy (below GREEDY_TEMPERATURE_EPS) instead of
    dividing logits into NaN; infinite and NaN temperatures are refused with the field named."""
    import math

    runner = TargetRunner(varied_target, [])
    engine = SpecEngine(runner, None, [], EngineConfig(scheduler="none"))
    greedy = engine.generate([EngineRequest("g", [5, 6, 7], SamplingParams(8, temperature=0.0))])
    tiny = engine.generate([EngineRequest("t", [5, 6, 7], SamplingParams(8, temperature=1e-38))])
    assert tiny[0].tokens == greedy[0].tokens
    for bad in (math.inf, math.nan):
        with pytest.raises(RequestError, match="temperature"):
            engine.add_request(EngineRequest("x", [1], SamplingParams(4, temperature=bad)))


# ----------------------------------------------------------------------------- failure isolation
BROKEN_PROMPTS = {"a": [3, 1, 4], "bad": [1, 5, 9], "c": [2, 6, 5]}


def _run_with_one_broken(target, engine, tokens: int, break_it) -> dict:
    """Run BROKEN_PROMPTS greedily; after the prefill step ``break_it(request state)`` breaks
    request "bad". Checks that only "bad" fails and that the others finish with the target's
    exact greedy output; returns the final outputs by request id."""
    for rid, p in BROKEN_PROMPTS.items():
        engine.add_request(EngineRequest(rid, p, SamplingParams(tokens, 0.0)))
    outs = {rid: [] for rid in BROKEN_PROMPTS}
    final = {}
    for out in engine.step():  # prefill: everyone gets a first token
        outs[out.request_id] += out.new_token_ids
    break_it(next(r for r in engine.running if r.req.request_id == "bad"))
    while engine.has_unfinished():
        for out in engine.step():
            outs[out.request_id] += out.new_token_ids
            if out.finished:
                final[out.request_id] = out
    assert final["bad"].finish_reason == "error"
    for rid in ("a", "c"):
        assert outs[rid] == greedy_reference(target, BROKEN_PROMPTS[rid], tokens), rid
        assert final[rid].finish_reason == "length" and final[rid].error is None
    assert engine.stats.failed_requests == 1
    return final


@pytest.mark.parametrize("where", ["detokenize", "drafting"])
def test_one_request_failing_in_its_own_processing_never_harms_the_others(varied_target,
                                                                          corrupted_table, where):
    """A bug hit by one request (its detokenizer raises, or its drafter state is broken) ends that
    request with an error output (finish_reason "error", HTTP 500 RequestFailedError); the other
    requests of the same batch finish with the target's exact greedy output, and the engine keeps
    serving new requests."""
    from serve.engine.errors import RequestFailedError

    def break_it(bad):
        if where == "detokenize":
            def broken(tokens):
                raise UnicodeError("a detokenizer bug")
            bad.detok = type("Broken", (), {"add": staticmethod(broken)})()
        else:
            bad.draft_state = None  # its drafter context is gone: extending it raises

    d = oracle_drafter(varied_target, corrupted_table, "markov", 4)
    engine = _engine(varied_target, d, "fixed", max_num_requests=4)
    final = _run_with_one_broken(varied_target, engine, 12, break_it)
    assert isinstance(final["bad"].error, RequestFailedError) and final["bad"].error.status == 500
    later = engine.generate([EngineRequest("later", [7, 7, 2], SamplingParams(6, 0.0))])[0]
    assert later.tokens == greedy_reference(varied_target, [7, 7, 2], 6)


@pytest.mark.parametrize("kind", ["dspark", "eagle3"])
def test_a_request_failing_inside_the_batched_context_extension_fails_alone(varied_target, kind):
    """The middle one of three requests carries context features of the wrong width, so the
    drafter call that extends all three contexts raises inside the extension (DSpark's packed
    pass before touching any cache; the generic Eagle3 path after extending the first request).
    The engine retries row by row: only that request fails, the others finish with the target's
    exact greedy output (the first request's finished extension is kept, not redone)."""
    from tests.unit.test_eagle3 import _eagle3

    def break_it(bad):
        assert bad.pending.features  # the contexts are pending after the prefill
        bad.pending.features = [f[:, :-1] for f in bad.pending.features]  # a column short

    d = (_eagle3(varied_target) if kind == "eagle3"
         else tiny_drafter(varied_target, block_size=4))
    _run_with_one_broken(varied_target, _engine(varied_target, d, "fixed", max_num_requests=4),
                         10, break_it)


# ----------------------------------------------------------------------------- request fields
def test_min_tokens_ignore_eos_and_stop_token_ids_inside_accepted_blocks(varied_target,
                                                                         corrupted_table):
    """Greedy, with a drafter whose blocks are mostly accepted: EOS and stop token ids are masked
    out of the target's distribution until min_tokens (reference: a plain masked argmax loop),
    ignore_eos decodes through EOS, and a stop token id inside a block ends the output there."""
    d = oracle_drafter(varied_target, corrupted_table, "markov", 4)
    prompt = [5, 17, 33]
    ref = greedy_reference(varied_target, prompt, 30)
    eos = ref[1]  # the target's second greedy token

    def masked_reference(n, min_tokens, banned):
        ids, out = list(prompt), []
        for i in range(n):
            logits = varied_target(input_ids=torch.tensor([ids])).logits[0, -1]
            if i < min_tokens:
                logits[list(banned)] = float("-inf")
            tok = int(logits.argmax())
            out.append(tok)
            ids.append(tok)
            if tok in banned and i >= min_tokens:
                break
        return out

    for scheduler in ("fixed", "dspark"):
        engine = _engine(varied_target, d, scheduler, eos=[eos])
        plain, _ = _run(engine, {0: [EngineRequest("a", prompt, SamplingParams(30, 0.0))]})
        assert plain["a"] == ref[:2]  # EOS ends the output
        done = engine.generate([EngineRequest("m", prompt, SamplingParams(
            30, 0.0, min_tokens=6))])[0]
        expect = masked_reference(30, 6, {eos})
        assert done.tokens == expect and eos not in done.tokens[:6]
        through = engine.generate([EngineRequest("i", prompt, SamplingParams(
            30, 0.0, ignore_eos=True))])[0]
        assert through.tokens == ref and through.finish_reason == "length"
        # with ignore_eos, EOS ends nothing, so min_tokens does not ban it (vLLM)
        through_min = engine.generate([EngineRequest("im", prompt, SamplingParams(
            30, 0.0, ignore_eos=True, min_tokens=6))])[0]
        assert through_min.tokens == ref and eos in through_min.tokens[:6]
        stop_tok = ref[9]
        stopped = engine.generate([EngineRequest("s", prompt, SamplingParams(
            30, 0.0, ignore_eos=True, stop_token_ids=(stop_tok,)))])[0]
        assert stopped.tokens == ref[:ref.index(stop_tok) + 1] and stopped.finish_reason == "stop"


def test_top_k_min_p_and_min_tokens_keep_sampling_lossless(sampling_pair):
    """Speculative sampling with top_k, min_p and min_tokens (EOS and a stop token id masked for
    the first tokens): the joint law of the first three tokens is the warped, masked target's
    (exact enumeration, chi-square)."""
    import itertools

    from drafters.sampling import warped_probs

    target, d = sampling_pair
    v = target.config.vocab_size
    prompt = [3, 7, 2, 9, 5]
    eos, stop_id = 0, 1
    params = dict(temperature=1.0, top_k=6, min_p=0.05, min_tokens=2, stop_token_ids=(stop_id,))

    def probs(seqs, masked):
        logits = target(input_ids=torch.tensor(seqs)).logits[:, -1].float()
        if masked:
            logits[:, [eos, stop_id]] = float("-inf")
        n = logits.shape[0]
        return warped_probs(logits, torch.ones(n), torch.ones(n), torch.full((n,), 6),
                            torch.full((n,), 0.05)).double()

    with torch.no_grad():
        p1 = probs([prompt], True)[0]
        p2 = probs([prompt + [a] for a in range(v)], True)
        p3 = probs([prompt + [a, b] for a, b in itertools.product(range(v), repeat=2)],
                   False).view(v, v, v)
    exact = (p1[:, None, None] * p2[:, :, None] * p3).numpy()
    engine = SpecEngine(TargetRunner(target, d.config.target_layer_ids), d, [eos],
                        EngineConfig(scheduler="dspark", max_num_requests=6, max_waiting=2000),
                        sps=SPS)
    states = []
    for i in range(1500):
        engine.add_request(EngineRequest(f"s{i}", prompt, SamplingParams(4, seed=i, **params)))
        states.append(engine.waiting[-1])
    while engine.has_unfinished():
        engine.step()
    counts = np.zeros((v, v, v))
    for st in states:
        toks = st.output + [eos] * 3  # an output ended by EOS / the stop id at token 3
        counts[tuple(toks[:3])] += 1
    assert _pooled_chisquare(counts, exact) > 1e-3
    assert engine.stats.verified_tokens > 0


def test_stop_token_ids_outside_the_vocabulary_are_refused(varied_target):
    engine = _engine(varied_target, None, "none")
    with pytest.raises(RequestError, match="stop_token_ids"):
        engine.add_request(EngineRequest("x", [1], SamplingParams(4, stop_token_ids=(10**6,))))
    with pytest.raises(RequestError, match="min_tokens"):
        engine.add_request(EngineRequest("y", [1], SamplingParams(4, min_tokens=5)))


def test_logprobs_come_from_the_verification_pass_and_equal_target_only_ones(varied_target,
                                                                             corrupted_table):
    """fp32: the log probabilities (and top alternatives) the speculative engine returns for each
    emitted token equal those of target-only decoding, and equal log_softmax of a plain forward
    pass (no serve/ code) at that position; min_tokens-trimmed and stop-trimmed outputs carry
    exactly one entry per emitted token."""
    d = oracle_drafter(varied_target, corrupted_table, "markov", 4)
    prompt = [4, 8, 15, 16]
    params = SamplingParams(14, 0.0, logprobs=3)

    def collect(engine):
        engine.add_request(EngineRequest("a", prompt, params))
        tokens, lps = [], []
        while engine.has_unfinished():
            for out in engine.step():
                tokens += out.new_token_ids
                assert out.logprobs is not None and len(out.logprobs) == len(out.new_token_ids)
                lps += out.logprobs
        return tokens, lps

    spec_tokens, spec = collect(_engine(varied_target, d, "fixed"))
    alone_tokens, alone = collect(_engine(varied_target, None, "none"))
    assert spec_tokens == alone_tokens
    assert engine_rounds_verified_blocks(d, varied_target, prompt) > 0
    ids = list(prompt)
    for tok, s_lp, a_lp in zip(spec_tokens, spec, alone):
        with torch.no_grad():
            ref = torch.log_softmax(varied_target(input_ids=torch.tensor([ids])).logits[0, -1], -1)
        assert s_lp.token_id == tok and s_lp.logprob == pytest.approx(float(ref[tok]), abs=1e-4)
        assert s_lp.logprob == pytest.approx(a_lp.logprob, abs=1e-4)
        assert [t for t, _ in s_lp.top] == ref.topk(3).indices.tolist()
        ids.append(tok)


def engine_rounds_verified_blocks(drafter, target, prompt) -> int:
    """Draft tokens a fixed-gamma engine verified on ``prompt`` (the test above must exercise
    multi-token verification, not only one-token steps)."""
    engine = _engine(target, drafter, "fixed")
    engine.generate([EngineRequest("v", prompt, SamplingParams(14, 0.0))])
    return engine.stats.verified_tokens


def test_speed_floors_draft_for_requests_the_goodput_plan_leaves_target_only(varied_target,
                                                                             corrupted_table):
    """Issue 43.1: at this drafter's acceptance a drafter call costing a pass (10 ms) makes the
    goodput planner (which counts the pass and the drafter call) draft for nobody; with the rest
    of a step measured at 50 ms, requests whose floor target-only steps miss are drafted for
    while their drafts are predicted to raise their speed (serve.engine.floor_plan), and greedy
    output stays the target's. A floor already held changes nothing."""
    d = randomize_heads(oracle_drafter(varied_target, corrupted_table, "markov", 4))
    costly = DraftCostTable((1,), ((0.01, 0.01),), ((0.01, 0.01),), 4)
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, 96, (n,), generator=g).tolist() for n in (5, 8, 6)]

    def run(floor):
        engine = SpecEngine(TargetRunner(varied_target, d.config.target_layer_ids), d, [],
                            EngineConfig(scheduler="dspark", probe_interval=64), sps=SPS,
                            draft_cost=costly)
        engine.planner.rest = StepRest(samples=1, mean_s=0.05)  # as if measured: deterministic
        engine.planner.observe_rest = lambda *a: None
        reqs = [EngineRequest(f"r{i}", p, SamplingParams(max_tokens=24, temperature=0.0),
                              min_tokens_per_s=floor) for i, p in enumerate(prompts)]
        out, _ = _run(engine, {0: reqs})
        for i, p in enumerate(prompts):
            assert out[f"r{i}"] == greedy_reference(varied_target, p, 24), (floor, i)
        return engine.stats.verified_tokens

    plain, held, missed = run(None), run(1.0), run(50.0)
    assert held == plain  # 1 token / 60 ms is above 1 tokens/s: the goodput plan stays
    assert missed > plain + 20


def test_the_rest_of_a_step_is_read_between_consecutive_decoding_steps(varied_target):
    """What the speed floors add to the profiles (StepPlanner.rest): read from one decoding
    step's plan start to the next, never across a prefill-only step or a step that failed before
    its commit; the mean of the first samples, then slowly forgetting. A floor of 0 is refused."""
    d = tiny_drafter(varied_target, block_size=4)
    engine = SpecEngine(TargetRunner(varied_target, LAYERS), d, [],
                        EngineConfig(scheduler="dspark"), sps=SPS, draft_cost=HALF_STEP)
    with pytest.raises(RequestError, match="min_tokens_per_s"):
        engine.add_request(EngineRequest("z", [1, 2], SamplingParams(4, 0.0), min_tokens_per_s=0))
    engine.add_request(EngineRequest("a", [3, 1, 4, 1, 5], SamplingParams(12, 0.0)))
    engine.step()  # the prompt alone: no decoding cycle
    assert engine.planner.last_cycle is None and engine.planner.rest.samples == 0
    engine.step()
    assert engine.planner.last_cycle is not None and engine.planner.rest.samples == 0
    engine.step()
    assert engine.planner.rest.samples == 1 and engine.planner.rest.fixed_s >= 0.0
    engine.drafting.propose = lambda rows, noise: {i: RuntimeError("boom")
                                                   for i in range(len(rows))}
    engine.step()  # every row failed while drafting: no commit, nothing to read next
    assert engine.planner.last_cycle is None and engine.planner.rest.samples == 2
    planner = engine.planner
    planner.rest = StepRest()
    planner.observe_rest(0.1, 0.02, 0.03)
    planner.observe_rest(0.2, 0.0, 0.1)
    assert planner.rest.seconds(1) == pytest.approx(0.075)  # the mean of 0.05 and 0.1
    planner.observe_rest(0.0, 0.0, 0.1)  # a pass the profile overrates: no negative rest
    assert planner.rest.seconds(1) == pytest.approx(0.05)


def test_speed_floors_add_verification_losslessly_and_gate_admission(varied_target,
                                                                     corrupted_table):
    """With a per-user speed floor above what the throughput plan gives, requests verify more
    (serve.engine.plan_extensions.hold_speed_floors) and greedy output stays the target's; admission waits
    while the measured speed, rescaled to one more request, would break a floor."""
    from serve.engine.admission import Pace

    d = randomize_heads(oracle_drafter(varied_target, corrupted_table, "markov", 4))
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, 96, (n,), generator=g).tolist() for n in (4, 7, 3, 9)]

    def run(floor=None):
        engine = _engine(varied_target, d, "dspark")
        # the rest of a step stays 0: measured by the wall clock, on a slow machine (a Zen 1 at
        # 2 GHz) it swamped this injected profile and predicted every longer plan slower, so the
        # floored run verified less; its measurement has a test of its own (above)
        engine.planner.observe_rest = lambda *a: None
        # the requests' own floors: they order verification and leave admission alone, so both
        # runs decode the same batches
        reqs = [EngineRequest(f"r{i}", p, SamplingParams(max_tokens=20, temperature=0.0),
                              min_tokens_per_s=floor)
                for i, p in enumerate(prompts)]
        out, _ = _run(engine, {0: reqs})
        for i, p in enumerate(prompts):
            assert out[f"r{i}"] == greedy_reference(varied_target, p, 20), (floor, i)
        return engine.stats

    plain, floored = run(), run(floor=400.0)  # SPS(1) = 100 steps/s: out of reach
    assert floored.verified_tokens > plain.verified_tokens

    # admission: SPS(8) = 95, SPS(16) = 80 steps/s; 4 running requests verifying B = 8 tokens in
    # steps as long as the profiled pass (1/95 s, nothing else per request), 2 tokens per request
    # per step: 190 tokens/s each now; a fifth request makes B = 10 -> SPS 91.25, so
    # 2 x 91.25 = 182.5 tokens/s, against a floor of 158 plus FLOOR_MARGIN (15 %): 181.7
    engine = _engine(varied_target, d, "dspark", min_tokens_per_s=158.0, max_num_requests=8)
    for i, p in enumerate(prompts + [[1, 2, 3]]):
        engine.add_request(EngineRequest(f"a{i}", p, SamplingParams(max_tokens=30,
                                                                    temperature=0.0)))
    engine.waiting, queued = deque(list(engine.waiting)[:4]), list(engine.waiting)[4:]
    engine._pace = Pace(step_s=1e-6)  # measured as fast: all four start together
    engine.step()  # prefill the four
    assert len(engine.running) == 4
    engine.waiting.extend(queued)
    engine._pace = Pace(step_s=1 / 95, tokens_per_step=2.0, decode_tokens=8.0, requests=4.0)
    assert engine._floors_allow_one_more()
    engine._pace = Pace(step_s=1 / 95, tokens_per_step=1.99, decode_tokens=8.0, requests=4.0)
    assert not engine._floors_allow_one_more()  # 1.99 x 91.25 = 181.6 < 181.7
    queued[0].req.min_tokens_per_s = 1.0  # the newcomer's own floor is low, the others' are not
    assert not engine._floors_allow_one_more()
    engine.config = engine.config.model_copy(update={"min_tokens_per_s": None})
    assert engine._floors_allow_one_more()  # no deployment floor any more
    # a client's own floor orders verification but never gates admission (one unreachable floor
    # would keep everyone else waiting)
    engine.running[0].req.min_tokens_per_s = 1e9
    assert engine._floors_allow_one_more()


def test_the_admission_pace_counts_prompt_chunks_and_grows_past_the_sps_profile(varied_target):
    """The pace the speed floor is checked against is what running requests get: steps carrying
    a newcomer's prompt chunk count, with the chunk's tokens in the step's batch; a batch past the
    SPS(B) profile's largest B costs in proportion to its size (not the profile's last value)."""
    from serve.engine.admission import Pace
    from serve.engine.sps import SPSTable

    table = SPSTable((100.0, 90.0, 80.0, 50.0))
    assert table.pass_seconds(2) == pytest.approx(1 / 90)
    assert table.pass_seconds(8) == pytest.approx(2 / 50)  # twice the largest profiled batch
    # 4 decoding in 10 ms steps of B = 4, 1 token each: 100 tokens/s; a fifth makes B = 5, past
    # the profile: 5/4 of B = 4's step, 80 tokens/s (read at the profile's end: still 100),
    # against each floor plus FLOOR_MARGIN
    pace = Pace(step_s=0.01, tokens_per_step=1.0, decode_tokens=4.0, requests=4.0)
    assert pace.allows_one_more([90.0], 4, table) is False
    assert pace.allows_one_more([65.0], 4, table) is True  # 80 >= 65 + 15 %

    engine = _engine(varied_target, None, "none", max_num_requests=4)
    engine.add_request(EngineRequest("a", [1, 2, 3], SamplingParams(max_tokens=8,
                                                                     temperature=0.0)))
    engine.step()  # prefill only: nothing decoded, nothing observed
    assert engine._pace.step_s is None
    engine.add_request(EngineRequest("b", list(range(1, 40)), SamplingParams(
        max_tokens=8, temperature=0.0)))
    engine.step()  # "a" decodes one token while "b"'s 39-token prompt rides along
    assert engine._pace.step_s is not None and engine._pace.batch_tokens == 1 + 39
    assert (engine._pace.decode_tokens, engine._pace.chunk_tokens, engine._pace.requests) == (
        1, 39, 1)
    # a newcomer adds its share of the decoding tokens, not of the prompt chunks too: 4 requests
    # decoding 1 token each beside 4 chunk tokens a step (B = 8, SPS(B) = 102 - 2B = 86) in
    # steps as long as the profiled pass: 86 tokens/s each; with 6 admitted, a seventh makes
    # B = 1 x 7 + 4 = 11 (SPS 80): 80 tokens/s, which clears a floor of 67 + 15 % = 77.05
    # (counting the chunks as per-request tokens would make B = 14, SPS 74, and refuse)
    table = SPSTable(tuple(102.0 - 2 * b for b in range(1, 17)))
    pace = Pace(step_s=1 / 86, tokens_per_step=1.0, decode_tokens=4.0, chunk_tokens=4.0,
                requests=4.0)
    assert pace.allows_one_more([67.0], 6, table)
    assert not pace.allows_one_more([70.0], 6, table)  # 70 + 15 % = 80.5 > 80


def test_a_running_request_near_the_floor_holds_newcomers_back(varied_target, corrupted_table):
    """Admission under a deployment floor also reads the running requests' own speeds: while one
    that has emitted enough tokens to say runs within FLOOR_MARGIN of the floor, no newcomer
    starts (the pace is an average; the floor is for the slowest request)."""
    import time as clock

    from serve.engine.admission import FLOOR_MARGIN, MIN_OBSERVED_TOKENS, Pace, observed_speed

    assert observed_speed(MIN_OBSERVED_TOKENS - 1, 0.0, 1.0) is None
    assert observed_speed(11, 0.0, 2.0) == pytest.approx(5.0)
    d = randomize_heads(oracle_drafter(varied_target, corrupted_table, "markov", 4))
    engine = _engine(varied_target, d, "dspark", min_tokens_per_s=10.0, max_num_requests=4)
    engine.add_request(EngineRequest("a", [1, 2, 3], SamplingParams(max_tokens=40,
                                                                     temperature=0.0)))
    for _ in range(MIN_OBSERVED_TOKENS + 1):
        engine.step()
    engine._pace = Pace(step_s=0.001, tokens_per_step=1.0, decode_tokens=1.0)  # 1,000 tok/s
    (r,) = engine.running
    now = clock.perf_counter()
    r.first_token_s = now - (len(r.output) - 1) / (10.0 * (1 + FLOOR_MARGIN) + 1)  # just above
    assert engine._floors_allow_one_more()
    r.first_token_s = now - (len(r.output) - 1) / (10.0 * (1 + FLOOR_MARGIN) - 1)  # just below
    assert not engine._floors_allow_one_more()


def test_an_idle_engine_under_a_floor_admits_a_burst_only_as_far_as_the_floor_allows(
        varied_target, corrupted_table):
    """A burst of arrivals at an idle engine with a deployment floor: before any decoding step
    is measured one request starts at a time; with a pace measured earlier (and nothing decoding
    now), as many start as the pace rescaled to their batch holds, not the whole burst."""
    from serve.engine.admission import Pace
    from serve.engine.sps import SPSTable

    d = randomize_heads(oracle_drafter(varied_target, corrupted_table, "markov", 4))
    engine = _engine(varied_target, d, "dspark", min_tokens_per_s=20.0, max_num_requests=8)
    for i in range(6):
        engine.add_request(EngineRequest(f"b{i}", [1, 2, 3 + i], SamplingParams(
            max_tokens=4, temperature=0.0)))
    engine._admit()
    assert len(engine.prefilling) == 1 and len(engine.waiting) == 5  # nothing measured yet
    # measured before: 10 ms steps of one request's one token (100 tokens/s); past the SPS
    # profile (B <= 1) the step time grows with the batch, so k requests get 100 / k tokens/s
    # each, against the floor plus 15 %: 23 tokens/s
    engine.sps = SPSTable((100.0,))
    engine._pace = Pace(step_s=0.01, tokens_per_step=1.0, decode_tokens=1.0, requests=1.0)
    engine.waiting.extendleft(reversed(engine.prefilling))
    engine.prefilling.clear()
    engine._admit()
    # 100 / k >= 23 -> k <= 4: four start, two wait (without the fix: all six)
    assert len(engine.prefilling) == 4 and len(engine.waiting) == 2


def test_a_reachable_deployment_floor_serves_a_burst_together_and_stays_lossless(
        varied_target, corrupted_table):
    """A deployment floor the engine can hold: a burst starts one request at a time until a
    decoding step is measured, then the rest join (the floor never serializes the engine for
    good), greedy output stays the target's, and requests without a floor of their own are held
    to the deployment's (``_floor``)."""
    d = randomize_heads(oracle_drafter(varied_target, corrupted_table, "markov", 4))
    engine = _engine(varied_target, d, "dspark", min_tokens_per_s=1.0, max_num_requests=8)
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, 96, (n,), generator=g).tolist() for n in (5, 3, 8, 4, 6)]
    for i, p in enumerate(prompts):
        engine.add_request(EngineRequest(f"f{i}", p, SamplingParams(max_tokens=16,
                                                                    temperature=0.0)))
    assert engine._floor(engine.waiting[0]) == 1.0
    out, admitted = {}, []
    while engine.has_unfinished():
        for o in engine.step():
            out[o.request_id] = out.get(o.request_id, []) + o.new_token_ids
        admitted.append(engine.num_running)
    assert admitted[0] == 1  # nothing measured yet: one request
    assert max(admitted) == len(prompts)  # measured fast enough: all of them together
    for i, p in enumerate(prompts):
        assert out[f"f{i}"] == greedy_reference(varied_target, p, 16), i


def test_the_step_model_counts_per_request_work_and_sizes_prompt_chunks_by_the_floor(
        varied_target, corrupted_table):
    """Admission predicts a step as the profiled target pass plus the rest of the step in
    proportion to the requests (what the measured step took beyond the pass); under a floor, a
    step carries only the prompt tokens that keep the decoding requests above it (at least
    MIN_PREFILL_TOKENS), and the engine cuts its prompt chunks to that."""
    from serve.engine.admission import MIN_PREFILL_TOKENS, Pace
    from serve.engine.sps import SPSTable

    flat = SPSTable((100.0,) * 64)  # a 10 ms pass at any B
    # 4 requests, one token each, in 40 ms steps: 7.5 ms a request beyond the pass; 8 requests
    # -> 10 + 60 = 70 ms (the pass alone would say 40 ms: twice the speed)
    pace = Pace(step_s=0.04, tokens_per_step=1.0, decode_tokens=4.0, requests=4.0)
    assert pace.predict_step_s(8, 0, flat) == pytest.approx(0.07)
    assert pace.allows_one_more([12.0], 7, flat)  # 1 / 0.07 = 14.3 >= 13.8
    assert not pace.allows_one_more([12.5], 7, flat)  # 14.3 < 14.4

    growing = SPSTable(tuple(100.0 / (1 + b / 32) for b in range(1, 65)))
    pace = Pace(step_s=0.02, tokens_per_step=1.0, decode_tokens=4.0, requests=4.0)
    for floor in (20.0, 25.0):
        budget = pace.prefill_budget(floor, 4, 2048, growing)
        longest = 1.0 / (floor * 1.15)
        assert pace.predict_step_s(4, budget, growing) <= longest
        assert pace.predict_step_s(4, budget + 1, growing) > longest
        assert budget > MIN_PREFILL_TOKENS
    assert growing.pass_seconds(80) > growing.pass_seconds(64)  # past the profile: grows on
    assert pace.prefill_budget(45.0, 4, 2048, growing) == MIN_PREFILL_TOKENS  # out of reach
    assert pace.prefill_budget(20.0, 0, 2048, growing) == 2048  # nothing decoding to slow
    assert Pace().prefill_budget(20.0, 4, 2048, growing) == 2048  # nothing measured

    d = randomize_heads(oracle_drafter(varied_target, corrupted_table, "markov", 4))
    engine = _engine(varied_target, d, "dspark", min_tokens_per_s=20.0, max_num_requests=4)
    engine.add_request(EngineRequest("a", [1, 2, 3], SamplingParams(max_tokens=30,
                                                                     temperature=0.0)))
    engine.step()
    engine.sps = growing
    engine._pace = pace
    budget = pace.prefill_budget(20.0, 1, engine.config.max_prefill_tokens, growing)
    assert MIN_PREFILL_TOKENS < budget < 90
    engine._pace = Pace(step_s=1e-6)  # let the newcomer in ...
    engine.add_request(EngineRequest("b", list(range(1, 91)), SamplingParams(
        max_tokens=4, temperature=0.0)))
    engine._admit()
    engine._pace = pace  # ... and size its chunk by the slow pace
    assert engine._prefill_budget(1) == budget
    engine.step()
    (b,) = engine.prefilling
    assert b.prefilled == budget  # the rest of its prompt follows in the next steps


def test_the_step_model_falls_back_to_proportional_where_the_profile_cannot_explain_a_step():
    """A profile whose pass alone is as long as the measured step (``sps_profile: off``'s flat
    table of 1 step/s, or a profile from slower hardware) says nothing about how a step grows:
    the prediction is in proportion to B, as without a profile; the chunk budget likewise."""
    from serve.engine.admission import MIN_PREFILL_TOKENS, Pace
    from serve.engine.sps import SPSTable

    off = SPSTable((1.0,) * 512)
    pace = Pace(step_s=0.05, tokens_per_step=1.0, decode_tokens=4.0, requests=4.0)
    assert pace.predict_step_s(8, 0, off) == pytest.approx(0.10)
    assert pace.predict_step_s(8, 0, None) == pytest.approx(0.10)
    assert not pace.allows_one_more([12.0], 31, off)  # 32 requests: 0.4 s steps
    assert pace.allows_one_more([12.0], 4, off)  # 5: 62.5 ms, 16 >= 13.8
    for sps in (off, None):  # 4 decoding, floor 10: steps up to 1 / 11.5 s -> B <= 6.96
        assert pace.prefill_budget(10.0, 4, 2048, sps) == MIN_PREFILL_TOKENS
        assert pace.prefill_budget(1.0, 4, 2048, sps) == 65  # B <= 69.6: 65 chunk tokens
    assert pace.prefill_budget(10.0, 4, 8, off) == 8  # never above max_prefill_tokens
