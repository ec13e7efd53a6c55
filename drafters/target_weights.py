"""The one target loader: a target resolved by HF hub name or local directory, as its config
(:func:`load_target_config`), the whole frozen model (:func:`load_target`: the serving engine,
generation, the cache stage, calibration and evaluation, through ``serve.engine.target_loading``),
or only the tensors a drafter is bound to (:func:`load_frozen_head`: the embedding and LM head
and, for ``init: target_layers``, the last decoder layers and the final norm, fp32 on CPU,
without loading the whole target: training, ``pipeline/train/worker.py``, and export,
``drafters/export``).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from .precision import DTYPES, resolve_dtype  # noqa: F401 - DTYPES: re-exported


def load_target_config(name_or_path: str):
    """The target's HF config (``AutoConfig.from_pretrained``).

    Raises:
        FileNotFoundError: nothing loadable at ``name_or_path`` (message names it).
    """
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(name_or_path)
    except (OSError, ValueError) as err:
        raise FileNotFoundError(f"unknown target model {name_or_path!r}: {err}") from err


def final_logit_softcap(config) -> float | None:
    """The soft cap the target applies to its output logits (``logits = c * tanh(logits / c)``),
    or None: Gemma 2's ``final_logit_softcapping`` (30.0 in its released configs), read from the
    text config of a multimodal one. Whatever computes the target's logits from its final hidden
    state outside the model's own forward (training's frozen head) applies it, else it trains
    toward another distribution than the one the target samples from.
    """
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    cap = getattr(text, "final_logit_softcapping", None)
    return float(cap) if cap else None


def load_target(name_or_path: str, dtype: str = "float32", device: str | None = None):
    """Load the frozen target model (eval mode, no grad) with ``from_pretrained``.

    Args:
        name_or_path: HF hub name or local directory.
        dtype: ``auto`` (bf16 where this process's device multiplies it natively, else fp32:
            :func:`drafters.precision.resolve_dtype`), ``float32``, ``bfloat16`` or ``float16``.
        device: where the model will run, for ``auto`` (default: CUDA when visible, else CPU);
            the model is loaded on the CPU either way.
    Raises:
        FileNotFoundError: nothing loadable at ``name_or_path`` (message names it).
        ValueError: unknown dtype.
    """
    from transformers import AutoModelForCausalLM

    torch_dtype = resolve_dtype(dtype, device)
    try:
        model = AutoModelForCausalLM.from_pretrained(name_or_path, dtype=torch_dtype)
    except (OSError, ValueError) as err:
        raise FileNotFoundError(f"cannot load target model {name_or_path!r}: {err}") from err
    model.eval()
    model.requires_grad_(False)
    return model


def load_frozen_head(target_name: str, top_layers: int = 0):
    """(target config, embedding [V, H], LM head [V, H]) of the target, fp32 on CPU; with
    ``top_layers`` > 0 also (state dicts of the last ``top_layers`` decoder layers, the final
    norm's state dict) for :meth:`drafters.dspark.DSparkDrafter.init_from_target`.

    Only those tensors are read, from the checkpoint's safetensors files (a 4B target's worker
    reads ~1.6 GB, not 16 GB of fp32 weights); a checkpoint in another format or with other
    tensor names is loaded whole with ``from_pretrained`` instead.
    """
    config = load_target_config(target_name)
    tensors = _read_target_tensors(target_name, config, top_layers)
    if tensors is None:
        return _load_frozen_head_whole(target_name, top_layers)
    emb = tensors["model.embed_tokens.weight"]
    head = tensors.get("lm_head.weight", emb)  # tied embeddings: the LM head is the embedding
    if not top_layers:
        return config, emb, head
    first = config.num_hidden_layers - top_layers
    layers = [{k[len(f"model.layers.{i}."):]: v for k, v in tensors.items()
               if k.startswith(f"model.layers.{i}.")}
              for i in range(first, config.num_hidden_layers)]
    norm = {k[len("model.norm."):]: v for k, v in tensors.items() if k.startswith("model.norm.")}
    return config, emb, head, (layers, norm)


def _read_target_tensors(target_name: str, config, top_layers: int) -> dict | None:
    """The embedding, LM head (if untied), final norm and last ``top_layers`` decoder layers as
    fp32 CPU tensors, read by name from the target's safetensors files; None when the checkpoint
    has no safetensors or names them differently."""
    from safetensors import safe_open

    files = _safetensors_files(target_name)
    if not files:
        return None
    first = config.num_hidden_layers - top_layers
    wanted = ["model.embed_tokens.", "model.norm.", "lm_head."] + [
        f"model.layers.{i}." for i in range(first, config.num_hidden_layers)]
    out = {}
    for path in files:
        with safe_open(path, framework="pt") as fh:
            for key in fh.keys():
                if any(key.startswith(w) for w in wanted):
                    out[key] = fh.get_tensor(key).to(torch.float32)
    tied = getattr(config, "tie_word_embeddings", False)
    if "model.embed_tokens.weight" not in out or ("lm_head.weight" not in out and not tied) or (
            top_layers and not any(k.startswith(f"model.layers.{first}.") for k in out)):
        return None
    return out


def _safetensors_files(target_name: str) -> list[str]:
    """Local paths of a target's safetensors shards (a directory or a Hub name already in the
    local cache / downloadable); [] if there are none."""
    from transformers.utils import cached_file

    for index in ("model.safetensors.index.json", "model.safetensors"):
        try:
            path = cached_file(target_name, index, _raise_exceptions_for_missing_entries=False)
        except OSError:
            path = None
        if not path:
            continue
        if index == "model.safetensors":
            return [path]
        shards = sorted(set(json.loads(Path(path).read_text())["weight_map"].values()))
        return [cached_file(target_name, shard) for shard in shards]
    return []


def _load_frozen_head_whole(target_name: str, top_layers: int):
    """:func:`load_frozen_head` through ``from_pretrained`` (every weight, fp32)."""
    model = load_target(target_name, "float32")
    emb = model.get_input_embeddings().weight.detach().clone()
    head = model.get_output_embeddings().weight.detach().clone()
    if not top_layers:
        return model.config, emb, head
    layers = [{k: v.detach().clone() for k, v in layer.state_dict().items()}
              for layer in model.model.layers[-top_layers:]]
    norm = {k: v.detach().clone() for k, v in model.model.norm.state_dict().items()}
    return model.config, emb, head, (layers, norm)
