"""Train stage: Ray Train ``TorchTrainer`` + DeepSpeed (ZeRO-1/2) over the target cache, streamed
through Ray Data (SPEC section 3).

Workers receive only O(H) hidden states from the cache; target probabilities are recomputed on the
worker from ``last_hidden`` through the frozen LM head and only at supervised rows (never V-sized
tensors in the cache or on the wire). Checkpoints are a Hugging Face drafter directory plus the
DeepSpeed training state, reported to Ray Train.
"""

from __future__ import annotations

import json
import logging
import math
import os
import shutil
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

from .train_data import plateau_reached, steps_per_epoch

if TYPE_CHECKING:
    from .config import DrafterSection, TrainConfig

logger = logging.getLogger(__name__)
PREFETCH_MICRO_BATCHES = 4  # micro-batches each worker reads ahead of its training loop


def build_drafter_config(target_config, target_name: str, layer_ids: list[int],
                         drafter: DrafterSection):
    """The drafter's config from the target's dimensions and the typed ``drafter`` config section
    (``pipeline.config.DrafterSection``): the one path from the YAML to ``DSparkConfig``.

    Eagle3 takes ``drafter.eagle3_num_layers`` decoder layers and no heads (SPEC 2).
    """
    from drafters.config import DSparkConfig

    tc = target_config
    kind = drafter.drafter_type
    return DSparkConfig(
        drafter_type=kind, target_name_or_path=target_name,
        target_vocab_size=tc.vocab_size, target_hidden_size=tc.hidden_size,
        target_layer_ids=layer_ids, block_size=drafter.block_size,
        num_hidden_layers=drafter.eagle3_num_layers if kind == "eagle3" else drafter.num_layers,
        hidden_size=tc.hidden_size, num_attention_heads=tc.num_attention_heads,
        num_key_value_heads=getattr(tc, "num_key_value_heads", None) or tc.num_attention_heads,
        head_dim=getattr(tc, "head_dim", None) or tc.hidden_size // tc.num_attention_heads,
        intermediate_size=tc.intermediate_size, rms_norm_eps=tc.rms_norm_eps,
        rope_theta=_rope_theta(tc), max_position_embeddings=tc.max_position_embeddings,
        head_type=drafter.head_type if kind == "dspark" else "none",
        markov_rank=drafter.markov_rank,
        confidence_head=drafter.confidence_head if kind == "dspark" else False,
        loss_decay=drafter.loss_decay,
        qk_norm=(drafter.qk_norm if drafter.qk_norm is not None
                 else getattr(tc, "model_type", "") in ("qwen3", "qwen3_moe")),
        draft_vocab_size=drafter.draft_vocab_size)


def training_objective(config):
    """(loss objective name, position weights fp32 [K]) of a drafter type (SPEC 3; Eagle3 per
    SPEC 2)."""
    from drafters.losses import eagle3_step_weights, position_weights

    if config.drafter_type == "eagle3":
        return "soft_ce", eagle3_step_weights(config.block_size)
    objective = "ce" if config.drafter_type == "dflash" else "dspark"
    return objective, position_weights(config.block_size, config.loss_decay)


def _rope_theta(tc) -> float:
    params = getattr(tc, "rope_parameters", None) or {}
    return float(params.get("rope_theta") or getattr(tc, "rope_theta", 10000.0))


def load_frozen_head(target_name: str, top_layers: int = 0):
    """(target config, embedding [V, H], LM head [V, H]) of the target, fp32 on CPU; with
    ``top_layers`` > 0 also (state dicts of the last ``top_layers`` decoder layers, the final
    norm's state dict) for :meth:`drafters.modeling.DSparkDrafter.init_from_target`.

    Only those tensors are read, from the checkpoint's safetensors files (a 4B target's worker
    reads ~1.6 GB, not 16 GB of fp32 weights); a checkpoint in another format or with other
    tensor names is loaded whole with ``from_pretrained`` instead.
    """
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(target_name)
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
    import torch
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
    from serve.target_loading import load_target

    model = load_target(target_name, "float32")
    emb = model.get_input_embeddings().weight.detach().clone()
    head = model.get_output_embeddings().weight.detach().clone()
    if not top_layers:
        return model.config, emb, head
    layers = [{k: v.detach().clone() for k, v in layer.state_dict().items()}
              for layer in model.model.layers[-top_layers:]]
    norm = {k: v.detach().clone() for k, v in model.model.norm.state_dict().items()}
    return model.config, emb, head, (layers, norm)


