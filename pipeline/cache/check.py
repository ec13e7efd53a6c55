"""The cache's head check: the target's LM head on a cached final state reproduces the target's own
logits (issue 42).

Training computes the target side of every loss from the cache's ``last_hidden`` through the
frozen LM head (``pipeline.train.worker.TargetHead``: the head weight read by
``drafters.target_weights.load_frozen_head``, Gemma 2's soft cap applied). If that state is not
exactly what the target's LM head reads (a pre-norm state, an untrained norm, a template that
tokenizes differently, a dtype slip), the drafter trains toward another distribution than the one
the target samples from, and the first sign is a served tau far below the trainer's. The cache
stage therefore reads back the first row of each split's first shard from the written file and
compares, on its supervised positions, the head applied to the cached state against the full
target forward on the row's ``input_ids``.
"""

from __future__ import annotations

import pyarrow.parquet as pq

from .. import storage
from ..train.worker import TargetHead
from .format import decode_row

# Measured on SmolLM2-135M (session 33): a correct cache leaves 0.3 % (fp32 forward) to 1.4-2.1 %
# (bf16 forward: the cache's batched pass and the check's single pass round differently, and the
# error grows along a row) relative error in the logits; a pre-norm cache leaves 2,575 %. The bound
# sits ~10x above the bf16 noise, so a long bf16 row of a larger target does not trip it
MAX_RELATIVE_ERROR = 0.25
CHECKED_POSITIONS = 256  # the row's last supervised positions: bounds the [n, V] logits


class CacheHeadMismatchError(ValueError):
    """The target's LM head on the cached final state does not give the target's own logits
    (shard, sample and the measured error named)."""


def read_first_row(shard_file: str, hidden_size: int, num_context_layers: int,
                   storage_options: dict | None = None) -> dict:
    """The first row of a written shard, decoded (:func:`pipeline.cache.format.decode_row`), read
    from its first row group only (a cluster shard is hundreds of MB)."""
    fs, inner = storage.get_arrow_fs(shard_file, storage_options)
    with fs.open_input_file(inner) as fh:
        table = pq.ParquetFile(fh).read_row_group(0)
    return decode_row(table.slice(0, 1).to_pylist()[0], hidden_size, num_context_layers)


def head_agreement(model, row: dict, head_weight, softcap: float | None = None) -> dict:
    """The head on the cached state against the target's forward, on a row's supervised positions.

    Args:
        model: the target (``AutoModelForCausalLM``, any dtype and device).
        row: a decoded cache row (torch tensors): ``input_ids`` int64 [T], ``loss_mask`` uint8
            [T], ``last_hidden`` bf16 [T, H].
        head_weight: the frozen LM head [V, H] as training loads it.
        softcap: the target's final logit soft cap (``final_logit_softcap``), None: none.
    Returns:
        ``{"positions", "relative_error", "top1_agreement"}``: the Frobenius norm of (head logits
        - target logits) over that of the target logits, both fp32 [n, V], and the share of
        positions whose argmax agrees.
    """
    import torch

    mask = torch.as_tensor(row["loss_mask"]).bool()  # [T]
    positions = torch.nonzero(mask).flatten()[-CHECKED_POSITIONS:]
    if positions.numel() == 0:  # nothing supervised: the last positions then
        positions = torch.arange(mask.numel())[-CHECKED_POSITIONS:]
    ids = torch.as_tensor(row["input_ids"], dtype=torch.long)[None]  # [1, T]
    device = next(model.parameters()).device
    with torch.no_grad():
        # logits of the checked tail only (a [T, V] fp32 tensor is GBs at Qwen3's vocabulary)
        keep = ids.shape[1] - int(positions[0])
        logits = model(input_ids=ids.to(device), logits_to_keep=keep).logits[0]  # [keep, V]
        target = logits.float().cpu()[positions - int(positions[0])]  # [n, V]
        state = torch.as_tensor(row["last_hidden"])[positions].float()  # [n, H]
        head = TargetHead(head_weight.float(), torch.float32, softcap).logits(state)  # [n, V]
    return {"positions": int(positions.numel()),
            "relative_error": float(torch.linalg.norm(head - target) / torch.linalg.norm(target)),
            "top1_agreement": float((head.argmax(-1) == target.argmax(-1)).float().mean())}


def check_head_agreement(result: dict, shard_file: str, sample_id: str) -> None:
    """Raise when :func:`head_agreement`'s result says the cached state is not the head's input.

    Raises:
        CacheHeadMismatchError: relative error above ``MAX_RELATIVE_ERROR``.
    """
    if result["relative_error"] > MAX_RELATIVE_ERROR:
        raise CacheHeadMismatchError(
            f"{shard_file}, sample {sample_id}: the target's LM head on the cached final state "
            f"differs from the target's own logits (relative error "
            f"{result['relative_error']:.3f} > {MAX_RELATIVE_ERROR}, top-1 agreement "
            f"{result['top1_agreement']:.0%} over {result['positions']} positions): the cache "
            "does not hold the state before the LM head (a pre-norm state?), so a drafter "
            "trained on it would learn another distribution than the target's")
