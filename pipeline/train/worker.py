"""Train stage, the pieces of a Ray Train worker's step: the LR schedule, DeepSpeed's config
(ZeRO-1/2), the frozen target head, one micro-batch's losses, the metrics reduction over the
workers and the non-finite-loss handling (SPEC section 3). The loop that runs them is
``pipeline/train/loop.py``.

Workers receive only O(H) hidden states from the cache; target probabilities are recomputed on the
worker from ``last_hidden`` through the frozen LM head and only at supervised rows (never V-sized
tensors in the cache or on the wire). The driver is ``pipeline/train/driver.py``; checkpoints
``pipeline/train/state.py``.
"""

from __future__ import annotations

import logging
import math
import os
from typing import TYPE_CHECKING

from drafters.base import WEIGHTS_NAME
from drafters.config import DrafterCheckpointError
from drafters.loading import check_checkpoint
from drafters.losses import chunked_drafter_losses
from drafters.precision import train_precision
from serve.engine.build_lock import exclusive_build

if TYPE_CHECKING:
    from ..config import TrainConfig

logger = logging.getLogger(__name__)


def load_deepspeed_cpu_comm_op(extensions_dir: str) -> None:
    """Build or load DeepSpeed's CPU shared-memory communication op (``deepspeed_shm_comm``)
    under :func:`serve.engine.build_lock.exclusive_build`, before ``deepspeed.initialize`` asks
    for it: DeepSpeed keeps the loaded op for the process, so its own load finds it, and a torch
    lock file a killed worker left in the op's build directory no longer makes every later
    training run wait forever. Nothing happens where DeepSpeed's accelerator has no such op or
    finds it incompatible (DeepSpeed then communicates without it, as before).

    Args:
        extensions_dir: ``$TORCH_EXTENSIONS_DIR``, where torch builds the op (in a directory
            named after it).
    Raises:
        TimeoutError: another live process kept building the op (:func:`exclusive_build`).
    """
    import deepspeed.ops
    from deepspeed.accelerator import get_accelerator

    builder = get_accelerator().create_op_builder("ShareMemCommBuilder")
    if builder is None or not deepspeed.ops.__compatible_ops__.get(builder.NAME, False):
        return
    with exclusive_build(os.path.join(extensions_dir, builder.NAME)):
        builder.load()


def lr_lambda(total_steps: int, warmup_ratio: float):
    """Linear warm-up over ``warmup_ratio`` of the steps, then cosine to 0 (SPEC 3)."""
    warmup = max(1, int(round(total_steps * warmup_ratio))) if warmup_ratio > 0 else 0

    def fn(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = (step - warmup) / max(1, total_steps - warmup)
        return 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))

    return fn


def uses_bf16(tc: TrainConfig, probe: bool = True) -> bool:
    """Whether training computes in bf16: ``train.precision`` resolved for the workers' device
    (``auto``: bf16 where it is native, :func:`drafters.precision.train_precision`). ``probe``
    False: a driver planning for GPU workers, which must not open a CUDA context (bf16 assumed
    on GPUs)."""
    return train_precision(tc.precision, "cuda" if tc.use_gpu else "cpu", probe=probe) == "bf16"


def deepspeed_config(tc: TrainConfig, world_size: int) -> dict:
    accum = tc.global_batch_size // (tc.micro_batch_size * world_size)
    cfg = {
        "train_batch_size": tc.global_batch_size,
        "train_micro_batch_size_per_gpu": tc.micro_batch_size,
        "gradient_accumulation_steps": accum,
        "gradient_clipping": tc.grad_clip,
        "zero_optimization": {"stage": tc.zero_stage},
        "optimizer": {"type": "AdamW", "params": {"lr": tc.lr, "betas": [0.9, 0.95],
                                                  "eps": 1e-8, "weight_decay": tc.weight_decay,
                                                  "torch_adam": True}},
        "steps_per_print": 10**9,
    }
    # bf16 runs as autocast around the forward (pipeline/train/loop.py): the weights, gradients and
    # optimizer state stay fp32 (SPEC 3: bf16 with fp32 master weights) on CPU and GPU alike. On
    # CUDA, DeepSpeed's engine.forward re-enters autocast(enabled=False) unless its own
    # torch_autocast section asks for bf16, which would silently run the backbone in fp32.
    if uses_bf16(tc) and tc.use_gpu:
        cfg["torch_autocast"] = {"enabled": True, "dtype": "bfloat16"}
    return cfg


