"""benchmarks/drafter_quality.py's report: the table it builds from each contender's eval report,
and the markdown naming the plots it wrote (a --suffix run keeps the default run's files)."""

from __future__ import annotations


def contender(tau: float, rates: list, calibrated: bool = False) -> dict:
    cell = {"tau": tau, "draft_ms_per_round": 10.0, "verify_ms_per_round": 40.0,
            "conditional_acceptance": rates, "rounds": 100}
    return {"report": {"results": {"gsm8k": {"1.0": cell}, "mt-bench": {"1.0": cell}},
                       "domains": {"1.0": {"math": tau, "chat": tau, "macro": tau}},
                       "trainable_parameters": 12_900_000},
            "train": {"steps": 600, "final_metrics": {"loss": 2.0, "heldout_tau": tau}},
            "calibration": {"calibrated": calibrated, "reason": "identity kept"}}


def test_table_and_markdown_name_the_suffixed_plots():
    from benchmarks.drafter_quality import build_table, render_md

    results = {"dspark": contender(2.0, [0.5, 0.4, None]), "eagle3": contender(1.6, [0.4, None, None])}
    table = build_table(results, "1.0")
    assert table["dspark"]["domains"]["macro"] == 2.0
    assert table["eagle3"]["conditional_acceptance"] == [0.4, None, None]
    meta = {"target": "t", "dtype": "bfloat16", "gamma": 3, "temperature": "1.0",
            "prompts_per_dataset": 8, "max_new_tokens": 64, "train_steps": 600,
            "global_batch_size": 16, "machine": "m", "wall_minutes": 1.0, "command": "c",
            "files": {"conditional_acceptance": "conditional_acceptance_reference.png",
                      "tau": "drafter_quality_tau_reference.png",
                      "reliability": "dspark_reliability_reference.png"}}
    md = render_md(table, results, meta)
    assert "`conditional_acceptance_reference.png`" in md
    assert "| dspark / eagle3 | 1.250 | 1.250 | 1.250 |" in md
    assert "| eagle3 | 0.400 | - | - |" in md  # positions no round reached are not drawn as 0
    assert "Not calibrated: identity kept" in md
