"""Training fits (issue 11): the analytic peak-memory model of one micro-batch
(``pipeline/memory.py``) against peaks measured with PyTorch's MemTracker at reduced shapes, and
the model at the qwen3_4b config's shapes against 80 GB with 20 % headroom."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from drafters.config import BoundDrafterConfig
from drafters.loading import build_drafter
from pipeline.config import TrainConfig, load_config
from pipeline.memory import (GB, StepShape, drafter_parameter_count, estimate_for_config,
                             estimate_step_memory)
from pipeline.memory_measure import measure_step_peak

# Qwen/Qwen3-4B's config.json (the fields the drafter and the memory model read)
QWEN3_4B = SimpleNamespace(
    model_type="qwen3", hidden_size=2560, vocab_size=151936, num_hidden_layers=36,
    num_attention_heads=32, num_key_value_heads=8, head_dim=128, intermediate_size=9728,
    rms_norm_eps=1e-6, rope_theta=1_000_000.0, max_position_embeddings=40960,
    tie_word_embeddings=True)
DEVICE_BYTES = 80 * GB  # an 80 GB accelerator (H100 / A100 80GB)
HEADROOM = 0.2
TOLERANCE = 0.15

# reduced shapes: hidden H, heads, kv heads, head dim, MLP width I, layers, vocabulary V,
# sequence length T, sequences B, anchors A, loss chunk rows, drafter kind, precision,
# draft vocabulary (0 = full), tied embeddings
SHAPES = {
    "dspark_bf16": dict(h=96, nh=4, nkv=2, hd=24, inter=288, layers=2, vocab=4096, seq=160,
                        batch=2, anchors=40, chunk=64, kind="dspark", precision="bf16",
                        subset=0, tied=True),
    # long context, small vocabulary: the last layer's attention chunk comes close to the loss
    "dflash_bf16_draft_vocab": dict(h=64, nh=4, nkv=1, hd=16, inter=256, layers=3, vocab=2048,
                                    seq=384, batch=1, anchors=96, chunk=96, kind="dflash",
                                    precision="bf16", subset=512, tied=False),
    # a draft vocabulary and several loss chunks: each recomputed in backward
    "dspark_bf16_draft_vocab_loss": dict(h=64, nh=4, nkv=2, hd=16, inter=192, layers=2,
                                         vocab=8192, seq=128, batch=2, anchors=32, chunk=48,
                                         kind="dspark", precision="bf16", subset=2048,
                                         tied=True),
    # a draft vocabulary and one loss chunk (the reference config's micro-batch): the draft side
    # is kept for backward, not recomputed
    "dspark_bf16_draft_vocab_one_chunk": dict(h=96, nh=4, nkv=2, hd=24, inter=192, layers=2,
                                              vocab=8192, seq=128, batch=2, anchors=32,
                                              chunk=1024, kind="dspark", precision="bf16",
                                              subset=4096, tied=True),
    "dspark_fp32": dict(h=64, nh=2, nkv=2, hd=32, inter=192, layers=2, vocab=2048, seq=128,
                        batch=2, anchors=32, chunk=48, kind="dspark", precision="fp32",
                        subset=0, tied=True),
}


def _drafter_config(p: dict) -> BoundDrafterConfig:
    """The drafter, written as the flat config.json fields a checkpoint records."""
    dspark = p["kind"] == "dspark"
    return BoundDrafterConfig.from_json_dict(dict(
        drafter_type=p["kind"], target_name_or_path="tiny", target_vocab_size=p["vocab"],
        target_hidden_size=p["h"], target_layer_ids=[1, 3, 5], block_size=7,
        num_hidden_layers=p["layers"], hidden_size=p["h"], num_attention_heads=p["nh"],
        num_key_value_heads=p["nkv"], head_dim=p["hd"], intermediate_size=p["inter"],
        rms_norm_eps=1e-6, rope_theta=10000.0, max_position_embeddings=4096,
        head_type="markov" if dspark else "none", markov_rank=16, confidence_head=dspark,
        qk_norm=True, draft_vocab_size=p["subset"]))


def _step(p: dict):
    """A drafter in its steady training state (gradients and AdamW moments allocated, as
    between the micro-batches of an optimizer step), one micro-batch of cache rows and the
    TrainConfig."""
    torch.manual_seed(0)
    cfg = _drafter_config(p)
    emb = torch.randn(p["vocab"], p["h"])
    head = emb if p["tied"] else torch.randn(p["vocab"], p["h"])
    subset = list(range(0, p["vocab"], p["vocab"] // p["subset"]))[:p["subset"]] if p["subset"] \
        else None
    model = build_drafter(cfg, emb, head, subset).train()
    params = [q for q in model.parameters() if q.requires_grad]
    for q in params:
        q.grad = torch.zeros_like(q)
    optimizer = torch.optim.AdamW(params, lr=1e-4)
    optimizer.step()  # allocates exp_avg and exp_avg_sq
    g = torch.Generator().manual_seed(1)
    samples = []
    for _ in range(p["batch"]):
        mask = torch.zeros(p["seq"], dtype=torch.uint8)
        mask[p["seq"] // 4:] = 1  # a prompt, then the answer
        samples.append({
            "input_ids": torch.randint(0, p["vocab"], (p["seq"],), generator=g),
            "loss_mask": mask,
            "context_hidden": torch.randn(p["seq"], 3 * p["h"], generator=g).bfloat16(),
            "last_hidden": torch.randn(p["seq"], p["h"], generator=g).bfloat16()})
    tc = TrainConfig(micro_batch_size=p["batch"], global_batch_size=p["batch"], num_workers=1,
                     num_anchors=p["anchors"], precision=p["precision"],
                     loss_chunk_rows=p["chunk"])
    return model, optimizer, samples, tc


def _measure_and_predict(p: dict):
    model, optimizer, samples, tc = _step(p)
    objective, weights = model.config.spec.training_objective(model.config)
    gens = [torch.Generator().manual_seed(10 + i) for i in range(len(samples))]
    measured = measure_step_peak(model, samples, tc, objective, weights, gens, optimizer)
    predicted = estimate_step_memory(model.config, measured.shape, precision=tc.precision,
                                     loss_chunk_rows=tc.loss_chunk_rows, tied_embeddings=p["tied"])
    return measured, predicted


@pytest.mark.parametrize("name", SHAPES)
def test_measured_peak_matches_the_model(name):
    p = SHAPES[name]
    measured, predicted = _measure_and_predict(p)
    shape = measured.shape
    # several loss chunks, as at GPU shapes, or one (CPU micro-batches)
    assert shape.supervised_rows > 2 * p["chunk"] or p["chunk"] >= shape.supervised_rows
    # the model's constant parts are exact
    assert predicted.parameters + predicted.gradients + predicted.optimizer == pytest.approx(
        measured.model_states, rel=1e-3)
    assert predicted.frozen == pytest.approx(measured.by_kind.get("Buffer", 0), rel=1e-2)
    # the activations, and with them the peak, within 15 %
    ratio = predicted.activations / measured.activations
    assert abs(ratio - 1) <= TOLERANCE, (name, predicted.peak_moment, predicted.moments,
                                          measured.activations)
    assert abs(predicted.total / measured.peak - 1) <= TOLERANCE
    # the peak comes in the phase the model says, where one moment clearly leads
    first, second = sorted(predicted.moments.values())[::-1][:2]
    if first > (1 + TOLERANCE) * second:
        assert measured.in_backward == predicted.peak_moment.endswith("backward")


def test_memory_model_catches_an_unchunked_loss(monkeypatch):
    """The comparison has teeth: a loss that keeps whole [rows, V] tensors for backward (no
    chunking, no recomputation) measures far above the chunked loss's prediction."""
    import drafters.losses as losses
    import pipeline.train.worker as worker  # the training step looks the loss up there

    def unchunked(draft_logits_fn, target_logits_fn, labels, valid, weights, *args, **kwargs):
        rows = torch.arange(int(valid.sum()))
        draft, target = draft_logits_fn(rows), target_logits_fn(rows).detach()
        kwargs.pop("chunk_rows", None)
        return chunked(lambda i: draft[i], lambda i: target[i], labels, valid, weights, *args,
                       chunk_rows=rows.numel(), **kwargs)

    chunked = losses.chunked_drafter_losses
    monkeypatch.setattr(worker, "chunked_drafter_losses", unchunked)
    measured, predicted = _measure_and_predict(SHAPES["dspark_bf16"])
    assert measured.activations > (1 + TOLERANCE) * predicted.activations


