"""Calibration of the drafter's confidence head: Sequential Temperature Scaling and its metrics.

The confidence head emits a raw logit z_k per draft position k; sigma(z_k) estimates the
conditional acceptance c_k = P(token k accepted | tokens < k accepted), and the scheduler ranks
draft tokens by the prefix survival a_k = prod_{i<=k} c_i (SPEC 0, 6). Calibration fits one
temperature T_k per position so that a_k matches the empirical rate of "positions 1..k were all
accepted" (DSpark paper section 3.2.1; SPEC 4).

Shapes: N verification rounds, K = gamma draft positions. Every function accepts numpy arrays or
torch tensors (any float/int dtype) and computes in float64 numpy; array outputs are numpy.

Source: DSpark paper section 3.2.1 and Figures 5-6; SPEC sections 4 and 5.
"""

from __future__ import annotations

import logging
import math

import numpy as np
import torch

logger = logging.getLogger(__name__)

DEFAULT_NUM_BINS = 20  # SPEC 4: ECE over 20 equal-width bins
# STS: the fewest accepted blocks that fit a position's temperature (the same floor as the
# calibrate stage's min_rounds per half; below it the ECE minimum is noise)
DEFAULT_MIN_POSITIVES = 20


def default_temperature_grid() -> np.ndarray:
    """Candidate temperatures for the grid search: float64 [201], 200 geometric points over
    [0.05, 20] plus exactly 1.0 (so "leave this position alone" is always a candidate)."""
    return np.union1d(np.geomspace(0.05, 20.0, 200), [1.0])


def _to_numpy(x, name: str, ndim: int) -> np.ndarray:
    """Boundary conversion: tensor or array-like -> float64 ndarray with `ndim` dims."""
    if isinstance(x, torch.Tensor):
        x = x.detach().to("cpu", torch.float64).numpy()
    arr = np.asarray(x, dtype=np.float64)
    if arr.ndim != ndim:
        raise ValueError(f"{name} must be {ndim}-D, got shape {arr.shape}")
    return arr


def _check_pair(probs, labels, pname: str) -> tuple[np.ndarray, np.ndarray]:
    """Validate a (scores, binary labels) pair of equal non-zero length."""
    p = _to_numpy(probs, pname, 1)
    y = _to_numpy(labels, "labels", 1)
    if p.shape[0] != y.shape[0]:
        raise ValueError(f"{pname} and labels differ in length: {p.shape[0]} vs {y.shape[0]}")
    if p.shape[0] == 0:
        raise ValueError(f"{pname} and labels are empty")
    if not np.all(np.isfinite(p)):
        raise ValueError(f"{pname} contains NaN or inf")
    if not np.all((y == 0) | (y == 1)):
        raise ValueError("labels must be 0 or 1")
    return p, y


def _check_probs(p: np.ndarray, name: str = "probs") -> None:
    if p.min() < 0.0 or p.max() > 1.0:
        raise ValueError(f"{name} must lie in [0, 1], got range [{p.min():.4g}, {p.max():.4g}]")


def _bin_index(probs: np.ndarray, num_bins: int) -> np.ndarray:
    """Equal-width bin of each probability; p = 1.0 goes to the last bin, not a bin of its own."""
    return np.minimum((probs * num_bins).astype(np.int64), num_bins - 1)


def reliability_bins(probs, labels, num_bins: int = DEFAULT_NUM_BINS) -> dict[str, np.ndarray]:
    """Per-bin statistics of a reliability diagram (equal-width bins over [0, 1]).

    Args:
        probs: [N] float, predicted probabilities in [0, 1].
        labels: [N] 0/1, outcomes.
        num_bins: number of equal-width bins; bin b covers [b/M, (b+1)/M), the last one includes 1.
    Returns:
        dict of float64 [num_bins] arrays: ``count`` (samples per bin), ``mean_prob`` and
        ``mean_label`` (NaN for empty bins), ``lower``/``upper`` (bin edges).
    Raises:
        ValueError: lengths differ, input empty, probs outside [0, 1], labels not 0/1,
            num_bins < 1.
    Source: standard reliability diagram; DSpark paper Figure 6.
    """
    if num_bins < 1:
        raise ValueError(f"num_bins must be >= 1, got {num_bins}")
    p, y = _check_pair(probs, labels, "probs")
    _check_probs(p)
    b = _bin_index(p, num_bins)
    count = np.bincount(b, minlength=num_bins).astype(np.float64)
    with np.errstate(invalid="ignore", divide="ignore"):
        mean_prob = np.bincount(b, weights=p, minlength=num_bins) / count
        mean_label = np.bincount(b, weights=y, minlength=num_bins) / count
    edges = np.linspace(0.0, 1.0, num_bins + 1)
    return {"count": count, "mean_prob": mean_prob, "mean_label": mean_label,
            "lower": edges[:-1], "upper": edges[1:]}


