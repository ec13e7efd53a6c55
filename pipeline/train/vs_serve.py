"""Train vs serve (issue 42): the trainer's held-out tau beside the tau the drafter reaches served,
flagged when the served interval does not cover it."""

from __future__ import annotations

from ..tau_intervals import format_interval


# On colder training answers the served excess acceptance (tau - 1) is expected below the
# trainer's, by a moderate factor (0.73 at the reference data: 0.51 vs 0.70); a train/serve
# mismatch (pre-norm features, a template difference) drives served acceptance towards none. A
# served interval whose top stays under half the trainer's excess is that collapse.
COLLAPSE_FRACTION = 0.5


def data_sampling_differs(sampling: dict | None) -> str | None:
    """Why teacher-forced acceptance on the cached answers is not the served one, or None.

    The trainer's held-out tau conditions every position on the cached answer; served at T = 1
    the context is the target's own T = 1 sample. Answers sampled colder or truncated (top-p,
    top-k) are more predictable text, so the trainer's tau is expected above the served one
    there (seen at the reference data: 1.70 teacher-forced on T = 0.7 / top-p 0.8 / top-k 20
    answers, 1.51 [1.47, 1.55] served) without any train/serve bug.

    Args:
        sampling: the generate stage's ``sampling`` section as a dict (``temperature``, ``top_p``,
            ``top_k``); None: unknown, taken as plain T = 1 sampling.
    """
    if sampling is None:
        return None
    plain = (sampling.get("temperature") == 1.0 and sampling.get("top_p", 1.0) >= 1.0
             and sampling.get("top_k", 0) in (0, None))
    if plain:
        return None
    return (f"the cached answers were sampled at T = {sampling.get('temperature')}, top-p "
            f"{sampling.get('top_p')}, top-k {sampling.get('top_k')} (generate.sampling), more "
            "predictable text than the target's own T = 1 samples the served tau decodes")


def train_vs_serve(history: list[dict], calibration: dict,
                   data_sampling: dict | None = None) -> dict | None:
    """The trainer's held-out tau beside the tau the drafter reaches served, and whether they
    differ by more than the served interval (issue 42: a gap is the usual sign of a train/serve
    mismatch: pre-norm features, untrained norms, a template or thinking-mode difference).

    The trainer's held-out tau (``heldout_tau``, teacher-forced on held-out cache rows: 1 + sum
    over k of prod_{i<=k} (1 - TV_i)) is the expected committed tokens per full-block round
    when target and drafter both sample at temperature 1; the calibrate stage's served tau is
    measured on the held-out prompts at fixed gamma, the target in the loop. The two are
    comparable at ``calibrate.temperature`` 1 on answers sampled at plain T = 1
    (``comparable``; :func:`data_sampling_differs` otherwise).

    Args:
        history: the training log's entries (``training_log.jsonl``), oldest first.
        calibration: the calibrate stage's ``report.json`` (:func:`pipeline.calibrate.served_tau`
            fields).
        data_sampling: how the cached answers were sampled (see :func:`data_sampling_differs`).
    Returns:
        None without a served tau; else ``{"served_tau", "served_tau_interval", "served_prompts",
        "served_temperature", "trainer_heldout_tau", "trainer_step", "comparable",
        "not_compared_because", "gap", "flagged", "flag_rule"}`` (``gap`` = trainer - served).
        ``flagged`` (``flag_rule`` "interval"): where the two are comparable, the trainer's tau
        lies outside the served 95 % interval. On colder answers (``not_compared_because`` says
        so; rule "collapse"): the served interval's top excess acceptance (tau - 1) is under
        ``COLLAPSE_FRACTION`` of the trainer's. None where either tau or the interval is missing,
        or served at another temperature than 1.
    """
    if calibration.get("served_tau") is None:
        return None
    heldout = [h for h in history if h.get("heldout_tau") is not None]
    trainer = heldout[-1]["heldout_tau"] if heldout else None
    served, ci = calibration["served_tau"], calibration.get("served_tau_interval")
    at_t1 = calibration.get("served_temperature") == 1.0
    cold_data = data_sampling_differs(data_sampling)
    why_not = (cold_data if at_t1 else
               f"served at T = {calibration.get('served_temperature')}, where teacher-forced TV "
               "acceptance (a T = 1 quantity) does not apply")
    flagged, how = None, None
    if trainer is not None and ci is not None and at_t1:
        if cold_data is None:
            flagged, how = not ci[0] <= trainer <= ci[1], "interval"
        else:  # a gap is expected; a mismatch bug (wrong features) makes acceptance collapse
            flagged = ci[1] - 1 < COLLAPSE_FRACTION * (trainer - 1)
            how = "collapse"
    return {"served_tau": served, "served_tau_interval": ci,
            "served_prompts": calibration.get("served_prompts"),
            "served_temperature": calibration.get("served_temperature"),
            "trainer_heldout_tau": trainer,
            "trainer_step": heldout[-1].get("step") if heldout else None,
            "comparable": why_not is None, "not_compared_because": why_not,
            "gap": None if trainer is None else trainer - served,
            "flagged": flagged, "flag_rule": how}


def train_vs_serve_lines(tvs: dict) -> list[str]:
    """The report's train-vs-serve paragraph."""
    served = format_interval(tvs["served_tau"], tvs["served_tau_interval"])
    head = (f"Train vs serve: the drafter's tau at fixed gamma on {tvs['served_prompts']} held-out "
            f"prompts, served at T = {tvs['served_temperature']} (calibrate stage): {served}")
    if tvs["trainer_heldout_tau"] is None:
        return ["", head + "; the trainer measured no held-out tau (`train.eval_every` unset)."]
    check = ("check the cache (pre-norm features, template or thinking mode) and the drafter's "
             "norms")
    cold = tvs.get("flag_rule") == "collapse"
    if tvs["flagged"]:
        verdict = (f"**COLLAPSE**: served acceptance is under half the trainer's, more than "
                   f"{tvs['not_compared_because']} explains; {check}" if cold else
                   f"**GAP**: the trainer's tau lies outside the served interval; {check}")
    elif tvs["flagged"] is False:
        verdict = (f"a gap of {tvs['gap']:+.2f} is expected: {tvs['not_compared_because']}; no "
                   "collapse (served acceptance above half the trainer's)" if cold
                   else "within the served interval")
    else:
        verdict = f"not compared: {tvs.get('not_compared_because') or 'no interval'}"
    return ["", f"{head}; the trainer's held-out tau (step {tvs['trainer_step']}): "
            f"{tvs['trainer_heldout_tau']:.2f}, {verdict}."]
