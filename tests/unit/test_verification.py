"""A step's target distributions warped together (serve/engine/verification.py:
Verifier.target_distributions) are each request's own (target_distribution, min_tokens masking
included), whatever the mix of sampling parameters and however the rows are chunked; a request
whose logits are not finite fails alone in the engine."""

from __future__ import annotations

import pytest
import torch

import serve.engine.verification as verification
from serve.engine.requests import EngineRequest, SamplingParams
from serve.engine.request_state import RequestState
from serve.engine.verification import Verifier, target_distribution

V = 50


def _requests():
    params = [SamplingParams(temperature=0.7, top_p=0.8, top_k=20, max_tokens=8),
              SamplingParams(temperature=0.0, max_tokens=8),  # greedy: no distribution
              SamplingParams(temperature=1.0, top_p=1.0, max_tokens=8),  # no top-k
              SamplingParams(temperature=1.3, top_p=0.5, top_k=5, min_p=0.1, max_tokens=8),
              SamplingParams(temperature=0.9, top_k=3, min_tokens=4, max_tokens=8),
              SamplingParams(temperature=0.5, top_p=0.9, max_tokens=8, min_p=0.05),
              SamplingParams(temperature=0.8, top_k=-1, max_tokens=8),  # vLLM's "no top-k"
              SamplingParams(temperature=0.6, top_k=20, top_p=0.9, max_tokens=8)]
    return [RequestState.create(EngineRequest(f"r{i}", [2, 3], p)) for i, p in enumerate(params)]


@pytest.mark.parametrize("warp_rows", [256, 4])
def test_each_request_gets_its_own_distribution(monkeypatch, warp_rows):
    monkeypatch.setattr(verification, "WARP_ROWS", warp_rows)
    g = torch.Generator().manual_seed(0)
    requests = _requests()
    logits = [torch.randn(n, V, generator=g) * 3 for n in (1, 3, 5, 2, 4, 1, 2, 3)]
    verifier = Verifier(eos={1}, vocab_size=V, load_invariant=False)
    together = verifier.target_distributions(requests, logits)
    for r, lg, probs in zip(requests, logits, together):
        if r.req.params.temperature <= 0:
            assert probs is None
            continue
        alone = target_distribution(r, verifier.mask_early_stops(r, lg))
        assert torch.equal(probs, alone)  # bit for bit: a row never depends on its neighbours
        assert probs.shape == (lg.shape[0], V)
    # min_tokens: the end token is held off at the rows before the fourth output token
    assert together[4][:, 1].abs().sum() == 0


def test_a_request_with_non_finite_logits_fails_alone():
    from serve.engine.config import EngineConfig
    from serve.engine.core import SpecEngine
    from serve.engine.target_runner import TargetRunner
    from tests.tiny import tiny_target

    model = tiny_target(seed=2)
    engine = SpecEngine(TargetRunner(model, []), None, [], EngineConfig(scheduler="none",
                                                                        sps_profile="off"))
    for i in range(3):
        engine.add_request(EngineRequest(f"r{i}", [5, 6, 7 + i], SamplingParams(
            temperature=1.0, top_k=10, max_tokens=6, seed=i, ignore_eos=True)))
    real = engine.target.forward_batch

    def poisoned(caches, tokens, **kwargs):  # r1's logits turn NaN after its prefill
        outs = real(caches, tokens, **kwargs)
        for r, o in zip(engine.running, outs):
            if r.req.request_id == "r1" and o.logits is not None and len(r.output) >= 2:
                o.logits = torch.full_like(o.logits, float("nan"))
        return outs

    engine.target.forward_batch = poisoned
    outs: dict = {}
    while engine.has_unfinished():
        for o in engine.step():
            outs.setdefault(o.request_id, []).append(o)
    assert outs["r1"][-1].finish_reason == "error"
    for rid in ("r0", "r2"):
        assert outs[rid][-1].finish_reason == "length"
        assert sum(len(o.new_token_ids) for o in outs[rid]) == 6