def lr_lambda(total_steps: int, warmup_ratio: float):
    """Linear warm-up over ``warmup_ratio`` of the steps, then cosine to 0 (SPEC 3)."""
    warmup = max(1, int(round(total_steps * warmup_ratio))) if warmup_ratio > 0 else 0

    def fn(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = (step - warmup) / max(1, total_steps - warmup)
        return 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))

    return fn


def deepspeed_config(tc: dict, world_size: int) -> dict:
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
    # bf16 runs as autocast around the forward (train_loop_per_worker): the weights, gradients and
    # optimizer state stay fp32 (SPEC 3: bf16 with fp32 master weights) on CPU and GPU alike. On
    # CUDA, DeepSpeed's engine.forward re-enters autocast(enabled=False) unless its own
    # torch_autocast section asks for bf16, which would silently run the backbone in fp32.
    if tc.precision == "bf16" and tc.use_gpu:
        cfg["torch_autocast"] = {"enabled": True, "dtype": "bfloat16"}
    return cfg


def batch_losses(model, samples: list[dict], tc: dict, objective: str, weights, device,
                 generators) -> dict:
    """Pack ``samples``, run the drafter and return
    :func:`drafters.losses.chunked_drafter_losses`.

    Target probabilities come from the cached O(H) ``last_hidden`` through the frozen LM head,
    only at supervised rows and one chunk of rows at a time (SPEC 3: never V-sized tensors on the
    wire; no [rows, V] tensor lives longer than a chunk).
    """
    import torch

    from drafters.losses import chunked_drafter_losses
    from drafters.packing import pack_blocks

    module = getattr(model, "module", model)  # DeepSpeed engine or the bare drafter
    cfg = module.config
    pb = pack_blocks(samples, tc.num_anchors, cfg.block_size, generators,
                     min_anchor=1 if cfg.drafter_type == "eagle3" else 0).to(device)
    valid = pb.label_valid
    with torch.autocast(device.type, dtype=torch.bfloat16, enabled=tc.precision == "bf16"):
        hidden = model(pb)
        feat, conf = module.head_features(hidden, pb.prev_tokens)
        hidden_rows = hidden[valid]
        feat_rows = None if feat is None else feat[valid]
        target_rows = pb.target_hidden[valid]
        head_w = module.lm_head_weight

        def draft_logits(idx):
            return module.logits_from(hidden_rows[idx], None if feat_rows is None else feat_rows[idx])

        def target_logits(idx):
            return torch.nn.functional.linear(target_rows[idx].to(head_w.dtype), head_w).float()

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