class TargetHead:
    """The frozen target LM head of one training worker, for the target side of the loss.

    ``logits(rows)`` returns the target logits [n, V] of ``rows`` [n, H] in ``dtype`` (the
    autocast dtype under bf16), written into one buffer that every call reuses: the returned
    tensor is only valid until the next call (the loss turns each chunk into probabilities at
    once, :func:`drafters.losses.target_terms`). Why not ``F.linear`` under autocast: autocast
    casts a weight that needs no grad anew on every call (its cast cache keeps only leaf tensors
    that require grad), and each chunk's logits were a fresh [~880, 49,152] bf16 tensor (~86 MB);
    glibc serves blocks that large with mmap and unmaps them on free, so every micro-batch
    page-faulted them in again. This is a part of the reference run's page faults, not most of
    them (a smoke run of ``benchmarks/train_throughput.py``: 88 k -> 77 k minor faults a step; the
    rest come from glibc trimming the training thread's arena). Results are identical (same
    product in the same dtype).

    Args:
        weight: the LM head [V, H] (frozen; cast once here).
        dtype: the dtype of the product (torch.bfloat16 under bf16 autocast, else the weight's).
        softcap: the target's final logit soft cap c (``c * tanh(logits / c)``, Gemma 2:
            :func:`drafters.target_weights.final_logit_softcap`), applied in place; None: none.
    """

    def __init__(self, weight, dtype, softcap: float | None = None):
        self.weight = weight.detach().to(dtype)
        self.softcap = softcap
        self.copied = weight.dtype != dtype  # else the head itself, shared
        self.buffer = None

    def reserve(self, n: int):
        """The logits buffer, grown to hold at least ``n`` rows: [>= n, V]."""
        import torch

        if self.buffer is None or self.buffer.shape[0] < n:
            self.buffer = None  # the old one goes before the new one comes
            self.buffer = torch.empty(n, self.weight.shape[0], dtype=self.weight.dtype,
                                      device=self.weight.device)
        return self.buffer

    def logits(self, rows):
        """Target logits of ``rows`` [n, H]: [n, V] in the head's dtype (a view of the buffer)."""
        import torch

        x = rows.detach().to(self.weight.dtype)
        out = torch.mm(x, self.weight.t(), out=self.reserve(x.shape[0])[:x.shape[0]])
        if self.softcap is not None:  # as the target's forward does after its LM head
            out.div_(self.softcap).tanh_().mul_(self.softcap)
        return out

    def owned_bytes(self) -> int:
        """Bytes this head holds beyond the LM head it was made from (its cast copy, if any, and
        its buffer)."""
        return ((self.weight.numel() * self.weight.element_size() if self.copied else 0)
                + (0 if self.buffer is None else self.buffer.numel() * self.buffer.element_size()))


def target_head(model, tc: TrainConfig, softcap: float | None = None) -> TargetHead:
    """A :class:`TargetHead` of ``model`` (a DeepSpeed engine or a bare drafter) in the dtype
    ``tc.precision`` computes in, with the target's final logit soft cap ``softcap``."""
    import torch

    module = getattr(model, "module", model)
    dtype = torch.bfloat16 if uses_bf16(tc) else module.lm_head_weight.dtype
    return TargetHead(module.lm_head_weight, dtype, softcap)


def batch_losses(model, samples: list[dict], tc: TrainConfig, objective: str, weights, device,
                 generators, head: TargetHead | None = None) -> dict:
    """Pack ``samples``, run the drafter and return
    :func:`drafters.losses.chunked_drafter_losses`.

    Target probabilities come from the cached O(H) ``last_hidden`` through the frozen LM head,
    only at supervised rows and one chunk of rows at a time (SPEC 3: never V-sized tensors on the
    wire; no [rows, V] tensor lives longer than a chunk, but for the head's one reused [chunk, V]
    logits buffer). ``head``: the worker's
    :class:`TargetHead`, reused across calls (None: one for this call).
    """
    import torch

    module = getattr(model, "module", model)  # DeepSpeed engine or the bare drafter
    pb = module.pack_blocks(samples, tc.num_anchors, generators).to(device)
    valid = pb.label_valid
    with torch.autocast(device.type, dtype=torch.bfloat16, enabled=uses_bf16(tc)):
        hidden = model(pb)
        feat, conf = module.head_features(hidden, pb.prev_tokens)
        hidden_rows = hidden[valid]
        feat_rows = None if feat is None else feat[valid]
        target_rows = pb.target_hidden[valid]
        head = head if head is not None else target_head(model, tc)

        def draft_logits(idx):
            return module.logits_from(hidden_rows[idx], None if feat_rows is None else feat_rows[idx])

        def target_logits(idx):  # bf16 under bf16: target_terms converts it slice by slice
            return head.logits(target_rows[idx])

        return chunked_drafter_losses(draft_logits, target_logits, pb.labels, valid, weights, conf,
                                      tuple(tc.loss_weights), objective=objective,
                                      draft_vocab=module.d2t, chunk_rows=tc.loss_chunk_rows)