def expected_calibration_error(probs, labels, num_bins: int = DEFAULT_NUM_BINS) -> float:
    """ECE = sum_b (n_b / N) |mean(label_b) - mean(prob_b)| over equal-width bins of [0, 1].

    Args:
        probs: [N] float, predicted probabilities in [0, 1].
        labels: [N] 0/1, outcomes.
        num_bins: number of equal-width bins (SPEC 4 uses 20).
    Returns:
        ECE as a python float in [0, 1].
    Raises:
        ValueError: lengths differ, input empty, probs outside [0, 1], labels not 0/1.
    Source: SPEC 4 (20 equal-width bins); DSpark paper section 3.2.1.
    """
    bins = reliability_bins(probs, labels, num_bins)
    filled = bins["count"] > 0
    gap = np.abs(bins["mean_label"][filled] - bins["mean_prob"][filled])
    return float(np.sum(bins["count"][filled] * gap) / bins["count"].sum())


def _ece_grid(probs: np.ndarray, labels: np.ndarray, num_bins: int) -> np.ndarray:
    """ECE of G candidate probability vectors at once: probs [G, N] -> [G].

    Same definition as `expected_calibration_error`, vectorised for the grid search: one bincount
    over (candidate, bin) pairs instead of G Python-level calls."""
    g, n = probs.shape
    idx = (np.arange(g)[:, None] * num_bins + _bin_index(probs, num_bins)).ravel()  # [G*N]
    size = g * num_bins
    sum_p = np.bincount(idx, weights=probs.ravel(), minlength=size)
    sum_y = np.bincount(idx, weights=np.broadcast_to(labels, (g, n)).ravel(), minlength=size)
    # n_b/N * |sum_y/n_b - sum_p/n_b| = |sum_y - sum_p| / N: no division by empty bins needed.
    return np.abs(sum_y - sum_p).reshape(g, num_bins).sum(axis=1) / n


def auroc(scores, labels) -> float:
    """Area under the ROC curve from ranks (Mann-Whitney U), ties counted as half.

    AUROC = (sum of positive ranks - n1 (n1 + 1) / 2) / (n1 n0), with tied scores given their
    average rank, which equals P(score_pos > score_neg) + 0.5 P(score_pos = score_neg).

    Args:
        scores: [N] float, any real scores (higher means "more likely positive").
        labels: [N] 0/1.
    Returns:
        AUROC as a python float, or NaN when only one class is present.
    Raises:
        ValueError: lengths differ, input empty, NaN/inf scores, labels not 0/1.
    Source: SPEC 4 (AUROC per position); DSpark paper section 3.2.1.
    """
    s, y = _check_pair(scores, labels, "scores")
    n1 = float(y.sum())
    n0 = float(y.shape[0] - n1)
    if n1 == 0 or n0 == 0:
        return math.nan
    uniq, inverse, counts = np.unique(s, return_inverse=True, return_counts=True)
    # 1-based average rank of each tie group: its last rank minus half its extra members.
    avg_rank = np.cumsum(counts) - (counts - 1) / 2.0
    rank_sum_pos = float(np.sum(avg_rank[inverse.ravel()] * y))
    return (rank_sum_pos - n1 * (n1 + 1) / 2.0) / (n1 * n0)


def brier_score(probs, labels) -> float:
    """Brier score: mean (prob - label)^2.

    Args:
        probs: [N] float in [0, 1].
        labels: [N] 0/1.
    Returns:
        python float in [0, 1].
    Raises:
        ValueError: lengths differ, input empty, probs outside [0, 1], labels not 0/1.
    Source: SPEC 4.
    """
    p, y = _check_pair(probs, labels, "probs")
    _check_probs(p)
    return float(np.mean((p - y) ** 2))


