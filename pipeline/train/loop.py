"""Train stage, the Ray Train worker's loop: one :class:`WorkerLoop` per worker builds the
drafter from the driver's :class:`~pipeline.train.job.TrainJob`, wraps it in DeepSpeed and trains
on its slice of every global batch of the target cache (SPEC section 3).

Workers receive only O(H) hidden states from the cache; target probabilities are recomputed on the
worker from ``last_hidden`` through the frozen LM head and only at supervised rows (never V-sized
tensors in the cache or on the wire). The driver is ``pipeline/train/driver.py``; a step's pieces
``pipeline/train/worker.py``; checkpoints ``pipeline/train/state.py``.
"""

from __future__ import annotations

import logging
import os
import time

from tqdm import tqdm

from drafters.loading import build_drafter
from drafters.target_weights import final_logit_softcap, load_frozen_head

from .data import plateau_reached, row_generator
from .job import TrainJob
from .sources import CachedRows, StreamedRows
from .state import load_training_log, load_training_state, resume_checkpoint, save_training_state
from .worker import (
    NonFiniteLossError,
    batch_losses,
    deepspeed_config,
    finite_on_all_workers,
    init_weights,
    load_deepspeed_cpu_comm_op,
    lr_lambda,
    reduce_metrics,
    skip_update,
    target_head,
    zero_loss,
)

logger = logging.getLogger(__name__)


def train_loop_per_worker(loop_config: dict) -> None:
    """Ray Train worker: builds the drafter, wraps it in DeepSpeed, trains on its slice of every
    global batch, evaluates on the held-out split every ``eval_every`` steps, checkpoints every
    ``checkpoint_every`` steps, and resumes from the run's checkpoint when there is one.

    Args:
        loop_config: ``{"job": TrainJob}`` (Ray Train hands the loop a dict), the driver's
            :class:`~pipeline.train.job.TrainJob`.
    """
    job: TrainJob = loop_config["job"]
    loop = WorkerLoop(job)
    try:
        loop.run()
    except BaseException:
        loop.close(failed=True)  # the run's own error is what propagates
        raise
    loop.close()


