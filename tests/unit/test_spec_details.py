"""Per-request speculation details (``return_spec_details``, issue 24): the summary each finished
request carries adds up, over a batch of concurrent requests, to the engine's own counters, and
only requests that asked carry one."""

from __future__ import annotations

import pytest
import torch

from serve.engine.metrics import request_spec_details
from serve.engine.requests import EngineRequest, SamplingParams
from tests.unit.helpers import oracle_drafter, permuted_target, randomize_heads
from tests.unit.test_engine import _engine
from tests.unit.test_speculative_lossless import corrupted_table  # noqa: F401 - a fixture


@pytest.fixture(scope="module")
def varied_target():
    return permuted_target()


def _drain(engine):
    """Step until every request finished: (finished output, tokens emitted) per request id."""
    finished, generated = {}, {}
    while engine.has_unfinished():
        for out in engine.step():
            generated[out.request_id] = generated.get(out.request_id, 0) + len(out.new_token_ids)
            if out.finished:
                finished[out.request_id] = out
    return finished, generated


@pytest.mark.parametrize("scheduler", ["dspark", "fixed"])
def test_details_of_concurrent_requests_add_up_to_the_engine_counters(varied_target,
                                                                      corrupted_table, scheduler):
    target = varied_target
    drafter = randomize_heads(oracle_drafter(target, corrupted_table, "markov", 4))
    engine = _engine(target, drafter, scheduler, threshold=0.3, prompt_lookup_max_ngram=2)
    g = torch.Generator().manual_seed(1)
    reqs = [EngineRequest(f"r{i}", torch.randint(0, 96, (n,), generator=g).tolist(),
                          SamplingParams(max_tokens=m, temperature=t, seed=i),
                          return_spec_details=True)
            for i, (n, m, t) in enumerate([(4, 30, 0.0), (9, 17, 1.0), (2, 1, 1.0), (6, 12, 0.0),
                                           (3, 25, 0.7)])]
    for r in reqs:
        engine.add_request(r)
    finished, generated = _drain(engine)
    details = [finished[r.request_id].spec_details for r in reqs]
    assert details[2]["rounds"] == 0 and details[2]["accept_histogram"] == []  # prefill token only
    s = engine.stats
    assert sum(d["rounds"] for d in details) == s.rounds > 0
    for mine, theirs in {"draft_tokens_proposed": "drafted_tokens",
                         "draft_tokens_verified": "verified_tokens",
                         "draft_tokens_accepted": "accepted_tokens",
                         "drafted_rounds": "drafted_rounds"}.items():
        assert sum(d[mine] for d in details) == getattr(s, theirs), mine
    assert s.accepted_tokens > 0 and s.verified_tokens > s.accepted_tokens
    for r, d in zip(reqs, details):
        assert sum(d["accept_histogram"]) == d["rounds"]
        assert sum(n * c for n, c in enumerate(d["accept_histogram"])) == d["draft_tokens_accepted"]
        # the first token is the prefill's; each round commits the rest (accepted + 1, or fewer
        # where a stop or max_tokens cut it)
        assert (d["accept_length"] or 0) * d["rounds"] == pytest.approx(
            generated[r.request_id] - 1)
        assert (d["accept_length"] is None) == (d["rounds"] == 0)
        src = d["sources"]
        for key in ("draft_tokens_verified", "draft_tokens_accepted"):
            assert src["model"][key] + src["lookup"][key] == d[key]
        if d["draft_tokens_verified"]:
            assert d["acceptance_rate"] == pytest.approx(
                d["draft_tokens_accepted"] / d["draft_tokens_verified"])
            assert d["conditional_acceptance"][0] is not None
            assert all(c is None or 0 <= c <= 1 for c in d["conditional_acceptance"])
        else:
            assert d["acceptance_rate"] is None
        assert d["engine_ttft_s"] >= 0
        # the engine's own decode speed: defined once a request emitted more than its first token
        speed = d["engine_decode_tokens_per_s"]
        assert (speed is None) == (generated[r.request_id] == 1)
        assert speed is None or speed > 0

    # a request that did not ask carries none
    engine.add_request(EngineRequest("plain", [5, 6, 7], SamplingParams(max_tokens=6,
                                                                         temperature=0.0)))
    finished, _ = _drain(engine)
    assert finished["plain"].spec_details is None


def test_conditional_acceptance_leaves_unreached_positions_unmeasured():
    class Round:
        def __init__(self, drafted, verified, accepted, source="model"):
            self.drafted, self.verified, self.accepted = drafted, verified, accepted
            self.committed, self.source = accepted + 1, source

    d = request_spec_details([Round(4, 4, 0), Round(4, 3, 1), Round(0, 0, 0, None),
                              Round(2, 2, 2, "lookup")])
    assert d["accept_histogram"] == [2, 1, 1]
    # positions 3 and 4 were verified (first round) but never reached with all before accepted
    assert d["conditional_acceptance"] == [2 / 3, 1 / 2, None, None]
    assert d["verified_rounds"] == 3 and d["drafted_rounds"] == 3 and d["rounds"] == 4
    assert d["sources"]["lookup"] == {"rounds": 1, "draft_tokens_verified": 2,
                                      "draft_tokens_accepted": 2}
    assert d["accept_length"] == pytest.approx(7 / 4)


def test_a_request_without_rounds_has_no_accept_length():
    """A one-token answer (its token is the prefill's) ran no round: tau is undefined, not 0."""
    from serve.engine.metrics import request_spec_details

    d = request_spec_details([])
    assert d["rounds"] == 0 and d["accept_length"] is None and d["acceptance_rate"] is None
    assert d["accept_histogram"] == []
