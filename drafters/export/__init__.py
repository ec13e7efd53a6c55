"""Export a drafter checkpoint to the formats other serving engines load.

    python -m drafters.export --format vllm|speculators|eagle3 SRC DST [--target T]
                              [--mask-token-id ID] [--dtype bfloat16]

The formats of a drafter type are its spec's ``exporters`` (one module per type beside this one:
``dspark.py``, ``dflash.py``, ``eagle3.py``; the shared conventions in ``common.py``):

- ``vllm``: vLLM's native DSpark drafter (``Qwen3DSparkModel``, vLLM 0.32+), DFlash drafter
  (``DFlashDraftModel`` -> ``DFlashQwen3ForCausalLM``) or Eagle3 layout;
- ``speculators``: the same weights with the ``speculators`` package's config
  (``DSparkSpeculator`` / ``DFlashSpeculator`` / ``Eagle3Speculator``), which vLLM converts;
- ``eagle3``: an Eagle3 drafter in the SpecForge / vLLM layout for vLLM and SGLang.

The names, shapes and conventions were read from vLLM 0.32's loaders and speculators 0.9's
configs; ``tests/interop`` loads the DSpark and DFlash exports with vLLM's own model classes and
compares block hidden states and logits. What does not carry over is written to ``DST/README.md``
and refused when the engine cannot represent it (:class:`ExportError`). Shared by all: ``d2t``
maps draft ids to target ids here and holds offsets there (target = draft + d2t[draft]), with the
draft vocabulary in ascending target ids; layer ids are 0-based decoder layers here and in vLLM's
``target_layer_ids``, ``l + 1`` in aux / speculators ids (a drafter reading the target's last
layer is refused: vLLM records it before the final norm, transformers after); STS temperatures
have no field in vLLM (SGLang's and TensorRT-LLM's STS and SPS files are written by
``python -m serve.engine.engine_files``).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
from pathlib import Path

from ..registry import all_specs
from .common import ExportError, ExportInputs, aux_layer_ids, choose_mask_token

__all__ = ["ExportError", "choose_mask_token", "export", "formats", "main"]


def formats() -> tuple[str, ...]:
    """Every export format some registered drafter type has."""

    return tuple(dict.fromkeys(f for spec in all_specs().values() for f in spec.exporters))


def _readme(fmt: str, cfg, rows: list, src: Path, target: str) -> str:
    lines = [f"# Drafter exported for {fmt}", "",
             f"Exported by `python -m drafters.export --format {fmt}` from `{src}` (a dspark-ray "
             f"{cfg.drafter_type} drafter for `{target}`: block size {cfg.block_size}, target "
             f"layers {list(cfg.target_layer_ids)}, draft vocabulary "
             f"{cfg.draft_vocab_size or 'full'}).", "",
             "| feature | in dspark-ray | here |", "|---|---|---|"]
    common = [("target layers", "0-based decoder layers "
               f"{list(cfg.target_layer_ids)}", "the same (`target_layer_ids`); aux ids "
               f"{aux_layer_ids(cfg)}")]
    if cfg.draft_vocab_size:
        common.append(("draft vocabulary", "`d2t`: target ids", "`d2t`: offsets (target = draft "
                       "+ d2t[draft]); `lm_head` holds the draft rows of the target's LM head"))
    lines += [f"| {a} | {b} | {c} |" for a, b, c in common + rows]
    lines += ["", "vLLM (0.32+): `speculative_config={\"model\": \"<this directory>\", "
              f"\"method\": \"{cfg.spec.vllm_method}\", "
              f"\"num_speculative_tokens\": {cfg.block_size}}}`"
              + (", plus `\"enable_adaptive_verification\": true` to size each request's "
                 "verification by the confidence head" if cfg.confidence_head else "") + "."]
    return "\n".join(lines) + "\n"


def _target_facts(target: str):
    """(embedding [V, H] fp32, LM head [V, H] fp32, architectures, tokenizer length or None,
    special ids, end ids) of the target ``target`` (a from_pretrained name or directory); the
    tensors through the trainer's reader (``drafters/target_weights.py``)."""
    from transformers import AutoTokenizer, GenerationConfig

    # lazy: import cycle: dspark (via the package) -> export
    from ..target_weights import load_frozen_head

    cfg, embed, lm_head = load_frozen_head(target)
    try:
        tok = AutoTokenizer.from_pretrained(target)
        tok_len, special = len(tok), list(tok.all_special_ids)
    except (OSError, ValueError, TypeError):  # a target directory without a tokenizer
        tok_len, special = None, []
    try:
        eos = GenerationConfig.from_pretrained(target).eos_token_id or cfg.eos_token_id
    except (OSError, ValueError):  # no generation_config.json: the model config's
        eos = cfg.eos_token_id
    ends = [eos] if isinstance(eos, int) else list(eos or [])
    return embed, lm_head, list(cfg.architectures or []), tok_len, special, ends