def train_loop_per_worker(loop_cfg: dict) -> None:
    """Ray Train worker: builds the drafter, wraps it in DeepSpeed, trains on its slice of every
    global batch, evaluates on the held-out split every ``eval_every`` steps, checkpoints every
    ``checkpoint_every`` steps, and resumes from ``resume_checkpoint`` when given."""
    os.environ.setdefault("TORCH_EXTENSIONS_DIR", loop_cfg["torch_extensions_dir"])
    # wandb writes only under the run directory and stays quiet (offline mode opens no connection)
    os.environ["WANDB_DIR"] = loop_cfg["wandb_dir"]
    os.environ["WANDB_SILENT"] = "true"
    import deepspeed
    import ray.train
    import torch

    from drafters.loading import build_drafter

    from .train_data import CacheRowIndex, CacheRowReader, row_generator, worker_plan

    from .config import DrafterSection, TrainConfig

    # Ray passes plain data: the typed sections are rebuilt (and re-validated) here
    tc = TrainConfig.model_validate(loop_cfg["train"])
    dsec = DrafterSection.model_validate(loop_cfg["drafter"])
    ctx = ray.train.get_context()
    rank, world = ctx.get_world_rank(), ctx.get_world_size()
    if tc.num_threads:
        torch.set_num_threads(tc.num_threads)
    torch.manual_seed(tc.seed)
    device = torch.device("cuda", ctx.get_local_rank()) if tc.use_gpu else torch.device("cpu")

    from_target = dsec.init == "target_layers"
    dcfg_layers = dsec.num_layers
    target_cfg, emb, head, *top = load_frozen_head(loop_cfg["target"],
                                                   dcfg_layers if from_target else 0)
    dcfg = build_drafter_config(target_cfg, loop_cfg["target"], loop_cfg["layer_ids"],
                                dsec)
    model = build_drafter(dcfg, emb, head, loop_cfg.get("draft_vocab"))
    if from_target and not loop_cfg.get("init_from") and not loop_cfg["resume_from"]:
        model.init_from_target(*top[0])
    if loop_cfg.get("init_from"):
        init_weights(model, loop_cfg["init_from"])
    model = model.to(device)
    total_steps = loop_cfg["total_steps"]
    engine, _, _, _ = deepspeed.initialize(
        model=model, model_parameters=[p for p in model.parameters() if p.requires_grad],
        config=deepspeed_config(tc, world),
        lr_scheduler=lambda opt: torch.optim.lr_scheduler.LambdaLR(
            opt, lr_lambda(total_steps, tc.warmup_ratio)))
    objective, weights = training_objective(dcfg)
    weights = weights.to(device)
    step = 0
    restored = resume_checkpoint(loop_cfg)
    history = []
    if restored is not None:
        with restored.as_directory() as ckpt_dir:
            step = load_training_state(engine, ckpt_dir)
            history = load_training_log(ckpt_dir, step)

    hidden, m = loop_cfg["hidden_size"], len(loop_cfg["layer_ids"])
    so = loop_cfg["storage_options"]
    train_index = CacheRowIndex(loop_cfg["cache_dir"], loop_cfg["manifest"], "train", so)
    reader = CacheRowReader(train_index, hidden, m)
    heldout_rows = heldout_reader = None
    if tc.eval_every and loop_cfg["manifest"]["splits"].get("heldout", {}).get("rows"):
        h_index = CacheRowIndex(loop_cfg["cache_dir"], loop_cfg["manifest"], "heldout", so)
        heldout_reader = CacheRowReader(h_index, hidden, m)
        heldout_rows = list(range(min(h_index.num_rows, tc.eval_rows)))[rank::world]

    run = bar = None
    if rank == 0 and loop_cfg["wandb"]["mode"] != "disabled":
        import wandb

        # one W&B run per run directory: resumes and later stages log into it (pipeline/tracking.py)
        manifest = loop_cfg["manifest"]
        run = wandb.init(project=loop_cfg["wandb"]["project"], entity=loop_cfg["wandb"]["entity"],
                         mode=loop_cfg["wandb"]["mode"], dir=loop_cfg["wandb_dir"],
                         id=loop_cfg["wandb_run_id"], resume="allow", job_type="train",
                         name=loop_cfg["run_name"],
                         config={"train": tc.model_dump(), "drafter": dsec.model_dump(),
                                 "target": loop_cfg["target"], "layer_ids": loop_cfg["layer_ids"],
                                 "cache_manifest": {k: manifest.get(k) for k in (
                                     "target", "layer_ids", "splits", "max_length",
                                     "template_sha256", "draft_vocab_coverage")},
                                 "draft_vocab_size": len(loop_cfg["draft_vocab"] or [])})
    if rank == 0:
        from tqdm import tqdm

        bar = tqdm(total=total_steps, initial=step, desc="train", unit="step", mininterval=5)

    def heldout_metrics() -> dict:
        engine.eval()
        outs = []
        with torch.no_grad():
            for i in range(0, len(heldout_rows), tc.micro_batch_size):
                rows = heldout_rows[i:i + tc.micro_batch_size]
                gens = [row_generator(tc.seed, -1, r) for r in rows]
                outs.append(batch_losses(engine, heldout_reader.read(rows), tc, objective,
                                         weights, device, gens))
        engine.train()
        return reduce_metrics(outs, dcfg.block_size, prefix="heldout_", device=device)

    per_epoch = loop_cfg["steps_per_epoch"]
    last = {"step": step}
    if history and history[-1].get("plateau"):  # a finished run: report its state once more
        total_steps = step
        save_training_state(engine, step, world, history, history[-1], loop_cfg)
    skipped, bad_in_a_row = (history[-1].get("skipped_steps", 0) if history else 0), 0
    # times this run continued from a checkpoint (a worker-group restart or a re-run's resume)
    resumes = history[-1].get("resumes", 0) + 1 if restored is not None and history else 0
    # every micro-batch this worker will read, in order; the reader works PREFETCH_MICRO_BATCHES
    # ahead of the loop without changing what a step sees (pipeline/train_data.py)
    micro_per_step = tc.global_batch_size // world // tc.micro_batch_size
    stream = reader.prefetch(worker_plan(train_index, tc.seed, step, total_steps, per_epoch,
                                         tc.global_batch_size, tc.micro_batch_size, rank, world),
                             depth=PREFETCH_MICRO_BATCHES)
    while step < total_steps:
        epoch = step // per_epoch
        outs, bad = [], False
        for _ in range(micro_per_step):
            rows, samples = next(stream)
            gens = [row_generator(tc.seed, epoch, r) for r in rows]
            out = batch_losses(engine, samples, tc, objective, weights, device, gens)
            loss = out["loss"]
            if not finite_on_all_workers(loss, device):
                # every worker still runs backward and step, so DeepSpeed's gradient all-reduce
                # stays in lock-step; the zero loss adds nothing to the accumulated gradients
                bad, loss = True, zero_loss(engine)
            else:
                outs.append(out)
            engine.backward(loss)
            if bad and engine.is_gradient_accumulation_boundary():
                skip_update(engine)
            engine.step()
        step += 1
        if bad:
            skipped, bad_in_a_row = skipped + 1, bad_in_a_row + 1
            logger.warning("step %d: non-finite loss on some worker, update skipped (%d in a "
                           "row, %d in all)", step, bad_in_a_row, skipped)
            if bad_in_a_row > tc.max_bad_steps:
                raise NonFiniteLossError(
                    f"{bad_in_a_row} consecutive optimizer steps (last: {step}) had a non-finite "
                    f"loss, more than train.max_bad_steps = {tc.max_bad_steps}: check the cache "
                    "for NaN/inf features and the learning rate; the checkpoints written before "
                    "are intact")
        else:
            bad_in_a_row = 0
        last = {"step": step, "epoch": epoch, "lr": engine.get_lr()[0], "skipped_steps": skipped,
                "resumes": resumes,
                **reduce_metrics(outs, dcfg.block_size, device=device)}
        if heldout_rows is not None and (step % tc.eval_every == 0 or step == total_steps):
            last.update(heldout_metrics())
        history.append(last)
        if plateau_reached(history, tc.plateau_patience, tc.plateau_min_delta):
            last["plateau"] = True  # recorded in the log: a re-run does not train on
            logger.info("step %d: held-out tau has not improved by %.3f for %d evaluations: "
                        "stopping at the plateau", step, tc.plateau_min_delta, tc.plateau_patience)
            total_steps = step
        if rank == 0:
            if run is not None and (step % tc.log_every == 0 or step == total_steps):
                run.log(last, step=step)
            bar.update(1)
            bar.set_postfix(loss=f"{last['loss']:.3f}", tau=f"{last['tau']:.2f}")
        if step == total_steps or (tc.checkpoint_every and step % tc.checkpoint_every == 0):
            save_training_state(engine, step, world, history, last, loop_cfg)
    stream.close()
    reader.close()
    if heldout_reader is not None:
        heldout_reader.close()
    if bar is not None:
        bar.close()
    if run is not None:
        run.finish()


