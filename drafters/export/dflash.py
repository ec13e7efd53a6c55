"""DFlash exports: vLLM's native ``DFlashDraftModel`` (-> ``DFlashQwen3ForCausalLM``) and
speculators' ``DFlashSpeculator``, which vLLM converts itself.

Conventions (read from vLLM's ``qwen3_dflash.py``): the block is the anchor plus block_size masks
attending both ways (``dflash_config.causal`` false; speculators: ``sliding_window_non_causal``
true), and its ``block_size`` counts those block inputs as z-lab's and speculators' DFlash do:
our ``config.num_block_inputs`` (block_size + the spec's ``anchor_slots``), served with
``num_speculative_tokens`` = our block_size. The mask vector travels in ``mask_embedding.pt``
for the mask token id (vLLM's ``_read_mask_embedding``) and the target's embedding is shared; the
speculators package's own DFlash model ignores that file. Layers without q/k norms are refused.
"""

from __future__ import annotations

import torch

from .common import (Exporter, ExportFiles, ExportInputs, aux_layer_ids, backbone_tensors,
                     check_qwen3_layers, draft_lm_head, proposals, qwen3_layer_config,
                     speculators_header)


def dflash_tensors(drafter, lm_head_weight: torch.Tensor) -> dict[str, torch.Tensor]:
    """Our DFlash state -> the tensors vLLM's ``DFlashQwen3ForCausalLM.load_weights`` reads.

    Unprefixed names (vLLM prefixes ``model.``; q/k/v and gate/up are stacked by
    ``DFlashQwen3Model.hf_to_vllm_mapper``), layers numbered from 0 (vLLM offsets only the KV-cache
    names by the target's layer count). No ``embed_tokens``: vLLM then shares the target's
    embedding, and the mask vector travels in ``mask_embedding.pt`` (:func:`dflash_mask_file`).

    Returns:
        {"fc.weight": [H, m*H_t], "hidden_norm.weight": [H], "norm.weight": [H], "layers.*",
        "lm_head.weight": [N, H], "d2t": int64 [N] (draft vocabulary only)}.
    """
    out = backbone_tensors(drafter)
    out.update(draft_lm_head(drafter, lm_head_weight, out["fc.weight"].dtype)[0])
    return out


def dflash_mask_file(drafter, mask_token_id: int, dtype: torch.dtype) -> dict:
    """The ``mask_embedding.pt`` content vLLM's DFlash loader (``_read_mask_embedding``) reads:
    {"mask_token_id": int, "embedding": [H] in ``dtype``}. vLLM embeds every query slot whose
    input id is ``mask_token_id`` with this vector (``DFlashQwen3Model.embed_input_ids``), and
    refuses a file whose id differs from ``dflash_config.mask_token_id``."""
    vec = drafter.mask_embedding.detach().to(dtype).contiguous().cpu().clone()
    return {"mask_token_id": int(mask_token_id), "embedding": vec}


def dflash_vllm_config(drafter, mask_token_id: int, dtype: str) -> dict:
    """vLLM's native DFlash config (``DFlashDraftModel``, a Qwen3 config with ``dflash_config``);
    ``block_size`` counts the block inputs (see the module docstring)."""
    cfg = drafter.config
    return {"architectures": ["DFlashDraftModel"], **qwen3_layer_config(cfg, dtype),
            "draft_vocab_size": cfg.draft_vocab_len, "target_hidden_size": cfg.target_hidden_size,
            "block_size": cfg.num_block_inputs,
            "dflash_config": {"mask_token_id": mask_token_id,
                              "target_layer_ids": list(cfg.target_layer_ids), "causal": False}}


def dflash_speculators_config(drafter, mask_token_id: int, dtype: str, verifier: dict) -> dict:
    """speculators 0.9's ``DFlashSpeculatorConfig``; vLLM's ``update_dflash`` turns it into the
    config of :func:`dflash_vllm_config` (aux ids ``l + 1``; ``sliding_window_non_causal`` true
    is what makes vLLM's ``dflash_config.causal`` false)."""
    cfg = drafter.config
    return {**speculators_header(cfg, "DFlashSpeculator", "dflash", dtype),
            "block_size": cfg.num_block_inputs, "aux_hidden_state_layer_ids": aux_layer_ids(cfg),
            "mask_token_id": mask_token_id, "sample_from_anchor": False,
            "sliding_window_non_causal": True, "target_hidden_size": cfg.target_hidden_size,
            "speculators_config": proposals("dflash", cfg.block_size, verifier)}


def readme_rows(cfg, mask_token_id: int, fmt: str) -> list[tuple[str, str, str]]:
    return [("mask input", "a learned vector", f"the same vector in `mask_embedding.pt` for "
             f"id {mask_token_id} (`mask_token_id`); the target's embedding is shared; a "
             "round whose anchor is that token drafts with the mask's embedding (lossless, "
             "shorter drafts)"
             + ("; the speculators package's own DFlash model ignores the file and "
                "embeds the mask as that id's verifier row" if fmt == "speculators" else "")),
            ("block", f"anchor + {cfg.block_size} masks, bidirectional",
             f"`block_size` {cfg.num_block_inputs} (anchor included), non-causal "
             "(`dflash_config.causal` false); serve with `num_speculative_tokens` "
             f"{cfg.block_size}")]


def _write(fmt: str, config_fn):
    def write(x: ExportInputs) -> ExportFiles:
        d = x.drafter
        return ExportFiles(tensors=dflash_tensors(d, x.lm_head), config=config_fn(d, x),
                           files={"mask_embedding.pt": dflash_mask_file(d, x.mask_token_id,
                                                                        x.dtype)},
                           readme_rows=readme_rows(d.config, x.mask_token_id, fmt))
    return write


EXPORTERS = {
    "vllm": Exporter(check_qwen3_layers, _write("vllm", lambda d, x: dflash_vllm_config(
        d, x.mask_token_id, x.dtype_name)), mask_token=True),
    "speculators": Exporter(check_qwen3_layers, _write("speculators", lambda d, x:
                            dflash_speculators_config(d, x.mask_token_id, x.dtype_name,
                                                      x.verifier)), mask_token=True),
}
