"""What the per-type exporters share: the :class:`Exporter` contract, the conventions every engine
format has (offset ``d2t``, ascending draft vocabulary, aux layer ids, the mask token) and the
Qwen3 decoder-layer config of the drafter's own layers."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

SPECULATORS_VERSION = "0.9.0"


class ExportError(ValueError):
    """The drafter cannot be represented in the requested format (the reason is named)."""


@dataclass(frozen=True)
class ExportInputs:
    """What an exporter writes from: the drafter with the target's tensors bound.

    Attributes:
        drafter: the loaded drafter (fp32).
        embed, lm_head: the target's embedding and LM head, [V, H] fp32.
        dtype: the written weights' dtype; dtype_name: its name ("bfloat16").
        verifier: speculators' ``verifier`` entry (the target's name and architectures).
        mask_token_id: the id fed to mask slots (None for exporters without ``mask_token``).
    """

    drafter: object
    embed: torch.Tensor
    lm_head: torch.Tensor
    dtype: torch.dtype
    dtype_name: str
    verifier: dict
    mask_token_id: int | None = None


@dataclass
class ExportFiles:
    """An exporter's result: the weights, ``config.json``, further ``torch.save`` files by name,
    and (feature, in dspark-ray, here) rows for the export's README."""

    tensors: dict[str, torch.Tensor]
    config: dict
    files: dict[str, object] = field(default_factory=dict)
    readme_rows: list[tuple[str, str, str]] = field(default_factory=list)


@dataclass(frozen=True)
class Exporter:
    """One export format of one drafter type (``DrafterSpec.exporters[format]``).

    Attributes:
        check: ``check(config, target_layers)`` raises :class:`ExportError` for what the format
            cannot hold, from the configs alone (before any weights are read).
        write: ``write(inputs) -> ExportFiles``.
        mask_token: whether the format feeds a token id to the mask slots.
        written_as: the format name the export is recorded under, when it differs from the
            requested one (an Eagle3 drafter's ``vllm`` export is its ``eagle3`` layout).
    """

    check: Callable[[object, int], None]
    write: Callable[[ExportInputs], ExportFiles]
    mask_token: bool = False
    written_as: str | None = None


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


def ascending_vocab(d2t: torch.Tensor) -> torch.Tensor:
    """The permutation that sorts the draft vocabulary by target id: ours is ordered by
    frequency, while the Eagle3 ``t2d`` mask (and any engine that rebuilds the map from it)
    implies ascending ids. Rows indexed by draft id are exported in this order."""
    return torch.argsort(d2t)


def aux_layer_ids(cfg) -> list[int]:
    """vLLM's aux / speculators' ids of the feature layers: ours + 1 (transformers'
    ``hidden_states[l + 1]``)."""
    return [l + 1 for l in cfg.target_layer_ids]


def check_layers(cfg, target_layers: int) -> None:
    """Raises ExportError: the drafter reads the target's last layer (its features differ)."""
    if cfg.target_layer_ids and max(cfg.target_layer_ids) >= target_layers - 1:
        raise ExportError(
            f"the drafter reads the target's last layer ({max(cfg.target_layer_ids)}): "
            "transformers reports it after the final norm, vLLM before it, so the features "
            "would differ; train with target.layer_ids below the last layer")


def check_qwen3_layers(cfg, target_layers: int) -> None:
    """Refuse what vLLM's Qwen3-based block drafters (``Qwen3DSparkModel``,
    ``DFlashDraftModel``) cannot hold.

    Raises:
        ExportError: layers without q/k norms (vLLM's ``DFlashQwen3Attention`` always normalises
            q and k; an RMSNorm with unit weight is no identity), a drafter whose anchor reads the
            last context state (``anchor_features``: vLLM's anchor input is its token embedding
            alone, and dropping W_a would change every draft), or a drafter reading the target's
            last layer.
    """
    if cfg.anchor_features:
        raise ExportError(f"vLLM's {cfg.spec.title} anchor input is the anchor's embedding alone; "
                          "this drafter's anchor also reads the last context state "
                          "(anchor_features true), which no vLLM or speculators model has")
    if not cfg.qk_norm:
        raise ExportError(f"vLLM's {cfg.spec.title} layers are Qwen3 layers with q/k norms; "
                          "this drafter has none (qk_norm false, a Llama-style target)")
    check_layers(cfg, target_layers)


def qwen3_layer_config(cfg, dtype: str) -> dict:
    """The decoder-layer fields of a Qwen3 config for the drafter's own layers, its attention
    windows included: ``layer_types`` per layer and the one ``sliding_window`` (a config holds
    one; every window of a drafter comes from one setting), which vLLM's DFlash/DSpark layers
    read per layer (a mixed drafter needs vLLM's V2 model runner)."""
    windows = cfg.layer_windows or [None] * cfg.num_hidden_layers
    window = next((w for w in windows if w is not None), None)
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
            "layer_types": ["full_attention" if w is None else "sliding_attention"
                            for w in windows],
            "use_sliding_window": window is not None, "sliding_window": window}


def backbone_tensors(drafter) -> dict[str, torch.Tensor]:
    """The DSpark/DFlash backbone in vLLM's names: W_c as ``fc``, the context norm as
    ``hidden_norm``, the final ``norm`` and the ``layers.*`` as they are (vLLM stacks q/k/v and
    gate/up itself)."""
    sd = {k: v.detach() for k, v in drafter.state_dict().items()}
    out = {"fc.weight": sd["context_proj.weight"], "hidden_norm.weight": sd["context_norm.weight"],
           "norm.weight": sd["norm.weight"]}
    out.update({k: v for k, v in sd.items() if k.startswith("layers.")})
    return out


def draft_lm_head(drafter, lm_head_weight: torch.Tensor, dtype: torch.dtype):
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


def proposals(algorithm: str, tokens: int, verifier: dict) -> dict:
    """speculators' ``speculators_config``: greedy proposals of ``tokens`` draft tokens."""
    return {"algorithm": algorithm, "default_proposal_method": "greedy",
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": tokens,
                                  "accept_tolerance": 0.0, "verifier_accept_k": 1}],
            "verifier": verifier}


def speculators_header(cfg, architecture: str, model_type: str, dtype: str) -> dict:
    """The fields every speculators config of a Qwen3-layer drafter starts with."""
    return {"architectures": [architecture], "speculators_model_type": model_type,
            "speculators_version": SPECULATORS_VERSION,
            "transformer_layer_config": {"architectures": ["Qwen3ForCausalLM"],
                                         **qwen3_layer_config(cfg, dtype)},
            "draft_vocab_size": cfg.draft_vocab_len}