class TrainingFailedError(RuntimeError):
    """The Ray Train run failed (its workers' errors in the message)."""


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
        ValueError: the checkpoint's architecture differs from the configured drafter.
    """
    from safetensors.torch import load_file

    from drafters.config import DrafterCheckpointError
    from drafters.loading import check_checkpoint
    from drafters.modeling import WEIGHTS_NAME

    src = check_checkpoint(path)
    keys = ("drafter_type", "hidden_size", "num_hidden_layers", "block_size", "head_type",
            "markov_rank", "target_layer_ids", "target_vocab_size")
    diff = [f"{k}: {getattr(src, k)} != {getattr(model.config, k)}" for k in keys
            if getattr(src, k) != getattr(model.config, k)]
    if diff:
        raise ValueError(f"train.init_from {path} does not match the configured drafter: "
                         + "; ".join(diff))
    try:
        model.load_state_dict(load_file(os.path.join(path, WEIGHTS_NAME)), strict=True)
    except RuntimeError as err:  # missing tensors or other shapes
        raise DrafterCheckpointError(f"train.init_from {os.path.join(path, WEIGHTS_NAME)}: "
                                     f"{str(err).strip()}") from err


def save_training_state(engine, step: int, world: int, history: list[dict], metrics: dict,
                        loop_cfg: dict) -> None:
    """Report a Ray Train checkpoint: DeepSpeed state (model, optimizer, LR schedule; every rank
    writes its shard), the HF drafter directory, the training log and ``train_state.json``; then,
    once every rank's upload has returned, rank 0 marks it complete (``pipeline/checkpoints.py``:
    the marker lists every rank's files and sizes, so ``resume_from: latest`` can tell a
    checkpoint some rank did not finish from a complete one). All workers call this together.

    Raises:
        OSError: writing the completion marker failed (the checkpoint then counts as incomplete).
    """
    import ray.train
    import torch.distributed as dist
    from ray.train import Checkpoint

    from .checkpoints import STATE, checkpoint_url, local_files, train_state_bytes, write_marker

    rank = ray.train.get_context().get_world_rank()
    with tempfile.TemporaryDirectory() as tmp:
        engine.save_checkpoint(os.path.join(tmp, "deepspeed"), tag="state")
        if rank == 0:
            engine.module.save_pretrained(os.path.join(tmp, "drafter"))
            with open(os.path.join(tmp, "drafter", "training_log.jsonl"), "w") as fh:
                fh.writelines(json.dumps(h) + "\n" for h in history)
            with open(os.path.join(tmp, STATE), "wb") as fh:
                fh.write(train_state_bytes(step, world))
        rank_files = [None] * world
        dist.all_gather_object(rank_files, local_files(tmp))
        ray.train.report(metrics, checkpoint=Checkpoint.from_directory(tmp))
    # report returns once this rank's files are uploaded: past the barrier, every rank's are
    dist.barrier()
    if rank == 0:
        write_marker(checkpoint_url(ray.train.get_checkpoint().path, loop_cfg["storage_path"]),
                     step, rank_files, loop_cfg["storage_options"])


def resume_checkpoint(loop_cfg: dict):
    """The ``ray.train.Checkpoint`` this worker group continues from, or None (step 0); the same
    on every worker (rank 0 chooses with :func:`pipeline.checkpoints.restore_choice`, from Ray
    Train's restored checkpoint and the driver's ``resume_from``, and broadcasts the choice).
    Call it on all workers together, after the process group is up."""
    import ray.train
    import torch.distributed as dist

    from . import storage
    from .checkpoints import checkpoint_url, restore_choice

    so, storage_path = loop_cfg["storage_options"], loop_cfg["storage_path"]
    choice = [None]
    if ray.train.get_context().get_world_rank() == 0:
        restored = ray.train.get_checkpoint()
        choice[0] = restore_choice(
            checkpoint_url(restored.path, storage_path) if restored is not None else None,
            loop_cfg["resume_from"], storage_path, loop_cfg["run_name"], so)
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.broadcast_object_list(choice, src=0)
    if choice[0] is None:
        return None
    fs, path = storage.get_arrow_fs(choice[0], so)
    return ray.train.Checkpoint(path, filesystem=fs)


def load_training_log(checkpoint_dir: str, step: int) -> list[dict]:
    """The training log of a checkpoint's run up to ``step`` (a resumed run continues it, so the
    final drafter's ``training_log.jsonl`` covers every step); [] if the checkpoint has none."""
    path = os.path.join(checkpoint_dir, "drafter", "training_log.jsonl")
    if not os.path.isfile(path):
        return []
    with open(path) as fh:
        return [h for h in map(json.loads, fh) if h["step"] <= step]


