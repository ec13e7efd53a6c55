"""``drafter.init: target_layers`` for any decoder: which of a target layer's parameters become
which of a drafter layer's, read from the layer's own parameter names and shapes, or a refusal
that names what does not fit, before any stage runs.

The drafter layer (``drafters/layers.py``) is a pre-norm Llama-shaped layer: RMSNorm
(``x * w``), attention with q/k/v/o projections and optional q/k norms, RMSNorm, SwiGLU MLP
(``silu``). A target layer initialises it when it computes the same function with the same
names, or with names the layer fuses (Phi-3's ``qkv_proj`` and ``gate_up_proj``, split by the
drafter's own projection sizes). Anything else would copy part of a layer and silently start the
drafter from a function the target never computed, so it is refused with the names:
parameters the drafter has no place for (Gemma 3's extra norms, Qwen2's q/k/v biases, MoE
experts, gpt-oss's sinks, a linear-attention layer), drafter parameters the target lacks, shapes
that differ, an MLP activation other than SiLU, or norms that scale by ``1 + w`` (Gemma's).
"""

from __future__ import annotations

import copy

import torch

# target parameter name -> the drafter parameters it holds, stacked along dim 0 in this order
FUSED = {
    "self_attn.qkv_proj.weight": ("self_attn.q_proj.weight", "self_attn.k_proj.weight",
                                  "self_attn.v_proj.weight"),
    "mlp.gate_up_proj.weight": ("mlp.gate_proj.weight", "mlp.up_proj.weight"),
}
# drafter parameters a target layer may lack: they keep the fresh drafter's values (a Llama
# target under drafter.qk_norm: the norms start at 1)
OWN_IF_ABSENT = ("self_attn.q_norm.weight", "self_attn.k_norm.weight")
SILU = ("silu", "swish")


class LayerInitError(ValueError):
    """``init: target_layers`` cannot map the target's layers onto the drafter's; the message
    names the target's model type, the layer and the parameters that do not fit."""


def map_layer_state(state: dict, drafter_shapes: dict, where: str = "target layer") -> dict:
    """A target decoder layer's state dict under the drafter layer's names.

    Args:
        state: the target layer's parameters (name -> tensor; meta tensors work), names relative
            to the layer (``self_attn.q_proj.weight``).
        drafter_shapes: the drafter layer's parameter name -> shape.
        where: names the layer in errors (e.g. "qwen2 layer 3").
    Returns:
        drafter name -> tensor, every drafter parameter except those in ``OWN_IF_ABSENT`` the
        target lacks.
    Raises:
        LayerInitError: unused target parameters, missing drafter parameters or shape mismatches,
            each listed by name.
    """
    mapped, unused = {}, []
    for name, tensor in state.items():
        if name.endswith("rotary_emb.inv_freq"):
            continue
        if name in drafter_shapes:
            mapped[name] = tensor
        elif name in FUSED and all(p in drafter_shapes for p in FUSED[name]):
            sizes = [drafter_shapes[p][0] for p in FUSED[name]]
            if sum(sizes) != tensor.shape[0]:
                unused.append(f"{name} {tuple(tensor.shape)} (cannot split into {sizes})")
                continue
            mapped.update(zip(FUSED[name], torch.split(tensor, sizes, dim=0)))
        else:
            unused.append(name)
    missing = [n for n in drafter_shapes if n not in mapped and n not in OWN_IF_ABSENT]
    shapes = [f"{n}: target {tuple(t.shape)} vs drafter {tuple(drafter_shapes[n])}"
              for n, t in mapped.items() if tuple(t.shape) != tuple(drafter_shapes[n])]
    problems = []
    if unused:
        problems.append(f"parameters the drafter layer has no place for: {', '.join(unused)}")
    if missing:
        problems.append(f"drafter parameters the target layer lacks: {', '.join(missing)}")
    if shapes:
        problems.append(f"shapes that differ: {'; '.join(shapes)}")
    if problems:
        raise LayerInitError(f"drafter.init 'target_layers': the {where} does not map onto a "
                             f"drafter layer ({'; '.join(problems)}); use drafter.init 'random'")
    return mapped


