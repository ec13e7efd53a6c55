"""Rows without a draft sample together (``Verifier.sample_undrafted``): each request gets exactly
the token its own verification would give, whatever else is in the batch, with its own stream;
seeded load-invariant requests keep their position-keyed path."""

from __future__ import annotations

import torch

from serve.engine.request_state import RequestState
from serve.engine.requests import EngineRequest, SamplingParams
from serve.engine.verification import Verifier

V = 500
PARAMS = [dict(temperature=0.0), dict(temperature=0.7, top_p=0.8, top_k=20),
          dict(temperature=1.0), dict(temperature=0.7, top_p=0.8, top_k=20),
          dict(temperature=1.3, top_k=-1, min_p=0.05), dict(temperature=0.9, top_p=0.5),
          dict(temperature=0.7, top_k=20, min_tokens=5), dict(temperature=0.0, min_tokens=5),
          dict(temperature=0.7, top_k=V + 10)]


def _requests(params, seed_offset=0):
    return [RequestState.create(EngineRequest(str(i), [1, 2],
                                              SamplingParams(seed=seed_offset + i, **p)))
            for i, p in enumerate(params)]


def test_each_request_gets_the_token_its_own_verification_gives():
    torch.manual_seed(0)
    verifier = Verifier(eos={3, 4}, vocab_size=V, load_invariant=False)
    logits = [torch.randn(1, V) * 4 for _ in PARAMS]
    for row in (6, 7):  # min_tokens must hold the end tokens off: make them the likeliest
        logits[row][0, 3] = 50.0
    for trial in range(4):
        batched, alone = _requests(PARAMS, 10 * trial), _requests(PARAMS, 10 * trial)
        got = verifier.sample_undrafted(batched, logits)
        empty = torch.zeros(0, dtype=torch.long)
        want = [verifier.verify(r, empty, None, lg)[1] for r, lg in zip(alone, logits)]
        assert got == want
        assert got[6] not in (3, 4) and got[7] not in (3, 4)
        # a request's token does not depend on its neighbours: alone in its own batch
        for i in (1, 4, 5):
            solo = _requests(PARAMS, 10 * trial)[i]
            assert verifier.sample_undrafted([solo], [logits[i]]) == [want[i]]


def test_seeded_requests_under_load_invariance_keep_their_own_path():
    verifier = Verifier(eos={3}, vocab_size=V, load_invariant=True)
    reqs = _requests([dict(temperature=0.7), dict(temperature=0.0)])
    got = verifier.sample_undrafted(reqs, [torch.randn(1, V), torch.randn(1, V)])
    assert got[0] is None and got[1] is not None


def test_a_row_without_mass_is_left_to_its_own_verification():
    verifier = Verifier(eos={3}, vocab_size=V, load_invariant=False)
    reqs = _requests([dict(temperature=0.7), dict(temperature=0.7)])
    bad = torch.full((1, V), float("nan"))
    got = verifier.sample_undrafted(reqs, [bad, torch.randn(1, V)])
    assert got[0] is None and got[1] is not None