def load_training_state(engine, checkpoint_dir: str) -> int:
    """Restore model, optimizer and LR schedule from a checkpoint written by
    :func:`save_training_state`; returns the optimizer step to continue from (the data position
    follows from it, see ``pipeline/train_data.py``).

    With the worker count of the run that saved it, the DeepSpeed checkpoint loads as it is. With
    another worker count a ZeRO checkpoint's optimizer partitions do not fit, so it is first
    converted to DeepSpeed's Universal Checkpoint format (see :func:`_universal_checkpoint_dir`)
    and loaded from there: the trained parameters (from their fp32 master copies), AdamW's moments
    and step, the optimizer's param-group settings and the LR scheduler state are all restored.

    Raises:
        FileNotFoundError: the directory is not a training checkpoint.
        IncompleteCheckpointError: its ``train_state.json`` is cut off or malformed (named).
        RuntimeError: resuming with another worker count and the universal conversion failed.
    """
    import ray.train

    from .checkpoints import parse_train_state

    state_file = os.path.join(checkpoint_dir, "train_state.json")
    if not os.path.isfile(state_file):
        raise FileNotFoundError(f"no train_state.json in {checkpoint_dir}: not a training checkpoint")
    with open(state_file, "rb") as fh:
        state = parse_train_state(fh.read(), state_file)
    world = ray.train.get_context().get_world_size()
    kwargs = dict(tag="state", load_optimizer_states=True, load_lr_scheduler_states=True)
    if state["world_size"] == world or not engine.zero_optimization():
        path, _ = engine.load_checkpoint(os.path.join(checkpoint_dir, "deepspeed"), **kwargs)
    else:
        path = _load_universal(engine, checkpoint_dir, kwargs)
    if path is None:
        raise FileNotFoundError(f"DeepSpeed state missing under {checkpoint_dir}/deepspeed")
    logger.info("resumed at step %d (saved with %d workers, now %d)", state["step"],
                state["world_size"], world)
    return int(state["step"])


