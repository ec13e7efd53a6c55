"""Export a drafter checkpoint to the formats other serving engines load.

    python -m drafters.export --format vllm|speculators|eagle3 SRC DST [--target T]
                              [--mask-token-id ID] [--dtype bfloat16]

- ``vllm``: vLLM's native DSpark drafter (``Qwen3DSparkModel``, vLLM 0.32+) or DFlash drafter
  (``DFlashDraftModel`` -> ``DFlashQwen3ForCausalLM``): a Qwen3-style config with the DSpark /
  ``dflash_config`` fields, weights named as ``qwen3_dspark.py`` / ``qwen3_dflash.py`` load them.
- ``speculators``: the same weights with the ``speculators`` package's config (``DSparkSpeculator``
  / ``DFlashSpeculator`` / ``Eagle3Speculator``), which vLLM detects and converts itself.
- ``eagle3``: an Eagle3 drafter in the SpecForge / vLLM layout (``midlayer.*``, ``d2t``, ``t2d``,
  ``lm_head``) for vLLM's ``Eagle3Qwen3ForCausalLM`` / ``LlamaForCausalLMEagle3`` and SGLang.

The names, shapes and conventions were read from vLLM 0.32's loaders (``qwen3_dspark.py``,
``qwen3_dflash.py``, ``qwen3_eagle3.py``, ``llama_eagle3.py``, ``eagle3_utils.py``,
``configs/speculators/algos.py``) and speculators 0.9's configs; ``tests/interop`` loads the DSpark
and DFlash exports with vLLM's own model classes and compares block hidden states and logits. What
does not carry over is written to ``DST/README.md`` and refused when the engine cannot represent
it (:class:`ExportError`):

- the mask: ours is a learned vector; vLLM feeds the id ``mask_token_id`` to every mask slot.
  DSpark reads its embedding row, so the export ships the target's embedding with that row
  replaced; DFlash reads the vector itself from ``mask_embedding.pt`` (``_read_mask_embedding``)
  and shares the target's embedding. The id is one no tokenizer id maps to when the target has
  one, else a special token the target never emits in answers (an anchor equal to it would be
  embedded as the mask); the speculators package's own DFlash model ignores the file;
- ``d2t``: ours maps draft ids to target ids; vLLM's holds offsets (target = draft + d2t[draft]);
  the draft vocabulary is listed in ascending target ids;
- the Markov head's W1 is indexed by draft ids (+1 row for "outside the draft vocabulary") here
  and by target ids in vLLM: row t gets our row of t's draft id (or the outside row);
- layer ids: ours are 0-based decoder layers (transformers' ``hidden_states[l + 1]``), as vLLM's
  ``target_layer_ids`` / ``dflash_config.target_layer_ids``; its aux/Eagle3 ids (and speculators'
  ``aux_hidden_state_layer_ids``) are ``l + 1``. Checkpoint layers are numbered from 0 (vLLM
  offsets only their KV-cache names by the target's layer count). vLLM records the last layer
  before the final norm and transformers after it, so a drafter reading the last layer is refused;
- DFlash's block: anchor + gamma masks attending both ways; vLLM's ``dflash_config.causal`` false
  (speculators: ``sliding_window_non_causal`` true), ``block_size`` gamma + 1 as z-lab's and
  speculators' DFlash count it, served with ``num_speculative_tokens`` gamma;
- STS temperatures (per-position confidence calibration) have no field in vLLM: its adaptive
  verification uses the raw confidence (SGLang's and TensorRT-LLM's STS and SPS files are written
  by ``python -m serve.engine_files``, which can read the engine's SPS profile);
- the RNN head and layers without q/k norms (vLLM's DSpark and DFlash attention always normalise
  q and k) are refused.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

FORMATS = ("vllm", "speculators", "eagle3")
SPECULATORS_VERSION = "0.9.0"


class ExportError(ValueError):
    """The drafter cannot be represented in the requested format (the reason is named)."""


# ------------------------------------------------------------------------------ pieces
def choose_mask_token(vocab_size: int, tokenizer_len: int | None, special_ids: list[int],
                      end_ids: list[int]) -> int:
    """The token id vLLM feeds to the mask slots (DSpark reads its embedding row, DFlash
    replaces it by ``mask_embedding.pt``).

    An id no token maps to (the target's embedding has more rows than its tokenizer) is never an
    anchor; otherwise a special token that ends nothing (an end token is an anchor whenever a
    request goes on after it, e.g. with ``ignore_eos``).

    Raises:
        ExportError: neither exists (pass ``--mask-token-id``).
    """
    if tokenizer_len is not None and tokenizer_len < vocab_size:
        return tokenizer_len
    candidates = [i for i in special_ids if i not in end_ids and 0 <= i < vocab_size]
    if not candidates:
        raise ExportError("no unused embedding row and no special token to use as the mask "
                          "token: pass --mask-token-id")
    return max(candidates)


def vllm_offsets(d2t: torch.Tensor) -> torch.Tensor:
    """Our draft-to-target ids int64 [N] -> vLLM's offsets int64 [N] (target = i + d2t[i])."""
    return d2t - torch.arange(d2t.numel(), dtype=d2t.dtype)


def target_indexed_w1(drafter) -> torch.Tensor:
    """The Markov head's W1 with one row per target id [V, r] (vLLM indexes it by the target id
    of the previous token; ours by its draft id, the last row standing for ids outside)."""
    w1 = drafter.head.w1.weight.detach()
    if drafter.d2t is None:
        return w1
    return w1[drafter.t2d.to(w1.device)]


def ascending_vocab(d2t: torch.Tensor) -> torch.Tensor:
    """The permutation that sorts the draft vocabulary by target id: ours is ordered by
    frequency, while the Eagle3 ``t2d`` mask (and any engine that rebuilds the map from it)
    implies ascending ids. Rows indexed by draft id are exported in this order."""
    return torch.argsort(d2t)


def _check_layers(cfg, target_layers: int) -> None:
    if cfg.target_layer_ids and max(cfg.target_layer_ids) >= target_layers - 1:
        raise ExportError(
            f"the drafter reads the target's last layer ({max(cfg.target_layer_ids)}): "
            "transformers reports it after the final norm, vLLM before it, so the features "
            "would differ; train with target.layer_ids below the last layer")


def _qwen3_layer_config(cfg, dtype: str) -> dict:
    """The decoder-layer fields of a Qwen3 config for the drafter's own layers."""
    return {"model_type": "qwen3", "hidden_size": cfg.hidden_size,
            "intermediate_size": cfg.intermediate_size,
            "num_hidden_layers": cfg.num_hidden_layers,
            "num_attention_heads": cfg.num_attention_heads,
            "num_key_value_heads": cfg.num_key_value_heads, "head_dim": cfg.head_dim,
            "hidden_act": "silu", "rms_norm_eps": cfg.rms_norm_eps,
            "max_position_embeddings": cfg.max_position_embeddings,
            "rope_parameters": {"rope_type": "default", "rope_theta": cfg.rope_theta},
            "attention_bias": False, "tie_word_embeddings": False,
            "vocab_size": cfg.target_vocab_size, "dtype": dtype,
            "layer_types": ["full_attention"] * cfg.num_hidden_layers,
            "use_sliding_window": False, "sliding_window": None}


# ------------------------------------------------------------------------------ DSpark / DFlash
def _check_block_drafter(cfg, target_layers: int) -> None:
    """Refuse what vLLM's ``Qwen3DSparkModel`` / ``DFlashDraftModel`` cannot hold.

    Raises:
        ExportError: an Eagle3 drafter (``--format eagle3``), a DSpark head other than the
            Markov head, layers without q/k norms (vLLM's ``DFlashQwen3Attention`` always
            normalises q and k; an RMSNorm with unit weight is no identity), or a drafter reading
            the target's last layer.
    """
    kind = "DSpark" if cfg.drafter_type == "dspark" else "DFlash"
    if cfg.drafter_type not in ("dspark", "dflash"):
        raise ExportError(f"--format vllm/speculators exports DSpark and DFlash drafters; this "
                          f"one is {cfg.drafter_type} (use --format eagle3)")
    if cfg.drafter_type == "dspark" and cfg.head_type != "markov":
        raise ExportError(f"vLLM's Qwen3DSparkModel has the Markov head only; this drafter has "
                          f"head_type {cfg.head_type!r}")
    if not cfg.qk_norm:
        raise ExportError(f"vLLM's {kind} layers are Qwen3 layers with q/k norms; this drafter "
                          "has none (qk_norm false, a Llama-style target)")
    _check_layers(cfg, target_layers)


def dspark_tensors(drafter, embed_weight: torch.Tensor, lm_head_weight: torch.Tensor,
                   mask_token_id: int) -> dict[str, torch.Tensor]:
    """Our DSpark state -> the tensors vLLM's ``Qwen3DSparkForCausalLM.load_weights`` reads
    (unprefixed names; q/k/v and gate/up are stacked by vLLM)."""
    sd = {k: v.detach() for k, v in drafter.state_dict().items()}
    out = {"fc.weight": sd["context_proj.weight"], "hidden_norm.weight": sd["context_norm.weight"],
           "norm.weight": sd["norm.weight"]}
    out.update({k: v for k, v in sd.items() if k.startswith("layers.")})
    embed = embed_weight.detach().to(sd["mask_embedding"].dtype).clone()
    embed[mask_token_id] = sd["mask_embedding"]
    out["embed_tokens.weight"] = embed  # differs from the target's: vLLM keeps this copy
    out["markov_head.markov_w1.weight"] = target_indexed_w1(drafter)  # by target id: any order
    w2 = sd["head.w2.weight"]
    if drafter.confidence is not None:
        out["confidence_head.proj.weight"] = sd["confidence.proj.weight"]
        out["confidence_head.proj.bias"] = sd["confidence.proj.bias"]
    head, order = _draft_lm_head(drafter, lm_head_weight, embed.dtype)
    out.update(head)
    out["markov_head.markov_w2.weight"] = w2 if order is None else w2[order.to(w2.device)]
    return out


def _draft_lm_head(drafter, lm_head_weight: torch.Tensor, dtype: torch.dtype):
    """The draft LM head as vLLM's DSpark / DFlash loaders read it.

    Returns:
        ({"lm_head.weight": [N, H], "d2t": int64 [N] offsets (only with a draft vocabulary)},
        the ascending order int64 [N] that rows indexed by draft id must follow, or None).
        The full-vocabulary head is written although vLLM could share the target's: it is part
        of what the drafter was trained against (vLLM shares it again when it is equal).
    """
    if drafter.d2t is None:
        return {"lm_head.weight": lm_head_weight.detach().to(dtype)}, None
    order = ascending_vocab(drafter.d2t)
    d2t = drafter.d2t[order]
    return {"lm_head.weight": lm_head_weight.detach()[d2t].to(dtype),
            "d2t": vllm_offsets(d2t)}, order


def dspark_vllm_config(drafter, mask_token_id: int, dtype: str) -> dict:
    cfg = drafter.config
    ids = list(cfg.target_layer_ids)
    return {"architectures": ["Qwen3DSparkModel"], **_qwen3_layer_config(cfg, dtype),
            "draft_vocab_size": cfg.draft_vocab_len, "target_hidden_size": cfg.target_hidden_size,
            "block_size": cfg.block_size, "target_layer_ids": ids,
            "mask_token_id": mask_token_id,
            "dflash_config": {"mask_token_id": mask_token_id, "target_layer_ids": ids},
            "markov_rank": cfg.markov_rank, "markov_head_type": "vanilla",
            "enable_confidence_head": bool(cfg.confidence_head),
            "confidence_head_with_markov": True, "sample_from_anchor": True,
            "logit_scale": 1.0}


def dspark_speculators_config(drafter, mask_token_id: int, dtype: str, verifier: dict) -> dict:
    cfg = drafter.config
    return {"architectures": ["DSparkSpeculator"], "speculators_model_type": "dspark",
            "speculators_version": SPECULATORS_VERSION,
            "transformer_layer_config": {"architectures": ["Qwen3ForCausalLM"],
                                         **_qwen3_layer_config(cfg, dtype)},
            "draft_vocab_size": cfg.draft_vocab_len, "block_size": cfg.block_size,
            "aux_hidden_state_layer_ids": [l + 1 for l in cfg.target_layer_ids],
            "mask_token_id": mask_token_id, "sample_from_anchor": True,
            "sliding_window_non_causal": False, "target_hidden_size": cfg.target_hidden_size,
            "markov_rank": cfg.markov_rank, "markov_head_type": "vanilla",
            "enable_confidence_head": bool(cfg.confidence_head),
            "confidence_head_with_markov": True,
            "speculators_config": _proposals("dspark", cfg.block_size, verifier)}


def _proposals(algorithm: str, tokens: int, verifier: dict) -> dict:
    return {"algorithm": algorithm, "default_proposal_method": "greedy",
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": tokens,
                                  "accept_tolerance": 0.0, "verifier_accept_k": 1}],
            "verifier": verifier}


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
    sd = {k: v.detach() for k, v in drafter.state_dict().items()}
    out = {"fc.weight": sd["context_proj.weight"], "hidden_norm.weight": sd["context_norm.weight"],
           "norm.weight": sd["norm.weight"]}
    out.update({k: v for k, v in sd.items() if k.startswith("layers.")})
    out.update(_draft_lm_head(drafter, lm_head_weight, sd["context_proj.weight"].dtype)[0])
    return out


