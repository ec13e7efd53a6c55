"""vLLM's per-request acceptance stats (``metrics.speculative_decoding``, vLLM PR #48915, issue 43):
the fields and their definitions as vLLM documents them, and, over concurrent requests, sums equal
to the engine counters the ``vllm_spec_decode_*`` Prometheus counters export."""

from __future__ import annotations

import pytest
import torch

from serve.engine.errors import RequestError
from serve.engine.metrics import vllm_spec_decode_metrics
from serve.engine.request_state import RoundRecord
from serve.engine.requests import EngineRequest, SamplingParams
from tests.unit.helpers import oracle_drafter, randomize_heads
from tests.unit.test_engine import _engine
from tests.unit.test_spec_details import _drain, varied_target  # noqa: F401 - a fixture
from tests.unit.test_speculative_lossless import corrupted_table  # noqa: F401 - a fixture

# vLLM's documented example response (docs: "Per-Request Acceptance Metrics"): 43 steps of k = 3
VLLM_SUMMARY = {"mean_acceptance_length": 1.2325581395348837,
                "draft_acceptance_rate": 0.07751937984496124,
                "acceptance_histogram": [39, 1, 0, 3], "num_spec_steps": 43,
                "num_accepted_draft_tokens": 10, "num_draft_tokens": 129, "num_spec_tokens": 3}
DETAILED_ONLY = {"per_step_accepted", "per_step_drafted"}


def _round(verified, accepted, drafted=None):
    drafted = verified if drafted is None else drafted
    return RoundRecord(drafted, verified, accepted, accepted + 1, 0.0, 0.0)


def test_the_documented_example_is_reproduced_field_for_field():
    rounds = [_round(3, 0)] * 39 + [_round(3, 1)] + [_round(3, 3)] * 3
    got = vllm_spec_decode_metrics(rounds, 3)
    assert got.keys() == VLLM_SUMMARY.keys()
    rates = ("mean_acceptance_length", "draft_acceptance_rate")
    assert [got[k] for k in rates] == pytest.approx([VLLM_SUMMARY[k] for k in rates])
    assert {k: v for k, v in got.items() if k not in rates} == \
        {k: v for k, v in VLLM_SUMMARY.items() if k not in rates}
    detailed = vllm_spec_decode_metrics(rounds, 3, detailed=True)
    assert detailed.keys() == VLLM_SUMMARY.keys() | DETAILED_ONLY
    assert detailed["per_step_accepted"] == [0] * 39 + [1, 3, 3, 3]
    assert detailed["per_step_drafted"] == [3] * 43


def test_plain_rounds_are_no_steps_and_withheld_drafts_are_not_draft_tokens():
    """A round that proposed nothing is plain decoding (no step); a step's draft tokens are those
    verified (DSpark's scheduler may withhold the rest), so the rate is accepted / verified."""
    rounds = [_round(0, 0), _round(2, 1, drafted=5), _round(0, 0, drafted=4), _round(5, 5)]
    got = vllm_spec_decode_metrics(rounds, 5, detailed=True)
    assert got["num_spec_steps"] == 3 and got["acceptance_histogram"] == [1, 1, 0, 0, 0, 1]
    assert got["num_draft_tokens"] == 7 and got["num_accepted_draft_tokens"] == 6
    assert got["draft_acceptance_rate"] == pytest.approx(6 / 7)
    assert got["mean_acceptance_length"] == pytest.approx(1 + 6 / 3)
    assert got["per_step_drafted"] == [2, 0, 5] and got["per_step_accepted"] == [1, 0, 5]
    empty = vllm_spec_decode_metrics([_round(0, 0)], 4)  # drafted nothing: all-zero histogram
    assert empty["acceptance_histogram"] == [0] * 5 and empty["num_spec_steps"] == 0
    assert empty["mean_acceptance_length"] == 1.0 and empty["draft_acceptance_rate"] == 0.0


@pytest.mark.parametrize("scheduler", ["dspark", "fixed"])
def test_stats_of_concurrent_requests_add_up_to_the_vllm_counters(varied_target, corrupted_table,
                                                                  scheduler):
    target = varied_target
    drafter = randomize_heads(oracle_drafter(target, corrupted_table, "markov", 4))
    engine = _engine(target, drafter, scheduler, threshold=0.3, prompt_lookup_max_ngram=2)
    g = torch.Generator().manual_seed(2)
    levels = ["summary", "detailed", "none", "detailed"]
    reqs = [EngineRequest(f"r{i}", torch.randint(0, 96, (n,), generator=g).tolist(),
                          SamplingParams(max_tokens=m, temperature=t, seed=i),
                          spec_decode_metrics=level)
            for i, ((n, m, t), level) in enumerate(zip([(4, 30, 0.0), (9, 17, 1.0), (6, 12, 0.0),
                                                         (3, 25, 0.7)], levels))]
    for r in reqs:
        engine.add_request(r)
    finished, _ = _drain(engine)
    assert finished["r2"].metrics is None and finished["r2"].spec_details is None
    stats = {r.request_id: finished[r.request_id].metrics["speculative_decoding"]
             for r in reqs if r.spec_decode_metrics != "none"}
    assert stats["r1"].keys() == VLLM_SUMMARY.keys() | DETAILED_ONLY
    assert stats["r0"].keys() == VLLM_SUMMARY.keys()
    assert engine.stats.accepted_tokens > 0
    for st in stats.values():
        assert len(st["acceptance_histogram"]) == st["num_spec_tokens"] + 1 == 5
        assert sum(st["acceptance_histogram"]) == st["num_spec_steps"]
        assert sum(j * c for j, c in enumerate(st["acceptance_histogram"])) == \
            st["num_accepted_draft_tokens"] <= st["num_draft_tokens"]
        if "per_step_accepted" in st:
            assert sum(st["per_step_accepted"]) == st["num_accepted_draft_tokens"]
            assert sum(st["per_step_drafted"]) == st["num_draft_tokens"]
    # every request asking: the sums are the counters vLLM's Prometheus names export
    engine2 = _engine(target, drafter, scheduler, threshold=0.3, prompt_lookup_max_ngram=2)
    for r in reqs:
        engine2.add_request(EngineRequest(r.request_id, r.prompt_ids, r.params,
                                          spec_decode_metrics="summary"))
    finished2, _ = _drain(engine2)
    every = [o.metrics["speculative_decoding"] for o in finished2.values()]
    s2 = engine2.stats
    assert sum(st["num_spec_steps"] for st in every) == s2.drafted_rounds > 0
    assert sum(st["num_draft_tokens"] for st in every) == s2.verified_tokens
    assert sum(st["num_accepted_draft_tokens"] for st in every) == s2.accepted_tokens > 0


def test_an_unknown_level_is_refused_naming_the_field(varied_target):
    engine = _engine(varied_target, None)
    with pytest.raises(RequestError, match="spec_decode_metrics") as err:
        engine.add_request(EngineRequest("x", [3, 4], SamplingParams(max_tokens=2),
                                         spec_decode_metrics="full"))
    assert err.value.field == "spec_decode_metrics"
