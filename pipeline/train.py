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

logger = logging.getLogger(__name__)


def build_drafter_config(target_config, target_name: str, layer_ids: list[int], drafter: dict):
    """The drafter's config from the target's dimensions and the ``drafter`` config section."""
    from drafters.config import DSparkConfig

    tc = target_config
    return DSparkConfig(
        drafter_type=drafter["drafter_type"], target_name_or_path=target_name,
        target_vocab_size=tc.vocab_size, target_hidden_size=tc.hidden_size,
        target_layer_ids=layer_ids, block_size=drafter["block_size"],
        num_hidden_layers=drafter["num_layers"], hidden_size=tc.hidden_size,
        num_attention_heads=tc.num_attention_heads,
        num_key_value_heads=getattr(tc, "num_key_value_heads", None) or tc.num_attention_heads,
        head_dim=getattr(tc, "head_dim", None) or tc.hidden_size // tc.num_attention_heads,
        intermediate_size=tc.intermediate_size, rms_norm_eps=tc.rms_norm_eps,
        rope_theta=_rope_theta(tc), max_position_embeddings=tc.max_position_embeddings,
        head_type=drafter["head_type"], markov_rank=drafter["markov_rank"],
        confidence_head=drafter["confidence_head"], loss_decay=drafter["loss_decay"],
        qk_norm=getattr(tc, "model_type", "") in ("qwen3", "qwen3_moe"))


def _rope_theta(tc) -> float:
    params = getattr(tc, "rope_parameters", None) or {}
    return float(params.get("rope_theta") or getattr(tc, "rope_theta", 10000.0))


def load_frozen_head(target_name: str):
    """(target config, embedding [V, H], LM head [V, H]) of the target, fp32 on CPU."""
    from .target import load_target

    model = load_target(target_name, "float32")
    emb = model.get_input_embeddings().weight.detach().clone()
    head = model.get_output_embeddings().weight.detach().clone()
    return model.config, emb, head


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
    accum = tc["global_batch_size"] // (tc["micro_batch_size"] * world_size)
    cfg = {
        "train_batch_size": tc["global_batch_size"],
        "train_micro_batch_size_per_gpu": tc["micro_batch_size"],
        "gradient_accumulation_steps": accum,
        "gradient_clipping": tc["grad_clip"],
        "zero_optimization": {"stage": tc["zero_stage"]},
        "optimizer": {"type": "AdamW", "params": {"lr": tc["lr"], "betas": [0.9, 0.95],
                                                  "eps": 1e-8, "weight_decay": tc["weight_decay"],
                                                  "torch_adam": True}},
        "steps_per_print": 10**9,
    }
    # bf16 runs as autocast around the forward (train_loop_per_worker): the weights, gradients and
    # optimizer state stay fp32 (SPEC 3: bf16 with fp32 master weights) on CPU and GPU alike
    return cfg


def steps_per_epoch(rows: int, tc: dict) -> int:
    """Optimizer steps in one epoch when every worker gets an equal share of ``rows``."""
    per_worker = rows // tc["num_workers"]
    micro_steps = per_worker // tc["micro_batch_size"]
    accum = tc["global_batch_size"] // (tc["micro_batch_size"] * tc["num_workers"])
    return micro_steps // accum


