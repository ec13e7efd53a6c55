"""95 % intervals on accepted length tau, and the paired comparison of two drafters (issue 42).

The resampling unit is the **prompt**. A prompt's rounds share its context, its answer and the
drafter's state along it, so they are not independent draws; the benchmark's prompts are. A cell
(one dataset at one temperature) has one ``(committed tokens, rounds)`` pair per prompt, counted
over the rounds that verified drafts (the eval's own tau: ``SpecDecodeStats.tau``, committed
tokens per round, bonus included). Its tau is the ratio of the sums, and a bootstrap resample
draws the cell's prompts with replacement and takes that ratio again. The interval is the
percentile interval of the resamples: it covers which prompts the benchmark happened to offer,
not the decoding noise within one prompt (a seed sweep measures that).

Domain and macro taus (mean over a domain's datasets, then over domains: the eval's
``domain_summary``) are resampled by drawing every cell's prompts in the same resample, so each
resample yields one consistent macro tau.

Two drafters evaluated on the same prompts with the same request seeds (``drafter_quality``, an
eval against an earlier one) are compared **paired**: one resample draws the same prompt indices
for both, so the interval of the difference leaves out the prompt-to-prompt spread both share. The
difference "separates" only when that interval excludes 0.
"""

from __future__ import annotations

import warnings

import numpy as np

CONFIDENCE = 0.95
RESAMPLES = 2000
SEED = 0  # a fixed stream: the same report gives the same interval
METHOD = (f"{CONFIDENCE:.0%} percentile bootstrap over prompts ({RESAMPLES} resamples, prompts "
          "drawn with replacement within each dataset; paired: the same draws for both drafters)")


def prompt_counts(rounds_per_prompt: list[list]) -> list[list[int]]:
    """``[[committed tokens, rounds], ...]``, one pair per prompt, over its rounds that verified
    drafts (``RoundRecord.verified > 0``; a round that verified nothing is a plain target step).

    Args:
        rounds_per_prompt: per prompt, its ``serve.engine.core.RoundRecord`` s.
    """
    out = []
    for rounds in rounds_per_prompt:
        drafted = [r for r in rounds if r.verified > 0]
        out.append([sum(r.committed for r in drafted), len(drafted)])
    return out


def _ratio(committed: np.ndarray, rounds: np.ndarray) -> np.ndarray:
    """committed / rounds, NaN where no round verified drafts (an unmeasured tau: the eval's
    ``None``; means over datasets and domains skip it)."""
    return np.divide(committed, rounds, out=np.full(np.shape(committed), np.nan),
                     where=rounds > 0)


def _draws(n: int, rng: np.random.Generator, resamples: int) -> np.ndarray:
    """``[resamples, n]`` int64 prompt indices drawn with replacement."""
    return rng.integers(0, n, size=(resamples, n))


def _resampled_tau(counts: list[list[int]], draws: np.ndarray) -> np.ndarray:
    """``[resamples]`` float64 tau of each resample of a cell's ``counts`` (``[n, 2]``)."""
    arr = np.asarray(counts, dtype=np.float64).reshape(-1, 2)
    picked = arr[draws]  # [resamples, n, 2]
    return _ratio(picked[..., 0].sum(axis=1), picked[..., 1].sum(axis=1))


def _interval(samples: np.ndarray) -> list[float]:
    """The central ``CONFIDENCE`` percentile interval ``[low, high]`` of ``samples``."""
    tail = 100 * (1 - CONFIDENCE) / 2
    low, high = np.nanpercentile(samples, [tail, 100 - tail])
    return [float(low), float(high)]


def _nanmean(arrays: list[np.ndarray]) -> np.ndarray:
    """Element-wise ``np.nanmean`` of ``arrays`` (each float64 ``[resamples]``, or any one shape)
    -> the same shape: NaN (unmeasured) entries skipped, NaN where all are, without numpy's
    "Mean of empty slice" warning for those (an unmeasured domain is expected, not an error)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        return np.nanmean(np.stack(arrays), axis=0)


def tau_interval(counts: list[list[int]], resamples: int = RESAMPLES,
                 seed: int = SEED) -> list[float] | None:
    """95 % bootstrap interval ``[low, high]`` of one cell's tau.

    Args:
        counts: ``prompt_counts`` of the cell (``[n, 2]`` committed tokens, rounds).
    Returns:
        None with fewer than 2 prompts (one prompt has no spread to resample) or no round that
        verified drafts (an unmeasured tau).
    """
    if len(counts) < 2 or not any(rounds for _, rounds in counts):
        return None
    rng = np.random.default_rng(seed)
    return _interval(_resampled_tau(counts, _draws(len(counts), rng, resamples)))


def _macro_samples(cells: dict[str, list[list[int]]], domain_of: dict[str, str],
                   draws: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Per domain and ``"macro"``: ``[resamples]`` taus (mean over the domain's datasets, then
    over domains), every cell resampled by its own ``draws``."""
    by_domain: dict[str, list[np.ndarray]] = {}
    for name, counts in cells.items():
        by_domain.setdefault(domain_of[name], []).append(_resampled_tau(counts, draws[name]))
    out = {d: _nanmean(v) for d, v in by_domain.items()}  # unmeasured cells and domains skipped
    if out:
        out["macro"] = _nanmean(list(out.values()))
    return out