def _load_universal(engine, checkpoint_dir: str, load_kwargs: dict) -> str | None:
    """Load the checkpoint's DeepSpeed state through a universal conversion (all workers call
    this together); returns ``engine.load_checkpoint``'s load path."""
    import torch.distributed as dist

    load_dir, own_tmp = _universal_checkpoint_dir(checkpoint_dir, load_kwargs["tag"])
    # DeepSpeed 0.19 reads this config field (the "checkpoint": {"load_universal": true} key) on
    # every load_checkpoint call; set it for this load only so later loads stay the regular kind
    cfg = engine._config
    previous = cfg.load_universal_checkpoint
    cfg.load_universal_checkpoint = True
    try:
        path, _ = engine.load_checkpoint(load_dir, **load_kwargs)
    finally:
        cfg.load_universal_checkpoint = previous
        dist.barrier()  # the node's converted copy is read by all its workers before it goes
        if own_tmp is not None:
            shutil.rmtree(own_tmp, ignore_errors=True)
    return path


def _universal_checkpoint_dir(checkpoint_dir: str, tag: str) -> tuple[str, str | None]:
    """Convert the ZeRO checkpoint under ``checkpoint_dir/deepspeed/<tag>`` to DeepSpeed's Universal
    Checkpoint format (``deepspeed.checkpoint.ds_to_universal``), which can be loaded at any data
    parallel world size. The first worker of each node converts into a temporary directory that
    the node's other workers then read; returns ``(load_dir, own_tmp)``: the directory to pass to
    ``engine.load_checkpoint`` and the temporary directory this worker must delete afterwards
    (None on the workers that did not convert).

    Raises:
        RuntimeError: the conversion failed on some node (raised on every worker, so none is left
            waiting for the others).
    """
    from argparse import Namespace

    import ray.train
    import torch.distributed as dist

    ctx = ray.train.get_context()
    own_tmp, error = None, None
    if ctx.get_local_rank() == 0:
        own_tmp = tempfile.mkdtemp(prefix="ds_universal_")
        try:
            from deepspeed.checkpoint.ds_to_universal import main as ds_to_universal

            # single-process conversion (no process pools inside a Ray worker); our model has no
            # universal_checkpoint_info attribute, so let the converter inject the default one
            ds_to_universal(Namespace(
                input_folder=os.path.join(checkpoint_dir, "deepspeed", tag),
                output_folder=os.path.join(own_tmp, tag), num_extract_workers=1,
                num_merge_workers=1, keep_temp_folder=False, strict=True,
                inject_missing_state=True))
        except Exception as e:  # reported to every worker below
            logger.exception("universal checkpoint conversion of %s failed", checkpoint_dir)
            error = f"{type(e).__name__}: {e}"
    # exchanging the results also keeps every worker waiting until the conversions are done
    results = [None] * dist.get_world_size()
    dist.all_gather_object(results, (ctx.get_node_rank(), own_tmp, error))
    errors = [err for _, _, err in results if err]
    if errors:
        if own_tmp is not None:
            shutil.rmtree(own_tmp, ignore_errors=True)
        raise RuntimeError(f"converting the DeepSpeed state in {checkpoint_dir} to a universal "
                           f"checkpoint failed: {errors[0]}")
    node = ctx.get_node_rank()
    load_dir = next(path for n, path, _ in results if n == node and path is not None)
    return load_dir, own_tmp


