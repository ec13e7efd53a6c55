"""Bootstrap intervals for ``benchmarks/serve_load.py``'s frontier (issue 43).

A frontier point is decided by a point's 5th-percentile request landing on one side of the SLA
and by a throughput that drifts with the machine between repeats, so a ratio read off the means
says little alone. Here each statistic of the runs is recomputed on resampled runs: the repeats
are drawn with replacement, the same draw for every policy and concurrency (the policies of one
repeat at one concurrency ran back to back, on the machine as it was then: paired), and within each drawn run its
requests' per-user speeds are drawn with replacement (the p5 a point's SLA test reads). The
interval is the percentile interval of the statistic over the draws.

Limits: with R repeats there are few distinct repeat draws (R = 2: the interval is about the span
of the two repeats' own ratios), so serve_load claims an interval only from
:data:`MIN_REPEATS` repeats on; and a resampled slowest request can never be slower than the
measured one, so intervals are claimed only for a quantile SLA test (``--sla-quantile`` > 0).
"""

from __future__ import annotations

import random
from collections.abc import Callable, Hashable

#: the fewest repeats an interval is claimed from (see the module docstring)
MIN_REPEATS = 5

METHOD = ("95 % percentile bootstrap (repeats drawn with replacement, the same draw for every "
          "policy and concurrency: paired; each drawn run's requests drawn with replacement)")


def resample_runs(runs: list[dict], rng: random.Random) -> list[dict]:
    """One bootstrap draw of ``runs`` (serve_load's measured points, each with ``repeat``,
    ``per_user_speeds`` in tokens/s and ``per_user_tok_s_min``).

    Returns:
        runs of the drawn repeats, renumbered 0..R-1 in draw order, each with its requests'
        speeds resampled and its slowest request recomputed (a stored ``sla_speed_tok_s``
        dropped: it described the measured requests); the other fields as measured.
    """
    repeats = sorted({r["repeat"] for r in runs})
    drawn = [rng.choice(repeats) for _ in repeats]
    out = []
    for slot, k in enumerate(drawn):
        for r in runs:
            if r["repeat"] != k:
                continue
            speeds = r.get("per_user_speeds") or []
            again = [rng.choice(speeds) for _ in speeds]
            drawn_run = {**r, "repeat": slot, "per_user_speeds": again,
                         "per_user_tok_s_min": min(again) if again else r["per_user_tok_s_min"]}
            drawn_run.pop("sla_speed_tok_s", None)
            out.append(drawn_run)
    return out


def bootstrap_intervals(runs: list[dict],
                        statistic: Callable[[list[dict]], dict[Hashable, float | None]],
                        draws: int = 1000, seed: int = 0, level: float = 0.95
                        ) -> dict[Hashable, tuple[float, float] | None]:
    """Percentile intervals of ``statistic`` over bootstrap draws of ``runs``
    (:func:`resample_runs`).

    Args:
        runs: serve_load's measured points (at least 2 repeats for an interval to mean anything).
        statistic: runs -> {key: value, or None where the draw has none (e.g. no point held the
            SLA)}; the keys of the measured runs' statistic are the ones reported.
        draws: bootstrap draws; seed: the draws' seed (the same runs give the same intervals).
        level: the interval's coverage.
    Returns:
        {key: (low, high)}, or None for a key that no draw gave a value.
    Raises:
        ValueError: ``draws`` < 1 or ``level`` outside (0, 1).
    """
    if draws < 1 or not 0.0 < level < 1.0:
        raise ValueError(f"draws must be >= 1 and level in (0, 1), got {draws} and {level}")
    rng = random.Random(seed)
    keys = list(statistic(runs))
    values: dict[Hashable, list[float]] = {k: [] for k in keys}
    for _ in range(draws):
        got = statistic(resample_runs(runs, rng))
        for k in keys:
            if got.get(k) is not None:
                values[k].append(got[k])
    tail = (1.0 - level) / 2
    out: dict[Hashable, tuple[float, float] | None] = {}
    for k, vs in values.items():
        if not vs:
            out[k] = None
            continue
        vs.sort()
        cut = int(tail * len(vs))  # as many draws left out below as above
        out[k] = (vs[cut], vs[len(vs) - 1 - cut])
    return out


def verdict(interval: tuple[float, float] | None) -> str:
    """How a ratio's interval reads against 1: "above" (its low end, the 2.5th percentile of the
    draws, > 1), "below" (its high end < 1), "tie" (it holds 1), "n/a" (no interval)."""
    if interval is None:
        return "n/a"
    lo, hi = interval
    return "above" if lo > 1.0 else "below" if hi < 1.0 else "tie"
