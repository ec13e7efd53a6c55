"""The generate stage's Ray Data pass (``pipeline.generate.hf.run_generate``): both splits in one
pass, each to its own file; the engine backend writes the hf backend's rows (greedy, fp32);
a re-run resumes by id; rows leave an actor as soon as it yields them; a prompt id in two splits
is refused before anything runs."""

from __future__ import annotations

import json

import pytest

from pipeline.config import GenerateConfig, SamplingConfig
from pipeline.generate.hf import run_generate

pytestmark = [pytest.mark.slow, pytest.mark.ray]
SAMPLING = {"temperature": 1.0, "top_p": 0.95, "top_k": 20, "max_new_tokens": 3}


def test_the_stage_writes_the_hf_backends_rows_and_resumes_by_id(smollm2_dir, tmp_path,
                                                                  ray_local):
    rows = [{"id": f"p{i}", "domain": "chat",
             "messages": [{"role": "user", "content": f"Question {i}?"}]} for i in range(6)]
    rows.append({"id": "long", "domain": "chat",
                 "messages": [{"role": "user", "content": "word " * 400}]})
    hf = GenerateConfig(sampling=SamplingConfig(**dict(SAMPLING, max_new_tokens=6,
                                                       temperature=0.0)),
                        batch_size=4, num_actors=1, cpus_per_actor=1, gpus_per_actor=0,
                        num_threads=1, max_prompt_tokens=64)
    engine = hf.model_copy(update={"backend": "engine", "max_num_requests": 4,
                                   "kv_cache_memory_gib": 0.05})
    common = dict(target=str(smollm2_dir), dtype="float32", template_kwargs={}, seed=0)
    out, err = tmp_path / "engine" / "train.jsonl", tmp_path / "engine" / "errors.jsonl"
    held = tmp_path / "engine" / "heldout.jsonl"
    first = run_generate({"train": (rows[:3], out)}, err, engine, **common)
    assert first == {"train": {"generated": 3, "errors": 0, "skipped": 0}}
    # both splits in one pass, each to its own file; the long prompt fails alone
    again = run_generate({"train": (rows[:5], out), "heldout": (rows[5:], held)}, err, engine,
                         **common)
    assert again == {"train": {"generated": 2, "errors": 0, "skipped": 3},
                     "heldout": {"generated": 1, "errors": 1, "skipped": 0}}
    train_rows = [json.loads(line) for line in out.read_text().splitlines()]
    held_rows = [json.loads(line) for line in held.read_text().splitlines()]
    assert sorted(r["id"] for r in train_rows) == [f"p{i}" for i in range(5)]
    assert [r["id"] for r in held_rows] == ["p5"]
    written = train_rows + held_rows
    assert "max_prompt_tokens" in err.read_text()
    hf_out = tmp_path / "hf" / "train.jsonl"
    run_generate({"train": (rows[:6], hf_out)}, tmp_path / "hf" / "errors.jsonl", hf, **common)
    hf_rows = {r["id"]: r for r in map(json.loads, hf_out.read_text().splitlines())}
    for r in written:  # greedy: the same answers, the same fields
        assert r == hf_rows[r["id"]]


class _WaitsForItsFirstRow:
    """A generate actor that yields one row, then waits until the stage has written it to the
    output file (its ``target`` argument) before yielding the rest: it raises if rows only leave
    an actor at the end of its batch."""

    def __init__(self, target, **_):
        from pathlib import Path

        self.out = Path(target)

    def __call__(self, batch):
        import time

        def rows(sl):
            return {"id": list(batch["id"][sl]), "domain": list(batch["domain"][sl]),
                    "messages": list(batch["messages"][sl]),
                    "finish_reasons": ['["stop"]'] * len(batch["id"][sl]),
                    "error": [""] * len(batch["id"][sl])}

        yield rows(slice(0, 1))
        deadline = time.monotonic() + 60
        while str(batch["id"][0]) not in (self.out.read_text() if self.out.exists() else ""):
            if time.monotonic() > deadline:
                raise TimeoutError("the first yielded row was not written while the batch ran")
            time.sleep(0.2)
        yield rows(slice(1, None))


def test_the_stage_writes_rows_an_actor_yields_before_its_batch_ends(tmp_path, ray_local):
    rows = [{"id": f"p{i}", "domain": "chat",
             "messages": [{"role": "user", "content": f"Question {i}?"}]} for i in range(5)]
    cfg = GenerateConfig(batch_size=8, num_actors=1, cpus_per_actor=1, gpus_per_actor=0)
    out = tmp_path / "train.jsonl"
    counts = run_generate({"train": (rows, out)}, tmp_path / "errors.jsonl", cfg,
                          target=str(out), dtype="float32", template_kwargs={}, seed=0,
                          udf=_WaitsForItsFirstRow)
    assert counts == {"train": {"generated": 5, "errors": 0, "skipped": 0}}
    assert sorted(json.loads(line)["id"] for line in out.read_text().splitlines()) == [
        f"p{i}" for i in range(5)]


def test_a_prompt_id_in_two_splits_is_refused_before_anything_runs(tmp_path):
    row = {"id": "p0", "domain": "chat", "messages": [{"role": "user", "content": "Hi?"}]}
    cfg = GenerateConfig(batch_size=8, num_actors=1, cpus_per_actor=1, gpus_per_actor=0)
    with pytest.raises(ValueError, match="'p0' is in splits 'train' and 'heldout'"):
        run_generate({"train": ([row], tmp_path / "train.jsonl"),
                      "heldout": ([row], tmp_path / "heldout.jsonl")}, tmp_path / "errors.jsonl",
                     cfg, target="-", dtype="float32", template_kwargs={}, seed=0)
    assert not (tmp_path / "train.jsonl").exists()