def dflash_mask_file(drafter, mask_token_id: int, dtype: torch.dtype) -> dict:
    """The ``mask_embedding.pt`` content vLLM's DFlash loader (``_read_mask_embedding``) reads:
    {"mask_token_id": int, "embedding": [H] in ``dtype``}. vLLM embeds every query slot whose
    input id is ``mask_token_id`` with this vector (``DFlashQwen3Model.embed_input_ids``), and
    refuses a file whose id differs from ``dflash_config.mask_token_id``."""
    vec = drafter.mask_embedding.detach().to(dtype).contiguous().cpu().clone()
    return {"mask_token_id": int(mask_token_id), "embedding": vec}


def dflash_vllm_config(drafter, mask_token_id: int, dtype: str) -> dict:
    """vLLM's native DFlash config (``DFlashDraftModel``, a Qwen3 config with ``dflash_config``).

    ``block_size`` counts the query slots (anchor + gamma masks) as z-lab's DFlash checkpoints
    and speculators do; vLLM reads ``num_speculative_tokens`` (= gamma) from the serving config.
    ``dflash_config.causal`` false: the block attends to itself both ways, as trained."""
    cfg = drafter.config
    return {"architectures": ["DFlashDraftModel"], **_qwen3_layer_config(cfg, dtype),
            "draft_vocab_size": cfg.draft_vocab_len, "target_hidden_size": cfg.target_hidden_size,
            "block_size": cfg.num_slots,
            "dflash_config": {"mask_token_id": mask_token_id,
                              "target_layer_ids": list(cfg.target_layer_ids), "causal": False}}


