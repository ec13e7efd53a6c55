"""Train vs serve (issue 42): the trainer's held-out tau beside the tau the drafter reaches served,
flagged when the served interval does not cover it."""

from __future__ import annotations

from ..tau_intervals import format_interval


def train_vs_serve(history: list[dict], calibration: dict) -> dict | None:
    """The trainer's held-out tau beside the tau the drafter reaches served, and whether they
    differ by more than the served interval (issue 42: a gap is the usual sign of a train/serve
    mismatch: pre-norm features, untrained norms, a template or thinking-mode difference).

    The trainer's held-out tau (``heldout_tau``, teacher-forced on held-out cache rows: 1 + sum
    over k of prod_{i<=k} (1 - TV_i)) is the expected committed tokens per full-block round
    when target and drafter both sample at temperature 1; the calibrate stage's served tau is
    measured on the held-out prompts at fixed gamma, the target in the loop. The two are
    comparable at ``calibrate.temperature`` 1 (``comparable``).

    Args:
        history: the training log's entries (``training_log.jsonl``), oldest first.
        calibration: the calibrate stage's ``report.json`` (:func:`pipeline.calibrate.served_tau`
            fields).
    Returns:
        None without a served tau; else ``{"served_tau", "served_tau_interval", "served_prompts",
        "served_temperature", "trainer_heldout_tau", "trainer_step", "comparable", "gap",
        "flagged"}`` (``gap`` = trainer - served; ``flagged``: the trainer's tau lies outside the
        served 95 % interval at a comparable temperature; None where either is missing).
    """
    if calibration.get("served_tau") is None:
        return None
    heldout = [h for h in history if h.get("heldout_tau") is not None]
    trainer = heldout[-1]["heldout_tau"] if heldout else None
    served, ci = calibration["served_tau"], calibration.get("served_tau_interval")
    comparable = calibration.get("served_temperature") == 1.0
    return {"served_tau": served, "served_tau_interval": ci,
            "served_prompts": calibration.get("served_prompts"),
            "served_temperature": calibration.get("served_temperature"),
            "trainer_heldout_tau": trainer,
            "trainer_step": heldout[-1].get("step") if heldout else None,
            "comparable": comparable, "gap": None if trainer is None else trainer - served,
            "flagged": (None if trainer is None or ci is None or not comparable
                        else not ci[0] <= trainer <= ci[1])}


def train_vs_serve_lines(tvs: dict) -> list[str]:
    """The report's train-vs-serve paragraph."""
    served = format_interval(tvs["served_tau"], tvs["served_tau_interval"])
    head = (f"Train vs serve: the drafter's tau at fixed gamma on {tvs['served_prompts']} held-out "
            f"prompts, served at T = {tvs['served_temperature']} (calibrate stage): {served}")
    if tvs["trainer_heldout_tau"] is None:
        return ["", head + "; the trainer measured no held-out tau (`train.eval_every` unset)."]
    verdict = ("**GAP**: the trainer's tau lies outside the served interval; check the cache "
               "(pre-norm features, template or thinking mode) and the drafter's norms"
               if tvs["flagged"] else "within the served interval" if tvs["flagged"] is False
               else "not compared (served at another temperature than 1, or no interval)")
    return ["", f"{head}; the trainer's held-out tau (step {tvs['trainer_step']}): "
            f"{tvs['trainer_heldout_tau']:.2f}, {verdict}."]
