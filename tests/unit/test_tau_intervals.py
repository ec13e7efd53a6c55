"""Intervals on accepted length tau (issue 42): bootstrap over prompts, domain and macro
intervals, and the paired comparison of two drafters on the same prompts."""

from __future__ import annotations

import numpy as np
import pytest

from pipeline.tau_intervals import (domain_intervals, format_interval, paired_difference,
                                    prompt_counts, tau_interval)
from serve.engine.core import RoundRecord

DOMAIN_OF = {"gsm8k": "math", "math500": "math", "mbpp": "code", "mt-bench": "chat"}


def _round(verified: int, accepted: int) -> RoundRecord:
    return RoundRecord(verified, verified, accepted, accepted + 1, 0.0, 0.0, None)


def _prompts(rng: np.random.Generator, n: int, mean_tau: float, rounds: int = 20) -> list:
    """``n`` prompts of ``rounds`` rounds each, prompt-level taus spread around ``mean_tau``."""
    taus = np.clip(rng.normal(mean_tau, 0.6, size=n), 1.0, None)
    return [[int(round(t * rounds)), rounds] for t in taus]


def test_prompt_counts_skip_rounds_that_verified_nothing():
    rounds = [_round(3, 2), _round(3, 0), RoundRecord(3, 0, 0, 1, 0.0, 0.0, None)]
    assert prompt_counts([rounds, []]) == [[3 + 1, 2], [0, 0]]


def test_interval_brackets_the_point_and_shrinks_with_more_prompts():
    rng = np.random.default_rng(1)
    counts = _prompts(rng, 12, 2.0)
    tau = sum(c for c, _ in counts) / sum(r for _, r in counts)
    low, high = tau_interval(counts)
    assert low < tau < high
    low4, high4 = tau_interval(counts * 4)  # the same prompts four times: half the width
    assert (high4 - low4) == pytest.approx((high - low) / 2, rel=0.25)
    assert tau_interval(counts[:1]) is None  # one prompt: nothing to resample
    same = [[30, 10]] * 5  # no spread between prompts: a zero-width interval at tau
    assert tau_interval(same) == pytest.approx([3.0, 3.0])


def test_interval_covers_the_population_tau_about_95_percent_of_the_time():
    """Draw many 10-prompt evals from a population of prompts whose pooled tau is known: the
    95 % interval should cover it in roughly 95 % of them (bootstrap percentile intervals run a
    little narrow at n = 10, hence the lower bound)."""
    rng = np.random.default_rng(7)
    population = np.array(_prompts(rng, 5000, 2.2), dtype=np.float64)
    truth = population[:, 0].sum() / population[:, 1].sum()
    evals = 200
    covered = sum(
        lo <= truth <= hi for lo, hi in
        (tau_interval(population[rng.integers(0, len(population), 10)].tolist(),
                      resamples=400, seed=i) for i in range(evals)))
    assert 0.85 <= covered / evals <= 0.99


def test_domain_and_macro_intervals():
    rng = np.random.default_rng(2)
    cells = {"gsm8k": _prompts(rng, 8, 2.5), "math500": _prompts(rng, 8, 2.0),
             "mbpp": _prompts(rng, 8, 1.8), "mt-bench": [[12, 10]]}
    ci = domain_intervals(cells, DOMAIN_OF)
    taus = {n: sum(c for c, _ in v) / sum(r for _, r in v) for n, v in cells.items()}
    math = (taus["gsm8k"] + taus["math500"]) / 2
    macro = (math + taus["mbpp"] + taus["mt-bench"]) / 3
    assert ci["math"][0] < math < ci["math"][1]
    assert ci["macro"][0] < macro < ci["macro"][1]
    assert ci["chat"] is None  # one prompt
    # the macro averages three domains: narrower than the noisiest domain's interval
    assert ci["macro"][1] - ci["macro"][0] < ci["code"][1] - ci["code"][0]


def test_paired_difference_separates_a_shift_shared_prompt_noise_would_hide():
    """Drafter b accepts 0.15 tokens per round less on every prompt. The prompts' own spread
    (sd 0.6) swamps that in either drafter's interval alone, but the paired interval of the
    difference excludes 0; an identical drafter does not separate; mismatched evals are refused."""
    rng = np.random.default_rng(3)
    a = {"gsm8k": _prompts(rng, 10, 2.4), "mbpp": _prompts(rng, 10, 1.9)}
    b = {n: [[c - 3, r] for c, r in v] for n, v in a.items()}  # 3 tokens over 20 rounds: -0.15
    res = paired_difference(a, b, DOMAIN_OF)
    assert res["difference"] == pytest.approx(0.15)
    assert res["separates"] and res["difference_interval"][0] > 0
    lone = domain_intervals(a, DOMAIN_OF)["macro"]
    assert lone[1] - lone[0] > 2 * 0.15  # unpaired, the two intervals would overlap
    assert res["ratio"] == pytest.approx(res["macro_a"] / res["macro_b"])
    assert res["relative_half_width"] == pytest.approx(res["half_width"] / res["macro_b"])
    same = paired_difference(a, a, DOMAIN_OF)
    assert same["difference"] == 0 and same["difference_interval"] == [0.0, 0.0]
    assert not same["separates"]
    with pytest.raises(ValueError, match="same prompts"):
        paired_difference(a, {"gsm8k": a["gsm8k"][:9], "mbpp": a["mbpp"]}, DOMAIN_OF)


def test_a_dataset_one_drafter_never_drafted_on_leaves_both_macros():
    """b drafted in no round of mt-bench (its chat domain unmeasured): both macros are over the
    datasets measured in both, so b's missing chat cannot make a lead out of a's chat tau; with
    nothing measured in both the comparison is refused."""
    rng = np.random.default_rng(5)
    a = {"gsm8k": _prompts(rng, 8, 2.0), "mt-bench": _prompts(rng, 8, 2.0)}
    b = {"gsm8k": a["gsm8k"], "mt-bench": [[c, 0] for c, _ in a["mt-bench"]]}
    res = paired_difference(a, b, DOMAIN_OF)
    assert res["unmeasured_datasets"] == ["mt-bench"]
    assert res["difference"] == 0 and not res["separates"]
    assert paired_difference(a, a, DOMAIN_OF)["unmeasured_datasets"] == []
    with pytest.raises(ValueError, match="no dataset where both drafters drafted"):
        paired_difference({"mt-bench": a["mt-bench"]}, {"mt-bench": b["mt-bench"]}, DOMAIN_OF)
    # a domain with no drafted round has no interval; the macro's is over the rest
    ci = domain_intervals(b, DOMAIN_OF)
    assert ci["chat"] is None and ci["macro"] == pytest.approx(ci["math"])


def test_format_interval():
    assert format_interval(1.6912, [1.52, 1.853]) == "1.69 [1.52, 1.85]"
    assert format_interval(1.6912, None, 3) == "1.691"
    assert format_interval(None, None) == "-" and format_interval(None, [1.0, 2.0]) == "-"
