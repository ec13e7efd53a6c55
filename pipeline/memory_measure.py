"""Peak device memory of one training micro-batch, measured: PyTorch's
``torch.distributed._tools.mem_tracker.MemTracker`` (a ``TorchDispatchMode`` that counts every
tensor storage once while it lives) around the real training step
(:func:`pipeline.train.worker.batch_losses`, then backward), at reduced shapes on real tensors
(``tests/unit/test_train_memory.py``) or at full shapes on fake ones (:func:`fake_floats`,
:func:`measure_config_peak_fake`; ``tests/integration/test_train_memory_qwen3_4b.py``). The
analytic model these check is ``pipeline/memory.py``.

Units: bytes throughout.
"""

from __future__ import annotations

from contextlib import ExitStack
from dataclasses import dataclass

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map_only

from drafters.loading import build_drafter

from .memory import (
    MemoryEstimate,
    StepShape,
    bound_drafter_config,
    check_modelled,
    estimate_step_memory,
)
from .train.worker import batch_losses, target_head, uses_bf16


@dataclass
class MeasuredPeak:
    """Peak bytes of the device tensors alive during one measured micro-batch.

    Attributes:
        peak: bytes at the peak (the input samples excluded: they are host memory in training).
        by_kind: MemTracker's categories at the peak (``Parameter``, ``Buffer``, ``Gradient``,
            ``Optstate``, ``Activation``, ``Temp``), bytes.
        in_backward: the peak was reached during backward.
        shape: the micro-batch's sizes.
    """

    peak: int
    by_kind: dict[str, int]
    in_backward: bool
    shape: StepShape

    @property
    def model_states(self) -> int:
        """Parameters, gradients and optimizer state at the peak (bytes)."""
        return sum(self.by_kind.get(k, 0) for k in ("Parameter", "Gradient", "Optstate"))

    @property
    def activations(self) -> int:
        """Everything else except the frozen buffers (bytes)."""
        return self.peak - self.model_states - self.by_kind.get("Buffer", 0)


def measure_step_peak(model, samples: list[dict], tc, objective: str, weights, generators,
                      optimizer=None) -> MeasuredPeak:
    """Run one training micro-batch (:func:`pipeline.train.worker.batch_losses`, then backward) under
    PyTorch's ``MemTracker`` and return the peak bytes of live tensors.

    Every tensor storage is counted once from its allocation to its release (views share it).
    The model's parameters, buffers and existing gradients and the optimizer's state are counted
    from the start, so a model that already took a step (gradients kept, as between the
    micro-batches of one optimizer step) measures the steady state. The samples are host memory
    in training and are left out. Works on any device the model is on (CPU in the unit tests).

    Args:
        model: the bare drafter (``drafters.loading.build_drafter``), in train mode.
        samples: cache rows as :func:`pipeline.train.worker.batch_losses` takes them.
        tc: the ``TrainConfig`` (micro-batch, anchors, precision, loss_chunk_rows).
        objective, weights: the spec's ``training_objective`` (with ``tc.objective``).
        generators: one anchor-sampling ``torch.Generator`` per sample (copied, not consumed).
        optimizer: counted with its state when given (it is not stepped).
    Returns:
        a :class:`MeasuredPeak`.
    """
    from torch.distributed._tools.mem_tracker import MemTracker

    device = next(model.parameters()).device
    copies = lambda: [torch.Generator().set_state(g.get_state()) for g in generators]
    shape = StepShape.of_packed(model.pack_blocks(samples, tc.num_anchors, copies()))
    # the worker's head, as in training: made once, its buffer already sized by earlier steps
    head = target_head(model, tc)
    head.reserve(min(shape.supervised_rows, tc.loss_chunk_rows))

    class _Step(torch.nn.Module):
        # MemTracker attributes memory to modules and refuses a second top-level call of one
        # module (batch_losses calls the drafter's heads once per loss chunk): one root module
        # around the whole step keeps every call inside it
        def __init__(self):
            super().__init__()
            self.drafter = model

        def forward(self):
            return batch_losses(self.drafter, samples, tc, objective, weights, device, copies(),
                                head)

    step = _Step()
    tracker = MemTracker()
    tracker.track_external(model, *([optimizer] if optimizer is not None else []))
    sample_tensors = [t for s in samples for t in s.values() if isinstance(t, torch.Tensor)]
    tracker.track_external(*sample_tensors)
    # counted below with the frozen tensors (a head used uncast is the model's own buffer)
    tracker.track_external(*([head.weight] if head.copied else []), head.buffer)
    with tracker:
        out = step()
        forward_peak = _total(tracker.get_tracker_snapshot("peak"), device)
        out["loss"].backward()
        del out
    snap = tracker.get_tracker_snapshot("peak")
    by_kind = {str(getattr(kind, "value", kind)): int(b)
               for kind, b in snap.get(device, {}).items()}
    other = by_kind.pop("Other", 0)
    total = by_kind.pop("Total", 0)
    # the head's tensors are no module's buffers (MemTracker files them under "Other"): counted
    # with the frozen target tensors, as the model counts them
    held = head.owned_bytes()
    by_kind["Buffer"] = by_kind.get("Buffer", 0) + held
    return MeasuredPeak(peak=total - other + held, by_kind=by_kind,
                        in_backward=total > forward_peak, shape=shape)


def _total(snapshot: dict, device) -> int:
    return int(snapshot.get(device, {}).get("Total", 0))