def train_loop_per_worker(loop_cfg: dict) -> None:
    """Ray Train worker: builds the drafter, wraps it in DeepSpeed, streams the cache shard."""
    os.environ.setdefault("TORCH_EXTENSIONS_DIR", loop_cfg["torch_extensions_dir"])
    # wandb writes only under the run directory and stays quiet (offline mode opens no connection)
    os.environ["WANDB_DIR"] = loop_cfg["wandb_dir"]
    os.environ["WANDB_SILENT"] = "true"
    import deepspeed
    import ray.train
    import torch
    from ray.train import Checkpoint

    from drafters.anchors import build_block_batch
    from drafters.losses import drafter_losses, position_weights
    from drafters.modeling import DSparkDrafter

    from .cache import decode_row

    tc = loop_cfg["train"]
    ctx = ray.train.get_context()
    rank, world = ctx.get_world_rank(), ctx.get_world_size()
    if tc["num_threads"]:
        torch.set_num_threads(tc["num_threads"])
    torch.manual_seed(tc["seed"])
    device = torch.device("cuda", ctx.get_local_rank()) if tc["use_gpu"] else torch.device("cpu")

    target_cfg, emb, head = load_frozen_head(loop_cfg["target"])
    dcfg = build_drafter_config(target_cfg, loop_cfg["target"], loop_cfg["layer_ids"],
                                loop_cfg["drafter"])
    model = DSparkDrafter(dcfg, emb, head).to(device)
    total_steps = loop_cfg["total_steps"]
    engine, _, _, _ = deepspeed.initialize(
        model=model, model_parameters=[p for p in model.parameters() if p.requires_grad],
        config=deepspeed_config(tc, world),
        lr_scheduler=lambda opt: torch.optim.lr_scheduler.LambdaLR(
            opt, lr_lambda(total_steps, tc["warmup_ratio"])))
    weights = position_weights(dcfg.block_size, dcfg.loss_decay).to(device)
    hidden, m = loop_cfg["hidden_size"], len(loop_cfg["layer_ids"])
    ce_only = dcfg.drafter_type == "dflash"
    bf16 = tc["precision"] == "bf16"
    gen = torch.Generator().manual_seed(tc["seed"] * 1000 + rank)

    run = None
    if rank == 0 and loop_cfg["wandb"]["mode"] != "disabled":
        import wandb

        run = wandb.init(project=loop_cfg["wandb"]["project"], entity=loop_cfg["wandb"]["entity"],
                         mode=loop_cfg["wandb"]["mode"], dir=loop_cfg["wandb_dir"],
                         config={"train": tc, "drafter": loop_cfg["drafter"]},
                         name=loop_cfg["run_name"])
    bar = None
    if rank == 0:
        from tqdm import tqdm

        bar = tqdm(total=total_steps, desc="train", unit="step", mininterval=5)

    shard = ray.train.get_dataset_shard("train")
    step, acc, last, history = 0, [], {}, []
    head_w = engine.module.lm_head_weight
    for epoch in range(tc["num_epochs"]):
        batches = shard.iter_batches(batch_size=tc["micro_batch_size"], batch_format="numpy",
                                     drop_last=True, local_shuffle_buffer_size=64,
                                     local_shuffle_seed=tc["seed"] + epoch)
        for batch in batches:
            samples = [decode_row({k: batch[k][i] for k in batch}, hidden, m)
                       for i in range(len(batch["num_tokens"]))]
            bb = build_block_batch(samples, tc["num_anchors"], dcfg.block_size, gen).to(device)
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16):
                h = engine(bb.context_features.float(), bb.anchor_positions, bb.anchor_tokens)
                n_blocks = h.shape[0] * h.shape[1]
                flat = lambda t: t.reshape(n_blocks, *t.shape[2:])
                logits, conf = engine.module.draft_logits(flat(h), flat(bb.prev_tokens))
                valid = flat(bb.label_valid) & flat(bb.anchor_valid[..., None].expand_as(bb.label_valid))
                with torch.no_grad():  # p_t from the cached O(H) state through the frozen LM head
                    target_logits = torch.zeros(logits.shape, device=device)
                    target_logits[valid] = torch.nn.functional.linear(
                        flat(bb.target_hidden)[valid].to(head_w.dtype), head_w).float()
            out = drafter_losses(logits, target_logits, flat(bb.labels), valid, weights, conf,
                                 tuple(tc["loss_weights"]), ce_only=ce_only)
            engine.backward(out["loss"])
            boundary = engine.is_gradient_accumulation_boundary()
            engine.step()
            acc.append(out)
            if not boundary:
                continue
            step += 1
            last = {
                "step": step, "epoch": epoch, "lr": engine.get_lr()[0],
                "loss": float(sum(o["loss"].detach() for o in acc) / len(acc)),
                "ce": float(sum(o["ce"] for o in acc) / len(acc)),
                "tv": float(sum(o["tv"] for o in acc) / len(acc)),
                "conf": float(sum(o["conf"] for o in acc) / len(acc)),
                "tau": float(sum(o["tau"] for o in acc) / len(acc)),
            }
            rates = sum(o["accept_rate"] for o in acc) / len(acc)
            last.update({f"accept_rate@{k + 1}": float(r) for k, r in enumerate(rates)})
            acc = []
            history.append(last)
            if rank == 0:
                if run is not None and step % tc["log_every"] == 0:
                    run.log(last, step=step)
                bar.update(1)
                bar.set_postfix(loss=f"{last['loss']:.3f}", tau=f"{last['tau']:.2f}")
            if step >= total_steps:
                break
        if step >= total_steps or epoch == tc["num_epochs"] - 1:
            break
    # final checkpoint: HF drafter directory (rank 0) + DeepSpeed training state (all ranks)
    with tempfile.TemporaryDirectory() as tmp:
        engine.save_checkpoint(os.path.join(tmp, "deepspeed"), tag=f"step{step}")
        if rank == 0:
            engine.module.save_pretrained(os.path.join(tmp, "drafter"))
            with open(os.path.join(tmp, "drafter", "training_log.jsonl"), "w") as fh:
                fh.writelines(json.dumps(h) + "\n" for h in history)
        ray.train.report(last or {"step": step}, checkpoint=Checkpoint.from_directory(tmp))
    if bar is not None:
        bar.close()
    if run is not None:
        run.finish()


