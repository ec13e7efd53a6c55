"""generate.backend: hf | vllm (issue 11, item 6): the config section validates with the field
named, the vllm backend's sampling, engine and processor settings map the shared generate settings
faithfully (pure functions, no vLLM here), a missing vLLM is reported before any stage runs, and
configs without the new fields keep their stage fingerprints. The real processor is built and run
in tests/interop/test_vllm_generate.py."""

from __future__ import annotations

import hashlib
import importlib.util
import json
import shutil
from pathlib import Path

import pytest

from pipeline.generate import vllm_backend as gv
from pipeline.config import ConfigError, SamplingConfig, VllmGenerateConfig, load_config
from pipeline.generate.hf import finish_answer, next_user_turn
from pipeline.stages import ADDED_LATER, StageContext, preflight, stage_fingerprint

ROOT = Path(__file__).resolve().parents[2]
QUICKSTART = ROOT / "infra" / "configs" / "quickstart.yaml"
QWEN = ROOT / "infra" / "configs" / "qwen3_4b.yaml"
# the quickstart's generate section as it was before it moved to the engine backend (session 28):
# the fingerprint tests below ask whether a config written before the backend fields existed, at
# their defaults, keeps its fingerprint
OLD_GENERATE = ["generate.backend=hf", "generate.batch_size=32", "generate.max_prompt_tokens=2048",
                "generate.kv_cache_memory_gib=4.0", "generate.max_num_requests=128"]


def _old_quickstart(overrides=()):
    return load_config(QUICKSTART, [*OLD_GENERATE, *overrides])


def test_hf_is_the_default_and_the_gpu_config_uses_vllm():
    from pipeline.config import GenerateConfig

    assert GenerateConfig().backend == "hf"
    assert load_config(QUICKSTART).generate.backend == "engine"  # its measured faster choice
    g = load_config(QWEN).generate
    assert g.backend == "vllm"
    assert (g.vllm.num_replicas, g.vllm.tensor_parallel_size) == (8, 1)
    # flipping back by override needs nothing else: the hf knobs are still there
    assert load_config(QWEN, ["generate.backend=hf"]).generate.num_actors == 8


@pytest.mark.parametrize("override, field", [
    ("generate.backend=sglang", "generate.backend"),
    ("generate.vllm.num_replicas=0", "generate.vllm.num_replicas"),
    ("generate.vllm.gpu_memory_utilization=1.5", "generate.vllm.gpu_memory_utilization"),
    ("generate.vllm.tensor_parallel_size=0", "generate.vllm.tensor_parallel_size"),
    ("generate.vllm.max_num_batched_tokens=0", "generate.vllm.max_num_batched_tokens"),
    ("generate.vllm.tp=2", "generate.vllm.tp: unknown key"),
])
def test_bad_backend_settings_name_the_field(override, field):
    with pytest.raises(ConfigError) as err:
        load_config(QWEN, [override])
    assert field in str(err.value)


def test_engine_kwargs_may_not_repeat_a_derived_setting():
    with pytest.raises(ConfigError) as err:
        load_config(QWEN, ["generate.vllm.engine_kwargs={tensor_parallel_size: 2, seed: 3, "
                           "enforce_eager: true}"])
    text = str(err.value)
    assert "generate.vllm.engine_kwargs" in text
    assert "tensor_parallel_size (comes from generate.vllm.tensor_parallel_size)" in text
    assert "seed (comes from seed)" in text and "enforce_eager (comes" not in text


def test_sampling_maps_one_to_one_onto_vllm_sampling_params():
    s = SamplingConfig(temperature=0.7, top_p=0.8, top_k=20, max_new_tokens=4096).model_dump()
    assert gv.sampling_params(s, [151645, 151643]) == {
        "n": 1, "temperature": 0.7, "top_p": 0.8, "top_k": 20, "max_tokens": 4096,
        "stop_token_ids": [151645, 151643], "ignore_eos": False, "detokenize": False}
    # greedy and "no top-k" mean the same in both backends (0 and 0)
    greedy = gv.sampling_params(SamplingConfig(temperature=0.0, top_k=0).model_dump(), [2])
    assert (greedy["temperature"], greedy["top_k"]) == (0.0, 0)


def test_engine_and_processor_settings():
    cfg = load_config(QWEN, ["generate.vllm.max_num_seqs=128",
                             "generate.vllm.accelerator_type=H100",
                             "generate.vllm.engine_kwargs={enable_prefix_caching: false}"])
    v = cfg.generate.vllm
    length = gv.engine_max_model_len(cfg.generate.max_prompt_tokens,
                                     cfg.generate.sampling.max_new_tokens, 40960)
    assert length == 2048 + 4096
    assert gv.engine_max_model_len(2048, 4096, 1024) == 1024  # never past the positions
    engine = gv.engine_kwargs(v, dtype=cfg.target.dtype, max_model_len=length, seed=cfg.seed)
    assert engine == {"tensor_parallel_size": 1, "dtype": "auto", "max_model_len": 6144,
                      "seed": 0, "gpu_memory_utilization": v.gpu_memory_utilization,
                      "max_num_seqs": 128, "max_num_batched_tokens": v.max_num_batched_tokens,
                      "enable_prefix_caching": False}
    kw = gv.processor_config_kwargs("Qwen/Qwen3-4B", v, engine)
    assert kw["concurrency"] == (8, 8) and kw["batch_size"] == v.batch_size
    assert kw["accelerator_type"] == "H100" and "placement_group_config" not in kw
    assert not (kw["chat_template_stage"] or kw["tokenize_stage"] or kw["detokenize_stage"])
    assert kw["should_continue_on_error"] and kw["engine_kwargs"] is engine


