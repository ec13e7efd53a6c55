"""Evaluation summaries (SPEC 5): tau, prefix survival, conditional acceptance, domain averages and
the static-threshold sweep, on hand-made rounds."""

from __future__ import annotations

import pytest

from pipeline.evaluate import domain_summary, render_report_md, summarize
from serve.engine.core import RoundRecord

# the engine's round records: drafted, verified l, accepted n, committed, draft_s, verify_s, logits
ROUNDS = [RoundRecord(3, 3, 1, 2, 0.01, 0.02, [2.0, 0.0, -2.0]),
          RoundRecord(3, 3, 3, 4, 0.01, 0.02, [3.0, 2.0, 1.0]),
          RoundRecord(2, 2, 2, 3, 0.01, 0.02, [1.0, 1.0]),  # a shorter block (budget end): not full
          RoundRecord(3, 0, 0, 1, 0.0, 0.02, None)]         # declined by the scheduler: ignored


def _records():
    return [{"spec_tokens": 10, "spec_s": 2.0, "base_tokens": 10, "base_s": 4.0,
             "spec_rounds": ROUNDS, "identical": True}]


def test_summary_by_hand():
    s = summarize(_records(), gamma=3)
    assert s["rounds"] == 3
    assert s["tau"] == pytest.approx((2 + 4 + 3) / 3)
    # survival among rounds that verified >= k: k=1: 3 of 3 accept; k=2: 3 verified, 2 accept
    # >= 2; k=3: the two full rounds verified, one accepts all 3
    assert s["accept_rate"] == pytest.approx([1.0, 2 / 3, 0.5])
    # conditional: k=1 reached by 3 rounds, all accept; k=2 reached by 3 (n >= 1), 2 accept;
    # k=3 reached by rounds with l >= 3 and n >= 2: one, it accepts
    assert s["conditional_acceptance"] == pytest.approx([1.0, 2 / 3, 1.0])
    assert s["speedup"] == pytest.approx(2.0) and s["greedy_identical_share"] == 1.0
    assert s["calibration"]["num_rounds"] == 2  # full rounds with confidences
    low = s["threshold_sweep"][0]
    assert low["threshold"] == 0.0 and low["committed_per_step"] == pytest.approx(3.0)


def test_unmeasured_positions_are_none_not_zero(tmp_path, monkeypatch):
    """Positions no round verified (or reached) have no rate: None in the JSON (issue 21: a 0.0
    there reads as "the drafter fails there") and no point in the plot (NaN: the line stops)."""
    from pipeline import plots

    s = summarize(_records(), gamma=5)
    assert s["accept_rate"][3:] == [None, None] and s["conditional_acceptance"][3:] == [None, None]
    drawn = []
    real_save = plots._save
    monkeypatch.setattr(plots, "_save", lambda fig, path: (
        drawn.extend(fig.axes[0].lines[0].get_ydata()), real_save(fig, path))[1])
    plots.conditional_acceptance_plot({"dspark": s["conditional_acceptance"]}, tmp_path / "c.png")
    assert drawn[:3] == pytest.approx([1.0, 2 / 3, 1.0])
    assert all(y != y for y in drawn[3:])  # NaN: not drawn


def test_domains_and_report():
    s = summarize(_records(), gamma=3)
    results = {"gsm8k": {"1.0": s}, "mbpp": {"1.0": dict(s, tau=2.0)}}
    dom = domain_summary(results, "1.0")
    assert dom["math"] == pytest.approx(3.0) and dom["code"] == 2.0
    assert dom["macro"] == pytest.approx(2.5)
    md = render_report_md({"gamma": 3, "target": "t", "dtype": "float32", "max_new_tokens": 8,
                           "results": results, "domains": {"1.0": dom}})
    assert "| 1.0 | 2.00 | 3.00 | 2.50 |" in md and "Static confidence threshold" in md


def test_a_dataset_where_no_round_drafted_has_no_tau_and_stays_out_of_the_means():
    """The goodput planner may draft in no round of a dataset (a slow CPU, a weak drafter): its
    tau is unmeasured (None, "-" in the report), not 0.0, which pulled the quickstart's macro tau
    on an AVX2 machine to 0.91 (a round commits >= 1 token); the domain mean, the macro and their
    intervals are over the datasets that drafted."""
    from pipeline.evaluate import domain_summary_intervals

    plain = [RoundRecord(3, 0, 0, 1, 0.0, 0.02, None)] * 4  # every round declined
    drafted = summarize([dict(_records()[0], spec_rounds=ROUNDS)] * 3, gamma=3)
    undrafted = summarize([dict(_records()[0], spec_rounds=plain)] * 3, gamma=3)
    assert undrafted["tau"] is None and undrafted["tau_interval"] is None
    results = {"gsm8k": {"0.0": drafted}, "math500": {"0.0": undrafted},
               "mt-bench": {"0.0": undrafted}}
    dom = domain_summary(results, "0.0")
    assert dom == {"math": pytest.approx(3.0), "macro": pytest.approx(3.0)}  # no chat domain
    intervals = domain_summary_intervals(results, "0.0")
    assert intervals["math"] == pytest.approx([3.0, 3.0]) and intervals["macro"] == pytest.approx(
        [3.0, 3.0]) and intervals["chat"] is None
    md = render_report_md({"gamma": 3, "target": "t", "dtype": "float32", "max_new_tokens": 8,
                           "results": results, "domains": {"0.0": dom}})
    row = next(line for line in md.splitlines() if line.startswith("| math500 | 0.0 |"))
    assert row.split(" | ")[3] == "-"