def _check_accepted(accepted, gamma: int) -> np.ndarray:
    a = _to_numpy(accepted, "accepted", 1)
    if gamma < 1:
        raise ValueError(f"gamma must be >= 1, got {gamma}")
    if a.shape[0] == 0:
        raise ValueError("accepted is empty")
    if not np.all(a == np.round(a)) or a.min() < 0 or a.max() > gamma:
        raise ValueError(f"accepted must hold integers in [0, {gamma}], "
                         f"got range [{a.min():.4g}, {a.max():.4g}]")
    return a.astype(np.int64)


def survival_labels(accepted, gamma: int) -> np.ndarray:
    """Prefix-survival labels: label[n, k-1] = 1 iff accepted[n] >= k (positions 1..k accepted).

    Args:
        accepted: [N] int, accepted draft tokens per round (bonus token excluded), from rounds that
            verified the full block of gamma tokens (a shorter verified block says nothing about
            the unverified positions).
        gamma: block size K.
    Returns:
        float64 [N, K] of 0/1.
    Raises:
        ValueError: accepted not 1-D, empty, non-integer or outside [0, gamma]; gamma < 1.
    Source: SPEC 4 (label "positions 1..k were all accepted"); SPEC 5 accept_rate@k.
    """
    a = _check_accepted(accepted, gamma)
    k = np.arange(1, gamma + 1)
    return (a[:, None] >= k[None, :]).astype(np.float64)  # [N, K]


def _check_logits(conf_logits) -> np.ndarray:
    z = _to_numpy(conf_logits, "conf_logits", 2)
    if z.shape[0] == 0 or z.shape[1] == 0:
        raise ValueError(f"conf_logits is empty: shape {z.shape}")
    if not np.all(np.isfinite(z)):
        raise ValueError("conf_logits contains NaN or inf")
    return z


def _sigmoid(x: np.ndarray) -> np.ndarray:
    # Branch-free stable form: exp never sees a large positive argument.
    e = np.exp(-np.abs(x))
    return np.where(x >= 0, 1.0 / (1.0 + e), e / (1.0 + e))


def cumulative_survival(conf_logits, temperatures) -> np.ndarray:
    """Calibrated prefix survival a_k = prod_{i<=k} sigmoid(z_i / T_i).

    Args:
        conf_logits: [N, K] float, raw confidence logits z of the drafter's head.
        temperatures: [K] positive floats T_1..T_K (all 1.0 = uncalibrated).
    Returns:
        float64 [N, K], non-increasing along K.
    Raises:
        ValueError: shapes disagree, non-finite logits, or a temperature <= 0.
    Source: SPEC 0 (a_j) and 4; DSpark paper section 3.2.1.
    """
    z = _check_logits(conf_logits)
    t = _to_numpy(temperatures, "temperatures", 1)
    if t.shape[0] != z.shape[1]:
        raise ValueError(f"need {z.shape[1]} temperatures (one per position), got {t.shape[0]}")
    if not np.all(np.isfinite(t)) or t.min() <= 0:
        raise ValueError(f"temperatures must be finite and > 0, got {t.tolist()}")
    return np.cumprod(_sigmoid(z / t[None, :]), axis=1)  # [N, K]


