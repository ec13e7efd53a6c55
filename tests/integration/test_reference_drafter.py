"""The reference drafter shipped in ``infra/drafters/smollm2_reference`` (issue 21).

What a user serves or exports without training: the files agree with their own record
(``release.json``), the weights are the bf16 copy of a drafter trained by the reference config,
``infra/configs/serve_reference.yaml`` serves it, and with the real SmolLM2 target it decodes
losslessly (fp32 greedy output token-identical to the target alone) while accepting several draft
tokens per round, which an untrained, damaged or mismatched drafter does not.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
REFERENCE = ROOT / "infra" / "drafters" / "smollm2_reference"
# written beside a served drafter by the engine on this machine (git-ignored), not shipped
ENGINE_PROFILES = {"sps_profile.json", "draft_cost_profile.json"}


def _release() -> dict:
    return json.loads((REFERENCE / "release.json").read_text())


def test_the_shipped_files_match_their_record_and_the_reference_config():
    from safetensors import safe_open

    from pipeline.config import load_config

    info = _release()
    weights = REFERENCE / "model.safetensors"
    assert hashlib.sha256(weights.read_bytes()).hexdigest() == info["weights_sha256"]
    shipped = [f for f in REFERENCE.iterdir() if f.name not in ENGINE_PROFILES]
    assert sum(f.stat().st_size for f in shipped) <= 30e6
    with safe_open(str(weights), "pt") as f:
        dtypes = {f.get_slice(name).get_dtype() for name in f.keys()}
    assert "BF16" in dtypes and not dtypes & {"F32", "F16"}

    reference = load_config(str(ROOT / "infra" / "configs" / "smollm2_reference.yaml"))
    trained = load_config(str(REFERENCE / "training_config.yaml"))
    # the same drafter and target; the precision is the machine's choice (the record says the
    # bf16 it was trained in, the reference config dtype auto: fp32 on an AVX2-only CPU)
    same_target = lambda t: t.model_copy(update={"dtype": "auto"})  # noqa: E731
    assert trained.drafter == reference.drafter
    assert same_target(trained.target) == same_target(reference.target)
    assert info["training_supervised_tokens"] >= 1_000_000
    # the held-out quality the model card states (set from the finished run)
    assert info["heldout"]["accept_rate@1"] >= 0.55, info["heldout"]


def test_serve_reference_config_serves_the_shipped_drafter():
    import yaml
    from ray.serve.schema import ServeDeploySchema

    from serve.app import ServeConfig, build_app

    raw = yaml.safe_load((ROOT / "infra" / "configs" / "serve_reference.yaml").read_text())
    (app,) = ServeDeploySchema.model_validate(raw).applications
    cfg = ServeConfig.model_validate(app.args)
    assert (ROOT / cfg.drafter).resolve() == REFERENCE and cfg.engine.scheduler == "dspark"
    build_app(app.args)  # builds the Application without loading anything


@pytest.fixture(scope="module")
def reference_models(smollm2_dir):
    from serve.engine.builder import load_models

    return load_models(str(smollm2_dir), "float32", str(REFERENCE), device="cpu")


QUESTIONS = [
    "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in "
    "May. How many clips did Natalia sell altogether in April and May?",
    "Write a Python function that returns the n-th Fibonacci number.",
]


@pytest.mark.parametrize("question", QUESTIONS)
def test_greedy_fp32_output_is_the_targets_and_drafts_are_accepted(reference_models, question):
    from serve.engine.chat import render_prompt_ids
    from serve.engine.decoding import SpeculativeDecoder

    m = reference_models
    prompt = render_prompt_ids(m.tokenizer, [{"role": "user", "content": question}],
                               {"enable_thinking": False})
    decoder = SpeculativeDecoder(m.runner, m.drafter, m.eos)
    target_alone = decoder.generate(prompt, 64, num_draft_tokens=0)
    speculative = decoder.generate(prompt, 64)  # fixed: the drafter's whole block every round
    assert speculative.tokens == target_alone.tokens
    # tokens committed per round after the prefill's first token: accepted drafts + the anchor
    tau = sum(r.committed for r in speculative.rounds) / len(speculative.rounds)
    # the shipped drafter: 1.91 (the GSM8K question) and 3.00 (Fibonacci) here; a drafter that
    # does not match its target (wrong layers, wrong vocabulary map) or an untrained one: ~1.0
    assert tau >= 1.6, f"tau {tau:.2f} over {len(speculative.rounds)} rounds"


def test_eval_reports_the_drafters_own_tau_beside_the_schedulers(smollm2_dir):
    """With a confidence scheduler the eval stage also decodes at fixed gamma (the paper's Table 1
    convention): those rounds verify the whole block, the scheduler's verify shorter drafts."""
    from pipeline.evaluate import evaluate, render_report_md
    from serve.engine.config import EngineConfig

    prompts = {"gsm8k": [QUESTIONS[0]], "humaneval": [QUESTIONS[1]]}
    kwargs = dict(target=str(smollm2_dir), dtype="float32", drafter_dir=str(REFERENCE),
                  template_kwargs={"enable_thinking": False}, datasets=prompts,
                  temperatures=[0.0], max_new_tokens=48, num_threads=None, seed=0,
                  progress=False, speed_baseline=False, fixed_gamma_pass=True)
    report = evaluate(engine=EngineConfig(scheduler="static_threshold", threshold=0.5), **kwargs)
    gamma = report["gamma"]
    fixed = report["fixed_gamma"]
    for name in prompts:
        full, scheduled = fixed["results"][name]["0.0"], report["results"][name]["0.0"]
        # every fixed round verifies gamma drafts except those the token budget cuts short: they
        # start within the last gamma tokens and each commits at least one, so at most gamma
        assert full["verified_per_position"][gamma - 1] >= max(1, full["rounds"] - gamma)
        assert sum(scheduled["verified_per_position"]) < sum(full["verified_per_position"])
    taus = {d: fixed["results"][n]["0.0"]["tau"] for n, d in (("gsm8k", "math"),
                                                               ("humaneval", "code"))}
    assert fixed["domains"]["0.0"]["macro"] == pytest.approx(sum(taus.values()) / 2)
    md = render_report_md(report)
    assert f"The drafter at fixed gamma = {gamma}" in md
    assert f"| 0.0 | {taus['code']:.2f} | {taus['math']:.2f} |" in md
    # a fixed scheduler already is the drafter's own tau: no second pass
    plain = evaluate(engine=None, **dict(kwargs, max_new_tokens=4))
    assert "fixed_gamma" not in plain and plain["scheduler"] == "fixed"