def test_spec_decode_stats_define_accept_rate_and_conditional_acceptance_once():
    """accept_rate@k is prefix survival among rounds verifying >= k; conditional acceptance divides
    by the rounds that reached k (k-1 accepted). A round verifying 3 and accepting 1 reaches k=2."""
    from serve.engine.metrics import SpecDecodeStats

    stats = SpecDecodeStats()
    for r in ROUNDS:
        stats.record_round(r.drafted, r.verified, r.accepted, r.committed)
    assert stats.verified_per_position == [3, 3, 2]
    assert stats.reached_per_position == [3, 3, 1]
    assert stats.accept_rate_at_k() == pytest.approx([1.0, 2 / 3, 0.5])
    assert stats.conditional_acceptance() == pytest.approx([1.0, 2 / 3, 1.0])


def test_report_marks_positions_no_round_verified():
    """Positions the scheduler never verified are unmeasured ("-"), not an acceptance of 0."""
    s = summarize(_records(), gamma=5)
    assert s["verified_per_position"] == [3, 3, 2, 0, 0]
    assert s["reached_per_position"] == [3, 3, 1, 0, 0]
    md = render_report_md({"gamma": 5, "target": "t", "dtype": "float32", "max_new_tokens": 8,
                           "results": {"gsm8k": {"1.0": s}}, "domains": {}})
    assert "| 1.00 / 0.67 / 0.50 / - / - |" in md
    assert "| gsm8k | 1.0 | 1.00 | 0.67 | 1.00 | - | - |" in md


def test_every_tau_carries_its_interval():
    """Each cell keeps its per-prompt counts and a 95 % interval over prompts; the report prints
    the interval beside each tau and beside each domain and macro tau (issue 42)."""
    from pipeline.evaluate import domain_summary_intervals

    one = summarize(_records(), gamma=3)
    assert one["per_prompt"] == [[9, 3]] and one["tau_interval"] is None  # one prompt
    short = [RoundRecord(1, 1, 0, 1, 0.0, 0.0, None)] * 4  # a prompt where every draft fails
    two = summarize(_records() + [dict(_records()[0], spec_rounds=short)], gamma=3)
    assert two["per_prompt"] == [[9, 3], [4, 4]] and two["tau"] == pytest.approx(13 / 7)
    low, high = two["tau_interval"]
    assert low == pytest.approx(1.0) and high == pytest.approx(3.0)  # all one or all the other
    results = {"gsm8k": {"1.0": two}, "mbpp": {"1.0": two}}
    ci = domain_summary_intervals(results, "1.0")
    assert set(ci) == {"math", "code", "macro"} and ci["macro"][0] < two["tau"] < ci["macro"][1]
    md = render_report_md({"gamma": 3, "target": "t", "dtype": "float32", "max_new_tokens": 8,
                           "results": results, "domains": {"1.0": domain_summary(results, "1.0")},
                           "domain_intervals": {"1.0": ci}})
    assert f"| gsm8k | 1.0 | 2 | 1.86 [{low:.2f}, {high:.2f}] |" in md
    assert f"| 1.86 [{ci['macro'][0]:.2f}, {ci['macro'][1]:.2f}] |" in md


def test_train_vs_serve_flags_a_trainer_tau_outside_the_served_interval():
    """The eval report puts the trainer's held-out tau beside the served tau at fixed gamma on
    the held-out prompts (calibrate stage) and flags a gap the served interval does not cover."""
    from pipeline.calibrate import served_tau
    from pipeline.train.vs_serve import train_vs_serve

    collected = {"per_prompt": [[20, 10], [30, 10], [25, 10], [22, 10]], "temperature": 1.0}
    served = served_tau(collected)
    assert served["served_tau"] == pytest.approx(97 / 40) and served["served_prompts"] == 4
    low, high = served["served_tau_interval"]
    history = [{"step": 10, "tau": 3.0}, {"step": 20, "heldout_tau": 2.4}, {"step": 25, "tau": 3.1}]
    ok = train_vs_serve(history, served)
    assert ok["trainer_heldout_tau"] == 2.4 and ok["trainer_step"] == 20
    assert low <= 2.4 <= high and ok["flagged"] is False
    gap = train_vs_serve([{"step": 20, "heldout_tau": 3.4}], served)
    assert gap["flagged"] and gap["gap"] == pytest.approx(3.4 - 97 / 40)
    md = render_report_md({"gamma": 3, "target": "t", "dtype": "float32", "max_new_tokens": 8,
                           "results": {}, "domains": {}, "train_vs_serve": gap})
    assert "**GAP**" in md and "3.40" in md
    at_t0 = train_vs_serve([{"step": 20, "heldout_tau": 3.4}], {**served, "served_temperature": 0.0})
    assert at_t0["flagged"] is None  # teacher-forced TV acceptance is T = 1's: not compared
    none = train_vs_serve([{"step": 5, "tau": 2.0}], served)
    assert none["flagged"] is None and "eval_every" in "".join(
        render_report_md({"gamma": 3, "target": "t", "dtype": "float32", "max_new_tokens": 8,
                          "results": {}, "domains": {}, "train_vs_serve": none}))
    assert served_tau({"per_prompt": [], "temperature": 1.0}) == {}
    assert train_vs_serve(history, {}) is None