def sequential_temperature_scaling(conf_logits, accepted, grid=None,
                                   num_bins: int = DEFAULT_NUM_BINS,
                                   min_positives: int = DEFAULT_MIN_POSITIVES) -> list[float]:
    """Fit per-position temperatures T_1..T_K by Sequential Temperature Scaling (STS).

    For k = 1..K in order, with T_<k fixed at their chosen values, pick the T_k from `grid` that
    minimises the ECE of a_k = prod_{i<k} sigmoid(z_i / T_i) * sigmoid(z_k / T_k) against the label
    "positions 1..k were all accepted". Fitting the product rather than c_k alone calibrates the
    quantity the scheduler consumes, and only rounds that reached position k carry a signal about
    T_k, which the product weights in automatically. Ties in ECE go to the temperature closest to
    1 (in log space), so a position with no signal stays uncalibrated. A position whose label is
    positive in fewer than ``min_positives`` rounds keeps T_k = 1: a handful of accepted blocks
    cannot pin a temperature, and the ECE minimum then sits wherever the noise puts it (measured
    on the reference drafter: ~5 positives at position 6 of 1,787 rounds drove T_6 to the grid's
    upper end, 20, and the report half's ECE there from 0.001 to 0.002).

    Args:
        conf_logits: [N, K] float, raw confidence logits of held-out full-block rounds.
        accepted: [N] int, accepted draft tokens per round, in [0, K] (bonus excluded).
        grid: 1-D positive candidate temperatures; default `default_temperature_grid()`
            (geometric 0.05..20, 200 points, plus 1.0).
        num_bins: ECE bins (SPEC 4: 20).
        min_positives: fewest rounds with positions 1..k all accepted for T_k to be fitted
            (0: fit every position).
    Returns:
        K python floats, the chosen temperatures.
    Raises:
        ValueError: shape mismatch between conf_logits and accepted, accepted outside [0, K],
            non-finite logits, an empty/non-positive grid, num_bins < 1 or min_positives < 0.
    Source: DSpark paper section 3.2.1 (Sequential Temperature Scaling); SPEC 4.
    """
    z = _check_logits(conf_logits)
    n, gamma = z.shape
    a = _check_accepted(accepted, gamma)
    if a.shape[0] != n:
        raise ValueError(f"conf_logits has {n} rounds but accepted has {a.shape[0]}")
    grid = default_temperature_grid() if grid is None else _to_numpy(grid, "grid", 1)
    if grid.shape[0] == 0 or not np.all(np.isfinite(grid)) or grid.min() <= 0:
        raise ValueError("grid must be a non-empty 1-D array of finite temperatures > 0")
    if num_bins < 1:
        raise ValueError(f"num_bins must be >= 1, got {num_bins}")
    if min_positives < 0:
        raise ValueError(f"min_positives must be >= 0, got {min_positives}")
    labels = survival_labels(a, gamma)  # [N, K]

    temperatures: list[float] = []
    prefix = np.ones(n)  # [N], prod_{i<k} sigmoid(z_i / T_i) with the chosen T_<k
    for k in range(gamma):
        if labels[:, k].sum() < min_positives:  # too few accepted blocks to fit: identity
            temperatures.append(1.0)
            prefix = prefix * _sigmoid(z[:, k])
            logger.debug("STS position %d: %d positives < %d, T=1", k + 1,
                         int(labels[:, k].sum()), min_positives)
            continue
        cand = prefix[None, :] * _sigmoid(z[None, :, k] / grid[:, None])  # [G, N]
        ece = _ece_grid(cand, labels[:, k], num_bins)  # [G]
        near_best = np.flatnonzero(ece <= ece.min() + 1e-12)
        best = near_best[np.argmin(np.abs(np.log(grid[near_best])))]
        temperatures.append(float(grid[best]))
        prefix = cand[best]
        logger.debug("STS position %d: T=%.4g ECE=%.4g", k + 1, grid[best], ece[best])
    return temperatures


def _nan_to_none(x: float) -> float | None:
    return None if math.isnan(x) else x


def _mean_skip_nan(values: list[float]) -> float | None:
    """Mean over the non-NaN values; None when there are none (strict JSON has no NaN)."""
    kept = [v for v in values if not math.isnan(v)]
    return float(np.mean(kept)) if kept else None


