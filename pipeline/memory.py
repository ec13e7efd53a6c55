"""Peak device memory of one training micro-batch: the analytic model.

:func:`estimate_step_memory` adds up, tensor by tensor, what one training micro-step of the
DSpark/DFlash backbone (:func:`pipeline.train.worker.batch_losses`, then backward) keeps on the
device, as a function of the shapes only, so it is evaluated at full shapes without allocating
anything (``python -m pipeline.plan`` prints it for a config). ``pipeline/memory_measure.py``
measures the same step with PyTorch's ``MemTracker``, at reduced shapes on real tensors and at
full shapes on fake ones, against which ``tests/unit/test_train_memory.py`` and
``tests/integration/test_train_memory_qwen3_4b.py`` (a minute of CPU) check this model.

Where the memory goes (bf16 = autocast around the forward, fp32 weights, gradients and Adam state):

- **model states**: trainable parameters P (fp32, 4P bytes), their gradients (4P, kept across
  the micro-batches of one optimizer step), AdamW's two moments and DeepSpeed's fp32 master copy
  (12P, divided by the data-parallel world size from ZeRO stage 1 on) and DeepSpeed's gradient
  reduction buffers;
- **frozen target tensors**: the embedding and LM head [V, H] (one tensor when tied), in the dtype
  they were loaded in (``drafters.target_weights.load_frozen_head``: fp32), and the worker's
  :class:`pipeline.train.worker.TargetHead`: the LM head cast once to bf16 (under bf16) and its
  reused target-logits buffer [min(rows, chunk_rows), V];
- **activations** kept for backward: per block token (N blocks x S slots) and layer the norm
  inputs, the bf16 inputs of every projection, q/k/v and the MLP's [I]-wide tensors; per context
  row the projected context and each layer's context keys/values; per supervised row the final
  states and the cached target states; the bf16 copies of the layer weights that autocast made.
  The attention scores are not kept (``drafters.packing.packed_attention`` recomputes them);
- **the loss chunk**: ``drafters.losses.chunked_drafter_losses`` holds at most six fp32
  [chunk_rows, V] tensors at a time, when backward recomputes a chunk (target probabilities,
  draft logits, log-probabilities, probabilities, their difference and its absolute value).
  With a draft vocabulary of N tokens and all rows in one chunk nothing is recomputed: every
  supervised row keeps its target subset probabilities and the draft log-probabilities,
  probabilities and difference (16 B per [row, N] entry) from forward to backward.

The peak is the largest of four moments: the last decoder layer's attention in forward and in
backward (one chunk of recomputed scores on top of the kept activations), the last loss chunk of
the forward pass, and the backward of a loss chunk, recomputed or kept (the usual peak at GPU
shapes: every activation is still kept, plus the row gradients and the bf16 LM-head copy). Not modelled: the
CUDA caching allocator's rounding and fragmentation, the CUDA context, NCCL buffers and kernels'
workspaces; the 20 % headroom the memory test demands is meant for those.

Units: bytes throughout (GB = 10^9 bytes where printed).
Sources: the code paths named above; DeepSpeed 0.19 ``deepspeed/runtime/zero/stage_1_and_2.py``
(fp32 partition copy ``single_partition_of_fp32_groups``, the ``reduce_bucket_size`` gradient
bucket, default 5e8 elements, and the partition's gradient buffer); PyTorch autocast's op lists
(``aten/src/ATen/autocast_mode.cpp``: linear and matmul run in bf16, weights are cast once per
autocast region).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING

from drafters.dspark import DSparkDrafter
from serve.engine.target_loading import default_layer_ids

from .train.worker import uses_bf16

if TYPE_CHECKING:
    from drafters.config import BoundDrafterConfig
    from drafters.packing import PackedBlocks

FP32_BYTES = 4
BF16_BYTES = 2
INT64_BYTES = 8
DEEPSPEED_REDUCE_BUCKET_ELEMENTS = 500_000_000  # DeepSpeedZeroConfig.reduce_bucket_size default
ANCHOR_CHUNK = 64  # drafters.packing.packed_attention's default anchor_chunk
TARGET_SLICE_ROWS = 64  # drafters.losses.TARGET_SLICE_ROWS (this module does not import torch)
GB = 1e9


@dataclass(frozen=True)
class StepShape:
    """The sizes one packed micro-batch produces (``drafters.packing.pack_blocks``).

    Attributes:
        sequences: B, sequences in the micro-batch.
        blocks: N, packed blocks (anchors) over all sequences.
        context_rows: Nc, packed context rows (each sequence up to its last anchor).
        supervised_rows: R, supervised (block, slot) pairs, <= N * K.
        chunk_blocks: the most blocks one attention chunk holds (<= ``ANCHOR_CHUNK``).
        chunk_context_pairs: the most (block, context row) pairs one attention chunk scores:
            max over chunks of blocks x the rows its furthest anchor sees
            (``drafters.packing.packed_attention``).
    """

    sequences: int
    blocks: int
    context_rows: int
    supervised_rows: int
    chunk_blocks: int
    chunk_context_pairs: int

    @classmethod
    def worst_case(cls, micro_batch_size: int, max_length: int, num_anchors: int,
                   block_size: int) -> StepShape:
        """Every sequence at ``max_length`` tokens with ``num_anchors`` anchors, every slot
        supervised and every attention chunk seeing the whole sequence: an upper bound for any
        micro-batch of the config.

        Raises:
            ValueError: a non-positive size.
        """
        if min(micro_batch_size, max_length, num_anchors, block_size) < 1:
            raise ValueError("micro_batch_size, max_length, num_anchors and block_size must be "
                             ">= 1")
        anchors = min(num_anchors, max(1, max_length - 1))
        blocks = micro_batch_size * anchors
        chunk = min(ANCHOR_CHUNK, anchors)
        return cls(sequences=micro_batch_size, blocks=blocks,
                   context_rows=micro_batch_size * max_length,
                   supervised_rows=blocks * block_size, chunk_blocks=chunk,
                   chunk_context_pairs=chunk * max_length)

    @classmethod
    def of_packed(cls, packed: PackedBlocks) -> StepShape:
        """The exact sizes of a packed batch."""
        b_off = packed.block_offsets.tolist()
        anchors = packed.anchor_positions.tolist()
        chunk_blocks = pairs = 0
        for seq in range(len(b_off) - 1):  # packed_attention's chunks
            for start in range(b_off[seq], b_off[seq + 1], ANCHOR_CHUNK):
                end = min(start + ANCHOR_CHUNK, b_off[seq + 1])
                chunk_blocks = max(chunk_blocks, end - start)
                pairs = max(pairs, (end - start) * max(anchors[start:end]))
        return cls(sequences=packed.num_sequences, blocks=packed.num_blocks,
                   context_rows=int(packed.context_positions.numel()),
                   supervised_rows=int(packed.label_valid.sum()), chunk_blocks=chunk_blocks,
                   chunk_context_pairs=pairs)


@dataclass
class MemoryEstimate:
    """Peak device bytes of one micro-batch, by part (see the module docstring).

    Attributes:
        parameters, gradients, optimizer, deepspeed_buffers, frozen: model-state bytes, constant
            over the step.
        activations: the activation bytes at the peak moment (kept tensors plus that moment's
            transients).
        peak_moment: which moment peaks: ``"layer_forward"`` / ``"layer_backward"`` (the last
            decoder layer's attention) or ``"loss_forward"`` / ``"loss_backward"`` (a loss
            chunk).
        moments: activation bytes of every moment.
        parts: the kept-activation terms (bytes) summed into every moment.
        trainable_parameters: P.
    """

    parameters: int
    gradients: int
    optimizer: int
    deepspeed_buffers: int
    frozen: int
    activations: int
    peak_moment: str
    moments: dict[str, int] = field(default_factory=dict)
    parts: dict[str, int] = field(default_factory=dict)
    trainable_parameters: int = 0

    @property
    def model_states(self) -> int:
        """Parameters, gradients, optimizer state and DeepSpeed buffers (bytes)."""
        return self.parameters + self.gradients + self.optimizer + self.deepspeed_buffers

    @property
    def total(self) -> int:
        """The predicted peak (bytes)."""
        return self.model_states + self.frozen + self.activations

    def as_dict(self) -> dict:
        return {**asdict(self), "model_states": self.model_states, "total": self.total}


def check_modelled(cfg: BoundDrafterConfig) -> None:
    """Raises NotImplementedError: a drafter type whose model is not DSpark's backbone
    (``DSparkDrafter``, which DFlash's is), or an RNN head."""
    if not issubclass(cfg.spec.model_class, DSparkDrafter):
        raise NotImplementedError(f"the memory model covers the DSpark/DFlash backbone, not "
                                  f"{cfg.spec.title}")
    if cfg.head_type == "rnn":
        raise NotImplementedError("the memory model covers the Markov head (and no head), not "
                                  "the RNN head")


def drafter_parameter_count(cfg: BoundDrafterConfig) -> int:
    """Trainable parameters P of a DSpark/DFlash drafter (``drafters.dspark.DSparkDrafter``).

    Raises:
        NotImplementedError: an Eagle3 drafter or an RNN head.
    """
    check_modelled(cfg)
    h, hd, nh, nkv = cfg.hidden_size, cfg.head_dim, cfg.num_attention_heads, cfg.num_key_value_heads
    layer = (2 * h * nh * hd + 2 * h * nkv * hd + 3 * h * cfg.intermediate_size  # projections
             + 2 * h + (2 * hd if cfg.qk_norm else 0))  # norms
    m_h = cfg.num_context_layers * cfg.target_hidden_size
    total = cfg.num_hidden_layers * layer + h * m_h + 3 * h  # W_c, context norm, mask, final norm
    n = cfg.draft_vocab_len
    if cfg.head_type == "markov":
        n_in = n + 1 if cfg.draft_vocab_size else n
        total += n_in * cfg.options.markov_rank + cfg.options.markov_rank * n
    if cfg.confidence_head:
        total += h + cfg.options.markov_rank + 1
    return total


def estimate_step_memory(cfg: BoundDrafterConfig, shape: StepShape, *, precision: str = "bf16",
                         loss_chunk_rows: int = 1024, world_size: int = 1, zero_stage: int = 0,
                         tied_embeddings: bool = True, frozen_bytes: int = FP32_BYTES,
                         feature_bytes: int = BF16_BYTES,
                         deepspeed: bool = False) -> MemoryEstimate:
    """Predicted peak device memory of one training micro-batch (forward + backward).

    Args:
        cfg: the drafter's config (``DrafterConfig.for_target``).
        shape: the micro-batch's sizes (:class:`StepShape`).
        precision: ``"bf16"`` (autocast forward, fp32 weights) or ``"fp32"``.
        loss_chunk_rows: ``train.loss_chunk_rows``.
        world_size: data-parallel workers the optimizer state is sharded over (ZeRO >= 1).
        zero_stage: 0 (every worker holds all optimizer state), 1 (optimizer state sharded) or
            2 (gradients sharded too).
        tied_embeddings: the target's embedding and LM head are one tensor.
        frozen_bytes: bytes per element of the frozen embedding / LM head on the device.
        feature_bytes: bytes per element of the cached hidden states (bf16 cache: 2).
        deepspeed: add DeepSpeed's fp32 master copy and gradient-reduction buffers (a plain
            ``torch.optim.AdamW`` has neither).
    Returns:
        a :class:`MemoryEstimate` (bytes).
    Raises:
        ValueError: unknown precision or ZeRO stage, or a non-positive size.
        NotImplementedError: an Eagle3 drafter or an RNN head.
    """
    check_modelled(cfg)
    if precision not in ("bf16", "fp32"):
        raise ValueError(f"precision must be 'bf16' or 'fp32', got {precision!r}")
    if zero_stage not in (0, 1, 2):
        raise ValueError(f"zero_stage must be 0, 1 or 2, got {zero_stage}")
    if min(world_size, loss_chunk_rows, shape.blocks, shape.supervised_rows) < 1:
        raise ValueError("world_size, loss_chunk_rows, blocks and supervised_rows must be >= 1")
    cast = precision == "bf16"
    a = BF16_BYTES if cast else FP32_BYTES  # activation bytes of projection outputs
    f4 = FP32_BYTES
    h, hd, nh, nkv = cfg.hidden_size, cfg.head_dim, cfg.num_attention_heads, cfg.num_key_value_heads
    inter, layers = cfg.intermediate_size, cfg.num_hidden_layers
    m_h = cfg.num_context_layers * cfg.target_hidden_size
    k, s = cfg.block_size, cfg.num_block_inputs
    r = cfg.options.markov_rank if cfg.head_type == "markov" else 0
    conf = cfg.confidence_head
    v, vd = cfg.target_vocab_size, cfg.draft_vocab_len
    subset = bool(cfg.draft_vocab_size)
    n, nc, rows = shape.blocks, shape.context_rows, shape.supervised_rows
    tokens, slots = n * s, n * k
    chunk = min(loss_chunk_rows, rows)
    # chunked_drafter_losses keeps the draft side instead of recomputing it (one chunk, subset)
    keeps = subset and rows <= loss_chunk_rows
    qk = 8 * (nh + nkv) * hd if cfg.qk_norm else 0  # q/k RMSNorm: fp32 input copy + normalised

    # ---- model states
    p = drafter_parameter_count(cfg)
    params, grads = f4 * p, f4 * p
    shard = world_size if zero_stage >= 1 else 1
    adam = 2 * f4 * p  # exp_avg, exp_avg_sq
    master = f4 * p if deepspeed and zero_stage >= 1 else 0  # fp32 partition copy
    optimizer = (adam + master) // shard
    ds_buffers = 0
    if deepspeed and zero_stage >= 1:
        ds_buffers = f4 * min(p, DEEPSPEED_REDUCE_BUCKET_ELEMENTS) + f4 * p // world_size
    if zero_stage == 2:
        grads = f4 * p // world_size
    frozen = frozen_bytes * v * h * (1 if tied_embeddings else 2)
    if subset:
        frozen += frozen_bytes * vd * h + INT64_BYTES * (vd + v)  # lm_head[d2t] copy, d2t, t2d
    # the worker's TargetHead: its bf16 copy of the LM head and its target-logits buffer
    copied = cast and frozen_bytes != BF16_BYTES  # a bf16 head is used as it is
    frozen += ((BF16_BYTES * v * h if copied else 0)
               + (BF16_BYTES if cast else frozen_bytes) * chunk * v)

    # ---- activations kept for backward
    # per block token and layer, first half: the input RMSNorm (fp32 input + normalised, 8H),
    # the inputs of q/k/v (bf16: three autocast copies, 2H each; fp32: the norm output, 4H), the
    # q/k norms, q, k, v after RoPE; second half: the attention output, the post-attention norm,
    # the inputs of gate/up, and gate, silu, up and their product ([I] each)
    first_half = (8 * h + (3 * BF16_BYTES * h if cast else f4 * h) + qk
                  + a * (nh * hd + 2 * nkv * hd))
    second_half = (a * nh * hd + 8 * h + (2 * BF16_BYTES * h if cast else f4 * h)
                   + 4 * a * inter)
    per_token_layer = first_half + second_half
    rope = 2 * a * hd  # block RoPE cos/sin, shared by the layers
    # per context row: the projection's input (bf16 copy of the features, or their fp32 copy),
    # the context norm (8H) and its output, RoPE tables, and every layer's k norm, k and v
    per_context_row = ((BF16_BYTES if cast else f4) * m_h + 8 * h + a * h + 2 * a * hd
                       + layers * ((8 * nkv * hd if cfg.qk_norm else 0) + 2 * a * nkv * hd))
    # per block slot: the confidence head's input ([H + r], bf16 copy or the fp32 concatenation)
    per_slot = ((BF16_BYTES if cast else f4) * (h + r) if conf else 0)
    # per supervised row: final states (fp32), cached target states, head features, small
    # per-row tensors (labels, weights, l1, masks), with a draft vocabulary the target's subset
    # probabilities, and when the draft side is kept its log-probs, probs and difference and the
    # bf16 inputs of the draft head and W2
    per_row = (f4 * h + feature_bytes * h + f4 * r + 32 + (f4 * (vd + 1) if subset else 0)
               + ((3 * f4 * vd + (BF16_BYTES * (h + r) if cast else 0)) if keeps else 0))
    # autocast's bf16 copies of the layer weights, kept by the matmuls for backward
    weight_copies = (BF16_BYTES * layers * (2 * h * nh * hd + 2 * h * nkv * hd + 3 * h * inter)
                     if cast else 0)
    parts = {"block_inputs": tokens * (layers * per_token_layer + rope + 8 * h),  # + final norm
             "context_rows": nc * per_context_row, "block_slots": slots * per_slot,
             "supervised_rows": rows * per_row, "weight_copies": weight_copies}
    kept = sum(parts.values())
    # the packed batch on the device, alive during the forward pass
    packed = (nc * (feature_bytes * m_h + 2 * INT64_BYTES)
              + slots * (feature_bytes * h + 2 * INT64_BYTES + 1) + n * 2 * INT64_BYTES)
    autocast_cache = BF16_BYTES * (h * m_h + vd * r + (h + r + 1 if conf else 0)) if cast else 0

    # ---- moments 1 and 2: the last decoder layer's attention, forward and backward. Kept: the
    # layers below, the last layer's first half, the context rows and weight copies; in forward
    # also the packed batch and the output buffer being filled, in backward the gradients of the
    # residual (fp32) and of the attention output. The largest chunk of a anchors scores
    # E = nh * S * a * (ctx + S) entries; computing it peaks at ~12.6 B per entry in forward and,
    # recomputed for backward with its gradients, at ~12.8 B (bf16) / ~17.2 B (fp32): measured
    # with drafters.packing._attend_chunk under torch.utils.checkpoint on CPU (the one
    # calibrated number of this model; the tests' long-context shape checks it).
    chunk_entries = nh * s * (shape.chunk_context_pairs + shape.chunk_blocks * s)
    below = (tokens * ((layers - 1) * per_token_layer + first_half + rope)
             + parts["context_rows"] + weight_copies)
    layer_fwd = below + packed + autocast_cache + a * nh * hd * tokens + 12.6 * chunk_entries
    layer_bwd = (below + (f4 * h + a * nh * hd) * tokens
                 + (12.8 if cast else 17.2) * chunk_entries)
    # ---- moment 3: the last loss chunk of the forward pass. Also alive: the packed batch, the
    # final norm's output [N, S, H] fp32, head features, autocast's other weight copies, and the
    # chunk: target probabilities + draft logits, log-probs, |p_d - p_t| and its input (20 B per
    # [c, V_d] entry; with a draft vocabulary the kept ones are counted per row, leaving the
    # logits and |p_d - p_t|), or the target side alone (its logits are in the TargetHead's
    # buffer, counted as frozen; one slice of them in fp32 with its log-sum-exp's exponentials,
    # and the fp32 probabilities: [c, V], or the subset's [c, V_d], counted per row)
    draft_chunk = f4 * (2 if keeps else 4 if subset else 5) * chunk * vd
    target_chunk = ((2 if cast else 1) * f4 * min(chunk, TARGET_SLICE_ROWS) * v
                    + (0 if subset else f4 * chunk * v))
    # the draft LM head rows [V_d, H] are not a leaf, so autocast does not cache their bf16 copy:
    # each chunk makes one, and a kept chunk keeps it for backward
    head_copy = BF16_BYTES * vd * h if cast and keeps else 0
    fwd_loss = max(draft_chunk + head_copy, target_chunk)
    loss_fwd = (kept + packed + autocast_cache + f4 * h * tokens + f4 * (r + 1) * slots
                + fwd_loss)
    # ---- moment 4: backward of a loss chunk. Also alive: the gradients of the final states and
    # head features (once a first chunk is done), autocast's bf16 copies of the draft LM head
    # [V_d, H] and of W2 [V_d, r], and the chunk: recomputed (target probabilities, draft
    # logits, log-probs, probs, their difference and its absolute value: 24 B per [c, V] entry;
    # 20 B with a draft vocabulary, whose subset probabilities are counted per row), or kept (a
    # draft vocabulary and one chunk: counted per row) plus the gradient flowing through it,
    # while each kept tensor is freed as its node runs (4 B per [c, V_d] entry)
    row_grads = f4 * (h + r) * rows if rows > chunk else 0
    loss_bwd = (kept + row_grads + (BF16_BYTES * vd * (h + r) if cast else 0)
                + f4 * (1 if keeps else 5 if subset else 6) * chunk * vd)
    moments = {"layer_forward": int(layer_fwd), "layer_backward": int(layer_bwd),
               "loss_forward": loss_fwd, "loss_backward": loss_bwd}
    peak_moment = max(moments, key=moments.get)
    return MemoryEstimate(parameters=params, gradients=grads, optimizer=optimizer,
                          deepspeed_buffers=ds_buffers, frozen=frozen,
                          activations=moments[peak_moment], peak_moment=peak_moment,
                          moments=moments, parts=parts, trainable_parameters=p)


def estimate_for_config(cfg, target_config) -> MemoryEstimate:
    """The worst-case micro-batch memory of a pipeline config's training stage, per worker.

    Args:
        cfg: a validated ``pipeline.config.PipelineConfig``.
        target_config: the target's Hugging Face config (``AutoConfig``), or any object with its
            attributes (hidden_size, vocab_size, num_hidden_layers, num_attention_heads, ...).
    Returns:
        :func:`estimate_step_memory` of :meth:`StepShape.worst_case` with DeepSpeed's ZeRO
        stage and world size from ``cfg.train`` and the frozen tensors in fp32, as
        ``drafters.target_weights.load_frozen_head`` loads them.
    Raises:
        NotImplementedError: an Eagle3 drafter or an RNN head.
    """
    dcfg = bound_drafter_config(cfg, target_config)
    tc = cfg.train
    shape = StepShape.worst_case(tc.micro_batch_size, cfg.cache.max_length, tc.num_anchors,
                                 dcfg.block_size)
    return estimate_step_memory(
        dcfg, shape, precision="bf16" if uses_bf16(tc, probe=False) else "fp32", loss_chunk_rows=tc.loss_chunk_rows,
        world_size=tc.num_workers, zero_stage=tc.zero_stage,
        tied_embeddings=bool(getattr(target_config, "tie_word_embeddings", False)),
        frozen_bytes=FP32_BYTES, deepspeed=True)


def bound_drafter_config(cfg, target_config) -> BoundDrafterConfig:
    """The drafter a pipeline config trains, bound to its target (layer ids as the cache stage
    picks them)."""
    layer_ids = cfg.target.layer_ids or default_layer_ids(target_config.num_hidden_layers,
                                                          cfg.target.num_context_layers)
    return cfg.drafter.for_target(target_config, cfg.target.name_or_path, layer_ids)


@dataclass
class StreamBudget:
    """What online / hybrid training (``train.data_mode``) asks of the feature stream and the
    object store (host memory, not device memory). Bytes, tokens and seconds.

    Attributes:
        bytes_in_flight: the object store's streamed features at most: the back-pressure cap
            ``train.stream_object_store_gib`` plus, per trainer, the rows it holds outside it
            (``prefetch_batches`` 2 micro-batches, the one in use, and the local shuffle buffer
            ``train.stream_shuffle_rows``), for samples of ``tokens_per_sample``.
        forward_tokens: target-forward tokens of the whole run (every epoch recomputes them
            online; hybrid and offline compute each once).
        extra_forward_tokens: the forwards online adds over the cache (``num_epochs - 1``
            epochs' worth); 0 for hybrid and offline.
        feature_tokens_per_s_needed: the producer rate that keeps every trainer busy, given the
            seconds of one optimizer step (None when not given).
        epoch_forward_s: one epoch's features at the given producer rate (None when not given).
    """

    bytes_in_flight: float
    forward_tokens: float
    extra_forward_tokens: float
    feature_tokens_per_s_needed: float | None
    epoch_forward_s: float | None


def stream_budget(cfg, train_rows: int, tokens_per_sample: float, bytes_per_token: int,
                  step_s: float | None = None, feature_tokens_per_s: float | None = None
                  ) -> StreamBudget:
    """The :class:`StreamBudget` of a pipeline config.

    Args:
        cfg: a validated ``pipeline.config.PipelineConfig``.
        train_rows: training samples per epoch; tokens_per_sample: their mean length.
        bytes_per_token: streamed bytes per token (the cache's, ``pipeline.plan.bytes_per_token``).
        step_s: measured seconds per optimizer step of the trainers (``benchmarks/
            train_throughput.py``), for the producer rate needed; feature_tokens_per_s: the
            target actors' forward tokens/s together, for the time per epoch.
    """
    tc = cfg.train
    row = tokens_per_sample * bytes_per_token
    held = tc.num_workers * ((2 + 1) * tc.micro_batch_size + tc.stream_shuffle_rows) * row
    epoch_tokens = train_rows * tokens_per_sample
    epochs = tc.num_epochs
    if tc.max_steps:
        epochs = min(epochs, tc.max_steps * tc.global_batch_size / max(train_rows, 1))
    forward = epoch_tokens * (epochs if tc.data_mode == "online" else 1)
    extra = epoch_tokens * max(epochs - 1, 0) if tc.data_mode == "online" else 0.0
    needed = tc.global_batch_size * tokens_per_sample / step_s if step_s else None
    per_epoch = epoch_tokens / feature_tokens_per_s if feature_tokens_per_s else None
    return StreamBudget(tc.stream_object_store_gib * 2**30 + held, forward, extra, needed,
                        per_epoch)