def test_the_model_s_constants_are_the_code_s():
    import inspect

    import pipeline.memory as memory
    from drafters.losses import TARGET_SLICE_ROWS
    from drafters.packing import packed_attention

    assert memory.TARGET_SLICE_ROWS == TARGET_SLICE_ROWS
    assert memory.ANCHOR_CHUNK == inspect.signature(packed_attention).parameters[
        "anchor_chunk"].default


def test_parameter_count_is_the_model_s():
    for p in SHAPES.values():
        cfg = _drafter_config(p)
        emb = torch.zeros(p["vocab"], p["h"])
        subset = list(range(p["subset"])) if p["subset"] else None
        assert drafter_parameter_count(cfg) == build_drafter(
            cfg, emb, emb, subset).num_trainable_parameters()


def test_qwen3_4b_micro_batch_fits_80gb_with_headroom():
    """infra/configs/qwen3_4b.yaml: 4 sequences of 4096 tokens, 512 anchors each, every slot
    supervised (the worst case), 5-layer DSpark with Markov and confidence heads, bf16 autocast,
    ZeRO-1 over 8 workers."""
    cfg = load_config("infra/configs/qwen3_4b.yaml")
    est = estimate_for_config(cfg, QWEN3_4B)
    # SPEC 2: a DSpark drafter for Qwen3-4B has 615 M trainable parameters
    assert round(est.trainable_parameters / 1e6) == 615
    assert est.total <= (1 - HEADROOM) * DEVICE_BYTES, est.as_dict()
    # what dominates: the backbone's kept activations, then the loss chunk in backward
    assert est.peak_moment == "loss_backward"
    assert est.parts["block_inputs"] > est.model_states


def test_worst_case_shape_bounds_a_packed_batch():
    from drafters.packing import pack_blocks

    p = SHAPES["dspark_bf16"]
    _, _, samples, tc = _step(p)
    packed = pack_blocks(samples, tc.num_anchors, 7, torch.Generator().manual_seed(0))
    real = StepShape.of_packed(packed)
    bound = StepShape.worst_case(p["batch"], p["seq"], p["anchors"], 7)
    for name in ("blocks", "context_rows", "supervised_rows", "chunk_blocks",
                 "chunk_context_pairs"):
        assert getattr(real, name) <= getattr(bound, name), name


def test_fake_tensor_measurement_equals_the_real_one():
    """pipeline.memory_measure.fake_floats, which lets the slow test run the step at the qwen3_4b shapes
    without allocating (tests/integration/test_train_memory_qwen3_4b.py), measures what real
    tensors measure."""
    from pipeline.memory_measure import fake_floats

    p = SHAPES["dspark_fp32"]
    real, _ = _measure_and_predict(p)
    with fake_floats():
        fake, _ = _measure_and_predict(p)
    assert fake.shape == real.shape
    assert (fake.peak, fake.by_kind, fake.in_backward) == (real.peak, real.by_kind,
                                                           real.in_backward)
