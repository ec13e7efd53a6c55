"""Batched context extension (``extend_context_batch``): the engine extends every drafted
request's context in one call; the contexts must end as per-request ``extend_context`` calls
would leave them, for the packed DSpark/DFlash version and the generic one (Eagle3), and the
matmul row counts stay in the bounded set of ``row_pieces``."""

from __future__ import annotations

import pytest
import torch

from drafters.base import row_pieces
from tests.tiny import tiny_drafter, tiny_target
from tests.unit.helpers import randomize_heads
from tests.unit.test_eagle3 import _eagle3


@pytest.fixture(scope="module")
def target():
    return tiny_target()


def test_row_pieces_refuses_what_it_cannot_split():
    with pytest.raises(ValueError, match="power-of-two"):
        row_pieces(-1)
    with pytest.raises(ValueError, match="power-of-two"):
        row_pieces(20, small=6)


@pytest.mark.parametrize("n", [0, 1, 7, 8, 9, 15, 16, 17, 150, 300, 1023, 1024, 1025])
def test_row_pieces_cover_n_in_bounded_shapes(n):
    pieces = row_pieces(n)
    assert sum(pieces) == n and all(p > 0 for p in pieces)
    big = [p for p in pieces if p >= 8]
    assert all(p & (p - 1) == 0 for p in big)  # powers of two
    assert big == sorted(big, reverse=True) and len(set(big)) == len(big)
    assert sum(1 for p in pieces if p < 8) <= 1 and (not pieces or pieces[-1] == min(pieces))


def _drafters(target):
    return {"dspark": randomize_heads(tiny_drafter(target, block_size=4, head_type="markov")),
            "dflash": randomize_heads(tiny_drafter(target, block_size=4, drafter_type="dflash")),
            "eagle3": _eagle3(target)}


@pytest.mark.parametrize("kind", ["dspark", "dflash", "eagle3"])
def test_batched_extension_equals_one_call_per_request(target, kind):
    d = _drafters(target)[kind].eval()
    width = d.config.target_hidden_size * len(d.config.target_layer_ids)
    g = torch.Generator().manual_seed(0)
    # per request: positions already in its context, then a backlog (one empty, one long
    # enough to be split into pieces)
    have, add = [3, 0, 5, 2], [4, 0, 37, 1]
    feats = [torch.randn(h + a, width, generator=g) for h, a in zip(have, add)]
    ids = [torch.randint(0, target.config.vocab_size, (h + a,), generator=g)
           for h, a in zip(have, add)]

    def prefilled():
        states = []
        for f, t, h in zip(feats, ids, have):
            st = d.new_draft_state()
            if h:
                d.extend_context(st, f[None, :h], torch.arange(h)[None], t[None, :h])
            states.append(st)
        return states

    one_by_one = prefilled()
    for st, f, t, h, a in zip(one_by_one, feats, ids, have, add):
        if a:
            d.extend_context(st, f[None, h:], torch.arange(h, h + a)[None], t[None, h:])
    batched = prefilled()
    d.extend_context_batch(batched, [f[h:] for f, h in zip(feats, have)],
                           [t[h:] for t, h in zip(ids, have)])
    for a, b, h, n in zip(one_by_one, batched, have, add):
        assert b.length == a.length == h + n
        assert len(b.keys) == len(a.keys) == len(b.values) == len(a.values)
        for ka, kb in zip(a.keys + a.values, b.keys + b.values):
            torch.testing.assert_close(kb, ka, rtol=1e-5, atol=1e-6)
        if kind == "eagle3" and a.hidden is not None:
            torch.testing.assert_close(b.hidden, a.hidden, rtol=1e-5, atol=1e-6)
            assert torch.equal(b.last_token, a.last_token)


def test_dspark_batched_extension_runs_the_bounded_row_counts(target, monkeypatch):
    """The packed rows (here 4 + 37 + 1 = 42) reach the projections as 32 + 8 + 2."""
    d = _drafters(target)["dspark"].eval()
    width = d.config.target_hidden_size * len(d.config.target_layer_ids)
    seen = []
    original = type(d).context_states

    def spy(self, features):
        seen.append(features.shape[1])
        return original(self, features)

    monkeypatch.setattr(type(d), "context_states", spy)
    states = [d.new_draft_state() for _ in range(3)]
    d.extend_context_batch(states, [torch.randn(n, width) for n in (4, 37, 1)],
                           [torch.zeros(n, dtype=torch.long) for n in (4, 37, 1)])
    assert seen == [32, 8, 2] and [s.length for s in states] == [4, 37, 1]


def test_dspark_batched_extension_changes_no_cache_when_it_raises(target):
    """All or nothing: the second of three caches is corrupt (its keys have a wrong head
    size), so growing it raises after the projections ran; the first cache must be as it was
    (the engine's row-by-row retry then extends it normally)."""
    d = _drafters(target)["dspark"].eval()
    width = d.config.target_hidden_size * len(d.config.target_layer_ids)
    states = [d.new_draft_state() for _ in range(3)]
    for st in states:
        d.extend_context(st, torch.randn(1, 3, width), torch.arange(3)[None])
    states[1].keys[-1] = states[1].keys[-1][..., :-1]  # the last layer's keys one dim short
    before = [k.clone() for k in states[0].keys]
    with pytest.raises(RuntimeError):
        d.extend_context_batch(states, [torch.randn(2, width) for _ in range(3)],
                               [torch.zeros(2, dtype=torch.long) for _ in range(3)])
    assert states[0].length == 3 and states[2].length == 3
    assert all(torch.equal(a, b) for a, b in zip(before, states[0].keys))
    d.extend_context_batch(states[:1], [torch.randn(2, width)], [torch.zeros(2, dtype=torch.long)])
    assert states[0].length == 5


def test_flush_refuses_a_pending_context_that_does_not_start_where_the_draft_context_ends(
        target):
    """A request whose pending positions would be appended at the wrong place (its draft
    context already holds them) is refused before anything is extended."""
    from types import SimpleNamespace

    from serve.engine.drafting import Drafting
    from serve.engine.request_state import PendingContext

    d = _drafters(target)["dspark"].eval()
    width = d.config.target_hidden_size * len(d.config.target_layer_ids)
    state = d.new_draft_state()
    d.extend_context(state, torch.randn(1, 4, width), torch.arange(4)[None])
    pending = PendingContext([torch.randn(2, width)], 2, [7, 8])  # starts at 2, not 4
    r = SimpleNamespace(draft_state=state, pending=pending,
                        req=SimpleNamespace(request_id="r"))
    with pytest.raises(RuntimeError, match="starts at 2, its draft context holds 4"):
        Drafting(d).flush([r])
    assert state.length == 4 and r.pending is pending