def run_train(*, cache_dir: str, manifest: dict, out_dir: Path, target: str, layer_ids: list[int],
              drafter: DrafterSection, train: TrainConfig, wandb_cfg: dict,
              storage_options: dict, run_name: str) -> dict:
    """Launch the trainer; copy the final drafter to ``out_dir/drafter``.

    Raises:
        ValueError: the cache holds too few rows for one optimizer step.
        IncompleteCheckpointError: ``train.resume_from`` names a checkpoint directory that is
            missing or that some rank did not finish writing (``pipeline/checkpoints.py``).
        TrainingFailedError: training failed (the workers' errors in the message).
    """
    from ray.train import CheckpointConfig, FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    from . import storage
    from .checkpoints import latest_checkpoint, require_complete
    from .tracking import log_drafter_artifact, open_run, run_id

    rows = manifest["splits"]["train"]["rows"]
    if train.init_from and not storage.is_url(train.init_from):  # named now, not by each worker
        from drafters.loading import check_checkpoint

        check_checkpoint(storage.resolve(train.init_from))
    if train.verify_cache:  # a damaged shard is named now, before any worker starts
        from .cache import verify_shard

        for split, info in manifest["splits"].items():
            for shard in info.get("shards", []):
                verify_shard(cache_dir, split, shard, storage_options)
    per_epoch = steps_per_epoch(rows, train.global_batch_size)
    if per_epoch < 1:
        raise ValueError(f"the cache has {rows} training rows: fewer than one global batch "
                         f"({train.global_batch_size})")
    draft_vocab, vocab_report = select_draft_vocab(manifest, drafter.draft_vocab_size)
    total = per_epoch * train.num_epochs
    if train.max_steps:
        total = min(total, train.max_steps)
    storage_path = (storage.resolve(train.storage_path) if train.storage_path
                    else str((out_dir / "ray_train").resolve()))
    storage.check_writable(storage_path, storage_options)  # a bad bucket or path fails now
    resume = None
    if train.resume_from == "latest":  # the newest complete one; incomplete ones are logged
        resume = latest_checkpoint(storage_path, run_name, storage_options)
        logger.info("resuming from %s", resume) if resume else logger.info(
            "train.resume_from is 'latest' but no complete checkpoint exists yet: starting at "
            "step 0")
    elif train.resume_from:
        resume = storage.resolve(train.resume_from)
        require_complete(resume, storage_options)
    else:  # an explicit fresh start: Ray Train would otherwise restore the run's old state
        fs = storage.get_fsspec(storage_path, storage_options)
        if fs.exists(storage.join(storage_path, run_name)):
            fs.rm(storage.join(storage_path, run_name), recursive=True)
    wandb_dir = out_dir / "wandb"
    wandb_dir.mkdir(parents=True, exist_ok=True)
    loop_cfg = {
        "train": train.model_dump(), "drafter": drafter.model_dump(), "target": target,
        "layer_ids": layer_ids,
        "hidden_size": manifest["target"]["hidden_size"], "total_steps": total,
        "steps_per_epoch": per_epoch, "cache_dir": cache_dir, "manifest": manifest,
        "storage_options": storage_options, "resume_from": resume,
        "storage_path": storage_path,
        "init_from": storage.resolve(train.init_from) if train.init_from else None,
        "wandb": wandb_cfg, "wandb_dir": str(wandb_dir), "run_name": run_name,
        "draft_vocab": draft_vocab, "wandb_run_id": run_id(out_dir.parent),
        "torch_extensions_dir": os.environ.get(
            "TORCH_EXTENSIONS_DIR", str(Path.home() / ".cache" / "dspark_ray" / "torch_extensions")),
    }
    train_fs, train_fs_path = storage.get_arrow_fs(storage_path, storage_options)
    resources = {"CPU": train.cpus_per_worker}
    if train.use_gpu:
        resources["GPU"] = 1
    trainer = TorchTrainer(
        train_loop_per_worker, train_loop_config=loop_cfg,
        scaling_config=ScalingConfig(num_workers=train.num_workers, use_gpu=train.use_gpu,
                                     resources_per_worker=resources,
                                     placement_strategy=train.placement_strategy),
        run_config=RunConfig(
            # our filesystem object, so s3fs options (a custom endpoint, keys) reach Ray Train,
            # whose own s3:// parsing would ignore them
            name=run_name, storage_path=train_fs_path, storage_filesystem=train_fs,
            failure_config=FailureConfig(max_failures=train.max_failures),
            checkpoint_config=CheckpointConfig(num_to_keep=train.num_to_keep)),
    )
    logger.info("training %d optimizer steps (%d per epoch) on %d rows", total, per_epoch, rows)
    try:
        result = trainer.fit()
    except Exception as err:  # Ray Train's WorkerGroupError carries the workers' tracebacks
        raise TrainingFailedError(f"training failed: {err}") from err
    if result.error is not None:
        raise TrainingFailedError(f"training failed: {result.error}") from result.error
    with result.checkpoint.as_directory() as ckpt:
        dest = out_dir / "drafter"
        if dest.exists():
            shutil.rmtree(dest)
        shutil.copytree(Path(ckpt) / "drafter", dest)
    run = open_run(wandb_cfg, out_dir.parent, run_name, "train")
    if run is not None:  # the trained drafter as a model artifact of the run directory's W&B run
        log_drafter_artifact(run, dest, f"drafter-{run_name}", {"steps": total,
                                                                "target": target})
        run.finish()
    if vocab_report:
        (dest / "draft_vocab.json").write_text(json.dumps(vocab_report, indent=1))
    # fewer than planned when training stopped at the held-out plateau
    steps = int((result.metrics or {}).get("step", total))
    return {"steps": steps, "rows": rows, "metrics": result.metrics or {}, "resumed_from": resume,
            "checkpoint": result.checkpoint.path, "draft_vocab": vocab_report}


