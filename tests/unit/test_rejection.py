"""verify_greedy / verify_sampled (SPEC section 5): hand cases and sampling statistics."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from scipy.stats import chisquare

from serve.engine.rejection import verify_greedy, verify_sampled


def _onehot_logits(tokens, v=6):
    """Logits whose argmax at row i is tokens[i]."""
    logits = torch.zeros(len(tokens), v)
    logits[torch.arange(len(tokens)), torch.tensor(tokens)] = 5.0
    return logits


@pytest.mark.parametrize("draft, target_argmax, expected", [
    ([], [4], (0, 4)),                          # no draft: the target's token
    ([2, 3, 1], [2, 3, 1, 5], (3, 5)),          # all accepted: bonus from the last row
    ([2, 3, 1], [2, 0, 1, 5], (1, 0)),          # first mismatch at slot 2: target's token there
    ([2, 3, 1], [4, 3, 1, 5], (0, 4)),          # mismatch at slot 1, later matches do not count
    ([2, 3, 1], [2, 3, 0, 5], (2, 0)),
    ([5], [5, 2], (1, 2)),
    ([5], [0, 2], (0, 0)),
])
def test_verify_greedy(draft, target_argmax, expected):
    n, nxt = verify_greedy(torch.tensor(draft, dtype=torch.long), _onehot_logits(target_argmax))
    assert (n, nxt) == expected
    assert isinstance(n, int) and isinstance(nxt, int)


def _dist(*p):
    t = torch.tensor(p, dtype=torch.float32)
    return t / t.sum()


def test_verify_sampled_equal_distributions_accept_everything():
    g = torch.Generator().manual_seed(0)
    v, l = 7, 5
    for _ in range(200):
        rows = torch.softmax(torch.randn(l + 1, v, generator=g) * 2, -1)
        draft = torch.multinomial(rows[:l], 1, generator=g).squeeze(-1)
        n, nxt = verify_sampled(draft, rows[:l], rows, g)
        assert n == l
        assert 0 <= nxt < v


def test_verify_sampled_hand_cases():
    g = torch.Generator().manual_seed(0)
    p_d = _dist(0.5, 0.5, 0.0)
    # the target gives the draft token zero probability: always rejected, and the recovered
    # token comes from norm(max(0, p_t - p_d)) = [0, 0, 1]
    p_t = _dist(0.0, 0.4, 0.6)
    for _ in range(50):
        n, nxt = verify_sampled(torch.tensor([0]), p_d[None], torch.stack((p_t, p_t)), g)
        assert (n, nxt) == (0, 2)
    # p_t >= p_d at the drafted token: always accepted, then the bonus from the last row
    bonus_row = torch.tensor([0.0, 1.0, 0.0])
    for _ in range(50):
        n, nxt = verify_sampled(torch.tensor([1]), p_d[None],
                                torch.stack((_dist(0.1, 0.8, 0.1), bonus_row)), g)
        assert (n, nxt) == (1, 1)
    # accepted at slot 1, certain rejection at slot 2, recovered token from row 2's residual
    d_rows = torch.stack((_dist(1, 0, 0), _dist(0, 1, 0)))
    t_rows = torch.stack((_dist(1, 0, 0), _dist(0, 0, 1), _dist(1, 0, 0)))
    for _ in range(20):
        assert verify_sampled(torch.tensor([0, 1]), d_rows, t_rows, g) == (1, 2)


def test_verify_sampled_acceptance_rate():
    """P(accept) = sum_x min(p_d(x), p_t(x)) = 1 - TV."""
    g = torch.Generator().manual_seed(1)
    p_d = _dist(0.6, 0.3, 0.1)
    p_t = _dist(0.2, 0.3, 0.5)
    n_trials = 10000
    draft = torch.multinomial(p_d, n_trials, replacement=True, generator=g)
    acc = sum(verify_sampled(draft[i:i + 1], p_d[None], torch.stack((p_t, p_t)), g)[0]
              for i in range(n_trials))
    expected = 0.2 + 0.3 + 0.1  # = 1 - TV, TV = 0.4
    sd = (expected * (1 - expected) / n_trials) ** 0.5
    assert abs(acc / n_trials - expected) < 5 * sd


def _chi2(counts: np.ndarray, probs: np.ndarray) -> float:
    probs = np.asarray(probs, dtype=np.float64)
    expected = probs / probs.sum() * counts.sum()
    keep = expected >= 5
    obs = np.append(counts[keep], counts[~keep].sum())
    exp = np.append(expected[keep], expected[~keep].sum())
    if exp[-1] == 0:
        obs, exp = obs[:-1], exp[:-1]
    return float(chisquare(obs, exp).pvalue)


def test_first_emitted_token_is_distributed_as_target():
    """Draft x ~ p_d, verify against p_t; the first emitted token (accepted x or the recovered
    token) must be distributed exactly as p_t, for p_d far from p_t."""
    g = torch.Generator().manual_seed(123)
    p_d = _dist(0.30, 0.05, 0.25, 0.02, 0.18, 0.20)
    p_t = _dist(0.05, 0.30, 0.10, 0.25, 0.20, 0.10)
    n_trials = 20000
    draft = torch.multinomial(p_d, n_trials, replacement=True, generator=g)
    rows = torch.stack((p_t, _dist(1, 1, 1, 1, 1, 1)))
    counts = np.zeros(6)
    accepted = 0
    for i in range(n_trials):
        n, nxt = verify_sampled(draft[i:i + 1], p_d[None], rows, g)
        counts[int(draft[i]) if n == 1 else nxt] += 1
        accepted += n
    assert 0.3 * n_trials < accepted < 0.7 * n_trials  # both branches exercised
    assert _chi2(counts, p_t.numpy()) > 1e-3
    # sanity: the same counts are clearly not distributed as p_d
    assert _chi2(counts, p_d.numpy()) < 1e-6


def test_two_slot_rounds_use_the_right_rows():
    """With a context-free target whose rows differ, the token emitted right after an accepted
    first draft (accepted x_2, recovered at slot 2, or the bonus when l = 1) follows that row of
    p_t, and the bonus after two accepted drafts follows the last row."""
    g = torch.Generator().manual_seed(7)
    pd1, pd2 = _dist(0.4, 0.3, 0.2, 0.1), _dist(0.1, 0.1, 0.2, 0.6)
    pt0, pt1, pt2 = _dist(0.3, 0.3, 0.2, 0.2), _dist(0.5, 0.2, 0.2, 0.1), _dist(0.1, 0.2, 0.3, 0.4)
    d_rows, t_rows = torch.stack((pd1, pd2)), torch.stack((pt0, pt1, pt2))
    n_trials = 20000
    x1 = torch.multinomial(pd1, n_trials, replacement=True, generator=g)
    x2 = torch.multinomial(pd2, n_trials, replacement=True, generator=g)
    second, bonus = np.zeros(4), np.zeros(4)
    first = np.zeros(4)
    for i in range(n_trials):
        draft = torch.stack((x1[i], x2[i]))
        n, nxt = verify_sampled(draft, d_rows, t_rows, g)
        emitted = draft[:n].tolist() + [nxt]
        first[emitted[0]] += 1
        if n >= 1:
            second[emitted[1]] += 1
        if n == 2:
            bonus[nxt] += 1
    assert second.sum() > 5000 and bonus.sum() > 2000
    assert _chi2(first, pt0.numpy()) > 1e-3
    assert _chi2(second, pt1.numpy()) > 1e-3
    assert _chi2(bonus, pt2.numpy()) > 1e-3