def run_train(*, cache_dir: str, manifest: dict, out_dir: Path, target: str, layer_ids: list[int],
              drafter: dict, train: dict, wandb_cfg: dict, storage_options: dict,
              run_name: str) -> dict:
    """Launch the trainer; copy the final drafter to ``out_dir/drafter``.

    Raises:
        ValueError: the cache holds too few rows for one optimizer step.
        RuntimeError: training failed (Ray Train's error attached).
    """
    import ray
    from ray.train import RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    from . import storage

    rows = manifest["splits"]["train"]["rows"]
    per_epoch = steps_per_epoch(rows, train)
    if per_epoch < 1:
        raise ValueError(f"the cache has {rows} training rows: fewer than one global batch "
                         f"({train['global_batch_size']}) split over {train['num_workers']} workers")
    total = per_epoch * train["num_epochs"]
    if train["max_steps"]:
        total = min(total, train["max_steps"])
    # exactly the shards the manifest lists: stray files in the directory are never trained on
    split_dir = storage.join(cache_dir, "train")
    fs, base = storage.get_arrow_fs(split_dir, storage_options)
    files = [f"{base}/{s['file']}" for s in manifest["splits"]["train"]["shards"] if s["rows"]]
    ds = ray.data.read_parquet(files, filesystem=fs)
    wandb_dir = out_dir / "wandb"
    wandb_dir.mkdir(parents=True, exist_ok=True)
    loop_cfg = {
        "train": train, "drafter": drafter, "target": target, "layer_ids": layer_ids,
        "hidden_size": manifest["target"]["hidden_size"], "total_steps": total,
        "wandb": wandb_cfg, "wandb_dir": str(wandb_dir), "run_name": run_name,
        "torch_extensions_dir": os.environ.get(
            "TORCH_EXTENSIONS_DIR", str(Path.home() / ".cache" / "dspark_ray" / "torch_extensions")),
    }
    resources = {"CPU": train["cpus_per_worker"]}
    if train["use_gpu"]:
        resources["GPU"] = 1
    trainer = TorchTrainer(
        train_loop_per_worker, train_loop_config=loop_cfg,
        scaling_config=ScalingConfig(num_workers=train["num_workers"], use_gpu=train["use_gpu"],
                                     resources_per_worker=resources),
        datasets={"train": ds},
        run_config=RunConfig(name=run_name, storage_path=str((out_dir / "ray_train").resolve())),
    )
    logger.info("training %d optimizer steps (%d per epoch) on %d rows", total, per_epoch, rows)
    result = trainer.fit()
    if result.error is not None:
        raise RuntimeError(f"training failed: {result.error}") from result.error
    with result.checkpoint.as_directory() as ckpt:
        dest = out_dir / "drafter"
        if dest.exists():
            shutil.rmtree(dest)
        shutil.copytree(Path(ckpt) / "drafter", dest)
    return {"steps": total, "rows": rows, "metrics": result.metrics or {},
            "checkpoint": result.checkpoint.path}