def dflash_speculators_config(drafter, mask_token_id: int, dtype: str, verifier: dict) -> dict:
    """speculators 0.9's ``DFlashSpeculatorConfig``; vLLM's ``update_dflash`` turns it into the
    config of :func:`dflash_vllm_config` (aux ids ``l + 1``; ``sliding_window_non_causal`` true
    is what makes vLLM's ``dflash_config.causal`` false)."""
    cfg = drafter.config
    return {"architectures": ["DFlashSpeculator"], "speculators_model_type": "dflash",
            "speculators_version": SPECULATORS_VERSION,
            "transformer_layer_config": {"architectures": ["Qwen3ForCausalLM"],
                                         **_qwen3_layer_config(cfg, dtype)},
            "draft_vocab_size": cfg.draft_vocab_len, "block_size": cfg.num_slots,
            "aux_hidden_state_layer_ids": [l + 1 for l in cfg.target_layer_ids],
            "mask_token_id": mask_token_id, "sample_from_anchor": False,
            "sliding_window_non_causal": True, "target_hidden_size": cfg.target_hidden_size,
            "speculators_config": _proposals("dflash", cfg.block_size, verifier)}


# ------------------------------------------------------------------------------ Eagle3
def _check_eagle3(cfg, target_layers: int) -> None:
    if cfg.drafter_type != "eagle3":
        raise ExportError(f"--format eagle3 exports Eagle3 drafters; this one is "
                          f"{cfg.drafter_type} (use --format vllm or speculators)")
    if cfg.num_hidden_layers != 1:
        raise ExportError(f"vLLM's and SGLang's Eagle3 drafters have one decoder layer; this one "
                          f"has {cfg.num_hidden_layers}")
    _check_layers(cfg, target_layers)


