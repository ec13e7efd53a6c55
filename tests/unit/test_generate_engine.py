"""generate.backend: engine (pipeline/generate/engine.py): the continuous-batching engine draws
answers from the distribution plain transformers ``generate`` samples (two-sample chi-square on
next-token histograms at three positions, the real SmolLM2 target), a row's answer does not depend
on its batch, and one bad row fails alone (the stage itself, on Ray:
tests/integration/test_generate_stage.py)."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from scipy.stats import chi2_contingency

from pipeline.generate.hf import GenerateUDF, answer_length
from pipeline.generate.engine import EngineGenerateUDF, answer_seed
from serve.engine.chat import render_prompt_ids
from serve.engine.target_loading import load_target

SAMPLING = {"temperature": 1.0, "top_p": 0.95, "top_k": 20, "max_new_tokens": 3}
N = 400  # answers per arm


def _two_sample_pvalue(a: list[int], b: list[int], min_expected: float = 5.0) -> float:
    """Chi-square test that two samples of token ids come from one distribution: a 2 x K table,
    tokens expected fewer than ``min_expected`` times in either row pooled into one column."""
    tokens = sorted(set(a) | set(b))
    table = np.array([[a.count(t) for t in tokens], [b.count(t) for t in tokens]], dtype=float)
    expected = table.sum(0) * min(table.sum(1)) / table.sum()
    keep = expected >= min_expected
    pooled = np.concatenate([table[:, keep], table[:, ~keep].sum(1, keepdims=True)], axis=1)
    pooled = pooled[:, pooled.sum(0) > 0]
    assert pooled.shape[1] >= 4  # enough cells for a meaningful test
    return float(chi2_contingency(pooled)[1])


@pytest.fixture(scope="module")
def engine_udf(smollm2_dir):
    return EngineGenerateUDF(str(smollm2_dir), "float32", SAMPLING, {}, num_threads=None,
                             max_prompt_tokens=64, seed=0, max_num_requests=128,
                             kv_cache_memory_gib=0.5)


def test_engine_backend_samples_the_distribution_of_hf_generate(smollm2_dir, engine_udf):
    # a short raw prompt (5 tokens, not the 37 of a chat-rendered one): each arm's cost is the
    # prompt's forward N times over; an answer may end early here, so the end token is one of
    # the outcomes compared and each position is compared over the answers that reached it
    prompt = engine_udf.tokenizer.encode("My favourite animal is the")
    ends = set(engine_udf.eos_ids)
    tokens, errors = engine_udf.sample_tokens([prompt] * N, [f"row{i}:0" for i in range(N)])
    assert errors == [""] * N
    assert all(len(t) == 3 or (t and t[-1] in ends) for t in tokens)
    assert all(x not in ends for t in tokens for x in t[:-1])  # nothing drawn past an end

    model = load_target(str(smollm2_dir), "float32")
    torch.manual_seed(0)
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt] * N), attention_mask=torch.ones(N, len(prompt),
                                                                                   dtype=torch.long),
                             do_sample=True, temperature=SAMPLING["temperature"],
                             top_p=SAMPLING["top_p"], top_k=SAMPLING["top_k"], max_new_tokens=3,
                             eos_token_id=sorted(ends),
                             pad_token_id=engine_udf.tokenizer.pad_token_id)
    # each answer through its first end token (transformers pads after it)
    hf = [t[:answer_length(t, ends)] for t in out[:, len(prompt):].tolist()]
    assert any(t[-1] in ends for t in hf + tokens)  # an end token was among the outcomes
    for pos in range(3):
        p = _two_sample_pvalue([t[pos] for t in tokens if len(t) > pos],
                               [t[pos] for t in hf if len(t) > pos])
        assert p > 1e-3, f"position {pos + 1}: p = {p:.2g}"
    # the draws are not degenerate: the first position has several likely tokens
    assert len({t[0] for t in tokens}) >= 4


def test_a_rows_answer_depends_on_its_key_not_its_batch(engine_udf):
    tok = engine_udf.tokenizer
    prompts = [render_prompt_ids(tok, [{"role": "user", "content": c}], {})
               for c in ("Name a colour.", "Say hello.", "What is 2 + 2?")]
    alone, _ = engine_udf.sample_tokens(prompts[1:2], ["b:0"])
    together, _ = engine_udf.sample_tokens(prompts, ["a:0", "b:0", "c:0"])
    assert together[1] == alone[0]
    assert answer_seed(0, "b:0") != answer_seed(0, "b:1") != answer_seed(1, "b:0")


def test_a_refused_row_fails_alone(engine_udf):
    tok = engine_udf.tokenizer
    good = render_prompt_ids(tok, [{"role": "user", "content": "Say hello."}], {})
    too_long = good * 400  # past the engine's model length
    tokens, errors = engine_udf.sample_tokens([good, too_long, good], ["a:0", "b:0", "c:0"])
    assert errors[0] == errors[2] == "" and "exceeds the model length" in errors[1]
    assert len(tokens[0]) >= 1 and tokens[1] == []


def test_a_failed_step_leaves_nothing_in_the_engine(engine_udf, monkeypatch):
    """A step that raises (out of memory, say) frees this call's requests, so the caller's
    row-by-row retry runs on an empty engine."""
    tok = engine_udf.tokenizer
    prompt = render_prompt_ids(tok, [{"role": "user", "content": "Say hello."}], {})
    real_step = engine_udf.engine.step
    monkeypatch.setattr(engine_udf.engine, "step",
                        lambda: (_ for _ in ()).throw(MemoryError("simulated")))
    with pytest.raises(MemoryError):
        engine_udf.sample_tokens([prompt, prompt], ["a:0", "b:0"])
    assert not engine_udf.engine.has_unfinished()
    monkeypatch.setattr(engine_udf.engine, "step", real_step)
    tokens, errors = engine_udf.sample_tokens([prompt], ["a:0"])
    assert errors == [""] and tokens[0]


def test_the_kv_budget_must_hold_the_longest_prompt_and_answer(smollm2_dir):
    with pytest.raises(ValueError, match="generate.kv_cache_memory_gib"):
        EngineGenerateUDF(str(smollm2_dir), "float32", dict(SAMPLING, max_new_tokens=512), {},
                          num_threads=None, max_prompt_tokens=1024, seed=0, max_num_requests=64,
                          kv_cache_memory_gib=0.05)


def test_the_hf_udf_counts_generated_tokens_too(tiny_target_dir):
    udf = GenerateUDF(str(tiny_target_dir), "float32", dict(SAMPLING, max_new_tokens=4), {},
                      num_threads=1, max_prompt_tokens=64, seed=0)
    udf._generate([[5, 6, 7], [8, 9]], ["a:0", "b:0"])
    assert 2 <= udf.generated_tokens <= 8


def _batch(rows: list[dict]) -> dict[str, np.ndarray]:
    return {"id": np.array([r["id"] for r in rows]),
            "domain": np.array([r["domain"] for r in rows]),
            "messages": np.array([json.dumps(r["messages"]) for r in rows])}


def test_the_engine_walks_each_conversation_as_the_hf_backend_does_and_yields_rows_early(
        smollm2_dir, monkeypatch):
    """Multi-turn rows (user and system turns, as the prompts stage writes them), a row too long
    for the prompt limit: the engine's
    per-conversation walk (next turn queued when the previous answer ends) writes the hf
    backend's turn-by-turn rows (greedy, fp32), every row once, in more than one chunk."""
    import pipeline.generate.engine as generate_engine

    monkeypatch.setattr(generate_engine, "FLUSH_S", 0.0)
    greedy = dict(SAMPLING, temperature=0.0, max_new_tokens=5)
    rows = [{"id": "one", "domain": "chat", "messages": [{"role": "user", "content": "Hi?"}]},
            {"id": "three", "domain": "chat", "messages": [
                {"role": "system", "content": "Be brief."},
                {"role": "user", "content": "Name a colour."},
                {"role": "user", "content": "Another one?"},
                {"role": "user", "content": "And a third?"}]},
            {"id": "long", "domain": "math", "messages": [{"role": "user", "content": "x " * 90}]},
            {"id": "two", "domain": "code", "messages": [
                {"role": "user", "content": "Write 1+1 in Python."},
                {"role": "user", "content": "Now 2+2."}]}]
    common = dict(target=str(smollm2_dir), dtype="float32", sampling=greedy, template_kwargs={},
                  num_threads=None, max_prompt_tokens=64, seed=0)
    engine = EngineGenerateUDF(**common, max_num_requests=2, kv_cache_memory_gib=0.05)
    chunks = list(engine(_batch(rows)))
    assert len(chunks) > 1  # finished conversations left before the last one ended
    got = {c["id"][j]: {k: c[k][j] for k in c} for c in chunks for j in range(len(c["id"]))}
    assert sorted(got) == sorted(r["id"] for r in rows)  # every row exactly once
    assert sum(len(c["id"]) for c in chunks) == len(rows)
    hf = GenerateUDF(**common)(_batch(rows))
    for j, rid in enumerate(hf["id"]):
        assert got[rid] == {k: hf[k][j] for k in hf}, rid
    assert "max_prompt_tokens" in got["long"]["error"]
    three = json.loads(got["three"]["messages"])
    assert [t["role"] for t in three] == ["system", "user", "assistant", "user", "assistant",
                                          "user", "assistant"]