METRIC_KEYS = ("loss", "ce", "tv", "conf", "soft_ce", "tau", "draft_vocab_coverage")


def reduce_metrics(outs: list[dict], block_size: int, prefix: str = "", device=None) -> dict:
    """Mean of per-micro-batch metrics over micro-batches and all workers (all-reduce on
    ``device``: NCCL reduces only GPU tensors, gloo CPU ones)."""
    import torch
    import torch.distributed as dist

    vec = torch.zeros(len(METRIC_KEYS) + block_size + 1)
    for o in outs:
        vec[:len(METRIC_KEYS)] += torch.stack([o[k].detach().float().cpu() for k in METRIC_KEYS])
        vec[len(METRIC_KEYS):-1] += o["accept_rate"].detach().float().cpu()
        vec[-1] += 1
    if dist.is_available() and dist.is_initialized():
        vec = vec.to(device or "cpu")
        dist.all_reduce(vec)
        vec = vec.cpu()
    vec = vec / vec[-1].clamp(min=1)
    out = {f"{prefix}{k}": float(vec[i]) for i, k in enumerate(METRIC_KEYS)}
    out.update({f"{prefix}accept_rate@{k + 1}": float(vec[len(METRIC_KEYS) + k])
                for k in range(block_size)})
    return out


class NonFiniteLossError(RuntimeError):
    """More consecutive optimizer steps had a non-finite loss than ``train.max_bad_steps``."""


def finite_on_all_workers(loss, device) -> bool:
    """True when ``loss`` (scalar tensor) is finite on every worker (all-reduce MIN over the
    workers; a single process just checks its own), so all workers take the same branch."""
    import torch
    import torch.distributed as dist

    ok = torch.isfinite(loss.detach()).to(torch.float32).reshape(1)
    if dist.is_available() and dist.is_initialized():
        ok = ok.to(device)
        dist.all_reduce(ok, op=dist.ReduceOp.MIN)
    return bool(ok.item() > 0)


def zero_loss(engine):
    """A loss of exactly 0 connected to every trainable parameter: its backward adds zero
    gradients, which keeps DeepSpeed's micro-step count and gradient all-reduce in step on all
    workers when one micro-batch's loss is unusable."""
    params = [p for p in engine.module.parameters() if p.requires_grad]
    return sum(p.sum() for p in params) * 0.0


def skip_update(engine) -> None:
    """Make the coming optimizer step leave the parameters unchanged: the learning rate is 0 for
    this one step (the LR scheduler, stepped right after, restores it). The step still counts in
    the schedule, and AdamW's moments see the step's finite micro-batches: a skipped step differs
    from no step by that moment update only."""
    for group in engine.optimizer.param_groups:
        group["lr"] = 0.0


def init_weights(model, path: str) -> None:
    """Start new training from an existing drafter's weights (not a resume: optimizer, schedule
    and data position start fresh).

    Raises:
        ValueError: the checkpoint's architecture or draft vocabulary differs from the configured
            drafter (each differing field named).
        DrafterCheckpointError (a ValueError): the weights are missing tensors or of other shapes.
    """
    from safetensors.torch import load_file

    src = check_checkpoint(path)
    keys = ("drafter_type", "hidden_size", "num_hidden_layers", "block_size", "head_type",
            "markov_rank", "target_layer_ids", "target_vocab_size", "draft_vocab_size",
            "draft_vocab_sha256")

    def value(cfg, key):  # markov_rank is DSpark's option: absent (None) for other types
        return getattr(cfg.options, key, None) if key == "markov_rank" else getattr(cfg, key)

    diff = [f"{k}: {value(src, k)} != {value(model.config, k)}" for k in keys
            if value(src, k) != value(model.config, k)]
    if diff:
        raise ValueError(f"train.init_from {path} does not match the configured drafter: "
                         + "; ".join(diff))
    try:
        model.load_state_dict(load_file(os.path.join(path, WEIGHTS_NAME)), strict=True)
    except RuntimeError as err:  # missing tensors or other shapes
        raise DrafterCheckpointError(f"train.init_from {os.path.join(path, WEIGHTS_NAME)}: "
                                     f"{str(err).strip()}") from err
