"""Training fits, measured at the real shapes (issue 11): one micro-batch of
infra/configs/qwen3_4b.yaml (4 sequences of 4096 tokens, 512 anchors each, Qwen3-4B widths and
vocabulary, the 5-layer DSpark drafter, bf16 autocast) runs the real training step on fake
tensors (``pipeline.memory_measure.fake_floats``: nothing is allocated) under PyTorch's MemTracker.

Here rather than in tests/unit because the ~25 k traced ops take a minute of CPU; the unit tests
(tests/unit/test_train_memory.py) check the same model against real tensors at reduced shapes.
"""

from __future__ import annotations

import pytest

from pipeline.config import load_config
from pipeline.memory import GB, estimate_for_config
from pipeline.memory_measure import measure_config_peak_fake

pytestmark = pytest.mark.slow


def test_qwen3_4b_micro_batch_measured_on_fake_tensors_fits_80gb():
    from tests.unit.test_train_memory import DEVICE_BYTES, HEADROOM, QWEN3_4B, TOLERANCE

    cfg = load_config("infra/configs/qwen3_4b.yaml")
    measured, predicted = measure_config_peak_fake(cfg, QWEN3_4B)
    shape = measured.shape
    assert (shape.sequences, shape.blocks) == (4, 4 * 512)
    assert shape.context_rows > 0.99 * 4 * 4096 and shape.supervised_rows > 0.99 * 4 * 512 * 7
    # the analytic model at the measured shape, and at the worst-case bound
    assert abs(predicted.activations / measured.activations - 1) <= TOLERANCE, (
        predicted.moments, measured.activations)
    assert predicted.frozen == pytest.approx(measured.by_kind["Buffer"], rel=1e-5)  # + RoPE table
    assert measured.in_backward
    # model states: one process measures no ZeRO-1 sharding, so take the model's (8 workers);
    # the frozen tensors and activations as measured
    peak = predicted.model_states + measured.by_kind["Buffer"] + measured.activations
    assert peak <= (1 - HEADROOM) * DEVICE_BYTES, f"{peak / GB:.1f} GB"
    assert estimate_for_config(cfg, QWEN3_4B).total >= peak * (1 - 0.01)