def check_target_layer_init(target_config, drafter_layer: torch.nn.Module, num_layers: int
                            ) -> None:
    """Refuse ``init: target_layers`` for a target whose last ``num_layers`` decoder layers do
    not map onto ``drafter_layer`` (:func:`map_layer_state`), before any weight is read: the
    target is built on the meta device from its config (no memory, no download of weights).

    Args:
        target_config: the target's transformers config.
        drafter_layer: one layer of the drafter to be built (its parameter names and shapes).
        num_layers: the drafter's layer count (the target's last layers it copies).
    Raises:
        LayerInitError: a layer does not map, the MLP activation is not SiLU, or the target's
            norms compute ``x * (1 + w)`` instead of ``x * w``; the message names the model type.
    """
    from transformers import AutoModelForCausalLM

    kind = getattr(target_config, "model_type", "target")
    act = getattr(target_config, "hidden_act", None) or getattr(target_config,
                                                               "hidden_activation", None)
    if act is not None and act not in SILU:
        raise LayerInitError(f"drafter.init 'target_layers': the {kind} MLP uses {act!r}, the "
                             f"drafter's SwiGLU silu; use drafter.init 'random'")
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(copy.deepcopy(target_config))
    decoder = model.get_decoder()
    shapes = {n: tuple(p.shape) for n, p in drafter_layer.state_dict().items()}
    first = len(decoder.layers) - num_layers
    for i in range(first, len(decoder.layers)):
        layer = decoder.layers[i]
        map_layer_state(dict(layer.state_dict()), shapes, f"{kind} layer {i}")
        for name in ("input_layernorm", "post_attention_layernorm"):
            _check_norm(getattr(layer, name), f"{kind} layer {i} {name}")
    _check_norm(decoder.norm, f"{kind} final norm")


def _check_norm(norm: torch.nn.Module, where: str) -> None:
    """A norm whose weight is all zeros must output zeros (``x * w``); Gemma's ``x * (1 + w)``
    does not, and copying its weights into the drafter's norms would be off by one."""
    weight = getattr(norm, "weight", None)
    if not isinstance(weight, torch.Tensor) or weight.dim() != 1:
        raise LayerInitError(f"drafter.init 'target_layers': the {where} ({type(norm).__name__}) "
                             f"has no per-channel weight for the drafter's RMSNorm; use "
                             f"drafter.init 'random'")
    probe = copy.deepcopy(norm).to_empty(device="cpu")
    with torch.no_grad():
        for p in probe.parameters():
            p.zero_()
        out = probe(torch.ones(1, weight.shape[-1]))
    if bool(out.abs().max() > 0):
        raise LayerInitError(f"drafter.init 'target_layers': the {where} scales by (1 + weight), "
                             f"the drafter's RMSNorm by weight; use drafter.init 'random'")


def check_drafter_init(drafter_config, target_config, target_name: str, layer_ids: list[int]
                       ) -> None:
    """The config-time check of ``drafter.init`` (the pipeline's preflight, before any stage
    runs): nothing to check for ``random``; for ``target_layers``, :func:`check_target_layer_init`
    against a drafter layer of this config bound to the target (built on the meta device).

    Args:
        drafter_config: the :class:`~drafters.config.DrafterConfig` section.
        target_config: the target's transformers config; target_name: its name or path;
        layer_ids: the target layers the drafter reads.
    Raises:
        LayerInitError: as :func:`check_target_layer_init`.
    """
    if drafter_config.init != "target_layers":
        return
    # lazy: import cycle: dspark (via the package) -> layer_init
    from .layers import DrafterLayer

    bound = drafter_config.for_target(target_config, target_name, layer_ids)
    with torch.device("meta"):
        layer = DrafterLayer(bound)
    check_target_layer_init(target_config, layer, bound.num_hidden_layers)