def test_train_vs_serve_does_not_blame_the_cache_for_colder_training_answers():
    """Answers sampled at T = 0.7 with top-p / top-k are more predictable than the target's own
    T = 1 samples: the trainer's tau on them is expected above the served one, so the gap is
    shown but not flagged, and the report says why (not "check the cache")."""
    from pipeline.calibrate import served_tau
    from pipeline.train.vs_serve import data_sampling_differs, train_vs_serve

    served = served_tau({"per_prompt": [[20, 10], [30, 10], [25, 10], [22, 10]],
                         "temperature": 1.0})
    cold = {"temperature": 0.7, "top_p": 0.8, "top_k": 20, "max_new_tokens": 512}
    result = train_vs_serve([{"step": 20, "heldout_tau": 3.4}], served, cold)
    assert result["flagged"] is False and not result["comparable"]
    assert result["gap"] == pytest.approx(3.4 - 97 / 40)
    md = render_report_md({"gamma": 3, "target": "t", "dtype": "float32", "max_new_tokens": 8,
                           "results": {}, "domains": {}, "train_vs_serve": result})
    assert "**GAP**" not in md and "is expected: the cached answers were sampled at T = 0.7" in md
    # a drafter fed the wrong features accepts (almost) nothing served: still caught
    broken = served_tau({"per_prompt": [[11, 10], [12, 10], [10, 10]], "temperature": 1.0})
    collapsed = train_vs_serve([{"step": 20, "heldout_tau": 1.7}], broken, cold)
    assert collapsed["flagged"] and collapsed["flag_rule"] == "collapse"
    assert "**COLLAPSE**" in render_report_md({"gamma": 3, "target": "t", "dtype": "float32",
                                               "max_new_tokens": 8, "results": {}, "domains": {},
                                               "train_vs_serve": collapsed})
    # the reference data's reading (1.70 trainer, 1.51 [1.47, 1.55] served): no flag
    reference = {"served_tau": 1.51, "served_tau_interval": [1.47, 1.55], "served_prompts": 71,
                 "served_temperature": 1.0}
    assert train_vs_serve([{"step": 600, "heldout_tau": 1.70}], reference, cold)["flagged"] is False
    plain = {"temperature": 1.0, "top_p": 1.0, "top_k": 0}
    assert data_sampling_differs(plain) is None
    assert train_vs_serve([{"step": 20, "heldout_tau": 3.4}], served, plain)["flagged"]
    assert data_sampling_differs({**plain, "top_k": 50})  # truncation alone changes the text


def test_an_unreadable_training_log_leaves_the_evaluation_standing(tmp_path, caplog):
    """The eval stage reads the training log after hours of decoding: a damaged log drops only
    the train-vs-serve paragraph (a warning names the files), never the measured report."""
    import logging
    from types import SimpleNamespace

    from pipeline.model_stages import _train_vs_serve
    from pipeline.run_layout import RunLayout

    from pipeline.config import load_config

    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    cfg = load_config(str(root / "infra" / "configs" / "quickstart.yaml"),  # a real config
                      ["generate.sampling.temperature=1.0", "generate.sampling.top_p=1.0",
                       "generate.sampling.top_k=0"])
    ctx = SimpleNamespace(run_dir=tmp_path, layout=RunLayout(tmp_path), cfg=cfg)
    (tmp_path / "train" / "drafter").mkdir(parents=True)
    (tmp_path / "calibrate").mkdir()
    (tmp_path / "calibrate" / "report.json").write_text(
        '{"served_tau": 1.5, "served_tau_interval": [1.4, 1.6], "served_prompts": 4, '
        '"served_temperature": 1.0}')
    log = tmp_path / "train" / "drafter" / "training_log.jsonl"
    log.write_text('{"step": 10, "heldout_tau": 1.55}\n')
    assert _train_vs_serve(ctx)["flagged"] is False
    log.write_text('{"step": 10, "heldout_tau": 1.5\n')  # cut off mid-line
    with caplog.at_level(logging.WARNING):
        assert _train_vs_serve(ctx) is None
    assert "training_log.jsonl" in caplog.text
