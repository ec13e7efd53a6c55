"""Anchor sampling and teacher-forced block batches (SPEC section 3; DSpark paper section 5.1).

For each sequence, up to ``num_anchors`` distinct positions p with loss_mask[p] = loss_mask[p+1] = 1
are sampled. Slot j of the block at p predicts x_{p+1+j}; it is supervised only while every earlier
slot of the block is supervised (the supervised prefix of the block). The target distribution of
slot j is softmax(LM_head(last_hidden[p+j])), recomputed from the cached O(H) state.

Shapes: B sequences, T max length, A max anchors, K = gamma, H hidden, m target layers.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


def valid_anchor_positions(loss_mask: torch.Tensor) -> torch.Tensor:
    """Positions p with loss_mask[p] = loss_mask[p+1] = 1: bool/uint8 [T] -> int64 [P]."""
    m = loss_mask.bool()
    return torch.nonzero(m[:-1] & m[1:]).flatten()


def sample_anchors(loss_mask: torch.Tensor, num_anchors: int,
                   generator: torch.Generator | None = None) -> torch.Tensor:
    """Sample up to ``num_anchors`` distinct valid anchor positions, ascending: int64 [A']."""
    candidates = valid_anchor_positions(loss_mask)
    if candidates.numel() > num_anchors:
        pick = torch.randperm(candidates.numel(), generator=generator)[:num_anchors]
        candidates = candidates[pick]
    return candidates.sort().values


def supervised_slots(loss_mask: torch.Tensor, anchors: torch.Tensor, block_size: int) -> torch.Tensor:
    """Which slots of each block are supervised: bool [A, K].

    Slot j (predicting x_{p+1+j}) is supervised iff positions p+1..p+1+j all lie inside the
    sequence and carry loss_mask = 1.
    """
    t = loss_mask.numel()
    target_pos = anchors[:, None] + 1 + torch.arange(block_size)  # [A, K]
    inside = target_pos < t
    ok = inside & loss_mask.bool()[target_pos.clamp(max=t - 1)]
    return ok.int().cumprod(dim=1).bool()


@dataclass
class BlockBatch:
    """A padded batch of teacher-forced blocks.

    context_features: [B, T, m*H] target layer features; anchor_positions / anchor_tokens: int64
    [B, A] (padding anchors sit at 0 with anchor_valid False); prev_tokens: int64 [B, A, K], x_{k-1}
    of each slot; labels: int64 [B, A, K], x_{p+1+j}; label_valid: bool [B, A, K];
    target_hidden: [B, A, K, H], last_hidden[p+j] (zeros where not supervised).
    """

    context_features: torch.Tensor
    anchor_positions: torch.Tensor
    anchor_tokens: torch.Tensor
    anchor_valid: torch.Tensor
    prev_tokens: torch.Tensor
    labels: torch.Tensor
    label_valid: torch.Tensor
    target_hidden: torch.Tensor

    def to(self, device) -> "BlockBatch":
        return BlockBatch(**{k: v.to(device) for k, v in self.__dict__.items()})


def build_block_batch(samples: list[dict], num_anchors: int, block_size: int,
                      generator: torch.Generator | None = None) -> BlockBatch:
    """Sample anchors for each sequence and gather labels and target states.

    Args:
        samples: dicts with ``input_ids`` int64 [T_i], ``loss_mask`` [T_i],
            ``context_hidden`` [T_i, m*H], ``last_hidden`` [T_i, H] (any float dtype).
        num_anchors: cap on anchors per sequence (SPEC default 512).
        block_size: gamma.
    Raises:
        ValueError: empty ``samples`` or a sample without any valid anchor.
    """
    if not samples:
        raise ValueError("build_block_batch needs at least one sample")
    b, k = len(samples), block_size
    t_max = max(s["input_ids"].numel() for s in samples)
    anchors = []
    for i, s in enumerate(samples):
        a = sample_anchors(s["loss_mask"], num_anchors, generator)
        if a.numel() == 0:
            raise ValueError(f"sample {s.get('sample_id', i)!r} has no position with "
                             "loss_mask[p] = loss_mask[p+1] = 1")
        anchors.append(a)
    a_max = max(a.numel() for a in anchors)
    feat = samples[0]["context_hidden"]
    hid = samples[0]["last_hidden"]
    out = BlockBatch(
        context_features=torch.zeros(b, t_max, feat.shape[-1], dtype=feat.dtype),
        anchor_positions=torch.zeros(b, a_max, dtype=torch.long),
        anchor_tokens=torch.zeros(b, a_max, dtype=torch.long),
        anchor_valid=torch.zeros(b, a_max, dtype=torch.bool),
        prev_tokens=torch.zeros(b, a_max, k, dtype=torch.long),
        labels=torch.zeros(b, a_max, k, dtype=torch.long),
        label_valid=torch.zeros(b, a_max, k, dtype=torch.bool),
        target_hidden=torch.zeros(b, a_max, k, hid.shape[-1], dtype=hid.dtype),
    )
    slot = torch.arange(k)
    for i, (s, a) in enumerate(zip(samples, anchors)):
        ids, t, n = s["input_ids"].long(), s["input_ids"].numel(), a.numel()
        out.context_features[i, :t] = s["context_hidden"]
        out.anchor_positions[i, :n] = a
        out.anchor_tokens[i, :n] = ids[a]
        out.anchor_valid[i, :n] = True
        valid = supervised_slots(s["loss_mask"], a, k)  # [n, K]
        src = (a[:, None] + slot).clamp(max=t - 1)  # p + j: state predicting x_{p+1+j}
        out.prev_tokens[i, :n] = ids[src]
        out.labels[i, :n] = ids[(src + 1).clamp(max=t - 1)]
        out.label_valid[i, :n] = valid
        out.target_hidden[i, :n] = s["last_hidden"][src] * valid[..., None].to(hid.dtype)
    return out
