"""The profiles checked against the engine's own steps (issue 41).

The goodput planner decides whether drafting pays from two profiles measured once per machine and
stored beside the drafter: the drafter's cost per call (``DraftCostTable``) and the target's
steps per second (``SPSTable``). A profile measured while the machine was loaded overstates the
drafter's cost, and a planner that believes it drafts only in its rare probes: measured on an
AVX2 machine, a draft round stored at 53-110 ms against 11-16 ms quiet kept drafting to 3 % of
the steps in every later run. So the engine times what it actually does: each drafting step's
drafter time and each step's target pass against what the profile predicted for that very call.
When the median ratio of the last :data:`WINDOW` observations (after the first :data:`WINDOW`,
whose new shapes are slow) leaves [1 / :data:`TOLERANCE`, :data:`TOLERANCE`], or the last
:data:`UNANIMOUS` calls all ran faster than 1 / :data:`TOLERANCE` of the prediction (a
pessimistic profile: the case that switches drafting off), the table is rescaled by that ratio (a re-measurement from the engine's own
steps, at no extra cost), the stored file is marked for re-profiling at the next start, and the
log says so. Probes keep drafting while the planner believes drafting does not pay, so a
pessimistic draft-cost profile is corrected even when it had switched drafting off.
"""

from __future__ import annotations

import logging
import math
import statistics
from collections import deque

logger = logging.getLogger(__name__)

WINDOW = 16  # observations per verdict: enough that one slow step (a GC, a page fault) is outvoted
TOLERANCE = 2.0  # a profile within 2x of the measured steps is kept as it is
# this many consecutive calls all beyond the tolerance on one side decide at once: a draft-cost
# profile that switched drafting off leaves only the planner's rare probes to observe
UNANIMOUS = 4  # (only for calls faster than the profile: see CostCheck.observe)


class CostCheck:
    """Running comparison of measured against predicted seconds for one profile.

    Args:
        name: the profile's name in log messages ("draft cost", "SPS(B)").
        window: observations per verdict.
        tolerance: the ratio (either way) beyond which the profile is corrected, > 1.
    Raises:
        ValueError: window < 1 or tolerance <= 1.
    """

    def __init__(self, name: str, window: int = WINDOW, tolerance: float = TOLERANCE):
        if window < 1 or not tolerance > 1:
            raise ValueError(f"window must be >= 1 and tolerance > 1, got {window}, {tolerance}")
        self.name, self.window, self.tolerance = name, window, tolerance
        self.ratios: deque[float] = deque(maxlen=window)
        self.seen = 0  # observations so far
        self.warmup = window  # the first calls never make a "slower" verdict
        self.corrections: list[float] = []  # every factor applied, in order

    def observe(self, predicted_s: float, measured_s: float) -> float | None:
        """Record one call: its predicted and measured seconds (ignored unless both are finite
        and positive).

        Returns:
            the factor (measured / predicted: the median of the window, or of the last
            :data:`UNANIMOUS` when they all ran faster than 1 / tolerance of the prediction) to
            scale the profile's seconds by when it is outside the tolerance, else None. Calls
            slower than predicted decide only on a full window after the first ``window``
            observations. After a
            correction the window starts again (the next verdict reads the corrected profile).
        """
        if not (math.isfinite(predicted_s) and math.isfinite(measured_s)
                and predicted_s > 0 and measured_s > 0):
            return None
        self.ratios.append(measured_s / predicted_s)
        self.seen += 1
        recent = list(self.ratios)[-UNANIMOUS:]
        # faster than the profile, call after call: the profile is pessimistic (a transient
        # never makes calls faster), and it may be what keeps the drafter off: decide at once
        unanimous = len(recent) == UNANIMOUS and all(r < 1 / self.tolerance for r in recent)
        # slower: decide on a full window after the warm-up (an engine's first calls of each new
        # shape, and a neighbour's burst, are slow for a while without the profile being wrong)
        if not unanimous and self.seen <= self.warmup:
            if self.seen == self.warmup:
                self.ratios.clear()  # the warm-up's calls never count towards a verdict
            return None
        if not unanimous and len(self.ratios) < self.window:
            return None
        used = recent if unanimous else list(self.ratios)
        factor = statistics.median(used)
        if 1 / self.tolerance <= factor <= self.tolerance:
            return None
        self.ratios.clear()
        self.corrections.append(factor)
        logger.warning("the %s profile disagrees with this engine's own steps (measured %.2fx "
                       "its prediction over the last %d calls): rescaled, and marked to be "
                       "profiled again at the next start", self.name, factor, len(used))
        return factor