def select_draft_vocab(manifest: dict, size: int) -> tuple[list[int] | None, dict]:
    """The top-``size`` target ids of the cache's supervised-token ranking (train split) and a
    report of their coverage per split (share of supervised tokens inside the subset).

    Returns:
        (draft vocabulary, most frequent first, or None for ``size`` 0; the report dict).
    Raises:
        ValueError: ``size`` exceeds the vocabulary, or the cache predates token counting.
    """
    from drafters.draft_vocab import coverage, frequency_ranking

    if not size:
        return None, {}
    vocab = manifest["target"]["vocab_size"]
    if size > vocab:
        raise ValueError(f"drafter.draft_vocab_size {size} exceeds the target vocabulary ({vocab})")
    splits = manifest["splits"]
    if "token_frequency" not in splits["train"]:
        raise ValueError("the cache manifest has no token_frequency (written by an older version): "
                         "re-run the cache stage (--force cache) to use drafter.draft_vocab_size")
    counts = {name: {t: c for t, c in sp.get("token_frequency", [])} for name, sp in splits.items()}
    ids = frequency_ranking(counts["train"], vocab)[:size]
    report = {"draft_vocab_size": size,
              "coverage": {name: round(coverage(c, ids), 5) for name, c in counts.items()}}
    logger.info("draft vocabulary: top %d of %d target tokens, supervised-token coverage %s",
                size, vocab, report["coverage"])
    return ids, report