def eagle3_tensors(drafter, lm_head_weight: torch.Tensor) -> dict[str, torch.Tensor]:
    """Our Eagle3 state -> the SpecForge / vLLM Eagle3 layout (``midlayer.*``)."""
    sd = {k: v.detach() for k, v in drafter.state_dict().items()}
    out = {"fc.weight": sd["fc.weight"], "norm.weight": sd["norm.weight"]}
    out.update({"midlayer." + k[len("layers.0."):]: v for k, v in sd.items()
                if k.startswith("layers.0.")})
    dtype = sd["fc.weight"].dtype
    if drafter.d2t is not None:
        d2t = drafter.d2t[ascending_vocab(drafter.d2t)]
        out["lm_head.weight"] = lm_head_weight.detach()[d2t].to(dtype)
        out["d2t"] = vllm_offsets(d2t)
        t2d = torch.zeros(drafter.config.target_vocab_size, dtype=torch.bool)
        t2d[d2t.cpu()] = True
        out["t2d"] = t2d
    else:
        out["lm_head.weight"] = lm_head_weight.detach().to(dtype)
    return out


def eagle3_config(drafter, dtype: str) -> dict:
    cfg = drafter.config
    qwen = bool(cfg.qk_norm)  # q/k norms: a Qwen3 layer; none: a Llama layer
    layer = _qwen3_layer_config(cfg, dtype)
    if not qwen:
        layer = {**{k: v for k, v in layer.items() if k not in ("layer_types", "head_dim")},
                 "model_type": "llama", "head_dim": cfg.head_dim, "mlp_bias": False}
    aux = [l + 1 for l in cfg.target_layer_ids]
    return {"architectures": ["Eagle3Qwen3ForCausalLM" if qwen else "LlamaForCausalLMEagle3"],
            **layer, "draft_vocab_size": cfg.draft_vocab_len,
            "target_hidden_size": cfg.target_hidden_size,
            "eagle_aux_hidden_state_layer_ids": aux, "num_aux_hidden_states": len(aux),
            "eagle_config": {"eagle_aux_hidden_state_layer_ids": aux,
                             "use_aux_hidden_state": True}}