class WorkerLoop:
    """One training worker's run, in the three pieces a reader follows: :meth:`__init__` sets up
    (process, drafter under DeepSpeed, data, restored state, tracking), :meth:`train_step` runs
    one optimizer step over this worker's micro-batches, :meth:`record_step` records it (skipped
    updates, metrics, held-out evaluation, the plateau, logging, checkpoints)."""

    def __init__(self, job: TrainJob):
        os.environ.setdefault("TORCH_EXTENSIONS_DIR", job.torch_extensions_dir)
        # wandb writes only under the run directory and stays quiet (offline mode opens no
        # connection)
        os.environ["WANDB_DIR"] = job.wandb_dir
        os.environ["WANDB_SILENT"] = "true"
        import ray.train
        import torch

        self.job, tc = job, job.train
        ctx = ray.train.get_context()
        self.rank, self.world = ctx.get_world_rank(), ctx.get_world_size()
        if tc.num_threads:
            torch.set_num_threads(tc.num_threads)
        torch.manual_seed(tc.seed)
        self.device = (torch.device("cuda", ctx.get_local_rank()) if tc.use_gpu
                       else torch.device("cpu"))
        target_cfg = self._build_engine()
        self.data = self._open_data()
        self.step, self.history = 0, []
        self._restore()
        self.total_steps = job.total_steps
        if self.history and self.history[-1].get("plateau"):  # a finished run
            self.total_steps = self.step
        # hybrid's streamed first epoch ends at stop_step (checkpointed); the LR schedule stays
        # the whole run's
        self.end_step = min(self.total_steps, job.stop_step or self.total_steps)
        if self.history and self.step >= self.end_step:  # nothing left: report it once
            self.checkpoint(self.history[-1])
        self.skipped = self.history[-1].get("skipped_steps", 0) if self.history else 0
        self.bad_in_a_row = 0
        self.run_log, self.bar = self._open_tracking()
        # the frozen LM head cast once (and soft-capped as the target's forward is), its buffer
        # reused
        self.head = target_head(self.engine, tc, final_logit_softcap(target_cfg))

    # ------------------------------------------------------------------ set-up
    def _build_engine(self):
        """The drafter (from the target's layers, an ``init_from`` checkpoint or random) under
        DeepSpeed, its objective and position weights; returns the target's HF config."""
        import deepspeed
        import torch

        job, tc, dsec = self.job, self.job.train, self.job.drafter
        from_target = dsec.init == "target_layers"
        target_cfg, emb, head, *top = load_frozen_head(
            job.target, dsec.num_hidden_layers if from_target else 0)
        dcfg = dsec.for_target(target_cfg, job.target, list(job.layer_ids))
        model = build_drafter(dcfg, emb, head,
                              list(job.draft_vocab) if job.draft_vocab is not None else None)
        if from_target and not job.init_from and not job.checkpoints.resume_from:
            model.init_from_target(*top[0])
        if job.init_from:
            init_weights(model, job.init_from)
        if not tc.use_gpu:
            load_deepspeed_cpu_comm_op(os.environ["TORCH_EXTENSIONS_DIR"])
        self.engine, _, _, _ = deepspeed.initialize(
            model=model.to(self.device),
            model_parameters=[p for p in model.parameters() if p.requires_grad],
            config=deepspeed_config(tc, self.world),
            lr_scheduler=lambda opt: torch.optim.lr_scheduler.LambdaLR(
                opt, lr_lambda(job.total_steps, tc.warmup_ratio)))
        self.block_size = dcfg.block_size
        self.objective, weights = dcfg.spec.training_objective(dcfg, tc.objective)
        self.weights = weights.to(self.device)
        return target_cfg

    def _open_data(self):
        """This worker's rows: streamed from the feature actors (online, hybrid's first epoch)
        or read from the cache shards."""
        job, tc = self.job, self.job.train
        eval_rows = tc.eval_rows if tc.eval_every else None
        h, m = job.target_hidden_size, job.num_context_layers
        if job.streamed:
            return StreamedRows(h, m, eval_rows if job.streamed_heldout else None, self.rank,
                                self.world, job.manifest["splits"]["train"]["rows"])
        return CachedRows(job.cache_dir, job.manifest, job.checkpoints.storage_options, h, m,
                          eval_rows, self.rank, self.world)

    def _restore(self) -> None:
        """Continue from the run's checkpoint, if any: weights, optimizer, schedule, the log and
        the data position."""
        restored = resume_checkpoint(self.job.checkpoints)
        self.resumes = 0
        if restored is None:
            return
        with restored.as_directory() as ckpt_dir:
            self.step = load_training_state(self.engine, ckpt_dir)
            self.history = load_training_log(ckpt_dir, self.step)
            self.data.restore(ckpt_dir)
        # times this run continued from a checkpoint (a worker-group restart or a resume)
        self.resumes = self.history[-1].get("resumes", 0) + 1 if self.history else 0

    def _open_tracking(self):
        """Rank 0's W&B run (one per run directory; resumes and later stages log into it,
        ``pipeline/tracking.py``) and progress bar; (None, None) elsewhere."""
        if self.rank != 0:
            return None, None

        job, run = self.job, None
        if job.wandb["mode"] != "disabled":
            import wandb

            manifest = job.manifest
            run = wandb.init(
                project=job.wandb["project"], entity=job.wandb["entity"],
                mode=job.wandb["mode"], dir=job.wandb_dir, id=job.wandb_run_id, resume="allow",
                job_type="train", name=job.checkpoints.run_name,
                config={"train": job.train.model_dump(), "drafter": job.drafter.model_dump(),
                        "target": job.target, "layer_ids": list(job.layer_ids),
                        "cache_manifest": {k: manifest.get(k) for k in (
                            "target", "layer_ids", "splits", "max_length", "template_sha256",
                            "draft_vocab_coverage")},
                        "draft_vocab_size": job.drafter.draft_vocab_size})
        bar = tqdm(total=self.total_steps, initial=self.step, desc="train", unit="step",
                   mininterval=5)
        return run, bar

    # ------------------------------------------------------------------ the loop
    def run(self) -> None:
        """Train from the restored step to the end step (or the held-out plateau)."""
        # every micro-batch this worker will read, in order (the offline reader works ahead of
        # the loop without changing what a step sees, pipeline/train/data.py)
        self.stream = self.data.micro_batches(self.step, self.end_step, self.job.steps_per_epoch,
                                              self.job.train)
        while self.step < self.end_step:
            epoch = self.step // self.job.steps_per_epoch
            outs, bad, waited = self.train_step()
            self.step += 1
            self.record_step(epoch, outs, bad, waited)

    def train_step(self) -> tuple[list[dict], bool, float]:
        """One optimizer step over this worker's micro-batches of the global batch.

        Returns:
            (the finite micro-batches' loss dicts, whether some worker's loss was non-finite
            (the update is then skipped on all), seconds spent waiting for data).
        """
        tc = self.job.train
        outs, bad, waited = [], False, 0.0
        for _ in range(tc.global_batch_size // self.world // tc.micro_batch_size):
            t0 = time.perf_counter()
            keys, samples = next(self.stream)
            waited += time.perf_counter() - t0
            gens = [row_generator(tc.seed, e, k) for e, k in keys]
            out = batch_losses(self.engine, samples, tc, self.objective, self.weights,
                               self.device, gens, self.head)
            loss = out["loss"]
            if not finite_on_all_workers(loss, self.device):
                # every worker still runs backward and step, so DeepSpeed's gradient all-reduce
                # stays in lock-step; the zero loss adds nothing to the accumulated gradients
                bad, loss = True, zero_loss(self.engine)
            else:
                outs.append(out)
            self.engine.backward(loss)
            if bad and self.engine.is_gradient_accumulation_boundary():
                skip_update(self.engine)
            self.engine.step()
        return outs, bad, waited

    def record_step(self, epoch: int, outs: list[dict], bad: bool, waited: float) -> None:
        """Record the step just taken: count a skipped update (too many in a row raise
        :class:`NonFiniteLossError`), reduce its metrics over the workers, evaluate on the
        held-out split when due, stop at the plateau, log, and checkpoint when due."""
        tc, step = self.job.train, self.step
        self._count_bad(bad)
        # data_wait_s: this worker's time waiting for its micro-batches (reader or stream)
        last = {"step": step, "epoch": epoch, "lr": self.engine.get_lr()[0],
                "skipped_steps": self.skipped, "data_wait_s": round(waited, 4),
                "resumes": self.resumes,
                **reduce_metrics(outs, self.block_size, device=self.device)}
        if self.data.has_heldout and (step % tc.eval_every == 0 or step == self.total_steps):
            last.update(self.heldout_metrics())
        self.history.append(last)
        if plateau_reached(self.history, tc.plateau_patience, tc.plateau_min_delta):
            last["plateau"] = True  # recorded in the log: a re-run does not train on
            logger.info("step %d: held-out tau has not improved by %.3f for %d evaluations: "
                        "stopping at the plateau", step, tc.plateau_min_delta,
                        tc.plateau_patience)
            self.total_steps = self.end_step = step
        if self.rank == 0:
            if self.run_log is not None and (step % tc.log_every == 0 or step == self.total_steps):
                self.run_log.log(last, step=step)
            self.bar.update(1)
            self.bar.set_postfix(loss=f"{last['loss']:.3f}", tau=f"{last['tau']:.2f}")
        if step == self.end_step or (tc.checkpoint_every and step % tc.checkpoint_every == 0):
            self.checkpoint(last)

    def _count_bad(self, bad: bool) -> None:
        if not bad:
            self.bad_in_a_row = 0
            return
        self.skipped, self.bad_in_a_row = self.skipped + 1, self.bad_in_a_row + 1
        logger.warning("step %d: non-finite loss on some worker, update skipped (%d in a row, "
                       "%d in all)", self.step, self.bad_in_a_row, self.skipped)
        if self.bad_in_a_row > self.job.train.max_bad_steps:
            raise NonFiniteLossError(
                f"{self.bad_in_a_row} consecutive optimizer steps (last: {self.step}) had a "
                f"non-finite loss, more than train.max_bad_steps = "
                f"{self.job.train.max_bad_steps}: check the cache for NaN/inf features and the "
                "learning rate; the checkpoints written before are intact")

    def heldout_metrics(self) -> dict:
        """The held-out split's metrics (``heldout_`` keys), reduced over the workers."""
        import torch

        tc = self.job.train
        self.engine.eval()
        outs = []
        with torch.no_grad():
            for keys, samples in self.data.heldout_batches(tc.micro_batch_size):
                gens = [row_generator(tc.seed, e, k) for e, k in keys]
                outs.append(batch_losses(self.engine, samples, tc, self.objective, self.weights,
                                         self.device, gens, self.head))
        self.engine.train()
        return reduce_metrics(outs, self.block_size, prefix="heldout_", device=self.device)

    def checkpoint(self, metrics: dict) -> None:
        """A checkpoint of the current step (all workers together)."""
        save_training_state(self.engine, self.step, self.world, self.history, metrics,
                            self.job.checkpoints, extra_files=self.data.checkpoint_files())

    def close(self, failed: bool = False) -> None:
        """Stop the data readers and close the progress bar and the W&B run (marked failed,
        exit code 1, after an error). After an error, a failure while closing is logged, not
        raised, so the run's own error is the one reported."""
        steps = [getattr(getattr(self, "stream", None), "close", None),
                 getattr(getattr(self, "data", None), "close", None),
                 getattr(getattr(self, "bar", None), "close", None)]
        if getattr(self, "run_log", None) is not None:
            steps.append(lambda: self.run_log.finish(exit_code=1 if failed else 0))
        for step in steps:
            if step is None:
                continue
            if not failed:
                step()
                continue
            try:
                step()
            except Exception:  # noqa: BLE001 - the run's own error is the one to report
                logger.exception("closing a failed training worker")
