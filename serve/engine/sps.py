"""The hardware profile the goodput schedulers read: SPS(B), target engine steps per second at a
verification batch of B tokens (DSpark paper section 3.2.2; SPEC 6). Measured by
``serve/engine/profiling.py``, read by ``serve/engine/scheduler.py`` and ``serve/engine/draft_planner.py``.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True, slots=True)
class SPSTable:
    """Profiled SPS(B): target engine steps per second at a verification batch of B tokens.

    Profiled once at engine start-up over the batch sizes the engine can run (SPEC 6) and looked
    up in O(1) by the schedulers. Jagged curves (SPS rising again after a dip, e.g. from kernel
    tile sizes) are allowed.

    Args:
        sps_by_batch: SPS(1), SPS(2), ..., SPS(max_tokens) in steps/s; entry i is batch size i + 1.
            Any sequence of numbers; stored as a tuple of floats.
    Raises:
        ValueError: the table is empty or holds a value that is not finite and positive.
    Source: DSpark paper section 3.2.2 (hardware profile SPS(B)); SPEC 6.
    """

    sps_by_batch: tuple[float, ...]
    # for a table made by :meth:`padded`: entry i is the pass length (tokens) a verification of
    # i + 1 tokens is filled to; empty for a measured table (every pass runs as scheduled)
    fill_to: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        values = tuple(float(v) for v in self.sps_by_batch)
        if not values:
            raise ValueError("SPSTable needs SPS(B) for at least B = 1, got an empty table")
        for b, v in enumerate(values, start=1):
            if not (math.isfinite(v) and v > 0):
                raise ValueError(f"SPS({b}) must be a finite positive steps/s value, got {v}")
        object.__setattr__(self, "sps_by_batch", values)
        fill_to = tuple(operator.index(t) for t in self.fill_to)
        if fill_to and (len(fill_to) != len(values)
                        or any(not b <= t <= len(values) for b, t in enumerate(fill_to, 1))):
            raise ValueError(f"fill_to must give, for every B in [1, {len(values)}], a pass "
                             f"length in [B, {len(values)}], got {fill_to}")
        object.__setattr__(self, "fill_to", fill_to)

    @property
    def max_tokens(self) -> int:
        """Largest verification batch (tokens) the table covers."""
        return len(self.sps_by_batch)

    def sps(self, b: int) -> float:
        """SPS(b) in steps/s, O(1).

        Args:
            b: verification batch size in tokens, 1 <= b <= max_tokens.
        Raises:
            ValueError: b is outside the table.
        """
        b = operator.index(b)
        if not 1 <= b <= len(self.sps_by_batch):
            raise ValueError(f"batch size b={b} is outside the SPS table range "
                             f"[1, {len(self.sps_by_batch)}] tokens")
        return self.sps_by_batch[b - 1]

    def pass_seconds(self, batch: float) -> float:
        """Seconds of a target pass of ``batch`` tokens: 1 / SPS(B) within the table, growing in
        proportion to the batch beyond its largest B (compute-bound there); B rounded, at least 1.
        """
        b = max(1, round(batch))
        top = self.max_tokens
        return max(1.0, b / top) / self.sps(min(b, top))

    @classmethod
    def from_measurements(cls, measurements: Mapping[int, float],
                          max_tokens: int | None = None) -> SPSTable:
        """Fill the integer grid 1..max_tokens by linear interpolation between measured sizes.

        Args:
            measurements: {batch size in tokens: SPS in steps/s}; must include B = 1 (nothing is
                extrapolated below the smallest measured size either).
            max_tokens: table length; default and maximum: the largest measured size.
        Raises:
            ValueError: no measurements, a size < 1 or a non-integer size, B = 1 missing, a bad
                SPS value, or max_tokens beyond the largest measured size (no extrapolation).
        """
        if not measurements:
            raise ValueError("SPSTable.from_measurements needs at least one measurement")
        points = sorted((operator.index(b), float(v)) for b, v in measurements.items())
        if points[0][0] < 1:
            raise ValueError(f"batch sizes must be >= 1 token, got {points[0][0]}")
        if points[0][0] != 1:
            raise ValueError(f"measurements must include B=1 (smallest given: {points[0][0]}); "
                             "SPS is not extrapolated below the smallest measured size")
        largest = points[-1][0]
        if max_tokens is None:
            max_tokens = largest
        if not 1 <= max_tokens <= largest:
            raise ValueError(f"max_tokens={max_tokens} is outside [1, {largest}]: SPS is not "
                             f"extrapolated beyond the largest measured size {largest}")
        values: list[float] = []
        for (b0, v0), (b1, v1) in zip(points, points[1:]):
            values.extend(v0 + (v1 - v0) * (b - b0) / (b1 - b0) for b in range(b0, b1))
        values.append(points[-1][1])
        return cls(tuple(values[:max_tokens]))

    def scaled(self, factor: float) -> SPSTable:
        """This table with every step's seconds multiplied by ``factor`` (> 0), i.e. SPS divided
        by it: a correction from the engine's measured passes (``serve/engine/cost_check.py``)."""
        return SPSTable(tuple(v / factor for v in self.sps_by_batch), self.fill_to)

    def fill_target(self, b: int) -> int:
        """The pass length (tokens) a verification of ``b`` tokens is filled to: b itself unless
        this table was made by :meth:`padded`.

        Raises:
            ValueError: b is outside the table.
        """
        self.sps(b)
        return self.fill_to[b - 1] if self.fill_to else b

    def padded(self, max_tokens: int | None = None) -> SPSTable:
        """The speeds a verification reaches when its pass may be filled up to a cheaper length:
        SPS'(B) = max over B <= B' <= max_tokens of SPS(B'), with ``fill_to`` the smallest such
        B'. Non-increasing in B.

        Why: on CPUs the measured curve is jagged (fp32 on AVX2: a pass of 2 to 4 tokens takes
        longer than one of 8, from the GEMM kernels chosen per row count), and Algorithm 1's early
        stop halts at the first dip even where a longer pass would be faster. Filling the pass
        with more draft tokens (``serve/engine/scheduler.py`` :func:`fill_pass`, lossless) makes
        the scheduled B cost SPS'(B). A non-increasing table is returned unchanged (fill_to = B).

        Args:
            max_tokens: the largest pass allowed (the engine's token budget); default and maximum
                the table's length.
        Returns:
            an SPSTable of ``max_tokens`` entries with ``fill_to`` set.
        Raises:
            ValueError: max_tokens outside [1, max_tokens of this table].
        """
        limit = self.max_tokens if max_tokens is None else operator.index(max_tokens)
        if not 1 <= limit <= self.max_tokens:
            raise ValueError(f"max_tokens={limit} is outside [1, {self.max_tokens}]")
        values, targets = [0.0] * limit, [0] * limit
        best, best_b = -math.inf, limit
        for b in range(limit, 0, -1):
            if self.sps_by_batch[b - 1] >= best:  # ties: the shorter pass
                best, best_b = self.sps_by_batch[b - 1], b
            values[b - 1], targets[b - 1] = best, best_b
        return SPSTable(tuple(values), tuple(targets))

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form: {"unit": "steps_per_s", "sps": [SPS(1), ..., SPS(max_tokens)]}, plus
        "fill_to" for a table made by :meth:`padded` (its speeds hold only when passes are
        filled, so the fill lengths travel with them)."""
        out: dict[str, Any] = {"unit": "steps_per_s", "sps": list(self.sps_by_batch)}
        if self.fill_to:
            out["fill_to"] = list(self.fill_to)
        return out

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> SPSTable:
        """Inverse of :meth:`to_dict`.

        Raises:
            ValueError: missing "sps", unknown keys, a unit other than steps_per_s, or bad values.
        """
        unknown = set(data) - {"unit", "sps", "fill_to"}
        if unknown or "sps" not in data:
            raise ValueError(f"SPS table dict needs key 'sps' (and optional 'unit', 'fill_to'), "
                             f"got keys {sorted(data)}")
        if data.get("unit", "steps_per_s") != "steps_per_s":
            raise ValueError(f"SPS table unit must be 'steps_per_s', got {data['unit']!r}")
        return cls(tuple(data["sps"]), tuple(data.get("fill_to", ())))
