"""What the engine honours of a target's architecture, checked when its runner is built.

The engine keeps every request's keys and values in its own KV pool (``serve/engine/kv_pool.py``)
and attends them itself, honouring what transformers passes a layer's attention function: causal
full attention, per-layer sliding windows, attention sinks and logit soft caps; linear-attention
layers (Gated DeltaNet) get per-request recurrent and convolution states with rollback
(``serve/engine/linear_state.py``). A target whose layers need anything else (a Mamba-style layer
type, a compressed latent KV, chunked attention) would either crash in the first prefill or,
worse, decode text that is not the target's. Such a target is refused here, with its model type
and the feature named, before any request is admitted.

The checks read the model's own config attributes (``layer_types`` as transformers derives it
from ``sliding_window`` / ``use_sliding_window`` / ``max_window_layers`` and similar), not a table
of model names, and then run one short probe through the engine's cache, so a layer that calls a
cache method the pool does not have is refused at build time too.
"""

from __future__ import annotations

import torch

from .errors import UnsupportedTargetError
from .linear_state import LINEAR_LAYER_TYPES, linear_mixers

# layer types (transformers' ``config.layer_types``) the KV pool and slot attention honour
SUPPORTED_LAYER_TYPES = frozenset({"full_attention", "sliding_attention"})
# config attributes whose presence (not None) means a feature the engine does not implement
UNSUPPORTED_ATTRIBUTES = {
    "kv_lora_rank": "multi-head latent attention (a compressed KV cache)",
    "attention_chunk_size": "chunked attention",
}


def check_target_supported(model) -> None:
    """Refuse a target the engine cannot decode exactly as the target itself would.

    Args:
        model: a transformers causal LM (its ``config`` is read).
    Raises:
        UnsupportedTargetError: an encoder-decoder; a layer type other than full attention,
            sliding attention and linear attention (``serve/engine/linear_state.py``), named with
            its layers; a linear-attention layer without a recognisable token mixer; multi-head
            latent or chunked attention. The message names ``config.model_type``.
    """
    cfg = model.config
    kind = getattr(cfg, "model_type", type(model).__name__)
    if getattr(cfg, "is_encoder_decoder", False):
        raise UnsupportedTargetError(f"target model type {kind!r} is an encoder-decoder; the "
                                     f"engine serves decoder-only causal LMs")
    types = list(getattr(cfg, "layer_types", None) or [])
    others = sorted({t for t in types if t not in SUPPORTED_LAYER_TYPES | LINEAR_LAYER_TYPES})
    if others:
        where = {t: [i for i, u in enumerate(types) if u == t] for t in others}
        named = "; ".join(f"{t!r} at layers {ls}" for t, ls in where.items())
        raise UnsupportedTargetError(
            f"target model type {kind!r} has layers the engine cannot run: {named} (the engine's "
            f"KV pool honours {sorted(SUPPORTED_LAYER_TYPES)}, and per-request states "
            f"{sorted(LINEAR_LAYER_TYPES)}; Mamba-style layer types are not implemented)")
    linear_mixers(model)  # each linear-attention layer has a mixer the engine can drive
    for attr, feature in UNSUPPORTED_ATTRIBUTES.items():
        if getattr(cfg, attr, None) is not None:
            raise UnsupportedTargetError(f"target model type {kind!r} uses {feature} "
                                         f"(config.{attr} = {getattr(cfg, attr)!r}); the engine "
                                         f"does not implement it")


def probe(runner) -> None:
    """One 3-token pass and one 1-token pass through the engine's cache on a throwaway slot,
    compared (in fp32) with the model's own forward over the same 4 tokens: a layer that needs a
    cache method or state the pool lacks raises here, and one that ignores the engine's cache
    (and would decode other text) gives other logits, at build time. In bf16 the comparison is
    skipped: rounding alone moves a small model's logits by ~5 % (SmolLM2-135M, measured).

    Args:
        runner: the :class:`serve.engine.target_runner.TargetRunner` being built.
    Raises:
        UnsupportedTargetError: a pass raised, gave non-finite logits, or (fp32) logits that
            differ from the model's own by more than rounding (relative L2 error > 1e-3); the
            message names the model type.
    """
    # lazy: import cycle: target_runner -> target_support
    from .target_runner import TargetKV

    kind = getattr(runner.model.config, "model_type", type(runner.model).__name__)
    tokens = [1, 2, 3, 4]
    kv = TargetKV()
    try:
        first = runner.forward_batch([kv], [tokens[:3]], with_features=bool(runner.layer_ids),
                                     logits="last")[0]
        first.keep(3)
        second = runner.forward_batch([kv], [tokens[3:]], with_features=False, logits="last")[0]
        with torch.inference_mode():
            own = runner.model(input_ids=torch.tensor([tokens], device=runner.device),
                               use_cache=False).logits[0, -2:].float()
    except Exception as err:  # noqa: BLE001 - any failure here is the architecture's
        raise UnsupportedTargetError(
            f"target model type {kind!r} does not run through the engine's KV pool: "
            f"{type(err).__name__}: {err}") from err
    finally:
        kv.release()
    engine = torch.cat([first.logits, second.logits])
    if not torch.isfinite(engine).all():
        raise UnsupportedTargetError(f"target model type {kind!r} gave non-finite logits through "
                                     f"the engine's KV pool")
    if runner.dtype != torch.float32:  # bf16 rounding alone moves logits by several %
        return
    error = float((engine - own).norm() / own.norm().clamp_min(1e-12))
    if error > 1e-3:
        raise UnsupportedTargetError(
            f"target model type {kind!r} computes other logits through the engine's KV pool than "
            f"alone (relative difference {error:.3f}): a layer ignores the engine's cache")