def _exporter(config, fmt: str):
    """The spec's exporter of ``fmt``.

    Raises:
        ExportError: an unknown format, or one this drafter type has no exporter for.
    """

    owners = [s.title for s in all_specs().values() if fmt in s.exporters]
    if not owners:
        raise ExportError(f"unknown format {fmt!r}; choose one of {list(formats())}")
    spec = config.spec
    if fmt not in spec.exporters:
        raise ExportError(f"--format {fmt} exports {' and '.join(owners)} drafters; this one is "
                          f"{config.drafter_type} (use --format {' or '.join(spec.exporters)})")
    return spec.exporters[fmt]


def export(src: str | Path, dst: str | Path, fmt: str, target: str | None = None,
           mask_token_id: int | None = None, dtype: str | None = None) -> dict:
    """Write the drafter at ``src`` to ``dst`` in format ``fmt``.

    Args:
        src: a dspark-ray drafter directory (``config.json`` + ``model.safetensors``).
        dst: the output directory (replaced whole when the export succeeds; never a drafter
            directory).
        fmt: one of :func:`formats` that the drafter's type exports ("vllm", "speculators",
            "eagle3").
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
    import torch
    from safetensors import safe_open
    from safetensors.torch import save_file
    from transformers import AutoConfig

    # lazy: import cycle: dspark (via the package) -> export
    from ..base import WEIGHTS_NAME
    from ..loading import check_checkpoint

    if fmt not in formats():
        raise ExportError(f"unknown format {fmt!r}; choose one of {list(formats())}")
    src, dst = Path(src), Path(dst)
    config = check_checkpoint(src)
    if dst.resolve() == src.resolve() or _is_drafter_dir(dst):
        raise ExportError(f"{dst} holds a dspark-ray drafter: export into another directory")
    target = target or config.target_name_or_path
    try:
        num_layers = AutoConfig.from_pretrained(target).num_hidden_layers
    except (OSError, ValueError) as err:
        raise FileNotFoundError(f"cannot load the target {target!r} (--target): {err}") from err
    exporter = _exporter(config, fmt)
    exporter.check(config, num_layers)  # refusals first: configs only, no weights read
    embed, lm_head, archs, tok_len, special, ends = _target_facts(target)
    drafter = config.spec.model_class.from_pretrained(src, embed, lm_head)
    if dtype:
        out_dtype = getattr(torch, dtype)
    else:  # the checkpoint's own (from_pretrained loads in fp32)
        floats = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16}
        with safe_open(str(src / WEIGHTS_NAME), framework="pt") as fh:
            out_dtype = next(floats[fh.get_slice(k).get_dtype()] for k in fh.keys()
                             if fh.get_slice(k).get_dtype() in floats)
    mask = None
    if exporter.mask_token:
        mask = (mask_token_id if mask_token_id is not None
                else choose_mask_token(config.target_vocab_size, tok_len, special, ends))
        if not 0 <= mask < config.target_vocab_size:
            raise ExportError(f"--mask-token-id {mask} is outside the vocabulary "
                              f"[0, {config.target_vocab_size})")
    out = exporter.write(ExportInputs(
        drafter=drafter, embed=embed, lm_head=lm_head, dtype=out_dtype,
        dtype_name=str(out_dtype).removeprefix("torch."), mask_token_id=mask,
        verifier={"name_or_path": str(target), "architectures": archs}))
    fmt = exporter.written_as or fmt
    tensors = {k: (v.to(out_dtype) if v.is_floating_point() and "confidence_head" not in k
                   else v).contiguous().cpu() for k, v in out.tensors.items()}
    # written beside the destination and moved into place whole: a failed export leaves no mix
    # of new weights and an old config
    tmp = dst.with_name(f".{dst.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        for name, content in out.files.items():  # e.g. DFlash's mask_embedding.pt for vLLM
            torch.save(content, tmp / name)
        (tmp / "config.json").write_text(json.dumps(out.config, indent=1) + "\n")
        (tmp / "README.md").write_text(_readme(fmt, config, out.readme_rows, src, str(target)))
        if dst.exists():
            shutil.rmtree(dst)
        os.replace(tmp, dst)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return {"format": fmt, "dst": str(dst), "tensors": len(tensors), "mask_token_id": mask}


def _is_drafter_dir(path: Path) -> bool:
    """Whether ``path`` holds a dspark-ray drafter checkpoint (never overwritten by an export)."""
    # lazy: import cycle: dspark (via the package) -> export
    from ..config import MODEL_TYPE

    try:
        return json.loads((path / "config.json").read_text()).get("model_type") == MODEL_TYPE
    except (OSError, ValueError):
        return False


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m drafters.export",
                                     description=__doc__.split("\n")[0])
    parser.add_argument("--format", required=True, choices=formats())
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
