"""serve/heap.py: the engine thread returns the allocator's free memory at most once per
interval; 0 disables it; the serve config validates the interval."""

from __future__ import annotations

import time

import pytest
from pydantic import ValidationError

from serve.config import ServeConfig
from serve.heap import HeapTrimmer


def test_trims_at_most_once_per_interval():
    off = HeapTrimmer(0.0)
    off.maybe_trim()
    assert off.trims == 0
    trimmer = HeapTrimmer(0.05)
    trimmer.maybe_trim()
    assert trimmer.trims == 0  # the interval has not passed since construction
    time.sleep(0.06)
    trimmer.maybe_trim()
    trimmer.maybe_trim()
    assert trimmer.trims == 1  # glibc (Linux CI): one trim, the second call is too soon


def test_the_interval_is_validated():
    assert ServeConfig.model_validate({"target": "t"}).heap_trim_interval_s == 10.0
    with pytest.raises(ValidationError, match="heap_trim_interval_s"):
        ServeConfig.model_validate({"target": "t", "heap_trim_interval_s": -1})


def test_an_idle_engine_trims_once_after_work():
    """Before waiting for work the engine trims if steps ran since the last trim, and only then."""
    trimmer = HeapTrimmer(3600.0)
    trimmer.maybe_trim(idle=True)
    assert trimmer.trims == 0  # nothing ran yet
    trimmer.maybe_trim()  # a step, long before the interval
    assert trimmer.trims == 0
    trimmer.maybe_trim(idle=True)
    trimmer.maybe_trim(idle=True)
    assert trimmer.trims == 1
