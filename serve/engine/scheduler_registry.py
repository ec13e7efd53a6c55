"""The verification-length policies by name: one registry entry per scheduler (SPEC 6), saying how
it is built and what the engine asks of it (whether it reads confidences, confidences of two steps
earlier, an SPS(B) table, and whether it speculates at all). Configs validate names against
:data:`SCHEDULER_NAMES`; the engine, the builder and the profiler read the entry's flags, never
the name. A new policy is a pure function in ``serve/engine/scheduler.py`` plus one line here.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from .scheduler import (
    Confidences,
    _as_rows,
    _batch_limit,
    _check_num_speculative_tokens,
    _check_threshold,
    async_schedule,
    dspark_schedule,
    fixed_schedule,
    no_speculation_schedule,
    static_threshold_schedule,
)
from .sps import SPSTable


@dataclass(frozen=True)
class NamedScheduler:
    """A scheduler with bound parameters: ``sched(confidences, stale_confidences=None)``.

    confidences: R rows of current c_{r,1..K_r}; stale_confidences: confidences of two steps
    earlier (read by schedulers whose entry ``reads_stale_confidences``, ignored by the others).
    Returns l: list[int] of length R.
    """

    name: str
    params: Mapping[str, Any]
    fn: Callable[[Confidences, Confidences | None], list[int]] = field(repr=False)

    def __call__(self, confidences: Confidences,
                 stale_confidences: Confidences | None = None) -> list[int]:
        return self.fn(confidences, stale_confidences)


def _rows_len(confidences: Confidences) -> list[int]:
    return [len(row) for row in _as_rows(confidences)]


def _build_dspark(sps: SPSTable, max_batch_tokens: int | None = None):
    _batch_limit(sps, max_batch_tokens)
    return lambda conf, stale: dspark_schedule(conf, sps, max_batch_tokens)


def _build_async(sps: SPSTable, max_batch_tokens: int | None = None):
    _batch_limit(sps, max_batch_tokens)
    return lambda conf, stale: async_schedule(conf, stale, sps, max_batch_tokens)


def _build_static(threshold: float):
    _check_threshold(threshold)
    return lambda conf, stale: static_threshold_schedule(conf, threshold)


def _build_fixed(num_speculative_tokens: int):
    _check_num_speculative_tokens(num_speculative_tokens)
    return lambda conf, stale: fixed_schedule(_rows_len(conf), num_speculative_tokens)


def _build_none():
    return lambda conf, stale: no_speculation_schedule(len(_as_rows(conf)))


@dataclass(frozen=True)
class SchedulerEntry:
    """One policy: ``builder(**params)`` returns ``fn(confidences, stale_confidences) -> l``;
    ``required`` / ``optional`` name the parameters it takes."""

    builder: Callable[..., Any]
    required: frozenset[str]
    optional: frozenset[str]
    reads_confidence: bool  # decides from calibrated confidences (needs a confidence head)
    reads_stale_confidences: bool = False  # also reads the confidences of two steps earlier
    speculates: bool = True  # verifies drafts at all (False: the target decodes alone)

    @property
    def needs_sps(self) -> bool:
        """Whether it reads the SPS(B) profile (so the goodput planner can run beside it)."""
        return "sps" in self.required


_REGISTRY: dict[str, SchedulerEntry] = {
    "dspark": SchedulerEntry(_build_dspark, frozenset({"sps"}), frozenset({"max_batch_tokens"}),
                             True),
    "async": SchedulerEntry(_build_async, frozenset({"sps"}), frozenset({"max_batch_tokens"}),
                            True, reads_stale_confidences=True),
    "static_threshold": SchedulerEntry(_build_static, frozenset({"threshold"}), frozenset(), True),
    "fixed": SchedulerEntry(_build_fixed, frozenset({"num_speculative_tokens"}), frozenset(),
                            False),
    "none": SchedulerEntry(_build_none, frozenset(), frozenset(), False, speculates=False),
}
SCHEDULER_NAMES = tuple(_REGISTRY)  # the one list of names (configs validate against it)
# what the engine and the profiler ask of a scheduler name (derived from the registry, not listed)
NEEDS_CONFIDENCE = frozenset(n for n, e in _REGISTRY.items() if e.reads_confidence)
NEEDS_SPS = frozenset(n for n, e in _REGISTRY.items() if e.needs_sps)


def scheduler_entry(name: str) -> SchedulerEntry:
    """The registry entry of scheduler ``name``.

    Raises:
        ValueError: unknown name (the message lists the valid ones).
    """
    if name not in _REGISTRY:
        raise ValueError(f"unknown scheduler {name!r}; valid names: {', '.join(SCHEDULER_NAMES)}")
    return _REGISTRY[name]


def make_scheduler(name: str, **params: Any) -> NamedScheduler:
    """Build a scheduler by name with one uniform call signature.

    Names and parameters: "dspark" (sps, max_batch_tokens=None) -> :func:`dspark_schedule`;
    "async" (sps, max_batch_tokens=None) -> :func:`async_schedule`; "static_threshold"
    (threshold) -> :func:`static_threshold_schedule`; "fixed" (num_speculative_tokens) ->
    :func:`fixed_schedule` clipped to each request's drafts; "none" () ->
    :func:`no_speculation_schedule`.

    Returns:
        A :class:`NamedScheduler`: ``sched(confidences, stale_confidences=None) -> list[int]``.
    Raises:
        ValueError: unknown name (the message lists the valid ones), a missing or unexpected
            parameter, or an invalid parameter value.
    Source: SPEC 6 (scheduler and the baselines it is compared against).
    """
    entry = scheduler_entry(name)
    builder, required, optional = entry.builder, entry.required, entry.optional
    missing = sorted(required - set(params))
    unexpected = sorted(set(params) - required - optional)
    if missing or unexpected:
        raise ValueError(f"scheduler {name!r} takes {sorted(required)} (required) and "
                         f"{sorted(optional)} (optional); missing {missing}, "
                         f"unexpected {unexpected}")
    return NamedScheduler(name, dict(params), builder(**params))


def scheduler_for(name: str, **available: Any) -> NamedScheduler:
    """:func:`make_scheduler` from everything the caller has (``sps``, ``max_batch_tokens``,
    ``threshold``, ``num_speculative_tokens``): only the parameters ``name`` takes are passed on,
    so the engine builds any scheduler with one call.

    Raises:
        ValueError: unknown name, or a required parameter that is missing or None (e.g. dspark
            without an SPS(B) table).
    """
    entry = scheduler_entry(name)
    missing = sorted(p for p in entry.required if available.get(p) is None)
    if missing:
        raise ValueError(f"scheduler {name!r} needs {', '.join(missing)}"
                         + (" (an SPS(B) table: serve/engine/profiling.py)" if "sps" in missing else ""))
    params = {k: v for k, v in available.items()
              if k in entry.required or (k in entry.optional and v is not None)}
    return make_scheduler(name, **params)