def test_a_failed_engine_step_retries_each_answer_alone_and_the_walk_goes_on(smollm2_dir,
                                                                              monkeypatch):
    """engine.step raising mid-batch: every interrupted answer is decoded alone before any next
    turn is queued, multi-turn rows go on, and the rows equal the hf backend's (greedy, fp32)."""
    greedy = dict(SAMPLING, temperature=0.0, max_new_tokens=4)
    rows = [{"id": f"r{i}", "domain": "chat", "messages": [
        {"role": "user", "content": f"Say {i}."}, {"role": "user", "content": "Again?"}]}
        for i in range(3)]
    common = dict(target=str(smollm2_dir), dtype="float32", sampling=greedy, template_kwargs={},
                  num_threads=None, max_prompt_tokens=64, seed=0)
    engine = EngineGenerateUDF(**common, max_num_requests=4, kv_cache_memory_gib=0.05)
    real_step, calls = engine.engine.step, {"n": 0}

    def failing_step():
        calls["n"] += 1
        if calls["n"] == 3:
            raise RuntimeError("step failed")
        return real_step()

    monkeypatch.setattr(engine.engine, "step", failing_step)
    chunks = list(engine(_batch(rows)))
    got = {c["id"][j]: {k: c[k][j] for k in c} for c in chunks for j in range(len(c["id"]))}
    assert calls["n"] > 3 and not engine.engine.has_unfinished()
    hf = GenerateUDF(**common)(_batch(rows))
    for j, rid in enumerate(hf["id"]):
        assert got[rid] == {k: hf[k][j] for k in hf}, rid
