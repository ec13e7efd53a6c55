"""The one sampling warp (drafters/sampling.py): temperature, top-k then top-p, per row."""

from __future__ import annotations

import pytest
import torch

from drafters.sampling import draw, sample_rows, warped_probs


def test_top_k_then_top_p_by_hand():
    logits = torch.log(torch.tensor([[0.4, 0.3, 0.2, 0.1], [0.4, 0.3, 0.2, 0.1]]))
    one = torch.ones(2)
    # row 0: top-2 -> (0.4, 0.3) renormalised; row 1: no top-k, top-p 0.65 keeps 0.4 and 0.3
    p = warped_probs(logits, one, torch.tensor([1.0, 0.65]), torch.tensor([2, 0]))
    assert p[0].tolist() == pytest.approx([4 / 7, 3 / 7, 0.0, 0.0])
    assert p[1].tolist() == pytest.approx([4 / 7, 3 / 7, 0.0, 0.0])
    # top-k 3 then top-p 0.5 of the renormalised (4/9, 3/9, 2/9): keeps the first two
    q = warped_probs(logits[:1], one[:1], torch.tensor([0.5]), torch.tensor([3]))
    assert q[0].tolist() == pytest.approx([4 / 7, 3 / 7, 0.0, 0.0])
    assert torch.equal(warped_probs(logits, one, one), torch.softmax(logits, -1))


def test_sample_rows_top_k_never_draws_outside_and_shared_stream_is_batched():
    torch.manual_seed(0)
    logits = torch.randn(64, 50)
    tokens, probs = sample_rows(logits, 1.0, 1.0, None, top_k=3)
    top3 = logits.topk(3, dim=-1).indices
    assert bool((top3 == tokens[:, None]).any(-1).all())
    assert torch.allclose(probs.sum(-1), torch.ones(64))
    greedy, _ = sample_rows(logits, 0.0)
    assert torch.equal(greedy, logits.argmax(-1))


def test_topk_fast_path_equals_the_full_sort():
    """Rows that all limit top-k rank only k_max tokens; the result equals the full-sort path."""
    torch.manual_seed(1)
    logits = torch.randn(5, 300)
    t, p = torch.full((5,), 0.8), torch.tensor([1.0, 0.9, 0.5, 0.99, 0.7])
    k = torch.tensor([20, 5, 20, 1, 300])
    fast = warped_probs(logits, t, p, k)
    full = torch.stack([warped_probs(logits[i:i + 1], t[i:i + 1], p[i:i + 1],
                                     torch.tensor([int(k[i]) if k[i] < 300 else 0]))[0]
                        for i in range(5)])
    assert torch.allclose(fast, full, atol=1e-6)
    assert (fast > 0).sum(-1).tolist()[3] == 1


def test_the_top_k_path_on_the_largest_logits_equals_the_whole_vocabulary_path():
    """Every row limiting top-k: warped on its k_max largest logits only; a row without top-k in
    the same call sends all rows through softmax over the whole vocabulary, min-p, top-k, top-p.
    Same distributions, with temperatures, min-p, top-p and -inf logits (min_tokens masking)."""
    torch.manual_seed(2)
    logits = torch.randn(6, 400) * 3
    logits[2, :390] = float("-inf")  # fewer finite logits than its top-k
    t = torch.tensor([0.3, 1.0, 0.7, 1.5, 0.9, 1.0])
    p = torch.tensor([1.0, 0.9, 0.5, 0.7, 0.95, 0.2])
    k = torch.tensor([20, 5, 50, 40, 1, 7])
    m = torch.tensor([0.0, 0.05, 0.0, 0.2, 0.0, 0.01])
    fast = warped_probs(logits, t, p, k, m)
    pad = lambda x, v: torch.cat([x, torch.tensor([v], dtype=x.dtype)])  # noqa: E731
    whole = warped_probs(torch.cat([logits, logits[:1]]), pad(t, 1.0), pad(p, 1.0), pad(k, 0),
                         pad(m, 0.0))[:6]
    torch.testing.assert_close(fast, whole, atol=1e-6, rtol=1e-5)
    assert (fast > 0).sum(-1).tolist()[4] == 1 and (fast[2, :390] == 0).all()


def test_draw_follows_the_distribution_and_never_a_zero_probability_token():
    """draw (inverse CDF, one uniform number per call) has the distribution it is given
    (chi-square over 20,000 draws), never returns a zero-probability token, and a seeded
    generator repeats it."""
    from scipy.stats import chisquare

    probs = torch.softmax(torch.randn(40, generator=torch.Generator().manual_seed(3)) * 2, -1)
    probs[[0, 7, 39]] = 0.0  # the first, a middle and the last token are impossible
    probs = probs / probs.sum()
    g = torch.Generator().manual_seed(0)
    counts = torch.zeros(40)
    for _ in range(20_000):
        counts[draw(probs, g)] += 1
    assert counts[[0, 7, 39]].sum() == 0
    keep = probs * 20_000 >= 5
    assert chisquare(counts[keep].numpy(), (probs[keep] / probs[keep].sum() * counts[keep].sum())
                     .numpy()).pvalue > 1e-3
    # a one-token distribution, unnormalised input
    one = torch.zeros(10)
    one[9] = 0.3
    assert {draw(one, g) for _ in range(50)} == {9}
    a = [draw(probs, torch.Generator().manual_seed(5)) for _ in range(3)]
    assert len(set(a)) == 1
    for bad in (torch.zeros(5), torch.tensor([0.5, float("nan")])):
        with pytest.raises(ValueError, match="cannot draw"):
            draw(bad, g)
