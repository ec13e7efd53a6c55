"""Seeded requests are reproducible whatever the server is doing (issue 24): with a drafter
loaded, a seeded request samples each output position by the Gumbel-max trick with noise keyed by
(seed, position) (``drafters.sampling.PositionNoise``, ``serve.engine.rejection.verify_coupled``),
so its text does not depend on the drafting plan, the scheduler or the other requests; it stays a
sample of the target's distribution (the chi-square tests in ``test_engine.py`` run seeded
requests)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from scipy.stats import chisquare

from drafters.sampling import PositionNoise, gumbel_argmax
from serve.engine.rejection import verify_coupled
from serve.engine.requests import EngineRequest, SamplingParams
from tests.unit.helpers import oracle_drafter, permuted_target, randomize_heads
from tests.unit.test_engine import _engine, _run
from tests.unit.test_speculative_lossless import corrupted_table  # noqa: F401 - a fixture


@pytest.fixture(scope="module")
def varied_target():
    return permuted_target()


@pytest.fixture(scope="module")
def drafter(varied_target, corrupted_table):
    return randomize_heads(oracle_drafter(varied_target, corrupted_table, "markov", 4))


def _seeded(rid, seed, prompt=(5, 17, 3, 40), n=24):
    return EngineRequest(rid, list(prompt), SamplingParams(n, temperature=1.0, top_p=0.95,
                                                           seed=seed))


def _crowd():
    """Five other requests: seeded and unseeded, greedy and sampled, different lengths."""
    return [EngineRequest(f"o{i}", [i + 1, 2 * i + 3, 9], SamplingParams(
        m, temperature=t, seed=s)) for i, (m, t, s) in
        enumerate([(30, 1.0, None), (7, 0.0, None), (19, 0.8, 11), (26, 1.0, 3), (12, 1.2, None)])]


def test_a_seeded_request_gives_the_same_output_alone_under_load_and_under_any_scheduler(
        varied_target, drafter):
    outputs = {}
    for seed in (0, 1, 2):
        alone, _ = _run(_engine(varied_target, drafter, "dspark"), {0: [_seeded("x", seed)]})
        loaded_engine = _engine(varied_target, drafter, "dspark", prompt_lookup_max_ngram=2)
        crowd = _crowd()
        loaded, _ = _run(loaded_engine, {0: crowd[:3], 1: [_seeded("x", seed)], 3: crowd[3:]})
        fixed, _ = _run(_engine(varied_target, drafter, "fixed"), {0: [_seeded("x", seed)]})
        plain, _ = _run(_engine(varied_target, drafter, "none"), {0: [_seeded("x", seed)]})
        assert len(alone["x"]) == 24
        assert alone["x"] == loaded["x"] == fixed["x"] == plain["x"], seed
        assert loaded_engine.stats.accepted_tokens > 0  # drafts were accepted on the way
        outputs[seed] = alone["x"]
    assert len({tuple(v) for v in outputs.values()}) == 3  # the seed matters


def test_rejection_mode_depends_on_the_plan(varied_target, drafter):
    """The bug the default fixes: from one random stream, the output changes with the plan."""
    differs = []
    for seed in (0, 1, 2):
        runs = [_run(_engine(varied_target, drafter, s, seeded_sampling="rejection"),
                     {0: [_seeded("x", seed)]})[0]["x"] for s in ("fixed", "none")]
        differs.append(runs[0] != runs[1])
    assert any(differs)


def test_gumbel_argmax_draws_from_the_distribution():
    probs = torch.tensor([0.5, 0.0, 0.2, 0.25, 0.05])
    counts = np.zeros(5)
    for i in range(4000):
        counts[gumbel_argmax(probs, PositionNoise(i, 0, 5).gumbel(0))] += 1
    assert counts[1] == 0  # never a token of zero probability
    keep = probs.numpy() > 0
    assert chisquare(counts[keep], probs.numpy()[keep] * 4000).pvalue > 1e-3
    # the noise is a function of (seed, position) only
    a, b = PositionNoise(7, 3, 5), PositionNoise(7, 1, 5)
    assert torch.equal(a.gumbel(0), b.gumbel(2)) and not torch.equal(a.gumbel(0), a.gumbel(1))
    with pytest.raises(ValueError):
        gumbel_argmax(torch.zeros(5), a.gumbel(0))


def test_verify_coupled_accepts_exactly_the_drafts_equal_to_the_targets_draws():
    g = torch.Generator().manual_seed(0)
    target_probs = torch.softmax(torch.randn(5, 30, generator=g), -1)
    noise = PositionNoise(4, 10, 30)
    draws = [gumbel_argmax(target_probs[k], noise.gumbel(k)) for k in range(5)]
    assert verify_coupled(torch.tensor(draws[:4]), target_probs, noise) == (4, draws[4])
    wrong = (draws[2] + 1) % 30
    assert verify_coupled(torch.tensor(draws[:2] + [wrong, draws[3]]), target_probs, noise) \
        == (2, draws[2])
    assert verify_coupled(torch.tensor([], dtype=torch.long), target_probs[:1], noise) \
        == (0, draws[0])


def test_no_two_seeds_share_noise_shifted_by_some_positions():
    """The noise key is a hash of (seed, position): seeds 2^32 apart, or a seed and the one a
    linear key would map onto the next position, do not repeat each other's noise."""
    base = PositionNoise(5, 0, 64)
    for other in (5 + 2**32, 5 + 2709248021, 6):
        shifted = PositionNoise(other, 0, 64)
        assert not any(torch.equal(base.gumbel(k), shifted.gumbel(j))
                       for k in range(3) for j in range(3)), other


def test_a_top_p_that_rounds_to_zero_keeps_the_top_token():
    from drafters.sampling import warped_probs

    probs = warped_probs(torch.tensor([[2.0, 1.0, 0.5]]), torch.tensor([1.0]),
                         torch.tensor([1e-50]))
    assert probs.tolist() == [[1.0, 0.0, 0.0]]
