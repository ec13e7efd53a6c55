"""Eagle3 exports: the SpecForge / vLLM layout (``midlayer.*``, ``d2t`` offsets, ``t2d`` mask,
``lm_head``) for vLLM's ``Eagle3Qwen3ForCausalLM`` / ``LlamaForCausalLMEagle3`` and SGLang
(``--format eagle3``, and ``--format vllm``, which vLLM loads in this layout), and speculators'
``Eagle3Speculator``. Read from vLLM's ``qwen3_eagle3.py``, ``llama_eagle3.py`` and
``eagle3_utils.py``; engines' Eagle3 drafters have one decoder layer.
"""

from __future__ import annotations

import torch

from .common import (SPECULATORS_VERSION, ExportError, Exporter, ExportFiles, ExportInputs,
                     ascending_vocab, aux_layer_ids, check_layers, proposals, qwen3_layer_config,
                     vllm_offsets)


def check(cfg, target_layers: int) -> None:
    """Raises ExportError: more than one decoder layer, or a drafter reading the target's last
    layer."""
    if cfg.num_hidden_layers != 1:
        raise ExportError(f"vLLM's and SGLang's Eagle3 drafters have one decoder layer; this one "
                          f"has {cfg.num_hidden_layers}")
    check_layers(cfg, target_layers)


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
    layer = qwen3_layer_config(cfg, dtype)
    if not qwen:
        layer = {**{k: v for k, v in layer.items() if k not in ("layer_types", "head_dim")},
                 "model_type": "llama", "head_dim": cfg.head_dim, "mlp_bias": False}
    aux = aux_layer_ids(cfg)
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
            "speculators_config": proposals("eagle3", cfg.block_size, verifier)}


def _layout(x: ExportInputs) -> ExportFiles:
    return ExportFiles(tensors=eagle3_tensors(x.drafter, x.lm_head),
                       config=eagle3_config(x.drafter, x.dtype_name))


def _speculators(x: ExportInputs) -> ExportFiles:
    return ExportFiles(tensors=eagle3_tensors(x.drafter, x.lm_head),
                       config=eagle3_speculators_config(x.drafter, x.dtype_name, x.verifier))


EXPORTERS = {
    "eagle3": Exporter(check, _layout),
    "vllm": Exporter(check, _layout, written_as="eagle3"),  # vLLM loads Eagle3 in this layout
    "speculators": Exporter(check, _speculators),
}