def _cell_draws(cells: dict[str, list[list[int]]], rng: np.random.Generator,
                resamples: int) -> dict[str, np.ndarray]:
    return {name: _draws(len(counts), rng, resamples) for name, counts in cells.items()}


def domain_intervals(cells: dict[str, list[list[int]]], domain_of: dict[str, str],
                     resamples: int = RESAMPLES, seed: int = SEED) -> dict[str, list[float] | None]:
    """95 % bootstrap intervals of the per-domain and macro tau.

    Args:
        cells: dataset -> ``prompt_counts`` at one temperature.
        domain_of: dataset -> domain (``pipeline.evaluate.DOMAINS``).
    Returns:
        ``{domain: [low, high], "macro": [low, high]}``; None for a domain whose datasets hold
        fewer than 2 prompts in all (nothing to resample) or where no round drafted.
    """
    cells = {n: c for n, c in cells.items() if c}
    if not cells:
        return {}
    samples = _macro_samples(cells, domain_of,
                             _cell_draws(cells, np.random.default_rng(seed), resamples))
    sizes: dict[str, int] = {}
    for name, counts in cells.items():
        sizes[domain_of[name]] = sizes.get(domain_of[name], 0) + len(counts)
    sizes["macro"] = sum(len(c) for c in cells.values())
    return {d: _interval(s) if sizes[d] >= 2 and not np.isnan(s).all() else None
            for d, s in samples.items()}


def paired_difference(a: dict[str, list[list[int]]], b: dict[str, list[list[int]]],
                      domain_of: dict[str, str], resamples: int = RESAMPLES,
                      seed: int = SEED) -> dict:
    """Macro tau of drafter ``a`` against drafter ``b`` on the same prompts, paired.

    Args:
        a, b: dataset -> ``prompt_counts`` at one temperature, the prompts in the same order
            (the eval draws them with a fixed seed).
        domain_of: dataset -> domain.
    Returns:
        ``{"macro_a", "macro_b", "difference", "difference_interval", "ratio", "ratio_interval",
        "half_width", "relative_half_width", "separates", "unmeasured_datasets"}``:
        ``difference`` = macro_a - macro_b, its paired 95 % interval, ``ratio`` = macro_a /
        macro_b with its interval, the difference's half-width absolute and relative to
        ``macro_b`` (the smallest relative change this eval resolves, roughly), whether the
        difference's interval excludes 0, and the datasets left out of both macros because one
        drafter drafted in no round there.
    Raises:
        ValueError: the two evals did not decode the same datasets with the same prompt counts
            (a paired comparison would pair unrelated prompts), or no dataset is measured in both.
    """
    a = {n: c for n, c in a.items() if c}
    b = {n: c for n, c in b.items() if c}
    if set(a) != set(b) or any(len(a[n]) != len(b[n]) for n in a):
        raise ValueError("paired comparison needs the same prompts in both evals: datasets "
                         f"{sorted(a)} with {[len(c) for c in a.values()]} prompts against "
                         f"{sorted(b)} with {[len(c) for c in b.values()]}")
    # a dataset where either drafter drafted in no round has no tau on that side: both macros
    # are taken over the datasets measured in both, or they would average different domains
    unmeasured = sorted(n for n in a if not any(r for _, r in a[n]) or not any(r for _, r in b[n]))
    a = {n: c for n, c in a.items() if n not in unmeasured}
    b = {n: c for n, c in b.items() if n not in unmeasured}
    if not a:
        raise ValueError(f"paired comparison: no dataset where both drafters drafted "
                         f"(unmeasured: {unmeasured})")
    draws = _cell_draws(a, np.random.default_rng(seed), resamples)
    macro_a = _macro_samples(a, domain_of, draws)["macro"]
    macro_b = _macro_samples(b, domain_of, draws)["macro"]
    no_draw = {n: np.arange(len(c))[None, :] for n, c in a.items()}  # the point estimate
    point_a = float(_macro_samples(a, domain_of, no_draw)["macro"][0])
    point_b = float(_macro_samples(b, domain_of, no_draw)["macro"][0])
    diff = _interval(macro_a - macro_b)
    ratio = _interval(_ratio(macro_a, macro_b))
    half = (diff[1] - diff[0]) / 2
    return {"macro_a": point_a, "macro_b": point_b, "difference": point_a - point_b,
            "unmeasured_datasets": unmeasured,
            "difference_interval": diff,
            "ratio": point_a / point_b if point_b else None, "ratio_interval": ratio,
            "half_width": half, "relative_half_width": half / point_b if point_b else None,
            "separates": diff[0] > 0 or diff[1] < 0}


def format_interval(value: float | None, interval: list[float] | None, digits: int = 2) -> str:
    """``"1.69 [1.52, 1.85]"`` (just the value without an interval; ``"-"`` for an unmeasured
    value, None)."""
    if value is None:
        return "-"
    if interval is None:
        return f"{value:.{digits}f}"
    return f"{value:.{digits}f} [{interval[0]:.{digits}f}, {interval[1]:.{digits}f}]"