def test_missing_vllm_is_reported_before_any_stage_runs(tmp_path, monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "vllm" else real(name, *a))
    cfg = load_config(QWEN)
    ctx = StageContext(cfg, tmp_path, target="-", layer_ids=[], cache_dir=str(tmp_path / "cache"))
    with pytest.raises(gv.VllmNotInstalledError) as err:
        preflight(ctx, ["prompts", "generate"], forced=[])
    assert "generate.backend 'vllm'" in str(err.value) and "pip install 'ray[llm]" in str(err.value)
    preflight(ctx, ["cache"], forced=[])  # a run that does not generate does not need vLLM
    (tmp_path / "generate").mkdir()
    (tmp_path / "generate" / "_SUCCESS.json").write_text("{}")
    preflight(ctx, ["generate", "cache"], forced=[])  # generation already complete
    with pytest.raises(gv.VllmNotInstalledError):
        preflight(ctx, ["generate"], forced=["generate"])


def test_configs_without_the_backend_fields_keep_their_fingerprints():
    cfg = _old_quickstart()
    dumped = cfg.model_dump(mode="json")
    for key in ("backend", "vllm", "max_num_requests", "kv_cache_memory_gib", "reuse_from"):
        del dumped["generate"][key]  # the generate section as it was dumped before them
    del dumped["prompts"]["heldout_ids_from"]  # and the prompts section
    sections = ["prompts", "storage_options", "target", "generate", "seed"]  # as they were read
    before = hashlib.sha256(json.dumps({s: dumped[s] for s in sections},
                                       sort_keys=True).encode()).hexdigest()
    assert stage_fingerprint(cfg, "generate") == before
    for override in ("generate.backend=vllm", "generate.backend=engine",
                     "generate.max_num_requests=64", "prompts.heldout_ids_from=heldout.jsonl"):
        assert stage_fingerprint(_old_quickstart([override]), "generate") != before
    # where earlier answers may be taken from is not what the stage makes
    assert stage_fingerprint(_old_quickstart(["generate.reuse_from=[old.jsonl]"]),
                             "generate") == before


def test_conversation_walk_and_answer_end_shared_by_both_backends(smollm2_tokenizer):
    conv = [{"role": "system", "content": "s"}, {"role": "user", "content": "a"},
            {"role": "user", "content": "b"}, {"role": "system", "content": "tail"}]
    history: list[dict] = []
    cursor, has = next_user_turn(conv, history, 0)
    assert (cursor, has, [m["content"] for m in history]) == (2, True, ["s", "a"])
    cursor, has = next_user_turn(conv, history, cursor)
    assert (cursor, has) == (3, True)
    cursor, has = next_user_turn(conv, history, cursor)
    assert (cursor, has, history[-1]["content"]) == (4, False, "tail")
    tok = smollm2_tokenizer
    ids = tok(" Hello there", add_special_tokens=False)["input_ids"]
    assert finish_answer(tok, ids + [tok.eos_token_id, 5], {tok.eos_token_id}) == ("Hello there",
                                                                                  "stop")
    assert finish_answer(tok, ids, {tok.eos_token_id}) == ("Hello there", "length")


def test_end_tokens_read_from_the_target_files_match_the_hf_backend(tiny_target_dir, tmp_path):
    from serve.engine.target_loading import eos_token_ids, load_target, load_tokenizer

    target = tmp_path / "two_end_tokens"
    shutil.copytree(tiny_target_dir, target)
    tok = load_tokenizer(str(target))
    (target / "generation_config.json").write_text(json.dumps(
        {"eos_token_id": [tok.eos_token_id, 7]}))
    expected = eos_token_ids(tok, load_target(str(target), "float32"))
    assert gv.target_end_tokens(str(target)) == expected and 7 in expected
    (target / "generation_config.json").unlink()
    assert gv.target_end_tokens(str(target)) == [tok.eos_token_id]


def test_train_fields_added_this_release_keep_train_fingerprints():
    """train.plateau_patience, train.plateau_min_delta and train.max_train_rows at their defaults
    leave finished runs' train (and later) stages complete."""
    cfg = _old_quickstart()
    dumped = cfg.model_dump(mode="json")
    for key in ("plateau_patience", "plateau_min_delta", "max_train_rows", "placement_strategy",
                "data_mode", "stream_object_store_gib", "stream_shuffle_rows", "objective"):
        del dumped["train"][key]
    for key in ("backend", "vllm", "max_num_requests", "kv_cache_memory_gib", "reuse_from"):
        del dumped["generate"][key]
    sections = ["prompts", "storage_options", "target", "generate", "seed", "cache", "drafter",
                "train"]  # what the stages up to train read, written out as they were
    for section, key, default in ADDED_LATER:  # older additions, as the fingerprint drops them
        if section not in ("train", "generate") and dumped[section].get(key) == default:
            del dumped[section][key]
    before = hashlib.sha256(json.dumps({s: dumped[s] for s in sections},
                                       sort_keys=True).encode()).hexdigest()
    assert stage_fingerprint(cfg, "train") == before
    assert stage_fingerprint(_old_quickstart(["train.plateau_min_delta=0.02"]),
                             "train") != before