def fake_floats() -> ExitStack:
    """A context in which floating-point tensors are ``FakeTensor``s (shape, dtype and a CPU
    device, no storage) while integer and bool tensors (token ids, masks, offsets, indices) stay
    real: the real training step runs at full shapes without allocating, data-dependent control
    flow (``.tolist()``, boolean-mask indexing) still works, autocast applies as on CPU, and
    ``MemTracker`` counts the fake tensors' bytes.

    Rules (:class:`FakeFloatsMode`): an op with only real tensor inputs runs for real; a factory
    (no tensor input) makes a fake tensor when its result is floating, a real one otherwise; an
    op with a fake input runs fake, its real inputs converted (boolean masks first turned into
    their real indices, so the result's shape is known). ``.item()`` of a fake tensor reads 1
    (only initialisation statistics such as the embedding's std ask for one). A ``MemTracker``
    entered inside the context counts real and fake tensors alike, so a measurement equals the
    one with real tensors (``tests/unit/test_train_memory.py``).

    Returns:
        the entered context (an ``ExitStack``); use as ``with fake_floats(): ...``.
    """
    from torch._subclasses.fake_tensor import FakeTensorMode

    stack = ExitStack()
    fake = stack.enter_context(FakeTensorMode(allow_non_fake_inputs=True))
    stack.enter_context(FakeFloatsMode(fake))
    return stack


class FakeFloatsMode(TorchDispatchMode):
    """The dispatch rules of :func:`fake_floats` (on top of its ``FakeTensorMode``)."""

    _INDEX_OPS = (torch.ops.aten.index.Tensor, torch.ops.aten.index_put.default,
                  torch.ops.aten.index_put_.default, torch.ops.aten._index_put_impl_.default)

    def __init__(self, fake_mode):
        super().__init__()
        self.fake = fake_mode

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        from torch._subclasses.fake_tensor import FakeTensor, unset_fake_temporarily

        kwargs = kwargs or {}
        tensors = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
        if not any(isinstance(t, FakeTensor) for t in tensors):
            if tensors:  # real inputs only: a real result
                with unset_fake_temporarily():
                    return func(*args, **kwargs)
            out = func(*args, **kwargs)  # a factory: fake if floating, else real
            if all(o.is_floating_point() for o in tree_flatten(out)[0]
                   if isinstance(o, torch.Tensor)):
                return out
            with unset_fake_temporarily():
                return func(*args, **kwargs)
        if func is torch.ops.aten._local_scalar_dense.default:
            return 1.0 if args[0].is_floating_point() else 1
        if func in self._INDEX_OPS:  # boolean masks -> their real indices
            indices = []
            for i in args[1]:
                if (isinstance(i, torch.Tensor) and i.dtype == torch.bool
                        and not isinstance(i, FakeTensor)):
                    with unset_fake_temporarily():
                        indices.extend(i.nonzero().unbind(1))
                else:
                    indices.append(i)
            args = (args[0], indices, *args[2:])
        args, kwargs = tree_map_only(
            torch.Tensor, lambda t: t if isinstance(t, FakeTensor) else self.fake.from_tensor(t),
            (args, kwargs))
        return func(*args, **kwargs)


def measure_config_peak_fake(cfg, target_config, *, micro_batch_size: int | None = None,
                             max_length: int | None = None,
                             num_anchors: int | None = None) -> tuple[MeasuredPeak, MemoryEstimate]:
    """Measure one near-worst-case training micro-batch of a config at its real shapes on fake
    tensors (:func:`fake_floats`, :func:`measure_step_peak`), and the analytic model at the
    measured shape.

    The micro-batch: ``micro_batch_size`` sequences of ``max_length`` tokens, every token after
    the first supervised, ``num_anchors`` anchors each (defaults: the config's
    ``train.micro_batch_size``, ``cache.max_length``, ``train.num_anchors``); the drafter from
    the config with fp32 frozen tensors and gradients allocated (no optimizer state: its
    sharded size is the model's, :attr:`MemoryEstimate.optimizer`).

    Returns:
        (the measurement; :func:`estimate_step_memory` at the measured shape with the config's
        ZeRO stage and world size).
    Raises:
        NotImplementedError: an Eagle3 drafter, an RNN head or a draft vocabulary.
    """
    dcfg = bound_drafter_config(cfg, target_config)

    check_modelled(dcfg)
    if dcfg.draft_vocab_size:
        raise NotImplementedError("the fake-tensor measurement uses the full vocabulary")
    batch = micro_batch_size or cfg.train.micro_batch_size
    length = max_length or cfg.cache.max_length
    tc = cfg.train.model_copy(update={"num_anchors": num_anchors or cfg.train.num_anchors})
    tied = bool(getattr(target_config, "tie_word_embeddings", False))
    m_h = dcfg.num_context_layers * dcfg.target_hidden_size
    with fake_floats():
        emb = torch.empty(dcfg.target_vocab_size, dcfg.hidden_size)
        head = emb if tied else torch.empty_like(emb)
        model = build_drafter(dcfg, emb, head).train()
        for p in model.parameters():
            p.grad = torch.zeros_like(p)
        samples = []
        for _ in range(batch):
            mask = torch.ones(length, dtype=torch.uint8)
            mask[0] = 0
            samples.append({
                "input_ids": torch.randint(0, dcfg.target_vocab_size, (length,)),
                "loss_mask": mask,
                "context_hidden": torch.empty(length, m_h, dtype=torch.bfloat16),
                "last_hidden": torch.empty(length, dcfg.hidden_size, dtype=torch.bfloat16)})
        objective, weights = dcfg.spec.training_objective(dcfg, tc.objective)
        gens = [torch.Generator().manual_seed(i) for i in range(batch)]
        measured = measure_step_peak(model, samples, tc, objective, weights, gens)
    estimate = estimate_step_memory(
        dcfg, measured.shape, precision="bf16" if uses_bf16(tc) else "fp32", loss_chunk_rows=tc.loss_chunk_rows,
        world_size=tc.num_workers, zero_stage=tc.zero_stage, tied_embeddings=tied,
        deepspeed=True)
    return measured, estimate