def eagle3_speculators_config(drafter, dtype: str, verifier: dict) -> dict:
    cfg = drafter.config
    layer = eagle3_config(drafter, dtype)
    return {"architectures": ["Eagle3Speculator"], "speculators_model_type": "eagle3",
            "speculators_version": SPECULATORS_VERSION,
            "transformer_layer_config": {k: v for k, v in layer.items()
                                         if k not in ("architectures", "eagle_config",
                                                      "eagle_aux_hidden_state_layer_ids",
                                                      "num_aux_hidden_states",
                                                      "draft_vocab_size", "target_hidden_size")},
            "draft_vocab_size": cfg.draft_vocab_len, "norm_before_residual": False,
            "target_hidden_size": cfg.target_hidden_size,
            "eagle_aux_hidden_state_layer_ids": layer["eagle_aux_hidden_state_layer_ids"],
            "speculators_config": _proposals("eagle3", cfg.block_size, verifier)}


# ------------------------------------------------------------------------------ the export
def _readme(fmt: str, drafter, mask_token_id: int | None, src: Path, target: str) -> str:
    cfg = drafter.config
    lines = [f"# Drafter exported for {fmt}", "",
             f"Exported by `python -m drafters.export --format {fmt}` from `{src}` (a dspark-ray "
             f"{cfg.drafter_type} drafter for `{target}`: block size {cfg.block_size}, target "
             f"layers {list(cfg.target_layer_ids)}, draft vocabulary "
             f"{cfg.draft_vocab_size or 'full'}).", "",
             "| feature | in dspark-ray | here |", "|---|---|---|"]
    rows = [("target layers", "0-based decoder layers "
             f"{list(cfg.target_layer_ids)}", "the same (`target_layer_ids`); aux ids "
             f"{[l + 1 for l in cfg.target_layer_ids]}")]
    if cfg.draft_vocab_size:
        rows.append(("draft vocabulary", "`d2t`: target ids", "`d2t`: offsets (target = draft "
                     "+ d2t[draft]); `lm_head` holds the draft rows of the target's LM head"))
    if cfg.drafter_type == "dspark":
        rows += [("mask input", "a learned vector", f"embedding row {mask_token_id} "
                  "(`mask_token_id`) of a copy of the target's embedding; a round whose anchor "
                  "is that token drafts with the mask's embedding (lossless, shorter drafts)"),
                 ("Markov head", "W1 by draft id", "`markov_head.markov_w1` by target id"),
                 ("confidence head", "with STS temperatures "
                  f"{cfg.calibration_temperatures}" if cfg.calibration_temperatures else
                  "uncalibrated", "raw confidence (vLLM's adaptive verification has no "
                  "per-position temperatures): calibration does not carry over"
                  if cfg.confidence_head else "none")]
    if cfg.drafter_type == "dflash":
        rows += [("mask input", "a learned vector", f"the same vector in `mask_embedding.pt` for "
                  f"id {mask_token_id} (`mask_token_id`); the target's embedding is shared; a "
                  "round whose anchor is that token drafts with the mask's embedding (lossless, "
                  "shorter drafts)"
                  + ("; the speculators package's own DFlash model ignores the file and "
                     "embeds the mask as that id's verifier row" if fmt == "speculators" else "")),
                 ("block", f"anchor + {cfg.block_size} masks, bidirectional",
                  f"`block_size` {cfg.num_slots} (anchor included), non-causal "
                  "(`dflash_config.causal` false); serve with `num_speculative_tokens` "
                  f"{cfg.block_size}")]
    lines += [f"| {a} | {b} | {c} |" for a, b, c in rows]
    lines += ["", "vLLM (0.32+): `speculative_config={\"model\": \"<this directory>\", "
              f"\"method\": \"{cfg.drafter_type}\", "
              f"\"num_speculative_tokens\": {cfg.block_size}}}`"
              + (", plus `\"enable_adaptive_verification\": true` to size each request's "
                 "verification by the confidence head" if cfg.confidence_head else "") + "."]
    return "\n".join(lines) + "\n"