def calibration_report(conf_logits, accepted, temperatures,
                       num_bins: int = DEFAULT_NUM_BINS) -> dict:
    """Per-position calibration metrics of the prefix survival a_k before and after STS.

    "Before" uses T = 1 everywhere, "after" the given temperatures. Scaling keeps the order of
    a_1 (a monotone map of z_1), so AUROC at position 1 cannot change; for k > 1 the product mixes
    positions with different temperatures and may reorder rounds, hence both AUROCs are reported.

    Args:
        conf_logits: [N, K] float, raw confidence logits of held-out full-block rounds.
        accepted: [N] int in [0, K], accepted draft tokens per round (bonus excluded).
        temperatures: [K] positive floats, e.g. from `sequential_temperature_scaling`.
        num_bins: ECE bins (SPEC 4: 20).
    Returns:
        JSON-serialisable dict: ``num_rounds``, ``num_bins``, ``temperatures``, ``positions`` (one
        dict per k with ``position``, ``num_rounds``, ``positive_rate``, ``ece_before``,
        ``ece_after``, ``auroc_before``, ``auroc_after``, ``brier_before``, ``brier_after``) and
        ``mean`` (the same metrics averaged over positions). AUROC is ``None`` where a position
        has only one class; the mean AUROC skips those positions.
    Raises:
        ValueError: as `cumulative_survival` and `survival_labels`, or N mismatch.
    Source: SPEC 4 (ECE before/after, AUROC, Brier); DSpark paper section 3.2.1.
    """
    z = _check_logits(conf_logits)
    n, gamma = z.shape
    labels = survival_labels(accepted, gamma)
    if labels.shape[0] != n:
        raise ValueError(f"conf_logits has {n} rounds but accepted has {labels.shape[0]}")
    before = cumulative_survival(z, np.ones(gamma))
    after = cumulative_survival(z, temperatures)

    rows = []
    for k in range(gamma):
        y = labels[:, k]
        rows.append({
            "position": k + 1,
            "num_rounds": n,
            "positive_rate": float(y.mean()),
            "ece_before": expected_calibration_error(before[:, k], y, num_bins),
            "ece_after": expected_calibration_error(after[:, k], y, num_bins),
            "auroc_before": auroc(before[:, k], y),
            "auroc_after": auroc(after[:, k], y),
            "brier_before": brier_score(before[:, k], y),
            "brier_after": brier_score(after[:, k], y),
        })
    metric_keys = [key for key in rows[0] if key not in ("position", "num_rounds")]
    mean = {key: _mean_skip_nan([r[key] for r in rows]) for key in metric_keys}
    for r in rows:  # strict JSON has no NaN
        r["auroc_before"] = _nan_to_none(r["auroc_before"])
        r["auroc_after"] = _nan_to_none(r["auroc_after"])
    return {"num_rounds": n, "num_bins": num_bins,
            "temperatures": [float(t) for t in _to_numpy(temperatures, "temperatures", 1)],
            "positions": rows, "mean": mean}


def static_threshold_sweep(survival, accepted, thresholds) -> list[dict]:
    """Offline simulation of a static confidence threshold on full-block rounds.

    For round n the threshold policy verifies the l_n leading drafts with a_{n,k} >= threshold
    (the prefix is cut at the first position below it). Acceptance of draft k depends only on
    tokens <= k, so the round's outcome under the shorter verification is exact:
    accepted' = min(accepted_n, l_n), committed = accepted' + 1 (bonus or corrected token),
    rejected = l_n - accepted' (every verified draft that is not committed: the first rejected
    one and the drafts after it, i.e. wasted verification slots).

    Args:
        survival: [N, K] float in [0, 1], prefix survival a_k (e.g. from `cumulative_survival`).
        accepted: [N] int in [0, K], accepted drafts when all K were verified (bonus excluded).
        thresholds: iterable of floats.
    Returns:
        One dict per threshold, in the given order, with per-round means ``committed_per_step``,
        ``accepted_per_step``, ``rejected_per_step``, ``verified_per_step`` and
        ``acceptance_rate`` = accepted / verified drafts (0.0 when nothing was verified), plus
        ``threshold``. All python floats.
    Raises:
        ValueError: shape mismatch, survival outside [0, 1], accepted outside [0, K].
    Source: DSpark paper Figure 5 (static threshold baseline); SPEC 6 baselines.
    """
    s = _to_numpy(survival, "survival", 2)
    n, gamma = s.shape
    if n == 0 or gamma == 0:
        raise ValueError(f"survival is empty: shape {s.shape}")
    _check_probs(s, "survival")
    a = _check_accepted(accepted, gamma)
    if a.shape[0] != n:
        raise ValueError(f"survival has {n} rounds but accepted has {a.shape[0]}")

    out = []
    for thr in thresholds:
        # Leading run of passing positions: cumprod of the pass mask stops at the first failure.
        verified = np.cumprod(s >= thr, axis=1).sum(axis=1)  # [N]
        acc = np.minimum(a, verified)  # [N]
        total_verified = float(verified.sum())
        out.append({
            "threshold": float(thr),
            "committed_per_step": float(np.mean(acc + 1)),
            "accepted_per_step": float(np.mean(acc)),
            "rejected_per_step": float(np.mean(verified - acc)),
            "verified_per_step": float(np.mean(verified)),
            "acceptance_rate": float(acc.sum()) / total_verified if total_verified else 0.0,
        })
    return out
