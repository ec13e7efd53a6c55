"""DSpark exports: vLLM's native ``Qwen3DSparkModel`` (vLLM 0.32+) and speculators'
``DSparkSpeculator``, which vLLM converts itself.

Conventions (read from vLLM's ``qwen3_dspark.py``): the mask is a token id whose embedding row the
export replaces by our learned mask vector (so the export ships its own copy of the target's
embedding); the Markov head's W1 is indexed by target id (ours by draft id, +1 row for "outside
the draft vocabulary"); W2 and the LM head follow the draft vocabulary in ascending target ids;
the confidence head is served raw (vLLM's adaptive verification has no per-position STS
temperatures). The RNN head and layers without q/k norms are refused.
"""

from __future__ import annotations

import torch

from .common import (ExportError, Exporter, ExportFiles, ExportInputs, aux_layer_ids,
                     backbone_tensors, check_qwen3_layers, draft_lm_head, proposals,
                     qwen3_layer_config, speculators_header)


def check(cfg, target_layers: int) -> None:
    """Raises ExportError: a head other than the Markov head, or see
    :func:`~drafters.export.common.check_qwen3_layers`."""
    if cfg.head_type != "markov":
        raise ExportError(f"vLLM's Qwen3DSparkModel has the Markov head only; this drafter has "
                          f"head_type {cfg.head_type!r}")
    check_qwen3_layers(cfg, target_layers)


def target_indexed_w1(drafter) -> torch.Tensor:
    """The Markov head's W1 with one row per target id [V, r] (vLLM indexes it by the target id
    of the previous token; ours by its draft id, the last row standing for ids outside)."""
    w1 = drafter.head.w1.weight.detach()
    if drafter.d2t is None:
        return w1
    return w1[drafter.t2d.to(w1.device)]


def dspark_tensors(drafter, embed_weight: torch.Tensor, lm_head_weight: torch.Tensor,
                   mask_token_id: int) -> dict[str, torch.Tensor]:
    """Our DSpark state -> the tensors vLLM's ``Qwen3DSparkForCausalLM.load_weights`` reads
    (unprefixed names; q/k/v and gate/up are stacked by vLLM)."""
    sd = {k: v.detach() for k, v in drafter.state_dict().items()}
    out = backbone_tensors(drafter)
    embed = embed_weight.detach().to(sd["mask_embedding"].dtype).clone()
    embed[mask_token_id] = sd["mask_embedding"]
    out["embed_tokens.weight"] = embed  # differs from the target's: vLLM keeps this copy
    out["markov_head.markov_w1.weight"] = target_indexed_w1(drafter)  # by target id: any order
    w2 = sd["head.w2.weight"]
    if drafter.confidence is not None:
        out["confidence_head.proj.weight"] = sd["confidence.proj.weight"]
        out["confidence_head.proj.bias"] = sd["confidence.proj.bias"]
    head, order = draft_lm_head(drafter, lm_head_weight, embed.dtype)
    out.update(head)
    out["markov_head.markov_w2.weight"] = w2 if order is None else w2[order.to(w2.device)]
    return out


def dspark_vllm_config(drafter, mask_token_id: int, dtype: str) -> dict:
    cfg = drafter.config
    ids = list(cfg.target_layer_ids)
    return {"architectures": ["Qwen3DSparkModel"], **qwen3_layer_config(cfg, dtype),
            "draft_vocab_size": cfg.draft_vocab_len, "target_hidden_size": cfg.target_hidden_size,
            "block_size": cfg.block_size, "target_layer_ids": ids,
            "mask_token_id": mask_token_id,
            # causal stated: vLLM makes a sliding layer causal unless the config says otherwise
            "dflash_config": {"mask_token_id": mask_token_id, "target_layer_ids": ids,
                              "causal": False},
            "markov_rank": cfg.options.markov_rank, "markov_head_type": "vanilla",
            "enable_confidence_head": bool(cfg.confidence_head),
            "confidence_head_with_markov": True, "sample_from_anchor": True,
            "logit_scale": 1.0}


def dspark_speculators_config(drafter, mask_token_id: int, dtype: str, verifier: dict) -> dict:
    cfg = drafter.config
    return {**speculators_header(cfg, "DSparkSpeculator", "dspark", dtype),
            "block_size": cfg.block_size, "aux_hidden_state_layer_ids": aux_layer_ids(cfg),
            "mask_token_id": mask_token_id, "sample_from_anchor": True,
            # the block attends both ways, as trained: vLLM's update_dflash sets
            # dflash_config.causal = not sliding_window_non_causal (DSpark shares it), and the
            # speculators trainer makes a windowed block causal unless this is true
            "sliding_window_non_causal": True, "target_hidden_size": cfg.target_hidden_size,
            "markov_rank": cfg.options.markov_rank, "markov_head_type": "vanilla",
            "enable_confidence_head": bool(cfg.confidence_head),
            "confidence_head_with_markov": True,
            "speculators_config": proposals("dspark", cfg.block_size, verifier)}


def readme_rows(cfg, mask_token_id: int) -> list[tuple[str, str, str]]:
    temps = cfg.calibration_temperatures
    return [("mask input", "a learned vector", f"embedding row {mask_token_id} "
             "(`mask_token_id`) of a copy of the target's embedding; a round whose anchor "
             "is that token drafts with the mask's embedding (lossless, shorter drafts)"),
            ("Markov head", "W1 by draft id", "`markov_head.markov_w1` by target id"),
            ("confidence head", f"with STS temperatures {temps}" if temps else "uncalibrated",
             "raw confidence (vLLM's adaptive verification has no per-position temperatures): "
             "calibration does not carry over" if cfg.confidence_head else "none")]


def _write(config_fn):
    def write(x: ExportInputs) -> ExportFiles:
        d = x.drafter
        return ExportFiles(tensors=dspark_tensors(d, x.embed, x.lm_head, x.mask_token_id),
                           config=config_fn(d, x),
                           readme_rows=readme_rows(d.config, x.mask_token_id))
    return write


EXPORTERS = {
    "vllm": Exporter(check, _write(lambda d, x: dspark_vllm_config(d, x.mask_token_id,
                                                                  x.dtype_name)),
                     mask_token=True),
    "speculators": Exporter(check, _write(lambda d, x: dspark_speculators_config(
        d, x.mask_token_id, x.dtype_name, x.verifier)), mask_token=True),
}
