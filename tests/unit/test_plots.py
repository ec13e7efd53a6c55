"""Each report figure writes a non-empty PNG from small inputs (pipeline/plots.py)."""

from __future__ import annotations

import numpy as np
import pytest

from pipeline import plots

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _assert_png(path):
    data = path.read_bytes()
    assert len(data) > 1000
    assert data[:8] == PNG_MAGIC


def test_reliability_diagram(tmp_path):
    rng = np.random.default_rng(0)
    z = rng.normal(1.0, 2.0, size=(300, 4))
    accepted = rng.integers(0, 5, size=300)
    out = plots.reliability_diagram(z, accepted, [1.5, 1.2, 0.9, 2.0], tmp_path / "sub" / "r.png")
    _assert_png(out)  # default positions 1, 3 (5 and 7 exceed gamma = 4)
    with pytest.raises(ValueError, match="positions"):
        plots.reliability_diagram(z, accepted, [1.0] * 4, tmp_path / "bad.png", positions=[5])


def test_conditional_acceptance_plot(tmp_path):
    curves = {"dspark": [0.9, 0.85, 0.8, 0.78], "dflash": [0.85, 0.7, 0.6, 0.5]}
    _assert_png(plots.conditional_acceptance_plot(curves, tmp_path / "c.png", "cond. acceptance"))


def test_threshold_sweep_plot(tmp_path):
    sweep = [dict(threshold=t, committed_per_step=1 + 3 * (1 - t), accepted_per_step=3 * (1 - t),
                  rejected_per_step=2 * (1 - t) ** 2, acceptance_rate=0.5 + 0.4 * t)
             for t in (0.9, 0.1, 0.5)]
    _assert_png(plots.threshold_sweep_plot(sweep, tmp_path / "s.png", "sweep"))


def test_tau_bar_plot(tmp_path):
    table = {"dspark": {"gsm8k": 6.1, "math500": 5.7}, "dflash": {"gsm8k": 5.4, "mt-bench": 3.1}}
    _assert_png(plots.tau_bar_plot(table, tmp_path / "t.png", "tau"))
