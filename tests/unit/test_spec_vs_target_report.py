"""benchmarks/spec_vs_target.py's table: tau with its 95 % interval over prompts (issue 42)."""

from __future__ import annotations

import pytest

from serve.engine.core import RoundRecord


def test_tau_row_carries_its_interval():
    from benchmarks.spec_vs_target import render, summarize

    good = [RoundRecord(3, 3, 3, 4, 0.01, 0.02, None)] * 2  # tau 4
    poor = [RoundRecord(3, 3, 0, 1, 0.01, 0.02, None)] * 2  # tau 1
    row = summarize([{"tokens": [1] * 8, "seconds": 1.0, "rounds": good},
                     {"tokens": [1] * 2, "seconds": 1.0, "rounds": poor}], gamma=3)
    assert row["tau"] == pytest.approx(2.5) and row["tau_interval"] == pytest.approx([1.0, 4.0])
    row.update(dataset="gsm8k", temperature=0.0, arm="dspark", speedup_vs_generate=1.2)
    md = render([row], {"target": "t", "dtype": "float32", "max_new_tokens": 8, "threads": 2,
                        "date": "d", "seconds": 1.0, "identity_max_new_tokens": 8,
                        "fp32_sampled": True})
    assert "| 1.20x | 2.50 [1.00, 4.00] |" in md