def _target_facts(target: str):
    """(embedding [V, H] fp32, LM head [V, H] fp32, architectures, number of layers, tokenizer
    length or None, special ids, end ids) of the target ``target`` (a from_pretrained name or
    directory)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32)
    cfg = model.config
    try:
        tok = AutoTokenizer.from_pretrained(target)
        tok_len, special = len(tok), list(tok.all_special_ids)
    except (OSError, ValueError, TypeError):  # a target directory without a tokenizer
        tok_len, special = None, []
    eos = getattr(model.generation_config, "eos_token_id", None) or cfg.eos_token_id
    ends = [eos] if isinstance(eos, int) else list(eos or [])
    return (model.get_input_embeddings().weight.detach(),
            model.get_output_embeddings().weight.detach(), list(cfg.architectures or []),
            cfg.num_hidden_layers, tok_len, special, ends)


def export(src: str | Path, dst: str | Path, fmt: str, target: str | None = None,
           mask_token_id: int | None = None, dtype: str | None = None) -> dict:
    """Write the drafter at ``src`` to ``dst`` in format ``fmt``.

    Args:
        src: a dspark-ray drafter directory (``config.json`` + ``model.safetensors``).
        dst: the output directory (replaced whole when the export succeeds; never a drafter
            directory).
        fmt: "vllm", "speculators" or "eagle3".
        target: the target model (name or directory); default: the one the drafter records.
        mask_token_id: the token id of the DSpark / DFlash mask slots; default: see
            :func:`choose_mask_token`.
        dtype: "float32", "bfloat16" or "float16" for the written weights; default: the source
            checkpoint's.
    Returns:
        {"format", "dst", "tensors", "mask_token_id"} (the id is None for Eagle3). A DFlash
        export also holds ``mask_embedding.pt`` beside ``model.safetensors``.
    Raises:
        ExportError: the format cannot represent this drafter (reason named), or an unknown
            format; FileNotFoundError / DrafterCheckpointError: a bad source directory.
    """
    import os
    import shutil

    from safetensors import safe_open
    from safetensors.torch import save_file
    from transformers import AutoConfig

    from .loading import check_checkpoint, drafter_class
    from .modeling import WEIGHTS_NAME

    if fmt not in FORMATS:
        raise ExportError(f"unknown format {fmt!r}; choose one of {list(FORMATS)}")
    src, dst = Path(src), Path(dst)
    config = check_checkpoint(src)
    if dst.resolve() == src.resolve() or _is_drafter_dir(dst):
        raise ExportError(f"{dst} holds a dspark-ray drafter: export into another directory")
    target = target or config.target_name_or_path
    try:
        num_layers = AutoConfig.from_pretrained(target).num_hidden_layers
    except (OSError, ValueError) as err:
        raise FileNotFoundError(f"cannot load the target {target!r} (--target): {err}") from err
    eagle = fmt == "eagle3" or config.drafter_type == "eagle3"
    # refusals first: they need the configs only, not the target's weights
    (_check_eagle3 if eagle else _check_block_drafter)(config, num_layers)
    embed, lm_head, archs, _, tok_len, special, ends = _target_facts(target)
    drafter = drafter_class(config.drafter_type).from_pretrained(src, embed, lm_head)
    if dtype:
        out_dtype = getattr(torch, dtype)
    else:  # the checkpoint's own (from_pretrained loads in fp32)
        floats = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16}
        with safe_open(str(src / WEIGHTS_NAME), framework="pt") as fh:
            out_dtype = next(floats[fh.get_slice(k).get_dtype()] for k in fh.keys()
                             if fh.get_slice(k).get_dtype() in floats)
    dtype_name = str(out_dtype).removeprefix("torch.")
    verifier = {"name_or_path": str(target), "architectures": archs}
    mask = mask_file = None
    if eagle:
        tensors = eagle3_tensors(drafter, lm_head)
        cfg = (eagle3_config(drafter, dtype_name) if fmt != "speculators"
               else eagle3_speculators_config(drafter, dtype_name, verifier))
        if fmt == "vllm":  # vLLM loads Eagle3 in its own (eagle3) layout
            fmt = "eagle3"
    else:
        mask = (mask_token_id if mask_token_id is not None
                else choose_mask_token(config.target_vocab_size, tok_len, special, ends))
        if not 0 <= mask < config.target_vocab_size:
            raise ExportError(f"--mask-token-id {mask} is outside the vocabulary "
                              f"[0, {config.target_vocab_size})")
        if config.drafter_type == "dspark":
            tensors = dspark_tensors(drafter, embed, lm_head, mask)
            cfg = (dspark_vllm_config(drafter, mask, dtype_name) if fmt == "vllm"
                   else dspark_speculators_config(drafter, mask, dtype_name, verifier))
        else:
            tensors = dflash_tensors(drafter, lm_head)
            mask_file = dflash_mask_file(drafter, mask, out_dtype)
            cfg = (dflash_vllm_config(drafter, mask, dtype_name) if fmt == "vllm"
                   else dflash_speculators_config(drafter, mask, dtype_name, verifier))
    tensors = {k: (v.to(out_dtype) if v.is_floating_point() and "confidence_head" not in k
                   else v).contiguous().cpu() for k, v in tensors.items()}
    # written beside the destination and moved into place whole: a failed export leaves no mix
    # of new weights and an old config
    tmp = dst.with_name(f".{dst.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        if mask_file is not None:  # vLLM's DFlash loader reads this name (torch.load, weights)
            torch.save(mask_file, tmp / "mask_embedding.pt")
        (tmp / "config.json").write_text(json.dumps(cfg, indent=1) + "\n")
        (tmp / "README.md").write_text(_readme(fmt, drafter, mask, src, str(target)))
        if dst.exists():
            shutil.rmtree(dst)
        os.replace(tmp, dst)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return {"format": fmt, "dst": str(dst), "tensors": len(tensors), "mask_token_id": mask}


def _is_drafter_dir(path: Path) -> bool:
    """Whether ``path`` holds a dspark-ray drafter checkpoint (never overwritten by an export)."""
    try:
        return json.loads((path / "config.json").read_text()).get("model_type") == \
            "dspark_drafter"
    except (OSError, ValueError):
        return False


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m drafters.export",
                                     description=__doc__.split("\n")[0])
    parser.add_argument("--format", required=True, choices=FORMATS)
    parser.add_argument("src", help="dspark-ray drafter directory")
    parser.add_argument("dst", help="output directory")
    parser.add_argument("--target", help="target model (default: the drafter's recorded one)")
    parser.add_argument("--mask-token-id", type=int,
                        help="DSpark/DFlash mask token id (default: auto)")
    parser.add_argument("--dtype", choices=("float32", "bfloat16", "float16"))
    args = parser.parse_args(argv)
    try:
        summary = export(args.src, args.dst, args.format, args.target, args.mask_token_id,
                         args.dtype)
    except (ExportError, FileNotFoundError, ValueError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
