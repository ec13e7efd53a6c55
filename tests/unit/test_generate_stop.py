"""The generate stage stops on the same end-token set as serving (issue: a target whose generation
config lists two end tokens, as Qwen3's does, must not get training answers that run past the
second one)."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from pipeline.generate.hf import GenerateUDF
from pipeline.generate.engine import EngineGenerateUDF
from serve.engine.target_loading import eos_token_ids, load_target, load_tokenizer
from tests.unit.helpers import greedy_reference


@pytest.mark.parametrize("backend", ["hf", "engine"])
def test_generation_stops_at_every_end_token_of_the_generation_config(tiny_target_dir, tmp_path,
                                                                      backend):
    target = tmp_path / "two_end_tokens"
    shutil.copytree(tiny_target_dir, target)
    tok = load_tokenizer(str(target))
    model = load_target(str(target), "float32")
    prompt = tok.apply_chat_template([{"role": "user", "content": "Count to ten."}],
                                     add_generation_prompt=True, tokenize=True, return_dict=False)
    with torch.no_grad():
        ref = greedy_reference(model, list(prompt), 8)
    second_end = next(t for t in ref[2:] if t != tok.eos_token_id)
    cfg_path = target / "generation_config.json"
    gen_cfg = json.loads(cfg_path.read_text()) if cfg_path.exists() else {}
    gen_cfg["eos_token_id"] = [tok.eos_token_id, second_end]
    cfg_path.write_text(json.dumps(gen_cfg))
    assert eos_token_ids(tok, load_target(str(target), "float32")) == [tok.eos_token_id, second_end]

    sampling = {"temperature": 0.0, "top_k": 0, "top_p": 1.0, "max_new_tokens": 8}
    if backend == "hf":
        udf = GenerateUDF(str(target), "float32", sampling, {}, num_threads=1,
                          max_prompt_tokens=512, seed=0)
    else:
        udf = EngineGenerateUDF(str(target), "float32", sampling, {}, num_threads=1,
                                max_prompt_tokens=512, seed=0, max_num_requests=4,
                                kv_cache_memory_gib=0.05)
    texts, reasons, errors = udf._generate([list(prompt)], ["row:0"])
    assert errors == [""]
    cut = ref.index(second_end)
    assert reasons == ["stop"]
    assert texts[0] == tok.decode(ref[:cut], skip_special_tokens=True).strip()
